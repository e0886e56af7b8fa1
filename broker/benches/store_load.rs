//! Creation on the two stores, side by side in one run: the same broker, the same load (new
//! `demo.run` keys from concurrent clients over loopback HTTP), on SQLite (WAL,
//! `synchronous=FULL`) and on PostgreSQL (`fsync` on, a server this bench starts), each
//! committing every write alone (`commit_batch` 1, the baseline) and with group commit (the
//! default), with creations per second and p50/p99 at each concurrency and the ratios between
//! them. Then a refusal flood on the PostgreSQL-backed broker, with the database's committed
//! transactions (`pg_stat_database.xact_commit`) read before and after: a refusal never touches
//! PostgreSQL, so the difference is the broker's own background work (membership renewals,
//! numbering rounds), not one per refusal.
//!
//! `cargo bench --bench store_load` (release build). `LOAD_CREATIONS` (default 2000 per
//! concurrency) and `LOAD_CONCURRENCY` (default `1,8,32,128`) tune it; `LOAD_POSTGRES=0` measures
//! SQLite alone. Under `cargo test` it runs
//! a short smoke version with the same assertions. Without PostgreSQL it measures SQLite alone
//! and says so.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use unyolo_admission::config::{Identity, Operators, Secrets};
use unyolo_admission::{Config, StorageCaps};
use unyolo_admission_broker::fairness::FairnessConfig;
use unyolo_admission_broker::store::{self, StoreLocation};
use unyolo_admission_broker::{Broker, BrokerSettings};

const SECRET: &str = "store-load-agent-secret";

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

struct Run {
    requests: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    statuses: std::collections::BTreeMap<u16, usize>,
}

impl Run {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Duration {
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i]
    }
}

/// `requests` submissions of `operation` under keys `prefix-N` from `concurrency` tasks.
async fn load(
    base: &str,
    prefix: &str,
    operation: &str,
    requests: usize,
    concurrency: usize,
) -> Run {
    let client = reqwest::Client::new();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, next) = (client.clone(), next.clone());
        let (url, prefix, operation) = (
            format!("{base}/api/agent/v1/operations"),
            prefix.to_owned(),
            operation.to_owned(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= requests {
                    return seen;
                }
                let body = json!({
                    "idempotency_key": format!("{prefix}-{n}"), "operation": operation,
                    "target": {"repo": "bench"}, "arguments": {}, "reason": "store load",
                });
                let sent = Instant::now();
                let reply = client
                    .post(&url)
                    .bearer_auth(SECRET)
                    .json(&body)
                    .send()
                    .await
                    .expect("the broker answers");
                let status = reply.status().as_u16();
                let _ = reply.bytes().await;
                seen.push((sent.elapsed(), status));
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
    Run {
        requests,
        elapsed,
        latencies,
        statuses,
    }
}

fn settings(
    dir: &std::path::Path,
    store: Option<StoreLocation>,
    n: usize,
    commit_batch: usize,
) -> BrokerSettings {
    let secrets = Secrets::parse(&format!("agent = {SECRET}\n")).unwrap();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    // Nothing binds while creating: `demo.run` needs no approval and runs at once (0 ms).
    let limits = format!(
        r#"{{"requests_per_window": 1000000, "window_seconds": 1, "client_active": {n},
            "client_pending": {n}, "global_active": {n}, "global_executing": {n}}}"#
    );
    BrokerSettings {
        config: Config::from_bytes(limits.as_bytes(), identities).unwrap(),
        storage_caps: StorageCaps::default(),
        store,
        // One client sends every request: its share of requests in flight must not be what
        // binds at 128 at once (each submission weighs 2 units).
        fairness: FairnessConfig {
            per_client_units: 400,
            ..FairnessConfig::default()
        },
        commit_batch,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.to_owned(),
            secrets,
            Operators::single("bench", "store-load-operator-secret-0123456789ab").unwrap(),
        )
    }
}

/// Creations at each concurrency on the store at `store`; the rows counted after each.
async fn creations(
    name: &str,
    store: Option<StoreLocation>,
    commit_batch: usize,
    per_level: usize,
    levels: &[usize],
) -> Vec<(usize, f64, Duration, Duration)> {
    let dir = tempfile::tempdir().unwrap();
    let (broker, _) = Broker::start(settings(dir.path(), store, 1_000_000, commit_batch))
        .await
        .unwrap();
    let base = format!("http://{}", broker.local_addr());
    let mut figures = Vec::new();
    let mut expected = 0;
    for &concurrency in levels {
        let run = load(
            &base,
            &format!("c{concurrency}"),
            "demo.run",
            per_level,
            concurrency,
        )
        .await;
        assert_eq!(
            run.statuses.get(&202),
            Some(&per_level),
            "{:?}",
            run.statuses
        );
        expected += per_level as u64;
        let rows = broker.database().count_operations().await.unwrap();
        assert_eq!(rows, expected, "every 202 has its row");
        println!(
            "{name:<10} {concurrency:>4} clients  {:>8.0} creations/s  p50 {:>8.2?}  p99 {:>8.2?}",
            run.rate(),
            run.percentile(0.5),
            run.percentile(0.99)
        );
        figures.push((
            concurrency,
            run.rate(),
            run.percentile(0.5),
            run.percentile(0.99),
        ));
    }
    broker.shutdown().await;
    figures
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let per_level: usize = env("LOAD_CREATIONS", if full { "2000" } else { "100" })
        .parse()
        .expect("LOAD_CREATIONS is a number");
    let levels: Vec<usize> = env("LOAD_CONCURRENCY", if full { "1,8,32,128" } else { "8" })
        .split(',')
        .map(|n| n.trim().parse().expect("LOAD_CONCURRENCY is numbers"))
        .collect();
    println!(
        "creations on loopback, {per_level} per concurrency level; {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let alone = creations("sqlite-1", None, 1, per_level, &levels).await;
    let sqlite = creations(
        "sqlite",
        None,
        store::DEFAULT_COMMIT_BATCH,
        per_level,
        &levels,
    )
    .await;
    for ((concurrency, one, one50, one99), (_, grouped, g50, g99)) in alone.iter().zip(&sqlite) {
        println!(
            "{concurrency:>4} clients: group commit/one per commit creations {:.2}x, \
             p50 {:.2}x, p99 {:.2}x",
            grouped / one,
            g50.as_secs_f64() / one50.as_secs_f64(),
            g99.as_secs_f64() / one99.as_secs_f64()
        );
    }
    if env("LOAD_POSTGRES", "1") == "0" {
        println!("LOAD_POSTGRES=0: SQLite alone was measured");
        return;
    }
    let Some(server) = support::postgres::PostgresServer::start() else {
        println!("PostgreSQL cannot be run here: SQLite alone was measured");
        return;
    };
    let database = |name: &str| Some(StoreLocation::parse(&server.database(name)).unwrap());
    let postgres_alone = creations(
        "postgres-1",
        database("store_load_alone"),
        1,
        per_level,
        &levels,
    )
    .await;
    let postgres = creations(
        "postgres",
        database("store_load"),
        store::DEFAULT_COMMIT_BATCH,
        per_level,
        &levels,
    )
    .await;
    for (((concurrency, s, _, s99), (_, p, _, p99)), (_, one, _, one99)) in
        sqlite.iter().zip(&postgres).zip(&postgres_alone)
    {
        println!(
            "{concurrency:>4} clients: postgres/sqlite (both group commit) creations {:.2}x, \
             p99 {:.2}x; postgres group commit/one per commit {:.2}x, p99 {:.2}x",
            p / s,
            p99.as_secs_f64() / s99.as_secs_f64(),
            p / one,
            p99.as_secs_f64() / one99.as_secs_f64()
        );
    }

    // A refusal flood on a PostgreSQL-backed broker: the client at its active limit (1), every
    // submission refused by the engine before anything reaches the store.
    let refusals = if full { 20_000 } else { 500 };
    let url = server.database("store_load_refusals");
    let dir = tempfile::tempdir().unwrap();
    let (broker, _) = Broker::start(settings(
        dir.path(),
        Some(StoreLocation::parse(&url).unwrap()),
        1,
        1,
    ))
    .await
    .unwrap();
    let base = format!("http://{}", broker.local_addr());
    let held = load(&base, "held", "demo.request", 1, 1).await;
    assert_eq!(held.statuses.get(&202), Some(&1));
    let commits = || {
        server
            .psql(
                "postgres",
                "SELECT xact_commit FROM pg_stat_database WHERE datname = 'store_load_refusals'",
            )
            .parse::<u64>()
            .expect("a count")
    };
    // The statistics collector reports with a delay: read, flood, wait for it to catch up.
    std::thread::sleep(Duration::from_millis(600));
    let before = commits();
    let flood = load(&base, "refused", "demo.request", refusals, 32).await;
    assert_eq!(
        flood.statuses.get(&429),
        Some(&refusals),
        "{:?}",
        flood.statuses
    );
    std::thread::sleep(Duration::from_millis(600));
    let after = commits();
    println!(
        "refusals on postgres: {refusals} in {:.2?} ({:.0}/s); xact_commit {before} -> {after} \
         (+{}: the broker's background work over the flood, not one per refusal)",
        flood.elapsed,
        flood.rate(),
        after - before
    );
    assert!(
        after - before < (refusals as u64) / 10,
        "refusals reached PostgreSQL: {} commits for {refusals} refusals",
        after - before
    );
    assert_eq!(broker.database().count_operations().await.unwrap(), 1);
    broker.shutdown().await;
}
