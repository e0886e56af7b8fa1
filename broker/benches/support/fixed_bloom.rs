//! The replay filter the broker had before retention: a fixed one-MiB Bloom filter with four
//! probes per key, kept here as the baseline `benches/retention.rs` compares against.

use std::hash::{BuildHasher, Hash, Hasher};

/// Bits in the filter (one MiB).
const BITS: u64 = 1 << 23;
/// Bits set per key.
const PROBES: u64 = 4;

/// A fixed-size Bloom filter of (client, key) pairs.
pub struct FixedBloom {
    words: Vec<u64>,
    hasher: std::collections::hash_map::RandomState,
}

impl FixedBloom {
    pub fn new() -> FixedBloom {
        FixedBloom {
            words: vec![0; (BITS / 64) as usize],
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    fn probes(&self, client: &str, key: &str) -> impl Iterator<Item = u64> + use<> {
        let mut h = self.hasher.build_hasher();
        (client, key).hash(&mut h);
        let first = h.finish();
        0xa5u8.hash(&mut h);
        let second = h.finish() | 1;
        (0..PROBES).map(move |i| first.wrapping_add(i.wrapping_mul(second)) % BITS)
    }

    pub fn insert(&mut self, client: &str, key: &str) {
        for bit in self.probes(client, key) {
            self.words[(bit / 64) as usize] |= 1 << (bit % 64);
        }
    }

    pub fn may_contain(&self, client: &str, key: &str) -> bool {
        self.probes(client, key)
            .all(|bit| self.words[(bit / 64) as usize] & (1 << (bit % 64)) != 0)
    }

    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }
}
