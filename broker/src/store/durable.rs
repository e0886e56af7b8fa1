//! What the broker asks of its durable store, in the store's own words: [`DurableStore`], one
//! trait that every backend implements and the broker above holds as `Arc<dyn DurableStore>`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use serde_json::Value;

use unyolo_admission::engine::{OperationState, StoreCaps};

use super::bell::EventBell;
use super::decisions::{DecidedMove, DecisionCommand, DecisionOutcome};
use super::error::{InsertError, StoreError};
use super::events::{EventPage, StoredEvent};
use super::maintenance::{Retiring, StoredCounts};
use super::records::{
    OperationRecord, OperationSummary, OperationTimes, PageQuery, Presentation, Recovered,
    StateChange, StoredRequest,
};
use super::requests::RequestQuery;
use super::streams::StreamRecord;

/// The default most creations and state changes a store commits in one transaction (group
/// commit: those that reach it together share one commit flush).
pub const DEFAULT_COMMIT_BATCH: usize = 64;

/// What a store the fleet shares knows of every replica ([`DurableStore::fleet_rows`]).
#[derive(Clone, Debug, Default)]
pub struct FleetRows {
    /// The replicas whose membership is live now.
    pub members: Vec<String>,
    /// Every live operation that a replica owns: (owner, id, client, state).
    pub live: Vec<(String, String, String, OperationState)>,
    /// Every operation created at or after the time asked for that a replica owns: (owner,
    /// client, creation time).
    pub created: Vec<(String, String, SystemTime)>,
}

/// How the presentation of an older row is derived from its request (operation, target,
/// arguments, reason), for [`DurableStore::fill_derived`].
pub type Derive = fn(&str, &Value, &Value, &str) -> Presentation;

/// A decision's judge, as a backend runs it inside the decision's transaction: from the stored
/// request, the move to write, or `Err(())` to write nothing (the caller keeps its own reason:
/// see `decide` on `dyn DurableStore`).
pub type Judge = Box<dyn FnOnce(&OperationRecord) -> Result<DecidedMove, ()> + Send>;

/// Renders a committed request for the decision's record (what a replay answers).
pub type Render = Box<dyn FnOnce(&OperationRecord) -> String + Send>;

/// What the broker asks of its durable store. Every call that writes is durable when it
/// returns `Ok`; every call is safe to drop before it returns in the sense that a write either
/// commits whole or not at all (the broker runs a decided change to its end regardless: see
/// `core::run_to_end`).
#[async_trait]
pub trait DurableStore: Send + Sync + 'static {
    /// The broker name records show.
    fn broker(&self) -> &str;

    /// Whether changes of `operation` are requests the event log records (it needs an
    /// operator's approval).
    fn is_request(&self, operation: &str) -> bool;

    /// The bell streams wait on (the newest committed event's sequence).
    fn event_bell(&self) -> &EventBell;

    /// The directory stream bodies are written to.
    fn streams_dir(&self) -> PathBuf;

    /// Whether a recorded stream's body lives in the store itself (moved there from
    /// [`streams_dir`](DurableStore::streams_dir) by [`insert_stream`](DurableStore::insert_stream)),
    /// so a row has no file to miss. `false` (the default): the file is the body.
    fn keeps_stream_bodies(&self) -> bool {
        false
    }

    /// Changes made by any process on this store, as they commit: an operation's id, a space
    /// and the state it moved to; a stream's id alone (it was deleted); an empty string:
    /// anything may have changed (e.g. after the feed was cut),
    /// for waits to wake on a change another replica made. `None` (the default) when only this
    /// process writes the store (SQLite): the broker wakes its own waits as it changes
    /// operations. A receiver that lags behind should re-read what it waits on.
    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<String>> {
        None
    }

    /// Whether other processes (a fleet's replicas) read and write this store too: their
    /// operations are in it, and this process learns of their changes through
    /// [`changes`](DurableStore::changes). `false` (the default) for a store one process owns.
    fn is_shared(&self) -> bool {
        false
    }

    /// The replicas whose membership is live now (none for a store one process owns).
    async fn live_members(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    /// In a fleet: what the store knows of every replica, read by a replica that rebuilds the
    /// others' work in Redis after it forgot (see [`FleetRows`]); `None` (the default) for a
    /// store one process owns, which knows only its own work.
    async fn fleet_rows(&self, since: SystemTime) -> Result<Option<FleetRows>, StoreError> {
        let _ = since;
        Ok(None)
    }

    /// Of `replicas`, those that own live operations in the store now (their work not taken
    /// over yet); `None` (the default) for a store one process owns.
    async fn still_owning(&self, replicas: &[String]) -> Result<Option<Vec<String>>, StoreError> {
        let _ = replicas;
        Ok(None)
    }

    /// The state each of `ids` has now; an id without a row is left out. Read after a rebuild
    /// from [`fleet_rows`](DurableStore::fleet_rows), so only a store that answers that one
    /// needs it (the default answers nothing).
    async fn states_of(&self, ids: &[String]) -> Result<Vec<(String, OperationState)>, StoreError> {
        let _ = ids;
        Ok(Vec::new())
    }

    /// Whether this process runs the chores done once for the whole store (retention, the
    /// event log's trimming) now: always, for a store one process owns; in a fleet, one live
    /// replica.
    async fn leads_fleet(&self) -> Result<bool, StoreError> {
        Ok(true)
    }

    /// Takes over the work of replicas whose membership lapsed, as start-up recovery does
    /// ([`recover`](DurableStore::recover)): their executing operations end `failed`
    /// `execution_interrupted`, their pending and approved ones become this replica's (returned
    /// as `live`). Called every third of `lease` (the membership's); nothing for a store one
    /// process owns.
    async fn take_over_lapsed(&self, lease: std::time::Duration) -> Result<Recovered, StoreError> {
        let _ = lease;
        Ok(Recovered::default())
    }

    /// Joins the replicas serving this store as `replica`, for `lease` (renewed with
    /// [`renew_membership`](DurableStore::renew_membership) while it runs), and answers the
    /// other replicas whose lease is live now; two replicas joining at once see each other. A
    /// store only one process can open (SQLite: its data dir's lock) has no one else to name.
    async fn join_fleet(
        &self,
        replica: &str,
        lease: std::time::Duration,
    ) -> Result<Vec<String>, StoreError> {
        let _ = (replica, lease);
        Ok(Vec::new())
    }

    /// Renews `replica`'s membership for `lease` from now.
    async fn renew_membership(
        &self,
        replica: &str,
        lease: std::time::Duration,
    ) -> Result<(), StoreError> {
        let _ = (replica, lease);
        Ok(())
    }

    /// Gives `replica`'s membership up (at shutdown), so another may start at once.
    async fn leave_fleet(&self, replica: &str) -> Result<(), StoreError> {
        let _ = replica;
        Ok(())
    }

    /// Whether the store would take a write now (the states in which a submission could not be
    /// made durable fail it).
    async fn ping(&self) -> Result<(), StoreError>;

    // --- Start-up.

    /// Derives the presentation and request digest of every row an older schema stored without
    /// them; how many rows it filled.
    async fn fill_derived(&self, derive: Derive) -> Result<u64, StoreError>;

    /// Start-up recovery: operations that were executing become `failed` with
    /// `execution_interrupted` (they never run twice); returns them, the live ones and the
    /// streams. In a fleet, only this replica's own operations and those no live replica owns
    /// (they become this replica's).
    async fn recover(&self) -> Result<Recovered, StoreError>;

    /// The client and creation time of every operation, in any state, created at or after
    /// `since` (to rebuild the rate buckets). A time that does not parse is skipped.
    async fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError>;

    /// Every stored operation's client, operation, state and times, oldest first: the history
    /// `admission check --history` replays. Reads only.
    async fn history(&self) -> Result<Vec<OperationTimes>, StoreError>;

    /// How many operation rows exist (sizes the replay filter).
    async fn key_count(&self) -> Result<u64, StoreError>;

    /// The client and idempotency key of every operation (fills the replay filter).
    async fn keys(&self) -> Result<Vec<(String, String)>, StoreError>;

    /// Every operation's (client, idempotency key, id): the key records a replica writes back
    /// after the shared admission store forgot them.
    async fn key_records(&self) -> Result<Vec<(String, String, String)>, StoreError>;

    // --- Operations.

    /// Inserts a new operation (and, for a request, its `request.created` event in the same
    /// transaction); [`InsertError::Duplicate`] when the client already has the key.
    async fn insert(&self, record: OperationRecord) -> Result<(), InsertError>;

    /// The request of the client's operation with this idempotency key: its digest and size,
    /// not its text.
    async fn request_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<StoredRequest>, StoreError>;

    /// The request of operation `id`: whose it is and its size, not its text.
    async fn request_of(&self, id: &str) -> Result<Option<StoredRequest>, StoreError>;

    /// The operation `id`.
    async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError>;

    /// One listing page: the client's operations matching `query`, newest first, each with its
    /// position (pass the last one as the next page's `before`).
    async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationSummary)>, StoreError>;

    /// Moves operation `id` from `from` to `to`, writing what `change` carries and, for a
    /// request, its event, in one transaction. The updated record, or `None` if the row was not
    /// in `from`.
    async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        change: StateChange,
    ) -> Result<Option<OperationRecord>, StoreError>;

    /// One operators' request page.
    async fn request_page(&self, query: RequestQuery) -> Result<Vec<OperationRecord>, StoreError>;

    /// Judges and commits `command` in one transaction (see `decisions`); a judge's refusal is
    /// `Refused(())`. Callers use `decide` (on `dyn DurableStore`), which keeps their reason.
    async fn decide_judged(
        &self,
        command: DecisionCommand,
        judge: Judge,
        render: Render,
    ) -> Result<DecisionOutcome<()>, StoreError>;

    /// How many decision records are stored (a refused decision writes none).
    async fn count_decisions(&self) -> Result<u64, StoreError>;

    // --- The event log.

    /// Up to `limit` events strictly after sequence `after` (`None`: from the oldest retained),
    /// oldest first; [`EventPage::Expired`] when events after `after` were already deleted.
    async fn events_after(&self, after: Option<i64>, limit: u32) -> Result<EventPage, StoreError>;

    /// The events of request `id`, oldest first.
    async fn events_of(&self, id: &str) -> Result<Vec<StoredEvent>, StoreError>;

    /// How many events are retained.
    async fn count_events(&self) -> Result<u64, StoreError>;

    /// Deletes, oldest first, at most `batch` of the events past retention (beyond the newest
    /// `keep`, and with a `cutoff`, every one up to the last older than it): only ever a prefix.
    async fn trim_events(
        &self,
        keep: u32,
        cutoff: Option<String>,
        batch: u32,
    ) -> Result<u64, StoreError>;

    // --- Streams.

    /// Takes room for upload `id` (one stream of `client`, `bytes` long) among the streams every
    /// process on this store holds, if `caps` allow it counting every stream recorded and every
    /// upload in progress of a live process; `false` if they do not, and nothing is taken. The
    /// room is this upload's until [`insert_stream`](DurableStore::insert_stream) records it or
    /// [`give_back_stream_room`](DurableStore::give_back_stream_room) lets it go.
    ///
    /// A store only this process writes (the default) takes nothing and answers `true`: this
    /// process's own counts, checked before, are the whole store's.
    async fn take_stream_room(
        &self,
        id: &str,
        client: &str,
        bytes: u64,
        caps: &StoreCaps,
    ) -> Result<bool, StoreError> {
        let _ = (id, client, bytes, caps);
        Ok(true)
    }

    /// Lets go of the room taken for upload `id`, whose stream was not recorded.
    async fn give_back_stream_room(&self, id: &str) -> Result<(), StoreError> {
        let _ = id;
        Ok(())
    }

    /// Records a stream whose body is already written to [`streams_dir`](DurableStore::streams_dir)
    /// under its id (and the room its upload took becomes the stream's). A store several
    /// replicas share moves the body into the store (removing the file), so no replica's disk
    /// holds what the fleet stored.
    async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError>;

    /// The stream `id`.
    async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError>;

    /// Deletes the stream `id`'s record; whether there was one.
    async fn delete_stream(&self, id: &str) -> Result<bool, StoreError>;

    /// Every stream's (id, client).
    async fn stream_ids(&self) -> Result<Vec<(String, String)>, StoreError>;

    // --- Checks and maintenance.

    /// What the store holds, for the drift check.
    async fn counts(&self) -> Result<StoredCounts, StoreError>;

    /// How many operation rows exist.
    async fn count_operations(&self) -> Result<u64, StoreError>;

    /// Operation rows by state.
    async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError>;

    /// Every live (non-terminal) operation's id and state.
    async fn live_states(&self) -> Result<Vec<(String, OperationState)>, StoreError>;

    /// The oldest terminal operations that ended before `cutoff` (RFC 3339), at most `limit`.
    async fn retiring(&self, cutoff: String, limit: u32) -> Result<Vec<Retiring>, StoreError>;

    /// Deletes the retiring operations (only those still terminal); how many.
    async fn retire(&self, batch: Vec<Retiring>) -> Result<u64, StoreError>;

    /// Gives freed space back to the filesystem, at most `step` units a call; how much is left
    /// to give (call again while it is above zero). Nothing for a store that manages its own.
    async fn release_space(&self, step: u32) -> Result<u64, StoreError>;

    /// Settles what a burst of writes left behind (SQLite: a checkpoint of its log).
    async fn checkpoint(&self) -> Result<(), StoreError>;

    /// The store's size by part, for `broker_store_bytes{file}`.
    fn sizes(&self) -> Vec<(&'static str, u64)>;
}

impl dyn DurableStore {
    /// Judges and commits `command` in one transaction: `judge` says, from the stored request,
    /// what to do (`Err` refuses with its reason, writing nothing); `render` renders the
    /// committed request for the record a replay answers.
    pub async fn decide<R: Send + 'static>(
        &self,
        command: DecisionCommand,
        judge: impl FnOnce(&OperationRecord) -> Result<DecidedMove, R> + Send + 'static,
        render: impl FnOnce(&OperationRecord) -> String + Send + 'static,
    ) -> Result<DecisionOutcome<R>, StoreError> {
        let reason: Arc<Mutex<Option<R>>> = Arc::new(Mutex::new(None));
        let kept = Arc::clone(&reason);
        let judge: Judge = Box::new(move |record| {
            judge(record).map_err(|why| {
                *crate::sync::lock(&kept) = Some(why);
            })
        });
        let outcome = self.decide_judged(command, judge, Box::new(render)).await?;
        Ok(match outcome {
            DecisionOutcome::Replayed(rendered) => DecisionOutcome::Replayed(rendered),
            DecisionOutcome::IdempotencyConflict => DecisionOutcome::IdempotencyConflict,
            DecisionOutcome::NotFound => DecisionOutcome::NotFound,
            DecisionOutcome::Committed(record, rendered) => {
                DecisionOutcome::Committed(record, rendered)
            }
            DecisionOutcome::Refused((), record) => match crate::sync::lock(&reason).take() {
                Some(why) => DecisionOutcome::Refused(why, record),
                None => {
                    return Err(StoreError::new(
                        "the store reported a refusal its judge did not make",
                    ));
                }
            },
        })
    }
}
