//! The operator's routes: the pending requests, approve, deny, and an on-demand drift reading
//! (`GET /api/operator/v1/drift`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::{Value, json};

use super::error::{ApiError, ApiResult, json_response};
use super::extract::{OperationId, Operator};
use super::projection::OperationJson;
use crate::broker::core::Core;
use crate::broker::operations::TransitionFailure;
use crate::broker::store::OperationRecord;
use crate::engine::OperationState;

/// Most pending requests the operator's list returns (the oldest).
const LIST_LIMIT: u32 = 1000;

pub(crate) async fn list_pending(State(core): State<Arc<Core>>, _operator: Operator) -> ApiResult {
    let records = core
        .db
        .list_in_state(OperationState::Pending, LIST_LIMIT)
        .await?;
    let requests: Vec<Value> = records.iter().map(OperationRecord::to_json).collect();
    Ok(json_response(StatusCode::OK, json!({"requests": requests})))
}

/// Approves or denies (`to`) the pending request `id`; the operator is already authenticated.
async fn decide(core: &Arc<Core>, id: &str, to: OperationState) -> ApiResult {
    let not_pending = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "request_not_pending",
            "The request is not pending.",
        )
    };
    if core.db.get(id).await?.is_none() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "request_not_found",
            "No such request.",
        ));
    }
    let op = core.live_op(id).ok_or_else(not_pending)?;
    if op.handle.state() != OperationState::Pending {
        return Err(not_pending());
    }
    // Decided: the write and the handle's move run to their end even if the operator hangs up.
    match core.transition_to_end(op, to).await {
        Ok(record) => Ok(json_response(StatusCode::OK, record.to_json())),
        Err(TransitionFailure::NotAllowed(_)) => Err(not_pending()),
        Err(TransitionFailure::Store(err)) => Err(err.into()),
    }
}

pub(crate) async fn approve(
    State(core): State<Arc<Core>>,
    _operator: Operator,
    OperationId(id): OperationId,
) -> ApiResult {
    decide(&core, &id, OperationState::Approved).await
}

pub(crate) async fn deny(
    State(core): State<Arc<Core>>,
    _operator: Operator,
    OperationId(id): OperationId,
) -> ApiResult {
    decide(&core, &id, OperationState::Denied).await
}

/// `GET /api/operator/v1/drift` (operator): compares the controller's counts with the store now
/// and answers the report, `{"drift": N, "differences": [...]}` (see [`crate::broker::DriftReport::to_json`]).
pub(crate) async fn drift(State(core): State<Arc<Core>>, _operator: Operator) -> ApiResult {
    let report = crate::broker::drift::check(&core).await?;
    Ok(json_response(StatusCode::OK, report.to_json()))
}
