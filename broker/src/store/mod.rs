//! The broker's durable store: what the broker asks of it, in the store's own words
//! ([`DurableStore`]), and the two houses that answer: `sqlite` (one file under the data dir, the
//! embedded default for one process) and `postgres` (one database for a fleet of replicas).
//!
//! Operations, their Operator V1 events, operators' decisions and streams live here; the
//! controller's counts are rebuilt from it at start-up, so what is stored is what counts. Every
//! write is committed (and so durable) before the call returns, which is what lets the HTTP layer
//! answer 202 only for work that survives a crash.
//!
//! The store knows SQL and files, nothing of HTTP or JSON answers: it imports nothing from the
//! rest of the broker, and the broker above names neither backend (it holds an
//! `Arc<dyn DurableStore>`, opened by [`open`]). One file per concern:
//!
//! - `durable`: the trait, what the broker asks of a store;
//! - `open`: where a store lives, and opening the one a location names;
//! - `records`: an operation and the slices of it that pages, replays and decisions read;
//! - `digest`: the canonical digest of a request, stored with its operation for replays;
//! - `streams`: a stored stream;
//! - `decisions`: operators' decisions, judged and committed with their idempotency records in
//!   one transaction;
//! - `requests`: what an operators' request page selects;
//! - `events`: the Operator V1 event log's shape (kinds, statuses, cursors, pages);
//! - `bell`: where the newest committed event is published, for the streams that wait on it;
//! - `maintenance`: the counts the drift check compares, and the rows retention retires;
//! - `error`: what went wrong, as values a caller matches on.

mod bell;
mod decisions;
mod digest;
mod dir_lock;
mod durable;
mod error;
pub mod events;
mod maintenance;
mod open;
pub mod postgres;
mod records;
mod requests;
pub mod sqlite;
mod streams;

pub use bell::EventBell;
pub use decisions::{DecidedMove, DecisionCommand, DecisionOutcome, DecisionScope};
pub use digest::request_digest;
pub use dir_lock::LOCK_FILE;
pub use durable::{DEFAULT_COMMIT_BATCH, Derive, DurableStore, FleetRows, Judge, Render};
pub use error::{InsertError, StoreError};
pub use events::{EventKind, EventPage, RequestStatus, StoredEvent, request_status};
pub use maintenance::{Retiring, StoredCounts};
pub use open::{StoreLocation, open, open_batched};
pub use postgres::{PostgresSettings, PostgresStore, redact_url};
pub use records::{
    DEFAULT_BROKER_NAME, Decided, DecisionMark, OperationError, OperationRecord, OperationSummary,
    OperationTimes, PageQuery, Presentation, Recovered, StateChange, StoredRequest, now_rfc3339,
};
pub use requests::{RequestQuery, StateFilter};
pub use sqlite::{DATABASE_FILE, MIN_FREE_BYTES, READERS, SCHEMA_VERSION, SqliteStore};
pub use streams::StreamRecord;
