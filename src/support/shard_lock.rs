//! The lock each shard sits behind: a test-and-test-and-set spin lock.
//!
//! A shard's critical sections are a hash probe and a few stores (tens of
//! nanoseconds) and never run user code that can block, so the lock is built
//! for that: locking is one compare-and-swap and unlocking is one release
//! store (no read-modify-write), where a parking mutex needs an atomic
//! read-modify-write on both sides to learn whether it must unpark someone.
//! That halves the atomic operations of an uncontended lock + unlock (see
//! BENCHMARKS.md). Under contention a locker spins briefly and then yields
//! its thread, so a preempted holder is not starved by its spinners.
//!
//! Its atomics and cell come from the loom shim. Under loom the table itself
//! sits behind loom's blocking mutex instead ([`ShardMutex`]): loom cannot
//! bound the schedules of a spin loop among three threads. The lock is
//! model-checked on its own (two threads, `loom_tests` below) and stressed
//! with real threads.
//!
//! | `locked` | meaning                  |
//! |----------|--------------------------|
//! | `false`  | free                     |
//! | `true`   | held by exactly one guard|
//!
//! With the `jitter` feature, [`lock`](ShardLock::lock) and the unlock are
//! also random preemption points for stress tests (`support/jitter.rs`).
//!
//! The `Acquire` compare-and-swap that sets `locked` pairs with the
//! `Release` store that clears it, so everything a holder wrote is visible to
//! the next.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use crate::support::loom::{AtomicBool, MutPtr, Spin, UnsafeCell};

/// The lock the table's shards use.
#[cfg(not(loom))]
pub(crate) type ShardMutex<T> = ShardLock<T>;
/// The lock the table's shards use (loom's, under loom; see the module doc).
#[cfg(loom)]
pub(crate) type ShardMutex<T> = crate::support::loom::Mutex<T>;

/// A spin lock around `T`.
///
/// # Invariants
///
/// `value` is accessed only through a [`ShardGuard`], and at most one guard
/// exists at a time: one is made only by the thread whose compare-and-swap
/// turned `locked` from `false` to `true`.
///
/// `repr(C)`: the lock word comes first, on the same cache line as the
/// front of the value it guards.
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct ShardLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to `T` to one thread at a time (see the
// invariants), which is what `Mutex<T>: Sync` requires of `T: Send`.
unsafe impl<T: Send> Sync for ShardLock<T> {}
// SAFETY: moving the lock moves the `T` it owns.
unsafe impl<T: Send> Send for ShardLock<T> {}

impl<T> ShardLock<T> {
    /// `const` outside loom, so that a lock can be a plain `static`
    /// (`support/recycle.rs`); loom's atomics are not `const`.
    #[cfg(not(loom))]
    pub(crate) const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    #[cfg(loom)]
    pub(crate) fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Locks, spinning then yielding while another thread holds it.
    #[inline]
    pub(crate) fn lock(&self) -> ShardGuard<'_, T> {
        #[cfg(all(feature = "jitter", not(loom)))]
        crate::support::jitter::jitter();
        if self
            .locked
            .compare_exchange(false, true, Acquire, Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        ShardGuard {
            lock: self,
            value: ManuallyDrop::new(self.value.get_mut()),
        }
    }

    /// Locks if nobody holds it (one compare-and-swap); `None` otherwise,
    /// for the caller to [`lock`](Self::lock) on a path of its own (so that
    /// its fast path keeps nothing across the wait).
    #[inline]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn try_lock(&self) -> Option<ShardGuard<'_, T>> {
        if self
            .locked
            .compare_exchange(false, true, Acquire, Relaxed)
            .is_err()
        {
            return None;
        }
        Some(ShardGuard {
            lock: self,
            value: ManuallyDrop::new(self.value.get_mut()),
        })
    }

    /// One attempt after the lock was seen free. (Under loom a strong
    /// compare-and-swap: loom lets a weak one fail spuriously without bound.)
    #[inline]
    fn try_take(&self) -> bool {
        #[cfg(not(loom))]
        let taken = self
            .locked
            .compare_exchange_weak(false, true, Acquire, Relaxed);
        #[cfg(loom)]
        let taken = self.locked.compare_exchange(false, true, Acquire, Relaxed);
        taken.is_ok()
    }

    #[cold]
    fn lock_contended(&self) {
        let spin = Spin::default();
        loop {
            // Wait on a plain load, so waiters do not bounce the cache line.
            // (Not under loom: there a plain load may read a stale `true`
            // for ever, while the compare-and-swap always reads the latest.)
            #[cfg(not(loom))]
            while self.locked.load(Relaxed) {
                spin.wait();
            }
            if self.try_take() {
                return;
            }
            #[cfg(loom)]
            spin.wait();
        }
    }
}

/// Exclusive access to a locked [`ShardLock`]'s value; unlocks on drop.
pub(crate) struct ShardGuard<'a, T> {
    lock: &'a ShardLock<T>,
    value: ManuallyDrop<MutPtr<T>>,
}

impl<T> Deref for ShardGuard<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `ShardLock`'s invariants).
        unsafe { MutPtr::deref(&self.value) }
    }
}

impl<T> DerefMut for ShardGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one, and `&mut self` makes this the
        // only reference it gives out.
        unsafe { MutPtr::deref(&self.value) }
    }
}

impl<T> Drop for ShardGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: `value` is dropped exactly once, here, and not used after.
        // It must end before the unlock: under loom it records the access.
        unsafe { ManuallyDrop::drop(&mut self.value) };
        self.lock.locked.store(false, Release);
        #[cfg(all(feature = "jitter", not(loom)))]
        crate::support::jitter::jitter();
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::Arc;

    use super::ShardLock;

    #[test]
    fn two_lockers_exclude_each_other_and_see_each_others_writes() {
        loom::model(|| {
            let lock = Arc::new(ShardLock::new(0u32));
            let other = lock.clone();
            let t = loom::thread::spawn(move || {
                let mut v = other.lock();
                *v += 1;
            });
            {
                let mut v = lock.lock();
                *v += 1;
            }
            t.join().unwrap();
            assert_eq!(*lock.lock(), 2);
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;

    use super::ShardLock;

    #[test]
    fn excludes_across_threads() {
        let lock = Arc::new(ShardLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut v = lock.lock();
                        // A non-atomic read-modify-write: lost updates would
                        // show if two guards ever overlapped.
                        let seen = *v;
                        std::hint::black_box(&mut *v);
                        *v = seen + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 80_000);
    }
}
