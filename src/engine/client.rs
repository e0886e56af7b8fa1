//! The state admission, the lifecycle and the storage quotas share: one [`ClientState`] per tracked
//! identity, the limits in force ([`Settings`]) and what every handle needs to give back what it
//! holds ([`Shared`]). It sits below `controller`, `lifecycle` and `storage`, which all build on it,
//! so the engine's imports run one way.

use std::sync::atomic::AtomicU64 as StdAtomicU64;
use std::time::Duration;

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;

use super::caps::StorageCaps;
use super::gauge::Gauge;
use super::gcra::{Bucket, Rate};
use super::global::GlobalCounts;
use super::holding::Holding;
use super::refusal::{FairShareRefusal, RefusalCode};
use super::share::PoolRule;
use super::tally::Tally;
use crate::clock::MonotonicClock;
use crate::config::{Config, Identity};
use crate::sync::{Arc, Event, IntoNotification, Mutex};

/// State every handle needs to release what it holds: global counts, limits, time.
pub(crate) struct Shared {
    pub(crate) global: CachePadded<GlobalCounts>,
    pub(crate) storage: [StoreGauges; 2],
    pub(crate) settings: ArcSwap<Settings>,
    /// `global_executing` and the execution pool's fair share in force, one packed
    /// [`PoolSettings`](super::share::PoolSettings) mirrored so starting an operation reads one
    /// word rather than loading the whole settings.
    pub(crate) executing_pool: StdAtomicU64,
    pub(crate) clock: MonotonicClock,
    /// Held by a reload from its first bucket rescale until its settings are swapped in, and by
    /// a refund while it reads the rate in force and gives its token back, so a refund always
    /// measures its token in the rate its bucket is scaled to. Admissions never take it.
    pub(crate) rescaling: Mutex<()>,
    /// Notified once for each execution slot given back (and for all waiters when a reload may
    /// have raised `global_executing`), so an executor can wait for a slot instead of polling.
    pub(crate) slot_freed: Event,
    /// Permits dropped without [`commit`](super::Permit::commit) or
    /// [`refund`](super::Permit::refund): an embedder bug (see the crate docs).
    pub(crate) dropped_permits: StdAtomicU64,
    /// Operation handles dropped while not terminal: an embedder bug (see the crate docs).
    pub(crate) dropped_operations: StdAtomicU64,
}

impl Shared {
    /// One execution slot was given back: wake one more waiter (in addition to any already woken
    /// and not yet run, so two slots freed at once wake two).
    #[inline]
    pub(crate) fn execution_slot_freed(&self) {
        self.slot_freed.notify(1.additional());
    }
}

/// One consistent view of every limit and of the clients they apply to, swapped whole on reload.
pub(crate) struct Settings {
    /// Every tracked client, found by identity: a decision looks its client up here and reads its
    /// limits from `clients` in the same settings, so the two always agree.
    pub(crate) table: ClientTable,
    pub(crate) config: Config,
    /// Per-client limits, indexed by [`ClientState::slot`]. A slot is reused only once no handle
    /// holds the state that had it.
    pub(crate) clients: Box<[ClientSettings]>,
    pub(crate) global_active: u64,
    pub(crate) global_executing: u64,
    /// Each pool's fair share ([`PoolRule::FIRST_COME`] without one).
    pub(crate) active_rule: PoolRule,
    pub(crate) executing_rule: PoolRule,
    pub(crate) capacity_retry: Duration,
    pub(crate) caps: StorageCaps,
}

/// The client table. Hashed with foldhash: the keys are configured identities, never inserted from
/// traffic, so a fast hash is safe.
pub(crate) type ClientTable = std::collections::HashSet<ClientKey, foldhash::fast::RandomState>;

/// A client state as a key of the client table: hashed and compared by its identity, so the table
/// is looked up by `&str` and the identity is stored once.
pub(crate) struct ClientKey(pub(crate) Arc<ClientState>);

impl std::hash::Hash for ClientKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // Must hash exactly as the borrowed `str` does.
        self.0.identity.as_str().hash(state);
    }
}

impl PartialEq for ClientKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.identity == other.0.identity
    }
}

impl Eq for ClientKey {}

impl std::borrow::Borrow<str> for ClientKey {
    fn borrow(&self) -> &str {
        self.0.identity.as_str()
    }
}

impl Settings {
    /// The same limits over another client table.
    // A `ClientKey` hashes and compares only its identity, which never changes.
    #[allow(clippy::mutable_key_type)]
    pub(crate) fn with_table(&self, table: ClientTable) -> Settings {
        Settings {
            table,
            clients: self.clients.clone(),
            config: self.config.clone(),
            ..*self
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientSettings {
    pub(crate) rate: Rate,
    pub(crate) active: u32,
    pub(crate) pending: u32,
    pub(crate) configured: bool,
    /// A reload is rescaling this client's bucket to another rate: a decision on it (or a reading
    /// of its bucket) waits for the settings that follow, which carry the new rate.
    pub(crate) rescaling: bool,
}

/// Everything the controller knows about one client.
///
/// Laid out in order (`repr(C)`) so that neighbouring clients on the heap do not share the lines
/// they write: the fields every admission writes come first (right after the `Arc`'s counts,
/// which admissions write too), then the fields it only reads, then over 64 bytes of fields
/// written only on refusals and storage traffic. A neighbour's hot head can therefore only share a
/// line with this state's cold tail.
#[repr(C)]
pub(crate) struct ClientState {
    pub(crate) bucket: Bucket,
    pub(crate) active: Holding,
    pub(crate) pending: Gauge,
    pub(crate) executing: Holding,
    pub(crate) admitted: StdAtomicU64,
    pub(crate) slot: usize,
    pub(crate) shared: Arc<Shared>,
    pub(crate) identity: Identity,
    pub(crate) storage: [StoreGauges; 2],
    /// Refusals by code, indexed like [`RefusalCode::ALL`] less one: an unconfigured identity has
    /// no state, so `ClientUnconfigured` is never counted here. Those a pool's fair share made
    /// are counted in places of their own after the codes (see [`rejected_index`]), so a refusal
    /// is one count whatever made it. Striped by thread, so a flood of refusals on several
    /// threads writes no line twice from two cores.
    pub(crate) rejected: Tally<REJECTED_COUNTERS>,
}

/// The counters of [`ClientState::rejected`]: one per refusal code a client can be refused
/// with, then one per fair-share refusal (a pool and a reason).
pub(crate) const REJECTED_COUNTERS: usize =
    RefusalCode::ALL.len() - 1 + FairShareRefusal::ALL.len();

/// Where a refusal with `code` is counted in [`ClientState::rejected`]: a fair-share refusal in
/// its own place (its code's count is the sum of its place and the code's), any other in its
/// code's. Never `ClientUnconfigured`: that client has no state.
#[inline]
pub(crate) fn rejected_index(code: RefusalCode, fair: Option<FairShareRefusal>) -> usize {
    match fair {
        Some(fair) => RefusalCode::ALL.len() - 1 + fair.index(),
        None => code.index() - 1,
    }
}

impl ClientState {
    pub(crate) fn settings<'a>(&self, settings: &'a Settings) -> &'a ClientSettings {
        &settings.clients[self.slot]
    }
}

/// Files and bytes held in one store, by one client or by all.
#[derive(Debug)]
pub(crate) struct StoreGauges {
    pub(crate) files: Gauge,
    pub(crate) bytes: Gauge,
}

impl StoreGauges {
    pub(crate) fn new() -> StoreGauges {
        StoreGauges {
            files: Gauge::new(),
            bytes: Gauge::new(),
        }
    }
}
