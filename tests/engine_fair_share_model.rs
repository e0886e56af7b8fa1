//! Random sequences of admissions, commits, drops, refunds, transitions, starts and reloads that
//! turn a fair share on, change it and turn it off, against a plain sequential model of SPEC
//! section 11: after every step the engine's counts, each pool's holders, its answers (code and
//! Retry-After) and its fair-share refusals by pool and reason equal the model's.
//!
//! The model states the rule as the contract words it, independently of the engine's
//! arithmetic: the last `reserve` slots of a pool only for clients holding fewer than `floor`;
//! above the floor, room in the shared part and fewer than the share, the shared part divided
//! among the holders (this client among them), rounded up. Time and rate are left out (every
//! client has tokens to spare); `engine_model.rs` covers them.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use unyolo_admission::config::Pool;
use unyolo_admission::{
    ClientLimits, Config, Controller, FairShare, FairShareReason, FairShareRefusal, Identity,
    Limits, Operation, OperationState, Permit, PoolShare, RefusalCode, StorageCaps,
};

const CLIENTS: [&str; 3] = ["a", "b", "c"];
const GA: u64 = 7;
const GE: u64 = 4;
const GRANTS: u64 = 4;
const HINT: Duration = Duration::from_secs(2);

/// The fair shares a reload may put in force: none, a reserve of one with a floor of one, and a
/// larger reserve with a floor of two.
fn fair_shares() -> [Option<FairShare>; 3] {
    let pool = |reserve, floor| PoolShare { reserve, floor };
    [
        None,
        Some(FairShare {
            active: pool(1, 1),
            executing: pool(1, 1),
        }),
        Some(FairShare {
            active: pool(3, 2),
            executing: pool(2, 2),
        }),
    ]
}

/// Client `i`'s active and pending limits: `a` may hold the whole active pool.
fn client_limits(i: usize) -> (u64, u64) {
    [(7, 3), (5, 2), (3, 3)][i]
}

fn config(share: usize) -> Config {
    let id = |n: &str| Identity::new(n).unwrap();
    let limits = Limits {
        requests_per_window: 1_000_000,
        window_seconds: 1,
        client_active: 3,
        client_pending: 3,
        global_active: GA as u32,
        global_executing: GE as u32,
    };
    let overrides: BTreeMap<Identity, ClientLimits> = CLIENTS
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let (active, pending) = client_limits(i);
            let limits = ClientLimits {
                requests_per_window: 1_000_000,
                window_seconds: 1,
                active: active as u32,
                pending: pending as u32,
            };
            (id(n), limits)
        })
        .collect();
    Config::new(limits, overrides, CLIENTS.map(id))
        .unwrap()
        .with_fair_share(fair_shares()[share])
        .unwrap()
}

#[derive(Clone, Debug)]
enum Op {
    Admit { client: usize, approval: bool },
    Commit(usize),
    DropPermit(usize),
    Refund(usize),
    Approve(usize),
    Start(usize),
    Succeed(usize),
    Fail(usize),
    Cancel(usize),
    DropOperation(usize),
    Reload(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, any::<bool>()).prop_map(|(client, approval)| Op::Admit { client, approval }),
        4 => any::<usize>().prop_map(Op::Commit),
        1 => any::<usize>().prop_map(Op::DropPermit),
        1 => any::<usize>().prop_map(Op::Refund),
        3 => any::<usize>().prop_map(Op::Approve),
        4 => any::<usize>().prop_map(Op::Start),
        2 => any::<usize>().prop_map(Op::Succeed),
        1 => any::<usize>().prop_map(Op::Fail),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::DropOperation),
        1 => (0..3usize).prop_map(Op::Reload),
    ]
}

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
struct Counts {
    active: u64,
    pending: u64,
    executing: u64,
}

/// The model: each client's counts, the permits and operations, the fair share in force.
struct Model {
    clients: [Counts; 3],
    permits: Vec<(usize, bool)>,
    ops: Vec<(usize, OperationState)>,
    share: Option<FairShare>,
    fair_refusals: [u64; 4],
}

/// Whether a pool of `limit` with `rule` gives one more slot to a client holding `held`, `used`
/// taken by the clients holding `holding` each: `Err(None)` when the pool is full, the fair
/// share's reason when it refuses.
fn pool_admits(
    limit: u64,
    rule: Option<PoolShare>,
    holding: &[u64],
    held: u64,
) -> Result<(), Option<FairShareReason>> {
    let used: u64 = holding.iter().sum();
    if used >= limit {
        return Err(None);
    }
    let Some(rule) = rule else { return Ok(()) };
    if held < u64::from(rule.floor) {
        return Ok(());
    }
    let shared = limit - u64::from(rule.reserve);
    if used >= shared {
        return Err(Some(FairShareReason::Reserve));
    }
    // The holders with this client among them.
    let holders = holding.iter().filter(|&&n| n > 0).count() as u64 + u64::from(held == 0);
    let share = shared.div_ceil(holders);
    if held >= share {
        return Err(Some(FairShareReason::Share));
    }
    Ok(())
}

impl Model {
    fn global(&self) -> Counts {
        self.clients.iter().fold(Counts::default(), |g, c| Counts {
            active: g.active + c.active,
            pending: g.pending + c.pending,
            executing: g.executing + c.executing,
        })
    }

    fn holders(&self) -> (u64, u64) {
        let count = |f: fn(&Counts) -> u64| self.clients.iter().filter(|c| f(c) > 0).count();
        (count(|c| c.active) as u64, count(|c| c.executing) as u64)
    }

    fn rule(&self, pool: Pool) -> Option<PoolShare> {
        self.share.map(|share| share.pool(pool))
    }

    fn refuse(&mut self, pool: Pool, reason: Option<FairShareReason>) -> RefusalCode {
        if let Some(reason) = reason {
            self.fair_refusals[FairShareRefusal::new(pool, reason).index()] += 1;
        }
        match pool {
            Pool::Active => RefusalCode::GlobalOperationLimit,
            Pool::Executing => RefusalCode::GlobalExecutionLimit,
        }
    }

    fn admit(&mut self, i: usize, approval: bool) -> Result<(), RefusalCode> {
        let g = self.global();
        let c = self.clients[i];
        let (active_limit, pending_limit) = client_limits(i);
        if c.active >= active_limit {
            return Err(RefusalCode::ClientOperationLimit);
        }
        if approval && c.pending >= pending_limit {
            return Err(RefusalCode::ClientPendingLimit);
        }
        if approval && g.pending >= GRANTS {
            return Err(RefusalCode::PendingGrantLimit);
        }
        let actives = self.clients.map(|c| c.active);
        if let Err(reason) = pool_admits(GA, self.rule(Pool::Active), &actives, c.active) {
            return Err(self.refuse(Pool::Active, reason));
        }
        let executing = self.clients.map(|c| c.executing);
        let rule = self.rule(Pool::Executing);
        if let Err(reason) = pool_admits(GE, rule, &executing, c.executing) {
            return Err(self.refuse(Pool::Executing, reason));
        }
        self.clients[i].active += 1;
        self.clients[i].pending += u64::from(approval);
        self.permits.push((i, approval));
        Ok(())
    }

    fn release_permit(&mut self, k: usize) {
        let (i, approval) = self.permits.remove(k);
        self.clients[i].active -= 1;
        self.clients[i].pending -= u64::from(approval);
    }

    fn commit(&mut self, k: usize) {
        let (i, approval) = self.permits.remove(k);
        let state = if approval {
            OperationState::Pending
        } else {
            OperationState::Approved
        };
        self.ops.push((i, state));
    }

    /// Applies a transition if the contract (and, for a start, the execution pool) allows it.
    fn transition(&mut self, k: usize, to: OperationState) -> bool {
        let (i, from) = self.ops[k];
        if !from.can_move_to(to) {
            return false;
        }
        if to == OperationState::Executing {
            let executing = self.clients.map(|c| c.executing);
            let rule = self.rule(Pool::Executing);
            if pool_admits(GE, rule, &executing, self.clients[i].executing).is_err() {
                return false;
            }
        }
        let c = &mut self.clients[i];
        match from {
            OperationState::Pending => c.pending -= 1,
            OperationState::Executing => c.executing -= 1,
            _ => {}
        }
        match to {
            OperationState::Executing => c.executing += 1,
            OperationState::Approved => {}
            _ => c.active -= 1,
        }
        self.ops[k].1 = to;
        true
    }
}

fn engine() -> Controller {
    let caps = StorageCaps {
        grant_global: GRANTS,
        ..StorageCaps::default()
    };
    Controller::builder(config(0)).storage_caps(caps).build()
}

fn compare(engine: &Controller, model: &Model) -> Result<(), TestCaseError> {
    let s = engine.snapshot();
    let g = model.global();
    prop_assert_eq!(
        (s.active, s.pending, s.executing),
        (g.active, g.pending, g.executing),
        "global counts"
    );
    prop_assert_eq!(
        (s.active_holders, s.executing_holders),
        model.holders(),
        "holders"
    );
    for (i, name) in CLIENTS.iter().enumerate() {
        let c = s.client(name).unwrap();
        let m = model.clients[i];
        prop_assert_eq!(
            (c.active, c.pending, c.executing),
            (m.active, m.pending, m.executing),
            "client {}",
            name
        );
    }
    prop_assert_eq!(
        s.fair_share_refusals,
        model.fair_refusals,
        "fair-share refusals"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn with_a_fair_share_the_engine_matches_the_sequential_model(
        ops in proptest::collection::vec(op(), 1..150)
    ) {
        let engine = engine();
        let mut model = Model {
            clients: [Counts::default(); 3],
            permits: Vec::new(),
            ops: Vec::new(),
            share: None,
            fair_refusals: [0; 4],
        };
        let mut permits: Vec<Permit> = Vec::new();
        let mut handles: Vec<Option<Operation>> = Vec::new();
        for op in ops {
            match op {
                Op::Admit { client, approval } => {
                    let got = engine.admit(CLIENTS[client], approval);
                    match (got, model.admit(client, approval)) {
                        (Ok(p), Ok(())) => permits.push(p),
                        (Err(r), Err(code)) => {
                            prop_assert_eq!(r.code, code);
                            prop_assert_eq!(r.retry_after, HINT);
                        }
                        (got, want) => prop_assert!(
                            false,
                            "engine {:?} vs model {:?}",
                            got.map(|_| ()),
                            want
                        ),
                    }
                }
                Op::Commit(k) | Op::DropPermit(k) | Op::Refund(k) if !permits.is_empty() => {
                    let k = k % permits.len();
                    let p = permits.remove(k);
                    match op {
                        Op::Commit(_) => {
                            handles.push(Some(p.commit()));
                            model.commit(k);
                        }
                        Op::DropPermit(_) => {
                            drop(p);
                            model.release_permit(k);
                        }
                        _ => {
                            p.refund();
                            model.release_permit(k);
                        }
                    }
                }
                Op::DropOperation(k) if !handles.is_empty() => {
                    let k = k % handles.len();
                    if let Some(h) = handles[k].take() {
                        drop(h);
                        model.transition(k, OperationState::Failed);
                    }
                }
                Op::Approve(k) | Op::Start(k) | Op::Succeed(k) | Op::Fail(k) | Op::Cancel(k)
                    if !handles.is_empty() =>
                {
                    let k = k % handles.len();
                    let Some(h) = &handles[k] else { continue };
                    let (got, to) = match op {
                        Op::Approve(_) => (h.approve().is_ok(), OperationState::Approved),
                        Op::Start(_) => (h.try_start().is_ok(), OperationState::Executing),
                        Op::Succeed(_) => (h.succeed().is_ok(), OperationState::Succeeded),
                        Op::Fail(_) => (h.fail().is_ok(), OperationState::Failed),
                        _ => (
                            h.cancel().is_ok_and(|outcome| outcome.changed()),
                            OperationState::Canceled,
                        ),
                    };
                    prop_assert_eq!(got, model.transition(k, to), "transition to {:?}", to);
                    prop_assert_eq!(h.state(), model.ops[k].1);
                }
                Op::Reload(share) => {
                    engine.reload(config(share));
                    model.share = fair_shares()[share];
                }
                _ => {}
            }
            compare(&engine, &model)?;
        }
        drop(permits);
        drop(handles);
        let s = engine.snapshot();
        prop_assert!(s.is_idle(), "{:?}", s);
        prop_assert_eq!((s.active_holders, s.executing_holders), (0, 0));
    }
}
