//! The fault tests' own: bursts of clients that hang up, a store held locked by another
//! connection, and the promise every fault test ends with (the controller's counts equal the
//! store, the inbox is decidable).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use unyolo_admission::StorageCaps;
use unyolo_admission_broker::{Broker, DriftReport};

use super::broker::{Harness, settings, start_with};
use super::eventually::eventually;
use super::http::request;
use super::metrics::metric;
use super::secrets::{AGENT_SECRET, OPERATOR_SECRET};

/// One raw HTTP/1.1 request, written whole (or, with `declared` above the body's length, cut
/// short) by a client that then closes the connection without reading the answer.
#[derive(Clone, Debug)]
pub struct HangUp {
    pub method: &'static str,
    pub path: String,
    pub token: String,
    pub body: Vec<u8>,
    /// The `Content-Length` sent; `None` sends the body's length.
    pub declared: Option<usize>,
    /// Sent to the operator listener (else the agent listener).
    pub to_operator: bool,
}

/// Where a broker listens: its agent and operator listeners (TCP).
#[derive(Clone, Copy, Debug)]
pub struct Listeners {
    pub agent: std::net::SocketAddr,
    pub operator: std::net::SocketAddr,
}

impl Listeners {
    pub fn of(h: &Harness) -> Listeners {
        Listeners {
            agent: h.broker.local_addr(),
            operator: h.operator_addr(),
        }
    }

    pub fn of_server(server: &super::serve::Server) -> Listeners {
        Listeners {
            agent: server.addr,
            operator: server.operator_addr.parse().unwrap(),
        }
    }
}

impl HangUp {
    pub fn new(
        method: &'static str,
        path: impl Into<String>,
        token: &str,
        body: Vec<u8>,
    ) -> HangUp {
        HangUp {
            method,
            path: path.into(),
            token: token.to_owned(),
            body,
            declared: None,
            to_operator: false,
        }
    }

    /// An operator's decision on request `id` (at revision 1, as created) with a body.
    pub fn decision(id: &str, action: &str) -> HangUp {
        let body = json!({"expected_revision": 1, "idempotency_key": format!("hang-up-{id}")});
        HangUp {
            to_operator: true,
            ..HangUp::new(
                "POST",
                format!("{INBOX}/{id}/{action}"),
                OPERATOR_SECRET,
                body.to_string().into_bytes(),
            )
        }
    }

    pub fn submit(token: &str, body: &Value) -> HangUp {
        HangUp::new(
            "POST",
            "/api/agent/v1/operations",
            token,
            body.to_string().into_bytes(),
        )
    }

    /// Connects to `addr`, writes the request and closes at once. Returns whether it was sent (a
    /// broker that is gone refuses the connection).
    pub async fn send(&self, addr: std::net::SocketAddr) -> bool {
        use tokio::io::AsyncWriteExt;
        let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
            return false;
        };
        let head = format!(
            "{} {} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.method,
            self.path,
            self.token,
            self.declared.unwrap_or(self.body.len())
        );
        let sent = stream.write_all(head.as_bytes()).await.is_ok()
            && stream.write_all(&self.body).await.is_ok();
        drop(stream);
        sent
    }
}

/// Sends every request at once, each on its own connection (to the listener it is for) closed
/// right after writing.
pub async fn hang_up_all(to: Listeners, requests: Vec<HangUp>) {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|r| {
            let addr = if r.to_operator { to.operator } else { to.agent };
            tokio::spawn(async move { r.send(addr).await })
        })
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}

/// Tight enough that the bursts hit the limits: 10 pending per client, 2 executing at once.
pub const LIMITS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 2}"#;

pub const OPERATIONS: &str = "/api/agent/v1/operations";
pub const STREAMS: &str = "/api/agent/v1/streams";
pub const INBOX: &str = "/api/operator/v1/requests";

/// A broker with [`LIMITS`] in `dir`.
pub async fn start_tight(dir: &Path) -> Harness {
    start_with(settings(dir, LIMITS, StorageCaps::default())).await
}

/// What the store holds, read through a connection of our own (SQLite's file, or PostgreSQL).
pub struct Stored {
    /// Operation rows by state.
    pub states: BTreeMap<String, u64>,
    /// The agent's idempotency keys.
    pub keys: Vec<String>,
    /// Stream rows.
    pub streams: u64,
}

pub fn stored(data: &Path) -> Stored {
    if super::broker::on_postgres() {
        return stored_in_postgres(data);
    }
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

/// [`stored`] when the broker's operations are in PostgreSQL: the same three readings, through
/// `psql` in the database of its data dir.
fn stored_in_postgres(data: &Path) -> Stored {
    let psql = |sql: &str| super::broker::psql_for(data, sql);
    let states = psql("SELECT state, count(*) FROM operations GROUP BY state")
        .lines()
        .filter_map(|line| line.split_once('|'))
        .map(|(state, n)| (state.to_owned(), n.parse::<u64>().expect("a count")))
        .collect();
    let keys = psql("SELECT idempotency_key FROM operations WHERE client_id = 'agent'")
        .lines()
        .map(str::to_owned)
        .collect();
    let streams = psql("SELECT count(*) FROM streams")
        .parse()
        .expect("a count");
    Stored {
        states,
        keys,
        streams,
    }
}

/// Stream bodies on disk.
pub fn files_on_disk(data: &Path) -> u64 {
    std::fs::read_dir(data.join("streams")).map_or(0, |entries| entries.count() as u64)
}

/// Holds the store's write lock from another connection ([`StoreLock::take`]) for `hold`;
/// returns once the lock is taken, and a handle that ends when it is let go.
pub fn lock_store(data: &Path, hold: Duration) -> std::thread::JoinHandle<()> {
    let lock = StoreLock::take(data);
    std::thread::spawn(move || {
        std::thread::sleep(hold);
        lock.release();
    })
}

/// The store's write lock held from another connection (SQLite: `BEGIN IMMEDIATE`) until
/// [`StoreLock::release`] (or drop).
pub struct StoreLock {
    release: Option<std::sync::mpsc::Sender<()>>,
    holder: Option<std::thread::JoinHandle<()>>,
}

impl StoreLock {
    /// Takes the write lock of the broker's store in `data`; returns once it is held. On
    /// PostgreSQL (`ADMISSION_TEST_STORE=postgres`): its tables locked `EXCLUSIVE` from another
    /// connection (writes wait, plain reads go on, as under SQLite's write lock).
    pub fn take(data: &Path) -> StoreLock {
        if super::broker::on_postgres() {
            return StoreLock::take_postgres(&super::broker::postgres_url_for(data));
        }
        StoreLock::take_file(&data.join("admission.sqlite3"))
    }

    /// Locks the broker's tables in the PostgreSQL database at `url` in one transaction.
    pub fn take_postgres(url: &str) -> StoreLock {
        let url = url.to_owned();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(connection);
                let tx = client.transaction().await.unwrap();
                tx.batch_execute(
                    "LOCK TABLE operations, streams, stream_uploads, operator_events, operator_decisions \
                     IN EXCLUSIVE MODE",
                )
                .await
                .unwrap();
                locked.send(()).unwrap();
                let _ = tokio::task::spawn_blocking(move || released.recv()).await;
                tx.commit().await.unwrap();
            });
        });
        is_locked.recv().unwrap();
        StoreLock {
            release: Some(release),
            holder: Some(holder),
        }
    }

    /// Takes the write lock of the SQLite file at `path`; returns once it is held.
    pub fn take_file(path: &Path) -> StoreLock {
        let path = path.to_owned();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let conn = rusqlite::Connection::open(path).unwrap();
            conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            locked.send(()).unwrap();
            let _ = released.recv();
            conn.execute_batch("COMMIT").unwrap();
        });
        is_locked.recv().unwrap();
        StoreLock {
            release: Some(release),
            holder: Some(holder),
        }
    }

    /// Lets the lock go and waits until it is.
    pub fn release(mut self) {
        self.let_go();
    }

    fn let_go(&mut self) {
        drop(self.release.take());
        if let Some(holder) = self.holder.take() {
            holder.join().unwrap();
        }
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        self.let_go();
    }
}

/// Takes drift readings until `stop` is set and returns every one that was not clean.
pub async fn watch_drift(broker: &Broker, stop: Arc<AtomicBool>) -> Vec<DriftReport> {
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
pub async fn burst_watching_drift(h: &Harness, requests: Vec<HangUp>) {
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_drift(&h.broker, Arc::clone(&stop));
    let sender = async {
        hang_up_all(Listeners::of(h), requests).await;
        stop.store(true, Ordering::Relaxed);
    };
    let (dirty, ()) = tokio::join!(watcher, sender);
    assert!(dirty.is_empty(), "drift seen during the burst: {dirty:?}");
}

/// What the broker holds that a late request could still change.
pub async fn observed(h: &Harness, data: &Path) -> (BTreeMap<String, u64>, u64, u64, String) {
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
pub async fn quiet(h: &Harness, data: &Path) {
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
pub async fn assert_counts_match_the_store(h: &Harness, data: &Path) {
    let report = h.broker.check_drift().await.unwrap();
    assert!(report.is_clean(), "drift: {report:?}");
    let route = h.operator.drift().await;
    assert_eq!(route["drift"], 0, "{route}");
    let metrics = h.metrics().await;
    assert_eq!(metric(&metrics, "admission_store_drift"), Some(0));
    // No permit or live handle was lost on the way (non-zero would be a broker bug).
    assert_eq!(metric(&metrics, "admission_dropped_permits_total"), Some(0));
    assert_eq!(
        metric(&metrics, "admission_dropped_operations_total"),
        Some(0)
    );
    let s = stored(data);
    if super::broker::on_postgres() {
        // The bodies are in the rows, and nothing is left staged on the disk.
        assert_eq!(files_on_disk(data), 0, "stream files left staged on disk");
        let with_bodies: u64 =
            super::broker::psql_for(data, "SELECT count(*) FROM streams WHERE body IS NOT NULL")
                .parse()
                .unwrap();
        assert_eq!(with_bodies, s.streams, "stream bodies vs rows");
    } else {
        assert_eq!(
            files_on_disk(data),
            s.streams,
            "stream files on disk vs rows"
        );
    }
    // Two reads, so a request still arriving may move one between them: poll until they agree.
    let agree =
        eventually(async || h.operator.pending().await.len() as u64 == h.snapshot().pending).await;
    assert!(
        agree,
        "the inbox never matched the controller's pending count"
    );
}

/// The operator decides every request in the inbox, approving or denying in turn, until it is
/// empty. Each decision is 200, unless a late request of the burst decided it first (409
/// `revision_conflict` or `invalid_transition`, and the operation is then no longer pending). Returns how many this call decided.
pub async fn decide_the_inbox(h: &Harness) -> usize {
    let mut decided = 0;
    let emptied = eventually(async || {
        let ids = h.operator.pending().await;
        if ids.is_empty() {
            return true;
        }
        for id in &ids {
            let decision = if decided % 2 == 0 { "approve" } else { "deny" };
            let reply = h.operator.act(id, decision).await;
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
pub async fn assert_every_key_replays(h: &Harness, data: &Path, bodies: &BTreeMap<String, Value>) {
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
pub async fn ends_whole(h: &Harness, data: &Path) {
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

pub async fn create_pending(h: &Harness, prefix: &str, n: usize) -> Vec<String> {
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

pub async fn upload(h: &Harness, size: usize) -> String {
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

pub fn submissions(prefix: &str, n: usize, bodies: &mut BTreeMap<String, Value>) -> Vec<HangUp> {
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

pub fn decisions(ids: &[String]) -> Vec<HangUp> {
    ids.iter()
        .enumerate()
        .map(|(i, id)| {
            let decision = if i % 2 == 0 { "approve" } else { "deny" };
            HangUp::decision(id, decision)
        })
        .collect()
}

pub fn cancels(ids: &[String]) -> Vec<HangUp> {
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
pub fn uploads(n: usize, size: usize) -> Vec<HangUp> {
    (0..n)
        .map(|i| HangUp {
            declared: (i % 2 == 1).then_some(size * 4),
            ..HangUp::new("POST", STREAMS, AGENT_SECRET, vec![1u8; size])
        })
        .collect()
}

pub fn deletes(ids: &[String]) -> Vec<HangUp> {
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

/// Every kind of hang-up at once: submissions, approvals and denials, cancels, uploads (whole and
/// cut short) and deletes, against the state `prepare` made.
pub async fn prepare(h: &Harness, prefix: &str) -> (Vec<String>, Vec<String>, Vec<String>) {
    let to_decide = create_pending(h, &format!("{prefix}-decide"), 4).await;
    let to_cancel = create_pending(h, &format!("{prefix}-cancel"), 4).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(upload(h, 512).await);
    }
    (to_decide, to_cancel, streams)
}

pub fn everything(
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
