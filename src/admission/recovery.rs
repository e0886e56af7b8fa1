//! What a replica's own store gives back to the shared store after Redis forgot the deployment
//! (a restart without persistence, a flush, a failover to a Redis that lacks the state): the
//! idempotency records of the operations it holds and its clients' recent admissions. The embedder implements [`RecoverySource`] over its store; the
//! admission calls it only when Redis lacks this replica's part of the deployment's state.

use std::time::Duration;

use crate::config::Identity;

/// One idempotency record: the client's key bound to its operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    /// The client.
    pub client: Identity,
    /// Its idempotency key.
    pub key: String,
    /// The operation the key names.
    pub operation: String,
}

/// Where a replica finds, in its own store, what Redis needs again after it forgot the
/// deployment: the idempotency records of every operation it holds (live and retained), and its
/// clients' recent admissions (to rebuild the rate buckets, as a restart does). Set with
/// [`super::Admission::set_recovery_source`].
pub trait RecoverySource: Send + Sync + 'static {
    /// Every operation the store holds: (client, idempotency key, operation id).
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>>;
    /// The admissions made on this replica within `within`, as (client, age). `within` is the
    /// longest rate window of the configuration in force when Redis forgot
    /// ([`Config::longest_window`](crate::Config::longest_window)), which a reload may have made
    /// longer than it was at start-up: read it from here, never a window kept from before.
    /// Admissions older than `within` may be included; they are ignored.
    fn recent_admissions(&self, within: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>>;
}

/// What a [`RecoverySource`] answers: its reading, or why it could not be read.
pub type SourceFuture<'a, T> =
    std::pin::Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;
