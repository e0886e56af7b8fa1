//! `admission drill --replicas N`: the drill across N in-process broker replicas sharing one
//! Redis (cargo feature `redis`; a build without it says so). Each replica has its own data dir and port; a client's
//! submissions go round-robin over them, as a load balancer that lost its stickiness would send
//! them. Each step prints what it expected and what it saw:
//!
//! - the client's pending limit holds across replicas (every replica refuses once it is reached);
//! - one idempotency key sent to every replica makes one operation;
//! - canceled work frees the shared counts, and everything drains to zero.
//!
//! Without `--redis URL`, the drill starts its own `redis-server` on a free loopback port (no
//! persistence) and stops it at the end.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

// The same clients, secrets and limits as the single-broker drill, so its figures compare.
use super::drill::{AGENT, AGENT_SECRET, LIMITS, OPERATOR_SECRET, Step, table};
use super::{Broker, BrokerSettings};
use unyolo_admission::Config;
use unyolo_admission::admission::ReplicaOptions;
use unyolo_admission::config::{Identity, Operators, Secrets};

/// A `redis-server` the drill started, stopped when dropped.
struct OwnRedis(Child);

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis(dir: &Path) -> Result<(OwnRedis, String), String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run redis-server (install Debian's redis-server): {e}"))?;
    let own = OwnRedis(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("redis-server did not start".to_owned());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((own, format!("redis://127.0.0.1:{port}/")))
}

/// Runs the drill across `replicas` replicas and prints each step; returns whether every step
/// passed.
pub fn run(replicas: usize, redis_url: Option<String>) -> bool {
    let dir = match tempfile_dir() {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("error: {e}");
            return false;
        }
    };
    let (_own, url) = match redis_url {
        Some(url) => (None, url),
        None => match start_redis(&dir) {
            Ok((own, url)) => (Some(own), url),
            Err(e) => {
                eprintln!("error: {e}");
                let _ = std::fs::remove_dir_all(&dir);
                return false;
            }
        },
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return false;
        }
    };
    let steps = runtime.block_on(walk(&dir, &url, replicas.max(2)));
    let _ = std::fs::remove_dir_all(&dir);
    print!("{}", table(&steps));
    steps.iter().all(|s| s.passed)
}

fn tempfile_dir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!(
        "admission-drill-replicas-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

fn settings(dir: &Path, name: &str) -> BrokerSettings {
    let secrets = Secrets::parse(&format!("{AGENT} = {AGENT_SECRET}\n")).expect("valid secrets");
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let config = Config::from_bytes(LIMITS.as_bytes(), identities).expect("valid limits");
    BrokerSettings {
        config,
        broker_name: name.to_owned(),
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().expect("an address"),
            dir.to_owned(),
            secrets,
            Operators::single("drill", OPERATOR_SECRET).expect("a valid operator"),
        )
    }
}

fn step(
    name: impl Into<String>,
    expected: impl Into<String>,
    observed: String,
    passed: bool,
) -> Step {
    Step {
        name: name.into(),
        expected: expected.into(),
        observed,
        passed,
    }
}

async fn submit(http: &reqwest::Client, broker: &Broker, key: &str) -> (u16, Value) {
    let body = json!({
        "idempotency_key": key,
        "operation": "demo.request",
        "target": {"repo": "unyolo/drill", "branch": "main"},
        "arguments": {},
        "reason": "replica drill",
    });
    let sent = http
        .post(format!(
            "http://{}/api/agent/v1/operations",
            broker.local_addr()
        ))
        .bearer_auth(AGENT_SECRET)
        .json(&body)
        .send()
        .await;
    match sent {
        Ok(response) => {
            let status = response.status().as_u16();
            let body = response.json().await.unwrap_or(Value::Null);
            (status, body)
        }
        Err(e) => (0, json!({"error": {"code": e.to_string()}})),
    }
}

async fn cancel(http: &reqwest::Client, broker: &Broker, id: &str) -> u16 {
    http.post(format!(
        "http://{}/api/agent/v1/operations/{id}/cancel",
        broker.local_addr()
    ))
    .bearer_auth(AGENT_SECRET)
    .send()
    .await
    .map(|r| r.status().as_u16())
    .unwrap_or(0)
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("-")
}

async fn walk(dir: &Path, url: &str, replicas: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut brokers = Vec::new();
    // Each replica is told the whole fleet: at the deployment's first start (and after Redis
    // forgets it) the replicas admit as soon as all have registered, not one lease period later.
    let names: Vec<String> = (1..=replicas).map(|i| format!("r{i}")).collect();
    for name in &names {
        let data = dir.join(name);
        let mut options = ReplicaOptions::new(url, name);
        options.replicas = names.clone();
        match Broker::start_shared(settings(&data, name), options).await {
            Ok((broker, _)) => brokers.push(broker),
            Err(e) => {
                steps.push(step("start replicas", "all start", e.to_string(), false));
                return steps;
            }
        }
    }
    // Any replica reads the whole deployment's counts.
    let Some(monitor) = brokers.first().map(|b| b.admission().clone()) else {
        return steps;
    };
    steps.push(step(
        format!("start {replicas} replicas sharing {url}"),
        "all start",
        format!("{} started", brokers.len()),
        brokers.len() == replicas,
    ));
    let http = reqwest::Client::new();

    // 1. Round-robin submissions: two are admitted in all, then every replica refuses.
    let mut created = Vec::new();
    let mut refusals = Vec::new();
    for (i, broker) in brokers.iter().cycle().take(replicas + 2).enumerate() {
        let (status, body) = submit(&http, broker, &format!("rr-{i}")).await;
        match status {
            202 => created.push((i % replicas, body["id"].as_str().unwrap_or("").to_owned())),
            _ => refusals.push(format!("{status} {}", code(&body))),
        }
    }
    let pending = monitor
        .counts()
        .await
        .map(|c| c.pending)
        .unwrap_or(u64::MAX);
    steps.push(step(
        "round-robin submissions across replicas",
        "2 created in all, then 429 client_pending_limit from each replica; 2 pending in Redis",
        format!(
            "{} created, refusals {:?}, {pending} pending in Redis",
            created.len(),
            refusals
        ),
        created.len() == 2
            && refusals.len() == replicas
            && refusals.iter().all(|r| r == "429 client_pending_limit")
            && pending == 2,
    ));

    // 2. Free one slot, then send one key to every replica at once — once each replica has
    //    heard of the release: until then it answers the client its remembered refusal (at
    //    most for the refusal's hint), as it is meant to.
    let forgotten =
        |broker: &Broker| -> u64 { broker.admission().stats().refusals_forgotten.iter().sum() };
    let before: Vec<u64> = brokers.iter().map(forgotten).collect();
    let freed = match created.pop() {
        Some((at, id)) => cancel(&http, &brokers[at], &id).await,
        None => 0,
    };
    let heard = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < heard
        && brokers.iter().zip(&before).any(|(b, n)| forgotten(b) <= *n)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let attempts = brokers.iter().map(|b| submit(&http, b, "same-key"));
    let answers = futures_join(attempts).await;
    let made = answers.iter().filter(|(s, _)| *s == 202).count();
    let elsewhere = answers
        .iter()
        .filter(|(s, b)| *s == 409 && code(b) == "idempotency_key_elsewhere")
        .count();
    let others: Vec<String> = answers
        .iter()
        .filter(|(s, b)| *s != 202 && !(*s == 409 && code(b) == "idempotency_key_elsewhere"))
        .map(|(s, b)| format!("{s} {}", code(b)))
        .collect();
    steps.push(step(
        "one idempotency key sent to every replica at once",
        "one 202, every other replica 409 idempotency_key_elsewhere",
        format!("cancel {freed}; {made} created, {elsewhere} pointed elsewhere, others {others:?}"),
        freed == 200 && made == 1 && elsewhere == replicas - 1,
    ));
    for (i, (status, body)) in answers.iter().enumerate() {
        if *status == 202 {
            created.push((i, body["id"].as_str().unwrap_or("").to_owned()));
        }
    }

    // 3. Cancel everything: the shared counts drain to zero.
    let mut canceled = 0;
    for (at, id) in &created {
        if cancel(&http, &brokers[*at], id).await == 200 {
            canceled += 1;
        }
    }
    let counts = monitor.counts().await;
    let idle = counts.as_ref().is_ok_and(|c| c.is_idle());
    steps.push(step(
        "cancel everything",
        "shared counts back to zero",
        format!(
            "{canceled} canceled; {}",
            match &counts {
                Ok(c) => format!(
                    "active {} pending {} executing {}",
                    c.active, c.pending, c.executing
                ),
                Err(e) => e.to_string(),
            }
        ),
        canceled == created.len() && idle,
    ));
    for broker in brokers {
        broker.shutdown().await;
    }
    steps
}

async fn futures_join<F: std::future::Future<Output = (u16, Value)>>(
    futures: impl Iterator<Item = F>,
) -> Vec<(u16, Value)> {
    // Concurrently, as a load balancer would send them: each on its own task would need 'static
    // borrows, so they are polled together here.
    let futures: Vec<_> = futures.map(Box::pin).collect();
    let mut outputs: Vec<Option<(u16, Value)>> = futures.iter().map(|_| None).collect();
    let mut futures: Vec<_> = futures.into_iter().map(Some).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (slot, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future ended"))
        .collect()
}
