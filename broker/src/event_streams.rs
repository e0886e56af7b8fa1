//! The open Operator V1 event streams (`GET /api/operator/v1/events`): how many each operator
//! and all of them together may hold, and the metrics of what they deliver.
//!
//! A stream is a long-lived response: without a bound, one operator's tool opening streams in a
//! loop would hold connections (and a task each) for as long as it likes. So each operator may
//! hold [`EventStreamLimits::per_operator`] at once and the broker
//! [`EventStreamLimits::total`]; one more is refused before the stream starts (the route answers
//! 503 `temporarily_unavailable` with Retry-After). A stream's slot is given back by its
//! `StreamSlot`'s `Drop`, when the response body is dropped: the client hung up, or the
//! stream ended at shutdown.
//!
//! The core holds this registry; the route is `api::events`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How many event streams may be open at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventStreamLimits {
    /// Per operator.
    pub per_operator: usize,
    /// In total.
    pub total: usize,
}

impl Default for EventStreamLimits {
    fn default() -> EventStreamLimits {
        EventStreamLimits {
            per_operator: 16,
            total: 64,
        }
    }
}

impl EventStreamLimits {
    /// Why these limits cannot serve, if they cannot.
    pub fn problem(&self) -> Option<String> {
        (self.per_operator == 0 || self.total == 0)
            .then(|| "event stream limits must be at least 1".to_owned())
    }
}

/// The open streams by operator, their bounds and their metrics.
pub(crate) struct EventStreams {
    shared: Arc<Shared>,
}

struct Shared {
    limits: EventStreamLimits,
    open: Mutex<HashMap<String, usize>>,
    /// `broker_operator_event_streams`: streams open now.
    gauge: Gauge,
    /// `broker_operator_events_delivered`: events written to streams.
    delivered: Counter,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        crate::sync::lock(&self.open)
    }
}

/// Over a bound: the stream is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooManyStreams;

impl EventStreams {
    pub(crate) fn new(limits: EventStreamLimits) -> EventStreams {
        EventStreams {
            shared: Arc::new(Shared {
                limits,
                open: Mutex::new(HashMap::new()),
                gauge: Gauge::default(),
                delivered: Counter::default(),
            }),
        }
    }

    /// Registers the metrics (`written` is the store's count of events written).
    pub(crate) fn register(&self, registry: &mut Registry, written: Counter) {
        registry.register(
            "broker_operator_event_streams",
            "Operator V1 event streams open now.",
            self.shared.gauge.clone(),
        );
        registry.register(
            "broker_operator_events_delivered",
            "Operator V1 events written to event streams (one per stream an event reached).",
            self.shared.delivered.clone(),
        );
        registry.register(
            "broker_operator_events_written",
            "Operator V1 events written to the event log since start-up.",
            written,
        );
    }

    /// Takes one of `operator`'s stream slots, or refuses when the operator or the broker holds
    /// as many as allowed.
    pub(crate) fn enter(&self, operator: &str) -> Result<StreamSlot, TooManyStreams> {
        let mut open = self.shared.lock();
        let total: usize = open.values().sum();
        let held = open.get(operator).copied().unwrap_or(0);
        if total >= self.shared.limits.total || held >= self.shared.limits.per_operator {
            return Err(TooManyStreams);
        }
        open.insert(operator.to_owned(), held + 1);
        self.shared.gauge.inc();
        Ok(StreamSlot {
            shared: Arc::clone(&self.shared),
            operator: operator.to_owned(),
        })
    }

    /// How many streams are open.
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        self.shared.lock().values().sum()
    }
}

/// One open stream's slot; dropping it gives the slot back.
pub(crate) struct StreamSlot {
    shared: Arc<Shared>,
    operator: String,
}

impl StreamSlot {
    /// Counts `n` events delivered on this stream.
    pub(crate) fn delivered(&self, n: u64) {
        self.shared.delivered.inc_by(n);
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.shared.lock();
        if let Some(held) = open.get_mut(&self.operator) {
            *held -= 1;
            if *held == 0 {
                open.remove(&self.operator);
            }
        }
        self.shared.gauge.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_bounded_per_operator_and_in_total_and_given_back_on_drop() {
        let streams = EventStreams::new(EventStreamLimits {
            per_operator: 2,
            total: 3,
        });
        let a1 = streams.enter("a").unwrap();
        let a2 = streams.enter("a").unwrap();
        assert_eq!(streams.enter("a").err(), Some(TooManyStreams));
        let b1 = streams.enter("b").unwrap();
        assert_eq!(
            streams.enter("c").err(),
            Some(TooManyStreams),
            "the total bound holds for an operator with none open"
        );
        assert_eq!((streams.open(), streams.shared.gauge.get()), (3, 3));
        drop(a1);
        let c1 = streams.enter("c").expect("a slot given back is free again");
        drop((a2, b1, c1));
        assert_eq!((streams.open(), streams.shared.gauge.get()), (0, 0));
    }
}
