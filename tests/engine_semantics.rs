//! SPEC section 2, paragraph by paragraph, against the library with a manual clock.

use std::collections::BTreeMap;
use std::time::Duration;

use unyolo_admission::{
    CancelOutcome, ClientLimits, Config, Controller, Identity, Limits, ManualClock, OperationState,
    RefusalCode, StartError, StorageCaps, Store, TransitionError,
};

fn id(name: &str) -> Identity {
    Identity::new(name).unwrap()
}

fn limits(n: u32, w: u32, active: u32, pending: u32) -> ClientLimits {
    ClientLimits {
        requests_per_window: n,
        window_seconds: w,
        active,
        pending,
    }
}

fn global(ga: u32, ge: u32) -> Limits {
    let client_active = ga.min(25);
    Limits {
        global_active: ga,
        global_executing: ge,
        client_active,
        client_pending: client_active.min(10),
        ..Limits::DEFAULT
    }
}

fn config(globals: Limits, overrides: &[(&str, ClientLimits)], names: &[&str]) -> Config {
    let overrides: BTreeMap<Identity, ClientLimits> =
        overrides.iter().map(|(n, l)| (id(n), *l)).collect();
    Config::new(globals, overrides, names.iter().map(|n| id(n))).unwrap()
}

fn controller(config: Config) -> (Controller, ManualClock) {
    let clock = ManualClock::new();
    clock.set_nanos(1_000_000_000);
    (
        Controller::builder(config).clock(clock.clone()).build(),
        clock,
    )
}

/// A controller where `bot` has its own limits and everything global is roomy.
fn one_client(n: u32, w: u32, active: u32, pending: u32) -> (Controller, ManualClock) {
    controller(config(
        Limits::DEFAULT,
        &[("bot", limits(n, w, active, pending))],
        &["bot", "other"],
    ))
}

/// The counts a refusal must leave alone: every gauge, every bucket.
fn counts(c: &Controller) -> Vec<(String, u64, u64, u64, u64, u64)> {
    let s = c.snapshot();
    let mut v = vec![(
        "global".to_string(),
        s.active,
        s.pending,
        s.queued,
        s.executing,
        0,
    )];
    v.extend(s.clients.iter().map(|c| {
        (
            c.identity.to_string(),
            c.active,
            c.pending,
            c.queued,
            c.executing,
            c.tokens,
        )
    }));
    v
}

#[test]
fn unknown_identity_is_refused_as_unconfigured_with_403() {
    let (c, _) = one_client(5, 60, 5, 5);
    let refusal = c.admit("stranger", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::ClientUnconfigured);
    assert_eq!(refusal.code.http_status(), 403);
    assert!(
        c.snapshot().client("stranger").is_none(),
        "no state is created from traffic"
    );
    assert_eq!(c.snapshot().rejected(RefusalCode::ClientUnconfigured), 1);
}

#[test]
fn rate_is_checked_before_client_active() {
    let (c, _) = one_client(1, 60, 1, 1);
    let _op = c.admit("bot", false).unwrap().commit();
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    assert_eq!(
        refusal.retry_after,
        Duration::from_secs(60),
        "largest hint: the rate wait"
    );
}

#[test]
fn client_active_limit_refuses_with_the_capacity_hint() {
    let (c, _) = one_client(10, 60, 2, 2);
    let _a = c.admit("bot", false).unwrap().commit();
    let _b = c.admit("bot", false).unwrap().commit();
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::ClientOperationLimit);
    assert_eq!(refusal.retry_after, Duration::from_secs(2));
    assert_eq!(refusal.code.http_status(), 429);
}

#[test]
fn pending_limit_only_applies_to_work_needing_approval() {
    let (c, _) = one_client(10, 60, 5, 1);
    let _p = c.admit("bot", true).unwrap().commit();
    assert_eq!(
        c.admit("bot", true).unwrap_err().code,
        RefusalCode::ClientPendingLimit
    );
    let run = c.admit("bot", false).unwrap().commit();
    assert_eq!(run.state(), OperationState::Approved);
}

#[test]
fn pending_grant_store_cap_binds_before_a_larger_client_pending() {
    let (c, _) = one_client(100, 60, 20, 12);
    let ops: Vec<_> = (0..10)
        .map(|_| c.admit("bot", true).unwrap().commit())
        .collect();
    let refusal = c.admit("bot", true).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::PendingGrantLimit);
    assert_eq!(ops.len(), 10);
}

#[test]
fn global_pending_grant_cap_is_shared_by_all_clients() {
    let caps = StorageCaps {
        grant_global: 2,
        ..StorageCaps::default()
    };
    let clock = ManualClock::new();
    let c = Controller::builder(config(Limits::DEFAULT, &[], &["a", "b"]))
        .clock(clock)
        .storage_caps(caps)
        .build();
    let _a = c.admit("a", true).unwrap().commit();
    let _b = c.admit("b", true).unwrap().commit();
    assert_eq!(
        c.admit("a", true).unwrap_err().code,
        RefusalCode::PendingGrantLimit
    );
    assert!(
        c.admit("a", false).is_ok(),
        "work that needs no approval is not a grant"
    );
}

#[test]
fn global_active_limit_is_shared_by_all_clients() {
    let (c, _) = controller(config(global(25, 10), &[], &["a", "b"]));
    let ops: Vec<_> = (0..25)
        .map(|i| {
            c.admit(if i % 2 == 0 { "a" } else { "b" }, false)
                .unwrap()
                .commit()
        })
        .collect();
    let refusal = c.admit("b", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::GlobalOperationLimit);
    drop(ops);
    assert!(c.admit("b", false).is_ok());
}

#[test]
fn saturated_execution_pool_refuses_new_work() {
    let (c, _) = controller(config(global(512, 1), &[], &["a"]));
    let running = c.admit("a", false).unwrap().commit();
    running.try_start().unwrap();
    let refusal = c.admit("a", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::GlobalExecutionLimit);
    running.succeed().unwrap();
    assert!(c.admit("a", false).is_ok());
}

/// A controller with one dimension exhausted, the operations holding it, and whether the next
/// submission needs approval.
type Exhausted = (
    Controller,
    ManualClock,
    Vec<unyolo_admission::Operation>,
    bool,
);

#[test]
fn every_refusal_consumes_no_token_and_no_slot() {
    // Each scenario exhausts one dimension, then checks a refusal changes nothing.
    let scenarios: Vec<(RefusalCode, Box<dyn Fn() -> Exhausted>)> = vec![
        (
            RefusalCode::SubmissionRateLimited,
            Box::new(|| {
                let (c, k) = one_client(1, 60, 5, 5);
                let ops = vec![c.admit("bot", false).unwrap().commit()];
                (c, k, ops, false)
            }),
        ),
        (
            RefusalCode::ClientOperationLimit,
            Box::new(|| {
                let (c, k) = one_client(10, 60, 1, 1);
                let ops = vec![c.admit("bot", false).unwrap().commit()];
                (c, k, ops, true)
            }),
        ),
        (
            RefusalCode::ClientPendingLimit,
            Box::new(|| {
                let (c, k) = one_client(10, 60, 5, 1);
                let ops = vec![c.admit("bot", true).unwrap().commit()];
                (c, k, ops, true)
            }),
        ),
        (
            RefusalCode::GlobalOperationLimit,
            Box::new(|| {
                let (c, k) = controller(config(
                    global(1, 1),
                    &[("bot", limits(10, 60, 1, 1))],
                    &["bot", "other"],
                ));
                let ops = vec![c.admit("other", false).unwrap().commit()];
                (c, k, ops, true)
            }),
        ),
        (
            RefusalCode::GlobalExecutionLimit,
            Box::new(|| {
                let (c, k) = controller(config(global(10, 1), &[], &["bot", "other"]));
                let op = c.admit("other", false).unwrap().commit();
                op.try_start().unwrap();
                (c, k, vec![op], true)
            }),
        ),
    ];
    for (code, setup) in scenarios {
        let (c, _clock, _ops, approval) = setup();
        let before = counts(&c);
        for _ in 0..3 {
            assert_eq!(c.admit("bot", approval).unwrap_err().code, code);
        }
        assert_eq!(counts(&c), before, "{code} changed a count or a bucket");
    }
}

#[test]
fn rate_retry_after_is_the_exact_wait_rounded_up() {
    let (c, clock) = one_client(1, 10, 5, 5);
    drop(c.admit("bot", false).unwrap());
    clock.advance(Duration::from_millis(3_500));
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    assert_eq!(
        refusal.retry_after,
        Duration::from_secs(7),
        "6.5 s rounds up to 7"
    );
    clock.advance(Duration::from_millis(6_499));
    assert_eq!(
        c.admit("bot", false).unwrap_err().retry_after,
        Duration::from_secs(1),
        "never below one second"
    );
    clock.advance(Duration::from_millis(1));
    assert!(c.admit("bot", false).is_ok());
}

#[test]
fn retry_after_is_the_largest_hint_among_exhausted_dimensions() {
    // 60 per second: the rate wait is ~17 ms, so the 5 s capacity hint wins when active is full too.
    let cfg = config(Limits::DEFAULT, &[("bot", limits(60, 1, 1, 1))], &["bot"]);
    let c = Controller::builder(cfg)
        .clock(ManualClock::new())
        .capacity_retry(Duration::from_secs(5))
        .build();
    let _op = c.admit("bot", false).unwrap().commit();
    for _ in 0..59 {
        let _ = c.admit("bot", false);
    }
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.retry_after, Duration::from_secs(5));
}

#[test]
fn dropped_permit_returns_slots_but_keeps_the_token_spent() {
    let (c, _) = one_client(2, 60, 1, 1);
    drop(c.admit("bot", true).unwrap());
    let s = c.snapshot();
    assert_eq!((s.active, s.pending), (0, 0));
    assert_eq!(s.client("bot").unwrap().tokens, 1);
}

#[test]
fn refunded_permit_returns_slots_and_the_token() {
    let (c, _) = one_client(2, 60, 1, 1);
    c.admit("bot", true).unwrap().refund();
    let s = c.snapshot();
    assert_eq!((s.active, s.pending), (0, 0));
    assert_eq!(s.client("bot").unwrap().tokens, 2);
}

#[test]
fn lifecycle_moves_counts_between_pending_queued_and_executing() {
    let (c, _) = one_client(10, 60, 5, 5);
    let op = c.admit("bot", true).unwrap().commit();
    let s = c.snapshot();
    assert_eq!((s.active, s.pending, s.queued, s.executing), (1, 1, 0, 0));
    op.approve().unwrap();
    let s = c.snapshot();
    assert_eq!((s.active, s.pending, s.queued, s.executing), (1, 0, 1, 0));
    op.try_start().unwrap();
    let s = c.snapshot();
    assert_eq!((s.active, s.pending, s.queued, s.executing), (1, 0, 0, 1));
    assert_eq!(
        op.cancel(),
        Err(TransitionError {
            from: OperationState::Executing,
            to: OperationState::Canceled
        })
    );
    op.succeed().unwrap();
    assert!(c.snapshot().is_idle());
    assert_eq!(op.state(), OperationState::Succeeded);
}

#[test]
fn terminal_transitions_release_exactly_once_whatever_the_repetition() {
    let (c, _) = one_client(10, 60, 5, 5);
    let op = c.admit("bot", true).unwrap().commit();
    let keep = c.admit("bot", true).unwrap().commit();
    op.deny().unwrap();
    assert!(op.deny().is_err(), "a second deny is refused");
    assert_eq!(
        op.cancel(),
        Ok(CancelOutcome::AlreadyTerminal(OperationState::Denied)),
        "cancel of a terminal operation changes nothing"
    );
    assert!(op.fail().is_err());
    drop(op);
    let s = c.snapshot();
    assert_eq!(
        (s.active, s.pending),
        (1, 1),
        "only the other operation is still counted"
    );
    drop(keep);
    assert!(c.snapshot().is_idle());
}

#[test]
fn cancel_racing_approve_releases_once() {
    let (c, _) = one_client(100_000, 60, 5, 5);
    for _ in 0..200 {
        let op = std::sync::Arc::new(c.admit("bot", true).unwrap().commit());
        let o2 = op.clone();
        let t = std::thread::spawn(move || o2.approve().is_ok());
        let canceled = op.cancel().is_ok();
        let approved = t.join().unwrap();
        assert!(canceled, "cancel succeeds from pending or approved");
        assert_eq!(op.state(), OperationState::Canceled);
        let _ = approved;
        assert!(c.snapshot().is_idle());
    }
}

#[test]
fn starting_without_a_free_slot_leaves_the_operation_queued() {
    let (c, _) = controller(config(global(10, 1), &[], &["a"]));
    let first = c.admit("a", false).unwrap().commit();
    let second = c.admit("a", false).unwrap().commit();
    first.try_start().unwrap();
    match second.try_start() {
        Err(StartError::Saturated(r)) => assert_eq!(r.code, RefusalCode::GlobalExecutionLimit),
        other => panic!("expected saturation, got {other:?}"),
    }
    assert_eq!(second.state(), OperationState::Approved);
    assert_eq!(c.snapshot().queued, 1);
    first.fail().unwrap();
    second.try_start().unwrap();
    second.cancel().unwrap_err();
    second.succeed().unwrap();
    assert!(c.snapshot().is_idle());
}

#[test]
fn restored_work_counts_even_above_a_lowered_limit() {
    let (c, _) = one_client(10, 60, 2, 2);
    let restored: Vec<_> = (0..3)
        .map(|_| c.restore(id("bot"), OperationState::Pending).unwrap())
        .collect();
    let s = c.snapshot();
    assert_eq!((s.active, s.pending), (3, 3));
    assert_eq!(
        c.admit("bot", false).unwrap_err().code,
        RefusalCode::ClientOperationLimit
    );
    restored[0].deny().unwrap();
    assert_eq!(
        c.admit("bot", false).unwrap_err().code,
        RefusalCode::ClientOperationLimit,
        "still at the limit of 2"
    );
    restored[1].cancel().unwrap();
    assert!(c.admit("bot", false).is_ok());
    assert!(c.restore(id("bot"), OperationState::Succeeded).is_err());
}

#[test]
fn restore_of_an_unconfigured_identity_counts_globally_but_admits_nothing() {
    let (c, _) = one_client(10, 60, 2, 2);
    let ghost = c.restore(id("ghost"), OperationState::Executing).unwrap();
    assert_eq!(c.snapshot().executing, 1);
    assert_eq!(
        c.admit("ghost", false).unwrap_err().code,
        RefusalCode::ClientUnconfigured
    );
    ghost.succeed().unwrap();
    assert!(c.snapshot().is_idle());
}

/// The clock drill: a clock stepping back an hour must neither refill a bucket nor lock the client
/// out for the hour; time as the engine sees it stands still at the step, then flows on.
#[test]
fn backward_clock_never_refills_a_bucket_nor_locks_out_past_the_window() {
    let (c, clock) = one_client(3, 60, 10, 10);
    clock.set_nanos(7_200_000_000_000);
    for _ in 0..3 {
        drop(c.admit("bot", false).unwrap());
    }
    clock.rewind(Duration::from_secs(3600));
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    assert_eq!(
        refusal.retry_after,
        Duration::from_secs(20),
        "one interval, never the hour"
    );
    assert!(refusal.retry_after <= Duration::from_secs(60));
    assert_eq!(
        c.snapshot().client("bot").unwrap().tokens,
        0,
        "not refilled"
    );
    assert!(c.snapshot().clock_regressions > 0);
    clock.advance(Duration::from_secs(19));
    assert!(
        c.admit("bot", false).is_err(),
        "19 s after the step: still empty"
    );
    clock.advance(Duration::from_secs(1));
    assert!(
        c.admit("bot", false).is_ok(),
        "20 s after the step: one token, as if the step never happened"
    );
    assert!(c.admit("bot", false).is_err());
}

/// A forward jump after a backward one refills only what real time allows.
#[test]
fn stepping_back_then_forward_counts_only_the_forward_progress() {
    let (c, clock) = one_client(3, 60, 10, 10);
    clock.set_nanos(7_200_000_000_000);
    for _ in 0..3 {
        drop(c.admit("bot", false).unwrap());
    }
    clock.rewind(Duration::from_secs(30));
    let _ = c.admit("bot", false);
    clock.advance(Duration::from_secs(30)); // the source is back where it was: 0 s really elapsed
    assert_eq!(
        c.snapshot().client("bot").unwrap().tokens,
        1,
        "30 s flowed after the step: 1 token, not 3"
    );
}

#[test]
fn reload_keeps_counts_and_scales_the_bucket_fill() {
    let (c, clock) = one_client(10, 60, 5, 5);
    let held: Vec<_> = (0..4)
        .map(|_| c.admit("bot", true).unwrap().commit())
        .collect();
    for _ in 0..1 {
        drop(c.admit("bot", false).unwrap());
    }
    // Half the bucket used; the new capacity is 100, so 50 tokens remain, not a fresh 100.
    c.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(100, 60, 5, 5))],
        &["bot", "other"],
    ));
    let s = c.snapshot();
    assert_eq!(s.client("bot").unwrap().tokens, 50);
    assert_eq!((s.active, s.pending), (4, 4));
    assert_eq!(s.reloads_applied, 1);
    // Lower active below usage: new work is refused until it drains.
    c.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(100, 60, 2, 2))],
        &["bot", "other"],
    ));
    assert_eq!(
        c.admit("bot", false).unwrap_err().code,
        RefusalCode::ClientOperationLimit
    );
    drop(held);
    clock.advance(Duration::from_secs(1));
    assert!(c.admit("bot", false).is_ok());
}

#[test]
fn removed_identity_is_refused_but_its_live_work_still_releases() {
    let (c, _) = one_client(10, 60, 5, 5);
    let live = c.admit("bot", true).unwrap().commit();
    c.reload(config(Limits::DEFAULT, &[], &["other"]));
    assert_eq!(
        c.admit("bot", false).unwrap_err().code,
        RefusalCode::ClientUnconfigured
    );
    assert_eq!(c.snapshot().active, 1);
    live.deny().unwrap();
    assert!(c.snapshot().is_idle());
    // Added back, it is admitted again with its configured limits.
    c.reload(config(
        Limits::DEFAULT,
        &[("bot", limits(10, 60, 1, 1))],
        &["bot", "other"],
    ));
    assert!(c.admit("bot", false).is_ok());
    assert_eq!(
        c.snapshot().client("bot").unwrap().tokens,
        8,
        "tokens spent before the removal stay spent"
    );
}

#[test]
fn identities_removed_by_reload_are_forgotten_once_drained() {
    let (c, _) = one_client(10, 60, 5, 5);
    let held = c.admit("other", false).unwrap().commit();
    for round in 0..50 {
        let names: Vec<String> = (0..20).map(|i| format!("gen{round}-{i}")).collect();
        let mut all: Vec<&str> = names.iter().map(String::as_str).collect();
        all.push("bot");
        c.reload(config(Limits::DEFAULT, &[], &all));
        assert!(c.admit(&names[round % 20], false).is_ok());
    }
    let s = c.snapshot();
    assert_eq!(
        s.clients.len(),
        22,
        "20 configured, bot, and other still draining: {:?}",
        s.clients.len()
    );
    assert!(!s.client("other").unwrap().configured);
    drop(held);
    let last: Vec<String> = (0..20).map(|i| format!("gen49-{i}")).collect();
    let mut same: Vec<&str> = last.iter().map(String::as_str).collect();
    same.push("bot");
    c.reload(config(Limits::DEFAULT, &[], &same));
    assert_eq!(
        c.snapshot().clients.len(),
        21,
        "an unchanged reload still forgets what drained"
    );
    c.reload(config(Limits::DEFAULT, &[], &["bot"]));
    assert_eq!(c.snapshot().clients.len(), 1);
    assert!(c.admit("bot", false).is_ok());
    assert_eq!(
        c.admit("gen0-0", false).unwrap_err().code,
        RefusalCode::ClientUnconfigured
    );
}

#[test]
fn invalid_reload_changes_nothing_and_is_counted() {
    let (c, _) = one_client(10, 60, 5, 5);
    let before = c.config();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("quota.json");
    std::fs::write(&path, br#"{"requests_per_window": 0}"#).unwrap();
    let path = std::fs::canonicalize(&path).unwrap();
    assert!(c.reload_from_path(&path).is_err());
    assert_eq!(c.config(), before);
    assert_eq!(c.snapshot().reloads_rejected, 1);
    assert_eq!(c.snapshot().reloads_applied, 0);
}

#[test]
fn storage_is_reserved_settled_and_released() {
    let caps = StorageCaps {
        stream: unyolo_admission::StoreCaps {
            global_files: 3,
            global_bytes: 1000,
            client_files: 2,
            client_bytes: 600,
        },
        ..StorageCaps::default()
    };
    let c = Controller::builder(config(Limits::DEFAULT, &[], &["a", "b"]))
        .clock(ManualClock::new())
        .storage_caps(caps)
        .build();
    let r = c.reserve_storage("a", Store::Stream, 500).unwrap();
    let obj = r.settle(100).unwrap();
    assert_eq!(c.snapshot().storage[0].bytes, 100);
    let refusal = c.reserve_storage("a", Store::Stream, 501).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::StreamStorageLimit);
    assert_eq!(refusal.code.as_str(), "stream_storage_limit");
    assert_eq!(
        c.snapshot().storage[0].bytes,
        100,
        "a refused reservation takes nothing"
    );
    let second = c
        .reserve_storage("a", Store::Stream, 10)
        .unwrap()
        .settle(10)
        .unwrap();
    assert_eq!(
        c.reserve_storage("a", Store::Stream, 1).unwrap_err().code,
        RefusalCode::StreamStorageLimit,
        "client files"
    );
    let big = c.reserve_storage("b", Store::Stream, 500).unwrap();
    assert!(
        big.settle(2000).is_err(),
        "growing past the caps fails and releases"
    );
    assert_eq!(c.snapshot().storage[0].files, 2);
    assert!(obj.release());
    assert!(!obj.release(), "released exactly once");
    drop(second);
    assert!(c.snapshot().is_idle());
    let sealed = c
        .reserve_storage("b", Store::SealedPayload, 17 * 1024 * 1024)
        .unwrap_err();
    assert_eq!(sealed.code.as_str(), "sealed_payload_storage_limit");
}

#[test]
fn prometheus_exposition_names_the_contract_metrics() {
    let (c, _) = one_client(1, 60, 5, 5);
    let _op = c.admit("bot", true).unwrap().commit();
    let _ = c.admit("bot", true);
    let text = unyolo_admission::metrics::render(&c);
    for needle in [
        r#"admission_requests_total{result="accepted",code="none"} 1"#,
        r#"admission_requests_total{result="rejected",code="submission_rate_limited"} 1"#,
        r#"admission_operations{state="pending"} 1"#,
        r#"admission_client_operations{client="bot",state="pending"} 1"#,
        r#"admission_storage_bytes{store="stream"} 0"#,
        r#"admission_config_reloads_total{result="applied"} 0"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

/// A refund after one or more reloads that changed the rate gives back exactly the token the
/// permit took: the client ends where a twin that never took it is, token for token.
#[test]
fn refund_after_a_reload_that_changed_the_rate_returns_exactly_the_token_taken() {
    // (requests, window) before and after: a longer window, more requests, fewer, both.
    let changes = [
        ((10, 10), vec![(10, 100)]),
        ((10, 60), vec![(100, 60)]),
        ((100, 60), vec![(3, 60)]),
        ((3, 60), vec![(7, 10)]),
        ((10, 10), vec![(10, 100), (100, 100), (5, 20)]),
    ];
    for (taken_spent, (before, reloads)) in [0, 1, 2].into_iter().flat_map(|spent| {
        changes
            .iter()
            .map(move |(before, after)| (spent, (*before, after.clone())))
    }) {
        let both = |(n, w): (u32, u32)| {
            config(
                Limits::DEFAULT,
                &[
                    ("bot", limits(n, w, 50, 50)),
                    ("twin", limits(n, w, 50, 50)),
                ],
                &["bot", "twin"],
            )
        };
        let (c, clock) = controller(both(before));
        for _ in 0..taken_spent {
            drop(c.admit("bot", false).unwrap());
            drop(c.admit("twin", false).unwrap());
        }
        let permit = c.admit("bot", false).unwrap();
        for &after in &reloads {
            c.reload(both(after));
        }
        permit.refund();
        let case = format!("{taken_spent} spent, {before:?} then {reloads:?}");
        let s = c.snapshot();
        assert_eq!(
            s.client("bot").unwrap().tokens,
            s.client("twin").unwrap().tokens,
            "{case}"
        );
        // Drained, both wait exactly as long for their next token.
        let drain = |name: &str| {
            let mut admitted = 0;
            let refusal = loop {
                match c.admit(name, false) {
                    Ok(p) => {
                        drop(p);
                        admitted += 1;
                    }
                    Err(refusal) => break refusal,
                }
            };
            (admitted, refusal)
        };
        assert_eq!(drain("bot"), drain("twin"), "{case}");
        let (n, w) = *reloads.last().unwrap();
        clock.advance(Duration::from_secs(u64::from(w)) / n);
        assert_eq!(drain("bot"), drain("twin"), "{case}: one interval later");
    }
}
