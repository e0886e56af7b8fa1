//! The event log's high-water mark, and the bell opened at it: a leaf, so the handle
//! (`database`) opens the bell and the log (`events`) reads the mark without importing each
//! other.

use rusqlite::{Connection, OptionalExtension};

use super::super::bell::EventBell;

/// Opens the bell at the log's high-water mark (blocking; at open).
pub(super) fn open_bell(conn: &Connection) -> rusqlite::Result<EventBell> {
    Ok(EventBell::new(high_water(conn)?))
}

/// The highest sequence ever assigned (`AUTOINCREMENT` keeps it even when the rows are gone).
pub(super) fn high_water(conn: &Connection) -> rusqlite::Result<i64> {
    Ok(conn
        .query_row(
            "SELECT seq FROM sqlite_sequence WHERE name = 'operator_events'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .optional()?
        .unwrap_or(0))
}
