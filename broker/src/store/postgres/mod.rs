//! The store in one PostgreSQL database for a fleet of replicas: every replica reads and writes
//! the same operations, decisions, streams and event log.
//!
//! **Why tokio-postgres (with a deadpool of connections), not sqlx.** The broker drops futures:
//! a client hangs up, a deadline passes. A dropped tokio-postgres future leaves its connection
//! consistent (the connection task owns the protocol state; what was sent is finished or its
//! answer discarded), and a `Transaction` dropped before its commit is rolled back, so a call
//! cut half-way commits nothing. It also costs less per statement (prepared statements cached
//! per connection, requests pipelined on one connection). The pool is bounded
//! ([`PostgresSettings::max_connections`], 16 by default) and a call waits for a connection at
//! most [`PostgresSettings::timeout`], then fails as [`StoreError::Unavailable`] (the broker's
//! 503 with `Retry-After`).
//!
//! **Same records, same rules as SQLite.** The tables hold the SQLite store's columns (JSON and
//! times as the same text), a state changes only in `operations::change_state`, and a
//! request's event is written in the transaction of its change. What differs is what a fleet
//! needs: the key's uniqueness is the table's constraint, across replicas; a decision locks its
//! request's row; the event log is numbered after commit so no reader skips an event (`events`);
//! every change is announced with `NOTIFY` and heard by each replica's listener (`listen`).
//!
//! - `location`: the URL (libpq's, `sslmode` included) and [`redact_url`];
//! - `tls`: rustls (ring) configured as `sslmode` says;
//! - `handle`: [`PostgresStore`], its pool and background tasks;
//! - `schema`: the tables, created and migrated at start-up under an advisory lock;
//! - `operations`, `decisions`, `requests`, `events`, `streams`, `maintenance`: the statements
//!   of each concern, and `rows`: the records they read back;
//! - `numbering`: a round of numbering the event log;
//! - `fleet`: who serves the store (each replica's membership lease);
//! - `listen`: the `LISTEN` connection, and the task that numbers events when woken;
//! - `group`: group commit, the creations and state changes that reach the store together in
//!   one pipelined transaction;
//! - `error`: PostgreSQL's errors sorted into the store's.

mod decisions;
mod error;
mod events;
mod fleet;
mod group;
mod handle;
mod listen;
mod location;
mod maintenance;
mod numbering;
mod operations;
mod requests;
mod rows;
mod schema;
mod streams;
mod tls;

use std::path::PathBuf;
use std::time::SystemTime;

use async_trait::async_trait;
use tokio::sync::broadcast;

use unyolo_admission::engine::{OperationState, StoreCaps};

use super::bell::EventBell;
use super::decisions::{DecisionCommand, DecisionOutcome};
use super::durable::{Derive, DurableStore, FleetRows, Judge, Render};
use super::error::{InsertError, StoreError};
use super::events::{EventPage, StoredEvent};
use super::maintenance::{Retiring, StoredCounts};
use super::records::{HISTORY_SELECT, OperationTimes};
use super::records::{
    OperationRecord, OperationSummary, PageQuery, Recovered, StateChange, StoredRequest,
};
use super::requests::RequestQuery;
use super::streams::StreamRecord;

pub use handle::{DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT, PostgresSettings, PostgresStore};
pub use listen::FALLBACK;
pub use location::redact_url;
pub use schema::SCHEMA_VERSION;

pub(in crate::store) use location::is_postgres_url;

impl PostgresStore {
    /// Whether the database would take a write now: a pooled connection (within the pool's
    /// timeout) runs a transaction on a server that is not a read-only standby.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.sorted(e))?;
        let standby: bool = tx
            .query_one("SELECT pg_is_in_recovery()", &[])
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        if !standby {
            // Whether a write could take its lock now (another session holding the tables
            // locked keeps every write waiting): asked without waiting, then let go.
            tx.batch_execute("LOCK TABLE operations IN ROW EXCLUSIVE MODE NOWAIT")
                .await
                .map_err(|e| self.sorted(e))?;
        }
        tx.rollback().await.map_err(|e| self.sorted(e))?;
        if standby {
            return Err(StoreError::Unavailable {
                database: self.database().to_owned(),
                source: "the server is a read-only standby".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl DurableStore for PostgresStore {
    fn broker(&self) -> &str {
        PostgresStore::broker(self)
    }

    fn is_request(&self, operation: &str) -> bool {
        PostgresStore::is_request(self, operation)
    }

    fn event_bell(&self) -> &EventBell {
        &self.events
    }

    fn streams_dir(&self) -> PathBuf {
        PostgresStore::streams_dir(self)
    }

    fn changes(&self) -> Option<broadcast::Receiver<String>> {
        Some(self.changes.subscribe())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        PostgresStore::ping(self).await
    }

    async fn join_fleet(
        &self,
        replica: &str,
        lease: std::time::Duration,
    ) -> Result<Vec<String>, StoreError> {
        PostgresStore::join_fleet(self, replica, lease).await
    }

    async fn renew_membership(
        &self,
        replica: &str,
        lease: std::time::Duration,
    ) -> Result<(), StoreError> {
        PostgresStore::renew_membership(self, replica, lease).await
    }

    async fn leave_fleet(&self, replica: &str) -> Result<(), StoreError> {
        PostgresStore::leave_fleet(self, replica).await
    }

    async fn fill_derived(&self, derive: Derive) -> Result<u64, StoreError> {
        PostgresStore::fill_derived(self, derive).await
    }

    async fn recover(&self) -> Result<Recovered, StoreError> {
        PostgresStore::recover(self).await
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn keeps_stream_bodies(&self) -> bool {
        true
    }

    async fn live_members(&self) -> Result<Vec<String>, StoreError> {
        PostgresStore::live_members(self).await
    }

    async fn fleet_rows(&self, since: SystemTime) -> Result<Option<FleetRows>, StoreError> {
        PostgresStore::fleet_rows(self, since).await.map(Some)
    }

    async fn still_owning(&self, replicas: &[String]) -> Result<Option<Vec<String>>, StoreError> {
        PostgresStore::still_owning(self, replicas).await.map(Some)
    }

    async fn states_of(&self, ids: &[String]) -> Result<Vec<(String, OperationState)>, StoreError> {
        PostgresStore::states_of(self, ids).await
    }

    async fn leads_fleet(&self) -> Result<bool, StoreError> {
        PostgresStore::leads_fleet(self).await
    }

    async fn take_over_lapsed(&self, lease: std::time::Duration) -> Result<Recovered, StoreError> {
        PostgresStore::take_over_lapsed(self, lease).await
    }

    async fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError> {
        PostgresStore::created_since(self, since).await
    }

    async fn history(&self) -> Result<Vec<OperationTimes>, StoreError> {
        let rows = self.strings(HISTORY_SELECT, 7).await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| <[String; 7]>::try_from(row).ok())
            .filter_map(OperationTimes::from_columns)
            .collect())
    }

    async fn key_count(&self) -> Result<u64, StoreError> {
        self.count("SELECT count(*) FROM operations").await
    }

    async fn keys(&self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self
            .strings("SELECT client_id, idempotency_key FROM operations", 2)
            .await?;
        Ok(rows
            .into_iter()
            .map(|mut row| {
                let key = row.pop().unwrap_or_default();
                (row.pop().unwrap_or_default(), key)
            })
            .collect())
    }

    async fn key_records(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        let rows = self
            .strings("SELECT client_id, idempotency_key, id FROM operations", 3)
            .await?;
        Ok(rows
            .into_iter()
            .map(|mut row| {
                let id = row.pop().unwrap_or_default();
                let key = row.pop().unwrap_or_default();
                (row.pop().unwrap_or_default(), key, id)
            })
            .collect())
    }

    async fn insert(&self, record: OperationRecord) -> Result<(), InsertError> {
        PostgresStore::insert(self, record).await
    }

    async fn request_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<StoredRequest>, StoreError> {
        PostgresStore::request_by_key(self, client_id, key).await
    }

    async fn request_of(&self, id: &str) -> Result<Option<StoredRequest>, StoreError> {
        PostgresStore::request_of(self, id).await
    }

    async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        PostgresStore::get(self, id).await
    }

    async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationSummary)>, StoreError> {
        PostgresStore::list_page(self, client_id, query).await
    }

    async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        change: StateChange,
    ) -> Result<Option<OperationRecord>, StoreError> {
        PostgresStore::set_state(self, id, from, to, change).await
    }

    async fn request_page(&self, query: RequestQuery) -> Result<Vec<OperationRecord>, StoreError> {
        PostgresStore::request_page(self, query).await
    }

    async fn decide_judged(
        &self,
        command: DecisionCommand,
        judge: Judge,
        render: Render,
    ) -> Result<DecisionOutcome<()>, StoreError> {
        PostgresStore::decide(self, command, judge, render).await
    }

    async fn count_decisions(&self) -> Result<u64, StoreError> {
        PostgresStore::count_decisions(self).await
    }

    async fn events_after(&self, after: Option<i64>, limit: u32) -> Result<EventPage, StoreError> {
        PostgresStore::events_after(self, after, limit).await
    }

    async fn events_of(&self, id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        PostgresStore::events_of(self, id).await
    }

    async fn count_events(&self) -> Result<u64, StoreError> {
        PostgresStore::count_events(self).await
    }

    async fn trim_events(
        &self,
        keep: u32,
        cutoff: Option<String>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        PostgresStore::trim_events(self, keep, cutoff, batch).await
    }

    async fn take_stream_room(
        &self,
        id: &str,
        client: &str,
        bytes: u64,
        caps: &StoreCaps,
    ) -> Result<bool, StoreError> {
        PostgresStore::take_stream_room(self, id, client, bytes, caps).await
    }

    async fn give_back_stream_room(&self, id: &str) -> Result<(), StoreError> {
        PostgresStore::give_back_stream_room(self, id).await
    }

    async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError> {
        PostgresStore::insert_stream(self, stream).await
    }

    async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError> {
        PostgresStore::get_stream(self, id).await
    }

    async fn delete_stream(&self, id: &str) -> Result<bool, StoreError> {
        PostgresStore::delete_stream(self, id).await
    }

    async fn stream_ids(&self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self.strings("SELECT id, client_id FROM streams", 2).await?;
        Ok(rows
            .into_iter()
            .map(|mut row| {
                let client = row.pop().unwrap_or_default();
                (row.pop().unwrap_or_default(), client)
            })
            .collect())
    }

    async fn counts(&self) -> Result<StoredCounts, StoreError> {
        PostgresStore::counts(self).await
    }

    async fn count_operations(&self) -> Result<u64, StoreError> {
        self.count("SELECT count(*) FROM operations").await
    }

    async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError> {
        PostgresStore::operations_by_state(self).await
    }

    async fn live_states(&self) -> Result<Vec<(String, OperationState)>, StoreError> {
        PostgresStore::live_states(self).await
    }

    async fn retiring(&self, cutoff: String, limit: u32) -> Result<Vec<Retiring>, StoreError> {
        PostgresStore::retiring(self, cutoff, limit).await
    }

    async fn retire(&self, batch: Vec<Retiring>) -> Result<u64, StoreError> {
        PostgresStore::retire(self, batch).await
    }

    /// Nothing to give back: autovacuum manages the database's space.
    async fn release_space(&self, _step: u32) -> Result<u64, StoreError> {
        Ok(0)
    }

    /// Nothing to settle: the server checkpoints its own log.
    async fn checkpoint(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// The database's size (`pg_database_size`), as last measured (at start-up, by the drift
    /// check's `counts`, and every half minute).
    fn sizes(&self) -> Vec<(&'static str, u64)> {
        vec![("database", self.bytes())]
    }
}
