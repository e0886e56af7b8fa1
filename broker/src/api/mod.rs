//! The HTTP surface, and the only part of the broker that knows HTTP and JSON: the router, and
//! below it one file per part of each wire contract (unYOLO Agent V1 and Operator V1).
//!
//! A submission goes authenticate → validate → replay → admit → create → commit: nothing that can
//! be refused without admission (a bad token, a bad body, a replay) reaches the controller, and a
//! refusal writes nothing. Cancel, operator decisions, reads, `/healthz`, `/readyz` and `/metrics`
//! never call admission. On the agent listener every error body is `{"error":{"code","message"}}`
//! and every response carries `Cache-Control: no-store`; the operator listener's routes are
//! under [`operator`], with Operator V1's envelope.
//!
//! Each mutating handler (submit, cancel, approve, deny, upload, delete) hands everything from its
//! decision on to a task of its own (`detached`, `Core::transition_to_end`) and only waits for
//! the answer, so a client that hangs up cannot leave a change half made (the broker module's docs
//! say what is atomic, route by route).
//!
//! What every handler shares is in leaves, which import no handler: `contract` (the contracts'
//! versions and digests, and the build id), [`error`] (the error envelope, `ApiError`, with
//! `From` the store's error) and `extract` (the client, the path id, the query and the body,
//! checked once; the operator's credential is `operator::credential`). Only this file imports
//! the handlers.

pub(crate) mod agent_operations;
mod contract;
pub(crate) mod detached;
pub mod discovery;
pub mod error;
pub mod events;
pub(crate) mod extract;
mod fairness;
mod health;
pub mod listing;
pub mod operator;
pub mod presentation;
pub mod projection;
pub mod ratelimit;
mod streams;
mod strict_json;
pub mod waits;

use std::sync::Arc;

use axum::Router;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{delete, get, post};

use crate::core::Core;
use crate::fairness::FairnessLayer;
use error::ApiError;

pub use agent_operations::{MAX_ARGUMENT_PROPERTIES, MAX_BODY_BYTES, MAX_TARGET_PROPERTIES};
pub use error::REFUSAL_MESSAGE;

/// The operator listener's routes (Operator V1, `/metrics`, `/admission/v1/drift`).
pub(crate) fn operator_router(core: Arc<Core>) -> Router {
    operator::router(core)
}

/// The agent listener's routes (Agent V1, `/healthz`, `/readyz`), with their state, behind the
/// fairness layer (`fairness::classify` says what each request is; a refusal is the layer's
/// default 429 `client_request_limit`, with the client's quota fields). No operator route and no `/metrics`: they are 404 here.
pub(crate) fn agent_router(core: Arc<Core>) -> Router {
    let classifier = Arc::clone(&core);
    let quotas = Arc::clone(&core);
    let fair = FairnessLayer::new(core.fairness.clone(), move |head: &Parts| {
        fairness::classify(&classifier, head)
    })
    .refusal_response(move |refusal| {
        // A client's request refused here still carries its quota fields, as every other 429
        // of a submission does, so a client reads one shape of refusal.
        let mut response = crate::fairness::default_refusal_response(refusal);
        if let Some(status) = refusal
            .client
            .as_deref()
            .and_then(|client| quotas.controller().quota(client))
        {
            ratelimit::insert_fields(response.headers_mut(), &status, None);
        }
        response
    });
    Router::new()
        .route("/.well-known/unyolo-agent", get(discovery::descriptor))
        .route(
            "/api/agent/v1/operations",
            post(agent_operations::submit).get(listing::list_operations),
        )
        .route(
            "/api/agent/v1/operations/{id}",
            get(agent_operations::get_own),
        )
        .route(
            "/api/agent/v1/operations/{id}/events",
            get(waits::wait_for_change),
        )
        .route(
            "/api/agent/v1/operations/{id}/cancel",
            post(agent_operations::cancel),
        )
        .route("/api/agent/v1/streams", post(streams::upload_stream))
        .route("/api/agent/v1/streams/{id}", delete(streams::delete_stream))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "No such route.") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "This route does not take that method.",
            )
        })
        .layer(axum::middleware::map_response(no_store))
        .layer(fair)
        .with_state(core)
}

async fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
