//! `POST /api/operator/v1/requests/{id}/{approve|deny|revoke}`: an operator's decision, in the
//! contract's order.
//!
//! 1. The path (an id past 128 characters is 400), then the credential (401), then the action
//!    (any other is 404 `route not found`).
//! 2. The body: `Content-Type: application/json` (parameters allowed; else 415), at most
//!    [`MAX_DECISION_BYTES`], read within the decisions' own room (`decision_room`, not the
//!    agents' buffered-bytes budget), strictly the contract's `Decision` (unknown or repeated
//!    fields, `null` where a value is due, trailing data, a constraint or notification bound
//!    broken: 400 `decision body is invalid`), then normalized as upstream's command is (a
//!    revision of at least 1, the key present, trimmed, at most 200 bytes, no control
//!    characters; `on_behalf_of` likewise; `constraints` only on approve, `notification` not on
//!    revoke: else 400 `request is invalid`). See [`parse_decision`].
//! 3. From here the decision is made, in one store transaction run to its end whether or not the
//!    operator waits (`Core::decide_to_end`): the idempotency record of
//!    (request, action, key) (the same command replays what it committed, 200 with
//!    `Idempotency-Replayed: true`; another is 409 `idempotency_conflict`), the request (404),
//!    its due lifecycle change (a request past its pending time, or an approval past its lapse,
//!    is expired first, as upstream applies due changes first, and judged again: so a decision
//!    on it is a stale one), `expected_revision` (409 `revision_conflict` with `current`), a
//!    `notification` (admission issues no decision tokens: 409 `invalid_decision_token`), the
//!    transition (409 `invalid_transition`), the constraints (may only narrow: 409
//!    `constraint_exceeded`). Then the state change, the revision and the decision's record
//!    commit together, and the controller's counts follow (a deny or revoke releases the
//!    request's slots).
//!
//! The command hash covers the whole normalized command, the operator's name included, so the
//! same key from another operator, for another revision or on behalf of someone else is a
//! conflict, not a replay.
//!
//! Past the usual size because its tests (about 320 lines, each check of the order above failing
//! alone) live beside it; the route itself is about 550 lines, one order of checks that holds only
//! read top to bottom.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::credential::OperatorName;
use super::error::{ErrorCode, OperatorError, OperatorResult};
use super::projection::{APPROVAL_SECONDS, broker_request, lapsed, past_due};
use super::requests::valid_id;
use crate::api::error::json_response;
use crate::api::extract::{is_json_object, read_body};
use crate::core::Core;
use crate::fairness::FairnessConfig;
use crate::registry;
use crate::store::{DecidedMove, DecisionCommand, DecisionOutcome, DecisionScope, OperationRecord};
use unyolo_admission::engine::OperationState;

/// The largest decision body, in bytes (unYOLO's `maxDecisionBodyBytes`).
pub const MAX_DECISION_BYTES: usize = 96 * 1024;

/// The bytes decision bodies may hold buffered at once, across every operator: one largest body
/// ([`MAX_DECISION_BYTES`]) per unit of the exempt reserve (`--exempt-reserved`, 32 by default:
/// 3 MiB), at least one. A room of their own, apart from the agents' buffered-bytes budget, so that
/// no client's load (bodies held or waiting there) can make a decision wait or be refused (the
/// exempt paths keep capacity reserved that no client's load takes); decisions wait only for other
/// decisions, and only an authenticated operator's body is read into it.
pub(crate) fn decision_room(fairness: &FairnessConfig) -> usize {
    MAX_DECISION_BYTES.saturating_mul(fairness.exempt_reserved_units.max(1) as usize)
}

/// The `Idempotency-Replayed` header of a replayed decision.
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The largest integer JSON carries exactly (2^53 - 1), the contract's bound on revisions.
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// What an operator decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Pending → approved (queued for execution).
    Approve,
    /// Pending → denied.
    Deny,
    /// Approved → canceled (shown as `revoked`).
    Revoke,
}

impl Action {
    /// The action a path segment names.
    pub fn from_path(segment: &str) -> Option<Action> {
        match segment {
            "approve" => Some(Action::Approve),
            "deny" => Some(Action::Deny),
            "revoke" => Some(Action::Revoke),
            _ => None,
        }
    }

    /// The action as the path spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Approve => "approve",
            Action::Deny => "deny",
            Action::Revoke => "revoke",
        }
    }
}

/// An approval's constraints: each may only narrow the request's bounds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Constraints {
    /// The approval's duration, in seconds (at least 1).
    pub duration_seconds: Option<u64>,
    /// The most uses: absent (`None`), unlimited (`Some(None)`), or a number 1–1,000,000.
    pub max_uses: Option<Option<u64>>,
}

/// A decision body, judged and normalized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionBody {
    /// The request's revision the operator decided on.
    pub expected_revision: u64,
    /// The key, trimmed.
    pub idempotency_key: String,
    /// Whom the operator decides for (absent when empty).
    pub on_behalf_of: Option<String>,
    /// Narrowed bounds (approve only).
    pub constraints: Option<Constraints>,
    /// A notification decision, as sent (never honoured: admission issues no tokens).
    pub notification: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireDecision {
    // Absent is 0 and blank, and a revision below 1 is taken, so that each is judged when the
    // command is normalized ("request is invalid"), as upstream's plain Go struct leaves them.
    #[serde(default)]
    expected_revision: i64,
    #[serde(default)]
    idempotency_key: String,
    #[serde(default, deserialize_with = "present")]
    on_behalf_of: Option<String>,
    #[serde(default, deserialize_with = "present")]
    constraints: Option<WireConstraints>,
    #[serde(default, deserialize_with = "present")]
    notification: Option<WireNotification>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireConstraints {
    #[serde(default, deserialize_with = "present")]
    duration_seconds: Option<u64>,
    #[serde(default, deserialize_with = "specified")]
    max_uses: Option<Option<u64>>,
}

#[derive(Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct WireNotification {
    kind: String,
    renderer: String,
    decision_token: String,
    chat_id: i64,
    message_id: u64,
    text: String,
    presentation_json: String,
    presentation_digest: String,
    rendered_digest: String,
}

/// A field that, when given, holds a value (`null` is refused).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// A field that, when given, holds a value or `null` (both are kept apart from absent).
fn specified<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// Whether `constraints` and `notification`, where given, are JSON objects (the body already
/// parsed as a decision, so it is valid JSON).
fn nested_are_objects(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Value>(bytes).is_ok_and(|body| {
        ["constraints", "notification"]
            .iter()
            .all(|field| body.get(field).is_none_or(Value::is_object))
    })
}

fn is_digest(text: &str) -> bool {
    text.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

fn chars_within(text: &str, min: usize, max: usize) -> bool {
    (min..=max).contains(&text.chars().count())
}

impl WireNotification {
    /// Whether it is the contract's `NotificationDecision` (every field within its bounds).
    fn valid(&self) -> bool {
        self.kind == "telegram"
            && chars_within(&self.renderer, 1, 64)
            && chars_within(&self.decision_token, 1, 200)
            && self.chat_id != 0
            && self.chat_id.unsigned_abs() <= MAX_SAFE_INTEGER
            && (1..=MAX_SAFE_INTEGER).contains(&self.message_id)
            && chars_within(&self.text, 1, 32_768)
            && chars_within(&self.presentation_json, 1, 65_536)
            && is_digest(&self.presentation_digest)
            && is_digest(&self.rendered_digest)
    }
}

/// Judges a decision body for `action` (see the module docs): 400 `decision body is invalid`
/// for a body that is not the contract's `Decision`, 400 `request is invalid` for one that does
/// not normalize (a revision below 1 or absent, a key absent, blank or past 200 bytes, a control
/// character, constraints on a deny or revoke, a notification on a revoke).
pub fn parse_decision(action: Action, bytes: &[u8]) -> Result<DecisionBody, OperatorError> {
    let wire: WireDecision =
        serde_json::from_slice(bytes).map_err(|_| OperatorError::invalid_body())?;
    // serde reads a struct from an array too: the body and its two nested objects must be
    // objects in the text (a decision is rare; reading it twice costs nothing that matters).
    if !is_json_object(bytes) || !nested_are_objects(bytes) {
        return Err(OperatorError::invalid_body());
    }
    let constraints_valid = wire.constraints.as_ref().is_none_or(|c| {
        c.duration_seconds
            .is_none_or(|d| (1..=MAX_SAFE_INTEGER).contains(&d))
            && c.max_uses
                .is_none_or(|uses| uses.is_none_or(|n| (1..=1_000_000).contains(&n)))
    });
    // The revision's bound is the contract's (JSON's exact integers); its floor, the key and
    // `on_behalf_of` are judged with the command below.
    let body_valid = wire.expected_revision <= MAX_SAFE_INTEGER as i64
        && constraints_valid
        && wire
            .notification
            .as_ref()
            .is_none_or(|n| n.valid() && wire.constraints.is_none());
    if !body_valid {
        return Err(OperatorError::invalid_body());
    }
    // Normalized as unYOLO's broker does: the texts trimmed, bounded in bytes too, and empty
    // constraints (`{}`, which its Go client sends) the same as none, for every action.
    let key = wire.idempotency_key.trim();
    let on_behalf_of = wire
        .on_behalf_of
        .as_deref()
        .map(str::trim)
        .filter(|who| !who.is_empty())
        .map(str::to_owned);
    let constraints = wire
        .constraints
        .filter(|c| c.duration_seconds.is_some() || c.max_uses.is_some());
    let normalizes = wire.expected_revision >= 1
        && !key.is_empty()
        && key.len() <= 200
        && !key.contains(char::is_control)
        && on_behalf_of
            .as_deref()
            .is_none_or(|who| who.len() <= 200 && !who.contains(char::is_control))
        && (action == Action::Approve || constraints.is_none())
        && (action != Action::Revoke || wire.notification.is_none());
    if !normalizes {
        return Err(OperatorError::invalid());
    }
    Ok(DecisionBody {
        expected_revision: wire.expected_revision as u64,
        idempotency_key: key.to_owned(),
        on_behalf_of,
        constraints: constraints.map(|c| Constraints {
            duration_seconds: c.duration_seconds,
            max_uses: c.max_uses,
        }),
        notification: wire
            .notification
            .map(|n| serde_json::to_value(n).expect("a notification serializes")),
    })
}

impl DecisionBody {
    /// The hash of the whole command: the request, the action, the operator and everything the
    /// body said (normalized).
    pub fn command_hash(&self, id: &str, action: Action, operator: &str) -> String {
        let constraints = self.constraints.as_ref().map(|c| {
            json!({
                "duration_seconds": c.duration_seconds,
                "max_uses": c.max_uses.flatten(),
                "max_uses_specified": c.max_uses.is_some(),
            })
        });
        // serde_json's maps are sorted: one text per command.
        let command = json!({
            "id": id,
            "action": action.as_str(),
            "operator": operator,
            "on_behalf_of": self.on_behalf_of,
            "expected_revision": self.expected_revision,
            "idempotency_key": self.idempotency_key,
            "constraints": constraints,
            "notification": self.notification,
        });
        let digest = Sha256::digest(command.to_string().as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Why a decision the store looked at was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Not a request (an operation that needs no approval).
    NotARequest,
    /// `expected_revision` is not the request's.
    Stale,
    /// A notification decision (admission issues no tokens).
    Token,
    /// The request's time ran out (its pending time, or its approval's lapse) but its expiry is
    /// not written yet: the caller expires it and judges the decision again.
    Due,
    /// The action is not allowed from the request's status.
    Transition,
    /// The constraints widen the bounds.
    Exceeded,
}

/// The contract's checks on the stored request, in its order; `live` is the state the
/// operation's lifecycle handle is in (`None`: not live).
fn judge(
    body: &DecisionBody,
    action: Action,
    record: &OperationRecord,
    live: Option<OperationState>,
    pending_timeout: Duration,
) -> Result<DecidedMove, Refusal> {
    if !registry::needs_approval(&record.operation) {
        return Err(Refusal::NotARequest);
    }
    // Due lifecycle changes come before the decision, as upstream applies them: a live request
    // past its pending time, or an approval past its lapse, is expired first, whether or not
    // the sweeper has got to it.
    let now = SystemTime::now();
    let due = match record.state {
        OperationState::Pending => past_due(record, pending_timeout, now),
        OperationState::Approved => lapsed(record, now),
        _ => false,
    };
    if due && live == Some(record.state) {
        return Err(Refusal::Due);
    }
    if record.revision != body.expected_revision {
        return Err(Refusal::Stale);
    }
    if body.notification.is_some() {
        return Err(Refusal::Token);
    }
    let (from, to, revoked) = match action {
        Action::Approve => (OperationState::Pending, OperationState::Approved, false),
        Action::Deny => (OperationState::Pending, OperationState::Denied, false),
        Action::Revoke => (OperationState::Approved, OperationState::Canceled, true),
    };
    if record.state != from || live != Some(from) {
        return Err(Refusal::Transition);
    }
    if let Some(constraints) = &body.constraints {
        let longer = constraints
            .duration_seconds
            .is_some_and(|d| d > APPROVAL_SECONDS);
        // Every request is used at most once: unlimited or more widen it.
        let more_uses = constraints
            .max_uses
            .is_some_and(|uses| uses.is_none_or(|n| n > 1));
        if longer || more_uses {
            return Err(Refusal::Exceeded);
        }
    }
    // An approval stays good for the duration granted (the requested one unless narrowed).
    let lasts = (action == Action::Approve).then(|| {
        let granted = body
            .constraints
            .as_ref()
            .and_then(|c| c.duration_seconds)
            .unwrap_or(APPROVAL_SECONDS);
        Duration::from_secs(granted)
    });
    Ok(DecidedMove { to, revoked, lasts })
}

/// The `{id}` and `{action}` of a decision route; the id judged before the credential, the
/// action after it.
pub(crate) struct DecisionPath {
    id: String,
    action: String,
}

impl<S: Send + Sync> FromRequestParts<S> for DecisionPath {
    type Rejection = OperatorError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &S,
    ) -> Result<DecisionPath, OperatorError> {
        let Path((id, action)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|_| OperatorError::invalid())?;
        valid_id(&id)?;
        Ok(DecisionPath { id, action })
    }
}

/// Whether the request says its body is JSON (`application/json`, parameters allowed).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// `POST /api/operator/v1/requests/{id}/{action}`.
pub(crate) async fn decide(
    State(core): State<Arc<Core>>,
    DecisionPath { id, action }: DecisionPath,
    OperatorName(operator): OperatorName,
    headers: HeaderMap,
    body: Body,
) -> OperatorResult {
    let Some(action) = Action::from_path(&action) else {
        return Err(OperatorError::no_route());
    };
    let count = |outcome: &'static str| {
        core.operator_decisions
            .get_or_create(&[("action", action.as_str()), ("outcome", outcome)])
            .inc();
    };
    if !is_json(&headers) {
        count("invalid_request");
        return Err(OperatorError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::InvalidRequest,
            "content type must be application/json",
        ));
    }
    // Read within the decisions' own room, never the agents' budget (see [`decision_room`]).
    let parsed = match read_body(&core.decision_budget, &headers, body, MAX_DECISION_BYTES).await {
        Ok((bytes, _held)) => parse_decision(action, &bytes),
        Err(err) => Err(OperatorError::from(err)),
    };
    let decision = parsed.inspect_err(|_| count("invalid_request"))?;
    let command = DecisionCommand {
        scope: DecisionScope {
            request_id: id.clone(),
            action: action.as_str().to_owned(),
            idempotency_key: decision.idempotency_key.clone(),
        },
        command_hash: decision.command_hash(&id, action, &operator),
        operator: operator.clone(),
        on_behalf_of: decision.on_behalf_of.clone(),
    };
    let timeout = core.pending_timeout;
    // A request whose time ran out is expired before it is judged, as upstream applies due
    // lifecycle changes first: what the sweeper has due now, then (`Refusal::Due`) one it has
    // taken but not written yet (its write waiting for the store, or to be retried).
    core.settle_expiries().await;
    let mut expired_first = false;
    let outcome = loop {
        let decision = decision.clone();
        // Decided: from here the decision runs to its end, whether or not the operator waits.
        let outcome = core
            .decide_to_end(
                command.clone(),
                move |record, live| judge(&decision, action, record, live, timeout),
                move |record| broker_request(record, timeout).to_string(),
            )
            .await
            .inspect_err(|_| count("storage_unavailable"))?;
        match outcome {
            // Once: the expiry leaves it expired (or in a state some other move made).
            DecisionOutcome::Refused(Refusal::Due, record) if !expired_first => {
                expired_first = true;
                core.expire_found_due(&record.id, record.state)
                    .await
                    .inspect_err(|_| count("storage_unavailable"))?;
            }
            outcome => break outcome,
        }
    };
    let current = |record: &OperationRecord| broker_request(record, timeout);
    match outcome {
        DecisionOutcome::Committed(record, _) => {
            count("committed");
            tracing::info!(
                request = %record.id,
                operator = %operator,
                action = action.as_str(),
                revision = record.revision,
                "operator decision committed"
            );
            Ok(json_response(StatusCode::OK, current(&record)))
        }
        DecisionOutcome::Replayed(committed) => {
            count("replayed");
            let mut response = (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                committed,
            )
                .into_response();
            response
                .headers_mut()
                .insert(IDEMPOTENCY_REPLAYED, HeaderValue::from_static("true"));
            Ok(response)
        }
        DecisionOutcome::IdempotencyConflict => {
            count("idempotency_conflict");
            Err(OperatorError::conflict(ErrorCode::IdempotencyConflict))
        }
        DecisionOutcome::NotFound | DecisionOutcome::Refused(Refusal::NotARequest, _) => {
            count("not_found");
            Err(OperatorError::no_request())
        }
        DecisionOutcome::Refused(Refusal::Stale, record) => {
            count("revision_conflict");
            Err(OperatorError::conflict(ErrorCode::RevisionConflict).with_current(current(&record)))
        }
        DecisionOutcome::Refused(Refusal::Token, _) => {
            count("invalid_decision_token");
            Err(OperatorError::conflict(ErrorCode::InvalidDecisionToken))
        }
        DecisionOutcome::Refused(Refusal::Transition | Refusal::Due, _) => {
            count("invalid_transition");
            Err(OperatorError::conflict(ErrorCode::InvalidTransition))
        }
        DecisionOutcome::Refused(Refusal::Exceeded, _) => {
            count("constraint_exceeded");
            Err(OperatorError::conflict(ErrorCode::ConstraintExceeded))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::operator::projection::tests::record;

    fn parse(action: Action, body: &str) -> Result<DecisionBody, OperatorError> {
        parse_decision(action, body.as_bytes())
    }

    #[test]
    fn a_pending_request_past_its_time_is_expired_before_it_is_judged_even_with_a_stale_revision() {
        let body = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k"}"#,
        )
        .unwrap();
        let pending = record(OperationState::Pending);
        // Created 2026-01-01: a year's timeout has not run out yet, five minutes have.
        let year = Duration::from_secs(2 * 365 * 24 * 3600);
        let judged = judge(
            &body,
            Action::Approve,
            &pending,
            Some(OperationState::Pending),
            year,
        );
        assert_eq!(
            judged,
            Ok(DecidedMove {
                to: OperationState::Approved,
                revoked: false,
                lasts: Some(Duration::from_secs(APPROVAL_SECONDS)),
            })
        );
        let five_minutes = Duration::from_secs(300);
        for action in [Action::Approve, Action::Deny] {
            let judged = judge(
                &body,
                action,
                &pending,
                Some(OperationState::Pending),
                five_minutes,
            );
            assert_eq!(judged, Err(Refusal::Due), "{action:?}");
        }
        // Before the revision: upstream applies the expiry first, so a stale decision sees it.
        let stale = parse(
            Action::Approve,
            r#"{"expected_revision":7,"idempotency_key":"k"}"#,
        )
        .unwrap();
        let live = Some(OperationState::Pending);
        let judged = judge(&stale, Action::Approve, &pending, live, five_minutes);
        assert_eq!(judged, Err(Refusal::Due));
        let judged = judge(&stale, Action::Approve, &pending, live, year);
        assert_eq!(judged, Err(Refusal::Stale));
        // Not live (nothing here to expire): refused as a transition the handle cannot make.
        let judged = judge(&body, Action::Approve, &pending, None, five_minutes);
        assert_eq!(judged, Err(Refusal::Transition));
        // An approved request is revoked whatever its age: the pending time bounds a wait only.
        let approved = record(OperationState::Approved);
        let judged = judge(
            &body,
            Action::Revoke,
            &approved,
            Some(OperationState::Approved),
            five_minutes,
        );
        assert!(matches!(judged, Ok(DecidedMove { revoked: true, .. })));
    }

    #[test]
    fn an_approval_lasts_the_duration_granted_and_a_lapsed_one_is_expired_not_revoked() {
        let year = Duration::from_secs(2 * 365 * 24 * 3600);
        let pending = record(OperationState::Pending);
        let narrowed = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"duration_seconds":60}}"#,
        )
        .unwrap();
        let judged = judge(
            &narrowed,
            Action::Approve,
            &pending,
            Some(OperationState::Pending),
            year,
        );
        assert_eq!(judged.map(|m| m.lasts), Ok(Some(Duration::from_secs(60))));
        // A deny grants nothing to last.
        let deny = parse(
            Action::Deny,
            r#"{"expected_revision":1,"idempotency_key":"k"}"#,
        )
        .unwrap();
        let judged = judge(
            &deny,
            Action::Deny,
            &pending,
            Some(OperationState::Pending),
            year,
        );
        assert_eq!(judged.map(|m| m.lasts), Ok(None));

        let revoke = parse(
            Action::Revoke,
            r#"{"expected_revision":1,"idempotency_key":"k"}"#,
        )
        .unwrap();
        let approved_until = |at: &str| OperationRecord {
            active_expires_at: Some(at.to_owned()),
            ..record(OperationState::Approved)
        };
        let live = Some(OperationState::Approved);
        for (until, lapsed) in [
            ("2000-01-01T00:00:00.000Z", true),
            ("not a time", true),
            ("2999-01-01T00:00:00.000Z", false),
        ] {
            let judged = judge(&revoke, Action::Revoke, &approved_until(until), live, year);
            if lapsed {
                assert_eq!(judged, Err(Refusal::Due), "{until}");
            } else {
                assert!(matches!(
                    judged,
                    Ok(DecidedMove {
                        revoked: true,
                        lasts: None,
                        ..
                    })
                ));
            }
        }
    }

    #[test]
    fn a_decision_and_its_nested_objects_are_objects_never_arrays_of_their_fields() {
        // Found by the operator_decision fuzz target: serde read `[1,"i"]` as a decision.
        for body in [
            r#"[1,"i"]"#,
            r#"  [1, "k", "telegram:42"]"#,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":[60]}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":[60,1]}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","notification":["telegram"]}"#,
        ] {
            let Err(err) = parse(Action::Approve, body) else {
                panic!("accepted {body}");
            };
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(err.message(), "decision body is invalid", "{body}");
        }
        let with_constraints = r#" {"expected_revision":1,"idempotency_key":"k","constraints":{"duration_seconds":60}}"#;
        assert!(parse(Action::Approve, with_constraints).is_ok());
    }

    #[test]
    fn a_plain_decision_parses_and_its_key_is_trimmed() {
        let body = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"  k1 ","on_behalf_of":"telegram:42"}"#,
        )
        .unwrap();
        assert_eq!(body.idempotency_key, "k1");
        assert_eq!(body.on_behalf_of.as_deref(), Some("telegram:42"));
        assert_eq!(body.expected_revision, 1);
    }

    #[test]
    fn bodies_that_are_not_the_contracts_decision_are_invalid() {
        for bad in [
            r#"{"expected_revision":1.0,"idempotency_key":"k"}"#,
            r#"{"expected_revision":"1","idempotency_key":"k"}"#,
            r#"{"expected_revision":9007199254740992,"idempotency_key":"k"}"#,
            r#"{"expected_revision":1,"idempotency_key":null}"#,
            r#"{"expected_revision":null,"idempotency_key":"k"}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","extra":1}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","idempotency_key":"j"}"#,
            r#"{"expected_revision":1,"idempotency_key":"k"} trailing"#,
            r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":null}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"max_uses":0}}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"duration_seconds":0}}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"other":1}}"#,
            r#"{"expected_revision":1,"idempotency_key":"k","notification":{"kind":"telegram"}}"#,
            r#"[]"#,
            "",
        ] {
            let err = parse(Action::Approve, bad).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(err.message(), "decision body is invalid", "{bad}");
        }
    }

    #[test]
    fn commands_that_do_not_normalize_are_invalid_requests() {
        let long_key = format!(
            r#"{{"expected_revision":1,"idempotency_key":"{}"}}"#,
            "k".repeat(201)
        );
        let long_who = format!(
            r#"{{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"{}"}}"#,
            "w".repeat(201)
        );
        // Absent, zero or negative revisions and absent, blank or long keys are commands that do
        // not normalize, as upstream judges them (not bodies that fail to decode).
        for (action, bad) in [
            (Action::Approve, r#"{"expected_revision":1}"#),
            (Action::Approve, r#"{"idempotency_key":"k"}"#),
            (
                Action::Approve,
                r#"{"expected_revision":0,"idempotency_key":"k"}"#,
            ),
            (
                Action::Deny,
                r#"{"expected_revision":-1,"idempotency_key":"k"}"#,
            ),
            (
                Action::Approve,
                r#"{"expected_revision":1,"idempotency_key":""}"#,
            ),
            (Action::Approve, long_key.as_str()),
            (Action::Revoke, long_who.as_str()),
            (
                Action::Approve,
                r#"{"expected_revision":1,"idempotency_key":"   "}"#,
            ),
            (
                Action::Approve,
                r#"{"expected_revision":1,"idempotency_key":"a\tb"}"#,
            ),
            (
                Action::Deny,
                r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"max_uses":null}}"#,
            ),
            (
                Action::Approve,
                r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"a\u0007"}"#,
            ),
            (
                Action::Approve,
                r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"ééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééé"}"#,
            ),
            (
                Action::Revoke,
                r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"max_uses":1}}"#,
            ),
        ] {
            let err = parse(action, bad).unwrap_err();
            assert_eq!(err.message(), "request is invalid", "{bad}");
        }
    }

    #[test]
    fn texts_are_trimmed_and_empty_constraints_are_none() {
        let padded = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":" k ","on_behalf_of":"  ada  "}"#,
        )
        .unwrap();
        let plain = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"ada"}"#,
        )
        .unwrap();
        assert_eq!(padded.on_behalf_of.as_deref(), Some("ada"));
        assert_eq!(
            padded.command_hash("op_1", Action::Approve, "op"),
            plain.command_hash("op_1", Action::Approve, "op"),
            "a retry differing only in spaces is the same command"
        );
        let blank = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"   "}"#,
        )
        .unwrap();
        assert_eq!(blank.on_behalf_of, None);
        for action in [Action::Approve, Action::Deny, Action::Revoke] {
            let empty = parse(
                action,
                r#"{"expected_revision":1,"idempotency_key":"k","constraints":{}}"#,
            )
            .unwrap();
            let none = parse(action, r#"{"expected_revision":1,"idempotency_key":"k"}"#).unwrap();
            assert!(empty.constraints.is_none());
            assert_eq!(
                empty.command_hash("op_1", action, "op"),
                none.command_hash("op_1", action, "op")
            );
        }
    }

    #[test]
    fn the_command_hash_covers_the_operator_and_every_field() {
        let body = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k"}"#,
        )
        .unwrap();
        let base = body.command_hash("op_1", Action::Approve, "ada");
        assert_eq!(base, body.command_hash("op_1", Action::Approve, "ada"));
        assert_ne!(base, body.command_hash("op_1", Action::Approve, "bob"));
        assert_ne!(base, body.command_hash("op_2", Action::Approve, "ada"));
        let other = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","on_behalf_of":"x"}"#,
        )
        .unwrap();
        assert_ne!(base, other.command_hash("op_1", Action::Approve, "ada"));
        let unlimited = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{"max_uses":null}}"#,
        )
        .unwrap();
        let absent = parse(
            Action::Approve,
            r#"{"expected_revision":1,"idempotency_key":"k","constraints":{}}"#,
        )
        .unwrap();
        assert_ne!(
            unlimited.command_hash("op_1", Action::Approve, "ada"),
            absent.command_hash("op_1", Action::Approve, "ada")
        );
    }
}
