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
//!   queued to run here.
//! - **No handle outlives its row**: a replica whose work was taken over, or decided and run
//!   elsewhere, while it was paused or cut off past its lease finds it when it reads its rows
//!   again ([`let_go_of_taken`], every third of a lease and before every drift reading): a
//!   handle of work taken over is let go, releasing nothing in Redis, where the taker counts
//!   it; one whose row ended follows it, releasing everything. And it never counts such work
//!   under its name in Redis again: each registration counts only the work whose rows it still
//!   owns (`RecoverySource::owned_live`).
//!
//! A store one process owns (SQLite) has no change feed and nothing to take over: none of this
//! runs there.

use std::sync::Arc;
use std::time::Duration;

use super::core::{Core, LiveOp};
use super::operations::{TransitionFailure, log_interrupted, to_count_again};
use super::store::{OperationRecord, StateChange, StoreError};
use unyolo_admission::engine::OperationState;

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
    let _adopting = core.adopting.lock().await;
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

/// Makes this replica's handles follow rows that moved without it hearing (see the module doc):
/// work another replica took over while this one's membership had lapsed (a replica cut off from
/// the store, or paused, for longer than a lease), and work that ended elsewhere meanwhile
/// (decided on one replica, taken over and run on another). Run every third of a lease and
/// before every drift reading, so no count of this replica, here or in Redis, outlives its row
/// past the next reading.
///
/// - **Taken over**, its row live and another replica's: the handle is handed over
///   ([`OperationHandle::hand_over`]): this replica's counts let go of it and nothing is
///   released in Redis, where the taker counts it. That includes a start this replica took but
///   could not record (the store refused it as taken over): the work never ran here.
/// - **Ended**, its row terminal: the handle follows its row from whatever state it is in
///   ([`Core::follow_row`]), releasing everything it holds here and, by its id, in Redis.
///
/// Which to look at: the operations live here are listed first, this replica's live rows read
/// second. An operation enters the live map only once its row was written as this replica's
/// (created, recovered or taken over here), so one listed first and missing from the rows read
/// after has ended, or been taken over (work is only ever taken from a lapsed replica, never
/// given back to it while it runs); its row, read under its lock, tells which. How many handles
/// were let go or ended.
///
/// [`OperationHandle::hand_over`]: unyolo_admission::admission::OperationHandle::hand_over
pub(crate) async fn let_go_of_taken(core: &Arc<Core>) -> Result<usize, StoreError> {
    let listed: Vec<Arc<LiveOp>> = core.live_ops().values().cloned().collect();
    let mine: std::collections::HashSet<String> = core
        .db
        .live_states()
        .await?
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let listed_ids: std::collections::HashSet<&str> =
        listed.iter().map(|op| op.id.as_str()).collect();
    let mut followed = 0;
    for id in mine.iter().filter(|id| !listed_ids.contains(id.as_str())) {
        if take_up_orphan(core, id).await? {
            followed += 1;
        }
    }
    for op in listed.into_iter().filter(|op| !mine.contains(&op.id)) {
        let _quiet = core.hold_counts().await;
        let _guard = op.lock.lock().await;
        if core.live_op(&op.id).is_none() {
            continue;
        }
        match core.db.get(&op.id).await? {
            // Ended (here or elsewhere): its handle follows its row.
            Some(record) if record.state.is_terminal() => {
                core.follow_row(&op).await?;
                followed += 1;
            }
            // Live, and not this replica's: taken over.
            Some(record) if core.let_go_here(&op, record.state) => followed += 1,
            // Its handle ended here meanwhile, or its row is gone (retired).
            Some(_) | None => {}
        }
    }
    Ok(followed)
}

/// Takes up operation `id`, whose live row this replica owns while nothing here holds it: a
/// creation whose commit's answer was lost (a failover cut the connection at the commit: its
/// client was answered `503`, its permit refunded, and the row committed all the same), or a
/// start recorded likewise. An operation being created holds its key's lock until it is live,
/// so that is waited out first. A pending or approved one is counted here (and in Redis) and
/// made live, as a takeover makes work live; an executing one, which nothing here runs, may
/// have run: it ends `failed` `execution_interrupted`, never run twice. Whether it was taken up.
async fn take_up_orphan(core: &Arc<Core>, id: &str) -> Result<bool, StoreError> {
    let Some(record) = core.db.get(id).await? else {
        return Ok(false);
    };
    if record.state.is_terminal() || core.live_once_created(&record).await.is_some() {
        return Ok(false);
    }
    let _adopting = core.adopting.lock().await;
    let _quiet = core.hold_counts().await;
    // Read again under the gate: decided, ended or taken over meanwhile?
    let Some(record) = core.db.get(id).await? else {
        return Ok(false);
    };
    let still_mine = core
        .db
        .live_states()
        .await?
        .iter()
        .any(|(mine, _)| mine == id);
    if core.live_op(id).is_some() || !still_mine {
        return Ok(false);
    }
    match record.state {
        OperationState::Executing => {
            let change = StateChange::error(Some(super::store::OperationError::interrupted()));
            let failed = core
                .db
                .set_state(
                    id,
                    OperationState::Executing,
                    OperationState::Failed,
                    change,
                )
                .await?;
            if failed.is_some() {
                log_interrupted(
                    std::slice::from_ref(&record),
                    "found executing here with nobody running it, after a store fault",
                );
            }
            Ok(failed.is_some())
        }
        OperationState::Pending | OperationState::Approved => {
            let (records, adopting) = to_count_again(vec![record], "not taken up");
            let adopted = core.admission.adopt(adopting).await;
            let taken = core.make_live(records, adopted.operations, "not taken up");
            if let Some(err) = adopted.deferred {
                tracing::warn!(error = %err, "redis does not count the operation taken up yet; the heartbeat registers it");
            }
            tracing::warn!(
                operation = %id,
                "this replica's row of a live operation had no handle here (its creation's \
                 commit was not answered: a store fault); counted and live here now"
            );
            Ok(!taken.is_empty())
        }
        _ => Ok(false),
    }
}

impl Core {
    /// Lets go of `op` here because another replica took it over (its row, in `stored`, is
    /// that replica's): its handle is handed over (this replica's counts give it back, nothing
    /// is released in Redis, where the taker counts it), it leaves the live map, and its waits
    /// and the executor are woken. Called with the counts gate and the operation's lock held.
    /// Whether it was live here.
    pub(crate) fn let_go_here(&self, op: &Arc<LiveOp>, stored: OperationState) -> bool {
        if !op.handle.hand_over() {
            return false;
        }
        op.start_unrecorded
            .store(false, std::sync::atomic::Ordering::Release);
        op.follow_in_shadow(self.shadow.as_ref(), OperationState::Failed);
        self.live_ops().remove(&op.id);
        self.waits.ring(&op.id);
        self.executor.wake();
        tracing::warn!(
            operation = %op.id,
            client = %op.client_id,
            state = %stored,
            "another replica took this operation over while this one's membership of the \
             store had lapsed; let go here"
        );
        true
    }
}
