//! The victim's latency while one client (holding a valid secret) attacks the broker, with the
//! fairness work on and before it, in one run; and what the fairness work costs on the path no
//! one attacks.
//!
//! Each run starts the `admission serve` binary on loopback (`--max-connections 64`, as the
//! issue's slow-body attack did) under two builds:
//!
//! - **fair**: this build, with its defaults (fairness layer, byte budget, body deadline and
//!   minimum rate, stored summaries and digests);
//! - **before**: the binary named by `ADMISSION_BEFORE_BIN` (the commit before the fairness work,
//!   `f550d8c`, built from a second checkout); without it, this build with the fairness limits
//!   turned off by configuration (a share and a budget no one reaches, no minimum rate, a long
//!   body deadline), which still has the stored summaries and digests. The report says which.
//!
//! Attacks (client `agent`), each against a fresh server: none (calm); **slow bodies** (64
//! connections each trickling a submission body one byte every 250 ms, reconnecting when cut
//! off); **heavy list** (50 stored operations with ~1 MB arguments, 8 connections paging
//! `limit=50`); **heavy replay** (16 connections replaying heavy operations). The victim (client
//! `other`) times its submission, its list and `/healthz` on a fresh connection each, up to 5 s
//! (a slower answer counts as 5 s and as a timeout), and the report gives p50 and p99, the
//! timeouts, and the server's peak resident memory.
//!
//! Unattacked cost (criterion, `fairness_cost/*`): a refusal flood (submissions refused 429
//! `client_pending_limit`) and creations (202), one at a time on a kept-alive connection, on
//! each build.
//!
//! `cargo bench --bench fairness` (release build; about three minutes). `FAIRNESS_SAMPLES`
//! (default 40) sets the victim's requests per kind. Under `cargo test --all-targets` a smoke run
//! of a few requests checks the same answers.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::Criterion;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinSet;

const AGENT_SECRET: &str = "bench-agent-secret-0123";
const OTHER_SECRET: &str = "bench-other-secret-4567";

/// Nothing binds but what an attack makes bind (10 pending, for the refusal flood).
const LIMITS: &str = r#"{"requests_per_window": 1000000, "window_seconds": 60,
  "client_active": 1000, "client_pending": 10, "global_active": 5000, "global_executing": 64}"#;

/// The longest the victim waits for one answer.
const VICTIM_TIMEOUT: Duration = Duration::from_secs(5);

/// The padding of a heavy operation's arguments: a submission just under 1 MiB.
const HEAVY_PADDING: usize = 1_000_000;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Which build a server runs, and how.
#[derive(Clone)]
struct Build {
    label: &'static str,
    binary: PathBuf,
    flags: Vec<String>,
}

fn builds() -> (Build, Build, String) {
    let this = PathBuf::from(env!("CARGO_BIN_EXE_admission"));
    // This build's operator listener on a port of its own (the default is a fixed one); the
    // operators' secrets file is the one `serve` creates (no request here is an operator's).
    let own_operator_port = || vec!["--operator-listen".to_owned(), "127.0.0.1:0".to_owned()];
    let fair = Build {
        label: "fair",
        binary: this.clone(),
        flags: own_operator_port(),
    };
    let (before, which) = match std::env::var_os("ADMISSION_BEFORE_BIN") {
        Some(path) => (
            Build {
                label: "before",
                binary: PathBuf::from(&path),
                flags: vec![],
            },
            format!(
                "before = the binary at {} (the commit before the fairness work)",
                PathBuf::from(path).display()
            ),
        ),
        None => (
            Build {
                label: "before",
                binary: this,
                flags: [
                    "--client-requests",
                    "400",
                    "--buffered-bytes",
                    "1099511627776",
                    "--body-min-rate",
                    "0",
                    "--body-deadline",
                    "1h",
                    "--operator-listen",
                    "127.0.0.1:0",
                ]
                .map(str::to_owned)
                .to_vec(),
            },
            "before = this build with the fairness limits off by configuration".to_owned(),
        ),
    };
    (fair, before, which)
}

/// A running `admission serve` in a temporary dir; killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(build: &Build) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path = |name: &str| dir.path().join(name);
        std::fs::write(
            path("secrets"),
            format!("agent = {AGENT_SECRET}\nother = {OTHER_SECRET}\n"),
        )
        .unwrap();
        std::fs::write(path("limits.json"), LIMITS).unwrap();
        let arg = |p: PathBuf| p.to_str().unwrap().to_owned();
        let mut child = Command::new(&build.binary)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--max-connections",
                "64",
            ])
            .args(["--data".to_owned(), arg(path("data"))])
            .args(["--secrets".to_owned(), arg(path("secrets"))])
            .args(["--admission-config".to_owned(), arg(path("limits.json"))])
            .args(&build.flags)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("serve exited before listening")
                .unwrap();
            if let Some(addr) = line.trim().strip_prefix("listening on ") {
                break addr.parse::<SocketAddr>().unwrap();
            }
        };
        // Keep draining stdout so the server never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            base: format!("http://{addr}"),
            addr,
            _dir: dir,
        }
    }

    /// The server's peak resident memory so far (`VmHWM`), in MiB.
    fn peak_mib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024)
    }
}

fn submission(key: &str, operation: &str, padding: usize) -> Value {
    let mut arguments = json!({"duration_ms": 0});
    if padding > 0 {
        arguments["padding"] = Value::from("x".repeat(padding));
    }
    json!({
        "idempotency_key": key,
        "operation": operation,
        "target": {"repo": "unyolo/bench"},
        "arguments": arguments,
        "reason": "fairness benchmark",
    })
}

/// A client on fresh connections (a kept-alive one could be the idle one evicted at the cap).
fn fresh_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(VICTIM_TIMEOUT)
        .build()
        .unwrap()
}

fn pooled_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn post(http: &reqwest::Client, base: &str, token: &str, body: &Value) -> Option<u16> {
    let reply = http
        .post(format!("{base}/api/agent/v1/operations"))
        .bearer_auth(token)
        .json(body)
        .send()
        .await
        .ok()?;
    let status = reply.status().as_u16();
    reply.bytes().await.ok()?;
    Some(status)
}

async fn get(http: &reqwest::Client, url: String, token: &str) -> Option<u16> {
    let reply = http.get(url).bearer_auth(token).send().await.ok()?;
    let status = reply.status().as_u16();
    reply.bytes().await.ok()?;
    Some(status)
}

#[derive(Clone, Copy, PartialEq)]
enum Attack {
    Calm,
    SlowBodies,
    HeavyList,
    HeavyReplay,
}

impl Attack {
    fn name(self) -> &'static str {
        match self {
            Attack::Calm => "none",
            Attack::SlowBodies => "slow bodies",
            Attack::HeavyList => "heavy list",
            Attack::HeavyReplay => "heavy replay",
        }
    }
}

/// Stores `count` heavy operations for the agent, four submissions at a time.
async fn seed_heavy(base: &str, count: usize) -> Vec<Value> {
    let http = pooled_client();
    let bodies: Vec<Value> = (0..count)
        .map(|n| submission(&format!("heavy-{n}"), "demo.run", HEAVY_PADDING))
        .collect();
    for chunk in bodies.chunks(4) {
        let mut sent = JoinSet::new();
        for body in chunk {
            let (http, base, body) = (http.clone(), base.to_owned(), body.clone());
            sent.spawn(async move { post(&http, &base, AGENT_SECRET, &body).await });
        }
        while let Some(status) = sent.join_next().await {
            assert_eq!(
                status.unwrap(),
                Some(202),
                "a heavy operation was not stored"
            );
        }
    }
    bodies
}

/// One attacker connection trickling a submission body a byte every 250 ms, reconnecting
/// whenever the broker cuts it off, until `stop`.
async fn trickle(addr: SocketAddr, mut stop: watch::Receiver<bool>) {
    let head = format!(
        "POST /api/agent/v1/operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \
         {AGENT_SECRET}\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n{{"
    );
    while !*stop.borrow() {
        let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await
        else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if stream.write_all(head.as_bytes()).await.is_err() {
            continue;
        }
        let mut buf = [0u8; 1024];
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                read = stream.read(&mut buf) => match read {
                    // Answered (408) or closed: start over.
                    Ok(_) | Err(_) => break,
                },
                _ = tokio::time::sleep(Duration::from_millis(250)) => {
                    if stream.write_all(b" ").await.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

/// Starts `attack` against `server`; the tasks run until `stop`.
async fn start_attack(
    attack: Attack,
    server: &Server,
    heavy: &[Value],
    stop: &watch::Sender<bool>,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    match attack {
        Attack::Calm => {}
        Attack::SlowBodies => {
            for _ in 0..64 {
                tasks.spawn(trickle(server.addr, stop.subscribe()));
            }
        }
        Attack::HeavyList => {
            for _ in 0..8 {
                let (base, mut stop) = (server.base.clone(), stop.subscribe());
                tasks.spawn(async move {
                    let http = pooled_client();
                    let url = format!("{base}/api/agent/v1/operations?limit=50");
                    while !*stop.borrow_and_update() {
                        tokio::select! {
                            _ = get(&http, url.clone(), AGENT_SECRET) => {}
                            _ = stop.changed() => {}
                        }
                    }
                });
            }
        }
        Attack::HeavyReplay => {
            for body in heavy.iter().take(16) {
                let (base, mut stop) = (server.base.clone(), stop.subscribe());
                let body = body.clone();
                tasks.spawn(async move {
                    let http = pooled_client();
                    while !*stop.borrow_and_update() {
                        tokio::select! {
                            _ = post(&http, &base, AGENT_SECRET, &body) => {}
                            _ = stop.changed() => {}
                        }
                    }
                });
            }
        }
    }
    tasks
}

/// The victim's latencies for one kind of request.
struct Sampled {
    latencies: Vec<Duration>,
    timeouts: usize,
    refused: usize,
}

impl Sampled {
    fn percentile(&self, p: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        sorted.get(i).copied().unwrap_or_default()
    }

    fn cell(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let mut cell = format!(
            "{:.1} / {:.1}",
            ms(self.percentile(0.5)),
            ms(self.percentile(0.99))
        );
        if self.timeouts > 0 {
            cell.push_str(&format!(
                " ({} of {} timed out)",
                self.timeouts,
                self.latencies.len()
            ));
        }
        if self.refused > 0 {
            cell.push_str(&format!(" ({} refused)", self.refused));
        }
        cell
    }
}

#[derive(Clone, Copy)]
enum Victim {
    Submit,
    List,
    Health,
}

/// `samples` requests of `victim` by the other client, one at a time, each on a fresh
/// connection; after three timeouts in a row the rest are counted as timeouts too (a broker that
/// keeps the victim out would otherwise make the run last minutes).
async fn sample(victim: Victim, base: &str, samples: usize, next_key: &AtomicU64) -> Sampled {
    let http = fresh_client();
    let mut out = Sampled {
        latencies: Vec::with_capacity(samples),
        timeouts: 0,
        refused: 0,
    };
    let mut in_a_row = 0;
    for _ in 0..samples {
        if in_a_row >= 3 {
            out.latencies.push(VICTIM_TIMEOUT);
            out.timeouts += 1;
            continue;
        }
        let started = Instant::now();
        let status = match victim {
            Victim::Submit => {
                // Relaxed: only uniqueness matters.
                let key = format!("victim-{}", next_key.fetch_add(1, Ordering::Relaxed));
                post(&http, base, OTHER_SECRET, &submission(&key, "demo.run", 0)).await
            }
            Victim::List => {
                get(
                    &http,
                    format!("{base}/api/agent/v1/operations?limit=20"),
                    OTHER_SECRET,
                )
                .await
            }
            Victim::Health => get(&http, format!("{base}/healthz"), OTHER_SECRET).await,
        };
        let took = started.elapsed().min(VICTIM_TIMEOUT);
        out.latencies.push(took);
        match status {
            None => {
                out.timeouts += 1;
                in_a_row += 1;
            }
            Some(200 | 202) => in_a_row = 0,
            Some(_) => {
                out.refused += 1;
                in_a_row = 0;
            }
        }
    }
    out
}

struct Row {
    build: &'static str,
    attack: Attack,
    submit: Sampled,
    list: Sampled,
    health: Sampled,
    peak_mib: u64,
}

async fn attacked(build: &Build, attack: Attack, samples: usize, rows: usize) -> Row {
    let server = Server::start(build);
    let heavy = match attack {
        Attack::HeavyList => seed_heavy(&server.base, rows).await,
        Attack::HeavyReplay => seed_heavy(&server.base, rows.min(16)).await,
        _ => Vec::new(),
    };
    let (stop, _) = watch::channel(false);
    let mut tasks = start_attack(attack, &server, &heavy, &stop).await;
    // Let the attack take hold: the slow bodies fill every connection.
    if attack != Attack::Calm {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let keys = AtomicU64::new(0);
    let submit = sample(Victim::Submit, &server.base, samples, &keys).await;
    let list = sample(Victim::List, &server.base, samples, &keys).await;
    let health = sample(Victim::Health, &server.base, samples, &keys).await;
    let _ = stop.send(true);
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    Row {
        build: build.label,
        attack,
        submit,
        list,
        health,
        peak_mib: server.peak_mib(),
    }
}

/// `fairness_cost/{refusal,creation}/{build}`: one request at a time on a kept-alive connection.
fn unattacked_cost(
    c: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    builds: &[&Build],
    full: bool,
) {
    let mut group = c.benchmark_group("fairness_cost");
    if full {
        group
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
    }
    for build in builds {
        let server = Server::start(build);
        let http = pooled_client();
        let base = server.base.clone();
        let keys = Arc::new(AtomicU64::new(0));
        // The agent's pending share full: every further demo.request is refused.
        runtime.block_on(async {
            for n in 0..10 {
                let body = submission(&format!("pending-{n}"), "demo.request", 0);
                assert_eq!(post(&http, &base, AGENT_SECRET, &body).await, Some(202));
            }
        });
        group.bench_function(format!("refusal/{}", build.label), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        // Relaxed: only uniqueness matters.
                        let key = format!("refused-{}", keys.fetch_add(1, Ordering::Relaxed));
                        let body = submission(&key, "demo.request", 0);
                        assert_eq!(post(&http, &base, AGENT_SECRET, &body).await, Some(429));
                    }
                    started.elapsed()
                })
            })
        });
        group.bench_function(format!("creation/{}", build.label), |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let started = Instant::now();
                    for _ in 0..iters {
                        // Relaxed: only uniqueness matters.
                        let key = format!("created-{}", keys.fetch_add(1, Ordering::Relaxed));
                        let body = submission(&key, "demo.run", 0);
                        assert_eq!(post(&http, &base, OTHER_SECRET, &body).await, Some(202));
                    }
                    started.elapsed()
                })
            })
        });
    }
    group.finish();
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` a smoke run.
    let full = std::env::args().any(|a| a == "--bench");
    let samples = env("FAIRNESS_SAMPLES", if full { 40 } else { 3 });
    let rows = if full { 50 } else { 2 };
    let (fair, before, which) = builds();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let mut table = Vec::new();
    for attack in [
        Attack::Calm,
        Attack::SlowBodies,
        Attack::HeavyList,
        Attack::HeavyReplay,
    ] {
        for build in [&fair, &before] {
            let row = runtime.block_on(attacked(build, attack, samples, rows));
            eprintln!(
                "{:>6} {:>12}: submit {} | list {} | healthz {} | peak {} MiB",
                row.build,
                row.attack.name(),
                row.submit.cell(),
                row.list.cell(),
                row.health.cell(),
                row.peak_mib
            );
            table.push(row);
        }
    }
    println!("\n{which}; victim p50 / p99 in ms, {samples} requests each\n");
    println!("| attack | build | submit | list | /healthz | peak RSS |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for row in &table {
        println!(
            "| {} | {} | {} | {} | {} | {} MiB |",
            row.attack.name(),
            row.build,
            row.submit.cell(),
            row.list.cell(),
            row.health.cell(),
            row.peak_mib
        );
    }
    println!();

    let mut criterion = if full {
        Criterion::default().configure_from_args()
    } else {
        // Smoke: each measured request once or a few times.
        Criterion::default()
            .sample_size(10)
            .warm_up_time(Duration::from_millis(10))
            .measurement_time(Duration::from_millis(50))
    };
    unattacked_cost(&mut criterion, &runtime, &[&fair, &before], full);
    criterion.final_summary();
}
