//! What the broker asks of its store (`DurableStore`), the second half of
//! `store_conformance.rs` (which says how each test runs against both houses): operator
//! decisions, recovery at start-up, retention, streams, the history a candidate quota file is
//! judged on, and writes queued together.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::houses::{House, Kind, REQUEST, Raw, record, request, request_id, settle};
use unyolo_admission::OperationState;
use unyolo_admission_broker::store::{
    DecidedMove, DecisionCommand, DecisionOutcome, DecisionScope, EventKind, InsertError,
    OperationRecord, RequestStatus, StateChange, StoreError, StreamRecord,
};

store_tests! {
    a_decision_commits_once_and_its_retry_replays_or_conflicts,
    a_refused_decision_writes_nothing,
    concurrent_decisions_on_one_request_commit_exactly_one,
    recovery_fails_executing_work_as_interrupted_and_returns_the_live,
    retention_retires_only_terminal_work_past_the_cutoff_with_its_decisions,
    streams_are_recorded_counted_and_deleted,
    the_history_is_every_operation_with_its_state_and_times_oldest_first,
    writes_queued_together_commit_together_each_answering_for_itself,
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
