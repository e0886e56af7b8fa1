//! Broker replicas sharing admission through a real `redis-server`: a client's limits hold
//! across replicas, one idempotency key makes one operation whichever replica it reaches, and a
//! paused Redis answers new submissions with 503 `admission_unavailable` while cancels still work.

mod support;

use std::time::Duration;

use support::broker::{Harness, settings, start_shared, start_with};
use support::contract::assert_conforms;
use support::eventually::eventually;
use support::http::request;
use support::metrics::metric;
use support::quota::{FIVE_AN_HOUR, Quota};
use support::secrets::{AGENT, AGENT_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission::redis::RedisOptions;

/// Two pending operations per client, across every replica.
const TIGHT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 4, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;

/// Broker replica `name`, one of `fleet` (every replica of the test's deployment, itself
/// included: knowing the whole fleet, the replicas admit as soon as all of it has registered at
/// the deployment's first start, not one lease period later).
async fn replica(
    server: &support::redis::RedisServer,
    dir: &std::path::Path,
    name: &str,
    fleet: &[&str],
) -> Harness {
    let mut options = RedisOptions::new(server.url(), name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
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
    let r1 = replica(&server, d1.path(), "r1", &["r1", "r2"]).await;
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
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
async fn a_shadow_file_judges_each_replicas_own_submissions_and_changes_no_answer() {
    let server = redis_or_skip!();
    // One pending request per client in the candidate; the real file allows two fleet-wide.
    let candidate = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 4, "client_pending": 1, "global_active": 100, "global_executing": 10}"#;
    let shadowed = async |dir: &std::path::Path, name: &str| {
        let mut options = RedisOptions::new(server.url(), name);
        options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
        let mut settings = settings(dir, TIGHT, StorageCaps::default());
        let identities: Vec<_> = settings.config.identities().cloned().collect();
        settings.shadow =
            Some(unyolo_admission::Config::from_bytes(candidate.as_bytes(), identities).unwrap());
        settings.broker_name = name.to_owned();
        start_shared(settings, options).await
    };
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = shadowed(d1.path(), "r1").await;
    let r2 = shadowed(d2.path(), "r2").await;
    let submit = async |replica: &Harness, key: &str| {
        replica
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await
    };
    assert_eq!(submit(&r1, "k1").await.status, 202);
    assert_eq!(submit(&r2, "k2").await.status, 202);
    let refused = submit(&r1, "k3").await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "client_pending_limit"),
        "the real file decides, fleet-wide"
    );
    // Each replica's shadow counts what that replica held: r2's admitted k2 with r1's k1 live
    // on the other replica.
    let verdicts = |replica: &Harness| {
        let report = replica.broker.shadow().expect("a shadow").report();
        let agent = report
            .clients
            .into_iter()
            .find(|c| c.identity.as_str() == AGENT)
            .unwrap();
        (agent.admitted, agent.refused)
    };
    use unyolo_admission::RefusalCode::ClientPendingLimit;
    assert_eq!(verdicts(&r1), (1, vec![(ClientPendingLimit, 1)]));
    assert_eq!(verdicts(&r2), (1, vec![]));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_on_two_replicas_makes_one_operation() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1", &["r1", "r2"]).await;
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
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
    let r1 = replica(&server, dir.path(), "r1", &["r1"]).await;
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
    // A replay needs nothing from Redis: answered, with this replica's own quota as the best
    // there is while the shared one cannot be read.
    let replayed = r1
        .submit(AGENT_SECRET, &request("before", "demo.request", 0))
        .await;
    assert_eq!(replayed.status, 200, "{:?}", replayed.body);
    assert!(replayed.header("ratelimit").is_some());
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
    // The deployment is r1 alone until r2 joins it below.
    options.replicas = vec!["r1".to_owned()];
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
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
    let full = r2
        .submit(AGENT_SECRET, &request("fourth", "demo.request", 0))
        .await;
    assert_eq!((full.status, full.code()), (429, "client_pending_limit"));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

/// Replica `name` of `fleet` (as [`replica`]) whose retention is one second, swept only on
/// demand, on a clock a test moves.
async fn retiring_replica(
    server: &support::redis::RedisServer,
    dir: &std::path::Path,
    name: &str,
    fleet: &[&str],
    ahead: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> Harness {
    use unyolo_admission_broker::{Keep, RetentionSettings, WallClock};
    let mut options = RedisOptions::new(server.url(), name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.call_timeout = Duration::from_secs(2);
    let mut settings = settings(dir, ROOMY_RATE, StorageCaps::default());
    settings.broker_name = name.to_owned();
    settings.retention = RetentionSettings {
        keep: Keep::For(Duration::from_secs(1)),
        sweep_interval: Duration::ZERO,
        clock: WallClock::from_fn(move || {
            std::time::SystemTime::now()
                + Duration::from_secs(ahead.load(std::sync::atomic::Ordering::Relaxed))
        }),
    };
    start_shared(settings, options).await
}

/// A recovery after Redis forgot reads the store's key records and writes them back; a
/// retention sweep unbinds keys, then deletes their rows. Interleaved (the recovery reading the
/// row before the sweep deletes it, and writing the key back after the sweep unbound it), the
/// key was bound again to an operation no store holds, and every other replica answered it
/// `idempotency_key_elsewhere` for the key's whole lifetime. A sweep now unbinds the keys again
/// once the rows are deleted, excluding any recovery's read-then-restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_during_a_retention_sweep_never_binds_a_retired_key_again() {
    let server = redis_or_skip!();
    let ahead = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = retiring_replica(&server, d1.path(), "r1", &["r1", "r2"], ahead.clone()).await;
    let r2 = retiring_replica(&server, d2.path(), "r2", &["r1", "r2"], ahead.clone()).await;
    let first = r1
        .submit(AGENT_SECRET, &request("gone", "demo.run", 0))
        .await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert!(
        eventually(async || r1.snapshot().is_idle()).await,
        "the run finishes"
    );
    assert_eq!(key_records_in_redis(&server), 1);
    ahead.store(3600, std::sync::atomic::Ordering::Relaxed);
    // Another process holds the store's write lock for 3 s: the sweep unbinds the key, then
    // waits to delete the row, which readers still see.
    let holder = support::faults::lock_store(d1.path(), Duration::from_secs(3));
    let sweep = r1.broker.sweep_now();
    let recovery = async {
        let unbound = eventually(async || key_records_in_redis(&server) == 0).await;
        assert!(unbound, "the sweep unbinds the key");
        server.flush_all();
        // Registers again at once (the heartbeat would too, a little later), while the row is
        // still there: the recovery binds the key again.
        let _ = r1.broker.admission().renew().await;
        assert_eq!(
            key_records_in_redis(&server),
            1,
            "the recovery restored the key"
        );
    };
    let (swept, ()) = tokio::join!(sweep, recovery);
    holder.join().unwrap();
    // Once the row is deleted, the sweep unbinds it again.
    assert_eq!(key_records_in_redis(&server), 0);
    let swept = swept.unwrap();
    assert_eq!((swept.retired, swept.deferred), (1, 0), "{swept:?}");
    assert!(
        r1.broker
            .database()
            .get(&first.id())
            .await
            .unwrap()
            .is_none()
    );
    // Once the replicas admit again, the key is new work on either.
    let mut last = (0, String::new());
    let admitted = eventually(async || {
        let reply = r2
            .submit(AGENT_SECRET, &request("gone", "demo.run", 0))
            .await;
        last = (reply.status, reply.code().to_owned());
        reply.status != 503
    })
    .await;
    assert!(admitted, "r2 never admitted again: {last:?}");
    assert_eq!(last.0, 202, "{last:?}");
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

const ROOMY_RATE: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 100, "client_pending": 50, "global_active": 500, "global_executing": 50}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_sweep_racing_replays_on_two_replicas_makes_every_later_submission_new_work() {
    let server = redis_or_skip!();
    let ahead = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = retiring_replica(&server, d1.path(), "r1", &["r1", "r2"], ahead.clone()).await;
    let r2 = retiring_replica(&server, d2.path(), "r2", &["r1", "r2"], ahead.clone()).await;
    // Twenty operations on r1 that finish at once (demo.run, no duration).
    let keys: Vec<String> = (0..20).map(|i| format!("retire-{i}")).collect();
    let mut first = Vec::new();
    for key in &keys {
        let reply = r1.submit(AGENT_SECRET, &request(key, "demo.run", 0)).await;
        assert_eq!(reply.status, 202, "{key}");
        first.push(reply.id());
    }
    assert!(
        eventually(async || r1.snapshot().is_idle()).await,
        "the runs finish"
    );
    // While live in the store, the keys replay on r1 and are held elsewhere on r2.
    assert_eq!(
        r1.submit(AGENT_SECRET, &request(&keys[0], "demo.run", 0))
            .await
            .status,
        200
    );
    assert_eq!(
        r2.submit(AGENT_SECRET, &request(&keys[0], "demo.run", 0))
            .await
            .code(),
        "idempotency_key_elsewhere"
    );
    // Past the retention: the sweep runs while both replicas replay the keys.
    ahead.store(3600, std::sync::atomic::Ordering::Relaxed);
    let sweep = r1.broker.sweep_now();
    let replays = async {
        let mut answers = Vec::new();
        for key in &keys {
            for h in [&r1, &r2] {
                let reply = h.submit(AGENT_SECRET, &request(key, "demo.run", 0)).await;
                answers.push((
                    key.clone(),
                    reply.status,
                    reply.code().to_owned(),
                    reply.id(),
                ));
            }
        }
        answers
    };
    let (swept, answers) = tokio::join!(sweep, replays);
    let swept = swept.unwrap();
    assert_eq!(swept.deferred, 0, "{swept:?}");
    // During the race a key answers as a replay of its row while the row is there, as held
    // elsewhere (by that same operation, on r1) while its key is still bound, or as new work.
    for (key, status, code, _) in &answers {
        match *status {
            200 | 202 => {}
            409 => assert_eq!(code, "idempotency_key_elsewhere", "{key}"),
            other => panic!("{key}: {other} {code}"),
        }
    }
    // Every operation of the first round is gone, and every later submission of its key, on
    // either replica, is new work (or a replay of that new work).
    for (key, original) in keys.iter().zip(&first) {
        assert!(
            r1.broker.database().get(original).await.unwrap().is_none(),
            "{key} retired"
        );
        for h in [&r2, &r1] {
            let reply = h.submit(AGENT_SECRET, &request(key, "demo.run", 0)).await;
            assert!(
                matches!(reply.status, 200 | 202 | 409),
                "{key}: {} {}",
                reply.status,
                reply.code()
            );
            assert_ne!(
                &reply.id(),
                original,
                "{key} answered with its retired operation"
            );
            if reply.status == 409 {
                // Bound to the new work another replica made: its row exists there.
                assert_eq!(reply.code(), "idempotency_key_elsewhere");
            }
        }
    }
}

/// A key's lifetime in Redis (`PTTL`, in ms; negative when it has none or is gone).
fn key_pttl(server: &support::redis::RedisServer, key: &str) -> i64 {
    let name = format!("{{admission}}:key:{AGENT}:{key}");
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &server.port.to_string(), "PTTL", &name])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// A key's lifetime starts at its admission (the retention plus a day, here a second plus a
/// day); a live operation older than 12 hours has it renewed at each sweep, so the key outlives
/// an operation that lives longer than that lifetime. A finished operation's key is not renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_keys_of_long_lived_operations_are_renewed_so_they_outlive_them() {
    let server = redis_or_skip!();
    let ahead = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let dir = tempfile::tempdir().unwrap();
    let r1 = retiring_replica(&server, dir.path(), "r1", &["r1"], ahead.clone()).await;
    let live = r1
        .submit(AGENT_SECRET, &request("long-lived", "demo.request", 0))
        .await;
    assert_eq!(live.status, 202, "{}", live.body);
    let done = r1
        .submit(AGENT_SECRET, &request("done", "demo.run", 0))
        .await;
    assert_eq!(done.status, 202, "{}", done.body);
    assert!(eventually(async || r1.snapshot().executing == 0 && r1.snapshot().active == 1).await);
    let day = 86_400_000;
    assert!(key_pttl(&server, "long-lived") > day - 60_000);
    // Young: nothing to renew.
    assert_eq!(r1.broker.sweep_now().await.unwrap().keys_renewed, 0);
    // A day and a half later (the key's lifetime nearly run out), the live one is renewed.
    redis_cmd(
        &server,
        &["PEXPIRE", "{admission}:key:agent:long-lived", "5000"],
    );
    redis_cmd(&server, &["PEXPIRE", "{admission}:key:agent:done", "5000"]);
    ahead.store(36 * 3600, std::sync::atomic::Ordering::Relaxed);
    let swept = r1.broker.sweep_now().await.unwrap();
    assert_eq!(swept.keys_renewed, 1, "{swept:?}");
    assert!(key_pttl(&server, "long-lived") > day - 60_000);
    // The finished one is retired (its row past the retention), its key unbound.
    assert!(key_pttl(&server, "done") < 0);
    r1.broker.shutdown().await;
}

fn redis_cmd(server: &support::redis::RedisServer, args: &[&str]) {
    let out = std::process::Command::new("redis-cli")
        .arg("-p")
        .arg(server.port.to_string())
        .args(args)
        .output()
        .expect("redis-cli runs");
    assert!(out.status.success(), "{out:?}");
}

/// The idempotency records Redis holds for the deployment under the default prefix.
fn key_records_in_redis(server: &support::redis::RedisServer) -> usize {
    let out = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &server.port.to_string(),
            "--scan",
            "--pattern",
            "{admission}:key:*",
        ])
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_flood_on_one_replica_leaves_no_key_bound_but_the_created_ones() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    const FLOOD: &str = r#"{"requests_per_window": 10, "window_seconds": 3600,
      "client_active": 100, "client_pending": 50, "global_active": 500, "global_executing": 50}"#;
    let start = |dir: std::path::PathBuf, name: &'static str| {
        let server_url = server.url();
        async move {
            let mut options = RedisOptions::new(server_url, name);
            options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
            options.call_timeout = Duration::from_secs(2);
            let mut settings = settings(&dir, FLOOD, StorageCaps::default());
            settings.broker_name = name.to_owned();
            start_shared(settings, options).await
        }
    };
    let r1 = start(d1.path().to_owned(), "r1").await;
    let r2 = start(d2.path().to_owned(), "r2").await;
    let (mut created, mut refused) = (Vec::new(), Vec::new());
    for i in 0..200 {
        let key = format!("flood-{i}");
        let reply = r1
            .submit(AGENT_SECRET, &request(&key, "demo.request", 0))
            .await;
        match reply.status {
            202 => created.push(key),
            429 => refused.push(key),
            other => panic!("{key}: {other} {}", reply.code()),
        }
    }
    assert_eq!(created.len(), 10, "the bucket's ten tokens");
    assert_eq!(
        key_records_in_redis(&server),
        created.len(),
        "one record per operation, none for a refusal"
    );
    // A refused key is free on the other replica: it is refused by the rate there too, never
    // answered as held elsewhere.
    for key in refused.iter().take(20) {
        let reply = r2
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(
            (reply.status, reply.code()),
            (429, "submission_rate_limited"),
            "{key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_after_a_store_error_leaves_the_key_free_on_every_replica() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1", &["r1", "r2"]).await;
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
    // Another process holds r1's SQLite write lock past the broker's busy timeout (5 s): the
    // admission is made, the insert fails, the permit is refunded — its key binding with it.
    let holder = support::faults::lock_store(d1.path(), Duration::from_secs(7));
    let failed = r1
        .submit(AGENT_SECRET, &request("store-fails", "demo.request", 0))
        .await;
    assert_eq!(
        (failed.status, failed.code()),
        (503, "store_unavailable"),
        "the store did not take the write"
    );
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(key_records_in_redis(&server), 0, "no key left bound");
    // The client's retry is new work on the other replica, not a replay of nothing.
    let retried = r2
        .submit(AGENT_SECRET, &request("store-fails", "demo.request", 0))
        .await;
    assert_eq!(retried.status, 202, "{}", retried.code());
    assert_eq!(key_records_in_redis(&server), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_flushall_replicas_recover_their_work_cancels_keep_working_and_fleet_drift_is_zero()
{
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let start = |dir: std::path::PathBuf, name: &'static str| {
        let url = server.url();
        async move {
            let mut options = RedisOptions::new(url, name);
            options.call_timeout = Duration::from_secs(2);
            options.lease_ttl = Duration::from_secs(4);
            options.heartbeat = Duration::from_millis(300);
            options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
            let mut settings = settings(&dir, TIGHT, StorageCaps::default());
            settings.broker_name = name.to_owned();
            start_shared(settings, options).await
        }
    };
    let r1 = start(d1.path().to_owned(), "r1").await;
    let r2 = start(d2.path().to_owned(), "r2").await;
    let mut ids = Vec::new();
    for (h, key) in [(&r1, "p1"), (&r2, "p2")] {
        let reply = eventually_admitted(h, key).await;
        ids.push(reply);
    }
    server.flush_all();
    // While Redis has forgotten, cancels still answer, and nothing is admitted over the limit.
    let cancel = format!("/api/agent/v1/operations/{}/cancel", ids[0]);
    assert_eq!(r1.post(&cancel, Some(AGENT_SECRET)).await.status, 200);
    // Both register again; then r1's cancel is reflected and r2's pending work is counted.
    let resumed = eventually(async || {
        let reply = r2
            .submit(AGENT_SECRET, &request("after", "demo.request", 0))
            .await;
        reply.status == 202
    })
    .await;
    assert!(resumed, "the replicas never admitted again");
    let counts = r1.broker.admission().counts().await.unwrap();
    assert_eq!(
        counts.clients.get("agent").copied(),
        Some((2, 2, 0)),
        "{counts:?}"
    );
    for h in [&r1, &r2] {
        let report = h.broker.check_drift().await.unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(
            report.fleet,
            Some(Vec::new()),
            "fleet drift after recovery: {report:?}"
        );
    }
    let text = r2.metrics().await;
    assert_eq!(metric(&text, "admission_fleet_drift"), Some(0));
}

/// Submits `key` until admitted (a new deployment with every replica listed waits for all of
/// them to register) and returns the operation's id.
async fn eventually_admitted(h: &Harness, key: &str) -> String {
    let mut id = None;
    let admitted = eventually(async || {
        let reply = h
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        if reply.status == 202 || reply.status == 200 {
            id = Some(reply.id());
        }
        id.is_some()
    })
    .await;
    assert!(admitted, "{key} never admitted");
    id.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_replicas_operator_listener_shows_and_decides_its_own_requests_only() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1", &["r1", "r2"]).await;
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
    let on_r1 = r1
        .submit(AGENT_SECRET, &request("on-r1", "demo.request", 0))
        .await
        .id();
    let on_r2 = r2
        .submit(AGENT_SECRET, &request("on-r2", "demo.request", 0))
        .await
        .id();
    assert_eq!(r1.operator.pending().await, std::slice::from_ref(&on_r1));
    assert_eq!(r2.operator.pending().await, std::slice::from_ref(&on_r2));
    let body = serde_json::json!({"expected_revision": 1, "idempotency_key": "elsewhere"});
    let elsewhere = r2.operator.decide(&on_r1, "deny", &body).await;
    assert_eq!((elsewhere.status, elsewhere.code()), (404, "not_found"));
    let denied = r1.operator.decide(&on_r1, "deny", &body).await;
    assert_eq!(denied.status, 200, "{}", denied.body);
    // The denial released the client's pending slot across the replicas: r2 admits again.
    assert!(
        eventually(async || {
            r2.submit(AGENT_SECRET, &request("after", "demo.request", 0))
                .await
                .status
                == 202
        })
        .await
    );
    assert_eq!(r1.operator.drift().await["drift"], 0);
    assert_eq!(r2.operator.drift().await["drift"], 0);
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_carries_the_deployments_quota_not_the_replicas_own() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let start = |dir: std::path::PathBuf, name: &'static str| {
        let server = &server;
        async move {
            let mut settings = settings(&dir, FIVE_AN_HOUR, StorageCaps::default());
            settings.broker_name = name.to_owned();
            let mut options = RedisOptions::new(server.url(), name);
            options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
            start_shared(settings, options).await
        }
    };
    let r1 = start(d1.path().to_owned(), "r1").await;
    let r2 = start(d2.path().to_owned(), "r2").await;
    let first = request("k-0", "demo.request", 0);
    assert_eq!(r1.submit(AGENT_SECRET, &first).await.status, 202);
    // Two more on the other replica: the deployment has taken 3 of 5 tokens and holds 3 pending.
    let mut last = None;
    for key in ["k-1", "k-2"] {
        let created = r2
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(created.status, 202, "{:?}", created.body);
        last = Some(Quota::of(&created));
    }
    let decided = last.unwrap();
    assert_eq!(
        (
            decided.limit("rate", "r"),
            decided.limit("active", "r"),
            decided.limit("pending", "r")
        ),
        (Some(2), Some(22), Some(7))
    );
    // r1 itself took one token and holds one operation; its replay still says what the
    // deployment holds, as the 202 on r2 did — and consumes nothing.
    for _ in 0..2 {
        let replayed = r1.submit(AGENT_SECRET, &first).await;
        assert_eq!(replayed.status, 200, "{:?}", replayed.body);
        assert_conforms("operation", &replayed.body, "a replay on another replica");
        let q = Quota::of(&replayed);
        for (name, param) in [("rate", "r"), ("active", "r"), ("pending", "r")] {
            assert_eq!(q.limit(name, param), decided.limit(name, param), "{name}");
        }
        let reset = q.limit("rate", "t").unwrap();
        assert!((1..=720).contains(&reset), "rate reset {reset}");
    }
    let replayed = r2
        .submit(AGENT_SECRET, &request("k-1", "demo.request", 0))
        .await;
    assert_eq!(replayed.status, 200);
    assert_eq!(Quota::of(&replayed).limit("rate", "r"), Some(2));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_bound_by_a_replica_that_stopped_before_its_row_is_new_work_when_it_returns() {
    use unyolo_admission::{Admission, Config, Controller, Identity};
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // r1's first life: the shared admission binds the key, and the process stops before the row
    // is written, releasing nothing (as a kill -9 there would).
    // The deployment starts as r1 alone (r2 joins it later).
    let config = Config::defaults([Identity::new(AGENT).unwrap()]);
    let mut alone = RedisOptions::new(server.url(), "r1");
    alone.replicas = vec!["r1".to_owned()];
    let first = Admission::new(Controller::new(config), Some(alone)).unwrap();
    assert!(first.restore(Vec::new()).await.deferred.is_none());
    let permit = first.admit(AGENT, true, Some("k-lost")).await.unwrap();
    let lost = permit.id().to_string();
    std::mem::forget(permit);
    first.shutdown().await;
    drop(first);

    // Another replica says where the key's operation lives: that is r1's to answer.
    let r2 = replica(&server, d2.path(), "r2", &["r1", "r2"]).await;
    let body = request("k-lost", "demo.request", 0);
    let elsewhere = r2.submit(AGENT_SECRET, &body).await;
    assert_eq!(elsewhere.status, 409, "{:?}", elsewhere.body);
    assert_conforms("error_envelope", &elsewhere.body, "the key held elsewhere");
    assert_eq!(elsewhere.code(), "idempotency_key_elsewhere");
    assert!(
        elsewhere.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&lost)
    );

    // r1 returns under its name with a store that never held the operation: nothing will ever
    // answer for it, so the key is new work there, and bound to the new operation everywhere.
    let r1 = replica(&server, d1.path(), "r1", &["r1", "r2"]).await;
    let created = r1.submit(AGENT_SECRET, &body).await;
    assert_eq!(created.status, 202, "{:?}", created.body);
    assert_conforms("operation", &created.body, "a stale key decided afresh");
    assert_ne!(created.id(), lost);
    let replayed = r1.submit(AGENT_SECRET, &body).await;
    assert_eq!((replayed.status, replayed.id()), (200, created.id()));
    let elsewhere = r2.submit(AGENT_SECRET, &body).await;
    assert_eq!(elsewhere.status, 409);
    assert!(
        elsewhere.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&created.id())
    );
    // The lost operation counts nowhere (r1's registration let it go): one pending in all.
    let counts = r1.broker.admission().counts().await.unwrap();
    assert_eq!((counts.active, counts.pending), (1, 1));
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

/// Four tokens an hour, reached by a reload from a one-second window.
const HOURLY: &str = r#"{"requests_per_window": 4, "window_seconds": 3600,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

/// After a reload lengthens a client's rate window, Redis forgetting the deployment rebuilds the
/// shared bucket from the admissions within the window in force, not the one the replica started
/// with: a client that spent its hour's four tokens across two replicas stays refused. Before,
/// each replica read back only its last second of creations (none), the shared bucket came back
/// full, and the client got four more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reload_lengthens_the_window_redis_forgetting_refills_no_bucket() {
    let server = redis_or_skip!();
    let (d1, d2, files) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let hourly = files.path().join("hourly.json");
    std::fs::write(&hourly, HOURLY).unwrap();
    let start = |dir: std::path::PathBuf, name: &'static str| {
        let url = server.url();
        async move {
            let mut options = RedisOptions::new(url, name);
            options.call_timeout = Duration::from_secs(2);
            options.lease_ttl = Duration::from_secs(4);
            options.heartbeat = Duration::from_millis(300);
            options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
            let per_second = r#"{"requests_per_window": 1000, "window_seconds": 1,
              "client_active": 25, "client_pending": 10, "global_active": 100,
              "global_executing": 10}"#;
            let mut settings = settings(&dir, per_second, StorageCaps::default());
            settings.broker_name = name.to_owned();
            start_shared(settings, options).await
        }
    };
    let r1 = start(d1.path().to_owned(), "r1").await;
    let r2 = start(d2.path().to_owned(), "r2").await;
    r1.broker.reload_from_path(&hourly).unwrap();
    r2.broker.reload_from_path(&hourly).unwrap();
    // The hour's four tokens, two on each replica; a fifth is refused.
    for (h, key) in [(&r1, "h1"), (&r1, "h2"), (&r2, "h3"), (&r2, "h4")] {
        let reply = h.submit(AGENT_SECRET, &request(key, "demo.run", 0)).await;
        assert_eq!(reply.status, 202, "{key}: {}", reply.code());
    }
    let fifth = r1.submit(AGENT_SECRET, &request("h5", "demo.run", 0)).await;
    assert_eq!(
        (fifth.status, fifth.code()),
        (429, "submission_rate_limited")
    );
    // Past the start-up window, Redis forgets.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.flush_all();
    // Once both have registered again (a submission is answered by Redis, not 503), every
    // submission on either replica is still refused for the rate.
    let mut n = 0;
    let mut answered = Vec::new();
    let recovered = eventually(async || {
        answered.clear();
        for h in [&r1, &r2] {
            n += 1;
            let reply = h
                .submit(AGENT_SECRET, &request(&format!("after-{n}"), "demo.run", 0))
                .await;
            answered.push((reply.status, reply.code().to_owned()));
        }
        answered.iter().all(|(status, _)| *status != 503)
    })
    .await;
    assert!(recovered, "the replicas never answered again: {answered:?}");
    assert!(
        answered
            .iter()
            .all(|(status, code)| (*status, code.as_str()) == (429, "submission_rate_limited")),
        "a bucket came back refilled after Redis forgot: {answered:?}"
    );
    // The refusals took nothing (the four admitted ran and ended).
    let counts = r1.broker.admission().counts().await.unwrap();
    assert_eq!((counts.active, counts.operations), (0, 0), "{counts:?}");
}
