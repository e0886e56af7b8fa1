//! Admission shared with other replicas through Redis, when the broker runs as one replica of
//! several (`admission serve --redis URL --replica NAME`, cargo feature `redis`).
//!
//! The in-process controller keeps counting what this replica holds — its drift check, metrics,
//! rate headers and storage quotas are unchanged — and the shared controller
//! ([`crate::redis::RedisController`]) is asked first and binds across replicas: a submission is
//! admitted only if both admit it, and every transition is mirrored to it by operation id. This
//! replica's counts are a part of the shared ones, so the shared decision is the one that refuses
//! first and its refusal is the one a client sees. Without the feature, or without a Redis URL,
//! these types hold nothing and every call here is a no-op.

#[cfg(feature = "redis")]
use std::sync::OnceLock;

use crate::engine::OperationState;

/// The shared controller, if this broker is one replica of several.
#[derive(Clone, Default)]
pub(crate) struct Shared {
    #[cfg(feature = "redis")]
    pub(crate) controller: Option<crate::redis::RedisController>,
}

/// A live operation's handle in the shared counts, once it has one.
#[derive(Default)]
pub(crate) struct SharedHandle {
    #[cfg(feature = "redis")]
    handle: OnceLock<crate::redis::RedisOperation>,
}

/// Why the shared controller did not start an operation.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) enum SharedStart {
    /// Started (or no shared controller).
    Started,
    /// Not now: the shared pool is saturated or Redis does not answer; stays queued.
    NotNow,
    /// The shared handle is not approved any more.
    NotApproved,
}

impl SharedHandle {
    #[cfg(feature = "redis")]
    pub(crate) fn set(&self, handle: crate::redis::RedisOperation) {
        let _ = self.handle.set(handle);
    }

    /// Whether the operation is counted in shared counts.
    pub(crate) fn is_set(&self) -> bool {
        #[cfg(feature = "redis")]
        return self.handle.get().is_some();
        #[cfg(not(feature = "redis"))]
        false
    }

    /// Mirrors a transition (not the start) already applied to the in-process handle. Never
    /// waits on a dead Redis: a release it cannot send is kept and retried by the controller.
    pub(crate) async fn apply(&self, to: OperationState) {
        #[cfg(feature = "redis")]
        if let Some(handle) = self.handle.get() {
            let result = match to {
                OperationState::Approved => handle.approve().await,
                OperationState::Denied => handle.deny().await,
                OperationState::Canceled => handle.cancel().await.map(|_| ()),
                OperationState::Expired => handle.expire().await,
                OperationState::Failed => handle.fail().await,
                OperationState::Succeeded => handle.succeed().await,
                OperationState::Pending | OperationState::Executing => Ok(()),
            };
            if let Err(err) = result {
                tracing::error!(operation = handle.id(), error = %err, "shared counts out of step");
            }
        }
        #[cfg(not(feature = "redis"))]
        let _ = to;
    }

    /// Takes a shared execution slot before the in-process one is taken.
    pub(crate) async fn try_start(&self) -> SharedStart {
        #[cfg(feature = "redis")]
        if let Some(handle) = self.handle.get() {
            use crate::redis::RedisStartError;
            return match handle.try_start().await {
                Ok(()) => SharedStart::Started,
                Err(RedisStartError::Saturated(_)) | Err(RedisStartError::Unavailable(_)) => {
                    SharedStart::NotNow
                }
                Err(RedisStartError::NotApproved(_)) => SharedStart::NotApproved,
            };
        }
        SharedStart::Started
    }
}

/// A shared reservation made for a submission, until its operation is created (or not).
#[derive(Default)]
pub(crate) struct SharedPermit {
    #[cfg(feature = "redis")]
    permit: Option<crate::redis::RedisPermit>,
}

impl SharedPermit {
    /// The operation exists: its shared handle goes to `handle`.
    pub(crate) fn commit_into(self, handle: &SharedHandle) {
        #[cfg(feature = "redis")]
        if let Some(permit) = self.permit {
            handle.set(permit.commit());
        }
        #[cfg(not(feature = "redis"))]
        let _ = handle;
    }

    /// The broker failed through its own fault: the shared slots and token go back.
    pub(crate) async fn refund(self) {
        #[cfg(feature = "redis")]
        if let Some(permit) = self.permit {
            permit.refund().await;
        }
    }
}

/// What the shared controller said to a submission.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) enum SharedAdmit {
    /// Admitted there (or no shared controller).
    Admitted(SharedPermit),
    /// Refused, as the in-process controller would refuse.
    Refused(crate::engine::Refusal),
    /// The idempotency key already names `operation`, admitted by `replica`.
    Replay { operation: String, replica: String },
    /// Redis could not decide: 503 with this Retry-After (seconds).
    Unavailable { retry_after: u64 },
}

impl Shared {
    /// Whether this broker is one replica of several.
    pub(crate) fn is_replica(&self) -> bool {
        #[cfg(feature = "redis")]
        return self.controller.is_some();
        #[cfg(not(feature = "redis"))]
        false
    }

    /// The shared decision for operation `id` of `client` with `key`.
    pub(crate) async fn admit(
        &self,
        client: &str,
        needs_approval: bool,
        id: &str,
        key: &str,
    ) -> SharedAdmit {
        #[cfg(feature = "redis")]
        if let Some(controller) = &self.controller {
            use crate::redis::AdmitError;
            return match controller
                .admit(client, needs_approval, id, Some(key))
                .await
            {
                Ok(permit) => SharedAdmit::Admitted(SharedPermit {
                    permit: Some(permit),
                }),
                Err(AdmitError::Refused(refusal)) => SharedAdmit::Refused(refusal),
                Err(AdmitError::Replay { operation, replica }) => {
                    SharedAdmit::Replay { operation, replica }
                }
                Err(AdmitError::Unavailable(u)) => {
                    tracing::warn!(client, error = %u, "shared admission unavailable");
                    SharedAdmit::Unavailable {
                        retry_after: u.retry_after_secs(),
                    }
                }
            };
        }
        let _ = (client, needs_approval, id, key);
        SharedAdmit::Admitted(SharedPermit::default())
    }

    /// Uses `config` (already in force in-process) for the next shared decisions too.
    pub(crate) fn reload(&self, config: crate::config::Config) {
        #[cfg(feature = "redis")]
        if let Some(controller) = &self.controller {
            controller.reload(config);
        }
        #[cfg(not(feature = "redis"))]
        let _ = config;
    }

    /// Sends kept releases and stops the lease heartbeat (at shutdown).
    pub(crate) async fn shutdown(&self) {
        #[cfg(feature = "redis")]
        if let Some(controller) = &self.controller {
            controller.shutdown().await;
        }
    }
}

/// The metrics of the admission backend: which one is in use and, with Redis, its errors, lease
/// changes, reaped operations, unavailable answers and kept releases. Read at each scrape.
struct BackendCollector {
    #[cfg(feature = "redis")]
    controller: Option<crate::redis::RedisController>,
}

impl std::fmt::Debug for BackendCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendCollector")
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("replica", &self.is_replica())
            .finish()
    }
}

impl Shared {
    /// Registers the backend's metrics.
    pub(crate) fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(BackendCollector {
            #[cfg(feature = "redis")]
            controller: self.controller.clone(),
        }));
    }
}

impl prometheus_client::collector::Collector for BackendCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::MetricType;
        use prometheus_client::metrics::gauge::ConstGauge;

        #[cfg(feature = "redis")]
        let stats = self.controller.as_ref().map(|c| c.stats());
        #[cfg(not(feature = "redis"))]
        let stats: Option<std::convert::Infallible> = None;
        let backend = if stats.is_some() {
            "redis"
        } else {
            "in_process"
        };
        let mut metric = encoder.encode_descriptor(
            "admission_backend",
            "The admission backend in use: in_process (this process counts alone) or redis \
             (shared by replicas).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(1i64).encode(metric.encode_family(&[("backend", backend)])?)?;
        #[cfg(feature = "redis")]
        if let Some(stats) = stats {
            let counters = [
                (
                    "admission_redis_errors",
                    "Calls to Redis that failed or timed out.",
                    stats.errors,
                ),
                (
                    "admission_redis_lease_changes",
                    "Times this replica's lease was taken, lost or taken back.",
                    stats.lease_changes,
                ),
                (
                    "admission_redis_reaped",
                    "Operations of lapsed replicas this replica released.",
                    stats.reaped,
                ),
                (
                    "admission_redis_unavailable",
                    "Admissions answered 503 admission_unavailable.",
                    stats.unavailable,
                ),
            ];
            use prometheus_client::metrics::counter::ConstCounter;
            for (name, help, value) in counters {
                let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                ConstCounter::new(value).encode(metric)?;
            }
            let gauges = [
                (
                    "admission_redis_kept_releases",
                    "Releases waiting for Redis to answer.",
                    stats.outbox,
                ),
                (
                    "admission_redis_lease_held",
                    "Whether this replica holds its lease: 1 or 0.",
                    u64::from(stats.lease_held),
                ),
                (
                    "admission_redis_circuit_open",
                    "Whether calls to Redis are paused after failures: 1 or 0.",
                    u64::from(stats.circuit_open),
                ),
            ];
            for (name, help, value) in gauges {
                let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(metric)?;
            }
        }
        Ok(())
    }
}
