//! Stable storage for the key of a live entry.
//!
//! A guard hands out `&K` without holding any lock, while the shard's hash
//! table may move its entries when it grows. The key therefore lives in a
//! heap slot of its own, which the entry owns and which guards and waiters
//! point to. Slots are recycled through a small per-shard pool so that the
//! uncontended path does not allocate once the table is warm, and the key is
//! moved in once and never cloned.

use std::mem::MaybeUninit;
use std::ptr::NonNull;

use crate::support::spares::Spares;

/// How many empty slots a shard keeps for reuse. Bounded, so an idle table
/// holds a fixed amount of memory however many keys it has seen.
const POOL_CAPACITY: usize = 16;

/// A pointer to an initialized key in a slot owned by a live entry.
///
/// # Invariants
///
/// The slot is initialized and not mutated for as long as its entry is in the
/// shard's table. Every holder of a `KeyPtr` (guards, waiters, granted waiters)
/// keeps that entry in the table: the entry is removed only when it has no
/// holder, no waiter and no fenced guard left.
pub(crate) struct KeyPtr<K>(NonNull<K>);

impl<K> Clone for KeyPtr<K> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K> Copy for KeyPtr<K> {}

impl<K> PartialEq for KeyPtr<K> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<K> std::fmt::Debug for KeyPtr<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KeyPtr").field(&self.0).finish()
    }
}

// SAFETY: a `KeyPtr` only ever gives out `&K` (shared access from several
// threads needs `K: Sync`) and the key is dropped by whichever thread removes
// the entry (needs `K: Send`).
unsafe impl<K: Send + Sync> Send for KeyPtr<K> {}
// SAFETY: as above; `KeyPtr` has no interior mutability of its own.
unsafe impl<K: Send + Sync> Sync for KeyPtr<K> {}

impl<K> KeyPtr<K> {
    /// Borrows the key.
    ///
    /// # Safety
    ///
    /// The entry that owns this slot must still be in its shard's table for
    /// all of `'a` (see the type's invariants).
    #[inline]
    pub(crate) unsafe fn get<'a>(self) -> &'a K {
        // SAFETY: the caller guarantees the slot is initialized and alive for
        // 'a, and slots are never written while their entry is live.
        unsafe { self.0.as_ref() }
    }
}

/// The per-shard pool of empty key slots. Touched only under the shard lock.
pub(crate) struct KeyPool<K> {
    spare: Spares<Box<MaybeUninit<K>>, POOL_CAPACITY>,
}

impl<K> std::fmt::Debug for KeyPool<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyPool")
            .field("spare", &self.spare)
            .finish()
    }
}

impl<K> KeyPool<K> {
    pub(crate) fn new() -> Self {
        Self {
            spare: Spares::default(),
        }
    }

    /// Moves `key` into a slot, reusing a spare one when there is one.
    #[inline(always)]
    pub(crate) fn store(&mut self, key: K) -> KeyPtr<K> {
        let mut slot = self
            .spare
            .take()
            .unwrap_or_else(|| Box::new(MaybeUninit::uninit()));
        slot.write(key);
        // The slot is initialized now; its ownership passes to the entry.
        KeyPtr(NonNull::from(Box::leak(slot)).cast())
    }

    /// Moves the key out of its slot and keeps the slot for reuse.
    ///
    /// # Safety
    ///
    /// `ptr` must come from [`store`](Self::store) on this pool, its entry must
    /// just have been removed from the table (so nothing will read it again),
    /// and `take` must not be called twice for one `store`.
    #[inline(always)]
    pub(crate) unsafe fn take(&mut self, ptr: KeyPtr<K>) -> K {
        // SAFETY: `ptr` came from `Box::leak` in `store`, so it is a unique
        // allocation of a `MaybeUninit<K>` that nobody else owns now.
        let slot = unsafe { Box::from_raw(ptr.0.cast::<MaybeUninit<K>>().as_ptr()) };
        // SAFETY: the slot was initialized by `store` and not read out since.
        let key = unsafe { slot.assume_init_read() };
        self.spare.give(slot);
        key
    }
}
