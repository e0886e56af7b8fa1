//! Pending expiry (`serve --pending-timeout`), against the `admission serve` binary: a request
//! nobody decides ends `expired` (the agent's long poll wakes on it, its error says why), its
//! slot is released like any terminal transition (a submission the pending limit refused
//! before is admitted after), the counts still equal the store, and `request.expired` is in the
//! event log; a request keeps the deadline it was created with across restarts (one restored
//! after it expires at start-up); a zero or unreadable timeout stops `serve` before it starts.

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
    let mut args = support::broker::serve_args(files);
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

/// A request keeps the deadline it was created with (as upstream's grant keeps its
/// `PendingExpiresAt`), whatever `--pending-timeout` a later start has: one restored past it
/// expires at start-up under a longer timeout, and one restored under a shorter timeout waits
/// its whole time, its `pending_expires_at` unchanged.
#[tokio::test]
async fn a_request_keeps_its_deadline_across_restarts_with_another_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_PENDING);
    let short = {
        let server = Server::spawn(None, &args(&files, "2s"));
        let reply = server
            .submit(AGENT_SECRET, &request("short", "demo.request", 0))
            .await;
        assert_eq!(reply.status, 202);
        reply.id()
        // Killed (SIGKILL) here: the request is still pending on disk.
    };
    let (long, deadline) = {
        let server = Server::spawn(None, &args(&files, "1h"));
        let path = format!("/api/agent/v1/operations/{short}");
        assert_eventually("the restored request expires", async || {
            server.get(&path, AGENT_SECRET).await.state() == "expired"
        })
        .await;
        assert_eq!(drift(&server).await, 0);
        let reply = server
            .submit(AGENT_SECRET, &request("long", "demo.request", 0))
            .await;
        assert_eq!(reply.status, 202, "its slot was released: {}", reply.body);
        let shown = server.operator.request(&reply.id()).await.body;
        (reply.id(), shown["pending_expires_at"].clone())
    };
    assert!(deadline.is_string(), "{deadline}");
    let server = Server::spawn(None, &args(&files, "1s"));
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let shown = server.operator.request(&long).await.body;
    assert_eq!(shown["status"], "pending", "{shown}");
    assert_eq!(shown["pending_expires_at"], deadline);
    let op = server
        .get(&format!("/api/agent/v1/operations/{long}"), AGENT_SECRET)
        .await;
    assert_eq!(op.state(), "pending");
    assert_eq!(drift(&server).await, 0);
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

/// One execution slot, so approved work waits for it while a long run holds it.
const ONE_SLOT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 10, "client_pending": 5, "global_active": 100, "global_executing": 1}"#;

/// Starts a long `demo.run` and waits until it holds the one execution slot.
async fn hold_the_slot(server: &Server) {
    let long = server
        .submit(AGENT_SECRET, &request("long", "demo.run", 600_000))
        .await;
    assert_eq!(long.status, 202, "{}", long.body);
    let path = format!("/api/agent/v1/operations/{}", long.id());
    assert_eventually("the long run holds the slot", async || {
        server.get(&path, AGENT_SECRET).await.state() == "executing"
    })
    .await;
}

/// Approves request `id` at revision 1 for `seconds`; the committed request.
async fn approve_for(server: &Server, id: &str, seconds: u64) -> serde_json::Value {
    let approved = server
        .operator
        .decide(
            id,
            "approve",
            &serde_json::json!({"expected_revision": 1, "idempotency_key": "approve",
                "constraints": {"duration_seconds": seconds}}),
        )
        .await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    approved.body
}

fn millis(at: &serde_json::Value) -> u128 {
    let at = humantime::parse_rfc3339(at.as_str().unwrap()).unwrap();
    at.duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

#[tokio::test]
async fn an_approval_that_lapses_before_a_slot_frees_expires_and_releases_what_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_SLOT);
    let server = Server::spawn(None, &support::broker::serve_args(&files));
    // Asked for before the slot is taken (a full pool admits no new work).
    let waits = server
        .submit(AGENT_SECRET, &request("waits", "demo.request", 0))
        .await;
    assert_eq!(waits.status, 202, "{}", waits.body);
    let id = waits.id();
    hold_the_slot(&server).await;
    // Granted one second: it is active until then, and says so.
    let approved = approve_for(&server, &id, 1).await;
    assert_eq!(approved["status"], "active", "{approved}");
    assert_eq!(
        millis(&approved["active_expires_at"]) - millis(&approved["decided_at"]),
        1000,
        "{approved}"
    );
    assert_eq!(
        server
            .metric("admission_operations{state=\"queued\"}")
            .await,
        Some(1)
    );

    // It never got the slot: the approval lapses, and the agent's long poll wakes on it.
    let waited = server
        .get(
            &format!("/api/agent/v1/operations/{id}/events?after_revision=2&wait_seconds=30"),
            AGENT_SECRET,
        )
        .await;
    assert_eq!(waited.state(), "expired", "{}", waited.body);
    assert_eq!(waited.body["revision"], 3);
    assert_eq!(waited.body["error"]["code"], "operation_approval_expired");
    assert!(
        waited.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("approval lapsed"),
        "{}",
        waited.body
    );
    let request_now = server.operator.request(&id).await;
    assert_eq!(
        request_now.body["status"], "expired",
        "{}",
        request_now.body
    );
    assert_eq!(
        request_now.body["active_expires_at"],
        approved["active_expires_at"]
    );
    assert_eq!(request_now.body["allowed_actions"], serde_json::json!([]));
    // Nothing is left to revoke; its queued slot is released and the counts equal the store.
    let revoke = server.operator.revoke(&id).await;
    assert_eq!(
        (revoke.status, revoke.code()),
        (409, "invalid_transition"),
        "{}",
        revoke.body
    );
    assert_eq!(
        server
            .metric("admission_operations{state=\"queued\"}")
            .await,
        Some(0)
    );
    assert_eq!(drift(&server).await, 0);
    let mut stream = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let kinds: Vec<(String, u64)> = stream
        .next_events(3)
        .await
        .iter()
        .map(|e| {
            (
                e["kind"].as_str().unwrap().to_owned(),
                e["revision"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("request.created".to_owned(), 1),
            ("request.approved".to_owned(), 2),
            ("request.expired".to_owned(), 3)
        ]
    );
}

#[tokio::test]
async fn work_that_starts_before_its_approval_lapses_runs_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_SLOT);
    let server = Server::spawn(None, &support::broker::serve_args(&files));
    let id = server
        .submit(AGENT_SECRET, &request("runs", "demo.request", 1500))
        .await
        .id();
    approve_for(&server, &id, 1).await;
    // The slot is free, so it starts at once, and runs past its lapse to success.
    let path = format!("/api/agent/v1/operations/{id}");
    assert_eventually("it runs to its end", async || {
        server.get(&path, AGENT_SECRET).await.state() == "succeeded"
    })
    .await;
    let request_now = server.operator.request(&id).await;
    assert_eq!(
        request_now.body["status"], "consumed",
        "{}",
        request_now.body
    );
    assert_eq!(drift(&server).await, 0);
}

#[tokio::test]
async fn an_approval_restored_past_its_lapse_never_starts_and_expires_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_SLOT);
    let id = {
        let server = Server::spawn(None, &support::broker::serve_args(&files));
        let kept = server
            .submit(AGENT_SECRET, &request("kept", "demo.request", 0))
            .await;
        assert_eq!(kept.status, 202, "{}", kept.body);
        let id = kept.id();
        hold_the_slot(&server).await;
        approve_for(&server, &id, 1).await;
        id
        // Killed (SIGKILL) here, before the lapse: the request is approved on disk.
    };
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    // The long run was interrupted, so the slot is free at start-up: the lapsed approval must
    // still not start.
    let server = Server::spawn(None, &support::broker::serve_args(&files));
    let path = format!("/api/agent/v1/operations/{id}");
    assert_eventually("the restored approval expires", async || {
        server.get(&path, AGENT_SECRET).await.state() == "expired"
    })
    .await;
    let op = server.get(&path, AGENT_SECRET).await;
    assert_eq!(op.body["error"]["code"], "operation_approval_expired");
    assert_eq!(drift(&server).await, 0);
}
