//! Operator V1 event fan-out: events/s delivered to N open `GET /api/operator/v1/events`
//! streams of an in-process broker on loopback, against the same writes with no stream open
//! (the baseline, in the same run).
//!
//! Each iteration writes a batch of [`BATCH`] events (one `request.created` each: a pending
//! `demo.request` row inserted through the broker's store, which writes the event in the row's
//! transaction and rings the event bell after the commit) and ends when every one of the N
//! streams has received all of them. Criterion's throughput is events delivered (N × batch),
//! so the figure with no stream is the write rate alone. Clients read the streams over real
//! HTTP with reqwest, counting frames.
//!
//! `cargo bench --bench event_fanout`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;
use tokio::sync::Notify;
use unyolo_admission::OperationState;
use unyolo_admission::config::Secrets;
use unyolo_admission_broker::store::now_rfc3339;
use unyolo_admission_broker::{Broker, BrokerSettings, EventStreamLimits, OperationRecord};

/// Events written per iteration.
const BATCH: u64 = 100;
const OPERATOR: &str = "operator-bench-secret-0123456789";

/// A client reading one stream: how many frames it has seen.
struct Reader {
    frames: Arc<AtomicU64>,
    seen: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        // Hangs up: the broker lets the stream go at its next write.
        self.task.abort();
    }
}

async fn open_reader(base: &str) -> Reader {
    let frames = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(Notify::new());
    let mut response = reqwest::Client::new()
        .get(format!("{base}/api/operator/v1/events"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (count, bell) = (Arc::clone(&frames), Arc::clone(&seen));
    let task = tokio::spawn(async move {
        // A frame may be split across chunks: count frame ends ("\n\n") after a `data:` line.
        let mut tail = Vec::new();
        while let Ok(Some(chunk)) = response.chunk().await {
            tail.extend_from_slice(&chunk);
            let mut n = 0;
            while let Some(end) = tail.windows(2).position(|w| w == b"\n\n") {
                if tail[..end].starts_with(b"id: ") {
                    n += 1;
                }
                tail.drain(..end + 2);
            }
            count.fetch_add(n, Ordering::Relaxed);
            bell.notify_waiters();
        }
    });
    Reader { frames, seen, task }
}

fn record(i: u64) -> OperationRecord {
    let now = now_rfc3339();
    OperationRecord {
        id: format!("op_{i:032x}"),
        client_id: "agent".to_owned(),
        idempotency_key: format!("fanout-{i}"),
        operation: "demo.request".to_owned(),
        target: json!({}),
        arguments: json!({}),
        reason: "fan-out benchmark".to_owned(),
        state: OperationState::Pending,
        created_at: now.clone(),
        updated_at: now,
        terminal_at: None,
        error: None,
        revision: 1,
        ended_from: None,
        active_expires_at: None,
        pending_expires_at: None,
        decided: None,
        broker: "admission".to_owned(),
        presentation: unyolo_admission_broker::presentation::derive(
            "demo.request",
            &json!({}),
            &json!({}),
            "fan-out benchmark",
        ),
    }
}

fn fanout(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let secrets = Secrets::parse("agent = agent-bench-secret-0123\n").unwrap();
    let mut settings = BrokerSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        dir.path().to_owned(),
        secrets,
        unyolo_admission::config::Operators::single("bench", OPERATOR).unwrap(),
    );
    settings.event_streams = EventStreamLimits {
        per_operator: 256,
        total: 256,
    };
    let (broker, _) = runtime.block_on(Broker::start(settings)).unwrap();
    let base = format!("http://{}", broker.operator_addr());
    let next = AtomicU64::new(0);

    let mut group = c.benchmark_group("event_fanout");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.warm_up_time(Duration::from_secs(1));
    for streams in [0usize, 1, 8, 32, 64] {
        let readers: Vec<Reader> = runtime.block_on(async {
            let mut readers = Vec::new();
            for _ in 0..streams {
                readers.push(open_reader(&base).await);
            }
            readers
        });
        let delivered = (streams.max(1) as u64) * BATCH;
        group.throughput(Throughput::Elements(delivered));
        group.bench_function(BenchmarkId::from_parameter(streams), |b| {
            b.iter_custom(|iterations| {
                runtime.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iterations {
                        let targets: Vec<u64> = readers
                            .iter()
                            .map(|r| r.frames.load(Ordering::Relaxed) + BATCH)
                            .collect();
                        let started = Instant::now();
                        for _ in 0..BATCH {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            broker.database().insert(record(i)).await.unwrap();
                        }
                        for (reader, target) in readers.iter().zip(&targets) {
                            loop {
                                let seen = reader.seen.notified();
                                if reader.frames.load(Ordering::Relaxed) >= *target {
                                    break;
                                }
                                let _ = tokio::time::timeout(Duration::from_secs(30), seen).await;
                            }
                        }
                        total += started.elapsed();
                    }
                    total
                })
            });
        });
        drop(readers);
    }
    group.finish();
    runtime.block_on(broker.shutdown());
}

criterion_group!(benches, fanout);
criterion_main!(benches);
