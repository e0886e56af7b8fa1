//! A bounded load run of the reference broker on loopback: refusal throughput and latency against
//! creation throughput and latency, in the same run, with proof that refusals never write to
//! SQLite (operation rows and the WAL file unchanged); then the refusal flood on that broker and
//! on a second one judging every submission against a shadow quota file too
//! (`--shadow-config`), in alternating rounds, with the medians' ratio; and the floor: a bare
//! axum server in the same process that answers the broker's own 429 and `/healthz` bytes with
//! nothing behind them, flooded by the same clients in turns with the broker, so the broker's
//! refusals/`/healthz` ratio is read beside the most any server on this stack reaches here.
//!
//! `cargo bench --bench broker_load` (release build). `LOAD_REQUESTS` (default 20000 refusals,
//! a tenth as many creations), `LOAD_CONCURRENCY` (default 32), `LOAD_FLOOR_ROUNDS` (default 3)
//! and `LOAD_SHADOW_ROUNDS` (default 5 rounds of each) tune it. Under `cargo test` it runs a short smoke version with the same
//! assertions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::{Config, StorageCaps};
use unyolo_admission_broker::{Broker, BrokerSettings};

const SECRET: &str = "load-agent-secret";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Phase {
    name: &'static str,
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    statuses: std::collections::BTreeMap<u16, usize>,
}

impl Phase {
    fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Duration {
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i]
    }

    fn report(&self) {
        println!(
            "{:<9} {:>7} requests  {:>9.0} req/s  p50 {:>8.2?}  p99 {:>8.2?}  statuses {:?}",
            self.name,
            self.requests,
            self.throughput(),
            self.percentile(0.50),
            self.percentile(0.99),
            self.statuses
        );
    }
}

/// Sends `requests` submissions with distinct keys from `concurrency` tasks.
async fn phase(
    name: &'static str,
    base: &str,
    prefix: &str,
    operation: &str,
    requests: usize,
    concurrency: usize,
) -> Phase {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, next) = (http.clone(), Arc::clone(&next));
        let url = format!("{base}/api/agent/v1/operations");
        let base = base.to_owned();
        let (prefix, operation) = (prefix.to_owned(), operation.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return seen;
                }
                let body = json!({
                    "idempotency_key": format!("{prefix}-{i}"),
                    "operation": operation,
                    "target": {"repo": "unyolo/load"},
                    "arguments": {},
                    "reason": "load run",
                });
                let t = Instant::now();
                let response = if operation == "healthz" {
                    http.get(format!("{base}/healthz")).send().await
                } else {
                    http.post(&url).bearer_auth(SECRET).json(&body).send().await
                };
                let status = match response {
                    Ok(r) => {
                        let s = r.status().as_u16();
                        let _ = r.bytes().await;
                        s
                    }
                    Err(_) => 0,
                };
                seen.push((t.elapsed(), status));
            }
        }));
    }
    let mut latencies = Vec::with_capacity(requests);
    let mut statuses = std::collections::BTreeMap::new();
    for task in tasks {
        for (latency, status) in task.await.unwrap() {
            latencies.push(latency);
            *statuses.entry(status).or_insert(0) += 1;
        }
    }
    let elapsed = started.elapsed();
    latencies.sort();
    Phase {
        name,
        requests,
        elapsed,
        latencies,
        statuses,
    }
}

fn wal_bytes(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join("admission.sqlite3-wal")).map_or(0, |m| m.len())
}

/// The median of `phases`' throughputs.
fn median_throughput(phases: &[Phase]) -> f64 {
    let mut rates: Vec<f64> = phases.iter().map(Phase::throughput).collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// The median of `phases`' medians (p50 latency).
fn median_p50(phases: &[Phase]) -> Duration {
    let mut p50s: Vec<Duration> = phases.iter().map(|p| p.percentile(0.50)).collect();
    p50s.sort();
    p50s[p50s.len() / 2]
}

/// A refusal as the broker answers it, kept to be answered again byte for byte by the floor.
#[derive(Clone)]
struct Answer {
    status: axum::http::StatusCode,
    headers: axum::http::HeaderMap,
    body: bytes::Bytes,
}

impl Answer {
    async fn of(response: reqwest::Response) -> Answer {
        let status = axum::http::StatusCode::from_u16(response.status().as_u16()).unwrap();
        let mut headers = axum::http::HeaderMap::new();
        for (name, value) in response.headers() {
            // hyper writes its own `date` and `content-length`, as it does for the broker.
            if name != "date" && name != "content-length" {
                headers.append(
                    axum::http::HeaderName::from_bytes(name.as_str().as_bytes()).unwrap(),
                    axum::http::HeaderValue::from_bytes(value.as_bytes()).unwrap(),
                );
            }
        }
        let body = response.bytes().await.unwrap();
        Answer {
            status,
            headers,
            body,
        }
    }

    fn response(&self) -> axum::response::Response {
        let mut response = axum::response::Response::new(axum::body::Body::from(self.body.clone()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        response
    }
}

/// The floor: a bare axum server on the broker's own stack (hyper's HTTP/1, tokio) with nothing
/// behind its routes. A submission's body is read and parsed as JSON (a refusal must tell a bad
/// body from a good one) and answered with the broker's own refusal, bytes and headers; a
/// `/healthz` with the broker's own `/healthz`. What the broker's refusal costs beyond this is
/// its own; what this one costs beyond its `/healthz` no server on this stack escapes.
async fn floor(refusal: Answer, healthz: Answer) -> (String, tokio::task::JoinHandle<()>) {
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    let app = axum::Router::new()
        .route(
            "/healthz",
            get(move || {
                let healthz = healthz.clone();
                async move { healthz.response() }
            }),
        )
        .route(
            "/api/agent/v1/operations",
            post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
                let refusal = refusal.clone();
                async move {
                    let parsed = serde_json::from_slice::<serde_json::Value>(&body);
                    match (headers.get("authorization"), parsed) {
                        (Some(_), Ok(submission)) => {
                            std::hint::black_box(submission);
                            refusal.response()
                        }
                        _ => axum::http::StatusCode::BAD_REQUEST.into_response(),
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, server)
}

/// One floor round and one broker round of `/healthz` then refusals, in turns (who goes first
/// alternating); each side's refusals/`/healthz` ratio by median over the rounds.
async fn against_floor(base: &str, refusals: usize, concurrency: usize, rounds: usize) {
    let http = reqwest::Client::new();
    let refused = http
        .post(format!("{base}/api/agent/v1/operations"))
        .bearer_auth(SECRET)
        .json(&json!({
            "idempotency_key": "floor-sample",
            "operation": "demo.request",
            "target": {"repo": "unyolo/load"},
            "arguments": {},
            "reason": "load run",
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    let refusal = Answer::of(refused).await;
    let healthz = Answer::of(http.get(format!("{base}/healthz")).send().await.unwrap()).await;
    let (floor_base, server) = floor(refusal, healthz).await;
    let (mut broker_ratios, mut floor_ratios) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for on_floor in [round % 2 == 1, round % 2 == 0] {
            let (url, ratios, name) = if on_floor {
                (&floor_base, &mut floor_ratios, "floor")
            } else {
                (&base.to_owned(), &mut broker_ratios, "broker")
            };
            let prefix = format!("{name}-{round}");
            let ceiling = phase("healthz", url, "-", "healthz", refusals, concurrency).await;
            let flood = phase(
                "refuse",
                url,
                &prefix,
                "demo.request",
                refusals,
                concurrency,
            )
            .await;
            assert_eq!(flood.statuses.get(&429), Some(&refusals));
            let ratio = flood.throughput() / ceiling.throughput();
            println!(
                "{name:<6} round {round}: healthz {:>7.0} req/s, refusals {:>7.0} req/s, ratio {ratio:.3}",
                ceiling.throughput(),
                flood.throughput()
            );
            ratios.push(ratio);
        }
    }
    server.abort();
    let median = |ratios: &mut Vec<f64>| {
        ratios.sort_by(f64::total_cmp);
        ratios[ratios.len() / 2]
    };
    let (broker, floor) = (median(&mut broker_ratios), median(&mut floor_ratios));
    println!(
        "refusals/healthz, median of {rounds}: broker {broker:.3}, bare axum floor {floor:.3}; \
         the broker holds {:.0}% of the floor's ratio",
        100.0 * broker / floor
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` a short smoke run checks
    // the same assertions.
    let full = std::env::args().any(|a| a == "--bench");
    let refusals = env("LOAD_REQUESTS", if full { 20_000 } else { 1_000 });
    let creations = (refusals / 10).max(100);
    let concurrency = env("LOAD_CONCURRENCY", 32);
    let dir = tempfile::tempdir().unwrap();
    let secrets = Secrets::parse(&format!("agent = {SECRET}\n")).unwrap();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    // No rate or count limit binds during the creation phase; the pending-grant store is widened
    // through the library API so that every creation can wait for approval.
    let limits = format!(
        r#"{{"requests_per_window": 1000000, "window_seconds": 1, "client_active": {n},
            "client_pending": {n}, "global_active": {n}, "global_executing": 1}}"#,
        n = creations
    );
    let config = Config::from_bytes(limits.as_bytes(), identities.clone()).unwrap();
    let caps = StorageCaps {
        grant_client: creations as u64,
        grant_global: creations as u64,
        ..StorageCaps::default()
    };
    let settings = |dir: &std::path::Path, shadow: Option<Config>| BrokerSettings {
        config: config.clone(),
        shadow,
        storage_caps: caps,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.to_owned(),
            secrets.clone(),
            unyolo_admission::config::Operators::single(
                "bench",
                "load-operator-secret-0123456789abcdef",
            )
            .unwrap(),
        )
    };
    let (broker, _) = Broker::start(settings(dir.path(), None)).await.unwrap();
    let base = format!("http://{}", broker.local_addr());
    println!(
        "broker on loopback, SQLite WAL synchronous=FULL; concurrency {concurrency}; {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    let ceiling = phase("healthz", &base, "-", "healthz", refusals, concurrency).await;
    ceiling.report();

    let created = phase(
        "create",
        &base,
        "create",
        "demo.request",
        creations,
        concurrency,
    )
    .await;
    created.report();
    assert_eq!(created.statuses.get(&202), Some(&creations));

    // Now the client is at its active limit: every new submission is refused.
    let rows = broker.database().count_operations().await.unwrap();
    let wal = wal_bytes(dir.path());
    let admitted = broker.controller().snapshot().admitted;
    let refused = phase(
        "refuse",
        &base,
        "refuse",
        "demo.request",
        refusals,
        concurrency,
    )
    .await;
    refused.report();
    assert_eq!(refused.statuses.get(&429), Some(&refusals));
    let rows_after = broker.database().count_operations().await.unwrap();
    let wal_after = wal_bytes(dir.path());
    println!(
        "operation rows {rows} -> {rows_after}; WAL bytes {wal} -> {wal_after}; admitted {admitted} -> {}",
        broker.controller().snapshot().admitted
    );
    assert_eq!(
        (rows, wal),
        (rows_after, wal_after),
        "a refusal wrote to SQLite"
    );
    println!(
        "refusal/creation throughput ratio: {:.1}x; refusals run at {:.0}% of the bare HTTP rate",
        refused.throughput() / created.throughput(),
        100.0 * refused.throughput() / ceiling.throughput()
    );

    let floor_rounds = env("LOAD_FLOOR_ROUNDS", if full { 3 } else { 1 });
    against_floor(&base, refusals, concurrency, floor_rounds).await;

    // The same flood on a broker with a shadow file (the same limits, so the shadow is at them
    // too and judges every submission a refusal), in alternating rounds against this one.
    let shadow_dir = tempfile::tempdir().unwrap();
    let (shadowed, _) = Broker::start(settings(shadow_dir.path(), Some(config.clone())))
        .await
        .unwrap();
    let shadow_base = format!("http://{}", shadowed.local_addr());
    let filled = phase(
        "create",
        &shadow_base,
        "create",
        "demo.request",
        creations,
        concurrency,
    )
    .await;
    assert_eq!(filled.statuses.get(&202), Some(&creations));
    let rounds = env("LOAD_SHADOW_ROUNDS", if full { 5 } else { 1 });
    let (mut plain, mut shadow) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternating who goes first, so neither always meets a warmer (or busier) machine.
        for with_shadow in [round % 2 == 1, round % 2 == 0] {
            let (name, url, phases) = if with_shadow {
                ("shadow", &shadow_base, &mut shadow)
            } else {
                ("plain", &base, &mut plain)
            };
            let prefix = format!("{name}-{round}");
            let flood = phase(name, url, &prefix, "demo.request", refusals, concurrency).await;
            assert_eq!(flood.statuses.get(&429), Some(&refusals));
            flood.report();
            phases.push(flood);
        }
    }
    let judged = shadowed.shadow().expect("a shadow").engine().snapshot();
    assert_eq!(
        judged.rejected.iter().sum::<u64>(),
        (refusals * rounds) as u64,
        "the shadow judged every refusal"
    );
    let (plain_rate, shadow_rate) = (median_throughput(&plain), median_throughput(&shadow));
    println!(
        "refusal flood, median of {rounds}: without shadow {plain_rate:.0} req/s (p50 {:.2?}), \
         with shadow {shadow_rate:.0} req/s (p50 {:.2?}); with/without {:.3}",
        median_p50(&plain),
        median_p50(&shadow),
        shadow_rate / plain_rate
    );
    shadowed.shutdown().await;
    broker.shutdown().await;
}
