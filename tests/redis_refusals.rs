//! Refusals answered from memory and the bounded Redis calls of a replica (SPEC section 7,
//! "Refusals cost the shared engine nothing after the first"; issue 21), on a real
//! `redis-server`: a refusal flood on three replicas costs Redis one script call per replica
//! while another client is admitted throughout; a release (or a refund) on one replica ends the
//! memory on the others long before the hint would; what a refusal covers is what it answers;
//! Retry-After counts down; a lost subscription forgets everything; a replica's decisions in
//! flight are bounded in all and per client, and releases never wait for that bound. Last, a
//! model: random sequences on three replicas with the memory on never admit what the
//! in-process engine refuses, and the counts stay exact.

mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use support::eventually::assert_eventually;
use support::redis::{self as redis_support, RedisServer};
use unyolo_admission::admission::{
    Admission, AdmitError, BackendStats, NotStarted, OperationHandle, ReplicaOptions,
    UnavailableReason,
};
use unyolo_admission::config::{ClientLimits, Limits};
use unyolo_admission::{Config, Controller, Identity, ManualClock, Operation, RefusalCode};

/// The capacity hint of these tests: an hour, so a refusal that ends before it was ended by a
/// notice, never by its hint.
const HINT: Duration = Duration::from_secs(3600);

/// amy: one live operation at most; bob: plenty; cat: one pending at most, five live; dan: one
/// token an hour; eve: two tokens a minute and one pending at most.
fn config() -> Config {
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 60,
        client_active: 100,
        client_pending: 100,
        global_active: 1000,
        global_executing: 100,
    };
    let client = |requests_per_window, window_seconds, active, pending| ClientLimits {
        requests_per_window,
        window_seconds,
        active,
        pending,
    };
    let mut overrides = BTreeMap::new();
    let id = |n: &str| Identity::new(n).unwrap();
    overrides.insert(id("amy"), client(100_000, 60, 1, 1));
    overrides.insert(id("cat"), client(100_000, 60, 5, 1));
    overrides.insert(id("dan"), client(1, 3600, 5, 5));
    overrides.insert(id("eve"), client(2, 60, 5, 1));
    Config::new(
        limits,
        overrides,
        ["amy", "bob", "cat", "dan", "eve"].map(id),
    )
    .unwrap()
}

/// Options for replica `name` under `prefix`, one of `fleet` (every replica of that deployment,
/// itself included, so the replicas admit as soon as all have registered at its first start):
/// no heartbeat during a test (its scripts would be counted with the decisions'), generous calls
/// for a noisy machine.
fn options(server: &RedisServer, prefix: &str, name: &str, fleet: &[&str]) -> ReplicaOptions {
    let mut options = ReplicaOptions::new(server.url(), name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.prefix = prefix.to_owned();
    options.lease_ttl = Duration::from_secs(600);
    options.heartbeat = Duration::from_secs(300);
    options.call_timeout = Duration::from_secs(2);
    options.decision_wait = Duration::from_secs(5);
    options
}

/// A registered replica whose notice subscription is live (the memory answers from then on).
async fn replica_with(config: Config, options: ReplicaOptions) -> Admission {
    let controller = Controller::builder(config).capacity_retry(HINT).build();
    let admission = Admission::new(controller, Some(options)).unwrap();
    assert!(admission.restore(Vec::new()).await.deferred.is_none());
    assert_eventually("the notice subscription is live", async || {
        admission.stats().notices_live
    })
    .await;
    admission
}

/// `n` registered replicas under `prefix`, `r0`, `r1`, ...: the whole deployment.
async fn replicas(server: &RedisServer, prefix: &str, n: usize) -> Vec<Admission> {
    let names: Vec<String> = (0..n).map(|r| format!("r{r}")).collect();
    let fleet: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut all = Vec::new();
    for name in &fleet {
        all.push(replica_with(config(), options(server, prefix, name, &fleet)).await);
    }
    all
}

fn code(result: &Result<unyolo_admission::AdmissionPermit, AdmitError>) -> Option<RefusalCode> {
    match result {
        Err(AdmitError::Refused(refused)) => Some(refused.refusal.code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_flood_on_three_replicas_costs_redis_one_call_per_replica_while_others_are_admitted()
 {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = replicas(&server, "flood", 3).await;
    // amy holds her one operation (on r0): every replica refuses her from now on.
    let held = replicas[0]
        .admit("amy", false, Some("held"))
        .await
        .unwrap()
        .commit();
    redis_support::warm(&replicas[1], "bob").await;
    let before = redis_support::script_calls(server.port);
    // The flood: 4 tasks per replica, 50 submissions each, with and without approval, each
    // with its own key; bob submits and finishes work on every replica meanwhile.
    let mut tasks = Vec::new();
    for (r, admission) in replicas.iter().enumerate() {
        for t in 0..4 {
            let admission = admission.clone();
            tasks.push(tokio::spawn(async move {
                let mut refused = 0;
                for n in 0..50 {
                    let key = format!("flood-{r}-{t}-{n}");
                    let result = admission.admit("amy", n % 2 == 0, Some(&key)).await;
                    assert_eq!(
                        code(&result),
                        Some(RefusalCode::ClientOperationLimit),
                        "{result:?}"
                    );
                    refused += 1;
                }
                refused
            }));
        }
    }
    let mut bob_admitted = 0u64;
    for round in 0..10 {
        for admission in &replicas {
            let permit = admission
                .admit(
                    "bob",
                    round % 2 == 0,
                    Some(&format!("bob-{round}-{bob_admitted}")),
                )
                .await
                .expect("bob is admitted throughout the flood");
            permit.commit().fail().await.unwrap();
            bob_admitted += 1;
        }
    }
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    let calls = redis_support::script_calls(server.port) - before;
    assert_eq!(refused, 600);
    // amy: one call per replica (its refusal); bob: his admissions and their releases.
    assert!(
        calls <= 3 + 2 * bob_admitted,
        "{calls} script calls for {refused} refusals and {bob_admitted} of bob's admissions"
    );
    let from_memory: u64 = replicas
        .iter()
        .map(|r| r.stats().refusals_from_memory)
        .sum();
    assert!(from_memory >= 600 - 3, "{from_memory} answered from memory");

    // A release on r0 ends amy's memory on r1 and r2 at once, an hour before its hint: her
    // next submission there is decided by Redis and admitted.
    held.fail().await.unwrap();
    let r1 = &replicas[1];
    let mut admitted = None;
    assert_eventually(
        "amy is admitted on r1 after her release on r0",
        async || match r1.admit("amy", false, None).await {
            Ok(permit) => {
                admitted = Some(permit.commit());
                true
            }
            Err(AdmitError::Refused(_)) => false,
            Err(other) => panic!("{other}"),
        },
    )
    .await;
    let forgotten = r1.stats().refusals_forgotten;
    assert!(forgotten[2] >= 1, "forgotten by a release: {forgotten:?}");
    admitted.unwrap().fail().await.unwrap();
    for admission in &replicas {
        assert!(admission.flush().await);
    }
    assert!(replicas[2].counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_limit_refusal_answers_work_that_needs_approval_and_not_work_that_does_not() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = replicas(&server, "pending", 1).await;
    let r0 = &replicas[0];
    let pending = r0.admit("cat", true, None).await.unwrap().commit();
    let first = r0.admit("cat", true, None).await;
    assert_eq!(code(&first), Some(RefusalCode::ClientPendingLimit));
    let calls = redis_support::script_calls(server.port);
    let again = r0.admit("cat", true, None).await;
    assert_eq!(code(&again), Some(RefusalCode::ClientPendingLimit));
    assert_eq!(
        redis_support::script_calls(server.port),
        calls,
        "answered from memory"
    );
    assert_eq!(r0.stats().refusals_from_memory, 1);
    // Work that needs no approval meets no pending limit: Redis decides it, and admits it.
    let approved = r0.admit("cat", false, None).await.unwrap().commit();
    assert_eq!(redis_support::script_calls(server.port), calls + 1);
    // Approving the pending one lowers cat's pending count: the memory forgets at once.
    pending.approve().await.unwrap();
    let third = r0.admit("cat", true, None).await.unwrap().commit();
    for operation in [pending, approved, third] {
        operation.fail().await.unwrap();
    }
    assert!(r0.flush().await);
    assert!(r0.counts().await.unwrap().is_idle());
}

/// `PUBLISH` calls Redis has run (`INFO commandstats`).
/// A remembered refusal is forgotten when this replica admits the client: Redis's next answer
/// may differ. Here a remembered `client_pending_limit` (it answers only work that needs
/// approval) is followed by an admission that needs none and spends eve's last token; her next
/// submission needing approval is then refused as Redis and the in-process engine refuse it, for
/// the rate, with the wait to the next token. Before, the memory answered the stale
/// `client_pending_limit` with a 1 s Retry-After, ~30 s early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_here_forgets_the_clients_remembered_refusals() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let r0 = replica_with(config(), options(&server, "admitted", "r0", &["r0"])).await;
    let engine = Controller::builder(config()).capacity_retry(HINT).build();
    let _pending = r0.admit("eve", true, None).await.unwrap().commit();
    let _pending_here = engine.admit("eve", true).unwrap().commit();
    let second = r0.admit("eve", true, None).await;
    assert_eq!(code(&second), Some(RefusalCode::ClientPendingLimit));
    assert_eq!(
        engine.admit("eve", true).err().map(|r| r.code),
        Some(RefusalCode::ClientPendingLimit)
    );
    // Work that needs no approval is not covered by that refusal: admitted, the last token.
    let _run = r0.admit("eve", false, None).await.unwrap().commit();
    let _run_here = engine.admit("eve", false).unwrap().commit();
    let before = r0.stats();
    let expected = engine.admit("eve", true).unwrap_err();
    assert_eq!(expected.code, RefusalCode::SubmissionRateLimited);
    let Err(AdmitError::Refused(refused)) = r0.admit("eve", true, None).await else {
        panic!("eve's third submission within the minute was not refused");
    };
    assert_eq!(refused.refusal.code, RefusalCode::SubmissionRateLimited);
    // The wait to her next token: tens of seconds, as the engine says (not a capacity hint).
    let (got, want) = (refused.refusal.retry_after, expected.retry_after);
    assert!(
        got.abs_diff(want) <= Duration::from_secs(2),
        "Retry-After {got:?}, the engine's {want:?}"
    );
    let after = r0.stats();
    assert_eq!(
        after.refusals_from_memory, before.refusals_from_memory,
        "answered from a stale memory"
    );
    let admitted = BackendStats::FORGOTTEN_REASONS
        .iter()
        .position(|r| *r == "admitted")
        .unwrap();
    assert_eq!(after.refusals_forgotten[admitted], 1, "{after:?}");
}

fn publishes(port: u16) -> u64 {
    redis_support::cli(port, &["INFO", "commandstats"])
        .lines()
        .find_map(|line| {
            line.strip_prefix("cmdstat_publish:")?
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_joining_with_nothing_held_ends_no_remembered_refusal() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // The first registration opens the deployment's epoch on a Redis that held none: what Redis
    // forgot may have changed any refusal, so it is published.
    // The deployment is r0 alone until r1 joins it.
    let r0 = replica_with(config(), options(&server, "join", "r0", &["r0"])).await;
    assert_eq!(publishes(server.port), 1, "the new epoch is published");
    let pending = r0.admit("cat", true, None).await.unwrap().commit();
    assert_eq!(
        code(&r0.admit("cat", true, None).await),
        Some(RefusalCode::ClientPendingLimit)
    );
    // A second replica joins with nothing held before and nothing restored: it lowers no count,
    // so nothing is published, and r0 still answers cat from memory.
    let r1 = replica_with(config(), options(&server, "join", "r1", &["r0", "r1"])).await;
    assert_eq!(
        publishes(server.port),
        1,
        "a join that lowers nothing is not published"
    );
    let calls = redis_support::script_calls(server.port);
    assert_eq!(
        code(&r0.admit("cat", true, None).await),
        Some(RefusalCode::ClientPendingLimit)
    );
    assert_eq!(
        redis_support::script_calls(server.port),
        calls,
        "answered from memory"
    );
    assert_eq!(r0.stats().refusals_from_memory, 1);
    // Released, cat's pending slot is free on every replica.
    pending.fail().await.unwrap();
    let again = r1.admit("cat", true, None).await.unwrap().commit();
    again.fail().await.unwrap();
    for admission in [&r0, &r1] {
        assert!(admission.flush().await);
    }
    assert!(r0.counts().await.unwrap().is_idle());
}

/// The refusal marker's value and lifetime (ms) under `prefix`, if it exists.
fn marker(port: u16, prefix: &str) -> Option<(String, i64)> {
    let key = format!("{{{prefix}}}:refused");
    let value = redis_support::cli(port, &["GET", &key]);
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    let ttl = redis_support::cli(port, &["PTTL", &key])
        .trim()
        .parse()
        .unwrap();
    Some((value.to_owned(), ttl))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_are_published_only_while_some_replica_may_remember_a_refusal() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = replicas(&server, "quiet", 2).await;
    let (r0, r1) = (&replicas[0], &replicas[1]);
    let registered = publishes(server.port);
    // No refusal yet: releases, approvals and refunds end nothing any replica remembers, so
    // none is published.
    for admission in [r0, r1] {
        let a = admission.admit("bob", true, None).await.unwrap().commit();
        a.approve().await.unwrap();
        a.fail().await.unwrap();
        let b = admission.admit("bob", false, None).await.unwrap();
        drop(b);
        assert!(admission.flush().await);
    }
    assert_eq!(
        publishes(server.port),
        registered,
        "nothing to end: nothing published"
    );
    assert_eq!(marker(server.port, "quiet"), None);
    // A refusal r1 may remember sets the marker for longer than the memory can last (the hint,
    // an hour here)...
    let held = r1.admit("amy", false, None).await.unwrap().commit();
    assert_eq!(
        code(&r1.admit("amy", false, None).await),
        Some(RefusalCode::ClientOperationLimit)
    );
    let (_, ttl) = marker(server.port, "quiet").expect("a refusal sets the marker");
    assert!(ttl > HINT.as_millis() as i64, "{ttl} ms");
    // ...so from then on every release is published: one on r0 for another client...
    let other = r0.admit("bob", false, None).await.unwrap().commit();
    other.fail().await.unwrap();
    assert_eq!(publishes(server.port), registered + 1);
    // ...and amy's own, which ends r1's memory of her refusal at once.
    held.fail().await.unwrap();
    assert_eq!(publishes(server.port), registered + 2);
    let calls = redis_support::script_calls(server.port);
    let again = r1.admit("amy", false, None).await.unwrap().commit();
    assert!(
        redis_support::script_calls(server.port) > calls,
        "decided by Redis, not the memory"
    );
    again.fail().await.unwrap();
    // A refusal with a shorter reach never shortens the marker: dan's rate refusal (a wait of
    // under an hour, plus the slack) leaves it as it was.
    let (before, _) = marker(server.port, "quiet").unwrap();
    let token = r0.admit("dan", false, None).await.unwrap().commit();
    assert_eq!(
        code(&r0.admit("dan", false, None).await),
        Some(RefusalCode::SubmissionRateLimited)
    );
    let (after, _) = marker(server.port, "quiet").unwrap();
    assert!(
        after.parse::<u64>().unwrap() >= before.parse::<u64>().unwrap(),
        "{before} -> {after}"
    );
    token.fail().await.unwrap();
    for admission in [r0, r1] {
        assert!(admission.flush().await);
    }
    assert!(r0.counts().await.unwrap().is_idle());

    // A replica that remembers no refusal sets no marker: its releases stay unpublished.
    let mut forgetful = options(&server, "off", "r0", &["r0"]);
    forgetful.refusal_memory = false;
    let controller = Controller::builder(config()).capacity_retry(HINT).build();
    let off = Admission::new(controller, Some(forgetful)).unwrap();
    assert!(off.restore(Vec::new()).await.deferred.is_none());
    let start = publishes(server.port);
    let held = off.admit("amy", false, None).await.unwrap().commit();
    assert_eq!(
        code(&off.admit("amy", false, None).await),
        Some(RefusalCode::ClientOperationLimit)
    );
    held.fail().await.unwrap();
    assert!(off.flush().await);
    assert_eq!(marker(server.port, "off"), None);
    assert_eq!(publishes(server.port), start);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_rate_refusal_counts_its_retry_after_down_and_a_refund_anywhere_ends_it() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = replicas(&server, "rate", 2).await;
    // dan's one token, taken on r0; r1 is refused for the rate (about an hour to wait).
    let permit = replicas[0].admit("dan", false, None).await.unwrap();
    let first = match replicas[1].admit("dan", true, None).await {
        Err(AdmitError::Refused(refused)) => refused,
        other => panic!("{other:?}"),
    };
    assert_eq!(first.refusal.code, RefusalCode::SubmissionRateLimited);
    let calls = redis_support::script_calls(server.port);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // From memory, for both kinds of work: the same code, the wait counted down (never a
    // fresh full one), the quota's next token as near.
    for approval in [false, true] {
        let again = match replicas[1].admit("dan", approval, None).await {
            Err(AdmitError::Refused(refused)) => refused,
            other => panic!("{other:?}"),
        };
        assert_eq!(again.refusal.code, RefusalCode::SubmissionRateLimited);
        assert!(
            again.refusal.retry_after < first.refusal.retry_after,
            "{:?} then {:?}",
            first.refusal.retry_after,
            again.refusal.retry_after
        );
        let (before, now) = (first.quota.unwrap().rate, again.quota.unwrap().rate);
        assert!(now.next_token_nanos < before.next_token_nanos);
        assert_eq!(now.remaining, 0);
    }
    assert_eq!(redis_support::script_calls(server.port), calls);
    // The refund on r0 gives the token back: r1 admits dan (decided by Redis) long before the
    // hour is up.
    permit.refund().await;
    let mut admitted = None;
    assert_eventually(
        "dan is admitted on r1 after the refund on r0",
        async || match replicas[1].admit("dan", false, None).await {
            Ok(permit) => {
                admitted = Some(permit);
                true
            }
            Err(AdmitError::Refused(_)) => false,
            Err(other) => panic!("{other}"),
        },
    )
    .await;
    assert!(
        replicas[1].stats().refusals_forgotten[1] >= 1,
        "by a refund"
    );
    admitted.unwrap().refund().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_notice_subscription_forgets_every_remembered_refusal() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let replicas = replicas(&server, "lost", 1).await;
    let r0 = &replicas[0];
    let held = r0.admit("amy", false, None).await.unwrap().commit();
    assert!(code(&r0.admit("amy", false, None).await).is_some());
    assert!(code(&r0.admit("amy", false, None).await).is_some());
    assert_eq!(r0.stats().refusals_from_memory, 1);
    redis_support::kill_subscribers(server.port);
    assert_eventually("the loss is noticed", async || {
        r0.stats().refusals_forgotten[5] >= 1
    })
    .await;
    assert_eventually("the subscription is made again", async || {
        r0.stats().notices_live
    })
    .await;
    // Forgotten: the next refusal is Redis's again (one call), then remembered again.
    let calls = redis_support::script_calls(server.port);
    assert!(code(&r0.admit("amy", false, None).await).is_some());
    assert_eq!(redis_support::script_calls(server.port), calls + 1);
    assert!(code(&r0.admit("amy", false, None).await).is_some());
    assert_eq!(redis_support::script_calls(server.port), calls + 1);
    held.fail().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_decisions_in_flight_a_submission_is_unavailable_and_releases_never_wait() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut options = options(&server, "busy", "r0", &["r0"]);
    options.decisions_in_flight = 2;
    options.client_decisions_in_flight = 1;
    options.decision_wait = Duration::from_millis(100);
    options.call_timeout = Duration::from_secs(3);
    let r0 = replica_with(config(), options).await;
    let live = r0.admit("bob", false, None).await.unwrap().commit();
    // Redis stops answering: amy's and bob's decisions hang in flight. Each is polled once, so
    // it holds its room and waits on Redis.
    server.pause();
    let mut amy = Box::pin(r0.admit("amy", false, None));
    let mut bob = Box::pin(r0.admit("bob", false, None));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(amy.as_mut().poll(&mut cx).is_pending());
    assert!(bob.as_mut().poll(&mut cx).is_pending());
    // amy's second is past her own share; cat's is past the replica's.
    for client in ["amy", "cat"] {
        match r0.admit(client, false, None).await {
            Err(AdmitError::Unavailable(u)) => assert_eq!(u.reason, UnavailableReason::Busy),
            other => panic!("{client}: {other:?}"),
        }
    }
    assert!(r0.stats().busy >= 2);
    // A release does not wait for room: kept at once (Redis does not answer), sent later.
    live.cancel().await.unwrap();
    server.resume();
    let _ = amy.await;
    let _ = bob.await;
    assert!(r0.flush().await);
    assert_eventually("everything drains", async || {
        r0.counts().await.is_ok_and(|c| c.is_idle())
    })
    .await;
}

/// One step of the model: an admission (on a replica, by a client, with or without approval),
/// an admission refunded at once, or a transition of a live operation.
#[derive(Clone, Debug)]
enum Step {
    Admit(usize, usize, bool),
    AdmitRefund(usize, usize),
    Approve(usize),
    Start(usize),
    Succeed(usize),
    Cancel(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..3usize, 0..4usize, any::<bool>()).prop_map(|(r, c, a)| Step::Admit(r, c, a)),
        1 => (0..3usize, 0..4usize).prop_map(|(r, c)| Step::AdmitRefund(r, c)),
        1 => any::<usize>().prop_map(Step::Approve),
        1 => any::<usize>().prop_map(Step::Start),
        1 => any::<usize>().prop_map(Step::Succeed),
        2 => any::<usize>().prop_map(Step::Cancel),
    ]
}

/// Small limits so every refusal comes up: amy 2 live (1 pending), bob 3 live, cat 2 pending,
/// dan 3 tokens an hour; 6 live and 2 executing in all.
fn model_config() -> Config {
    let limits = Limits {
        requests_per_window: 10_000,
        window_seconds: 3600,
        client_active: 3,
        client_pending: 2,
        global_active: 6,
        global_executing: 2,
    };
    let mut overrides = BTreeMap::new();
    let id = |n: &str| Identity::new(n).unwrap();
    overrides.insert(
        id("amy"),
        ClientLimits {
            requests_per_window: 10_000,
            window_seconds: 3600,
            active: 2,
            pending: 1,
        },
    );
    overrides.insert(
        id("dan"),
        ClientLimits {
            requests_per_window: 3,
            window_seconds: 3600,
            active: 3,
            pending: 2,
        },
    );
    Config::new(limits, overrides, ["amy", "bob", "cat", "dan"].map(id)).unwrap()
}

const CLIENTS: [&str; 4] = ["amy", "bob", "cat", "dan"];

/// Runs `steps` on three replicas (memory on) and on the in-process engine side by side: no
/// replica admits what the engine refuses; where a replica refuses what the engine admits (a
/// release not yet heard), the engine gives its permit back to stay in step; after every step
/// the deployment's counts are the engine's.
async fn model(server: &RedisServer, prefix: &str, steps: &[Step]) -> u64 {
    let mut replicas = Vec::new();
    let fleet = ["m0", "m1", "m2"];
    for name in fleet {
        let mut options = options(server, prefix, name, &fleet);
        options.call_timeout = Duration::from_secs(3);
        replicas.push(replica_with(model_config(), options).await);
    }
    let engine = Controller::builder(model_config())
        .clock(ManualClock::new())
        .capacity_retry(HINT)
        .build();
    let mut live: Vec<(Operation, OperationHandle)> = Vec::new();
    for (n, step) in steps.iter().enumerate() {
        let context = format!("step {n}: {step:?}");
        let admission = match *step {
            Step::Admit(r, c, approval) => Some((r, c, approval, false)),
            Step::AdmitRefund(r, c) => Some((r, c, false, true)),
            _ => None,
        };
        match *step {
            _ if admission.is_some() => {
                let (r, c, approval, refund) = admission.unwrap();
                let client = CLIENTS[c];
                let expected = engine.admit(client, approval);
                match (expected, replicas[r].admit(client, approval, None).await) {
                    (Ok(local), Ok(shared)) => {
                        if refund {
                            local.refund();
                            shared.refund().await;
                        } else {
                            live.push((local.commit(), shared.commit()));
                        }
                    }
                    (Ok(local), Err(AdmitError::Refused(_))) => local.refund(),
                    (Err(_), Err(AdmitError::Refused(_))) => {}
                    (Err(expected), Ok(got)) => {
                        panic!("{context}: admitted {got:?} that the engine refused: {expected:?}")
                    }
                    (_, Err(other)) => panic!("{context}: {other}"),
                }
            }
            _ if live.is_empty() => {}
            Step::Approve(i) => {
                let (op, shared) = &live[i % live.len()];
                assert_eq!(op.approve(), shared.approve().await, "{context}");
            }
            Step::Start(i) => {
                let (op, shared) = &live[i % live.len()];
                match (op.try_start(), shared.try_start().await) {
                    (Ok(()), Ok(())) => {}
                    (Err(_), Err(NotStarted::Saturated(_) | NotStarted::NotApproved(_))) => {}
                    (expected, got) => panic!("{context}: {expected:?} vs {got:?}"),
                }
            }
            Step::Succeed(i) => {
                let (op, shared) = &live[i % live.len()];
                assert_eq!(op.succeed(), shared.succeed().await, "{context}");
            }
            Step::Cancel(i) => {
                let (op, shared) = &live[i % live.len()];
                assert_eq!(op.cancel(), shared.cancel().await, "{context}");
            }
            _ => {}
        }
        live.retain(|(op, _)| !op.state().is_terminal());
        let counts = replicas[n % 3].counts().await.unwrap();
        let snapshot = engine.snapshot();
        assert_eq!(
            (counts.active, counts.pending, counts.executing),
            (snapshot.active, snapshot.pending, snapshot.executing),
            "{context}"
        );
    }
    for (op, shared) in live.drain(..) {
        let _ = op.fail();
        let _ = shared.fail().await;
    }
    let mut answered = 0;
    for admission in &replicas {
        assert!(admission.flush().await);
        answered += admission.stats().refusals_from_memory;
        admission.shutdown().await;
    }
    assert!(replicas[0].counts().await.unwrap().is_idle());
    answered
}

#[test]
fn random_sequences_on_three_replicas_with_the_memory_on_never_admit_what_the_engine_refuses() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some(server) = runtime.block_on(async { RedisServer::start() }) else {
        return;
    };
    static CASE: AtomicUsize = AtomicUsize::new(0);
    let answered = std::sync::atomic::AtomicU64::new(0);
    proptest!(ProptestConfig { cases: 12, ..ProptestConfig::default() },
        |(steps in proptest::collection::vec(step(), 40..120))| {
        let prefix = format!("model-{}", CASE.fetch_add(1, Ordering::Relaxed));
        let n = runtime.block_on(model(&server, &prefix, &steps));
        answered.fetch_add(n, Ordering::Relaxed);
    });
    assert!(
        answered.load(Ordering::Relaxed) > 0,
        "no sequence had a refusal answered from memory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_notice_subscription_stays_live_and_keeps_what_it_remembers() {
    // No notice for several quiet periods: the pings that check the subscription are answered,
    // so nothing is forgotten and the refusal is still answered from memory.
    let Some(server) = RedisServer::start() else {
        return;
    };
    let mut options = options(&server, "quiet", "r0", &["r0"]);
    options.heartbeat = Duration::from_millis(200);
    options.lease_ttl = Duration::from_secs(60);
    let replica = replica_with(config(), options).await;
    let _held = replica.admit("amy", false, None).await.unwrap().commit();
    assert_eq!(
        code(&replica.admit("amy", false, None).await),
        Some(RefusalCode::ClientOperationLimit)
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let stats = replica.stats();
    let resubscribed = unyolo_admission::admission::BackendStats::FORGOTTEN_REASONS
        .iter()
        .position(|r| *r == "resubscribed")
        .unwrap();
    assert!(stats.notices_live, "{stats:?}");
    assert_eq!(stats.refusals_forgotten[resubscribed], 0, "{stats:?}");
}
