//! The Agent V1-compatible HTTP surface: the router and the pieces every route shares.
//!
//! A submission goes authenticate → validate → replay → admit → create → commit: nothing that can
//! be refused without admission (a bad token, a bad body, a replay) reaches the controller, and a
//! refusal writes nothing. Cancel, operator decisions, reads, `/healthz`, `/readyz` and `/metrics`
//! never call admission. Every error body is `{"error":{"code","message"}}` and every response
//! carries `Cache-Control: no-store`.
//!
//! Each mutating handler (submit, cancel, approve, deny, upload, delete) hands everything from its
//! decision on to a task of its own (`detached`, `transition_to_end`) and only waits for the
//! answer, so a client that hangs up cannot leave a change half made (the broker module's docs say
//! what is atomic, route by route).
//!
//! This file holds the router, the error envelope ([`ApiError`]), bearer authentication, body
//! reading and the `{id}` lookups. The handlers live beside the types they speak, by part of the
//! wire contract: `agent_operations` (submit, get, cancel), `streams`, `operator` (pending
//! requests, approve, deny, drift), `health` (`/healthz`, `/readyz`, `/metrics`), and
//! `discovery`, `listing` and `waits`.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::extract::rejection::PathRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::operations::{LiveOp, TransitionFailure};
use super::store::{OperationRecord, StoreError};
use super::{Core, agent_operations, health, operator, streams};
use crate::config::{Identity, Secrets};
use crate::engine::{OperationState, Refusal, RefusalCode};

pub use agent_operations::{MAX_ARGUMENT_PROPERTIES, MAX_BODY_BYTES, MAX_TARGET_PROPERTIES};

/// The message of every admission refusal.
pub const REFUSAL_MESSAGE: &str = "Operation admission limit reached";

/// An error response: status, stable code, message, and a Retry-After for refusals.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<u64>,
}

/// The longest error message the contract allows, in characters.
const MAX_MESSAGE_CHARS: usize = 500;

impl ApiError {
    /// An error; a message past [`MAX_MESSAGE_CHARS`] (one quoting a long input) is cut to it,
    /// and control characters a quoted input brought in are escaped, so it stays one line.
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        let mut message = message.into();
        if message.contains(char::is_control) {
            message = message
                .chars()
                .flat_map(|c| {
                    let escaped = c.is_control().then(|| c.escape_default());
                    let plain = (!c.is_control()).then_some(c);
                    escaped.into_iter().flatten().chain(plain)
                })
                .collect();
        }
        if message.chars().count() > MAX_MESSAGE_CHARS {
            message = message.chars().take(MAX_MESSAGE_CHARS - 1).collect();
            message.push('…');
        }
        ApiError {
            status,
            code,
            message,
            retry_after: None,
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub(crate) fn store(err: StoreError) -> ApiError {
        tracing::error!(error = %err, "store failed");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "The operation store is unavailable; try again.",
        )
    }

    pub(crate) fn refused(refusal: Refusal) -> ApiError {
        let status = StatusCode::from_u16(refusal.code.http_status())
            .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
        if refusal.code == RefusalCode::ClientUnconfigured {
            return ApiError::new(
                status,
                refusal.code.as_str(),
                "This client is not configured for admission.",
            );
        }
        ApiError {
            status,
            code: refusal.code.as_str(),
            message: REFUSAL_MESSAGE.to_owned(),
            retry_after: Some(refusal.retry_after_secs().max(1)),
        }
    }

    /// This error with a `Retry-After` of `secs` (a refusal the client may retry).
    pub(crate) fn with_retry_after(self, secs: u64) -> ApiError {
        ApiError {
            retry_after: Some(secs),
            ..self
        }
    }

    /// The HTTP status.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable error code.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn code(&self) -> &'static str {
        self.code
    }

    /// The message a client reads.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    fn operation_not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such operation.")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Bearer-secret authentication for clients and the operator. Secrets are compared in constant
/// time and never logged.
pub(crate) struct Auth {
    clients: Secrets,
    operator: Box<[u8]>,
}

impl Auth {
    pub(crate) fn new(secrets: &Secrets, operator: &str) -> Auth {
        Auth {
            clients: secrets.clone(),
            operator: operator.as_bytes().into(),
        }
    }

    pub(crate) fn client(&self, headers: &HeaderMap) -> Result<&Identity, ApiError> {
        // The library's lookup: every secret compared, each in constant time.
        self.clients
            .identify(bearer(headers)?)
            .ok_or_else(rejected_token)
    }

    pub(crate) fn operator(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if constant_time_eq(&self.operator, bearer(headers)?) {
            Ok(())
        } else {
            Err(rejected_token())
        }
    }
}

fn bearer(headers: &HeaderMap) -> Result<&[u8], ApiError> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
        .filter(|token| !token.is_empty())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_failed",
                "A bearer token is required.",
            )
        })
}

fn rejected_token() -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "authentication_failed",
        "The bearer token is not valid for this route.",
    )
}

/// Whether two secrets are equal, in time that depends on their lengths only (`subtle`).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

/// The routes, with their state.
pub(crate) fn router(core: Arc<Core>) -> Router {
    Router::new()
        .route(
            "/.well-known/unyolo-agent",
            get(super::discovery::descriptor),
        )
        .route(
            "/api/agent/v1/operations",
            post(agent_operations::submit).get(super::listing::list_operations),
        )
        .route(
            "/api/agent/v1/operations/{id}",
            get(agent_operations::get_own),
        )
        .route(
            "/api/agent/v1/operations/{id}/events",
            get(super::waits::wait_for_change),
        )
        .route(
            "/api/agent/v1/operations/{id}/cancel",
            post(agent_operations::cancel),
        )
        .route("/api/agent/v1/streams", post(streams::upload_stream))
        .route("/api/agent/v1/streams/{id}", delete(streams::delete_stream))
        .route("/api/operator/v1/requests", get(operator::list_pending))
        .route(
            "/api/operator/v1/requests/{id}/approve",
            post(operator::approve),
        )
        .route("/api/operator/v1/requests/{id}/deny", post(operator::deny))
        .route("/api/operator/v1/drift", get(operator::drift))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such route.") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "This route does not take that method.",
            )
        })
        .layer(axum::middleware::map_response(no_store))
        .with_state(core)
}

async fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

pub(crate) type ApiResult = Result<Response, ApiError>;

pub(crate) fn json_response(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

/// Reads a body of at most `limit` bytes (413 beyond it, judged from `Content-Length` first).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<bytes::Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("The request body is larger than {limit} bytes."),
        )
    };
    if content_length(headers)?.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(_) => Err(ApiError::invalid("The request body could not be read.")),
    }
}

pub(crate) fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    match headers.get(header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map(Some)
            .ok_or_else(|| ApiError::invalid("Content-Length is not a number.")),
    }
}

/// Runs a decided change to its end ([`super::run_to_end`]) and returns its answer; a panic in it
/// is a 500.
pub(crate) async fn detached(work: impl Future<Output = ApiResult> + Send + 'static) -> ApiResult {
    let outcome = super::run_to_end(work);
    outcome.await.unwrap_or_else(|err| {
        tracing::error!(error = %err, "a detached change did not finish");
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "The change did not finish; check the operation before retrying.",
        ))
    })
}

/// The `{id}` of a route, judged after authentication; an id that is not UTF-8 once
/// percent-decoded is a 400 in the error shape (axum's own rejection would be plain text).
pub(crate) fn path_id(id: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    id.map(|Path(id)| id)
        .map_err(|rejection| ApiError::invalid(rejection.body_text()))
}

/// The caller's own operation `id`, else 404.
pub(crate) async fn own_record(
    core: &Core,
    client: &Identity,
    id: &str,
) -> Result<OperationRecord, ApiError> {
    match core.db.get(id).await.map_err(ApiError::store)? {
        Some(record) if record.client_id == client.as_str() => Ok(record),
        _ => Err(ApiError::operation_not_found()),
    }
}

/// Runs [`Core::transition`] detached ([`super::run_to_end`]) and returns its outcome.
pub(crate) async fn transition_to_end(
    core: &Arc<Core>,
    op: Arc<LiveOp>,
    to: OperationState,
) -> Result<OperationRecord, TransitionFailure> {
    let transition = Arc::clone(core).transition(op, to, None);
    super::run_to_end(transition).await.unwrap_or_else(|err| {
        Err(TransitionFailure::Store(StoreError::new(format!(
            "the transition did not finish: {err}"
        ))))
    })
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_are_cut_to_the_contracts_500_characters() {
        let long = ApiError::invalid(format!("Unknown query parameter {:?}.", "é".repeat(900)));
        assert_eq!(long.message.chars().count(), MAX_MESSAGE_CHARS);
        assert!(long.message.ends_with('…'));
        assert_eq!(ApiError::invalid("short").message, "short");
    }

    #[test]
    fn error_messages_quoting_control_characters_stay_one_line() {
        // Found by the submission fuzz target: serde quotes an unknown field name as sent.
        let quoted = ApiError::invalid("unknown field `a\nb\u{1b}[2J`, expected `reason`");
        assert_eq!(
            quoted.message,
            "unknown field `a\\nb\\u{1b}[2J`, expected `reason`"
        );
    }

    #[test]
    fn secrets_compare_by_full_content() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secre"));
        assert!(!constant_time_eq(b"secret", b"secret!"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(!constant_time_eq(b"secret", b"Secret"));
    }
}
