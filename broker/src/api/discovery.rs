//! `GET /.well-known/unyolo-agent`: what an Agent V1 client reads before anything else, to know
//! it speaks the same contract (by digest), which operations exist, and whether the broker's
//! credential is ready.

use axum::http::StatusCode;
use serde_json::json;

pub use super::contract::{API_VERSION, BUILD_ID, CONTRACT_DIGEST, OPERATOR_CONTRACT_DIGEST};
use super::error::{ApiResult, json_response};
use super::extract::Client;
use crate::registry::OPERATIONS;

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
    fn registered_operation_names_are_unique() {
        let mut names: Vec<&str> = OPERATIONS.iter().map(|(name, _)| *name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), OPERATIONS.len());
    }
}
