#![forbid(unsafe_code)]
#![warn(missing_docs)]
//! Admission control for agent brokers.
// (crate docs with the full example follow once the engine settles)

#[cfg(feature = "broker")]
pub mod broker;
pub mod clock;
pub mod config;
pub mod engine;
pub mod metrics;
mod sync;

pub use clock::{Clock, ManualClock, QuantaClock};
pub use config::{ClientLimits, Config, Identity, Limits};
pub use engine::{
    Controller, ControllerBuilder, Operation, OperationState, Permit, Refusal, RefusalCode,
    StartError, StorageCaps, StorageReservation, Store, StoreCaps, StoredObject, TransitionError,
};
pub use metrics::Snapshot;
