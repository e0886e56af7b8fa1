//! The operator listener speaks unYOLO's Operator V1 exactly (SPEC section 8), the second half of
//! `broker_operator_v1.rs`: decisions in the contract's order (body, idempotency, lookup,
//! revision, token, transition, constraints) through the conformance lifecycle, their counts,
//! the Unix socket listener, and every request at or below the list's event cursor. Every reply
//! is checked against the vendored contract's schemas and the common headers
//! (`support::operator::check_reply`); bad input is checked to change nothing.

mod support;

use serde_json::json;
use support::broker::{ROOMY, assert_unchanged, settings, start, start_with};
use support::events::open;
use support::eventually::eventually;
use support::requests::{
    ONE_SLOT, REQUESTS, agent_op, canceled_error, decision, hold_the_slot, ids, pending_request,
};
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, OTHER_OPERATOR_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission_broker::store::events::decode_cursor;

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
    s.operator_listen = unyolo_admission_broker::ListenAddr::Unix(socket.clone());
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
