//! Expiry: a request nobody decides within `--pending-timeout` (five minutes by default, as
//! unYOLO) ends `expired`, and so does an approved one that has not started by its
//! `active_expires_at` (its approval lapsed: the duration the operator granted, five minutes
//! unless narrowed, ran out while it waited for an execution slot), each with its
//! `request.expired` event, its slots released like any terminal transition
//! (`Core::expire_to_end`, which runs to its end under the counts gate and the operation's
//! lock), and its Agent V1 waiters woken. Work that started before its lapse runs to its end.
//!
//! **A timer, not a poll.** The pending requests wait in the core's `PendingExpiries` in the order
//! they expire (one timeout for all: creation order, but for an expiry retried after a store
//! fault). The sweeper sleeps until the first one is due, or until a request is queued before
//! it; it never reads the store to find work.
//! [`Core::expire_due`] is also what a read that must see due expiries first calls (the
//! operator's request list and decisions, as upstream applies due lifecycle changes before them).
//!
//! **Per owner.** Each replica expires the requests it owns (on a shared store, those it created
//! or took over: so each request once for the fleet); the shared counts follow through the
//! handle's release. A decision on another replica that finds a request due writes its expiry
//! there, and the owner's handle follows the row.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::api::operator::projection::{lapsed, past_due};
use super::core::{Core, LiveOp, run_to_end};
use super::operations::{TransitionFailure, expiry_change};
use super::store::{OperationRecord, StoreError};
use unyolo_admission::engine::OperationState;

/// How long the sweeper waits before retrying an expiry the store could not take.
const RETRY: Duration = Duration::from_secs(1);

impl Core {
    /// Expires every pending request whose time has come (by the wall clock), oldest first, each
    /// run to its end; returns how many expired. A request whose expiry the store could not take
    /// is queued again, due [`RETRY`] later (before any request due after that).
    pub(crate) async fn expire_due(self: &Arc<Self>) -> usize {
        let mut expired = 0;
        for (op, from) in self.expiries.take_due(SystemTime::now()) {
            match self.expire_to_end(Arc::clone(&op), from).await {
                Ok(Some(_)) => expired += 1,
                Ok(None) | Err(TransitionFailure::NotAllowed(_)) => {}
                Err(TransitionFailure::Store(err)) => {
                    tracing::warn!(operation = %op.id, error = %err, "cannot record the expiry yet; retrying");
                    self.expiries
                        .push(SystemTime::now() + RETRY, Arc::downgrade(&op), from);
                }
            }
        }
        expired
    }

    /// What a read or a decision that must see due expiries first calls: expires whatever is
    /// due, on a task of its own, so an operator who hangs up meanwhile leaves no taken expiry
    /// undone. With nothing due it costs a lock and a clock read.
    pub(crate) async fn settle_expiries(self: &Arc<Self>) {
        if self
            .expiries
            .next()
            .is_some_and(|at| at <= SystemTime::now())
        {
            let core = Arc::clone(self);
            // Err only if the expiry panicked or the runtime is stopping: the sweeper retries.
            let _ = run_to_end(async move { core.expire_due().await }).await;
        }
    }

    /// The state `op` expires from if its time has run out at `now`: pending past its
    /// `pending_expires_at`, or approved past its lapse (`None` otherwise, and for work that
    /// started), whether or not its expiry is written yet: an operator's read that finds it so
    /// expires it first, as upstream applies due lifecycle changes first (a decision judges
    /// the same from the stored row).
    pub(crate) fn due_from(&self, op: &LiveOp, now: SystemTime) -> Option<OperationState> {
        match op.stored_state() {
            OperationState::Pending if self.pending_expires_at(op) <= now => {
                Some(OperationState::Pending)
            }
            OperationState::Approved if op.lapsed(now) => Some(OperationState::Approved),
            _ => None,
        }
    }

    /// Makes sure no request of `records` (read for an operator's list or get) whose time had
    /// run out at `now` is shown as it was read: one still live in that state is expired first
    /// (its expiry not written yet: the sweeper's write waiting for the store, or its retry not
    /// yet due), as upstream applies due lifecycle changes before a read; one a move has taken
    /// since the read (an expiry, a cancel) is waited out. Err (503 to the operator) if the store
    /// cannot take an expiry. Whether any was due: the caller reads again.
    pub(crate) async fn expire_due_among(
        self: &Arc<Self>,
        records: &[OperationRecord],
        now: SystemTime,
    ) -> Result<bool, StoreError> {
        let mut due = false;
        for record in records {
            let ran_out = match record.state {
                OperationState::Pending => past_due(record, self.pending_timeout, now),
                OperationState::Approved => lapsed(record, now),
                // Only a live request can be due; a history page looks up nothing.
                _ => false,
            };
            if !ran_out {
                continue;
            }
            due = true;
            let Some(op) = self.live_op(&record.id) else {
                // Ended since the read: the row says how.
                continue;
            };
            match self.due_from(&op, now) {
                Some(from) if from == record.state => {
                    self.expire_found_due(&record.id, from).await?;
                }
                // Moved since the read: a move holds the operation's lock until its handle
                // follows its row, so once the lock is free the row says where it went.
                _ => drop(op.lock.lock().await),
            }
        }
        Ok(due)
    }

    /// Expires request `id` at once if it is still live in `from`: what a decision that found
    /// its request due (its time run out, its expiry taken by the sweeper but not yet written)
    /// calls before judging again. Run to its end like every expiry; the sweeper's own entry
    /// then finds it expired and does nothing. Err only if the store could not take it (the
    /// sweeper retries).
    pub(crate) async fn expire_found_due(
        self: &Arc<Self>,
        id: &str,
        from: OperationState,
    ) -> Result<(), StoreError> {
        let Some(op) = self.live_op(id) else {
            // Another replica's request (a shared store): its expiry is written here, and its
            // owner's handle follows the row.
            if self.owned_elsewhere(id)
                && matches!(from, OperationState::Pending | OperationState::Approved)
            {
                let core = Arc::clone(self);
                let id = id.to_owned();
                let expired = run_to_end(async move {
                    core.move_in_store(&id, OperationState::Expired, expiry_change(from))
                        .await
                })
                .await
                .unwrap_or_else(|err| {
                    Err(TransitionFailure::Store(StoreError::unfinished(
                        "the expiry",
                        err,
                    )))
                });
                return match expired {
                    Ok(_) | Err(TransitionFailure::NotAllowed(_)) => Ok(()),
                    Err(TransitionFailure::Store(err)) => Err(err),
                };
            }
            return Ok(());
        };
        match self.expire_to_end(op, from).await {
            Ok(_) | Err(TransitionFailure::NotAllowed(_)) => Ok(()),
            Err(TransitionFailure::Store(err)) => Err(err),
        }
    }
}

/// The sweeper: expires requests as they fall due, until the broker shuts down.
pub(crate) async fn run(core: Arc<Core>) {
    let mut shutdown = core.shutdown.clone();
    loop {
        if *shutdown.borrow() {
            return;
        }
        core.expire_due().await;
        match core.expiries.next() {
            Some(at) => {
                let wait = at
                    .duration_since(SystemTime::now())
                    .unwrap_or(Duration::ZERO);
                // Woken early by a request queued before that one (an expiry retried after a
                // store fault by a decision's `settle_expiries`, say).
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = core.expiries.rung() => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
            None => {
                tokio::select! {
                    _ = core.expiries.rung() => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        }
    }
}
