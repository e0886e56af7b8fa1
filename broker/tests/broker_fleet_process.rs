//! A fleet as an operator runs it: three `admission serve --store postgres://... --redis URL
//! --replica NAME` processes on one real PostgreSQL and one real `redis-server`, every request
//! sent round-robin. A replica killed with `kill -9` while it executes work: that work ends
//! `failed` `execution_interrupted`, its approved work queued behind it runs on a survivor,
//! exactly once. PostgreSQL restarted under load: no `202` without its row, nothing doubled,
//! every replica's counts equal its rows after.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use support::http::request;
use support::postgres::PostgresServer;
use support::secrets::AGENT_SECRET;
use support::serve::{Files, Server};

/// One execution slot for the whole fleet: approved work queues behind a long run.
const LIMITS: &str = r#"{"requests_per_window": 10000, "window_seconds": 60,
  "client_active": 200, "client_pending": 200, "global_active": 1000, "global_executing": 1}"#;

/// Room for the load after the kill, reloaded with `SIGHUP`.
const ROOMY: &str = r#"{"requests_per_window": 10000, "window_seconds": 60,
  "client_active": 500, "client_pending": 500, "global_active": 1000, "global_executing": 100}"#;

const FLEET: &str = "f1,f2,f3";

/// A takeover waits for the dead replica's leases (10 s each) to lapse: a bound, not a claim.
const LEASE_PATIENCE: Duration = Duration::from_secs(60);

fn replica(redis: &str, store: &str, files: &Files, dir: &Path, name: &str) -> Server {
    let mut args: Vec<String> = ["--store", store, "--redis", redis]
        .map(str::to_owned)
        .into();
    args.extend(files.replica_args(dir, name, FLEET));
    Server::spawn(None, &args)
}

async fn state(server: &Server, id: &str) -> (String, String) {
    let reply = server
        .get(&format!("/api/agent/v1/operations/{id}"), AGENT_SECRET)
        .await;
    (
        reply.body["state"].as_str().unwrap_or_default().to_owned(),
        reply.body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + LEASE_PATIENCE;
    loop {
        if check().await {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_behind_round_robin_survives_a_kill_and_a_postgres_restart() {
    let Some(redis) = support::redis::RedisServer::start() else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    // A server of this test's own: it restarts it.
    let Some(mut postgres) = PostgresServer::start() else {
        return;
    };
    let url = postgres.database("fleet");
    let tmp = tempfile::tempdir().unwrap();
    let files = Files::write(tmp.path(), LIMITS);
    let mut fleet: Vec<Server> = ["f1", "f2", "f3"]
        .into_iter()
        .map(|name| replica(&redis.url(), &url, &files, tmp.path(), name))
        .collect();

    // Round-robin: each request created on one replica, replayed on the next, decided on the
    // third; all run once, one at a time.
    let mut ids = Vec::new();
    for n in 0..6 {
        let key = format!("rr-{n}");
        let created = fleet[n % 3]
            .submit(AGENT_SECRET, &request(&key, "demo.request", 0))
            .await;
        assert_eq!(created.status, 202, "{:?}", created.body);
        let replay = fleet[(n + 1) % 3]
            .submit(AGENT_SECRET, &request(&key, "demo.request", 0))
            .await;
        assert_eq!(replay.status, 200, "{:?}", replay.body);
        assert_eq!(replay.id(), created.id());
        ids.push(created.id());
    }
    for (n, id) in ids.iter().enumerate() {
        let approved = fleet[(n + 2) % 3].operator.approve(id).await;
        assert_eq!(approved.status, 200, "{:?}", approved.body);
    }
    for id in &ids {
        eventually("every approved request ran", async || {
            state(&fleet[0], id).await.0 == "succeeded"
        })
        .await;
    }

    // f1 runs long work (it holds the fleet's one execution slot) and has approved work queued
    // behind it (requested before the slot was taken: a full pool refuses new work); then it
    // is killed.
    let queued = fleet[0]
        .submit(AGENT_SECRET, &request("queued", "demo.request", 0))
        .await;
    assert_eq!(queued.status, 202, "{:?}", queued.body);
    let queued = queued.id();
    let running = fleet[0]
        .submit(AGENT_SECRET, &request("long", "demo.run", 600_000))
        .await;
    assert_eq!(running.status, 202, "{:?}", running.body);
    let running = running.id();
    eventually("f1 executes its long work", async || {
        state(&fleet[1], &running).await.0 == "executing"
    })
    .await;
    let approved = fleet[1].operator.approve(&queued).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    assert_eq!(state(&fleet[2], &queued).await.0, "approved");
    drop(fleet.remove(0)); // kill -9
    eventually(
        "f1's executing work ends execution_interrupted",
        async || {
            state(&fleet[0], &running).await
                == ("failed".to_owned(), "execution_interrupted".to_owned())
        },
    )
    .await;
    eventually("f1's queued work runs on a survivor", async || {
        state(&fleet[1], &queued).await.0 == "succeeded"
    })
    .await;
    let runs = postgres.psql(
        "fleet",
        &format!("SELECT revision || ' ' || owner FROM operations WHERE id = '{queued}'"),
    );
    let (revision, owner) = runs.trim().split_once(' ').unwrap();
    // Created, approved, started, succeeded: it started once.
    assert_eq!(revision, "4", "{runs}");
    assert!(owner == "f2" || owner == "f3", "{runs}");

    // PostgreSQL restarted under load: submissions on both survivors throughout, with room for
    // them all (reloaded on both).
    std::fs::write(&files.config, ROOMY).unwrap();
    for server in &fleet {
        server.sighup();
    }
    eventually("the roomier limits are in force", async || {
        let reply = fleet[0]
            .submit(AGENT_SECRET, &request("reloaded", "demo.request", 0))
            .await;
        reply.status == 202 || reply.status == 200
    })
    .await;
    let mut answered: BTreeMap<String, u16> = BTreeMap::new();
    for n in 0..60 {
        if n == 20 {
            postgres.crash_and_restart();
        }
        let key = format!("load-{n}");
        let reply = fleet[n % 2]
            .submit(AGENT_SECRET, &request(&key, "demo.run", 0))
            .await;
        assert!(
            [202, 503].contains(&reply.status),
            "{} {:?}",
            reply.status,
            reply.body
        );
        if reply.status == 503 {
            assert!(reply.retry_after().is_some(), "a 503 says when to retry");
        }
        answered.insert(key, reply.status);
    }
    // Every key retried until it is answered: created once, or replayed.
    for key in answered.keys() {
        let mut tries = 0;
        loop {
            let reply = fleet[tries % 2]
                .submit(AGENT_SECRET, &request(key, "demo.run", 0))
                .await;
            if reply.status == 200 {
                break;
            }
            assert!(
                [202, 503].contains(&reply.status),
                "{} {:?}",
                reply.status,
                reply.body
            );
            tries += 1;
            assert!(tries < 200, "{key} is never answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let rows = postgres.psql(
        "fleet",
        "SELECT count(*), count(DISTINCT idempotency_key) FROM operations WHERE idempotency_key LIKE 'load-%'",
    );
    assert_eq!(rows.trim(), "60|60", "one row per key, none doubled");
    for server in &fleet {
        eventually("counts equal rows on every survivor", async || {
            server.operator.drift().await["drift"] == 0
        })
        .await;
    }
    // Every load operation ran once and ended; nothing is left live or counted.
    eventually("the load ran to its end", async || {
        postgres.psql(
            "fleet",
            "SELECT count(*) FROM operations WHERE idempotency_key LIKE 'load-%' \
             AND state <> 'succeeded'",
        ) == "0"
    })
    .await;
    // The survivors together count each live row once (the request that found the reload).
    for live in ["pending", "approved", "executing"] {
        let rows: u64 = postgres
            .psql(
                "fleet",
                &format!("SELECT count(*) FROM operations WHERE state = '{live}'"),
            )
            .parse()
            .unwrap();
        let mut counted = 0;
        for server in &fleet {
            counted += server
                .metric(&format!("admission_operations{{state=\"{live}\"}}"))
                .await
                .unwrap_or(0);
        }
        assert_eq!(counted, rows, "{live}");
    }
}
