//! The store in one SQLite file (WAL, `synchronous=FULL`) under the data dir: the embedded
//! default for one process.
//!
//! SQLite is blocking, so every call runs on tokio's blocking pool. Writes go through one
//! connection; reads (replay lookups, gets, list pages, waits) through a small pool of reader
//! connections ([`READERS`]), so a read never queues behind an `fsync` nor behind another read.
//!
//! One broker owns a data dir: opening takes an exclusive lock on [`LOCK_FILE`](super::LOCK_FILE)
//! and holds it while any handle on the database lives. Two brokers on one dir would both restore,
//! count and execute the same operations, so the second is refused at start-up instead.
//!
//! - `database`: the handle (opening, the data dir's lock, the write connection and the reader
//!   pool);
//! - `schema`: the tables, their indexes and the migrations from older files;
//! - `group`: group commit, the creations and state changes that reach the writer together
//!   committed in one transaction;
//! - `operations`: the operation rows (insert, lookups, state changes, listing pages, start-up
//!   recovery);
//! - `streams`, `decisions`, `requests`, `events`, `maintenance`: the statements of each
//!   concern (`store` says what each means);
//! - `error`: SQLite's errors sorted into the store's.

mod bell;
mod database;
mod decisions;
mod error;
mod events;
mod group;
mod maintenance;
mod operations;
mod requests;
mod schema;
mod streams;

use std::path::PathBuf;
use std::time::SystemTime;

use async_trait::async_trait;

use super::bell::EventBell;
use super::decisions::{DecisionCommand, DecisionOutcome};
use super::durable::{Derive, DurableStore, Judge, Render};
use super::error::{InsertError, StoreError};
use super::events::{EventPage, StoredEvent};
use super::maintenance::{Retiring, StoredCounts};
use super::records::OperationTimes;
use super::records::{
    OperationRecord, OperationSummary, PageQuery, Recovered, StateChange, StoredRequest,
};
use super::requests::RequestQuery;
use super::streams::StreamRecord;
use unyolo_admission::engine::OperationState;

pub use database::{DATABASE_FILE, MIN_FREE_BYTES, READERS, SqliteStore};
pub use schema::SCHEMA_VERSION;

/// Runs blocking store work off the async threads.
async fn blocking<T: Send + 'static>(
    store: &SqliteStore,
    f: impl FnOnce(&SqliteStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| StoreError::unfinished("the store task", e))?
}

#[async_trait]
impl DurableStore for SqliteStore {
    fn broker(&self) -> &str {
        SqliteStore::broker(self)
    }

    fn is_request(&self, operation: &str) -> bool {
        SqliteStore::is_request(self, operation)
    }

    fn event_bell(&self) -> &EventBell {
        SqliteStore::event_bell(self)
    }

    fn streams_dir(&self) -> PathBuf {
        SqliteStore::streams_dir(self)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        SqliteStore::ping(self).await
    }

    async fn fill_derived(&self, derive: Derive) -> Result<u64, StoreError> {
        blocking(self, move |db| db.fill_derived(derive)).await
    }

    async fn recover(&self) -> Result<Recovered, StoreError> {
        blocking(self, SqliteStore::recover).await
    }

    async fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError> {
        blocking(self, move |db| db.created_since(since)).await
    }

    async fn history(&self) -> Result<Vec<OperationTimes>, StoreError> {
        blocking(self, SqliteStore::history).await
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        blocking(self, SqliteStore::key_count).await
    }

    async fn keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        blocking(self, |db| {
            let mut keys = Vec::new();
            db.for_each_key(|client, key| keys.push((client.to_owned(), key.to_owned())))?;
            Ok(keys)
        })
        .await
    }

    async fn key_records(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        SqliteStore::key_records(self).await
    }

    async fn insert(&self, record: OperationRecord) -> Result<(), InsertError> {
        SqliteStore::insert(self, record).await
    }

    async fn request_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<StoredRequest>, StoreError> {
        SqliteStore::request_by_key(self, client_id, key).await
    }

    async fn request_of(&self, id: &str) -> Result<Option<StoredRequest>, StoreError> {
        SqliteStore::request_of(self, id).await
    }

    async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        SqliteStore::get(self, id).await
    }

    async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationSummary)>, StoreError> {
        SqliteStore::list_page(self, client_id, query).await
    }

    async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        change: StateChange,
    ) -> Result<Option<OperationRecord>, StoreError> {
        SqliteStore::set_state(self, id, from, to, change).await
    }

    async fn request_page(&self, query: RequestQuery) -> Result<Vec<OperationRecord>, StoreError> {
        SqliteStore::request_page(self, query).await
    }

    async fn decide_judged(
        &self,
        command: DecisionCommand,
        judge: Judge,
        render: Render,
    ) -> Result<DecisionOutcome<()>, StoreError> {
        SqliteStore::decide(self, command, judge, render).await
    }

    async fn count_decisions(&self) -> Result<u64, StoreError> {
        SqliteStore::count_decisions(self).await
    }

    async fn events_after(&self, after: Option<i64>, limit: u32) -> Result<EventPage, StoreError> {
        SqliteStore::events_after(self, after, limit).await
    }

    async fn events_of(&self, id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        SqliteStore::events_of(self, id).await
    }

    async fn count_events(&self) -> Result<u64, StoreError> {
        SqliteStore::count_events(self).await
    }

    async fn trim_events(
        &self,
        keep: u32,
        cutoff: Option<String>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        SqliteStore::trim_events(self, keep, cutoff, batch).await
    }

    async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError> {
        SqliteStore::insert_stream(self, stream).await
    }

    async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError> {
        SqliteStore::get_stream(self, id).await
    }

    async fn delete_stream(&self, id: &str) -> Result<bool, StoreError> {
        SqliteStore::delete_stream(self, id).await
    }

    async fn stream_ids(&self) -> Result<Vec<(String, String)>, StoreError> {
        SqliteStore::stream_ids(self).await
    }

    async fn counts(&self) -> Result<StoredCounts, StoreError> {
        SqliteStore::counts(self).await
    }

    async fn count_operations(&self) -> Result<u64, StoreError> {
        SqliteStore::count_operations(self).await
    }

    async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError> {
        SqliteStore::operations_by_state(self).await
    }

    async fn live_states(&self) -> Result<Vec<(String, OperationState)>, StoreError> {
        SqliteStore::live_states(self).await
    }

    async fn retiring(&self, cutoff: String, limit: u32) -> Result<Vec<Retiring>, StoreError> {
        SqliteStore::retiring(self, cutoff, limit).await
    }

    async fn retire(&self, batch: Vec<Retiring>) -> Result<u64, StoreError> {
        SqliteStore::retire(self, batch).await
    }

    async fn release_space(&self, step: u32) -> Result<u64, StoreError> {
        SqliteStore::return_free_pages(self, step).await
    }

    async fn checkpoint(&self) -> Result<(), StoreError> {
        SqliteStore::checkpoint(self).await
    }

    fn sizes(&self) -> Vec<(&'static str, u64)> {
        let (database, wal) = SqliteStore::file_bytes(self);
        vec![("database", database), ("wal", wal)]
    }
}

/// What only SQLite has: the data dir's lock, the file's schema version, a file another process
/// holds locked. The store's semantics, the same in both houses, are tested once for both in
/// `tests/store_conformance.rs`.
#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::*;

    #[test]
    fn a_second_open_of_a_data_dir_is_refused_as_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = SqliteStore::open(dir.path()).unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err();
        let StoreError::DirInUse { dir: in_use, lock } = &err else {
            panic!("not DirInUse: {err}");
        };
        assert_eq!(in_use, dir.path());
        assert_eq!(lock, &dir.path().join(super::super::dir_lock::LOCK_FILE));
        assert!(
            err.to_string().contains("in use by another broker"),
            "{err}"
        );
    }

    #[test]
    fn a_file_from_a_newer_broker_is_an_unknown_schema() {
        let dir = tempfile::tempdir().unwrap();
        Connection::open(dir.path().join(DATABASE_FILE))
            .unwrap()
            .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, StoreError::UnknownSchema { found, .. } if found == SCHEMA_VERSION + 1),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_store_another_connection_holds_locked_is_busy() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path()).unwrap();
        let holder = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        holder.execute_batch("BEGIN IMMEDIATE").unwrap();
        // The write waits out its busy timeout, then gives up.
        let err = db.ping().await.unwrap_err();
        assert!(matches!(err, StoreError::Busy(_)), "{err}");
        holder.execute_batch("ROLLBACK").unwrap();
        db.ping().await.unwrap();
    }
}
