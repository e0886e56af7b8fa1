//! Criterion benchmarks of the admission engine, each group measured side by side with its
//! baseline in the same run (see BENCHMARKS.md for the figures and ratios).
//!
//! The engine runs on a clock that reads `quanta` like production but runs 100× fast, and the
//! clients may make 1,000,000 requests per second (100 million a second of real time), so the rate
//! limit does not bind while we time the rest of the cycle; the clock read costs the same. A thread
//! preempted for over 10 ms between its clock read and its token CAS sees a stale `now` and can be
//! refused; such refusals are retried and counted (printed when any happened).

#[path = "support/mutex_baseline.rs"]
mod mutex_baseline;

use std::collections::BTreeMap;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use mutex_baseline::{BaselineLimits, MutexAdmission};
use unyolo_admission::admission::{Shadow, ShadowVerdict};
use unyolo_admission::config::{ClientLimits, Config, Identity, Limits};
use unyolo_admission::fuzzing::RateCheck;
use unyolo_admission::{
    Admission, AdmitError, Clock, Controller, FairShare, Operation, PoolShare, RefusalCode,
};

/// Production's clock source, read the same way, running 100× fast.
struct FastQuanta {
    clock: quanta::Clock,
    origin: quanta::Instant,
}

impl Clock for FastQuanta {
    fn now_nanos(&self) -> u64 {
        let real = self.clock.now().saturating_duration_since(self.origin);
        (real.as_nanos() as u64).saturating_mul(100)
    }
}

fn fast_clock() -> FastQuanta {
    let clock = quanta::Clock::new();
    let origin = clock.now();
    FastQuanta { clock, origin }
}

const CLIENTS: [&str; 4] = ["bot-0", "bot-1", "bot-2", "bot-3"];

/// Generous limits: nothing binds, so every cycle does the full work of an admission.
fn roomy_limits() -> Limits {
    Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active: 1_000,
        client_pending: 1_000,
        global_active: 1_000_000,
        global_executing: 1_000_000,
    }
}

fn roomy_config() -> Config {
    let ids = CLIENTS.map(|c| Identity::new(c).expect("valid"));
    Config::new(roomy_limits(), BTreeMap::new(), ids).expect("valid config")
}

fn controller() -> Controller {
    Controller::builder(roomy_config())
        .clock(fast_clock())
        .build()
}

fn baseline() -> MutexAdmission {
    MutexAdmission::new(
        &CLIENTS,
        BaselineLimits {
            requests_per_window: 1_000_000_000,
            window_nanos: 1_000_000_000,
            client_active: 1_000,
            global_active: 1_000_000,
            global_executing: 1_000_000,
        },
    )
}

/// `bot-0` may make one request a day: once it is spent, every admission is a rate refusal.
fn one_a_day() -> Config {
    let id = Identity::new("bot-0").expect("valid");
    let mut overrides = BTreeMap::new();
    overrides.insert(
        id.clone(),
        ClientLimits {
            requests_per_window: 1,
            window_seconds: 86_400,
            active: 10,
            pending: 10,
        },
    );
    Config::new(roomy_limits(), overrides, [id]).expect("valid")
}

/// Reloads done, and nanoseconds of admissions timed while they ran (group 5), to report the
/// reload rate behind each figure.
static RELOADS: AtomicU64 = AtomicU64::new(0);
static RELOAD_NANOS: AtomicU64 = AtomicU64::new(0);

/// Rate refusals retried in [`cycle`] (see the module docs).
static STALE_CLOCK_RETRIES: AtomicU64 = AtomicU64::new(0);

/// admit → commit → start → succeed, for work that needs no approval.
#[inline]
fn cycle(c: &Controller, client: &str) {
    let permit = loop {
        match c.admit(client, false) {
            Ok(permit) => break permit,
            Err(r) if r.code == RefusalCode::SubmissionRateLimited => {
                STALE_CLOCK_RETRIES.fetch_add(1, Ordering::Relaxed);
            }
            Err(r) => panic!("refused: {r:?}"),
        }
    };
    let op = permit.commit();
    op.try_start().expect("started");
    op.succeed().expect("succeeded");
}

#[inline]
fn baseline_cycle(b: &MutexAdmission, client: &str) {
    let op = b.admit(client).expect("admitted");
    b.commit(&op);
    assert!(b.start(&op));
    b.finish(op);
}

/// Runs `iters` calls of `work(thread)` split across `threads` threads; the wall time from the
/// moment all of them are ready until the last finishes. Thread `t` is pinned to core `t`, so the
/// scheduler cannot stack two busy threads on one core (which made two-thread figures bimodal on
/// this 2-core VM); every side of every comparison runs under the same rule.
fn threaded<F: Fn(usize) + Sync>(iters: u64, threads: usize, work: F) -> Duration {
    let per = iters / threads as u64;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let ready = std::sync::Barrier::new(threads + 1);
    let go = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (work, ready, go, core) = (
                    &work,
                    &ready,
                    &go,
                    cores.get(t % cores.len().max(1)).copied(),
                );
                s.spawn(move || {
                    if let Some(core) = core {
                        core_affinity::set_for_current(core);
                    }
                    ready.wait();
                    go.wait();
                    for _ in 0..per {
                        work(t);
                    }
                })
            })
            .collect();
        ready.wait();
        let start = Instant::now();
        go.wait();
        for h in handles {
            h.join().expect("bench thread");
        }
        start.elapsed()
    })
}

/// 1. The full cycle on one thread, and the refusal path alone.
fn full_cycle(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("1_full_cycle");
    let c = controller();
    g.bench_function("admit_commit_start_succeed", |b| {
        b.iter(|| cycle(&c, black_box("bot-0")))
    });
    // A client with one request a day, spent: every admission is a rate refusal.
    let config = one_a_day();
    let refusing = Controller::builder(config).clock(fast_clock()).build();
    drop(refusing.admit("bot-0", false).expect("the one token"));
    g.bench_function("refusal_rate_limited", |b| {
        b.iter(|| {
            refusing
                .admit(black_box("bot-0"), false)
                .expect_err("refused")
        })
    });
    g.bench_function("refusal_unconfigured", |b| {
        b.iter(|| {
            refusing
                .admit(black_box("stranger"), false)
                .expect_err("refused")
        })
    });
    g.finish();
}

/// 6. A flood of refusals from one client (its rate spent), on one and two threads, beside
///    governor's keyed check refusing the same single spent key: what admission costs under the
///    very overload it exists for.
fn refusal_flood(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("6_refusal_flood");
    let config = one_a_day();
    let refusing = Controller::builder(config).clock(fast_clock()).build();
    drop(refusing.admit("bot-0", false).expect("the one token"));
    let refuse = |_| {
        let refused = refusing.admit(black_box("bot-0"), false);
        assert!(refused.is_err());
    };
    let governor = RateLimiter::dashmap(Quota::per_hour(NonZeroU32::new(1).expect("non-zero")));
    assert!(governor.check_key(&"bot-0").is_ok());
    let governor_refuse = |_| assert!(governor.check_key(black_box(&"bot-0")).is_err());
    g.bench_function("ours_1_thread", |b| {
        b.iter_custom(|iters| threaded(iters, 1, refuse))
    });
    g.bench_function("ours_2_threads", |b| {
        b.iter_custom(|iters| threaded(iters, 2, refuse))
    });
    g.bench_function("governor_1_thread", |b| {
        b.iter_custom(|iters| threaded(iters, 1, governor_refuse))
    });
    g.bench_function("governor_2_threads", |b| {
        b.iter_custom(|iters| threaded(iters, 2, governor_refuse))
    });
    g.finish();
}

/// 2. The rate check alone against governor's keyed limiter, same 1,000 keys and quota.
fn rate_check(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("2_rate_check_1000_keys");
    let keys: Vec<String> = (0..1_000).map(|i| format!("client-{i}")).collect();
    let ours = RateCheck::new(
        keys.iter().map(|k| Identity::new(k).expect("valid")),
        1_000_000,
        1,
    );
    let governor = RateLimiter::dashmap(Quota::per_second(
        NonZeroU32::new(1_000_000).expect("non-zero"),
    ));
    for k in &keys {
        // Create each key's state up front, as ours is created from configuration.
        let _ = governor.check_key(k);
    }
    let mut i = 0;
    g.bench_function("ours", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            assert!(ours.check(black_box(&keys[i])));
        })
    });
    let mut i = 0;
    g.bench_function("governor_dashmap", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            assert!(governor.check_key(black_box(&keys[i])).is_ok());
        })
    });
    g.finish();
}

/// 3. The full cycle against the mutex baseline, one and two threads (distinct clients).
fn versus_mutex(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("3_full_cycle_vs_mutex");
    let c = controller();
    let m = baseline();
    g.bench_function("ours_1_thread", |b| {
        b.iter_custom(|iters| threaded(iters, 1, |t| cycle(&c, CLIENTS[t])))
    });
    g.bench_function("mutex_1_thread", |b| {
        b.iter_custom(|iters| threaded(iters, 1, |t| baseline_cycle(&m, CLIENTS[t])))
    });
    g.bench_function("ours_2_threads", |b| {
        b.iter_custom(|iters| threaded(iters, 2, |t| cycle(&c, CLIENTS[t])))
    });
    g.bench_function("mutex_2_threads", |b| {
        b.iter_custom(|iters| threaded(iters, 2, |t| baseline_cycle(&m, CLIENTS[t])))
    });
    g.finish();
}

/// 4. Scaling: two threads on distinct clients vs one thread; two threads on one client.
fn scaling(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("4_scaling");
    let c = controller();
    g.bench_function("1_thread", |b| {
        b.iter_custom(|iters| threaded(iters, 1, |t| cycle(&c, CLIENTS[t])))
    });
    g.bench_function("2_threads_distinct_clients", |b| {
        b.iter_custom(|iters| threaded(iters, 2, |t| cycle(&c, CLIENTS[t])))
    });
    g.bench_function("2_threads_same_client", |b| {
        b.iter_custom(|iters| threaded(iters, 2, |_| cycle(&c, CLIENTS[0])))
    });
    g.finish();
}

/// 5. Admission throughput (full cycle, one thread) while another thread reloads the config.
fn under_reload(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("5_reload");
    let c = controller();
    // Each reload swaps in a configuration that really differs (global and per-client active
    // limits), alternating, so none is skipped as unchanged.
    let configs = [roomy_config(), {
        let ids = CLIENTS.map(|c| Identity::new(c).expect("valid"));
        let limits = Limits {
            client_active: 999,
            client_pending: 999,
            global_active: 999_999,
            global_executing: 999_999,
            ..roomy_limits()
        };
        Config::new(limits, BTreeMap::new(), ids).expect("valid config")
    }];
    g.bench_function("without_reloads", |b| {
        b.iter_custom(|iters| threaded(iters, 1, |_| cycle(&c, CLIENTS[0])))
    });
    for (name, pause) in [
        ("reloading_in_a_tight_loop", None),
        ("reloading_every_1ms", Some(Duration::from_millis(1))),
    ] {
        RELOADS.store(0, Ordering::Relaxed);
        RELOAD_NANOS.store(0, Ordering::Relaxed);
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let stop = AtomicBool::new(false);
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let mut i = 0;
                        while !stop.load(Ordering::Relaxed) {
                            c.reload(configs[i % 2].clone());
                            i += 1;
                            RELOADS.fetch_add(1, Ordering::Relaxed);
                            if let Some(p) = pause {
                                std::thread::sleep(p);
                            }
                        }
                    });
                    let elapsed = threaded(iters, 1, |_| cycle(&c, CLIENTS[0]));
                    stop.store(true, Ordering::Relaxed);
                    RELOAD_NANOS.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
                    elapsed
                })
            })
        });
        let seconds = RELOAD_NANOS.load(Ordering::Relaxed) as f64 / 1e9;
        if seconds > 0.0 {
            println!(
                "{name}: {:.0} reloads per second while admitting",
                RELOADS.load(Ordering::Relaxed) as f64 / seconds
            );
        }
    }
    g.finish();
    let retries = STALE_CLOCK_RETRIES.load(Ordering::Relaxed);
    if retries > 0 {
        println!("rate refusals retried after a stale clock read: {retries}");
    }
}

/// The value of `future` at its first poll: the in-process [`Admission`] needs no executor, every
/// call is ready at once (it panics otherwise, so the bench would say if that ever changed).
fn ready<F: std::future::Future>(future: F) -> F::Output {
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut context) {
        std::task::Poll::Ready(value) => value,
        std::task::Poll::Pending => panic!("the in-process admission waited"),
    }
}

/// The full cycle through the one admission API ([`Admission`], in-process).
#[inline]
fn admission_cycle(a: &Admission, client: &str) {
    let permit = loop {
        match ready(a.admit(client, false, None)) {
            Ok(permit) => break permit,
            Err(AdmitError::Refused(r)) if r.refusal.code == RefusalCode::SubmissionRateLimited => {
                STALE_CLOCK_RETRIES.fetch_add(1, Ordering::Relaxed);
            }
            Err(r) => panic!("refused: {r:?}"),
        }
    };
    let op = permit.commit();
    ready(op.try_start()).expect("started");
    ready(op.succeed()).expect("succeeded");
}

/// 7. The one admission API in-process beside the engine it wraps, in the same run: the full
///    cycle and a rate refusal. What the API adds is its operation id and the quota it reads for
///    the answer's headers.
fn admission_api(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("7_admission_api");
    let c = controller();
    let a = Admission::in_process(controller());
    g.bench_function("engine_cycle", |b| b.iter(|| cycle(&c, black_box("bot-0"))));
    g.bench_function("admission_cycle", |b| {
        b.iter(|| admission_cycle(&a, black_box("bot-0")))
    });
    let config = one_a_day();
    let refusing = Controller::builder(config.clone())
        .clock(fast_clock())
        .build();
    drop(refusing.admit("bot-0", false).expect("the one token"));
    let refusing_api =
        Admission::in_process(Controller::builder(config).clock(fast_clock()).build());
    drop(ready(refusing_api.admit("bot-0", false, None)).expect("the one token"));
    g.bench_function("engine_refusal", |b| {
        b.iter(|| {
            refusing
                .admit(black_box("bot-0"), false)
                .expect_err("refused")
        })
    });
    g.bench_function("admission_refusal", |b| {
        b.iter(|| ready(refusing_api.admit(black_box("bot-0"), false, None)).expect_err("refused"))
    });
    g.finish();
}

/// 8. A shadow quota file's judgement beside the refusal it follows, in the same run: the
///    in-process `Admission` refusing a spent client, then the same refusal followed by a shadow
///    engine's judgement (itself a refusal, with the wall-clock reading the broker takes) — what
///    `serve --shadow-config` adds to every refused submission.
fn shadow_judgement(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("8_shadow_judgement");
    let config = one_a_day();
    let real = Admission::in_process(
        Controller::builder(config.clone())
            .clock(fast_clock())
            .build(),
    );
    drop(ready(real.admit("bot-0", false, None)).expect("the one token"));
    let shadow = Shadow::new(Controller::builder(config).clock(fast_clock()).build());
    drop(shadow.judge("bot-0", false, std::time::SystemTime::now()));
    g.bench_function("admission_refusal", |b| {
        b.iter(|| ready(real.admit(black_box("bot-0"), false, None)).expect_err("refused"))
    });
    g.bench_function("admission_refusal_then_shadow", |b| {
        b.iter(|| {
            let refused = ready(real.admit(black_box("bot-0"), false, None)).expect_err("refused");
            let verdict = shadow.judge(black_box("bot-0"), false, std::time::SystemTime::now());
            assert!(matches!(verdict, ShadowVerdict::Refused { .. }));
            refused
        })
    });
    g.finish();
}

/// `config` with both pools shared: a reserve of a tenth, a floor of one.
fn fair(config: Config) -> Config {
    let limits = *config.limits();
    let pool = |limit: u32| PoolShare {
        reserve: limit / 10,
        floor: 1,
    };
    config
        .with_fair_share(Some(FairShare {
            active: pool(limits.global_active),
            executing: pool(limits.global_executing),
        }))
        .expect("a valid fair share")
}

/// One operation of `client` executing on `c`, held for a whole bench: from then on the client
/// holds in both pools, so each cycle's admission and start are judged by the whole rule (not
/// waved through as a small client's) and nobody's count crosses zero.
fn holding(c: &Controller, client: &str) -> Operation {
    let op = c.admit(client, false).expect("admitted").commit();
    op.try_start().expect("started");
    op
}

/// `bot-0`, whose one request a day (`config` is [`one_a_day`], with or without a fair share) is
/// spent: every admission is a rate refusal.
fn spent(config: Config) -> Controller {
    let refusing = Controller::builder(config).clock(fast_clock()).build();
    drop(refusing.admit("bot-0", false).expect("the one token"));
    refusing
}

/// A pool of 10 live operations refusing `bot-0`, which holds 9 of them: first come, first
/// served because `bot-1` holds the tenth (the pool is full); the fair share (a reserve of 1)
/// because only the reserve is left. A capacity refusal of the active pool either way, the
/// fair share's arithmetic on top in the second.
fn pool_refusing(fair_share: bool) -> (Controller, Vec<Operation>) {
    let ids = CLIENTS.map(|c| Identity::new(c).expect("valid"));
    let limits = Limits {
        client_active: 10,
        client_pending: 10,
        global_active: 10,
        global_executing: 10,
        ..roomy_limits()
    };
    let mut config = Config::new(limits, BTreeMap::new(), ids).expect("valid config");
    if fair_share {
        config = fair(config);
    }
    let c = Controller::builder(config).clock(fast_clock()).build();
    let mut held: Vec<Operation> = (0..9)
        .map(|_| c.admit("bot-0", false).expect("room").commit())
        .collect();
    if !fair_share {
        held.push(c.admit("bot-1", false).expect("room").commit());
    }
    (c, held)
}

/// Nanoseconds per call of `a` and of `b`, each the median over `rounds` rounds of `iters`
/// calls, the two measured in turns (a round runs `a` then `b`, the next `b` then `a`), so a
/// machine whose load changes under the run (other builds on a shared VM) weighs on both alike.
fn in_turns(rounds: usize, iters: u32, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    let time = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        start.elapsed().as_nanos() as f64 / f64::from(iters)
    };
    let (mut ta, mut tb) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds {
        if round % 2 == 0 {
            ta.push(time(&mut a));
            tb.push(time(&mut b));
        } else {
            tb.push(time(&mut b));
            ta.push(time(&mut a));
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(ta), median(tb))
}

/// 9. The fair share of the global pools against first come, first served, in the same run: the
///    full cycle of a client already holding in both pools (each decision judged by the whole
///    rule), the cycle of an idle client (each one counting it in and out of the holders, which
///    both keep), a rate refusal, and a capacity refusal of the active pool (full, against only
///    its reserve left). Each pair is also measured in turns, and its medians and ratio printed
///    (`fair_share/first_come`): on a shared machine, the figure to read.
fn fair_share(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("9_fair_share");
    let build = |config: Config| Controller::builder(config).clock(fast_clock()).build();
    let (plain, fair_c) = (build(roomy_config()), build(fair(roomy_config())));
    let (plain_spent, fair_spent) = (spent(one_a_day()), spent(fair(one_a_day())));
    let ((plain_full, plain_held), (fair_full, fair_held)) =
        (pool_refusing(false), pool_refusing(true));
    let refuse_pool = |c: &Controller| {
        let refused = c.admit(black_box("bot-0"), false).expect_err("refused");
        assert_eq!(refused.code, RefusalCode::GlobalOperationLimit);
    };
    let refuse_rate = |c: &Controller| {
        c.admit(black_box("bot-0"), false).expect_err("refused");
    };
    for (name, c, refusing, full) in [
        ("first_come", &plain, &plain_spent, &plain_full),
        ("fair_share", &fair_c, &fair_spent, &fair_full),
    ] {
        g.bench_function(format!("cycle_idle_client_{name}"), |b| {
            b.iter(|| cycle(c, black_box("bot-0")))
        });
        let held = holding(c, "bot-1");
        g.bench_function(format!("cycle_holding_client_{name}"), |b| {
            b.iter(|| cycle(c, black_box("bot-1")))
        });
        held.succeed().expect("succeeded");
        g.bench_function(format!("refusal_rate_limited_{name}"), |b| {
            b.iter(|| refuse_rate(refusing))
        });
        g.bench_function(format!("refusal_global_operation_limit_{name}"), |b| {
            b.iter(|| refuse_pool(full))
        });
    }
    g.finish();
    let held = [holding(&plain, "bot-1"), holding(&fair_c, "bot-1")];
    let pairs: [(&str, (f64, f64)); 4] = [
        (
            "cycle_idle_client",
            in_turns(
                101,
                20_000,
                || cycle(&plain, black_box("bot-0")),
                || cycle(&fair_c, black_box("bot-0")),
            ),
        ),
        (
            "cycle_holding_client",
            in_turns(
                101,
                20_000,
                || cycle(&plain, black_box("bot-1")),
                || cycle(&fair_c, black_box("bot-1")),
            ),
        ),
        (
            "refusal_rate_limited",
            in_turns(
                101,
                50_000,
                || refuse_rate(&plain_spent),
                || refuse_rate(&fair_spent),
            ),
        ),
        (
            "refusal_global_operation_limit",
            in_turns(
                101,
                50_000,
                || refuse_pool(&plain_full),
                || refuse_pool(&fair_full),
            ),
        ),
    ];
    for (name, (first_come, fair_share)) in pairs {
        println!(
            "9_fair_share in turns: {name}: first_come {first_come:.1} ns, fair_share \
             {fair_share:.1} ns, fair_share/first_come {:.3}",
            fair_share / first_come
        );
    }
    for op in held {
        op.succeed().expect("succeeded");
    }
    drop((plain_held, fair_held));
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(700))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = full_cycle, rate_check, versus_mutex, scaling, under_reload, refusal_flood,
        admission_api, shadow_judgement, fair_share
}
criterion_main!(benches);
