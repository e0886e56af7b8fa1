//! `admission drill`: the overload drill, end to end, against an in-process broker on loopback.
//!
//! It starts a broker with tight limits in a temporary data dir and walks what an on-call operator
//! needs to trust: a looping agent fills its pending and active limits and is refused with a code
//! and a Retry-After while nothing is written; replay, cancel, operator decisions, `/readyz` and
//! `/metrics` keep answering; freed capacity admits again; a saturated execution pool refuses new
//! work; a restart on the same data dir restores every count; and clients that hang up after
//! admission while their creation waits on a store another connection holds locked leave the
//! counts equal to the store. Each step prints what it expected
//! and what it saw.
//!
//! One file past the usual size: the drill is one script, step after step against one broker, and
//! reads best top to bottom.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{Broker, BrokerSettings, ListenAddr, RestoreSummary};
use unyolo_admission::config::{Identity, Operators, Secrets};
use unyolo_admission::{Config, Snapshot};

pub(super) const AGENT: &str = "agent";
pub(super) const AGENT_SECRET: &str = "drill-agent-secret";
const OTHER: &str = "other";
const OTHER_SECRET: &str = "drill-other-secret";
pub(super) const OPERATOR_SECRET: &str = "drill-operator-secret-0123456789abcdef";

/// The drill's limits: each client may have 4 operations active and 2 awaiting approval; two
/// operations may execute at a time.
pub(super) const LIMITS: &str = r#"{
  "requests_per_window": 100, "window_seconds": 60,
  "client_active": 4, "client_pending": 2,
  "global_active": 16, "global_executing": 2
}"#;

/// One step of the drill and how it went.
#[derive(Clone, Debug)]
pub struct Step {
    /// What the step does.
    pub name: String,
    /// What had to happen.
    pub expected: String,
    /// What happened.
    pub observed: String,
    /// Whether it held.
    pub passed: bool,
}

/// Runs the drill in a temporary data dir, printing the step table; returns whether every step
/// held.
pub fn run() -> bool {
    let dir = std::env::temp_dir().join(format!(
        "admission-drill-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return false;
        }
    };
    println!(
        "overload drill: broker on 127.0.0.1, data in {}",
        dir.display()
    );
    println!("limits: per client active 4, pending 2; global executing 2\n");
    let steps = runtime.block_on(walk(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    print!("{}", table(&steps));
    let failed = steps.iter().filter(|s| !s.passed).count();
    if failed == 0 {
        println!("\nall {} steps held", steps.len());
    } else {
        println!("\n{failed} of {} steps FAILED", steps.len());
    }
    failed == 0
}

/// The steps as an aligned table.
pub fn table(steps: &[Step]) -> String {
    let width = |f: fn(&Step) -> &str, title: &str| {
        steps
            .iter()
            .map(|s| f(s).len())
            .max()
            .unwrap_or(0)
            .max(title.len())
    };
    let (wn, we) = (
        width(|s| &s.name, "step"),
        width(|s| &s.expected, "expected"),
    );
    let mut out = format!(
        "{:>2}  {:<wn$}  {:<we$}  result  observed\n",
        "#", "step", "expected"
    );
    for (i, s) in steps.iter().enumerate() {
        out.push_str(&format!(
            "{:>2}  {:<wn$}  {:<we$}  {:<6}  {}\n",
            i + 1,
            s.name,
            s.expected,
            if s.passed { "pass" } else { "FAIL" },
            s.observed
        ));
    }
    out
}

/// A response: status, `Retry-After`, JSON body (or the text as a JSON string).
struct Reply {
    status: u16,
    retry_after: Option<String>,
    body: Value,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("-")
    }

    /// An operation's `state`, or a request's `status`.
    fn state(&self) -> &str {
        self.body["state"]
            .as_str()
            .or_else(|| self.body["status"].as_str())
            .unwrap_or("-")
    }

    fn id(&self) -> String {
        self.body["id"].as_str().unwrap_or_default().to_owned()
    }

    fn summary(&self) -> String {
        // An error answer; an operation that ended with an `error` of its own (denied, canceled)
        // is a 200 and shown by its state.
        let failed = self.status >= 400 && self.body["error"]["code"].is_string();
        match &self.retry_after {
            Some(after) if failed => {
                format!("{} {} Retry-After {after}", self.status, self.code())
            }
            _ if failed => format!("{} {}", self.status, self.code()),
            _ => format!("{} {}", self.status, self.state()),
        }
    }
}

/// The drill's HTTP client: agents' calls to the agent listener, the operator's to the
/// operator listener.
pub(super) struct Client {
    http: reqwest::Client,
    base: String,
    operator: String,
}

impl Client {
    pub(super) fn new(broker: &Broker) -> Client {
        let operator = match broker.operator_addr() {
            ListenAddr::Tcp(addr) => format!("http://{addr}"),
            // The drill listens on TCP; a socket would need a client of its own.
            ListenAddr::Unix(_) => String::new(),
        };
        Client {
            http: reqwest::Client::new(),
            base: format!("http://{}", broker.local_addr()),
            operator,
        }
    }

    /// A call to the agent listener.
    async fn call(&self, method: &str, path: &str, token: &str, body: Option<Value>) -> Reply {
        self.send(&self.base, method, path, token, body).await
    }

    /// A call to the operator listener, as the drill's operator.
    async fn operator(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.send(&self.operator, method, path, OPERATOR_SECRET, body)
            .await
    }

    async fn send(
        &self,
        base: &str,
        method: &str,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> Reply {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap_or(reqwest::Method::GET);
        let mut request = self
            .http
            .request(method, format!("{base}{path}"))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        match request.send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let text = response.text().await.unwrap_or_default();
                let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
                Reply {
                    status,
                    retry_after,
                    body,
                }
            }
            Err(err) => Reply {
                status: 0,
                retry_after: None,
                body: json!({"error": {"code": "unreachable", "message": err.to_string()}}),
            },
        }
    }

    async fn submit(&self, token: &str, key: &str, operation: &str, duration_ms: u64) -> Reply {
        let body = json!({
            "idempotency_key": key,
            "operation": operation,
            "target": {"repo": "unyolo/drill"},
            "arguments": {"duration_ms": duration_ms},
            "reason": "overload drill",
        });
        self.call("POST", "/api/agent/v1/operations", token, Some(body))
            .await
    }
}

fn settings(dir: &Path) -> BrokerSettings {
    let secrets = Secrets::parse(&format!(
        "{AGENT} = {AGENT_SECRET}\n{OTHER} = {OTHER_SECRET}\n"
    ))
    .expect("the drill's secrets are valid");
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let config = Config::from_bytes(LIMITS.as_bytes(), identities).expect("the drill's limits");
    BrokerSettings {
        config,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().expect("loopback"),
            PathBuf::from(dir),
            secrets,
            Operators::single("drill", OPERATOR_SECRET).expect("the drill's operator is valid"),
        )
    }
}

/// Counts the drill compares: (active, pending, queued, executing) for the agent, and admissions.
fn counts(s: &Snapshot) -> String {
    let c = s.client(AGENT);
    format!(
        "active {} pending {} queued {} executing {}",
        c.map_or(0, |c| c.active),
        c.map_or(0, |c| c.pending),
        c.map_or(0, |c| c.queued),
        c.map_or(0, |c| c.executing)
    )
}

async fn rows(broker: &Broker) -> u64 {
    broker
        .database()
        .count_operations()
        .await
        .unwrap_or(u64::MAX)
}

/// Polls `check` for up to five seconds.
async fn eventually(mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Walks the drill in `dir`; every step is recorded, whatever happened before it.
pub async fn walk(dir: &Path) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut step = |name: &str, expected: &str, observed: String, passed: bool| {
        steps.push(Step {
            name: name.to_owned(),
            expected: expected.to_owned(),
            observed,
            passed,
        });
    };
    let (broker, _) = match Broker::start(settings(dir)).await {
        Ok(started) => started,
        Err(err) => {
            step("start the broker", "listening", err.to_string(), false);
            return steps;
        }
    };
    step(
        "start the broker",
        "listening",
        format!("listening on {}", broker.local_addr()),
        true,
    );
    let c = Client::new(&broker);

    // Fill the agent's pending limit.
    let r1 = c
        .submit(AGENT_SECRET, "request-1", "demo.request", 100)
        .await;
    let r2 = c
        .submit(AGENT_SECRET, "request-2", "demo.request", 100)
        .await;
    step(
        "two approval requests",
        "202 pending, 202 pending",
        format!("{}, {}", r1.summary(), r2.summary()),
        r1.status == 202 && r2.status == 202 && r1.state() == "pending" && r2.state() == "pending",
    );
    let (rows_before, snap_before) = (rows(&broker).await, broker.controller().snapshot());
    let r3 = c
        .submit(AGENT_SECRET, "request-3", "demo.request", 100)
        .await;
    let (rows_after, snap_after) = (rows(&broker).await, broker.controller().snapshot());
    step(
        "third approval request",
        "429 client_pending_limit, no row",
        format!("{}; rows {rows_before}->{rows_after}", r3.summary()),
        r3.status == 429
            && r3.code() == "client_pending_limit"
            && retry_after_ok(&r3)
            && rows_before == rows_after
            && counts(&snap_before) == counts(&snap_after),
    );

    // Fill the agent's active limit with two runs; they fill the execution pool too.
    let run1 = c.submit(AGENT_SECRET, "run-1", "demo.run", 60_000).await;
    let run2 = c.submit(AGENT_SECRET, "run-2", "demo.run", 1_500).await;
    let started = eventually(async || broker.controller().snapshot().executing == 2).await;
    step(
        "two runs (60 s and 1.5 s)",
        "202, 202; both executing",
        format!(
            "{}, {}; {}",
            run1.summary(),
            run2.summary(),
            counts(&broker.controller().snapshot())
        ),
        run1.status == 202 && run2.status == 202 && started,
    );
    let (rows_before, snap_before) = (rows(&broker).await, broker.controller().snapshot());
    let run3 = c.submit(AGENT_SECRET, "run-3", "demo.run", 0).await;
    let (rows_after, snap_after) = (rows(&broker).await, broker.controller().snapshot());
    step(
        "fifth submission",
        "429 client_operation_limit, no row",
        format!("{}; rows {rows_before}->{rows_after}", run3.summary()),
        run3.status == 429
            && run3.code() == "client_operation_limit"
            && retry_after_ok(&run3)
            && rows_before == rows_after
            && counts(&snap_before) == counts(&snap_after)
            && snap_before.admitted == snap_after.admitted,
    );
    let other = c.submit(OTHER_SECRET, "other-1", "demo.run", 0).await;
    let rows_after = rows(&broker).await;
    step(
        "pool saturated: other client",
        "429 global_execution_limit, no row",
        format!("{}; rows {rows_before}->{rows_after}", other.summary()),
        other.status == 429
            && other.code() == "global_execution_limit"
            && retry_after_ok(&other)
            && rows_before == rows_after,
    );

    // Exempt paths while the client is over every limit.
    let replay = c
        .submit(AGENT_SECRET, "request-1", "demo.request", 100)
        .await;
    let rows_after = rows(&broker).await;
    step(
        "replay while over limits",
        "200, same operation, no row",
        format!(
            "{} same id: {}; rows {rows_before}->{rows_after}",
            replay.summary(),
            replay.id() == r1.id()
        ),
        replay.status == 200 && replay.id() == r1.id() && rows_after == rows_before,
    );
    let conflict = c.submit(AGENT_SECRET, "request-1", "demo.request", 5).await;
    step(
        "same key, other request",
        "409 idempotency_conflict",
        conflict.summary(),
        conflict.status == 409 && conflict.code() == "idempotency_conflict",
    );
    let health = c.call("GET", "/healthz", "", None).await;
    let ready = c.call("GET", "/readyz", "", None).await;
    let metrics = c.operator("GET", "/metrics", None).await;
    let text = metrics.body.as_str().unwrap_or_default();
    let pending_refusals = metric(
        text,
        r#"admission_requests_total{result="rejected",code="client_pending_limit"}"#,
    );
    let rejected = metric(text, r#"broker_submissions_total{result="rejected"}"#);
    step(
        "healthz, readyz, metrics",
        "200, 200, 200 counting the refusals",
        format!(
            "{}, {}, {}; client_pending_limit {pending_refusals:?}, rejected {rejected:?}",
            health.status, ready.status, metrics.status
        ),
        health.status == 200
            && ready.status == 200
            && metrics.status == 200
            && pending_refusals == Some(1)
            && rejected == Some(3),
    );

    // Operator decisions and cancels.
    let pending = c
        .operator("GET", "/api/operator/v1/requests?status=pending", None)
        .await;
    let listed = pending.body["requests"].as_array().map_or(0, Vec::len);
    let denied = decide(&c, &r1.id(), "deny").await;
    let approved = decide(&c, &r2.id(), "approve").await;
    let again = decide(&c, &r1.id(), "approve").await;
    let snap = broker.controller().snapshot();
    step(
        "operator: list, deny, approve",
        "2 pending; denied; active (queued); 409 invalid_transition",
        format!(
            "{listed} pending; {}; {} (queued {}); {}",
            denied.state(),
            approved.state(),
            snap.queued,
            again.summary()
        ),
        listed == 2
            && denied.state() == "denied"
            && approved.state() == "active"
            && snap.queued == 1
            && again.status == 409
            && again.code() == "invalid_transition",
    );
    let canceled = cancel(&c, &r2.id()).await;
    let executing = cancel(&c, &run1.id()).await;
    step(
        "cancel queued, cancel executing",
        "200 canceled; 409 operation_not_cancelable",
        format!("{}; {}", canceled.summary(), executing.summary()),
        canceled.status == 200
            && canceled.state() == "canceled"
            && executing.status == 409
            && executing.code() == "operation_not_cancelable",
    );
    let path = format!("/api/agent/v1/operations/{}", run2.id());
    let finished =
        eventually(async || c.call("GET", &path, AGENT_SECRET, None).await.state() == "succeeded")
            .await;
    step(
        "the 1.5 s run finishes",
        "succeeded; a slot frees",
        counts(&broker.controller().snapshot()),
        finished,
    );
    let r4 = c
        .submit(AGENT_SECRET, "request-4", "demo.request", 60_000)
        .await;
    let r5 = c
        .submit(AGENT_SECRET, "request-5", "demo.request", 100)
        .await;
    step(
        "freed capacity admits again",
        "202 pending, 202 pending",
        format!("{}, {}", r4.summary(), r5.summary()),
        r4.status == 202 && r5.status == 202,
    );
    let a4 = decide(&c, &r4.id(), "approve").await;
    let a5 = decide(&c, &r5.id(), "approve").await;
    let saturated = eventually(async || {
        let s = broker.controller().snapshot();
        s.executing == 2 && s.queued == 1
    })
    .await;
    step(
        "approve both: pool saturated again",
        "2 executing, 1 queued",
        format!(
            "{}, {}; {}",
            a4.summary(),
            a5.summary(),
            counts(&broker.controller().snapshot())
        ),
        a4.status == 200 && a5.status == 200 && saturated,
    );

    // Restart on the same data dir: executing work must not run again; queued work must.
    let before = broker.controller().snapshot();
    let rows_before = rows(&broker).await;
    broker.shutdown().await;
    let (broker, restored) = match Broker::start(settings(dir)).await {
        Ok(started) => started,
        Err(err) => {
            step("restart", "restored", err.to_string(), false);
            return steps;
        }
    };
    let c = Client::new(&broker);
    let after = broker.controller().snapshot();
    let rows_after = rows(&broker).await;
    let expected = RestoreSummary {
        pending: 0,
        approved: 1,
        interrupted: 2,
        streams: 0,
    };
    step(
        "restart on the same data dir",
        "rows kept; 1 queued restored, 2 interrupted",
        format!(
            "rows {rows_before}->{rows_after}; restored {} queued, {} interrupted; active {}->{}",
            restored.approved, restored.interrupted, before.active, after.active
        ),
        rows_before == rows_after && restored == expected && after.active == 1,
    );
    let interrupted = c
        .call(
            "GET",
            &format!("/api/agent/v1/operations/{}", run1.id()),
            AGENT_SECRET,
            None,
        )
        .await;
    step(
        "the run executing at the stop",
        "failed, execution_interrupted",
        format!(
            "{} {}",
            interrupted.state(),
            interrupted.body["error"]["code"].as_str().unwrap_or("-")
        ),
        interrupted.state() == "failed"
            && interrupted.body["error"]["code"] == "execution_interrupted",
    );
    let path = format!("/api/agent/v1/operations/{}", r5.id());
    let ran =
        eventually(async || c.call("GET", &path, AGENT_SECRET, None).await.state() == "succeeded")
            .await;
    let idle = eventually(async || broker.controller().snapshot().is_idle()).await;
    step(
        "queued work runs after restart",
        "succeeded; counts back to zero",
        format!(
            "{}; {}",
            c.call("GET", &path, AGENT_SECRET, None).await.state(),
            counts(&broker.controller().snapshot())
        ),
        ran && idle,
    );
    let (observed, passed) = hang_up_mid_submission(&broker, dir, &c).await;
    step(
        "clients hang up mid-submission",
        "replays 200; drift 0; inbox decidable",
        observed,
        passed,
    );
    broker.shutdown().await;
    steps
}

/// Two clients send an approval request while another connection holds the store's write lock;
/// once the controller has admitted both (their creations now wait on the store), the clients
/// hang up, and only then is the lock let go. Each creation must still end whole: the same
/// requests again are replays (200), the controller's counts equal the store (drift 0), and the
/// operator can deny both.
async fn hang_up_mid_submission(broker: &Broker, dir: &Path, c: &Client) -> (String, bool) {
    let addr = broker.local_addr();
    let bodies: Vec<Value> = (1..=2)
        .map(|i| {
            json!({
                "idempotency_key": format!("hang-up-{i}"),
                "operation": "demo.request",
                "target": {"repo": "unyolo/drill"},
                "arguments": {"duration_ms": 0},
                "reason": "overload drill",
            })
        })
        .collect();
    let pending_before = broker.controller().snapshot().pending;
    let database = dir.join(super::store::DATABASE_FILE);
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || -> Result<(), String> {
        let conn = rusqlite::Connection::open(database).map_err(|e| e.to_string())?;
        conn.busy_timeout(Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
        conn.execute_batch("BEGIN IMMEDIATE")
            .map_err(|e| e.to_string())?;
        let _ = locked.send(());
        // Until the drill says so (or gives up), bounded so a failed drill cannot hang.
        let _ = released.recv_timeout(Duration::from_secs(10));
        conn.execute_batch("COMMIT").map_err(|e| e.to_string())
    });
    if is_locked.recv().is_err() {
        let err = holder
            .join()
            .map_or_else(|_| "panicked".to_owned(), |r| format!("{r:?}"));
        return (format!("cannot lock the store: {err}"), false);
    }
    let mut connections = Vec::new();
    for body in &bodies {
        if let Some(stream) = send_submission(addr, AGENT_SECRET, body).await {
            connections.push(stream);
        }
    }
    let admitted =
        eventually(async || broker.controller().snapshot().pending == pending_before + 2).await;
    let sent = connections.len();
    drop(connections); // The clients hang up while their creations wait on the store.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = release.send(());
    let unlocked = tokio::task::spawn_blocking(move || holder.join())
        .await
        .map(|joined| joined.is_ok_and(|r| r.is_ok()))
        .unwrap_or(false);
    let mut again = Vec::new();
    for body in &bodies {
        let reply = c
            .call(
                "POST",
                "/api/agent/v1/operations",
                AGENT_SECRET,
                Some(body.clone()),
            )
            .await;
        again.push(reply.status);
    }
    let drift = broker.check_drift().await;
    let pending = broker.controller().snapshot().pending;
    let inbox = c
        .operator("GET", "/api/operator/v1/requests?status=pending", None)
        .await;
    let mut denied = Vec::new();
    for request in inbox.body["requests"].as_array().into_iter().flatten() {
        let id = request["id"].as_str().unwrap_or_default();
        denied.push(decide(c, id, "deny").await.status);
    }
    let after = broker.check_drift().await;
    let drift_text = |d: &Result<super::DriftReport, super::StoreError>| match d {
        Ok(report) => report.total().to_string(),
        Err(err) => err.to_string(),
    };
    let observed = format!(
        "{sent} admitted then hung up; again {again:?}; pending {pending}, drift {}; denied {denied:?}, drift {}",
        drift_text(&drift),
        drift_text(&after)
    );
    let passed = sent == 2
        && admitted
        && unlocked
        && again == [200, 200]
        && drift.as_ref().is_ok_and(|d| d.is_clean())
        && pending == pending_before + 2
        && denied == [200, 200]
        && after.as_ref().is_ok_and(|d| d.is_clean());
    (observed, passed)
}

/// Writes a whole submission to the broker and returns the open connection, answer unread.
async fn send_submission(
    addr: SocketAddr,
    token: &str,
    body: &Value,
) -> Option<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let body = body.to_string();
    let request = format!(
        "POST /api/agent/v1/operations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.write_all(request.as_bytes()).await.ok()?;
    Some(stream)
}

/// The operator's `decision` on request `id`, made against its current revision.
async fn decide(c: &Client, id: &str, decision: &str) -> Reply {
    let current = c
        .operator("GET", &format!("/api/operator/v1/requests/{id}"), None)
        .await;
    let body = json!({
        "expected_revision": current.body["revision"].as_u64().unwrap_or(0),
        "idempotency_key": format!("drill-{decision}-{id}"),
    });
    let path = format!("/api/operator/v1/requests/{id}/{decision}");
    c.operator("POST", &path, Some(body)).await
}

async fn cancel(c: &Client, id: &str) -> Reply {
    let path = format!("/api/agent/v1/operations/{id}/cancel");
    c.call("POST", &path, AGENT_SECRET, None).await
}

/// The value of one series in Prometheus text.
fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

fn retry_after_ok(reply: &Reply) -> bool {
    reply
        .retry_after
        .as_deref()
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|secs| secs >= 1)
}
