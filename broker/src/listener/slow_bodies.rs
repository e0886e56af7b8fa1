//! Slow bodies against a real server from [`serve_counted`] on loopback: what the client reads,
//! whether its connection closed, and whether a newcomer still gets in.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use http_body_util::BodyExt;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// How long any one step may take before the test gives up: a bound against hanging, not a
/// measure of speed.
const HANG: Duration = Duration::from_secs(30);

/// How often a trickling client sends its next byte.
const DRIP: Duration = Duration::from_millis(100);

struct Server {
    addr: std::net::SocketAddr,
    metrics: BodyMetrics,
    /// Handlers of `/stuck` that have read their first part.
    stuck: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    _stop: watch::Sender<bool>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `/healthz` answers `ok`; `/upload` reads its whole body and says how it ended; `/stuck` reads
/// the first part of its body and then never reads again.
async fn start(settings: ConnectionSettings, cap: usize) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stuck = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/upload", post(upload))
        .route("/stuck", post(read_once_then_hang))
        .with_state(Arc::clone(&stuck));
    let (stop, stopped) = watch::channel(false);
    let metrics = BodyMetrics::default();
    let task = tokio::spawn(serve_counted(
        listener,
        app,
        settings,
        ConnectionPool::new(cap),
        stopped,
        metrics.clone(),
    ));
    Server {
        addr,
        metrics,
        stuck,
        task,
        _stop: stop,
    }
}

async fn upload(body: Body) -> (StatusCode, String) {
    match body.collect().await {
        Ok(body) => (StatusCode::OK, format!("{} bytes", body.to_bytes().len())),
        Err(err) => match body_cut_off(&err) {
            Some(cut) => (
                StatusCode::BAD_REQUEST,
                format!("cut off: {}", cut.reason.as_str()),
            ),
            None => (StatusCode::BAD_REQUEST, format!("unreadable: {err}")),
        },
    }
}

async fn read_once_then_hang(State(stuck): State<Arc<AtomicUsize>>, mut body: Body) -> String {
    let _ = body.frame().await;
    // Relaxed: a count the test polls.
    stuck.fetch_add(1, Ordering::Relaxed);
    std::future::pending::<String>().await
}

/// Sends a `POST path` declaring `declared` bytes, `first` of them at once and then one every
/// [`DRIP`] until an answer comes; returns what it read and whether the server closed the
/// connection.
async fn trickle(
    addr: std::net::SocketAddr,
    path: &str,
    declared: usize,
    first: usize,
) -> (String, bool) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b'x'; first]).await.unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    let mut answered = false;
    let closed = tokio::time::timeout(HANG, async {
        loop {
            if !answered && stream.write_all(b"x").await.is_err() {
                return true;
            }
            match tokio::time::timeout(DRIP, stream.read(&mut buf)).await {
                Err(_) => {}
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(n)) => {
                    answered = true;
                    received.extend_from_slice(&buf[..n]);
                }
            }
        }
    })
    .await
    .unwrap_or(false);
    (String::from_utf8_lossy(&received).into_owned(), closed)
}

fn settings() -> ConnectionSettings {
    ConnectionSettings {
        body_rate_grace: Duration::from_millis(500),
        ..ConnectionSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickled_below_the_minimum_rate_is_cut_off_and_its_connection_closed() {
    let server = start(settings(), 8).await;
    let (answer, closed) = trickle(server.addr, "/upload", 100_000, 10).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.ends_with("cut off: too_slow"), "{answer}");
    assert!(closed, "the connection stayed open: {answer}");
    assert_eq!(server.metrics.cut_off(CutOffReason::TooSlow), 1);
    assert_eq!(server.metrics.cut_off(CutOffReason::Deadline), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_still_arriving_at_its_deadline_is_cut_off_whatever_its_rate() {
    let server = start(
        ConnectionSettings {
            body_deadline: Duration::from_millis(1500),
            body_min_rate: 1,
            ..settings()
        },
        8,
    )
    .await;
    let (answer, closed) = trickle(server.addr, "/upload", 100_000, 100).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.ends_with("cut off: deadline"), "{answer}");
    assert!(closed, "the connection stayed open: {answer}");
    assert_eq!(server.metrics.cut_off(CutOffReason::Deadline), 1);

    let mut registry = Registry::default();
    server.metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"broker_body_deadlines_total{reason="deadline"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"broker_body_deadlines_total{reason="too_slow"} 0"#),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_arrives_whole_is_read_whole() {
    let server = start(settings(), 8).await;
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    let request = format!(
        "POST /upload HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5000\r\n\r\n{}",
        "x".repeat(5000)
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    let read = tokio::time::timeout(HANG, stream.read_to_string(&mut answer)).await;
    assert!(read.is_ok());
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("5000 bytes"), "{answer}");
    assert_eq!(server.metrics.cut_off(CutOffReason::TooSlow), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_on_every_slot_do_not_keep_a_newcomer_out() {
    // Each handler read a first part and then stopped reading: its body can no longer cut itself
    // off, so only making room at the cap lets the newcomer in.
    const CAP: usize = 2;
    let server = start(settings(), CAP).await;
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..CAP {
        slow.spawn(trickle(server.addr, "/stuck", 100_000, 10));
    }
    let every_slot = tokio::time::timeout(HANG, async {
        // Relaxed: a count the handlers bump.
        while server.stuck.load(Ordering::Relaxed) < CAP {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert!(
        every_slot.await.is_ok(),
        "the slow bodies never took every slot"
    );

    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    let read = tokio::time::timeout(HANG, stream.read_to_string(&mut answer)).await;
    assert!(read.is_ok(), "the newcomer was never served");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("ok"), "{answer}");
    assert!(server.metrics.cut_off(CutOffReason::TooSlow) >= 1);
    // The connection closed to make room was told so: it reads the end of its stream.
    let (_, closed) = slow.join_next().await.unwrap().unwrap();
    assert!(closed);
}
