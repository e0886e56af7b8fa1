//! The embedding API: what a broker author meets — cancel outcomes, waiting for a slot, dropped
//! handles counted, bearer-token lookup, refusal → HTTP, optional quota files, metrics output.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use unyolo_admission::config::{Rule, Secrets};
use unyolo_admission::{
    CancelOutcome, ClientLimits, Config, Controller, Identity, Limits, ManualClock, OperationState,
    RefusalCode, TransitionError, metrics,
};

fn bot() -> Identity {
    Identity::new("bot").unwrap()
}

fn controller(requests: u32, active: u32, global_executing: u32) -> Controller {
    let mut overrides = BTreeMap::new();
    overrides.insert(
        bot(),
        ClientLimits {
            requests_per_window: requests,
            window_seconds: 60,
            active,
            pending: active,
        },
    );
    let limits = Limits {
        global_executing,
        ..Limits::default()
    };
    let config = Config::new(limits, overrides, [bot()]).unwrap();
    Controller::builder(config)
        .clock(ManualClock::new())
        .build()
}

/// Polls `future` on this thread, parking between polls: no runtime at all.
fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut Context::from_waker(&waker)) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn cancel_says_whether_it_changed_the_operation() {
    let c = controller(10, 5, 5);
    let op = c.admit("bot", false).unwrap().commit();
    assert_eq!(
        op.cancel(),
        Ok(CancelOutcome::Canceled {
            from: OperationState::Approved
        })
    );
    let done = c.admit("bot", false).unwrap().commit();
    done.try_start().unwrap();
    done.succeed().unwrap();
    let outcome = done.cancel().unwrap();
    assert_eq!(
        outcome,
        CancelOutcome::AlreadyTerminal(OperationState::Succeeded)
    );
    assert!(!outcome.changed());
    assert_eq!(outcome.state(), OperationState::Succeeded);
    assert!(c.snapshot().is_idle());
}

#[test]
fn start_waits_for_a_slot_and_takes_it_once_one_is_given_back() {
    let c = controller(10, 5, 1);
    let running = c.admit("bot", false).unwrap().commit();
    let queued = Arc::new(c.admit("bot", false).unwrap().commit());
    running.try_start().unwrap();
    let waiter = {
        let queued = Arc::clone(&queued);
        std::thread::spawn(move || block_on(queued.start()))
    };
    running.succeed().unwrap();
    assert_eq!(waiter.join().unwrap(), Ok(()));
    assert_eq!(queued.state(), OperationState::Executing);
    assert_eq!(c.snapshot().executing, 1);
}

#[test]
fn start_gives_up_when_the_waiting_operation_is_canceled() {
    let c = controller(10, 5, 1);
    let running = c.admit("bot", false).unwrap().commit();
    let queued = Arc::new(c.admit("bot", false).unwrap().commit());
    running.try_start().unwrap();
    let waiter = {
        let queued = Arc::clone(&queued);
        std::thread::spawn(move || block_on(queued.start()))
    };
    assert!(queued.cancel().unwrap().changed());
    assert_eq!(
        waiter.join().unwrap(),
        Err(TransitionError {
            from: OperationState::Canceled,
            to: OperationState::Executing
        })
    );
    assert_eq!(c.snapshot().executing, 1, "the running one only");
}

#[test]
fn start_wakes_when_a_reload_raises_the_execution_limit() {
    let c = controller(10, 5, 1);
    let running = c.admit("bot", false).unwrap().commit();
    let queued = Arc::new(c.admit("bot", false).unwrap().commit());
    running.try_start().unwrap();
    let waiter = {
        let queued = Arc::clone(&queued);
        std::thread::spawn(move || block_on(queued.start()))
    };
    let mut config = c.config();
    let limits = Limits {
        global_executing: 2,
        ..*config.limits()
    };
    config = Config::new(limits, config.overrides().clone(), [bot()]).unwrap();
    c.reload(config);
    assert_eq!(waiter.join().unwrap(), Ok(()));
    assert_eq!(c.snapshot().executing, 2);
}

#[test]
fn a_dropped_permit_and_a_dropped_live_operation_are_counted_as_embedder_bugs() {
    let c = controller(10, 5, 5);
    drop(c.admit("bot", true).unwrap());
    c.admit("bot", true).unwrap().refund();
    let committed = c.admit("bot", true).unwrap().commit();
    drop(committed);
    let finished = c.admit("bot", true).unwrap().commit();
    finished.deny().unwrap();
    drop(finished);
    let s = c.snapshot();
    assert_eq!((s.dropped_permits, s.dropped_operations), (1, 1));
    assert!(s.is_idle());
    let text = metrics::render(&c);
    assert!(
        text.contains("\nadmission_dropped_permits_total 1\n"),
        "{text}"
    );
    assert!(
        text.contains("\nadmission_dropped_operations_total 1\n"),
        "{text}"
    );
}

#[test]
fn restore_and_admit_take_the_same_identity_types() {
    let c = controller(10, 5, 5);
    let name = String::from("bot");
    let a = c.restore(&name, OperationState::Pending).unwrap();
    let b = c.restore(bot(), OperationState::Approved).unwrap();
    let d = c.restore("bot", OperationState::Pending).unwrap();
    let p = c.admit(&name, false).unwrap();
    let q = c.admit(bot(), false).unwrap();
    assert_eq!(c.snapshot().active, 5);
    assert_eq!(
        c.restore("no spaces allowed", OperationState::Pending)
            .unwrap_err(),
        unyolo_admission::engine::RestoreError::InvalidIdentity
    );
    for op in [a, b, d] {
        op.fail().unwrap();
    }
    p.refund();
    q.refund();
    assert!(c.snapshot().is_idle());
}

#[test]
fn a_refusal_takes_no_token_even_when_a_later_check_fails() {
    let c = controller(3, 1, 5);
    let held = c.admit("bot", false).unwrap();
    let tokens = c.snapshot().client("bot").unwrap().tokens;
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::ClientOperationLimit);
    assert_eq!(c.snapshot().client("bot").unwrap().tokens, tokens);
    held.refund();
}

#[test]
fn the_rate_is_reported_before_capacity_when_both_are_exhausted() {
    let c = controller(1, 1, 5);
    let held = c.admit("bot", false).unwrap();
    let refusal = c.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    assert_eq!(refusal.retry_after_header(), Some(60));
    assert_eq!(refusal.http_status(), 429);
    assert_eq!(
        refusal.message(),
        RefusalCode::SubmissionRateLimited.message()
    );
    held.refund();
}

#[test]
fn an_unconfigured_client_gets_a_403_without_retry_after() {
    let c = controller(10, 5, 5);
    let refusal = c.admit("stranger", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::ClientUnconfigured);
    assert_eq!(
        (refusal.http_status(), refusal.retry_after_header()),
        (403, None)
    );
}

#[test]
fn secrets_identify_exactly_the_matching_bearer_token() {
    let secrets = Secrets::parse("bot = alpha-secret\nops = beta-secret\n").unwrap();
    assert_eq!(secrets.identify(b"alpha-secret"), Some(&bot()));
    assert_eq!(
        secrets.identify(b"beta-secret").map(Identity::as_str),
        Some("ops")
    );
    for wrong in [&b"alpha"[..], b"alpha-secret ", b"", b"ALPHA-SECRET"] {
        assert_eq!(secrets.identify(wrong), None, "{wrong:?}");
    }
}

#[test]
fn no_quota_path_means_the_defaults_but_a_path_without_a_file_is_an_error() {
    let none = Config::from_optional_path(None, [bot()]).unwrap();
    assert_eq!(none, Config::defaults([bot()]));
    let missing = std::env::temp_dir().join("unyolo-no-such-quota-file.json");
    let err = Config::from_optional_path(Some(&missing), [bot()]).unwrap_err();
    assert_eq!(err.rule(), Rule::FileNotFound);
    assert!(
        err.to_string().contains("unyolo-no-such-quota-file.json"),
        "{err}"
    );
    // A reload from a file that went away keeps the limits in force and counts the failure.
    let c = controller(10, 5, 5);
    assert!(
        c.reload_from_optional_path(Some(&missing), [bot()])
            .is_err()
    );
    let s = c.snapshot();
    assert_eq!((s.reloads_applied, s.reloads_rejected), (0, 1));
    let relative = Config::from_optional_path(Some("quota.json".as_ref()), [bot()]).unwrap_err();
    assert_eq!(relative.rule(), Rule::PathNotAbsolute);
}

#[test]
fn a_reload_can_add_identities_and_counts_a_rejected_file() {
    let c = controller(10, 5, 5);
    assert!(c.admit("newcomer", false).is_err());
    let newcomer = Identity::new("newcomer").unwrap();
    c.reload_from_optional_path(None, [bot(), newcomer.clone()])
        .unwrap();
    c.admit("newcomer", false).unwrap().refund();
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("quota.json");
    std::fs::write(&bad, "{}").unwrap();
    assert!(
        c.reload_from_optional_path(Some(&bad), [bot(), newcomer])
            .is_err()
    );
    let s = c.snapshot();
    assert_eq!((s.reloads_applied, s.reloads_rejected), (1, 1));
}

#[test]
fn metrics_have_no_empty_label_sets_and_export_each_clients_tokens() {
    let c = controller(10, 5, 5);
    c.admit("bot", false).unwrap().refund();
    drop(c.admit("bot", false).unwrap());
    let text = metrics::render(&c);
    assert!(!text.contains("{}"), "{text}");
    assert!(
        text.contains("\nadmission_clock_regressions_total 0\n"),
        "{text}"
    );
    assert!(
        text.contains("\nadmission_client_tokens{client=\"bot\"} 9\n"),
        "{text}"
    );
    let families = metrics::render_families(&c);
    assert!(!families.contains("# EOF"));
    assert_eq!(format!("{families}# EOF\n"), text);
}
