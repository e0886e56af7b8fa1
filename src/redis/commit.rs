//! The group commit: every admission decision and transition a replica sends to Redis goes
//! through one writer task, which sends what is waiting in one call of the batch script
//! (`scripts/batch.lua`), decided there in order, each exactly as it would be alone.
//!
//! Why: on Redis a script call has a large fixed cost (entering Lua, and every `redis.call`), so
//! a replica with several decisions waiting pays it once for all of them, and what they share
//! (the time, the lease, the counts, the operations hash) is read and written once. A batch forms
//! only from what is already waiting — no timer: a lone call goes at once, as it always did;
//! while batches are in flight the next calls queue and go together as the next ("Nagle without
//! the timer"), at most [`MOST_PER_BATCH`] at a time, at most [`MOST_IN_FLIGHT`] batches at
//! once (the second fills the first's round trip). The writer keeps each operation's decisions
//! in the order they were made — never two of its batches in flight at once — so a release kept
//! after a timed-out admission always follows it.
//!
//! Every caller still waits for Redis's answer to its own decision. A caller that stops waiting
//! (its future dropped, or its wait timed out) does not take its decision back: it is decided
//! anyway, and the caller's own undo (a kept release, see `KeepOnDrop`) follows it to Redis.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Weak;

use redis::ScriptInvocation;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::reply::{self, Asked, Decided};
use super::{Inner, Target, UnavailableReason};

/// The most decisions one script call carries.
pub(crate) const MOST_PER_BATCH: usize = 64;

/// The most batches a replica has in flight at once: a second fills the round trip of the
/// first (Redis decides one while the replica reads the other's answer).
pub(crate) const MOST_IN_FLIGHT: usize = 2;

/// One decision for the batch script, with every argument it is decided on.
pub(crate) enum Decision {
    /// An admission (the fields of `scripts/batch.lua`'s `A` record, in order).
    Admit {
        id: String,
        client: String,
        needs_approval: bool,
        rate: (u64, u64),
        client_active: u32,
        client_pending: u32,
        grant_client: u64,
        grant_global: u64,
        global_active: u32,
        global_executing: u32,
        /// The idempotency record's key, if the submission has one.
        key: Option<String>,
        key_ttl_millis: u64,
    },
    /// A transition by operation id (the `T` record).
    Move {
        id: String,
        target: Target,
        global_executing: u32,
        /// The idempotency record to free if it still names this operation.
        key: Option<String>,
    },
}

impl Decision {
    /// The operation decided.
    fn id(&self) -> &str {
        match self {
            Decision::Admit { id, .. } | Decision::Move { id, .. } => id,
        }
    }

    fn asked(&self) -> Asked {
        match self {
            Decision::Admit { .. } => Asked::Admit,
            Decision::Move { .. } => Asked::Transition,
        }
    }

    fn write(&self, invocation: &mut ScriptInvocation<'_>) {
        match self {
            Decision::Admit {
                id,
                client,
                needs_approval,
                rate: (interval, span),
                client_active,
                client_pending,
                grant_client,
                grant_global,
                global_active,
                global_executing,
                key,
                key_ttl_millis,
            } => {
                invocation
                    .arg("A")
                    .arg(id)
                    .arg(client)
                    .arg(u8::from(*needs_approval))
                    .arg(interval)
                    .arg(span)
                    .arg(client_active)
                    .arg(client_pending)
                    .arg(grant_client)
                    .arg(grant_global)
                    .arg(global_active)
                    .arg(global_executing)
                    .arg(key.as_deref().unwrap_or(""))
                    .arg(key_ttl_millis);
            }
            Decision::Move {
                id,
                target,
                global_executing,
                key,
            } => {
                let (interval, span) = match target {
                    Target::Refund(interval, span) => (*interval, *span),
                    _ => (0, 0),
                };
                invocation
                    .arg("T")
                    .arg(id)
                    .arg(target.arg())
                    .arg(global_executing)
                    .arg(interval)
                    .arg(span)
                    .arg(key.as_deref().unwrap_or(""));
            }
        }
    }
}

/// Where a decision's answer goes.
pub(crate) type Answer = oneshot::Sender<Result<Decided, UnavailableReason>>;

/// What waits for the writer.
pub(crate) enum Job {
    /// A decision, and where its answer goes.
    Decide { decision: Decision, answer: Answer },
    /// Told once every decision queued before it has been decided (or has failed).
    Settle(oneshot::Sender<()>),
}

/// The writer's end of a replica's queue: what the replica's calls send their decisions to.
pub(crate) type Queue = mpsc::UnboundedSender<Job>;

/// A new queue and the end the writer reads.
pub(crate) fn queue() -> (Queue, mpsc::UnboundedReceiver<Job>) {
    mpsc::unbounded_channel()
}

/// The writer: forms batches from whatever is waiting (at least one decision, at most
/// [`MOST_PER_BATCH`]), keeps up to [`MOST_IN_FLIGHT`] of them in flight at once, and again,
/// until the replica is gone. Each batch runs on a task of its own, which answers its callers.
///
/// Order: two batches in flight at once may be decided by Redis in either order (a `NOSCRIPT`
/// retry resends one after the other), so no operation has decisions in two of them at once —
/// a decision for an operation already in flight waits, and everything queued after it waits
/// behind it, until that batch is answered; a [`Job::Settle`] is answered only once every
/// batch before it is. What an operation's decisions see is therefore always their order here.
/// The writer holds the replica only while a batch is in flight.
pub(crate) async fn write(inner: Weak<Inner>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut flying: JoinSet<()> = JoinSet::new();
    // The operations each batch in flight decides, by its task; and all of them.
    let mut carried: HashMap<tokio::task::Id, Vec<String>> = HashMap::new();
    let mut busy: HashSet<String> = HashSet::new();
    let mut received = Vec::with_capacity(MOST_PER_BATCH);
    let mut open = true;
    loop {
        while flying.len() < MOST_IN_FLIGHT {
            let batch = take(&mut waiting, &busy, flying.is_empty());
            if batch.is_empty() {
                break;
            }
            let Some(inner) = inner.upgrade() else { return };
            let ids: Vec<String> = batch.iter().map(|(d, _)| d.id().to_owned()).collect();
            busy.extend(ids.iter().cloned());
            let task = flying.spawn(async move { inner.send(batch).await });
            carried.insert(task.id(), ids);
        }
        // Read the queue only with room to send and nothing held back (a held-back job waits
        // for a batch to land, and everything after it waits behind it).
        let reading = open && waiting.is_empty() && flying.len() < MOST_IN_FLIGHT;
        tokio::select! {
            landed = flying.join_next_with_id(), if !flying.is_empty() => {
                let task = match landed {
                    Some(Ok((task, ()))) => task,
                    Some(Err(e)) => e.id(),
                    None => continue,
                };
                for id in carried.remove(&task).unwrap_or_default() {
                    busy.remove(&id);
                }
            }
            n = jobs.recv_many(&mut received, MOST_PER_BATCH), if reading => {
                if n == 0 {
                    open = false;
                }
                waiting.extend(received.drain(..));
            }
            else => {
                // Closed, nothing waiting to be sent, nothing in flight.
                if waiting.is_empty() {
                    return;
                }
            }
        }
    }
}

/// The next batch from the front of `waiting`, in order: up to [`MOST_PER_BATCH`] decisions,
/// stopping before a decision for an operation in flight (`busy`) and before a settle that has
/// batches ahead of it (`idle`: none in flight). A settle with nothing ahead of it is answered
/// here.
fn take(
    waiting: &mut VecDeque<Job>,
    busy: &HashSet<String>,
    idle: bool,
) -> Vec<(Decision, Answer)> {
    let mut batch = Vec::new();
    while batch.len() < MOST_PER_BATCH {
        match waiting.front() {
            Some(Job::Settle(_)) if idle && batch.is_empty() => {
                if let Some(Job::Settle(settled)) = waiting.pop_front() {
                    let _ = settled.send(());
                }
            }
            Some(Job::Decide { decision, .. }) if !busy.contains(decision.id()) => {
                if let Some(Job::Decide { decision, answer }) = waiting.pop_front() {
                    batch.push((decision, answer));
                }
            }
            _ => break,
        }
    }
    batch
}

impl Inner {
    /// Sends `decision` to Redis in the replica's next batch and waits for its answer (at most
    /// twice the call timeout: the batch in flight, then its own).
    pub(crate) async fn decide(&self, decision: Decision) -> Result<Decided, UnavailableReason> {
        let (answer, answered) = oneshot::channel();
        if self.queue.send(Job::Decide { decision, answer }).is_err() {
            return Err(UnavailableReason::Redis(
                "the replica's writer has stopped".into(),
            ));
        }
        match tokio::time::timeout(self.options.call_timeout * 2, answered).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(UnavailableReason::Redis(
                "the replica's writer dropped the decision".into(),
            )),
            Err(_) => Err(UnavailableReason::Timeout),
        }
    }

    /// Waits (at most twice the call timeout) until every decision queued so far has been
    /// decided: registration does, so that a decision whose caller hung up (its undo kept, then
    /// made moot by the registration) never reaches Redis after the registration's replace.
    pub(crate) async fn settled(&self) {
        let (settled, done) = oneshot::channel();
        if self.queue.send(Job::Settle(settled)).is_ok() {
            let _ = tokio::time::timeout(self.options.call_timeout * 2, done).await;
        }
    }

    /// Sends one batch and answers each of its callers.
    async fn send(&self, batch: Vec<(Decision, Answer)>) {
        let mut answers = self.commit(batch.iter().map(|(d, _)| d)).await.into_iter();
        for (_, answer) in batch {
            let decided = answers.next().unwrap_or(Err(UnavailableReason::Reply(
                "the batch answered fewer decisions than it was sent".into(),
            )));
            // A caller that stopped waiting has its own undo under way.
            let _ = answer.send(decided);
        }
    }

    /// One call of the batch script for `decisions`, in order: an answer for each.
    async fn commit<'a>(
        &self,
        decisions: impl Iterator<Item = &'a Decision>,
    ) -> Vec<Result<Decided, UnavailableReason>> {
        let replica = &self.options.replica;
        let mut invocation = self.scripts.batch.prepare_invoke();
        invocation
            .key(&self.keys.counts)
            .key(&self.keys.ops)
            .key(self.keys.lease(replica))
            .key(&self.keys.epoch)
            .key(&self.keys.recovery)
            .arg(&self.keys.base)
            .arg(replica)
            .arg(&self.token)
            .arg(self.epoch().unwrap_or_default());
        let mut asked = Vec::with_capacity(MOST_PER_BATCH);
        for decision in decisions {
            decision.write(&mut invocation);
            asked.push(decision.asked());
        }
        let value = match self.call(&invocation).await {
            Ok(value) => value,
            Err(reason) => return vec![Err(reason); asked.len()],
        };
        match reply::parse_batch(&value, &asked) {
            Ok(answers) => answers
                .into_iter()
                .map(|a| a.map_err(|e| UnavailableReason::Reply(e.to_string())))
                .collect(),
            Err(e) => vec![Err(UnavailableReason::Reply(e.to_string())); asked.len()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(id: &str) -> (Job, oneshot::Receiver<Result<Decided, UnavailableReason>>) {
        let (answer, answered) = oneshot::channel();
        let decision = Decision::Move {
            id: id.to_owned(),
            target: Target::Terminal,
            global_executing: 1,
            key: None,
        };
        (Job::Decide { decision, answer }, answered)
    }

    fn ids(batch: &[(Decision, Answer)]) -> Vec<&str> {
        batch.iter().map(|(d, _)| d.id()).collect()
    }

    fn front(waiting: &VecDeque<Job>) -> Option<&str> {
        match waiting.front()? {
            Job::Decide { decision, .. } => Some(decision.id()),
            Job::Settle(_) => Some("settle"),
        }
    }

    #[test]
    fn an_operation_in_flight_holds_back_its_decision_and_everything_after_it() {
        let mut waiting: VecDeque<Job> = ["a", "b", "c"].map(|id| release(id).0).into();
        let busy: HashSet<String> = ["b".to_owned()].into();
        let batch = take(&mut waiting, &busy, false);
        assert_eq!(ids(&batch), ["a"]);
        // `c` is free, but it was queued after `b`: it waits behind it.
        assert_eq!(waiting.len(), 2);
        assert_eq!(front(&waiting), Some("b"));
        assert!(take(&mut waiting, &busy, false).is_empty());
        // Once `b`'s batch lands, both go, in order.
        let batch = take(&mut waiting, &HashSet::new(), true);
        assert_eq!(ids(&batch), ["b", "c"]);
        assert!(waiting.is_empty());
    }

    #[test]
    fn one_batch_may_carry_an_operation_twice_in_order() {
        let mut waiting: VecDeque<Job> = ["a", "a"].map(|id| release(id).0).into();
        let batch = take(&mut waiting, &HashSet::new(), true);
        assert_eq!(ids(&batch), ["a", "a"]);
    }

    #[test]
    fn a_settle_is_answered_only_once_nothing_is_ahead_of_it() {
        let (settled, mut done) = oneshot::channel();
        let mut waiting: VecDeque<Job> = VecDeque::new();
        waiting.push_back(release("a").0);
        waiting.push_back(Job::Settle(settled));
        waiting.push_back(release("b").0);
        // `a` goes; the settle stops the batch, and `b` waits behind it.
        let batch = take(&mut waiting, &HashSet::new(), true);
        assert_eq!(ids(&batch), ["a"]);
        assert_eq!(front(&waiting), Some("settle"));
        // `a`'s batch in flight: the settle still waits.
        assert!(take(&mut waiting, &HashSet::new(), false).is_empty());
        assert!(done.try_recv().is_err());
        // Landed: the settle is answered, then `b` goes.
        let batch = take(&mut waiting, &HashSet::new(), true);
        assert!(done.try_recv().is_ok());
        assert_eq!(ids(&batch), ["b"]);
    }

    #[test]
    fn a_batch_carries_at_most_its_share() {
        let mut waiting: VecDeque<Job> = (0..MOST_PER_BATCH + 3)
            .map(|n| release(&format!("op-{n}")).0)
            .collect();
        assert_eq!(
            take(&mut waiting, &HashSet::new(), true).len(),
            MOST_PER_BATCH
        );
        assert_eq!(take(&mut waiting, &HashSet::new(), false).len(), 3);
    }
}
