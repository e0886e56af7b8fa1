//! The `admission serve` binary as a process for the fault tests: started (optionally under a
//! lowered open-file limit), spoken to over fresh connections, killed with SIGKILL when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const AGENT_SECRET: &str = "agent-secret-0123";
pub const OTHER_SECRET: &str = "other-secret-4567";
pub const OPERATOR_SECRET: &str = "operator-secret-89ab";

/// How long a test waits for something that must happen "eventually": a bound, not a timing
/// claim.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The paths of the files `serve` reads, in a test's temporary dir.
pub struct Files {
    pub data: PathBuf,
    pub secrets: PathBuf,
    pub operator: PathBuf,
    pub config: PathBuf,
}

impl Files {
    /// Clients `agent` and `other`, the operator, and a quota file with `limits` (a JSON object).
    pub fn write(dir: &Path, limits: &str) -> Files {
        let files = Files {
            data: dir.join("data"),
            secrets: dir.join("secrets"),
            operator: dir.join("operator"),
            config: dir.join("admission.json"),
        };
        std::fs::write(
            &files.secrets,
            format!("agent = {AGENT_SECRET}\nother = {OTHER_SECRET}\n"),
        )
        .unwrap();
        std::fs::write(&files.operator, format!("{OPERATOR_SECRET}\n")).unwrap();
        std::fs::write(&files.config, limits).unwrap();
        files
    }

    /// The flags naming these files.
    pub fn args(&self) -> Vec<String> {
        [
            ("--data", &self.data),
            ("--secrets", &self.secrets),
            ("--operator-secret", &self.operator),
            ("--admission-config", &self.config),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [flag.to_owned(), path.to_str().unwrap().to_owned()])
        .collect()
    }
}

/// A running `admission serve`; killed (SIGKILL) when dropped.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    pub base: String,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `admission serve` with `args`, through `sh` so `ulimit -n` can lower its open-file limit first.
fn command(file_limit: Option<u32>, args: &[String]) -> Command {
    let limit = file_limit.map_or(String::new(), |n| format!("ulimit -n {n} && "));
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "{limit}exec \"$0\" serve --listen 127.0.0.1:0 \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_admission"))
        .args(args)
        .env("RUST_LOG", "info");
    command
}

/// Runs `admission serve` with `args` to its end (for start-up failures).
pub fn run_to_end(args: &[String]) -> Output {
    command(None, args).output().unwrap()
}

impl Server {
    /// Starts `admission serve` with `args`, under `file_limit` open files if given, and waits
    /// until it listens.
    pub fn spawn(file_limit: Option<u32>, args: &[String]) -> Server {
        let mut child = command(file_limit, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut seen = String::new();
        let addr = loop {
            let mut line = String::new();
            if stdout.read_line(&mut line).unwrap() == 0 {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("serve exited before listening:\n{seen}\n{err}");
            }
            seen.push_str(&line);
            if let Some(addr) = line.trim().strip_prefix("listening on ") {
                break addr.parse::<SocketAddr>().unwrap();
            }
        };
        // Keep draining both pipes so the server never blocks on them.
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = stdout.read_to_end(&mut sink);
        });
        let mut stderr = child.stderr.take().unwrap();
        let logged = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&logged);
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Server {
            child,
            addr,
            base: format!("http://{addr}"),
            stderr: logged,
        }
    }

    /// Whether the process is still running.
    pub fn is_alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Everything the server has logged so far.
    pub fn logged(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// One request on a connection of its own (no pooled connection the server may have closed),
    /// waiting at most [`PATIENCE`]: `(status, Retry-After, body)`.
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> Result<(u16, Option<u64>, Value), reqwest::Error> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(PATIENCE)
            .build()
            .unwrap();
        let mut request = http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, retry_after, body))
    }

    /// Submits `operation` with idempotency key `key`.
    pub async fn submit(
        &self,
        token: &str,
        key: &str,
        operation: &str,
    ) -> (u16, Option<u64>, Value) {
        let body = serde_json::json!({
            "idempotency_key": key,
            "operation": operation,
            "target": {"repo": "unyolo/test", "branch": "main"},
            "arguments": {"duration_ms": 0},
            "reason": "fault test",
        });
        self.send(
            reqwest::Method::POST,
            "/api/agent/v1/operations",
            token,
            Some(body),
        )
        .await
        .unwrap()
    }
}

/// Polls `check` until it holds or [`PATIENCE`] has passed; whether it held.
pub async fn eventually(mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
