//! What a submission pays for its idempotency key's lock: the broker's exact table (one lock per
//! (client, key) in use, in a sharded `dashmap` keyed by one shared name; `src/key_locks.rs`)
//! against the design it replaced, 64 `tokio` mutexes shared by hash (the baseline, rebuilt here
//! as it was), in the same run. Each step takes a free key's lock and lets it go, as an
//! uncontended submission does around its admission and store write; the keys rotate over 1,024
//! (client, key) pairs, so the table grows and shrinks by one entry every step.
//!
//! `cargo bench --bench key_locks` (release build, about a minute). Under `cargo test` each
//! routine runs once, which still checks that the exact table never makes one thread's key wait
//! for another's and ends empty. (The striped baseline does make them wait when two keys share a
//! stripe: its step spins until its stripe is free.)

use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use unyolo_admission_broker::key_locks::KeyLocks;

const PAIRS: usize = 1024;

/// Polls `future` once; it must be ready (no two threads' pairs share a lock in the exact table).
fn now<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a free key's lock was not had at once"),
    }
}

/// The (client, key) pairs of thread `t`: distinct from every other thread's.
fn pairs(t: usize) -> Vec<(String, String)> {
    (0..PAIRS)
        .map(|i| {
            let client = format!("client-{t}-{}", i % 16);
            let key = format!("0190c9a4-7e1f-7c3a-9b2d-{t:04}{i:08}");
            (client, key)
        })
        .collect()
}

/// The baseline: the striped table the broker had, 64 `tokio` mutexes chosen by a hash of
/// (client, key).
struct Striped(Box<[Arc<tokio::sync::Mutex<()>>]>);

impl Striped {
    fn new() -> Striped {
        Striped((0..64).map(|_| Arc::default()).collect())
    }

    fn lock(&self, client: &str, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut hasher = DefaultHasher::new();
        (client, key).hash(&mut hasher);
        let stripe = (hasher.finish() % self.0.len() as u64) as usize;
        Arc::clone(&self.0[stripe])
    }
}

fn exact_step(locks: &Arc<KeyLocks>, (client, key): &(String, String)) {
    let guard = now(locks.lock(client, key));
    drop(std::hint::black_box(guard));
}

/// Polls `future` until it is ready (a stripe another thread's key shares may be held: the
/// baseline's flaw, which the exact table does not have).
fn spin<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            return out;
        }
        std::hint::spin_loop();
    }
}

fn striped_step(locks: &Striped, (client, key): &(String, String)) {
    let guard = spin(locks.lock(client, key).lock_owned());
    drop(std::hint::black_box(guard));
}

/// `iters` steps split over `threads` threads, thread `t` pinned to core `t` and walking its own
/// pairs; the wall time from the moment all are ready until the last is done.
fn threaded(iters: u64, threads: usize, step: impl Fn(&(String, String)) + Sync) -> Duration {
    let per = iters / threads as u64;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let ready = std::sync::Barrier::new(threads + 1);
    let go = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (step, ready, go) = (&step, &ready, &go);
                let core = cores.get(t % cores.len().max(1)).copied();
                let mine = pairs(t);
                s.spawn(move || {
                    if let Some(core) = core {
                        core_affinity::set_for_current(core);
                    }
                    ready.wait();
                    go.wait();
                    for i in 0..per as usize {
                        step(&mine[i % PAIRS]);
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

fn key_locks(c: &mut Criterion) {
    let exact = Arc::new(KeyLocks::default());
    let striped = Striped::new();
    let mut group = c.benchmark_group("key lock, take and let go");
    for threads in [1, 2] {
        group.bench_function(format!("exact table, {threads} thread(s)"), |b| {
            b.iter_custom(|iters| threaded(iters, threads, |pair| exact_step(&exact, pair)))
        });
        group.bench_function(format!("baseline: 64 stripes, {threads} thread(s)"), |b| {
            b.iter_custom(|iters| threaded(iters, threads, |pair| striped_step(&striped, pair)))
        });
    }
    group.finish();
    // Every lock taken was let go: the table holds nothing (it is bounded by the locks in use).
    assert_eq!(
        exact.in_use(),
        0,
        "the exact table kept entries nobody holds"
    );
}

criterion_group!(benches, key_locks);
criterion_main!(benches);
