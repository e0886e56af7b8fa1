//! The reference broker: the admission controller embedded in an Agent V1-compatible HTTP service
//! with a durable SQLite store. It exists to prove the library under overload, crashes and bad
//! input, and to show broker authors where each call goes.
//!
//! - [`store`]: the SQLite file; what is on disk is what counts after a restart.
//! - [`api`]: the router and what every route shares: the error envelope (`ApiError`), bearer
//!   authentication, body reading, the `{id}` lookups and the detached runners. The handlers sit
//!   beside the types they speak, one file per part of the Agent V1 wire contract:
//!   - `agent_operations`: submit, get and cancel; the order authenticate → validate → replay →
//!     admit → create → commit.
//!   - `streams`: stream upload and delete.
//!   - `operator`: the pending requests, approve, deny and the on-demand drift reading.
//!   - `health`: `/healthz`, `/readyz` and `/metrics`.
//! - `operations`: live operations, each with a lifecycle handle; a transition is written to
//!   the store first and then applied to the handle, under the operation's lock.
//! - `exec`: the demo executor; approved work waits for an execution slot (woken by the
//!   controller when one is given back, not polling) and starts under the counts gate.
//! - `keys`: a growable filter that answers "this key was never used" without the store, so
//!   refusals stay off SQLite however many keys are stored.
//! - [`retention`]: the sweep that keeps the store bounded: terminal operations retire after
//!   `--retention` (a replay of a retired key is a new submission), streams are reconciled, space
//!   returns to the filesystem.
//! - `drift`: compares the controller's counts with the store (at start-up, on a timer, on
//!   demand) and exports the difference as `admission_store_drift`.
//! - [`discovery`], [`listing`] and [`waits`]: the Agent V1 reads: the descriptor, pages of
//!   summaries, and long-poll waits on an operation's revision; [`presentation`]: what an
//!   operator reads about each operation.
//! - [`listener`]: the accept loop; header, body and idle timeouts and the connection cap.
//! - [`ratelimit`]: the quota fields (`RateLimit-Policy`, `RateLimit`) on submission answers.
//! - [`serve`] and [`drill`]: the `admission serve` and `admission drill` commands.
//!
//! Only this module knows about HTTP, JSON bodies and SQL; the engine does not.
//!
//! # What a client that hangs up can and cannot leave half done
//!
//! A handler future is dropped at whatever `.await` it is parked on when its client hangs up. So
//! each mutating route is split in two at the moment the broker *decides* to change something.
//! Before it, the handler only authenticates, validates and reads; dropped there, nothing was
//! changed. From it on, the whole change runs in a task of its own (`run_to_end`: a
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
//! - **approve / deny / cancel**: authenticate and look the operation up (a hangup here changes
//!   nothing); then gate, the operation's lock, the state check, the durable write and the handle
//!   transition (which releases slots on a terminal move; approved work is queued) run detached.
//!   A decision that loses the race to another (approve vs cancel) is refused inside the task, by
//!   the same state check.
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
//!
//! This file is past the usual size because it is the broker's assembly: settings, the shared
//! core, start-up (restore, rate replay, drift, retention, replicas) and shutdown, each of which
//! wires the rooms above together; the rooms themselves live in their own files.

pub mod api;
mod auth;
mod drift;
pub mod drill;
pub mod drill_replicas;
mod exec;
#[doc(hidden)]
pub mod keys;
pub mod listener;
mod operations;
pub mod retention;
pub mod serve;
pub mod store;
pub mod waits;

pub use api::{discovery, listing, presentation, ratelimit};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::{Admission, ReplicaOptions, RestoredOperation};
use crate::config::{ConfigError, Identity, Secrets};
use crate::engine::{Controller, DEFAULT_CAPACITY_RETRY, StorageCaps, StoredObject};
use crate::{Config, OperationState};

pub use drift::{Difference, DriftCount, DriftReport};
pub use listener::ConnectionSettings;
pub use retention::{Keep, RetentionSettings, SweepReport, WallClock};
pub use store::{Database, OperationError, OperationRecord, StoreError, StoredCounts};

use operations::LiveOp;

/// Everything a broker needs to start. Its `Debug` output shows no secret.
#[derive(Clone)]
pub struct BrokerSettings {
    /// Where to listen (port 0 picks a free port; see [`Broker::local_addr`]).
    pub listen: SocketAddr,
    /// The data dir: the SQLite file and stream bodies.
    pub data_dir: PathBuf,
    /// The client identities and their bearer secrets; the controller is built for exactly these.
    pub secrets: Secrets,
    /// The operator's bearer secret.
    pub operator_secret: String,
    /// The admission limits (validated for the identities of `secrets`).
    pub config: Config,
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
}

/// How often, by default, the broker compares its counts with the store.
pub const DEFAULT_DRIFT_INTERVAL: Duration = Duration::from_secs(30);

impl std::fmt::Debug for BrokerSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerSettings")
            .field("listen", &self.listen)
            .field("data_dir", &self.data_dir)
            .field("secrets", &self.secrets)
            .field("operator_secret", &"<redacted>")
            .field("config", &self.config)
            .field("storage_caps", &self.storage_caps)
            .field("capacity_retry", &self.capacity_retry)
            .field("drift_interval", &self.drift_interval)
            .field("broker_name", &self.broker_name)
            .field("connections", &self.connections)
            .field("retention", &self.retention)
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl BrokerSettings {
    /// Settings with the default limits for the identities of `secrets`, the default caps and
    /// Retry-After hint.
    pub fn new(
        listen: SocketAddr,
        data_dir: PathBuf,
        secrets: Secrets,
        operator_secret: String,
    ) -> BrokerSettings {
        let config = Config::defaults(secrets.identities().cloned());
        BrokerSettings {
            listen,
            data_dir,
            secrets,
            operator_secret,
            config,
            storage_caps: StorageCaps::default(),
            capacity_retry: DEFAULT_CAPACITY_RETRY,
            drift_interval: DEFAULT_DRIFT_INTERVAL,
            broker_name: store::DEFAULT_BROKER_NAME.to_owned(),
            connections: ConnectionSettings::default(),
            retention: RetentionSettings::default(),
            replicas: None,
        }
    }

    /// Why these settings cannot start a broker, if they cannot: the operator secret equal to a
    /// client's (that client could decide its own requests), or connection settings that cannot
    /// serve.
    pub fn validate(&self) -> Result<(), BrokerError> {
        if let Some(client) = client_sharing_secret(&self.secrets, &self.operator_secret) {
            return Err(BrokerError::SharedSecret(client.clone()));
        }
        if let Some(problem) = self.connections.problem() {
            return Err(BrokerError::Settings(problem));
        }
        Ok(())
    }
}

/// The client whose secret equals `operator_secret`, if any. Every secret is compared, in constant
/// time, so the time taken says nothing about which one matched.
pub fn client_sharing_secret<'a>(
    secrets: &'a Secrets,
    operator_secret: &str,
) -> Option<&'a Identity> {
    secrets.identify(operator_secret.as_bytes())
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
    /// The listen address could not be bound.
    Bind(SocketAddr, std::io::Error),
    /// The store could not be opened or recovered.
    Store(StoreError),
    /// Another file problem (data dir, secrets).
    Io(String),
    /// The operator secret is also this client's secret.
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
                "the operator secret is also the secret of client `{client}`; that client could decide its own requests, so give the operator a secret of its own"
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

/// How long [`Broker::shutdown`] waits for the broker's tasks to end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The `broker_submissions_total{result}` label set.
type SubmissionLabels = [(&'static str, &'static str); 1];

/// State shared by every handler and the executor.
pub(crate) struct Core {
    /// Admission, in-process or shared with other replicas: every submission, transition and
    /// start goes through it.
    pub(crate) admission: Admission,
    pub(crate) db: Database,
    /// Non-terminal operations by id.
    pub(crate) live: Mutex<HashMap<String, Arc<LiveOp>>>,
    /// Stored streams by id.
    pub(crate) streams: Mutex<HashMap<String, StoredObject>>,
    pub(crate) executor: exec::Executor,
    pub(crate) auth: auth::Auth,
    pub(crate) registry: Registry,
    pub(crate) submissions: Family<SubmissionLabels, Counter>,
    /// `broker_store_ready`: 1 when the store took a write at the last scrape, else 0.
    pub(crate) store_ready: Gauge,
    /// The (client, key) pairs that may have an operation, so a new key skips the store lookup.
    pub(crate) keys: keys::KeyFilter,
    /// Serializes submissions with the same (client, idempotency key), so concurrent duplicates
    /// create one operation. Striped: bounded memory whatever the traffic.
    pub(crate) key_locks: Box<[Arc<tokio::sync::Mutex<()>>]>,
    /// Held shared by every change of the counts or the store while it is in progress, and
    /// exclusively by a drift reading (see the `drift` module).
    pub(crate) counts_gate: Arc<tokio::sync::RwLock<()>>,
    /// Uploads whose room is reserved while their body arrives: stream id → (client, bytes).
    pub(crate) uploading: Mutex<HashMap<String, (String, u64)>>,
    /// `admission_store_drift`: the total difference found by the last drift reading.
    pub(crate) drift: Gauge,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Open long-poll waits and the bells that wake them.
    pub(crate) waits: waits::Waits,
    /// The retention sweep's settings and metrics.
    pub(crate) retention: retention::Retention,
}

impl Core {
    /// This process's engine (what this replica holds; storage quotas, rate headers, drift).
    pub(crate) fn controller(&self) -> &Controller {
        self.admission.controller()
    }

    /// Counts a submission outcome: `created`, `replayed` or `rejected`.
    pub(crate) fn count_submission(&self, result: &'static str) {
        self.submissions.get_or_create(&[("result", result)]).inc();
    }

    fn live_ops(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<LiveOp>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stored_streams(&self) -> std::sync::MutexGuard<'_, HashMap<String, StoredObject>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn uploads(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, u64)>> {
        self.uploading.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The uploads in progress: (client, bytes reserved) each.
    pub(crate) fn uploads_in_progress(&self) -> Vec<(String, u64)> {
        self.uploads().values().cloned().collect()
    }

    /// A shared hold on the counts gate: while it lives, no drift reading is taken. Take it before
    /// the first count a change touches and keep it until the store and the counts agree again.
    /// Never take it twice in one task (a reading waiting in between would deadlock it).
    pub(crate) async fn hold_counts(&self) -> tokio::sync::OwnedRwLockReadGuard<()> {
        Arc::clone(&self.counts_gate).read_owned().await
    }

    /// The lock serializing submissions of `client` with idempotency `key`.
    pub(crate) fn key_lock(&self, client: &str, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (client, key).hash(&mut hasher);
        let stripe = (hasher.finish() % self.key_locks.len() as u64) as usize;
        Arc::clone(&self.key_locks[stripe])
    }
}

/// Starts `work` on a task of its own at once (not at the first poll) and returns a future of its
/// outcome. The caller only waits: if the caller is dropped (its client hung up), the work goes on
/// to its end regardless. `Err` only if the work panicked or the runtime is shutting down.
pub(crate) fn run_to_end<T: Send + 'static>(
    work: impl Future<Output = T> + Send + 'static,
) -> impl Future<Output = Result<T, tokio::task::JoinError>> {
    tokio::spawn(work)
}

/// A running broker. Dropping it without [`Broker::shutdown`] leaves the server running until the
/// runtime stops.
pub struct Broker {
    addr: SocketAddr,
    core: Arc<Core>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    executor: JoinHandle<()>,
    drift: JoinHandle<()>,
    sweeper: JoinHandle<()>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").field("addr", &self.addr).finish()
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
    /// Opens the store in the data dir, restores every non-terminal operation and stream into a
    /// new controller, starts the executor and serves. Must run inside a tokio runtime.
    ///
    /// With [`BrokerSettings::replicas`], the broker is one replica of several sharing admission
    /// through Redis: it registers what the store restores under the replica's name (replacing
    /// what an earlier run under that name held, in one step) and takes its lease. A Redis that
    /// does not answer at start-up does not stop it: the replica serves reads, cancels,
    /// decisions, health and metrics, answers new submissions 503 `admission_unavailable` with
    /// Retry-After, and registers (then admits) as soon as Redis answers. Only invalid options
    /// or URL fail.
    pub async fn start(settings: BrokerSettings) -> Result<(Broker, RestoreSummary), BrokerError> {
        validate_broker_name(&settings.broker_name).map_err(BrokerError::Settings)?;
        settings.validate()?;
        let connection_cap = settings.connections.connection_cap();
        if let Some(limit) = listener::file_limit() {
            let derived = listener::connection_cap_for_file_limit(Some(limit));
            if connection_cap > derived {
                tracing::warn!(
                    connection_cap,
                    file_limit = limit,
                    "the connection limit is above what the file limit leaves for connections"
                );
            }
        }
        let rate_window = largest_window(&settings.config);
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .map_err(|e| BrokerError::Bind(settings.listen, e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BrokerError::Bind(settings.listen, e))?;
        let controller = Controller::builder(settings.config)
            .storage_caps(settings.storage_caps)
            .capacity_retry(settings.capacity_retry)
            .build();
        let admission = Admission::new(controller, settings.replicas.clone())
            .map_err(|e| BrokerError::Settings(e.to_string()))?;
        let data_dir = settings.data_dir.clone();
        let broker_name = settings.broker_name.clone();
        let (db, recovered, keys, created) = tokio::task::spawn_blocking(move || {
            let db = Database::open_as(&data_dir, &broker_name)?;
            let recovered = db.recover()?;
            let keys = keys::KeyFilter::with_capacity(db.key_count()? as usize);
            db.for_each_key(|client, key| keys.insert(client, key))?;
            let since = SystemTime::now()
                .checked_sub(rate_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let created = db.created_since(since)?;
            Ok::<_, StoreError>((db, recovered, keys, created))
        })
        .await
        .map_err(|e| BrokerError::Io(format!("start-up task failed: {e}")))??;

        let mut registry = Registry::default();
        admission.register_metrics(&mut registry);
        let drift = Gauge::default();
        registry.register(
            "admission_store_drift",
            "Total absolute difference between the controller's counts and the store at the last \
             check (0 when they agree).",
            drift.clone(),
        );
        let submissions = Family::<SubmissionLabels, Counter>::default();
        for result in ["created", "replayed", "rejected"] {
            let _ = submissions.get_or_create(&[("result", result)]);
        }
        registry.register(
            "broker_submissions",
            "Operation submissions by result: created, replayed, or rejected by admission.",
            submissions.clone(),
        );
        let store_ready = Gauge::default();
        registry.register(
            "broker_store_ready",
            "Whether the store took a write (as /readyz checks it) when these metrics were scraped: 1 or 0.",
            store_ready.clone(),
        );
        let retention = retention::Retention::new(settings.retention.clone(), &mut registry);
        match settings.retention.keep {
            Keep::Forever => tracing::warn!(
                "retention is forever: terminal operations are never deleted and the store grows \
                 without bound"
            ),
            Keep::For(keep) => tracing::info!(
                retention = %humantime::format_duration(keep),
                "terminal operations retire after the retention; a replay after it is new work"
            ),
        }
        let (stop, shutdown) = watch::channel(false);
        let core = Arc::new(Core {
            admission,
            db,
            live: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            executor: exec::Executor::default(),
            auth: auth::Auth::new(&settings.secrets, &settings.operator_secret),
            registry,
            submissions,
            store_ready,
            keys,
            key_locks: (0..64)
                .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                .collect(),
            counts_gate: Arc::new(tokio::sync::RwLock::new(())),
            uploading: Mutex::new(HashMap::new()),
            drift,
            shutdown: shutdown.clone(),
            waits: waits::Waits::default(),
            retention,
        });
        let summary = restore(&core, recovered).await;
        match drift::check(&core).await {
            Ok(report) if report.is_clean() => {}
            Ok(report) => {
                tracing::warn!(
                    drift = report.total(),
                    "restored counts differ from the store"
                )
            }
            Err(err) => tracing::warn!(error = %err, "start-up drift check failed"),
        }
        restore_rates(core.controller(), created, SystemTime::now());

        let executor = tokio::spawn(exec::run(Arc::clone(&core)));
        let drift = tokio::spawn(drift::watch(Arc::clone(&core), settings.drift_interval));
        let sweeper = tokio::spawn(retention::watch(
            Arc::clone(&core),
            settings.retention.sweep_interval,
        ));
        let app = api::router(Arc::clone(&core));
        let server = tokio::spawn(listener::serve(
            listener,
            app,
            settings.connections,
            connection_cap,
            shutdown.clone(),
        ));
        tracing::info!(
            %addr,
            connection_cap,
            pending = summary.pending,
            approved = summary.approved,
            interrupted = summary.interrupted,
            streams = summary.streams,
            "broker started"
        );
        Ok((
            Broker {
                addr,
                core,
                stop,
                server,
                executor,
                drift,
                sweeper,
            },
            summary,
        ))
    }

    /// [`Broker::start`] as one replica of several: `settings` with
    /// [`BrokerSettings::replicas`] set to `options`.
    pub async fn start_shared(
        mut settings: BrokerSettings,
        options: ReplicaOptions,
    ) -> Result<(Broker, RestoreSummary), BrokerError> {
        settings.replicas = Some(options);
        Box::pin(Broker::start(settings)).await
    }

    /// The address the broker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The embedded controller: what this process holds (for snapshots in tests and the drill).
    pub fn controller(&self) -> &Controller {
        self.core.controller()
    }

    /// The admission every submission goes through.
    pub fn admission(&self) -> &Admission {
        &self.core.admission
    }

    /// The store.
    pub fn database(&self) -> &Database {
        &self.core.db
    }

    /// Compares the controller's counts with the store now (per client and global: pending,
    /// queued, executing, active; per store: files and bytes), sets `admission_store_drift` to the
    /// total difference and logs each one. Waits for the changes in progress to finish, so the
    /// reading never catches one half made. The same reading `GET /api/operator/v1/drift` answers.
    pub async fn check_drift(&self) -> Result<DriftReport, StoreError> {
        drift::check(&self.core).await
    }

    /// Runs a retention sweep now (see [`retention`]): retires terminal operations older than the
    /// retention by the settings' clock, returns free space, reconciles streams and refreshes the
    /// store metrics. Waits for a sweep already running to finish first.
    pub async fn sweep_now(&self) -> Result<SweepReport, StoreError> {
        retention::sweep(&self.core).await
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

    /// Stops serving and executing. A change already decided (a creation, decision, cancel,
    /// upload or delete in progress) runs to its end first; executing work is abandoned exactly
    /// as in a crash (it stays `executing` on disk), so a broker started on the same data dir
    /// recovers it. Returns once every
    /// task of this broker has let go of it, so the data dir's lock is released (unless the caller
    /// still holds a clone of [`Broker::database`]) and another broker may start on the dir.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.server.await;
        let _ = self.executor.await;
        let _ = self.drift.await;
        let _ = self.sweeper.await;
        // Connection and execution tasks see the stop and return; changes in progress (see
        // `run_to_end`) run to their end. Each holds the core until it ends. Bounded, so a stuck store call cannot hang shutdown forever.
        let deadline = std::time::Instant::now() + SHUTDOWN_GRACE;
        while Arc::strong_count(&self.core) > 1 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if Arc::strong_count(&self.core) > 1 {
            tracing::warn!("shutdown: some broker tasks are still running");
        }
        // Live work stays counted until the lease lapses (or a restart re-registers it).
        self.core.admission.shutdown().await;
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

/// Puts what the store holds back under the controller: live operations (approved ones queued
/// for execution) and stored streams.
async fn restore(core: &Arc<Core>, recovered: store::Recovered) -> RestoreSummary {
    let mut summary = RestoreSummary {
        interrupted: recovered.interrupted.len(),
        ..RestoreSummary::default()
    };
    for record in &recovered.interrupted {
        tracing::warn!(
            operation = %record.id,
            client = %record.client_id,
            from = "executing",
            to = "failed",
            error = "execution_interrupted",
            "operation state changed"
        );
    }
    let mut records = Vec::new();
    let mut restoring = Vec::new();
    for record in recovered.live {
        let Ok(identity) = Identity::new(&record.client_id) else {
            tracing::error!(operation = %record.id, "stored operation has an invalid client id; not restored");
            continue;
        };
        restoring.push(RestoredOperation {
            id: record.id.clone(),
            identity,
            state: record.state,
        });
        records.push(record);
    }
    let restored = core.admission.restore(restoring).await;
    for (record, handle) in records.into_iter().zip(restored.operations) {
        let handle = match handle {
            Ok(handle) => handle,
            Err(err) => {
                tracing::error!(operation = %record.id, error = %err, "not restored");
                continue;
            }
        };
        let op = Arc::new(LiveOp::new(&record, handle));
        core.live_ops().insert(record.id.clone(), Arc::clone(&op));
        match record.state {
            OperationState::Approved => {
                summary.approved += 1;
                core.executor.enqueue(op);
            }
            _ => summary.pending += 1,
        }
    }
    if let Some(replica) = core.admission.replica() {
        match restored.deferred {
            None => tracing::info!(
                replica,
                restored = summary.pending + summary.approved,
                "registered with redis"
            ),
            Some(err) => tracing::warn!(
                replica,
                restored = summary.pending + summary.approved,
                error = %err,
                "redis does not answer: new submissions are answered 503 admission_unavailable \
                 until it does, then this replica registers"
            ),
        }
    }
    let mut known = std::collections::HashSet::new();
    for stream in recovered.streams {
        let Ok(identity) = Identity::new(&stream.client_id) else {
            continue;
        };
        let object =
            core.controller()
                .restore_storage(&identity, crate::engine::Store::Stream, stream.size);
        known.insert(stream.id.clone());
        core.stored_streams().insert(stream.id, object);
        summary.streams += 1;
    }
    // Bodies written but never recorded (a crash between the two) hold nothing; remove them.
    if let Ok(entries) = std::fs::read_dir(core.db.streams_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !known.contains(&name) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    summary
}

/// The longest rate window of any configured client: how far back start-up reads admissions.
fn largest_window(config: &Config) -> Duration {
    let seconds = config
        .identities()
        .filter_map(|identity| config.effective(identity.as_str()))
        .map(|limits| limits.window_seconds)
        .max()
        .unwrap_or(0);
    Duration::from_secs(u64::from(seconds))
}

/// Rebuilds each client's rate bucket from the creation times of its operations created within
/// the largest window (`created`, read at start-up), as of `now`, so a restart never hands out a
/// fresh burst. It costs no write per admission: the operation's row is the record. What a restart
/// cannot know: tokens spent by admissions whose operation was never created (the store failed
/// after admission, or the process died in between); those come back early.
fn restore_rates(controller: &Controller, created: Vec<(String, SystemTime)>, now: SystemTime) {
    let admissions = created.len();
    let mut ages: HashMap<String, Vec<Duration>> = HashMap::new();
    for (client, at) in created {
        // A creation time after now (the wall clock stepped back) counts as just now.
        let age = now.duration_since(at).unwrap_or(Duration::ZERO);
        ages.entry(client).or_default().push(age);
    }
    let clients = ages.len();
    for (client, ages) in ages {
        if let Ok(identity) = Identity::new(&client) {
            controller.restore_rate(&identity, ages);
        }
    }
    tracing::info!(
        admissions,
        clients,
        "rate buckets rebuilt from recent operations"
    );
}

/// A fresh random id: `prefix`, `_`, 32 hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    crate::admission::random_id(prefix)
}
