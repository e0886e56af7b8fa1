//! What each request is to the fairness layer (`crate::fairness`): exempt (a client's own, for
//! its cancels), a client's (and what it costs), or unkeyed. The router puts the library's
//! `FairnessLayer` in front of every route with [`classify`]; a refused request gets the layer's
//! default refusal, which already speaks the broker's envelope: `429 client_request_limit` with
//! `Retry-After` and `Cache-Control: no-store`.
//!
//! The bearer token is looked up here (the same constant-time lookup the `Client` extractor
//! makes) but never answered: a missing or bad token is [`Class::Unkeyed`], and the handler then
//! answers 401 or 403 as it always has.

use axum::extract::Query;
use axum::http::request::Parts;
use axum::http::{Method, header};

use super::extract::parse_integer;
use super::listing::DEFAULT_LIMIT;
use crate::core::Core;
use crate::fairness::Class;

/// The units one request costs, by route: 1 for reading one operation, a wait or a delete; 2 for
/// a submission or an upload (a body to read and a row to write), and one more for each
/// [`BODY_UNIT_BYTES`] its `Content-Length` declares, at most [`MAX_SIZE_COST`] more (a body is
/// read, parsed, digested and answered in proportion to its size: sixteen 1 MiB replays cost
/// what 144 small submissions do); `1 + limit/10` for a page of summaries.
const BODY_COST: u32 = 2;

/// The declared body bytes that cost one more unit.
const BODY_UNIT_BYTES: u64 = 64 << 10;

/// The most units a body's size adds: a whole 1 MiB submission's.
const MAX_SIZE_COST: u32 = 16;

/// What the request with head `head` is (on the agent listener; the operator listener has no
/// fairness layer, its requests take nothing from the clients' shares): health and readiness are
/// exempt; a client's cancel is exempt for that client (up to its share of them in flight); any
/// other request whose bearer token names a client is that client's; any other is unkeyed.
pub(crate) fn classify(core: &Core, head: &Parts) -> Class {
    let mut split = [""; SEGMENTS];
    let segments = segments_of(head.uri.path(), &mut split);
    if matches!(segments, ["healthz" | "readyz"]) {
        return Class::Exempt;
    }
    let cancel = head.method == Method::POST
        && matches!(segments, ["api", "agent", "v1", "operations", _, "cancel"]);
    let cost = cost(head, segments);
    let client = head
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|value| super::extract::bearer_secret(value.as_bytes()))
        .and_then(|token| core.auth.client(token));
    match client {
        Some(identity) if cancel => Class::ExemptClient {
            key: core.auth.key_of(identity),
        },
        Some(identity) => Class::Client {
            key: core.auth.key_of(identity),
            cost,
        },
        None => Class::Unkeyed { cost },
    }
}

/// The most path segments a classified route has, and one more.
const SEGMENTS: usize = 7;

/// `path`'s segments, split into `split` without allocating; a path of more segments than any
/// route has is none (it matches no route the classifier knows).
fn segments_of<'a>(path: &'a str, split: &'a mut [&'a str; SEGMENTS]) -> &'a [&'a str] {
    let mut n = 0;
    for segment in path.trim_matches('/').split('/') {
        if n == SEGMENTS {
            return &[];
        }
        split[n] = segment;
        n += 1;
    }
    &split[..n]
}

/// The units the request with head `head` (its path split into `segments`) costs.
fn cost(head: &Parts, segments: &[&str]) -> u32 {
    match (&head.method, segments) {
        (&Method::POST, ["api", "agent", "v1", "operations" | "streams"]) => {
            BODY_COST + size_cost(head)
        }
        // A `HEAD` is answered by the `GET` handler: it reads and renders the same page.
        (&Method::GET | &Method::HEAD, ["api", "agent", "v1", "operations"]) => {
            1 + page_limit(head) / 10
        }
        _ => 1,
    }
}

/// The units a body's declared size adds: a body that declares no length (chunked) may be a
/// whole submission, and the handler holds room for one while it reads it, so it costs that; a
/// bad length adds none (the handler answers it at once).
fn size_cost(head: &Parts) -> u32 {
    let Some(length) = head.headers.get(header::CONTENT_LENGTH) else {
        return MAX_SIZE_COST;
    };
    let declared = length
        .to_str()
        .ok()
        .and_then(|value| value.parse::<u64>().ok())
        .unwrap_or(0);
    u32::try_from(declared / BODY_UNIT_BYTES).map_or(MAX_SIZE_COST, |n| n.min(MAX_SIZE_COST))
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

#[cfg(test)]
mod tests {
    use axum::http::Request;

    use super::*;

    fn head(length: Option<&str>) -> Parts {
        let mut request = Request::post("/api/agent/v1/operations");
        if let Some(length) = length {
            request = request.header(header::CONTENT_LENGTH, length);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn a_path_splits_into_its_segments_and_a_longer_one_than_any_route_into_none() {
        let mut split = [""; SEGMENTS];
        assert_eq!(
            segments_of("/api/agent/v1/operations/op_1/cancel", &mut split),
            ["api", "agent", "v1", "operations", "op_1", "cancel"]
        );
        let mut split = [""; SEGMENTS];
        assert_eq!(segments_of("/healthz", &mut split), ["healthz"]);
        let mut split = [""; SEGMENTS];
        assert!(segments_of("/a/b/c/d/e/f/g/h", &mut split).is_empty());
        let mut split = [""; SEGMENTS];
        assert_eq!(segments_of("/a/b/c/d/e/f/g", &mut split).len(), 7);
    }

    #[test]
    fn a_body_costs_one_more_unit_per_64_kib_it_declares_up_to_a_whole_submission() {
        // Chunked, it may be a whole submission: the handler holds room for one.
        assert_eq!(size_cost(&head(None)), MAX_SIZE_COST);
        assert_eq!(size_cost(&head(Some("0"))), 0);
        assert_eq!(size_cost(&head(Some("300"))), 0);
        assert_eq!(size_cost(&head(Some("65536"))), 1);
        assert_eq!(size_cost(&head(Some("1048576"))), 16);
        assert_eq!(size_cost(&head(Some("536870912"))), MAX_SIZE_COST);
        assert_eq!(size_cost(&head(Some("99999999999999999999999"))), 0);
        assert_eq!(size_cost(&head(Some("ten"))), 0);
    }

    #[test]
    fn a_page_costs_the_same_asked_with_head_and_a_chunked_submission_a_whole_one() {
        let of = |method: Method, uri: &str, length: Option<&str>| {
            let mut request = Request::builder().method(method).uri(uri);
            if let Some(length) = length {
                request = request.header(header::CONTENT_LENGTH, length);
            }
            let head = request.body(()).unwrap().into_parts().0;
            let mut split = [""; SEGMENTS];
            cost(&head, segments_of(head.uri.path(), &mut split))
        };
        let page = "/api/agent/v1/operations?limit=50";
        assert_eq!(of(Method::GET, page, None), 6);
        assert_eq!(of(Method::HEAD, page, None), 6);
        let submit = "/api/agent/v1/operations";
        assert_eq!(of(Method::POST, submit, Some("300")), BODY_COST);
        assert_eq!(of(Method::POST, submit, None), BODY_COST + MAX_SIZE_COST);
        assert_eq!(
            of(Method::POST, submit, Some("1048576")),
            BODY_COST + MAX_SIZE_COST
        );
        assert_eq!(of(Method::GET, "/api/agent/v1/operations/op_1", None), 1);
    }
}
