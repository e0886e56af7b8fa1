//! The stream rows: one per stream body on disk under [`SqliteStore::streams_dir`], with its owner
//! and size, so the storage quotas are rebuilt from the store at start-up like the operation
//! counts. The body files themselves are written and read by the broker; this file only records
//! them.

use std::path::PathBuf;

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::super::error::StoreError;
use super::super::records::now_rfc3339;
use super::super::streams::StreamRecord;
use super::database::SqliteStore;

impl StreamRecord {
    /// The record in `row`, selected as `id, client_id, size`.
    pub(in crate::store) fn from_row(row: &Row<'_>) -> rusqlite::Result<StreamRecord> {
        Ok(StreamRecord {
            id: row.get(0)?,
            client_id: row.get(1)?,
            size: row.get::<_, i64>(2)?.max(0) as u64,
        })
    }
}

impl SqliteStore {
    /// The directory stream bodies are written to.
    pub fn streams_dir(&self) -> PathBuf {
        self.dir.join("streams")
    }

    /// Records a stream whose body is already on disk; durable when this returns.
    pub async fn insert_stream(&self, stream: StreamRecord) -> Result<(), StoreError> {
        self.write(move |conn| {
            conn.execute(
                "INSERT INTO streams (id, client_id, size, created_at) VALUES (?1, ?2, ?3, ?4)",
                params![
                    stream.id,
                    stream.client_id,
                    i64::try_from(stream.size).unwrap_or(i64::MAX),
                    now_rfc3339()
                ],
            )
        })
        .await
        .map(|_| ())
    }

    /// The stream `id`.
    pub async fn get_stream(&self, id: &str) -> Result<Option<StreamRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, _| {
            conn.query_row(
                "SELECT id, client_id, size FROM streams WHERE id = ?1",
                params![id],
                StreamRecord::from_row,
            )
            .optional()
        })
        .await
    }

    /// Deletes the stream row `id`; returns whether it existed.
    pub async fn delete_stream(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.write(move |conn| conn.execute("DELETE FROM streams WHERE id = ?1", params![id]))
            .await
            .map(|n| n == 1)
    }

    /// The id of every stream row, with its client.
    pub async fn stream_ids(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt = conn.prepare_cached("SELECT id, client_id FROM streams")?;
            stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                .collect()
        })
        .await
    }
}

/// Every stored stream, oldest first, read on `conn` (start-up recovery reads them in its
/// transaction).
pub(super) fn all_streams(conn: &Connection) -> rusqlite::Result<Vec<StreamRecord>> {
    let mut stmt = conn.prepare("SELECT id, client_id, size FROM streams ORDER BY rowid")?;
    stmt.query_map([], StreamRecord::from_row)?.collect()
}
