//! The replicated admission against a real `redis-server`, the second half of
//! `redis_backend.rs`: a reload rescales the shared buckets; a replica set up before Redis runs;
//! restores dropped mid-registration; idempotency keys freed again by a refund, a drop or a
//! cut-off call and kept by a commit; the quota an answer carries; kept releases; refusals
//! counted; a Redis stalled past every lease; a replica built outside a runtime.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::eventually::assert_eventually as eventually;
use support::redis as redis_support;
use support::replicas::{admit_op, global, ids, options, replica, roomy_config, small_config};
use unyolo_admission::admission::{
    Admission, AdmitError, OperationHandle, Refused, ReplicaOptions, RestoredOperation,
    UnavailableReason,
};
use unyolo_admission::config::{ClientLimits, Limits};
use unyolo_admission::{
    Config, Controller, Identity, ManualClock, Operation, OperationState, RefusalCode,
};

/// amy and bob: ten tokens an hour each; roomy counts, so only the rate ever refuses.
fn rate_config(amy: (u32, u32), bob: (u32, u32)) -> Config {
    let limits = Limits {
        requests_per_window: 10,
        window_seconds: 3600,
        client_active: 100,
        client_pending: 100,
        global_active: 400,
        global_executing: 10,
    };
    let mut overrides = BTreeMap::new();
    for (name, (requests, window)) in [("amy", amy), ("bob", bob)] {
        overrides.insert(
            Identity::new(name).unwrap(),
            ClientLimits {
                requests_per_window: requests,
                window_seconds: window,
                active: 100,
                pending: 100,
            },
        );
    }
    Config::new(limits, overrides, ids(&["amy", "bob"])).unwrap()
}

/// Admits `client` on the replicas in turn until the rate refuses; the admitted operations stay
/// live in `kept`. Returns how many were admitted.
async fn drain_tokens(
    replicas: &[&Admission],
    client: &str,
    tag: &str,
    kept: &mut Vec<OperationHandle>,
) -> usize {
    for n in 0..200 {
        let r = replicas[n % replicas.len()];
        match r.admit(client, false, None).await {
            Ok(permit) => kept.push(permit.commit()),
            Err(AdmitError::Refused(Refused { refusal, .. })) => {
                assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited, "{tag}");
                return n;
            }
            Err(other) => panic!("{tag}: {other:?}"),
        }
    }
    panic!("{tag}: the rate never refused");
}

fn drain_local(local: &Controller, client: &str, kept: &mut Vec<Operation>) -> usize {
    for n in 0..200 {
        match local.admit(client, false) {
            Ok(permit) => kept.push(permit.commit()),
            Err(refusal) => {
                assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
                return n;
            }
        }
    }
    panic!("the in-process rate never refused {client}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_on_every_replica_rescales_the_shared_buckets_as_the_in_process_engine_does() {
    let server = redis_or_skip!();
    let before = rate_config((10, 3600), (10, 3600));
    // amy: twice the burst over twice the window (no fresh burst may appear); bob: the same
    // burst over a tenth of the window (the used part shrinks with it, nothing is confiscated).
    let after = rate_config((20, 7200), (10, 360));
    let r1 = replica(before.clone(), options(&server, "r1", &["r1", "r2"])).await;
    let r2 = replica(before.clone(), options(&server, "r2", &["r1", "r2"])).await;
    let local = Controller::builder(before.clone())
        .clock(ManualClock::new())
        .build();
    let mut kept = Vec::new();
    let mut kept_local = Vec::new();
    for n in 0..4 {
        let r = if n % 2 == 0 { &r1 } else { &r2 };
        for client in ["amy", "bob"] {
            kept.push(admit_op(r, client, false).await);
            kept_local.push(local.admit(client, false).unwrap().commit());
        }
    }
    // A fifth token for amy, taken before the reload and refunded after it: what comes back is
    // measured in the new rate.
    let pending = r2.admit("amy", false, None).await.unwrap();
    let pending_local = local.admit("amy", false).unwrap();

    r1.reload(after.clone());
    r2.reload(after.clone());
    local.reload(after.clone());
    pending.refund().await;
    pending_local.refund();

    let amy = drain_tokens(&[&r1, &r2], "amy", "amy-after", &mut kept).await;
    let bob = drain_tokens(&[&r2, &r1], "bob", "bob-after", &mut kept).await;
    let amy_local = drain_local(&local, "amy", &mut kept_local);
    let bob_local = drain_local(&local, "bob", &mut kept_local);
    // amy used 4 of 10 → 8 of 20 used, 12 left (16 would be a fresh burst); bob used 4 of 10 →
    // still 4 of 10 used over the shorter window, 6 left (0 would be confiscation).
    assert_eq!((amy, bob), (12, 6));
    assert_eq!((amy, bob), (amy_local, bob_local));
    assert_eq!(kept.len(), 8 + 12 + 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_set_up_before_redis_runs_is_unavailable_then_registers_its_restored_work() {
    if !redis_support::installed() {
        return;
    }
    let port = redis_support::free_port();
    let mut opts = ReplicaOptions::new(format!("redis://127.0.0.1:{port}/"), "r1");
    opts.replicas = vec!["r1".to_owned()];
    opts.call_timeout = Duration::from_millis(300);
    opts.circuit_cool_down = Duration::from_millis(200);
    opts.heartbeat = Duration::from_millis(100);
    opts.lease_ttl = Duration::from_secs(2);
    let config = roomy_config(&["amy"]);
    // Set-up does not wait for Redis: the connection is made by the first call.
    let early = Admission::new(Controller::new(config), Some(opts)).unwrap();
    let amy = Identity::new("amy").unwrap();
    let restored = early
        .restore([
            RestoredOperation {
                id: "kept".into(),
                identity: amy.clone(),
                state: OperationState::Pending,
            },
            RestoredOperation {
                id: "ended".into(),
                identity: amy,
                state: OperationState::Approved,
            },
        ])
        .await;
    assert!(restored.deferred.is_some());
    let restored: Vec<OperationHandle> = restored
        .operations
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(restored.len(), 2);
    assert!(restored.iter().all(OperationHandle::is_replicated));
    match early.admit("amy", false, None).await {
        Err(AdmitError::Unavailable(u)) => assert_eq!(u.http_status(), 503),
        other => panic!("{other:?}"),
    }
    // One restored operation ends while Redis is still down.
    restored[1].fail().await.unwrap();

    let _server = redis_support::RedisServer::start_on(port).expect("redis-server on the port");
    let _new = admitted_once_registered(&early, "the replica registers and admits").await;
    let counts = early.counts().await.unwrap();
    // The restored pending operation and the new one; the ended one is not counted.
    assert_eq!(global(&counts), (2, 1, 0), "{counts:?}");
    assert_eq!(counts.operations, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_dropped_mid_registration_leaves_the_registration_to_the_heartbeat() {
    let server = redis_or_skip!();
    let mut opts = options(&server, "r1", &["r1"]);
    opts.heartbeat = Duration::from_millis(100);
    opts.lease_ttl = Duration::from_secs(2);
    let admission = Admission::new(Controller::new(roomy_config(&["amy"])), Some(opts)).unwrap();
    // The caller gives up while the registration waits on a paused Redis: the restore is dropped
    // mid-way, before it has registered anything or started anything.
    server.pause();
    let gave_up =
        tokio::time::timeout(Duration::from_millis(100), admission.restore(Vec::new())).await;
    assert!(
        gave_up.is_err(),
        "the registration finished on a paused Redis"
    );
    match admission.admit("amy", false, None).await {
        Err(AdmitError::Unavailable(u)) => assert_eq!(u.http_status(), 503),
        other => panic!("admitted without a registration: {other:?}"),
    }
    server.resume();
    // The heartbeat (started as the restore was dropped) registers the replica; only then does
    // it admit.
    let op = admitted_once_registered(
        &admission,
        "the heartbeat registers the replica and it admits",
    )
    .await;
    op.fail().await.unwrap();
    assert!(admission.counts().await.unwrap().is_idle());
    assert!(admission.stats().lease_held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_dropped_mid_registration_counts_none_of_its_operations_anywhere() {
    let server = redis_or_skip!();
    let mut opts = options(&server, "r1", &["r1"]);
    opts.heartbeat = Duration::from_millis(100);
    opts.lease_ttl = Duration::from_secs(2);
    let admission = Admission::new(Controller::new(roomy_config(&["amy"])), Some(opts)).unwrap();
    let amy = Identity::new("amy").unwrap();
    let stored = [
        RestoredOperation {
            id: "waiting".into(),
            identity: amy.clone(),
            state: OperationState::Pending,
        },
        RestoredOperation {
            id: "queued".into(),
            identity: amy,
            state: OperationState::Approved,
        },
    ];
    // The caller gives up while the registration (sent with both operations) waits on a paused
    // Redis: no handle is ever returned, so nothing could release them later.
    server.pause();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        admission.restore(stored.clone()),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the registration finished on a paused Redis"
    );
    // The in-process engine let go of them with the dropped handles.
    assert_eq!(admission.snapshot().active, 0);
    // Redis then runs the registration the dropped restore sent, and the heartbeat registers
    // the replica again: with what it holds now, which is neither of them.
    server.resume();
    let op = admitted_once_registered(&admission, "the heartbeat registers the replica").await;
    eventually("the dropped restore's registration is replaced", || async {
        let counts = admission.counts().await.unwrap();
        global(&counts) == (1, 0, 0) && counts.operations == 1
    })
    .await;
    assert_eq!(admission.snapshot().active, 1);
    op.fail().await.unwrap();
    assert!(admission.counts().await.unwrap().is_idle());
    assert_eq!(admission.snapshot().active, 0);
    // A restore tried again under the same ids counts them once each, in both engines, and
    // nothing the dropped one left behind releases them.
    let again = admission.restore(stored).await;
    assert!(again.deferred.is_none());
    let handles: Vec<OperationHandle> = again.operations.into_iter().map(Result::unwrap).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let counts = admission.counts().await.unwrap();
    assert_eq!(global(&counts), (2, 1, 0), "{counts:?}");
    assert_eq!(admission.snapshot().active, 2);
    for handle in &handles {
        handle.fail().await.unwrap();
    }
    assert!(admission.counts().await.unwrap().is_idle());
}

/// Admits `amy` on `admission` as soon as it is registered (until then it answers unavailable),
/// committed; `what` names the wait.
async fn admitted_once_registered(admission: &Admission, what: &str) -> OperationHandle {
    let admitted = std::sync::Mutex::new(None);
    eventually(what, || {
        let admitted = &admitted;
        async move {
            match admission.admit("amy", false, None).await {
                Ok(permit) => {
                    *admitted.lock().unwrap() = Some(permit.commit());
                    true
                }
                Err(AdmitError::Unavailable(_)) => false,
                Err(other) => panic!("{other:?}"),
            }
        }
    })
    .await;
    admitted.into_inner().unwrap().expect("admitted")
}

/// Two replicas of one deployment with one client, `amy`.
async fn two_replicas(server: &redis_support::RedisServer) -> (Admission, Admission) {
    let config = roomy_config(&["amy"]);
    let r1 = replica(config.clone(), options(server, "r1", &["r1", "r2"])).await;
    let r2 = replica(config, options(server, "r2", &["r1", "r2"])).await;
    (r1, r2)
}

/// Admits `amy` with `key` on `admission`: the permit, failing the test on anything else.
async fn admit_keyed(admission: &Admission, key: &str) -> unyolo_admission::AdmissionPermit {
    match admission.admit("amy", true, Some(key)).await {
        Ok(permit) => permit,
        Err(other) => panic!("{key} on {:?}: {other}", admission.replica()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refunded_permit_leaves_its_idempotency_key_free_for_an_admission_on_any_replica() {
    let server = redis_or_skip!();
    let (r1, r2) = two_replicas(&server).await;
    let refunded = admit_keyed(&r1, "deploy-1").await;
    let refunded_id = refunded.id();
    refunded.refund().await;
    assert!(r1.counts().await.unwrap().is_idle());
    // The key is new work on the other replica, and on this one.
    let permit = admit_keyed(&r2, "deploy-1").await;
    assert_ne!(permit.id(), refunded_id);
    let op = permit.commit();
    match r1.admit("amy", true, Some("deploy-1")).await {
        Err(AdmitError::Replay { operation, replica }) => {
            assert_eq!((operation, replica.as_str()), (op.id().to_string(), "r2"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(global(&r1.counts().await.unwrap()), (1, 1, 0));
    op.cancel().await.unwrap();
    assert!(r2.counts().await.unwrap().is_idle());
    assert_eq!(r1.snapshot().dropped_permits, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_permit_leaves_its_idempotency_key_free_on_any_replica_and_is_counted_once() {
    let server = redis_or_skip!();
    let (r1, r2) = two_replicas(&server).await;
    let dropped_before = r1.snapshot().dropped_permits;
    let permit = admit_keyed(&r1, "deploy-2").await;
    assert_eq!(global(&r1.counts().await.unwrap()), (1, 1, 0));
    drop(permit);
    assert!(r1.flush().await);
    // Its slots are back everywhere, the drop is counted once (a mistake of the embedding), and
    // the key is free on the other replica.
    assert!(r1.counts().await.unwrap().is_idle());
    assert!(r1.snapshot().is_idle());
    assert_eq!(r1.snapshot().dropped_permits, dropped_before + 1);
    let op = admit_keyed(&r2, "deploy-2").await.commit();
    assert_eq!(global(&r2.counts().await.unwrap()), (1, 1, 0));
    op.cancel().await.unwrap();
    assert!(r2.counts().await.unwrap().is_idle());
    assert_eq!(r1.snapshot().dropped_permits, dropped_before + 1);
    assert_eq!(r2.snapshot().dropped_permits, 0);
}

/// How many clients the Redis at `conn` holds blocked (a paused client's command waits there).
async fn blocked_clients(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("blocked_clients:"))
        .map(|n| n.trim().parse().unwrap())
        .expect("INFO clients names blocked_clients")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_dropped_mid_call_holds_no_slot_and_leaves_its_idempotency_key_free() {
    let server = redis_or_skip!();
    // Ten tokens an hour, so the tokens left show which admissions Redis decided.
    let config = rate_config((10, 3600), (10, 3600));
    // A long call timeout and a slow heartbeat: the only thing that ends the call below is the
    // drop, and the only script waiting in Redis is the admission's.
    let mut slow = options(&server, "r1", &["r1", "r2"]);
    slow.call_timeout = Duration::from_secs(20);
    slow.lease_ttl = Duration::from_secs(120);
    slow.heartbeat = Duration::from_secs(60);
    let r1 = replica(config.clone(), slow).await;
    let r2 = replica(config, options(&server, "r2", &["r1", "r2"])).await;
    // The admission script is loaded (so the call below is one EVALSHA that runs as sent).
    admit_op(&r1, "amy", true).await.fail().await.unwrap();
    assert!(r1.flush().await);

    // Redis holds every write command until unpaused: the admission is sent and waits there.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(60_000)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let call = {
        let r1 = r1.clone();
        tokio::spawn(async move { r1.admit("amy", true, Some("deploy-3")).await })
    };
    eventually("the admission waits in Redis", || {
        let mut conn = conn.clone();
        async move { blocked_clients(&mut conn).await == 1 }
    })
    .await;
    // The caller hangs up: the admission's future is dropped with its script sent.
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    let _: () = redis::cmd("CLIENT")
        .arg("UNPAUSE")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The script ran once Redis went on; the release kept by the drop undoes it by id.
    eventually("the kept release reaches Redis", || {
        let r1 = r1.clone();
        async move { r1.flush().await }
    })
    .await;
    let counts = r1.counts().await.unwrap();
    assert!(counts.is_idle(), "{counts:?}");
    assert!(r1.snapshot().is_idle());
    let op = admit_keyed(&r2, "deploy-3").await.commit();
    assert_eq!(global(&r2.counts().await.unwrap()), (1, 1, 0));
    op.cancel().await.unwrap();
    assert!(r2.counts().await.unwrap().is_idle());
    // The cut-off admission was decided (its token stays spent, as a dropped permit's does):
    // of ten, the warm-up, it and the one on r2 are gone.
    let mut kept = Vec::new();
    assert_eq!(drain_tokens(&[&r2], "amy", "after", &mut kept).await, 7);
    for op in &kept {
        op.fail().await.unwrap();
    }
    assert!(r2.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_operation_keeps_its_idempotency_key_bound_on_every_replica() {
    let server = redis_or_skip!();
    let (r1, r2) = two_replicas(&server).await;
    let op = admit_keyed(&r1, "deploy-4").await.commit();
    let id = op.id().to_string();
    for (replica, round) in [(&r2, 0), (&r1, 1), (&r2, 2)] {
        match replica.admit("amy", true, Some("deploy-4")).await {
            Err(AdmitError::Replay { operation, replica }) => {
                assert_eq!((operation.as_str(), replica.as_str()), (id.as_str(), "r1"));
            }
            other => panic!("round {round}: {other:?}"),
        }
    }
    // A replay reserved nothing, on either replica.
    assert_eq!(global(&r1.counts().await.unwrap()), (1, 1, 0));
    assert!(r2.snapshot().is_idle());
    op.approve().await.unwrap();
    match r2.admit("amy", false, Some("deploy-4")).await {
        Err(AdmitError::Replay { operation, .. }) => assert_eq!(operation, id),
        other => panic!("{other:?}"),
    }
    op.cancel().await.unwrap();
    assert!(r1.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusals_and_a_permits_quota_name_the_deployments_counts_not_the_replicas() {
    let server = redis_or_skip!();
    // amy: 12 tokens an hour, 3 active, 2 pending.
    let r1 = replica(small_config(), options(&server, "r1", &["r1", "r2"])).await;
    let r2 = replica(small_config(), options(&server, "r2", &["r1", "r2"])).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(admit_op(&r1, "amy", true).await);
    }
    // amy is at her pending limit through r1 alone; r2 holds nothing of hers.
    let refused = match r2.admit("amy", true, None).await {
        Err(AdmitError::Refused(refused)) => refused,
        other => panic!("{other:?}"),
    };
    assert_eq!(refused.refusal.code, RefusalCode::ClientPendingLimit);
    let quota = refused.quota.expect("amy has a quota");
    assert_eq!((quota.pending.used, quota.pending.limit), (2, 2));
    assert_eq!((quota.active.used, quota.active.limit), (2, 3));
    // Two tokens spent on r1 (a refusal spends none), of twelve.
    assert_eq!((quota.rate.quota, quota.rate.remaining), (12, 10));
    let local = r2.controller().quota("amy").unwrap();
    assert_eq!((local.pending.used, local.active.used), (0, 0));
    assert_eq!(local.rate.remaining, 12);
    // A permit's quota is the deployment's too: the third live operation, the third token.
    let permit = r2.admit("amy", false, None).await.unwrap();
    let quota = permit.quota().expect("amy has a quota");
    assert_eq!((quota.active.used, quota.pending.used), (3, 2));
    assert_eq!(quota.rate.remaining, 9);
    assert!(quota.rate.next_token_nanos > 0);
    held.push(permit.commit());
    // At her active limit now, whichever replica asks.
    for r in [&r1, &r2] {
        match r.admit("amy", false, None).await {
            Err(AdmitError::Refused(refused)) => {
                assert_eq!(refused.refusal.code, RefusalCode::ClientOperationLimit);
                let quota = refused.quota.unwrap();
                assert_eq!(quota.active.used, quota.active.limit);
                assert_eq!(quota.rate.remaining, 9);
            }
            other => panic!("{other:?}"),
        }
    }
    for op in &held {
        op.fail().await.unwrap();
    }
    assert!(r1.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_live_handle_releases_its_slots_on_every_replica_and_is_counted_once() {
    let server = redis_or_skip!();
    let (r1, r2) = two_replicas(&server).await;
    let pending = admit_keyed(&r1, "deploy-5").await.commit();
    let approved = admit_op(&r1, "amy", false).await;
    let executing = admit_op(&r1, "amy", false).await;
    executing.start().await.unwrap();
    assert_eq!(global(&r2.counts().await.unwrap()), (3, 1, 1));
    // Dropped while live: released as if failed, each drop counted once (by this replica's
    // engine, which holds the local half; the shared half adds nothing to the count).
    drop(pending);
    drop(approved);
    drop(executing);
    assert!(r1.flush().await);
    assert!(r2.counts().await.unwrap().is_idle());
    let snapshot = r1.snapshot();
    assert!(snapshot.is_idle());
    assert_eq!(
        (snapshot.dropped_operations, snapshot.dropped_permits),
        (3, 0)
    );
    // A committed operation's key names it even once it has ended this way.
    match r2.admit("amy", true, Some("deploy-5")).await {
        Err(AdmitError::Replay { replica, .. }) => assert_eq!(replica, "r1"),
        other => panic!("{other:?}"),
    }
    assert_eq!(r2.snapshot().dropped_operations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_read_now_is_the_deployments_and_what_the_next_decision_sees() {
    let server = redis_or_skip!();
    let before = rate_config((10, 3600), (10, 3600));
    let r1 = replica(before.clone(), options(&server, "r1", &["r1", "r2"])).await;
    let r2 = replica(before.clone(), options(&server, "r2", &["r1", "r2"])).await;
    let mut kept = Vec::new();
    for r in [&r1, &r1, &r2] {
        kept.push(admit_op(r, "amy", false).await);
    }
    let pending = r2.admit("amy", true, None).await.unwrap();
    let decided = pending
        .quota()
        .expect("a replicated permit carries the shared quota");
    let seen =
        |q: &unyolo_admission::QuotaStatus| (q.rate.remaining, q.active.used, q.pending.used);
    assert_eq!(seen(&decided), (6, 4, 1));
    for r in [&r1, &r2] {
        let now = r.quota_now("amy").await.expect("amy has a quota");
        assert_eq!(seen(&now), seen(&decided), "{}", r.replica().unwrap_or("?"));
        // This replica's own engine counts only what it admitted.
        assert_ne!(seen(&r.quota("amy").unwrap()), seen(&decided));
    }
    assert_eq!(seen(&r1.quota_now("bob").await.unwrap()), (10, 0, 0));
    assert!(r1.quota_now("nobody").await.is_none());
    // Reading changes nothing: the next decision takes the next token.
    let next = r1.admit("amy", false, None).await.unwrap();
    assert_eq!(seen(&next.quota().unwrap()), (5, 5, 1));
    next.refund().await;

    // A reload rescales the bucket, and the reading says so before any decision wrote it: 4 of
    // 10 used over twice the window is 8 of 20.
    let after = rate_config((20, 7200), (10, 3600));
    r1.reload(after.clone());
    r2.reload(after);
    assert_eq!(seen(&r2.quota_now("amy").await.unwrap()), (12, 4, 1));
    let next = r2.admit("amy", false, None).await.unwrap();
    assert_eq!(seen(&next.quota().unwrap()), (11, 5, 1));
    next.refund().await;
    // A token taken under the old rate comes back as the same share of the new one: a tenth of
    // the bucket, two of its twenty tokens (as the in-process engine's refund does).
    pending.refund().await;
    assert_eq!(seen(&r1.quota_now("amy").await.unwrap()), (14, 3, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_kept_more_often_than_the_heartbeat_never_hold_the_lease_renewal_back() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let fast = |name: &str| {
        let mut o = options(&server, name, &["r1", "r2"]);
        o.lease_ttl = Duration::from_millis(1200);
        o.heartbeat = Duration::from_millis(200);
        o
    };
    let r1 = replica(config.clone(), fast("r1")).await;
    let r2 = replica(config, fast("r2")).await;
    // A permit dropped unanswered is released in the background: kept, and the heartbeat woken
    // to send it. Five times a heartbeat period, for two and a half lease lifetimes.
    let changes = r1.stats().lease_changes;
    let began = Instant::now();
    let mut admitted = 0;
    while began.elapsed() < Duration::from_secs(3) {
        match r1.admit("amy", false, None).await {
            Ok(permit) => {
                admitted += 1;
                drop(permit);
            }
            Err(other) => panic!("after {admitted} admissions: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(r2.reap().await.unwrap(), 0, "r1's lease never lapsed");
    assert_eq!(r1.stats().lease_changes, changes);
    assert!(r1.flush().await);
    assert!(r1.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_counts_the_refusals_it_answers_whoever_decided_them() {
    let server = redis_or_skip!();
    let admission = replica(small_config(), options(&server, "r1", &["r1"])).await;
    let _held = admit_op(&admission, "eve", true).await;
    // Refused by the shared engine, then from memory: both answered here, both counted here.
    for _ in 0..2 {
        match admission.admit("eve", true, None).await {
            Err(AdmitError::Refused(refused)) => {
                assert_eq!(refused.refusal.code, RefusalCode::ClientPendingLimit);
            }
            other => panic!("eve admitted past her pending limit: {other:?}"),
        }
    }
    assert!(matches!(
        admission.admit("zed", false, None).await,
        Err(AdmitError::Refused(_))
    ));
    let snapshot = admission.snapshot();
    let eve = snapshot.client("eve").expect("configured");
    assert_eq!(eve.rejected[RefusalCode::ClientPendingLimit as usize], 2);
    assert_eq!(snapshot.rejected(RefusalCode::ClientPendingLimit), 2);
    assert_eq!(snapshot.rejected(RefusalCode::ClientUnconfigured), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_stalls_past_every_lease_no_replica_reaps_the_others_live_work() {
    // Redis freezes for longer than a lease: every lease lapses at once, though every replica
    // lives. The first to renew must not release the others' work, nor admit into its room.
    let server = redis_or_skip!();
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 1,
        client_active: 2,
        client_pending: 1,
        global_active: 2,
        global_executing: 2,
    };
    let config = Config::new(limits, BTreeMap::new(), ids(&["amy", "bob"])).unwrap();
    // r1 beats often, r2 seldom: r1 is back well before r2 after the stall.
    let short_lease = |name: &str, beat: u64| {
        let mut options = options(&server, name, &["r1", "r2"]);
        options.lease_ttl = Duration::from_secs(1);
        options.heartbeat = Duration::from_millis(beat);
        options
    };
    let r1 = replica(config.clone(), short_lease("r1", 100)).await;
    let r2 = replica(config, short_lease("r2", 600)).await;
    let _amy = admit_op(&r1, "amy", false).await;
    let _bob = admit_op(&r2, "bob", false).await;
    server.pause();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    server.resume();
    // Each heartbeat finds its lease lapsed and registers again; none releases the other's work
    // (it would, the moment it found the other not yet back).
    eventually("both replicas hold their leases again", || {
        let (r1, r2) = (r1.clone(), r2.clone());
        async move { r1.stats().lease_held && r2.stats().lease_held }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        (r1.stats().reaped, r2.stats().reaped),
        (0, 0),
        "a live replica's work was released"
    );
    let counts = r1.counts().await.unwrap();
    assert_eq!(counts.active, 2, "{counts:?}");
    for (replica, client) in [(&r1, "amy"), (&r2, "bob")] {
        assert!(
            matches!(
                replica.admit(client, false, None).await,
                Err(AdmitError::Refused(_))
            ),
            "admitted into a full deployment"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_a_clients_decisions_in_flight_bounded() {
    // One decision at a time for amy: the one in flight holds her room across a reload, so the
    // next waits for it (and is answered Busy), not sent beside it.
    let server = redis_or_skip!();
    let mut options = options(&server, "r1", &["r1"]);
    options.client_decisions_in_flight = 1;
    options.call_timeout = Duration::from_secs(3);
    options.decision_wait = Duration::from_millis(200);
    let config = roomy_config(&["amy"]);
    let shared = replica(config.clone(), options).await;
    server.pause();
    let first = {
        let shared = shared.clone();
        tokio::spawn(async move { shared.admit("amy", false, None).await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    shared.reload(config);
    let second = shared.admit("amy", false, None).await;
    server.resume();
    match second {
        Err(AdmitError::Unavailable(u)) => assert_eq!(u.reason, UnavailableReason::Busy),
        other => panic!("a second decision beside the first: {other:?}"),
    }
    let _ = first.await.unwrap();
}

/// A replica built outside a Tokio runtime (a synchronous `main`) is a setup error that says
/// what is missing, not a panic inside the Redis client. No Redis is needed: nothing connects.
#[test]
fn a_replica_built_outside_a_runtime_is_a_setup_error_saying_so() {
    let options = ReplicaOptions::new("redis://127.0.0.1:1", "r1");
    let built = Admission::new(Controller::new(small_config()), Some(options));
    let Err(err) = built else {
        panic!("a replica was built with no runtime to run it");
    };
    assert!(err.to_string().contains("needs a Tokio runtime"), "{err}");
    // In process, no runtime is needed.
    assert!(Admission::new(Controller::new(small_config()), None).is_ok());
}
