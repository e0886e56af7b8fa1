//! What the Operator V1 suites (`broker_operator_v1*.rs`) share: the request list's path, a
//! quota file with one execution slot, a pending request, a held slot, a decision's body, a
//! page's ids and the contract's order of them.

use serde_json::{Value, json};

use super::broker::Harness;
use super::eventually::eventually;
use super::http::{Reply, request};
use super::secrets::AGENT_SECRET;

/// The Operator V1 request list.
pub const REQUESTS: &str = "/api/operator/v1/requests";

/// One execution slot: a long run holds it, so approved requests stay queued (`active`, revocable).
pub const ONE_SLOT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 1}"#;

/// A `demo.request` submitted under `key`, pending; its id.
pub async fn pending_request(h: &Harness, key: &str) -> String {
    let reply = h
        .submit(AGENT_SECRET, &request(key, "demo.request", 0))
        .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    reply.id()
}

/// Fills the one execution slot with a ten-minute run.
pub async fn hold_the_slot(h: &Harness) -> String {
    let run = h
        .submit(AGENT_SECRET, &request("long-run", "demo.run", 600_000))
        .await;
    assert_eq!(run.status, 202, "{}", run.body);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    run.id()
}

/// A decision's body: the revision it expects and its idempotency key.
pub fn decision(revision: u64, key: &str) -> Value {
    json!({"expected_revision": revision, "idempotency_key": key})
}

/// The ids of a page of requests, in its order.
pub fn ids(page: &Reply) -> Vec<String> {
    page.body["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

/// `ids` in the contract's order, newest `requested_at` first, ties by id (both descending).
pub async fn newest_first(h: &Harness, ids: &[&String]) -> Vec<String> {
    let mut keyed = Vec::new();
    for id in ids {
        let at = h.operator.request(id).await.body["requested_at"]
            .as_str()
            .unwrap()
            .to_owned();
        keyed.push((at, (*id).clone()));
    }
    keyed.sort_unstable_by(|a, b| b.cmp(a));
    keyed.into_iter().map(|(_, id)| id).collect()
}

/// The Agent V1 path of operation `id`.
pub fn agent_op(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

/// The error upstream's Agent V1 runtime gives an operation canceled by its client or revoked
/// by an operator.
pub fn canceled_error() -> Value {
    json!({"code": "operation_canceled", "message": "Request was canceled"})
}
