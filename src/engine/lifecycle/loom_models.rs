//! The lifecycle transitions that race in a broker: the executor starting an operation while
//! its client cancels or it expires, a finish right behind a start, two terminal calls at
//! once, a cancel racing an operator's approval. Each model runs the real `Operation` over a
//! real controller and checks every count, per client and global, once the threads are done.
//!
//! A file of its own, beside `lifecycle.rs`, because the models need a controller to make their
//! operations, and the controller is built on the lifecycle: from here imports run one way.

use super::*;
use crate::clock::ManualClock;
use crate::config::Config;
use crate::engine::controller::Controller;
use loom::sync::Arc;
use loom::thread;

/// A controller with one client, `a`, and one operation of it committed in `state`.
fn one_operation(state: OperationState) -> (Controller, Arc<Operation>) {
    let c = Controller::builder(Config::defaults([Identity::new("a").unwrap()]))
        .clock(ManualClock::new())
        .build();
    let permit = c
        .admit("a", state == OperationState::Pending)
        .expect("an idle client is admitted");
    let op = permit.commit();
    assert_eq!(op.state(), state);
    (c, Arc::new(op))
}

/// Every count, per client and global, matches one operation in `state` (none if terminal).
fn assert_counts(c: &Controller, state: OperationState) {
    let s = c.snapshot();
    let client = &s.clients[0];
    let live = u64::from(!state.is_terminal());
    let pending = u64::from(state == OperationState::Pending);
    let queued = u64::from(state == OperationState::Approved);
    let executing = u64::from(state == OperationState::Executing);
    assert_eq!(
        (
            client.active,
            client.pending,
            client.queued,
            client.executing
        ),
        (live, pending, queued, executing),
        "client counts for a {state} operation"
    );
    assert_eq!(
        (s.active, s.pending, s.queued, s.executing),
        (live, pending, queued, executing),
        "global counts for a {state} operation"
    );
    assert_eq!(
        (s.active_holders, s.executing_holders),
        (live, executing),
        "the pools' holders for a {state} operation"
    );
}

/// The executor starts an approved operation while the operation is finished from elsewhere
/// (succeed if it already runs, else fail): the finish can land between the start's state
/// change and its count, and the client must not be left executing with nothing active.
#[test]
fn loom_start_racing_a_finish_leaves_every_count_right() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Approved);
        let finisher = {
            let op = op.clone();
            thread::spawn(move || {
                if op.succeed().is_err() {
                    op.fail().expect("an operation not yet executing can fail");
                }
            })
        };
        let started = op.try_start().is_ok();
        finisher.join().unwrap();
        let end = op.state();
        assert!(end.is_terminal());
        assert!(started || end == OperationState::Failed);
        assert_counts(&c, end);
    });
}

/// A replica's start gives its local slot back (`unstart`: the shared pool refused) while the
/// operation fails from elsewhere: whichever wins, the execution slot is released exactly
/// once and the counts end as the final state says (queued again, or nothing held).
#[test]
fn loom_unstart_racing_a_failure_releases_the_execution_once() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Approved);
        op.try_start().expect("an idle pool has a slot");
        let failer = {
            let op = op.clone();
            thread::spawn(move || op.fail().is_ok())
        };
        let unstarted = op.unstart();
        let failed = failer.join().unwrap();
        let end = op.state();
        assert!(failed, "an executing or approved operation can always fail");
        assert_eq!(end, OperationState::Failed);
        // Had the unstart won first, the failure then moved approved → failed; either way
        // nothing is held at the end.
        let _ = unstarted;
        assert_counts(&c, end);
    });
}

/// A start racing a cancel and an expiry: at most one of the two terminal calls wins, the
/// start either wins first or leaves no execution slot behind, and an operation that did
/// start finishes with every count at zero.
#[test]
fn loom_start_racing_cancel_and_expiry_leaves_every_count_right() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Approved);
        let canceler = {
            let op = op.clone();
            thread::spawn(move || op.cancel())
        };
        let started = op.try_start().is_ok();
        let expired = op.expire().is_ok();
        let canceled = canceler.join().unwrap();
        let end = op.state();
        let cancel_won = canceled
            == Ok(CancelOutcome::Canceled {
                from: OperationState::Approved,
            });
        assert_eq!(
            u8::from(started) + u8::from(expired) + u8::from(cancel_won),
            1,
            "exactly one call moves an approved operation on"
        );
        if started {
            assert!(
                canceled.is_err(),
                "an executing operation cannot be canceled"
            );
        }
        if expired {
            assert_eq!(
                canceled,
                Ok(CancelOutcome::AlreadyTerminal(OperationState::Expired))
            );
        }
        assert_counts(&c, end);
        if started {
            assert_eq!(end, OperationState::Executing);
            op.succeed().unwrap();
        }
        assert_counts(&c, op.state());
        assert!(c.snapshot().is_idle());
    });
}

/// Two terminal calls at once (an operator's deny and the client's cancel): exactly one
/// wins, and the slots are released once.
#[test]
fn loom_double_terminal_transition_releases_once() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Pending);
        let denier = {
            let op = op.clone();
            thread::spawn(move || op.deny().is_ok())
        };
        let canceled = op.cancel();
        let denied = denier.join().unwrap();
        match canceled {
            Ok(CancelOutcome::Canceled {
                from: OperationState::Pending,
            }) => assert!(!denied),
            Ok(CancelOutcome::AlreadyTerminal(OperationState::Denied)) => assert!(denied),
            other => panic!("cancel returned {other:?}"),
        }
        assert_counts(&c, op.state());
        assert!(c.snapshot().is_idle());
    });
}

/// The executor's `succeed` racing a `fail` of the same running operation (a watchdog, a
/// dropped handle): exactly one wins, and the execution slot is released once.
#[test]
fn loom_succeed_racing_fail_releases_the_execution_once() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Approved);
        op.try_start().unwrap();
        let failer = {
            let op = op.clone();
            thread::spawn(move || op.fail().is_ok())
        };
        let succeeded = op.succeed().is_ok();
        let failed = failer.join().unwrap();
        assert!(succeeded ^ failed, "exactly one finish wins");
        let end = op.state();
        assert_eq!(
            end,
            if succeeded {
                OperationState::Succeeded
            } else {
                OperationState::Failed
            }
        );
        assert_counts(&c, end);
        assert!(c.snapshot().is_idle());
    });
}

/// Polls `future` on this loom thread, parking between polls (loom's park and unpark).
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(thread::Thread);
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(thread::current())));
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut Context::from_waker(&waker)) {
            return v;
        }
        thread::park();
    }
}

/// An executor waiting in `start` for the only execution slot while the running operation
/// finishes: whatever the interleaving of the finish with the wait's listen and try, the
/// waiter is woken and takes the slot (no lost wake-up).
#[test]
fn loom_start_waiting_for_a_slot_is_woken_by_a_finish() {
    loom::model(|| {
        let limits = crate::config::Limits {
            global_executing: 1,
            ..crate::config::Limits::default()
        };
        let config =
            Config::new(limits, Default::default(), [Identity::new("a").unwrap()]).unwrap();
        let c = Controller::builder(config)
            .clock(ManualClock::new())
            .build();
        let running = Arc::new(c.admit("a", false).unwrap().commit());
        let queued = c.admit("a", false).unwrap().commit();
        running.try_start().unwrap();
        let finisher = {
            let running = running.clone();
            thread::spawn(move || running.succeed().unwrap())
        };
        block_on(queued.start()).unwrap();
        finisher.join().unwrap();
        assert_eq!(queued.state(), OperationState::Executing);
        assert_eq!(c.snapshot().executing, 1);
    });
}

/// A client's cancel racing an operator's approval and the executor's start right behind it:
/// the operation ends canceled with nothing held, or runs holding exactly one execution slot.
#[test]
fn loom_cancel_racing_approve_and_start_leaves_every_count_right() {
    loom::model(|| {
        let (c, op) = one_operation(OperationState::Pending);
        let canceler = {
            let op = op.clone();
            thread::spawn(move || op.cancel())
        };
        let approved = op.approve().is_ok();
        let started = approved && op.try_start().is_ok();
        let canceled = canceler.join().unwrap();
        let end = op.state();
        if started {
            assert_eq!(end, OperationState::Executing);
            assert!(
                canceled.is_err(),
                "an executing operation cannot be canceled"
            );
        } else {
            assert_eq!(end, OperationState::Canceled);
        }
        assert_counts(&c, end);
        if started {
            op.succeed().unwrap();
        }
        assert!(c.snapshot().is_idle());
    });
}

/// With a fair share of the execution pool (two slots, one in reserve), a client's second
/// start races its running operation's finish and another client's start: whichever wins, the
/// pool never runs more than two, a start refused leaves its operation queued, and each pool's
/// holders end equal to the clients holding there.
#[test]
fn loom_fair_starts_racing_a_finish_keep_the_holders_exact() {
    loom::model(|| {
        use crate::config::{FairShare, Limits, PoolShare};
        let limits = Limits {
            global_executing: 2,
            ..Limits::default()
        };
        let pool = |reserve| PoolShare { reserve, floor: 1 };
        let config = Config::new(
            limits,
            Default::default(),
            ["a", "b"].map(|n| Identity::new(n).unwrap()),
        )
        .unwrap()
        .with_fair_share(Some(FairShare {
            active: pool(0),
            executing: pool(1),
        }))
        .unwrap();
        let c = Controller::builder(config)
            .clock(ManualClock::new())
            .build();
        // Admitted first: once `a` runs its share, the execution pool refuses its submissions.
        let running = Arc::new(c.admit("a", false).unwrap().commit());
        let second = Arc::new(c.admit("a", false).unwrap().commit());
        let other = c.admit("b", false).unwrap().commit();
        running.try_start().unwrap();
        let starter = {
            let second = second.clone();
            thread::spawn(move || second.try_start().is_ok())
        };
        let finisher = {
            let running = running.clone();
            thread::spawn(move || running.succeed().unwrap())
        };
        let other_started = other.try_start().is_ok();
        let second_started = starter.join().unwrap();
        finisher.join().unwrap();
        // `b` holds nothing executing: the reserve is its, whatever `a` holds.
        assert!(other_started);
        let s = c.snapshot();
        let executing = 1 + u64::from(second_started);
        assert_eq!(s.executing, executing);
        assert!(s.executing <= 2);
        assert_eq!(s.executing_holders, 1 + u64::from(second_started));
        assert_eq!(s.active_holders, 2);
        assert_eq!(
            second.state(),
            if second_started {
                OperationState::Executing
            } else {
                OperationState::Approved
            }
        );
    });
}
