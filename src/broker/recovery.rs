//! The broker's store as a replica's [`RecoverySource`]: after the shared store forgot the
//! deployment, what this replica's store holds goes back to Redis with its holdings — the
//! idempotency key of every operation it keeps (live and retained), and its clients' admissions
//! within the longest rate window in force (read from the creation times, as a restart rebuilds
//! the in-process buckets: no extra write per admission).

use std::time::{Duration, SystemTime};

use std::sync::Arc;

use super::store::DurableStore;
use crate::admission::{KeyRecord, RecoverySource, SourceFuture};
use crate::config::Identity;

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
}
