//! The one lock helper.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data even when a thread panicked holding it: the
/// state behind every lock here stays consistent at every await-free step
/// (no lock is held across a panic-prone call that leaves it half
/// changed), so a poisoned lock is no reason to take the proxy down.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
