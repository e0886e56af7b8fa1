//! Where the engine's time comes from.
//!
//! The engine only ever asks "how many nanoseconds since this controller started?". Production
//! reads `quanta`'s monotonic clock; tests use [`ManualClock`], which can also be stepped
//! backwards to prove the clamp. Whatever the source, the controller's monotonic wrapper clamps each reading to
//! the latest one seen, so time as the engine sees it never goes back: a backward step can neither
//! refill a bucket nor lock a client out for longer than its window.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::sync::Arc;

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

/// How far a reading may run ahead of the last published one before it is published. Publishing
/// every reading would make every admission write one word shared by all threads; publishing at
/// most every millisecond of progress keeps that word read-mostly.
const PUBLISH_STRIDE: u64 = 1_000_000;

/// Clamps another clock so time as the engine sees it never goes back, and counts the times the
/// source tried.
///
/// When the source steps back, the reading is clamped to the latest one published and the step is
/// absorbed into an offset, so time then *continues* from where it was instead of standing still
/// until the source catches up: a backward step can neither refill a bucket (time never jumps
/// forward) nor lock a client out for longer than its window (time never freezes). Readings are
/// published at most every [`PUBLISH_STRIDE`], so a step back smaller than that stride passes
/// through unclamped. That is harmless by construction: an earlier time can only make a bucket
/// look emptier, never refill it, and the next forward reading refills nothing that real time did
/// not.
pub(crate) struct MonotonicClock {
    source: Box<dyn Clock>,
    state: CachePadded<ClampState>,
}

struct ClampState {
    /// The latest published reading (after the offset).
    latest: AtomicU64,
    /// Nanoseconds added to every source reading: the sum of the backward steps absorbed.
    offset: AtomicU64,
    regressions: AtomicU64,
}

impl MonotonicClock {
    pub(crate) fn new(source: Box<dyn Clock>) -> MonotonicClock {
        let latest = source.now_nanos();
        MonotonicClock {
            source,
            state: CachePadded::new(ClampState {
                latest: AtomicU64::new(latest),
                offset: AtomicU64::new(0),
                regressions: AtomicU64::new(0),
            }),
        }
    }

    /// The source's reading plus the absorbed offset, never below the latest published reading.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        let state = &*self.state;
        // Relaxed: `latest` and `offset` are lone values that publish no other data. `latest` is
        // loaded before the source is read so that, for a well-behaved source, it cannot exceed
        // this reading; a stale (smaller) value only makes the comparison below more lenient.
        let latest = state.latest.load(Ordering::Relaxed);
        let offset = state.offset.load(Ordering::Relaxed);
        let now = self.source.now_nanos().saturating_add(offset);
        if now >= latest {
            if now - latest >= PUBLISH_STRIDE {
                // Relaxed: fetch_max keeps the largest of concurrent publications.
                state.latest.fetch_max(now, Ordering::Relaxed);
            }
            return now;
        }
        if latest - now > PUBLISH_STRIDE {
            // A real step back (not just a neighbour's reading published a moment ago): absorb it
            // so time continues from `latest`. Relaxed: statistics and a lone value; if another
            // thread absorbed the step first the CAS fails and this reading is clamped anyway.
            state.regressions.fetch_add(1, Ordering::Relaxed);
            let _ = state.offset.compare_exchange(
                offset,
                offset + (latest - now),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        latest
    }

    /// The time as [`MonotonicClock::now`] would give it, without publishing the reading or
    /// absorbing a step back: a pure read, for observers that must not write.
    #[inline]
    pub(crate) fn peek(&self) -> u64 {
        let state = &*self.state;
        // Relaxed: lone values, as in `now`.
        let latest = state.latest.load(Ordering::Relaxed);
        let offset = state.offset.load(Ordering::Relaxed);
        self.source.now_nanos().saturating_add(offset).max(latest)
    }

    /// How many backward steps of the source were absorbed.
    pub(crate) fn regressions(&self) -> u64 {
        self.state.regressions.load(Ordering::Relaxed)
    }
}

pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `nanos` in whole seconds, rounded up: a wait of 1.2 s is told as 2 s, so a client that waits
/// what it is told never arrives early.
pub(crate) fn whole_seconds_up(nanos: u64) -> u64 {
    nanos.div_ceil(1_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_step_is_clamped_then_time_continues_from_there() {
        let manual = ManualClock::new();
        manual.set_nanos(5_000_000);
        let clock = MonotonicClock::new(Box::new(manual.clone()));
        manual.advance(Duration::from_millis(1));
        assert_eq!(clock.now(), 6_000_000);
        manual.rewind(Duration::from_secs(3600));
        assert_eq!(clock.now(), 6_000_000, "clamped to the latest reading");
        assert_eq!(clock.regressions(), 1);
        manual.advance(Duration::from_millis(3));
        assert_eq!(
            clock.now(),
            9_000_000,
            "and it flows on from there, not an hour later"
        );
    }

    #[test]
    fn readings_never_go_back_by_more_than_the_publish_stride() {
        let manual = ManualClock::new();
        let clock = MonotonicClock::new(Box::new(manual.clone()));
        let mut last = 0;
        for step in 0..1_000u64 {
            if step % 7 == 0 {
                manual.rewind(Duration::from_micros(step * 13));
            } else {
                manual.advance(Duration::from_micros(step % 90));
            }
            let now = clock.now();
            assert!(
                now + PUBLISH_STRIDE >= last,
                "went back from {last} to {now}"
            );
            last = last.max(now);
        }
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
