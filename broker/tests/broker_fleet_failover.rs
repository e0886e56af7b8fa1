//! A fleet follows a PostgreSQL failover by itself (SPEC section 12): two `admission serve`
//! replicas on one real `redis-server` and a real PostgreSQL primary with a synchronous streaming
//! standby (`pg_basebackup -R`), named together in one libpq multi-host URL with
//! `target_session_attrs=read-write`. Under load on both replicas and an operator's event stream,
//! the primary is killed (`kill -9`) and the standby promoted (`pg_promote`). Every replica
//! reconnects to the new primary without a restart; meanwhile submissions are `503
//! store_unavailable` with `Retry-After` and `/readyz` is 503. After: every `202` has its row,
//! one row per key, nothing ran twice, the counts equal the rows, and the operator's stream,
//! resumed with its last cursor, read every event of the log once, in order, across the switch.
//! Admissions resume within 5 s of the promotion (measured and printed).

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::events::{Next, Opened, open};
use support::http::request;
use support::postgres::PostgresServer;
use support::redis::RedisServer;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use support::serve::{Files, Server};

/// Room for the whole load.
const ROOMY: &str = r#"{"requests_per_window": 100000, "window_seconds": 60,
  "client_active": 2000, "client_pending": 1000, "global_active": 5000, "global_executing": 100}"#;

/// How long the contract gives admissions to resume after the standby's promotion.
const RESUME_WITHIN: Duration = Duration::from_secs(5);

fn replica(
    redis: &RedisServer,
    store: &str,
    files: &Files,
    dir: &std::path::Path,
    name: &str,
) -> Server {
    let mut args = vec![
        "--store".to_owned(),
        store.to_owned(),
        "--redis".to_owned(),
        redis.url(),
    ];
    args.extend(files.replica_args(dir, name, "p1,p2"));
    Server::spawn(None, &args)
}

/// The client of load key `key`: `agent` on `p1`, `other` on `p2` (a pending-grant cap each).
fn secret_of(key: &str) -> &'static str {
    if key.starts_with("p1") {
        AGENT_SECRET
    } else {
        OTHER_SECRET
    }
}

/// One submission's answer: when it came, its status, and the operation's id if created.
struct Answer {
    at: Instant,
    status: u16,
    id: Option<String>,
    /// `demo.request` or `demo.run`.
    operation: &'static str,
}

/// The operation of load key `key`: every third a request that needs an approval.
fn operation_of(key: &str) -> &'static str {
    let n: u64 = key.rsplit('-').next().unwrap().parse().unwrap();
    if n.is_multiple_of(3) {
        "demo.request"
    } else {
        "demo.run"
    }
}

/// Submits `prefix-N` (runs, and requests an operator approves on `decider`) to `server` until
/// `stop`; every answer, and the requests whose approval did not go through (the store away).
async fn load(
    server: Arc<Server>,
    decider: Arc<Server>,
    prefix: &'static str,
    stop: Arc<AtomicBool>,
) -> (BTreeMap<String, Answer>, Vec<String>) {
    let mut answers = BTreeMap::new();
    let mut unapproved: Vec<String> = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        // Approvals the store did not take yet are tried again first: a client's pending
        // requests stay within its pending-grant cap.
        let mut left: Vec<String> = Vec::new();
        for id in unapproved.drain(..) {
            if decider.operator.approve(&id).await.status != 200 {
                left.push(id);
            }
        }
        unapproved = left;
        let key = format!("{prefix}-{n}");
        let operation = if unapproved.len() > 2 {
            "demo.run"
        } else {
            operation_of(&key)
        };
        let reply = server
            .submit(secret_of(&key), &request(&key, operation, 0))
            .await;
        assert!(
            [202, 503].contains(&reply.status),
            "{key}: {} {:?}",
            reply.status,
            reply.body
        );
        if reply.status == 503 {
            assert_eq!(reply.code(), "store_unavailable", "{:?}", reply.body);
            assert!(reply.retry_after().is_some(), "a 503 says when to retry");
        }
        let id = (reply.status == 202).then(|| reply.id());
        if let Some(id) = &id
            && operation == "demo.request"
            && decider.operator.approve(id).await.status != 200
        {
            unapproved.push(id.clone());
        }
        answers.insert(
            key,
            Answer {
                at: Instant::now(),
                status: reply.status,
                id,
                operation,
            },
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (answers, unapproved)
}

/// An operator's event stream on `base`, resumed with its last cursor whenever it is cut, until
/// `stop`: every event read goes into `read`, as "request revision".
async fn read_events(base: String, read: Arc<Mutex<Vec<String>>>, stop: Arc<AtomicBool>) {
    let mut last: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        let ids: Vec<&str> = last.iter().map(String::as_str).collect();
        let mut stream = match open(&base, OPERATOR_SECRET, "", &ids).await {
            Opened::Stream(stream) => stream,
            // The store does not answer yet (the stream's backlog is read from it).
            Opened::Refused(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            match stream.next_or_end(Duration::from_millis(200)).await {
                Next::Event(event) => {
                    last = Some(event["cursor"].as_str().unwrap().to_owned());
                    let read_one = format!(
                        "{} {}",
                        event["request_id"].as_str().unwrap(),
                        event["revision"]
                    );
                    read.lock().unwrap().push(read_one);
                }
                Next::Quiet => {}
                Next::Ended => break,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_follows_a_promoted_synchronous_standby_losing_nothing_and_resumes_within_5_s() {
    let Some(redis) = RedisServer::start() else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    let Some(mut primary) = PostgresServer::start() else {
        return;
    };
    primary.database("fleet");
    let standby = primary.start_standby(true);
    let store = format!(
        "postgres://{}@127.0.0.1:{},127.0.0.1:{}/fleet?target_session_attrs=read-write",
        support::postgres::ROLE,
        primary.port,
        standby.port
    );
    let tmp = tempfile::tempdir().unwrap();
    let files = Files::write(tmp.path(), ROOMY);
    let p1 = Arc::new(replica(&redis, &store, &files, tmp.path(), "p1"));
    let p2 = Arc::new(replica(&redis, &store, &files, tmp.path(), "p2"));

    let stop = Arc::new(AtomicBool::new(false));
    let stop_events = Arc::new(AtomicBool::new(false));
    let read = Arc::new(Mutex::new(Vec::new()));
    let events = tokio::spawn(read_events(
        p2.operator.base.clone(),
        Arc::clone(&read),
        Arc::clone(&stop_events),
    ));
    let loads = [
        tokio::spawn(load(
            Arc::clone(&p1),
            Arc::clone(&p2),
            "p1",
            Arc::clone(&stop),
        )),
        tokio::spawn(load(
            Arc::clone(&p2),
            Arc::clone(&p1),
            "p2",
            Arc::clone(&stop),
        )),
    ];
    tokio::time::sleep(Duration::from_secs(3)).await;

    primary.kill();
    // Down until a person or a tool promotes the standby: the fleet answers what it can.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for server in [&p1, &p2] {
        let ready = server.get("/readyz", "").await;
        assert_eq!(ready.status, 503, "{:?}", ready.body);
        assert_eq!(server.get("/healthz", "").await.status, 200);
    }
    standby.promote();
    let promoted = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = BTreeMap::new();
    let mut unapproved = Vec::new();
    for load in loads {
        let (answered, left) = load.await.unwrap();
        answers.extend(answered);
        unapproved.extend(left);
    }

    // Admissions resumed on each replica within the contract's bound of the promotion.
    for prefix in ["p1", "p2"] {
        let resumed = answers
            .iter()
            .filter(|(key, a)| key.starts_with(prefix) && a.status == 202 && a.at > promoted)
            .map(|(_, a)| a.at)
            .min()
            .expect("admissions resumed");
        let after = resumed - promoted;
        eprintln!("{prefix}: admissions resumed {after:?} after the standby's promotion");
        assert!(
            after < RESUME_WITHIN,
            "{prefix} resumed {after:?} after the promotion"
        );
    }
    let refused = answers.values().filter(|a| a.status == 503).count();
    assert!(refused > 0, "the outage was seen");

    // The approvals the store did not take, then every key answered 503, retried until
    // answered (created once, or replayed); a request created now is approved at once.
    for id in &unapproved {
        let approved = p1.operator.approve(id).await;
        assert!(
            [200, 409].contains(&approved.status),
            "{id}: {:?}",
            approved.body
        );
    }
    for (key, answer) in answers.iter_mut().filter(|(_, a)| a.status == 503) {
        let server = if key.starts_with("p1") { &p1 } else { &p2 };
        let reply = server
            .submit(secret_of(key), &request(key, answer.operation, 0))
            .await;
        assert!(
            [200, 202].contains(&reply.status),
            "{key}: {:?}",
            reply.body
        );
        answer.id = Some(reply.id());
        if answer.operation == "demo.request" {
            let approved = p1.operator.approve(&reply.id()).await;
            assert!(
                [200, 409].contains(&approved.status),
                "{key}: {:?}",
                approved.body
            );
        }
    }
    let keys = answers.len();
    let rows = standby.psql(
        "fleet",
        "SELECT count(*) || ' ' || count(DISTINCT idempotency_key) FROM operations",
    );
    assert_eq!(
        rows,
        format!("{keys} {keys}"),
        "one row per key, none lost, none doubled"
    );
    for (key, answer) in &answers {
        let owner = standby.psql(
            "fleet",
            &format!(
                "SELECT idempotency_key FROM operations WHERE id = '{}'",
                answer.id.as_ref().unwrap()
            ),
        );
        assert_eq!(&owner, key, "the id answered for {key} is its row");
    }
    // Nothing ran twice: a run is created approved (1), started (2) and ends (3).
    assert_eq!(
        standby.psql(
            "fleet",
            "SELECT count(*) FROM operations WHERE operation = 'demo.run' AND revision > 3"
        ),
        "0"
    );
    for server in [&p1, &p2] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let report = server.operator.drift().await;
            if report["drift"] == 0 && report["fleet_drift"] == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "drift stays: {report}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    // The operator's stream, resumed across the switch, read the whole log once, in order.
    let log: Vec<String> = standby
        .psql(
            "fleet",
            "SELECT request_id || ' ' || revision FROM operator_events \
             WHERE position IS NOT NULL ORDER BY position",
        )
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(log.len() > 10, "the log has the requests' events");
    let deadline = Instant::now() + Duration::from_secs(20);
    while read.lock().unwrap().len() < log.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_events.store(true, Ordering::Relaxed);
    events.await.unwrap();
    let read = read.lock().unwrap().clone();
    assert_eq!(
        read, log,
        "the stream read every event of the log once, in order"
    );
}

/// A failover can cut the connection at a commit: the commit holds on the promoted standby while
/// its answer is lost. A creation answered `503` then left a row its replica holds no handle of
/// (its permit refunded), and a start left its row `executing` with nothing running it. The
/// replica takes such rows up at its next reading of its rows (every third of a lease, and
/// before every drift reading): a pending one is counted, an approved one counted and run, an
/// executing one (it may have run) ended `failed` `execution_interrupted`, never run again. Here
/// the rows are written behind the replica's back, as such a commit leaves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_a_replica_owns_without_a_handle_are_taken_up_at_its_next_reading() {
    let Some(redis) = RedisServer::start() else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    let Some(postgres) = PostgresServer::shared() else {
        return;
    };
    let store = postgres.database("orphans");
    let tmp = tempfile::tempdir().unwrap();
    let files = Files::write(tmp.path(), ROOMY);
    let p1 = replica(&redis, &store, &files, tmp.path(), "p1");
    let template = p1
        .submit(AGENT_SECRET, &request("template", "demo.request", 0))
        .await;
    assert_eq!(template.status, 202, "{:?}", template.body);
    let template = template.id();
    for (id, key, operation, state) in [
        (
            "op_0rphan00000000000000000000000001",
            "orphan-pending",
            "demo.request",
            "pending",
        ),
        (
            "op_0rphan00000000000000000000000002",
            "orphan-approved",
            "demo.run",
            "approved",
        ),
        (
            "op_0rphan00000000000000000000000003",
            "orphan-executing",
            "demo.run",
            "executing",
        ),
    ] {
        postgres.psql(
            "orphans",
            &format!(
                "INSERT INTO operations (id, client_id, idempotency_key, operation, target, \
                 arguments, reason, state, created_at, updated_at, revision, title, owner, \
                 pending_expires_at, request_digest) \
                 SELECT '{id}', client_id, '{key}', '{operation}', target, arguments, reason, \
                 '{state}', created_at, updated_at, 1, title, owner, pending_expires_at, \
                 request_digest FROM operations WHERE id = '{template}'"
            ),
        );
    }
    // The next reading takes them up: the counts equal the rows at once.
    let report = p1.operator.drift().await;
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(report["fleet_drift"], 0, "{report}");
    let state = |id: &'static str| {
        postgres.psql(
            "orphans",
            &format!(
                "SELECT state || ' ' || coalesce(error_code, '-') FROM operations WHERE id = '{id}'"
            ),
        )
    };
    assert_eq!(
        state("op_0rphan00000000000000000000000003"),
        "failed execution_interrupted"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while state("op_0rphan00000000000000000000000002") != "succeeded -" {
        assert!(Instant::now() < deadline, "the approved orphan never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state("op_0rphan00000000000000000000000001"), "pending -");
    assert_eq!(
        p1.metric("admission_operations{state=\"pending\"}").await,
        Some(2),
        "the template and the pending orphan"
    );
    let report = p1.operator.drift().await;
    assert_eq!(
        (report["drift"].as_u64(), report["fleet_drift"].as_u64()),
        (Some(0), Some(0)),
        "{report}"
    );
}
