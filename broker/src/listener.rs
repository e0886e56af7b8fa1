//! The accept loop: how many connections the broker holds open, and for how long a connection may
//! keep it waiting. Everything here is assembled from hyper, hyper-util and tower-http; this file
//! only chooses the numbers and holds the connection cap.
//!
//! - **Header timeout** (hyper's `header_read_timeout`). hyper starts the timer whenever the
//!   connection waits for a request head: on a new connection before its first byte, and again
//!   after each response while a keep-alive connection idles. A connection that sends nothing, or
//!   half a head, is closed when it expires. So it is also the keep-alive idle timeout: HTTP/1
//!   has no other idle state, and a separate longer idle setting could never take effect.
//! - **Body timeout, body deadline and minimum rate** (ours, in `listener/body.rs`, one timer a
//!   body armed only while it waits for the client): the longest wait for the next piece of a
//!   request body once its head is in (the handler then sees a body that could not be read); the whole body must arrive within a
//!   deadline and, past a grace period, at an average rate above a minimum, counted from when the
//!   handler first reads it; otherwise the handler sees a body that could not be read
//!   ([`BodyCutOff`] in its source chain), and each cut-off is counted in
//!   `broker_body_deadlines_total{reason}` ([`BodyMetrics`]).
//! - **Connection cap**: a semaphore permit per open connection. The cap comes from the process's
//!   file limit (see [`connection_cap_for_file_limit`]), so the broker never runs out of
//!   descriptors for its store. At the cap, a newly accepted connection makes room by closing the
//!   connection that has been idle longest (no request in progress, a request being in progress
//!   until its response body is sent, so an open event stream is never idle: silent, half a head, or kept
//!   alive), so a flood of half-open connections cannot queue `/healthz` or an operator decision
//!   behind itself. A new connection gets a moment's grace for its head to arrive; one kept alive
//!   after an answer gets none, so connections that each ask again every few hundred
//!   milliseconds cannot hold every place either. When none is idle, a connection stuck on a body that breaks the deadline or
//!   the minimum rate makes room instead, closed as if its client had hung up (its handler was
//!   still reading the body: nothing was decided yet). Only when every connection has a request
//!   in progress that is not stuck on its body does the newcomer wait for one to end. This part is
//!   ours: hyper and tower offer no eviction.
//! - **Listen backlog** (`bind`): the kernel's queue of connections not yet accepted is 4096
//!   deep (or `net.core.somaxconn`, if lower), not the 128 of `std` and tokio. At the cap the
//!   accept loop takes one connection at a time, as eviction makes room, so a flood holds about
//!   `cap + backlog` connections; past the backlog the kernel drops new connections' SYNs and
//!   their clients retry after 1, 3, 7, 15 s... With 128, a flood of a few hundred connections
//!   left `/healthz` behind such retries for up to half a minute.
//! - **Graceful shutdown** (hyper-util's `GracefulShutdown`): on stop, idle connections close at
//!   once and requests in flight finish, for at most a bounded grace.
//!
//! - **Listeners**: a TCP listener or a Unix socket ([`ListenAddr`]; the socket is created mode
//!   0600 under a temporary name and renamed into place, and removed when its loop ends). One
//!   accept loop serves both kinds (`Acceptor`), and the broker's two listeners (agents,
//!   operators) share one `ConnectionPool`: one cap for every connection (each is a descriptor),
//!   and at the cap the connection idle longest on either listener makes room, so a flood on the
//!   agent listener cannot keep an operator out.
//!
//! Only HTTP/1.1 is served: the Agent V1 wire is HTTP/1.1, and hyper's header timeout is an
//! HTTP/1 setting.
//!
//! One file past the usual size: the settings, the listeners and the accept loop share one
//! connection pool, whose cap and eviction hold only together; what stands alone is already below
//! it (`listener/body`, `listener/write_deadline`), and about 120 lines are tests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, watch};

mod body;
#[cfg(test)]
mod slow_bodies;
mod write_deadline;

pub use body::{BodyCutOff, BodyMetrics, CutOffReason, body_cut_off};
use body::{BodyLimits, BodyProgress, LimitedBody};
use write_deadline::WriteDeadline;

/// The default [`ConnectionSettings::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default [`ConnectionSettings::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// The default [`ConnectionSettings::body_deadline`]: room for the largest submission body
/// (1 MiB) at the default minimum rate.
pub const DEFAULT_BODY_DEADLINE: Duration = Duration::from_secs(300);
/// The default [`ConnectionSettings::body_min_rate`], in bytes a second.
pub const DEFAULT_BODY_MIN_RATE: u64 = 4 * 1024;
/// The default [`ConnectionSettings::body_rate_grace`].
pub const DEFAULT_BODY_RATE_GRACE: Duration = Duration::from_secs(2);

/// Descriptors kept back from connections whatever the file limit: stdio, the data-dir lock, the
/// store's (SQLite's files for both its connections: database, WAL, shared memory, temporary
/// files; or PostgreSQL's pool of at most 16 connections and its listening one), the runtime's
/// epoll and wake-up descriptors, the listeners and signal handling. About twenty today with
/// SQLite, about thirty with PostgreSQL.
const RESERVED_FILES: u64 = 32;

/// The cap when the file limit cannot be read or is unlimited.
const FALLBACK_CONNECTION_CAP: usize = 512;

/// How long a connection must have been idle before a newcomer at the cap may displace it: a
/// moment for a new connection's request head to arrive.
const EVICTION_GRACE: Duration = Duration::from_millis(500);

/// How often a newcomer waiting at the cap asks again for an idle connection to make room.
const EVICTION_RETRY: Duration = Duration::from_millis(100);

/// The listen backlog [`bind`] asks for; the kernel lowers it to `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

/// How long a stopping server waits for requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long the accept loop pauses after an accept error other than a refused connection (such as
/// running out of descriptors), so it does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How the broker bounds its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionSettings {
    /// How long a connection may take to send a request head, counted from when the broker starts
    /// waiting for it (connection open, or the previous response sent). Also the keep-alive idle
    /// timeout. Default 10 s.
    pub header_timeout: Duration,
    /// The longest wait for the next part of a request body, and for a client to take the next
    /// bytes of its answer (a write timeout: the connection is then closed). Default 30 s.
    pub body_timeout: Duration,
    /// The longest a whole request body may take, from when the handler starts reading it.
    /// Default 300 s.
    pub body_deadline: Duration,
    /// The least average rate of a request body past [`ConnectionSettings::body_rate_grace`], in
    /// bytes a second; 0: no minimum. Default 4 KiB/s.
    pub body_min_rate: u64,
    /// How long a request body may arrive below the minimum rate before its average counts.
    /// Default 2 s.
    pub body_rate_grace: Duration,
    /// The most connections open at once; `None` derives it from the process's file limit
    /// ([`connection_cap_for_file_limit`]).
    pub max_connections: Option<usize>,
}

impl Default for ConnectionSettings {
    fn default() -> ConnectionSettings {
        ConnectionSettings {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            body_deadline: DEFAULT_BODY_DEADLINE,
            body_min_rate: DEFAULT_BODY_MIN_RATE,
            body_rate_grace: DEFAULT_BODY_RATE_GRACE,
            max_connections: None,
        }
    }
}

impl ConnectionSettings {
    /// Why these settings cannot serve, if they cannot: a zero timeout, deadline or grace, a
    /// grace not shorter than the deadline, or a zero cap.
    pub fn problem(&self) -> Option<String> {
        if self.header_timeout.is_zero() {
            return Some("the header timeout must be longer than zero".to_owned());
        }
        if self.body_timeout.is_zero() {
            return Some("the body timeout must be longer than zero".to_owned());
        }
        if self.body_deadline.is_zero() {
            return Some("the body deadline must be longer than zero".to_owned());
        }
        if self.body_rate_grace.is_zero() {
            return Some("the body rate grace must be longer than zero".to_owned());
        }
        if self.body_rate_grace >= self.body_deadline {
            return Some(format!(
                "the body rate grace ({:?}) must be shorter than the body deadline ({:?})",
                self.body_rate_grace, self.body_deadline
            ));
        }
        if self.max_connections == Some(0) {
            return Some("the connection limit must be at least 1".to_owned());
        }
        None
    }

    fn body_limits(&self) -> BodyLimits {
        BodyLimits {
            deadline: self.body_deadline,
            min_rate: self.body_min_rate,
            grace: self.body_rate_grace,
        }
    }

    /// The connection cap in force: the configured one, or the one the file limit allows; never
    /// above the latter (open connections stay below the process's file limit, so the cap, not
    /// `EMFILE`, is what a flood of idle connections meets, and it closes idle ones for room).
    pub fn connection_cap(&self) -> usize {
        capped_by_file_limit(self.max_connections, file_limit())
    }
}

/// The cap in force for a configured `max_connections` (if any) under `file_limit` (if known).
fn capped_by_file_limit(max_connections: Option<usize>, file_limit: Option<u64>) -> usize {
    let allowed = connection_cap_for_file_limit(file_limit);
    match (max_connections, file_limit) {
        (Some(max), Some(_)) => max.min(allowed),
        (Some(max), None) => max,
        (None, _) => allowed,
    }
}

/// The process's soft limit on open files (`RLIMIT_NOFILE`), if it can be read and is finite.
pub fn file_limit() -> Option<u64> {
    match rlimit::Resource::NOFILE.get() {
        Ok((soft, _hard)) if soft != rlimit::INFINITY => Some(soft),
        _ => None,
    }
}

/// The most connections a process allowed `file_limit` open files may hold: each connection is
/// one socket, and may hold one file more while it uploads a stream body, so half of what is left
/// after 32 kept for the store and the runtime. At least 1.
pub fn connection_cap_for_file_limit(file_limit: Option<u64>) -> usize {
    match file_limit {
        Some(limit) => usize::try_from(limit.saturating_sub(RESERVED_FILES) / 2)
            .unwrap_or(usize::MAX)
            .clamp(1, Semaphore::MAX_PERMITS),
        None => FALLBACK_CONNECTION_CAP,
    }
}

/// A TCP listener on `addr` with a listen backlog of [`LISTEN_BACKLOG`] (see the module docs),
/// address reuse on as `std` and tokio set it.
pub(crate) fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Where a listener listens: a TCP address, or a Unix socket's path (`unix:/abs/path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address (port 0 picks a free port).
    Tcp(SocketAddr),
    /// A Unix socket at this absolute, normalized path: created mode 0600 (only the broker's
    /// user may connect), removed when the listener stops.
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    /// `127.0.0.1:8081`, `[::1]:8081`, or `unix:/run/admission/operator.sock` (absolute and
    /// normalized: no `.`, `..`, `//` or trailing `/`).
    fn from_str(text: &str) -> Result<ListenAddr, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            let normalized = path.starts_with('/')
                && path.len() > 1
                && !path.ends_with('/')
                && path[1..]
                    .split('/')
                    .all(|part| !part.is_empty() && part != "." && part != "..");
            if !normalized {
                return Err(format!(
                    "{text:?}: a Unix socket is `unix:` and an absolute, normalized path (no `.`, \
                     `..`, `//` or trailing `/`)"
                ));
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        text.parse::<SocketAddr>()
            .map(ListenAddr::Tcp)
            .map_err(|_| format!("{text:?} is neither ADDR:PORT nor unix:/abs/path"))
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(addr) => write!(f, "{addr}"),
            ListenAddr::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// What an accept loop accepts connections from: a TCP listener or a Unix socket. The loop
/// itself ([`serve_counted`]) is one, whichever it is.
pub(crate) trait Acceptor: Send + 'static {
    /// One accepted connection.
    type Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static;

    /// The next connection, ready to serve.
    fn accept_one(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

impl Acceptor for TcpListener {
    type Stream = tokio::net::TcpStream;

    async fn accept_one(&self) -> std::io::Result<tokio::net::TcpStream> {
        let (stream, _peer) = self.accept().await?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}

/// A Unix socket listener that removes its file when dropped (when its accept loop ends).
pub(crate) struct UnixSocket {
    listener: tokio::net::UnixListener,
    path: PathBuf,
}

impl UnixSocket {
    /// Binds a Unix socket at `path`, mode 0600 from the moment it has that name: bound under a
    /// temporary name beside it, restricted, then renamed into place. A socket file left by a
    /// broker that died is replaced; one a live process answers on, or a file that is not a
    /// socket, is refused.
    pub(crate) fn bind(path: &Path) -> std::io::Result<UnixSocket> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", path.display()),
                ));
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("another process listens on {}", path.display()),
                ));
            }
        }
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(format!(".{}.binding", std::process::id()));
        let temporary = PathBuf::from(temporary);
        let _ = std::fs::remove_file(&temporary);
        let listener = tokio::net::UnixListener::bind(&temporary)?;
        let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o600))
            .and_then(|()| std::fs::rename(&temporary, path));
        if let Err(err) = placed {
            let _ = std::fs::remove_file(&temporary);
            return Err(err);
        }
        Ok(UnixSocket {
            listener,
            path: path.to_owned(),
        })
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Acceptor for UnixSocket {
    type Stream = tokio::net::UnixStream;

    async fn accept_one(&self) -> std::io::Result<tokio::net::UnixStream> {
        let (stream, _peer) = self.listener.accept().await?;
        Ok(stream)
    }
}

/// The connections of every listener of one broker: one cap for all of them (each connection
/// is a descriptor, whichever listener took it), and the open connections a newcomer at the cap
/// may displace, so a flood on the agent listener cannot keep an operator out either.
pub(crate) struct ConnectionPool {
    cap: usize,
    permits: Arc<Semaphore>,
    open: Arc<OpenConnections>,
}

impl ConnectionPool {
    /// A pool of at most `cap` connections.
    pub(crate) fn new(cap: usize) -> Arc<ConnectionPool> {
        Arc::new(ConnectionPool {
            cap,
            permits: Arc::new(Semaphore::new(cap)),
            open: Arc::new(OpenConnections::default()),
        })
    }
}

/// Serves `app` on `listener` until `stop` turns true, holding the connections in `pool` (shared
/// with the broker's other listener), and counting bodies cut off in `metrics` (the broker's,
/// registered in its registry).
pub(crate) async fn serve_counted<A: Acceptor>(
    listener: A,
    app: axum::Router,
    settings: ConnectionSettings,
    pool: Arc<ConnectionPool>,
    mut stop: watch::Receiver<bool>,
    metrics: BodyMetrics,
) {
    let limits = settings.body_limits();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(settings.header_timeout)
        .keep_alive(true);
    let service = TowerToHyperService::new(app);
    let cap = pool.cap;
    let permits = Arc::clone(&pool.permits);
    let open = Arc::clone(&pool.open);
    let graceful = GracefulShutdown::new();
    let mut saturated = false;
    loop {
        let stream = tokio::select! {
            accepted = listener.accept_one() => match accepted {
                Ok(stream) => stream,
                Err(err) => {
                    if !is_connection_error(&err) {
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    }
                    continue;
                }
            },
            () = stopped(&mut stop) => break,
        };
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => {
                // Logged again only once the flood has clearly receded, not on every swing.
                if permits.available_permits() >= cap / 10 {
                    saturated = false;
                }
                permit
            }
            Err(_) => {
                if !saturated {
                    saturated = true;
                    tracing::warn!(
                        connections = cap,
                        "connection limit reached; the connections idle longest make room"
                    );
                }
                // This one connection, accepted above the cap, lives on the reserve until an
                // idle connection has closed to make room for it. Asked again while it waits: a
                // connection may become idle (or idle long enough) meanwhile.
                let permit = loop {
                    open.evict_one(&limits);
                    tokio::select! {
                        permit = Arc::clone(&permits).acquire_owned() => break permit.ok(),
                        () = stopped(&mut stop) => break None,
                        () = tokio::time::sleep(EVICTION_RETRY) => {}
                    }
                };
                let Some(permit) = permit else { break };
                permit
            }
        };
        let (id, state) = open.insert();
        let busy = Arc::clone(&state);
        let service = service.clone();
        let body_metrics = metrics.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let request_open = Busy::enter(&busy);
            // Relaxed: only distinctness matters.
            let nth = busy.bodies.fetch_add(1, Ordering::Relaxed);
            let request = request.map(|body| {
                let progress = Arc::clone(&busy.body);
                LimitedBody::new(
                    body,
                    limits,
                    settings.body_timeout,
                    progress,
                    nth,
                    body_metrics.clone(),
                )
            });
            let response = hyper::service::Service::call(&service, request);
            async move {
                // The request stays in progress until its response body ends, so a streamed
                // answer (an Operator V1 event stream) is never taken for an idle connection.
                response.await.map(|response| {
                    response.map(|body| {
                        axum::body::Body::new(BusyBody {
                            body,
                            _busy: request_open,
                        })
                    })
                })
            }
        });
        // A client that takes none of its answer for a body timeout is gone as far as this
        // connection is concerned, as one that sends none of its body is.
        let stream = WriteDeadline::new(stream, settings.body_timeout);
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let open = Arc::clone(&open);
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut connection = std::pin::pin!(connection);
            loop {
                tokio::select! {
                    ended = &mut connection => {
                        if let Err(err) = ended {
                            // A client that times out, hangs up or sends garbage: its own business.
                            tracing::debug!(error = %err, "connection ended with an error");
                        }
                        break;
                    }
                    () = state.evict.notified() => {
                        // Checked here, where the connection is not being polled: no request can
                        // start between the check and the drop, so no handler is dropped unless
                        // it was stuck reading a slow body (as if its client had hung up).
                        // Relaxed: see `Busy::enter`.
                        if state.requests.load(Ordering::Relaxed) == 0 {
                            tracing::debug!("idle connection closed to make room");
                            break;
                        }
                        if state.body.claim_stuck(&limits, &metrics) {
                            tracing::debug!("connection stuck on a slow body closed to make room");
                            break;
                        }
                    }
                }
            }
            open.remove(id);
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown: some connections were still busy after the grace period");
    }
}

/// The open connections, so that at the cap the one idle longest (waiting for a request head:
/// silent, half-sent, or kept alive between requests) can be closed for a new one. Without this,
/// a flood of half-open connections would queue every newcomer, `/healthz` and operator decisions
/// included, behind the whole flood in the kernel's accept queue, a header timeout per cap's
/// worth. Looked through only when the cap is reached.
#[derive(Default)]
struct OpenConnections {
    next: AtomicU64,
    by_id: Mutex<HashMap<u64, Arc<ConnectionState>>>,
}

struct ConnectionState {
    /// Requests in progress: from hyper handing over the head until the response is produced.
    requests: AtomicUsize,
    /// When the connection last had no request in progress began: accepted, or its last
    /// response produced.
    idle_since: Mutex<Instant>,
    /// Asks the connection's task to close it, if it is still idle or stuck on a slow body.
    evict: Notify,
    /// The request body it is receiving, if any.
    body: Arc<BodyProgress>,
    /// Request bodies so far, to tell one from the next.
    bodies: AtomicU64,
}

impl OpenConnections {
    fn insert(&self) -> (u64, Arc<ConnectionState>) {
        // Relaxed: only uniqueness matters.
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnectionState {
            requests: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            evict: Notify::new(),
            body: Arc::default(),
            bodies: AtomicU64::new(0),
        });
        self.lock().insert(id, Arc::clone(&state));
        (id, state)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Asks the connection idle longest to close, if one is idle between requests (kept alive
    /// after an answer) or has been idle for [`EVICTION_GRACE`]; else the one stuck longest on a
    /// body that breaks `limits`; none if every one has a request in progress that is not stuck,
    /// or is new and has only just become idle (a newcomer whose head is still on its way). A
    /// kept-alive connection makes room however briefly it has idled: connections that each ask
    /// again within the grace would otherwise hold every place.
    fn evict_one(&self, limits: &BodyLimits) {
        let open = self.lock();
        let longest = open
            .values()
            // Relaxed: a hint; the connection's task checks again before it closes.
            .filter(|state| state.requests.load(Ordering::Relaxed) == 0)
            .map(|state| (*crate::sync::lock(&state.idle_since), state))
            .filter(|(since, state)| {
                state.bodies.load(Ordering::Relaxed) > 0 || since.elapsed() >= EVICTION_GRACE
            })
            .min_by_key(|(since, _)| *since);
        let now = Instant::now();
        let chosen = longest.map(|(_, state)| state).or_else(|| {
            open.values()
                .filter_map(|state| Some((state.body.stuck_since(limits, now)?, state)))
                .min_by_key(|(since, _)| *since)
                .map(|(_, state)| state)
        });
        if let Some(state) = chosen {
            // Wakes the task only if it is parked waiting: no request is left standing to close
            // the connection later, when it may be busy or just kept alive.
            state.evict.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnectionState>>> {
        crate::sync::lock(&self.by_id)
    }
}

/// A request in progress on a connection; when it ends, the connection is idle from then.
struct Busy(Arc<ConnectionState>);

impl Busy {
    fn enter(state: &Arc<ConnectionState>) -> Busy {
        // Relaxed: the count that decides an eviction is read by the connection's own task, which
        // also runs this (program order); the accept loop reads it only to choose whom to ask.
        state.requests.fetch_add(1, Ordering::Relaxed);
        Busy(Arc::clone(state))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *crate::sync::lock(&self.0.idle_since) = Instant::now();
        // Relaxed: as in `enter`; the idle time is under its own lock.
        self.0.requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`Busy`] until the body ends or is dropped.
struct BusyBody {
    body: axum::body::Body,
    _busy: Busy,
}

impl hyper::body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Returns once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// An accept error that concerns one connection only (it was reset before we took it).
fn is_connection_error(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_the_reserve_and_a_file_per_connection() {
        assert_eq!(connection_cap_for_file_limit(Some(256)), 112);
        assert_eq!(connection_cap_for_file_limit(Some(1024)), 496);
        assert_eq!(connection_cap_for_file_limit(Some(10)), 1);
        assert_eq!(connection_cap_for_file_limit(None), FALLBACK_CONNECTION_CAP);
    }

    #[test]
    fn zero_timeouts_a_grace_past_the_deadline_and_a_zero_cap_are_refused() {
        let ok = ConnectionSettings::default();
        assert_eq!(ok.problem(), None);
        for bad in [
            ConnectionSettings {
                header_timeout: Duration::ZERO,
                ..ok
            },
            ConnectionSettings {
                body_timeout: Duration::ZERO,
                ..ok
            },
            ConnectionSettings {
                body_deadline: Duration::ZERO,
                ..ok
            },
            ConnectionSettings {
                body_rate_grace: Duration::ZERO,
                ..ok
            },
            ConnectionSettings {
                body_rate_grace: ok.body_deadline,
                ..ok
            },
            ConnectionSettings {
                max_connections: Some(0),
                ..ok
            },
        ] {
            assert!(bad.problem().is_some(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn the_listener_queues_more_than_the_std_backlog_of_128() {
        // Connections the broker has not accepted yet wait in the kernel's queue: 300 of them
        // all complete their handshake (none is left retrying a dropped SYN), as long as the
        // kernel allows a backlog that deep.
        let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok());
        let Some(max) = somaxconn.filter(|&max| max > 300) else {
            eprintln!("skipped: net.core.somaxconn is {somaxconn:?}, below the 300 this needs");
            return;
        };
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        // Nothing is accepted meanwhile: with a shallower queue the handshake past it never
        // completes (its SYN is dropped, and dropped again on every retry), so this bound is
        // not about speed.
        let waiting = tokio::time::timeout(Duration::from_secs(30), async {
            let mut waiting = Vec::new();
            for _ in 0..300 {
                waiting.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            waiting
        })
        .await
        .unwrap_or_else(|_| panic!("the listen queue held fewer than 300 (somaxconn {max})"));
        assert_eq!(waiting.len(), 300);
        for _ in 0..300 {
            listener.accept().await.unwrap();
        }
    }

    #[test]
    fn a_listen_address_is_addr_port_or_an_absolute_normalized_unix_path() {
        assert_eq!(
            "127.0.0.1:8081".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 8081))))
        );
        assert_eq!(
            "unix:/run/admission/operator.sock".parse::<ListenAddr>(),
            Ok(ListenAddr::Unix(PathBuf::from(
                "/run/admission/operator.sock"
            )))
        );
        for bad in [
            "unix:relative.sock",
            "unix:/run/./x.sock",
            "unix:/run/../x.sock",
            "unix://run/x.sock",
            "unix:/run/",
            "unix:/",
            "localhost:8081",
            "8081",
        ] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
        let shown = ListenAddr::Unix(PathBuf::from("/run/a.sock")).to_string();
        assert_eq!(shown.parse::<ListenAddr>().unwrap().to_string(), shown);
    }

    #[test]
    fn an_explicit_cap_holds_up_to_what_the_file_limit_leaves() {
        let settings = ConnectionSettings {
            max_connections: Some(7),
            ..ConnectionSettings::default()
        };
        assert_eq!(settings.connection_cap(), 7);
        // 128 files: 32 kept, two per connection, so 48 connections at most.
        assert_eq!(connection_cap_for_file_limit(Some(128)), 48);
        assert_eq!(capped_by_file_limit(Some(7), Some(128)), 7);
        assert_eq!(capped_by_file_limit(Some(1000), Some(128)), 48);
        assert_eq!(capped_by_file_limit(None, Some(128)), 48);
        // No known limit: the configured cap, else the fallback.
        assert_eq!(capped_by_file_limit(Some(1000), None), 1000);
        assert_eq!(capped_by_file_limit(None, None), FALLBACK_CONNECTION_CAP);
    }
}
