//! Shared admission on one local `redis-server`: decisions per second and latency per decision
//! with 1, 2, 3 and 4 replicas (each a replicated `Admission` with its own connection and tasks),
//! beside a baseline in the same run — a rate-only GCRA script on connections of its own, the
//! least any Redis decision costs.
//!
//! One decision is one `Admission::admit`, as a broker replica makes it: one script (rate, client
//! and global counts, pending grants, the idempotency record), then the replica's own engine;
//! each admitted operation is then released (a second script, not timed as a decision), so the
//! counts stay level. Not run in CI: `cargo bench --bench
//! redis`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::ConnectionManager;
use unyolo_admission::config::{Identity, Limits};
use unyolo_admission::redis::RATE_ONLY;
use unyolo_admission::{Admission, Config, Controller, ReplicaOptions, StorageCaps};

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

async fn admissions(url: &str, replica_count: usize, prefix: &str) -> Figures {
    let mut replicas = Vec::new();
    for r in 0..replica_count {
        let mut options = ReplicaOptions::new(url, format!("bench-r{r}"));
        options.prefix = prefix.to_owned();
        // The pending-grant caps are the engine's (`Admission::new` hands them to Redis too).
        let caps = StorageCaps {
            grant_global: 100_000,
            grant_client: 1000,
            ..StorageCaps::default()
        };
        let controller = Controller::builder(config()).storage_caps(caps).build();
        let admission = Admission::new(controller, Some(options)).unwrap();
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        replicas.push(admission);
    }
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (r, admission) in replicas.iter().enumerate() {
        for t in 0..TASKS_PER_REPLICA {
            let admission = admission.clone();
            tasks.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0usize;
                while start.elapsed() < RUN {
                    let client = format!("bench-{}", (r * TASKS_PER_REPLICA + t + n) % CLIENTS);
                    let key = format!("k-{r}-{t}-{n}");
                    let began = Instant::now();
                    let permit = admission
                        .admit(&client, n.is_multiple_of(2), Some(&key))
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
    for admission in &replicas {
        assert!(admission.flush().await);
        assert_eq!(admission.snapshot().dropped_permits, 0);
    }
    assert!(replicas[0].counts().await.unwrap().is_idle());
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
