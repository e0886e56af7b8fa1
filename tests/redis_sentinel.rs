//! Replicas on a Redis watched by Sentinels (SPEC 12), on real processes: a primary, its Redis
//! replicas and three `redis-server --sentinel`s on loopback. A `redis+sentinel://` URL finds
//! the primary through the Sentinels; when it dies and they promote a replica, every admission
//! replica follows without a restart: under load with `wait_replicas = 1` no limit is exceeded
//! and no acknowledged admission is lost, admissions resume within 2 s of the promotion (the
//! Sentinels' `+switch-master`, heard here too), and the counts drain to zero; a promoted
//! replica that lacks the deployment's state is Redis forgetting, counted back exactly.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::failover::{
    RESUME_WITHIN, assert_nothing_lost_and_all_drained, config, drain, fleet_under_load, options,
    replica,
};
use support::redis_ha::{SentinelSet, try_cli};
use unyolo_admission::admission::{Admission, AdmitError, ReplicaOptions};
use unyolo_admission::{Controller, RefusalCode};

/// How long a primary may be silent before the Sentinels fail it over.
const DOWN_AFTER: Duration = Duration::from_millis(1000);
/// How often each replica heartbeats.
const HEARTBEAT: Duration = Duration::from_secs(2);

/// When the first of the Sentinels on `ports` announces a `+switch-master`, from now on.
async fn heard_switch(ports: &[u16]) -> Arc<Mutex<Option<Instant>>> {
    let heard = Arc::new(Mutex::new(None));
    for &port in ports {
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
                slot.lock().unwrap().get_or_insert_with(Instant::now);
            }
        });
    }
    heard
}

/// `later - earlier` in seconds, negative when `later` came first.
fn seconds(later: Instant, earlier: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => d.as_secs_f64(),
        None => -(earlier - later).as_secs_f64(),
    }
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
    let r1 = replica(options(set.url(), "r1", &["r1"], HEARTBEAT)).await;
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

/// How the primary is failed over.
#[derive(Clone, Copy, Debug)]
enum Failover {
    /// `kill -9`: the Sentinels notice it is gone and promote a replica.
    Kill,
    /// `SENTINEL FAILOVER`: a replica promoted, the old primary demoted alive.
    Manual,
}

/// Three replicas under load with `wait_replicas = 1` while the primary (with `redis_replicas`
/// Redis replicas) is failed over: no limit exceeded, nothing acknowledged lost, admissions
/// resumed within 2 s of the promotion (`+switch-master`), counts back to zero.
async fn failover_under_load(redis_replicas: usize, failover: Failover) {
    let Some(mut set) = SentinelSet::start(redis_replicas, DOWN_AFTER) else {
        return;
    };
    let (replicas, load) = fleet_under_load(&set.url(), &["s1", "s2", "s3"], HEARTBEAT).await;

    let heard = heard_switch(&set.sentinels.iter().map(|s| s.port).collect::<Vec<_>>()).await;
    let old = set.primary_port();
    let began = Instant::now();
    // From when no admission asked can be decided by the old primary: once it is gone (kill
    // returns then), or once the Sentinels switched (before, a manual failover's old primary
    // still admits).
    let cut = match failover {
        Failover::Kill => {
            set.server(old).kill();
            Some(Instant::now())
        }
        Failover::Manual => {
            let said = try_cli(
                set.sentinels[0].port,
                &["SENTINEL", "FAILOVER", &set.service],
            );
            assert_eq!(said.as_deref().map(str::trim), Some("OK"));
            None
        }
    };
    let switch = switched(&heard).await;
    // The load goes on through the promotion and for a while after it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = load.stop().await;
    let new = set.primary_port();
    assert_ne!(new, old, "the sentinels named a new primary");

    assert!(seen.over.is_empty(), "above a limit: {:?}", seen.over);
    let Some(first) = seen.first_after(cut.unwrap_or(switch)) else {
        let roles: Vec<String> = set
            .servers
            .iter()
            .map(|s| {
                let info = try_cli(s.port, &["INFO", "replication"]).unwrap_or_default()
                    + &try_cli(s.port, &["INFO", "clients"]).unwrap_or_default()
                    + &try_cli(s.port, &["INFO", "stats"]).unwrap_or_default();
                let line = |k: &str| {
                    info.lines()
                        .find(|l| l.starts_with(k))
                        .unwrap_or("")
                        .trim()
                        .to_owned()
                };
                format!(
                    ":{} {} {} {} {} {} {}",
                    s.port,
                    line("role:"),
                    line("connected_slaves:"),
                    line("master_port:"),
                    line("connected_clients:"),
                    line("total_commands_processed:"),
                    line("slave0:")
                )
            })
            .collect();
        panic!(
            "admissions never resumed after the failover to :{new}; Redis: {roles:?}; last \
             unavailable: {:#?}",
            seen.why_unavailable
        );
    };
    let resume = first.saturating_duration_since(switch);
    // (Negative when a replica followed the new primary before the first announcement reached
    // this test: the Sentinels name it as soon as they have switched.)
    println!(
        "sentinel failover ({failover:?}): failover began -> +switch-master {:.3} s; \
         +switch-master -> first admission {:.3} s; longest pause in admissions {:.3} s; {} \
         admissions, {} unavailable answers",
        seconds(switch, began),
        seconds(first, switch),
        seen.longest_pause(began).as_secs_f64(),
        seen.admitted_at.len(),
        seen.unavailable
    );
    assert!(
        resume <= RESUME_WITHIN,
        "admissions resumed {:.3} s after the promotion (+switch-master); the contract is within \
         {} s",
        resume.as_secs_f64(),
        RESUME_WITHIN.as_secs()
    );
    assert!(
        seen.admitted_at.iter().any(|(_, at)| *at > first),
        "admissions went on after the first"
    );

    assert_nothing_lost_and_all_drained(new, &seen, replicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_is_followed_to_the_promoted_replica_within_two_seconds_with_nothing_acknowledged_lost()
 {
    // Two Redis replicas: the one not promoted follows the new primary, so `WAIT 1` is
    // answered after the failover too.
    failover_under_load(2, Failover::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_sentinel_failover_under_load_moves_every_replica_off_the_demoted_primary_within_two_seconds()
 {
    // Two Redis replicas, as for a kill: the Sentinels point the other one at the new primary
    // during the failover, while the demoted one is turned into a replica only later (its
    // next INFO, seconds on), and `WAIT 1` needs one now.
    failover_under_load(2, Failover::Manual).await;
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
        replicas.push(replica(options(set.url(), name, &fleet, HEARTBEAT)).await);
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
    let heard = heard_switch(&set.sentinels.iter().map(|s| s.port).collect::<Vec<_>>()).await;
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
        seconds(resumed, switch)
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
    drain(&replicas).await;
    for r in &replicas {
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_any_url_form_is_in_no_error_debug_output_or_metric() {
    use prometheus_client::registry::Registry;
    use support::redis::free_port;
    // Nothing answers on these ports: every attempt fails, and says why.
    let (a, b) = (free_port(), free_port());
    for url in [
        format!("redis://:hunter2@127.0.0.1:{a}/0"),
        format!("redis://ops:hunter2@127.0.0.1:{a}"),
        format!("redis+sentinel://:hunter2@127.0.0.1:{a},127.0.0.1:{b}/hot/1"),
        format!("redis+sentinel://ops:hunter2@127.0.0.1:{a}/hot"),
        format!("redis+cluster://:hunter2@127.0.0.1:{a},127.0.0.1:{b}"),
    ] {
        let mut options = ReplicaOptions::new(url.clone(), "p1");
        options.call_timeout = Duration::from_millis(200);
        assert!(!format!("{options:?}").contains("hunter2"), "{url}");
        assert!(!options.url_redacted().contains("hunter2"), "{url}");
        let admission = Admission::new(Controller::new(config()), Some(options)).unwrap();
        let restored = admission.restore(Vec::new()).await;
        let deferred = restored.deferred.expect("nothing answers");
        let mut said = vec![deferred.to_string(), format!("{deferred:?}")];
        assert!(
            deferred.to_string().contains("refused"),
            "{url}: says why: {deferred}"
        );
        let refused = admission.admit("amy", false, None).await.unwrap_err();
        said.extend([refused.to_string(), format!("{refused:?}")]);
        let mut registry = Registry::default();
        admission.register_metrics(&mut registry);
        let mut metrics = String::new();
        prometheus_client::encoding::text::encode(&mut metrics, &registry).unwrap();
        said.push(metrics);
        for text in said {
            assert!(!text.contains("hunter2"), "{url}: {text}");
        }
        admission.shutdown().await;
    }
    // A malformed URL stops the replica at setup, redacted.
    let bad = ReplicaOptions::new("redis+sentinel://:hunter2@127.0.0.1:x/hot", "p1");
    let err = Admission::new(Controller::new(config()), Some(bad)).unwrap_err();
    assert!(err.to_string().contains("bad port"), "{err}");
    assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
}
