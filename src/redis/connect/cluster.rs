//! A Redis Cluster, through the redis crate's async cluster client: every command of the
//! deployment goes to the primary of the deployment's one slot (the slot of its hash tag,
//! `{prefix}`, which every key of it is under: `keys`). The client follows `MOVED` (the slot
//! moved, or its primary failed over) and `ASK` (the slot mid-migration) itself, learning the
//! cluster's new shape; keyless commands (`WAIT`, `SCAN`, `SCRIPT LOAD`) go to the same primary
//! as the scripts, which is where they mean something.
//!
//! The notices are heard on a plain subscriber connection to that primary: the scripts `PUBLISH`
//! there, and a cluster passes every `PUBLISH` to all of its nodes, so the subscription goes on
//! hearing them if that node is demoted. Which node holds the slot is read every heartbeat
//! (`CLUSTER NODES`, asked of the slot's primary: the node the commands reach now); a new one
//! counts as a change of primary, as a followed Sentinel failover does.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::PubSub;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{RedisError, Value};
use tokio::sync::watch;

use super::attempt::{self, Attempt};
use super::node;
use crate::admission::redis_url::{ClusterTarget, Credentials, HostPort};

/// The deployment's slot in a cluster. Cheap to clone.
#[derive(Clone)]
pub(crate) struct ClusterSlot {
    shared: Arc<Shared>,
}

struct Shared {
    client: ClusterClient,
    current: ArcSwap<Attempt<ClusterConnection>>,
    /// The primary of the deployment's slot.
    route: Route,
    credentials: Credentials,
    /// The node id of the slot's primary, as last read.
    owner: Mutex<Option<String>>,
    changes: watch::Sender<u64>,
    watcher: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl ClusterSlot {
    /// The slot of `hash_tag` (`{prefix}`) in the cluster `target` reaches, each call at most
    /// `timeout` (redirections and retries included); which node holds it is read every
    /// `period`.
    pub(crate) fn new(
        target: ClusterTarget,
        hash_tag: &str,
        timeout: Duration,
        period: Duration,
    ) -> Result<ClusterSlot, RedisError> {
        let nodes: Vec<(String, u16)> = target
            .nodes
            .iter()
            .map(|node| (node.host.clone(), node.port))
            .collect();
        let millis = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let mut builder = ClusterClient::builder(nodes)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            // A redirection is a retry: a few, quickly, within the call timeout (the crate's
            // default waits seconds between them).
            .retries(5)
            .min_retry_wait(5)
            .max_retry_wait((millis / 4).max(6));
        if let Some(username) = &target.credentials.username {
            builder = builder.username(username);
        }
        if let Some(password) = &target.credentials.password {
            builder = builder.password(password);
        }
        let slot = ClusterSlot {
            shared: Arc::new(Shared {
                client: builder.build()?,
                current: ArcSwap::from_pointee(Attempt::new()),
                route: Route::with_key(hash_tag, SlotAddr::Master),
                credentials: target.credentials,
                owner: Mutex::new(None),
                changes: watch::channel(0).0,
                watcher: Mutex::new(None),
            }),
        };
        let task = tokio::spawn(watch_owner(Arc::downgrade(&slot.shared), period));
        *crate::sync::lock(&slot.shared.watcher) = Some(task);
        Ok(slot)
    }

    /// The cluster connection, made now if need be.
    async fn connection(&self) -> Result<ClusterConnection, RedisError> {
        let attempt = self.shared.current.load_full();
        let client = self.shared.client.clone();
        match attempt
            .outcome(|| async move { client.get_async_connection().await })
            .await
        {
            Ok(conn) => Ok(conn),
            Err(e) => {
                attempt::again(&self.shared.current, &attempt);
                Err(e)
            }
        }
    }

    fn to_slot(&self) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::SpecificNode(self.shared.route)
    }

    pub(crate) async fn send(&self, cmd: &redis::Cmd) -> Result<Value, RedisError> {
        let mut conn = self.connection().await?;
        conn.route_command(cmd.clone(), RoutingInfo::SingleNode(self.to_slot()))
            .await
    }

    pub(crate) async fn send_all(
        &self,
        pipeline: &redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> Result<Vec<Value>, RedisError> {
        let mut conn = self.connection().await?;
        conn.route_pipeline(pipeline.clone(), offset, count, self.to_slot())
            .await
    }

    /// A subscriber connection to the slot's primary.
    pub(crate) async fn subscriber(&self) -> Result<PubSub, RedisError> {
        let (_, at) = self.owner().await?;
        let info = node::info(&at, 0, Some(&self.shared.credentials))?;
        redis::Client::open(info)?.get_async_pubsub().await
    }

    /// Counts the moves of the slot to another primary.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// The node id and address of the slot's primary, as the slot's primary says
    /// (`CLUSTER NODES`, the line marked `myself`).
    async fn owner(&self) -> Result<(String, HostPort), RedisError> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("NODES");
        let nodes: String = redis::from_redis_value(self.send(&cmd).await?)?;
        nodes.lines().find_map(myself).ok_or_else(|| {
            RedisError::from((
                redis::ErrorKind::Parse,
                "no node says myself in CLUSTER NODES",
            ))
        })
    }
}

/// `(id, address)` of a `CLUSTER NODES` line if it is the answering node's own:
/// `ID HOST:PORT@BUS[,HOSTNAME] myself,master ...`.
fn myself(line: &str) -> Option<(String, HostPort)> {
    let mut fields = line.split(' ');
    let id = fields.next()?;
    let address = fields.next()?;
    let flags = fields.next()?;
    if !flags.split(',').any(|flag| flag == "myself") {
        return None;
    }
    let address = address.split(['@', ',']).next()?;
    let (host, port) = address.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((
        id.to_owned(),
        HostPort {
            host: host.to_owned(),
            port: port.parse().ok()?,
        },
    ))
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(task) = self
            .watcher
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// Reads which node is the slot's primary every `period`, counting each change.
async fn watch_owner(shared: Weak<Shared>, period: Duration) {
    loop {
        tokio::time::sleep(period).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let slot = ClusterSlot {
            shared: Arc::clone(&shared),
        };
        let Ok(Ok((id, at))) = tokio::time::timeout(period, slot.owner()).await else {
            continue;
        };
        let mut owner = crate::sync::lock(&shared.owner);
        if owner.as_deref() != Some(id.as_str()) {
            if owner.is_some() {
                tracing::warn!(to = %at, "the deployment's cluster slot has a new primary: following it");
                shared.changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            *owner = Some(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answering_node_is_the_line_marked_myself() {
        let nodes = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
e7d1 127.0.0.1:30001@40001,node-1 myself,master - 0 0 1 connected 0-5460
";
        let found: Vec<_> = nodes.lines().filter_map(myself).collect();
        assert_eq!(
            found,
            [(
                "e7d1".to_owned(),
                HostPort {
                    host: "127.0.0.1".into(),
                    port: 30001
                }
            )]
        );
    }
}
