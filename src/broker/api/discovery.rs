//! `GET /.well-known/unyolo-agent`: what an Agent V1 client reads before anything else, to know
//! it speaks the same contract (by digest), which operations exist, and whether the broker's
//! credential is ready.

use axum::http::StatusCode;
use serde_json::json;

use super::error::{ApiResult, json_response};
use super::extract::Client;
use crate::broker::registry::OPERATIONS;

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

/// The descriptor. The demo operations act on nothing outside the broker, so there is no
/// upstream credential to hold: it is always ready, of provider `demo` and kind `none`, never
/// rotated (generation 0), with nothing to verify.
pub(crate) async fn descriptor(_client: Client) -> ApiResult {
    let operations: Vec<&str> = OPERATIONS.iter().map(|(name, _)| *name).collect();
    Ok(json_response(
        StatusCode::OK,
        json!({
            "api_version": API_VERSION,
            "contract_digest": CONTRACT_DIGEST,
            "build_id": BUILD_ID,
            "operations": operations,
            "credential": {
                "ready": true,
                "provider": "demo",
                "credential_kind": "none",
                "generation": 0,
                "verification_state": "not_required",
            },
        }),
    ))
}

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

    #[test]
    fn registered_operation_names_are_unique() {
        let mut names: Vec<&str> = OPERATIONS.iter().map(|(name, _)| *name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), OPERATIONS.len());
    }
}
