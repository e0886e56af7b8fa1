//! The fleet's lease: each replica holds a key with a TTL, renewed by its heartbeat task; a
//! replica that cannot renew stops admitting; a renewal that finds the lease lapsed, or the
//! deployment forgotten, registers again; and once this replica has renewed without a break for
//! a whole lease, the replicas whose leases lapsed are reaped, what they held released exactly
//! once (`scripts/reap.lua`).

use std::sync::Arc;
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::replica::{Inner, RedisController};
use super::reply::{self, LeaseReply};
use super::units::ttl_millis;
use crate::admission::outcome::{Unavailable, UnavailableReason};
use crate::config::Identity;

impl RedisController {
    pub(super) fn start_heartbeat(&self) {
        let mut slot = crate::sync::lock(&self.inner.heartbeat);
        if slot.is_some() {
            return;
        }
        // The task holds the controller only while it works, never while it waits, so dropping
        // every handle of a replica ends it (and its lease lapses).
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let wake = Arc::clone(&self.inner.wake);
        let period = self.inner.options.heartbeat;
        // A failover followed: register again at once (see `primary_changed`).
        let mut changes = self.inner.conn.changes();
        *slot = Some(tokio::spawn(async move {
            // The next beat is a deadline, not a sleep started afresh on every wake: kept
            // releases may wake this task more often than the period, and the lease must still
            // be renewed every period.
            let mut beat = tokio::time::Instant::now() + period;
            loop {
                let woken = tokio::select! {
                    _ = wake.notified() => true,
                    Ok(()) = changes.changed() => {
                        let Some(inner) = weak.upgrade() else { return };
                        inner.primary_changed.store(true, Ordering::Release);
                        // Relaxed: read by this task just below.
                        inner.renew_now.store(true, Ordering::Relaxed);
                        true
                    }
                    _ = tokio::time::sleep_until(beat) => false,
                };
                let Some(inner) = weak.upgrade() else { return };
                // Relaxed: a hint; a missed one waits for the next beat.
                let due = !woken
                    || inner.renew_now.swap(false, Ordering::Relaxed)
                    || tokio::time::Instant::now() >= beat;
                if due {
                    beat = tokio::time::Instant::now() + period;
                    inner.tick(beat.into_std()).await;
                } else {
                    // Never past the next beat: however many releases wait, the lease is
                    // renewed on time.
                    inner.drain_until(Some(beat.into_std())).await;
                }
            }
        }));
    }

    /// Renews the lease now (as the heartbeat does), re-registering if it lapsed.
    pub(crate) async fn renew(&self) -> Result<(), Unavailable> {
        self.inner.renew().await
    }

    /// Releases, exactly once, what every replica whose lease has lapsed held; returns how many
    /// operations were released. The heartbeat does this on every beat.
    pub(crate) async fn reap(&self) -> Result<u64, Unavailable> {
        self.inner.reap().await
    }
}

impl Inner {
    pub(super) fn lease_held(&self) -> bool {
        crate::sync::lock(&self.lease_until).is_some_and(|until| Instant::now() < until)
    }

    pub(super) fn lease_lost(&self) {
        let was = crate::sync::lock(&self.lease_until).take();
        if was.is_some() {
            // Relaxed: a statistic.
            self.lease_changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One heartbeat: the lease, kept releases (until `next_beat`), then lapsed replicas, once
    /// this replica has renewed without a break for a whole lease. The lease goes first: kept
    /// releases could otherwise keep a live replica from renewing for as long as they come.
    async fn tick(&self, next_beat: Instant) {
        let mut renewed = self.renew().await.is_ok();
        // Work taken over from a lapsed replica is counted under this one by a registration,
        // which moves each operation's record here in one step (`scripts/replace.lua`); after a
        // failover, the same registration counts what this replica holds as it holds it, in
        // place of whatever the new primary received of it.
        let adopted = renewed && self.adopted_unregistered.swap(false, Ordering::AcqRel);
        let moved = renewed && self.primary_changed.swap(false, Ordering::AcqRel);
        if (adopted || moved)
            && let Err(err) = self.register_again().await
        {
            tracing::warn!(error = %err, "what this replica holds is not counted again in redis yet; retrying");
            if adopted {
                self.adopted_unregistered.store(true, Ordering::Release);
            }
            if moved {
                self.primary_changed.store(true, Ordering::Release);
            }
            renewed = false;
        }
        self.drain_until(Some(next_beat)).await;
        let steady = crate::sync::lock(&self.renewing_since)
            .is_some_and(|since| since.elapsed() >= self.options.lease_ttl);
        if renewed && steady {
            let _ = self.reap().await;
        }
    }

    async fn renew(&self) -> Result<(), Unavailable> {
        let sent = Instant::now();
        let mut invocation = self.scripts.heartbeat.prepare_invoke();
        invocation
            .key(self.keys.lease(&self.options.replica))
            .key(&self.keys.epoch)
            .key(&self.keys.recovery)
            .arg(&self.token)
            .arg(ttl_millis(self.options.lease_ttl))
            .arg(self.epoch().unwrap_or_default());
        let value = match self.call(&invocation).await {
            Ok(v) => v,
            Err(reason) => {
                *crate::sync::lock(&self.renewing_since) = None;
                return Err(self.unavailable(reason));
            }
        };
        let renewed = matches!(
            reply::parse_lease(&value),
            Ok(LeaseReply::Renewed | LeaseReply::RenewedRecovering)
        );
        {
            let mut since = crate::sync::lock(&self.renewing_since);
            match (renewed, *since) {
                (true, None) => *since = Some(sent),
                (false, _) => *since = None,
                (true, Some(_)) => {}
            }
        }
        match reply::parse_lease(&value) {
            Ok(reply @ (LeaseReply::Renewed | LeaseReply::RenewedRecovering)) => {
                // Relaxed: a statistic (`admission_redis_recovering`), set at registration and
                // cleared here once the recovery window has closed.
                self.recovering
                    .store(reply == LeaseReply::RenewedRecovering, Ordering::Relaxed);
                *crate::sync::lock(&self.lease_until) = Some(sent + self.options.lease_ttl);
                self.learn_replicas(reply == LeaseReply::RenewedRecovering)
                    .await;
                Ok(())
            }
            Ok(LeaseReply::Lapsed) | Ok(LeaseReply::Lost) => {
                // Cut off for longer than the lease (the others may have released what this
                // replica held), or Redis forgot the deployment: count again what it holds now,
                // as a restart would, and after a loss its key records and rate buckets too.
                self.lease_lost();
                self.register_again().await
            }
            Ok(LeaseReply::Taken) => {
                self.lease_lost();
                Err(self.unavailable(UnavailableReason::LeaseNotHeld))
            }
            Err(e) => Err(self.unavailable(UnavailableReason::Reply(e.to_string()))),
        }
    }

    /// Asks the heartbeat to renew (and register again if need be) now.
    pub(super) fn renew_soon(&self) {
        // Relaxed: a hint read by the heartbeat after it is woken.
        self.renew_now.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// Remembers the deployment's replicas as Redis lists them now, for a later recovery.
    /// `recovering`: the heartbeat found a recovery under way.
    async fn learn_replicas(&self, recovering: bool) {
        let _one = self.learning.lock().await;
        let mut conn = self.conn.clone();
        // One atomic read: the set, and whether it is the whole deployment's (the epoch this
        // replica registered in, and no recovery under way) at that very moment.
        let mut read = redis::pipe();
        read.atomic()
            .smembers(&self.keys.replicas)
            .get(&self.keys.epoch)
            .exists(&self.keys.recovery);
        let reply = tokio::time::timeout(
            self.options.call_timeout,
            read.query_async::<(Vec<String>, Option<String>, bool)>(&mut conn),
        )
        .await;
        let Ok(Ok((members, epoch, recovery))) = reply else {
            return;
        };
        let mut known = crate::sync::lock(&self.known_replicas);
        if !recovering && !recovery && epoch.is_some() && epoch == self.epoch() {
            // With no recovery under way every live replica is in the set: one it no longer
            // lists was reaped (its lease lapsed, its work released), and is not waited for at
            // the next recovery. Names given with `replicas` always stay. During a recovery, or
            // after Redis forgot, the set is partial and nothing is forgotten.
            let configured = &self.options.replicas;
            known.retain(|name| *name == self.options.replica || configured.contains(name));
        }
        known.extend(members.into_iter().filter(|m| Identity::new(m).is_ok()));
    }

    async fn reap(&self) -> Result<u64, Unavailable> {
        // With a store the fleet shares, a lapsed replica whose live work is not taken over yet
        // is spared (see `RecoverySource::still_owning`): asked only once some lease lapsed.
        let mut spare: Vec<String> = Vec::new();
        if let Some(source) = self.source.get().cloned() {
            let lapsed = self.reap_call("?", &[]).await?;
            let lapsed = reply::parse_names(&lapsed)
                .map_err(|e| self.unavailable(UnavailableReason::Reply(e.to_string())))?;
            if lapsed.is_empty() {
                return Ok(0);
            }
            match source.still_owning(lapsed.clone()).await {
                Ok(None) => {}
                Ok(Some(owning)) => spare = owning,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot tell whether lapsed replicas' work was taken over; they are reaped later");
                    return Ok(0);
                }
            }
            if spare.len() == lapsed.len() {
                return Ok(0);
            }
        }
        let value = self.reap_call("!", &spare).await?;
        let reaped = reply::parse_reaped(&value)
            .map_err(|e| self.unavailable(UnavailableReason::Reply(e.to_string())))?;
        let n: u64 = reaped.iter().map(|(_, n)| n).sum();
        // Relaxed: a statistic.
        self.reaped.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }

    /// One call of `scripts/reap.lua` in `mode` (`?`: name the lapsed replicas; `!`: reap them),
    /// sparing `spare`.
    async fn reap_call(&self, mode: &str, spare: &[String]) -> Result<redis::Value, Unavailable> {
        let mut invocation = self.scripts.reap.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(&self.keys.replicas)
            .arg(&self.keys.base)
            .arg(mode);
        for name in spare {
            invocation.arg(name);
        }
        self.call(&invocation)
            .await
            .map_err(|r| self.unavailable(r))
    }
}
