//! Faults (SPEC section 6): clients that send a whole request and hang up at once, a store that
//! another process holds locked, and a `kill -9` in the middle of it all. Each test ends with the
//! controller's counts equal to the store (drift 0) and the operator able to decide everything in
//! the inbox. Drift readings taken *during* the bursts must be 0 too: a reading never catches a
//! change half made.
#![cfg(feature = "broker")]

mod broker_support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use broker_support::*;
use serde_json::{Value, json};
use unyolo_admission::StorageCaps;
use unyolo_admission::broker::{Broker, DriftReport};

/// Tight enough that the bursts hit the limits: 10 pending per client, 2 executing at once.
const LIMITS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 2}"#;

const OPERATIONS: &str = "/api/agent/v1/operations";
const STREAMS: &str = "/api/agent/v1/streams";
const INBOX: &str = "/api/operator/v1/requests";

async fn start(dir: &Path) -> Harness {
    start_with(settings(dir, LIMITS, StorageCaps::default())).await
}

/// What the SQLite file holds, read through a connection of our own.
struct Stored {
    /// Operation rows by state.
    states: BTreeMap<String, u64>,
    /// The agent's idempotency keys.
    keys: Vec<String>,
    /// Stream rows.
    streams: u64,
}

fn stored(data: &Path) -> Stored {
    let conn = rusqlite::Connection::open(data.join("admission.sqlite3")).unwrap();
    conn.busy_timeout(Duration::from_secs(30)).unwrap();
    let mut states = BTreeMap::new();
    let mut stmt = conn
        .prepare("SELECT state, COUNT(*) FROM operations GROUP BY state")
        .unwrap();
    for row in stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .unwrap()
    {
        let (state, n) = row.unwrap();
        states.insert(state, n as u64);
    }
    let keys = conn
        .prepare("SELECT idempotency_key FROM operations WHERE client_id = 'agent'")
        .unwrap()
        .query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let streams: i64 = conn
        .query_row("SELECT COUNT(*) FROM streams", [], |r| r.get(0))
        .unwrap();
    Stored {
        states,
        keys,
        streams: streams as u64,
    }
}

/// Stream bodies on disk.
fn files_on_disk(data: &Path) -> u64 {
    std::fs::read_dir(data.join("streams")).map_or(0, |entries| entries.count() as u64)
}

/// Holds SQLite's write lock from another connection (`BEGIN IMMEDIATE`) for `hold`; returns
/// once the lock is taken, and a handle that ends when it is let go.
fn lock_store(data: &Path, hold: Duration) -> std::thread::JoinHandle<()> {
    let path = data.join("admission.sqlite3");
    let (taken, is_taken) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.busy_timeout(Duration::from_secs(30)).unwrap();
        conn.execute_batch("BEGIN IMMEDIATE").unwrap();
        taken.send(()).unwrap();
        std::thread::sleep(hold);
        conn.execute_batch("COMMIT").unwrap();
    });
    is_taken.recv().unwrap();
    holder
}

/// Takes drift readings until `stop` is set and returns every one that was not clean.
async fn watch_drift(broker: &Broker, stop: Arc<AtomicBool>) -> Vec<DriftReport> {
    let mut dirty = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let report = broker.check_drift().await.unwrap();
        if !report.is_clean() {
            dirty.push(report);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    dirty
}

/// Sends the hang-ups while drift is read continuously; asserts every reading was clean.
async fn burst_watching_drift(h: &Harness, requests: Vec<HangUp>) {
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_drift(&h.broker, Arc::clone(&stop));
    let sender = async {
        hang_up_all(h.broker.local_addr(), requests).await;
        stop.store(true, Ordering::Relaxed);
    };
    let (dirty, ()) = tokio::join!(watcher, sender);
    assert!(dirty.is_empty(), "drift seen during the burst: {dirty:?}");
}

/// What the broker holds that a late request could still change.
async fn observed(h: &Harness, data: &Path) -> (BTreeMap<String, u64>, u64, u64, String) {
    let s = stored(data);
    let snap = h.snapshot();
    (
        s.states,
        s.streams,
        files_on_disk(data),
        format!(
            "{} {} {} {} {:?}",
            snap.active, snap.pending, snap.queued, snap.executing, snap.storage
        ),
    )
}

/// Waits until the broker has handled every request sent (nothing changes across two readings).
async fn quiet(h: &Harness, data: &Path) {
    let mut last = observed(h, data).await;
    let settled = eventually(async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = observed(h, data).await;
        let same = now == last;
        last = now;
        same
    })
    .await;
    assert!(settled, "the broker never settled: {last:?}");
}

/// The promise: drift 0 by the on-demand reading, on the operator route and in the gauge; the
/// stream files on disk are the stream rows; the inbox is what the controller counts pending.
async fn assert_counts_match_the_store(h: &Harness, data: &Path) {
    let report = h.broker.check_drift().await.unwrap();
    assert!(report.is_clean(), "drift: {report:?}");
    let route = h.get("/api/operator/v1/drift", Some(OPERATOR_SECRET)).await;
    assert_eq!(route.status, 200);
    assert_eq!(route.body["drift"], 0, "{}", route.body);
    assert_eq!(metric(&h.metrics().await, "admission_store_drift"), Some(0));
    let s = stored(data);
    assert_eq!(
        files_on_disk(data),
        s.streams,
        "stream files on disk vs rows"
    );
    // Two reads, so a request still arriving may move one between them: poll until they agree.
    let agree = eventually(async || {
        let inbox = h.get(INBOX, Some(OPERATOR_SECRET)).await;
        inbox.body["requests"].as_array().unwrap().len() as u64 == h.snapshot().pending
    })
    .await;
    assert!(
        agree,
        "the inbox never matched the controller's pending count"
    );
}

/// The operator decides every request in the inbox, approving or denying in turn, until it is
/// empty. Each decision is 200, unless a late request of the burst decided it first (409, and the
/// operation is then no longer pending). Returns how many this call decided.
async fn decide_the_inbox(h: &Harness) -> usize {
    let mut decided = 0;
    let emptied = eventually(async || {
        let inbox = h.get(INBOX, Some(OPERATOR_SECRET)).await;
        let ids: Vec<String> = inbox.body["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|op| op["id"].as_str().unwrap().to_owned())
            .collect();
        if ids.is_empty() {
            return true;
        }
        for id in &ids {
            let decision = if decided % 2 == 0 { "approve" } else { "deny" };
            let reply = h
                .post(&format!("{INBOX}/{id}/{decision}"), Some(OPERATOR_SECRET))
                .await;
            if reply.status == 200 {
                decided += 1;
                continue;
            }
            assert_eq!(reply.status, 409, "{decision} {id}: {}", reply.body);
            let op = h
                .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
                .await;
            assert_ne!(
                op.state(),
                "pending",
                "{decision} {id} refused while it is pending: {}",
                reply.body
            );
        }
        false
    })
    .await;
    assert!(emptied, "the inbox never emptied");
    decided
}

/// Every stored operation of the agent is replayed (200) by its own request, whatever the limits.
async fn assert_every_key_replays(h: &Harness, data: &Path, bodies: &BTreeMap<String, Value>) {
    for key in stored(data).keys {
        let Some(body) = bodies.get(&key) else {
            continue;
        };
        let reply = h.submit(AGENT_SECRET, body).await;
        assert_eq!(reply.status, 200, "replay of {key}: {}", reply.body);
    }
}

/// The ending every test shares: quiet, counts equal the store, the inbox decidable, and once
/// the approved work has run, the counts still equal the store.
async fn ends_whole(h: &Harness, data: &Path) {
    quiet(h, data).await;
    assert_counts_match_the_store(h, data).await;
    decide_the_inbox(h).await;
    let drained = eventually(async || {
        let s = h.snapshot();
        s.pending == 0 && s.queued == 0
    })
    .await;
    assert!(drained, "approved work never ran: {:?}", h.snapshot());
    quiet(h, data).await;
    assert_counts_match_the_store(h, data).await;
}

async fn create_pending(h: &Harness, prefix: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let reply = h
            .submit(
                AGENT_SECRET,
                &request(&format!("{prefix}-{i}"), "demo.request", 0),
            )
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        ids.push(reply.id());
    }
    ids
}

async fn upload(h: &Harness, size: usize) -> String {
    let reply = h
        .send(
            "POST",
            STREAMS,
            Some(AGENT_SECRET),
            Some(vec![7u8; size].into()),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    reply.id()
}

fn submissions(prefix: &str, n: usize, bodies: &mut BTreeMap<String, Value>) -> Vec<HangUp> {
    (0..n)
        .map(|i| {
            let operation = if i % 4 == 3 {
                "demo.run"
            } else {
                "demo.request"
            };
            let key = format!("{prefix}-{i}");
            let body = request(&key, operation, 0);
            bodies.insert(key, body.clone());
            HangUp::submit(AGENT_SECRET, &body)
        })
        .collect()
}

fn decisions(ids: &[String]) -> Vec<HangUp> {
    ids.iter()
        .enumerate()
        .map(|(i, id)| {
            let decision = if i % 2 == 0 { "approve" } else { "deny" };
            HangUp::new(
                "POST",
                format!("{INBOX}/{id}/{decision}"),
                OPERATOR_SECRET,
                Vec::new(),
            )
        })
        .collect()
}

fn cancels(ids: &[String]) -> Vec<HangUp> {
    ids.iter()
        .map(|id| {
            HangUp::new(
                "POST",
                format!("{OPERATIONS}/{id}/cancel"),
                AGENT_SECRET,
                Vec::new(),
            )
        })
        .collect()
}

/// Uploads of `size` bytes; every other one declares more than it sends (cut short).
fn uploads(n: usize, size: usize) -> Vec<HangUp> {
    (0..n)
        .map(|i| HangUp {
            declared: (i % 2 == 1).then_some(size * 4),
            ..HangUp::new("POST", STREAMS, AGENT_SECRET, vec![1u8; size])
        })
        .collect()
}

fn deletes(ids: &[String]) -> Vec<HangUp> {
    ids.iter()
        .map(|id| {
            HangUp::new(
                "DELETE",
                format!("{STREAMS}/{id}"),
                AGENT_SECRET,
                Vec::new(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_whose_clients_hang_up_are_counted_exactly_as_stored_and_all_decidable() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let mut bodies = BTreeMap::new();
    burst_watching_drift(&h, submissions("gone", 40, &mut bodies)).await;
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_every_key_replays(&h, dir.path(), &bodies).await;
    ends_whole(&h, dir.path()).await;
    // Capacity that the hung-up submissions held is free again: a new request is admitted.
    let fresh = h
        .submit(AGENT_SECRET, &request("after", "demo.request", 0))
        .await;
    assert_eq!(fresh.status, 202, "{}", fresh.body);
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_and_denials_whose_operator_hangs_up_are_made_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let ids = create_pending(&h, "decide", 10).await;
    burst_watching_drift(&h, decisions(&ids)).await;
    quiet(&h, dir.path()).await;
    for id in &ids {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert!(
            ["pending", "approved", "executing", "succeeded", "denied"].contains(&op.state()),
            "{}",
            op.body
        );
    }
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_whose_client_hangs_up_release_exactly_what_the_store_released() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let ids = create_pending(&h, "cancel", 8).await;
    // Two long runs fill the execution pool, so approved work stays queued.
    let mut long = Vec::new();
    for i in 0..2 {
        let reply = h
            .submit(
                AGENT_SECRET,
                &request(&format!("long-{i}"), "demo.run", 600_000),
            )
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        long.push(reply.id());
    }
    assert!(eventually(async || h.snapshot().executing == 2).await);
    for id in &ids[..4] {
        let approved = h
            .post(&format!("{INBOX}/{id}/approve"), Some(OPERATOR_SECRET))
            .await;
        assert_eq!(approved.status, 200);
    }
    assert_eq!(h.snapshot().queued, 4);
    let mut targets = ids.clone();
    targets.extend(long.iter().cloned());
    burst_watching_drift(&h, cancels(&targets)).await;
    quiet(&h, dir.path()).await;
    for id in &long {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert_eq!(
            op.state(),
            "executing",
            "an executing run is not cancelable"
        );
    }
    for id in &ids {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert!(
            ["pending", "approved", "canceled"].contains(&op.state()),
            "{}",
            op.body
        );
    }
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    decide_the_inbox(&h).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_whose_client_hangs_up_leave_no_file_without_a_row_and_no_room_held() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    // 40 uploads against a per-client cap of 16 files; half are cut short.
    burst_watching_drift(&h, uploads(40, 1024)).await;
    ends_whole(&h, dir.path()).await;
    let stream_files = h.snapshot().storage[0].files;
    assert_eq!(stream_files, stored(dir.path()).streams);
    assert!(stream_files <= 16);
    // Everything stored can be deleted, and the room comes back to zero.
    let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
    let ids: Vec<String> = conn
        .prepare("SELECT id FROM streams")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for id in ids {
        let reply = h
            .send(
                "DELETE",
                &format!("{STREAMS}/{id}"),
                Some(AGENT_SECRET),
                None,
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert!(h.snapshot().is_idle(), "{:?}", h.snapshot());
    assert_eq!(files_on_disk(dir.path()), 0);
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_whose_client_hangs_up_remove_row_file_and_room_together() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let mut ids = Vec::new();
    for _ in 0..12 {
        ids.push(upload(&h, 2048).await);
    }
    // Each delete twice: the second races the first.
    let mut requests = deletes(&ids);
    requests.extend(deletes(&ids));
    burst_watching_drift(&h, requests).await;
    ends_whole(&h, dir.path()).await;
    for id in &ids {
        let reply = h
            .send(
                "DELETE",
                &format!("{STREAMS}/{id}"),
                Some(AGENT_SECRET),
                None,
            )
            .await;
        assert!(
            reply.status == 200 || reply.code() == "stream_not_found",
            "{}",
            reply.body
        );
    }
    assert!(h.snapshot().is_idle(), "{:?}", h.snapshot());
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// Every kind of hang-up at once: submissions, approvals and denials, cancels, uploads (whole and
/// cut short) and deletes, against the state `prepare` made.
async fn prepare(h: &Harness, prefix: &str) -> (Vec<String>, Vec<String>, Vec<String>) {
    let to_decide = create_pending(h, &format!("{prefix}-decide"), 4).await;
    let to_cancel = create_pending(h, &format!("{prefix}-cancel"), 4).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(upload(h, 512).await);
    }
    (to_decide, to_cancel, streams)
}

fn everything(
    prefix: &str,
    (to_decide, to_cancel, streams): &(Vec<String>, Vec<String>, Vec<String>),
    bodies: &mut BTreeMap<String, Value>,
) -> Vec<HangUp> {
    let mut requests = submissions(prefix, 12, bodies);
    requests.extend(decisions(to_decide));
    requests.extend(cancels(to_cancel));
    requests.extend(uploads(8, 256));
    requests.extend(deletes(streams));
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_ups_while_another_process_holds_the_store_locked_change_nothing_half_way() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let prepared = prepare(&h, "locked").await;
    let mut bodies = BTreeMap::new();
    let requests = everything("locked", &prepared, &mut bodies);
    let holder = lock_store(dir.path(), Duration::from_secs(1));
    burst_watching_drift(&h, requests).await;
    holder.join().unwrap();
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_every_key_replays(&h, dir.path(), &bodies).await;
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_admitted_before_their_clients_hang_up_are_created_once_the_store_frees() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let bodies: Vec<Value> = (0..4)
        .map(|i| request(&format!("admitted-{i}"), "demo.request", 0))
        .collect();
    let path = dir.path().join("admission.sqlite3");
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.execute_batch("BEGIN IMMEDIATE").unwrap();
        locked.send(()).unwrap();
        released.recv().unwrap();
        conn.execute_batch("COMMIT").unwrap();
    });
    is_locked.recv().unwrap();
    // Each request is sent whole on a connection kept open until the controller has admitted it:
    // its creation is then waiting on the locked store.
    let mut open = Vec::new();
    for body in &bodies {
        use tokio::io::AsyncWriteExt;
        let text = body.to_string();
        let mut stream = tokio::net::TcpStream::connect(h.broker.local_addr())
            .await
            .unwrap();
        let head = format!(
            "POST {OPERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_SECRET}\r\n\
             Content-Length: {}\r\n\r\n{text}",
            text.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        open.push(stream);
    }
    assert!(eventually(async || h.snapshot().pending == 4).await);
    drop(open);
    release.send(()).unwrap();
    holder.join().unwrap();
    for body in &bodies {
        let reply = h.submit(AGENT_SECRET, body).await;
        assert_eq!(
            reply.status, 200,
            "created by the hung-up request: {}",
            reply.body
        );
    }
    assert_eq!(stored(dir.path()).states.get("pending"), Some(&4));
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_eq!(decide_the_inbox(&h).await, 4);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// A running `admission serve`; killed (SIGKILL) when dropped.
struct Server {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn spawn(dir: &Path) -> Server {
        let secrets = dir.join("secrets");
        std::fs::write(
            &secrets,
            format!("{AGENT} = {AGENT_SECRET}\n{OTHER} = {OTHER_SECRET}\n"),
        )
        .unwrap();
        let operator = dir.join("operator");
        std::fs::write(&operator, format!("{OPERATOR_SECRET}\n")).unwrap();
        let config = dir.join("admission.json");
        std::fs::write(&config, LIMITS).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_admission"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--data"])
            .arg(data_dir(dir))
            .arg("--secrets")
            .arg(&secrets)
            .arg("--operator-secret")
            .arg(&operator)
            .arg("--admission-config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let addr = loop {
            let mut line = String::new();
            if stdout.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("serve exited before listening: {err}");
            }
            if let Some(addr) = line.trim().strip_prefix("listening on ") {
                break addr.parse().unwrap();
            }
        };
        // Drain stderr so logging never blocks the server.
        let mut stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Server { child, addr }
    }

    fn kill_9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn data_dir(dir: &Path) -> PathBuf {
    dir.join("data")
}

/// A harness-like client for the real binary: reuses the in-process helpers' HTTP code.
fn client_for(addr: std::net::SocketAddr) -> (reqwest::Client, String) {
    (reqwest::Client::new(), format!("http://{addr}"))
}

async fn call(
    (http, base): &(reqwest::Client, String),
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = http
        .request(method, format!("{base}{path}"))
        .bearer_auth(token);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let response = req.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn drift_of(c: &(reqwest::Client, String)) -> Value {
    let (status, body) = call(
        c,
        reqwest::Method::GET,
        "/api/operator/v1/drift",
        OPERATOR_SECRET,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_in_the_middle_of_a_hang_up_burst_restarts_with_counts_equal_to_the_store() {
    use reqwest::Method;
    let dir = tempfile::tempdir().unwrap();
    let data = data_dir(dir.path());
    let server = Server::spawn(dir.path());
    let c = client_for(server.addr);
    let mut to_decide = Vec::new();
    for i in 0..6 {
        let (status, op) = call(
            &c,
            Method::POST,
            OPERATIONS,
            AGENT_SECRET,
            Some(request(&format!("before-{i}"), "demo.request", 0)),
        )
        .await;
        assert_eq!(status, 202, "{op}");
        to_decide.push(op["id"].as_str().unwrap().to_owned());
    }
    let mut streams = Vec::new();
    for _ in 0..4 {
        let response =
            c.0.post(format!("{}{STREAMS}", c.1))
                .bearer_auth(AGENT_SECRET)
                .body(vec![3u8; 512])
                .send()
                .await
                .unwrap();
        assert_eq!(response.status().as_u16(), 201);
        let body: Value = response.json().await.unwrap();
        streams.push(body["id"].as_str().unwrap().to_owned());
    }
    let mut bodies = BTreeMap::new();
    let requests = everything(
        "crash",
        &(to_decide[..3].to_vec(), to_decide[3..].to_vec(), streams),
        &mut bodies,
    );
    // The kill lands once the first half of the burst has been sent, the rest meets a dead port.
    let addr = server.addr;
    let (first, second) = requests.split_at(requests.len() / 2);
    let (first, second) = (first.to_vec(), second.to_vec());
    let late = tokio::spawn(async move {
        hang_up_all(addr, second).await;
    });
    hang_up_all(addr, first).await;
    server.kill_9();
    late.await.unwrap();

    let files_before_restart = files_on_disk(&data);
    let server = Server::spawn(dir.path());
    let c = client_for(server.addr);
    let report = drift_of(&c).await;
    assert_eq!(report["drift"], 0, "{report}");
    let (_, metrics) = call(&c, Method::GET, "/metrics", OPERATOR_SECRET, None).await;
    assert_eq!(
        metric(metrics.as_str().unwrap(), "admission_store_drift"),
        Some(0)
    );
    assert_eq!(files_on_disk(&data), stored(&data).streams);
    assert!(files_on_disk(&data) <= files_before_restart);
    // Every stored operation replays; every request in the inbox is decidable.
    for key in stored(&data).keys {
        if let Some(body) = bodies.get(&key) {
            let (status, op) = call(
                &c,
                Method::POST,
                OPERATIONS,
                AGENT_SECRET,
                Some(body.clone()),
            )
            .await;
            assert_eq!(status, 200, "replay of {key}: {op}");
        }
    }
    let (_, inbox) = call(&c, Method::GET, INBOX, OPERATOR_SECRET, None).await;
    let ids: Vec<String> = inbox["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| op["id"].as_str().unwrap().to_owned())
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let decision = if i % 2 == 0 { "approve" } else { "deny" };
        let (status, body) = call(
            &c,
            Method::POST,
            &format!("{INBOX}/{id}/{decision}"),
            OPERATOR_SECRET,
            None,
        )
        .await;
        assert_eq!(status, 200, "{decision} {id}: {body}");
    }
    let drained = eventually(async || {
        let s = stored(&data);
        s.states.get("pending").copied().unwrap_or(0) == 0
            && s.states.get("approved").copied().unwrap_or(0) == 0
            && s.states.get("executing").copied().unwrap_or(0) == 0
    })
    .await;
    assert!(drained, "{:?}", stored(&data).states);
    let report = drift_of(&c).await;
    assert_eq!(report["drift"], 0, "{report}");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_behind_the_brokers_back_is_reported_as_drift_on_the_timer_and_on_demand() {
    use unyolo_admission::broker::{Difference, DriftCount};
    let dir = tempfile::tempdir().unwrap();
    let mut settings = settings(dir.path(), LIMITS, StorageCaps::default());
    settings.drift_interval = Duration::from_millis(50);
    let h = start_with(settings).await;
    assert!(h.broker.check_drift().await.unwrap().is_clean());
    let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
    conn.busy_timeout(Duration::from_secs(30)).unwrap();
    conn.execute(
        "INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, \
         reason, state, created_at, updated_at) VALUES ('op_behind', 'agent', 'behind', \
         'demo.request', '{}', '{}', 'written by hand', 'pending', '2026-01-01T00:00:00Z', \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO streams (id, client_id, size, created_at) VALUES ('st_behind', 'other', 100, \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    // Pending and active, for the client and globally: 4; files 1 and bytes 100, for the client
    // and globally: 202.
    let seen =
        eventually(async || metric(&h.metrics().await, "admission_store_drift") == Some(4 + 202))
            .await;
    assert!(seen, "{}", h.metrics().await);
    let report = h.broker.check_drift().await.unwrap();
    assert_eq!(report.total(), 206);
    assert!(report.differences.contains(&Difference {
        client: Some(AGENT.to_owned()),
        count: DriftCount::Pending,
        controller: 0,
        store: 1,
    }));
    let route = h.get("/api/operator/v1/drift", Some(OPERATOR_SECRET)).await;
    assert_eq!(route.body["drift"], 206);
    assert!(
        route.body["differences"].as_array().unwrap().contains(
            &json!({"client": OTHER, "count": "stream_bytes", "controller": 0, "store": 100})
        ),
        "{}",
        route.body
    );
    let agent_only = h.get("/api/operator/v1/drift", Some(AGENT_SECRET)).await;
    assert_eq!(agent_only.status, 403, "the drift route is the operator's");
    conn.execute("DELETE FROM operations WHERE id = 'op_behind'", [])
        .unwrap();
    conn.execute("DELETE FROM streams WHERE id = 'st_behind'", [])
        .unwrap();
    let cleared =
        eventually(async || metric(&h.metrics().await, "admission_store_drift") == Some(0)).await;
    assert!(cleared, "{}", h.metrics().await);
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_start_up_cannot_restore_is_drift_from_the_first_reading() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    h.broker.shutdown().await;
    let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
    conn.execute(
        "INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, \
         reason, state, created_at, updated_at) VALUES ('op_orphan', 'not a valid id!', 'k', \
         'demo.request', '{}', '{}', 'written by hand', 'approved', '2026-01-01T00:00:00Z', \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    drop(conn);
    let mut settings = settings(dir.path(), LIMITS, StorageCaps::default());
    settings.drift_interval = Duration::from_secs(3600);
    let h = start_with(settings).await;
    // Queued and active, for that client and globally, from the start-up reading alone.
    assert_eq!(metric(&h.metrics().await, "admission_store_drift"), Some(4));
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_the_locked_store_cannot_record_waits_for_the_store_and_then_runs() {
    let dir = tempfile::tempdir().unwrap();
    let one_slot = LIMITS.replace(r#""global_executing": 2"#, r#""global_executing": 1"#);
    let h = start_with(settings(dir.path(), &one_slot, StorageCaps::default())).await;
    let queued = create_pending(&h, "start", 1).await.remove(0);
    let long = h
        .submit(AGENT_SECRET, &request("long", "demo.run", 600_000))
        .await;
    assert_eq!(long.status, 202, "{}", long.body);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    let approved = h
        .post(&format!("{INBOX}/{queued}/approve"), Some(OPERATOR_SECRET))
        .await;
    assert_eq!(approved.status, 200);
    assert_eq!(h.snapshot().queued, 1);
    // Longer than the broker's busy timeout (5 s), so its first attempt to record the start
    // fails; then a second slot opens and the executor tries at once.
    let holder = lock_store(dir.path(), Duration::from_secs(6));
    let config = dir.path().join("two-slots.json");
    std::fs::write(&config, LIMITS).unwrap();
    h.broker.reload_from_path(&config).unwrap();
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    let path = format!("{OPERATIONS}/{queued}");
    let ran = eventually(async || {
        let state = h.get(&path, Some(AGENT_SECRET)).await.state().to_owned();
        state == "succeeded" || state == "failed"
    })
    .await;
    assert!(ran);
    let op = h.get(&path, Some(AGENT_SECRET)).await;
    assert_eq!(op.state(), "succeeded", "{}", op.body);
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}
