//! What the broker asks of its store (`DurableStore`), written once against
//! `Arc<dyn DurableStore>` and run against both houses: `sqlite::*` on a SQLite file in a
//! temporary data dir, `postgres::*` on a real PostgreSQL (one server shared by this binary's
//! tests while they run, a database of its own per test). A PostgreSQL test skips, saying why,
//! only when PostgreSQL cannot be run here.
//!
//! What only one house has stays with it: SQLite's data dir lock, busy file and free pages in
//! `store/sqlite/`; PostgreSQL's fleet (one event log with no gaps across concurrent writers,
//! waking another replica, schema and connection errors) in `postgres_fleet.rs`.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use support::postgres::PostgresServer;
use unyolo_admission::OperationState;
use unyolo_admission::broker::store::{
    self, DecidedMove, DecisionCommand, DecisionOutcome, DecisionScope, DurableStore, EventKind,
    EventPage, InsertError, OperationRecord, PageQuery, Presentation, RequestQuery, RequestStatus,
    StateChange, StateFilter, StoreError, StoreLocation, StoredEvent, StreamRecord, now_rfc3339,
};

/// Writes `mod sqlite` and `mod postgres`, each with one test per name that runs the async
/// function of that name against its house.
macro_rules! store_tests {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Kind::Postgres).await
                }
            )*
        }
    };
}

store_tests! {
    a_second_insert_of_a_key_is_a_duplicate,
    concurrent_inserts_of_one_key_make_one_operation,
    a_row_in_an_unknown_state_reads_back_as_corrupt,
    a_listing_page_reads_no_request_and_a_lookup_no_request_text,
    listing_pages_walk_newest_first_and_filter_by_key_and_state,
    request_pages_filter_by_state_requester_target_and_position,
    a_target_filter_matches_numbers_by_value_strings_by_text_and_flags_as_themselves,
    each_change_of_a_request_writes_one_event_and_other_work_none,
    trimming_keeps_the_newest_as_a_gapless_suffix_and_older_cursors_expire,
    a_decision_commits_once_and_its_retry_replays_or_conflicts,
    a_refused_decision_writes_nothing,
    concurrent_decisions_on_one_request_commit_exactly_one,
    recovery_fails_executing_work_as_interrupted_and_returns_the_live,
    retention_retires_only_terminal_work_past_the_cutoff_with_its_decisions,
    streams_are_recorded_counted_and_deleted,
    the_history_is_every_operation_with_its_state_and_times_oldest_first,
    writes_queued_together_commit_together_each_answering_for_itself,
}

/// Which house a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Postgres,
}

/// The operation whose changes are requests (they need an approval) in every test.
const REQUEST: &str = "demo.request";

/// A store of one house, and a way to write rows behind its back.
struct House {
    store: Arc<dyn DurableStore>,
    raw: Raw,
    _dir: tempfile::TempDir,
}

enum Raw {
    Sqlite(PathBuf),
    Postgres {
        server: Arc<PostgresServer>,
        database: String,
    },
}

impl House {
    /// A fresh store of `kind` named for `test`, or `None` (having said why) when PostgreSQL
    /// cannot be run here.
    async fn open(kind: Kind, test: &str) -> Option<House> {
        let dir = tempfile::tempdir().unwrap();
        match kind {
            Kind::Sqlite => {
                let location = StoreLocation::Dir(dir.path().to_owned());
                let store = store::open(&location, "admission", [REQUEST], dir.path())
                    .await
                    .unwrap();
                Some(House {
                    store,
                    raw: Raw::Sqlite(dir.path().join(store::DATABASE_FILE)),
                    _dir: dir,
                })
            }
            Kind::Postgres => {
                let server = PostgresServer::shared()?;
                let url = server.database(test);
                let location = StoreLocation::parse(&url).unwrap();
                let store = store::open(&location, "admission", [REQUEST], dir.path())
                    .await
                    .unwrap();
                Some(House {
                    store,
                    raw: Raw::Postgres {
                        server,
                        database: test.to_owned(),
                    },
                    _dir: dir,
                })
            }
        }
    }

    /// The store's write lock, held from another connection until released: writes queue.
    fn lock(&self) -> support::faults::StoreLock {
        match &self.raw {
            Raw::Sqlite(path) => support::faults::StoreLock::take_file(path),
            Raw::Postgres { server, database } => {
                support::faults::StoreLock::take_postgres(&server.url(database))
            }
        }
    }

    /// Runs `sql` on the store's database behind its back.
    fn execute(&self, sql: &str) {
        match &self.raw {
            Raw::Sqlite(path) => rusqlite::Connection::open(path)
                .unwrap()
                .execute_batch(sql)
                .unwrap(),
            Raw::Postgres { server, database } => {
                server.psql(database, sql);
            }
        }
    }
}

/// Opens the house for this test or returns from it.
macro_rules! house {
    ($kind:expr, $name:literal) => {
        match House::open($kind, $name).await {
            Some(house) => house,
            None => return,
        }
    };
}

fn record(id: &str, key: &str) -> OperationRecord {
    let now = now_rfc3339();
    OperationRecord {
        client_id: "bot-7".to_owned(),
        idempotency_key: key.to_owned(),
        operation: "demo.run".to_owned(),
        created_at: now.clone(),
        updated_at: now,
        presentation: Presentation {
            title: format!("Run {id}"),
            summary: None,
        },
        ..OperationRecord::example(id)
    }
}

fn request(i: usize, operation: &str) -> OperationRecord {
    OperationRecord {
        operation: operation.to_owned(),
        reason: "r".to_owned(),
        presentation: Presentation {
            title: format!("Request {i}"),
            summary: None,
        },
        ..record(&request_id(i), &format!("k{i}"))
    }
}

fn request_id(i: usize) -> String {
    format!("op_{i:032}")
}

fn events_of(page: EventPage) -> Vec<StoredEvent> {
    match page {
        EventPage::Events { events, .. } => events,
        EventPage::Expired => panic!("expired"),
    }
}

async fn a_second_insert_of_a_key_is_a_duplicate(kind: Kind) {
    let house = house!(kind, "duplicate");
    let db = &house.store;
    db.insert(record("op_1", "k")).await.unwrap();
    let again = db.insert(record("op_2", "k")).await;
    assert!(matches!(again, Err(InsertError::Duplicate)), "{again:?}");
    // Another client's key is its own.
    let other = OperationRecord {
        client_id: "bot-8".to_owned(),
        ..record("op_3", "k")
    };
    db.insert(other).await.unwrap();
    assert_eq!(db.count_operations().await.unwrap(), 2);
}

async fn concurrent_inserts_of_one_key_make_one_operation(kind: Kind) {
    let house = house!(kind, "concurrent_inserts");
    let tasks: Vec<_> = (0..8)
        .map(|n| {
            let db = Arc::clone(&house.store);
            tokio::spawn(async move { db.insert(record(&format!("op_{n}"), "same")).await })
        })
        .collect();
    let (mut created, mut duplicates) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Ok(()) => created += 1,
            Err(InsertError::Duplicate) => duplicates += 1,
            Err(InsertError::Store(err)) => panic!("{err}"),
        }
    }
    assert_eq!((created, duplicates), (1, 7));
    assert_eq!(house.store.count_operations().await.unwrap(), 1);
}

async fn a_row_in_an_unknown_state_reads_back_as_corrupt(kind: Kind) {
    let house = house!(kind, "corrupt_state");
    house.store.insert(record("op_1", "k")).await.unwrap();
    house.execute("UPDATE operations SET state = 'mislaid'");
    let err = house.store.get("op_1").await.unwrap_err();
    assert!(matches!(err, StoreError::CorruptRow(_)), "{err}");
}

async fn a_listing_page_reads_no_request_and_a_lookup_no_request_text(kind: Kind) {
    let house = house!(kind, "no_request_text");
    let db = &house.store;
    db.insert(record("op_1", "k")).await.unwrap();
    // Whatever the stored request holds, a page and a request lookup never parse it.
    house.execute("UPDATE operations SET target = 'not json', arguments = '{broken'");
    let query = PageQuery {
        limit: 10,
        ..PageQuery::default()
    };
    let page = db.list_page("bot-7", query).await.unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(page[0].1.presentation.title, "Run op_1");
    let stored = db.request_by_key("bot-7", "k").await.unwrap().unwrap();
    assert_eq!((stored.id.as_str(), stored.bytes), ("op_1", 8 + 7));
    assert_eq!(stored.digest.len(), 64);
    assert_eq!(db.request_of("op_1").await.unwrap(), Some(stored));
    // The whole operation does parse it.
    let err = db.get("op_1").await.unwrap_err();
    assert!(matches!(err, StoreError::CorruptRow(_)), "{err}");
}

async fn listing_pages_walk_newest_first_and_filter_by_key_and_state(kind: Kind) {
    let house = house!(kind, "listing_pages");
    let db = &house.store;
    for i in 0..5 {
        db.insert(record(&format!("op_{i}"), &format!("k{i}")))
            .await
            .unwrap();
    }
    db.set_state(
        "op_3",
        OperationState::Pending,
        OperationState::Approved,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    let page = |before, state, key: Option<&str>| PageQuery {
        idempotency_key: key.map(str::to_owned),
        state,
        before,
        limit: 2,
    };
    let ids = |page: &[(i64, unyolo_admission::broker::store::OperationSummary)]| {
        page.iter().map(|(_, s)| s.id.clone()).collect::<Vec<_>>()
    };
    let first = db.list_page("bot-7", page(None, None, None)).await.unwrap();
    assert_eq!(ids(&first), ["op_4", "op_3"]);
    let second = db
        .list_page("bot-7", page(Some(first[1].0), None, None))
        .await
        .unwrap();
    assert_eq!(ids(&second), ["op_2", "op_1"]);
    let third = db
        .list_page("bot-7", page(Some(second[1].0), None, None))
        .await
        .unwrap();
    assert_eq!(ids(&third), ["op_0"]);
    let approved = db
        .list_page("bot-7", page(None, Some(OperationState::Approved), None))
        .await
        .unwrap();
    assert_eq!(ids(&approved), ["op_3"]);
    assert_eq!(approved[0].1.revision, 2);
    let keyed = db
        .list_page("bot-7", page(None, None, Some("k1")))
        .await
        .unwrap();
    assert_eq!(ids(&keyed), ["op_1"]);
    assert!(
        db.list_page("bot-8", page(None, None, None))
            .await
            .unwrap()
            .is_empty()
    );
}

async fn request_pages_filter_by_state_requester_target_and_position(kind: Kind) {
    let house = house!(kind, "request_pages");
    let db = &house.store;
    for i in 0..4 {
        let target: serde_json::Value = serde_json::from_str(&format!(
            r#"{{"host": "h{}", "port": {}, "tls": true}}"#,
            i % 2,
            5430 + i
        ))
        .unwrap();
        let requester = if i == 3 { "bot-8" } else { "bot-7" };
        db.insert(OperationRecord {
            target,
            client_id: requester.to_owned(),
            created_at: format!("2026-01-01T00:00:0{i}.000Z"),
            ..request(i, REQUEST)
        })
        .await
        .unwrap();
    }
    db.insert(request(9, "demo.run")).await.unwrap();
    db.set_state(
        &request_id(0),
        OperationState::Pending,
        OperationState::Denied,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    let query = |states, requester: Option<&str>, target: Vec<(&str, &str)>| RequestQuery {
        operations: vec![REQUEST.to_owned()],
        states,
        requester: requester.map(str::to_owned),
        target: target
            .into_iter()
            .map(|(k, v)| (k.to_owned(), vec![v.to_owned()]))
            .collect(),
        before: None,
        limit: 10,
    };
    let ids = |page: Vec<OperationRecord>| page.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let all = db
        .request_page(query(StateFilter::Any, None, vec![]))
        .await
        .unwrap();
    assert_eq!(
        ids(all.clone()),
        [3, 2, 1, 0].map(request_id),
        "newest first, requests only"
    );
    let pending = db
        .request_page(query(
            StateFilter::In(vec![OperationState::Pending]),
            None,
            vec![],
        ))
        .await
        .unwrap();
    assert_eq!(ids(pending), [3, 2, 1].map(request_id));
    let not_pending = db
        .request_page(query(
            StateFilter::NotIn(vec![OperationState::Pending]),
            None,
            vec![],
        ))
        .await
        .unwrap();
    assert_eq!(ids(not_pending), [request_id(0)]);
    let by_requester = db
        .request_page(query(StateFilter::Any, Some("bot-8"), vec![]))
        .await
        .unwrap();
    assert_eq!(ids(by_requester), [request_id(3)]);
    let by_host = db
        .request_page(query(StateFilter::Any, None, vec![("host", "h1")]))
        .await
        .unwrap();
    assert_eq!(ids(by_host), [3, 1].map(request_id));
    let by_port = db
        .request_page(query(StateFilter::Any, None, vec![("port", "5432")]))
        .await
        .unwrap();
    assert_eq!(ids(by_port), [request_id(2)]);
    let by_flag = db
        .request_page(query(
            StateFilter::Any,
            None,
            vec![("tls", "true"), ("host", "h0")],
        ))
        .await
        .unwrap();
    assert_eq!(ids(by_flag), [2, 0].map(request_id));
    let after = db
        .request_page(RequestQuery {
            before: Some((all[1].created_at.clone(), all[1].id.clone())),
            ..query(StateFilter::Any, None, vec![])
        })
        .await
        .unwrap();
    assert_eq!(ids(after), [1, 0].map(request_id));
    // Two kinds of request: both, newest first, still without other work.
    db.insert(OperationRecord {
        created_at: "2026-01-01T00:00:05.000Z".to_owned(),
        ..request(5, "demo.review")
    })
    .await
    .unwrap();
    let two_kinds = |states, before| RequestQuery {
        operations: vec![REQUEST.to_owned(), "demo.review".to_owned()],
        before,
        ..query(states, None, vec![])
    };
    let both = db
        .request_page(two_kinds(StateFilter::Any, None))
        .await
        .unwrap();
    assert_eq!(ids(both.clone()), [5, 3, 2, 1, 0].map(request_id));
    let pending_after = db
        .request_page(two_kinds(
            StateFilter::In(vec![OperationState::Pending]),
            Some((both[1].created_at.clone(), both[1].id.clone())),
        ))
        .await
        .unwrap();
    assert_eq!(ids(pending_after), [2, 1].map(request_id));
    // The limit bounds the merged page, and a kind named twice is read once.
    let first_two = db
        .request_page(RequestQuery {
            limit: 2,
            ..two_kinds(StateFilter::Any, None)
        })
        .await
        .unwrap();
    assert_eq!(ids(first_two), [5, 3].map(request_id));
    let named_twice = db
        .request_page(RequestQuery {
            operations: vec![
                "demo.review".to_owned(),
                REQUEST.to_owned(),
                "demo.review".to_owned(),
            ],
            ..two_kinds(StateFilter::Any, None)
        })
        .await
        .unwrap();
    assert_eq!(ids(named_twice), [5, 3, 2, 1, 0].map(request_id));
}

async fn a_target_filter_matches_numbers_by_value_strings_by_text_and_flags_as_themselves(
    kind: Kind,
) {
    let house = house!(kind, "target_filters");
    let db = &house.store;
    // Each target as a client wrote it: the store keeps a number's text as written.
    let targets: [&str; 21] = [
        r#"{"n": 1.50}"#,
        r#"{"n": 1.5}"#,
        r#"{"n": "1.5"}"#,
        r#"{"n": 15e-1}"#,
        r#"{"n": 10}"#,
        r#"{"n": 1e1}"#,
        r#"{"n": -3}"#,
        r#"{"n": -3.0}"#,
        r#"{"n": "1.50"}"#,
        r#"{"n": true}"#,
        r#"{"n": "true"}"#,
        r#"{"n": null}"#,
        r#"{"m": 1}"#,
        r#"{"n": 1}"#,
        r#"{"n": [1.5]}"#,
        r#"{"n": 1e400}"#,
        r#"{"n": 0}"#,
        r#"{"n": 1e-400}"#,
        r#"{"n": 9007199254740993}"#,
        // Past the bounds a filter compares: matched by nothing, refused by no store.
        r#"{"n": 1e-1000}"#,
        &format!(r#"{{"n": 1{}}}"#, "0".repeat(1000)),
    ];
    for (i, target) in targets.iter().enumerate() {
        let target: serde_json::Value = serde_json::from_str(target).unwrap();
        db.insert(OperationRecord {
            target,
            created_at: format!("2026-01-01T00:00:{i:02}.000Z"),
            ..request(i, REQUEST)
        })
        .await
        .unwrap();
    }
    let matching = |value: &str| {
        let query = RequestQuery {
            operations: vec![REQUEST.to_owned()],
            target: vec![("n".to_owned(), vec![value.to_owned()])],
            limit: 100,
            ..RequestQuery::default()
        };
        async move {
            let mut found: Vec<usize> = db
                .request_page(query)
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.id["op_".len()..].parse::<usize>().unwrap())
                .collect();
            found.sort_unstable();
            found
        }
    };
    for (value, expected) in [
        // A number by its value, however either is written; a string by its text.
        ("1.5", vec![0, 1, 2, 3]),
        ("1.50", vec![0, 1, 3, 8]),
        ("15e-1", vec![0, 1, 3]),
        ("10", vec![4, 5]),
        ("1e1", vec![4, 5]),
        ("10.0", vec![4, 5]),
        ("1E+1", vec![4, 5]),
        ("-3", vec![6, 7]),
        ("-3.00", vec![6, 7]),
        ("3", vec![]),
        ("-1.5", vec![]),
        // An integer is a number, not `true`; `true` is the flag or the string.
        ("1", vec![13]),
        ("true", vec![9, 10]),
        ("false", vec![]),
        // `null` is the field holding null, not a field that is missing.
        ("null", vec![11]),
        // Zero, and what is too small for a double to tell from it.
        ("0", vec![16, 17]),
        ("-0.0", vec![16, 17]),
        // As doubles: the nearest to 2^53 + 1 is 2^53.
        ("9007199254740992", vec![18]),
        // Text that is no JSON number matches no number; one past a double matches nothing.
        ("+1.5", vec![]),
        (".5", vec![]),
        ("1e400", vec![]),
        ("[1.5]", vec![]),
        (&format!("1{}", "0".repeat(1000)), vec![]),
        ("1e1000", vec![]),
    ] {
        assert_eq!(matching(value).await, expected, "target.n={value}");
    }
}

/// Waits (at most 5 s) until every event written is in the log. SQLite's are at once;
/// PostgreSQL numbers an event once no transaction older than its writer is open on the server
/// (other tests' included), so its log catches up a moment later.
async fn settle(db: &Arc<dyn DurableStore>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let written = db.count_events().await.unwrap();
        let numbered = match db.events_after(None, 100_000).await.unwrap() {
            EventPage::Events { events, .. } => events.len() as u64,
            EventPage::Expired => 0,
        };
        if numbered == written {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{numbered} of {written} events numbered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (at most 5 s) until the bell has published `seq`.
async fn rung(db: &Arc<dyn DurableStore>, seq: i64) {
    let mut bell = db.event_bell().subscribe();
    let waited = tokio::time::timeout(Duration::from_secs(5), bell.wait_for(|n| *n >= seq)).await;
    assert!(waited.is_ok(), "the bell never rang {seq}");
}

async fn each_change_of_a_request_writes_one_event_and_other_work_none(kind: Kind) {
    let house = house!(kind, "one_event_a_change");
    let db = &house.store;
    db.insert(request(1, REQUEST)).await.unwrap();
    db.insert(request(2, "demo.run")).await.unwrap();
    rung(db, 1).await;
    let moved = db
        .set_state(
            &request_id(1),
            OperationState::Pending,
            OperationState::Approved,
            StateChange::default(),
        )
        .await
        .unwrap();
    assert!(moved.is_some());
    // A move from a state the row is not in changes nothing and writes nothing.
    let stale = db
        .set_state(
            &request_id(1),
            OperationState::Pending,
            OperationState::Denied,
            StateChange::default(),
        )
        .await
        .unwrap();
    assert!(stale.is_none());
    db.set_state(
        &request_id(2),
        OperationState::Pending,
        OperationState::Canceled,
        StateChange::default(),
    )
    .await
    .unwrap();
    db.set_state(
        &request_id(1),
        OperationState::Approved,
        OperationState::Canceled,
        StateChange::default(),
    )
    .await
    .unwrap();
    settle(db).await;
    let events = events_of(db.events_after(None, 100).await.unwrap());
    let got: Vec<_> = events
        .iter()
        .map(|e| (e.seq, e.kind, e.revision, e.status, e.used_count))
        .collect();
    assert_eq!(
        got,
        [
            (1, EventKind::RequestCreated, 1, RequestStatus::Pending, 0),
            (2, EventKind::RequestApproved, 2, RequestStatus::Active, 0),
            (3, EventKind::GrantRevoked, 3, RequestStatus::Revoked, 0),
        ]
    );
    rung(db, 3).await;
    assert_eq!(db.event_bell().newest(), 3);
    assert_eq!(db.event_bell().written().get(), 3);
    assert_eq!(db.events_of(&request_id(1)).await.unwrap(), events);
    let stored = db.get(&request_id(1)).await.unwrap().unwrap();
    assert_eq!(stored.ended_from, Some(OperationState::Approved));
    assert_eq!(stored.revision, 3);
}

async fn trimming_keeps_the_newest_as_a_gapless_suffix_and_older_cursors_expire(kind: Kind) {
    let house = house!(kind, "trimming");
    let db = &house.store;
    for i in 0..30 {
        db.insert(request(i, REQUEST)).await.unwrap();
    }
    settle(db).await;
    let mut trimmed = 0;
    loop {
        let n = db.trim_events(10, None, 7).await.unwrap();
        trimmed += n;
        if n < 7 {
            break;
        }
    }
    assert_eq!(trimmed, 20);
    assert_eq!(db.count_events().await.unwrap(), 10);
    let left = events_of(db.events_after(None, 100).await.unwrap());
    assert_eq!(
        left.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (21..=30).collect::<Vec<_>>()
    );
    assert_eq!(
        db.events_after(Some(19), 100).await.unwrap(),
        EventPage::Expired
    );
    assert_eq!(
        events_of(db.events_after(Some(20), 100).await.unwrap()).len(),
        10
    );
    assert_eq!(
        events_of(db.events_after(Some(30), 100).await.unwrap()).len(),
        0
    );
    let page = db.events_after(Some(20), 4).await.unwrap();
    let EventPage::Events {
        after,
        events,
        more,
    } = page
    else {
        panic!("expired");
    };
    assert_eq!((after, events.len(), more), (20, 4, true));
    // With a cutoff after every event, all go; then only the newest cursor still resumes.
    let later = humantime::format_rfc3339_millis(
        std::time::SystemTime::now() + std::time::Duration::from_secs(60),
    )
    .to_string();
    assert_eq!(db.trim_events(10, Some(later), 100).await.unwrap(), 10);
    assert_eq!(
        db.events_after(Some(29), 100).await.unwrap(),
        EventPage::Expired
    );
    assert_eq!(
        db.events_after(Some(30), 100).await.unwrap(),
        EventPage::Events {
            after: 30,
            events: vec![],
            more: false
        }
    );
    assert_eq!(
        db.events_after(None, 100).await.unwrap(),
        EventPage::Events {
            after: 30,
            events: vec![],
            more: false
        },
        "an empty cursor goes on from the high-water mark"
    );
}

fn command(i: usize, key: &str, hash: &str) -> DecisionCommand {
    DecisionCommand {
        scope: DecisionScope {
            request_id: request_id(i),
            action: "approve".to_owned(),
            idempotency_key: key.to_owned(),
        },
        command_hash: hash.to_owned(),
        operator: "ops".to_owned(),
        on_behalf_of: Some("team".to_owned()),
    }
}

/// Approves a pending request; refuses anything else with its state.
fn approve_if_pending(record: &OperationRecord) -> Result<DecidedMove, OperationState> {
    if record.state == OperationState::Pending {
        Ok(DecidedMove {
            to: OperationState::Approved,
            revoked: false,
            lasts: Some(Duration::from_secs(60)),
        })
    } else {
        Err(record.state)
    }
}

fn render(record: &OperationRecord) -> String {
    format!("{} at {}", record.state, record.revision)
}

async fn a_decision_commits_once_and_its_retry_replays_or_conflicts(kind: Kind) {
    let house = house!(kind, "decision_replay");
    let db = &house.store;
    db.insert(request(1, REQUEST)).await.unwrap();
    let first = db
        .decide(command(1, "d1", "h"), approve_if_pending, render)
        .await
        .unwrap();
    let DecisionOutcome::Committed(record, rendered) = first else {
        panic!("{first:?}");
    };
    assert_eq!(rendered, "approved at 2");
    let decided = record.decided.clone().unwrap();
    assert_eq!(
        (
            decided.by.as_str(),
            decided.on_behalf_of.as_deref(),
            decided.revoked
        ),
        ("ops", Some("team"), false)
    );
    assert!(record.active_expires_at.is_some());
    assert_eq!(db.get(&record.id).await.unwrap().unwrap(), record);
    let again = db
        .decide(command(1, "d1", "h"), approve_if_pending, render)
        .await
        .unwrap();
    assert!(
        matches!(&again, DecisionOutcome::Replayed(r) if r == "approved at 2"),
        "{again:?}"
    );
    let other = db
        .decide(command(1, "d1", "another"), approve_if_pending, render)
        .await
        .unwrap();
    assert!(
        matches!(other, DecisionOutcome::IdempotencyConflict),
        "{other:?}"
    );
    let missing = db
        .decide(command(7, "d1", "h"), approve_if_pending, render)
        .await
        .unwrap();
    assert!(matches!(missing, DecisionOutcome::NotFound), "{missing:?}");
    assert_eq!(db.count_decisions().await.unwrap(), 1);
    settle(db).await;
    let kinds: Vec<_> = db
        .events_of(&request_id(1))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds,
        [EventKind::RequestCreated, EventKind::RequestApproved]
    );
}

async fn a_refused_decision_writes_nothing(kind: Kind) {
    let house = house!(kind, "decision_refused");
    let db = &house.store;
    db.insert(request(1, REQUEST)).await.unwrap();
    db.set_state(
        &request_id(1),
        OperationState::Pending,
        OperationState::Canceled,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    let refused = db
        .decide(command(1, "d1", "h"), approve_if_pending, render)
        .await
        .unwrap();
    let DecisionOutcome::Refused(why, record) = refused else {
        panic!("{refused:?}");
    };
    assert_eq!(why, OperationState::Canceled);
    assert_eq!(record.revision, 2);
    assert_eq!(db.count_decisions().await.unwrap(), 0);
    settle(db).await;
    assert_eq!(db.events_of(&request_id(1)).await.unwrap().len(), 2);
}

async fn concurrent_decisions_on_one_request_commit_exactly_one(kind: Kind) {
    let house = house!(kind, "decisions_race");
    let db = &house.store;
    db.insert(request(1, REQUEST)).await.unwrap();
    db.insert(request(2, REQUEST)).await.unwrap();
    // Request 1: eight operators, eight keys: one approval commits, the rest are refused.
    // Request 2: one command retried eight times: one commits, the rest replay it.
    let mut tasks = Vec::new();
    for n in 0..8 {
        let db = Arc::clone(db);
        tasks.push(tokio::spawn(async move {
            db.decide(
                command(1, &format!("d{n}"), &format!("h{n}")),
                approve_if_pending,
                render,
            )
            .await
            .unwrap()
        }));
        let db2 = Arc::clone(&house.store);
        tasks.push(tokio::spawn(async move {
            db2.decide(command(2, "same", "h"), approve_if_pending, render)
                .await
                .unwrap()
        }));
    }
    let (mut committed, mut refused, mut replayed) = (0, 0, 0);
    for task in tasks {
        match task.await.unwrap() {
            DecisionOutcome::Committed(..) => committed += 1,
            DecisionOutcome::Refused(state, _) => {
                assert_eq!(state, OperationState::Approved);
                refused += 1;
            }
            DecisionOutcome::Replayed(rendered) => {
                assert_eq!(rendered, "approved at 2");
                replayed += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((committed, refused, replayed), (2, 7, 7));
    assert_eq!(db.count_decisions().await.unwrap(), 2);
    settle(db).await;
    for i in [1, 2] {
        let stored = db.get(&request_id(i)).await.unwrap().unwrap();
        assert_eq!(
            (stored.state, stored.revision),
            (OperationState::Approved, 2)
        );
        assert_eq!(db.events_of(&request_id(i)).await.unwrap().len(), 2);
    }
}

async fn recovery_fails_executing_work_as_interrupted_and_returns_the_live(kind: Kind) {
    let house = house!(kind, "recovery");
    let db = &house.store;
    for i in 0..4 {
        db.insert(request(i, REQUEST)).await.unwrap();
    }
    let to = |i, from, to| {
        let db = Arc::clone(db);
        async move {
            db.set_state(&request_id(i), from, to, StateChange::default())
                .await
                .unwrap()
                .unwrap()
        }
    };
    use OperationState as S;
    to(1, S::Pending, S::Approved).await;
    to(2, S::Pending, S::Approved).await;
    to(2, S::Approved, S::Executing).await;
    to(3, S::Pending, S::Denied).await;
    std::fs::create_dir_all(db.streams_dir()).unwrap();
    std::fs::write(db.streams_dir().join("st_1"), [0u8; 12]).unwrap();
    db.insert_stream(StreamRecord {
        id: "st_1".to_owned(),
        client_id: "bot-7".to_owned(),
        size: 12,
    })
    .await
    .unwrap();
    let recovered = db.recover().await.unwrap();
    let interrupted: Vec<_> = recovered
        .interrupted
        .iter()
        .map(|r| (r.id.clone(), r.state, r.error.clone().map(|e| e.code)))
        .collect();
    assert_eq!(
        interrupted,
        [(
            request_id(2),
            S::Failed,
            Some("execution_interrupted".to_owned())
        )]
    );
    let live: Vec<_> = recovered.live.iter().map(|r| r.id.clone()).collect();
    assert_eq!(live, [0, 1].map(request_id));
    assert_eq!(recovered.streams.len(), 1);
    settle(db).await;
    let events = db.events_of(&request_id(2)).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (last.kind, last.status, last.revision),
        (EventKind::ExecutionFailed, RequestStatus::Consumed, 4)
    );
    // A second recovery finds nothing executing.
    assert!(db.recover().await.unwrap().interrupted.is_empty());
    let mut by_state = db.operations_by_state().await.unwrap();
    by_state.sort_by_key(|(s, _)| s.as_str());
    assert_eq!(
        by_state,
        [
            (S::Approved, 1),
            (S::Denied, 1),
            (S::Failed, 1),
            (S::Pending, 1)
        ]
    );
    let counts = db.counts().await.unwrap();
    let mut operations = counts.operations.clone();
    operations.sort_by_key(|(_, s, _)| s.as_str());
    assert_eq!(
        operations,
        [
            ("bot-7".to_owned(), S::Approved, 1),
            ("bot-7".to_owned(), S::Pending, 1)
        ]
    );
    assert_eq!(counts.streams, [("bot-7".to_owned(), 1, 12)]);
}

async fn retention_retires_only_terminal_work_past_the_cutoff_with_its_decisions(kind: Kind) {
    let house = house!(kind, "retention");
    let db = &house.store;
    for i in 0..3 {
        db.insert(request(i, REQUEST)).await.unwrap();
    }
    db.decide(command(0, "d", "h"), approve_if_pending, render)
        .await
        .unwrap();
    db.set_state(
        &request_id(0),
        OperationState::Approved,
        OperationState::Canceled,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    db.set_state(
        &request_id(1),
        OperationState::Pending,
        OperationState::Expired,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    let before = "2000-01-01T00:00:00.000Z".to_owned();
    assert!(db.retiring(before, 10).await.unwrap().is_empty());
    let later = humantime::format_rfc3339_millis(
        std::time::SystemTime::now() + std::time::Duration::from_secs(60),
    )
    .to_string();
    let batch = db.retiring(later.clone(), 10).await.unwrap();
    let mut ids: Vec<_> = batch.iter().map(|r| r.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, [0, 1].map(request_id));
    assert_eq!(db.retire(batch.clone()).await.unwrap(), 2);
    assert_eq!(
        db.retire(batch).await.unwrap(),
        0,
        "retiring twice is harmless"
    );
    assert_eq!(db.count_operations().await.unwrap(), 1);
    assert_eq!(db.count_decisions().await.unwrap(), 0);
    assert!(db.get(&request_id(0)).await.unwrap().is_none());
    assert_eq!(
        db.key_records().await.unwrap(),
        [("bot-7".to_owned(), "k2".to_owned(), request_id(2))]
    );
    // A replay after retention is new work.
    db.insert(request(0, REQUEST)).await.unwrap();
    assert_eq!(db.key_count().await.unwrap(), 2);
}

async fn streams_are_recorded_counted_and_deleted(kind: Kind) {
    let house = house!(kind, "streams");
    let db = &house.store;
    for (id, client, size) in [
        ("st_1", "bot-7", 5),
        ("st_2", "bot-7", 7),
        ("st_3", "bot-8", 1),
    ] {
        // Recorded once its body is written, as the broker does.
        let dir = db.streams_dir();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(id), vec![1u8; size as usize]).unwrap();
        db.insert_stream(StreamRecord {
            id: id.to_owned(),
            client_id: client.to_owned(),
            size,
        })
        .await
        .unwrap();
    }
    assert_eq!(
        db.get_stream("st_2").await.unwrap(),
        Some(StreamRecord {
            id: "st_2".to_owned(),
            client_id: "bot-7".to_owned(),
            size: 7
        })
    );
    assert!(db.delete_stream("st_1").await.unwrap());
    assert!(!db.delete_stream("st_1").await.unwrap());
    let mut ids = db.stream_ids().await.unwrap();
    ids.sort();
    assert_eq!(
        ids,
        [
            ("st_2".to_owned(), "bot-7".to_owned()),
            ("st_3".to_owned(), "bot-8".to_owned())
        ]
    );
    let mut streams = db.counts().await.unwrap().streams;
    streams.sort();
    assert_eq!(
        streams,
        [("bot-7".to_owned(), 1, 7), ("bot-8".to_owned(), 1, 1)]
    );
    assert!(db.ping().await.is_ok());
    assert!(!db.sizes().is_empty());
}

async fn the_history_is_every_operation_with_its_state_and_times_oldest_first(kind: Kind) {
    let house = house!(kind, "history");
    let db = &house.store;
    assert!(db.history().await.unwrap().is_empty());
    let mut inserted = Vec::new();
    for i in 0..3 {
        let record = request(i, REQUEST);
        inserted.push(record.clone());
        db.insert(record).await.unwrap();
    }
    let run = OperationRecord {
        client_id: "bot-8".to_owned(),
        ..record("op_run", "run")
    };
    db.insert(run.clone()).await.unwrap();
    use OperationState as S;
    db.set_state(
        &request_id(1),
        S::Pending,
        S::Approved,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();
    db.set_state(
        &request_id(2),
        S::Pending,
        S::Denied,
        StateChange::default(),
    )
    .await
    .unwrap()
    .unwrap();

    let history = db.history().await.unwrap();
    let rows: Vec<_> = history
        .iter()
        .map(|h| {
            (
                h.client_id.as_str(),
                h.operation.as_str(),
                h.state,
                h.created_at.as_str(),
            )
        })
        .collect();
    let mut expected: Vec<_> = inserted
        .iter()
        .chain([&run])
        .map(|r| {
            (
                r.client_id.as_str(),
                r.operation.as_str(),
                r.state,
                r.created_at.as_str(),
            )
        })
        .collect();
    expected[1].2 = S::Approved;
    expected[2].2 = S::Denied;
    // Oldest first: by creation time (each written by `now_rfc3339`), then by id.
    expected.sort_by_key(|(_, _, _, at)| *at);
    assert_eq!(rows, expected);
    for h in &history {
        assert_eq!(h.terminal_at.is_some(), h.state.is_terminal(), "{h:?}");
        let ended = (h.state == S::Denied).then_some(S::Pending);
        assert_eq!(h.ended_from, ended, "{h:?}");
    }
}

/// What a write queued behind the store's lock answered.
#[derive(Debug)]
enum Answer {
    Inserted(Result<(), InsertError>),
    Moved(Box<Result<Option<OperationRecord>, StoreError>>),
}

/// Queues `writes` behind the store's write lock (held from another connection), lets it go,
/// and returns each write's answer in order: the writes reach the store together, as a burst's
/// do, and are committed in as few transactions as the store's group commit makes.
async fn behind_the_lock(house: &House, writes: Vec<Option<OperationRecord>>) -> Vec<Answer> {
    let lock = house.lock();
    let tasks: Vec<_> = writes
        .into_iter()
        .map(|write| {
            let db = Arc::clone(&house.store);
            tokio::spawn(async move {
                match write {
                    Some(record) => Answer::Inserted(db.insert(record).await),
                    None => Answer::Moved(Box::new(
                        db.set_state(
                            "op_moving",
                            OperationState::Approved,
                            OperationState::Executing,
                            StateChange::default(),
                        )
                        .await,
                    )),
                }
            })
        })
        .collect();
    // Long enough for every write to queue (none can commit while the lock is held).
    tokio::time::sleep(Duration::from_millis(400)).await;
    lock.release();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

async fn writes_queued_together_commit_together_each_answering_for_itself(kind: Kind) {
    let house = house!(kind, "group_commit");
    let db = &house.store;
    db.insert(record("op_taken", "taken")).await.unwrap();
    db.insert(OperationRecord {
        state: OperationState::Approved,
        ..record("op_moving", "moving")
    })
    .await
    .unwrap();

    // A burst: twenty creations, a key already taken, and a state change.
    let mut writes: Vec<_> = (0..20)
        .map(|n| Some(record(&format!("op_g{n}"), &format!("g{n}"))))
        .collect();
    writes.insert(7, Some(record("op_again", "taken")));
    writes.insert(13, None);
    let answers = behind_the_lock(&house, writes).await;
    for (n, answer) in answers.iter().enumerate() {
        match (n, answer) {
            (7, Answer::Inserted(Err(InsertError::Duplicate))) => {}
            (13, Answer::Moved(moved)) => match moved.as_ref() {
                Ok(Some(moved)) => assert_eq!(
                    (moved.state, moved.revision),
                    (OperationState::Executing, 2)
                ),
                other => panic!("the state change answered {other:?}"),
            },
            (n, Answer::Inserted(Ok(()))) if n != 7 && n != 13 => {}
            (n, other) => panic!("write {n} answered {other:?}"),
        }
    }
    assert_eq!(db.count_operations().await.unwrap(), 22);
    assert!(db.get("op_again").await.unwrap().is_none());
    if let Raw::Postgres { server, database } = &house.raw {
        // Each row records the transaction that wrote it: the burst shared a few.
        let transactions: usize = server
            .psql(
                database,
                "SELECT count(DISTINCT xmin::text) FROM operations WHERE idempotency_key LIKE 'g%'",
            )
            .parse()
            .unwrap();
        assert!(
            transactions <= 10,
            "20 creations queued together committed in {transactions} transactions"
        );
    }

    // A write that fails (an id already stored, under a new key: SQLite reads any uniqueness as
    // the key's, PostgreSQL fails the statement) among others: it answers its error alone, the
    // others commit.
    let mut writes: Vec<_> = (0..10)
        .map(|n| Some(record(&format!("op_h{n}"), &format!("h{n}"))))
        .collect();
    writes.insert(4, Some(record("op_g3", "fresh")));
    let answers = behind_the_lock(&house, writes).await;
    for (n, answer) in answers.iter().enumerate() {
        match (n, answer) {
            (4, Answer::Inserted(Err(_))) => {}
            (n, Answer::Inserted(Ok(()))) if n != 4 => {}
            (n, other) => panic!("write {n} answered {other:?}"),
        }
    }
    assert_eq!(db.count_operations().await.unwrap(), 32);
    assert_eq!(
        db.get("op_g3").await.unwrap().unwrap().idempotency_key,
        "g3",
        "the failed write changed nothing"
    );
}
