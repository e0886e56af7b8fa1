//! The quota a submission answer tells its client: the IETF httpapi `RateLimit-Policy` and
//! `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers, the two-field syntax of drafts 08 to
//! 10), written as structured fields (RFC 9651).
//!
//! Three policies, each a String item with parameters:
//!
//! - `"rate"`: the token bucket, `q` = `requests_per_window`, `w` = `window_seconds`.
//!   Its `RateLimit` item has `r` = tokens there now and `t` = seconds until one more token is
//!   there (0 when the bucket is full).
//! - `"active"` and `"pending"`: the client's live operations and its operations awaiting approval,
//!   `q` = the limit, quota unit `qu="concurrent-requests"`, no window (slots come back when work
//!   ends, not with time). `r` = slots free; `t` only when none is free: the capacity Retry-After
//!   hint.
//!
//! On a 429 the policy the refusal names carries the refusal's own Retry-After as its `t`, read
//! at the decision, so the two fields always agree. Refusals of a global dimension (global active,
//! the execution pool, the global pending-grant store) belong to no client policy: Retry-After
//! alone speaks for them.
//!
//! The two fields are written straight into one buffer each: every item is one of the constant
//! strings below (plain printable ASCII, nothing to escape) and every parameter a non-negative
//! integer saturated at the largest structured-field integer, so there is nothing a general
//! serializer would check. Every submission answer carries them, refusals included, and a
//! refusal flood is the path that exists to be cheap. The tests here and
//! `tests/broker_ratelimit_headers.rs` parse them back with a structured-field parser.

use std::fmt::Write as _;

use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;

use crate::core::Core;
use unyolo_admission::engine::{Controller, QuotaStatus, Refusal, RefusalCode};

/// The `RateLimit-Policy` field name.
pub const POLICY_FIELD: &str = "ratelimit-policy";
/// The `RateLimit` field name.
pub const LIMIT_FIELD: &str = "ratelimit";

/// The two field names, made once (a static name's clone copies nothing).
static POLICY_NAME: HeaderName = HeaderName::from_static(POLICY_FIELD);
static LIMIT_NAME: HeaderName = HeaderName::from_static(LIMIT_FIELD);

/// The policies' names, as structured-field Strings (quoted).
const RATE: &str = "\"rate\"";
const ACTIVE: &str = "\"active\"";
const PENDING: &str = "\"pending\"";
/// The capacity policies' quota unit parameter.
const CONCURRENT: &str = ";qu=\"concurrent-requests\"";

/// The largest structured-field Integer (15 decimal digits, RFC 9651 section 3.3.1).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// Room for either field of the largest values (every integer at 15 digits), so writing one
/// never grows its buffer.
const FIELD_CAPACITY: usize = 160;

/// The two field values for `status`; `refusal` when answering a 429.
pub fn fields(status: &QuotaStatus, refusal: Option<&Refusal>) -> (String, String) {
    let mut policy = String::with_capacity(FIELD_CAPACITY);
    policy.push_str(RATE);
    parameter(&mut policy, "q", u64::from(status.rate.quota));
    parameter(&mut policy, "w", u64::from(status.rate.window_seconds));
    for (name, capacity) in [(ACTIVE, status.active), (PENDING, status.pending)] {
        policy.push_str(", ");
        policy.push_str(name);
        parameter(&mut policy, "q", capacity.limit);
        policy.push_str(CONCURRENT);
    }

    let refused = refusal.map(|r| (r.code, r.retry_after_secs().max(1)));
    let reset_if_refused = |code: RefusalCode| {
        refused.and_then(|(refused_code, secs)| (refused_code == code).then_some(secs))
    };
    let capacity_retry = status.capacity_retry.as_secs().max(1);

    let mut limit = String::with_capacity(FIELD_CAPACITY);
    let rate_reset = reset_if_refused(RefusalCode::SubmissionRateLimited)
        .unwrap_or_else(|| status.rate.next_token_secs());
    limit.push_str(RATE);
    parameter(&mut limit, "r", status.rate.remaining);
    parameter(&mut limit, "t", rate_reset);
    let pending_refusal = reset_if_refused(RefusalCode::ClientPendingLimit).or_else(|| {
        // The per-client pending-grant cap is part of the pending policy's limit.
        reset_if_refused(RefusalCode::PendingGrantLimit).filter(|_| status.pending.remaining() == 0)
    });
    for (name, capacity, refused_here) in [
        (
            ACTIVE,
            status.active,
            reset_if_refused(RefusalCode::ClientOperationLimit),
        ),
        (PENDING, status.pending, pending_refusal),
    ] {
        let remaining = capacity.remaining();
        limit.push_str(", ");
        limit.push_str(name);
        parameter(&mut limit, "r", remaining);
        if let Some(secs) = refused_here {
            parameter(&mut limit, "t", secs);
        } else if remaining == 0 {
            parameter(&mut limit, "t", capacity_retry);
        }
    }
    (policy, limit)
}

/// Appends the parameter `;key=n` to `field`, `n` as a structured-field Integer (saturated at the
/// largest one).
fn parameter(field: &mut String, key: &str, n: u64) {
    field.push(';');
    field.push_str(key);
    field.push('=');
    // Writing to a `String` cannot fail.
    let _ = write!(field, "{}", n.min(SF_INTEGER_MAX));
}

/// `response` with the quota fields of `identity` added (unchanged for an identity that has no
/// quota, such as one no longer configured). `refusal` when the response answers it.
pub fn with_quota(
    response: Response,
    controller: &Controller,
    identity: &str,
    refusal: Option<&Refusal>,
) -> Response {
    let Some(status) = controller.quota(identity) else {
        return response;
    };
    with_status(response, &status, refusal)
}

/// `response` with the quota fields of `status` (the client's quota as the deciding backend saw
/// it) added; `refusal` when the response answers it.
pub fn with_status(
    mut response: Response,
    status: &QuotaStatus,
    refusal: Option<&Refusal>,
) -> Response {
    insert_fields(response.headers_mut(), status, refusal);
    response
}

/// Writes the quota fields of `status` into `headers` (see [`with_status`]).
pub(crate) fn insert_fields(
    headers: &mut axum::http::HeaderMap,
    status: &QuotaStatus,
    refusal: Option<&Refusal>,
) {
    let (policy, limit) = fields(status, refusal);
    for (name, value) in [(&POLICY_NAME, policy), (&LIMIT_NAME, limit)] {
        // A serialized structured field is visible ASCII, always a valid header value; taken
        // from the `String` it was written into, without a copy.
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.insert(name.clone(), value);
        }
    }
}

/// [`with_quota`] for the broker's own submission answers.
pub(crate) fn answer(
    core: &Core,
    identity: &str,
    response: Response,
    refusal: Option<&Refusal>,
) -> Response {
    with_quota(response, core.controller(), identity, refusal)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use unyolo_admission::engine::{CapacityQuota, RateQuota};

    fn status(remaining: u64, next_token_nanos: u64, active: u64, pending: u64) -> QuotaStatus {
        QuotaStatus {
            rate: RateQuota {
                quota: 60,
                window_seconds: 60,
                remaining,
                next_token_nanos,
            },
            active: CapacityQuota {
                limit: 25,
                used: active,
            },
            pending: CapacityQuota {
                limit: 10,
                used: pending,
            },
            capacity_retry: Duration::from_secs(2),
        }
    }

    #[test]
    fn a_full_bucket_and_free_slots_serialize_as_three_policies() {
        let (policy, limit) = fields(&status(60, 0, 0, 0), None);
        assert_eq!(
            policy,
            r#""rate";q=60;w=60, "active";q=25;qu="concurrent-requests", "pending";q=10;qu="concurrent-requests""#
        );
        assert_eq!(limit, r#""rate";r=60;t=0, "active";r=25, "pending";r=10"#);
    }

    #[test]
    fn an_exhausted_capacity_carries_the_capacity_hint_as_its_reset() {
        let (_, limit) = fields(&status(3, 400_000_000, 25, 10), None);
        assert_eq!(
            limit,
            r#""rate";r=3;t=1, "active";r=0;t=2, "pending";r=0;t=2"#
        );
    }

    #[test]
    fn the_refused_policy_resets_with_the_refusals_retry_after() {
        let refusal = Refusal {
            code: RefusalCode::SubmissionRateLimited,
            retry_after: Duration::from_secs(7),
        };
        let (_, limit) = fields(&status(0, 6_000_000_001, 1, 0), Some(&refusal));
        assert_eq!(limit, r#""rate";r=0;t=7, "active";r=24, "pending";r=10"#);
    }

    #[test]
    fn the_largest_values_saturate_and_still_parse_as_structured_field_lists() {
        let mut largest = status(u64::MAX, u64::MAX, 0, 0);
        largest.rate.quota = u32::MAX;
        largest.rate.window_seconds = u32::MAX;
        largest.active.limit = u64::MAX;
        largest.pending.limit = u64::MAX;
        let (policy, limit) = fields(&largest, None);
        assert!(policy.len() <= FIELD_CAPACITY && limit.len() <= FIELD_CAPACITY);
        assert_eq!(
            limit,
            format!(
                r#""rate";r=999999999999999;t={}, "active";r=999999999999999, "pending";r=999999999999999"#,
                largest.rate.next_token_secs()
            )
        );
        for field in [policy, limit] {
            let parsed: sfv::List = sfv::Parser::new(&field).parse().expect("a list");
            assert_eq!(parsed.len(), 3, "{field}");
        }
    }
}
