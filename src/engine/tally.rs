//! Counters many threads bump at once without sharing a cache line: the refusal statistics.
//!
//! A flood of refusals for one client comes from every connection it opens, so on several
//! threads at once. One shared counter per (client, code) would make every refusal a write to the
//! same line from every core — the very contention read-only refusals remove. A [`Tally`] instead
//! keeps one *lane* per group of threads: lane 0 inline (8 bytes per code, the whole cost for a
//! client never refused on another thread), the others allocated on the first refusal counted on
//! them, each lane on its own cache line. Each thread is given a lane once, round-robin, so two
//! threads refusing the same client write different lines. A reading sums the lanes: exact, as
//! every increment lands in exactly one lane; only the order in which concurrent bumps become
//! visible is relaxed, as for any statistic.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use once_cell::race::OnceBox;

/// Lanes per tally. More lanes than busy cores buy nothing; fewer make threads share one.
pub(crate) const LANES: usize = 4;

/// `N` counters, striped over [`LANES`] lanes.
pub(crate) struct Tally<const N: usize> {
    home: [AtomicU64; N],
    spill: OnceBox<[CachePadded<[AtomicU64; N]>; LANES - 1]>,
}

impl<const N: usize> Default for Tally<N> {
    fn default() -> Self {
        Tally {
            home: std::array::from_fn(|_| AtomicU64::new(0)),
            spill: OnceBox::new(),
        }
    }
}

impl<const N: usize> Tally<N> {
    /// Adds one to counter `i`, in this thread's lane.
    #[inline]
    pub(crate) fn bump(&self, i: usize) {
        // Relaxed: a statistic; `read` sums the lanes whenever it runs.
        match lane() {
            0 => self.home[i].fetch_add(1, Ordering::Relaxed),
            lane => self.spill()[lane - 1][i].fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Counter `i`, summed over every lane.
    pub(crate) fn read(&self, i: usize) -> u64 {
        // Relaxed: a statistic (see the module docs).
        let home = self.home[i].load(Ordering::Relaxed);
        self.spill.get().map_or(home, |lanes| {
            lanes
                .iter()
                .fold(home, |sum, lane| sum + lane[i].load(Ordering::Relaxed))
        })
    }

    #[cold]
    fn allocate() -> Box<[CachePadded<[AtomicU64; N]>; LANES - 1]> {
        Box::new(std::array::from_fn(|_| {
            CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0)))
        }))
    }

    #[inline]
    fn spill(&self) -> &[CachePadded<[AtomicU64; N]>; LANES - 1] {
        // Two threads allocating at once: one box is installed, the other dropped unused.
        self.spill.get_or_init(Self::allocate)
    }
}

impl<const N: usize> std::fmt::Debug for Tally<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries((0..N).map(|i| self.read(i)))
            .finish()
    }
}

thread_local! {
    /// This thread's lane; `usize::MAX` until its first bump.
    static LANE: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// This thread's lane, given round-robin on its first call.
#[inline]
fn lane() -> usize {
    LANE.with(|lane| match lane.get() {
        usize::MAX => {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            // Relaxed: any spread is correct; round-robin only makes two threads likely to differ.
            let mine = NEXT.fetch_add(1, Ordering::Relaxed) % LANES;
            lane.set(mine);
            mine
        }
        mine => mine,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bumps_from_many_threads_sum_exactly_whatever_lanes_they_land_in() {
        let tally = Tally::<3>::default();
        let lanes: Vec<usize> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..2 * LANES)
                .map(|t| {
                    let tally = &tally;
                    s.spawn(move || {
                        for _ in 0..1_000 {
                            tally.bump(t % 3);
                        }
                        lane()
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("no panic"))
                .collect()
        });
        // Threads 0..8 bump counters 0,1,2,0,1,2,0,1: three, three and two thousand.
        assert_eq!(
            [tally.read(0), tally.read(1), tally.read(2)],
            [3_000, 3_000, 2_000]
        );
        // The other lanes exist exactly when some thread was given one.
        assert_eq!(
            tally.spill.get().is_some(),
            lanes.iter().any(|&lane| lane != 0)
        );
    }

    #[test]
    fn a_tally_only_ever_bumped_on_one_lane_allocates_nothing_else() {
        let tally = Tally::<2>::default();
        // Find a thread on lane 0 (threads get lanes round-robin).
        loop {
            let on_home = std::thread::scope(|s| {
                s.spawn(|| {
                    if lane() == 0 {
                        tally.bump(1);
                        true
                    } else {
                        false
                    }
                })
                .join()
                .expect("no panic")
            });
            if on_home {
                break;
            }
        }
        assert_eq!((tally.read(0), tally.read(1)), (0, 1));
        assert!(tally.spill.get().is_none());
    }
}
