//! One lock per (client, idempotency key) in use: submissions with the same key run one at a time
//! (so concurrent duplicates create one operation), and nothing else ever waits on them.
//!
//! A striped table (a few dozen locks shared by hash) would bound memory the same way, but a
//! replay, a cancel or a decision would then wait behind an unrelated submission that happens to
//! share its stripe — one held through an admission on Redis or a store write retried against a
//! busy disk — and those paths never pass through admission nor wait on it. Here a lock exists only
//! while someone holds it or waits for it: the entry counts its users and the last one out
//! removes it, so memory is bounded by the requests in flight, whatever the keys.
//!
//! Public (hidden) only for `benches/key_locks.rs`, which measures it against the striped table.

use std::sync::Arc;

use dashmap::DashMap;
use tokio::sync::OwnedMutexGuard;

/// A key's lock and how many hold it or wait for it.
type Entry = (Arc<tokio::sync::Mutex<()>>, usize);

/// The locks of the (client, key) pairs in use, by one string naming each pair. Sharded, so
/// submissions of different keys meet on a shard's lock only when they share it, and only for a
/// map step. Keys come from clients, so the map keeps the standard library's keyed (SipHash)
/// hasher.
#[derive(Default)]
pub struct KeyLocks {
    in_use: DashMap<Arc<str>, Entry>,
}

/// Holds `client`'s lock on `key` until dropped.
pub struct KeyGuard {
    locks: Arc<KeyLocks>,
    name: Arc<str>,
    held: Option<OwnedMutexGuard<()>>,
}

/// One string naming the pair exactly: the client's length first, so no two pairs share a name
/// (`a` + `bc` is `1:abc`, `ab` + `c` is `2:abc`). One allocation, shared by the map and the
/// guard.
fn name(client: &str, key: &str) -> Arc<str> {
    use std::fmt::Write;
    let mut name = String::with_capacity(client.len() + key.len() + 4);
    // Only the length goes through the formatter; writing to a `String` cannot fail.
    let _ = write!(name, "{}", client.len());
    name.push(':');
    name.push_str(client);
    name.push_str(key);
    Arc::from(name)
}

impl KeyLocks {
    /// Waits for `client`'s lock on `key`. Dropped while waiting (its client hung up), it leaves
    /// nothing behind.
    pub async fn lock(self: &Arc<Self>, client: &str, key: &str) -> KeyGuard {
        let name = name(client, key);
        let lock = {
            let mut entry = self.in_use.entry(Arc::clone(&name)).or_default();
            entry.1 += 1;
            Arc::clone(&entry.0)
        };
        // Counted from here: dropped before the lock is had, the guard still gives its use back.
        let mut guard = KeyGuard {
            locks: Arc::clone(self),
            name,
            held: None,
        };
        guard.held = Some(lock.lock_owned().await);
        guard
    }

    /// How many (client, key) pairs have a lock now.
    pub fn in_use(&self) -> usize {
        self.in_use.len()
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        // The lock first, so an entry is never removed while its lock is held.
        drop(self.held.take());
        self.locks
            .in_use
            .remove_if_mut(&*self.name, |_, (_, users)| {
                *users -= 1;
                *users == 0
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    /// Polls `future` once: whether it is ready now.
    fn ready_now<F: Future>(future: F) -> Option<F::Output> {
        let mut future = pin!(future);
        match future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        }
    }

    #[test]
    fn only_the_same_client_and_key_wait_for_each_other() {
        let locks = Arc::new(KeyLocks::default());
        let held = ready_now(locks.lock("bot", "k1")).expect("a free key");
        // Another key of the same client, and the same key of another client: not waiting.
        assert!(ready_now(locks.lock("bot", "k2")).is_some());
        assert!(ready_now(locks.lock("other", "k1")).is_some());
        // The same client and key waits until the holder lets go.
        let mut same = Box::pin(locks.lock("bot", "k1"));
        let cx = &mut Context::from_waker(Waker::noop());
        assert!(same.as_mut().poll(cx).is_pending());
        drop(held);
        let Poll::Ready(second) = same.as_mut().poll(cx) else {
            panic!("the key was let go, yet its next submission still waits");
        };
        assert_eq!(locks.in_use(), 1);
        drop(second);
        assert_eq!(locks.in_use(), 0);
    }

    #[test]
    fn a_waiter_that_gives_up_leaves_nothing_and_does_not_hold_the_key() {
        let locks = Arc::new(KeyLocks::default());
        let held = ready_now(locks.lock("bot", "k1")).expect("a free key");
        let mut waiter = Box::pin(locks.lock("bot", "k1"));
        let cx = &mut Context::from_waker(Waker::noop());
        assert!(waiter.as_mut().poll(cx).is_pending());
        drop(waiter); // its client hung up
        assert_eq!(locks.in_use(), 1, "only the holder's");
        drop(held);
        assert_eq!(locks.in_use(), 0, "nothing left behind");
        // And the key is free again.
        assert!(ready_now(locks.lock("bot", "k1")).is_some());
        assert_eq!(locks.in_use(), 0);
    }
}
