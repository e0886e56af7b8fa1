//! The store stays bounded, measured: the replay filter against the fixed Bloom filter it replaced
//! (same run), refusal throughput and the share of refusals that reach SQLite with few and many
//! keys stored, start-up time and memory with many rows, and sweep rows per second.
//!
//! `cargo bench --bench retention` (release build, about two minutes; not in CI). `RETENTION_ROWS`
//! (default 1,000,000) sets the large store; `RETENTION_FILTER_KEYS` (default 10,000,000) the
//! largest in-memory filter run; `RETENTION_REFUSALS` (default 20,000) the refusals per phase;
//! `RETENTION_SWEEP_ROWS` (default 50,000) how many of the large store's rows are old enough to
//! retire in the timed sweep.
//! Under `cargo test --all-targets` it runs a small smoke version.

#[path = "support/fixed_bloom.rs"]
mod fixed_bloom;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::engine::OperationState;
use unyolo_admission::{Config, StorageCaps};
use unyolo_admission_broker::keys::KeyFilter;
use unyolo_admission_broker::store::{OperationRecord, SqliteStore};
use unyolo_admission_broker::{Broker, BrokerSettings, Keep, RetentionSettings};

const SECRET: &str = "retention-agent-secret";

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// This process's resident memory, from `/proc/self/status` (0 where there is none).
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The filters alone: `stored` keys in, then `probes` never-used keys asked.
fn filters(stored: usize, probes: usize) {
    let started = Instant::now();
    let ours = KeyFilter::with_capacity(stored);
    for i in 0..stored {
        ours.insert("agent", &format!("stored-{i}"));
    }
    let build = started.elapsed();
    let mut bloom = fixed_bloom::FixedBloom::new();
    for i in 0..stored {
        bloom.insert("agent", &format!("stored-{i}"));
    }
    let keys: Vec<String> = (0..probes).map(|i| format!("new-{i}")).collect();
    let t = Instant::now();
    let ours_passed = keys.iter().filter(|k| ours.may_contain("agent", k)).count();
    let ours_ns = t.elapsed().as_nanos() as f64 / probes as f64;
    let t = Instant::now();
    let bloom_passed = keys
        .iter()
        .filter(|k| bloom.may_contain("agent", k))
        .count();
    let bloom_ns = t.elapsed().as_nanos() as f64 / probes as f64;
    let missing = (0..stored.min(1_000_000))
        .filter(|i| !ours.may_contain("agent", &format!("stored-{i}")))
        .count();
    assert_eq!(missing, 0, "a stored key was answered \"no\"");
    let stats = ours.stats();
    println!(
        "filter  {stored:>10} keys | cuckoo: {:>7.3}% of new keys pass, {:>6.1} ns/lookup, {:>7.2} MiB, built in {:>6.2?} \
         | fixed Bloom (baseline): {:>7.3}% pass, {:>6.1} ns/lookup, {:.2} MiB",
        100.0 * ours_passed as f64 / probes as f64,
        ours_ns,
        mib(stats.bytes),
        build,
        100.0 * bloom_passed as f64 / probes as f64,
        bloom_ns,
        mib(bloom.bytes() as u64),
    );
}

/// Operation `i`: terminal since 2020 (past any retention) if `old`, else terminal just now.
fn terminal(i: usize, old: bool) -> OperationRecord {
    let now = unyolo_admission_broker::store::now_rfc3339();
    let at = if old {
        "2020-01-01T00:00:00.000Z"
    } else {
        now.as_str()
    };
    OperationRecord {
        id: format!("op_{i:032x}"),
        client_id: "agent".to_owned(),
        idempotency_key: format!("stored-{i}"),
        operation: "demo.run".to_owned(),
        target: json!({"repo": "unyolo/retention"}),
        arguments: json!({"duration_ms": 0}),
        reason: "retention benchmark".to_owned(),
        state: OperationState::Succeeded,
        created_at: at.to_owned(),
        updated_at: at.to_owned(),
        terminal_at: Some(at.to_owned()),
        error: None,
        revision: 3,
        decided: None,
        ended_from: None,
        active_expires_at: None,
        pending_expires_at: None,
        broker: "admission".to_owned(),
        presentation: unyolo_admission_broker::presentation::derive(
            "demo.run",
            &json!({"repo": "unyolo/retention"}),
            &json!({"duration_ms": 0}),
            "stored before",
        ),
    }
}

struct StoreRun {
    rows: usize,
    refusals_per_second: f64,
    reached_sqlite: usize,
}

/// A broker over `rows` terminal operations, `retiring` of them from 2020: start-up, refusals,
/// then one sweep (which deletes the `retiring` ones).
async fn store_run(rows: usize, retiring: usize, refusals: usize, concurrency: usize) -> StoreRun {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = SqliteStore::open(dir.path()).unwrap();
        let t = Instant::now();
        for chunk in (0..rows).collect::<Vec<_>>().chunks(50_000) {
            let records: Vec<_> = chunk.iter().map(|&i| terminal(i, i < retiring)).collect();
            db.load(&records).unwrap();
        }
        if rows > 1_000 {
            println!("store   {rows:>10} rows | seeded in {:.2?}", t.elapsed());
        }
    }
    let file = dir.path().join("admission.sqlite3");
    let secrets = Secrets::parse(&format!("agent = {SECRET}\n")).unwrap();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    // One admission an hour: after the first, every new key is refused by the rate limit, after
    // the replay lookup (which is what the filter guards).
    let limits = r#"{"requests_per_window": 1, "window_seconds": 3600, "client_active": 10,
        "client_pending": 10, "global_active": 10, "global_executing": 1}"#;
    let settings = BrokerSettings {
        config: Config::from_bytes(limits.as_bytes(), identities).unwrap(),
        storage_caps: StorageCaps::default(),
        drift_interval: Duration::ZERO,
        retention: RetentionSettings {
            keep: Keep::For(Duration::from_secs(7 * 86_400)),
            sweep_interval: Duration::ZERO,
            ..RetentionSettings::default()
        },
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().to_owned(),
            secrets,
            unyolo_admission::config::Operators::single(
                "bench",
                "retention-operator-secret-0123456789abcdef",
            )
            .unwrap(),
        )
    };
    let rss_before = rss_bytes();
    let t = Instant::now();
    let (broker, _) = Broker::start(settings).await.unwrap();
    let start_up = t.elapsed();
    let rss_after = rss_bytes();
    println!(
        "store   {rows:>10} rows | start-up {start_up:>8.2?}, RSS +{:>7.1} MiB",
        mib(rss_after.saturating_sub(rss_before))
    );
    let base = format!("http://{}", broker.local_addr());

    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let spend = http
        .post(format!("{base}/api/agent/v1/operations"))
        .bearer_auth(SECRET)
        .json(
            &json!({"idempotency_key": "spend", "operation": "demo.request",
            "target": {}, "arguments": {}, "reason": "spend the token"}),
        )
        .send()
        .await
        .unwrap();
    // 202, or 429 when start-up already rebuilt a spent bucket from the rows created just now.
    assert!(matches!(spend.status().as_u16(), 202 | 429));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, next) = (http.clone(), Arc::clone(&next));
        let url = format!("{base}/api/agent/v1/operations");
        tasks.push(tokio::spawn(async move {
            let mut refused = 0;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= refusals {
                    return refused;
                }
                let body = json!({"idempotency_key": format!("new-{i}"), "operation": "demo.request",
                    "target": {}, "arguments": {}, "reason": "refused"});
                let r = http.post(&url).bearer_auth(SECRET).json(&body).send().await;
                if r.is_ok_and(|r| r.status().as_u16() == 429) {
                    refused += 1;
                }
            }
        }));
    }
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    let elapsed = t.elapsed();
    assert_eq!(refused, refusals, "every new key is refused");
    let reached_sqlite = (0..refusals)
        .filter(|i| broker.replay_filter_passes("agent", &format!("new-{i}")))
        .count();
    let refusals_per_second = refusals as f64 / elapsed.as_secs_f64();

    let before = std::fs::metadata(&file).map_or(0, |m| m.len());
    let t = Instant::now();
    let report = broker.sweep_now().await.unwrap();
    let sweep = t.elapsed();
    let after = std::fs::metadata(&file).map_or(0, |m| m.len());
    assert_eq!(report.retired, retiring as u64);
    println!(
        "store   {rows:>10} rows | {refusals} refusals at {:>6.0}/s, \
         {:.3}% reached SQLite | sweep {} rows in {sweep:.2?} ({:.0} rows/s), file {:.1} -> {:.1} MiB",
        refusals_per_second,
        100.0 * reached_sqlite as f64 / refusals as f64,
        report.retired,
        report.retired as f64 / sweep.as_secs_f64(),
        mib(before),
        mib(after),
    );
    broker.shutdown().await;
    StoreRun {
        rows,
        refusals_per_second,
        reached_sqlite,
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let rows = env("RETENTION_ROWS", if full { 1_000_000 } else { 2_000 });
    let filter_keys = env(
        "RETENTION_FILTER_KEYS",
        if full { 10_000_000 } else { 10_000 },
    );
    let refusals = env("RETENTION_REFUSALS", if full { 20_000 } else { 500 });
    let probes = if full { 1_000_000 } else { 10_000 };
    println!(
        "{} CPUs; filters probed with {probes} never-used keys",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for stored in [10, rows, filter_keys] {
        filters(stored, probes);
    }
    let retiring = env("RETENTION_SWEEP_ROWS", if full { 50_000 } else { 1_000 });
    let few = store_run(10, 10, refusals, 32).await;
    let many = store_run(rows, retiring.min(rows), refusals, 32).await;
    println!(
        "refusal throughput with {} rows / with {} rows: {:.2}x; reached SQLite: {} of {refusals} / {} of {refusals}",
        many.rows,
        few.rows,
        many.refusals_per_second / few.refusals_per_second,
        many.reached_sqlite,
        few.reached_sqlite,
    );
}
