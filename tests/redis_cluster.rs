//! Replicas on a Redis Cluster (SPEC 12), on real processes: three primaries with a replica
//! each, on loopback, reached with a `redis+cluster://` URL. Every script runs in the
//! deployment's one slot (a script touching a key of another slot is an error on a cluster),
//! and every key left behind is in it; a script sent twice, as the cluster client re-sends one
//! whose reply was lost, counts once; the slot moving to another primary is followed (`ASK`
//! while it moves, admissions pausing meanwhile, then `MOVED`); and the slot's primary killed
//! under load is followed to the replica the cluster promotes, within 2 s, exceeding no limit
//! and losing nothing acknowledged.

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Value;
use support::eventually::assert_eventually;
use support::failover::{
    CLIENT_ACTIVE, RESUME_WITHIN, assert_nothing_lost_and_all_drained, config, drain,
    fleet_under_load, options, replica,
};
use support::redis::cli;
use support::redis_ha::{Cluster, errors, try_cli, wait_until};
use unyolo_admission::admission::{
    Admission, AdmitError, KeyRecord, OperationHandle, RecoverySource, SourceFuture,
};
use unyolo_admission::{Controller, Identity, RefusalCode};

/// How long a primary may be unreachable before its replica takes over.
const NODE_TIMEOUT: Duration = Duration::from_millis(1000);
/// How often each replica heartbeats.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// The deployment's hash tag (the default prefix).
const TAG: &str = "{admission}";

/// The key records a replica's store would hold.
#[derive(Default)]
struct Keys(Mutex<Vec<KeyRecord>>);

impl Keys {
    fn records(&self) -> Vec<KeyRecord> {
        self.0.lock().unwrap().clone()
    }
}

impl RecoverySource for Keys {
    fn key_records(&self) -> SourceFuture<'_, Vec<KeyRecord>> {
        let keys = self.records();
        Box::pin(async move { Ok(keys) })
    }

    fn recent_admissions(&self, _: Duration) -> SourceFuture<'_, Vec<(Identity, Duration)>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

fn record(client: &str, key: &str, op: &OperationHandle) -> KeyRecord {
    KeyRecord {
        client: Identity::new(client).unwrap(),
        key: key.to_owned(),
        operation: op.id().to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_runs_in_the_deployments_one_slot_and_leaves_no_key_outside_it() {
    let Some(cluster) = Cluster::start(NODE_TIMEOUT) else {
        return;
    };
    let slot = cluster.keyslot(TAG);
    let fleet = ["c1", "c2"];
    let mut replicas = Vec::new();
    let mut stores = Vec::new();
    for name in fleet {
        let mut options = options(cluster.url(), name, &fleet, HEARTBEAT);
        options.idempotency_ttl = Some(Duration::from_secs(3600));
        let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
        let store = Arc::new(Keys::default());
        admission.set_recovery_source(Arc::clone(&store) as Arc<dyn RecoverySource>);
        assert!(admission.restore(Vec::new()).await.deferred.is_none());
        replicas.push(admission);
        stores.push(store);
    }
    let (c1, c2) = (&replicas[0], &replicas[1]);
    // The batch: admissions with keys, a whole lifecycle, a refusal (and its marker), a dropped
    // permit (its key freed).
    let done = c1.admit("amy", true, Some("k1")).await.unwrap().commit();
    stores[0].0.lock().unwrap().push(record("amy", "k1", &done));
    done.approve().await.unwrap();
    done.start().await.unwrap();
    done.succeed().await.unwrap();
    let mut live = Vec::new();
    for n in 0..CLIENT_ACTIVE {
        let key = format!("b{n}");
        let op = c2.admit("bob", false, Some(&key)).await.unwrap().commit();
        stores[1].0.lock().unwrap().push(record("bob", &key, &op));
        live.push(op);
    }
    match c1.admit("bob", false, None).await {
        Err(AdmitError::Refused(r)) => {
            assert_eq!(r.refusal.code, RefusalCode::ClientOperationLimit)
        }
        other => panic!("{other:?}"),
    }
    drop(c1.admit("amy", false, Some("dropped")).await.unwrap());
    // The key records' own scripts.
    let (retired, renewed) = (stores[0].records(), stores[1].records());
    assert_eq!(c2.renew_keys(&renewed).await.unwrap(), 4);
    c1.retire_keys(&retired).await.unwrap();
    // (Its rows deleted after.)
    stores[0].0.lock().unwrap().clear();
    // Reaping: a third replica holds one operation and stops; its lease lapses.
    let mut gone = options(cluster.url(), "c3", &[], HEARTBEAT);
    gone.lease_ttl = Duration::from_secs(1);
    gone.heartbeat = Duration::from_millis(300);
    let c3 = replica(gone).await;
    let held = c3.admit("amy", false, None).await.unwrap().commit();
    c3.shutdown().await;
    // Let go here with nothing sent: Redis holds it until the lease lapses.
    assert!(held.hand_over());
    drop(c3);
    assert_eventually("the stopped replica is reaped", async || {
        c1.reap().await.is_ok_and(|n| n == 1)
    })
    .await;
    // Redis forgets: the slot's primary is flushed. The replicas register again, the key
    // records going back first (restore_keys, then replace).
    let (_, owner) = cluster.owner(slot);
    cli(owner, &["FLUSHALL"]);
    assert_eventually("the replicas registered again", async || {
        c1.counts()
            .await
            .is_ok_and(|c| c.clients.get("bob") == Some(&(4, 0, 0)))
            && c2.admit("amy", false, None).await.is_ok_and(|p| {
                drop(p);
                true
            })
    })
    .await;
    match c2.admit("bob", false, Some("b0")).await {
        Err(AdmitError::Replay { replica, .. }) => assert_eq!(replica, "c2"),
        other => panic!("the key record did not come back: {other:?}"),
    }
    for op in live {
        op.fail().await.unwrap();
    }
    for r in &replicas {
        assert!(r.flush().await);
    }
    assert_eventually("the counts drained to zero", async || {
        c1.counts().await.is_ok_and(|c| c.is_idle())
    })
    .await;
    // Every key the deployment left, on whichever node, is in its one slot.
    let mut seen = 0;
    for node in &cluster.nodes {
        for key in cli(node.port, &["--scan"])
            .lines()
            .filter(|k| !k.is_empty())
        {
            seen += 1;
            assert_eq!(cluster.keyslot(key), slot, "{key} on :{}", node.port);
        }
    }
    assert!(
        seen > 0,
        "the deployment left keys (its epoch, buckets, key records)"
    );
    for r in &replicas {
        r.shutdown().await;
    }
}

/// One decision for the batch script, as the replica's writer sends it (see
/// `src/redis/scripts/batch.lua`): an admission of `id` for amy, or the release of `id`.
fn decision(admit: bool, id: &str) -> Vec<String> {
    let mut args: Vec<String> = [TAG, "r1", "token", "e1"].map(String::from).into();
    if admit {
        // The limits record, then the admission (no approval, key k-ID, no key lifetime).
        args.extend(
            [
                "L", "600000", "60000000", "4", "4", "10", "512", "6", "6", "3000", "A", id, "amy",
                "0",
            ]
            .map(String::from),
        );
        args.push(format!("{TAG}:key:amy:k-{id}"));
        args.push("0".into());
    } else {
        args.extend(["T", id, "t"].map(String::from));
        args.push(format!("{TAG}:key:amy:k-{id}"));
    }
    args
}

/// Runs one batch call through the cluster client; the first word of its answer.
async fn send(conn: &mut redis::cluster_async::ClusterConnection, args: &[String]) -> String {
    let script = redis::Script::new(unyolo_admission::redis::BATCH);
    let mut invocation = script.prepare_invoke();
    for key in ["counts", "ops", "lease:r1", "epoch", "recovery"] {
        invocation.key(format!("{TAG}:{key}"));
    }
    for arg in args {
        invocation.arg(arg);
    }
    match invocation.invoke_async::<Value>(conn).await.unwrap() {
        Value::Array(items) => match &items[0] {
            Value::BulkString(word) => String::from_utf8_lossy(word).into_owned(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_sent_again_after_a_lost_reply_counts_once() {
    let Some(cluster) = Cluster::start(NODE_TIMEOUT) else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(vec![format!(
        "redis://127.0.0.1:{}/",
        cluster.nodes[0].port
    )])
    .unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let _: () = redis::pipe()
        .set(format!("{TAG}:lease:r1"), "token")
        .set(format!("{TAG}:epoch"), "e1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let counts = async |conn: &mut redis::cluster_async::ClusterConnection| {
        let all: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("{TAG}:counts"))
            .query_async(conn)
            .await
            .unwrap();
        let ops: u64 = redis::cmd("HLEN")
            .arg(format!("{TAG}:ops"))
            .query_async(conn)
            .await
            .unwrap();
        (all.get("active").cloned(), all.get("a:amy").cloned(), ops)
    };
    // The admission, and the same call again (its reply lost, the client sends it once more):
    // the second finds the operation by its id and reserves nothing.
    let admit = decision(true, "op1");
    assert_eq!(send(&mut conn, &admit).await, "admitted");
    assert_eq!(send(&mut conn, &admit).await, "duplicate");
    let once = (Some("1".to_owned()), Some("1".to_owned()), 1);
    assert_eq!(counts(&mut conn).await, once);
    // Its key record names it once.
    let owner: Option<String> = redis::cmd("GET")
        .arg(format!("{TAG}:key:amy:k-op1"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(owner.is_some_and(|o| o.starts_with("op1 ")));
    // The release, twice: freed once.
    let release = decision(false, "op1");
    assert_eq!(send(&mut conn, &release).await, "moved");
    assert_eq!(send(&mut conn, &release).await, "absent");
    let (active, amy, ops) = counts(&mut conn).await;
    assert!(
        active.as_deref().unwrap_or("0") == "0" && amy.as_deref().unwrap_or("0") == "0" && ops == 0,
        "{active:?} {amy:?} {ops}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_moving_to_another_primary_pauses_admissions_while_it_moves_and_is_followed_after()
{
    let Some(cluster) = Cluster::start(NODE_TIMEOUT) else {
        return;
    };
    let slot = cluster.keyslot(TAG);
    let fleet = ["m1", "m2"];
    let mut replicas = Vec::new();
    for name in fleet {
        replicas.push(replica(options(cluster.url(), name, &fleet, HEARTBEAT)).await);
    }
    let mut live = Vec::new();
    for r in &replicas {
        live.push(
            r.admit("amy", false, Some(r.replica().unwrap()))
                .await
                .unwrap()
                .commit(),
        );
    }
    let (_, from) = cluster.owner(slot);
    let to = cluster
        .nodes
        .iter()
        .map(|n| n.port)
        .find(|&p| p != from && try_cli(p, &["ROLE"]).is_some_and(|r| r.starts_with("master")))
        .expect("another primary");
    let (asked, moved) = (errors(from, "ASK"), errors(from, "MOVED"));
    let migration = cluster.begin_migration(slot, to);
    // Mid-move every key of the slot is on the new primary: the old one answers ASK, and the
    // client asks the new one (with ASKING: without it, it would answer MOVED), which answers
    // the script TRYAGAIN (a key it names, the recovery marker, exists on neither side) until
    // the move ends. Admissions pause, unavailable, never admitted unchecked.
    match replicas[0].admit("bob", false, Some("mid-move")).await {
        Err(AdmitError::Unavailable(u)) => {
            assert!(u.to_string().contains("TryAgain"), "{u}")
        }
        other => panic!("admitted mid-move: {other:?}"),
    }
    assert!(errors(from, "ASK") > asked, "no ASK was answered");
    assert!(errors(to, "TRYAGAIN") > 0, "the ASK was not followed");
    migration.finish();
    // Moved: the old primary answers MOVED, once per client until it learns the new home.
    for r in &replicas {
        let key = format!("moved-{}", r.replica().unwrap());
        live.push(r.admit("bob", false, Some(&key)).await.unwrap().commit());
    }
    assert!(errors(from, "MOVED") > moved, "no MOVED was followed");
    assert_eq!(cluster.owner(slot).1, to);
    assert_eq!(
        try_cli(to, &["HGET", "{admission}:counts", "active"]).map(|o| o.trim().to_owned()),
        Some("4".to_owned())
    );
    match replicas[1].admit("amy", false, Some("m1")).await {
        Err(AdmitError::Replay { replica, .. }) => assert_eq!(replica, "m1"),
        other => panic!("{other:?}"),
    }
    let counts = replicas[0].counts().await.unwrap();
    assert_eq!(
        (counts.active, counts.clients["bob"].0),
        (4, 2),
        "{counts:?}"
    );
    for op in live {
        op.fail().await.unwrap();
    }
    drain(&replicas).await;
    for r in &replicas {
        r.shutdown().await;
    }
}

/// How the slot's primary is failed over.
#[derive(Clone, Copy, Debug)]
enum Failover {
    /// `kill -9`: its replica takes over once it has been unreachable for the node timeout.
    Kill,
    /// `CLUSTER FAILOVER` on its replica: the primary pauses its clients until the replica has
    /// caught up, then the two swap.
    Manual,
}

/// Three replicas under load with `wait_replicas = 1` while the slot's primary (with two
/// Redis replicas) is failed over: no limit exceeded, nothing acknowledged lost, admissions
/// resumed within 2 s of the promotion, counts back to zero.
async fn failover_under_load(failover: Failover) {
    let Some(mut cluster) = Cluster::start(NODE_TIMEOUT) else {
        return;
    };
    let slot = cluster.keyslot(TAG);
    let (owner_id, owner) = cluster.owner(slot);
    // A second replica in the slot's shard: the one not promoted follows the new primary, so
    // `WAIT 1` is answered after the failover too.
    let first_replica = cluster.replica_of(&owner_id);
    let second_replica = cluster.add_replica(&owner_id);
    let (replicas, load) = fleet_under_load(&cluster.url(), &["k1", "k2", "k3"], HEARTBEAT).await;

    let began = Instant::now();
    // From when no admission asked can be decided by the old primary: once it is gone (kill
    // returns then), or once the replica is promoted.
    let cut = match failover {
        Failover::Kill => {
            cluster.node(owner).kill();
            Some(Instant::now())
        }
        Failover::Manual => {
            let said = try_cli(first_replica, &["CLUSTER", "FAILOVER"]);
            assert_eq!(said.as_deref().map(str::trim), Some("OK"));
            None
        }
    };
    // The promotion: a replica of the shard says it is the primary.
    let promoted = tokio::task::spawn_blocking(move || {
        let mut promoted = None;
        assert!(
            wait_until(Duration::from_secs(60), || {
                promoted = [first_replica, second_replica].into_iter().find(|&port| {
                    try_cli(port, &["ROLE"]).is_some_and(|r| r.starts_with("master"))
                });
                promoted.is_some()
            }),
            "no replica was promoted"
        );
        (promoted.unwrap(), Instant::now())
    });
    let (new, promotion) = promoted.await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = load.stop().await;

    assert!(seen.over.is_empty(), "above a limit: {:?}", seen.over);
    let Some(first) = seen.first_after(cut.unwrap_or(promotion)) else {
        panic!(
            "admissions never resumed after the failover; last unavailable: {:#?}",
            seen.why_unavailable
        );
    };
    let resume = first.saturating_duration_since(promotion);
    println!(
        "cluster failover ({failover:?}): failover began -> replica promoted {:.3} s; promoted \
         -> first admission asked after it answered {:.3} s; longest pause in admissions {:.3} \
         s; {} admissions, {} unavailable answers",
        (promotion - began).as_secs_f64(),
        resume.as_secs_f64(),
        seen.longest_pause(began).as_secs_f64(),
        seen.admitted_at.len(),
        seen.unavailable
    );
    assert!(
        resume <= RESUME_WITHIN,
        "admissions resumed {:.3} s after the promotion; the contract is within {} s",
        resume.as_secs_f64(),
        RESUME_WITHIN.as_secs()
    );
    assert_nothing_lost_and_all_drained(new, &seen, replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slots_primary_killed_under_load_is_followed_to_its_promoted_replica_within_two_seconds_with_nothing_acknowledged_lost()
 {
    failover_under_load(Failover::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_cluster_failover_under_load_is_followed_within_two_seconds_with_nothing_acknowledged_lost()
 {
    failover_under_load(Failover::Manual).await;
}
