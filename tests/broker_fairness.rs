//! SPEC section 6, "no client starves the others", against a broker in-process: one client
//! holding its whole share of requests in flight gets 429 `client_request_limit` past it, while
//! another client's submission, `/healthz` and the first client's own cancel are answered; its
//! units come back when its requests end.
#![cfg(feature = "broker")]

mod support;

use std::time::Duration;

use support::broker::{ROOMY, settings, start_with};
use support::eventually::assert_eventually;
use support::http::request;
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET, OTHER_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission::broker::BrokerSettings;
use unyolo_admission::fairness::FairnessConfig;

/// A share of 4 units, none of them queued: a fifth unit is refused at once.
const SHARE: u32 = 4;

fn fairness() -> FairnessConfig {
    FairnessConfig {
        per_client_units: SHARE,
        exempt_reserved_units: 4,
        total_units: 16,
        queue_depth: 0,
        queue_wait: Duration::from_secs(1),
        retry_after: Duration::from_secs(1),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holding_its_share_with_long_polls_cannot_keep_out_another_client_health_or_its_cancel()
 {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(BrokerSettings {
        fairness: fairness(),
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let created = h
        .submit(AGENT_SECRET, &request("held", "demo.request", 0))
        .await;
    assert_eq!(created.status, 202, "{}", created.body);
    let id = created.id();
    let revision = created.body["revision"].as_u64().unwrap();

    // The agent's whole share: long polls that wait for a change nobody makes yet.
    let mut waits = tokio::task::JoinSet::new();
    for _ in 0..SHARE {
        let url = format!(
            "{}/api/agent/v1/operations/{id}/events?after_revision={revision}&wait_seconds=30",
            h.base
        );
        let http = h.http.clone();
        waits.spawn(async move {
            let reply = http
                .get(url)
                .bearer_auth(AGENT_SECRET)
                .send()
                .await
                .unwrap();
            reply.status().as_u16()
        });
    }
    assert_eventually("the long polls hold the agent's whole share", async || {
        h.broker
            .fairness()
            .snapshot()
            .client(AGENT)
            .is_some_and(|flow| flow.units == SHARE && flow.requests == SHARE)
    })
    .await;

    // Past its share: 429 client_request_limit, Retry-After, no-store; nothing reaches the route.
    let refused = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.code(), "client_request_limit");
    assert_eq!(refused.retry_after(), Some(1));
    assert_eq!(refused.header("cache-control"), Some("no-store"));
    let again = h
        .submit(AGENT_SECRET, &request("over-share", "demo.run", 0))
        .await;
    assert_eq!(again.status, 429, "{}", again.body);
    assert_eq!(h.rows().await, 1, "a refused submission wrote nothing");

    // Everyone else, and the exempt routes, still answer.
    let other = h
        .submit(OTHER_SECRET, &request("other", "demo.run", 0))
        .await;
    assert_eq!(other.status, 202, "{}", other.body);
    assert_eq!(h.get("/healthz", None).await.status, 200);
    let text = h.metrics().await;
    let rejected = format!(
        "broker_client_requests_rejected_total{{client=\"{AGENT}\",reason=\"queue_full\"}}"
    );
    assert_eq!(metric(&text, &rejected), Some(2), "{text}");
    let units = format!("broker_client_units_in_flight{{client=\"{AGENT}\"}}");
    assert_eq!(metric(&text, &units), Some(u64::from(SHARE)), "{text}");
    let canceled = h
        .post(
            &format!("/api/agent/v1/operations/{id}/cancel"),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(canceled.status, 200, "{}", canceled.body);
    assert_eq!(canceled.state(), "canceled");

    // The cancel is the change the long polls waited for: they end, and give their units back.
    while let Some(status) = waits.join_next().await {
        assert_eq!(status.unwrap(), 200);
    }
    assert_eventually("every unit is back", async || {
        h.broker.fairness().snapshot().is_idle()
    })
    .await;
    let text = h.metrics().await;
    assert_eq!(metric(&text, &units), Some(0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_token_is_still_answered_403_through_the_fairness_layer() {
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(BrokerSettings {
        fairness: fairness(),
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let reply = h
        .get("/api/agent/v1/operations", Some("not-a-secret"))
        .await;
    assert_eq!(reply.status, 403, "{}", reply.body);
    assert_eq!(reply.code(), "authentication_failed");
    assert!(h.broker.fairness().snapshot().is_idle());
}

#[tokio::test]
async fn fairness_numbers_that_cannot_work_stop_the_broker_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let settings = BrokerSettings {
        fairness: FairnessConfig {
            per_client_units: 0,
            ..FairnessConfig::default()
        },
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    };
    let err = unyolo_admission::broker::Broker::start(settings)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("per-client units"), "{err}");
}
