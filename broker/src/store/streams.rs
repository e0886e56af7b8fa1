//! A stored stream: its owner and size, recorded with its body so the storage quotas are rebuilt
//! from the store at start-up like the operation counts.

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
