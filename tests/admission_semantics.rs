//! SPEC section 2, written once and run against both backends (section 7: the same contract):
//! the decision (identities, the rate, the client and global limits, their order, Retry-After,
//! quotas on answers) and the permit here; the lifecycle, restores and reloads in
//! `admission_lifecycle.rs`.
//! `in_process::*` on the library's `Controller` with a manual clock, `redis::*` on the
//! Redis-backed controller against a real `redis-server` (one per test process, each test under
//! its own key prefix). What only the in-process engine can show (a clock that steps, metrics,
//! storage quotas, config files) stays in `engine_semantics.rs`.
//!
//! Time: Redis decides on its own clock, which no test can move, so the rate tests use windows
//! long enough (an hour, a day) that no token comes back while a test runs, and a rate wait is
//! exact in-process and bounded by the time that passed on Redis.

mod support;

use std::time::Duration;

use support::semantics::{self as semantics_support, Backend, Kind};
use support::semantics::{HOUR, config, global, limits, one_client, one_client_config};
use unyolo_admission::{Limits, OperationState, RefusalCode, StorageCaps};

semantic_tests! {
    unknown_identity_is_refused_as_unconfigured_with_403,
    rate_is_checked_before_client_active,
    client_active_limit_refuses_with_the_capacity_hint,
    every_answer_carries_the_quota_the_deciding_backend_left,
    pending_limit_only_applies_to_work_needing_approval,
    pending_grant_store_cap_binds_before_a_larger_client_pending,
    global_pending_grant_cap_is_shared_by_all_clients,
    global_active_limit_is_shared_by_all_clients,
    saturated_execution_pool_refuses_new_work,
    capacity_checks_run_in_the_contracts_order_when_several_are_exhausted,
    every_refusal_consumes_no_token_and_no_slot,
    retry_after_is_the_largest_hint_among_exhausted_dimensions,
    dropped_permit_returns_slots_but_keeps_the_token_spent,
    refunded_permit_returns_slots_and_the_token,
}

async fn unknown_identity_is_refused_as_unconfigured_with_403(kind: Kind) {
    let Some(b) = one_client(kind, 5, 60, 5, 5).await else {
        return;
    };
    for needs_approval in [false, true] {
        let refusal = b.refusal("stranger", needs_approval).await;
        assert_eq!(refusal.code, RefusalCode::ClientUnconfigured);
        assert_eq!(refusal.code.http_status(), 403);
        assert_eq!(refusal.retry_after, Duration::ZERO, "retrying cannot help");
    }
    assert!(
        b.counts().await.is_idle(),
        "an unknown identity holds nothing"
    );
    if let Some(c) = b.in_process() {
        assert!(
            c.snapshot().client("stranger").is_none(),
            "no state is created from traffic"
        );
        assert_eq!(c.snapshot().rejected(RefusalCode::ClientUnconfigured), 2);
    }
}

async fn rate_is_checked_before_client_active(kind: Kind) {
    let Some(b) = one_client(kind, 1, 60, 1, 1).await else {
        return;
    };
    let _op = b.admit_op("bot", false).await;
    let refusal = b.refusal("bot", false).await;
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    // Both are exhausted: the largest hint is the rate wait (a minute), not the 2 s capacity hint.
    b.assert_rate_wait(&refusal, Duration::from_secs(60));
}

async fn client_active_limit_refuses_with_the_capacity_hint(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 2, 2).await else {
        return;
    };
    let _a = b.admit_op("bot", false).await;
    let _b = b.admit_op("bot", false).await;
    let refusal = b.refusal("bot", false).await;
    assert_eq!(refusal.code, RefusalCode::ClientOperationLimit);
    assert_eq!(refusal.retry_after, Duration::from_secs(2));
    assert_eq!(refusal.code.http_status(), 429);
    assert!(
        b.admit("other", false).await.is_ok(),
        "one client's limit is its own"
    );
}

/// The quota fields of an answer (`RateLimit`, the JSON quota) come with the decision on either
/// backend, so an embedder writes `answer_429(refused.refusal, refused.quota)` once.
async fn every_answer_carries_the_quota_the_deciding_backend_left(kind: Kind) {
    let Some(b) = one_client(kind, 3, HOUR, 2, 2).await else {
        return;
    };
    let first = b
        .admission
        .admit("bot", true, None)
        .await
        .expect("admitted");
    let q = first.quota().expect("a permit carries the quota");
    assert_eq!((q.rate.quota, q.rate.window_seconds), (3, HOUR));
    assert_eq!(q.rate.remaining, 2);
    assert_eq!((q.active.used, q.active.limit), (1, 2));
    assert_eq!((q.pending.used, q.pending.limit), (1, 2));
    let _first = first.commit();
    let second = b
        .admission
        .admit("bot", false, None)
        .await
        .expect("admitted");
    let q = second.quota().expect("a permit carries the quota");
    assert_eq!(q.rate.remaining, 1);
    assert_eq!((q.active.used, q.pending.used), (2, 1));
    let _second = second.commit();
    let Err(unyolo_admission::AdmitError::Refused(refused)) =
        b.admission.admit("bot", false, None).await
    else {
        panic!("the third is over the active limit")
    };
    assert_eq!(refused.refusal.code, RefusalCode::ClientOperationLimit);
    let q = refused.quota.expect("a refusal carries the quota");
    assert_eq!(q.rate.remaining, 1, "a refusal spends no token");
    assert_eq!((q.active.used, q.active.limit), (2, 2));
    let Err(unyolo_admission::AdmitError::Refused(stranger)) =
        b.admission.admit("stranger", false, None).await
    else {
        panic!("a stranger is refused")
    };
    assert_eq!(
        stranger.quota, None,
        "no quota for an identity that has none"
    );
}

async fn pending_limit_only_applies_to_work_needing_approval(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 1).await else {
        return;
    };
    let _p = b.admit_op("bot", true).await;
    let refusal = b.refusal("bot", true).await;
    assert_eq!(refusal.code, RefusalCode::ClientPendingLimit);
    assert_eq!(refusal.retry_after, Duration::from_secs(2));
    let run = b.admit_op("bot", false).await;
    assert_eq!(run.state(), OperationState::Approved);
    assert_eq!(b.counts().await.client("bot").all(), (2, 1, 1, 0));
}

async fn pending_grant_store_cap_binds_before_a_larger_client_pending(kind: Kind) {
    // The client may have 12 pending, but the grant store holds 10 per client.
    let Some(b) = one_client(kind, 100, HOUR, 20, 12).await else {
        return;
    };
    let mut ops = Vec::new();
    for _ in 0..10 {
        ops.push(b.admit_op("bot", true).await);
    }
    let refusal = b.refusal("bot", true).await;
    assert_eq!(refusal.code, RefusalCode::PendingGrantLimit);
    assert_eq!(refusal.retry_after, Duration::from_secs(2));
    assert_eq!(b.counts().await.client("bot").pending, 10);
}

async fn global_pending_grant_cap_is_shared_by_all_clients(kind: Kind) {
    let caps = StorageCaps {
        grant_global: 2,
        ..StorageCaps::default()
    };
    let Some(b) = kind
        .with(config(Limits::DEFAULT, &[], &["a", "b"]))
        .caps(caps)
        .start()
        .await
    else {
        return;
    };
    let _a = b.admit_op("a", true).await;
    let _b = b.admit_op("b", true).await;
    assert_eq!(
        b.refusal("a", true).await.code,
        RefusalCode::PendingGrantLimit
    );
    assert!(
        b.admit("a", false).await.is_ok(),
        "work that needs no approval is not a grant"
    );
}

async fn global_active_limit_is_shared_by_all_clients(kind: Kind) {
    let Some(b) = kind
        .with(config(global(25, 10), &[], &["a", "b"]))
        .start()
        .await
    else {
        return;
    };
    let mut ops = Vec::new();
    for i in 0..25 {
        ops.push(b.admit_op(if i % 2 == 0 { "a" } else { "b" }, false).await);
    }
    let refusal = b.refusal("b", false).await;
    assert_eq!(refusal.code, RefusalCode::GlobalOperationLimit);
    assert_eq!(refusal.retry_after, Duration::from_secs(2));
    assert_eq!(b.counts().await.global.active, 25);
    drop(ops);
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert!(b.admit("b", false).await.is_ok());
}

async fn saturated_execution_pool_refuses_new_work(kind: Kind) {
    let Some(b) = kind.with(config(global(512, 1), &[], &["a"])).start().await else {
        return;
    };
    let running = b.admit_op("a", false).await;
    running.try_start().await.unwrap();
    for needs_approval in [false, true] {
        let refusal = b.refusal("a", needs_approval).await;
        assert_eq!(refusal.code, RefusalCode::GlobalExecutionLimit);
        assert_eq!(refusal.retry_after, Duration::from_secs(2));
    }
    running.succeed().await.unwrap();
    assert!(b.admit("a", false).await.is_ok());
}

/// Every capacity dimension exhausted at once (restored work may exceed limits), then freed one
/// at a time from the front: each refusal names the first that still fails.
async fn capacity_checks_run_in_the_contracts_order_when_several_are_exhausted(kind: Kind) {
    let caps = StorageCaps {
        grant_global: 1,
        ..StorageCaps::default()
    };
    let Some(b) = kind
        .with(config(
            global(2, 1),
            &[("bot", limits(10, HOUR, 2, 1))],
            &["bot", "other"],
        ))
        .caps(caps)
        .start()
        .await
    else {
        return;
    };
    use OperationState::{Approved, Executing, Pending};
    let restored = b
        .restore(&[
            ("bot", Pending),
            ("bot", Approved),
            ("other", Pending),
            ("other", Executing),
        ])
        .await;
    let [
        Some(bot_pending),
        Some(bot_approved),
        Some(other_pending),
        Some(other_executing),
    ] = <[_; 4]>::try_from(restored).unwrap()
    else {
        panic!("every live operation is restored");
    };
    let expect = |code: RefusalCode, approval: bool| {
        let b = &b;
        async move {
            let refusal = b.refusal("bot", approval).await;
            assert_eq!(refusal.code, code, "needs approval: {approval}");
            assert_eq!(refusal.retry_after, Duration::from_secs(2), "{code}");
        }
    };
    expect(RefusalCode::ClientOperationLimit, true).await;
    expect(RefusalCode::ClientOperationLimit, false).await;
    bot_approved.fail().await.unwrap();
    expect(RefusalCode::ClientPendingLimit, true).await;
    expect(RefusalCode::GlobalOperationLimit, false).await;
    bot_pending.deny().await.unwrap();
    expect(RefusalCode::PendingGrantLimit, true).await;
    other_pending.approve().await.unwrap();
    expect(RefusalCode::GlobalOperationLimit, true).await;
    other_pending.fail().await.unwrap();
    expect(RefusalCode::GlobalExecutionLimit, true).await;
    expect(RefusalCode::GlobalExecutionLimit, false).await;
    other_executing.succeed().await.unwrap();
    assert!(b.counts().await.is_idle());
    let op = b.admit_op("bot", true).await;
    assert_eq!(op.state(), Pending);
}

/// One scenario of `every_refusal_consumes_no_token_and_no_slot`: a backend with the dimension
/// that refuses with `code` exhausted for `bot`, the operations exhausting it, whether `bot`'s
/// next submission needs approval, and how many tokens `bot` has left.
async fn exhausted(
    kind: Kind,
    code: RefusalCode,
) -> Option<(Backend, Vec<semantics_support::AnyOperation>, bool, u64)> {
    Some(match code {
        RefusalCode::SubmissionRateLimited => {
            let b = one_client(kind, 1, HOUR, 5, 5).await?;
            let ops = vec![b.admit_op("bot", false).await];
            (b, ops, false, 0)
        }
        RefusalCode::ClientOperationLimit => {
            let b = one_client(kind, 10, HOUR, 1, 1).await?;
            let ops = vec![b.admit_op("bot", false).await];
            (b, ops, true, 9)
        }
        RefusalCode::ClientPendingLimit => {
            let b = one_client(kind, 10, HOUR, 5, 1).await?;
            let ops = vec![b.admit_op("bot", true).await];
            (b, ops, true, 9)
        }
        RefusalCode::GlobalOperationLimit => {
            let b = kind
                .with(config(
                    global(1, 1),
                    &[("bot", limits(10, HOUR, 1, 1))],
                    &["bot", "other"],
                ))
                .start()
                .await?;
            let ops = vec![b.admit_op("other", false).await];
            (b, ops, true, 10)
        }
        RefusalCode::GlobalExecutionLimit => {
            let b = kind
                .with(config(
                    global(10, 1),
                    &[("bot", limits(10, HOUR, 5, 5))],
                    &["bot", "other"],
                ))
                .start()
                .await?;
            let op = b.admit_op("other", false).await;
            op.try_start().await.unwrap();
            (b, vec![op], true, 10)
        }
        other => unreachable!("no scenario for {other}"),
    })
}

async fn every_refusal_consumes_no_token_and_no_slot(kind: Kind) {
    for code in [
        RefusalCode::SubmissionRateLimited,
        RefusalCode::ClientOperationLimit,
        RefusalCode::ClientPendingLimit,
        RefusalCode::GlobalOperationLimit,
        RefusalCode::GlobalExecutionLimit,
    ] {
        let Some((b, ops, approval, tokens)) = exhausted(kind, code).await else {
            return;
        };
        let tokens_now = |b: &Backend| {
            b.in_process().map(|c| {
                c.snapshot()
                    .clients
                    .iter()
                    .map(|c| (c.identity.to_string(), c.tokens))
                    .collect::<Vec<_>>()
            })
        };
        let before = (b.counts().await, tokens_now(&b));
        for _ in 0..3 {
            assert_eq!(b.refusal("bot", approval).await.code, code);
        }
        assert_eq!(
            (b.counts().await, tokens_now(&b)),
            before,
            "{code} changed a count or a bucket"
        );
        // Freed, bot still has every token it had before the refusals.
        for op in &ops {
            op.fail().await.unwrap();
        }
        assert!(b.counts().await.is_idle(), "{code}");
        assert_eq!(
            b.spend_all_tokens("bot").await,
            tokens,
            "{code} took a token"
        );
    }
}

async fn retry_after_is_the_largest_hint_among_exhausted_dimensions(kind: Kind) {
    // The rate wait (five minutes) is shorter than this controller's capacity hint (ten): with
    // active full too, the capacity hint wins. (The other way round: see
    // `rate_is_checked_before_client_active`.)
    let Some(b) = kind
        .with(one_client_config(1, 300, 1, 1))
        .capacity_retry(Duration::from_secs(600))
        .start()
        .await
    else {
        return;
    };
    let _op = b.admit_op("bot", false).await;
    let refusal = b.refusal("bot", false).await;
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    assert_eq!(refusal.retry_after, Duration::from_secs(600));
}

async fn dropped_permit_returns_slots_but_keeps_the_token_spent(kind: Kind) {
    let Some(b) = one_client(kind, 2, HOUR, 1, 1).await else {
        return;
    };
    drop(b.admit("bot", true).await.unwrap());
    b.settle().await;
    assert!(b.counts().await.is_idle());
    if let Some(c) = b.in_process() {
        assert_eq!(c.snapshot().dropped_permits, 1);
    }
    assert_eq!(b.spend_all_tokens("bot").await, 1);
}

async fn refunded_permit_returns_slots_and_the_token(kind: Kind) {
    let Some(b) = one_client(kind, 2, HOUR, 1, 1).await else {
        return;
    };
    b.admit("bot", true).await.unwrap().refund().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.spend_all_tokens("bot").await, 2);
}
