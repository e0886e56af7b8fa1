//! Replicas when Redis forgets (SPEC section 7, "Redis forgets"; issue 18): three replicas on a
//! real `redis-server`, with pending, approved and executing work on every one, through Redis
//! restarted empty (`kill -9`, no persistence) and `FLUSHALL`. Throughout, the deployment's
//! counts never exceed a limit; after recovery every replica's holdings, its clients' spent rate
//! tokens and its idempotency keys are back, and nothing is admitted that the limits refuse.

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::eventually::assert_eventually;
use support::redis::RedisServer;
use support::rng::Rng;
use unyolo_admission::admission::{
    Admission, AdmitError, KeyRecord, NotStarted, OperationHandle, RecoverySource, ReplicaOptions,
    SourceFuture, UnavailableReason,
};
use unyolo_admission::config::{ClientLimits, Limits};
use unyolo_admission::{Config, Controller, Identity, OperationState, RefusalCode};

const REPLICAS: [&str; 3] = ["r1", "r2", "r3"];

/// amy: 6 live at most (3 pending), plenty of tokens; bob: 5 tokens per 600 s; 4 executing at
/// most in all.
fn config() -> Config {
    let (amy, bob) = (Identity::new("amy").unwrap(), Identity::new("bob").unwrap());
    let limits = Limits {
        requests_per_window: 1_000,
        window_seconds: 60,
        client_active: 20,
        client_pending: 10,
        global_active: 40,
        global_executing: 4,
    };
    let mut overrides = BTreeMap::new();
    overrides.insert(
        amy.clone(),
        ClientLimits {
            requests_per_window: 1_000,
            window_seconds: 60,
            active: 6,
            pending: 3,
        },
    );
    overrides.insert(
        bob.clone(),
        ClientLimits {
            requests_per_window: 5,
            window_seconds: 600,
            active: 20,
            pending: 10,
        },
    );
    Config::new(limits, overrides, [amy, bob]).unwrap()
}

/// What a replica's store would hold: its operations' keys and its admissions' times, and, once
/// a test says so, which live rows it still owns.
#[derive(Default)]
struct MemoryStore {
    keys: Mutex<Vec<KeyRecord>>,
    admitted: Mutex<Vec<(Identity, Instant)>>,
    owned: Mutex<Option<Vec<(String, OperationState)>>>,
}

impl RecoverySource for MemoryStore {
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>> {
        let keys = self.keys.lock().unwrap().clone();
        Box::pin(async move { Ok(keys) })
    }

    fn recent_admissions(&self, within: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>> {
        let admitted: Vec<(Identity, Duration)> = self
            .admitted
            .lock()
            .unwrap()
            .iter()
            .map(|(client, at)| (client.clone(), at.elapsed()))
            .filter(|(_, age)| *age < within)
            .collect();
        Box::pin(async move { Ok(admitted) })
    }

    fn owned_live(&self) -> SourceFuture<'_, Option<Vec<(String, OperationState)>>> {
        let owned = self.owned.lock().unwrap().clone();
        Box::pin(async move { Ok(owned) })
    }
}

struct Replica {
    admission: Admission,
    store: Arc<MemoryStore>,
    live: Vec<OperationHandle>,
}

impl Replica {
    async fn start(server: &RedisServer, name: &str) -> Replica {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.replicas = REPLICAS.iter().map(|r| r.to_string()).collect();
        // A short lease, so a lost one is noticed quickly; generous calls for a noisy machine.
        options.lease_ttl = Duration::from_secs(4);
        options.heartbeat = Duration::from_millis(300);
        options.call_timeout = Duration::from_secs(2);
        options.circuit_cool_down = Duration::from_millis(100);
        let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
        let store = Arc::new(MemoryStore::default());
        admission.set_recovery_source(Arc::clone(&store) as Arc<dyn RecoverySource>);
        let restored = admission.restore(Vec::new()).await;
        assert!(restored.deferred.is_none(), "{name} registers");
        Replica {
            admission,
            store,
            live: Vec::new(),
        }
    }

    /// Admits and commits (recording it as a store would), or says why not.
    async fn submit(
        &mut self,
        client: &str,
        approval: bool,
        key: &str,
    ) -> Result<usize, AdmitError> {
        let permit = self.admission.admit(client, approval, Some(key)).await?;
        let identity = Identity::new(client).unwrap();
        self.store.keys.lock().unwrap().push(KeyRecord {
            client: identity.clone(),
            key: key.to_string(),
            operation: permit.id().to_string(),
        });
        self.store
            .admitted
            .lock()
            .unwrap()
            .push((identity, Instant::now()));
        self.live.push(permit.commit());
        Ok(self.live.len() - 1)
    }
}

async fn three_replicas(server: &RedisServer) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for name in REPLICAS {
        replicas.push(Replica::start(server, name).await);
    }
    replicas
}

/// On every replica: amy 2 live (one pending, one approved), one of them (on r1 and r2) executing;
/// bob's 5 tokens spent on r1 (his operations live, queued). amy is then at her limit of 6, the
/// pool holds 2 of 4, bob has no token.
async fn fill(replicas: &mut [Replica]) {
    for (i, replica) in replicas.iter_mut().enumerate() {
        replica
            .submit("amy", true, &format!("amy-p-{i}"))
            .await
            .unwrap();
        let run = replica
            .submit("amy", false, &format!("amy-a-{i}"))
            .await
            .unwrap();
        if i < 2 {
            replica.live[run].try_start().await.unwrap();
        }
    }
    for n in 0..5 {
        replicas[0]
            .submit("bob", false, &format!("bob-{n}"))
            .await
            .unwrap();
    }
    let counts = replicas[0].admission.counts().await.unwrap();
    assert_eq!(counts.clients["amy"].0, 6, "amy at her limit");
    assert_eq!(counts.executing, 2);
}

/// Every sampled reading of the deployment's counts stays within the limits.
fn assert_within_limits(counts: &unyolo_admission::admission::DeploymentCounts, when: &str) {
    let (amy, bob) = (
        counts.clients.get("amy").copied().unwrap_or_default(),
        counts.clients.get("bob").copied().unwrap_or_default(),
    );
    assert!(
        amy.0 <= 6 && amy.1 <= 3,
        "{when}: amy over her limits: {counts:?}"
    );
    assert!(bob.0 <= 20, "{when}: bob over his limit: {counts:?}");
    assert!(
        counts.executing <= 4,
        "{when}: executing over 4: {counts:?}"
    );
    assert!(counts.active <= 40, "{when}: active over 40: {counts:?}");
}

/// While the replicas recover, every replica keeps trying to admit amy (at her limit) and bob
/// (out of tokens), and the counts are sampled: nothing may get through, and no sample may exceed
/// a limit. Returns once all three admit again (a fresh client's admission goes through).
async fn recover_admitting_nothing_over_a_limit(replicas: &mut [Replica]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut unavailable = 0;
    loop {
        assert!(Instant::now() < deadline, "the replicas never recovered");
        let mut recovered = 0;
        for (i, replica) in replicas.iter_mut().enumerate() {
            for (client, approval) in [("amy", false), ("amy", true), ("bob", false)] {
                match replica.admission.admit(client, approval, None).await {
                    Ok(permit) => {
                        panic!("r{} admitted {client} while at a limit: {permit:?}", i + 1)
                    }
                    Err(AdmitError::Refused(refused)) => {
                        let expected = if client == "amy" {
                            RefusalCode::ClientOperationLimit
                        } else {
                            RefusalCode::SubmissionRateLimited
                        };
                        assert_eq!(refused.refusal.code, expected, "{client} on r{}", i + 1);
                        recovered += 1;
                    }
                    Err(AdmitError::Unavailable(u)) => {
                        assert!(
                            matches!(
                                u.reason,
                                UnavailableReason::LeaseNotHeld
                                    | UnavailableReason::Recovering
                                    | UnavailableReason::Timeout
                                    | UnavailableReason::CircuitOpen
                                    | UnavailableReason::Redis(_)
                            ),
                            "{u}"
                        );
                        unavailable += 1;
                    }
                    Err(AdmitError::Replay { .. }) => unreachable!("no key"),
                }
            }
            if let Ok(counts) = replica.admission.counts().await {
                assert_within_limits(&counts, "while recovering");
            }
        }
        if recovered == 3 * replicas.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        unavailable > 0,
        "no admission was ever refused as unavailable: did Redis forget?"
    );
}

/// After recovery: the counts are every live handle again, the pool is as full as before, and
/// each key still names its one operation on every replica.
async fn assert_everything_back(replicas: &mut [Replica]) {
    let live: usize = replicas.iter().map(|r| r.live.len()).sum();
    let counts = replicas[1].admission.counts().await.unwrap();
    assert_eq!(
        counts.active as usize, live,
        "every live operation counted again: {counts:?}"
    );
    assert_eq!(counts.clients["amy"], (6, 3, 2), "{counts:?}");
    assert_eq!(counts.executing, 2, "{counts:?}");
    assert_within_limits(&counts, "after recovery");
    // One operation per key, on every replica: amy's key from r1 replays on r2 and r3 — once
    // their memory of amy's refusals (made while recovering) has ended; until then they refuse.
    let first = replicas[0].store.keys.lock().unwrap()[0].clone();
    for replica in &replicas[1..] {
        assert_eventually("the key replays", async || {
            match replica.admission.admit("amy", true, Some(&first.key)).await {
                Err(AdmitError::Replay { operation, replica }) => {
                    assert_eq!(
                        (operation.as_str(), replica.as_str()),
                        (first.operation.as_str(), "r1")
                    );
                    true
                }
                Err(AdmitError::Refused(_))
                    if replica.admission.stats().refusals_from_memory > 0 =>
                {
                    false
                }
                other => panic!("the key {} made a second operation: {other:?}", first.key),
            }
        })
        .await;
    }
    // The pool: two more may start, not three.
    let mut started = 0;
    for replica in replicas.iter() {
        for handle in &replica.live {
            if handle.state() == unyolo_admission::OperationState::Approved {
                match handle.try_start().await {
                    Ok(()) => started += 1,
                    Err(NotStarted::Saturated(_)) => {}
                    Err(other) => panic!("start: {other}"),
                }
            }
        }
    }
    assert_eq!(started, 2, "the pool of 4 held 2");
    let counts = replicas[0].admission.counts().await.unwrap();
    assert_eq!(counts.executing, 4);
    // Everything drains to zero.
    for replica in replicas.iter_mut() {
        for handle in replica.live.drain(..) {
            let _ = handle.cancel().await;
            let _ = handle.fail().await;
        }
        assert!(replica.admission.flush().await);
    }
    let counts = replicas[2].admission.counts().await.unwrap();
    assert!(counts.is_idle(), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushall_with_live_work_on_three_replicas_exceeds_no_limit_and_restores_every_count() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut replicas = three_replicas(&server).await;
    fill(&mut replicas).await;
    server.flush_all();
    recover_admitting_nothing_over_a_limit(&mut replicas).await;
    assert_everything_back(&mut replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty_with_live_work_exceeds_no_limit_and_restores_every_count()
{
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let mut replicas = three_replicas(&server).await;
    fill(&mut replicas).await;
    server.restart_empty();
    recover_admitting_nothing_over_a_limit(&mut replicas).await;
    assert_everything_back(&mut replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_flush_a_replica_that_never_returns_holds_admissions_back_for_one_lease_only() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // r3 is listed but never runs.
    let mut replicas = Vec::new();
    for name in &REPLICAS[..2] {
        replicas.push(Replica::start(&server, name).await);
    }
    // A new deployment whose listed r3 never comes: the first admission waits one lease.
    let first = &mut replicas[0];
    assert_eventually("the first admission", async || {
        first.submit("amy", true, "before").await.is_ok()
    })
    .await;
    server.flush_all();
    // Both register again; r3 never does: admissions wait, as unavailable, then resume once one
    // lease period has passed.
    let mut recovering = 0;
    assert_eventually("admissions resume without r3", async || {
        match replicas[1].admission.admit("amy", false, None).await {
            Ok(permit) => {
                permit.refund().await;
                true
            }
            Err(AdmitError::Unavailable(u)) => {
                if u.reason == UnavailableReason::Recovering {
                    recovering += 1;
                }
                false
            }
            Err(other) => panic!("{other}"),
        }
    })
    .await;
    assert!(recovering > 0, "the recovery window held admissions back");
    let counts = replicas[0].admission.counts().await.unwrap();
    assert_eq!(
        counts.clients["amy"],
        (1, 1, 0),
        "r1's pending work is counted again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deployment_with_every_replica_listed_admits_once_all_have_registered() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut first = Replica::start(&server, "r1").await;
    // r2 and r3 are listed and not yet there: a Redis with no state may have forgotten them.
    match first.submit("amy", true, "early").await {
        Err(AdmitError::Unavailable(u)) => assert_eq!(u.reason, UnavailableReason::Recovering),
        other => panic!("admitted before the others registered: {other:?}"),
    }
    let mut others = Vec::new();
    for name in &REPLICAS[1..] {
        others.push(Replica::start(&server, name).await);
    }
    // All three registered: the next admission goes through at once, on any of them.
    first.submit("amy", true, "now").await.unwrap();
    others[1].submit("amy", true, "there").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_with_redis_forgetting_at_random_points_never_admit_what_the_engine_refuses()
 {
    use unyolo_admission::{ManualClock, Operation};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut flushes = 0;
    for seed in [3u64, 11, 2026] {
        let mut options = ReplicaOptions::new(server.url(), "model");
        // The whole deployment is this one replica: after a flush, it admits again once it has
        // registered again (without the list it would wait out its 30 s lease).
        options.replicas = vec!["model".to_string()];
        options.prefix = format!("forgets-{seed}");
        options.call_timeout = Duration::from_secs(2);
        options.lease_ttl = Duration::from_secs(30);
        options.heartbeat = Duration::from_secs(10);
        let shared = Admission::new(Controller::new(config()), Some(options)).unwrap();
        let store = Arc::new(MemoryStore::default());
        shared.set_recovery_source(Arc::clone(&store) as Arc<dyn RecoverySource>);
        assert!(shared.restore(Vec::new()).await.deferred.is_none());
        // The in-process engine decides the same sequence on a clock that never moves.
        let local = Controller::builder(config())
            .clock(ManualClock::new())
            .build();
        let mut rng = Rng(seed);
        let mut live: Vec<(Operation, OperationHandle)> = Vec::new();
        for step in 0..300 {
            let context = format!("seed {seed} step {step}");
            match rng.below(9) {
                0..=3 => {
                    let client = ["amy", "bob", "stranger"][rng.below(3)];
                    let approval = rng.below(2) == 0;
                    let expected = local.admit(client, approval);
                    match (expected, shared.admit(client, approval, None).await) {
                        (Ok(permit), Ok(shared_permit)) => {
                            store
                                .admitted
                                .lock()
                                .unwrap()
                                .push((Identity::new(client).unwrap(), Instant::now()));
                            live.push((permit.commit(), shared_permit.commit()));
                        }
                        // The shared engine may refuse more (a restored bucket is never
                        // fuller), never less: the model gives its permit back to stay in step.
                        (Ok(permit), Err(AdmitError::Refused(_))) => permit.refund(),
                        (Err(_), Err(AdmitError::Refused(_))) => {}
                        (Err(expected), Ok(got)) => {
                            panic!(
                                "{context}: admitted {got:?} that the engine refused: {expected:?}"
                            )
                        }
                        (_, Err(other)) => panic!("{context}: {other}"),
                    }
                }
                8 => {
                    // Redis forgets everything; the replica notices and registers again.
                    server.flush_all();
                    flushes += 1;
                    shared.renew().await.expect("the replica registers again");
                }
                action if !live.is_empty() => {
                    let i = rng.below(live.len());
                    let (op, shared_op) = &live[i];
                    match action {
                        4 => assert_eq!(op.approve(), shared_op.approve().await, "{context}"),
                        5 => match (op.try_start(), shared_op.try_start().await) {
                            (Ok(()), Ok(())) => {}
                            (
                                Err(_),
                                Err(NotStarted::Saturated(_) | NotStarted::NotApproved(_)),
                            ) => {}
                            (expected, got) => panic!("{context}: {expected:?} vs {got:?}"),
                        },
                        6 => assert_eq!(op.succeed(), shared_op.succeed().await, "{context}"),
                        _ => assert_eq!(op.cancel(), shared_op.cancel().await, "{context}"),
                    }
                    if op.state().is_terminal() {
                        live.swap_remove(i);
                    }
                }
                _ => {}
            }
            // Whatever Redis forgot, it counts exactly what is live once it has registered again.
            let counts = shared.counts().await.unwrap();
            let snapshot = local.snapshot();
            assert_eq!(
                (counts.active, counts.pending, counts.executing),
                (snapshot.active, snapshot.pending, snapshot.executing),
                "{context}"
            );
        }
        for (op, shared_op) in live.drain(..) {
            let _ = op.fail();
            let _ = shared_op.fail().await;
        }
        assert!(shared.flush().await);
        assert!(shared.counts().await.unwrap().is_idle(), "seed {seed}");
    }
    assert!(flushes > 0, "no sequence made Redis forget");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replica_starts_work_until_every_replica_has_counted_its_executing_work_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // One execution slot in all; r2 beats rarely, so it registers again only when told to.
    let limits = Limits {
        requests_per_window: 1_000,
        window_seconds: 60,
        client_active: 20,
        client_pending: 10,
        global_active: 40,
        global_executing: 1,
    };
    let amy = Identity::new("amy").unwrap();
    let config = Config::new(limits, BTreeMap::new(), [amy]).unwrap();
    let replica = |name: &str, heartbeat: Duration| {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.replicas = vec!["r1".to_string(), "r2".to_string()];
        options.lease_ttl = Duration::from_secs(30);
        options.heartbeat = heartbeat;
        options.call_timeout = Duration::from_secs(2);
        Admission::new(Controller::new(config.clone()), Some(options)).unwrap()
    };
    let r1 = replica("r1", Duration::from_millis(200));
    let r2 = replica("r2", Duration::from_secs(20));
    assert!(r1.restore(Vec::new()).await.deferred.is_none());
    assert!(r2.restore(Vec::new()).await.deferred.is_none());
    // (Admitted before the slot is taken: a full pool refuses new work too.)
    let queued = r1.admit("amy", false, None).await.unwrap().commit();
    let running = r2.admit("amy", false, None).await.unwrap().commit();
    running.try_start().await.unwrap();
    assert!(matches!(
        queued.try_start().await,
        Err(NotStarted::Saturated(_))
    ));

    // Redis forgets. r1 registers again at its next beat; r2, holding the one slot, has not yet.
    server.flush_all();
    assert_eventually("r1 registers again", async || {
        r1.stats().lease_changes >= 2 && r1.renew().await.is_ok()
    })
    .await;
    // In the window the executing count is r1's alone (none): a start would overfill the pool
    // the moment r2 counts its running work again. It waits instead.
    for _ in 0..5 {
        match queued.try_start().await {
            Err(NotStarted::Unavailable(u)) => {
                assert_eq!(u.reason, UnavailableReason::Recovering, "{u}")
            }
            other => panic!("started while the deployment was recounting: {other:?}"),
        }
    }
    r2.renew().await.unwrap();
    let counts = r1.counts().await.unwrap();
    assert_eq!(counts.executing, 1, "r2's running work, and only it");
    assert!(matches!(
        queued.try_start().await,
        Err(NotStarted::Saturated(_))
    ));
    running.succeed().await.unwrap();
    queued.try_start().await.unwrap();
    assert_eq!(r1.counts().await.unwrap().executing, 1);
}

/// A store whose recent admissions are read only after Redis forgot the deployment once more
/// (flushed as they are read, the first time): what the replica restored before is gone.
struct ForgettingStore {
    keys: Vec<KeyRecord>,
    port_url: String,
    armed: std::sync::atomic::AtomicBool,
}

impl RecoverySource for ForgettingStore {
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>> {
        let keys = self.keys.clone();
        Box::pin(async move { Ok(keys) })
    }

    fn recent_admissions(&self, _: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>> {
        Box::pin(async move {
            if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let client = redis::Client::open(self.port_url.as_str()).unwrap();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
            }
            Ok(Vec::new())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_after_which_redis_forgets_again_restores_the_key_records_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let options = |name: &str| {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.replicas = vec!["r1".to_string(), "r2".to_string()];
        options.call_timeout = Duration::from_secs(2);
        options
    };
    let r2 = Admission::new(Controller::new(config()), Some(options("r2"))).unwrap();
    assert!(r2.restore(Vec::new()).await.deferred.is_none());
    // r1 starts with a store that holds amy's operation under key "kept" (retained, not live):
    // its key record goes back to Redis, and then Redis forgets everything once more before r1
    // has registered.
    let r1 = Admission::new(Controller::new(config()), Some(options("r1"))).unwrap();
    let kept = "op_0123456789abcdef0123456789abcdef";
    r1.set_recovery_source(Arc::new(ForgettingStore {
        keys: vec![KeyRecord {
            client: Identity::new("amy").unwrap(),
            key: "kept".to_string(),
            operation: kept.to_string(),
        }],
        port_url: server.url(),
        armed: std::sync::atomic::AtomicBool::new(true),
    }));
    assert!(r1.restore(Vec::new()).await.deferred.is_none());
    // r2 registers again after the loss (its store holds nothing).
    r2.renew().await.unwrap();
    // The key still names r1's operation: not new work on r2.
    assert_eventually("the deployment admits again", async || {
        !matches!(
            r2.admit("amy", false, Some("other")).await,
            Err(AdmitError::Unavailable(_))
        )
    })
    .await;
    match r2.admit("amy", false, Some("kept")).await {
        Err(AdmitError::Replay { operation, replica }) => {
            assert_eq!((operation.as_str(), replica.as_str()), (kept, "r1"));
        }
        other => panic!("the key of r1's stored operation was lost: {other:?}"),
    }
}

/// A permit admitted, and not yet committed, when Redis forgets has no row in its replica's
/// store yet: its key record and its rate token come back from the replica itself, so another
/// replica answers the key as a replay (not new work) and the token stays spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_not_yet_committed_when_redis_forgets_keeps_its_key_and_its_token() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut r1 = Replica::start(&server, "r1").await;
    let r2 = Replica::start(&server, "r2").await;
    let _r3 = Replica::start(&server, "r3").await;
    // bob: four of his five tokens spent and committed, the fifth admitted under "in-flight"
    // but not yet in r1's store.
    for n in 0..4 {
        r1.submit("bob", false, &format!("bob-{n}")).await.unwrap();
    }
    let permit = r1
        .admission
        .admit("bob", false, Some("in-flight"))
        .await
        .expect("bob's fifth token");
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    for replica in [&r1, &r2, &_r3] {
        replica.admission.renew().await.unwrap();
    }
    assert_eventually("the deployment admits again", async || {
        !matches!(
            r2.admission.admit("amy", false, None).await,
            Err(AdmitError::Unavailable(_))
        )
    })
    .await;
    // Now the row is written and the permit committed, as the broker does after the store.
    let id = permit.id().to_string();
    r1.store.keys.lock().unwrap().push(KeyRecord {
        client: Identity::new("bob").unwrap(),
        key: "in-flight".to_string(),
        operation: id.clone(),
    });
    let _op = permit.commit();
    match r2.admission.admit("bob", false, Some("in-flight")).await {
        Err(AdmitError::Replay { operation, replica }) => {
            assert_eq!((operation.as_str(), replica.as_str()), (id.as_str(), "r1"));
        }
        other => panic!("the key of r1's uncommitted permit was lost: {other:?}"),
    }
    // And bob has no token left: five were spent, whatever Redis forgot.
    match r2.admission.admit("bob", false, Some("sixth")).await {
        Err(AdmitError::Refused(refused)) => {
            assert_eq!(refused.refusal.code, RefusalCode::SubmissionRateLimited);
        }
        other => panic!("bob got a sixth token: {other:?}"),
    }
}

/// `admission_redis_recovering` (the stats' `recovering`) is 1 while the replicas register again
/// after Redis forgot and 0 again once they all have: it was set by the registration and
/// cleared by nothing, so the first replica back reported a recovery for as long as it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recovering_flag_is_cleared_once_every_replica_has_registered_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = three_replicas(&server).await;
    // A new deployment listing its replicas waits for all of them too: the first two registered
    // while it did, and their next renewal sees it over.
    for replica in &replicas {
        replica.admission.renew().await.unwrap();
        assert!(!replica.admission.stats().recovering);
    }
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    replicas[0].admission.renew().await.unwrap();
    assert!(
        replicas[0].admission.stats().recovering,
        "the first back waits for the others"
    );
    for replica in &replicas[1..] {
        replica.admission.renew().await.unwrap();
    }
    // The next renewal of each sees the window closed.
    for replica in &replicas {
        replica.admission.renew().await.unwrap();
        assert!(!replica.admission.stats().recovering);
    }
}

/// A replica reaped (it stopped; its lease lapsed) is forgotten by the others once Redis no
/// longer lists it, so a later recovery with a replica list waits only for the replicas still
/// there... and without a list, for nobody it heard of either: a recovery then lasts its whole
/// lease period, since a replica started a moment before Redis forgot may be unknown to all.
/// (Before, a replica without a list admitted as soon as the replicas it had heard of were back:
/// two replicas, no list, a flush a second after the second started, and the first admitted at
/// once, before the second's holdings were counted again: 6 pending against a limit of 3.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replica_list_a_recovery_lasts_its_whole_lease_period() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // No --replicas list: who the deployment is, each replica only hears from Redis.
    let start = async |name: &str, lease: Duration| {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.lease_ttl = lease;
        options.heartbeat = Duration::from_millis(200);
        options.call_timeout = Duration::from_secs(2);
        let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        admission
    };
    let lease = Duration::from_secs(4);
    let r1 = start("r1", lease).await;
    let r2 = start("r2", lease).await;
    for r in [&r1, &r2] {
        r.renew().await.unwrap();
    }
    server.flush_all();
    let flushed = Instant::now();
    for r in [&r1, &r2] {
        assert_eventually("registered again", async || r.renew().await.is_ok()).await;
    }
    // Both are back, yet neither admits: a third replica nobody heard of may hold work whose
    // counts are not back. Only one lease period after the flush does admission resume.
    match r2.admit("amy", false, None).await {
        Err(AdmitError::Unavailable(u)) => {
            assert!(u.to_string().contains("registering again"), "{u}");
        }
        Err(other) => panic!("refused otherwise: {other}"),
        Ok(permit) => {
            assert!(
                flushed.elapsed() >= lease,
                "admitted {:?} after the flush, within the lease period",
                flushed.elapsed()
            );
            permit.refund().await;
        }
    }
    assert_eventually("admitted after the lease period", async || {
        match r2.admit("amy", false, None).await {
            Ok(permit) => {
                permit.refund().await;
                true
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(
        flushed.elapsed() >= lease - Duration::from_millis(500),
        "the window closed after {:?}, before its lease period",
        flushed.elapsed()
    );
}

/// A replica whose store lost rows (a restore from an older backup, say) unbinds, when it
/// starts, every key Redis still binds to one of its operations that its store does not hold:
/// such a key is new work on every replica, not `Replay` naming an operation nothing answers for.
/// (Before, an embedder got `Replay` naming its own replica for that key, forever.) A key whose
/// operation the store does hold stays bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarting_with_rows_lost_unbinds_the_keys_its_store_does_not_hold() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let start = async |name: &str, store: Arc<MemoryStore>| {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
        options.call_timeout = Duration::from_secs(2);
        let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
        admission.set_recovery_source(store as Arc<dyn RecoverySource>);
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        admission
    };
    let r2 = start("r2", Arc::default()).await;
    let first_store = Arc::new(MemoryStore::default());
    let r1 = start("r1", Arc::clone(&first_store)).await;
    let amy = Identity::new("amy").unwrap();
    let mut kept_ids = Vec::new();
    for key in ["lost", "kept"] {
        let permit = r1.admit("amy", false, Some(key)).await.expect("admitted");
        kept_ids.push(permit.id().to_string());
        first_store.keys.lock().unwrap().push(KeyRecord {
            client: amy.clone(),
            key: key.to_owned(),
            operation: permit.id().to_string(),
        });
        let op = permit.commit();
        op.start().await.unwrap();
        op.succeed().await.unwrap();
    }
    let admitted = r2.admit("amy", false, Some("lost")).await;
    assert!(
        matches!(&admitted, Err(AdmitError::Replay { replica, .. }) if replica == "r1"),
        "bound to r1 before its restart: {admitted:?}"
    );
    r1.shutdown().await;
    drop(r1);

    // r1 comes back with a store that kept only "kept".
    let second_store = Arc::new(MemoryStore::default());
    second_store.keys.lock().unwrap().push(KeyRecord {
        client: amy.clone(),
        key: "kept".to_owned(),
        operation: kept_ids[1].clone(),
    });
    let r1 = start("r1", second_store).await;
    let fresh = r2
        .admit("amy", false, Some("lost"))
        .await
        .expect("a key whose operation no store holds is new work");
    fresh.refund().await;
    let kept = r2.admit("amy", false, Some("kept")).await;
    assert!(
        matches!(&kept, Err(AdmitError::Replay { operation, replica }) if replica == "r1" && *operation == kept_ids[1]),
        "a key whose operation the store holds stays bound: {kept:?}"
    );
    r1.shutdown().await;
    r2.shutdown().await;
}

/// A replica paused past its lease while its request was decided and run on another replica
/// (its store says it no longer owns that row) registers again with only the work whose rows it
/// still owns: the request that ended elsewhere is not counted under its name, and ending its
/// handle afterwards (as the broker does once it reads the row) releases nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_counts_only_the_work_whose_rows_this_replica_still_owns() {
    let Some(server) = RedisServer::start() else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    let mut replicas = three_replicas(&server).await;
    let r1 = &mut replicas[0];
    let kept = r1.submit("amy", true, "kept").await.unwrap();
    let ended = r1.submit("amy", true, "ended-elsewhere").await.unwrap();
    let (kept_id, ended_id) = (
        r1.live[kept].id().to_string(),
        r1.live[ended].id().to_string(),
    );
    *r1.store.owned.lock().unwrap() = Some(vec![(kept_id.clone(), OperationState::Pending)]);
    // A permit admitted and not yet committed has no row yet: it is counted whatever the store says.
    let uncommitted = r1
        .admission
        .admit("amy", false, Some("in-flight"))
        .await
        .unwrap();
    let uncommitted_id = uncommitted.id().to_string();

    r1.admission.recount_shared().await.unwrap();
    let holdings = r1.admission.shared_holdings().await.unwrap().unwrap();
    let held: Vec<&String> = holdings.keys().collect();
    let mut expected = vec![&kept_id, &uncommitted_id];
    expected.sort();
    assert_eq!(
        held, expected,
        "only the owned row and the uncommitted permit"
    );
    assert!(!holdings.contains_key(&ended_id));
    let counts = r1.admission.counts().await.unwrap();
    assert_eq!(counts.clients.get("amy"), Some(&(2, 1, 0)), "{counts:?}");

    // The broker reads the ended row and ends its handle: nothing more is released.
    r1.live[ended].fail().await.unwrap();
    let counts = r1.admission.counts().await.unwrap();
    assert_eq!(counts.clients.get("amy"), Some(&(2, 1, 0)), "{counts:?}");
    uncommitted.refund().await;
    r1.live[kept].cancel().await.unwrap();
    assert_eventually("the deployment is idle", async || {
        r1.admission.counts().await.unwrap().is_idle()
    })
    .await;
}
