//! SPEC section 11, the fair share of the global pools, written once and run against both
//! backends as `admission_semantics.rs` is: `in_process::*` on the library's engine, `redis::*`
//! on a real `redis-server` (one per test process, each test under its own key prefix), where
//! the same rule is decided inside the one shared script. And, on Redis alone, that a decision
//! with a fair share is still one script call.
//!
//! On one replica, the replica's own engine (which decides after Redis, on the same counts)
//! would refuse what the script let through: `redis_fair_share.rs` splits the clients across
//! two replicas, so there the script's answer shows alone.
//!
//! The Redis backends here answer no refusal from memory: each test asks again right after a
//! release, and the notice that would end a remembered refusal arrives on a connection of its
//! own, a moment later (`redis_refusals.rs` tests the memory).

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::semantics::{Backend, Kind};
use unyolo_admission::admission::NotStarted;
use unyolo_admission::config::Pool;
use unyolo_admission::{
    ClientLimits, Config, FairShare, FairShareReason, FairShareRefusal, Identity, Limits,
    PoolShare, RefusalCode,
};

semantic_tests! {
    the_reserve_admits_a_small_client_beside_a_batch_client_filling_the_pool,
    freed_slots_go_to_the_client_below_its_share_not_to_the_one_at_it,
    the_execution_pool_is_shared_at_start_and_judged_at_admission,
    a_reload_turns_fair_share_on_and_off_keeping_every_count,
    fair_share_refusals_are_counted_by_pool_and_reason,
}

const HINT: Duration = Duration::from_secs(2);

fn id(name: &str) -> Identity {
    Identity::new(name).unwrap()
}

/// A batch client's override: a day's window of many tokens, `active` live operations.
fn batch(active: u32) -> ClientLimits {
    ClientLimits {
        requests_per_window: 10_000,
        window_seconds: 86_400,
        active,
        pending: active.min(10),
    }
}

fn share(active: (u32, u32), executing: (u32, u32)) -> FairShare {
    FairShare {
        active: PoolShare {
            reserve: active.0,
            floor: active.1,
        },
        executing: PoolShare {
            reserve: executing.0,
            floor: executing.1,
        },
    }
}

/// `global_active` `ga` and `global_executing` `ge`; the batch clients (`batch-a`, `batch-b`)
/// may each hold the whole active pool, `ui` is on defaults of many tokens; shared as
/// `fair_share` says.
fn config(ga: u32, ge: u32, fair_share: Option<FairShare>) -> Config {
    let limits = Limits {
        requests_per_window: 10_000,
        window_seconds: 86_400,
        client_active: 4,
        client_pending: 4,
        global_active: ga,
        global_executing: ge,
    };
    let overrides: BTreeMap<Identity, ClientLimits> =
        [(id("batch-a"), batch(ga)), (id("batch-b"), batch(ga))].into();
    Config::new(limits, overrides, ["batch-a", "batch-b", "ui"].map(id))
        .unwrap()
        .with_fair_share(fair_share)
        .unwrap()
}

async fn start(kind: Kind, config: Config) -> Option<Backend> {
    kind.with(config).without_refusal_memory().start().await
}

/// Asserts that `client` is refused with `code`, the capacity hint, and `fair` as the fair-share
/// refusal (`None`: the pool itself is full).
async fn assert_refused(
    b: &Backend,
    client: &str,
    needs_approval: bool,
    code: RefusalCode,
    fair: Option<FairShareRefusal>,
) {
    let refused = b.refused(client, needs_approval).await;
    assert_eq!(refused.refusal.code, code, "{client}: {refused:?}");
    assert_eq!(refused.refusal.retry_after, HINT, "{client}: {refused:?}");
    assert_eq!(refused.fair_share, fair, "{client}: {refused:?}");
}

const ACTIVE_RESERVE: Option<FairShareRefusal> = Some(FairShareRefusal::new(
    Pool::Active,
    FairShareReason::Reserve,
));
const ACTIVE_SHARE: Option<FairShareRefusal> =
    Some(FairShareRefusal::new(Pool::Active, FairShareReason::Share));
const EXECUTING_RESERVE: Option<FairShareRefusal> = Some(FairShareRefusal::new(
    Pool::Executing,
    FairShareReason::Reserve,
));
const EXECUTING_SHARE: Option<FairShareRefusal> = Some(FairShareRefusal::new(
    Pool::Executing,
    FairShareReason::Share,
));

/// The case in the active pool: a batch client alone fills all but the reserve, and a
/// client holding fewer than the floor is still admitted, up to the floor, while the reserve has
/// room. Without `fair_share` the batch client takes every slot and the small one is refused.
async fn the_reserve_admits_a_small_client_beside_a_batch_client_filling_the_pool(kind: Kind) {
    let fair = share((2, 2), (1, 1));
    let Some(b) = start(kind, config(10, 4, Some(fair))).await else {
        return;
    };
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(b.admit_op("batch-a", false).await);
    }
    let code = RefusalCode::GlobalOperationLimit;
    assert_refused(&b, "batch-a", false, code, ACTIVE_RESERVE).await;
    // The small client takes the reserve, up to its floor (with or without approval).
    held.push(b.admit_op("ui", true).await);
    held.push(b.admit_op("ui", false).await);
    // Now the pool is full for everyone: no fair share involved.
    assert_refused(&b, "ui", false, code, None).await;
    assert_refused(&b, "batch-b", false, code, None).await;
    let counts = b.counts().await;
    assert_eq!(counts.global.active, 10);
    assert_eq!(
        (counts.client("batch-a").active, counts.client("ui").active),
        (8, 2)
    );
    assert_eq!(b.holders().await, (2, 0));
    drop(held);
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.holders().await, (0, 0));

    // First come, first served: the same traffic locks the small client out.
    let Some(b) = start(kind, config(10, 4, None)).await else {
        return;
    };
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(b.admit_op("batch-a", false).await);
    }
    assert_refused(&b, "ui", true, code, None).await;
    drop(held);
    b.settle().await;
}

/// Two batch clients wanting more than the pool: once both hold, a slot freed by the one above
/// its share goes to the one below it, however often the first asks; at its share the second
/// stops too; a slot freed where only the reserve is left stays idle. Nothing held is taken
/// back.
async fn freed_slots_go_to_the_client_below_its_share_not_to_the_one_at_it(kind: Kind) {
    // 10 slots, 1 in reserve: a shared part of 9, a share of ⌈9 / 2⌉ = 5 once both hold.
    let Some(b) = start(kind, config(10, 10, Some(share((1, 1), (1, 1))))).await else {
        return;
    };
    let code = RefusalCode::GlobalOperationLimit;
    let mut a_ops = Vec::new();
    for _ in 0..9 {
        a_ops.push(b.admit_op("batch-a", false).await);
    }
    assert_refused(&b, "batch-a", false, code, ACTIVE_RESERVE).await;
    let mut b_ops = vec![b.admit_op("batch-b", false).await];
    assert_eq!(b.holders().await, (2, 0));
    // The first slot batch-a frees is the reserve's: neither holds less than the floor.
    a_ops.pop().unwrap().fail().await.unwrap();
    assert_refused(&b, "batch-a", false, code, ACTIVE_RESERVE).await;
    assert_refused(&b, "batch-b", false, code, ACTIVE_RESERVE).await;
    // Then each round batch-a, above its share, finishes one operation and at once asks three
    // times (it hammers); batch-b asks once, and gets the slot.
    while b_ops.len() < 4 {
        a_ops.pop().unwrap().fail().await.unwrap();
        for _ in 0..3 {
            assert_refused(&b, "batch-a", false, code, ACTIVE_SHARE).await;
        }
        b_ops.push(b.admit_op("batch-b", false).await);
        let counts = b.counts().await;
        assert_eq!(counts.global.active, 9, "the freed slot was taken");
        assert_eq!(counts.client("batch-b").active, b_ops.len() as u64);
    }
    // 5 against 4: both at or below their share, so the next freed slot is whoever's asks.
    a_ops.pop().unwrap().fail().await.unwrap();
    b_ops.push(b.admit_op("batch-b", false).await);
    // 4 against 5: now batch-b is at its share, and the freed slot is batch-a's.
    a_ops.pop().unwrap().fail().await.unwrap();
    assert_refused(&b, "batch-b", false, code, ACTIVE_SHARE).await;
    a_ops.push(b.admit_op("batch-a", false).await);
    let counts = b.counts().await;
    assert_eq!(
        (
            counts.client("batch-a").active,
            counts.client("batch-b").active
        ),
        (4, 5)
    );
    drop((a_ops, b_ops));
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.holders().await, (0, 0));
}

/// The case in the execution pool: a batch client starts until only the reserve is
/// left, and from then its starts wait and its new submissions are refused
/// `global_execution_limit` (the pool is saturated *for it*), while a client executing nothing
/// is admitted (a request that only asks for approval, too) and starts in the reserve. A slot
/// freed where only the reserve is left stays idle; one freed below the shared part goes to the
/// client below its share.
async fn the_execution_pool_is_shared_at_start_and_judged_at_admission(kind: Kind) {
    // 6 execution slots, 1 in reserve: a shared part of 5, a share of 3 once two execute.
    let Some(b) = start(kind, config(100, 6, Some(share((0, 1), (1, 1))))).await else {
        return;
    };
    let mut queued = Vec::new();
    for _ in 0..6 {
        queued.push(b.admit_op("batch-a", false).await);
    }
    let mut running = Vec::new();
    for _ in 0..5 {
        let op = queued.pop().unwrap();
        op.try_start().await.unwrap();
        running.push(op);
    }
    // Only the reserve is left: batch-a's next start waits, queued, and its submissions are
    // refused, with or without approval.
    let waiting = queued.pop().unwrap();
    let saturated = |started: Result<(), NotStarted>| matches!(started, Err(NotStarted::Saturated(r)) if r.code == RefusalCode::GlobalExecutionLimit);
    assert!(saturated(waiting.try_start().await));
    let code = RefusalCode::GlobalExecutionLimit;
    assert_refused(&b, "batch-a", false, code, EXECUTING_RESERVE).await;
    assert_refused(&b, "batch-a", true, code, EXECUTING_RESERVE).await;
    // The interactive client executing nothing: admitted, and its work starts in the reserve.
    let request = b.admit_op("ui", true).await;
    let ui = b.admit_op("ui", false).await;
    let ui_next = b.admit_op("ui", false).await;
    ui.try_start().await.unwrap();
    assert_eq!(b.counts().await.global.executing, 6);
    assert_eq!(b.holders().await, (2, 2));
    // batch-a finishes one: 5 of 6 execute, the shared part is full, and neither client is
    // below the floor: the freed slot stays idle.
    running.pop().unwrap().succeed().await.unwrap();
    assert!(saturated(waiting.try_start().await));
    assert!(saturated(ui_next.try_start().await));
    assert_refused(&b, "batch-a", false, code, EXECUTING_RESERVE).await;
    // batch-a finishes another: it holds 3, its share; ui holds 1, below it, and takes the slot.
    running.pop().unwrap().succeed().await.unwrap();
    assert!(saturated(waiting.try_start().await));
    assert_refused(&b, "batch-a", false, code, EXECUTING_SHARE).await;
    ui_next.try_start().await.unwrap();
    let counts = b.counts().await;
    assert_eq!(
        (
            counts.global.executing,
            counts.client("batch-a").executing,
            counts.client("ui").executing
        ),
        (5, 3, 2)
    );
    drop((queued, running, waiting, request, ui, ui_next));
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.holders().await, (0, 0));
}

/// A reload turns the fair share on over counts it did not make (a batch client holding the
/// whole pool), off again, and changes it: every count and holder stays as it was, nothing
/// held is taken back, and each decision after a reload follows the rule then in force.
async fn a_reload_turns_fair_share_on_and_off_keeping_every_count(kind: Kind) {
    let Some(b) = start(kind, config(10, 10, None)).await else {
        return;
    };
    let code = RefusalCode::GlobalOperationLimit;
    let mut a_ops = Vec::new();
    for _ in 0..10 {
        a_ops.push(b.admit_op("batch-a", false).await);
    }
    let before = b.counts().await;
    b.reload(config(10, 10, Some(share((2, 1), (1, 1)))));
    assert_eq!(b.counts().await, before, "a reload keeps every count");
    assert_eq!(b.holders().await, (1, 0));
    assert_refused(&b, "ui", false, code, None).await;
    // Three finish: the shared part (8) has one slot for batch-a, the reserve is ui's.
    for _ in 0..3 {
        a_ops.pop().unwrap().fail().await.unwrap();
    }
    a_ops.push(b.admit_op("batch-a", false).await);
    assert_refused(&b, "batch-a", false, code, ACTIVE_RESERVE).await;
    let ui = b.admit_op("ui", false).await;
    assert_eq!(b.holders().await, (2, 0));
    // Off again: first come, first served, over the same counts.
    b.reload(config(10, 10, None));
    assert_eq!(b.holders().await, (2, 0));
    a_ops.push(b.admit_op("batch-a", false).await);
    assert_eq!(b.counts().await.global.active, 10);
    // Changed (a larger reserve) while the pool is full: batch-a, above everything, waits.
    b.reload(config(10, 10, Some(share((5, 1), (1, 1)))));
    for _ in 0..2 {
        a_ops.pop().unwrap().fail().await.unwrap();
    }
    assert_refused(&b, "batch-a", false, code, ACTIVE_RESERVE).await;
    let counts = b.counts().await;
    assert_eq!(
        (
            counts.global.active,
            counts.client("batch-a").active,
            counts.client("ui").active
        ),
        (8, 7, 1)
    );
    drop((a_ops, ui));
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.holders().await, (0, 0));
}

/// Every refusal a fair share makes is counted by pool and reason (on a replica, from the
/// script's reply), and under its pool's code; one a full pool makes is not.
async fn fair_share_refusals_are_counted_by_pool_and_reason(kind: Kind) {
    // Active: 6 slots, 1 in reserve (a shared part of 5). Executing: 2, 1 in reserve.
    let Some(b) = start(kind, config(6, 2, Some(share((1, 1), (1, 1))))).await else {
        return;
    };
    let active_code = RefusalCode::GlobalOperationLimit;
    let executing_code = RefusalCode::GlobalExecutionLimit;
    // batch-a takes the shared part; the reserve refuses it, twice.
    let mut a_ops = Vec::new();
    for _ in 0..5 {
        a_ops.push(b.admit_op("batch-a", false).await);
    }
    for _ in 0..2 {
        assert_refused(&b, "batch-a", false, active_code, ACTIVE_RESERVE).await;
    }
    // batch-b takes the reserve; then the pool is full for both (not the fair share's doing).
    let b_op = b.admit_op("batch-b", false).await;
    assert_refused(&b, "batch-b", false, active_code, None).await;
    // Two of batch-a's finish: 3 of its 4 against a share of ⌈5 / 2⌉ = 3 refuses it.
    for _ in 0..2 {
        a_ops.pop().unwrap().fail().await.unwrap();
    }
    assert_refused(&b, "batch-a", false, active_code, ACTIVE_SHARE).await;
    // batch-b starts its operation: the execution pool's reserve refuses its next submission;
    // batch-a starts one: the pool is full for anyone.
    b_op.try_start().await.unwrap();
    assert_refused(&b, "batch-b", false, executing_code, EXECUTING_RESERVE).await;
    a_ops[0].try_start().await.unwrap();
    assert_refused(&b, "batch-b", false, executing_code, None).await;
    let mut want = [0; 4];
    want[FairShareRefusal::new(Pool::Active, FairShareReason::Reserve).index()] = 2;
    want[FairShareRefusal::new(Pool::Active, FairShareReason::Share).index()] = 1;
    want[FairShareRefusal::new(Pool::Executing, FairShareReason::Reserve).index()] = 1;
    assert_eq!(b.fair_share_refusals(), want);
    // Each under its pool's code too, beside the full pools' refusals.
    let s = b.admission.snapshot();
    assert_eq!(s.rejected(active_code), 4);
    assert_eq!(s.rejected(executing_code), 2);
    let exposition = unyolo_admission::metrics::render(b.admission.controller());
    for (pool, reason, n) in [
        ("active", "reserve", 2),
        ("active", "share", 1),
        ("executing", "reserve", 1),
        ("executing", "share", 0),
    ] {
        let line = format!(
            "admission_fair_share_refusals_total{{pool=\"{pool}\",reason=\"{reason}\"}} {n}"
        );
        assert!(exposition.contains(&line), "{line} in\n{exposition}");
    }
    drop((a_ops, b_op));
    b.settle().await;
    assert!(b.counts().await.is_idle());
}

/// On Redis, a decision with a fair share is still one script call: an admission refused by
/// the share, an admitted one, and a start each cost exactly one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_fair_share_decision_is_one_script_call() {
    use support::redis::{RedisServer, script_calls, warm};
    use unyolo_admission::Controller;
    use unyolo_admission::admission::{Admission, ReplicaOptions};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let config = config(4, 2, Some(share((1, 1), (1, 1))));
    let mut options = ReplicaOptions::new(format!("redis://127.0.0.1:{}/", server.port), "r1");
    options.replicas = vec!["r1".to_owned()];
    options.refusal_memory = false;
    options.call_timeout = Duration::from_secs(5);
    options.lease_ttl = Duration::from_secs(60);
    options.heartbeat = Duration::from_secs(20);
    let admission = Admission::new(Controller::new(config), Some(options)).unwrap();
    assert!(admission.restore(Vec::new()).await.deferred.is_none());
    warm(&admission, "batch-a").await;
    let mut ops = Vec::new();
    for _ in 0..3 {
        let before = script_calls(server.port);
        ops.push(
            admission
                .admit("batch-a", false, None)
                .await
                .unwrap()
                .commit(),
        );
        assert_eq!(script_calls(server.port), before + 1, "an admission");
    }
    let before = script_calls(server.port);
    let refused = admission.admit("batch-a", false, None).await.unwrap_err();
    assert_eq!(script_calls(server.port), before + 1, "a refusal");
    assert!(
        matches!(refused, unyolo_admission::AdmitError::Refused(r) if r.fair_share == ACTIVE_RESERVE)
    );
    let before = script_calls(server.port);
    ops[0].try_start().await.unwrap();
    assert_eq!(script_calls(server.port), before + 1, "a start");
    for op in ops {
        op.fail().await.unwrap();
    }
    assert!(admission.counts().await.unwrap().is_idle());
}

/// A shadow file and a history replay (`admission check --history`) judge a candidate's fair
/// share as the engine they are built on decides it: where the real, first-come file admits a
/// batch client into the reserve, the candidate refuses it, and still admits the small client.
#[test]
fn a_shadow_and_a_history_replay_judge_the_fair_share_like_any_limit() {
    use std::time::{Duration, SystemTime};
    use unyolo_admission::Controller;
    use unyolo_admission::admission::{Shadow, ShadowVerdict, StoredOperation};
    let candidate = config(10, 4, Some(share((2, 2), (1, 1))));
    let shadow = Shadow::new(Controller::new(candidate.clone()));
    let now = SystemTime::now();
    let mut held = Vec::new();
    for _ in 0..8 {
        match shadow.judge("batch-a", true, now) {
            ShadowVerdict::Admitted(permit) => held.push(permit.commit()),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(
        shadow.judge("batch-a", true, now),
        ShadowVerdict::Refused {
            code: RefusalCode::GlobalOperationLimit,
            first: true
        }
    ));
    assert!(matches!(
        shadow.judge("ui", true, now),
        ShadowVerdict::Admitted(_)
    ));
    assert_eq!(
        shadow.engine().snapshot().fair_share_refusals,
        [1, 0, 0, 0],
        "the shadow engine counts it by pool and reason"
    );
    // The same traffic as stored history: nine requests of batch-a awaiting approval, then one
    // of ui's. First come, first served admits all; the candidate refuses batch-a's ninth.
    let at = |s: u64| now + Duration::from_secs(s);
    let request = |client: &str, s| StoredOperation {
        client: client.to_owned(),
        needs_approval: true,
        created_at: at(s),
        approved_at: None,
        ended_at: None,
    };
    let mut history: Vec<StoredOperation> = (0..9).map(|s| request("batch-a", s)).collect();
    history.push(request("ui", 9));
    assert!(
        Shadow::replay(config(10, 4, None), &history)
            .refusals
            .is_empty()
    );
    let refusals = Shadow::replay(candidate, &history).refusals;
    assert_eq!(refusals.len(), 1, "{refusals:?}");
    assert_eq!(
        (
            refusals[0].client.as_str(),
            refusals[0].code,
            refusals[0].at
        ),
        ("batch-a", RefusalCode::GlobalOperationLimit, at(8))
    );
}
