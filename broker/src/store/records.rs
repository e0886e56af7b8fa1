//! The records the store keeps and answers with, in the store's own words: an operation
//! ([`OperationRecord`]) and the slices of it a page, a replay or a decision reads, the changes a
//! transition writes, and what start-up finds. Every backend (`sqlite`, `postgres`) reads and
//! writes exactly these; none of them knows HTTP or JSON answers.

use std::time::SystemTime;

use serde_json::Value;

use unyolo_admission::engine::OperationState;

use super::digest::request_digest;
use super::streams::StreamRecord;

/// The broker name an operation shows when none is configured.
pub const DEFAULT_BROKER_NAME: &str = "admission";

/// The current time in RFC 3339 (UTC, milliseconds): the one clock every stored time is written
/// with, fixed width, so text order is time order.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// The error an operation ended with, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperationError {
    /// A stable code, e.g. `execution_interrupted`.
    pub code: String,
    /// A sentence for people.
    pub message: String,
}

impl OperationError {
    /// The error of an operation found executing with nobody running it (the broker stopped, or
    /// its replica's membership lapsed, while it executed): it may have run, so it is never run
    /// again.
    pub fn interrupted() -> OperationError {
        OperationError {
            code: "execution_interrupted".to_owned(),
            message: "The broker stopped while the operation was executing; it was not run again."
                .to_owned(),
        }
    }

    /// The error an operation ends with when it is ended before it ran by a decision, as
    /// upstream's Agent V1 runtime reports it: denied → `operation_approval_denied`; canceled
    /// (by its client, or its approval revoked by an operator) → `operation_canceled`. `None`
    /// for any other move.
    pub fn ended_by_decision(to: OperationState) -> Option<OperationError> {
        let (code, message) = match to {
            OperationState::Denied => ("operation_approval_denied", "Approval was denied"),
            OperationState::Canceled => ("operation_canceled", "Request was canceled"),
            _ => return None,
        };
        Some(OperationError {
            code: code.to_owned(),
            message: message.to_owned(),
        })
    }
}

/// What an operator reads in the inbox about an operation (the Agent V1 `presentation`): derived
/// from the request once, at creation, and stored with it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Presentation {
    /// One line, 1 to 160 characters.
    pub title: String,
    /// At most 500 characters; `None` when there is nothing to say.
    pub summary: Option<String>,
}

/// Who decided an operation, when and for whom: an operator's approve, deny or revoke, or the
/// client's own cancel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided {
    /// RFC 3339, UTC.
    pub at: String,
    /// The operator's name, or the client id for the client's cancel.
    pub by: String,
    /// Whom the operator decided for (a decision's `on_behalf_of`), if anyone.
    pub on_behalf_of: Option<String>,
    /// Whether the decision took back an approval (a revoke, or a cancel of approved work).
    pub revoked: bool,
}

/// Who makes a state change, for the change to record ([`Decided`] without the time, which the
/// store stamps).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionMark {
    /// The operator's name, or the client id.
    pub by: String,
    /// Whom the operator decides for.
    pub on_behalf_of: Option<String>,
    /// Whether it takes back an approval.
    pub revoked: bool,
    /// For an approval: how long it stays good if the operation has not started (the record's
    /// `active_expires_at` becomes the decision's time plus this). `None` leaves it as it is.
    pub lasts: Option<std::time::Duration>,
}

/// What a state change writes besides the state: the error a failure ends with, and who decided
/// (for decisions and cancels).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateChange {
    /// Why it failed (for a move to `failed`).
    pub error: Option<OperationError>,
    /// Who decided, if this change is a decision.
    pub decision: Option<DecisionMark>,
}

impl StateChange {
    /// A change carrying `error` only.
    pub fn error(error: Option<OperationError>) -> StateChange {
        StateChange {
            error,
            decision: None,
        }
    }
}

/// One durable operation, as stored (the broker's `projection` shows it as the API does).
#[derive(Clone, Debug, PartialEq)]
pub struct OperationRecord {
    /// `op_` and 32 hex digits.
    pub id: String,
    /// The client that submitted it.
    pub client_id: String,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// The registered operation name.
    pub operation: String,
    /// A JSON object.
    pub target: Value,
    /// A JSON object.
    pub arguments: Value,
    /// Why the agent asks.
    pub reason: String,
    /// The state.
    pub state: OperationState,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// RFC 3339, UTC.
    pub updated_at: String,
    /// When it reached a terminal state.
    pub terminal_at: Option<String>,
    /// Why it failed, if it did.
    pub error: Option<OperationError>,
    /// 1 at creation, +1 on every change; durable.
    pub revision: u64,
    /// The last decision about it (an operator's, or the client's cancel), if any.
    pub decided: Option<Decided>,
    /// The state a terminal operation left (`None` while live, and for rows older than schema
    /// 6): what tells a revocation from a cancel while pending, and a failure while running
    /// from one before it (see [`super::request_status`]).
    pub ended_from: Option<OperationState>,
    /// When an operator's approval lapses if the operation has not started by then (RFC 3339,
    /// UTC; Operator V1's `active_expires_at`); kept after the approval ends. `None` for work
    /// no operator approved, and for approvals stored before schema 7.
    pub active_expires_at: Option<String>,
    /// When a request nobody decides expires (RFC 3339, UTC; Operator V1's
    /// `pending_expires_at`), fixed at its creation. `None` for work that needs no approval,
    /// and for requests stored before schema 8 (theirs is `created_at` plus the timeout now).
    pub pending_expires_at: Option<String>,
    /// The name of the broker that holds it (not stored: the broker's configured name).
    pub broker: String,
    /// Its presentation, as derived at creation.
    pub presentation: Presentation,
}

/// An operation without its request (`target`, `arguments`, `reason`) and its outcome: what a
/// listing page shows.
#[derive(Clone, Debug, PartialEq)]
pub struct OperationSummary {
    /// `op_` and 32 hex digits.
    pub id: String,
    /// The client that submitted it.
    pub client_id: String,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// The registered operation name.
    pub operation: String,
    /// The state.
    pub state: OperationState,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// RFC 3339, UTC.
    pub updated_at: String,
    /// When it reached a terminal state.
    pub terminal_at: Option<String>,
    /// 1 at creation, +1 on every change; durable.
    pub revision: u64,
    /// The name of the broker that holds it.
    pub broker: String,
    /// Its presentation, as derived at creation.
    pub presentation: Presentation,
}

/// What a replay, a get and a wait read before the operation itself: whose it is, the digest of
/// the request that created it, how many bytes its stored request holds, and its revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRequest {
    /// The operation's id.
    pub id: String,
    /// The client that submitted it.
    pub client_id: String,
    /// The client's idempotency key for it.
    pub idempotency_key: String,
    /// SHA-256 of the canonical request ([`request_digest`](super::request_digest)).
    pub digest: String,
    /// Bytes of its stored `target`, `arguments` and `reason` together.
    pub bytes: u64,
    /// The operation's revision now.
    pub revision: u64,
    /// Whether it has ended (it will not change again).
    pub terminal: bool,
}

impl OperationRecord {
    /// A pending `demo.request` of client `agent` (key `k`), created 2026-01-01T00:00:00Z, at
    /// revision 1, with nothing decided: what a test or a fuzz target starts from and changes
    /// with struct-update syntax.
    #[cfg(any(test, feature = "fuzzing"))]
    #[doc(hidden)]
    pub fn example(id: &str) -> OperationRecord {
        OperationRecord {
            id: id.to_owned(),
            client_id: "agent".to_owned(),
            idempotency_key: "k".to_owned(),
            operation: "demo.request".to_owned(),
            target: Value::Object(serde_json::Map::new()),
            arguments: Value::Object(serde_json::Map::new()),
            reason: String::new(),
            state: OperationState::Pending,
            created_at: "2026-01-01T00:00:00.000Z".to_owned(),
            updated_at: "2026-01-01T00:00:00.000Z".to_owned(),
            terminal_at: None,
            error: None,
            revision: 1,
            decided: None,
            ended_from: None,
            active_expires_at: None,
            pending_expires_at: None,
            broker: DEFAULT_BROKER_NAME.to_owned(),
            presentation: Presentation::default(),
        }
    }

    /// The record as a listing page shows it.
    pub fn summary(&self) -> OperationSummary {
        OperationSummary {
            id: self.id.clone(),
            client_id: self.client_id.clone(),
            idempotency_key: self.idempotency_key.clone(),
            operation: self.operation.clone(),
            state: self.state,
            created_at: self.created_at.clone(),
            updated_at: self.updated_at.clone(),
            terminal_at: self.terminal_at.clone(),
            revision: self.revision,
            broker: self.broker.clone(),
            presentation: self.presentation.clone(),
        }
    }

    /// The digest of the request that created it.
    pub fn request_digest(&self) -> String {
        request_digest(&self.operation, &self.target, &self.arguments, &self.reason)
    }
}

/// What start-up found in the store.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Operations that were executing at the crash, now failed with `execution_interrupted`.
    pub interrupted: Vec<OperationRecord>,
    /// Pending and approved operations, oldest first.
    pub live: Vec<OperationRecord>,
    /// Every stored stream.
    pub streams: Vec<StreamRecord>,
}

/// What a listing page selects: the caller's operations, newest first, after a position.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageQuery {
    /// Only the operation with this idempotency key.
    pub idempotency_key: Option<String>,
    /// Only operations in this state.
    pub state: Option<OperationState>,
    /// Only operations older than this position (the previous page's last).
    pub before: Option<i64>,
    /// At most this many.
    pub limit: u32,
}

/// The columns of one stored operation that a history replay reads (`admission check
/// --history`): whose it was, what it asked for, its state and its times as stored (RFC 3339,
/// UTC; `None` where the column is empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperationTimes {
    /// The client that submitted it.
    pub client_id: String,
    /// The registered operation name (whether it needed approval follows from it).
    pub operation: String,
    /// Its state now.
    pub state: OperationState,
    /// When it was created.
    pub created_at: String,
    /// When the last decision about it was made (an approval, a denial, a revoke, a cancel).
    pub decided_at: Option<String>,
    /// When it reached a terminal state.
    pub terminal_at: Option<String>,
    /// The state a terminal operation left, where recorded.
    pub ended_from: Option<OperationState>,
}

/// The columns [`OperationTimes::from_columns`] reads, in order, each as text (`''` for none).
pub(crate) const HISTORY_SELECT: &str = "SELECT client_id, operation, state, created_at, \
     COALESCE(decided_at, ''), COALESCE(terminal_at, ''), COALESCE(ended_from, '') \
     FROM operations ORDER BY created_at, id";

impl OperationTimes {
    /// One row of [`HISTORY_SELECT`]; `None` for a state that does not parse.
    pub(crate) fn from_columns(columns: [String; 7]) -> Option<OperationTimes> {
        let [
            client_id,
            operation,
            state,
            created_at,
            decided_at,
            terminal_at,
            ended_from,
        ] = columns;
        let some = |text: String| (!text.is_empty()).then_some(text);
        Some(OperationTimes {
            client_id,
            operation,
            state: OperationState::parse(&state)?,
            created_at,
            decided_at: some(decided_at),
            terminal_at: some(terminal_at),
            ended_from: OperationState::parse(&ended_from),
        })
    }
}
