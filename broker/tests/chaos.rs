//! The chaos run (SPEC section 12; `docs/testing.md` says how to run it for ten minutes): three
//! `admission serve` replicas on a PostgreSQL primary with a synchronous standby (one libpq
//! multi-host URL, `target_session_attrs=read-write`) and a Redis primary with two replicas behind
//! three Sentinels (`redis+sentinel://`, `--redis-wait-replicas 1`), all on loopback. Agents and
//! an operator drive every replica while, at random from a printed seed, replicas are killed and
//! restarted or paused (`SIGSTOP`, 2 to 15 s) and resumed, Redis fails over, and PostgreSQL is
//! restarted or fails over to its standby (a new standby then built on the old primary's port).
//!
//! Afterwards it checks, and prints: every `202` has its row and every key one row (a key
//! answered `503` is retried until answered); no operation ran twice (a run's revision is at most
//! 3, a request's at most 4: created, approved, started, ended); no client was ever above a limit
//! in the store (sampled all along); drift and fleet drift are 0 on every replica within a minute
//! of the run settling; no replica died but those it killed; and the longest pause in admissions
//! after each kind of fault.
//!
//! `CHAOS_SECONDS` (default 45 under `cargo test`: CI's short run, every kind of fault once;
//! the load goes on 5 s past the last fault) and `CHAOS_SEED` (default:
//! from the clock, printed) set the run.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use support::http::request;
use support::postgres::PostgresServer;
use support::redis_ha::SentinelSet;
use support::rng::Rng;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use support::serve::{Files, Server};

/// Limits that bind under the load: the sampler checks the store never holds more.
const LIMITS: &str = r#"{"requests_per_window": 100000, "window_seconds": 60,
  "client_active": 12, "client_pending": 5, "global_active": 20, "global_executing": 4}"#;
const CLIENT_ACTIVE: u64 = 12;
const CLIENT_PENDING: u64 = 5;
const GLOBAL_ACTIVE: u64 = 20;
const GLOBAL_EXECUTING: u64 = 4;

const NAMES: [&str; 3] = ["c1", "c2", "c3"];

/// The faults, each once in every round of the schedule.
const KINDS: [&str; 5] = [
    "replica killed",
    "replica paused",
    "redis failover",
    "postgres restart",
    "postgres failover",
];

/// How long the fleet gets, once the faults stop, for its drift to read 0.
const SETTLE: Duration = Duration::from_secs(60);

/// A submission's answer: its status (0: none, the replica killed or paused under it), the
/// operation's id when created, and the operation submitted with its duration (a retry sends
/// the very same request).
type Answer = (u16, Option<String>, &'static str, u64);

/// One replica's place: its process (none while killed), and whether it is paused.
struct Slot {
    server: Option<Arc<Server>>,
    paused: bool,
}

/// What the run shares between its tasks.
struct Run {
    slots: RwLock<Vec<Slot>>,
    stop: AtomicBool,
    /// Every submission's answer, by key.
    answers: Mutex<BTreeMap<String, Answer>>,
    /// When each `202` was answered.
    admitted: Mutex<Vec<Instant>>,
    /// Each fault: its kind, when it began.
    faults: Mutex<Vec<(&'static str, Instant)>>,
    /// What the sampler saw over a limit.
    over: Mutex<Vec<String>>,
    samples: Mutex<u64>,
}

impl Run {
    /// A replica a load balancer would send to now (running, not paused), at random.
    fn pick(&self, rng: &mut Rng) -> Option<Arc<Server>> {
        let slots = self.slots.read().unwrap();
        let up: Vec<&Arc<Server>> = slots
            .iter()
            .filter(|s| !s.paused)
            .filter_map(|s| s.server.as_ref())
            .collect();
        if up.is_empty() {
            return None;
        }
        Some(Arc::clone(up[(rng.below(up.len()) as u64) as usize]))
    }
}

fn seconds(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The replica named `name`'s flags.
fn args(store: &str, redis: &str, files: &Files, dir: &std::path::Path, name: &str) -> Vec<String> {
    let mut args: Vec<String> = [
        "--store",
        store,
        "--redis",
        redis,
        "--redis-wait-replicas",
        "1",
    ]
    .map(str::to_owned)
    .into();
    args.extend(files.replica_args(dir, name, "c1,c2,c3"));
    args
}

/// An agent of `secret`'s client: submits runs and requests under keys `prefix-N` to replicas
/// picked at random, until the run stops.
async fn agent(run: Arc<Run>, secret: &'static str, prefix: &'static str, seed: u64) {
    let mut rng = Rng((seed) | 1);
    let mut n = 0u64;
    while !run.stop.load(Ordering::Relaxed) {
        let Some(server) = run.pick(&mut rng) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let key = format!("{prefix}-{n}");
        let operation = if (rng.below(3) as u64) == 0 {
            "demo.request"
        } else {
            "demo.run"
        };
        let duration = rng.below(300) as u64;
        let reply = server
            .send(
                reqwest::Method::POST,
                "/api/agent/v1/operations",
                secret,
                Some(request(&key, operation, duration)),
            )
            .await;
        let Ok(reply) = reply else {
            // The replica was killed or paused under the request: the key is retried at the end.
            run.answers
                .lock()
                .unwrap()
                .insert(key, (0, None, operation, duration));
            n += 1;
            continue;
        };
        assert!(
            [202, 429, 503].contains(&reply.status),
            "{key}: {} {:?}",
            reply.status,
            reply.body
        );
        if reply.status == 503 {
            assert!(reply.retry_after().is_some(), "a 503 says when to retry");
        }
        let id = (reply.status == 202).then(|| reply.id());
        if reply.status == 202 {
            run.admitted.lock().unwrap().push(Instant::now());
        }
        run.answers
            .lock()
            .unwrap()
            .insert(key, (reply.status, id, operation, duration));
        n += 1;
        tokio::time::sleep(Duration::from_millis(10 + (rng.below(30) as u64))).await;
    }
}

/// An operator: approves (three in four) or denies the pending requests a replica lists, each
/// against the revision the list showed. A replica killed under a request, a request decided
/// elsewhere meanwhile, or the store away: another time.
async fn operator(run: Arc<Run>, seed: u64) {
    let mut rng = Rng(seed | 1);
    let bearer = format!("Bearer {OPERATOR_SECRET}");
    let mut n = 0u64;
    while !run.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Some(server) = run.pick(&mut rng) else {
            continue;
        };
        let page = server
            .operator
            .try_send_raw(
                "GET",
                "/api/operator/v1/requests?status=pending&limit=20",
                Some(&bearer),
                None,
            )
            .await;
        let Some(page) = page.ok().filter(|p| p.status == 200) else {
            continue;
        };
        let pending: Vec<(String, u64)> = page.body["requests"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| Some((r["id"].as_str()?.to_owned(), r["revision"].as_u64()?)))
            .collect();
        for (id, revision) in pending {
            let action = if rng.below(4) == 0 { "deny" } else { "approve" };
            n += 1;
            let body = serde_json::json!({"expected_revision": revision, "idempotency_key": format!("chaos-{n}")});
            let reply = server
                .operator
                .try_send_raw(
                    "POST",
                    &format!("/api/operator/v1/requests/{id}/{action}"),
                    Some(&bearer),
                    Some(("application/json", body.to_string().into_bytes())),
                )
                .await;
            if let Ok(reply) = reply {
                assert!(
                    [200, 409, 503].contains(&reply.status),
                    "{id}: {} {:?}",
                    reply.status,
                    reply.body
                );
            }
        }
    }
}

/// Reads the store's live counts every 300 ms and keeps every one over a limit.
async fn sampler(run: Arc<Run>, postgres: Arc<RwLock<Pair>>) {
    while !run.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sql = "SELECT coalesce(string_agg(client_id || ' ' || active || ' ' || pending || ' ' || executing, ','), '') FROM (\
            SELECT client_id, count(*) FILTER (WHERE state IN ('pending', 'approved', 'executing')) AS active, \
            count(*) FILTER (WHERE state = 'pending') AS pending, \
            count(*) FILTER (WHERE state = 'executing') AS executing FROM operations GROUP BY client_id) c";
        // The fault loop holds the pair while it fails PostgreSQL over: no sample then.
        let Some(read) = postgres.try_read().ok().and_then(|pair| pair.try_psql(sql)) else {
            continue;
        };
        *run.samples.lock().unwrap() += 1;
        let (mut active, mut executing) = (0, 0);
        for client in read.split(',').filter(|c| !c.is_empty()) {
            let fields: Vec<&str> = client.split(' ').collect();
            let [name, a, p, e] = fields[..] else {
                continue;
            };
            let (a, p, e): (u64, u64, u64) =
                (a.parse().unwrap(), p.parse().unwrap(), e.parse().unwrap());
            active += a;
            executing += e;
            if a > CLIENT_ACTIVE || p > CLIENT_PENDING {
                run.over
                    .lock()
                    .unwrap()
                    .push(format!("{name}: active {a}, pending {p}"));
            }
        }
        if active > GLOBAL_ACTIVE || executing > GLOBAL_EXECUTING {
            run.over
                .lock()
                .unwrap()
                .push(format!("global: active {active}, executing {executing}"));
        }
    }
}

/// The PostgreSQL primary and its standby, which swap roles at a failover.
struct Pair {
    primary: PostgresServer,
    standby: PostgresServer,
}

impl Pair {
    /// `psql` on the fleet's database of the primary, `None` while it does not answer.
    fn try_psql(&self, sql: &str) -> Option<String> {
        self.primary.try_psql("chaos", sql)
    }

    /// The primary killed, the standby promoted, and a new standby of it built in the old
    /// primary's place (its port, so the fleet's multi-host URL names the pair still).
    fn fail_over(&mut self) {
        let old_port = self.primary.port;
        self.primary.kill();
        self.standby.promote();
        let fresh = self.standby.start_standby_on(old_port, true);
        let old = std::mem::replace(&mut self.primary, fresh);
        std::mem::swap(&mut self.primary, &mut self.standby);
        drop(old);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_run_loses_nothing_runs_nothing_twice_and_settles_with_no_drift() {
    let run_for = Duration::from_secs(seconds("CHAOS_SECONDS", 45));
    let seed = seconds(
        "CHAOS_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    );
    println!("chaos: seed {seed}, {run_for:?} of faults (CHAOS_SEED={seed} replays the schedule)");
    let Some(mut redis) = SentinelSet::start(2, Duration::from_millis(1000)) else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    let Some(primary) = PostgresServer::start() else {
        return;
    };
    primary.database("chaos");
    let standby = primary.start_standby(true);
    let ports = (primary.port, standby.port);
    let store = format!(
        "postgres://{}@127.0.0.1:{},127.0.0.1:{}/chaos?target_session_attrs=read-write",
        support::postgres::ROLE,
        ports.0,
        ports.1
    );
    let postgres = Arc::new(RwLock::new(Pair { primary, standby }));
    let tmp = tempfile::tempdir().unwrap();
    let files = Files::write(tmp.path(), LIMITS);
    let redis_url = redis.url();
    let spawn =
        |name: &str| Server::spawn(None, &args(&store, &redis_url, &files, tmp.path(), name));
    let run = Arc::new(Run {
        slots: RwLock::new(
            NAMES
                .iter()
                .map(|name| Slot {
                    server: Some(Arc::new(spawn(name))),
                    paused: false,
                })
                .collect(),
        ),
        stop: AtomicBool::new(false),
        answers: Mutex::new(BTreeMap::new()),
        admitted: Mutex::new(Vec::new()),
        faults: Mutex::new(Vec::new()),
        over: Mutex::new(Vec::new()),
        samples: Mutex::new(0),
    });
    let tasks = vec![
        tokio::spawn(agent(Arc::clone(&run), AGENT_SECRET, "agent", seed ^ 1)),
        tokio::spawn(agent(Arc::clone(&run), OTHER_SECRET, "other", seed ^ 2)),
        tokio::spawn(operator(Arc::clone(&run), seed ^ 3)),
        tokio::spawn(sampler(Arc::clone(&run), Arc::clone(&postgres))),
    ];

    // The faults, one every 4 to 10 s, at random from the seed.
    let mut rng = Rng((seed) | 1);
    let mut killed = [false; 3];
    let mut deck: Vec<&str> = Vec::new();
    let began = Instant::now();
    while began.elapsed() < run_for {
        tokio::time::sleep(Duration::from_millis(4000 + (rng.below(6000) as u64))).await;
        // Every kind once per round, in an order of the seed's: a short run meets them all.
        if deck.is_empty() {
            deck = KINDS.to_vec();
            for i in (1..deck.len()).rev() {
                deck.swap(i, rng.below(i + 1));
            }
        }
        let kind = deck.pop().expect("a kind");
        println!("chaos: {:>6.1} s: {kind}", began.elapsed().as_secs_f64());
        run.faults.lock().unwrap().push((kind, Instant::now()));
        match kind {
            "replica killed" => {
                let n = (rng.below(3) as u64) as usize;
                let server = run.slots.write().unwrap()[n].server.take();
                if let Some(server) = server {
                    server.kill();
                    killed[n] = true;
                }
                tokio::time::sleep(Duration::from_millis(1000 + (rng.below(3000) as u64))).await;
                let restarted = Arc::new(spawn(NAMES[n]));
                run.slots.write().unwrap()[n].server = Some(restarted);
            }
            "replica paused" => {
                let n = (rng.below(3) as u64) as usize;
                let server = run.slots.read().unwrap()[n].server.clone();
                if let Some(server) = server {
                    run.slots.write().unwrap()[n].paused = true;
                    server.pause();
                    tokio::time::sleep(Duration::from_millis(2000 + (rng.below(13000) as u64)))
                        .await;
                    server.resume();
                    run.slots.write().unwrap()[n].paused = false;
                }
            }
            "redis failover" => tokio::task::block_in_place(|| redis.fail_over()),
            "postgres restart" => tokio::task::block_in_place(|| {
                postgres.write().unwrap().primary.crash_and_restart()
            }),
            _ => tokio::task::block_in_place(|| postgres.write().unwrap().fail_over()),
        }
    }
    // The load goes on a while, so the last fault's pause is measured too.
    tokio::time::sleep(Duration::from_secs(5)).await;
    run.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let settled = Instant::now();
    println!(
        "chaos: the faults stop after {:.1} s",
        began.elapsed().as_secs_f64()
    );

    // Every key answered 503 (or not at all) is retried until answered: created, or replayed.
    let slots: Vec<Arc<Server>> = run
        .slots
        .read()
        .unwrap()
        .iter()
        .map(|s| Arc::clone(s.server.as_ref().unwrap()))
        .collect();
    let mut answers = std::mem::take(&mut *run.answers.lock().unwrap());
    let mut tries = 0;
    for (key, (status, id, operation, duration)) in answers
        .iter_mut()
        .filter(|(_, (s, ..))| [0, 503].contains(s))
    {
        let secret = if key.starts_with("agent") {
            AGENT_SECRET
        } else {
            OTHER_SECRET
        };
        loop {
            let server = &slots[tries % slots.len()];
            tries += 1;
            let reply = server
                .submit(secret, &request(key, operation, *duration))
                .await;
            match reply.status {
                200 | 202 => {
                    *status = reply.status;
                    *id = Some(reply.id());
                    break;
                }
                // Over a limit now: it was never created; it is not retried.
                429 => {
                    *status = 429;
                    break;
                }
                503 => tokio::time::sleep(Duration::from_millis(200)).await,
                other => panic!("{key}: {other} {:?}", reply.body),
            }
            assert!(settled.elapsed() < SETTLE, "{key} is never answered");
        }
    }

    let (lost, doubled, twice) = {
        let pair = postgres.read().unwrap();
        let psql = |sql: &str| pair.primary.psql("chaos", sql);
        let rows: BTreeMap<String, String> =
            psql("SELECT idempotency_key || ' ' || id FROM operations")
                .lines()
                .filter_map(|l| l.split_once(' ').map(|(k, i)| (k.to_owned(), i.to_owned())))
                .collect();
        let lost: Vec<String> = answers
            .iter()
            .filter(|(_, (status, ..))| [200, 202].contains(status))
            .filter_map(|(key, (_, id, ..))| {
                let id = id.as_ref().unwrap();
                (rows.get(key) != Some(id)).then(|| format!("{key} ({id})"))
            })
            .collect();
        let doubled =
            psql("SELECT count(*) - count(DISTINCT (client_id, idempotency_key)) FROM operations");
        let twice = psql(
            "SELECT count(*) FROM operations WHERE (operation = 'demo.run' AND revision > 3) \
             OR (operation = 'demo.request' AND revision > 4)",
        );
        (lost, doubled, twice)
    };

    // Drift 0 on every replica within a minute of settling.
    let mut drift_at = Vec::new();
    for (n, server) in slots.iter().enumerate() {
        let deadline = settled + SETTLE;
        loop {
            let report = server.operator.drift().await;
            if report["drift"] == 0 && report["fleet_drift"] == 0 {
                drift_at.push(settled.elapsed());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: drift stays {report}",
                NAMES[n]
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let died: Vec<&str> = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_running())
        .map(|(n, _)| NAMES[n])
        .collect();

    // The longest pause in admissions after each kind of fault: the longest gap between two
    // admissions (on any replica) from the fault's start until the next fault (or the end).
    let mut admitted = run.admitted.lock().unwrap().clone();
    admitted.sort();
    let faults = run.faults.lock().unwrap().clone();
    let mut pauses: BTreeMap<&str, (usize, Duration)> = BTreeMap::new();
    for (n, (kind, at)) in faults.iter().enumerate() {
        let until = faults.get(n + 1).map_or(settled, |(_, next)| *next);
        let mut last = *at;
        let mut longest = Duration::ZERO;
        for t in admitted.iter().filter(|t| **t >= *at && **t <= until) {
            longest = longest.max(*t - last);
            last = *t;
        }
        assert!(last > *at, "admissions resume after the {kind} at {at:?}");
        let entry = pauses.entry(kind).or_insert((0, Duration::ZERO));
        entry.0 += 1;
        entry.1 = entry.1.max(longest);
    }

    let count = |s: u16| answers.values().filter(|(status, ..)| *status == s).count();
    println!("chaos report (seed {seed}):");
    println!(
        "  submissions: {} created, {} replayed at the end, {} refused 429",
        count(202),
        count(200),
        count(429)
    );
    for (kind, (n, longest)) in &pauses {
        println!("  {kind}: {n} times, longest pause in admissions after it {longest:?}");
    }
    println!(
        "  every 202 has its row: {}",
        if lost.is_empty() {
            "yes".to_owned()
        } else {
            format!("NO: {lost:?}")
        }
    );
    println!("  rows with the same key: {doubled}");
    println!("  operations run twice: {twice}");
    let over = run.over.lock().unwrap().clone();
    println!(
        "  store over a limit: {} in {} samples",
        over.len(),
        run.samples.lock().unwrap()
    );
    println!(
        "  drift 0 on every replica {:?} after settling",
        drift_at.iter().max().unwrap()
    );
    println!("  replicas died unbidden: {died:?} (killed on purpose: {killed:?})");
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(doubled, "0");
    assert_eq!(twice, "0");
    assert!(over.is_empty(), "over a limit: {over:?}");
    assert!(died.is_empty(), "died: {died:?}");
    assert!(*run.samples.lock().unwrap() > 0, "the store was sampled");
}
