//! The atomics and the wake-up primitive the engine's primitives are built on: std's normally,
//! loom's under `cfg(loom)`, so the loom models check the real code rather than a copy of it.
//!
//! [`Event`] (from `event-listener`, runtime-agnostic: any executor, or a blocking wait) wakes
//! executors waiting for a free execution slot; under `cfg(loom)` the crate is built with its
//! `loom` feature, so its internals are modelled too.

pub(crate) use event_listener::{Event, EventListener, IntoNotification};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
