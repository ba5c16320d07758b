//! The one place the crate takes its synchronization primitives from.
//!
//! Under `--cfg loom` these are loom's model-checked types; otherwise the
//! shard lock is parking_lot's mutex (one compare-and-swap to lock, one to
//! unlock, no poisoning to track). Every lock the table takes goes through
//! [`Mutex`] so that the loom models explore exactly the code that ships.

#[cfg(loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(not(loom))]
pub(crate) use parking_lot::MutexGuard;

/// A mutex without poisoning.
///
/// No user code runs while a shard is locked except `K`'s `Eq`, which can only
/// panic before the shard's state is changed, so a shard whose lock was
/// released by a panic is still consistent and is used as is.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(loom)] loom::sync::Mutex<T>,
    #[cfg(not(loom))] parking_lot::Mutex<T>,
);

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(loom)]
        return Self(loom::sync::Mutex::new(value));
        #[cfg(not(loom))]
        Self(parking_lot::Mutex::new(value))
    }

    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(loom)]
        return self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        #[cfg(not(loom))]
        self.0.lock()
    }
}
