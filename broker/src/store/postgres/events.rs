//! The event log on PostgreSQL: one log for the fleet, with no gaps a reader could fall into.
//!
//! Several replicas insert events at once, and their transactions commit out of the order they
//! started in: had each event taken its number at insert (a sequence), a reader could be handed
//! event N+1, committed, while event N's transaction was still open, and move its cursor past N
//! for good. So an event is numbered after it commits, in an order no later commit can fall
//! under:
//!
//! - **Writing** (in the statement of the change it records: `operations`): the row records the transaction that writes it (`xid`,
//!   `pg_current_xact_id()`) and an internal `seq`; its public `position` (the cursor) is
//!   `NULL`. The same transaction sends `NOTIFY` (delivered on commit), so every replica's
//!   listener knows to number it.
//! - **Numbering** (`assign`): under `pg_advisory_xact_lock(POSITION_LOCK)` (one assigner at a
//!   time, fleet-wide), the unnumbered events whose `xid` is below the horizon
//!   `pg_snapshot_xmin(pg_current_snapshot())` get positions after the highest ever handed out,
//!   in `(xid, seq)` order. Every transaction below the horizon has ended, so every event it
//!   committed is visible to the statement that reads them (the horizon is that statement's own
//!   snapshot's), and any transaction still to write an event has an `xid` at or above it: no
//!   event can later appear below one already numbered. Events of a transaction still open
//!   (or of one that is older than an open one) wait for the next round.
//! - **Reading** (`events_after`): first a round of numbering (skipped when another assigner is
//!   at work: `pg_try_advisory_xact_lock`, so readers never queue behind each other), then the
//!   numbered events after the cursor, in position order, in one snapshot. A batch of positions
//!   commits whole, and batches commit one after the other, so a reader sees a prefix.
//!
//! A long transaction anywhere on the server holds the horizon back and so delays the log's
//! newest events (never loses or reorders them). Retention trims a prefix by position;
//! unnumbered events are never trimmed. Cursors expire as SQLite's do.

use tokio_postgres::Row;

use super::super::error::StoreError;
use super::super::events::{EventKind, EventPage, RequestStatus, StoredEvent};
use super::error::corrupt;
use super::handle::PostgresStore;
use super::numbering::{Assigner, assign};
use super::schema::CHANGES_CHANNEL;

/// Announces a change of operation `id` to every replica's listener, inside the caller's
/// transaction (delivered only if it commits).
pub(super) async fn announce(
    tx: &deadpool_postgres::Transaction<'_>,
    id: &str,
) -> Result<(), tokio_postgres::Error> {
    let notify = tx.prepare_cached("SELECT pg_notify($1, $2)").await?;
    tx.execute(&notify, &[&CHANGES_CHANNEL, &id]).await?;
    Ok(())
}

/// The columns of a [`StoredEvent`], in [`event_of`]'s order.
const EVENT_COLUMNS: &str = "position, kind, request_id, revision, status, occurred_at, used_count";

/// The event in `row` (selected as [`EVENT_COLUMNS`]).
fn event_of(row: &Row) -> Result<StoredEvent, StoreError> {
    let bad = |e: tokio_postgres::Error| corrupt(format!("an event's column: {e}"));
    let kind: String = row.try_get(1).map_err(bad)?;
    let status: String = row.try_get(4).map_err(bad)?;
    Ok(StoredEvent {
        seq: row.try_get(0).map_err(bad)?,
        kind: EventKind::parse(&kind)
            .ok_or_else(|| corrupt(format!("unknown event kind {kind:?}")))?,
        request_id: row.try_get(2).map_err(bad)?,
        revision: row.try_get::<_, i64>(3).map_err(bad)?.max(1) as u64,
        status: RequestStatus::parse(&status)
            .ok_or_else(|| corrupt(format!("unknown request status {status:?}")))?,
        occurred_at: row.try_get(5).map_err(bad)?,
        used_count: row.try_get::<_, i64>(6).map_err(bad)?.max(0) as u64,
    })
}

impl PostgresStore {
    /// Numbers what is ready (giving way to a running assigner) and rings the bell.
    pub(super) async fn number_events(&self, assigner: Assigner) -> Result<(), StoreError> {
        let assigned = assign(&self.pool, &self.shown, assigner).await?;
        self.events.rang(assigned.high_water, 0);
        Ok(())
    }

    /// Up to `limit` events strictly after position `after` (`None`: from the oldest retained),
    /// oldest first; [`EventPage::Expired`] when events after `after` were already deleted.
    pub async fn events_after(
        &self,
        after: Option<i64>,
        limit: u32,
    ) -> Result<EventPage, StoreError> {
        let pending = {
            let client = self.client().await?;
            client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM operator_events WHERE position IS NULL)",
                    &[],
                )
                .await
                .map_err(|e| self.sorted(e))?
                .get::<_, bool>(0)
        };
        if pending {
            self.number_events(Assigner::GivesWay).await?;
        }
        let mut client = self.client().await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| self.sorted(e))?;
        let bounds = tx
            .query_one(
                "SELECT (SELECT min(position) FROM operator_events), \
                 (SELECT high_water FROM event_positions)",
                &[],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        let oldest: Option<i64> = bounds.get(0);
        let high_water: i64 = bounds.get(1);
        let start = match (after, oldest) {
            (None, Some(oldest)) => oldest - 1,
            (None, None) => high_water,
            // Retained starts at `oldest`: a cursor just before it still sees every event.
            (Some(after), Some(oldest)) if after < oldest - 1 => return Ok(EventPage::Expired),
            // Nothing retained: a cursor below the high-water mark missed deleted events.
            (Some(after), None) if after < high_water => return Ok(EventPage::Expired),
            (Some(after), _) => after,
        };
        let page = tx
            .prepare_cached(&format!(
                "SELECT {EVENT_COLUMNS} FROM operator_events \
                 WHERE position > $1 ORDER BY position LIMIT $2"
            ))
            .await
            .map_err(|e| self.sorted(e))?;
        let rows = tx
            .query(&page, &[&start, &(i64::from(limit) + 1)])
            .await
            .map_err(|e| self.sorted(e))?;
        tx.commit().await.map_err(|e| self.sorted(e))?;
        let mut events = rows.iter().map(event_of).collect::<Result<Vec<_>, _>>()?;
        let more = events.len() > limit as usize;
        events.truncate(limit as usize);
        Ok(EventPage::Events {
            after: start,
            events,
            more,
        })
    }

    /// The numbered events of request `id`, oldest first (after a round of numbering).
    pub async fn events_of(&self, id: &str) -> Result<Vec<StoredEvent>, StoreError> {
        self.number_events(Assigner::Waits).await?;
        let client = self.client().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {EVENT_COLUMNS} FROM operator_events \
                     WHERE request_id = $1 AND position IS NOT NULL ORDER BY position"
                ),
                &[&id],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter().map(event_of).collect()
    }

    /// How many events are retained (numbered or not).
    pub async fn count_events(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let n: i64 = client
            .query_one("SELECT count(*) FROM operator_events", &[])
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        Ok(n.max(0) as u64)
    }

    /// Deletes, oldest first, at most `batch` numbered events past retention: beyond the newest
    /// `keep` and, with a `cutoff` (RFC 3339), every one up to the last older than it. Only a
    /// prefix of the numbered log goes.
    pub async fn trim_events(
        &self,
        keep: u32,
        cutoff: Option<String>,
        batch: u32,
    ) -> Result<u64, StoreError> {
        // What committed since the last round is numbered first, so it can be judged.
        self.number_events(Assigner::Waits).await?;
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.sorted(e))?;
        let newest: Option<i64> = tx
            .query_one("SELECT max(position) FROM operator_events", &[])
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        let Some(newest) = newest else {
            return Ok(0);
        };
        let mut bound = newest - i64::from(keep);
        if let Some(cutoff) = cutoff {
            let first_kept: Option<i64> = tx
                .query_one(
                    "SELECT min(position) FROM operator_events \
                     WHERE position IS NOT NULL AND occurred_at >= $1",
                    &[&cutoff],
                )
                .await
                .map_err(|e| self.sorted(e))?
                .get(0);
            bound = bound.max(first_kept.map_or(newest, |position| position - 1));
        }
        let deleted = tx
            .execute(
                "DELETE FROM operator_events WHERE seq IN \
                 (SELECT seq FROM operator_events WHERE position <= $1 \
                  ORDER BY position LIMIT $2)",
                &[&bound, &i64::from(batch)],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        tx.commit().await.map_err(|e| self.sorted(e))?;
        Ok(deleted)
    }
}
