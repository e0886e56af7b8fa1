//! Where admission is decided.
//!
//! The controller holds one [`ClientState`] per configured identity in a hash table (created from
//! configuration, never from traffic, so memory is bounded by the quota file), the global counts in
//! one packed, cache-padded word ([`GlobalCounts`]), and the validated limits in an `arc-swap` so a
//! reload never blocks an admission. A decision reads one consistent limits snapshot, checks every
//! dimension without writing (a refusal ends there), then reserves each by compare-and-swap in the
//! contract's order — the client's token, its active and pending counts ([`Gauge`]), then the
//! global counts in one step — rolling back everything reserved so far at the first that fails.
//!
//! The client table changes only on reload, so it is immutable and swapped in with the limits, in
//! the same [`Settings`]: one load finds the client and its limits, and they always agree. (A
//! `dashmap` lookup takes its shard's read lock — an atomic write to a word every thread looking
//! up that client shares — which made a flood of refusals for one client on two threads slower
//! than on one.) Before a reload frees the slot of a removed identity it waits until no decision
//! still reads settings that had it, as an RCU writer waits out its readers.
//!
//! One piece past the usual size: the decision, its rollback, restore and reload all touch the same
//! private layout of client states and settings, and splitting them would widen that layout's
//! visibility to the whole engine.

use std::sync::atomic::AtomicU64 as StdAtomicU64;
use std::time::Duration;

use arc_swap::ArcSwap;
use crossbeam_utils::CachePadded;

use super::caps::{StorageCaps, Store};
use super::client::{
    ClientKey, ClientSettings, ClientState, ClientTable, Settings, Shared, StoreGauges,
};
use super::gauge::Gauge;
use super::gcra::{Bucket, Rate};
use super::global::{Counts, GlobalCounts, GlobalLimits, GlobalRefusal};
use super::lifecycle::{Operation, OperationState};
use super::refusal::{Refusal, RefusalCode, retry_after};
use super::snapshot::{ClientSnapshot, Snapshot, StoreSnapshot};
use super::storage::{StorageReservation, StoredObject};
use super::tally::Tally;
use crate::clock::{Clock, MonotonicClock, QuantaClock, duration_nanos};
use crate::config::{ClientLimits, Config, ConfigError, Identity};
use crate::sync::{Arc, Event, Mutex, lock};

use std::sync::atomic::Ordering;

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
            capacity_retry: retry_after(duration_nanos(self.capacity_retry)),
            caps: self.caps,
            config: Config::defaults([]),
        };
        let shared = Arc::new(Shared {
            global: CachePadded::new(GlobalCounts::new()),
            storage: [StoreGauges::new(), StoreGauges::new()],
            settings: ArcSwap::from_pointee(settings),
            executing_limit: StdAtomicU64::new(0),
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

fn client_settings(limits: ClientLimits, configured: bool) -> ClientSettings {
    ClientSettings {
        rate: Rate::new(limits.requests_per_window, limits.window_seconds),
        active: limits.active,
        pending: limits.pending,
        configured,
        rescaling: false,
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

    /// Decides one submission by `identity`; `needs_approval` when it will wait for an operator.
    ///
    /// Checks, in order: the client is configured → a rate token → client active → (if it needs
    /// approval) client pending and the pending-grant store → global active → global executing.
    /// The first failure is the refusal's code. The checks are first read without writing
    /// anything, so a refusal is a handful of loads (and a statistic); only a submission that
    /// passes them all reserves, by compare-and-swap, and if a concurrent admission took the
    /// last slot meanwhile everything reserved is rolled back: a refusal consumes nothing.
    ///
    /// The last check means that while `global_executing` operations execute, *every* new
    /// submission is refused `global_execution_limit` — including one that needs approval and so
    /// would not execute soon. That is deliberate: a saturated pool is the broker's signal to
    /// stop taking work until it drains (see [`Limits::global_executing`](crate::Limits)).
    ///
    /// `identity` is the authenticated client's name, as `&str`, `&String` or `&Identity` — the
    /// same type [`Controller::restore`] takes. On success, commit the permit once the durable
    /// operation exists, or refund it; never let it drop (see [`Permit`]).
    pub fn admit(
        &self,
        identity: impl AsRef<str>,
        needs_approval: bool,
    ) -> Result<Permit, Refusal> {
        self.admit_str(identity.as_ref(), needs_approval)
    }

    fn admit_str(&self, identity: &str, needs_approval: bool) -> Result<Permit, Refusal> {
        // The state is borrowed from the settings' table for the read-only checks, and its `Arc`
        // cloned only to reserve: a refusal writes no reference count and takes no lock. The
        // settings are held until then, so a reload cannot free the state's slot meanwhile.
        let shared = &*self.inner.shared;
        let settings = shared.settings.load();
        let Some(ClientKey(found)) = settings.table.get(identity) else {
            return Err(self.refuse_unconfigured());
        };
        let client: &ClientState = found;
        let limits = *client.settings(&settings);
        if !limits.configured {
            return Err(self.refuse_unconfigured());
        }
        if limits.rescaling {
            drop(settings);
            return self.admit_once_rescaled(identity, needs_approval);
        }
        let now = shared.clock.now();
        let global = &*shared.global;
        let caps = &settings.caps;
        let global_limits = GlobalLimits {
            active: settings.global_active,
            executing: settings.global_executing,
            pending_grants: caps.grant_global,
        };

        // Read-only, in the contract's order: under a flood a refused client's line is only
        // read, so refusals on several threads do not contend.
        let rate_wait = client.bucket.wait(now, limits.rate);
        if let Some(code) = first_failing(
            client,
            &limits,
            caps,
            global_limits,
            rate_wait,
            needs_approval,
        ) {
            return Err(refuse(client, &settings, code, rate_wait, needs_approval));
        }
        let client = Arc::clone(found);

        if client.bucket.try_take(now, limits.rate).is_err() {
            return Err(refuse(
                &client,
                &settings,
                RefusalCode::SubmissionRateLimited,
                client.bucket.wait(now, limits.rate),
                needs_approval,
            ));
        }
        let code = 'reserve: {
            if !client.active.try_acquire(1, u64::from(limits.active)) {
                break 'reserve RefusalCode::ClientOperationLimit;
            }
            if needs_approval
                && !client
                    .pending
                    .try_acquire(1, u64::from(limits.pending).min(caps.grant_client))
            {
                client.active.release(1);
                break 'reserve if client.pending.get() >= u64::from(limits.pending) {
                    RefusalCode::ClientPendingLimit
                } else {
                    RefusalCode::PendingGrantLimit
                };
            }
            if let Err(refusal) = global.try_admit(needs_approval, global_limits) {
                if needs_approval {
                    client.pending.release(1);
                }
                client.active.release(1);
                break 'reserve global_code(refusal);
            }
            // Relaxed: a statistic.
            client.admitted.fetch_add(1, Ordering::Relaxed);
            return Ok(Permit {
                client: Some(client),
                rate: limits.rate,
                needs_approval,
            });
        };
        client.bucket.give_back(limits.rate);
        let rate_wait = client.bucket.wait(now, limits.rate);
        Err(refuse(&client, &settings, code, rate_wait, needs_approval))
    }

    /// [`Controller::admit`] for a client whose bucket a reload is rescaling: waits for the
    /// settings that follow, then decides.
    #[cold]
    fn admit_once_rescaled(&self, identity: &str, needs_approval: bool) -> Result<Permit, Refusal> {
        self.wait_for_rescale(identity);
        self.admit_str(identity, needs_approval)
    }

    /// Returns once no reload is rescaling `identity`'s bucket. A reload marks the clients whose
    /// rate it changes, waits for the decisions already reading the settings before the mark,
    /// rescales those buckets and puts the new settings in force: a few microseconds a client,
    /// during which this yields the thread. (A decision reading unmarked settings holds them
    /// through its take, so the rescale waits for it instead.)
    pub(crate) fn wait_for_rescale(&self, identity: &str) {
        loop {
            let settings = self.inner.shared.settings.load();
            let rescaling = settings
                .table
                .get(identity)
                .is_some_and(|ClientKey(state)| state.settings(&settings).rescaling);
            drop(settings);
            if !rescaling {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Counts a refusal of `identity` with `code` decided elsewhere (by the replicas' shared
    /// engine, or from its refusal memory), as if this engine had made it: the statistics and
    /// metrics of one replica then count every answer it gave.
    pub(crate) fn count_refusal(&self, identity: &str, code: RefusalCode) {
        // Borrowed from the settings, as `admit` reads it: a counted refusal clones no `Arc`
        // (no shared reference count written under a refusal flood).
        let settings = self.inner.shared.settings.load();
        match (code, settings.table.get(identity)) {
            (RefusalCode::ClientUnconfigured, _) | (_, None) => {
                self.inner.unconfigured_refusals.bump(0);
            }
            (code, Some(ClientKey(client))) => client.rejected.bump(code.index() - 1),
        }
    }

    fn refuse_unconfigured(&self) -> Refusal {
        self.inner.unconfigured_refusals.bump(0);
        Refusal {
            code: RefusalCode::ClientUnconfigured,
            retry_after: Duration::ZERO,
        }
    }

    /// Puts a non-terminal operation found in the durable store back under the controller's
    /// counts, at start-up. Restored work counts even above a lowered limit (new work is then
    /// refused until it drains), so a restart never resets quotas. An identity no longer
    /// configured is tracked, so its work still counts globally, but cannot be admitted again.
    ///
    /// `identity` is the client's name as the store holds it (`&str`, `&String` or `&Identity`,
    /// as [`Controller::admit`] takes it); a name that is not a valid identity is
    /// [`RestoreError::InvalidIdentity`].
    ///
    /// What to do with a row found `executing`: it was running when the process stopped, and
    /// whether its effect happened is unknown. The reference broker marks it `failed` with error
    /// `execution_interrupted` in the store and does not restore it (it must never run twice);
    /// restoring it as `executing` is for a broker that can resume or reattach to the work.
    ///
    /// ```
    /// use unyolo_admission::{Config, Controller, Identity, OperationState};
    ///
    /// let c = Controller::new(Config::defaults([Identity::new("bot-7").unwrap()]));
    /// let op = c.restore("bot-7", OperationState::Pending).unwrap();
    /// assert_eq!(c.snapshot().pending, 1);
    /// assert!(c.restore("not a name", OperationState::Pending).is_err());
    /// # drop(op);
    /// ```
    pub fn restore(
        &self,
        identity: impl AsRef<str>,
        state: OperationState,
    ) -> Result<Operation, RestoreError> {
        if state.is_terminal() {
            return Err(RestoreError::Terminal(state));
        }
        let identity = match self.client(identity.as_ref()) {
            Some(client) => client.identity.clone(),
            None => Identity::new(identity.as_ref()).map_err(|_| RestoreError::InvalidIdentity)?,
        };
        let identity = &identity;
        let client = self.client_or_insert(identity);
        let global = &self.inner.shared.global;
        client.active.force_acquire(1);
        match state {
            OperationState::Pending => {
                client.pending.force_acquire(1);
                global.force(Counts::ACTIVE.plus(Counts::PENDING));
            }
            OperationState::Approved => global.force(Counts::ACTIVE),
            OperationState::Executing => {
                client.executing.force_acquire(1);
                global.force(Counts::ACTIVE.plus(Counts::EXECUTING));
            }
            _ => unreachable!("terminal states returned above"),
        }
        Ok(Operation::new(client, state))
    }

    /// Rebuilds `identity`'s rate bucket at start-up from its admissions made `admitted_ago`
    /// (each the age of an operation it created, in any state), so a restart never hands out a
    /// fresh burst. Each admission spends a token as it did when made; admissions a whole window
    /// old or older count nothing; the bucket only becomes emptier, and never owes more than one
    /// window. An identity that is not configured has no bucket: nothing happens.
    pub fn restore_rate(
        &self,
        identity: impl AsRef<str>,
        admitted_ago: impl IntoIterator<Item = Duration>,
    ) {
        let Some(client) = self.client(identity.as_ref()) else {
            return;
        };
        self.wait_for_rescale(identity.as_ref());
        let shared = &*self.inner.shared;
        let settings = shared.settings.load();
        let limits = *client.settings(&settings);
        if !limits.configured {
            return;
        }
        if limits.rescaling {
            // A reload began meanwhile: replay in the rate it puts in force.
            drop(settings);
            return self.restore_rate(identity, admitted_ago);
        }
        let now = shared.clock.now();
        client.bucket.replay(
            now,
            limits.rate,
            admitted_ago.into_iter().map(duration_nanos),
        );
    }

    /// Reserves `bytes` (and one file) in `store` for `identity` before a write. Settle the
    /// reservation to the real size after the write; dropping it releases everything.
    pub fn reserve_storage(
        &self,
        identity: &str,
        store: Store,
        bytes: u64,
    ) -> Result<StorageReservation, Refusal> {
        let Some(client) = self.client(identity) else {
            return Err(self.refuse_unconfigured());
        };
        let settings = self.inner.shared.settings.load();
        if !client.settings(&settings).configured {
            return Err(self.refuse_unconfigured());
        }
        StorageReservation::reserve(client, store, bytes, &settings)
    }

    /// Counts an object already in `store` at start-up (restored usage may exceed the caps).
    pub fn restore_storage(&self, identity: &Identity, store: Store, bytes: u64) -> StoredObject {
        StoredObject::restore(self.client_or_insert(identity), store, bytes)
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
        if let Some(client) = self.client(identity.as_str()) {
            return client;
        }
        // The configuration in force when it is applied (not read here: a reload in between
        // would be undone).
        self.apply(None, Some(identity));
        self.client(identity.as_str())
            .expect("apply tracks the extra identity")
    }

    fn new_client_state(&self, identity: Identity, slot: usize) -> ClientState {
        ClientState {
            bucket: Bucket::new(),
            active: Gauge::new(),
            pending: Gauge::new(),
            executing: Gauge::new(),
            slot,
            identity,
            shared: Arc::clone(&self.inner.shared),
            storage: [StoreGauges::new(), StoreGauges::new()],
            admitted: StdAtomicU64::new(0),
            rejected: Tally::default(),
        }
    }

    /// Swaps in a new, already validated configuration without blocking any admission.
    ///
    /// Live counts are kept; each bucket keeps its fill level scaled to its new capacity; new
    /// identities get full buckets; removed identities are refused from now on while their live
    /// operations still release correctly. A limit lowered below current usage refuses new work
    /// until usage drains.
    pub fn reload(&self, config: Config) {
        self.apply(Some(config), None);
        // Relaxed: a statistic.
        self.inner.reloads_ok.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads, validates and applies the quota file at `path` against the identities configured now.
    /// On any error the old configuration stays, and the failure is counted.
    pub fn reload_from_path(&self, path: &std::path::Path) -> Result<(), ConfigError> {
        let identities: Vec<Identity> = self
            .inner
            .shared
            .settings
            .load()
            .config
            .identities()
            .cloned()
            .collect();
        match Config::from_path(path, identities) {
            Ok(config) => {
                self.reload(config);
                Ok(())
            }
            Err(err) => {
                self.record_failed_reload();
                Err(err)
            }
        }
    }

    /// Reads, validates and applies the quota file at `path` for `identities` — which may add
    /// clients (new secrets) or remove some (their live work still drains correctly). `None`
    /// means the defaults, as at start-up with [`Config::from_optional_path`]; a path whose file
    /// is missing is an error. On any error the old configuration stays, and the failure is
    /// counted.
    ///
    /// ```
    /// use unyolo_admission::{Config, Controller, Identity};
    ///
    /// let a = Identity::new("bot-a").unwrap();
    /// let c = Controller::new(Config::defaults([a.clone()]));
    /// assert!(c.admit("bot-b", false).is_err());
    /// let b = Identity::new("bot-b").unwrap();
    /// let gone = Some("/no/such/quota.json".as_ref());
    /// assert!(c.reload_from_optional_path(gone, [a.clone(), b.clone()]).is_err());
    /// assert!(c.admit("bot-b", false).is_err());
    /// c.reload_from_optional_path(None, [a, b]).unwrap();
    /// assert!(c.admit("bot-b", false).is_ok());
    /// let s = c.snapshot();
    /// assert_eq!((s.reloads_applied, s.reloads_rejected), (1, 1));
    /// ```
    pub fn reload_from_optional_path<I: IntoIterator<Item = Identity>>(
        &self,
        path: Option<&std::path::Path>,
        identities: I,
    ) -> Result<(), ConfigError> {
        match Config::from_optional_path(path, identities) {
            Ok(config) => {
                self.reload(config);
                Ok(())
            }
            Err(err) => {
                self.record_failed_reload();
                Err(err)
            }
        }
    }

    /// Counts a reload that was rejected before it reached the controller (an invalid file).
    pub fn record_failed_reload(&self) {
        // Relaxed: a statistic.
        self.inner.reloads_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Installs `config`, or the configuration in force for `None` (and tracks `extra`, an
    /// unconfigured identity met while restoring).
    ///
    /// A decision finds a client and its slot's limits in the same settings, so it never reads a
    /// slot that is not its own as long as a slot is reused only once nothing can reach the state
    /// that had it: `forget_unheld` sees to that. Admissions take none of the locks used here.
    fn apply(&self, config: Option<Config>, extra: Option<&Identity>) {
        let mut guard = lock(&self.inner.reloading);
        let Reloading { retired } = &mut *guard;
        let shared = &self.inner.shared;
        // Once no decision reads the settings the last reload retired, their table no longer
        // counts in a state's references.
        if let Some(old) = retired.take() {
            free_when_unread(old);
        }
        let mut current = shared.settings.load_full();
        let config = config.unwrap_or_else(|| current.config.clone());
        // The same configuration again (a SIGHUP with an unchanged file), with no identity to add
        // and none draining to forget: nothing to swap.
        let nothing_new = extra.is_none_or(|identity| current.table.contains(identity.as_str()));
        let nothing_draining = current.table.len() == config.identities().len();
        if nothing_new
            && nothing_draining
            && current.config == config
            && !current.clients.is_empty()
        {
            return;
        }
        let now = shared.clock.now();
        let mut tracked = self.forget_unheld(&mut current, &config, extra, now);
        // Slots of the states still tracked keep their place; the others are free.
        let mut slots: Vec<Option<ClientSettings>> = vec![None; current.clients.len()];
        for state in tracked.iter() {
            slots[state.slot] = Some(ClientSettings {
                configured: false,
                rescaling: false,
                ..current.clients[state.slot]
            });
        }
        let mut free = (0..slots.len())
            .filter(|&i| slots[i].is_none())
            .collect::<Vec<_>>()
            .into_iter();
        let mut place =
            |slots: &mut Vec<Option<ClientSettings>>, limits: ClientSettings| match free.next() {
                Some(i) => {
                    slots[i] = Some(limits);
                    i
                }
                None => {
                    slots.push(Some(limits));
                    slots.len() - 1
                }
            };
        let mut new_states = Vec::new();
        // Until the new settings are in force, no refund reads a rate its bucket is not scaled to.
        let rescaling = lock(&shared.rescaling);
        // Nor does a decision: the clients whose rate changes are marked first, and their buckets
        // rescaled only once no decision reads the settings from before the mark.
        let changing: Vec<usize> = tracked
            .iter()
            .filter(|state| {
                config
                    .effective(state.identity.as_str())
                    .is_some_and(|limits| {
                        client_settings(limits, true).rate != current.clients[state.slot].rate
                    })
            })
            .map(|state| state.slot)
            .collect();
        if !changing.is_empty() {
            self.mark_rescaling(&mut current, &changing);
        }
        // Read again: decisions spent tokens while this waited (for the readers, the refunds,
        // the marked decisions), and a rescale measures the use up to the instant it scales.
        let now = shared.clock.now();
        for identity in config.identities() {
            let limits = client_settings(
                config
                    .effective(identity.as_str())
                    .expect("configured identity"),
                true,
            );
            match find(&tracked, identity.as_str()).ok().map(|i| &tracked[i]) {
                Some(state) => {
                    let old = current.clients[state.slot];
                    if old.rate != limits.rate {
                        state.bucket.rescale(now, old.rate, limits.rate);
                    }
                    slots[state.slot] = Some(limits);
                }
                None => {
                    let slot = place(&mut slots, limits);
                    new_states.push(self.new_client_state(identity.clone(), slot));
                }
            }
        }
        if let Some(identity) = extra
            && find(&tracked, identity.as_str()).is_err()
            && config.effective(identity.as_str()).is_none()
        {
            let limits = client_settings(config.limits().client_defaults(), false);
            let slot = place(&mut slots, limits);
            new_states.push(self.new_client_state(identity.clone(), slot));
        }
        while slots.last().is_some_and(Option::is_none) {
            slots.pop();
        }
        let unused = client_settings(config.limits().client_defaults(), false);
        let limits = *config.limits();
        // Relaxed: a lone value; a start racing the reload may use either limit, as it may the
        // settings themselves.
        shared
            .executing_limit
            .store(u64::from(limits.global_executing), Ordering::Relaxed);
        tracked.extend(new_states.into_iter().map(Arc::new));
        *retired = Some(shared.settings.swap(Arc::new(Settings {
            table: table_of(&tracked),
            clients: slots.into_iter().map(|s| s.unwrap_or(unused)).collect(),
            global_active: u64::from(limits.global_active),
            global_executing: u64::from(limits.global_executing),
            config,
            capacity_retry: current.capacity_retry,
            caps: current.caps,
        })));
        drop(rescaling);
        // A raised `global_executing` may let waiting operations start.
        shared.slot_freed.notify(usize::MAX);
    }

    /// Every state the settings in force track, sorted by identity, less the removed identities
    /// nothing holds any more and whose buckets are full again: those are forgotten, so their
    /// slots can be reused. (An identity removed with tokens spent is remembered until they are
    /// back: added again meanwhile, it must not get a fresh burst.)
    ///
    /// Once listed here, a state no handle holds has two references: the list's and the table of
    /// the settings in force (`current`). But a decision that found it there may be about to clone
    /// it, and is reading its slot, so such states are first left out of the table (the settings
    /// are swapped for the same limits without them) and the old settings freed once no decision
    /// reads them. A count of one (the list's) afterwards proves that no permit, operation, stored
    /// object or decision in flight holds the state, nor can find it again.
    fn forget_unheld(
        &self,
        current: &mut Arc<Settings>,
        config: &Config,
        extra: Option<&Identity>,
        now: u64,
    ) -> Vec<Arc<ClientState>> {
        let mut states: Vec<Arc<ClientState>> =
            current.table.iter().map(|key| Arc::clone(&key.0)).collect();
        states.sort_unstable_by(|a, b| a.identity.cmp(&b.identity));
        let unheld = |state: &Arc<ClientState>| {
            !is_named(config, extra, &state.identity)
                && Arc::strong_count(state) == 2
                && state.bucket.is_full(now)
        };
        if !states.iter().any(unheld) {
            return states;
        }
        let kept = states.iter().filter(|state| !unheld(state));
        let without =
            Arc::new(current.with_table(kept.map(|s| ClientKey(Arc::clone(s))).collect()));
        let shared = &self.inner.shared;
        let old = shared.settings.swap(Arc::clone(&without));
        *current = without;
        free_when_unread(old);
        // A state a decision took meanwhile is kept (and back in the table after this reload).
        states.retain(|state| {
            is_named(config, extra, &state.identity) || Arc::strong_count(state) > 1
        });
        states
    }

    /// Puts in force the settings `current` with the clients in `slots` marked `rescaling`, and
    /// returns once no decision reads the settings that were in force before: from then until
    /// the next swap nothing takes from those clients' buckets (see
    /// [`Controller::wait_for_rescale`]), so they can be rescaled.
    fn mark_rescaling(&self, current: &mut Arc<Settings>, slots: &[usize]) {
        let mut marked = current.with_table(
            current
                .table
                .iter()
                .map(|key| ClientKey(Arc::clone(&key.0)))
                .collect(),
        );
        for &slot in slots {
            marked.clients[slot].rescaling = true;
        }
        let marked = Arc::new(marked);
        let old = self.inner.shared.settings.swap(Arc::clone(&marked));
        *current = marked;
        free_when_unread(old);
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

    /// A lock-free reading of every count, for metrics and tests.
    pub fn snapshot(&self) -> Snapshot {
        let shared = &self.inner.shared;
        // The states and their slots' limits from the same settings, as `admit` reads them; none
        // marked as being rescaled (a bucket read in the rate it is leaving shows phantom tokens).
        let settings = loop {
            let settings = shared.settings.load();
            if !settings.clients.iter().any(|limits| limits.rescaling) {
                break settings;
            }
            drop(settings);
            std::thread::yield_now();
        };
        let states = settings.table.iter().map(|key| &*key.0);
        let now = shared.clock.now();
        let mut clients: Vec<ClientSnapshot> = states
            .map(|c| {
                let limits = c.settings(&settings);
                let (executing, pending, active) =
                    (c.executing.get(), c.pending.get(), c.active.get());
                ClientSnapshot {
                    identity: c.identity.clone(),
                    configured: limits.configured,
                    active,
                    pending,
                    // Queued is what is active but neither pending nor executing: approved work,
                    // and admitted work needing no approval whose permit is not committed yet.
                    queued: active.saturating_sub(pending + executing),
                    executing,
                    tokens: c.bucket.available(now, limits.rate),
                    admitted: c.admitted.load(Ordering::Relaxed),
                    rejected: std::array::from_fn(|i| match i.checked_sub(1) {
                        Some(i) => c.rejected.read(i),
                        None => 0,
                    }),
                    storage: std::array::from_fn(|i| StoreSnapshot {
                        store: Store::ALL[i],
                        files: c.storage[i].files.get(),
                        bytes: c.storage[i].bytes.get(),
                    }),
                }
            })
            .collect();
        clients.sort_by(|a, b| a.identity.cmp(&b.identity));
        let mut rejected: [u64; RefusalCode::ALL.len()] = [0; RefusalCode::ALL.len()];
        rejected[RefusalCode::ClientUnconfigured.index()] =
            self.inner.unconfigured_refusals.read(0);
        for c in &clients {
            for (total, n) in rejected.iter_mut().zip(c.rejected) {
                *total += n;
            }
        }
        let global = shared.global.get();
        Snapshot {
            admitted: clients.iter().map(|c| c.admitted).sum(),
            rejected,
            active: global.active,
            pending: global.pending,
            queued: clients.iter().map(|c| c.queued).sum(),
            executing: global.executing,
            storage: std::array::from_fn(|i| StoreSnapshot {
                store: Store::ALL[i],
                files: shared.storage[i].files.get(),
                bytes: shared.storage[i].bytes.get(),
            }),
            reloads_applied: self.inner.reloads_ok.load(Ordering::Relaxed),
            reloads_rejected: self.inner.reloads_failed.load(Ordering::Relaxed),
            dropped_permits: shared.dropped_permits.load(Ordering::Relaxed),
            dropped_operations: shared.dropped_operations.load(Ordering::Relaxed),
            clock_regressions: shared.clock.regressions(),
            clients,
        }
    }
}

/// The first check `client` would fail now (its bucket's wait for a token is `rate_wait`), in the
/// contract's order, read without writing; `None` if every check passes as things stand (the
/// reservation then decides, exactly).
#[inline]
fn first_failing(
    client: &ClientState,
    limits: &ClientSettings,
    caps: &StorageCaps,
    global_limits: GlobalLimits,
    rate_wait: u64,
    needs_approval: bool,
) -> Option<RefusalCode> {
    if rate_wait > 0 {
        return Some(RefusalCode::SubmissionRateLimited);
    }
    if client.active.get() >= u64::from(limits.active) {
        return Some(RefusalCode::ClientOperationLimit);
    }
    if needs_approval {
        let pending = client.pending.get();
        if pending >= u64::from(limits.pending) {
            return Some(RefusalCode::ClientPendingLimit);
        }
        if pending >= caps.grant_client {
            return Some(RefusalCode::PendingGrantLimit);
        }
    }
    client
        .shared
        .global
        .would_refuse(needs_approval, global_limits)
        .map(global_code)
}

fn global_code(refusal: GlobalRefusal) -> RefusalCode {
    match refusal {
        GlobalRefusal::PendingGrants => RefusalCode::PendingGrantLimit,
        GlobalRefusal::Active => RefusalCode::GlobalOperationLimit,
        GlobalRefusal::Executing => RefusalCode::GlobalExecutionLimit,
    }
}

/// The refusal for `code`, with the largest Retry-After among every exhausted dimension (the
/// client's bucket waits `rate_wait` for a token), counted in the client's metrics. Reads only;
/// reserves nothing.
fn refuse(
    client: &ClientState,
    settings: &Settings,
    code: RefusalCode,
    rate_wait: u64,
    needs_approval: bool,
) -> Refusal {
    // `code` is never ClientUnconfigured here: refusals of unknown identities have no client.
    client.rejected.bump(code.index() - 1);
    let limits = client.settings(settings);
    let capacity_retry = duration_nanos(settings.capacity_retry);
    if rate_wait >= capacity_retry {
        // The largest hint wins, and no capacity hint is larger: no need to look at capacity.
        return Refusal::after_nanos(code, rate_wait);
    }
    let global = client.shared.global.get();
    let caps = &settings.caps;
    let capacity_exhausted = code.is_capacity()
        || client.active.get() >= u64::from(limits.active)
        || (needs_approval
            && (client.pending.get() >= u64::from(limits.pending).min(caps.grant_client)
                || global.pending >= caps.grant_global))
        || global.active >= settings.global_active
        || global.executing >= settings.global_executing;
    let capacity_wait = if capacity_exhausted {
        capacity_retry
    } else {
        0
    };
    Refusal::after_nanos(code, rate_wait.max(capacity_wait))
}

/// An admitted submission, before the broker has created its durable operation.
///
/// [`Permit::commit`] turns it into a lifecycle [`Operation`] once the durable operation exists;
/// [`Permit::refund`] returns its slots and its rate token when the broker failed through its own
/// fault (the store was unavailable), or when it lost a race to a concurrent duplicate.
///
/// # Dropping it
///
/// Dropped without either, it returns its slots but its rate token stays spent. That is never
/// what a broker means: in an async handler it happens when the client hangs up while the handler
/// awaits the store between `admit` and `commit` — the future is dropped at that `.await`, the
/// permit with it, and a row the store may already have written is counted nowhere. So run
/// everything from `admit` to `commit` (or `refund`) in a task a disconnect cannot cancel
/// (`tokio::spawn`, and have the handler only await its outcome); `examples/axum_broker.rs` shows
/// the whole pattern. Each drop is counted in
/// [`Snapshot::dropped_permits`](crate::Snapshot::dropped_permits) and exported as
/// `admission_dropped_permits_total`; anything but zero is a bug in the embedding.
#[must_use = "a permit holds slots until it is committed or refunded"]
pub struct Permit {
    /// The client, until the permit is committed, refunded or dropped (then `None`): moving it
    /// out on commit hands the operation the permit's own reference, no second count.
    client: Option<Arc<ClientState>>,
    rate: Rate,
    needs_approval: bool,
}

impl Permit {
    fn client(&self) -> &ClientState {
        // Only `commit`, `refund` and `drop` take the client, and each consumes the permit.
        self.client
            .as_deref()
            .expect("a live permit holds its client")
    }

    /// The admitted client.
    pub fn identity(&self) -> &Identity {
        &self.client().identity
    }

    /// Whether the operation waits for an operator (it starts `pending`, else `approved`).
    pub fn needs_approval(&self) -> bool {
        self.needs_approval
    }

    /// The durable operation exists: track it, `pending` if it needs approval, else `approved`.
    pub fn commit(mut self) -> Operation {
        let client = self.client.take().expect("a live permit holds its client");
        let state = if self.needs_approval {
            OperationState::Pending
        } else {
            OperationState::Approved
        };
        Operation::new(client, state)
    }

    /// The broker failed through its own fault (say, the store was unavailable): return the
    /// slots and the rate token. The token given back is exactly the one taken, even if a reload
    /// has changed the client's rate since (and rescaled its bucket).
    pub fn refund(mut self) {
        if let Some(client) = self.client.take() {
            release_admission(&client, self.needs_approval);
            let shared = &*client.shared;
            let _rescaling = lock(&shared.rescaling);
            let rate_now = client.settings(&shared.settings.load()).rate;
            client.bucket.give_back_nanos(self.rate.token_in(rate_now));
        }
    }
}

/// Returns what an uncommitted admission holds.
fn release_admission(client: &ClientState, needs_approval: bool) {
    if needs_approval {
        client
            .shared
            .global
            .release(Counts::ACTIVE.plus(Counts::PENDING));
        client.pending.release(1);
    } else {
        client.shared.global.release(Counts::ACTIVE);
    }
    client.active.release(1);
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            release_admission(&client, self.needs_approval);
            // Relaxed: a statistic.
            client
                .shared
                .dropped_permits
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("identity", &self.client.as_ref().map(|c| &c.identity))
            .field("needs_approval", &self.needs_approval)
            .finish()
    }
}

/// Why an operation could not be restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Terminal operations hold nothing and are not restored.
    Terminal(OperationState),
    /// The client name is not a valid identity (so no configuration could ever name it).
    InvalidIdentity,
    /// Replicated: the operation id cannot be recorded in the shared store (1 to 128 visible
    /// ASCII characters), so the other replicas could never count it; nothing is restored.
    UnshareableId,
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestoreError::Terminal(state) => {
                write!(f, "a {state} operation is terminal and holds no slots")
            }
            RestoreError::InvalidIdentity => f.write_str("the client name is not a valid identity"),
            RestoreError::UnshareableId => f.write_str(
                "the operation id cannot be recorded in the shared store (1 to 128 visible ASCII \
                 characters)",
            ),
        }
    }
}

impl std::error::Error for RestoreError {}

/// Where `identity` is in the sorted `states` (or where it would go).
fn find(states: &[Arc<ClientState>], identity: &str) -> Result<usize, usize> {
    states.binary_search_by(|state| state.identity.as_str().cmp(identity))
}

/// Whether a reload to `config` keeps tracking `identity` by name.
fn is_named(config: &Config, extra: Option<&Identity>, identity: &Identity) -> bool {
    config.effective(identity.as_str()).is_some() || extra == Some(identity)
}

/// The client table of `states`.
// A `ClientKey` hashes and compares only its identity, which never changes.
#[allow(clippy::mutable_key_type)]
fn table_of(states: &[Arc<ClientState>]) -> ClientTable {
    states.iter().map(|s| ClientKey(Arc::clone(s))).collect()
}

/// Frees `settings` once no decision reads them any more (`swap` has counted every reader still
/// holding them): the grace period after which a state left out of newer tables is unreachable.
/// Decisions hold settings only for one decision's loads, so the wait is short; freeing them here
/// spares a decision the cost.
fn free_when_unread(mut settings: Arc<Settings>) {
    loop {
        match Arc::try_unwrap(settings) {
            Ok(unread) => break drop(unread),
            Err(still_read) => {
                settings = still_read;
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn controller() -> Controller {
        Controller::new(Config::defaults([Identity::new("a").expect("valid")]))
    }

    /// `a` alone, `requests` a window of `window_seconds`.
    fn rate_of_a(requests: u32, window_seconds: u32) -> Config {
        let json = format!(
            r#"{{"requests_per_window": {requests}, "window_seconds": {window_seconds},
                "client_active": 10, "client_pending": 1, "global_active": 10,
                "global_executing": 10}}"#
        );
        Config::from_bytes(json.as_bytes(), [Identity::new("a").expect("valid")]).expect("valid")
    }

    #[test]
    fn a_rescale_measures_the_tokens_spent_while_the_reload_waited() {
        // The reload waits for a refund in progress (here: the test holding the lock) while the
        // client spends its whole burst; the rescale must count all of it, or the shorter window
        // hands out the part spent during the wait.
        let clock = crate::clock::ManualClock::new();
        let c = Controller::builder(rate_of_a(1000, 60))
            .clock(clock.clone())
            .build();
        let refund_in_progress = lock(&c.inner.shared.rescaling);
        std::thread::scope(|s| {
            let reload = s.spawn(|| c.reload(rate_of_a(1000, 1)));
            // The reload has read the time and waits for the lock (nothing else it does waits).
            while c.inner.reloading.try_lock().is_ok() {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(20));
            clock.advance(Duration::from_millis(50));
            let mut spent = 0;
            while c.admit("a", false).is_ok() {
                spent += 1;
            }
            assert_eq!(spent, 1000, "the whole burst, in the old window");
            drop(refund_in_progress);
            reload.join().expect("the reload ends");
        });
        let quota = c.quota("a").expect("configured");
        assert_eq!(quota.rate.remaining, 0, "{quota:?}");
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

    #[test]
    fn a_removed_identity_nothing_holds_is_forgotten_and_its_slot_reused() {
        let c = controller();
        let a = Arc::downgrade(&c.client("a").expect("configured"));
        c.reload(Config::defaults([Identity::new("b").expect("valid")]));
        assert!(a.upgrade().is_none(), "the removed state is freed at once");
        let b = c.client("b").expect("configured");
        assert_eq!(b.slot, 0, "the freed slot is reused");
        assert!(c.client("a").is_none());
    }
}
