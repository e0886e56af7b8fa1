//! The Agent V1 contract (SPEC section 5) from a client's side, against the real server: discovery,
//! the operation object and its revisions, recovery by listing, paging while work arrives,
//! long-poll waits (wake-up, timeout, bounds, shutdown, restart), and the data dirs of schema
//! version 1. Every body the harness receives is validated against
//! `tests/contract/agent_v1.schema.json` (see `support::contract`).
#![cfg(feature = "broker")]

mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::broker::{ROOMY, settings, start, start_with};
use support::contract::{assert_conforms, violations};
use support::eventually::eventually;
use support::http::request;
use support::secrets::{AGENT, AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission::broker::store::{PageQuery, SCHEMA_VERSION, SqliteStore};
use unyolo_admission::broker::{Broker, BrokerError};
use unyolo_admission::engine::OperationState;

const DIGEST: &str = "sha256:bdc7fc2230ea7db9ede54305f2adcb3e3c21451056e58f9467fd5dbcc4a3ddc7";

/// Room for hundreds of operations per client.
const LARGE: &str = r#"{"requests_per_window": 10000, "window_seconds": 60,
  "client_active": 1000, "client_pending": 100, "global_active": 2000, "global_executing": 100}"#;

fn op_path(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

fn events(id: &str, after: u64, wait_seconds: u64) -> String {
    format!(
        "/api/agent/v1/operations/{id}/events?after_revision={after}&wait_seconds={wait_seconds}"
    )
}

fn revision(body: &Value) -> u64 {
    body["revision"].as_u64().expect("a revision")
}

/// The state an operation of `demo.request` that is approved and runs has at each revision.
fn expected_state(revision: u64) -> &'static str {
    match revision {
        1 => "pending",
        2 => "approved",
        3 => "executing",
        4 => "succeeded",
        other => panic!("an approved demo.request has no revision {other}"),
    }
}

fn no_nulls(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Array(items) => items.iter().all(no_nulls),
        Value::Object(fields) => fields.values().all(no_nulls),
        _ => true,
    }
}

#[tokio::test]
async fn discovery_describes_the_contract_to_a_known_client_only() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let missing = h.get("/.well-known/unyolo-agent", None).await;
    assert_eq!(
        (missing.status, missing.code()),
        (401, "authentication_failed")
    );
    let unknown = h
        .get("/.well-known/unyolo-agent", Some("not-a-secret"))
        .await;
    assert_eq!(
        (unknown.status, unknown.code()),
        (403, "authentication_failed")
    );
    let operator = h
        .get("/.well-known/unyolo-agent", Some(OPERATOR_SECRET))
        .await;
    assert_eq!(operator.status, 403, "the operator is not an agent client");

    let found = h.get("/.well-known/unyolo-agent", Some(AGENT_SECRET)).await;
    assert_eq!(found.status, 200);
    assert_eq!(found.header("cache-control"), Some("no-store"));
    let d = &found.body;
    assert_eq!(d.as_object().unwrap().len(), 5, "{d}");
    assert_eq!(d["api_version"], "unyolo.io/agent/v1");
    assert_eq!(d["contract_digest"], DIGEST);
    let build_id = d["build_id"].as_str().unwrap();
    assert!(
        build_id.starts_with(concat!(env!("CARGO_PKG_VERSION"), "+")),
        "{build_id}"
    );
    assert_eq!(d["operations"], json!(["demo.run", "demo.request"]));
    assert_eq!(
        d["credential"],
        json!({"ready": true, "provider": "demo", "credential_kind": "none",
               "generation": 0, "verification_state": "not_required"})
    );
}

#[tokio::test]
async fn the_operation_object_has_broker_revision_and_presentation_and_never_a_null() {
    let dir = tempfile::tempdir().unwrap();
    let mut settings = settings(dir.path(), ROOMY, StorageCaps::default());
    settings.broker_name = "ci-broker".to_owned();
    let h = start_with(settings).await;
    let created = h
        .submit(AGENT_SECRET, &request("shape-1", "demo.request", 1500))
        .await;
    assert_eq!(created.status, 202);
    let op = &created.body;
    let mut fields: Vec<&str> = op.as_object().unwrap().keys().map(String::as_str).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "api_version",
            "approval_id",
            "arguments",
            "broker",
            "client_id",
            "created_at",
            "id",
            "idempotency_key",
            "operation",
            "presentation",
            "reason",
            "revision",
            "state",
            "target",
            "updated_at",
        ]
    );
    assert_eq!(op["broker"], "ci-broker");
    assert_eq!(revision(op), 1);
    assert_eq!(
        op["presentation"],
        json!({
            "title": "Approve a demo run: wait 1500 ms, then succeed, on branch=main, repo=unyolo/test",
            "summary": "end-to-end test",
        })
    );
    assert!(no_nulls(op), "{op}");

    // The summary in a page is the object without target, arguments, reason and the rest.
    let page = h
        .get(
            "/api/agent/v1/operations?idempotency_key=shape-1",
            Some(AGENT_SECRET),
        )
        .await;
    let summary = &page.body["operations"][0];
    let mut expected = op.clone();
    for field in ["target", "arguments", "reason", "approval_id"] {
        expected.as_object_mut().unwrap().remove(field);
    }
    assert_eq!(summary, &expected);

    // Denied: terminal_at appears, and the error upstream's runtime gives a denial.
    assert_eq!(h.operator.deny(&created.id()).await.status, 200);
    let denied = h.get(&op_path(&created.id()), Some(AGENT_SECRET)).await;
    assert_eq!(
        (denied.status, denied.state(), revision(&denied.body)),
        (200, "denied", 2)
    );
    assert!(denied.body["terminal_at"].is_string());
    assert_eq!(
        denied.body["error"],
        json!({"code": "operation_approval_denied", "message": "Approval was denied"})
    );
    assert!(no_nulls(&denied.body));
    // A replay answers the operation as it is now, revision included.
    let replay = h
        .submit(AGENT_SECRET, &request("shape-1", "demo.request", 1500))
        .await;
    assert_eq!((replay.status, revision(&replay.body)), (200, 2));
}

#[tokio::test]
async fn a_client_follows_an_operation_revision_by_revision_from_submit_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let discovered = h.get("/.well-known/unyolo-agent", Some(AGENT_SECRET)).await;
    assert!(
        discovered.body["operations"]
            .as_array()
            .unwrap()
            .contains(&json!("demo.request"))
    );
    let created = h
        .submit(AGENT_SECRET, &request("follow-1", "demo.request", 300))
        .await;
    assert_eq!((created.status, revision(&created.body)), (202, 1));
    let id = created.id();

    // The operator approves while the client waits.
    let approver = {
        let (operator, id) = (h.operator.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            operator.approve(&id).await.status
        })
    };
    let mut seen = vec![created.body.clone()];
    let mut last = 1;
    while !expected_state(last).ends_with("ed") || last < 4 {
        let reply = h.get(&events(&id, last, 30), Some(AGENT_SECRET)).await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let now = revision(&reply.body);
        assert!(
            now > last,
            "a wait answers with a later revision: {now} after {last}"
        );
        assert_eq!(reply.state(), expected_state(now), "{}", reply.body);
        last = now;
        seen.push(reply.body);
    }
    assert_eq!(approver.await.unwrap(), 200);
    let end = seen.last().unwrap();
    assert_eq!(
        (end["state"].as_str(), revision(end)),
        (Some("succeeded"), 4)
    );
    assert!(end["terminal_at"].is_string());
    // updated_at moves with every revision; created_at never does.
    for pair in seen.windows(2) {
        assert_eq!(pair[0]["created_at"], pair[1]["created_at"]);
        assert!(pair[0]["updated_at"].as_str() <= pair[1]["updated_at"].as_str());
    }
    // A wait on a revision already passed answers at once with the operation as it is.
    let again = h.get(&events(&id, 0, 30), Some(AGENT_SECRET)).await;
    assert_eq!(&again.body, end);
}

/// Whitespace around the idempotency key and the reason is not part of them, as upstream's
/// broker trims both before it judges and stores them: ` trim-1 ` is key `trim-1`, stored and
/// shown trimmed, and the same request with the reason's whitespace changed is a replay.
#[tokio::test]
async fn a_key_and_a_reason_are_judged_and_stored_without_surrounding_whitespace() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let mut body = request(" trim-1\t", "demo.request", 0);
    body["reason"] = json!("  deploy the fix\n");
    let created = h.submit(AGENT_SECRET, &body).await;
    assert_eq!(created.status, 202, "{}", created.body);
    assert_eq!(created.body["idempotency_key"], "trim-1");
    assert_eq!(created.body["reason"], "deploy the fix");
    let mut again = request("trim-1", "demo.request", 0);
    again["reason"] = json!("deploy the fix");
    let replay = h.submit(AGENT_SECRET, &again).await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.id(), created.id());
    let page = h
        .get(
            "/api/agent/v1/operations?idempotency_key=%20trim-1%20",
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(page.body["operations"][0]["id"], created.id().as_str());
    assert_eq!(h.rows().await, 1);
}

#[tokio::test]
async fn a_wait_wakes_on_the_change_and_a_wait_that_times_out_returns_the_same_revision() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let created = h
        .submit(AGENT_SECRET, &request("wake-1", "demo.request", 0))
        .await;
    let id = created.id();

    let timed_out = h.get(&events(&id, 1, 1), Some(AGENT_SECRET)).await;
    assert_eq!((timed_out.status, revision(&timed_out.body)), (200, 1));
    assert_eq!(timed_out.body, created.body);
    let at_once = h.get(&events(&id, 1, 0), Some(AGENT_SECRET)).await;
    assert_eq!(at_once.body, created.body);

    let started = Instant::now();
    let waiter = {
        let (http, url) = (h.http.clone(), format!("{}{}", h.base, events(&id, 1, 30)));
        tokio::spawn(async move {
            let reply = http
                .get(url)
                .bearer_auth(AGENT_SECRET)
                .send()
                .await
                .unwrap();
            reply.json::<Value>().await.unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let canceled = h
        .post(&format!("{}/cancel", op_path(&id)), Some(AGENT_SECRET))
        .await;
    assert_eq!(
        (canceled.state(), revision(&canceled.body)),
        ("canceled", 2)
    );
    let woken = waiter.await.unwrap();
    assert_conforms("operation", &woken, "a woken wait");
    assert_eq!(woken, canceled.body);
    // Bounded by the wait's own 30 s: it was the change, not the timeout, that answered.
    assert!(started.elapsed() < Duration::from_secs(30));

    // An ended operation will not change again: a wait at its revision answers at once, as
    // upstream's does, rather than after its 30 s.
    let started = Instant::now();
    let ended = h.get(&events(&id, 2, 30), Some(AGENT_SECRET)).await;
    assert_eq!(ended.status, 200);
    assert_eq!(ended.body, canceled.body);
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn a_client_recovers_a_lost_submission_by_its_idempotency_key() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    for n in 0..3 {
        h.submit(AGENT_SECRET, &request(&format!("noise-{n}"), "demo.run", 0))
            .await;
    }
    let lost = h
        .submit(AGENT_SECRET, &request("lost-reply", "demo.request", 0))
        .await;
    h.submit(OTHER_SECRET, &request("lost-reply", "demo.request", 0))
        .await;
    let found = h
        .get(
            "/api/agent/v1/operations?idempotency_key=lost-reply&limit=1",
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(found.status, 200);
    assert_eq!(found.body["api_version"], "unyolo.io/agent/v1");
    assert_eq!(found.body["next_cursor"], Value::Null);
    let ops = found.body["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0]["id"], lost.body["id"]);
    assert_eq!(ops[0]["client_id"], AGENT);
    let none = h
        .get(
            "/api/agent/v1/operations?idempotency_key=never-used&limit=1",
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(
        none.body,
        json!({"api_version": "unyolo.io/agent/v1", "operations": [], "next_cursor": null})
    );
    // Filtering by state: the pending one only.
    let pending = h
        .get("/api/agent/v1/operations?state=pending", Some(AGENT_SECRET))
        .await;
    let ids: Vec<&Value> = pending.body["operations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| &op["id"])
        .collect();
    assert_eq!(ids, [&lost.body["id"]]);
}

#[tokio::test]
async fn paging_through_120_operations_while_new_ones_arrive_shows_each_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), LARGE).await;
    let mut submitted = Vec::new();
    for n in 0..120 {
        let reply = h
            .submit(AGENT_SECRET, &request(&format!("page-{n}"), "demo.run", 0))
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        submitted.push(reply.id());
    }
    // Another client's work is never in this client's pages.
    h.submit(OTHER_SECRET, &request("page-other", "demo.run", 0))
        .await;

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    let mut arrived = 0;
    loop {
        let path = match &cursor {
            None => "/api/agent/v1/operations?limit=7".to_owned(),
            Some(c) => format!("/api/agent/v1/operations?limit=7&cursor={c}"),
        };
        let page = h.get(&path, Some(AGENT_SECRET)).await;
        assert_eq!(page.status, 200, "{}", page.body);
        let ops = page.body["operations"].as_array().unwrap();
        assert!(ops.len() <= 7);
        seen.extend(ops.iter().map(|op| op["id"].as_str().unwrap().to_owned()));
        pages += 1;
        // New work arrives between pages.
        for _ in 0..3 {
            h.submit(
                AGENT_SECRET,
                &request(&format!("late-{arrived}"), "demo.run", 0),
            )
            .await;
            arrived += 1;
        }
        match page.body["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(pages, 120usize.div_ceil(7));
    let newest_first: Vec<String> = submitted.iter().rev().cloned().collect();
    assert_eq!(seen, newest_first, "each of the 120, once, newest first");
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 120);

    // The default page is 20, and the newest work leads it.
    let first = h.get("/api/agent/v1/operations", Some(AGENT_SECRET)).await;
    let ops = first.body["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 20);
    assert_eq!(ops[0]["idempotency_key"], format!("late-{}", arrived - 1));
    assert!(first.body["next_cursor"].is_string());
}

#[tokio::test]
async fn every_bad_listing_or_wait_parameter_is_a_400_invalid_request() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(
            h.submit(
                AGENT_SECRET,
                &request(&format!("bad-{n}"), "demo.request", 0),
            )
            .await
            .id(),
        );
    }
    let page = h
        .get("/api/agent/v1/operations?limit=1", Some(AGENT_SECRET))
        .await;
    let cursor = page.body["next_cursor"].as_str().unwrap().to_owned();
    let filtered = h
        .get(
            "/api/agent/v1/operations?limit=1&state=pending",
            Some(AGENT_SECRET),
        )
        .await;
    let filtered_cursor = filtered.body["next_cursor"].as_str().unwrap().to_owned();
    let other_page = h.submit(OTHER_SECRET, &request("o-1", "demo.run", 0)).await;
    assert_eq!(other_page.status, 202);

    let list = "/api/agent/v1/operations";
    let wait = format!("{}/events", op_path(&ids[0]));
    let bad = [
        format!("{list}?limit=0"),
        format!("{list}?limit=51"),
        format!("{list}?limit=-1"),
        format!("{list}?limit=two"),
        format!("{list}?limit=1.0"),
        format!("{list}?limit=5&limit=6"),
        format!("{list}?state=running"),
        format!("{list}?state=PENDING"),
        format!("{list}?idempotency_key=-no"),
        format!("{list}?cursor=forged"),
        format!("{list}?cursor=AAAAAAAAAAAAAAAAAAAAAAA"),
        format!("{list}?cursor={}", "A".repeat(129)),
        // A cursor is good for its own filters only.
        format!("{list}?cursor={filtered_cursor}"),
        format!("{list}?state=approved&cursor={cursor}"),
        format!("{list}?page=2"),
        // Empty values are bad values, not absent ones (an empty key once listed everything).
        format!("{list}?idempotency_key="),
        format!("{list}?cursor="),
        format!("{list}?limit="),
        format!("{list}?state="),
        format!("{wait}?after_revision="),
        format!("{wait}?wait_seconds="),
        format!("{wait}?wait_seconds=31"),
        format!("{wait}?after_revision=1&wait_seconds=31"),
        format!("{wait}?after_revision=-1"),
        format!("{wait}?after_revision=one"),
        format!("{wait}?wait_seconds=5&wait_seconds=5"),
        format!("{wait}?timeout=5"),
        // The message quoting a long bad value stays within the contract's 500 characters.
        format!("{list}?{}=1", "x".repeat(2000)),
        format!("{list}?state={}", "y".repeat(2000)),
    ];
    for path in &bad {
        let reply = h.get(path, Some(AGENT_SECRET)).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{path}: {}",
            reply.body
        );
        assert_eq!(reply.header("cache-control"), Some("no-store"));
    }
    // Another client cannot use this client's cursor either.
    let reply = h
        .get(&format!("{list}?cursor={cursor}"), Some(OTHER_SECRET))
        .await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_request"));
    // The good ones work, and the limits are inclusive.
    for path in [
        format!("{list}?limit=1&cursor={cursor}"),
        format!("{list}?limit=50"),
        format!("{list}?state=pending&limit=1&cursor={filtered_cursor}"),
        format!("{wait}?after_revision=0&wait_seconds=30"),
    ] {
        let reply = h.get(&path, Some(AGENT_SECRET)).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
}

#[tokio::test]
async fn missing_operations_and_unknown_routes_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let theirs = h
        .submit(OTHER_SECRET, &request("theirs", "demo.request", 0))
        .await
        .id();
    for path in [
        op_path("op_missing"),
        op_path(&theirs),
        events("op_missing", 0, 0),
        events(&theirs, 0, 0),
        "/api/agent/v1/nothing".to_owned(),
        "/.well-known/other".to_owned(),
    ] {
        let reply = h.get(&path, Some(AGENT_SECRET)).await;
        assert_eq!((reply.status, reply.code()), (404, "not_found"), "{path}");
    }
    let reply = h
        .post(&format!("{}/cancel", op_path(&theirs)), Some(AGENT_SECRET))
        .await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_read_while_it_is_being_created_is_canceled_or_decided_at_once() {
    // A client whose submission's answer is slow finds its operation by key and cancels it; an
    // operator approves a request as soon as it can be read. The row is readable a moment before
    // the broker holds the operation live; a cancel in that moment must still cancel (not answer
    // the pending operation unchanged), an approval must still approve (not 409).
    let dir = tempfile::tempdir().unwrap();
    let h = std::sync::Arc::new(start(dir.path(), ROOMY).await);
    let (mut created, rounds) = (0, 400);
    for i in 0..rounds {
        let key = format!("race-{i}");
        let submitting = {
            let (h, body) = (std::sync::Arc::clone(&h), request(&key, "demo.request", 0));
            tokio::spawn(async move { h.submit(AGENT_SECRET, &body).await })
        };
        let list = format!("/api/agent/v1/operations?idempotency_key={key}&limit=1");
        let id = loop {
            let found = h.get(&list, Some(AGENT_SECRET)).await;
            assert_eq!(found.status, 200, "{}", found.body);
            if let Some(op) = found.body["operations"].as_array().unwrap().first() {
                break op["id"].as_str().unwrap().to_owned();
            }
        };
        if i % 2 == 0 {
            let canceled = h
                .post(&format!("{}/cancel", op_path(&id)), Some(AGENT_SECRET))
                .await;
            assert_eq!(
                (canceled.status, canceled.state()),
                (200, "canceled"),
                "{key}: {}",
                canceled.body
            );
        } else {
            let approved = h.operator.approve(&id).await;
            assert_eq!(approved.status, 200, "{key}: {}", approved.body);
        }
        let answer = submitting.await.unwrap();
        assert_eq!(answer.status, 202, "{}", answer.body);
        created += 1;
    }
    assert_eq!(created, rounds);
    std::sync::Arc::into_inner(h)
        .unwrap()
        .broker
        .shutdown()
        .await;
}

/// Probes with `probe` (a zero-second wait) until the client's wait slots are full, and returns
/// the refusal. The waits in `waiters` open in their own time on a busy machine, and one that
/// arrives while a probe holds a slot is refused 429 and ends at once (a 30 s wait ends no sooner
/// otherwise): each such one is sent again with `wait`, at most once per slot.
async fn fill_wait_slots<T: std::fmt::Debug + Send + 'static>(
    h: &support::broker::Harness,
    probe: &str,
    waiters: &mut [tokio::task::JoinHandle<T>],
    wait: &impl Fn() -> tokio::task::JoinHandle<T>,
) -> support::http::Reply {
    let deadline = Instant::now() + Duration::from_secs(120);
    let (slots, mut replaced) = (waiters.len(), Vec::new());
    loop {
        let reply = h.get(probe, Some(AGENT_SECRET)).await;
        if reply.status == 429 {
            return reply;
        }
        assert_eq!(reply.status, 200, "{}", reply.body);
        for waiter in waiters.iter_mut() {
            if waiter.is_finished() && replaced.len() < slots {
                let ended = std::mem::replace(waiter, wait());
                replaced.push(format!("{:?}", ended.await));
            }
        }
        if Instant::now() >= deadline {
            panic!(
                "the waits never filled the client's slots: the last probe got {} {}; \
                 the waits sent again had ended with {replaced:?}",
                reply.status, reply.body
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn waits_are_bounded_per_client_never_block_others_and_end_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    // The client's fairness share (32 units by default, one a wait) is raised past its wait
    // limit, so the limit judged here is the waits' own, and its other requests get room.
    let fairness = unyolo_admission::fairness::FairnessConfig {
        per_client_units: 64,
        ..Default::default()
    };
    let h = start_with(unyolo_admission::broker::BrokerSettings {
        fairness,
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let id = h
        .submit(AGENT_SECRET, &request("held", "demo.request", 0))
        .await
        .id();
    let max = unyolo_admission::broker::waits::MAX_WAITS_PER_CLIENT;
    let wait = || {
        let (http, url) = (h.http.clone(), format!("{}{}", h.base, events(&id, 1, 30)));
        tokio::spawn(async move {
            let reply = http
                .get(url)
                .bearer_auth(AGENT_SECRET)
                .send()
                .await
                .unwrap();
            (
                reply.status().as_u16(),
                reply.json::<Value>().await.unwrap(),
            )
        })
    };
    let mut waiters: Vec<_> = (0..max).map(|_| wait()).collect();
    // Once all are open, one more that would wait is refused (a one-second probe, so a probe let
    // in ends soon).
    let probe = events(&id, 1, 1);
    let refused = fill_wait_slots(&h, &probe, &mut waiters, &wait).await;
    assert_eq!(refused.code(), "too_many_waits");
    assert!(refused.retry_after().is_some_and(|s| s >= 1));
    // A wait that answers at once needs no slot: its revision already above N, no time to wait,
    // or an id that is not the client's (before: 429 `too_many_waits` for each).
    let at_once = h.get(&events(&id, 0, 30), Some(AGENT_SECRET)).await;
    assert_eq!((at_once.status, revision(&at_once.body)), (200, 1));
    let no_time = h.get(&events(&id, 1, 0), Some(AGENT_SECRET)).await;
    assert_eq!((no_time.status, revision(&no_time.body)), (200, 1));
    let unknown = h.get(&events("op_nope", 0, 30), Some(AGENT_SECRET)).await;
    assert_eq!((unknown.status, unknown.code()), (404, "not_found"));
    // Nothing else of this client waits behind them, nor does any other client.
    assert_eq!(h.get(&op_path(&id), Some(AGENT_SECRET)).await.status, 200);
    let other = h
        .submit(OTHER_SECRET, &request("free", "demo.request", 0))
        .await;
    assert_eq!(
        h.get(&events(&other.id(), 1, 0), Some(OTHER_SECRET))
            .await
            .status,
        200
    );
    // Waits hold no quota: the client still submits.
    let more = h
        .submit(AGENT_SECRET, &request("more", "demo.run", 0))
        .await;
    assert_eq!(more.status, 202);

    h.broker.shutdown().await;
    for waiter in waiters {
        let (status, body) = waiter.await.unwrap();
        assert_eq!((status, revision(&body)), (200, 1), "{body}");
        assert_conforms("operation", &body, "a wait ended by shutdown");
    }
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_wait_gives_its_wait_slots_back() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = h
        .submit(AGENT_SECRET, &request("hang-up", "demo.request", 0))
        .await
        .id();
    let max = unyolo_admission::broker::waits::MAX_WAITS_PER_CLIENT;
    // A separate client, so dropping it closes every connection the waits use.
    let impatient = reqwest::Client::new();
    let wait = || {
        let request = impatient
            .get(format!("{}{}", h.base, events(&id, 1, 30)))
            .bearer_auth(AGENT_SECRET)
            .send();
        tokio::spawn(request)
    };
    let mut waiters: Vec<_> = (0..max).map(|_| wait()).collect();
    let probe = events(&id, 1, 1);
    fill_wait_slots(&h, &probe, &mut waiters, &wait).await;
    for waiter in &waiters {
        waiter.abort();
    }
    for waiter in waiters {
        let _ = waiter.await;
    }
    drop(impatient);
    // The server drops each abandoned wait; its slot comes back well before the 30 s timeout.
    let deadline = Instant::now() + Duration::from_secs(25);
    let freed = loop {
        let reply = h.get(&probe, Some(AGENT_SECRET)).await;
        if reply.status == 200 || Instant::now() > deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (freed.status, revision(&freed.body)),
        (200, 1),
        "{}",
        freed.body
    );
}

#[tokio::test]
async fn a_wait_after_a_restart_sees_the_change_made_during_the_crash() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let id = h
        .submit(AGENT_SECRET, &request("crash", "demo.run", 600_000))
        .await
        .id();
    assert!(
        eventually(async || h.get(&op_path(&id), Some(AGENT_SECRET)).await.state() == "executing")
            .await
    );
    let executing = h.get(&op_path(&id), Some(AGENT_SECRET)).await;
    assert_eq!(revision(&executing.body), 2);
    h.broker.shutdown().await;

    let h = start(dir.path(), ROOMY).await;
    assert_eq!(h.restored.interrupted, 1);
    let started = Instant::now();
    let reply = h.get(&events(&id, 2, 30), Some(AGENT_SECRET)).await;
    assert_eq!(
        (reply.status, reply.state(), revision(&reply.body)),
        (200, "failed", 3)
    );
    assert_eq!(reply.body["error"]["code"], "execution_interrupted");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "answered, not timed out"
    );
    // The revision is durable: the next restart changes nothing.
    h.broker.shutdown().await;
    let h = start(dir.path(), ROOMY).await;
    let read = h.get(&op_path(&id), Some(AGENT_SECRET)).await;
    assert_eq!(read.body, reply.body);
}

#[tokio::test]
async fn submissions_beyond_the_target_and_argument_bounds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), LARGE).await;
    let with = |key: &str, field: &str, count: usize| {
        let mut body = request(key, "demo.request", 0);
        let object: serde_json::Map<String, Value> =
            (0..count).map(|n| (format!("p{n}"), json!(n))).collect();
        body[field] = Value::Object(object);
        body
    };
    let ok = h.submit(AGENT_SECRET, &with("t32", "target", 32)).await;
    assert_eq!(ok.status, 202, "{}", ok.body);
    let ok = h
        .submit(AGENT_SECRET, &with("a128", "arguments", 128))
        .await;
    assert_eq!(ok.status, 202, "{}", ok.body);
    for (key, field, count) in [("t33", "target", 33), ("a129", "arguments", 129)] {
        let reply = h.submit(AGENT_SECRET, &with(key, field, count)).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{key}"
        );
    }
    for field in ["target", "arguments"] {
        let mut body = request(&format!("no-{field}"), "demo.run", 0);
        body.as_object_mut().unwrap().remove(field);
        let reply = h.submit(AGENT_SECRET, &body).await;
        assert_eq!(
            (reply.status, reply.code()),
            (400, "invalid_request"),
            "{field}"
        );
    }
    assert_eq!(h.rows().await, 2);
}

#[tokio::test]
async fn a_broker_name_outside_1_to_64_characters_stops_start_up() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["", &"n".repeat(65), "tab\there"] {
        let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
        s.broker_name = name.to_owned();
        assert!(
            matches!(Broker::start(s).await, Err(BrokerError::Settings(_))),
            "{name:?}"
        );
    }
    let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
    s.broker_name = "é".repeat(64);
    let (broker, _) = Broker::start(s).await.expect("64 characters are allowed");
    broker.shutdown().await;
}

/// The schema of version 1, as the previous release created it.
const SCHEMA_V1: &str = "
CREATE TABLE operations (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, idempotency_key TEXT NOT NULL,
    operation TEXT NOT NULL, target TEXT NOT NULL, arguments TEXT NOT NULL, reason TEXT NOT NULL,
    state TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, terminal_at TEXT,
    error_code TEXT, error_message TEXT, UNIQUE (client_id, idempotency_key)
);
CREATE INDEX operations_by_state ON operations (state);
CREATE TABLE streams (
    id TEXT PRIMARY KEY NOT NULL, client_id TEXT NOT NULL, size INTEGER NOT NULL,
    created_at TEXT NOT NULL
);
PRAGMA user_version = 1;
";

#[tokio::test]
async fn a_data_dir_of_schema_version_1_keeps_working_from_revision_1() {
    if !support::broker::sqlite_only("a SQLite file of schema version 1, written by hand") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        let row = "INSERT INTO operations VALUES (?1, 'agent', ?2, 'demo.request', \
                   '{\"repo\":\"old\"}', '{}', 'from v1', ?3, '2025-01-01T00:00:00.000Z', \
                   '2025-01-01T00:00:00.000Z', ?4, ?5, ?6)";
        conn.execute(
            row,
            rusqlite::params![
                "op_old_pending",
                "k-old-1",
                "pending",
                None::<String>,
                None::<String>,
                None::<String>
            ],
        )
        .unwrap();
        conn.execute(
            row,
            rusqlite::params![
                "op_old_failed",
                "k-old-2",
                "failed",
                Some("2025-01-01T00:00:01.000Z"),
                Some("execution_interrupted"),
                Some("stopped")
            ],
        )
        .unwrap();
    }
    // Kept for ever: these rows ended in 2025, long past the default retention.
    let mut s = settings(dir.path(), ROOMY, StorageCaps::default());
    s.retention.keep = unyolo_admission::broker::Keep::Forever;
    // And not expired: the pending one was created in 2025, far past the default pending timeout.
    s.pending_timeout = std::time::Duration::from_secs(10 * 365 * 24 * 3600);
    let h = start_with(s).await;
    assert_eq!(h.restored.pending, 1);
    let version: i64 = rusqlite::Connection::open(dir.path().join("admission.sqlite3"))
        .unwrap()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let pending = h.get(&op_path("op_old_pending"), Some(AGENT_SECRET)).await;
    assert_eq!((pending.state(), revision(&pending.body)), ("pending", 1));
    assert_eq!(
        pending.body["presentation"]["title"],
        "Approve a demo run: wait 0 ms, then succeed, on repo=old"
    );
    let failed = h.get(&op_path("op_old_failed"), Some(AGENT_SECRET)).await;
    assert_eq!(failed.body["error"]["code"], "execution_interrupted");
    let page = h.get("/api/agent/v1/operations", Some(AGENT_SECRET)).await;
    assert_eq!(page.body["operations"].as_array().unwrap().len(), 2);
    let approved = h.operator.approve("op_old_pending").await;
    assert_eq!(
        (approved.body["status"].as_str(), revision(&approved.body)),
        (Some("active"), 2)
    );
    // A replay of the old key is still recognized.
    let old_key = h
        .get(
            "/api/agent/v1/operations?idempotency_key=k-old-2&limit=1",
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(old_key.body["operations"][0]["id"], "op_old_failed");
}

#[tokio::test]
async fn every_listing_page_walks_an_index_in_order_and_sorts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let db = tokio::task::spawn_blocking({
        let dir = dir.path().to_owned();
        move || SqliteStore::open(&dir).unwrap()
    })
    .await
    .unwrap();
    for key in [None, Some("k".to_owned())] {
        for state in [None, Some(OperationState::Pending)] {
            for before in [None, Some(10)] {
                let query = PageQuery {
                    idempotency_key: key.clone(),
                    state,
                    before,
                    limit: 21,
                };
                let plan = db.explain_page(query.clone()).await.unwrap().join(" | ");
                assert!(
                    plan.contains("USING INDEX") || plan.contains("USING COVERING INDEX"),
                    "{query:?}: {plan}"
                );
                assert!(!plan.contains("TEMP B-TREE"), "{query:?} sorts: {plan}");
                assert!(
                    !plan.starts_with("SCAN operations"),
                    "{query:?} scans: {plan}"
                );
            }
        }
    }
}

#[test]
fn the_schema_rejects_what_the_contract_forbids() {
    let operation = json!({
        "api_version": "unyolo.io/agent/v1", "id": "op_1", "broker": "admission",
        "client_id": "agent", "idempotency_key": "k", "operation": "demo.run", "target": {},
        "arguments": {}, "reason": "r", "state": "pending", "revision": 1,
        "created_at": "2026-01-01T00:00:00.000Z", "updated_at": "2026-01-01T00:00:00.000Z",
        "presentation": {"title": "t"}
    });
    assert!(violations("operation", &operation).is_empty());
    let mut with_null = operation.clone();
    with_null["terminal_at"] = Value::Null;
    assert!(!violations("operation", &with_null).is_empty());
    let mut without_revision = operation.clone();
    without_revision.as_object_mut().unwrap().remove("revision");
    assert!(!violations("operation", &without_revision).is_empty());
    assert!(
        !violations("summary", &operation).is_empty(),
        "a summary has no target"
    );
    let old_list = json!({"operations": []});
    assert!(!violations("page", &old_list).is_empty());
    let envelope = json!({"error": {"code": "not_found", "message": "No such operation."}});
    assert!(violations("error_envelope", &envelope).is_empty());
    assert!(!violations("error_envelope", &json!({"error": {"code": "x"}})).is_empty());
}

#[tokio::test]
async fn numbers_are_stored_and_shown_as_sent_and_a_retry_is_judged_on_their_text() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let post = |body: String| {
        h.send(
            "POST",
            "/api/agent/v1/operations",
            Some(AGENT_SECRET),
            Some(body.into()),
        )
    };
    let body = |big: &str, price: &str| {
        format!(
            r#"{{"idempotency_key":"numbers","operation":"demo.request","reason":"r",
                "target":{{"repo":"u/t","pr":{big}}},
                "arguments":{{"duration_ms":0,"price":{price},"ids":[{big},-{big}]}}}}"#
        )
    };
    let big = "12345678901234567890123";
    let created = post(body(big, "1.50")).await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.id();
    // Every digit as sent, in the answer, a later read, the operator's view and the row.
    let read = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    for op in [&created.body, &read.body] {
        assert_eq!(op["target"]["pr"].to_string(), big, "{op}");
        assert_eq!(op["arguments"]["price"].to_string(), "1.50", "{op}");
        assert_eq!(op["arguments"]["ids"][1].to_string(), format!("-{big}"));
    }
    let request = h
        .operator
        .request(read.body["approval_id"].as_str().unwrap())
        .await;
    assert_eq!(request.status, 200, "{}", request.body);
    assert!(request.body.to_string().contains(big), "{}", request.body);
    if support::broker::sqlite_only("the stored text is read from the SQLite file") {
        let stored: String = rusqlite::Connection::open(dir.path().join("admission.sqlite3"))
            .unwrap()
            .query_row("SELECT arguments FROM operations", [], |row| row.get(0))
            .unwrap();
        assert!(stored.contains(big) && stored.contains("1.50"), "{stored}");
    }
    // The same text is a replay; a number an f64 reads alike, or the same price written
    // otherwise, is another request.
    let replay = post(body(big, "1.50")).await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.id(), id);
    for (other, price) in [("12345678901234567890124", "1.50"), (big, "1.5")] {
        let reply = post(body(other, price)).await;
        assert_eq!(reply.status, 409, "{other} {price}: {}", reply.body);
        assert_eq!(reply.code(), "idempotency_conflict");
    }
    assert_eq!(h.rows().await, 1);
}

#[tokio::test]
async fn a_replay_is_the_same_request_up_to_key_order_and_any_deep_change_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let post = |body: &'static str| {
        h.send(
            "POST",
            "/api/agent/v1/operations",
            Some(AGENT_SECRET),
            Some(body.into()),
        )
    };
    let created = post(
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
    )
    .await;
    assert_eq!(created.status, 202, "{}", created.body);
    // The same request with its keys in another order at every depth: a replay.
    let replay = post(
        r#"{"arguments":{"list":[1,2],"duration_ms":0},"reason":"r",
            "target":{"deep":{"b":null,"a":[1,{"y":2,"x":1}]},"repo":"u/t"},
            "operation":"demo.run","idempotency_key":"deep"}"#,
    )
    .await;
    assert_eq!(replay.status, 200, "{}", replay.body);
    assert_eq!(replay.id(), created.id());
    assert_eq!(replay.body["target"], created.body["target"]);
    // A change deep inside, an array reordered, or a number of another kind: conflicts.
    for changed in [
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":3}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[2,1]}}"#,
        r#"{"idempotency_key":"deep","operation":"demo.run","reason":"r",
            "target":{"repo":"u/t","deep":{"a":[1.0,{"x":1,"y":2}],"b":null}},
            "arguments":{"duration_ms":0,"list":[1,2]}}"#,
    ] {
        let reply = post(changed).await;
        assert_eq!(reply.status, 409, "{changed}: {}", reply.body);
        assert_eq!(reply.code(), "idempotency_conflict");
    }
    assert_eq!(h.rows().await, 1);
    let text = h.metrics().await;
    assert_eq!(
        support::metrics::metric(&text, "broker_submissions_total{result=\"replayed\"}"),
        Some(1),
        "{text}"
    );
}
