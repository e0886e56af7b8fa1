//! What the store reports for the checks that keep it honest and bounded: the counts the drift
//! check compares with the controller's, and the rows retention retires.

use unyolo_admission::engine::OperationState;

/// What the store holds, for the drift check: operation rows by client and non-terminal state,
/// and stream files and bytes by client, read in one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredCounts {
    /// (client, state, rows) for the pending, approved and executing operations.
    pub operations: Vec<(String, OperationState, u64)>,
    /// (client, files, bytes) of the stored streams.
    pub streams: Vec<(String, u64, u64)>,
}

/// A terminal operation the retention sweep is about to retire: its row and its idempotency key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retiring {
    /// The row's sequence number.
    pub seq: i64,
    /// Its client.
    pub client: String,
    /// Its idempotency key.
    pub key: String,
    /// Its id.
    pub id: String,
}
