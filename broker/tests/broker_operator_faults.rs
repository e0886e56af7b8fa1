//! Operator decisions under faults (SPEC sections 6 and 8): an operator who hangs up mid-decision,
//! the store held by another process during a decision, concurrent decisions on one request, a
//! replay after a restart, and `kill -9` between the commit and the answer. In every case the
//! decision is made whole or not at all, a retry with the same key replays what was committed,
//! and the controller's counts equal the store (drift 0).

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::broker::{Harness, assert_unchanged, settings, start_with};
use support::eventually::eventually;
use support::faults::*;
use support::http::request;
use support::secrets::{AGENT_SECRET, OTHER_OPERATOR_SECRET};
use support::serve::{Files, Server};
use unyolo_admission::StorageCaps;

/// The body [`HangUp::decision`] sends for request `id`.
fn hang_up_body(id: &str) -> Value {
    json!({"expected_revision": 1, "idempotency_key": format!("hang-up-{id}")})
}

fn action(i: usize) -> &'static str {
    if i.is_multiple_of(2) {
        "approve"
    } else {
        "deny"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_who_hangs_up_mid_decision_leaves_it_whole_and_a_retry_replays_it() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "hang", 10).await;
    let hang_ups = ids
        .iter()
        .enumerate()
        .map(|(i, id)| HangUp::decision(id, action(i)))
        .collect();
    burst_watching_drift(&h, hang_ups).await;
    quiet(&h, dir.path()).await;
    assert_counts_match_the_store(&h, dir.path()).await;
    let records = h.broker.database().count_decisions().await.unwrap();
    let mut replayed = 0;
    for (i, id) in ids.iter().enumerate() {
        let before = h.operator.request(id).await.body;
        let retry = h.operator.decide(id, action(i), &hang_up_body(id)).await;
        assert_eq!(retry.status, 200, "{id}: {}", retry.body);
        if before["status"] == "pending" {
            // Not decided before the hang-up: the retry decides it now.
            assert_eq!(retry.header("idempotency-replayed"), None);
        } else {
            // Decided, whole: the retry answers what that decision committed.
            assert_eq!(retry.header("idempotency-replayed"), Some("true"));
            assert_eq!(retry.body["decided_by"], "operator");
            replayed += 1;
        }
    }
    assert_eq!(
        replayed, records,
        "one record per decision the hang-ups made"
    );
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_while_another_process_holds_the_store_waits_for_it_or_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "locked", 2).await;
    // Held shorter than the busy timeout (5 s): the decision waits, then commits.
    let holder = lock_store(dir.path(), Duration::from_secs(2));
    let waited = h.operator.deny(&ids[0]).await;
    assert_eq!(waited.status, 200, "{}", waited.body);
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    // Held past it: 503 storage_unavailable, Retry-After 1, and nothing written or counted.
    let snapshot = h.snapshot();
    let holder = lock_store(dir.path(), Duration::from_secs(7));
    let body = json!({"expected_revision": 1, "idempotency_key": "locked"});
    let refused = h.operator.decide(&ids[1], "approve", &body).await;
    assert_eq!(
        (refused.status, refused.code()),
        (503, "storage_unavailable"),
        "{}",
        refused.body
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_unchanged(&snapshot, &h.snapshot(), "a failed decision moved a count");
    assert_eq!(h.operator.request(&ids[1]).await.body["revision"], 1);
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 1);
    // The retry is a new decision (nothing was recorded), and it commits.
    let retried = h.operator.decide(&ids[1], "approve", &body).await;
    assert_eq!(retried.status, 200, "{}", retried.body);
    assert_eq!(retried.header("idempotency-replayed"), None);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_concurrent_decisions_on_one_request_exactly_one_wins_the_rest_see_a_revision_conflict()
{
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "race", 4).await;
    for id in &ids {
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let operator = if i % 3 == 0 {
                    h.operator_with(OTHER_OPERATOR_SECRET)
                } else {
                    h.operator.clone()
                };
                let id = id.clone();
                tokio::spawn(async move {
                    let body =
                        json!({"expected_revision": 1, "idempotency_key": format!("race-{i}")});
                    operator.decide(&id, action(i), &body).await
                })
            })
            .collect();
        let mut won = 0;
        for task in tasks {
            let reply = task.await.unwrap();
            match reply.status {
                200 => won += 1,
                409 => assert_eq!(reply.code(), "revision_conflict", "{}", reply.body),
                other => panic!("{other}: {}", reply.body),
            }
        }
        assert_eq!(won, 1, "exactly one decision on {id} wins");
    }
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 4);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

async fn restart(h: Harness, dir: &std::path::Path) -> Harness {
    h.broker.shutdown().await;
    start_with(settings(dir, LIMITS, StorageCaps::default())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_replays_after_a_restart_and_its_key_still_conflicts_with_another_command() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "restart", 2).await;
    let body = json!({"expected_revision": 1, "idempotency_key": "before-restart"});
    let denied = h.operator.decide(&ids[0], "deny", &body).await;
    assert_eq!(denied.status, 200);
    let h = restart(h, dir.path()).await;
    let replay = h.operator.decide(&ids[0], "deny", &body).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotency-replayed"), Some("true"));
    assert_eq!(replay.body, denied.body);
    let mut other = body.clone();
    other["on_behalf_of"] = json!("someone else");
    let conflict = h.operator.decide(&ids[0], "deny", &other).await;
    assert_eq!(
        (conflict.status, conflict.code()),
        (409, "idempotency_conflict")
    );
    // The other request was restored pending and is decidable.
    assert_eq!(h.operator.approve(&ids[1]).await.status, 200);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_between_a_decision_and_its_answer_restarts_decided_or_not_never_half() {
    let dir = tempfile::tempdir().unwrap();
    let files = Files::write(dir.path(), LIMITS);
    let server = Server::spawn_logging(None, "warn", &support::broker::serve_args(&files));
    let mut ids = Vec::new();
    for i in 0..8 {
        let op = server
            .submit(
                AGENT_SECRET,
                &request(&format!("kill-{i}"), "demo.request", 0),
            )
            .await;
        assert_eq!(op.status, 202, "{}", op.body);
        ids.push(op.id());
    }
    let hang_ups: Vec<HangUp> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| HangUp::decision(id, action(i)))
        .collect();
    hang_up_all(Listeners::of_server(&server), hang_ups).await;
    drop(server); // SIGKILL, answers unread
    let server = Server::spawn_logging(None, "warn", &support::broker::serve_args(&files));
    assert_eq!(server.operator.drift().await["drift"], 0);
    for (i, id) in ids.iter().enumerate() {
        let before = server.operator.request(id).await.body;
        let retry = server
            .operator
            .decide(id, action(i), &hang_up_body(id))
            .await;
        assert_eq!(retry.status, 200, "{id}: {}", retry.body);
        let replayed = retry.header("idempotency-replayed") == Some("true");
        assert_eq!(
            replayed,
            before["status"] != "pending",
            "{id}: a decision the store holds replays, one it lacks is made now: {before}"
        );
    }
    assert!(
        support::eventually::eventually(async || server.operator.pending().await.is_empty()).await
    );
    assert_eq!(server.operator.drift().await["drift"], 0);
    assert_eq!(server.metric("admission_store_drift").await, Some(0));
    drop(server);
}

/// A broker whose requests wait 2 s for a decision, with two requests created, and the store held
/// by another process from before that request is due until well after the sweeper's expiry gave
/// up (its write waits out the 5 s busy timeout from about 2 s on, then is retried a second
/// later). Returns once the sweeper's write is waiting: whatever is sent now is judged after
/// that write failed, before its retry, with the requests due but not yet expired.
async fn due_but_unwritten(
    dir: &std::path::Path,
) -> (Harness, Vec<String>, std::thread::JoinHandle<()>) {
    let mut settings = settings(dir, LIMITS, StorageCaps::default());
    settings.pending_timeout = Duration::from_secs(2);
    let h = start_with(settings).await;
    let ids = create_pending(&h, "due", 2).await;
    let holder = lock_store(dir, Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(3)).await;
    (h, ids, holder)
}

/// A decision on a request whose pending time ran out while its expiry could not be written
/// expires it first, as upstream applies due lifecycle changes before a decision: 409
/// `revision_conflict` with `current.status = "expired"`, the `request.expired` event written, no
/// decision recorded, never an `invalid_transition` that leaves the inbox showing it pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_on_a_request_whose_expiry_is_due_but_unwritten_expires_it_first() {
    let dir = tempfile::tempdir().unwrap();
    let (h, ids, holder) = due_but_unwritten(dir.path()).await;
    let id = &ids[0];
    let body = json!({"expected_revision": 1, "idempotency_key": "due"});
    let decided = h.operator.decide(id, "approve", &body).await;
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(
        (decided.status, decided.code()),
        (409, "revision_conflict"),
        "{}",
        decided.body
    );
    let current = &decided.body["error"]["current"];
    assert_eq!(current["status"], "expired", "{}", decided.body);
    assert_eq!(current["revision"], 2);
    assert_eq!(current["allowed_actions"], json!([]));
    let shown = h.operator.request(id).await;
    assert_eq!(shown.body["status"], "expired");
    assert_eq!(h.broker.database().count_decisions().await.unwrap(), 0);
    // The same key with the fresh revision is a new command, refused as a transition now.
    let fresh = json!({"expected_revision": 2, "idempotency_key": "due"});
    let late = h.operator.decide(id, "approve", &fresh).await;
    assert_eq!((late.status, late.code()), (409, "invalid_transition"));
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// An operator's read finds such requests expired, as upstream applies due lifecycle changes
/// before a read: the request by id shows `expired` (with `decided_at`, the expiry, and no
/// `decided_by`, as upstream's pending expiry), and a `pending` page no longer lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_read_of_requests_whose_expiry_is_due_but_unwritten_shows_them_expired() {
    let dir = tempfile::tempdir().unwrap();
    let (h, ids, holder) = due_but_unwritten(dir.path()).await;
    let one = h.operator.clone();
    let id = ids[0].clone();
    let shown = tokio::spawn(async move { one.request(&id).await });
    let page = h.operator.get(&format!("{INBOX}?status=pending")).await;
    let shown = shown.await.unwrap();
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(shown.status, 200, "{}", shown.body);
    assert_eq!(shown.body["status"], "expired", "{}", shown.body);
    assert_eq!(shown.body["revision"], 2);
    assert_eq!(shown.body["allowed_actions"], json!([]));
    assert!(shown.body["decided_at"].is_string(), "{}", shown.body);
    assert!(shown.body.get("decided_by").is_none(), "{}", shown.body);
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(page.body["requests"], json!([]), "{}", page.body);
    let history = h.operator.get(&format!("{INBOX}?status=history")).await;
    let listed: Vec<&str> = history.body["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["expired", "expired"], "{}", history.body);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// The agent's cancel of such a request cancels it, as upstream's Agent V1 cancel does (its
/// operation store still holds the operation pending; only the grant behind it expires): 200
/// with the operation `canceled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_cancel_of_a_request_whose_expiry_is_due_but_unwritten_cancels_it() {
    let dir = tempfile::tempdir().unwrap();
    let (h, ids, holder) = due_but_unwritten(dir.path()).await;
    let canceled = h
        .post(
            &format!("/api/agent/v1/operations/{}/cancel", ids[0]),
            Some(AGENT_SECRET),
        )
        .await;
    tokio::task::spawn_blocking(move || holder.join().unwrap())
        .await
        .unwrap();
    assert_eq!(canceled.status, 200, "{}", canceled.body);
    assert_eq!(canceled.body["state"], "canceled", "{}", canceled.body);
    assert_eq!(canceled.body["error"]["code"], "operation_canceled");
    assert_eq!(canceled.body["revision"], 2);
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// The store refusing every write of a start (`approved` → `executing`) through a trigger of
/// the test's own, until [`StartsRefused::end`]: the executor holds the slot and retries.
struct StartsRefused(rusqlite::Connection);

impl StartsRefused {
    fn in_store(data: &std::path::Path) -> StartsRefused {
        let conn = rusqlite::Connection::open(data.join("admission.sqlite3")).unwrap();
        conn.busy_timeout(Duration::from_secs(30)).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER refuse_start BEFORE UPDATE OF state ON operations \
             WHEN NEW.state = 'executing' BEGIN SELECT RAISE(ABORT, 'start refused'); END;",
        )
        .unwrap();
        StartsRefused(conn)
    }

    fn end(self) {
        self.0.execute_batch("DROP TRIGGER refuse_start").unwrap();
    }
}

/// An approval that lapses while its start cannot be recorded (the store refuses the write, here
/// through a trigger of the test's own, so the executor holds the slot and retries) never runs:
/// once the store takes writes again the request ends `expired`, as any lapsed approval does,
/// its slots are released and the counts equal the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_that_lapses_while_its_start_cannot_be_recorded_never_runs() {
    if !support::broker::sqlite_only("refuses starts with a trigger in the SQLite file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "lapse", 1).await;
    let starts = StartsRefused::in_store(dir.path());
    let body = json!({"expected_revision": 1, "idempotency_key": "lapse",
        "constraints": {"duration_seconds": 2}});
    let approved = h.operator.decide(&ids[0], "approve", &body).await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    // The executor took the slot; the store refuses the start, so the work waits.
    assert!(
        eventually(async || h.snapshot().executing == 1).await,
        "the start never took its slot: {:?}",
        h.snapshot()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    starts.end();
    let path = format!("/api/agent/v1/operations/{}", ids[0]);
    let ended = eventually(async || {
        let op = h.get(&path, Some(AGENT_SECRET)).await;
        op.body["state"] != "approved"
    })
    .await;
    assert!(ended, "the lapsed approval never ended");
    let op = h.get(&path, Some(AGENT_SECRET)).await;
    assert_eq!(op.body["state"], "expired", "{}", op.body);
    assert_eq!(op.body["error"]["code"], "operation_approval_expired");
    assert_eq!(h.operator.request(&ids[0]).await.body["status"], "expired");
    let snapshot = h.snapshot();
    assert_eq!(
        (snapshot.executing, snapshot.active),
        (0, 0),
        "{snapshot:?}"
    );
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}

/// Approved work whose start the store cannot record yet (here refused by a trigger of the
/// test's own) has not run and is still `approved` on disk, so its client may cancel it and an
/// operator may revoke it, as any approved work: 200, the slot it held released, and it never
/// runs once the store takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_whose_start_is_not_recorded_yet_can_be_canceled_or_revoked() {
    if !support::broker::sqlite_only("refuses starts with a trigger in the SQLite file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let h = start_tight(dir.path()).await;
    let ids = create_pending(&h, "unstarted", 2).await;
    let starts = StartsRefused::in_store(dir.path());
    for id in &ids {
        assert_eq!(h.operator.approve(id).await.status, 200);
    }
    assert!(
        eventually(async || h.snapshot().executing == 2).await,
        "the starts never took their slots: {:?}",
        h.snapshot()
    );
    let path = format!("/api/agent/v1/operations/{}", ids[0]);
    assert_eq!(h.get(&path, Some(AGENT_SECRET)).await.state(), "approved");
    let canceled = h.post(&format!("{path}/cancel"), Some(AGENT_SECRET)).await;
    assert_eq!(canceled.status, 200, "{}", canceled.body);
    assert_eq!(canceled.state(), "canceled");
    assert_eq!(canceled.body["error"]["code"], "operation_canceled");
    let shown = h.operator.request(&ids[0]).await.body;
    assert_eq!(shown["status"], "revoked", "{shown}");
    let revoked = h.operator.revoke(&ids[1]).await;
    assert_eq!(revoked.status, 200, "{}", revoked.body);
    assert_eq!(revoked.body["status"], "revoked");
    let snapshot = h.snapshot();
    assert_eq!(
        (snapshot.executing, snapshot.active),
        (0, 0),
        "{snapshot:?}"
    );
    starts.end();
    // The retries find nothing left to start: neither ever runs.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for id in &ids {
        let op = h
            .get(
                &format!("/api/agent/v1/operations/{id}"),
                Some(AGENT_SECRET),
            )
            .await;
        assert_eq!(op.state(), "canceled", "{}", op.body);
    }
    ends_whole(&h, dir.path()).await;
    h.broker.shutdown().await;
}
