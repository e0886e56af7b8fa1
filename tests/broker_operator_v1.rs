//! The operator listener speaks unYOLO's Operator V1 exactly (SPEC section 8): discovery, health,
//! readiness, the request list with every filter and cursors bound to their query, one request,
//! decisions in the contract's order (body, idempotency, lookup, revision, token, transition,
//! constraints), the projection of each state, and the error envelope with its closed codes.
//! Every reply is checked against the vendored contract's schemas and the common headers
//! (`support::operator::check_reply`); bad input is checked to change nothing.
#![cfg(feature = "broker")]

mod support;

use std::time::Duration;

use base64::Engine;
use serde_json::{Value, json};
use support::broker::{Harness, ROOMY, assert_unchanged, settings, start, start_with};
use support::events::open;
use support::eventually::eventually;
use support::faults::lock_store;
use support::http::{Reply, request};
use support::secrets::{
    AGENT, AGENT_SECRET, OPERATOR, OPERATOR_SECRET, OTHER, OTHER_OPERATOR, OTHER_OPERATOR_SECRET,
    OTHER_SECRET,
};
use unyolo_admission::StorageCaps;
use unyolo_admission::broker::store::events::decode_cursor;

const REQUESTS: &str = "/api/operator/v1/requests";

/// One execution slot: a long run holds it, so approved requests stay queued (`active`, revocable).
const ONE_SLOT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 1}"#;

async fn pending_request(h: &Harness, key: &str) -> String {
    let reply = h
        .submit(AGENT_SECRET, &request(key, "demo.request", 0))
        .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    reply.id()
}

/// Fills the one execution slot with a ten-minute run.
async fn hold_the_slot(h: &Harness) -> String {
    let run = h
        .submit(AGENT_SECRET, &request("long-run", "demo.run", 600_000))
        .await;
    assert_eq!(run.status, 202, "{}", run.body);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    run.id()
}

fn decision(revision: u64, key: &str) -> Value {
    json!({"expected_revision": revision, "idempotency_key": key})
}

fn ids(page: &Reply) -> Vec<String> {
    page.body["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

/// `ids` in the contract's order, newest `requested_at` first, ties by id (both descending).
async fn newest_first(h: &Harness, ids: &[&String]) -> Vec<String> {
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

fn agent_op(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

/// The error upstream's Agent V1 runtime gives an operation canceled by its client or revoked
/// by an operator.
fn canceled_error() -> Value {
    json!({"code": "operation_canceled", "message": "Request was canceled"})
}

#[tokio::test]
async fn discovery_health_and_readiness_name_the_operator_v1_contract() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let found = h.operator.get("/.well-known/unyolo-operator").await;
    assert_eq!(found.status, 200);
    assert_eq!(found.body["api_version"], "unyolo.io/operator/v1");
    assert_eq!(
        found.body["contract_digest"],
        "sha256:ab10778e2838f660157b000e442a1b97c5217fd92e66107122451b6894f0b9d3"
    );
    assert_eq!(
        found.body["build_id"],
        unyolo_admission::broker::discovery::BUILD_ID
    );
    let anonymous = h
        .operator
        .send_raw("GET", "/.well-known/unyolo-operator", None, None)
        .await;
    assert_eq!((anonymous.status, anonymous.code()), (401, "unauthorized"));
    assert_eq!(
        anonymous.body["error"]["message"],
        "operator authentication required"
    );
    for path in ["/healthz", "/readyz"] {
        let reply = h.operator.send_raw("GET", path, None, None).await;
        assert_eq!(reply.status, 200, "{path}");
        assert_eq!(reply.body["status"], "ok");
        assert_eq!(reply.body["contract_digest"], found.body["contract_digest"]);
    }
    // Not ready while another process holds the store's write lock; ready once it lets go.
    let holder = lock_store(dir.path(), Duration::from_secs(3));
    let busy = h.operator.send_raw("GET", "/readyz", None, None).await;
    assert_eq!((busy.status, busy.code()), (503, "temporarily_unavailable"));
    assert_eq!(
        busy.body["error"]["message"],
        "operator source is not ready"
    );
    assert_eq!(busy.header("retry-after"), None);
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    let ready = h.operator.send_raw("GET", "/readyz", None, None).await;
    assert_eq!(ready.status, 200);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn bearer_or_basic_in_any_case_names_the_operator_who_decides() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "who").await;
    let basic =
        base64::engine::general_purpose::STANDARD.encode(format!("anyone:{OTHER_OPERATOR_SECRET}"));
    for auth in [
        format!("Bearer {OPERATOR_SECRET}"),
        format!("bearer {OPERATOR_SECRET}"),
        format!("BEARER   {OPERATOR_SECRET}  "),
        format!("Basic {basic}"),
        format!("bAsIc {basic}"),
    ] {
        let reply = h
            .operator
            .send_raw("GET", REQUESTS, Some(&auth), None)
            .await;
        assert_eq!(reply.status, 200, "{auth}");
    }
    for auth in [
        format!("Bearer {AGENT_SECRET}"),
        format!("Bearer {}", &OPERATOR_SECRET[1..]),
        format!("Token {OPERATOR_SECRET}"),
        format!("Basic {OPERATOR_SECRET}"),
        "Bearer".to_owned(),
    ] {
        let reply = h
            .operator
            .send_raw("GET", REQUESTS, Some(&auth), None)
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (401, "unauthorized"),
            "{auth}"
        );
        assert_eq!(
            reply.header("www-authenticate"),
            Some(r#"Bearer realm="broker-operator""#)
        );
    }
    // The matched name is the actor.
    let path = format!("{REQUESTS}/{id}/deny");
    let body =
        json!({"expected_revision": 1, "idempotency_key": "k", "on_behalf_of": "telegram:42"});
    let denied = h
        .operator
        .send_raw(
            "POST",
            &path,
            Some(&format!("Basic {basic}")),
            Some(("application/json", body.to_string().into_bytes())),
        )
        .await;
    assert_eq!(denied.status, 200, "{}", denied.body);
    assert_eq!(denied.body["decided_by"], OTHER_OPERATOR);
    assert_eq!(denied.body["decided_on_behalf_of"], "telegram:42");
    h.broker.shutdown().await;
}

#[tokio::test]
async fn every_answer_has_a_fresh_correlation_id_and_every_error_the_closed_envelope() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let a = h.operator.get(REQUESTS).await;
    let b = h.operator.get(REQUESTS).await;
    assert_ne!(a.header("x-correlation-id"), b.header("x-correlation-id"));
    let cases = [
        (
            "GET",
            "/nowhere".to_owned(),
            404,
            "not_found",
            "route not found",
        ),
        (
            "DELETE",
            REQUESTS.to_owned(),
            405,
            "method_not_allowed",
            "method not allowed",
        ),
        (
            "GET",
            format!("{REQUESTS}/op_unknown"),
            404,
            "not_found",
            "request not found",
        ),
        (
            "GET",
            format!("{REQUESTS}/{}", "x".repeat(129)),
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "POST",
            format!("{REQUESTS}/op_unknown/cancel"),
            404,
            "not_found",
            "route not found",
        ),
    ];
    for (method, path, status, code, message) in cases {
        let auth = format!("Bearer {OPERATOR_SECRET}");
        let reply = h.operator.send_raw(method, &path, Some(&auth), None).await;
        assert_eq!(
            (reply.status, reply.code()),
            (status, code),
            "{method} {path}"
        );
        assert_eq!(reply.body["error"]["message"], message, "{method} {path}");
        assert!(reply.body["error"].get("current").is_none());
    }
    // An unknown action is looked at only after the credential.
    let stranger = h
        .operator
        .send_raw("POST", &format!("{REQUESTS}/op_unknown/cancel"), None, None)
        .await;
    assert_eq!(stranger.status, 401);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn the_list_filters_by_status_group_requester_operation_and_target() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ONE_SLOT, StorageCaps::default())).await;
    let pending = pending_request(&h, "pending").await;
    let other = h
        .submit(OTHER_SECRET, &request("pending", "demo.request", 0))
        .await
        .id();
    let mut elsewhere = request("elsewhere", "demo.request", 0);
    elsewhere["target"] = json!({"repo": "elsewhere", "draft": true, "pr": 12, "note": null});
    let elsewhere = h.submit(AGENT_SECRET, &elsewhere).await.id();
    let queued = pending_request(&h, "queued").await;
    let denied = pending_request(&h, "denied").await;
    // Submitted last: a saturated execution pool refuses new work.
    let run = hold_the_slot(&h).await;
    assert_eq!(h.operator.approve(&queued).await.status, 200);
    assert_eq!(h.operator.deny(&denied).await.status, 200);
    let list = async |query: &str| ids(&h.operator.get(&format!("{REQUESTS}?{query}")).await);
    // Newest first; never the run (it needs no approval).
    let all = list("").await;
    assert_eq!(
        all,
        newest_first(&h, &[&denied, &queued, &elsewhere, &other, &pending]).await
    );
    assert!(!all.contains(&run));
    assert_eq!(list("status=all").await, all);
    assert_eq!(
        list("status=pending").await,
        newest_first(&h, &[&elsewhere, &other, &pending]).await
    );
    assert_eq!(list("status=active").await, std::slice::from_ref(&queued));
    assert_eq!(list("status=history").await, std::slice::from_ref(&denied));
    assert_eq!(
        list(&format!("requester={OTHER}")).await,
        std::slice::from_ref(&other)
    );
    assert_eq!(list("requester=nobody").await, Vec::<String>::new());
    assert_eq!(list("operation=demo.request").await, all);
    assert_eq!(list("operation=demo.run").await, Vec::<String>::new());
    assert_eq!(list("target_kind=demo").await, all);
    assert_eq!(list("target_kind=github").await, Vec::<String>::new());
    assert_eq!(
        list("target_kind=demo&target.repo=elsewhere").await,
        std::slice::from_ref(&elsewhere)
    );
    assert_eq!(
        list("status=pending&target_kind=demo&target.repo=unyolo/test&target.branch=main").await,
        newest_first(&h, &[&other, &pending]).await
    );
    // A scalar matches by its JSON text (before: `true` matched only as `1`, `null` never).
    for query in ["target.draft=true", "target.pr=12", "target.note=null"] {
        assert_eq!(
            list(&format!("target_kind=demo&{query}")).await,
            std::slice::from_ref(&elsewhere),
            "{query}"
        );
    }
    for query in ["target.draft=1", "target.draft=false", "target.repo=null"] {
        assert_eq!(
            list(&format!("target_kind=demo&{query}")).await,
            Vec::<String>::new(),
            "{query}"
        );
    }
    // A field's values are a set: a repeat changes nothing, two values match nothing here.
    assert_eq!(
        list("target_kind=demo&target.repo=elsewhere&target.repo=elsewhere").await,
        std::slice::from_ref(&elsewhere)
    );
    assert_eq!(
        list("target_kind=demo&target.repo=elsewhere&target.repo=unyolo/test").await,
        Vec::<String>::new()
    );
    h.broker.shutdown().await;
}

#[tokio::test]
async fn pages_run_newest_first_and_a_cursor_only_continues_its_own_query() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(pending_request(&h, &format!("page-{i}")).await);
    }
    let created = newest_first(&h, &made.iter().collect::<Vec<_>>()).await;
    let mut seen = Vec::new();
    let mut cursor = String::new();
    let mut pages = 0;
    loop {
        let page = h
            .operator
            .get(&format!(
                "{REQUESTS}?status=pending&limit=2&cursor={cursor}"
            ))
            .await;
        assert_eq!(page.status, 200);
        pages += 1;
        // The events branch fills `event_cursor` (first pages only); never on a later page.
        if pages > 1 {
            assert!(page.body.get("event_cursor").is_none(), "{}", page.body);
        }
        seen.extend(ids(&page));
        match page.body["next_cursor"].as_str() {
            Some(next) => {
                assert!(next.len() <= 1024);
                cursor = next.to_owned();
            }
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, created);
    // The first page's cursor, asked for under another query, is refused.
    let first = h
        .operator
        .get(&format!("{REQUESTS}?status=pending&limit=2"))
        .await;
    let cursor = first.body["next_cursor"].as_str().unwrap();
    for other in [
        format!("status=all&limit=2&cursor={cursor}"),
        format!("status=pending&limit=3&cursor={cursor}"),
        format!("status=pending&requester=agent&limit=2&cursor={cursor}"),
    ] {
        let reply = h.operator.get(&format!("{REQUESTS}?{other}")).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{other}"
        );
    }
    // 0 is the default of 50; 100 the largest.
    let everything = h.operator.get(&format!("{REQUESTS}?limit=0")).await;
    assert_eq!(ids(&everything), created);
    assert!(everything.body.get("next_cursor").is_none());
    h.broker.shutdown().await;
}

#[tokio::test]
async fn bad_list_queries_are_400_before_the_credential_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    pending_request(&h, "one").await;
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    for query in [
        "state=pending",
        "status=pending&status=active",
        "limit=1&limit=2",
        "status=done",
        "limit=101",
        "limit=-1",
        "limit=1.5",
        "target.=x",
        "target.repo=demo",
        "target_kind=demo&target.repo=",
        "cursor=garbage",
        &format!("requester={}", "r".repeat(129)),
        &format!("cursor={}", "c".repeat(1025)),
    ] {
        for auth in [Some(format!("Bearer {OPERATOR_SECRET}")), None] {
            let reply = h
                .operator
                .send_raw("GET", &format!("{REQUESTS}?{query}"), auth.as_deref(), None)
                .await;
            assert_eq!(
                (reply.status, reply.code()),
                (400, "invalid_request"),
                "{query}"
            );
            assert_eq!(reply.body["error"]["message"], "request is invalid");
        }
    }
    assert_eq!(h.rows().await, rows);
    assert_unchanged(&snapshot, &h.snapshot(), "a bad query changed something");
    h.broker.shutdown().await;
}

#[tokio::test]
async fn one_request_reads_back_and_an_operation_without_approval_is_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "one").await;
    let one = h.operator.request(&id).await;
    assert_eq!(one.status, 200);
    let listed = h.operator.get(REQUESTS).await;
    assert_eq!(listed.body["requests"][0], one.body);
    let run = h
        .submit(AGENT_SECRET, &request("run", "demo.run", 0))
        .await
        .id();
    for unknown in [run.as_str(), "op_nothing"] {
        let reply = h.operator.request(unknown).await;
        assert_eq!((reply.status, reply.code()), (404, "not_found"));
        let decided = h
            .operator
            .decide(unknown, "approve", &decision(1, "k"))
            .await;
        assert_eq!((decided.status, decided.code()), (404, "not_found"));
    }
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn each_state_projects_onto_the_specs_request() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ONE_SLOT, StorageCaps::default())).await;
    let id = pending_request(&h, "p").await;
    let agent = h.get(&agent_op(&id), Some(AGENT_SECRET)).await;
    assert_eq!(agent.body["approval_id"], id);
    let pending = h.operator.request(&id).await.body;
    assert_eq!(pending["status"], "pending");
    assert_eq!(pending["requester"], AGENT);
    assert_eq!(pending["operation"], "demo.request");
    assert_eq!(pending["mode"], "execution");
    assert_eq!(pending["revision"], 1);
    assert_eq!(pending["requested_at"], agent.body["created_at"]);
    assert_eq!(pending["requested_duration_seconds"], 300);
    assert_eq!(pending["requested_max_uses"], 1);
    assert_eq!(pending["granted_max_uses"], 1);
    assert_eq!(pending["used_count"], 0);
    assert_eq!(pending["allowed_actions"], json!(["approve", "deny"]));
    assert_eq!(
        pending["approval_bounds"],
        json!({"max_duration_seconds": 300, "max_uses": 1})
    );
    assert_eq!(pending["request_reason"], "end-to-end test");
    assert_eq!(
        pending["presentation"]["target"],
        "branch=main, repo=unyolo/test"
    );
    let created = humantime::parse_rfc3339(agent.body["created_at"].as_str().unwrap()).unwrap();
    let expires =
        humantime::parse_rfc3339(pending["pending_expires_at"].as_str().unwrap()).unwrap();
    assert_eq!(
        expires.duration_since(created).unwrap(),
        Duration::from_secs(300)
    );
    assert!(pending.get("decided_at").is_none());

    // Canceled by its client from pending: canceled, decided by the client.
    let canceled = h
        .post(&format!("{}/cancel", agent_op(&id)), Some(AGENT_SECRET))
        .await;
    assert_eq!(canceled.state(), "canceled");
    assert_eq!(canceled.body["error"], canceled_error());
    let shown = h.operator.request(&id).await.body;
    assert_eq!(
        (shown["status"].as_str(), shown["decided_by"].as_str()),
        (Some("canceled"), Some(AGENT))
    );
    assert!(shown.get("approval_bounds").is_none() && shown.get("pending_expires_at").is_none());

    // Approved and queued: active, revocable; canceled by its client then: revoked.
    let queued = pending_request(&h, "q").await;
    let long = h
        .submit(
            AGENT_SECRET,
            &request("long-request", "demo.request", 600_000),
        )
        .await
        .id();
    let quick = pending_request(&h, "quick").await;
    let run = hold_the_slot(&h).await;
    let approved = h.operator.approve(&queued).await.body;
    assert_eq!(approved["status"], "active");
    assert_eq!(approved["allowed_actions"], json!(["revoke"]));
    assert_eq!(approved["decided_by"], OPERATOR);
    assert!(approved["decided_at"].is_string());
    assert!(approved.get("decided_on_behalf_of").is_none());
    let canceled = h
        .post(&format!("{}/cancel", agent_op(&queued)), Some(AGENT_SECRET))
        .await;
    assert_eq!(canceled.state(), "canceled");
    assert_eq!(canceled.body["error"], canceled_error());
    let revoked = h.operator.request(&queued).await.body;
    assert_eq!(
        (revoked["status"].as_str(), revoked["decided_by"].as_str()),
        (Some("revoked"), Some(AGENT))
    );

    // Executing: active with no action; revoke is an invalid transition.
    let running = h.operator.request(&run).await;
    assert_eq!(running.status, 404, "a run is no request");
    assert_eq!(h.operator.approve(&long).await.status, 200);
    // A second execution slot (a reload) lets it start.
    let roomy = dir.path().join("roomy.json");
    std::fs::write(&roomy, ROOMY).unwrap();
    h.broker.reload_from_path(&roomy).unwrap();
    assert!(
        eventually(async || h.operator.request(&long).await.body["allowed_actions"] == json!([]))
            .await
    );
    let executing = h.operator.request(&long).await.body;
    assert_eq!(executing["status"], "active");
    let revoke = h.operator.revoke(&long).await;
    assert_eq!((revoke.status, revoke.code()), (409, "invalid_transition"));

    // Succeeded: consumed, used once.
    h.operator.approve(&quick).await;
    assert!(
        eventually(async || h.operator.request(&quick).await.body["status"] == "consumed").await
    );
    let consumed = h.operator.request(&quick).await.body;
    assert_eq!(consumed["used_count"], 1);
    assert_eq!(consumed["decided_by"], OPERATOR);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn the_conformance_lifecycle_approve_replay_conflict_stale_revoke_revoke() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ONE_SLOT, StorageCaps::default())).await;
    let id = pending_request(&h, "lifecycle").await;
    hold_the_slot(&h).await;
    let pending = h.operator.get(&format!("{REQUESTS}?status=pending")).await;
    assert_eq!(ids(&pending), std::slice::from_ref(&id));
    let approve = decision(1, "conformance-approve");
    let approved = h.operator.decide(&id, "approve", &approve).await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    assert_eq!(approved.body["status"], "active");
    assert_eq!(approved.header("idempotency-replayed"), None);
    let replay = h.operator.decide(&id, "approve", &approve).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotency-replayed"), Some("true"));
    assert_eq!(replay.body, approved.body);
    // Empty constraints are none, as unYOLO's Go client sends them: the same command, replayed
    // (before: 409 `idempotency_conflict`).
    let mut empty = approve.clone();
    empty["constraints"] = json!({});
    let replay = h.operator.decide(&id, "approve", &empty).await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.header("idempotency-replayed"), Some("true"));
    assert_eq!(replay.body, approved.body);
    let mut changed = approve.clone();
    changed["on_behalf_of"] = json!("changed");
    let conflict = h.operator.decide(&id, "approve", &changed).await;
    assert_eq!(
        (conflict.status, conflict.code()),
        (409, "idempotency_conflict")
    );
    assert!(conflict.body["error"].get("current").is_none());
    // Another operator with the same key: another command, a conflict too.
    let grace = h.operator_with(OTHER_OPERATOR_SECRET);
    let theirs = grace.decide(&id, "approve", &approve).await;
    assert_eq!(
        (theirs.status, theirs.code()),
        (409, "idempotency_conflict")
    );
    let detail = h.operator.request(&id).await.body;
    assert_eq!(detail["status"], "active");
    assert!(detail["revision"].as_u64().unwrap() > 1);
    let stale = h
        .operator
        .decide(&id, "revoke", &decision(1, "conformance-stale-revoke"))
        .await;
    assert_eq!((stale.status, stale.code()), (409, "revision_conflict"));
    assert_eq!(
        stale.body["error"]["message"],
        "request changed; refresh before deciding"
    );
    assert_eq!(stale.body["error"]["current"], detail);
    let revision = detail["revision"].as_u64().unwrap();
    let revoked = h
        .operator
        .decide(&id, "revoke", &decision(revision, "conformance-revoke"))
        .await;
    assert_eq!(revoked.status, 200, "{}", revoked.body);
    assert_eq!(revoked.body["status"], "revoked");
    assert_eq!(revoked.body["revision"], revision + 1);
    // Agent V1 sees its operation canceled, as upstream's runtime reports a revoke, its slots
    // released.
    let op = h.get(&agent_op(&id), Some(AGENT_SECRET)).await;
    assert_eq!(op.state(), "canceled");
    assert_eq!(op.body["error"], canceled_error());
    assert_eq!(h.snapshot().queued, 0);
    // The same key under another action is another scope: here a stale one.
    let again = h.operator.decide(&id, "deny", &approve).await;
    assert_eq!((again.status, again.code()), (409, "revision_conflict"));
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 2);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_replay_answers_what_its_decision_committed_not_what_the_request_became() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "replayed").await;
    let body = decision(1, "once");
    let approved = h.operator.decide(&id, "approve", &body).await;
    assert_eq!(approved.body["status"], "active");
    assert!(eventually(async || h.operator.request(&id).await.body["status"] == "consumed").await);
    let replay = h.operator.decide(&id, "approve", &body).await;
    assert_eq!(replay.header("idempotency-replayed"), Some("true"));
    assert_eq!(replay.body, approved.body);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_decision_needs_a_json_content_type_and_the_contracts_strict_body() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "strict").await;
    let path = format!("{REQUESTS}/{id}/approve");
    let auth = format!("Bearer {OPERATOR_SECRET}");
    let good = decision(1, "k").to_string().into_bytes();
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    for content_type in [
        "",
        "text/plain",
        "application/jsonx",
        "application/x-www-form-urlencoded",
    ] {
        let reply = h
            .operator
            .send_raw(
                "POST",
                &path,
                Some(&auth),
                Some((content_type, good.clone())),
            )
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (415, "invalid_request"),
            "{content_type:?}"
        );
        assert_eq!(
            reply.body["error"]["message"],
            "content type must be application/json"
        );
    }
    let mut huge = decision(1, "k");
    huge["on_behalf_of"] = json!("x".repeat(96 * 1024));
    for (body, message) in [
        (b"{".to_vec(), "decision body is invalid"),
        (b"".to_vec(), "decision body is invalid"),
        // No key: the body decodes, and the command does not normalize, as upstream judges it.
        (br#"{"expected_revision":1}"#.to_vec(), "request is invalid"),
        (br#"{"expected_revision":0,"idempotency_key":"k"}"#.to_vec(), "request is invalid"),
        (
            br#"{"expected_revision":1,"idempotency_key":"k","why":"x"}"#.to_vec(),
            "decision body is invalid",
        ),
        (
            br#"{"expected_revision":1,"expected_revision":1,"idempotency_key":"k"}"#.to_vec(),
            "decision body is invalid",
        ),
        (
            br#"{"expected_revision":1,"idempotency_key":"k"}{}"#.to_vec(),
            "decision body is invalid",
        ),
        (
            br#"{"expected_revision":1,"idempotency_key":"k","constraints":{"duration_seconds":0}}"#
                .to_vec(),
            "decision body is invalid",
        ),
        (
            br#"{"expected_revision":1,"idempotency_key":"k","constraints":{"max_uses":0}}"#
                .to_vec(),
            "decision body is invalid",
        ),
        (huge.to_string().into_bytes(), "decision body is invalid"),
        (
            br#"{"expected_revision":1,"idempotency_key":"   "}"#.to_vec(),
            "request is invalid",
        ),
    ] {
        let reply = h
            .operator
            .send_raw("POST", &path, Some(&auth), Some(("application/json", body.clone())))
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        assert_eq!(reply.body["error"]["message"], message);
    }
    // Constraints on a deny are no command.
    let deny =
        json!({"expected_revision": 1, "idempotency_key": "k", "constraints": {"max_uses": 1}});
    let reply = h.operator.decide(&id, "deny", &deny).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_request"));
    // Nothing changed: still pending at revision 1, no record, no count moved.
    assert_eq!(h.operator.request(&id).await.body["revision"], 1);
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    assert_eq!(h.rows().await, rows);
    assert_unchanged(
        &snapshot,
        &h.snapshot(),
        "a refused decision changed something",
    );
    // Parameters on the media type are fine.
    let ok = h
        .operator
        .send_raw(
            "POST",
            &path,
            Some(&auth),
            Some(("Application/JSON; charset=utf-8", good)),
        )
        .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_stale_revision_writes_nothing_so_the_same_key_with_the_fresh_one_commits() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "stale").await;
    let snapshot = h.snapshot();
    let stale = h.operator.decide(&id, "deny", &decision(7, "key")).await;
    assert_eq!((stale.status, stale.code()), (409, "revision_conflict"));
    assert_eq!(stale.body["error"]["current"]["status"], "pending");
    assert_eq!(stale.body["error"]["current"]["revision"], 1);
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    assert_unchanged(
        &snapshot,
        &h.snapshot(),
        "a stale decision changed something",
    );
    let fresh = h.operator.decide(&id, "deny", &decision(1, "key")).await;
    assert_eq!(fresh.status, 200, "{}", fresh.body);
    assert_eq!(fresh.header("idempotency-replayed"), None);
    assert_eq!(h.snapshot().pending, 0, "the denial released the slot");
    h.broker.shutdown().await;
}

#[tokio::test]
async fn an_action_the_status_does_not_allow_is_an_invalid_transition_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(dir.path(), ONE_SLOT, StorageCaps::default())).await;
    let pending = pending_request(&h, "pending").await;
    let denied = pending_request(&h, "denied").await;
    let queued = pending_request(&h, "queued").await;
    hold_the_slot(&h).await;
    h.operator.deny(&denied).await;
    h.operator.approve(&queued).await;
    for (id, action) in [
        (&pending, "revoke"),
        (&denied, "approve"),
        (&denied, "deny"),
        (&denied, "revoke"),
        (&queued, "approve"),
        (&queued, "deny"),
    ] {
        let before = h.operator.request(id).await.body;
        let reply = h.operator.act(id, action).await;
        assert_eq!(
            (reply.status, reply.code()),
            (409, "invalid_transition"),
            "{action} on {}",
            before["status"]
        );
        assert_eq!(reply.body["error"]["message"], "invalid transition");
        assert_eq!(h.operator.request(id).await.body, before);
    }
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 2);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn constraints_may_only_narrow_the_requests_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "bounded").await;
    for constraints in [
        json!({"duration_seconds": 301}),
        json!({"max_uses": 2}),
        json!({"max_uses": null}),
        json!({"duration_seconds": 60, "max_uses": 1000000}),
    ] {
        let body = json!({"expected_revision": 1, "idempotency_key": constraints.to_string(),
                          "constraints": constraints});
        let reply = h.operator.decide(&id, "approve", &body).await;
        assert_eq!(
            (reply.status, reply.code()),
            (409, "constraint_exceeded"),
            "{constraints}"
        );
        assert_eq!(reply.body["error"]["message"], "constraint exceeded");
    }
    assert_eq!(h.operator.request(&id).await.body["status"], "pending");
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    let narrow = json!({"expected_revision": 1, "idempotency_key": "narrow",
                        "constraints": {"duration_seconds": 60, "max_uses": 1}});
    let reply = h.operator.decide(&id, "approve", &narrow).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.body["granted_max_uses"], 1);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_notification_decision_is_refused_after_the_revision_check() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = pending_request(&h, "telegram").await;
    let digest = format!("sha256:{}", "0".repeat(64));
    let notification = json!({
        "kind": "telegram", "renderer": "v1", "decision_token": "token", "chat_id": 42,
        "message_id": 7, "text": "Approve?", "presentation_json": "{}",
        "presentation_digest": digest, "rendered_digest": digest,
    });
    let with = |revision: u64| {
        json!({"expected_revision": revision, "idempotency_key": "tg",
               "notification": notification.clone()})
    };
    let stale = h.operator.decide(&id, "approve", &with(2)).await;
    assert_eq!((stale.status, stale.code()), (409, "revision_conflict"));
    let refused = h.operator.decide(&id, "approve", &with(1)).await;
    assert_eq!(
        (refused.status, refused.code()),
        (409, "invalid_decision_token")
    );
    let mut with_constraints = with(1);
    with_constraints["constraints"] = json!({"max_uses": 1});
    let reply = h.operator.decide(&id, "approve", &with_constraints).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_request"));
    let mut malformed = with(1);
    malformed["notification"]["chat_id"] = json!(0);
    let reply = h.operator.decide(&id, "approve", &malformed).await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_request"));
    assert_eq!(h.operator.request(&id).await.body["revision"], 1);
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn decisions_are_counted_by_action_and_outcome_and_the_drift_stays_zero() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let a = pending_request(&h, "a").await;
    let b = pending_request(&h, "b").await;
    assert_eq!(h.snapshot().pending, 2);
    h.operator.decide(&a, "deny", &decision(1, "k")).await;
    h.operator.decide(&a, "deny", &decision(1, "k")).await;
    h.operator.decide(&b, "approve", &decision(9, "k")).await;
    assert_eq!(h.snapshot().pending, 1);
    let metrics = h.metrics().await;
    for (series, n) in [
        (
            r#"broker_operator_decisions_total{action="deny",outcome="committed"}"#,
            1,
        ),
        (
            r#"broker_operator_decisions_total{action="deny",outcome="replayed"}"#,
            1,
        ),
        (
            r#"broker_operator_decisions_total{action="approve",outcome="revision_conflict"}"#,
            1,
        ),
    ] {
        assert_eq!(
            support::metrics::metric(&metrics, series),
            Some(n),
            "{series}"
        );
    }
    assert_eq!(h.operator.drift().await["drift"], 0);
    h.broker.shutdown().await;
}

#[tokio::test]
async fn a_unix_socket_operator_listener_is_private_and_gone_after_shutdown() {
    use std::os::unix::fs::PermissionsExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("operator.sock");
    let mut s = settings(&dir.path().join("data"), ROOMY, StorageCaps::default());
    s.operator_listen = unyolo_admission::broker::ListenAddr::Unix(socket.clone());
    let h = start_with(s).await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    stream
        .write_all(
            format!(
                "GET /.well-known/unyolo-operator HTTP/1.1\r\nHost: unyolo.local\r\n\
                 Authorization: Bearer {OPERATOR_SECRET}\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("unyolo.io/operator/v1"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("x-correlation-id: "),
        "{answer}"
    );
    h.broker.shutdown().await;
    assert!(!socket.exists(), "the socket outlived its broker");
}

/// The list's `event_cursor` is a promise: "list, then stream from there" misses nothing. Pages
/// run newest first, so every request created at or below the cursor and newer than the page's
/// oldest entry is on the page; checked on pages listed while an agent submits as fast as it
/// can. The cursor was once read after the page, and a request created in between was on
/// neither the page nor the stream that followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_created_at_or_below_the_lists_event_cursor_is_on_the_page() {
    const ROOM: &str = r#"{"requests_per_window": 100000, "window_seconds": 60,
      "client_active": 5000, "client_pending": 5000, "global_active": 5000,
      "global_executing": 1}"#;
    let dir = tempfile::tempdir().unwrap();
    let caps = StorageCaps {
        grant_client: 5000,
        grant_global: 5000,
        ..StorageCaps::default()
    };
    let h = std::sync::Arc::new(start_with(settings(dir.path(), ROOM, caps)).await);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (h, stop) = (std::sync::Arc::clone(&h), std::sync::Arc::clone(&stop));
        tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 3000 {
                n += 1;
                pending_request(&h, &format!("churn-{n}")).await;
            }
            n
        })
    };
    let mut pages = Vec::new();
    for _ in 0..300 {
        let page = h
            .operator
            .get(&format!("{REQUESTS}?status=pending&limit=100"))
            .await;
        assert_eq!(page.status, 200, "{}", page.body);
        if let Some(cursor) = page.body["event_cursor"].as_str() {
            let cursor = decode_cursor(cursor).unwrap();
            pages.push((cursor, ids(&page)));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let submitted = churn.await.unwrap();
    // Each request's `request.created`, in the log's order.
    let mut stream = open(&h.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let created: Vec<(i64, String)> = stream
        .next_events(submitted)
        .await
        .iter()
        .map(|e| {
            assert_eq!(e["kind"], "request.created");
            let cursor = decode_cursor(e["cursor"].as_str().unwrap()).unwrap();
            (cursor, e["request_id"].as_str().unwrap().to_owned())
        })
        .collect();
    let mut checked = 0;
    for (cursor, listed) in &pages {
        let oldest_listed = listed
            .last()
            .and_then(|id| created.iter().find(|(_, c)| c == id))
            .map_or(0, |(seq, _)| *seq);
        for (seq, id) in created.iter().filter(|(s, _)| s <= cursor) {
            if listed.len() < 100 || *seq > oldest_listed {
                checked += 1;
                assert!(
                    listed.contains(id),
                    "{id} (event {seq}) is at or below the page's event cursor {cursor} but \
                     not on it"
                );
            }
        }
    }
    assert!(
        submitted > 10 && checked > 0,
        "{submitted} submitted, {checked} checked"
    );
}
