//! SPEC section 6, "a restart never resets a quota": a controller rebuilt after a restart replays
//! the client's recent admissions into its rate bucket.

use std::collections::BTreeMap;
use std::time::Duration;

use unyolo_admission::{
    ClientLimits, Config, Controller, Identity, Limits, ManualClock, RefusalCode,
};

fn id(name: &str) -> Identity {
    Identity::new(name).unwrap()
}

/// A controller where `bot` may submit `n` per `w` seconds, on a manual clock.
fn controller(n: u32, w: u32) -> (Controller, ManualClock) {
    let limits = ClientLimits {
        requests_per_window: n,
        window_seconds: w,
        active: 25,
        pending: 10,
    };
    let overrides: BTreeMap<Identity, ClientLimits> = [(id("bot"), limits)].into();
    let config = Config::new(Limits::DEFAULT, overrides, [id("bot"), id("other")]).unwrap();
    let clock = ManualClock::new();
    (
        Controller::builder(config).clock(clock.clone()).build(),
        clock,
    )
}

#[test]
fn a_bucket_spent_before_a_restart_is_still_spent_after_it() {
    let (controller, _clock) = controller(3, 3600);
    let ago = [5, 4, 3].map(Duration::from_secs);
    controller.restore_rate(id("bot"), ago);
    let refusal = controller.admit("bot", false).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    // The oldest admission's token returns one interval (20 minutes) after it was made.
    assert_eq!(refusal.retry_after, Duration::from_secs(1200 - 5));
    // Another client's bucket is untouched.
    assert!(controller.admit("other", false).is_ok());
}

#[test]
fn admissions_older_than_the_window_leave_the_bucket_full() {
    let (controller, _clock) = controller(2, 2);
    controller.restore_rate(id("bot"), [3, 4, 10].map(Duration::from_secs));
    assert!(controller.admit("bot", false).is_ok());
    assert!(controller.admit("bot", false).is_ok());
    assert!(controller.admit("bot", false).is_err());
}

#[test]
fn a_partly_spent_bucket_keeps_what_was_left() {
    let (controller, clock) = controller(3, 60);
    controller.restore_rate(id("bot"), [Duration::from_secs(1)]);
    assert!(controller.admit("bot", false).is_ok());
    assert!(controller.admit("bot", false).is_ok());
    assert_eq!(
        controller.admit("bot", false).unwrap_err().code,
        RefusalCode::SubmissionRateLimited
    );
    // The restored admission's token is back 20 s after it was made.
    clock.advance(Duration::from_secs(19));
    assert!(controller.admit("bot", false).is_ok());
}

#[test]
fn restoring_the_rate_of_an_unconfigured_identity_changes_nothing() {
    let (controller, _clock) = controller(1, 60);
    controller.restore_rate(id("ghost"), [Duration::ZERO]);
    assert!(controller.admit("bot", false).is_ok());
    assert_eq!(
        controller.admit("ghost", false).unwrap_err().code,
        RefusalCode::ClientUnconfigured
    );
}
