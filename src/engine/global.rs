//! The global counts — active, pending approvals, executing — packed into one atomic word.
//!
//! Every admission and every transition touches the global counts, from every thread, so they are
//! the one place where threads working for different clients meet. Packing the three into one
//! word makes each decision one compare-and-swap on one cache line: an admission reserves its
//! active slot (and pending grant) and checks the execution pool in a single atomic step, and a
//! finish releases its active and executing slots together. Like [`Gauge`](super::gauge), each
//! field only ever rises by a compare-and-swap that checks its limit, and never falls below zero.
//!
//! Each field has 21 bits (up to 2,097,151), above the largest limit a quota file may set
//! (1,000,000); restored counts saturate there rather than spill into a neighbour.

use crate::sync::{AtomicU64, Ordering};

const BITS: u32 = 21;
/// The largest value a field can hold.
pub(crate) const FIELD_MAX: u64 = (1 << BITS) - 1;
const PENDING_SHIFT: u32 = BITS;
const EXECUTING_SHIFT: u32 = 2 * BITS;

/// The three global counts at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) active: u64,
    pub(crate) pending: u64,
    pub(crate) executing: u64,
}

impl Counts {
    pub(crate) const ACTIVE: Counts = Counts {
        active: 1,
        pending: 0,
        executing: 0,
    };
    pub(crate) const PENDING: Counts = Counts {
        active: 0,
        pending: 1,
        executing: 0,
    };
    pub(crate) const EXECUTING: Counts = Counts {
        active: 0,
        pending: 0,
        executing: 1,
    };

    pub(crate) const fn plus(self, other: Counts) -> Counts {
        Counts {
            active: self.active + other.active,
            pending: self.pending + other.pending,
            executing: self.executing + other.executing,
        }
    }

    fn unpack(word: u64) -> Counts {
        Counts {
            active: word & FIELD_MAX,
            pending: (word >> PENDING_SHIFT) & FIELD_MAX,
            executing: (word >> EXECUTING_SHIFT) & FIELD_MAX,
        }
    }

    fn pack(self) -> u64 {
        debug_assert!(
            self.active <= FIELD_MAX && self.pending <= FIELD_MAX && self.executing <= FIELD_MAX
        );
        self.active | (self.pending << PENDING_SHIFT) | (self.executing << EXECUTING_SHIFT)
    }
}

/// Why [`GlobalCounts::try_admit`] refused: the first global check that failed, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GlobalRefusal {
    PendingGrants,
    Active,
    Executing,
}

/// The limits one admission is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GlobalLimits {
    pub(crate) active: u64,
    pub(crate) executing: u64,
    pub(crate) pending_grants: u64,
}

/// The global counts.
#[derive(Debug)]
pub(crate) struct GlobalCounts {
    word: AtomicU64,
}

impl GlobalCounts {
    pub(crate) fn new() -> GlobalCounts {
        GlobalCounts {
            word: AtomicU64::new(0),
        }
    }

    /// The counts now.
    #[inline]
    pub(crate) fn get(&self) -> Counts {
        // Relaxed: the word is the only data; nothing else is published with it.
        Counts::unpack(self.word.load(Ordering::Relaxed))
    }

    /// One admission: takes an active slot (and a pending grant if `pending`) if global active
    /// stays within its limit, the grants within theirs, and the execution pool is not saturated.
    #[inline]
    pub(crate) fn try_admit(
        &self,
        pending: bool,
        limits: GlobalLimits,
    ) -> Result<(), GlobalRefusal> {
        let add = if pending {
            Counts::ACTIVE.plus(Counts::PENDING)
        } else {
            Counts::ACTIVE
        };
        // Relaxed: as in `get`; the CAS alone makes each decision on the value it replaces.
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let c = Counts::unpack(word);
            if pending && c.pending >= limits.pending_grants.min(FIELD_MAX) {
                return Err(GlobalRefusal::PendingGrants);
            }
            if c.active >= limits.active.min(FIELD_MAX) {
                return Err(GlobalRefusal::Active);
            }
            if c.executing >= limits.executing {
                return Err(GlobalRefusal::Executing);
            }
            let next = c.plus(add).pack();
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(actual) => word = actual,
            }
        }
    }

    /// The check [`GlobalCounts::try_admit`] would fail now, read without writing.
    #[inline]
    pub(crate) fn would_refuse(
        &self,
        pending: bool,
        limits: GlobalLimits,
    ) -> Option<GlobalRefusal> {
        let c = self.get();
        if pending && c.pending >= limits.pending_grants.min(FIELD_MAX) {
            Some(GlobalRefusal::PendingGrants)
        } else if c.active >= limits.active.min(FIELD_MAX) {
            Some(GlobalRefusal::Active)
        } else if c.executing >= limits.executing {
            Some(GlobalRefusal::Executing)
        } else {
            None
        }
    }

    /// Takes an execution slot if fewer than `limit` are taken.
    #[inline]
    pub(crate) fn try_start(&self, limit: u64) -> bool {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let c = Counts::unpack(word);
            if c.executing >= limit.min(FIELD_MAX) {
                return false;
            }
            let next = c.plus(Counts::EXECUTING).pack();
            // Relaxed: as in try_admit.
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => word = actual,
            }
        }
    }

    /// Gives back `sub` in one step. A field never goes below zero (a bookkeeping bug would
    /// saturate it at zero, and fail debug builds loudly).
    #[inline]
    pub(crate) fn release(&self, sub: Counts) {
        let mut word = self.word.load(Ordering::Relaxed);
        loop {
            let c = Counts::unpack(word);
            debug_assert!(
                c.active >= sub.active && c.pending >= sub.pending && c.executing >= sub.executing,
                "released {sub:?} but only {c:?} were held"
            );
            let next = Counts {
                active: c.active.saturating_sub(sub.active),
                pending: c.pending.saturating_sub(sub.pending),
                executing: c.executing.saturating_sub(sub.executing),
            }
            .pack();
            // Relaxed: as in try_admit.
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(actual) => word = actual,
            }
        }
    }

    /// Adds `add` whatever the limits (start-up recovery), saturating each field at its maximum.
    pub(crate) fn force(&self, add: Counts) {
        // Relaxed: as in try_admit.
        let _ = self
            .word
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                let c = Counts::unpack(word);
                Some(
                    Counts {
                        active: (c.active + add.active).min(FIELD_MAX),
                        pending: (c.pending + add.pending).min(FIELD_MAX),
                        executing: (c.executing + add.executing).min(FIELD_MAX),
                    }
                    .pack(),
                )
            });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const ROOMY: GlobalLimits = GlobalLimits {
        active: 10,
        executing: 10,
        pending_grants: 10,
    };

    #[test]
    fn fields_do_not_spill_into_each_other() {
        let g = GlobalCounts::new();
        g.force(Counts {
            active: FIELD_MAX + 5,
            pending: 3,
            executing: 0,
        });
        assert_eq!(
            g.get(),
            Counts {
                active: FIELD_MAX,
                pending: 3,
                executing: 0
            }
        );
        g.release(Counts {
            active: FIELD_MAX,
            pending: 3,
            executing: 0,
        });
        assert_eq!(g.get(), Counts::default());
    }

    #[test]
    fn admission_checks_grants_then_active_then_the_execution_pool() {
        let g = GlobalCounts::new();
        let tight = GlobalLimits {
            active: 2,
            executing: 1,
            pending_grants: 1,
        };
        assert_eq!(g.try_admit(true, tight), Ok(()));
        assert_eq!(g.try_admit(true, tight), Err(GlobalRefusal::PendingGrants));
        assert_eq!(g.try_admit(false, tight), Ok(()));
        assert_eq!(g.try_admit(false, tight), Err(GlobalRefusal::Active));
        g.release(Counts::ACTIVE);
        assert!(g.try_start(1));
        assert!(!g.try_start(1));
        assert_eq!(g.try_admit(false, tight), Err(GlobalRefusal::Executing));
        assert_eq!(
            g.get(),
            Counts {
                active: 1,
                pending: 1,
                executing: 1
            }
        );
    }

    #[test]
    fn a_refused_admission_changes_nothing() {
        let g = GlobalCounts::new();
        g.force(Counts {
            active: 10,
            pending: 0,
            executing: 0,
        });
        let before = g.get();
        assert!(g.try_admit(true, ROOMY).is_err());
        assert_eq!(g.get(), before);
    }
}

#[cfg(all(test, loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Two admissions race for the last active slot while an operation finishes: the count never
    /// passes the limit and ends consistent with who won.
    #[test]
    fn loom_global_admissions_never_pass_the_limit() {
        loom::model(|| {
            let limits = GlobalLimits {
                active: 2,
                executing: 2,
                pending_grants: 2,
            };
            let g = Arc::new(GlobalCounts::new());
            assert!(g.try_admit(false, limits).is_ok());
            assert!(g.try_start(2));
            let racers: Vec<_> = (0..2)
                .map(|i| {
                    let g = g.clone();
                    thread::spawn(move || {
                        let won = g.try_admit(i == 0, limits).is_ok();
                        assert!(g.get().active <= 2);
                        won
                    })
                })
                .collect();
            let finisher = {
                let g = g.clone();
                thread::spawn(move || g.release(Counts::ACTIVE.plus(Counts::EXECUTING)))
            };
            let won: Vec<bool> = racers.into_iter().map(|t| t.join().unwrap()).collect();
            finisher.join().unwrap();
            let c = g.get();
            assert!(
                won.iter().any(|&w| w),
                "one slot was always free for at least one racer"
            );
            assert_eq!(c.active, won.iter().filter(|&&w| w).count() as u64);
            assert_eq!(c.pending, u64::from(won[0]));
            assert_eq!(c.executing, 0);
        });
    }
}
