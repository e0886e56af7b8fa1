//! The event log's bell: where the newest committed event's sequence is published, and the
//! count of events written, so a stream waits on a change instead of polling the store. A leaf:
//! the handle (`database`) opens it and the log (`events`) rings it, and neither imports the
//! other for it.

use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

/// Where the newest event's sequence is published after each commit, and the count of events
/// written: what streams wait on instead of polling the store.
#[derive(Clone)]
pub struct EventBell {
    newest: Arc<watch::Sender<i64>>,
    written: Counter,
}

impl EventBell {
    pub(crate) fn new(newest: i64) -> EventBell {
        EventBell {
            newest: Arc::new(watch::Sender::new(newest)),
            written: Counter::default(),
        }
    }

    /// Publishes that the events up to `seq` are committed (call after the commit).
    pub(crate) fn rang(&self, seq: i64, written: u64) {
        self.written.inc_by(written);
        self.newest.send_if_modified(|newest| {
            let newer = seq > *newest;
            if newer {
                *newest = seq;
            }
            newer
        });
    }

    /// Counts `written` events this process committed, without publishing a sequence: for a
    /// store whose events are numbered after their commit (PostgreSQL's log, where a later
    /// [`rang`](EventBell::rang) publishes them).
    pub(crate) fn wrote(&self, written: u64) {
        self.written.inc_by(written);
    }

    /// A receiver of the newest committed sequence. Let go of what it lends at once (read the
    /// number out of `borrow()` or `wait_for(..)`, do not keep the `watch::Ref` across an
    /// `.await`): while one is kept, the next ring waits for it, blocking the thread that rings,
    /// which on PostgreSQL is a numbering round holding the fleet's numbering lock.
    pub fn subscribe(&self) -> watch::Receiver<i64> {
        self.newest.subscribe()
    }

    /// The newest committed sequence (0 before the first event).
    pub fn newest(&self) -> i64 {
        *self.newest.borrow()
    }

    /// Events written since start-up (`broker_operator_events_written_total`).
    pub fn written(&self) -> Counter {
        self.written.clone()
    }
}
