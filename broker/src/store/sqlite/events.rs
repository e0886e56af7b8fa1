//! The event log in SQLite: `append` inside the change's own transaction, pages after a cursor
//! in one read transaction, and retention's prefix trims. The log's shape and its cursors are
//! the store's (`store::events`).

use rusqlite::{Connection, params};

use unyolo_admission::engine::OperationState;

use super::super::bell::EventBell;
use super::super::error::StoreError;
use super::super::events::{
    EventKind, EventPage, RequestStatus, StoredEvent, event_kind, request_status,
};
use super::bell::high_water;
use super::database::SqliteStore;

/// Appends the event of request `request_id`'s move from `from` (`None`: its creation) to `to`
/// at `revision` (after the move), inside the caller's transaction; returns its sequence.
/// `ended_from` is what the row's `ended_from` is after the move.
pub(super) fn append(
    tx: &Connection,
    request_id: &str,
    revision: u64,
    from: Option<OperationState>,
    to: OperationState,
    ended_from: Option<OperationState>,
    occurred_at: &str,
) -> rusqlite::Result<i64> {
    let status = request_status(to, ended_from);
    tx.prepare_cached(
        "INSERT INTO operator_events (kind, request_id, revision, status, occurred_at, used_count) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        event_kind(from, to).as_str(),
        request_id,
        i64::try_from(revision).unwrap_or(i64::MAX),
        status.as_str(),
        occurred_at,
        status.used_count() as i64,
    ])?;
    Ok(tx.last_insert_rowid())
}

fn from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<StoredEvent> {
    let corrupt = |column: usize, what: String| {
        rusqlite::Error::FromSqlConversionFailure(column, rusqlite::types::Type::Text, what.into())
    };
    let kind: String = row.get(1)?;
    let status: String = row.get(4)?;
    Ok(StoredEvent {
        seq: row.get(0)?,
        kind: EventKind::parse(&kind)
            .ok_or_else(|| corrupt(1, format!("unknown event kind {kind:?}")))?,
        request_id: row.get(2)?,
        revision: row.get::<_, i64>(3)?.max(1) as u64,
        status: RequestStatus::parse(&status)
            .ok_or_else(|| corrupt(4, format!("unknown request status {status:?}")))?,
        occurred_at: row.get(5)?,
        used_count: row.get::<_, i64>(6)?.max(0) as u64,
    })
}

impl SqliteStore {
    /// The bell streams wait on (the newest committed event's sequence).
    pub fn event_bell(&self) -> &EventBell {
        &self.events
    }

    /// Whether changes of `operation` are requests the event log records (it needs an
    /// operator's approval).
    pub fn is_request(&self, operation: &str) -> bool {
        self.requests.iter().any(|name| name == operation)
    }

    /// Up to `limit` events strictly after sequence `after` (`None`: from the oldest retained),
    /// oldest first; [`EventPage::Expired`] when events after `after` were already deleted. One
    /// read transaction: the check and the page see the same log.
    pub async fn events_after(
        &self,
        after: Option<i64>,
        limit: u32,
    ) -> Result<EventPage, StoreError> {
        self.read(move |conn, _| {
            let tx = conn.unchecked_transaction()?;
            let oldest: Option<i64> =
                tx.query_row("SELECT MIN(seq) FROM operator_events", [], |r| r.get(0))?;
            let start = match (after, oldest) {
                (None, Some(oldest)) => oldest - 1,
                (None, None) => high_water(&tx)?,
                // Retained starts at `oldest`: a cursor just before it still sees every event.
                (Some(after), Some(oldest)) if after < oldest - 1 => {
                    tx.finish()?;
                    return Ok(EventPage::Expired);
                }
                // Nothing retained: a cursor below the high-water mark missed deleted events.
                (Some(after), None) if after < high_water(&tx)? => {
                    tx.finish()?;
                    return Ok(EventPage::Expired);
                }
                (Some(after), _) => after,
            };
            let mut events = {
                let mut stmt = tx.prepare_cached(
                    "SELECT seq, kind, request_id, revision, status, occurred_at, used_count \
                     FROM operator_events WHERE seq > ?1 ORDER BY seq LIMIT ?2",
                )?;
                stmt.query_map(params![start, i64::from(limit) + 1], from_row)?
                    .collect::<rusqlite::Result<Vec<_>>>()?
            };
            tx.finish()?;
            let more = events.len() > limit as usize;
            events.truncate(limit as usize);
            Ok(EventPage::Events {
                after: start,
                events,
                more,
            })
        })
        .await
    }

    /// The events of request `id`, oldest first (for tests and the drill).
    pub async fn events_of(&self, id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, _| {
            let mut stmt = conn.prepare_cached(
                "SELECT seq, kind, request_id, revision, status, occurred_at, used_count \
                 FROM operator_events WHERE request_id = ?1 ORDER BY seq",
            )?;
            stmt.query_map(params![id], from_row)?.collect()
        })
        .await
    }

    /// How many events are retained.
    pub async fn count_events(&self) -> Result<u64, StoreError> {
        self.read(|conn, _| {
            conn.query_row("SELECT COUNT(*) FROM operator_events", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|n| n.max(0) as u64)
    }

    /// Deletes, oldest first, at most `batch` of the events past retention: beyond the newest
    /// `keep` and, with a `cutoff` (RFC 3339), every one from the oldest up to the last older
    /// than it. Only a prefix of the log goes, so what stays has no gap. One short write
    /// transaction; returns how many were deleted (call again while it returns `batch`).
    pub async fn trim_events(
        &self,
        keep: u32,
        cutoff: Option<String>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        self.write(move |conn| {
            let tx = conn.transaction()?;
            let newest: Option<i64> =
                tx.query_row("SELECT MAX(seq) FROM operator_events", [], |r| r.get(0))?;
            let Some(newest) = newest else {
                return Ok(0);
            };
            let mut bound = newest - i64::from(keep);
            if let Some(cutoff) = cutoff {
                // The first event not older than the cutoff; all before it go (fixed-width UTC
                // text, so text order is time order).
                let first_kept: Option<i64> = tx.query_row(
                    "SELECT MIN(seq) FROM operator_events WHERE occurred_at >= ?1",
                    params![cutoff],
                    |r| r.get(0),
                )?;
                bound = bound.max(first_kept.map_or(newest, |seq| seq - 1));
            }
            let deleted = tx.execute(
                "DELETE FROM operator_events WHERE seq IN \
                 (SELECT seq FROM operator_events WHERE seq <= ?1 ORDER BY seq LIMIT ?2)",
                params![bound, batch],
            )?;
            tx.commit()?;
            Ok(deleted as u64)
        })
        .await
    }
}
