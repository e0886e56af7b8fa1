//! What a replica holds: every live operation it admitted, committed or restored ([`Held`]), and,
//! until its commit, what Redis would need again if it forgot meanwhile ([`Uncommitted`]).
//! Registration sends exactly this to Redis.

use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::config::Identity;
use crate::engine::OperationState;

/// A live operation this replica holds: what re-registration counts.
pub(crate) struct Held {
    pub(crate) id: String,
    pub(crate) identity: Identity,
    pub(crate) state: std::sync::atomic::AtomicU8,
    /// Admitted here and not yet committed (its row may not be in the store yet): since when,
    /// and its idempotency key. Cleared by the commit. When Redis forgets, the recovery takes
    /// these from here, as it takes committed operations' keys and admissions from the store.
    pub(crate) uncommitted: Mutex<Option<Uncommitted>>,
}

/// What Redis must have again for a permit not yet committed, if it forgets meanwhile.
#[derive(Clone)]
pub(crate) struct Uncommitted {
    pub(crate) at: Instant,
    pub(crate) key: Option<String>,
}

impl Held {
    pub(crate) fn state(&self) -> OperationState {
        // Acquire: pairs with the AcqRel transitions (see the lifecycle's rule).
        OperationState::ALL[usize::from(self.state.load(Ordering::Acquire))]
    }
}
