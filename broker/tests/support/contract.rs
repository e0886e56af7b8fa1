//! The Agent V1 contract as a JSON Schema (`tests/contract/agent_v1.schema.json`), and the check
//! every reply of the test harness goes through: the body a route sends must be the contract's
//! object for that route, and every error body the contract's envelope.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde_json::{Value, json};

const SCHEMA: &str = include_str!("../contract/agent_v1.schema.json");

/// The kinds of body the contract defines (the schema's `$defs` entries).
pub const KINDS: [&str; 7] = [
    "descriptor",
    "operation",
    "summary",
    "page",
    "error_envelope",
    "stream",
    "stream_deleted",
];

fn validators() -> &'static HashMap<&'static str, jsonschema::Validator> {
    static VALIDATORS: OnceLock<HashMap<&'static str, jsonschema::Validator>> = OnceLock::new();
    VALIDATORS.get_or_init(|| {
        let document: Value = serde_json::from_str(SCHEMA).expect("the schema is JSON");
        KINDS
            .iter()
            .map(|kind| {
                let mut schema = document.clone();
                schema["$ref"] = json!(format!("#/$defs/{kind}"));
                let validator = jsonschema::draft202012::new(&schema)
                    .unwrap_or_else(|e| panic!("the schema's {kind} does not compile: {e}"));
                (*kind, validator)
            })
            .collect()
    })
}

/// The schema's violations of `body` as `kind`, one line each (empty when it conforms).
pub fn violations(kind: &str, body: &Value) -> Vec<String> {
    let validator = validators()
        .get(kind)
        .unwrap_or_else(|| panic!("no schema for {kind}"));
    validator
        .iter_errors(body)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Panics unless `body` conforms to the schema's `kind`.
pub fn assert_conforms(kind: &str, body: &Value, what: &str) {
    let found = violations(kind, body);
    assert!(
        found.is_empty(),
        "{what}: the body is not a contract {kind}:\n  {}\n{body}",
        found.join("\n  ")
    );
}

/// The contract object a reply to `method path` with `status` must be, if the contract has one
/// for it (health, readiness and metrics bodies are not Agent V1 objects).
pub fn kind_of(method: &str, path: &str, status: u16) -> Option<&'static str> {
    if status >= 400 {
        return Some("error_envelope");
    }
    let path = path.split('?').next().unwrap_or(path);
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", [".well-known", "unyolo-agent"]) => Some("descriptor"),
        ("POST", ["api", "agent", "v1", "operations"]) => Some("operation"),
        ("GET", ["api", "agent", "v1", "operations"]) => Some("page"),
        ("GET", ["api", "agent", "v1", "operations", _]) => Some("operation"),
        ("GET", ["api", "agent", "v1", "operations", _, "events"]) => Some("operation"),
        ("POST", ["api", "agent", "v1", "operations", _, "cancel"]) => Some("operation"),
        ("POST", ["api", "agent", "v1", "streams"]) => Some("stream"),
        ("DELETE", ["api", "agent", "v1", "streams", _]) => Some("stream_deleted"),
        _ => None,
    }
}

/// Checks a reply against the contract object for its route (see [`kind_of`]).
pub fn check_reply(method: &str, path: &str, status: u16, body: &Value) {
    if let Some(kind) = kind_of(method, path, status) {
        assert_conforms(kind, body, &format!("{method} {path} → {status}"));
    }
}
