//! Redis's units, and the in-process engine's: rates in µs (the emission interval and the burst
//! span), lifetimes in ms, Retry-After hints in whole seconds.

use std::time::Duration;

/// A rate in Redis's unit (µs): the emission interval and the burst span.
pub(super) fn rate_micros(requests: u32, window_seconds: u32) -> (u64, u64) {
    let requests = u64::from(requests.max(1));
    let window = u64::from(window_seconds.max(1)) * 1_000_000;
    let interval = (window / requests).max(1);
    (interval, interval * requests)
}

/// A hint in whole seconds, at least one, as the in-process engine rounds it.
pub(super) fn secs_at_least_one(d: Duration) -> Duration {
    crate::engine::refusal::retry_after(crate::clock::duration_nanos(d))
}

/// A lifetime in ms, at least one.
pub(super) fn ttl_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
