//! An operation that needs approval as Operator V1's `BrokerRequest`, by this table:
//!
//! | operation | request `status` | `allowed_actions` | `used_count` |
//! | --- | --- | --- | --- |
//! | pending | `pending` (with `approval_bounds`, `pending_expires_at`) | approve, deny | 0 |
//! | approved, waiting for a slot | `active` | revoke | 0 |
//! | executing | `active` | none | 0 |
//! | succeeded, or failed after running | `consumed` | none | 1 |
//! | failed before running | `failed` | none | 0 |
//! | denied | `denied` | none | 0 |
//! | canceled from pending (by its client) | `canceled` | none | 0 |
//! | canceled from approved (by its client), or revoked | `revoked` | none | 0 |
//! | expired | `expired` | none | 0 |
//!
//! Every request is `mode: "execution"`: one exact action, used at most once
//! (`requested_max_uses` and `granted_max_uses` 1); its approval is good for
//! [`APPROVAL_SECONDS`], or the shorter `constraints.duration_seconds` the operator granted:
//! an approved request that has not started by its `active_expires_at` ends `expired` (the
//! `expiry` sweeper), as an unused unYOLO grant does.

use std::time::{Duration, SystemTime};

use serde_json::{Value, json};

use crate::api::presentation::{describe_target, presentation_json, truncate};
use crate::store::{OperationRecord, request_status};
use unyolo_admission::engine::OperationState;

/// `requested_duration_seconds` of every request, and the bound an approval's
/// `constraints.duration_seconds` may narrow: five minutes, unYOLO's default.
pub const APPROVAL_SECONDS: u64 = 300;

/// The longest `presentation.target`, in characters.
const TARGET_MAX: usize = 500;

/// The request's status as Operator V1 names it: the event log's own rule
/// ([`request_status`]), so a request and its events never disagree.
pub(crate) fn status(record: &OperationRecord) -> &'static str {
    request_status(record.state, record.ended_from).as_str()
}

/// The actions an operator may take now.
pub(crate) fn allowed_actions(record: &OperationRecord) -> &'static [&'static str] {
    match record.state {
        OperationState::Pending => &["approve", "deny"],
        OperationState::Approved => &["revoke"],
        _ => &[],
    }
}

/// When a request created at `created_at` stops waiting for a decision.
pub(crate) fn pending_expires_at(created_at: &str, pending_timeout: Duration) -> Option<String> {
    let created = humantime::parse_rfc3339(created_at).ok()?;
    Some(humantime::format_rfc3339_millis(created + pending_timeout).to_string())
}

/// When `record`, a request, stops waiting for a decision: the deadline fixed at its creation,
/// or (stored before schema 8) its `created_at` plus `pending_timeout`. `None` if unreadable.
pub(crate) fn pending_deadline(
    record: &OperationRecord,
    pending_timeout: Duration,
) -> Option<SystemTime> {
    match &record.pending_expires_at {
        Some(at) => humantime::parse_rfc3339(at).ok(),
        None => humantime::parse_rfc3339(&record.created_at)
            .ok()
            .map(|created| created + pending_timeout),
    }
}

/// Whether `record`, a request, has waited its whole pending time at `now`.
pub(crate) fn past_due(
    record: &OperationRecord,
    pending_timeout: Duration,
    now: SystemTime,
) -> bool {
    pending_deadline(record, pending_timeout).is_some_and(|due| due <= now)
}

/// Whether `record`'s approval has lapsed at `now` (it has an `active_expires_at`, and that has
/// come); an unreadable time counts as lapsed, so a damaged row never keeps work approved.
pub(crate) fn lapsed(record: &OperationRecord, now: SystemTime) -> bool {
    record
        .active_expires_at
        .as_deref()
        .is_some_and(|at| humantime::parse_rfc3339(at).map_or(true, |at| at <= now))
}

/// `record` as a `BrokerRequest`.
pub(crate) fn broker_request(record: &OperationRecord, pending_timeout: Duration) -> Value {
    let shown = presentation_json(&record.presentation);
    let mut presentation = json!({
        "risk": "low",
        "title": shown["title"],
        "target": truncate(&describe_target(&record.target), TARGET_MAX),
    });
    if let Some(summary) = shown.get("summary") {
        presentation["summary"] = summary.clone();
    }
    let used = u64::from(status(record) == "consumed");
    let mut request = json!({
        "id": record.id,
        "revision": record.revision,
        "requester": record.client_id,
        "operation": record.operation,
        "mode": "execution",
        "status": status(record),
        "requested_at": record.created_at,
        "requested_duration_seconds": APPROVAL_SECONDS,
        "requested_max_uses": 1,
        "granted_max_uses": 1,
        "used_count": used,
        "presentation": presentation,
        "allowed_actions": allowed_actions(record),
    });
    if !record.reason.is_empty() {
        request["request_reason"] = Value::from(record.reason.as_str());
    }
    if record.state == OperationState::Pending {
        request["approval_bounds"] =
            json!({"max_duration_seconds": APPROVAL_SECONDS, "max_uses": 1});
        if let Some(at) = &record.pending_expires_at {
            request["pending_expires_at"] = Value::from(at.as_str());
        } else if let Some(at) = pending_expires_at(&record.created_at, pending_timeout) {
            request["pending_expires_at"] = Value::from(at);
        }
    }
    if let Some(at) = &record.active_expires_at {
        request["active_expires_at"] = Value::from(at.as_str());
    }
    // A request nobody decided in time was settled by its expiry: upstream's pending expiry
    // sets `decided_at` (then), never `decided_by`.
    let expired_pending = record.state == OperationState::Expired
        && record.ended_from == Some(OperationState::Pending);
    if record.decided.is_none()
        && expired_pending
        && let Some(at) = &record.terminal_at
    {
        request["decided_at"] = Value::from(at.as_str());
    }
    // A request whose approved work failed before it ran: upstream sets `failed_at` with every
    // `status: failed` (its `failure_code` names activation failures only, so none is given).
    if status(record) == "failed"
        && let Some(at) = &record.terminal_at
    {
        request["failed_at"] = Value::from(at.as_str());
    }
    if let Some(decided) = &record.decided {
        request["decided_at"] = Value::from(decided.at.as_str());
        request["decided_by"] = Value::from(decided.by.as_str());
        if let Some(on_behalf_of) = &decided.on_behalf_of {
            request["decided_on_behalf_of"] = Value::from(on_behalf_of.as_str());
        }
    }
    request
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::Decided;

    /// A request of client `agent`, created 2026-01-01T00:00:00Z, in `state`, at revision 1.
    pub(crate) fn record(state: OperationState) -> OperationRecord {
        OperationRecord {
            target: json!({"repo": "demo"}),
            reason: "why".to_owned(),
            state,
            ..OperationRecord::example("op_1")
        }
    }

    #[test]
    fn a_request_is_past_due_from_the_instant_its_pending_time_ends() {
        let created = humantime::parse_rfc3339("2026-01-01T00:00:00Z").unwrap();
        let timeout = Duration::from_secs(300);
        let pending = record(OperationState::Pending);
        let just_before = created + timeout - Duration::from_millis(1);
        assert!(!past_due(&pending, timeout, just_before));
        assert!(past_due(&pending, timeout, created + timeout));
    }

    #[test]
    fn a_pending_request_shows_its_bounds_and_when_it_expires() {
        let shown = broker_request(&record(OperationState::Pending), Duration::from_secs(300));
        assert_eq!(shown["status"], "pending");
        assert_eq!(shown["allowed_actions"], json!(["approve", "deny"]));
        assert_eq!(shown["pending_expires_at"], "2026-01-01T00:05:00.000Z");
        assert_eq!(
            shown["approval_bounds"],
            json!({"max_duration_seconds": 300, "max_uses": 1})
        );
        assert_eq!(shown["presentation"]["target"], "repo=demo");
        assert!(shown.get("decided_at").is_none());
        // Stored at creation (schema 8): that deadline, whatever the timeout is now; the
        // timeout above only serves rows stored before.
        let fixed = OperationRecord {
            pending_expires_at: Some("2026-01-01T01:00:00.000Z".to_owned()),
            ..record(OperationState::Pending)
        };
        let shown = broker_request(&fixed, Duration::from_secs(300));
        assert_eq!(shown["pending_expires_at"], "2026-01-01T01:00:00.000Z");
        let created = humantime::parse_rfc3339("2026-01-01T00:00:00Z").unwrap();
        let timeout = Duration::from_secs(300);
        assert!(!past_due(&fixed, timeout, created + timeout));
        assert!(past_due(
            &fixed,
            timeout,
            created + Duration::from_secs(3600)
        ));
    }

    #[test]
    fn each_state_projects_to_the_specs_status_and_use_count() {
        let ended = |state, from| OperationRecord {
            ended_from: Some(from),
            ..record(state)
        };
        let canceled = |from| OperationRecord {
            decided: Some(Decided {
                at: "2026-01-01T00:00:01.000Z".to_owned(),
                by: "agent".to_owned(),
                on_behalf_of: None,
                revoked: from == OperationState::Approved,
            }),
            ..ended(OperationState::Canceled, from)
        };
        for (record, status, used, actions) in [
            (
                record(OperationState::Approved),
                "active",
                0,
                json!(["revoke"]),
            ),
            (record(OperationState::Executing), "active", 0, json!([])),
            (
                ended(OperationState::Succeeded, OperationState::Executing),
                "consumed",
                1,
                json!([]),
            ),
            (
                ended(OperationState::Failed, OperationState::Executing),
                "consumed",
                1,
                json!([]),
            ),
            (
                ended(OperationState::Failed, OperationState::Approved),
                "failed",
                0,
                json!([]),
            ),
            (
                ended(OperationState::Denied, OperationState::Pending),
                "denied",
                0,
                json!([]),
            ),
            (canceled(OperationState::Pending), "canceled", 0, json!([])),
            (canceled(OperationState::Approved), "revoked", 0, json!([])),
            (
                ended(OperationState::Expired, OperationState::Pending),
                "expired",
                0,
                json!([]),
            ),
        ] {
            let shown = broker_request(&record, Duration::from_secs(300));
            assert_eq!(shown["status"], status, "{record:?}");
            assert_eq!(shown["used_count"], used, "{record:?}");
            assert_eq!(shown["allowed_actions"], actions, "{record:?}");
            assert!(shown.get("approval_bounds").is_none(), "{record:?}");
        }
        // Only a request that failed before it ran shows when it failed.
        let at_end = |from| OperationRecord {
            terminal_at: Some("2026-01-01T00:02:00.000Z".to_owned()),
            ..ended(OperationState::Failed, from)
        };
        let failed = broker_request(&at_end(OperationState::Approved), Duration::from_secs(300));
        assert_eq!(failed["failed_at"], "2026-01-01T00:02:00.000Z");
        assert!(failed.get("failure_code").is_none(), "{failed}");
        let consumed = broker_request(&at_end(OperationState::Executing), Duration::from_secs(300));
        assert!(consumed.get("failed_at").is_none(), "{consumed}");
        let revoked = broker_request(
            &canceled(OperationState::Approved),
            Duration::from_secs(300),
        );
        assert_eq!(revoked["decided_by"], "agent");
    }

    #[test]
    fn a_pending_expiry_is_decided_at_its_end_by_nobody_and_a_lapse_keeps_its_approval() {
        let expired = |from| OperationRecord {
            ended_from: Some(from),
            terminal_at: Some("2026-01-01T00:05:00.000Z".to_owned()),
            ..record(OperationState::Expired)
        };
        let shown = broker_request(&expired(OperationState::Pending), Duration::from_secs(300));
        assert_eq!(shown["decided_at"], "2026-01-01T00:05:00.000Z");
        assert!(shown.get("decided_by").is_none(), "{shown}");
        // A lapsed approval keeps the approval's decision.
        let lapsed = OperationRecord {
            decided: Some(Decided {
                at: "2026-01-01T00:01:00.000Z".to_owned(),
                by: "operator".to_owned(),
                on_behalf_of: None,
                revoked: false,
            }),
            ..expired(OperationState::Approved)
        };
        let shown = broker_request(&lapsed, Duration::from_secs(300));
        assert_eq!(shown["decided_at"], "2026-01-01T00:01:00.000Z");
        assert_eq!(shown["decided_by"], "operator");
    }
}
