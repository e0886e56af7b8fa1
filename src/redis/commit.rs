//! The group commit: every admission decision and transition a replica sends to Redis goes
//! through one writer task, which sends what is waiting in one call of the batch script
//! (`scripts/batch.lua`), decided there in order, each exactly as it would be alone.
//!
//! Why: on Redis a script call has a large fixed cost (entering Lua, and every `redis.call`), so
//! a replica with several decisions waiting pays it once for all of them, and what they share
//! (the time, the lease, the counts, the operations hash) is read and written once. A batch forms
//! only from what is already waiting — no timer: a lone call goes at once, as it always did;
//! while one batch is in flight the next calls queue and go together as the next ("Nagle without
//! the timer"), with the calls its answers wake (the writer yields once to let them send), at
//! most [`MOST_PER_BATCH`] at a time. One writer per replica keeps the calls in
//! the order they were made, so a release kept after a timed-out admission always follows it.
//!
//! With `wait_replicas`, a batch that takes a slot (an admission, a start) is followed by one
//! `WAIT` on the very connection it was written on (pinned: after a failover in between, the
//! `WAIT` fails rather than count the new primary's replicas), and its admissions and starts are
//! answered only once that many Redis replicas hold them; without the acknowledgement each is
//! answered unavailable (an admission's undo follows it, as after a lost reply; a start stays
//! queued and is tried again), so no failover gives a slot taken away once more.
//!
//! Every caller still waits for Redis's answer to its own decision. A caller that stops waiting
//! (its future dropped, or its wait timed out) does not take its decision back: it is decided
//! anyway, and the caller's own undo (a kept release, see `KeepOnDrop`) follows it to Redis.

use std::sync::Weak;

use tokio::sync::{mpsc, oneshot};

use super::connect::connection::Connection;
use super::decision::{Decision, InForce, Job, MOST_PER_BATCH, Target};
use super::replica::Inner;
use super::reply;
use super::reply::{AdmitReply, Decided, TransitionReply};
use super::units::ttl_millis;
use crate::admission::outcome::UnavailableReason;

/// The writer: takes whatever is waiting (at least one, at most [`MOST_PER_BATCH`]), sends it as
/// one call, answers each caller, and again, until the replica is gone. It holds the replica
/// only while a batch is in flight.
pub(crate) async fn write(inner: Weak<Inner>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut batch = Vec::with_capacity(MOST_PER_BATCH);
    while jobs.recv_many(&mut batch, MOST_PER_BATCH).await > 0 {
        let Some(inner) = inner.upgrade() else { return };
        let decisions = batch.iter().filter_map(|job| match job {
            Job::Decide { decision, .. } => Some(decision),
            Job::Settle(_) => None,
        });
        let mut answers = if decisions.clone().next().is_some() {
            inner.commit(decisions).await.into_iter()
        } else {
            Vec::new().into_iter()
        };
        for job in batch.drain(..) {
            match job {
                Job::Decide { answer, .. } => {
                    let decided = answers.next().unwrap_or(Err(UnavailableReason::Reply(
                        "the batch answered fewer decisions than it was sent".into(),
                    )));
                    // A caller that stopped waiting has its own undo under way.
                    let _ = answer.send(decided);
                }
                Job::Settle(settled) => {
                    let _ = settled.send(());
                }
            }
        }
        // The callers just answered are woken, and most send their next decision at once (a
        // release after an admission, the next admission after a release). Let them run before
        // taking what is waiting, so those go in one batch rather than the first one or two
        // alone (tokio runs a task woken by this one next, and the first caller's send would
        // wake this writer ahead of the rest). No timer: with nothing woken, this costs one
        // trip through the scheduler.
        tokio::task::yield_now().await;
    }
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
    /// Whether they all were: `false` when the wait ran out (a slow Redis with a backlog), so
    /// some may still reach Redis after whatever is sent next.
    pub(crate) async fn settled(&self) -> bool {
        let (settled, done) = oneshot::channel();
        if self.queue.send(Job::Settle(settled)).is_err() {
            return false;
        }
        matches!(
            tokio::time::timeout(self.options.call_timeout * 2, done).await,
            Ok(Ok(()))
        )
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
        let mut in_force = InForce::default();
        // Which decisions take a slot (an admission, a start): with `wait_replicas`, each is
        // answered only once a Redis replica holds it, so no failover gives its slot away again.
        let mut takes = Vec::with_capacity(MOST_PER_BATCH);
        for decision in decisions {
            decision.write(&mut invocation, &mut in_force);
            takes.push(matches!(
                decision,
                Decision::Admit { .. }
                    | Decision::Move {
                        target: Target::Executing,
                        ..
                    }
            ));
            asked.push(decision.asked());
        }
        let waits = takes.contains(&true) && self.options.wait_replicas > 0;
        let mut conn = if waits {
            match self.pinned().await {
                Ok(conn) => conn,
                Err(reason) => return vec![Err(reason); asked.len()],
            }
        } else {
            self.conn.clone()
        };
        // A write acknowledged while a failover began (or the primary changed) may be lost
        // with the old primary: not taken for acknowledged.
        let turns = conn.turns();
        let value = match self.call_on(&mut conn, &invocation).await {
            Ok(value) => value,
            Err(reason) => return vec![Err(reason); asked.len()],
        };
        let mut answers: Vec<Result<Decided, UnavailableReason>> =
            match reply::parse_batch(&value, &asked) {
                Ok(answers) => answers
                    .into_iter()
                    .map(|a| a.map_err(|e| UnavailableReason::Reply(e.to_string())))
                    .collect(),
                Err(e) => vec![Err(UnavailableReason::Reply(e.to_string())); asked.len()],
            };
        // A slot taken: an admission admitted, or a start made (moved, or found made by an
        // earlier try whose answer was unavailable: acknowledged now, or unavailable again).
        let took = |a: &Result<Decided, UnavailableReason>| {
            matches!(
                a,
                Ok(Decided::Admit(AdmitReply::Admitted(_)))
                    | Ok(Decided::Transition(
                        TransitionReply::Moved(_) | TransitionReply::Same
                    ))
            )
        };
        if waits
            && answers.iter().zip(&takes).any(|(a, t)| *t && took(a))
            && let Err(reason) = self.acknowledged(&mut conn, turns).await
        {
            for (answer, _) in answers
                .iter_mut()
                .zip(&takes)
                .filter(|(a, t)| **t && took(a))
            {
                *answer = Err(reason.clone());
            }
        }
        answers
    }

    /// Waits (`WAIT`, on `conn`, the pinned connection the batch was written on) until
    /// [`crate::admission::ReplicaOptions::wait_replicas`] Redis replicas hold every write made
    /// on it so far, for half the call timeout at most; and then, that no failover began since
    /// the batch was sent (`turns`, see [`Connection::turns`]): a primary failed over alive has
    /// its writes acknowledged by replicas that then drop them.
    async fn acknowledged(
        &self,
        conn: &mut Connection,
        turns: u64,
    ) -> Result<(), UnavailableReason> {
        let wanted = self.options.wait_replicas;
        // Redis answers WAIT after half the call timeout at most, well within the connection's
        // own reply timeout (the call timeout).
        let millis = ttl_millis(self.options.call_timeout / 2);
        let acked = tokio::time::timeout(
            self.options.call_timeout,
            redis::cmd("WAIT")
                .arg(wanted)
                .arg(millis)
                .query_async::<u64>(conn),
        )
        .await;
        match acked {
            Ok(Ok(_)) if conn.turns() != turns => Err(UnavailableReason::Redis(
                "a failover began while the admission was acknowledged".to_owned(),
            )),
            Ok(Ok(n)) if n >= u64::from(wanted) => Ok(()),
            Ok(Ok(n)) => Err(UnavailableReason::Redis(format!(
                "{n} of {wanted} redis replicas acknowledged the admission in time"
            ))),
            Ok(Err(e)) => Err(UnavailableReason::Redis(e.to_string())),
            Err(_) => Err(UnavailableReason::Timeout),
        }
    }
}
