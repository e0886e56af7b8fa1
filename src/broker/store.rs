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
//! Every operation row carries a `revision`: 1 at creation, +1 in the same statement as every
//! change (state, error, recovery), so a client that saw revision N knows whether anything
//! changed since, across restarts too. Listing pages walk `seq`, the table's explicit rowid
//! (creation order; `AUTOINCREMENT`, so never reused, even after retention deleted the newest
//! rows; and kept by `VACUUM`, which may renumber an implicit rowid) through the `(client_id)` and
//! `(client_id, state)` indexes, so a page costs the same however many rows there are. Schema 3
//! made `seq` explicit: the migration copies each row's old rowid into it, so a cursor handed out
//! before the upgrade still points at the same place after it.
//!
//! **Bounded.** The file uses incremental auto-vacuum: the retention sweep
//! ([`super::retention`]) deletes retired rows in small transactions ([`Database::retire_batch`])
//! and then returns freed pages to the filesystem a few at a time
//! ([`Database::return_free_pages`]), so neither step holds the write lock for long. An older file
//! is switched over once at start-up with one full `VACUUM`.
//!
//! One broker owns a data dir: opening takes an exclusive lock on [`LOCK_FILE`] and holds it while
//! any handle on the database lives. Two brokers on one dir would both restore, count and execute
//! the same operations, so the second is refused at start-up instead.
//!
//! One piece past the usual size: every SQL statement of the broker is here, beside the schema and
//! its migrations, so a reader checks a query against the table and its indexes in one file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::{Value, json};

use crate::engine::OperationState;

/// The schema version this code writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 3;

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

/// The operations table, named `{name}`. `seq` is its explicit rowid: listing cursors are `seq`
/// values, so they survive a `VACUUM` (which may renumber an implicit rowid) and, with
/// `AUTOINCREMENT`, are never reused even after retention deleted the newest rows.
const OPERATIONS_TABLE: &str = "
CREATE TABLE {name} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT NOT NULL UNIQUE,
    client_id       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    operation       TEXT NOT NULL,
    target          TEXT NOT NULL,
    arguments       TEXT NOT NULL,
    reason          TEXT NOT NULL,
    state           TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    terminal_at     TEXT,
    error_code      TEXT,
    error_message   TEXT,
    revision        INTEGER NOT NULL DEFAULT 1,
    UNIQUE (client_id, idempotency_key)
);
";

/// The operations table's indexes (listing pages, recovery, counts).
const OPERATIONS_INDEXES: &str = "
CREATE INDEX operations_by_state ON operations (state);
CREATE INDEX operations_by_client ON operations (client_id);
CREATE INDEX operations_by_client_state ON operations (client_id, state);
";

const STREAMS_TABLE: &str = "
CREATE TABLE streams (
    id         TEXT PRIMARY KEY NOT NULL,
    client_id  TEXT NOT NULL,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
";

/// The columns of an operation row, in table order after `seq`.
const OPERATION_COLUMNS: &str = "id, client_id, idempotency_key, operation, target, arguments, \
    reason, state, created_at, updated_at, terminal_at, error_code, error_message, revision";

/// From schema version 1: every existing operation starts at revision 1 (it has no recorded
/// history), and the indexes that listing pages walk.
const MIGRATE_1_TO_2: &str = "
ALTER TABLE operations ADD COLUMN revision INTEGER NOT NULL DEFAULT 1;
CREATE INDEX operations_by_client ON operations (client_id);
CREATE INDEX operations_by_client_state ON operations (client_id, state);
";

/// From schema version 2: the operations table is copied into one whose rowid is the explicit
/// `seq`, each row keeping its rowid as its `seq`, so every listing cursor handed out before the
/// migration still points at the same place.
fn migrate_2_to_3() -> String {
    format!(
        "{table} INSERT INTO operations_v3 (seq, {OPERATION_COLUMNS}) \
         SELECT rowid, {OPERATION_COLUMNS} FROM operations ORDER BY rowid; \
         DROP TABLE operations; ALTER TABLE operations_v3 RENAME TO operations; {OPERATIONS_INDEXES}",
        table = OPERATIONS_TABLE.replace("{name}", "operations_v3"),
    )
}

/// `PRAGMA auto_vacuum` value for `INCREMENTAL`: freed pages stay in the file until
/// `PRAGMA incremental_vacuum` returns them to the filesystem, which the retention sweep does in
/// small steps.
const AUTO_VACUUM_INCREMENTAL: i64 = 2;

/// Why the store could not do what was asked.
#[derive(Debug)]
pub struct StoreError(String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "store: {}", self.0)
    }
}

impl std::error::Error for StoreError {}

impl StoreError {
    /// An error with this description.
    pub fn new(detail: impl Into<String>) -> StoreError {
        StoreError(detail.into())
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> StoreError {
        StoreError(err.to_string())
    }
}

/// Why an operation row was not inserted.
#[derive(Debug)]
pub enum InsertError {
    /// The client already has an operation with this idempotency key (a concurrent duplicate).
    Duplicate,
    /// The store failed.
    Store(StoreError),
}

/// The error an operation ended with, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OperationError {
    /// A stable code, e.g. `execution_interrupted`.
    pub code: String,
    /// A sentence for people.
    pub message: String,
}

/// One durable operation, as stored and as the API shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct OperationRecord {
    /// `op_` and 32 hex digits.
    pub id: String,
    /// The client that submitted it.
    pub client_id: String,
    /// The client's idempotency key.
    pub idempotency_key: String,
    /// The registered operation name.
    pub operation: String,
    /// A JSON object.
    pub target: Value,
    /// A JSON object.
    pub arguments: Value,
    /// Why the agent asks.
    pub reason: String,
    /// The state.
    pub state: OperationState,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// RFC 3339, UTC.
    pub updated_at: String,
    /// When it reached a terminal state.
    pub terminal_at: Option<String>,
    /// Why it failed, if it did.
    pub error: Option<OperationError>,
    /// 1 at creation, +1 on every change; durable.
    pub revision: u64,
    /// The name of the broker that holds it (not stored: the broker's configured name).
    pub broker: String,
}

impl OperationRecord {
    /// The Agent V1 operation object: every field the contract has, optional ones only when
    /// they have a value (never a `null`).
    pub fn to_json(&self) -> Value {
        let mut object = self.to_summary_json();
        let fields = object.as_object_mut().expect("a summary is an object");
        fields.insert("target".to_owned(), self.target.clone());
        fields.insert("arguments".to_owned(), self.arguments.clone());
        fields.insert("reason".to_owned(), Value::from(self.reason.as_str()));
        if let Some(error) = &self.error {
            fields.insert(
                "error".to_owned(),
                json!({"code": error.code, "message": error.message}),
            );
        }
        object
    }

    /// The Agent V1 operation summary: the operation object without `target`, `arguments`,
    /// `reason`, `result`, `error`, `approval_id` and `plan_digest`.
    pub fn to_summary_json(&self) -> Value {
        let mut object = json!({
            "api_version": super::discovery::API_VERSION,
            "id": self.id,
            "broker": self.broker,
            "client_id": self.client_id,
            "idempotency_key": self.idempotency_key,
            "operation": self.operation,
            "state": self.state.as_str(),
            "revision": self.revision,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "presentation": super::presentation::presentation(self),
        });
        if let Some(terminal_at) = &self.terminal_at {
            object["terminal_at"] = Value::from(terminal_at.as_str());
        }
        object
    }

    fn from_row(row: &Row<'_>, broker: &str) -> rusqlite::Result<OperationRecord> {
        let state: String = row.get("state")?;
        let state = OperationState::parse(&state).ok_or_else(|| {
            rusqlite::Error::FromSqlConversionFailure(
                0,
                rusqlite::types::Type::Text,
                format!("unknown operation state {state:?}").into(),
            )
        })?;
        let json_column = |name: &str| -> rusqlite::Result<Value> {
            let text: String = row.get(name)?;
            serde_json::from_str(&text).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into())
            })
        };
        let error_code: Option<String> = row.get("error_code")?;
        let error_message: Option<String> = row.get("error_message")?;
        Ok(OperationRecord {
            id: row.get("id")?,
            client_id: row.get("client_id")?,
            idempotency_key: row.get("idempotency_key")?,
            operation: row.get("operation")?,
            target: json_column("target")?,
            arguments: json_column("arguments")?,
            reason: row.get("reason")?,
            state,
            created_at: row.get("created_at")?,
            updated_at: row.get("updated_at")?,
            terminal_at: row.get("terminal_at")?,
            error: error_code.map(|code| OperationError {
                code,
                message: error_message.unwrap_or_default(),
            }),
            revision: row.get::<_, i64>("revision")?.max(1) as u64,
            broker: broker.to_owned(),
        })
    }
}

/// One stored stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRecord {
    /// `st_` and 32 hex digits.
    pub id: String,
    /// The owner.
    pub client_id: String,
    /// Bytes.
    pub size: u64,
}

/// What start-up found in the store.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Operations that were executing at the crash, now failed with `execution_interrupted`.
    pub interrupted: Vec<OperationRecord>,
    /// Pending and approved operations, oldest first.
    pub live: Vec<OperationRecord>,
    /// Every stored stream.
    pub streams: Vec<StreamRecord>,
}

/// What the store holds, for the drift check: operation rows by client and non-terminal state,
/// and stream files and bytes by client, read in one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredCounts {
    /// (client, state, rows) for the pending, approved and executing operations.
    pub operations: Vec<(String, OperationState, u64)>,
    /// (client, files, bytes) of the stored streams.
    pub streams: Vec<(String, u64, u64)>,
}

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
    // Before WAL, whose switch writes a new file's header: a new file is incremental from the start.
    conn.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
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
        .map_err(|e| StoreError(format!("cannot open {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError(format!(
            "the data dir {} is in use by another broker (it holds {}); stop it or choose another --data",
            dir.display(),
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(StoreError(format!("cannot lock {}: {e}", path.display())))
        }
    }
}

const SELECT_OPERATION: &str = "SELECT id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision FROM operations";

const FIND_BY_KEY: &str = "SELECT id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision FROM operations WHERE client_id = ?1 AND idempotency_key = ?2";

/// What a listing page selects: the caller's operations, newest first, after a position.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageQuery {
    /// Only the operation with this idempotency key.
    pub idempotency_key: Option<String>,
    /// Only operations in this state.
    pub state: Option<OperationState>,
    /// Only operations older than this position (the previous page's last).
    pub before: Option<i64>,
    /// At most this many.
    pub limit: u32,
}

/// The SQL of a listing page: the filters present, in a fixed order so each shape is one cached
/// statement. Each walks an index in `rowid` order and stops after `limit` rows.
fn page_sql(query: &PageQuery) -> String {
    let mut sql = format!(
        "SELECT rowid AS position, {} WHERE client_id = ?1",
        SELECT_OPERATION.trim_start_matches("SELECT ")
    );
    if query.idempotency_key.is_some() {
        sql.push_str(" AND idempotency_key = ?2");
    }
    if query.state.is_some() {
        sql.push_str(" AND state = ?3");
    }
    if query.before.is_some() {
        sql.push_str(" AND rowid < ?4");
    }
    sql.push_str(" ORDER BY rowid DESC LIMIT ?5");
    sql
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
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError(format!("cannot create {}: {e}", dir.display())))?;
        let lock = lock_data_dir(dir)?;
        let path = dir.join(DATABASE_FILE);
        let writer = open_connection(&path)?;
        let version: i64 = writer.pragma_query_value(None, "user_version", |r| r.get(0))?;
        match version {
            0 => {
                writer.execute_batch(&format!(
                    "BEGIN; {table} {OPERATIONS_INDEXES} {STREAMS_TABLE} \
                     PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;",
                    table = OPERATIONS_TABLE.replace("{name}", "operations"),
                ))?;
            }
            1 | 2 => {
                let first = if version == 1 { MIGRATE_1_TO_2 } else { "" };
                writer.execute_batch(&format!(
                    "BEGIN; {first} {} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;",
                    migrate_2_to_3()
                ))?;
            }
            SCHEMA_VERSION => {}
            other => {
                return Err(StoreError(format!(
                    "{} has schema version {other}; this broker knows version {SCHEMA_VERSION}",
                    path.display()
                )));
            }
        }
        // An older file (or one created by hand) is switched to incremental vacuum once: the mode
        // only takes effect through a full `VACUUM`, which rewrites the file (a one-time cost at
        // start-up, logged). Cursors are `seq` values, which `VACUUM` keeps.
        let auto_vacuum: i64 = writer.pragma_query_value(None, "auto_vacuum", |r| r.get(0))?;
        if auto_vacuum != AUTO_VACUUM_INCREMENTAL {
            tracing::warn!(path = %path.display(), "switching the store to incremental vacuum (one full VACUUM)");
            writer.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
            writer.execute_batch("VACUUM")?;
        }
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
            .map_err(|e| StoreError(format!("cannot open readers on {}: {e}", path.display())))?;
        // The start-up rate replay reads operations by creation time, and the retention sweep
        // terminal ones by when they ended. Created at every open, not
        // by a schema version: an index changes no row, and an older file gains it on its next
        // start.
        writer.execute_batch(
            "CREATE INDEX IF NOT EXISTS operations_by_created_at ON operations (created_at); \
             CREATE INDEX IF NOT EXISTS operations_retiring ON operations (terminal_at) \
             WHERE terminal_at IS NOT NULL;",
        )?;
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

    /// A reader connection from the pool (blocking until one is free, at most its timeout).
    fn reader(&self) -> Result<r2d2::PooledConnection<SqliteConnectionManager>, StoreError> {
        self.readers
            .get()
            .map_err(|e| StoreError(format!("no reader connection: {e}")))
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
        .map_err(|e| StoreError(format!("store task failed: {e}")))?
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
        .map_err(|e| StoreError(format!("store task failed: {e}")))?
    }

    /// Start-up recovery (blocking): operations that were executing become `failed` with
    /// `execution_interrupted` (they never run twice); returns them, the live ones and the
    /// streams.
    pub fn recover(&self) -> Result<Recovered, StoreError> {
        let mut conn = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        let now = now_rfc3339();
        let error = OperationError {
            code: "execution_interrupted".to_owned(),
            message: "The broker stopped while the operation was executing; it was not run again."
                .to_owned(),
        };
        let interrupted = {
            let mut stmt = tx.prepare(&format!(
                "{SELECT_OPERATION} WHERE state = 'executing' ORDER BY rowid"
            ))?;
            stmt.query_map([], |row| OperationRecord::from_row(row, &self.broker))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        tx.execute(
            "UPDATE operations SET state = 'failed', updated_at = ?1, terminal_at = ?1, \
             error_code = ?2, error_message = ?3, revision = revision + 1 \
             WHERE state = 'executing'",
            params![now, error.code, error.message],
        )?;
        let interrupted = interrupted
            .into_iter()
            .map(|record| OperationRecord {
                state: OperationState::Failed,
                updated_at: now.clone(),
                terminal_at: Some(now.clone()),
                error: Some(error.clone()),
                revision: record.revision + 1,
                ..record
            })
            .collect();
        let live = {
            let mut stmt = tx.prepare(&format!(
                "{SELECT_OPERATION} WHERE state IN ('pending', 'approved') ORDER BY rowid"
            ))?;
            stmt.query_map([], |row| OperationRecord::from_row(row, &self.broker))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        let streams = {
            let mut stmt = tx.prepare("SELECT id, client_id, size FROM streams ORDER BY rowid")?;
            stmt.query_map([], |row| {
                Ok(StreamRecord {
                    id: row.get(0)?,
                    client_id: row.get(1)?,
                    size: row.get::<_, i64>(2)?.max(0) as u64,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?
        };
        tx.commit()?;
        Ok(Recovered {
            interrupted,
            live,
            streams,
        })
    }

    /// The client and creation time of every operation, in any state, created at or after
    /// `since` (blocking; at start-up, to rebuild the rate buckets). A `created_at` that does not
    /// parse is skipped.
    pub fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError> {
        let since = humantime::format_rfc3339_millis(since).to_string();
        let conn = self.reader()?;
        // `created_at` is always written by `now_rfc3339`: fixed width, UTC, so text order is time
        // order.
        let mut stmt = conn.prepare(
            "SELECT client_id, created_at FROM operations WHERE created_at >= ?1 ORDER BY created_at",
        )?;
        let mut rows = stmt.query([since])?;
        let mut created = Vec::new();
        while let Some(row) = rows.next()? {
            let client: String = row.get(0)?;
            let at: String = row.get(1)?;
            if let Ok(at) = humantime::parse_rfc3339(&at) {
                created.push((client, at));
            }
        }
        Ok(created)
    }

    /// How many operation rows exist (blocking; sizes the replay filter).
    pub fn key_count(&self) -> Result<u64, StoreError> {
        let conn = self.reader()?;
        let n: i64 = conn.query_row("SELECT COUNT(*) FROM operations", [], |r| r.get(0))?;
        Ok(n.max(0) as u64)
    }

    /// Calls `f` with the client and idempotency key of every operation (blocking; at start-up
    /// and when the replay filter is rebuilt).
    pub fn for_each_key(&self, mut f: impl FnMut(&str, &str)) -> Result<(), StoreError> {
        let conn = self.reader()?;
        let mut stmt = conn.prepare("SELECT client_id, idempotency_key FROM operations")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let client: String = row.get(0)?;
            let key: String = row.get(1)?;
            f(&client, &key);
        }
        Ok(())
    }

    /// Inserts a new operation; durable when this returns `Ok`.
    pub async fn insert(&self, record: OperationRecord) -> Result<(), InsertError> {
        let result = self
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO operations (id, client_id, idempotency_key, operation, target, \
                     arguments, reason, state, created_at, updated_at, terminal_at, error_code, \
                     error_message, revision) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, NULL, NULL, 1)",
                    params![
                        record.id,
                        record.client_id,
                        record.idempotency_key,
                        record.operation,
                        record.target.to_string(),
                        record.arguments.to_string(),
                        record.reason,
                        record.state.as_str(),
                        record.created_at,
                        record.updated_at,
                    ],
                )
            })
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(err) if err.0.contains("UNIQUE constraint failed") => Err(InsertError::Duplicate),
            Err(err) => Err(InsertError::Store(err)),
        }
    }

    /// The client's operation with this idempotency key.
    pub async fn find_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<OperationRecord>, StoreError> {
        let (client_id, key) = (client_id.to_owned(), key.to_owned());
        self.read(move |conn, broker| {
            conn.prepare_cached(FIND_BY_KEY)?
                .query_row(params![client_id, key], |row| {
                    OperationRecord::from_row(row, broker)
                })
                .optional()
        })
        .await
    }

    /// The operation `id`.
    pub async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, broker| {
            conn.prepare_cached(&format!("{SELECT_OPERATION} WHERE id = ?1"))?
                .query_row(params![id], |row| OperationRecord::from_row(row, broker))
                .optional()
        })
        .await
    }

    /// One listing page: the client's operations matching `query`, newest first, each with its
    /// position (pass the last one as the next page's `before`).
    pub async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationRecord)>, StoreError> {
        let client_id = client_id.to_owned();
        self.read(move |conn, broker| {
            let mut stmt = conn.prepare_cached(&page_sql(&query))?;
            let mut bind = |index: usize, value: &dyn rusqlite::ToSql| -> rusqlite::Result<()> {
                stmt.raw_bind_parameter(index, value)
            };
            bind(1, &client_id)?;
            if let Some(key) = &query.idempotency_key {
                bind(2, key)?;
            }
            if let Some(state) = query.state {
                bind(3, &state.as_str())?;
            }
            if let Some(before) = query.before {
                bind(4, &before)?;
            }
            bind(5, &query.limit)?;
            let mut rows = stmt.raw_query();
            let mut page = Vec::new();
            while let Some(row) = rows.next()? {
                page.push((
                    row.get::<_, i64>("position")?,
                    OperationRecord::from_row(row, broker)?,
                ));
            }
            Ok(page)
        })
        .await
    }

    /// How SQLite plans the listing page for `query` (one line per step), so a test can check
    /// that every page shape walks an index and sorts nothing.
    pub async fn explain_page(&self, query: PageQuery) -> Result<Vec<String>, StoreError> {
        self.read(move |conn, _| {
            let sql = format!("EXPLAIN QUERY PLAN {}", page_sql(&query));
            let mut stmt = conn.prepare(&sql)?;
            for index in 1..=stmt.parameter_count() {
                stmt.raw_bind_parameter(index, 1)?;
            }
            let mut rows = stmt.raw_query();
            let mut plan = Vec::new();
            while let Some(row) = rows.next()? {
                plan.push(row.get::<_, String>(3)?);
            }
            Ok(plan)
        })
        .await
    }

    /// Every operation in `state`, oldest first, at most `limit`.
    pub async fn list_in_state(
        &self,
        state: OperationState,
        limit: u32,
    ) -> Result<Vec<OperationRecord>, StoreError> {
        self.read(move |conn, broker| {
            let mut stmt = conn.prepare_cached(&format!(
                "{SELECT_OPERATION} WHERE state = ?1 ORDER BY rowid LIMIT ?2"
            ))?;
            stmt.query_map(params![state.as_str(), limit], |row| {
                OperationRecord::from_row(row, broker)
            })?
            .collect()
        })
        .await
    }

    /// Moves operation `id` from `from` to `to` (with `error` for a failure); durable when this
    /// returns. Returns the updated record, or `None` if the row was not in `from`.
    pub async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        error: Option<OperationError>,
    ) -> Result<Option<OperationRecord>, StoreError> {
        let id = id.to_owned();
        let broker = Arc::clone(&self.broker);
        self.write(move |conn| {
            let now = now_rfc3339();
            let terminal_at = to.is_terminal().then_some(now.as_str());
            let tx = conn.transaction()?;
            let changed = tx.execute(
                "UPDATE operations SET state = ?3, updated_at = ?4, terminal_at = ?5, \
                 error_code = ?6, error_message = ?7, revision = revision + 1 \
                 WHERE id = ?1 AND state = ?2",
                params![
                    id,
                    from.as_str(),
                    to.as_str(),
                    now,
                    terminal_at,
                    error.as_ref().map(|e| e.code.as_str()),
                    error.as_ref().map(|e| e.message.as_str()),
                ],
            )?;
            let record = if changed == 1 {
                tx.query_row(
                    &format!("{SELECT_OPERATION} WHERE id = ?1"),
                    params![id],
                    |row| OperationRecord::from_row(row, &broker),
                )
                .optional()?
            } else {
                None
            };
            tx.commit()?;
            Ok(record)
        })
        .await
    }

    /// How many operation rows exist (for tests and the drill).
    pub async fn count_operations(&self) -> Result<u64, StoreError> {
        self.read(|conn, _| {
            conn.query_row("SELECT COUNT(*) FROM operations", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|n| n.max(0) as u64)
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

    /// The directory stream bodies are written to.
    pub fn streams_dir(&self) -> PathBuf {
        self.dir.join("streams")
    }

    /// Records a stream whose body is already on disk; durable when this returns.
    pub async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError> {
        self.write(move |conn| {
            conn.execute(
                "INSERT INTO streams (id, client_id, size, created_at) VALUES (?1, ?2, ?3, ?4)",
                params![
                    stream.id,
                    stream.client_id,
                    i64::try_from(stream.size).unwrap_or(i64::MAX),
                    now_rfc3339()
                ],
            )
        })
        .await
        .map(|_| ())
    }

    /// The stream `id`.
    pub async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, _| {
            conn.query_row(
                "SELECT id, client_id, size FROM streams WHERE id = ?1",
                params![id],
                |row| {
                    Ok(StreamRecord {
                        id: row.get(0)?,
                        client_id: row.get(1)?,
                        size: row.get::<_, i64>(2)?.max(0) as u64,
                    })
                },
            )
            .optional()
        })
        .await
    }

    /// Deletes the stream row `id`; returns whether it existed.
    pub async fn delete_stream(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.write(move |conn| conn.execute("DELETE FROM streams WHERE id = ?1", params![id]))
            .await
            .map(|n| n == 1)
    }

    /// The counts the controller's must equal (see [`StoredCounts`]), from one read transaction
    /// on the read connection.
    pub async fn counts(&self) -> Result<StoredCounts, StoreError> {
        self.read(|conn, _| {
            let tx = conn.unchecked_transaction()?;
            let operations = {
                let mut stmt = tx.prepare(
                    "SELECT client_id, state, COUNT(*) FROM operations \
                     WHERE state IN ('pending', 'approved', 'executing') \
                     GROUP BY client_id, state",
                )?;
                stmt.query_map([], |row| {
                    let state: String = row.get(1)?;
                    let state = OperationState::parse(&state).ok_or_else(|| {
                        rusqlite::Error::FromSqlConversionFailure(
                            1,
                            rusqlite::types::Type::Text,
                            format!("unknown operation state {state:?}").into(),
                        )
                    })?;
                    Ok((row.get(0)?, state, row.get::<_, i64>(2)?.max(0) as u64))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
            };
            let streams = {
                let mut stmt = tx.prepare(
                    "SELECT client_id, COUNT(*), COALESCE(SUM(size), 0) FROM streams \
                     GROUP BY client_id",
                )?;
                stmt.query_map([], |row| {
                    Ok((
                        row.get(0)?,
                        row.get::<_, i64>(1)?.max(0) as u64,
                        row.get::<_, i64>(2)?.max(0) as u64,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
            };
            tx.finish()?;
            Ok(StoredCounts {
                operations,
                streams,
            })
        })
        .await
    }

    /// Deletes up to `limit` terminal operations whose `terminal_at` is before `cutoff` (RFC 3339,
    /// UTC, as [`now_rfc3339`] writes it), oldest first, in one short write transaction; returns
    /// how many went. Non-terminal operations are never touched, whatever their `terminal_at`.
    pub async fn retire_batch(&self, cutoff: String, limit: u32) -> Result<u64, StoreError> {
        self.write(move |conn| {
            // `terminal_at` is fixed-width UTC text, so text order is time order; the partial
            // index `operations_retiring` finds the batch without a scan.
            conn.prepare_cached(
                "DELETE FROM operations WHERE seq IN (SELECT seq FROM operations \
                 WHERE terminal_at IS NOT NULL AND terminal_at < ?1 \
                 AND state IN ('succeeded', 'failed', 'denied', 'canceled', 'expired') \
                 ORDER BY terminal_at LIMIT ?2)",
            )?
            .execute(params![cutoff, limit])
        })
        .await
        .map(|n| n as u64)
    }

    /// Returns up to `pages` free pages to the filesystem (incremental vacuum), in one short write
    /// transaction; returns how many free pages are left.
    pub async fn return_free_pages(&self, pages: u32) -> Result<u64, StoreError> {
        self.write(move |conn| {
            conn.execute_batch(&format!("PRAGMA incremental_vacuum({pages})"))?;
            conn.pragma_query_value(None, "freelist_count", |r| r.get::<_, i64>(0))
        })
        .await
        .map(|n| n.max(0) as u64)
    }

    /// Copies the write-ahead log into the database file as far as no reader needs it, without
    /// waiting for anyone (`PASSIVE`): after an incremental vacuum, this is what makes the main
    /// file shorter on disk.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        self.write(|conn| conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())))
            .await
    }

    /// How many operation rows are in each state (states with none are absent).
    pub async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt =
                conn.prepare_cached("SELECT state, COUNT(*) FROM operations GROUP BY state")?;
            let rows = stmt.query_map([], |row| {
                let state: String = row.get(0)?;
                Ok((state, row.get::<_, i64>(1)?.max(0) as u64))
            })?;
            let mut counts = Vec::new();
            for row in rows {
                let (state, n) = row?;
                if let Some(state) = OperationState::parse(&state) {
                    counts.push((state, n));
                }
            }
            Ok(counts)
        })
        .await
    }

    /// The bytes the database takes on disk: (the main file, its write-ahead log).
    pub fn file_bytes(&self) -> (u64, u64) {
        let size = |name: String| std::fs::metadata(self.dir.join(name)).map_or(0, |m| m.len());
        (
            size(DATABASE_FILE.to_owned()),
            size(format!("{DATABASE_FILE}-wal")),
        )
    }

    /// The id of every stream row, with its client.
    pub async fn stream_ids(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt = conn.prepare_cached("SELECT id, client_id FROM streams")?;
            stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                .collect()
        })
        .await
    }

    /// Writes `records` as they are (state, times, revision included) in one transaction
    /// (blocking): to seed a store for benchmarks and tests. Not for serving: the controller does
    /// not learn of them until the next start.
    pub fn load(&self, records: &[OperationRecord]) -> Result<(), StoreError> {
        let mut conn = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare(&format!(
                "INSERT INTO operations ({OPERATION_COLUMNS}) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)"
            ))?;
            for record in records {
                stmt.execute(params![
                    record.id,
                    record.client_id,
                    record.idempotency_key,
                    record.operation,
                    record.target.to_string(),
                    record.arguments.to_string(),
                    record.reason,
                    record.state.as_str(),
                    record.created_at,
                    record.updated_at,
                    record.terminal_at,
                    record.error.as_ref().map(|e| e.code.as_str()),
                    record.error.as_ref().map(|e| e.message.as_str()),
                    i64::try_from(record.revision).unwrap_or(i64::MAX),
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }
}
