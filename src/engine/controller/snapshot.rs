//! A lock-free reading of every count the controller keeps, per client and overall, as the
//! engine's own [`Snapshot`] type (which `metrics` renders).

use super::Controller;
use crate::engine::caps::Store;
use crate::engine::client::rejected_index;
use crate::engine::refusal::{FairShareRefusal, RefusalCode};
use crate::engine::snapshot::{ClientSnapshot, Snapshot, StoreSnapshot};

use std::sync::atomic::Ordering;

impl Controller {
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
                    rejected: std::array::from_fn(|i| {
                        let code = RefusalCode::ALL[i];
                        match i.checked_sub(1) {
                            // A code's own count, and its pool's fair-share refusals.
                            Some(i) => {
                                FairShareRefusal::ALL
                                    .into_iter()
                                    .filter(|fair| fair.code() == code)
                                    .map(|fair| c.rejected.read(rejected_index(code, Some(fair))))
                                    .sum::<u64>()
                                    + c.rejected.read(i)
                            }
                            None => 0,
                        }
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
        let fair_share_refusals = std::array::from_fn(|i| {
            let fair = FairShareRefusal::ALL[i];
            settings
                .table
                .iter()
                .map(|key| key.0.rejected.read(rejected_index(fair.code(), Some(fair))))
                .sum()
        });
        let global = shared.global.get();
        Snapshot {
            admitted: clients.iter().map(|c| c.admitted).sum(),
            rejected,
            active: global.active,
            pending: global.pending,
            queued: clients.iter().map(|c| c.queued).sum(),
            executing: global.executing,
            active_holders: global.active_holders,
            executing_holders: global.executing_holders,
            fair_share_refusals,
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
