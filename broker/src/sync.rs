//! Locking a std mutex without letting one panic poison it for everyone after.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, recovering it if a holder panicked: every mutex here guards nothing, or state a
/// holder leaves consistent at each step, so one panic must not make every later caller panic too.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
