//! Fair share of a global pool, as arithmetic: whether one client may take one more slot of a
//! pool, given the pool's limit and rule, how many slots are taken, by how many clients (the
//! pool's *holders*), and how many this client holds. A leaf: it knows no atomics and no clients;
//! `global` applies it inside the compare-and-swap that takes the slot, and the Redis backend's
//! batch script applies the same rule to the same numbers.
//!
//! The rule, for a pool of `limit` slots with `reserve` R and `floor` F (the shared part is
//! S = `limit` − R), `used` slots taken by H holders, and a client holding `held` (c):
//!
//! - no slot is free (`used ≥ limit`): refused, as first come, first served refuses;
//! - c < F (a small client): admitted;
//! - `used ≥ S` (only the reserve is left): refused, reason *reserve*;
//! - c ≥ ⌈S / H'⌉, with H' = H + 1 if c = 0 else H (this client among the holders): refused,
//!   reason *share*; written c·H' ≥ S, which is the same for integers and divides nothing;
//! - otherwise admitted.
//!
//! So a client alone may hold the whole shared part (H' = 1); when several hold, slots freed by
//! finished work go only to those below their share, whoever asks first; nothing held is ever
//! taken back. Without a fair share (`floor` 0 here) only the first line applies.

use crate::config::PoolShare;
use crate::engine::refusal::FairShareReason;

/// A pool's fair-share rule as the engine applies it. A `floor` of 0 means no fair share: first
/// come, first served (a quota file's floor is at least 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolRule {
    pub(crate) reserve: u64,
    pub(crate) floor: u64,
}

impl PoolRule {
    /// First come, first served.
    pub(crate) const FIRST_COME: PoolRule = PoolRule {
        reserve: 0,
        floor: 0,
    };

    /// The rule of a quota file's pool entry, or first come, first served for none.
    pub(crate) fn of(share: Option<PoolShare>) -> PoolRule {
        share.map_or(PoolRule::FIRST_COME, |share| PoolRule {
            reserve: u64::from(share.reserve),
            floor: u64::from(share.floor),
        })
    }

    /// Whether a client holding `held` may take one more of a pool's `limit` slots, `used` of
    /// which are taken by `holders` clients. `Err(None)`: no slot is free at all;
    /// `Err(Some(reason))`: fair share refuses where first come, first served would admit.
    #[inline]
    pub(crate) fn judge(
        self,
        limit: u64,
        used: u64,
        holders: u64,
        held: u64,
    ) -> Result<(), Option<FairShareReason>> {
        if used >= limit {
            return Err(None);
        }
        if held < self.floor || self.floor == 0 {
            return Ok(());
        }
        let shared = limit.saturating_sub(self.reserve);
        if used >= shared {
            return Err(Some(FairShareReason::Reserve));
        }
        // `held` ≥ floor ≥ 1: this client holds already, so it is one of the holders. At least
        // one: in the engine a client's first slot is counted among the holders by the
        // compare-and-swap that takes it, so one still in flight may not be counted yet.
        let holders = holders.max(1);
        if held.saturating_mul(holders) >= shared {
            return Err(Some(FairShareReason::Share));
        }
        Ok(())
    }
}

/// A pool's limit and rule in one word (21 bits each: the limit and the reserve are at most
/// 1,000,000, the floor too), so a start reads what it is decided on with one load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PoolSettings {
    pub(crate) limit: u64,
    pub(crate) rule: PoolRule,
}

const BITS: u32 = 21;
const MASK: u64 = (1 << BITS) - 1;

impl PoolSettings {
    pub(crate) fn pack(self) -> u64 {
        debug_assert!(self.limit <= MASK && self.rule.reserve <= MASK && self.rule.floor <= MASK);
        (self.limit & MASK)
            | ((self.rule.reserve & MASK) << BITS)
            | ((self.rule.floor & MASK) << (2 * BITS))
    }

    pub(crate) fn unpack(word: u64) -> PoolSettings {
        PoolSettings {
            limit: word & MASK,
            rule: PoolRule {
                reserve: (word >> BITS) & MASK,
                floor: (word >> (2 * BITS)) & MASK,
            },
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const FAIR: PoolRule = PoolRule {
        reserve: 4,
        floor: 2,
    };

    #[test]
    fn without_a_fair_share_only_a_full_pool_refuses() {
        let rule = PoolRule::FIRST_COME;
        assert_eq!(rule.judge(10, 9, 1, 9), Ok(()));
        assert_eq!(rule.judge(10, 10, 1, 0), Err(None));
    }

    #[test]
    fn a_small_client_takes_the_reserve_while_any_slot_is_free() {
        assert_eq!(FAIR.judge(10, 9, 5, 1), Ok(()));
        assert_eq!(FAIR.judge(10, 9, 5, 0), Ok(()));
        assert_eq!(FAIR.judge(10, 10, 5, 0), Err(None));
    }

    #[test]
    fn a_big_client_stops_where_the_reserve_begins() {
        assert_eq!(FAIR.judge(10, 5, 1, 5), Ok(()));
        assert_eq!(FAIR.judge(10, 6, 1, 6), Err(Some(FairShareReason::Reserve)));
    }

    #[test]
    fn a_big_client_stops_at_its_share_of_the_shared_part() {
        // Shared part 6 among 2 holders: a share of 3.
        assert_eq!(FAIR.judge(10, 4, 2, 2), Ok(()));
        assert_eq!(FAIR.judge(10, 4, 2, 3), Err(Some(FairShareReason::Share)));
        // Among 4: ⌈6 / 4⌉ = 2, so a client holding 2 is at its share.
        assert_eq!(FAIR.judge(10, 4, 4, 2), Err(Some(FairShareReason::Share)));
        // Among 5: ⌈6 / 5⌉ = 2 still.
        assert_eq!(FAIR.judge(10, 4, 5, 1), Ok(()));
    }

    #[test]
    fn the_share_is_the_ceiling_of_the_shared_part_over_the_holders() {
        let rule = PoolRule {
            reserve: 3,
            floor: 1,
        };
        for limit in 4..40u64 {
            let shared = limit - 3;
            for holders in 1..12u64 {
                let share = shared.div_ceil(holders);
                for held in 1..=limit {
                    let fits = rule.judge(limit, 0, holders, held).is_ok();
                    assert_eq!(fits, held < share, "{limit} {holders} {held}");
                }
            }
        }
    }

    #[test]
    fn pool_settings_survive_their_one_word() {
        let settings = PoolSettings {
            limit: 1_000_000,
            rule: PoolRule {
                reserve: 999_999,
                floor: 1_000_000,
            },
        };
        assert_eq!(PoolSettings::unpack(settings.pack()), settings);
        let off = PoolSettings {
            limit: 64,
            rule: PoolRule::FIRST_COME,
        };
        assert_eq!(PoolSettings::unpack(off.pack()), off);
    }
}
