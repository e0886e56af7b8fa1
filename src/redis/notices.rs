//! The deployment's notices, heard on one subscriber connection per replica: the batch, reap
//! and replace scripts `PUBLISH` on `{prefix}:notices` when they lower a count (a batch all of
//! its notices in one message, one a line, and only while some replica may remember a refusal:
//! see `memory`), and each replica's refusal memory (`memory`)
//! forgets what a notice may have changed.
//!
//! The subscription is the memory's licence: while it is live the memory remembers and answers;
//! the moment it is lost (the connection failed, or a ping went unanswered) everything is
//! forgotten, and nothing is remembered until it is made again — a notice missed meanwhile can
//! then not leave a stale refusal behind.

use std::sync::Arc;
use std::time::Duration;

use super::memory::RefusalMemory;

/// How long after a lost subscription the next attempt is made.
const RETRY: Duration = Duration::from_millis(200);

/// Hears `channel` on its own connection for as long as the task runs, feeding `memory`; pings
/// after `quiet` without a message, and takes a ping unanswered within `timeout` for a lost
/// connection.
pub(super) async fn listen(
    client: redis::Client,
    channel: String,
    memory: Arc<RefusalMemory>,
    quiet: Duration,
    timeout: Duration,
) {
    loop {
        if let Ok(Ok(pubsub)) = tokio::time::timeout(timeout, client.get_async_pubsub()).await {
            let (mut sink, mut stream) = pubsub.split();
            if let Ok(Ok(())) = tokio::time::timeout(timeout, sink.subscribe(&channel)).await {
                memory.subscribed();
                loop {
                    let next = std::future::poll_fn(|cx| {
                        futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
                    });
                    tokio::select! {
                        message = next => match message {
                            Some(message) => memory.notice(message.get_payload_bytes()),
                            None => break,
                        },
                        _ = tokio::time::sleep(quiet) => {
                            // Any answer will do: on RESP2 a subscribed connection answers `["pong", ""]`, which
                            // is no string (read as one, every quiet period looked like a lost connection).
                            let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                            if !matches!(pong, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                memory.unsubscribed();
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}
