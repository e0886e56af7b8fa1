//! Many threads hammer admissions and random transitions while a monitor samples every count: no
//! counter may ever pass its limit, releases never underflow (the engine debug-asserts that), and
//! everything is back to zero at the end. Bounded in operations, not time.
//!
//! Counts read while threads race are not one instant (a snapshot reads one gauge after
//! another), so the racing monitor checks bounds only. Exact checks — each client's executing,
//! pending, queued and active counts equal to the states of the handles the workers hold,
//! executing never above active, each pool's holders equal to the clients holding there — run
//! at checkpoints where every worker is between batches: workers hold a read lock on a gate
//! while they work a batch, the checker takes its write lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use unyolo_admission::{
    ClientLimits, Config, Controller, FairShare, Identity, Limits, ManualClock, Operation,
    OperationState, PoolShare, StorageCaps, Store,
};

const CLIENTS: [&str; 4] = ["a", "b", "c", "d"];
const THREADS: usize = 4;
const OPS_PER_THREAD: usize = 100_000;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn id(n: &str) -> Identity {
    Identity::new(n).unwrap()
}

fn config(client_active: u32, client_pending: u32, ga: u32, ge: u32) -> Config {
    let limits = Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active,
        client_pending,
        global_active: ga,
        global_executing: ge,
    };
    let overrides = BTreeMap::from([(
        id("d"),
        ClientLimits {
            requests_per_window: 50,
            window_seconds: 1,
            active: 3,
            pending: 2,
        },
    )]);
    Config::new(limits, overrides, CLIENTS.iter().map(|n| id(n))).unwrap()
}

/// The largest value each count may take under any of `configs`.
struct Bounds {
    client_active: BTreeMap<&'static str, u64>,
    client_pending: BTreeMap<&'static str, u64>,
    global_active: u64,
    global_executing: u64,
    global_pending: u64,
}

fn bounds(configs: &[Config], caps: &StorageCaps) -> Bounds {
    let max = |f: &dyn Fn(&Config) -> u64| configs.iter().map(f).max().unwrap();
    Bounds {
        client_active: CLIENTS
            .iter()
            .map(|&n| (n, max(&|c| u64::from(c.effective(n).unwrap().active))))
            .collect(),
        client_pending: CLIENTS
            .iter()
            .map(|&n| {
                (
                    n,
                    max(&|c| u64::from(c.effective(n).unwrap().pending)).min(caps.grant_client),
                )
            })
            .collect(),
        global_active: max(&|c| u64::from(c.limits().global_active)),
        global_executing: max(&|c| u64::from(c.limits().global_executing)),
        global_pending: caps.grant_global,
    }
}

fn check(c: &Controller, b: &Bounds, caps: &StorageCaps) {
    let s = c.snapshot();
    assert!(
        s.active <= b.global_active,
        "global active {} above {}",
        s.active,
        b.global_active
    );
    assert!(
        s.executing <= b.global_executing,
        "executing {} above {}",
        s.executing,
        b.global_executing
    );
    assert!(
        s.pending <= b.global_pending,
        "pending {} above {}",
        s.pending,
        b.global_pending
    );
    assert!(
        s.storage[0].files <= caps.stream.global_files
            && s.storage[0].bytes <= caps.stream.global_bytes
    );
    for client in &s.clients {
        let name = client.identity.as_str();
        assert!(
            client.active <= b.client_active[name],
            "{name} active {} above limit",
            client.active
        );
        assert!(
            client.pending <= b.client_pending[name],
            "{name} pending {} above limit",
            client.pending
        );
        assert!(
            client.pending + client.queued + client.executing
                <= client.active.max(b.client_active[name])
        );
        assert!(client.storage[0].files <= caps.stream.client_files);
        assert!(
            client.executing <= b.client_active[name],
            "{name} executing {} above its active limit",
            client.executing
        );
        assert!(
            client.executing <= b.global_executing,
            "{name} executing {} above the global execution limit",
            client.executing
        );
    }
}

/// What the handles held at a checkpoint say each count must be, per client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    active: u64,
    pending: u64,
    queued: u64,
    executing: u64,
    stream_files: u64,
    stream_bytes: u64,
}

type Tally = BTreeMap<String, Held>;

fn tally_operations<'a>(tally: &mut Tally, ops: impl IntoIterator<Item = &'a Arc<Operation>>) {
    for op in ops {
        let held = tally.entry(op.identity().as_str().to_owned()).or_default();
        match op.state() {
            OperationState::Pending => held.pending += 1,
            OperationState::Approved => held.queued += 1,
            OperationState::Executing => held.executing += 1,
            _ => continue,
        }
        held.active += 1;
    }
}

/// At a checkpoint (no worker mid-batch): every count, per client and global, is exactly what the
/// held handles say, no client executes more than it has active, and each pool's holders are
/// the clients holding there.
fn check_exact(c: &Controller, tally: &Tally) {
    let s = c.snapshot();
    let holding = |f: fn(&Held) -> u64| tally.values().filter(|held| f(held) > 0).count() as u64;
    assert_eq!(
        (s.active_holders, s.executing_holders),
        (holding(|h| h.active), holding(|h| h.executing)),
        "the pools' holders against the clients holding"
    );
    let mut total = Held::default();
    for client in &s.clients {
        let name = client.identity.as_str();
        let want = tally.get(name).copied().unwrap_or_default();
        let got = Held {
            active: client.active,
            pending: client.pending,
            queued: client.queued,
            executing: client.executing,
            stream_files: client.storage[0].files,
            stream_bytes: client.storage[0].bytes,
        };
        assert_eq!(got, want, "{name}'s counts against the handles held");
        assert!(client.executing <= client.active, "{name}: {client:?}");
        total.active += want.active;
        total.pending += want.pending;
        total.queued += want.queued;
        total.executing += want.executing;
        total.stream_files += want.stream_files;
        total.stream_bytes += want.stream_bytes;
    }
    let got = Held {
        active: s.active,
        pending: s.pending,
        queued: s.queued,
        executing: s.executing,
        stream_files: s.storage[0].files,
        stream_bytes: s.storage[0].bytes,
    };
    assert_eq!(got, total, "global counts against the handles held");
}

/// Ops a worker runs between checkpoints.
const BATCH: usize = 500;

/// One worker: admit, then drive its own and others' operations through random transitions, in
/// batches; after each batch it publishes what it holds for the checkpoint checker.
fn work(
    c: &Controller,
    shared: &Mutex<Vec<Arc<Operation>>>,
    gate: &RwLock<()>,
    published: &Mutex<Tally>,
    seed: u64,
) {
    let mut rng = Rng(seed);
    let mut mine: Vec<Arc<Operation>> = Vec::new();
    let mut stored: Vec<unyolo_admission::StoredObject> = Vec::new();
    let mut batch = gate.read().unwrap();
    for n in 0..OPS_PER_THREAD {
        if n % BATCH == 0 {
            let mut tally = Tally::new();
            tally_operations(&mut tally, &mine);
            for obj in &stored {
                let held = tally.entry(obj.identity().as_str().to_owned()).or_default();
                held.stream_files += 1;
                held.stream_bytes += obj.bytes();
            }
            *published.lock().unwrap() = tally;
            drop(batch);
            batch = gate.read().unwrap();
        }
        let client = CLIENTS[rng.below(4) as usize];
        match rng.below(10) {
            0..=3 => {
                if let Ok(permit) = c.admit(client, rng.below(2) == 0) {
                    match rng.below(8) {
                        0 => drop(permit),
                        1 => permit.refund(),
                        2 => shared.lock().unwrap().push(Arc::new(permit.commit())),
                        _ => mine.push(Arc::new(permit.commit())),
                    }
                }
            }
            4..=8 if !mine.is_empty() => {
                let i = rng.below(mine.len() as u64) as usize;
                let op = &mine[i];
                let _ = match rng.below(7) {
                    0 => op.approve().map(|_| ()),
                    1 => op.deny(),
                    2 => op.cancel().map(|_| ()),
                    3 => op.try_start().map_err(|_| unreachable_transition()),
                    4 => op.succeed(),
                    5 => op.fail(),
                    _ => op.expire(),
                };
                if op.state().is_terminal() || rng.below(50) == 0 {
                    mine.swap_remove(i); // dropping a live handle releases it
                }
            }
            4..=8 => {
                // Race someone else's operation.
                let op = shared.lock().unwrap().pop();
                if let Some(op) = op {
                    let _ = op.approve();
                    let _ = op.try_start();
                    if op.state() == OperationState::Executing {
                        op.succeed().unwrap();
                    } else {
                        let _ = op.cancel();
                    }
                }
            }
            _ => {
                if stored.len() > 3 || rng.below(3) == 0 {
                    stored.pop();
                } else if let Ok(r) = c.reserve_storage(client, Store::Stream, rng.below(400))
                    && let Ok(obj) = r.settle(rng.below(500))
                {
                    stored.push(obj);
                }
            }
        }
    }
    drop(mine);
    drop(stored);
    *published.lock().unwrap() = Tally::new();
    drop(batch);
}

fn unreachable_transition() -> unyolo_admission::TransitionError {
    unyolo_admission::TransitionError {
        from: OperationState::Approved,
        to: OperationState::Executing,
    }
}

fn hammer(reload_between: Option<[Config; 2]>) {
    let caps = StorageCaps {
        grant_global: 6,
        stream: unyolo_admission::StoreCaps {
            global_files: 6,
            global_bytes: 1500,
            client_files: 3,
            client_bytes: 900,
        },
        ..StorageCaps::default()
    };
    let first = config(5, 3, 12, 4);
    let configs: Vec<Config> = match &reload_between {
        Some(pair) => pair.to_vec(),
        None => vec![first.clone()],
    };
    let b = bounds(&configs, &caps);
    let clock = ManualClock::new();
    let c = Controller::builder(configs[0].clone())
        .clock(clock.clone())
        .storage_caps(caps)
        .build();
    let shared = Mutex::new(Vec::new());
    let done = AtomicBool::new(false);
    let gate = RwLock::new(());
    let published: Vec<Mutex<Tally>> = (0..THREADS).map(|_| Mutex::default()).collect();
    let checkpoints = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (c, shared, gate, published) = (&c, &shared, &gate, &published[t]);
                s.spawn(move || {
                    work(
                        c,
                        shared,
                        gate,
                        published,
                        0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1),
                    )
                })
            })
            .collect();
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                {
                    let _quiet = gate.write().unwrap_or_else(|p| p.into_inner());
                    let mut tally = Tally::new();
                    for p in &published {
                        for (name, held) in p.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                            let sum = tally.entry(name.clone()).or_default();
                            sum.active += held.active;
                            sum.pending += held.pending;
                            sum.queued += held.queued;
                            sum.executing += held.executing;
                            sum.stream_files += held.stream_files;
                            sum.stream_bytes += held.stream_bytes;
                        }
                    }
                    // The pool stays locked until the counts are read: the main thread empties it
                    // at the end, outside the gate.
                    let pool = shared.lock().unwrap();
                    tally_operations(&mut tally, pool.iter());
                    check_exact(&c, &tally);
                    drop(pool);
                    checkpoints.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::yield_now();
            }
        });
        s.spawn(|| {
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) {
                check(&c, &b, &caps);
                clock.advance(std::time::Duration::from_micros(700));
                if let Some(pair) = &reload_between {
                    c.reload(pair[(i % 2) as usize].clone());
                }
                i += 1;
            }
        });
        for w in workers {
            w.join().unwrap();
        }
        shared.lock().unwrap().clear();
        done.store(true, Ordering::Relaxed);
    });
    check(&c, &b, &caps);
    check_exact(&c, &Tally::new());
    assert!(checkpoints.load(Ordering::Relaxed) > 0);
    let s = c.snapshot();
    assert!(s.is_idle(), "counts left behind: {s:?}");
    assert!(
        s.admitted > 1_000,
        "the run admitted too little to mean anything: {}",
        s.admitted
    );
    assert!(
        s.rejected.iter().sum::<u64>() > 1_000,
        "the run refused too little to test the limits"
    );
}

#[test]
fn many_threads_never_push_a_count_past_its_limit_and_all_return_to_zero() {
    hammer(None);
}

#[test]
fn reloads_under_concurrent_admissions_keep_every_invariant() {
    hammer(Some([config(5, 3, 12, 4), config(2, 1, 6, 2)]));
}

/// A fair share of both pools, given to `config`.
fn fair(config: Config, active_reserve: u32, executing_reserve: u32) -> Config {
    let pool = |reserve| PoolShare { reserve, floor: 1 };
    config
        .with_fair_share(Some(FairShare {
            active: pool(active_reserve),
            executing: pool(executing_reserve),
        }))
        .unwrap()
}

#[test]
fn a_fair_share_under_many_threads_keeps_every_count_and_holder_exact() {
    hammer(Some([
        fair(config(5, 3, 12, 4), 3, 1),
        fair(config(5, 3, 12, 4), 5, 2),
    ]));
}

#[test]
fn reloads_turning_the_fair_share_on_and_off_under_concurrent_admissions_keep_every_invariant() {
    hammer(Some([fair(config(5, 3, 12, 4), 3, 1), config(2, 1, 6, 2)]));
}

/// Base identities, admitted by workers, plus extra identities that reloads add and remove by the
/// dozen (so slots are freed and reused), each extra with a rate of its own.
fn churn_config(extras: std::ops::Range<u32>) -> Config {
    let overrides = extras
        .clone()
        .map(|k| {
            (
                id(&format!("x{k}")),
                ClientLimits {
                    requests_per_window: k + 1,
                    window_seconds: 60,
                    active: 2,
                    pending: 1,
                },
            )
        })
        .collect();
    let names = ["a", "b"]
        .into_iter()
        .map(id)
        .chain(extras.map(|k| id(&format!("x{k}"))));
    Config::new(
        Limits {
            requests_per_window: 1_000_000,
            window_seconds: 1,
            client_active: 4,
            client_pending: 2,
            global_active: 8,
            global_executing: 2,
        },
        overrides,
        names,
    )
    .unwrap()
}

#[test]
fn snapshots_racing_reloads_that_add_and_remove_identities_never_panic_nor_invent_counts() {
    const RELOADS: usize = 3_000;
    let configs = [
        churn_config(0..6),
        churn_config(3..24),
        churn_config(12..14),
    ];
    let clock = ManualClock::new();
    let c = Controller::builder(configs[0].clone())
        .clock(clock.clone())
        .build();
    let done = AtomicBool::new(false);
    let snapshots_checked = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (c, done, checked) = (&c, &done, &snapshots_checked);
            s.spawn(move || {
                let mut rng = Rng(0xA5A5_5A5A ^ (t + 1));
                let mut held: Vec<Operation> = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    // Traffic for the base identities only: every extra's bucket stays full.
                    let name = ["a", "b"][rng.below(2) as usize];
                    if let Ok(permit) = c.admit(name, rng.below(2) == 0) {
                        held.push(permit.commit());
                    }
                    if held.len() > 3 {
                        let op = held.swap_remove(rng.below(held.len() as u64) as usize);
                        let _ = op.approve();
                        let _ = op.try_start();
                    }
                    let snap = c.snapshot();
                    for client in &snap.clients {
                        let name = client.identity.as_str();
                        if let Some(k) = name.strip_prefix('x') {
                            let k: u64 = k.parse().unwrap();
                            assert_eq!(
                                (client.tokens, client.admitted, client.active),
                                (k + 1, 0, 0),
                                "{name} read under another client's settings: {client:?}"
                            );
                        } else {
                            assert!(client.tokens <= 1_000_000, "{client:?}");
                            assert!(client.active <= 4 && client.pending <= 2, "{client:?}");
                            assert!(client.executing <= 2, "{client:?}");
                        }
                    }
                    assert!(snap.active <= 8 && snap.executing <= 2, "{snap:?}");
                    checked.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        for i in 0..RELOADS {
            c.reload(configs[i % configs.len()].clone());
            if i % 64 == 0 {
                std::thread::yield_now();
            }
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(c.snapshot().is_idle(), "{:?}", c.snapshot());
    assert!(snapshots_checked.load(Ordering::Relaxed) > 0);
}

/// `names` with `active` each (roomy rate and globals), nothing else configured.
fn only(names: &[(&str, u32)]) -> Config {
    let overrides = names
        .iter()
        .map(|&(name, active)| {
            (
                id(name),
                ClientLimits {
                    requests_per_window: 1_000_000,
                    window_seconds: 1,
                    active,
                    pending: 1,
                },
            )
        })
        .collect();
    let limits = Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active: 1,
        client_pending: 1,
        global_active: 64,
        global_executing: 64,
    };
    Config::new(limits, overrides, names.iter().map(|&(name, _)| id(name))).unwrap()
}

#[test]
fn admissions_racing_reloads_that_hand_a_freed_slot_to_another_client_use_their_own_limits() {
    // `p` (1 active) and `q` (3 active) take turns being the only client, so each reload that
    // finds the other idle frees its slot and gives it to the newcomer. An admission that found
    // `p` in the old table but read the newcomer's limits would let `p` hold 3.
    const RELOADS: usize = 20_000;
    let configs = [only(&[("p", 1)]), only(&[("q", 3)])];
    let clock = ManualClock::new();
    let c = Controller::builder(configs[0].clone())
        .clock(clock.clone())
        .build();
    let done = AtomicBool::new(false);
    let live = [
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    ];
    let admitted = std::sync::atomic::AtomicU64::new(0);
    let handoffs = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (c, done, live, admitted) = (&c, &done, &live, &admitted);
            s.spawn(move || {
                let mut rng = Rng(0x5EED ^ (t + 1));
                let mut held: Vec<(usize, Operation)> = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    let who = rng.below(2) as usize;
                    if let Ok(permit) = c.admit(["p", "q"][who], false) {
                        let op = permit.commit();
                        let now_live = live[who].fetch_add(1, Ordering::SeqCst) + 1;
                        assert!(
                            now_live <= [1, 3][who],
                            "{} holds {now_live} operations: admitted under another client's limits",
                            ["p", "q"][who]
                        );
                        admitted.fetch_add(1, Ordering::Relaxed);
                        held.push((who, op));
                    }
                    // Hold briefly, so both idle and draining states meet reloads.
                    if held.len() > 1 || rng.below(4) == 0 {
                        for (who, op) in held.drain(..) {
                            live[who].fetch_sub(1, Ordering::SeqCst);
                            op.cancel().expect("live until now");
                        }
                    }
                }
                for (who, op) in held.drain(..) {
                    live[who].fetch_sub(1, Ordering::SeqCst);
                    op.cancel().expect("live until now");
                }
            });
        }
        for i in 0..RELOADS {
            // A window on, every bucket is full: an idle removed client is forgotten.
            clock.advance(std::time::Duration::from_secs(1));
            c.reload(configs[i % 2].clone());
            if c.snapshot().clients.len() == 1 {
                handoffs.fetch_add(1, Ordering::Relaxed);
            }
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(c.snapshot().is_idle(), "{:?}", c.snapshot());
    assert!(
        admitted.load(Ordering::Relaxed) > 0,
        "no admission raced a reload"
    );
    assert!(
        handoffs.load(Ordering::Relaxed) > 0,
        "no reload forgot the other client and handed its slot on"
    );
}

#[test]
fn refusals_counted_on_many_threads_at_once_sum_exactly() {
    const THREADS: u64 = 6;
    const EACH: u64 = 20_000;
    let c = Controller::builder(only(&[("p", 1)]))
        .clock(ManualClock::new())
        .build();
    let held = c.admit("p", false).expect("its one slot").commit();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let c = &c;
            s.spawn(move || {
                for _ in 0..EACH {
                    let name = if t % 2 == 0 { "p" } else { "nobody" };
                    assert!(c.admit(name, false).is_err());
                }
            });
        }
    });
    let snap = c.snapshot();
    let p = snap.client("p").expect("configured");
    assert_eq!(
        p.rejected[unyolo_admission::RefusalCode::ClientOperationLimit as usize],
        THREADS / 2 * EACH
    );
    assert_eq!(
        snap.rejected(unyolo_admission::RefusalCode::ClientUnconfigured),
        THREADS / 2 * EACH
    );
    assert_eq!(
        snap.rejected.iter().sum::<u64>(),
        THREADS * EACH,
        "nothing else was counted: {snap:?}"
    );
    drop(held);
}

/// `bot`, 60 submissions a window of `window_seconds`, among `others` idle identities (whose
/// buckets a reload rescales too, so the reload takes a while).
fn windowed(window_seconds: u32, others: u32) -> Config {
    let mut overrides: BTreeMap<Identity, ClientLimits> = (0..others)
        .map(|k| {
            (
                id(&format!("idle{k}")),
                ClientLimits {
                    requests_per_window: 60,
                    window_seconds,
                    active: 1,
                    pending: 1,
                },
            )
        })
        .collect();
    overrides.insert(
        id("bot"),
        ClientLimits {
            requests_per_window: 60,
            window_seconds,
            active: 60,
            pending: 1,
        },
    );
    let names: Vec<Identity> = overrides.keys().cloned().collect();
    Config::new(
        Limits {
            requests_per_window: 60,
            window_seconds: 60,
            client_active: 60,
            client_pending: 1,
            global_active: 64,
            global_executing: 64,
        },
        overrides,
        names,
    )
    .unwrap()
}

#[test]
fn admissions_racing_reloads_that_change_a_rate_never_find_a_token_in_an_empty_bucket() {
    // Time stands still and `bot` has spent its whole burst. A reload keeps a bucket's fill
    // level (here: empty) whatever the window becomes, so nothing may be admitted however the
    // reloads between a 60 s and a 6 s window meet the admissions. One that read the old window
    // against a bucket already rescaled to the new one would find tokens (6 s used of 60).
    const RELOADS: usize = 150;
    let configs = [windowed(60, 1_000), windowed(6, 1_000)];
    let c = Controller::builder(configs[0].clone())
        .clock(ManualClock::new())
        .build();
    for _ in 0..60 {
        drop(c.admit("bot", false).expect("within the burst"));
    }
    assert!(c.admit("bot", false).is_err(), "the burst is spent");
    let done = AtomicBool::new(false);
    let (admitted, tried) = (
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    );
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (c, done, admitted, tried) = (&c, &done, &admitted, &tried);
            s.spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    tried.fetch_add(1, Ordering::Relaxed);
                    if let Ok(permit) = c.admit("bot", false) {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        drop(permit);
                    }
                }
            });
        }
        for i in 0..RELOADS {
            c.reload(configs[(i + 1) % 2].clone());
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(tried.load(Ordering::Relaxed) > 0);
    assert_eq!(
        admitted.load(Ordering::Relaxed),
        0,
        "admitted from an empty bucket during reloads ({} tried)",
        tried.load(Ordering::Relaxed)
    );
    // Back on the 60 s window, the bucket is still exactly empty: a token is due in a second.
    let refusal = c.admit("bot", false).expect_err("still empty");
    assert_eq!(
        refusal.code,
        unyolo_admission::RefusalCode::SubmissionRateLimited
    );
    assert_eq!(refusal.retry_after, std::time::Duration::from_secs(1));
}

#[test]
fn snapshots_racing_reloads_that_change_a_rate_show_no_phantom_tokens() {
    // As above, `bot`'s bucket is empty and time stands still; a snapshot read while a reload
    // rescales it must not read the bucket in the rate it is leaving (59 tokens of 60).
    const RELOADS: usize = 150;
    let configs = [windowed(60, 1_000), windowed(1, 1_000)];
    let c = Controller::builder(configs[0].clone())
        .clock(ManualClock::new())
        .build();
    for _ in 0..60 {
        drop(c.admit("bot", false).expect("within the burst"));
    }
    let done = AtomicBool::new(false);
    let read = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let (c, done, read) = (&c, &done, &read);
        s.spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let snapshot = c.snapshot();
                let bot = snapshot.client("bot").expect("configured");
                assert_eq!(bot.tokens, 0, "a snapshot during a reload");
                read.fetch_add(1, Ordering::Relaxed);
            }
        });
        for i in 0..RELOADS {
            c.reload(configs[(i + 1) % 2].clone());
        }
        done.store(true, Ordering::Relaxed);
    });
    assert!(read.load(Ordering::Relaxed) > 0);
}

#[test]
fn a_restore_racing_a_reload_never_puts_the_old_configuration_back() {
    // Restoring work of an identity no longer configured applies the configuration in force
    // (to track it): read before the reload and applied after, it would undo the reload.
    const ROUNDS: u64 = 300;
    let limits = |global_active: u32| {
        Config::new(
            Limits {
                requests_per_window: 1_000,
                window_seconds: 60,
                client_active: 4,
                client_pending: 2,
                global_active,
                global_executing: 2,
            },
            BTreeMap::new(),
            [id("a")],
        )
        .unwrap()
    };
    let c = Controller::builder(limits(8))
        .clock(ManualClock::new())
        .build();
    let mut restored = Vec::new();
    for round in 0..ROUNDS {
        let wanted = limits(if round % 2 == 0 { 7 } else { 8 });
        let op = std::thread::scope(|s| {
            let restoring = s.spawn(|| c.restore(format!("gone{round}"), OperationState::Pending));
            c.reload(wanted.clone());
            restoring.join().unwrap()
        });
        restored.push(op.expect("restored"));
        assert_eq!(c.config(), wanted, "round {round}: the reload was undone");
    }
    for op in restored {
        op.cancel().expect("live until now");
    }
    assert!(c.snapshot().is_idle());
}
