//! The `admission serve` binary as a process: the files it reads, started (optionally under a
//! lowered open-file limit) and waited for until it listens, spoken to over fresh connections,
//! killed with SIGKILL when dropped; or run to its end when it must refuse to start.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::contract;
use super::eventually::PATIENCE;
use super::http::Reply;
use super::metrics::metric;
use super::operator::Operator;
use super::secrets::{operator_secrets_file, secrets_file};

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
        std::fs::write(&files.secrets, secrets_file()).unwrap();
        std::fs::write(&files.operator, operator_secrets_file()).unwrap();
        std::fs::write(&files.config, limits).unwrap();
        files
    }

    /// The flags naming these files.
    pub fn args(&self) -> Vec<String> {
        [
            ("--data", &self.data),
            ("--secrets", &self.secrets),
            ("--operator-secrets", &self.operator),
            ("--admission-config", &self.config),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [flag.to_owned(), path.to_str().unwrap().to_owned()])
        .collect()
    }

    /// The flags of replica `name` of the deployment whose replicas are `fleet`
    /// (comma-separated): these files, and a data dir of its own under `dir`. The caller adds
    /// what its fleet shares (`--redis`, `--store`, ...).
    pub fn replica_args(&self, dir: &Path, name: &str, fleet: &str) -> Vec<String> {
        let data = dir.join(format!("data-{name}"));
        [
            ("--replica", Path::new(name)),
            ("--replicas", Path::new(fleet)),
            ("--data", &data),
            ("--secrets", &self.secrets),
            ("--operator-secrets", &self.operator),
            ("--admission-config", &self.config),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value.to_str().unwrap().to_owned()])
        .collect()
    }
}

/// A process's memory, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    /// Resident now.
    pub resident: u64,
    /// The most resident so far.
    pub peak: u64,
}

/// A running `admission serve`; killed (SIGKILL) when dropped.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    pub base: String,
    /// Where it listens for operators, as it printed it (`ADDR` or `unix:/path`).
    pub operator_addr: String,
    /// The operator (`OPERATOR`) on its operator listener (TCP).
    pub operator: Operator,
    /// What it printed up to and including its `listening on` line.
    pub stdout: String,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `admission serve --listen 127.0.0.1:0 --operator-listen 127.0.0.1:0` (unless `args` names
/// another operator listener) with `args`, logging at `log_filter`, through `sh` so
/// `ulimit -n` can lower its open-file limit first (`exec` keeps the pid the server's own).
fn command(file_limit: Option<u32>, log_filter: &str, args: &[impl AsRef<str>]) -> Command {
    let limit = file_limit.map_or(String::new(), |n| format!("ulimit -n {n} && "));
    let operator = if args.iter().any(|a| a.as_ref() == "--operator-listen") {
        ""
    } else {
        " --operator-listen 127.0.0.1:0"
    };
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "{limit}exec \"$0\" serve --listen 127.0.0.1:0{operator} \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_admission"))
        .args(args.iter().map(AsRef::as_ref))
        .env("RUST_LOG", log_filter);
    command
}

/// How a `serve` that was expected to refuse to start ended.
pub struct Exit {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `admission serve` with `args` to its end (for start-up failures); a server that starts
/// anyway fails the test after [`PATIENCE`] instead of hanging it.
pub fn run_to_end(args: &[impl AsRef<str>]) -> Exit {
    let mut child = command(None, "info", args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let mut out = String::new();
            let _ = child.stdout.take().unwrap().read_to_string(&mut out);
            panic!("serve kept running:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    Exit {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

impl Server {
    /// Starts `admission serve` with `args`, under `file_limit` open files if given, logging at
    /// `info`, and waits until it listens.
    pub fn spawn(file_limit: Option<u32>, args: &[impl AsRef<str>]) -> Server {
        Server::spawn_logging(file_limit, "info", args)
    }

    /// [`Server::spawn`] with `RUST_LOG=log_filter`.
    pub fn spawn_logging(
        file_limit: Option<u32>,
        log_filter: &str,
        args: &[impl AsRef<str>],
    ) -> Server {
        Server::launch(command(file_limit, log_filter, args))
    }

    /// [`Server::spawn`] with more environment variables (the debug build's stops, say:
    /// `ADMISSION_TEST_STOP_AFTER_INSERT`).
    pub fn spawn_with_env(env: &[(&str, &str)], args: &[impl AsRef<str>]) -> Server {
        let mut command = command(None, "info", args);
        command.envs(env.iter().copied());
        Server::launch(command)
    }

    fn launch(mut command: Command) -> Server {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Both pipes are drained on threads of their own for the server's whole life, so it never
        // blocks on them, and a server that never listens fails the test after a bound.
        let stdout = child.stdout.take().unwrap();
        let (lines, printed) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let mut stderr = child.stderr.take().unwrap();
        let logged = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&logged);
        let log_drain = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        let deadline = Instant::now() + PATIENCE;
        let mut seen = String::new();
        let mut operator_addr = String::new();
        let addr = loop {
            match printed.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    seen.push_str(&line);
                    seen.push('\n');
                    if let Some(addr) = line.trim().strip_prefix("operators on ") {
                        operator_addr = addr.to_owned();
                    }
                    if let Some(addr) = line.trim().strip_prefix("listening on ") {
                        break addr.parse::<SocketAddr>().unwrap();
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = child.wait();
                    let _ = log_drain.join();
                    let err = String::from_utf8_lossy(&logged.lock().unwrap()).into_owned();
                    panic!("serve exited before listening:\n{seen}\n{err}");
                }
                Err(RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    panic!("serve did not listen within {PATIENCE:?}:\n{seen}");
                }
            }
        };
        Server {
            child,
            addr,
            base: format!("http://{addr}"),
            operator: Operator::new(format!("http://{operator_addr}")),
            operator_addr,
            stdout: seen,
            stderr: logged,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server process's resident memory now (`VmRSS`) and at its peak so far (`VmHWM`),
    /// in bytes, from `/proc/<pid>/status`.
    pub fn memory(&self) -> Memory {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib = |field: &str| -> u64 {
            let line = status.lines().find(|l| l.starts_with(field)).unwrap();
            line.split_whitespace().nth(1).unwrap().parse().unwrap()
        };
        Memory {
            resident: kib("VmRSS:") * 1024,
            peak: kib("VmHWM:") * 1024,
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

    /// Sends SIGTERM (shut down gracefully).
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Sends SIGKILL: the process ends at once, as a crash would (its handle may still be held
    /// elsewhere; dropping it later changes nothing).
    pub fn kill(&self) {
        self.signal("-KILL");
    }

    /// Sends SIGSTOP: the whole process pauses where it is, as a stalled machine would.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Sends SIGCONT: a paused process goes on from where it stopped.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Whether the process runs (or is stopped): not exited, not a zombie (`/proc/PID/stat`),
    /// read through a shared handle.
    pub fn is_running(&self) -> bool {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
    }

    /// Whether the process is stopped (`T` in `/proc/PID/stat`): by [`Server::pause`], or by
    /// itself at one of the debug build's stops.
    pub fn is_stopped(&self) -> bool {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        // The state follows the command's name, which is in parentheses.
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('T'))
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal}");
    }

    /// Sends SIGHUP (reload the admission config).
    pub fn sighup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// One request on a connection of its own (no pooled connection the server may have closed),
    /// waiting at most [`PATIENCE`]. The binary speaks the contract too: every reply is checked
    /// against it.
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> Result<Reply, reqwest::Error> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(PATIENCE)
            .build()
            .unwrap();
        let mut request = http
            .request(method.clone(), format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let reply = Reply::read(request.send().await?).await?;
        contract::check_reply(method.as_str(), path, reply.status, &reply.body);
        Ok(reply)
    }

    pub async fn submit(&self, token: &str, body: &Value) -> Reply {
        self.send(
            reqwest::Method::POST,
            "/api/agent/v1/operations",
            token,
            Some(body.clone()),
        )
        .await
        .unwrap()
    }

    pub async fn get(&self, path: &str, token: &str) -> Reply {
        self.send(reqwest::Method::GET, path, token, None)
            .await
            .unwrap()
    }

    pub async fn post(&self, path: &str, token: &str) -> Reply {
        self.send(reqwest::Method::POST, path, token, None)
            .await
            .unwrap()
    }

    /// One series of the server's `/metrics` (on its operator listener).
    pub async fn metric(&self, series: &str) -> Option<u64> {
        metric(&self.operator.metrics().await, series)
    }
}
