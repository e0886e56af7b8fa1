//! Waking across processes. Every transaction that writes an event or changes an operation
//! sends `NOTIFY admission_changes, '<operation id> <new state>'` (delivered when it commits;
//! a stream's deletion sends its id). Each
//! replica keeps one connection of its own (outside the pool) that `LISTEN`s, reconnecting with
//! a growing pause when it is cut; a notification
//!
//! - wakes the numbering task, which numbers the events that are ready (`events::assign`) and
//!   rings the event bell, so event streams on every replica wake; and
//! - is published to the store's change feed
//!   ([`DurableStore::changes`](super::super::durable::DurableStore::changes)), so a wait on
//!   one replica wakes on a change made on another. After a reconnect an empty payload is
//!   published: anything may have changed while the connection was down.
//!
//! The numbering task also runs every [`FALLBACK`] without being woken, so a lost notification
//! (or a horizon held back by a long transaction) delays a reader by at most that; and it
//! measures the database's size now and then for `sizes`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, broadcast};
use tokio_postgres::AsyncMessage;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::super::bell::EventBell;
use super::super::error::StoreError;
use super::error::{sort, sort_pool};
use super::numbering::{Assigner, assign};
use super::schema::CHANGES_CHANNEL;

/// How often events are numbered without a notification.
pub const FALLBACK: Duration = Duration::from_secs(1);

/// How many fallback rounds pass between two measurements of the database's size.
const MEASURE_EVERY: u32 = 30;

/// The longest pause between two attempts to reconnect the listener.
const MOST_BACKOFF: Duration = Duration::from_secs(5);

/// Keeps a `LISTEN` connection to the database and forwards its notifications, for as long as
/// the store lives (its handle aborts this task).
pub(super) async fn listen(
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    shown: Arc<str>,
    changes: broadcast::Sender<String>,
    wake: Arc<Notify>,
    listening: tokio::sync::watch::Sender<bool>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut was_cut = false;
    loop {
        match config.connect(tls.clone()).await {
            Ok((client, mut connection)) => {
                let sql = format!("LISTEN {CHANGES_CHANNEL}");
                let ready = {
                    let listening = client.batch_execute(&sql);
                    tokio::pin!(listening);
                    // The connection must be driven for the LISTEN to be answered.
                    loop {
                        tokio::select! {
                            done = &mut listening => break done.is_ok(),
                            message = std::future::poll_fn(|cx| connection.poll_message(cx)) => {
                                match message {
                                    Some(Ok(_)) => {}
                                    _ => break false,
                                }
                            }
                        }
                    }
                };
                if ready {
                    if was_cut {
                        tracing::info!(database = %shown, "the store's listener is back");
                    }
                    backoff = Duration::from_millis(100);
                    listening.send_replace(true);
                    // Anything may have changed while no one listened.
                    let _ = changes.send(String::new());
                    wake.notify_one();
                    while let Some(message) =
                        std::future::poll_fn(|cx| connection.poll_message(cx)).await
                    {
                        match message {
                            Ok(AsyncMessage::Notification(note)) => {
                                let _ = changes.send(note.payload().to_owned());
                                wake.notify_one();
                            }
                            Ok(_) => {}
                            Err(err) => {
                                tracing::warn!(database = %shown, error = %err, "the store's listener was cut; reconnecting");
                                break;
                            }
                        }
                    }
                }
                // The client lives as long as the connection is read: dropping it closes it.
                drop(client);
            }
            Err(err) => {
                tracing::warn!(database = %shown, error = %err, retry_in = ?backoff, "the store's listener cannot connect");
            }
        }
        was_cut = true;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MOST_BACKOFF);
    }
}

/// Numbers ready events and rings `bell`, when woken and every [`FALLBACK`]; measures the
/// database's size into `bytes` every [`MEASURE_EVERY`] rounds. Runs for as long as the store
/// lives.
pub(super) async fn assign_positions(
    pool: deadpool_postgres::Pool,
    shown: Arc<str>,
    bell: EventBell,
    wake: Arc<Notify>,
    bytes: Arc<AtomicU64>,
) {
    let mut rounds = 0u32;
    loop {
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(FALLBACK) => {
                rounds += 1;
                if rounds.is_multiple_of(MEASURE_EVERY)
                    && let Ok(measured) = measure(&pool, &shown).await
                {
                    bytes.store(measured, Ordering::Relaxed);
                }
            }
        }
        match assign(&pool, &shown, Assigner::Waits).await {
            Ok(assigned) => bell.rang(assigned.high_water, 0),
            Err(err) => {
                tracing::debug!(database = %shown, error = %err, "numbering events failed; retrying");
            }
        }
    }
}

/// The current database's size in bytes.
pub(super) async fn measure(
    pool: &deadpool_postgres::Pool,
    shown: &str,
) -> Result<u64, StoreError> {
    let client = pool.get().await.map_err(|e| sort_pool(shown, e))?;
    let row = client
        .query_one("SELECT pg_database_size(current_database())", &[])
        .await
        .map_err(|e| sort(shown, e))?;
    Ok(row.get::<_, i64>(0).max(0) as u64)
}
