//! The one admission API, for one process or many: [`Admission`].
//!
//! A broker builds it once — in-process ([`Admission::in_process`]) or replicated through Redis
//! ([`Admission::new`] with [`ReplicaOptions`]: a URL and a replica name) — and then uses it the
//! same way whichever backend is behind it: [`Admission::admit`] gives an [`AdmissionPermit`] or
//! an [`AdmitError`]; the permit commits into an [`OperationHandle`] whose transitions release
//! slots exactly once; [`OperationHandle::start`] waits for an execution slot;
//! [`Admission::restore`], [`Admission::reload_from_path`], [`Admission::snapshot`] and
//! [`Admission::register_metrics`] do the rest. Going to replicas adds four things, each said in
//! full in the crate docs ("Going to replicas"): the options (a Redis URL, a replica name, and
//! the list of every replica when known), a [`RecoverySource`] over the store
//! ([`Admission::set_recovery_source`], before [`Admission::restore`]), two more answers
//! ([`AdmitError::Unavailable`], 503 `admission_unavailable`: the shared store cannot decide
//! now; [`AdmitError::Replay`]: the key is bound on another replica), and retiring keys with
//! the rows they name ([`Admission::retire_keys_then`]).
//!
//! Replicated, every decision is the shared store's first (it binds across replicas), then this
//! process's own engine's (which keeps counting what this replica holds: its drift check, rate
//! headers and storage quotas stay exact). This replica's counts are a part of the shared ones,
//! so the shared decision refuses first; in the rare case the local one refuses after it (a rate
//! bucket read on another clock) the shared reservation is given back whole, idempotency key
//! included. Transitions move the local handle first and then the shared one by operation id;
//! releases Redis does not answer are kept and sent, in order, when it does.
//!
//! The admission makes operation ids itself ([`OperationId`]): no caller can hand the shared
//! store an id it has seen before (an id reused after a restart must never be taken for a retry
//! of an old admission).
//!
//! - `outcome`: refusals, unavailability, starts that did not happen, the deployment's counts.
//! - `options`: what a replica needs to know ([`ReplicaOptions`]); `redis_url`: what its Redis
//!   URL names (one server, a Sentinel service, a Cluster), read without connecting.
//! - `handles`: the permit and the lifecycle handle.
//! - `backend`: the only place that knows whether this build has the Redis backend.
//! - `exposition`: the backend's metrics.
//! - `id`: operation ids.
//! - `shadow`: a candidate quota file judging the same traffic without binding ([`Shadow`]),
//!   and replaying a store's history.

mod backend;
mod exposition;
mod handles;
pub(crate) mod id;
pub(crate) mod options;
pub(crate) mod outcome;
pub(crate) mod recovery;
pub(crate) mod redis_url;
pub(crate) mod shadow;

use std::path::Path;

pub use handles::{AdmissionPermit, OperationHandle};
pub use id::{OperationId, random_id};
pub use options::{
    BareUser, DEFAULT_CLIENT_DECISIONS_IN_FLIGHT, DEFAULT_DECISIONS_IN_FLIGHT, ReplicaOptions,
    redact_url_with,
};
pub use outcome::{
    AdmitError, BackendStats, DeploymentCounts, NotStarted, Refused, RestoredOperation, SetupError,
    Unavailable, UnavailableReason,
};
pub use recovery::{FleetReading, KeyRecord, RecoverySource, SourceFuture};
pub use shadow::{
    Replay, ReplayedRefusal, Shadow, ShadowClient, ShadowPeaks, ShadowReport, ShadowVerdict,
    StoredOperation,
};

use self::backend::SharedController;
use crate::config::{Config, ConfigError, Identity};
use crate::engine::{Controller, RestoreError, StartError};
use crate::metrics::Snapshot;

/// Admission for a broker: in-process, or shared by replicas through Redis, behind one API.
/// Cheap to clone (every clone is the same admission).
///
/// ```
/// # async fn broker() -> Result<(), Box<dyn std::error::Error>> {
/// use unyolo_admission::{Admission, AdmitError, Config, Controller, Identity};
///
/// let bot = Identity::new("bot-7")?;
/// let controller = Controller::new(Config::defaults([bot]));
/// // One process. For replicas: `Admission::new(controller, Some(ReplicaOptions::new(url, name)))?`,
/// // then `set_recovery_source` before `restore` (the crate docs, "Going to replicas").
/// let admission = Admission::in_process(controller);
/// # let mut ran = false;
/// match admission.admit("bot-7", true, Some("deploy-42")).await {
///     Ok(permit) => {
///         let id = permit.id(); // store the operation under this id, then:
///         let operation = permit.commit();
///         operation.approve().await?;
///         operation.start().await?;
///         operation.succeed().await?;
///         # let _ = id;
///         # assert_eq!(operation.state(), unyolo_admission::OperationState::Succeeded);
///         # ran = true;
///     }
///     Err(AdmitError::Refused(refused)) => println!("429 {}", refused.refusal.code),
///     Err(AdmitError::Replay { operation, .. }) => println!("the key names {operation}"),
///     Err(AdmitError::Unavailable(u)) => println!("503, retry after {}s", u.retry_after_secs()),
/// }
/// # assert!(ran, "admitted and run");
/// # assert!(admission.snapshot().is_idle());
/// # Ok(()) }
/// # futures_lite_block_on(broker()).unwrap();
/// # fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     use std::task::{Context, Poll, Wake, Waker};
/// #     struct Unpark(std::thread::Thread);
/// #     impl Wake for Unpark { fn wake(self: std::sync::Arc<Self>) { self.0.unpark() } }
/// #     let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
/// #     let mut f = std::pin::pin!(f);
/// #     loop {
/// #         if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) { return v; }
/// #         std::thread::park();
/// #     }
/// # }
/// ```
#[derive(Clone)]
pub struct Admission {
    local: Controller,
    shared: Option<SharedController>,
    /// One reload at a time: each applies its configuration here and then hands the one in
    /// force to the shared store, so two racing reloads cannot leave the two on different ones.
    reloading: std::sync::Arc<std::sync::Mutex<()>>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("replica", &self.replica())
            .finish()
    }
}

/// What [`Admission::restore`] gave back: one entry per restored operation, in order, and whether
/// registering with the shared store had to be deferred.
#[derive(Debug)]
pub struct Restored {
    /// The handle of each operation, or why it could not be restored (a terminal state, an
    /// invalid client name).
    pub operations: Vec<Result<OperationHandle, RestoreError>>,
    /// Replicated, when the shared store did not answer: the operations are held here (their
    /// handles work, releases are kept), admissions are [`Unavailable`], and the heartbeat
    /// registers them as soon as Redis answers.
    pub deferred: Option<Unavailable>,
}

impl Admission {
    /// Admission decided by this process alone: `controller` is the engine. Needs no runtime;
    /// every call completes at its first poll.
    pub fn in_process(controller: Controller) -> Admission {
        Admission {
            local: controller,
            shared: None,
            reloading: std::sync::Arc::default(),
        }
    }

    /// Admission in-process (`replicas` = `None`) or shared with the other replicas through
    /// Redis. Replicated, `controller` keeps counting what this replica holds, and the options'
    /// capacity hint and pending-grant caps are taken from it. Connects lazily: a Redis that is
    /// down now does not fail this (admissions are [`Unavailable`] until it answers); only
    /// invalid options or URL do, a build without the Redis backend, or (replicated) a call
    /// outside a Tokio runtime: the replica's connection and background tasks run on it.
    pub fn new(
        controller: Controller,
        replicas: Option<ReplicaOptions>,
    ) -> Result<Admission, SetupError> {
        let Some(mut options) = replicas else {
            return Ok(Admission::in_process(controller));
        };
        options.caps = controller.storage_caps();
        options.capacity_retry = controller.capacity_retry();
        let shared = backend::connect(controller.config(), options)?;
        Ok(Admission {
            local: controller,
            shared: Some(shared),
            reloading: std::sync::Arc::default(),
        })
    }

    /// Whether admission is shared with other replicas.
    pub fn is_replicated(&self) -> bool {
        self.shared.is_some()
    }

    /// This replica's name, when replicated.
    pub fn replica(&self) -> Option<&str> {
        self.shared.as_ref().map(SharedController::replica)
    }

    /// This process's engine: what this replica holds, its storage quotas and its clients' rate
    /// buckets as seen here. Reload through [`Admission::reload_from_optional_path`] (or
    /// [`Admission::reload_from_path`]) and register metrics with [`Admission::register_metrics`],
    /// not through this engine's own: on replicas those would miss the shared side (a client
    /// added by a reload here would still be unknown to the decisions Redis makes).
    pub fn controller(&self) -> &Controller {
        &self.local
    }

    /// Decides one submission by `identity`, in the contract's order (client configured → rate
    /// token → client active → if it needs approval, client pending and the pending grants →
    /// global active → global executing). Replicated, with an `idempotency_key`, a key already
    /// bound to an operation on any replica answers [`AdmitError::Replay`] and reserves nothing,
    /// before any refusal: also while this replica answers the client from its refusal memory
    /// ([`ReplicaOptions::refusal_memory`]), which reads the key's binding first (one `GET`, no
    /// script), so a client retrying correctly with a stable key is never refused for the
    /// retry. Replay from your own store before admitting, as the crate docs' sequence does.
    ///
    /// In-process this completes at its first poll and dropping it is harmless. Replicated, it
    /// awaits Redis; dropped mid-way (its client hung up), whatever the script reserved is
    /// released by id, key binding included, as a dropped permit's would be — the rate token
    /// stays spent. Call it where a hangup cannot drop the permit it returns (see the crate
    /// docs on dropped futures).
    pub async fn admit(
        &self,
        identity: impl AsRef<str>,
        needs_approval: bool,
        idempotency_key: Option<&str>,
    ) -> Result<AdmissionPermit, AdmitError> {
        let identity = identity.as_ref();
        let Some(shared) = &self.shared else {
            // In-process: the engine alone, at the first poll; the quota an answer carries is
            // the engine's, read just after its decision (as the shared backend's is Redis's).
            return match self.local.admit_explained(identity, needs_approval) {
                Ok(local) => Ok(AdmissionPermit {
                    id: OperationId::new(),
                    quota: self.local.quota(identity),
                    local,
                    shared: None,
                }),
                Err((refusal, fair_share)) => Err(AdmitError::Refused(Refused {
                    refusal,
                    quota: self.local.quota(identity),
                    fair_share,
                })),
            };
        };
        let id = OperationId::new();
        // Boxed, so the in-process future stays small (the Redis call's state is large).
        let decided =
            Box::pin(shared.admit(identity, needs_approval, &id.to_string(), idempotency_key))
                .await;
        let shared = match decided {
            Ok(permit) => permit,
            Err(AdmitError::Refused(Refused {
                refusal,
                quota,
                fair_share,
            })) => {
                // Counted here too, so this replica's statistics and `admission_requests_total`
                // (and `admission_fair_share_refusals_total`) count the refusals it answered,
                // not only its admissions.
                self.local.count_refusal(identity, refusal.code, fair_share);
                return Err(AdmitError::Refused(Refused {
                    refusal,
                    quota: quota.or_else(|| self.local.quota(identity)),
                    fair_share,
                }));
            }
            Err(other) => return Err(other),
        };
        // Replicated, the quota is the shared decision's (the deployment's counts and bucket);
        // this process's own only where Redis gave none.
        let shared_quota = shared.quota();
        match self.local.admit_explained(identity, needs_approval) {
            Ok(local) => Ok(AdmissionPermit {
                id,
                quota: shared_quota.or_else(|| self.local.quota(identity)),
                local,
                shared: Some(shared),
            }),
            Err((refusal, fair_share)) => {
                Box::pin(shared.refund()).await;
                // This engine refused (the rare case above): its own quota is the one that
                // explains the refusal (the shared reading still counts the reservation just
                // given back).
                Err(AdmitError::Refused(Refused {
                    refusal,
                    quota: self.local.quota(identity),
                    fair_share,
                }))
            }
        }
    }

    /// The client's quota as this process's engine sees it now (`None` for an identity that has
    /// none): in-process, the quota an answer carries; replicated, use the decision's
    /// ([`AdmissionPermit::quota`], [`Refused::quota`]), or for an answer that decided nothing
    /// [`Admission::quota_now`], which count every replica.
    pub fn quota(&self, identity: &str) -> Option<crate::engine::QuotaStatus> {
        self.local.quota(identity)
    }

    /// The client's quota as the deciding backend sees it now, for an answer that decided
    /// nothing (a replay): in-process, this engine's ([`Admission::quota`]); replicated, its
    /// bucket and its counts on every replica, read from the shared store (one read, no script,
    /// nothing written) — or, when the shared store does not answer within the call timeout,
    /// this engine's, as the best there is. `None` for an identity with no quota. Read-only;
    /// safe to drop.
    pub async fn quota_now(&self, identity: &str) -> Option<crate::engine::QuotaStatus> {
        match &self.shared {
            Some(shared) => match shared.quota_now(identity).await {
                Ok(quota) => quota,
                Err(_) => self.local.quota(identity),
            },
            None => self.local.quota(identity),
        }
    }

    /// Puts what the durable store holds back under admission at start-up: each live operation
    /// counts against the limits again (even above a lowered limit: new work is then refused
    /// until it drains). Replicated, this replica's holdings in the shared store are replaced by
    /// these, in one atomic step, and its lease is taken (or, if Redis does not answer, deferred:
    /// see [`Restored::deferred`]).
    ///
    /// Await it to its end before serving. Dropped mid-way, it returns no handle, so none of its
    /// operations stays counted: the in-process engine lets go of them with the dropped local
    /// handles, and the heartbeat registers this replica without them (whether or not the
    /// dropped registration reached Redis). A restore tried again counts them once each.
    pub async fn restore(
        &self,
        operations: impl IntoIterator<Item = RestoredOperation>,
    ) -> Restored {
        self.count_again(operations, Registering::Replace).await
    }

    /// Takes over operations another replica held (it died: its lease lapsed, and the durable
    /// store made its work this replica's): each counts here from now on, as a restored one
    /// does (even above a limit). Replicated, one registration moves each operation's shared
    /// record from the replica that held it to this one (or counts it again if its holdings
    /// were already released), so it is counted once; if Redis does not answer, the heartbeat
    /// registers them as soon as it does ([`Restored::deferred`] says so).
    pub async fn adopt(&self, operations: impl IntoIterator<Item = RestoredOperation>) -> Restored {
        self.count_again(operations, Registering::Add).await
    }

    /// [`Admission::restore`] and [`Admission::adopt`]: each operation counted here (even above
    /// a limit), then, replicated, registered as `registering` says.
    async fn count_again(
        &self,
        operations: impl IntoIterator<Item = RestoredOperation>,
        registering: Registering,
    ) -> Restored {
        let mut restored = Vec::new();
        let mut to_share = Vec::new();
        for op in operations {
            // Replicated, an id the shared store cannot hold would be counted here only: the
            // other replicas would admit past it. Refused before anything is restored.
            if self.shared.is_some() && !id::shareable(&op.id) {
                restored.push((op, Err(RestoreError::UnshareableId)));
                continue;
            }
            let local = self.local.restore(&op.identity, op.state);
            if local.is_ok() {
                to_share.push(op.clone());
            }
            restored.push((op, local));
        }
        let (mut shared, deferred) = match &self.shared {
            None => (std::collections::HashMap::new(), None),
            Some(controller) => {
                let (handles, deferred) = match registering {
                    Registering::Replace => controller.register_or_defer(to_share).await,
                    Registering::Add => controller.adopt(to_share).await,
                };
                let handles = handles
                    .into_iter()
                    .map(|handle| (handle.id().to_owned(), handle))
                    .collect();
                (handles, deferred)
            }
        };
        let operations = restored
            .into_iter()
            .map(|(op, local)| {
                local.map(|local| {
                    OperationHandle::restored(
                        OperationId::stored(&op.id),
                        local,
                        shared.remove(&op.id),
                    )
                })
            })
            .collect();
        Restored {
            operations,
            deferred,
        }
    }

    /// Swaps in a new, already validated configuration for the next decisions (every replica
    /// applies its own reloads).
    pub fn reload(&self, config: Config) {
        let _one = crate::sync::lock(&self.reloading);
        self.local.reload(config);
        self.follow_reload();
    }

    /// Re-reads the quota file at `path` for the identities in force; an invalid file leaves
    /// the old configuration in force and is counted.
    pub fn reload_from_path(&self, path: &Path) -> Result<(), ConfigError> {
        let _one = crate::sync::lock(&self.reloading);
        self.local.reload_from_path(path)?;
        self.follow_reload();
        Ok(())
    }

    /// Re-reads the quota file at `path` (or the defaults, for `None`) for `identities`, which
    /// may add or remove clients; an invalid file leaves the old configuration and is counted.
    pub fn reload_from_optional_path<I: IntoIterator<Item = Identity>>(
        &self,
        path: Option<&Path>,
        identities: I,
    ) -> Result<(), ConfigError> {
        let _one = crate::sync::lock(&self.reloading);
        self.local.reload_from_optional_path(path, identities)?;
        self.follow_reload();
        Ok(())
    }

    fn follow_reload(&self) {
        if let Some(shared) = &self.shared {
            shared.reload(self.local.config());
        }
    }

    /// This process's counts and statistics now (replicated: what this replica holds).
    pub fn snapshot(&self) -> Snapshot {
        self.local.snapshot()
    }

    /// The whole deployment's counts now: every replica's from the shared store, or this
    /// process's in-process. Read-only; safe to drop.
    pub async fn counts(&self) -> Result<DeploymentCounts, Unavailable> {
        match &self.shared {
            Some(shared) => shared.counts().await,
            None => Ok(DeploymentCounts::from(&self.local.snapshot())),
        }
    }

    /// Where this replica reads, after Redis forgot the deployment, the key records and recent
    /// admissions its store holds, so re-registration restores them with its holdings. Every
    /// replica needs one: without it only the holdings are restored, so after Redis forgets, a
    /// retried key bound to an operation this replica holds is admitted as new work elsewhere
    /// (a second operation), and its clients' rate buckets start full. Set it before
    /// [`Admission::restore`]; the first one set stays. Nothing in-process (the engine's state
    /// never leaves the process).
    pub fn set_recovery_source(&self, source: std::sync::Arc<dyn RecoverySource>) {
        if let Some(shared) = &self.shared {
            shared.set_source(source);
        }
    }

    /// The operations in `records` were retired from the store: their keys are unbound on every
    /// replica, so a later submission with one is new work. Call it *before* deleting the rows:
    /// a replay that finds the key unbound then finds no row anywhere, and one that still finds
    /// it bound finds the row. Nothing in-process (keys live in the embedder's store). Safe to
    /// drop: a record not yet sent stays bound, and retiring it again is harmless.
    pub async fn retire_keys(&self, records: &[KeyRecord]) -> Result<(), Unavailable> {
        match &self.shared {
            Some(shared) => shared.retire_keys(records).await,
            None => Ok(()),
        }
    }

    /// [`Admission::retire_keys`], then `delete` (the embedder's deletion of those rows), then
    /// the keys unbound once more, excluding any recovery: replicated, a re-registration after
    /// Redis forgot writes the store's key records back, and one that read the rows before the
    /// deletion would otherwise bind the retired keys again, to operations no store holds
    /// (another replica would answer them as held elsewhere until their lifetime ran out).
    /// `delete` runs only once the keys are unbound; in-process it is all there is. Run it to
    /// its end (on a task of its own if the caller may be dropped): dropped after `delete`
    /// began, the rows may be deleted without the second unbinding.
    pub async fn retire_keys_then<T>(
        &self,
        records: &[KeyRecord],
        delete: impl std::future::Future<Output = T>,
    ) -> Result<T, Unavailable> {
        match &self.shared {
            Some(shared) => shared.retire_keys_then(records, delete).await,
            None => Ok(delete.await),
        }
    }

    /// The operations in `records` are still live: replicated, with a key lifetime
    /// ([`ReplicaOptions::idempotency_ttl`]), each key that still names its operation gets that
    /// whole lifetime again, from now. The lifetime starts at the admission, so an operation
    /// that may live longer than it needs its key renewed now and then (the reference broker
    /// renews, every minute, the keys of live operations older than 12 hours). How many were
    /// renewed; nothing in-process or without a lifetime. Safe to drop and to repeat.
    pub async fn renew_keys(&self, records: &[KeyRecord]) -> Result<u64, Unavailable> {
        match &self.shared {
            Some(shared) => shared.renew_keys(records).await,
            None => Ok(0),
        }
    }

    /// What the shared store holds under this replica's name (operation id → state), to compare
    /// with the store's live rows (fleet drift); `None` in-process. Read-only; safe to drop.
    pub async fn shared_holdings(
        &self,
    ) -> Result<
        Option<std::collections::BTreeMap<String, crate::engine::OperationState>>,
        Unavailable,
    > {
        match &self.shared {
            Some(shared) => shared.holdings().await.map(Some),
            None => Ok(None),
        }
    }

    /// What the replicated backend has seen (all zero in-process).
    pub fn stats(&self) -> BackendStats {
        self.shared
            .as_ref()
            .map(SharedController::stats)
            .unwrap_or_default()
    }

    /// Sends the releases kept while Redis did not answer; whether none is left (always, in
    /// process). Safe to drop: what is not sent stays kept.
    pub async fn flush(&self) -> bool {
        match &self.shared {
            Some(shared) => shared.flush().await,
            None => true,
        }
    }

    /// Renews this replica's lease now, as the heartbeat does (re-registering what it holds if
    /// the lease had lapsed). Nothing in-process.
    pub async fn renew(&self) -> Result<(), Unavailable> {
        match &self.shared {
            Some(shared) => shared.renew().await,
            None => Ok(()),
        }
    }

    /// Counts this replica's holdings in the shared store again from what it holds now, in one
    /// atomic step: what heals a difference between Redis and the durable store that persists
    /// (a Redis failover that lost the replication lag, an older snapshot restored). Nothing
    /// in-process.
    pub async fn recount_shared(&self) -> Result<(), Unavailable> {
        match &self.shared {
            Some(shared) => shared.recount().await,
            None => Ok(()),
        }
    }

    /// Releases, exactly once, what every replica whose lease has lapsed held; how many
    /// operations that was. The heartbeat does this on every beat. Nothing in-process.
    pub async fn reap(&self) -> Result<u64, Unavailable> {
        match &self.shared {
            Some(shared) => shared.reap().await,
            None => Ok(0),
        }
    }

    /// At shutdown: sends kept releases if Redis answers and stops the lease heartbeat (live work
    /// stays counted until the lease lapses or a restart under the same name re-registers it).
    pub async fn shutdown(&self) {
        if let Some(shared) = &self.shared {
            shared.shutdown().await;
        }
    }

    /// Registers every metric of this admission in `registry`: the engine's
    /// ([`crate::metrics::register`]) and the backend's (`admission_backend` and, replicated,
    /// the Redis calls, lease, kept releases and circuit).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        crate::metrics::register(registry, &self.local);
        exposition::register(registry, self.shared.clone());
    }
}

impl From<&Snapshot> for DeploymentCounts {
    fn from(s: &Snapshot) -> DeploymentCounts {
        DeploymentCounts {
            active: s.active,
            pending: s.pending,
            executing: s.executing,
            active_holders: s.active_holders,
            executing_holders: s.executing_holders,
            clients: s
                .clients
                .iter()
                .filter(|c| c.active > 0 || c.pending > 0 || c.executing > 0)
                .map(|c| (c.identity.to_string(), (c.active, c.pending, c.executing)))
                .collect(),
            operations: s.active,
        }
    }
}

impl From<StartError> for NotStarted {
    fn from(err: StartError) -> NotStarted {
        match err {
            StartError::Saturated(refusal) => NotStarted::Saturated(refusal),
            StartError::NotApproved(state) => NotStarted::NotApproved(state),
        }
    }
}

/// How operations counted again are registered with the shared store (see `Admission::count_again`).
#[derive(Clone, Copy)]
enum Registering {
    /// At start-up: they replace whatever this replica held.
    Replace,
    /// Taken over while running: they join what it holds.
    Add,
}
