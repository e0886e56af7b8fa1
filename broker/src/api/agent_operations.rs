//! The agent's operation routes (Agent V1 "operations"): submit, get one's own, cancel.
//!
//! A submission goes authenticate → validate → replay → admit → create → commit; from the permit
//! on, the creation runs detached (see the broker module's docs).
//!
//! One file past the usual size: submit, create and cancel share the detached hand-off, the replay
//! and the refusal answers, and read as one sequence.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use serde::Deserialize;
use serde_json::Value;

use super::detached::detached;
use super::error::{ApiError, ApiResult, json_response};
use super::extract::{
    Client, OperationId, is_idempotency_key, is_json_object, own_record, own_rendered, own_request,
    read_body, render_operation, render_room, rendered, reserve_render,
};
use super::operator::projection::pending_expires_at;
use super::presentation;
use super::projection::OperationJson;
use super::ratelimit;
use crate::core::LiveOp;
use crate::core::{Core, Submitted, run_to_end};
use crate::operations::TransitionFailure;
use crate::registry::{self, NotRunnable};
use crate::store::{
    DecisionMark, InsertError, OperationError, OperationRecord, StateChange, StoreError,
    StoredRequest, now_rfc3339, request_digest,
};
use unyolo_admission::admission::{AdmissionPermit, AdmitError, KeyRecord, Refused, Unavailable};
use unyolo_admission::config::Identity;
use unyolo_admission::engine::{OperationState, Permit};

/// Largest operation submission body, in bytes.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Most properties a submission's `target` may have.
pub const MAX_TARGET_PROPERTIES: usize = 32;

/// Most properties a submission's `arguments` may have.
pub const MAX_ARGUMENT_PROPERTIES: usize = 128;

/// Longest submission `operation` name, in characters.
pub const MAX_OPERATION_CHARS: usize = 128;

/// Longest submission `reason`, in characters.
pub const MAX_REASON_CHARS: usize = 2000;

/// A submission body: every field required, unknown fields refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Submission {
    pub(crate) idempotency_key: String,
    pub(crate) operation: String,
    #[serde(deserialize_with = "super::strict_json::value")]
    pub(crate) target: Value,
    #[serde(deserialize_with = "super::strict_json::value")]
    pub(crate) arguments: Value,
    pub(crate) reason: String,
}

/// A validated submission: the request and whether it needs approval.
pub(crate) struct Validated {
    pub(crate) request: Submission,
    pub(crate) needs_approval: bool,
}

pub(crate) fn validate(bytes: &[u8]) -> Result<Validated, ApiError> {
    let mut request: Submission = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::invalid(format!("The request body is not a valid submission: {e}"))
    })?;
    if !is_json_object(bytes) {
        return Err(ApiError::invalid(
            "The request body is not a valid submission: a submission is a JSON object.",
        ));
    }
    // Whitespace around the key and the reason is not part of them, as upstream's broker trims
    // both before it judges and stores them (its length bound is on the reason as sent).
    let reason_chars = request.reason.chars().count();
    trim(&mut request.idempotency_key);
    trim(&mut request.reason);
    if !is_idempotency_key(&request.idempotency_key) {
        return Err(ApiError::invalid(
            "idempotency_key must match ^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$.",
        ));
    }
    // Characters, as the contract's JSON Schema counts a string's length. A name out of these
    // bounds is a bad request, not an unregistered operation (the contract's `operation` is 1 to
    // 128 characters).
    if !(1..=MAX_OPERATION_CHARS).contains(&request.operation.chars().count()) {
        return Err(ApiError::invalid("operation must be 1 to 128 characters."));
    }
    if request.reason.is_empty() || reason_chars > MAX_REASON_CHARS {
        return Err(ApiError::invalid(
            "reason must be 1 to 2000 characters, not only whitespace.",
        ));
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
    let needs_approval =
        registry::judge(&request.operation, &request.arguments).map_err(|why| match why {
            NotRunnable::NotRegistered => ApiError::new(
                StatusCode::BAD_REQUEST,
                "operation_not_registered",
                "This broker has no such operation.",
            ),
            // The body is well formed; its operation refuses these arguments. unYOLO's runtime
            // answers an operation's own input check with this code, not `invalid_request`.
            NotRunnable::Duration => ApiError::new(
                StatusCode::BAD_REQUEST,
                "operation_input_invalid",
                "arguments.duration_ms must be an integer from 0 to 600000.",
            ),
        })?;
    Ok(Validated {
        request,
        needs_approval,
    })
}

/// `text` without its leading and trailing whitespace (Unicode's, as Go's `strings.TrimSpace`).
fn trim(text: &mut String) {
    let trimmed = text.trim();
    if trimmed.len() != text.len() {
        *text = trimmed.to_owned();
    }
}

impl Submission {
    /// The digest of this request ("the same request up to JSON key order").
    fn digest(&self) -> String {
        request_digest(&self.operation, &self.target, &self.arguments, &self.reason)
    }
}

/// The answer to a submission whose key names `existing`: 409 `idempotency_conflict` when
/// `existing` was created by another request (judged by the stored digest alone, nothing of it
/// read or parsed), else the replay, 200 with the operation, rendered within the budget.
/// `Ok(None)` when the operation was retired between the lookup and the read: the key is free,
/// and the submission is new work.
pub(crate) async fn replay(
    core: &Core,
    existing: &StoredRequest,
    request: &Submission,
) -> Result<Option<axum::response::Response>, ApiError> {
    if existing.digest != request.digest() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "idempotency_conflict",
            "This idempotency key was used for a different request.",
        ));
    }
    let Some(response) = render_operation(core, existing, StatusCode::OK).await? else {
        return Ok(None);
    };
    core.count_submission(Submitted::Replayed);
    // The quota as the deciding backend sees it now: replicated, every replica's counts and the
    // shared bucket (a replay decides nothing, so there is no decision's reading to carry).
    Ok(Some(
        match core.admission.quota_now(&existing.client_id).await {
            Some(quota) => ratelimit::with_status(response, &quota, None),
            None => response,
        },
    ))
}

/// The answer to `request` if the store holds an operation under its client and key (see
/// [`replay`]); `None` if it holds none (or it was retired meanwhile).
async fn stored_replay(
    core: &Core,
    client: &Identity,
    request: &Submission,
) -> Result<Option<axum::response::Response>, ApiError> {
    match core
        .db
        .request_by_key(client.as_str(), &request.idempotency_key)
        .await?
    {
        Some(existing) => replay(core, &existing, request).await,
        None => Ok(None),
    }
}

pub(crate) async fn submit(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    // The body's room in the buffered-bytes budget is held until the submission is answered.
    let (bytes, _buffered) = read_body(&core.budget, &headers, body, MAX_BODY_BYTES).await?;
    let Validated {
        request,
        needs_approval,
    } = validate(&bytes)?;

    // Same client and key: one at a time, so concurrent duplicates create one operation. Held
    // until the operation is created (or not), inside the detached part below.
    let same_key = core
        .key_lock(client.as_str(), &request.idempotency_key)
        .await;

    if core
        .keys
        .may_contain(client.as_str(), &request.idempotency_key)
        && let Some(answer) = stored_replay(&core, &client, &request).await?
    {
        return Ok(answer);
    }

    // The decision, the same call for both backends. In-process it completes at once;
    // replicated it awaits Redis, and a client hanging up there drops it harmlessly (the
    // admission releases whatever the script reserved, key binding included). From the permit on
    // there is no `.await` until the creation is detached, so a permit is never dropped by a
    // hangup.
    let mut unbound = false;
    let (permit, quiet) = loop {
        let quiet = core.hold_counts().await;
        let admitted = core
            .admission
            .admit(
                client.as_str(),
                needs_approval,
                Some(&request.idempotency_key),
            )
            .await;
        match admitted {
            Ok(permit) => break (permit, quiet),
            Err(AdmitError::Refused(refusal)) => {
                core.judge_in_shadow(client.as_str(), needs_approval, false);
                return Ok(refused(&core, &client, refusal));
            }
            Err(AdmitError::Replay { operation, replica }) => {
                drop(quiet);
                match replayed_elsewhere(&core, &client, &request, &operation, &replica).await? {
                    Elsewhere::Answer(answer) => return answer,
                    // Unbound once, the key is decided afresh; a second time it is another
                    // request's doing (a key bound anew meanwhile), and answered as it stands.
                    Elsewhere::Stale if !unbound => {
                        unbound = true;
                        unbind(&core, &client, &request, &operation).await?;
                    }
                    Elsewhere::Stale => return Err(elsewhere(&operation, &replica)),
                }
            }
            Err(AdmitError::Unavailable(unavailable)) => {
                return Err(admission_unavailable(&core, &client, &unavailable));
            }
        }
    };
    // The shadow judges after the real decision, which it never changes.
    let shadow = core.judge_in_shadow(client.as_str(), needs_approval, true);
    let creation = create(Arc::clone(&core), client, request, permit, shadow);
    detached(async move {
        let _same_key = same_key;
        let _quiet = quiet;
        creation.await
    })
    .await
}

/// 503 `admission_unavailable`: the shared quota store cannot decide now.
fn admission_unavailable(core: &Core, client: &Identity, unavailable: &Unavailable) -> ApiError {
    core.count_submission(Submitted::Rejected);
    tracing::warn!(client = %client, error = %unavailable, "admission unavailable");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        Unavailable::CODE,
        "Admission cannot be decided right now (the shared quota store does not answer); retry \
         later.",
    )
    .with_retry_after(unavailable.retry_after_secs())
}

/// What a key bound to another admission's operation comes to.
enum Elsewhere {
    /// The answer: this replica's store holds the operation (a replay, or 409
    /// `idempotency_conflict`), or another replica does (409 `idempotency_key_elsewhere`).
    Answer(ApiResult),
    /// The key names an operation of this very replica that its store does not hold and that
    /// is not live here: it stopped between the shared admission and the row (a crash, a
    /// shutdown with the release still kept), or the admission's answer was lost and its release
    /// is still kept. Nothing will ever answer for it; the key is free to unbind.
    Stale,
}

/// The key names an operation another admission made: a replay if this replica's store has it
/// (the same client and key), else where it lives — or, when that is this replica and nothing
/// here holds it, a stale binding.
async fn replayed_elsewhere(
    core: &Core,
    client: &Identity,
    request: &Submission,
    operation: &str,
    replica: &str,
) -> Result<Elsewhere, ApiError> {
    if let Some(answer) = stored_replay(core, client, request).await? {
        return Ok(Elsewhere::Answer(Ok(answer)));
    }
    // Under the key's lock no creation for this key is under way here, so an operation of this
    // replica that is neither stored nor live never will be.
    if core.admission.replica() == Some(replica) && core.live_op(operation).is_none() {
        return Ok(Elsewhere::Stale);
    }
    if core.db.is_shared() {
        return replayed_from_the_fleet(core, client, request, operation, replica).await;
    }
    Ok(Elsewhere::Answer(Err(elsewhere(operation, replica))))
}

/// How long a replay waits for another replica to commit the operation its key names.
const CREATION_ELSEWHERE: std::time::Duration = std::time::Duration::from_secs(2);

/// On a store the fleet shares, a key another replica bound is that replica's creation under
/// way: the replay waits (briefly) for its row and answers it. A replica whose membership
/// lapsed will never commit it: the binding is stale. One still creating past the wait: 503
/// with Retry-After, never `idempotency_key_elsewhere`.
async fn replayed_from_the_fleet(
    core: &Core,
    client: &Identity,
    request: &Submission,
    operation: &str,
    replica: &str,
) -> Result<Elsewhere, ApiError> {
    let deadline = tokio::time::Instant::now() + CREATION_ELSEWHERE;
    loop {
        if !core
            .db
            .live_members()
            .await?
            .iter()
            .any(|member| member == replica)
        {
            // Read the store once more: it may have committed just before it stopped.
            if let Some(answer) = stored_replay(core, client, request).await? {
                return Ok(Elsewhere::Answer(Ok(answer)));
            }
            return Ok(Elsewhere::Stale);
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        if let Some(answer) = stored_replay(core, client, request).await? {
            return Ok(Elsewhere::Answer(Ok(answer)));
        }
    }
    Ok(Elsewhere::Answer(Err(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store_unavailable",
        format!(
            "This idempotency key names operation {operation}, which broker replica {replica} \
             is still creating; retry shortly to read it."
        ),
    )
    .with_retry_after(1))))
}

fn elsewhere(operation: &str, replica: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "idempotency_key_elsewhere",
        format!(
            "This idempotency key names operation {operation}, held by broker replica \
             {replica}; its reads, waits and cancels are answered there."
        ),
    )
}

/// Unbinds `request`'s key from `operation` on every replica (only if it still names it: a key
/// bound since to new work is left alone), so the submission is decided afresh.
async fn unbind(
    core: &Core,
    client: &Identity,
    request: &Submission,
    operation: &str,
) -> Result<(), ApiError> {
    tracing::warn!(
        client = %client,
        operation,
        "idempotency key bound to an operation this replica never stored: unbound"
    );
    let record = KeyRecord {
        client: client.clone(),
        key: request.idempotency_key.clone(),
        operation: operation.to_owned(),
    };
    core.admission
        .retire_keys(&[record])
        .await
        .map_err(|unavailable| admission_unavailable(core, client, &unavailable))
}

/// The creation of an admitted operation: durable row, replay filter, permit commit (or refund;
/// the shadow's permit, if any, with it),
/// live map, executor hand-off. Runs detached, under the per-key lock and the counts gate.
pub(crate) async fn create(
    core: Arc<Core>,
    client: Identity,
    request: Submission,
    permit: AdmissionPermit,
    shadow: Option<Permit>,
) -> ApiResult {
    let now = now_rfc3339();
    // Fixed now, as upstream fixes each grant's: a later timeout moves no deadline shown.
    let pending_until = permit
        .needs_approval()
        .then(|| pending_expires_at(&now, core.pending_timeout))
        .flatten();
    let shown = presentation::derive(
        &request.operation,
        &request.target,
        &request.arguments,
        &request.reason,
    );
    let record = OperationRecord {
        id: permit.id().to_string(),
        client_id: client.to_string(),
        idempotency_key: request.idempotency_key.clone(),
        operation: request.operation.clone(),
        target: request.target.clone(),
        arguments: request.arguments.clone(),
        reason: request.reason.clone(),
        state: if permit.needs_approval() {
            OperationState::Pending
        } else {
            OperationState::Approved
        },
        created_at: now.clone(),
        updated_at: now,
        terminal_at: None,
        error: None,
        revision: 1,
        decided: None,
        ended_from: None,
        active_expires_at: None,
        pending_expires_at: pending_until,
        broker: core.db.broker().to_owned(),
        presentation: shown,
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
            permit.refund().await;
            if let Some(shadow) = shadow {
                shadow.refund();
            }
            let vanished = || ApiError::from(StoreError::new("duplicate key vanished"));
            let existing = core
                .db
                .request_by_key(client.as_str(), &request.idempotency_key)
                .await?
                .ok_or_else(vanished)?;
            return replay(&core, &existing, &request)
                .await?
                .ok_or_else(vanished);
        }
        Err(InsertError::Store(err)) => {
            permit.refund().await;
            if let Some(shadow) = shadow {
                shadow.refund();
            }
            return Err(err.into());
        }
    }
    crate::stops::after_insert(&request.idempotency_key);
    // Replicated, the answer's quota fields are the shared decision's (every replica's counts).
    let decided = permit.quota();
    let op = Arc::new(LiveOp::new(&record, permit.commit()).shadowed(shadow.map(Permit::commit)));
    core.add_live(&op, &record);
    core.count_submission(Submitted::Created);
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
    Ok(match decided {
        Some(quota) => ratelimit::with_status(response, &quota, None),
        None => ratelimit::answer(&core, client.as_str(), response, None),
    })
}

pub(crate) async fn get_own(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    OperationId(id): OperationId,
) -> ApiResult {
    own_rendered(&core, &client, &id).await
}

pub(crate) async fn cancel(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    OperationId(id): OperationId,
) -> ApiResult {
    let client = &client;
    // Its size, state and key first (ownership too), without reading it whole.
    let request = own_request(&core, client, &id).await?;
    let room = render_room(request.bytes);
    let live = core
        .live_once_created_of(
            &request.id,
            &request.client_id,
            &request.idempotency_key,
            request.terminal,
        )
        .await;
    // Decided before any room is asked for: the agents' buffered-bytes budget may be full (a cancel
    // is exempt from the fairness share, not from that budget), and a cancel must take effect even
    // then (an exempt path keeps working under any load). The write and the handle's move run to
    // their end even if the client hangs up. The client decides its own cancel: it is `decided_by`
    // (a cancel of approved work revokes).
    let change = StateChange {
        error: OperationError::ended_by_decision(OperationState::Canceled),
        decision: Some(DecisionMark {
            by: client.as_str().to_owned(),
            on_behalf_of: None,
            revoked: false,
            lasts: None,
        }),
    };
    let moved = match live {
        Some(op) => {
            core.transition_to_end(op, OperationState::Canceled, change)
                .await
        }
        // Another replica's operation (a shared store): the row moves here, its owner follows.
        None if !request.terminal && core.owned_elsewhere(&id) => {
            let core = Arc::clone(&core);
            let id = id.clone();
            run_to_end(async move {
                core.move_in_store(&id, OperationState::Canceled, change)
                    .await
            })
            .await
            .unwrap_or_else(|err| {
                Err(TransitionFailure::Store(StoreError::unfinished(
                    "the cancel",
                    err,
                )))
            })
        }
        // Terminal: canceling changes nothing, so it is a read of the operation, with room in
        // the buffered-bytes budget reserved before the row is read (after the live lookup, so
        // the answer is not older than the terminal transition).
        None => return terminal_answer(&core, client, &id, room).await,
    };
    match moved {
        // Canceled. Its answer is rendered within the budget like any other; without room in
        // time it is a retryable 503 that says the cancel took effect (a retry reads it).
        Ok(record) => match reserve_render(&core, room).await {
            Ok(reservation) => Ok(rendered(StatusCode::OK, record.into_json(), reservation)),
            Err(_) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "response_budget_exhausted",
                "The operation is canceled, but the broker holds as many bytes of answers as it \
                 may buffer; retry the cancel shortly to read it.",
            )
            .with_retry_after(1)),
        },
        Err(TransitionFailure::NotAllowed(OperationState::Executing)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "operation_not_cancelable",
            "The operation is executing and cannot be canceled.",
        )),
        // Ended meanwhile (a decision, an expiry, the work's end): a read of it, as above.
        Err(TransitionFailure::NotAllowed(_)) => terminal_answer(&core, client, &id, room).await,
        Err(TransitionFailure::Store(err)) => Err(err.into()),
    }
}

/// The answer to a cancel of an operation that has ended: the operation read whole, `room`
/// reserved in the buffered-bytes budget before it is read, as a read of it takes.
async fn terminal_answer(core: &Core, client: &Identity, id: &str, room: usize) -> ApiResult {
    let reservation = reserve_render(core, room).await?;
    let record = own_record(core, client, id).await?;
    Ok(rendered(StatusCode::OK, record.into_json(), reservation))
}

/// The pace of the refusal log: at most one line a second, saying how many refusals went
/// unlogged before it. A flood of refusals is the path that exists to be cheap, and a line a
/// refusal (formatted, then written to stderr under its lock) was the largest part of its cost;
/// every refusal is still counted (`broker_submissions_total{result="rejected"}`).
struct RefusalLog {
    /// The second (of the Unix epoch) of the last line logged.
    second: AtomicU64,
    /// Refusals not logged since that line.
    unlogged: AtomicU64,
}

static REFUSAL_LOG: RefusalLog = RefusalLog {
    second: AtomicU64::new(0),
    unlogged: AtomicU64::new(0),
};

impl RefusalLog {
    /// Whether this refusal is logged, and if it is, how many went unlogged before it.
    fn take(&self, now: SystemTime) -> Option<u64> {
        let second = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        // Relaxed: the second and the count are independent numbers; a line that reports a
        // refusal a moment late or early is still true about the second.
        let last = self.second.load(Ordering::Relaxed);
        if last != second
            && self
                .second
                .compare_exchange(last, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.unlogged.swap(0, Ordering::Relaxed));
        }
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// A refused submission as the client sees it: counted, logged (at most a line a second:
/// [`RefusalLog`]), and answered with its code, Retry-After and the quota fields of the decision
/// that refused it (the in-process and the shared backend alike).
fn refused(core: &Core, client: &Identity, refused: Refused) -> axum::response::Response {
    let refusal = refused.refusal;
    core.count_submission(Submitted::Rejected);
    if let Some(unlogged) = REFUSAL_LOG.take(SystemTime::now()) {
        tracing::info!(
            client = %client,
            code = refusal.code.as_str(),
            retry_after = refusal.retry_after_secs(),
            unlogged_before = unlogged,
            "submission refused"
        );
    }
    let response = ApiError::refused(refusal).into_response();
    match refused.quota {
        Some(quota) => ratelimit::with_status(response, &quota, Some(&refusal)),
        None => ratelimit::answer(core, client.as_str(), response, Some(&refusal)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(reason: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "idempotency_key": "k",
            "operation": "demo.run",
            "target": {},
            "arguments": {},
            "reason": reason,
        }))
        .unwrap()
    }

    #[test]
    fn a_reason_is_bounded_in_characters_not_bytes() {
        // Found by the submission fuzz target's seeds: 2000 two-byte characters were refused.
        assert!(validate(&body(&"é".repeat(2000))).is_ok());
        assert!(validate(&body(&"🦀".repeat(2000))).is_ok());
        let err = validate(&body(&"é".repeat(2001))).err().expect("refused");
        assert_eq!(err.code(), "invalid_request");
        assert_eq!(
            err.message(),
            "reason must be 1 to 2000 characters, not only whitespace."
        );
        assert!(validate(&body("")).is_err());
        assert!(
            validate(&body(" \u{3000}\n")).is_err(),
            "Unicode whitespace only"
        );
        // The bound is on the reason as sent, as upstream's is; what is kept is trimmed.
        assert!(validate(&body(&format!(" {} ", "r".repeat(1999)))).is_err());
        let Ok(kept) = validate(&body(" why ")) else {
            panic!("refused");
        };
        assert_eq!(kept.request.reason, "why");
    }

    #[test]
    fn a_submission_is_an_object_never_an_array_of_its_fields_in_order() {
        let fields = br#"["k1","demo.run",{"repo":"a/b"},{"duration_ms":1},"why"]"#;
        for bytes in [&fields[..], b" \n\t[\"k1\",\"demo.run\",{},{},\"why\"]"] {
            let err = validate(bytes).err().expect("refused");
            assert_eq!(err.code(), "invalid_request");
            assert_eq!(
                err.message(),
                "The request body is not a valid submission: a submission is a JSON object."
            );
        }
        assert!(validate(&body("why")).is_ok());
    }
}

#[cfg(test)]
mod refusal_log_tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_refusal_log_writes_a_line_a_second_counting_those_it_left_out() {
        let log = RefusalLog {
            second: AtomicU64::new(0),
            unlogged: AtomicU64::new(0),
        };
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        assert_eq!(log.take(at), Some(0));
        assert_eq!(log.take(at + Duration::from_millis(300)), None);
        assert_eq!(log.take(at + Duration::from_millis(900)), None);
        assert_eq!(log.take(at + Duration::from_secs(1)), Some(2));
        assert_eq!(log.take(at + Duration::from_secs(1)), None);
        assert_eq!(log.take(at + Duration::from_secs(5)), Some(1));
    }
}
