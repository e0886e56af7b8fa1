//! Where a store lives, and opening the one a location names: the one place that knows which
//! backends there are.

use std::path::PathBuf;
use std::sync::Arc;

use super::durable::DurableStore;
use super::error::StoreError;
use super::sqlite::SqliteStore;

/// Where a store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file in this data dir (created if needed), owned by one broker.
    Dir(PathBuf),
}

/// Opens the store at `location` (creating its schema, or migrating an older one), with
/// operations showing `broker` as their broker's name and the changes of the operations named
/// in `requests` (those that need an operator's approval) recorded in the event log.
pub async fn open(
    location: &StoreLocation,
    broker: &str,
    requests: impl IntoIterator<Item = &str>,
) -> Result<Arc<dyn DurableStore>, StoreError> {
    let requests: Vec<String> = requests.into_iter().map(str::to_owned).collect();
    match location {
        StoreLocation::Dir(dir) => {
            let (dir, broker) = (dir.clone(), broker.to_owned());
            let store = tokio::task::spawn_blocking(move || {
                SqliteStore::open_as(&dir, &broker)
                    .map(|db| db.with_requests(requests.iter().map(String::as_str)))
            })
            .await
            .map_err(|e| StoreError::unfinished("opening the store", e))??;
            Ok(Arc::new(store))
        }
    }
}
