//! One primary, followed: a multiplexed connection made on first use, and made again — the
//! primary found again — after a connection error or a `READONLY` answer (a primary demoted
//! under the connection). Where the primary is comes from the URL (one server) or from its
//! Sentinels (`sentinel`), which are also heard, each of them: their `+switch-master` for the
//! service moves the connection to the new primary at once, before any call fails on the old
//! one.
//!
//! From the moment a Sentinel says it is failing the primary over (`+try-failover`) until the
//! connection is on the new primary (or the failover was abandoned, or a lease passed),
//! nothing is sent: a primary failed over alive (`SENTINEL FAILOVER`, or cut off from the
//! Sentinels only) goes on taking writes, and its replicas acknowledging them (`WAIT`), until
//! it is demoted, and all of them are lost when its replicas resync from the new primary. The
//! count of those moments and of the changes of primary ([`Following::turns`]) lets a write
//! acknowledged across one be taken for unacknowledged.
//!
//! Connecting is an `attempt` (on a task of its own, shared by the callers that wait on it). A
//! connection error reaches only the callers of that one connection: each call names the
//! attempt it used, and only a failure on the current one starts the next.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, ConnectionInfo, ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::watch;

use super::attempt::{self, Attempt};
use super::sentinel::{self, Announcement};
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
    /// Counts the failovers begun and the moves to another primary.
    turns: AtomicU64,
    /// A failover under way: since when, and from which primary.
    failing_over: Mutex<Option<(Instant, Option<String>)>>,
    /// Whether `failing_over` holds one: read by every call, without the lock.
    held_back: AtomicBool,
    /// The longest a failover holds calls back.
    longest_failover: Duration,
    /// The primary a Sentinel just announced, tried first by the next connection.
    announced: Mutex<Option<HostPort>>,
    /// The tasks hearing the Sentinels' announcements, one each (ended with the last clone).
    heard: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

struct Link {
    conn: MultiplexedConnection,
    at: String,
    info: ConnectionInfo,
}

impl Following {
    /// The URL's one server.
    pub(crate) fn server(client: redis::Client, config: AsyncConnectionConfig) -> Following {
        Following::new(Finder::Server(client), config, Duration::ZERO)
    }

    /// The service its Sentinels name; each Sentinel's announcements are heard from now on
    /// (pinging a quiet subscription every `quiet`, taking no answer within `timeout` for a
    /// lost one). A failover holds calls back for `longest_failover` at most.
    pub(crate) fn sentinel(
        target: SentinelTarget,
        config: AsyncConnectionConfig,
        quiet: Duration,
        timeout: Duration,
        longest_failover: Duration,
    ) -> Following {
        let sentinels = target.sentinels.len();
        let following = Following::new(Finder::Sentinel(target), config, longest_failover);
        let tasks = (0..sentinels)
            .map(|n| tokio::spawn(hear(Arc::downgrade(&following.shared), n, quiet, timeout)))
            .collect();
        *crate::sync::lock(&following.shared.heard) = tasks;
        following
    }

    fn new(finder: Finder, config: AsyncConnectionConfig, longest_failover: Duration) -> Following {
        Following {
            shared: Arc::new(Shared {
                finder,
                config,
                current: ArcSwap::from_pointee(Attempt::new()),
                primary: Mutex::new(None),
                changes: watch::channel(0).0,
                turns: AtomicU64::new(0),
                failing_over: Mutex::new(None),
                held_back: AtomicBool::new(false),
                longest_failover,
                announced: Mutex::new(None),
                heard: Mutex::new(Vec::new()),
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

    /// Counts the failovers begun and the moves to another primary: a write acknowledged
    /// while it changed may be lost.
    pub(crate) fn turns(&self) -> u64 {
        // Acquire: pairs with the Release of `begun` and `connect`.
        self.shared.turns.load(Ordering::Acquire)
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
        self.shared.not_failing_over()?;
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
        self.shared.not_failing_over()?;
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

    pub(crate) fn turns(&self) -> u64 {
        // Acquire: pairs with the Release of `begun` and `connect`.
        self.shared.turns.load(Ordering::Acquire)
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
                let announced = crate::sync::lock(&self.announced).take();
                let found = sentinel::primary(target, &self.config, announced).await?;
                Link {
                    conn: found.conn,
                    at: found.at.to_string(),
                    info: found.info,
                }
            }
        };
        // On another primary than the one being failed over: the failover is behind us (before
        // the change is told, so what it wakes is not held back).
        self.failed_over_unless_at(&link.at);
        let mut primary = crate::sync::lock(&self.primary);
        if primary.as_deref() != Some(link.at.as_str()) {
            if let Some(was) = primary.as_deref() {
                tracing::warn!(from = was, to = %link.at, "redis primary changed: following it");
                // Release: a write acknowledged before this is judged by its `turns`.
                self.turns.fetch_add(1, Ordering::Release);
                self.changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            *primary = Some(link.at.clone());
        }
        Ok(link)
    }

    /// The Sentinels announced (or say) that the primary is `to`: connect there now (it
    /// first), unless the connection is there already.
    fn follow(self: &Arc<Self>, to: &HostPort) {
        let to_text = to.to_string();
        if crate::sync::lock(&self.primary).as_deref() == Some(to_text.as_str()) {
            self.failed_over_unless_at(&to_text);
            return;
        }
        *crate::sync::lock(&self.announced) = Some(to.clone());
        let seen = self.current.load_full();
        if let Some(fresh) = self.again(&seen) {
            fresh.start(|| self.connecting());
        }
    }

    /// A Sentinel began failing the primary over: nothing is sent until the connection is on
    /// another primary (or the failover is abandoned, or `longest_failover` passed).
    fn begun(&self) {
        let mut failing_over = crate::sync::lock(&self.failing_over);
        if failing_over.is_none() {
            let from = crate::sync::lock(&self.primary).clone();
            *failing_over = Some((Instant::now(), from));
            // Release: a call that reads it set sees the failover recorded. One that read it
            // clear just before is judged by `turns`.
            self.held_back.store(true, Ordering::Release);
            // Release: a write acknowledged before this is judged by its `turns`.
            self.turns.fetch_add(1, Ordering::Release);
        }
    }

    fn abandoned(&self) {
        let mut failing_over = crate::sync::lock(&self.failing_over);
        *failing_over = None;
        // Relaxed: under the lock that orders it with `begun`.
        self.held_back.store(false, Ordering::Relaxed);
    }

    /// The connection is on `at`: a failover away from another primary is behind it.
    fn failed_over_unless_at(&self, at: &str) {
        let mut failing_over = crate::sync::lock(&self.failing_over);
        if failing_over
            .as_ref()
            .is_some_and(|(_, from)| from.as_deref() != Some(at))
        {
            *failing_over = None;
            // Relaxed: under the lock that orders it with `begun`.
            self.held_back.store(false, Ordering::Relaxed);
        }
    }

    /// An error while a failover is under way.
    fn not_failing_over(&self) -> Result<(), RedisError> {
        // Acquire: pairs with `begun`'s Release.
        if !self.held_back.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut failing_over = crate::sync::lock(&self.failing_over);
        match *failing_over {
            Some((since, _)) if since.elapsed() < self.longest_failover => Err(RedisError::from((
                ErrorKind::Client,
                "the Sentinels are failing the primary over",
            ))),
            Some(_) => {
                *failing_over = None;
                // Relaxed: under the lock that orders it with `begun`.
                self.held_back.store(false, Ordering::Relaxed);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for task in self
            .heard
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }
}

/// Hears the `n`th Sentinel (again after each lost subscription) for what it announces about
/// the service: a failover begun, abandoned, or the new primary. After each subscription the
/// Sentinels are asked once where the primary is, so a switch announced while this one was not
/// heard is followed too.
async fn hear(shared: Weak<Shared>, n: usize, quiet: Duration, timeout: Duration) {
    loop {
        let (sentinel, credentials, service) = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let Finder::Sentinel(target) = &shared.finder else {
                return;
            };
            let sentinel = target.sentinels[n].clone();
            (sentinel, target.credentials.clone(), target.service.clone())
        };
        if let Ok(Ok(pubsub)) =
            tokio::time::timeout(timeout, sentinel::announcements(&sentinel, &credentials)).await
        {
            {
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                if let Finder::Sentinel(target) = &shared.finder
                    && let Some(at) = sentinel::named(target, &shared.config).await
                {
                    shared.follow(&at);
                }
            }
            let (mut sink, mut stream) = pubsub.split();
            loop {
                let next_message = std::future::poll_fn(|cx| {
                    futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
                });
                tokio::select! {
                    message = next_message => {
                        let Some(message) = message else { break };
                        let said = sentinel::announcement(
                            message.get_channel_name(),
                            message.get_payload_bytes(),
                            &service,
                        );
                        let Some(said) = said else { continue };
                        let Some(shared) = shared.upgrade() else { return };
                        match said {
                            Announcement::Begun => {
                                tracing::warn!(sentinel = %sentinel, "the sentinels are failing the redis primary over: calls held back");
                                shared.begun();
                            }
                            Announcement::Abandoned => shared.abandoned(),
                            Announcement::Switched(to) => {
                                tracing::warn!(to = %to, sentinel = %sentinel, "the sentinels switched the redis primary");
                                shared.follow(&to);
                            }
                        }
                    }
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
