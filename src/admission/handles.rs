//! The permit and the lifecycle handle of an [`Admission`](super::Admission), one type each for
//! both backends.
//!
//! In-process, each wraps the engine's [`Permit`](crate::engine::Permit) or
//! [`Operation`](crate::engine::Operation). Replicated, each also holds its half in the shared
//! store, and the two move together: the local half moves first (its compare-and-swap decides
//! which call wins, exactly once), then the same move is sent to the shared store by operation
//! id. A release the shared store does not answer is kept and sent when it does; the caller is
//! never made to wait for a dead Redis to give slots back.
//!
//! What a dropped future leaves, per call, is in each call's docs. In short: every transition
//! has happened once its future has been polled (the local move is synchronous and the shared
//! one is kept if its reply is not awaited), so dropping one mid-way loses nothing; a dropped
//! `try_start` or `start` leaves the operation queued.

use std::future::Future;

use super::backend::{self, SharedOperation, SharedPermit};
use super::id::OperationId;
use super::outcome::{NotStarted, Unavailable, UnavailableReason};
use crate::config::Identity;
use crate::engine::{
    self, CancelOutcome, OperationState, QuotaStatus, StartError, TransitionError,
};

/// An admitted submission, before the broker has created its durable operation.
///
/// [`commit`](AdmissionPermit::commit) it once the operation exists, or
/// [`refund`](AdmissionPermit::refund) it if creating the operation failed through the broker's
/// own fault. Dropped without either, it gives its slots back (and, replicated, its idempotency
/// key's binding) but the rate token stays spent, and the drop is counted
/// ([`Snapshot::dropped_permits`](crate::Snapshot::dropped_permits)): a correct embedding never
/// drops one.
#[must_use = "a permit holds slots until it is committed, refunded or dropped"]
pub struct AdmissionPermit {
    pub(super) id: OperationId,
    pub(super) local: engine::Permit,
    pub(super) shared: Option<SharedPermit>,
    pub(super) quota: Option<QuotaStatus>,
}

impl AdmissionPermit {
    /// The operation's id, made by the admission (unique across restarts and replicas): store
    /// the operation under it.
    pub fn id(&self) -> OperationId {
        self.id.clone()
    }

    /// The admitted client.
    pub fn identity(&self) -> &Identity {
        self.local.identity()
    }

    /// Whether the operation waits for an operator (it starts `pending`, else `approved`).
    pub fn needs_approval(&self) -> bool {
        self.local.needs_approval()
    }

    /// The client's quota just after this admission, for the answer's quota fields: replicated,
    /// as Redis's decision left it (the client's bucket and its counts on every replica), else
    /// this process's engine's.
    pub fn quota(&self) -> Option<QuotaStatus> {
        self.quota
    }

    /// The durable operation exists: its lifecycle handle. Synchronous, so nothing can come
    /// between the store's write and this.
    pub fn commit(self) -> OperationHandle {
        OperationHandle {
            id: self.id,
            local: self.local.commit(),
            shared: self.shared.map(SharedPermit::commit),
        }
    }

    /// Creating the operation failed through the broker's own fault (say, the store was
    /// unavailable): give back the slots, the rate token and, replicated, the idempotency key's
    /// binding, so the client's retry is decided afresh on every replica.
    ///
    /// The local half is given back at the first poll. Dropping the future after that loses
    /// nothing: a shared release not yet answered is kept and sent when Redis answers.
    pub async fn refund(self) {
        self.local.refund();
        if let Some(shared) = self.shared {
            Box::pin(shared.refund()).await;
        }
    }
}

impl std::fmt::Debug for AdmissionPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionPermit")
            .field("id", &self.id)
            .field("identity", self.identity())
            .field("needs_approval", &self.needs_approval())
            .field("replicated", &self.shared.is_some())
            .finish()
    }
}

/// The lifecycle handle of one live operation: it holds the operation's slots until a terminal
/// transition releases them, exactly once, whatever the order or repetition of calls.
///
/// Dropped while not terminal, it releases them as if the operation had failed, and the drop is
/// counted ([`Snapshot::dropped_operations`](crate::Snapshot::dropped_operations)): keep handles
/// in a map the request does not own.
pub struct OperationHandle {
    id: OperationId,
    local: engine::Operation,
    shared: Option<SharedOperation>,
}

impl OperationHandle {
    pub(super) fn restored(
        id: OperationId,
        local: engine::Operation,
        shared: Option<SharedOperation>,
    ) -> OperationHandle {
        OperationHandle { id, local, shared }
    }

    /// Its id: the one the admission made, or for a restored operation the one it was stored
    /// under.
    pub fn id(&self) -> OperationId {
        self.id.clone()
    }

    /// The client the operation belongs to.
    pub fn identity(&self) -> &Identity {
        self.local.identity()
    }

    /// The current state.
    pub fn state(&self) -> OperationState {
        self.local.state()
    }

    /// Whether the operation is also counted in the shared store.
    pub fn is_replicated(&self) -> bool {
        self.shared.is_some()
    }

    /// Sends a move the local handle has just made to the shared half, if any: by operation id,
    /// kept and resent if Redis does not answer; its outcome only confirms what the local move
    /// decided. Boxed, so the in-process futures stay small (the Redis call's state is large).
    async fn mirror<'a, F: Future>(&'a self, call: impl FnOnce(&'a SharedOperation) -> F) {
        if let Some(shared) = &self.shared {
            let _ = Box::pin(call(shared)).await;
        }
    }

    /// `pending` → `approved` (queued for an execution slot). Done at the first poll; dropping
    /// the future later loses nothing.
    pub async fn approve(&self) -> Result<(), TransitionError> {
        self.local.approve()?;
        self.mirror(SharedOperation::approve).await;
        Ok(())
    }

    /// `pending` → `denied`, releasing its slots. Done at the first poll; dropping the future
    /// later loses nothing.
    pub async fn deny(&self) -> Result<(), TransitionError> {
        self.local.deny()?;
        self.mirror(SharedOperation::deny).await;
        Ok(())
    }

    /// `pending` or `approved` → `canceled`, releasing its slots
    /// ([`CancelOutcome::Canceled`]); a terminal operation is left as it is
    /// ([`CancelOutcome::AlreadyTerminal`]); an executing one cannot be canceled (`Err`). Done at
    /// the first poll; dropping the future later loses nothing.
    pub async fn cancel(&self) -> Result<CancelOutcome, TransitionError> {
        let outcome = self.local.cancel()?;
        if outcome.changed() {
            self.mirror(SharedOperation::cancel).await;
        }
        Ok(outcome)
    }

    /// `pending` or `approved` → `expired`, releasing its slots. Done at the first poll;
    /// dropping the future later loses nothing.
    pub async fn expire(&self) -> Result<(), TransitionError> {
        self.local.expire()?;
        self.mirror(SharedOperation::expire).await;
        Ok(())
    }

    /// Any live state → `failed`, releasing its slots. Done at the first poll; dropping the
    /// future later loses nothing.
    pub async fn fail(&self) -> Result<(), TransitionError> {
        self.local.fail()?;
        self.mirror(SharedOperation::fail).await;
        Ok(())
    }

    /// `executing` → `succeeded`, releasing its slots. Done at the first poll; dropping the
    /// future later loses nothing.
    pub async fn succeed(&self) -> Result<(), TransitionError> {
        self.local.succeed()?;
        self.mirror(SharedOperation::succeed).await;
        Ok(())
    }

    /// Lets a live operation go here because another replica took it over: the shared store
    /// records it as that replica's and counts it there once, so nothing is sent to it (a
    /// release by this operation's id would free what the other replica now holds). This
    /// process's slots are given back, and the shared half stops holding it (a re-registration
    /// no longer counts it here). `false` if it was terminal already. A handle with no shared
    /// half has no other replica to hand over to: it only gives this process's slots back, as a
    /// failure would.
    pub fn hand_over(&self) -> bool {
        if self.local.fail().is_err() {
            return false;
        }
        if let Some(shared) = &self.shared {
            shared.hand_over();
        }
        true
    }

    /// Takes an execution slot and moves `approved` → `executing`, or says why not: the pool is
    /// full (it stays queued), the shared store did not answer (it stays queued), or it is no
    /// longer approved.
    ///
    /// Replicated, this process's slot is taken first and the shared one second; a refused
    /// shared slot gives this process's back. Dropped mid-way, the operation stays queued
    /// (`approved`): a shared slot the interrupted call may have taken is the one the next try
    /// finds already taken for it (the start is recorded by operation id).
    pub async fn try_start(&self) -> Result<(), NotStarted> {
        match self.local.try_start() {
            Ok(()) => {}
            Err(StartError::Saturated(refusal)) => return Err(NotStarted::Saturated(refusal)),
            Err(StartError::NotApproved(state)) => return Err(NotStarted::NotApproved(state)),
        }
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        // Gives the local slot back unless the shared one is taken too.
        let undo = Unstart(Some(&self.local));
        let outcome = Box::pin(shared.try_start()).await;
        match outcome {
            Ok(()) => {
                undo.keep();
                Ok(())
            }
            Err(NotStarted::NotApproved(_)) if self.local.state() == OperationState::Executing => {
                // The shared store does not hold it approved: released by a lapsed lease until
                // this replica registers again (its heartbeat does), so not now.
                drop(undo);
                Err(NotStarted::Unavailable(Unavailable {
                    reason: UnavailableReason::LeaseNotHeld,
                    retry_after: backend::SHARED_RETRY,
                }))
            }
            Err(NotStarted::NotApproved(_)) => {
                drop(undo);
                Err(NotStarted::NotApproved(self.local.state()))
            }
            Err(other) => {
                drop(undo);
                Err(other)
            }
        }
    }

    /// Waits for a free execution slot, takes it and moves `approved` → `executing`. `Err` with
    /// the state it is in if the operation is not (or no longer) approved.
    ///
    /// In-process it is woken when a slot is given back (no timer, any executor). Replicated it
    /// is woken by this process's releases and, for slots other replicas give back, tries again
    /// every second (this needs a Tokio runtime). Dropping the future while it waits changes
    /// nothing: the operation stays queued.
    pub async fn start(&self) -> Result<(), TransitionError> {
        loop {
            let freed = self.slot_freed();
            match self.try_start().await {
                Ok(()) => return Ok(()),
                Err(NotStarted::NotApproved(from)) => {
                    return Err(TransitionError {
                        from,
                        to: OperationState::Executing,
                    });
                }
                Err(NotStarted::Saturated(_)) | Err(NotStarted::Unavailable(_)) => freed.await,
            }
        }
    }

    /// The next moment this operation may be able to start: an execution slot given back in
    /// this process, a reload that may have raised `global_executing`, or the operation leaving
    /// `approved` — and, replicated, the shared retry pause. Take it *before* a
    /// [`try_start`](OperationHandle::try_start) that fails and await it after: no slot given
    /// back in between is missed. [`start`](OperationHandle::start) is that loop; an executor
    /// that must try under locks it cannot hold while it waits runs it in two halves.
    pub fn slot_freed(&self) -> impl Future<Output = ()> + Send + 'static {
        let local = self.local.slot_freed();
        let replicated = self.shared.is_some();
        async move {
            if replicated {
                backend::local_or_pause(local).await
            } else {
                local.await
            }
        }
    }
}

impl std::fmt::Debug for OperationHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperationHandle")
            .field("id", &self.id)
            .field("identity", self.identity())
            .field("state", &self.state())
            .field("replicated", &self.shared.is_some())
            .finish()
    }
}

/// Gives back a local execution slot when dropped, unless [`Unstart::keep`] was called: the
/// composite start's undo, run on a refusal and on a drop of the start's future alike.
struct Unstart<'a>(Option<&'a engine::Operation>);

impl Unstart<'_> {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Unstart<'_> {
    fn drop(&mut self) {
        if let Some(local) = self.0.take() {
            local.unstart();
        }
    }
}
