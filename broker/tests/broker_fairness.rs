//! SPEC section 6, "no client starves the others", against a broker in-process: one client
//! holding its whole share of requests in flight gets 429 `client_request_limit` past it, while
//! another client's submission, `/healthz` and the first client's own cancel are answered; its
//! units come back when its requests end. Bodies and answers past the buffered-bytes budget are
//! refused unread, and an agent's body holding that whole budget cannot keep out an operator's
//! decision.

mod support;

use std::time::Duration;

use support::broker::{ROOMY, settings, start_with};
use support::eventually::assert_eventually;
use support::http::{read_answer, request};
use support::metrics::metric;
use support::secrets::{AGENT, AGENT_SECRET, OPERATOR_SECRET, OTHER_SECRET};
use unyolo_admission::StorageCaps;
use unyolo_admission_broker::BrokerSettings;
use unyolo_admission_broker::fairness::FairnessConfig;

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
    // Every submission's 429 carries the client's quota fields, this one too (section 5).
    let policy = again.header("ratelimit-policy").expect("RateLimit-Policy");
    assert!(policy.contains("\"rate\""), "{policy}");
    assert!(again.header("ratelimit").is_some());
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
    let err = unyolo_admission_broker::Broker::start(settings)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("per-client units"), "{err}");
}

/// The broker's resident memory (this process's, as the broker runs in it), in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_byte_budget_are_refused_unread_while_another_client_and_health_answer() {
    use tokio::io::AsyncWriteExt;
    const BODY: usize = 1 << 20;
    const HELD: usize = 4;
    const SENT: usize = 12;
    let budget = HELD * BODY + BODY / 2;
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(BrokerSettings {
        buffered_bytes: budget,
        // No minimum rate: the held bodies stay held until the test lets them go.
        connections: unyolo_admission_broker::ConnectionSettings {
            body_min_rate: 0,
            ..Default::default()
        },
        // A share for every body at once (18 units each): only the byte budget binds.
        fairness: FairnessConfig {
            per_client_units: 400,
            ..FairnessConfig::default()
        },
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let addr = h.broker.local_addr();

    // SENT submissions of one client, each declaring a whole 1 MiB body and sending 64 KiB of it.
    let (release, released) = tokio::sync::watch::channel(false);
    let (answered, mut answers) = tokio::sync::mpsc::unbounded_channel();
    let mut bodies = tokio::task::JoinSet::new();
    for n in 0..SENT {
        let (mut released, answered) = (released.clone(), answered.clone());
        bodies.spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut read, mut write) = stream.into_split();
            let head = format!(
                "POST /api/agent/v1/operations HTTP/1.1\r\nHost: x\r\n\
                 Authorization: Bearer {AGENT_SECRET}\r\nContent-Type: application/json\r\n\
                 Content-Length: {BODY}\r\n\r\n{{\"idempotency_key\": \"big-{n}\", \"reason\": \""
            );
            write.write_all(head.as_bytes()).await.unwrap();
            let _ = write.write_all(&vec![b'x'; 64 << 10]).await;
            tokio::select! {
                answer = read_answer(&mut read) => { let _ = answered.send(answer); }
                _ = released.changed() => {}
            }
        });
    }
    drop(answered);
    for _ in 0..SENT - HELD {
        let answer = tokio::time::timeout(support::eventually::PATIENCE, answers.recv())
            .await
            .expect("a body past the budget was answered")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("body_budget_exhausted"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("retry-after: 1"),
            "{answer}"
        );
    }
    let text = h.metrics().await;
    let held = (HELD * BODY) as u64;
    assert_eq!(
        metric(&text, "broker_buffered_bytes "),
        Some(held),
        "{text}"
    );
    assert_eq!(
        metric(&text, "broker_buffered_bytes_refused_total"),
        Some((SENT - HELD) as u64),
        "{text}"
    );
    assert_eq!(
        metric(&text, "broker_buffered_bytes_limit"),
        Some(budget as u64)
    );

    // Another client's small submission, its reads and /healthz are answered meanwhile.
    let other = h
        .submit(OTHER_SECRET, &request("small", "demo.run", 0))
        .await;
    assert_eq!(other.status, 202, "{}", other.body);
    assert_eq!(
        h.get("/api/agent/v1/operations", Some(OTHER_SECRET))
            .await
            .status,
        200
    );
    assert_eq!(h.get("/healthz", None).await.status, 200);
    let rss = resident_bytes();
    let bound = budget as u64 + (200 << 20);
    assert!(rss < bound, "resident {rss} bytes, above {bound}");

    // Let the held bodies go: their handlers see the hang-up, and the budget is whole again.
    let _ = release.send(true);
    while bodies.join_next().await.is_some() {}
    assert_eventually("the held bodies' bytes are given back", async || {
        metric(&h.metrics().await, "broker_buffered_bytes ") == Some(0)
    })
    .await;
    assert_eq!(
        h.rows().await,
        1,
        "only the other client's submission was created"
    );
}

/// A `demo.run` submission whose arguments carry `bytes` of padding (still within the 1 MiB
/// body limit when `bytes` is below it).
fn heavy_request(key: &str, bytes: usize) -> serde_json::Value {
    serde_json::json!({
        "idempotency_key": key,
        "operation": "demo.run",
        "target": {"repo": "unyolo/test"},
        "arguments": {"duration_ms": 0, "padding": "x".repeat(bytes)},
        "reason": "heavy row",
    })
}

/// Opens `n` submissions of one client that each declare a whole 1 MiB body, send 64 KiB of it
/// and hold the rest, so their room in the byte budget stays reserved until `release` changes.
async fn hold_bodies(
    addr: std::net::SocketAddr,
    n: usize,
    release: &tokio::sync::watch::Sender<bool>,
) -> tokio::task::JoinSet<()> {
    use tokio::io::AsyncWriteExt;
    let mut bodies = tokio::task::JoinSet::new();
    for i in 0..n {
        let mut released = release.subscribe();
        bodies.spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut read, mut write) = stream.into_split();
            let head = format!(
                "POST /api/agent/v1/operations HTTP/1.1\r\nHost: x\r\n\
                 Authorization: Bearer {AGENT_SECRET}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{{\"idempotency_key\": \"held-{i}\", \"reason\": \"",
                1 << 20
            );
            write.write_all(head.as_bytes()).await.unwrap();
            let _ = write.write_all(&vec![b'x'; 64 << 10]).await;
            tokio::select! {
                _ = read_answer(&mut read) => {}
                _ = released.changed() => {}
            }
        });
    }
    bodies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_answer_reserves_its_rendering_in_the_byte_budget_and_past_it_is_refused_unread() {
    const HEAVY: usize = 900_000;
    // Room for one heavy answer (about three times its stored request), not for one beside two
    // held bodies.
    let budget = 4 << 20;
    let dir = tempfile::tempdir().unwrap();
    let h = start_with(BrokerSettings {
        buffered_bytes: budget,
        connections: unyolo_admission_broker::ConnectionSettings {
            body_min_rate: 0,
            ..Default::default()
        },
        ..settings(dir.path(), ROOMY, StorageCaps::default())
    })
    .await;
    let heavy = h.submit(AGENT_SECRET, &heavy_request("heavy", HEAVY)).await;
    assert_eq!(heavy.status, 202, "{}", heavy.body);
    let light = h
        .submit(AGENT_SECRET, &request("light", "demo.run", 0))
        .await;
    assert_eq!(light.status, 202, "{}", light.body);
    let heavy_path = format!("/api/agent/v1/operations/{}", heavy.id());
    let light_path = format!("/api/agent/v1/operations/{}", light.id());

    // With room: the whole operation, and its replay, are answered.
    let got = h.get(&heavy_path, Some(AGENT_SECRET)).await;
    assert_eq!(got.status, 200, "{}", got.body);
    assert_eq!(
        got.body["arguments"]["padding"].as_str().unwrap().len(),
        HEAVY
    );
    let replayed = h.submit(AGENT_SECRET, &heavy_request("heavy", HEAVY)).await;
    assert_eq!(replayed.status, 200, "{}", replayed.body);
    assert_eq!(replayed.id(), heavy.id());
    assert_eventually("the answers' bytes are given back once sent", async || {
        metric(&h.metrics().await, "broker_buffered_bytes ") == Some(0)
    })
    .await;

    // Two held bodies take 2 MiB: a heavy answer no longer fits, and waits, then is refused
    // before anything is read; light answers and pages still fit.
    let (release, _) = tokio::sync::watch::channel(false);
    let mut bodies = hold_bodies(h.broker.local_addr(), 2, &release).await;
    assert_eventually("the held bodies hold their room", async || {
        metric(&h.metrics().await, "broker_buffered_bytes ") == Some(2 << 20)
    })
    .await;
    let refused_before = metric(&h.metrics().await, "broker_buffered_bytes_refused_total");
    let refused = h.get(&heavy_path, Some(AGENT_SECRET)).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.code(), "response_budget_exhausted");
    assert_eq!(refused.retry_after(), Some(1));
    let replay = h.submit(AGENT_SECRET, &heavy_request("heavy", HEAVY)).await;
    assert_eq!(replay.status, 503, "{}", replay.body);
    assert_eq!(replay.code(), "response_budget_exhausted");
    // A cancel of an ended operation (a `demo.run` runs at once) is a read of the whole row too:
    // exempt from the fairness share, not from the budget (many cancels of heavy rows once held
    // memory well past it).
    let cancel = h
        .post(&format!("{heavy_path}/cancel"), Some(AGENT_SECRET))
        .await;
    assert_eq!(cancel.status, 503, "{}", cancel.body);
    assert_eq!(cancel.code(), "response_budget_exhausted");
    assert_eq!(
        h.post(&format!("{light_path}/cancel"), Some(AGENT_SECRET))
            .await
            .status,
        200
    );
    assert_eq!(h.get(&light_path, Some(AGENT_SECRET)).await.status, 200);
    let page = h
        .get("/api/agent/v1/operations?limit=50", Some(AGENT_SECRET))
        .await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(page.body["operations"].as_array().unwrap().len(), 2);
    let text = h.metrics().await;
    assert_eq!(
        metric(&text, "broker_buffered_bytes_refused_total"),
        refused_before.map(|n| n + 3),
        "{text}"
    );
    // A conflict is judged by the digest alone: answered at once, whatever the budget.
    let mut other_request = heavy_request("heavy", HEAVY);
    other_request["reason"] = serde_json::json!("another reason");
    let conflict = h.submit(AGENT_SECRET, &other_request).await;
    assert_eq!(conflict.status, 409, "{}", conflict.body);
    assert_eq!(conflict.code(), "idempotency_conflict");

    let _ = release.send(true);
    while bodies.join_next().await.is_some() {}
    assert_eventually("the heavy operation is answered again", async || {
        h.get(&heavy_path, Some(AGENT_SECRET)).await.status == 200
    })
    .await;
    assert_eq!(
        h.rows().await,
        2,
        "nothing but the two submissions was created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_body_holding_the_whole_byte_budget_cannot_keep_out_an_operator_decision() {
    let dir = tempfile::tempdir().unwrap();
    let h = HeldBody::start_broker(dir.path()).await;
    let asked = h
        .submit(AGENT_SECRET, &request("asks", "demo.request", 0))
        .await;
    assert_eq!(asked.status, 202, "{}", asked.body);
    let id = asked.id();
    let revision = asked.body["revision"].as_u64().unwrap();

    let held = HeldBody::hold(&h, HeldBody::BODY).await;

    // Another client's submission waits in line for room meanwhile, and the operator denies the
    // request: the decision is applied while the agent's body is still held (before: it waited
    // behind both for a second, then was 503 `temporarily_unavailable`, nothing decided).
    let decision = serde_json::json!({"expected_revision": revision, "idempotency_key": "d1"});
    let small = request("waits", "demo.run", 0);
    let (waited, decided) = tokio::join!(
        h.submit(OTHER_SECRET, &small),
        h.operator.decide(&id, "deny", &decision),
    );
    assert_eq!(decided.status, 200, "{}", decided.body);
    assert_eq!(decided.body["status"], "denied", "{}", decided.body);
    assert_eq!(h.operator.request(&id).await.body["status"], "denied");
    // The waiting submission is refused unread as before, and consumes nothing.
    assert_eq!(waited.status, 503, "{}", waited.body);
    assert_eq!(waited.code(), "body_budget_exhausted");
    assert_eq!(waited.retry_after(), Some(1));
    assert_eq!(h.rows().await, 1, "the refused submission wrote nothing");

    // The held body, sent whole at last, is created as it always was.
    held.finish(&h).await;
    assert_eq!(h.rows().await, 2);
    // The agent sees its request denied, once there is room to answer it whole.
    let agent_view = h
        .get(
            &format!("/api/agent/v1/operations/{id}"),
            Some(AGENT_SECRET),
        )
        .await;
    assert_eq!(agent_view.state(), "denied", "{}", agent_view.body);
}

/// An agent's submission of exactly `bytes` (a valid body, padded in its arguments) on a raw
/// connection, its first 64 KiB sent and the rest held: its room in the buffered-bytes budget
/// stays reserved until [`HeldBody::finish`].
struct HeldBody {
    read: tokio::net::tcp::OwnedReadHalf,
    write: tokio::net::tcp::OwnedWriteHalf,
    whole: Vec<u8>,
}

impl HeldBody {
    const SENT: usize = 64 << 10;
    /// A whole 1 MiB submission body.
    const BODY: usize = 1 << 20;

    /// A broker whose buffered-bytes budget is one held [`HeldBody::BODY`] and 24 bytes more (no
    /// decision body or answer fits beside it), with no minimum body rate, so a held body stays
    /// held until the test sends the rest.
    async fn start_broker(dir: &std::path::Path) -> support::broker::Harness {
        start_with(BrokerSettings {
            buffered_bytes: Self::BODY + 24,
            connections: unyolo_admission_broker::ConnectionSettings {
                body_min_rate: 0,
                ..Default::default()
            },
            ..settings(dir, ROOMY, StorageCaps::default())
        })
        .await
    }

    async fn hold(h: &support::broker::Harness, bytes: usize) -> HeldBody {
        use tokio::io::AsyncWriteExt;
        let prefix = concat!(
            r#"{"idempotency_key":"whole","operation":"demo.run","#,
            r#""target":{"repo":"unyolo/test"},"arguments":{"duration_ms":0,"padding":""#
        );
        let suffix = r#""},"reason":"a whole body"}"#;
        let mut whole = prefix.as_bytes().to_vec();
        whole.resize(bytes - suffix.len(), b'x');
        whole.extend_from_slice(suffix.as_bytes());
        let stream = tokio::net::TcpStream::connect(h.broker.local_addr())
            .await
            .unwrap();
        let (read, mut write) = stream.into_split();
        let head = format!(
            "POST /api/agent/v1/operations HTTP/1.1\r\nHost: x\r\n\
             Authorization: Bearer {AGENT_SECRET}\r\nContent-Type: application/json\r\n\
             Content-Length: {bytes}\r\n\r\n"
        );
        write.write_all(head.as_bytes()).await.unwrap();
        write.write_all(&whole[..Self::SENT]).await.unwrap();
        assert_eventually("the agent's body holds the budget", async || {
            metric(&h.metrics().await, "broker_buffered_bytes ") == Some(bytes as u64)
        })
        .await;
        HeldBody { read, write, whole }
    }

    /// Sends the rest: the submission is created (202) and its bytes are given back.
    async fn finish(mut self, h: &support::broker::Harness) {
        use tokio::io::AsyncWriteExt;
        self.write
            .write_all(&self.whole[Self::SENT..])
            .await
            .unwrap();
        let answer =
            tokio::time::timeout(support::eventually::PATIENCE, read_answer(&mut self.read))
                .await
                .expect("the whole body was answered");
        assert!(
            answer.starts_with("HTTP/1.1 202"),
            "{}",
            &answer[..answer.len().min(500)]
        );
        drop(self);
        assert_eventually("the body's bytes are given back", async || {
            metric(&h.metrics().await, "broker_buffered_bytes ") == Some(0)
        })
        .await;
    }
}

/// A cancel is exempt from the fairness share, not from the buffered-bytes budget its answer is
/// rendered in; with that budget full, the cancel still takes effect, and its 503 says so.
/// Before: it waited a second for room and was refused with the operation still pending.
#[tokio::test]
async fn a_cancel_takes_effect_while_an_agent_body_holds_the_whole_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let h = HeldBody::start_broker(dir.path()).await;
    let asked = h
        .submit(AGENT_SECRET, &request("asks", "demo.request", 0))
        .await;
    assert_eq!(asked.status, 202, "{}", asked.body);
    let id = asked.id();
    let cancel = format!("/api/agent/v1/operations/{id}/cancel");
    let held = HeldBody::hold(&h, HeldBody::BODY).await;

    let canceled = h.post(&cancel, Some(AGENT_SECRET)).await;
    assert_eq!(canceled.status, 503, "{}", canceled.body);
    assert_eq!(canceled.code(), "response_budget_exhausted");
    assert_eq!(canceled.retry_after(), Some(1));
    assert!(
        canceled.body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("The operation is canceled"),
        "{}",
        canceled.body
    );
    // Applied, budget or not: the operator's inbox no longer holds it.
    assert_eq!(h.operator.request(&id).await.body["status"], "canceled");
    // A second cancel changes nothing and, being a read, waits for room like one.
    let again = h.post(&cancel, Some(AGENT_SECRET)).await;
    assert_eq!(again.status, 503, "{}", again.body);
    assert_eq!(again.code(), "response_budget_exhausted");

    held.finish(&h).await;
    let read = h.post(&cancel, Some(AGENT_SECRET)).await;
    assert_eq!(read.status, 200, "{}", read.body);
    assert_eq!(read.state(), "canceled", "{}", read.body);
    assert!(read.body["terminal_at"].is_string(), "{}", read.body);
}

/// Decisions read their bodies within a room of their own (one largest decision body per unit of
/// the exempt reserve); only other decisions fill it, and its metrics say how full it is. With a
/// one-unit room filled by one operator's slow decision, another decision waits, then is a
/// retryable 503 with nothing decided, while the agents' budget is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_other_decisions_fill_the_decisions_room_and_its_metrics_say_how_full() {
    use tokio::io::AsyncWriteExt;
    const ROOM: u64 = 96 * 1024;
    // The largest decision body: the whole room.
    const HELD: usize = 96 * 1024;
    let dir = tempfile::tempdir().unwrap();
    let base = settings(dir.path(), ROOMY, StorageCaps::default());
    let h = start_with(BrokerSettings {
        fairness: FairnessConfig {
            exempt_reserved_units: 1,
            ..base.fairness
        },
        connections: unyolo_admission_broker::ConnectionSettings {
            body_min_rate: 0,
            ..Default::default()
        },
        ..base
    })
    .await;
    let mut ids = Vec::new();
    for key in ["first", "second"] {
        let asked = h
            .submit(AGENT_SECRET, &request(key, "demo.request", 0))
            .await;
        assert_eq!(asked.status, 202, "{}", asked.body);
        ids.push(asked.id());
    }
    let text = h.metrics().await;
    assert_eq!(metric(&text, "broker_decision_bytes_limit"), Some(ROOM));
    assert_eq!(metric(&text, "broker_decision_bytes "), Some(0));

    // A deny of the first, padded with JSON whitespace to 96 KiB, its last byte held back.
    let mut body = br#"{"expected_revision":1,"idempotency_key":"slow""#.to_vec();
    body.resize(HELD - 1, b' ');
    body.push(b'}');
    let stream = tokio::net::TcpStream::connect(h.operator_addr())
        .await
        .unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = format!(
        "POST /api/operator/v1/requests/{}/deny HTTP/1.1\r\nHost: x\r\n\
         Authorization: Bearer {OPERATOR_SECRET}\r\nContent-Type: application/json\r\n\
         Content-Length: {HELD}\r\n\r\n",
        ids[0]
    );
    write.write_all(head.as_bytes()).await.unwrap();
    write.write_all(&body[..HELD - 1]).await.unwrap();
    assert_eventually("the slow decision holds the room", async || {
        metric(&h.metrics().await, "broker_decision_bytes ") == Some(HELD as u64)
    })
    .await;

    let decision = serde_json::json!({"expected_revision": 1, "idempotency_key": "quick"});
    let refused = h.operator.decide(&ids[1], "deny", &decision).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.code(), "temporarily_unavailable");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(h.operator.request(&ids[1]).await.body["status"], "pending");
    let text = h.metrics().await;
    assert_eq!(
        metric(&text, "broker_decision_bytes_refused_total"),
        Some(1)
    );
    assert_eq!(metric(&text, "broker_buffered_bytes "), Some(0), "{text}");
    assert_eq!(
        metric(&text, "broker_buffered_bytes_refused_total"),
        Some(0),
        "{text}"
    );

    // The slow decision ends; its room comes back, and the other decision is taken.
    write.write_all(&body[HELD - 1..]).await.unwrap();
    let answer = tokio::time::timeout(support::eventually::PATIENCE, read_answer(&mut read))
        .await
        .expect("the slow decision was answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""status":"denied""#), "{answer}");
    assert_eventually("the slow decision's room comes back", async || {
        metric(&h.metrics().await, "broker_decision_bytes ") == Some(0)
    })
    .await;
    let taken = h.operator.decide(&ids[1], "deny", &decision).await;
    assert_eq!(taken.status, 200, "{}", taken.body);
    assert_eq!(taken.body["status"], "denied", "{}", taken.body);
}
