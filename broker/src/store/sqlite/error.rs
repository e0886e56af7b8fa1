//! SQLite reports every failure as one error type; [`StoreError::from`] sorts it once, here, into
//! what happened: the file was busy, a row did not read back, or SQLite failed otherwise.

use rusqlite::ErrorCode;

use super::super::error::StoreError;

impl From<rusqlite::Error> for StoreError {
    /// Sorts SQLite's error by what happened: busy or locked, a row that does not convert, or
    /// anything else SQLite reports.
    fn from(err: rusqlite::Error) -> StoreError {
        if let Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) = err.sqlite_error_code() {
            return StoreError::Busy(err);
        }
        match err {
            rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::IntegralValueOutOfRange(..) => StoreError::CorruptRow(Box::new(err)),
            _ => StoreError::Sqlite(err),
        }
    }
}

/// Whether `err` is a `UNIQUE` constraint failing: an insert of a key the table already holds.
pub(super) fn is_unique_violation(err: &StoreError) -> bool {
    matches!(
        err,
        StoreError::Sqlite(rusqlite::Error::SqliteFailure(failure, _))
            if failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite_failure(code: std::os::raw::c_int) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None)
    }

    #[test]
    fn busy_and_locked_files_are_busy_not_a_failure() {
        assert!(matches!(
            StoreError::from(sqlite_failure(rusqlite::ffi::SQLITE_BUSY)),
            StoreError::Busy(_)
        ));
        assert!(matches!(
            StoreError::from(sqlite_failure(rusqlite::ffi::SQLITE_LOCKED)),
            StoreError::Busy(_)
        ));
        assert!(matches!(
            StoreError::from(sqlite_failure(rusqlite::ffi::SQLITE_IOERR)),
            StoreError::Sqlite(_)
        ));
    }

    #[test]
    fn only_a_unique_constraint_is_a_duplicate() {
        let unique = StoreError::from(sqlite_failure(rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE));
        assert!(is_unique_violation(&unique));
        let not_null = StoreError::from(sqlite_failure(rusqlite::ffi::SQLITE_CONSTRAINT_NOTNULL));
        assert!(!is_unique_violation(&not_null));
    }

    #[test]
    fn a_value_that_does_not_convert_is_a_corrupt_row() {
        let err =
            rusqlite::Error::InvalidColumnType(0, "state".into(), rusqlite::types::Type::Null);
        assert!(matches!(StoreError::from(err), StoreError::CorruptRow(_)));
    }
}
