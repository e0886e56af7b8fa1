//! The Operator V1 error envelope, `{"error":{"code","message","correlation_id"[,"current"]}}`,
//! with a code from the contract's closed list only ([`ErrorCode`]) and the statuses and messages
//! unYOLO's own operator API answers with.
//!
//! A handler answers an [`OperatorError`]; the operator router's envelope layer (in `mod.rs`)
//! writes its body, because only the layer knows the request's correlation id, which the body
//! carries and the `X-Correlation-ID` header repeats.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::error::ApiError;
use crate::store::StoreError;

/// Every error code Operator V1 defines (the yaml's `Error.code` enum), and no other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorCode {
    /// A bad query, path, header or body.
    InvalidRequest,
    /// A missing or wrong operator credential.
    Unauthorized,
    /// Never answered by this broker (a wrong credential is `unauthorized`); in the contract.
    Forbidden,
    /// No such route or request.
    NotFound,
    /// A known route, another method.
    MethodNotAllowed,
    /// The request changed since the revision the decision was made against.
    RevisionConflict,
    /// The idempotency key was used for another command.
    IdempotencyConflict,
    /// The approval's constraints widen the request's bounds.
    ConstraintExceeded,
    /// The action is not allowed from the request's status.
    InvalidTransition,
    /// A notification decision's token does not match (admission issues none).
    InvalidDecisionToken,
    /// A notification reference failed its integrity check (not answered by this broker).
    InvalidNotification,
    /// Activation failure (not answered by this broker).
    PlanUnavailable,
    /// Activation failure (not answered by this broker).
    PlanMismatch,
    /// Activation failure (not answered by this broker).
    CredentialChanged,
    /// Activation failure (not answered by this broker).
    CredentialInsufficient,
    /// The store failed.
    StorageUnavailable,
    /// An event cursor older than the retained history.
    CursorExpired,
    /// Not ready, or a resource briefly exhausted.
    TemporarilyUnavailable,
    /// Anything else.
    InternalError,
}

impl ErrorCode {
    /// The code as the wire spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RevisionConflict => "revision_conflict",
            ErrorCode::IdempotencyConflict => "idempotency_conflict",
            ErrorCode::ConstraintExceeded => "constraint_exceeded",
            ErrorCode::InvalidTransition => "invalid_transition",
            ErrorCode::InvalidDecisionToken => "invalid_decision_token",
            ErrorCode::InvalidNotification => "invalid_notification",
            ErrorCode::PlanUnavailable => "plan_unavailable",
            ErrorCode::PlanMismatch => "plan_mismatch",
            ErrorCode::CredentialChanged => "credential_changed",
            ErrorCode::CredentialInsufficient => "credential_insufficient",
            ErrorCode::StorageUnavailable => "storage_unavailable",
            ErrorCode::CursorExpired => "cursor_expired",
            ErrorCode::TemporarilyUnavailable => "temporarily_unavailable",
            ErrorCode::InternalError => "internal_error",
        }
    }
}

/// The message of a 400 for a bad query, path or command.
pub const INVALID_REQUEST: &str = "request is invalid";
/// The message of a 400 for a decision body that is not the contract's `Decision`.
pub const INVALID_DECISION_BODY: &str = "decision body is invalid";
/// The message of a 503 the operator may retry.
pub const TEMPORARILY_UNAVAILABLE: &str = "operator request temporarily unavailable";

/// An Operator V1 error: status, code, message, the request as it is now (`current`, for a
/// revision conflict), and whether the client may retry in a second (`Retry-After: 1`).
#[derive(Debug)]
pub struct OperatorError {
    status: StatusCode,
    code: ErrorCode,
    message: Cow<'static, str>,
    current: Option<Value>,
    retry_after: bool,
}

/// What the envelope layer renders into the body: the error without the correlation id.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    code: ErrorCode,
    message: Cow<'static, str>,
    current: Option<Value>,
}

impl Failure {
    /// The envelope, with the request's correlation id.
    pub(crate) fn body(&self, correlation_id: &str) -> Value {
        let mut error = json!({
            "code": self.code.as_str(),
            "message": self.message,
            "correlation_id": correlation_id,
        });
        if let Some(current) = &self.current {
            error["current"] = current.clone();
        }
        json!({ "error": error })
    }
}

impl OperatorError {
    /// An error with one of the contract's messages.
    pub(crate) fn new(
        status: StatusCode,
        code: ErrorCode,
        message: impl Into<Cow<'static, str>>,
    ) -> OperatorError {
        OperatorError {
            status,
            code,
            message: message.into(),
            current: None,
            retry_after: false,
        }
    }

    /// 400 `invalid_request`, `request is invalid`.
    pub(crate) fn invalid() -> OperatorError {
        OperatorError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            INVALID_REQUEST,
        )
    }

    /// 400 `invalid_request`, `decision body is invalid`.
    pub(crate) fn invalid_body() -> OperatorError {
        OperatorError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidRequest,
            INVALID_DECISION_BODY,
        )
    }

    /// 401 `unauthorized` (the layer adds `WWW-Authenticate: Bearer realm="broker-operator"`).
    pub(crate) fn unauthorized() -> OperatorError {
        OperatorError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "operator authentication required",
        )
    }

    /// 404 `not_found`, `route not found`.
    pub(crate) fn no_route() -> OperatorError {
        OperatorError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "route not found",
        )
    }

    /// 404 `not_found`, `request not found`.
    pub(crate) fn no_request() -> OperatorError {
        OperatorError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "request not found",
        )
    }

    /// A 409 with `code` and the contract's message for it (the code, spaces for underscores).
    pub(crate) fn conflict(code: ErrorCode) -> OperatorError {
        let message = match code {
            ErrorCode::RevisionConflict => "request changed; refresh before deciding".to_owned(),
            other => other.as_str().replace('_', " "),
        };
        OperatorError::new(StatusCode::CONFLICT, code, message)
    }

    /// A 503 the client may retry in a second.
    pub(crate) fn unavailable(code: ErrorCode) -> OperatorError {
        OperatorError {
            retry_after: true,
            ..OperatorError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                TEMPORARILY_UNAVAILABLE,
            )
        }
    }

    /// This error carrying the request as it is now.
    pub(crate) fn with_current(self, current: Value) -> OperatorError {
        OperatorError {
            current: Some(current),
            ..self
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The code.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// A store failure is a 503 `storage_unavailable` with `Retry-After: 1` (logged; the operator
/// reads no detail of it).
impl From<StoreError> for OperatorError {
    fn from(err: StoreError) -> OperatorError {
        tracing::error!(error = %err, "store failed");
        OperatorError::unavailable(ErrorCode::StorageUnavailable)
    }
}

/// A decision body the shared reader refused: too large, cut off or unreadable is a 400
/// (`decision body is invalid`); no room in the decisions' own room (other decisions' bodies
/// fill it; see `decisions::decision_room`) a retryable 503.
impl From<ApiError> for OperatorError {
    fn from(err: ApiError) -> OperatorError {
        if err.status() == StatusCode::SERVICE_UNAVAILABLE {
            OperatorError::unavailable(ErrorCode::TemporarilyUnavailable)
        } else {
            OperatorError::invalid_body()
        }
    }
}

impl IntoResponse for OperatorError {
    fn into_response(self) -> Response {
        let mut response = self.status.into_response();
        let headers = response.headers_mut();
        if self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"broker-operator\""),
            );
        }
        response.extensions_mut().insert(Failure {
            code: self.code,
            message: self.message,
            current: self.current,
        });
        response
    }
}

/// What an operator handler answers.
pub(crate) type OperatorResult = Result<Response, OperatorError>;
