//! The replicated admission against a real `redis-server`, through the library's one API
//! ([`Admission`] with [`ReplicaOptions`]): the same decisions as the in-process engine on random
//! sequences, limits that hold across replicas, exactly-once releases, operation ids the
//! admission never hands out twice, leases, a paused Redis, and one operation per idempotency
//! key. `redis_backend_keys.rs`: reloads and buckets, a Redis down at set-up, restores dropped
//! mid-way, idempotency keys freed by a refund, a drop or a cut-off call, quotas and refusals
//! counted. The section-2 semantic tests run against both backends in `admission_semantics.rs`.

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use support::eventually::assert_eventually as eventually;
use support::replicas::{
    admit_op, global, ids, options, replica, replica_on, roomy_config, small_config,
};
use support::rng::Rng;
use unyolo_admission::admission::{
    Admission, AdmitError, NotStarted, OperationHandle, Refused, ReplicaOptions, RestoredOperation,
    UnavailableReason,
};
use unyolo_admission::config::Limits;
use unyolo_admission::{
    CancelOutcome, Config, Controller, Identity, ManualClock, Operation, OperationState,
    RefusalCode, StartError, StorageCaps,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sequences_get_the_same_decisions_and_counts_as_the_in_process_engine() {
    let server = redis_or_skip!();
    let started = Instant::now();
    let mut seen = std::collections::BTreeSet::new();
    for seed in [1u64, 7, 42, 1234, 98765] {
        // Three pending grants in all, fewer than the clients' pending limits add up to.
        let caps = StorageCaps {
            grant_global: 3,
            ..StorageCaps::default()
        };
        let mut opts = options(&server, "model", &["model"]);
        opts.prefix = format!("model-{seed}");
        let shared = replica_on(
            Controller::builder(small_config())
                .storage_caps(caps)
                .build(),
            opts,
        )
        .await;
        let local = Controller::builder(small_config())
            .clock(ManualClock::new())
            .storage_caps(caps)
            .build();
        let mut rng = Rng(seed);
        let mut live: Vec<(Operation, OperationHandle)> = Vec::new();
        for step in 0..250 {
            let context = format!("seed {seed} step {step}");
            match rng.below(7) {
                0..=2 => {
                    let client = ["amy", "bob", "eve", "stranger"][rng.below(4)];
                    let needs_approval = rng.below(3) > 0;
                    let expected = local.admit(client, needs_approval);
                    let got = shared.admit(client, needs_approval, None).await;
                    match (expected, got) {
                        (Ok(permit), Ok(shared_permit)) => {
                            live.push((permit.commit(), shared_permit.commit()));
                        }
                        (Err(expected), Err(AdmitError::Refused(Refused { refusal: got, .. }))) => {
                            assert_eq!(expected.code, got.code, "{context}");
                            seen.insert(got.code);
                            if expected.code == RefusalCode::SubmissionRateLimited
                                && got.retry_after != expected.retry_after
                            {
                                // Redis's clock moves and the manual one does not: the rate
                                // wait can only be shorter, by no more than the time elapsed.
                                let elapsed = started.elapsed().as_secs() + 1;
                                assert!(
                                    got.retry_after < expected.retry_after
                                        && got.retry_after_secs() + elapsed
                                            >= expected.retry_after_secs(),
                                    "{context}: {got:?} vs {expected:?}"
                                );
                            } else {
                                assert_eq!(expected.retry_after, got.retry_after, "{context}");
                            }
                        }
                        (expected, got) => panic!("{context}: {expected:?} vs {got:?}"),
                    }
                }
                action if !live.is_empty() => {
                    let i = rng.below(live.len());
                    let (op, shared_op) = &live[i];
                    match action {
                        3 => assert_eq!(op.approve(), shared_op.approve().await, "{context}"),
                        4 => {
                            let expected = op.try_start();
                            let got = shared_op.try_start().await;
                            match (expected, got) {
                                (Ok(()), Ok(())) => {}
                                (Err(StartError::Saturated(a)), Err(NotStarted::Saturated(b))) => {
                                    assert_eq!(a, b, "{context}")
                                }
                                (
                                    Err(StartError::NotApproved(a)),
                                    Err(NotStarted::NotApproved(b)),
                                ) => assert_eq!(a, b, "{context}"),
                                (expected, got) => panic!("{context}: {expected:?} vs {got:?}"),
                            }
                        }
                        5 => assert_eq!(op.succeed(), shared_op.succeed().await, "{context}"),
                        _ => match rng.below(4) {
                            0 => assert_eq!(op.cancel(), shared_op.cancel().await, "{context}"),
                            1 => assert_eq!(op.deny(), shared_op.deny().await, "{context}"),
                            2 => assert_eq!(op.expire(), shared_op.expire().await, "{context}"),
                            _ => assert_eq!(op.fail(), shared_op.fail().await, "{context}"),
                        },
                    }
                    assert_eq!(op.state(), shared_op.state(), "{context}");
                    if op.state().is_terminal() {
                        live.swap_remove(i);
                    }
                }
                _ => {}
            }
            let snapshot = local.snapshot();
            let counts = shared.counts().await.unwrap();
            assert_eq!(
                (snapshot.active, snapshot.pending, snapshot.executing),
                global(&counts),
                "{context}"
            );
            for client in &snapshot.clients {
                let (a, p, e) = counts
                    .clients
                    .get(client.identity.as_str())
                    .copied()
                    .unwrap_or_default();
                assert_eq!(
                    (client.active, client.pending, client.executing),
                    (a, p, e),
                    "{context}: {}",
                    client.identity
                );
            }
        }
        for (op, shared_op) in live.drain(..) {
            let _ = op.fail();
            let _ = shared_op.fail().await;
        }
        assert!(shared.counts().await.unwrap().is_idle(), "seed {seed}");
        assert!(shared.snapshot().is_idle(), "seed {seed}");
        assert!(local.snapshot().is_idle(), "seed {seed}");
    }
    // The sequences reached every admission refusal, not just the easy ones.
    for code in &RefusalCode::ALL[..7] {
        assert!(seen.contains(code), "no sequence was refused with {code}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admissions_on_three_replicas_never_exceed_a_limit_and_drain_to_zero() {
    let server = redis_or_skip!();
    let clients = ["amy", "bob", "cat"];
    let config = roomy_config(&clients);
    let mut replicas = Vec::new();
    for name in ["r1", "r2", "r3"] {
        replicas.push(replica(config.clone(), options(&server, name, &["r1", "r2", "r3"])).await);
    }
    let monitor_view = replicas[0].clone();
    let stop = Arc::new(AtomicBool::new(false));
    let readings = Arc::new(AtomicU64::new(0));
    let monitor = {
        let stop = Arc::clone(&stop);
        let readings = Arc::clone(&readings);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let counts = monitor_view.counts().await.unwrap();
                assert!(counts.active <= 12, "{counts:?}");
                assert!(counts.executing <= 4, "{counts:?}");
                for (client, (a, p, _)) in &counts.clients {
                    assert!(*a <= 5 && *p <= 3, "{client}: {counts:?}");
                }
                readings.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let admitted = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..12 {
        let admission = replicas[worker % 3].clone();
        let admitted = Arc::clone(&admitted);
        workers.push(tokio::spawn(async move {
            for round in 0..40 {
                let client = clients[(worker + round) % 3];
                let needs_approval = round % 2 == 0;
                let Ok(permit) = admission.admit(client, needs_approval, None).await else {
                    tokio::task::yield_now().await;
                    continue;
                };
                admitted.fetch_add(1, Ordering::Relaxed);
                let op = permit.commit();
                if needs_approval {
                    if round % 4 == 0 {
                        op.cancel().await.unwrap();
                        continue;
                    }
                    op.approve().await.unwrap();
                }
                loop {
                    match op.try_start().await {
                        Ok(()) => break,
                        Err(NotStarted::Saturated(_)) => tokio::task::yield_now().await,
                        Err(other) => panic!("{other}"),
                    }
                }
                op.succeed().await.unwrap();
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    monitor.await.unwrap();
    assert!(admitted.load(Ordering::Relaxed) > 0);
    assert!(readings.load(Ordering::Relaxed) > 0);
    for r in &replicas {
        assert!(r.flush().await);
        assert!(r.snapshot().is_idle());
    }
    let counts = replicas[1].counts().await.unwrap();
    assert!(counts.is_idle(), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_frees_once_whatever_the_order_or_repetition_of_calls() {
    let server = redis_or_skip!();
    let shared = replica(roomy_config(&["amy"]), options(&server, "r1", &["r1"])).await;
    let other = admit_op(&shared, "amy", true).await;
    let canceled = admit_op(&shared, "amy", true).await;
    let done = admit_op(&shared, "amy", false).await;
    assert_eq!(global(&shared.counts().await.unwrap()), (3, 2, 0));
    // Cancel twice: the second changes nothing.
    assert_eq!(
        canceled.cancel().await,
        Ok(CancelOutcome::Canceled {
            from: OperationState::Pending
        })
    );
    assert_eq!(
        canceled.cancel().await,
        Ok(CancelOutcome::AlreadyTerminal(OperationState::Canceled))
    );
    assert!(canceled.fail().await.is_err());
    assert!(canceled.expire().await.is_err());
    // Run to the end, then every other ending too: refused, nothing freed again.
    done.start().await.unwrap();
    done.succeed().await.unwrap();
    assert!(done.succeed().await.is_err());
    assert!(done.fail().await.is_err());
    assert_eq!(
        done.cancel().await,
        Ok(CancelOutcome::AlreadyTerminal(OperationState::Succeeded))
    );
    // Dropped once terminal: no release is sent for them again.
    drop(canceled);
    drop(done);
    assert!(shared.flush().await);
    let counts = shared.counts().await.unwrap();
    assert_eq!(
        global(&counts),
        (1, 1, 0),
        "the other operation still counted once"
    );
    assert_eq!(counts.operations, 1);
    assert_eq!(
        shared.snapshot().dropped_operations,
        0,
        "terminal drops are not mistakes"
    );
    other.deny().await.unwrap();
    assert!(shared.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_id_is_never_accepted_twice_for_two_admissions_across_replicas_and_restarts() {
    let server = redis_or_skip!();
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 1,
        client_active: 20,
        client_pending: 20,
        global_active: 100,
        global_executing: 4,
    };
    let config = Config::new(limits, BTreeMap::new(), ids(&["amy", "bob", "cat"])).unwrap();
    let r1 = replica(config.clone(), options(&server, "r1", &["r1", "r2"])).await;
    let r2 = replica(config.clone(), options(&server, "r2", &["r1", "r2"])).await;
    let mut seen = HashSet::new();
    let mut live: Vec<(String, OperationHandle)> = Vec::new();
    // Admissions on both replicas, each operation ended or kept, so ids come from both and the
    // counts move both ways.
    for round in 0..24 {
        let r = if round % 2 == 0 { &r1 } else { &r2 };
        let client = ["amy", "bob", "cat"][round % 3];
        let permit = r.admit(client, round % 3 != 0, None).await.unwrap();
        assert!(
            seen.insert(permit.id()),
            "id {} handed out twice",
            permit.id()
        );
        let op = permit.commit();
        if round % 4 == 0 {
            op.fail().await.unwrap();
        } else {
            live.push((r.replica().unwrap().to_owned(), op));
        }
    }
    let counts = r1.counts().await.unwrap();
    assert_eq!(counts.active, live.len() as u64, "{counts:?}");
    assert_eq!(counts.operations, live.len() as u64);
    // r1 restarts under its name: its store restores what r1 held, under the ids it stored.
    let (of_r1, mut live): (Vec<_>, Vec<_>) = live.into_iter().partition(|(r, _)| r == "r1");
    let stored: Vec<RestoredOperation> = of_r1
        .iter()
        .map(|(_, op)| RestoredOperation {
            id: op.id().to_string(),
            identity: op.identity().clone(),
            state: op.state(),
        })
        .collect();
    for (_, op) in of_r1 {
        // As if the process died: no release is ever sent.
        std::mem::forget(op);
    }
    r1.shutdown().await;
    drop(r1);
    let restarted = Admission::new(
        Controller::new(config),
        Some(options(&server, "r1", &["r1", "r2"])),
    )
    .unwrap();
    let restored = restarted.restore(stored.clone()).await;
    assert!(restored.deferred.is_none());
    for op in restored.operations {
        live.push(("r1".to_owned(), op.unwrap()));
    }
    assert_eq!(live.len(), 24 - 6);
    let counts = r2.counts().await.unwrap();
    assert_eq!(
        counts.active,
        live.len() as u64,
        "restored once each: {counts:?}"
    );
    // New admissions on the restarted replica and the other: never an id seen before, so none
    // is taken for a retry of an earlier admission (which would count nothing).
    for round in 0..12 {
        let r = if round % 2 == 0 { &restarted } else { &r2 };
        let permit = r.admit("amy", false, None).await.unwrap();
        assert!(
            seen.insert(permit.id()),
            "id {} handed out twice",
            permit.id()
        );
        assert!(
            stored.iter().all(|s| s.id != permit.id().to_string()),
            "a restored id handed out again"
        );
        let op = permit.commit();
        let counts = r2.counts().await.unwrap();
        assert_eq!(counts.active, live.len() as u64 + 1, "{counts:?}");
        op.fail().await.unwrap();
    }
    let counts = r2.counts().await.unwrap();
    assert_eq!(counts.active, live.len() as u64);
    assert_eq!(counts.operations, live.len() as u64);
    for (_, op) in &live {
        op.fail().await.unwrap();
    }
    assert!(r2.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_released_by_a_survivor_exactly_once() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy", "bob"]);
    let mut short = options(&server, "doomed", &["doomed", "survivor"]);
    short.lease_ttl = Duration::from_millis(400);
    short.heartbeat = Duration::from_millis(100);
    let doomed = replica(config.clone(), short).await;
    let survivor = replica(
        config,
        options(&server, "survivor", &["doomed", "survivor"]),
    )
    .await;
    let kept = admit_op(&survivor, "bob", true).await;
    for i in 0..3 {
        let op = admit_op(&doomed, "amy", i != 1).await;
        // As if the process died: no release is ever sent.
        std::mem::forget(op);
    }
    assert_eq!(survivor.counts().await.unwrap().active, 4);
    // A set of ids as an older build kept it, naming one it never recorded: reap goes by the
    // records, and deletes the set.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("SADD")
        .arg("{admission}:held:doomed")
        .arg("never-recorded")
        .query_async(&mut conn)
        .await
        .unwrap();
    doomed.shutdown().await;
    drop(doomed);
    let freed = Arc::new(AtomicU64::new(0));
    eventually("the survivor reaps the lapsed lease", || {
        let survivor = survivor.clone();
        let freed = Arc::clone(&freed);
        async move {
            let n = survivor.reap().await.unwrap();
            freed.fetch_add(n, Ordering::Relaxed) + n > 0
        }
    })
    .await;
    assert_eq!(freed.load(Ordering::Relaxed), 3);
    assert!(held_sets(&mut conn).await.is_empty());
    assert_eq!(survivor.reap().await.unwrap(), 0, "reaped once only");
    assert_eq!(survivor.stats().reaped, 3);
    let counts = survivor.counts().await.unwrap();
    assert_eq!(global(&counts), (1, 1, 0), "{counts:?}");
    assert_eq!(counts.clients.get("bob"), Some(&(1, 1, 0)));
    kept.cancel().await.unwrap();
    assert!(survivor.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarting_under_its_name_replaces_its_holdings_with_what_it_restores() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let first = replica(config.clone(), options(&server, "r1", &["r1"])).await;
    let mut stored = Vec::new();
    for i in 0..4 {
        let op = admit_op(&first, "amy", i % 2 == 0).await;
        stored.push(RestoredOperation {
            id: op.id().to_string(),
            identity: op.identity().clone(),
            state: op.state(),
        });
        std::mem::forget(op);
    }
    first.shutdown().await;
    drop(first);
    // The store restores two of the four (the others ended before the crash was recorded), one
    // approved: counted once each, nothing left of the old run.
    let restarted = Admission::new(
        Controller::new(config),
        Some(options(&server, "r1", &["r1"])),
    )
    .unwrap();
    let restored = restarted
        .restore([stored[0].clone(), stored[3].clone()])
        .await;
    assert!(restored.deferred.is_none());
    let restored: Vec<OperationHandle> = restored
        .operations
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(restored[0].state(), OperationState::Pending);
    assert_eq!(restored[1].state(), OperationState::Approved);
    let counts = restarted.counts().await.unwrap();
    assert_eq!(global(&counts), (2, 1, 0), "{counts:?}");
    assert_eq!(counts.operations, 2);
    for op in &restored {
        op.fail().await.unwrap();
    }
    assert!(restarted.counts().await.unwrap().is_idle());
}

/// The `{admission}:held:*` keys in `conn`'s Redis.
async fn held_sets(conn: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    redis::cmd("KEYS")
        .arg("{admission}:held:*")
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_work_is_found_by_its_records_and_an_older_builds_held_set_is_deleted() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy", "bob"]);
    let first = replica(config.clone(), options(&server, "r1", &["r1", "r2"])).await;
    let other = replica(config.clone(), options(&server, "r2", &["r1", "r2"])).await;
    let theirs = admit_op(&other, "bob", false).await;
    let mut mine = Vec::new();
    for i in 0..3 {
        let op = admit_op(&first, "amy", i == 0).await;
        mine.push(op.id().to_string());
        std::mem::forget(op);
    }
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    assert!(held_sets(&mut conn).await.is_empty(), "no set per replica");
    // A set as an older build kept it, listing one of r1's operations and one of r2's: the
    // records decide whose an operation is, not the set.
    let _: () = redis::cmd("SADD")
        .arg("{admission}:held:r1")
        .arg(&mine[0])
        .arg(theirs.id().to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    let holdings = first.shared_holdings().await.unwrap().unwrap();
    let expected: BTreeMap<String, OperationState> = [
        (mine[0].clone(), OperationState::Pending),
        (mine[1].clone(), OperationState::Approved),
        (mine[2].clone(), OperationState::Approved),
    ]
    .into_iter()
    .collect();
    assert_eq!(holdings, expected);
    first.shutdown().await;
    drop(first);
    // r1 comes back with nothing to restore: its three are released, r2's stays counted, and the
    // old set is gone.
    let restarted = replica(config, options(&server, "r1", &["r1", "r2"])).await;
    let counts = restarted.counts().await.unwrap();
    assert_eq!(global(&counts), (1, 0, 0), "{counts:?}");
    assert_eq!(counts.operations, 1);
    assert_eq!(counts.clients.get("bob"), Some(&(1, 0, 0)));
    assert!(held_sets(&mut conn).await.is_empty());
    assert!(
        restarted
            .shared_holdings()
            .await
            .unwrap()
            .unwrap()
            .is_empty()
    );
    theirs.fail().await.unwrap();
    assert!(restarted.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_holdings_are_read_page_by_page_whatever_their_number() {
    let server = redis_or_skip!();
    // More live operations than one page holds, spread over two replicas.
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 1,
        client_active: 2000,
        client_pending: 2000,
        global_active: 2000,
        global_executing: 4,
    };
    let config = Config::new(limits, BTreeMap::new(), ids(&["amy"])).unwrap();
    let caps = StorageCaps {
        grant_global: 2000,
        grant_client: 2000,
        ..StorageCaps::default()
    };
    let on = |name: &str| {
        let controller = Controller::builder(config.clone())
            .storage_caps(caps)
            .build();
        replica_on(controller, options(&server, name, &["r1", "r2"]))
    };
    let (mine, theirs) = (on("r1").await, on("r2").await);
    let mut expected = BTreeMap::new();
    let mut live = Vec::new();
    for i in 0..1200 {
        let on_mine = i % 3 != 0;
        let op = admit_op(if on_mine { &mine } else { &theirs }, "amy", i % 2 == 0).await;
        if on_mine {
            expected.insert(op.id().to_string(), op.state());
        }
        live.push(op);
    }
    assert_eq!(expected.len(), 800);
    assert_eq!(mine.shared_holdings().await.unwrap().unwrap(), expected);
    for op in &live {
        op.fail().await.unwrap();
    }
    assert!(mine.shared_holdings().await.unwrap().unwrap().is_empty());
    assert!(mine.counts().await.unwrap().is_idle());
}

/// An operation whose id Redis cannot record (a space, say) is not restored on a replica at all:
/// counted only here, the other replicas would admit past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_id_the_shared_store_cannot_hold_is_refused_and_counted_nowhere() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let admission = Admission::new(
        Controller::new(config),
        Some(options(&server, "r1", &["r1"])),
    )
    .expect("valid replica options");
    let amy = Identity::new("amy").unwrap();
    let restored = admission
        .restore(vec![
            RestoredOperation {
                id: "op 1".to_string(),
                identity: amy.clone(),
                state: OperationState::Pending,
            },
            RestoredOperation {
                id: "op_2".to_string(),
                identity: amy,
                state: OperationState::Pending,
            },
        ])
        .await;
    assert!(restored.deferred.is_none());
    let mut results = restored.operations.into_iter();
    match results.next().unwrap() {
        Err(err) => {
            assert_eq!(err, unyolo_admission::engine::RestoreError::UnshareableId);
            assert!(err.to_string().contains("shared store"), "{err}");
        }
        Ok(handle) => panic!("restored {handle:?}"),
    }
    let _kept = results.next().unwrap().expect("a shareable id is restored");
    assert_eq!(admission.snapshot().pending, 1, "only op_2 here");
    assert_eq!(
        admission.counts().await.unwrap().pending,
        1,
        "only op_2 shared"
    );
}

/// A replica takes its lease by registering what its store restored; until the embedder calls
/// `restore` (even with nothing), its refusals say so instead of a bare "lease not held".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_admits_nothing_before_restore_and_says_restore_is_missing() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let admission = Admission::new(
        Controller::new(config),
        Some(options(&server, "fresh", &["fresh"])),
    )
    .expect("valid replica options");
    match admission.admit("amy", false, None).await {
        Err(AdmitError::Unavailable(u)) => {
            assert_eq!(u.reason, UnavailableReason::NotRestored);
            assert!(u.to_string().contains("Admission::restore"), "{u}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        admission.counts().await.unwrap().is_idle(),
        "nothing reserved"
    );
    let restored = admission.restore(Vec::new()).await;
    assert!(restored.deferred.is_none(), "the replica registers");
    admit_op(&admission, "amy", false)
        .await
        .fail()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_replica_stops_admitting_and_counts_its_work_again_on_return() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let cut_off = replica(config.clone(), options(&server, "cut", &["cut", "other"])).await;
    let other = replica(config, options(&server, "other", &["cut", "other"])).await;
    let op = admit_op(&cut_off, "amy", false).await;
    // Its lease lapses (as if it could not reach Redis for longer than the TTL) and the other
    // replica releases what it held.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg("{admission}:lease:cut")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(other.reap().await.unwrap(), 1);
    assert!(other.counts().await.unwrap().is_idle());
    match cut_off.admit("amy", false, None).await {
        Err(AdmitError::Unavailable(u)) => {
            assert_eq!(u.reason, UnavailableReason::LeaseNotHeld);
            assert_eq!(u.http_status(), 503);
        }
        other => panic!("{other:?}"),
    }
    assert!(!cut_off.stats().lease_held);
    // Back: it re-registers what it still holds, as a restart would.
    cut_off.renew().await.unwrap();
    assert!(cut_off.stats().lease_held);
    let counts = other.counts().await.unwrap();
    assert_eq!(global(&counts), (1, 0, 0), "{counts:?}");
    admit_op(&cut_off, "amy", false).await.fail().await.unwrap();
    op.fail().await.unwrap();
    assert!(other.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_answers_unavailable_never_over_admits_and_releases_catch_up() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let shared = replica(config, options(&server, "r1", &["r1"])).await;
    let held = admit_op(&shared, "amy", true).await;
    server.pause();
    let mut unavailable = 0;
    for _ in 0..5 {
        match shared.admit("amy", true, None).await {
            Err(AdmitError::Unavailable(u)) => {
                assert_eq!(u.retry_after_secs(), 2);
                unavailable += 1;
            }
            other => panic!("admitted while Redis was paused: {other:?}"),
        }
    }
    assert_eq!(unavailable, 5);
    assert!(shared.stats().circuit_open);
    // Reads that a broker takes while exempt paths may wait on it do not ask a Redis known
    // not to answer: no wait, no call.
    let errors = shared.stats().errors;
    match shared.shared_holdings().await {
        Err(u) => assert_eq!(u.reason, UnavailableReason::CircuitOpen),
        Ok(held) => panic!("holdings read from a paused Redis: {held:?}"),
    }
    assert!(
        shared.quota_now("amy").await.is_some(),
        "this engine's quota"
    );
    assert_eq!(shared.stats().errors, errors, "no call was made");
    // Exempt paths keep working: the cancel answers now, its release is kept.
    assert_eq!(
        held.cancel().await,
        Ok(CancelOutcome::Canceled {
            from: OperationState::Pending
        })
    );
    assert!(shared.stats().outbox >= 1);
    server.resume();
    eventually("kept releases reach Redis", || {
        let shared = shared.clone();
        async move { shared.flush().await }
    })
    .await;
    // The admissions whose replies were lost ran once Redis woke; their releases undid them.
    let counts = shared.counts().await.unwrap();
    assert!(counts.is_idle(), "{counts:?}");
    assert!(shared.stats().errors > 0);
    eventually("admissions work again", || {
        let shared = shared.clone();
        async move {
            match shared.admit("amy", true, None).await {
                Ok(permit) => {
                    permit.commit().cancel().await.unwrap();
                    true
                }
                Err(AdmitError::Unavailable(_)) => false,
                Err(other) => panic!("{other:?}"),
            }
        }
    })
    .await;
    assert!(shared.flush().await);
    assert!(shared.counts().await.unwrap().is_idle());
    assert!(shared.snapshot().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_idempotency_key_on_every_replica_creates_one_operation() {
    let server = redis_or_skip!();
    let config = roomy_config(&["amy"]);
    let mut replicas = Vec::new();
    for name in ["r1", "r2", "r3", "r4"] {
        replicas.push(
            replica(
                config.clone(),
                options(&server, name, &["r1", "r2", "r3", "r4"]),
            )
            .await,
        );
    }
    for round in 0..5 {
        let key = format!("deploy-{round}");
        let attempts = replicas.iter().map(|r| {
            let r = r.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let name = r.replica().unwrap().to_owned();
                (name, r.admit("amy", true, Some(&key)).await)
            })
        });
        let mut admitted = Vec::new();
        let mut replays = Vec::new();
        for attempt in attempts.collect::<Vec<_>>() {
            let (name, result) = attempt.await.unwrap();
            match result {
                Ok(permit) => admitted.push((permit.id().to_string(), name, permit.commit())),
                Err(AdmitError::Replay { operation, replica }) => {
                    replays.push((operation, replica))
                }
                Err(other) => panic!("{other:?}"),
            }
        }
        assert_eq!(admitted.len(), 1, "round {round}");
        assert_eq!(replays.len(), 3, "round {round}");
        let (winner, winner_replica, op) = admitted.pop().unwrap();
        assert!(
            replays
                .iter()
                .all(|(o, r)| *o == winner && *r == winner_replica),
            "{replays:?} vs {winner} on {winner_replica}"
        );
        assert_eq!(replicas[0].counts().await.unwrap().active, 1);
        // Even once the operation has ended, the key still names it.
        op.cancel().await.unwrap();
        match replicas[2].admit("amy", true, Some(&key)).await {
            Err(AdmitError::Replay { operation, .. }) => assert_eq!(operation, winner),
            other => panic!("{other:?}"),
        }
    }
    assert!(replicas[0].counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_under_two_prefixes_share_a_redis_but_not_their_counts() {
    let server = redis_or_skip!();
    let config = small_config();
    let blue = replica(config.clone(), options(&server, "r1", &["r1"])).await;
    let mut green_options = options(&server, "r1", &["r1"]);
    green_options.prefix = "green".into();
    let green = replica(config, green_options).await;
    let _ops: Vec<_> = futures_collect(&blue, 3).await;
    match blue.admit("eve", true, None).await {
        Err(AdmitError::Refused(_)) => {}
        other => panic!("{other:?}"),
    }
    let _green_op = admit_op(&green, "eve", true).await;
    assert_eq!(blue.counts().await.unwrap().active, 1);
    assert_eq!(green.counts().await.unwrap().active, 1);
}

async fn futures_collect(admission: &Admission, n: usize) -> Vec<OperationHandle> {
    let mut ops = Vec::new();
    for _ in 0..n {
        if let Ok(p) = admission.admit("eve", true, None).await {
            ops.push(p.commit());
        }
    }
    ops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_name_that_is_not_an_identity_is_refused_at_setup() {
    let server = redis_or_skip!();
    let err = Admission::new(
        Controller::new(small_config()),
        Some(ReplicaOptions::new(server.url(), "a b")),
    )
    .expect_err("refused");
    assert!(err.to_string().contains("replica"), "{err}");
    let mut bad_prefix = ReplicaOptions::new(server.url(), "r1");
    bad_prefix.prefix = "{x}".into();
    assert!(Admission::new(Controller::new(small_config()), Some(bad_prefix)).is_err());
}
