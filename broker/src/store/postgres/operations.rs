//! The operation rows on PostgreSQL: inserting a submission (its key's uniqueness is the
//! table's constraint, so two replicas inserting one key make one row), the lookups a replay,
//! a get and a wait make, state changes (`change_state`, the one place a state changes),
//! listing pages and start-up recovery. The records they read back are `rows`'.

use std::sync::LazyLock;
use std::time::SystemTime;

use serde_json::Value;
use tokio_postgres::types::ToSql;

use unyolo_admission::engine::OperationState;

use super::super::error::{InsertError, StoreError};
use super::super::events::{event_kind, request_status};
use super::super::records::{
    OperationError, OperationRecord, OperationSummary, PageQuery, Presentation, Recovered,
    StateChange, StoredRequest, now_rfc3339,
};
use super::error::{Failed, corrupt, is_duplicate_key};
use super::group::Write;
use super::handle::PostgresStore;
use super::rows::{
    RECORD_COLUMNS, REQUEST_COLUMNS, SUMMARY_COLUMNS, column, record_of, record_presented,
    stored_request_of, summary_of,
};
use super::schema::{CHANGES_CHANNEL, LIVE, TERMINAL};
use super::streams::all_streams;

/// Every state change of an operation, as one statement: moves the row from `$2` to `$3` (only
/// if it is in `$2`, and for a start claimed by replica `$13` only if that replica still owns
/// it and its membership is live), +1 on its revision, writes its Operator V1 event (for the
/// operations named in `$17`, the requests) and announces the change; the updated row, or none.
static CHANGE_STATE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH up AS (UPDATE operations SET state = $3, updated_at = $4, terminal_at = $5, \
         error_code = $6, error_message = $7, revision = revision + 1, \
         decided_at = CASE WHEN $8::text IS NULL THEN decided_at ELSE $4 END, \
         decided_by = CASE WHEN $8::text IS NULL THEN decided_by ELSE $8 END, \
         decided_on_behalf_of = CASE WHEN $8::text IS NULL THEN decided_on_behalf_of \
         ELSE $9::text END, \
         revoked = CASE WHEN $8::text IS NULL THEN revoked ELSE $10::boolean END, \
         ended_from = $11, \
         active_expires_at = COALESCE($12::text, active_expires_at) \
         WHERE id = $1 AND state = $2 AND ($13::text IS NULL OR ((owner IS NULL OR owner = $13) \
         AND EXISTS (SELECT 1 FROM replicas WHERE name = $13 \
         AND lease_until >= clock_timestamp()))) \
         RETURNING {RECORD_COLUMNS}), \
         ev AS (INSERT INTO operator_events (kind, request_id, revision, status, occurred_at, \
         used_count) SELECT $14, id, revision, $15, $4, $16 FROM up \
         WHERE operation = ANY($17::text[])) \
         SELECT {RECORD_COLUMNS}, pg_notify($18, id || ' ' || state) FROM up"
    )
});

/// The statement and parameters of moving operation `id` from `from` to `to`, writing what
/// `change` carries; a start claimed by replica `claim` (see [`CHANGE_STATE`]).
fn state_change(
    db: &PostgresStore,
    id: &str,
    from: OperationState,
    to: OperationState,
    change: &StateChange,
    claim: Option<&str>,
) -> Write {
    let now = now_rfc3339();
    let terminal_at = to.is_terminal().then(|| now.clone());
    let ended_from = to.is_terminal().then_some(from);
    let decision = change.decision.as_ref();
    let lasts = decision
        .and_then(|d| d.lasts)
        .and_then(|lasts| humantime::parse_rfc3339(&now).ok().map(|at| at + lasts))
        .map(|at| humantime::format_rfc3339_millis(at).to_string());
    let status = request_status(to, ended_from);
    let owned = |s: Option<&str>| s.map(str::to_owned);
    Write {
        sql: CHANGE_STATE.as_str(),
        params: vec![
            Box::new(id.to_owned()),
            Box::new(from.as_str()),
            Box::new(to.as_str()),
            Box::new(now),
            Box::new(terminal_at),
            Box::new(owned(change.error.as_ref().map(|e| e.code.as_str()))),
            Box::new(owned(change.error.as_ref().map(|e| e.message.as_str()))),
            Box::new(owned(decision.map(|d| d.by.as_str()))),
            Box::new(owned(decision.and_then(|d| d.on_behalf_of.as_deref()))),
            Box::new(decision.map(|d| d.revoked)),
            Box::new(ended_from.map(OperationState::as_str)),
            Box::new(lasts),
            Box::new(owned(claim)),
            Box::new(event_kind(Some(from), to).as_str()),
            Box::new(status.as_str()),
            Box::new(status.used_count() as i64),
            Box::new(db.requests.to_vec()),
            Box::new(CHANGES_CHANNEL),
        ],
    }
}

/// Moves operation `id` from `from` to `to` inside `tx`, writing what `change` carries, +1 on
/// its revision, its Operator V1 event (for a request) and the change's notification; the
/// updated record, or `None` if the row was not in `from`. **Every** state change of an
/// operation is [`CHANGE_STATE`] (a row is created in its first state, with its own event):
/// here in the caller's transaction (decisions, recovery, expiry), or in a group commit's
/// (`PostgresStore::set_state`). Whether an event was written is
/// `db.is_request(&record.operation)`.
pub(super) async fn change_state(
    tx: &deadpool_postgres::Transaction<'_>,
    db: &PostgresStore,
    id: &str,
    from: OperationState,
    to: OperationState,
    change: &StateChange,
) -> Result<Option<OperationRecord>, Failed> {
    let write = state_change(db, id, from, to, change, None);
    let statement = tx.prepare_cached(write.sql).await?;
    let row = tx.query_opt(&statement, &write.refs()).await?;
    Ok(row.map(|row| record_of(&row, &db.broker)).transpose()?)
}

/// Why a start claimed by `me` moved nothing (read after it): the row is not in `from`, another
/// replica owns it, or `me`'s membership had lapsed.
enum NotStarted {
    /// The row is not in `from` (or is gone).
    NotThere,
    /// Refused: taken over ([`StoreError::TakenOver`]), or a membership still lapsed (a
    /// transient [`StoreError::Unavailable`]: the start waits until it is renewed, or the work
    /// is taken over).
    Refused(StoreError),
    /// Lapsed when the start was tried, renewed since: try again.
    Renewed,
}

/// Reads why a start claimed by `me` of operation `id` (from `from`) moved nothing.
async fn why_not_started(
    db: &PostgresStore,
    id: &str,
    from: OperationState,
    me: &str,
) -> Result<NotStarted, StoreError> {
    let row = db
        .query_opt_cached(
            "SELECT state, owner IS NULL OR owner = $2, \
             EXISTS (SELECT 1 FROM replicas WHERE name = $2 AND lease_until >= clock_timestamp()) \
             FROM operations WHERE id = $1",
            &[&id, &me],
        )
        .await?;
    let Some(row) = row else {
        return Ok(NotStarted::NotThere);
    };
    let (state, owned, member): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    Ok(if state != from.as_str() {
        NotStarted::NotThere
    } else if !owned {
        NotStarted::Refused(StoreError::TakenOver { id: id.to_owned() })
    } else if member {
        NotStarted::Renewed
    } else {
        NotStarted::Refused(StoreError::Unavailable {
            database: db.shown.to_string(),
            source: format!(
                "the membership of replica {me} has lapsed: it starts no work until it is renewed"
            )
            .into(),
        })
    })
}

/// An operation (aliased `o`) no live replica owns: its owner's membership lapsed, or it names
/// none (written outside a fleet, or by schema 1).
const ORPHANED: &str = "(o.owner IS NULL OR NOT EXISTS (SELECT 1 FROM replicas r \
     WHERE r.name = o.owner AND r.lease_until >= clock_timestamp()))";

/// Which work recovery takes (see `PostgresStore::take_over`).
#[derive(Clone, Copy)]
enum Taking {
    /// At start-up: this replica's own and the orphaned.
    AtStart,
    /// While running: only the orphaned.
    Lapsed,
}

impl PostgresStore {
    /// Inserts a new operation (and, for a request, its `request.created` event) in one
    /// statement, in the group commit forming now; [`InsertError::Duplicate`] when the client
    /// already has the key (the constraint `operations_client_key`, however many replicas
    /// insert it at once).
    pub async fn insert(&self, record: OperationRecord) -> Result<(), InsertError> {
        let is_request = self.is_request(&record.operation);
        let status = request_status(record.state, None);
        let (digest, target, arguments) = (
            record.request_digest(),
            record.target.to_string(),
            record.arguments.to_string(),
        );
        // One statement, so it means the same alone or in a batch: the row, its
        // `request.created` event (for a request) and the change's notification commit together
        // or not at all. A key already taken inserts nothing and returns no row (not an error,
        // which would abort the batch's other writes).
        let write = Write {
            sql: "WITH op AS (INSERT INTO operations (id, client_id, idempotency_key, \
                  operation, target, arguments, reason, state, created_at, updated_at, \
                  revision, title, summary, request_digest, pending_expires_at, owner) \
                  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, $11, $12, $13, $14, \
                  $15) ON CONFLICT ON CONSTRAINT operations_client_key DO NOTHING \
                  RETURNING id), \
                  ev AS (INSERT INTO operator_events (kind, request_id, revision, status, \
                  occurred_at, used_count) SELECT $16, id, 1, $17, $9, $18 FROM op \
                  WHERE $19::boolean) \
                  SELECT pg_notify($20, id || ' ' || $8) FROM op",
            params: vec![
                Box::new(record.id),
                Box::new(record.client_id),
                Box::new(record.idempotency_key),
                Box::new(record.operation),
                Box::new(target),
                Box::new(arguments),
                Box::new(record.reason),
                Box::new(record.state.as_str()),
                Box::new(record.created_at),
                Box::new(record.updated_at),
                Box::new(record.presentation.title),
                Box::new(record.presentation.summary),
                Box::new(digest),
                Box::new(record.pending_expires_at),
                Box::new(self.member.get().cloned()),
                Box::new(event_kind(None, record.state).as_str()),
                Box::new(status.as_str()),
                Box::new(status.used_count() as i64),
                Box::new(is_request),
                Box::new(CHANGES_CHANNEL),
            ],
        };
        match self.group.write(write).await {
            Ok(rows) if rows.is_empty() => Err(InsertError::Duplicate),
            Ok(_) => {
                if is_request {
                    self.wrote(1);
                }
                Ok(())
            }
            Err(Failed::Statement(err)) if is_duplicate_key(&err) => Err(InsertError::Duplicate),
            Err(failed) => Err(InsertError::Store(self.failed(failed))),
        }
    }

    /// Moves operation `id` from `from` to `to` (see `change_state`), in the group commit
    /// forming now. A start (approved to executing) in a fleet is this replica's claim: see
    /// `why_not_started`.
    pub async fn set_state(
        &self,
        id: &str,
        from: OperationState,
        to: OperationState,
        change: StateChange,
    ) -> Result<Option<OperationRecord>, StoreError> {
        let claim = (from == OperationState::Approved && to == OperationState::Executing)
            .then(|| self.member.get())
            .flatten();
        // A start refused by a membership renewed meanwhile is tried once more.
        for _ in 0..2 {
            let rows = self
                .group
                .write(state_change(
                    self,
                    id,
                    from,
                    to,
                    &change,
                    claim.map(String::as_str),
                ))
                .await
                .map_err(|f| self.failed(f))?;
            if let Some(row) = rows.first() {
                let record = record_of(row, &self.broker)?;
                if self.is_request(&record.operation) {
                    self.wrote(1);
                }
                return Ok(Some(record));
            }
            let Some(me) = claim else {
                return Ok(None);
            };
            match why_not_started(self, id, from, me).await? {
                NotStarted::NotThere => return Ok(None),
                NotStarted::Refused(refused) => return Err(refused),
                NotStarted::Renewed => continue,
            }
        }
        Err(StoreError::Unavailable {
            database: self.shown.to_string(),
            source: "the replica's membership lapsed and was renewed while the start was tried"
                .into(),
        })
    }

    /// Start-up recovery: of this replica's operations and those no live replica owns
    /// (their owner's membership lapsed, or none: a store opened outside a fleet), the ones that
    /// were executing become `failed` with `execution_interrupted`, and the pending and approved
    /// ones become this replica's; returns them and every stream, from one transaction. Live
    /// replicas' work is left to them.
    pub async fn recover(&self) -> Result<Recovered, StoreError> {
        self.take_over(Taking::AtStart).await
    }

    /// Takes over the work of replicas whose membership has lapsed (they died, or lost the
    /// store for a whole lease), as [`PostgresStore::recover`] does at start-up: their
    /// executing operations end `failed` `execution_interrupted`, their pending and approved
    /// ones become this replica's. Only once this replica has been a live member for `lease`
    /// itself (after a store outage every replica's lease lapses: each gets a lease to renew
    /// before any takes another's work), and one replica at a time. Streams are not returned.
    pub async fn take_over_lapsed(
        &self,
        lease: std::time::Duration,
    ) -> Result<Recovered, StoreError> {
        let Some(me) = self.member.get() else {
            return Ok(Recovered::default());
        };
        // A cheap look first, without the lock: is there work whose owner is gone?
        let client = self.client().await?;
        let lapsed = client
            .query_one(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM operations o \
                     WHERE state IN ('pending', 'approved', 'executing') AND {ORPHANED}) \
                     AND EXISTS (SELECT 1 FROM replicas WHERE name = $1 \
                     AND lease_until >= clock_timestamp() \
                     AND joined_at + $2::text::interval <= clock_timestamp())"
                ),
                &[me, &format!("{} milliseconds", lease.as_millis())],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        drop(client);
        if !lapsed.get::<_, bool>(0) {
            return Ok(Recovered::default());
        }
        self.take_over(Taking::Lapsed).await
    }

    /// Recovery's one transaction (see [`PostgresStore::recover`] and
    /// [`PostgresStore::take_over_lapsed`]), under the fleet's lock so two replicas never take
    /// the same work.
    async fn take_over(&self, taking: Taking) -> Result<Recovered, StoreError> {
        let error = OperationError::interrupted();
        let me = self.member.get().map(String::as_str);
        // Whose work: all of it outside a fleet; in one, this replica's own (at start-up) and
        // that of owners no longer live.
        let whose = match (me, taking) {
            (None, _) => String::from("true"),
            (Some(_), Taking::AtStart) => format!("(owner = $1 OR {ORPHANED})"),
            (Some(_), Taking::Lapsed) => format!("(owner IS DISTINCT FROM $1 AND {ORPHANED})"),
        };
        let params: Vec<&(dyn ToSql + Sync)> = match &me {
            Some(me) => vec![me],
            None => vec![],
        };
        let recovered: Result<_, Failed> = async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock($1)",
                &[&super::schema::FLEET_LOCK],
            )
            .await?;
            let executing = tx
                .query(
                    &format!(
                        "SELECT id FROM operations o WHERE state = 'executing' AND {whose} \
                         ORDER BY seq FOR UPDATE"
                    ),
                    &params,
                )
                .await?;
            let change = StateChange::error(Some(error));
            let mut interrupted = Vec::with_capacity(executing.len());
            for row in &executing {
                let id: String = column(row, "id")?;
                if let Some(record) = change_state(
                    &tx,
                    self,
                    &id,
                    OperationState::Executing,
                    OperationState::Failed,
                    &change,
                )
                .await?
                {
                    interrupted.push(record);
                }
            }
            let live = match me {
                Some(_) => {
                    tx.query(
                        &format!(
                            "UPDATE operations o SET owner = $1 \
                             WHERE state IN ('pending', 'approved') AND {whose} \
                             RETURNING seq, {RECORD_COLUMNS}"
                        ),
                        &params,
                    )
                    .await?
                }
                None => {
                    tx.query(
                        &format!(
                            "SELECT seq, {RECORD_COLUMNS} FROM operations \
                             WHERE state IN ('pending', 'approved') ORDER BY seq"
                        ),
                        &[],
                    )
                    .await?
                }
            };
            let mut live = live
                .iter()
                .map(|row| Ok((column::<i64>(row, "seq")?, record_of(row, &self.broker)?)))
                .collect::<Result<Vec<_>, Failed>>()?;
            // Oldest first, as they were queued (UPDATE .. RETURNING keeps no order).
            live.sort_by_key(|(seq, _)| *seq);
            let live = live.into_iter().map(|(_, record)| record).collect();
            let streams = match taking {
                Taking::AtStart => all_streams(&tx, me).await?,
                Taking::Lapsed => Vec::new(),
            };
            tx.commit().await?;
            Ok(Recovered {
                interrupted,
                live,
                streams,
            })
        }
        .await;
        let recovered = recovered.map_err(|f| self.failed(f))?;
        let written = recovered
            .interrupted
            .iter()
            .filter(|r| self.is_request(&r.operation))
            .count();
        self.wrote(written as u64);
        Ok(recovered)
    }

    /// The client and creation time of every operation created at or after `since` (in a
    /// fleet, this replica's: each replica's admissions are its own share of a client's rate).
    pub async fn created_since(
        &self,
        since: SystemTime,
    ) -> Result<Vec<(String, SystemTime)>, StoreError> {
        let since = humantime::format_rfc3339_millis(since).to_string();
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT client_id, created_at FROM operations WHERE created_at >= $1 \
                 AND ($2::text IS NULL OR owner = $2) ORDER BY created_at",
                &[&since, &self.member.get()],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        let mut created = Vec::with_capacity(rows.len());
        for row in &rows {
            let at: String = column(row, "created_at")?;
            if let Ok(at) = humantime::parse_rfc3339(&at) {
                created.push((column(row, "client_id")?, at));
            }
        }
        Ok(created)
    }

    /// Runs `sql` (no parameters) and reads each row's first columns as strings.
    pub(super) async fn strings(
        &self,
        sql: &str,
        width: usize,
    ) -> Result<Vec<Vec<String>>, StoreError> {
        let client = self.client().await?;
        let rows = client.query(sql, &[]).await.map_err(|e| self.sorted(e))?;
        rows.iter()
            .map(|row| {
                (0..width)
                    .map(|n| {
                        row.try_get::<_, String>(n)
                            .map_err(|e| corrupt(format!("column {n}: {e}")))
                    })
                    .collect()
            })
            .collect()
    }

    /// Runs `sql`, a `count(*)`, and reads it.
    pub(super) async fn count(&self, sql: &str) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let n: i64 = client
            .query_one(sql, &[])
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        Ok(n.max(0) as u64)
    }

    /// The request of the client's operation with this idempotency key.
    pub async fn request_by_key(
        &self,
        client_id: &str,
        key: &str,
    ) -> Result<Option<StoredRequest>, StoreError> {
        let sql = format!(
            "SELECT {REQUEST_COLUMNS} FROM operations \
             WHERE client_id = $1 AND idempotency_key = $2"
        );
        let row = self.query_opt_cached(&sql, &[&client_id, &key]).await?;
        row.as_ref().map(stored_request_of).transpose()
    }

    /// The request of operation `id`.
    pub async fn request_of(&self, id: &str) -> Result<Option<StoredRequest>, StoreError> {
        let sql = format!("SELECT {REQUEST_COLUMNS} FROM operations WHERE id = $1");
        let row = self.query_opt_cached(&sql, &[&id]).await?;
        row.as_ref().map(stored_request_of).transpose()
    }

    /// The operation `id`.
    pub async fn get(&self, id: &str) -> Result<Option<OperationRecord>, StoreError> {
        let sql = format!("SELECT {RECORD_COLUMNS} FROM operations WHERE id = $1");
        let row = self.query_opt_cached(&sql, &[&id]).await?;
        row.map(|row| record_of(&row, &self.broker)).transpose()
    }

    /// One listing page: the client's operations matching `query`, newest first, each with its
    /// position (`seq`; pass the last one as the next page's `before`).
    pub async fn list_page(
        &self,
        client_id: &str,
        query: PageQuery,
    ) -> Result<Vec<(i64, OperationSummary)>, StoreError> {
        let mut sql = format!("SELECT seq, {SUMMARY_COLUMNS} FROM operations WHERE client_id = $1");
        let state = query.state.map(OperationState::as_str);
        let limit = i64::from(query.limit);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&client_id];
        if let Some(key) = &query.idempotency_key {
            params.push(key);
            sql.push_str(&format!(" AND idempotency_key = ${}", params.len()));
        }
        if let Some(state) = &state {
            params.push(state);
            // Its group named too, so a plan made for any state may read the partial index of
            // that group (`schema::MIGRATE_3`).
            let group = match query.state {
                Some(s) if s.is_terminal() => TERMINAL,
                _ => LIVE,
            };
            sql.push_str(&format!(
                " AND state = ${} AND state IN {group}",
                params.len()
            ));
        }
        if let Some(before) = &query.before {
            params.push(before);
            sql.push_str(&format!(" AND seq < ${}", params.len()));
        }
        params.push(&limit);
        sql.push_str(&format!(" ORDER BY seq DESC LIMIT ${}", params.len()));
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&sql)
            .await
            .map_err(|e| self.sorted(e))?;
        let rows = client
            .query(&stmt, &params)
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter()
            .map(|row| Ok((column(row, "seq")?, summary_of(row, &self.broker)?)))
            .collect()
    }

    /// Derives the presentation and digest of every row stored without them (written by a
    /// program other than the broker); how many rows it filled.
    pub async fn fill_derived(
        &self,
        derive: impl Fn(&str, &Value, &Value, &str) -> Presentation,
    ) -> Result<u64, StoreError> {
        /// Rows filled per transaction.
        const BATCH: i64 = 500;
        let mut filled = 0;
        loop {
            let done: Result<(u64, bool), Failed> = async {
                let mut client = self.client().await?;
                let tx = client.transaction().await?;
                let rows = tx
                    .query(
                        &format!(
                            "SELECT seq, {RECORD_COLUMNS} FROM operations \
                             WHERE request_digest IS NULL ORDER BY seq LIMIT $1 FOR UPDATE"
                        ),
                        &[&BATCH],
                    )
                    .await?;
                for row in &rows {
                    let seq: i64 = column(row, "seq")?;
                    let record = record_presented(row, &self.broker, Presentation::default())?;
                    let shown = derive(
                        &record.operation,
                        &record.target,
                        &record.arguments,
                        &record.reason,
                    );
                    tx.execute(
                        "UPDATE operations SET title = $2, summary = $3, request_digest = $4 \
                         WHERE seq = $1",
                        &[&seq, &shown.title, &shown.summary, &record.request_digest()],
                    )
                    .await?;
                }
                tx.commit().await?;
                Ok((rows.len() as u64, (rows.len() as i64) < BATCH))
            }
            .await;
            let (n, done) = done.map_err(|f| self.failed(f))?;
            filled += n;
            if done {
                return Ok(filled);
            }
        }
    }
}
