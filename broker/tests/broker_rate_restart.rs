//! SPEC section 6, "a restart never resets a quota", for the rate: after `kill -9`, `admission
//! serve` rebuilds each client's bucket from the creation times of its recent operations.

mod support;

use support::eventually::eventually;
use support::http::{Reply, request};
use support::secrets::{AGENT_SECRET, OTHER_SECRET};
use support::serve::{Files, Server};

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
        let Reply {
            status, body: op, ..
        } = server
            .submit(AGENT_SECRET, &request(key, operation, 0))
            .await;
        assert_eq!(status, 202, "{op}");
    }
    let Reply {
        status,
        body: refused,
        ..
    } = server
        .submit(AGENT_SECRET, &request("a4", "demo.request", 0))
        .await;
    assert_eq!(status, 429, "{refused}");
    for key in ["o1", "o2"] {
        assert_eq!(
            server
                .submit(OTHER_SECRET, &request(key, "demo.run", 0))
                .await
                .status,
            202
        );
    }

    drop(server); // SIGKILL: nothing of the buckets was written anywhere.

    let server = Server::spawn(None, &files.args());
    let reply = server
        .submit(AGENT_SECRET, &request("a5", "demo.request", 0))
        .await;
    let (status, retry_after, refused) = (reply.status, reply.retry_after(), reply.body);
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
                .submit(
                    OTHER_SECRET,
                    &request(&format!("o-after-{key}"), "demo.run", 0),
                )
                .await
                .status
                == 202
        })
        .await
    );
}
