//! What the library's replica tests (`redis_backend*.rs`) share: quota files of every size they
//! need, the options of a replica of a test's deployment, and replicas registered and ready.

use std::collections::BTreeMap;
use std::time::Duration;

use super::redis as redis_support;
use unyolo_admission::admission::{Admission, DeploymentCounts, OperationHandle, ReplicaOptions};
use unyolo_admission::config::{ClientLimits, Limits};
use unyolo_admission::{Config, Controller, Identity};

/// The identities named `names`.
pub fn ids(names: &[&str]) -> Vec<Identity> {
    names.iter().map(|n| Identity::new(n).unwrap()).collect()
}

/// Small limits so every refusal code comes up: 12 tokens an hour, 3 active, 2 pending per
/// client; 6 active, 2 executing globally; `eve` has her own, tighter limits.
pub fn small_config() -> Config {
    let limits = Limits {
        requests_per_window: 12,
        window_seconds: 3600,
        client_active: 3,
        client_pending: 2,
        global_active: 6,
        global_executing: 2,
    };
    let mut overrides = BTreeMap::new();
    overrides.insert(
        Identity::new("eve").unwrap(),
        ClientLimits {
            requests_per_window: 2,
            window_seconds: 3600,
            active: 2,
            pending: 1,
        },
    );
    Config::new(limits, overrides, ids(&["amy", "bob", "eve"])).unwrap()
}

/// Room for every test: 5 active and 3 pending per client, 12 and 4 globally.
pub fn roomy_config(clients: &[&str]) -> Config {
    let limits = Limits {
        requests_per_window: 100_000,
        window_seconds: 1,
        client_active: 5,
        client_pending: 3,
        global_active: 12,
        global_executing: 4,
    };
    Config::new(limits, BTreeMap::new(), ids(clients)).unwrap()
}

/// Options for `replica`, one of `fleet` (every replica of the test's deployment, itself
/// included): knowing the whole fleet, the replicas admit as soon as all of it has registered
/// at the deployment's first start, not one lease period later.
pub fn options(
    server: &redis_support::RedisServer,
    replica: &str,
    fleet: &[&str],
) -> ReplicaOptions {
    let mut options = ReplicaOptions::new(server.url(), replica);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.call_timeout = Duration::from_millis(300);
    options.lease_ttl = Duration::from_secs(30);
    options.heartbeat = Duration::from_secs(5);
    options.circuit_cool_down = Duration::from_millis(200);
    options
}

/// A replica on `controller`, registered (its lease taken) with nothing restored.
pub async fn replica_on(controller: Controller, options: ReplicaOptions) -> Admission {
    let admission = Admission::new(controller, Some(options)).expect("valid replica options");
    let restored = admission.restore(Vec::new()).await;
    assert!(restored.deferred.is_none(), "the replica registers");
    admission
}

/// A replica whose own engine is a plain controller for `config` (on real time, as a broker's).
pub async fn replica(config: Config, options: ReplicaOptions) -> Admission {
    replica_on(Controller::new(config), options).await
}

/// Admits and commits, failing the test on anything but an admission.
pub async fn admit_op(
    admission: &Admission,
    client: &str,
    needs_approval: bool,
) -> OperationHandle {
    match admission.admit(client, needs_approval, None).await {
        Ok(permit) => permit.commit(),
        Err(other) => panic!("{client} not admitted: {other}"),
    }
}

/// The deployment's global counts: active, pending, executing.
pub fn global(counts: &DeploymentCounts) -> (u64, u64, u64) {
    (counts.active, counts.pending, counts.executing)
}
