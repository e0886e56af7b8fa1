//! What went wrong in the store, as values: the store's callers decide on them, and a person
//! reads them in the log.

/// Why the store could not do what was asked.
#[derive(Debug)]
pub struct StoreError(pub(super) String);

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
