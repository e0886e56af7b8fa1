//! The broker's store as a replica's [`RecoverySource`]: after the shared store forgot the
//! deployment, what this replica's store holds goes back to Redis with its holdings — the
//! idempotency key of every operation it keeps (live and retained), and its clients' admissions
//! within the longest rate window in force (read from the creation times, as a restart rebuilds
//! the in-process buckets: no extra write per admission). A store the fleet shares
//! (PostgreSQL) also answers for every replica ([`RecoverySource::fleet`]): its members, every
//! owned live operation and every owned recent admission, so one replica rebuilds the work of
//! those that have not registered again. At every registration it says which live rows are
//! still this replica's own ([`RecoverySource::owned_live`]), so work that ended or was taken
//! over elsewhere while this replica was paused is not counted under its name again.

use std::time::{Duration, SystemTime};

use std::sync::Arc;

use super::store::DurableStore;
use unyolo_admission::admission::{
    FleetReading, KeyRecord, RecoverySource, RestoredOperation, SourceFuture,
};
use unyolo_admission::config::Identity;
use unyolo_admission::engine::OperationState;

/// The store, read for a recovery.
pub(crate) struct StoreSource {
    db: Arc<dyn DurableStore>,
}

impl StoreSource {
    pub(crate) fn new(db: Arc<dyn DurableStore>) -> StoreSource {
        StoreSource { db }
    }
}

impl RecoverySource for StoreSource {
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>> {
        Box::pin(async move {
            let rows = self.db.key_records().await.map_err(|e| e.to_string())?;
            Ok(rows
                .into_iter()
                .filter_map(|(client, key, operation)| {
                    Some(KeyRecord {
                        client: Identity::new(&client).ok()?,
                        key,
                        operation,
                    })
                })
                .collect())
        })
    }

    fn recent_admissions(&self, within: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>> {
        Box::pin(async move {
            let now = SystemTime::now();
            let since = now.checked_sub(within).unwrap_or(SystemTime::UNIX_EPOCH);
            let created = self
                .db
                .created_since(since)
                .await
                .map_err(|e| e.to_string())?;
            Ok(created
                .into_iter()
                .filter_map(|(client, at)| {
                    // A creation time after now (the wall clock stepped back) counts as just now.
                    let age = now.duration_since(at).unwrap_or(Duration::ZERO);
                    Some((Identity::new(&client).ok()?, age))
                })
                .collect())
        })
    }

    fn fleet(&self, within: Duration) -> SourceFuture<'_, Option<FleetReading>> {
        Box::pin(async move {
            let now = SystemTime::now();
            let since = now.checked_sub(within).unwrap_or(SystemTime::UNIX_EPOCH);
            let Some(rows) = self.db.fleet_rows(since).await.map_err(|e| e.to_string())? else {
                return Ok(None);
            };
            // A client id or state that would not be a valid identity is not admission's to
            // count (it never admitted one); skipped, as the single-replica reading skips them.
            let live = rows
                .live
                .into_iter()
                .filter_map(|(owner, id, client, state)| {
                    let identity = Identity::new(&client).ok()?;
                    Some((
                        owner,
                        RestoredOperation {
                            id,
                            identity,
                            state,
                        },
                    ))
                })
                .collect();
            let admissions = rows
                .created
                .into_iter()
                .filter_map(|(owner, client, at)| {
                    let age = now.duration_since(at).unwrap_or(Duration::ZERO);
                    Some((owner, Identity::new(&client).ok()?, age))
                })
                .collect();
            Ok(Some(FleetReading {
                members: rows.members,
                live,
                admissions,
            }))
        })
    }

    fn still_owning(&self, replicas: Vec<String>) -> SourceFuture<'_, Option<Vec<String>>> {
        Box::pin(async move {
            self.db
                .still_owning(&replicas)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn owned_live(&self) -> SourceFuture<'_, Option<Vec<(String, OperationState)>>> {
        Box::pin(async move {
            self.db
                .live_states()
                .await
                .map(Some)
                .map_err(|e| e.to_string())
        })
    }

    fn states(&self, ids: Vec<String>) -> SourceFuture<'_, Vec<(String, OperationState)>> {
        Box::pin(async move { self.db.states_of(&ids).await.map_err(|e| e.to_string()) })
    }
}
