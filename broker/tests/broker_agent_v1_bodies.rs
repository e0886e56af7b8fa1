//! The Agent V1 contract (SPEC section 5) from a client's side, the second half of
//! `broker_agent_v1.rs`: the bounds of a submission's body, the broker's name, the data dirs of
//! schema version 1, every listing page on an index, numbers kept as sent, and a replay judged on
//! the request up to key order. Every body the harness receives is validated against
//! `tests/contract/agent_v1.schema.json` (see `support::contract`).

mod support;

use serde_json::{Value, json};
use support::broker::{ROOMY, settings, start, start_with};
use support::contract::violations;
use support::http::{LARGE, op_path, request, revision};
use support::secrets::AGENT_SECRET;
use unyolo_admission::StorageCaps;
use unyolo_admission::engine::OperationState;
use unyolo_admission_broker::store::{PageQuery, SCHEMA_VERSION, SqliteStore};
use unyolo_admission_broker::{Broker, BrokerError};

#[tokio::test]
async fn submissions_beyond_the_target_and_argument_bounds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), LARGE).await;
    let with = |key: &str, field: &str, count: usize| {
        let mut body = request(key, "demo.request", 0);
        let object: serde_json::Map<String, Value> =
            (0..count).map(|n| (format!("p{n}"), json!(n))).collect();
        body[field] = Value::Object(object);
        body
    };
    let ok = h.submit(AGENT_SECRET, &with("t32", "target", 32)).await;
    assert_eq!(ok.status, 202, "{}", ok.body);
    let ok = h
        .submit(AGENT_SECRET, &with("a128", "arguments", 128))
        .await;
    assert_eq!(ok.status, 202, "{}", ok.body);
    for (key, field, count) in [("t33", "target", 33), ("a129", "arguments", 129)] {
        let reply = h.submit(AGENT_SECRET, &with(key, field, count)).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{key}"
        );
    }
    for field in ["target", "arguments"] {
        let mut body = request(&format!("no-{field}"), "demo.run", 0);
        body.as_object_mut().unwrap().remove(field);
        let reply = h.submit(AGENT_SECRET, &body).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{field}"
        );
    }
    assert_eq!(h.rows().await, 2);
}

#[tokio::test]
async fn a_broker_name_outside_1_to_64_characters_stops_start_up() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["", &"n".repeat(65), "tab\there"] {
        let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
        s.broker_name = name.to_owned();
        assert!(
            matches!(Broker::start(s).await, Err(BrokerError::Settings(_))),
            "{name:?}"
        );
    }
    let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
    s.broker_name = "é".repeat(64);
    let (broker, _) = Broker::start(s).await.expect("64 characters are allowed");
    broker.shutdown().await;
}

/// The schema of version 1, as the previous release created it.
const SCHEMA_V1: &str = "
CREATE TABLE operations (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, idempotency_key TEXT NOT NULL,
    operation TEXT NOT NULL, target TEXT NOT NULL, arguments TEXT NOT NULL, reason TEXT NOT NULL,
    state TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, terminal_at TEXT,
    error_code TEXT, error_message TEXT, UNIQUE (client_id, idempotency_key)
);
CREATE INDEX operations_by_state ON operations (state);
CREATE TABLE streams (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, size INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
PRAGMA user_version = 1;
";

#[tokio::test]
async fn a_data_dir_of_schema_version_1_keeps_working_from_revision_1() {
    if !support::broker::sqlite_only("a SQLite file of schema version 1, written by hand") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        let row = "INSERT INTO operations VALUES (?1, 'agent', ?2, 'demo.request', \
                   '{\"repo\":\"old\"}', '{}', 'from v1', ?3, '2025-01-01T00:00:00.000Z', \
                   '2025-01-01T00:00:00.000Z', ?4, ?5, ?6)";
        conn.execute(
            row,
            rusqlite::params![
                "op_old_pending",
                "k-old-1",
                "pending",
                None::<String>,
                None::<String>,
                None::<String>
            ],
        )
        .unwrap();
        conn.execute(
            row,
            rusqlite::params![
                "op_old_failed",
                "k-old-2",
                "failed",
                Some("2025-01-01T00:00:01.000Z"),
                Some("execution_interrupted"),
                Some("stopped")
            ],
        )
        .unwrap();
    }
    // Kept for ever: these rows ended in 2025, long past the default retention.
    let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
    s.retention.keep = unyolo_admission_broker::Keep::Forever;
    // And not expired: the pending one was created in 2025, far past the default pending timeout.
    s.pending_timeout = std::time::Duration::from_secs(10 * 365 * 24 * 3600);
    let h = start_with(s).await;
    assert_eq!(h.restored.pending, 1);
    let version: i64 = rusqlite::Connection::open(dir.path().join("admission.sqlite3"))
        .unwrap()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let pending = h.get(&op_path("op_old_pending"), Some(AGENT_SECRET)).await;
    assert_eq!((pending.state(), revision(&pending.body)), ("pending", 1));
    assert_eq!(
        pending.body["presentation"]["title"],
        "Approve a demo run: wait 0 ms, then succeed, on repo=old"
    );
    let failed = h.get(&op_path("op_old_failed"), Some(AGENT_SECRET)).await;
    assert_eq!(failed.body["error"]["code"], "execution_interrupted");
    let page = h.get("/api/agent/v1/operations", Some(AGENT_SECRET)).await;
    assert_eq!(page.body["operations"].as_array().unwrap().len(), 2);
    let approved = h.operator.approve("op_old_pending").await;
    assert_eq!(
        (approved.body["status"].as_str(), revision(&approved.body)),
        (Some("active"), 2)
    );
    // A replay of the old key is still recognized.
    let old_key = h
        .get(
            "/api/agent/v1/operations?idempotency_key=k-old-2&limit=1",
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(old_key.body["operations"][0]["id"], "op_old_failed");
}

#[tokio::test]
async fn every_listing_page_walks_an_index_in_order_and_sorts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = tokio::task::spawn_blocking({
        let dir = dir.path().to_owned();
        move || SqliteStore::open(&dir).unwrap()
    })
    .await
    .unwrap();
    for key in [None, Some("k".to_owned())] {
        for state in [None, Some(OperationState::Pending)] {
            for before in [None, Some(10)] {
                let query = PageQuery {
                    idempotency_key: key.clone(),
                    state,
                    before,
                    limit: 21,
                };
                let plan = db.explain_page(query.clone()).await.unwrap().join(" | ");
                assert!(
                    plan.contains("USING INDEX") || plan.contains("USING COVERING INDEX"),
                    "{query:?}: {plan}"
                );
                assert!(!plan.contains("TEMP B-TREE"), "{query:?} sorts: {plan}");
                assert!(
                    !plan.starts_with("SCAN operations"),
                    "{query:?} scans: {plan}"
                );
            }
        }
    }
}

#[test]
fn the_schema_rejects_what_the_contract_forbids() {
    let operation = json!({
        "api_version": "unyolo.io/agent/v1", "id": "op_1", "broker": "admission",
        "client_id": "agent", "idempotency_key": "k", "operation": "demo.run", "target": {},
        "arguments": {}, "reason": "r", "state": "pending", "revision": 1,
        "created_at": "2026-01-01T00:00:00.000Z", "updated_at": "2026-01-01T00:00:00.000Z",
        "presentation": {"title": "t"}
    });
    assert!(violations("operation", &operation).is_empty());
    let mut with_null = operation.clone();
    with_null["terminal_at"] = Value::Null;
    assert!(!violations("operation", &with_null).is_empty());
    let mut without_revision = operation.clone();
    without_revision.as_object_mut().unwrap().remove("revision");
    assert!(!violations("operation", &without_revision).is_empty());
    assert!(
        !violations("summary", &operation).is_empty(),
        "a summary has no target"
    );
    let old_list = json!({"operations": []});
    assert!(!violations("page", &old_list).is_empty());
    let envelope = json!({"error": {"code": "not_found", "message": "No such operation."}});
    assert!(violations("error_envelope", &envelope).is_empty());
    assert!(!violations("error_envelope", &json!({"error": {"code": "x"}})).is_empty());
}

#[tokio::test]
async fn numbers_are_stored_and_shown_as_sent_and_a_retry_is_judged_on_their_text() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let post = |body: String| {
        h.send(
            "POST",
            "/api/agent/v1/operations",
            Some(AGENT_SECRET),
            Some(body.into()),
        )
    };
    let body = |big: &str, price: &str| {
        format!(
            r#"{{"idempotency_key":"numbers","operation":"demo.request","reason":"r",
                "target":{{"repo":"u/t","pr":{big}}},
                "arguments":{{"duration_ms":0,"price":{price},"ids":[{big},-{big}]}}}}"#
        )
    };
    let big = "12345678901234567890123";
    let created = post(body(big, "1.50")).await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.id();
    // Every digit as sent, in the answer, a later read, the operator's view and the row.
    let read = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    for op in [&created.body, &read.body] {
        assert_eq!(op["target"]["pr"].to_string(), big, "{op}");
        assert_eq!(op["arguments"]["price"].to_string(), "1.50", "{op}");
        assert_eq!(op["arguments"]["ids"][1].to_string(), format!("-{big}"));
    }
    let request = h
        .operator
        .request(read.body["approval_id"].as_str().unwrap())
        .await;
    assert_eq!(request.status, 200, "{}", request.body);
    assert!(request.body.to_string().contains(big), "{}", request.body);
    if support::broker::sqlite_only("the stored text is read from the SQLite file") {
        let stored: String = rusqlite::Connection::open(dir.path().join("admission.sqlite3"))
            .unwrap()
            .query_row("SELECT arguments FROM operations", [], |row| row.get(0))
            .unwrap();
        assert!(stored.contains(big) && stored.contains("1.50"), "{stored}");
    }
    // The same text is a replay; a number an f64 reads alike, or the same price written
    // otherwise, is another request.
    let replay = post(body(big, "1.50")).await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.id(), id);
    for (other, price) in [("12345678901234567890124", "1.50"), (big, "1.5")] {
        let reply = post(body(other, price)).await;
        assert_eq!(reply.status, 409, "{other} {price}: {}", reply.body);
        assert_eq!(reply.code(), "idempotency_conflict");
    }
    assert_eq!(h.rows().await, 1);
}

#[tokio::test]
async fn a_replay_is_the_same_request_up_to_key_order_and_any_deep_change_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let post = |body: &'static str| {
        h.send(
            "POST",
            "/api/agent/v1/operations",
            Some(AGENT_SECRET),
            Some(body.into()),
        )
    };
    let created = post(
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    // The same request with its keys in another order at every depth: a replay.
    let replay = post(
        r#"{"arguments":{"list":[1,2],"duration_ms":0},"reason":"r",
            "target":{"deep":{"b":null,"a":[1,{"y":2,"x":1}]},"repo":"u/t"},
            "operation":"demo.run","idempotency_key":"deep"}"#,
    )
    .await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.id(), created.id());
    assert_eq!(replay.body["target"], created.body["target"]);
    // A change deep inside, an array reordered, or a number of another kind: conflicts.
    for changed in [
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":3}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[2,1]}}"#,
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1.0,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
    ] {
        let reply = post(changed).await;
        assert_eq!(reply.status, 409, "{changed}: {}", reply.body);
        assert_eq!(reply.code(), "idempotency_conflict");
    }
    assert_eq!(h.rows().await, 1);
    let text = h.metrics().await;
    assert_eq!(
        support::metrics::metric(&text, "broker_submissions_total{result=\"replayed\"}"),
        Some(1),
        "{text}"
    );
}
