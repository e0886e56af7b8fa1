//! The embedding example's own test: its server, started in-process, keeps the controller's
//! counts equal to its store while clients hang up in the middle of their requests, and restores
//! them from the store at start-up.

#[path = "../examples/axum_broker.rs"]
#[allow(dead_code, unreachable_pub)]
mod example;
mod support;

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use example::{App, Settings};
use support::eventually::eventually;
use support::faults::StoreLock;
use tokio::io::AsyncWriteExt;
use unyolo_admission::{OperationState, ReplicaOptions};

const SECRETS: &str = "bot = bot-secret\noperator = operator-secret\n";

/// Which admission the example runs on: `None` in-process, or one replica on a `redis-server`
/// of this test process (under a prefix of its own).
type Backend = Option<ReplicaOptions>;

fn in_process() -> Option<Backend> {
    Some(None)
}

/// A replica's options on this process's `redis-server`, read as the example reads its
/// environment; `None` (having said why) if it cannot run here.
fn replicated(test: &str) -> Option<Backend> {
    let Some(server) = support::redis::process_server() else {
        eprintln!("SKIPPED: {test}: no redis-server to run the replicated example against");
        return None;
    };
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let environment = HashMap::from([
        ("ADMISSION_REDIS_URL", server.url()),
        ("ADMISSION_REPLICA", "r1".to_owned()),
        // The whole deployment is this one replica: it admits as soon as it has registered, not
        // one lease period after the deployment's first start.
        ("ADMISSION_REPLICAS", "r1".to_owned()),
    ]);
    let mut options = example::replicas_from_env(|name| environment.get(name).cloned())
        .expect("ADMISSION_REDIS_URL is set");
    assert_eq!(options.replicas, ["r1"]);
    options.prefix = format!("example-{test}-{n}");
    // Generous: a shared, noisy machine must not fail a decision for slowness.
    options.call_timeout = Duration::from_secs(5);
    Some(Some(options))
}

fn settings(dir: &tempfile::TempDir, store_delay: Duration, replicas: Backend) -> Settings {
    let secrets_path = dir.path().join("secrets");
    std::fs::File::create(&secrets_path)
        .and_then(|mut f| f.write_all(SECRETS.as_bytes()))
        .expect("secrets file");
    Settings {
        listen: "127.0.0.1:0".parse().unwrap(),
        db_path: dir.path().join("store.sqlite"),
        secrets_path,
        quota_path: None,
        store_delay,
        replicas,
    }
}

fn submission(key: &str, operation: &str) -> String {
    let body = format!(r#"{{"idempotency_key":"{key}","operation":"{operation}"}}"#);
    format!(
        "POST /operations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bot-secret\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends a whole submission and hangs up before the answer (the store is still writing).
async fn submit_and_hang_up(addr: SocketAddr, key: &str, operation: &str) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(submission(key, operation).as_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    drop(stream);
}

async fn post(addr: SocketAddr, path: &str, token: &str, body: &str) -> (u16, serde_json::Value) {
    let answer = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .bearer_auth(token)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or_default())
}

/// The store's count of operations in each state, read from its file.
fn stored_counts(dir: &tempfile::TempDir) -> HashMap<String, u64> {
    let db = rusqlite::Connection::open(dir.path().join("store.sqlite")).unwrap();
    let sql = "SELECT state, COUNT(*) FROM operations GROUP BY state";
    let mut query = db.prepare(sql).unwrap();
    let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
    rows.map(Result::unwrap).collect()
}

/// The controller's live counts against the store's rows, per state; and nothing dropped.
fn assert_counts_match_store(app: &App, dir: &tempfile::TempDir) {
    let stored = stored_counts(dir);
    let at = |state: OperationState| stored.get(state.as_str()).copied().unwrap_or(0);
    let s = app.admission.snapshot();
    assert_eq!(
        (s.pending, s.queued, s.executing),
        (
            at(OperationState::Pending),
            at(OperationState::Approved),
            at(OperationState::Executing)
        ),
        "controller counts vs store rows {stored:?}"
    );
    assert_eq!((s.dropped_permits, s.dropped_operations), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_hanging_up_mid_submission_leave_counts_equal_to_the_store() {
    if let Some(backend) = in_process() {
        hang_ups_leave_counts_equal_to_the_store(backend).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_hanging_up_mid_submission_leave_counts_equal_to_the_store_on_a_replica() {
    if let Some(backend) = replicated("hangups") {
        let redis = backend.clone();
        let app = hang_ups_leave_counts_equal_to_the_store(backend).await;
        // The shared counts agree with this replica's, which agree with its store.
        assert!(app.admission.flush().await, "kept releases reach redis");
        let shared = app.admission.counts().await.expect("redis answers");
        let local = app.admission.snapshot();
        assert_eq!(
            (shared.pending, shared.executing, shared.active),
            (local.pending, local.executing, local.active),
            "redis {redis:?}"
        );
    }
}

async fn hang_ups_leave_counts_equal_to_the_store(backend: Backend) -> std::sync::Arc<App> {
    let dir = tempfile::tempdir().unwrap();
    let (addr, app) = example::start(settings(&dir, Duration::from_millis(200), backend)).await;
    let keys: Vec<String> = (0..6).map(|i| format!("key-{i}")).collect();
    let hangups = keys.iter().cloned().map(|key| async move {
        submit_and_hang_up(addr, &key, "demo.request").await;
    });
    futures_join_all(hangups).await;
    // Each retry takes its key's lock, so it answers only once the abandoned submission has run
    // to its end: every one was created (a replay, 200), none lost with its client.
    for key in &keys {
        let body = format!(r#"{{"idempotency_key":"{key}","operation":"demo.request"}}"#);
        let (status, op) = post(addr, "/operations", "bot-secret", &body).await;
        assert_eq!(
            (status, op["state"].as_str()),
            (200, Some("pending")),
            "{key}"
        );
    }
    assert_eq!(app.admission.snapshot().pending, 6);
    assert_counts_match_store(&app, &dir);

    // Decisions and cancels, some abandoned by their callers too.
    let ids: Vec<String> = futures_join_all(keys.iter().cloned().map(|key| async move {
        let body = format!(r#"{{"idempotency_key":"{key}","operation":"demo.request"}}"#);
        post(addr, "/operations", "bot-secret", &body).await.1["id"]
            .as_str()
            .unwrap()
            .to_owned()
    }))
    .await;
    let (status, first) = post(
        addr,
        &format!("/operations/{}/cancel", ids[0]),
        "bot-secret",
        "",
    )
    .await;
    assert_eq!((status, first["state"].as_str()), (200, Some("canceled")));
    let abandoned = reqwest::Client::new()
        .post(format!("http://{addr}/operations/{}/approve", ids[1]))
        .bearer_auth("operator-secret")
        .timeout(Duration::from_millis(20))
        .send()
        .await;
    assert!(
        abandoned.is_err(),
        "the caller hung up before the slow store answered"
    );
    let (status, _) = post(
        addr,
        &format!("/operations/{}/deny", ids[2]),
        "operator-secret",
        "",
    )
    .await;
    assert_eq!(status, 200);
    // The abandoned approval still ran: its operation executes and succeeds, so it cannot be
    // canceled any more (409 while executing, 404 once it is done) — a second cancel of the
    // first is 404 too: it is no longer live.
    let (status, _) = post(
        addr,
        &format!("/operations/{}/cancel", ids[0]),
        "bot-secret",
        "",
    )
    .await;
    assert_eq!(status, 404);
    let stored = wait_until_stored(&app, &dir, "succeeded", 1).await;
    assert_counts_match_store(&app, &dir);
    assert_eq!(stored.get("succeeded"), Some(&1), "{stored:?}");
    assert_eq!(stored.get("canceled"), Some(&1), "{stored:?}");
    assert_eq!(stored.get("denied"), Some(&1), "{stored:?}");
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_restores_live_rows_and_fails_interrupted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, app) = example::start(settings(&dir, Duration::ZERO, None)).await;
    for key in ["a", "b"] {
        let body = format!(r#"{{"idempotency_key":"{key}","operation":"demo.request"}}"#);
        assert_eq!(post(addr, "/operations", "bot-secret", &body).await.0, 202);
    }
    // Pretend the process died while one operation was executing.
    let db = rusqlite::Connection::open(dir.path().join("store.sqlite")).unwrap();
    db.execute(
        "INSERT INTO operations (id, client, key, operation, created_ms, state)
         VALUES ('op_c', 'bot', 'c', 'demo.run', 0, 'executing')",
        [],
    )
    .unwrap();
    drop(db);
    let (_, restarted) = example::start(settings(&dir, Duration::ZERO, None)).await;
    let s = restarted.admission.snapshot();
    assert_eq!((s.pending, s.executing), (2, 0), "two pending restored");
    let stored = stored_counts(&dir);
    assert_eq!(
        stored.get("failed"),
        Some(&1),
        "executing became failed: {stored:?}"
    );
    assert_counts_match_store(&restarted, &dir);
    drop(app);
}

/// Waits until the store holds `n` operations in `state` (the abandoned work has run to its end)
/// and the step after that store write has reached the controller (a quiet moment).
async fn wait_until_stored(
    app: &App,
    dir: &tempfile::TempDir,
    state: &str,
    n: u64,
) -> HashMap<String, u64> {
    let mut stored = HashMap::new();
    let settled = eventually(async || {
        stored = stored_counts(dir);
        let executing = stored.get("executing").copied().unwrap_or(0);
        stored.get(state) == Some(&n) && app.admission.snapshot().executing == executing
    })
    .await;
    assert!(settled, "the store never held {n} {state} operations");
    stored
}

/// Runs each future on a task of its own, all at once, and collects their outputs in order.
async fn futures_join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fairness_layer_counts_each_clients_requests_and_gives_their_units_back() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, _app) = example::start(settings(&dir, Duration::ZERO, None)).await;
    let body = r#"{"idempotency_key":"fair","operation":"demo.run"}"#;
    assert_eq!(post(addr, "/operations", "bot-secret", body).await.0, 202);
    // A request without a valid secret still gets the handler's 403, through the layer; one
    // without a secret (or with a body that is not even JSON) its 401, authentication first.
    assert_eq!(post(addr, "/operations", "wrong", body).await.0, 403);
    let anonymous = reqwest::Client::new()
        .post(format!("http://{addr}/operations"))
        .header("content-type", "text/plain")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status().as_u16(), 401);
    // The scheme in any case, spaces around the secret: the same client.
    let spelled = reqwest::Client::new()
        .post(format!("http://{addr}/operations"))
        .header("authorization", "bearer   bot-secret ")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(spelled.status().as_u16(), 200, "a replay of the key");
    let text = reqwest::Client::new()
        .get(format!("http://{addr}/metrics"))
        .bearer_auth("operator-secret")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for series in [
        r#"broker_client_requests_in_flight{client="bot"} 0"#,
        r#"broker_client_units_in_flight{client="bot"} 0"#,
        // The metrics scrape itself is exempt, and in flight while it renders.
        "broker_exempt_requests_in_flight 1",
    ] {
        assert!(text.contains(series), "{series} not in\n{text}");
    }
}

#[tokio::test]
async fn only_the_operator_and_the_metrics_scrape_are_exempt_from_the_clients_shares() {
    use unyolo_admission_broker::fairness::Class;
    let dir = tempfile::tempdir().unwrap();
    let (_addr, app) = example::start(settings(&dir, Duration::ZERO, None)).await;
    let bearer = |token: &str| {
        let mut headers = axum::http::HeaderMap::new();
        let value = format!("Bearer {token}").parse().unwrap();
        headers.insert(axum::http::header::AUTHORIZATION, value);
        headers
    };
    let (bot, operator, nobody) = (
        bearer("bot-secret"),
        bearer("operator-secret"),
        axum::http::HeaderMap::new(),
    );
    let cases = [
        ("/operations", &bot, Class::client("bot", 2)),
        ("/operations", &nobody, Class::Unkeyed { cost: 2 }),
        (
            "/operations/op-1/cancel",
            &bot,
            Class::ExemptClient { key: "bot".into() },
        ),
        // The bot may not approve: its attempt is its own request, not the operator's room.
        ("/operations/op-1/approve", &bot, Class::client("bot", 1)),
        ("/operations/op-1/approve", &operator, Class::Exempt),
        (
            "/operations/op-1/cancel",
            &nobody,
            Class::Unkeyed { cost: 1 },
        ),
        ("/operations//cancel", &bot, Class::client("bot", 1)),
        ("/operations/a/b/cancel", &bot, Class::client("bot", 1)),
        ("/no-such-route", &bot, Class::client("bot", 1)),
        ("/no-such-route", &nobody, Class::Unkeyed { cost: 1 }),
        (
            "/no-such-route",
            &bearer("wrong"),
            Class::Unkeyed { cost: 1 },
        ),
        ("/metrics", &operator, Class::Exempt),
        ("/metrics", &bot, Class::client("bot", 1)),
        ("/metrics", &nobody, Class::Unkeyed { cost: 1 }),
    ];
    for (path, headers, class) in cases {
        assert_eq!(app.classify(path, headers), class, "{path} {headers:?}");
    }
}

/// A store write after a transition that fails (another process holds SQLite's write lock past
/// the connection's 5 s busy timeout) is retried until it lands: the approval is answered once it
/// is stored, the work runs and ends, and the counts match the store with nothing held. (A
/// panic there would leave the row `pending` behind an approved handle, never executed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_by_a_locked_store_after_a_transition_is_retried_until_it_lands() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, app) = example::start(settings(&dir, Duration::ZERO, None)).await;
    let body = r#"{"idempotency_key":"locked","operation":"demo.request"}"#;
    let (status, created) = post(addr, "/operations", "bot-secret", body).await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();

    // Another process takes the write lock for 6 s: the example's write gives up after 5.
    let path = dir.path().join("store.sqlite");
    let (locked_tx, locked) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let db = rusqlite::Connection::open(path).unwrap();
        db.execute_batch("BEGIN EXCLUSIVE").unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_secs(6));
        db.execute_batch("COMMIT").unwrap();
    });
    locked.recv().unwrap();
    let (status, approved) = post(
        addr,
        &format!("/operations/{id}/approve"),
        "operator-secret",
        "",
    )
    .await;
    assert_eq!(
        (status, approved["state"].as_str()),
        (200, Some("approved")),
        "{approved}"
    );
    holder.join().unwrap();

    wait_until_stored(&app, &dir, "succeeded", 1).await;
    assert_counts_match_store(&app, &dir);
    let s = app.admission.snapshot();
    assert_eq!((s.pending, s.queued, s.executing), (0, 0, 0));
}

/// A cancel sent while the approval is still being stored is decided after it, in order: the
/// operation is canceled, never started. Before, the approval's executor started the operation
/// the moment it was handed off, ahead of the cancel queued on the operation's lock: the cancel
/// got 409 while the store still said `approved`, and the work ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_queued_behind_the_approval_cancels_before_the_work_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (addr, app) = example::start(settings(&dir, Duration::ZERO, None)).await;
    let body = r#"{"idempotency_key":"queued","operation":"demo.request"}"#;
    let (status, created) = post(addr, "/operations", "bot-secret", body).await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();

    // The approval holds the operation's lock while its write waits on the locked store; the
    // cancel queues behind it.
    let store_lock = StoreLock::take_file(&dir.path().join("store.sqlite"));
    let approve = tokio::spawn(async move {
        post(
            addr,
            &format!("/operations/{id}/approve"),
            "operator-secret",
            "",
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = created["id"].as_str().unwrap().to_owned();
    let cancel = tokio::spawn(async move {
        post(addr, &format!("/operations/{id}/cancel"), "bot-secret", "").await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!approve.is_finished() && !cancel.is_finished());
    store_lock.release();

    let (status, approved) = approve.await.unwrap();
    assert_eq!(
        (status, approved["state"].as_str()),
        (200, Some("approved")),
        "{approved}"
    );
    let (status, canceled) = cancel.await.unwrap();
    assert_eq!(
        (status, canceled["state"].as_str()),
        (200, Some("canceled")),
        "{canceled}"
    );
    // Nothing runs it afterwards: it stays canceled, with nothing held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stored = stored_counts(&dir);
    assert_eq!(stored, HashMap::from([("canceled".to_owned(), 1)]));
    assert_counts_match_store(&app, &dir);
    let s = app.admission.snapshot();
    assert_eq!((s.pending, s.queued, s.executing), (0, 0, 0));
}

/// A restart rebuilds each client's rate bucket from what it created within its window (a
/// restart never hands out a fresh burst), and a key names one request: the same request again
/// is a replay (even past the rate), another request under that key a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_rate_spent_and_a_key_replays_only_its_own_request() {
    let dir = tempfile::tempdir().unwrap();
    let quota = dir.path().join("quota.json");
    std::fs::write(
        &quota,
        r#"{"requests_per_window": 2, "window_seconds": 3600, "client_active": 25,
            "client_pending": 10, "global_active": 512, "global_executing": 64}"#,
    )
    .unwrap();
    let with_quota = || Settings {
        quota_path: Some(quota.clone()),
        ..settings(&dir, Duration::ZERO, None)
    };
    let submit = async |addr, key: &str, operation: &str| {
        let body = format!(r#"{{"idempotency_key":"{key}","operation":"{operation}"}}"#);
        post(addr, "/operations", "bot-secret", &body).await
    };
    let (addr, _first) = example::start(with_quota()).await;
    assert_eq!(submit(addr, "a", "demo.run").await.0, 202);
    assert_eq!(submit(addr, "b", "demo.run").await.0, 202);
    let (status, refused) = submit(addr, "c", "demo.run").await;
    assert_eq!(status, 429, "{refused}");

    let (addr, restarted) = example::start(with_quota()).await;
    let (status, refused) = submit(addr, "c", "demo.run").await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (429, Some("submission_rate_limited")),
        "the restart handed out a fresh burst: {refused}"
    );
    // Past the rate, the same request under its key is still answered with what it made.
    let (status, replayed) = submit(addr, "a", "demo.run").await;
    assert_eq!(status, 200, "{replayed}");
    // Another request under that key is refused, and consumes nothing.
    let (status, conflict) = submit(addr, "a", "demo.request").await;
    assert_eq!(
        (status, conflict["error"]["code"].as_str()),
        (409, Some("idempotency_conflict")),
        "{conflict}"
    );
    assert_eq!(stored_counts(&dir).values().sum::<u64>(), 2);
    assert_counts_match_store(&restarted, &dir);
}

/// Replicated, the example gives Redis back its keys when Redis forgets the deployment (its
/// recovery source): after a `FLUSHALL`, another replica's submission under a key the example
/// holds is a replay of the example's operation, never a second operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_forgets_a_key_the_example_holds_is_still_a_replay_on_another_replica() {
    use unyolo_admission::{Admission, AdmitError, Config, Controller};
    let Some(server) = support::redis::RedisServer::start() else {
        eprintln!("SKIPPED: after_redis_forgets: no redis-server to run the replicas against");
        return;
    };
    let replica = |name: &str| {
        let mut options = ReplicaOptions::new(server.url(), name);
        options.call_timeout = Duration::from_secs(5);
        options.heartbeat = Duration::from_millis(200);
        options.lease_ttl = Duration::from_secs(3);
        // Each waits for the other after Redis forgets.
        options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
        options
    };
    let dir = tempfile::tempdir().unwrap();
    let (addr, app) = example::start(settings(&dir, Duration::ZERO, Some(replica("r1")))).await;
    let ids = ["bot", "operator"].map(|n| n.parse().unwrap());
    let config = Config::from_optional_path(None, ids).unwrap();
    let other = Admission::new(Controller::new(config), Some(replica("r2"))).unwrap();
    assert!(other.restore(Vec::new()).await.deferred.is_none());

    let body = r#"{"idempotency_key":"kept","operation":"demo.request"}"#;
    let (status, created) = post(addr, "/operations", "bot-secret", body).await;
    assert_eq!(status, 202, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();

    server.flush_all();
    let mut answer = None;
    let settled = eventually(
        async || match other.admit("bot", true, Some("kept")).await {
            // Redis is recovering: both replicas register again first.
            Err(AdmitError::Unavailable(_)) => false,
            Err(AdmitError::Replay { operation, replica }) => {
                answer = Some((operation, replica));
                true
            }
            Ok(permit) => panic!("a second operation under the key: {}", permit.id()),
            Err(refused) => panic!("{refused}"),
        },
    )
    .await;
    assert!(settled, "the replicas never recovered");
    assert_eq!(answer, Some((id, "r1".to_owned())));
    assert_counts_match_store(&app, &dir);
}
