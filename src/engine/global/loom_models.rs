//! The global counts' loom models: admissions racing for the last slot, and each pool's holders
//! kept exact by the steps the controller takes (a client count's take, the global
//! compare-and-swap, a refused slot given back, a release) under every interleaving loom explores.

use super::*;
use loom::sync::Arc;
use loom::thread;

const FIRST_COME: GlobalLimits = GlobalLimits {
    active: 2,
    executing: 2,
    pending_grants: 2,
    active_rule: PoolRule::FIRST_COME,
    executing_rule: PoolRule::FIRST_COME,
};

const HOLDS_ONE: Held = Held {
    active: 1,
    executing: 1,
};

/// Two admissions race for the last active slot while an operation finishes: the count never
/// passes the limit and ends consistent with who won.
#[test]
fn loom_global_admissions_never_pass_the_limit() {
    loom::model(|| {
        let g = Arc::new(GlobalCounts::new());
        assert!(g.try_admit(false, FIRST_COME, HOLDS_ONE).is_ok());
        assert!(g.try_start(2, PoolRule::FIRST_COME, 1).is_ok());
        let racers: Vec<_> = (0..2)
            .map(|i| {
                let g = g.clone();
                thread::spawn(move || {
                    let won = g.try_admit(i == 0, FIRST_COME, HOLDS_ONE).is_ok();
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

/// One client's admission in full, as the controller makes it: its count's take, the global
/// slot (counting it in if the take found 0), given back at once if refused; then its
/// release, the global slot first and then its count, counting it out if that empties it.
fn admit_and_release(g: &GlobalCounts, h: &Holding, limits: GlobalLimits) -> bool {
    let Some(found) = h.try_take(2) else {
        return false;
    };
    let held = Held {
        active: found,
        executing: 0,
    };
    if g.try_admit(false, limits, held).is_err() {
        g.give_back_refused(h, found, Pool::Active);
        return false;
    }
    assert!(g.get().active <= limits.active);
    g.release(Counts::ACTIVE);
    if h.give_back() {
        g.release(Counts::holder(Pool::Active));
    }
    true
}

/// Two threads of one client and one of another admit and release at once into a pool of
/// two with a fair share: the pool never passes its limit, the holders never pass the
/// clients holding (and never dip below zero: `minus` fails debug builds), and at the end
/// nothing is held and nobody counted.
#[test]
fn loom_holders_are_exact_whatever_the_interleaving() {
    loom::model(|| {
        let limits = GlobalLimits {
            active: 2,
            active_rule: PoolRule {
                reserve: 1,
                floor: 1,
            },
            ..FIRST_COME
        };
        let g = Arc::new(GlobalCounts::new());
        let a = Arc::new(Holding::new());
        let b = Arc::new(Holding::new());
        let threads: Vec<_> = [a.clone(), a.clone(), b.clone()]
            .into_iter()
            .map(|h| {
                let g = g.clone();
                thread::spawn(move || admit_and_release(&g, &h, limits))
            })
            .collect();
        let won: Vec<bool> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(won.iter().any(|&w| w), "the first admission always fits");
        assert_eq!((a.get(), b.get()), (0, 0));
        assert_eq!(g.get(), Counts::default());
    });
}

/// A start racing another start of the same client and a finish of its running one, in a
/// pool of two whose reserve is one: at most two execute, the holders end exact.
#[test]
fn loom_starts_keep_the_executing_holders_exact() {
    loom::model(|| {
        let rule = PoolRule {
            reserve: 1,
            floor: 1,
        };
        let g = Arc::new(GlobalCounts::new());
        let h = Arc::new(Holding::new());
        // One operation runs already.
        let found = h.take();
        g.try_start(2, rule, found).unwrap();
        let starters: Vec<_> = (0..2)
            .map(|_| {
                let (g, h) = (g.clone(), h.clone());
                thread::spawn(move || {
                    let found = h.take();
                    match g.try_start(2, rule, found) {
                        Ok(()) => {
                            assert!(g.get().executing <= 2);
                            true
                        }
                        Err(_) => {
                            g.give_back_refused(&h, found, Pool::Executing);
                            false
                        }
                    }
                })
            })
            .collect();
        let finisher = {
            let (g, h) = (g.clone(), h.clone());
            thread::spawn(move || {
                g.release(Counts::EXECUTING);
                if h.give_back() {
                    g.release(Counts::holder(Pool::Executing));
                }
            })
        };
        let started = starters
            .into_iter()
            .map(|t| t.join().unwrap())
            .filter(|&s| s)
            .count() as u64;
        finisher.join().unwrap();
        let c = g.get();
        assert_eq!(c.executing, started);
        assert_eq!(h.get(), started);
        assert_eq!(c.executing_holders, u64::from(started > 0));
    });
}
