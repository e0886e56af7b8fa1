//! The life of an admitted operation, and the one rule that keeps the counts true: whichever call
//! moves an operation into a terminal state, and only that call, releases what the operation held.
//!
//! The state is one atomic byte changed by compare-and-swap, so a cancel racing an approve, a
//! double deny or a drop after a finish each resolve to exactly one winner, and the winner knows
//! exactly which state it left and so which slots to give back.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::client::ClientState;
use super::global::Counts;
use super::refusal::{Refusal, RefusalCode};
use crate::clock::duration_nanos;
use crate::config::Identity;

/// The Agent V1 operation states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum OperationState {
    /// Awaiting an operator decision.
    Pending = 0,
    /// Approved (or needing no approval), waiting for an execution slot.
    Approved = 1,
    /// Holding an execution slot.
    Executing = 2,
    /// Finished successfully. Terminal.
    Succeeded = 3,
    /// Failed. Terminal.
    Failed = 4,
    /// Denied by an operator. Terminal.
    Denied = 5,
    /// Expired before it ran. Terminal.
    Expired = 6,
    /// Canceled by its client. Terminal.
    Canceled = 7,
}

impl OperationState {
    /// Every state.
    pub const ALL: [OperationState; 8] = [
        OperationState::Pending,
        OperationState::Approved,
        OperationState::Executing,
        OperationState::Succeeded,
        OperationState::Failed,
        OperationState::Denied,
        OperationState::Expired,
        OperationState::Canceled,
    ];

    /// The wire name, e.g. `pending`.
    pub const fn as_str(self) -> &'static str {
        match self {
            OperationState::Pending => "pending",
            OperationState::Approved => "approved",
            OperationState::Executing => "executing",
            OperationState::Succeeded => "succeeded",
            OperationState::Failed => "failed",
            OperationState::Denied => "denied",
            OperationState::Expired => "expired",
            OperationState::Canceled => "canceled",
        }
    }

    /// Parses a wire name.
    pub fn parse(name: &str) -> Option<OperationState> {
        OperationState::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Whether nothing more can happen to the operation.
    pub const fn is_terminal(self) -> bool {
        (self as u8) >= OperationState::Succeeded as u8
    }

    /// Whether the contract allows moving from `self` to `to`.
    pub const fn can_move_to(self, to: OperationState) -> bool {
        use OperationState::*;
        matches!(
            (self, to),
            (Pending, Approved | Denied | Expired | Canceled | Failed)
                | (Approved, Executing | Canceled | Expired | Failed)
                | (Executing, Succeeded | Failed)
        )
    }

    fn from_u8(v: u8) -> OperationState {
        OperationState::ALL[usize::from(v)]
    }
}

impl fmt::Display for OperationState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transition the contract does not allow from the operation's current state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransitionError {
    /// The state the operation was in.
    pub from: OperationState,
    /// The state that was asked for.
    pub to: OperationState,
}

impl fmt::Display for TransitionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an operation cannot move from {} to {}",
            self.from, self.to
        )
    }
}

impl std::error::Error for TransitionError {}

/// Why [`Operation::try_start`] did not start the operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartError {
    /// Every execution slot is taken; the operation stays queued and can retry.
    Saturated(Refusal),
    /// The operation is not approved (it was canceled, say, or already started).
    NotApproved(OperationState),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Saturated(refusal) => write!(f, "execution pool saturated: {refusal}"),
            StartError::NotApproved(state) => write!(f, "cannot start a {state} operation"),
        }
    }
}

impl std::error::Error for StartError {}

/// The controller's handle on one live operation: it holds the operation's slots until a
/// terminal transition gives them back, exactly once.
///
/// All transitions take `&self`, so the handle can be shared (say in an `Arc`) between the
/// task executing the operation and the handlers that cancel or decide it. Dropping a handle that
/// is not terminal releases its slots as if the operation had failed.
pub struct Operation {
    client: Arc<ClientState>,
    state: AtomicU8,
}

impl Operation {
    pub(crate) fn new(client: Arc<ClientState>, state: OperationState) -> Operation {
        Operation {
            client,
            state: AtomicU8::new(state as u8),
        }
    }

    /// The client the operation belongs to.
    pub fn identity(&self) -> &Identity {
        &self.client.identity
    }

    /// The current state.
    pub fn state(&self) -> OperationState {
        // Acquire: pairs with the AcqRel transition so a reader seeing a terminal state also sees
        // the releases its winner made.
        OperationState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// An operator approved it: `pending` → `approved` (queued for an execution slot).
    pub fn approve(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Approved).map(|_| ())
    }

    /// An operator denied it: `pending` → `denied`, releasing its slots.
    pub fn deny(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Denied).map(|_| ())
    }

    /// Its client canceled it: `pending` or `approved` → `canceled`, releasing its slots. Returns
    /// the state it was in; canceling a terminal operation changes nothing and returns that state.
    /// An executing operation cannot be canceled.
    pub fn cancel(&self) -> Result<OperationState, TransitionError> {
        match self.transition(OperationState::Canceled) {
            Err(TransitionError { from, .. }) if from.is_terminal() => Ok(from),
            other => other,
        }
    }

    /// It expired before running: `pending` or `approved` → `expired`.
    pub fn expire(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Expired).map(|_| ())
    }

    /// It failed, from any live state.
    pub fn fail(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Failed).map(|_| ())
    }

    /// Its execution finished: `executing` → `succeeded`, releasing the execution slot.
    pub fn succeed(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Succeeded).map(|_| ())
    }

    /// Takes a global execution slot and moves `approved` → `executing`. If every slot is taken
    /// the operation stays `approved` (queued) and the call can be retried.
    pub fn try_start(&self) -> Result<(), StartError> {
        let shared = &self.client.shared;
        let current = self.state();
        if current != OperationState::Approved {
            return Err(StartError::NotApproved(current));
        }
        // Relaxed: a lone value mirrored from the settings in force.
        if !shared
            .global
            .try_start(shared.executing_limit.load(Ordering::Relaxed))
        {
            let hint = duration_nanos(shared.settings.load().capacity_retry);
            return Err(StartError::Saturated(Refusal::after_nanos(
                RefusalCode::GlobalExecutionLimit,
                hint,
            )));
        }
        // AcqRel: see `transition`.
        match self.state.compare_exchange(
            OperationState::Approved as u8,
            OperationState::Executing as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                self.client.executing.force_acquire(1);
                Ok(())
            }
            Err(actual) => {
                // Lost to a cancel or expiry: the slot was never the operation's.
                shared.global.release(Counts::EXECUTING);
                Err(StartError::NotApproved(OperationState::from_u8(actual)))
            }
        }
    }

    /// Moves to `to` if the contract allows it from the current state; returns the state left.
    /// The winning compare-and-swap, and only it, moves the counts.
    fn transition(&self, to: OperationState) -> Result<OperationState, TransitionError> {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            let from = OperationState::from_u8(current);
            if !from.can_move_to(to) {
                return Err(TransitionError { from, to });
            }
            // AcqRel: the winner's count updates happen after it owns the transition; readers of
            // the new state (Acquire) see a consistent picture.
            match self.state.compare_exchange(
                current,
                to as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.account(from, to);
                    return Ok(from);
                }
                Err(actual) => current = actual,
            }
        }
    }

    fn account(&self, from: OperationState, to: OperationState) {
        let client = &*self.client;
        // What the state left held globally, and what the new one no longer holds: released in
        // one step on the global word.
        let mut global = Counts::default();
        match from {
            OperationState::Pending => {
                client.pending.release(1);
                global.pending = 1;
            }
            OperationState::Executing => {
                client.executing.release(1);
                global.executing = 1;
            }
            _ => {}
        }
        if to.is_terminal() {
            client.active.release(1);
            global.active = 1;
        }
        if global != Counts::default() {
            client.shared.global.release(global);
        }
    }
}

impl Drop for Operation {
    fn drop(&mut self) {
        let _ = self.transition(OperationState::Failed);
    }
}

impl fmt::Debug for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Operation")
            .field("identity", &self.client.identity)
            .field("state", &self.state())
            .finish()
    }
}
