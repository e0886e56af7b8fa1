//! How a replica reaches Redis, and setting it up without waiting for Redis: the options
//! checked, the connection made by the first call (and again after each failure, so a replica
//! starts while Redis is down), the scripts loaded, and the group commit's writer spawned.
//!
//! The connection logic lives in this room alone; the rest of `redis/` holds a
//! [`connection::Connection`] and never asks which kind of Redis is behind it. A failover is a
//! reconnection, not a mode: Sentinel and Cluster are two more ways to find the Redis to talk
//! to, and the scripts, the lease, the kept releases and recovery stay as they are.
//!
//! - `connection`: the one connection type (commands, pipelines, scripts; pinned for a write and
//!   its `WAIT`; the notices' subscriber; the count of primary changes).
//! - `following`: one primary, connected on first use and again after a connection error or a
//!   `READONLY`: the URL's one server, or the primary its Sentinels name (`sentinel`: asking
//!   them, the newest answer confirmed with `ROLE`; hearing each of them, calls held back from
//!   `+try-failover` until the connection is on the primary `+switch-master` names).
//! - `cluster`: the deployment's one slot of a Redis Cluster, through the redis crate's cluster
//!   client (which follows `MOVED` and `ASK`).
//! - `attempt`: one connection attempt, on a task of its own, its outcome shared; `node`: how to
//!   reach a node found at run time.

mod attempt;
mod cluster;
pub(crate) mod connection;
mod following;
mod node;
mod sentinel;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use self::connection::Connection;
use super::circuit::Circuit;
use super::commit;
use super::decision;
use super::keys::Keys;
use super::memory::RefusalMemory;
use super::replica::{Inner, RedisController, fill_random};
use super::scripts::Scripts;
use crate::admission::options::ReplicaOptions;
use crate::admission::outcome::SetupError;
use crate::config::Config;

impl RedisController {
    /// The shared controller of one replica, without waiting for Redis: the connection is made
    /// by the first call and made again after each failure, so a replica can start while Redis
    /// is down (see [`RedisController::register_or_defer`]). Fails only on invalid options or
    /// URL, or when called outside a Tokio runtime. Admits nothing until registration has taken
    /// the lease.
    pub(crate) fn connect_lazy(
        config: Config,
        options: ReplicaOptions,
    ) -> Result<RedisController, SetupError> {
        options.check()?;
        // The connection manager and the replica's background tasks are spawned on the
        // caller's runtime: outside one they would panic, so say what is missing instead.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(SetupError::Options(
                "a replica needs a Tokio runtime: build the Admission inside one \
                 (in an async fn under #[tokio::main], or within Runtime::block_on)"
                    .to_owned(),
            ));
        }
        let keys = Keys::new(&options.prefix);
        let conn = Connection::open(
            &options.url,
            &keys.base,
            options.call_timeout,
            options.heartbeat,
            options.lease_ttl,
        )
        .map_err(|e| SetupError::Redis(format!("{}: {e}", options.url_redacted())))?;
        let mut token_bytes = [0u8; 16];
        fill_random(&mut token_bytes);
        let token: String = token_bytes.iter().map(|b| format!("{b:02x}")).collect();
        let (queue, jobs) = decision::queue();
        let inner = Inner {
            queue,
            conn,
            keys,
            circuit: Circuit::new(options.circuit_threshold, options.circuit_cool_down),
            token,
            scripts: Scripts::load(),
            config: ArcSwap::from_pointee(config),
            held: Mutex::new(HashMap::new()),
            registration: tokio::sync::RwLock::new(()),
            restoring: tokio::sync::RwLock::new(()),
            lease_until: Mutex::new(None),
            restore_begun: AtomicBool::new(false),
            renewing_since: Mutex::new(None),
            outbox: Mutex::new(Vec::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
            errors: AtomicU64::new(0),
            lease_changes: AtomicU64::new(0),
            reaped: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            heartbeat: Mutex::new(None),
            epoch: Mutex::new(None),
            known_replicas: Mutex::new(
                options
                    .replicas
                    .iter()
                    .cloned()
                    .chain(std::iter::once(options.replica.clone()))
                    .collect(),
            ),
            learning: tokio::sync::Mutex::new(()),
            source: std::sync::OnceLock::new(),
            renew_now: AtomicBool::new(false),
            adopted_unregistered: AtomicBool::new(false),
            primary_changed: AtomicBool::new(false),
            recovering: AtomicBool::new(false),
            memory: Arc::new(RefusalMemory::default()),
            decisions: Arc::new(tokio::sync::Semaphore::new(options.decisions_in_flight)),
            client_decisions: Mutex::new(HashMap::new()),
            busy: AtomicU64::new(0),
            notices: Mutex::new(None),
            options,
        };
        let inner = Arc::new(inner);
        // The writer holds the replica only while a batch is in flight, and ends with it.
        tokio::spawn(commit::write(Arc::downgrade(&inner), jobs));
        Ok(RedisController { inner })
    }
}
