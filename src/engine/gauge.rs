//! The one reservation primitive every limit is built on: a count that is only ever raised by
//! compare-and-swap *if it is below its limit*, and lowered by compare-and-swap *if it is above
//! zero*. So no interleaving can push it past its limit, not even for an instant, and no repeated
//! release can wrap it below zero.

use crate::sync::{AtomicU64, Ordering};

/// A bounded count of held slots (operations, files, bytes).
#[derive(Debug)]
pub(crate) struct Gauge {
    held: AtomicU64,
}

impl Gauge {
    pub(crate) fn new() -> Gauge {
        Gauge {
            held: AtomicU64::new(0),
        }
    }

    /// The current count.
    #[inline]
    pub(crate) fn get(&self) -> u64 {
        // Relaxed: callers read a count, nothing published with it.
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `n` slots if that keeps the count at or below `limit`. Returns whether it did.
    #[inline]
    pub(crate) fn try_acquire(&self, n: u64, limit: u64) -> bool {
        if n == 0 {
            return true; // Taking nothing fits even where restored usage is above the limit.
        }
        // Relaxed throughout: the count is the only data; the CAS alone guarantees that every
        // increment was decided against the value it replaced, which is what bounds the count.
        let mut current = self.held.load(Ordering::Relaxed);
        loop {
            let Some(next) = current.checked_add(n) else {
                return false;
            };
            if next > limit {
                return false;
            }
            match self.held.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// Adds `n` slots regardless of the limit (start-up recovery: restored work counts even when
    /// it exceeds a lowered limit).
    pub(crate) fn force_acquire(&self, n: u64) {
        // Relaxed: as in try_acquire. Saturating so a corrupt restore cannot wrap.
        let _ = self
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_add(n))
            });
    }

    /// Returns `n` slots. Never goes below zero; returns `false` if fewer than `n` were held
    /// (which would be a bookkeeping bug: the count is then set to zero rather than wrapping).
    #[inline]
    pub(crate) fn release(&self, n: u64) -> bool {
        let mut current = self.held.load(Ordering::Relaxed);
        loop {
            let next = current.saturating_sub(n);
            // Relaxed: as in try_acquire.
            match self.held.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    // Releasing more than was held is a bookkeeping bug; make tests fail loudly.
                    debug_assert!(
                        current >= n,
                        "released {n} slots but only {current} were held"
                    );
                    return current >= n;
                }
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn acquire_stops_at_the_limit() {
        let g = Gauge::new();
        assert!(g.try_acquire(1, 2));
        assert!(g.try_acquire(1, 2));
        assert!(!g.try_acquire(1, 2));
        assert_eq!(g.get(), 2);
    }

    #[test]
    #[cfg(not(debug_assertions))]
    fn release_never_goes_below_zero() {
        let g = Gauge::new();
        assert!(g.try_acquire(1, 5));
        assert!(g.release(1));
        assert!(!g.release(1));
        assert_eq!(g.get(), 0);
    }

    #[test]
    fn multi_slot_acquire_is_all_or_nothing() {
        let g = Gauge::new();
        assert!(g.try_acquire(7, 10));
        assert!(!g.try_acquire(4, 10));
        assert_eq!(g.get(), 7);
        assert!(g.try_acquire(3, 10));
    }

    #[test]
    fn taking_nothing_always_fits() {
        let g = Gauge::new();
        g.force_acquire(5);
        assert!(g.try_acquire(0, 3));
        assert_eq!(g.get(), 5);
    }

    #[test]
    fn forced_acquire_may_exceed_the_limit_and_then_blocks_new_work() {
        let g = Gauge::new();
        g.force_acquire(5);
        assert!(!g.try_acquire(1, 3));
        assert_eq!(g.get(), 5);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Three threads race to take two slots: exactly two succeed, the count never passes the
    /// limit, and releasing what was taken brings it back to zero.
    #[test]
    fn loom_gauge_never_exceeds_its_limit() {
        loom::model(|| {
            let gauge = Arc::new(Gauge::new());
            let handles: Vec<_> = (0..3)
                .map(|_| {
                    let gauge = gauge.clone();
                    thread::spawn(move || {
                        let got = gauge.try_acquire(1, 2);
                        assert!(gauge.get() <= 2);
                        got
                    })
                })
                .collect();
            let won = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&w| w)
                .count();
            assert_eq!(won, 2);
            assert_eq!(gauge.get(), 2);
            assert!(gauge.release(1));
            assert!(gauge.release(1));
            assert_eq!(gauge.get(), 0);
        });
    }

    /// A release racing an acquire at the limit never wraps and leaves a consistent count.
    #[test]
    fn loom_release_racing_acquire_keeps_count_consistent() {
        loom::model(|| {
            let gauge = Arc::new(Gauge::new());
            assert!(gauge.try_acquire(1, 1));
            let g2 = gauge.clone();
            let releaser = thread::spawn(move || g2.release(1));
            let got = gauge.try_acquire(1, 1);
            assert!(releaser.join().unwrap());
            assert_eq!(gauge.get(), if got { 1 } else { 0 });
        });
    }
}
