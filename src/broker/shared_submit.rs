//! A submission on one replica of several: the shared decision (Redis) first, then this
//! replica's own, then the creation as on a lone broker. Runs detached (see `http::submit`), under
//! the per-key lock and the counts gate, so a client hanging up never strands a reservation.

use std::sync::Arc;

use axum::http::StatusCode;

use super::agent_operations::{Submission, create, refused, replay};
use super::http::{ApiError, ApiResult};
use super::shared::SharedAdmit;
use super::{Core, new_id};
use crate::config::Identity;

/// Admits `request` through the shared controller and this replica's, then creates it.
pub(crate) async fn submit(
    core: Arc<Core>,
    client: Identity,
    request: Submission,
    needs_approval: bool,
) -> ApiResult {
    let id = new_id("op");
    let key = request.idempotency_key.clone();
    match core
        .shared
        .admit(client.as_str(), needs_approval, &id, &key)
        .await
    {
        SharedAdmit::Admitted(shared) => {
            let permit = match core.controller.admit(client.as_str(), needs_approval) {
                Ok(permit) => permit,
                Err(refusal) => {
                    // This replica's counts are a part of the shared ones, so this is rare (a
                    // rate bucket read on another clock): the shared reservation goes back whole.
                    shared.refund().await;
                    return Ok(refused(&core, &client, refusal));
                }
            };
            create(core, client, request, permit, needs_approval, id, shared).await
        }
        SharedAdmit::Refused(refusal) => Ok(refused(&core, &client, refusal)),
        SharedAdmit::Replay { operation, replica } => {
            if let Some(existing) = core
                .db
                .find_by_key(client.as_str(), &key)
                .await
                .map_err(ApiError::store)?
            {
                return replay(&core, existing, &request);
            }
            Err(ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_key_elsewhere",
                format!(
                    "This idempotency key names operation {operation}, held by broker replica \
                     {replica}; its reads, waits and cancels are answered there."
                ),
            ))
        }
        SharedAdmit::Unavailable { retry_after } => {
            core.count_submission("rejected");
            Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "admission_unavailable",
                "Admission cannot be decided right now (the shared quota store does not answer); \
                 retry later.",
            )
            .with_retry_after(retry_after.max(1)))
        }
    }
}
