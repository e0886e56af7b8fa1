//! The agent listener's health: `/healthz` (alive) and `/readyz` (the store takes writes).
//! `/metrics` is on the operator listener (`operator`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;

use super::error::{ApiError, ApiResult, json_response};
use crate::core::{Core, NotReady};

pub(crate) async fn healthz() -> Response {
    json_response(StatusCode::OK, json!({"ok": true}))
}

/// Ready when the store would take a write ([`Core::store_readiness`]: room on its disk, its
/// write lock within a deadline); a broker that cannot make a submission durable is taken out of
/// rotation. The reason's detail (paths, free bytes) is in the log, not in this unauthenticated
/// answer.
pub(crate) async fn readyz(State(core): State<Arc<Core>>) -> ApiResult {
    match core.store_readiness().await {
        Ok(()) => Ok(json_response(StatusCode::OK, json!({"ready": true}))),
        Err(why) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            match why {
                NotReady::NoRoom => "The operation store's disk has no room for a write.",
                NotReady::NoAnswer => "The operation store does not answer.",
            },
        )),
    }
}
