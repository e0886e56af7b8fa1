//! The accept loop: how many connections the broker holds open, and for how long a connection may
//! keep it waiting. Everything here is assembled from hyper, hyper-util and tower-http; this file
//! only chooses the numbers and holds the connection cap.
//!
//! - **Header timeout** (hyper's `header_read_timeout`). hyper starts the timer whenever the
//!   connection waits for a request head: on a new connection before its first byte, and again
//!   after each response while a keep-alive connection idles. A connection that sends nothing, or
//!   half a head, is closed when it expires. So it is also the keep-alive idle timeout: HTTP/1
//!   has no other idle state, and a separate longer idle setting could never take effect.
//! - **Body timeout** (tower-http's `RequestBodyTimeout`): the longest wait for the next piece of
//!   a request body once its head is in; the handler then sees a body that could not be read.
//! - **Connection cap**: a semaphore permit per open connection, taken *before* `accept`, so when
//!   the cap is reached new connections wait in the kernel's backlog (using no descriptor of ours)
//!   until a slow one times out. The cap comes from the process's file limit (see
//!   [`connection_cap_for_file_limit`]), so the broker never runs out of descriptors for its store.
//! - **Graceful shutdown** (hyper-util's `GracefulShutdown`): on stop, idle connections close at
//!   once and requests in flight finish, for at most a bounded grace.
//!
//! Only HTTP/1.1 is served: the Agent V1 wire is HTTP/1.1, and hyper's header timeout is an
//! HTTP/1 setting.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tower_http::timeout::RequestBodyTimeout;

/// The default [`ConnectionSettings::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default [`ConnectionSettings::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Descriptors kept back from connections whatever the file limit: stdio, the data-dir lock, the
/// SQLite files of both connections (database, WAL, shared memory, temporary files), the runtime's
/// epoll and wake-up descriptors, the listener and signal handling. About twenty today; the rest
/// is margin.
const RESERVED_FILES: u64 = 32;

/// The cap when the file limit cannot be read or is unlimited.
const FALLBACK_CONNECTION_CAP: usize = 512;

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
    /// The longest wait for the next part of a request body. Default 30 s.
    pub body_timeout: Duration,
    /// The most connections open at once; `None` derives it from the process's file limit
    /// ([`connection_cap_for_file_limit`]).
    pub max_connections: Option<usize>,
}

impl Default for ConnectionSettings {
    fn default() -> ConnectionSettings {
        ConnectionSettings {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: None,
        }
    }
}

impl ConnectionSettings {
    /// Why these settings cannot serve, if they cannot: a zero timeout or a zero cap.
    pub fn problem(&self) -> Option<String> {
        if self.header_timeout.is_zero() {
            return Some("the header timeout must be longer than zero".to_owned());
        }
        if self.body_timeout.is_zero() {
            return Some("the body timeout must be longer than zero".to_owned());
        }
        if self.max_connections == Some(0) {
            return Some("the connection limit must be at least 1".to_owned());
        }
        None
    }

    /// The connection cap in force: the configured one, or the one the file limit allows.
    pub fn connection_cap(&self) -> usize {
        self.max_connections
            .unwrap_or_else(|| connection_cap_for_file_limit(file_limit()))
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
/// after [`RESERVED_FILES`] for the store and the runtime. At least 1.
pub fn connection_cap_for_file_limit(file_limit: Option<u64>) -> usize {
    match file_limit {
        Some(limit) => usize::try_from(limit.saturating_sub(RESERVED_FILES) / 2)
            .unwrap_or(usize::MAX)
            .clamp(1, Semaphore::MAX_PERMITS),
        None => FALLBACK_CONNECTION_CAP,
    }
}

/// Serves `app` on `listener` until `stop` turns true, holding at most `cap` connections open.
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    settings: ConnectionSettings,
    cap: usize,
    mut stop: watch::Receiver<bool>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(settings.header_timeout)
        .keep_alive(true);
    let service = TowerToHyperService::new(RequestBodyTimeout::new(app, settings.body_timeout));
    let permits = Arc::new(Semaphore::new(cap));
    let graceful = GracefulShutdown::new();
    let mut saturated = false;
    loop {
        if permits.available_permits() == 0 && !saturated {
            saturated = true;
            tracing::warn!(
                connections = cap,
                "connection limit reached; new connections wait until one closes"
            );
        }
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = stopped(&mut stop) => break,
        };
        if saturated && permits.available_permits() > cap / 10 {
            saturated = false;
        }
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
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
        let _ = stream.set_nodelay(true);
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service.clone()));
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                // A client that times out, hangs up or sends garbage: its own business.
                tracing::debug!(error = %err, "connection ended with an error");
            }
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
        assert_eq!(
            connection_cap_for_file_limit(None),
            FALLBACK_CONNECTION_CAP
        );
    }

    #[test]
    fn zero_timeouts_and_a_zero_cap_are_refused() {
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
                max_connections: Some(0),
                ..ok
            },
        ] {
            assert!(bad.problem().is_some(), "{bad:?}");
        }
    }

    #[test]
    fn an_explicit_cap_wins_over_the_file_limit() {
        let settings = ConnectionSettings {
            max_connections: Some(7),
            ..ConnectionSettings::default()
        };
        assert_eq!(settings.connection_cap(), 7);
    }
}
