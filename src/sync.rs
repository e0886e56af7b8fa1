//! The atomics the engine's primitives are built on: std's normally, loom's under `cfg(loom)`, so
//! the loom models check the real code rather than a copy of it.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
