//! The operation rows: inserting a submission, the lookups a replay, a get and a wait make,
//! state changes, listing pages, and start-up recovery. Each statement sits beside the one
//! projection of a row into an [`OperationRecord`] (or, for a listing page, an
//! [`OperationSummary`]), so a reader checks the columns a query selects against what the record
//! needs in one file (the table itself is in `schema`): why it is one piece past the usual size.
//!
//! What reads only what it answers: a listing page selects the summary's columns (the stored
//! presentation, never `target` or `arguments`); a replay and a get first read a
//! [`StoredRequest`] (the request's digest and the size of its stored JSON, which SQLite knows
//! without reading the text), so a conflict is answered from the digest alone and a full
//! render can reserve its bytes before it reads them.

use std::time::SystemTime;

use rusqlite::{OptionalExtension, Row, params};
use serde_json::Value;

use unyolo_admission::engine::OperationState;

use super::super::error::{InsertError, StoreError};
use super::super::records::now_rfc3339;
use super::super::records::{
    Decided, OperationError, OperationRecord, OperationSummary, PageQuery, Presentation, Recovered,
    StateChange, StoredRequest,
};
use super::super::records::{HISTORY_SELECT, OperationTimes};
use super::database::SqliteStore;
use super::error::is_unique_violation;
use super::events;
use super::schema::OPERATION_COLUMNS;
use super::streams::all_streams;

/// The columns a listing page selects.
const SUMMARY_COLUMNS: &str = "id, client_id, idempotency_key, operation, state, created_at, \
    updated_at, terminal_at, revision, title, summary";

/// The columns of a [`StoredRequest`]: `octet_length` takes a value's size from the record
/// header, without reading the text.
const REQUEST_COLUMNS: &str = "id, client_id, idempotency_key, request_digest, revision, \
    terminal_at IS NOT NULL AS terminal, \
    octet_length(target) + octet_length(arguments) + octet_length(reason) AS bytes";

/// The stored presentation of `row`; a row without one was never derived (start-up derives every
/// row a migration found before it serves), and reads as corrupt.
fn presentation_of(row: &Row<'_>) -> rusqlite::Result<Presentation> {
    let title: Option<String> = row.get("title")?;
    let title = title.ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Null,
            "the operation has no stored presentation".into(),
        )
    })?;
    Ok(Presentation {
        title,
        summary: row.get("summary")?,
    })
}

impl OperationSummary {
    pub(in crate::store) fn from_row(
        row: &Row<'_>,
        broker: &str,
    ) -> rusqlite::Result<OperationSummary> {
        Ok(OperationSummary {
            id: row.get("id")?,
            client_id: row.get("client_id")?,
            idempotency_key: row.get("idempotency_key")?,
            operation: row.get("operation")?,
            state: parse_state(row.get("state")?, 0)?,
            created_at: row.get("created_at")?,
            updated_at: row.get("updated_at")?,
            terminal_at: row.get("terminal_at")?,
            revision: row.get::<_, i64>("revision")?.max(1) as u64,
            broker: broker.to_owned(),
            presentation: presentation_of(row)?,
        })
    }
}

impl StoredRequest {
    pub(in crate::store) fn from_row(row: &Row<'_>) -> rusqlite::Result<StoredRequest> {
        let digest: Option<String> = row.get("request_digest")?;
        Ok(StoredRequest {
            id: row.get("id")?,
            client_id: row.get("client_id")?,
            idempotency_key: row.get("idempotency_key")?,
            digest: digest.unwrap_or_default(),
            bytes: row.get::<_, Option<i64>>("bytes")?.unwrap_or(0).max(0) as u64,
            revision: row.get::<_, i64>("revision")?.max(1) as u64,
            terminal: row.get::<_, i64>("terminal")? != 0,
        })
    }
}

impl OperationRecord {
    pub(in crate::store) fn from_row(
        row: &Row<'_>,
        broker: &str,
    ) -> rusqlite::Result<OperationRecord> {
        let presentation = presentation_of(row)?;
        OperationRecord::from_row_presented(row, broker, presentation)
    }

    /// The row's record with `presentation` (read from the row, or derived from it).
    pub(in crate::store) fn from_row_presented(
        row: &Row<'_>,
        broker: &str,
        presentation: Presentation,
    ) -> rusqlite::Result<OperationRecord> {
        let state = parse_state(row.get("state")?, 0)?;
        let json_column = |name: &str| -> rusqlite::Result<Value> {
            let text: String = row.get(name)?;
            serde_json::from_str(&text).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into())
            })
        };
        let ended_from = row
            .get::<_, Option<String>>("ended_from")?
            .map(|text| parse_state(text, 0))
            .transpose()?;
        let error_code: Option<String> = row.get("error_code")?;
        let error_message: Option<String> = row.get("error_message")?;
        Ok(OperationRecord {
            id: row.get("id")?,
            client_id: row.get("client_id")?,
            idempotency_key: row.get("idempotency_key")?,
            operation: row.get("operation")?,
            target: json_column("target")?,
            arguments: json_column("arguments")?,
            reason: row.get("reason")?,
            state,
            created_at: row.get("created_at")?,
            updated_at: row.get("updated_at")?,
            terminal_at: row.get("terminal_at")?,
            error: error_code.map(|code| OperationError {
                code,
                message: error_message.unwrap_or_default(),
            }),
            revision: row.get::<_, i64>("revision")?.max(1) as u64,
            decided: match row.get::<_, Option<String>>("decided_at")? {
                None => None,
                Some(at) => Some(Decided {
                    at,
                    by: row
                        .get::<_, Option<String>>("decided_by")?
                        .unwrap_or_default(),
                    on_behalf_of: row.get("decided_on_behalf_of")?,
                    revoked: row.get::<_, i64>("revoked")? != 0,
                }),
            },
            ended_from,
            active_expires_at: row.get("active_expires_at")?,
            pending_expires_at: row.get("pending_expires_at")?,
            broker: broker.to_owned(),
            presentation,
        })
    }
}

pub(super) const SELECT_OPERATION: &str = "SELECT id, client_id, idempotency_key, operation, \
    target, arguments, reason, state, created_at, updated_at, terminal_at, error_code, \
    error_message, revision, title, summary, decided_at, decided_by, decided_on_behalf_of, \
    revoked, ended_from, active_expires_at, pending_expires_at FROM operations";

/// Moves operation `id` from `from` to `to` inside `tx`, writing what `change` carries, +1 on
/// its revision, and (for a request) its Operator V1 event; the updated record and the event's
/// sequence, or `None` if the row was not in `from`. **Every** state change of an operation goes
/// through here (submission aside: a row is created in its first state, with its own event), in
/// the caller's transaction: transitions, starts, decisions, recovery, expiry. The caller rings
/// the event bell ([`SqliteStore::rang`]) after its commit.
pub(super) fn change_state(
    tx: &rusqlite::Connection,
    db: &SqliteStore,
    id: &str,
    from: OperationState,
    to: OperationState,
    change: &StateChange,
) -> rusqlite::Result<Option<(OperationRecord, Option<i64>)>> {
    let now = now_rfc3339();
    let terminal_at = to.is_terminal().then_some(now.as_str());
    let ended_from = to.is_terminal().then_some(from.as_str());
    let decision = change.decision.as_ref();
    let changed = tx
        .prepare_cached(
            "UPDATE operations SET state = ?3, updated_at = ?4, terminal_at = ?5, \
         error_code = ?6, error_message = ?7, revision = revision + 1, \
         decided_at = CASE WHEN ?8 IS NULL THEN decided_at ELSE ?4 END, \
         decided_by = CASE WHEN ?8 IS NULL THEN decided_by ELSE ?8 END, \
         decided_on_behalf_of = CASE WHEN ?8 IS NULL THEN decided_on_behalf_of ELSE ?9 END, \
         revoked = CASE WHEN ?8 IS NULL THEN revoked ELSE ?10 END, \
         ended_from = ?11, \
         active_expires_at = COALESCE(?12, active_expires_at) \
         WHERE id = ?1 AND state = ?2",
        )?
        .execute(params![
            id,
            from.as_str(),
            to.as_str(),
            now,
            terminal_at,
            change.error.as_ref().map(|e| e.code.as_str()),
            change.error.as_ref().map(|e| e.message.as_str()),
            decision.map(|d| d.by.as_str()),
            decision.and_then(|d| d.on_behalf_of.as_deref()),
            decision.map(|d| i64::from(d.revoked)),
            ended_from,
            decision
                .and_then(|d| d.lasts)
                .and_then(|lasts| humantime::parse_rfc3339(&now).ok().map(|at| at + lasts))
                .map(|at| humantime::format_rfc3339_millis(at).to_string()),
        ])?;
    if changed != 1 {
        return Ok(None);
    }
    let Some(record) = tx
        .prepare_cached(&format!("{SELECT_OPERATION} WHERE id = ?1"))?
        .query_row(params![id], |row| {
            OperationRecord::from_row(row, &db.broker)
        })
        .optional()?
    else {
        return Ok(None);
    };
    let seq = if db.is_request(&record.operation) {
        Some(events::append(
            tx,
            &record.id,
            record.revision,
            Some(from),
            to,
            record.ended_from,
            &now,
        )?)
    } else {
        None
    };
    Ok(Some((record, seq)))
}

/// The SQL of a listing page: the filters present, in a fixed order so each shape is one cached
/// statement. Each walks an index in `rowid` order and stops after `limit` rows.
fn page_sql(query: &PageQuery) -> String {
    let mut sql =
        format!("SELECT rowid AS position, {SUMMARY_COLUMNS} FROM operations WHERE client_id = ?1");
    if query.idempotency_key.is_some() {
        sql.push_str(" AND idempotency_key = ?2");
    }
    if query.state.is_some() {
        sql.push_str(" AND state = ?3");
    }
    if query.before.is_some() {
        sql.push_str(" AND rowid < ?4");
    }
    sql.push_str(" ORDER BY rowid DESC LIMIT ?5");
    sql
}

impl SqliteStore {
    /// Start-up recovery (blocking): operations that were executing become `failed` with
    /// `execution_interrupted` (they never run twice); returns them, the live ones and the
    /// streams.
    pub fn recover(&self) -> Result<Recovered, StoreError> {
        let mut conn = self.writer();
        let tx = conn.transaction()?;
        let error = OperationError::interrupted();
        let interrupted = {
            let mut stmt = tx.prepare(&format!(
                "{SELECT_OPERATION} WHERE state = 'executing' ORDER BY rowid"
            ))?;
            stmt.query_map([], |row| OperationRecord::from_row(row, &self.broker))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        let change = StateChange::error(Some(error));
        let mut failed = Vec::with_capacity(interrupted.len());
        let mut newest = None;
        for record in &interrupted {
            if let Some((record, seq)) = change_state(
                &tx,
                self,
                &record.id,
                OperationState::Executing,
                OperationState::Failed,
                &change,
            )? {
                failed.push(record);
                newest = seq.or(newest);
            }
        }
        let interrupted = failed;
        let live = {
            let mut stmt = tx.prepare(&format!(
                "{SELECT_OPERATION} WHERE state IN ('pending', 'approved') ORDER BY rowid"
            ))?;
            stmt.query_map([], |row| OperationRecord::from_row(row, &self.broker))?
                .collect::<rusqlite::Result<Vec<_>>>()?
        };
        let streams = all_streams(&tx)?;
        tx.commit()?;
        if let Some(seq) = newest {
            let written = interrupted
                .iter()
                .filter(|r| self.is_request(&r.operation))
                .count();
            self.events.rang(seq, written as u64);
        }
        Ok(Recovered {
            interrupted,
            live,
            streams,
        })
    }

    /// The client and creation time of every operation, in any state, created at or after
    /// `since` (blocking; at start-up, to rebuild the rate buckets). A `created_at` that does not
    /// parse is skipped.
    pub fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError> {
        let since = humantime::format_rfc3339_millis(since).to_string();
        let conn = self.reader()?;
        // `created_at` is always written by `now_rfc3339`: fixed width, UTC, so text order is time
        // order.
        let mut stmt = conn.prepare(
            "SELECT client_id, created_at FROM operations WHERE created_at >= ?1 ORDER BY created_at",
        )?;
        let mut rows = stmt.query([since])?;
        let mut created = Vec::new();
        while let Some(row) = rows.next()? {
            let client: String = row.get(0)?;
            let at: String = row.get(1)?;
            if let Ok(at) = humantime::parse_rfc3339(&at) {
                created.push((client, at));
            }
        }
        Ok(created)
    }

    /// Every stored operation's times, oldest first (blocking; see
    /// [`DurableStore::history`](crate::store::DurableStore::history)).
    pub fn history(&self) -> Result<Vec<OperationTimes>, StoreError> {
        history_of(&*self.reader()?)
    }

    /// [`SqliteStore::history`] of the store in `dir` without opening it as a broker does:
    /// through one read-only connection of its own, so no lock is taken, nothing is migrated or
    /// written, and a store a broker is serving can be read (a WAL reader never blocks its
    /// writer). For `admission check --history`.
    pub fn read_history(dir: &std::path::Path) -> Result<Vec<OperationTimes>, StoreError> {
        use rusqlite::OpenFlags;
        let path = dir.join(super::DATABASE_FILE);
        let conn = rusqlite::Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        history_of(&conn)
    }
}

/// The rows of [`HISTORY_SELECT`] through `conn`.
fn history_of(conn: &rusqlite::Connection) -> Result<Vec<OperationTimes>, StoreError> {
    let mut stmt = conn.prepare(HISTORY_SELECT)?;
    let mut rows = stmt.query([])?;
    let mut history = Vec::new();
    while let Some(row) = rows.next()? {
        let columns: [String; 7] = [
            row.get(0)?,
            row.get(1)?,
            row.get(2)?,
            row.get(3)?,
            row.get(4)?,
            row.get(5)?,
            row.get(6)?,
        ];
        history.extend(OperationTimes::from_columns(columns));
    }
    Ok(history)
}

impl SqliteStore {
    /// How many operation rows exist (blocking; sizes the replay filter).
    pub fn key_count(&self) -> Result<u64, StoreError> {
        let conn = self.reader()?;
        let n: i64 = conn.query_row("SELECT COUNT(*) FROM operations", [], |r| r.get(0))?;
        Ok(n.max(0) as u64)
    }

    /// Calls `f` with the client and idempotency key of every operation (blocking; at start-up
    /// and when the replay filter is rebuilt).
    pub fn for_each_key(&self, mut f: impl FnMut(&str, &str)) -> Result<(), StoreError> {
        let conn = self.reader()?;
        let mut stmt = conn.prepare("SELECT client_id, idempotency_key FROM operations")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let client: String = row.get(0)?;
            let key: String = row.get(1)?;
            f(&client, &key);
        }
        Ok(())
    }

    /// Every operation's (client, idempotency key, id): the key records a replica writes back
    /// after the shared store forgot them.
    pub async fn key_records(&self) -> Result<Vec<(String, String, String)>, StoreError> {
        self.read(|conn, _| {
            let mut stmt = conn.prepare("SELECT client_id, idempotency_key, id FROM operations")?;
            let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?;
            rows.collect()
        })
        .await
    }

    /// Inserts a new operation (and, for a request, its `request.created` event in the same
    /// transaction); durable when this returns `Ok`.
    pub async fn insert(&self, record: OperationRecord) -> Result<(), InsertError> {
        let is_request = self.is_request(&record.operation);
        let bell = self.events.clone();
        let result = self
            .write_grouped(
                move |tx| {
                    tx.prepare_cached(
                        "INSERT INTO operations (id, client_id, idempotency_key, operation, \
                         target, arguments, reason, state, created_at, updated_at, terminal_at, \
                         error_code, error_message, revision, title, summary, request_digest, \
                         pending_expires_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, NULL, NULL, NULL, 1, \
                         ?11, ?12, ?13, ?14)",
                    )?
                    .execute(params![
                        record.id,
                        record.client_id,
                        record.idempotency_key,
                        record.operation,
                        record.target.to_string(),
                        record.arguments.to_string(),
                        record.reason,
                        record.state.as_str(),
                        record.created_at,
                        record.updated_at,
                        record.presentation.title,
                        record.presentation.summary,
                        record.request_digest(),
                        record.pending_expires_at,
                    ])?;
                    is_request
                        .then(|| {
                            events::append(
                                tx,
                                &record.id,
                                1,
                                None,
                                record.state,
                                None,
                                &record.created_at,
                            )
                        })
                        .transpose()
                },
                move |seq| {
                    if let Some(seq) = *seq {
                        bell.rang(seq, 1);
                    }
                },
            )
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(err) if is_unique_violation(&err) => Err(InsertError::Duplicate),
            Err(err) => Err(InsertError::Store(err)),
        }
    }

    /// The request of the client's operation with this idempotency key: its digest and size,
    /// not its text.
    pub async fn request_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<StoredRequest>, StoreError> {
        let (client_id, key) = (client_id.to_owned(), key.to_owned());
        self.read(move |conn, _| {
            conn.prepare_cached(&format!(
                "SELECT {REQUEST_COLUMNS} FROM operations \
                 WHERE client_id = ?1 AND idempotency_key = ?2"
            ))?
            .query_row(params![client_id, key], StoredRequest::from_row)
            .optional()
        })
        .await
    }

    /// The request of operation `id`: whose it is and its size, not its text.
    pub async fn request_of(&self, id: &str) -> Result<Option<StoredRequest>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, _| {
            conn.prepare_cached(&format!(
                "SELECT {REQUEST_COLUMNS} FROM operations WHERE id = ?1"
            ))?
            .query_row(params![id], StoredRequest::from_row)
            .optional()
        })
        .await
    }

    /// Derives what schema 4 stores for every row that lacks it (blocking; at start-up, before
    /// anything reads the rows): the `presentation` from the stored request, and the request's
    /// digest. Those are the rows schema 4's migration found, and any row written into the file
    /// by another program; the partial index `operations_underived` lists exactly them, so a
    /// start with none costs one empty index lookup. Returns how many rows it filled.
    pub fn fill_derived(
        &self,
        derive: impl Fn(&str, &Value, &Value, &str) -> Presentation,
    ) -> Result<u64, StoreError> {
        /// Rows filled per transaction.
        const BATCH: i64 = 500;
        let mut conn = self.writer();
        let mut filled = 0;
        loop {
            let tx = conn.transaction()?;
            let rows = {
                let mut stmt = tx.prepare(&format!(
                    "SELECT seq, {SELECT} INDEXED BY operations_underived \
                     WHERE request_digest IS NULL ORDER BY seq LIMIT ?1",
                    SELECT = SELECT_OPERATION.trim_start_matches("SELECT ")
                ))?;
                stmt.query_map(params![BATCH], |row| {
                    let record = OperationRecord::from_row_presented(
                        row,
                        &self.broker,
                        Presentation::default(),
                    )?;
                    Ok((row.get::<_, i64>("seq")?, record))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?
            };
            for (seq, record) in &rows {
                let shown = derive(
                    &record.operation,
                    &record.target,
                    &record.arguments,
                    &record.reason,
                );
                tx.execute(
                    "UPDATE operations SET title = ?2, summary = ?3, request_digest = ?4 \
                     WHERE seq = ?1",
                    params![seq, shown.title, shown.summary, record.request_digest()],
                )?;
            }
            let done = (rows.len() as i64) < BATCH;
            tx.commit()?;
            filled += rows.len() as u64;
            if done {
                return Ok(filled);
            }
        }
    }

    /// The operation `id`.
    pub async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn, broker| {
            conn.prepare_cached(&format!("{SELECT_OPERATION} WHERE id = ?1"))?
                .query_row(params![id], |row| OperationRecord::from_row(row, broker))
                .optional()
        })
        .await
    }

    /// One listing page: the client's operations matching `query`, newest first, each with its
    /// position (pass the last one as the next page's `before`).
    pub async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationSummary)>, StoreError> {
        let client_id = client_id.to_owned();
        self.read(move |conn, broker| {
            let mut stmt = conn.prepare_cached(&page_sql(&query))?;
            let mut bind = |index: usize, value: &dyn rusqlite::ToSql| -> rusqlite::Result<()> {
                stmt.raw_bind_parameter(index, value)
            };
            bind(1, &client_id)?;
            if let Some(key) = &query.idempotency_key {
                bind(2, key)?;
            }
            if let Some(state) = query.state {
                bind(3, &state.as_str())?;
            }
            if let Some(before) = query.before {
                bind(4, &before)?;
            }
            bind(5, &query.limit)?;
            let mut rows = stmt.raw_query();
            let mut page = Vec::new();
            while let Some(row) = rows.next()? {
                page.push((
                    row.get::<_, i64>("position")?,
                    OperationSummary::from_row(row, broker)?,
                ));
            }
            Ok(page)
        })
        .await
    }

    /// How SQLite plans the listing page for `query` (one line per step), so a test can check
    /// that every page shape walks an index and sorts nothing.
    pub async fn explain_page(&self, query: PageQuery) -> Result<Vec<String>, StoreError> {
        self.read(move |conn, _| {
            let sql = format!("EXPLAIN QUERY PLAN {}", page_sql(&query));
            let mut stmt = conn.prepare(&sql)?;
            for index in 1..=stmt.parameter_count() {
                stmt.raw_bind_parameter(index, 1)?;
            }
            let mut rows = stmt.raw_query();
            let mut plan = Vec::new();
            while let Some(row) = rows.next()? {
                plan.push(row.get::<_, String>(3)?);
            }
            Ok(plan)
        })
        .await
    }

    /// Moves operation `id` from `from` to `to`, writing what `change` carries and its event if
    /// it is a request (`change_state`), in one transaction; durable when this returns. Returns
    /// the updated record, or `None` if the row was not in
    /// `from`.
    pub async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        change: StateChange,
    ) -> Result<Option<OperationRecord>, StoreError> {
        let id = id.to_owned();
        let db = self.clone();
        let bell = self.events.clone();
        let changed = self
            .write_grouped(
                move |tx| change_state(tx, &db, &id, from, to, &change),
                move |changed| {
                    if let Some((_, Some(seq))) = changed {
                        bell.rang(*seq, 1);
                    }
                },
            )
            .await?;
        Ok(changed.map(|(record, _)| record))
    }

    /// Writes `records` as they are (state, times, revision included) in one transaction
    /// (blocking): to seed a store for benchmarks and tests. Not for serving: the controller does
    /// not learn of them until the next start.
    pub fn load(&self, records: &[OperationRecord]) -> Result<(), StoreError> {
        let mut conn = self.writer();
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare(&format!(
                "INSERT INTO operations ({OPERATION_COLUMNS}, ended_from, active_expires_at, \
                 pending_expires_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, \
                 ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24)"
            ))?;
            for record in records {
                stmt.execute(params![
                    record.id,
                    record.client_id,
                    record.idempotency_key,
                    record.operation,
                    record.target.to_string(),
                    record.arguments.to_string(),
                    record.reason,
                    record.state.as_str(),
                    record.created_at,
                    record.updated_at,
                    record.terminal_at,
                    record.error.as_ref().map(|e| e.code.as_str()),
                    record.error.as_ref().map(|e| e.message.as_str()),
                    i64::try_from(record.revision).unwrap_or(i64::MAX),
                    record.presentation.title,
                    record.presentation.summary,
                    record.request_digest(),
                    record.decided.as_ref().map(|d| d.at.as_str()),
                    record.decided.as_ref().map(|d| d.by.as_str()),
                    record
                        .decided
                        .as_ref()
                        .and_then(|d| d.on_behalf_of.as_deref()),
                    record.decided.as_ref().is_some_and(|d| d.revoked),
                    record.ended_from.map(OperationState::as_str),
                    record.active_expires_at,
                    record.pending_expires_at,
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }
}

/// The operation state stored as `text` (read from column `column`), or the conversion error
/// that says the row holds a state this code does not know.
pub(super) fn parse_state(text: String, column: usize) -> rusqlite::Result<OperationState> {
    OperationState::parse(&text).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            column,
            rusqlite::types::Type::Text,
            format!("unknown operation state {text:?}").into(),
        )
    })
}
