//! A small, bounded stack of spare values kept for reuse under a lock the
//! caller holds (a shard's): empty key slots, empty holder vectors. Taking
//! a spare instead of allocating keeps the allocator out of the shard's
//! critical section once the table is warm.
//!
//! A fixed array rather than a `Vec`: taking and giving compile to a few
//! moves, and the bound holds without a check of capacity.

/// Up to `N` spare values.
///
/// # Invariants
///
/// `spare[..count]` are `Some`, the rest `None`.
pub(crate) struct Spares<T, const N: usize> {
    spare: [Option<T>; N],
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
        Self {
            spare: std::array::from_fn(|_| None),
            count: 0,
        }
    }
}

impl<T, const N: usize> Spares<T, N> {
    /// The spare given back last, if any.
    #[inline(always)]
    pub(crate) fn take(&mut self) -> Option<T> {
        let top = self.count.checked_sub(1)?;
        self.count = top;
        self.spare.get_mut(top).and_then(Option::take)
    }

    /// Keeps `value` for reuse; drops it if `N` are kept already.
    #[inline(always)]
    pub(crate) fn give(&mut self, value: T) {
        if let Some(slot) = self.spare.get_mut(self.count) {
            // Empty, by the invariant: nothing to drop, and no check for it.
            let old = slot.replace(value);
            debug_assert!(old.is_none());
            std::mem::forget(old);
            self.count += 1;
        }
    }

    /// How many spares are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.count
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
        assert_eq!(spares.len(), 2);
        assert_eq!(spares.take(), Some(2));
        assert_eq!(spares.take(), Some(1));
        assert_eq!(spares.take(), None);
        assert_eq!(spares.len(), 0);
    }
}
