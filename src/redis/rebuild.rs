//! One replica rebuilds the others' work after Redis forgot, from a store the whole fleet shares
//! ([`crate::admission::RecoverySource::fleet`]): once this replica has registered again, the
//! live work and rate debts of every replica that has not (yet) registered in the new epoch are
//! counted under that replica's name (`scripts/rebuild.lua`), with a lease nobody holds the
//! token of. A replica that died a moment before Redis forgot (its membership of the store still
//! live, its Redis lease gone with the rest) has its work counted at once, not only once a
//! survivor takes it over, and is reaped when that lease lapses, as any dead replica is; one
//! that lives replaces what was counted for it when it registers, as after a lapsed lease.
//!
//! The store is read before the script runs, so a move made meanwhile on another replica (a
//! decision, a cancel: written to the store, then sent to Redis, where the operation was not yet
//! held) could be counted from the older reading. The states are read again once the script has
//! run, and what moved is moved in the counts too, by id, as any release is (kept until Redis
//! answers, never applied twice).

use super::decision::{Kept, Target};
use super::recovery::{held_state, push_debts, rate_debts};
use super::replica::Inner;
use super::reply;
use super::units::ttl_millis;
use crate::admission::recovery::{FleetReading, RecoverySource};
use crate::config::Config;
use crate::engine::OperationState;

/// What a move from `held` to `now` is in the counts (`None`: nothing to move).
fn moved(held: OperationState, now: Option<OperationState>) -> Option<Target> {
    match now {
        None => Some(Target::Terminal),
        Some(now) if now == held => None,
        Some(now) if now.is_terminal() => Some(Target::Terminal),
        Some(OperationState::Approved) => Some(Target::Approved),
        Some(OperationState::Executing) => Some(Target::Executing),
        Some(_) => None,
    }
}

impl Inner {
    /// Counts, under their own names, the work of the replicas of `fleet` other than this one
    /// that have not registered in the epoch this replica just registered in; then moves in the
    /// counts what moved in the store since it was read. Returns how many operations were
    /// counted. Failures are only logged: this replica's own registration stands, each replica
    /// that lives registers its own work anyway, and a survivor takes a dead one's work over.
    pub(super) async fn rebuild_others(
        &self,
        source: &dyn RecoverySource,
        fleet: FleetReading,
        config: &Config,
    ) -> u64 {
        let Some(epoch) = self.epoch() else {
            return 0;
        };
        let me = self.options.replica.as_str();
        let mut by_owner: std::collections::BTreeMap<&str, Owner> = Default::default();
        for (owner, op) in &fleet.live {
            if owner != me
                && let Some(state) = held_state(op.state)
            {
                by_owner.entry(owner).or_default().live.push((op, state));
            }
        }
        for (owner, client, age) in &fleet.admissions {
            if owner != me {
                by_owner
                    .entry(owner)
                    .or_default()
                    .admissions
                    .push((client.clone(), *age));
            }
        }
        if by_owner.is_empty() {
            return 0;
        }
        let mut invocation = self.scripts.rebuild.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(&self.keys.epoch)
            .key(&self.keys.members)
            .key(&self.keys.replicas)
            .arg(&self.keys.base)
            .arg(&epoch)
            .arg(ttl_millis(self.options.lease_ttl));
        for (owner, work) in &by_owner {
            invocation.arg(*owner);
            push_debts(&mut invocation, &rate_debts(config, &work.admissions));
            invocation.arg(work.live.len());
            for (op, state) in &work.live {
                invocation.arg(&op.id).arg(op.identity.as_str()).arg(*state);
            }
        }
        let counted = match self.call(&invocation).await {
            Ok(value) => match reply::parse_rebuilt(&value) {
                Ok(Some(counted)) => counted,
                // Redis forgot again: the next registration starts over.
                Ok(None) => return 0,
                Err(e) => {
                    tracing::warn!(error = %e, "the other replicas' work could not be rebuilt");
                    return 0;
                }
            },
            Err(reason) => {
                tracing::warn!(?reason, "the other replicas' work could not be rebuilt");
                return 0;
            }
        };
        let total = counted.iter().map(|(_, n)| n).sum();
        if counted.is_empty() {
            return 0;
        }
        tracing::info!(
            replicas = %counted.iter().map(|(r, n)| format!("{r}: {n}")).collect::<Vec<_>>().join(", "),
            "counted the work of replicas not registered again, from the store"
        );
        // What was counted for those replicas, read again: a move written in between went to
        // Redis before the operation was held there, and is made now.
        let rebuilt: std::collections::HashSet<&str> =
            counted.iter().map(|(r, _)| r.as_str()).collect();
        let held: Vec<(&str, OperationState)> = by_owner
            .iter()
            .filter(|(owner, _)| rebuilt.contains(*owner))
            .flat_map(|(_, work)| work.live.iter().map(|(op, _)| (op.id.as_str(), op.state)))
            .collect();
        let ids = held.iter().map(|(id, _)| (*id).to_owned()).collect();
        let now: std::collections::HashMap<String, OperationState> = match source.states(ids).await
        {
            Ok(states) => states.into_iter().collect(),
            Err(e) => {
                // Each live owner's registration replaces what was counted for it; a dead one's
                // work is moved by its takeover. Only a move in between stays uncounted.
                tracing::warn!(error = %e, "the rebuilt work's states could not be read again");
                return total;
            }
        };
        for (id, state) in held {
            if let Some(target) = moved(state, now.get(id).copied()) {
                self.release(Kept {
                    id: id.to_owned(),
                    target,
                    key: None,
                })
                .await;
            }
        }
        total
    }
}

/// One other replica's work, as the store has it.
#[derive(Default)]
struct Owner<'a> {
    live: Vec<(&'a crate::admission::RestoredOperation, &'static str)>,
    admissions: Vec<(crate::config::Identity, std::time::Duration)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_in_the_store_is_the_same_move_in_the_counts() {
        use OperationState::*;
        assert_eq!(moved(Pending, Some(Pending)), None);
        assert_eq!(moved(Pending, Some(Approved)), Some(Target::Approved));
        assert_eq!(moved(Approved, Some(Executing)), Some(Target::Executing));
        assert_eq!(moved(Pending, Some(Denied)), Some(Target::Terminal));
        assert_eq!(moved(Executing, Some(Succeeded)), Some(Target::Terminal));
        // A row retired (deleted) meanwhile ended long before.
        assert_eq!(moved(Approved, None), Some(Target::Terminal));
    }
}
