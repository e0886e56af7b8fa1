//! A `kill -9` of the real `admission serve` in the middle of a burst of clients that hang up:
//! after the restart the controller's counts equal the store (drift 0, on the operator route and
//! in the gauge), every stored request replays, and the operator can decide the whole inbox.
#![cfg(feature = "broker")]

mod broker_support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use broker_support::faults::*;
use broker_support::*;
use serde_json::Value;

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
