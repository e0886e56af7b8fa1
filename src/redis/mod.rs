//! Admission shared by broker replicas, on Redis (cargo feature `redis`; SPEC section 7).
//!
//! The shared half of a replicated [`crate::Admission`]: embedders reach it only through that
//! one API ([`crate::Admission::new`] with [`ReplicaOptions`]), which decides here first and then
//! in the replica's own [`crate::Controller`]. The types of this module stay inside the crate;
//! what it offers an embedder is the options and the outcome types under their older names
//! ([`RedisOptions`], [`SharedCounts`], [`RedisStats`], [`RedisStartError`]), and, hidden, the
//! script replies' parser (for the fuzz target) and the benchmark's rate-only baseline script.
//!
//! It keeps the in-process engine's decision contract: the same checks in the same order, the
//! same refusal codes and Retry-After rules, the same permit and lifecycle semantics. What
//! differs is where the counts live: in one Redis, shared by every replica, so a client's limits
//! and the global limits hold across all of them.
//!
//! - **One script per decision.** Each admission is decided by one atomic Lua script
//!   (`scripts/batch.lua`, run by `EVALSHA`, loaded again on `NOSCRIPT`) on Redis server time,
//!   so replicas' clocks never matter: GCRA, client and global counts, the pending-grant caps,
//!   all or nothing. The scripts are files beside this one, built in with `include_str!`.
//! - **A group commit per replica** (`commit`). Admissions and transitions go to Redis through
//!   one writer task per replica; what is waiting when it sends goes in the same script call,
//!   decided there in order, each exactly as alone. A lone call goes at once; each caller still
//!   waits for Redis to have decided its own.
//! - **Reloads rescale the buckets.** A client's bucket (its field of the hash `{prefix}:buckets`)
//!   holds its TAT with the rate (emission interval, burst span) it was written under; a decision
//!   under a different rate (a reload, on whichever replica) first rescales the used part of the
//!   span to the new span, rounded up, as the in-process engine's `Bucket::rescale` does, so a
//!   reload never hands out a fresh burst nor confiscates one. A refunded token is measured in the
//!   bucket's rate at refund time.
//! - **One hash tag.** Every key of a deployment starts with `{prefix}`, so all of them live in one
//!   Redis Cluster slot, and two deployments can share a Redis under two prefixes.
//! - **Exactly once, by operation id.** A reservation is recorded under its operation's id; every
//!   transition and release names the id, so a retry after a lost reply or a timeout never counts
//!   or frees twice.
//! - **Leases.** Each replica holds a lease (a key with a TTL) renewed by a heartbeat task; a
//!   replica that cannot renew stops admitting; the survivors release a lapsed replica's holdings
//!   exactly once (`scripts/reap.lua`); a replica that (re)registers replaces its holdings with
//!   what it holds now in one step (`scripts/replace.lua`).
//! - **Redis down at start-up.** The controller (`RedisController::connect_lazy`, behind
//!   [`crate::Admission::new`]) makes the connection on the first call (and again after each
//!   failure); registration (`RedisController::register_or_defer`, behind
//!   [`crate::Admission::restore`]) holds the restored work here and lets the heartbeat register
//!   it once Redis answers. Until then every
//!   admission is [`Unavailable`] (no lease), and nothing is admitted unchecked.
//! - **Redis down or slow.** Every call has a timeout; an admission that cannot be decided is
//!   [`Unavailable`] (503 `admission_unavailable`), never admitted unchecked; a circuit stops
//!   calling a dead Redis for a while; releases that cannot be sent are kept and retried, in
//!   order, until Redis answers.
//! - **One operation per key.** An admission records (client, idempotency key) → (operation
//!   id, replica) with the reservation, so the same key sent to two replicas admits once; the
//!   second is told which operation and replica hold it. The record lives as long as its
//!   operation: freed by a refund, a drop or an unanswered admission (the release names it), and
//!   by [`crate::Admission::retire_keys`] when the store retires the operation.
//! - **Redis forgets.** The deployment has an epoch (`{prefix}:epoch`), written by the first
//!   registration on a Redis that holds none; every admission and heartbeat checks it. A replica
//!   that finds it gone or changed registers again (`register_again`): its key records go back
//!   first (`scripts/restore_keys.lua`, from the embedder's [`RecoverySource`]), then, in the one
//!   atomic replace, its holdings and its clients' rate debts. The replace checks that the key
//!   records are still there (the restore's marker, `{prefix}:keyed:<replica>`): a Redis that
//!   forgot again meanwhile gets them restored again before anything is registered. A new epoch
//!   opens a recovery window (`{prefix}:recovery`, one lease long) in which no replica admits or
//!   starts work until every replica it knew of has registered again (`scripts/replace.lua`).
//!
//! - **Refusals from memory.** A refusal Redis gave is remembered (`memory`) and answers the
//!   client's next submissions here, without a call, until it can have changed: its next token,
//!   its hint, or a release or refund heard on the deployment's notices channel (`notices`: the
//!   scripts `PUBLISH` whenever they lower a count; one subscriber connection per replica). The
//!   memory only ever refuses; a lost subscription forgets it all.
//! - **Bounded calls.** Admission decisions in flight to Redis are bounded per replica and per
//!   client (semaphores, waited for briefly, then [`UnavailableReason::Busy`]); releases,
//!   transitions and heartbeats never wait for them. With `wait_replicas`, an admission is
//!   answered only once `WAIT` says a Redis replica holds it.
//!
//! What stays per replica: storage quotas (streams, sealed payloads) and the durable store.
//!
//! This file is one piece past the usual size because its parts share one private state
//! (`Inner`: the connection, the lease, the epoch, the kept releases, the registration lock) whose
//! rules only hold together — registration after a loss reads and rewrites all of them: the
//! options and errors come first, then the controller, then the calls it makes; its unit tests
//! (the quota arithmetic, the rate debts) close it.
//! The handles (`handles`), the reply parser (`reply`), the circuit (`circuit`), the refusal
//! memory (`memory`), the notice subscriber (`notices`) and the group commit's writer (`commit`)
//! stand alone.

mod circuit;
mod commit;
mod handles;
pub(crate) mod memory;
mod notices;
#[doc(hidden)]
pub mod reply;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};

pub use crate::admission::{
    AdmitError, BackendStats, DeploymentCounts, NotStarted, Refused, ReplicaOptions,
    RestoredOperation, SetupError, Unavailable, UnavailableReason,
};
pub use crate::admission::{KeyRecord, RecoverySource, SourceFuture};
pub(crate) use handles::{RedisOperation, RedisPermit};

use self::circuit::{Circuit, Gate};
use self::memory::{Answer, Forgotten, RefusalMemory};
use self::reply::{AdmitReply, Decided, LeaseReply, Reading, Replaced, TransitionReply};
use crate::config::{ClientLimits, Config, Identity};
use crate::engine::gcra::{self, Rate};
use crate::engine::{OperationState, QuotaStatus, Refusal, RefusalCode};

/// The script every admission and transition runs (a batch of them, in order), with the
/// helpers all scripts share. Public, hidden, for the tests that call it directly.
#[doc(hidden)]
pub const BATCH: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/batch.lua")
);
const REPLACE: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/counts.lua"),
    include_str!("scripts/replace.lua")
);
const REAP: &str = concat!(
    include_str!("scripts/shared.lua"),
    include_str!("scripts/counts.lua"),
    include_str!("scripts/reap.lua")
);
const HEARTBEAT: &str = include_str!("scripts/heartbeat.lua");
const RESTORE_KEYS: &str = include_str!("scripts/restore_keys.lua");
const RETIRE_KEYS: &str = include_str!("scripts/retire_keys.lua");
const RENEW_KEYS: &str = include_str!("scripts/renew_keys.lua");

/// Idempotency records sent to Redis in one script call, when restoring or retiring them.
const KEY_RECORDS_PER_CALL: usize = 500;

/// Registrations tried in one go when Redis keeps forgetting what they restore; after these the
/// heartbeat tries again.
const REGISTRATION_TRIES: usize = 3;
/// Operation records asked for in one `HSCAN` page, when reading a replica's holdings.
const OPERATIONS_PER_PAGE: usize = 500;
/// The benchmark's baseline: a rate token and nothing else.
#[doc(hidden)]
pub const RATE_ONLY: &str = include_str!("scripts/rate_only.lua");

/// The options of a replica (the library-wide name is [`ReplicaOptions`]).
pub type RedisOptions = ReplicaOptions;
/// The shared counts (the library-wide name is [`DeploymentCounts`]).
pub type SharedCounts = DeploymentCounts;
/// What the backend has seen (the library-wide name is [`BackendStats`]).
pub type RedisStats = BackendStats;
/// Why a start did not happen (the library-wide name is [`NotStarted`]).
pub type RedisStartError = NotStarted;

/// Every key of one deployment, under one hash tag.
struct Keys {
    base: String,
    counts: String,
    ops: String,
    replicas: String,
    /// The deployment's epoch: written by the first registration on a Redis that holds nothing
    /// of the deployment, so a Redis that forgot (restart, flush, failover) is told apart.
    epoch: String,
    /// Present while the replicas register again after Redis forgot: no admission meanwhile.
    recovery: String,
    /// The replicas expected to register again before the recovery ends.
    expected: String,
    /// Replica → the epoch it last registered in.
    members: String,
    /// The channel the scripts publish on when they lower a count (see `memory`).
    notices: String,
}

impl Keys {
    fn new(prefix: &str) -> Keys {
        let base = format!("{{{prefix}}}");
        Keys {
            counts: format!("{base}:counts"),
            ops: format!("{base}:ops"),
            replicas: format!("{base}:replicas"),
            epoch: format!("{base}:epoch"),
            recovery: format!("{base}:recovery"),
            expected: format!("{base}:expected"),
            members: format!("{base}:members"),
            notices: format!("{base}:notices"),
            base,
        }
    }
    fn lease(&self, replica: &str) -> String {
        format!("{}:lease:{replica}", self.base)
    }
    /// The set of operation ids an older build kept per replica beside the records (the records
    /// name their replica now): registration deletes it.
    fn held(&self, replica: &str) -> String {
        format!("{}:held:{replica}", self.base)
    }
    fn idempotency(&self, client: &str, key: &str) -> String {
        format!("{}:key:{client}:{key}", self.base)
    }
}

struct Scripts {
    batch: Script,
    replace: Script,
    reap: Script,
    heartbeat: Script,
    restore_keys: Script,
    retire_keys: Script,
    renew_keys: Script,
}

/// Starts a replica's notices and heartbeat when dropped: at the end of its registration,
/// whether the registration finished or its caller dropped it mid-way.
struct StartOnDrop<'a>(&'a RedisController);

impl Drop for StartOnDrop<'_> {
    fn drop(&mut self) {
        // Both are spawned tasks: outside a runtime (one shutting down) there is nothing to run
        // them, and spawning would panic.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.0.start_background();
        }
    }
}

/// Armed while a restore registers: dropped with it (the caller gave up before the restored
/// operations had handles), it takes them out of what this replica holds, as the dropped local
/// handles release them from the in-process engine. Nothing else could ever release them. The
/// local epoch is forgotten too, so the heartbeat registers this replica again (replacing its
/// holdings, whether or not the dropped registration reached Redis) rather than renewing.
/// No release by id is sent: a restore tried again under the same ids must not be undone.
struct AbandonOnDrop<'a> {
    inner: &'a Inner,
    /// What the restore holds; emptied once its registration has ended.
    cells: Vec<Arc<Held>>,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if self.cells.is_empty() {
            // Ended (or nothing restored, so nothing to take back).
            return;
        }
        {
            let mut held = self.inner.lock_held();
            for cell in &self.cells {
                if held.get(&cell.id).is_some_and(|h| Arc::ptr_eq(h, cell)) {
                    held.remove(&cell.id);
                }
            }
        }
        *crate::sync::lock(&self.inner.epoch) = None;
    }
}

/// A release kept until Redis answers: the operation and the transition's target.
#[derive(Clone, Debug)]
pub(crate) struct Kept {
    pub(crate) id: String,
    pub(crate) target: Target,
    /// The idempotency record to delete if it still names this operation: set for a release of
    /// an admission never committed (refunded, dropped, or whose answer was lost), so the key is
    /// free for the client's retry on every replica.
    pub(crate) key: Option<String>,
}

/// A release to keep if the future sending it is dropped before Redis answers: armed before the
/// first `.await`, disarmed once the release (or the decision it undoes) is settled.
pub(crate) struct KeepOnDrop<'a> {
    inner: &'a Inner,
    kept: Option<Kept>,
}

impl<'a> KeepOnDrop<'a> {
    pub(crate) fn new(inner: &'a Inner, kept: Kept) -> KeepOnDrop<'a> {
        KeepOnDrop {
            inner,
            kept: Some(kept),
        }
    }

    /// Nothing to keep: the release was sent, or nothing was reserved.
    pub(crate) fn disarm(mut self) {
        self.kept = None;
    }
}

impl Drop for KeepOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(kept) = self.kept.take() {
            self.inner.keep(kept);
        }
    }
}

/// What a transition asks the script for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Approved,
    Executing,
    Terminal,
    /// Terminal, and the rate token given back: the emission interval and the burst span (µs) it
    /// was taken under (the script measures it in the bucket's rate now, if a reload changed it).
    Refund(u64, u64),
}

impl Target {
    fn arg(self) -> &'static str {
        match self {
            Target::Approved => "a",
            Target::Executing => "e",
            Target::Terminal => "t",
            Target::Refund(..) => "r",
        }
    }
}

/// A live operation this replica holds: what re-registration counts.
pub(crate) struct Held {
    pub(crate) id: String,
    pub(crate) identity: Identity,
    pub(crate) state: std::sync::atomic::AtomicU8,
    /// Admitted here and not yet committed (its row may not be in the store yet): since when,
    /// and its idempotency key. Cleared by the commit. When Redis forgets, the recovery takes
    /// these from here, as it takes committed operations' keys and admissions from the store.
    pub(crate) uncommitted: Mutex<Option<Uncommitted>>,
}

/// What Redis must have again for a permit not yet committed, if it forgets meanwhile.
#[derive(Clone)]
pub(crate) struct Uncommitted {
    pub(crate) at: Instant,
    pub(crate) key: Option<String>,
}

impl Held {
    pub(crate) fn state(&self) -> OperationState {
        // Acquire: pairs with the AcqRel transitions (see the lifecycle's rule).
        OperationState::ALL[usize::from(self.state.load(Ordering::Acquire))]
    }
}

pub(crate) struct Inner {
    conn: ConnectionManager,
    keys: Keys,
    options: RedisOptions,
    token: String,
    scripts: Scripts,
    config: ArcSwap<Config>,
    /// Every live operation this replica holds (admitted, committed or restored), by id.
    held: Mutex<HashMap<String, Arc<Held>>>,
    /// Admissions and transitions hold it shared; (re)registration holds it alone, so what it
    /// reads from `held` is exactly what Redis holds for this replica when it runs.
    registration: tokio::sync::RwLock<()>,
    /// Held (write) by a recovery from before it reads the store's key records until it has
    /// written them back, and (read) by a retirement's second unbinding, after its rows are
    /// deleted: a key retired meanwhile is never left bound for a row already gone.
    restoring: tokio::sync::RwLock<()>,
    /// Until when the lease is surely held (the send time of the last renewal plus the TTL).
    lease_until: Mutex<Option<Instant>>,
    /// Set when the first registration (`restore`) begins: before it, an admission is
    /// [`UnavailableReason::NotRestored`], which names the embedder's missing call.
    restore_begun: AtomicBool,
    /// Since when every renewal has gone through (none failed, none found the lease lapsed):
    /// lapsed leases are reaped only once this is a whole lease old. After Redis stalled (or
    /// this replica was cut off) for a lease, every lease has lapsed, and the first replica to
    /// renew would otherwise release live work the others are about to renew.
    renewing_since: Mutex<Option<Instant>>,
    circuit: Circuit,
    outbox: Mutex<Vec<Kept>>,
    wake: Arc<tokio::sync::Notify>,
    errors: AtomicU64,
    lease_changes: AtomicU64,
    reaped: AtomicU64,
    unavailable: AtomicU64,
    heartbeat: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The deployment's epoch this replica registered in (`None` before its first registration).
    epoch: Mutex<Option<String>>,
    /// The deployment's replicas as last seen (with this one and the configured ones): who must
    /// register again before a recovery ends.
    known_replicas: Mutex<std::collections::BTreeSet<String>>,
    /// One reading of the deployment's replicas at a time, so an older reading is never applied
    /// over a newer one.
    learning: tokio::sync::Mutex<()>,
    /// Where re-registration after Redis forgot gets the key records and the rate history.
    source: std::sync::OnceLock<Arc<dyn RecoverySource>>,
    /// The heartbeat should renew (and register again) at once, not only drain kept releases.
    renew_now: AtomicBool,
    /// Whether the last registration found a recovery in progress.
    recovering: AtomicBool,
    /// Redis's refusals, answered here until they can have changed.
    memory: Arc<RefusalMemory>,
    /// Room for admission decisions in flight to Redis: in all, and per client.
    decisions: Arc<tokio::sync::Semaphore>,
    client_decisions: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    /// Submissions answered unavailable for want of that room.
    busy: AtomicU64,
    /// The task that hears the deployment's notices.
    notices: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Where the notice task connects.
    client: redis::Client,
    /// The replica's decisions on their way to Redis (see `commit`).
    queue: commit::Queue,
}

/// The admission controller shared by broker replicas through Redis. Cheap to clone.
///
/// Set up with [`RedisController::connect_lazy`], then [`RedisController::register_or_defer`]
/// with what the replica's store restores (which takes the lease and starts the heartbeat); then
/// [`RedisController::admit`] as with the in-process controller, with the operation's id (made
/// by [`crate::Admission`], never by a caller).
#[derive(Clone)]
pub(crate) struct RedisController {
    inner: Arc<Inner>,
}

/// An operation id the scripts can record: 1 to 128 visible ASCII characters.
use crate::admission::id::shareable as valid_op_id;

/// The client's quota from what the admission decision read (its bucket in µs of Redis time and
/// its counts on every replica), built as the in-process engine builds its own
/// ([`QuotaStatus::of`], with the engine's bucket arithmetic, [`gcra::level`]), so the quota
/// fields say the same thing whichever backend decided.
fn quota(
    limits: ClientLimits,
    options: &ReplicaOptions,
    (interval, span): (u64, u64),
    reading: &Reading,
) -> QuotaStatus {
    let (remaining, next_micros) = gcra::level(
        reading.tat_micros,
        reading.now_micros,
        Rate { interval, span },
    );
    QuotaStatus::of(
        limits,
        options.caps.grant_client,
        secs_at_least_one(options.capacity_retry),
        (remaining, next_micros.saturating_mul(1000)),
        reading.active,
        reading.pending,
    )
}

fn secs_at_least_one(d: Duration) -> Duration {
    crate::engine::refusal::retry_after(crate::clock::duration_nanos(d))
}

/// A rate in Redis's unit (µs): the emission interval and the burst span.
fn rate_micros(requests: u32, window_seconds: u32) -> (u64, u64) {
    let requests = u64::from(requests.max(1));
    let window = u64::from(window_seconds.max(1)) * 1_000_000;
    let interval = (window / requests).max(1);
    (interval, interval * requests)
}

impl RedisController {
    /// The shared controller of one replica, without waiting for Redis: the connection is made
    /// by the first call and made again after each failure, so a replica can start while Redis
    /// is down (see [`RedisController::register_or_defer`]). Fails only on invalid options or
    /// URL, or when called outside a Tokio runtime. Admits nothing until registration has taken
    /// the lease.
    pub(crate) fn connect_lazy(
        config: Config,
        options: RedisOptions,
    ) -> Result<RedisController, SetupError> {
        options.check()?;
        // The connection manager and the replica's background tasks are spawned on the
        // caller's runtime: outside one they would panic, so say what is missing instead.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(SetupError::Options(
                "a replica needs a Tokio runtime: build the Admission inside one \
                 (in an async fn under #[tokio::main], or within Runtime::block_on)"
                    .to_owned(),
            ));
        }
        let client = redis::Client::open(options.url.as_str())
            .map_err(|e| SetupError::Redis(e.to_string()))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.call_timeout))
            .set_response_timeout(Some(options.call_timeout))
            .set_number_of_retries(1)
            .set_max_delay(options.call_timeout);
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager_config)
            .map_err(|e| SetupError::Redis(e.to_string()))?;
        let mut token_bytes = [0u8; 16];
        fill_random(&mut token_bytes);
        let token: String = token_bytes.iter().map(|b| format!("{b:02x}")).collect();
        let (queue, jobs) = commit::queue();
        let inner = Inner {
            queue,
            conn,
            keys: Keys::new(&options.prefix),
            circuit: Circuit::new(options.circuit_threshold, options.circuit_cool_down),
            token,
            scripts: Scripts {
                batch: Script::new(BATCH),
                replace: Script::new(REPLACE),
                reap: Script::new(REAP),
                heartbeat: Script::new(HEARTBEAT),
                restore_keys: Script::new(RESTORE_KEYS),
                retire_keys: Script::new(RETIRE_KEYS),
                renew_keys: Script::new(RENEW_KEYS),
            },
            config: ArcSwap::from_pointee(config),
            held: Mutex::new(HashMap::new()),
            registration: tokio::sync::RwLock::new(()),
            restoring: tokio::sync::RwLock::new(()),
            lease_until: Mutex::new(None),
            restore_begun: AtomicBool::new(false),
            renewing_since: Mutex::new(None),
            outbox: Mutex::new(Vec::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
            errors: AtomicU64::new(0),
            lease_changes: AtomicU64::new(0),
            reaped: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            heartbeat: Mutex::new(None),
            epoch: Mutex::new(None),
            known_replicas: Mutex::new(
                options
                    .replicas
                    .iter()
                    .cloned()
                    .chain(std::iter::once(options.replica.clone()))
                    .collect(),
            ),
            learning: tokio::sync::Mutex::new(()),
            source: std::sync::OnceLock::new(),
            renew_now: AtomicBool::new(false),
            recovering: AtomicBool::new(false),
            memory: Arc::new(RefusalMemory::default()),
            decisions: Arc::new(tokio::sync::Semaphore::new(options.decisions_in_flight)),
            client_decisions: Mutex::new(HashMap::new()),
            busy: AtomicU64::new(0),
            notices: Mutex::new(None),
            client,
            options,
        };
        let inner = Arc::new(inner);
        // The writer holds the replica only while a batch is in flight, and ends with it.
        tokio::spawn(commit::write(Arc::downgrade(&inner), jobs));
        Ok(RedisController { inner })
    }

    /// This replica's name.
    pub(crate) fn replica(&self) -> &str {
        &self.inner.options.replica
    }

    /// Registers this replica: whatever Redis holds for it (from an earlier run under the same
    /// name) is released and `restored` counted instead — even above a limit, so new work is
    /// refused until it drains — and the lease is taken, all in one atomic step. Starts the
    /// heartbeat. Returns a handle per restored operation, in order.
    ///
    /// If Redis does not answer now the replica still starts: `restored` is held here (its handles work; releases are kept), every admission is
    /// [`Unavailable`] (no lease), and the heartbeat registers it — the same atomic replace —
    /// as soon as Redis answers, after which admissions are decided. Returns the handles and, if
    /// registration was deferred, why.
    pub(crate) async fn register_or_defer(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> (Vec<RedisOperation>, Option<Unavailable>) {
        // Relaxed: only ever set, and read for which reason an admission names.
        self.inner.restore_begun.store(true, Ordering::Relaxed);
        let cells = {
            let _alone = self.inner.registration.write().await;
            self.hold_restored(restored)
        };
        // The notices and the heartbeat start once the registration below has ended — or been
        // dropped mid-way (the caller gave up): then the heartbeat registers this replica, as
        // when Redis does not answer now, without what the dropped restore held (see
        // `AbandonOnDrop`).
        let start = StartOnDrop(self);
        let mut abandon = AbandonOnDrop {
            inner: &self.inner,
            cells: cells.clone(),
        };
        let deferred = self.inner.register_again().await.err();
        abandon.cells.clear();
        drop(abandon);
        drop(start);
        (self.handles(cells), deferred)
    }

    /// The notices (with the refusal memory on) and the heartbeat, if not running.
    fn start_background(&self) {
        // Heard only after this replica's own registration: its `*` could only end refusals
        // remembered before (there are none yet), and heard late, it would keep this replica's
        // first refusals from being remembered.
        if self.inner.options.refusal_memory {
            self.start_notices();
        }
        self.start_heartbeat();
    }

    fn handles(&self, cells: Vec<Arc<Held>>) -> Vec<RedisOperation> {
        cells
            .into_iter()
            .map(|cell| RedisOperation::new(Arc::clone(&self.inner), cell))
            .collect()
    }

    /// Makes `restored` (the live part) what this replica holds. The caller holds `registration`
    /// alone.
    fn hold_restored(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> Vec<Arc<Held>> {
        let mut cells = Vec::new();
        for op in restored {
            if op.state.is_terminal() || !valid_op_id(&op.id) {
                continue;
            }
            cells.push(Arc::new(Held {
                id: op.id,
                identity: op.identity,
                state: std::sync::atomic::AtomicU8::new(op.state as u8),
                uncommitted: Mutex::new(None),
            }));
        }
        let mut held = self.inner.lock_held();
        held.clear();
        for cell in &cells {
            held.insert(cell.id.clone(), Arc::clone(cell));
        }
        cells
    }

    fn start_heartbeat(&self) {
        let mut slot = crate::sync::lock(&self.inner.heartbeat);
        if slot.is_some() {
            return;
        }
        // The task holds the controller only while it works, never while it waits, so dropping
        // every handle of a replica ends it (and its lease lapses).
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let wake = Arc::clone(&self.inner.wake);
        let period = self.inner.options.heartbeat;
        *slot = Some(tokio::spawn(async move {
            // The next beat is a deadline, not a sleep started afresh on every wake: kept
            // releases may wake this task more often than the period, and the lease must still
            // be renewed every period.
            let mut beat = tokio::time::Instant::now() + period;
            loop {
                let woken = tokio::select! {
                    _ = wake.notified() => true,
                    _ = tokio::time::sleep_until(beat) => false,
                };
                let Some(inner) = weak.upgrade() else { return };
                // Relaxed: a hint; a missed one waits for the next beat.
                let due = !woken
                    || inner.renew_now.swap(false, Ordering::Relaxed)
                    || tokio::time::Instant::now() >= beat;
                if due {
                    beat = tokio::time::Instant::now() + period;
                    inner.tick(beat.into_std()).await;
                } else {
                    // Never past the next beat: however many releases wait, the lease is
                    // renewed on time.
                    inner.drain_until(Some(beat.into_std())).await;
                }
            }
        }));
    }

    fn start_notices(&self) {
        let mut slot = crate::sync::lock(&self.inner.notices);
        if slot.is_none() {
            *slot = Some(tokio::spawn(notices::listen(
                self.inner.client.clone(),
                self.inner.keys.notices.clone(),
                Arc::clone(&self.inner.memory),
                self.inner.options.heartbeat,
                self.inner.options.call_timeout,
            )));
        }
    }

    /// Stops the heartbeat (the lease then lapses unless another process under this name renews
    /// it) and the notices. Kept releases are sent first if Redis answers.
    pub(crate) async fn shutdown(&self) {
        self.inner.drain().await;
        let task = crate::sync::lock(&self.inner.heartbeat).take();
        if let Some(task) = task {
            task.abort();
        }
        let task = crate::sync::lock(&self.inner.notices).take();
        if let Some(task) = task {
            task.abort();
        }
        self.inner.memory.unsubscribed();
    }

    /// Decides one submission by `identity` for the operation `id` (unique, chosen by the
    /// broker before admitting), in the contract's order: the client is configured → a rate
    /// token → client active → (if it needs approval) client pending and the pending grants →
    /// global active → global executing. With an `idempotency_key`, the same key already bound
    /// to an operation (on any replica) answers [`AdmitError::Replay`] and reserves nothing.
    ///
    /// Retrying with the same `id` after a lost reply never counts twice.
    pub(crate) async fn admit(
        &self,
        identity: &str,
        needs_approval: bool,
        id: &str,
        idempotency_key: Option<&str>,
    ) -> Result<RedisPermit, AdmitError> {
        let inner = &self.inner;
        let unconfigured = || {
            Err(AdmitError::Refused(Refused {
                refusal: Refusal {
                    code: RefusalCode::ClientUnconfigured,
                    retry_after: Duration::ZERO,
                },
                quota: None,
            }))
        };
        if inner.config.load().effective(identity).is_none() {
            return unconfigured();
        }
        // Before the limits are read: a reload (or a notice) from here on keeps the answer from
        // being remembered, so a refusal under limits no longer in force is never answered again.
        // (Only for a configured identity: the memory holds one entry per client it is given.)
        let ticket = inner.memory.ticket(identity);
        let config = inner.config.load();
        let Some(limits) = config.effective(identity) else {
            return unconfigured();
        };
        let identity = Identity::new(identity).expect("a configured identity is valid");
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        if let Some(refused) = inner.recall(identity.as_str(), needs_approval) {
            return Err(AdmitError::Refused(refused));
        }
        if !valid_op_id(id) {
            return Err(AdmitError::Unavailable(inner.unavailable(
                UnavailableReason::Reply(format!("operation id {id:?} cannot be recorded")),
            )));
        }
        if inner.is_kept(id) {
            return Err(AdmitError::Unavailable(inner.unavailable(
                UnavailableReason::Reply(format!(
                    "operation id {id} was given up after an unanswered admission; use a new id"
                )),
            )));
        }
        if !inner.lease_held() {
            // Relaxed: see `restore_begun`.
            let reason = if inner.restore_begun.load(Ordering::Relaxed) {
                UnavailableReason::LeaseNotHeld
            } else {
                UnavailableReason::NotRestored
            };
            return Err(AdmitError::Unavailable(inner.unavailable(reason)));
        }
        // Room to decide: this client's share first, then the replica's, each waited for
        // briefly. Released when this call ends, however it ends.
        let _room = match inner.room(identity.as_str()).await {
            Some(room) => room,
            None => {
                // Relaxed: a statistic.
                inner.busy.fetch_add(1, Ordering::Relaxed);
                return Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::Busy),
                ));
            }
        };
        // A refusal that came back while this call waited answers it too.
        if let Some(refused) = inner.recall(identity.as_str(), needs_approval) {
            return Err(AdmitError::Refused(refused));
        }
        if let Gate::Open(_) = inner.circuit.enter() {
            return Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::CircuitOpen),
            ));
        }
        let caps = inner.options.caps;
        let global = config.limits();
        let idem_key = idempotency_key.map(|k| inner.keys.idempotency(identity.as_str(), k));
        let decision = commit::Decision::Admit {
            id: id.to_string(),
            client: identity.as_str().to_string(),
            needs_approval,
            limits: commit::AdmitLimits {
                rate: (interval, span),
                client_active: limits.active,
                client_pending: limits.pending,
                grant_client: caps.grant_client,
                grant_global: caps.grant_global,
                global_active: global.global_active,
                global_executing: global.global_executing,
                remembered_millis: inner.remembered_millis(),
            },
            key: idem_key.clone(),
            key_ttl_millis: inner.options.idempotency_ttl.map_or(0, ttl_millis),
        };
        let cell = Arc::new(Held {
            id: id.to_string(),
            identity: identity.clone(),
            state: std::sync::atomic::AtomicU8::new(if needs_approval {
                OperationState::Pending as u8
            } else {
                OperationState::Approved as u8
            }),
            uncommitted: Mutex::new(Some(Uncommitted {
                at: Instant::now(),
                key: idempotency_key.map(str::to_owned),
            })),
        });
        // From here on the script may run: if this future is dropped, or the reply is lost or
        // unreadable, release by id (a no-op if it never ran), key binding included, so a
        // reservation never outlives an answer that was not "admitted".
        let undo = KeepOnDrop::new(
            inner,
            Kept {
                id: id.to_string(),
                target: Target::Terminal,
                key: idem_key.clone(),
            },
        );
        let _shared = inner.registration.read().await;
        let reply = match inner.decide(decision).await {
            Ok(Decided::Admit(reply)) => reply,
            Ok(Decided::Transition(_)) => {
                return Err(AdmitError::Unavailable(inner.unavailable(
                    UnavailableReason::Reply("a transition's reply to an admission".into()),
                )));
            }
            Err(reason) => return Err(AdmitError::Unavailable(inner.unavailable(reason))),
        };
        // Asked to, an admission is answered only once a Redis replica holds it: not
        // acknowledged in time, it is given back (the armed undo keeps its release).
        if matches!(reply, AdmitReply::Admitted(_))
            && let Err(reason) = inner.acknowledged().await
        {
            return Err(AdmitError::Unavailable(inner.unavailable(reason)));
        }
        // A definite answer: the permit below takes the reservation over, or nothing was made.
        undo.disarm();
        match reply {
            AdmitReply::Admitted(_) | AdmitReply::Duplicate => {
                if matches!(reply, AdmitReply::Admitted(_)) {
                    // What Redis would answer this client next may differ from what is
                    // remembered (a token spent, a slot taken).
                    inner.memory.admitted_here(identity.as_str());
                }
                let quota = match &reply {
                    AdmitReply::Admitted(reading) => {
                        Some(quota(limits, &inner.options, (interval, span), reading))
                    }
                    _ => None,
                };
                inner.lock_held().insert(cell.id.clone(), Arc::clone(&cell));
                Ok(RedisPermit::new(
                    Arc::clone(inner),
                    cell,
                    needs_approval,
                    (interval, span),
                    idem_key,
                    quota,
                ))
            }
            AdmitReply::Replay { id, replica } => Err(AdmitError::Replay {
                operation: id,
                replica,
            }),
            AdmitReply::Lease => {
                inner.lease_lost();
                // Register again now rather than at the next beat (Redis may have forgotten).
                inner.renew_soon();
                Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::LeaseNotHeld),
                ))
            }
            AdmitReply::Recovering => Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::Recovering),
            )),
            AdmitReply::Refused {
                code,
                rate_wait_micros,
                capacity,
                reading,
            } => {
                let capacity_hint =
                    capacity.then(|| secs_at_least_one(inner.options.capacity_retry));
                let wait_nanos = rate_wait_micros
                    .saturating_mul(1000)
                    .max(capacity_hint.map_or(0, |h| h.as_nanos() as u64));
                if let Some(ticket) = ticket {
                    inner.memory.remember(
                        identity.as_str(),
                        ticket,
                        Answer {
                            code,
                            needs_approval,
                            rate_wait_micros,
                            capacity_hint,
                            limits,
                            rate: (interval, span),
                            reading,
                        },
                    );
                }
                Err(AdmitError::Refused(Refused {
                    refusal: Refusal::after_nanos(code, wait_nanos),
                    quota: Some(quota(limits, &inner.options, (interval, span), &reading)),
                }))
            }
        }
    }

    /// Swaps in a new, already validated configuration; the next decision uses it (and no
    /// refusal remembered under the old limits answers again).
    pub(crate) fn reload(&self, config: Config) {
        // A removed client's room goes; a kept one's stays, with the decisions in flight on it
        // (made anew, it would let that many more in beside them).
        crate::sync::lock(&self.inner.client_decisions)
            .retain(|client, _| config.effective(client).is_some());
        self.inner.config.store(Arc::new(config));
        self.inner.memory.forget_all(Forgotten::Reload);
    }

    /// The shared counts now, across every replica.
    pub(crate) async fn counts(&self) -> Result<SharedCounts, Unavailable> {
        let inner = &self.inner;
        let mut pipe = redis::pipe();
        pipe.hgetall(&inner.keys.counts).hlen(&inner.keys.ops);
        let mut conn = inner.conn.clone();
        let (fields, operations): (HashMap<String, u64>, u64) =
            match tokio::time::timeout(inner.options.call_timeout, pipe.query_async(&mut conn))
                .await
            {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
        let mut counts = SharedCounts {
            operations,
            ..SharedCounts::default()
        };
        for (field, n) in fields {
            match field.split_once(':') {
                None => match field.as_str() {
                    "active" => counts.active = n,
                    "pending" => counts.pending = n,
                    "executing" => counts.executing = n,
                    _ => {}
                },
                Some((kind, client)) => {
                    let entry = counts.clients.entry(client.to_string()).or_default();
                    match kind {
                        "a" => entry.0 = n,
                        "p" => entry.1 = n,
                        "e" => entry.2 = n,
                        _ => {}
                    }
                }
            }
        }
        Ok(counts)
    }

    /// The client's quota as the deployment sees it now (its bucket, and its counts on every
    /// replica), for an answer that decided nothing, such as a replay: one `MULTI` of plain
    /// reads on Redis time, no script, nothing written. A bucket written under another rate is
    /// read in the rate in force, as the next decision would rescale it. `Ok(None)` for an
    /// identity with no quota (not configured). While the circuit is open it answers at once,
    /// unavailable, without asking Redis.
    pub(crate) async fn quota_now(
        &self,
        identity: &str,
    ) -> Result<Option<QuotaStatus>, Unavailable> {
        let inner = &self.inner;
        let Some(limits) = inner.config.load().effective(identity) else {
            return Ok(None);
        };
        if inner.circuit.is_open() {
            return Err(inner.unavailable(UnavailableReason::CircuitOpen));
        }
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("TIME")
            .hget(format!("{}:buckets", inner.keys.base), identity)
            .cmd("HMGET")
            .arg(&inner.keys.counts)
            .arg(format!("a:{identity}"))
            .arg(format!("p:{identity}"));
        let mut conn = inner.conn.clone();
        let value: Value =
            match tokio::time::timeout(inner.options.call_timeout, pipe.query_async(&mut conn))
                .await
            {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
        let read = reply::parse_client_reading(&value)
            .map_err(|e| inner.unavailable(UnavailableReason::Reply(e.to_string())))?;
        let now = read.now_micros;
        let tat = read.bucket.map_or(0, |bucket| match bucket.span_micros {
            Some(old) if old != span => gcra::rescaled(bucket.tat_micros, now, old, span),
            _ => bucket.tat_micros,
        });
        let reading = Reading {
            tat_micros: tat,
            now_micros: now,
            active: read.active,
            pending: read.pending,
        };
        Ok(Some(quota(
            limits,
            &inner.options,
            (interval, span),
            &reading,
        )))
    }

    /// Releases, exactly once, what every replica whose lease has lapsed held; returns how many
    /// operations were released. The heartbeat does this on every beat.
    pub(crate) async fn reap(&self) -> Result<u64, Unavailable> {
        self.inner.reap().await
    }

    /// Sends the releases kept while Redis did not answer; returns whether none is left.
    pub(crate) async fn flush(&self) -> bool {
        self.inner.drain().await
    }

    /// Renews the lease now (as the heartbeat does), re-registering if it lapsed.
    pub(crate) async fn renew(&self) -> Result<(), Unavailable> {
        self.inner.renew().await
    }

    /// Where re-registration after Redis forgot reads the key records and the rate history.
    /// The first source set stays.
    pub fn set_source(&self, source: Arc<dyn RecoverySource>) {
        let _ = self.inner.source.set(source);
    }

    /// Unbinds retired operations' keys (see [`crate::Admission::retire_keys`]).
    pub async fn retire_keys(&self, records: &[KeyRecord]) -> Result<(), Unavailable> {
        self.inner.retire_keys(records).await
    }

    /// Unbinds retired operations' keys, runs `delete`, then unbinds them again while no
    /// recovery is restoring keys (see [`crate::Admission::retire_keys_then`]). A recovery that
    /// read the rows before the deletion restored its keys either before that second unbinding
    /// (which removes them again) or, excluded, not at all; one that reads after it finds no
    /// row. Nothing waits on the store under the exclusion, so a recovery never waits for a busy
    /// store.
    pub async fn retire_keys_then<T>(
        &self,
        records: &[KeyRecord],
        delete: impl std::future::Future<Output = T>,
    ) -> Result<T, Unavailable> {
        self.inner.retire_keys(records).await?;
        let deleted = delete.await;
        let _no_restore = self.inner.restoring.read().await;
        if let Err(err) = self.inner.retire_keys(records).await {
            // Only a recovery that ran between the deletion and now could have bound them
            // again; the other replicas then answer them as held elsewhere until the key
            // lifetime ends, and this replica unbinds one as stale when it is submitted here.
            tracing::warn!(error = %err, "retired keys could not be unbound a second time after their rows were deleted");
        }
        Ok(deleted)
    }

    /// Gives live operations' keys their whole lifetime again (see
    /// [`crate::Admission::renew_keys`]); how many were renewed.
    pub async fn renew_keys(&self, records: &[KeyRecord]) -> Result<u64, Unavailable> {
        self.inner.renew_keys(records).await
    }

    /// What Redis holds under this replica's name now: operation id → state — the operations
    /// whose records name this replica, read a page at a time (`HSCAN`: the operations hash holds
    /// only live operations, and no read here holds Redis up for long).
    pub async fn holdings(
        &self,
    ) -> Result<std::collections::BTreeMap<String, OperationState>, Unavailable> {
        let inner = &self.inner;
        // Its caller may hold what exempt paths wait for (the broker's counts gate): a Redis
        // known not to answer is not asked, and the whole scan, every page, gets one call's time.
        if inner.circuit.is_open() {
            return Err(inner.unavailable(UnavailableReason::CircuitOpen));
        }
        let deadline = tokio::time::Instant::now() + inner.options.call_timeout;
        let mut conn = inner.conn.clone();
        let mut holdings = std::collections::BTreeMap::new();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<(String, String)>) = match tokio::time::timeout_at(
                deadline,
                redis::cmd("HSCAN")
                    .arg(&inner.keys.ops)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(OPERATIONS_PER_PAGE)
                    .query_async(&mut conn),
            )
            .await
            {
                Ok(Ok(page)) => page,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
            for (id, record) in page {
                let mut fields = record.split(' ');
                let (state, owner) = (fields.next(), fields.next());
                if owner != Some(inner.options.replica.as_str()) {
                    continue;
                }
                let state = match state {
                    Some("p") => OperationState::Pending,
                    Some("a") => OperationState::Approved,
                    Some("e") => OperationState::Executing,
                    // Not a record this build writes: counted as nothing; the drift shows it.
                    _ => continue,
                };
                // (HSCAN may return a field twice across pages: the map keeps one.)
                holdings.insert(id, state);
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(holdings)
    }

    /// What this replica's backend has seen.
    pub(crate) fn stats(&self) -> RedisStats {
        let inner = &self.inner;
        // Relaxed: statistics.
        RedisStats {
            errors: inner.errors.load(Ordering::Relaxed),
            lease_changes: inner.lease_changes.load(Ordering::Relaxed),
            reaped: inner.reaped.load(Ordering::Relaxed),
            unavailable: inner.unavailable.load(Ordering::Relaxed),
            outbox: crate::sync::lock(&inner.outbox).len() as u64,
            lease_held: inner.lease_held(),
            circuit_open: inner.circuit.is_open(),
            // Relaxed: a reading for metrics.
            recovering: inner.recovering.load(Ordering::Relaxed),
            refusals_from_memory: inner.memory.answered(),
            refusals_forgotten: inner.memory.forgotten(),
            notices_live: inner.memory.is_live(),
            // Relaxed: a statistic.
            busy: inner.busy.load(Ordering::Relaxed),
        }
    }
}

/// 16 bytes of [`fill_random`] as 32 hex digits (an epoch, a restore's nonce).
fn random_hex() -> String {
    let mut bytes = [0u8; 16];
    fill_random(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn fill_random(bytes: &mut [u8]) {
    // Unique enough to tell two processes under one replica name apart: time, process, address.
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        let mut h = state.build_hasher();
        h.write_usize(i);
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        let v = h.finish().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// How much longer than a remembered refusal can last Redis keeps the refusal marker (see
/// `scripts/batch.lua`): room for the reply's trip back and a replica clock that runs slow
/// against Redis's. A marker that ends early only lets a release go unheard, so a refusal lasts
/// to its own wait or hint, as Redis would have answered.
const MARKER_SLACK: Duration = Duration::from_secs(2);

impl Inner {
    /// How long past its rate wait this replica may remember a refusal, in ms (0 when it
    /// remembers none): a capacity refusal is remembered for its hint, a rate refusal for its
    /// wait (`memory`), and the slack on top.
    fn remembered_millis(&self) -> u64 {
        if !self.options.refusal_memory {
            return 0;
        }
        let longest = secs_at_least_one(self.options.capacity_retry) + MARKER_SLACK;
        u64::try_from(longest.as_millis()).unwrap_or(u64::MAX)
    }

    /// A remembered refusal answering `client`'s submission now, as the answer gives it: the
    /// code, Retry-After counted down from the remembered moment, and the quota read from the
    /// remembered reading advanced by the time that passed.
    fn recall(&self, client: &str, needs_approval: bool) -> Option<Refused> {
        let recalled = self.memory.recall(client, needs_approval, Instant::now())?;
        Some(Refused {
            refusal: Refusal::after_nanos(
                recalled.code,
                u64::try_from(recalled.wait_left.as_nanos()).unwrap_or(u64::MAX),
            ),
            quota: Some(quota(
                recalled.limits,
                &self.options,
                recalled.rate,
                &recalled.reading,
            )),
        })
    }

    /// With [`ReplicaOptions::wait_replicas`], waits (`WAIT`, on the connection the admission
    /// was written on) until that many Redis replicas hold every write made so far, for half the
    /// call timeout at most.
    async fn acknowledged(&self) -> Result<(), UnavailableReason> {
        let wanted = self.options.wait_replicas;
        if wanted == 0 {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        // Redis answers WAIT after half the call timeout at most, well within the connection's
        // own reply timeout (the call timeout).
        let millis = ttl_millis(self.options.call_timeout / 2);
        let acked = tokio::time::timeout(
            self.options.call_timeout,
            redis::cmd("WAIT")
                .arg(wanted)
                .arg(millis)
                .query_async::<u64>(&mut conn),
        )
        .await;
        match acked {
            Ok(Ok(n)) if n >= u64::from(wanted) => Ok(()),
            Ok(Ok(n)) => Err(UnavailableReason::Redis(format!(
                "{n} of {wanted} redis replicas acknowledged the admission in time"
            ))),
            Ok(Err(e)) => Err(UnavailableReason::Redis(e.to_string())),
            Err(_) => Err(UnavailableReason::Timeout),
        }
    }

    /// Room for one decision in flight: `client`'s share, then the replica's, each waited for at
    /// most the decision wait (`None`: no room came).
    async fn room(
        &self,
        client: &str,
    ) -> Option<(
        tokio::sync::OwnedSemaphorePermit,
        tokio::sync::OwnedSemaphorePermit,
    )> {
        let share = Arc::clone(
            crate::sync::lock(&self.client_decisions)
                .entry(client.to_owned())
                .or_insert_with(|| {
                    Arc::new(tokio::sync::Semaphore::new(
                        self.options.client_decisions_in_flight,
                    ))
                }),
        );
        let deadline = tokio::time::Instant::now() + self.options.decision_wait;
        let own = tokio::time::timeout_at(deadline, share.acquire_owned())
            .await
            .ok()?
            .ok()?;
        let all = tokio::time::timeout_at(deadline, Arc::clone(&self.decisions).acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some((own, all))
    }

    pub(crate) fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Held>>> {
        crate::sync::lock(&self.held)
    }

    fn lease_held(&self) -> bool {
        crate::sync::lock(&self.lease_until).is_some_and(|until| Instant::now() < until)
    }

    fn lease_lost(&self) {
        let was = crate::sync::lock(&self.lease_until).take();
        if was.is_some() {
            // Relaxed: a statistic.
            self.lease_changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn unavailable(&self, reason: UnavailableReason) -> Unavailable {
        // Relaxed: a statistic.
        self.unavailable.fetch_add(1, Ordering::Relaxed);
        Unavailable {
            reason,
            retry_after: secs_at_least_one(self.options.unavailable_retry),
        }
    }

    /// Counts a failed call and answers unavailable.
    fn failed(&self, reason: UnavailableReason) -> Unavailable {
        // Relaxed: a statistic.
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.circuit.failed();
        self.unavailable(reason)
    }

    /// Runs one script with the call timeout, through the circuit's accounting.
    async fn call(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Value, UnavailableReason> {
        let mut conn = self.conn.clone();
        let result = tokio::time::timeout(
            self.options.call_timeout,
            invocation.invoke_async::<Value>(&mut conn),
        )
        .await;
        let reason = match result {
            Ok(Ok(value)) => {
                self.circuit.succeeded();
                return Ok(value);
            }
            Ok(Err(e)) => UnavailableReason::Redis(e.to_string()),
            Err(_) => UnavailableReason::Timeout,
        };
        // Relaxed: a statistic.
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.circuit.failed();
        Err(reason)
    }

    fn is_kept(&self, id: &str) -> bool {
        crate::sync::lock(&self.outbox).iter().any(|k| k.id == id)
    }

    /// Keeps a release to send when Redis answers, and wakes the sender.
    pub(crate) fn keep(&self, kept: Kept) {
        crate::sync::lock(&self.outbox).push(kept);
        self.wake.notify_one();
    }

    /// Moves `id` in the shared counts (in the replica's next batch, see `commit`).
    pub(crate) async fn transition(
        &self,
        id: &str,
        target: Target,
        key: Option<&str>,
    ) -> Result<TransitionReply, UnavailableReason> {
        let decision = commit::Decision::Move {
            id: id.to_string(),
            target,
            global_executing: self.config.load().limits().global_executing,
            key: key.map(str::to_string),
        };
        match self.decide(decision).await? {
            Decided::Transition(reply) => Ok(reply),
            Decided::Admit(_) => Err(UnavailableReason::Reply(
                "an admission's reply to a transition".into(),
            )),
        }
    }

    /// Sends a release now, or keeps it for later if Redis does not answer (or earlier releases
    /// are still waiting, so they go first). Dropped before Redis answers, it is kept too.
    pub(crate) async fn release(&self, kept: Kept) {
        let waiting = !crate::sync::lock(&self.outbox).is_empty();
        let (id, target, key) = (kept.id.clone(), kept.target, kept.key.clone());
        let undo = KeepOnDrop::new(self, kept);
        if !waiting && !self.circuit.is_open() {
            let _shared = self.registration.read().await;
            if self.transition(&id, target, key.as_deref()).await.is_ok() {
                undo.disarm();
            }
        }
    }

    /// Sends kept releases in order until one fails; returns whether none is left.
    async fn drain(&self) -> bool {
        self.drain_until(None).await
    }

    /// [`Inner::drain`], stopping at `deadline` if one is given (the rest go on the next call).
    async fn drain_until(&self, deadline: Option<Instant>) -> bool {
        let _shared = self.registration.read().await;
        loop {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return crate::sync::lock(&self.outbox).is_empty();
            }
            let next = crate::sync::lock(&self.outbox).first().cloned();
            let Some(kept) = next else { return true };
            if self
                .transition(&kept.id, kept.target, kept.key.as_deref())
                .await
                .is_err()
            {
                return false;
            }
            let mut outbox = crate::sync::lock(&self.outbox);
            if outbox.first().is_some_and(|k| k.id == kept.id) {
                outbox.remove(0);
            }
        }
    }

    /// One heartbeat: the lease, kept releases (until `next_beat`), then lapsed replicas, once
    /// this replica has renewed without a break for a whole lease. The lease goes first: kept
    /// releases could otherwise keep a live replica from renewing for as long as they come.
    async fn tick(&self, next_beat: Instant) {
        let renewed = self.renew().await.is_ok();
        self.drain_until(Some(next_beat)).await;
        let steady = crate::sync::lock(&self.renewing_since)
            .is_some_and(|since| since.elapsed() >= self.options.lease_ttl);
        if renewed && steady {
            let _ = self.reap().await;
        }
    }

    async fn renew(&self) -> Result<(), Unavailable> {
        let sent = Instant::now();
        let mut invocation = self.scripts.heartbeat.prepare_invoke();
        invocation
            .key(self.keys.lease(&self.options.replica))
            .key(&self.keys.epoch)
            .key(&self.keys.recovery)
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl))
            .arg(self.epoch().unwrap_or_default());
        let value = match self.call(&invocation).await {
            Ok(v) => v,
            Err(reason) => {
                *crate::sync::lock(&self.renewing_since) = None;
                return Err(self.unavailable(reason));
            }
        };
        let renewed = matches!(
            reply::parse_lease(&value),
            Ok(LeaseReply::Renewed | LeaseReply::RenewedRecovering)
        );
        {
            let mut since = crate::sync::lock(&self.renewing_since);
            match (renewed, *since) {
                (true, None) => *since = Some(sent),
                (false, _) => *since = None,
                (true, Some(_)) => {}
            }
        }
        match reply::parse_lease(&value) {
            Ok(reply @ (LeaseReply::Renewed | LeaseReply::RenewedRecovering)) => {
                // Relaxed: a statistic (`admission_redis_recovering`), set at registration and
                // cleared here once the recovery window has closed.
                self.recovering
                    .store(reply == LeaseReply::RenewedRecovering, Ordering::Relaxed);
                *crate::sync::lock(&self.lease_until) = Some(sent + self.options.lease_ttl);
                self.learn_replicas(reply == LeaseReply::RenewedRecovering)
                    .await;
                Ok(())
            }
            Ok(LeaseReply::Lapsed) | Ok(LeaseReply::Lost) => {
                // Cut off for longer than the lease (the others may have released what this
                // replica held), or Redis forgot the deployment: count again what it holds now,
                // as a restart would, and after a loss its key records and rate buckets too.
                self.lease_lost();
                self.register_again().await
            }
            Ok(LeaseReply::Taken) => {
                self.lease_lost();
                Err(self.unavailable(UnavailableReason::LeaseNotHeld))
            }
            Err(e) => Err(self.unavailable(UnavailableReason::Reply(e.to_string()))),
        }
    }

    /// The epoch this replica registered in, if it has.
    fn epoch(&self) -> Option<String> {
        crate::sync::lock(&self.epoch).clone()
    }

    /// Asks the heartbeat to renew (and register again if need be) now.
    fn renew_soon(&self) {
        // Relaxed: a hint read by the heartbeat after it is woken.
        self.renew_now.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// Remembers the deployment's replicas as Redis lists them now, for a later recovery.
    /// `recovering`: the heartbeat found a recovery under way.
    async fn learn_replicas(&self, recovering: bool) {
        let _one = self.learning.lock().await;
        let mut conn = self.conn.clone();
        // One atomic read: the set, and whether it is the whole deployment's (the epoch this
        // replica registered in, and no recovery under way) at that very moment.
        let mut read = redis::pipe();
        read.atomic()
            .smembers(&self.keys.replicas)
            .get(&self.keys.epoch)
            .exists(&self.keys.recovery);
        let reply = tokio::time::timeout(
            self.options.call_timeout,
            read.query_async::<(Vec<String>, Option<String>, bool)>(&mut conn),
        )
        .await;
        let Ok(Ok((members, epoch, recovery))) = reply else {
            return;
        };
        let mut known = crate::sync::lock(&self.known_replicas);
        if !recovering && !recovery && epoch.is_some() && epoch == self.epoch() {
            // With no recovery under way every live replica is in the set: one it no longer
            // lists was reaped (its lease lapsed, its work released), and is not waited for at
            // the next recovery. Names given with `replicas` always stay. During a recovery, or
            // after Redis forgot, the set is partial and nothing is forgotten.
            let configured = &self.options.replicas;
            known.retain(|name| *name == self.options.replica || configured.contains(name));
        }
        known.extend(members.into_iter().filter(|m| Identity::new(m).is_ok()));
    }

    /// The permits this replica admitted and has not committed: (id, client, what Redis needs
    /// again). Read once the admissions in flight have answered (they hold the registration
    /// lock shared), so none is missed.
    async fn uncommitted(&self) -> Vec<(String, Identity, Uncommitted)> {
        let _alone = self.registration.write().await;
        self.lock_held()
            .values()
            .filter_map(|cell| {
                let u = crate::sync::lock(&cell.uncommitted).clone()?;
                Some((cell.id.clone(), cell.identity.clone(), u))
            })
            .collect()
    }

    /// Registers this replica again (at start-up, after a lapsed lease, after Redis forgot): if
    /// Redis lacks this replica's part of the current epoch, its key records go back first (from
    /// the recovery source, outside the registration lock, so releases are never held up by the
    /// store), then its holdings and rate debts are counted in one atomic step.
    ///
    /// Redis may forget again at any point of this (it crash-loops, say): the registration then
    /// finds the key records it restored gone, or never restored, does nothing, and they are
    /// restored again, a few times before the heartbeat takes over.
    async fn register_again(&self) -> Result<(), Unavailable> {
        let source = self.source.get().cloned();
        for _ in 0..REGISTRATION_TRIES {
            let mut debts = Vec::new();
            // '-': nothing to restore; '': Redis held this replica's part when checked.
            let mut keyed = String::from("-");
            if let Some(source) = &source {
                keyed.clear();
                // Permits admitted here but not yet committed have no row in the store yet:
                // their keys and admissions come from here. Read first (once the admissions in
                // flight have their cells), then the store, so a permit committed in between is
                // in one or both (a token counted twice can only refuse, never admit).
                let uncommitted = self.uncommitted().await;
                // No retirement between reading the key records and writing them back: a key
                // unbound after the read, its row then deleted, would be bound again here to an
                // operation no store holds (and answered "elsewhere" on every other replica).
                let restoring = self.restoring.write().await;
                if self.lacks_this_replica().await? {
                    let mut records = source.key_records().await.map_err(|e| {
                        self.unavailable(UnavailableReason::Reply(format!(
                            "the store's key records could not be read: {e}"
                        )))
                    })?;
                    let stored: std::collections::HashSet<String> =
                        records.iter().map(|r| r.operation.clone()).collect();
                    records.extend(uncommitted.iter().filter_map(|(id, client, u)| {
                        let key = u.key.clone()?;
                        (!stored.contains(id)).then(|| crate::admission::KeyRecord {
                            client: client.clone(),
                            key,
                            operation: id.clone(),
                        })
                    }));
                    match self.restore_keys(&records).await? {
                        Some(nonce) => keyed = nonce,
                        None => continue,
                    }
                }
                drop(restoring);
                // The configuration in force now, not at start-up: a reload may have lengthened
                // a window, and admissions within it still weigh on the bucket.
                let config = self.config.load_full();
                let within = config.longest_window();
                let mut admissions = source.recent_admissions(within).await.map_err(|e| {
                    self.unavailable(UnavailableReason::Reply(format!(
                        "the store's recent admissions could not be read: {e}"
                    )))
                })?;
                admissions.extend(
                    uncommitted
                        .iter()
                        .map(|(_, client, u)| (client.clone(), u.at.elapsed())),
                );
                debts = rate_debts(&config, &admissions);
            }
            let _alone = self.registration.write().await;
            if self.replace_locked(&debts, &keyed).await? {
                return Ok(());
            }
        }
        Err(self.unavailable(UnavailableReason::Recovering))
    }

    /// Whether Redis lacks what this replica contributed to the deployment's current epoch (no
    /// epoch at all, or this replica not registered in it).
    async fn lacks_this_replica(&self) -> Result<bool, Unavailable> {
        let mut pipe = redis::pipe();
        pipe.get(&self.keys.epoch)
            .hget(&self.keys.members, &self.options.replica);
        let mut conn = self.conn.clone();
        let (epoch, registered): (Option<String>, Option<String>) = match tokio::time::timeout(
            self.options.call_timeout,
            pipe.query_async(&mut conn),
        )
        .await
        {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(self.failed(UnavailableReason::Redis(e.to_string()))),
            Err(_) => return Err(self.failed(UnavailableReason::Timeout)),
        };
        Ok(epoch.is_none() || epoch != registered)
    }

    /// Writes `records` back as idempotency records bound to this replica (where the key is not
    /// bound already), in calls of [`KEY_RECORDS_PER_CALL`] (one at least, so Redis holds the
    /// restore's marker even with no record). The restore's nonce, for the registration to check
    /// that Redis still holds them; `None` if Redis forgot them before the last call.
    async fn restore_keys(&self, records: &[KeyRecord]) -> Result<Option<String>, Unavailable> {
        let ttl = self.options.idempotency_ttl.map_or(0, ttl_millis);
        let nonce = random_hex();
        let whole = self
            .send_key_records(
                &self.scripts.restore_keys,
                records,
                true,
                |invocation, n| {
                    invocation
                        .arg(&self.keys.base)
                        .arg(&self.options.replica)
                        .arg(ttl)
                        .arg(&nonce)
                        .arg(u8::from(n == 0));
                },
            )
            .await?;
        if !whole {
            return Ok(None);
        }
        Ok(Some(nonce))
    }

    /// Unbinds each key from its operation (if it still names it), in calls of
    /// [`KEY_RECORDS_PER_CALL`]: the operations were retired, and a retired key is new work.
    pub(crate) async fn retire_keys(&self, records: &[KeyRecord]) -> Result<(), Unavailable> {
        self.send_key_records(
            &self.scripts.retire_keys,
            records,
            false,
            |invocation, _| {
                invocation.arg(&self.keys.base);
            },
        )
        .await
        .map(|_| ())
    }

    pub(crate) async fn renew_keys(&self, records: &[KeyRecord]) -> Result<u64, Unavailable> {
        let Some(ttl) = self.options.idempotency_ttl else {
            return Ok(0);
        };
        let mut renewed = 0;
        for chunk in records.chunks(KEY_RECORDS_PER_CALL) {
            let mut invocation = self.scripts.renew_keys.prepare_invoke();
            invocation.arg(&self.keys.base).arg(ttl_millis(ttl));
            for record in chunk {
                invocation
                    .arg(record.client.as_str())
                    .arg(&record.key)
                    .arg(&record.operation);
            }
            let value = self
                .call(&invocation)
                .await
                .map_err(|r| self.unavailable(r))?;
            match value {
                Value::Int(n) => renewed += u64::try_from(n).unwrap_or(0),
                other => {
                    return Err(self.unavailable(UnavailableReason::Reply(format!(
                        "renew_keys answered {other:?}"
                    ))));
                }
            }
        }
        Ok(renewed)
    }

    /// Runs `script` over `records` in calls of [`KEY_RECORDS_PER_CALL`] (one at least, if
    /// `at_least_once`, even with no record): `head` writes the script's leading arguments for
    /// the `n`th call, then each record's client, key and operation follow. Whether every call
    /// ran through: a call answering -1 (a restore whose marker Redis lost) ends the run.
    async fn send_key_records(
        &self,
        script: &Script,
        records: &[KeyRecord],
        at_least_once: bool,
        head: impl Fn(&mut redis::ScriptInvocation<'_>, usize),
    ) -> Result<bool, Unavailable> {
        let mut chunks: Vec<&[KeyRecord]> = records.chunks(KEY_RECORDS_PER_CALL).collect();
        if chunks.is_empty() && at_least_once {
            chunks.push(&[]);
        }
        for (n, chunk) in chunks.into_iter().enumerate() {
            let mut invocation = script.prepare_invoke();
            head(&mut invocation, n);
            for record in chunk {
                invocation
                    .arg(record.client.as_str())
                    .arg(&record.key)
                    .arg(&record.operation);
            }
            let value = self
                .call(&invocation)
                .await
                .map_err(|r| self.unavailable(r))?;
            if value == Value::Int(-1) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The replace script with what `held` says now and `debts` (applied only if Redis lacks this
    /// replica's admissions for its epoch). The caller holds `registration` alone.
    async fn replace_locked(&self, debts: &[RateDebt], keyed: &str) -> Result<bool, Unavailable> {
        let sent = Instant::now();
        let replica = &self.options.replica;
        let fresh = random_hex();
        let known: Vec<String> = crate::sync::lock(&self.known_replicas)
            .iter()
            .cloned()
            .collect();
        let mut invocation = self.scripts.replace.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(self.keys.held(replica))
            .key(self.keys.lease(replica))
            .key(&self.keys.replicas)
            .key(&self.keys.epoch)
            .key(&self.keys.recovery)
            .key(&self.keys.expected)
            .key(&self.keys.members)
            .arg(&self.keys.base)
            .arg(replica)
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl))
            .arg(self.epoch().unwrap_or_default())
            .arg(&fresh)
            .arg(keyed)
            .arg(known.len());
        for name in &known {
            invocation.arg(name);
        }
        invocation.arg(debts.len());
        for debt in debts {
            invocation
                .arg(debt.client.as_str())
                .arg(debt.interval)
                .arg(debt.span)
                .arg(debt.micros);
        }
        // Kept releases before this point are for operations no longer held here (each left
        // `held` before it was kept): once Redis holds exactly `held` for this replica they are
        // moot, unless they free an idempotency key. Those kept while the script runs are not.
        // A decision whose caller hung up may still be queued for Redis: it goes first. If the
        // queue did not settle in time, such a decision can reach Redis after the replace and be
        // admitted there; its kept undo must then follow it, so none is pruned (a release of an
        // operation Redis no longer holds is answered `absent` and changes nothing).
        let settled = self.settled().await;
        let kept_before = if settled {
            crate::sync::lock(&self.outbox).len()
        } else {
            0
        };
        for cell in self.lock_held().values() {
            let state = match cell.state() {
                OperationState::Pending => "p",
                OperationState::Approved => "a",
                OperationState::Executing => "e",
                _ => continue,
            };
            invocation
                .arg(&cell.id)
                .arg(cell.identity.as_str())
                .arg(state);
        }
        let value = self
            .call(&invocation)
            .await
            .map_err(|r| self.unavailable(r))?;
        let reply = match reply::parse_replace(&value) {
            Ok(Replaced::Registered(reply)) => reply,
            Ok(Replaced::Lacking) => return Ok(false),
            Err(e) => return Err(self.unavailable(UnavailableReason::Reply(e.to_string()))),
        };
        {
            let mut outbox = crate::sync::lock(&self.outbox);
            let mut index = 0;
            outbox.retain(|kept| {
                index += 1;
                index > kept_before || kept.key.is_some()
            });
        }
        *crate::sync::lock(&self.epoch) = Some(reply.epoch);
        // Relaxed: a reading for metrics.
        self.recovering.store(reply.recovering, Ordering::Relaxed);
        *crate::sync::lock(&self.lease_until) = Some(sent + self.options.lease_ttl);
        // Relaxed: a statistic.
        self.lease_changes.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    async fn reap(&self) -> Result<u64, Unavailable> {
        let mut invocation = self.scripts.reap.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(&self.keys.replicas)
            .arg(&self.keys.base);
        let value = self
            .call(&invocation)
            .await
            .map_err(|r| self.unavailable(r))?;
        let reaped = reply::parse_reaped(&value)
            .map_err(|e| self.unavailable(UnavailableReason::Reply(e.to_string())))?;
        let n: u64 = reaped.iter().map(|(_, n)| n).sum();
        // Relaxed: a statistic.
        self.reaped.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }
}

/// A client's rate debt: how far its bucket's TAT must move past now (µs), in its rate.
struct RateDebt {
    client: Identity,
    interval: u64,
    span: u64,
    micros: u64,
}

/// Each client's debt from its admissions `ago`: GCRA replayed over them, oldest first, as the
/// in-process engine's `restore_rate` does (an admission a whole window old counts nothing).
fn rate_debts(config: &Config, admissions: &[(Identity, Duration)]) -> Vec<RateDebt> {
    let mut ages: std::collections::BTreeMap<&str, Vec<u64>> = std::collections::BTreeMap::new();
    for (client, ago) in admissions {
        let micros = u64::try_from(ago.as_micros()).unwrap_or(u64::MAX);
        ages.entry(client.as_str()).or_default().push(micros);
    }
    let mut debts = Vec::new();
    for (client, mut ages) in ages {
        let Some(limits) = config.effective(client) else {
            continue;
        };
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        // Oldest first; times as "span minus age" so nothing goes below zero.
        ages.sort_unstable_by(|a, b| b.cmp(a));
        let now = span;
        let mut tat = 0u64;
        for age in ages.into_iter().filter(|&age| age < span) {
            let at = now - age;
            tat = tat.max(at) + interval;
        }
        let micros = tat.saturating_sub(now).min(span);
        if micros > 0 {
            debts.push(RateDebt {
                client: Identity::new(client).expect("a configured identity is valid"),
                interval,
                span,
                micros,
            });
        }
    }
    debts
}

fn ttl_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Drop for Inner {
    fn drop(&mut self) {
        for slot in [&mut self.heartbeat, &mut self.notices] {
            if let Some(task) = slot.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                task.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::config::Limits;
    use crate::{Controller, ManualClock, StorageCaps};

    #[test]
    fn rate_debts_replay_the_admissions_as_the_engine_restores_a_bucket() {
        let bob = Identity::new("bob").unwrap();
        let limits = Limits {
            requests_per_window: 5,
            window_seconds: 600,
            ..Limits::default()
        };
        let config = Config::new(limits, BTreeMap::new(), [bob.clone()]).unwrap();
        let secs = Duration::from_secs;
        // Five tokens spent 25 s ago: the bucket is empty and the next token is 95 s away, so the
        // TAT lies 575 s past now (a full span of 600 s, less the 25 s that passed).
        let spent: Vec<(Identity, Duration)> = (0..5).map(|_| (bob.clone(), secs(25))).collect();
        let debts = rate_debts(&config, &spent);
        assert_eq!(debts.len(), 1);
        assert_eq!(debts[0].micros, 575_000_000);
        assert_eq!(
            (debts[0].interval, debts[0].span),
            (120_000_000, 600_000_000)
        );
        // One admission a whole window old (or older) counts nothing; an unknown client neither.
        let stale = [
            (bob.clone(), secs(600)),
            (Identity::new("eve").unwrap(), secs(1)),
        ];
        assert!(rate_debts(&config, &stale).is_empty());
        // Spread out: tokens 10 minutes apart never pile up beyond the last one's interval.
        let spread = [
            (bob.clone(), secs(599)),
            (bob.clone(), secs(300)),
            (bob.clone(), secs(1)),
        ];
        assert_eq!(rate_debts(&config, &spread)[0].micros, 119_000_000);
    }

    #[test]
    fn a_quota_from_a_redis_reading_is_the_engines_quota_for_the_same_bucket_and_counts() {
        let limits = Limits {
            requests_per_window: 3,
            window_seconds: 60,
            client_active: 5,
            client_pending: 4,
            global_active: 10,
            global_executing: 2,
        };
        let config = Config::new(limits, BTreeMap::new(), [Identity::new("amy").unwrap()]).unwrap();
        // The pending-grant cap is below the client's pending limit: the quota names the lower.
        let caps = StorageCaps {
            grant_client: 2,
            ..StorageCaps::default()
        };
        let start_secs = 1_000;
        let clock = ManualClock::new();
        clock.set_nanos(start_secs * 1_000_000_000);
        let engine = Controller::builder(config.clone())
            .clock(clock.clone())
            .storage_caps(caps)
            .build();
        let mut options = ReplicaOptions::new("redis://127.0.0.1:1/", "r1");
        options.caps = caps;
        options.capacity_retry = engine.capacity_retry();
        let amy = config.effective("amy").unwrap();
        let rate = rate_micros(3, 60);
        let start = start_secs * 1_000_000;
        // What the script reads after `taken` admissions at `start`, from a full bucket (TAT
        // `max(TAT, now) + interval` each), of which the first two need approval.
        let reading = |taken: u64, now: u64| Reading {
            tat_micros: start + taken * rate.0,
            now_micros: now,
            active: taken,
            pending: taken.min(2),
        };
        let mut held = Vec::new();
        for taken in 1..=3 {
            held.push(engine.admit("amy", taken <= 2).unwrap().commit());
            let redis = quota(amy, &options, rate, &reading(taken, start));
            assert_eq!(Some(redis), engine.quota("amy"), "{taken} taken");
            assert_eq!(redis.rate.remaining, 3 - taken);
            assert_eq!((redis.active.used, redis.active.limit), (taken, 5));
            assert_eq!((redis.pending.used, redis.pending.limit), (taken.min(2), 2));
        }
        // Empty: the next token in exactly the wait a rate refusal reports (20 s).
        let empty = quota(amy, &options, rate, &reading(3, start));
        assert_eq!(empty.rate.next_token_nanos, 20_000_000_000);
        let refusal = engine.admit("amy", false).unwrap_err();
        assert_eq!(
            refusal.retry_after,
            Duration::from_nanos(empty.rate.next_token_nanos)
        );
        // Time passes on both clocks: tokens come back alike, to a full bucket.
        for (elapsed, remaining) in [(5, 0), (20, 1), (45, 2), (61, 3), (600, 3)] {
            clock.set_nanos((start_secs + elapsed) * 1_000_000_000);
            let redis = quota(
                amy,
                &options,
                rate,
                &reading(3, start + elapsed * 1_000_000),
            );
            assert_eq!(Some(redis), engine.quota("amy"), "after {elapsed} s");
            assert_eq!(redis.rate.remaining, remaining, "after {elapsed} s");
        }
        assert_eq!(
            quota(amy, &options, rate, &reading(3, start + 600_000_000))
                .rate
                .next_token_nanos,
            0
        );
    }
}
