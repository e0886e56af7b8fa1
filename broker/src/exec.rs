//! The demo executor: approved operations wait in a FIFO queue (the core's `ExecQueue`), and the
//! oldest starts as soon as the controller has a global execution slot for it. Executing means
//! sleeping `arguments.duration_ms`, then succeeding.
//!
//! **No client holds the queue up.** Under a fair share (SPEC 11) the execution pool can refuse
//! the oldest operation's client (at its share, or past the floor with only the reserve left)
//! while it has slots for others. Then the oldest operation of each other client queued behind
//! it is tried, in queue order (a bounded few, each client's own work in its order), and the
//! first that fits starts: a slot freed by finished work goes to a client below its share, as
//! the fair share means, not back to the wait of a client at it; work queued while the oldest
//! waits is tried as it comes. Without a fair share a refusal means the pool is full for
//! everyone, and the executor only waits for a slot.
//!
//! **Waiting for a slot, without polling.** A start takes its slot under the counts gate and the
//! operation's lock, like every transition, so no drift reading sees it half made. But the
//! executor must hold neither while it waits: the gate is fair, so a drift reading queued behind
//! a waiting executor would hold up every change behind it, the finish that frees the slot
//! included; and the operation's lock would hold up the operation's own cancel. So the executor
//! runs [`Operation::start`](unyolo_admission::Operation::start)'s loop in two halves: it listens for a freed
//! slot before it tries (`Operation::slot_freed`), tries under the gate and the lock, and on a
//! full pool lets both go and awaits the listener. A slot given back between the try and the wait
//! still wakes it, and so do a raised `global_executing` and a cancel or expiry of the waiting
//! operation (the next try finds it no longer approved and drops it from the queue). On a replica
//! the same listener also ends after the shared retry pause ([`OperationHandle::slot_freed`]):
//! other replicas give shared slots back without telling this one; a Redis that did not answer
//! is tried again on a timer.
//!
//! [`OperationHandle::slot_freed`]: unyolo_admission::admission::OperationHandle::slot_freed
//!
//! An operation is written `executing` before its work begins, so after a crash it is known to
//! have (maybe) run and is failed with `execution_interrupted` rather than run twice. A store that
//! cannot take that write (locked past its busy timeout) delays the work, never fails it: the
//! operation keeps its slot and the start is recorded once the store answers, unless its
//! approval lapses meanwhile: then it ends `expired`, never run, as if it had waited for a slot.
//! Until then its row is still `approved`, and it is judged as that (`LiveOp::stored_state`): its
//! client may cancel it and an operator revoke it, which fails its handle (releasing the slot)
//! and leaves the retry nothing to start.
//!
//! The executor is its own task, so no client's hangup cancels it; and a shutdown only ends its
//! waits, never a start between its slot and its row: the try is awaited outside any `select!`.

use std::sync::Arc;
use std::time::Duration;

use super::core::{Core, LiveOp};
use super::operations::TransitionFailure;
use super::store::{OperationError, OperationRecord, StateChange, StoreError};
use unyolo_admission::admission::NotStarted;
use unyolo_admission::engine::OperationState;

/// How long to wait before trying again what no in-process event announces: a Redis or a store
/// that did not answer.
const RETRY: Duration = Duration::from_secs(1);

/// What one try to start the oldest queued operation came to.
enum Tried {
    /// It leaves the queue: started (its start recorded, or left to a retry), abandoned, or found
    /// no longer approved.
    Done,
    /// The execution pool (this replica's, or the one shared by every replica) is full: wait for
    /// a slot to be given back.
    PoolFull,
    /// Redis did not answer, or this replica's lease lapsed: try later.
    NotNow,
}

/// The executor loop; returns when the broker shuts down.
pub(crate) async fn run(core: Arc<Core>) {
    let mut shutdown = core.shutdown.clone();
    while !*shutdown.borrow() {
        let Some(op) = core.executor.oldest() else {
            // A ring while nobody waits is kept, so work queued just now is not missed.
            tokio::select! {
                _ = core.executor.rung() => continue,
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
        };
        // Listen before trying, so a slot given back between a failed try and the wait is not
        // missed (a listener is notified even before it is awaited).
        let freed = op.handle.slot_freed();
        match try_start(&core, &op).await {
            Tried::Done => {
                core.executor.pop_oldest();
            }
            Tried::PoolFull => {
                // Full for this client may not be full: under a fair share the pool refuses a
                // client at its share (or one past the floor, to the reserve) while it still has
                // slots for others. Work of another client queued behind starts now, rather than
                // the oldest holding the queue up until its own client drops below its share;
                // and work queued later is tried as it comes.
                let shared = core.admission.controller().config().fair_share().is_some();
                if shared && start_another_clients(&core, &op).await {
                    continue;
                }
                let queued = async {
                    if shared {
                        core.executor.rung().await
                    } else {
                        std::future::pending().await
                    }
                };
                tokio::select! {
                    _ = freed => {}
                    _ = queued => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
            Tried::NotNow => {
                tokio::select! {
                    _ = core.executor.rung() => {}
                    _ = tokio::time::sleep(RETRY) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        }
    }
}

/// After the oldest queued operation was refused a slot, tries the oldest queued operation of
/// each other client in turn (a bounded few:
/// [`OTHER_CLIENTS_TRIED`](super::core::OTHER_CLIENTS_TRIED)), in queue order, until
/// one leaves the queue (started, or found ended). `false` when none did: the pool is full for
/// every one of them, or Redis did not answer.
async fn start_another_clients(core: &Arc<Core>, oldest: &Arc<LiveOp>) -> bool {
    for op in core.executor.oldest_of_other_clients(&oldest.client_id) {
        match try_start(core, &op).await {
            Tried::Done => {
                core.executor.remove(&op);
                return true;
            }
            Tried::PoolFull => {}
            Tried::NotNow => return false,
        }
    }
    false
}

/// Tries to start `op`, a queued operation (the oldest, or the oldest of its client). The gate first, then the operation's lock,
/// as every transition takes them: from the slot taken to the row written, no drift reading sees
/// the start half made.
async fn try_start(core: &Arc<Core>, op: &Arc<LiveOp>) -> Tried {
    let quiet = core.hold_counts().await;
    let guard = op.lock.lock().await;
    // An approval that lapsed while the work waited never starts: the expiry sweeper, due for
    // it now, ends it `expired` (it takes the same lock, so it waits for this to let go).
    if op.lapsed(std::time::SystemTime::now()) {
        return Tried::Done;
    }
    // One call for both backends: replicated, this replica's slot and then the shared one, the
    // first given back if the second is refused.
    match op.handle.try_start().await {
        Ok(()) => {}
        // Canceled or expired while queued.
        Err(NotStarted::NotApproved(_)) => return Tried::Done,
        Err(NotStarted::Saturated(_)) => return Tried::PoolFull,
        Err(NotStarted::Unavailable(_)) => return Tried::NotNow,
    }
    match record_start_in_store(core, op).await {
        Ok(Some(_)) => {
            core.changed(op, OperationState::Approved, OperationState::Executing);
            drop(guard);
            drop(quiet);
            tokio::spawn(execute(Arc::clone(core), Arc::clone(op)));
        }
        Ok(None) => {
            let detail = "the stored operation is no longer approved";
            abandon_start(core, op, detail).await;
        }
        Err(StoreError::TakenOver { .. }) => {
            // Another replica took this work over while this one's membership had lapsed: it
            // runs there, never here. Let go at once, the slot just taken with it: nothing is
            // released in Redis, where the taker counts it (and will find its start made).
            tracing::warn!(operation = %op.id, "not started: taken over by another replica");
            core.let_go_here(op, OperationState::Approved);
        }
        Err(err) => {
            // The store is unavailable (locked past its busy timeout, say): the work has not run
            // and must not run until it is recorded. It keeps its slot and the start is recorded
            // later; until then the store lags the counts and drift says so.
            tracing::warn!(operation = %op.id, error = %err, "cannot record the start yet; retrying");
            // Still `approved` in the store: its client may cancel it meanwhile, an operator
            // revoke it (see `LiveOp::stored_state`).
            op.start_unrecorded
                .store(true, std::sync::atomic::Ordering::Release);
            drop(guard);
            drop(quiet);
            tokio::spawn(record_start(Arc::clone(core), Arc::clone(op)));
        }
    }
    Tried::Done
}

/// Retries recording a start the store could not take, then runs the operation; ends at
/// shutdown with nothing more written (the row is still `approved`, so a restart queues it again:
/// it never ran).
async fn record_start(core: Arc<Core>, op: Arc<LiveOp>) {
    let mut shutdown = core.shutdown.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let quiet = core.hold_counts().await;
        let guard = op.lock.lock().await;
        // Canceled or revoked meanwhile (its handle failed, its row canceled): nothing to start.
        if op.handle.state().is_terminal() {
            return;
        }
        // A write of the start that committed while its answer was lost (the connection cut at
        // the commit: a store's failover) left the row `executing`, and only this replica's own
        // start writes that: the start is recorded, and the work, which has not run, runs now.
        let recorded = match core.db.get(&op.id).await {
            Ok(Some(row)) => row.state == OperationState::Executing,
            Ok(None) => false,
            Err(err) => {
                tracing::warn!(operation = %op.id, error = %err, "cannot record the start yet; retrying");
                continue;
            }
        };
        // The work has not run: an approval that lapsed meanwhile ends it `expired` through the
        // one expiry every lapse takes (its row is still `approved`: see `LiveOp::stored_state`),
        // which takes the gate and the lock itself.
        if !recorded && op.lapsed(std::time::SystemTime::now()) {
            drop(guard);
            drop(quiet);
            match core
                .expire_to_end(Arc::clone(&op), OperationState::Approved)
                .await
            {
                Ok(_) | Err(TransitionFailure::NotAllowed(_)) => return,
                Err(TransitionFailure::Store(err)) => {
                    tracing::warn!(operation = %op.id, error = %err, "cannot record the lapse yet; retrying");
                    continue;
                }
            }
        }
        let written = if recorded {
            tracing::warn!(operation = %op.id, "its start was recorded though the store did not answer it; it runs now");
            Ok(Some(()))
        } else {
            record_start_in_store(&core, &op)
                .await
                .map(|row| row.map(|_| ()))
        };
        match written {
            Ok(Some(())) => {
                op.start_unrecorded
                    .store(false, std::sync::atomic::Ordering::Release);
                core.changed(&op, OperationState::Approved, OperationState::Executing);
                drop(guard);
                drop(quiet);
                execute(core, op).await;
                return;
            }
            Ok(None) => {
                abandon_start(&core, &op, "the stored operation is no longer approved").await;
                return;
            }
            // Taken over by another replica meanwhile: let go here (see `try_start`).
            Err(StoreError::TakenOver { .. }) => {
                core.let_go_here(&op, OperationState::Approved);
                return;
            }
            Err(err) => {
                tracing::warn!(operation = %op.id, error = %err, "cannot record the start yet; retrying");
            }
        }
    }
}

/// A start that can never be recorded (the row is not `approved` any more): the operation does
/// not run; its handle fails (releasing its slots) and the row is failed if it can be. Called with
/// the counts gate and the operation's lock held.
async fn abandon_start(core: &Arc<Core>, op: &Arc<LiveOp>, detail: &str) {
    tracing::error!(operation = %op.id, error = %detail, "cannot start");
    let _ = op.handle.fail().await;
    let error = OperationError {
        code: "store_unavailable".to_owned(),
        message: "The operation could not be recorded as executing.".to_owned(),
    };
    let _ = core
        .db
        .set_state(
            &op.id,
            OperationState::Approved,
            OperationState::Failed,
            StateChange::error(Some(error)),
        )
        .await;
    core.changed(op, OperationState::Approved, OperationState::Failed);
}

/// Runs one operation: sleeps its duration, then records success. A shutdown abandons it as a
/// crash would (it stays `executing` on disk).
async fn execute(core: Arc<Core>, op: Arc<LiveOp>) {
    let mut shutdown = core.shutdown.clone();
    tokio::select! {
        _ = tokio::time::sleep(op.duration) => {}
        _ = shutdown.wait_for(|stop| *stop) => return,
    }
    loop {
        let outcome = Arc::clone(&core)
            .transition(
                Arc::clone(&op),
                OperationState::Succeeded,
                StateChange::default(),
            )
            .await;
        match outcome {
            Ok(_) | Err(TransitionFailure::NotAllowed(_)) => return,
            Err(TransitionFailure::Store(err)) => {
                tracing::error!(operation = %op.id, error = %err, "cannot record success; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(RETRY) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        }
    }
}

/// Writes `op`'s move from approved to executing to the store (the one durable step of a start);
/// `Ok(None)` when the stored row is no longer approved.
async fn record_start_in_store(
    core: &Core,
    op: &LiveOp,
) -> Result<Option<OperationRecord>, StoreError> {
    core.db
        .set_state(
            &op.id,
            OperationState::Approved,
            OperationState::Executing,
            StateChange::default(),
        )
        .await
}
