//! Shared admission on one local `redis-server`: decisions per second and latency per decision
//! with 1, 2, 3 and 4 replicas (each its own connection and tasks), beside a baseline in the same
//! run — a rate-only GCRA script on the same connections, the least any Redis decision costs.
//!
//! One decision is one `admit` (one script: rate, client and global counts, pending grants, the
//! idempotency record); each admitted operation is then released (a second script, not timed as
//! a decision), so the counts stay level. Not run in CI: `cargo bench --bench
//! redis`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::ConnectionManager;
use unyolo_admission::config::{Identity, Limits};
use unyolo_admission::redis::{RATE_ONLY, RedisController, RedisOptions};
use unyolo_admission::{Config, StorageCaps};

const TASKS_PER_REPLICA: usize = 4;
const RUN: Duration = Duration::from_secs(3);
const CLIENTS: usize = 16;

fn config() -> Config {
    let identities: Vec<Identity> = (0..CLIENTS)
        .map(|i| Identity::new(&format!("bench-{i}")).unwrap())
        .collect();
    let limits = Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active: 1000,
        client_pending: 1000,
        global_active: 100_000,
        global_executing: 1000,
    };
    Config::new(limits, BTreeMap::new(), identities).unwrap()
}

struct Figures {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn figures(mut latencies: Vec<Duration>, elapsed: Duration) -> Figures {
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q) as usize];
    Figures {
        per_sec: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

async fn admissions(url: &str, replicas: usize, prefix: &str) -> Figures {
    let mut controllers = Vec::new();
    for r in 0..replicas {
        let mut options = RedisOptions::new(url, format!("bench-r{r}"));
        options.prefix = prefix.to_owned();
        options.caps = StorageCaps {
            grant_global: 100_000,
            grant_client: 1000,
            ..StorageCaps::default()
        };
        let controller = RedisController::connect(config(), options).await.unwrap();
        controller.register(Vec::new()).await.unwrap();
        controllers.push(controller);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (r, controller) in controllers.iter().enumerate() {
        for t in 0..TASKS_PER_REPLICA {
            let controller = controller.clone();
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0usize;
                while start.elapsed() < RUN {
                    let client = format!("bench-{}", (r * TASKS_PER_REPLICA + t + n) % CLIENTS);
                    let id = format!("{r}-{t}-{n}");
                    let key = format!("k-{id}");
                    let began = Instant::now();
                    let permit = controller
                        .admit(&client, n.is_multiple_of(2), &id, Some(&key))
                        .await
                        .expect("roomy limits admit");
                    latencies.push(began.elapsed());
                    permit.commit().fail().await.unwrap();
                    n += 1;
                }
                latencies
            }));
        }
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed();
    for controller in &controllers {
        assert!(controller.flush().await);
    }
    assert!(controllers[0].counts().await.unwrap().is_idle());
    figures(all, elapsed)
}

async fn rate_only(url: &str, replicas: usize) -> Figures {
    let script = Arc::new(Script::new(RATE_ONLY));
    let mut conns = Vec::new();
    for _ in 0..replicas {
        let client = redis::Client::open(url).unwrap();
        conns.push(ConnectionManager::new(client).await.unwrap());
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (r, conn) in conns.iter().enumerate() {
        for t in 0..TASKS_PER_REPLICA {
            let mut conn = conn.clone();
            let script = Arc::clone(&script);
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0usize;
                while start.elapsed() < RUN {
                    let key = format!("{{rate}}:tat:{}", (r * TASKS_PER_REPLICA + t + n) % CLIENTS);
                    let began = Instant::now();
                    let taken: i64 = script
                        .key(key)
                        .arg(1u64)
                        .arg(1_000_000u64)
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    latencies.push(began.elapsed());
                    assert_eq!(taken, 1);
                    n += 1;
                }
                latencies
            }));
        }
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    figures(all, start.elapsed())
}

fn main() {
    let Some(server) = support::redis::RedisServer::start() else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = server.url();
        println!(
            "{:<10} {:>14} {:>10} {:>10} {:>16} {:>10} {:>10} {:>8}",
            "replicas", "admissions/s", "p50", "p99", "rate-only/s", "p50", "p99", "ratio"
        );
        for replicas in [1, 2, 3, 4] {
            let baseline = rate_only(&url, replicas).await;
            let admit = admissions(&url, replicas, &format!("bench{replicas}")).await;
            println!(
                "{:<10} {:>14.0} {:>10.1?} {:>10.1?} {:>16.0} {:>10.1?} {:>10.1?} {:>8.2}",
                replicas,
                admit.per_sec,
                admit.p50,
                admit.p99,
                baseline.per_sec,
                baseline.p50,
                baseline.p99,
                admit.per_sec / baseline.per_sec
            );
        }
    });
}
