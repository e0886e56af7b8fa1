//! Who may start now: each client's share of units, the pool the clients share, the reserve kept
//! for exempt requests, and the queue of those waiting. Nothing here knows HTTP; the tower layer
//! ([`super::FairnessLayer`]) classifies a request and holds what [`Fairness::acquire`] grants.
//!
//! One mutex guards the whole picture (flows, queues, the round-robin ring): the order of the
//! queues needs one owner, and every critical section is a few counter and queue moves, never an
//! `.await`. The fast path (a client under its share, nobody waiting) takes it once to start and
//! once to finish.
//!
//! One file past the usual size because it is one invariant: the shares, the pool, the queues and
//! the permits and tickets that give units back all change under that one lock, and reading any
//! of them means reading the others.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

/// The `client` label of requests that belong to no client ([`Class::Unkeyed`]). No
/// [`unyolo_admission::Identity`] can take it: an identity starts with a letter or a digit.
pub const UNKEYED_LABEL: &str = "-";

/// How much work the fairness layer lets through, and how long an excess request may wait.
///
/// Requests cost *units*. Clients (and the unkeyed requests, together as one more client) share
/// `total_units - exempt_reserved_units`; each client holds at most `per_client_units` at once.
/// Exempt requests never wait and are never refused: they borrow from the whole total, so the
/// reserve is the part of it that no client's load can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FairnessConfig {
    /// The most units one client holds at once. Default 64: above the 32 waits a client may hold open, so the wait limit (`too_many_waits`) answers first.
    pub per_client_units: u32,
    /// Units of the total that only exempt requests may use. Default 32.
    pub exempt_reserved_units: u32,
    /// Units in flight across every request, exempt ones included. Default 512.
    pub total_units: u32,
    /// How long a request over its client's share (or over the shared pool) may wait for room
    /// before it is refused. Default 1 s.
    pub queue_wait: Duration,
    /// How many requests of one client may wait at once; a request past it is refused at once.
    /// 0: none waits. Default 16.
    pub queue_depth: u32,
    /// The `Retry-After` a refused request is given. Default 1 s.
    pub retry_after: Duration,
}

impl Default for FairnessConfig {
    fn default() -> FairnessConfig {
        FairnessConfig {
            per_client_units: 64,
            exempt_reserved_units: 32,
            total_units: 512,
            queue_wait: Duration::from_secs(1),
            queue_depth: 16,
            retry_after: Duration::from_secs(1),
        }
    }
}

impl FairnessConfig {
    /// Why these numbers cannot work, if they cannot: a zero share, a reserve that leaves the
    /// clients nothing, or a share so large that one client at it would leave no room for another.
    pub fn problem(&self) -> Option<String> {
        if self.per_client_units == 0 {
            return Some("the per-client units must be at least 1".to_owned());
        }
        let pool = self.client_pool();
        if self.exempt_reserved_units >= self.total_units {
            return Some(format!(
                "the exempt reserve ({}) must be below the total units ({})",
                self.exempt_reserved_units, self.total_units
            ));
        }
        if self.per_client_units >= pool {
            return Some(format!(
                "the per-client units ({}) must be below the units clients share ({} total - {} \
                 exempt reserve = {pool}), or one client at its share leaves no room for another",
                self.per_client_units, self.total_units, self.exempt_reserved_units
            ));
        }
        None
    }

    /// The units clients share: the total less the exempt reserve.
    fn client_pool(&self) -> u32 {
        self.total_units.saturating_sub(self.exempt_reserved_units)
    }
}

/// What a request is to the fairness layer, as the embedder's classifier says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Class {
    /// Health, readiness, operator decisions, metrics: never waits behind clients, never
    /// refused; counts one unit against the total.
    Exempt,
    /// An exempt request of the authenticated client `key` (its cancel): exempt while the client
    /// has fewer than [`FairnessConfig::per_client_units`] exempt requests in flight; past that,
    /// one of its own requests costing one unit (in its queue, refused at its share), so one
    /// client's flood of them cannot take the pool the other clients share.
    ExemptClient {
        /// The client, as authenticated.
        key: Arc<str>,
    },
    /// A request of the authenticated client `key`, costing `cost` units (clamped to
    /// `1..=per_client_units`). Keys must come from a bounded set (the configured identities):
    /// each key keeps a small entry and its own metric labels for the life of the layer.
    Client {
        /// The client, as authenticated.
        key: Arc<str>,
        /// What the request costs: 1 for a plain read, more for a page of heavy rows.
        cost: u32,
    },
    /// A request that names no client (no or a bad credential): all of them share one share,
    /// as if they were one client labelled [`UNKEYED_LABEL`].
    Unkeyed {
        /// What the request costs, as for [`Class::Client`].
        cost: u32,
    },
}

impl Class {
    /// A request of client `key` costing `cost` units.
    pub fn client(key: impl Into<Arc<str>>, cost: u32) -> Class {
        Class::Client {
            key: key.into(),
            cost,
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalReason {
    /// Its client already had `queue_depth` requests waiting.
    QueueFull,
    /// It waited `queue_wait` and no room came.
    QueueTimeout,
}

impl RefusalReason {
    /// The metric label: `queue_full` or `queue_timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::QueueFull => "queue_full",
            RefusalReason::QueueTimeout => "queue_timeout",
        }
    }
}

/// A request the fairness layer refused: whose, why, and when to come back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FairnessRefusal {
    /// The client; `None` for an unkeyed request.
    pub client: Option<Arc<str>>,
    /// Why.
    pub reason: RefusalReason,
    /// When the client may try again ([`FairnessConfig::retry_after`]).
    pub retry_after: Duration,
}

impl FairnessRefusal {
    /// The `Retry-After` header's value: whole seconds, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.retry_after.as_secs();
        let rounded_up = secs + u64::from(self.retry_after.subsec_nanos() > 0);
        rounded_up.max(1)
    }
}

/// One client's units, requests and waiters at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowSnapshot {
    /// The client; `None` for the unkeyed requests.
    pub client: Option<Arc<str>>,
    /// Units held by its requests in flight.
    pub units: u32,
    /// Its requests in flight.
    pub requests: u32,
    /// Its requests waiting.
    pub queued: u32,
}

/// The whole layer at one moment (taken under its lock: one consistent picture).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FairnessSnapshot {
    /// Exempt requests in flight (one unit each).
    pub exempt_in_flight: u32,
    /// Units held by clients and unkeyed requests together.
    pub client_units: u32,
    /// Every client seen so far, in no particular order.
    pub flows: Vec<FlowSnapshot>,
}

impl FairnessSnapshot {
    /// The client `key`'s entry, if it was ever seen.
    pub fn client(&self, key: &str) -> Option<&FlowSnapshot> {
        self.flows.iter().find(|f| f.client.as_deref() == Some(key))
    }

    /// Whether nothing is in flight or waiting.
    pub fn is_idle(&self) -> bool {
        self.exempt_in_flight == 0
            && self.client_units == 0
            && self
                .flows
                .iter()
                .all(|f| f.units == 0 && f.requests == 0 && f.queued == 0)
    }
}

/// Per-client fairness for a server's own work: a bounded number of units in flight per client,
/// a pool the clients share, a reserve for exempt requests, and a short FIFO queue per client
/// served round-robin across clients. Cheap to clone (one shared state).
///
/// Most embedders use it through [`super::FairnessLayer`]; [`Fairness::acquire`] serves work
/// that is not an HTTP request.
#[derive(Clone)]
pub struct Fairness {
    shared: Arc<Shared>,
}

struct Shared {
    config: FairnessConfig,
    state: Mutex<State>,
    metrics: Metrics,
}

#[derive(Default)]
struct State {
    flows: HashMap<Flow, FlowState>,
    /// Flows with waiters, in round-robin order; a flow is here exactly when its queue is not
    /// empty.
    ring: VecDeque<Flow>,
    /// Units held by clients and unkeyed requests.
    client_units: u32,
    /// Exempt requests in flight.
    exempt_in_flight: u32,
    /// Whether the first waiter in round-robin order that its own share admits is waiting for
    /// the shared pool: newcomers then queue behind it rather than take the room it waits for.
    pool_blocked: bool,
    next_waiter: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Flow {
    Client(Arc<str>),
    Unkeyed,
}

impl Flow {
    fn label(&self) -> &str {
        match self {
            Flow::Client(key) => key,
            Flow::Unkeyed => UNKEYED_LABEL,
        }
    }

    fn client(&self) -> Option<Arc<str>> {
        match self {
            Flow::Client(key) => Some(Arc::clone(key)),
            Flow::Unkeyed => None,
        }
    }
}

struct FlowState {
    units: u32,
    requests: u32,
    /// Its exempt requests in flight ([`Class::ExemptClient`]).
    exempt: u32,
    queue: VecDeque<Waiter>,
    gauges: FlowGauges,
}

struct Waiter {
    id: u64,
    cost: u32,
    granted: oneshot::Sender<()>,
}

/// One client's metric handles, looked up once when the client is first seen.
struct FlowGauges {
    requests: Gauge,
    units: Gauge,
    queued: Gauge,
}

type ClientLabels = [(&'static str, String); 1];
type RefusalLabels = [(&'static str, String); 2];

#[derive(Default)]
struct Metrics {
    requests: Family<ClientLabels, Gauge>,
    units: Family<ClientLabels, Gauge>,
    queued: Family<ClientLabels, Gauge>,
    rejected: Family<RefusalLabels, Counter>,
    exempt: Counter,
    exempt_in_flight: Gauge,
}

impl Fairness {
    /// A fairness scheduler with `config`, or why the numbers cannot work
    /// ([`FairnessConfig::problem`]).
    pub fn new(config: FairnessConfig) -> Result<Fairness, String> {
        if let Some(problem) = config.problem() {
            return Err(problem);
        }
        Ok(Fairness {
            shared: Arc::new(Shared {
                config,
                state: Mutex::new(State::default()),
                metrics: Metrics::default(),
            }),
        })
    }

    /// The numbers in force.
    pub fn config(&self) -> &FairnessConfig {
        &self.shared.config
    }

    /// Room for one request of `class`: at once if its client is under its share and the pool
    /// has room (exempt requests: always at once), else after waiting in its client's queue for at
    /// most [`FairnessConfig::queue_wait`], else a refusal. The units are held until the
    /// [`UnitsPermit`] drops.
    ///
    /// Cancel-safe: dropped while waiting, the request leaves its queue; dropped just as room was
    /// granted, the room goes back to the others.
    ///
    /// Waiting uses tokio's timer: call it inside a tokio runtime with time enabled (any runtime
    /// serving axum is one).
    pub async fn acquire(&self, class: Class) -> Result<UnitsPermit, FairnessRefusal> {
        match self.start(class) {
            Start::Now(permit) => Ok(permit),
            Start::Refused(refusal) => Err(refusal),
            Start::Wait(mut ticket) => {
                // Whether it was granted, timed out, or (impossibly) lost its sender, `finish`
                // reads the outcome under the lock: a grant racing the timeout is kept, not lost.
                let _ =
                    tokio::time::timeout(self.shared.config.queue_wait, &mut ticket.granted).await;
                ticket.finish()
            }
        }
    }

    /// Every client's units, requests and waiters now.
    pub fn snapshot(&self) -> FairnessSnapshot {
        let state = self.shared.lock();
        FairnessSnapshot {
            exempt_in_flight: state.exempt_in_flight,
            client_units: state.client_units,
            flows: state
                .flows
                .iter()
                .map(|(flow, f)| FlowSnapshot {
                    client: flow.client(),
                    units: f.units,
                    requests: f.requests,
                    queued: f.queue.len() as u32,
                })
                .collect(),
        }
    }

    /// Registers the layer's metrics in `registry`:
    ///
    /// - `broker_client_requests_in_flight{client}` and `broker_client_units_in_flight{client}`:
    ///   each client's requests holding units, and the units they hold;
    /// - `broker_client_requests_queued{client}`: requests waiting for room;
    /// - `broker_client_requests_rejected_total{client,reason}`: refused by this layer
    ///   (`queue_full`, `queue_timeout`);
    /// - `broker_exempt_requests_total` and `broker_exempt_requests_in_flight`.
    ///
    /// Unkeyed requests are labelled `client="-"` ([`UNKEYED_LABEL`]).
    pub fn register(&self, registry: &mut Registry) {
        let m = &self.shared.metrics;
        registry.register(
            "broker_client_requests_in_flight",
            "Requests of each client holding fairness units (until their response body ends).",
            m.requests.clone(),
        );
        registry.register(
            "broker_client_units_in_flight",
            "Fairness units held by each client's requests in flight.",
            m.units.clone(),
        );
        registry.register(
            "broker_client_requests_queued",
            "Requests of each client waiting for fairness units.",
            m.queued.clone(),
        );
        registry.register(
            "broker_client_requests_rejected",
            "Requests refused by the fairness layer (429), by client and reason: queue_full or \
             queue_timeout.",
            m.rejected.clone(),
        );
        registry.register(
            "broker_exempt_requests",
            "Exempt requests (health, readiness, cancel, decisions, metrics) let through without \
             waiting.",
            m.exempt.clone(),
        );
        registry.register(
            "broker_exempt_requests_in_flight",
            "Exempt requests in flight.",
            m.exempt_in_flight.clone(),
        );
    }

    fn start(&self, class: Class) -> Start {
        let shared = &self.shared;
        let exempt = |state: &mut State, flow: Option<Flow>| {
            state.exempt_in_flight += 1;
            shared.metrics.exempt.inc();
            shared
                .metrics
                .exempt_in_flight
                .set(i64::from(state.exempt_in_flight));
            Start::Now(UnitsPermit {
                shared: Arc::clone(shared),
                hold: Hold::Exempt(flow),
            })
        };
        let (flow, cost) = match class {
            Class::Exempt => return exempt(&mut shared.lock(), None),
            Class::ExemptClient { key } => {
                let flow = Flow::Client(key);
                let mut state = shared.lock();
                let f = shared.flow(&mut state.flows, &flow);
                if f.exempt < shared.config.per_client_units {
                    f.exempt += 1;
                    return exempt(&mut state, Some(flow));
                }
                (flow, 1)
            }
            Class::Client { key, cost } => (Flow::Client(key), cost),
            Class::Unkeyed { cost } => (Flow::Unkeyed, cost),
        };
        let cost = cost.clamp(1, shared.config.per_client_units);
        let mut guard = shared.lock();
        let state = &mut *guard;
        let room = shared.pool_room(state);
        let blocked = state.pool_blocked;
        let f = shared.flow(&mut state.flows, &flow);
        let fits = f.units + cost <= shared.config.per_client_units && cost <= room;
        if f.queue.is_empty() && !blocked && fits {
            f.units += cost;
            f.requests += 1;
            f.publish();
            state.client_units += cost;
            return Start::Now(UnitsPermit {
                shared: Arc::clone(shared),
                hold: Hold::Client { flow, cost },
            });
        }
        if f.queue.len() >= shared.config.queue_depth as usize {
            drop(guard);
            return Start::Refused(shared.refuse(&flow, RefusalReason::QueueFull));
        }
        let id = state.next_waiter;
        state.next_waiter += 1;
        let (granted, wait) = oneshot::channel();
        let was_idle = f.queue.is_empty();
        f.queue.push_back(Waiter { id, cost, granted });
        f.publish();
        if was_idle {
            state.ring.push_back(flow.clone());
        }
        // It may fit now (room came while it was being queued behind nobody but a blocked pool).
        shared.dispatch(state);
        drop(guard);
        Start::Wait(Ticket {
            shared: Arc::clone(shared),
            flow,
            id,
            cost,
            granted: wait,
            done: false,
        })
    }
}

enum Start {
    Now(UnitsPermit),
    Wait(Ticket),
    Refused(FairnessRefusal),
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The pool's free units: clients may hold the total less the larger of the exempt reserve
    /// and what exempt requests hold now (they borrow past their reserve from the pool).
    fn pool_room(&self, state: &State) -> u32 {
        let exempt = state
            .exempt_in_flight
            .max(self.config.exempt_reserved_units);
        self.config
            .total_units
            .saturating_sub(exempt)
            .saturating_sub(state.client_units)
    }

    fn flow<'a>(&self, flows: &'a mut HashMap<Flow, FlowState>, flow: &Flow) -> &'a mut FlowState {
        flows.entry(flow.clone()).or_insert_with(|| {
            let label = [("client", flow.label().to_owned())];
            FlowState {
                units: 0,
                requests: 0,
                exempt: 0,
                queue: VecDeque::new(),
                gauges: FlowGauges {
                    requests: self.metrics.requests.get_or_create(&label).clone(),
                    units: self.metrics.units.get_or_create(&label).clone(),
                    queued: self.metrics.queued.get_or_create(&label).clone(),
                },
            }
        })
    }

    fn refuse(&self, flow: &Flow, reason: RefusalReason) -> FairnessRefusal {
        self.metrics
            .rejected
            .get_or_create(&[
                ("client", flow.label().to_owned()),
                ("reason", reason.as_str().to_owned()),
            ])
            .inc();
        FairnessRefusal {
            client: flow.client(),
            reason,
            retry_after: self.config.retry_after,
        }
    }

    /// Grants room to waiters, one per client per round, until the first waiter its own share
    /// admits finds the pool too small (it keeps its place: nobody behind it takes that room), or
    /// no waiter fits. Called after every change that can make room or move a queue.
    fn dispatch(&self, state: &mut State) {
        state.pool_blocked = false;
        let mut skipped = 0;
        while skipped < state.ring.len() {
            let Some(flow) = state.ring.front().cloned() else {
                break;
            };
            let room = self.pool_room(state);
            let Some(f) = state.flows.get_mut(&flow) else {
                // Unreachable: a flow in the ring has an entry. Dropped rather than spun on.
                state.ring.pop_front();
                continue;
            };
            let Some(cost) = f.queue.front().map(|w| w.cost) else {
                state.ring.pop_front();
                continue;
            };
            if f.units + cost > self.config.per_client_units {
                // Waiting for its own requests to end: the others go first.
                state.ring.rotate_left(1);
                skipped += 1;
                continue;
            }
            if cost > room {
                state.pool_blocked = true;
                break;
            }
            let Some(waiter) = f.queue.pop_front() else {
                continue;
            };
            f.units += cost;
            f.requests += 1;
            f.publish();
            state.client_units += cost;
            // The receiver lives as long as its ticket, and a dropped ticket leaves the queue
            // first (under this lock), so the send reaches a live waiter.
            let _ = waiter.granted.send(());
            state.ring.pop_front();
            if !f.queue.is_empty() {
                state.ring.push_back(flow);
            }
            skipped = 0;
        }
    }

    fn release(&self, hold: &Hold) {
        let mut guard = self.lock();
        let state = &mut *guard;
        match hold {
            Hold::Exempt(flow) => {
                state.exempt_in_flight -= 1;
                self.metrics
                    .exempt_in_flight
                    .set(i64::from(state.exempt_in_flight));
                if let Some(f) = flow.as_ref().and_then(|flow| state.flows.get_mut(flow)) {
                    f.exempt -= 1;
                }
            }
            Hold::Client { flow, cost } => {
                state.client_units -= cost;
                if let Some(f) = state.flows.get_mut(flow) {
                    f.units -= cost;
                    f.requests -= 1;
                    f.publish();
                }
            }
        }
        self.dispatch(state);
    }
}

impl FlowState {
    fn publish(&self) {
        self.gauges.requests.set(i64::from(self.requests));
        self.gauges.units.set(i64::from(self.units));
        self.gauges.queued.set(self.queue.len() as i64);
    }
}

/// Units held by one request, given back to the others when dropped.
#[must_use = "the units are given back as soon as the permit drops"]
pub struct UnitsPermit {
    shared: Arc<Shared>,
    hold: Hold,
}

impl std::fmt::Debug for UnitsPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitsPermit")
            .field("hold", &self.hold)
            .finish()
    }
}

#[derive(Debug)]
enum Hold {
    /// An exempt request; its client's, for [`Class::ExemptClient`].
    Exempt(Option<Flow>),
    Client {
        flow: Flow,
        cost: u32,
    },
}

impl UnitsPermit {
    /// The units held: 1 for an exempt request, else the request's clamped cost.
    pub fn units(&self) -> u32 {
        match &self.hold {
            Hold::Exempt(_) => 1,
            Hold::Client { cost, .. } => *cost,
        }
    }
}

impl Drop for UnitsPermit {
    fn drop(&mut self) {
        self.shared.release(&self.hold);
    }
}

/// A request waiting in its client's queue.
struct Ticket {
    shared: Arc<Shared>,
    flow: Flow,
    id: u64,
    cost: u32,
    granted: oneshot::Receiver<()>,
    /// Set once [`Ticket::finish`] has settled the outcome, so the drop does nothing more.
    done: bool,
}

impl Ticket {
    /// The outcome, read under the lock: still queued means no room came (it leaves the queue
    /// and is refused); gone from the queue means it was granted.
    fn finish(&mut self) -> Result<UnitsPermit, FairnessRefusal> {
        self.done = true;
        if self.leave() {
            return Err(self.shared.refuse(&self.flow, RefusalReason::QueueTimeout));
        }
        Ok(UnitsPermit {
            shared: Arc::clone(&self.shared),
            hold: Hold::Client {
                flow: self.flow.clone(),
                cost: self.cost,
            },
        })
    }

    /// Takes the waiter out of its queue if it is still there; whether it was. Not there means
    /// it was granted: its cost is already counted in its client's units.
    fn leave(&self) -> bool {
        let shared = &self.shared;
        let mut guard = shared.lock();
        let state = &mut *guard;
        let Some(f) = state.flows.get_mut(&self.flow) else {
            return false;
        };
        let Some(at) = f.queue.iter().position(|w| w.id == self.id) else {
            return false;
        };
        f.queue.remove(at);
        f.publish();
        if f.queue.is_empty() {
            state.ring.retain(|queued| *queued != self.flow);
        }
        // Its leaving may unblock the pool for the waiters behind it.
        shared.dispatch(state);
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Dropped while waiting (the request's future was dropped): leave the queue, or give back
        // the room granted meanwhile. Runs before `granted` drops, so no grant is sent after.
        if !self.done && !self.leave() {
            self.shared.release(&Hold::Client {
                flow: self.flow.clone(),
                cost: self.cost,
            });
        }
    }
}
