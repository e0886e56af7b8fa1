#![forbid(unsafe_code)]
#![deny(missing_docs)]
//! Admission control for agent brokers.
//!
//! A broker executes operations that coding agents ask for, some only after a human operator
//! approves them. One looping agent must not be able to flood the operator's approval inbox or
//! exhaust the broker's durable store, while cancellation, operator decisions and health checks keep
//! working during exactly that overload. This crate is the admission controller such a broker
//! embeds.
//!
//! # Where things are
//!
//! - [`config`]: the quota file — wire format, strict validation, loading from a path, bytes or an
//!   environment variable. A [`Config`] can only exist validated.
//! - [`engine`]: where admission is decided. [`Controller::admit`] checks a client's rate token
//!   bucket (GCRA on one atomic word), its active and pending counts, the pending-grant store, and
//!   the global active and executing counts (with each pool's fair share, when the quota file
//!   sets one) — each a compare-and-swap reservation, rolled back whole at the first refusal. A [`Permit`] becomes an [`Operation`] whose terminal transition
//!   releases its slots exactly once. Storage quotas use the same primitive.
//! - [`admission`]: the one API a broker uses, for one process or many: [`Admission`] wraps the
//!   engine in-process, or composes it with the counts every replica shares in Redis (cargo
//!   feature `redis`), behind the same calls.
//! - [`clock`]: where time comes from (`quanta` in production, [`ManualClock`] in tests), clamped
//!   so time as the engine sees it never goes back.
//! - [`metrics`]: the Prometheus exposition of the engine's lock-free [`Snapshot`] of every count.
//! - `redis` (cargo feature `redis`, on by default): the shared backend replicas decide on, one
//!   atomic script per decision; reached only through [`Admission`].
//!
//! The reference broker behind `admission serve` (an HTTP server on a SQLite or PostgreSQL
//! store, and the `admission` command) is a crate of its own, `unyolo-admission-broker`, written
//! on [`Admission`] through this crate's public API only: the library ends where it begins, and
//! none of its dependencies (a web server, database drivers, a CLI parser) come with this one.
//!
//! # The broker-side sequence
//!
//! Authenticate, validate and replay come first and touch no quota; then admit, create the durable
//! operation under the id the admission made, and commit the permit into a lifecycle handle. The
//! same lines serve one process and many replicas; see [Going to replicas](#going-to-replicas)
//! for the four things a replica adds.
//!
//! ```
//! # async fn example() {
//! use std::collections::HashMap;
//! use unyolo_admission::{Admission, AdmitError, Config, Controller, Identity, OperationState};
//!
//! // Start-up: the identities come from the broker's secrets, the limits from the quota file
//! // (here the defaults). For replicas, the second argument is
//! // `Some(ReplicaOptions::new("redis://127.0.0.1:6379", "replica-1"))`, and a recovery
//! // source is set before `restore` (see "Going to replicas" below).
//! let bot = Identity::new("bot-7").unwrap();
//! let controller = Controller::new(Config::defaults([bot.clone()]));
//! let admission = Admission::new(controller, None).expect("in-process needs no options");
//! let mut store: HashMap<String, OperationState> = HashMap::new();
//!
//! // 0. Restore what the store holds (here nothing), once, before serving. A replica takes its
//! //    lease by registering it, and admits nothing before (`UnavailableReason::NotRestored`).
//! let restored = admission.restore(Vec::new()).await;
//! assert!(restored.operations.is_empty() && restored.deferred.is_none());
//!
//! // 1. Authenticate (the token names `bot-7`), 2. validate, 3. replay: no quota involved.
//! let (client, key, needs_approval) = ("bot-7", "deploy-42", true);
//!
//! // 4. Admit: a permit, or why not (the same codes on both backends).
//! let permit = match admission.admit(client, needs_approval, Some(key)).await {
//!     Ok(permit) => permit,
//!     Err(AdmitError::Refused(refused)) => {
//!         let r = refused.refusal;
//!         panic!("{} {} Retry-After: {:?}", r.http_status(), r.code, r.retry_after_header())
//!     }
//!     Err(AdmitError::Unavailable(u)) => panic!("503, Retry-After: {}", u.retry_after_secs()),
//!     Err(AdmitError::Replay { operation, replica }) => panic!("{operation} is on {replica}"),
//! };
//!
//! // 5. Create the durable operation under the admission's id. Had that failed through the
//! //    broker's own fault, `permit.refund().await` would give back the slots and the token.
//! store.insert(permit.id().to_string(), OperationState::Pending);
//!
//! // 6. Commit: the permit becomes the operation's lifecycle handle.
//! let operation = permit.commit();
//! assert_eq!(operation.state(), OperationState::Pending);
//! assert_eq!(admission.snapshot().pending, 1);
//!
//! // 7. Transitions: an operator approves; an execution slot is taken; the work finishes and
//! //    every slot it held is released exactly once.
//! operation.approve().await.unwrap();
//! operation.start().await.unwrap();
//! operation.succeed().await.unwrap();
//! assert!(admission.snapshot().is_idle());
//!
//! // An identity the controller was not configured with is refused, not rate limited (HTTP 403,
//! // and no Retry-After: retrying cannot help).
//! let Err(AdmitError::Refused(refused)) = admission.admit("stranger", false, None).await else {
//!     panic!("a stranger is refused")
//! };
//! assert_eq!(refused.refusal.http_status(), 403);
//!
//! // Nothing was lost on the way: no permit or live operation was dropped half-way.
//! let snapshot = admission.snapshot();
//! assert_eq!((snapshot.dropped_permits, snapshot.dropped_operations), (0, 0));
//! # }
//! # // In-process every call is ready at its first poll: no runtime is needed.
//! # let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
//! # assert!(std::pin::pin!(example()).poll(&mut cx).is_ready());
//! ```
//!
//! [`Controller`] stays usable on its own, synchronously (`admit`, `commit`, `approve`,
//! `try_start`, `succeed`), for a process that never needs replicas.
//!
//! # Going to replicas
//!
//! Several broker processes behind one load balancer share their limits through Redis (cargo
//! feature `redis`). The calls above stay the same; a correct replica adds four things, and
//! each one left out breaks a promise:
//!
//! 1. **How it is built**: `Admission::new(controller, Some(options))` with
//!    [`ReplicaOptions::new`]`(redis_url, replica_name)`. The name is unique in the deployment
//!    and stable across restarts: a restart under the same name replaces what the last run held,
//!    in one atomic step. At a deployment's first start and after Redis forgets it (a restart
//!    without persistence, a flush, a failover to a Redis that lacks the state; Redis cannot
//!    tell the two apart), no replica admits for one lease period, until every replica's holdings can be counted again (a silent one then counts as
//!    dead). Set [`ReplicaOptions::replicas`] to every replica's name to shorten that wait:
//!    admissions then resume as soon as every replica listed has registered again.
//! 2. **A recovery source**, set with [`Admission::set_recovery_source`] before
//!    [`Admission::restore`]: an [`admission::RecoverySource`] over your store that gives back
//!    every stored operation's idempotency key and this replica's recent admissions. When Redis
//!    forgets, the replica re-registers them with its holdings. Without one, the holdings come
//!    back but the key bindings and rate buckets do not: a client's retry of a key another
//!    replica holds becomes a second operation, and a client that spent its bucket gets a
//!    fresh one.
//! 3. **Two more answers**: [`AdmitError::Unavailable`] (503 `admission_unavailable` with
//!    `Retry-After`: Redis cannot decide now, and nothing is ever admitted unchecked) and
//!    [`AdmitError::Replay`] (the key is bound to an operation on another replica).
//! 4. **Retiring keys**: when your retention deletes terminal operations, delete them through
//!    [`Admission::retire_keys_then`] (their keys are unbound on every replica first, then your
//!    deletion runs, then they are unbound once more past any recovery in flight). Deleted
//!    without it, a retired key stays bound in Redis and answers
//!    [`AdmitError::Replay`] for an operation no store holds.
//!
//! The shared decision is one atomic Redis script on Redis server time (replicas' clocks never
//! matter), recorded under the operation's id so a retried release never frees twice. A replica
//! that cannot renew its lease stops admitting, and the others release what a dead replica held.
//!
//! # In an async broker: what a dropped future does
//!
//! An async HTTP server (axum, hyper, actix) drops a request handler's future when its client
//! hangs up, at whatever `.await` the handler is parked on; nothing after that `.await` runs,
//! and every value the future owns is dropped. For this crate that means:
//!
//! - A permit ([`Permit`], [`AdmissionPermit`]) dropped there (say, while the handler awaited the store's insert) gives its
//!   slots back but the rate token stays spent — and the row the store may already have written
//!   is counted nowhere: nothing can approve, cancel or run it, and the counts no longer match
//!   the store.
//! - An [`Operation`] dropped while not terminal is counted as failed — while the store still
//!   holds it as live.
//! - [`Operation::start`] and [`OperationHandle::start`], awaiting a free execution slot, are safe
//!   to drop: the operation stays queued.
//! - [`Admission::admit`] on replicas awaits Redis; dropped there, whatever the script reserved is
//!   released by id (its idempotency key too) as for a dropped permit. Each async call of
//!   [`Admission`] says in its docs what a drop mid-way leaves.
//!
//! So split each mutating handler where it *decides*: before that point, only authenticate,
//! validate and read (a hangup changes nothing); from it on, run the whole change — `admit`, the
//! store write, `commit` or `refund`, the hand-off to the executor — in a task a disconnect
//! cannot cancel (`tokio::spawn`, with the handler merely awaiting its `JoinHandle`: dropping a
//! `JoinHandle` does not cancel the task). Keep [`Operation`] handles in a map the request does
//! not own. Serialize submissions with the same idempotency key (a per-key lock around replay
//! and admit), or the loser of a race between duplicates holds a permit it must
//! [`refund`](Permit::refund) — never drop.
//!
//! `broker/examples/axum_broker.rs` is a complete broker written this way in about 580 lines:
//! bearer authentication ([`config::Secrets::identify`]), replay under a per-key lock (another
//! request under the key is a conflict), admission and creation in a detached task, decisions
//! (approve, deny, and cancel by its [`CancelOutcome`]) whose store writes are retried until
//! they land, an executor that waits for a slot without holding the operation's lock
//! ([`OperationHandle::slot_freed`], then [`OperationHandle::try_start`] under it), restore at
//! start-up (what to do with rows found `executing`; the rate buckets rebuilt with
//! [`Controller::restore_rate`], before or after [`Admission::restore`]: the two are
//! independent; an [`admission::RecoverySource`] for when Redis forgets), reload on `SIGHUP`
//! ([`Admission::reload_from_optional_path`]), and `/metrics` in the embedder's own registry
//! ([`Admission::register_metrics`]). Its tests hang clients up mid-request and check the counts
//! against the store, lock the store under a decision, restart it, and flush Redis under it.
//!
//! Mistakes are counted, not silent: [`Snapshot::dropped_permits`] and
//! [`Snapshot::dropped_operations`] (`admission_dropped_permits_total`,
//! `admission_dropped_operations_total`) stay zero in a correct embedding; anything else is a
//! bug in it.

pub mod admission;
pub mod clock;
pub mod config;
pub mod engine;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod metrics;
#[cfg(feature = "redis")]
pub mod redis;
mod sync;

/// The `prometheus-client` version the metrics are built with, so an embedder's registry
/// matches [`metrics::register`] without pinning the version by hand.
pub use prometheus_client;

pub use admission::{
    Admission, AdmissionPermit, AdmitError, NotStarted, OperationHandle, OperationId, Refused,
    ReplicaOptions, RestoredOperation, Unavailable,
};
pub use clock::{Clock, ManualClock, QuantaClock};
pub use config::{ClientLimits, Config, FairShare, Identity, Limits, PoolShare};
pub use engine::Snapshot;
pub use engine::{
    CancelOutcome, CapacityQuota, Controller, ControllerBuilder, FairShareReason, FairShareRefusal,
    Operation, OperationState, Permit, QuotaStatus, RateQuota, Refusal, RefusalCode, StartError,
    StorageCaps, StorageReservation, Store, StoreCaps, StoredObject, TransitionError,
};
