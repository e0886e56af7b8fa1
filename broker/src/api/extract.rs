//! What a handler takes from a request, checked once here instead of in every handler: the
//! authenticated client ([`Client`]) from the bearer token, the
//! operation id of the path ([`OperationId`]), the query's parameters ([`QueryPairs`] and
//! [`single_params`]), and the body ([`read_body`], within the buffered-bytes budget); the
//! caller's own operation ([`own_record`], or rendered whole within the budget:
//! [`own_rendered`]); and the room an answer's rendering holds in the budget
//! ([`reserve_render`], [`rendered`]).
//!
//! Each extractor rejects with an [`ApiError`], so a refused request answers in the error shape
//! (axum's own rejections are plain text). Axum runs the extractors in the order of the handler's
//! parameters, so a handler lists the client or the operator first: a bad token is answered
//! before a bad path or query is looked at.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, Query};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use http_body_util::BodyExt;
use serde_json::Value;

use super::error::{ApiError, ApiResult};
use super::projection::OperationJson;
use crate::core::Core;
use crate::fairness::{ByteBudget, BytesReservation, Class};
use crate::store::{OperationRecord, StoredRequest};
use unyolo_admission::config::Identity;

/// The client the bearer token names: missing → 401, unknown → 403, both
/// `authentication_failed`.
pub(crate) struct Client(pub(crate) Identity);

impl FromRequestParts<Arc<Core>> for Client {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, core: &Arc<Core>) -> Result<Client, ApiError> {
        // The fairness layer's classifier already compared the token with the secrets: a
        // request it keyed to a client is that client's.
        if let Some(Class::Client { key, .. } | Class::ExemptClient { key }) =
            parts.extensions.get::<Class>()
            && let Some(identity) = core.auth.named(key)
        {
            return Ok(Client(identity.clone()));
        }
        let token = bearer(&parts.headers)?;
        core.auth
            .client(token)
            .cloned()
            .map(Client)
            .ok_or_else(rejected_token)
    }
}

/// The secret a bearer `Authorization` header presents, as unYOLO's `SecretFromAuthorization`
/// reads one: the header trimmed, split at its first space, the scheme `Bearer` in any case
/// (RFC 9110), the rest trimmed and not empty. Any other scheme presents none (Agent V1 takes
/// bearer tokens only).
pub(crate) fn bearer_secret(header: &[u8]) -> Option<&[u8]> {
    let header = header.trim_ascii();
    let space = header.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = header.split_at(space);
    let secret = rest.trim_ascii();
    (scheme.eq_ignore_ascii_case(b"bearer") && !secret.is_empty()).then_some(secret)
}

fn bearer(headers: &HeaderMap) -> Result<&[u8], ApiError> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|value| bearer_secret(value.as_bytes()))
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

/// The `{id}` of a route; an id that is not UTF-8 once percent-decoded is a 400 in the error
/// shape.
pub(crate) struct OperationId(pub(crate) String);

impl<S: Send + Sync> FromRequestParts<S> for OperationId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<OperationId, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| OperationId(id))
            .map_err(|rejection| ApiError::invalid(rejection.body_text()))
    }
}

/// The query string's `name=value` pairs, in order, repeats kept (each route judges them with
/// [`single_params`]); a query that does not decode is a 400.
pub(crate) struct QueryPairs(pub(crate) Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<QueryPairs, ApiError> {
        Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map(|Query(pairs)| QueryPairs(pairs))
            .map_err(|rejection| ApiError::invalid(rejection.body_text()))
    }
}

/// The query's parameters, each at most once, each one of `known`, none empty: every parameter
/// the contract defines has at least one character (an empty `idempotency_key=` once counted as
/// absent and listed every operation), so an empty one is a 400 like any bad value.
pub(crate) fn single_params(
    pairs: Vec<(String, String)>,
    known: &[&str],
) -> Result<std::collections::HashMap<String, String>, ApiError> {
    let mut params = std::collections::HashMap::new();
    for (name, value) in pairs {
        if !known.contains(&name.as_str()) {
            return Err(ApiError::invalid(format!(
                "Unknown query parameter {name:?}; this route takes {}.",
                known.join(", ")
            )));
        }
        if params.contains_key(&name) {
            return Err(ApiError::invalid(format!(
                "The query parameter {name:?} is given twice."
            )));
        }
        if value.is_empty() {
            return Err(ApiError::invalid(format!(
                "The query parameter {name:?} is empty; leave it out instead."
            )));
        }
        params.insert(name, value);
    }
    Ok(params)
}

/// Whether JSON text is an object (its first byte past JSON whitespace is `{`). A body the
/// contract defines as an object is judged by this before serde reads it into a struct: serde
/// reads a struct from an array too, field by field in order, which would let `[1,"k"]` pass
/// for `{"expected_revision":1,"idempotency_key":"k"}`.
pub(crate) fn is_json_object(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b'{')
}

/// A decimal integer of plain ASCII digits (no sign, no spaces), within `u64`.
pub(crate) fn parse_integer(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 20 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Whether `key` matches `^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`, the idempotency key's pattern
/// (in a submission body and in a listing's query).
pub(crate) fn is_idempotency_key(key: &str) -> bool {
    let bytes = key.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// How long a body waits for room in the buffered-bytes budget before it is refused.
const BUDGET_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads a body of at most `limit` bytes (413 beyond it, judged from `Content-Length` first; 408
/// when the listener cuts it off for coming too slowly or past its deadline), holding its bytes
/// in `budget`: room for the `Content-Length` (or `limit` when there is none) is reserved before
/// a byte is read, then shrunk to the bytes read. With no room within a second it is refused,
/// 503 `body_budget_exhausted` with Retry-After, unread. Keep the reservation for as long as the
/// body's bytes (or what is parsed from them) are held.
pub(crate) async fn read_body(
    budget: &ByteBudget,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<(bytes::Bytes, BytesReservation), ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("The request body is larger than {limit} bytes."),
        )
    };
    let declared = content_length(headers)?;
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let room = declared.map_or(limit, |n| n as usize);
    let mut reservation = budget.reserve(room, BUDGET_WAIT).await.map_err(|refusal| {
        // The agents' buffered-bytes budget, or the operator decisions' own room.
        let budget_bytes = budget.total();
        tracing::warn!(bytes = room, budget_bytes, %refusal, "request body refused: its byte budget is full");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "body_budget_exhausted",
            "The broker holds as many request bodies as it may buffer; retry shortly.",
        )
        .with_retry_after(1)
    })?;
    match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => {
            let bytes = collected.to_bytes();
            reservation.shrink_to(bytes.len());
            Ok((bytes, reservation))
        }
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(err) => Err(ApiError::unreadable_body(&*err)),
    }
}

/// The `Content-Length`, if given; one that is not a number is a 400.
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

/// Room a listing page reserves per row: a summary's rendered bound (its title and summary are
/// at most 160 and 500 characters, even escaped well under this) with its parsed form.
pub(crate) const SUMMARY_ROW_BYTES: usize = 8 << 10;

/// A whole operation's rendering holds about this many times its stored request: the row's text
/// as read, the values parsed from it, and the rendered answer.
const RENDER_FACTOR: u64 = 3;

/// Room for the rest of a whole operation (ids, times, presentation, error) and its envelope.
const RENDER_OVERHEAD: u64 = 16 << 10;

/// The room the whole rendering of an operation whose stored request is `bytes` long holds.
pub(crate) fn render_room(bytes: u64) -> usize {
    usize::try_from(bytes.saturating_mul(RENDER_FACTOR) + RENDER_OVERHEAD).unwrap_or(usize::MAX)
}

/// Reserves `bytes` in the buffered-bytes budget for an answer about to be rendered (read from
/// the store, parsed, written out), waiting for room as a body does; without room in time it is
/// refused, 503 `response_budget_exhausted` with Retry-After, before anything is read.
pub(crate) async fn reserve_render(
    core: &Core,
    bytes: usize,
) -> Result<BytesReservation, ApiError> {
    core.budget
        .reserve(bytes, BUDGET_WAIT)
        .await
        .map_err(|refusal| {
            tracing::warn!(bytes, %refusal, "answer refused: buffered-bytes budget");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "response_budget_exhausted",
                "The broker holds as many bytes of answers as it may buffer; retry shortly.",
            )
            .with_retry_after(1)
        })
}

/// `body` as JSON with `status`, rendered now; its bytes keep `reservation` (shrunk to their
/// length) until they have been sent.
pub(crate) fn rendered(status: StatusCode, body: Value, reservation: BytesReservation) -> Response {
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    drop(body);
    let mut response = Response::new(Body::new(reservation.hold(bytes.into())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The stored request of the caller's own operation `id` (its size, not its text), else 404
/// `not_found` (unknown and another client's alike).
pub(crate) async fn own_request(
    core: &Core,
    client: &Identity,
    id: &str,
) -> Result<StoredRequest, ApiError> {
    match core.db.request_of(id).await? {
        Some(request) if request.client_id == client.as_str() => Ok(request),
        _ => Err(ApiError::operation_not_found()),
    }
}

/// Operation `request.id` rendered whole with `status`, its room reserved before it is read.
/// `None` when the row went (retention) between the two reads.
pub(crate) async fn render_operation(
    core: &Core,
    request: &StoredRequest,
    status: StatusCode,
) -> Result<Option<Response>, ApiError> {
    let reservation = reserve_render(core, render_room(request.bytes)).await?;
    let Some(record) = core.db.get(&request.id).await? else {
        return Ok(None);
    };
    Ok(Some(rendered(status, record.into_json(), reservation)))
}

/// The caller's own operation `id`, rendered whole within the budget; else 404 `not_found`.
pub(crate) async fn own_rendered(core: &Core, client: &Identity, id: &str) -> ApiResult {
    let request = own_request(core, client, id).await?;
    render_operation(core, &request, StatusCode::OK)
        .await?
        .ok_or_else(ApiError::operation_not_found)
}

/// The caller's own operation `id`, else 404 `not_found` (unknown and another client's alike).
pub(crate) async fn own_record(
    core: &Core,
    client: &Identity,
    id: &str,
) -> Result<OperationRecord, ApiError> {
    match core.db.get(id).await? {
        Some(record) if record.client_id == client.as_str() => Ok(record),
        _ => Err(ApiError::operation_not_found()),
    }
}

/// A query as the extractor hands it over, from literal pairs (for the parsers' unit tests).
#[cfg(test)]
pub(crate) fn test_pairs(query: &[(&str, &str)]) -> Vec<(String, String)> {
    query
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys_follow_the_contract_pattern() {
        assert!(is_idempotency_key("a"));
        assert!(is_idempotency_key("A1._:-z"));
        assert!(is_idempotency_key(&"k".repeat(128)));
        assert!(!is_idempotency_key(&"k".repeat(129)));
        assert!(!is_idempotency_key(""));
        assert!(!is_idempotency_key("-leading"));
        assert!(!is_idempotency_key("has space"));
        assert!(!is_idempotency_key("slash/no"));
    }
}
