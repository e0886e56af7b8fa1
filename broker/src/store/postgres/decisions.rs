//! Operators' decisions on PostgreSQL: judged and committed in one transaction that first locks
//! the request's row (`FOR UPDATE`), so two decisions on one request, from any replicas, run one
//! after the other and the second sees what the first wrote: its idempotency record (a replay or
//! a conflict) or the request's new state (for its judge). The state change goes through
//! `change_state`, the one place a state changes, with the decision's record beside it.

use super::super::decisions::{DecisionCommand, DecisionOutcome};
use super::super::durable::{Judge, Render};
use super::super::error::StoreError;
use super::super::records::{DecisionMark, OperationError, StateChange, now_rfc3339};
use super::error::Failed;
use super::handle::PostgresStore;
use super::operations::change_state;
use super::rows::{RECORD_COLUMNS, column, record_of};

impl PostgresStore {
    /// Judges and commits `command` in one transaction (see the module docs); a judge's refusal
    /// is `Refused(())`, writing nothing.
    pub async fn decide(
        &self,
        command: DecisionCommand,
        judge: Judge,
        render: Render,
    ) -> Result<DecisionOutcome<()>, StoreError> {
        let decided: Result<_, Failed> = async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            let scope = &command.scope;
            // The row lock first: a decision committed meanwhile is visible to what follows.
            let current = tx
                .query_opt(
                    &format!("SELECT {RECORD_COLUMNS} FROM operations WHERE id = $1 FOR UPDATE"),
                    &[&scope.request_id],
                )
                .await?;
            let recorded = tx
                .query_opt(
                    "SELECT command_hash, committed FROM operator_decisions \
                     WHERE request_id = $1 AND action = $2 AND idempotency_key = $3",
                    &[&scope.request_id, &scope.action, &scope.idempotency_key],
                )
                .await?;
            if let Some(row) = recorded {
                let hash: String = column(&row, "command_hash")?;
                return Ok(if hash == command.command_hash {
                    DecisionOutcome::Replayed(column(&row, "committed")?)
                } else {
                    DecisionOutcome::IdempotencyConflict
                });
            }
            let Some(current) = current else {
                return Ok(DecisionOutcome::NotFound);
            };
            let current = record_of(&current, &self.broker)?;
            let Ok(decided) = judge(&current) else {
                return Ok(DecisionOutcome::Refused((), current));
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
            let Some(record) =
                change_state(&tx, self, &current.id, current.state, decided.to, &change).await?
            else {
                // Locked in this transaction and unchanged since: cannot happen; commit nothing.
                return Ok(DecisionOutcome::NotFound);
            };
            let rendered = render(&record);
            tx.execute(
                "INSERT INTO operator_decisions (request_id, action, idempotency_key, \
                 command_hash, operator, committed, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &[
                    &scope.request_id,
                    &scope.action,
                    &scope.idempotency_key,
                    &command.command_hash,
                    &command.operator,
                    &rendered,
                    &now_rfc3339(),
                ],
            )
            .await?;
            tx.commit().await?;
            if self.is_request(&record.operation) {
                self.wrote(1);
            }
            Ok(DecisionOutcome::Committed(record, rendered))
        }
        .await;
        decided.map_err(|f| self.failed(f))
    }

    /// How many decision records are stored.
    pub async fn count_decisions(&self) -> Result<u64, StoreError> {
        self.count("SELECT count(*) FROM operator_decisions").await
    }
}
