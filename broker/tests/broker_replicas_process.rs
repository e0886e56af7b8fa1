//! Three `admission serve --redis URL --replica NAME --replicas r1,r2,r3` processes sharing one
//! real `redis-server`: a client's pending limit holds across them; `kill -9` of one frees its
//! holdings once its lease lapses (exactly once); restarted under the same name on the same data
//! dir, its restored work is counted again, once.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::http::request;
use support::secrets::AGENT_SECRET;
use support::serve::{Files, Server};

/// Three pending operations per client, across every replica.
const TIGHT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 10, "client_pending": 3, "global_active": 100, "global_executing": 10}"#;

/// A bound on waiting for a lapsed lease (its TTL is 10 s) to be reaped: not a timing claim.
const LEASE_PATIENCE: Duration = Duration::from_secs(40);

/// Every replica of each test's deployment (`--replicas`): at its first start the replicas
/// admit as soon as all three have registered, not one lease period later.
const FLEET: &str = "r1,r2,r3";

/// `admission serve` as replica `name` (one of [`FLEET`]), with a data dir of its own under
/// `dir`.
fn replica(redis_url: &str, files: &Files, dir: &Path, name: &str) -> Server {
    let mut args = vec!["--redis".to_owned(), redis_url.to_owned()];
    args.extend(files.replica_args(dir, name, FLEET));
    Server::spawn(None, &args)
}

/// Submits a pending `demo.request`: `(status, code, id)`.
async fn submit(server: &Server, key: &str) -> (u16, String, String) {
    let reply = server
        .submit(AGENT_SECRET, &request(key, "demo.request", 0))
        .await;
    (reply.status, reply.code().to_owned(), reply.id())
}

/// The ids of the pending requests in a replica's operator inbox (its own operator listener:
/// each replica shows its own requests).
async fn inbox(server: &Server) -> Vec<String> {
    server.operator.pending().await
}

async fn deny(server: &Server, id: &str) {
    let reply = server.operator.deny(id).await;
    assert_eq!(reply.status, 200, "deny {id}: {}", reply.body);
}

/// Asserts a fresh submission on every replica is refused with 429 `client_pending_limit`.
async fn assert_full(replicas: &[&Server], key: &str) {
    for (i, server) in replicas.iter().enumerate() {
        let (status, code, _) = submit(server, &format!("{key}-{i}")).await;
        assert_eq!(
            (status, code.as_str()),
            (429, "client_pending_limit"),
            "replica {i} at the limit"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_serve_replicas_holdings_are_freed_once_when_its_lease_lapses_and_counted_once_on_restart()
 {
    let redis = redis_or_skip!();
    let url = format!("{}0", redis.url());
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), TIGHT);
    let mut r1 = Some(replica(&url, &files, dir.path(), "r1"));
    let r2 = replica(&url, &files, dir.path(), "r2");
    let r3 = replica(&url, &files, dir.path(), "r3");

    // r1 holds two pending operations, r2 one: the client is at its limit on every replica.
    let first = r1.as_ref().unwrap();
    for (server, key) in [(first, "a1"), (first, "a2"), (&r2, "b1")] {
        let (status, code, _) = submit(server, key).await;
        assert_eq!(status, 202, "{key}: {code}");
    }
    assert_full(&[first, &r2, &r3], "full").await;

    // kill -9 (Server's drop sends SIGKILL and reaps it).
    drop(r1.take());

    // A survivor admits again once r1's lease lapses and its holdings are released.
    let deadline = Instant::now() + LEASE_PATIENCE;
    let mut attempt = 0;
    let freed_first = loop {
        attempt += 1;
        let (status, code, id) = submit(&r3, &format!("wait-{attempt}")).await;
        if status == 202 {
            break id;
        }
        assert_eq!(
            (status, code.as_str()),
            (429, "client_pending_limit"),
            "refused only for the limit while r1's lease runs"
        );
        assert!(
            Instant::now() < deadline,
            "r1's holdings were never released"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // Exactly the two r1 held were freed: one more is admitted, then the limit holds again.
    let (status, code, freed_second) = submit(&r2, "after-kill-2").await;
    assert_eq!(status, 202, "{code}");
    assert_full(&[&r2, &r3], "after-kill-full").await;
    let mut survivors = inbox(&r2).await;
    survivors.extend(inbox(&r3).await);
    assert_eq!(survivors.len(), 3, "{survivors:?}");

    // r1 restarts under the same name on the same data dir and restores its two pending ops.
    let r1 = replica(&url, &files, dir.path(), "r1");
    // Its holdings are replaced in Redis before it admits; wait (bounded) until it says so.
    let deadline = Instant::now() + LEASE_PATIENCE;
    while !r1.logged().contains("registered with redis") {
        assert!(
            Instant::now() < deadline,
            "r1 never registered:\n{}",
            r1.logged()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let restored = inbox(&r1).await;
    assert_eq!(restored.len(), 2, "{restored:?}");
    // Five pending in all, over the limit: refused everywhere.
    assert_full(&[&r1, &r2, &r3], "restored-full").await;

    // Denying the two admitted after the kill leaves three: r1's restored work is counted.
    deny(&r3, &freed_first).await;
    deny(&r2, &freed_second).await;
    assert_full(&[&r1, &r2, &r3], "restored-counted").await;

    // Denying one restored op frees exactly one slot: it was counted once, not twice.
    deny(&r1, &restored[0]).await;
    let (status, code, _) = submit(&r3, "one-slot").await;
    assert_eq!(status, 202, "{code}");
    assert_full(&[&r1, &r2, &r3], "one-slot-full").await;
    let mut all = inbox(&r1).await;
    all.extend(inbox(&r2).await);
    all.extend(inbox(&r3).await);
    assert_eq!(
        all.len(),
        3,
        "pending across the inboxes equals the limit: {all:?}"
    );
}

/// The agent may hold one pending operation, across every replica.
const ONE_PENDING: &str = r#"{"requests_per_window": 100000, "window_seconds": 60,
  "client_active": 10, "client_pending": 1, "global_active": 100, "global_executing": 10}"#;

/// The capacity hint `serve` gives (its Retry-After for a capacity refusal).
const CAPACITY_HINT: Duration = Duration::from_secs(2);
/// A replica's heartbeat period (a third of its 10 s lease): each beat is two scripts.
const BEAT: Duration = Duration::from_millis(3333);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_flood_on_three_serve_replicas_costs_redis_one_call_per_replica_per_hint_and_a_release_ends_it()
 {
    use support::secrets::OTHER_SECRET;
    let redis = redis_or_skip!();
    let url = format!("{}0", redis.url());
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), ONE_PENDING);
    let replicas = [
        replica(&url, &files, dir.path(), "r1"),
        replica(&url, &files, dir.path(), "r2"),
        replica(&url, &files, dir.path(), "r3"),
    ];
    // The agent holds its one pending operation (on r1); the other client's work is admitted
    // and denied on every replica (every script is loaded before counting).
    let (status, code, held) = submit(&replicas[0], "held").await;
    assert_eq!(status, 202, "{code}");
    for (i, server) in replicas.iter().enumerate() {
        let reply = server
            .submit(
                OTHER_SECRET,
                &request(&format!("warm-{i}"), "demo.request", 0),
            )
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        deny(server, &reply.id()).await;
        support::eventually::assert_eventually("the notices are heard", async || {
            server.metric("admission_redis_notices_live").await == Some(1)
        })
        .await;
    }

    let before = support::redis::script_calls(redis.port);
    let started = Instant::now();
    // The flood: two looping clients per replica, at once on every replica, each submission
    // with a new key; the other client is admitted (and denied) on every replica meanwhile.
    let mut floods = Vec::new();
    for (i, server) in replicas.iter().enumerate() {
        for loop_no in 0..2 {
            let base = server.base.clone();
            floods.push(tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut refused = 0u64;
                for n in 0..40 {
                    let reply = http
                        .post(format!("{base}/api/agent/v1/operations"))
                        .bearer_auth(AGENT_SECRET)
                        .json(&request(
                            &format!("flood-{i}-{loop_no}-{n}"),
                            "demo.request",
                            0,
                        ))
                        .send()
                        .await
                        .unwrap();
                    let status = reply.status().as_u16();
                    let body: Value = reply.json().await.unwrap();
                    assert_eq!(
                        (status, body["error"]["code"].as_str()),
                        (429, Some("client_pending_limit")),
                        "{body}"
                    );
                    refused += 1;
                }
                refused
            }));
        }
    }
    let mut other_admitted = 0u64;
    for round in 0..3 {
        for (i, server) in replicas.iter().enumerate() {
            let reply = server
                .submit(
                    OTHER_SECRET,
                    &request(&format!("other-{round}-{i}"), "demo.request", 0),
                )
                .await;
            assert_eq!(
                reply.status, 202,
                "the other client is admitted: {}",
                reply.body
            );
            deny(server, &reply.id()).await;
            other_admitted += 1;
        }
    }
    let mut refused = 0;
    for flood in floods {
        refused += flood.await.unwrap();
    }
    let elapsed = started.elapsed();
    let calls = support::redis::script_calls(redis.port) - before;
    // At most one call per replica per capacity hint for the agent, the other client's
    // admissions and denials (one release notice each), and each replica's heartbeats.
    let windows = (elapsed.as_secs_f64() / CAPACITY_HINT.as_secs_f64()).ceil() as u64 + 1;
    let beats = (elapsed.as_secs_f64() / BEAT.as_secs_f64()).ceil() as u64 + 1;
    let allowed = 3 * windows + 2 * other_admitted + 3 * 2 * beats;
    assert_eq!(refused, 240);
    eprintln!("{calls} script calls for {refused} refusals in {elapsed:?} (at most {allowed})");
    assert!(
        calls <= allowed,
        "{calls} script calls for {refused} refusals in {elapsed:?} (at most {allowed})"
    );
    let mut from_memory = 0;
    for server in &replicas {
        from_memory += server
            .metric("admission_redis_refusals_from_memory_total")
            .await
            .unwrap();
    }
    assert!(
        from_memory >= refused - 3 * windows,
        "{from_memory} of {refused} refusals answered from memory"
    );

    // Denying the held operation on r1 ends the memory on r2 and r3: the agent's next
    // submission there is decided by Redis, and admitted.
    deny(&replicas[0], &held).await;
    let mut attempt = 0;
    support::eventually::assert_eventually("the agent is admitted on r2", async || {
        attempt += 1;
        let (status, code, _) = submit(&replicas[1], &format!("after-{attempt}")).await;
        assert!(
            status == 202 || code == "client_pending_limit",
            "{status} {code}"
        );
        status == 202
    })
    .await;
    let forgotten = replicas[2]
        .metric("admission_redis_refusals_forgotten_total{reason=\"release\"}")
        .await
        .unwrap();
    assert!(
        forgotten >= 1,
        "r3 forgot the agent's refusal on the release"
    );
}
