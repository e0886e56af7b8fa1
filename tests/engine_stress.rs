//! Many threads hammer admissions and random transitions while a monitor samples every count: no
//! counter may ever pass its limit, releases never underflow (the engine debug-asserts that), and
//! everything is back to zero at the end. Bounded in operations, not time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use unyolo_admission::{
    ClientLimits, Config, Controller, Identity, Limits, ManualClock, Operation, OperationState,
    StorageCaps, Store,
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
    }
}

/// One worker: admit, then drive its own and others' operations through random transitions.
fn work(c: &Controller, shared: &Mutex<Vec<Arc<Operation>>>, seed: u64) {
    let mut rng = Rng(seed);
    let mut mine: Vec<Arc<Operation>> = Vec::new();
    let mut stored = Vec::new();
    for _ in 0..OPS_PER_THREAD {
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
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (c, shared) = (&c, &shared);
                s.spawn(move || work(c, shared, 0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1)))
            })
            .collect();
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
    let configs = [churn_config(0..6), churn_config(3..24), churn_config(12..14)];
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
