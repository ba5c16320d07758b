//! The one place the crate takes its synchronization primitives from.
//!
//! Under `--cfg loom` these are loom's model-checked types; otherwise std's
//! atomics and a plain cell. The shard lock (`shard_lock.rs`) and the waiter
//! node (`waiter.rs`) are built from these, so the loom models explore the
//! code that ships. [`Mutex`] is an owned transaction's state lock
//! (`transactions/access.rs`), the manual clock's lock, and, under loom, the
//! table's (see `shard_lock.rs`).

#[cfg(loom)]
pub(crate) use loom::sync::MutexGuard;
#[cfg(all(not(loom), feature = "test-util"))]
pub(crate) use parking_lot::MutexGuard;
#[cfg(not(any(loom, feature = "test-util")))]
pub(crate) use std::sync::MutexGuard;

/// A mutex without poisoning: loom's under loom, parking_lot's under
/// `test-util` (which depends on it anyway), std's otherwise, its poison
/// ignored.
///
/// Its users change the guarded state only after any user code that can
/// panic under the lock has run: no user code runs while a shard is locked
/// except `K`'s `Eq`, which can only panic before the shard's state is
/// changed; an owned transaction's set runs a key's `Eq` before
/// changing anything. So a state whose lock was released by a panic
/// is still consistent and is used as is.
#[derive(Debug, Default)]
pub(crate) struct Mutex<T>(
    #[cfg(loom)] loom::sync::Mutex<T>,
    #[cfg(all(not(loom), feature = "test-util"))] parking_lot::Mutex<T>,
    #[cfg(not(any(loom, feature = "test-util")))] std::sync::Mutex<T>,
);

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(loom)]
        return Self(loom::sync::Mutex::new(value));
        #[cfg(all(not(loom), feature = "test-util"))]
        return Self(parking_lot::Mutex::new(value));
        #[cfg(not(any(loom, feature = "test-util")))]
        Self(std::sync::Mutex::new(value))
    }

    #[inline]
    /// Locks if nobody holds it (may fail spuriously under loom: a
    /// caller then locks).
    #[cfg_attr(not(loom), allow(dead_code))]
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        #[cfg(all(not(loom), feature = "test-util"))]
        return self.0.try_lock();
        #[cfg(any(loom, not(feature = "test-util")))]
        match self.0.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(all(not(loom), feature = "test-util"))]
        return self.0.lock();
        #[cfg(any(loom, not(feature = "test-util")))]
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(loom)]
pub(crate) use loom::cell::{MutPtr, UnsafeCell};
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};

/// `std`'s `UnsafeCell` behind loom's API, so that code written once is
/// checked by loom and compiles to a plain cell otherwise.
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    /// A pointer for exclusive access; see [`MutPtr::deref`].
    #[inline]
    pub(crate) fn get_mut(&self) -> MutPtr<T> {
        MutPtr(self.0.get())
    }
}

/// A pointer to the contents of an [`UnsafeCell`], as loom's `MutPtr`.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct MutPtr<T>(*mut T);

#[cfg(not(loom))]
impl<T> MutPtr<T> {
    /// Exclusive access to the cell's contents.
    ///
    /// # Safety
    ///
    /// No other reference to the contents may exist while the returned one
    /// is used.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn deref(&self) -> &mut T {
        // SAFETY: the caller guarantees exclusive access.
        unsafe { &mut *self.0 }
    }
}

/// Waits a little inside a spin loop: exponential spinning, then yielding the
/// thread (under loom, a yield every time so the model makes progress).
#[derive(Debug, Default)]
pub(crate) struct Spin {
    #[cfg(not(loom))]
    backoff: crossbeam_utils::Backoff,
}

impl Spin {
    #[inline]
    pub(crate) fn wait(&self) {
        #[cfg(loom)]
        loom::thread::yield_now();
        #[cfg(not(loom))]
        self.backoff.snooze();
    }
}
