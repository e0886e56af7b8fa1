//! Fuzz bodies for the operator listener's parsers of untrusted input: the Operator V1 decision
//! body and the request list's query string (with its opaque cursor).
//!
//! Each checks the parser against what the contract says, written here plainly: an accepted value
//! carries exactly what the input said and round-trips, and every refusal is a 400
//! `invalid_request` with one of the contract's two messages.

use axum::extract::Query;
use axum::http::{StatusCode, Uri};
use serde_json::Value;

use crate::api::operator::decisions::{Action, DecisionBody, parse_decision};
use crate::api::operator::error::{
    ErrorCode, INVALID_DECISION_BODY, INVALID_REQUEST, OperatorError,
};
use crate::api::operator::requests::{ListQuery, MAX_LIMIT, StatusGroup, parse_list_query};
use crate::store::OperationRecord;

/// The fields a `Decision` may have.
const DECISION_FIELDS: [&str; 5] = [
    "expected_revision",
    "idempotency_key",
    "on_behalf_of",
    "constraints",
    "notification",
];

fn assert_invalid(err: &OperatorError) {
    assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{err:?}");
    assert_eq!(err.code(), ErrorCode::InvalidRequest, "{err:?}");
    assert!(
        [INVALID_REQUEST, INVALID_DECISION_BODY].contains(&err.message()),
        "{err:?}"
    );
}

/// The action the first byte picks, and the body the rest is.
fn split(data: &[u8]) -> (Action, &[u8]) {
    let (first, body) = data.split_first().map_or((0, data), |(f, b)| (*f, b));
    let action = match first % 3 {
        0 => Action::Approve,
        1 => Action::Deny,
        _ => Action::Revoke,
    };
    (action, body)
}

/// Arbitrary bytes as a decision: the first byte picks the action, the rest is the body.
///
/// An accepted body is a JSON object of the contract's fields only, whose `expected_revision`
/// and trimmed `idempotency_key` are what was accepted; `constraints` only on an approve, no
/// `notification` on a revoke; re-rendered, it parses to the same decision and the same command
/// hash (64 hex digits, different for another operator). A refusal is a 400 `invalid_request`.
pub fn operator_decision(data: &[u8]) {
    let (action, body) = split(data);
    match parse_decision(action, body) {
        Ok(decision) => {
            let value: Value = serde_json::from_slice(body).expect("accepted bodies are JSON");
            let fields = value.as_object().expect("accepted bodies are objects");
            assert!(fields.keys().all(|k| DECISION_FIELDS.contains(&k.as_str())));
            assert_eq!(
                fields["expected_revision"].as_u64(),
                Some(decision.expected_revision)
            );
            assert!(decision.expected_revision >= 1);
            let key = fields["idempotency_key"].as_str().expect("a string key");
            assert_eq!(key.trim(), decision.idempotency_key);
            assert!(!decision.idempotency_key.is_empty());
            assert!(!decision.idempotency_key.contains(char::is_control));
            if let Some(who) = &decision.on_behalf_of {
                assert_eq!(who.trim(), who, "on_behalf_of is trimmed");
                assert!(!who.is_empty() && who.len() <= 200, "{who:?}");
            }
            assert!(action == Action::Approve || decision.constraints.is_none());
            assert!(action != Action::Revoke || decision.notification.is_none());
            let again = parse_decision(action, render(&decision).to_string().as_bytes())
                .unwrap_or_else(|e| panic!("a re-rendered decision is refused: {e:?}"));
            assert_eq!(again, decision);
            let hash = decision.command_hash("op_1", action, "ada");
            assert_eq!(hash.len(), 64);
            assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(hash, again.command_hash("op_1", action, "ada"));
            assert_ne!(hash, decision.command_hash("op_1", action, "bob"));
        }
        Err(err) => assert_invalid(&err),
    }
}

/// `decision` as the JSON body that says it.
fn render(decision: &DecisionBody) -> Value {
    let mut body = serde_json::json!({
        "expected_revision": decision.expected_revision,
        "idempotency_key": decision.idempotency_key,
    });
    if let Some(who) = &decision.on_behalf_of {
        body["on_behalf_of"] = Value::from(who.as_str());
    }
    if let Some(constraints) = &decision.constraints {
        let mut object = serde_json::Map::new();
        if let Some(seconds) = constraints.duration_seconds {
            object.insert("duration_seconds".into(), Value::from(seconds));
        }
        if let Some(uses) = constraints.max_uses {
            object.insert("max_uses".into(), uses.map_or(Value::Null, Value::from));
        }
        body["constraints"] = Value::Object(object);
    }
    if let Some(notification) = &decision.notification {
        body["notification"] = notification.clone();
    }
    body
}

/// Whether `data` is a decision the parser accepts (for the seeds named `valid_*`/`invalid_*`).
pub fn operator_decision_accepted(data: &[u8]) -> bool {
    let (action, body) = split(data);
    parse_decision(action, body).is_ok()
}

/// The query string as the list route decodes it; `None` when it never reaches the route.
fn list_pairs(data: &[u8]) -> Option<Vec<(String, String)>> {
    let text = std::str::from_utf8(data).ok()?;
    let uri = Uri::try_from(format!("/api/operator/v1/requests?{text}")).ok()?;
    Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .ok()
        .map(|Query(pairs)| pairs)
}

/// Arbitrary bytes as the request list's query string.
///
/// Accepted only when every name is one of the six or `target.<field>`, none of the six twice,
/// and then: the limit in 1–100 (not empty), `target.` fields only with a `target_kind`, no kind,
/// field or value blank, each value as given.
/// A cursor made for the accepted query continues it (and only it: not the same query with
/// another limit). A refusal is a 400 `invalid_request`, `request is invalid`.
pub fn operator_list_query(data: &[u8]) {
    let Some(pairs) = list_pairs(data) else {
        return;
    };
    let query = match parse_list_query(&pairs) {
        Ok(query) => query,
        Err(err) => {
            assert_invalid(&err);
            assert_eq!(err.message(), INVALID_REQUEST);
            return;
        }
    };
    const SINGLE: [&str; 6] = [
        "status",
        "requester",
        "operation",
        "target_kind",
        "cursor",
        "limit",
    ];
    for (i, (name, value)) in pairs.iter().enumerate() {
        if let Some(field) = name.strip_prefix("target.") {
            assert!(!field.trim().is_empty() && !value.trim().is_empty());
            assert!(query.target[field].contains(value));
        } else {
            assert!(SINGLE.contains(&name.as_str()), "{name}");
            assert!(pairs[..i].iter().all(|(earlier, _)| earlier != name));
        }
    }
    assert!((1..=MAX_LIMIT).contains(&query.limit));
    // `limit=` names no number, and a blank kind matches nothing: both refused, as upstream.
    assert!(pairs.iter().all(|(n, v)| n != "limit" || !v.is_empty()));
    assert!(
        query
            .target_kind
            .as_deref()
            .is_none_or(|k| !k.trim().is_empty())
    );
    assert!(query.target.is_empty() || query.target_kind.is_some());
    let given = |name: &str| {
        pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    };
    assert_eq!(query.requester.as_deref(), given("requester"));
    let group = match given("status") {
        Some("pending") => StatusGroup::Pending,
        Some("active") => StatusGroup::Active,
        Some("history") => StatusGroup::History,
        _ => StatusGroup::All,
    };
    assert_eq!(query.status, group);
    assert_eq!(query.after.is_some(), given("cursor").is_some());
    continues_only_itself(&pairs, &query);
}

/// A cursor made for `query` continues it, and not the query with another limit.
fn continues_only_itself(pairs: &[(String, String)], query: &ListQuery) {
    let record = OperationRecord::example("op_fuzz");
    let cursor = query.cursor_after(&record);
    let with = |limit: Option<String>| -> Vec<(String, String)> {
        let mut next: Vec<(String, String)> = pairs
            .iter()
            .filter(|(n, _)| n != "cursor" && (limit.is_none() || n != "limit"))
            .cloned()
            .collect();
        if let Some(limit) = limit {
            next.push(("limit".to_owned(), limit));
        }
        next.push(("cursor".to_owned(), cursor.clone()));
        next
    };
    let next = parse_list_query(&with(None)).expect("a query's own cursor continues it");
    assert_eq!(
        next.after,
        Some((record.created_at.clone(), record.id.clone()))
    );
    let other = if query.limit == MAX_LIMIT {
        1
    } else {
        query.limit + 1
    };
    assert!(parse_list_query(&with(Some(other.to_string()))).is_err());
}

/// Whether the list route accepts `data` as its query string.
pub fn operator_list_query_accepted(data: &[u8]) -> bool {
    list_pairs(data).is_some_and(|pairs| parse_list_query(&pairs).is_ok())
}
