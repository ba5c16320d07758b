//! The one place the crate takes its synchronization primitives from.
//!
//! Under `--cfg loom` these are loom's model-checked types; otherwise they are
//! `std`'s. Every lock the table takes goes through [`Mutex`] so that the loom
//! models explore exactly the code that ships.

#[cfg(loom)]
use loom::sync::Mutex as Inner;
#[cfg(not(loom))]
use std::sync::Mutex as Inner;

#[cfg(loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(not(loom))]
pub(crate) use std::sync::MutexGuard;

/// A mutex that ignores poisoning.
///
/// No user code runs while a shard is locked except `K`'s `Eq`, which can only
/// panic before the shard's state is changed, so a poisoned shard is still
/// consistent and is used as is.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(Inner<T>);

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(Inner::new(value))
    }

    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
