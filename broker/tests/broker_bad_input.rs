//! Bad input of every kind gets its status and stable code, and creates and consumes nothing:
//! no row, no admission decision, no token, no slot.

mod support;

use serde_json::{Value, json};
use std::io::{Read, Write};
use support::broker::{Harness, ROOMY, assert_unchanged, settings, start, start_with};
use support::http::{Reply, request};
use support::secrets::{AGENT, AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission::RefusalCode;

/// Sends `body` as a submission with `token` and asserts the status and code, that the response
/// carries `Cache-Control: no-store` and the error shape, and that nothing was created or consumed.
async fn refused_without_trace(
    h: &Harness,
    token: Option<&str>,
    body: impl Into<reqwest::Body>,
    status: u16,
    code: &str,
) -> Reply {
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let reply = h
        .send("POST", "/api/agent/v1/operations", token, Some(body.into()))
        .await;
    assert_eq!(
        (reply.status, reply.code()),
        (status, code),
        "{}",
        reply.body
    );
    assert_error_shape(&reply);
    assert_eq!(h.rows().await, rows, "a row was written");
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");
    reply
}

fn assert_error_shape(reply: &Reply) {
    assert_eq!(reply.header("cache-control"), Some("no-store"));
    let error = reply.body["error"].as_object().expect("an error object");
    assert_eq!(error.len(), 2, "{}", reply.body);
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
}

fn with(field: &str, value: Value) -> String {
    let mut body = request("key-1", "demo.request", 0);
    body[field] = value;
    body.to_string()
}

#[tokio::test]
async fn malformed_and_mistyped_bodies_are_invalid_requests_that_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let token = Some(AGENT_SECRET);
    let cases: Vec<(&str, String)> = vec![
        (
            "malformed json",
            r#"{"idempotency_key": "k1", "operation": "#.to_owned(),
        ),
        ("not an object", "[1, 2, 3]".to_owned()),
        ("empty body", String::new()),
        (
            "trailing content",
            format!("{} x", request("key-1", "demo.run", 0)),
        ),
        ("unknown field", with("priority", json!("high"))),
        ("unknown field differing in case", {
            let mut v = request("key-1", "demo.run", 0);
            let reason = v.as_object_mut().unwrap().remove("reason").unwrap();
            v["Reason"] = reason;
            v.to_string()
        }),
        ("missing reason", {
            let mut v = request("key-1", "demo.run", 0);
            v.as_object_mut().unwrap().remove("reason");
            v.to_string()
        }),
        (
            "duplicate field",
            r#"{"idempotency_key":"a","idempotency_key":"b","operation":"demo.run","reason":"r"}"#
                .to_owned(),
        ),
        ("a key repeated inside arguments", {
            // Read leniently this would be {"duration_ms":0}; the first value is over the limit.
            let body = with("arguments", json!({"duration_ms": 600_001}));
            let twice = body.replacen(
                r#""duration_ms":600001"#,
                r#""duration_ms":600001,"duration_ms":0"#,
                1,
            );
            assert_ne!(twice, body);
            twice
        }),
        ("a key repeated deep inside target", {
            let body = with("target", json!({"repo": {"path": "a"}}));
            let twice = body.replacen(r#""path":"a""#, r#""path":"a","path":"b""#, 1);
            assert_ne!(twice, body);
            twice
        }),
        ("empty idempotency key", with("idempotency_key", json!(""))),
        (
            "key with a leading dash",
            with("idempotency_key", json!("-key")),
        ),
        ("key with a space", with("idempotency_key", json!("a key"))),
        ("key with a slash", with("idempotency_key", json!("a/b"))),
        ("key not ascii", with("idempotency_key", json!("clé"))),
        (
            "key of 129 bytes",
            with("idempotency_key", json!("k".repeat(129))),
        ),
        ("key not a string", with("idempotency_key", json!(7))),
        ("empty reason", with("reason", json!(""))),
        ("blank reason", with("reason", json!(" \t\n "))),
        ("blank key", with("idempotency_key", json!("  "))),
        (
            "reason of 2001 bytes",
            with("reason", json!("r".repeat(2001))),
        ),
        ("target not an object", with("target", json!("repo"))),
        ("target null", with("target", Value::Null)),
        ("arguments an array", with("arguments", json!([1]))),
    ];
    for (name, body) in cases {
        eprintln!("case: {name}");
        refused_without_trace(&h, token, body, 400, "invalid_request").await;
    }
    // A well-formed body whose operation refuses its arguments: unYOLO's runtime answers an
    // operation's own input check with `operation_input_invalid`.
    let bad_arguments = [
        (
            "duration above ten minutes",
            json!({"duration_ms": 600_001}),
        ),
        ("negative duration", json!({"duration_ms": -1})),
        ("duration as a string", json!({"duration_ms": "5"})),
        ("fractional duration", json!({"duration_ms": 1.5})),
        ("duration null", json!({"duration_ms": null})),
    ];
    for (name, arguments) in bad_arguments {
        eprintln!("case: {name}");
        let body = with("arguments", arguments);
        refused_without_trace(&h, token, body, 400, "operation_input_invalid").await;
    }
    // The limits of the contract are accepted.
    let mut edge = request(&"k".repeat(128), "demo.request", 600_000);
    edge["reason"] = json!("r".repeat(2000));
    let reply = h.submit(AGENT_SECRET, &edge).await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    let reply = h
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", reply.id()),
            token,
        )
        .await;
    assert_eq!(reply.state(), "canceled");
}

#[tokio::test]
async fn an_unknown_operation_is_not_registered() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    for operation in ["demo.delete", "Demo.run", "demo.run ", &"x".repeat(128)] {
        refused_without_trace(
            &h,
            Some(AGENT_SECRET),
            with("operation", json!(operation)),
            400,
            "operation_not_registered",
        )
        .await;
    }
    // Out of the contract's 1-128 characters: a bad request, not an unknown operation.
    for operation in ["".to_owned(), "x".repeat(129), "é".repeat(129)] {
        refused_without_trace(
            &h,
            Some(AGENT_SECRET),
            with("operation", json!(operation)),
            400,
            "invalid_request",
        )
        .await;
    }
}

#[tokio::test]
async fn a_body_over_one_mebibyte_is_413_whether_declared_or_streamed() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let mut big = request("key-1", "demo.run", 0);
    big["reason"] = json!("r".repeat(1 << 20));
    let reply = refused_without_trace(
        &h,
        Some(AGENT_SECRET),
        big.to_string(),
        413,
        "payload_too_large",
    )
    .await;
    assert!(reply.retry_after().is_none());

    // Chunked, so no Content-Length announces it: the limit applies while reading.
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let addr = h.broker.local_addr();
    let head = format!(
        "POST /api/agent/v1/operations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {AGENT_SECRET}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let response = tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream.write_all(head.as_bytes()).unwrap();
        let chunk = vec![b' '; 64 * 1024];
        for _ in 0..20 {
            if stream
                .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                .and_then(|()| stream.write_all(&chunk))
                .and_then(|()| stream.write_all(b"\r\n"))
                .is_err()
            {
                break; // The server answered and closed.
            }
        }
        let _ = stream.write_all(b"0\r\n\r\n");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response
    })
    .await
    .unwrap();
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(response.contains("payload_too_large"), "{response}");
    assert_eq!(h.rows().await, rows);
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");
}

#[tokio::test]
async fn missing_tokens_are_401_and_wrong_tokens_403_before_the_body_is_judged() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let good = request("key-1", "demo.run", 0).to_string();
    let reply = refused_without_trace(&h, None, good.clone(), 401, "authentication_failed").await;
    assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
    refused_without_trace(
        &h,
        Some("not-a-secret"),
        good.clone(),
        403,
        "authentication_failed",
    )
    .await;
    refused_without_trace(
        &h,
        Some(&AGENT_SECRET[..5]),
        good.clone(),
        403,
        "authentication_failed",
    )
    .await;
    refused_without_trace(
        &h,
        Some(OPERATOR_SECRET),
        good.clone(),
        403,
        "authentication_failed",
    )
    .await;
    // Authentication comes first: a bad body with no token is still 401.
    refused_without_trace(&h, None, "{", 401, "authentication_failed").await;

    // Other schemes are not bearer tokens.
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let response = h
        .http
        .post(format!("{}/api/agent/v1/operations", h.base))
        .header("authorization", format!("Basic {AGENT_SECRET}"))
        .body(good)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(h.rows().await, rows);
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");

    for path in ["/api/agent/v1/operations", "/api/agent/v1/operations/op_x"] {
        let reply = h.get(path, None).await;
        assert_eq!((reply.status, reply.code()), (401, "authentication_failed"));
        let reply = h.get(path, Some("wrong")).await;
        assert_eq!((reply.status, reply.code()), (403, "authentication_failed"));
    }

    // The scheme in any case (RFC 9110), and spaces around the secret, as unYOLO reads a
    // bearer header: the client is known, not refused.
    for header in [
        format!("bearer {AGENT_SECRET}"),
        format!("BEARER {AGENT_SECRET}"),
        format!("Bearer   {AGENT_SECRET}  "),
    ] {
        let response = h
            .http
            .get(format!("{}/api/agent/v1/operations", h.base))
            .header("authorization", &header)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{header:?}");
    }
    // A scheme that only starts like one is not it.
    let response = h
        .http
        .get(format!("{}/api/agent/v1/operations", h.base))
        .header("authorization", format!("Bearerx {AGENT_SECRET}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
}

#[tokio::test]
async fn operator_routes_refuse_client_tokens_and_client_routes_refuse_the_operator() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let created = h
        .submit(AGENT_SECRET, &request("key-1", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202);
    let id = created.id();
    let (rows, snapshot) = (h.rows().await, h.snapshot());
    let operator_routes = [
        ("GET", "/api/operator/v1/requests".to_owned()),
        ("GET", format!("/api/operator/v1/requests/{id}")),
        ("POST", format!("/api/operator/v1/requests/{id}/approve")),
        ("POST", format!("/api/operator/v1/requests/{id}/deny")),
        ("POST", format!("/api/operator/v1/requests/{id}/revoke")),
        ("GET", "/.well-known/unyolo-operator".to_owned()),
        ("GET", "/metrics".to_owned()),
        ("GET", "/admission/v1/drift".to_owned()),
    ];
    for (method, path) in &operator_routes {
        // On the operator listener a client's secret is no operator's: 401, never 403.
        for token in [AGENT_SECRET, OTHER_SECRET, "nope"] {
            let auth = format!("Bearer {token}");
            let body = Some((
                "application/json",
                br#"{"expected_revision":1,"idempotency_key":"k"}"#.to_vec(),
            ));
            let reply = h.operator.send_raw(method, path, Some(&auth), body).await;
            assert_eq!(
                (reply.status, reply.code()),
                (401, "unauthorized"),
                "{path}"
            );
            assert_eq!(
                reply.header("www-authenticate"),
                Some(r#"Bearer realm="broker-operator""#)
            );
        }
        let reply = h.operator.send_raw(method, path, None, None).await;
        assert_eq!(
            (reply.status, reply.code()),
            (401, "unauthorized"),
            "{path}"
        );
        // On the agent listener none of them exists, whoever asks.
        for token in [Some(AGENT_SECRET), Some(OPERATOR_SECRET), None] {
            let reply = h.send(method, path, token, None).await;
            assert_eq!((reply.status, reply.code()), (404, "not_found"), "{path}");
            assert_error_shape(&reply);
        }
    }
    let cancel = format!("/api/agent/v1/operations/{id}/cancel");
    let reply = h.post(&cancel, Some(OPERATOR_SECRET)).await;
    assert_eq!((reply.status, reply.code()), (403, "authentication_failed"));
    // Nothing moved: still pending, nothing consumed.
    assert_eq!(h.rows().await, rows);
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");
    let reply = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(reply.state(), "pending");
}

#[tokio::test]
async fn another_clients_operation_is_not_found_and_cannot_be_canceled() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let created = h
        .submit(AGENT_SECRET, &request("key-1", "demo.request", 0))
        .await;
    let id = created.id();
    let snapshot = h.snapshot();
    let reply = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(OTHER_SECRET),
        )
        .await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
    let reply = h
        .post(
            &format!("/api/agent/v1/operations/{id}/cancel"),
            Some(OTHER_SECRET),
        )
        .await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
    let reply = h.get("/api/agent/v1/operations", Some(OTHER_SECRET)).await;
    assert_eq!(
        reply.body,
        json!({"api_version": "unyolo.io/agent/v1", "operations": [], "next_cursor": null})
    );
    let reply = h
        .get("/api/agent/v1/operations/op_missing", Some(AGENT_SECRET))
        .await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
    for decision in ["approve", "deny", "revoke"] {
        let body = json!({"expected_revision": 1, "idempotency_key": "k"});
        let reply = h.operator.decide("op_missing", decision, &body).await;
        assert_eq!((reply.status, reply.code()), (404, "not_found"));
        assert_eq!(reply.body["error"]["message"], "request not found");
    }
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    assert_unchanged(&snapshot, &h.snapshot(), "admission state changed");
    let reply = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(reply.state(), "pending");
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json_errors_with_no_store() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    let reply = h.get("/api/agent/v1/nothing", Some(AGENT_SECRET)).await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
    assert_error_shape(&reply);
    let reply = h
        .send("PUT", "/api/agent/v1/operations", Some(AGENT_SECRET), None)
        .await;
    assert_eq!((reply.status, reply.code()), (405, "method_not_allowed"));
    assert_error_shape(&reply);
    for path in ["/healthz", "/readyz"] {
        let reply = h.get(path, None).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("cache-control"), Some("no-store"));
    }
    assert_eq!(h.get("/healthz", None).await.body, json!({"ok": true}));
    assert_eq!(h.get("/readyz", None).await.body, json!({"ready": true}));
}

#[tokio::test]
async fn an_authenticated_client_missing_from_the_admission_config_is_403_client_unconfigured() {
    let dir = tempfile::tempdir().unwrap();
    let agent = unyolo_admission::Identity::new(AGENT).unwrap();
    let config = unyolo_admission::Config::from_bytes(ROOMY.as_bytes(), [agent]).unwrap();
    let h = start_with(unyolo_admission_broker::BrokerSettings {
        config,
        ..settings(dir.path(), ROOMY, unyolo_admission::StorageCaps::default())
    })
    .await;
    // An admission decision (counted as a refusal), but nothing stored or held.
    let (rows, before) = (h.rows().await, h.snapshot());
    let reply = h
        .submit(OTHER_SECRET, &request("key-1", "demo.request", 0))
        .await;
    assert_eq!((reply.status, reply.code()), (403, "client_unconfigured"));
    assert_error_shape(&reply);
    assert!(reply.retry_after().is_none());
    let after = h.snapshot();
    assert_eq!(h.rows().await, rows);
    assert_eq!(after.rejected(RefusalCode::ClientUnconfigured), 1);
    assert_eq!(after.clients, before.clients);
    assert!(after.is_idle());
    assert_eq!(
        h.submit(AGENT_SECRET, &request("key-1", "demo.request", 0))
            .await
            .status,
        202
    );
}
