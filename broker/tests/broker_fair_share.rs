//! SPEC section 11 on the real broker: `admission serve` processes, every scenario written once
//! and run on both backends, `in_process::*` (one `serve`) and `replicas::*` (two `serve --redis
//! URL --replica NAME --replicas r1,r2` sharing a real `redis-server`, each client's work spread
//! over both).
//!
//! - **Headroom for the small.** A batch client with the issue's `active: 300` override fills the
//!   execution pool with long `demo.run`s. With `fair_share` it stops where the reserve begins,
//!   and an interactive client holding nothing is admitted beside it (its request for approval,
//!   and its own run, which starts in the reserve); without, the batch client takes the whole
//!   pool and the interactive client is refused `global_execution_limit`.
//! - **A fair share among the big.** A polite client (it sleeps each refusal's Retry-After, then
//!   asks again) and a hammering one (it asks again at once), each with more workers than the
//!   execution pool has slots, submit `demo.run`s of [`RUN_MS`] each, so the pool turns over
//!   while they contend. The slots each executes are sampled from the servers' `/metrics`
//!   (`admission_client_operations{client,state="executing"}`, summed over the replicas) and
//!   averaged over time, from two turnovers of the pool (twice `global_executing` operations
//!   ended) to the run's end ([`TURNOVERS`]); Jain's fairness index over the two averages is at
//!   least 0.9 with `fair_share`, and without it the hammering client holds most of the pool.
//!
//! - **No client holds the queue up.** A client at its share whose approved request is the oldest
//!   in the executor's queue does not keep another client's approved request, queued behind it,
//!   out of a free slot.
//!
//! The run is bounded by operations ended, not by time: nothing here asserts a duration.
//!
//! One file past 500 lines: the scenarios stand on the same deployment of either backend and
//! the same clients, and one test binary is cheaper to build and run than two.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use support::eventually::{PATIENCE, assert_eventually};
use support::http::{Reply, op_path, request, revision};
use support::metrics::metric;
use support::redis::RedisServer;
use support::serve::{Files, Server};

/// The batch client of the issue (an `active: 300` override).
const BATCH: &str = "batch-a";
const BATCH_SECRET: &str = "batch-a-secret-0123";
/// An interactive client: one request at a time, holding nothing before it.
const INTERACTIVE: &str = "interactive";
const INTERACTIVE_SECRET: &str = "interactive-secret-4567";
/// Sleeps each refusal's Retry-After before it asks again.
const POLITE: &str = "polite";
const POLITE_SECRET: &str = "polite-secret-89ab";
/// Asks again as soon as it is refused.
const HAMMERING: &str = "hammering";
const HAMMERING_SECRET: &str = "hammering-secret-cdef";

/// The clients every scenario's `serve` knows.
fn secrets_file() -> String {
    [
        (BATCH, BATCH_SECRET),
        (INTERACTIVE, INTERACTIVE_SECRET),
        (POLITE, POLITE_SECRET),
        (HAMMERING, HAMMERING_SECRET),
    ]
    .map(|(name, secret)| format!("{name} = {secret}\n"))
    .concat()
}

/// Where a scenario runs.
#[derive(Clone, Copy, Debug)]
enum Backend {
    /// One `serve`, deciding in-process.
    InProcess,
    /// Two `serve` replicas sharing one `redis-server`.
    Replicas,
}

/// The replicas of [`Backend::Replicas`], each told the whole fleet so they admit as soon as
/// both have registered.
const FLEET: [&str; 2] = ["r1", "r2"];

/// The `serve` processes of one scenario, and what they need alive.
struct Deployment {
    servers: Vec<Server>,
    _redis: Option<RedisServer>,
    _dir: tempfile::TempDir,
}

impl Deployment {
    /// `serve` on `backend` with the quota file `limits` and the clients of [`secrets_file`];
    /// `None`, having said why, when `redis-server` cannot be run here.
    fn start(backend: Backend, limits: &str) -> Option<Deployment> {
        let dir = tempfile::tempdir().unwrap();
        let files = Files::write(dir.path(), limits);
        std::fs::write(&files.secrets, secrets_file()).unwrap();
        let (servers, redis) = match backend {
            Backend::InProcess => (vec![Server::spawn(None, &files.args())], None),
            Backend::Replicas => {
                let redis = RedisServer::start()?;
                let servers = FLEET
                    .iter()
                    .map(|name| {
                        let mut args = vec!["--redis".to_owned(), redis.url()];
                        args.extend(files.replica_args(dir.path(), name, &FLEET.join(",")));
                        Server::spawn(None, &args)
                    })
                    .collect();
                (servers, Some(redis))
            }
        };
        Some(Deployment {
            servers,
            _redis: redis,
            _dir: dir,
        })
    }

    /// The server of a client's `n`th request: the replicas in turn.
    fn server(&self, n: usize) -> &Server {
        &self.servers[n % self.servers.len()]
    }

    /// `series` summed over the servers' `/metrics` (absent counts 0): on replicas, each
    /// exports what it holds and what it answered.
    async fn sum(&self, series: &str) -> u64 {
        let mut total = 0;
        for server in &self.servers {
            total += metric(&server.operator.metrics().await, series).unwrap_or(0);
        }
        total
    }
}

/// Writes `mod in_process` and `mod replicas`, each with one test per name that runs the async
/// function of that name on its backend.
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod in_process {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::InProcess).await
                }
            )*
        }
        mod replicas {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Replicas).await
                }
            )*
        }
    };
}

per_backend! {
    a_client_holding_nothing_is_admitted_beside_a_batch_client_that_filled_the_execution_pool,
    without_fair_share_a_batch_client_that_filled_the_execution_pool_locks_out_a_client_holding_nothing,
    a_polite_client_gets_its_share_of_the_execution_pool_against_a_hammering_one,
    without_fair_share_a_hammering_client_takes_the_execution_pool_from_a_polite_one,
    approved_work_of_a_client_at_its_share_does_not_hold_up_another_clients_behind_it,
}

// ---------------------------------------------------------------------------------------------
// Headroom for the small.

/// The issue's case, scaled down: `batch-a` may hold 300 live operations; the execution pool
/// has 16 slots; with `fair_share`, 4 of them are the reserve (floor 1), so the batch client
/// alone stops at 12.
fn headroom(fair_share: bool) -> String {
    let fair = if fair_share {
        r#", "fair_share": {"active": {"reserve": 32, "floor": 2},
                             "executing": {"reserve": 4, "floor": 1}}"#
    } else {
        ""
    };
    format!(
        r#"{{"requests_per_window": 100000, "window_seconds": 60, "client_active": 25,
            "client_pending": 10, "global_active": 512, "global_executing": 16,
            "clients": {{"{BATCH}": {{"requests_per_window": 100000, "window_seconds": 60,
                                     "active": 300, "pending": 10}}}}{fair}}}"#
    )
}

const EXECUTION_POOL: usize = 16;
const RESERVE: usize = 4;

/// The longest run the demo executor takes (ten minutes): it executes for the whole test.
const LONG_MS: u64 = 600_000;

/// The capacity hint `serve` gives as Retry-After.
const CAPACITY_RETRY_SECS: u64 = 2;

/// Submits a long `demo.run` of `secret`'s client on `server` under `key`; once admitted, waits
/// until it executes.
async fn run_long(server: &Server, secret: &str, key: &str) -> Reply {
    let reply = server
        .submit(secret, &request(key, "demo.run", LONG_MS))
        .await;
    if reply.status == 202 {
        let path = op_path(&reply.id());
        assert_eventually(&format!("{key} executes"), async || {
            server.get(&path, secret).await.state() == "executing"
        })
        .await;
    }
    reply
}

/// `batch-a` starts long runs, one after the other across the servers, each executing before
/// the next is submitted, until one is refused: how many were admitted, and the refusal.
async fn fill_with_batch_work(deployment: &Deployment) -> (usize, Reply) {
    for n in 0..=EXECUTION_POOL {
        let reply = run_long(deployment.server(n), BATCH_SECRET, &format!("batch-{n}")).await;
        if reply.status != 202 {
            return (n, reply);
        }
    }
    panic!("{BATCH} was admitted more than the execution pool holds");
}

/// Asserts `reply` is the execution pool's refusal, with the capacity hint.
fn assert_execution_pool_refusal(reply: &Reply, who: &str) {
    assert_eq!(
        (reply.status, reply.code()),
        (429, "global_execution_limit"),
        "{who}: {}",
        reply.body
    );
    assert_eq!(reply.retry_after(), Some(CAPACITY_RETRY_SECS), "{who}");
}

async fn fair_share_refusals(deployment: &Deployment, pool: &str, reason: &str) -> u64 {
    deployment
        .sum(&format!(
            r#"admission_fair_share_refusals_total{{pool="{pool}",reason="{reason}"}}"#
        ))
        .await
}

async fn a_client_holding_nothing_is_admitted_beside_a_batch_client_that_filled_the_execution_pool(
    backend: Backend,
) {
    let Some(deployment) = Deployment::start(backend, &headroom(true)) else {
        return;
    };
    // The batch client alone takes the pool less its reserve, then is refused with the pool's
    // code and hint: a fair-share refusal, by the reserve.
    let (admitted, refusal) = fill_with_batch_work(&deployment).await;
    assert_eq!(admitted, EXECUTION_POOL - RESERVE);
    assert_execution_pool_refusal(&refusal, BATCH);
    assert_eq!(
        fair_share_refusals(&deployment, "executing", "reserve").await,
        1
    );

    // The interactive client, holding nothing, is admitted (on replicas, by the other one): its
    // request for approval, and a run of its own that starts in the reserve.
    let other = deployment.server(admitted + 1);
    let ask = other
        .submit(INTERACTIVE_SECRET, &request("ask", "demo.request", 0))
        .await;
    assert_eq!((ask.status, ask.state()), (202, "pending"), "{}", ask.body);
    let run = run_long(other, INTERACTIVE_SECRET, "run").await;
    assert_eq!(run.status, 202, "{}", run.body);
    assert_eq!(
        deployment
            .sum(r#"admission_operations{state="executing"}"#)
            .await,
        (EXECUTION_POOL - RESERVE + 1) as u64
    );

    // The batch client is still held at the reserve's edge, wherever it asks.
    for n in 0..deployment.servers.len() {
        let again = deployment
            .server(n)
            .submit(
                BATCH_SECRET,
                &request(&format!("again-{n}"), "demo.run", LONG_MS),
            )
            .await;
        assert_execution_pool_refusal(&again, BATCH);
    }
    assert_eq!(
        fair_share_refusals(&deployment, "executing", "reserve").await,
        1 + deployment.servers.len() as u64
    );
    assert_eq!(
        fair_share_refusals(&deployment, "executing", "share").await,
        0
    );
}

async fn without_fair_share_a_batch_client_that_filled_the_execution_pool_locks_out_a_client_holding_nothing(
    backend: Backend,
) {
    let Some(deployment) = Deployment::start(backend, &headroom(false)) else {
        return;
    };
    let (admitted, refusal) = fill_with_batch_work(&deployment).await;
    assert_eq!(admitted, EXECUTION_POOL);
    assert_execution_pool_refusal(&refusal, BATCH);
    let ask = deployment
        .server(admitted + 1)
        .submit(INTERACTIVE_SECRET, &request("ask", "demo.request", 0))
        .await;
    assert_execution_pool_refusal(&ask, INTERACTIVE);
    for pool in ["active", "executing"] {
        for reason in ["reserve", "share"] {
            assert_eq!(
                fair_share_refusals(&deployment, pool, reason).await,
                0,
                "{pool} {reason}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// No client holds the queue up.

/// An execution pool of 4 without a reserve (floor 1): two clients holding in it have a share
/// of 2 each.
fn queue_limits() -> String {
    format!(
        r#"{{"requests_per_window": 100000, "window_seconds": 60, "client_active": 25,
            "client_pending": 10, "global_active": 512, "global_executing": 4,
            "clients": {{"{BATCH}": {{"requests_per_window": 100000, "window_seconds": 60,
                                     "active": 300, "pending": 10}}}},
            "fair_share": {{"active": {{"reserve": 0, "floor": 1}},
                           "executing": {{"reserve": 0, "floor": 1}}}}}}"#
    )
}

/// Submits a long `demo.request` of `secret`'s client on `server` under `key` and asserts it
/// waits for approval: its id.
async fn ask_long(server: &Server, secret: &str, key: &str) -> String {
    let reply = server
        .submit(secret, &request(key, "demo.request", LONG_MS))
        .await;
    assert_eq!(
        (reply.status, reply.state()),
        (202, "pending"),
        "{}",
        reply.body
    );
    reply.id()
}

async fn approved_work_of_a_client_at_its_share_does_not_hold_up_another_clients_behind_it(
    backend: Backend,
) {
    let Some(deployment) = Deployment::start(backend, &queue_limits()) else {
        return;
    };
    // Everything on one server, so both requests wait in one executor's queue.
    let server = deployment.server(0);
    let batch_ask = ask_long(server, BATCH_SECRET, "batch-ask").await;
    let interactive_ask = ask_long(server, INTERACTIVE_SECRET, "interactive-ask").await;
    // The batch client executes 2 and the interactive one 1: two holders, a share of 2 each,
    // one slot free.
    for key in ["batch-0", "batch-1"] {
        assert_eq!(run_long(server, BATCH_SECRET, key).await.status, 202);
    }
    assert_eq!(
        run_long(server, INTERACTIVE_SECRET, "run").await.status,
        202
    );

    // The batch client's request, approved first, is the oldest in the queue; its client is at
    // its share, so it cannot start. The interactive client's, approved after it, can.
    let approved = server.operator.approve(&batch_ask).await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    let approved = server.operator.approve(&interactive_ask).await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    let path = op_path(&interactive_ask);
    assert_eventually(
        "the interactive client's approved request starts in the free slot",
        async || server.get(&path, INTERACTIVE_SECRET).await.state() == "executing",
    )
    .await;
    assert_eq!(
        server.get(&op_path(&batch_ask), BATCH_SECRET).await.state(),
        "approved",
        "the batch client's stays queued: it is at its share"
    );
    assert_eq!(
        deployment
            .sum(r#"admission_operations{state="executing"}"#)
            .await,
        4
    );
}

// ---------------------------------------------------------------------------------------------
// A fair share among the big.

/// The execution pool the two clients contend for: 10 slots; with `fair_share`, 2 of them the
/// reserve (floor 1), so each of two clients holding in it has a share of 4. The rate and the
/// active limits never bind.
fn contention(fair_share: bool) -> String {
    let fair = if fair_share {
        r#", "fair_share": {"active": {"reserve": 0, "floor": 1},
                             "executing": {"reserve": 2, "floor": 1}}"#
    } else {
        ""
    };
    format!(
        r#"{{"requests_per_window": 1000000, "window_seconds": 60, "client_active": 50,
            "client_pending": 10, "global_active": 200, "global_executing": {CONTENDED_POOL}{fair}}}"#
    )
}

const CONTENDED_POOL: u64 = 10;
/// Each client's workers: more than the pool has slots, so each alone wants more than all of it.
const WORKERS: usize = 12;
/// How long each `demo.run` executes.
const RUN_MS: u64 = 400;
/// Operations ended, in pools: the first two turnovers are not measured, the run ends after the
/// last. The polite client reaches its share only as fast as its Retry-After lets it ask (2 s a
/// round, against runs of [`RUN_MS`]), so the run is long enough for that ramp not to be most
/// of what is measured.
const TURNOVERS: u64 = 20;
/// How often the holdings are read.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// How a client answers a refusal.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Manners {
    /// Sleeps the refusal's Retry-After, then asks again.
    Polite,
    /// Asks again at once.
    Hammering,
}

#[derive(Clone, Copy)]
struct Contender {
    name: &'static str,
    secret: &'static str,
    manners: Manners,
}

const CONTENDERS: [Contender; 2] = [
    Contender {
        name: POLITE,
        secret: POLITE_SECRET,
        manners: Manners::Polite,
    },
    Contender {
        name: HAMMERING,
        secret: HAMMERING_SECRET,
        manners: Manners::Hammering,
    },
];

/// What one worker's submissions got.
#[derive(Default, Debug)]
struct Tally {
    admitted: u64,
    refused: u64,
}

/// One Agent V1 request on `http` (a connection kept alive: the hammering worker asks as fast
/// as a client can). The replies are not checked against the contract here, so the test's own
/// CPU stays with the servers; every other test checks them.
async fn agent(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    secret: &str,
    body: Option<&serde_json::Value>,
) -> Reply {
    let mut request = http.request(method, url).bearer_auth(secret);
    if let Some(body) = body {
        request = request.json(body);
    }
    Reply::read(request.send().await.unwrap()).await.unwrap()
}

fn ended(state: &str) -> bool {
    matches!(
        state,
        "succeeded" | "failed" | "denied" | "expired" | "canceled"
    )
}

/// One worker of `who`, on the server at `base`: submits a run, waits (long-polling) for its
/// end, and submits the next; refused, it asks again as its manners say. Counts each ended run
/// in `runs_ended`; stops asking once `stop` is set.
async fn work(
    base: String,
    who: Contender,
    worker: usize,
    runs_ended: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> Tally {
    let http = reqwest::Client::builder()
        .timeout(PATIENCE)
        .build()
        .unwrap();
    let mut tally = Tally::default();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = request(&format!("{}-{worker}-{n}", who.name), "demo.run", RUN_MS);
        let url = format!("{base}/api/agent/v1/operations");
        let reply = agent(&http, reqwest::Method::POST, url, who.secret, Some(&body)).await;
        match reply.status {
            202 => {
                tally.admitted += 1;
                let id = reply.id();
                let mut seen = reply;
                while !ended(seen.state()) {
                    let url = format!(
                        "{base}{}/events?after_revision={}&wait_seconds=10",
                        op_path(&id),
                        revision(&seen.body)
                    );
                    seen = agent(&http, reqwest::Method::GET, url, who.secret, None).await;
                    assert_eq!(seen.status, 200, "{}", seen.body);
                }
                runs_ended.fetch_add(1, Ordering::Relaxed);
            }
            // A refusal by admission (429), or a replica without room for one more decision
            // in flight to Redis (503 admission_unavailable): both say when to retry.
            429 | 503 => {
                tally.refused += 1;
                let after = reply
                    .retry_after()
                    .unwrap_or_else(|| panic!("a refusal without Retry-After: {}", reply.body));
                if who.manners == Manners::Polite {
                    let wake = Instant::now() + Duration::from_secs(after);
                    while Instant::now() < wake && !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            status => panic!("{} got {status}: {}", who.name, reply.body),
        }
    }
    tally
}

/// What a contention run measured.
struct Contention {
    /// Each contender's time-averaged executing slots, in [`CONTENDERS`]' order.
    held: [f64; 2],
    /// Each contender's admitted and refused submissions.
    tallies: [Tally; 2],
    /// How long the measured part lasted, and how many samples it took.
    measured: Duration,
    samples: u64,
    /// The fair-share refusals the servers counted: executing by the reserve, by the share.
    fair_share_refusals: [u64; 2],
}

impl Contention {
    /// Jain's fairness index over the time-averaged holdings: (Σx)² / (n·Σx²), 1 when equal,
    /// 1/n when one client holds everything.
    fn jain(&self) -> f64 {
        let sum: f64 = self.held.iter().sum();
        let squares: f64 = self.held.iter().map(|x| x * x).sum();
        sum * sum / (self.held.len() as f64 * squares)
    }

    fn print(&self, backend: Backend, file: &str) {
        println!(
            "{backend:?}, {file}: executing slots held on average over {:.1?} ({} samples) after \
             two turnovers: {POLITE} {:.2}, {HAMMERING} {:.2}; Jain's index {:.3}; admitted / \
             refused: {POLITE} {} / {}, {HAMMERING} {} / {}; fair-share refusals of the \
             execution pool: reserve {}, share {}",
            self.measured,
            self.samples,
            self.held[0],
            self.held[1],
            self.jain(),
            self.tallies[0].admitted,
            self.tallies[0].refused,
            self.tallies[1].admitted,
            self.tallies[1].refused,
            self.fair_share_refusals[0],
            self.fair_share_refusals[1],
        );
    }
}

/// The executing slots each contender holds now, summed over the servers.
async fn executing(deployment: &Deployment) -> [u64; 2] {
    let mut held = [0; 2];
    for server in &deployment.servers {
        let text = server.operator.metrics().await;
        for (slot, who) in held.iter_mut().zip(CONTENDERS) {
            let series = format!(
                r#"admission_client_operations{{client="{}",state="executing"}}"#,
                who.name
            );
            *slot += metric(&text, &series).unwrap_or(0);
        }
    }
    held
}

/// Both contenders' workers ([`WORKERS`] each, spread over the servers) contend for the
/// execution pool until [`TURNOVERS`] pools of runs have ended; the holdings are averaged over
/// time from the second turnover on.
async fn contend(deployment: &Deployment) -> Contention {
    // One contention at a time in this binary: two at once share the machine's two CPUs, and
    // a client's holdings over time would measure the scheduler as much as the fair share.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_AT_A_TIME.lock().await;
    let runs_ended = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for who in CONTENDERS {
        for worker in 0..WORKERS {
            let base = deployment.server(worker).base.clone();
            workers.push(tokio::spawn(work(
                base,
                who,
                worker,
                Arc::clone(&runs_ended),
                Arc::clone(&stop),
            )));
        }
    }

    let deadline = Instant::now() + 4 * PATIENCE;
    let mut area = [0.0f64; 2];
    let mut measured = Duration::ZERO;
    let mut samples = 0;
    let mut last: Option<(Instant, [u64; 2])> = None;
    loop {
        let done = runs_ended.load(Ordering::Relaxed);
        if done >= TURNOVERS * CONTENDED_POOL {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done} runs ended within {:?}",
            4 * PATIENCE
        );
        let held = executing(deployment).await;
        let now = Instant::now();
        // Each interval counts at the holdings read at its start, from the second turnover on.
        if let Some((then, before)) = last {
            let dt = now - then;
            measured += dt;
            for (area, held) in area.iter_mut().zip(before) {
                *area += held as f64 * dt.as_secs_f64();
            }
            samples += 1;
        }
        last = (done >= 2 * CONTENDED_POOL).then_some((now, held));
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut tallies = [Tally::default(), Tally::default()];
    for (i, worker) in workers.into_iter().enumerate() {
        let tally = worker.await.unwrap();
        let mine = &mut tallies[i / WORKERS];
        mine.admitted += tally.admitted;
        mine.refused += tally.refused;
    }
    let fair_share_refusals = [
        fair_share_refusals(deployment, "executing", "reserve").await,
        fair_share_refusals(deployment, "executing", "share").await,
    ];
    Contention {
        held: area.map(|a| a / measured.as_secs_f64()),
        tallies,
        measured,
        samples,
        fair_share_refusals,
    }
}

/// Both contenders were admitted and refused: each wanted more than it got.
fn assert_both_contended(run: &Contention) {
    for (who, tally) in CONTENDERS.iter().zip(&run.tallies) {
        assert!(tally.admitted > 0, "{} was never admitted", who.name);
        assert!(tally.refused > 0, "{} was never refused", who.name);
    }
}

async fn a_polite_client_gets_its_share_of_the_execution_pool_against_a_hammering_one(
    backend: Backend,
) {
    let Some(deployment) = Deployment::start(backend, &contention(true)) else {
        return;
    };
    let run = contend(&deployment).await;
    run.print(backend, "fair_share");
    assert_both_contended(&run);
    assert!(
        run.fair_share_refusals[1] > 0,
        "the hammering client was never held to its share"
    );
    assert!(
        run.jain() >= 0.9,
        "Jain's index {:.3} (polite {:.2}, hammering {:.2})",
        run.jain(),
        run.held[0],
        run.held[1]
    );
}

async fn without_fair_share_a_hammering_client_takes_the_execution_pool_from_a_polite_one(
    backend: Backend,
) {
    let Some(deployment) = Deployment::start(backend, &contention(false)) else {
        return;
    };
    let run = contend(&deployment).await;
    run.print(backend, "first come, first served");
    assert_both_contended(&run);
    assert_eq!(run.fair_share_refusals, [0, 0]);
    let [polite, hammering] = run.held;
    assert!(
        hammering > 2.0 * polite && run.jain() < 0.9,
        "the hammering client did not win: Jain's index {:.3} (polite {polite:.2}, hammering \
         {hammering:.2})",
        run.jain()
    );
}
