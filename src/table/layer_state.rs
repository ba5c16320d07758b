//! State a layer over the table keeps per table, which the table holds for
//! it without knowing its type ([`LayerState`]).
//!
//! The table must not import the layers above it (transactions, their
//! deadlock detector, their holds), yet their state lives as long as the
//! table and is found from it. So the table carries one untyped slot per
//! layer, empty until that layer is first used: a table that never runs a
//! transaction makes no detector and no hold registry at all. The layer
//! fills its slot with a value of its own type and is the only code that
//! reads it back (one accessor per slot, so one type per slot).

use std::ptr::NonNull;
use std::sync::OnceLock;

/// One layer's state, made on first use and dropped with the table.
///
/// # Invariants
///
/// Once set, `ptr` is a `Box<T>` leaked by [`get_or_init`](Self::get_or_init)
/// and `drop` is `drop_boxed::<T>` for that same `T`.
pub(crate) struct LayerState {
    slot: OnceLock<Erased>,
}

struct Erased {
    ptr: NonNull<()>,
    drop: unsafe fn(NonNull<()>),
}

// SAFETY: the value behind `ptr` is a layer's per-table state, shared the
// way the table is: a table is `Send`/`Sync` only when its keys are (its
// shards' state requires `K: Send + Sync`), and every layer state is
// `Send + Sync` when the keys are (each layer checks that of its state at
// compile time, beside its accessor). The slot itself is only
// written once (by `OnceLock`) and read through shared references.
unsafe impl Send for Erased {}
// SAFETY: as for `Send`.
unsafe impl Sync for Erased {}

/// Frees a `Box<T>` leaked into a slot.
///
/// # Safety
///
/// `ptr` came from `Box::<T>::leak` and is not used again.
unsafe fn drop_boxed<T>(ptr: NonNull<()>) {
    // SAFETY: the caller's contract.
    drop(unsafe { Box::from_raw(ptr.cast::<T>().as_ptr()) });
}

impl LayerState {
    /// An empty slot.
    pub(crate) const fn new() -> Self {
        Self {
            slot: OnceLock::new(),
        }
    }

    /// The layer's state, made by `init` on first use.
    ///
    /// # Safety
    ///
    /// Every call on one slot names the same `T` (each slot has one accessor,
    /// in its layer).
    #[inline]
    pub(crate) unsafe fn get_or_init<T>(&self, init: impl FnOnce() -> T) -> &T {
        let erased = self.slot.get_or_init(|| Erased {
            ptr: NonNull::from(Box::leak(Box::new(init()))).cast(),
            drop: drop_boxed::<T>,
        });
        // SAFETY: the slot holds a live `Box<T>` (the caller's contract and
        // the invariant), freed only when `self` is dropped, which the
        // returned borrow outlives not.
        unsafe { erased.ptr.cast::<T>().as_ref() }
    }
}

impl Drop for LayerState {
    fn drop(&mut self) {
        if let Some(erased) = self.slot.take() {
            // SAFETY: the invariant; the slot is emptied, so this runs once.
            unsafe { (erased.drop)(erased.ptr) };
        }
    }
}

impl std::fmt::Debug for LayerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerState")
            .field("made", &self.slot.get().is_some())
            .finish()
    }
}
