//! The backend's metrics, read at each scrape: which backend is in use and, replicated, the
//! Redis calls that failed, lease changes, reaped operations, unavailable answers, kept releases
//! and the circuit.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::backend::SharedController;
use super::outcome::BackendStats;

/// Registers the backend's collector: `shared` is the replicated half, `None` in-process.
pub(super) fn register(registry: &mut Registry, shared: Option<SharedController>) {
    registry.register_collector(Box::new(BackendCollector(shared)));
}

struct BackendCollector(Option<SharedController>);

impl std::fmt::Debug for BackendCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendCollector")
    }
}

impl Collector for BackendCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        let backend = if shared.is_some() {
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
        let Some(shared) = shared else {
            return Ok(());
        };
        let stats: BackendStats = shared.stats();
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
            (
                "admission_redis_busy",
                "Admissions answered 503 admission_unavailable because this replica (or the \
                 client on it) had as many decisions in flight to Redis as it allows.",
                stats.busy,
            ),
            (
                "admission_redis_refusals_from_memory",
                "Submissions refused from this replica's memory of Redis's refusal, without a \
                 Redis call.",
                stats.refusals_from_memory,
            ),
        ];
        for (name, help, value) in counters {
            let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(value).encode(metric)?;
        }
        let mut metric = encoder.encode_descriptor(
            "admission_redis_refusals_forgotten",
            "Remembered refusals forgotten, by why: expired (the next token or the capacity \
             hint came), refund, release (for the client), any_release (a global limit), \
             replaced (a replica's holdings reaped or registered again), resubscribed (the \
             notice subscription was lost), reload, admitted (this replica admitted the \
             client).",
            None,
            MetricType::Counter,
        )?;
        for (reason, value) in BackendStats::FORGOTTEN_REASONS
            .iter()
            .zip(stats.refusals_forgotten)
        {
            ConstCounter::new(value).encode(metric.encode_family(&[("reason", *reason)])?)?;
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
            (
                "admission_redis_recovering",
                "Whether Redis forgot the deployment and its replicas were still registering \
                 again at this replica's last registration (no admissions meanwhile): 1 or 0.",
                u64::from(stats.recovering),
            ),
            (
                "admission_redis_notices_live",
                "Whether this replica hears the deployment's release notices now (its refusal \
                 memory answers only then): 1 or 0.",
                u64::from(stats.notices_live),
            ),
        ];
        for (name, help, value) in gauges {
            let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(metric)?;
        }
        Ok(())
    }
}
