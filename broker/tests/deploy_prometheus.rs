//! The rules under `deploy/prometheus/` are valid (`promtool check rules`), behave as their unit
//! tests say (`promtool test rules`), and agree with the broker's exposition when a real
//! Prometheus scrapes a live broker and evaluates them.
//!
//! Debian's `prometheus` package ships both binaries (`.ci/run` installs it when missing). Where
//! a binary cannot be found the test says so and skips; it never passes silently otherwise.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::broker::{ROOMY, start};
use support::http::request;
use support::redis::free_port;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET};
use support::serve::Server;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `name` on the PATH (or in /usr/bin, where Debian puts it), if there.
fn binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn skip(name: &str) {
    eprintln!(
        "SKIPPED: `{name}` is not installed (Debian: `apt-get install prometheus`; .ci/run installs it when it can)"
    );
}

fn run(program: &Path, args: &[&Path]) -> (bool, String) {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let Some(promtool) = binary("promtool") else {
        return skip("promtool");
    };
    let rules = repo("deploy/prometheus/admission.rules.yml");
    let (ok, out) = run(&promtool, &[Path::new("check"), Path::new("rules"), &rules]);
    assert!(ok, "promtool check rules:\n{out}");
    assert!(out.contains("SUCCESS"), "{out}");

    let tests: Vec<PathBuf> = std::fs::read_dir(repo("deploy/prometheus/tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yml"))
        .collect();
    assert!(
        !tests.is_empty(),
        "no rule tests in deploy/prometheus/tests"
    );
    for test in tests {
        let (ok, out) = run(&promtool, &[Path::new("test"), Path::new("rules"), &test]);
        assert!(ok, "promtool test rules {}:\n{out}", test.display());
    }
}

/// Kills and reaps the Prometheus process however the test ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The samples of an instant query: (labels, value).
async fn query(http: &reqwest::Client, base: &str, promql: &str) -> Vec<(serde_json::Value, f64)> {
    let Ok(response) = http
        .get(format!("{base}/api/v1/query"))
        .query(&[("query", promql)])
        .send()
        .await
    else {
        return Vec::new();
    };
    let Ok(body) = response.json::<serde_json::Value>().await else {
        return Vec::new();
    };
    body["data"]["result"]
        .as_array()
        .map(|samples| {
            samples
                .iter()
                .filter_map(|s| {
                    let value = s["value"][1].as_str()?.parse().ok()?;
                    Some((s["metric"].clone(), value))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_broker_and_records_the_rules() {
    let Some(prometheus) = binary("prometheus") else {
        return skip("prometheus");
    };
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path(), ROOMY).await;
    // Two of the agent's ten pending slots taken: the recording rule must say 0.2.
    for key in ["a", "b"] {
        assert_eq!(
            h.submit(AGENT_SECRET, &request(key, "demo.request", 0))
                .await
                .status,
            202
        );
    }

    let port = free_port();
    let rules = repo("deploy/prometheus/admission.rules.yml");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: admission\n    metrics_path: /metrics\n    \
             authorization:\n      credentials: {OPERATOR_SECRET}\n    \
             static_configs:\n      - targets: ['{addr}']\n",
            rules = rules.display(),
            addr = h.operator_addr(),
        ),
    )
    .unwrap();
    let tsdb = dir.path().join("tsdb");
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let child = Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", tsdb.display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("prometheus starts");
    let running = Running(child);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();

    // Bounded: a scrape and a rule evaluation each second; a minute is ample even here.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut recorded = Vec::new();
    while Instant::now() < deadline {
        recorded = query(
            &http,
            &base,
            r#"admission:client_pending:ratio{client="agent"}"#,
        )
        .await;
        if !recorded.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();
    assert_eq!(
        recorded.len(),
        1,
        "no recorded ratio within a minute; prometheus log:\n{log}"
    );
    let (labels, value) = &recorded[0];
    assert_eq!(*value, 0.2, "{labels}");
    assert_eq!(labels["job"], "admission");
    assert_eq!(labels["client"], "agent");

    // The scrape itself was authorised and healthy, and the other client's ratio is there too.
    let up = query(&http, &base, r#"up{job="admission"}"#).await;
    assert_eq!(up.iter().map(|(_, v)| *v).collect::<Vec<_>>(), [1.0]);
    let other = query(
        &http,
        &base,
        r#"admission:client_pending:ratio{client="other"}"#,
    )
    .await;
    assert_eq!(other.iter().map(|(_, v)| *v).collect::<Vec<_>>(), [0.0]);
    drop(running);
    h.broker.shutdown().await;
}

#[test]
fn serve_prints_where_its_metrics_are_and_which_rule_file_fits_them() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::spawn(None, &["--data", dir.path().to_str().unwrap()]);
    let seen: Vec<&str> = server.stdout.lines().collect();
    // On the operator listener, not the agents'.
    let addr = &server.operator_addr;
    assert_ne!(addr, &server.addr.to_string());
    assert!(
        seen.iter()
            .any(|l| l.starts_with(&format!("metrics: http://{addr}/metrics"))),
        "{seen:?}"
    );
    let rules_line = seen
        .iter()
        .find(|l| l.starts_with("rules for these metrics: "))
        .expect("a rules line");
    let rules = rules_line
        .strip_prefix("rules for these metrics: ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap();
    assert!(repo(rules).is_file(), "{rules} is not in the repository");
    let dashboard = rules_line
        .split("(dashboard: ")
        .nth(1)
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap();
    assert!(
        repo(dashboard).is_file(),
        "{dashboard} is not in the repository"
    );
}
