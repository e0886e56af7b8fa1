//! The design most brokers start with, as the baseline the engine is measured against: one
//! `Mutex` over a `HashMap` of per-client fixed windows and counters, plus global counters under the
//! same lock. Every step of an operation's life takes the lock and looks the client up by name.

use std::collections::HashMap;
use std::sync::Mutex;

/// Per-client limits and state under the one lock.
struct ClientEntry {
    window_start: u64,
    in_window: u64,
    active: u64,
    queued: u64,
    executing: u64,
}

struct State {
    clients: HashMap<String, ClientEntry>,
    global_active: u64,
    global_executing: u64,
}

/// Limits, as in the engine's quota file.
#[derive(Clone, Copy)]
pub struct BaselineLimits {
    pub requests_per_window: u64,
    pub window_nanos: u64,
    pub client_active: u64,
    pub global_active: u64,
    pub global_executing: u64,
}

pub struct MutexAdmission {
    state: Mutex<State>,
    limits: BaselineLimits,
    clock: quanta::Clock,
    origin: quanta::Instant,
}

/// An admitted operation's handle: the client name, looked up again at every step.
pub struct BaselineOp {
    client: String,
}

impl MutexAdmission {
    pub fn new(clients: &[&str], limits: BaselineLimits) -> MutexAdmission {
        let clock = quanta::Clock::new();
        let origin = clock.now();
        let clients = clients
            .iter()
            .map(|c| {
                (
                    (*c).to_owned(),
                    ClientEntry {
                        window_start: 0,
                        in_window: 0,
                        active: 0,
                        queued: 0,
                        executing: 0,
                    },
                )
            })
            .collect();
        MutexAdmission {
            state: Mutex::new(State {
                clients,
                global_active: 0,
                global_executing: 0,
            }),
            limits,
            clock,
            origin,
        }
    }

    fn now(&self) -> u64 {
        self.clock
            .now()
            .saturating_duration_since(self.origin)
            .as_nanos() as u64
    }

    /// Fixed-window rate check, then the per-client and global counts, all under the lock.
    pub fn admit(&self, client: &str) -> Option<BaselineOp> {
        let now = self.now();
        let l = self.limits;
        let mut state = self.state.lock().unwrap();
        let State {
            clients,
            global_active,
            global_executing,
        } = &mut *state;
        let entry = clients.get_mut(client)?;
        if now - entry.window_start >= l.window_nanos {
            entry.window_start = now;
            entry.in_window = 0;
        }
        if entry.in_window >= l.requests_per_window
            || entry.active >= l.client_active
            || *global_active >= l.global_active
            || *global_executing >= l.global_executing
        {
            return None;
        }
        entry.in_window += 1;
        entry.active += 1;
        *global_active += 1;
        Some(BaselineOp {
            client: client.to_owned(),
        })
    }

    /// The durable operation exists and needs no approval: it is queued.
    pub fn commit(&self, op: &BaselineOp) {
        let mut state = self.state.lock().unwrap();
        state.clients.get_mut(&op.client).expect("known").queued += 1;
    }

    /// Takes an execution slot.
    pub fn start(&self, op: &BaselineOp) -> bool {
        let mut state = self.state.lock().unwrap();
        if state.global_executing >= self.limits.global_executing {
            return false;
        }
        state.global_executing += 1;
        let entry = state.clients.get_mut(&op.client).expect("known");
        entry.queued -= 1;
        entry.executing += 1;
        true
    }

    /// Execution finished: release everything.
    pub fn finish(&self, op: BaselineOp) {
        let mut state = self.state.lock().unwrap();
        state.global_executing -= 1;
        state.global_active -= 1;
        let entry = state.clients.get_mut(&op.client).expect("known");
        entry.executing -= 1;
        entry.active -= 1;
    }
}
