//! One replica's state and its handle. [`Inner`] holds what every concern of a replica shares —
//! the connection, the lease, the epoch, the kept releases, the registration lock, the refusal
//! memory, the writer's queue — and their rules only hold together (registration after a loss
//! reads and rewrites all of them), so it is one type; each concern is an `impl` of it in a file
//! of its own (the module's docs list them). Here: the type, how it runs a script (with the call
//! timeout, through the circuit), and how it counts an unavailable answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;
use redis::Value;

use super::circuit::Circuit;
use super::connect::connection::Connection;
use super::decision::{Kept, Queue};
use super::held::Held;
use super::keys::Keys;
use super::memory::RefusalMemory;
use super::scripts::Scripts;
use super::units::secs_at_least_one;
use crate::admission::options::ReplicaOptions;
use crate::admission::outcome::{Unavailable, UnavailableReason};
use crate::admission::recovery::RecoverySource;
use crate::config::Config;

/// One replica's shared state: what the files of this module each `impl` a concern of.
pub(crate) struct Inner {
    /// Redis, whichever kind the URL names (see `connect`).
    pub(super) conn: Connection,
    pub(super) keys: Keys,
    pub(super) options: ReplicaOptions,
    pub(super) token: String,
    pub(super) scripts: Scripts,
    pub(super) config: ArcSwap<Config>,
    /// Every live operation this replica holds (admitted, committed or restored), by id.
    pub(super) held: Mutex<HashMap<String, Arc<Held>>>,
    /// Admissions and transitions hold it shared; (re)registration holds it alone, so what it
    /// reads from `held` is exactly what Redis holds for this replica when it runs.
    pub(super) registration: tokio::sync::RwLock<()>,
    /// Held (write) by a recovery from before it reads the store's key records until it has
    /// written them back, and (read) by a retirement's second unbinding, after its rows are
    /// deleted: a key retired meanwhile is never left bound for a row already gone.
    pub(super) restoring: tokio::sync::RwLock<()>,
    /// Until when the lease is surely held (the send time of the last renewal plus the TTL).
    pub(super) lease_until: Mutex<Option<Instant>>,
    /// Set when the first registration (`restore`) begins: before it, an admission is
    /// [`UnavailableReason::NotRestored`], which names the embedder's missing call.
    pub(super) restore_begun: AtomicBool,
    /// Since when every renewal has gone through (none failed, none found the lease lapsed):
    /// lapsed leases are reaped only once this is a whole lease old. After Redis stalled (or
    /// this replica was cut off) for a lease, every lease has lapsed, and the first replica to
    /// renew would otherwise release live work the others are about to renew.
    pub(super) renewing_since: Mutex<Option<Instant>>,
    pub(super) circuit: Circuit,
    pub(super) outbox: Mutex<Vec<Kept>>,
    pub(super) wake: Arc<tokio::sync::Notify>,
    pub(super) errors: AtomicU64,
    pub(super) lease_changes: AtomicU64,
    pub(super) reaped: AtomicU64,
    pub(super) unavailable: AtomicU64,
    pub(super) heartbeat: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The deployment's epoch this replica registered in (`None` before its first registration).
    pub(super) epoch: Mutex<Option<String>>,
    /// The deployment's replicas as last seen (with this one and the configured ones): who must
    /// register again before a recovery ends.
    pub(super) known_replicas: Mutex<std::collections::BTreeSet<String>>,
    /// One reading of the deployment's replicas at a time, so an older reading is never applied
    /// over a newer one.
    pub(super) learning: tokio::sync::Mutex<()>,
    /// Where re-registration after Redis forgot gets the key records and the rate history.
    pub(super) source: std::sync::OnceLock<Arc<dyn RecoverySource>>,
    /// The heartbeat should renew (and register again) at once, not only drain kept releases.
    pub(super) renew_now: AtomicBool,
    /// Operations taken over from another replica are held here but not yet counted under this
    /// replica in Redis (the registration that moves them did not get through): the heartbeat
    /// registers again until it does.
    pub(super) adopted_unregistered: AtomicBool,
    /// Redis's primary changed under this replica (a failover followed): the heartbeat
    /// registers again until it does, so what the old primary acknowledged and did not pass on
    /// (a release, or without `WAIT` an admission) is counted as this replica holds it.
    pub(super) primary_changed: AtomicBool,
    /// Whether the last registration found a recovery in progress.
    pub(super) recovering: AtomicBool,
    /// Redis's refusals, answered here until they can have changed.
    pub(super) memory: Arc<RefusalMemory>,
    /// Room for admission decisions in flight to Redis: in all, and per client.
    pub(super) decisions: Arc<tokio::sync::Semaphore>,
    pub(super) client_decisions: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// Submissions answered unavailable for want of that room.
    pub(super) busy: AtomicU64,
    /// The task that hears the deployment's notices.
    pub(super) notices: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The replica's decisions on their way to Redis (see `commit`).
    pub(super) queue: Queue,
}

/// The admission controller shared by broker replicas through Redis. Cheap to clone.
///
/// Set up with [`RedisController::connect_lazy`], then [`RedisController::register_or_defer`]
/// with what the replica's store restores (which takes the lease and starts the heartbeat); then
/// [`RedisController::admit`] as with the in-process controller, with the operation's id (made
/// by [`crate::Admission`], never by a caller).
#[derive(Clone)]
pub(crate) struct RedisController {
    pub(super) inner: Arc<Inner>,
}

impl RedisController {
    /// This replica's name.
    pub(crate) fn replica(&self) -> &str {
        &self.inner.options.replica
    }

    /// Stops the heartbeat (the lease then lapses unless another process under this name renews
    /// it) and the notices. Kept releases are sent first if Redis answers.
    pub(crate) async fn shutdown(&self) {
        self.inner.drain().await;
        let task = crate::sync::lock(&self.inner.heartbeat).take();
        if let Some(task) = task {
            task.abort();
        }
        let task = crate::sync::lock(&self.inner.notices).take();
        if let Some(task) = task {
            task.abort();
        }
        self.inner.memory.unsubscribed();
    }
}

impl Inner {
    pub(crate) fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Held>>> {
        crate::sync::lock(&self.held)
    }

    pub(super) fn unavailable(&self, reason: UnavailableReason) -> Unavailable {
        // Relaxed: a statistic.
        self.unavailable.fetch_add(1, Ordering::Relaxed);
        Unavailable {
            reason,
            retry_after: secs_at_least_one(self.options.unavailable_retry),
        }
    }

    /// Counts a failed call and answers unavailable.
    pub(super) fn failed(&self, reason: UnavailableReason) -> Unavailable {
        // Relaxed: a statistic.
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.circuit.failed();
        self.unavailable(reason)
    }

    /// Runs one script with the call timeout, through the circuit's accounting.
    pub(super) async fn call(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Value, UnavailableReason> {
        self.call_on(&mut self.conn.clone(), invocation).await
    }

    /// [`Inner::call`] on `conn` (a [`Connection::pinned`] one).
    pub(super) async fn call_on(
        &self,
        conn: &mut Connection,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Value, UnavailableReason> {
        let result = tokio::time::timeout(
            self.options.call_timeout,
            invocation.invoke_async::<Value>(conn),
        )
        .await;
        let reason = match result {
            Ok(Ok(value)) => {
                self.circuit.succeeded();
                return Ok(value);
            }
            Ok(Err(e)) => UnavailableReason::Redis(e.to_string()),
            Err(_) => UnavailableReason::Timeout,
        };
        // Relaxed: a statistic.
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.circuit.failed();
        Err(reason)
    }

    /// The connection held to the physical one it goes through now (made now if need be), for a
    /// write and the `WAIT` after it; a failure counts as a failed call's does.
    pub(super) async fn pinned(&self) -> Result<Connection, UnavailableReason> {
        let reason = match tokio::time::timeout(self.options.call_timeout, self.conn.pinned()).await
        {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => UnavailableReason::Redis(e.to_string()),
            Err(_) => UnavailableReason::Timeout,
        };
        // Relaxed: a statistic.
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.circuit.failed();
        Err(reason)
    }

    /// The epoch this replica registered in, if it has.
    pub(super) fn epoch(&self) -> Option<String> {
        crate::sync::lock(&self.epoch).clone()
    }
}

/// 16 bytes of [`fill_random`] as 32 hex digits (an epoch, a restore's nonce).
pub(super) fn random_hex() -> String {
    let mut bytes = [0u8; 16];
    fill_random(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn fill_random(bytes: &mut [u8]) {
    // Unique enough to tell two processes under one replica name apart: time, process, address.
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        let mut h = state.build_hasher();
        h.write_usize(i);
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for slot in [&mut self.heartbeat, &mut self.notices] {
            if let Some(task) = slot.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                task.abort();
            }
        }
    }
}
