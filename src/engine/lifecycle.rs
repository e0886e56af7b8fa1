//! The life of an admitted operation, and the one rule that keeps the counts true: whichever call
//! moves an operation into a terminal state, and only that call, releases what the operation held.
//!
//! The state is one atomic byte changed by compare-and-swap, so a cancel racing an approve, a
//! double deny or a drop after a finish each resolve to exactly one winner, and the winner knows
//! exactly which state it left and so which slots to give back.
//!
//! The loom models of these transitions live beside them, in `lifecycle/loom_models.rs`: they
//! drive real operations made by a real controller, which this file, below the controller, does
//! not import.
//!
//! A little past the usual size because the states, their handle and its transitions are one
//! contract (which call releases what, exactly once), read best whole.

use std::fmt;

use super::client::ClientState;
use super::global::Counts;
use super::refusal::{Refusal, RefusalCode};
use super::share::PoolSettings;
use crate::clock::duration_nanos;
use crate::config::Identity;
use crate::config::Pool;
use crate::sync::{Arc, AtomicU8, EventListener, Ordering};

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

/// What [`Operation::cancel`] did: the two answers a broker must tell apart before it writes
/// anything to its store.
///
/// ```
/// use unyolo_admission::{CancelOutcome, Config, Controller, Identity, OperationState};
///
/// let c = Controller::new(Config::defaults([Identity::new("bot-7").unwrap()]));
/// let op = c.admit("bot-7", true).unwrap().commit();
/// // The first cancel moves the operation: write `canceled` to the store.
/// assert_eq!(op.cancel(), Ok(CancelOutcome::Canceled { from: OperationState::Pending }));
/// // A second one changes nothing: the store must keep what it has.
/// assert_eq!(op.cancel(), Ok(CancelOutcome::AlreadyTerminal(OperationState::Canceled)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// This call canceled the operation, which was in `from` (`pending` or `approved`); its
    /// slots are released.
    Canceled {
        /// The state the operation left.
        from: OperationState,
    },
    /// The operation was already terminal, in this state; nothing changed.
    AlreadyTerminal(OperationState),
}

impl CancelOutcome {
    /// Whether this call changed the operation.
    pub fn changed(self) -> bool {
        matches!(self, CancelOutcome::Canceled { .. })
    }

    /// The state the operation is in after the call.
    pub fn state(self) -> OperationState {
        match self {
            CancelOutcome::Canceled { .. } => OperationState::Canceled,
            CancelOutcome::AlreadyTerminal(state) => state,
        }
    }
}

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
/// task executing the operation and the handlers that cancel or decide it.
///
/// # Dropping it
///
/// Dropping a handle that is not terminal releases its slots as if the operation had failed —
/// but the broker's store still says `pending`, `approved` or `executing`, so the counts no longer
/// match the store, and nothing can approve, cancel or run that row any more. In an async broker
/// this happens when the handle lives in a request handler's future and the client hangs up: the
/// future is dropped at whatever `.await` it waits on. Keep handles in a place a request does not
/// own (a map of live operations), and make every change in a task a disconnect cannot cancel
/// (`broker/examples/axum_broker.rs` shows how). Each such drop is counted in
/// [`Snapshot::dropped_operations`](crate::Snapshot::dropped_operations) and exported as
/// `admission_dropped_operations_total`; anything but zero is a bug in the embedding.
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

    /// Its client canceled it: `pending` or `approved` → `canceled`, releasing its slots
    /// ([`CancelOutcome::Canceled`], with the state it left). Canceling a terminal operation
    /// changes nothing ([`CancelOutcome::AlreadyTerminal`], with its state: do not write
    /// `canceled` over it). An executing operation cannot be canceled (`Err`).
    pub fn cancel(&self) -> Result<CancelOutcome, TransitionError> {
        match self.transition(OperationState::Canceled) {
            Ok(from) => Ok(CancelOutcome::Canceled { from }),
            Err(TransitionError { from, .. }) if from.is_terminal() => {
                Ok(CancelOutcome::AlreadyTerminal(from))
            }
            Err(err) => Err(err),
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

    /// Waits for a global execution slot, takes it and moves `approved` → `executing`.
    ///
    /// Runtime-agnostic (any executor, no timer): the wait is woken each time an execution slot
    /// is given back, when a reload may have raised `global_executing`, and when this operation
    /// leaves `approved` another way. `Err` if the operation is not (or no longer) approved —
    /// canceled, expired or failed while it waited — with the state it is in.
    ///
    /// Dropping the future while it waits changes nothing: the operation stays `approved`.
    ///
    /// ```
    /// use unyolo_admission::{Config, Controller, Identity, Limits, OperationState};
    ///
    /// let bot = Identity::new("bot-7").unwrap();
    /// let limits = Limits { global_executing: 1, ..Limits::default() };
    /// let config = Config::new(limits, Default::default(), [bot]).unwrap();
    /// let c = Controller::new(config);
    /// let running = c.admit("bot-7", false).unwrap().commit();
    /// let queued = c.admit("bot-7", false).unwrap().commit();
    /// running.try_start().unwrap();
    /// // The pool is full: `start` waits until `running` gives its slot back.
    /// let waiter = std::thread::spawn(move || {
    ///     futures_lite_block_on(queued.start()).unwrap();
    ///     queued
    /// });
    /// running.succeed().unwrap();
    /// let queued = waiter.join().unwrap();
    /// assert_eq!(queued.state(), OperationState::Executing);
    /// # fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     use std::task::{Context, Poll, Wake, Waker};
    /// #     struct Unpark(std::thread::Thread);
    /// #     impl Wake for Unpark { fn wake(self: std::sync::Arc<Self>) { self.0.unpark() } }
    /// #     let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop {
    /// #         if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) { return v; }
    /// #         std::thread::park();
    /// #     }
    /// # }
    /// ```
    pub async fn start(&self) -> Result<(), TransitionError> {
        loop {
            // Listen before trying, so a slot given back between a failed try and the wait is
            // not missed (a listener is notified even before it is awaited).
            let freed = self.slot_freed();
            match self.try_start() {
                Ok(()) => return Ok(()),
                Err(StartError::NotApproved(from)) => {
                    return Err(TransitionError {
                        from,
                        to: OperationState::Executing,
                    });
                }
                Err(StartError::Saturated(_)) => freed.await,
            }
        }
    }

    /// Listens for the next moment this operation may be able to start: an execution slot is
    /// given back, a reload may have raised `global_executing`, or the operation leaves
    /// `approved`. Taken *before* a [`try_start`](Operation::try_start) that finds the pool full
    /// and awaited after it, it misses no slot given back in between: [`Operation::start`] is that
    /// loop. The broker's executor runs the same loop in two halves, because it must try under
    /// locks it cannot hold while it waits.
    pub(crate) fn slot_freed(&self) -> EventListener {
        self.client.shared.slot_freed.listen()
    }

    /// Takes a global execution slot and moves `approved` → `executing`. If every slot is taken
    /// (or, with a fair share, none is this client's: see
    /// [`Config::fair_share`](crate::Config::fair_share)) the operation stays `approved` (queued)
    /// and the call can be retried — or use [`Operation::start`], which waits for a slot.
    pub fn try_start(&self) -> Result<(), StartError> {
        let client = &*self.client;
        let shared = &client.shared;
        let current = self.state();
        if current != OperationState::Approved {
            return Err(StartError::NotApproved(current));
        }
        // Relaxed: a lone word mirrored from the settings in force (limit and rule together).
        let pool = PoolSettings::unpack(shared.executing_pool.load(Ordering::Relaxed));
        // The client's executing count rises first: the fair share judges the start by what the
        // client held before it (the count its take found, 0: this start makes it a holder,
        // counted in the compare-and-swap that takes the global slot). It also rises *before*
        // the state says `executing`: from the instant the state does, a `succeed` or `fail` on
        // another thread may release it, and a release that came first would find nothing to
        // release (saturating at zero) and leave this start's count behind for good. (The take
        // is AcqRel, see `holding`; the state change below is AcqRel too, and a finish acquires
        // it before it releases the count, so its release comes after this take.)
        let found = client.executing.take();
        if shared
            .global
            .try_start(pool.limit, pool.rule, found)
            .is_err()
        {
            shared
                .global
                .give_back_refused(&client.executing, found, Pool::Executing);
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
            Ok(_) => Ok(()),
            Err(actual) => {
                // Lost to a cancel, expiry or failure: neither slot was ever the operation's.
                self.give_back_execution_slot();
                // A waiter refused while this slot was briefly taken must hear it is free again.
                shared.execution_slot_freed();
                Err(StartError::NotApproved(OperationState::from_u8(actual)))
            }
        }
    }

    /// Gives back the execution slot a [`try_start`](Operation::try_start) took a moment ago:
    /// `executing` → `approved` (queued again). For a composite start whose second half (the slot
    /// shared with other replicas) was refused after this one was taken; the work has not begun.
    /// Returns whether it moved: a terminal move that won the race released the slot itself.
    ///
    /// It rings no bell: a waiter refused while this slot was briefly taken is a replica's, and
    /// retries on the shared pause anyway; ringing would wake the very start that called this,
    /// which would then try the shared store again at once, and again.
    pub(crate) fn unstart(&self) -> bool {
        // AcqRel: as in `transition`; the winner alone gives the counts back.
        if self
            .state
            .compare_exchange(
                OperationState::Executing as u8,
                OperationState::Approved as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return false;
        }
        self.give_back_execution_slot();
        true
    }

    /// Gives back one execution slot, the global one and then the client's (and the client's
    /// place among the executing pool's holders if it was its last): in that order, as
    /// `account` does.
    fn give_back_execution_slot(&self) {
        let global = &self.client.shared.global;
        global.release(Counts::EXECUTING);
        if self.client.executing.give_back() {
            global.release(Counts::holder(Pool::Executing));
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
        // one step per global word, *before* the client's own counts, so a fair-share decision
        // racing this never judges the client by fewer than the pool still counts for it. Then
        // the client's place among a pool's holders, where this was its last slot there.
        let mut global = Counts::default();
        match from {
            OperationState::Pending => {
                client.pending.release(1);
                global.pending = 1;
            }
            OperationState::Executing => global = global.plus(Counts::EXECUTING),
            _ => {}
        }
        if to.is_terminal() {
            global = global.plus(Counts::ACTIVE);
        }
        if global != Counts::default() {
            client.shared.global.release(global);
        }
        let mut left = Counts::default();
        if from == OperationState::Executing {
            left = left.joining(Pool::Executing, client.executing.give_back());
        }
        if to.is_terminal() {
            left = left.joining(Pool::Active, client.active.give_back());
        }
        if left != Counts::default() {
            client.shared.global.release(left);
        }
        if from == OperationState::Executing {
            client.shared.execution_slot_freed();
        } else if from == OperationState::Approved && to.is_terminal() {
            // A `start` waiting on this very operation must wake to see it is no longer
            // approved; which waiter it is cannot be told, so all wake (and the others listen
            // again).
            client.shared.slot_freed.notify(usize::MAX);
        }
    }
}

impl Drop for Operation {
    fn drop(&mut self) {
        if self.transition(OperationState::Failed).is_ok() {
            // Relaxed: a statistic.
            self.client
                .shared
                .dropped_operations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
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

#[cfg(all(test, loom))]
mod loom_models;
