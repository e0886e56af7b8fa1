//! A replica paused (SIGSTOP) past its lease while its request is decided, taken over and run by
//! the others: three `admission serve --store postgres://... --redis URL --replica NAME`
//! processes on one real PostgreSQL and one real `redis-server`, driven by signals.
//!
//! Each test pauses the owner `p1` of a request at one point of its life, moves the world on
//! without it (a decision on `p2`, a takeover and a run on `p2` or `p3`), then resumes it, and
//! checks that nothing counts the request any more: at the first drift reading of every replica
//! the counts equal the rows (`drift` 0) and Redis holds for each replica what its rows say
//! (`fleet_drift` 0); Redis counts nothing; and the client's next submissions on `p1` are
//! admitted up to its limits, not one below them. The orders of events:
//!
//! - the decision before the takeover, the owner paused holding the request;
//! - the decision after the takeover;
//! - the owner stopped between its row's commit and its answer (the debug build's
//!   `ADMISSION_TEST_STOP_AFTER_INSERT`);
//! - the request still running on the taker when the owner resumes (the owner must not count it
//!   under its own name again when it registers);
//! - PostgreSQL restarted during the pause;
//! - the owner killed and restarted instead of paused.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::http::request;
use support::postgres::PostgresServer;
use support::redis::RedisServer;
use support::secrets::AGENT_SECRET;
use support::serve::{Files, Server};

/// Two pending requests and three active operations for the client: one leaked count is one
/// submission refused.
const LIMITS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 3, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;

const NAMES: [&str; 3] = ["p1", "p2", "p3"];

/// A takeover waits for the paused replica's membership (10 s) to lapse, and for the takers to
/// have been live members for a whole lease; after a PostgreSQL restart, for every lease to be
/// renewed first. A bound, not a claim.
const LEASE_PATIENCE: Duration = Duration::from_secs(90);

/// Where the debug build stops a submission after its row's commit.
const STOP_AFTER_INSERT: &str = "ADMISSION_TEST_STOP_AFTER_INSERT";

struct Fleet {
    redis: RedisServer,
    postgres: Arc<PostgresServer>,
    database: String,
    url: String,
    files: Files,
    tmp: tempfile::TempDir,
    /// `p1`, `p2`, `p3`; `None` while killed.
    replicas: Vec<Option<Server>>,
}

impl Fleet {
    /// Three replicas on a database of `postgres` and a Redis of their own; `p1` started with
    /// `p1_env`.
    fn start(
        postgres: Arc<PostgresServer>,
        database: &str,
        p1_env: &[(&str, &str)],
    ) -> Option<Fleet> {
        Fleet::start_with(postgres, database, p1_env, LIMITS)
    }

    /// [`Fleet::start`] with the quota file `limits`.
    fn start_with(
        postgres: Arc<PostgresServer>,
        database: &str,
        p1_env: &[(&str, &str)],
        limits: &str,
    ) -> Option<Fleet> {
        let redis = RedisServer::start()?;
        let url = postgres.database(database);
        let tmp = tempfile::tempdir().unwrap();
        let files = Files::write(tmp.path(), limits);
        let mut fleet = Fleet {
            redis,
            postgres,
            database: database.to_owned(),
            url,
            files,
            tmp,
            replicas: Vec::new(),
        };
        for (n, name) in NAMES.into_iter().enumerate() {
            let env = if n == 0 { p1_env } else { &[] };
            let server = fleet.spawn(name, env);
            fleet.replicas.push(Some(server));
        }
        Some(fleet)
    }

    fn spawn(&self, name: &str, env: &[(&str, &str)]) -> Server {
        let mut args = vec![
            "--store".to_owned(),
            self.url.clone(),
            "--redis".to_owned(),
            self.redis.url(),
        ];
        args.extend(self.files.replica_args(self.tmp.path(), name, "p1,p2,p3"));
        Server::spawn_with_env(env, &args)
    }

    fn replica(&self, n: usize) -> &Server {
        self.replicas[n].as_ref().expect("a running replica")
    }

    fn psql(&self, sql: &str) -> String {
        self.postgres.psql(&self.database, sql)
    }

    /// The operation's stored state and owner.
    fn row(&self, id: &str) -> (String, String) {
        let row = self.psql(&format!(
            "SELECT state || ' ' || coalesce(owner, '-') FROM operations WHERE id = '{id}'"
        ));
        let (state, owner) = row.trim().split_once(' ').unwrap_or(("-", "-"));
        (state.to_owned(), owner.to_owned())
    }

    /// Waits until the operation's row is as `wanted` says.
    async fn until_row(&self, id: &str, what: &str, wanted: impl Fn(&str, &str) -> bool) {
        let deadline = Instant::now() + LEASE_PATIENCE;
        loop {
            let (state, owner) = self.row(id);
            if wanted(&state, &owner) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never: {what} (the row is {state}, owned by {owner})"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A request created on `p1` (pending), its id.
    async fn pending_on_p1(&self, key: &str) -> String {
        let created = self
            .replica(0)
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(created.status, 202, "{:?}", created.body);
        assert_eq!(created.state(), "pending");
        created.id()
    }

    /// `p1` admits again: it renewed its lease after its pause (a `demo.run` of no duration,
    /// retried while `p1` answers 503, then run to its end).
    async fn until_p1_admits(&self) {
        let deadline = Instant::now() + LEASE_PATIENCE;
        let mut n = 0;
        let id = loop {
            let reply = self
                .replica(0)
                .submit(AGENT_SECRET, &request(&format!("probe-{n}"), "demo.run", 0))
                .await;
            if reply.status == 202 {
                break reply.id();
            }
            assert_eq!(reply.status, 503, "{:?}", reply.body);
            assert!(Instant::now() < deadline, "p1 never admits again");
            n += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        self.until_row(&id, "the probe ran", |state, _| state == "succeeded")
            .await;
    }

    /// What every replica's first drift reading after the world settled must say, and what
    /// Redis and the client's limits must show: nothing counts what ended.
    async fn counts_nothing(&self) {
        let live = self.psql(
            "SELECT count(*) FROM operations WHERE state IN ('pending', 'approved', 'executing')",
        );
        assert_eq!(live, "0", "the store holds no live operation");
        for (n, server) in self.replicas.iter().enumerate() {
            let server = server.as_ref().unwrap();
            let report = server.operator.drift().await;
            assert_eq!(report["drift"], 0, "{}: {report}", NAMES[n]);
            assert_eq!(report["fleet_drift"], 0, "{}: {report}", NAMES[n]);
            for state in ["pending", "queued", "executing"] {
                let counted = server
                    .metric(&format!("admission_operations{{state=\"{state}\"}}"))
                    .await;
                assert_eq!(counted, Some(0), "{} counts {state}", NAMES[n]);
            }
        }
        let held = support::redis::cli(self.redis.port, &["HLEN", "{admission}:ops"]);
        assert_eq!(held.trim(), "0", "redis holds no operation");
        let counts = support::redis::cli(self.redis.port, &["HGETALL", "{admission}:counts"]);
        assert_eq!(counts.trim(), "", "redis counts nothing");
        // The client's whole pending limit is its own again, on the replica that was paused.
        let mut ids = Vec::new();
        for n in 0..2 {
            let reply = self
                .replica(0)
                .submit(
                    AGENT_SECRET,
                    &request(&format!("after-{n}"), "demo.request", 0),
                )
                .await;
            assert_eq!(
                reply.status, 202,
                "request {n} after the pause: {:?}",
                reply.body
            );
            ids.push(reply.id());
        }
        let third = self
            .replica(0)
            .submit(AGENT_SECRET, &request("after-2", "demo.request", 0))
            .await;
        assert_eq!(third.status, 429, "{:?}", third.body);
        assert_eq!(third.code(), "client_pending_limit");
        for id in ids {
            let canceled = self
                .replica(0)
                .post(
                    &format!("/api/agent/v1/operations/{id}/cancel"),
                    AGENT_SECRET,
                )
                .await;
            assert_eq!(canceled.status, 200, "{:?}", canceled.body);
        }
    }
}

/// Pauses `p1` and waits until it is stopped.
async fn pause(server: &Server) {
    server.pause();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.is_stopped() {
        assert!(Instant::now() < deadline, "the replica never stopped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts a fleet on the test binary's shared PostgreSQL, or says why not.
fn fleet(database: &str, p1_env: &[(&str, &str)]) -> Option<Fleet> {
    let Some(postgres) = PostgresServer::shared() else {
        eprintln!("SKIPPED: postgres cannot be started here");
        return None;
    };
    let fleet = Fleet::start(postgres, database, p1_env);
    if fleet.is_none() {
        eprintln!("SKIPPED: redis-server cannot be started here");
    }
    fleet
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_decided_then_taken_over_and_run_while_its_owner_was_paused_is_counted_nowhere_after()
 {
    let Some(fleet) = fleet("decided_then_taken", &[]) else {
        return;
    };
    let id = fleet.pending_on_p1("paused-1").await;
    pause(fleet.replica(0)).await;
    let approved = fleet.replica(1).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    fleet
        .until_row(
            &id,
            "a survivor takes it over and runs it",
            |state, owner| state == "succeeded" && owner != "p1",
        )
        .await;
    fleet.replica(0).resume();
    fleet.until_p1_admits().await;
    fleet.counts_nothing().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_taken_over_then_decided_and_run_while_its_owner_was_paused_is_counted_nowhere_after()
 {
    let Some(fleet) = fleet("taken_then_decided", &[]) else {
        return;
    };
    let id = fleet.pending_on_p1("paused-1").await;
    pause(fleet.replica(0)).await;
    fleet
        .until_row(
            &id,
            "a survivor takes the pending request over",
            |state, owner| state == "pending" && owner != "p1",
        )
        .await;
    let approved = fleet.replica(2).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    fleet
        .until_row(&id, "its new owner runs it", |state, _| {
            state == "succeeded"
        })
        .await;
    fleet.replica(0).resume();
    fleet.until_p1_admits().await;
    fleet.counts_nothing().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_stopped_between_its_row_and_its_answer_whose_request_ran_elsewhere_is_counted_nowhere_after()
 {
    let Some(fleet) = fleet("stopped_after_insert", &[(STOP_AFTER_INSERT, "held-")]) else {
        return;
    };
    // The submission's answer comes only once p1 is continued: sent on a task of its own, with
    // patience for the whole pause.
    let base = fleet.replica(0).base.clone();
    let submission = tokio::spawn(async move {
        let http = reqwest::Client::builder()
            .timeout(LEASE_PATIENCE * 2)
            .build()
            .unwrap();
        let reply = http
            .post(format!("{base}/api/agent/v1/operations"))
            .bearer_auth(AGENT_SECRET)
            .json(&request("held-1", "demo.request", 0))
            .send()
            .await
            .unwrap();
        let status = reply.status().as_u16();
        (status, reply.json::<serde_json::Value>().await.unwrap())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !fleet.replica(0).is_stopped() {
        assert!(
            Instant::now() < deadline,
            "p1 never stopped after the row's commit"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let id = fleet.psql("SELECT id FROM operations WHERE idempotency_key = 'held-1'");
    assert!(!id.is_empty(), "the row is committed before the stop");
    let approved = fleet.replica(1).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    fleet
        .until_row(
            &id,
            "a survivor takes it over and runs it",
            |state, owner| state == "succeeded" && owner != "p1",
        )
        .await;
    fleet.replica(0).resume();
    let (status, body) = submission.await.unwrap();
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["id"], id.as_str());
    fleet.until_p1_admits().await;
    fleet.counts_nothing().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_does_not_count_again_a_request_still_running_on_its_taker() {
    let Some(fleet) = fleet("still_running", &[]) else {
        return;
    };
    let created = fleet
        .replica(0)
        .submit(AGENT_SECRET, &request("long-1", "demo.request", 600_000))
        .await;
    assert_eq!(created.status, 202, "{:?}", created.body);
    let id = created.id();
    pause(fleet.replica(0)).await;
    let approved = fleet.replica(1).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    fleet
        .until_row(
            &id,
            "a survivor takes it over and starts it",
            |state, owner| state == "executing" && owner != "p1",
        )
        .await;
    let taker = NAMES.iter().position(|&n| n == fleet.row(&id).1).unwrap();
    fleet.replica(0).resume();
    fleet.until_p1_admits().await;
    // p1 registered again in Redis with only the work whose rows it owns: the running request
    // is its taker's there, counted once, and p1's own counts let it go.
    for (n, server) in fleet.replicas.iter().enumerate() {
        let report = server.as_ref().unwrap().operator.drift().await;
        assert_eq!(report["drift"], 0, "{}: {report}", NAMES[n]);
        assert_eq!(report["fleet_drift"], 0, "{}: {report}", NAMES[n]);
    }
    let record = support::redis::cli(fleet.redis.port, &["HGET", "{admission}:ops", &id]);
    assert_eq!(record.trim(), format!("e {} agent", NAMES[taker]));
    let executing = fleet
        .replica(0)
        .metric("admission_operations{state=\"executing\"}")
        .await;
    assert_eq!(executing, Some(0), "p1 counts nothing it does not run");
    // Its client: one active operation (the running one), so two pending requests and no third
    // (active 3).
    for n in 0..2 {
        let reply = fleet
            .replica(0)
            .submit(
                AGENT_SECRET,
                &request(&format!("after-{n}"), "demo.request", 0),
            )
            .await;
        assert_eq!(reply.status, 202, "request {n}: {:?}", reply.body);
    }
    let third = fleet
        .replica(0)
        .submit(AGENT_SECRET, &request("after-2", "demo.run", 0))
        .await;
    assert_eq!(third.status, 429, "{:?}", third.body);
    assert_eq!(third.code(), "client_operation_limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_run_elsewhere_while_its_owner_was_paused_and_postgres_restarted_is_counted_nowhere_after()
 {
    // A server of this test's own: it restarts it.
    let Some(postgres) = PostgresServer::start() else {
        eprintln!("SKIPPED: postgres cannot be started here");
        return;
    };
    let Some(mut fleet) = Fleet::start(Arc::new(postgres), "restarted", &[]) else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    let id = fleet.pending_on_p1("paused-1").await;
    pause(fleet.replica(0)).await;
    let approved = fleet.replica(1).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    Arc::get_mut(&mut fleet.postgres)
        .expect("the test's own server")
        .crash_and_restart();
    fleet
        .until_row(
            &id,
            "a survivor takes it over and runs it",
            |state, owner| state == "succeeded" && owner != "p1",
        )
        .await;
    fleet.replica(0).resume();
    fleet.until_p1_admits().await;
    fleet.counts_nothing().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_run_elsewhere_while_its_owner_was_killed_is_counted_nowhere_after_its_restart() {
    let Some(mut fleet) = fleet("killed", &[]) else {
        return;
    };
    let id = fleet.pending_on_p1("killed-1").await;
    drop(fleet.replicas[0].take()); // kill -9
    let approved = fleet.replica(1).operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    fleet
        .until_row(
            &id,
            "a survivor takes it over and runs it",
            |state, owner| state == "succeeded" && owner != "p1",
        )
        .await;
    let restarted = fleet.spawn("p1", &[]);
    fleet.replicas[0] = Some(restarted);
    fleet.until_p1_admits().await;
    fleet.counts_nothing().await;
}

/// A replica paused past its lease holds two executing runs, the fleet's whole execution pool;
/// another replica has approved work waiting for a slot. Redis's lease of the paused replica
/// lapses before the store's takeover interrupts its runs (held back here by the fleet's
/// advisory lock, as a busy store or a slower membership would): reaped then, its slots would
/// go to the waiting work while its rows still execute, and the store would hold three executing
/// operations under a limit of two. A lapsed replica that still owns live rows in the shared
/// store is reaped only once they are taken over: the store never holds more than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_paused_past_its_lease_keeps_its_slots_until_its_work_is_taken_over() {
    const TWO_SLOTS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
      "client_active": 10, "client_pending": 5, "global_active": 100, "global_executing": 2}"#;
    let Some(postgres) = PostgresServer::shared() else {
        eprintln!("SKIPPED: postgres cannot be started here");
        return;
    };
    let Some(fleet) = Fleet::start_with(postgres, "kept_slots", &[], TWO_SLOTS) else {
        eprintln!("SKIPPED: redis-server cannot be started here");
        return;
    };
    // A request on p2 (admitted while the pool is free), then p1 fills the pool with two long
    // runs, then the request is approved: queued on p2.
    let waiting = fleet
        .replica(1)
        .submit(AGENT_SECRET, &request("waiting", "demo.request", 3_000))
        .await;
    assert_eq!(waiting.status, 202, "{:?}", waiting.body);
    let waiting = waiting.id();
    for key in ["long-1", "long-2"] {
        let run = fleet
            .replica(0)
            .submit(AGENT_SECRET, &request(key, "demo.run", 600_000))
            .await;
        assert_eq!(run.status, 202, "{:?}", run.body);
    }
    let executing = || {
        fleet
            .psql("SELECT count(*) FROM operations WHERE state = 'executing'")
            .parse::<u64>()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while executing() < 2 {
        assert!(Instant::now() < deadline, "p1 never started its runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let approved = fleet.replica(2).operator.approve(&waiting).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    // The fleet's lock (joins and takeovers: `store::postgres::schema::FLEET_LOCK`), held past
    // the paused replica's Redis lease (10 s).
    const FLEET_LOCK: i64 = 0x756e_796f_6c6f_0003;
    let mut held = fleet
        .postgres
        .hold_advisory_lock(&fleet.database, FLEET_LOCK, 16);
    pause(fleet.replica(0)).await;
    // Until the waiting request has run, the store never holds more than two executing.
    let mut most = 0;
    let deadline = Instant::now() + LEASE_PATIENCE;
    loop {
        most = most.max(executing());
        let (state, _) = fleet.row(&waiting);
        if state == "succeeded" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the waiting request never ran ({state})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        most <= 2,
        "the store held {most} executing operations under a limit of 2"
    );
    let _ = held.wait();
    // p1's runs were interrupted by the takeover, never run twice.
    let interrupted = fleet.psql(
        "SELECT count(*) FROM operations WHERE idempotency_key LIKE 'long-%' \
         AND state = 'failed' AND error_code = 'execution_interrupted'",
    );
    assert_eq!(interrupted, "2");
    fleet.replica(0).resume();
}
