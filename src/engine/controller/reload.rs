//! Reload: swapping in a new, validated configuration without blocking any admission — buckets
//! rescaled to their new rate once no decision reads the old one, removed identities forgotten
//! once nothing holds them, and the settings a reload replaces freed only once unread.

use std::sync::atomic::AtomicU64 as StdAtomicU64;

use super::{Controller, Reloading};
use crate::config::{ClientLimits, Config, ConfigError, Identity};
use crate::engine::client::{
    ClientKey, ClientSettings, ClientState, ClientTable, Settings, StoreGauges,
};
use crate::engine::gauge::Gauge;
use crate::engine::gcra::{Bucket, Rate};
use crate::engine::holding::Holding;
use crate::engine::share::{PoolRule, PoolSettings};
use crate::engine::tally::Tally;
use crate::sync::{Arc, lock};

use std::sync::atomic::Ordering;

impl Controller {
    /// Swaps in a new, already validated configuration without blocking any admission.
    ///
    /// Live counts are kept; each bucket keeps its fill level scaled to its new capacity; new
    /// identities get full buckets; removed identities are refused from now on while their live
    /// operations still release correctly. A limit lowered below current usage refuses new work
    /// until usage drains. A fair share turned on, off or changed applies from the next decision
    /// on the counts and holders as they are (they are kept whether or not one is in force);
    /// nothing held is taken back.
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
    pub(super) fn apply(&self, config: Option<Config>, extra: Option<&Identity>) {
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
        let fair_share = config.fair_share();
        let active_rule = PoolRule::of(fair_share.map(|share| share.active));
        let executing_rule = PoolRule::of(fair_share.map(|share| share.executing));
        let executing_pool = PoolSettings {
            limit: u64::from(limits.global_executing),
            rule: executing_rule,
        };
        // Relaxed: a lone word (limit and rule together); a start racing the reload may use
        // either, as it may the settings themselves.
        shared
            .executing_pool
            .store(executing_pool.pack(), Ordering::Relaxed);
        tracked.extend(new_states.into_iter().map(Arc::new));
        *retired = Some(shared.settings.swap(Arc::new(Settings {
            table: table_of(&tracked),
            clients: slots.into_iter().map(|s| s.unwrap_or(unused)).collect(),
            global_active: u64::from(limits.global_active),
            global_executing: u64::from(limits.global_executing),
            active_rule,
            executing_rule,
            config,
            capacity_retry: current.capacity_retry,
            caps: current.caps,
        })));
        drop(rescaling);
        // A raised `global_executing` (or a fair share changed) may let waiting operations start.
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

    fn new_client_state(&self, identity: Identity, slot: usize) -> ClientState {
        ClientState {
            bucket: Bucket::new(),
            active: Holding::new(),
            pending: Gauge::new(),
            executing: Holding::new(),
            slot,
            identity,
            shared: Arc::clone(&self.inner.shared),
            storage: [StoreGauges::new(), StoreGauges::new()],
            admitted: StdAtomicU64::new(0),
            rejected: Tally::default(),
        }
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
    use std::time::Duration;

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
