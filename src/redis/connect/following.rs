//! One primary, followed: a multiplexed connection made on first use, and made again — the
//! primary found again — after a connection error or a `READONLY` answer (a primary demoted
//! under the connection). Where the primary is comes from the URL (one server) or from its
//! Sentinels (`sentinel`), which are also heard: their `+switch-master` for the service moves
//! the connection to the new primary at once, before any call fails on the old one.
//!
//! Connecting is an `attempt` (on a task of its own, shared by the callers that wait on it). A
//! connection error reaches only the callers of that one connection: each call names the
//! attempt it used, and only a failure on the current one starts the next.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, ConnectionInfo, ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::watch;

use super::attempt::{self, Attempt};
use super::sentinel;
use crate::admission::redis_url::{HostPort, SentinelTarget};

/// How long after a lost subscription to a Sentinel the next is tried.
const RETRY: Duration = Duration::from_millis(200);

/// A followed primary. Cheap to clone; every clone follows the same one.
#[derive(Clone)]
pub(crate) struct Following {
    shared: Arc<Shared>,
}

/// One connection to the primary, and the attempt that made it.
#[derive(Clone)]
pub(crate) struct Pinned {
    link: Arc<Link>,
    attempt: Arc<Attempt<Arc<Link>>>,
    shared: Arc<Shared>,
}

/// Where the primary is found.
enum Finder {
    /// The URL's one server.
    Server(redis::Client),
    /// The service's Sentinels.
    Sentinel(SentinelTarget),
}

struct Shared {
    finder: Finder,
    config: AsyncConnectionConfig,
    current: ArcSwap<Attempt<Arc<Link>>>,
    /// Where the last connection made went (`HOST:PORT`).
    primary: Mutex<Option<String>>,
    /// Counts the moves to another primary.
    changes: watch::Sender<u64>,
    /// The Sentinel to ask first: the last that answered.
    first: AtomicUsize,
    /// The task hearing the Sentinels' announcements (ended with the last clone).
    heard: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct Link {
    conn: MultiplexedConnection,
    at: String,
    info: ConnectionInfo,
}

impl Following {
    /// The URL's one server.
    pub(crate) fn server(client: redis::Client, config: AsyncConnectionConfig) -> Following {
        Following::new(Finder::Server(client), config)
    }

    /// The service its Sentinels name; their announcements are heard from now on (pinging a
    /// quiet subscription every `quiet`, taking no answer within `timeout` for a lost one).
    pub(crate) fn sentinel(
        target: SentinelTarget,
        config: AsyncConnectionConfig,
        quiet: Duration,
        timeout: Duration,
    ) -> Following {
        let following = Following::new(Finder::Sentinel(target), config);
        let task = tokio::spawn(hear_switches(
            Arc::downgrade(&following.shared),
            quiet,
            timeout,
        ));
        *crate::sync::lock(&following.shared.heard) = Some(task);
        following
    }

    fn new(finder: Finder, config: AsyncConnectionConfig) -> Following {
        Following {
            shared: Arc::new(Shared {
                finder,
                config,
                current: ArcSwap::from_pointee(Attempt::new()),
                primary: Mutex::new(None),
                changes: watch::channel(0).0,
                first: AtomicUsize::new(0),
                heard: Mutex::new(None),
            }),
        }
    }

    /// The current connection, made now if need be.
    pub(crate) async fn pinned(&self) -> Result<Pinned, RedisError> {
        let attempt = self.shared.current.load_full();
        let link = attempt.outcome(|| self.shared.connecting()).await;
        match link {
            Ok(link) => Ok(Pinned {
                link,
                attempt,
                shared: Arc::clone(&self.shared),
            }),
            Err(e) => {
                // The next call makes a new attempt (each call makes at most one, so a dead
                // Redis costs one connection try per call, behind the circuit).
                self.shared.again(&attempt);
                Err(e)
            }
        }
    }

    /// A subscriber connection to the current primary.
    pub(crate) async fn subscriber(&self) -> Result<PubSub, RedisError> {
        self.pinned().await?.subscriber().await
    }

    /// Counts the moves to another primary (a failover followed).
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    pub(crate) async fn send(&self, cmd: &redis::Cmd) -> Result<redis::Value, RedisError> {
        self.pinned().await?.send(cmd).await
    }

    pub(crate) async fn send_all(
        &self,
        pipeline: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> Result<Vec<redis::Value>, RedisError> {
        self.pinned().await?.send_all(pipeline, offset, count).await
    }
}

impl Pinned {
    pub(crate) async fn send(&self, cmd: &redis::Cmd) -> Result<redis::Value, RedisError> {
        let mut conn = self.link.conn.clone();
        let result = conn.send_packed_command(cmd).await;
        self.judge(&result);
        result
    }

    pub(crate) async fn send_all(
        &self,
        pipeline: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> Result<Vec<redis::Value>, RedisError> {
        let mut conn = self.link.conn.clone();
        let result = conn.send_packed_commands(pipeline, offset, count).await;
        self.judge(&result);
        result
    }

    /// A subscriber connection to this connection's primary.
    pub(crate) async fn subscriber(&self) -> Result<PubSub, RedisError> {
        redis::Client::open(self.link.info.clone())?
            .get_async_pubsub()
            .await
    }

    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// After a connection error, or a primary that became a replica, the next call finds the
    /// primary again and connects.
    fn judge<T>(&self, result: &Result<T, RedisError>) {
        if let Err(e) = result
            && (e.is_unrecoverable_error()
                || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly))
        {
            self.shared.again(&self.attempt);
        }
    }
}

impl Shared {
    /// The next call makes a new attempt, unless `seen` is no longer the current one.
    fn again(&self, seen: &Arc<Attempt<Arc<Link>>>) -> Option<Arc<Attempt<Arc<Link>>>> {
        attempt::again(&self.current, seen)
    }

    /// [`Shared::connect`] as a task can run it.
    fn connecting(
        self: &Arc<Self>,
    ) -> impl std::future::Future<Output = Result<Arc<Link>, RedisError>> + Send + 'static {
        let shared = Arc::clone(self);
        async move { shared.connect().await.map(Arc::new) }
    }

    /// Finds the primary and connects to it.
    async fn connect(&self) -> Result<Link, RedisError> {
        let link = match &self.finder {
            Finder::Server(client) => {
                let conn = client
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?;
                let info = client.get_connection_info().clone();
                Link {
                    conn,
                    at: info.addr().to_string(),
                    info,
                }
            }
            Finder::Sentinel(target) => {
                let first = self.first.load(Ordering::Relaxed);
                let found = sentinel::primary(target, &self.config, first).await?;
                // Relaxed: a hint of where to start next time.
                self.first.store(found.sentinel, Ordering::Relaxed);
                Link {
                    conn: found.conn,
                    at: found.at.to_string(),
                    info: found.info,
                }
            }
        };
        let mut primary = crate::sync::lock(&self.primary);
        if primary.as_deref() != Some(link.at.as_str()) {
            if let Some(was) = primary.as_deref() {
                tracing::warn!(from = was, to = %link.at, "redis primary changed: following it");
                self.changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            *primary = Some(link.at.clone());
        }
        Ok(link)
    }

    /// The Sentinels announced (or say) that the primary is `to`: connect there now, unless
    /// the connection is there already.
    fn follow(self: &Arc<Self>, to: &HostPort) {
        if crate::sync::lock(&self.primary).as_deref() == Some(to.to_string().as_str()) {
            return;
        }
        let seen = self.current.load_full();
        if let Some(fresh) = self.again(&seen) {
            fresh.start(|| self.connecting());
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(task) = self
            .heard
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// Hears one Sentinel at a time (round the list) for `+switch-master`, and follows each
/// announcement for the service. After each (re)subscription the Sentinels are asked once
/// where the primary is, so a switch announced while none was heard is followed too.
async fn hear_switches(shared: Weak<Shared>, quiet: Duration, timeout: Duration) {
    let mut next = 0usize;
    loop {
        let (sentinel, credentials, service) = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let Finder::Sentinel(target) = &shared.finder else {
                return;
            };
            let sentinel = target.sentinels[next % target.sentinels.len()].clone();
            (sentinel, target.credentials.clone(), target.service.clone())
        };
        next = next.wrapping_add(1);
        if let Ok(Ok(pubsub)) =
            tokio::time::timeout(timeout, sentinel::switches(&sentinel, &credentials)).await
        {
            {
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                if let Finder::Sentinel(target) = &shared.finder {
                    let first = shared.first.load(Ordering::Relaxed);
                    if let Some(at) = sentinel::named(target, &shared.config, first).await {
                        shared.follow(&at);
                    }
                }
            }
            let (mut sink, mut stream) = pubsub.split();
            loop {
                let next_message = std::future::poll_fn(|cx| {
                    futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
                });
                tokio::select! {
                    message = next_message => match message {
                        Some(message) => {
                            let Some(to) = sentinel::switched_to(message.get_payload_bytes(), &service) else {
                                continue;
                            };
                            let Some(shared) = shared.upgrade() else { return };
                            tracing::warn!(to = %to, sentinel = %sentinel, "the sentinels switched the redis primary");
                            shared.follow(&to);
                        }
                        None => break,
                    },
                    _ = tokio::time::sleep(quiet) => {
                        let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                        if !matches!(pong, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}
