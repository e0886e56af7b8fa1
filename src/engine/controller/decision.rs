//! The decision: whether one submission is admitted, read first without writing and then
//! reserved by compare-and-swap, rolled back whole at the first dimension that fails; and the
//! refusal with its Retry-After when it is not. A storage reservation is decided here too.

use std::time::Duration;

use super::Controller;
use super::permit::Permit;
use crate::clock::duration_nanos;
use crate::config::Pool;
use crate::engine::caps::{StorageCaps, Store};
use crate::engine::client::{ClientKey, ClientSettings, ClientState, Settings, rejected_index};
use crate::engine::global::{GlobalLimits, GlobalRefusal, Held};
use crate::engine::refusal::{FairShareReason, FairShareRefusal, Refusal, RefusalCode};
use crate::engine::storage::StorageReservation;
use crate::sync::Arc;

use std::sync::atomic::Ordering;

impl Controller {
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
    /// With a fair share ([`Config::fair_share`](crate::Config::fair_share)) the two global
    /// checks are each pool's rule: the active pool is full *for this client* when its fair share
    /// refuses it a slot, and the execution pool is saturated for it when it could not start an
    /// operation now. Such a refusal keeps its pool's code and the capacity hint, and is counted
    /// in [`Snapshot::fair_share_refusals`](crate::Snapshot::fair_share_refusals).
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
            .map_err(|(refusal, _)| refusal)
    }

    /// [`Controller::admit`], saying of a refusal whether a pool's fair share made it (for the
    /// one admission API's [`Refused::fair_share`](crate::Refused::fair_share)).
    pub(crate) fn admit_explained(
        &self,
        identity: &str,
        needs_approval: bool,
    ) -> Result<Permit, (Refusal, Option<FairShareRefusal>)> {
        self.admit_str(identity, needs_approval)
    }

    fn admit_str(
        &self,
        identity: &str,
        needs_approval: bool,
    ) -> Result<Permit, (Refusal, Option<FairShareRefusal>)> {
        // The state is borrowed from the settings' table for the read-only checks, and its `Arc`
        // cloned only to reserve: a refusal writes no reference count and takes no lock. The
        // settings are held until then, so a reload cannot free the state's slot meanwhile.
        let shared = &*self.inner.shared;
        let settings = shared.settings.load();
        let Some(ClientKey(found)) = settings.table.get(identity) else {
            return Err((self.refuse_unconfigured(), None));
        };
        let client: &ClientState = found;
        let limits = *client.settings(&settings);
        if !limits.configured {
            return Err((self.refuse_unconfigured(), None));
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
            active_rule: settings.active_rule,
            executing_rule: settings.executing_rule,
        };

        // Read-only, in the contract's order: under a flood a refused client's line is only
        // read, so refusals on several threads do not contend.
        let rate_wait = client.bucket.wait(now, limits.rate);
        if let Some((code, fair)) = first_failing(
            client,
            &limits,
            caps,
            global_limits,
            rate_wait,
            needs_approval,
        ) {
            return Err(self.refuse(client, &settings, code, fair, rate_wait, needs_approval));
        }
        let client = Arc::clone(found);

        if client.bucket.try_take(now, limits.rate).is_err() {
            let rate_wait = client.bucket.wait(now, limits.rate);
            let code = RefusalCode::SubmissionRateLimited;
            return Err(self.refuse(&client, &settings, code, None, rate_wait, needs_approval));
        }
        let (code, fair) = 'reserve: {
            let Some(found_active) = client.active.try_take(u64::from(limits.active)) else {
                break 'reserve (RefusalCode::ClientOperationLimit, None);
            };
            if needs_approval
                && !client
                    .pending
                    .try_acquire(1, u64::from(limits.pending).min(caps.grant_client))
            {
                global.give_back_refused(&client.active, found_active, Pool::Active);
                break 'reserve if client.pending.get() >= u64::from(limits.pending) {
                    (RefusalCode::ClientPendingLimit, None)
                } else {
                    (RefusalCode::PendingGrantLimit, None)
                };
            }
            let held = Held {
                active: found_active,
                executing: client.executing.get(),
            };
            // The client's first live operation counts it among the active pool's holders in
            // this same compare-and-swap.
            if let Err(refusal) = global.try_admit(needs_approval, global_limits, held) {
                if needs_approval {
                    client.pending.release(1);
                }
                global.give_back_refused(&client.active, found_active, Pool::Active);
                break 'reserve global_code(refusal);
            }
            // Relaxed: a statistic.
            client.admitted.fetch_add(1, Ordering::Relaxed);
            return Ok(Permit::new(client, limits.rate, needs_approval));
        };
        client.bucket.give_back(limits.rate);
        let rate_wait = client.bucket.wait(now, limits.rate);
        Err(self.refuse(&client, &settings, code, fair, rate_wait, needs_approval))
    }

    /// The refusal for `code` (made by a pool's fair share if `fair`), counted: see the free
    /// [`refuse`].
    #[inline]
    fn refuse(
        &self,
        client: &ClientState,
        settings: &Settings,
        code: RefusalCode,
        fair: Option<FairShareRefusal>,
        rate_wait: u64,
        needs_approval: bool,
    ) -> (Refusal, Option<FairShareRefusal>) {
        let refusal = refuse(client, settings, code, fair, rate_wait, needs_approval);
        (refusal, fair)
    }

    /// [`Controller::admit`] for a client whose bucket a reload is rescaling: waits for the
    /// settings that follow, then decides.
    #[cold]
    fn admit_once_rescaled(
        &self,
        identity: &str,
        needs_approval: bool,
    ) -> Result<Permit, (Refusal, Option<FairShareRefusal>)> {
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
    /// engine, or from its refusal memory), as if this engine had made it (`fair`: a pool's fair
    /// share made it): the statistics and metrics of one replica then count every answer it gave.
    pub(crate) fn count_refusal(
        &self,
        identity: &str,
        code: RefusalCode,
        fair: Option<FairShareRefusal>,
    ) {
        // Borrowed from the settings, as `admit` reads it: a counted refusal clones no `Arc`
        // (no shared reference count written under a refusal flood).
        let settings = self.inner.shared.settings.load();
        match (code, settings.table.get(identity)) {
            (RefusalCode::ClientUnconfigured, _) | (_, None) => {
                self.inner.unconfigured_refusals.bump(0);
            }
            (code, Some(ClientKey(client))) => client.rejected.bump(rejected_index(code, fair)),
        }
    }

    fn refuse_unconfigured(&self) -> Refusal {
        self.inner.unconfigured_refusals.bump(0);
        Refusal {
            code: RefusalCode::ClientUnconfigured,
            retry_after: Duration::ZERO,
        }
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
}

/// The first check `client` would fail now (its bucket's wait for a token is `rate_wait`), in the
/// contract's order, read without writing, and whether a pool's fair share fails it; `None` if
/// every check passes as things stand (the reservation then decides, exactly).
#[inline]
fn first_failing(
    client: &ClientState,
    limits: &ClientSettings,
    caps: &StorageCaps,
    global_limits: GlobalLimits,
    rate_wait: u64,
    needs_approval: bool,
) -> Option<(RefusalCode, Option<FairShareRefusal>)> {
    if rate_wait > 0 {
        return Some((RefusalCode::SubmissionRateLimited, None));
    }
    let active = client.active.get();
    if active >= u64::from(limits.active) {
        return Some((RefusalCode::ClientOperationLimit, None));
    }
    if needs_approval {
        let pending = client.pending.get();
        if pending >= u64::from(limits.pending) {
            return Some((RefusalCode::ClientPendingLimit, None));
        }
        if pending >= caps.grant_client {
            return Some((RefusalCode::PendingGrantLimit, None));
        }
    }
    let held = Held {
        active,
        executing: client.executing.get(),
    };
    client
        .shared
        .global
        .would_refuse(needs_approval, global_limits, held)
        .map(global_code)
}

/// The refusal code of a global refusal, and the fair-share refusal it is if a pool's fair share
/// made it.
fn global_code(refusal: GlobalRefusal) -> (RefusalCode, Option<FairShareRefusal>) {
    let pool = |pool, reason: Option<FairShareReason>| {
        let fair = reason.map(|reason| FairShareRefusal::new(pool, reason));
        match pool {
            Pool::Active => (RefusalCode::GlobalOperationLimit, fair),
            Pool::Executing => (RefusalCode::GlobalExecutionLimit, fair),
        }
    };
    match refusal {
        GlobalRefusal::PendingGrants => (RefusalCode::PendingGrantLimit, None),
        GlobalRefusal::Active(reason) => pool(Pool::Active, reason),
        GlobalRefusal::Executing(reason) => pool(Pool::Executing, reason),
    }
}

/// The refusal for `code`, with the largest Retry-After among every exhausted dimension (the
/// client's bucket waits `rate_wait` for a token), counted in the client's metrics (one count,
/// in its fair-share refusal's place if `fair`). Reads only; reserves nothing.
fn refuse(
    client: &ClientState,
    settings: &Settings,
    code: RefusalCode,
    fair: Option<FairShareRefusal>,
    rate_wait: u64,
    needs_approval: bool,
) -> Refusal {
    // `code` is never ClientUnconfigured here: refusals of unknown identities have no client.
    client.rejected.bump(rejected_index(code, fair));
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
