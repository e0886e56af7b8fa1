//! Live operations and the one way their state changes.
//!
//! Each live operation ([`LiveOp`], held in the core's live map) pairs its durable row with the
//! controller's lifecycle handle. Every
//! transition takes the counts gate (so a drift reading never sees it half made) and the
//! operation's lock, checks the move is allowed, writes the new state to the
//! store (durable), and only then applies it to the handle, which releases the operation's slots
//! on a terminal move. So the store never lags the counts, a store failure changes nothing, and two
//! racing transitions (a cancel and an approve, say) are written in the order they happened.

use std::sync::Arc;

use super::core::{Core, LiveOp, run_to_end};
use super::store::{
    DecidedMove, DecisionCommand, DecisionOutcome, OperationError, OperationRecord, StateChange,
    StoreError,
};
use unyolo_admission::admission::{OperationHandle, RestoredOperation};
use unyolo_admission::config::Identity;
use unyolo_admission::engine::{CancelOutcome, OperationState, RestoreError, TransitionError};

/// What an expiry from `from` (pending: nobody decided in time; approved: the approval lapsed
/// before the work started) writes.
pub(crate) fn expiry_change(from: OperationState) -> StateChange {
    let message = if from == OperationState::Approved {
        "The operator's approval lapsed before an execution slot was free."
    } else {
        "No operator decided on the request within the pending timeout."
    };
    StateChange::error(Some(OperationError {
        code: "operation_approval_expired".to_owned(),
        message: message.to_owned(),
    }))
}

/// Logs each of `interrupted` (found executing by recovery or a takeover: failed with
/// `execution_interrupted`, never run twice) as the state change it is; `why` says whose.
pub(crate) fn log_interrupted(interrupted: &[OperationRecord], why: &str) {
    for record in interrupted {
        tracing::warn!(
            operation = %record.id,
            client = %record.client_id,
            from = "executing",
            to = "failed",
            error = "execution_interrupted",
            "operation state changed ({why})"
        );
    }
}

/// The live records as admission counts them again (`Admission::restore`, `Admission::adopt`):
/// those whose client id is valid, each with what admission needs; the others are logged
/// (`not_counted` says what did not happen to them) and left out.
pub(crate) fn to_count_again(
    records: Vec<OperationRecord>,
    not_counted: &str,
) -> (Vec<OperationRecord>, Vec<RestoredOperation>) {
    let mut kept = Vec::new();
    let mut restoring = Vec::new();
    for record in records {
        let Ok(identity) = Identity::new(&record.client_id) else {
            tracing::error!(operation = %record.id, "stored operation has an invalid client id; {not_counted}");
            continue;
        };
        restoring.push(RestoredOperation {
            id: record.id.clone(),
            identity,
            state: record.state,
        });
        kept.push(record);
    }
    (kept, restoring)
}

/// Why a transition did not happen.
#[derive(Debug)]
pub(crate) enum TransitionFailure {
    /// The operation's state does not allow the move.
    NotAllowed(OperationState),
    /// The store failed; nothing changed.
    Store(StoreError),
}

impl Core {
    /// Makes live here each of `records` whose handle admission gave back (`handles`, in the
    /// same order; a refused one is logged, `not_counted` saying what did not happen): in the
    /// live map, followed by the shadow file's engine if there is one, approved work queued to
    /// run. The states of those made live.
    pub(crate) fn make_live(
        &self,
        records: Vec<OperationRecord>,
        handles: Vec<Result<OperationHandle, RestoreError>>,
        not_counted: &str,
    ) -> Vec<OperationState> {
        let mut live = Vec::new();
        for (record, handle) in records.into_iter().zip(handles) {
            let handle = match handle {
                Ok(handle) => handle,
                Err(err) => {
                    tracing::error!(operation = %record.id, error = %err, "{not_counted}");
                    continue;
                }
            };
            let shadowed = self
                .shadow
                .as_ref()
                .and_then(|shadow| shadow.restore(handle.identity(), record.state));
            let op = Arc::new(LiveOp::new(&record, handle).shadowed(shadowed));
            self.add_live(&op, &record);
            if record.state == OperationState::Approved {
                self.executor.enqueue(op);
            }
            live.push(record.state);
        }
        live
    }

    /// The live operation `id`, if it is not terminal.
    pub(crate) fn live_op(&self, id: &str) -> Option<Arc<LiveOp>> {
        self.live_ops().get(id).cloned()
    }

    /// The live operation of `record` (read from the store), once its creation here has ended. A
    /// new operation's row is committed (readable, its `request.created` event sent) a moment
    /// before its creating task puts it in the live map, and that task holds the operation's key
    /// lock throughout: a row read not terminal whose operation is not live is waited out on that
    /// lock, so a cancel or a decision in that moment finds the operation live rather than
    /// answering as if it had ended. Never call it holding the counts gate: a creation holding
    /// the key's lock may be waiting for the gate.
    pub(crate) async fn live_once_created(&self, record: &OperationRecord) -> Option<Arc<LiveOp>> {
        self.live_once_created_of(
            &record.id,
            &record.client_id,
            &record.idempotency_key,
            record.state.is_terminal(),
        )
        .await
    }

    /// [`Core::live_once_created`] from the operation's id, client, key and whether its row was
    /// read terminal (a [`StoredRequest`](crate::store::StoredRequest) has them without
    /// the request's text).
    pub(crate) async fn live_once_created_of(
        &self,
        id: &str,
        client_id: &str,
        idempotency_key: &str,
        terminal: bool,
    ) -> Option<Arc<LiveOp>> {
        if let Some(op) = self.live_op(id) {
            return Some(op);
        }
        if !terminal {
            drop(self.key_lock(client_id, idempotency_key).await);
        }
        self.live_op(id)
    }

    /// Moves `op` to `to` (not `executing`; see the executor): store first, then the handle,
    /// holding the counts gate and the operation's lock throughout. Owns what it needs, so it can
    /// run detached ([`run_to_end`]): once started, it ends whether or not anyone waits.
    pub(crate) async fn transition(
        self: Arc<Self>,
        op: Arc<LiveOp>,
        to: OperationState,
        change: StateChange,
    ) -> Result<OperationRecord, TransitionFailure> {
        let _quiet = self.hold_counts().await;
        let _guard = op.lock.lock().await;
        self.transition_locked(&op, to, change).await
    }

    /// [`Core::transition`] run detached ([`run_to_end`]): a decision a client made (a
    /// cancel, an approval, a denial) ends the same whether or not the client waits for it.
    pub(crate) async fn transition_to_end(
        self: &Arc<Self>,
        op: Arc<LiveOp>,
        to: OperationState,
        change: StateChange,
    ) -> Result<OperationRecord, TransitionFailure> {
        let transition = Arc::clone(self).transition(op, to, change);
        run_to_end(transition).await.unwrap_or_else(|err| {
            Err(TransitionFailure::Store(StoreError::unfinished(
                "the transition",
                err,
            )))
        })
    }

    /// Expires `op` if it is still in `from`: pending (a request nobody decided in time) or
    /// approved (an approval that lapsed before the work started). Run to its end like every
    /// transition: the row (with its `request.expired` event) first, then the handle, which
    /// releases the operation's slots. `Ok(None)` when it was no longer in `from`.
    pub(crate) async fn expire_to_end(
        self: &Arc<Self>,
        op: Arc<LiveOp>,
        from: OperationState,
    ) -> Result<Option<OperationRecord>, TransitionFailure> {
        let core = Arc::clone(self);
        let expiry = async move {
            let _quiet = core.hold_counts().await;
            let _guard = op.lock.lock().await;
            // Only from the state it was queued in: a request approved before its pending time
            // ran out is not expired by that entry, nor one that started by its lapse (a start
            // not recorded yet has not: see `LiveOp::stored_state`).
            if op.stored_state() != from {
                return Ok(None);
            }
            core.transition_locked(&op, OperationState::Expired, expiry_change(from))
                .await
                .map(Some)
        };
        run_to_end(expiry).await.unwrap_or_else(|err| {
            Err(TransitionFailure::Store(StoreError::unfinished(
                "the expiry",
                err,
            )))
        })
    }

    /// [`Core::transition`] with the counts gate and the operation's lock already held.
    async fn transition_locked(
        &self,
        op: &Arc<LiveOp>,
        to: OperationState,
        mut change: StateChange,
    ) -> Result<OperationRecord, TransitionFailure> {
        debug_assert_ne!(to, OperationState::Executing);
        // A start not recorded yet is still `approved` in the store: moved from there.
        let from = op.stored_state();
        if !from.can_move_to(to) {
            return Err(TransitionFailure::NotAllowed(from));
        }
        if let Some(decision) = &mut change.decision {
            // A cancel of approved work takes the approval back (Operator V1 shows `revoked`).
            decision.revoked |= from == OperationState::Approved && to == OperationState::Canceled;
        }
        let Some(record) = self
            .db
            .set_state(&op.id, from, to, change)
            .await
            .map_err(TransitionFailure::Store)?
        else {
            // On a shared store another replica may have moved it first (a cancel, a decision
            // there): the handle follows the row, and this move is judged from where it went.
            if self.db.is_shared()
                && let Some(record) = self
                    .follow_row(op)
                    .await
                    .map_err(TransitionFailure::Store)?
                && record.state != from
            {
                return Err(TransitionFailure::NotAllowed(record.state));
            }
            return Err(TransitionFailure::Store(StoreError::NotInState {
                id: op.id.clone(),
                expected: from,
            }));
        };
        self.follow_in_handle(op, from, to).await;
        Ok(record)
    }

    /// An operator's decision on request `id`, judged and committed by the store in one
    /// transaction ([`crate::store::DurableStore::decide`]), then followed by the lifecycle
    /// handle, holding the counts gate and the operation's lock (if it is live) throughout, and
    /// run detached ([`run_to_end`]): decided once the store is asked, it ends the same whether
    /// or not the operator waits for the answer. `judge` also gets the state the handle is in
    /// (`None` when the operation is not live): a move the handle cannot make is refused there.
    pub(crate) async fn decide_to_end<R: Send + 'static>(
        self: &Arc<Self>,
        command: DecisionCommand,
        judge: impl FnOnce(&OperationRecord, Option<OperationState>) -> Result<DecidedMove, R>
        + Send
        + 'static,
        render: impl FnOnce(&OperationRecord) -> String + Send + 'static,
    ) -> Result<DecisionOutcome<R>, StoreError> {
        let core = Arc::clone(self);
        let work = async move {
            let id = &command.scope.request_id;
            if core.live_op(id).is_none()
                && let Some(record) = core.db.get(id).await?
            {
                core.live_once_created(&record).await;
            }
            let _quiet = core.hold_counts().await;
            let op = core.live_op(id);
            let _guard = match &op {
                Some(op) => Some(op.lock.lock().await),
                None => None,
            };
            let live = op.as_ref().map(|op| op.stored_state());
            // Another replica's request (on a shared store): judged on its row, which its
            // owner's handle follows once this is committed.
            let elsewhere = op.is_none() && core.db.is_shared();
            let outcome = core
                .db
                .decide(
                    command,
                    move |record| {
                        let live = match live {
                            None if elsewhere && !record.state.is_terminal() => Some(record.state),
                            live => live,
                        };
                        judge(record, live)
                    },
                    render,
                )
                .await?;
            if let (DecisionOutcome::Committed(record, _), Some(op), Some(from)) =
                (&outcome, &op, live)
            {
                core.follow_in_handle(op, from, record.state).await;
                if record.state == OperationState::Approved {
                    core.queue_lapse(op, record);
                }
            }
            Ok(outcome)
        };
        run_to_end(work)
            .await
            .unwrap_or_else(|err| Err(StoreError::unfinished("the decision", err)))
    }

    /// Makes `op`'s handle follow its row if another replica moved it (a cancel, a decision,
    /// an expiry written there: see the `fleet` module), with the counts gate and the
    /// operation's lock held; the row read, if there is one.
    pub(crate) async fn follow_row(
        &self,
        op: &Arc<LiveOp>,
    ) -> Result<Option<OperationRecord>, StoreError> {
        let Some(record) = self.db.get(&op.id).await? else {
            return Ok(None);
        };
        let from = op.stored_state();
        let to = record.state;
        // `executing` is only ever written by the owner's own start (this replica's executor).
        // A row that ended is followed from whatever state the handle is in: it may have ended
        // through moves this replica never saw (decided, taken over and run elsewhere while it
        // was paused past its lease).
        if to != from
            && to != OperationState::Executing
            && (from.can_move_to(to) || to.is_terminal())
        {
            if !from.can_move_to(to) {
                tracing::warn!(
                    operation = %op.id,
                    client = %op.client_id,
                    held = %from,
                    stored = %to,
                    "this operation ended elsewhere while this replica did not follow it (paused \
                     or cut off past its lease); every slot it held here is let go"
                );
            }
            self.follow_in_handle(op, from, to).await;
            if to == OperationState::Approved {
                self.queue_lapse(op, &record);
            }
        }
        Ok(Some(record))
    }

    /// Applies a move already durable in the store to `op`'s handle (which releases its slots on
    /// a terminal move) and follows it up ([`Core::changed`]). Called with the counts gate and
    /// the operation's lock held, so the handle is still in `from`.
    pub(crate) async fn follow_in_handle(
        &self,
        op: &Arc<LiveOp>,
        from: OperationState,
        to: OperationState,
    ) {
        // One call for both backends: the local move at once, the shared one by operation id
        // (kept and resent if Redis does not answer; this task runs to its end regardless).
        let applied = match to {
            OperationState::Approved => op.handle.approve().await,
            OperationState::Denied => op.handle.deny().await,
            // A start not recorded yet took its slot (the handle is `executing`) but never ran:
            // ended in the store (canceled, revoked or expired), its handle is failed, which
            // releases what it holds.
            _ if to.is_terminal()
                && op
                    .start_unrecorded
                    .swap(false, std::sync::atomic::Ordering::AcqRel) =>
            {
                op.handle.fail().await
            }
            // A row that ended through moves this handle never saw (see `follow_row`): every
            // slot it holds is released, as for a failure, here and in Redis by its id (the row
            // ended: no replica may count it any more).
            _ if to.is_terminal() && !from.can_move_to(to) => op.handle.fail().await,
            // Under the lock the handle is live, so the cancel must be this call's own.
            OperationState::Canceled => match op.handle.cancel().await {
                Ok(CancelOutcome::Canceled { .. }) => Ok(()),
                Ok(CancelOutcome::AlreadyTerminal(from)) => Err(TransitionError { from, to }),
                Err(err) => Err(err),
            },
            OperationState::Expired => op.handle.expire().await,
            OperationState::Failed => op.handle.fail().await,
            OperationState::Succeeded => op.handle.succeed().await,
            OperationState::Pending | OperationState::Executing => Ok(()),
        };
        debug_assert!(applied.is_ok(), "{applied:?}");
        self.changed(op, from, to);
    }

    /// Logs a state change (already durable) and follows it up: the shadow follows it, waiters on the operation are
    /// woken, approved work is queued, terminal work forgotten (its slots are already released)
    /// and the executor woken.
    pub(crate) fn changed(&self, op: &Arc<LiveOp>, from: OperationState, to: OperationState) {
        op.follow_in_shadow(self.shadow.as_ref(), to);
        self.waits.ring(&op.id);
        tracing::info!(
            operation = %op.id,
            client = %op.client_id,
            from = %from,
            to = %to,
            "operation state changed"
        );
        if to == OperationState::Approved {
            self.executor.enqueue(Arc::clone(op));
        }
        if to.is_terminal() {
            self.live_ops().remove(&op.id);
            self.executor.wake();
        }
    }
}
