//! SPEC section 5, statement by statement, against the real server: the operation's JSON fields
//! and `Location`, `Cache-Control: no-store` and the error shape on every answer, the cancel and
//! operator-decision matrices, the metric names, `/readyz` when the store does not answer, and
//! one broker per data dir.

mod support;

use serde_json::json;
use support::broker::{ROOMY, assert_unchanged, chosen_store, settings, start, start_with};
use support::eventually::eventually;
use support::http::{Reply, request};
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission_broker::Broker;

/// Fast limits: one rate token every 60 s after the first two, so the third submission is refused.
const TWO_PER_MINUTE: &str = r#"{"requests_per_window": 2, "window_seconds": 120,
  "client_active": 2, "client_pending": 2, "global_active": 100, "global_executing": 1}"#;

fn assert_no_store(reply: &Reply, what: &str) {
    assert_eq!(reply.header("cache-control"), Some("no-store"), "{what}");
}

/// `{"error":{"code":"<stable_code>","message":"<text>"}}` and nothing else.
fn assert_error_shape(reply: &Reply, status: u16, code: &str, what: &str) {
    assert_eq!(
        (reply.status, reply.code()),
        (status, code),
        "{what}: {}",
        reply.body
    );
    assert_no_store(reply, what);
    let top = reply.body.as_object().expect("a JSON object");
    assert_eq!(top.len(), 1, "{what}: {}", reply.body);
    let error = reply.body["error"].as_object().expect("an error object");
    assert_eq!(error.len(), 2, "{what}: {}", reply.body);
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {}",
        reply.body
    );
}

fn path_of(reply: &Reply) -> String {
    format!("/api/agent/v1/operations/{}", reply.id())
}

#[tokio::test]
async fn a_created_operation_has_exactly_the_agent_v1_fields_and_a_location_that_reads_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let body = request("key-1", "demo.request", 5);
    let created = h.submit(AGENT_SECRET, &body).await;
    assert_eq!(created.status, 202, "{}", created.body);
    let mut fields: Vec<&str> = created
        .body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "api_version",
            "approval_id",
            "arguments",
            "broker",
            "client_id",
            "created_at",
            "id",
            "idempotency_key",
            "operation",
            "presentation",
            "reason",
            "revision",
            "state",
            "target",
            "updated_at",
        ]
    );
    let op = &created.body;
    assert_eq!(op["api_version"], "unyolo.io/agent/v1");
    assert!(op["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert_eq!(op["client_id"], AGENT);
    assert_eq!(op["idempotency_key"], "key-1");
    assert_eq!(op["operation"], "demo.request");
    assert_eq!(op["target"], body["target"]);
    assert_eq!(op["arguments"], body["arguments"]);
    assert_eq!(op["reason"], body["reason"]);
    assert_eq!(op["state"], "pending");
    assert!(op["created_at"].is_string());
    assert_eq!(op["updated_at"], op["created_at"]);
    assert_eq!(op["broker"], "admission");
    assert_eq!(op["revision"], 1);
    assert!(op["presentation"]["title"].is_string());
    // Optional fields without a value are omitted, never null.
    assert!(op.get("terminal_at").is_none());
    assert!(op.get("error").is_none());

    let location = created.header("location").expect("a Location header");
    assert_eq!(location, path_of(&created));
    let read = h.get(location, Some(AGENT_SECRET)).await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body, created.body);
    let listed = h.get("/api/agent/v1/operations", Some(AGENT_SECRET)).await;
    let mut summary = created.body.clone();
    for field in ["target", "arguments", "reason", "approval_id"] {
        summary.as_object_mut().unwrap().remove(field);
    }
    assert_eq!(
        listed.body,
        json!({"api_version": "unyolo.io/agent/v1", "operations": [summary], "next_cursor": null})
    );
    // The operator sees it as an Operator V1 request (checked against that contract), the same
    // operation by id and revision; Agent V1 names it by `approval_id`.
    let requests = h.operator.get("/api/operator/v1/requests").await;
    assert_eq!(requests.body["requests"].as_array().unwrap().len(), 1);
    assert_eq!(requests.body["requests"][0]["id"], created.body["id"]);
    assert_eq!(requests.body["requests"][0]["revision"], 1);
    assert_eq!(created.body["approval_id"], created.body["id"]);

    // A run that needs no approval starts approved and ends succeeded with the same fields.
    let run = h
        .submit(AGENT_SECRET, &request("key-2", "demo.run", 0))
        .await;
    assert_eq!((run.status, run.state()), (202, "approved"));
    assert_eq!(run.header("location"), Some(path_of(&run).as_str()));
    assert!(
        eventually(async || h.get(&path_of(&run), Some(AGENT_SECRET)).await.state() == "succeeded")
            .await
    );
    let done = h.get(&path_of(&run), Some(AGENT_SECRET)).await;
    // Created (1), executing (2), succeeded (3); terminal_at now has a value, error still none.
    assert_eq!(done.body.as_object().unwrap().len(), 15);
    assert_eq!(done.body["revision"], 3);
    assert!(done.body["terminal_at"].is_string());
    assert!(done.body.get("error").is_none());
}

#[tokio::test]
async fn every_answer_carries_no_store_and_every_error_the_error_shape() {
    let dir = tempfile::tempdir().unwrap();
    let caps = unyolo_admission::StorageCaps {
        stream: unyolo_admission::engine::StoreCaps {
            global_files: 1,
            global_bytes: 100,
            client_files: 1,
            client_bytes: 100,
        },
        ..unyolo_admission::StorageCaps::default()
    };
    let h = start_with(settings(dir.path(), TWO_PER_MINUTE, caps)).await;

    // Successes.
    let created = h
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202);
    assert_no_store(&created, "202");
    let replayed = h
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(replayed.status, 200);
    assert_no_store(&replayed, "replay");
    for (path, token) in [
        (path_of(&created), Some(AGENT_SECRET)),
        (
            format!(
                "{}/events?after_revision=0&wait_seconds=0",
                path_of(&created)
            ),
            Some(AGENT_SECRET),
        ),
        ("/.well-known/unyolo-agent".to_owned(), Some(AGENT_SECRET)),
        ("/api/agent/v1/operations".to_owned(), Some(AGENT_SECRET)),
        ("/healthz".to_owned(), None),
        ("/readyz".to_owned(), None),
    ] {
        let reply = h.get(&path, token).await;
        assert_eq!(reply.status, 200, "{path}");
        assert_no_store(&reply, &path);
    }
    let stream = h
        .send(
            "POST",
            "/api/agent/v1/streams",
            Some(AGENT_SECRET),
            Some(vec![1u8; 10].into()),
        )
        .await;
    assert_eq!(stream.status, 201);
    assert_no_store(&stream, "201");

    // Errors, each with its status and code.
    let reply = h.get("/api/agent/v1/operations", None).await;
    assert_error_shape(&reply, 401, "authentication_failed", "no token");
    let reply = h.get("/api/agent/v1/operations", Some("wrong")).await;
    assert_error_shape(&reply, 403, "authentication_failed", "wrong token");
    for (path, token) in [
        ("/metrics", OPERATOR_SECRET),
        ("/metrics", AGENT_SECRET),
        ("/api/operator/v1/requests", OPERATOR_SECRET),
        ("/.well-known/unyolo-operator", OPERATOR_SECRET),
        ("/admission/v1/drift", OPERATOR_SECRET),
    ] {
        let reply = h.get(path, Some(token)).await;
        assert_error_shape(
            &reply,
            404,
            "not_found",
            "operator routes are not on this listener",
        );
    }
    let reply = h
        .get("/api/agent/v1/operations/op_x", Some(AGENT_SECRET))
        .await;
    assert_error_shape(&reply, 404, "not_found", "unknown operation");
    let reply = h.get("/nowhere", None).await;
    assert_error_shape(&reply, 404, "not_found", "unknown route");
    let reply = h.send("DELETE", "/healthz", None, None).await;
    assert_error_shape(&reply, 405, "method_not_allowed", "405");
    let reply = h
        .send(
            "POST",
            "/api/agent/v1/operations",
            Some(AGENT_SECRET),
            Some("{".into()),
        )
        .await;
    assert_error_shape(&reply, 400, "invalid_request", "malformed JSON");
    let mut big = request("big", "demo.run", 0);
    big["reason"] = json!("r".repeat(1 << 20));
    let reply = h.submit(AGENT_SECRET, &big).await;
    assert_error_shape(&reply, 413, "payload_too_large", "413");
    let mut conflict = request("a", "demo.request", 0);
    conflict["reason"] = json!("another reason");
    let reply = h.submit(AGENT_SECRET, &conflict).await;
    assert_error_shape(&reply, 409, "idempotency_conflict", "409");
    assert_eq!(h.operator.deny(&created.id()).await.status, 200);
    let reply = h.operator.deny(&created.id()).await;
    assert_eq!((reply.status, reply.code()), (409, "invalid_transition"));
    let reply = h
        .send(
            "POST",
            "/api/agent/v1/streams",
            Some(AGENT_SECRET),
            Some(vec![1u8; 10].into()),
        )
        .await;
    assert_error_shape(&reply, 429, "stream_storage_limit", "stream cap");
    // It names the store, not an operation (before: `Operation admission limit reached`).
    assert_eq!(reply.body["error"]["message"], "The stream store is full.");
    assert!(reply.retry_after().is_some_and(|s| s >= 1));
    // Two tokens spent ("a" and nothing else: the replay, the conflict and the 413 spent none).
    assert_eq!(
        h.submit(AGENT_SECRET, &request("b", "demo.request", 0))
            .await
            .status,
        202
    );
    let reply = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    assert_error_shape(&reply, 429, "submission_rate_limited", "rate");
    assert_eq!(
        reply.body["error"]["message"],
        "Operation admission limit reached"
    );
    let raw = reply.header("retry-after").expect("Retry-After");
    assert!(
        raw.bytes().all(|b| b.is_ascii_digit()) && raw.parse::<u64>().unwrap() >= 1,
        "Retry-After {raw:?} is not an integer of at least 1"
    );

    // A path parameter that is not valid UTF-8 once decoded: still the error shape, not text.
    for path in [
        "/api/agent/v1/operations/%FF",
        "/api/agent/v1/operations/%FF/cancel",
    ] {
        let method = if path.ends_with("cancel") {
            "POST"
        } else {
            "GET"
        };
        let reply = h.send(method, path, Some(AGENT_SECRET), None).await;
        assert_error_shape(&reply, 400, "invalid_request", path);
    }
    let reply = h
        .send(
            "DELETE",
            "/api/agent/v1/streams/%FF",
            Some(AGENT_SECRET),
            None,
        )
        .await;
    assert_error_shape(&reply, 400, "invalid_request", "stream path");
}

#[tokio::test]
async fn cancel_is_200_for_pending_and_approved_409_while_executing_and_200_unchanged_when_terminal()
 {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let cancel = async |op: &Reply| {
        h.post(&format!("{}/cancel", path_of(op)), Some(AGENT_SECRET))
            .await
    };
    let approve = async |op: &Reply| h.operator.approve(&op.id()).await;

    let pending = h
        .submit(AGENT_SECRET, &request("pending", "demo.request", 0))
        .await;
    let reply = cancel(&pending).await;
    assert_eq!((reply.status, reply.state()), (200, "canceled"));
    assert!(reply.body["terminal_at"].is_string());

    // Approved and queued behind long runs. Submitted first: a saturated pool refuses new work.
    let queued = h
        .submit(OTHER_SECRET, &request("queued", "demo.request", 0))
        .await;
    assert_eq!(queued.status, 202);
    let denied = h
        .submit(AGENT_SECRET, &request("denied", "demo.request", 0))
        .await;
    let mut runs = Vec::new();
    for i in 0..10 {
        runs.push(
            h.submit(
                AGENT_SECRET,
                &request(&format!("run-{i}"), "demo.run", 60_000),
            )
            .await,
        );
    }
    assert!(eventually(async || h.snapshot().executing == 10).await);
    assert_eq!(approve(&queued).await.state(), "active");
    assert_eq!(h.snapshot().queued, 1);
    let reply = h
        .post(&format!("{}/cancel", path_of(&queued)), Some(OTHER_SECRET))
        .await;
    assert_eq!((reply.status, reply.state()), (200, "canceled"));

    // Executing: 409, and it keeps executing.
    let reply = cancel(&runs[0]).await;
    assert_error_shape(&reply, 409, "operation_not_cancelable", "executing");
    let still = h.get(&path_of(&runs[0]), Some(AGENT_SECRET)).await;
    assert_eq!(still.state(), "executing");

    // Terminal (canceled, denied, succeeded): 200 with the operation exactly as it was.
    assert_eq!(h.operator.deny(&denied.id()).await.body["status"], "denied");
    for op in [&pending, &denied] {
        let before = h.get(&path_of(op), Some(AGENT_SECRET)).await;
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let reply = cancel(op).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, before.body, "a terminal operation changed");
        assert_eq!(
            h.get(&path_of(op), Some(AGENT_SECRET)).await.body,
            before.body
        );
    }
    let snapshot = h.snapshot();
    assert_eq!(snapshot.executing, 10);
    assert_eq!(snapshot.pending, 0);
    assert_eq!(snapshot.queued, 0);
}

#[tokio::test]
async fn metrics_use_the_spec_names_with_code_none_for_accepted_submissions() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), TWO_PER_MINUTE).await;
    h.submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    h.submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    h.submit(AGENT_SECRET, &request("b", "demo.request", 0))
        .await;
    let refused = h
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 429);
    let reply = h.operator.get("/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(
        reply.header("content-type").is_some_and(
            |t| t.starts_with("application/openmetrics-text") || t.starts_with("text/plain")
        ),
        "{:?}",
        reply.header("content-type")
    );
    let text = reply.body.as_str().unwrap();
    let expect = [
        (
            r#"admission_requests_total{result="accepted",code="none"}"#,
            2,
        ),
        (
            r#"admission_requests_total{result="rejected",code="submission_rate_limited"}"#,
            1,
        ),
        (
            r#"admission_requests_total{result="rejected",code="client_pending_limit"}"#,
            0,
        ),
        (r#"admission_operations{state="pending"}"#, 2),
        (r#"admission_operations{state="queued"}"#, 0),
        (r#"admission_operations{state="executing"}"#, 0),
        (
            r#"admission_client_operations{client="agent",state="pending"}"#,
            2,
        ),
        (
            r#"admission_client_operations{client="other",state="pending"}"#,
            0,
        ),
        (r#"broker_submissions_total{result="created"}"#, 2),
        (r#"broker_submissions_total{result="replayed"}"#, 1),
        (r#"broker_submissions_total{result="rejected"}"#, 1),
        (r#"admission_storage_bytes{store="stream"}"#, 0),
        (r#"admission_config_reloads_total{result="applied"}"#, 0),
        (r#"admission_config_reloads_total{result="rejected"}"#, 0),
    ];
    for (series, value) in expect {
        assert_eq!(metric(text, series), Some(value), "{series}\n{text}");
    }
    assert!(
        text.contains("admission_storage_bytes{store=\"sealed_payload\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn readyz_is_503_while_another_process_holds_the_store_and_200_once_it_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    assert_eq!(h.get("/readyz", None).await.body, json!({"ready": true}));

    // Another process (a stuck sqlite3 shell, a backup tool; on PostgreSQL, a session holding
    // the tables locked) holds the store's write lock.
    let foreign = support::faults::StoreLock::take(dir.path());
    let (rows, snapshot) = (h.rows().await, h.snapshot());

    let reply = h.get("/readyz", None).await;
    assert_error_shape(&reply, 503, "store_unavailable", "readyz");
    assert_eq!(
        h.get("/healthz", None).await.body,
        json!({"ok": true}),
        "alive"
    );
    // Reads still answer from the database (WAL readers are not blocked by a writer).
    assert_eq!(
        h.get("/api/agent/v1/operations", Some(AGENT_SECRET))
            .await
            .status,
        200
    );

    foreign.release();
    assert!(eventually(async || h.get("/readyz", None).await.status == 200).await);
    assert_eq!(h.get("/readyz", None).await.body, json!({"ready": true}));
    assert_eq!(h.rows().await, rows);
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");
}

#[tokio::test]
async fn a_second_broker_on_the_same_data_dir_is_refused_until_the_first_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first = start(&data, ROOMY).await;
    let created = first
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202);

    let err = Broker::start(chosen_store(settings(&data, ROOMY, Default::default())))
        .await
        .expect_err("a second broker on a data dir in use");
    let message = err.to_string();
    assert!(
        message.contains(data.to_str().unwrap()) && message.contains("in use"),
        "{message}"
    );
    // The refused broker changed nothing: the first still owns its operation and counts.
    assert_eq!(first.snapshot().pending, 1);
    assert_eq!(first.rows().await, 1);

    first.broker.shutdown().await;
    let second = start(&data, ROOMY).await;
    assert_eq!(second.restored.pending, 1);
    assert_eq!(second.snapshot().pending, 1);
}

#[test]
fn broker_settings_debug_shows_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!("{:?}", settings(dir.path(), ROOMY, Default::default()));
    for secret in [AGENT_SECRET, OTHER_SECRET, OPERATOR_SECRET] {
        assert!(!text.contains(secret), "{text}");
    }
    assert!(text.contains("redacted"), "{text}");
}
