//! What the broker asks of its store (`DurableStore`), written once against
//! `Arc<dyn DurableStore>` and run against both houses (`support::houses`): `sqlite::*` on a
//! SQLite file in a temporary data dir, `postgres::*` on a real PostgreSQL (one server shared by
//! this binary's tests while they run, a database of its own per test). A PostgreSQL test skips,
//! saying why, only when PostgreSQL cannot be run here. This file: inserts and their keys,
//! listing and request pages, the event log. `store_conformance_decisions.rs`: decisions,
//! recovery, retention, streams, the history and grouped writes.
//!
//! What only one house has stays with it: SQLite's data dir lock, busy file and free pages in
//! `store/sqlite/`; PostgreSQL's fleet (one event log with no gaps across concurrent writers,
//! waking another replica, schema and connection errors) in `postgres_fleet.rs`.

mod support;

use std::sync::Arc;

use support::houses::{Kind, REQUEST, events_of, record, request, request_id, rung, settle};
use unyolo_admission::OperationState;
use unyolo_admission_broker::store::{
    EventKind, EventPage, InsertError, OperationRecord, PageQuery, RequestQuery, RequestStatus,
    StateChange, StateFilter, StoreError,
};

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
    let ids = |page: &[(i64, unyolo_admission_broker::store::OperationSummary)]| {
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
