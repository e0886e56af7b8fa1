//! The stream rows on PostgreSQL: one per stream, with its client, size, owning replica and body.
//! The broker writes an upload's body to a file under the directory it passed in (`streams_dir`,
//! this replica's own) while it arrives; recording the stream moves the body into its row, so
//! the fleet's store holds it, not a replica's disk. A deletion is announced on the change feed,
//! so the replica that counts the stream lets its room go.

use std::path::PathBuf;

use tokio_postgres::Row;

use super::super::error::StoreError;
use super::super::records::now_rfc3339;
use super::super::streams::StreamRecord;
use super::handle::PostgresStore;
use super::rows::column;

fn stream_of(row: &Row) -> Result<StreamRecord, StoreError> {
    Ok(StreamRecord {
        id: column(row, "id")?,
        client_id: column(row, "client_id")?,
        size: column::<i64>(row, "size")?.max(0) as u64,
    })
}

/// Every stream `me` owns (with none, every stream), and those whose owner is no live
/// replica (made `me`'s), oldest first, in the caller's transaction: what start-up restores.
pub(super) async fn all_streams(
    tx: &deadpool_postgres::Transaction<'_>,
    me: Option<&str>,
) -> Result<Vec<StreamRecord>, super::error::Failed> {
    let rows = match me {
        None => {
            tx.query("SELECT id, client_id, size FROM streams ORDER BY seq", &[])
                .await?
        }
        Some(me) => {
            tx.query(
                "UPDATE streams s SET owner = $1 WHERE owner = $1 OR owner IS NULL \
                 OR NOT EXISTS (SELECT 1 FROM replicas r WHERE r.name = s.owner \
                 AND r.lease_until >= clock_timestamp()) RETURNING seq, id, client_id, size",
                &[&me],
            )
            .await?
        }
    };
    let mut rows: Vec<_> = rows.iter().collect();
    if me.is_some() {
        rows.sort_by_key(|row| row.get::<_, i64>("seq"));
    }
    Ok(rows.into_iter().map(stream_of).collect::<Result<_, _>>()?)
}

impl PostgresStore {
    /// The directory stream bodies are written to (this replica's: see the module docs).
    pub fn streams_dir(&self) -> PathBuf {
        self.streams.as_ref().clone()
    }

    /// Records a stream whose body is already written.
    /// Its body, staged in `streams_dir`, goes into the row; the staged file is removed once
    /// the row is committed.
    pub async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError> {
        let staged = self.streams.join(&stream.id);
        let body = tokio::fs::read(&staged)
            .await
            .map_err(|e| StoreError::io("open", &staged, e))?;
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO streams (id, client_id, size, created_at, owner, body) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &stream.id,
                    &stream.client_id,
                    &i64::try_from(stream.size).unwrap_or(i64::MAX),
                    &now_rfc3339(),
                    &self.member.get(),
                    &body,
                ],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        let _ = tokio::fs::remove_file(&staged).await;
        Ok(())
    }

    /// The body of stream `id`, as its row holds it.
    pub async fn stream_body(&self, id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt("SELECT body FROM streams WHERE id = $1", &[&id])
            .await
            .map_err(|e| self.sorted(e))?;
        Ok(row.and_then(|row| row.get::<_, Option<Vec<u8>>>(0)))
    }

    /// The stream `id`.
    pub async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT id, client_id, size FROM streams WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        row.as_ref().map(stream_of).transpose()
    }

    /// Deletes the stream `id`'s record; whether there was one.
    pub async fn delete_stream(&self, id: &str) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let deleted: Result<u64, tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            let n = tx
                .execute("DELETE FROM streams WHERE id = $1", &[&id])
                .await?;
            if n == 1 {
                super::events::announce(&tx, id).await?;
            }
            tx.commit().await?;
            Ok(n)
        }
        .await;
        Ok(deleted.map_err(|e| self.sorted(e))? == 1)
    }
}
