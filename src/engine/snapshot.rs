//! A plain reading of every count the controller keeps, taken without locks: the engine's own
//! type, so the engine knows nothing of how it is exposed. The `metrics` module renders it for
//! Prometheus.

use crate::config::Identity;

use super::caps::Store;
use super::refusal::{FairShareRefusal, RefusalCode};

/// Every count the controller keeps, read at one moment (each count exactly, the set not as one
/// atomic picture).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Submissions admitted.
    pub admitted: u64,
    /// Submissions refused, indexed like [`RefusalCode::ALL`].
    pub rejected: [u64; RefusalCode::ALL.len()],
    /// Operations pending, approved or executing, across all clients.
    pub active: u64,
    /// Operations awaiting an operator decision (the pending-grant store's count).
    pub pending: u64,
    /// Operations waiting for an execution slot: approved ones, and admitted ones that need no
    /// approval (counted from admission, before the broker commits the permit). Derived as
    /// active − pending − executing.
    pub queued: u64,
    /// Operations executing.
    pub executing: u64,
    /// Clients holding at least one live operation: the active pool's holders, among whom its
    /// fair share is divided (`admission_pool_holders{pool="active"}`). Kept with or without a
    /// fair share in force.
    pub active_holders: u64,
    /// Clients holding at least one executing operation: the executing pool's holders
    /// (`admission_pool_holders{pool="executing"}`).
    pub executing_holders: u64,
    /// Refusals a pool's fair share made where first come, first served would have admitted,
    /// indexed like [`FairShareRefusal::ALL`]
    /// (`admission_fair_share_refusals_total{pool,reason}`). Each is also counted in `rejected`
    /// under its pool's code.
    pub fair_share_refusals: [u64; FairShareRefusal::ALL.len()],
    /// Files and bytes in each capped store, indexed like [`Store::ALL`].
    pub storage: [StoreSnapshot; 2],
    /// Reloads applied (`admission_config_reloads_total{result="applied"}`).
    pub reloads_applied: u64,
    /// Reloads rejected: an invalid configuration, the old one stayed
    /// (`admission_config_reloads_total{result="rejected"}`).
    pub reloads_rejected: u64,
    /// Permits dropped without commit or refund (`admission_dropped_permits_total`). Not zero
    /// means a bug in the embedding: a permit was lost at an `.await` (see [`crate::Permit`]).
    pub dropped_permits: u64,
    /// Operation handles dropped while not terminal (`admission_dropped_operations_total`). Not
    /// zero means a bug in the embedding: the store and the counts disagree (see
    /// [`crate::Operation`]).
    pub dropped_operations: u64,
    /// Clock readings clamped because the time source went backwards.
    pub clock_regressions: u64,
    /// Each tracked client, by identity.
    pub clients: Vec<ClientSnapshot>,
}

impl Snapshot {
    /// Refusals with `code`.
    pub fn rejected(&self, code: RefusalCode) -> u64 {
        self.rejected[code as usize]
    }

    /// Refusals the fair share `refusal` (a pool and a reason) made.
    pub fn fair_share_refused(&self, refusal: FairShareRefusal) -> u64 {
        self.fair_share_refusals[refusal.index()]
    }

    /// The client `identity`, if tracked.
    pub fn client(&self, identity: &str) -> Option<&ClientSnapshot> {
        self.clients
            .iter()
            .find(|c| c.identity.as_str() == identity)
    }

    /// Whether every operation count, holder count and storage count is zero.
    pub fn is_idle(&self) -> bool {
        self.active == 0
            && self.pending == 0
            && self.queued == 0
            && self.executing == 0
            && self.active_holders == 0
            && self.executing_holders == 0
            && self.storage.iter().all(|s| s.files == 0 && s.bytes == 0)
            && self.clients.iter().all(ClientSnapshot::is_idle)
    }
}

/// One client's counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientSnapshot {
    /// The client.
    pub identity: Identity,
    /// Whether it is in the configuration in force (a removed client is tracked until it drains).
    pub configured: bool,
    /// Operations pending, approved or executing.
    pub active: u64,
    /// Operations awaiting approval.
    pub pending: u64,
    /// Operations waiting for an execution slot: approved ones, and admitted ones that need no
    /// approval (counted from admission, before the broker commits the permit). Derived as
    /// active − pending − executing.
    pub queued: u64,
    /// Operations executing.
    pub executing: u64,
    /// Rate tokens available now.
    pub tokens: u64,
    /// Submissions admitted.
    pub admitted: u64,
    /// Submissions refused, indexed like [`RefusalCode::ALL`].
    pub rejected: [u64; RefusalCode::ALL.len()],
    /// Files and bytes in each capped store.
    pub storage: [StoreSnapshot; 2],
}

impl ClientSnapshot {
    /// Whether the client holds nothing.
    pub fn is_idle(&self) -> bool {
        self.active == 0
            && self.pending == 0
            && self.queued == 0
            && self.executing == 0
            && self.storage.iter().all(|s| s.files == 0 && s.bytes == 0)
    }
}

/// Files and bytes in one store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreSnapshot {
    /// The store.
    pub store: Store,
    /// Files held.
    pub files: u64,
    /// Bytes held.
    pub bytes: u64,
}
