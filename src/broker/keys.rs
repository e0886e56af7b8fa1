//! Which (client, idempotency key) pairs may already have an operation: a fixed-size Bloom
//! filter in front of the store's replay lookup.
//!
//! Replay comes before admission, so every submission, refused or not, must learn whether its key
//! was used before. Almost always it was not, and answering that from memory keeps refusals off
//! SQLite entirely. A "maybe" (a key that was used, or a false positive) falls through to the
//! store, so the filter only ever saves work and never changes an answer. Its memory is fixed
//! (one MiB) whatever the traffic; as the store grows past about a million keys, false positives
//! rise and more lookups reach the store, which stays correct.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits in the filter (one MiB).
const BITS: u64 = 1 << 23;
/// Bits set per key.
const PROBES: u64 = 4;

/// A fixed-size Bloom filter of (client, idempotency key) pairs.
pub(crate) struct KeyFilter {
    words: Box<[AtomicU64]>,
    hasher: std::collections::hash_map::RandomState,
}

impl KeyFilter {
    pub(crate) fn new() -> KeyFilter {
        KeyFilter {
            words: (0..BITS / 64).map(|_| AtomicU64::new(0)).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// The bit positions of a pair: double hashing from two halves of one 128-bit spread.
    fn probes(&self, client: &str, key: &str) -> impl Iterator<Item = u64> + use<> {
        let mut h = self.hasher.build_hasher();
        (client, key).hash(&mut h);
        let first = h.finish();
        0xa5u8.hash(&mut h);
        let second = h.finish() | 1;
        (0..PROBES).map(move |i| first.wrapping_add(i.wrapping_mul(second)) % BITS)
    }

    /// Records that the pair has an operation.
    pub(crate) fn insert(&self, client: &str, key: &str) {
        for bit in self.probes(client, key) {
            // Relaxed: submissions with the same pair are serialized by the broker's per-key lock,
            // whose release/acquire orders this write before any later lookup of the pair.
            self.words[(bit / 64) as usize].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        }
    }

    /// Whether the pair may have an operation (`false` means it certainly has none).
    pub(crate) fn may_contain(&self, client: &str, key: &str) -> bool {
        self.probes(client, key).all(|bit| {
            // Relaxed: see `insert`.
            self.words[(bit / 64) as usize].load(Ordering::Relaxed) & (1 << (bit % 64)) != 0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inserted_pair_is_always_found_and_pairs_are_distinct_by_client() {
        let filter = KeyFilter::new();
        for i in 0..10_000 {
            filter.insert("agent", &format!("key-{i}"));
        }
        assert!((0..10_000).all(|i| filter.may_contain("agent", &format!("key-{i}"))));
        let false_positives = (0..10_000)
            .filter(|i| filter.may_contain("other", &format!("key-{i}")))
            .count();
        assert!(false_positives < 10, "{false_positives}");
    }
}
