//! The demo executor: approved operations wait in a FIFO queue and start when the controller
//! grants a global execution slot ([`crate::Operation::try_start`]); a saturated pool leaves them
//! queued until a slot frees. Executing means sleeping `arguments.duration_ms`, then succeeding.
//!
//! An operation is written `executing` before its work begins, so after a crash it is known to
//! have (maybe) run and is failed with `execution_interrupted` rather than run twice. A store that
//! cannot take that write (locked past its busy timeout) delays the work, never fails it: the
//! operation keeps its slot and the start is recorded once the store answers.
//!
//! Starting and finishing hold the counts gate and the operation's lock, like every transition;
//! the executor is its own task, so no client's hangup cancels either.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::Core;
use super::operations::{LiveOp, TransitionFailure};
use super::shared::SharedStart;
use super::store::OperationError;
use crate::engine::{OperationState, StartError};

/// How often the queue is retried even without a wake-up (a safety net; wake-ups do the work).
const POLL: Duration = Duration::from_secs(1);

/// The queue of approved operations and the bell that says a slot may have freed.
#[derive(Default)]
pub(crate) struct Executor {
    queue: Mutex<VecDeque<Arc<LiveOp>>>,
    bell: Notify,
}

impl Executor {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<LiveOp>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues an approved operation for execution.
    pub(crate) fn enqueue(&self, op: Arc<LiveOp>) {
        self.queue().push_back(op);
        self.wake();
    }

    /// Something changed that may let queued work start (a slot freed, a limit was raised).
    pub(crate) fn wake(&self) {
        self.bell.notify_one();
    }
}

/// The executor loop; returns when the broker shuts down.
pub(crate) async fn run(core: Arc<Core>) {
    let mut shutdown = core.shutdown.clone();
    loop {
        if *shutdown.borrow() {
            return;
        }
        start_queued(&core).await;
        tokio::select! {
            _ = core.executor.bell.notified() => {}
            _ = tokio::time::sleep(POLL) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

/// Starts queued operations, oldest first, until the pool is saturated or the queue is empty.
async fn start_queued(core: &Arc<Core>) {
    loop {
        let Some(op) = core.executor.queue().front().cloned() else {
            return;
        };
        // The gate first, then the operation's lock, as every transition takes them: from the
        // slot taken to the row written, no drift reading sees the start half made.
        let quiet = core.hold_counts().await;
        let guard = op.lock.lock().await;
        // The shared slot first (it binds across replicas); this replica's own count is a part of
        // the shared one, so the in-process start then succeeds unless the operation is gone.
        match op.shared.try_start().await {
            SharedStart::Started => {}
            SharedStart::NotNow => return,
            SharedStart::NotApproved => {
                if op.handle.state() == OperationState::Approved {
                    // The shared counts no longer hold it approved (a lapsed lease, until this
                    // replica re-registers): not now.
                    return;
                }
                core.executor.queue().pop_front();
                continue;
            }
        }
        match op.handle.try_start() {
            Ok(()) => {
                core.executor.queue().pop_front();
                let written = record_start_in_store(core, &op).await;
                match written {
                    Ok(Some(_)) => {
                        core.changed(&op, OperationState::Approved, OperationState::Executing);
                        drop(guard);
                        drop(quiet);
                        tokio::spawn(execute(Arc::clone(core), op));
                    }
                    Ok(None) => {
                        let detail = "the stored operation is no longer approved";
                        abandon_start(core, &op, detail).await;
                    }
                    Err(err) => {
                        // The store is unavailable (locked past its busy timeout, say): the work
                        // has not run and must not run until it is recorded. It keeps its slot
                        // and the start is recorded later; until then the store lags the counts
                        // and drift says so.
                        tracing::warn!(operation = %op.id, error = %err, "cannot record the start yet; retrying");
                        drop(guard);
                        drop(quiet);
                        tokio::spawn(record_start(Arc::clone(core), op));
                    }
                }
            }
            Err(StartError::NotApproved(_)) => {
                // Canceled or expired while queued.
                core.executor.queue().pop_front();
            }
            Err(StartError::Saturated(_)) if op.shared.is_set() => {
                // The shared slot is taken but this replica's pool is full (its counts ran
                // ahead of the shared ones): the work does not run, and both are released.
                core.executor.queue().pop_front();
                abandon_start(core, &op, "no execution slot on this replica").await;
            }
            Err(StartError::Saturated(_)) => return,
        }
    }
}

/// Retries recording a start the store could not take, then runs the operation; ends at
/// shutdown with nothing more written (the row is still `approved`, so a restart queues it again:
/// it never ran).
async fn record_start(core: Arc<Core>, op: Arc<LiveOp>) {
    let mut shutdown = core.shutdown.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let quiet = core.hold_counts().await;
        let guard = op.lock.lock().await;
        let written = record_start_in_store(&core, &op).await;
        match written {
            Ok(Some(_)) => {
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
    let _ = op.handle.fail();
    op.shared.apply(OperationState::Failed).await;
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
            Some(error),
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
            .transition(Arc::clone(&op), OperationState::Succeeded, None)
            .await;
        match outcome {
            Ok(_) | Err(TransitionFailure::NotAllowed(_)) => return,
            Err(TransitionFailure::Store(err)) => {
                tracing::error!(operation = %op.id, error = %err, "cannot record success; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(POLL) => {}
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
) -> Result<Option<super::store::OperationRecord>, super::store::StoreError> {
    core.db
        .set_state(
            &op.id,
            OperationState::Approved,
            OperationState::Executing,
            None,
        )
        .await
}
