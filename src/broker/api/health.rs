//! Health and metrics: `/healthz` (alive), `/readyz` (the store takes writes) and `/metrics`
//! (operator; OpenMetrics text).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::{ApiError, ApiResult, json_response};
use super::extract::Operator;
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

pub(crate) async fn metrics(State(core): State<Arc<Core>>, _operator: Operator) -> ApiResult {
    let ready = tokio::time::timeout(READY_DEADLINE, core.db.ping()).await;
    core.store_ready.set(i64::from(matches!(ready, Ok(Ok(())))));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &core.registry).map_err(|_| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "Metrics could not be encoded.",
        )
    })?;
    Ok((
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
