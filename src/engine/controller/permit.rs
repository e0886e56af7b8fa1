//! What a decision hands out: a [`Permit`] holds an admission's slots and its rate token until
//! the broker commits it into an [`Operation`] or refunds it, and counts a drop of neither as the
//! embedding's bug. It knows the client's state, not the controller.

use std::sync::atomic::Ordering;

use crate::config::{Identity, Pool};
use crate::engine::client::ClientState;
use crate::engine::gcra::Rate;
use crate::engine::global::Counts;
use crate::engine::lifecycle::{Operation, OperationState};
use crate::sync::{Arc, lock};

/// An admitted submission, before the broker has created its durable operation.
///
/// [`Permit::commit`] turns it into a lifecycle [`Operation`] once the durable operation exists;
/// [`Permit::refund`] returns its slots and its rate token when the broker failed through its own
/// fault (the store was unavailable), or when it lost a race to a concurrent duplicate.
///
/// # Dropping it
///
/// Dropped without either, it returns its slots but its rate token stays spent. That is never
/// what a broker means: in an async handler it happens when the client hangs up while the handler
/// awaits the store between `admit` and `commit` — the future is dropped at that `.await`, the
/// permit with it, and a row the store may already have written is counted nowhere. So run
/// everything from `admit` to `commit` (or `refund`) in a task a disconnect cannot cancel
/// (`tokio::spawn`, and have the handler only await its outcome); `broker/examples/axum_broker.rs` shows
/// the whole pattern. Each drop is counted in
/// [`Snapshot::dropped_permits`](crate::Snapshot::dropped_permits) and exported as
/// `admission_dropped_permits_total`; anything but zero is a bug in the embedding.
#[must_use = "a permit holds slots until it is committed or refunded"]
pub struct Permit {
    /// The client, until the permit is committed, refunded or dropped (then `None`): moving it
    /// out on commit hands the operation the permit's own reference, no second count.
    client: Option<Arc<ClientState>>,
    rate: Rate,
    needs_approval: bool,
}

impl Permit {
    /// The permit for an admission of `client` that took a token at `rate` and reserved its
    /// slots (and a pending one if it `needs_approval`).
    pub(super) fn new(client: Arc<ClientState>, rate: Rate, needs_approval: bool) -> Permit {
        Permit {
            client: Some(client),
            rate,
            needs_approval,
        }
    }

    fn client(&self) -> &ClientState {
        // Only `commit`, `refund` and `drop` take the client, and each consumes the permit.
        self.client
            .as_deref()
            .expect("a live permit holds its client")
    }

    /// The admitted client.
    pub fn identity(&self) -> &Identity {
        &self.client().identity
    }

    /// Whether the operation waits for an operator (it starts `pending`, else `approved`).
    pub fn needs_approval(&self) -> bool {
        self.needs_approval
    }

    /// The durable operation exists: track it, `pending` if it needs approval, else `approved`.
    pub fn commit(mut self) -> Operation {
        let client = self.client.take().expect("a live permit holds its client");
        let state = if self.needs_approval {
            OperationState::Pending
        } else {
            OperationState::Approved
        };
        Operation::new(client, state)
    }

    /// The broker failed through its own fault (say, the store was unavailable): return the
    /// slots and the rate token. The token given back is exactly the one taken, even if a reload
    /// has changed the client's rate since (and rescaled its bucket).
    pub fn refund(mut self) {
        if let Some(client) = self.client.take() {
            release_admission(&client, self.needs_approval);
            let shared = &*client.shared;
            let _rescaling = lock(&shared.rescaling);
            let rate_now = client.settings(&shared.settings.load()).rate;
            client.bucket.give_back_nanos(self.rate.token_in(rate_now));
        }
    }
}

/// Returns what an uncommitted admission holds: the global slots first, then the client's (and
/// its place among the active pool's holders, if this was its last live operation), as an
/// operation's end does.
fn release_admission(client: &ClientState, needs_approval: bool) {
    let global = &client.shared.global;
    if needs_approval {
        global.release(Counts::ACTIVE.plus(Counts::PENDING));
        client.pending.release(1);
    } else {
        global.release(Counts::ACTIVE);
    }
    if client.active.give_back() {
        global.release(Counts::holder(Pool::Active));
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            release_admission(&client, self.needs_approval);
            // Relaxed: a statistic.
            client
                .shared
                .dropped_permits
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("identity", &self.client.as_ref().map(|c| &c.identity))
            .field("needs_approval", &self.needs_approval)
            .finish()
    }
}
