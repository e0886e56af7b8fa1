//! SPEC section 5, statement by statement, against the real server: the operation's JSON fields
//! and `Location`, `Cache-Control: no-store` and the error shape on every answer, the cancel and
//! operator-decision matrices, the metric names, `/readyz` when the store does not answer, and
//! one broker per data dir.
#![cfg(feature = "broker")]

mod broker_support;

use broker_support::*;
use serde_json::{Value, json};
use unyolo_admission::broker::Broker;

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
async fn readyz_is_503_while_another_process_holds_the_store_and_200_once_it_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    assert_eq!(h.get("/readyz", None).await.body, json!({"ready": true}));

    // Another process (a stuck sqlite3 shell, a backup tool) holds the database's write lock.
    let path = dir
        .path()
        .join(unyolo_admission::broker::store::DATABASE_FILE);
    let foreign = rusqlite::Connection::open(&path).unwrap();
    foreign.execute_batch("BEGIN IMMEDIATE").unwrap();
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

    foreign.execute_batch("ROLLBACK").unwrap();
    drop(foreign);
    assert!(eventually(async || h.get("/readyz", None).await.status == 200).await);
    assert_eq!(h.get("/readyz", None).await.body, json!({"ready": true}));
    assert_eq!(h.rows().await, rows);
    assert_eq!(h.snapshot(), snapshot);
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

    let err = Broker::start(settings(&data, ROOMY, Default::default()))
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
