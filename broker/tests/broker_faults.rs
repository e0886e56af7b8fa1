//! Faults (SPEC section 6) against an in-process broker on real SQLite: clients that send a whole
//! request and hang up at once, and a store that another connection holds locked (the `kill -9`
//! of the real binary is in `broker_faults_crash.rs`; the helpers in `support/faults.rs`).
//! Each test ends with the controller's counts equal to the store (drift 0) and the operator able
//! to decide everything in the inbox. Drift readings taken *during* the bursts must be 0 too: a
//! reading never catches a change half made.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use support::broker::{settings, start_with};
use support::eventually::eventually;
use support::faults::*;
use support::http::request;
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET, OTHER, OTHER_SECRET};
use unyolo_admission::StorageCaps;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_whose_clients_hang_up_are_counted_exactly_as_stored_and_all_decidable() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let mut bodies = BTreeMap::new();
    burst_watching_drift(&h, submissions("gone", 40, &mut bodies)).await;
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_every_key_replays(&h, dir.path(), &bodies).await;
    ends_whole(&h, dir.path()).await;
    // Capacity that the hung-up submissions held is free again: a new request is admitted.
    let fresh = h
        .submit(AGENT_SECRET, &request("after", "demo.request", 0))
        .await;
    assert_eq!(fresh.status, 202, "{}", fresh.body);
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_and_denials_whose_operator_hangs_up_are_made_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "decide", 10).await;
    burst_watching_drift(&h, decisions(&ids)).await;
    quiet(&h, dir.path()).await;
    for id in &ids {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert!(
            ["pending", "approved", "executing", "succeeded", "denied"].contains(&op.state()),
            "{}",
            op.body
        );
    }
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_whose_client_hangs_up_release_exactly_what_the_store_released() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "cancel", 8).await;
    // Two long runs fill the execution pool, so approved work stays queued.
    let mut long = Vec::new();
    for i in 0..2 {
        let reply = h
            .submit(
                AGENT_SECRET,
                &request(&format!("long-{i}"), "demo.run", 600_000),
            )
            .await;
        assert_eq!(reply.status, 202, "{}", reply.body);
        long.push(reply.id());
    }
    assert!(eventually(async || h.snapshot().executing == 2).await);
    for id in &ids[..4] {
        let approved = h.operator.approve(id).await;
        assert_eq!(approved.status, 200);
    }
    assert_eq!(h.snapshot().queued, 4);
    let mut targets = ids.clone();
    targets.extend(long.iter().cloned());
    burst_watching_drift(&h, cancels(&targets)).await;
    quiet(&h, dir.path()).await;
    for id in &long {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert_eq!(
            op.state(),
            "executing",
            "an executing run is not cancelable"
        );
    }
    for id in &ids {
        let op = h
            .get(&format!("{OPERATIONS}/{id}"), Some(AGENT_SECRET))
            .await;
        assert!(
            ["pending", "approved", "canceled"].contains(&op.state()),
            "{}",
            op.body
        );
    }
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    decide_the_inbox(&h).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_whose_client_hangs_up_leave_no_file_without_a_row_and_no_room_held() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    // 40 uploads against a per-client cap of 16 files; half are cut short.
    burst_watching_drift(&h, uploads(40, 1024)).await;
    ends_whole(&h, dir.path()).await;
    let stream_files = h.snapshot().storage[0].files;
    assert_eq!(stream_files, stored(dir.path()).streams);
    assert!(stream_files <= 16);
    // Everything stored can be deleted, and the room comes back to zero.
    let ids: Vec<String> = h
        .broker
        .database()
        .stream_ids()
        .await
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    for id in ids {
        let reply = h
            .send(
                "DELETE",
                &format!("{STREAMS}/{id}"),
                Some(AGENT_SECRET),
                None,
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    assert!(h.snapshot().is_idle(), "{:?}", h.snapshot());
    assert_eq!(files_on_disk(dir.path()), 0);
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_whose_client_hangs_up_remove_row_file_and_room_together() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let mut ids = Vec::new();
    for _ in 0..12 {
        ids.push(upload(&h, 2048).await);
    }
    // Each delete twice: the second races the first.
    let mut requests = deletes(&ids);
    requests.extend(deletes(&ids));
    burst_watching_drift(&h, requests).await;
    ends_whole(&h, dir.path()).await;
    for id in &ids {
        let reply = h
            .send(
                "DELETE",
                &format!("{STREAMS}/{id}"),
                Some(AGENT_SECRET),
                None,
            )
            .await;
        assert!(
            reply.status == 200 || reply.code() == "stream_not_found",
            "{}",
            reply.body
        );
    }
    assert!(h.snapshot().is_idle(), "{:?}", h.snapshot());
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_ups_while_another_process_holds_the_store_locked_change_nothing_half_way() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let prepared = prepare(&h, "locked").await;
    let mut bodies = BTreeMap::new();
    let requests = everything("locked", &prepared, &mut bodies);
    let holder = lock_store(dir.path(), Duration::from_secs(1));
    burst_watching_drift(&h, requests).await;
    holder.join().unwrap();
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_every_key_replays(&h, dir.path(), &bodies).await;
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_admitted_before_their_clients_hang_up_are_created_once_the_store_frees() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let bodies: Vec<Value> = (0..4)
        .map(|i| request(&format!("admitted-{i}"), "demo.request", 0))
        .collect();
    let store_lock = StoreLock::take(dir.path());
    // Each request is sent whole on a connection kept open until the controller has admitted it:
    // its creation is then waiting on the locked store.
    let mut open = Vec::new();
    for body in &bodies {
        use tokio::io::AsyncWriteExt;
        let text = body.to_string();
        let mut stream = tokio::net::TcpStream::connect(h.broker.local_addr())
            .await
            .unwrap();
        let head = format!(
            "POST {OPERATIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_SECRET}\r\n\
             Content-Length: {}\r\n\r\n{text}",
            text.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        open.push(stream);
    }
    assert!(eventually(async || h.snapshot().pending == 4).await);
    drop(open);
    store_lock.release();
    for body in &bodies {
        let reply = h.submit(AGENT_SECRET, body).await;
        assert_eq!(
            reply.status, 200,
            "created by the hung-up request: {}",
            reply.body
        );
    }
    assert_eq!(stored(dir.path()).states.get("pending"), Some(&4));
    assert_counts_match_the_store(&h, dir.path()).await;
    assert_eq!(decide_the_inbox(&h).await, 4);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_written_behind_the_brokers_back_is_reported_as_drift_on_the_timer_and_on_demand() {
    if !support::broker::sqlite_only("writes a row into the SQLite file behind the broker's back") {
        return;
    }
    use unyolo_admission_broker::{Difference, DriftCount};
    let dir = tempfile::tempdir().unwrap();
    let mut settings = settings(dir.path(), LIMITS, StorageCaps::default());
    settings.drift_interval = Duration::from_millis(50);
    // The row without a file is the drift this test makes; no sweep may reconcile it away.
    settings.retention.sweep_interval = Duration::ZERO;
    let h = start_with(settings).await;
    assert!(h.broker.check_drift().await.unwrap().is_clean());
    let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
    conn.busy_timeout(Duration::from_secs(30)).unwrap();
    conn.execute(
        "INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, \
         reason, state, created_at, updated_at) VALUES ('op_behind', 'agent', 'behind', \
         'demo.request', '{}', '{}', 'written by hand', 'pending', '2026-01-01T00:00:00Z', \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO streams (id, client_id, size, created_at) VALUES ('st_behind', 'other', 100, \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    // Pending and active, for the client and globally: 4; files 1 and bytes 100, for the client
    // and globally: 202.
    let seen =
        eventually(async || metric(&h.metrics().await, "admission_store_drift") == Some(4 + 202))
            .await;
    assert!(seen, "{}", h.metrics().await);
    let report = h.broker.check_drift().await.unwrap();
    assert_eq!(report.total(), 206);
    assert!(report.differences.contains(&Difference {
        client: Some(AGENT.to_owned()),
        count: DriftCount::Pending,
        controller: 0,
        store: 1,
    }));
    let route = h.operator.get("/admission/v1/drift").await;
    assert_eq!(route.body["drift"], 206);
    assert!(
        route.body["differences"].as_array().unwrap().contains(
            &json!({"client": OTHER, "count": "stream_bytes", "controller": 0, "store": 100})
        ),
        "{}",
        route.body
    );
    let agent_only = h
        .operator_with(AGENT_SECRET)
        .get("/admission/v1/drift")
        .await;
    assert_eq!(agent_only.status, 401, "the drift route is the operator's");
    let agent_listener = h.get("/admission/v1/drift", Some(AGENT_SECRET)).await;
    assert_eq!(agent_listener.status, 404, "not on the agent listener");
    conn.execute("DELETE FROM operations WHERE id = 'op_behind'", [])
        .unwrap();
    conn.execute("DELETE FROM streams WHERE id = 'st_behind'", [])
        .unwrap();
    let cleared =
        eventually(async || metric(&h.metrics().await, "admission_store_drift") == Some(0)).await;
    assert!(cleared, "{}", h.metrics().await);
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_start_up_cannot_restore_is_drift_from_the_first_reading() {
    if !support::broker::sqlite_only("writes a row into the SQLite file behind the broker's back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    h.broker.shutdown().await;
    let conn = rusqlite::Connection::open(dir.path().join("admission.sqlite3")).unwrap();
    conn.execute(
        "INSERT INTO operations (id, client_id, idempotency_key, operation, target, arguments, \
         reason, state, created_at, updated_at) VALUES ('op_orphan', 'not a valid id!', 'k', \
         'demo.request', '{}', '{}', 'written by hand', 'approved', '2026-01-01T00:00:00Z', \
         '2026-01-01T00:00:00Z')",
        [],
    )
    .unwrap();
    drop(conn);
    let mut settings = settings(dir.path(), LIMITS, StorageCaps::default());
    settings.drift_interval = Duration::from_secs(3600);
    let h = start_with(settings).await;
    // Queued and active, for that client and globally, from the start-up reading alone.
    assert_eq!(metric(&h.metrics().await, "admission_store_drift"), Some(4));
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_the_locked_store_cannot_record_waits_for_the_store_and_then_runs() {
    let dir = tempfile::tempdir().unwrap();
    let one_slot = LIMITS.replace(r#""global_executing": 2"#, r#""global_executing": 1"#);
    let h = start_with(settings(dir.path(), &one_slot, StorageCaps::default())).await;
    let queued = create_pending(&h, "start", 1).await.remove(0);
    let long = h
        .submit(AGENT_SECRET, &request("long", "demo.run", 600_000))
        .await;
    assert_eq!(long.status, 202, "{}", long.body);
    assert!(eventually(async || h.snapshot().executing == 1).await);
    let approved = h.operator.approve(&queued).await;
    assert_eq!(approved.status, 200);
    assert_eq!(h.snapshot().queued, 1);
    // Longer than the broker's busy timeout (5 s), so its first attempt to record the start
    // fails; then a second slot opens and the executor tries at once.
    let holder = lock_store(dir.path(), Duration::from_secs(6));
    let config = dir.path().join("two-slots.json");
    std::fs::write(&config, LIMITS).unwrap();
    h.broker.reload_from_path(&config).unwrap();
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    let path = format!("{OPERATIONS}/{queued}");
    let ran = eventually(async || {
        let state = h.get(&path, Some(AGENT_SECRET)).await.state().to_owned();
        state == "succeeded" || state == "failed"
    })
    .await;
    assert!(ran);
    let op = h.get(&path, Some(AGENT_SECRET)).await;
    assert_eq!(op.state(), "succeeded", "{}", op.body);
    assert_counts_match_the_store(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// A small tmpfs mounted for one test, unmounted when dropped (lazily: a file the broker still
/// holds open does not keep it busy).
struct SmallDisk {
    root: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    /// A tmpfs of `mib` MiB, or why one cannot be had (mounting needs root, or the capability).
    fn mount(mib: u64) -> Result<SmallDisk, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let root = dir.path().join("disk");
        std::fs::create_dir(&root).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&root)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(SmallDisk { root, _dir: dir })
    }

    /// Writes `filler` until the disk is full; returns its length.
    fn fill(&self, filler: &std::path::Path) -> u64 {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(filler)
            .unwrap();
        for chunk in [1 << 20, 4096, 1] {
            let bytes = vec![0u8; chunk];
            while file.write_all(&bytes).and_then(|()| file.flush()).is_ok() {}
        }
        file.sync_all().ok();
        std::fs::metadata(filler).unwrap().len()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.root)
            .status();
    }
}

/// `/readyz` on both listeners: the agent's status and code, the operator's status.
async fn readiness(h: &support::broker::Harness) -> (u16, String, u16) {
    let agent = h.get("/readyz", None).await;
    let operator = h.operator.send_raw("GET", "/readyz", None, None).await;
    (agent.status, agent.code().to_owned(), operator.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_takes_the_broker_out_of_rotation_before_writes_fail_and_refuses_without_a_trace()
 {
    if !support::broker::sqlite_only(
        "the free space of the data dir's disk, where the SQLite file is",
    ) {
        return;
    }
    let disk = match SmallDisk::mount(24) {
        Ok(disk) => disk,
        Err(why) => {
            eprintln!("SKIPPED: this test needs a small filesystem of its own: {why}");
            return;
        }
    };
    let data = disk.root.join("data");
    let h = start_tight(&data).await;
    let first = h
        .submit(AGENT_SECRET, &request("roomy", "demo.run", 0))
        .await;
    assert_eq!(first.status, 202, "{}", first.body);
    assert_eq!(readiness(&h).await, (200, "-".to_owned(), 200));
    assert_eq!(metric(&h.metrics().await, "broker_store_ready"), Some(1));

    // Less free than a write may need (MIN_FREE_BYTES, 8 MiB), though small writes still fit:
    // not ready, so a load balancer stops sending before SQLite fails a write half-way.
    let filler = disk.root.join("filler");
    let full = disk.fill(&filler);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap()
        .set_len(full - (2 << 20))
        .unwrap();
    assert_eq!(
        readiness(&h).await,
        (503, "store_unavailable".to_owned(), 503)
    );
    let agent = h.get("/readyz", None).await;
    assert_eq!(
        agent.body["error"]["message"], "The operation store's disk has no room for a write.",
        "{}",
        agent.body
    );
    assert_eq!(metric(&h.metrics().await, "broker_store_ready"), Some(0));

    // No room at all: a submission is refused as the store's failure, and nothing of it is
    // created, counted or spent.
    disk.fill(&filler);
    let rows = h.rows().await;
    let before = h.snapshot();
    let mut big = request("no-room", "demo.run", 0);
    big["arguments"]["blob"] = json!("x".repeat(256 * 1024));
    let refused = h.submit(AGENT_SECRET, &big).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.code(), "store_unavailable", "{}", refused.body);
    assert_eq!(h.rows().await, rows);
    // Admission admitted it before the write failed, and `admission_requests_total` counts that
    // decision (a counter never goes back); every count and the rate token are given back.
    let mut after = h.snapshot();
    assert_eq!(after.admitted, before.admitted + 1);
    after.admitted = before.admitted;
    after.clients[0].admitted = before.clients[0].admitted;
    support::broker::assert_unchanged(&before, &after, "a submission on a full disk");
    // A stream upload neither: no file, no row, no bytes counted.
    let stream = h
        .send(
            "POST",
            STREAMS,
            Some(AGENT_SECRET),
            Some(vec![7u8; 64 * 1024].into()),
        )
        .await;
    assert_eq!(stream.status, 503, "{}", stream.body);
    assert_eq!(files_on_disk(&data), 0);
    assert_eq!(stored(&data).streams, 0);
    assert_eq!(h.snapshot().storage, before.storage);

    // Room again: ready, and the same key is new work, not a replay.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(readiness(&h).await, (200, "-".to_owned(), 200));
    let created = h.submit(AGENT_SECRET, &big).await;
    assert_eq!(created.status, 202, "{}", created.body);
    upload(&h, 64 * 1024).await;
    quiet(&h, &data).await;
    assert_counts_match_the_store(&h, &data).await;
    assert_eq!(metric(&h.metrics().await, "broker_store_ready"), Some(1));
    h.broker.shutdown().await;
    drop(disk);
}

/// A replay never waits on another submission (SPEC section 2: replay is exempt from admission
/// and never waits on it). Here another client's submission is admitted and its creation waits
/// on a store another process holds locked — under a key that, when submissions were serialized
/// by 64 striped locks, shared the replayed key's lock. The replay is answered while that
/// creation still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_while_another_clients_creation_waits_on_a_locked_store() {
    use std::hash::{Hash, Hasher};
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(settings(
        dir.path(),
        support::broker::ROOMY,
        StorageCaps::default(),
    ))
    .await;
    let replayed = request("k1", "demo.request", 0);
    assert_eq!(h.submit(AGENT_SECRET, &replayed).await.status, 202);
    // A key of the other client that the striped table put under k1's lock.
    let stripe = |client: &str, key: &str| {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (client, key).hash(&mut hasher);
        hasher.finish() % 64
    };
    let shared = (0..)
        .map(|n| format!("x{n}"))
        .find(|key| stripe(OTHER, key) == stripe(AGENT, "k1"))
        .unwrap();

    let store_lock = StoreLock::take(dir.path());
    let h = std::sync::Arc::new(h);
    let waiting = {
        let h = std::sync::Arc::clone(&h);
        let body = request(&shared, "demo.request", 0);
        tokio::spawn(async move { h.submit(OTHER_SECRET, &body).await })
    };
    // Admitted: its creation now waits on the locked store, holding its key's lock.
    assert!(eventually(async || h.snapshot().pending == 2).await);
    let replay = {
        let h = std::sync::Arc::clone(&h);
        tokio::spawn(async move { h.submit(AGENT_SECRET, &replayed).await })
    };
    let answered = eventually(async || replay.is_finished()).await;
    let still_waiting = !waiting.is_finished();
    store_lock.release();
    // Before, the replay was answered only once that creation had given up on the store (5 s).
    assert!(
        answered && still_waiting,
        "the replay waited on another client's submission \
         (answered: {answered}; the other still waiting then: {still_waiting})"
    );
    assert_eq!(replay.await.unwrap().status, 200);
    assert_eq!(waiting.await.unwrap().status, 202);
    assert_counts_match_the_store(&h, dir.path()).await;
}
