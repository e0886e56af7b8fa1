//! A small deterministic generator (xorshift) for model tests, so a failing sequence can be
//! replayed by its seed.

/// Xorshift over a non-zero seed.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}
