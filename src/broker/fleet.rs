//! One broker out of many replicas on one shared store (PostgreSQL): what a replica does so that
//! any replica serves any request and every operation's work runs once.
//!
//! - **Each operation has one owner**: the replica that created it (or took it over). Only the
//!   owner holds its lifecycle handle (its counts, here and in Redis), expires it and runs its
//!   work; its start is a claim the store grants only to the owner with a live membership.
//! - **Any replica moves any operation**: a cancel or an operator's decision on a replica that
//!   does not own the operation is written to the store ([`Core::move_in_store`]); the owner
//!   hears of it (the store's change feed, `DurableStore::changes`) and its handle follows the row
//!   ([`follow`]), as it follows its own moves: the store leads, the counts follow. A change
//!   feed that was cut is made up for by following every live operation again.
//! - **Waits are woken by any replica's change**: every change heard rings its operation's bell.
//! - **Streams are the fleet's**: their bodies live in the store's rows; one deleted on any
//!   replica frees its room on the replica that counts it.
//! - **Work outlives its replica**: every third of a membership lease, a replica takes over the
//!   work of replicas whose membership lapsed ([`take_over`]): their executing operations end
//!   `failed` `execution_interrupted` (never run twice), their pending and approved ones become
//!   its own, counted here and moved to it in Redis in one registration, and approved work is
//!   queued to run here. A replica whose work was taken while it was cut off lets its handles
//!   of that work go when it reads its rows again ([`let_go_of_taken`]), releasing nothing in
//!   Redis, where the taker counts it.
//!
//! A store one process owns (SQLite) has no change feed and nothing to take over: none of this
//! runs there.

use std::sync::Arc;
use std::time::Duration;

use super::core::{Core, LiveOp};
use super::operations::{TransitionFailure, log_interrupted, to_count_again};
use super::store::{OperationRecord, StateChange, StoreError};
use crate::engine::OperationState;

/// Follows the store's change feed until shutdown: rings the waits of every operation changed
/// on any replica, and makes this replica's handles follow their rows. Nothing for a store with
/// no feed.
pub(crate) async fn follow_changes(core: Arc<Core>) {
    let Some(mut changes) = core.db.changes() else {
        return;
    };
    let mut shutdown = core.shutdown.clone();
    loop {
        let heard = tokio::select! {
            heard = changes.recv() => heard,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        match heard {
            Ok(change) if !change.is_empty() => {
                let (id, state) = match change.split_once(' ') {
                    Some((id, state)) => (id, OperationState::parse(state)),
                    None => (change.as_str(), None),
                };
                core.waits.ring(id);
                if let Some(op) = core.live_op(id) {
                    // This replica's own moves come back too: followed already.
                    if state != Some(op.stored_state()) {
                        tokio::spawn(follow_logged(Arc::clone(&core), op));
                    }
                } else if core.stored_streams().contains_key(id) {
                    tokio::spawn(follow_stream(Arc::clone(&core), id.to_owned()));
                }
            }
            // The feed was cut (or this reader fell behind): anything may have changed.
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                core.waits.ring_all();
                let live: Vec<Arc<LiveOp>> = core.live_ops().values().cloned().collect();
                for op in live {
                    tokio::spawn(follow_logged(Arc::clone(&core), op));
                }
                let streams: Vec<String> = core.stored_streams().keys().cloned().collect();
                for id in streams {
                    tokio::spawn(follow_stream(Arc::clone(&core), id));
                }
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// A stream this replica counts that another replica deleted: its room is let go here.
async fn follow_stream(core: Arc<Core>, id: String) {
    let _quiet = core.hold_counts().await;
    match core.db.get_stream(&id).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            if let Some(object) = core.stored_streams().remove(&id) {
                object.release();
                tracing::info!(stream = %id, "stream deleted on another replica; its room is free here");
            }
        }
        Err(err) => {
            tracing::warn!(stream = %id, error = %err, "cannot read a stream change made on another replica yet")
        }
    }
}

/// [`follow`], tried again every second while the store does not answer (until the operation
/// is no longer live here, or shutdown).
async fn follow_logged(core: Arc<Core>, op: Arc<LiveOp>) {
    let mut shutdown = core.shutdown.clone();
    while let Err(err) = follow(&core, &op).await {
        tracing::warn!(operation = %op.id, error = %err, "cannot read a change made on another replica yet; retrying");
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        if core.live_op(&op.id).is_none() {
            return;
        }
    }
}

/// Makes `op`'s handle follow its row, if another replica moved it (a cancel, a decision, an
/// expiry written there). Takes the counts gate and the operation's lock, as every move does.
pub(crate) async fn follow(core: &Arc<Core>, op: &Arc<LiveOp>) -> Result<(), StoreError> {
    let _quiet = core.hold_counts().await;
    let _guard = op.lock.lock().await;
    core.follow_row(op).await.map(|_| ())
}

impl Core {
    /// Moves operation `id`, which another replica owns, from the state its row is in to `to`,
    /// in the store alone: its owner's handle follows when it hears of it. A row that moved
    /// meanwhile is read again (a few times). `Err(NotAllowed)` when its state does not allow
    /// the move.
    pub(crate) async fn move_in_store(
        &self,
        id: &str,
        to: OperationState,
        change: StateChange,
    ) -> Result<OperationRecord, TransitionFailure> {
        for _ in 0..8 {
            let Some(record) = self.db.get(id).await.map_err(TransitionFailure::Store)? else {
                return Err(TransitionFailure::Store(StoreError::new(format!(
                    "operation {id} is no longer stored"
                ))));
            };
            let from = record.state;
            if !from.can_move_to(to) {
                return Err(TransitionFailure::NotAllowed(from));
            }
            let mut change = change.clone();
            if let Some(decision) = &mut change.decision {
                decision.revoked |=
                    from == OperationState::Approved && to == OperationState::Canceled;
            }
            if let Some(moved) = self
                .db
                .set_state(id, from, to, change)
                .await
                .map_err(TransitionFailure::Store)?
            {
                tracing::info!(
                    operation = %id,
                    client = %moved.client_id,
                    from = %from,
                    to = %to,
                    "operation state changed (its owner follows)"
                );
                return Ok(moved);
            }
        }
        Err(TransitionFailure::Store(StoreError::NotInState {
            id: id.to_owned(),
            expected: to,
        }))
    }

    /// Whether operation `id`, stored and not terminal, is another replica's to hold (this one
    /// shares its store and does not hold it live).
    pub(crate) fn owned_elsewhere(&self, id: &str) -> bool {
        self.db.is_shared() && self.live_op(id).is_none()
    }
}

/// Takes over the work of replicas whose membership of the store lapsed (see the module doc):
/// their pending and approved operations are counted here and live here from now on; approved
/// ones are queued to run. How many were taken.
pub(crate) async fn take_over(core: &Arc<Core>, lease: Duration) -> Result<usize, StoreError> {
    let taken = core.db.take_over_lapsed(lease).await?;
    log_interrupted(
        &taken.interrupted,
        "its replica's membership lapsed while it executed",
    );
    if taken.live.is_empty() {
        return Ok(0);
    }
    let (records, adopting) = to_count_again(taken.live, "not taken over");
    let adopted = {
        let _quiet = core.hold_counts().await;
        let adopted = core.admission.adopt(adopting).await;
        let taken = core
            .make_live(records, adopted.operations, "not taken over")
            .len();
        if let Some(err) = adopted.deferred {
            tracing::warn!(error = %err, "redis does not count the work taken over yet; the heartbeat registers it");
        }
        taken
    };
    tracing::info!(
        operations = adopted,
        "took over the work of replicas whose membership of the store lapsed"
    );
    Ok(adopted)
}

/// Lets go of this replica's handles of work another replica took over while this one's
/// membership had lapsed (a replica cut off from the store for longer than a lease, still
/// serving): their rows are live and owned elsewhere, and the taker counts them, in Redis too
/// (moved there). Each handle here is handed over ([`OperationHandle::hand_over`]): this
/// replica's counts let go of it and nothing is released in Redis. Without this, such a handle
/// held its counts here (drift on this replica, its clients refused sooner) until its row ended.
///
/// Which are taken over: the operations live here are listed first, this replica's live rows
/// read second. An operation enters the live map only once its row is this replica's (created,
/// recovered or taken over here), so one listed first and missing from the rows read after has
/// ended, or been taken over (work is only ever taken from a lapsed replica, never given back
/// to it while it runs); its row, read under its lock, tells which. A start this replica took
/// but could not record is left to end with its row, as before (`exec`). How many were let go.
///
/// [`OperationHandle::hand_over`]: crate::admission::OperationHandle::hand_over
pub(crate) async fn let_go_of_taken(core: &Arc<Core>) -> Result<usize, StoreError> {
    let listed: Vec<Arc<LiveOp>> = core.live_ops().values().cloned().collect();
    if listed.is_empty() {
        return Ok(0);
    }
    let mine: std::collections::HashSet<String> = core
        .db
        .live_states()
        .await?
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let candidates = listed.into_iter().filter(|op| {
        !mine.contains(&op.id)
            && !op
                .start_unrecorded
                .load(std::sync::atomic::Ordering::Acquire)
    });
    let mut let_go = 0;
    for op in candidates {
        let _quiet = core.hold_counts().await;
        let _guard = op.lock.lock().await;
        if core.live_op(&op.id).is_none() {
            continue;
        }
        match core.db.get(&op.id).await? {
            // Ended (here or elsewhere): its handle follows its row, as for any change heard.
            Some(record) if record.state.is_terminal() => {
                core.follow_row(&op).await?;
            }
            // Live, and not this replica's: taken over.
            Some(record) if op.handle.hand_over() => {
                core.live_ops().remove(&op.id);
                core.waits.ring(&op.id);
                core.executor.wake();
                let_go += 1;
                tracing::warn!(
                    operation = %op.id,
                    client = %op.client_id,
                    state = %record.state,
                    "another replica took this operation over while this one's membership \
                     of the store had lapsed; let go here"
                );
            }
            // Its handle ended here meanwhile, or its row is gone.
            Some(_) | None => {}
        }
    }
    Ok(let_go)
}
