//! Which (client, idempotency key) pairs may already have an operation: a scalable cuckoo filter
//! in front of the store's replay lookup, sized from the store at start-up, growing as keys
//! arrive and rebuilt from the store as keys retire.
//!
//! Replay comes before admission, so every submission, refused or not, must learn whether its key
//! was used before. Almost always it was not, and answering that from memory keeps refusals off
//! the store (SQLite's file or PostgreSQL's server). A "maybe" (a key that was used, or a false positive) falls through to the store, so
//! the filter only ever saves work and never changes an answer, as long as it never says "no"
//! for a stored key.
//!
//! **Why a scalable cuckoo filter** ([`scalable_cuckoo_filter`]): a fixed Bloom filter's false
//! positives climb with the number of keys until nearly every new key reaches the store. This
//! one adds a sub-filter twice the size of the last whenever the last fills up, with a tighter
//! fingerprint each time, so the false-positive rate stays under [`FALSE_POSITIVE_BOUND`] however
//! many keys arrive; an insertion never fails.
//!
//! **Why retirement rebuilds instead of deleting.** The crate can remove an item, but across
//! sub-filters it removes the first matching fingerprint it finds, which can be another live key's
//! (an alias in an older sub-filter): that key would then be answered "no" and a replay of it would
//! create a second operation. So retired keys are never removed one by one. Instead, once the
//! retention sweep has retired a quarter of the keys the filter holds (see [`KeyFilter::stale`]),
//! it rebuilds the filter from the store ([`KeyFilter::rebuild`]): inserts made while the store is
//! read are recorded and replayed into the new filter before it is swapped in, so no key is lost.
//! Until then a retired key may still answer "maybe", which costs one store lookup that finds
//! nothing, and the submission is new work, as a replay after retention is.
//!
//! Public only for the benchmarks (`benches/retention.rs`); not part of the crate's API.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Mutex, RwLock};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use scalable_cuckoo_filter::{ScalableCuckooFilter, ScalableCuckooFilterBuilder};

/// The upper bound on the share of never-used keys the filter answers "maybe" for.
pub const FALSE_POSITIVE_BOUND: f64 = 0.0005;

/// The smallest first sub-filter (keys), whatever the store holds.
const MIN_CAPACITY: usize = 100_000;

/// How many never-inserted values [`KeyFilter::measure_false_positives`] probes.
const PROBES: u32 = 20_000;

type Filter = ScalableCuckooFilter<u64, scalable_cuckoo_filter::DefaultHasher, SmallRng>;

/// A growable filter of (client, idempotency key) pairs.
pub struct KeyFilter {
    /// Pairs are hashed with a per-process random key first, so a client cannot choose keys
    /// that collide; the filter stores that 64-bit digest.
    hasher: RandomState,
    filter: RwLock<Filter>,
    /// While a rebuild reads the store: the digests inserted meanwhile, replayed into the new
    /// filter before it replaces the old one.
    rebuilding: Mutex<Option<Vec<u64>>>,
    /// Keys retired from the store since the filter was last built.
    retired: std::sync::atomic::AtomicU64,
}

/// The filter's size and accuracy, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FilterStats {
    /// Keys inserted (approximately: the crate's count).
    pub keys: u64,
    /// Memory the filter's tables take, in bytes.
    pub bytes: u64,
    /// The measured share of never-inserted values it answers "maybe" for.
    pub false_positive_ratio: f64,
}

fn new_filter(expected_keys: usize) -> Filter {
    ScalableCuckooFilterBuilder::new()
        .initial_capacity(expected_keys.saturating_mul(2).max(MIN_CAPACITY))
        .false_positive_probability(FALSE_POSITIVE_BOUND)
        .rng(SmallRng::from_os_rng())
        .finish()
}

impl KeyFilter {
    /// An empty filter sized for about `expected_keys` (it grows past that by itself).
    pub fn with_capacity(expected_keys: usize) -> KeyFilter {
        KeyFilter {
            hasher: RandomState::new(),
            filter: RwLock::new(new_filter(expected_keys)),
            rebuilding: Mutex::new(None),
            retired: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn digest(&self, client: &str, key: &str) -> u64 {
        self.hasher.hash_one((client, key))
    }

    /// Records that the pair has an operation.
    pub fn insert(&self, client: &str, key: &str) {
        let digest = self.digest(client, key);
        // The rebuild lock first and throughout: a rebuild swapping filters holds it too while it
        // replays and swaps, so this digest lands in the old filter and in the pending list, or
        // in the new filter; never in a filter about to be dropped only.
        let mut rebuilding = crate::sync::lock(&self.rebuilding);
        self.filter
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(&digest);
        if let Some(pending) = rebuilding.as_mut() {
            pending.push(digest);
        }
    }

    /// Whether the pair may have an operation (`false` means it certainly has none).
    pub fn may_contain(&self, client: &str, key: &str) -> bool {
        let digest = self.digest(client, key);
        self.filter
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&digest)
    }

    /// Notes that `count` keys left the store (they stay in the filter until the next rebuild).
    pub fn retired(&self, count: u64) {
        // Relaxed: a hint for when to rebuild; nothing is published through it.
        self.retired
            .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether enough keys retired since the last build (a quarter of what the filter holds) that
    /// a rebuild is worth its store scan.
    pub fn stale(&self) -> bool {
        let retired = self.retired.load(std::sync::atomic::Ordering::Relaxed);
        let keys = self.filter.read().unwrap_or_else(|p| p.into_inner()).len() as u64;
        retired > 0 && retired.saturating_mul(4) >= keys
    }

    /// Rebuilds the filter from the store: `expected_keys` sizes it, `scan` must call its argument
    /// once per (client, key) the store holds, reading the store after this call began (blocking;
    /// run it off the async threads). Pairs inserted meanwhile are kept. If `scan` fails the old
    /// filter stays.
    pub fn rebuild<E>(
        &self,
        expected_keys: usize,
        scan: impl FnOnce(&mut dyn FnMut(&str, &str)) -> Result<(), E>,
    ) -> Result<(), E> {
        *crate::sync::lock(&self.rebuilding) = Some(Vec::new());
        let retired_before = self.retired.load(std::sync::atomic::Ordering::Relaxed);
        let mut fresh = new_filter(expected_keys);
        let scanned = scan(&mut |client, key| fresh.insert(&self.digest(client, key)));
        let mut rebuilding = crate::sync::lock(&self.rebuilding);
        let pending = rebuilding.take().unwrap_or_default();
        scanned?;
        for digest in pending {
            fresh.insert(&digest);
        }
        *self.filter.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        self.retired
            .fetch_sub(retired_before, std::sync::atomic::Ordering::Relaxed);
        drop(rebuilding);
        Ok(())
    }

    /// The filter's size, and its false-positive ratio measured by probing it with random values
    /// that were never inserted.
    pub fn stats(&self) -> FilterStats {
        let filter = self.filter.read().unwrap_or_else(|p| p.into_inner());
        FilterStats {
            keys: filter.len() as u64,
            bytes: filter.bits() / 8,
            false_positive_ratio: measure_false_positives(&filter),
        }
    }
}

/// The share of [`PROBES`] random 64-bit values (never inserted but with chance 2^-64 each) that
/// `filter` answers "maybe" for.
fn measure_false_positives(filter: &Filter) -> f64 {
    let mut rng = SmallRng::from_os_rng();
    let hits = (0..PROBES)
        .filter(|_| filter.contains(&rand::Rng::random::<u64>(&mut rng)))
        .count();
    hits as f64 / f64::from(PROBES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inserted_pair_is_always_found_and_pairs_are_distinct_by_client() {
        let filter = KeyFilter::with_capacity(0);
        for i in 0..10_000 {
            filter.insert("agent", &format!("key-{i}"));
        }
        assert!((0..10_000).all(|i| filter.may_contain("agent", &format!("key-{i}"))));
        let false_positives = (0..10_000)
            .filter(|i| filter.may_contain("other", &format!("key-{i}")))
            .count();
        assert!(false_positives < 10, "{false_positives}");
    }

    #[test]
    fn the_filter_grows_past_its_first_size_and_keeps_every_key() {
        let filter = KeyFilter::with_capacity(0);
        let keys = MIN_CAPACITY * 3;
        for i in 0..keys {
            filter.insert("agent", &i.to_string());
        }
        assert!((0..keys).all(|i| filter.may_contain("agent", &i.to_string())));
        let stats = filter.stats();
        assert!(
            stats.false_positive_ratio <= FALSE_POSITIVE_BOUND * 4.0,
            "{stats:?}"
        );
        assert!(stats.bytes > 0 && stats.keys >= keys as u64, "{stats:?}");
    }

    #[test]
    fn a_rebuild_drops_retired_keys_and_keeps_keys_inserted_while_it_reads() {
        let filter = KeyFilter::with_capacity(0);
        for i in 0..1_000 {
            filter.insert("agent", &format!("old-{i}"));
        }
        filter.retired(1_000);
        assert!(filter.stale());
        filter
            .rebuild(10, |visit| {
                // The store now holds only `kept`; `racing` is inserted while it is read.
                visit("agent", "kept");
                filter.insert("agent", "racing");
                Ok::<(), ()>(())
            })
            .unwrap();
        assert!(filter.may_contain("agent", "kept"));
        assert!(filter.may_contain("agent", "racing"));
        let still = (0..1_000)
            .filter(|i| filter.may_contain("agent", &format!("old-{i}")))
            .count();
        assert!(still < 5, "{still}");
        assert!(!filter.stale());
    }
}
