//! Numbering the event log (see `events` for why): one round hands positions, after the
//! highest ever handed out, to the events whose writers are below the horizon
//! `pg_snapshot_xmin(pg_current_snapshot())`, in `(xid, seq)` order, under the advisory lock
//! `POSITION_LOCK` (one assigner at a time, fleet-wide). A leaf beside the log: the handle (at
//! start-up), the listener's task and the log's readers all run it.

use super::super::error::StoreError;
use super::error::{sort, sort_pool};
use super::schema::POSITION_LOCK;

/// The most events one round of numbering takes (the rest wait for the next).
const ASSIGN_BATCH: i64 = 10_000;

/// Whether a round of numbering waits for the lock or gives way to a running one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Assigner {
    /// Waits for the lock (the listener's rounds, start-up).
    Waits,
    /// Gives way: another assigner is numbering (a reader's round).
    GivesWay,
}

/// What a round of numbering did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Assigned {
    /// The highest position handed out, ever (as this round saw it).
    pub(super) high_water: i64,
    /// How many events this round numbered.
    pub(super) numbered: u64,
}

/// One round of numbering (see the module docs). A round that gives way, or finds nothing to
/// number, reports the high-water mark it read.
pub(super) async fn assign(
    pool: &deadpool_postgres::Pool,
    shown: &str,
    assigner: Assigner,
) -> Result<Assigned, StoreError> {
    let sort = |e| sort(shown, e);
    let mut client = pool.get().await.map_err(|e| sort_pool(shown, e))?;
    let tx = client.transaction().await.map_err(sort)?;
    let locked: bool = match assigner {
        Assigner::Waits => {
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&POSITION_LOCK])
                .await
                .map_err(sort)?;
            true
        }
        Assigner::GivesWay => tx
            .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&POSITION_LOCK])
            .await
            .map_err(sort)?
            .get(0),
    };
    // Read after the lock: the last assigner's commit is visible to this statement.
    let high_water: i64 = tx
        .query_one("SELECT high_water FROM event_positions", &[])
        .await
        .map_err(sort)?
        .get(0);
    if !locked {
        tx.commit().await.map_err(sort)?;
        return Ok(Assigned {
            high_water,
            numbered: 0,
        });
    }
    // One statement, one snapshot: the horizon is this statement's snapshot's `xmin`, so every
    // transaction below it has ended and its committed rows are visible here.
    let ready: Vec<i64> = tx
        .query(
            "SELECT seq FROM operator_events \
             WHERE position IS NULL AND xid < pg_snapshot_xmin(pg_current_snapshot()) \
             ORDER BY xid, seq LIMIT $1",
            &[&ASSIGN_BATCH],
        )
        .await
        .map_err(sort)?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if ready.is_empty() {
        tx.commit().await.map_err(sort)?;
        return Ok(Assigned {
            high_water,
            numbered: 0,
        });
    }
    let positions: Vec<i64> = (1..=ready.len() as i64).map(|n| high_water + n).collect();
    let newest = high_water + ready.len() as i64;
    tx.execute(
        "UPDATE operator_events e SET position = u.position \
         FROM unnest($1::bigint[], $2::bigint[]) AS u(seq, position) WHERE e.seq = u.seq",
        &[&ready, &positions],
    )
    .await
    .map_err(sort)?;
    tx.execute("UPDATE event_positions SET high_water = $1", &[&newest])
        .await
        .map_err(sort)?;
    tx.commit().await.map_err(sort)?;
    Ok(Assigned {
        high_water: newest,
        numbered: ready.len() as u64,
    })
}
