//! A retry is never penalised on replicas, whichever store they keep their operations in. The
//! seed orders replay before quota charging, so a client "retrying correctly with a stable
//! request ID is not penalised for the retry": a client at its pending limit, refused from the
//! refusal memory of one replica, retries there a key another replica created. On replicas that
//! share one PostgreSQL store the retry is the replay (200), at once; on replicas each with a
//! SQLite store of its own it is 409 `idempotency_key_elsewhere`, at once.

mod support;

use std::time::Duration;

use support::broker::{Harness, settings, start_shared};
use support::http::request;
use support::postgres::PostgresServer;
use support::secrets::AGENT_SECRET;
use unyolo_admission::StorageCaps;
use unyolo_admission::redis::RedisOptions;
use unyolo_admission_broker::store::StoreLocation;

/// Two pending operations per client, across every replica.
const TIGHT: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 4, "client_pending": 2, "global_active": 100, "global_executing": 10}"#;

/// Replica `name` of two (`r1`, `r2`) on `redis`, limits [`TIGHT`], its operations in
/// `store` (`None`: a SQLite file in `dir`).
async fn replica(
    redis: &support::redis::RedisServer,
    dir: &std::path::Path,
    name: &str,
    store: Option<&str>,
) -> Harness {
    let mut options = RedisOptions::new(redis.url(), name);
    options.replicas = vec!["r1".to_owned(), "r2".to_owned()];
    options.call_timeout = Duration::from_millis(500);
    let mut settings = settings(dir, TIGHT, StorageCaps::default());
    settings.broker_name = name.to_owned();
    settings.store = store.map(|url| StoreLocation::parse(url).unwrap());
    start_shared(settings, options).await
}

/// The seed orders replay before quota charging: a client retrying correctly with a stable key
/// is not penalised for the retry. A client at its pending limit retries, on the other replica,
/// a key bound on the first: the answer is the key's (409 `idempotency_key_elsewhere`), at once,
/// though that replica refuses the client from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_bound_elsewhere_is_answered_as_such_before_a_refusal_from_memory() {
    let server = redis_or_skip!();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let r1 = replica(&server, d1.path(), "r1", None).await;
    let r2 = replica(&server, d2.path(), "r2", None).await;
    for key in ["k1", "k2"] {
        let created = r1
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(created.status, 202, "{:?}", created.body);
    }
    // Redis refuses r2 the client's next request; r2 remembers the refusal.
    let refused = r2
        .submit(AGENT_SECRET, &request("k3", "demo.request", 0))
        .await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "client_pending_limit")
    );
    let calls = support::redis::script_calls(server.port);
    let remembered = r2
        .submit(AGENT_SECRET, &request("k4", "demo.request", 0))
        .await;
    assert_eq!(
        (remembered.status, remembered.code()),
        (429, "client_pending_limit")
    );
    assert_eq!(
        support::redis::script_calls(server.port),
        calls,
        "the refusal came from memory"
    );
    // The retry of a key bound on r1, on r2: the key's answer, not the remembered refusal.
    let retry = r2
        .submit(AGENT_SECRET, &request("k1", "demo.request", 0))
        .await;
    assert_eq!(
        (retry.status, retry.code()),
        (409, "idempotency_key_elsewhere"),
        "{:?}",
        retry.body
    );
    assert_eq!(
        support::redis::script_calls(server.port),
        calls,
        "no script ran for it"
    );
    // On r1, whose store holds it, the retry is a replay as ever.
    let replay = r1
        .submit(AGENT_SECRET, &request("k1", "demo.request", 0))
        .await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    r1.broker.shutdown().await;
    r2.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_shared_store_a_retry_refused_from_memory_elsewhere_is_the_replay() {
    let Some(redis) = support::redis::RedisServer::start() else {
        return;
    };
    let Some(postgres) = PostgresServer::shared() else {
        return;
    };
    let url = postgres.database("replays_elsewhere");
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let p1 = replica(&redis, d1.path(), "r1", Some(&url)).await;
    let p2 = replica(&redis, d2.path(), "r2", Some(&url)).await;
    let mut created = Vec::new();
    for key in ["k1", "k2"] {
        let reply = p1
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(reply.status, 202, "{:?}", reply.body);
        created.push(reply.id());
    }
    let refused = p2
        .submit(AGENT_SECRET, &request("k3", "demo.request", 0))
        .await;
    assert_eq!(
        (refused.status, refused.code()),
        (429, "client_pending_limit")
    );
    let calls = support::redis::script_calls(redis.port);
    let remembered = p2
        .submit(AGENT_SECRET, &request("k4", "demo.request", 0))
        .await;
    assert_eq!(
        (remembered.status, remembered.code()),
        (429, "client_pending_limit")
    );
    assert_eq!(
        support::redis::script_calls(redis.port),
        calls,
        "the refusal came from memory"
    );
    let retry = p2
        .submit(AGENT_SECRET, &request("k1", "demo.request", 0))
        .await;
    assert_eq!(retry.status, 200, "{:?}", retry.body);
    assert_eq!(retry.id(), created[0]);
    p1.broker.shutdown().await;
    p2.broker.shutdown().await;
}
