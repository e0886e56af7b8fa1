//! One face for the two admission backends — the in-process [`Controller`] on a manual clock, and
//! the Redis-backed [`RedisController`] on Redis server time — so each semantic test of SPEC
//! section 2 is written once and run against both (section 7: the same contract).
//!
//! What the tests see: `admit` → a permit or a [`Refusal`]; the permit's `commit`, `refund` or
//! drop; the operation's transitions; `restore` at start-up; `reload`; and the counts, global and
//! per client. What differs stays here: Redis sends a dropped handle's release in the background
//! ([`Backend::settle`] waits for it), its operations need ids (made up here), and its time is
//! real ([`Backend::assert_rate_wait`] bounds a rate wait by the time that passed, where the
//! manual clock gives it exactly).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use unyolo_admission::engine::DEFAULT_CAPACITY_RETRY;
use unyolo_admission::redis::{
    AdmitError, RedisController, RedisOperation, RedisOptions, RedisPermit, RedisStartError,
    RestoredOperation,
};
use unyolo_admission::{
    CancelOutcome, Config, Controller, Identity, ManualClock, Operation, OperationState, Permit,
    Refusal, RefusalCode, StartError, StorageCaps, TransitionError,
};

use super::redis as redis_support;

/// Which backend a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    InProcess,
    Redis,
}

impl Kind {
    /// A backend for `config` with the default caps and capacity hint (see [`Setup`]).
    pub fn with(self, config: Config) -> Setup {
        Setup {
            kind: self,
            config,
            caps: StorageCaps::default(),
            capacity_retry: DEFAULT_CAPACITY_RETRY,
        }
    }
}

/// What a backend is built with.
pub struct Setup {
    kind: Kind,
    config: Config,
    caps: StorageCaps,
    capacity_retry: Duration,
}

/// Distinct key prefixes (and operation ids) for the tests sharing the process's Redis.
static NEXT: AtomicU64 = AtomicU64::new(0);

fn next() -> u64 {
    // Relaxed: only uniqueness matters.
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Setup {
    /// The pending-grant caps (the storage caps are in-process only).
    pub fn caps(mut self, caps: StorageCaps) -> Setup {
        self.caps = caps;
        self
    }

    /// The Retry-After of capacity refusals.
    pub fn capacity_retry(mut self, hint: Duration) -> Setup {
        self.capacity_retry = hint;
        self
    }

    /// The backend, registered and ready to admit; `None` (having said why) only when Redis is
    /// asked for and `redis-server` cannot be run here.
    pub async fn start(self) -> Option<Backend> {
        match self.kind {
            Kind::InProcess => {
                let clock = ManualClock::new();
                clock.set_nanos(1_000_000_000);
                let controller = Controller::builder(self.config)
                    .clock(clock.clone())
                    .storage_caps(self.caps)
                    .capacity_retry(self.capacity_retry)
                    .build();
                Some(Backend::InProcess { controller, clock })
            }
            Kind::Redis => {
                let Some(server) = redis_support::process_server() else {
                    eprintln!(
                        "SKIPPED: {}: no redis-server to run the Redis backend against",
                        std::thread::current().name().unwrap_or("a semantic test")
                    );
                    return None;
                };
                let mut options = RedisOptions::new(server.url(), "r1");
                options.prefix = format!("semantics-{}", next());
                options.caps = self.caps;
                options.capacity_retry = self.capacity_retry;
                // Generous: a shared, noisy machine must not fail a decision for slowness.
                options.call_timeout = Duration::from_secs(5);
                options.lease_ttl = Duration::from_secs(60);
                options.heartbeat = Duration::from_secs(20);
                let controller = RedisController::connect(self.config, options)
                    .await
                    .expect("the test process's redis-server answers");
                controller
                    .register(Vec::new())
                    .await
                    .expect("the replica registers");
                Some(Backend::Redis {
                    controller,
                    started: Instant::now(),
                })
            }
        }
    }
}

/// An admission backend under test.
pub enum Backend {
    InProcess {
        controller: Controller,
        clock: ManualClock,
    },
    Redis {
        controller: RedisController,
        /// When it was set up: real time has passed since, at most this much.
        started: Instant,
    },
}

/// The counts of one scope (global, or one client).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub active: u64,
    pub pending: u64,
    /// Approved, waiting for an execution slot: active − pending − executing.
    pub queued: u64,
    pub executing: u64,
}

impl Tally {
    fn new(active: u64, pending: u64, executing: u64) -> Tally {
        Tally {
            active,
            pending,
            queued: active - pending - executing,
            executing,
        }
    }

    /// (active, pending, queued, executing), for terse assertions.
    pub fn all(self) -> (u64, u64, u64, u64) {
        (self.active, self.pending, self.queued, self.executing)
    }

    fn is_zero(self) -> bool {
        self == Tally::default()
    }
}

/// Every count the backend holds now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub global: Tally,
    /// Only clients holding something.
    pub clients: BTreeMap<String, Tally>,
}

impl Counts {
    pub fn client(&self, name: &str) -> Tally {
        self.clients.get(name).copied().unwrap_or_default()
    }

    pub fn is_idle(&self) -> bool {
        self.global.is_zero() && self.clients.is_empty()
    }
}

impl Backend {
    pub fn kind(&self) -> Kind {
        match self {
            Backend::InProcess { .. } => Kind::InProcess,
            Backend::Redis { .. } => Kind::Redis,
        }
    }

    /// The in-process controller, for what only it can show (its snapshot's token readings and
    /// statistics); `None` on Redis.
    pub fn in_process(&self) -> Option<&Controller> {
        match self {
            Backend::InProcess { controller, .. } => Some(controller),
            Backend::Redis { .. } => None,
        }
    }

    /// The in-process backend's clock, for what only a clock a test moves can show; `None` on
    /// Redis.
    pub fn manual_clock(&self) -> Option<&ManualClock> {
        match self {
            Backend::InProcess { clock, .. } => Some(clock),
            Backend::Redis { .. } => None,
        }
    }

    /// Admissions by `client` (each committed then failed, so no slot stays taken) until one is
    /// refused: how many were admitted, and the refusal.
    pub async fn drain(&self, client: &str) -> (u64, Refusal) {
        let mut admitted = 0;
        loop {
            match self.admit(client, false).await {
                Ok(permit) => {
                    permit.commit().fail().await.unwrap();
                    admitted += 1;
                }
                Err(refusal) => return (admitted, refusal),
            }
            assert!(admitted <= 1_000_000, "{client}'s bucket never empties");
        }
    }

    /// Decides one submission. On Redis an answer other than admitted or refused (unavailable,
    /// replay) fails the test: the semantic tests run on a healthy Redis without idempotency keys.
    pub async fn admit(&self, client: &str, needs_approval: bool) -> Result<AnyPermit, Refusal> {
        match self {
            Backend::InProcess { controller, .. } => controller
                .admit(client, needs_approval)
                .map(AnyPermit::InProcess),
            Backend::Redis { controller, .. } => {
                let id = format!("op-{}", next());
                match controller.admit(client, needs_approval, &id, None).await {
                    Ok(permit) => Ok(AnyPermit::Redis(permit)),
                    Err(AdmitError::Refused(refusal)) => Err(refusal),
                    Err(other) => panic!("redis admission neither admitted nor refused: {other}"),
                }
            }
        }
    }

    /// Admits and commits, failing the test on a refusal.
    pub async fn admit_op(&self, client: &str, needs_approval: bool) -> AnyOperation {
        match self.admit(client, needs_approval).await {
            Ok(permit) => permit.commit(),
            Err(refusal) => panic!("{client} refused: {refusal:?}"),
        }
    }

    /// The refusal of an admission expected to be refused.
    pub async fn refusal(&self, client: &str, needs_approval: bool) -> Refusal {
        match self.admit(client, needs_approval).await {
            Ok(permit) => panic!("{client} admitted ({permit:?}), expected a refusal"),
            Err(refusal) => refusal,
        }
    }

    /// Restores the live operations a store holds, at start-up (before anything is admitted:
    /// on Redis this is the replica's registration, which replaces what it held). One entry per
    /// input, in order: `None` where the state is terminal (nothing restored).
    pub async fn restore(&self, ops: &[(&str, OperationState)]) -> Vec<Option<AnyOperation>> {
        match self {
            Backend::InProcess { controller, .. } => ops
                .iter()
                .map(|&(name, state)| {
                    controller
                        .restore(name, state)
                        .ok()
                        .map(AnyOperation::InProcess)
                })
                .collect(),
            Backend::Redis { controller, .. } => {
                let restored: Vec<RestoredOperation> = ops
                    .iter()
                    .map(|&(name, state)| RestoredOperation {
                        id: format!("restored-{}", next()),
                        identity: Identity::new(name).expect("a valid identity"),
                        state,
                    })
                    .collect();
                let mut handles = controller
                    .register(restored.clone())
                    .await
                    .expect("the replica registers")
                    .into_iter();
                restored
                    .iter()
                    .map(|op| {
                        if op.state.is_terminal() {
                            return None;
                        }
                        let handle = handles.next().expect("a handle per live operation");
                        assert_eq!(handle.id(), op.id);
                        Some(AnyOperation::Redis(handle))
                    })
                    .collect()
            }
        }
    }

    /// Swaps in a new configuration.
    pub fn reload(&self, config: Config) {
        match self {
            Backend::InProcess { controller, .. } => controller.reload(config),
            Backend::Redis { controller, .. } => controller.reload(config),
        }
    }

    /// Waits until the releases of dropped permits and handles have reached the counts (the
    /// in-process engine releases on drop; Redis sends them in the background).
    pub async fn settle(&self) {
        if let Backend::Redis { controller, .. } = self {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !controller.flush().await {
                assert!(
                    Instant::now() < deadline,
                    "kept releases never reached Redis"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// The counts now.
    pub async fn counts(&self) -> Counts {
        match self {
            Backend::InProcess { controller, .. } => {
                let s = controller.snapshot();
                Counts {
                    global: Tally::new(s.active, s.pending, s.executing),
                    clients: s
                        .clients
                        .iter()
                        .map(|c| {
                            (
                                c.identity.to_string(),
                                Tally::new(c.active, c.pending, c.executing),
                            )
                        })
                        .filter(|(_, t)| !t.is_zero())
                        .collect(),
                }
            }
            Backend::Redis { controller, .. } => {
                let c = controller.counts().await.expect("redis answers");
                Counts {
                    global: Tally::new(c.active, c.pending, c.executing),
                    clients: c
                        .clients
                        .iter()
                        .map(|(name, &(a, p, e))| (name.clone(), Tally::new(a, p, e)))
                        .filter(|(_, t)| !t.is_zero())
                        .collect(),
                }
            }
        }
    }

    /// Asserts a rate refusal's Retry-After: exactly `expected` on the manual clock (where no
    /// time passes unless a test moves it); on Redis, whose clock is real, `expected` less at most
    /// the whole seconds that passed since the backend was set up, and never below one second.
    pub fn assert_rate_wait(&self, refusal: &Refusal, expected: Duration) {
        assert_eq!(
            refusal.code,
            RefusalCode::SubmissionRateLimited,
            "{refusal:?}"
        );
        match self {
            Backend::InProcess { .. } => assert_eq!(refusal.retry_after, expected, "{refusal:?}"),
            Backend::Redis { started, .. } => {
                let passed = Duration::from_secs(started.elapsed().as_secs() + 1);
                let lowest = expected.saturating_sub(passed).max(Duration::from_secs(1));
                assert!(
                    refusal.retry_after <= expected && refusal.retry_after >= lowest,
                    "{refusal:?}: expected {expected:?}, at most {passed:?} less"
                );
            }
        }
    }

    /// How many tokens `client` has, found by spending them all: admissions (each committed then
    /// failed, so no slot stays taken) until the rate refuses. The in-process snapshot's reading
    /// is checked against the count first. Use windows long enough that no token comes back
    /// while a test runs (Redis's time is real).
    pub async fn spend_all_tokens(&self, client: &str) -> u64 {
        let reading = self
            .in_process()
            .map(|c| c.snapshot().client(client).map_or(0, |c| c.tokens));
        let (spent, refusal) = self.drain(client).await;
        assert_eq!(
            refusal.code,
            RefusalCode::SubmissionRateLimited,
            "{client}'s tokens are counted only while capacity is free"
        );
        if let Some(reading) = reading {
            assert_eq!(reading, spent, "the snapshot's token reading for {client}");
        }
        spent
    }
}

/// A permit of either backend.
#[derive(Debug)]
pub enum AnyPermit {
    InProcess(Permit),
    Redis(RedisPermit),
}

impl AnyPermit {
    pub fn commit(self) -> AnyOperation {
        match self {
            AnyPermit::InProcess(p) => AnyOperation::InProcess(p.commit()),
            AnyPermit::Redis(p) => AnyOperation::Redis(p.commit()),
        }
    }

    pub async fn refund(self) {
        match self {
            AnyPermit::InProcess(p) => p.refund(),
            AnyPermit::Redis(p) => p.refund().await,
        }
    }
}

/// Why an operation did not start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotStarted {
    /// Every execution slot is taken: it stays queued.
    Saturated(Refusal),
    /// It is not approved.
    NotApproved(OperationState),
}

/// A lifecycle handle of either backend.
#[derive(Debug)]
pub enum AnyOperation {
    InProcess(Operation),
    Redis(RedisOperation),
}

impl AnyOperation {
    pub fn state(&self) -> OperationState {
        match self {
            AnyOperation::InProcess(o) => o.state(),
            AnyOperation::Redis(o) => o.state(),
        }
    }

    pub async fn approve(&self) -> Result<(), TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.approve(),
            AnyOperation::Redis(o) => o.approve().await,
        }
    }

    pub async fn deny(&self) -> Result<(), TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.deny(),
            AnyOperation::Redis(o) => o.deny().await,
        }
    }

    pub async fn cancel(&self) -> Result<CancelOutcome, TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.cancel(),
            AnyOperation::Redis(o) => o.cancel().await,
        }
    }

    pub async fn expire(&self) -> Result<(), TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.expire(),
            AnyOperation::Redis(o) => o.expire().await,
        }
    }

    pub async fn fail(&self) -> Result<(), TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.fail(),
            AnyOperation::Redis(o) => o.fail().await,
        }
    }

    pub async fn succeed(&self) -> Result<(), TransitionError> {
        match self {
            AnyOperation::InProcess(o) => o.succeed(),
            AnyOperation::Redis(o) => o.succeed().await,
        }
    }

    /// Takes an execution slot: `approved` → `executing`. On Redis, an unavailable answer fails
    /// the test (the semantic tests run on a healthy Redis).
    pub async fn try_start(&self) -> Result<(), NotStarted> {
        match self {
            AnyOperation::InProcess(o) => o.try_start().map_err(|e| match e {
                StartError::Saturated(r) => NotStarted::Saturated(r),
                StartError::NotApproved(s) => NotStarted::NotApproved(s),
            }),
            AnyOperation::Redis(o) => o.try_start().await.map_err(|e| match e {
                RedisStartError::Saturated(r) => NotStarted::Saturated(r),
                RedisStartError::NotApproved(s) => NotStarted::NotApproved(s),
                RedisStartError::Unavailable(u) => panic!("redis unavailable: {u}"),
            }),
        }
    }
}
