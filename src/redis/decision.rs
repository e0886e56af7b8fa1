//! What a replica asks Redis to decide, as the batch script (`scripts/batch.lua`) reads it: an
//! admission with the limits it is decided on, or a move of an operation by id to a [`Target`];
//! a release kept until Redis answers ([`Kept`]); and the queue the decisions wait in for the
//! group commit's writer (`commit`).

use redis::ScriptInvocation;
use tokio::sync::{mpsc, oneshot};

use super::reply::{Asked, Decided};
use crate::admission::outcome::UnavailableReason;
use crate::config::FairShare;

/// The most decisions one script call carries.
pub(crate) const MOST_PER_BATCH: usize = 64;

/// What an admission is decided on (the fields of `scripts/batch.lua`'s `L` record, in order):
/// sent once for every run of admissions in a batch that share it, not once per admission.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct AdmitLimits {
    /// The emission interval and burst span (µs).
    pub(crate) rate: (u64, u64),
    pub(crate) client_active: u32,
    pub(crate) client_pending: u32,
    pub(crate) grant_client: u64,
    pub(crate) grant_global: u64,
    pub(crate) global_active: u32,
    pub(crate) global_executing: u32,
    /// How long past its rate wait the replica may remember a refusal (ms; 0 when it remembers
    /// none): how long the script keeps the refusal marker that makes every later release
    /// publish its notice.
    pub(crate) remembered_millis: u64,
    /// The pools' fair share (sent as an `F` record when it is not the one in force in the
    /// call: see [`write_fair_share`]).
    pub(crate) fair_share: Option<FairShare>,
}

impl AdmitLimits {
    pub(super) fn write(&self, invocation: &mut ScriptInvocation<'_>) {
        let (interval, span) = self.rate;
        invocation
            .arg("L")
            .arg(interval)
            .arg(span)
            .arg(self.client_active)
            .arg(self.client_pending)
            .arg(self.grant_client)
            .arg(self.grant_global)
            .arg(self.global_active)
            .arg(self.global_executing)
            .arg(self.remembered_millis);
    }
}

/// Writes the `F` record of `fair_share` (both pools' reserve and floor; floors of 0 for none)
/// if it is not the one in force in this call (`last`, which starts as none, as the script's
/// does; `last` is then updated). The admissions and starts after it are decided on it.
fn write_fair_share(
    invocation: &mut ScriptInvocation<'_>,
    fair_share: Option<FairShare>,
    last: &mut Option<FairShare>,
) {
    if *last == fair_share {
        return;
    }
    let [active, executing] = fair_share.map_or([(0, 0); 2], |share| {
        [share.active, share.executing].map(|pool| (pool.reserve, pool.floor))
    });
    invocation
        .arg("F")
        .arg(active.0)
        .arg(active.1)
        .arg(executing.0)
        .arg(executing.1);
    *last = fair_share;
}

/// What the records of one call have put in force so far: the limits of the last `L` record
/// and the fair share of the last `F` record (none before the first).
#[derive(Default)]
pub(super) struct InForce {
    limits: Option<AdmitLimits>,
    fair_share: Option<FairShare>,
}

/// One decision for the batch script, with every argument it is decided on.
pub(crate) enum Decision {
    /// An admission (the fields of `scripts/batch.lua`'s `A` record, in order, after the `L`
    /// record of its limits).
    Admit {
        id: String,
        client: String,
        needs_approval: bool,
        limits: AdmitLimits,
        /// The idempotency record's key, if the submission has one.
        key: Option<String>,
        key_ttl_millis: u64,
    },
    /// A transition by operation id (the `T` record).
    Move {
        id: String,
        target: Target,
        global_executing: u32,
        /// The pools' fair share a start is decided on (sent as for an admission).
        fair_share: Option<FairShare>,
        /// The idempotency record to free if it still names this operation.
        key: Option<String>,
    },
}

impl Decision {
    pub(super) fn asked(&self) -> Asked {
        match self {
            Decision::Admit { .. } => Asked::Admit,
            Decision::Move { .. } => Asked::Transition,
        }
    }

    /// Writes the decision's record, preceded by an `L` record when its limits are not the
    /// last ones written in this call, and by an `F` record when it is decided on a fair share
    /// other than the one in force (`in_force` is then updated).
    pub(super) fn write(&self, invocation: &mut ScriptInvocation<'_>, in_force: &mut InForce) {
        match self {
            Decision::Admit {
                id,
                client,
                needs_approval,
                limits,
                key,
                key_ttl_millis,
            } => {
                if in_force.limits.as_ref() != Some(limits) {
                    limits.write(invocation);
                    in_force.limits = Some(*limits);
                }
                write_fair_share(invocation, limits.fair_share, &mut in_force.fair_share);
                invocation
                    .arg("A")
                    .arg(id)
                    .arg(client)
                    .arg(u8::from(*needs_approval))
                    .arg(key.as_deref().unwrap_or(""))
                    .arg(key_ttl_millis);
            }
            Decision::Move {
                id,
                target,
                global_executing,
                fair_share,
                key,
            } => {
                if let Target::Executing = target {
                    write_fair_share(invocation, *fair_share, &mut in_force.fair_share);
                }
                invocation
                    .arg("T")
                    .arg(id)
                    .arg(target.arg())
                    .arg(key.as_deref().unwrap_or(""));
                match target {
                    Target::Executing => {
                        invocation.arg(global_executing);
                    }
                    Target::Refund(interval, span) => {
                        invocation.arg(interval).arg(span);
                    }
                    Target::Approved | Target::Terminal => {}
                }
            }
        }
    }
}

/// What a transition asks the script for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Approved,
    Executing,
    Terminal,
    /// Terminal, and the rate token given back: the emission interval and the burst span (µs) it
    /// was taken under (the script measures it in the bucket's rate now, if a reload changed it).
    Refund(u64, u64),
}

impl Target {
    pub(super) fn arg(self) -> &'static str {
        match self {
            Target::Approved => "a",
            Target::Executing => "e",
            Target::Terminal => "t",
            Target::Refund(..) => "r",
        }
    }
}

/// A release kept until Redis answers: the operation and the transition's target.
#[derive(Clone, Debug)]
pub(crate) struct Kept {
    pub(crate) id: String,
    pub(crate) target: Target,
    /// The idempotency record to delete if it still names this operation: set for a release of
    /// an admission never committed (refunded, dropped, or whose answer was lost), so the key is
    /// free for the client's retry on every replica.
    pub(crate) key: Option<String>,
}

/// What waits for the writer.
pub(crate) enum Job {
    /// A decision, and where its answer goes.
    Decide {
        decision: Decision,
        answer: oneshot::Sender<Result<Decided, UnavailableReason>>,
    },
    /// Told once every decision queued before it has been decided (or has failed).
    Settle(oneshot::Sender<()>),
}

/// The writer's end of a replica's queue: what the replica's calls send their decisions to.
pub(crate) type Queue = mpsc::UnboundedSender<Job>;

/// A new queue and the end the writer reads.
pub(crate) fn queue() -> (Queue, mpsc::UnboundedReceiver<Job>) {
    mpsc::unbounded_channel()
}
