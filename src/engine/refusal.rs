//! Why an admission was refused, in the stable words clients and dashboards rely on.

use std::fmt;
use std::time::Duration;

use crate::clock::whole_seconds_up;
use crate::config::Pool;

/// The stable reason for a refusal. [`RefusalCode::as_str`] gives the wire code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefusalCode {
    /// The identity is not one the controller was configured with (HTTP 403, not a quota).
    ClientUnconfigured,
    /// The client's token bucket is empty.
    SubmissionRateLimited,
    /// The client already has its `active` limit of live operations.
    ClientOperationLimit,
    /// The client already has its `pending` limit of operations awaiting approval.
    ClientPendingLimit,
    /// The pending-grant store is full (globally, or for this client).
    PendingGrantLimit,
    /// The broker already has `global_active` live operations.
    GlobalOperationLimit,
    /// The execution pool is saturated (`global_executing` operations executing).
    GlobalExecutionLimit,
    /// The stream store is full (globally, or for this client).
    StreamStorageLimit,
    /// The sealed-payload store is full (globally, or for this client).
    SealedPayloadStorageLimit,
}

impl RefusalCode {
    /// Every code, in check order.
    pub const ALL: [RefusalCode; 9] = [
        RefusalCode::ClientUnconfigured,
        RefusalCode::SubmissionRateLimited,
        RefusalCode::ClientOperationLimit,
        RefusalCode::ClientPendingLimit,
        RefusalCode::PendingGrantLimit,
        RefusalCode::GlobalOperationLimit,
        RefusalCode::GlobalExecutionLimit,
        RefusalCode::StreamStorageLimit,
        RefusalCode::SealedPayloadStorageLimit,
    ];

    /// The stable wire code, e.g. `client_pending_limit`.
    pub const fn as_str(self) -> &'static str {
        match self {
            RefusalCode::ClientUnconfigured => "client_unconfigured",
            RefusalCode::SubmissionRateLimited => "submission_rate_limited",
            RefusalCode::ClientOperationLimit => "client_operation_limit",
            RefusalCode::ClientPendingLimit => "client_pending_limit",
            RefusalCode::PendingGrantLimit => "pending_grant_limit",
            RefusalCode::GlobalOperationLimit => "global_operation_limit",
            RefusalCode::GlobalExecutionLimit => "global_execution_limit",
            RefusalCode::StreamStorageLimit => "stream_storage_limit",
            RefusalCode::SealedPayloadStorageLimit => "sealed_payload_storage_limit",
        }
    }

    /// The HTTP status a broker answers with: 403 for an unconfigured client, else 429. A bare
    /// number so the engine needs no HTTP crate: `http::StatusCode::from_u16(code.http_status())`
    /// always succeeds.
    pub const fn http_status(self) -> u16 {
        match self {
            RefusalCode::ClientUnconfigured => 403,
            _ => 429,
        }
    }

    /// A human sentence for the error body's `message`, the same for every refusal with this
    /// code (it names no client and no limit value, so it is safe to show any caller). A broker
    /// serving unYOLO's Agent V1 says `Operation admission limit reached` instead, the one
    /// message that contract gives every refusal (the reference broker does); the code tells them
    /// apart.
    ///
    /// ```
    /// use unyolo_admission::RefusalCode;
    ///
    /// assert_eq!(
    ///     RefusalCode::ClientPendingLimit.message(),
    ///     "Too many of this client's operations are awaiting approval"
    /// );
    /// ```
    pub const fn message(self) -> &'static str {
        match self {
            RefusalCode::ClientUnconfigured => "This client is not configured for admission",
            RefusalCode::SubmissionRateLimited => "This client is submitting operations too fast",
            RefusalCode::ClientOperationLimit => "This client has too many live operations",
            RefusalCode::ClientPendingLimit => {
                "Too many of this client's operations are awaiting approval"
            }
            RefusalCode::PendingGrantLimit => "The approval inbox is full",
            RefusalCode::GlobalOperationLimit => "The broker has too many live operations",
            RefusalCode::GlobalExecutionLimit => {
                "The execution pool is saturated; new work is not accepted until it drains"
            }
            RefusalCode::StreamStorageLimit => "The stream store is full",
            RefusalCode::SealedPayloadStorageLimit => "The sealed-payload store is full",
        }
    }

    /// Whether this is a capacity refusal (answered with the configured Retry-After hint).
    pub const fn is_capacity(self) -> bool {
        !matches!(
            self,
            RefusalCode::ClientUnconfigured | RefusalCode::SubmissionRateLimited
        )
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for RefusalCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the fair share of a global pool refused a client a slot that first come, first served
/// would have given it (see [`FairShare`](crate::config::FairShare)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FairShareReason {
    /// Only the pool's reserve is free, and the client holds at least the floor: the reserve is
    /// kept for clients holding less.
    Reserve,
    /// The client holds at least its share: the pool less its reserve, divided among the clients
    /// holding in it.
    Share,
}

impl FairShareReason {
    /// The metric label: `reserve` or `share`.
    pub const fn as_str(self) -> &'static str {
        match self {
            FairShareReason::Reserve => "reserve",
            FairShareReason::Share => "share",
        }
    }

    /// Parses a label.
    pub fn parse(label: &str) -> Option<FairShareReason> {
        [FairShareReason::Reserve, FairShareReason::Share]
            .into_iter()
            .find(|r| r.as_str() == label)
    }
}

impl fmt::Display for FairShareReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal that the fair share of a global pool made: which pool, and why. The refusal's code
/// stays the pool's ([`FairShareRefusal::code`]) and its Retry-After the capacity hint; this is
/// what `admission_fair_share_refusals_total{pool,reason}` counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FairShareRefusal {
    /// The pool that refused.
    pub pool: Pool,
    /// Why.
    pub reason: FairShareReason,
}

impl FairShareRefusal {
    /// Every pool and reason, in the order [`Snapshot::fair_share_refusals`](crate::Snapshot)
    /// counts them.
    pub const ALL: [FairShareRefusal; 4] = [
        FairShareRefusal::new(Pool::Active, FairShareReason::Reserve),
        FairShareRefusal::new(Pool::Active, FairShareReason::Share),
        FairShareRefusal::new(Pool::Executing, FairShareReason::Reserve),
        FairShareRefusal::new(Pool::Executing, FairShareReason::Share),
    ];

    /// The refusal of `pool` for `reason`.
    pub const fn new(pool: Pool, reason: FairShareReason) -> FairShareRefusal {
        FairShareRefusal { pool, reason }
    }

    /// The refusal code it is answered with: the pool's.
    pub const fn code(self) -> RefusalCode {
        match self.pool {
            Pool::Active => RefusalCode::GlobalOperationLimit,
            Pool::Executing => RefusalCode::GlobalExecutionLimit,
        }
    }

    /// The fair-share refusal a refusal with `code` is, for `reason` (`None`: `code` is not a
    /// global pool's).
    pub const fn of(code: RefusalCode, reason: FairShareReason) -> Option<FairShareRefusal> {
        match code {
            RefusalCode::GlobalOperationLimit => Some(FairShareRefusal::new(Pool::Active, reason)),
            RefusalCode::GlobalExecutionLimit => {
                Some(FairShareRefusal::new(Pool::Executing, reason))
            }
            _ => None,
        }
    }

    /// Its place in [`FairShareRefusal::ALL`].
    pub const fn index(self) -> usize {
        let pool = match self.pool {
            Pool::Active => 0,
            Pool::Executing => 2,
        };
        pool + self.reason as usize
    }
}

impl fmt::Display for FairShareRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pool's {}", self.pool, self.reason)
    }
}

/// A refused admission (or storage reservation, or execution start): why, and when to retry.
///
/// A refusal consumes nothing: no token, no slot, no byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The first check that failed, in the contract's order.
    pub code: RefusalCode,
    /// When to try again, in whole seconds and at least one second; the largest hint among every
    /// exhausted dimension. Zero only for [`RefusalCode::ClientUnconfigured`], where retrying
    /// cannot help.
    pub retry_after: Duration,
}

impl Refusal {
    /// `retry_after` in whole seconds (zero for [`RefusalCode::ClientUnconfigured`]). Prefer
    /// [`Refusal::retry_after_header`], which says when there is no header to send.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs()
    }

    /// The `Retry-After` header value in whole seconds (at least one), or `None` where retrying
    /// cannot help and no header should be sent ([`RefusalCode::ClientUnconfigured`], a 403).
    ///
    /// ```
    /// use unyolo_admission::{Config, Controller, Identity, RefusalCode};
    ///
    /// let c = Controller::new(Config::defaults([Identity::new("bot-7").unwrap()]));
    /// let refusal = c.admit("stranger", false).unwrap_err();
    /// assert_eq!(refusal.code, RefusalCode::ClientUnconfigured);
    /// assert_eq!(refusal.retry_after_header(), None);
    /// assert_eq!(refusal.http_status(), 403);
    /// ```
    pub fn retry_after_header(&self) -> Option<u64> {
        (self.code != RefusalCode::ClientUnconfigured).then(|| self.retry_after.as_secs().max(1))
    }

    /// The HTTP status to answer with (see [`RefusalCode::http_status`]).
    pub fn http_status(&self) -> u16 {
        self.code.http_status()
    }

    /// The human sentence for the error body (see [`RefusalCode::message`]).
    pub fn message(&self) -> &'static str {
        self.code.message()
    }

    /// A refusal whose wait is `wait_nanos`, as [`retry_after`] tells it.
    pub(crate) fn after_nanos(code: RefusalCode, wait_nanos: u64) -> Refusal {
        Refusal {
            code,
            retry_after: retry_after(wait_nanos),
        }
    }
}

/// A wait of `wait_nanos` as a Retry-After: rounded up to whole seconds, at least one.
pub(crate) fn retry_after(wait_nanos: u64) -> Duration {
    Duration::from_secs(whole_seconds_up(wait_nanos).max(1))
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (retry after {}s)",
            self.code,
            self.retry_after.as_secs()
        )
    }
}

impl std::error::Error for Refusal {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_have_their_stable_strings_and_statuses() {
        let strings: Vec<_> = RefusalCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            strings,
            [
                "client_unconfigured",
                "submission_rate_limited",
                "client_operation_limit",
                "client_pending_limit",
                "pending_grant_limit",
                "global_operation_limit",
                "global_execution_limit",
                "stream_storage_limit",
                "sealed_payload_storage_limit"
            ]
        );
        assert_eq!(RefusalCode::ClientUnconfigured.http_status(), 403);
        assert!(RefusalCode::ALL[1..].iter().all(|c| c.http_status() == 429));
        assert!(
            RefusalCode::ALL
                .iter()
                .enumerate()
                .all(|(i, c)| c.index() == i)
        );
    }

    #[test]
    fn only_an_unconfigured_client_gets_no_retry_after_header() {
        let unconfigured = Refusal {
            code: RefusalCode::ClientUnconfigured,
            retry_after: Duration::ZERO,
        };
        assert_eq!(unconfigured.retry_after_header(), None);
        for &code in &RefusalCode::ALL[1..] {
            assert_eq!(
                Refusal::after_nanos(code, 2_500_000_000).retry_after_header(),
                Some(3)
            );
        }
    }

    #[test]
    fn each_fair_share_refusal_has_its_place_and_its_pools_code() {
        for (i, refusal) in FairShareRefusal::ALL.into_iter().enumerate() {
            assert_eq!(refusal.index(), i);
            assert_eq!(
                FairShareRefusal::of(refusal.code(), refusal.reason),
                Some(refusal)
            );
        }
        assert_eq!(
            FairShareRefusal::of(RefusalCode::ClientOperationLimit, FairShareReason::Share),
            None
        );
    }

    #[test]
    fn every_code_has_its_own_message() {
        let messages: std::collections::BTreeSet<_> =
            RefusalCode::ALL.iter().map(|c| c.message()).collect();
        assert_eq!(messages.len(), RefusalCode::ALL.len());
    }

    #[test]
    fn waits_round_up_to_whole_seconds_and_at_least_one() {
        assert_eq!(
            Refusal::after_nanos(RefusalCode::SubmissionRateLimited, 1).retry_after_secs(),
            1
        );
        assert_eq!(
            Refusal::after_nanos(RefusalCode::SubmissionRateLimited, 0).retry_after_secs(),
            1
        );
        assert_eq!(
            Refusal::after_nanos(RefusalCode::SubmissionRateLimited, 1_000_000_001)
                .retry_after_secs(),
            2
        );
        assert_eq!(
            Refusal::after_nanos(RefusalCode::SubmissionRateLimited, 3_000_000_000)
                .retry_after_secs(),
            3
        );
    }
}
