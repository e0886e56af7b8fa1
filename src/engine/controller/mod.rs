//! Where admission is decided.
//!
//! The controller holds one [`ClientState`] per configured identity in a hash table (created from
//! configuration, never from traffic, so memory is bounded by the quota file), the global counts in
//! two packed words on one cache-padded line ([`GlobalCounts`]: each pool's counts and holders),
//! and the validated limits in an `arc-swap` so a
//! reload never blocks an admission. A decision reads one consistent limits snapshot, checks every
//! dimension without writing (a refusal ends there), then reserves each by compare-and-swap in the
//! contract's order — the client's token, its active and pending counts
//! ([`Holding`](super::holding::Holding), [`Gauge`](super::gauge::Gauge)), then the global counts
//! in one step, where each pool's fair share is decided — rolling back everything reserved so far
//! at the first that fails.
//!
//! The client table changes only on reload, so it is immutable and swapped in with the limits, in
//! the same [`Settings`]: one load finds the client and its limits, and they always agree. (A
//! `dashmap` lookup takes its shard's read lock — an atomic write to a word every thread looking
//! up that client shares — which made a flood of refusals for one client on two threads slower
//! than on one.) Before a reload frees the slot of a removed identity it waits until no decision
//! still reads settings that had it, as an RCU writer waits out its readers.
//!
//! This file holds the controller's private layout and how one is built. What the controller
//! does with it is in the files below, each an `impl Controller` of one concern: the decision
//! (`decision`), the permit a decision hands out (`permit`), putting the store's work back at
//! start-up (`restore`), swapping in a new configuration (`reload`) and reading every count
//! (`snapshot`). They are children of this module, so the layout stays private to them: no
//! other engine file sees it.

mod decision;
pub(super) mod permit;
mod reload;
pub(super) mod restore;
mod snapshot;

use std::sync::atomic::AtomicU64 as StdAtomicU64;
use std::time::Duration;

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;

use super::caps::StorageCaps;
use super::client::{ClientState, ClientTable, Settings, Shared, StoreGauges};
use super::global::GlobalCounts;
use super::refusal::retry_after;
use super::share::PoolRule;
use super::tally::Tally;
use crate::clock::{Clock, MonotonicClock, QuantaClock, duration_nanos};
use crate::config::{Config, Identity};
use crate::sync::{Arc, Event, Mutex};

/// The default Retry-After hint for capacity refusals.
pub const DEFAULT_CAPACITY_RETRY: Duration = Duration::from_secs(2);

/// The admission controller a broker embeds. Cheap to clone; clones share all state.
#[derive(Clone)]
pub struct Controller {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    /// What the reload path keeps to itself. The mutex serializes reloads and insertions against
    /// each other; admissions never take it.
    reloading: Mutex<Reloading>,
    unconfigured_refusals: Tally<1>,
    reloads_ok: StdAtomicU64,
    reloads_failed: StdAtomicU64,
}

impl Drop for Inner {
    /// Every state's `Arc` points back at `shared`, whose settings hold the client table: empty
    /// it, or the last controller leaves the states and `shared` keeping each other alive.
    /// Handles that outlive the controller still find their slot's limits.
    fn drop(&mut self) {
        let settings = self.shared.settings.load();
        let emptied = settings.with_table(ClientTable::default());
        self.shared.settings.store(Arc::new(emptied));
    }
}

/// What the reload path keeps to itself, under its mutex. (The tracked states themselves are the
/// ones in the client table of the settings in force: no second list.)
#[derive(Default)]
struct Reloading {
    /// The settings replaced by the last reload, kept alive until the next one so that an
    /// admission still reading them never pays for freeing them (nor for dropping the client
    /// references their table holds).
    retired: Option<Arc<Settings>>,
}

/// Builds a [`Controller`] with a non-default clock, Retry-After hint or storage caps.
pub struct ControllerBuilder {
    config: Config,
    clock: Option<Box<dyn Clock>>,
    capacity_retry: Duration,
    caps: StorageCaps,
}

impl ControllerBuilder {
    /// Uses `clock` as the time source (a [`crate::ManualClock`] in tests).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Box::new(clock));
        self
    }

    /// The Retry-After hint for capacity refusals (default two seconds; rounded up to whole
    /// seconds, at least one).
    pub fn capacity_retry(mut self, hint: Duration) -> Self {
        self.capacity_retry = hint;
        self
    }

    /// The stream, sealed-payload and pending-grant store caps.
    pub fn storage_caps(mut self, caps: StorageCaps) -> Self {
        self.caps = caps;
        self
    }

    /// The controller, with one client state per configured identity.
    pub fn build(self) -> Controller {
        let source = self.clock.unwrap_or_else(|| Box::new(QuantaClock::new()));
        let clock = MonotonicClock::new(source);
        let settings = Settings {
            table: ClientTable::default(),
            clients: Box::new([]),
            global_active: 0,
            global_executing: 0,
            active_rule: PoolRule::FIRST_COME,
            executing_rule: PoolRule::FIRST_COME,
            capacity_retry: retry_after(duration_nanos(self.capacity_retry)),
            caps: self.caps,
            config: Config::defaults([]),
        };
        let shared = Arc::new(Shared {
            global: CachePadded::new(GlobalCounts::new()),
            storage: [StoreGauges::new(), StoreGauges::new()],
            settings: ArcSwap::from_pointee(settings),
            executing_pool: StdAtomicU64::new(0),
            clock,
            rescaling: Mutex::new(()),
            slot_freed: Event::new(),
            dropped_permits: StdAtomicU64::new(0),
            dropped_operations: StdAtomicU64::new(0),
        });
        let controller = Controller {
            inner: Arc::new(Inner {
                shared,
                reloading: Mutex::new(Reloading::default()),
                unconfigured_refusals: Tally::default(),
                reloads_ok: StdAtomicU64::new(0),
                reloads_failed: StdAtomicU64::new(0),
            }),
        };
        controller.apply(Some(self.config), None);
        controller
    }
}

impl Controller {
    /// A controller for `config` with the production clock and default hints and caps.
    pub fn new(config: Config) -> Controller {
        Controller::builder(config).build()
    }

    /// A builder for a controller with other clocks, hints or storage caps.
    pub fn builder(config: Config) -> ControllerBuilder {
        ControllerBuilder {
            config,
            clock: None,
            capacity_retry: DEFAULT_CAPACITY_RETRY,
            caps: StorageCaps::default(),
        }
    }

    /// The state of `identity`, if tracked (configured, or draining after removal).
    #[inline]
    pub(super) fn client(&self, identity: &str) -> Option<Arc<ClientState>> {
        self.inner
            .shared
            .settings
            .load()
            .table
            .get(identity)
            .map(|key| Arc::clone(&key.0))
    }

    fn client_or_insert(&self, identity: &Identity) -> Arc<ClientState> {
        loop {
            if let Some(client) = self.client(identity.as_str()) {
                return client;
            }
            // The configuration in force when it is applied (not read here: a reload in between
            // would be undone). Until the state is found (and so held), a reload racing this one
            // may forget it again as unheld: then it is tracked again.
            self.apply(None, Some(identity));
        }
    }

    /// What every handle shares: limits, global counts, time.
    pub(super) fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// The configuration in force.
    pub fn config(&self) -> Config {
        self.inner.shared.settings.load().config.clone()
    }

    /// The storage caps in force.
    pub fn storage_caps(&self) -> StorageCaps {
        self.inner.shared.settings.load().caps
    }

    /// The Retry-After hint of capacity refusals in force (whole seconds, at least one).
    pub fn capacity_retry(&self) -> Duration {
        self.inner.shared.settings.load().capacity_retry
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn controller() -> Controller {
        Controller::new(Config::defaults([Identity::new("a").expect("valid")]))
    }

    #[test]
    fn the_last_controller_gone_frees_every_client_state_and_the_shared_state() {
        let c = controller();
        let shared = Arc::downgrade(&c.inner.shared);
        let state = Arc::downgrade(&c.client("a").expect("configured"));
        drop(c);
        assert!(
            state.upgrade().is_none(),
            "a client state outlived its controller"
        );
        assert!(
            shared.upgrade().is_none(),
            "the shared state outlived its controller"
        );
    }

    #[test]
    fn an_operation_outliving_its_controller_still_releases_and_then_frees_everything() {
        let c = controller();
        let shared = Arc::downgrade(&c.inner.shared);
        let op = c.admit("a", false).expect("admitted").commit();
        drop(c);
        assert!(
            shared.upgrade().is_some(),
            "the operation still needs the shared counts"
        );
        op.try_start().expect("a free slot");
        op.succeed().expect("executing");
        assert_eq!(shared.upgrade().expect("held").global.get().active, 0);
        drop(op);
        assert!(
            shared.upgrade().is_none(),
            "the shared state outlived the last handle"
        );
    }
}
