//! A box whose memory is recycled: the transaction layer's contended
//! waits (a call's boxed rest, a parked wait) are put in blocks taken from,
//! and given back to, a small process-wide stock, not made and freed by
//! the allocator each time.
//!
//! Why: such a wait is boxed on the worker thread where it begins and,
//! woken by a release on the other worker (tokio runs a task woken from a
//! worker on that worker), usually ends and is freed there. glibc's
//! allocator keeps only seven free blocks of a size per thread; past that,
//! the freeing thread gives blocks back to the allocating thread's arena
//! under that arena's lock, which the allocating thread takes for every
//! block it no longer finds cached. The two workers meet on one lock, and
//! when they collide one of them sleeps in the kernel while its tasks wait.
//! On the hot bank (`examples/bank.rs`, 64 accounts, two auditors) that
//! was 16,000 to 18,000 futex sleeps a run, where sorted plain guards
//! (whose waits allocate nothing) had 3,000 to 5,000 (BENCHMARKS.md).
//!
//! Each thread first keeps up to [`LOCAL_KEEP`] blocks of each size for
//! itself: a wait that begins on the worker where an earlier one ended
//! takes that one's block, still in the core's cache, with no atomic
//! operation. Past those, a block is taken from and given back to the
//! shared stock under a spin lock that is only ever *tried*: if another
//! thread has it, the box is allocated or freed the usual way, so no
//! thread ever waits here. The shared stock keeps at most [`KEEP`] blocks
//! of each of three sizes (256, 512 and 1,024 bytes, 16-byte aligned); a
//! thread gives its own to it (or frees them) as it ends. Blocks are made
//! only as boxes are: a process that never waits in a transaction has
//! none. A value larger than the largest block, or aligned
//! past 16 bytes, is boxed as usual. Under loom (which cannot model a
//! static) there is no stock: every block is allocated and freed.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::ptr::NonNull;

/// The sizes of the blocks, smallest first.
const SIZES: [usize; 3] = [256, 512, 1024];

/// The alignment of every block.
const ALIGN: usize = 16;

/// The most blocks the stock keeps of each size: enough for every wait of
/// a few dozen tasks in flight at once, at most 112 KiB in all.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) const KEEP: usize = 64;

/// The most blocks a thread keeps of each size for itself, before the
/// shared stock: at most 28 KiB a thread, on a thread that waits in
/// transactions.
#[cfg_attr(loom, allow(dead_code))]
const LOCAL_KEEP: usize = 16;

/// The size class a `T` is kept in: the index of the smallest block it
/// fits, or `None` (boxed as usual).
const fn class_of<T>() -> Option<usize> {
    if size_of::<T>() == 0 || align_of::<T>() > ALIGN {
        return None;
    }
    let mut class = 0;
    while class < SIZES.len() {
        if size_of::<T>() <= SIZES[class] {
            return Some(class);
        }
        class += 1;
    }
    None
}

/// The layout of a block of `class`.
fn block_layout(class: usize) -> Layout {
    match Layout::from_size_align(SIZES[class], ALIGN) {
        Ok(layout) => layout,
        Err(_) => unreachable!("the block sizes are valid layouts"),
    }
}

/// A block from the stock, or a new one.
fn take_block(class: usize) -> NonNull<u8> {
    if let Some(block) = stock::take(class) {
        return block;
    }
    let layout = block_layout(class);
    // SAFETY: the layout's size is not zero.
    let block = unsafe { alloc(layout) };
    NonNull::new(block).unwrap_or_else(|| handle_alloc_error(layout))
}

/// Gives a block back to the stock, or frees it.
///
/// # Safety
///
/// `block` came from [`take_block`] with the same `class`, holds no live
/// value, and is not used again.
unsafe fn give_block(class: usize, block: NonNull<u8>) {
    if let Err(block) = stock::give(class, block) {
        // SAFETY: allocated with this layout (the caller's contract).
        unsafe { dealloc(block.as_ptr(), block_layout(class)) };
    }
}

#[cfg(not(loom))]
mod stock {
    use std::alloc::dealloc;
    use std::cell::RefCell;
    use std::ptr::NonNull;

    use super::{block_layout, KEEP, LOCAL_KEEP, SIZES};
    use crate::support::shard_lock::ShardLock;
    use crate::support::spares::Spares;

    /// A free block of the stock.
    struct Block(NonNull<u8>);

    // SAFETY: a free block is raw memory that no one else refers to: the
    // stock hands it to one taker at a time.
    unsafe impl Send for Block {}

    /// One size's blocks, on a cache line of its own.
    #[repr(align(128))]
    struct Stock(ShardLock<Spares<Block, KEEP>>);

    /// A plain `static`, not a `LazyLock`: nothing to initialize, so no
    /// first use that another thread would wait for, and no check of an
    /// initialization state on each take and give.
    static STOCKS: [Stock; SIZES.len()] =
        [const { Stock(ShardLock::new(Spares::new())) }; SIZES.len()];

    /// The blocks a thread keeps for itself, taken and given before the
    /// shared stock's: a wait that begins on the worker where an earlier
    /// one ended gets that one's block, still in this core's cache, with
    /// no atomic operation; the shared stock's lock line is met only when
    /// a thread has none (it begins more waits than end on it) or too
    /// many. Given back to the shared stock (or freed) as the thread exits.
    struct Local([RefCell<Spares<Block, LOCAL_KEEP>>; SIZES.len()]);

    impl Drop for Local {
        fn drop(&mut self) {
            for (class, spares) in self.0.iter_mut().enumerate() {
                while let Some(Block(block)) = spares.get_mut().take() {
                    if let Err(block) = give_shared(class, block) {
                        // SAFETY: a free block of `class`, allocated with
                        // its layout, used by no one.
                        unsafe { dealloc(block.as_ptr(), block_layout(class)) };
                    }
                }
            }
        }
    }

    thread_local! {
        static LOCAL: Local =
            const { Local([const { RefCell::new(Spares::new()) }; SIZES.len()]) };
    }

    /// A kept block of `class`: this thread's, else the shared stock's if
    /// it has one and is free.
    #[inline]
    pub(super) fn take(class: usize) -> Option<NonNull<u8>> {
        // (`try_with`: a thread whose locals are being torn down has none.)
        let local = LOCAL.try_with(|local| local.0[class].try_borrow_mut().ok()?.take());
        if let Ok(Some(Block(block))) = local {
            return Some(block);
        }
        let block = STOCKS[class].0.try_lock()?.take();
        block.map(|Block(block)| block)
    }

    /// Keeps `block`: this thread's if it has room, else the shared
    /// stock's; `Err` with it if both are full (or the shared one busy).
    #[inline]
    pub(super) fn give(class: usize, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
        let kept = LOCAL.try_with(|local| {
            let mut spares = local.0[class].try_borrow_mut().ok()?;
            if spares.is_full() {
                return None;
            }
            spares.give(Block(block));
            Some(())
        });
        if let Ok(Some(())) = kept {
            return Ok(());
        }
        give_shared(class, block)
    }

    /// Keeps `block` in the shared stock; `Err` with it if that is full or
    /// busy.
    fn give_shared(class: usize, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
        match STOCKS[class].0.try_lock() {
            Some(mut stock) if !stock.is_full() => {
                stock.give(Block(block));
                Ok(())
            }
            _ => Err(block),
        }
    }

    /// How many blocks of `class` are kept: in the shared stock and by
    /// this thread.
    #[cfg(any(test, feature = "test-util"))]
    pub(super) fn kept(class: usize) -> usize {
        let local = LOCAL
            .try_with(|local| local.0[class].borrow().count())
            .unwrap_or(0);
        STOCKS[class].0.lock().count() + local
    }
}

/// Under loom, no stock: every block is allocated and freed.
#[cfg(loom)]
mod stock {
    use std::ptr::NonNull;

    #[cfg(feature = "test-util")]
    pub(super) fn kept(_class: usize) -> usize {
        0
    }

    pub(super) fn take(_class: usize) -> Option<NonNull<u8>> {
        None
    }

    pub(super) fn give(_class: usize, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
        Err(block)
    }
}

/// The bytes of the blocks kept now: the shared stock's and the calling
/// thread's own.
#[cfg(feature = "test-util")]
pub(crate) fn kept_bytes() -> usize {
    (0..SIZES.len())
        .map(|class| stock::kept(class) * SIZES[class])
        .sum()
}

/// A pinned box whose block is recycled (see the module doc): what
/// `Box::pin` is to the allocator.
///
/// # Invariants
///
/// `ptr` points to a live `T` that this box owns: in a block of
/// `class_of::<T>()` taken by [`take_block`] when that is `Some`, in a
/// `Box<T>` leaked by [`Recycled::pin`] otherwise. The `T` never moves
/// while the box lives, and is dropped in place before its memory is given
/// back or freed.
pub(crate) struct Recycled<T> {
    ptr: NonNull<T>,
    /// Owns a `T` (for the drop check and auto traits).
    _owns: PhantomData<T>,
}

// SAFETY: the box owns its `T` as a `Box<T>` does.
unsafe impl<T: Send> Send for Recycled<T> {}
// SAFETY: as for `Send`: shared access to the box is shared access to `T`.
unsafe impl<T: Sync> Sync for Recycled<T> {}

/// As `Box<T>`: moving the box moves a pointer, never the `T`.
impl<T> Unpin for Recycled<T> {}

impl<T> Recycled<T> {
    /// `value`, pinned in a recycled block.
    #[inline]
    pub(crate) fn pin(value: T) -> Pin<Self> {
        let ptr = match class_of::<T>() {
            Some(class) => {
                let ptr = take_block(class).cast::<T>();
                // SAFETY: the block is at least `size_of::<T>()` bytes and
                // 16-byte aligned, at least `T`'s alignment (`class_of`),
                // and holds no value.
                unsafe { ptr.as_ptr().write(value) };
                ptr
            }
            None => NonNull::from(Box::leak(Box::new(value))),
        };
        let boxed = Self {
            ptr,
            _owns: PhantomData,
        };
        // SAFETY: the value stays where it was written until it is dropped
        // in place (the invariant): nothing moves it out of its block.
        unsafe { Pin::new_unchecked(boxed) }
    }

    /// The value `make` returns, pinned in a recycled block taken before
    /// it is made, so that a large value (a future) can be built where it
    /// will stay rather than on the stack and copied in.
    #[inline(always)]
    pub(crate) fn pin_with(make: impl FnOnce() -> T) -> Pin<Self> {
        let Some(class) = class_of::<T>() else {
            return Self::pin(make());
        };
        // Given back if `make` panics: it holds no value yet.
        struct Unfilled(usize, NonNull<u8>);
        impl Drop for Unfilled {
            fn drop(&mut self) {
                // SAFETY: taken just now with this class; never written.
                unsafe { give_block(self.0, self.1) };
            }
        }
        let block = Unfilled(class, take_block(class));
        let ptr = block.1.cast::<T>();
        // SAFETY: as in `pin`: the block fits and aligns a `T` and holds
        // no value.
        unsafe { ptr.as_ptr().write(make()) };
        std::mem::forget(block);
        let boxed = Self {
            ptr,
            _owns: PhantomData,
        };
        // SAFETY: as in `pin`.
        unsafe { Pin::new_unchecked(boxed) }
    }
}

impl<T> Deref for Recycled<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: a live `T` the box owns (the invariant).
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> DerefMut for Recycled<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: a live `T` the box owns, borrowed through the box.
        unsafe { self.ptr.as_mut() }
    }
}

impl<T> Drop for Recycled<T> {
    fn drop(&mut self) {
        let Some(class) = class_of::<T>() else {
            // SAFETY: leaked from a `Box<T>` by `pin` (the invariant), and
            // not used again.
            drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
            return;
        };
        /// Gives the block back even if the value's drop panics.
        struct GiveBack(usize, NonNull<u8>);
        impl Drop for GiveBack {
            fn drop(&mut self) {
                // SAFETY: the block of a value dropped just before.
                unsafe { give_block(self.0, self.1) };
            }
        }
        let _give_back = GiveBack(class, self.ptr.cast());
        // SAFETY: a live `T` in its block (the invariant), dropped once: the
        // block is given back right after, and the box is not used again.
        unsafe { std::ptr::drop_in_place(self.ptr.as_ptr()) };
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::cell::Cell;
    use std::future::Future;
    use std::pin::Pin;
    use std::rc::Rc;
    use std::task::{Context, Poll};

    use super::{class_of, stock, Recycled, KEEP, LOCAL_KEEP};

    /// Notes its drop.
    struct Noted(Rc<Cell<usize>>, [u64; 40]);

    impl Drop for Noted {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    #[test]
    fn sizes_go_to_the_smallest_block_that_fits_and_the_rest_to_the_allocator() {
        assert_eq!(class_of::<()>(), None);
        assert_eq!(class_of::<[u8; 1]>(), Some(0));
        assert_eq!(class_of::<[u8; 256]>(), Some(0));
        assert_eq!(class_of::<[u8; 257]>(), Some(1));
        assert_eq!(class_of::<[u64; 128]>(), Some(2));
        assert_eq!(class_of::<[u8; 1025]>(), None);
        #[repr(align(32))]
        struct Wide(#[allow(dead_code)] u8);
        assert_eq!(class_of::<Wide>(), None);
    }

    #[test]
    fn a_value_is_dropped_once_and_the_next_gets_a_whole_block() {
        let drops = Rc::new(Cell::new(0));
        let first = Recycled::pin(Noted(Rc::clone(&drops), [7; 40]));
        assert!(first.1.iter().all(|&v| v == 7));
        drop(first);
        assert_eq!(drops.get(), 1);
        // Tests run in parallel and share the stock, so the next box may
        // get another block than the first's: whichever it gets, the value
        // in it is whole.
        let second = Recycled::pin(Noted(Rc::clone(&drops), [9; 40]));
        assert!(second.1.iter().all(|&v| v == 9));
        drop(second);
        assert_eq!(drops.get(), 2);
    }

    /// (Under miri, a block neither given back nor freed is reported as a
    /// leak: one in the stock is reachable from its static.)
    #[test]
    fn a_value_whose_drop_panics_still_gives_its_block_back() {
        struct Panics([u8; 600]);
        impl Drop for Panics {
            fn drop(&mut self) {
                panic!("a hostile drop");
            }
        }
        assert_eq!(class_of::<Panics>(), Some(2));
        let boxed = Recycled::pin(Panics([1; 600]));
        assert_eq!(boxed.0[599], 1);
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(boxed))).is_err());
    }

    #[test]
    fn the_stock_keeps_at_most_keep_blocks_and_a_thread_its_own_few() {
        let boxes: Vec<_> = (0..KEEP + LOCAL_KEEP + 8)
            .map(|i| Recycled::pin([i as u8; 300]))
            .collect();
        drop(boxes);
        let class = class_of::<[u8; 300]>().expect("kept");
        assert!(stock::kept(class) <= KEEP + LOCAL_KEEP);
    }

    /// The thread's own blocks come first, last given first: a box made
    /// where one was just dropped gets that one's block (which no other
    /// thread can take meanwhile), still in this core's cache.
    #[test]
    fn a_thread_gets_back_the_block_it_gave_last() {
        let first = Recycled::pin([1u8; 700]);
        let at = &*first as *const [u8; 700] as usize;
        drop(first);
        let second = Recycled::pin([2u8; 700]);
        assert_eq!(&*second as *const [u8; 700] as usize, at);
        assert!(second.iter().all(|&b| b == 2));
    }

    /// A thread that ends with blocks of its own gives them to the shared
    /// stock or frees them (under miri, one lost is reported as a leak).
    #[test]
    fn a_thread_gives_its_blocks_back_as_it_ends() {
        std::thread::spawn(|| {
            let boxes: Vec<_> = (0..4).map(|i| Recycled::pin([i as u8; 100])).collect();
            drop(boxes);
            let class = class_of::<[u8; 100]>().expect("kept");
            assert!(stock::kept(class) >= 4, "kept by the thread");
        })
        .join()
        .expect("the thread ran");
    }

    #[test]
    fn a_pinned_future_polls_through_the_box() {
        let mut fut: Pin<Recycled<_>> = Recycled::pin(async { 41 + 1 });
        let cx = &mut Context::from_waker(futures::task::noop_waker_ref());
        assert_eq!(fut.as_mut().poll(cx), Poll::Ready(42));
    }

    #[test]
    fn a_large_or_overaligned_value_is_boxed_as_usual() {
        let big = Recycled::pin([3u8; 4096]);
        assert!(big.iter().all(|&b| b == 3));
        #[repr(align(64))]
        struct Wide(u8);
        let wide = Recycled::pin(Wide(5));
        assert_eq!(wide.0, 5);
        assert_eq!(&*wide as *const Wide as usize % 64, 0);
    }
}
