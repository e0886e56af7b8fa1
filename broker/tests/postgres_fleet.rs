//! What only a PostgreSQL store shared by a fleet has (the semantics both houses share are
//! `store_conformance.rs`'s): one event log with no gaps when writers commit out of order, a
//! change on one replica waking another, the schema created once by replicas starting at
//! once, a newer schema refused, an unreachable server, and the password shown nowhere. One
//! PostgreSQL serves the binary's tests while they run, a database for each; each test skips,
//! saying why, only when PostgreSQL cannot be run here.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::postgres::PostgresServer;
use unyolo_admission_broker::store::{
    self, DurableStore, EventPage, OperationRecord, Presentation, StoreError, StoreLocation,
    StoredEvent, now_rfc3339,
};

/// The operation whose changes are requests.
const REQUEST: &str = "demo.request";

fn request_id(i: usize) -> String {
    format!("op_{i:032}")
}

/// A pending request of `bot-7`, key `k{i}`, created now.
fn request(i: usize) -> OperationRecord {
    let now = now_rfc3339();
    OperationRecord {
        client_id: "bot-7".to_owned(),
        idempotency_key: format!("k{i}"),
        operation: REQUEST.to_owned(),
        created_at: now.clone(),
        updated_at: now,
        presentation: Presentation {
            title: format!("Request {i}"),
            summary: None,
        },
        ..OperationRecord::example(&request_id(i))
    }
}

fn events_of(page: EventPage) -> Vec<StoredEvent> {
    match page {
        EventPage::Events { events, .. } => events,
        EventPage::Expired => panic!("expired"),
    }
}

/// The shared server and a fresh database's URL, or `None` (having said why).
fn database(name: &str) -> Option<(Arc<PostgresServer>, String)> {
    let server = PostgresServer::shared()?;
    let url = server.database(name);
    Some((server, url))
}

async fn connect(url: &str) -> store::PostgresStore {
    store::PostgresStore::connect(url, "admission", [REQUEST], std::env::temp_dir())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_between_two_commits_is_never_handed_the_later_event_past_the_earlier() {
    let Some((_server, url)) = database("no_gap") else {
        return;
    };
    let db: Arc<dyn DurableStore> = Arc::new(connect(&url).await);
    // A writer that takes the lower number (it inserts first) but commits last: a
    // transaction of its own, held open.
    let (raw, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    raw.batch_execute(
        "BEGIN; INSERT INTO operator_events \
         (kind, request_id, revision, status, occurred_at, used_count) \
         VALUES ('request.created', 'op_early', 1, 'pending', '2026-01-01T00:00:00.000Z', 0)",
    )
    .await
    .unwrap();
    // A second writer inserts after it and commits first.
    db.insert(request(1)).await.unwrap();
    let seqs = raw
        .query("SELECT request_id FROM operator_events ORDER BY seq", &[])
        .await
        .unwrap();
    let in_seq_order: Vec<String> = seqs.iter().map(|r| r.get(0)).collect();
    assert_eq!(in_seq_order, ["op_early", request_id(1).as_str()]);
    // A reader between the commits is handed nothing past the open writer's event.
    let page = db.events_after(None, 100).await.unwrap();
    let EventPage::Events { after, events, .. } = page else {
        panic!("expired");
    };
    assert!(events.is_empty(), "handed {events:?} past an open writer");
    tokio::time::sleep(listen_round()).await;
    assert!(events_of(db.events_after(Some(after), 100).await.unwrap()).is_empty());
    // The earlier writer commits: the reader, going on from its cursor, gets both, the
    // earlier first.
    raw.batch_execute("COMMIT").await.unwrap();
    let events = events_of(db.events_after(Some(after), 100).await.unwrap());
    let got: Vec<_> = events
        .iter()
        .map(|e| (e.seq, e.request_id.clone()))
        .collect();
    assert_eq!(
        got,
        [(1, "op_early".to_owned()), (2, request_id(1))],
        "numbered in commit-safe order, no gap"
    );
}

/// Longer than a fallback round of numbering.
fn listen_round() -> Duration {
    store::postgres::FALLBACK + Duration::from_millis(300)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_on_one_replica_wakes_the_other() {
    let Some((_server, url)) = database("two_replicas") else {
        return;
    };
    let one: Arc<dyn DurableStore> = Arc::new(connect(&url).await);
    let other: Arc<dyn DurableStore> = Arc::new(connect(&url).await);
    let mut changes = other.changes().expect("a fleet store announces changes");
    let mut bell = other.event_bell().subscribe();
    one.insert(request(1)).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let change = changes.recv().await.unwrap();
            if change == format!("{} pending", request_id(1)) {
                return;
            }
        }
    })
    .await;
    assert!(heard.is_ok(), "the other replica heard of the insert");
    // The bell's value is read and let go at once: a `watch::Ref` kept would hold its lock,
    // and the next ring (a numbering round in `events_after` below) would wait for it forever.
    let rang = tokio::time::timeout(Duration::from_secs(5), async {
        bell.wait_for(|n| *n >= 1).await.map(|_| ())
    })
    .await;
    assert!(rang.is_ok(), "the other replica's bell rang");
    let events = events_of(other.events_after(None, 10).await.unwrap());
    assert_eq!(events.len(), 1);
    // And SQLite, one process, announces nothing.
    let dir = tempfile::tempdir().unwrap();
    let sqlite = store::open(
        &StoreLocation::Dir(dir.path().to_owned()),
        "admission",
        [REQUEST],
        dir.path(),
    )
    .await
    .unwrap();
    assert!(sqlite.changes().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_from_a_newer_broker_is_refused_naming_it_without_the_password() {
    let Some((server, url)) = database("newer_schema") else {
        return;
    };
    drop(connect(&url).await);
    server.psql("newer_schema", "UPDATE schema_version SET version = 99");
    // Trusted on loopback: the password is sent nowhere, but must be shown nowhere.
    let with_password = url.replace("admission@", "admission:hunter2@");
    let err =
        store::PostgresStore::connect(&with_password, "admission", [REQUEST], std::env::temp_dir())
            .await
            .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::UnknownSchema {
                found: 99,
                supported: 4,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("admission:***@127.0.0.1"), "{text}");
    assert!(text.contains("/newer_schema"), "{text}");
    assert!(text.contains("99") && text.contains("version 4"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_there_is_unavailable_and_the_password_is_shown_nowhere() {
    let port = support::redis::free_port();
    let url = format!("postgres://admission:hunter2@127.0.0.1:{port}/fleet?sslmode=disable");
    let err = store::PostgresStore::connect(&url, "admission", [REQUEST], std::env::temp_dir())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
    assert!(err.is_transient());
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("admission:***@127.0.0.1"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_from_many_replicas_at_once_creates_the_schema_once() {
    let Some((server, url)) = database("many_starts") else {
        return;
    };
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { connect(&url).await })
        })
        .collect();
    let mut stores = Vec::new();
    for start in starts {
        stores.push(start.await.unwrap());
    }
    assert_eq!(
        server.psql("many_starts", "SELECT version FROM schema_version"),
        "4"
    );
    let shown = format!("{:?}", stores[0]);
    assert!(
        shown.contains("PostgresStore") && shown.contains("/many_starts"),
        "{shown}"
    );
}
