//! The reference broker on a PostgreSQL store (`BrokerSettings::store`, `serve --store`), end to
//! end against a real PostgreSQL: the agent's and the operator's paths, a restart that restores
//! the counts from the database, and the start-up rule that one replica serves a store until
//! the fleet's claims exist (a second is refused, saying why).

mod support;

use std::sync::Arc;

use support::broker::{ROOMY, settings, start_with};
use support::http::request;
use support::postgres::PostgresServer;
use support::secrets::AGENT_SECRET;
use unyolo_admission::StorageCaps;
use unyolo_admission_broker::store::StoreLocation;
use unyolo_admission_broker::{Broker, BrokerSettings};

/// Settings for a broker whose operations live in `url`, its data dir (secrets, streams, its
/// membership id) in `dir`.
fn on_postgres(dir: &std::path::Path, url: &str) -> BrokerSettings {
    let mut settings = settings(dir, ROOMY, StorageCaps::default());
    settings.store = Some(StoreLocation::parse(url).unwrap());
    settings
}

fn server() -> Option<Arc<PostgresServer>> {
    PostgresServer::shared()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_on_postgres_serves_agents_and_operators_and_restores_its_counts() {
    let Some(server) = server() else { return };
    let url = server.database("serves");
    let dir = tempfile::tempdir().unwrap();
    let broker = start_with(on_postgres(dir.path(), &url)).await;
    let created = broker
        .submit(AGENT_SECRET, &request("pg-1", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202, "{:?}", created.body);
    let id = created.body["id"].as_str().unwrap().to_owned();
    // A replay is the same operation, from the database.
    let replay = broker
        .submit(AGENT_SECRET, &request("pg-1", "demo.request", 0))
        .await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(replay.body["id"], created.body["id"]);
    // The operator's inbox shows it, and a decision on it commits.
    assert_eq!(broker.operator.pending().await, vec![id.clone()]);
    let approved = broker.operator.approve(&id).await;
    assert_eq!(approved.status, 200, "{:?}", approved.body);
    // It runs and ends.
    support::eventually::assert_eventually("the approved request ran", async || {
        let op = broker
            .get(
                &format!("/api/agent/v1/operations/{id}"),
                Some(AGENT_SECRET),
            )
            .await;
        op.body["state"] == "succeeded"
    })
    .await;
    // A second request stays pending over the restart and counts again after it.
    let pending = broker
        .submit(AGENT_SECRET, &request("pg-2", "demo.request", 0))
        .await;
    assert_eq!(pending.status, 202, "{:?}", pending.body);
    assert_eq!(broker.rows().await, 2);
    let events = broker.broker.database().count_events().await.unwrap();
    assert!(
        events >= 4,
        "created, approved, started, succeeded, created: {events}"
    );
    broker.broker.shutdown().await;

    let again = start_with(on_postgres(dir.path(), &url)).await;
    assert_eq!(again.restored.pending, 1, "{:?}", again.restored);
    assert_eq!(again.snapshot().pending, 1);
    let drift = again.broker.check_drift().await.unwrap();
    assert_eq!(drift.total(), 0, "{drift:?}");
    again.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_one_postgres_store_is_refused_saying_why() {
    let Some(server) = server() else { return };
    let url = server.database("one_replica");
    let (first_dir, second_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = start_with(on_postgres(first_dir.path(), &url)).await;
    let Err(refused) = Broker::start(on_postgres(second_dir.path(), &url)).await else {
        panic!("a second broker on the store is refused");
    };
    let message = refused.to_string();
    assert!(message.contains("another replica"), "{message}");
    assert!(message.contains("--redis"), "{message}");
    assert!(
        !message.contains("admission@"),
        "no URL, let alone a password: {message}"
    );
    // Nothing was written by the refused one.
    assert_eq!(first.rows().await, 0);
    // The same data dir is the same member: a restart on it is served at once.
    first.broker.shutdown().await;
    let second = start_with(on_postgres(second_dir.path(), &url)).await;
    second.broker.shutdown().await;
    let first_again = start_with(on_postgres(first_dir.path(), &url)).await;
    first_again.broker.shutdown().await;
}

/// `serve --store` killed with `kill -9` keeps neither its data dir's lock nor a membership that
/// could refuse its own restart: started again at once on its data dir, it is the same member
/// and serves; its pending request counts again. A broker on another data dir is refused while
/// the first one runs, and two brokers on one data dir never both run, whatever the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_killed_and_restarted_at_once_on_its_data_dir_is_the_same_member() {
    use support::serve::{Files, Server};
    let Some(server) = server() else { return };
    let url = server.database("same_member");
    let tmp = tempfile::tempdir().unwrap();
    let files = Files::write(tmp.path(), ROOMY);
    let mut args: Vec<String> = files.args();
    args.extend(["--store".into(), url.clone()]);
    let first = Server::spawn(None, &args);
    let created = first
        .submit(AGENT_SECRET, &request("before-kill", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202, "{:?}", created.body);
    // Another broker on the same data dir is refused by the dir's lock, on any store.
    let same_dir = support::serve::run_to_end(&args);
    assert_ne!(same_dir.code, Some(0), "a second broker on one data dir");
    assert!(
        same_dir.stderr.contains("in use by another broker"),
        "{}",
        same_dir.stderr
    );
    drop(first); // SIGKILL: no shutdown, no membership given up.
    let again = Server::spawn(None, &args);
    let replay = again
        .submit(AGENT_SECRET, &request("before-kill", "demo.request", 0))
        .await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(
        again
            .metric("admission_operations{state=\"pending\"}")
            .await,
        Some(1)
    );
    // A broker on another data dir is another member: refused while this one runs.
    let other = tempfile::tempdir().unwrap();
    let other_files = Files::write(other.path(), ROOMY);
    let mut other_args: Vec<String> = other_files.args();
    other_args.extend(["--store".into(), url]);
    let refused = support::serve::run_to_end(&other_args);
    assert_ne!(refused.code, Some(0), "another member is refused");
    assert!(
        refused.stderr.contains("another replica"),
        "{}",
        refused.stderr
    );
    drop(again);
}

#[test]
fn serve_with_an_unreachable_store_fails_naming_it_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let port = support::redis::free_port();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_admission"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--operator-listen",
            "127.0.0.1:0",
        ])
        .arg("--data")
        .arg(dir.path())
        .arg("--store")
        .arg(format!(
            "postgres://admission:hunter2@127.0.0.1:{port}/fleet"
        ))
        .output()
        .expect("admission runs");
    assert!(!out.status.success(), "an unreachable store stops serve");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !printed.contains("hunter2"),
        "the password is printed: {printed}"
    );
    assert!(printed.contains("error:"), "{printed}");
    assert!(printed.contains(&format!("127.0.0.1:{port}")), "{printed}");
}

#[test]
fn serve_refuses_a_store_that_is_not_a_postgres_url() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_admission"))
        .args(["serve", "--store", "mysql://root:hunter2@db/x"])
        .output()
        .expect("admission runs");
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("expected a PostgreSQL URL"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_postgres_is_down_submissions_are_503_with_retry_after_and_nothing_counts_twice_after()
 {
    // A server of its own: this test stops it.
    let Some(mut server) = PostgresServer::start() else {
        return;
    };
    let url = server.database("faults");
    let dir = tempfile::tempdir().unwrap();
    let broker = start_with(on_postgres(dir.path(), &url)).await;
    let before = broker
        .submit(AGENT_SECRET, &request("before", "demo.request", 0))
        .await;
    assert_eq!(before.status, 202, "{:?}", before.body);

    server.kill();
    let refused = broker
        .submit(AGENT_SECRET, &request("while-down", "demo.request", 0))
        .await;
    assert_eq!(refused.status, 503, "{:?}", refused.body);
    assert_eq!(refused.code(), "store_unavailable");
    assert!(refused.retry_after().is_some(), "a 503 says when to retry");
    let ready = broker.get("/readyz", None).await;
    assert_eq!(ready.status, 503, "{:?}", ready.body);
    // Liveness does not depend on the store.
    assert_eq!(broker.get("/healthz", None).await.status, 200);
    // Nothing was counted for the refused submission.
    assert_eq!(broker.snapshot().pending, 1);
    // An upload cannot take its room in the store: 503 before a byte is read, no room held.
    let upload_64_bytes = async || {
        let body = Some(vec![1u8; 64].into());
        broker
            .send("POST", "/api/agent/v1/streams", Some(AGENT_SECRET), body)
            .await
    };
    let upload = upload_64_bytes().await;
    assert_eq!(
        (upload.status, upload.code()),
        (503, "store_unavailable"),
        "{:?}",
        upload.body
    );
    assert!(upload.retry_after().is_some(), "a 503 says when to retry");
    let streams = broker.snapshot().storage[0];
    assert_eq!((streams.files, streams.bytes), (0, 0));

    server.restart();
    support::eventually::assert_eventually("ready again", async || {
        broker.get("/readyz", None).await.status == 200
    })
    .await;
    // The refused key is new work now, created once; the earlier one replays.
    let retried = broker
        .submit(AGENT_SECRET, &request("while-down", "demo.request", 0))
        .await;
    assert_eq!(retried.status, 202, "{:?}", retried.body);
    let replay = broker
        .submit(AGENT_SECRET, &request("before", "demo.request", 0))
        .await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(broker.rows().await, 2);
    assert_eq!(broker.snapshot().pending, 2);
    let uploaded = upload_64_bytes().await;
    assert_eq!(uploaded.status, 201, "{:?}", uploaded.body);
    assert_eq!(
        server.psql("faults", "SELECT count(*) FROM stream_uploads"),
        "0",
        "the upload's room is its stream's"
    );
    let drift = broker.broker.check_drift().await.unwrap();
    assert_eq!(drift.total(), 0, "counts equal rows: {drift:?}");
    broker.broker.shutdown().await;
}
