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

/// `Arc` and `Mutex` are std's under `cfg(loom)` too: the engine's `Arc`s live inside `ArcSwap`,
/// which holds std's, and its mutexes only serialize reloads, which no loom model checks.
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

/// Locks `mutex`, recovering it if a holder panicked: every mutex here guards nothing, or state a
/// holder leaves consistent at each step, so one panic must not make every later caller panic too.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
