//! Replicas on a Redis watched by Sentinels (SPEC 12), on real processes: a primary, its Redis
//! replicas and three `redis-server --sentinel`s on loopback. A `redis+sentinel://` URL finds
//! the primary through the Sentinels; when it dies and they promote a replica, every admission
//! replica follows without a restart: under load with `wait_replicas = 1` no limit is exceeded
//! and no acknowledged admission is lost, admissions resume within 2 s of the promotion (the
//! Sentinels' `+switch-master`, heard here too), and the counts drain to zero; a promoted
//! replica that lacks the deployment's state is Redis forgetting, counted back exactly.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::eventually::assert_eventually;
use support::redis_ha::{SentinelSet, try_cli};
use unyolo_admission::admission::{Admission, AdmitError, OperationHandle, ReplicaOptions};
use unyolo_admission::config::Limits;
use unyolo_admission::{Config, Controller, Identity, RefusalCode};

/// How long a primary may be silent before the Sentinels fail it over.
const DOWN_AFTER: Duration = Duration::from_millis(1000);
/// The contract's pause: admissions resume within this of the promotion.
const RESUME_WITHIN: Duration = Duration::from_secs(2);

const CLIENT_ACTIVE: u32 = 4;
const GLOBAL_ACTIVE: u32 = 6;

/// amy and bob: four live each, six in all.
fn config() -> Config {
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

fn options(set: &SentinelSet, name: &str, fleet: &[&str]) -> ReplicaOptions {
    let mut options = ReplicaOptions::new(set.url(), name);
    options.replicas = fleet.iter().map(|r| r.to_string()).collect();
    options.heartbeat = Duration::from_secs(2);
    options
}

async fn replica(options: ReplicaOptions) -> Admission {
    let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
    let restored = admission.restore(Vec::new()).await;
    assert!(restored.deferred.is_none(), "{:?}", restored.deferred);
    admission
}

/// When the Sentinel on `port` announces a `+switch-master`, from now on.
async fn heard_switch(port: u16) -> Arc<Mutex<Option<Instant>>> {
    let heard = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&heard);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe("+switch-master").await.unwrap();
    tokio::spawn(async move {
        let mut stream = pubsub.on_message();
        let next = std::future::poll_fn(|cx| {
            futures_core::Stream::poll_next(std::pin::Pin::new(&mut stream), cx)
        });
        if next.await.is_some() {
            *slot.lock().unwrap() = Some(Instant::now());
        }
    });
    heard
}

async fn switched(heard: &Mutex<Option<Instant>>) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(at) = *heard.lock().unwrap() {
            return at;
        }
        assert!(Instant::now() < deadline, "the sentinels never failed over");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_finds_the_primary_and_a_replica_admits_through_it() {
    let Some(set) = SentinelSet::start(1, DOWN_AFTER) else {
        return;
    };
    let r1 = replica(options(&set, "r1", &["r1"])).await;
    let op = r1.admit("amy", true, Some("k1")).await.unwrap().commit();
    // Written on the primary the Sentinels name (and not on its replica: they are read-only).
    let primary = set.primary_port();
    assert_eq!(primary, set.servers[0].port);
    assert_eq!(
        try_cli(primary, &["EXISTS", "{admission}:key:amy:k1"]).map(|o| o.trim().to_owned()),
        Some("1".to_owned())
    );
    assert_eq!(r1.counts().await.unwrap().clients["amy"], (1, 1, 0));
    op.fail().await.unwrap();
    assert!(r1.flush().await);
    assert!(r1.counts().await.unwrap().is_idle());
    r1.shutdown().await;
}

/// What the load saw: how many of each client's admissions it held at most, every admission's
/// moment, and each (client, key) acknowledged.
#[derive(Default)]
struct Seen {
    live: BTreeMap<&'static str, u32>,
    over: Vec<String>,
    admitted_at: Vec<Instant>,
    acknowledged: Vec<(&'static str, String)>,
}

impl Seen {
    /// An admission was answered: counted before anything is done with it, so what is counted
    /// here is never more than Redis holds (a release is uncounted before it is sent).
    fn admitted(&mut self, client: &'static str, key: String) {
        *self.live.entry(client).or_default() += 1;
        let total: u32 = self.live.values().sum();
        if self.live[client] > CLIENT_ACTIVE || total > GLOBAL_ACTIVE {
            self.over
                .push(format!("{:?} at {:?}", self.live, Instant::now()));
        }
        self.admitted_at.push(Instant::now());
        self.acknowledged.push((client, key));
    }

    fn released(&mut self, client: &'static str) {
        *self.live.get_mut(client).expect("admitted before") -= 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_is_followed_to_the_promoted_replica_within_two_seconds_with_nothing_acknowledged_lost()
 {
    // Two Redis replicas: the one not promoted follows the new primary, so `WAIT 1` is
    // answered after the failover too.
    let Some(mut set) = SentinelSet::start(2, DOWN_AFTER) else {
        return;
    };
    let fleet = ["s1", "s2", "s3"];
    let mut replicas = Vec::new();
    for name in fleet {
        let mut options = options(&set, name, &fleet);
        options.wait_replicas = 1;
        replicas.push(replica(options).await);
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let unavailable = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..9usize {
        let admission = replicas[worker % 3].clone();
        let (seen, stop, unavailable) = (
            Arc::clone(&seen),
            Arc::clone(&stop),
            Arc::clone(&unavailable),
        );
        workers.push(tokio::spawn(async move {
            let mut round = 0usize;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let client = ["amy", "bob"][(worker + round) % 2];
                let key = format!("w{worker}-{round}");
                match admission.admit(client, false, Some(&key)).await {
                    Ok(permit) => {
                        let op: OperationHandle = permit.commit();
                        seen.lock().unwrap().admitted(client, key);
                        tokio::time::sleep(Duration::from_millis(5 + (round % 4) as u64 * 5)).await;
                        seen.lock().unwrap().released(client);
                        op.fail().await.unwrap();
                    }
                    Err(AdmitError::Refused(_)) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(AdmitError::Unavailable(_)) => {
                        unavailable.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(other) => panic!("{other:?}"),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = seen.lock().unwrap().admitted_at.len();
    assert!(before > 0, "nothing was admitted before the failover");

    let heard = heard_switch(set.sentinels[0].port).await;
    let old = set.primary_port();
    let killed = Instant::now();
    set.server(old).kill();
    let switch = switched(&heard).await;
    // The load goes on through the promotion and for a while after it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    let new = set.primary_port();
    assert_ne!(new, old, "the sentinels named a new primary");

    let seen = Arc::try_unwrap(seen).ok().unwrap().into_inner().unwrap();
    assert!(seen.over.is_empty(), "above a limit: {:?}", seen.over);
    let first = seen
        .admitted_at
        .iter()
        .copied()
        .find(|at| *at > killed)
        .expect("admissions resumed after the failover");
    let resume = first.saturating_duration_since(switch);
    println!(
        "sentinel failover: primary killed -> +switch-master {:.3} s; +switch-master -> first \
         admission {:.3} s; killed -> first admission {:.3} s; {} admissions, {} unavailable \
         answers",
        (switch - killed).as_secs_f64(),
        resume.as_secs_f64(),
        (first - killed).as_secs_f64(),
        seen.admitted_at.len(),
        unavailable.load(Ordering::Relaxed)
    );
    assert!(
        resume <= RESUME_WITHIN,
        "admissions resumed {:.3} s after the promotion (+switch-master); the contract is within \
         {} s",
        resume.as_secs_f64(),
        RESUME_WITHIN.as_secs()
    );
    assert!(
        seen.admitted_at.iter().filter(|at| **at > first).count() > 0,
        "admissions went on after the first"
    );

    // Nothing acknowledged is lost: every admission answered, before the failover or after,
    // still has its key record on the new primary (one lost would be admitted again).
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{new}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let names: Vec<String> = seen
        .acknowledged
        .iter()
        .map(|(client, key)| format!("{{admission}}:key:{client}:{key}"))
        .collect();
    for chunk in names.chunks(500) {
        let owners: Vec<Option<String>> = redis::cmd("MGET")
            .arg(chunk)
            .query_async(&mut conn)
            .await
            .unwrap();
        let lost: Vec<&String> = chunk
            .iter()
            .zip(&owners)
            .filter(|(_, owner)| owner.is_none())
            .map(|(name, _)| name)
            .collect();
        assert!(lost.is_empty(), "acknowledged and lost: {lost:?}");
    }

    for r in &replicas {
        assert!(r.flush().await);
    }
    assert_eventually("the counts drained to zero", async || {
        replicas[0].counts().await.is_ok_and(|c| c.is_idle())
    })
    .await;
    for r in &replicas {
        assert!(r.snapshot().is_idle());
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_without_the_deployments_state_is_redis_forgetting_and_every_count_comes_back()
 {
    let Some(mut set) = SentinelSet::start(1, DOWN_AFTER) else {
        return;
    };
    let fleet = ["f1", "f2", "f3"];
    let mut replicas = Vec::new();
    for name in fleet {
        replicas.push(replica(options(&set, name, &fleet)).await);
    }
    // amy at her limit, spread over the three; bob with one.
    let mut live = Vec::new();
    for (n, r) in replicas.iter().enumerate() {
        let per = if n == 0 { 2 } else { 1 };
        for _ in 0..per {
            live.push(r.admit("amy", false, None).await.unwrap().commit());
        }
    }
    live.push(
        replicas[2]
            .admit("bob", false, None)
            .await
            .unwrap()
            .commit(),
    );
    assert_eq!(replicas[0].counts().await.unwrap().clients["amy"].0, 4);
    // The Redis replica loses everything it held and never gets it back: what Sentinel is about
    // to promote lacks the deployment's state.
    let standby = set.servers[1].port;
    try_cli(standby, &["CONFIG", "SET", "replica-read-only", "no"]).unwrap();
    try_cli(standby, &["FLUSHALL"]).unwrap();
    try_cli(standby, &["CONFIG", "SET", "replica-read-only", "yes"]).unwrap();
    assert_eq!(
        try_cli(standby, &["EXISTS", "{admission}:epoch"]).map(|o| o.trim().to_owned()),
        Some("0".to_owned())
    );

    let old = set.primary_port();
    let epoch = try_cli(old, &["GET", "{admission}:epoch"]).unwrap();
    let heard = heard_switch(set.sentinels[0].port).await;
    set.server(old).kill();
    let switch = switched(&heard).await;
    // Each replica notices, registers again, and the recovery window closes once all three
    // have: bob (room left) is admitted again, amy is not (her four are counted again).
    let mut resumed = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while resumed.is_none() {
        assert!(Instant::now() < deadline, "admissions never resumed");
        match replicas[1].admit("bob", false, None).await {
            Ok(permit) => {
                resumed = Some(Instant::now());
                live.push(permit.commit());
            }
            Err(AdmitError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(other) => panic!("{other:?}"),
        }
    }
    let resumed = resumed.unwrap();
    println!(
        "sentinel failover to a replica without the state: +switch-master -> first admission \
         {:.3} s (every replica registered again)",
        resumed.saturating_duration_since(switch).as_secs_f64()
    );
    // A new epoch: the deployment was registered afresh on the promoted primary.
    let now = try_cli(set.primary_port(), &["GET", "{admission}:epoch"]).unwrap();
    assert!(
        !now.trim().is_empty() && now != epoch,
        "{epoch:?} then {now:?}"
    );
    let counts = replicas[0].counts().await.unwrap();
    assert_eq!(counts.clients["amy"], (4, 0, 0), "{counts:?}");
    assert_eq!(counts.clients["bob"], (2, 0, 0), "{counts:?}");
    match replicas[2].admit("amy", false, None).await {
        Err(AdmitError::Refused(refused)) => {
            assert_eq!(refused.refusal.code, RefusalCode::ClientOperationLimit)
        }
        other => panic!("amy admitted above her limit: {other:?}"),
    }
    for op in live {
        op.fail().await.unwrap();
    }
    for r in &replicas {
        assert!(r.flush().await);
    }
    assert_eventually("the counts drained to zero", async || {
        replicas[0].counts().await.is_ok_and(|c| c.is_idle())
    })
    .await;
    for r in &replicas {
        r.shutdown().await;
    }
}
