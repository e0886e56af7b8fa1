//! A circuit breaker in front of Redis: after a run of failed calls, admissions stop calling for a
//! while (each is refused as unavailable at once) rather than queue on a dead or stalled server;
//! then one trial call decides whether to close again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Consecutive failures and, once open, until when.
pub(crate) struct Circuit {
    threshold: u32,
    cool_down: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    failures: u32,
    open_until: Option<Instant>,
    /// A trial call is in flight (half-open): others stay refused until it answers.
    trial: bool,
}

/// Whether a call may go to Redis now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    Closed,
    /// Open: how long until a trial is let through.
    Open(Duration),
}

impl Circuit {
    pub(crate) fn new(threshold: u32, cool_down: Duration) -> Circuit {
        Circuit {
            threshold: threshold.max(1),
            cool_down,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Asks to make a call now.
    pub(crate) fn enter(&self) -> Gate {
        let mut state = self.lock();
        match state.open_until {
            None => Gate::Closed,
            Some(until) => {
                let now = Instant::now();
                if now < until {
                    Gate::Open(until - now)
                } else if state.trial {
                    Gate::Open(self.cool_down)
                } else {
                    state.trial = true;
                    Gate::Closed
                }
            }
        }
    }

    /// The call answered.
    pub(crate) fn succeeded(&self) {
        let mut state = self.lock();
        *state = State::default();
    }

    /// The call failed or timed out. Returns true when this failure opened the circuit.
    pub(crate) fn failed(&self) -> bool {
        let mut state = self.lock();
        state.failures = state.failures.saturating_add(1);
        let was_open = state.open_until.is_some();
        if state.trial || state.failures >= self.threshold {
            state.open_until = Some(Instant::now() + self.cool_down);
            state.trial = false;
        }
        !was_open && state.open_until.is_some()
    }

    /// Whether the circuit is open now.
    pub(crate) fn is_open(&self) -> bool {
        self.lock().open_until.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_and_a_success_closes_it() {
        let circuit = Circuit::new(2, Duration::from_secs(3600));
        assert_eq!(circuit.enter(), Gate::Closed);
        assert!(!circuit.failed());
        assert_eq!(circuit.enter(), Gate::Closed);
        assert!(circuit.failed());
        assert!(matches!(circuit.enter(), Gate::Open(_)));
        circuit.succeeded();
        assert_eq!(circuit.enter(), Gate::Closed);
    }

    #[test]
    fn after_the_cool_down_one_trial_goes_through_and_its_failure_reopens() {
        let circuit = Circuit::new(1, Duration::ZERO);
        circuit.failed();
        assert_eq!(circuit.enter(), Gate::Closed, "the trial");
        assert!(
            matches!(circuit.enter(), Gate::Open(_)),
            "one trial at a time"
        );
        circuit.failed();
        assert!(circuit.is_open());
        assert_eq!(circuit.enter(), Gate::Closed, "the next trial");
        circuit.succeeded();
        assert!(!circuit.is_open());
    }
}
