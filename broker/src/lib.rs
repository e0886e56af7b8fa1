//! The reference broker of unyolo-admission: the admission controller embedded in a broker that
//! speaks unYOLO's Agent V1 to agents and Operator V1 to operators over HTTP, with every operation
//! in a durable store (a SQLite file in its data dir, or one PostgreSQL database a fleet of
//! replicas shares). It exists to prove the library under overload, crashes and bad input, and to
//! show broker authors where each call goes. It uses the library (`unyolo_admission`) through its
//! public API only, as any embedder does; the `admission` command (`main.rs`) is its front.
//!
//! # The layers, by folder and file
//!
//! Imports run one way, down this list: a file imports only from the layers below its own.
//!
//! - the commands on top of everything: [`serve`] (`admission serve`), [`drill`] and
//!   [`drill_replicas`] (the overload drill), [`history`] (`admission check --history`).
//! - `startup`: [`Broker::start`] (open the store, restore the counts and the rate buckets from
//!   it, start the tasks and the listeners with their routers) and [`Broker::shutdown`].
//! - [`api`]: the only part that knows HTTP and JSON. The router (`api/mod.rs`), the leaf error
//!   type (`api::error::ApiError`, with `From` the store's error), the extractors
//!   (`api::extract`: the client from the bearer token, the path id, the query, the body), the
//!   JSON projection of stored records (`api::projection`, `api::presentation`), and one file
//!   per part of the wire contracts: `agent_operations` (submit, get, cancel; the order
//!   authenticate → validate → replay → admit → create → commit), [`listing`], `waits` (the long
//!   poll), `streams`, [`discovery`], `health` (`/healthz`, `/readyz` of the agent listener),
//!   [`api::operator`] (the operator listener: Operator V1's discovery, health, request list,
//!   one request and decisions, its envelope and projection, [`events`](api::events) (the event
//!   stream, SSE), `/metrics`, `/admission/v1/drift` and `/admission/v1/shadow`), [`ratelimit`]
//!   (the quota fields on submission answers).
//! - the rooms that act on the shared state: `operations` (the one way a live operation's state
//!   changes: store first, then the lifecycle handle, under the operation's lock), `exec` (the
//!   demo executor; approved work waits for an execution slot, woken by the controller when one
//!   is given back, not polling), `fleet` (a replica among others on one store: following the
//!   rows other replicas moved, taking over a lapsed replica's work, letting go of its own work
//!   taken or ended elsewhere), `drift` (compares the controller's counts with the store at
//!   start-up, on a timer and on demand, and exports the difference as `admission_store_drift`),
//!   `expiry` (pending requests nobody decided end `expired` at `--pending-timeout`, on a timer
//!   set to the next due one) and [`retention`] (the sweep that keeps the store bounded: terminal
//!   operations retire after `--retention`, a replay of a retired key is a new submission,
//!   streams are reconciled, space returns to the filesystem).
//! - `core`: the state every part shares (`Core`, each live operation, the execution queue) and
//!   `run_to_end`, the one way a decided change is detached from its client.
//! - what the core is made of, each knowing nothing above it: [`store`] (one `DurableStore` trait
//!   in the store's own words, and its two houses, `store::sqlite` and `store::postgres`; what is
//!   stored is what counts after a restart), `registry` (the registered operations and what a
//!   submission's operation and arguments must be), `auth` (who a bearer secret names), [`waits`]
//!   (the open long-poll waits and their bells), [`event_streams`] (the open Operator V1 event
//!   streams, bounded per operator and in total), `keys` (a growable filter that answers "this
//!   key was never used" without the store, so refusals stay off it however many keys are
//!   stored), `recovery` (the store as the library's `RecoverySource`).
//! - beside them, knowing nothing of the broker: [`listener`] (the accept loop, for TCP and Unix
//!   sockets; header, body and idle timeouts and one connection cap shared by both listeners, for
//!   any router) and [`fairness`] (each client's share of the requests in flight, and the byte
//!   budget for buffered bodies: tower layers for any router).
//!
//! This file is the assembly: the module list, the settings ([`BrokerSettings`]), the errors
//! ([`BrokerError`]) and the [`Broker`] handle with its small accessors.
//!
//! Only this crate knows about HTTP, JSON bodies and SQL; the library does not.
//!
//! # What a client that hangs up can and cannot leave half done
//!
//! A handler future is dropped at whatever `.await` it is parked on when its client hangs up. So
//! each mutating route is split in two at the moment the broker *decides* to change something.
//! Before it, the handler only authenticates, validates and reads; dropped there, nothing was
//! changed. From it on, the whole change runs in a task of its own (`run_to_end` in `core`: a
//! `tokio::spawn`ed task the handler merely awaits; dropping a `JoinHandle` does not cancel the
//! task), so it ends the same way whether or not anyone waits for the answer. Each change also
//! holds the counts gate (`Core::hold_counts`) from its first touch of a count to its last, so a
//! drift reading never sees it half made. Per route:
//!
//! - **submit**: authenticate, read the body, validate, take the per-key lock, look for a replay:
//!   a hangup here changes nothing (the lock is released with the future). Then the gate is taken
//!   and `admit` runs; from the permit on, the row insert, the replay filter, the commit into a
//!   lifecycle handle (or the refund on a store failure), the live map and the executor hand-off
//!   run detached, still holding the per-key lock, so a retry with the same key waits for them and
//!   then replays. There is no `.await` between `admit` and the spawn, so no permit is ever
//!   dropped by a hangup.
//! - **cancel**: authenticate and look the operation up (a hangup here changes nothing); then
//!   gate, the operation's lock, the state check, the durable write and the handle transition
//!   (which releases slots on a terminal move) run detached.
//! - **an operator's approve / deny / revoke** (`Core::decide_to_end`): authenticate, read and
//!   judge the body (a hangup here changes nothing); then, detached: the gate, the operation's
//!   lock, and one write transaction of the store that looks up the idempotency record, the request,
//!   checks the revision, the transition and the constraints, and writes the state change with
//!   the decision's record; then the handle's move (approved work is queued). A decision that
//!   loses the race to another (two operators, or a cancel) sees the revision the winner wrote
//!   and is refused `revision_conflict`, writing nothing.
//! - **upload**: authenticate and read `Content-Length` in the handler; everything else runs
//!   detached, reading the body included: the room is reserved (under the gate, recorded as an
//!   upload in progress, which drift counts as stored), the body is written to its file, then
//!   under the gate either the reservation is settled, the row inserted and the stream recorded,
//!   or (the body ended early: the client hung up, or the store failed) the file is removed and
//!   the reservation released. The detached task sees a hangup as a body error and cleans up;
//!   nothing is left to a `Drop` in a future that may never run again.
//! - **delete**: authenticate and check the owner; then, detached under the gate, the row is
//!   deleted, the file removed and the stored room released.
//! - **the executor** is its own task: starting work (slot, durable `executing`) and recording the
//!   outcome are done under the gate and the operation's lock and are not cancelled by any client
//!   nor by a shutdown. It waits for a slot holding neither, so a drift reading or a cancel never
//!   waits for a slot with it.
//!
//! **Shutdown.** Detached work holds the broker's core until it ends, and [`Broker::shutdown`]
//! waits (bounded) for every holder, so a change in progress finishes before the data dir is
//! released. A task still running when the runtime itself stops is lost as in a crash: its store
//! write either committed (restored at start-up) or did not (nothing to restore), and a stream
//! body without a row is removed at start-up.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
mod auth;
mod core;
mod drift;
pub mod drill;
pub mod drill_replicas;
pub mod event_streams;
mod exec;
mod expiry;
pub mod fairness;
mod fleet;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod history;
#[doc(hidden)]
pub mod key_locks;
#[doc(hidden)]
pub mod keys;
pub mod listener;
mod operations;
mod recovery;
pub(crate) mod registry;
pub mod retention;
pub mod serve;
mod startup;
mod stops;
pub mod store;
mod sync;
pub mod waits;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::fairness::FairnessConfig;
use unyolo_admission::Config;
use unyolo_admission::admission::{Admission, ReplicaOptions};
use unyolo_admission::config::{ConfigError, Identity, Operators, Secrets};
use unyolo_admission::engine::{Controller, DEFAULT_CAPACITY_RETRY, StorageCaps};

pub use api::{discovery, listing, presentation, projection, ratelimit};
pub use drift::{Difference, DriftCount, DriftReport};
pub use event_streams::EventStreamLimits;
pub use listener::{ConnectionSettings, ListenAddr};
pub use retention::{Keep, RetentionSettings, SweepReport, WallClock};
pub use store::{
    DurableStore, OperationError, OperationRecord, SqliteStore, StoreError, StoredCounts,
};

use self::core::Core;

/// Everything a broker needs to start. Its `Debug` output shows no secret.
#[derive(Clone)]
pub struct BrokerSettings {
    /// Where agents connect (port 0 picks a free port; see [`Broker::local_addr`]).
    pub listen: SocketAddr,
    /// Where operators connect: Operator V1, `/metrics` and `/admission/v1/drift`
    /// ([`DEFAULT_OPERATOR_LISTEN`] by default; see [`Broker::operator_addr`]).
    pub operator_listen: ListenAddr,
    /// The data dir: the SQLite file (unless [`BrokerSettings::store`] names another store),
    /// stream bodies, and this replica's identity in a shared store.
    pub data_dir: PathBuf,
    /// Where operations live: `None` (the default) for a SQLite file in the data dir, or a
    /// PostgreSQL database ([`store::StoreLocation::Postgres`]). Its `Debug` hides a password.
    pub store: Option<store::StoreLocation>,
    /// The client identities and their bearer secrets; the controller is built for exactly these.
    pub secrets: Secrets,
    /// The named operators and their bearer secrets; the matched name decides (`decided_by`).
    pub operators: Operators,
    /// How long a request may wait for an operator's decision before it expires
    /// ([`DEFAULT_PENDING_TIMEOUT`] by default; not zero): its `pending_expires_at` is its
    /// creation plus this.
    pub pending_timeout: Duration,
    /// The admission limits (validated for the identities of `secrets`).
    pub config: Config,
    /// A shadow quota file's limits (`--shadow-config`), validated for the same identities:
    /// every submission is judged against them too, after the real decision, never changing
    /// it (see [`unyolo_admission::admission::Shadow`]). `None` by default.
    pub shadow: Option<Config>,
    /// The stream, sealed-payload and pending-grant store caps.
    pub storage_caps: StorageCaps,
    /// The Retry-After hint for capacity refusals.
    pub capacity_retry: Duration,
    /// How often the controller's counts are compared with the store (besides start-up and
    /// [`Broker::check_drift`]); [`DEFAULT_DRIFT_INTERVAL`] by default, zero for never.
    pub drift_interval: Duration,
    /// The broker's name, shown as every operation's `broker` (1–64 characters).
    pub broker_name: String,
    /// Header, body and idle timeouts and the connection cap.
    pub connections: ConnectionSettings,
    /// How long terminal operations are kept, and how often the store is swept.
    pub retention: RetentionSettings,
    /// Shared admission with other replicas through Redis (a URL and a replica name), or `None`
    /// for admission decided by this process alone.
    pub replicas: Option<ReplicaOptions>,
    /// Each client's share of requests in flight, and the capacity kept for exempt requests
    /// (health, readiness, metrics, cancellation, operator routes); see [`crate::fairness`].
    pub fairness: FairnessConfig,
    /// The most bytes of request bodies (and answers being rendered) held buffered at once,
    /// across every request of the agent listener ([`DEFAULT_BUFFERED_BYTES`] by default); past
    /// it a body waits a second for room, then is answered 503 `body_budget_exhausted` unread.
    /// Operator decision bodies have a room of their own beside it, one largest decision body
    /// (96 KiB) per unit of [`FairnessConfig::exempt_reserved_units`], so no client's load
    /// keeps a decision out.
    pub buffered_bytes: usize,
    /// How many Operator V1 event streams may be open at once, per operator and in total.
    pub event_streams: EventStreamLimits,
    /// The most creations and state changes the store commits in one transaction, one commit
    /// flush (group commit: those that reach the store together), on SQLite and PostgreSQL;
    /// [`store::DEFAULT_COMMIT_BATCH`] by default, 1 to commit each alone. Not zero.
    pub commit_batch: usize,
}

/// The default [`BrokerSettings::operator_listen`]: `127.0.0.1:8081`.
pub const DEFAULT_OPERATOR_LISTEN: &str = "127.0.0.1:8081";

/// The default [`BrokerSettings::pending_timeout`]: 5 minutes, as unYOLO's.
pub const DEFAULT_PENDING_TIMEOUT: Duration = Duration::from_secs(300);

/// The default [`BrokerSettings::buffered_bytes`]: 256 MiB.
pub const DEFAULT_BUFFERED_BYTES: usize = 256 << 20;

/// How often, by default, the broker compares its counts with the store.
pub const DEFAULT_DRIFT_INTERVAL: Duration = Duration::from_secs(30);

impl std::fmt::Debug for BrokerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerSettings")
            .field("listen", &self.listen)
            .field("operator_listen", &self.operator_listen)
            .field("data_dir", &self.data_dir)
            .field("store", &self.store)
            .field("secrets", &self.secrets)
            .field("operators", &self.operators)
            .field("pending_timeout", &self.pending_timeout)
            .field("config", &self.config)
            .field("storage_caps", &self.storage_caps)
            .field("capacity_retry", &self.capacity_retry)
            .field("drift_interval", &self.drift_interval)
            .field("broker_name", &self.broker_name)
            .field("connections", &self.connections)
            .field("retention", &self.retention)
            .field("replicas", &self.replicas)
            .field("fairness", &self.fairness)
            .field("buffered_bytes", &self.buffered_bytes)
            .field("pending_timeout", &self.pending_timeout)
            .field("event_streams", &self.event_streams)
            .field("commit_batch", &self.commit_batch)
            .finish()
    }
}

impl BrokerSettings {
    /// Settings with the default limits for the identities of `secrets`, the default caps and
    /// Retry-After hint; operators on `127.0.0.1` at a port the system picks (set
    /// [`BrokerSettings::operator_listen`] for another).
    pub fn new(
        listen: SocketAddr,
        data_dir: PathBuf,
        secrets: Secrets,
        operators: Operators,
    ) -> BrokerSettings {
        let config = Config::defaults(secrets.identities().cloned());
        BrokerSettings {
            listen,
            operator_listen: ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0))),
            data_dir,
            store: None,
            secrets,
            operators,
            pending_timeout: DEFAULT_PENDING_TIMEOUT,
            config,
            shadow: None,
            storage_caps: StorageCaps::default(),
            capacity_retry: DEFAULT_CAPACITY_RETRY,
            drift_interval: DEFAULT_DRIFT_INTERVAL,
            broker_name: store::DEFAULT_BROKER_NAME.to_owned(),
            connections: ConnectionSettings::default(),
            retention: RetentionSettings::default(),
            replicas: None,
            fairness: FairnessConfig::default(),
            buffered_bytes: DEFAULT_BUFFERED_BYTES,
            event_streams: EventStreamLimits::default(),
            commit_batch: store::DEFAULT_COMMIT_BATCH,
        }
    }

    /// Why these settings cannot start a broker, if they cannot: no operator, an operator secret
    /// equal to a client's (that client could decide its own requests), a zero pending timeout,
    /// connection settings that cannot serve, fairness numbers that cannot work, or a
    /// buffered-bytes budget smaller than the largest submission body.
    pub fn validate(&self) -> Result<(), BrokerError> {
        if let Some((_, client)) = self.operators.sharing_with(&self.secrets) {
            return Err(BrokerError::SharedSecret(client.clone()));
        }
        if self.operators.is_empty() {
            return Err(BrokerError::Settings(
                "no operator: give at least one `name = secret` line".to_owned(),
            ));
        }
        if let Some(problem) = self.connections.problem() {
            return Err(BrokerError::Settings(problem));
        }
        if let Some(problem) = self.fairness.problem() {
            return Err(BrokerError::Settings(format!("fairness: {problem}")));
        }
        if self.commit_batch == 0 {
            return Err(BrokerError::Settings(
                "the commit batch must be at least 1 (1 commits each write alone)".to_owned(),
            ));
        }
        if self.pending_timeout.is_zero() {
            return Err(BrokerError::Settings(
                "the pending timeout must be above zero (a request would expire as it is made)"
                    .to_owned(),
            ));
        }
        if let Some(problem) = self.event_streams.problem() {
            return Err(BrokerError::Settings(problem));
        }
        if self.buffered_bytes < api::MAX_BODY_BYTES {
            return Err(BrokerError::Settings(format!(
                "the buffered-bytes budget ({} bytes) must hold at least one largest submission \
                 body ({} bytes)",
                self.buffered_bytes,
                api::MAX_BODY_BYTES
            )));
        }
        Ok(())
    }
}

/// Checks a broker name: 1 to 64 characters, none of them a control character.
pub fn validate_broker_name(name: &str) -> Result<(), String> {
    let chars = name.chars().count();
    if !(1..=64).contains(&chars) || name.chars().any(char::is_control) {
        return Err(format!(
            "broker name {name:?} must be 1 to 64 characters, none of them a control character"
        ));
    }
    Ok(())
}

/// Why a broker could not start.
#[derive(Debug)]
pub enum BrokerError {
    /// A listen address could not be bound.
    Bind(ListenAddr, std::io::Error),
    /// The store could not be opened or recovered.
    Store(StoreError),
    /// Another file problem (data dir, secrets).
    Io(String),
    /// An operator's secret is also this client's secret.
    SharedSecret(Identity),
    /// A setting out of its bounds (the broker name) or that cannot serve (a zero timeout).
    Settings(String),
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BrokerError::Bind(addr, err) => write!(f, "cannot listen on {addr}: {err}"),
            BrokerError::Store(err) => write!(f, "{err}"),
            BrokerError::Io(detail) => f.write_str(detail),
            BrokerError::SharedSecret(client) => write!(
                f,
                "an operator secret is also the secret of client `{client}`; that client could decide its own requests, so give the operator a secret of its own"
            ),
            BrokerError::Settings(detail) => f.write_str(detail),
        }
    }
}

impl std::error::Error for BrokerError {}

impl From<StoreError> for BrokerError {
    fn from(err: StoreError) -> BrokerError {
        BrokerError::Store(err)
    }
}

/// A running broker. Dropping it without [`Broker::shutdown`] leaves the server running until the
/// runtime stops.
pub struct Broker {
    addr: SocketAddr,
    operator_addr: ListenAddr,
    core: Arc<Core>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    operator_server: JoinHandle<()>,
    executor: JoinHandle<()>,
    drift: JoinHandle<()>,
    sweeper: JoinHandle<()>,
    /// The pending-expiry sweeper.
    expiry: JoinHandle<()>,
    /// Renews this replica's membership of the store while it runs, and gives it up at shutdown.
    membership: JoinHandle<()>,
    /// The retention sweep's state, shared with the sweeping task.
    retention: Arc<retention::Retention>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("addr", &self.addr)
            .field("operator_addr", &self.operator_addr)
            .finish()
    }
}

/// What start-up restored from the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreSummary {
    /// Operations restored pending.
    pub pending: usize,
    /// Operations restored approved (queued for execution).
    pub approved: usize,
    /// Operations that were executing at the crash, now failed (`execution_interrupted`).
    pub interrupted: usize,
    /// Streams restored.
    pub streams: usize,
}

impl Broker {
    /// The address the broker listens on for agents.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the broker listens for operators (the port bound, when 0 was asked for).
    pub fn operator_addr(&self) -> &ListenAddr {
        &self.operator_addr
    }

    /// The embedded controller: what this process holds (for snapshots in tests and the drill).
    pub fn controller(&self) -> &Controller {
        self.core.controller()
    }

    /// The admission every submission goes through.
    pub fn admission(&self) -> &Admission {
        &self.core.admission
    }

    /// The fairness layer in front of the routes (its snapshot: units and requests in flight per
    /// client).
    pub fn fairness(&self) -> &crate::fairness::Fairness {
        &self.core.fairness
    }

    /// The store.
    pub fn database(&self) -> &dyn DurableStore {
        &*self.core.db
    }

    /// Compares the controller's counts with the store now (per client and global: pending,
    /// queued, executing, active; per store: files and bytes), sets `admission_store_drift` to the
    /// total difference and logs each one. Waits for the changes in progress to finish, so the
    /// reading never catches one half made. The same reading `GET /admission/v1/drift` answers on the operator listener.
    pub async fn check_drift(&self) -> Result<DriftReport, StoreError> {
        drift::check(&self.core).await
    }

    /// Runs a retention sweep now (see [`retention`]): retires terminal operations older than the
    /// retention by the settings' clock, returns free space, reconciles streams and refreshes the
    /// store metrics. Waits for a sweep already running to finish first.
    pub async fn sweep_now(&self) -> Result<SweepReport, StoreError> {
        retention::sweep(&self.core, &self.retention).await
    }

    /// The cursor of the newest Operator V1 event (`None` before the first): a consumer that
    /// streams from it sees every event after this moment.
    pub fn newest_event_cursor(&self) -> Option<String> {
        self.core.newest_event_cursor()
    }

    /// Whether the replay filter lets a submission of `client` with `key` through to the store
    /// lookup (for the benchmarks: the share of new keys that reach SQLite).
    #[doc(hidden)]
    pub fn replay_filter_passes(&self, client: &str, key: &str) -> bool {
        self.core.keys.may_contain(client, key)
    }

    /// Re-reads the quota file at `path` (the identities stay those of the secrets file); an
    /// invalid file leaves the old configuration in force and is counted.
    pub fn reload_from_path(&self, path: &Path) -> Result<(), ConfigError> {
        reload(&self.core, path)
    }

    /// Re-reads the shadow quota file at `path` (see [`BrokerSettings::shadow`]); an invalid
    /// file leaves the old shadow in force and is counted. Nothing without a shadow.
    pub fn reload_shadow_from_path(&self, path: &Path) -> Result<(), ConfigError> {
        reload_shadow(&self.core, path)
    }

    /// The shadow judging every submission against a candidate file, if one is set.
    pub fn shadow(&self) -> Option<&unyolo_admission::admission::Shadow> {
        self.core.shadow.as_ref()
    }
}

fn reload_shadow(core: &Core, path: &Path) -> Result<(), ConfigError> {
    let Some(shadow) = &core.shadow else {
        return Ok(());
    };
    match shadow.reload_from_path(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "shadow admission config reloaded");
            Ok(())
        }
        Err(err) => {
            tracing::warn!(error = %err, "shadow admission config rejected; the old shadow stays");
            Err(err)
        }
    }
}

fn reload(core: &Core, path: &Path) -> Result<(), ConfigError> {
    match core.admission.reload_from_path(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), "admission config reloaded");
            // A raised global_executing may let queued work start.
            core.executor.wake();
            Ok(())
        }
        Err(err) => {
            tracing::warn!(error = %err, "admission config rejected; the old one stays");
            Err(err)
        }
    }
}
