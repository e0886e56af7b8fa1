//! Operators' decisions: the one write transaction that judges and commits a decision, and the
//! durable idempotency records that let a retried decision replay what it committed.
//!
//! A decision is judged and written in one SQLite write transaction, so two decisions on one
//! request are serialized by SQLite's write lock and the second sees what the first wrote: the
//! idempotency record is looked up, then the request, then the caller's judge (revision,
//! transition, constraints: the contract's rules, which the store does not know) says what to
//! write, and the state change ([`change_state`], the one place every state change is written)
//! and the decision's record commit together, or nothing does.

use rusqlite::{OptionalExtension, params};

use super::super::decisions::{DecidedMove, DecisionCommand, DecisionOutcome};
use super::super::error::StoreError;
use super::super::records::now_rfc3339;
use super::super::records::{DecisionMark, OperationError, OperationRecord, StateChange};
use super::database::SqliteStore;
use super::operations::{SELECT_OPERATION, change_state};

impl SqliteStore {
    /// Judges and commits `command` in one write transaction (see the module docs): `judge`
    /// says, from the stored request, what to do (`Err` refuses with its reason, writing
    /// nothing); `render` renders the committed request for the record a replay answers.
    pub async fn decide<R: Send + 'static>(
        &self,
        command: DecisionCommand,
        judge: impl FnOnce(&OperationRecord) -> Result<DecidedMove, R> + Send + 'static,
        render: impl FnOnce(&OperationRecord) -> String + Send + 'static,
    ) -> Result<DecisionOutcome<R>, StoreError> {
        let db = self.clone();
        self.write(move |conn| {
            let broker = &db.broker;
            // Immediate: the write lock is taken at the start (waiting out another process's
            // hold within the busy timeout), so the reads below see what the write commits on.
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let scope = &command.scope;
            let recorded: Option<(String, String)> = tx
                .prepare_cached(
                    "SELECT command_hash, committed FROM operator_decisions \
                     WHERE request_id = ?1 AND action = ?2 AND idempotency_key = ?3",
                )?
                .query_row(
                    params![scope.request_id, scope.action, scope.idempotency_key],
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()?;
            if let Some((hash, committed)) = recorded {
                return Ok(if hash == command.command_hash {
                    DecisionOutcome::Replayed(committed)
                } else {
                    DecisionOutcome::IdempotencyConflict
                });
            }
            let current = tx
                .prepare_cached(&format!("{SELECT_OPERATION} WHERE id = ?1"))?
                .query_row(params![scope.request_id], |row| {
                    OperationRecord::from_row(row, broker)
                })
                .optional()?;
            let Some(current) = current else {
                return Ok(DecisionOutcome::NotFound);
            };
            let decided = match judge(&current) {
                Ok(decided) => decided,
                Err(reason) => return Ok(DecisionOutcome::Refused(reason, current)),
            };
            let change = StateChange {
                error: OperationError::ended_by_decision(decided.to),
                decision: Some(DecisionMark {
                    by: command.operator.clone(),
                    on_behalf_of: command.on_behalf_of.clone(),
                    revoked: decided.revoked,
                    lasts: decided.lasts,
                }),
            };
            let Some((record, seq)) =
                change_state(&tx, &db, &current.id, current.state, decided.to, &change)?
            else {
                // Read in this transaction and unchanged since: cannot happen; commit nothing.
                return Ok(DecisionOutcome::NotFound);
            };
            let rendered = render(&record);
            tx.prepare_cached(
                "INSERT INTO operator_decisions (request_id, action, idempotency_key, \
                 command_hash, operator, committed, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?
            .execute(params![
                scope.request_id,
                scope.action,
                scope.idempotency_key,
                command.command_hash,
                command.operator,
                rendered,
                now_rfc3339(),
            ])?;
            tx.commit()?;
            if let Some(seq) = seq {
                db.events.rang(seq, 1);
            }
            Ok(DecisionOutcome::Committed(record, rendered))
        })
        .await
    }

    /// How many decision records are stored (for tests: a refused decision writes none).
    pub async fn count_decisions(&self) -> Result<u64, StoreError> {
        self.read(|conn, _| {
            conn.query_row("SELECT COUNT(*) FROM operator_decisions", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|n| n.max(0) as u64)
    }
}
