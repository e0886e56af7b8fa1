//! Fair to the others: one client cannot take a server's own capacity.
//!
//! Admission guards what a client may *create*; this module guards what a client may *ask for at
//! once*, in the spirit of Kubernetes' API Priority and Fairness. Every request costs units (a
//! `GET` one, a page of heavy rows more). Each authenticated client holds at most
//! [`FairnessConfig::per_client_units`] at once, out of a pool all clients share; a request over
//! its client's share (or over the pool) waits briefly in its client's queue — first in, first
//! out within a client, round-robin across clients — and otherwise gets `429` with `Retry-After`.
//! Exempt requests (health, readiness, cancellation, operator decisions, metrics) never wait and
//! are never refused, and part of the total ([`FairnessConfig::exempt_reserved_units`]) is theirs
//! alone: no client's load can take it. A client's own exempt requests ([`Class::ExemptClient`],
//! its cancels) are exempt up to its share of them in flight, so they cannot take the pool either.
//!
//! Units are held until the response body has ended or been dropped, not merely until the handler
//! returns: a long-poll or a streamed download counts for as long as it lives.
//!
//! - [`share`]'s [`Fairness`] is the scheduler: shares, pool, reserve, queues, and the metrics
//!   ([`Fairness::register`]). It knows nothing of HTTP.
//! - [`FairnessLayer`] puts it in front of any tower service, axum routers included. *How to find
//!   the client* and *what a request costs* are the embedder's: a classifier from the request
//!   head to a [`Class`]. Classify after authentication (or authenticate in the classifier): a
//!   key must come from a bounded set of clients; a request with no valid credential is
//!   [`Class::Unkeyed`], and all of those share one share.
//! - [`FairnessLayer::refusal_response`] makes a refusal speak the server's own error envelope;
//!   the default ([`default_refusal_response`]) is
//!   `{"error":{"code":"client_request_limit","message":"..."}}`.
//!
//! - [`ByteBudget`] bounds what fairness does not: the bytes held buffered for all requests at
//!   once (bodies being read, rows being rendered). A [`BytesReservation`] holds its bytes until
//!   it drops; past the budget a new one waits briefly or is refused
//!   (`broker_buffered_bytes`, `broker_buffered_bytes_refused_total`). A rendered answer keeps
//!   its reservation until it has been sent ([`BytesReservation::hold`], a [`HeldBytes`] body).
//!
//! # In front of an axum router
//!
//! ```
//! use axum::Router;
//! use axum::http::{Request, StatusCode};
//! use axum::routing::get;
//! use tower::ServiceExt;
//! use unyolo_admission_broker::fairness::{Class, Fairness, FairnessConfig, FairnessLayer};
//!
//! let fairness = Fairness::new(FairnessConfig::default()).expect("valid numbers");
//! let layer = FairnessLayer::new(fairness.clone(), |head: &axum::http::request::Parts| {
//!     if head.uri.path() == "/healthz" {
//!         return Class::Exempt;
//!     }
//!     // A real server maps the bearer token to the client it authenticates.
//!     match head.headers.get("x-client").and_then(|v| v.to_str().ok()) {
//!         Some(client) if head.uri.path() == "/report" => Class::client(client, 8),
//!         Some(client) => Class::client(client, 1),
//!         None => Class::Unkeyed { cost: 1 },
//!     }
//! });
//! let app = Router::new()
//!     .route("/healthz", get(|| async { "ok" }))
//!     .route("/report", get(|| async { "a heavy page" }))
//!     .layer(layer);
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let request = Request::get("/report").header("x-client", "bot-7").body(axum::body::Body::empty());
//! let response = app.oneshot(request.unwrap()).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! // The response is done (its body dropped): the client's units are back.
//! drop(response);
//! assert!(fairness.snapshot().is_idle());
//! # });
//! ```
//!
//! Serve it as usual (`axum::serve(listener, app)`), and export the metrics with
//! [`Fairness::register`] in the server's registry.

pub mod share;

mod budget;
mod layer;

pub use budget::{BudgetRefusal, ByteBudget, BytesReservation, HELD_FRAME_BYTES, HeldBytes};
pub use layer::{FairBody, FairnessLayer, FairnessService, REFUSAL_CODE, default_refusal_response};
pub use share::{
    Class, Fairness, FairnessConfig, FairnessRefusal, FairnessSnapshot, FlowSnapshot,
    RefusalReason, UNKEYED_LABEL, UnitsPermit,
};

#[cfg(test)]
mod tests;
