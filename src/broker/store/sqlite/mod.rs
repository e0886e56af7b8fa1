//! The store in one SQLite file (WAL, `synchronous=FULL`) under the data dir: the embedded
//! default for one process.
//!
//! SQLite is blocking, so every call runs on tokio's blocking pool. Writes go through one
//! connection; reads (replay lookups, gets, list pages, waits) through a small pool of reader
//! connections ([`READERS`]), so a read never queues behind an `fsync` nor behind another read.
//!
//! One broker owns a data dir: opening takes an exclusive lock on [`LOCK_FILE`] and holds it while
//! any handle on the database lives. Two brokers on one dir would both restore, count and execute
//! the same operations, so the second is refused at start-up instead.
//!
//! - `database`: the handle (opening, the data dir's lock, the write connection and the reader
//!   pool);
//! - `schema`: the tables, their indexes and the migrations from older files;
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
use super::records::{
    OperationRecord, OperationSummary, PageQuery, Recovered, StateChange, StoredRequest,
};
use super::requests::RequestQuery;
use super::streams::StreamRecord;
use crate::engine::OperationState;

pub use database::{DATABASE_FILE, LOCK_FILE, MIN_FREE_BYTES, READERS, SqliteStore};
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

#[cfg(test)]
mod tests {
    use super::super::events::{EventKind, RequestStatus};
    use super::super::records::{OperationRecord, PageQuery, Presentation, now_rfc3339};
    use rusqlite::Connection;

    use super::*;
    use crate::engine::OperationState;

    fn record(id: &str, key: &str) -> OperationRecord {
        let now = now_rfc3339();
        OperationRecord {
            client_id: "bot-7".to_owned(),
            idempotency_key: key.to_owned(),
            operation: "demo.run".to_owned(),
            created_at: now.clone(),
            updated_at: now,
            presentation: Presentation {
                title: format!("Run {id}"),
                summary: None,
            },
            ..OperationRecord::example(id)
        }
    }

    #[test]
    fn a_second_open_of_a_data_dir_is_refused_as_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let _first = SqliteStore::open(dir.path()).unwrap();
        let err = SqliteStore::open(dir.path()).unwrap_err();
        let StoreError::DirInUse { dir: in_use, lock } = &err else {
            panic!("not DirInUse: {err}");
        };
        assert_eq!(in_use, dir.path());
        assert_eq!(lock, &dir.path().join(LOCK_FILE));
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
    async fn a_second_insert_of_a_key_is_a_duplicate() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path()).unwrap();
        db.insert(record("op_1", "k")).await.unwrap();
        let again = db.insert(record("op_2", "k")).await;
        assert!(matches!(again, Err(InsertError::Duplicate)), "{again:?}");
    }

    #[tokio::test]
    async fn a_row_in_an_unknown_state_reads_back_as_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path()).unwrap();
        db.load(&[record("op_1", "k")]).unwrap();
        Connection::open(dir.path().join(DATABASE_FILE))
            .unwrap()
            .execute("UPDATE operations SET state = 'mislaid'", [])
            .unwrap();
        let err = db.get("op_1").await.unwrap_err();
        assert!(matches!(err, StoreError::CorruptRow(_)), "{err}");
    }

    #[tokio::test]
    async fn a_listing_page_reads_no_request_and_a_lookup_no_request_text() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path()).unwrap();
        db.load(&[record("op_1", "k")]).unwrap();
        // Whatever the stored request holds, a page and a request lookup never parse it.
        Connection::open(dir.path().join(DATABASE_FILE))
            .unwrap()
            .execute(
                "UPDATE operations SET target = 'not json', arguments = '{broken'",
                [],
            )
            .unwrap();
        let query = PageQuery {
            limit: 10,
            ..PageQuery::default()
        };
        let page = db.list_page("bot-7", query).await.unwrap();
        assert_eq!(page.len(), 1);
        assert_eq!(page[0].1.presentation.title, "Run op_1");
        let stored = db.request_by_key("bot-7", "k").await.unwrap().unwrap();
        assert_eq!((stored.id.as_str(), stored.bytes), ("op_1", 8 + 7));
        assert_eq!(stored.digest.len(), 64);
        // The whole operation does parse it.
        let err = db.get("op_1").await.unwrap_err();
        assert!(matches!(err, StoreError::CorruptRow(_)), "{err}");
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

    fn request(i: usize, operation: &str) -> OperationRecord {
        let now = now_rfc3339();
        OperationRecord {
            client_id: "bot-7".to_owned(),
            idempotency_key: format!("k{i}"),
            operation: operation.to_owned(),
            reason: "r".to_owned(),
            created_at: now.clone(),
            updated_at: now,
            presentation: Presentation {
                title: format!("Request {i}"),
                summary: None,
            },
            ..OperationRecord::example(&format!("op_{i:032}"))
        }
    }

    fn events_of(page: EventPage) -> Vec<StoredEvent> {
        match page {
            EventPage::Events { events, .. } => events,
            EventPage::Expired => panic!("expired"),
        }
    }

    #[tokio::test]
    async fn each_change_of_a_request_writes_one_event_and_other_work_none() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path())
            .unwrap()
            .with_requests(["demo.request"]);
        let mut bell = db.event_bell().subscribe();
        db.insert(request(1, "demo.request")).await.unwrap();
        db.insert(request(2, "demo.run")).await.unwrap();
        assert_eq!(*bell.borrow_and_update(), 1, "rung after the commit");
        let moved = db
            .set_state(
                &request(1, "").id,
                OperationState::Pending,
                OperationState::Approved,
                StateChange::default(),
            )
            .await
            .unwrap();
        assert!(moved.is_some());
        // A move from a state the row is not in changes nothing and writes nothing.
        let stale = db
            .set_state(
                &request(1, "").id,
                OperationState::Pending,
                OperationState::Denied,
                StateChange::default(),
            )
            .await
            .unwrap();
        assert!(stale.is_none());
        db.set_state(
            &request(2, "").id,
            OperationState::Pending,
            OperationState::Canceled,
            StateChange::default(),
        )
        .await
        .unwrap();
        db.set_state(
            &request(1, "").id,
            OperationState::Approved,
            OperationState::Canceled,
            StateChange::default(),
        )
        .await
        .unwrap();
        let events = events_of(db.events_after(None, 100).await.unwrap());
        let got: Vec<_> = events
            .iter()
            .map(|e| (e.seq, e.kind, e.revision, e.status, e.used_count))
            .collect();
        assert_eq!(
            got,
            [
                (1, EventKind::RequestCreated, 1, RequestStatus::Pending, 0),
                (2, EventKind::RequestApproved, 2, RequestStatus::Active, 0),
                (3, EventKind::GrantRevoked, 3, RequestStatus::Revoked, 0),
            ]
        );
        assert_eq!(db.event_bell().newest(), 3);
        assert_eq!(db.event_bell().written().get(), 3);
        let stored = db.get(&request(1, "").id).await.unwrap().unwrap();
        assert_eq!(stored.ended_from, Some(OperationState::Approved));
    }

    #[tokio::test]
    async fn trimming_keeps_the_newest_as_a_gapless_suffix_and_older_cursors_expire() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path())
            .unwrap()
            .with_requests(["demo.request"]);
        for i in 0..30 {
            db.insert(request(i, "demo.request")).await.unwrap();
        }
        let mut trimmed = 0;
        loop {
            let n = db.trim_events(10, None, 7).await.unwrap();
            trimmed += n;
            if n < 7 {
                break;
            }
        }
        assert_eq!(trimmed, 20);
        assert_eq!(db.count_events().await.unwrap(), 10);
        let left = events_of(db.events_after(None, 100).await.unwrap());
        assert_eq!(
            left.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (21..=30).collect::<Vec<_>>()
        );
        assert_eq!(
            db.events_after(Some(19), 100).await.unwrap(),
            EventPage::Expired
        );
        assert_eq!(
            events_of(db.events_after(Some(20), 100).await.unwrap()).len(),
            10
        );
        assert_eq!(
            events_of(db.events_after(Some(30), 100).await.unwrap()).len(),
            0
        );
        // With a cutoff after every event, all go; then only the newest cursor still resumes.
        let later = humantime::format_rfc3339_millis(
            std::time::SystemTime::now() + std::time::Duration::from_secs(60),
        )
        .to_string();
        assert_eq!(db.trim_events(10, Some(later), 100).await.unwrap(), 10);
        assert_eq!(
            db.events_after(Some(29), 100).await.unwrap(),
            EventPage::Expired
        );
        assert_eq!(
            db.events_after(Some(30), 100).await.unwrap(),
            EventPage::Events {
                after: 30,
                events: vec![],
                more: false
            }
        );
        assert_eq!(
            db.events_after(None, 100).await.unwrap(),
            EventPage::Events {
                after: 30,
                events: vec![],
                more: false
            },
            "an empty cursor goes on from the high-water mark"
        );
    }
}
