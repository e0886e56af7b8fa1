//! The agent listener's health: `/healthz` (alive) and `/readyz` (the store takes writes).
//! `/metrics` is on the operator listener (`operator`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::json;

use super::error::{ApiError, ApiResult, json_response};
use crate::broker::core::Core;

pub(crate) async fn healthz() -> Response {
    json_response(StatusCode::OK, json!({"ok": true}))
}

/// How long `/readyz` waits for the store before answering 503.
const READY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Ready when the store would take a write within [`READY_DEADLINE`]; a broker that cannot make
/// a submission durable is taken out of rotation.
pub(crate) async fn readyz(State(core): State<Arc<Core>>) -> ApiResult {
    let answered = tokio::time::timeout(READY_DEADLINE, core.db.ping()).await;
    match answered {
        Ok(Ok(())) => Ok(json_response(StatusCode::OK, json!({"ready": true}))),
        _ => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "The operation store does not answer.",
        )),
    }
}
