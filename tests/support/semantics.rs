//! One face for the two admission backends — the in-process engine on a manual clock, and the
//! Redis-backed one on Redis server time — so each semantic test of SPEC section 2 is written once
//! and run against both (section 7: the same contract). Both are the library's one
//! [`Admission`] type; what differs stays here: how each is built, that Redis sends a dropped
//! handle's release in the background ([`Backend::settle`] waits for it), and that its time is
//! real ([`Backend::assert_rate_wait`] bounds a rate wait by the time that passed, where the
//! manual clock gives it exactly).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use unyolo_admission::admission::{
    Admission, AdmitError, DeploymentCounts, Refused, ReplicaOptions, RestoredOperation,
};
pub use unyolo_admission::admission::{
    AdmissionPermit as AnyPermit, OperationHandle as AnyOperation,
};
use unyolo_admission::engine::DEFAULT_CAPACITY_RETRY;
use unyolo_admission::{
    ClientLimits, Config, Controller, Identity, Limits, ManualClock, OperationState, Refusal,
    RefusalCode, StorageCaps,
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
            refusal_memory: true,
        }
    }
}

/// What a backend is built with.
pub struct Setup {
    kind: Kind,
    config: Config,
    caps: StorageCaps,
    capacity_retry: Duration,
    refusal_memory: bool,
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

    /// On Redis, no refusal answered from memory: for a test that asks again right after a
    /// release, whose notice (which ends a remembered refusal) arrives on a connection of its
    /// own, a moment later.
    pub fn without_refusal_memory(mut self) -> Setup {
        self.refusal_memory = false;
        self
    }

    /// The backend, registered and ready to admit; `None` (having said why) only when Redis is
    /// asked for and `redis-server` cannot be run here.
    pub async fn start(self) -> Option<Backend> {
        let clock = ManualClock::new();
        clock.set_nanos(1_000_000_000);
        let builder = Controller::builder(self.config)
            .storage_caps(self.caps)
            .capacity_retry(self.capacity_retry);
        match self.kind {
            Kind::InProcess => Some(Backend {
                admission: Admission::in_process(builder.clock(clock.clone()).build()),
                clock: Some(clock),
                started: Instant::now(),
            }),
            Kind::Redis => {
                let Some(server) = redis_support::process_server() else {
                    eprintln!(
                        "SKIPPED: {}: no redis-server to run the Redis backend against",
                        std::thread::current().name().unwrap_or("a semantic test")
                    );
                    return None;
                };
                let mut options = ReplicaOptions::new(server.url(), "r1");
                // The deployment under this prefix is r1 alone: it admits once registered.
                options.replicas = vec!["r1".to_owned()];
                options.prefix = format!("semantics-{}", next());
                // Generous: a shared, noisy machine must not fail a decision for slowness.
                options.call_timeout = Duration::from_secs(5);
                options.lease_ttl = Duration::from_secs(60);
                options.heartbeat = Duration::from_secs(20);
                options.refusal_memory = self.refusal_memory;
                // The engine on real time, as a replica's is: its rate bucket then agrees with
                // Redis's (the shared decision binds; the local one follows it).
                let admission =
                    Admission::new(builder.build(), Some(options)).expect("valid replica options");
                let restored = admission.restore(Vec::new()).await;
                assert!(
                    restored.deferred.is_none(),
                    "the test process's redis-server answers"
                );
                Some(Backend {
                    admission,
                    clock: None,
                    started: Instant::now(),
                })
            }
        }
    }
}

/// An admission backend under test: the library's [`Admission`], in-process on a manual clock or
/// replicated on Redis.
pub struct Backend {
    pub admission: Admission,
    /// The in-process backend's clock; `None` on Redis, whose time is real.
    clock: Option<ManualClock>,
    /// When it was set up: real time has passed since, at most this much.
    started: Instant,
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
        if self.admission.is_replicated() {
            Kind::Redis
        } else {
            Kind::InProcess
        }
    }

    /// The in-process controller, for what only it can show (its snapshot's token readings and
    /// statistics); `None` on Redis.
    pub fn in_process(&self) -> Option<&Controller> {
        (!self.admission.is_replicated()).then(|| self.admission.controller())
    }

    /// The in-process backend's clock, for what only a clock a test moves can show; `None` on
    /// Redis.
    pub fn manual_clock(&self) -> Option<&ManualClock> {
        self.clock.as_ref()
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

    /// Decides one submission. An answer other than admitted or refused (unavailable, replay)
    /// fails the test: the semantic tests run on a healthy Redis without idempotency keys.
    pub async fn admit(&self, client: &str, needs_approval: bool) -> Result<AnyPermit, Refusal> {
        match self.admission.admit(client, needs_approval, None).await {
            Ok(permit) => Ok(permit),
            Err(AdmitError::Refused(refused)) => Err(refused.refusal),
            Err(other) => panic!("admission neither admitted nor refused: {other}"),
        }
    }

    /// The whole answer to a submission expected to be refused (the refusal, the quota, and
    /// whether a pool's fair share made it).
    pub async fn refused(&self, client: &str, needs_approval: bool) -> Refused {
        match self.admission.admit(client, needs_approval, None).await {
            Ok(permit) => panic!("{client} admitted ({permit:?}), expected a refusal"),
            Err(AdmitError::Refused(refused)) => refused,
            Err(other) => panic!("admission neither admitted nor refused: {other}"),
        }
    }

    /// Each pool's holders now, (active, executing): the whole deployment's (Redis's), or the
    /// engine's in-process.
    pub async fn holders(&self) -> (u64, u64) {
        let c: DeploymentCounts = self.admission.counts().await.expect("redis answers");
        (c.active_holders, c.executing_holders)
    }

    /// The fair-share refusals this process answered, by pool and reason (indexed like
    /// `FairShareRefusal::ALL`): counted by its engine on both backends.
    pub fn fair_share_refusals(&self) -> [u64; 4] {
        self.admission.snapshot().fair_share_refusals
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
        let restored: Vec<RestoredOperation> = ops
            .iter()
            .map(|&(name, state)| RestoredOperation {
                id: format!("restored-{}", next()),
                identity: Identity::new(name).expect("a valid identity"),
                state,
            })
            .collect();
        let ids: Vec<String> = restored.iter().map(|op| op.id.clone()).collect();
        let restored = self.admission.restore(restored).await;
        assert!(restored.deferred.is_none(), "the replica registers");
        restored
            .operations
            .into_iter()
            .zip(ids)
            .map(|(handle, id)| {
                let handle = handle.ok()?;
                assert_eq!(handle.is_replicated(), self.admission.is_replicated());
                assert_eq!(
                    handle.id().to_string(),
                    id,
                    "a restored handle keeps its stored id"
                );
                Some(handle)
            })
            .collect()
    }

    /// Swaps in a new configuration.
    pub fn reload(&self, config: Config) {
        self.admission.reload(config);
    }

    /// Waits until the releases of dropped permits and handles have reached the counts (the
    /// in-process engine releases on drop; Redis sends them in the background).
    pub async fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.admission.flush().await {
            assert!(
                Instant::now() < deadline,
                "kept releases never reached Redis"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The counts now: the whole deployment's (Redis's), or the engine's in-process.
    pub async fn counts(&self) -> Counts {
        let c: DeploymentCounts = self.admission.counts().await.expect("redis answers");
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

    /// Asserts a rate refusal's Retry-After: exactly `expected` on the manual clock (where no
    /// time passes unless a test moves it); on Redis, whose clock is real, `expected` less at most
    /// the whole seconds that passed since the backend was set up, and never below one second.
    pub fn assert_rate_wait(&self, refusal: &Refusal, expected: Duration) {
        assert_eq!(
            refusal.code,
            RefusalCode::SubmissionRateLimited,
            "{refusal:?}"
        );
        if self.clock.is_some() {
            assert_eq!(refusal.retry_after, expected, "{refusal:?}");
        } else {
            let passed = Duration::from_secs(self.started.elapsed().as_secs() + 1);
            let lowest = expected.saturating_sub(passed).max(Duration::from_secs(1));
            assert!(
                refusal.retry_after <= expected && refusal.retry_after >= lowest,
                "{refusal:?}: expected {expected:?}, at most {passed:?} less"
            );
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

/// Writes `mod in_process` and `mod redis`, each with one test per name that runs the async
/// function of that name against its backend.
#[macro_export]
macro_rules! semantic_tests {
    ($($name:ident),* $(,)?) => {
        mod in_process {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::InProcess).await
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Redis).await
                }
            )*
        }
    };
}

/// An hour: a token of `limits(10, HOUR, ..)` takes six minutes to come back.
pub const HOUR: u32 = 3600;
/// A day: the longest window the configuration allows.
pub const DAY: u32 = 86_400;

/// The identity `name`.
pub fn id(name: &str) -> Identity {
    Identity::new(name).unwrap()
}

/// A client's limits: `n` tokens per `w` seconds, `active`, `pending`.
pub fn limits(n: u32, w: u32, active: u32, pending: u32) -> ClientLimits {
    ClientLimits {
        requests_per_window: n,
        window_seconds: w,
        active,
        pending,
    }
}

/// The global limits `ga` active and `ge` executing, the rest the defaults.
pub fn global(ga: u32, ge: u32) -> Limits {
    let client_active = ga.min(25);
    Limits {
        global_active: ga,
        global_executing: ge,
        client_active,
        client_pending: client_active.min(10),
        ..Limits::DEFAULT
    }
}

/// A configuration of `globals`, the `overrides`, and the identities `names`.
pub fn config(globals: Limits, overrides: &[(&str, ClientLimits)], names: &[&str]) -> Config {
    let overrides: BTreeMap<Identity, ClientLimits> =
        overrides.iter().map(|(n, l)| (id(n), *l)).collect();
    Config::new(globals, overrides, names.iter().map(|n| id(n))).unwrap()
}

/// `bot` with its own limits, `other` on the defaults, everything global roomy.
pub fn one_client_config(n: u32, w: u32, active: u32, pending: u32) -> Config {
    config(
        Limits::DEFAULT,
        &[("bot", limits(n, w, active, pending))],
        &["bot", "other"],
    )
}

/// A backend of [`one_client_config`], started (`None` when it cannot run here).
pub async fn one_client(kind: Kind, n: u32, w: u32, active: u32, pending: u32) -> Option<Backend> {
    kind.with(one_client_config(n, w, active, pending))
        .start()
        .await
}
