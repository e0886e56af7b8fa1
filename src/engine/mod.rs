//! The admission engine: rate maths (`gcra`), the reservation primitive (`gauge`), the
//! decision (`controller`), the life of admitted work (`lifecycle`) and storage quotas
//! (`storage`), and what a client may still do (`quota`). Nothing here knows about HTTP, JSON or SQL.

pub(crate) mod controller;
pub(crate) mod gauge;
pub(crate) mod gcra;
pub(crate) mod global;
pub(crate) mod lifecycle;
pub(crate) mod quota;
pub(crate) mod refusal;
pub(crate) mod storage;

pub use controller::{Controller, ControllerBuilder, DEFAULT_CAPACITY_RETRY, Permit, RestoreError};
pub use lifecycle::{Operation, OperationState, StartError, TransitionError};
pub use quota::{CapacityQuota, QuotaStatus, RateQuota};
pub use refusal::{Refusal, RefusalCode};
pub use storage::{StorageCaps, StorageReservation, Store, StoreCaps, StoredObject};
