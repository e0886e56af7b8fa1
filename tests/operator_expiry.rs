//! Pending expiry (`serve --pending-timeout`), against the `admission serve` binary: a request
//! nobody decides ends `expired` (the agent's long poll wakes on it, its error says why), its
//! slot is released like any terminal transition (a submission the pending limit refused
//! before is admitted after), the counts still equal the store, and `request.expired` is in the
//! event log; a request restored after its time expires at start-up; a zero or unreadable
//! timeout stops `serve` before it starts.
#![cfg(feature = "broker")]

mod support;

use support::events::open;
use support::eventually::assert_eventually;
use support::http::request;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET};
use support::serve::{Files, Server, run_to_end};

/// One pending request per client at most, so a second one is refused until the first ends.
const ONE_PENDING: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 10, "client_pending": 1, "global_active": 100, "global_executing": 4}"#;

fn args(files: &Files, timeout: &str) -> Vec<String> {
    let mut args = files.args();
    args.extend(["--pending-timeout".to_owned(), timeout.to_owned()]);
    args
}

async fn drift(server: &Server) -> u64 {
    server.operator.drift().await["drift"].as_u64().unwrap()
}

#[tokio::test]
async fn a_request_nobody_decides_expires_releases_its_slot_and_leaves_its_event() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_PENDING);
    let server = Server::spawn(None, &args(&files, "2s"));
    let first = server
        .submit(AGENT_SECRET, &request("first", "demo.request", 0))
        .await;
    assert_eq!(first.status, 202, "{}", first.body);
    let id = first.id();
    let refused = server
        .submit(AGENT_SECRET, &request("second", "demo.request", 0))
        .await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "client_pending_limit")
    );

    // The agent's long poll wakes on the expiry (the poll's own bound is longer than the timeout).
    let waited = server
        .get(
            &format!("/api/agent/v1/operations/{id}/events?after_revision=1&wait_seconds=30"),
            AGENT_SECRET,
        )
        .await;
    assert_eq!(waited.status, 200);
    assert_eq!(waited.state(), "expired", "{}", waited.body);
    assert_eq!(waited.body["revision"], 2);
    assert_eq!(waited.body["error"]["code"], "operation_approval_expired");
    assert!(waited.body["terminal_at"].is_string());

    // Its pending slot is free: the submission refused before is admitted now.
    let again = server
        .submit(AGENT_SECRET, &request("second", "demo.request", 0))
        .await;
    assert_eq!(again.status, 202, "{}", again.body);
    assert_eq!(drift(&server).await, 0);

    let mut stream = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let events = stream.next_events(3).await;
    let first_events: Vec<(&str, u64, &str)> = events
        .iter()
        .filter(|e| e["request_id"] == id.as_str())
        .map(|e| {
            (
                e["kind"].as_str().unwrap(),
                e["revision"].as_u64().unwrap(),
                e["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        first_events,
        [
            ("request.created", 1, "pending"),
            ("request.expired", 2, "expired")
        ]
    );
    // A decision after the expiry finds it no longer pending and changes nothing.
    let late = server.operator.approve(&id).await;
    assert_eq!(late.status, 409, "{}", late.body);
    let after = server
        .get(&format!("/api/agent/v1/operations/{id}"), AGENT_SECRET)
        .await;
    assert_eq!(
        (after.state(), after.body["revision"].as_u64()),
        ("expired", Some(2))
    );
    assert_eq!(
        server
            .metric("admission_operations{state=\"pending\"}")
            .await,
        Some(1),
        "only the new request is pending"
    );
}

#[tokio::test]
async fn a_request_restored_past_its_timeout_expires_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_PENDING);
    let id = {
        let server = Server::spawn(None, &args(&files, "1h"));
        let reply = server
            .submit(AGENT_SECRET, &request("kept", "demo.request", 0))
            .await;
        assert_eq!(reply.status, 202);
        reply.id()
        // Killed (SIGKILL) here: the request is still pending on disk.
    };
    let server = Server::spawn(None, &args(&files, "1s"));
    let path = format!("/api/agent/v1/operations/{id}");
    assert_eventually("the restored request expires", async || {
        server.get(&path, AGENT_SECRET).await.state() == "expired"
    })
    .await;
    assert_eq!(drift(&server).await, 0);
    let reply = server
        .submit(AGENT_SECRET, &request("next", "demo.request", 0))
        .await;
    assert_eq!(reply.status, 202, "its slot was released: {}", reply.body);
}

#[test]
fn a_zero_or_unreadable_pending_timeout_stops_serve_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_PENDING);
    let zero = run_to_end(&args(&files, "0s"));
    assert_eq!(zero.code, Some(1), "{}", zero.stderr);
    assert!(
        zero.stderr.contains("--pending-timeout must be above zero"),
        "{}",
        zero.stderr
    );
    let unreadable = run_to_end(&args(&files, "soon"));
    assert_eq!(unreadable.code, Some(2), "{}", unreadable.stderr);
    assert!(
        unreadable.stderr.contains("--pending-timeout"),
        "{}",
        unreadable.stderr
    );
    // Nothing was created: neither run opened the store.
    assert!(!files.data.join("admission.sqlite3").exists());
}
