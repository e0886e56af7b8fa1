//! A `kill -9` of the real `admission serve` in the middle of a burst of clients that hang up:
//! after the restart the controller's counts equal the store (drift 0, on the operator route and
//! in the gauge), every stored request replays, and the operator can decide the whole inbox.
#![cfg(feature = "broker")]

mod support;

use std::collections::BTreeMap;

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
    let server = Server::spawn_logging(None, "warn", &files.args());
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
    let server = Server::spawn_logging(None, "warn", &files.args());
    let report = drift_of(&server).await;
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(server.metric("admission_store_drift").await, Some(0));
    assert_eq!(files_on_disk(&data), stored(&data).streams);
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
