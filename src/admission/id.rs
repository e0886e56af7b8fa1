//! Operation ids, made by the admission itself so no caller can hand the shared store an id it
//! has seen before: a 64-bit random number drawn once per process from the operating system's
//! random source, then a 64-bit sequence. Unique across restarts and replicas without any
//! coordination (two processes collide only if they draw the same 64 random bits), and cheap:
//! one relaxed increment, no allocation until the id is written out. An operation restored from
//! a store keeps the id it was stored under, whatever its form.

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// An operation's id: written `op_` and 32 lowercase hex digits when the admission made it, or as
/// it was stored for a restored operation. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OperationId(Repr);

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Repr {
    Made { process: u64, sequence: u64 },
    Stored(std::sync::Arc<str>),
}

static PROCESS: OnceLock<u64> = OnceLock::new();
static SEQUENCE: AtomicU64 = AtomicU64::new(0);

impl OperationId {
    /// A fresh id, never handed out before by any process (see the module docs).
    pub(crate) fn new() -> OperationId {
        let process = *PROCESS.get_or_init(|| {
            let mut bytes = [0u8; 8];
            getrandom::fill(&mut bytes).expect("the operating system's random source is available");
            u64::from_le_bytes(bytes)
        });
        // Relaxed: only uniqueness matters, and one counter gives it.
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        OperationId(Repr::Made { process, sequence })
    }

    /// The id an operation was stored under (restored at start-up).
    pub(crate) fn stored(id: &str) -> OperationId {
        OperationId(Repr::Stored(id.into()))
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Made { process, sequence } => write!(f, "op_{process:016x}{sequence:016x}"),
            Repr::Stored(id) => f.write_str(id),
        }
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Whether `id` can name an operation in the shared store: 1 to 128 visible ASCII characters
/// (no space: Redis records hold it beside other words). Every id [`OperationId`] makes can.
pub(crate) fn shareable(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A fresh random id: `prefix`, `_`, 32 lowercase hex digits (128 bits from the operating
/// system's random source), for things other than operations (streams).
pub fn random_id(prefix: &str) -> String {
    use std::fmt::Write;
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the operating system's random source is available");
    let mut id = String::with_capacity(prefix.len() + 33);
    id.push_str(prefix);
    id.push('_');
    for b in bytes {
        let _ = write!(id, "{b:02x}");
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_are_op_and_32_hex_digits_and_never_repeat() {
        let ids: std::collections::HashSet<String> = (0..10_000)
            .map(|_| OperationId::new().to_string())
            .collect();
        assert_eq!(ids.len(), 10_000);
        for id in ids.iter().take(10) {
            assert_eq!(id.len(), 35, "{id}");
            assert!(id.starts_with("op_"), "{id}");
            assert!(
                id[3..]
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{id}"
            );
        }
    }

    #[test]
    fn a_restored_id_is_the_stored_one() {
        assert_eq!(
            OperationId::stored("op-from-2025").to_string(),
            "op-from-2025"
        );
    }

    #[test]
    fn random_ids_carry_their_prefix_and_128_bits() {
        let a = random_id("st");
        assert_eq!(a.len(), 35);
        assert!(a.starts_with("st_"));
        assert_ne!(a, random_id("st"));
    }
}
