//! One connection attempt: made on a task of its own, so a slow one (a node down, a Sentinel
//! that does not answer) ends even when every caller waiting for it gave up (their call
//! timeouts); every caller that waits on it gets its outcome. A failed attempt is replaced by
//! the next caller (`again`), never retried in place, so each call makes at most one.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use redis::{ErrorKind, RedisError};
use tokio::sync::watch;

/// One attempt at a connection of type `L`.
pub(super) struct Attempt<L> {
    started: AtomicBool,
    outcome: watch::Sender<Option<Result<L, RedisError>>>,
}

impl<L: Clone + Send + Sync + 'static> Attempt<L> {
    pub(super) fn new() -> Attempt<L> {
        Attempt {
            started: AtomicBool::new(false),
            outcome: watch::channel(None).0,
        }
    }

    /// Starts `connect`, once, on a task of its own.
    pub(super) fn start<F>(self: &Arc<Self>, connect: impl FnOnce() -> F)
    where
        F: Future<Output = Result<L, RedisError>> + Send + 'static,
    {
        // Acquire/AcqRel: one starter; the outcome itself is published through the channel.
        if self.started.load(Ordering::Acquire) || self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let attempt = Arc::clone(self);
        let connecting = connect();
        tokio::spawn(async move {
            let outcome = connecting.await;
            attempt.outcome.send_replace(Some(outcome));
        });
    }

    /// This attempt's connection, `connect` started now if nothing started it yet.
    pub(super) async fn outcome<F>(
        self: &Arc<Self>,
        connect: impl FnOnce() -> F,
    ) -> Result<L, RedisError>
    where
        F: Future<Output = Result<L, RedisError>> + Send + 'static,
    {
        // Made already: every call but the first few of a connection.
        if let Some(Ok(made)) = &*self.outcome.borrow() {
            return Ok(made.clone());
        }
        self.start(connect);
        let mut outcome = self.outcome.subscribe();
        let seen = outcome.wait_for(Option::is_some).await;
        match seen.as_deref() {
            Ok(Some(outcome)) => outcome.clone(),
            _ => Err(RedisError::from((
                ErrorKind::Io,
                "the connection attempt ended without an answer",
            ))),
        }
    }
}

/// Replaces the attempt `seen` in `current` with a new one, unless another caller did already:
/// the new attempt if this call put it there.
pub(super) fn again<L: Clone + Send + Sync + 'static>(
    current: &ArcSwap<Attempt<L>>,
    seen: &Arc<Attempt<L>>,
) -> Option<Arc<Attempt<L>>> {
    let fresh = Arc::new(Attempt::new());
    let previous = current.compare_and_swap(seen, Arc::clone(&fresh));
    Arc::ptr_eq(&previous, seen).then_some(fresh)
}
