//! The tables, their indexes, and how a database is brought to [`SCHEMA_VERSION`]: created on
//! first start, migrated from an older version, refused when newer. Start-up runs it inside one
//! transaction holding `pg_advisory_xact_lock(MIGRATION_LOCK)`, so when a fleet starts at once
//! one replica creates or migrates and the others wait, then find it done.
//!
//! The records are the SQLite store's, column for column: `target` and `arguments` are `text`
//! (the exact JSON text the broker stored: a number keeps its text), times are the same fixed
//! width RFC 3339 text (`records::now_rfc3339`), compared in the `C` collation so text order is
//! time order whatever the database's locale. Ids, keys and states are `text` too.
//!
//! The event log (`operator_events`, see `events`) numbers events after they commit: each row
//! keeps the transaction that wrote it (`xid`, a `xid8`) and an internal `seq`, and gets its
//! public `position` later; `event_positions` holds the highest position ever handed out (so a
//! cursor past a fully trimmed log is still judged, as SQLite's `sqlite_sequence` does).

use super::super::error::StoreError;

/// The schema version this code writes (the row of `schema_version`).
pub const SCHEMA_VERSION: i64 = 4;

/// The advisory lock start-up holds while it creates or migrates the schema.
pub(super) const MIGRATION_LOCK: i64 = 0x756e_796f_6c6f_0001;

/// The advisory lock the one assigner of event positions holds (see `events`).
pub(super) const POSITION_LOCK: i64 = 0x756e_796f_6c6f_0002;

/// The advisory lock a replica holds while it joins the fleet (see `fleet`), so two replicas
/// starting at once see each other.
pub(super) const FLEET_LOCK: i64 = 0x756e_796f_6c6f_0003;

/// The advisory lock an upload holds while it counts the fleet's streams and takes its room
/// (see `streams`), so two uploads on two replicas never both take the last room.
pub(super) const STREAM_ROOM_LOCK: i64 = 0x756e_796f_6c6f_0004;

/// The channel every change is announced on (payload: an operation's id, a space and its new
/// state; or a deleted stream's id).
pub(super) const CHANGES_CHANNEL: &str = "admission_changes";

/// The live states, as SQL: the predicate of `operations_live_by_owner`. A query that names
/// them (`state IN` this list) may read that index; one that names a parameter may not.
pub(super) const LIVE: &str = "('pending', 'approved', 'executing')";

/// The terminal states, as SQL: the predicate of `operations_ended_by_client`.
pub(super) const TERMINAL: &str = "('succeeded', 'failed', 'denied', 'canceled', 'expired')";

/// Schema 1, whole.
const SCHEMA_1: &str = r#"
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
"#;

/// Schema 2 over 1: each operation (and stream) names the replica that owns it (`owner`: the one that
/// created it, or took it over when that one's membership lapsed), so a fleet's replicas
/// recover, start and take over only their own work. Rows of schema 1 own no replica: the
/// first replica to recover takes them. A stream keeps its body (`body`), so no replica's disk
/// holds what the fleet stored. (`replicas` is created if missing: schema 1 as first written,
/// for a few unreleased commits, had no such table.)
const MIGRATE_2: &str = r#"
CREATE TABLE IF NOT EXISTS replicas (
    name        text COLLATE "C" PRIMARY KEY,
    lease_until timestamptz NOT NULL,
    joined_at   timestamptz NOT NULL
);
ALTER TABLE operations ADD COLUMN owner text COLLATE "C";
ALTER TABLE streams ADD COLUMN owner text COLLATE "C";
ALTER TABLE streams ADD COLUMN body bytea;
CREATE INDEX operations_live_by_owner ON operations (owner, seq)
    WHERE state IN ('pending', 'approved', 'executing');
"#;

/// Schema 3 over 2: fewer index entries written per row version. A state change is never a HOT
/// update (`state` is in `operations_live_by_owner`'s predicate, and the last change sets
/// `terminal_at`), so each new version of a row gets an entry in every full index and in each
/// partial index whose predicate it meets: a `demo.run` creation (three versions: `approved`,
/// `executing`, `succeeded`) wrote 30 index entries under schema 2, 22 under this one. What
/// each dropped index served (checked with `EXPLAIN` on 60,000 rows, 900 of them live), and what
/// serves it now:
///
/// - `operations_by_state` (`state`): every read by state names live states only (`counts`,
///   `live_states`, recovery, the takeover check), so `operations_live_by_owner` (the live rows
///   only, however many have ended) serves them; the count of rows by state (the retention
///   metrics) reads the whole table either way.
/// - `operations_by_client_state` (`client_id, state, seq`): its terminal half is
///   `operations_ended_by_client` (one entry an operation, when it ends, instead of one a
///   version); a listing filtered by a live state reads the live rows (`operations_live_by_owner`,
///   with `operations_by_client` if the planner likes). `list_page` names the state's group in
///   its SQL, so a plan made for any state may use these partial indexes.
/// - `operations_requests_by_state` (`operation, state, created_at, id`): a request page's
///   `operation = ANY($1)` is an array on its first column, so it never gave rows in page order,
///   only a bitmap of every row in the states asked; for the live states asked by the pending and
///   active pages (`page_sql` names the group) `operations_live_by_owner` gives the same, and
///   pages otherwise walk `operations_by_created_at` newest first.
///
/// Kept, each what a query needs for a bounded plan on a big table: the primary key (retire),
/// the unique `id` and `operations_client_key` (every get and change, a submission's key),
/// `operations_by_client` (a client's listing, newest first), `operations_by_created_at` (the
/// rate windows restored at start-up, request pages newest first), `operations_retiring`
/// (retention; terminal rows only), `operations_requests` (request pages where requests are
/// few among many operations: read as a bitmap of the requests alone),
/// `operations_underived` (rows written without a digest: none normally) and
/// `operations_live_by_owner`.
///
/// The new index is built first (holding off writes, not reads, while it is built), the drops
/// last: each takes the table exclusively until the migration commits.
const MIGRATE_3: &str = r#"
CREATE INDEX operations_ended_by_client ON operations (client_id, state, seq)
    WHERE state IN ('succeeded', 'failed', 'denied', 'canceled', 'expired');
DROP INDEX operations_by_state;
DROP INDEX operations_by_client_state;
DROP INDEX operations_requests_by_state;
"#;

/// Schema 4 over 3: the uploads in progress (`stream_uploads`), each holding the room it
/// declared until its stream is recorded or it fails, so the stream caps count across the
/// fleet: an upload on one replica sees the streams and uploads of every other (`streams`).
/// An upload of a replica whose membership lapsed holds nothing.
const MIGRATE_4: &str = r#"
CREATE TABLE stream_uploads (
    id         text COLLATE "C" PRIMARY KEY,
    client_id  text COLLATE "C" NOT NULL,
    size       bigint NOT NULL,
    owner      text COLLATE "C",
    started_at text COLLATE "C" NOT NULL
);
"#;

/// Brings the database to [`SCHEMA_VERSION`] in one transaction under [`MIGRATION_LOCK`]:
/// creates it when empty, refuses a newer one ([`StoreError::UnknownSchema`], naming `shown`).
/// Each version's step runs from the version below it.
pub(super) async fn migrate(
    client: &mut tokio_postgres::Client,
    shown: &str,
) -> Result<(), StoreError> {
    let sort = |e| super::error::sort(shown, e);
    let tx = client.transaction().await.map_err(sort)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(sort)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS schema_version (version bigint NOT NULL)")
        .await
        .map_err(sort)?;
    let found: Option<i64> = tx
        .query_one("SELECT max(version) FROM schema_version", &[])
        .await
        .map_err(sort)?
        .get(0);
    // The steps from the version found up to this one, each from the version below it.
    let steps: &[&str] = match found {
        None => &[SCHEMA_1, MIGRATE_2, MIGRATE_3, MIGRATE_4],
        Some(1) => &[MIGRATE_2, MIGRATE_3, MIGRATE_4],
        Some(2) => &[MIGRATE_3, MIGRATE_4],
        Some(3) => &[MIGRATE_4],
        Some(SCHEMA_VERSION) => &[],
        Some(found) => {
            return Err(StoreError::UnknownSchema {
                store: format!("the database {shown}"),
                found,
                supported: SCHEMA_VERSION,
            });
        }
    };
    if !steps.is_empty() {
        for step in steps {
            tx.batch_execute(step).await.map_err(sort)?;
        }
        tx.execute(
            "INSERT INTO schema_version (version) VALUES ($1)",
            &[&SCHEMA_VERSION],
        )
        .await
        .map_err(sort)?;
    }
    tx.commit().await.map_err(sort)
}
