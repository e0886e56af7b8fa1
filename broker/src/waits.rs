//! The open long-poll waits and the bells that wake them: each operation being waited on has a
//! bell, rung by `Core::changed` right after every durable state change (the executor's start and
//! its failures included), never by polling the store: an idle wait is a parked task. Bells are
//! created when the first waiter of an operation arrives and dropped with its last, so the
//! registry holds only what is waited on.
//!
//! Waiting is not work: it is never admitted and holds no quota. A client may hold at most
//! [`MAX_WAITS_PER_CLIENT`] waits at once; one more is refused (the route answers 429
//! `too_many_waits`), which concerns that client only. A wait's slot is given back by its `Drop`,
//! so a client that hangs up leaks no count.
//!
//! The core holds this registry; the route that waits (`GET
//! /api/agent/v1/operations/{id}/events`) is `api::waits`.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

/// Most waits one client may hold open at once.
pub const MAX_WAITS_PER_CLIENT: usize = 32;

/// The bells of the operations being waited on, and how many waits each client holds.
#[derive(Default)]
pub(crate) struct Waits {
    inner: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    bells: HashMap<String, Bell>,
    per_client: HashMap<String, usize>,
}

struct Bell {
    ring: watch::Sender<()>,
    waiters: usize,
}

/// The client already holds [`MAX_WAITS_PER_CLIENT`] waits.
#[derive(Debug)]
pub(crate) struct TooManyWaits;

impl Waits {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        crate::sync::lock(&self.inner)
    }

    /// Rings the bell of operation `id`, if anyone waits on it. Call after the change is
    /// durable, so a woken waiter reads it.
    pub(crate) fn ring(&self, id: &str) {
        if let Some(bell) = self.registry().bells.get(id) {
            bell.ring.send_replace(());
        }
    }

    /// Rings every bell: anything may have changed (a change feed from other replicas was cut).
    pub(crate) fn ring_all(&self) {
        for bell in self.registry().bells.values() {
            bell.ring.send_replace(());
        }
    }

    /// Takes one of `client`'s wait slots on operation `id`; the slot's bell hears every change
    /// from now on.
    pub(crate) fn enter(&self, client: &str, id: &str) -> Result<WaitSlot<'_>, TooManyWaits> {
        let mut registry = self.registry();
        let held = registry.per_client.entry(client.to_owned()).or_insert(0);
        if *held >= MAX_WAITS_PER_CLIENT {
            return Err(TooManyWaits);
        }
        *held += 1;
        let bell = registry.bells.entry(id.to_owned()).or_insert_with(|| Bell {
            ring: watch::Sender::new(()),
            waiters: 0,
        });
        bell.waiters += 1;
        Ok(WaitSlot {
            waits: self,
            client: client.to_owned(),
            id: id.to_owned(),
            bell: bell.ring.subscribe(),
        })
    }

    /// How many waits are open (all clients).
    #[cfg(test)]
    fn open(&self) -> usize {
        self.registry().per_client.values().sum()
    }

    /// How many operations have a bell.
    #[cfg(test)]
    fn bells(&self) -> usize {
        self.registry().bells.len()
    }
}

/// One open wait: a client's slot and the operation's bell. Dropping it gives both back.
pub(crate) struct WaitSlot<'a> {
    waits: &'a Waits,
    client: String,
    id: String,
    bell: watch::Receiver<()>,
}

impl WaitSlot<'_> {
    /// Returns once the bell rings (at once if it rang since the last call or since entering).
    pub(crate) async fn rung(&mut self) {
        // The sender lives in the registry as long as this slot does, so this never fails.
        let _ = self.bell.changed().await;
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        let mut registry = self.waits.registry();
        if let Some(held) = registry.per_client.get_mut(&self.client) {
            *held -= 1;
            if *held == 0 {
                registry.per_client.remove(&self.client);
            }
        }
        if let Some(bell) = registry.bells.get_mut(&self.id) {
            bell.waiters -= 1;
            if bell.waiters == 0 {
                registry.bells.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn slots_are_bounded_per_client_and_given_back_on_drop() {
        let waits = Waits::default();
        let held: Vec<_> = (0..MAX_WAITS_PER_CLIENT)
            .map(|_| waits.enter("a", "op_1").unwrap())
            .collect();
        assert!(waits.enter("a", "op_2").is_err());
        let other = waits
            .enter("b", "op_1")
            .expect("another client is not blocked");
        assert_eq!(waits.open(), MAX_WAITS_PER_CLIENT + 1);
        drop(held);
        drop(other);
        assert_eq!((waits.open(), waits.bells()), (0, 0));
        assert!(waits.enter("a", "op_2").is_ok());
    }

    #[tokio::test]
    async fn a_ring_wakes_the_waiters_of_that_operation_only() {
        let waits = Waits::default();
        let mut one = waits.enter("a", "op_1").unwrap();
        let two = waits.enter("a", "op_2").unwrap();
        waits.ring("op_1");
        tokio::time::timeout(Duration::from_secs(10), one.rung())
            .await
            .expect("the rung operation's waiter wakes");
        assert!(
            !two.bell.has_changed().unwrap(),
            "another operation's waiter sleeps on"
        );
        waits.ring("op_unwatched");
        assert_eq!(waits.bells(), 2);
    }
}
