//! The Agent V1 contract (SPEC section 5) from a client's side, against the real server: discovery,
//! the operation object and its revisions, recovery by listing, paging while work arrives,
//! long-poll waits (wake-up, timeout, bounds, shutdown, restart). `broker_agent_v1_bodies.rs`:
//! the bounds of a submission's body, the broker's name, the data dirs of schema version 1, the
//! listing's index, numbers kept as sent, and replays judged on the request. Every body the
//! harness receives is validated against `tests/contract/agent_v1.schema.json` (see
//! `support::contract`).

mod support;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::broker::{ROOMY, settings, start, start_with};
use support::contract::assert_conforms;
use support::eventually::eventually;
use support::http::{LARGE, op_path, request, revision};
use support::secrets::{AGENT, AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission::StorageCaps;

const DIGEST: &str = "sha256:bdc7fc2230ea7db9ede54305f2adcb3e3c21451056e58f9467fd5dbcc4a3ddc7";

fn events(id: &str, after: u64, wait_seconds: u64) -> String {
    format!(
        "/api/agent/v1/operations/{id}/events?after_revision={after}&wait_seconds={wait_seconds}"
    )
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
    let fairness = unyolo_admission_broker::fairness::FairnessConfig {
        per_client_units: 64,
        ..Default::default()
    };
    let h = start_with(unyolo_admission_broker::BrokerSettings {
        fairness,
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let id = h
        .submit(AGENT_SECRET, &request("held", "demo.request", 0))
        .await
        .id();
    let max = unyolo_admission_broker::waits::MAX_WAITS_PER_CLIENT;
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
    let max = unyolo_admission_broker::waits::MAX_WAITS_PER_CLIENT;
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
