//! A PostgreSQL store written by a schema-1 broker, opened by this one: migrated to the current
//! schema once, its rows kept as they were, its work recovered; one written by a schema-2
//! broker, migrated through schema 3 once (its indexes, not its rows); and one written by a
//! schema-3 broker, given the table of uploads in progress. (A database newer than this broker
//! is refused in `postgres_fleet.rs`.) One PostgreSQL serves the binary's tests while they
//! run, a database for each; each test skips, saying why, only when PostgreSQL cannot be run
//! here.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::postgres::PostgresServer;
use unyolo_admission::OperationState;
use unyolo_admission_broker::store::{
    self, EventKind, EventPage, PageQuery, RequestStatus, StreamRecord,
};

/// The operation whose changes are requests.
const REQUEST: &str = "demo.request";

/// Schema 1 as a schema-1 broker created it (`store/postgres/schema.rs` from `serve --store`
/// until schema 2), kept here as it was so the migration is tested from what is in the field,
/// not from today's copy of it. A schema-1 broker created `schema_version` first, then this,
/// then wrote its version, in one transaction.
const SCHEMA_1: &str = r#"
CREATE TABLE IF NOT EXISTS schema_version (version bigint NOT NULL);
CREATE TABLE operations (
    seq                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id                   text COLLATE "C" NOT NULL UNIQUE,
    client_id            text COLLATE "C" NOT NULL,
    idempotency_key      text COLLATE "C" NOT NULL,
    operation            text COLLATE "C" NOT NULL,
    target               text NOT NULL,
    arguments            text NOT NULL,
    reason               text NOT NULL,
    state                text COLLATE "C" NOT NULL,
    created_at           text COLLATE "C" NOT NULL,
    updated_at           text COLLATE "C" NOT NULL,
    terminal_at          text COLLATE "C",
    error_code           text,
    error_message        text,
    revision             bigint NOT NULL DEFAULT 1,
    title                text,
    summary              text,
    request_digest       text,
    decided_at           text COLLATE "C",
    decided_by           text,
    decided_on_behalf_of text,
    revoked              boolean NOT NULL DEFAULT false,
    ended_from           text,
    active_expires_at    text COLLATE "C",
    pending_expires_at   text COLLATE "C",
    CONSTRAINT operations_client_key UNIQUE (client_id, idempotency_key)
);
CREATE INDEX operations_by_state ON operations (state);
CREATE INDEX operations_by_client ON operations (client_id, seq);
CREATE INDEX operations_by_client_state ON operations (client_id, state, seq);
CREATE INDEX operations_by_created_at ON operations (created_at);
CREATE INDEX operations_retiring ON operations (terminal_at) WHERE terminal_at IS NOT NULL;
CREATE INDEX operations_requests ON operations (operation, created_at, id);
CREATE INDEX operations_requests_by_state ON operations (operation, state, created_at, id);
CREATE INDEX operations_underived ON operations (seq) WHERE request_digest IS NULL;

CREATE TABLE streams (
    seq        bigint GENERATED ALWAYS AS IDENTITY,
    id         text COLLATE "C" PRIMARY KEY,
    client_id  text COLLATE "C" NOT NULL,
    size       bigint NOT NULL,
    created_at text COLLATE "C" NOT NULL
);

CREATE TABLE operator_decisions (
    request_id      text COLLATE "C" NOT NULL,
    action          text COLLATE "C" NOT NULL,
    idempotency_key text COLLATE "C" NOT NULL,
    command_hash    text NOT NULL,
    operator        text NOT NULL,
    committed       text NOT NULL,
    created_at      text COLLATE "C" NOT NULL,
    PRIMARY KEY (request_id, action, idempotency_key)
);

CREATE TABLE operator_events (
    seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    xid         xid8 NOT NULL DEFAULT pg_current_xact_id(),
    position    bigint UNIQUE,
    kind        text NOT NULL,
    request_id  text COLLATE "C" NOT NULL,
    revision    bigint NOT NULL,
    status      text NOT NULL,
    occurred_at text COLLATE "C" NOT NULL,
    used_count  bigint NOT NULL
);
CREATE INDEX operator_events_unpositioned ON operator_events (xid, seq) WHERE position IS NULL;
CREATE INDEX operator_events_by_request ON operator_events (request_id, seq);

CREATE TABLE replicas (
    name        text COLLATE "C" PRIMARY KEY,
    lease_until timestamptz NOT NULL,
    joined_at   timestamptz NOT NULL
);

CREATE TABLE event_positions (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    high_water bigint NOT NULL
);
INSERT INTO event_positions (high_water) VALUES (0);
INSERT INTO schema_version (version) VALUES (1);
"#;

/// Schema 2 over 1 as a schema-2 broker wrote it (`store/postgres/schema.rs` until schema 3),
/// kept as it was, with the version row that broker wrote after it.
const MIGRATE_2: &str = r#"
ALTER TABLE operations ADD COLUMN owner text COLLATE "C";
ALTER TABLE streams ADD COLUMN owner text COLLATE "C";
ALTER TABLE streams ADD COLUMN body bytea;
CREATE INDEX operations_live_by_owner ON operations (owner, seq)
    WHERE state IN ('pending', 'approved', 'executing');
INSERT INTO schema_version (version) VALUES (2);
"#;

/// Schema 3 over 2 as a schema-3 broker wrote it (`store/postgres/schema.rs` until schema 4),
/// with its version row.
const MIGRATE_3: &str = r#"
CREATE INDEX operations_ended_by_client ON operations (client_id, state, seq)
    WHERE state IN ('succeeded', 'failed', 'denied', 'canceled', 'expired');
DROP INDEX operations_by_state;
DROP INDEX operations_by_client_state;
DROP INDEX operations_requests_by_state;
INSERT INTO schema_version (version) VALUES (3);
"#;

/// What a schema-1 broker had written: a pending, an approved, an executing and a succeeded
/// request, the approval's decision record, the first request's event (numbered), and a
/// stream (its body in the replica's staged file, as schema 1 kept it).
const ROWS_1: &str = r#"
INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, reason,
    state, created_at, updated_at, terminal_at, revision, title, summary, request_digest,
    decided_at, decided_by, ended_from, active_expires_at, pending_expires_at)
VALUES
    ('op_pending', 'bot-7', 'k1', 'demo.request', '{"repo": "demo", "n": 1.50}',
     '{"duration_ms": 5}', 'first', 'pending', '2026-01-01T00:00:01.000Z',
     '2026-01-01T00:00:01.000Z', NULL, 1, 'Request 1', NULL, 'sha256:01', NULL, NULL, NULL,
     NULL, '2099-01-01T00:00:00.000Z'),
    ('op_approved', 'bot-7', 'k2', 'demo.request', '{"repo": "demo"}', '{}', 'second',
     'approved', '2026-01-01T00:00:02.000Z', '2026-01-01T00:00:03.000Z', NULL, 2,
     'Request 2', 'to approve', 'sha256:02', '2026-01-01T00:00:03.000Z', 'alice', NULL,
     '2099-01-01T00:00:00.000Z', '2099-01-01T00:00:00.000Z'),
    ('op_executing', 'bot-8', 'k3', 'demo.request', '{}', '{}', 'third', 'executing',
     '2026-01-01T00:00:04.000Z', '2026-01-01T00:00:06.000Z', NULL, 3, 'Request 3', NULL,
     'sha256:03', '2026-01-01T00:00:05.000Z', 'alice', NULL, '2099-01-01T00:00:00.000Z',
     '2099-01-01T00:00:00.000Z'),
    ('op_succeeded', 'bot-8', 'k4', 'demo.request', '{}', '{}', 'fourth', 'succeeded',
     '2026-01-01T00:00:07.000Z', '2026-01-01T00:00:09.000Z', '2026-01-01T00:00:09.000Z', 4,
     'Request 4', NULL, 'sha256:04', '2026-01-01T00:00:08.000Z', 'bob', 'executing',
     '2099-01-01T00:00:00.000Z', '2099-01-01T00:00:00.000Z');
INSERT INTO operator_decisions (request_id, action, idempotency_key, command_hash, operator,
    committed, created_at)
VALUES ('op_approved', 'approve', 'd1', 'h1', 'alice', '{"id": "op_approved"}',
    '2026-01-01T00:00:03.000Z');
INSERT INTO operator_events (position, kind, request_id, revision, status, occurred_at,
    used_count)
VALUES (1, 'request.created', 'op_pending', 1, 'pending', '2026-01-01T00:00:01.000Z', 0);
UPDATE event_positions SET high_water = 1;
INSERT INTO streams (id, client_id, size, created_at)
VALUES ('st_1', 'bot-7', 12, '2026-01-01T00:00:10.000Z');
"#;

/// Every table's schema-1 columns, row by row, oldest first: what the migration must keep.
const READ_1: &str = "SELECT * FROM (\
     SELECT 'operations', row_to_json(o)::text FROM (SELECT seq, id, client_id, \
     idempotency_key, operation, target, arguments, reason, state, created_at, updated_at, \
     terminal_at, error_code, error_message, revision, title, summary, request_digest, \
     decided_at, decided_by, decided_on_behalf_of, revoked, ended_from, active_expires_at, \
     pending_expires_at FROM operations) o \
     UNION ALL SELECT 'streams', row_to_json(s)::text FROM (SELECT seq, id, client_id, size, \
     created_at FROM streams) s \
     UNION ALL SELECT 'operator_decisions', row_to_json(d)::text FROM operator_decisions d \
     UNION ALL SELECT 'operator_events', row_to_json(e)::text FROM operator_events e \
     UNION ALL SELECT 'event_positions', row_to_json(p)::text FROM event_positions p\
     ) AS rows ORDER BY 1, 2";

/// The shape of a database's tables: every column (type, nullability, collation) and index.
const SHAPE: &str = "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || \
     is_nullable || ' ' || coalesce(collation_name, '-') FROM information_schema.columns \
     WHERE table_schema = 'public' \
     UNION ALL SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1";

/// The `replicas` table of [`SCHEMA_1`]: a few unreleased commits wrote schema 1 without it.
const REPLICAS_1: &str = r#"CREATE TABLE replicas (
    name        text COLLATE "C" PRIMARY KEY,
    lease_until timestamptz NOT NULL,
    joined_at   timestamptz NOT NULL
);"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_1_database_written_before_the_replicas_table_is_migrated_to_the_same_shape() {
    let Some((server, url)) = database("schema_one_early") else {
        return;
    };
    let early = SCHEMA_1.replace(REPLICAS_1, "");
    assert_ne!(early, SCHEMA_1, "the replicas table is taken out");
    server.psql(
        "schema_one_early",
        &format!("BEGIN; {early} {ROWS_1} COMMIT;"),
    );
    let dir = tempfile::tempdir().unwrap();
    let db = connect(&url, dir.path()).await;
    // A replica can join the fleet of the migrated database.
    assert_eq!(
        db.join_fleet("r1", std::time::Duration::from_secs(10))
            .await
            .unwrap(),
        Vec::<String>::new()
    );
    let (_, fresh) = database("schema_fresh_early").unwrap();
    drop(connect(&fresh, dir.path()).await);
    assert_eq!(
        server.psql("schema_one_early", SHAPE),
        server.psql("schema_fresh_early", SHAPE)
    );
}

/// The shared server and a fresh database's name and URL, or `None` (having said why).
fn database(name: &str) -> Option<(Arc<PostgresServer>, String)> {
    let server = PostgresServer::shared()?;
    let url = server.database(name);
    Some((server, url))
}

async fn connect(url: &str, streams: &std::path::Path) -> store::PostgresStore {
    store::PostgresStore::connect(url, "admission", [REQUEST], streams.to_owned())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_1_database_is_migrated_once_keeping_its_rows_and_its_work_is_recovered() {
    let Some((server, url)) = database("schema_one") else {
        return;
    };
    server.psql("schema_one", &format!("BEGIN; {SCHEMA_1} {ROWS_1} COMMIT;"));
    let written = server.psql("schema_one", READ_1);
    assert_eq!(written.lines().count(), 8, "{written}");
    let dir = tempfile::tempdir().unwrap();

    let db = connect(&url, dir.path()).await;
    assert_eq!(
        server.psql(
            "schema_one",
            "SELECT version FROM schema_version ORDER BY version"
        ),
        "1\n4",
        "migrated to 4, one version row written"
    );
    assert_eq!(
        server.psql("schema_one", READ_1),
        written,
        "every row of schema 1 is there, unchanged"
    );
    assert_eq!(
        server.psql(
            "schema_one",
            "SELECT (SELECT count(*) FROM operations WHERE owner IS NULL) || ' ' || \
             (SELECT count(*) FROM streams WHERE owner IS NULL AND body IS NULL)"
        ),
        "4 1",
        "rows of schema 1 own no replica; a stream's body stays in its staged file"
    );
    // The migrated database is the one this broker creates afresh.
    let (_, fresh) = database("schema_fresh").unwrap();
    drop(connect(&fresh, dir.path()).await);
    assert_eq!(
        server.psql("schema_one", SHAPE),
        server.psql("schema_fresh", SHAPE)
    );

    // The store reads them as they were written.
    let approved = db.get("op_approved").await.unwrap().unwrap();
    assert_eq!(
        (
            approved.state,
            approved.revision,
            approved.client_id.as_str()
        ),
        (OperationState::Approved, 2, "bot-7")
    );
    assert_eq!(
        approved.decided.as_ref().map(|d| d.by.as_str()),
        Some("alice")
    );
    let pending = db.get("op_pending").await.unwrap().unwrap();
    assert_eq!(
        pending.target,
        serde_json::from_str::<serde_json::Value>(r#"{"repo": "demo", "n": 1.50}"#).unwrap()
    );
    assert_eq!(db.count_decisions().await.unwrap(), 1);
    let EventPage::Events { events, .. } = db.events_after(None, 10).await.unwrap() else {
        panic!("the event log of schema 1 is kept");
    };
    assert_eq!(
        events
            .iter()
            .map(|e| (e.seq, e.kind, e.request_id.as_str(), e.status))
            .collect::<Vec<_>>(),
        [(
            1,
            EventKind::RequestCreated,
            "op_pending",
            RequestStatus::Pending
        )]
    );
    assert_eq!(
        db.get_stream("st_1").await.unwrap(),
        Some(StreamRecord {
            id: "st_1".to_owned(),
            client_id: "bot-7".to_owned(),
            size: 12
        })
    );

    // The first replica to recover takes the work of schema 1: the executing request was cut
    // off (it ends failed, interrupted), the pending and approved ones and the stream are its.
    db.join_fleet("replica-a", Duration::from_secs(30))
        .await
        .unwrap();
    let recovered = db.recover().await.unwrap();
    assert_eq!(
        recovered
            .interrupted
            .iter()
            .map(|r| (
                r.id.as_str(),
                r.state,
                r.error.as_ref().map(|e| e.code.as_str())
            ))
            .collect::<Vec<_>>(),
        [(
            "op_executing",
            OperationState::Failed,
            Some("execution_interrupted")
        )]
    );
    assert_eq!(
        recovered
            .live
            .iter()
            .map(|r| (r.id.as_str(), r.state))
            .collect::<Vec<_>>(),
        [
            ("op_pending", OperationState::Pending),
            ("op_approved", OperationState::Approved)
        ]
    );
    assert_eq!(
        recovered
            .streams
            .iter()
            .map(|s| s.id.as_str())
            .collect::<Vec<_>>(),
        ["st_1"]
    );
    assert_eq!(
        server.psql(
            "schema_one",
            "SELECT id || ' ' || state || ' ' || coalesce(owner, '-') FROM operations \
             ORDER BY seq"
        ),
        "op_pending pending replica-a\nop_approved approved replica-a\n\
         op_executing failed -\nop_succeeded succeeded -"
    );
    assert_eq!(
        server.psql("schema_one", "SELECT owner FROM streams"),
        "replica-a"
    );
    let mut failed = db.get("op_executing").await.unwrap().unwrap();
    assert_eq!(
        (failed.revision, failed.ended_from),
        (4, Some(OperationState::Executing))
    );
    failed = db.get("op_succeeded").await.unwrap().unwrap();
    assert_eq!(
        (failed.state, failed.revision),
        (OperationState::Succeeded, 4)
    );
    // The recovery's event is numbered in the background: settled before the rows are read
    // for the second start to compare with (which would number it otherwise).
    let numbered = support::eventually::eventually(async || {
        server.psql(
            "schema_one",
            "SELECT count(*) FROM operator_events WHERE position IS NULL",
        ) == "0"
    })
    .await;
    assert!(numbered, "the recovery's event is never numbered");
    db.leave_fleet("replica-a").await.unwrap();
    drop(db);

    // A second start finds schema 4 and migrates nothing.
    let after_first = server.psql("schema_one", READ_1);
    let again = connect(&url, dir.path()).await;
    assert_eq!(
        server.psql(
            "schema_one",
            "SELECT version FROM schema_version ORDER BY version"
        ),
        "1\n4"
    );
    assert_eq!(server.psql("schema_one", READ_1), after_first);
    assert_eq!(
        again.get("op_approved").await.unwrap().unwrap().state,
        OperationState::Approved
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_2_database_is_migrated_through_3_once_its_indexes_not_its_rows() {
    let Some((server, url)) = database("schema_two") else {
        return;
    };
    server.psql(
        "schema_two",
        &format!("BEGIN; {SCHEMA_1} {ROWS_1} {MIGRATE_2} COMMIT;"),
    );
    let written = server.psql("schema_two", READ_1);
    let dir = tempfile::tempdir().unwrap();

    let db = connect(&url, dir.path()).await;
    let versions = "SELECT version FROM schema_version ORDER BY version";
    assert_eq!(server.psql("schema_two", versions), "1\n2\n4");
    assert_eq!(server.psql("schema_two", READ_1), written, "no row changed");
    // The indexes of schema 3: three dropped, the terminal rows' one by client added.
    let indexes = "SELECT string_agg(indexname, ' ' ORDER BY indexname) FROM pg_indexes \
         WHERE tablename = 'operations'";
    assert_eq!(
        server.psql("schema_two", indexes),
        "operations_by_client operations_by_created_at operations_client_key \
         operations_ended_by_client operations_id_key operations_live_by_owner operations_pkey \
         operations_requests operations_retiring operations_underived"
    );
    // The same as this broker creates afresh.
    let (_, fresh) = database("schema_three").unwrap();
    drop(connect(&fresh, dir.path()).await);
    assert_eq!(
        server.psql("schema_two", SHAPE),
        server.psql("schema_three", SHAPE)
    );

    // A client's listing by a terminal state, by a live one, and by none.
    let listed = |state: Option<OperationState>| {
        let db = &db;
        async move {
            db.list_page(
                "bot-8",
                PageQuery {
                    state,
                    limit: 10,
                    ..PageQuery::default()
                },
            )
            .await
            .unwrap()
            .into_iter()
            .map(|(_, summary)| summary.id)
            .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        listed(Some(OperationState::Succeeded)).await,
        ["op_succeeded"]
    );
    assert_eq!(
        listed(Some(OperationState::Executing)).await,
        ["op_executing"]
    );
    assert_eq!(listed(None).await, ["op_succeeded", "op_executing"]);
    drop(db);

    // A second start finds schema 4 and migrates nothing.
    drop(connect(&url, dir.path()).await);
    assert_eq!(server.psql("schema_two", versions), "1\n2\n4");
    assert_eq!(server.psql("schema_two", READ_1), written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_3_database_gets_the_uploads_table_and_its_streams_count_against_the_caps() {
    let Some((server, url)) = database("schema_three_old") else {
        return;
    };
    server.psql(
        "schema_three_old",
        &format!("BEGIN; {SCHEMA_1} {ROWS_1} {MIGRATE_2} {MIGRATE_3} COMMIT;"),
    );
    let written = server.psql("schema_three_old", READ_1);
    let dir = tempfile::tempdir().unwrap();
    let db = connect(&url, dir.path()).await;
    let versions = "SELECT version FROM schema_version ORDER BY version";
    assert_eq!(server.psql("schema_three_old", versions), "1\n2\n3\n4");
    assert_eq!(
        server.psql("schema_three_old", READ_1),
        written,
        "no row changed"
    );
    let (_, fresh) = database("schema_four").unwrap();
    drop(connect(&fresh, dir.path()).await);
    assert_eq!(
        server.psql("schema_three_old", SHAPE),
        server.psql("schema_four", SHAPE)
    );

    // The stream schema 1 wrote (bot-7's, 12 bytes) counts: bot-7 may hold one stream, so it
    // gets no room; bot-8 gets room, held as the replica's upload until it starts again.
    db.join_fleet("r1", Duration::from_secs(30)).await.unwrap();
    let caps = unyolo_admission::StoreCaps {
        global_files: 10,
        global_bytes: 1 << 20,
        client_files: 1,
        client_bytes: 1 << 20,
    };
    assert!(
        !db.take_stream_room("up_1", "bot-7", 5, &caps)
            .await
            .unwrap()
    );
    assert!(
        db.take_stream_room("up_2", "bot-8", 5, &caps)
            .await
            .unwrap()
    );
    assert!(
        !db.take_stream_room("up_3", "bot-8", 5, &caps)
            .await
            .unwrap(),
        "bot-8's upload in progress counts"
    );
    let uploads = "SELECT string_agg(id || ' ' || client_id || ' ' || size || ' ' || owner, ',') \
         FROM stream_uploads";
    assert_eq!(server.psql("schema_three_old", uploads), "up_2 bot-8 5 r1");
    drop(db);
    // Started again, the replica's uploads in progress are over: their room is let go.
    let again = connect(&url, dir.path()).await;
    again
        .join_fleet("r1", Duration::from_secs(30))
        .await
        .unwrap();
    again.recover().await.unwrap();
    assert_eq!(server.psql("schema_three_old", uploads), "");
    assert!(
        again
            .take_stream_room("up_4", "bot-8", 5, &caps)
            .await
            .unwrap()
    );
}
