//! The reference broker: the admission controller embedded in an Agent V1-compatible HTTP service
//! with a durable SQLite store. It exists to prove the library under overload, crashes and bad
//! input, and to show broker authors where each call goes.
//!
//! - [`store`]: the SQLite file; what is on disk is what counts after a restart.
//! - [`http`]: the routes; the order authenticate → validate → replay → admit → create → commit.
//! - `operations`: live operations, each with a lifecycle handle; a transition is written to
//!   the store first and then applied to the handle, under the operation's lock.
//! - `exec`: the demo executor; approved work starts when the controller grants an execution
//!   slot.
//! - `keys`: a fixed-size filter that answers "this key was never used" without the store, so
//!   refusals stay off SQLite.
//! - [`ratelimit`]: the quota fields (`RateLimit-Policy`, `RateLimit`) on submission answers.
//! - [`serve`] and [`drill`]: the `admission serve` and `admission drill` commands.
//!
//! Only this module knows about HTTP, JSON bodies and SQL; the engine does not.

pub mod drill;
mod exec;
pub mod http;
mod keys;
mod operations;
pub mod ratelimit;
pub mod serve;
pub mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{ConfigError, Identity, Secrets};
use crate::engine::{Controller, DEFAULT_CAPACITY_RETRY, StorageCaps, StoredObject};
use crate::{Config, OperationState};

pub use store::{Database, OperationError, OperationRecord, StoreError};

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
}

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
        }
    }
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
}

impl std::fmt::Display for BrokerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BrokerError::Bind(addr, err) => write!(f, "cannot listen on {addr}: {err}"),
            BrokerError::Store(err) => write!(f, "{err}"),
            BrokerError::Io(detail) => f.write_str(detail),
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
    pub(crate) controller: Controller,
    pub(crate) db: Database,
    /// Non-terminal operations by id.
    pub(crate) live: Mutex<HashMap<String, Arc<LiveOp>>>,
    /// Stored streams by id.
    pub(crate) streams: Mutex<HashMap<String, StoredObject>>,
    pub(crate) executor: exec::Executor,
    pub(crate) auth: http::Auth,
    pub(crate) registry: Registry,
    pub(crate) submissions: Family<SubmissionLabels, Counter>,
    /// `broker_store_ready`: 1 when the store took a write at the last scrape, else 0.
    pub(crate) store_ready: Gauge,
    /// The (client, key) pairs that may have an operation, so a new key skips the store lookup.
    pub(crate) keys: keys::KeyFilter,
    /// Serializes submissions with the same (client, idempotency key), so concurrent duplicates
    /// create one operation. Striped: bounded memory whatever the traffic.
    pub(crate) key_locks: Box<[tokio::sync::Mutex<()>]>,
    pub(crate) shutdown: watch::Receiver<bool>,
}

impl Core {
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
}

/// A running broker. Dropping it without [`Broker::shutdown`] leaves the server running until the
/// runtime stops.
pub struct Broker {
    addr: SocketAddr,
    core: Arc<Core>,
    stop: watch::Sender<bool>,
    server: JoinHandle<()>,
    executor: JoinHandle<()>,
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
    pub async fn start(settings: BrokerSettings) -> Result<(Broker, RestoreSummary), BrokerError> {
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
        let data_dir = settings.data_dir.clone();
        let (db, recovered, keys) = tokio::task::spawn_blocking(move || {
            let db = Database::open(&data_dir)?;
            let recovered = db.recover()?;
            let keys = keys::KeyFilter::new();
            db.for_each_key(|client, key| keys.insert(client, key))?;
            Ok::<_, StoreError>((db, recovered, keys))
        })
        .await
        .map_err(|e| BrokerError::Io(format!("start-up task failed: {e}")))??;

        let mut registry = Registry::default();
        crate::metrics::register(&mut registry, &controller);
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
        let (stop, shutdown) = watch::channel(false);
        let core = Arc::new(Core {
            controller,
            db,
            live: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            executor: exec::Executor::default(),
            auth: http::Auth::new(&settings.secrets, &settings.operator_secret),
            registry,
            submissions,
            store_ready,
            keys,
            key_locks: (0..64).map(|_| tokio::sync::Mutex::new(())).collect(),
            shutdown: shutdown.clone(),
        });
        let summary = restore(&core, recovered);

        let executor = tokio::spawn(exec::run(Arc::clone(&core)));
        let app = http::router(Arc::clone(&core));
        let mut until = shutdown.clone();
        let server = tokio::spawn(async move {
            let stopped = async move {
                let _ = until.wait_for(|stop| *stop).await;
            };
            if let Err(err) = axum::serve(listener, app)
                .with_graceful_shutdown(stopped)
                .await
            {
                tracing::error!(error = %err, "server stopped");
            }
        });
        tracing::info!(
            %addr,
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
            },
            summary,
        ))
    }

    /// The address the broker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The embedded controller (for snapshots in tests and the drill).
    pub fn controller(&self) -> &Controller {
        &self.core.controller
    }

    /// The store.
    pub fn database(&self) -> &Database {
        &self.core.db
    }

    /// Re-reads the quota file at `path` (the identities stay those of the secrets file); an
    /// invalid file leaves the old configuration in force and is counted.
    pub fn reload_from_path(&self, path: &Path) -> Result<(), ConfigError> {
        reload(&self.core, path)
    }

    /// Stops serving and executing. Work in progress is abandoned exactly as in a crash: nothing
    /// more is written, so a broker started on the same data dir recovers it. Returns once every
    /// task of this broker has let go of it, so the data dir's lock is released (unless the caller
    /// still holds a clone of [`Broker::database`]) and another broker may start on the dir.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.server.await;
        let _ = self.executor.await;
        // Connection and execution tasks see the stop and return; each holds the core until it
        // ends. Bounded, so a stuck store call cannot hang shutdown forever.
        let deadline = std::time::Instant::now() + SHUTDOWN_GRACE;
        while Arc::strong_count(&self.core) > 1 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if Arc::strong_count(&self.core) > 1 {
            tracing::warn!("shutdown: some broker tasks are still running");
        }
    }
}

fn reload(core: &Core, path: &Path) -> Result<(), ConfigError> {
    match core.controller.reload_from_path(path) {
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
fn restore(core: &Arc<Core>, recovered: store::Recovered) -> RestoreSummary {
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
    for record in recovered.live {
        let Ok(identity) = Identity::new(&record.client_id) else {
            tracing::error!(operation = %record.id, "stored operation has an invalid client id; not restored");
            continue;
        };
        let handle = match core.controller.restore(&identity, record.state) {
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
    let mut known = std::collections::HashSet::new();
    for stream in recovered.streams {
        let Ok(identity) = Identity::new(&stream.client_id) else {
            continue;
        };
        let object =
            core.controller
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

/// A fresh random id: `prefix`, `_`, 32 hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    let mut id = String::with_capacity(prefix.len() + 33);
    id.push_str(prefix);
    id.push('_');
    for b in bytes {
        id.push_str(&format!("{b:02x}"));
    }
    id
}
