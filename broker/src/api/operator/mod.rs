//! The operator listener's routes: unYOLO's **Operator V1** (discovery, health, readiness, the
//! request list, one request, decisions), `/metrics` and admission's own readings: drift
//! (`/admission/v1/drift`) and the shadow quota file's verdicts (`/admission/v1/shadow`). Nothing here is mounted on the agent listener.
//!
//! Every response carries `Cache-Control: no-store`, `X-Content-Type-Options: nosniff` and
//! `X-Correlation-ID` (22 characters, base64url of 16 random bytes), set by one layer
//! (`envelope`), which also writes every error's body with the same correlation id. Errors are
//! [`OperatorError`]s with codes from the contract's closed list only.
//!
//! Files: `error` (the envelope), `credential` (the operator a request's credential names),
//! `projection` (an operation as a `BrokerRequest`), `requests` (the list and one request),
//! `decisions` (approve, deny, revoke), `shadow` (the shadow file's verdicts).
//!
//! The order of checks is the contract's: route → path and query (400) → the operator's
//! credential (401) → the action (404) → the body (415, 400) → idempotency → lookup (404) →
//! revision (409) → transition (409) → constraints (409).

pub(super) mod credential;
pub mod decisions;
pub mod error;
pub(crate) mod projection;
pub mod requests;
pub(crate) mod shadow;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use serde_json::json;

use super::contract::BUILD_ID;
pub use super::contract::{OPERATOR_API_VERSION, OPERATOR_CONTRACT_DIGEST};
use super::error::json_response;
use crate::core::Core;
use credential::OperatorName;
pub use credential::presented_secret;
use error::{ErrorCode, Failure, OperatorError, OperatorResult};

/// The `X-Correlation-ID` header.
pub const CORRELATION_ID: HeaderName = HeaderName::from_static("x-correlation-id");

/// The operator's routes, with their state.
pub(crate) fn router(core: Arc<Core>) -> Router {
    Router::new()
        .route("/.well-known/unyolo-operator", get(discover))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/api/operator/v1/requests", get(requests::list))
        .route("/api/operator/v1/events", get(super::events::stream_events))
        .route("/api/operator/v1/requests/{id}", get(requests::get_one))
        .route(
            "/api/operator/v1/requests/{id}/{action}",
            post(decisions::decide),
        )
        .route("/metrics", get(metrics))
        .route("/admission/v1/drift", get(drift))
        .route("/admission/v1/shadow", get(shadow::shadow))
        .fallback(|| async { OperatorError::no_route() })
        .method_not_allowed_fallback(|| async {
            OperatorError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::MethodNotAllowed,
                "method not allowed",
            )
        })
        .layer(axum::middleware::from_fn(envelope))
        .with_state(core)
}

/// A fresh correlation id: base64url (no padding) of 16 random bytes, 22 characters.
pub(crate) fn new_correlation_id() -> Option<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).ok()?;
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// The layer around every operator route: a correlation id for the request (the response's
/// `X-Correlation-ID`), the error body with it, and the headers every
/// response carries. Without randomness there is no id to give: 503 `temporarily_unavailable`
/// with `X-Correlation-ID: unavailable`, as unYOLO's own server answers.
async fn envelope(request: Request, next: Next) -> Response {
    let (correlation_id, mut response) = match new_correlation_id() {
        Some(id) => (id, next.run(request).await),
        None => (
            "unavailable".to_owned(),
            OperatorError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::TemporarilyUnavailable,
                "secure request identifier unavailable",
            )
            .into_response(),
        ),
    };
    if let Some(failure) = response.extensions_mut().remove::<Failure>() {
        let (parts, _) = response.into_parts();
        let body = axum::Json(failure.body(&correlation_id)).into_response();
        let (body_parts, body) = body.into_parts();
        response = Response::from_parts(parts, body);
        if let Some(content_type) = body_parts.headers.get(header::CONTENT_TYPE) {
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, content_type.clone());
        }
    }
    let headers = response.headers_mut();
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if let Ok(value) = HeaderValue::from_str(&correlation_id) {
        headers.insert(CORRELATION_ID, value);
    }
    response
}

/// `{status, contract_digest, build_id}`.
fn health_body() -> serde_json::Value {
    json!({
        "status": "ok",
        "contract_digest": OPERATOR_CONTRACT_DIGEST,
        "build_id": BUILD_ID,
    })
}

/// `GET /.well-known/unyolo-operator` (operator): the contract this listener speaks.
async fn discover(_operator: OperatorName) -> OperatorResult {
    Ok(json_response(
        StatusCode::OK,
        json!({
            "api_version": OPERATOR_API_VERSION,
            "contract_digest": OPERATOR_CONTRACT_DIGEST,
            "build_id": BUILD_ID,
        }),
    ))
}

/// `GET /healthz` (no credential): alive.
async fn healthz() -> Response {
    json_response(StatusCode::OK, health_body())
}

/// `GET /readyz` (no credential): ready when the store would take a write
/// ([`Core::store_readiness`]), else 503 `temporarily_unavailable` (no Retry-After, as unYOLO's).
async fn readyz(State(core): State<Arc<Core>>) -> OperatorResult {
    match core.store_readiness().await {
        Ok(()) => Ok(json_response(StatusCode::OK, health_body())),
        _ => Err(OperatorError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::TemporarilyUnavailable,
            "operator source is not ready",
        )),
    }
}

/// `GET /metrics` (operator): OpenMetrics text.
async fn metrics(State(core): State<Arc<Core>>, _operator: OperatorName) -> OperatorResult {
    // (Sets `broker_store_ready` for this scrape; the answer is the gauge.)
    let _ = core.store_readiness().await;
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &core.registry).map_err(|_| {
        OperatorError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::InternalError,
            "operator request failed",
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

/// `GET /admission/v1/drift` (operator): compares the controller's counts with the store now
/// and answers the report, `{"drift": N, "differences": [...]}` (see
/// [`crate::DriftReport::to_json`]).
async fn drift(State(core): State<Arc<Core>>, _operator: OperatorName) -> OperatorResult {
    let report = crate::drift::check(&core).await?;
    Ok(json_response(StatusCode::OK, report.to_json()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correlation_ids_are_22_base64url_characters_and_differ() {
        let a = new_correlation_id().unwrap();
        let b = new_correlation_id().unwrap();
        assert_eq!(a.len(), 22);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_ne!(a, b);
    }
}
