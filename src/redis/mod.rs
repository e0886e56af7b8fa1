//! Admission shared by broker replicas, on Redis (cargo feature `redis`).
//!
//! The shared half of a replicated [`crate::Admission`]: embedders reach it only through that
//! one API ([`crate::Admission::new`] with [`ReplicaOptions`]), which decides here first and then
//! in the replica's own [`crate::Controller`]. The types of this module stay inside the crate;
//! what it offers an embedder is the options and the outcome types under their older names
//! ([`RedisOptions`], [`SharedCounts`], [`RedisStats`], [`RedisStartError`]), and, hidden, the
//! script replies' parser (for the fuzz target) and the benchmark's rate-only baseline script.
//!
//! It keeps the in-process engine's decision contract: the same checks in the same order, the
//! same refusal codes and Retry-After rules, the same permit and lifecycle semantics. What
//! differs is where the counts live: in one Redis, shared by every replica, so a client's limits
//! and the global limits hold across all of them.
//!
//! - **One script per decision.** Each admission is decided by one atomic Lua script
//!   (`scripts/batch.lua`, run by `EVALSHA`, loaded again on `NOSCRIPT`) on Redis server time,
//!   so replicas' clocks never matter: GCRA, client and global counts, the pending-grant caps,
//!   all or nothing. The scripts are files beside this one, built in with `include_str!`.
//! - **A group commit per replica** (`commit`). Admissions and transitions go to Redis through
//!   one writer task per replica; what is waiting when it sends goes in the same script call,
//!   decided there in order, each exactly as alone. A lone call goes at once; each caller still
//!   waits for Redis to have decided its own.
//! - **Reloads rescale the buckets.** A client's bucket (its field of the hash `{prefix}:buckets`)
//!   holds its TAT with the rate (emission interval, burst span) it was written under; a decision
//!   under a different rate (a reload, on whichever replica) first rescales the used part of the
//!   span to the new span, rounded up, as the in-process engine's `Bucket::rescale` does, so a
//!   reload never hands out a fresh burst nor confiscates one. A refunded token is measured in the
//!   bucket's rate at refund time.
//! - **One hash tag.** Every key of a deployment starts with `{prefix}`, so all of them live in one
//!   Redis Cluster slot, and two deployments can share a Redis under two prefixes.
//! - **Exactly once, by operation id.** A reservation is recorded under its operation's id; every
//!   transition and release names the id, so a retry after a lost reply or a timeout never counts
//!   or frees twice.
//! - **Leases.** Each replica holds a lease (a key with a TTL) renewed by a heartbeat task; a
//!   replica that cannot renew stops admitting; the survivors release a lapsed replica's holdings
//!   exactly once (`scripts/reap.lua`); a replica that (re)registers replaces its holdings with
//!   what it holds now in one step (`scripts/replace.lua`).
//! - **Redis down at start-up.** The controller (`RedisController::connect_lazy`, behind
//!   [`crate::Admission::new`]) makes the connection on the first call (and again after each
//!   failure); registration (`RedisController::register_or_defer`, behind
//!   [`crate::Admission::restore`]) holds the restored work here and lets the heartbeat register
//!   it once Redis answers. Until then every
//!   admission is [`Unavailable`] (no lease), and nothing is admitted unchecked.
//! - **Redis down or slow.** Every call has a timeout; an admission that cannot be decided is
//!   [`Unavailable`] (503 `admission_unavailable`), never admitted unchecked; a circuit stops
//!   calling a dead Redis for a while; releases that cannot be sent are kept and retried, in
//!   order, until Redis answers.
//! - **One operation per key.** An admission records (client, idempotency key) → (operation
//!   id, replica) with the reservation, so the same key sent to two replicas admits once; the
//!   second is told which operation and replica hold it. The record lives as long as its
//!   operation: freed by a refund, a drop or an unanswered admission (the release names it), and
//!   by [`crate::Admission::retire_keys`] when the store retires the operation.
//! - **Redis forgets.** The deployment has an epoch (`{prefix}:epoch`), written by the first
//!   registration on a Redis that holds none; every admission and heartbeat checks it. A replica
//!   that finds it gone or changed registers again (`register_again`): its key records go back
//!   first (`scripts/restore_keys.lua`, from the embedder's [`RecoverySource`]), then, in the one
//!   atomic replace, its holdings and its clients' rate debts. The replace checks that the key
//!   records are still there (the restore's marker, `{prefix}:keyed:<replica>`): a Redis that
//!   forgot again meanwhile gets them restored again before anything is registered. A new epoch
//!   opens a recovery window (`{prefix}:recovery`, one lease long) in which no replica admits or
//!   starts work. It closes early only once a replica that knows the whole deployment (its
//!   [`ReplicaOptions::replicas`] list) has registered and every replica named has registered
//!   again; otherwise it lasts its whole lease period (`scripts/replace.lua`). A store the whole
//!   fleet shares ([`RecoverySource::fleet`]) names the fleet (its live members) as such a list
//!   does, and what each replica owns: the first replica to register again counts the work and
//!   rate debts of every replica not yet registered in the new epoch under that one's name
//!   (`rebuild`, `scripts/rebuild.lua`), so a replica that died just before is counted at once;
//!   a live one replaces it with its own registration.
//!
//! - **Failovers followed.** The URL names one server, the primary a set of Sentinels watch
//!   (`redis+sentinel://`), or a Redis Cluster (`redis+cluster://`); `connect` alone knows
//!   which. A replica follows a failover as a reconnection: after a connection error, a
//!   `READONLY` or the Sentinels' `+switch-master` it finds the primary again and goes on with
//!   it (scripts loaded again on `NOSCRIPT`); in a cluster the client follows `MOVED` and
//!   `ASK`. A change of primary also registers this replica again (what the old primary did
//!   not pass on is counted as held here), and moves the notices' subscription to the new one.
//!   A promoted primary without the deployment's state is Redis forgetting, below.
//! - **Refusals from memory.** A refusal Redis gave is remembered (`memory`) and answers the
//!   client's next submissions here, without a call, until it can have changed: its next token,
//!   its hint, or a release or refund heard on the deployment's notices channel (`notices`: the
//!   scripts `PUBLISH` whenever they lower a count; one subscriber connection per replica). The
//!   memory only ever refuses, and never for a key bound elsewhere: a submission with an
//!   idempotency key reads the key's binding first (one `GET`), so a retry is answered as a
//!   replay before any limit, as the script would. A lost subscription forgets it all.
//! - **Bounded calls.** Admission decisions in flight to Redis are bounded per replica and per
//!   client (semaphores, waited for briefly, then [`UnavailableReason::Busy`]); releases,
//!   transitions and heartbeats never wait for them. With `wait_replicas`, an admission is
//!   answered only once `WAIT` says a Redis replica holds it.
//!
//! What stays per replica: storage quotas (streams, sealed payloads) and the durable store.
//!
//! The files, one concern each:
//!
//! - `replica`: one replica's state (`Inner`) and its handle (`RedisController`), and the one
//!   way it calls Redis (a script, with the call timeout, through the circuit, `circuit`);
//!   `connect` sets one up, and is the one room that knows how Redis is reached (one server,
//!   Sentinels, a Cluster);
//! - `keys` and `scripts`: the deployment's key names, and the Lua scripts (files in
//!   `scripts/`) built in;
//! - `admit`: the decision; `quota`: the quota every answer carries; `decision` is what a
//!   replica asks Redis to decide, `commit` the group commit's writer that sends it, `reply` the
//!   parser of what the scripts answer;
//! - `releases`: transitions by id, and the releases kept until Redis answers; `handles`: the
//!   permit and operation handles; `held`: what this replica holds;
//! - `lease`: the fleet's lease (the heartbeat, renewal, reaping lapsed replicas);
//!   `registration`: taking it with what this replica holds, at start-up and after a loss;
//!   `recovery`: what Redis gets back from the embedder's store when it forgot (the key records,
//!   and how they are kept true; the clients' rate debts);
//!   `rebuild`: the other replicas' work, counted from a store the whole fleet shares once this
//!   replica has registered after Redis forgot;
//! - `memory` and `notices`: refusals answered from memory, and the notices that end them;
//! - `readings`: the shared counts, this replica's holdings and its statistics, read without
//!   deciding; `units`: Redis's units.
//!
//! Only this file re-exports; the files import each other directly, never through it.

mod admit;
mod circuit;
mod commit;
mod connect;
mod decision;
mod handles;
mod held;
mod keys;
mod lease;
pub(crate) mod memory;
mod notices;
mod quota;
mod readings;
mod rebuild;
mod recovery;
mod registration;
mod releases;
mod replica;
#[doc(hidden)]
pub mod reply;
mod scripts;
mod units;

pub use crate::admission::options::ReplicaOptions;
pub use crate::admission::outcome::{
    AdmitError, BackendStats, DeploymentCounts, NotStarted, Refused, RestoredOperation, SetupError,
    Unavailable, UnavailableReason,
};
pub use crate::admission::recovery::{FleetReading, KeyRecord, RecoverySource, SourceFuture};
pub(crate) use handles::{RedisOperation, RedisPermit};
pub(crate) use replica::RedisController;
#[doc(hidden)]
pub use scripts::{BATCH, RATE_ONLY};

/// The options of a replica (the library-wide name is [`ReplicaOptions`]).
pub type RedisOptions = ReplicaOptions;
/// The shared counts (the library-wide name is [`DeploymentCounts`]).
pub type SharedCounts = DeploymentCounts;
/// What the backend has seen (the library-wide name is [`BackendStats`]).
pub type RedisStats = BackendStats;
/// Why a start did not happen (the library-wide name is [`NotStarted`]).
pub type RedisStartError = NotStarted;
