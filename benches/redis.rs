//! Shared admission on one local `redis-server`: decisions per second and latency per decision
//! with 1, 2, 3 and 4 replicas (each a replicated `Admission` with its own connection and tasks),
//! beside a baseline in the same run — a rate-only GCRA script on connections of its own, the
//! least any Redis decision costs.
//!
//! One decision is one `Admission::admit`, as a broker replica makes it: one decision of the
//! batch script (rate, client and global counts, pending grants, the idempotency record), then
//! the replica's own engine; each admitted operation is then released (a second decision, not
//! timed), so the counts stay level. A replica's decisions waiting at once go to Redis in one
//! script call (its group commit), so the profile also measures a batched lifecycle: what an
//! admission and its release cost Redis when 4 or 16 tasks share a replica; and the throughput
//! group runs at 4 and at 16 tasks per replica, the baseline at the same concurrency, each row
//! as three alternated one-second rounds of both, their medians compared (`rounds` is the
//! lowest and highest ratio of one round's pair). The last three columns say what bounds a row,
//! from Redis's own accounting over the median rounds (`INFO cpu`, `INFO commandstats`): the
//! share of a core Redis used and its CPU time per lifecycle and per rate-only call, then
//! lifecycles per script call. A Redis near a whole core is the bound (the ratio is then the
//! inverse of its CPU times' ratio); one well below it leaves the round trips as the bound.
//! The figures come from
//! `cargo bench --bench redis` (`-- --profile-only` for the profile alone); `cargo test
//! --all-targets`, and so CI, runs it once more in a debug build, as a smoke test whose figures
//! mean nothing.

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
/// The throughput group runs each row's baseline and lifecycles `ROUNDS` times for `ROUND` each,
/// alternating which goes first, and compares their medians: this VM's speed drifts by 10-20%
/// from one second to the next, and a single pair of runs put that drift into the ratio.
const ROUNDS: usize = 3;
const ROUND: Duration = Duration::from_secs(1);
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
    /// Redis's own CPU time over the run (its `INFO cpu`, user and system, every thread), per
    /// decision timed: per lifecycle, or per rate-only call.
    redis_micros: f64,
    /// The share of one core Redis used over the run.
    redis_busy: f64,
    /// Decisions timed per script call Redis ran over the run (lifecycles per call of the batch
    /// script; 1 for the rate-only script), heartbeats and registrations included.
    per_call: f64,
}

/// What Redis has done so far: its CPU time (s) and its script calls.
struct Reading {
    cpu: f64,
    calls: u64,
}

async fn reading(conn: &mut ConnectionManager) -> Reading {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .unwrap();
    let field = |key: &str| -> f64 {
        info.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("INFO cpu has no {key}: {info}"))
    };
    Reading {
        cpu: field("used_cpu_user") + field("used_cpu_sys"),
        calls: script_calls(conn).await,
    }
}

/// The round with the median throughput (its latencies with it).
fn median(mut rounds: Vec<Figures>) -> Figures {
    rounds.sort_by(|a, b| a.per_sec.total_cmp(&b.per_sec));
    rounds.swap_remove(rounds.len() / 2)
}

fn figures(
    mut latencies: Vec<Duration>,
    elapsed: Duration,
    before: Reading,
    after: Reading,
) -> Figures {
    latencies.sort_unstable();
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q) as usize];
    let decisions = latencies.len() as f64;
    let cpu = after.cpu - before.cpu;
    Figures {
        per_sec: decisions / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        redis_micros: cpu * 1e6 / decisions,
        redis_busy: cpu / elapsed.as_secs_f64(),
        per_call: decisions / after.calls.saturating_sub(before.calls).max(1) as f64,
    }
}

async fn admissions(
    url: &str,
    replica_count: usize,
    tasks: usize,
    prefix: &str,
    wait_replicas: u32,
    run: Duration,
) -> Figures {
    let mut replicas = Vec::new();
    // Every replica is told the whole fleet: they admit as soon as all have registered, not one
    // lease period after the deployment's first start.
    let fleet: Vec<String> = (0..replica_count).map(|r| format!("bench-r{r}")).collect();
    for name in &fleet {
        let mut options = ReplicaOptions::new(url, name);
        options.replicas = fleet.clone();
        options.prefix = prefix.to_owned();
        options.wait_replicas = wait_replicas;
        // As many of one client's decisions in flight as tasks, as the rate-only baseline has:
        // this group measures Redis, not the per-client bound (default 1).
        options.client_decisions_in_flight = tasks;
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
    let mut stats = ConnectionManager::new(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let before = reading(&mut stats).await;
    let start = Instant::now();
    let mut running = Vec::new();
    for (r, admission) in replicas.iter().enumerate() {
        for t in 0..tasks {
            let admission = admission.clone();
            running.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0usize;
                while start.elapsed() < run {
                    let client = format!("bench-{}", (r * tasks + t + n) % CLIENTS);
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
    for task in running {
        all.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed();
    let after = reading(&mut stats).await;
    for admission in &replicas {
        assert!(admission.flush().await);
        assert_eq!(admission.snapshot().dropped_permits, 0);
    }
    assert!(replicas[0].counts().await.unwrap().is_idle());
    figures(all, elapsed, before, after)
}

async fn rate_only(url: &str, replicas: usize, tasks: usize, run: Duration) -> Figures {
    let script = Arc::new(Script::new(RATE_ONLY));
    let mut conns = Vec::new();
    for _ in 0..replicas {
        let client = redis::Client::open(url).unwrap();
        conns.push(ConnectionManager::new(client).await.unwrap());
    }
    let mut stats = ConnectionManager::new(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let before = reading(&mut stats).await;
    let start = Instant::now();
    let mut running = Vec::new();
    for (r, conn) in conns.iter().enumerate() {
        for t in 0..tasks {
            let mut conn = conn.clone();
            let script = Arc::clone(&script);
            running.push(tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0usize;
                while start.elapsed() < run {
                    let key = format!("{{rate}}:tat:{}", (r * tasks + t + n) % CLIENTS);
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
    for task in running {
        all.extend(task.await.unwrap());
    }
    let elapsed = start.elapsed();
    let after = reading(&mut stats).await;
    figures(all, elapsed, before, after)
}

/// `INFO commandstats` as (command, calls, usec) rows, e.g. `("evalsha", 2000, 41000)`.
async fn commandstats(conn: &mut ConnectionManager) -> Vec<(String, u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |key: &str| -> Option<u64> {
                rest.split(',')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?
                    .parse()
                    .ok()
            };
            Some((name.to_owned(), field("calls")?, field("usec")?))
        })
        .collect()
}

/// Zeroes `INFO commandstats` and the slow log, which from now on logs every call (until
/// [`cost`] reads it).
async fn reset_stats(conn: &mut ConnectionManager) {
    commands(
        conn,
        &[
            &["CONFIG", "SET", "slowlog-log-slower-than", "0"],
            &["CONFIG", "SET", "slowlog-max-len", "10000"],
            &["SLOWLOG", "RESET"],
            &["CONFIG", "RESETSTAT"],
        ],
    )
    .await;
}

/// Runs each command in turn (each must succeed).
async fn commands(conn: &mut ConnectionManager, all: &[&[&str]]) {
    for args in all {
        let _: () = redis::cmd(args[0])
            .arg(&args[1..])
            .query_async(conn)
            .await
            .unwrap();
    }
}

/// The script calls' durations (µs) in the slow log: its median and its largest.
async fn slowlog(conn: &mut ConnectionManager) -> (u64, u64) {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(10000)
        .query_async(conn)
        .await
        .unwrap();
    let mut micros: Vec<u64> = entries
        .iter()
        .filter_map(|entry| match entry {
            redis::Value::Array(fields) => match (fields.get(2), fields.get(3)) {
                (Some(redis::Value::Int(us)), Some(redis::Value::Array(args))) => {
                    let is_script = matches!(args.first(), Some(redis::Value::BulkString(a))
                        if a.eq_ignore_ascii_case(b"evalsha") || a.eq_ignore_ascii_case(b"eval"));
                    is_script.then_some(*us as u64)
                }
                _ => None,
            },
            _ => None,
        })
        .collect();
    micros.sort_unstable();
    (
        micros.get(micros.len() / 2).copied().unwrap_or(0),
        micros.last().copied().unwrap_or(0),
    )
}

/// What one kind of script call cost Redis, from `INFO commandstats` after `calls` of them:
/// µs per script call, and the Redis commands each made.
struct ScriptCost {
    usec_per_call: f64,
    commands_per_call: f64,
    slowlog_p50: u64,
    slowlog_max: u64,
}

async fn cost(conn: &mut ConnectionManager, calls: usize) -> ScriptCost {
    let stats = commandstats(conn).await;
    let (script_calls, usec) = stats
        .iter()
        .filter(|(name, ..)| name == "evalsha" || name == "eval")
        .fold((0, 0), |(c, u), (_, calls, usec)| (c + calls, u + usec));
    let inner: u64 = stats
        .iter()
        .filter(|(name, ..)| !matches!(name.as_str(), "evalsha" | "eval" | "info" | "config"))
        .map(|(_, calls, _)| calls)
        .sum();
    assert!(
        script_calls >= calls as u64 && script_calls > 0,
        "{script_calls} script calls for {calls}"
    );
    let (slowlog_p50, slowlog_max) = slowlog(conn).await;
    // Logging every call costs Redis time of its own (an entry copied, another freed, per
    // call): off again, at its default, before anything else is measured.
    commands(
        conn,
        &[
            &["CONFIG", "SET", "slowlog-log-slower-than", "10000"],
            &["SLOWLOG", "RESET"],
        ],
    )
    .await;
    ScriptCost {
        usec_per_call: usec as f64 / script_calls as f64,
        commands_per_call: inner as f64 / script_calls as f64,
        slowlog_p50,
        slowlog_max,
    }
}

/// What each script costs Redis itself (`INFO commandstats`, `usec_per_call`), one kind of call
/// at a time on one replica (each a batch of one): an admission admitted, its release (a
/// transition), an admission refused by Redis (memory off: every one reaches Redis), and the
/// rate-only script; then lifecycles from four tasks at once, batched by the group commit.
async fn profile(url: &str) {
    const CALLS: usize = 2000;
    let mut options = ReplicaOptions::new(url, "profile-r0");
    // The whole deployment (it admits once registered, not a lease period later).
    options.replicas = vec!["profile-r0".to_owned()];
    options.prefix = "profile".to_owned();
    // No beat during a phase: its scripts would be counted with the phase's.
    options.lease_ttl = Duration::from_secs(120);
    options.heartbeat = Duration::from_secs(60);
    // The batched phase's tasks may each have a decision in flight, as in the throughput group.
    options.client_decisions_in_flight = 4 * TASKS_PER_REPLICA;
    let caps = StorageCaps {
        grant_global: 100_000,
        grant_client: 1000,
        ..StorageCaps::default()
    };
    let controller = Controller::builder(config()).storage_caps(caps).build();
    let admission = Admission::new(controller, Some(options)).unwrap();
    assert!(admission.restore(Vec::new()).await.deferred.is_none());
    // Slow-log readings are large: a generous reply timeout.
    let mut conn = ConnectionManager::new_with_config(
        redis::Client::open(url).unwrap(),
        redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(30))),
    )
    .await
    .unwrap();
    let mut rows = Vec::new();

    reset_stats(&mut conn).await;
    let mut live = Vec::new();
    for n in 0..CALLS {
        let client = format!("bench-{}", n % CLIENTS);
        let permit = admission
            .admit(&client, n.is_multiple_of(2), Some(&format!("p-{n}")))
            .await
            .unwrap();
        live.push(permit.commit());
    }
    rows.push(("admit (admitted)", cost(&mut conn, CALLS).await));

    reset_stats(&mut conn).await;
    for operation in &live {
        operation.fail().await.unwrap();
    }
    rows.push(("transition (release)", cost(&mut conn, CALLS).await));

    // The lifecycle as the throughput group runs it (4 tasks, then 16, each admitting and
    // releasing), so the replica's group commit batches what is waiting: the cost per script
    // call, and per lifecycle (an admission and its release).
    let mut batched = Vec::new();
    for tasks in [TASKS_PER_REPLICA, 4 * TASKS_PER_REPLICA] {
        reset_stats(&mut conn).await;
        let mut running = Vec::new();
        for t in 0..tasks {
            let admission = admission.clone();
            running.push(tokio::spawn(async move {
                for n in 0..CALLS / tasks {
                    let client = format!("bench-{}", (t + n) % CLIENTS);
                    let permit = admission
                        .admit(
                            &client,
                            n.is_multiple_of(2),
                            Some(&format!("b{tasks}-{t}-{n}")),
                        )
                        .await
                        .unwrap();
                    permit.commit().fail().await.unwrap();
                }
            }));
        }
        for task in running {
            task.await.unwrap();
        }
        let cost = cost(&mut conn, 0).await;
        batched.push((tasks, script_calls(&mut conn).await, cost));
    }

    // One client at its active limit: every admission is refused by Redis.
    let tight = Admission::new(
        Controller::new(tight_config()),
        Some({
            let mut options = ReplicaOptions::new(url, "profile-tight");
            options.replicas = vec!["profile-tight".to_owned()];
            options.prefix = "profile-tight".to_owned();
            options.lease_ttl = Duration::from_secs(120);
            options.heartbeat = Duration::from_secs(60);
            options.refusal_memory = false;
            options
        }),
    )
    .unwrap();
    assert!(tight.restore(Vec::new()).await.deferred.is_none());
    let held = tight.admit("bench-0", false, None).await.unwrap().commit();
    reset_stats(&mut conn).await;
    for _ in 0..CALLS {
        assert!(tight.admit("bench-0", false, None).await.is_err());
    }
    rows.push(("admit (refused)", cost(&mut conn, CALLS).await));
    held.fail().await.unwrap();

    let script = Script::new(RATE_ONLY);
    reset_stats(&mut conn).await;
    for n in 0..CALLS {
        let _: i64 = script
            .key(format!("{{rate}}:tat:p{}", n % CLIENTS))
            .arg(1u64)
            .arg(1_000_000u64)
            .invoke_async(&mut conn)
            .await
            .unwrap();
    }
    rows.push(("rate-only", cost(&mut conn, CALLS).await));

    // The rate-only script at the batched phases' concurrency (one connection, as the replica
    // has): Redis runs calls that arrive together back to back, warmer than one at a time, so
    // this is the like-for-like baseline for a batched lifecycle.
    let mut concurrent = Vec::new();
    for tasks in [TASKS_PER_REPLICA, 4 * TASKS_PER_REPLICA] {
        reset_stats(&mut conn).await;
        let mut running = Vec::new();
        for t in 0..tasks {
            let mut conn = conn.clone();
            running.push(tokio::spawn(async move {
                let script = Script::new(RATE_ONLY);
                for n in 0..CALLS / tasks {
                    let _: i64 = script
                        .key(format!("{{rate}}:tat:q{}", (t + n) % CLIENTS))
                        .arg(1u64)
                        .arg(1_000_000u64)
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                }
            }));
        }
        for task in running {
            task.await.unwrap();
        }
        concurrent.push(cost(&mut conn, CALLS).await.usec_per_call);
    }

    println!(
        "{:<22} {:>14} {:>18} {:>12} {:>12}",
        "script", "usec_per_call", "commands_per_call", "slowlog p50", "slowlog max"
    );
    let rate_only_usec = rows.last().map_or(0.0, |(_, c)| c.usec_per_call);
    for (name, cost) in rows {
        println!(
            "{:<22} {:>14.2} {:>18.1} {:>10} µs {:>9} µs",
            name, cost.usec_per_call, cost.commands_per_call, cost.slowlog_p50, cost.slowlog_max
        );
    }
    // Two decisions per lifecycle (its admission and its release).
    for ((tasks, calls, cost), rate_only_together) in batched.into_iter().zip(concurrent) {
        let per_call = 2.0 * CALLS as f64 / calls as f64;
        let lifecycle_usec = cost.usec_per_call * calls as f64 / CALLS as f64;
        println!(
            "batched lifecycle, {tasks} tasks: {calls} script calls for {CALLS} lifecycles \
             ({per_call:.2} decisions/call), {:.2} µs and {:.1} commands per call, \
             {lifecycle_usec:.2} µs per lifecycle = {:.2}x the lone rate-only call's cost, \
             {:.2}x its cost at {tasks} tasks ({rate_only_together:.2} µs)",
            cost.usec_per_call,
            cost.commands_per_call,
            rate_only_usec / lifecycle_usec,
            rate_only_together / lifecycle_usec
        );
    }
    admission.shutdown().await;
    tight.shutdown().await;
}

/// The bench's clients, each allowed one live operation.
fn tight_config() -> Config {
    let identities: Vec<Identity> = (0..CLIENTS)
        .map(|i| Identity::new(&format!("bench-{i}")).unwrap())
        .collect();
    let limits = Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active: 1,
        client_pending: 1,
        global_active: 100_000,
        global_executing: 1000,
    };
    Config::new(limits, BTreeMap::new(), identities).unwrap()
}

/// A refusal flood: one client at its limit, `TASKS_PER_REPLICA` tasks per replica submitting
/// as fast as they can for `RUN`; refusals per second per replica, and script calls per refusal
/// (`INFO commandstats`), with the refusal memory on or off.
async fn refusal_flood(
    url: &str,
    replica_count: usize,
    memory: bool,
    conn: &mut ConnectionManager,
) -> (f64, f64) {
    let mut replicas = Vec::new();
    let fleet: Vec<String> = (0..replica_count).map(|r| format!("flood-r{r}")).collect();
    for name in &fleet {
        let mut options = ReplicaOptions::new(url, name);
        options.replicas = fleet.clone();
        options.prefix = format!("flood{replica_count}{memory}");
        options.refusal_memory = memory;
        // The flood's tasks queue for their client's one decision in flight; on a loaded
        // machine they may wait long, and this group counts refusals, not waits.
        options.decision_wait = Duration::from_secs(10);
        let admission = Admission::new(Controller::new(tight_config()), Some(options)).unwrap();
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        while memory && !admission.stats().notices_live {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        replicas.push(admission);
    }
    let held = replicas[0]
        .admit("bench-0", false, None)
        .await
        .unwrap()
        .commit();
    let before = script_calls(conn).await;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for admission in &replicas {
        for _ in 0..TASKS_PER_REPLICA {
            let admission = admission.clone();
            tasks.push(tokio::spawn(async move {
                let mut refused = 0u64;
                while start.elapsed() < RUN {
                    match admission.admit("bench-0", false, None).await {
                        Err(unyolo_admission::AdmitError::Refused(_)) => refused += 1,
                        // Redis too slow on a loaded machine: not a refusal, not counted.
                        Err(unyolo_admission::AdmitError::Unavailable(_)) => {}
                        other => panic!("{other:?}"),
                    }
                }
                refused
            }));
        }
    }
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    let elapsed = start.elapsed();
    let calls = script_calls(conn).await - before;
    held.fail().await.unwrap();
    for admission in &replicas {
        admission.shutdown().await;
    }
    (
        refused as f64 / elapsed.as_secs_f64() / replica_count as f64,
        calls as f64 / refused as f64,
    )
}

async fn script_calls(conn: &mut ConnectionManager) -> u64 {
    commandstats(conn)
        .await
        .iter()
        .filter(|(name, ..)| name == "evalsha" || name == "eval")
        .map(|(_, calls, _)| calls)
        .sum()
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
        profile(&url).await;
        if std::env::args().any(|a| a == "--profile-only") {
            return;
        }
        // Each at the same concurrency as its baseline: 4 tasks per replica, then 16 (where a
        // replica's group commit has more waiting to batch).
        for tasks in [TASKS_PER_REPLICA, 4 * TASKS_PER_REPLICA] {
            println!(
                "{:<13} {:>14} {:>10} {:>10} {:>16} {:>10} {:>10} {:>8} {:>10} {:>12} {:>16} {:>9}",
                format!("replicas×{tasks}"),
                "admissions/s",
                "p50",
                "p99",
                "rate-only/s",
                "p50",
                "p99",
                "ratio",
                "rounds",
                "Redis busy",
                "Redis µs each",
                "per call"
            );
            for replicas in [1, 2, 3, 4] {
                let (mut baselines, mut admits) = (Vec::new(), Vec::new());
                for round in 0..ROUNDS {
                    // A deployment per round: its idempotency keys are new.
                    let prefix = format!("bench{replicas}x{tasks}r{round}");
                    if round % 2 == 1 {
                        admits.push(admissions(&url, replicas, tasks, &prefix, 0, ROUND).await);
                    }
                    baselines.push(rate_only(&url, replicas, tasks, ROUND).await);
                    if round % 2 == 0 {
                        admits.push(admissions(&url, replicas, tasks, &prefix, 0, ROUND).await);
                    }
                }
                let spread = |f: &[Figures], g: &[Figures]| {
                    let ratios = f.iter().zip(g).map(|(a, b)| a.per_sec / b.per_sec);
                    ratios.fold((f64::MAX, 0f64), |(lo, hi), r| (lo.min(r), hi.max(r)))
                };
                let (low, high) = spread(&admits, &baselines);
                let admit = median(admits);
                let baseline = median(baselines);
                println!(
                    "{:<13} {:>14.0} {:>10.1?} {:>10.1?} {:>16.0} {:>10.1?} {:>10.1?} {:>8.2} {:>5.2}-{:.2} {:>12} {:>16} {:>9.1}",
                    replicas,
                    admit.per_sec,
                    admit.p50,
                    admit.p99,
                    baseline.per_sec,
                    baseline.p50,
                    baseline.p99,
                    admit.per_sec / baseline.per_sec,
                    low,
                    high,
                    format!(
                        "{:.0}% / {:.0}%",
                        admit.redis_busy * 100.0,
                        baseline.redis_busy * 100.0
                    ),
                    format!("{:.1} / {:.1}", admit.redis_micros, baseline.redis_micros),
                    admit.per_call
                );
            }
        }
        // The cost of answering only what a Redis replica holds (`wait_replicas`): one replica,
        // with and without WAIT, against the same primary with one Redis replica attached.
        let standby = support::redis::RedisServer::start_replica_of(server.port);
        let plain = admissions(&url, 1, TASKS_PER_REPLICA, "wait0", 0, RUN).await;
        let waiting = admissions(&url, 1, TASKS_PER_REPLICA, "wait1", 1, RUN).await;
        println!(
            "{:<22} {:>14} {:>10} {:>10}",
            "1 replica, Redis replica", "admissions/s", "p50", "p99"
        );
        for (name, f) in [("no WAIT", plain), ("WAIT 1", waiting)] {
            println!(
                "{:<22} {:>14.0} {:>10.1?} {:>10.1?}",
                name, f.per_sec, f.p50, f.p99
            );
        }
        drop(standby);
        let mut conn = ConnectionManager::new(redis::Client::open(url.as_str()).unwrap())
            .await
            .unwrap();
        println!(
            "{:<10} {:>22} {:>18} {:>22} {:>18}",
            "replicas",
            "refusals/s/replica",
            "calls/refusal",
            "memory off: refusals/s",
            "calls/refusal"
        );
        for replicas in [1, 2, 3] {
            let (on, on_calls) = refusal_flood(&url, replicas, true, &mut conn).await;
            let (off, off_calls) = refusal_flood(&url, replicas, false, &mut conn).await;
            println!(
                "{:<10} {:>22.0} {:>18.5} {:>22.0} {:>18.3}",
                replicas, on, on_calls, off, off_calls
            );
        }
    });
}
