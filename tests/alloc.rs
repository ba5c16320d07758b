//! The uncontended path allocates nothing once the table is warm; readers
//! joining and leaving a key allocate nothing once warm; a transaction's
//! boxed wait fits a small allocator block.
//!
//! A counting global allocator counts allocations made by the current
//! thread while counting is switched on for it, the largest one, and the
//! bytes still live (allocated less freed), so the tests of this binary may
//! run in parallel without seeing each other's allocations. A committed
//! transaction frees all it allocated.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::hint::black_box;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::task::noop_waker_ref;
use keylock::LockTable;

struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

/// Notes `bytes` more (or fewer) live bytes, if counting.
fn live(bytes: isize) {
    if ON.try_with(Cell::get).unwrap_or(false) {
        let _ = LIVE.try_with(|l| l.set(l.get() + bytes));
    }
}

fn note(size: usize) {
    if ON.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    }
}

// SAFETY: every call is forwarded unchanged to `System`.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        live(layout.size() as isize);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        live(layout.size() as isize);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        live(new_size as isize - layout.size() as isize);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        live(-(layout.size() as isize));
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by this thread while `f` runs.
fn allocations(f: impl FnOnce()) -> usize {
    allocations_and_largest(f).0
}

/// Allocations made by this thread while `f` runs, and the largest (bytes).
fn allocations_and_largest(f: impl FnOnce()) -> (usize, usize) {
    ALLOCS.with(|a| a.set(0));
    LARGEST.with(|l| l.set(0));
    ON.with(|on| on.set(true));
    f();
    ON.with(|on| on.set(false));
    (ALLOCS.with(Cell::get), LARGEST.with(Cell::get))
}

/// The bytes this thread allocated and did not free while `f` ran, less
/// what the process-wide stock of recycled blocks gained meanwhile (a
/// contended transaction's waits give their blocks back there, not to the
/// allocator). The caller holds [`STOCK`] (the tests whose transactions
/// wait take it too), so that no other test's wait moves the stock
/// meanwhile: a test that only counts must take it as well, or a block
/// another test stocks while it counts is subtracted from its own bytes.
/// (`keylock::recycled_bytes` is a `test-util` function: so are this and
/// the tests that use it.)
#[cfg(feature = "test-util")]
fn kept_bytes(_stock: &std::sync::MutexGuard<'static, ()>, f: impl FnOnce()) -> isize {
    let stocked = keylock::recycled_bytes() as isize;
    LIVE.with(|l| l.set(0));
    ON.with(|on| on.set(true));
    f();
    ON.with(|on| on.set(false));
    LIVE.with(Cell::get) - (keylock::recycled_bytes() as isize - stocked)
}

/// Taken by the tests whose transactions wait: they take blocks from the
/// process-wide stock and give them back, and the tests that count see
/// the stock's state (under `cargo test`, the tests of this file share a
/// process).
static STOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn stock() -> std::sync::MutexGuard<'static, ()> {
    STOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `run` once to warm the table up, then asserts that a second run
/// allocates nothing.
fn assert_warm_allocates_nothing(mut run: impl FnMut()) {
    run();
    assert_eq!(allocations(&mut run), 0, "a warm run allocated");
}

/// The largest request glibc's allocator serves from its per-thread cache
/// (`tcache`), without locking an arena, on 64-bit targets: a block freed on
/// another thread than the one that allocated it costs an arena lock above
/// this size.
const SMALL_BLOCK: usize = 1032;

const N: usize = 10_000;

/// Polls `fut` once with a no-op waker and expects it to be ready.
fn poll_ready<F: Future>(fut: F) -> F::Output {
    match std::pin::pin!(fut).poll(&mut Context::from_waker(noop_waker_ref())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("an uncontended lock must be ready at once"),
    }
}

#[test]
fn counter_sees_allocations() {
    // The harness itself: an allocation made inside `allocations` is counted.
    assert_eq!(allocations(|| drop(black_box(Box::new(1u64)))), 1);
    assert_eq!(allocations(|| {}), 0);
    assert_eq!(
        allocations_and_largest(|| drop(black_box(vec![0u8; 2000]))),
        (1, 2000)
    );
}

#[test]
fn readers_joining_and_leaving_a_key_allocate_nothing_once_warm() {
    let table = LockTable::<u64>::builder().shards(1).build();
    let run = |table: &LockTable<u64>| {
        for k in 0..N as u64 / 10 {
            let readers: [_; 3] = std::array::from_fn(|_| table.try_lock_shared(k % 4).unwrap());
            assert_eq!(table.len(), 1);
            drop(readers);
        }
    };
    assert_warm_allocates_nothing(|| run(&table));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_transactions_contended_lock_all_boxes_its_wait_in_a_small_block() {
    use keylock::Mode;
    let _stock = stock();
    let table: LockTable<u64> = LockTable::new();
    let cx = &mut Context::from_waker(noop_waker_ref());
    for rounds in 0..2 {
        let mut holder = table.transaction();
        poll_ready(holder.lock_all([(2, Mode::Exclusive)])).unwrap();
        let mut txn = table.transaction();
        let (allocs, largest) = allocations_and_largest(|| {
            let mut all =
                std::pin::pin!(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
            assert!(all.as_mut().poll(cx).is_pending());
            holder.commit().unwrap();
            assert!(all.as_mut().poll(cx).is_ready());
        });
        // The boxed rest of the call, the name of its wait (registered
        // with the deadlock detector: the call holds a key), and the cell
        // its transaction can cancel (its wait and the guards it took, so
        // that a forgotten call keeps nothing once the transaction ended)
        // with the boxed table lock future in it.
        if rounds > 0 {
            assert!(allocs <= 4, "{allocs} allocations");
        }
        assert!(
            largest <= SMALL_BLOCK,
            "the waiting lock_all allocated a {largest}-byte block"
        );
        txn.commit().unwrap();
    }
    // The owned form's, which claims its keys first.
    let table = Arc::new(table);
    let holder = Arc::clone(&table).transaction_owned();
    poll_ready(holder.lock_all([(2, Mode::Exclusive)])).unwrap();
    let txn = Arc::clone(&table).transaction_owned();
    let (_, largest) = allocations_and_largest(|| {
        let mut all = std::pin::pin!(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
        assert!(all.as_mut().poll(cx).is_pending());
        holder.commit().unwrap();
        assert!(all.as_mut().poll(cx).is_ready());
    });
    assert!(largest <= SMALL_BLOCK, "a {largest}-byte block");
    txn.commit().unwrap();
    assert_eq!(table.len(), 0);
}

/// A warm contended transfer (a `lock_all` of two keys whose second is
/// held) takes the blocks of its waits from the process-wide stock and
/// gives them back: it allocates only the name its wait is registered
/// under with the deadlock detector (a small block), so the allocator is
/// not asked, on one thread, for blocks another thread frees. The same
/// for a single contended `lock`, which registers nothing (it holds
/// nothing).
#[test]
fn a_warm_contended_transfer_takes_its_boxes_from_the_stock() {
    use keylock::Mode;
    let _stock = stock();
    let table: LockTable<u64> = LockTable::new();
    let cx = &mut Context::from_waker(noop_waker_ref());
    for round in 0..3 {
        let holder = table.try_lock(2).unwrap();
        let mut txn = table.transaction();
        let (allocs, largest) = allocations_and_largest(|| {
            let mut all =
                std::pin::pin!(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
            assert!(all.as_mut().poll(cx).is_pending());
            drop(holder);
            assert!(all.as_mut().poll(cx).is_ready());
        });
        txn.commit().unwrap();
        if round > 0 {
            assert!(
                allocs <= 1 && largest <= 64,
                "a warm contended transfer allocated {allocs} blocks, the largest {largest} bytes"
            );
        }
        let holder = table.try_lock(3).unwrap();
        let mut txn = table.transaction();
        let allocs = allocations(|| {
            let mut one = std::pin::pin!(txn.lock(3, Mode::Exclusive));
            assert!(one.as_mut().poll(cx).is_pending());
            drop(holder);
            assert!(one.as_mut().poll(cx).is_ready());
        });
        txn.commit().unwrap();
        if round > 0 {
            assert_eq!(allocs, 0, "a warm contended lock allocated");
        }
    }
    assert!(table.is_empty());
}

/// A call that waited frees its wait's cell as it returns, not when its
/// transaction ends: a transaction that goes on after its calls finished
/// keeps nothing of them (the cells of forgotten calls alone stay on its
/// list until it ends).
#[test]
#[cfg(feature = "test-util")]
fn a_finished_wait_keeps_no_memory_until_the_transaction_ends() {
    use keylock::Mode;
    let stock = stock();
    let table: LockTable<u64> = LockTable::new();
    let cx = &mut Context::from_waker(noop_waker_ref());
    for round in 0..2 {
        // One key (`lock`), then two (`lock_all`), each waiting for a
        // holder that lets go meanwhile.
        for two in [false, true] {
            let holder = table.try_lock(2).unwrap();
            let mut txn = table.transaction();
            let kept = kept_bytes(&stock, || {
                if two {
                    let mut all =
                        std::pin::pin!(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
                    assert!(all.as_mut().poll(cx).is_pending());
                    drop(holder);
                    assert!(all.as_mut().poll(cx).is_ready());
                } else {
                    let mut one = std::pin::pin!(txn.lock(2, Mode::Exclusive));
                    assert!(one.as_mut().poll(cx).is_pending());
                    drop(holder);
                    assert!(one.as_mut().poll(cx).is_ready());
                }
            });
            // The first round warms the table up (its entries' room).
            if round > 0 {
                assert_eq!(kept, 0, "a finished wait kept memory (two keys: {two})");
            }
            txn.commit().unwrap();
        }
    }
    // The owned form's. Its first wait makes room for the waits' wakers
    // and the keys, which the transaction keeps for what it does next: the
    // second, the same after the first's keys were released, is measured.
    let table = Arc::new(table);
    for round in 0..2 {
        let txn = Arc::clone(&table).transaction_owned();
        for measured in [false, true] {
            let holder = table.try_lock(2).unwrap();
            let kept = kept_bytes(&stock, || {
                let mut all =
                    std::pin::pin!(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
                assert!(all.as_mut().poll(cx).is_pending());
                drop(holder);
                assert!(all.as_mut().poll(cx).is_ready());
            });
            if round > 0 && measured {
                assert_eq!(kept, 0, "the owned form's finished wait kept memory");
            }
            txn.release(&1).unwrap();
            txn.release(&2).unwrap();
        }
        txn.commit().unwrap();
    }
    assert!(table.is_empty());
}

/// A small `lock_all` (three keys: up to four are kept in place) into a
/// transaction that already holds a key, uncontended, allocates nothing
/// once warm, in both forms.
#[test]
fn a_small_lock_all_on_a_held_set_allocates_nothing_once_warm() {
    use keylock::Mode;
    let asked = || {
        [
            (3, Mode::Exclusive),
            (1, Mode::Exclusive),
            (2, Mode::Shared),
        ]
    };
    // Warms `$txn` up (its set spills once, with room for the linear
    // scan's keys, then keeps it; it holds key 0 throughout), then checks
    // that the call and the releases of its keys allocate nothing.
    macro_rules! check {
        ($txn:expr) => {{
            let txn = $txn;
            poll_ready(txn.lock_all((0..5).map(|k| (k, Mode::Exclusive)))).unwrap();
            for k in 1..5 {
                txn.release(&k).unwrap();
            }
            assert_warm_allocates_nothing(|| {
                poll_ready(txn.lock_all(asked())).unwrap();
                for k in 1..4 {
                    txn.release(&k).unwrap();
                }
            });
        }};
    }
    let table = Arc::new(LockTable::<u64>::new());
    check!(&mut table.transaction());
    check!(&Arc::clone(&table).transaction_owned());
    assert!(table.is_empty());
}

#[test]
fn uncontended_try_lock_u64_allocates_nothing() {
    let table = LockTable::new();
    for k in 0..N as u64 {
        drop(table.try_lock(k).unwrap());
    }
    let n = allocations(|| {
        for k in 0..N as u64 {
            let g = table.try_lock(black_box(k)).unwrap();
            black_box(g.token());
            drop(g);
        }
    });
    assert_eq!(n, 0);
    assert_eq!(table.len(), 0);
    assert_eq!(table.stats().acquisitions, 2 * N as u64);
}

#[test]
fn uncontended_lock_await_u64_allocates_nothing() {
    let table = LockTable::new();
    let run = |table: &LockTable<u64>| {
        for k in 0..N as u64 {
            let g = futures::executor::block_on(table.lock(black_box(k)));
            black_box(g.token());
            drop(g);
            let g = poll_ready(table.lock(black_box(k)));
            drop(g);
        }
    };
    assert_warm_allocates_nothing(|| run(&table));
    assert_eq!(table.len(), 0);
}

#[test]
fn uncontended_string_keys_allocate_nothing() {
    let table = LockTable::new();
    let make = || {
        (0..N)
            .map(|i| format!("tenant-{i}"))
            .collect::<Vec<String>>()
    };
    // Warm with the same key values, so every shard they land in is warm.
    let (warm_try, warm_lock) = (make(), make());
    let (keys_try, keys_lock) = (make(), make());
    for k in warm_try {
        drop(table.try_lock(k).unwrap());
    }
    for k in warm_lock {
        // `block_on` sets up its thread-local notifier on first use.
        drop(futures::executor::block_on(table.lock(k)));
    }

    let n = allocations(|| {
        for k in keys_try {
            let g = table.try_lock(k).unwrap();
            black_box(g.key().len());
            drop(g);
        }
        for k in keys_lock {
            let g = futures::executor::block_on(table.lock(k));
            black_box(g.key().len());
            drop(g);
        }
    });
    assert_eq!(n, 0);
    // Lookups by `&str` allocate nothing either.
    let n = allocations(|| {
        for i in 0..100 {
            black_box(table.is_locked(black_box(if i % 2 == 0 { "tenant-1" } else { "x" })));
            black_box(table.waiters("tenant-2"));
        }
    });
    assert_eq!(n, 0);
    assert_eq!(table.len(), 0);
}

#[test]
fn uncontended_owned_locks_on_an_arc_table_allocate_nothing() {
    let table = Arc::new(LockTable::new());
    let run = |table: &Arc<LockTable<u64>>| {
        for k in 0..N as u64 {
            let g = table.clone().try_lock_owned(black_box(k)).unwrap();
            drop(g);
            let g = futures::executor::block_on(table.clone().lock_owned(black_box(k)));
            black_box(g.token());
            drop(g);
            drop(poll_ready(table.clone().lock_owned(k)));
        }
    };
    assert_warm_allocates_nothing(|| run(&table));
    assert_eq!(table.len(), 0);
    assert_eq!(Arc::strong_count(&table), 1);
}

#[test]
fn holding_several_keys_at_once_allocates_nothing_once_warm() {
    let table = LockTable::<u64>::builder().shards(4).build();
    let run = |table: &LockTable<u64>| {
        for round in 0..N as u64 / 8 {
            let guards: [_; 8] =
                std::array::from_fn(|i| table.try_lock(round * 8 + i as u64).unwrap());
            assert_eq!(table.len(), 8);
            drop(guards);
        }
    };
    assert_warm_allocates_nothing(|| run(&table));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_warm_handoff_to_a_waiter_allocates_nothing() {
    let table = LockTable::new();
    let cx = &mut Context::from_waker(noop_waker_ref());
    let run = |table: &LockTable<u64>, cx: &mut Context<'_>| {
        for k in 0..N as u64 / 10 {
            let holder = table.try_lock(k).unwrap();
            let mut a = std::pin::pin!(table.lock(k));
            let mut b = std::pin::pin!(table.lock(k));
            assert!(a.as_mut().poll(cx).is_pending());
            assert!(b.as_mut().poll(cx).is_pending());
            drop(holder);
            let Poll::Ready(g) = a.as_mut().poll(cx) else {
                panic!("the head waiter was handed the key");
            };
            drop(g);
            // b, granted and unobserved, is dropped at the end of the
            // iteration and frees the key.
        }
    };
    assert_warm_allocates_nothing(|| run(&table, cx));
    assert_eq!(table.len(), 0);
    assert_eq!(table.stats().handoffs, 2 * 2 * (N as u64 / 10));
}

/// A committed transaction frees everything it allocated: its set's room
/// once it held more keys than it keeps in place. (A commit that skipped
/// the transaction's drop glue while it had something to free would keep
/// these bytes.)
#[test]
#[cfg(feature = "test-util")]
fn a_committed_transaction_frees_all_it_allocated() {
    use keylock::Mode;
    let stock = stock();
    let table = LockTable::<u64>::new();
    let lock_five = || {
        let mut txn = table.transaction();
        let got = poll_ready(txn.lock_all((0..5).map(|k| (k, Mode::Exclusive))));
        assert_eq!(got.expect("uncontended").acquired(), 5);
        txn.commit().expect("no lease");
    };
    let lock_two = || {
        let mut txn = table.transaction();
        poll_ready(txn.lock_all([(7, Mode::Exclusive), (8, Mode::Exclusive)]))
            .expect("uncontended");
        txn.commit().expect("no lease");
    };
    for run in [&lock_five as &dyn Fn(), &lock_two] {
        run();
        assert_eq!(
            kept_bytes(&stock, run),
            0,
            "a committed transaction kept memory"
        );
    }
    assert!(table.is_empty());
}
