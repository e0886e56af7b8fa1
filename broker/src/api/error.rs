//! The one error shape every route answers with: `{"error":{"code","message"}}`, its status, and a
//! `Retry-After` when the client may retry.
//!
//! It is a leaf: it knows the store's error (so a handler writes `?` on a store call, as axum's own
//! examples do) and the engine's refusal, and nothing of the routes. Every handler, extractor and
//! the router import it; it imports none of them.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;

use crate::listener::{CutOffReason, body_cut_off};
use crate::store::StoreError;
use unyolo_admission::engine::{Refusal, RefusalCode};

/// The message of every admission refusal.
pub const REFUSAL_MESSAGE: &str = "Operation admission limit reached";

/// The longest error message the contract allows, in characters.
const MAX_MESSAGE_CHARS: usize = 500;

/// An error response: status, stable code, message, and a Retry-After for refusals.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    /// Borrowed when it is one of the broker's own sentences (every refusal's), so answering
    /// one copies nothing.
    message: Cow<'static, str>,
    retry_after: Option<u64>,
}

impl ApiError {
    /// An error; a message past [`MAX_MESSAGE_CHARS`] (one quoting a long input) is cut to it,
    /// and control characters a quoted input brought in are escaped, so it stays one line.
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<Cow<'static, str>>,
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
            let mut cut: String = message.chars().take(MAX_MESSAGE_CHARS - 1).collect();
            cut.push('…');
            message = cut.into();
        }
        ApiError {
            status,
            code,
            message,
            retry_after: None,
        }
    }

    /// A 400 `invalid_request`.
    pub(crate) fn invalid(message: impl Into<Cow<'static, str>>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// An admission refusal: its status and code, [`REFUSAL_MESSAGE`] (for a store's cap, the
    /// sentence that names the store: a stream upload is not an operation) and its Retry-After
    /// (at least 1 second).
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
        let message = match refusal.code {
            RefusalCode::StreamStorageLimit | RefusalCode::SealedPayloadStorageLimit => {
                Cow::Owned(format!("{}.", refusal.message()))
            }
            _ => Cow::Borrowed(REFUSAL_MESSAGE),
        };
        ApiError {
            status,
            code: refusal.code.as_str(),
            message,
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
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable error code.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn code(&self) -> &'static str {
        self.code
    }

    /// The message a client reads.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// A request body that could not be read, from the error reading it: `408 request_timeout`
    /// when the listener cut it off (too slow past the grace, or past its deadline), else a 400
    /// `invalid_request` (the client hung up, a frame timed out, a malformed chunk).
    pub(crate) fn unreadable_body(err: &(dyn std::error::Error + 'static)) -> ApiError {
        match body_cut_off(err) {
            Some(cut) => {
                let secs = cut.after.as_secs_f64();
                let message = match cut.reason {
                    CutOffReason::Deadline => format!(
                        "The request body came past its deadline: still arriving after {secs:.1} s."
                    ),
                    CutOffReason::TooSlow => format!(
                        "The request body came too slowly: {} bytes in {secs:.1} s is below the \
                         minimum rate.",
                        cut.bytes
                    ),
                };
                ApiError::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", message)
            }
            None => ApiError::invalid("The request body could not be read."),
        }
    }

    /// 404 `not_found` for an operation that is unknown or another client's.
    pub(crate) fn operation_not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such operation.")
    }
}

/// A store failure is a 503 `store_unavailable` (logged; the client reads no detail of it); one
/// that passes by itself (a busy file, an unreachable database: [`StoreError::is_transient`])
/// says when to try again (`Retry-After: 1`).
impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> ApiError {
        tracing::error!(error = %err, "store failed");
        let transient = err.is_transient();
        let answer = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "The operation store is unavailable; try again.",
        );
        if transient {
            answer.with_retry_after(1)
        } else {
            answer
        }
    }
}

/// The error envelope as it is written: `{"error":{"code","message"}}`.
#[derive(Serialize)]
struct Envelope<'a> {
    error: EnvelopeError<'a>,
}

#[derive(Serialize)]
struct EnvelopeError<'a> {
    code: &'a str,
    message: &'a str,
}

/// The envelope's JSON text for `code` and `message`.
fn envelope(code: &str, message: &str) -> Vec<u8> {
    let envelope = Envelope {
        error: EnvelopeError { code, message },
    };
    serde_json::to_vec(&envelope).unwrap_or_default()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // Written straight from the two strings (one buffer, no JSON value built first): every
        // refusal of a flood is answered here.
        let body = envelope(self.code, &self.message);
        let mut response = Response::new(axum::body::Body::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// What a handler answers.
pub(crate) type ApiResult = Result<Response, ApiError>;

/// `body` as JSON with `status`.
pub(crate) fn json_response(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
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
    fn the_envelope_is_the_json_object_of_its_code_and_message() {
        for message in [
            REFUSAL_MESSAGE,
            "quote \" backslash \\ tab \t é 🦀 </script>",
        ] {
            let written: Value = serde_json::from_slice(&envelope("a_code", message)).unwrap();
            assert_eq!(
                written,
                serde_json::json!({"error": {"code": "a_code", "message": message}})
            );
        }
        assert_eq!(
            envelope("client_operation_limit", REFUSAL_MESSAGE),
            br#"{"error":{"code":"client_operation_limit","message":"Operation admission limit reached"}}"#
        );
    }
}
