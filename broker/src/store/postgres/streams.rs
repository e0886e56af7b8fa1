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
use super::schema::STREAM_ROOM_LOCK;
use unyolo_admission::engine::StoreCaps;

/// A size or count as a `bigint` (one past `i64::MAX` is more than any cap or file).
fn bigint(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn stream_of(row: &Row) -> Result<StreamRecord, StoreError> {
    Ok(StreamRecord {
        id: column(row, "id")?,
        client_id: column(row, "client_id")?,
        size: column::<i64>(row, "size")?.max(0) as u64,
    })
}

/// Every stream `me` owns (with none, every stream), and those whose owner is no live
/// replica (made `me`'s), oldest first, in the caller's transaction: what start-up restores.
/// The uploads `me` had in progress when it stopped are over: their room is let go.
pub(super) async fn all_streams(
    tx: &deadpool_postgres::Transaction<'_>,
    me: Option<&str>,
) -> Result<Vec<StreamRecord>, super::error::Failed> {
    tx.execute(
        "DELETE FROM stream_uploads WHERE $1::text IS NULL OR owner = $1",
        &[&me],
    )
    .await?;
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
        let mut client = self.client().await?;
        let recorded: Result<(), tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            tx.execute(
                "INSERT INTO streams (id, client_id, size, created_at, owner, body) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &stream.id,
                    &stream.client_id,
                    &bigint(stream.size),
                    &now_rfc3339(),
                    &self.member.get(),
                    &body,
                ],
            )
            .await?;
            // The upload's room is the stream's now.
            tx.execute("DELETE FROM stream_uploads WHERE id = $1", &[&stream.id])
                .await?;
            tx.commit().await
        }
        .await;
        recorded.map_err(|e| self.sorted(e))?;
        let _ = tokio::fs::remove_file(&staged).await;
        Ok(())
    }

    /// Takes room for upload `id` among the fleet's streams (see
    /// `DurableStore::take_stream_room`): under `STREAM_ROOM_LOCK`, so uploads on every replica
    /// take room one at a time, it forgets the uploads of replicas whose membership lapsed,
    /// counts every stream and upload (the client's and all), and records this upload as
    /// this replica's if one more file of `bytes` fits `caps`.
    pub async fn take_stream_room(
        &self,
        id: &str,
        client_id: &str,
        bytes: u64,
        caps: &StoreCaps,
    ) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let taken: Result<bool, tokio_postgres::Error> = async {
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&STREAM_ROOM_LOCK])
                .await?;
            tx.execute(
                "DELETE FROM stream_uploads u WHERE NOT EXISTS (SELECT 1 FROM replicas r \
                 WHERE r.name = u.owner AND r.lease_until >= clock_timestamp())",
                &[],
            )
            .await?;
            let row = tx
                .query_opt(
                    "WITH held AS (SELECT client_id, size FROM streams \
                     UNION ALL SELECT client_id, size FROM stream_uploads), \
                     totals AS (SELECT count(*) AS files, COALESCE(sum(size), 0) AS bytes, \
                     count(*) FILTER (WHERE client_id = $2::text) AS mine, \
                     COALESCE(sum(size) FILTER (WHERE client_id = $2::text), 0) AS my_bytes \
                     FROM held) \
                     INSERT INTO stream_uploads (id, client_id, size, owner, started_at) \
                     SELECT $1::text, $2::text, $3::bigint, $4::text, $5::text FROM totals \
                     WHERE files < $6::bigint AND bytes + $3::bigint <= $7::bigint \
                     AND mine < $8::bigint AND my_bytes + $3::bigint <= $9::bigint \
                     RETURNING id",
                    &[
                        &id,
                        &client_id,
                        &bigint(bytes),
                        &self.member.get(),
                        &now_rfc3339(),
                        &bigint(caps.global_files),
                        &bigint(caps.global_bytes),
                        &bigint(caps.client_files),
                        &bigint(caps.client_bytes),
                    ],
                )
                .await?;
            tx.commit().await?;
            Ok(row.is_some())
        }
        .await;
        taken.map_err(|e| self.sorted(e))
    }

    /// Lets go of the room upload `id` took (its stream was not recorded).
    pub async fn give_back_stream_room(&self, id: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute("DELETE FROM stream_uploads WHERE id = $1", &[&id])
            .await
            .map_err(|e| self.sorted(e))?;
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
