//! `GET /api/agent/v1/operations/{id}/events?after_revision=N&wait_seconds=S`: long-poll waits.
//!
//! A wait answers with the operation as soon as its revision is above N (at once if it already
//! is), after S seconds as it is, or at shutdown as it is. It wakes on a per-operation bell rung
//! by `Core::changed` right after every durable state change (the executor's start and its
//! failures included), never by polling the store: an idle wait is a parked task. Bells are
//! created when the first waiter of an operation arrives and dropped with its last, so the
//! registry holds only what is waited on. A change made while the broker was down (recovery
//! failing interrupted work) is in the durable revision, so a wait after a restart that names an
//! older revision answers at once.
//!
//! Waiting is not work: it is never admitted and holds no quota. A client may hold at most
//! [`MAX_WAITS_PER_CLIENT`] waits at once; one more is refused with 429 `too_many_waits`, which
//! concerns that client only.
//!
//! A client that hangs up drops the handler at an `.await`; the `WaitSlot` it held is released
//! by its `Drop`, so no count leaks. Nothing is written, so nothing can be left half-done.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use tokio::sync::watch;

use super::Core;
use super::api::error::{ApiError, ApiResult, json_response};
use super::api::extract::{
    Client, OperationId, QueryPairs, own_record, parse_integer, single_params,
};

/// Most waits one client may hold open at once.
pub const MAX_WAITS_PER_CLIENT: usize = 32;

/// The longest `wait_seconds`.
pub const MAX_WAIT_SECONDS: u64 = 30;

/// `wait_seconds` when the query has none: the longest wait, as a long poll means.
const DEFAULT_WAIT_SECONDS: u64 = MAX_WAIT_SECONDS;

/// The bells of the operations being waited on, and how many waits each client holds.
#[derive(Default)]
pub(crate) struct Waits {
    inner: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    bells: HashMap<String, Bell>,
    per_client: HashMap<String, usize>,
}

struct Bell {
    ring: watch::Sender<()>,
    waiters: usize,
}

/// The client already holds [`MAX_WAITS_PER_CLIENT`] waits.
#[derive(Debug)]
pub(crate) struct TooManyWaits;

impl Waits {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rings the bell of operation `id`, if anyone waits on it. Call after the change is
    /// durable, so a woken waiter reads it.
    pub(crate) fn ring(&self, id: &str) {
        if let Some(bell) = self.registry().bells.get(id) {
            bell.ring.send_replace(());
        }
    }

    /// Takes one of `client`'s wait slots on operation `id`; the slot's bell hears every change
    /// from now on.
    pub(crate) fn enter(&self, client: &str, id: &str) -> Result<WaitSlot<'_>, TooManyWaits> {
        let mut registry = self.registry();
        let held = registry.per_client.entry(client.to_owned()).or_insert(0);
        if *held >= MAX_WAITS_PER_CLIENT {
            return Err(TooManyWaits);
        }
        *held += 1;
        let bell = registry.bells.entry(id.to_owned()).or_insert_with(|| Bell {
            ring: watch::Sender::new(()),
            waiters: 0,
        });
        bell.waiters += 1;
        Ok(WaitSlot {
            waits: self,
            client: client.to_owned(),
            id: id.to_owned(),
            bell: bell.ring.subscribe(),
        })
    }

    /// How many waits are open (all clients).
    #[cfg(test)]
    fn open(&self) -> usize {
        self.registry().per_client.values().sum()
    }

    /// How many operations have a bell.
    #[cfg(test)]
    fn bells(&self) -> usize {
        self.registry().bells.len()
    }
}

/// One open wait: a client's slot and the operation's bell. Dropping it gives both back.
pub(crate) struct WaitSlot<'a> {
    waits: &'a Waits,
    client: String,
    id: String,
    bell: watch::Receiver<()>,
}

impl WaitSlot<'_> {
    /// Returns once the bell rings (at once if it rang since the last call or since entering).
    async fn rung(&mut self) {
        // The sender lives in the registry as long as this slot does, so this never fails.
        let _ = self.bell.changed().await;
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        let mut registry = self.waits.registry();
        if let Some(held) = registry.per_client.get_mut(&self.client) {
            *held -= 1;
            if *held == 0 {
                registry.per_client.remove(&self.client);
            }
        }
        if let Some(bell) = registry.bells.get_mut(&self.id) {
            bell.waiters -= 1;
            if bell.waiters == 0 {
                registry.bells.remove(&self.id);
            }
        }
    }
}

/// The wait's query: `after_revision` (≥ 0, default 0) and `wait_seconds` (0–30, default 30).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct WaitQuery {
    pub(crate) after_revision: u64,
    pub(crate) wait: Duration,
}

pub(crate) fn parse_query(pairs: Vec<(String, String)>) -> Result<WaitQuery, ApiError> {
    let params = single_params(pairs, &["after_revision", "wait_seconds"])?;
    let after_revision = match params.get("after_revision") {
        None => 0,
        Some(text) => parse_integer(text)
            .ok_or_else(|| ApiError::invalid("after_revision must be an integer of at least 0."))?,
    };
    let seconds = match params.get("wait_seconds") {
        None => DEFAULT_WAIT_SECONDS,
        Some(text) => parse_integer(text)
            .filter(|s| *s <= MAX_WAIT_SECONDS)
            .ok_or_else(|| ApiError::invalid("wait_seconds must be an integer from 0 to 30."))?,
    };
    Ok(WaitQuery {
        after_revision,
        wait: Duration::from_secs(seconds),
    })
}

/// The events route.
pub(crate) async fn wait_for_change(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    OperationId(id): OperationId,
    QueryPairs(pairs): QueryPairs,
) -> ApiResult {
    let client = &client;
    let WaitQuery {
        after_revision,
        wait,
    } = parse_query(pairs)?;
    let deadline = tokio::time::Instant::now() + wait;
    // Enter before the first read: a change committed after that read rings this slot's bell.
    let mut slot = core
        .waits
        .enter(client.as_str(), &id)
        .map_err(|TooManyWaits| {
            tracing::info!(client = %client, "wait refused: too many open");
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_waits",
                format!("This client already holds {MAX_WAITS_PER_CLIENT} open waits."),
            )
            .with_retry_after(1)
        })?;
    let mut shutdown = core.shutdown.clone();
    loop {
        let record = own_record(&core, client, &id).await?;
        if record.revision > after_revision
            || tokio::time::Instant::now() >= deadline
            || *shutdown.borrow()
        {
            return Ok(json_response(StatusCode::OK, record.to_json()));
        }
        tokio::select! {
            _ = slot.rung() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(query: &[(&str, &str)]) -> Vec<(String, String)> {
        query
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_wait_query_is_bounded_and_strict() {
        let ok = parse_query(pairs(&[("after_revision", "3"), ("wait_seconds", "30")])).unwrap();
        assert_eq!(ok.after_revision, 3);
        assert_eq!(ok.wait, Duration::from_secs(30));
        assert_eq!(
            parse_query(vec![]).unwrap(),
            WaitQuery {
                after_revision: 0,
                wait: Duration::from_secs(30)
            }
        );
        for bad in [
            &[("wait_seconds", "31")][..],
            &[("wait_seconds", "-1")],
            &[("wait_seconds", "1.5")],
            &[("after_revision", "-1")],
            &[("after_revision", "x")],
            &[("after_revision", "1"), ("after_revision", "2")],
            &[("since", "1")],
        ] {
            assert!(parse_query(pairs(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn slots_are_bounded_per_client_and_given_back_on_drop() {
        let waits = Waits::default();
        let held: Vec<_> = (0..MAX_WAITS_PER_CLIENT)
            .map(|_| waits.enter("a", "op_1").unwrap())
            .collect();
        assert!(waits.enter("a", "op_2").is_err());
        let other = waits
            .enter("b", "op_1")
            .expect("another client is not blocked");
        assert_eq!(waits.open(), MAX_WAITS_PER_CLIENT + 1);
        drop(held);
        drop(other);
        assert_eq!((waits.open(), waits.bells()), (0, 0));
        assert!(waits.enter("a", "op_2").is_ok());
    }

    #[tokio::test]
    async fn a_ring_wakes_the_waiters_of_that_operation_only() {
        let waits = Waits::default();
        let mut one = waits.enter("a", "op_1").unwrap();
        let two = waits.enter("a", "op_2").unwrap();
        waits.ring("op_1");
        tokio::time::timeout(Duration::from_secs(10), one.rung())
            .await
            .expect("the rung operation's waiter wakes");
        assert!(
            !two.bell.has_changed().unwrap(),
            "another operation's waiter sleeps on"
        );
        waits.ring("op_unwatched");
        assert_eq!(waits.bells(), 2);
    }
}
