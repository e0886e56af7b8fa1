//! A client's count in one global pool (its live operations, or its executing ones): the
//! reservation primitive of [`Gauge`](super::gauge::Gauge), which also says when the client
//! starts and stops *holding* in the pool — its count going 0 → 1 and 1 → 0 — because the pool's
//! fair share divides it among the clients holding there, and that number (the pool's holders,
//! kept in `global`) must be exact.
//!
//! The rule that keeps it exact: whoever makes a transition adjusts the holders, once, however
//! the counts of other threads move meanwhile. The thread whose take found 0 counts the client
//! among the holders (in the compare-and-swap that takes its global slot, or alone if that slot
//! was refused) *before* its next write to this count; the thread whose release found 1 (made
//! after its global slot went back) counts it out after. Every write here is AcqRel, so a count-in made before a write is visible to the
//! release that later finds 1 (that release reads a value written after it, through the chain
//! of read-modify-writes that every write here is): the holders never count a client out before
//! they counted it in, so they never dip below zero, not even for an instant.
//!
//! Its loom model is here; the one of the holders it keeps (the global count with this count's
//! transitions) is `global`'s.

use crate::sync::{AtomicU64, Ordering};

/// One client's count in one pool.
#[derive(Debug)]
pub(crate) struct Holding {
    held: AtomicU64,
}

impl Holding {
    pub(crate) fn new() -> Holding {
        Holding {
            held: AtomicU64::new(0),
        }
    }

    /// The count now.
    #[inline]
    pub(crate) fn get(&self) -> u64 {
        // Relaxed: a reading of the count for a check that the reservation decides again.
        self.held.load(Ordering::Relaxed)
    }

    /// Takes one slot if that keeps the count at or below `limit`: the count it found (0: the
    /// client now holds in the pool, and the caller counts it among the holders), or `None`.
    #[inline]
    pub(crate) fn try_take(&self, limit: u64) -> Option<u64> {
        let mut current = self.held.load(Ordering::Relaxed);
        loop {
            if current >= limit {
                return None;
            }
            // AcqRel: see the module docs (a count-in is published before the next write).
            match self.held.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(current),
                Err(actual) => current = actual,
            }
        }
    }

    /// Takes one slot whatever the limit (an execution slot, whose limit is the pool's; restored
    /// work): the count it found.
    #[inline]
    pub(crate) fn take(&self) -> u64 {
        // AcqRel: see the module docs. Saturating, so a corrupt restore cannot wrap.
        match self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |c| {
                Some(c.saturating_add(1))
            }) {
            Ok(found) | Err(found) => found,
        }
    }

    /// Gives one slot back: whether the client no longer holds in the pool (the count went
    /// 1 → 0, and the caller counts it out of the holders). Never goes below zero (giving back
    /// more than was taken is a bookkeeping bug: it fails debug builds and leaves zero).
    #[inline]
    pub(crate) fn give_back(&self) -> bool {
        // AcqRel: see the module docs (a release that leaves sees the count-in it undoes).
        let found = match self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(1))
            }) {
            Ok(found) | Err(found) => found,
        };
        debug_assert!(found >= 1, "gave back a slot but none was held");
        found == 1
    }

    /// Gives back the one slot a take that found 0 made, if no other slot is held now (1 → 0):
    /// then nobody saw the client hold, and the holders need not count it in and out. `false`
    /// (nothing done) if others are held beside it.
    #[inline]
    pub(crate) fn give_back_alone(&self) -> bool {
        // AcqRel: as every write here.
        self.held
            .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_take_reports_the_count_it_found_and_stops_at_the_limit() {
        let h = Holding::new();
        assert_eq!(h.try_take(2), Some(0));
        assert_eq!(h.try_take(2), Some(1));
        assert_eq!(h.try_take(2), None);
        assert_eq!(h.take(), 2);
        assert_eq!(h.get(), 3);
    }

    #[test]
    fn only_the_release_of_the_last_slot_leaves_the_pool() {
        let h = Holding::new();
        h.take();
        h.take();
        assert!(!h.give_back());
        assert!(h.give_back());
        assert_eq!(h.get(), 0);
    }

    #[test]
    fn a_lone_slot_goes_back_unseen_but_not_beside_another() {
        let h = Holding::new();
        h.take();
        h.take();
        assert!(!h.give_back_alone());
        assert_eq!(h.get(), 2);
        assert!(!h.give_back());
        assert!(h.give_back_alone());
        assert_eq!(h.get(), 0);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two threads take a slot each and give it back: exactly one take finds the pool empty
    /// before the other's, exactly one release leaves it, and the count ends at zero. (With
    /// three slots of two at most, a third take is refused.)
    #[test]
    fn loom_one_join_and_one_leave_whatever_the_interleaving() {
        loom::model(|| {
            let h = Arc::new(Holding::new());
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let h = h.clone();
                    thread::spawn(move || {
                        let found = h.try_take(2).expect("room for both");
                        assert!(h.get() <= 2);
                        let left = h.give_back();
                        (found == 0, left)
                    })
                })
                .collect();
            let seen: Vec<(bool, bool)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            let joins = seen.iter().filter(|s| s.0).count();
            let leaves = seen.iter().filter(|s| s.1).count();
            // Each thread's slot may be the only one while it holds it (both join and leave),
            // or overlap the other's: joins and leaves always pair up.
            assert_eq!(joins, leaves);
            assert!(joins >= 1);
            assert_eq!(h.get(), 0);
        });
    }
}
