//! Whether a listing page costs the same with a thousand operations as with a million: one
//! client's operations are bulk-inserted straight into the SQLite file (one transaction per step),
//! and at 1,000, 10,000, 100,000 and 1,000,000 rows `SqliteStore::list_page` (what
//! `GET /api/agent/v1/operations` runs) is timed for four page shapes: the first page, the last
//! page (a cursor at the oldest operations), the first page filtered by state, and the recovery
//! lookup by idempotency key. Medians and the 1M/1k ratio are printed, with SQLite's plan.
//!
//! `cargo bench --bench list_pages` (release build). `LIST_ROWS` (default 1000000) is the largest
//! size and `LIST_REPEATS` (default 200) the timed calls per shape and size. Under `cargo test` it
//! runs a short smoke version (up to 5,000 rows) with the same assertions.

use std::time::{Duration, Instant};

use unyolo_admission::OperationState;
use unyolo_admission_broker::store::SqliteStore;
use unyolo_admission_broker::store::{DATABASE_FILE, PageQuery};

const CLIENT: &str = "agent";
/// The contract's largest page.
const LIMIT: u32 = 50;
/// One operation in this many is pending; the rest succeeded.
const PENDING_EVERY: u64 = 10;

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

/// Inserts operations `from..to` (rowids `from + 1..=to`) in one transaction.
fn grow(conn: &mut rusqlite::Connection, from: u64, to: u64) {
    let tx = conn.transaction().unwrap();
    {
        let mut insert = tx
            .prepare(
                "INSERT INTO operations (id, client_id, idempotency_key, operation, target, \
                 arguments, reason, state, created_at, updated_at, terminal_at, revision, \
                 title, summary, request_digest) \
                 VALUES (?1, ?2, ?3, 'demo.run', '{\"repo\":\"unyolo/bench\"}', '{}', \
                 'list bench', ?4, ?5, ?5, ?6, ?7, 'Run the demo on repo=unyolo/bench', \
                 'list bench', ?8)",
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
                    if pending { "pending" } else { "succeeded" },
                    created,
                    (!pending).then_some(&created),
                    if pending { 1 } else { 4 },
                    format!("{i:064x}"),
                ])
                .unwrap();
        }
    }
    tx.commit().unwrap();
}

struct Shape {
    name: &'static str,
    query: PageQuery,
    /// Rows the page must hold.
    rows: usize,
}

fn shapes(size: u64) -> Vec<Shape> {
    vec![
        Shape {
            name: "first page",
            query: PageQuery {
                limit: LIMIT,
                ..PageQuery::default()
            },
            rows: LIMIT as usize,
        },
        Shape {
            name: "last page",
            query: PageQuery {
                before: Some(i64::from(LIMIT) + 1),
                limit: LIMIT,
                ..PageQuery::default()
            },
            rows: LIMIT as usize,
        },
        Shape {
            name: "state=pending",
            query: PageQuery {
                state: Some(OperationState::Pending),
                limit: LIMIT,
                ..PageQuery::default()
            },
            rows: LIMIT as usize,
        },
        Shape {
            name: "idempotency_key",
            query: PageQuery {
                idempotency_key: Some(format!("key-{}", size / 2)),
                limit: 1,
                ..PageQuery::default()
            },
            rows: 1,
        },
    ]
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let largest = env("LIST_ROWS", if full { 1_000_000 } else { 5_000 });
    let repeats = env("LIST_REPEATS", if full { 200 } else { 20 }) as usize;
    let mut sizes: Vec<u64> = [1_000, 10_000, 100_000, 1_000_000]
        .into_iter()
        .filter(|n| *n < largest)
        .collect();
    sizes.push(largest);

    let dir = tempfile::tempdir().unwrap();
    let db = SqliteStore::open(dir.path()).unwrap();
    let mut conn = rusqlite::Connection::open(dir.path().join(DATABASE_FILE)).unwrap();
    // Loading only: the timed reads are on the broker's own reader connections.
    conn.pragma_update(None, "synchronous", "OFF").unwrap();
    println!(
        "one client's operations, 1 in {PENDING_EVERY} pending; pages of {LIMIT}; \
         {repeats} timed calls per shape and size"
    );

    let mut medians: Vec<(u64, Vec<Duration>)> = Vec::new();
    let mut loaded = 0;
    for &size in &sizes {
        let started = Instant::now();
        grow(&mut conn, loaded, size);
        loaded = size;
        let load_took = started.elapsed();
        let mut row = Vec::new();
        for shape in shapes(size) {
            let check = db.list_page(CLIENT, shape.query.clone()).await.unwrap();
            assert_eq!(check.len(), shape.rows, "{} at {size}", shape.name);
            assert!(check.windows(2).all(|w| w[0].0 > w[1].0), "newest first");
            match shape.name {
                "first page" => assert_eq!(check[0].0, size as i64),
                "last page" => assert_eq!(check[LIMIT as usize - 1].0, 1),
                "state=pending" => assert!(
                    check
                        .iter()
                        .all(|(_, r)| r.state == OperationState::Pending)
                ),
                _ => assert_eq!(check[0].1.idempotency_key, format!("key-{}", size / 2)),
            }
            if size == sizes[0] {
                let plan = db.explain_page(shape.query.clone()).await.unwrap();
                println!("  plan of {:<16} {}", shape.name, plan.join(" / "));
            }
            let mut times = Vec::with_capacity(repeats);
            for _ in 0..repeats {
                let t = Instant::now();
                let page = db.list_page(CLIENT, shape.query.clone()).await.unwrap();
                times.push(t.elapsed());
                assert_eq!(page.len(), shape.rows);
            }
            row.push(median(&mut times));
        }
        println!(
            "{size:>9} rows (loaded in {load_took:>8.2?}): {}",
            shapes(size)
                .iter()
                .zip(&row)
                .map(|(s, m)| format!("{} {m:>9.2?}", s.name))
                .collect::<Vec<_>>()
                .join("  ")
        );
        medians.push((size, row));
    }
    let (first, last) = (&medians[0], &medians[medians.len() - 1]);
    println!(
        "median ratio {} rows / {} rows: {}",
        last.0,
        first.0,
        shapes(last.0)
            .iter()
            .zip(first.1.iter().zip(&last.1))
            .map(|(s, (a, b))| format!("{} {:.2}x", s.name, b.as_secs_f64() / a.as_secs_f64()))
            .collect::<Vec<_>>()
            .join("  ")
    );
}
