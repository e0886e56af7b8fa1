//! The store stays bounded (SPEC section 6): terminal operations retire after the retention,
//! live ones never do, a replay after retention is new work, a sweep racing submissions and
//! decisions loses nothing, the file shrinks, and streams are reconciled. Time is the test's: the
//! sweep's clock is moved forward instead of waiting days.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::json;
use support::broker::{Harness, ROOMY, settings, start_with};
use support::eventually::eventually;
use support::faults::upload;
use support::http::request;
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission::engine::{OperationState, Store};
use unyolo_admission_broker::store::{OperationRecord, PageQuery, SqliteStore};
use unyolo_admission_broker::{BrokerSettings, Keep, RetentionSettings, WallClock};

const DAY: Duration = Duration::from_secs(86_400);

/// A clock the test moves: the system time plus an offset.
#[derive(Clone, Default)]
struct TestClock(Arc<AtomicU64>);

impl TestClock {
    fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_secs(), Ordering::SeqCst);
    }
    fn wall(&self) -> WallClock {
        let offset = Arc::clone(&self.0);
        WallClock::from_fn(move || {
            SystemTime::now() + Duration::from_secs(offset.load(Ordering::SeqCst))
        })
    }
}

/// Settings with `keep`, no timed sweep (the test sweeps), and `clock`.
fn retaining(dir: &std::path::Path, keep: Keep, clock: &TestClock) -> BrokerSettings {
    BrokerSettings {
        retention: RetentionSettings {
            keep,
            sweep_interval: Duration::ZERO,
            clock: clock.wall(),
        },
        ..settings(dir, ROOMY, StorageCaps::default())
    }
}

fn op_path(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

async fn wait_state(h: &Harness, id: &str, state: &str) {
    assert!(
        eventually(async || h.get(&op_path(id), Some(AGENT_SECRET)).await.state() == state).await,
        "{id} never became {state}"
    );
}

/// A terminal operation as a previous run stored it, ended at `terminal_at`.
fn old_terminal(i: usize, terminal_at: &str, padding: usize) -> OperationRecord {
    OperationRecord {
        id: format!("op_old{i:027}"),
        client_id: AGENT.to_owned(),
        idempotency_key: format!("old-{i}"),
        operation: "demo.run".to_owned(),
        target: json!({"repo": "unyolo/test"}),
        arguments: json!({"duration_ms": 0}),
        reason: "x".repeat(padding),
        state: OperationState::Succeeded,
        created_at: terminal_at.to_owned(),
        updated_at: terminal_at.to_owned(),
        terminal_at: Some(terminal_at.to_owned()),
        error: None,
        revision: 3,
        decided: None,
        ended_from: None,
        active_expires_at: None,
        pending_expires_at: None,
        broker: "admission".to_owned(),
        presentation: unyolo_admission_broker::presentation::derive(
            "demo.run",
            &json!({"repo": "unyolo/test"}),
            &json!({"duration_ms": 0}),
            "stored before",
        ),
    }
}

fn seed(dir: &std::path::Path, rows: usize, padding: usize) {
    let db = SqliteStore::open(dir).unwrap();
    let records: Vec<_> = (0..rows)
        .map(|i| old_terminal(i, "2020-01-01T00:00:00.000Z", padding))
        .collect();
    db.load(&records).unwrap();
}

#[tokio::test]
async fn terminal_operations_older_than_the_retention_retire_and_live_ones_stay() {
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    let h = start_with(retaining(dir.path(), Keep::For(DAY), &clock)).await;
    let done = h
        .submit(AGENT_SECRET, &request("done", "demo.run", 0))
        .await;
    let denied = h
        .submit(AGENT_SECRET, &request("denied", "demo.request", 0))
        .await;
    let waiting = h
        .submit(AGENT_SECRET, &request("waiting", "demo.request", 0))
        .await;
    let deny = h.operator.deny(&denied.id()).await;
    assert_eq!(deny.status, 200, "{}", deny.body);
    wait_state(&h, &done.id(), "succeeded").await;

    // Half a day on: nothing is old enough.
    clock.advance(DAY / 2);
    assert_eq!(h.broker.sweep_now().await.unwrap().retired, 0);
    assert_eq!(h.rows().await, 3);

    // Two days on: both terminal operations retire; the pending one, older still, stays.
    clock.advance(DAY * 2);
    let report = h.broker.sweep_now().await.unwrap();
    assert_eq!(report.retired, 2);
    assert_eq!(h.rows().await, 1);
    for gone in [done.id(), denied.id()] {
        assert_eq!(h.get(&op_path(&gone), Some(AGENT_SECRET)).await.status, 404);
    }
    let live = h.get(&op_path(&waiting.id()), Some(AGENT_SECRET)).await;
    assert_eq!(live.state(), "pending");
    let approve = h.operator.approve(&waiting.id()).await;
    assert_eq!(approve.status, 200, "{}", approve.body);

    let metrics = h.metrics().await;
    assert_eq!(
        metric(&metrics, "broker_retention_last_sweep_retired "),
        Some(2)
    );
    assert_eq!(metric(&metrics, "broker_retention_retired_total "), Some(2));
    assert_eq!(
        metric(&metrics, "broker_store_operations{state=\"pending\"} "),
        Some(1)
    );
    assert_eq!(
        metric(&metrics, "broker_store_operations{state=\"succeeded\"} "),
        Some(0)
    );
    assert!(metric(&metrics, "broker_store_bytes{file=\"database\"} ").unwrap() > 0);
    assert!(metric(&metrics, "broker_key_filter_bytes ").unwrap() > 0);
    assert_eq!(h.broker.check_drift().await.unwrap().total(), 0);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_retention_shorter_than_a_rate_window_keeps_the_rows_a_restart_rebuilds_the_rate_from() {
    // Two submissions a day, kept one second: the rows stay for the day, so a restart still
    // knows the client spent both.
    const TWO_A_DAY: &str = r#"{"requests_per_window": 2, "window_seconds": 86400,
      "client_active": 5, "client_pending": 2, "global_active": 10, "global_executing": 5}"#;
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    let kept_a_second = || BrokerSettings {
        retention: RetentionSettings {
            keep: Keep::For(Duration::from_secs(1)),
            sweep_interval: Duration::ZERO,
            clock: clock.wall(),
        },
        ..settings(dir.path(), TWO_A_DAY, StorageCaps::default())
    };
    let h = start_with(kept_a_second()).await;
    for key in ["one", "two"] {
        let reply = h.submit(AGENT_SECRET, &request(key, "demo.run", 0)).await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        wait_state(&h, &reply.id(), "succeeded").await;
    }
    clock.advance(Duration::from_secs(10));
    assert_eq!(h.broker.sweep_now().await.unwrap().retired, 0);
    h.broker.shutdown().await;

    let h = start_with(kept_a_second()).await;
    let third = h
        .submit(AGENT_SECRET, &request("three", "demo.run", 0))
        .await;
    assert_eq!(
        (third.status, third.code()),
        (429, "submission_rate_limited"),
        "{}",
        third.body
    );
    // A window on, they retire.
    clock.advance(DAY);
    assert_eq!(h.broker.sweep_now().await.unwrap().retired, 2);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_retention_of_forever_keeps_every_terminal_operation() {
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    let h = start_with(retaining(dir.path(), Keep::Forever, &clock)).await;
    let done = h
        .submit(AGENT_SECRET, &request("done", "demo.run", 0))
        .await;
    wait_state(&h, &done.id(), "succeeded").await;
    clock.advance(DAY * 10_000);
    assert_eq!(h.broker.sweep_now().await.unwrap().retired, 0);
    assert_eq!(h.rows().await, 1);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_replay_of_a_retired_key_creates_a_new_operation() {
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    let h = start_with(retaining(dir.path(), Keep::For(DAY), &clock)).await;
    let first = h
        .submit(AGENT_SECRET, &request("same", "demo.run", 0))
        .await;
    assert_eq!(first.status, 202);
    wait_state(&h, &first.id(), "succeeded").await;
    let replay = h
        .submit(AGENT_SECRET, &request("same", "demo.run", 0))
        .await;
    assert_eq!((replay.status, replay.id()), (200, first.id()));

    clock.advance(DAY * 2);
    let report = h.broker.sweep_now().await.unwrap();
    assert_eq!(report.retired, 1);
    // Every key the filter held retired, so it was rebuilt: the key no longer answers "maybe".
    assert!(report.filter_rebuilt);
    assert_eq!(
        metric(&h.metrics().await, "broker_key_filter_keys "),
        Some(0)
    );

    let again = h
        .submit(AGENT_SECRET, &request("same", "demo.run", 0))
        .await;
    assert_eq!(again.status, 202, "{}", again.body);
    assert_ne!(again.id(), first.id());
    wait_state(&h, &again.id(), "succeeded").await;
    // And that new operation is replayed like any other.
    let replay = h
        .submit(AGENT_SECRET, &request("same", "demo.run", 0))
        .await;
    assert_eq!((replay.status, replay.id()), (200, again.id()));
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_sweep_racing_submissions_and_decisions_loses_nothing_and_leaves_no_drift() {
    if !support::broker::sqlite_only("its ended rows are seeded by writing the SQLite file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Rows that ended in 2020: the default seven days retire them all, in many batches.
    seed(dir.path(), 6_000, 16);
    let clock = TestClock::default();
    let h = Arc::new(start_with(retaining(dir.path(), Keep::For(7 * DAY), &clock)).await);

    let sweeping = {
        let h = Arc::clone(&h);
        tokio::spawn(async move {
            let mut retired = 0;
            let mut drift = 0;
            for _ in 0..20 {
                retired += h.broker.sweep_now().await.unwrap().retired;
                drift += h.broker.check_drift().await.unwrap().total();
            }
            (retired, drift)
        })
    };
    let mut ids = Vec::new();
    for i in 0..30 {
        let (operation, decision) = match i % 3 {
            0 => ("demo.run", None),
            1 => ("demo.request", Some("approve")),
            _ => ("demo.request", Some("deny")),
        };
        let reply = h
            .submit(AGENT_SECRET, &request(&format!("new-{i}"), operation, 0))
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        if let Some(decision) = decision {
            let decided = h.operator.act(&reply.id(), decision).await;
            assert_eq!(decided.status, 200, "{}", decided.body);
        }
        ids.push(reply.id());
    }
    let (retired, drift_during) = sweeping.await.unwrap();
    assert_eq!(drift_during, 0);
    let retired = retired + h.broker.sweep_now().await.unwrap().retired;
    assert_eq!(retired, 6_000);
    for id in &ids {
        let reply = h.get(&op_path(id), Some(AGENT_SECRET)).await;
        assert_eq!(reply.status, 200, "{id} lost");
    }
    assert_eq!(h.rows().await, 30);
    assert_eq!(h.broker.check_drift().await.unwrap().total(), 0);
    Arc::into_inner(h).unwrap().broker.shutdown().await;
}

#[tokio::test]
async fn the_database_file_shrinks_after_a_large_sweep() {
    if !support::broker::sqlite_only("the SQLite file's size and free pages") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    seed(dir.path(), 5_000, 2_000);
    let file = dir.path().join("admission.sqlite3");
    let clock = TestClock::default();
    let h = start_with(retaining(dir.path(), Keep::For(7 * DAY), &clock)).await;
    let before = std::fs::metadata(&file).unwrap().len();
    assert!(before > 5_000 * 2_000, "{before}");
    assert_eq!(h.broker.sweep_now().await.unwrap().retired, 5_000);
    let after = std::fs::metadata(&file).unwrap().len();
    assert!(after < before / 10, "{before} -> {after}");
    let metrics = h.metrics().await;
    assert!(metric(&metrics, "broker_store_bytes{file=\"database\"} ").unwrap() == after);
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeps_racing_uploads_never_take_a_stored_stream() {
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    // Room for every stream the test keeps (320).
    let stream = unyolo_admission::StoreCaps {
        global_files: 1_000,
        client_files: 1_000,
        ..StorageCaps::default().stream
    };
    let h = Arc::new(
        start_with(BrokerSettings {
            storage_caps: StorageCaps {
                stream,
                ..StorageCaps::default()
            },
            ..retaining(dir.path(), Keep::For(DAY), &clock)
        })
        .await,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sweeping = {
        let (h, stop) = (Arc::clone(&h), Arc::clone(&stop));
        tokio::spawn(async move {
            let (mut sweeps, mut rows, mut files) = (0, 0, 0);
            while !stop.load(Ordering::Relaxed) {
                let report = h.broker.sweep_now().await.unwrap();
                (sweeps, rows, files) = (
                    sweeps + 1,
                    rows + report.stream_rows_removed,
                    files + report.stream_files_removed,
                );
            }
            (sweeps, rows, files)
        })
    };
    // Uploads eight at a time, each answered 201 only once stored.
    let mut stored = Vec::new();
    for _ in 0..40 {
        let batch: Vec<_> = (0..8)
            .map(|_| {
                let h = Arc::clone(&h);
                tokio::spawn(async move { upload(&h, 512).await })
            })
            .collect();
        for upload in batch {
            stored.push(upload.await.unwrap());
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (sweeps, rows, files) = sweeping.await.unwrap();
    assert!(sweeps > 0);
    // Nothing was out of place, so nothing was removed: not a row, not a file.
    assert_eq!((rows, files), (0, 0), "over {sweeps} sweeps");
    let streams = dir.path().join("streams");
    for id in &stored {
        // On PostgreSQL the body is in the row (its staged file is gone once it is recorded).
        assert!(
            support::broker::on_postgres() || streams.join(id).exists(),
            "{id}: its file is gone"
        );
        assert!(
            h.broker.database().get_stream(id).await.unwrap().is_some(),
            "{id}: its row is gone"
        );
    }
    assert_eq!(h.broker.check_drift().await.unwrap().total(), 0);
    Arc::into_inner(h).unwrap().broker.shutdown().await;
}

#[tokio::test]
async fn stream_rows_without_files_and_files_without_rows_are_reconciled() {
    if !support::broker::sqlite_only(
        "a stream's body is a file only on SQLite (PostgreSQL keeps it in the row)",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let clock = TestClock::default();
    let h = start_with(retaining(dir.path(), Keep::For(DAY), &clock)).await;
    let kept = upload(&h, 1000).await;
    let lost = upload(&h, 2000).await;
    let streams = dir.path().join("streams");
    std::fs::remove_file(streams.join(&lost)).unwrap();
    std::fs::write(streams.join("st_stray"), b"no row").unwrap();

    let report = h.broker.sweep_now().await.unwrap();
    assert_eq!(
        (report.stream_rows_removed, report.stream_files_removed),
        (1, 1)
    );
    assert!(streams.join(&kept).exists());
    assert!(!streams.join("st_stray").exists());
    assert!(
        h.broker
            .database()
            .get_stream(&lost)
            .await
            .unwrap()
            .is_none()
    );
    let stored = h.snapshot();
    let stream_bytes: u64 = stored
        .storage
        .iter()
        .filter(|s| s.store == Store::Stream)
        .map(|s| (s.files, s.bytes))
        .map(|(files, bytes)| {
            assert_eq!(files, 1);
            bytes
        })
        .sum();
    assert_eq!(stream_bytes, 1000);
    assert_eq!(h.broker.check_drift().await.unwrap().total(), 0);
    // A sweep with nothing to reconcile changes nothing.
    let again = h.broker.sweep_now().await.unwrap();
    assert_eq!(
        (again.stream_rows_removed, again.stream_files_removed),
        (0, 0)
    );
    h.broker.shutdown().await;
}

/// Schema 2 as the previous release created it: an implicit rowid.
const SCHEMA_V2: &str = "
CREATE TABLE operations (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, idempotency_key TEXT NOT NULL,
    operation TEXT NOT NULL, target TEXT NOT NULL, arguments TEXT NOT NULL, reason TEXT NOT NULL,
    state TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, terminal_at TEXT,
    error_code TEXT, error_message TEXT, revision INTEGER NOT NULL DEFAULT 1,
    UNIQUE (client_id, idempotency_key)
);
CREATE INDEX operations_by_state ON operations (state);
CREATE INDEX operations_by_client ON operations (client_id);
CREATE INDEX operations_by_client_state ON operations (client_id, state);
CREATE TABLE streams (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, size INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
PRAGMA user_version = 2;
";

#[tokio::test]
async fn listing_cursors_from_schema_2_point_at_the_same_rows_after_the_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admission.sqlite3");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(SCHEMA_V2).unwrap();
        for i in 0..10 {
            conn.execute(
                "INSERT INTO operations VALUES (?1, 'agent', ?2, 'demo.run', '{}', '{}', 'r', \
                 'succeeded', '2025-01-01T00:00:00.000Z', '2025-01-01T00:00:00.000Z', \
                 '2025-01-01T00:00:00.000Z', NULL, NULL, 2)",
                rusqlite::params![format!("op_{i:032}"), format!("k-{i}")],
            )
            .unwrap();
        }
        // Gaps in the rowids, as deletions leave them.
        conn.execute(
            "DELETE FROM operations WHERE idempotency_key IN ('k-2', 'k-5')",
            [],
        )
        .unwrap();
    }
    let before: Vec<(i64, String)> = {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let mut stmt = conn
            .prepare("SELECT rowid, id FROM operations ORDER BY rowid")
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let db = SqliteStore::open(dir.path()).unwrap();
    // What schema 4 stores for each row, derived once (as the broker's start-up does).
    let derived = db
        .fill_derived(unyolo_admission_broker::presentation::derive)
        .unwrap();
    assert_eq!(derived, 8);
    let page = db
        .list_page(
            AGENT,
            PageQuery {
                idempotency_key: None,
                state: None,
                before: Some(before[5].0),
                limit: 100,
            },
        )
        .await
        .unwrap();
    let expected: Vec<_> = before[..5].iter().rev().cloned().collect();
    let got: Vec<_> = page.into_iter().map(|(pos, r)| (pos, r.id)).collect();
    assert_eq!(got, expected);
    let conn = rusqlite::Connection::open(&path).unwrap();
    let auto_vacuum: i64 = conn
        .pragma_query_value(None, "auto_vacuum", |r| r.get(0))
        .unwrap();
    assert_eq!(auto_vacuum, 2, "incremental");
    drop(conn);
    // Deleting the newest row never lets its position be handed out again.
    let newest = before.last().unwrap().0;
    let records = vec![old_terminal(99, "2025-01-02T00:00:00.000Z", 1)];
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute("DELETE FROM operations WHERE seq = ?1", [newest])
        .unwrap();
    db.load(&records).unwrap();
    let page = db
        .list_page(
            AGENT,
            PageQuery {
                idempotency_key: None,
                state: None,
                before: None,
                limit: 1,
            },
        )
        .await
        .unwrap();
    assert_eq!(page[0].1.id, records[0].id);
    assert!(page[0].0 > newest, "{} <= {newest}", page[0].0);
}
