//! The `admission serve` binary as an operator runs it: crash (`kill -9`) and restart on the same
//! data dir, `SIGHUP` reload, generated secrets.

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::eventually::eventually;
use support::http::{Reply, request};
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use support::serve::{Exit, Files, Server, run_to_end};

/// Writes the secrets, operator secret and a quota file; returns their paths as flags.
fn files(dir: &Path, pending: u32) -> (Vec<String>, PathBuf) {
    let files = Files::write(dir, &limits(pending));
    (files.args(), files.config)
}

/// Roomy limits but `pending` per client and one execution slot.
fn limits(pending: u32) -> String {
    format!(
        r#"{{"requests_per_window": 1000, "window_seconds": 60, "client_active": 5,
                "client_pending": {pending}, "global_active": 100, "global_executing": 1}}"#
    )
}

fn write_config(path: &Path, pending: u32) {
    std::fs::write(path, limits(pending)).unwrap();
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
    let server = Server::spawn(None, &as_args(&args));
    let Reply { body: pending, .. } = server
        .submit(AGENT_SECRET, &request("pending", "demo.request", 0))
        .await;
    let Reply { body: done, .. } = server
        .submit(AGENT_SECRET, &request("done", "demo.request", 0))
        .await;
    let deny = server.operator.deny(done["id"].as_str().unwrap()).await;
    assert_eq!(deny.status, 200, "{}", deny.body);
    let Reply { body: queued, .. } = server
        .submit(AGENT_SECRET, &request("queued", "demo.request", 100))
        .await;
    let Reply {
        status,
        body: running,
        ..
    } = server
        .submit(AGENT_SECRET, &request("running", "demo.run", 60_000))
        .await;
    assert_eq!(status, 202);
    let running_path = format!(
        "/api/agent/v1/operations/{}",
        running["id"].as_str().unwrap()
    );
    assert!(
        eventually(
            async || state(&server.get(&running_path, AGENT_SECRET).await.body) == "executing"
        )
        .await
    );
    // The pool (1) is busy, so the approved request waits in the queue.
    let approve = server
        .operator
        .approve(queued["id"].as_str().unwrap())
        .await;
    assert_eq!(approve.status, 200, "{}", approve.body);
    assert_eq!(
        server
            .metric(r#"admission_operations{state="queued"}"#)
            .await,
        Some(1)
    );

    drop(server); // SIGKILL: no shutdown path runs.

    let server = Server::spawn(None, &as_args(&args));
    assert!(
        server
            .stdout
            .contains("restored: 1 pending, 1 approved, 1 interrupted, 0 streams"),
        "{}",
        server.stdout
    );
    let Reply { body: listed, .. } = server.get("/api/agent/v1/operations", AGENT_SECRET).await;
    let ops = listed["operations"].as_array().unwrap();
    assert_eq!(ops.len(), 4, "every operation survived");
    let Reply { body: running, .. } = server.get(&running_path, AGENT_SECRET).await;
    assert_eq!(state(&running), "failed");
    assert_eq!(running["error"]["code"], "execution_interrupted");
    assert!(running["terminal_at"].is_string());
    let Reply { body: pending, .. } = server
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
    let Reply {
        status,
        body: replayed,
        ..
    } = server
        .submit(AGENT_SECRET, &request("pending", "demo.request", 0))
        .await;
    assert_eq!((status, &replayed["id"]), (200, &pending["id"]));
    let Reply {
        status, body: _, ..
    } = server
        .submit(AGENT_SECRET, &request("pending", "demo.request", 5))
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
        eventually(
            async || state(&server.get(&queued_path, AGENT_SECRET).await.body) == "succeeded"
        )
        .await
    );
    // Restored counts bind: pending is 1 of 2, so one more is admitted and the next refused.
    assert_eq!(
        server
            .submit(AGENT_SECRET, &request("after-1", "demo.request", 0))
            .await
            .status,
        202
    );
    let Reply {
        status,
        body: refused,
        ..
    } = server
        .submit(AGENT_SECRET, &request("after-2", "demo.request", 0))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (429, Some("client_pending_limit"))
    );
    // The interrupted run was not run again.
    let Reply { body: running, .. } = server.get(&running_path, AGENT_SECRET).await;
    assert_eq!(state(&running), "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_valid_file_and_keeps_the_old_config_on_an_invalid_one() {
    let dir = tempfile::tempdir().unwrap();
    let (args, config) = files(dir.path(), 1);
    let server = Server::spawn(None, &as_args(&args));
    assert_eq!(
        server
            .submit(AGENT_SECRET, &request("a", "demo.request", 0))
            .await
            .status,
        202
    );
    let Reply { status, body, .. } = server
        .submit(AGENT_SECRET, &request("b", "demo.request", 0))
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
            .submit(AGENT_SECRET, &request("b", "demo.request", 0))
            .await
            .status,
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
    let Reply { status, body, .. } = server
        .submit(AGENT_SECRET, &request("c", "demo.request", 0))
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
    assert_eq!(server.get("/readyz", "").await.status, 200, "still serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_secrets_generates_private_files_and_prints_only_their_paths() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::spawn(None, &["--data", data.to_str().unwrap()]);
    let secrets = data.join("client-secrets");
    let operator = data.join("operator-secrets");
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
    let operator_text = std::fs::read_to_string(&operator).unwrap();
    let operator_secret = operator_text
        .trim()
        .strip_prefix("operator = ")
        .unwrap()
        .to_owned();
    assert!(operator_secret.len() >= 32, "{operator_secret}");
    assert!(!server.stdout.contains(&client) && !server.stdout.contains(&operator_secret));
    // Written under a temporary name and linked into place: nothing of that is left.
    let leftovers: Vec<String> = std::fs::read_dir(&data)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let Reply {
        status, body: _, ..
    } = server
        .submit(&client, &request("k", "demo.request", 0))
        .await;
    assert_eq!(status, 202);
    let inbox = server
        .operator
        .with_secret(&operator_secret)
        .get("/api/operator/v1/requests")
        .await;
    assert_eq!(inbox.status, 200);
    assert_eq!(inbox.body["requests"].as_array().unwrap().len(), 1);
    assert_eq!(
        inbox.body["requests"][0]["requester"], "default",
        "{}",
        inbox.body
    );
    drop(server);
    // A restart reuses them.
    let server = Server::spawn(None, &["--data", data.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&secrets).unwrap(), text);
    let Reply { status, body, .. } = server.get("/api/agent/v1/operations", &client).await;
    assert_eq!(status, 200);
    assert_eq!(body["operations"].as_array().unwrap().len(), 1);
}

#[test]
fn serve_refuses_a_client_secrets_file_with_no_client() {
    // An empty file (left by a crash, say) is not read as a broker no client can use.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let secrets = data.join("client-secrets");
    for text in ["", "# nobody yet\n\n"] {
        std::fs::write(&secrets, text).unwrap();
        let out = support::serve::run_to_end(&["--data".to_owned(), data.display().to_string()]);
        assert_eq!(out.code, Some(1), "{}", out.stderr);
        assert!(
            out.stderr.contains(&format!(
                "secrets file {}: no client; give at least one `name = secret` line",
                secrets.display()
            )),
            "{}",
            out.stderr
        );
        assert!(!out.stdout.contains("listening on"), "{}", out.stdout);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_shows_its_broker_name_on_every_operation_and_refuses_one_out_of_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let (args, _) = files(dir.path(), 2);
    let mut named = as_args(&args);
    named.extend(["--broker-name", "lab-broker"]);
    let server = Server::spawn(None, &named);
    let Reply {
        status,
        body: created,
        ..
    } = server
        .submit(AGENT_SECRET, &request("named", "demo.request", 0))
        .await;
    assert_eq!(
        (status, created["broker"].as_str()),
        (202, Some("lab-broker"))
    );
    let Reply { body: page, .. } = server.get("/api/agent/v1/operations", AGENT_SECRET).await;
    assert_eq!(page["operations"][0]["broker"], "lab-broker");
    let Reply {
        status,
        body: descriptor,
        ..
    } = server.get("/.well-known/unyolo-agent", AGENT_SECRET).await;
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
        let Exit {
            code,
            stdout,
            stderr,
        } = run_to_end(&flags);
        assert_eq!(code, Some(2), "{bad:?}: {stdout}\n{stderr}");
        assert!(stderr.contains("broker name"), "{stderr}");
    }
    // Without the flag, the broker is `admission`.
    let server = Server::spawn(None, &as_args(&args));
    let Reply { body: read, .. } = server
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_on_a_data_dir_in_use_exits_1_naming_the_dir() {
    let dir = tempfile::tempdir().unwrap();
    let (args, _) = files(dir.path(), 2);
    let server = Server::spawn(None, &as_args(&args));
    let Reply {
        status,
        body: created,
        ..
    } = server
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(status, 202);

    let Exit {
        code,
        stdout,
        stderr,
    } = run_to_end(&as_args(&args));
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
    let Reply {
        status, body: read, ..
    } = server
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
    std::fs::write(&operator, "ada = operator-s3cret-zz-0123456789abcdef\n").unwrap();
    let cases = [
        (
            "duplicate name",
            "agent = s3cret-one\nagent = s3cret-two\n",
            "line 2: agent is already defined on line 1",
        ),
        (
            "bad name",
            "# clients\nbad name! = s3cret-three\n",
            "line 2: the name before '=' is not a valid identity: it holds ' ', '!'",
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
        let Exit {
            code,
            stdout,
            stderr,
        } = run_to_end(&[
            "--data",
            data.to_str().unwrap(),
            "--secrets",
            secrets.to_str().unwrap(),
            "--operator-secrets",
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
        ("--operator-secrets", &empty, "error: operator secrets"),
    ] {
        let mut args = vec!["--data", data.to_str().unwrap()];
        if flag == "--secrets" {
            args.extend(["--secrets", file.to_str().unwrap()]);
        } else {
            args.extend(["--secrets", secrets.to_str().unwrap()]);
            args.extend(["--operator-secrets", file.to_str().unwrap()]);
        }
        let Exit { code, stderr, .. } = run_to_end(&args);
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
    let Exit {
        code,
        stdout,
        stderr,
    } = run_to_end(&as_args(&args));
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
    let Exit { code, stderr, .. } = run_to_end(&as_args(&args));
    assert_eq!(code, Some(1));
    assert_eq!(stderr.trim_end(), format!("error: {expected}"));
    let mut relative = args.clone();
    *relative.last_mut().unwrap() = "admission.json".to_owned();
    let Exit { code, stderr, .. } = run_to_end(&as_args(&relative));
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
    let server = Server::spawn_logging(None, "trace", &as_args(&args));
    let Reply {
        status,
        body: created,
        ..
    } = server
        .submit(AGENT_SECRET, &request("a", "demo.request", 0))
        .await;
    assert_eq!(status, 202);
    // A refusal, a wrong token, the operator's routes, a reload: every kind of log line.
    assert_eq!(
        server
            .submit(AGENT_SECRET, &request("b", "demo.request", 0))
            .await
            .status,
        429
    );
    assert_eq!(
        server
            .submit("not-the-secret-x9", &request("c", "demo.request", 0))
            .await
            .status,
        403
    );
    let id = created["id"].as_str().unwrap();
    assert_eq!(server.operator.approve(id).await.status, 200);
    let stranger = server.operator.with_secret(AGENT_SECRET);
    assert_eq!(stranger.approve(id).await.status, 401);
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
    let logged = || server.logged();
    assert!(
        eventually(async || logged().contains("admission config rejected")).await,
        "{}",
        logged()
    );
    let log = logged();
    assert!(log.contains("submission refused"), "{log}");
    for secret in [
        AGENT_SECRET,
        OTHER_SECRET,
        OPERATOR_SECRET,
        "not-the-secret-x9",
    ] {
        assert!(!log.contains(secret), "the log holds {secret:?}");
    }
    assert!(!server.stdout.contains(AGENT_SECRET) && !server.stdout.contains(OPERATOR_SECRET));
}
