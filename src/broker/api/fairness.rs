//! What each request is to the fairness layer (`crate::fairness`): exempt, a client's (and what
//! it costs), or unkeyed. The router puts the library's `FairnessLayer` in front of every route
//! with [`classify`]; a refused request gets the layer's default refusal, which already speaks
//! the broker's envelope: `429 client_request_limit` with `Retry-After` and
//! `Cache-Control: no-store`.
//!
//! The bearer token is looked up here (the same constant-time lookup the `Client` extractor
//! makes) but never answered: a missing or bad token is [`Class::Unkeyed`], and the handler then
//! answers 401 or 403 as it always has.

use axum::extract::Query;
use axum::http::request::Parts;
use axum::http::{Method, header};

use super::extract::parse_integer;
use super::listing::DEFAULT_LIMIT;
use crate::broker::core::Core;
use crate::fairness::Class;

/// The units one request costs, by route: 1 for reading one operation, a wait or a delete; 2 for
/// a submission or an upload (a body to read and a row to write); `1 + limit/10` for a page of
/// summaries.
const BODY_COST: u32 = 2;

/// What the request with head `head` is (on the agent listener; the operator listener has no
/// fairness layer, its requests take nothing from the clients' shares): health, readiness and
/// cancellation are exempt; a request whose bearer token names a client is that client's; any
/// other is unkeyed.
pub(crate) fn classify(core: &Core, head: &Parts) -> Class {
    let path = head.uri.path();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let exempt = match segments.as_slice() {
        ["healthz" | "readyz"] => true,
        ["api", "agent", "v1", "operations", _, "cancel"] => head.method == Method::POST,
        _ => false,
    };
    if exempt {
        return Class::Exempt;
    }
    let cost = match (&head.method, segments.as_slice()) {
        (&Method::POST, ["api", "agent", "v1", "operations" | "streams"]) => BODY_COST,
        (&Method::GET, ["api", "agent", "v1", "operations"]) => 1 + page_limit(head) / 10,
        _ => 1,
    };
    let client = head
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "))
        .and_then(|token| core.auth.client(token));
    match client {
        Some(identity) => Class::client(identity.as_str(), cost),
        None => Class::Unkeyed { cost },
    }
}

/// The `limit` of a listing's query, or the default when it is absent or not a number (the
/// handler answers 400 for a bad one; it costs the default here).
fn page_limit(head: &Parts) -> u32 {
    Query::<Vec<(String, String)>>::try_from_uri(&head.uri)
        .ok()
        .and_then(|Query(pairs)| {
            let (_, limit) = pairs.into_iter().find(|(name, _)| name == "limit")?;
            u32::try_from(parse_integer(&limit)?).ok()
        })
        .unwrap_or(DEFAULT_LIMIT)
}
