//! What a replica's own store gives back to the shared store after Redis forgot the deployment
//! (a restart without persistence, a flush, a failover to a Redis that lacks the state): the
//! idempotency records of the operations it holds and its clients' recent admissions. The embedder implements [`RecoverySource`] over its store; the
//! admission calls it only when Redis lacks this replica's part of the deployment's state.

use std::time::Duration;

use super::outcome::RestoredOperation;
use crate::config::Identity;
use crate::engine::OperationState;

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

    /// For a store the whole fleet shares (every replica's operations in one database): what it
    /// knows of every replica, so that one replica rebuilds, after Redis forgot, the work of the
    /// replicas that have not registered again (a replica that died a moment before, say),
    /// instead of leaving it uncounted until its work is taken over. `within` is as for
    /// [`recent_admissions`](RecoverySource::recent_admissions). `None` (the default) for a store
    /// that holds only this replica's operations: then each replica registers its own work, and
    /// only the [`ReplicaOptions::replicas`](crate::ReplicaOptions::replicas) list tells who the
    /// fleet is. A source that answers `Some` must answer
    /// [`states`](RecoverySource::states) too.
    fn fleet(&self, within: Duration) -> SourceFuture<'_, Option<FleetReading>> {
        let _ = within;
        Box::pin(async { Ok(None) })
    }

    /// The live operations (pending, approved or executing) whose rows this replica owns in the
    /// store now, each in its stored state; `None` (the default) when the store cannot tell,
    /// and then a registration counts everything this replica holds, as it always did.
    ///
    /// Read at every registration after the operations this replica holds are listed (at
    /// start-up, after a lapsed lease, after Redis forgot, at a takeover, at a drift's heal): an
    /// operation it held committed when the list was taken, and that this answer lacks, has
    /// ended or is another replica's now (decided and run elsewhere, or taken over while this
    /// one was paused or cut off past its lease), so the registration does not count it under
    /// this replica's name. Its handle is still live here until the embedder lets it go: end it
    /// if its row ended ([`OperationHandle::fail`](crate::OperationHandle::fail) releases
    /// everything), or [`OperationHandle::hand_over`](crate::OperationHandle::hand_over) it if
    /// another replica owns it now. Answer from the store as it is at the call, and commit a
    /// permit only once its row is written (the order the crate asks anyway), or a commit
    /// between the list and this reading would be taken for an operation that ended.
    fn owned_live(&self) -> SourceFuture<'_, Option<Vec<(String, OperationState)>>> {
        Box::pin(async { Ok(None) })
    }

    /// Of `replicas` (whose leases in Redis lapsed), those that still own live operations in a
    /// store the whole fleet shares; `None` (the default) for a store of this replica's own.
    ///
    /// A lapsed replica is reaped (what it held released in Redis) only once it owns no live
    /// work in the store: until a survivor has taken that work over there (and moved it to
    /// itself in Redis by the registration that counts it), it stays counted under the lapsed
    /// replica's name, so no other client is admitted into the room it still takes in the
    /// store. What it held and no longer owns (work that ended, or was interrupted by the
    /// takeover) is released then. A store that does not answer spares every one of them this
    /// time (the next heartbeat asks again): refusing more, never admitting more.
    fn still_owning(&self, replicas: Vec<String>) -> SourceFuture<'_, Option<Vec<String>>> {
        let _ = replicas;
        Box::pin(async { Ok(None) })
    }

    /// The stored state of each of `ids` now, read after a rebuild from [`fleet`]'s reading was
    /// counted, so that what moved in between (a decision taken on another replica, say) is
    /// moved in the counts too. An id missing from the answer has no row any more. The default
    /// (for a source without [`fleet`]) cannot tell, and says so.
    ///
    /// [`fleet`]: RecoverySource::fleet
    fn states(&self, ids: Vec<String>) -> SourceFuture<'_, Vec<(String, OperationState)>> {
        let _ = ids;
        Box::pin(async { Err("this recovery source reads no fleet".to_owned()) })
    }
}

/// What a store the whole fleet shares knows of it ([`RecoverySource::fleet`]).
#[derive(Clone, Debug, Default)]
pub struct FleetReading {
    /// The replicas serving the store now (their membership live), this one included: the whole
    /// fleet. A replica not named here holds no permit that could still be committed, so the
    /// recovery window after Redis forgot waits for these only.
    pub members: Vec<String>,
    /// Every live operation in the store (pending, approved or executing), with the replica
    /// that owns it.
    pub live: Vec<(String, RestoredOperation)>,
    /// The admissions within the window asked for, each with the replica that made it (owns
    /// it), its client and its age.
    pub admissions: Vec<(String, Identity, Duration)>,
}

/// What a [`RecoverySource`] answers: its reading, or why it could not be read.
pub type SourceFuture<'a, T> =
    std::pin::Pin<Box<dyn Future<Output = Result<T, String>> + Send + 'a>>;
