//! Operator V1 under load, in two parts, each beside its baseline in the same run.
//!
//! 1. **Request pages at 1k and 100k requests.** Requests (`demo.request` operations, 1 in 10
//!    pending, the rest denied) are bulk-inserted into the SQLite file, and at each size
//!    `SqliteStore::request_page` (what `GET /api/operator/v1/requests` runs) is timed for five
//!    shapes: the first page of everything, the last page (a position at the oldest requests), the
//!    first pending page, the first history page, and a target-field filter. The baseline is the
//!    Agent V1 listing's first page (`SqliteStore::list_page`) on the same file. Medians, the
//!    100k/1k ratio per shape, and SQLite's plan are printed.
//! 2. **A decision's latency under a refusal flood.** An in-process broker; a flooding client has
//!    spent its rate bucket and sends submissions on the agent listener as fast as
//!    `FLOOD_CONCURRENCY` connections allow (each is refused 429); meanwhile the operator denies
//!    requests one after another on the operator listener. The baseline is the same decisions with
//!    no flood. Medians and p99 and the flooded/quiet ratio are printed.
//!
//! `cargo bench --bench operator_pages` (release build). `OPERATOR_ROWS` (default 100000) is the
//! largest size, `OPERATOR_REPEATS` (default 200) the timed calls per shape and size, and
//! `OPERATOR_DECISIONS` (default 200) the decisions per phase. Under `cargo test` it runs a short
//! smoke version with the same checks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use unyolo_admission::config::{Identity, Operators, Secrets};
use unyolo_admission::{Config, OperationState, StorageCaps};
use unyolo_admission_broker::store::{DATABASE_FILE, PageQuery, RequestQuery, StateFilter};
use unyolo_admission_broker::{Broker, BrokerSettings, ListenAddr, SqliteStore};

const CLIENT: &str = "agent";
const LIMIT: u32 = 50;
const PENDING_EVERY: u64 = 10;
const OPERATOR_SECRET: &str = "bench-operator-secret-0123456789abcdef";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A creation time `i` milliseconds after a fixed start, in the store's RFC 3339 form.
fn timestamp(i: u64) -> String {
    let (ms, s) = (i % 1000, i / 1000);
    let (day, s) = (s / 86_400, s % 86_400);
    format!(
        "2026-{:02}-{:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        1 + day / 28,
        1 + day % 28,
        s / 3600,
        s / 60 % 60,
        s % 60
    )
}

/// Inserts requests `from..to` in one transaction.
fn grow(conn: &mut rusqlite::Connection, from: u64, to: u64) {
    let tx = conn.transaction().unwrap();
    {
        let mut insert = tx
            .prepare(
                "INSERT INTO operations (id, client_id, idempotency_key, operation, target, \
                 arguments, reason, state, created_at, updated_at, terminal_at, revision, \
                 ended_from, title, summary, request_digest) \
                 VALUES (?1, ?2, ?3, 'demo.request', ?4, '{}', 'operator bench', ?5, ?6, ?6, \
                 ?7, ?8, ?9, 'Ask for approval on the bench repo', 'operator bench', ?10)",
            )
            .unwrap();
        for i in from..to {
            let created = timestamp(i);
            let pending = i % PENDING_EVERY == 0;
            insert
                .execute(rusqlite::params![
                    format!("op_{i:016x}"),
                    CLIENT,
                    format!("key-{i}"),
                    format!("{{\"repo\":\"repo-{}\"}}", i % 100),
                    if pending { "pending" } else { "denied" },
                    created,
                    (!pending).then_some(&created),
                    if pending { 1 } else { 2 },
                    (!pending).then_some("pending"),
                    format!("{i:064x}"),
                ])
                .unwrap();
        }
    }
    tx.commit().unwrap();
}

fn shapes(size: u64) -> Vec<(&'static str, RequestQuery)> {
    let base = RequestQuery {
        operations: vec!["demo.request".to_owned()],
        limit: LIMIT + 1,
        ..RequestQuery::default()
    };
    let live = vec![
        OperationState::Pending,
        OperationState::Approved,
        OperationState::Executing,
    ];
    vec![
        ("first page", base.clone()),
        (
            "last page",
            RequestQuery {
                before: Some((timestamp(u64::from(LIMIT)), format!("op_{:016x}", LIMIT))),
                ..base.clone()
            },
        ),
        (
            "status=pending",
            RequestQuery {
                states: StateFilter::In(vec![OperationState::Pending]),
                ..base.clone()
            },
        ),
        (
            "status=history",
            RequestQuery {
                states: StateFilter::NotIn(live),
                ..base.clone()
            },
        ),
        (
            "target.repo",
            RequestQuery {
                target: vec![("repo".to_owned(), vec![format!("repo-{}", size % 100)])],
                ..base
            },
        ),
    ]
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn p99(times: &mut [Duration]) -> Duration {
    times.sort();
    times[(times.len() * 99 / 100).min(times.len() - 1)]
}

async fn pages(repeats: usize, largest: u64) {
    let mut sizes: Vec<u64> = [1_000].into_iter().filter(|n| *n < largest).collect();
    sizes.push(largest);
    let dir = tempfile::tempdir().unwrap();
    let db = SqliteStore::open(dir.path()).unwrap();
    let mut conn = rusqlite::Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
    conn.pragma_update(None, "synchronous", "OFF").unwrap();
    println!(
        "request pages: one client's demo.request operations, 1 in {PENDING_EVERY} pending; \
         pages of {LIMIT}; {repeats} timed calls per shape and size"
    );
    let mut loaded = 0;
    let mut results: Vec<(u64, Vec<(&str, Duration)>)> = Vec::new();
    for &size in &sizes {
        grow(&mut conn, loaded, size);
        loaded = size;
        let mut row = Vec::new();
        let agent = PageQuery {
            limit: LIMIT,
            ..PageQuery::default()
        };
        let mut times = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            let start = Instant::now();
            let page = db.list_page(CLIENT, agent.clone()).await.unwrap();
            times.push(start.elapsed());
            assert_eq!(page.len(), LIMIT as usize);
        }
        row.push(("baseline: agent first page", median(&mut times)));
        for (name, query) in shapes(size) {
            let mut times = Vec::with_capacity(repeats);
            for _ in 0..repeats {
                let start = Instant::now();
                let page = db.request_page(query.clone()).await.unwrap();
                times.push(start.elapsed());
                assert!(!page.is_empty(), "{name} at {size}");
            }
            row.push((name, median(&mut times)));
            if size == largest {
                let plan = db.explain_request_page(query).await.unwrap();
                println!("  plan of {name}: {}", plan.join(" / "));
                assert!(
                    plan.iter().any(|step| step.contains("operations_requests")),
                    "{name} walks no request index: {plan:?}"
                );
            }
        }
        results.push((size, row));
    }
    println!(
        "{:<28} {:>12} {:>12} {:>8}",
        "shape", "1k", "largest", "ratio"
    );
    let (first, last) = (&results[0].1, &results[results.len() - 1].1);
    for ((name, small), (_, large)) in first.iter().zip(last) {
        println!(
            "{name:<28} {:>12?} {:>12?} {:>8.2}",
            small,
            large,
            large.as_secs_f64() / small.as_secs_f64()
        );
    }
}

async fn decisions(count: usize, concurrency: usize) {
    let dir = tempfile::tempdir().unwrap();
    let secrets = Secrets::parse("agent = agent-secret\nflood = flood-secret\n").unwrap();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let n = 2 * count + 10;
    // The flooding client has one token a minute; the agent's limits never bind.
    let limits = format!(
        r#"{{"requests_per_window": 1000000, "window_seconds": 1, "client_active": {n},
            "client_pending": {n}, "global_active": {n}, "global_executing": 1,
            "clients": {{"flood": {{"requests_per_window": 1, "window_seconds": 60,
                                    "active": 1, "pending": 1}}}}}}"#
    );
    let config = Config::from_bytes(limits.as_bytes(), identities).unwrap();
    let settings = BrokerSettings {
        config,
        storage_caps: StorageCaps {
            grant_client: n as u64,
            grant_global: n as u64,
            ..StorageCaps::default()
        },
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().to_owned(),
            secrets,
            Operators::single("bench", OPERATOR_SECRET).unwrap(),
        )
    };
    let (broker, _) = Broker::start(settings).await.unwrap();
    let agent = format!("http://{}", broker.local_addr());
    let ListenAddr::Tcp(operator) = broker.operator_addr().clone() else {
        unreachable!("the bench listens on TCP");
    };
    let operator = format!("http://{operator}");
    let http = reqwest::Client::new();
    let mut ids = Vec::with_capacity(2 * count);
    for i in 0..2 * count {
        let body = json!({"idempotency_key": format!("r-{i}"), "operation": "demo.request",
                          "target": {"repo": "bench"}, "arguments": {}, "reason": "bench"});
        let reply = http
            .post(format!("{agent}/api/agent/v1/operations"))
            .bearer_auth("agent-secret")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 202);
        let reply: serde_json::Value = reply.json().await.unwrap();
        ids.push(reply["id"].as_str().unwrap().to_owned());
    }
    let decide = async |id: &str| {
        let start = Instant::now();
        let reply = http
            .post(format!("{operator}/api/operator/v1/requests/{id}/deny"))
            .bearer_auth(OPERATOR_SECRET)
            .json(&json!({"expected_revision": 1, "idempotency_key": "bench"}))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
        let _ = reply.bytes().await;
        start.elapsed()
    };
    let mut quiet = Vec::with_capacity(count);
    for id in &ids[..count] {
        quiet.push(decide(id).await);
    }
    // The flood: the client's one token is spent first, so every submission after is refused.
    let stop = Arc::new(AtomicBool::new(false));
    let refused = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for c in 0..concurrency {
        let (stop, refused, agent) = (Arc::clone(&stop), Arc::clone(&refused), agent.clone());
        flooders.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let body = json!({"idempotency_key": format!("f-{c}-{i}"), "operation": "demo.run",
                                  "target": {}, "arguments": {}, "reason": "flood"});
                i += 1;
                if let Ok(reply) = http
                    .post(format!("{agent}/api/agent/v1/operations"))
                    .bearer_auth("flood-secret")
                    .json(&body)
                    .send()
                    .await
                    && reply.status() == 429
                {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let flood_start = Instant::now();
    let before = refused.load(Ordering::Relaxed);
    let mut flooded = Vec::with_capacity(count);
    for id in &ids[count..] {
        flooded.push(decide(id).await);
    }
    let refusals = refused.load(Ordering::Relaxed) - before;
    let rate = refusals as f64 / flood_start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for flooder in flooders {
        let _ = flooder.await;
    }
    assert!(refusals > 0, "the flood was refused nothing");
    let drift = broker.check_drift().await.unwrap();
    assert!(drift.is_clean(), "{drift:?}");
    broker.shutdown().await;
    let (qm, fm) = (median(&mut quiet), median(&mut flooded));
    let (q99, f99) = (p99(&mut quiet), p99(&mut flooded));
    println!(
        "\ndecisions (deny, one at a time, {count} per phase); flood: {concurrency} connections, \
         {rate:.0} refusals/s during the flooded phase"
    );
    println!("{:<24} {:>12} {:>12}", "phase", "median", "p99");
    println!("{:<24} {:>12?} {:>12?}", "baseline: no flood", qm, q99);
    println!("{:<24} {:>12?} {:>12?}", "refusal flood", fm, f99);
    println!(
        "flooded/quiet: median {:.2}x, p99 {:.2}x",
        fm.as_secs_f64() / qm.as_secs_f64(),
        f99.as_secs_f64() / q99.as_secs_f64()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let largest = env("OPERATOR_ROWS", if full { 100_000 } else { 2_000 });
    let repeats = env("OPERATOR_REPEATS", if full { 200 } else { 10 }) as usize;
    let count = env("OPERATOR_DECISIONS", if full { 200 } else { 10 }) as usize;
    let concurrency = env("FLOOD_CONCURRENCY", 16) as usize;
    pages(repeats, largest).await;
    decisions(count, concurrency).await;
}
