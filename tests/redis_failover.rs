//! A Redis failover under replicas (issue 21), on real `redis-server` processes:
//! a primary, a `--replicaof` Redis replica, the primary lost, `REPLICAOF NO ONE` on the replica
//! and the admission replicas pointed at it. What the Redis replica had received is kept (the
//! deployment's epoch, so no recovery window; the counts; the rate tokens and key records);
//! what the primary acknowledged but had not yet replicated is lost: each such admission can be
//! admitted once more (its rate token and its key's binding are gone), which is the
//! over-admission bound `docs/replicas.md` states. The counts themselves come back exactly, from the
//! replicas' stores, as after any restart. With `wait_replicas` an admission is answered only
//! once the Redis replica holds it: one it did not acknowledge is given back, unanswered.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::redis::RedisServer;
use unyolo_admission::admission::{
    Admission, AdmitError, OperationHandle, ReplicaOptions, RestoredOperation, UnavailableReason,
};
use unyolo_admission::config::{ClientLimits, Limits};
use unyolo_admission::{Config, Controller, Identity, OperationState};

/// amy: ten live; dan: two tokens an hour.
fn config() -> Config {
    let limits = Limits {
        requests_per_window: 1000,
        window_seconds: 3600,
        client_active: 10,
        client_pending: 10,
        global_active: 100,
        global_executing: 10,
    };
    let mut overrides = BTreeMap::new();
    overrides.insert(
        Identity::new("dan").unwrap(),
        ClientLimits {
            requests_per_window: 2,
            window_seconds: 3600,
            active: 10,
            pending: 10,
        },
    );
    Config::new(
        limits,
        overrides,
        [Identity::new("amy").unwrap(), Identity::new("dan").unwrap()],
    )
    .unwrap()
}

/// Options for replica `name` of a deployment whose replicas are `fleet` (itself included; none
/// listed: each then knows only what it hears from Redis, and a recovery window, if one opened,
/// would last its whole lease period).
fn options(server: &RedisServer, name: &str, fleet: &[&str]) -> ReplicaOptions {
    let mut options = ReplicaOptions::new(server.url(), name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.lease_ttl = Duration::from_secs(60);
    options.heartbeat = Duration::from_secs(20);
    options.call_timeout = Duration::from_millis(800);
    options.refusal_memory = false;
    options
}

/// A registered replica, and the handles of what it restored.
async fn replica_restoring(
    options: ReplicaOptions,
    restored: Vec<RestoredOperation>,
) -> (Admission, Vec<OperationHandle>) {
    let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
    let restored = admission.restore(restored).await;
    assert!(restored.deferred.is_none(), "{:?}", restored.deferred);
    let handles = restored
        .operations
        .into_iter()
        .map(Result::unwrap)
        .collect();
    (admission, handles)
}

async fn replica(options: ReplicaOptions) -> Admission {
    replica_restoring(options, Vec::new()).await.0
}

/// What a replica's store would hold of a live operation.
fn stored(handle: &OperationHandle) -> RestoredOperation {
    RestoredOperation {
        id: handle.id().to_string(),
        identity: handle.identity().clone(),
        state: handle.state(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_keeps_what_was_replicated_and_loses_at_most_the_admissions_not_yet_replicated()
{
    let Some(primary) = RedisServer::start() else {
        return;
    };
    let standby = RedisServer::start_replica_of(primary.port);
    // The deployment starts as f1 alone (f2 joins it later): f1 admits once it has registered.
    let f1 = replica(options(&primary, "f1", &["f1"])).await;
    let mut live = Vec::new();

    // Replicated: amy's pending operation under "kept", dan's first token.
    live.push(f1.admit("amy", true, Some("kept")).await.unwrap().commit());
    live.push(f1.admit("dan", false, None).await.unwrap().commit());
    assert!(primary.replicated(1, Duration::from_secs(10)));

    // The Redis replica stops receiving: the primary still answers, and acknowledges.
    standby.cut_off();
    live.push(f1.admit("amy", true, Some("lost")).await.unwrap().commit());
    live.push(f1.admit("dan", false, None).await.unwrap().commit());
    assert!(matches!(
        f1.admit("dan", false, None).await,
        Err(AdmitError::Refused(_))
    ));
    // A replica that waits for the Redis replica's acknowledgement answers nothing it lacks:
    // its admission is given back and answered unavailable.
    let mut waiting = options(&primary, "f2", &["f1", "f2"]);
    waiting.wait_replicas = 1;
    let f2 = replica(waiting).await;
    match f2.admit("amy", false, Some("unacknowledged")).await {
        Err(AdmitError::Unavailable(u)) => {
            assert!(
                matches!(u.reason, UnavailableReason::Redis(ref m) if m.contains("acknowledged")),
                "{u}"
            )
        }
        other => panic!("answered without the replica's acknowledgement: {other:?}"),
    }
    f2.shutdown().await;
    assert_eq!(f1.counts().await.unwrap().clients["amy"].0, 2);

    // The primary is lost; the Redis replica is promoted, and f1 restarts pointed at it with
    // what its store holds (its four live operations).
    let restored: Vec<RestoredOperation> = live.iter().map(stored).collect();
    f1.shutdown().await;
    drop(live);
    drop(f1);
    drop(primary);
    standby.promote();
    // Neither lists the fleet: had the failover opened a recovery window, no replica could
    // close it early, and f3 would admit nothing for a whole lease period (60 s).
    let (f1, restored) = replica_restoring(options(&standby, "f1", &[]), restored).await;
    let f3 = replica(options(&standby, "f3", &[])).await;

    // Kept: the epoch (no recovery window: f3 admits at once), the counts (exactly the four,
    // from f1's store), the key record of "kept" (a replay on f3).
    let counts = f3.counts().await.unwrap();
    assert_eq!(counts.clients["amy"], (2, 2, 0), "{counts:?}");
    assert_eq!(counts.clients["dan"].0, 2, "{counts:?}");
    match f3.admit("amy", true, Some("kept")).await {
        Err(AdmitError::Replay { replica, .. }) => assert_eq!(replica, "f1"),
        other => panic!("the replicated key was lost: {other:?}"),
    }
    // Lost: what the primary had not replicated. The key "lost" is free again (one more
    // operation for it), and dan's second token is back (one more admission than his rate):
    // exactly the admissions the Redis replica never received.
    let again = f3.admit("amy", true, Some("lost")).await.unwrap().commit();
    let extra = f3.admit("dan", false, None).await.unwrap().commit();
    assert!(
        matches!(
            f3.admit("dan", false, None).await,
            Err(AdmitError::Refused(_))
        ),
        "one token over, not more"
    );
    assert_eq!(again.state(), OperationState::Pending);
    for operation in restored.iter().chain([&again, &extra]) {
        operation.fail().await.unwrap();
    }
    assert!(f1.flush().await && f3.flush().await);
    assert!(f3.counts().await.unwrap().is_idle());
    f1.shutdown().await;
    f3.shutdown().await;
}
