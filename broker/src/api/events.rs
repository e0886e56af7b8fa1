//! `GET /api/operator/v1/events`: the Operator V1 event stream (server-sent events).
//!
//! **Before the stream**, everything that can be refused is, as JSON: the cursor comes from
//! `?cursor=` or, when that is empty, the `Last-Event-ID` header (each at most 1024 characters;
//! `cursor` given twice or the header twice is 400 `invalid_request`); a cursor that does not
//! decode is 400; one older than the retained log is 410 `cursor_expired`; an operator (or the
//! broker) already holding as many streams as allowed gets 503 `temporarily_unavailable` with
//! `Retry-After` (see `event_streams`). An empty cursor replays every retained event.
//!
//! **The stream**: `200`, `Content-Type: text/event-stream`, `Cache-Control: no-store`. Each
//! event is one frame, `id: <cursor>\ndata: <BrokerEvent JSON>\n\n` (no `event:`, no `retry:`),
//! the backlog in pages of [`PAGE`], each page one write. Then live events in order: the stream
//! waits on the store's event bell (the newest committed sequence, published after each commit)
//! and reads strictly after the last sequence it sent, so nothing committed between the backlog
//! and the wait is lost, and nothing polls the store. Idle for [`HEARTBEAT`], it writes
//! `: heartbeat\n\n`. It never ends on its own: only when the client hangs up (the body is
//! dropped, and with it the stream's slot), at shutdown (the body ends, so a graceful shutdown
//! does not wait for it), or when retention deleted events it had not sent yet (the client's
//! reconnect then gets 410).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use serde_json::json;
use tokio::sync::watch;

use super::error::ApiError;
use super::operator::credential::OperatorName;
use super::operator::error::{ErrorCode, OperatorError, OperatorResult};
use crate::core::Core;
use crate::event_streams::StreamSlot;
use crate::store::StoredEvent;
use crate::store::events::{EventPage, MAX_CURSOR_CHARS, decode_cursor};

/// Events per backlog read (and per write).
pub const PAGE: u32 = 100;

/// How long a stream stays silent before it writes a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(15);

/// The frame written when a stream has been idle for [`HEARTBEAT`].
const HEARTBEAT_FRAME: &[u8] = b": heartbeat\n\n";

/// Where a stream starts, as the request gave it: the query's `cursor`, else `Last-Event-ID`,
/// else nothing (every retained event). Bound before authentication, as upstream binds
/// parameters: a repeated or overlong one is a 400 `invalid_request` whoever asks.
pub(crate) struct StreamStart(Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for StreamStart {
    type Rejection = OperatorError;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<StreamStart, OperatorError> {
        stream_start(parts.uri.query(), &parts.headers)
            .map(StreamStart)
            .map_err(|_| OperatorError::invalid())
    }
}

/// The cursor a stream starts after, from the request's query string and headers: the query's
/// `cursor` (at most once) unless empty, else the `Last-Event-ID` header (trimmed) unless
/// empty, else none. The header given more than once is a 400 whichever starts the stream, and
/// either longer than [`MAX_CURSOR_CHARS`] is a 400. Other query parameters are ignored. The
/// cursor is not decoded here (that is [`decode_cursor`], after authentication).
pub fn stream_start(query: Option<&str>, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    // The header is bound first, as upstream's generated router does: given twice, it is a 400
    // whatever the query says.
    let mut ids = headers.get_all("last-event-id").iter();
    let (first, second) = (ids.next(), ids.next());
    if second.is_some() {
        return Err(ApiError::invalid("Last-Event-ID is given more than once."));
    }
    let mut cursor: Option<String> = None;
    for (name, value) in query_pairs(query.unwrap_or(""))? {
        if name != "cursor" {
            continue;
        }
        if cursor.is_some() {
            return Err(ApiError::invalid(
                "The query parameter \"cursor\" is given twice.",
            ));
        }
        cursor = Some(value);
    }
    if let Some(cursor) = cursor.filter(|c| !c.is_empty()) {
        bounded("cursor", &cursor)?;
        return Ok(Some(cursor));
    }
    let Some(value) = first else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| ApiError::invalid("Last-Event-ID is not visible ASCII."))?
        .trim();
    bounded("Last-Event-ID", value)?;
    Ok((!value.is_empty()).then(|| value.to_owned()))
}

fn bounded(what: &str, cursor: &str) -> Result<(), ApiError> {
    if cursor.chars().count() > MAX_CURSOR_CHARS {
        return Err(ApiError::invalid(format!(
            "{what} is longer than {MAX_CURSOR_CHARS} characters."
        )));
    }
    Ok(())
}

/// The query's pairs, percent-decoded (as axum's `Query` decodes them).
fn query_pairs(query: &str) -> Result<Vec<(String, String)>, ApiError> {
    let uri: axum::http::Uri = format!("/?{query}")
        .parse()
        .map_err(|_| ApiError::invalid("The query does not parse."))?;
    axum::extract::Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .map(|axum::extract::Query(pairs)| pairs)
        .map_err(|rejection| ApiError::invalid(rejection.body_text()))
}

fn cursor_expired() -> OperatorError {
    OperatorError::new(
        StatusCode::GONE,
        ErrorCode::CursorExpired,
        "cursor is no longer retained",
    )
}

/// `GET /api/operator/v1/events`.
pub(crate) async fn stream_events(
    State(core): State<Arc<Core>>,
    StreamStart(start): StreamStart,
    OperatorName(operator): OperatorName,
) -> OperatorResult {
    let after = match &start {
        Some(cursor) => Some(decode_cursor(cursor).map_err(|_| OperatorError::invalid())?),
        None => None,
    };
    let Ok(slot) = core.event_streams.enter(&operator) else {
        // No room for one more stream; but a cursor the log no longer holds is 410 whatever
        // the room (a consumer re-syncs on `cursor_expired` and only backs off on a 503).
        if after.is_some()
            && let EventPage::Expired = core.db.events_after(after, 1).await?
        {
            return Err(cursor_expired());
        }
        return Err(OperatorError::unavailable(
            ErrorCode::TemporarilyUnavailable,
        ));
    };
    // Subscribed before the first read: a commit after the read rings this receiver.
    let newest = core.db.event_bell().subscribe();
    let (start, events, more) = match core.db.events_after(after, PAGE).await? {
        EventPage::Expired => return Err(cursor_expired()),
        EventPage::Events {
            after,
            events,
            more,
        } => (after, events, more),
    };
    let stream = Stream {
        after: start,
        first: Some(events),
        more,
        checked: start,
        shutdown: core.shutdown.clone(),
        core,
        newest,
        slot,
    };
    let body = Body::from_stream(futures_util::stream::unfold(stream, Stream::next));
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    Ok(response)
}

/// One open stream: where it is, and what wakes it.
struct Stream {
    core: Arc<Core>,
    /// The sequence of the last event sent (or the cursor it started after).
    after: i64,
    /// The first page, read before the response (so a 410 could still be answered).
    first: Option<Vec<StoredEvent>>,
    /// Whether more events are stored after `after` than the last page held.
    more: bool,
    /// The newest sequence the bell had published when a read last found nothing new: waits
    /// are for a sequence past it, so a read never repeats without a new commit.
    checked: i64,
    newest: watch::Receiver<i64>,
    shutdown: watch::Receiver<bool>,
    /// Held for as long as the stream lives (the body holds the stream).
    slot: StreamSlot,
}

type Chunk = Result<Bytes, std::io::Error>;

impl Stream {
    /// The next write: a page of frames, a heartbeat, or the end.
    async fn next(mut self) -> Option<(Chunk, Stream)> {
        loop {
            if *self.shutdown.borrow() {
                return None;
            }
            if let Some(events) = self.first.take() {
                if let Some(chunk) = self.frames(&events) {
                    return Some((Ok(chunk), self));
                }
                continue;
            }
            if self.more || *self.newest.borrow() > self.after.max(self.checked) {
                let published = *self.newest.borrow();
                match self.core.db.events_after(Some(self.after), PAGE).await {
                    Ok(EventPage::Events { events, more, .. }) => {
                        self.more = more;
                        if let Some(chunk) = self.frames(&events) {
                            return Some((Ok(chunk), self));
                        }
                        // Nothing past `after` despite the bell: wait for the next commit.
                        self.checked = published;
                    }
                    Ok(EventPage::Expired) => {
                        tracing::info!("an event stream fell behind retention; ending it");
                        return None;
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "an event stream could not read the log; ending it");
                        return None;
                    }
                }
            }
            let after = self.after.max(self.checked);
            let Stream {
                newest, shutdown, ..
            } = &mut self;
            let bell_gone = tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => return None,
                woke = newest.wait_for(|seq| *seq > after) => woke.is_err(),
                () = tokio::time::sleep(HEARTBEAT) => false,
            };
            if bell_gone {
                return None;
            }
            if *self.newest.borrow() <= after {
                // Silent for a whole heartbeat interval.
                return Some((Ok(Bytes::from_static(HEARTBEAT_FRAME)), self));
            }
        }
    }

    /// The frames of `events` as one write (moving `after` past them), or `None` for none.
    fn frames(&mut self, events: &[StoredEvent]) -> Option<Bytes> {
        let last = events.last()?;
        let mut out = String::with_capacity(events.len() * 256);
        for event in events {
            let cursor = event.cursor();
            let data = json!({
                "cursor": cursor,
                "kind": event.kind.as_str(),
                "request_id": event.request_id,
                "revision": event.revision,
                "status": event.status.as_str(),
                "occurred_at": event.occurred_at,
                "used_count": event.used_count,
            });
            out.push_str("id: ");
            out.push_str(&cursor);
            out.push_str("\ndata: ");
            out.push_str(&data.to_string());
            out.push_str("\n\n");
        }
        self.after = last.seq;
        self.slot.delivered(events.len() as u64);
        Some(Bytes::from(out))
    }
}
