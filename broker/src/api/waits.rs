//! `GET /api/agent/v1/operations/{id}/events?after_revision=N&wait_seconds=S`: long-poll waits.
//!
//! A wait answers with the operation as soon as its revision is above N (at once if it already
//! is, or if the operation has ended: it will not change again, as upstream's wait knows), after
//! S seconds as it is, or at shutdown as it is. It listens on the operation's bell in
//! the core's registry of open waits (`broker::waits`, which also bounds how many one client
//! holds), never polling the store. A change made while the broker was down (recovery failing
//! interrupted work) is in the durable revision, so a wait after a restart that names an older
//! revision answers at once.
//!
//! A client that hangs up drops the handler at an `.await`; the slot it held is released by its
//! `Drop`, so no count leaks. Nothing is written, so nothing can be left half-done.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;

use super::error::{ApiError, ApiResult};
use super::extract::{
    Client, OperationId, QueryPairs, own_request, parse_integer, render_operation, single_params,
};
use crate::core::Core;
use crate::store::StoredRequest;
use crate::waits::{MAX_WAITS_PER_CLIENT, TooManyWaits};

/// The longest `wait_seconds`.
pub const MAX_WAIT_SECONDS: u64 = 30;

/// `wait_seconds` when the query has none: the longest wait, as a long poll means.
const DEFAULT_WAIT_SECONDS: u64 = MAX_WAIT_SECONDS;

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
    let mut shutdown = core.shutdown.clone();
    // Whether `request`, read now, is the answer: its revision is above N, it has ended (it will
    // not change again, as upstream's wait knows), the time is up, or the broker is stopping.
    let answers = |request: &StoredRequest, shutdown: &tokio::sync::watch::Receiver<bool>| {
        request.revision > after_revision
            || request.terminal
            || tokio::time::Instant::now() >= deadline
            || *shutdown.borrow()
    };
    // A first read, without a wait slot: a wait that answers at once (or an id that is not the
    // client's) holds no slot, so a client whose slots are all open still reads through this
    // route what it would read at once.
    let request = own_request(&core, client, &id).await?;
    if answers(&request, &shutdown) {
        return answer(&core, &request).await;
    }
    // Enter before the next read: a change committed after that read rings this slot's bell.
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
    loop {
        // Each wake-up reads the revision only; the operation is read and rendered once, within
        // the buffered-bytes budget, when it is the answer.
        let request = own_request(&core, client, &id).await?;
        if answers(&request, &shutdown) {
            return answer(&core, &request).await;
        }
        tokio::select! {
            _ = slot.rung() => {}
            _ = tokio::time::sleep_until(deadline) => {}
            _ = shutdown.wait_for(|stop| *stop) => {}
        }
    }
}

/// The operation `request` names, read whole and rendered within the buffered-bytes budget.
async fn answer(core: &Core, request: &StoredRequest) -> ApiResult {
    render_operation(core, request, StatusCode::OK)
        .await?
        .ok_or_else(ApiError::operation_not_found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::extract::test_pairs as pairs;

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
}
