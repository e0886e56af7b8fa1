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
//! Schema 5 adds what Operator V1 needs: who decided each operation, when, and for whom
//! (`decided_at`, `decided_by`, `decided_on_behalf_of`), whether a cancel took back an approval
//! (`revoked`), and the `operator_decisions` table, one row per committed decision keyed by
//! (request, action, idempotency key), holding the command's hash and the request as that
//! decision committed it (what a replay answers).
//!
//! Each step applies when the file's `user_version` is below its number, on its own, so the steps
//! chain whatever version an older file is at.
//!
//! A new file uses incremental auto-vacuum from its first table (see `maintenance`); an older
//! file is switched over once at start-up with one full `VACUUM`.

use std::path::Path;

use rusqlite::Connection;

use super::error::StoreError;

/// The schema version this code writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 5;

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

/// The columns of an operation row up to schema 3, in table order after `seq`.
const OPERATION_COLUMNS_V3: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision";

/// The columns of an operation row, in table order after `seq`.
pub(super) const OPERATION_COLUMNS: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision, decided_at, decided_by, decided_on_behalf_of, revoked";

/// Schema 5: who decided, when, for whom, whether a cancel took back an approval, and the
/// operators' decision records (see the module docs).
const STEP_5: &str = "
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
    if version < SCHEMA_VERSION {
        // Every step that applies, in one transaction: a file is at one version or the next.
        let mut steps = String::from("BEGIN;");
        match version {
            0 => steps.push_str(&format!(
                "{table} {OPERATIONS_INDEXES} {STREAMS_TABLE}",
                table = OPERATIONS_TABLE.replace("{name}", "operations"),
            )),
            1 => steps.push_str(&format!("{MIGRATE_1_TO_2} {}", migrate_2_to_3())),
            2 => steps.push_str(&migrate_2_to_3()),
            _ => {}
        }
        if version < 5 {
            steps.push_str(STEP_5);
        }
        steps.push_str(&format!("PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"));
        writer.execute_batch(&steps)?;
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
/// request pages an operation's rows newest first (all of them, or those in one state). Created at every
/// open, not by a schema version: an index changes no row, and an older file gains it on its next
/// start.
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
