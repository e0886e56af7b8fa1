//! The one connection type the rest of `redis/` uses, whatever kind of Redis the URL names: one
//! server, a primary its Sentinels watch (both followed: `following`), or a slot of a Redis
//! Cluster (`cluster`). It runs commands, pipelines and scripts as any `redis` connection does
//! ([`redis::aio::ConnectionLike`]), pins itself to one physical connection for a write and
//! the `WAIT` after it, opens the subscriber connection the notices are heard on, and counts the
//! times the Redis behind it changed to another primary (a failover followed).

use std::time::Duration;

use redis::aio::{ConnectionLike, PubSub};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, Value};
use tokio::sync::watch;

use super::cluster::ClusterSlot;
use super::following::{Following, Pinned};
use crate::admission::redis_url::{self, RedisTarget};

/// A replica's connection to Redis. Cheap to clone; every clone follows the same Redis.
#[derive(Clone)]
pub(crate) enum Connection {
    /// One server, or the primary a service's Sentinels name.
    Primary(Following),
    /// One physical connection to the primary (see [`Connection::pinned`]).
    Pinned(Pinned),
    /// The deployment's slot of a Redis Cluster.
    Cluster(ClusterSlot),
}

impl Connection {
    /// The connection `url` names (made on first use, not now), each call at most `timeout`;
    /// `period`: how often a subscription with nothing to say is pinged and a cluster slot's
    /// primary read; `longest_failover`: how long a failover the Sentinels began holds calls
    /// back at most. `hash_tag`: the deployment's `{prefix}`. The error never quotes the URL.
    pub(crate) fn open(
        url: &str,
        hash_tag: &str,
        timeout: Duration,
        period: Duration,
        longest_failover: Duration,
    ) -> Result<Connection, String> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        match redis_url::parse(url)? {
            RedisTarget::Server => {
                let client = redis::Client::open(url).map_err(|e| e.to_string())?;
                Ok(Connection::Primary(Following::server(client, config)))
            }
            RedisTarget::Sentinel(target) => Ok(Connection::Primary(Following::sentinel(
                target,
                config,
                period,
                timeout,
                longest_failover,
            ))),
            RedisTarget::Cluster(target) => ClusterSlot::new(target, hash_tag, timeout, period)
                .map(Connection::Cluster)
                .map_err(|e| e.to_string()),
        }
    }

    /// This connection held to the one physical connection it goes through now (made now if
    /// need be), so that a `WAIT` after a write is asked where the write went: after a failover
    /// in between, the `WAIT` fails rather than count the new primary's replicas for a write
    /// the new primary never had. (A cluster slot is reached through the cluster client, which
    /// sends both to the slot's primary as it knows it.)
    pub(crate) async fn pinned(&self) -> Result<Connection, RedisError> {
        match self {
            Connection::Primary(following) => following.pinned().await.map(Connection::Pinned),
            Connection::Pinned(_) | Connection::Cluster(_) => Ok(self.clone()),
        }
    }

    /// A new subscriber connection to the primary the deployment's scripts run on (where they
    /// `PUBLISH` the notices).
    pub(crate) async fn subscriber(&self) -> Result<PubSub, RedisError> {
        match self {
            Connection::Primary(following) => following.subscriber().await,
            Connection::Pinned(pinned) => pinned.subscriber().await,
            Connection::Cluster(slot) => slot.subscriber().await,
        }
    }

    /// Counts the failovers begun (as the Sentinels announce them) and the changes of primary:
    /// a write acknowledged (`WAIT`) while this changed may be lost with the old primary.
    pub(crate) fn turns(&self) -> u64 {
        match self {
            Connection::Primary(following) => following.turns(),
            Connection::Pinned(pinned) => pinned.turns(),
            Connection::Cluster(slot) => *slot.changes().borrow(),
        }
    }

    /// Counts each change to another primary: what a subscription to the old one may have
    /// missed, and what a failover may have lost, is to be made good.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        match self {
            Connection::Primary(following) => following.changes(),
            Connection::Pinned(pinned) => pinned.changes(),
            Connection::Cluster(slot) => slot.changes(),
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            match self {
                Connection::Primary(following) => following.send(cmd).await,
                Connection::Pinned(pinned) => pinned.send(cmd).await,
                Connection::Cluster(slot) => slot.send(cmd).await,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            match self {
                Connection::Primary(following) => following.send_all(pipeline, offset, count).await,
                Connection::Pinned(pinned) => pinned.send_all(pipeline, offset, count).await,
                Connection::Cluster(slot) => slot.send_all(pipeline, offset, count).await,
            }
        })
    }

    fn get_db(&self) -> i64 {
        // Not read on the async paths this crate uses; a cluster has only database 0.
        0
    }
}
