//! The Agent V1-compatible HTTP surface.
//!
//! A submission goes authenticate → validate → replay → admit → create → commit: nothing that can
//! be refused without admission (a bad token, a bad body, a replay) reaches the controller, and a
//! refusal writes nothing. Cancel, operator decisions, reads, `/healthz`, `/readyz` and `/metrics`
//! never call admission. Every error body is `{"error":{"code","message"}}` and every response
//! carries `Cache-Control: no-store`.
//!
//! Each mutating handler (submit, cancel, approve, deny, upload, delete) hands everything from its
//! decision on to a task of its own and only waits for the answer, so a client that hangs up
//! cannot leave a change half made (the broker module's docs say what is atomic, route by route).
//! `GET /api/operator/v1/drift` (operator) answers a drift reading on demand.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use super::operations::{LiveOp, TransitionFailure, duration_ms};
use super::store::{InsertError, OperationRecord, StoreError, StreamRecord, now_rfc3339};
use super::{Core, new_id, ratelimit};
use crate::config::{Identity, Secrets};
use crate::engine::{OperationState, Refusal, RefusalCode, Store};

/// Largest operation submission body, in bytes.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Most pending requests the operator's list returns (the oldest).
const LIST_LIMIT: u32 = 1000;

/// Most properties a submission's `target` may have.
pub const MAX_TARGET_PROPERTIES: usize = 32;

/// Most properties a submission's `arguments` may have.
pub const MAX_ARGUMENT_PROPERTIES: usize = 128;

/// The message of every admission refusal.
pub const REFUSAL_MESSAGE: &str = "Operation admission limit reached";

/// The registered operations: name and whether it needs an operator's approval.
pub(crate) const OPERATIONS: [(&str, bool); 2] = [("demo.run", false), ("demo.request", true)];

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
    /// An error; a message past [`MAX_MESSAGE_CHARS`] (one quoting a long input) is cut to it.
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        let mut message = message.into();
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
    clients: Vec<(Identity, Box<[u8]>)>,
    operator: Box<[u8]>,
}

impl Auth {
    pub(crate) fn new(secrets: &Secrets, operator: &str) -> Auth {
        Auth {
            clients: secrets
                .iter()
                .map(|(identity, secret)| (identity.clone(), secret.as_bytes().into()))
                .collect(),
            operator: operator.as_bytes().into(),
        }
    }

    pub(crate) fn client(&self, headers: &HeaderMap) -> Result<&Identity, ApiError> {
        let token = bearer(headers)?;
        // Compare against every secret so the time taken does not say which one matched.
        let mut found = None;
        for (identity, secret) in &self.clients {
            if constant_time_eq(secret, token) {
                found = Some(identity);
            }
        }
        found.ok_or_else(rejected_token)
    }

    fn operator(&self, headers: &HeaderMap) -> Result<(), ApiError> {
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
            post(submit).get(super::listing::list_operations),
        )
        .route("/api/agent/v1/operations/{id}", get(get_own))
        .route(
            "/api/agent/v1/operations/{id}/events",
            get(super::waits::wait_for_change),
        )
        .route("/api/agent/v1/operations/{id}/cancel", post(cancel))
        .route("/api/agent/v1/streams", post(upload_stream))
        .route("/api/agent/v1/streams/{id}", delete(delete_stream))
        .route("/api/operator/v1/requests", get(list_pending))
        .route("/api/operator/v1/requests/{id}/approve", post(approve))
        .route("/api/operator/v1/requests/{id}/deny", post(deny))
        .route("/api/operator/v1/drift", get(drift))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
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

/// A submission body: every field required, unknown fields refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Submission {
    pub(crate) idempotency_key: String,
    operation: String,
    target: Value,
    arguments: Value,
    reason: String,
}

/// Whether `key` matches `^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$`.
pub(crate) fn is_idempotency_key(key: &str) -> bool {
    let bytes = key.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Reads a body of at most `limit` bytes (413 beyond it, judged from `Content-Length` first).
async fn read_body(
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

fn content_length(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
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

/// A validated submission: the request and whether it needs approval.
struct Validated {
    request: Submission,
    needs_approval: bool,
}

fn validate(bytes: &[u8]) -> Result<Validated, ApiError> {
    let request: Submission = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::invalid(format!("The request body is not a valid submission: {e}"))
    })?;
    if !is_idempotency_key(&request.idempotency_key) {
        return Err(ApiError::invalid(
            "idempotency_key must match ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$.",
        ));
    }
    if request.reason.is_empty() || request.reason.len() > 2000 {
        return Err(ApiError::invalid("reason must be 1 to 2000 bytes."));
    }
    if request
        .target
        .as_object()
        .is_none_or(|o| o.len() > MAX_TARGET_PROPERTIES)
    {
        return Err(ApiError::invalid(
            "target must be a JSON object of at most 32 properties.",
        ));
    }
    if request
        .arguments
        .as_object()
        .is_none_or(|o| o.len() > MAX_ARGUMENT_PROPERTIES)
    {
        return Err(ApiError::invalid(
            "arguments must be a JSON object of at most 128 properties.",
        ));
    }
    let Some(&(_, needs_approval)) = OPERATIONS
        .iter()
        .find(|(name, _)| *name == request.operation)
    else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "operation_not_registered",
            "This broker has no such operation.",
        ));
    };
    if duration_ms(&request.arguments).is_none() {
        return Err(ApiError::invalid(
            "arguments.duration_ms must be an integer from 0 to 600000.",
        ));
    }
    Ok(Validated {
        request,
        needs_approval,
    })
}

/// Whether `existing` was created by this same request (JSON objects compare by content, so key
/// order does not matter).
fn same_request(existing: &OperationRecord, request: &Submission) -> bool {
    existing.operation == request.operation
        && existing.target == request.target
        && existing.arguments == request.arguments
        && existing.reason == request.reason
}

pub(crate) fn replay(core: &Core, existing: OperationRecord, request: &Submission) -> ApiResult {
    if !same_request(&existing, request) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_conflict",
            "This idempotency key was used for a different request.",
        ));
    }
    core.count_submission("replayed");
    let response = json_response(StatusCode::OK, existing.to_json());
    Ok(ratelimit::answer(core, &existing.client_id, response, None))
}

async fn submit(State(core): State<Arc<Core>>, headers: HeaderMap, body: Body) -> ApiResult {
    let client = core.auth.client(&headers)?.clone();
    let bytes = read_body(&headers, body, MAX_BODY_BYTES).await?;
    let Validated {
        request,
        needs_approval,
    } = validate(&bytes)?;

    // Same client and key: one at a time, so concurrent duplicates create one operation. Held
    // until the operation is created (or not), inside the detached part below.
    let same_key = core
        .key_lock(client.as_str(), &request.idempotency_key)
        .lock_owned()
        .await;

    if core
        .keys
        .may_contain(client.as_str(), &request.idempotency_key)
        && let Some(existing) = core
            .db
            .find_by_key(client.as_str(), &request.idempotency_key)
            .await
            .map_err(ApiError::store)?
    {
        return replay(&core, existing, &request);
    }

    // The decision: from the gate on there is no `.await` until the creation is detached, so a
    // permit is never dropped by a client hanging up.
    let quiet = core.hold_counts().await;
    if core.shared.is_replica() {
        // One replica of several: the shared decision is a call to Redis, so it too runs
        // detached (its script may run even if this client hangs up).
        let submission =
            super::shared_submit::submit(Arc::clone(&core), client, request, needs_approval);
        return detached(async move {
            let _same_key = same_key;
            let _quiet = quiet;
            submission.await
        })
        .await;
    }
    let permit = match core.controller.admit(client.as_str(), needs_approval) {
        Ok(permit) => permit,
        Err(refusal) => {
            core.count_submission("rejected");
            tracing::info!(
                client = %client,
                code = refusal.code.as_str(),
                retry_after = refusal.retry_after_secs(),
                "submission refused"
            );
            let response = ApiError::refused(refusal).into_response();
            return Ok(ratelimit::answer(
                &core,
                client.as_str(),
                response,
                Some(&refusal),
            ));
        }
    };
    let creation = create(
        Arc::clone(&core),
        client,
        request,
        permit,
        needs_approval,
        new_id("op"),
        super::shared::SharedPermit::default(),
    );
    detached(async move {
        let _same_key = same_key;
        let _quiet = quiet;
        creation.await
    })
    .await
}

/// Runs a decided change to its end ([`super::run_to_end`]) and returns its answer; a panic in it
/// is a 500.
async fn detached(work: impl Future<Output = ApiResult> + Send + 'static) -> ApiResult {
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

/// The creation of an admitted operation: durable row, replay filter, permit commit (or refund),
/// live map, executor hand-off. Runs detached, under the per-key lock and the counts gate.
pub(crate) async fn create(
    core: Arc<Core>,
    client: Identity,
    request: Submission,
    permit: crate::Permit,
    needs_approval: bool,
    id: String,
    shared: super::shared::SharedPermit,
) -> ApiResult {
    let now = now_rfc3339();
    let record = OperationRecord {
        id,
        client_id: client.to_string(),
        idempotency_key: request.idempotency_key.clone(),
        operation: request.operation.clone(),
        target: request.target.clone(),
        arguments: request.arguments.clone(),
        reason: request.reason.clone(),
        state: if needs_approval {
            OperationState::Pending
        } else {
            OperationState::Approved
        },
        created_at: now.clone(),
        updated_at: now,
        terminal_at: None,
        error: None,
        revision: 1,
        broker: core.db.broker().to_owned(),
    };
    let inserted = core.db.insert(record.clone()).await;
    if matches!(inserted, Ok(()) | Err(InsertError::Duplicate)) {
        // Before the per-key lock is released, so the next submission with this key looks it up.
        core.keys.insert(client.as_str(), &request.idempotency_key);
    }
    match inserted {
        Ok(()) => {}
        Err(InsertError::Duplicate) => {
            // Another process or path created it first: this request is a replay after all.
            permit.refund();
            shared.refund().await;
            let existing = core
                .db
                .find_by_key(client.as_str(), &request.idempotency_key)
                .await
                .map_err(ApiError::store)?
                .ok_or_else(|| ApiError::store(StoreError::new("duplicate key vanished")))?;
            return replay(&core, existing, &request);
        }
        Err(InsertError::Store(err)) => {
            permit.refund();
            shared.refund().await;
            return Err(ApiError::store(err));
        }
    }
    let op = Arc::new(LiveOp::new(&record, permit.commit()));
    shared.commit_into(&op.shared);
    core.live_ops().insert(record.id.clone(), Arc::clone(&op));
    core.count_submission("created");
    tracing::info!(
        operation = %record.id,
        client = %client,
        to = %record.state,
        "operation created"
    );
    if record.state == OperationState::Approved {
        core.executor.enqueue(op);
    }
    let mut response = json_response(StatusCode::ACCEPTED, record.to_json());
    if let Ok(location) = HeaderValue::from_str(&format!("/api/agent/v1/operations/{}", record.id))
    {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(ratelimit::answer(&core, client.as_str(), response, None))
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

async fn get_own(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    let client = core.auth.client(&headers)?;
    let id = path_id(id)?;
    let record = own_record(&core, client, &id).await?;
    Ok(json_response(StatusCode::OK, record.to_json()))
}

async fn cancel(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    let client = core.auth.client(&headers)?;
    let id = path_id(id)?;
    own_record(&core, client, &id).await?;
    let Some(op) = core.live_op(&id) else {
        // Terminal: canceling changes nothing. Read again, after the live lookup, so the answer
        // is not older than the terminal transition.
        let record = own_record(&core, client, &id).await?;
        return Ok(json_response(StatusCode::OK, record.to_json()));
    };
    // Decided: the write and the handle's move run to their end even if the client hangs up.
    match transition_to_end(&core, op, OperationState::Canceled).await {
        Ok(record) => Ok(json_response(StatusCode::OK, record.to_json())),
        Err(TransitionFailure::NotAllowed(OperationState::Executing)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "operation_not_cancelable",
            "The operation is executing and cannot be canceled.",
        )),
        Err(TransitionFailure::NotAllowed(_)) => {
            let record = own_record(&core, client, &id).await?;
            Ok(json_response(StatusCode::OK, record.to_json()))
        }
        Err(TransitionFailure::Store(err)) => Err(ApiError::store(err)),
    }
}

/// Runs [`Core::transition`] detached ([`super::run_to_end`]) and returns its outcome.
async fn transition_to_end(
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

async fn list_pending(State(core): State<Arc<Core>>, headers: HeaderMap) -> ApiResult {
    core.auth.operator(&headers)?;
    let records = core
        .db
        .list_in_state(OperationState::Pending, LIST_LIMIT)
        .await
        .map_err(ApiError::store)?;
    let requests: Vec<Value> = records.iter().map(OperationRecord::to_json).collect();
    Ok(json_response(StatusCode::OK, json!({"requests": requests})))
}

async fn decide(
    core: &Arc<Core>,
    headers: &HeaderMap,
    id: Result<Path<String>, PathRejection>,
    to: OperationState,
) -> ApiResult {
    core.auth.operator(headers)?;
    let id = &path_id(id)?;
    let not_pending = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "request_not_pending",
            "The request is not pending.",
        )
    };
    if core.db.get(id).await.map_err(ApiError::store)?.is_none() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "request_not_found",
            "No such request.",
        ));
    }
    let op = core.live_op(id).ok_or_else(not_pending)?;
    if op.handle.state() != OperationState::Pending {
        return Err(not_pending());
    }
    // Decided: the write and the handle's move run to their end even if the operator hangs up.
    match transition_to_end(core, op, to).await {
        Ok(record) => Ok(json_response(StatusCode::OK, record.to_json())),
        Err(TransitionFailure::NotAllowed(_)) => Err(not_pending()),
        Err(TransitionFailure::Store(err)) => Err(ApiError::store(err)),
    }
}

async fn approve(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    decide(&core, &headers, id, OperationState::Approved).await
}

async fn deny(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    decide(&core, &headers, id, OperationState::Denied).await
}

async fn upload_stream(State(core): State<Arc<Core>>, headers: HeaderMap, body: Body) -> ApiResult {
    let client = core.auth.client(&headers)?.clone();
    let declared = content_length(&headers)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::LENGTH_REQUIRED,
            "length_required",
            "A stream upload needs a Content-Length.",
        )
    })?;
    // From here on everything runs detached, reading the body included: a client that hangs up
    // mid-body is a body error there, and the same task removes the file and releases the room.
    detached(store_stream(core, client, declared, body)).await
}

/// Reserves room for a stream, writes its body, then records it; or, if the body or the store
/// fails, removes the file and releases the room. Runs detached.
async fn store_stream(core: Arc<Core>, client: Identity, declared: u64, body: Body) -> ApiResult {
    let id = new_id("st");
    // Reserve before reading a byte: a full store refuses without taking the body. The room is
    // recorded as an upload in progress in the same gated step, so drift counts it as stored.
    let reservation = {
        let _quiet = core.hold_counts().await;
        let reservation = core
            .controller
            .reserve_storage(client.as_str(), Store::Stream, declared)
            .map_err(|refusal| {
                tracing::info!(
                    client = %client,
                    code = refusal.code.as_str(),
                    retry_after = refusal.retry_after_secs(),
                    "stream refused"
                );
                ApiError::refused(refusal)
            })?;
        core.uploads()
            .insert(id.clone(), (client.to_string(), declared));
        reservation
    };
    let dir = core.db.streams_dir();
    let path = dir.join(&id);
    let written = write_stream(&dir, &path, body, declared).await;

    // The body is complete (or never will be): settle or undo, under the gate.
    let _quiet = core.hold_counts().await;
    core.uploads().remove(&id);
    // Undoing: the file goes; dropping the reservation or the stored object releases its room.
    async fn undo(path: &std::path::Path, err: ApiError) -> ApiResult {
        let _ = tokio::fs::remove_file(path).await;
        Err(err)
    }
    let size = match written {
        Ok(size) => size,
        Err(err) => {
            drop(reservation);
            return undo(&path, err).await;
        }
    };
    let stored = match reservation.settle(size) {
        Ok(stored) => stored,
        Err(refusal) => return undo(&path, ApiError::refused(refusal)).await,
    };
    let row = StreamRecord {
        id: id.clone(),
        client_id: client.to_string(),
        size,
    };
    if let Err(err) = core.db.insert_stream(row).await {
        drop(stored);
        return undo(&path, ApiError::store(err)).await;
    }
    core.stored_streams().insert(id.clone(), stored);
    tracing::info!(stream = %id, client = %client, size, "stream stored");
    let mut response = json_response(StatusCode::CREATED, json!({"id": id, "size": size}));
    if let Ok(location) = HeaderValue::from_str(&format!("/api/agent/v1/streams/{id}")) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// Writes at most `declared` bytes of `body` to `path` (synced); a body of another length is
/// refused.
async fn write_stream(
    dir: &std::path::Path,
    path: &std::path::Path,
    mut body: Body,
    declared: u64,
) -> Result<u64, ApiError> {
    let io_error = |err: std::io::Error| ApiError::store(StoreError::new(err.to_string()));
    tokio::fs::create_dir_all(dir).await.map_err(io_error)?;
    let mut file = tokio::fs::File::create(path).await.map_err(io_error)?;
    let mut size: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ApiError::invalid("The request body could not be read."))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        size += data.len() as u64;
        if size > declared {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "The body is longer than its Content-Length.",
            ));
        }
        file.write_all(&data).await.map_err(io_error)?;
    }
    if size != declared {
        return Err(ApiError::invalid(
            "The body is shorter than its Content-Length.",
        ));
    }
    file.sync_all().await.map_err(io_error)?;
    Ok(size)
}

async fn delete_stream(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    let client = core.auth.client(&headers)?;
    let id = path_id(id)?;
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "stream_not_found", "No such stream.");
    match core.db.get_stream(&id).await.map_err(ApiError::store)? {
        Some(stream) if stream.client_id == client.as_str() => {}
        _ => return Err(not_found()),
    }
    // Decided: row, file and room go together, whether or not the client waits.
    let client = client.clone();
    detached(async move {
        let _quiet = core.hold_counts().await;
        if !core.db.delete_stream(&id).await.map_err(ApiError::store)? {
            return Err(not_found());
        }
        let _ = tokio::fs::remove_file(core.db.streams_dir().join(&id)).await;
        if let Some(object) = core.stored_streams().remove(&id) {
            object.release();
        }
        tracing::info!(stream = %id, client = %client, "stream deleted");
        Ok(json_response(
            StatusCode::OK,
            json!({"id": id, "deleted": true}),
        ))
    })
    .await
}

/// `GET /api/operator/v1/drift` (operator): compares the controller's counts with the store now
/// and answers the report, `{"drift": N, "differences": [...]}` (see [`super::DriftReport::to_json`]).
async fn drift(State(core): State<Arc<Core>>, headers: HeaderMap) -> ApiResult {
    core.auth.operator(&headers)?;
    let report = super::drift::check(&core).await.map_err(ApiError::store)?;
    Ok(json_response(StatusCode::OK, report.to_json()))
}

async fn healthz() -> Response {
    json_response(StatusCode::OK, json!({"ok": true}))
}

/// How long `/readyz` waits for the store before answering 503.
const READY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Ready when the store would take a write within [`READY_DEADLINE`]; a broker that cannot make
/// a submission durable is taken out of rotation.
async fn readyz(State(core): State<Arc<Core>>) -> ApiResult {
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

async fn metrics(State(core): State<Arc<Core>>, headers: HeaderMap) -> ApiResult {
    core.auth.operator(&headers)?;
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

    #[test]
    fn error_messages_are_cut_to_the_contracts_500_characters() {
        let long = ApiError::invalid(format!("Unknown query parameter {:?}.", "é".repeat(900)));
        assert_eq!(long.message.chars().count(), MAX_MESSAGE_CHARS);
        assert!(long.message.ends_with('…'));
        assert_eq!(ApiError::invalid("short").message, "short");
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
