//! Which contracts this broker speaks and which build it is: the `api_version` of each wire
//! contract, the digest of each contract document, and the build id. Every answer that names its
//! contract (the Agent V1 descriptor and objects, the Operator V1 discovery and health) reads
//! them here, a leaf that imports nothing, so naming a contract never ties one handler's file to
//! another's.

/// The `api_version` of every Agent V1 object.
pub const API_VERSION: &str = "unyolo.io/agent/v1";

/// The digest of the Agent Operations V1 contract this broker implements.
pub const CONTRACT_DIGEST: &str =
    "sha256:bdc7fc2230ea7db9ede54305f2adcb3e3c21451056e58f9467fd5dbcc4a3ddc7";

/// The digest of the Operator V1 contract the operator listener implements (unYOLO's
/// `OperatorV1Digest`, recomputed from the vendored `tests/contract/operator-v1.yaml` by
/// `tests/operator_contract.rs`).
pub const OPERATOR_CONTRACT_DIGEST: &str =
    "sha256:ab10778e2838f660157b000e442a1b97c5217fd92e66107122451b6894f0b9d3";

/// The crate version and the commit it was built from (`unknown` outside git), e.g.
/// `0.1.0+0b792bf`.
pub const BUILD_ID: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "+",
    env!("ADMISSION_BUILD_COMMIT")
);

/// The `api_version` of Operator V1.
pub const OPERATOR_API_VERSION: &str = "unyolo.io/operator/v1";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_id_is_the_crate_version_and_a_commit() {
        let (version, commit) = BUILD_ID.split_once('+').unwrap();
        assert_eq!(version, env!("CARGO_PKG_VERSION"));
        assert!(commit == "unknown" || commit.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!((1..=128).contains(&BUILD_ID.len()));
    }
}
