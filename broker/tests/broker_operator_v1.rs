//! The operator listener speaks unYOLO's Operator V1 exactly (SPEC section 8): discovery, health,
//! readiness, the request list with every filter and cursors bound to their query, one request,
//! the projection of each state, and the error envelope with its closed codes. Decisions in the
//! contract's order (body, idempotency, lookup, revision, token, transition, constraints), the
//! Unix socket listener and the list's event cursor are in `broker_operator_v1_decisions.rs`.
//! Every reply is checked against the vendored contract's schemas and the common headers
//! (`support::operator::check_reply`); bad input is checked to change nothing.

mod support;

use std::time::Duration;

use base64::Engine;
use serde_json::json;
use support::broker::{ROOMY, assert_unchanged, settings, start, start_with};
use support::eventually::eventually;
use support::faults::lock_store;
use support::http::request;
use support::requests::{
    ONE_SLOT, REQUESTS, agent_op, canceled_error, decision, hold_the_slot, ids, newest_first,
    pending_request,
};
use support::secrets::{
    AGENT, AGENT_SECRET, OPERATOR, OPERATOR_SECRET, OTHER, OTHER_OPERATOR, OTHER_OPERATOR_SECRET,
    OTHER_SECRET,
};
use unyolo_admission::StorageCaps;

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
        unyolo_admission_broker::discovery::BUILD_ID
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
