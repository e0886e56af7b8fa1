//! The vendored Operator V1 contract is the one the broker pins: its digest, recomputed by
//! unYOLO's recipe, equals the constant the discovery and health routes serve; and the
//! validators built from it accept the contract's objects and refuse what its closed schemas
//! forbid (an extra field, a value outside an enum, a timestamp that is not RFC 3339).

mod support;

use serde_json::{Value, json};
use support::operator_contract::{check, recomputed_digest, violations};

#[test]
fn the_vendored_contract_recomputes_to_the_pinned_operator_v1_digest() {
    let digest = recomputed_digest();
    assert_eq!(
        digest,
        "sha256:ab10778e2838f660157b000e442a1b97c5217fd92e66107122451b6894f0b9d3"
    );
    assert_eq!(
        digest,
        unyolo_admission_broker::discovery::OPERATOR_CONTRACT_DIGEST
    );
}

fn request() -> Value {
    json!({
        "id": "op_0123456789abcdef0123456789abcdef",
        "revision": 1,
        "requester": "agent-1",
        "operation": "demo.request",
        "mode": "execution",
        "status": "pending",
        "requested_at": "2026-12-01T12:00:00.123Z",
        "pending_expires_at": "2026-12-01T12:05:00.123Z",
        "requested_duration_seconds": 300,
        "requested_max_uses": 1,
        "granted_max_uses": 1,
        "used_count": 0,
        "request_reason": "deploy the demo",
        "presentation": {"risk": "unknown", "title": "Run demo.request", "target": "repo=demo"},
        "allowed_actions": ["approve", "deny"],
        "approval_bounds": {"max_duration_seconds": 300, "max_uses": 1}
    })
}

fn event() -> Value {
    json!({
        "cursor": "AAAAAAAAAAE",
        "kind": "request.created",
        "request_id": "op_0123456789abcdef0123456789abcdef",
        "revision": 1,
        "status": "pending",
        "occurred_at": "2026-12-01T12:00:00.123Z",
        "used_count": 0
    })
}

/// The violations of `body` changed by `change`, which must not be empty.
fn refused(component: &str, body: &Value, change: impl FnOnce(&mut Value)) -> Vec<String> {
    let mut changed = body.clone();
    change(&mut changed);
    let found = violations(component, &changed);
    assert!(!found.is_empty(), "{component} accepted {changed}");
    found
}

#[test]
fn a_valid_broker_request_and_broker_event_conform() {
    check("BrokerRequest", &request());
    check("BrokerEvent", &event());
    check(
        "RequestPage",
        &json!({"requests": [request()], "event_cursor": "AAAAAAAAAAE"}),
    );
    check(
        "ErrorEnvelope",
        &json!({"error": {"code": "revision_conflict", "message": "request changed; refresh before deciding",
            "correlation_id": "AAAAAAAAAAAAAAAAAAAAAA", "current": request()}}),
    );
    let digest = "sha256:ab10778e2838f660157b000e442a1b97c5217fd92e66107122451b6894f0b9d3";
    check(
        "Descriptor",
        &json!({"api_version": "unyolo.io/operator/v1", "contract_digest": digest, "build_id": "0.1.0+abc"}),
    );
    check(
        "Health",
        &json!({"status": "ok", "contract_digest": digest, "build_id": "0.1.0+abc"}),
    );
}

#[test]
fn an_extra_field_is_refused_at_the_top_and_inside_nested_objects() {
    let found = refused("BrokerEvent", &event(), |e| e["actor"] = json!("operator"));
    assert!(found.iter().any(|v| v.contains("actor")), "{found:?}");
    let found = refused("BrokerRequest", &request(), |r| {
        r["presentation"]["color"] = json!("red")
    });
    assert!(found.iter().any(|v| v.contains("color")), "{found:?}");
}

#[test]
fn a_value_outside_an_enum_is_refused() {
    let found = refused("BrokerEvent", &event(), |e| {
        e["kind"] = json!("request.revoked")
    });
    assert!(found.iter().any(|v| v.starts_with("/kind")), "{found:?}");
    let found = refused("BrokerRequest", &request(), |r| {
        r["status"] = json!("approved")
    });
    assert!(found.iter().any(|v| v.starts_with("/status")), "{found:?}");
    let found = refused(
        "ErrorEnvelope",
        &json!({"error": {"code": "x", "message": "m", "correlation_id": "c"}}),
        |e| e["error"]["code"] = json!("request_not_found"),
    );
    assert!(
        found.iter().any(|v| v.starts_with("/error/code")),
        "{found:?}"
    );
}

#[test]
fn a_timestamp_that_is_not_rfc_3339_is_refused() {
    for bad in [
        "2026-12-01 12:00:00Z",
        "2026-12-01T12:00:00",
        "yesterday",
        "2026-13-01T12:00:00Z",
    ] {
        let found = refused("BrokerEvent", &event(), |e| e["occurred_at"] = json!(bad));
        assert!(
            found.iter().any(|v| v.starts_with("/occurred_at")),
            "{bad}: {found:?}"
        );
        let found = refused("BrokerRequest", &request(), |r| {
            r["pending_expires_at"] = json!(bad)
        });
        assert!(
            found.iter().any(|v| v.starts_with("/pending_expires_at")),
            "{bad}: {found:?}"
        );
    }
}

#[test]
fn a_missing_required_field_or_an_out_of_bounds_value_is_refused() {
    refused("BrokerEvent", &event(), |e| {
        e.as_object_mut().unwrap().remove("cursor");
    });
    refused("BrokerEvent", &event(), |e| e["cursor"] = json!(""));
    refused("BrokerEvent", &event(), |e| e["revision"] = json!(0));
    refused("BrokerRequest", &request(), |r| {
        r["requester"] = json!("a".repeat(81))
    });
    refused("BrokerRequest", &request(), |r| {
        r["allowed_actions"] = json!(["approve", "approve"])
    });
}
