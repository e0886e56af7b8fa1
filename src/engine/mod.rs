//! The admission engine: rate maths (`gcra`), the reservation primitive (`gauge`), a client's
//! count in a global pool (`holding`, a gauge that tells when the client starts and stops holding
//! there), the fair share of a pool as arithmetic (`share`), the global counts with each pool's
//! holders (`global`), the per-client state they share (`client`), the decision (`controller`),
//! the life of admitted work (`lifecycle`), storage quotas (`caps`, `storage`), what a client
//! may still do (`quota`, read-only), and a lock-free reading of every count (`snapshot`, which
//! the `metrics` module renders). Nothing here knows about HTTP, JSON, SQL or Prometheus.
//!
//! Imports run one way, upward: `gauge`, `gcra`, `holding`, `refusal`, `share`, `global` and
//! `caps` know nothing of clients; `snapshot` is plain data over `caps` and `refusal`; `client` builds on them;
//! `lifecycle` and `storage` build on `client`; `controller` builds on all of them, and `quota`
//! reads through it.

pub(crate) mod caps;
pub(crate) mod client;
pub(crate) mod controller;
pub(crate) mod gauge;
pub(crate) mod gcra;
pub(crate) mod global;
pub(crate) mod holding;
pub(crate) mod lifecycle;
pub(crate) mod quota;
pub(crate) mod refusal;
pub(crate) mod share;
pub(crate) mod snapshot;
pub(crate) mod storage;
pub(crate) mod tally;

pub use caps::{StorageCaps, Store, StoreCaps};
pub use controller::permit::Permit;
pub use controller::restore::RestoreError;
pub use controller::{Controller, ControllerBuilder, DEFAULT_CAPACITY_RETRY};
pub use lifecycle::{CancelOutcome, Operation, OperationState, StartError, TransitionError};
pub use quota::{CapacityQuota, QuotaStatus, RateQuota};
pub use refusal::{FairShareReason, FairShareRefusal, Refusal, RefusalCode};
pub use snapshot::{ClientSnapshot, Snapshot, StoreSnapshot};
pub use storage::{StorageReservation, StoredObject};
