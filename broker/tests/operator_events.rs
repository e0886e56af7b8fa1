//! The Operator V1 event stream (`GET /api/operator/v1/events`) of the `admission serve`
//! binary, read by a real SSE parser: the backlog, live events in order without a gap, one
//! event per revision change with the contract's kinds and statuses, resuming by cursor and by
//! `Last-Event-ID`, a heartbeat when idle, the refusals before a stream (400, 410, 503), the
//! bound on open streams, and every stream ended at shutdown. Every event is checked against
//! the contract's `BrokerEvent` schema (`support::events`).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::Value;
use support::broker::{ROOMY, settings, start_with};
use support::events::open;
use support::eventually::assert_eventually;
use support::http::request;
use support::secrets::{AGENT_SECRET, OPERATOR_SECRET};
use support::serve::{Files, Server};
use unyolo_admission::StorageCaps;
use unyolo_admission_broker::WallClock;
use unyolo_admission_broker::store::events::decode_cursor;

/// Room for every test here; one execution at a time, so an approved request can be held
/// queued behind a long one.
const LIMITS: &str = r#"{"requests_per_window": 1000, "window_seconds": 60,
  "client_active": 100, "client_pending": 10, "global_active": 200, "global_executing": 1}"#;

fn serve(dir: &std::path::Path, extra: &[&str]) -> Server {
    let files = Files::write(dir, LIMITS);
    let mut args = support::broker::serve_args(&files);
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    Server::spawn(None, &args)
}

fn op_path(id: &str) -> String {
    format!("/api/agent/v1/operations/{id}")
}

/// Submits a `demo.request` (needs approval) running `duration_ms`; its id.
async fn submit_request(server: &Server, key: &str, duration_ms: u64) -> String {
    let reply = server
        .submit(AGENT_SECRET, &request(key, "demo.request", duration_ms))
        .await;
    assert_eq!(reply.status, 202, "{}", reply.body);
    reply.id()
}

async fn decide(server: &Server, id: &str, action: &str) {
    let reply = server.operator.act(id, action).await;
    assert_eq!(reply.status, 200, "{action} {id}: {}", reply.body);
}

async fn await_state(server: &Server, id: &str, state: &str) {
    assert_eventually(&format!("{id} becomes {state}"), async || {
        server.get(&op_path(id), AGENT_SECRET).await.state() == state
    })
    .await;
}

/// (request id, kind, revision, status, used_count) of an event.
fn summary(event: &Value) -> (String, String, u64, String, u64) {
    (
        event["request_id"].as_str().unwrap().to_owned(),
        event["kind"].as_str().unwrap().to_owned(),
        event["revision"].as_u64().unwrap(),
        event["status"].as_str().unwrap().to_owned(),
        event["used_count"].as_u64().unwrap(),
    )
}

fn expect(
    id: &str,
    kind: &str,
    revision: u64,
    status: &str,
    used: u64,
) -> (String, String, u64, String, u64) {
    (
        id.to_owned(),
        kind.to_owned(),
        revision,
        status.to_owned(),
        used,
    )
}

fn cursor(event: &Value) -> String {
    event["cursor"].as_str().unwrap().to_owned()
}

/// The sequence an event's cursor names (cursors are opaque to clients; the test knows them).
fn seq(event: &Value) -> i64 {
    decode_cursor(event["cursor"].as_str().unwrap()).expect("a cursor the broker issued")
}

/// Whether the events' sequences strictly increase.
fn in_order(events: &[Value]) -> bool {
    events.windows(2).all(|w| seq(&w[0]) < seq(&w[1]))
}

#[tokio::test]
async fn the_backlog_then_live_changes_arrive_in_order_one_event_per_revision_with_the_spec_kinds()
{
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &[]);
    let consumed = submit_request(&server, "consumed", 0).await;
    let denied = submit_request(&server, "denied", 0).await;
    let canceled = submit_request(&server, "canceled", 0).await;
    let running = submit_request(&server, "running", 600_000).await;
    let revoked = submit_request(&server, "revoked", 0).await;
    // Decided after the stream opened (no new work is admitted while the pool is full).
    let live = submit_request(&server, "live", 0).await;
    let live_canceled = submit_request(&server, "live-canceled", 0).await;
    // Work that needs no approval is no request: it has no events.
    let run = server
        .submit(AGENT_SECRET, &request("run", "demo.run", 0))
        .await;
    assert_eq!(run.status, 202);
    let run = run.id();
    await_state(&server, &run, "succeeded").await;
    decide(&server, &consumed, "approve").await;
    await_state(&server, &consumed, "succeeded").await;
    decide(&server, &denied, "deny").await;
    let reply = server
        .post(&format!("{}/cancel", op_path(&canceled)), AGENT_SECRET)
        .await;
    assert_eq!(reply.state(), "canceled");
    decide(&server, &running, "approve").await;
    await_state(&server, &running, "executing").await;
    // The one execution slot is taken: this approval waits queued, then its requester cancels.
    decide(&server, &revoked, "approve").await;
    let reply = server
        .post(&format!("{}/cancel", op_path(&revoked)), AGENT_SECRET)
        .await;
    assert_eq!(reply.state(), "canceled", "{}", reply.body);

    let mut stream = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    assert_eq!(stream.status, 200);
    let header = |name: &str| stream.headers.get(name).and_then(|v| v.to_str().ok());
    assert_eq!(header("content-type"), Some("text/event-stream"));
    assert_eq!(header("cache-control"), Some("no-store"));
    let backlog = stream.next_events(16).await;
    let got: Vec<_> = backlog.iter().map(summary).collect();
    assert_eq!(
        got,
        [
            expect(&consumed, "request.created", 1, "pending", 0),
            expect(&denied, "request.created", 1, "pending", 0),
            expect(&canceled, "request.created", 1, "pending", 0),
            expect(&running, "request.created", 1, "pending", 0),
            expect(&revoked, "request.created", 1, "pending", 0),
            expect(&live, "request.created", 1, "pending", 0),
            expect(&live_canceled, "request.created", 1, "pending", 0),
            expect(&consumed, "request.approved", 2, "active", 0),
            expect(&consumed, "grant.reserved", 3, "active", 0),
            expect(&consumed, "grant.consumed", 4, "consumed", 1),
            expect(&denied, "request.denied", 2, "denied", 0),
            expect(&canceled, "request.canceled", 2, "canceled", 0),
            expect(&running, "request.approved", 2, "active", 0),
            expect(&running, "grant.reserved", 3, "active", 0),
            expect(&revoked, "request.approved", 2, "active", 0),
            expect(&revoked, "grant.revoked", 3, "revoked", 0),
        ]
    );
    // Each event's revision is the operation's own after the change.
    for id in [&consumed, &denied, &canceled, &revoked] {
        let last = got.iter().rev().find(|e| &e.0 == id).unwrap();
        let op = server.get(&op_path(id), AGENT_SECRET).await;
        assert_eq!(op.body["revision"].as_u64(), Some(last.2), "{id}");
    }
    assert!(got.iter().all(|e| e.0 != run), "demo.run is not a request");

    // Live, after the backlog: in order, nothing lost.
    decide(&server, &live, "deny").await;
    let reply = server
        .post(&format!("{}/cancel", op_path(&live_canceled)), AGENT_SECRET)
        .await;
    assert_eq!(reply.state(), "canceled");
    let events = stream.next_events(2).await;
    assert_eq!(
        events.iter().map(summary).collect::<Vec<_>>(),
        [
            expect(&live, "request.denied", 2, "denied", 0),
            expect(&live_canceled, "request.canceled", 2, "canceled", 0),
        ]
    );
    let all: Vec<Value> = backlog.iter().chain(&events).cloned().collect();
    assert!(in_order(&all), "cursors are distinct and in order");
    assert_eq!(
        server.metric("broker_operator_events_written_total").await,
        Some(18)
    );
    assert_eventually("18 events counted delivered", async || {
        server
            .metric("broker_operator_events_delivered_total")
            .await
            == Some(18)
    })
    .await;
}

#[tokio::test]
async fn a_stream_resumes_strictly_after_its_cursor_or_its_last_event_id_across_pages() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &[]);
    // 120 events: more than one backlog page of 100.
    for i in 0..60 {
        let id = submit_request(&server, &format!("k{i}"), 0).await;
        decide(&server, &id, "deny").await;
    }
    let mut all = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let events = all.next_events(120).await;
    let cursors: Vec<String> = events.iter().map(cursor).collect();
    assert!(in_order(&events), "in sequence order");

    let by_query = open(
        &server.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={}", cursors[99]),
        &[],
    )
    .await
    .stream()
    .next_event()
    .await
    .unwrap();
    assert_eq!(by_query, events[100]);
    let by_header = open(&server.operator.base, OPERATOR_SECRET, "", &[&cursors[49]])
        .await
        .stream()
        .next_event()
        .await
        .unwrap();
    assert_eq!(by_header, events[50]);
    // An empty query cursor gives way to the header; a query cursor wins over it.
    let empty_query = open(
        &server.operator.base,
        OPERATOR_SECRET,
        "cursor=",
        &[&cursors[9]],
    )
    .await
    .stream()
    .next_event()
    .await
    .unwrap();
    assert_eq!(empty_query, events[10]);
    let both = open(
        &server.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={}", cursors[19]),
        &[&cursors[29]],
    )
    .await
    .stream()
    .next_event()
    .await
    .unwrap();
    assert_eq!(both, events[20]);

    // From the newest cursor: only what happens next.
    let mut tail = open(
        &server.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={}", cursors[119]),
        &[],
    )
    .await
    .stream();
    let id = submit_request(&server, "after", 0).await;
    let next = tail.next_event().await.unwrap();
    assert_eq!(
        summary(&next),
        expect(&id, "request.created", 1, "pending", 0)
    );
    assert_eq!(
        all.next_event().await.unwrap(),
        next,
        "the first stream sees it live too"
    );
}

#[tokio::test]
async fn an_idle_stream_has_its_head_at_once_and_writes_a_heartbeat_every_15_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &[]);
    // No event yet: the head still arrives (`open` waits for it), then the first heartbeat.
    let mut stream = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    assert_eq!(stream.status, 200);
    assert!(
        stream.until_raw_contains(": heartbeat\n\n").await,
        "no heartbeat: {:?}",
        stream.raw()
    );
    assert_eq!(stream.raw(), ": heartbeat\n\n", "nothing else was written");
    let id = submit_request(&server, "after-heartbeat", 0).await;
    let event = stream.next_event().await.unwrap();
    assert_eq!(
        summary(&event),
        expect(&id, "request.created", 1, "pending", 0)
    );
}

#[tokio::test]
async fn a_bad_start_is_refused_as_json_before_any_stream_and_opens_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &[]);
    let id = submit_request(&server, "one", 0).await;
    let long = "A".repeat(1025);
    let cases: [(&str, Vec<&str>, u16, &str, &str); 8] = [
        (
            "cursor=zz",
            vec![],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "cursor=AAAAAAAAAAF",
            vec![],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            &format!("cursor={long}"),
            vec![],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "cursor=AAAAAAAAAAE&cursor=AAAAAAAAAAI",
            vec![],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "",
            vec!["AAAAAAAAAAE", "AAAAAAAAAAI"],
            400,
            "invalid_request",
            "request is invalid",
        ),
        // Two headers are refused even when the query's cursor is the start, as upstream binds
        // the header before it looks at the query (before: the stream opened).
        (
            "cursor=AAAAAAAAAAE",
            vec!["AAAAAAAAAAE", "AAAAAAAAAAI"],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "",
            vec![long.as_str()],
            400,
            "invalid_request",
            "request is invalid",
        ),
        (
            "",
            vec!["not-a-cursor"],
            400,
            "invalid_request",
            "request is invalid",
        ),
    ];
    // `long` is borrowed by the table, so the query is built before it.
    for (query, headers, status, code, message) in &cases {
        let reply = open(&server.operator.base, OPERATOR_SECRET, query, headers)
            .await
            .refused();
        assert_eq!(
            (
                reply.status,
                reply.code(),
                reply.body["error"]["message"].as_str()
            ),
            (*status, *code, Some(*message)),
            "{query} {headers:?}: {}",
            reply.body
        );
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(reply.header("cache-control"), Some("no-store"));
    }
    let reply = open(&server.operator.base, "", "", &[]).await.refused();
    assert_eq!((reply.status, reply.code()), (401, "unauthorized"));
    assert_eq!(
        server.metric("broker_operator_event_streams").await,
        Some(0)
    );
    assert_eq!(
        server
            .metric("broker_operator_events_delivered_total")
            .await,
        Some(0)
    );
    // The request is as it was: pending at revision 1.
    let op = server.get(&op_path(&id), AGENT_SECRET).await;
    assert_eq!(
        (op.state(), op.body["revision"].as_u64()),
        ("pending", Some(1))
    );
}

#[tokio::test]
async fn open_streams_are_bounded_and_a_slot_given_back_opens_again() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &[]);
    let mut streams = Vec::new();
    for _ in 0..16 {
        streams.push(
            open(&server.operator.base, OPERATOR_SECRET, "", &[])
                .await
                .stream(),
        );
    }
    assert_eq!(
        server.metric("broker_operator_event_streams").await,
        Some(16)
    );
    let reply = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .refused();
    assert_eq!(
        (reply.status, reply.code(), reply.retry_after()),
        (503, "temporarily_unavailable", Some(1)),
        "{}",
        reply.body
    );
    // Streams still open still get events.
    let id = submit_request(&server, "bounded", 0).await;
    for stream in &mut streams {
        assert_eq!(
            stream.next_event().await.unwrap()["request_id"],
            id.as_str()
        );
    }
    drop(streams.pop());
    // The server lets the slot go once it sees the hang-up (at the latest at its next write).
    assert_eventually("a hung-up stream's slot is free again", async || {
        server.metric("broker_operator_event_streams").await == Some(15)
    })
    .await;
    let again = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    assert_eq!(again.status, 200);
}

#[tokio::test]
async fn at_the_connection_cap_an_open_stream_is_not_taken_for_an_idle_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = serve(dir.path(), &["--max-connections", "4"]);
    let mut stream = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    // Silent connections past the cap: each newcomer makes room by closing the connection idle
    // longest, which must be a silent one, never the stream (its response is still being sent).
    let silent: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(server.addr).unwrap())
        .collect();
    let id = submit_request(&server, "through-the-flood", 0).await;
    let event = stream.next_event().await.expect("the stream is still open");
    assert_eq!(
        summary(&event),
        expect(&id, "request.created", 1, "pending", 0)
    );
    drop(silent);
}

#[tokio::test]
async fn shutdown_ends_every_open_stream_without_waiting_out_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = serve(dir.path(), &[]);
    let id = submit_request(&server, "before", 0).await;
    let mut first = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let mut second = open(&server.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    assert_eq!(first.next_event().await.unwrap()["request_id"], id.as_str());
    assert_eq!(
        second.next_event().await.unwrap()["request_id"],
        id.as_str()
    );
    server.sigterm();
    assert!(first.ends().await, "the first stream ended");
    assert!(second.ends().await, "the second stream ended");
    assert_eventually("the server exits", async || !server.is_alive()).await;
    let logged = server.logged();
    assert!(
        !logged.contains("still busy after the grace period")
            && !logged.contains("some broker tasks are still running"),
        "{logged}"
    );
}

#[tokio::test]
async fn a_cursor_older_than_the_retained_log_is_410_and_an_empty_one_replays_what_is_left() {
    let dir = tempfile::tempdir().unwrap();
    // The sweep's clock: moved a week and a day on, every event is past the 7-day retention.
    let offset = Arc::new(AtomicU64::new(0));
    let clock = Arc::clone(&offset);
    let mut settings = settings(dir.path(), ROOMY, StorageCaps::default());
    settings.retention.clock = WallClock::from_fn(move || {
        SystemTime::now() + Duration::from_secs(clock.load(Ordering::Relaxed))
    });
    settings.retention.sweep_interval = Duration::ZERO;
    let h = start_with(settings).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let reply = h
            .submit(
                AGENT_SECRET,
                &request(&format!("old{i}"), "demo.request", 0),
            )
            .await;
        ids.push(reply.id());
    }
    let mut stream = open(&h.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let events = stream.next_events(3).await;
    drop(stream);
    let newest = h.broker.newest_event_cursor().expect("events exist");
    assert_eq!(newest, cursor(&events[2]));

    offset.store(8 * 24 * 3600, Ordering::Relaxed);
    let report = h.broker.sweep_now().await.unwrap();
    assert_eq!(report.events_trimmed, 3);
    for old in [
        cursor(&events[0]),
        cursor(&events[1]),
        "AAAAAAAAAAA".to_owned(),
    ] {
        let reply = open(
            &h.operator.base,
            OPERATOR_SECRET,
            &format!("cursor={old}"),
            &[],
        )
        .await
        .refused();
        assert_eq!(
            (reply.status, reply.code()),
            (410, "cursor_expired"),
            "{old}: {}",
            reply.body
        );
        assert_eq!(reply.header("content-type"), Some("application/json"));
    }
    // The newest cursor missed nothing: it still resumes, as does an empty one.
    let mut from_newest = open(
        &h.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={newest}"),
        &[],
    )
    .await
    .stream();
    let mut from_start = open(&h.operator.base, OPERATOR_SECRET, "", &[])
        .await
        .stream();
    let reply = h.operator.deny(&ids[0]).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let next = from_newest.next_event().await.unwrap();
    assert_eq!(
        summary(&next),
        expect(&ids[0], "request.denied", 2, "denied", 0)
    );
    assert_eq!(from_start.next_event().await.unwrap(), next);
    // With every one of the operator's 16 streams open, an expired cursor is still 410 (the
    // consumer re-syncs on it), and a retained one is 503 (no room).
    let mut open_streams = vec![from_newest, from_start];
    while open_streams.len() < 16 {
        open_streams.push(
            open(&h.operator.base, OPERATOR_SECRET, "", &[])
                .await
                .stream(),
        );
    }
    let expired = open(
        &h.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={}", cursor(&events[0])),
        &[],
    )
    .await
    .refused();
    assert_eq!((expired.status, expired.code()), (410, "cursor_expired"));
    let full = open(
        &h.operator.base,
        OPERATOR_SECRET,
        &format!("cursor={newest}"),
        &[],
    )
    .await
    .refused();
    assert_eq!((full.status, full.code()), (503, "temporarily_unavailable"));
    drop(open_streams);
    h.broker.shutdown().await;
}
