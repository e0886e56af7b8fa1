//! Broker replicas sharing admission through a real `redis-server`: a client's limits hold
//! across replicas, one idempotency key makes one operation whichever replica it reaches, and a
//! paused Redis answers new submissions with 503 `admission_unavailable` while cancels still work.

mod support;

use std::time::Duration;

use support::broker::{Harness, settings, start_shared, start_with};
use support::eventually::eventually;
use support::http::request;
use support::metrics::metric;
use support::secrets::AGENT_SECRET;
use unyolo_admission::StorageCaps;
use unyolo_admission::redis::RedisOptions;

/// Two pending operations per client, across every replica.
const TIGHT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 4, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;

async fn replica(
    server: &support::redis::RedisServer,
    dir: &std::path::Path,
    name: &str,
) -> Harness {
    let mut options = RedisOptions::new(server.url(), name);
    options.call_timeout = Duration::from_millis(300);
    options.circuit_cool_down = Duration::from_millis(200);
    let mut settings = settings(dir, TIGHT, StorageCaps::default());
    settings.broker_name = name.to_owned();
    start_shared(settings, options).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_pending_limit_holds_across_replicas() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1").await;
    let r2 = replica(&server, d2.path(), "r2").await;
    assert_eq!(
        r1.submit(AGENT_SECRET, &request("k1", "demo.request", 0))
            .await
            .status,
        202
    );
    assert_eq!(
        r2.submit(AGENT_SECRET, &request("k2", "demo.request", 0))
            .await
            .status,
        202
    );
    for harness in [&r1, &r2] {
        let refused = harness
            .submit(AGENT_SECRET, &request("k3", "demo.request", 0))
            .await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.code(), "client_pending_limit");
        assert_eq!(refused.retry_after(), Some(2));
    }
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_on_two_replicas_makes_one_operation() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1").await;
    let r2 = replica(&server, d2.path(), "r2").await;
    let body = request("same-key", "demo.request", 0);
    let (a, b) = tokio::join!(
        r1.submit(AGENT_SECRET, &body),
        r2.submit(AGENT_SECRET, &body)
    );
    let (created, other) = if a.status == 202 { (a, b) } else { (b, a) };
    assert_eq!(created.status, 202, "{:?}", created.body);
    assert_eq!(other.status, 409, "{:?}", other.body);
    assert_eq!(other.code(), "idempotency_key_elsewhere");
    let message = other.body["error"]["message"].as_str().unwrap();
    assert!(message.contains(&created.id()), "{message}");
    assert_eq!(r1.rows().await + r2.rows().await, 1);
    // The replica holding it answers the same key as a replay.
    let holder = if r1.rows().await == 1 { &r1 } else { &r2 };
    let replayed = holder.submit(AGENT_SECRET, &body).await;
    assert_eq!((replayed.status, replayed.id()), (200, created.id()));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_refuses_new_work_with_503_and_cancels_still_work() {
    let server = redis_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let r1 = replica(&server, dir.path(), "r1").await;
    let created = r1
        .submit(AGENT_SECRET, &request("before", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202);
    server.pause();
    let refused = r1
        .submit(AGENT_SECRET, &request("during", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(refused.code(), "admission_unavailable");
    assert!(refused.retry_after().is_some_and(|s| s >= 1));
    let canceled = r1
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", created.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(
        (canceled.status, canceled.state()),
        (200, "canceled"),
        "{:?}",
        canceled.body
    );
    assert_eq!(r1.rows().await, 1, "nothing created while Redis was paused");
    let metrics = r1.metrics().await;
    assert!(
        metrics.contains("admission_backend{backend=\"redis\"} 1"),
        "{metrics}"
    );
    assert!(metric(&metrics, "admission_redis_errors_total").is_some_and(|n| n > 0));
    assert!(metric(&metrics, "admission_redis_unavailable_total").is_some_and(|n| n > 0));
    server.resume();
    assert!(
        eventually(async || {
            r1.submit(AGENT_SECRET, &request("after", "demo.request", 0))
                .await
                .status
                == 202
        })
        .await
    );
    r1.broker.shutdown().await;
}

#[test]
fn the_replica_drill_passes_every_step_against_its_own_redis() {
    let Some(server) = support::redis::RedisServer::start() else {
        return;
    };
    let output = assert_cmd::Command::cargo_bin("admission")
        .unwrap()
        .args(["drill", "--replicas", "3", "--redis", &server.url()])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{table}");
    assert_eq!(table.matches(" pass ").count(), 4, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_before_redis_serves_reads_answers_503_then_registers_its_work() {
    if !support::redis::installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // An earlier run (alone) left two pending operations in the store.
    let mut lone = settings(dir.path(), TIGHT, StorageCaps::default());
    lone.broker_name = "r1".to_owned();
    let earlier = start_with(lone).await;
    let first = earlier
        .submit(AGENT_SECRET, &request("first", "demo.request", 0))
        .await;
    let second = earlier
        .submit(AGENT_SECRET, &request("second", "demo.request", 0))
        .await;
    assert_eq!((first.status, second.status), (202, 202));
    earlier.broker.shutdown().await;

    // Nothing listens on the port yet.
    let port = support::redis::free_port();
    let mut options = RedisOptions::new(format!("redis://127.0.0.1:{port}/"), "r1");
    options.call_timeout = Duration::from_millis(300);
    options.circuit_cool_down = Duration::from_millis(200);
    options.heartbeat = Duration::from_millis(200);
    options.lease_ttl = Duration::from_secs(2);
    let mut shared_settings = settings(dir.path(), TIGHT, StorageCaps::default());
    shared_settings.broker_name = "r1".to_owned();
    let r1 = start_shared(shared_settings, options).await;

    let refused = r1
        .submit(AGENT_SECRET, &request("third", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(refused.code(), "admission_unavailable");
    assert!(refused.retry_after().is_some_and(|s| s >= 1));
    let read = r1
        .get(
            &format!("/api/agent/v1/operations/{}", second.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!((read.status, read.state()), (200, "pending"));
    let canceled = r1
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", first.id()),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!((canceled.status, canceled.state()), (200, "canceled"));
    assert_eq!(r1.get("/healthz", None).await.status, 200);
    let metrics = r1.metrics().await;
    assert!(
        metrics.contains("admission_redis_lease_held 0"),
        "{metrics}"
    );
    assert_eq!(r1.rows().await, 2, "nothing created while Redis was down");

    let server = support::redis::RedisServer::start_on(port).expect("redis-server on the port");
    // Registered, then admitting: the client's pending limit (2) has room for one more beside
    // the restored pending operation (the canceled one is not counted).
    assert!(
        eventually(async || {
            r1.submit(AGENT_SECRET, &request("third", "demo.request", 0))
                .await
                .status
                == 202
        })
        .await
    );
    // Another replica sees the restored operation in the shared counts: the limit is reached.
    let d2 = tempfile::tempdir().unwrap();
    let r2 = replica(&server, d2.path(), "r2").await;
    let full = r2
        .submit(AGENT_SECRET, &request("fourth", "demo.request", 0))
        .await;
    assert_eq!((full.status, full.code()), (429, "client_pending_limit"));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}
