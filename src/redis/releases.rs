//! Transitions by operation id, and the releases kept until Redis answers: a release Redis does
//! not answer, or whose sender is dropped first, is kept and sent again in order, before
//! anything newer, by the heartbeat or the next release.

use std::time::Instant;

use super::decision::{Decision, Kept, Target};
use super::replica::{Inner, RedisController};
use super::reply::{Decided, TransitionReply};
use crate::admission::outcome::UnavailableReason;

/// A release to keep if the future sending it is dropped before Redis answers: armed before the
/// first `.await`, disarmed once the release (or the decision it undoes) is settled.
pub(crate) struct KeepOnDrop<'a> {
    inner: &'a Inner,
    kept: Option<Kept>,
}

impl<'a> KeepOnDrop<'a> {
    pub(crate) fn new(inner: &'a Inner, kept: Kept) -> KeepOnDrop<'a> {
        KeepOnDrop {
            inner,
            kept: Some(kept),
        }
    }

    /// Nothing to keep: the release was sent, or nothing was reserved.
    pub(crate) fn disarm(mut self) {
        self.kept = None;
    }
}

impl Drop for KeepOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(kept) = self.kept.take() {
            self.inner.keep(kept);
        }
    }
}

impl Inner {
    pub(super) fn is_kept(&self, id: &str) -> bool {
        crate::sync::lock(&self.outbox).iter().any(|k| k.id == id)
    }

    /// Keeps a release to send when Redis answers, and wakes the sender.
    pub(crate) fn keep(&self, kept: Kept) {
        crate::sync::lock(&self.outbox).push(kept);
        self.wake.notify_one();
    }

    /// Moves `id` in the shared counts (in the replica's next batch, see `commit`).
    pub(crate) async fn transition(
        &self,
        id: &str,
        target: Target,
        key: Option<&str>,
    ) -> Result<TransitionReply, UnavailableReason> {
        let config = self.config.load();
        let decision = Decision::Move {
            id: id.to_string(),
            target,
            global_executing: config.limits().global_executing,
            fair_share: config.fair_share(),
            key: key.map(str::to_string),
        };
        drop(config);
        match self.decide(decision).await? {
            Decided::Transition(reply) => Ok(reply),
            Decided::Admit(_) => Err(UnavailableReason::Reply(
                "an admission's reply to a transition".into(),
            )),
        }
    }

    /// Sends a release now, or keeps it for later if Redis does not answer (or earlier releases
    /// are still waiting, so they go first). Dropped before Redis answers, it is kept too.
    pub(crate) async fn release(&self, kept: Kept) {
        let waiting = !crate::sync::lock(&self.outbox).is_empty();
        let (id, target, key) = (kept.id.clone(), kept.target, kept.key.clone());
        let undo = KeepOnDrop::new(self, kept);
        if !waiting && !self.circuit.is_open() {
            let _shared = self.registration.read().await;
            if self.transition(&id, target, key.as_deref()).await.is_ok() {
                undo.disarm();
            }
        }
    }

    /// Sends kept releases in order until one fails; returns whether none is left.
    pub(super) async fn drain(&self) -> bool {
        self.drain_until(None).await
    }

    /// [`Inner::drain`], stopping at `deadline` if one is given (the rest go on the next call).
    pub(super) async fn drain_until(&self, deadline: Option<Instant>) -> bool {
        let _shared = self.registration.read().await;
        loop {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return crate::sync::lock(&self.outbox).is_empty();
            }
            let next = crate::sync::lock(&self.outbox).first().cloned();
            let Some(kept) = next else { return true };
            if self
                .transition(&kept.id, kept.target, kept.key.as_deref())
                .await
                .is_err()
            {
                return false;
            }
            let mut outbox = crate::sync::lock(&self.outbox);
            if outbox.first().is_some_and(|k| k.id == kept.id) {
                outbox.remove(0);
            }
        }
    }
}

impl RedisController {
    /// Sends the releases kept while Redis did not answer; returns whether none is left.
    pub(crate) async fn flush(&self) -> bool {
        self.inner.drain().await
    }
}
