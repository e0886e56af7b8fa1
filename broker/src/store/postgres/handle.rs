//! The store's handle: the pool of connections, the database as it may be shown, the event
//! bell and the change feed the listener (`listen`) keeps current, and the background tasks,
//! stopped when the last handle goes. Each concern's statements are `impl PostgresStore` blocks
//! in their own files; this one knows none of them.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;

use super::super::bell::EventBell;
use super::super::durable::DEFAULT_COMMIT_BATCH;
use super::super::error::StoreError;
use super::error::{sort, sort_pool};
use super::group::GroupCommit;
use super::location::Location;
use super::numbering::{Assigner, assign};
use super::{listen, schema, tls};

/// How long a statement waits for a lock another session holds before it fails as busy.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// How many connections the pool holds at most, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;

/// How long a call waits for a pooled connection (or to open one), by default.
pub const DEFAULT_POOL_TIMEOUT: Duration = Duration::from_secs(5);

/// How a [`PostgresStore`] uses its database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostgresSettings {
    /// The most connections this process holds (the pool's bound; the listener's one is
    /// besides). Each replica of a fleet holds its own: the server's `max_connections` must
    /// cover the sum.
    pub max_connections: usize,
    /// How long a call waits for a connection before it fails as
    /// [`StoreError::Unavailable`] (and how long opening one may take).
    pub timeout: Duration,
    /// The most creations and state changes committed in one transaction (group commit: those
    /// that reach the store together); 1 commits each alone.
    pub commit_batch: usize,
}

impl Default for PostgresSettings {
    fn default() -> PostgresSettings {
        PostgresSettings {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            timeout: DEFAULT_POOL_TIMEOUT,
            commit_batch: DEFAULT_COMMIT_BATCH,
        }
    }
}

/// The background tasks, aborted when the last handle is dropped.
struct Tasks(Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// A handle on the fleet's database; cheap to clone. Its `Debug` shows the URL without its
/// password.
#[derive(Clone)]
pub struct PostgresStore {
    pub(super) pool: Pool,
    /// The URL with its password redacted: what errors and logs name.
    pub(super) shown: Arc<str>,
    /// The broker name operations show.
    pub(super) broker: Arc<str>,
    /// The operations whose changes the event log records (those needing approval).
    pub(super) requests: Arc<[String]>,
    /// Where the newest positioned event is published.
    pub(super) events: EventBell,
    /// Woken when another process may have written an event (a notification, a reconnect).
    pub(super) wake: Arc<Notify>,
    /// Changes announced by any process (an operation's id and new state, a stream's id;
    /// empty: anything may have changed).
    pub(super) changes: broadcast::Sender<String>,
    /// The database's size in bytes, as last measured.
    pub(super) bytes: Arc<AtomicU64>,
    /// Where this replica writes stream bodies.
    pub(super) streams: Arc<PathBuf>,
    /// Where creations and state changes queue to be committed together.
    pub(super) group: Arc<GroupCommit>,
    /// The replica this process serves the store as, once it joined the fleet
    /// (`join_fleet`): the owner its new operations name, and whose work it recovers, starts
    /// and takes over. Unset, it owns every row (a store opened outside a broker).
    pub(super) member: Arc<std::sync::OnceLock<String>>,
    /// The data dir's lock, when the broker's data dir is held through this store
    /// ([`PostgresStore::holding`]).
    _dir_lock: Option<Arc<std::fs::File>>,
    _tasks: Arc<Tasks>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("database", &self.shown)
            .field("broker", &self.broker)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// This handle, holding `lock` (the broker's data dir's) for as long as any clone lives.
    pub(crate) fn holding(mut self, lock: std::fs::File) -> PostgresStore {
        self._dir_lock = Some(Arc::new(lock));
        self
    }

    /// Connects to the database at `url` (any libpq URL; `sslmode` honoured) with the default
    /// [`PostgresSettings`], creating its schema on first start and migrating an older one
    /// (one replica at a time); operations show `broker` as their broker's name, and the
    /// changes of the operations named in `requests` are recorded in the event log. Stream
    /// bodies go to `streams_dir`, a directory of this replica's own for now.
    pub async fn connect(
        url: &str,
        broker: &str,
        requests: impl IntoIterator<Item = &str>,
        streams_dir: PathBuf,
    ) -> Result<PostgresStore, StoreError> {
        PostgresStore::connect_with(
            url,
            broker,
            requests,
            streams_dir,
            PostgresSettings::default(),
        )
        .await
    }

    /// [`PostgresStore::connect`] with these `settings`.
    pub async fn connect_with(
        url: &str,
        broker: &str,
        requests: impl IntoIterator<Item = &str>,
        streams_dir: PathBuf,
        settings: PostgresSettings,
    ) -> Result<PostgresStore, StoreError> {
        let mut location = Location::parse(url)?;
        if location.config.get_connect_timeout().is_none() {
            location.config.connect_timeout(settings.timeout);
        }
        location
            .config
            .application_name("unyolo-admission")
            .keepalives_idle(Duration::from_secs(30));
        // A write waits at most this long for a lock another session holds, then fails as busy
        // (a 503 with Retry-After), as SQLite's busy timeout does; the URL's own options stay.
        let lock_timeout = format!("-c lock_timeout={}", LOCK_TIMEOUT.as_millis());
        let options = match location.config.get_options() {
            Some(given) if !given.is_empty() => format!("{given} {lock_timeout}"),
            _ => lock_timeout,
        };
        location.config.options(&options);
        let tls = tls::connector(&location)?;
        let shown: Arc<str> = Arc::from(location.shown.as_str());
        let manager = Manager::from_config(
            location.config.clone(),
            tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.max_connections.max(1))
            .wait_timeout(Some(settings.timeout))
            .create_timeout(Some(settings.timeout))
            .recycle_timeout(Some(settings.timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::BadLocation {
                location: shown.to_string(),
                detail: format!("the connection pool: {e}"),
            })?;
        {
            let mut client = pool.get().await.map_err(|e| sort_pool(&shown, e))?;
            schema::migrate(&mut client, &shown).await?;
        }
        let high_water = assign(&pool, &shown, Assigner::Waits).await?.high_water;
        let bell = EventBell::new(high_water);
        let (changes, _) = broadcast::channel(1024);
        let wake = Arc::new(Notify::new());
        let bytes = Arc::new(AtomicU64::new(0));
        let (listening, mut is_listening) = tokio::sync::watch::channel(false);
        let tasks = vec![
            tokio::spawn(listen::listen(
                location.config.clone(),
                tls,
                Arc::clone(&shown),
                changes.clone(),
                Arc::clone(&wake),
                listening,
            )),
            tokio::spawn(listen::assign_positions(
                pool.clone(),
                Arc::clone(&shown),
                bell.clone(),
                Arc::clone(&wake),
                Arc::clone(&bytes),
            )),
        ];
        let group = Arc::new(GroupCommit::new(
            pool.clone(),
            Arc::clone(&shown),
            settings.commit_batch,
        ));
        let store = PostgresStore {
            group,
            pool,
            shown,
            broker: Arc::from(broker),
            requests: requests.into_iter().map(str::to_owned).collect(),
            events: bell,
            wake,
            changes,
            bytes,
            streams: Arc::new(streams_dir),
            member: Arc::default(),
            _dir_lock: None,
            _tasks: Arc::new(Tasks(tasks)),
        };
        store.measure().await?;
        // Changes made by others from now on are heard: the listener is connected (or, if it
        // cannot connect within the timeout, keeps trying and announces "anything may have
        // changed" once it does).
        if tokio::time::timeout(settings.timeout, is_listening.wait_for(|on| *on))
            .await
            .is_err()
        {
            tracing::warn!(database = %store.shown, "the store's listener is not connected yet; changes made elsewhere are heard once it is");
        }
        Ok(store)
    }

    /// The database's URL with its password redacted.
    pub fn database(&self) -> &str {
        &self.shown
    }

    /// The broker name operations show.
    pub fn broker(&self) -> &str {
        &self.broker
    }

    /// Whether changes of `operation` are requests the event log records.
    pub fn is_request(&self, operation: &str) -> bool {
        self.requests.iter().any(|name| name == operation)
    }

    /// A pooled connection, within the pool's timeout.
    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| sort_pool(&self.shown, e))
    }

    /// Runs `sql` (prepared once per connection) on a pooled connection and reads at most one
    /// row: the shape of every lookup by key or id.
    pub(super) async fn query_opt_cached(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>, StoreError> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(sql)
            .await
            .map_err(|e| self.sorted(e))?;
        client
            .query_opt(&stmt, params)
            .await
            .map_err(|e| self.sorted(e))
    }

    /// Sorts a statement's error (see `error`).
    pub(super) fn sorted(&self, err: tokio_postgres::Error) -> StoreError {
        sort(&self.shown, err)
    }

    /// Measures the database's size (`pg_database_size`), kept for [`Self::bytes`].
    pub(super) async fn measure(&self) -> Result<(), StoreError> {
        let bytes = listen::measure(&self.pool, &self.shown).await?;
        self.bytes.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Counts `n` events this process committed, and wakes the numbering task for them (the
    /// other replicas' listeners hear of them by the transaction's notification).
    pub(super) fn wrote(&self, n: u64) {
        if n > 0 {
            self.events.wrote(n);
            self.wake.notify_one();
        }
    }

    /// The database's size in bytes, as last measured.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}
