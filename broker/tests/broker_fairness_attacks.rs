//! SPEC section 6, "no client starves the others", played by an attacker holding a valid client
//! secret against the `admission serve` binary: trickled 1 MiB bodies on many connections, pages
//! of heavy rows listed concurrently, heavy replays on many connections, and a stream upload
//! trickled below the minimum rate. Each test asserts outcomes: the broker's memory (read from
//! `/proc/<pid>/status` of the server process) stays within its byte budget and a stated margin,
//! another client's requests are answered, and nothing is created or counted that should not be.
//! Latencies under the same attacks are measured in `benches/fairness.rs`.

mod support;

use serde_json::{Value, json};
use support::eventually::{PATIENCE, assert_eventually};
use support::http::{read_answer, request};
use support::secrets::{AGENT_SECRET, OTHER_SECRET};
use support::serve::{Files, Server};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// Roomy limits: admission refuses nothing here (50 heavy operations fit the active limit).
const LIMITS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60, "client_active": 100,
  "client_pending": 10, "global_active": 200, "global_executing": 10}"#;

/// What the broker may hold beyond its byte budget under these attacks: its own code, the
/// runtime and SQLite's page cache, hyper's per-connection buffers, and allocator slack.
const MARGIN: u64 = 96 << 20;

const MIB: usize = 1 << 20;

/// Padding that keeps a submission just under the 1 MiB body limit.
const HEAVY_PADDING: usize = 1_000_000;

fn serve(files: &Files, extra: &[&str]) -> Server {
    let mut args = files.args();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    Server::spawn(None, &args)
}

/// A `demo.run` submission under `key` whose arguments carry `padding` bytes.
fn heavy_request(key: &str, padding: usize) -> Value {
    json!({
        "idempotency_key": key,
        "operation": "demo.run",
        "target": {"repo": "unyolo/test"},
        "arguments": {"duration_ms": 0, "padding": "x".repeat(padding)},
        "reason": "a heavy row",
    })
}

/// Submits `count` heavy operations for the agent, keys `{prefix}-0..`, each answered 202.
async fn seed_heavy(server: &Server, prefix: &str, count: usize) -> Vec<Value> {
    let mut bodies = Vec::new();
    for n in 0..count {
        let body = heavy_request(&format!("{prefix}-{n}"), HEAVY_PADDING);
        let reply = server.submit(AGENT_SECRET, &body).await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        bodies.push(body);
    }
    bodies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_megabyte_bodies_from_one_client_keep_the_brokers_memory_within_its_budget() {
    const ATTACKERS: usize = 160;
    // Room for 16 whole bodies and half a MiB for small ones.
    const BUDGET: usize = 16 * MIB + MIB / 2;
    const HELD: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    // A share for 22 whole bodies at once (18 units each): more than the byte budget holds, so
    // the budget binds first; past the share, the client's own queue refuses the rest.
    let server = serve(
        &files,
        &[
            "--buffered-bytes",
            &BUDGET.to_string(),
            "--client-requests",
            "400",
        ],
    );
    let addr = server.addr;
    let calm = server.memory();

    // Each attacker declares a 1 MiB body, sends all of it but its last byte at once, and
    // holds that byte back: a body that is never done and never too slow.
    let (release, _) = watch::channel(false);
    let (answered, mut answers) = mpsc::unbounded_channel();
    let mut attackers = JoinSet::new();
    for n in 0..ATTACKERS {
        let (mut released, answered) = (release.subscribe(), answered.clone());
        attackers.spawn(async move {
            let stream = TcpStream::connect(addr).await.unwrap();
            let (mut read, mut write) = stream.into_split();
            let prefix = format!("{{\"idempotency_key\": \"slow-{n}\", \"reason\": \"");
            let head = format!(
                "POST /api/agent/v1/operations HTTP/1.1\r\nHost: x\r\n\
                 Authorization: Bearer {AGENT_SECRET}\r\nContent-Type: application/json\r\n\
                 Content-Length: {MIB}\r\n\r\n{prefix}"
            );
            let writer = tokio::spawn(async move {
                let _ = write.write_all(head.as_bytes()).await;
                let _ = write.write_all(&vec![b'x'; MIB - prefix.len() - 1]).await;
                // Held open (never the last byte) until the task is aborted.
                std::future::pending::<()>().await;
                drop(write);
            });
            tokio::select! {
                answer = read_answer(&mut read) => { let _ = answered.send(answer); }
                _ = released.changed() => {}
            }
            writer.abort();
        });
    }
    drop(answered);

    // All but the bodies the budget holds are answered, unread: 503 past the budget, or 429
    // past the client's share.
    let mut past_budget = 0;
    for _ in 0..ATTACKERS - HELD {
        let answer = tokio::time::timeout(PATIENCE, answers.recv())
            .await
            .expect("a body past the budget was answered")
            .unwrap();
        if answer.starts_with("HTTP/1.1 503") {
            assert!(answer.contains("body_budget_exhausted"), "{answer}");
            past_budget += 1;
        } else {
            assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
            assert!(answer.contains("client_request_limit"), "{answer}");
        }
        assert!(
            answer.to_ascii_lowercase().contains("retry-after: 1"),
            "{answer}"
        );
    }
    assert!(past_budget > 0, "no body was refused by the byte budget");
    assert_eq!(
        server.metric("broker_buffered_bytes ").await,
        Some((HELD * MIB) as u64)
    );

    // Meanwhile another client's submission and reads, and /healthz, are answered.
    let other = server
        .submit(OTHER_SECRET, &request("victim", "demo.run", 0))
        .await;
    assert_eq!(other.status, 202, "{}", other.body);
    let listed = server.get("/api/agent/v1/operations", OTHER_SECRET).await;
    assert_eq!(listed.status, 200, "{}", listed.body);
    let health = server.get("/healthz", OTHER_SECRET).await;
    assert_eq!(health.status, 200);

    let attacked = server.memory();
    eprintln!(
        "resident {} MiB, peak {} MiB (calm peak {} MiB), budget {} MiB",
        attacked.resident >> 20,
        attacked.peak >> 20,
        calm.peak >> 20,
        BUDGET >> 20
    );
    let bound = calm.peak + BUDGET as u64 + MARGIN;
    assert!(
        attacked.peak < bound,
        "peak {} bytes, above the budget and margin ({bound})",
        attacked.peak
    );

    // The attackers hang up: their bytes come back, and only the victim's submission exists.
    let _ = release.send(true);
    while attackers.join_next().await.is_some() {}
    assert_eventually("the held bodies' bytes are given back", async || {
        server.metric("broker_buffered_bytes ").await == Some(0)
    })
    .await;
    assert_eq!(
        server
            .metric("broker_submissions_total{result=\"created\"}")
            .await,
        Some(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_heavy_rows_listed_concurrently_read_no_request_and_leave_another_client_answered()
{
    const ROWS: usize = 50;
    const LISTERS: usize = 8;
    const PAGES: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    let server = std::sync::Arc::new(serve(&files, &[]));
    seed_heavy(&server, "heavy", ROWS).await;
    let own = server
        .submit(OTHER_SECRET, &request("own", "demo.run", 0))
        .await;
    assert_eq!(own.status, 202, "{}", own.body);
    let calm = server.memory();

    let mut listers = JoinSet::new();
    for _ in 0..LISTERS {
        let server = std::sync::Arc::clone(&server);
        listers.spawn(async move {
            for _ in 0..PAGES {
                let page = server
                    .get("/api/agent/v1/operations?limit=50", AGENT_SECRET)
                    .await;
                assert_eq!(page.status, 200, "{}", page.body);
                let operations = page.body["operations"].as_array().unwrap();
                assert_eq!(operations.len(), ROWS);
                // Summaries: the presentation, never the request.
                for summary in operations {
                    assert!(summary.get("arguments").is_none(), "{summary}");
                    assert!(summary["presentation"]["title"].is_string(), "{summary}");
                }
            }
        });
    }
    // Another client's list is answered meanwhile, with its own operation only.
    for _ in 0..PAGES {
        let page = server.get("/api/agent/v1/operations", OTHER_SECRET).await;
        assert_eq!(page.status, 200, "{}", page.body);
        assert_eq!(page.body["operations"][0]["id"], own.body["id"]);
    }
    while let Some(done) = listers.join_next().await {
        done.unwrap();
    }
    let listed = server.memory();
    eprintln!(
        "heavy pages: peak {} MiB before, {} MiB after {} pages",
        calm.peak >> 20,
        listed.peak >> 20,
        LISTERS * PAGES
    );
    assert!(
        listed.peak < calm.peak + MARGIN,
        "listing raised the peak from {} to {} bytes",
        calm.peak,
        listed.peak
    );
    assert_eq!(server.metric("broker_buffered_bytes ").await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_replays_on_sixteen_connections_leave_another_clients_submissions_admitted() {
    const REPLAYERS: usize = 16;
    const ROUNDS: usize = 6;
    const VICTIM: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    let server = std::sync::Arc::new(serve(&files, &[]));
    let bodies = seed_heavy(&server, "replayed", REPLAYERS).await;

    let mut replayers = JoinSet::new();
    for body in bodies {
        let server = std::sync::Arc::clone(&server);
        replayers.spawn(async move {
            let mut replayed = 0u64;
            for _ in 0..ROUNDS {
                let reply = server.submit(AGENT_SECRET, &body).await;
                match (reply.status, reply.code()) {
                    (200, _) => replayed += 1,
                    // Past the byte budget, or past the client's share: refused, never created.
                    (503, "response_budget_exhausted") | (429, "client_request_limit") => {}
                    other => panic!("a replay answered {other:?}: {}", reply.body),
                }
            }
            replayed
        });
    }
    // The other client's new work is admitted throughout.
    for n in 0..VICTIM {
        let reply = server
            .submit(
                OTHER_SECRET,
                &request(&format!("victim-{n}"), "demo.run", 0),
            )
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
    }
    let mut replayed = 0;
    while let Some(done) = replayers.join_next().await {
        replayed += done.unwrap();
    }
    assert!(replayed > 0, "no replay was answered");
    assert_eq!(
        server
            .metric("broker_submissions_total{result=\"replayed\"}")
            .await,
        Some(replayed)
    );
    assert_eq!(
        server
            .metric("broker_submissions_total{result=\"created\"}")
            .await,
        Some((REPLAYERS + VICTIM) as u64)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_trickled_below_the_minimum_rate_is_cut_off_408_and_leaves_nothing_stored() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    // The default minimum rate (4096 bytes a second after a 2 s grace).
    let server = serve(&files, &[]);
    let stream = TcpStream::connect(server.addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = format!(
        "POST /api/agent/v1/streams HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_SECRET}\r\n\
         Content-Type: application/octet-stream\r\nContent-Length: {MIB}\r\n\r\n"
    );
    write.write_all(head.as_bytes()).await.unwrap();
    // One byte every 100 ms: ten bytes a second, far below the minimum.
    let trickle = tokio::spawn(async move {
        loop {
            if write.write_all(b"s").await.is_err() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    });
    let answer = tokio::time::timeout(PATIENCE, read_answer(&mut read))
        .await
        .expect("the trickled upload was answered");
    trickle.abort();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");

    // No stream file, no stored bytes or files counted, no drift, and the cut-off counted.
    let streams = files.data.join("streams");
    assert_eventually("the partial stream file is removed", async || {
        std::fs::read_dir(&streams).map_or(true, |mut entries| entries.next().is_none())
    })
    .await;
    assert_eq!(
        server
            .metric("admission_storage_bytes{store=\"stream\"}")
            .await,
        Some(0)
    );
    assert_eq!(
        server
            .metric("admission_storage_files{store=\"stream\"}")
            .await,
        Some(0)
    );
    assert_eq!(
        server
            .metric("broker_body_deadlines_total{reason=\"too_slow\"}")
            .await,
        Some(1)
    );
    let drift = server.operator.drift().await;
    assert_eq!(drift["drift"], 0, "{drift}");
}
