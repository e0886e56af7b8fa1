//! The broker under overload, over real HTTP: refusals write nothing and say when to retry,
//! replay and the exempt paths keep answering, concurrent duplicates create one operation, limits
//! hold under concurrency, and the stream store's caps bind.

mod support;

use std::sync::Arc;

use serde_json::json;
use support::broker::{Harness, ROOMY, settings, start, start_with};
use support::eventually::eventually;
use support::http::{Reply, request};
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET, OTHER_SECRET};
use unyolo_admission::config::Secrets;
use unyolo_admission::engine::StoreCaps;
use unyolo_admission::{Config, StorageCaps};
use unyolo_admission_broker::BrokerSettings;

const TIGHT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;

#[tokio::test]
async fn the_overload_drill_passes() {
    let dir = tempfile::tempdir().unwrap();
    let steps = unyolo_admission_broker::drill::walk(dir.path()).await;
    let table = unyolo_admission_broker::drill::table(&steps);
    assert!(steps.len() >= 15, "{table}");
    assert!(steps.iter().all(|s| s.passed), "{table}");
    // An operation that ended with an error of its own (canceled, denied) is a 200 shown by its
    // state, not as a failed call.
    assert!(!table.contains("200 operation_"), "{table}");
}

#[tokio::test]
async fn a_refusal_is_429_with_an_integer_retry_after_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), TIGHT).await;
    for key in ["a", "b"] {
        assert_eq!(
            h.submit(AGENT_SECRET, &request(key, "demo.request", 0))
                .await
                .status,
            202
        );
    }
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let reply = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    assert_eq!((reply.status, reply.code()), (429, "client_pending_limit"));
    assert_eq!(
        reply.body["error"]["message"],
        "Operation admission limit reached"
    );
    assert_eq!(reply.retry_after(), Some(2));
    assert_eq!(reply.header("cache-control"), Some("no-store"));
    assert_eq!(h.rows().await, rows);
    let after = h.snapshot();
    assert_eq!(after.active, snapshot.active);
    assert_eq!(after.pending, snapshot.pending);
    assert_eq!(after.admitted, snapshot.admitted);
    let listed = h.get("/api/agent/v1/operations", Some(AGENT_SECRET)).await;
    assert_eq!(listed.body["operations"].as_array().unwrap().len(), 2);
    let pending = h
        .operator
        .get("/api/operator/v1/requests?status=pending")
        .await;
    assert_eq!(
        pending.body["requests"].as_array().unwrap().len(),
        2,
        "no approval request"
    );
}

#[tokio::test]
async fn a_rate_refusal_says_when_the_next_token_comes() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 2, "window_seconds": 60,
      "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;
    let h = start(dir.path(), limits).await;
    for key in ["a", "b"] {
        assert_eq!(
            h.submit(AGENT_SECRET, &request(key, "demo.run", 0))
                .await
                .status,
            202
        );
    }
    let rows = h.rows().await;
    let reply = h.submit(AGENT_SECRET, &request("c", "demo.run", 0)).await;
    assert_eq!(
        (reply.status, reply.code()),
        (429, "submission_rate_limited")
    );
    let after = reply.retry_after().expect("an integer Retry-After");
    assert!(
        (29..=30).contains(&after),
        "one token every 30 s, got {after}"
    );
    assert_eq!(h.rows().await, rows);
    // The other client has its own bucket.
    assert_eq!(
        h.submit(OTHER_SECRET, &request("a", "demo.run", 0))
            .await
            .status,
        202
    );
}

#[tokio::test]
async fn replay_answers_over_every_limit_up_to_key_order_and_consumes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 3, "window_seconds": 3600,
      "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;
    let h = start(dir.path(), limits).await;
    let first = h
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    h.submit(AGENT_SECRET, &request("b", "demo.request", 0))
        .await;
    h.submit(AGENT_SECRET, &request("c", "demo.run", 60_000))
        .await;
    // Now over every limit: no token, active 3 of 3, pending 2 of 2.
    let refused = h
        .submit(AGENT_SECRET, &request("d", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 429);
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let reordered = r#"{"reason": "end-to-end test", "arguments": {"duration_ms": 0},
        "target": {"branch": "main", "repo": "unyolo/test"},
        "operation": "demo.request", "idempotency_key": "a"}"#;
    for _ in 0..3 {
        let reply = h
            .send(
                "POST",
                "/api/agent/v1/operations",
                Some(AGENT_SECRET),
                Some(reordered.into()),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.body, first.body);
    }
    assert_eq!(h.rows().await, rows);
    assert_eq!(h.snapshot(), snapshot, "replay consumed something");
    // Replay answers in any state, even terminal.
    let denied = h.operator.deny(&first.id()).await;
    assert_eq!(denied.state(), "denied");
    let reply = h
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!((reply.status, reply.state()), (200, "denied"));
    // Same key, different request: a conflict, still nothing consumed.
    let mut other = request("a", "demo.request", 0);
    other["target"]["branch"] = json!("dev");
    let snapshot = h.snapshot();
    let reply = h.submit(AGENT_SECRET, &other).await;
    assert_eq!((reply.status, reply.code()), (409, "idempotency_conflict"));
    assert_eq!(h.snapshot(), snapshot);
    // Keys are per client.
    let reply = h
        .submit(OTHER_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(reply.status, 202);
    let metrics = h.metrics().await;
    assert_eq!(
        metric(&metrics, r#"broker_submissions_total{result="replayed"}"#),
        Some(4)
    );
    assert_eq!(
        metric(&metrics, r#"broker_submissions_total{result="created"}"#),
        Some(4)
    );
    assert_eq!(
        metric(&metrics, r#"broker_submissions_total{result="rejected"}"#),
        Some(1)
    );
}

#[tokio::test]
async fn exempt_paths_answer_during_overload_and_never_pass_admission() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), TIGHT).await;
    let a = h
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    let b = h
        .submit(AGENT_SECRET, &request("b", "demo.request", 0))
        .await;
    let run = h
        .submit(AGENT_SECRET, &request("c", "demo.run", 60_000))
        .await;
    assert!(eventually(async || h.snapshot().executing == 1).await);
    assert_eq!(
        h.submit(AGENT_SECRET, &request("d", "demo.run", 0))
            .await
            .status,
        429
    );
    let decisions = |s: &unyolo_admission::Snapshot| (s.admitted, s.rejected);
    let before = decisions(&h.snapshot());

    assert_eq!(h.get("/healthz", None).await.status, 200);
    assert_eq!(h.get("/readyz", None).await.status, 200);
    let metrics = h.metrics().await;
    assert_eq!(
        metric(&metrics, r#"admission_operations{state="pending"}"#),
        Some(2)
    );
    assert_eq!(
        metric(&metrics, r#"admission_operations{state="executing"}"#),
        Some(1)
    );
    assert_eq!(
        metric(
            &metrics,
            r#"admission_client_operations{client="agent",state="active"}"#
        ),
        Some(3)
    );
    assert_eq!(
        metric(
            &metrics,
            r#"admission_requests_total{result="rejected",code="client_operation_limit"}"#
        ),
        Some(1)
    );
    assert!(metrics.contains("admission_storage_bytes{store=\"stream\"} 0"));
    assert!(metrics.contains("admission_config_reloads_total"));
    assert_eq!(
        h.get(
            &format!("/api/agent/v1/operations/{}", a.id()),
            Some(AGENT_SECRET)
        )
        .await
        .status,
        200
    );
    assert_eq!(
        h.get("/api/agent/v1/operations", Some(AGENT_SECRET))
            .await
            .status,
        200
    );
    assert_eq!(
        h.operator
            .get("/api/operator/v1/requests?status=pending")
            .await
            .status,
        200
    );
    let denied = h.operator.deny(&a.id()).await;
    assert_eq!(denied.state(), "denied");
    let approved = h.operator.approve(&b.id()).await;
    assert_eq!(approved.state(), "active");
    // Not pending any more (and maybe already started, a revision on, by the executor).
    let not_pending = h.operator.deny(&b.id()).await;
    assert_eq!(not_pending.status, 409, "{}", not_pending.body);
    assert!(
        ["invalid_transition", "revision_conflict"].contains(&not_pending.code()),
        "{}",
        not_pending.body
    );
    let cancel = h
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", run.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(
        (cancel.status, cancel.code()),
        (409, "operation_not_cancelable")
    );
    // Canceling a terminal operation changes nothing and answers 200.
    let again = h
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", a.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!((again.status, again.state()), (200, "denied"));
    assert_eq!(
        decisions(&h.snapshot()),
        before,
        "an exempt path passed through admission"
    );
}

#[tokio::test]
async fn cancel_releases_pending_and_queued_work_and_frees_the_slot() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 1}"#;
    let h = start(dir.path(), limits).await;
    let pending = h
        .submit(AGENT_SECRET, &request("p", "demo.request", 0))
        .await;
    let queued = h
        .submit(AGENT_SECRET, &request("q", "demo.request", 0))
        .await;
    let run = h
        .submit(OTHER_SECRET, &request("r", "demo.run", 60_000))
        .await;
    assert_eq!(run.status, 202);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    h.operator.approve(&queued.id()).await;
    assert_eq!(h.snapshot().queued, 1);
    for op in [&pending, &queued] {
        let reply = h
            .post(
                &format!("/api/agent/v1/operations/{}/cancel", op.id()),
                Some(AGENT_SECRET),
            )
            .await;
        assert_eq!((reply.status, reply.state()), (200, "canceled"));
        assert!(reply.body["terminal_at"].is_string());
    }
    let agent = h.snapshot();
    let agent = agent.client(AGENT).unwrap();
    assert!(agent.is_idle(), "{agent:?}");
    let reply = h
        .get(
            &format!("/api/agent/v1/operations/{}", queued.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(reply.state(), "canceled", "the canceled work never ran");
}

#[tokio::test]
async fn queued_work_starts_when_a_slot_is_given_back_passing_work_canceled_while_it_waited() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 1}"#;
    let h = start(dir.path(), limits).await;
    // Submitted before the run fills the pool: a saturated pool refuses new work.
    let canceled = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    let next = h
        .submit(AGENT_SECRET, &request("n", "demo.request", 0))
        .await;
    let run = h
        .submit(OTHER_SECRET, &request("r", "demo.run", 3_000))
        .await;
    assert_eq!(run.status, 202);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    for op in [&canceled, &next] {
        assert_eq!(h.operator.approve(&op.id()).await.status, 200);
    }
    assert_eq!(h.snapshot().queued, 2);
    // The oldest, the one the executor waits a slot for, is canceled: the executor lets it go.
    let reply = h
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", canceled.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!((reply.status, reply.state()), (200, "canceled"));
    // When the run gives its slot back, the next one takes it and runs to its end.
    let path = format!("/api/agent/v1/operations/{}", next.id());
    let ran = eventually(async || h.get(&path, Some(AGENT_SECRET)).await.state() == "succeeded");
    assert!(ran.await, "{}", h.get(&path, Some(AGENT_SECRET)).await.body);
    let path = format!("/api/agent/v1/operations/{}", canceled.id());
    let reply = h.get(&path, Some(AGENT_SECRET)).await;
    assert_eq!(reply.state(), "canceled", "the canceled work never ran");
    let snapshot = h.snapshot();
    assert!(snapshot.is_idle(), "{snapshot:?}");
    h.broker.shutdown().await;
}

#[tokio::test]
async fn concurrent_duplicates_create_exactly_one_operation() {
    let dir = tempfile::tempdir().unwrap();
    // Room for exactly one operation: a duplicate must never be refused or create a second.
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 1, "client_pending": 1, "global_active": 100, "global_executing": 10}"#;
    let h = Arc::new(start(dir.path(), limits).await);
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let h = Arc::clone(&h);
        tasks.push(tokio::spawn(async move {
            h.submit(AGENT_SECRET, &request("same", "demo.request", 0))
                .await
        }));
    }
    let mut statuses = Vec::new();
    let mut ids = std::collections::BTreeSet::new();
    for task in tasks {
        let reply = task.await.unwrap();
        statuses.push(reply.status);
        ids.insert(reply.id());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 202).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        31,
        "{statuses:?}"
    );
    assert_eq!(ids.len(), 1);
    assert_eq!(h.rows().await, 1);
    let s = h.snapshot();
    assert_eq!(
        (s.active, s.pending, s.admitted),
        (1, 1, 1),
        "a slot leaked"
    );
}

#[tokio::test]
async fn concurrent_distinct_submissions_never_exceed_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 5, "client_pending": 5, "global_active": 8, "global_executing": 8}"#;
    let h = Arc::new(start(dir.path(), limits).await);
    let mut tasks = Vec::new();
    for i in 0..60 {
        let h = Arc::clone(&h);
        let (token, key) = if i % 2 == 0 {
            (AGENT_SECRET, format!("agent-{i}"))
        } else {
            (OTHER_SECRET, format!("other-{i}"))
        };
        tasks.push(tokio::spawn(async move {
            h.submit(token, &request(&key, "demo.request", 0)).await
        }));
    }
    let mut created = 0;
    for task in tasks {
        let reply = task.await.unwrap();
        match reply.status {
            202 => created += 1,
            429 => assert!(
                [
                    "client_operation_limit",
                    "client_pending_limit",
                    "global_operation_limit"
                ]
                .contains(&reply.code()),
                "{}",
                reply.body
            ),
            other => panic!("unexpected {other}: {}", reply.body),
        }
    }
    assert_eq!(created, 8, "global_active binds at 8");
    assert_eq!(h.rows().await, 8);
    let s = h.snapshot();
    assert_eq!(s.active, 8);
    assert!(s.clients.iter().all(|c| c.active <= 5));
}

fn stream_caps() -> StorageCaps {
    StorageCaps {
        stream: StoreCaps {
            global_files: 3,
            global_bytes: 10_000,
            client_files: 2,
            client_bytes: 1_000,
        },
        ..StorageCaps::default()
    }
}

#[tokio::test]
async fn streams_count_against_the_stream_caps_and_delete_releases_them() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ROOMY, stream_caps())).await;
    let upload = async |token: &str, size: usize| {
        h.send(
            "POST",
            "/api/agent/v1/streams",
            Some(token),
            Some(vec![7u8; size].into()),
        )
        .await
    };
    let first = upload(AGENT_SECRET, 600).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(first.body["size"], 600);
    assert!(first.header("location").is_some());
    let stream_bytes = |h: &Harness| h.snapshot().storage[0].bytes;
    assert_eq!(stream_bytes(&h), 600);

    // Larger than the client may ever store: 413, not a 429 to retry, nothing held or written.
    let never = upload(OTHER_SECRET, 1_001).await;
    assert_eq!(
        (never.status, never.code()),
        (413, "payload_too_large"),
        "{}",
        never.body
    );
    assert_eq!(never.retry_after(), None);
    assert_eq!(stream_bytes(&h), 600);

    // Over the client's bytes: refused before the body is read, nothing held.
    let refused = upload(AGENT_SECRET, 600).await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "stream_storage_limit")
    );
    assert!(refused.retry_after().is_some_and(|s| s >= 1));
    assert_eq!(stream_bytes(&h), 600);

    // Over the client's files.
    assert_eq!(upload(AGENT_SECRET, 100).await.status, 201);
    let refused = upload(AGENT_SECRET, 1).await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "stream_storage_limit")
    );
    // Over the global files (3): the other client gets one, then is refused.
    assert_eq!(upload(OTHER_SECRET, 10).await.status, 201);
    assert_eq!(
        upload(OTHER_SECRET, 10).await.code(),
        "stream_storage_limit"
    );

    // Only the owner may delete; delete releases files and bytes.
    let path = format!("/api/agent/v1/streams/{}", first.id());
    let reply = h.send("DELETE", &path, Some(OTHER_SECRET), None).await;
    assert_eq!((reply.status, reply.code()), (404, "stream_not_found"));
    let reply = h.send("DELETE", &path, Some(AGENT_SECRET), None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(stream_bytes(&h), 110);
    let reply = h.send("DELETE", &path, Some(AGENT_SECRET), None).await;
    assert_eq!(reply.status, 404);
    assert_eq!(upload(AGENT_SECRET, 800).await.status, 201);
    assert_eq!(stream_bytes(&h), 910);

    // A restart restores the usage from the store.
    let metrics = h.metrics().await;
    assert_eq!(
        metric(&metrics, r#"admission_storage_bytes{store="stream"}"#),
        Some(910)
    );
    h.broker.shutdown().await;
    let h = start_with(settings(dir.path(), ROOMY, stream_caps())).await;
    assert_eq!(h.restored.streams, 3);
    assert_eq!(h.snapshot().storage[0].bytes, 910);
    assert_eq!(h.snapshot().storage[0].files, 3);
}

#[tokio::test]
async fn a_stream_without_content_length_or_with_a_short_body_holds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ROOMY, stream_caps())).await;
    let addr = h.broker.local_addr();
    let raw = |request: String| {
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream.write_all(request.as_bytes()).unwrap();
            stream.shutdown(std::net::Shutdown::Write).unwrap();
            let mut response = String::new();
            let _ = stream.read_to_string(&mut response);
            response
        })
    };
    let chunked = raw(format!(
        "POST /api/agent/v1/streams HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_SECRET}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    ))
    .await
    .unwrap();
    assert!(chunked.starts_with("HTTP/1.1 411"), "{chunked}");
    assert!(chunked.contains("length_required"));
    // An empty stream, its length declared as 0 (as Go's client sends it): bad input, not stored.
    let empty = h
        .http
        .post(format!("{}/api/agent/v1/streams", h.base))
        .bearer_auth(AGENT_SECRET)
        .header("content-length", "0")
        .send()
        .await
        .unwrap();
    let empty = Reply::read(empty).await.unwrap();
    assert_eq!(
        (empty.status, empty.code()),
        (400, "stream_input_invalid"),
        "{}",
        empty.body
    );
    support::contract::assert_conforms("error_envelope", &empty.body, "the empty stream's 400");
    assert_eq!(h.snapshot().storage[0].files, 0);
    // Declares 500 bytes, sends 5, then closes.
    let _ = raw(format!(
        "POST /api/agent/v1/streams HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_SECRET}\r\nContent-Length: 500\r\n\r\nhello"
    ))
    .await
    .unwrap();
    assert!(eventually(async || h.snapshot().storage[0].files == 0).await);
    assert_eq!(h.snapshot().storage[0].bytes, 0);
    let files = std::fs::read_dir(dir.path().join("streams")).map_or(0, |d| d.count());
    assert_eq!(files, 0, "a partial body was left on disk");
}

/// A client removed from the secrets file while it had pending work: after the restart its
/// operations still count against the global limits, the operator can still decide them, and the
/// client itself can no longer authenticate.
#[tokio::test]
async fn work_of_a_client_removed_from_the_secrets_survives_a_restart_and_can_be_decided() {
    let dir = tempfile::tempdir().unwrap();
    let limits = r#"{"requests_per_window": 1000, "window_seconds": 60, "client_active": 2,
      "client_pending": 2, "global_active": 3, "global_executing": 2}"#;
    let h = start(dir.path(), limits).await;
    let first = h
        .submit(OTHER_SECRET, &request("gone-1", "demo.request", 0))
        .await;
    let second = h
        .submit(OTHER_SECRET, &request("gone-2", "demo.request", 0))
        .await;
    assert_eq!((first.status, second.status), (202, 202));
    h.broker.shutdown().await;

    // Restart with only AGENT configured.
    let secrets = Secrets::parse(&format!("{AGENT} = {AGENT_SECRET}\n")).unwrap();
    let config = Config::from_bytes(
        limits.as_bytes(),
        secrets.identities().cloned().collect::<Vec<_>>(),
    )
    .unwrap();
    let settings = BrokerSettings {
        config,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().to_owned(),
            secrets,
            support::secrets::operators(),
        )
    };
    let h = start_with(settings).await;
    assert_eq!(h.restored.pending, 2, "both operations restored");
    assert_eq!(h.snapshot().active, 2, "and they count globally");
    assert_eq!(
        h.get(
            &format!("/api/agent/v1/operations/{}", first.id()),
            Some(OTHER_SECRET)
        )
        .await
        .status,
        403
    );
    // Global active is 3: AGENT gets the one slot left, then the removed client's work binds.
    assert_eq!(
        h.submit(AGENT_SECRET, &request("a-1", "demo.run", 0))
            .await
            .status,
        202
    );
    let refused = h.submit(AGENT_SECRET, &request("a-2", "demo.run", 0)).await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "global_operation_limit")
    );
    // The operator still sees and decides them, and deciding frees the slots.
    let listed = h
        .operator
        .get("/api/operator/v1/requests?status=pending")
        .await;
    assert_eq!(listed.body["requests"].as_array().unwrap().len(), 2);
    let denied = h.operator.deny(&first.id()).await;
    assert_eq!((denied.status, denied.state()), (200, "denied"));
    let canceled_by_operator = h.operator.deny(&second.id()).await;
    assert_eq!(canceled_by_operator.status, 200);
    assert_eq!(
        h.submit(AGENT_SECRET, &request("a-3", "demo.run", 0))
            .await
            .status,
        202
    );
    h.broker.shutdown().await;
}
