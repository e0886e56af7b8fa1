//! The deployment's notices, heard on one subscriber connection per replica: the batch, reap
//! and replace scripts `PUBLISH` on `{prefix}:notices` when they lower a count (a batch all of
//! its notices in one message, one a line, and only while some replica may remember a refusal:
//! see `memory`), and each replica's refusal memory (`memory`)
//! forgets what a notice may have changed.
//!
//! The subscription is the memory's licence: while it is live the memory remembers and answers;
//! the moment it is lost (the connection failed, a ping went unanswered, or Redis's primary
//! changed: a failover followed) everything is forgotten, and nothing is remembered until it is
//! made again, on the primary the scripts run on now — a notice missed meanwhile can then not
//! leave a stale refusal behind. The subscriber connection comes from the same room as every
//! other (`connect`), whichever kind of Redis is behind it.

use std::sync::Arc;
use std::time::Duration;

use super::connect::connection::Connection;
use super::memory::RefusalMemory;

/// How long after a lost subscription the next attempt is made.
const RETRY: Duration = Duration::from_millis(200);

/// Hears `channel` on its own connection (to the primary `conn` reaches) for as long as the task
/// runs, feeding `memory`; pings after `quiet` without a message, and takes a ping unanswered
/// within `timeout` for a lost connection, and a change of primary for one too.
pub(super) async fn listen(
    conn: Connection,
    channel: String,
    memory: Arc<RefusalMemory>,
    quiet: Duration,
    timeout: Duration,
) {
    let mut changes = conn.changes();
    loop {
        // A change from here on ends the subscription about to be made.
        changes.borrow_and_update();
        if let Ok(Ok(pubsub)) = tokio::time::timeout(timeout, conn.subscriber()).await {
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
                        Ok(()) = changes.changed() => break,
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
