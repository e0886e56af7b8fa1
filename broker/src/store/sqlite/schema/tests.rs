//! The migrations, checked through a real open of the store: a file as an older schema left it,
//! opened by [`SqliteStore::open`], reads back as the newest schema says. A file of its own because
//! opening is the handle's (`database.rs`), which imports this schema, not the other way round.

use serde_json::{Value, json};

use super::*;
use crate::store::digest::request_digest;
use crate::store::records::Presentation;
use crate::store::sqlite::{DATABASE_FILE, SqliteStore};

/// A file as schema 3 left it, with one operation whose target's keys are in some order.
fn schema_3_file(dir: &Path) {
    let conn = Connection::open(dir.join(DATABASE_FILE)).unwrap();
    conn.execute_batch(&format!(
        "{} {OPERATIONS_INDEXES} {STREAMS_TABLE} PRAGMA user_version = 3;",
        OPERATIONS_TABLE.replace("{name}", "operations")
    ))
    .unwrap();
    conn.execute(
        "INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, \
         reason, state, created_at, updated_at, revision) VALUES ('op_1', 'bot-7', 'k', \
         'demo.run', '{\"repo\":\"u/t\",\"branch\":\"main\"}', '{\"duration_ms\":5}', 'why', \
         'pending', '2025-01-01T00:00:00.000Z', '2025-01-01T00:00:00.000Z', 1)",
        [],
    )
    .unwrap();
}

fn shown(operation: &str, target: &Value, _: &Value, reason: &str) -> Presentation {
    Presentation {
        title: format!("{operation} on {}", target["repo"].as_str().unwrap_or("-")),
        summary: Some(reason.to_owned()),
    }
}

#[test]
fn an_older_files_ended_rows_learn_the_state_they_left_from_what_they_recorded() {
    let dir = tempfile::tempdir().unwrap();
    schema_3_file(dir.path());
    {
        let conn = Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
        for (id, state, code) in [
            ("op_ok", "succeeded", None),
            ("op_ran", "failed", Some("execution_interrupted")),
            ("op_never", "failed", Some("store_unavailable")),
            ("op_like", "failed", Some("executionXinterrupted")),
            ("op_gone", "canceled", None),
        ] {
            conn.execute(
                "INSERT INTO operations (id, client_id, idempotency_key, operation, target,                      arguments, reason, state, created_at, updated_at, error_code, revision)                      VALUES (?1, 'bot-7', ?1, 'demo.request', '{}', '{}', 'why', ?2,                      '2025-01-01T00:00:00.000Z', '2025-01-01T00:00:00.000Z', ?3, 2)",
                rusqlite::params![id, state, code],
            )
            .unwrap();
        }
    }
    let db = SqliteStore::open(dir.path()).unwrap();
    let ended = |id: &str| -> Option<String> {
        db.writer()
            .query_row(
                "SELECT ended_from FROM operations WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!(ended("op_ok").as_deref(), Some("executing"));
    assert_eq!(ended("op_ran").as_deref(), Some("executing"));
    // `_` in the pattern is escaped: only the literal prefix `execution_` counts.
    assert_eq!(ended("op_never"), None);
    assert_eq!(ended("op_like"), None);
    // Schema 3 recorded no revocation: a cancel shows `canceled`.
    assert_eq!(ended("op_gone"), None);
    assert_eq!(ended("op_1"), None);
}

#[tokio::test]
async fn a_schema_3_file_gets_each_rows_presentation_and_digest_once() {
    let dir = tempfile::tempdir().unwrap();
    schema_3_file(dir.path());
    let db = SqliteStore::open(dir.path()).unwrap();
    let version: i64 = db
        .writer()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    // Before start-up derived it, the row has no presentation: reading it is an error, not
    // an empty title.
    assert!(db.get("op_1").await.is_err());

    assert_eq!(db.fill_derived(shown).unwrap(), 1);
    let record = db.get("op_1").await.unwrap().unwrap();
    assert_eq!(
        record.presentation,
        Presentation {
            title: "demo.run on u/t".to_owned(),
            summary: Some("why".to_owned())
        }
    );
    // The digest is of the canonical request: the same with the keys in another order.
    let stored = db.request_by_key("bot-7", "k").await.unwrap().unwrap();
    let target = json!({"branch": "main", "repo": "u/t"});
    assert_eq!(
        stored.digest,
        request_digest("demo.run", &target, &json!({"duration_ms": 5}), "why")
    );
    assert_eq!(
        stored.bytes,
        (r#"{"repo":"u/t","branch":"main"}"#.len() + 17 + 3) as u64
    );

    // Once: a second start finds nothing to fill; a row another program writes without them
    // is filled at the next.
    assert_eq!(db.fill_derived(|_, _, _, _| unreachable!()).unwrap(), 0);
    db.writer()
        .execute(
            "INSERT INTO operations (id, client_id, idempotency_key, operation, target, \
             arguments, reason, state, created_at, updated_at) VALUES ('op_2', 'bot-7', 'k2', \
             'demo.run', '{}', '{}', 'by hand', 'succeeded', '2025-01-01T00:00:00.000Z', \
             '2025-01-01T00:00:00.000Z')",
            [],
        )
        .unwrap();
    assert_eq!(db.fill_derived(shown).unwrap(), 1);
    let plan: String = db
        .writer()
        .query_row(
            "EXPLAIN QUERY PLAN SELECT seq FROM operations INDEXED BY operations_underived \
             WHERE request_digest IS NULL ORDER BY seq",
            [],
            |r| r.get(3),
        )
        .unwrap();
    assert!(plan.contains("operations_underived"), "{plan}");
}
