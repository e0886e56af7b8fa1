//! The projections of rows into the store's records, in one place: the columns each record
//! reads (`RECORD_COLUMNS`, ...) beside the function that reads them, every value that does
//! not convert reported as a corrupt row, and how a transaction's stop (`error::Failed`) reads as
//! the store's error.

use serde_json::Value;
use tokio_postgres::Row;

use unyolo_admission::engine::OperationState;

use super::super::error::StoreError;
use super::super::records::{
    Decided, OperationError, OperationRecord, OperationSummary, Presentation, StoredRequest,
};
use super::error::{Failed, corrupt};
use super::handle::PostgresStore;

/// The columns of an [`OperationRecord`].
pub(super) const RECORD_COLUMNS: &str = "id, client_id, idempotency_key, operation, target, \
    arguments, reason, state, created_at, updated_at, terminal_at, error_code, error_message, \
    revision, title, summary, decided_at, decided_by, decided_on_behalf_of, revoked, ended_from, \
    active_expires_at, pending_expires_at";

/// The columns a listing page selects.
pub(super) const SUMMARY_COLUMNS: &str = "id, client_id, idempotency_key, operation, state, created_at, \
    updated_at, terminal_at, revision, title, summary";

/// The columns of a [`StoredRequest`]: the sizes, not the texts.
pub(super) const REQUEST_COLUMNS: &str = "id, client_id, idempotency_key, request_digest, revision, \
    terminal_at IS NOT NULL AS terminal, \
    (octet_length(target) + octet_length(arguments) + octet_length(reason))::bigint AS bytes";

/// Column `name` of `row`, or the corrupt row it says this is.
pub(super) fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    name: &str,
) -> Result<T, StoreError> {
    row.try_get(name)
        .map_err(|e| corrupt(format!("column {name}: {e}")))
}

/// The state in column `name`.
pub(super) fn state_column(row: &Row, name: &str) -> Result<OperationState, StoreError> {
    let text: String = column(row, name)?;
    OperationState::parse(&text)
        .ok_or_else(|| corrupt(format!("unknown operation state {text:?} in {name}")))
}

/// The stored presentation; a row without one was never derived, and reads as corrupt.
fn presentation_of(row: &Row) -> Result<Presentation, StoreError> {
    let title: Option<String> = column(row, "title")?;
    Ok(Presentation {
        title: title.ok_or_else(|| corrupt("the operation has no stored presentation"))?,
        summary: column(row, "summary")?,
    })
}

/// The record in `row` (selected as [`RECORD_COLUMNS`]).
pub(super) fn record_of(row: &Row, broker: &str) -> Result<OperationRecord, StoreError> {
    let presentation = presentation_of(row)?;
    record_presented(row, broker, presentation)
}

/// The record in `row` with `presentation`.
pub(super) fn record_presented(
    row: &Row,
    broker: &str,
    presentation: Presentation,
) -> Result<OperationRecord, StoreError> {
    let json = |name: &str| -> Result<Value, StoreError> {
        let text: String = column(row, name)?;
        serde_json::from_str(&text).map_err(|e| corrupt(format!("column {name}: {e}")))
    };
    let ended_from: Option<String> = column(row, "ended_from")?;
    let ended_from = match ended_from {
        None => None,
        Some(text) => Some(
            OperationState::parse(&text)
                .ok_or_else(|| corrupt(format!("unknown operation state {text:?}")))?,
        ),
    };
    let error_code: Option<String> = column(row, "error_code")?;
    let error_message: Option<String> = column(row, "error_message")?;
    let decided_at: Option<String> = column(row, "decided_at")?;
    Ok(OperationRecord {
        id: column(row, "id")?,
        client_id: column(row, "client_id")?,
        idempotency_key: column(row, "idempotency_key")?,
        operation: column(row, "operation")?,
        target: json("target")?,
        arguments: json("arguments")?,
        reason: column(row, "reason")?,
        state: state_column(row, "state")?,
        created_at: column(row, "created_at")?,
        updated_at: column(row, "updated_at")?,
        terminal_at: column(row, "terminal_at")?,
        error: error_code.map(|code| OperationError {
            code,
            message: error_message.unwrap_or_default(),
        }),
        revision: column::<i64>(row, "revision")?.max(1) as u64,
        decided: match decided_at {
            None => None,
            Some(at) => Some(Decided {
                at,
                by: column::<Option<String>>(row, "decided_by")?.unwrap_or_default(),
                on_behalf_of: column(row, "decided_on_behalf_of")?,
                revoked: column(row, "revoked")?,
            }),
        },
        ended_from,
        active_expires_at: column(row, "active_expires_at")?,
        pending_expires_at: column(row, "pending_expires_at")?,
        broker: broker.to_owned(),
        presentation,
    })
}

pub(super) fn summary_of(row: &Row, broker: &str) -> Result<OperationSummary, StoreError> {
    Ok(OperationSummary {
        id: column(row, "id")?,
        client_id: column(row, "client_id")?,
        idempotency_key: column(row, "idempotency_key")?,
        operation: column(row, "operation")?,
        state: state_column(row, "state")?,
        created_at: column(row, "created_at")?,
        updated_at: column(row, "updated_at")?,
        terminal_at: column(row, "terminal_at")?,
        revision: column::<i64>(row, "revision")?.max(1) as u64,
        broker: broker.to_owned(),
        presentation: presentation_of(row)?,
    })
}

pub(super) fn stored_request_of(row: &Row) -> Result<StoredRequest, StoreError> {
    let digest: Option<String> = column(row, "request_digest")?;
    Ok(StoredRequest {
        id: column(row, "id")?,
        client_id: column(row, "client_id")?,
        idempotency_key: column(row, "idempotency_key")?,
        digest: digest.unwrap_or_default(),
        bytes: column::<Option<i64>>(row, "bytes")?.unwrap_or(0).max(0) as u64,
        revision: column::<i64>(row, "revision")?.max(1) as u64,
        terminal: column(row, "terminal")?,
    })
}

impl PostgresStore {
    /// `failed` as the store's error.
    pub(super) fn failed(&self, failed: Failed) -> StoreError {
        match failed {
            Failed::Statement(err) => self.sorted(err),
            Failed::Store(err) => err,
        }
    }
}
