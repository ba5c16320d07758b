//! A small, bounded stack of spare values kept for reuse under a lock the
//! caller holds (a shard's): empty key slots, empty holder vectors. Taking
//! a spare instead of allocating keeps the allocator out of the shard's
//! critical section once the table is warm.
//!
//! A fixed array rather than a `Vec`: taking and giving compile to a few
//! moves, and the bound holds without a check of capacity. The slots above
//! the count are uninitialized, not `None`: taking a spare reads it out and
//! writes nothing back, and neither way checks a slot's tag.

use std::mem::MaybeUninit;

/// Up to `N` spare values.
///
/// # Invariants
///
/// `count <= N`; `spare[..count]` are initialized, the rest are not (and
/// are never read).
pub(crate) struct Spares<T, const N: usize> {
    spare: [MaybeUninit<T>; N],
    count: usize,
}

impl<T, const N: usize> std::fmt::Debug for Spares<T, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spares")
            .field("count", &self.count)
            .finish()
    }
}

impl<T, const N: usize> Default for Spares<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, const N: usize> Spares<T, N> {
    /// None kept (`const`: the recycled blocks' stock is a `static`).
    pub(crate) const fn new() -> Self {
        Self {
            spare: [const { MaybeUninit::uninit() }; N],
            count: 0,
        }
    }

    /// The spare given back last, if any.
    #[inline(always)]
    pub(crate) fn take(&mut self) -> Option<T> {
        let top = self.count.checked_sub(1)?;
        self.count = top;
        debug_assert!(top < N);
        // SAFETY: `top < count <= N` (the invariant), so in bounds and
        // initialized; with `count` now `top` the slot counts as
        // uninitialized, so it is read out exactly once.
        Some(unsafe { self.spare.get_unchecked(top).assume_init_read() })
    }

    /// Keeps `value` for reuse; drops it if `N` are kept already.
    #[inline(always)]
    pub(crate) fn give(&mut self, value: T) {
        if let Some(slot) = self.spare.get_mut(self.count) {
            // Uninitialized, by the invariant: nothing to drop.
            slot.write(value);
            self.count += 1;
        }
    }

    /// Whether `N` are kept: [`give`](Self::give) would drop its value.
    #[inline(always)]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn is_full(&self) -> bool {
        self.count == N
    }

    /// How many spares are kept.
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn count(&self) -> usize {
        self.count
    }
}

impl<T, const N: usize> Drop for Spares<T, N> {
    fn drop(&mut self) {
        let count = std::mem::take(&mut self.count);
        for slot in &mut self.spare[..count] {
            // SAFETY: below the count, so initialized (the invariant); the
            // count is zero now, so each is dropped once, even should one
            // of these drops panic (the rest then leak).
            unsafe { slot.assume_init_drop() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Spares;

    #[test]
    fn gives_back_the_last_given_and_keeps_at_most_n() {
        let mut spares: Spares<u32, 2> = Spares::default();
        assert_eq!(spares.take(), None);
        for v in 1..=3 {
            spares.give(v);
        }
        assert_eq!(spares.count(), 2);
        assert_eq!(spares.take(), Some(2));
        assert_eq!(spares.take(), Some(1));
        assert_eq!(spares.take(), None);
        assert_eq!(spares.count(), 0);
    }
}
