//! An Operator V1 event stream read the way a client reads it: `GET /api/operator/v1/events`
//! parsed by a real SSE parser (`eventsource-stream`), every event's `data` checked against the
//! contract's `BrokerEvent` and its `id` against the event's `cursor` (as the OpenClaw client
//! does), and the raw bytes kept so a test can see the comments (heartbeats) the parser skips.

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures_util::{Stream, StreamExt};
use serde_json::Value;

use super::eventually::PATIENCE;
use super::http::Reply;
use super::operator_contract;

type Events = Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Send>>;

/// An open stream.
pub struct EventStream {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    events: Events,
    raw: Arc<Mutex<Vec<u8>>>,
}

/// What [`EventStream::next_or_end`] read.
pub enum Next {
    Event(Value),
    Ended,
    Quiet,
}

/// How opening a stream went: a stream (200) or a refusal before it (JSON).
pub enum Opened {
    Stream(EventStream),
    Refused(Reply),
}

impl Opened {
    /// The stream; fails the test on a refusal.
    pub fn stream(self) -> EventStream {
        match self {
            Opened::Stream(stream) => stream,
            Opened::Refused(reply) => {
                panic!("the stream was refused: {} {}", reply.status, reply.body)
            }
        }
    }

    /// The refusal; fails the test on a stream.
    pub fn refused(self) -> Reply {
        match self {
            Opened::Refused(reply) => reply,
            Opened::Stream(stream) => panic!("the stream opened: {}", stream.status),
        }
    }
}

/// Opens the event stream of the broker at `base` as `token`, with the query string `query`
/// (e.g. `cursor=AAAAAAAAAAE`, or empty) and these `Last-Event-ID` headers. Waits at most
/// [`PATIENCE`] for the response head.
pub async fn open(base: &str, token: &str, query: &str, last_event_ids: &[&str]) -> Opened {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut request = http
        .get(format!("{base}/api/operator/v1/events?{query}"))
        .header("accept", "text/event-stream");
    if !token.is_empty() {
        request = request.bearer_auth(token);
    }
    for id in last_event_ids {
        request = request.header("last-event-id", *id);
    }
    let response = tokio::time::timeout(PATIENCE, request.send())
        .await
        .expect("the response head arrived")
        .unwrap();
    if response.status() != 200 {
        return Opened::Refused(Reply::read(response).await.unwrap());
    }
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let raw = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&raw);
    let bytes = futures_util::stream::unfold(response, move |mut response| {
        let sink = Arc::clone(&sink);
        async move {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    sink.lock().unwrap().extend_from_slice(&chunk);
                    Some((Ok(chunk), response))
                }
                Ok(None) => None,
                Err(err) => Some((Err(err), response)),
            }
        }
    });
    Opened::Stream(EventStream {
        status,
        headers,
        events: Box::pin(bytes.eventsource()),
        raw,
    })
}

impl EventStream {
    /// The next event's data (a contract `BrokerEvent` whose `cursor` is the frame's `id`), or
    /// `None` when the stream ended. Fails the test if nothing arrives within [`PATIENCE`].
    pub async fn next_event(&mut self) -> Option<Value> {
        let next = tokio::time::timeout(PATIENCE, self.events.next())
            .await
            .expect("an event or the end arrived")?;
        let event = next.expect("a well-formed frame");
        assert!(
            event.event.is_empty() || event.event == "message",
            "frames carry no `event:` field: {:?}",
            event.event
        );
        let data: Value = serde_json::from_str(&event.data).expect("data is JSON");
        operator_contract::check("BrokerEvent", &data);
        assert_eq!(data["cursor"], event.id.as_str(), "the id is the cursor");
        Some(data)
    }

    /// What comes next within `wait`, for a reader that outlives a cut stream (a failover):
    /// an event (checked as [`EventStream::next_event`] checks it), the end of the stream (it
    /// ended, or was cut: reopen it with the last cursor), or nothing yet.
    pub async fn next_or_end(&mut self, wait: std::time::Duration) -> Next {
        match tokio::time::timeout(wait, self.events.next()).await {
            Err(_) => Next::Quiet,
            Ok(None) | Ok(Some(Err(_))) => Next::Ended,
            Ok(Some(Ok(event))) => {
                let data: Value = serde_json::from_str(&event.data).expect("data is JSON");
                operator_contract::check("BrokerEvent", &data);
                assert_eq!(data["cursor"], event.id.as_str(), "the id is the cursor");
                Next::Event(data)
            }
        }
    }

    /// The next `n` events (fails the test if the stream ends first).
    pub async fn next_events(&mut self, n: usize) -> Vec<Value> {
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            events.push(self.next_event().await.expect("the stream goes on"));
        }
        events
    }

    /// Whether the stream ends (rather than yielding an event) within [`PATIENCE`].
    pub async fn ends(&mut self) -> bool {
        matches!(
            tokio::time::timeout(PATIENCE, self.events.next()).await,
            Ok(None) | Ok(Some(Err(_)))
        )
    }

    /// Reads on until the raw bytes contain `text` (comments included, which yield no event);
    /// whether they did within [`PATIENCE`]. Events read meanwhile are dropped.
    pub async fn until_raw_contains(&mut self, text: &str) -> bool {
        let deadline = std::time::Instant::now() + PATIENCE;
        while std::time::Instant::now() < deadline {
            if self.raw().contains(text) {
                return true;
            }
            let poll = std::time::Duration::from_millis(200);
            if let Ok(None) = tokio::time::timeout(poll, self.events.next()).await {
                return self.raw().contains(text);
            }
        }
        self.raw().contains(text)
    }

    /// The bytes received so far.
    pub fn raw(&self) -> String {
        String::from_utf8_lossy(&self.raw.lock().unwrap()).into_owned()
    }
}
