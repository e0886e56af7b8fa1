//! What keeps the store bounded and checked, apart from serving: retention deletes, returning
//! freed pages to the filesystem, checkpoints, and the counts the drift check and the metrics
//! compare with the controller's.
//!
//! **Bounded.** The file uses incremental auto-vacuum: the broker's retention sweep deletes
//! retired rows in small transactions ([`SqliteStore::retiring`], [`SqliteStore::retire`]) and then returns freed pages to
//! the filesystem a few at a time ([`SqliteStore::return_free_pages`]), so neither step holds the
//! write lock for long. An older file is switched over once at start-up with one full `VACUUM`
//! (see `schema`).

use rusqlite::params;

use unyolo_admission::engine::OperationState;

use super::super::error::StoreError;
use super::super::maintenance::{Retiring, StoredCounts};
use super::database::{DATABASE_FILE, SqliteStore};
use super::operations::parse_state;

impl SqliteStore {
    /// The counts the controller's must equal (see [`StoredCounts`]), from one read transaction
    /// on the read connection.
    pub async fn counts(&self) -> Result<StoredCounts, StoreError> {
        self.read(|conn, _| {
            let tx = conn.unchecked_transaction()?;
            let operations = {
                let mut stmt = tx.prepare(
                    "SELECT client_id, state, COUNT(*) FROM operations \
                     WHERE state IN ('pending', 'approved', 'executing') \
                     GROUP BY client_id, state",
                )?;
                stmt.query_map([], |row| {
                    let state = parse_state(row.get(1)?, 1)?;
                    Ok((row.get(0)?, state, row.get::<_, i64>(2)?.max(0) as u64))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
            };
            let streams = {
                let mut stmt = tx.prepare(
                    "SELECT client_id, COUNT(*), COALESCE(SUM(size), 0) FROM streams \
                     GROUP BY client_id",
                )?;
                stmt.query_map([], |row| {
                    Ok((
                        row.get(0)?,
                        row.get::<_, i64>(1)?.max(0) as u64,
                        row.get::<_, i64>(2)?.max(0) as u64,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
            };
            tx.finish()?;
            Ok(StoredCounts {
                operations,
                streams,
            })
        })
        .await
    }

    /// How many operation rows exist (for tests and the drill).
    pub async fn count_operations(&self) -> Result<u64, StoreError> {
        self.read(|conn, _| {
            conn.query_row("SELECT COUNT(*) FROM operations", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|n| n.max(0) as u64)
    }

    /// How many operation rows are in each state (states with none are absent).
    pub async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt =
                conn.prepare_cached("SELECT state, COUNT(*) FROM operations GROUP BY state")?;
            let rows = stmt.query_map([], |row| {
                let state: String = row.get(0)?;
                Ok((state, row.get::<_, i64>(1)?.max(0) as u64))
            })?;
            let mut counts = Vec::new();
            for row in rows {
                let (state, n) = row?;
                if let Some(state) = OperationState::parse(&state) {
                    counts.push((state, n));
                }
            }
            Ok(counts)
        })
        .await
    }

    /// Every live operation's id and state (pending, approved or executing): what this replica's
    /// shared holdings must equal (fleet drift).
    pub async fn live_states(&self) -> Result<Vec<(String, OperationState)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt = conn.prepare_cached(
                "SELECT id, state FROM operations \
                 WHERE state IN ('pending', 'approved', 'executing')",
            )?;
            let rows = stmt.query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
            })?;
            let mut live = Vec::new();
            for row in rows {
                let (id, state) = row?;
                if let Some(state) = OperationState::parse(&state) {
                    live.push((id, state));
                }
            }
            Ok(live)
        })
        .await
    }

    /// Up to `limit` terminal operations whose `terminal_at` is before `cutoff` (RFC 3339, UTC,
    /// as [`now_rfc3339`](super::super::records::now_rfc3339) writes it), oldest first: what the next retention batch retires.
    /// Non-terminal operations are never among them, whatever their `terminal_at`.
    pub async fn retiring(&self, cutoff: String, limit: u32) -> Result<Vec<Retiring>, StoreError> {
        self.read(move |conn, _| {
            // `terminal_at` is fixed-width UTC text, so text order is time order; the partial
            // index `operations_retiring` finds the batch without a scan.
            let mut stmt = conn.prepare_cached(
                "SELECT seq, client_id, idempotency_key, id FROM operations \
                 WHERE terminal_at IS NOT NULL AND terminal_at < ?1 \
                 AND state IN ('succeeded', 'failed', 'denied', 'canceled', 'expired') \
                 ORDER BY terminal_at LIMIT ?2",
            )?;
            let rows = stmt.query_map(params![cutoff, limit], |row| {
                Ok(Retiring {
                    seq: row.get(0)?,
                    client: row.get(1)?,
                    key: row.get(2)?,
                    id: row.get(3)?,
                })
            })?;
            rows.collect()
        })
        .await
    }

    /// Deletes the operations of `batch` (found by [`SqliteStore::retiring`]) in one short write
    /// transaction; returns how many went. Each is deleted only if still terminal.
    pub async fn retire(&self, batch: Vec<Retiring>) -> Result<u64, StoreError> {
        self.write(move |conn| {
            let tx = conn.transaction()?;
            let mut deleted = 0;
            {
                let mut stmt = tx.prepare_cached(
                    "DELETE FROM operations WHERE seq = ?1 AND terminal_at IS NOT NULL \
                     AND state IN ('succeeded', 'failed', 'denied', 'canceled', 'expired')",
                )?;
                let mut decisions = tx.prepare_cached(
                    "DELETE FROM operator_decisions WHERE request_id = ?1 \
                     AND NOT EXISTS (SELECT 1 FROM operations WHERE id = ?1)",
                )?;
                for row in &batch {
                    let gone = stmt.execute(params![row.seq])?;
                    if gone == 1 {
                        // Its decision records go with it: a replay after retention is new work.
                        decisions.execute(params![row.id])?;
                    }
                    deleted += gone;
                }
            }
            tx.commit()?;
            Ok(deleted as u64)
        })
        .await
    }

    /// Returns up to `pages` free pages to the filesystem (incremental vacuum), in one short write
    /// transaction; returns how many free pages are left.
    pub async fn return_free_pages(&self, pages: u32) -> Result<u64, StoreError> {
        self.write(move |conn| {
            // The pragma frees one page per step (a row each): stepped to its end, in the one
            // statement's transaction. (`execute_batch` steps a statement once: one page a call.)
            let mut vacuum = conn.prepare(&format!("PRAGMA incremental_vacuum({pages})"))?;
            let mut freed = vacuum.query([])?;
            while freed.next()?.is_some() {}
            drop(freed);
            drop(vacuum);
            conn.pragma_query_value(None, "freelist_count", |r| r.get::<_, i64>(0))
        })
        .await
        .map(|n| n.max(0) as u64)
    }

    /// Copies the write-ahead log into the database file as far as no reader needs it, without
    /// waiting for anyone (`PASSIVE`): after an incremental vacuum, this is what makes the main
    /// file shorter on disk.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        self.write(|conn| conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())))
            .await
    }

    /// The bytes the database takes on disk: (the main file, its write-ahead log).
    pub fn file_bytes(&self) -> (u64, u64) {
        let size = |name: String| std::fs::metadata(self.dir.join(name)).map_or(0, |m| m.len());
        (
            size(DATABASE_FILE.to_owned()),
            size(format!("{DATABASE_FILE}-wal")),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_call_returns_up_to_its_step_of_free_pages() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteStore::open(dir.path()).unwrap();
        // Free pages made beside the store: a table filled, then dropped.
        let other =
            rusqlite::Connection::open(dir.path().join(super::super::database::DATABASE_FILE))
                .unwrap();
        other
            .execute_batch(
                "CREATE TABLE ballast (b BLOB);
                 WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300)
                 INSERT INTO ballast SELECT zeroblob(4000) FROM n;
                 DROP TABLE ballast;",
            )
            .unwrap();
        let free = |c: &rusqlite::Connection| -> i64 {
            c.pragma_query_value(None, "freelist_count", |r| r.get(0))
                .unwrap()
        };
        let before = free(&other);
        assert!(before > 250, "{before} free pages");
        drop(other);
        assert_eq!(
            db.return_free_pages(100).await.unwrap(),
            u64::try_from(before - 100).unwrap()
        );
        assert_eq!(db.return_free_pages(1_000).await.unwrap(), 0);
    }
}
