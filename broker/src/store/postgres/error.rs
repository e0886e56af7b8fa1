//! PostgreSQL's errors sorted once, here, into the store's: the server could not be reached or
//! is not taking work ([`StoreError::Unavailable`]), a row did not read back
//! ([`StoreError::CorruptRow`]), or a statement failed otherwise ([`StoreError::Postgres`]).
//! Always by the error's kind and SQLSTATE, never by its message.

use tokio_postgres::error::SqlState;

use super::super::error::StoreError;

/// The unique constraint on an operation's (client, idempotency key): a violation of it is a
/// duplicate submission.
pub(super) const CLIENT_KEY_CONSTRAINT: &str = "operations_client_key";

/// Whether `code` says the server cannot take work now (connection trouble, shutting down or
/// starting, out of connections or resources): the same call may succeed later.
fn unavailable_code(code: &SqlState) -> bool {
    let text = code.code();
    // Class 08: connection exception; 53: insufficient resources; 57P0x: operator intervention
    // (admin shutdown, crash shutdown, cannot connect now); 25006: a read-only transaction (a
    // standby, or a primary demoted under us).
    // 55P03: a lock not granted within `lock_timeout` (another session holds the rows or a
    // table: busy, as SQLite's busy timeout); 40001 and 40P01: a serialization failure or a
    // deadlock the server broke (nothing committed; the same call may go through).
    text.starts_with("08")
        || text.starts_with("53")
        || matches!(
            text,
            "57P01" | "57P02" | "57P03" | "25006" | "55P03" | "40001" | "40P01"
        )
}

/// Sorts `err` from a statement or a connection to `database` (shown redacted).
pub(super) fn sort(database: &str, err: tokio_postgres::Error) -> StoreError {
    let unavailable = match err.code() {
        Some(code) => unavailable_code(code),
        // No SQLSTATE: the connection was closed, or failed at the socket or TLS (refused,
        // cut, timed out); anything else (a value that does not convert, a protocol surprise)
        // is a failure of the statement.
        None => {
            err.is_closed()
                || std::error::Error::source(&err).is_some_and(|s| s.is::<std::io::Error>())
        }
    };
    if unavailable {
        return StoreError::Unavailable {
            database: database.to_owned(),
            source: Box::new(err),
        };
    }
    if matches!(
        err.code(),
        Some(code) if *code == SqlState::INVALID_TEXT_REPRESENTATION
    ) {
        return StoreError::CorruptRow(Box::new(err));
    }
    StoreError::Postgres(err)
}

/// Sorts a pool's failure to hand out a connection.
pub(super) fn sort_pool(database: &str, err: deadpool_postgres::PoolError) -> StoreError {
    match err {
        deadpool_postgres::PoolError::Backend(err) => sort(database, err),
        other => StoreError::Unavailable {
            database: database.to_owned(),
            source: Box::new(other),
        },
    }
}

/// Whether `err` is the insert of a (client, idempotency key) the table already holds.
pub(super) fn is_duplicate_key(err: &tokio_postgres::Error) -> bool {
    err.as_db_error().is_some_and(|db| {
        *db.code() == SqlState::UNIQUE_VIOLATION && db.constraint() == Some(CLIENT_KEY_CONSTRAINT)
    })
}

/// A value in a row that does not read back as the record's field.
pub(super) fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::CorruptRow(what.into().into())
}

/// Why a transaction's work stopped: a statement failed, or a row did not read back.
pub(super) enum Failed {
    /// A statement failed.
    Statement(tokio_postgres::Error),
    /// A row did not read back, or no connection came.
    Store(StoreError),
}

impl From<tokio_postgres::Error> for Failed {
    fn from(err: tokio_postgres::Error) -> Failed {
        Failed::Statement(err)
    }
}

impl From<StoreError> for Failed {
    fn from(err: StoreError) -> Failed {
        Failed::Store(err)
    }
}
