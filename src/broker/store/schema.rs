//! The tables, their indexes, and the migrations that bring an older file up to
//! [`SCHEMA_VERSION`]: in one file, so a reader checks a query against the table and its indexes,
//! and a change to the table against every file written before it.
//!
//! Every operation row carries a `revision`: 1 at creation, +1 in the same statement as every
//! change (state, error, recovery), so a client that saw revision N knows whether anything
//! changed since, across restarts too. Listing pages walk `seq`, the table's explicit rowid
//! (creation order; `AUTOINCREMENT`, so never reused, even after retention deleted the newest
//! rows; and kept by `VACUUM`, which may renumber an implicit rowid) through the `(client_id)` and
//! `(client_id, state)` indexes, so a page costs the same however many rows there are. Schema 3
//! made `seq` explicit: the migration copies each row's old rowid into it, so a cursor handed out
//! before the upgrade still points at the same place after it.
//!
//! Schema 6 adds the Operator V1 event log (`operator_events`, see `events`): one row per
//! revision change of a request, its `seq` the event's sequence (`AUTOINCREMENT`: never reused,
//! so a cursor never names two events), and `operations.ended_from`, the state a terminal
//! operation left (what tells a request revoked from approved from one canceled while pending,
//! and a failure after running from one before it).
//!
//! Each step applies when `user_version` is below its number, in its own transaction, so steps
//! written on different branches chain in number order.
//!
//! A new file uses incremental auto-vacuum from its first table (see `maintenance`); an older
//! file is switched over once at start-up with one full `VACUUM`.

use std::path::Path;

use rusqlite::Connection;

use super::error::StoreError;

/// The schema version this code writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 6;

/// The operations table, named `{name}`. `seq` is its explicit rowid: listing cursors are `seq`
/// values, so they survive a `VACUUM` (which may renumber an implicit rowid) and, with
/// `AUTOINCREMENT`, are never reused even after retention deleted the newest rows.
const OPERATIONS_TABLE: &str = "
CREATE TABLE {name} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT NOT NULL UNIQUE,
    client_id       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    operation       TEXT NOT NULL,
    target          TEXT NOT NULL,
    arguments       TEXT NOT NULL,
    reason          TEXT NOT NULL,
    state           TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    terminal_at     TEXT,
    error_code      TEXT,
    error_message   TEXT,
    revision        INTEGER NOT NULL DEFAULT 1,
    UNIQUE (client_id, idempotency_key)
);
";

/// The operations table's indexes (listing pages, recovery, counts).
const OPERATIONS_INDEXES: &str = "
CREATE INDEX operations_by_state ON operations (state);
CREATE INDEX operations_by_client ON operations (client_id);
CREATE INDEX operations_by_client_state ON operations (client_id, state);
";

const STREAMS_TABLE: &str = "
CREATE TABLE streams (
    id         TEXT PRIMARY KEY NOT NULL,
    client_id  TEXT NOT NULL,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
";

/// The columns of an operation row, in table order after `seq`.
pub(super) const OPERATION_COLUMNS: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision";

/// From schema version 1: every existing operation starts at revision 1 (it has no recorded
/// history), and the indexes that listing pages walk.
const MIGRATE_1_TO_2: &str = "
ALTER TABLE operations ADD COLUMN revision INTEGER NOT NULL DEFAULT 1;
CREATE INDEX operations_by_client ON operations (client_id);
CREATE INDEX operations_by_client_state ON operations (client_id, state);
";

/// From schema version 2: the operations table is copied into one whose rowid is the explicit
/// `seq`, each row keeping its rowid as its `seq`, so every listing cursor handed out before the
/// migration still points at the same place.
fn migrate_2_to_3() -> String {
    format!(
        "{table} INSERT INTO operations_v3 (seq, {OPERATION_COLUMNS}) \
         SELECT rowid, {OPERATION_COLUMNS} FROM operations ORDER BY rowid; \
         DROP TABLE operations; ALTER TABLE operations_v3 RENAME TO operations; {OPERATIONS_INDEXES}",
        table = OPERATIONS_TABLE.replace("{name}", "operations_v3"),
    )
}

/// Schema 6: the event log and `operations.ended_from` (see the module doc). Rows written before
/// it have no events and no `ended_from`.
const MIGRATE_TO_6: &str = "
CREATE TABLE operator_events (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    kind        TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    revision    INTEGER NOT NULL,
    status      TEXT NOT NULL,
    occurred_at TEXT NOT NULL,
    used_count  INTEGER NOT NULL
);
ALTER TABLE operations ADD COLUMN ended_from TEXT;
";

/// `PRAGMA auto_vacuum` value for `INCREMENTAL`: freed pages stay in the file until
/// `PRAGMA incremental_vacuum` returns them to the filesystem, which the retention sweep does in
/// small steps.
const AUTO_VACUUM_INCREMENTAL: i64 = 2;

/// Brings the file at `path` (open on `writer`) to [`SCHEMA_VERSION`]: creates the schema in a
/// new file, migrates an older one, refuses a newer one, and switches an older file to
/// incremental vacuum.
pub(super) fn migrate(writer: &Connection, path: &Path) -> Result<(), StoreError> {
    let version: i64 = writer.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::UnknownSchema {
            path: path.to_owned(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    match version {
        0 => {
            writer.execute_batch(&format!(
                "BEGIN; {table} {OPERATIONS_INDEXES} {STREAMS_TABLE} \
                 PRAGMA user_version = 3; COMMIT;",
                table = OPERATIONS_TABLE.replace("{name}", "operations"),
            ))?;
        }
        1 | 2 => {
            let first = if version == 1 { MIGRATE_1_TO_2 } else { "" };
            writer.execute_batch(&format!(
                "BEGIN; {first} {} PRAGMA user_version = 3; COMMIT;",
                migrate_2_to_3()
            ))?;
        }
        _ => {}
    }
    if version < 6 {
        writer.execute_batch(&format!(
            "BEGIN; {MIGRATE_TO_6} PRAGMA user_version = 6; COMMIT;"
        ))?;
    }
    // An older file (or one created by hand) is switched to incremental vacuum once: the mode
    // only takes effect through a full `VACUUM`, which rewrites the file (a one-time cost at
    // start-up, logged). Cursors are `seq` values, which `VACUUM` keeps.
    let auto_vacuum: i64 = writer.pragma_query_value(None, "auto_vacuum", |r| r.get(0))?;
    if auto_vacuum != AUTO_VACUUM_INCREMENTAL {
        tracing::warn!(path = %path.display(), "switching the store to incremental vacuum (one full VACUUM)");
        writer.pragma_update(None, "auto_vacuum", "INCREMENTAL")?;
        writer.execute_batch("VACUUM")?;
    }
    Ok(())
}

/// Creates the indexes no schema version owns. The start-up rate replay reads operations by
/// creation time, and the retention sweep terminal ones by when they ended. Created at every
/// open, not by a schema version: an index changes no row, and an older file gains it on its next
/// start.
pub(super) fn ensure_indexes(writer: &Connection) -> Result<(), StoreError> {
    writer.execute_batch(
        "CREATE INDEX IF NOT EXISTS operations_by_created_at ON operations (created_at); \
         CREATE INDEX IF NOT EXISTS operations_retiring ON operations (terminal_at) \
         WHERE terminal_at IS NOT NULL;",
    )?;
    Ok(())
}
