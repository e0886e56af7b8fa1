//! Random operation sequences against a plain sequential model of SPEC section 2. The model keeps
//! its rate state as "credit" (nanoseconds of refill banked, capped at the burst span) rather than
//! the engine's theoretical arrival time, so it is an independent statement of the same contract.
//! Clock steps back are part of the sequences: the model says they change nothing at all.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use unyolo_admission::{
    ClientLimits, Config, Controller, Identity, Limits, ManualClock, Operation, OperationState,
    Permit, RefusalCode, StorageCaps,
};

const SEC: u64 = 1_000_000_000;
const HINT: u64 = 2 * SEC;
const CLIENTS: [&str; 2] = ["a", "b"];
const GA: u64 = 4;
const GE: u64 = 2;
const GRANTS: u64 = 3;

fn client_limits(i: usize) -> ClientLimits {
    [
        ClientLimits {
            requests_per_window: 3,
            window_seconds: 2,
            active: 3,
            pending: 2,
        },
        ClientLimits {
            requests_per_window: 2,
            window_seconds: 1,
            active: 2,
            pending: 1,
        },
    ][i]
}

#[derive(Clone, Debug)]
enum Op {
    Admit { client: usize, approval: bool },
    Commit(usize),
    DropPermit(usize),
    Refund(usize),
    Approve(usize),
    Deny(usize),
    Cancel(usize),
    Start(usize),
    Succeed(usize),
    Fail(usize),
    Expire(usize),
    DropOperation(usize),
    Advance(u64),
    Rewind(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, any::<bool>()).prop_map(|(client, approval)| Op::Admit { client, approval }),
        3 => any::<usize>().prop_map(Op::Commit),
        1 => any::<usize>().prop_map(Op::DropPermit),
        1 => any::<usize>().prop_map(Op::Refund),
        2 => any::<usize>().prop_map(Op::Approve),
        1 => any::<usize>().prop_map(Op::Deny),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => any::<usize>().prop_map(Op::Start),
        2 => any::<usize>().prop_map(Op::Succeed),
        1 => any::<usize>().prop_map(Op::Fail),
        1 => any::<usize>().prop_map(Op::Expire),
        1 => any::<usize>().prop_map(Op::DropOperation),
        2 => (1..3_000u64).prop_map(Op::Advance),
        1 => (1..5_000_000u64).prop_map(Op::Rewind),
    ]
}

#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct Counts {
    active: u64,
    pending: u64,
    queued: u64,
    executing: u64,
}

struct ModelClient {
    credit: u64,
    interval: u64,
    span: u64,
    active_limit: u64,
    pending_limit: u64,
    counts: Counts,
}

struct Model {
    clients: Vec<ModelClient>,
    global: Counts,
    permits: Vec<(usize, bool)>,
    ops: Vec<(usize, OperationState)>,
}

impl Model {
    fn new() -> Model {
        let clients = (0..2)
            .map(|i| {
                let l = client_limits(i);
                let interval = u64::from(l.window_seconds) * SEC / u64::from(l.requests_per_window);
                let span = interval * u64::from(l.requests_per_window);
                ModelClient {
                    credit: span,
                    interval,
                    span,
                    active_limit: u64::from(l.active),
                    pending_limit: u64::from(l.pending),
                    counts: Counts::default(),
                }
            })
            .collect();
        Model {
            clients,
            global: Counts::default(),
            permits: vec![],
            ops: vec![],
        }
    }

    fn advance_by(&mut self, elapsed: u64) {
        for c in &mut self.clients {
            c.credit = (c.credit + elapsed).min(c.span);
        }
    }

    fn capacity_exhausted(&self, i: usize, approval: bool) -> bool {
        let c = &self.clients[i];
        c.counts.active >= c.active_limit
            || (approval
                && (c.counts.pending >= c.pending_limit.min(10) || self.global.pending >= GRANTS))
            || self.global.active >= GA
            || self.global.executing >= GE
    }

    fn admit(&mut self, i: usize, approval: bool) -> Result<(), (RefusalCode, u64)> {
        let code = {
            let c = &self.clients[i];
            if c.credit < c.interval {
                Some(RefusalCode::SubmissionRateLimited)
            } else if c.counts.active >= c.active_limit {
                Some(RefusalCode::ClientOperationLimit)
            } else if approval && c.counts.pending >= c.pending_limit {
                Some(RefusalCode::ClientPendingLimit)
            } else if approval && (c.counts.pending >= 10 || self.global.pending >= GRANTS) {
                Some(RefusalCode::PendingGrantLimit)
            } else if self.global.active >= GA {
                Some(RefusalCode::GlobalOperationLimit)
            } else if self.global.executing >= GE {
                Some(RefusalCode::GlobalExecutionLimit)
            } else {
                None
            }
        };
        if let Some(code) = code {
            let c = &self.clients[i];
            let rate_wait = c.interval.saturating_sub(c.credit);
            let cap = if self.capacity_exhausted(i, approval) {
                HINT
            } else {
                0
            };
            let secs = rate_wait.max(cap).div_ceil(SEC).max(1);
            return Err((code, secs));
        }
        let c = &mut self.clients[i];
        c.credit -= c.interval;
        c.counts.active += 1;
        self.global.active += 1;
        if approval {
            c.counts.pending += 1;
            self.global.pending += 1;
        } else {
            // Admitted work that needs no approval is queued from the start.
            c.counts.queued += 1;
            self.global.queued += 1;
        }
        self.permits.push((i, approval));
        Ok(())
    }

    fn release_permit(&mut self, k: usize, refund: bool) {
        let (i, approval) = self.permits.remove(k);
        let c = &mut self.clients[i];
        c.counts.active -= 1;
        self.global.active -= 1;
        if approval {
            c.counts.pending -= 1;
            self.global.pending -= 1;
        } else {
            c.counts.queued -= 1;
            self.global.queued -= 1;
        }
        if refund {
            c.credit = (c.credit + c.interval).min(c.span);
        }
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

    /// Applies a transition if the contract allows it; returns whether it did.
    fn transition(&mut self, k: usize, to: OperationState) -> bool {
        let (i, from) = self.ops[k];
        if to == OperationState::Executing
            && (from != OperationState::Approved || self.global.executing >= GE)
        {
            return false;
        }
        if !from.can_move_to(to) {
            return false;
        }
        let c = &mut self.clients[i].counts;
        let g = &mut self.global;
        match from {
            OperationState::Pending => {
                c.pending -= 1;
                g.pending -= 1;
            }
            OperationState::Approved => {
                c.queued -= 1;
                g.queued -= 1;
            }
            OperationState::Executing => {
                c.executing -= 1;
                g.executing -= 1;
            }
            _ => unreachable!(),
        }
        match to {
            OperationState::Approved => {
                c.queued += 1;
                g.queued += 1;
            }
            OperationState::Executing => {
                c.executing += 1;
                g.executing += 1;
            }
            _ => {
                c.active -= 1;
                g.active -= 1;
            }
        }
        self.ops[k].1 = to;
        true
    }
}

fn engine() -> (Controller, ManualClock) {
    let id = |n: &str| Identity::new(n).unwrap();
    let limits = Limits {
        client_active: 3,
        client_pending: 2,
        global_active: GA as u32,
        global_executing: GE as u32,
        ..Limits::DEFAULT
    };
    let overrides: BTreeMap<_, _> = CLIENTS
        .iter()
        .enumerate()
        .map(|(i, n)| (id(n), client_limits(i)))
        .collect();
    let config = Config::new(limits, overrides, CLIENTS.iter().map(|n| id(n))).unwrap();
    let clock = ManualClock::new();
    clock.set_nanos(0);
    let caps = StorageCaps {
        grant_global: GRANTS,
        ..StorageCaps::default()
    };
    (
        Controller::builder(config)
            .clock(clock.clone())
            .storage_caps(caps)
            .build(),
        clock,
    )
}

fn compare(engine: &Controller, model: &Model) {
    let s = engine.snapshot();
    let g = Counts {
        active: s.active,
        pending: s.pending,
        queued: s.queued,
        executing: s.executing,
    };
    assert_eq!(g, model.global, "global counts");
    for (i, name) in CLIENTS.iter().enumerate() {
        let c = s.client(name).unwrap();
        let m = &model.clients[i];
        assert_eq!(
            Counts {
                active: c.active,
                pending: c.pending,
                queued: c.queued,
                executing: c.executing
            },
            m.counts,
            "client {name}"
        );
        assert_eq!(c.tokens, m.credit / m.interval, "tokens of {name}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_the_sequential_model(ops in proptest::collection::vec(op(), 1..120)) {
        let (engine, clock) = engine();
        let mut model = Model::new();
        let mut permits: Vec<Permit> = Vec::new();
        let mut handles: Vec<Option<Operation>> = Vec::new();
        let mut raw: u64 = 0;
        for op in ops {
            match op {
                Op::Admit { client, approval } => {
                    let got = engine.admit(CLIENTS[client], approval);
                    let want = model.admit(client, approval);
                    match (got, want) {
                        (Ok(p), Ok(())) => permits.push(p),
                        (Err(r), Err((code, secs))) => {
                            prop_assert_eq!(r.code, code);
                            prop_assert_eq!(r.retry_after, Duration::from_secs(secs));
                        }
                        (got, want) => prop_assert!(false, "engine {:?} vs model {:?}", got.map(|_| ()), want),
                    }
                }
                Op::Commit(k) | Op::DropPermit(k) | Op::Refund(k) if !permits.is_empty() => {
                    let k = k % permits.len();
                    let p = permits.remove(k);
                    match op {
                        Op::Commit(_) => { handles.push(Some(p.commit())); model.commit(k); }
                        Op::DropPermit(_) => { drop(p); model.release_permit(k, false); }
                        _ => { p.refund(); model.release_permit(k, true); }
                    }
                }
                Op::DropOperation(k) if !handles.is_empty() => {
                    let k = k % handles.len();
                    if let Some(h) = handles[k].take() {
                        drop(h);
                        model.transition(k, OperationState::Failed);
                    }
                }
                Op::Approve(k) | Op::Deny(k) | Op::Cancel(k) | Op::Start(k) | Op::Succeed(k) | Op::Fail(k) | Op::Expire(k)
                    if !handles.is_empty() =>
                {
                    let k = k % handles.len();
                    let Some(h) = &handles[k] else { continue };
                    let (got, to) = match op {
                        Op::Approve(_) => (h.approve().is_ok(), OperationState::Approved),
                        Op::Deny(_) => (h.deny().is_ok(), OperationState::Denied),
                        Op::Cancel(_) => (h.cancel().is_ok_and(|outcome| outcome.changed()), OperationState::Canceled),
                        Op::Start(_) => (h.try_start().is_ok(), OperationState::Executing),
                        Op::Succeed(_) => (h.succeed().is_ok(), OperationState::Succeeded),
                        Op::Fail(_) => (h.fail().is_ok(), OperationState::Failed),
                        _ => (h.expire().is_ok(), OperationState::Expired),
                    };
                    prop_assert_eq!(got, model.transition(k, to), "transition to {:?}", to);
                    prop_assert_eq!(h.state(), model.ops[k].1);
                }
                Op::Advance(ms) => {
                    raw += ms * 1_000_000;
                    clock.set_nanos(raw);
                    model.advance_by(ms * 1_000_000);
                }
                Op::Rewind(ms) => {
                    // A backward step is absorbed: engine time stands still, then flows on.
                    raw = raw.saturating_sub(ms * 1_000_000);
                    clock.set_nanos(raw);
                }
                _ => {}
            }
            compare(&engine, &model);
        }
        drop(permits);
        drop(handles);
        prop_assert!(engine.snapshot().is_idle());
    }
}
