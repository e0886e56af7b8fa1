//! What a client may still do: its quota as the engine sees it now, for the broker to tell the
//! client (the IETF `RateLimit` fields) so an agent can pace itself instead of learning its limits
//! by being refused.
//!
//! A reading is loads only: no token is taken, no slot reserved, nothing written (the clock is
//! peeked, not advanced), so asking costs the admission path nothing and changes no decision.

use std::time::Duration;

use crate::clock::whole_seconds_up;

use super::controller::Controller;
use crate::config::ClientLimits;

/// One client's quota at one moment (each count exactly, the set not as one atomic picture).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaStatus {
    /// The submission rate: the client's token bucket.
    pub rate: RateQuota,
    /// Live operations (pending, approved or executing) against the client's `active` limit.
    pub active: CapacityQuota,
    /// Operations awaiting approval against the client's `pending` limit (or the pending-grant
    /// store's per-client cap, where that is lower).
    pub pending: CapacityQuota,
    /// The Retry-After hint a capacity refusal carries (whole seconds, at least one).
    pub capacity_retry: Duration,
}

/// The state of a client's token bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateQuota {
    /// Tokens a full bucket holds: `requests_per_window`.
    pub quota: u32,
    /// The window over which `quota` tokens come back: `window_seconds`.
    pub window_seconds: u32,
    /// Tokens there now: submissions the rate allows right away.
    pub remaining: u64,
    /// Nanoseconds until one more token is there; zero when the bucket is full. When `remaining`
    /// is zero this is exactly the wait a rate refusal reports.
    pub next_token_nanos: u64,
}

impl RateQuota {
    /// [`RateQuota::next_token_nanos`] rounded up to whole seconds (as Retry-After is).
    pub fn next_token_secs(&self) -> u64 {
        whole_seconds_up(self.next_token_nanos)
    }
}

/// A count against its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacityQuota {
    /// The limit in force.
    pub limit: u64,
    /// Slots held now (restored work may hold more than a lowered limit).
    pub used: u64,
}

impl CapacityQuota {
    /// Slots still free (zero when at or above the limit).
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used)
    }
}

impl Controller {
    /// The quota of `identity` now, or `None` if it is not a configured identity (it cannot be
    /// admitted, so it has no quota). Reads only: reserves nothing and writes no atomic.
    pub fn quota(&self, identity: &str) -> Option<QuotaStatus> {
        let client = self.client(identity)?;
        let shared = self.shared();
        let settings = shared.settings.load();
        let limits = *client.settings(&settings);
        if !limits.configured {
            return None;
        }
        if limits.rescaling {
            drop(settings);
            self.wait_for_rescale(identity);
            return self.quota(identity);
        }
        let configured = settings.config.effective(identity)?;
        Some(QuotaStatus::of(
            configured,
            settings.caps.grant_client,
            settings.capacity_retry,
            client.bucket.level(shared.clock.peek(), limits.rate),
            client.active.get(),
            client.pending.get(),
        ))
    }
}

impl QuotaStatus {
    /// A client's quota from one reading: its configured `limits`, the pending-grant store's
    /// per-client cap, the capacity hint, its bucket's `level` (tokens there and nanoseconds to
    /// the next, as [`Bucket::level`](super::gcra::Bucket::level) reads them) and the slots it
    /// holds. One function for both backends: the engine reads its own atomics, the Redis backend
    /// what its admission script saw.
    pub(crate) fn of(
        limits: ClientLimits,
        grant_client: u64,
        capacity_retry: Duration,
        (remaining, next_token_nanos): (u64, u64),
        active: u64,
        pending: u64,
    ) -> QuotaStatus {
        QuotaStatus {
            rate: RateQuota {
                quota: limits.requests_per_window,
                window_seconds: limits.window_seconds,
                remaining,
                next_token_nanos,
            },
            active: CapacityQuota {
                limit: u64::from(limits.active),
                used: active,
            },
            pending: CapacityQuota {
                limit: u64::from(limits.pending).min(grant_client),
                used: pending,
            },
            capacity_retry,
        }
    }
}

/// The slots one client and the whole engine hold at one moment (each count exactly, the set
/// not as one atomic picture): what a shadow engine's peaks are taken from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Held {
    /// The client's live operations.
    pub(crate) active: u64,
    /// The client's operations awaiting approval.
    pub(crate) pending: u64,
    /// The client's operations executing.
    pub(crate) executing: u64,
    /// Every client's live operations.
    pub(crate) global_active: u64,
    /// Every client's operations executing.
    pub(crate) global_executing: u64,
}

impl Controller {
    /// The slots `identity` and the engine hold now; `None` for an identity with no state.
    /// Loads only, like [`Controller::quota`].
    pub(crate) fn held(&self, identity: &str) -> Option<Held> {
        let client = self.client(identity)?;
        let global = self.shared().global.get();
        Some(Held {
            active: client.active.get(),
            pending: client.pending.get(),
            executing: client.executing.get(),
            global_active: global.active,
            global_executing: global.executing,
        })
    }
}
