//! SPEC section 6, "a restart never resets a quota", for the rate: after `kill -9`, `admission
//! serve` rebuilds each client's bucket from the creation times of its recent operations.
#![cfg(feature = "broker")]

mod serve_support;

use serve_support::{AGENT_SECRET, Files, OTHER_SECRET, Server, eventually};

/// `agent` may submit 3 an hour; `other` 2 every 2 seconds.
const LIMITS: &str = r#"{"requests_per_window": 60, "window_seconds": 60, "client_active": 25,
  "client_pending": 10, "global_active": 100, "global_executing": 10,
  "clients": {
    "agent": {"requests_per_window": 3, "window_seconds": 3600, "active": 25, "pending": 10},
    "other": {"requests_per_window": 2, "window_seconds": 2, "active": 25, "pending": 10}
  }}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_spent_before_kill_9_is_still_spent_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    let server = Server::spawn(None, &files.args());
    // Three admissions: two left pending, one run to its end (terminal work counts as much as
    // live work).
    for (key, operation) in [
        ("a1", "demo.request"),
        ("a2", "demo.run"),
        ("a3", "demo.request"),
    ] {
        let (status, _, op) = server.submit(AGENT_SECRET, key, operation).await;
        assert_eq!(status, 202, "{op}");
    }
    let (status, _, refused) = server.submit(AGENT_SECRET, "a4", "demo.request").await;
    assert_eq!(status, 429, "{refused}");
    for key in ["o1", "o2"] {
        assert_eq!(server.submit(OTHER_SECRET, key, "demo.run").await.0, 202);
    }

    drop(server); // SIGKILL: nothing of the buckets was written anywhere.

    let server = Server::spawn(None, &files.args());
    let (status, retry_after, refused) = server.submit(AGENT_SECRET, "a5", "demo.request").await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "submission_rate_limited");
    // The oldest admission's token comes back 20 minutes after it was taken, not before.
    let retry_after = retry_after.expect("a Retry-After header");
    assert!((1..=1200).contains(&retry_after), "{retry_after}");
    assert!(retry_after > 600, "{retry_after}");

    // `other`'s window is 2 s: its bucket refills, and it is admitted again.
    let mut key = 0;
    assert!(
        eventually(async || {
            key += 1;
            server
                .submit(OTHER_SECRET, &format!("o-after-{key}"), "demo.run")
                .await
                .0
                == 202
        })
        .await
    );
}
