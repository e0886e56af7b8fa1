//! The broker's durable store: one SQLite file (WAL, `synchronous=FULL`) under the data dir.
//!
//! Operations and streams live here; the controller's counts are rebuilt from it at start-up, so
//! what is on disk is what counts. Every write is committed (and so on disk) before the call
//! returns, which is what lets the HTTP layer answer 202 only for work that survives a crash.
//!
//! SQLite is blocking, so every call runs on tokio's blocking pool. Writes go through one
//! connection; reads through another, so a read (a replay lookup) never queues behind an `fsync`.
//!
//! One broker owns a data dir: opening takes an exclusive lock on [`LOCK_FILE`] and holds it while
//! any handle on the database lives. Two brokers on one dir would both restore, count and execute
//! the same operations, so the second is refused at start-up instead.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::{Value, json};

use crate::engine::OperationState;

/// The schema version this code writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 1;

/// The database file's name inside the data dir.
pub const DATABASE_FILE: &str = "admission.sqlite3";

/// The lock file's name inside the data dir: locked exclusively by the broker that owns the dir.
pub const LOCK_FILE: &str = "admission.lock";

const SCHEMA: &str = "
CREATE TABLE operations (
    id              TEXT PRIMARY KEY NOT NULL,
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
    UNIQUE (client_id, idempotency_key)
);
CREATE INDEX operations_by_state ON operations (state);
CREATE TABLE streams (
    id         TEXT PRIMARY KEY NOT NULL,
    client_id  TEXT NOT NULL,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
";

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
}

impl OperationRecord {
    /// The Agent V1 JSON representation.
    pub fn to_json(&self) -> Value {
        json!({
            "api_version": "unyolo.io/agent/v1",
            "id": self.id,
            "client_id": self.client_id,
            "idempotency_key": self.idempotency_key,
            "operation": self.operation,
            "target": self.target,
            "arguments": self.arguments,
            "reason": self.reason,
            "state": self.state.as_str(),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "terminal_at": self.terminal_at,
            "error": self.error.as_ref().map(|e| json!({"code": e.code, "message": e.message})),
        })
    }

    fn from_row(row: &Row<'_>) -> rusqlite::Result<OperationRecord> {
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

/// The current time in RFC 3339 (UTC, milliseconds).
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// A handle on the database; cheap to clone.
#[derive(Clone)]
pub struct Database {
    writer: Arc<Mutex<Connection>>,
    reader: Arc<Mutex<Connection>>,
    dir: PathBuf,
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
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message \
    FROM operations";

const FIND_BY_KEY: &str = "SELECT id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message \
    FROM operations WHERE client_id = ?1 AND idempotency_key = ?2";

impl Database {
    /// Opens (creating if needed) the database in `dir`, creating the schema on first start.
    /// Fails if another broker holds the data dir. Blocking; call it before serving.
    pub fn open(dir: &Path) -> Result<Database, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError(format!("cannot create {}: {e}", dir.display())))?;
        let lock = lock_data_dir(dir)?;
        let path = dir.join(DATABASE_FILE);
        let writer = open_connection(&path)?;
        let version: i64 = writer.pragma_query_value(None, "user_version", |r| r.get(0))?;
        match version {
            0 => {
                writer.execute_batch(&format!(
                    "BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
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
        // The start-up rate replay reads operations by creation time. Created at every open, not
        // by a schema version: an index changes no row, and an older file gains it on its next
        // start.
        writer.execute_batch(
            "CREATE INDEX IF NOT EXISTS operations_by_created_at ON operations (created_at);",
        )?;
        let reader = open_connection(&path)?;
        Ok(Database {
            writer: Arc::new(Mutex::new(writer)),
            reader: Arc::new(Mutex::new(reader)),
            dir: dir.to_owned(),
            _lock: Arc::new(lock),
        })
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.dir
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

    /// Runs `f` on the read connection, off the async threads.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = Arc::clone(&self.reader);
        tokio::task::spawn_blocking(move || {
            let conn = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&conn).map_err(StoreError::from)
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
            stmt.query_map([], OperationRecord::from_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        tx.execute(
            "UPDATE operations SET state = 'failed', updated_at = ?1, terminal_at = ?1, \
             error_code = ?2, error_message = ?3 WHERE state = 'executing'",
            params![now, error.code, error.message],
        )?;
        let interrupted = interrupted
            .into_iter()
            .map(|record| OperationRecord {
                state: OperationState::Failed,
                updated_at: now.clone(),
                terminal_at: Some(now.clone()),
                error: Some(error.clone()),
                ..record
            })
            .collect();
        let live = {
            let mut stmt = tx.prepare(&format!(
                "{SELECT_OPERATION} WHERE state IN ('pending', 'approved') ORDER BY rowid"
            ))?;
            stmt.query_map([], OperationRecord::from_row)?
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
        let conn = self.reader.lock().unwrap_or_else(|p| p.into_inner());
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

    /// Calls `f` with the client and idempotency key of every operation (blocking; at start-up).
    pub fn for_each_key(&self, mut f: impl FnMut(&str, &str)) -> Result<(), StoreError> {
        let conn = self.reader.lock().unwrap_or_else(|p| p.into_inner());
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
                     error_message) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, NULL, NULL)",
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
        self.read(move |conn| {
            conn.prepare_cached(FIND_BY_KEY)?
                .query_row(params![client_id, key], OperationRecord::from_row)
                .optional()
        })
        .await
    }

    /// The operation `id`.
    pub async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| {
            conn.query_row(
                &format!("{SELECT_OPERATION} WHERE id = ?1"),
                params![id],
                OperationRecord::from_row,
            )
            .optional()
        })
        .await
    }

    /// The client's operations, oldest first, at most `limit` (the newest ones).
    pub async fn list_by_client(
        &self,
        client_id: &str,
        limit: u32,
    ) -> Result<Vec<OperationRecord>, StoreError> {
        let client_id = client_id.to_owned();
        self.read(move |conn| {
            let mut stmt = conn.prepare(&format!(
                "{SELECT_OPERATION} WHERE rowid IN (SELECT rowid FROM operations \
                 WHERE client_id = ?1 ORDER BY rowid DESC LIMIT ?2) ORDER BY rowid"
            ))?;
            stmt.query_map(params![client_id, limit], OperationRecord::from_row)?
                .collect()
        })
        .await
    }

    /// Every operation in `state`, oldest first, at most `limit`.
    pub async fn list_in_state(
        &self,
        state: OperationState,
        limit: u32,
    ) -> Result<Vec<OperationRecord>, StoreError> {
        self.read(move |conn| {
            let mut stmt = conn.prepare(&format!(
                "{SELECT_OPERATION} WHERE state = ?1 ORDER BY rowid LIMIT ?2"
            ))?;
            stmt.query_map(params![state.as_str(), limit], OperationRecord::from_row)?
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
        self.write(move |conn| {
            let now = now_rfc3339();
            let terminal_at = to.is_terminal().then_some(now.as_str());
            let tx = conn.transaction()?;
            let changed = tx.execute(
                "UPDATE operations SET state = ?3, updated_at = ?4, terminal_at = ?5, \
                 error_code = ?6, error_message = ?7 WHERE id = ?1 AND state = ?2",
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
                    OperationRecord::from_row,
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
        self.read(|conn| {
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
        self.read(move |conn| {
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
}
