//! What keeps the store checked and bounded on PostgreSQL: the counts the drift check compares
//! (one snapshot), retention's batches, and the size `sizes` reports. Freed space is
//! autovacuum's business: `release_space` and `checkpoint` have nothing to do here.

use unyolo_admission::engine::OperationState;

use super::super::error::StoreError;
use super::super::maintenance::{Retiring, StoredCounts};
use super::handle::PostgresStore;
use super::rows::{column, state_column};
use super::schema::TERMINAL;

impl PostgresStore {
    /// The counts the controller's must equal, read in one snapshot; refreshes the database's
    /// measured size besides.
    pub async fn counts(&self) -> Result<StoredCounts, StoreError> {
        let counted = {
            let mut client = self.client().await?;
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(|e| self.sorted(e))?;
            // In a fleet, this replica's own: what its counts hold.
            let me = self.member.get();
            let operations = tx
                .query(
                    "SELECT client_id, state, count(*) AS n FROM operations \
                     WHERE state IN ('pending', 'approved', 'executing') \
                     AND ($1::text IS NULL OR owner = $1) \
                     GROUP BY client_id, state",
                    &[&me],
                )
                .await
                .map_err(|e| self.sorted(e))?;
            let streams = tx
                .query(
                    "SELECT client_id, count(*) AS n, COALESCE(sum(size), 0)::bigint AS bytes \
                     FROM streams WHERE $1::text IS NULL OR owner = $1 GROUP BY client_id",
                    &[&me],
                )
                .await
                .map_err(|e| self.sorted(e))?;
            tx.commit().await.map_err(|e| self.sorted(e))?;
            StoredCounts {
                operations: operations
                    .iter()
                    .map(|row| {
                        Ok((
                            column(row, "client_id")?,
                            state_column(row, "state")?,
                            column::<i64>(row, "n")?.max(0) as u64,
                        ))
                    })
                    .collect::<Result<_, StoreError>>()?,
                streams: streams
                    .iter()
                    .map(|row| {
                        Ok((
                            column(row, "client_id")?,
                            column::<i64>(row, "n")?.max(0) as u64,
                            column::<i64>(row, "bytes")?.max(0) as u64,
                        ))
                    })
                    .collect::<Result<_, StoreError>>()?,
            }
        };
        self.measure().await?;
        Ok(counted)
    }

    /// Operation rows by state (states with none, or one this code does not know, are absent).
    pub async fn operations_by_state(&self) -> Result<Vec<(OperationState, u64)>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query("SELECT state, count(*) FROM operations GROUP BY state", &[])
            .await
            .map_err(|e| self.sorted(e))?;
        Ok(rows
            .iter()
            .filter_map(|row| {
                let state: String = row.get(0);
                let n: i64 = row.get(1);
                OperationState::parse(&state).map(|s| (s, n.max(0) as u64))
            })
            .collect())
    }

    /// Every live operation's id and state (in a fleet, this replica's own).
    pub async fn live_states(&self) -> Result<Vec<(String, OperationState)>, StoreError> {
        let client = self.client().await?;
        let rows: Vec<Vec<String>> = client
            .query(
                "SELECT id, state FROM operations \
                 WHERE state IN ('pending', 'approved', 'executing') \
                 AND ($1::text IS NULL OR owner = $1)",
                &[&self.member.get()],
            )
            .await
            .map_err(|e| self.sorted(e))?
            .iter()
            .map(|row| vec![row.get::<_, String>(0), row.get::<_, String>(1)])
            .collect();
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let state = OperationState::parse(&row[1])?;
                Some((row[0].clone(), state))
            })
            .collect())
    }

    /// Up to `limit` terminal operations that ended before `cutoff`, oldest first.
    pub async fn retiring(&self, cutoff: String, limit: u32) -> Result<Vec<Retiring>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT seq, client_id, idempotency_key, id FROM operations \
                     WHERE terminal_at IS NOT NULL AND terminal_at < $1 AND state IN {TERMINAL} \
                     ORDER BY terminal_at LIMIT $2"
                ),
                &[&cutoff, &i64::from(limit)],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter()
            .map(|row| {
                Ok(Retiring {
                    seq: column(row, "seq")?,
                    client: column(row, "client_id")?,
                    key: column(row, "idempotency_key")?,
                    id: column(row, "id")?,
                })
            })
            .collect()
    }

    /// Deletes the operations of `batch` that are still terminal, with their decision records,
    /// in one statement; how many went. Safe to run from several replicas at once.
    pub async fn retire(&self, batch: Vec<Retiring>) -> Result<u64, StoreError> {
        let seqs: Vec<i64> = batch.iter().map(|r| r.seq).collect();
        let client = self.client().await?;
        let n: i64 = client
            .query_one(
                &format!(
                    "WITH gone AS (DELETE FROM operations WHERE seq = ANY($1) \
                     AND terminal_at IS NOT NULL AND state IN {TERMINAL} RETURNING id), \
                     decisions AS (DELETE FROM operator_decisions \
                     WHERE request_id IN (SELECT id FROM gone)) \
                     SELECT count(*) FROM gone"
                ),
                &[&seqs],
            )
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        Ok(n.max(0) as u64)
    }
}
