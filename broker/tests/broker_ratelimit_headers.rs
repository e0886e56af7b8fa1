//! The quota fields: every submission answer (202, 200 replay, 429) carries `RateLimit-Policy`
//! and `RateLimit` as structured fields, exact from the engine; parsed back here with `sfv`.

mod support;

use std::time::Duration;

use support::broker::start;
use support::http::request;
use support::quota::{FIVE_AN_HOUR, Param, Quota};
use support::secrets::{AGENT, AGENT_SECRET, OTHER_SECRET};
use unyolo_admission::{Config, Controller, Identity, ManualClock, RefusalCode};

#[tokio::test]
async fn every_submission_outcome_carries_both_fields_exact_from_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), FIVE_AN_HOUR).await;

    let created = h
        .submit(AGENT_SECRET, &request("k-0", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202);
    let q = Quota::of(&created);
    assert_eq!(q.policy("rate", "q"), Some(5));
    assert_eq!(q.policy("rate", "w"), Some(3600));
    assert_eq!(q.policy("active", "q"), Some(25));
    assert_eq!(q.policy("pending", "q"), Some(10));
    for capacity in ["active", "pending"] {
        assert_eq!(
            q.policy.get(capacity).and_then(|p| p.get("qu")),
            Some(&Param::Str("concurrent-requests".into()))
        );
    }
    assert_eq!(q.limit("rate", "r"), Some(4));
    // One token back every 720 s; one was just taken.
    let reset = q.limit("rate", "t").unwrap();
    assert!((1..=720).contains(&reset), "rate reset {reset}");
    assert_eq!(q.limit("active", "r"), Some(24));
    assert_eq!(q.limit("pending", "r"), Some(9));
    assert_eq!(q.limit("pending", "t"), None, "a free slot has no reset");

    let replayed = h
        .submit(AGENT_SECRET, &request("k-0", "demo.request", 0))
        .await;
    assert_eq!(replayed.status, 200);
    let q = Quota::of(&replayed);
    assert_eq!(q.limit("rate", "r"), Some(4), "a replay consumes nothing");
    assert_eq!(q.limit("active", "r"), Some(24));
    assert_eq!(q.limit("pending", "r"), Some(9));

    for i in 1..5 {
        let reply = h
            .submit(AGENT_SECRET, &request(&format!("k-{i}"), "demo.request", 0))
            .await;
        assert_eq!(reply.status, 202);
        assert_eq!(Quota::of(&reply).limit("rate", "r"), Some(4 - i));
    }
    let refused = h
        .submit(AGENT_SECRET, &request("k-5", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.code(), "submission_rate_limited");
    let q = Quota::of(&refused);
    assert_eq!(q.limit("rate", "r"), Some(0));
    assert_eq!(
        q.limit("rate", "t").map(|t| t as u64),
        refused.retry_after(),
        "the refused policy resets when Retry-After says"
    );
    assert_eq!(q.limit("pending", "r"), Some(5), "a refusal takes no slot");

    // The other client's quota is its own.
    let theirs = h
        .submit(OTHER_SECRET, &request("k-0", "demo.request", 0))
        .await;
    assert_eq!(theirs.status, 202);
    assert_eq!(Quota::of(&theirs).limit("rate", "r"), Some(4));
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_capacity_refusal_names_the_full_policy_with_retry_after_as_its_reset() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 86400,
      "client_active": 25, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;
    let h = start(dir.path(), limits).await;
    for key in ["a", "b"] {
        assert_eq!(
            h.submit(AGENT_SECRET, &request(key, "demo.request", 0))
                .await
                .status,
            202
        );
    }
    let refused = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.code(), "client_pending_limit");
    let q = Quota::of(&refused);
    assert_eq!(q.policy("pending", "q"), Some(2));
    assert_eq!(q.limit("pending", "r"), Some(0));
    assert_eq!(
        q.limit("pending", "t").map(|t| t as u64),
        refused.retry_after()
    );
    assert_eq!(q.limit("active", "r"), Some(23));
    assert_eq!(
        q.limit("rate", "r"),
        Some(998),
        "a capacity refusal gives its token back"
    );

    // Work that needs no approval is not held by the pending policy, and its answer says so.
    let run = h.submit(AGENT_SECRET, &request("d", "demo.run", 0)).await;
    assert_eq!(run.status, 202);
    let q = Quota::of(&run);
    assert_eq!(q.limit("pending", "r"), Some(0));
    assert_eq!(q.limit("pending", "t"), Some(2), "the capacity hint");
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_reload_that_changes_the_rate_changes_both_fields() {
    let dir = tempfile::tempdir().unwrap();
    let ten_a_minute = r#"{"requests_per_window": 10, "window_seconds": 60,
      "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#;
    let h = start(dir.path(), ten_a_minute).await;
    for key in ["a", "b"] {
        let reply = h
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(Quota::of(&reply).policy("rate", "q"), Some(10));
    }

    let file = dir.path().join("limits.json");
    std::fs::write(
        &file,
        r#"{"requests_per_window": 100, "window_seconds": 1000,
      "client_active": 20, "client_pending": 4, "global_active": 100, "global_executing": 10}"#,
    )
    .unwrap();
    h.broker.reload_from_path(&file).unwrap();

    let before = h.broker.controller().quota(AGENT).unwrap();
    let reply = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    let after = h.broker.controller().quota(AGENT).unwrap();
    assert_eq!(reply.status, 202);
    let q = Quota::of(&reply);
    assert_eq!(q.policy("rate", "q"), Some(100));
    assert_eq!(q.policy("rate", "w"), Some(1000));
    assert_eq!(q.policy("active", "q"), Some(20));
    assert_eq!(q.policy("pending", "q"), Some(4));
    // The bucket kept its fill fraction (two of ten used → about twenty of a hundred), so the
    // answer lies between the engine's readings around the submission.
    let remaining = q.limit("rate", "r").unwrap() as u64;
    assert!(
        before.rate.remaining <= 80 + 1,
        "no fresh burst: {before:?}"
    );
    assert!(
        (before.rate.remaining - 1..=after.rate.remaining).contains(&remaining),
        "{} not within {before:?} .. {after:?}",
        remaining
    );
    assert_eq!(q.limit("pending", "r"), Some(1));
    assert_eq!(q.limit("active", "r"), Some(17));
    h.broker.shutdown().await;
}

#[tokio::test]
async fn an_unauthenticated_or_invalid_submission_carries_no_quota() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), FIVE_AN_HOUR).await;
    let bad = h.submit("nobody", &request("k", "demo.request", 0)).await;
    assert_eq!(bad.status, 403);
    assert!(bad.header("ratelimit").is_none());
    let mut invalid = request("k", "demo.request", 0);
    invalid["reason"] = "".into();
    let reply = h.submit(AGENT_SECRET, &invalid).await;
    assert_eq!(reply.status, 400);
    assert!(reply.header("ratelimit-policy").is_none());
    assert_eq!(
        h.broker.controller().quota(AGENT).unwrap().rate.remaining,
        5
    );
    h.broker.shutdown().await;
}

fn manual(limits: &str) -> (Controller, ManualClock) {
    let clock = ManualClock::new();
    clock.set_nanos(1_000_000_000);
    let config = Config::from_bytes(limits.as_bytes(), [Identity::new("bot").unwrap()]).unwrap();
    (
        Controller::builder(config).clock(clock.clone()).build(),
        clock,
    )
}

#[test]
fn reading_the_quota_takes_nothing_and_changes_no_decision() {
    let one = r#"{"requests_per_window": 1, "window_seconds": 60,
      "client_active": 1, "client_pending": 1, "global_active": 10, "global_executing": 10}"#;
    let (controller, _clock) = manual(one);
    let fresh = controller.quota("bot").unwrap();
    for _ in 0..1000 {
        assert_eq!(controller.quota("bot").unwrap(), fresh);
    }
    assert_eq!(fresh.rate.remaining, 1);
    assert_eq!(fresh.rate.next_token_nanos, 0);
    let permit = controller.admit("bot", true).unwrap();
    let refusal = controller.admit("bot", true).unwrap_err();
    assert_eq!(refusal.code, RefusalCode::SubmissionRateLimited);
    let spent = controller.quota("bot").unwrap();
    assert_eq!(spent.rate.remaining, 0);
    assert_eq!(spent.rate.next_token_secs(), refusal.retry_after_secs());
    assert_eq!((spent.active.used, spent.pending.used), (1, 1));
    drop(permit);
    assert!(controller.quota("nobody").is_none());
}

#[test]
fn a_refund_returns_the_token_and_the_slots_the_quota_showed_taken() {
    let (controller, clock) = manual(FIVE_AN_HOUR);
    let permit = controller.admit("bot", true).unwrap();
    let taken = controller.quota("bot").unwrap();
    assert_eq!(taken.rate.remaining, 4);
    assert_eq!(taken.rate.next_token_nanos, 720_000_000_000);
    assert_eq!((taken.active.used, taken.pending.used), (1, 1));
    permit.refund();
    let refunded = controller.quota("bot").unwrap();
    assert_eq!(refunded.rate.remaining, 5);
    assert_eq!(refunded.rate.next_token_nanos, 0);
    assert_eq!((refunded.active.used, refunded.pending.used), (0, 0));

    // A refund after a reload changed the rate returns the token taken, rescaled with the bucket.
    clock.advance(Duration::from_secs(1));
    let permit = controller.admit("bot", false).unwrap();
    let identities = [Identity::new("bot").unwrap()];
    controller.reload(
        Config::from_bytes(
            br#"{"requests_per_window": 50, "window_seconds": 3600,
      "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#,
            identities,
        )
        .unwrap(),
    );
    let rescaled = controller.quota("bot").unwrap();
    assert_eq!((rescaled.rate.quota, rescaled.rate.remaining), (50, 40));
    permit.refund();
    let after = controller.quota("bot").unwrap();
    // The permit returns exactly the token it took: a fifth of the bucket it was admitted from,
    // which the reload rescaled to ten of the new 72 s tokens, so the bucket is full again.
    assert_eq!(after.rate.remaining, 50);
    assert_eq!(after.rate.next_token_nanos, 0);
    let snapshot = controller.snapshot();
    let bot = snapshot.client("bot").unwrap();
    assert_eq!(after.rate.remaining, bot.tokens);
    assert_eq!(
        (after.active.used, after.pending.used),
        (bot.active, bot.pending)
    );
    assert_eq!(after.active.used, 0);
}

#[test]
fn the_pending_quota_is_the_limit_that_binds_and_a_removed_client_has_none() {
    let identities = || {
        [
            Identity::new("bot").unwrap(),
            Identity::new("gone").unwrap(),
        ]
    };
    // `bot` may have 15 pending, but the pending-grant store holds 10 per client.
    let config = Config::from_bytes(
        br#"{"requests_per_window": 60, "window_seconds": 60,
      "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10,
      "clients": {"bot": {"requests_per_window": 60, "window_seconds": 60, "active": 20, "pending": 15}}}"#,
        identities(),
    )
    .unwrap();
    let controller = Controller::new(config);
    let quota = controller.quota("bot").unwrap();
    assert_eq!(quota.pending.limit, 10);
    assert_eq!(quota.active.limit, 20);
    let text = unyolo_admission::metrics::render(&controller);
    assert!(
        text.contains(r#"admission_client_limit{client="bot",limit="pending"} 10"#),
        "{text}"
    );

    let held = controller.admit("gone", false).unwrap().commit();
    controller.reload(Config::defaults([Identity::new("bot").unwrap()]));
    assert!(
        controller.quota("gone").is_none(),
        "a removed client cannot be admitted, so it has no quota"
    );
    assert_eq!(controller.snapshot().client("gone").unwrap().active, 1);
    held.cancel().unwrap();
}
