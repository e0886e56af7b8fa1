//! The fair share of the global pools on replicas (SPEC sections 7 and 11), on a real
//! `redis-server`: decided inside the one shared script, on the whole deployment's counts and
//! holders. Two replicas split the clients, so the replica that answers holds nothing of the
//! client it refuses: its own engine (which decides after Redis, and alone would refuse too) has
//! nothing to refuse with, and the answer is the script's. And the holders Redis keeps stay
//! exact through the scripts that move counts outside a decision: reap, and registration (which
//! counts them again from the client counts).
//!
//! `admission_fair_share.rs` runs the same semantics against one replica and in process.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::redis::{ProcessServer, cli, process_server};
use unyolo_admission::admission::{Admission, AdmitError, NotStarted, Refused, ReplicaOptions};
use unyolo_admission::config::Pool;
use unyolo_admission::{
    ClientLimits, Config, Controller, FairShare, FairShareReason, FairShareRefusal, Identity,
    Limits, PoolShare, RefusalCode,
};

fn id(name: &str) -> Identity {
    Identity::new(name).unwrap()
}

/// `global_active` `ga`, `global_executing` `ge`, shared with these (reserve, floor) per pool;
/// `batch-a` and `batch-b` may each hold the whole active pool, `ui` four.
fn config(ga: u32, ge: u32, active: (u32, u32), executing: (u32, u32)) -> Config {
    let limits = Limits {
        requests_per_window: 10_000,
        window_seconds: 86_400,
        client_active: 4,
        client_pending: 4,
        global_active: ga,
        global_executing: ge,
    };
    let batch = ClientLimits {
        requests_per_window: 10_000,
        window_seconds: 86_400,
        active: ga,
        pending: 4,
    };
    let overrides: BTreeMap<Identity, ClientLimits> =
        [(id("batch-a"), batch), (id("batch-b"), batch)].into();
    let pool = |(reserve, floor)| PoolShare { reserve, floor };
    Config::new(limits, overrides, ["batch-a", "batch-b", "ui"].map(id))
        .unwrap()
        .with_fair_share(Some(FairShare {
            active: pool(active),
            executing: pool(executing),
        }))
        .unwrap()
}

/// Two replicas of one deployment under a prefix of its own, `r1` and `r2`, registered.
async fn two_replicas(
    server: &ProcessServer,
    prefix: &str,
    config: Config,
    memory: bool,
) -> (Admission, Admission) {
    let mut replicas = Vec::new();
    for name in ["r1", "r2"] {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
        options.prefix = prefix.to_owned();
        options.refusal_memory = memory;
        options.call_timeout = Duration::from_secs(5);
        options.lease_ttl = Duration::from_secs(60);
        options.heartbeat = Duration::from_secs(20);
        let admission = Admission::new(Controller::new(config.clone()), Some(options)).unwrap();
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        replicas.push(admission);
    }
    let r2 = replicas.pop().unwrap();
    (replicas.pop().unwrap(), r2)
}

async fn refused(replica: &Admission, client: &str, needs_approval: bool) -> Refused {
    match replica.admit(client, needs_approval, None).await {
        Err(AdmitError::Refused(refused)) => refused,
        Ok(permit) => panic!("{client} admitted: {permit:?}"),
        Err(other) => panic!("{client}: {other}"),
    }
}

/// Asserts the refusal of `client` on `replica`: its code and fair-share refusal.
async fn assert_refused(
    replica: &Admission,
    client: &str,
    code: RefusalCode,
    fair: Option<(Pool, FairShareReason)>,
) {
    let refused = refused(replica, client, false).await;
    assert_eq!(refused.refusal.code, code, "{client}: {refused:?}");
    assert_eq!(
        refused.fair_share,
        fair.map(|(pool, reason)| FairShareRefusal::new(pool, reason)),
        "{client}: {refused:?}"
    );
}

async fn holders(replica: &Admission) -> (u64, u64) {
    let counts = replica.counts().await.unwrap();
    (counts.active_holders, counts.executing_holders)
}

const RESERVE: FairShareReason = FairShareReason::Reserve;
const SHARE: FairShareReason = FairShareReason::Share;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_script_keeps_the_reserve_for_a_client_another_replica_serves() {
    let Some(server) = process_server() else {
        return;
    };
    let (r1, r2) = two_replicas(server, "fair-reserve", config(10, 4, (2, 2), (1, 1)), false).await;
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(r1.admit("batch-a", false, None).await.unwrap().commit());
    }
    // r2 holds nothing of batch-a's: the refusal is the script's.
    let code = RefusalCode::GlobalOperationLimit;
    assert_refused(&r2, "batch-a", code, Some((Pool::Active, RESERVE))).await;
    assert_eq!(r2.controller().snapshot().active, 0);
    for needs_approval in [true, false] {
        held.push(r2.admit("ui", needs_approval, None).await.unwrap().commit());
    }
    assert_refused(&r2, "ui", code, None).await;
    assert_eq!(holders(&r1).await, (2, 0));
    // r2 counted the refusal it answered, by pool and reason.
    let fair = r2.controller().snapshot().fair_share_refusals;
    assert_eq!(fair, [1, 0, 0, 0]);
    for op in held {
        op.fail().await.unwrap();
    }
    let counts = r2.counts().await.unwrap();
    assert!(counts.is_idle(), "{counts:?}");
    let hash = cli(server.port, &["HGETALL", "{fair-reserve}:counts"]);
    assert_eq!(
        hash.trim(),
        "",
        "an idle deployment leaves no count, no holder"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_script_gives_a_freed_slot_to_the_client_below_its_share() {
    let Some(server) = process_server() else {
        return;
    };
    let (r1, r2) = two_replicas(server, "fair-share", config(10, 10, (1, 1), (1, 1)), false).await;
    let code = RefusalCode::GlobalOperationLimit;
    let mut a_ops = Vec::new();
    for _ in 0..9 {
        a_ops.push(r1.admit("batch-a", false, None).await.unwrap().commit());
    }
    let mut b_ops = vec![r2.admit("batch-b", false, None).await.unwrap().commit()];
    a_ops.pop().unwrap().fail().await.unwrap();
    // Only the reserve is free: neither is below the floor.
    assert_refused(&r2, "batch-a", code, Some((Pool::Active, RESERVE))).await;
    assert_refused(&r2, "batch-b", code, Some((Pool::Active, RESERVE))).await;
    // batch-a, above its share of 5 (9 among 2), asks on both replicas; the slot is batch-b's.
    a_ops.pop().unwrap().fail().await.unwrap();
    assert_refused(&r1, "batch-a", code, Some((Pool::Active, SHARE))).await;
    assert_refused(&r2, "batch-a", code, Some((Pool::Active, SHARE))).await;
    b_ops.push(r2.admit("batch-b", false, None).await.unwrap().commit());
    let counts = r1.counts().await.unwrap();
    assert_eq!(
        (
            counts.active,
            counts.clients["batch-a"].0,
            counts.clients["batch-b"].0
        ),
        (9, 7, 2)
    );
    assert_eq!(holders(&r1).await, (2, 0));
    for op in a_ops.into_iter().chain(b_ops) {
        op.fail().await.unwrap();
    }
    assert!(r1.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_script_refuses_a_start_and_an_admission_the_execution_pool_has_no_room_for() {
    let Some(server) = process_server() else {
        return;
    };
    let (r1, r2) = two_replicas(server, "fair-start", config(100, 6, (0, 1), (1, 1)), false).await;
    // batch-a's operation on r2, admitted while the pool is empty, and five on r1 that run.
    let queued = r2.admit("batch-a", false, None).await.unwrap().commit();
    let mut running = Vec::new();
    for _ in 0..5 {
        let op = r1.admit("batch-a", false, None).await.unwrap().commit();
        op.try_start().await.unwrap();
        running.push(op);
    }
    // r2 runs nothing of batch-a's: its engine would start it; the script does not.
    assert!(matches!(
        queued.try_start().await,
        Err(NotStarted::Saturated(r)) if r.code == RefusalCode::GlobalExecutionLimit
    ));
    assert_eq!(r2.controller().snapshot().executing, 0, "given back here");
    let code = RefusalCode::GlobalExecutionLimit;
    assert_refused(&r2, "batch-a", code, Some((Pool::Executing, RESERVE))).await;
    // ui, executing nothing, is admitted on r2 and starts in the reserve.
    let ui = r2.admit("ui", true, None).await.unwrap().commit();
    ui.approve().await.unwrap();
    ui.try_start().await.unwrap();
    // Two of batch-a's finish: 3 of its against a share of 3 (5 among 2).
    running.pop().unwrap().succeed().await.unwrap();
    running.pop().unwrap().succeed().await.unwrap();
    assert_refused(&r2, "batch-a", code, Some((Pool::Executing, SHARE))).await;
    assert!(queued.try_start().await.is_err());
    let counts = r1.counts().await.unwrap();
    assert_eq!(
        (
            counts.executing,
            counts.executing_holders,
            counts.active_holders
        ),
        (4, 2, 2)
    );
    ui.succeed().await.unwrap();
    queued.try_start().await.unwrap();
    for op in running.into_iter().chain([queued]) {
        op.succeed().await.unwrap();
    }
    assert!(r2.counts().await.unwrap().is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_answered_from_memory_is_counted_by_its_pool_and_reason() {
    let Some(server) = process_server() else {
        return;
    };
    let (r1, r2) = two_replicas(server, "fair-memory", config(4, 2, (1, 1), (1, 1)), true).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(r1.admit("batch-a", false, None).await.unwrap().commit());
    }
    support::eventually::assert_eventually("r2's notices are live", async || {
        r2.stats().notices_live
    })
    .await;
    let code = RefusalCode::GlobalOperationLimit;
    for _ in 0..3 {
        assert_refused(&r2, "batch-a", code, Some((Pool::Active, RESERVE))).await;
    }
    assert!(r2.stats().refusals_from_memory >= 1, "{:?}", r2.stats());
    assert_eq!(r2.controller().snapshot().fair_share_refusals, [3, 0, 0, 0]);
    for op in held {
        op.fail().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holders_stay_exact_when_a_lapsed_replica_is_reaped_and_a_replica_registers() {
    let Some(server) = process_server() else {
        return;
    };
    let prefix = "fair-reap";
    let (r1, r2) = two_replicas(server, prefix, config(10, 4, (1, 1), (1, 1)), false).await;
    // r1 holds batch-a's work (one executing), r2 ui's and batch-b's.
    let a1 = r1.admit("batch-a", false, None).await.unwrap().commit();
    a1.try_start().await.unwrap();
    let a2 = r1.admit("batch-a", true, None).await.unwrap().commit();
    let ui = r2.admit("ui", false, None).await.unwrap().commit();
    ui.try_start().await.unwrap();
    let b = r2.admit("batch-b", true, None).await.unwrap().commit();
    assert_eq!(holders(&r2).await, (3, 2));
    // r1's lease lapses (its heartbeat is far off): r2's reap releases what it held.
    cli(server.port, &["DEL", &format!("{{{prefix}}}:lease:r1")]);
    assert_eq!(r2.reap().await.unwrap(), 2);
    assert_eq!(holders(&r2).await, (2, 1));
    // Holders written wrong (as by a build that kept none): a registration counts them again.
    let counts_key = format!("{{{prefix}}}:counts");
    cli(server.port, &["HSET", &counts_key, "active_holders", "7"]);
    cli(server.port, &["HDEL", &counts_key, "executing_holders"]);
    r2.recount_shared().await.unwrap();
    assert_eq!(holders(&r2).await, (2, 1));
    ui.succeed().await.unwrap();
    b.cancel().await.unwrap();
    assert!(r2.counts().await.unwrap().is_idle());
    // r1's handles are let go here; Redis holds nothing of theirs any more.
    drop((a1, a2));
    assert!(r2.counts().await.unwrap().is_idle());
}
