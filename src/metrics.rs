//! What the controller exposes to dashboards: a plain [`Snapshot`] read without locks, and its
//! Prometheus text exposition through `prometheus-client` (re-exported as
//! [`crate::prometheus_client`]): [`register`] into the embedder's own registry, [`render`] a
//! whole exposition, or [`render_families`] to append to another.
//!
//! Metric names follow the snapshot's fields: `admission_config_reloads_total{result="applied"}`
//! is [`Snapshot::reloads_applied`], `admission_dropped_permits_total` is
//! [`Snapshot::dropped_permits`], and so on.
//!
//! The counts are the engine's own atomics, read at scrape time, so exposing them costs the hot
//! path nothing. The limits in force are exported beside them (`admission_client_limit`,
//! `admission_limit`, `admission_storage_limit_*`) so rules and dashboards can put each count
//! against what binds it. Clients are a configured, bounded set, so labelling by client is safe.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::config::Pool;
pub use crate::engine::{ClientSnapshot, Snapshot, StoreSnapshot};
use crate::engine::{Controller, FairShareRefusal, RefusalCode, Store};

/// Registers the controller's metrics in `registry`; they are read from the controller at each
/// scrape.
pub fn register(registry: &mut Registry, controller: &Controller) {
    registry.register_collector(Box::new(ControllerCollector {
        controller: controller.clone(),
    }));
}

/// Renders the controller's metrics alone as a complete OpenMetrics exposition, ending in
/// `# EOF`. To serve them beside metrics of your own, [`register`] them in your registry
/// (the crate re-exports [`prometheus_client`], so the versions match), or append
/// [`render_families`] to another exposition.
pub fn render(controller: &Controller) -> String {
    let mut registry = Registry::default();
    register(&mut registry, controller);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

/// The controller's metric families as OpenMetrics text *without* the closing `# EOF`, so they
/// can be appended to another registry's families before one final `# EOF`.
///
/// ```
/// use unyolo_admission::{Config, Controller, Identity, metrics};
///
/// let c = Controller::new(Config::defaults([Identity::new("bot-7").unwrap()]));
/// let mut exposition = String::from("# TYPE my_up gauge\nmy_up 1\n");
/// exposition.push_str(&metrics::render_families(&c));
/// exposition.push_str("# EOF\n");
/// assert_eq!(exposition.matches("# EOF").count(), 1);
/// assert!(exposition.contains("admission_dropped_permits_total 0"));
/// ```
pub fn render_families(controller: &Controller) -> String {
    let mut registry = Registry::default();
    register(&mut registry, controller);
    let mut out = String::new();
    prometheus_client::encoding::text::encode_registry(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

struct ControllerCollector {
    controller: Controller,
}

impl std::fmt::Debug for ControllerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControllerCollector")
    }
}

/// Each client's decisions as counter samples labelled `client`, `result` and `code`: its
/// admissions (result `admitted_as`, code `none`) and its refusals by code (`rejected`).
fn decisions_by_client<'a>(
    s: &'a crate::engine::Snapshot,
    admitted_as: &'static str,
) -> impl Iterator<Item = ([(&'static str, &'a str); 3], u64)> + 'a {
    s.clients.iter().flat_map(move |c| {
        std::iter::once((
            [
                ("client", c.identity.as_str()),
                ("result", admitted_as),
                ("code", "none"),
            ],
            c.admitted,
        ))
        .chain(RefusalCode::ALL[1..].iter().map(|&code| {
            (
                [
                    ("client", c.identity.as_str()),
                    ("result", "rejected"),
                    ("code", code.as_str()),
                ],
                c.rejected[code as usize],
            )
        }))
    })
}

fn family<L: prometheus_client::encoding::EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric_type: MetricType,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in samples {
        let sample = metric.encode_family(&labels)?;
        match metric_type {
            MetricType::Counter => ConstCounter::new(value).encode(sample)?,
            _ => ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(sample)?,
        }
    }
    Ok(())
}

/// A counter with no labels (encoded without an empty `{}`).
fn unlabelled(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(metric)
}

impl Collector for ControllerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.controller.snapshot();
        let requests = std::iter::once(([("result", "accepted"), ("code", "none")], s.admitted))
            .chain(RefusalCode::ALL.iter().map(|&code| {
                (
                    [("result", "rejected"), ("code", code.as_str())],
                    s.rejected(code),
                )
            }));
        family(
            &mut encoder,
            "admission_requests",
            "Admission decisions by result and stable refusal code.",
            MetricType::Counter,
            requests,
        )?;
        let depths = [
            ("pending", s.pending),
            ("queued", s.queued),
            ("executing", s.executing),
            ("active", s.active),
        ];
        family(
            &mut encoder,
            "admission_operations",
            "Operations by state across all clients: pending approval, queued for execution, executing, and all active.",
            MetricType::Gauge,
            depths.map(|(state, n)| ([("state", state)], n)),
        )?;
        family(
            &mut encoder,
            "admission_fair_share_refusals",
            "Refusals a global pool's fair share made where first come, first served would have admitted, by pool (active, executing) and reason (reserve: only the pool's reserve was free; share: the client held its share). Each is also counted in admission_requests_total under its pool's code.",
            MetricType::Counter,
            FairShareRefusal::ALL.map(|refusal| {
                (
                    [
                        ("pool", refusal.pool.as_str()),
                        ("reason", refusal.reason.as_str()),
                    ],
                    s.fair_share_refused(refusal),
                )
            }),
        )?;
        family(
            &mut encoder,
            "admission_pool_holders",
            "Clients holding at least one slot of each global pool (active: a live operation; executing: an executing one): how many a pool's fair share is divided among.",
            MetricType::Gauge,
            Pool::ALL.map(|pool| {
                let holders = match pool {
                    Pool::Active => s.active_holders,
                    Pool::Executing => s.executing_holders,
                };
                ([("pool", pool.as_str())], holders)
            }),
        )?;
        let per_client = s.clients.iter().flat_map(|c| {
            [
                ("pending", c.pending),
                ("queued", c.queued),
                ("executing", c.executing),
                ("active", c.active),
            ]
            .map(|(state, n)| ([("client", c.identity.as_str()), ("state", state)], n))
        });
        family(
            &mut encoder,
            "admission_client_operations",
            "Operations by client and state.",
            MetricType::Gauge,
            per_client,
        )?;
        let client_requests = decisions_by_client(&s, "accepted");
        family(
            &mut encoder,
            "admission_client_requests",
            "Admission decisions by client, result and code.",
            MetricType::Counter,
            client_requests,
        )?;
        family(
            &mut encoder,
            "admission_storage_bytes",
            "Bytes held in each capped store.",
            MetricType::Gauge,
            s.storage
                .iter()
                .map(|st| ([("store", st.store.as_str())], st.bytes)),
        )?;
        family(
            &mut encoder,
            "admission_storage_files",
            "Files held in each capped store (pending_grant: pending approvals).",
            MetricType::Gauge,
            s.storage
                .iter()
                .map(|st| ([("store", st.store.as_str())], st.files))
                .chain(std::iter::once(([("store", "pending_grant")], s.pending))),
        )?;
        family(
            &mut encoder,
            "admission_config_reloads",
            "Configuration reloads by result.",
            MetricType::Counter,
            [
                ([("result", "applied")], s.reloads_applied),
                ([("result", "rejected")], s.reloads_rejected),
            ],
        )?;
        encode_limits(&mut encoder, &self.controller)?;
        family(
            &mut encoder,
            "admission_client_tokens",
            "Rate tokens each client has available now.",
            MetricType::Gauge,
            s.clients
                .iter()
                .map(|c| ([("client", c.identity.as_str())], c.tokens)),
        )?;
        unlabelled(
            &mut encoder,
            "admission_clock_regressions",
            "Clock readings clamped because the time source went backwards.",
            s.clock_regressions,
        )?;
        unlabelled(
            &mut encoder,
            "admission_dropped_permits",
            "Permits dropped without commit or refund. Not zero means an embedding bug: a permit was lost at an await (say, a client hung up between admit and commit).",
            s.dropped_permits,
        )?;
        unlabelled(
            &mut encoder,
            "admission_dropped_operations",
            "Operation handles dropped while not terminal. Not zero means an embedding bug: the controller's counts and the store disagree.",
            s.dropped_operations,
        )?;
        Ok(())
    }
}

/// The limits in force, so rules and dashboards can put each count against what binds it.
fn encode_limits(
    encoder: &mut DescriptorEncoder<'_>,
    controller: &Controller,
) -> Result<(), std::fmt::Error> {
    let config = controller.config();
    let caps = controller.storage_caps();
    let per_client = config.effective_all().flat_map(|(identity, limits, _)| {
        [
            ("requests_per_window", u64::from(limits.requests_per_window)),
            ("window_seconds", u64::from(limits.window_seconds)),
            ("active", u64::from(limits.active)),
            // The pending limit that binds: the pending-grant store's per-client cap when lower.
            ("pending", u64::from(limits.pending).min(caps.grant_client)),
        ]
        .map(|(limit, n)| ([("client", identity.as_str()), ("limit", limit)], n))
    });
    family(
        encoder,
        "admission_client_limit",
        "Each configured client's limits in force: requests_per_window, window_seconds, active, and pending (the lower of its pending limit and the pending-grant store's per-client cap).",
        MetricType::Gauge,
        per_client,
    )?;
    let limits = config.limits();
    family(
        encoder,
        "admission_limit",
        "Global limits in force: global_active, global_executing, and pending_grants (the pending-grant store's global cap).",
        MetricType::Gauge,
        [
            ("global_active", u64::from(limits.global_active)),
            ("global_executing", u64::from(limits.global_executing)),
            ("pending_grants", caps.grant_global),
        ]
        .map(|(limit, n)| ([("limit", limit)], n)),
    )?;
    family(
        encoder,
        "admission_storage_limit_bytes",
        "Global byte cap of each capped store.",
        MetricType::Gauge,
        Store::ALL.map(|store| ([("store", store.as_str())], caps.of(store).global_bytes)),
    )?;
    family(
        encoder,
        "admission_storage_limit_files",
        "Global file cap of each capped store (pending_grant: pending approvals).",
        MetricType::Gauge,
        Store::ALL
            .map(|store| ([("store", store.as_str())], caps.of(store).global_files))
            .into_iter()
            .chain(std::iter::once((
                [("store", "pending_grant")],
                caps.grant_global,
            ))),
    )
}

/// Registers a shadow engine's verdicts in `registry` ([`crate::admission::Shadow::engine`]):
/// `admission_shadow_decisions_total{client,result,code}` (result `admitted` or `rejected`, code
/// `none` for an admission) and `admission_shadow_config_reloads_total{result}`, read from the
/// shadow engine at each scrape.
pub fn register_shadow(registry: &mut Registry, shadow_engine: &Controller) {
    registry.register_collector(Box::new(ShadowCollector {
        controller: shadow_engine.clone(),
    }));
}

struct ShadowCollector {
    controller: Controller,
}

impl std::fmt::Debug for ShadowCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShadowCollector")
    }
}

impl Collector for ShadowCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.controller.snapshot();
        let decisions = decisions_by_client(&s, "admitted");
        family(
            &mut encoder,
            "admission_shadow_decisions",
            "What the shadow quota file would have decided, by client, result and refusal code; it never changes the real decision.",
            MetricType::Counter,
            decisions,
        )?;
        family(
            &mut encoder,
            "admission_shadow_config_reloads",
            "Shadow quota file reloads by result (a rejected file leaves the old shadow in force).",
            MetricType::Counter,
            [
                ([("result", "applied")], s.reloads_applied),
                ([("result", "rejected")], s.reloads_rejected),
            ],
        )
    }
}
