//! The operator's routes: the pending requests, approve, deny, and an on-demand drift reading
//! (`GET /api/operator/v1/drift`).

use std::sync::Arc;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};

use super::Core;
use super::http::{ApiError, ApiResult, json_response, path_id, transition_to_end};
use super::operations::TransitionFailure;
use super::projection::OperationJson;
use super::store::OperationRecord;
use crate::engine::OperationState;

/// Most pending requests the operator's list returns (the oldest).
const LIST_LIMIT: u32 = 1000;

pub(crate) async fn list_pending(State(core): State<Arc<Core>>, headers: HeaderMap) -> ApiResult {
    core.auth.operator(&headers)?;
    let records = core
        .db
        .list_in_state(OperationState::Pending, LIST_LIMIT)
        .await
        .map_err(ApiError::store)?;
    let requests: Vec<Value> = records.iter().map(OperationRecord::to_json).collect();
    Ok(json_response(StatusCode::OK, json!({"requests": requests})))
}

async fn decide(
    core: &Arc<Core>,
    headers: &HeaderMap,
    id: Result<Path<String>, PathRejection>,
    to: OperationState,
) -> ApiResult {
    core.auth.operator(headers)?;
    let id = &path_id(id)?;
    let not_pending = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "request_not_pending",
            "The request is not pending.",
        )
    };
    if core.db.get(id).await.map_err(ApiError::store)?.is_none() {
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
    match transition_to_end(core, op, to).await {
        Ok(record) => Ok(json_response(StatusCode::OK, record.to_json())),
        Err(TransitionFailure::NotAllowed(_)) => Err(not_pending()),
        Err(TransitionFailure::Store(err)) => Err(ApiError::store(err)),
    }
}

pub(crate) async fn approve(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    decide(&core, &headers, id, OperationState::Approved).await
}

pub(crate) async fn deny(
    State(core): State<Arc<Core>>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult {
    decide(&core, &headers, id, OperationState::Denied).await
}

/// `GET /api/operator/v1/drift` (operator): compares the controller's counts with the store now
/// and answers the report, `{"drift": N, "differences": [...]}` (see [`super::DriftReport::to_json`]).
pub(crate) async fn drift(State(core): State<Arc<Core>>, headers: HeaderMap) -> ApiResult {
    core.auth.operator(&headers)?;
    let report = super::drift::check(&core).await.map_err(ApiError::store)?;
    Ok(json_response(StatusCode::OK, report.to_json()))
}
