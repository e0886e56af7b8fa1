//! What went wrong in the store, as values: a caller decides on the variant (a duplicate insert, a
//! busy file, a data dir in use), never on the message, and a person reads the `Display` in the
//! log or on stderr.
//!
//! Each backend sorts its driver's errors once, in its own `error` file, into what happened: the
//! store was busy or could not be reached, a row did not read back, the backend failed otherwise.
//! No variant carries a database password: a PostgreSQL URL is held redacted
//! (`postgres::redact_url`).

use std::path::{Path, PathBuf};

use unyolo_admission::engine::OperationState;

/// Why the store could not do what was asked.
#[derive(Debug)]
pub enum StoreError {
    /// The store would not take the statement in time: another connection or process held the
    /// database locked past the busy timeout (SQLite's `BUSY` or `LOCKED`). Nothing changed; the
    /// same call may succeed later.
    Busy(rusqlite::Error),
    /// No reader connection came free (or could be opened) within the pool's timeout.
    NoReader {
        /// The database file.
        path: PathBuf,
        /// Why the pool gave none.
        source: r2d2::Error,
    },
    /// SQLite failed otherwise (I/O, a full disk, a damaged file, a constraint), with its detail.
    Sqlite(rusqlite::Error),
    /// PostgreSQL could not be reached or did not answer in time: no pooled connection came free
    /// (or could be opened) within the pool's timeout, the server refused or cut the connection,
    /// is shutting down or starting, or is a read-only standby. Nothing is known to have changed;
    /// the same call may succeed later (the broker answers 503 with `Retry-After`).
    Unavailable {
        /// The database, as its URL with the password redacted.
        database: String,
        /// What happened.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// PostgreSQL failed a statement otherwise (a constraint, a type, a permission), with its
    /// detail (the server's SQLSTATE is in it: `tokio_postgres::Error::code`).
    Postgres(tokio_postgres::Error),
    /// A stored row does not read back as a record: a state this code does not know, a JSON
    /// column that does not parse, a column of another type.
    CorruptRow(Box<dyn std::error::Error + Send + Sync>),
    /// A store location (a PostgreSQL URL) that does not parse or names a setting this broker
    /// cannot honour.
    BadLocation {
        /// The location, with any password redacted.
        location: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A file or directory of the data dir could not be created, opened, locked or written.
    Io {
        /// What was tried: `create`, `open`, `lock`, `write`, `measure` (its free space).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// The filesystem holding the data dir has less free space than a write may need
    /// ([`MIN_FREE_BYTES`](super::MIN_FREE_BYTES)): SQLite would fail it half-way, so the
    /// store is not ready.
    NoRoom {
        /// The data dir.
        dir: PathBuf,
        /// The bytes this process may still write on its filesystem.
        available: u64,
        /// The bytes a write may need.
        needed: u64,
    },
    /// Another broker holds the data dir: its lock file is locked.
    DirInUse {
        /// The data dir.
        dir: PathBuf,
        /// The lock file in it.
        lock: PathBuf,
    },
    /// The database was written by a newer broker: its schema version is not one this code
    /// knows.
    UnknownSchema {
        /// The database: a file's path, or a PostgreSQL URL with the password redacted.
        store: String,
        /// Its `user_version`.
        found: i64,
        /// The version this broker knows.
        supported: i64,
    },
    /// The operation's row was not in the state the change moves it from: something else moved
    /// it first.
    NotInState {
        /// The operation.
        id: String,
        /// The state the change expected.
        expected: OperationState,
    },
    /// The operation belongs to another replica of the fleet now (it took the work over while
    /// this one's membership had lapsed): this replica must not start it.
    TakenOver {
        /// The operation.
        id: String,
    },
    /// The store and what the broker knows of it disagree (a row the store just reported is
    /// gone).
    Inconsistent(String),
    /// A task doing store work did not finish: it panicked or was cancelled.
    Unfinished {
        /// The work, e.g. `the store task`.
        task: &'static str,
        /// How the task ended.
        source: tokio::task::JoinError,
    },
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("store: ")?;
        match self {
            StoreError::Busy(err) => write!(f, "the database is busy: {err}"),
            StoreError::NoReader { path, source } => {
                write!(f, "no reader connection on {}: {source}", path.display())
            }
            StoreError::Sqlite(err) => write!(f, "{err}"),
            StoreError::Unavailable { database, source } => {
                write!(f, "the database {database} is unavailable: {source}")
            }
            StoreError::Postgres(err) => write!(f, "{err}"),
            StoreError::CorruptRow(err) => write!(f, "a stored row does not read back: {err}"),
            StoreError::BadLocation { location, detail } => {
                write!(f, "the store location {location} is not usable: {detail}")
            }
            StoreError::Io {
                action,
                path,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            StoreError::NoRoom {
                dir,
                available,
                needed,
            } => write!(
                f,
                "the filesystem holding the data dir {} has {available} bytes free, fewer than the {needed} a write may need; free space on it or move --data",
                dir.display()
            ),
            StoreError::DirInUse { dir, lock } => write!(
                f,
                "the data dir {} is in use by another broker (it holds {}); stop it or choose another --data",
                dir.display(),
                lock.display()
            ),
            StoreError::UnknownSchema {
                store,
                found,
                supported,
            } => write!(
                f,
                "{store} has schema version {found}; this broker knows version {supported} \
                 (a newer broker wrote it: run that version)",
            ),
            StoreError::NotInState { id, expected } => {
                write!(f, "operation {id} is not {expected} in the store")
            }
            StoreError::TakenOver { id } => write!(
                f,
                "operation {id} was taken over by another replica of the fleet (this one's \
                 membership of the store had lapsed)"
            ),
            StoreError::Inconsistent(detail) => f.write_str(detail),
            StoreError::Unfinished { task, source } => write!(f, "{task} did not finish: {source}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Busy(err) | StoreError::Sqlite(err) => Some(err),
            StoreError::CorruptRow(err) => Some(err.as_ref()),
            StoreError::Unavailable { source, .. } => Some(source.as_ref()),
            StoreError::Postgres(err) => Some(err),
            StoreError::NoReader { source, .. } => Some(source),
            StoreError::Io { source, .. } => Some(source),
            StoreError::Unfinished { source, .. } => Some(source),
            StoreError::DirInUse { .. }
            | StoreError::NoRoom { .. }
            | StoreError::UnknownSchema { .. }
            | StoreError::BadLocation { .. }
            | StoreError::NotInState { .. }
            | StoreError::TakenOver { .. }
            | StoreError::Inconsistent(_) => None,
        }
    }
}

impl StoreError {
    /// [`StoreError::Inconsistent`] with this description: for a caller with nothing more
    /// specific to say (prefer a variant that names what happened).
    pub fn new(detail: impl Into<String>) -> StoreError {
        StoreError::Inconsistent(detail.into())
    }

    /// [`StoreError::Io`]: `action` (`create`, `open`, `lock`, `write`) on `path` failed.
    pub fn io(action: &'static str, path: &Path, source: std::io::Error) -> StoreError {
        StoreError::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }

    /// Whether the same call may succeed later without anything changing here: the store was
    /// busy or unreachable for a moment (the broker answers 503 with `Retry-After`).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Busy(_) | StoreError::NoReader { .. } | StoreError::Unavailable { .. }
        )
    }

    /// [`StoreError::Unfinished`]: the task doing `task` (e.g. `the filter rebuild`) ended
    /// without an answer.
    pub fn unfinished(task: &'static str, source: tokio::task::JoinError) -> StoreError {
        StoreError::Unfinished { task, source }
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
