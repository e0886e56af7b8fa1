//! The `admission serve` binary as an operator runs it: crash (`kill -9`) and restart on the same
//! data dir, `SIGHUP` reload, generated secrets.
#![cfg(feature = "broker")]

mod broker_support;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use broker_support::{AGENT_SECRET, OPERATOR_SECRET, eventually, metric, request};
use serde_json::Value;

/// A running `admission serve`; killed (SIGKILL) when dropped.
struct Server {
    child: Child,
    base: String,
    stdout: String,
    /// Everything the server has logged so far.
    stderr: Arc<Mutex<Vec<u8>>>,
    http: reqwest::Client,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn spawn(args: &[&str]) -> Server {
        Server::spawn_logging(args, "info")
    }

    /// Starts `admission serve` with `RUST_LOG=log_filter`.
    fn spawn_logging(args: &[&str], log_filter: &str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_admission"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", log_filter)
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
                break addr.to_owned();
            }
        };
        // Keep draining stderr so logging never blocks the server.
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
            base: format!("http://{addr}"),
            stdout: seen,
            stderr: logged,
            http: reqwest::Client::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let method_name = method.to_string();
        let response = req.send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        // The binary speaks the contract too.
        broker_support::contract::check_reply(&method_name, path, status, &body);
        (status, body)
    }

    async fn submit(&self, token: &str, body: Value) -> (u16, Value) {
        self.send(
            reqwest::Method::POST,
            "/api/agent/v1/operations",
            token,
            Some(body),
        )
        .await
    }

    async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, token, None).await
    }

    async fn post(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, token, None).await
    }

    async fn metric(&self, series: &str) -> Option<u64> {
        let (status, text) = self.get("/metrics", OPERATOR_SECRET).await;
        assert_eq!(status, 200);
        metric(text.as_str().unwrap(), series)
    }

    fn sighup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Writes the secrets, operator secret and a quota file; returns their paths as flags.
fn files(dir: &Path, pending: u32) -> (Vec<String>, PathBuf) {
    let secrets = dir.join("secrets");
    std::fs::write(
        &secrets,
        format!("agent = {AGENT_SECRET}\nother = other-secret-4567\n"),
    )
    .unwrap();
    let operator = dir.join("operator");
    std::fs::write(&operator, format!("{OPERATOR_SECRET}\n")).unwrap();
    let config = dir.join("admission.json");
    write_config(&config, pending);
    let data = dir.join("data");
    let args = [
        "--data",
        data.to_str().unwrap(),
        "--secrets",
        secrets.to_str().unwrap(),
        "--operator-secret",
        operator.to_str().unwrap(),
        "--admission-config",
        config.to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec();
    (args, config)
}

fn write_config(path: &Path, pending: u32) {
    std::fs::write(
        path,
        format!(
            r#"{{"requests_per_window": 1000, "window_seconds": 60, "client_active": 5,
                "client_pending": {pending}, "global_active": 100, "global_executing": 1}}"#
        ),
    )
    .unwrap();
}

fn as_args(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn state(op: &Value) -> &str {
    op["state"].as_str().unwrap_or("-")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_every_operation_is_back_counts_are_restored_and_executing_work_failed() {
    let dir = tempfile::tempdir().unwrap();
    let (args, _) = files(dir.path(), 2);
    let server = Server::spawn(&as_args(&args));
    let (_, pending) = server
        .submit(AGENT_SECRET, request("pending", "demo.request", 0))
        .await;
    let (_, done) = server
        .submit(AGENT_SECRET, request("done", "demo.request", 0))
        .await;
    let deny = format!(
        "/api/operator/v1/requests/{}/deny",
        done["id"].as_str().unwrap()
    );
    assert_eq!(server.post(&deny, OPERATOR_SECRET).await.0, 200);
    let (_, queued) = server
        .submit(AGENT_SECRET, request("queued", "demo.request", 100))
        .await;
    let (status, running) = server
        .submit(AGENT_SECRET, request("running", "demo.run", 60_000))
        .await;
    assert_eq!(status, 202);
    let running_path = format!(
        "/api/agent/v1/operations/{}",
        running["id"].as_str().unwrap()
    );
    assert!(
        eventually(async || state(&server.get(&running_path, AGENT_SECRET).await.1) == "executing")
            .await
    );
    // The pool (1) is busy, so the approved request waits in the queue.
    let approve = format!(
        "/api/operator/v1/requests/{}/approve",
        queued["id"].as_str().unwrap()
    );
    assert_eq!(server.post(&approve, OPERATOR_SECRET).await.0, 200);
    assert_eq!(
        server
            .metric(r#"admission_operations{state="queued"}"#)
            .await,
        Some(1)
    );

    drop(server); // SIGKILL: no shutdown path runs.

    let server = Server::spawn(&as_args(&args));
    assert!(
        server
            .stdout
            .contains("restored: 1 pending, 1 approved, 1 interrupted, 0 streams"),
        "{}",
        server.stdout
    );
    let (_, listed) = server.get("/api/agent/v1/operations", AGENT_SECRET).await;
    let ops = listed["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 4, "every operation survived");
    let (_, running) = server.get(&running_path, AGENT_SECRET).await;
    assert_eq!(state(&running), "failed");
    assert_eq!(running["error"]["code"], "execution_interrupted");
    assert!(running["terminal_at"].is_string());
    let (_, pending) = server
        .get(
            &format!(
                "/api/agent/v1/operations/{}",
                pending["id"].as_str().unwrap()
            ),
            AGENT_SECRET,
        )
        .await;
    assert_eq!(state(&pending), "pending");
    // Keys used before the crash still replay (and conflict), and consume nothing.
    let (status, replayed) = server
        .submit(AGENT_SECRET, request("pending", "demo.request", 0))
        .await;
    assert_eq!((status, &replayed["id"]), (200, &pending["id"]));
    let (status, _) = server
        .submit(AGENT_SECRET, request("pending", "demo.request", 5))
        .await;
    assert_eq!(status, 409);
    assert_eq!(
        server
            .metric(r#"admission_operations{state="pending"}"#)
            .await,
        Some(1)
    );
    assert_eq!(
        server
            .metric(r#"admission_client_operations{client="agent",state="pending"}"#)
            .await,
        Some(1)
    );
    // The queued request runs now that the pool is free, exactly once.
    let queued_path = format!(
        "/api/agent/v1/operations/{}",
        queued["id"].as_str().unwrap()
    );
    assert!(
        eventually(async || state(&server.get(&queued_path, AGENT_SECRET).await.1) == "succeeded")
            .await
    );
    // Restored counts bind: pending is 1 of 2, so one more is admitted and the next refused.
    assert_eq!(
        server
            .submit(AGENT_SECRET, request("after-1", "demo.request", 0))
            .await
            .0,
        202
    );
    let (status, refused) = server
        .submit(AGENT_SECRET, request("after-2", "demo.request", 0))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (429, Some("client_pending_limit"))
    );
    // The interrupted run was not run again.
    let (_, running) = server.get(&running_path, AGENT_SECRET).await;
    assert_eq!(state(&running), "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_valid_file_and_keeps_the_old_config_on_an_invalid_one() {
    let dir = tempfile::tempdir().unwrap();
    let (args, config) = files(dir.path(), 1);
    let server = Server::spawn(&as_args(&args));
    assert_eq!(
        server
            .submit(AGENT_SECRET, request("a", "demo.request", 0))
            .await
            .0,
        202
    );
    let (status, body) = server
        .submit(AGENT_SECRET, request("b", "demo.request", 0))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("client_pending_limit"))
    );

    write_config(&config, 2);
    server.sighup();
    assert!(
        eventually(async || {
            server
                .metric(r#"admission_config_reloads_total{result="applied"}"#)
                .await
                == Some(1)
        })
        .await
    );
    assert_eq!(
        server
            .submit(AGENT_SECRET, request("b", "demo.request", 0))
            .await
            .0,
        202
    );

    // Invalid: pending above active. Rejected, counted, the old limits stay.
    write_config(&config, 9);
    server.sighup();
    assert!(
        eventually(async || {
            server
                .metric(r#"admission_config_reloads_total{result="rejected"}"#)
                .await
                == Some(1)
        })
        .await
    );
    let (status, body) = server
        .submit(AGENT_SECRET, request("c", "demo.request", 0))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (429, Some("client_pending_limit"))
    );
    assert_eq!(
        server
            .metric(r#"admission_config_reloads_total{result="applied"}"#)
            .await,
        Some(1)
    );
    assert_eq!(server.get("/readyz", "").await.0, 200, "still serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_secrets_generates_private_files_and_prints_only_their_paths() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::spawn(&["--data", data.to_str().unwrap()]);
    let secrets = data.join("client-secrets");
    let operator = data.join("operator-secret");
    for file in [&secrets, &operator] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", file.display());
        assert!(
            server.stdout.contains(file.to_str().unwrap()),
            "{}",
            server.stdout
        );
    }
    let text = std::fs::read_to_string(&secrets).unwrap();
    let client = text.trim().strip_prefix("default = ").unwrap().to_owned();
    let operator_secret = std::fs::read_to_string(&operator)
        .unwrap()
        .trim()
        .to_owned();
    assert!(!server.stdout.contains(&client) && !server.stdout.contains(&operator_secret));
    let (status, _) = server
        .submit(&client, request("k", "demo.request", 0))
        .await;
    assert_eq!(status, 202);
    let (status, body) = server
        .get("/api/operator/v1/requests", &operator_secret)
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["requests"].as_array().unwrap().len(), 1);
    drop(server);
    // A restart reuses them.
    let server = Server::spawn(&["--data", data.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&secrets).unwrap(), text);
    let (status, body) = server.get("/api/agent/v1/operations", &client).await;
    assert_eq!(status, 200);
    assert_eq!(body["operations"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_shows_its_broker_name_on_every_operation_and_refuses_one_out_of_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let (args, _) = files(dir.path(), 2);
    let mut named = as_args(&args);
    named.extend(["--broker-name", "lab-broker"]);
    let server = Server::spawn(&named);
    let (status, created) = server
        .submit(AGENT_SECRET, request("named", "demo.request", 0))
        .await;
    assert_eq!(
        (status, created["broker"].as_str()),
        (202, Some("lab-broker"))
    );
    let (_, page) = server.get("/api/agent/v1/operations", AGENT_SECRET).await;
    assert_eq!(page["operations"][0]["broker"], "lab-broker");
    let (status, descriptor) = server.get("/.well-known/unyolo-agent", AGENT_SECRET).await;
    assert_eq!(status, 200);
    assert_eq!(
        descriptor["contract_digest"],
        "sha256:bdc7fc2230ea7db9ede54305f2adcb3e3c21451056e58f9467fd5dbcc4a3ddc7"
    );
    drop(server);

    let too_long = "n".repeat(65);
    for bad in ["", too_long.as_str()] {
        let mut flags = as_args(&args);
        flags.extend(["--broker-name", bad]);
        let (code, stdout, stderr) = serve_fails(&flags);
        assert_eq!(code, Some(2), "{bad:?}: {stdout}\n{stderr}");
        assert!(stderr.contains("broker name"), "{stderr}");
    }
    // Without the flag, the broker is `admission`.
    let server = Server::spawn(&as_args(&args));
    let (_, read) = server
        .get(
            &format!(
                "/api/agent/v1/operations/{}",
                created["id"].as_str().unwrap()
            ),
            AGENT_SECRET,
        )
        .await;
    assert_eq!(read["broker"], "admission");
}

/// Runs `admission serve` expecting it to fail at start-up: its exit code, stdout and stderr.
fn serve_fails(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_admission"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A server that starts anyway must not hang the test.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let mut out = String::new();
            let _ = child.stdout.take().unwrap().read_to_string(&mut out);
            panic!("serve kept running:\n{out}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_on_a_data_dir_in_use_exits_1_naming_the_dir() {
    let dir = tempfile::tempdir().unwrap();
    let (args, _) = files(dir.path(), 2);
    let server = Server::spawn(&as_args(&args));
    let (status, created) = server
        .submit(AGENT_SECRET, request("a", "demo.request", 0))
        .await;
    assert_eq!(status, 202);

    let (code, stdout, stderr) = serve_fails(&as_args(&args));
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    let data = dir.path().join("data");
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains(data.to_str().unwrap())
            && stderr.contains("in use"),
        "{stderr}"
    );
    assert!(!stdout.contains("listening on"), "{stdout}");
    // The first broker still owns the dir and its operation.
    let (status, read) = server
        .get(
            &format!(
                "/api/agent/v1/operations/{}",
                created["id"].as_str().unwrap()
            ),
            AGENT_SECRET,
        )
        .await;
    assert_eq!((status, state(&read)), (200, "pending"));
    assert_eq!(
        server
            .metric(r#"admission_operations{state="pending"}"#)
            .await,
        Some(1)
    );
}

#[test]
fn an_invalid_secrets_file_stops_serve_with_its_line_and_problem_and_shows_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let operator = dir.path().join("operator");
    std::fs::write(&operator, "operator-s3cret-zz\n").unwrap();
    let cases = [
        (
            "duplicate name",
            "agent = s3cret-one\nagent = s3cret-two\n",
            "line 2: agent is already defined on line 1",
        ),
        (
            "bad name",
            "# clients\nbad name! = s3cret-three\n",
            "line 2: \"bad name!\" is not a valid identity",
        ),
        (
            "empty secret",
            "agent = s3cret-four\nother =\n",
            "line 2: the secret is empty",
        ),
        (
            "no equals sign",
            "agent s3cret-five\n",
            "line 1: expected `name = secret`",
        ),
    ];
    for (name, text, problem) in cases {
        let secrets = dir.path().join("secrets");
        std::fs::write(&secrets, text).unwrap();
        let data = dir.path().join(format!("data-{}", name.replace(' ', "-")));
        let (code, stdout, stderr) = serve_fails(&[
            "--data",
            data.to_str().unwrap(),
            "--secrets",
            secrets.to_str().unwrap(),
            "--operator-secret",
            operator.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(1), "{name}: {stderr}");
        let expected = format!("error: secrets file {}: {problem}", secrets.display());
        assert!(stderr.starts_with(&expected), "{name}: {stderr}");
        for output in [&stdout, &stderr] {
            assert!(
                !output.contains("s3cret"),
                "{name} showed a secret: {output}"
            );
        }
    }

    // A missing file, and an empty operator secret.
    let secrets = dir.path().join("secrets");
    std::fs::write(&secrets, "agent = s3cret-six\n").unwrap();
    let missing = dir.path().join("missing");
    let empty = dir.path().join("empty-operator");
    std::fs::write(&empty, "\n").unwrap();
    let data = dir.path().join("data");
    for (flag, file, expected) in [
        ("--secrets", &missing, "error: secrets file"),
        ("--operator-secret", &empty, "error: operator secret"),
    ] {
        let mut args = vec!["--data", data.to_str().unwrap()];
        if flag == "--secrets" {
            args.extend(["--secrets", file.to_str().unwrap()]);
        } else {
            args.extend(["--secrets", secrets.to_str().unwrap()]);
            args.extend(["--operator-secret", file.to_str().unwrap()]);
        }
        let (code, _, stderr) = serve_fails(&args);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.starts_with(expected) && stderr.contains(file.to_str().unwrap()),
            "{stderr}"
        );
        assert!(!stderr.contains("s3cret"), "{stderr}");
    }
}

#[test]
fn an_invalid_admission_config_stops_serve_with_the_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let (args, config) = files(dir.path(), 9); // pending 9 above active 5
    let identities = ["agent", "other"].map(|n| unyolo_admission::Identity::new(n).unwrap());
    let expected = unyolo_admission::Config::from_path(&config, identities.clone())
        .unwrap_err()
        .to_string();
    let (code, stdout, stderr) = serve_fails(&as_args(&args));
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert_eq!(stderr.trim_end(), format!("error: {expected}"));
    assert!(!stdout.contains("listening on"), "{stdout}");

    // An override for a client the secrets file does not name, and a relative path.
    std::fs::write(
        &config,
        r#"{"requests_per_window": 10, "window_seconds": 60, "client_active": 5,
            "client_pending": 2, "global_active": 100, "global_executing": 1,
            "clients": {"agnet": {"requests_per_window": 1, "window_seconds": 60,
                                  "active": 1, "pending": 1}}}"#,
    )
    .unwrap();
    let expected = unyolo_admission::Config::from_path(&config, identities)
        .unwrap_err()
        .to_string();
    assert!(expected.contains("agnet"), "{expected}");
    let (code, _, stderr) = serve_fails(&as_args(&args));
    assert_eq!(code, Some(1));
    assert_eq!(stderr.trim_end(), format!("error: {expected}"));
    let mut relative = args.clone();
    *relative.last_mut().unwrap() = "admission.json".to_owned();
    let (code, _, stderr) = serve_fails(&as_args(&relative));
    assert_eq!(code, Some(1));
    assert!(
        stderr.starts_with("error: ") && stderr.contains("absolute"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_the_log_even_at_trace_level() {
    let dir = tempfile::tempdir().unwrap();
    let (args, config) = files(dir.path(), 1);
    let server = Server::spawn_logging(&as_args(&args), "trace");
    let (status, created) = server
        .submit(AGENT_SECRET, request("a", "demo.request", 0))
        .await;
    assert_eq!(status, 202);
    // A refusal, a wrong token, the operator's routes, a reload: every kind of log line.
    assert_eq!(
        server
            .submit(AGENT_SECRET, request("b", "demo.request", 0))
            .await
            .0,
        429
    );
    assert_eq!(
        server
            .submit("not-the-secret-x9", request("c", "demo.request", 0))
            .await
            .0,
        403
    );
    let approve = format!(
        "/api/operator/v1/requests/{}/approve",
        created["id"].as_str().unwrap()
    );
    assert_eq!(server.post(&approve, OPERATOR_SECRET).await.0, 200);
    assert_eq!(server.post(&approve, AGENT_SECRET).await.0, 403);
    write_config(&config, 9);
    server.sighup();
    assert!(
        eventually(async || {
            server
                .metric(r#"admission_config_reloads_total{result="rejected"}"#)
                .await
                == Some(1)
        })
        .await
    );
    let logged = || String::from_utf8_lossy(&server.stderr.lock().unwrap()).into_owned();
    assert!(
        eventually(async || logged().contains("admission config rejected")).await,
        "{}",
        logged()
    );
    let log = logged();
    assert!(log.contains("submission refused"), "{log}");
    for secret in [
        AGENT_SECRET,
        "other-secret-4567",
        OPERATOR_SECRET,
        "not-the-secret-x9",
    ] {
        assert!(!log.contains(secret), "the log holds {secret:?}");
    }
    assert!(!server.stdout.contains(AGENT_SECRET) && !server.stdout.contains(OPERATOR_SECRET));
}
