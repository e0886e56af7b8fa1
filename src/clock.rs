//! Where the engine's time comes from.
//!
//! The engine only ever asks "how many nanoseconds since this controller started?". Production
//! reads `quanta`'s monotonic clock; tests use [`ManualClock`], which can also be stepped
//! backwards to prove the clamp. Whatever the source, the controller's monotonic wrapper clamps each reading to
//! the latest one seen, so time as the engine sees it never goes back: a backward step can neither
//! refill a bucket nor lock a client out for longer than its window.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of time in nanoseconds since an arbitrary origin fixed when the clock was made.
pub trait Clock: Send + Sync + 'static {
    /// The current reading. Implementations may go backwards; the controller clamps them.
    fn now_nanos(&self) -> u64;
}

/// The production clock: `quanta`'s monotonic, calibrated TSC (or OS) clock.
#[derive(Debug)]
pub struct QuantaClock {
    clock: quanta::Clock,
    origin: quanta::Instant,
}

impl QuantaClock {
    /// A clock whose origin is now.
    pub fn new() -> QuantaClock {
        let clock = quanta::Clock::new();
        let origin = clock.now();
        QuantaClock { clock, origin }
    }
}

impl Default for QuantaClock {
    fn default() -> Self {
        QuantaClock::new()
    }
}

impl Clock for QuantaClock {
    fn now_nanos(&self) -> u64 {
        // Saturating: quanta is monotonic, but a reading before the origin must not wrap.
        let elapsed = self.clock.now().saturating_duration_since(self.origin);
        u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// A clock moved by hand, for tests and drills. Cloning shares the same time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A manual clock reading zero.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        // Relaxed: the reading carries no other data with it.
        self.nanos.fetch_add(duration_nanos(by), Ordering::Relaxed);
    }

    /// Moves time backwards by `by` (saturating at zero), as a misbehaving clock would.
    pub fn rewind(&self, by: Duration) {
        let by = duration_nanos(by);
        // Relaxed: as above; fetch_update keeps the subtraction saturating.
        let _ = self
            .nanos
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(by))
            });
    }

    /// Sets the reading to `nanos`.
    pub fn set_nanos(&self, nanos: u64) {
        self.nanos.store(nanos, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_nanos(&self) -> u64 {
        self.nanos.load(Ordering::Relaxed)
    }
}

/// Clamps another clock so its readings never go backwards, and counts the times they tried.
pub(crate) struct MonotonicClock {
    source: Box<dyn Clock>,
    latest: AtomicU64,
    regressions: AtomicU64,
}

impl MonotonicClock {
    pub(crate) fn new(source: Box<dyn Clock>) -> MonotonicClock {
        let latest = source.now_nanos();
        MonotonicClock {
            source,
            latest: AtomicU64::new(latest),
            regressions: AtomicU64::new(0),
        }
    }

    /// The source's reading, or the latest reading seen if the source went backwards.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        let raw = self.source.now_nanos();
        // Relaxed: `latest` is a lone value; fetch_max makes concurrent updates keep the largest.
        let latest = self.latest.load(Ordering::Relaxed);
        if raw > latest {
            let prev = self.latest.fetch_max(raw, Ordering::Relaxed);
            return raw.max(prev);
        }
        if raw < latest {
            // Relaxed: a statistic.
            self.regressions.fetch_add(1, Ordering::Relaxed);
        }
        latest
    }

    /// How many readings were clamped because the source went backwards.
    pub(crate) fn regressions(&self) -> u64 {
        self.regressions.load(Ordering::Relaxed)
    }
}

pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_source_is_clamped_to_the_latest_reading() {
        let manual = ManualClock::new();
        manual.set_nanos(5_000);
        let clock = MonotonicClock::new(Box::new(manual.clone()));
        manual.advance(Duration::from_nanos(1_000));
        assert_eq!(clock.now(), 6_000);
        manual.rewind(Duration::from_secs(3600));
        assert_eq!(clock.now(), 6_000);
        assert_eq!(clock.regressions(), 1);
        manual.set_nanos(7_000);
        assert_eq!(clock.now(), 7_000);
    }

    #[test]
    fn quanta_clock_starts_near_zero_and_moves_forward() {
        let clock = QuantaClock::new();
        let a = clock.now_nanos();
        let b = clock.now_nanos();
        assert!(b >= a);
        assert!(a < 60 * 1_000_000_000);
    }
}
