//! The broker's durable store: one SQLite file (WAL, `synchronous=FULL`) under the data dir.
//!
//! Operations and streams live here; the controller's counts are rebuilt from it at start-up, so
//! what is on disk is what counts. Every write is committed (and so on disk) before the call
//! returns, which is what lets the HTTP layer answer 202 only for work that survives a crash.
//!
//! SQLite is blocking, so every call runs on tokio's blocking pool. Writes go through one
//! connection; reads (replay lookups, gets, list pages, waits) through a small pool of reader
//! connections ([`READERS`]), so a read never queues behind an `fsync` nor behind another read.
//!
//! One broker owns a data dir: opening takes an exclusive lock on [`LOCK_FILE`] and holds it while
//! any handle on the database lives. Two brokers on one dir would both restore, count and execute
//! the same operations, so the second is refused at start-up instead.
//!
//! The store knows SQL and files, nothing of HTTP or JSON answers: it imports nothing from the
//! rest of the broker. This file holds the handle (opening, the data dir's lock, the write
//! connection and the reader pool); the rest is one file per concern:
//!
//! - `schema`: the tables, their indexes and the migrations from older files;
//! - `operations`: the operation rows (insert, lookups, state changes, listing pages, start-up
//!   recovery);
//! - `streams`: the stream rows;
//! - `maintenance`: what keeps the file bounded and checked (retention deletes, returning free
//!   pages, checkpoints, the counts the drift check compares);
//! - `error`: what went wrong, as values a caller matches on.

mod error;
mod maintenance;
mod operations;
mod schema;
mod streams;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::Connection;

pub use error::{InsertError, StoreError};
pub use maintenance::StoredCounts;
pub use operations::{OperationError, OperationRecord, PageQuery, Recovered};
pub use schema::SCHEMA_VERSION;
pub use streams::StreamRecord;

/// How many reader connections serve gets, list pages and waits.
pub const READERS: u32 = 4;

/// The broker name an operation shows when none is configured.
pub const DEFAULT_BROKER_NAME: &str = "admission";

/// The database file's name inside the data dir.
pub const DATABASE_FILE: &str = "admission.sqlite3";

/// The bytes the write-ahead log is cut back to after a checkpoint.
const WAL_SIZE_LIMIT: i64 = 4 * 1024 * 1024;

/// The lock file's name inside the data dir: locked exclusively by the broker that owns the dir.
pub const LOCK_FILE: &str = "admission.lock";

/// The current time in RFC 3339 (UTC, milliseconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Database {
    writer: Arc<Mutex<Connection>>,
    readers: r2d2::Pool<SqliteConnectionManager>,
    dir: PathBuf,
    /// The broker name operations show.
    broker: Arc<str>,
    /// The data dir's lock, held until the last handle is dropped (closing the file unlocks it).
    _lock: Arc<std::fs::File>,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").field("dir", &self.dir).finish()
    }
}

fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: a commit is on disk before it returns, in WAL mode too.
    conn.pragma_update(None, "synchronous", "FULL")?;
    // When the log restarts after a checkpoint, it is cut back to this size: a burst of writes (a
    // large sweep) does not leave a large log file behind.
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    // 32 MiB of page cache (negative: KiB): a sweep's batch touches index pages all over the
    // file, and re-reading them for every batch is most of its cost.
    conn.pragma_update(None, "cache_size", -32_768)?;
    Ok(conn)
}

/// Takes the exclusive lock on `dir`'s [`LOCK_FILE`], or says which dir is in use.
fn lock_data_dir(dir: &Path) -> Result<std::fs::File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StoreError::io("open", &path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::DirInUse {
            dir: dir.to_owned(),
            lock: path,
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::io("lock", &path, e)),
    }
}

impl Database {
    /// Opens (creating if needed) the database in `dir`, creating the schema on first start and
    /// migrating an older one; operations show [`DEFAULT_BROKER_NAME`]. Fails if another broker
    /// holds the data dir. Blocking; call it before serving.
    pub fn open(dir: &Path) -> Result<Database, StoreError> {
        Database::open_as(dir, DEFAULT_BROKER_NAME)
    }

    /// [`Database::open`], with operations showing `broker` as their broker's name.
    pub fn open_as(dir: &Path, broker: &str) -> Result<Database, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::io("create", dir, e))?;
        let lock = lock_data_dir(dir)?;
        let path = dir.join(DATABASE_FILE);
        let writer = open_connection(&path)?;
        schema::migrate(&writer, &path)?;
        // Readers only read: WAL is already on (it is a property of the file), and a reader never
        // takes the write lock.
        let manager = SqliteConnectionManager::file(&path).with_init(|conn| {
            conn.busy_timeout(std::time::Duration::from_secs(5))?;
            conn.pragma_update(None, "query_only", true)
        });
        let readers = r2d2::Pool::builder()
            .max_size(READERS)
            .connection_timeout(std::time::Duration::from_secs(5))
            .build(manager)
            .map_err(|source| StoreError::NoReader {
                path: path.clone(),
                source,
            })?;
        schema::ensure_indexes(&writer)?;
        Ok(Database {
            writer: Arc::new(Mutex::new(writer)),
            readers,
            broker: Arc::from(broker),
            dir: dir.to_owned(),
            _lock: Arc::new(lock),
        })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The broker name operations show.
    pub fn broker(&self) -> &str {
        &self.broker
    }

    /// Whether the store would take a write now: the write connection takes SQLite's write lock
    /// and lets it go, writing nothing. Fails (after the busy timeout) while another process holds
    /// the database's write lock, and fails if the file cannot be read or locked: the states in
    /// which a submission could not be made durable.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.write(|conn| {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            conn.execute_batch("ROLLBACK")
        })
        .await
    }

    /// A reader connection from the pool (blocking until one is free, at most its timeout).
    fn reader(&self) -> Result<r2d2::PooledConnection<SqliteConnectionManager>, StoreError> {
        self.readers.get().map_err(|source| StoreError::NoReader {
            path: self.dir.join(DATABASE_FILE),
            source,
        })
    }

    /// The write connection, blocking until no other call holds it (for the blocking calls made
    /// before serving: recovery, seeding).
    fn writer(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the write connection, off the async threads.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = Arc::clone(&self.writer);
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut conn).map_err(StoreError::from)
        })
        .await
        .map_err(|e| StoreError::unfinished("the store task", e))?
    }

    /// Runs `f` on a pooled reader connection, off the async threads; `f` gets the broker name
    /// records show.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, &str) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = self.clone();
        tokio::task::spawn_blocking(move || {
            let conn = db.reader()?;
            f(&conn, &db.broker).map_err(StoreError::from)
        })
        .await
        .map_err(|e| StoreError::unfinished("the store task", e))?
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::OperationState;

    fn record(id: &str, key: &str) -> OperationRecord {
        let now = now_rfc3339();
        OperationRecord {
            id: id.to_owned(),
            client_id: "bot-7".to_owned(),
            idempotency_key: key.to_owned(),
            operation: "demo.run".to_owned(),
            target: json!({}),
            arguments: json!({}),
            reason: String::new(),
            state: OperationState::Pending,
            created_at: now.clone(),
            updated_at: now,
            terminal_at: None,
            error: None,
            revision: 1,
            broker: DEFAULT_BROKER_NAME.to_owned(),
        }
    }

    #[test]
    fn a_second_open_of_a_data_dir_is_refused_as_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Database::open(dir.path()).unwrap();
        let err = Database::open(dir.path()).unwrap_err();
        let StoreError::DirInUse { dir: in_use, lock } = &err else {
            panic!("not DirInUse: {err}");
        };
        assert_eq!(in_use, dir.path());
        assert_eq!(lock, &dir.path().join(LOCK_FILE));
        assert!(
            err.to_string().contains("in use by another broker"),
            "{err}"
        );
    }

    #[test]
    fn a_file_from_a_newer_broker_is_an_unknown_schema() {
        let dir = tempfile::tempdir().unwrap();
        Connection::open(dir.path().join(DATABASE_FILE))
            .unwrap()
            .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let err = Database::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, StoreError::UnknownSchema { found, .. } if found == SCHEMA_VERSION + 1),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_second_insert_of_a_key_is_a_duplicate() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(dir.path()).unwrap();
        db.insert(record("op_1", "k")).await.unwrap();
        let again = db.insert(record("op_2", "k")).await;
        assert!(matches!(again, Err(InsertError::Duplicate)), "{again:?}");
    }

    #[tokio::test]
    async fn a_row_in_an_unknown_state_reads_back_as_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(dir.path()).unwrap();
        db.load(&[record("op_1", "k")]).unwrap();
        Connection::open(dir.path().join(DATABASE_FILE))
            .unwrap()
            .execute("UPDATE operations SET state = 'mislaid'", [])
            .unwrap();
        let err = db.get("op_1").await.unwrap_err();
        assert!(matches!(err, StoreError::CorruptRow(_)), "{err}");
    }

    #[tokio::test]
    async fn a_store_another_connection_holds_locked_is_busy() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(dir.path()).unwrap();
        let holder = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        holder.execute_batch("BEGIN IMMEDIATE").unwrap();
        // The write waits out its busy timeout, then gives up.
        let err = db.ping().await.unwrap_err();
        assert!(matches!(err, StoreError::Busy(_)), "{err}");
        holder.execute_batch("ROLLBACK").unwrap();
        db.ping().await.unwrap();
    }
}
