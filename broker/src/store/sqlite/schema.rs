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
//! Schema 4 stores at creation what a summary and a replay need, so neither reads the request
//! whole: `title` and `summary` (the operation's presentation) and `request_digest` (SHA-256 of
//! the canonical request, see `digest`). Its step adds the three columns; the partial index
//! `operations_underived` lists the rows without them (those the step found, and any a program
//! other than the broker writes), and the broker fills those from their stored JSON at start-up
//! ([`super::SqliteStore::fill_derived`]), so the reads never meet a row without them. The index is
//! empty otherwise, and costs an insert nothing but evaluating its condition.
//!
//! Schema 5 adds what Operator V1 needs: who decided each operation, when, and for whom
//! (`decided_at`, `decided_by`, `decided_on_behalf_of`), whether a cancel took back an approval
//! (`revoked`), and the `operator_decisions` table, one row per committed decision keyed by
//! (request, action, idempotency key), holding the command's hash and the request as that
//! decision committed it (what a replay answers).
//!
//! Schema 6 adds the Operator V1 event log (`operator_events`, see `events`): one row per
//! revision change of a request, its `seq` the event's sequence (`AUTOINCREMENT`: never reused,
//! so a cursor never names two events), and `operations.ended_from`, the state a terminal
//! operation left (what tells a request revoked from approved from one canceled while pending,
//! and a failure after running from one before it). A migrated file's rows get it from what
//! they recorded: a success, or a failure with an `execution_` error, ended `executing`; a
//! cancel that took back an approval (`revoked`) ended `approved`; for every other row the
//! status does not depend on it.
//!
//! Schema 7 adds `operations.active_expires_at`: when an operator's approval lapses if the
//! operation has not started by then (Operator V1's `active_expires_at`; the decision's
//! `constraints.duration_seconds`, or the requested duration, after the approval). Rows written
//! before it have none: their approvals never lapse, as before.
//!
//! Schema 8 adds `operations.pending_expires_at`: when a request nobody decides expires, fixed
//! at its creation (its `created_at` plus the `--pending-timeout` then), as upstream stores each
//! grant's, so a restart with another timeout moves no deadline already shown. Rows written
//! before it have none: theirs is their `created_at` plus the timeout in force, as before.
//!
//! Each step brings a file from the version below its number to its number, and a file applies
//! every step above its version in one transaction. A new file is the version 3 table plus every
//! later step, so a column added by a step is there on new and old files alike.
//!
//! A new file uses incremental auto-vacuum from its first table (see `maintenance`); an older
//! file is switched over once at start-up with one full `VACUUM`.

use std::path::Path;

use rusqlite::Connection;

use super::super::error::StoreError;

/// The schema version this code writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 8;

/// The operations table as schema 3 made it, named `{name}` (later steps add columns to it).
/// `seq` is its explicit rowid: listing cursors are `seq`
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

/// The columns of an operation row as schema 3 has them, in table order after `seq`.
const OPERATION_COLUMNS_V3: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision";

/// The columns of an operation row, in table order after `seq`.
pub(super) const OPERATION_COLUMNS: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision, title, summary, request_digest, decided_at, decided_by, decided_on_behalf_of, \
    revoked";

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
        "{table} INSERT INTO operations_v3 (seq, {OPERATION_COLUMNS_V3}) \
         SELECT rowid, {OPERATION_COLUMNS_V3} FROM operations ORDER BY rowid; \
         DROP TABLE operations; ALTER TABLE operations_v3 RENAME TO operations; {OPERATIONS_INDEXES}",
        table = OPERATIONS_TABLE.replace("{name}", "operations_v3"),
    )
}

/// From schema version 3: the presentation (`title`, `summary`) and the request's digest, stored
/// at creation so a summary and a replay read only these. Rows already there get them at
/// start-up: the partial index lists exactly the rows without them.
const MIGRATE_3_TO_4: &str = "
ALTER TABLE operations ADD COLUMN title TEXT;
ALTER TABLE operations ADD COLUMN summary TEXT;
ALTER TABLE operations ADD COLUMN request_digest TEXT;
CREATE INDEX operations_underived ON operations (seq) WHERE request_digest IS NULL;
";

/// From schema version 4: who decided, when, for whom, whether a cancel took back an approval,
/// and the operators' decision records (see the module docs).
const MIGRATE_4_TO_5: &str = "
ALTER TABLE operations ADD COLUMN decided_at TEXT;
ALTER TABLE operations ADD COLUMN decided_by TEXT;
ALTER TABLE operations ADD COLUMN decided_on_behalf_of TEXT;
ALTER TABLE operations ADD COLUMN revoked INTEGER NOT NULL DEFAULT 0;
CREATE TABLE operator_decisions (
    request_id      TEXT NOT NULL,
    action          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    command_hash    TEXT NOT NULL,
    operator        TEXT NOT NULL,
    committed       TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    PRIMARY KEY (request_id, action, idempotency_key)
) WITHOUT ROWID;
";

/// From schema version 5: the event log and `operations.ended_from` (see the module doc). Rows
/// written before it have no events and no `ended_from`.
const MIGRATE_5_TO_6: &str = "
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
UPDATE operations SET ended_from = 'executing'
    WHERE state = 'succeeded' OR (state = 'failed' AND error_code LIKE 'execution!_%' ESCAPE '!');
UPDATE operations SET ended_from = 'approved' WHERE state = 'canceled' AND revoked = 1;
";

/// From schema version 6: when an approval lapses (see the module doc).
const MIGRATE_6_TO_7: &str = "
ALTER TABLE operations ADD COLUMN active_expires_at TEXT;
";

/// From schema version 7: when a pending request expires, fixed at creation (see the module
/// doc).
const MIGRATE_7_TO_8: &str = "
ALTER TABLE operations ADD COLUMN pending_expires_at TEXT;
";

/// The steps after schema 3, each with the version it brings a file to, in order.
const STEPS_AFTER_3: [(i64, &str); 5] = [
    (4, MIGRATE_3_TO_4),
    (5, MIGRATE_4_TO_5),
    (6, MIGRATE_5_TO_6),
    (7, MIGRATE_6_TO_7),
    (8, MIGRATE_7_TO_8),
];

/// `PRAGMA auto_vacuum` value for `INCREMENTAL`: freed pages stay in the file until
/// `PRAGMA incremental_vacuum` returns them to the filesystem, which the retention sweep does in
/// small steps.
const AUTO_VACUUM_INCREMENTAL: i64 = 2;

/// Brings the file at `path` (open on `writer`) to [`SCHEMA_VERSION`]: creates the schema in a
/// new file, migrates an older one, refuses a newer one, and switches an older file to
/// incremental vacuum.
pub(super) fn migrate(writer: &Connection, path: &Path) -> Result<(), StoreError> {
    let version: i64 = writer.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let later = |from: i64| -> String {
        STEPS_AFTER_3
            .iter()
            .filter(|(to, _)| *to > from)
            .map(|(_, step)| *step)
            .collect()
    };
    match version {
        0 => {
            writer.execute_batch(&format!(
                "BEGIN; {table} {OPERATIONS_INDEXES} {STREAMS_TABLE} {steps} \
                 PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;",
                table = OPERATIONS_TABLE.replace("{name}", "operations"),
                steps = later(3),
            ))?;
        }
        1..SCHEMA_VERSION => {
            let first = if version == 1 { MIGRATE_1_TO_2 } else { "" };
            let to_3 = if version < 3 {
                migrate_2_to_3()
            } else {
                String::new()
            };
            writer.execute_batch(&format!(
                "BEGIN; {first} {to_3} {steps} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;",
                steps = later(version.max(3)),
            ))?;
        }
        SCHEMA_VERSION => {}
        other => {
            return Err(StoreError::UnknownSchema {
                store: path.display().to_string(),
                found: other,
                supported: SCHEMA_VERSION,
            });
        }
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
/// creation time, the retention sweep terminal ones by when they ended, and the operators'
/// request pages an operation's rows newest first (all of them, or those in one state). Created
/// at every open, not by a schema version: an index changes no row, and an older file gains it
/// on its next start.
pub(super) fn ensure_indexes(writer: &Connection) -> Result<(), StoreError> {
    writer.execute_batch(
        "CREATE INDEX IF NOT EXISTS operations_by_created_at ON operations (created_at); \
         CREATE INDEX IF NOT EXISTS operations_retiring ON operations (terminal_at) \
         WHERE terminal_at IS NOT NULL; \
         CREATE INDEX IF NOT EXISTS operations_requests \
         ON operations (operation, created_at, id); \
         CREATE INDEX IF NOT EXISTS operations_requests_by_state \
         ON operations (operation, state, created_at, id);",
    )?;
    Ok(())
}

#[cfg(test)]
mod tests;
