//! The permit and lifecycle handles of the shared controller, with the in-process handles'
//! semantics: whichever call moves an operation into a terminal state, and only that call, sends
//! its release — by operation id, so a retried release frees nothing twice. The handle's own
//! state decides the winner (one compare-and-swap, as in the in-process lifecycle); Redis only
//! counts.
//!
//! A release Redis does not answer is kept and retried until it does; the caller is not made to
//! wait for it. Only starting execution needs Redis's answer (it takes a shared slot).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::decision::{Kept, Target};
use super::held::Held;
use super::replica::Inner;
use super::reply::TransitionReply;
use crate::admission::outcome::NotStarted as RedisStartError;
use crate::admission::outcome::UnavailableReason;
use crate::engine::{
    CancelOutcome, OperationState, QuotaStatus, Refusal, RefusalCode, TransitionError,
};

/// An admitted submission on the shared controller, before the broker has created its durable
/// operation. [`RedisPermit::commit`] turns it into a [`RedisOperation`]; dropped without commit
/// it releases its slots (the rate token stays spent); [`RedisPermit::refund`] returns the token
/// too.
#[must_use = "a permit holds slots until it is committed or dropped"]
pub(crate) struct RedisPermit {
    inner: Arc<Inner>,
    cell: Option<Arc<Held>>,
    needs_approval: bool,
    /// The rate the token was taken under: emission interval and burst span (µs).
    rate_micros: (u64, u64),
    /// The idempotency record the admission wrote, freed again if this permit is refunded or
    /// dropped (committed, it stays bound to the operation).
    key: Option<String>,
    /// The client's quota as Redis's decision left it (`None` for a retried id's admission,
    /// which Redis did not decide again).
    quota: Option<QuotaStatus>,
}

impl RedisPermit {
    pub(super) fn new(
        inner: Arc<Inner>,
        cell: Arc<Held>,
        needs_approval: bool,
        rate_micros: (u64, u64),
        key: Option<String>,
        quota: Option<QuotaStatus>,
    ) -> RedisPermit {
        RedisPermit {
            inner,
            cell: Some(cell),
            needs_approval,
            rate_micros,
            key,
            quota,
        }
    }

    /// The client's quota as the shared decision left it: its bucket and its counts on every
    /// replica.
    pub(crate) fn quota(&self) -> Option<QuotaStatus> {
        self.quota
    }

    /// The durable operation exists: its lifecycle handle (the reservation is already recorded
    /// under its id, in its first state).
    pub(crate) fn commit(mut self) -> RedisOperation {
        let cell = self.cell.take().expect("a live permit holds its cell");
        // Its row is in the store now: a recovery reads its key and admission from there.
        crate::sync::lock(&cell.uncommitted).take();
        RedisOperation::new(Arc::clone(&self.inner), cell)
    }

    /// The broker failed through its own fault: return the slots, the rate token and the
    /// idempotency key's binding. Dropped before Redis answers, the release is kept and sent later.
    pub(crate) async fn refund(mut self) {
        if let Some(cell) = self.cell.take() {
            let target = Target::Refund(self.rate_micros.0, self.rate_micros.1);
            finish(&self.inner, &cell, target, self.key.take()).await;
        }
    }
}

impl Drop for RedisPermit {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            let state = cell.state();
            cell.state
                .store(OperationState::Failed as u8, Ordering::Release);
            if !state.is_terminal() {
                forget(&self.inner, &cell);
                self.inner.keep(Kept {
                    id: cell.id.clone(),
                    target: Target::Terminal,
                    key: self.key.take(),
                });
            }
        }
    }
}

impl fmt::Debug for RedisPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("id", &self.cell.as_ref().map(|c| &c.id))
            .field("needs_approval", &self.needs_approval)
            .finish()
    }
}

/// The shared controller's handle on one live operation: it holds the operation's slots (in
/// Redis, under its id) until a terminal transition releases them, exactly once. Dropping a
/// handle that is not terminal releases them as if the operation had failed.
pub(crate) struct RedisOperation {
    inner: Arc<Inner>,
    cell: Arc<Held>,
}

impl RedisOperation {
    pub(super) fn new(inner: Arc<Inner>, cell: Arc<Held>) -> RedisOperation {
        RedisOperation { inner, cell }
    }

    /// The operation's id.
    pub(crate) fn id(&self) -> &str {
        &self.cell.id
    }

    /// The current state.
    pub(crate) fn state(&self) -> OperationState {
        self.cell.state()
    }

    /// `pending` → `approved`.
    pub(crate) async fn approve(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Approved).await.map(|_| ())
    }

    /// `pending` → `denied`, releasing its slots.
    pub(crate) async fn deny(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Denied).await.map(|_| ())
    }

    /// `pending` or `approved` → `canceled`, releasing its slots ([`CancelOutcome::Canceled`]
    /// with the state it left). Canceling a terminal operation changes nothing
    /// ([`CancelOutcome::AlreadyTerminal`]), as with the in-process handle.
    pub(crate) async fn cancel(&self) -> Result<CancelOutcome, TransitionError> {
        match self.transition(OperationState::Canceled).await {
            Ok(from) => Ok(CancelOutcome::Canceled { from }),
            Err(TransitionError { from, .. }) if from.is_terminal() => {
                Ok(CancelOutcome::AlreadyTerminal(from))
            }
            Err(err) => Err(err),
        }
    }

    /// `pending` or `approved` → `expired`.
    pub(crate) async fn expire(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Expired).await.map(|_| ())
    }

    /// Any live state → `failed`.
    pub(crate) async fn fail(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Failed).await.map(|_| ())
    }

    /// `executing` → `succeeded`.
    pub(crate) async fn succeed(&self) -> Result<(), TransitionError> {
        self.transition(OperationState::Succeeded).await.map(|_| ())
    }

    /// Takes a shared execution slot and moves `approved` → `executing`. A saturated pool, a
    /// Redis that does not answer, or one whose replicas are registering again after it forgot
    /// the deployment, leaves it `approved` (queued) to retry.
    pub(crate) async fn try_start(&self) -> Result<(), RedisStartError> {
        let inner = &self.inner;
        let current = self.state();
        if current != OperationState::Approved {
            return Err(RedisStartError::NotApproved(current));
        }
        let _shared = inner.registration.read().await;
        let reply = inner
            .transition(&self.cell.id, Target::Executing, None)
            .await
            .map_err(|reason| RedisStartError::Unavailable(inner.unavailable(reason)))?;
        match reply {
            TransitionReply::Moved(_) | TransitionReply::Same => {}
            TransitionReply::Saturated => {
                let hint = inner.options.capacity_retry.as_nanos() as u64;
                return Err(RedisStartError::Saturated(Refusal::after_nanos(
                    RefusalCode::GlobalExecutionLimit,
                    hint,
                )));
            }
            TransitionReply::Recounting => {
                return Err(RedisStartError::Unavailable(
                    inner.unavailable(UnavailableReason::Recovering),
                ));
            }
            TransitionReply::NotAllowed(_) | TransitionReply::Absent => {
                // Redis does not hold it approved: released by a lapsed lease (the next
                // heartbeat re-registers it), or lost to a concurrent terminal move.
                let now = self.state();
                return Err(if now == OperationState::Approved {
                    RedisStartError::Unavailable(inner.unavailable(UnavailableReason::LeaseNotHeld))
                } else {
                    RedisStartError::NotApproved(now)
                });
            }
        }
        // AcqRel: as in the lifecycle's transitions.
        match self.cell.state.compare_exchange(
            OperationState::Approved as u8,
            OperationState::Executing as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(()),
            // Lost to a terminal move, whose release (sent after, by id) frees the slot taken
            // here too: Redis releases whatever it records the operation as holding.
            Err(actual) => Err(RedisStartError::NotApproved(
                OperationState::ALL[usize::from(actual)],
            )),
        }
    }

    /// Moves to `to` if the contract allows it; the winning compare-and-swap, and only it, sends
    /// the shared counts' change.
    async fn transition(&self, to: OperationState) -> Result<OperationState, TransitionError> {
        debug_assert_ne!(to, OperationState::Executing);
        let cell = &self.cell;
        let mut current = cell.state.load(Ordering::Acquire);
        let from = loop {
            let from = OperationState::ALL[usize::from(current)];
            if !from.can_move_to(to) {
                return Err(TransitionError { from, to });
            }
            // AcqRel: as in the lifecycle's transitions.
            match cell.state.compare_exchange(
                current,
                to as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break from,
                Err(actual) => current = actual,
            }
        };
        if to.is_terminal() {
            finish(&self.inner, cell, Target::Terminal, None).await;
        } else {
            self.inner
                .release(Kept {
                    id: cell.id.clone(),
                    target: Target::Approved,
                    key: None,
                })
                .await;
            // An approval lowers the pending counts: a release as far as refusals go.
            self.inner
                .memory
                .released_here(cell.identity.as_str(), false);
        }
        Ok(from)
    }

    /// Lets the operation go here without a word to Redis: another replica took it over, and
    /// Redis records it as that replica's (moved there in the registration that counted it), so
    /// a release sent from here would free what the other now holds. This replica stops
    /// holding it (a re-registration no longer counts it here) and its memory forgets it.
    /// Whether it was live here.
    pub(crate) fn hand_over(&self) -> bool {
        if !fail_if_live(&self.cell) {
            return false;
        }
        forget(&self.inner, &self.cell);
        self.inner
            .memory
            .released_here(self.cell.identity.as_str(), false);
        true
    }
}

/// Moves a live operation to `failed` here; whether this call did (the winning
/// compare-and-swap, and only it, lets go of the operation after). `false` once terminal.
fn fail_if_live(cell: &Held) -> bool {
    let mut current = cell.state.load(Ordering::Acquire);
    loop {
        if OperationState::ALL[usize::from(current)].is_terminal() {
            return false;
        }
        // AcqRel: as in the lifecycle's transitions.
        match cell.state.compare_exchange(
            current,
            OperationState::Failed as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return true,
            Err(actual) => current = actual,
        }
    }
}

/// No longer held by this replica: re-registration must not count it.
fn forget(inner: &Inner, cell: &Held) {
    inner.lock_held().remove(&cell.id);
}

async fn finish(inner: &Inner, cell: &Held, target: Target, key: Option<String>) {
    forget(inner, cell);
    inner
        .release(Kept {
            id: cell.id.clone(),
            target,
            key,
        })
        .await;
    // This replica's own memory forgets at once what the release may have changed (the
    // others hear it from Redis).
    inner
        .memory
        .released_here(cell.identity.as_str(), matches!(target, Target::Refund(..)));
}

impl Drop for RedisOperation {
    fn drop(&mut self) {
        if !fail_if_live(&self.cell) {
            return;
        }
        forget(&self.inner, &self.cell);
        self.inner.keep(Kept {
            id: self.cell.id.clone(),
            target: Target::Terminal,
            key: None,
        });
    }
}

impl fmt::Debug for RedisOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisOperation")
            .field("id", &self.cell.id)
            .field("identity", &self.cell.identity)
            .field("state", &self.state())
            .finish()
    }
}
