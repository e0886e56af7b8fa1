//! Start-up: putting what the durable store holds back under the controller's counts — live
//! operations, the rate each client already spent, stored objects — and why an operation could
//! not be.

use std::time::Duration;

use super::Controller;
use crate::clock::duration_nanos;
use crate::config::{Identity, Pool};
use crate::engine::caps::Store;
use crate::engine::global::Counts;
use crate::engine::lifecycle::{Operation, OperationState};
use crate::engine::storage::StoredObject;

impl Controller {
    /// Puts a non-terminal operation found in the durable store back under the controller's
    /// counts, at start-up. Restored work counts even above a lowered limit (new work is then
    /// refused until it drains), so a restart never resets quotas. An identity no longer
    /// configured is tracked, so its work still counts globally, but cannot be admitted again.
    ///
    /// `identity` is the client's name as the store holds it (`&str`, `&String` or `&Identity`,
    /// as [`Controller::admit`] takes it); a name that is not a valid identity is
    /// [`RestoreError::InvalidIdentity`].
    ///
    /// What to do with a row found `executing`: it was running when the process stopped, and
    /// whether its effect happened is unknown. The reference broker marks it `failed` with error
    /// `execution_interrupted` in the store and does not restore it (it must never run twice);
    /// restoring it as `executing` is for a broker that can resume or reattach to the work.
    ///
    /// ```
    /// use unyolo_admission::{Config, Controller, Identity, OperationState};
    ///
    /// let c = Controller::new(Config::defaults([Identity::new("bot-7").unwrap()]));
    /// let op = c.restore("bot-7", OperationState::Pending).unwrap();
    /// assert_eq!(c.snapshot().pending, 1);
    /// assert!(c.restore("not a name", OperationState::Pending).is_err());
    /// # drop(op);
    /// ```
    pub fn restore(
        &self,
        identity: impl AsRef<str>,
        state: OperationState,
    ) -> Result<Operation, RestoreError> {
        if state.is_terminal() {
            return Err(RestoreError::Terminal(state));
        }
        let identity = match self.client(identity.as_ref()) {
            Some(client) => client.identity.clone(),
            None => Identity::new(identity.as_ref()).map_err(|_| RestoreError::InvalidIdentity)?,
        };
        let identity = &identity;
        let client = self.client_or_insert(identity);
        let global = &self.inner.shared.global;
        // Each count whose take found 0 counts the client among that pool's holders, in the
        // same step as the global count.
        let joined = client.active.take() == 0;
        let mut add = Counts::ACTIVE.joining(Pool::Active, joined);
        match state {
            OperationState::Pending => {
                client.pending.force_acquire(1);
                add = add.plus(Counts::PENDING);
            }
            OperationState::Approved => {}
            OperationState::Executing => {
                let joined = client.executing.take() == 0;
                add = add.plus(Counts::EXECUTING.joining(Pool::Executing, joined));
            }
            _ => unreachable!("terminal states returned above"),
        }
        global.force(add);
        Ok(Operation::new(client, state))
    }

    /// Rebuilds `identity`'s rate bucket at start-up from its admissions made `admitted_ago`
    /// (each the age of an operation it created, in any state), so a restart never hands out a
    /// fresh burst. Each admission spends a token as it did when made; admissions a whole window
    /// old or older count nothing; the bucket only becomes emptier, and never owes more than one
    /// window. An identity that is not configured has no bucket: nothing happens.
    pub fn restore_rate(
        &self,
        identity: impl AsRef<str>,
        admitted_ago: impl IntoIterator<Item = Duration>,
    ) {
        let Some(client) = self.client(identity.as_ref()) else {
            return;
        };
        self.wait_for_rescale(identity.as_ref());
        let shared = &*self.inner.shared;
        let settings = shared.settings.load();
        let limits = *client.settings(&settings);
        if !limits.configured {
            return;
        }
        if limits.rescaling {
            // A reload began meanwhile: replay in the rate it puts in force.
            drop(settings);
            return self.restore_rate(identity, admitted_ago);
        }
        let now = shared.clock.now();
        client.bucket.replay(
            now,
            limits.rate,
            admitted_ago.into_iter().map(duration_nanos),
        );
    }

    /// Counts an object already in `store` at start-up (restored usage may exceed the caps).
    pub fn restore_storage(&self, identity: &Identity, store: Store, bytes: u64) -> StoredObject {
        StoredObject::restore(self.client_or_insert(identity), store, bytes)
    }
}

/// Why an operation could not be restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Terminal operations hold nothing and are not restored.
    Terminal(OperationState),
    /// The client name is not a valid identity (so no configuration could ever name it).
    InvalidIdentity,
    /// Replicated: the operation id cannot be recorded in the shared store (1 to 128 visible
    /// ASCII characters), so the other replicas could never count it; nothing is restored.
    UnshareableId,
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestoreError::Terminal(state) => {
                write!(f, "a {state} operation is terminal and holds no slots")
            }
            RestoreError::InvalidIdentity => f.write_str("the client name is not a valid identity"),
            RestoreError::UnshareableId => f.write_str(
                "the operation id cannot be recorded in the shared store (1 to 128 visible ASCII \
                 characters)",
            ),
        }
    }
}

impl std::error::Error for RestoreError {}
