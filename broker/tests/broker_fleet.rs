//! One fleet, one store: three broker replicas on one real PostgreSQL database and one real
//! `redis-server`, requests sent round-robin across them. Any replica answers a replay, a read,
//! a wait, a cancel and an operator's decision for an operation another replica created; the
//! operators see one inbox and one event log from every replica; and the work of a replica that
//! stops is finished by the others: its executing work ends `execution_interrupted`, its pending
//! and approved work is taken over and runs once.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::broker::{Harness, settings, start_shared};
use support::events::open;
use support::eventually::assert_eventually;
use support::http::request;
use support::postgres::PostgresServer;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission::redis::RedisOptions;
use unyolo_admission::{RefusalCode, StorageCaps, StoreCaps};
use unyolo_admission_broker::store::StoreLocation;

/// Room for everything the tests submit, one execution slot at a time fleet-wide.
const FLEET: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 20, "client_pending": 20, "global_active": 100, "global_executing": 4}"#;

const NAMES: [&str; 3] = ["f1", "f2", "f3"];

/// Replica `name` of the fleet, its operations in `url`, sharing admission in `redis`.
async fn replica(
    redis: &support::redis::RedisServer,
    url: &str,
    dir: &std::path::Path,
    name: &str,
    caps: StorageCaps,
) -> Harness {
    let mut options = RedisOptions::new(redis.url(), name);
    options.replicas = NAMES.iter().map(|r| r.to_string()).collect();
    options.call_timeout = Duration::from_millis(500);
    let mut settings = settings(dir, FLEET, caps);
    settings.store = Some(StoreLocation::parse(url).unwrap());
    start_shared(settings, options).await
}

struct Fleet {
    replicas: Vec<Harness>,
    _dirs: Vec<tempfile::TempDir>,
    /// Held while the fleet runs: the server stops with its last holder.
    _server: std::sync::Arc<PostgresServer>,
    /// Stopped with the fleet, after its replicas (fields drop in order).
    _redis: support::redis::RedisServer,
}

impl Fleet {
    /// Rows in `table` of the fleet's database `database`, as psql prints the count.
    fn count(&self, database: &str, table: &str) -> String {
        self._server
            .psql(database, &format!("SELECT count(*) FROM {table}"))
    }

    /// Checks that no replica's counts drift from the store, then shuts every replica down.
    async fn end_without_drift(self) {
        for harness in &self.replicas {
            let drift = harness.broker.check_drift().await.unwrap();
            assert_eq!(drift.total(), 0, "{drift:?}");
        }
        for harness in self.replicas {
            harness.broker.shutdown().await;
        }
    }
}

/// Storage caps whose stream store holds `client_files` streams a client and `global_files`
/// in all (bytes never bind).
fn stream_caps(client_files: u64, global_files: u64) -> StorageCaps {
    StorageCaps {
        stream: StoreCaps {
            global_files,
            global_bytes: 1 << 20,
            client_files,
            client_bytes: 1 << 20,
        },
        ..StorageCaps::default()
    }
}

async fn fleet(database: &str) -> Option<(Fleet, String)> {
    fleet_with(database, StorageCaps::default()).await
}

/// [`fleet`] with the storage caps `caps`.
async fn fleet_with(database: &str, caps: StorageCaps) -> Option<(Fleet, String)> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn")
        .with_test_writer()
        .try_init();
    let redis = support::redis::RedisServer::start()?;
    let server = PostgresServer::shared()?;
    let url = server.database(database);
    let mut replicas = Vec::new();
    let mut dirs = Vec::new();
    for name in NAMES {
        let dir = tempfile::tempdir().unwrap();
        replicas.push(replica(&redis, &url, dir.path(), name, caps).await);
        dirs.push(dir);
    }
    Some((
        Fleet {
            replicas,
            _dirs: dirs,
            _server: server,
            _redis: redis,
        },
        url,
    ))
}

fn op_path(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

async fn state_on(harness: &Harness, id: &str) -> String {
    harness.get(&op_path(id), Some(AGENT_SECRET)).await.body["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The event log read from `harness`'s operator listener: (cursor, request, status) of the
/// first `n` events.
async fn event_log(harness: &Harness, n: usize) -> Vec<(String, String, String)> {
    let mut stream = open(&harness.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    stream
        .next_events(n)
        .await
        .iter()
        .map(|event: &Value| {
            (
                event["cursor"].to_string(),
                event["request_id"].to_string(),
                event["status"].to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_replica_serves_any_request_and_the_fleet_has_one_inbox_and_one_event_log() {
    let Some((fleet, _url)) = fleet("fleet_round_robin").await else {
        eprintln!("SKIPPED: needs redis-server and postgres");
        return;
    };
    let [r1, r2, r3] = &fleet.replicas[..] else {
        unreachable!()
    };
    // Created on r1; replayed on r2 and r3: the same operation, 200.
    let created = r1
        .submit(AGENT_SECRET, &request("rr-1", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202, "{:?}", created.body);
    let id = created.id();
    for other in [r2, r3] {
        let replay = other
            .submit(AGENT_SECRET, &request("rr-1", "demo.request", 0))
            .await;
        assert_eq!(replay.status, 200, "{:?}", replay.body);
        assert_eq!(replay.id(), id);
        // The same key for another request is a conflict on every replica.
        let conflict = other
            .submit(AGENT_SECRET, &request("rr-1", "demo.request", 7))
            .await;
        assert_eq!(conflict.status, 409, "{:?}", conflict.body);
        assert_eq!(conflict.code(), "idempotency_conflict");
        // Read from any replica.
        assert_eq!(state_on(other, &id).await, "pending");
    }
    // One key sent to two replicas at once: one operation.
    let body = request("rr-race", "demo.request", 0);
    let (a, b) = tokio::join!(
        r2.submit(AGENT_SECRET, &body),
        r3.submit(AGENT_SECRET, &body)
    );
    let mut statuses = [a.status, b.status];
    statuses.sort();
    assert_eq!(statuses, [200, 202], "{:?} {:?}", a.body, b.body);
    assert_eq!(a.id(), b.id());
    let raced = a.id();
    // One inbox: every replica lists both requests.
    for harness in [r1, r2, r3] {
        let mut pending = harness.operator.pending().await;
        pending.sort();
        let mut expected = vec![id.clone(), raced.clone()];
        expected.sort();
        assert_eq!(pending, expected);
    }
    // A wait on r3 is woken by a decision on r2 for r1's request.
    let wait_path = format!("{}/events?after_revision=1&wait_seconds=20", op_path(&id));
    let wait = r3.get(&wait_path, Some(AGENT_SECRET));
    let approve = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        r2.operator.approve(&id).await
    };
    let started = std::time::Instant::now();
    let (woken, approved) = tokio::join!(wait, approve);
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    assert_eq!(woken.status, 200, "{:?}", woken.body);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the wait was woken by the change, not its timeout"
    );
    // It runs on its owner, r1, and is seen to succeed everywhere.
    assert_eventually("r1's request approved on r2 ran", async || {
        state_on(r3, &id).await == "succeeded"
    })
    .await;
    // A cancel on r1 of the request created on r2 or r3: its owner's counts follow.
    let canceled = r1
        .post(&format!("{}/cancel", op_path(&raced)), Some(AGENT_SECRET))
        .await;
    assert_eq!(canceled.status, 200, "{:?}", canceled.body);
    assert_eq!(canceled.state(), "canceled");
    assert_eventually("every replica's counts are back to zero", async || {
        fleet.replicas.iter().all(|r| {
            let snapshot = r.snapshot();
            snapshot.pending == 0 && snapshot.active == 0 && snapshot.executing == 0
        })
    })
    .await;
    // A second decision on the ended request is refused on every replica.
    for harness in [r1, r2, r3] {
        let again = harness.operator.deny(&raced).await;
        assert_eq!(again.status, 409, "{:?}", again.body);
    }
    // One event log: the same events in the same order from every replica (created ×2,
    // approved, executing, succeeded, canceled).
    let log = event_log(r1, 6).await;
    assert_eq!(log.len(), 6, "{log:?}");
    for harness in [r2, r3] {
        assert_eq!(event_log(harness, 6).await, log);
    }
    // A stream uploaded on r1 lives in the store, not on r1's disk; deleted on r3, its room is
    // free on r1.
    let uploaded = r1
        .send(
            "POST",
            "/api/agent/v1/streams",
            Some(AGENT_SECRET),
            Some(vec![7u8; 4096].into()),
        )
        .await;
    assert_eq!(uploaded.status, 201, "{:?}", uploaded.body);
    let stream = uploaded.body["id"].as_str().unwrap().to_owned();
    let database = _url.rsplit('/').next().unwrap();
    assert_eq!(
        fleet._server.psql(
            database,
            &format!("SELECT length(body), owner FROM streams WHERE id = '{stream}'")
        ),
        "4096|f1"
    );
    let streams_dir = fleet._dirs[0].path().join("streams");
    assert!(
        streams_dir.is_dir(),
        "the upload was staged in {streams_dir:?}"
    );
    assert!(
        !streams_dir.join(&stream).exists(),
        "the body is not left on the replica's disk"
    );
    let deleted = r3
        .send(
            "DELETE",
            &format!("/api/agent/v1/streams/{stream}"),
            Some(AGENT_SECRET),
            None,
        )
        .await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    assert_eventually("r1 lets the deleted stream's room go", async || {
        r1.broker.check_drift().await.unwrap().total() == 0 && r1.snapshot().storage[0].files == 0
    })
    .await;
    fleet.end_without_drift().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_leaves_its_work_to_the_others_and_nothing_runs_twice() {
    let Some((fleet, url)) = fleet("fleet_takeover").await else {
        eprintln!("SKIPPED: needs redis-server and postgres");
        return;
    };
    let server = std::sync::Arc::clone(&fleet._server);
    let mut replicas = fleet.replicas.into_iter();
    let (r1, r2, r3) = (
        replicas.next().unwrap(),
        replicas.next().unwrap(),
        replicas.next().unwrap(),
    );
    // On r1: work executing (long), and a request pending.
    let running = r1
        .submit(AGENT_SECRET, &request("running", "demo.run", 600_000))
        .await;
    assert_eq!(running.status, 202, "{:?}", running.body);
    let running = running.id();
    assert_eventually("r1 executes its work", async || {
        state_on(&r2, &running).await == "executing"
    })
    .await;
    let pending = r1
        .submit(AGENT_SECRET, &request("pending", "demo.request", 0))
        .await;
    assert_eq!(pending.status, 202, "{:?}", pending.body);
    let pending = pending.id();
    // r1 stops as a crash would leave it: its executing work stays `executing` in the store.
    r1.broker.shutdown().await;
    // Within a lease (and the survivors' own first lease), a survivor takes r1's work over.
    assert_eventually_within(
        Duration::from_secs(40),
        "r1's executing work ends execution_interrupted",
        async || {
            let op = r2.get(&op_path(&running), Some(AGENT_SECRET)).await;
            op.body["state"] == "failed" && op.body["error"]["code"] == "execution_interrupted"
        },
    )
    .await;
    // Its pending request is now a survivor's: an approval on any replica runs it, once.
    let approved = r3.operator.approve(&pending).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    assert_eventually_within(
        Duration::from_secs(30),
        "r1's request ran on a survivor",
        async || state_on(&r2, &pending).await == "succeeded",
    )
    .await;
    let database = url.rsplit('/').next().unwrap();
    // Created, approved, started, succeeded: four revisions and four events, so it started
    // once (a second start would have moved it again).
    let revisions = server.psql(
        database,
        &format!(
            "SELECT revision, (SELECT count(*) FROM operator_events WHERE request_id = '{pending}') \
             FROM operations WHERE id = '{pending}'"
        ),
    );
    assert_eq!(revisions.trim(), "4|4", "it started exactly once");
    let owner = server.psql(
        database,
        &format!("SELECT owner FROM operations WHERE id = '{pending}'"),
    );
    assert!(
        owner.trim() == "f2" || owner.trim() == "f3",
        "owned by a survivor: {owner}"
    );
    assert_eventually("the survivors' counts are back to zero", async || {
        [&r2, &r3].iter().all(|r| {
            let snapshot = r.snapshot();
            snapshot.pending == 0 && snapshot.active == 0 && snapshot.executing == 0
        })
    })
    .await;
    for harness in [&r2, &r3] {
        let drift = harness.broker.check_drift().await.unwrap();
        assert_eq!(drift.total(), 0, "{drift:?}");
    }
    r2.broker.shutdown().await;
    r3.broker.shutdown().await;
}

/// A `redis-server` of its own and a fresh database named `name` on the shared PostgreSQL
/// server (its URL), or `None` having said which cannot be run here.
fn redis_and_database(
    name: &str,
) -> Option<(
    support::redis::RedisServer,
    std::sync::Arc<PostgresServer>,
    String,
)> {
    let Some(redis) = support::redis::RedisServer::start() else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return None;
    };
    let server = PostgresServer::shared()?;
    let url = server.database(name);
    Some((redis, server, url))
}

/// `assert_eventually` with a longer patience (a takeover waits out leases).
async fn assert_eventually_within(
    patience: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> bool,
) {
    let deadline = std::time::Instant::now() + patience;
    loop {
        if check().await {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drift_between_redis_and_the_store_that_persists_heals_from_the_store() {
    let Some((redis, _server, url)) = redis_and_database("fleet_heals") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut options = RedisOptions::new(redis.url(), "h1");
    options.replicas = vec!["h1".to_owned()];
    let mut settings = settings(dir.path(), FLEET, StorageCaps::default());
    settings.store = Some(StoreLocation::parse(&url).unwrap());
    settings.drift_interval = Duration::from_millis(200);
    let h1 = start_shared(settings, options).await;
    let first = h1
        .submit(AGENT_SECRET, &request("kept", "demo.request", 0))
        .await;
    assert_eq!(first.status, 202, "{:?}", first.body);
    // Redis as an older snapshot has it: from before the second admission (its record and its
    // counts lost together, as a failover that lost its replication lag leaves them).
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let snapshot: Vec<(String, Vec<u8>)> = {
        let mut dumped = Vec::new();
        for key in ["{admission}:counts", "{admission}:ops"] {
            let dump: Vec<u8> = redis::cmd("DUMP")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
            dumped.push((key.to_owned(), dump));
        }
        dumped
    };
    let lost = h1
        .submit(AGENT_SECRET, &request("lost", "demo.request", 0))
        .await;
    assert_eq!(lost.status, 202, "{:?}", lost.body);
    for (key, dump) in &snapshot {
        let _: () = redis::cmd("RESTORE")
            .arg(key)
            .arg(0)
            .arg(dump.as_slice())
            .arg("REPLACE")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    // Redis now counts one pending request of two: the drift readings see it, twice, and the
    // replica counts its holdings again from what the store says.
    assert_eventually_within(
        Duration::from_secs(30),
        "redis counts both again",
        async || {
            h1.broker
                .admission()
                .counts()
                .await
                .is_ok_and(|counts| counts.clients.get("agent").map(|c| c.1) == Some(2))
        },
    )
    .await;
    let report = h1.broker.check_drift().await.unwrap();
    assert_eq!(report.fleet, Some(Vec::new()), "{report:?}");
    assert!(report.is_clean(), "{report:?}");
    h1.broker.shutdown().await;
}

/// A replica of a fleet that names no `replicas` list: the store's membership is its fleet.
async fn unlisted_replica(
    redis: &str,
    url: &str,
    dir: &std::path::Path,
    name: &str,
    lease: Duration,
) -> Harness {
    let mut options = RedisOptions::new(redis.to_owned(), name);
    options.call_timeout = Duration::from_millis(500);
    options.lease_ttl = lease;
    options.heartbeat = lease / 3;
    let mut settings = settings(dir, FLEET, StorageCaps::default());
    settings.store = Some(StoreLocation::parse(url).unwrap());
    start_shared(settings, options).await
}

/// What Redis records for operation `id` (`"<state> <replica> <client>"`), if anything.
async fn record_of(conn: &mut redis::aio::MultiplexedConnection, id: &str) -> Option<String> {
    redis::cmd("HGET")
        .arg("{admission}:ops")
        .arg(id)
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_forgets_one_replica_counts_the_work_of_a_replica_that_died_from_the_store() {
    let Some((redis, _server, url)) = redis_and_database("fleet_rebuild") else {
        return;
    };
    let lease = Duration::from_secs(10);
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let g1 = unlisted_replica(&redis.url(), &url, d1.path(), "g1", lease).await;
    // g2 runs in a runtime of its own, so that it can die as a crash leaves it: its tasks gone
    // at once, nothing given up (its store membership and its work stay as they were).
    let (made, pending) = std::sync::mpsc::channel();
    let (kill, killed) = std::sync::mpsc::channel::<()>();
    let (redis_url, store_url, dir) = (redis.url(), url.clone(), d2.path().to_owned());
    let g2 = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let g2 = runtime.block_on(async {
            let g2 = unlisted_replica(&redis_url, &store_url, &dir, "g2", lease).await;
            let reply = g2
                .submit(AGENT_SECRET, &request("g2-pending", "demo.request", 0))
                .await;
            assert_eq!(reply.status, 202, "{:?}", reply.body);
            let other = g2
                .submit(AGENT_SECRET, &request("g2-denied", "demo.request", 0))
                .await;
            assert_eq!(other.status, 202, "{:?}", other.body);
            made.send((reply.id(), other.id())).unwrap();
            g2
        });
        killed.recv().unwrap();
        // Nothing of g2 runs any more; its handles are never dropped (no goodbye either).
        std::mem::forget(g2);
        runtime.shutdown_background();
    });
    let (pending, denied) = tokio::task::spawn_blocking(move || pending.recv().unwrap())
        .await
        .unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    assert_eq!(
        record_of(&mut conn, &pending).await.as_deref(),
        Some("p g2 agent")
    );
    kill.send(()).unwrap();
    g2.join().unwrap();
    // Redis forgets, a moment after g2 died: nobody will register g2's work again.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    // g1 finds out at its next call and registers again; from the store it counts g2's work
    // under g2's name, long before g2's membership lapses and g1 takes the work over.
    let refused = g1
        .submit(AGENT_SECRET, &request("during", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eventually_within(
        Duration::from_secs(5),
        "g2's pending request is counted again, as g2's",
        async || record_of(&mut conn, &pending).await.as_deref() == Some("p g2 agent"),
    )
    .await;
    assert_eq!(
        record_of(&mut conn, &denied).await.as_deref(),
        Some("p g2 agent")
    );
    let counts = g1.broker.admission().counts().await.unwrap();
    assert_eq!(counts.clients.get("agent"), Some(&(2, 2, 0)), "{counts:?}");
    // An operator denies one of them on g1 while g2 is gone: written to the store; its owner,
    // dead, never follows it in the counts.
    let reply = g1.operator.deny(&denied).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    // g2's membership lapses and g1 takes the live one over (moved in Redis, not counted
    // twice); g2's rebuilt lease lapses and what it held besides (the denied one) is released.
    assert_eventually_within(
        Duration::from_secs(30),
        "g1 takes g2's request over, and g2's lapsed lease frees the denied one",
        async || {
            record_of(&mut conn, &pending).await.as_deref() == Some("p g1 agent")
                && record_of(&mut conn, &denied).await.is_none()
                && g1
                    .broker
                    .admission()
                    .counts()
                    .await
                    .is_ok_and(|counts| counts.clients.get("agent") == Some(&(1, 1, 0)))
        },
    )
    .await;
    // The recovery window closed with the lease at the latest, and the request ends once.
    let reply = g1.operator.deny(&pending).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eventually_within(
        Duration::from_secs(15),
        "the counts are back to zero",
        async || {
            g1.broker
                .admission()
                .counts()
                .await
                .is_ok_and(|c| c.is_idle())
        },
    )
    .await;
    assert_eventually_within(
        Duration::from_secs(15),
        "admitted again once the window closed",
        async || {
            g1.submit(AGENT_SECRET, &request("after", "demo.request", 0))
                .await
                .status
                == 202
        },
    )
    .await;
    let drift = g1.broker.check_drift().await.unwrap();
    assert_eq!(drift.total(), 0, "{drift:?}");
    g1.broker.shutdown().await;
}

/// What replica `harness`'s own controller counts for `client`: (active, pending).
fn counted_here(harness: &Harness, client: &str) -> (u64, u64) {
    let snapshot = harness.broker.controller().snapshot();
    let counted = snapshot
        .clients
        .iter()
        .find(|c| c.identity.as_str() == client);
    counted.map_or((0, 0), |c| (c.active, c.pending))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_work_was_taken_over_while_it_was_cut_off_lets_it_go_without_a_release() {
    let Some((redis, server, url)) = redis_and_database("fleet_cut_off") else {
        return;
    };
    let lease = Duration::from_secs(10);
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let c1 = unlisted_replica(&redis.url(), &url, d1.path(), "c1", lease).await;
    let c2 = unlisted_replica(&redis.url(), &url, d2.path(), "c2", lease).await;
    let reply = c1
        .submit(AGENT_SECRET, &request("held", "demo.request", 0))
        .await;
    assert_eq!(reply.status, 202, "{:?}", reply.body);
    let id = reply.id();
    // c1 is cut off from the store's membership while it keeps serving (and Redis): its
    // renewals are swallowed and its lease lapses, so c2 takes its work over.
    server.psql(
        "fleet_cut_off",
        "CREATE FUNCTION cut_off() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         IF NEW.name = 'c1' AND NEW.lease_until > clock_timestamp() THEN RETURN NULL; END IF; \
         RETURN NEW; END $$; \
         CREATE TRIGGER cut_off BEFORE INSERT OR UPDATE ON replicas \
         FOR EACH ROW EXECUTE FUNCTION cut_off(); \
         UPDATE replicas SET lease_until = clock_timestamp() - interval '1 minute' \
         WHERE name = 'c1'",
    );
    let owner = format!("SELECT owner FROM operations WHERE id = '{id}'");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    assert_eventually_within(
        Duration::from_secs(30),
        "c2 takes c1's request over, in the store and in Redis",
        async || {
            server.psql("fleet_cut_off", &owner) == "c2"
                && record_of(&mut conn, &id).await.as_deref() == Some("p c2 agent")
        },
    )
    .await;
    // c1 lets its handle go (its counts, its drift) and releases nothing in Redis: the request
    // stays counted once, as c2's.
    assert_eventually_within(
        Duration::from_secs(15),
        "c1 lets go of the request taken from it",
        async || {
            counted_here(&c1, "agent") == (0, 0)
                && c1.broker.check_drift().await.unwrap().total() == 0
        },
    )
    .await;
    assert_eq!(counted_here(&c2, "agent"), (1, 1));
    assert_eq!(
        record_of(&mut conn, &id).await.as_deref(),
        Some("p c2 agent")
    );
    let counts = c1.broker.admission().counts().await.unwrap();
    assert_eq!(counts.clients.get("agent"), Some(&(1, 1, 0)), "{counts:?}");
    // c1 is back: it serves as before, and the request ends once, decided on c1.
    server.psql("fleet_cut_off", "DROP TRIGGER cut_off ON replicas");
    let reply = c1.operator.deny(&id).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eventually_within(
        Duration::from_secs(15),
        "the counts are back to zero",
        async || {
            c1.broker
                .admission()
                .counts()
                .await
                .is_ok_and(|c| c.is_idle())
                && counted_here(&c2, "agent") == (0, 0)
        },
    )
    .await;
    let again = c1
        .submit(AGENT_SECRET, &request("after", "demo.request", 0))
        .await;
    assert_eq!(again.status, 202, "{:?}", again.body);
    for harness in [&c1, &c2] {
        let drift = harness.broker.check_drift().await.unwrap();
        assert_eq!(drift.total(), 0, "{drift:?}");
    }
    c1.broker.shutdown().await;
    c2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_forgets_the_store_names_the_fleet_so_admissions_resume_once_all_registered() {
    let Some((redis, _server, url)) = redis_and_database("fleet_window") else {
        return;
    };
    // A lease far longer than the test waits: a window that lasted it would fail the test.
    let lease = Duration::from_secs(120);
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let w1 = unlisted_replica(&redis.url(), &url, d1.path(), "w1", lease).await;
    let w2 = unlisted_replica(&redis.url(), &url, d2.path(), "w2", lease).await;
    let first = w2
        .submit(AGENT_SECRET, &request("w2-pending", "demo.request", 0))
        .await;
    assert_eq!(first.status, 202, "{:?}", first.body);
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    // Each finds out at its next call and registers again. Neither lists the fleet, yet the
    // store's membership names both, so the window closes once both are back.
    let during = w1
        .submit(AGENT_SECRET, &request("during", "demo.request", 0))
        .await;
    assert_eq!(during.status, 503, "{:?}", during.body);
    let _ = w2
        .submit(AGENT_SECRET, &request("during-2", "demo.request", 0))
        .await;
    assert_eventually_within(
        Duration::from_secs(20),
        "admitted again, long before the lease",
        async || {
            w1.submit(AGENT_SECRET, &request("after", "demo.request", 0))
                .await
                .status
                == 202
        },
    )
    .await;
    let counts = w1.broker.admission().counts().await.unwrap();
    // w2's request (counted once, whoever counted it first) and w1's new one.
    assert_eq!(
        counts.clients.get("agent").map(|c| c.1),
        Some(2),
        "{counts:?}"
    );
    for harness in [&w1, &w2] {
        let drift = harness.broker.check_drift().await.unwrap();
        assert_eq!(drift.total(), 0, "{drift:?}");
    }
    w1.broker.shutdown().await;
    w2.broker.shutdown().await;
}

/// An upload of `n` bytes on `harness` as the client of `token`.
async fn upload(harness: &Harness, token: &str, n: usize) -> support::http::Reply {
    let body = Some(vec![7u8; n].into());
    harness
        .send("POST", "/api/agent/v1/streams", Some(token), body)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_caps_count_the_streams_and_uploads_of_every_replica() {
    // A client may hold two streams and the fleet four, whichever replicas took them.
    let caps = stream_caps(2, 4);
    let Some((fleet, url)) = fleet_with("fleet_stream_caps", caps).await else {
        eprintln!("SKIPPED: needs redis-server and postgres");
        return;
    };
    let database = url.rsplit('/').next().unwrap();
    let count = |table: &str| fleet.count(database, table);
    let [r1, r2, r3] = [&fleet.replicas[0], &fleet.replicas[1], &fleet.replicas[2]];
    let first = upload(r1, AGENT_SECRET, 100).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(upload(r2, AGENT_SECRET, 100).await.status, 201);

    // The agent's third, on a replica holding none of its streams: refused before a byte is
    // read, and nothing kept: no row, no upload, no staged file, no room on r3.
    let refused = upload(r3, AGENT_SECRET, 100).await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "stream_storage_limit"),
        "{}",
        refused.body
    );
    assert!(refused.retry_after().is_some_and(|s| s >= 1));
    assert_eq!(
        (count("streams"), count("stream_uploads")),
        ("2".into(), "0".into())
    );
    let staged = fleet._dirs[2].path().join("streams");
    assert!(
        std::fs::read_dir(&staged).map_or(true, |mut files| files.next().is_none()),
        "nothing staged in {staged:?}"
    );
    let on_r3 = r3.snapshot();
    assert_eq!((on_r3.storage[0].files, on_r3.storage[0].bytes), (0, 0));
    assert_eq!(on_r3.rejected(RefusalCode::StreamStorageLimit), 1);

    // Deleted on r3, the first stream's room is the agent's again on every replica.
    let path = format!("/api/agent/v1/streams/{}", first.id());
    assert_eq!(
        r3.send("DELETE", &path, Some(AGENT_SECRET), None)
            .await
            .status,
        200
    );
    assert_eq!(upload(r3, AGENT_SECRET, 100).await.status, 201);

    // An upload left behind by a replica that is gone holds no room.
    fleet._server.psql(
        database,
        "INSERT INTO stream_uploads (id, client_id, size, owner, started_at) \
         VALUES ('st_gone', 'other', 100, 'gone', '2026-01-01T00:00:00.000Z')",
    );
    // The fleet holds 2 of its 4; the other client sends 6 at once, two to each replica:
    // exactly 2 are stored, whichever replicas they reached.
    let uploads = fleet
        .replicas
        .iter()
        .cycle()
        .take(6)
        .map(|harness| upload(harness, OTHER_SECRET, 10));
    let replies = futures_util::future::join_all(uploads).await;
    let mut statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    statuses.sort();
    let bodies: Vec<String> = replies.iter().map(|r| r.body.to_string()).collect();
    assert_eq!(statuses, [201, 201, 429, 429, 429, 429], "{bodies:?}");
    assert_eq!(
        (count("streams"), count("stream_uploads")),
        ("4".into(), "0".into())
    );

    let held: u64 = fleet
        .replicas
        .iter()
        .map(|h| h.snapshot().storage[0].files)
        .sum();
    assert_eq!(held, 4, "each stream is counted by one replica");
    fleet.end_without_drift().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_and_deletes_on_every_replica_at_once_never_hold_more_than_the_caps() {
    // A client may hold three streams and the fleet five; two clients upload and delete on the
    // three replicas at once while a watcher reads what the store holds.
    let caps = stream_caps(3, 5);
    let Some((fleet, url)) = fleet_with("fleet_stream_stress", caps).await else {
        eprintln!("SKIPPED: needs redis-server and postgres");
        return;
    };
    let database = url.rsplit('/').next().unwrap().to_owned();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (server, stop, database) = (
            std::sync::Arc::clone(&fleet._server),
            std::sync::Arc::clone(&stop),
            database.clone(),
        );
        // Stored streams and uploads in progress, per client, in one snapshot.
        let held = "SELECT client_id || ' ' || count(*) FROM (SELECT client_id FROM streams \
                    UNION ALL SELECT client_id FROM stream_uploads) AS held GROUP BY client_id";
        std::thread::spawn(move || {
            let mut readings = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut total = 0;
                for line in server.psql(&database, held).lines() {
                    let (client, n) = line.split_once(' ').unwrap();
                    let n: u64 = n.parse().unwrap();
                    assert!(n <= 3, "{client} holds {n} streams and uploads");
                    total += n;
                }
                assert!(total <= 5, "the fleet holds {total} streams and uploads");
                readings += 1;
            }
            readings
        })
    };
    let replicas = &fleet.replicas;
    let work = [AGENT_SECRET, OTHER_SECRET].into_iter().flat_map(|token| {
        (0..3).map(move |first| async move {
            let (mut stored, mut refused) = (0, 0);
            for round in 0..8 {
                let reply = upload(&replicas[(first + round) % 3], token, 50).await;
                match reply.status {
                    201 => stored += 1,
                    429 => {
                        assert_eq!(reply.code(), "stream_storage_limit");
                        refused += 1;
                        continue;
                    }
                    status => panic!("{status}: {}", reply.body),
                }
                // Every other stream is deleted at once, on another replica.
                if round % 2 == 0 {
                    let path = format!("/api/agent/v1/streams/{}", reply.id());
                    let deleted = replicas[(first + round + 1) % 3]
                        .send("DELETE", &path, Some(token), None)
                        .await;
                    assert_eq!(deleted.status, 200, "{}", deleted.body);
                }
            }
            (stored, refused)
        })
    });
    let outcomes = futures_util::future::join_all(work).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let readings = watcher.join().unwrap();
    let stored: u32 = outcomes.iter().map(|o| o.0).sum();
    let refused: u32 = outcomes.iter().map(|o| o.1).sum();
    eprintln!("{stored} stored, {refused} refused, {readings} readings of the store");
    assert!(
        stored > 5 && refused > 0,
        "the caps were reached and room came back"
    );
    assert!(readings > 0);

    // Everything left is deleted, from any replica; nothing is held anywhere after.
    let left = fleet
        ._server
        .psql(&database, "SELECT id || ' ' || client_id FROM streams");
    for line in left.lines() {
        let (id, client) = line.split_once(' ').unwrap();
        let token = if client == "agent" {
            AGENT_SECRET
        } else {
            OTHER_SECRET
        };
        let path = format!("/api/agent/v1/streams/{id}");
        let deleted = replicas[0].send("DELETE", &path, Some(token), None).await;
        assert_eq!(deleted.status, 200, "{}", deleted.body);
    }
    let count = |table: &str| fleet.count(&database, table);
    assert_eq!(
        (count("streams"), count("stream_uploads")),
        ("0".into(), "0".into())
    );
    assert_eventually("every replica lets its streams' room go", async || {
        replicas.iter().all(|h| h.snapshot().storage[0].files == 0)
    })
    .await;
    fleet.end_without_drift().await;
}
