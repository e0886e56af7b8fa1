//! Operators' decisions, in the store's words: the idempotency scope a decision is recorded
//! under, the command, the move a judge allows, and how a decision ended. A backend judges and
//! commits a decision in one transaction: the idempotency record is looked up, then the request,
//! then the caller's judge (revision, transition, constraints: the contract's rules, which the
//! store does not know) says what to write, and the state change and the decision's record
//! commit together, or nothing does.

use unyolo_admission::engine::OperationState;

use super::records::OperationRecord;

/// Where a decision's idempotency record lives: the request, the action and the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionScope {
    /// The request (operation) id.
    pub request_id: String,
    /// `approve`, `deny` or `revoke`.
    pub action: String,
    /// The decision's idempotency key (trimmed).
    pub idempotency_key: String,
}

/// A decision to judge and, if the judge allows it, commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionCommand {
    /// Its idempotency scope.
    pub scope: DecisionScope,
    /// The hash of the whole normalized command (operator included): a replay must match it.
    pub command_hash: String,
    /// The operator deciding.
    pub operator: String,
    /// Whom the operator decides for.
    pub on_behalf_of: Option<String>,
}

/// The move a judge allows: from the stored state to `to`, and whether it takes back an
/// approval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecidedMove {
    /// The state the request moves to.
    pub to: OperationState,
    /// Whether it takes back an approval (a revoke).
    pub revoked: bool,
    /// For an approval: how long it stays good if the operation has not started (see
    /// [`DecisionMark::lasts`](super::records::DecisionMark::lasts)).
    pub lasts: Option<std::time::Duration>,
}

/// How a decision ended in the store.
#[derive(Debug)]
pub enum DecisionOutcome<R> {
    /// The same command was committed before: what it committed, as rendered then.
    Replayed(String),
    /// The scope holds another command.
    IdempotencyConflict,
    /// No such request.
    NotFound,
    /// The judge refused (nothing written); the request as it is.
    Refused(R, OperationRecord),
    /// Committed: the request as it is now, and its rendering (also stored for replays).
    Committed(OperationRecord, String),
}
