//! SPEC section 2, written once and run against both backends (section 7: the same contract),
//! the second half of `admission_semantics.rs`: the lifecycle (moves, forbidden moves, releases
//! exactly once, races), restores, and reloads.
//! `in_process::*` on the library's `Controller` with a manual clock, `redis::*` on the
//! Redis-backed controller against a real `redis-server` (one per test process, each test under
//! its own key prefix). What only the in-process engine can show (a clock that steps, metrics,
//! storage quotas, config files) stays in `engine_semantics.rs`.
//!
//! Time: Redis decides on its own clock, which no test can move, so the rate tests use windows
//! long enough (an hour, a day) that no token comes back while a test runs, and a rate wait is
//! exact in-process and bounded by the time that passed on Redis.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::semantics::Kind;
use support::semantics::{DAY, HOUR, config, global, limits, one_client, one_client_config};
use unyolo_admission::NotStarted;
use unyolo_admission::{CancelOutcome, Limits, OperationState, RefusalCode, TransitionError};

semantic_tests! {
    a_handed_over_operation_is_let_go_here_and_released_nowhere,
    lifecycle_moves_counts_between_pending_queued_and_executing,
    transitions_the_contract_forbids_are_refused_and_change_nothing,
    terminal_transitions_release_exactly_once_whatever_the_repetition,
    cancel_reports_the_state_it_left_and_changes_nothing_once_terminal,
    dropped_operation_handles_release_their_slots_as_if_failed,
    cancel_racing_approve_releases_once,
    cancel_racing_start_releases_the_execution_slot_once,
    starting_without_a_free_slot_leaves_the_operation_queued,
    restored_work_counts_even_above_a_lowered_limit,
    restore_of_an_unconfigured_identity_counts_globally_but_admits_nothing,
    reload_keeps_counts_and_scales_the_bucket_fill,
    reload_rescales_a_bucket_to_a_new_window_without_a_fresh_burst_or_confiscation,
    removed_identity_is_refused_but_its_live_work_still_releases,
    identity_removed_idle_with_tokens_spent_and_added_back_gets_no_fresh_burst,
    reload_lowering_global_limits_below_usage_refuses_until_it_drains,
    rate_wait_after_a_reload_is_one_interval_of_the_new_rate,
    refund_after_a_reload_that_changed_the_rate_returns_exactly_the_token_taken,
}

async fn lifecycle_moves_counts_between_pending_queued_and_executing(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    let op = b.admit_op("bot", true).await;
    assert_eq!(op.state(), OperationState::Pending);
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (1, 1, 0, 0));
    assert_eq!(counts.client("bot").all(), (1, 1, 0, 0));
    op.approve().await.unwrap();
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (1, 0, 1, 0));
    assert_eq!(counts.client("bot").all(), (1, 0, 1, 0));
    op.try_start().await.unwrap();
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (1, 0, 0, 1));
    assert_eq!(counts.client("bot").all(), (1, 0, 0, 1));
    assert_eq!(
        op.cancel().await,
        Err(TransitionError {
            from: OperationState::Executing,
            to: OperationState::Canceled
        })
    );
    op.succeed().await.unwrap();
    assert!(b.counts().await.is_idle());
    assert_eq!(op.state(), OperationState::Succeeded);
}

async fn transitions_the_contract_forbids_are_refused_and_change_nothing(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    use OperationState::{Approved, Denied, Executing, Pending, Succeeded};
    let pending = b.admit_op("bot", true).await;
    let approved = b.admit_op("bot", false).await;
    let running = b.admit_op("bot", false).await;
    running.try_start().await.unwrap();
    let before = b.counts().await;
    let refused = |from, to| Err(TransitionError { from, to });
    assert_eq!(pending.succeed().await, refused(Pending, Succeeded));
    assert_eq!(
        pending.try_start().await,
        Err(NotStarted::NotApproved(Pending))
    );
    assert_eq!(approved.approve().await, refused(Approved, Approved));
    assert_eq!(approved.deny().await, refused(Approved, Denied));
    assert_eq!(approved.succeed().await, refused(Approved, Succeeded));
    assert_eq!(running.approve().await, refused(Executing, Approved));
    assert_eq!(
        running.expire().await,
        refused(Executing, OperationState::Expired)
    );
    assert_eq!(
        running.try_start().await,
        Err(NotStarted::NotApproved(Executing))
    );
    assert_eq!(
        b.counts().await,
        before,
        "a refused transition moves nothing"
    );
    assert_eq!(
        (pending.state(), approved.state(), running.state()),
        (Pending, Approved, Executing)
    );
}

async fn terminal_transitions_release_exactly_once_whatever_the_repetition(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    let op = b.admit_op("bot", true).await;
    let keep = b.admit_op("bot", true).await;
    op.deny().await.unwrap();
    assert!(op.deny().await.is_err(), "a second deny is refused");
    assert_eq!(
        op.cancel().await,
        Ok(CancelOutcome::AlreadyTerminal(OperationState::Denied)),
        "cancel of a terminal operation changes nothing"
    );
    assert!(op.fail().await.is_err());
    assert!(op.expire().await.is_err());
    drop(op);
    b.settle().await;
    let counts = b.counts().await;
    assert_eq!(
        (counts.global.active, counts.global.pending),
        (1, 1),
        "only the other operation is still counted"
    );
    assert_eq!(counts.client("bot").all(), (1, 1, 0, 0));
    drop(keep);
    b.settle().await;
    assert!(b.counts().await.is_idle());
}

async fn cancel_reports_the_state_it_left_and_changes_nothing_once_terminal(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    let pending = b.admit_op("bot", true).await;
    let approved = b.admit_op("bot", false).await;
    let done = b.admit_op("bot", false).await;
    done.try_start().await.unwrap();
    done.succeed().await.unwrap();
    assert_eq!(
        pending.cancel().await,
        Ok(CancelOutcome::Canceled {
            from: OperationState::Pending
        })
    );
    assert_eq!(b.counts().await.global.all(), (1, 0, 1, 0));
    assert_eq!(
        approved.cancel().await,
        Ok(CancelOutcome::Canceled {
            from: OperationState::Approved
        })
    );
    assert!(b.counts().await.is_idle());
    for (op, state) in [
        (&pending, OperationState::Canceled),
        (&approved, OperationState::Canceled),
        (&done, OperationState::Succeeded),
    ] {
        assert_eq!(op.cancel().await, Ok(CancelOutcome::AlreadyTerminal(state)));
        assert_eq!(op.state(), state);
    }
    assert!(b.counts().await.is_idle(), "counts never underflow");
    // Nothing was released twice: a full client's worth can still be admitted, and no more.
    let mut ops = Vec::new();
    for _ in 0..5 {
        ops.push(b.admit_op("bot", false).await);
    }
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientOperationLimit
    );
}

async fn dropped_operation_handles_release_their_slots_as_if_failed(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    let pending = b.admit_op("bot", true).await;
    let approved = b.admit_op("bot", false).await;
    let running = b.admit_op("other", false).await;
    running.try_start().await.unwrap();
    let kept = b.admit_op("other", true).await;
    drop((pending, approved, running));
    b.settle().await;
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (1, 1, 0, 0), "{counts:?}");
    assert_eq!(counts.client("other").all(), (1, 1, 0, 0));
    if let Some(c) = b.in_process() {
        assert_eq!(c.snapshot().dropped_operations, 3);
    }
    kept.expire().await.unwrap();
    assert!(b.counts().await.is_idle());
}

/// What a replica does with work another replica took over (SPEC section 9): its handle lets go
/// here, and the shared store is told nothing, since it now counts the work as the other
/// replica's (a release by the operation's id would free what that replica holds).
async fn a_handed_over_operation_is_let_go_here_and_released_nowhere(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 5, 5).await else {
        return;
    };
    let taken = b.admit_op("bot", true).await;
    let kept = b.admit_op("bot", false).await;
    assert!(taken.hand_over());
    assert!(!taken.hand_over(), "handed over once");
    assert_eq!(
        taken.approve().await,
        Err(TransitionError {
            from: OperationState::Failed,
            to: OperationState::Approved
        })
    );
    drop(taken);
    b.settle().await;
    let mut counts = b.counts().await;
    if b.kind() == Kind::Redis {
        // Nothing was sent: Redis counts it still, and only a count of this replica's holdings
        // taken again (a re-registration, a heal) leaves it out.
        assert_eq!(counts.client("bot").all(), (2, 1, 1, 0), "{counts:?}");
        b.admission.recount_shared().await.unwrap();
        counts = b.counts().await;
    }
    assert_eq!(counts.client("bot").all(), (1, 0, 1, 0), "{counts:?}");
    if let Some(c) = b.in_process() {
        assert_eq!(c.snapshot().dropped_operations, 0, "not dropped live");
    }
    kept.fail().await.unwrap();
    b.settle().await;
    assert!(b.counts().await.is_idle());
}

async fn cancel_racing_approve_releases_once(kind: Kind) {
    let Some(b) = one_client(kind, 100_000, 60, 5, 5).await else {
        return;
    };
    for round in 0..200 {
        let op = Arc::new(b.admit_op("bot", true).await);
        let racer = Arc::clone(&op);
        let approve = tokio::spawn(async move { racer.approve().await });
        let canceled = op.cancel().await;
        let approved = approve.await.unwrap();
        match canceled {
            Ok(CancelOutcome::Canceled { from }) => assert_eq!(
                from == OperationState::Approved,
                approved.is_ok(),
                "round {round}: cancel left {from} but approve said {approved:?}"
            ),
            other => panic!("round {round}: cancel succeeds from pending or approved: {other:?}"),
        }
        assert_eq!(op.state(), OperationState::Canceled);
        assert!(b.counts().await.is_idle(), "round {round}");
    }
}

async fn cancel_racing_start_releases_the_execution_slot_once(kind: Kind) {
    let config = config(global(10, 1), &[("a", limits(100_000, 60, 5, 5))], &["a"]);
    let Some(b) = kind.with(config).start().await else {
        return;
    };
    for round in 0..200 {
        let op = Arc::new(b.admit_op("a", false).await);
        let racer = Arc::clone(&op);
        let start = tokio::spawn(async move { racer.try_start().await });
        let canceled = op.cancel().await;
        let started = start.await.unwrap();
        match (canceled, started) {
            (Ok(CancelOutcome::Canceled { from }), Err(NotStarted::NotApproved(state))) => {
                assert_eq!(
                    (from, state),
                    (OperationState::Approved, OperationState::Canceled),
                    "round {round}"
                );
            }
            (Err(refused), Ok(())) => {
                assert_eq!(refused.from, OperationState::Executing, "round {round}");
                assert_eq!(b.counts().await.global.all(), (1, 0, 0, 1), "round {round}");
                op.succeed().await.unwrap();
            }
            other => panic!("round {round}: exactly one of cancel and start wins: {other:?}"),
        }
        assert!(op.state().is_terminal());
        assert!(b.counts().await.is_idle(), "round {round}");
    }
    // The one execution slot is free: nothing kept it.
    let last = b.admit_op("a", false).await;
    last.try_start().await.unwrap();
    last.succeed().await.unwrap();
}

async fn starting_without_a_free_slot_leaves_the_operation_queued(kind: Kind) {
    let Some(b) = kind.with(config(global(10, 1), &[], &["a"])).start().await else {
        return;
    };
    let first = b.admit_op("a", false).await;
    let second = b.admit_op("a", false).await;
    first.try_start().await.unwrap();
    match second.try_start().await {
        Err(NotStarted::Saturated(r)) => {
            assert_eq!(r.code, RefusalCode::GlobalExecutionLimit);
            assert_eq!(r.retry_after, Duration::from_secs(2));
        }
        other => panic!("expected saturation, got {other:?}"),
    }
    assert_eq!(second.state(), OperationState::Approved);
    assert_eq!(b.counts().await.global.all(), (2, 0, 1, 1));
    first.fail().await.unwrap();
    second.try_start().await.unwrap();
    second.cancel().await.unwrap_err();
    second.succeed().await.unwrap();
    assert!(b.counts().await.is_idle());
}

async fn restored_work_counts_even_above_a_lowered_limit(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 2, 2).await else {
        return;
    };
    let restored = b
        .restore(&[
            ("bot", OperationState::Pending),
            ("bot", OperationState::Pending),
            ("bot", OperationState::Pending),
            ("bot", OperationState::Succeeded),
        ])
        .await;
    assert!(
        restored[3].is_none(),
        "a terminal operation restores nothing"
    );
    let restored: Vec<_> = restored.into_iter().take(3).map(Option::unwrap).collect();
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (3, 3, 0, 0));
    assert_eq!(counts.client("bot").all(), (3, 3, 0, 0));
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientOperationLimit
    );
    restored[0].deny().await.unwrap();
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientOperationLimit,
        "still at the limit of 2"
    );
    restored[1].cancel().await.unwrap();
    assert!(b.admit("bot", false).await.is_ok());
}

async fn restore_of_an_unconfigured_identity_counts_globally_but_admits_nothing(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 2, 2).await else {
        return;
    };
    let ghost = b
        .restore(&[("ghost", OperationState::Executing)])
        .await
        .pop()
        .flatten()
        .expect("restored");
    let counts = b.counts().await;
    assert_eq!(counts.global.all(), (1, 0, 0, 1));
    assert_eq!(counts.client("ghost").all(), (1, 0, 0, 1));
    assert_eq!(
        b.refusal("ghost", false).await.code,
        RefusalCode::ClientUnconfigured
    );
    ghost.succeed().await.unwrap();
    assert!(b.counts().await.is_idle());
}

async fn reload_keeps_counts_and_scales_the_bucket_fill(kind: Kind) {
    let Some(b) = one_client(kind, 10, DAY, 5, 5).await else {
        return;
    };
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(b.admit_op("bot", true).await);
    }
    drop(b.admit("bot", false).await.unwrap());
    b.settle().await;
    // Half the bucket used; the new capacity is 100, so 50 tokens remain, not a fresh 100.
    b.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(100, DAY, 5, 5))],
        &["bot", "other"],
    ));
    if let Some(c) = b.in_process() {
        let s = c.snapshot();
        assert_eq!(s.client("bot").unwrap().tokens, 50);
        assert_eq!(s.reloads_applied, 1);
    }
    assert_eq!(b.counts().await.client("bot").all(), (4, 4, 0, 0));
    // Lower active below usage: new work is refused until it drains.
    b.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(100, DAY, 2, 2))],
        &["bot", "other"],
    ));
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientOperationLimit
    );
    drop(held);
    b.settle().await;
    assert!(b.counts().await.is_idle());
    assert_eq!(b.spend_all_tokens("bot").await, 50);
}

async fn reload_rescales_a_bucket_to_a_new_window_without_a_fresh_burst_or_confiscation(
    kind: Kind,
) {
    let before = config(
        Limits::DEFAULT,
        &[
            ("amy", limits(10, HOUR, 50, 50)),
            ("bob", limits(10, HOUR, 50, 50)),
        ],
        &["amy", "bob"],
    );
    // amy: twice the burst over twice the window; bob: the same burst over a tenth of it.
    let after = config(
        Limits::DEFAULT,
        &[
            ("amy", limits(20, 2 * HOUR, 50, 50)),
            ("bob", limits(10, HOUR / 10, 50, 50)),
        ],
        &["amy", "bob"],
    );
    let Some(b) = kind.with(before).start().await else {
        return;
    };
    let mut kept = Vec::new();
    for _ in 0..4 {
        kept.push(b.admit_op("amy", false).await);
        kept.push(b.admit_op("bob", false).await);
    }
    b.reload(after);
    // amy used 4 of 10 → 8 of 20, 12 left (16 would be a fresh burst); bob used 4 of 10 → still
    // 4 of 10 over the shorter window, 6 left (0 would be confiscation).
    assert_eq!(b.spend_all_tokens("amy").await, 12);
    assert_eq!(b.spend_all_tokens("bob").await, 6);
    assert_eq!(b.counts().await.global.active, 8);
}

async fn reload_lowering_global_limits_below_usage_refuses_until_it_drains(kind: Kind) {
    let clients = ["a", "b", "c"];
    let Some(b) = kind
        .with(config(global(10, 2), &[], &clients))
        .start()
        .await
    else {
        return;
    };
    let running = [b.admit_op("a", false).await, b.admit_op("b", false).await];
    let queued = b.admit_op("a", false).await;
    for op in &running {
        op.try_start().await.unwrap();
    }
    b.reload(config(global(2, 1), &[], &clients));
    assert_eq!(
        b.counts().await.global.all(),
        (3, 0, 1, 2),
        "counts are kept"
    );
    assert_eq!(
        b.refusal("c", false).await.code,
        RefusalCode::GlobalOperationLimit
    );
    assert!(matches!(
        queued.try_start().await,
        Err(NotStarted::Saturated(_))
    ));
    running[0].succeed().await.unwrap();
    assert_eq!(
        b.refusal("c", false).await.code,
        RefusalCode::GlobalOperationLimit,
        "two active of two"
    );
    assert!(
        matches!(queued.try_start().await, Err(NotStarted::Saturated(_))),
        "one executing of one"
    );
    running[1].fail().await.unwrap();
    queued.try_start().await.unwrap();
    assert_eq!(
        b.refusal("c", true).await.code,
        RefusalCode::GlobalExecutionLimit
    );
    queued.succeed().await.unwrap();
    assert!(b.counts().await.is_idle());
    assert!(b.admit("c", true).await.is_ok());
}

async fn rate_wait_after_a_reload_is_one_interval_of_the_new_rate(kind: Kind) {
    let Some(b) = one_client(kind, 10, HOUR, 20, 20).await else {
        return;
    };
    assert_eq!(b.spend_all_tokens("bot").await, 10);
    b.assert_rate_wait(&b.refusal("bot", false).await, Duration::from_secs(360));
    // Half the rate over the same window: the empty bucket stays empty, and its next token is
    // one new interval away.
    b.reload(one_client_config(5, HOUR, 20, 20));
    b.assert_rate_wait(&b.refusal("bot", false).await, Duration::from_secs(720));
    b.reload(one_client_config(40, HOUR, 20, 20));
    b.assert_rate_wait(&b.refusal("bot", false).await, Duration::from_secs(90));
}

async fn removed_identity_is_refused_but_its_live_work_still_releases(kind: Kind) {
    let Some(b) = one_client(kind, 10, DAY, 5, 5).await else {
        return;
    };
    let live = b.admit_op("bot", true).await;
    b.reload(config(Limits::DEFAULT, &[], &["other"]));
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientUnconfigured
    );
    assert_eq!(b.counts().await.client("bot").all(), (1, 1, 0, 0));
    live.deny().await.unwrap();
    assert!(b.counts().await.is_idle());
    // Added back, it is admitted again with its configured limits.
    b.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(10, DAY, 1, 1))],
        &["bot", "other"],
    ));
    let op = b.admit_op("bot", false).await;
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientOperationLimit,
        "its new active limit of 1"
    );
    op.fail().await.unwrap();
    assert_eq!(
        b.spend_all_tokens("bot").await,
        8,
        "tokens spent before the removal stay spent"
    );
}

/// Nothing live holds the removed client, but its spent tokens are not back yet: forgetting it
/// would hand it a fresh burst when it is added back, which a reload never does.
async fn identity_removed_idle_with_tokens_spent_and_added_back_gets_no_fresh_burst(kind: Kind) {
    let Some(b) = one_client(kind, 10, DAY, 5, 5).await else {
        return;
    };
    for _ in 0..7 {
        b.admit_op("bot", false).await.fail().await.unwrap();
    }
    b.settle().await;
    b.reload(config(Limits::DEFAULT, &[], &["other"]));
    // A second reload: the one at which a drained identity would be forgotten.
    b.reload(config(Limits::DEFAULT, &[], &["other", "newcomer"]));
    assert_eq!(
        b.refusal("bot", false).await.code,
        RefusalCode::ClientUnconfigured
    );
    b.reload(one_client_config(10, DAY, 5, 5));
    assert_eq!(
        b.spend_all_tokens("bot").await,
        3,
        "the seven tokens spent before the removal stay spent"
    );
}

/// A refund after one or more reloads that changed the rate gives back exactly the token the
/// permit took: the client ends where a twin that never took it is, token for token.
async fn refund_after_a_reload_that_changed_the_rate_returns_exactly_the_token_taken(kind: Kind) {
    // (requests, window) before and after: a longer window, more requests, fewer, both. On
    // Redis, whose clock runs, every window is 360 times longer, so that no token comes back
    // between the two clients' drains.
    let stretch = match kind {
        Kind::InProcess => 1,
        Kind::Redis => 360,
    };
    let changes = [
        ((10, 10), vec![(10, 100)]),
        ((10, 60), vec![(100, 60)]),
        ((100, 60), vec![(3, 60)]),
        ((3, 60), vec![(7, 10)]),
        ((10, 10), vec![(10, 100), (100, 100), (5, 20)]),
    ];
    for spent in [0, 1, 2] {
        for (before, reloads) in &changes {
            let both = |(n, w): (u32, u32)| {
                config(
                    Limits::DEFAULT,
                    &[
                        ("bot", limits(n, w * stretch, 50, 50)),
                        ("twin", limits(n, w * stretch, 50, 50)),
                    ],
                    &["bot", "twin"],
                )
            };
            let Some(b) = kind.with(both(*before)).start().await else {
                return;
            };
            for _ in 0..spent {
                drop(b.admit("bot", false).await.unwrap());
                drop(b.admit("twin", false).await.unwrap());
            }
            let permit = b.admit("bot", false).await.unwrap();
            for &after in reloads {
                b.reload(both(after));
            }
            permit.refund().await;
            b.settle().await;
            let case = format!("{spent} spent, {before:?} then {reloads:?}");
            if let Some(c) = b.in_process() {
                let s = c.snapshot();
                assert_eq!(
                    s.client("bot").unwrap().tokens,
                    s.client("twin").unwrap().tokens,
                    "{case}"
                );
            }
            // Drained, both wait as long for their next token: exactly on the manual clock; on
            // Redis's the twin drains a moment later, so its wait may round a second shorter.
            let (bot, bot_refusal) = b.drain("bot").await;
            let (twin, twin_refusal) = b.drain("twin").await;
            assert_eq!(bot, twin, "{case}");
            assert_eq!(bot_refusal.code, RefusalCode::SubmissionRateLimited);
            assert_eq!(twin_refusal.code, RefusalCode::SubmissionRateLimited);
            match b.manual_clock() {
                Some(clock) => {
                    assert_eq!(bot_refusal, twin_refusal, "{case}");
                    let (n, w) = *reloads.last().unwrap();
                    clock.advance(Duration::from_secs(u64::from(w)) / n);
                    assert_eq!(
                        b.drain("bot").await,
                        b.drain("twin").await,
                        "{case}: one interval later"
                    );
                }
                None => assert!(
                    bot_refusal
                        .retry_after_secs()
                        .abs_diff(twin_refusal.retry_after_secs())
                        <= 1,
                    "{case}: {bot_refusal:?} vs {twin_refusal:?}"
                ),
            }
        }
    }
}
