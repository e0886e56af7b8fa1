//! Registration: what this replica holds (of its committed work, only what its store says it
//! still owns: `RecoverySource::owned_live`) replaces whatever Redis held under its name, and
//! the lease is taken, in one atomic step (`scripts/replace.lua`) — at start-up
//! ([`RedisController::register_or_defer`], deferred to the heartbeat while Redis does not
//! answer), after a lapsed lease, and after Redis forgot ([`Inner::register_again`]: the key
//! records go back first, then the holdings with the clients' rate debts).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::handles::RedisOperation;
use super::held::{Held, Uncommitted};
use super::notices;
use super::recovery::{RateDebt, held_state, push_debts, rate_debts};
use super::replica::{Inner, RedisController, random_hex};
use super::reply::{self, Replaced};
use super::units::ttl_millis;
use crate::admission::outcome::{RestoredOperation, Unavailable, UnavailableReason};
use crate::admission::recovery::RecoverySource;
use crate::config::Identity;

/// An operation id the scripts can record: 1 to 128 visible ASCII characters.
use crate::admission::id::shareable as valid_op_id;

/// Registrations tried in one go when Redis keeps forgetting what they restore; after these the
/// heartbeat tries again.
const REGISTRATION_TRIES: usize = 3;
/// Starts a replica's notices and heartbeat when dropped: at the end of its registration,
/// whether the registration finished or its caller dropped it mid-way.
struct StartOnDrop<'a>(&'a RedisController);

impl Drop for StartOnDrop<'_> {
    fn drop(&mut self) {
        // Both are spawned tasks: outside a runtime (one shutting down) there is nothing to run
        // them, and spawning would panic.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.0.start_background();
        }
    }
}

/// Armed while a restore registers: dropped with it (the caller gave up before the restored
/// operations had handles), it takes them out of what this replica holds, as the dropped local
/// handles release them from the in-process engine. Nothing else could ever release them. The
/// local epoch is forgotten too, so the heartbeat registers this replica again (replacing its
/// holdings, whether or not the dropped registration reached Redis) rather than renewing.
/// No release by id is sent: a restore tried again under the same ids must not be undone.
struct AbandonOnDrop<'a> {
    inner: &'a Inner,
    /// What the restore holds; emptied once its registration has ended.
    cells: Vec<Arc<Held>>,
}

impl Drop for AbandonOnDrop<'_> {
    fn drop(&mut self) {
        if self.cells.is_empty() {
            // Ended (or nothing restored, so nothing to take back).
            return;
        }
        {
            let mut held = self.inner.lock_held();
            for cell in &self.cells {
                if held.get(&cell.id).is_some_and(|h| Arc::ptr_eq(h, cell)) {
                    held.remove(&cell.id);
                }
            }
        }
        *crate::sync::lock(&self.inner.epoch) = None;
    }
}

impl RedisController {
    /// Registers this replica: whatever Redis holds for it (from an earlier run under the same
    /// name) is released and `restored` counted instead — even above a limit, so new work is
    /// refused until it drains — and the lease is taken, all in one atomic step. Starts the
    /// heartbeat. Returns a handle per restored operation, in order.
    ///
    /// If Redis does not answer now the replica still starts: `restored` is held here (its handles work; releases are kept), every admission is
    /// [`Unavailable`] (no lease), and the heartbeat registers it — the same atomic replace —
    /// as soon as Redis answers, after which admissions are decided. Returns the handles and, if
    /// registration was deferred, why.
    pub(crate) async fn register_or_defer(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> (Vec<RedisOperation>, Option<Unavailable>) {
        // Relaxed: only ever set, and read for which reason an admission names.
        self.inner.restore_begun.store(true, Ordering::Relaxed);
        let cells = {
            let _alone = self.inner.registration.write().await;
            self.hold_restored(restored)
        };
        // The notices and the heartbeat start once the registration below has ended — or been
        // dropped mid-way (the caller gave up): then the heartbeat registers this replica, as
        // when Redis does not answer now, without what the dropped restore held (see
        // `AbandonOnDrop`).
        let start = StartOnDrop(self);
        let mut abandon = AbandonOnDrop {
            inner: &self.inner,
            cells: cells.clone(),
        };
        let deferred = self.inner.register_again().await.err();
        abandon.cells.clear();
        drop(abandon);
        drop(start);
        // Keys bound to this replica's operations that its store does not hold would be
        // answered as held here forever (by this replica too): unbound now, once.
        if deferred.is_none()
            && let Some(source) = self.inner.source.get().cloned()
        {
            match self.inner.unbind_unheld_keys(&*source).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    keys = n,
                    "unbound idempotency keys of operations this replica's store does not hold"
                ),
                Err(err) => tracing::warn!(
                    error = %err,
                    "keys bound to operations this replica's store does not hold could not be \
                     unbound now; they stay bound until the next start"
                ),
            }
        }
        (self.handles(cells), deferred)
    }

    /// Takes over `adopted`, operations another replica held (its lease lapsed; the store made
    /// them this replica's): they join what this replica holds, and a registration counts them
    /// here, moving each one's record from the replica that held it (or counting it again, if
    /// that one's holdings were already reaped), in one step with the rest. If Redis does not
    /// answer now, the heartbeat registers them once it does (see `adopted_unregistered`).
    pub(crate) async fn adopt(
        &self,
        adopted: impl IntoIterator<Item = RestoredOperation>,
    ) -> (Vec<RedisOperation>, Option<Unavailable>) {
        let cells: Vec<Arc<Held>> = {
            let _alone = self.inner.registration.write().await;
            let cells: Vec<Arc<Held>> = adopted
                .into_iter()
                .filter(|op| !op.state.is_terminal() && valid_op_id(&op.id))
                .map(|op| {
                    Arc::new(Held {
                        id: op.id,
                        identity: op.identity,
                        state: std::sync::atomic::AtomicU8::new(op.state as u8),
                        uncommitted: Mutex::new(None),
                    })
                })
                .collect();
            let mut held = self.inner.lock_held();
            for cell in &cells {
                held.insert(cell.id.clone(), Arc::clone(cell));
            }
            cells
        };
        self.inner
            .adopted_unregistered
            .store(true, std::sync::atomic::Ordering::Release);
        let deferred = match self.inner.register_again().await {
            Ok(()) => {
                self.inner
                    .adopted_unregistered
                    .store(false, std::sync::atomic::Ordering::Release);
                None
            }
            Err(err) => Some(err),
        };
        (self.handles(cells), deferred)
    }

    /// Counts this replica's holdings in Redis again, from what it holds now, in one atomic
    /// replace (as after a lapsed lease): what heals a drift between Redis and the store that
    /// persists (a failover that lost writes, an older snapshot restored).
    pub(crate) async fn recount(&self) -> Result<(), Unavailable> {
        self.inner.register_again().await
    }

    /// The notices (with the refusal memory on) and the heartbeat, if not running.
    fn start_background(&self) {
        // Heard only after this replica's own registration: its `*` could only end refusals
        // remembered before (there are none yet), and heard late, it would keep this replica's
        // first refusals from being remembered.
        if self.inner.options.refusal_memory {
            self.start_notices();
        }
        self.start_heartbeat();
    }

    fn handles(&self, cells: Vec<Arc<Held>>) -> Vec<RedisOperation> {
        cells
            .into_iter()
            .map(|cell| RedisOperation::new(Arc::clone(&self.inner), cell))
            .collect()
    }

    /// Makes `restored` (the live part) what this replica holds. The caller holds `registration`
    /// alone.
    fn hold_restored(
        &self,
        restored: impl IntoIterator<Item = RestoredOperation>,
    ) -> Vec<Arc<Held>> {
        let mut cells = Vec::new();
        for op in restored {
            if op.state.is_terminal() || !valid_op_id(&op.id) {
                continue;
            }
            cells.push(Arc::new(Held {
                id: op.id,
                identity: op.identity,
                state: std::sync::atomic::AtomicU8::new(op.state as u8),
                uncommitted: Mutex::new(None),
            }));
        }
        let mut held = self.inner.lock_held();
        held.clear();
        for cell in &cells {
            held.insert(cell.id.clone(), Arc::clone(cell));
        }
        cells
    }

    fn start_notices(&self) {
        let mut slot = crate::sync::lock(&self.inner.notices);
        if slot.is_none() {
            *slot = Some(tokio::spawn(notices::listen(
                self.inner.conn.clone(),
                self.inner.keys.notices.clone(),
                Arc::clone(&self.inner.memory),
                self.inner.options.heartbeat,
                self.inner.options.call_timeout,
            )));
        }
    }
}

impl Inner {
    /// What this replica holds, listed once the admissions in flight have answered (they hold
    /// the registration lock shared), so none is missed: the permits it admitted and has not
    /// committed (id, client, what Redis needs again), and the ids of the operations committed.
    async fn listed(&self) -> (Vec<(String, Identity, Uncommitted)>, HashSet<String>) {
        let _alone = self.registration.write().await;
        let mut uncommitted = Vec::new();
        let mut committed = HashSet::new();
        for cell in self.lock_held().values() {
            match crate::sync::lock(&cell.uncommitted).clone() {
                Some(u) => uncommitted.push((cell.id.clone(), cell.identity.clone(), u)),
                None => {
                    committed.insert(cell.id.clone());
                }
            }
        }
        (uncommitted, committed)
    }

    /// Of `committed` (listed before `source` was read), the operations whose rows this
    /// replica no longer owns live: ended, or another replica's now. Empty when the source
    /// cannot tell ([`RecoverySource::owned_live`]).
    async fn disowned(
        &self,
        source: &dyn RecoverySource,
        mut committed: HashSet<String>,
    ) -> Result<HashSet<String>, Unavailable> {
        let owned = source.owned_live().await.map_err(|e| {
            self.unavailable(UnavailableReason::Reply(format!(
                "the store's live operations could not be read: {e}"
            )))
        })?;
        let Some(owned) = owned else {
            return Ok(HashSet::new());
        };
        for (id, _) in owned {
            committed.remove(&id);
        }
        if !committed.is_empty() {
            tracing::info!(
                operations = committed.len(),
                "not counted again under this replica: their rows ended or are another \
                 replica's now (decided, run or taken over elsewhere while its lease had lapsed)"
            );
        }
        Ok(committed)
    }

    /// Registers this replica again (at start-up, after a lapsed lease, after Redis forgot): if
    /// Redis lacks this replica's part of the current epoch, its key records go back first (from
    /// the recovery source, outside the registration lock, so releases are never held up by the
    /// store), then its holdings and rate debts are counted in one atomic step.
    ///
    /// Redis may forget again at any point of this (it crash-loops, say): the registration then
    /// finds the key records it restored gone, or never restored, does nothing, and they are
    /// restored again, a few times before the heartbeat takes over.
    pub(super) async fn register_again(&self) -> Result<(), Unavailable> {
        let source = self.source.get().cloned();
        for _ in 0..REGISTRATION_TRIES {
            let mut debts = Vec::new();
            let mut fleet = None;
            let mut disowned = HashSet::new();
            // '-': nothing to restore; '': Redis held this replica's part when checked.
            let mut keyed = String::from("-");
            if let Some(source) = &source {
                keyed.clear();
                // Permits admitted here but not yet committed have no row in the store yet:
                // their keys and admissions come from here. Read first (once the admissions in
                // flight have their cells), then the store, so a permit committed in between is
                // in one or both (a token counted twice can only refuse, never admit).
                let (uncommitted, committed) = self.listed().await;
                // No retirement between reading the key records and writing them back: a key
                // unbound after the read, its row then deleted, would be bound again here to an
                // operation no store holds (and answered "elsewhere" on every other replica).
                let restoring = self.restoring.write().await;
                let lacking = self.lacks_this_replica().await?;
                if lacking {
                    let mut records = source.key_records().await.map_err(|e| {
                        self.unavailable(UnavailableReason::Reply(format!(
                            "the store's key records could not be read: {e}"
                        )))
                    })?;
                    let stored: std::collections::HashSet<String> =
                        records.iter().map(|r| r.operation.clone()).collect();
                    records.extend(uncommitted.iter().filter_map(|(id, client, u)| {
                        let key = u.key.clone()?;
                        (!stored.contains(id)).then(|| crate::admission::recovery::KeyRecord {
                            client: client.clone(),
                            key,
                            operation: id.clone(),
                        })
                    }));
                    match self.restore_keys(&records).await? {
                        Some(nonce) => keyed = nonce,
                        None => continue,
                    }
                }
                drop(restoring);
                // The configuration in force now, not at start-up: a reload may have lengthened
                // a window, and admissions within it still weigh on the bucket.
                let config = self.config.load_full();
                let within = config.longest_window();
                let mut admissions = source.recent_admissions(within).await.map_err(|e| {
                    self.unavailable(UnavailableReason::Reply(format!(
                        "the store's recent admissions could not be read: {e}"
                    )))
                })?;
                admissions.extend(
                    uncommitted
                        .iter()
                        .map(|(_, client, u)| (client.clone(), u.at.elapsed())),
                );
                debts = rate_debts(&config, &admissions);
                // Only work whose row this replica still owns, read after the list above: an
                // operation committed here before it was listed has its row written, so one
                // the store does not give back as this replica's has ended or moved since.
                disowned = self.disowned(&**source, committed).await?;
                // A store the fleet shares names the whole fleet, and what each replica owns:
                // read when Redis lacks this replica's part (a new epoch: others may lack theirs
                // too), not at every registration (a takeover's, a drift's heal), since it
                // reads every replica's recent admissions.
                if lacking {
                    fleet = source.fleet(within).await.map_err(|e| {
                        self.unavailable(UnavailableReason::Reply(format!(
                            "the store's reading of the fleet could not be read: {e}"
                        )))
                    })?;
                }
            }
            let members = fleet.as_ref().map(|f| f.members.as_slice());
            let registered = {
                let _alone = self.registration.write().await;
                self.replace_locked(&debts, &keyed, members, &disowned)
                    .await?
            };
            if registered {
                if let (Some(source), Some(fleet)) = (&source, fleet) {
                    let config = self.config.load_full();
                    self.rebuild_others(&**source, fleet, &config).await;
                }
                return Ok(());
            }
        }
        Err(self.unavailable(UnavailableReason::Recovering))
    }

    /// Whether Redis lacks what this replica contributed to the deployment's current epoch (no
    /// epoch at all, or this replica not registered in it).
    async fn lacks_this_replica(&self) -> Result<bool, Unavailable> {
        let mut pipe = redis::pipe();
        pipe.get(&self.keys.epoch)
            .hget(&self.keys.members, &self.options.replica);
        let mut conn = self.conn.clone();
        let (epoch, registered): (Option<String>, Option<String>) = match tokio::time::timeout(
            self.options.call_timeout,
            pipe.query_async(&mut conn),
        )
        .await
        {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(self.failed(UnavailableReason::Redis(e.to_string()))),
            Err(_) => return Err(self.failed(UnavailableReason::Timeout)),
        };
        Ok(epoch.is_none() || epoch != registered)
    }

    /// The replace script with what `held` says now and `debts` (applied only if Redis lacks this
    /// replica's admissions for its epoch). `members`: the whole fleet, when a store the fleet
    /// shares says who it is. `disowned`: operations held here whose rows are no longer this
    /// replica's (not counted). The caller holds `registration` alone.
    async fn replace_locked(
        &self,
        debts: &[RateDebt],
        keyed: &str,
        members: Option<&[String]>,
        disowned: &HashSet<String>,
    ) -> Result<bool, Unavailable> {
        let sent = Instant::now();
        let replica = &self.options.replica;
        let fresh = random_hex();
        let known: Vec<String> = match members {
            Some(members) => members.to_vec(),
            None => crate::sync::lock(&self.known_replicas)
                .iter()
                .cloned()
                .collect(),
        };
        let mut invocation = self.scripts.replace.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(self.keys.held(replica))
            .key(self.keys.lease(replica))
            .key(&self.keys.replicas)
            .key(&self.keys.epoch)
            .key(&self.keys.recovery)
            .key(&self.keys.expected)
            .key(&self.keys.members)
            .arg(&self.keys.base)
            .arg(replica)
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl))
            .arg(self.epoch().unwrap_or_default())
            .arg(&fresh)
            .arg(keyed)
            // Whether `known` is the whole deployment: only a given list, or the store the
            // fleet shares, says so. Heard of is not known: a replica started just before Redis
            // forgot may be unknown to all. (A replica joins the store's membership before it
            // registers here, so one the store does not name holds nothing yet.)
            .arg(if self.options.replicas.is_empty() && members.is_none() {
                "0"
            } else {
                "1"
            })
            .arg(known.len());
        for name in &known {
            invocation.arg(name);
        }
        push_debts(&mut invocation, debts);
        // Kept releases before this point are for operations no longer held here (each left
        // `held` before it was kept): once Redis holds exactly `held` for this replica they are
        // moot, unless they free an idempotency key. Those kept while the script runs are not.
        // A decision whose caller hung up may still be queued for Redis: it goes first. If the
        // queue did not settle in time, such a decision can reach Redis after the replace and be
        // admitted there; its kept undo must then follow it, so none is pruned (a release of an
        // operation Redis no longer holds is answered `absent` and changes nothing).
        let settled = self.settled().await;
        let kept_before = if settled {
            crate::sync::lock(&self.outbox).len()
        } else {
            0
        };
        for cell in self.lock_held().values() {
            let Some(state) = held_state(cell.state()) else {
                continue;
            };
            if disowned.contains(&cell.id) {
                continue;
            }
            invocation
                .arg(&cell.id)
                .arg(cell.identity.as_str())
                .arg(state);
        }
        let value = self
            .call(&invocation)
            .await
            .map_err(|r| self.unavailable(r))?;
        let reply = match reply::parse_replace(&value) {
            Ok(Replaced::Registered(reply)) => reply,
            Ok(Replaced::Lacking) => return Ok(false),
            Err(e) => return Err(self.unavailable(UnavailableReason::Reply(e.to_string()))),
        };
        {
            let mut outbox = crate::sync::lock(&self.outbox);
            let mut index = 0;
            outbox.retain(|kept| {
                index += 1;
                index > kept_before || kept.key.is_some()
            });
        }
        *crate::sync::lock(&self.epoch) = Some(reply.epoch);
        // Relaxed: a reading for metrics.
        self.recovering.store(reply.recovering, Ordering::Relaxed);
        *crate::sync::lock(&self.lease_until) = Some(sent + self.options.lease_ttl);
        // Relaxed: a statistic.
        self.lease_changes.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}
