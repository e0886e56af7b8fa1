//! A `kill -9` of the real `admission serve` in the middle of a burst of clients that hang up:
//! after the restart the controller's counts equal the store (drift 0, on the operator route and
//! in the gauge), every stored request replays, and the operator can decide the whole inbox. And
//! one in the middle of a stream of creations the store commits in groups: every `202` answered
//! has its row after the restart.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use support::broker::{on_postgres, serve_args};
use support::eventually::eventually;
use support::faults::*;
use support::http::request;
use support::secrets::AGENT_SECRET;
use support::serve::{Files, Server};

async fn drift_of(server: &Server) -> serde_json::Value {
    server.operator.drift().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_in_the_middle_of_a_hang_up_burst_restarts_with_counts_equal_to_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    let data = files.data.clone();
    let server = Server::spawn_logging(None, "warn", &serve_args(&files));
    let mut to_decide = Vec::new();
    for i in 0..6 {
        let op = server
            .submit(
                AGENT_SECRET,
                &request(&format!("before-{i}"), "demo.request", 0),
            )
            .await;
        assert_eq!(op.status, 202, "{}", op.body);
        to_decide.push(op.id());
    }
    let mut streams = Vec::new();
    let http = reqwest::Client::new();
    for _ in 0..4 {
        let response = http
            .post(format!("{}{STREAMS}", server.base))
            .bearer_auth(AGENT_SECRET)
            .body(vec![3u8; 512])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 201);
        let body: serde_json::Value = response.json().await.unwrap();
        streams.push(body["id"].as_str().unwrap().to_owned());
    }
    let mut bodies = BTreeMap::new();
    let requests = everything(
        "crash",
        &(to_decide[..3].to_vec(), to_decide[3..].to_vec(), streams),
        &mut bodies,
    );
    // The kill lands once the first half of the burst has been sent, the rest meets a dead port.
    let addr = Listeners::of_server(&server);
    let (first, second) = requests.split_at(requests.len() / 2);
    let (first, second) = (first.to_vec(), second.to_vec());
    let late = tokio::spawn(async move {
        hang_up_all(addr, second).await;
    });
    hang_up_all(addr, first).await;
    drop(server); // SIGKILL
    late.await.unwrap();

    let files_before_restart = files_on_disk(&data);
    let server = Server::spawn_logging(None, "warn", &serve_args(&files));
    let report = drift_of(&server).await;
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(server.metric("admission_store_drift").await, Some(0));
    if on_postgres() {
        // The bodies are the store's rows: none of them is on the data dir's disk.
        assert_eq!(files_on_disk(&data), 0);
    } else {
        assert_eq!(files_on_disk(&data), stored(&data).streams);
    }
    assert!(files_on_disk(&data) <= files_before_restart);
    // Every stored operation replays; every request in the inbox is decidable.
    for key in stored(&data).keys {
        if let Some(body) = bodies.get(&key) {
            let op = server.submit(AGENT_SECRET, body).await;
            assert_eq!(op.status, 200, "replay of {key}: {}", op.body);
        }
    }
    let ids = server.operator.pending().await;
    for (i, id) in ids.iter().enumerate() {
        let decision = if i % 2 == 0 { "approve" } else { "deny" };
        let reply = server.operator.act(id, decision).await;
        assert_eq!(reply.status, 200, "{decision} {id}: {}", reply.body);
    }
    let drained = eventually(async || {
        let s = stored(&data);
        s.states.get("pending").copied().unwrap_or(0) == 0
            && s.states.get("approved").copied().unwrap_or(0) == 0
            && s.states.get("executing").copied().unwrap_or(0) == 0
    })
    .await;
    assert!(drained, "{:?}", stored(&data).states);
    let report = drift_of(&server).await;
    assert_eq!(report["drift"], 0, "{report}");
    drop(server);
}

/// Limits that never refuse the creation stream: `demo.run` (0 ms) ends as soon as it starts.
const STREAM_LIMITS: &str = r#"{"requests_per_window": 1000000, "window_seconds": 1,
  "client_active": 1000, "client_pending": 10, "global_active": 1000,
  "global_executing": 1000}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_during_grouped_creations_keeps_every_answered_row_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), STREAM_LIMITS);
    let data = files.data.clone();
    let server = Server::spawn_logging(None, "warn", &serve_args(&files));
    let http = reqwest::Client::new();
    let url = format!("{}{OPERATIONS}", server.base);
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(Mutex::new(Vec::new()));
    // 32 clients at once: their creations reach the writer together and commit in groups.
    let mut clients = Vec::new();
    for _ in 0..32 {
        let (http, url, next, answered) = (
            http.clone(),
            url.clone(),
            Arc::clone(&next),
            Arc::clone(&answered),
        );
        clients.push(tokio::spawn(async move {
            loop {
                let key = format!("grouped-{}", next.fetch_add(1, Ordering::Relaxed));
                let sent = http
                    .post(&url)
                    .bearer_auth(AGENT_SECRET)
                    .json(&request(&key, "demo.run", 0))
                    .send()
                    .await;
                // The kill: the connection fails, and this client stops.
                let Ok(reply) = sent else { return };
                let status = reply.status().as_u16();
                let Ok(body) = reply.text().await else { return };
                assert_eq!(status, 202, "{key}: {body}");
                answered.lock().unwrap().push(key);
            }
        }));
    }
    let streaming = eventually(async || answered.lock().unwrap().len() >= 300).await;
    assert!(streaming, "the creations did not stream");
    drop(server); // SIGKILL, with creations in flight
    for client in clients {
        client.await.unwrap();
    }
    let answered: BTreeSet<String> = answered.lock().unwrap().iter().cloned().collect();
    let sent = next.load(Ordering::Relaxed);

    let server = Server::spawn_logging(None, "warn", &serve_args(&files));
    let rows: BTreeSet<String> = stored(&data).keys.into_iter().collect();
    let lost: Vec<&String> = answered.difference(&rows).collect();
    assert!(lost.is_empty(), "answered 202 but not stored: {lost:?}");
    let strangers: Vec<&String> = rows
        .iter()
        .filter(|key| {
            key.strip_prefix("grouped-")
                .and_then(|n| n.parse::<usize>().ok())
                .is_none_or(|n| n >= sent)
        })
        .collect();
    assert!(
        strangers.is_empty(),
        "rows no request asked for: {strangers:?}"
    );
    // Counts = rows: the restarted controller agrees with the store.
    let report = drift_of(&server).await;
    assert_eq!(report["drift"], 0, "{report}");
    let states = stored(&data).states;
    assert_eq!(
        states.values().sum::<u64>(),
        rows.len() as u64,
        "{states:?}"
    );
    // Every answered creation replays as the one stored.
    for key in answered.iter().take(20) {
        let op = server
            .submit(AGENT_SECRET, &request(key, "demo.run", 0))
            .await;
        assert_eq!(op.status, 200, "replay of {key}: {}", op.body);
    }
    drop(server);
}
