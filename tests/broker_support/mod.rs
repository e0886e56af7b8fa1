//! Shared by the broker's end-to-end tests: start a real broker on 127.0.0.1 (port 0) in a
//! temporary data dir and talk to it over HTTP.
#![allow(dead_code)]

pub mod contract;
pub mod faults;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use unyolo_admission::broker::{Broker, BrokerSettings, RestoreSummary};
use unyolo_admission::config::{Identity, Secrets};
use unyolo_admission::{Config, Snapshot, StorageCaps};

pub const AGENT: &str = "agent";
pub const AGENT_SECRET: &str = "agent-secret-0123";
pub const OTHER: &str = "other";
pub const OTHER_SECRET: &str = "other-secret-4567";
pub const OPERATOR_SECRET: &str = "operator-secret-89ab";

/// Roomy limits: nothing binds unless a test makes it.
pub const ROOMY: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 25, "client_pending": 10, "global_active": 100, "global_executing": 10}"#;

pub fn secrets() -> Secrets {
    Secrets::parse(&format!(
        "{AGENT} = {AGENT_SECRET}\n{OTHER} = {OTHER_SECRET}\n"
    ))
    .unwrap()
}

pub fn settings(dir: &std::path::Path, limits: &str, caps: StorageCaps) -> BrokerSettings {
    let secrets = secrets();
    let identities: Vec<Identity> = secrets.identities().cloned().collect();
    let config = Config::from_bytes(limits.as_bytes(), identities).unwrap();
    BrokerSettings {
        config,
        storage_caps: caps,
        ..BrokerSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.to_owned(),
            secrets,
            OPERATOR_SECRET.to_owned(),
        )
    }
}

pub struct Harness {
    pub broker: Broker,
    pub restored: RestoreSummary,
    pub base: String,
    pub http: reqwest::Client,
}

pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl Reply {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("-")
    }
    pub fn state(&self) -> &str {
        self.body["state"].as_str().unwrap_or("-")
    }
    pub fn id(&self) -> String {
        self.body["id"].as_str().unwrap_or_default().to_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn retry_after(&self) -> Option<u64> {
        self.header("retry-after").and_then(|v| v.parse().ok())
    }
}

pub async fn start(dir: &std::path::Path, limits: &str) -> Harness {
    start_with(settings(dir, limits, StorageCaps::default())).await
}

pub async fn start_with(settings: BrokerSettings) -> Harness {
    let (broker, restored) = Broker::start(settings).await.unwrap();
    Harness {
        base: format!("http://{}", broker.local_addr()),
        broker,
        restored,
        http: reqwest::Client::new(),
    }
}

pub fn request(key: &str, operation: &str, duration_ms: u64) -> Value {
    json!({
        "idempotency_key": key,
        "operation": operation,
        "target": {"repo": "unyolo/test", "branch": "main"},
        "arguments": {"duration_ms": duration_ms},
        "reason": "end-to-end test",
    })
}

impl Harness {
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<reqwest::Body>,
    ) -> Reply {
        let method_name = method;
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        if let Some(body) = body {
            req = req.body(body);
        }
        let response = req.send().await.unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        // Every body the broker sends in these tests is checked against the contract's schema.
        contract::check_reply(method_name, path, status, &body);
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn submit(&self, token: &str, body: &Value) -> Reply {
        self.send(
            "POST",
            "/api/agent/v1/operations",
            Some(token),
            Some(body.to_string().into()),
        )
        .await
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.send("GET", path, token, None).await
    }

    pub async fn post(&self, path: &str, token: Option<&str>) -> Reply {
        self.send("POST", path, token, None).await
    }

    pub async fn rows(&self) -> u64 {
        self.broker.database().count_operations().await.unwrap()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.broker.controller().snapshot()
    }

    pub async fn metrics(&self) -> String {
        let reply = self.get("/metrics", Some(OPERATOR_SECRET)).await;
        assert_eq!(reply.status, 200);
        reply.body.as_str().unwrap().to_owned()
    }
}

/// Asserts that nothing was admitted, refused, counted or spent between two snapshots. Rate
/// tokens may only have refilled (time passes between the two); a spent token still shows.
#[track_caller]
pub fn assert_unchanged(before: &Snapshot, after: &Snapshot, what: &str) {
    let mut after = after.clone();
    for (now, then) in after.clients.iter_mut().zip(&before.clients) {
        if now.tokens >= then.tokens {
            now.tokens = then.tokens;
        }
    }
    assert_eq!(&after, before, "{what}");
}

/// The value of one series in Prometheus text.
pub fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

/// Polls `check` for up to ten seconds.
pub async fn eventually(mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
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

/// Sends every request at once, each on its own connection closed right after writing.
pub async fn hang_up_all(addr: std::net::SocketAddr, requests: Vec<HangUp>) {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|r| tokio::spawn(async move { r.send(addr).await }))
        .collect();
    for task in tasks {
        let _ = task.await;
    }
}
