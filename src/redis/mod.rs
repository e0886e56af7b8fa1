//! Admission shared by broker replicas, on Redis (cargo feature `redis`; SPEC section 7).
//!
//! A sibling of the in-process [`crate::Controller`] behind the same decision contract: the same
//! checks in the same order, the same refusal codes and Retry-After rules, the same permit and
//! lifecycle semantics. What differs is where the counts live: in one Redis, shared by every
//! replica, so a client's limits and the global limits hold across all of them.
//!
//! - **One script per decision.** Each admission is one atomic Lua script (`scripts/admit.lua`,
//!   run by `EVALSHA`, loaded again on `NOSCRIPT`) on Redis server time, so replicas' clocks never
//!   matter: GCRA, client and global counts, the pending-grant caps, all or nothing. The scripts
//!   are files beside this one, built in with `include_str!`.
//! - **Reloads rescale the buckets.** A client's bucket key holds its TAT with the rate (emission
//!   interval, burst span) it was written under; a decision under a different rate (a reload, on
//!   whichever replica) first rescales the used part of the span to the new span, rounded up, as
//!   the in-process engine's `Bucket::rescale` does, so a reload never hands out a fresh burst nor
//!   confiscates one. A refunded token is measured in the bucket's rate at refund time.
//! - **One hash tag.** Every key of a deployment starts with `{prefix}`, so all of them live in one
//!   Redis Cluster slot, and two deployments can share a Redis under two prefixes.
//! - **Exactly once, by operation id.** A reservation is recorded under its operation's id; every
//!   transition and release names the id, so a retry after a lost reply or a timeout never counts
//!   or frees twice.
//! - **Leases.** Each replica holds a lease (a key with a TTL) renewed by a heartbeat task; a
//!   replica that cannot renew stops admitting; the survivors release a lapsed replica's holdings
//!   exactly once (`scripts/reap.lua`); a replica that (re)registers replaces its holdings with
//!   what it holds now in one step (`scripts/replace.lua`).
//! - **Redis down at start-up.** [`RedisController::connect_lazy`] makes the connection on the
//!   first call (and again after each failure); [`RedisController::register_or_defer`] holds the
//!   restored work here and lets the heartbeat register it once Redis answers. Until then every
//!   admission is [`Unavailable`] (no lease), and nothing is admitted unchecked.
//! - **Redis down or slow.** Every call has a timeout; an admission that cannot be decided is
//!   [`Unavailable`] (503 `admission_unavailable`), never admitted unchecked; a circuit stops
//!   calling a dead Redis for a while; releases that cannot be sent are kept and retried, in
//!   order, until Redis answers.
//! - **One operation per key.** The admission script records (client, idempotency key) →
//!   (operation id, replica) with the reservation, so the same key sent to two replicas admits
//!   once; the second is told which operation and replica hold it.
//!
//! What stays per replica: storage quotas (streams, sealed payloads) and the durable store.
//!
//! This file is one piece past the usual size because its parts share one private state
//! (`Inner`: the connection, the lease, the kept releases, the registration lock) whose rules only
//! hold together: the options and errors come first, then the controller, then the calls it makes.
//! The handles (`handles`), the reply parser (`reply`) and the circuit (`circuit`) stand alone.

mod circuit;
mod handles;
#[doc(hidden)]
pub mod reply;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};

pub use handles::{RedisOperation, RedisPermit, RedisStartError};

use self::circuit::{Circuit, Gate};
use self::reply::{AdmitReply, LeaseReply, TransitionReply};
use crate::config::{Config, Identity};
use crate::engine::{DEFAULT_CAPACITY_RETRY, OperationState, Refusal, RefusalCode, StorageCaps};

/// The script every decision runs, with the helpers all scripts share.
const ADMIT: &str = concat!(
    include_str!("scripts/counts.lua"),
    include_str!("scripts/admit.lua")
);
const TRANSITION: &str = concat!(
    include_str!("scripts/counts.lua"),
    include_str!("scripts/transition.lua")
);
const REPLACE: &str = concat!(
    include_str!("scripts/counts.lua"),
    include_str!("scripts/replace.lua")
);
const REAP: &str = concat!(
    include_str!("scripts/counts.lua"),
    include_str!("scripts/reap.lua")
);
const HEARTBEAT: &str = include_str!("scripts/heartbeat.lua");
/// The benchmark's baseline: a rate token and nothing else.
#[doc(hidden)]
pub const RATE_ONLY: &str = include_str!("scripts/rate_only.lua");

/// How a replica reaches Redis and shares it.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://host:port/db`.
    pub url: String,
    /// Starts every key, as the hash tag `{prefix}` (default `admission`). Two deployments sharing
    /// a Redis use two prefixes.
    pub prefix: String,
    /// This replica's name, unique in the deployment and stable across restarts (an identity-like
    /// name: `^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$`).
    pub replica: String,
    /// How long a lease lasts unrenewed (default 10 s). A replica that cannot renew for this long
    /// stops admitting, and the others release what it held.
    pub lease_ttl: Duration,
    /// How often the lease is renewed, lapsed leases reaped and kept releases retried (default a
    /// third of the lease).
    pub heartbeat: Duration,
    /// The longest any one call to Redis may take (default 500 ms).
    pub call_timeout: Duration,
    /// How long an idempotency key stays bound to its operation (default 24 h).
    pub idempotency_ttl: Duration,
    /// Consecutive failed calls that open the circuit (default 3).
    pub circuit_threshold: u32,
    /// How long an open circuit refuses before a trial call (default 1 s).
    pub circuit_cool_down: Duration,
    /// Retry-After of a capacity refusal (default 2 s).
    pub capacity_retry: Duration,
    /// Retry-After of an [`Unavailable`] answer (default 2 s).
    pub unavailable_retry: Duration,
    /// The pending-grant caps (the storage caps are per replica and not used here).
    pub caps: StorageCaps,
}

impl RedisOptions {
    /// Options with the defaults for `url` and `replica`.
    pub fn new(url: impl Into<String>, replica: impl Into<String>) -> RedisOptions {
        RedisOptions {
            url: url.into(),
            prefix: "admission".to_string(),
            replica: replica.into(),
            lease_ttl: Duration::from_secs(10),
            heartbeat: Duration::from_millis(3333),
            call_timeout: Duration::from_millis(500),
            idempotency_ttl: Duration::from_secs(24 * 3600),
            circuit_threshold: 3,
            circuit_cool_down: Duration::from_secs(1),
            capacity_retry: DEFAULT_CAPACITY_RETRY,
            unavailable_retry: Duration::from_secs(2),
            caps: StorageCaps::default(),
        }
    }
}

/// Why the shared controller cannot be set up.
#[derive(Debug)]
pub enum SetupError {
    /// An option is unusable (the message names it).
    Options(String),
    /// Redis could not be reached or refused.
    Redis(String),
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Options(m) => write!(f, "redis options: {m}"),
            SetupError::Redis(m) => write!(f, "redis: {m}"),
        }
    }
}

impl std::error::Error for SetupError {}

/// Why admission could not be decided: answered as 503 `admission_unavailable`, never as an
/// unchecked admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable {
    /// What went wrong.
    pub reason: UnavailableReason,
    /// When to try again (whole seconds, at least one).
    pub retry_after: Duration,
}

impl Unavailable {
    /// The wire code: `admission_unavailable`.
    pub const CODE: &'static str = "admission_unavailable";

    /// The HTTP status: 503.
    pub const fn http_status(&self) -> u16 {
        503
    }

    /// `retry_after` in whole seconds, as the `Retry-After` header carries it.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs()
    }
}

/// Why Redis could not decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnavailableReason {
    /// The call did not answer within the call timeout.
    Timeout,
    /// Redis answered with an error, or the connection failed (the message says which).
    Redis(String),
    /// Recent calls failed; this one was not sent.
    CircuitOpen,
    /// This replica does not hold its lease (not registered, lapsed, or taken by another process
    /// under the same name).
    LeaseNotHeld,
    /// A script replied with something no script returns.
    Reply(String),
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match &self.reason {
            UnavailableReason::Timeout => "redis did not answer in time".to_string(),
            UnavailableReason::Redis(m) => format!("redis error: {m}"),
            UnavailableReason::CircuitOpen => "redis is failing; calls paused".to_string(),
            UnavailableReason::LeaseNotHeld => "this replica does not hold its lease".to_string(),
            UnavailableReason::Reply(m) => m.clone(),
        };
        write!(
            f,
            "{} ({why}; retry after {}s)",
            Self::CODE,
            self.retry_after.as_secs()
        )
    }
}

impl std::error::Error for Unavailable {}

/// Why [`RedisController::admit`] gave no permit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// Refused, exactly as the in-process controller would have (429, or 403 when unconfigured).
    Refused(Refusal),
    /// The client's idempotency key already names an operation, created by `replica`: answer as a
    /// replay if this replica can read it, else say where it lives. Nothing was reserved.
    Replay {
        /// The operation's id.
        operation: String,
        /// The replica that admitted it.
        replica: String,
    },
    /// Admission could not be decided (503).
    Unavailable(Unavailable),
}

impl fmt::Display for AdmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdmitError::Refused(r) => r.fmt(f),
            AdmitError::Replay { operation, replica } => {
                write!(
                    f,
                    "the idempotency key names operation {operation} on replica {replica}"
                )
            }
            AdmitError::Unavailable(u) => u.fmt(f),
        }
    }
}

impl std::error::Error for AdmitError {}

/// The shared counts as Redis holds them now (one consistent reading).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SharedCounts {
    /// Live operations across every replica.
    pub active: u64,
    /// Operations awaiting approval.
    pub pending: u64,
    /// Operations executing.
    pub executing: u64,
    /// Per client: (active, pending, executing), only clients holding something.
    pub clients: BTreeMap<String, (u64, u64, u64)>,
    /// Operations recorded (every live operation of every replica).
    pub operations: u64,
}

impl SharedCounts {
    /// Whether nothing is held anywhere.
    pub fn is_idle(&self) -> bool {
        self.active == 0
            && self.pending == 0
            && self.executing == 0
            && self.clients.is_empty()
            && self.operations == 0
    }
}

/// What this replica's backend has seen, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Calls that failed or timed out.
    pub errors: u64,
    /// Times this replica's lease was taken, lost or taken back.
    pub lease_changes: u64,
    /// Operations of lapsed replicas this replica released.
    pub reaped: u64,
    /// Admissions answered unavailable.
    pub unavailable: u64,
    /// Releases waiting to be sent.
    pub outbox: u64,
    /// Whether this replica holds its lease now.
    pub lease_held: bool,
    /// Whether the circuit is open now.
    pub circuit_open: bool,
}

/// An operation a replica restores from its store at (re)registration.
#[derive(Clone, Debug)]
pub struct RestoredOperation {
    /// Its id.
    pub id: String,
    /// Its client.
    pub identity: Identity,
    /// Its state (not terminal).
    pub state: OperationState,
}

/// Every key of one deployment, under one hash tag.
struct Keys {
    base: String,
    counts: String,
    ops: String,
    replicas: String,
}

impl Keys {
    fn new(prefix: &str) -> Keys {
        let base = format!("{{{prefix}}}");
        Keys {
            counts: format!("{base}:counts"),
            ops: format!("{base}:ops"),
            replicas: format!("{base}:replicas"),
            base,
        }
    }
    fn tat(&self, client: &str) -> String {
        format!("{}:tat:{client}", self.base)
    }
    fn lease(&self, replica: &str) -> String {
        format!("{}:lease:{replica}", self.base)
    }
    fn held(&self, replica: &str) -> String {
        format!("{}:held:{replica}", self.base)
    }
    fn idempotency(&self, client: &str, key: &str) -> String {
        format!("{}:key:{client}:{key}", self.base)
    }
}

struct Scripts {
    admit: Script,
    transition: Script,
    replace: Script,
    reap: Script,
    heartbeat: Script,
}

/// A release kept until Redis answers: the operation and the transition script's target.
#[derive(Clone, Debug)]
pub(crate) struct Kept {
    pub(crate) id: String,
    pub(crate) target: Target,
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
    /// Until when the lease is surely held (the send time of the last renewal plus the TTL).
    lease_until: Mutex<Option<Instant>>,
    circuit: Circuit,
    outbox: Mutex<Vec<Kept>>,
    wake: Arc<tokio::sync::Notify>,
    errors: AtomicU64,
    lease_changes: AtomicU64,
    reaped: AtomicU64,
    unavailable: AtomicU64,
    heartbeat: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// The admission controller shared by broker replicas through Redis. Cheap to clone.
///
/// Set up with [`RedisController::connect`], then [`RedisController::register`] with what the
/// replica's store restores (which takes the lease and starts the heartbeat); then
/// [`RedisController::admit`] as with the in-process controller, with the operation's id.
#[derive(Clone)]
pub struct RedisController {
    inner: Arc<Inner>,
}

fn valid_name(what: &str, name: &str) -> Result<(), SetupError> {
    if Identity::new(name).is_ok() {
        Ok(())
    } else {
        Err(SetupError::Options(format!(
            "{what} {name:?} must match ^[A-Za-z0-9][A-Za-z0-9._@-]{{0,63}}$"
        )))
    }
}

/// An operation id the scripts can record: 1 to 128 visible ASCII characters.
fn valid_op_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
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
    /// Connects to Redis (checking it answers) for `config`. Admits nothing until
    /// [`RedisController::register`] has taken the lease.
    pub async fn connect(
        config: Config,
        options: RedisOptions,
    ) -> Result<RedisController, SetupError> {
        let controller = RedisController::connect_lazy(config, options)?;
        let inner = &controller.inner;
        let mut conn = inner.conn.clone();
        let ping = tokio::time::timeout(
            inner.options.call_timeout * 4,
            redis::cmd("PING").query_async::<Value>(&mut conn),
        )
        .await
        .map_err(|_| SetupError::Redis(format!("{} did not answer in time", inner.options.url)))?;
        ping.map_err(|e| SetupError::Redis(e.to_string()))?;
        Ok(controller)
    }

    /// As [`RedisController::connect`], without waiting for Redis: the connection is made by the
    /// first call and made again after each failure, so a replica can start while Redis is down
    /// (see [`RedisController::register_or_defer`]). Fails only on invalid options or URL. Call
    /// it inside a Tokio runtime.
    pub fn connect_lazy(
        config: Config,
        options: RedisOptions,
    ) -> Result<RedisController, SetupError> {
        valid_name("replica", &options.replica)?;
        if options.prefix.is_empty()
            || options.prefix.len() > 64
            || !options
                .prefix
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(SetupError::Options(format!(
                "prefix {:?} must be 1 to 64 visible characters without braces",
                options.prefix
            )));
        }
        if options.lease_ttl < Duration::from_millis(100)
            || options.heartbeat.is_zero()
            || options.heartbeat >= options.lease_ttl
            || options.call_timeout.is_zero()
        {
            return Err(SetupError::Options(
                "the heartbeat must be shorter than the lease (at least 100 ms), and the call \
                 timeout above zero"
                    .to_string(),
            ));
        }
        let client = redis::Client::open(options.url.as_str())
            .map_err(|e| SetupError::Redis(e.to_string()))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.call_timeout))
            .set_response_timeout(Some(options.call_timeout))
            .set_number_of_retries(1)
            .set_max_delay(options.call_timeout);
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config)
            .map_err(|e| SetupError::Redis(e.to_string()))?;
        let mut token_bytes = [0u8; 16];
        fill_random(&mut token_bytes);
        let token: String = token_bytes.iter().map(|b| format!("{b:02x}")).collect();
        let inner = Inner {
            conn,
            keys: Keys::new(&options.prefix),
            circuit: Circuit::new(options.circuit_threshold, options.circuit_cool_down),
            token,
            scripts: Scripts {
                admit: Script::new(ADMIT),
                transition: Script::new(TRANSITION),
                replace: Script::new(REPLACE),
                reap: Script::new(REAP),
                heartbeat: Script::new(HEARTBEAT),
            },
            config: ArcSwap::from_pointee(config),
            held: Mutex::new(HashMap::new()),
            registration: tokio::sync::RwLock::new(()),
            lease_until: Mutex::new(None),
            outbox: Mutex::new(Vec::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
            errors: AtomicU64::new(0),
            lease_changes: AtomicU64::new(0),
            reaped: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            heartbeat: Mutex::new(None),
            options,
        };
        Ok(RedisController {
            inner: Arc::new(inner),
        })
    }

    /// This replica's name.
    pub fn replica(&self) -> &str {
        &self.inner.options.replica
    }

    /// Registers this replica: whatever Redis holds for it (from an earlier run under the same
    /// name) is released and `restored` counted instead — even above a limit, so new work is
    /// refused until it drains — and the lease is taken, all in one atomic step. Starts the
    /// heartbeat. Returns a handle per restored operation, in order.
    pub async fn register(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> Result<Vec<RedisOperation>, Unavailable> {
        let cells = {
            let _alone = self.inner.registration.write().await;
            let cells = self.hold_restored(restored);
            self.inner.replace_locked().await?;
            cells
        };
        self.start_heartbeat();
        Ok(self.handles(cells))
    }

    /// As [`RedisController::register`], but if Redis does not answer now the replica still
    /// starts: `restored` is held here (its handles work; releases are kept), every admission is
    /// [`Unavailable`] (no lease), and the heartbeat registers it — the same atomic replace —
    /// as soon as Redis answers, after which admissions are decided. Returns the handles and, if
    /// registration was deferred, why.
    pub async fn register_or_defer(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> (Vec<RedisOperation>, Option<Unavailable>) {
        let (cells, deferred) = {
            let _alone = self.inner.registration.write().await;
            let cells = self.hold_restored(restored);
            (cells, self.inner.replace_locked().await.err())
        };
        self.start_heartbeat();
        (self.handles(cells), deferred)
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
        let mut slot = self
            .inner
            .heartbeat
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return;
        }
        // The task holds the controller only while it works, never while it waits, so dropping
        // every handle of a replica ends it (and its lease lapses).
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let wake = Arc::clone(&self.inner.wake);
        let period = self.inner.options.heartbeat;
        *slot = Some(tokio::spawn(async move {
            loop {
                let woken = tokio::select! {
                    _ = wake.notified() => true,
                    _ = tokio::time::sleep(period) => false,
                };
                let Some(inner) = weak.upgrade() else { return };
                if woken {
                    inner.drain().await;
                } else {
                    inner.tick().await;
                }
            }
        }));
    }

    /// Stops the heartbeat (the lease then lapses unless another process under this name renews
    /// it). Kept releases are sent first if Redis answers.
    pub async fn shutdown(&self) {
        self.inner.drain().await;
        let task = self
            .inner
            .heartbeat
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(task) = task {
            task.abort();
        }
    }

    /// Decides one submission by `identity` for the operation `id` (unique, chosen by the
    /// broker before admitting), in the contract's order: the client is configured → a rate
    /// token → client active → (if it needs approval) client pending and the pending grants →
    /// global active → global executing. With an `idempotency_key`, the same key already bound
    /// to an operation (on any replica) answers [`AdmitError::Replay`] and reserves nothing.
    ///
    /// Retrying with the same `id` after a lost reply never counts twice.
    pub async fn admit(
        &self,
        identity: &str,
        needs_approval: bool,
        id: &str,
        idempotency_key: Option<&str>,
    ) -> Result<RedisPermit, AdmitError> {
        let inner = &self.inner;
        let config = inner.config.load();
        let Some(limits) = config.effective(identity) else {
            return Err(AdmitError::Refused(Refusal {
                code: RefusalCode::ClientUnconfigured,
                retry_after: Duration::ZERO,
            }));
        };
        let identity = Identity::new(identity).expect("a configured identity is valid");
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
            return Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::LeaseNotHeld),
            ));
        }
        if let Gate::Open(_) = inner.circuit.enter() {
            return Err(AdmitError::Unavailable(
                inner.unavailable(UnavailableReason::CircuitOpen),
            ));
        }
        let (interval, span) = rate_micros(limits.requests_per_window, limits.window_seconds);
        let caps = inner.options.caps;
        let global = config.limits();
        let keys = &inner.keys;
        let replica = &inner.options.replica;
        let idem_key = idempotency_key.map(|k| keys.idempotency(identity.as_str(), k));
        let mut invocation = inner.scripts.admit.prepare_invoke();
        invocation
            .key(&keys.counts)
            .key(&keys.ops)
            .key(keys.tat(identity.as_str()))
            .key(keys.lease(replica))
            .key(idem_key.as_deref().unwrap_or(&keys.counts))
            .key(&keys.replicas)
            .arg(&keys.base)
            .arg(id)
            .arg(replica)
            .arg(&inner.token)
            .arg(identity.as_str())
            .arg(u8::from(needs_approval))
            .arg(interval)
            .arg(span)
            .arg(limits.active)
            .arg(limits.pending)
            .arg(caps.grant_client)
            .arg(caps.grant_global)
            .arg(global.global_active)
            .arg(global.global_executing)
            .arg(u8::from(idem_key.is_some()))
            .arg(ttl_millis(inner.options.idempotency_ttl));
        let cell = Arc::new(Held {
            id: id.to_string(),
            identity,
            state: std::sync::atomic::AtomicU8::new(if needs_approval {
                OperationState::Pending as u8
            } else {
                OperationState::Approved as u8
            }),
        });
        let _shared = inner.registration.read().await;
        let value = match inner.call(&invocation).await {
            Ok(value) => value,
            Err(reason) => {
                // The script may have run and its reply been lost: release by id (a no-op if it
                // never ran), so a reservation never outlives the answer "unavailable".
                inner.keep(Kept {
                    id: id.to_string(),
                    target: Target::Terminal,
                });
                return Err(AdmitError::Unavailable(inner.unavailable(reason)));
            }
        };
        let reply = match reply::parse_admit(&value) {
            Ok(reply) => reply,
            Err(e) => {
                inner.keep(Kept {
                    id: id.to_string(),
                    target: Target::Terminal,
                });
                return Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::Reply(e.to_string())),
                ));
            }
        };
        match reply {
            AdmitReply::Admitted | AdmitReply::Duplicate => {
                inner.lock_held().insert(cell.id.clone(), Arc::clone(&cell));
                Ok(RedisPermit::new(
                    Arc::clone(inner),
                    cell,
                    needs_approval,
                    (interval, span),
                ))
            }
            AdmitReply::Replay { id, replica } => Err(AdmitError::Replay {
                operation: id,
                replica,
            }),
            AdmitReply::Lease => {
                inner.lease_lost();
                Err(AdmitError::Unavailable(
                    inner.unavailable(UnavailableReason::LeaseNotHeld),
                ))
            }
            AdmitReply::Refused {
                code,
                rate_wait_micros,
                capacity,
            } => {
                let capacity_wait = if capacity {
                    secs_at_least_one(inner.options.capacity_retry).as_nanos() as u64
                } else {
                    0
                };
                Err(AdmitError::Refused(Refusal::after_nanos(
                    code,
                    rate_wait_micros.saturating_mul(1000).max(capacity_wait),
                )))
            }
        }
    }

    /// Swaps in a new, already validated configuration; the next decision uses it.
    pub fn reload(&self, config: Config) {
        self.inner.config.store(Arc::new(config));
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        Config::clone(&self.inner.config.load())
    }

    /// The shared counts now, across every replica.
    pub async fn counts(&self) -> Result<SharedCounts, Unavailable> {
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

    /// Releases, exactly once, what every replica whose lease has lapsed held; returns how many
    /// operations were released. The heartbeat does this on every beat.
    pub async fn reap(&self) -> Result<u64, Unavailable> {
        self.inner.reap().await
    }

    /// Sends the releases kept while Redis did not answer; returns whether none is left.
    pub async fn flush(&self) -> bool {
        self.inner.drain().await
    }

    /// Renews the lease now (as the heartbeat does), re-registering if it lapsed.
    pub async fn renew(&self) -> Result<(), Unavailable> {
        self.inner.renew().await
    }

    /// What this replica's backend has seen.
    pub fn stats(&self) -> RedisStats {
        let inner = &self.inner;
        // Relaxed: statistics.
        RedisStats {
            errors: inner.errors.load(Ordering::Relaxed),
            lease_changes: inner.lease_changes.load(Ordering::Relaxed),
            reaped: inner.reaped.load(Ordering::Relaxed),
            unavailable: inner.unavailable.load(Ordering::Relaxed),
            outbox: inner.outbox.lock().unwrap_or_else(|p| p.into_inner()).len() as u64,
            lease_held: inner.lease_held(),
            circuit_open: inner.circuit.is_open(),
        }
    }
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

impl Inner {
    pub(crate) fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Held>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lease_held(&self) -> bool {
        self.lease_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|until| Instant::now() < until)
    }

    fn lease_lost(&self) {
        let was = self
            .lease_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
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
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|k| k.id == id)
    }

    /// Keeps a release to send when Redis answers, and wakes the sender.
    pub(crate) fn keep(&self, kept: Kept) {
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kept);
        self.wake.notify_one();
    }

    /// Runs the transition script for `id`.
    pub(crate) async fn transition(
        &self,
        id: &str,
        target: Target,
    ) -> Result<TransitionReply, UnavailableReason> {
        let limit = self.config.load().limits().global_executing;
        let (interval, span) = match target {
            Target::Refund(interval, span) => (interval, span),
            _ => (0, 0),
        };
        let mut invocation = self.scripts.transition.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .arg(&self.keys.base)
            .arg(id)
            .arg(target.arg())
            .arg(limit)
            .arg(interval)
            .arg(span);
        let value = self.call(&invocation).await?;
        reply::parse_transition(&value).map_err(|e| UnavailableReason::Reply(e.to_string()))
    }

    /// Sends a release now, or keeps it for later if Redis does not answer (or earlier releases
    /// are still waiting, so they go first).
    pub(crate) async fn release(&self, id: &str, target: Target) {
        let waiting = !self
            .outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        if !waiting && !self.circuit.is_open() {
            let _shared = self.registration.read().await;
            if self.transition(id, target).await.is_ok() {
                return;
            }
        }
        self.keep(Kept {
            id: id.to_string(),
            target,
        });
    }

    /// Sends kept releases in order until one fails; returns whether none is left.
    async fn drain(&self) -> bool {
        let _shared = self.registration.read().await;
        loop {
            let next = self
                .outbox
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .first()
                .cloned();
            let Some(kept) = next else { return true };
            if self.transition(&kept.id, kept.target).await.is_err() {
                return false;
            }
            let mut outbox = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
            if outbox.first().is_some_and(|k| k.id == kept.id) {
                outbox.remove(0);
            }
        }
    }

    /// One heartbeat: kept releases, the lease, then lapsed replicas.
    async fn tick(&self) {
        self.drain().await;
        if self.renew().await.is_ok() {
            let _ = self.reap().await;
        }
    }

    async fn renew(&self) -> Result<(), Unavailable> {
        let sent = Instant::now();
        let mut invocation = self.scripts.heartbeat.prepare_invoke();
        invocation
            .key(self.keys.lease(&self.options.replica))
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl));
        let value = match self.call(&invocation).await {
            Ok(v) => v,
            Err(reason) => return Err(self.unavailable(reason)),
        };
        match reply::parse_lease(&value) {
            Ok(LeaseReply::Renewed) => {
                *self.lease_until.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(sent + self.options.lease_ttl);
                Ok(())
            }
            Ok(LeaseReply::Lapsed) => {
                // Cut off for longer than the lease: the others may have released what this
                // replica held. Count again what it holds now, as a restart would.
                self.lease_lost();
                let _alone = self.registration.write().await;
                self.replace_locked().await
            }
            Ok(LeaseReply::Taken) => {
                self.lease_lost();
                Err(self.unavailable(UnavailableReason::LeaseNotHeld))
            }
            Err(e) => Err(self.unavailable(UnavailableReason::Reply(e.to_string()))),
        }
    }

    /// The replace script with what `held` says now. The caller holds `registration` alone.
    async fn replace_locked(&self) -> Result<(), Unavailable> {
        let sent = Instant::now();
        let replica = &self.options.replica;
        let mut invocation = self.scripts.replace.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(self.keys.held(replica))
            .key(self.keys.lease(replica))
            .key(&self.keys.replicas)
            .arg(&self.keys.base)
            .arg(replica)
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl));
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
        reply::parse_pair(&value)
            .map_err(|e| self.unavailable(UnavailableReason::Reply(e.to_string())))?;
        // Kept releases were for operations no longer held here: what Redis holds for this
        // replica is now exactly `held`, so they are moot.
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        *self.lease_until.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(sent + self.options.lease_ttl);
        // Relaxed: a statistic.
        self.lease_changes.fetch_add(1, Ordering::Relaxed);
        Ok(())
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

fn ttl_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .heartbeat
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}
