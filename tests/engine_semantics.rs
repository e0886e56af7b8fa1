//! SPEC section 2 where only the in-process engine can show it, against the library with a manual
//! clock: a clock that steps (exact waits, backward steps, refills after a reload), identities
//! forgotten once drained, config files, storage quotas and metrics. The decisions, refusals,
//! permits, lifecycle, restore and reload rules that both backends share are written once in
//! `admission_semantics.rs` and run against the in-process engine and Redis.

use std::collections::BTreeMap;
use std::time::Duration;

use unyolo_admission::{
    ClientLimits, Config, Controller, Identity, Limits, ManualClock, RefusalCode, StorageCaps,
    Store,
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
fn identities_removed_by_reload_are_forgotten_once_drained_and_refilled() {
    let (c, clock) = one_client(10, 60, 5, 5);
    let held = c.admit("other", false).unwrap().commit();
    let window = Duration::from_secs(Limits::DEFAULT.window_seconds.into());
    for round in 0..50 {
        let names: Vec<String> = (0..20).map(|i| format!("gen{round}-{i}")).collect();
        let mut all: Vec<&str> = names.iter().map(String::as_str).collect();
        all.push("bot");
        c.reload(config(Limits::DEFAULT, &[], &all));
        assert!(c.admit(&names[round % 20], false).is_ok());
        // A window on, its token is back: removed next round, it is forgotten then.
        clock.advance(window);
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
fn a_reservation_the_whole_store_refuses_gives_everything_back_and_counts_the_refusal() {
    let c = Controller::builder(config(Limits::DEFAULT, &[], &["a"]))
        .clock(ManualClock::new())
        .build();
    let kept = c
        .reserve_storage("a", Store::Stream, 7)
        .unwrap()
        .settle(7)
        .unwrap();
    let reservation = c.reserve_storage("a", Store::Stream, 300).unwrap();
    assert_eq!(c.snapshot().storage[0].files, 2);
    let refusal = reservation.refuse();
    assert_eq!(refusal.code, RefusalCode::StreamStorageLimit);
    assert_eq!(refusal.retry_after, c.capacity_retry());
    let after = c.snapshot();
    assert_eq!((after.storage[0].files, after.storage[0].bytes), (1, 7));
    assert_eq!(after.rejected(RefusalCode::StreamStorageLimit), 1);
    drop(kept);
    assert!(c.snapshot().is_idle());
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
