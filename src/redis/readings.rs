//! What a replica reads without deciding anything: the shared counts across every replica, what
//! Redis holds under this replica's name (for the drift check), and the backend's statistics.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::replica::RedisController;
use crate::admission::outcome::{BackendStats, DeploymentCounts, Unavailable, UnavailableReason};
use crate::engine::OperationState;

/// Operation records asked for in one `HSCAN` page, when reading a replica's holdings.
const OPERATIONS_PER_PAGE: usize = 500;
impl RedisController {
    /// The shared counts now, across every replica.
    pub(crate) async fn counts(&self) -> Result<DeploymentCounts, Unavailable> {
        let inner = &self.inner;
        let mut pipe = redis::pipe();
        pipe.hgetall(&inner.keys.counts).hlen(&inner.keys.ops);
        let mut conn = inner.conn.clone();
        let (fields, operations): (HashMap<String, u64>, u64) =
            match tokio::time::timeout(inner.options.call_timeout, pipe.query_async(&mut conn))
                .await
            {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
        let mut counts = DeploymentCounts {
            operations,
            ..DeploymentCounts::default()
        };
        for (field, n) in fields {
            match field.split_once(':') {
                None => match field.as_str() {
                    "active" => counts.active = n,
                    "pending" => counts.pending = n,
                    "executing" => counts.executing = n,
                    "active_holders" => counts.active_holders = n,
                    "executing_holders" => counts.executing_holders = n,
                    _ => {}
                },
                Some((kind, client)) => {
                    let entry = counts.clients.entry(client.to_string()).or_default();
                    match kind {
                        "a" => entry.0 = n,
                        "p" => entry.1 = n,
                        "e" => entry.2 = n,
                        _ => {}
                    }
                }
            }
        }
        Ok(counts)
    }

    /// What Redis holds under this replica's name now: operation id → state — the operations
    /// whose records name this replica, read a page at a time (`HSCAN`: the operations hash holds
    /// only live operations, and no read here holds Redis up for long).
    pub async fn holdings(
        &self,
    ) -> Result<std::collections::BTreeMap<String, OperationState>, Unavailable> {
        let inner = &self.inner;
        // Its caller may hold what exempt paths wait for (the broker's counts gate): a Redis
        // known not to answer is not asked, and the whole scan, every page, gets one call's time.
        if inner.circuit.is_open() {
            return Err(inner.unavailable(UnavailableReason::CircuitOpen));
        }
        let deadline = tokio::time::Instant::now() + inner.options.call_timeout;
        let mut conn = inner.conn.clone();
        let mut holdings = std::collections::BTreeMap::new();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<(String, String)>) = match tokio::time::timeout_at(
                deadline,
                redis::cmd("HSCAN")
                    .arg(&inner.keys.ops)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(OPERATIONS_PER_PAGE)
                    .query_async(&mut conn),
            )
            .await
            {
                Ok(Ok(page)) => page,
                Ok(Err(e)) => return Err(inner.failed(UnavailableReason::Redis(e.to_string()))),
                Err(_) => return Err(inner.failed(UnavailableReason::Timeout)),
            };
            for (id, record) in page {
                let mut fields = record.split(' ');
                let (state, owner) = (fields.next(), fields.next());
                if owner != Some(inner.options.replica.as_str()) {
                    continue;
                }
                let state = match state {
                    Some("p") => OperationState::Pending,
                    Some("a") => OperationState::Approved,
                    Some("e") => OperationState::Executing,
                    // Not a record this build writes: counted as nothing; the drift shows it.
                    _ => continue,
                };
                // (HSCAN may return a field twice across pages: the map keeps one.)
                holdings.insert(id, state);
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(holdings)
    }

    /// What this replica's backend has seen.
    pub(crate) fn stats(&self) -> BackendStats {
        let inner = &self.inner;
        // Relaxed: statistics.
        BackendStats {
            errors: inner.errors.load(Ordering::Relaxed),
            lease_changes: inner.lease_changes.load(Ordering::Relaxed),
            reaped: inner.reaped.load(Ordering::Relaxed),
            unavailable: inner.unavailable.load(Ordering::Relaxed),
            outbox: crate::sync::lock(&inner.outbox).len() as u64,
            lease_held: inner.lease_held(),
            circuit_open: inner.circuit.is_open(),
            // Relaxed: a reading for metrics.
            recovering: inner.recovering.load(Ordering::Relaxed),
            refusals_from_memory: inner.memory.answered(),
            refusals_forgotten: inner.memory.forgotten(),
            notices_live: inner.memory.is_live(),
            // Relaxed: a statistic.
            busy: inner.busy.load(Ordering::Relaxed),
        }
    }
}
