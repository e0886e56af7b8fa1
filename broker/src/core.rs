//! The state every part of the broker shares: [`Core`], held by every handler, the executor, the
//! drift watch and the retention sweep, and what it holds of each live operation ([`LiveOp`]) and
//! of the work waiting to execute ([`ExecQueue`]).
//!
//! It sits below everything that acts on it: its fields are types of the rooms below it (the
//! store, the replay filter, the secrets, the open waits), and the rooms that act (transitions,
//! the executor, drift, retention, the HTTP layer) import it, never the other way. So this file
//! names no handler, no route and no task loop.
//!
//! Also here, because every change shares it: [`run_to_end`], the one way a decided change is
//! detached from the future of the client that asked for it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::fairness::{ByteBudget, Fairness};
use tokio::sync::{Notify, watch};

use super::auth::Auth;
use super::event_streams::EventStreams;
use super::key_locks::{KeyGuard, KeyLocks};
use super::keys::KeyFilter;
use super::registry::duration_ms;
use super::store::{DurableStore, OperationRecord};
use super::waits::Waits;
use unyolo_admission::admission::{Admission, OperationHandle, Shadow, ShadowVerdict};
use unyolo_admission::engine::{Controller, Operation, StoredObject};

/// The `broker_submissions_total{result}` label set.
pub(crate) type SubmissionLabels = [(&'static str, &'static str); 1];

/// What became of a submission, as `broker_submissions_total{result}` counts it.
#[derive(Clone, Copy)]
pub(crate) enum Submitted {
    Created,
    Replayed,
    Rejected,
}

/// `broker_submissions_total{result}`: each result's counter, looked up in the family once, at
/// start-up, so counting a submission (every refusal of a flood) takes no lock and hashes no
/// label.
pub(crate) struct SubmissionCounters {
    created: Counter,
    replayed: Counter,
    rejected: Counter,
}

impl SubmissionCounters {
    /// The counters of `family`'s three results (created in it, so a scrape shows each from 0).
    pub(crate) fn of(family: &Family<SubmissionLabels, Counter>) -> SubmissionCounters {
        // A family's counter is a handle on one shared count: the clone counts into the family.
        let counter = |result: &'static str| family.get_or_create(&[("result", result)]).clone();
        SubmissionCounters {
            created: counter("created"),
            replayed: counter("replayed"),
            rejected: counter("rejected"),
        }
    }
}

/// The `broker_operator_decisions_total{action,outcome}` label set.
pub(crate) type DecisionLabels = [(&'static str, &'static str); 2];

/// State shared by every handler and the executor.
pub(crate) struct Core {
    /// Admission, in-process or shared with other replicas: every submission, transition and
    /// start goes through it.
    pub(crate) admission: Admission,
    /// The shadow quota file's engine (`--shadow-config`), judging every submission after the
    /// real decision; in-process only, whatever the admission's backend.
    pub(crate) shadow: Option<Shadow>,
    pub(crate) db: Arc<dyn DurableStore>,
    /// Non-terminal operations by id.
    pub(crate) live: Mutex<HashMap<String, Arc<LiveOp>>>,
    /// Stored streams by id.
    pub(crate) streams: Mutex<HashMap<String, StoredObject>>,
    /// Approved operations waiting for an execution slot (the `exec` module runs them).
    pub(crate) executor: ExecQueue,
    pub(crate) auth: Auth,
    pub(crate) registry: Registry,
    pub(crate) submissions: SubmissionCounters,
    /// `broker_store_ready`: 1 when the store would take a write at the last check
    /// ([`Core::store_readiness`]: `/readyz`, a scrape), else 0.
    pub(crate) store_ready: Gauge,
    /// The (client, key) pairs that may have an operation, so a new key skips the store lookup.
    pub(crate) keys: KeyFilter,
    /// Serializes submissions with the same (client, idempotency key), so concurrent duplicates
    /// create one operation; one lock per pair in use, so nothing else waits on them.
    pub(crate) key_locks: Arc<KeyLocks>,
    /// Held shared by every change of the counts or the store while it is in progress, and
    /// exclusively by a drift reading (see the `drift` module).
    pub(crate) counts_gate: Arc<tokio::sync::RwLock<()>>,
    /// Uploads whose room is reserved while their body arrives: stream id → (client, bytes).
    pub(crate) uploading: Mutex<HashMap<String, (String, u64)>>,
    /// `admission_store_drift`: the total difference found by the last drift reading.
    pub(crate) drift: Gauge,
    /// `admission_fleet_drift`: operations the shared store holds for this replica differently
    /// from its store, at the last reading (0 in-process).
    pub(crate) fleet_drift: Gauge,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Open long-poll waits and the bells that wake them.
    pub(crate) waits: Waits,
    /// Each client's share of requests in flight (the router's fairness layer).
    pub(crate) fairness: Fairness,
    /// The bytes agents' request bodies and rendered answers may hold buffered at once
    /// (`--buffered-bytes`).
    pub(crate) budget: ByteBudget,
    /// The bytes operator decision bodies may hold buffered at once, apart from `budget` so no
    /// client's load can keep a decision out (`api::operator::decisions::decision_room`).
    pub(crate) decision_budget: ByteBudget,
    /// How long a request waits for a decision (`--pending-timeout`; its `pending_expires_at`
    /// is its creation plus this): the one place the broker reads the pending timeout from.
    pub(crate) pending_timeout: Duration,
    /// `broker_operator_decisions_total{action,outcome}`.
    pub(crate) operator_decisions: Family<DecisionLabels, Counter>,
    /// The pending requests by when they expire (the `expiry` sweeper takes from it).
    pub(crate) expiries: PendingExpiries,
    /// The open Operator V1 event streams and their bounds.
    pub(crate) event_streams: EventStreams,
    /// Held while operations this replica's live map lacks are made live from their rows (a
    /// takeover, an orphan taken up: the `fleet` module), so no row is counted twice.
    pub(crate) adopting: tokio::sync::Mutex<()>,
}

/// How long a readiness check waits for the store before counting it not ready.
const READY_DEADLINE: Duration = Duration::from_secs(2);

/// Why the store is not ready (see [`Core::store_readiness`]).
pub(crate) enum NotReady {
    /// Its filesystem is (nearly) full.
    NoRoom,
    /// It failed otherwise, or did not answer within the deadline.
    NoAnswer,
}

impl Core {
    /// Whether the store would take a write now ([`DurableStore::ping`]: free space, then the write
    /// lock) within a deadline, as `/readyz` on both listeners and the metrics scrape ask it.
    /// Sets `broker_store_ready`, and logs when readiness is lost (with why) or comes back, not
    /// at every probe.
    pub(crate) async fn store_readiness(&self) -> Result<(), NotReady> {
        let checked = tokio::time::timeout(READY_DEADLINE, self.db.ping()).await;
        let ready = matches!(checked, Ok(Ok(())));
        let was = self.store_ready.set(i64::from(ready)) == 1;
        match checked {
            Ok(Ok(())) => {
                if !was {
                    tracing::info!("the store takes writes again: /readyz answers 200");
                }
                Ok(())
            }
            Ok(Err(err)) => {
                if was {
                    tracing::warn!(error = %err, "the store is not ready: /readyz answers 503");
                }
                match err {
                    super::store::StoreError::NoRoom { .. } => Err(NotReady::NoRoom),
                    _ => Err(NotReady::NoAnswer),
                }
            }
            Err(_) => {
                if was {
                    tracing::warn!(
                        deadline = ?READY_DEADLINE,
                        "the store did not answer within the deadline: /readyz answers 503"
                    );
                }
                Err(NotReady::NoAnswer)
            }
        }
    }

    /// This process's engine (what this replica holds; storage quotas, rate headers, drift).
    pub(crate) fn controller(&self) -> &Controller {
        self.admission.controller()
    }

    /// Counts a submission's outcome.
    pub(crate) fn count_submission(&self, result: Submitted) {
        let counter = match result {
            Submitted::Created => &self.submissions.created,
            Submitted::Replayed => &self.submissions.replayed,
            Submitted::Rejected => &self.submissions.rejected,
        };
        counter.inc();
    }

    /// The live operations by id.
    pub(crate) fn live_ops(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<LiveOp>>> {
        crate::sync::lock(&self.live)
    }

    /// The stored streams by id.
    pub(crate) fn stored_streams(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, StoredObject>> {
        crate::sync::lock(&self.streams)
    }

    /// The uploads in progress by stream id.
    pub(crate) fn uploads(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, u64)>> {
        crate::sync::lock(&self.uploading)
    }

    /// The uploads in progress: (client, bytes reserved) each.
    pub(crate) fn uploads_in_progress(&self) -> Vec<(String, u64)> {
        self.uploads().values().cloned().collect()
    }

    /// A shared hold on the counts gate: while it lives, no drift reading is taken. Take it before
    /// the first count a change touches and keep it until the store and the counts agree again.
    /// Never take it twice in one task (a reading waiting in between would deadlock it).
    pub(crate) async fn hold_counts(&self) -> tokio::sync::OwnedRwLockReadGuard<()> {
        Arc::clone(&self.counts_gate).read_owned().await
    }

    /// Adds a live operation (stored as `record`) to the live map; a pending one is also queued
    /// for expiry at its [`Core::pending_expires_at`], an approved one whose approval lapses at
    /// its `active_expires_at`.
    pub(crate) fn add_live(&self, op: &Arc<LiveOp>, record: &OperationRecord) {
        use unyolo_admission::engine::OperationState;
        self.live_ops().insert(op.id.clone(), Arc::clone(op));
        match record.state {
            OperationState::Pending => self.expiries.push(
                self.pending_expires_at(op),
                Arc::downgrade(op),
                OperationState::Pending,
            ),
            OperationState::Approved => self.queue_lapse(op, record),
            _ => {}
        }
    }

    /// Queues an approved operation's lapse at `record`'s `active_expires_at`, if it has one (an
    /// unreadable time is due now: see `projection::lapsed`).
    pub(crate) fn queue_lapse(&self, op: &Arc<LiveOp>, record: &OperationRecord) {
        if let Some(at) = &record.active_expires_at {
            let at = humantime::parse_rfc3339(at).unwrap_or_else(|_| SystemTime::now());
            // Set once: an operation is approved at most once.
            let _ = op.lapses_at.set(at);
            self.expiries.push(
                at,
                Arc::downgrade(op),
                unyolo_admission::engine::OperationState::Approved,
            );
        }
    }

    /// When request `op` expires if nobody decides it (its `pending_expires_at`): fixed at its
    /// creation, or for a request stored before schema 8, its creation plus the timeout now.
    pub(crate) fn pending_expires_at(&self, op: &LiveOp) -> SystemTime {
        op.pending_until
            .unwrap_or_else(|| op.created_at + self.pending_timeout)
    }

    /// The cursor of the newest event in the log (the request list's `event_cursor`), `None`
    /// before the first; read from the event bell, not the store.
    pub(crate) fn newest_event_cursor(&self) -> Option<String> {
        let newest = self.db.event_bell().newest();
        (newest > 0).then(|| super::store::events::encode_cursor(newest))
    }

    /// Judges a submission the real admission has just decided (`real_admitted`) against the
    /// shadow file, if one is set: the shadow's permit when it would admit and the real answer
    /// admitted (commit or refund it with the real one). The first would-be refusal of each
    /// client is logged. In-process only: no store, no Redis, nothing awaited.
    pub(crate) fn judge_in_shadow(
        &self,
        client: &str,
        needs_approval: bool,
        real_admitted: bool,
    ) -> Option<unyolo_admission::engine::Permit> {
        match self
            .shadow
            .as_ref()?
            .judge(client, needs_approval, SystemTime::now())
        {
            // Refused for real, the shadow's permit is dropped: its slots return (there is no
            // operation to follow) and its rate token stays spent, as the candidate's would.
            ShadowVerdict::Admitted(permit) => real_admitted.then_some(permit),
            ShadowVerdict::Refused { code, first } => {
                if first {
                    tracing::warn!(
                        client,
                        code = code.as_str(),
                        real = if real_admitted { "admitted" } else { "refused" },
                        "the shadow admission config would refuse this client (its first \
                         would-be refusal; the real decision stands)"
                    );
                }
                None
            }
        }
    }

    /// Waits for the lock serializing submissions of `client` with idempotency `key`.
    pub(crate) async fn key_lock(&self, client: &str, key: &str) -> KeyGuard {
        self.key_locks.lock(client, key).await
    }
}

/// A non-terminal operation: its id, what the executor needs, and its lifecycle handle.
pub(crate) struct LiveOp {
    pub(crate) id: String,
    pub(crate) client_id: String,
    /// Its idempotency key (renewed in the shared store while it lives long: see retention).
    pub(crate) key: String,
    pub(crate) duration: Duration,
    /// Its lifecycle handle (in-process, or mirrored to the replicas' shared counts).
    pub(crate) handle: OperationHandle,
    /// Its handle in the shadow engine, when a shadow file is set and would have admitted it;
    /// taken out at its end.
    pub(crate) shadow: Mutex<Option<Operation>>,
    /// Held across a transition's store write and its handle update.
    pub(crate) lock: tokio::sync::Mutex<()>,
    /// When it was created (its row's `created_at`; now, if that does not parse).
    pub(crate) created_at: SystemTime,
    /// When it expires if it is a request nobody decides, as its row fixed at creation (`None`
    /// for rows stored before schema 8: see [`Core::pending_expires_at`]; now, if it does not
    /// parse).
    pub(crate) pending_until: Option<SystemTime>,
    /// When an operator's approval of it lapses (its row's `active_expires_at`), once approved:
    /// from then it never starts, and the expiry sweeper ends it `expired`.
    pub(crate) lapses_at: std::sync::OnceLock<SystemTime>,
    /// Whether its start took its slot (the handle is `executing`) but the store has not taken
    /// the start's write yet (the executor retries it): the work has not run and its row is
    /// still `approved`. Read and written under its lock.
    pub(crate) start_unrecorded: std::sync::atomic::AtomicBool,
}

impl LiveOp {
    /// Whether its approval has lapsed at `now`.
    pub(crate) fn lapsed(&self, now: SystemTime) -> bool {
        self.lapses_at.get().is_some_and(|at| *at <= now)
    }

    /// The state its row is in, as a move from it is judged: the handle's, but for a start not
    /// recorded yet, which is still `approved` there (and may be canceled or revoked as such).
    pub(crate) fn stored_state(&self) -> unyolo_admission::engine::OperationState {
        use unyolo_admission::engine::OperationState;
        let state = self.handle.state();
        if state == OperationState::Executing
            && self
                .start_unrecorded
                .load(std::sync::atomic::Ordering::Acquire)
        {
            OperationState::Approved
        } else {
            state
        }
    }
}

impl LiveOp {
    /// The same operation, held in the shadow engine by `shadow` too.
    pub(crate) fn shadowed(self, shadow: Option<Operation>) -> LiveOp {
        *crate::sync::lock(&self.shadow) = shadow;
        self
    }

    /// Follows a move of the real operation (already made) in the shadow, if the shadow holds
    /// it: a start takes a shadow execution slot if the candidate has one free; a terminal move
    /// releases what the shadow holds.
    pub(crate) fn follow_in_shadow(
        &self,
        shadow: Option<&Shadow>,
        to: unyolo_admission::engine::OperationState,
    ) {
        let Some(shadow) = shadow else {
            return;
        };
        let mut held = crate::sync::lock(&self.shadow);
        let Some(operation) = held.as_ref() else {
            return;
        };
        if to == unyolo_admission::engine::OperationState::Executing {
            shadow.start(operation);
        } else {
            Shadow::follow(operation, to);
        }
        if to.is_terminal() {
            *held = None;
        }
    }

    pub(crate) fn new(record: &OperationRecord, handle: OperationHandle) -> LiveOp {
        LiveOp {
            id: record.id.clone(),
            client_id: record.client_id.clone(),
            key: record.idempotency_key.clone(),
            duration: Duration::from_millis(duration_ms(&record.arguments).unwrap_or(0)),
            handle,
            shadow: Mutex::new(None),
            lock: tokio::sync::Mutex::new(()),
            created_at: humantime::parse_rfc3339(&record.created_at)
                .unwrap_or_else(|_| SystemTime::now()),
            pending_until: record
                .pending_expires_at
                .as_deref()
                .map(|at| humantime::parse_rfc3339(at).unwrap_or_else(|_| SystemTime::now())),
            lapses_at: std::sync::OnceLock::new(),
            start_unrecorded: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// The requests in the order they expire, each with the state it expires from, and the bell
/// rung when one is queued first: a pending request at its `pending_expires_at`, an approved
/// one at its `active_expires_at` (its approval lapsed before it started). The pending timeout
/// is one for all, so a new request nearly always expires after every one queued before it and
/// goes at the back (restored ones are queued oldest first); two creations that finish out of
/// order, an approval (due when its granted duration ends), or an expiry the store could not
/// take (queued again, due a second later), go before whatever is due after them. An entry
/// whose request left that state meanwhile is skipped when its time comes (it is held weakly,
/// so a finished operation is not kept alive by the queue).
#[derive(Default)]
pub(crate) struct PendingExpiries {
    queue: Mutex<VecDeque<Expiry>>,
    bell: Notify,
}

/// One queued expiry: when, the request, and the state it expires from.
type Expiry = (
    SystemTime,
    Weak<LiveOp>,
    unyolo_admission::engine::OperationState,
);

impl PendingExpiries {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Expiry>> {
        crate::sync::lock(&self.queue)
    }

    /// Queues a request in state `from` expiring at `at`, in order; rings the bell when it is
    /// the first due, so a sweeper asleep until a later one wakes for it.
    pub(crate) fn push(
        &self,
        at: SystemTime,
        op: Weak<LiveOp>,
        from: unyolo_admission::engine::OperationState,
    ) {
        let mut queue = self.queue();
        // Searched from the back, where a new request nearly always goes.
        let place = queue
            .iter()
            .rposition(|(queued, ..)| *queued <= at)
            .map_or(0, |before| before + 1);
        queue.insert(place, (at, op, from));
        drop(queue);
        if place == 0 {
            self.bell.notify_one();
        }
    }

    /// When the first queued request expires, if any is queued.
    pub(crate) fn next(&self) -> Option<SystemTime> {
        self.queue().front().map(|(at, ..)| *at)
    }

    /// Takes out every entry due at `now`, oldest first, with the requests still live and the
    /// state each expires from.
    pub(crate) fn take_due(
        &self,
        now: SystemTime,
    ) -> Vec<(Arc<LiveOp>, unyolo_admission::engine::OperationState)> {
        let mut queue = self.queue();
        let mut due = Vec::new();
        while queue.front().is_some_and(|(at, ..)| *at <= now) {
            if let Some((_, op, from)) = queue.pop_front()
                && let Some(op) = op.upgrade()
            {
                due.push((op, from));
            }
        }
        due
    }

    /// Returns once a request is queued first; a ring while nobody waits is kept for the next
    /// call.
    pub(crate) async fn rung(&self) {
        self.bell.notified().await;
    }
}

/// How many other clients' work the executor tries when the oldest queued operation's client is
/// refused a slot the pool still has (its fair share): see the `exec` module.
pub(crate) const OTHER_CLIENTS_TRIED: usize = 8;
/// How far into the queue those clients are looked for.
pub(crate) const QUEUE_LOOKED_AT: usize = 4096;

/// The queue of approved operations, oldest first, and the bell rung when work is queued or may
/// start. The executor (the `exec` module) takes from it.
#[derive(Default)]
pub(crate) struct ExecQueue {
    queue: Mutex<VecDeque<Arc<LiveOp>>>,
    bell: Notify,
}

impl ExecQueue {
    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<LiveOp>>> {
        crate::sync::lock(&self.queue)
    }

    /// Queues an approved operation for execution.
    pub(crate) fn enqueue(&self, op: Arc<LiveOp>) {
        self.queue().push_back(op);
        self.wake();
    }

    /// Something changed that may let queued work start (work queued, a slot freed, a limit
    /// raised). A wait for this replica's own pool is woken by the controller itself; this bell
    /// serves an empty queue and a wait for the shared pool.
    pub(crate) fn wake(&self) {
        self.bell.notify_one();
    }

    /// The oldest queued operation, left in the queue.
    pub(crate) fn oldest(&self) -> Option<Arc<LiveOp>> {
        self.queue().front().cloned()
    }

    /// Takes the oldest queued operation out of the queue.
    pub(crate) fn pop_oldest(&self) {
        self.queue().pop_front();
    }

    /// The oldest queued operation of each client other than `refused`'s, in queue order: at
    /// most [`OTHER_CLIENTS_TRIED`] clients, found among the first [`QUEUE_LOOKED_AT`] entries.
    /// Each client's own work keeps its order: only a client's oldest is offered.
    pub(crate) fn oldest_of_other_clients(&self, refused: &str) -> Vec<Arc<LiveOp>> {
        let mut seen: Vec<&str> = vec![refused];
        let mut found = Vec::new();
        let queue = self.queue();
        for op in queue.iter().take(QUEUE_LOOKED_AT) {
            if found.len() == OTHER_CLIENTS_TRIED {
                break;
            }
            if !seen.contains(&op.client_id.as_str()) {
                seen.push(&op.client_id);
                found.push(Arc::clone(op));
            }
        }
        found
    }

    /// Takes `op` out of the queue, wherever it is in it.
    pub(crate) fn remove(&self, op: &Arc<LiveOp>) {
        self.queue().retain(|queued| !Arc::ptr_eq(queued, op));
    }

    /// Returns once the bell rings; a ring while nobody waits is kept for the next call.
    pub(crate) async fn rung(&self) {
        self.bell.notified().await;
    }
}

/// Starts `work` on a task of its own at once (not at the first poll) and returns a future of its
/// outcome. The caller only waits: if the caller is dropped (its client hung up), the work goes on
/// to its end regardless. `Err` only if the work panicked or the runtime is shutting down.
pub(crate) fn run_to_end<T: Send + 'static>(
    work: impl Future<Output = T> + Send + 'static,
) -> impl Future<Output = Result<T, tokio::task::JoinError>> {
    tokio::spawn(work)
}

/// A fresh random id: `prefix`, `_`, 32 hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    unyolo_admission::admission::random_id(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use unyolo_admission::engine::OperationState::Pending;

    fn at(seconds: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(seconds)
    }

    #[test]
    fn an_expiry_queued_again_after_a_store_fault_is_due_before_later_requests() {
        let expiries = PendingExpiries::default();
        expiries.push(at(10), Weak::new(), Pending);
        expiries.push(at(20), Weak::new(), Pending);
        assert!(expiries.take_due(at(10)).is_empty(), "held weakly: gone");
        assert_eq!(expiries.next(), Some(at(20)));
        // The first one's expiry failed: it is retried a second later, not after the second.
        expiries.push(at(11), Weak::new(), Pending);
        assert_eq!(expiries.next(), Some(at(11)));
        // Two creations finished out of order: the earlier one is still due first.
        expiries.push(at(30), Weak::new(), Pending);
        expiries.push(at(25), Weak::new(), Pending);
        let order: Vec<SystemTime> = expiries.queue().iter().map(|(at, ..)| *at).collect();
        assert_eq!(order, [at(11), at(20), at(25), at(30)]);
    }

    #[tokio::test]
    async fn the_bell_rings_only_for_a_request_queued_first() {
        // Whether a ring is waiting: `rung` is ready at its first poll only then.
        async fn rang(expiries: &PendingExpiries) -> bool {
            tokio::select! {
                biased;
                () = expiries.rung() => true,
                () = std::future::ready(()) => false,
            }
        }
        let expiries = PendingExpiries::default();
        expiries.push(at(20), Weak::new(), Pending);
        assert!(rang(&expiries).await, "the first request rings");
        expiries.push(at(30), Weak::new(), Pending);
        assert!(!rang(&expiries).await, "a request due after the first rang");
        expiries.push(at(10), Weak::new(), Pending);
        assert!(rang(&expiries).await, "a request due first rings");
    }
}
