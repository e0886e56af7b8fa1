//! The global counts — active, pending approvals, executing — and each pool's *holders* (how many
//! clients hold in it), packed into two atomic words, one per pool.
//!
//! Every admission and every transition touches the global counts, from every thread, so they are
//! the one place where threads working for different clients meet. Packing a pool's counts into
//! one word makes each decision on it one compare-and-swap: an admission reserves its active slot
//! (and pending grant) in the active word, decided there against the active pool's fair share
//! with the holders read in the same word, and checks the execution pool on the executing word;
//! a start takes its slot in the executing word the same way. Like [`Gauge`](super::gauge), each
//! count only ever rises by a compare-and-swap that checks its limit, and never falls below zero.
//! The two words share one cache line (the struct is cache-padded as a whole), so a thread that
//! touches both pays for one line.
//!
//! The holders are counted, never sampled: a client's first slot in a pool (its
//! [`Holding`](super::holding::Holding) found 0) counts it in, in the compare-and-swap that takes
//! the pool's slot; the release that empties its count counts it out, right after (the rule and
//! why it never dips below zero: `holding`'s docs). They are kept whether or not a fair share is
//! in force, so a reload that turns one on finds them exact.
//!
//! A decision reads the client's own count and this word one after the other, so it is made on
//! what both said at two instants; the order of every step makes each such reading err on the
//! side of refusing: a client's count rises before its pool slot is taken and falls after it is
//! given back (it is never judged by fewer than the pool counts for it), and a client is counted
//! among the holders before its first slot is visible and out of them after its last is gone
//! (a share is never larger than the holders make it).
//!
//! Each field has 21 bits (up to 2,097,151), above the largest limit a quota file may set
//! (1,000,000); restored counts saturate there rather than spill into a neighbour.
//!
//! Past the usual size only because its unit tests live beside it; the counts themselves are
//! about 450 lines. Its loom models are beside it too, in `global/loom_models.rs`.

use super::holding::Holding;
use super::refusal::FairShareReason;
use super::share::PoolRule;
use crate::config::Pool;
use crate::sync::{AtomicU64, Ordering};

const BITS: u32 = 21;
/// The largest value a field can hold.
pub(crate) const FIELD_MAX: u64 = (1 << BITS) - 1;
/// The active word: active | pending << 21 | active holders << 42.
const PENDING_SHIFT: u32 = BITS;
const ACTIVE_HOLDERS_SHIFT: u32 = 2 * BITS;
/// The executing word: executing | executing holders << 21.
const EXECUTING_HOLDERS_SHIFT: u32 = BITS;

/// The global counts at one instant (each word's fields at one instant; the two words read one
/// after the other).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) active: u64,
    pub(crate) pending: u64,
    pub(crate) executing: u64,
    /// Clients holding at least one live operation.
    pub(crate) active_holders: u64,
    /// Clients holding at least one executing operation.
    pub(crate) executing_holders: u64,
}

impl Counts {
    pub(crate) const ACTIVE: Counts = Counts {
        active: 1,
        ..Counts::ZERO
    };
    pub(crate) const PENDING: Counts = Counts {
        pending: 1,
        ..Counts::ZERO
    };
    pub(crate) const EXECUTING: Counts = Counts {
        executing: 1,
        ..Counts::ZERO
    };
    const ZERO: Counts = Counts {
        active: 0,
        pending: 0,
        executing: 0,
        active_holders: 0,
        executing_holders: 0,
    };

    /// One holder of `pool`.
    pub(crate) const fn holder(pool: Pool) -> Counts {
        match pool {
            Pool::Active => Counts {
                active_holders: 1,
                ..Counts::ZERO
            },
            Pool::Executing => Counts {
                executing_holders: 1,
                ..Counts::ZERO
            },
        }
    }

    pub(crate) const fn plus(self, other: Counts) -> Counts {
        Counts {
            active: self.active + other.active,
            pending: self.pending + other.pending,
            executing: self.executing + other.executing,
            active_holders: self.active_holders + other.active_holders,
            executing_holders: self.executing_holders + other.executing_holders,
        }
    }

    /// `add` plus one holder of `pool` if `joined`.
    #[inline]
    pub(crate) const fn joining(self, pool: Pool, joined: bool) -> Counts {
        if joined {
            self.plus(Counts::holder(pool))
        } else {
            self
        }
    }

    /// The fields of the active word alone.
    fn active_part(self) -> Counts {
        Counts {
            executing: 0,
            executing_holders: 0,
            ..self
        }
    }

    /// The fields of the executing word alone.
    fn executing_part(self) -> Counts {
        Counts {
            executing: self.executing,
            executing_holders: self.executing_holders,
            ..Counts::ZERO
        }
    }

    fn with_active_word(self, word: u64) -> Counts {
        Counts {
            active: word & FIELD_MAX,
            pending: (word >> PENDING_SHIFT) & FIELD_MAX,
            active_holders: (word >> ACTIVE_HOLDERS_SHIFT) & FIELD_MAX,
            ..self
        }
    }

    fn with_executing_word(self, word: u64) -> Counts {
        Counts {
            executing: word & FIELD_MAX,
            executing_holders: (word >> EXECUTING_HOLDERS_SHIFT) & FIELD_MAX,
            ..self
        }
    }

    fn active_word(self) -> u64 {
        debug_assert!(
            self.active <= FIELD_MAX
                && self.pending <= FIELD_MAX
                && self.active_holders <= FIELD_MAX
        );
        self.active
            | (self.pending << PENDING_SHIFT)
            | (self.active_holders << ACTIVE_HOLDERS_SHIFT)
    }

    fn executing_word(self) -> u64 {
        debug_assert!(self.executing <= FIELD_MAX && self.executing_holders <= FIELD_MAX);
        self.executing | (self.executing_holders << EXECUTING_HOLDERS_SHIFT)
    }

    /// Each field less `sub`'s, never below zero (a bookkeeping bug would saturate at zero, and
    /// fail debug builds loudly).
    fn minus(self, sub: Counts) -> Counts {
        debug_assert!(
            self.active >= sub.active
                && self.pending >= sub.pending
                && self.executing >= sub.executing
                && self.active_holders >= sub.active_holders
                && self.executing_holders >= sub.executing_holders,
            "released {sub:?} but only {self:?} were held"
        );
        Counts {
            active: self.active.saturating_sub(sub.active),
            pending: self.pending.saturating_sub(sub.pending),
            executing: self.executing.saturating_sub(sub.executing),
            active_holders: self.active_holders.saturating_sub(sub.active_holders),
            executing_holders: self.executing_holders.saturating_sub(sub.executing_holders),
        }
    }

    /// Each field plus `add`'s, saturating at the field's maximum.
    fn saturating_plus(self, add: Counts) -> Counts {
        let sum = |a: u64, b: u64| a.saturating_add(b).min(FIELD_MAX);
        Counts {
            active: sum(self.active, add.active),
            pending: sum(self.pending, add.pending),
            executing: sum(self.executing, add.executing),
            active_holders: sum(self.active_holders, add.active_holders),
            executing_holders: sum(self.executing_holders, add.executing_holders),
        }
    }
}

/// Why [`GlobalCounts::try_admit`] refused: the first global check that failed, in order, and
/// for a pool, whether its fair share refused (`Some`) or the pool is simply full (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GlobalRefusal {
    PendingGrants,
    Active(Option<FairShareReason>),
    Executing(Option<FairShareReason>),
}

/// The limits one admission is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GlobalLimits {
    pub(crate) active: u64,
    pub(crate) executing: u64,
    pub(crate) pending_grants: u64,
    pub(crate) active_rule: PoolRule,
    pub(crate) executing_rule: PoolRule,
}

/// What the client asking holds, as the fair share judges it: its live operations before this
/// admission (the count its take found), and its executing ones.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Held {
    pub(crate) active: u64,
    pub(crate) executing: u64,
}

/// The global counts.
#[derive(Debug)]
pub(crate) struct GlobalCounts {
    active: AtomicU64,
    executing: AtomicU64,
}

impl GlobalCounts {
    pub(crate) fn new() -> GlobalCounts {
        GlobalCounts {
            active: AtomicU64::new(0),
            executing: AtomicU64::new(0),
        }
    }

    /// The counts now.
    #[inline]
    pub(crate) fn get(&self) -> Counts {
        // Relaxed: the words are the only data; nothing else is published with them.
        Counts::ZERO
            .with_active_word(self.active.load(Ordering::Relaxed))
            .with_executing_word(self.executing.load(Ordering::Relaxed))
    }

    /// One admission by a client holding `held`: takes an active slot (and a pending grant if
    /// `pending`) if the grants stay within their cap, the active pool has a slot for this
    /// client (its limit, and its fair share), and the execution pool is not saturated for it
    /// (it could start an operation now). Counts the client among the active pool's holders if
    /// this is its first live operation (`held.active` is 0).
    #[inline]
    pub(crate) fn try_admit(
        &self,
        pending: bool,
        limits: GlobalLimits,
        held: Held,
    ) -> Result<(), GlobalRefusal> {
        let add = if pending {
            Counts::ACTIVE.plus(Counts::PENDING)
        } else {
            Counts::ACTIVE
        }
        .joining(Pool::Active, held.active == 0);
        // Relaxed: as in `get`; the CAS alone makes each decision on the value it replaces.
        let mut word = self.active.load(Ordering::Relaxed);
        loop {
            let c = Counts::ZERO.with_active_word(word);
            self.refusal(pending, limits, held, c)?;
            let next = c.plus(add).active_word();
            // Relaxed: as above.
            match self.active.compare_exchange_weak(
                word,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
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
        held: Held,
    ) -> Option<GlobalRefusal> {
        // Relaxed: as in `get`.
        let c = Counts::ZERO.with_active_word(self.active.load(Ordering::Relaxed));
        self.refusal(pending, limits, held, c).err()
    }

    /// The global checks of one admission against the active word's counts `c` (the executing
    /// word is read here: the execution pool is only checked at admission, never taken).
    #[inline]
    fn refusal(
        &self,
        pending: bool,
        limits: GlobalLimits,
        held: Held,
        c: Counts,
    ) -> Result<(), GlobalRefusal> {
        if pending && c.pending >= limits.pending_grants.min(FIELD_MAX) {
            return Err(GlobalRefusal::PendingGrants);
        }
        limits
            .active_rule
            .judge(
                limits.active.min(FIELD_MAX),
                c.active,
                c.active_holders + u64::from(held.active == 0),
                held.active,
            )
            .map_err(GlobalRefusal::Active)?;
        // Relaxed: as in `get`.
        let e = Counts::ZERO.with_executing_word(self.executing.load(Ordering::Relaxed));
        limits
            .executing_rule
            .judge(
                limits.executing,
                e.executing,
                e.executing_holders + u64::from(held.executing == 0),
                held.executing,
            )
            .map_err(GlobalRefusal::Executing)
    }

    /// Takes an execution slot for a client holding `held` executing operations (the count its
    /// take found), if fewer than `limit` are taken and the pool's `rule` gives this client one;
    /// counts the client among the executing pool's holders if it held none.
    #[inline]
    pub(crate) fn try_start(
        &self,
        limit: u64,
        rule: PoolRule,
        held: u64,
    ) -> Result<(), Option<FairShareReason>> {
        let add = Counts::EXECUTING.joining(Pool::Executing, held == 0);
        let mut word = self.executing.load(Ordering::Relaxed);
        loop {
            let c = Counts::ZERO.with_executing_word(word);
            rule.judge(
                limit.min(FIELD_MAX),
                c.executing,
                c.executing_holders + u64::from(held == 0),
                held,
            )?;
            let next = c.plus(add).executing_word();
            // Relaxed: as in try_admit.
            match self.executing.compare_exchange_weak(
                word,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => word = actual,
            }
        }
    }

    /// Gives back `sub`: one step per word it touches. A field never goes below zero.
    #[inline]
    pub(crate) fn release(&self, sub: Counts) {
        self.apply(sub, Counts::minus);
    }

    /// Adds `add` whatever the limits (start-up recovery, a holder counted in alone), saturating
    /// each field at its maximum.
    pub(crate) fn force(&self, add: Counts) {
        self.apply(add, Counts::saturating_plus);
    }

    /// Moves each word `change` touches by `step` (the word's counts, that word's part of
    /// `change`): one update per word, none for a word it leaves alone.
    #[inline]
    fn apply(&self, change: Counts, step: impl Fn(Counts, Counts) -> Counts) {
        let (active, executing) = (change.active_part(), change.executing_part());
        if active != Counts::ZERO {
            // Relaxed: as in try_admit.
            let _ = self
                .active
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                    Some(step(Counts::ZERO.with_active_word(word), active).active_word())
                });
        }
        if executing != Counts::ZERO {
            // Relaxed: as in try_admit.
            let _ = self
                .executing
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                    Some(step(Counts::ZERO.with_executing_word(word), executing).executing_word())
                });
        }
    }

    /// Gives back the slot of `pool` that `holding` gave a reservation this count then refused
    /// (`found`: the count its take found), keeping the pool's holders exact. A take that found
    /// 0 made the client a holder: if its slot is the only one still held it goes back unseen
    /// (nothing to count); if not, others saw the client hold, so it is counted in now, before
    /// its slot goes back, and out again if that release empties the count.
    pub(crate) fn give_back_refused(&self, holding: &Holding, found: u64, pool: Pool) {
        if found == 0 {
            if holding.give_back_alone() {
                return;
            }
            self.force(Counts::holder(pool));
        }
        if holding.give_back() {
            self.release(Counts::holder(pool));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const ROOMY: GlobalLimits = GlobalLimits {
        active: 10,
        executing: 10,
        pending_grants: 10,
        active_rule: PoolRule::FIRST_COME,
        executing_rule: PoolRule::FIRST_COME,
    };

    /// A client holding one live operation and nothing executing.
    const HOLDS_ONE: Held = Held {
        active: 1,
        executing: 1,
    };

    #[test]
    fn fields_do_not_spill_into_each_other() {
        let g = GlobalCounts::new();
        let big = Counts {
            active: FIELD_MAX + 5,
            pending: 3,
            executing: FIELD_MAX + 1,
            active_holders: 2,
            executing_holders: FIELD_MAX + 9,
        };
        g.force(big);
        let want = Counts {
            active: FIELD_MAX,
            pending: 3,
            executing: FIELD_MAX,
            active_holders: 2,
            executing_holders: FIELD_MAX,
        };
        assert_eq!(g.get(), want);
        g.release(want);
        assert_eq!(g.get(), Counts::default());
    }

    #[test]
    fn admission_checks_grants_then_active_then_the_execution_pool() {
        let g = GlobalCounts::new();
        let tight = GlobalLimits {
            active: 2,
            executing: 1,
            pending_grants: 1,
            ..ROOMY
        };
        assert_eq!(g.try_admit(true, tight, HOLDS_ONE), Ok(()));
        assert_eq!(
            g.try_admit(true, tight, HOLDS_ONE),
            Err(GlobalRefusal::PendingGrants)
        );
        assert_eq!(g.try_admit(false, tight, HOLDS_ONE), Ok(()));
        assert_eq!(
            g.try_admit(false, tight, HOLDS_ONE),
            Err(GlobalRefusal::Active(None))
        );
        g.release(Counts::ACTIVE);
        assert_eq!(g.try_start(1, PoolRule::FIRST_COME, 1), Ok(()));
        assert_eq!(g.try_start(1, PoolRule::FIRST_COME, 1), Err(None));
        assert_eq!(
            g.try_admit(false, tight, HOLDS_ONE),
            Err(GlobalRefusal::Executing(None))
        );
        assert_eq!(
            g.get(),
            Counts {
                active: 1,
                pending: 1,
                executing: 1,
                ..Counts::default()
            }
        );
    }

    #[test]
    fn a_refused_admission_changes_nothing() {
        let g = GlobalCounts::new();
        g.force(Counts {
            active: 10,
            ..Counts::default()
        });
        let before = g.get();
        assert!(g.try_admit(true, ROOMY, Held::default()).is_err());
        assert_eq!(g.get(), before);
    }

    #[test]
    fn a_first_slot_counts_its_client_among_the_holders() {
        let g = GlobalCounts::new();
        assert_eq!(g.try_admit(false, ROOMY, Held::default()), Ok(()));
        assert_eq!(g.try_admit(false, ROOMY, HOLDS_ONE), Ok(()));
        assert_eq!(g.try_start(10, PoolRule::FIRST_COME, 0), Ok(()));
        assert_eq!(g.try_start(10, PoolRule::FIRST_COME, 1), Ok(()));
        let c = g.get();
        assert_eq!((c.active_holders, c.executing_holders), (1, 1));
    }

    #[test]
    fn the_fair_share_of_each_pool_is_decided_in_its_word() {
        let g = GlobalCounts::new();
        let fair = GlobalLimits {
            active: 4,
            executing: 2,
            active_rule: PoolRule {
                reserve: 1,
                floor: 1,
            },
            executing_rule: PoolRule {
                reserve: 1,
                floor: 1,
            },
            ..ROOMY
        };
        // A big client alone takes the whole shared part (3 of 4), then meets the reserve.
        assert_eq!(g.try_admit(false, fair, Held::default()), Ok(()));
        for held in 1..3 {
            let held = Held {
                active: held,
                executing: 0,
            };
            assert_eq!(g.try_admit(false, fair, held), Ok(()));
        }
        let big = Held {
            active: 3,
            executing: 0,
        };
        assert_eq!(
            g.try_admit(false, fair, big),
            Err(GlobalRefusal::Active(Some(FairShareReason::Reserve)))
        );
        // A client holding nothing takes the reserve.
        assert_eq!(g.try_admit(false, fair, Held::default()), Ok(()));
        // The execution pool: the big client's first start, then the reserve is the small one's.
        assert_eq!(g.try_start(2, fair.executing_rule, 0), Ok(()));
        assert_eq!(
            g.try_start(2, fair.executing_rule, 1),
            Err(Some(FairShareReason::Reserve))
        );
        assert_eq!(
            g.would_refuse(false, GlobalLimits { active: 8, ..fair }, HOLDS_ONE),
            Some(GlobalRefusal::Executing(Some(FairShareReason::Reserve)))
        );
        assert_eq!(g.try_start(2, fair.executing_rule, 0), Ok(()));
        assert_eq!(g.try_start(2, fair.executing_rule, 0), Err(None));
        let c = g.get();
        assert_eq!(
            (c.active, c.active_holders, c.executing, c.executing_holders),
            (4, 2, 2, 2)
        );
    }

    #[test]
    fn a_refused_first_slot_goes_back_without_a_holder_left_behind() {
        let g = GlobalCounts::new();
        let h = Holding::new();
        // Alone: back unseen.
        let found = h.try_take(10).unwrap();
        g.give_back_refused(&h, found, Pool::Active);
        assert_eq!((h.get(), g.get()), (0, Counts::default()));
        // Beside a slot another admission took (and counted nothing for: it found 1).
        let found = h.try_take(10).unwrap();
        assert_eq!(h.try_take(10), Some(1));
        g.give_back_refused(&h, found, Pool::Active);
        assert_eq!(h.get(), 1);
        assert_eq!(g.get().active_holders, 1, "the client still holds");
        g.give_back_refused(&h, 1, Pool::Active);
        assert_eq!((h.get(), g.get()), (0, Counts::default()));
    }
}

#[cfg(all(test, loom))]
mod loom_models;
