//! A fleet of replicas admitting under load through a Redis failover, written once for the
//! Sentinel and the Cluster tests: the quota they share, the fleet with its [`Load`], and what
//! every failover must leave behind ([`assert_nothing_lost_and_all_drained`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::eventually::assert_eventually;
use super::redis_ha::{Load, Seen, assert_notices_heard, errors, missing};
use unyolo_admission::admission::{Admission, ReplicaOptions};
use unyolo_admission::config::Limits;
use unyolo_admission::{Config, Controller, Identity};

/// The contract's pause: admissions resume within this of the promotion.
pub const RESUME_WITHIN: Duration = Duration::from_secs(2);
pub const CLIENT_ACTIVE: u32 = 4;
pub const GLOBAL_ACTIVE: u32 = 6;

/// amy and bob: four live each, six in all.
pub fn config() -> Config {
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 60,
        client_active: CLIENT_ACTIVE,
        client_pending: CLIENT_ACTIVE,
        global_active: GLOBAL_ACTIVE,
        global_executing: GLOBAL_ACTIVE,
    };
    Config::new(
        limits,
        BTreeMap::new(),
        ["amy", "bob"].map(|c| Identity::new(c).unwrap()),
    )
    .unwrap()
}

/// Replica `name` of `fleet` on the Redis at `url`, heartbeating every `heartbeat`.
pub fn options(url: String, name: &str, fleet: &[&str], heartbeat: Duration) -> ReplicaOptions {
    let mut options = ReplicaOptions::new(url, name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.heartbeat = heartbeat;
    options
}

/// A replica on [`config`], registered with nothing to restore.
pub async fn replica(options: ReplicaOptions) -> Admission {
    let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
    let restored = admission.restore(Vec::new()).await;
    assert!(restored.deferred.is_none(), "{:?}", restored.deferred);
    admission
}

/// Every replica of `fleet` on the Redis at `url`, each waiting for one Redis replica
/// (`WAIT 1`), admitting under a [`Load`] that has been admitted before this returns.
pub async fn fleet_under_load(
    url: &str,
    fleet: &[&str],
    heartbeat: Duration,
) -> (Vec<Admission>, Load) {
    let mut replicas = Vec::new();
    for name in fleet {
        let mut options = options(url.to_owned(), name, fleet, heartbeat);
        options.wait_replicas = 1;
        replicas.push(replica(options).await);
    }
    let load = Load::start(&replicas, &["amy", "bob"], CLIENT_ACTIVE, GLOBAL_ACTIVE);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        load.admitted() > 0,
        "nothing was admitted before the failover"
    );
    (replicas, load)
}

/// Every replica flushes what it holds, and the counts in Redis drain to zero.
pub async fn drain(replicas: &[Admission]) {
    for r in replicas {
        assert!(r.flush().await);
    }
    assert_eventually("the counts drained to zero", async || {
        replicas[0].counts().await.is_ok_and(|c| c.is_idle())
    })
    .await;
}

/// After a failover to the primary on port `new`: its script cache was empty (Redis does not
/// replicate it), so the scripts were loaded again on NOSCRIPT; every admission `seen`
/// answered, before the failover or after, still has its key record there (one lost would be
/// admitted again); refusals are remembered and forgotten on the notices it publishes; and
/// once flushed, every count drains to zero and the replicas shut down.
pub async fn assert_nothing_lost_and_all_drained(new: u16, seen: &Seen, replicas: Vec<Admission>) {
    assert!(errors(new, "NOSCRIPT") > 0, "no script was loaded again");
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{new}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let lost = missing(&mut conn, &seen.key_records("admission")).await;
    assert!(lost.is_empty(), "acknowledged and lost: {lost:?}");
    assert_notices_heard(&replicas, "amy", CLIENT_ACTIVE).await;
    drain(&replicas).await;
    for r in &replicas {
        assert!(r.snapshot().is_idle());
        r.shutdown().await;
    }
}
