//! The fairness layer's promises, checked through the layer itself over a tower service whose
//! response bodies the test holds open or ends.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{Request, Response, StatusCode, request::Parts};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tower::{Layer, ServiceExt};

use super::*;

/// A response body that lasts until the test drops its sender, yielding what is sent meanwhile.
struct Held(mpsc::Receiver<Bytes>);

impl Body for Held {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }
}

/// `x-client: NAME` and `x-cost: N` say whose and how heavy; `/healthz` is exempt; no client is
/// unkeyed.
fn classify(head: &Parts) -> Class {
    if head.uri.path() == "/healthz" {
        return Class::Exempt;
    }
    let cost = head
        .headers
        .get("x-cost")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1);
    match head.headers.get("x-client").and_then(|v| v.to_str().ok()) {
        Some(client) => Class::client(client, cost),
        None => Class::Unkeyed { cost },
    }
}

type Svc = FairnessService<
    tower::util::BoxCloneService<Request<()>, Response<Held>, Infallible>,
    fn(&Parts) -> Class,
>;

/// A layered service whose `/hold` responses stay open until the sender handed out on `holds` is
/// dropped; every other response ends at once.
fn service(fairness: &Fairness) -> (Svc, mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>) {
    let (holds, held) = mpsc::unbounded_channel();
    let inner = tower::service_fn(move |request: Request<()>| {
        let holds = holds.clone();
        async move {
            let (send, receive) = mpsc::channel(4);
            if request.uri().path() == "/hold" {
                let _ = holds.send(send);
            }
            Ok::<_, Infallible>(Response::new(Held(receive)))
        }
    });
    let layer = FairnessLayer::new(fairness.clone(), classify as fn(&Parts) -> Class);
    (layer.layer(tower::util::BoxCloneService::new(inner)), held)
}

fn request(path: &str, client: Option<&str>, cost: u32) -> Request<()> {
    let mut request = Request::get(path).header("x-cost", cost);
    if let Some(client) = client {
        request = request.header("x-client", client);
    }
    request.body(()).unwrap()
}

async fn send(service: &Svc, path: &str, client: Option<&str>) -> Response<FairBody<Held>> {
    service
        .clone()
        .oneshot(request(path, client, 1))
        .await
        .unwrap()
}

fn config(per_client: u32, reserved: u32, total: u32, depth: u32) -> FairnessConfig {
    FairnessConfig {
        per_client_units: per_client,
        exempt_reserved_units: reserved,
        total_units: total,
        queue_wait: Duration::from_secs(60),
        queue_depth: depth,
        retry_after: Duration::from_secs(3),
    }
}

/// Polls `until` between yields, a bounded number of times.
async fn eventually(mut until: impl FnMut() -> bool) -> bool {
    for _ in 0..2_000 {
        if until() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    until()
}

#[test]
fn numbers_that_cannot_work_are_refused() {
    assert_eq!(FairnessConfig::default().problem(), None);
    for bad in [
        config(0, 1, 10, 1),
        config(4, 10, 10, 1),
        config(4, 6, 10, 1),
        config(9, 1, 10, 1),
    ] {
        assert!(bad.problem().is_some(), "{bad:?}");
        assert!(Fairness::new(bad).is_err());
    }
    assert_eq!(config(3, 6, 10, 0).problem(), None);
}

#[tokio::test]
async fn one_client_at_its_share_makes_no_other_client_or_exempt_request_wait() {
    // No queue at all: a request that would have to wait is refused, so every 200 below was
    // served without waiting.
    let fairness = Fairness::new(config(2, 1, 5, 0)).unwrap();
    let (service, mut held) = service(&fairness);
    let mut open = Vec::new();
    for _ in 0..2 {
        open.push(send(&service, "/hold", Some("a")).await);
        assert!(held.recv().await.is_some());
    }
    assert_eq!(
        send(&service, "/quick", Some("a")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "a is at its share"
    );
    for _ in 0..3 {
        assert_eq!(
            send(&service, "/quick", Some("b")).await.status(),
            StatusCode::OK
        );
        assert_eq!(
            send(&service, "/healthz", None).await.status(),
            StatusCode::OK
        );
    }
    // b takes the rest of the pool: the clients now hold all they may.
    for _ in 0..2 {
        open.push(send(&service, "/hold", Some("b")).await);
    }
    assert_eq!(fairness.snapshot().client_units, 4);
    assert_eq!(
        send(&service, "/quick", Some("c")).await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the clients' pool is full"
    );
    // The reserve is the exempt requests' alone, and they may borrow past it.
    let mut exempt = Vec::new();
    for _ in 0..3 {
        let response = send(&service, "/healthz", None).await;
        assert_eq!(response.status(), StatusCode::OK);
        exempt.push(response);
    }
    assert_eq!(fairness.snapshot().exempt_in_flight, 3);
    drop((open, exempt));
    assert!(fairness.snapshot().is_idle(), "{:?}", fairness.snapshot());
}

#[tokio::test]
async fn a_request_past_its_clients_queue_gets_429_with_retry_after() {
    let fairness = Fairness::new(config(1, 1, 5, 1)).unwrap();
    let mut registry = Registry::default();
    fairness.register(&mut registry);
    let (service, mut held) = service(&fairness);
    let first = send(&service, "/hold", Some("a")).await;
    let hold = held.recv().await.unwrap();
    let queued = tokio::spawn({
        let service = service.clone();
        async move {
            let response = service.oneshot(request("/quick", Some("a"), 1)).await;
            response.unwrap().status()
        }
    });
    assert!(eventually(|| fairness.snapshot().client("a").unwrap().queued == 1).await);
    // One request of a's in flight, one queued behind it: the metrics say so.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"broker_client_requests_in_flight{client="a"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"broker_client_requests_queued{client="a"} 1"#),
        "{text}"
    );

    let refused = send(&service, "/quick", Some("a")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "3");
    assert_eq!(refused.headers()["content-type"], "application/json");
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], REFUSAL_CODE);

    // The held body ends: the queued request gets the room.
    drop(hold);
    let ended = first.into_body().collect().await;
    assert!(ended.is_ok());
    assert_eq!(queued.await.unwrap(), StatusCode::OK);
    assert!(fairness.snapshot().is_idle());

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"broker_client_requests_rejected_total{client="a",reason="queue_full"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"broker_client_units_in_flight{client="a"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"broker_client_requests_in_flight{client="a"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"broker_client_requests_queued{client="a"} 0"#),
        "{text}"
    );
    assert!(text.contains("broker_exempt_requests_total 0"), "{text}");
}

#[tokio::test]
async fn a_refusal_can_speak_the_servers_own_envelope() {
    let fairness = Fairness::new(config(1, 1, 5, 0)).unwrap();
    let inner = tower::service_fn(|_: Request<()>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new()))
    });
    let layer = FairnessLayer::new(fairness.clone(), classify).refusal_response(|refusal| {
        let mut response = Response::new(Bytes::from_static(b"busy"));
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        assert_eq!(refusal.client.as_deref(), Some("a"));
        response
    });
    let service = layer.layer(inner);
    let holder = fairness.acquire(Class::client("a", 1)).await.unwrap();
    let refused = service
        .clone()
        .oneshot(request("/x", Some("a"), 1))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"busy");
    drop(holder);
    assert!(fairness.snapshot().is_idle());
}

#[tokio::test]
async fn units_come_back_when_a_response_body_is_dropped_mid_stream() {
    let fairness = Fairness::new(config(2, 1, 5, 0)).unwrap();
    let (service, mut held) = service(&fairness);
    let response = send(&service, "/hold", Some("a")).await;
    let stream = held.recv().await.unwrap();
    stream
        .send(Bytes::from_static(b"first part"))
        .await
        .unwrap();
    let mut body = response.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "first part");
    // The handler returned long ago; the body still holds the units.
    assert_eq!(fairness.snapshot().client("a").unwrap().units, 1);
    assert!(!stream.is_closed(), "the body has not ended");
    drop(body);
    assert!(fairness.snapshot().is_idle());
}

#[tokio::test]
async fn units_come_back_when_the_body_ends_before_it_is_dropped() {
    let fairness = Fairness::new(config(2, 1, 5, 0)).unwrap();
    let (service, _held) = service(&fairness);
    let response = send(&service, "/quick", Some("a")).await;
    let mut body = response.into_body();
    assert!(body.frame().await.is_none());
    assert!(fairness.snapshot().is_idle(), "ended, not yet dropped");
    drop(body);
}

#[tokio::test]
async fn a_waiting_request_dropped_leaves_nothing_behind_even_once_granted() {
    let fairness = Fairness::new(config(1, 1, 5, 4)).unwrap();
    let noop = &mut Context::from_waker(std::task::Waker::noop());

    // Dropped while waiting: it leaves the queue.
    let holder = fairness.acquire(Class::client("a", 1)).await.unwrap();
    let mut waiting = Box::pin(fairness.acquire(Class::client("a", 1)));
    assert!(waiting.as_mut().poll(noop).is_pending());
    assert_eq!(fairness.snapshot().client("a").unwrap().queued, 1);
    drop(waiting);
    assert_eq!(fairness.snapshot().client("a").unwrap().queued, 0);

    // Dropped after the room was granted but before it was taken: the room goes back.
    let mut waiting = Box::pin(fairness.acquire(Class::client("a", 1)));
    assert!(waiting.as_mut().poll(noop).is_pending());
    drop(holder);
    let granted = fairness.snapshot();
    assert_eq!(
        granted.client("a").unwrap().units,
        1,
        "granted to the waiter"
    );
    drop(waiting);
    assert!(fairness.snapshot().is_idle(), "{:?}", fairness.snapshot());
}

#[tokio::test]
async fn a_request_that_waits_too_long_is_refused_and_leaves_the_queue() {
    let fairness = Fairness::new(FairnessConfig {
        queue_wait: Duration::from_millis(20),
        ..config(1, 1, 5, 4)
    })
    .unwrap();
    let holder = fairness.acquire(Class::client("a", 1)).await.unwrap();
    let refused = fairness.acquire(Class::client("a", 1)).await.unwrap_err();
    assert_eq!(refused.reason, RefusalReason::QueueTimeout);
    assert_eq!(refused.retry_after_secs(), 3);
    assert_eq!(fairness.snapshot().client("a").unwrap().queued, 0);
    drop(holder);
    assert!(fairness.snapshot().is_idle());
}

#[tokio::test]
async fn room_goes_round_the_waiting_clients_not_to_one_clients_whole_queue() {
    // The clients share 3 units, each holds at most 2.
    let fairness = Fairness::new(config(2, 1, 4, 4)).unwrap();
    let noop = &mut Context::from_waker(std::task::Waker::noop());
    let mut h = vec![
        fairness.acquire(Class::client("h", 1)).await.unwrap(),
        fairness.acquire(Class::client("h", 1)).await.unwrap(),
    ];
    let x = fairness.acquire(Class::client("x", 1)).await.unwrap();
    let mut c1 = Box::pin(fairness.acquire(Class::client("c", 1)));
    let mut c2 = Box::pin(fairness.acquire(Class::client("c", 1)));
    let mut d1 = Box::pin(fairness.acquire(Class::client("d", 1)));
    for waiting in [
        c1.as_mut().poll(noop),
        c2.as_mut().poll(noop),
        d1.as_mut().poll(noop),
    ] {
        assert!(waiting.is_pending());
    }
    // A newcomer under its share does not take the room the waiters wait for.
    let mut e = Box::pin(fairness.acquire(Class::client("e", 1)));
    assert!(e.as_mut().poll(noop).is_pending());
    h.pop();
    h.pop();
    let snapshot = fairness.snapshot();
    let units = |key| snapshot.client(key).unwrap().units;
    assert_eq!(
        (units("c"), units("d"), units("e")),
        (1, 1, 0),
        "{snapshot:?}"
    );
    assert!(matches!(c1.as_mut().poll(noop), Poll::Ready(Ok(_))));
    assert!(matches!(d1.as_mut().poll(noop), Poll::Ready(Ok(_))));
    drop(x);
    drop((c1, c2, d1, e));
    assert!(fairness.snapshot().is_idle(), "{:?}", fairness.snapshot());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_crowd_no_client_passes_its_units_and_all_come_back() {
    const CLIENTS: usize = 4;
    const REQUESTS: usize = 60;
    let config = FairnessConfig {
        queue_wait: Duration::from_secs(5),
        ..config(4, 2, 12, 8)
    };
    let fairness = Fairness::new(config).unwrap();
    // Units each client's handlers hold right now, as the handlers themselves count them, and
    // the most ever seen: the layer holds units from before a handler starts to after its
    // body ends, so these can only be lower than what the layer admitted.
    let held: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let most = Arc::new(AtomicU32::new(0));
    let most_total = Arc::new(AtomicU32::new(0));
    let inner = tower::service_fn({
        let (held, most, most_total) = (held.clone(), most.clone(), most_total.clone());
        move |request: Request<()>| {
            let (held, most, most_total) = (held.clone(), most.clone(), most_total.clone());
            async move {
                let client = request.headers().get("x-client").cloned();
                let cost: u32 = request.headers()["x-cost"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                if let Some(client) = &client {
                    let client = client.to_str().unwrap().to_owned();
                    {
                        let mut held = held.lock().unwrap();
                        let mine = held.entry(client.clone()).or_default();
                        *mine += cost;
                        // Relaxed: a maximum of values read under the lock above.
                        most.fetch_max(*mine, Ordering::Relaxed);
                        most_total.fetch_max(held.values().sum(), Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    *held.lock().unwrap().get_mut(&client).unwrap() -= cost;
                }
                Ok::<_, Infallible>(Response::new(http_body_util::Empty::<Bytes>::new()))
            }
        }
    });
    let service = FairnessLayer::new(fairness.clone(), classify).layer(inner);
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        for n in 0..REQUESTS {
            let service = service.clone();
            tasks.spawn(async move {
                let cost = (n % 3 + 1) as u32;
                let request = request("/work", Some(&format!("c{client}")), cost);
                let response = service.oneshot(request).await.unwrap();
                let status = response.status();
                let _ = response.into_body().collect().await;
                status
            });
        }
        for _ in 0..5 {
            let service = service.clone();
            tasks.spawn(async move {
                let response = service.oneshot(request("/healthz", None, 1)).await.unwrap();
                response.status()
            });
        }
    }
    let (mut served, mut refused) = (0, 0);
    while let Some(status) = tasks.join_next().await {
        match status.unwrap() {
            StatusCode::OK => served += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(served + refused, CLIENTS * (REQUESTS + 5));
    assert!(served >= CLIENTS * 5, "every exempt request was served");
    // Relaxed: read after every task was joined.
    assert!(most.load(Ordering::Relaxed) <= 4);
    assert!(most_total.load(Ordering::Relaxed) <= 10);
    assert!(fairness.snapshot().is_idle(), "{:?}", fairness.snapshot());
}

#[tokio::test]
async fn a_clients_exempt_requests_are_exempt_up_to_its_share_then_its_own_requests() {
    let fairness = Fairness::new(FairnessConfig {
        queue_wait: Duration::from_millis(10),
        ..config(4, 8, 64, 4)
    })
    .unwrap();
    let cancel = |client: &str| Class::ExemptClient { key: client.into() };
    // Four of a's cancels are exempt: they take nothing from the clients' pool.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(fairness.acquire(cancel("a")).await.unwrap());
    }
    let snapshot = fairness.snapshot();
    assert_eq!((snapshot.exempt_in_flight, snapshot.client_units), (4, 0));
    // The fifth is one of a's own requests: a unit of its share.
    held.push(fairness.acquire(cancel("a")).await.unwrap());
    let snapshot = fairness.snapshot();
    assert_eq!((snapshot.exempt_in_flight, snapshot.client_units), (4, 1));
    // With a's share full, a's next cancel waits behind a's own, then is refused; b's are exempt.
    held.push(fairness.acquire(Class::client("a", 3)).await.unwrap());
    assert!(fairness.acquire(cancel("a")).await.is_err());
    let b = fairness.acquire(cancel("b")).await.unwrap();
    assert_eq!(fairness.snapshot().exempt_in_flight, 5);
    drop((held, b));
    assert!(fairness.snapshot().is_idle());
    // Given back, a's cancels are exempt again.
    let again: Vec<_> =
        futures_util::future::join_all((0..4).map(|_| fairness.acquire(cancel("a"))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    assert_eq!(fairness.snapshot().exempt_in_flight, 4);
    drop(again);
    assert!(fairness.snapshot().is_idle());
}
