//! What the table costs in memory: per idle key, per waiting future, after a
//! storm of a million waiters on one key that are all cancelled, and whether
//! memory follows the live set when a storm leaves one key or one waiter
//! behind.
//!
//! Run with `cargo run --release --example memory`. Memory is counted as the
//! heap bytes live (a counting global allocator), which is exact; resident
//! set size (Linux `/proc/self/statm`) is shown beside it, but it also counts
//! what the allocator keeps for reuse after a free.

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::task::{Context, Poll};

use keylock::LockTable;

/// Counts the heap bytes live.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards every call to the system allocator unchanged, only
// counting the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Relaxed)
}

const WAITERS: usize = 1_000_000;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4
}

/// Registers `WAITERS` waiters on a held key, then drops them all. Returns
/// the table's bytes per waiter, and the live bytes afterwards.
fn storm(table: &LockTable<u64>) -> (f64, i64) {
    let held = table.try_lock(1).expect("free");
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut waiters: Vec<_> = (0..WAITERS).map(|_| Box::pin(table.lock(1))).collect();
    let before = live();
    for w in &mut waiters {
        assert!(matches!(std::pin::Pin::new(w).poll(&mut cx), Poll::Pending));
    }
    assert_eq!(table.waiters(&1), WAITERS);
    let per_waiter = (live() - before) as f64 / WAITERS as f64;
    drop(waiters);
    drop(held);
    assert_eq!(table.len(), 0);
    (per_waiter, live())
}

/// Holds `WAITERS` distinct keys at once, then releases all but one: the
/// table's heap with one key left, minus before the storm.
fn key_storm_leaving_one(table: &LockTable<u64>) -> (i64, i64) {
    let before = live();
    let mut guards: Vec<_> = (2_000_000..2_000_000 + WAITERS as u64)
        .map(|k| table.try_lock(k).expect("free"))
        .collect();
    // The guards' own vector is not the table's: count it out.
    let vec_bytes = (guards.capacity() * std::mem::size_of::<keylock::Guard<'_, u64>>()) as i64;
    let peak = live() - before - vec_bytes;
    let last = guards.pop().expect("one");
    drop(guards);
    let left = live() - before;
    assert_eq!(table.len(), 1);
    drop(last);
    (peak, left)
}

/// Queues `WAITERS` waiters on a held key and drops all but one: the table's
/// heap with one waiter left, minus before (the futures' own boxes are
/// counted out).
fn waiter_storm_leaving_one(table: &LockTable<u64>) -> i64 {
    let held = table.try_lock(3).expect("free");
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut waiters: Vec<_> = (0..WAITERS).map(|_| Box::pin(table.lock(3))).collect();
    for w in &mut waiters {
        assert!(matches!(std::pin::Pin::new(w).poll(&mut cx), Poll::Pending));
    }
    let mut last = waiters.pop().expect("one");
    drop(waiters);
    assert_eq!(table.waiters(&3), 1);
    let future_bytes = std::mem::size_of_val(&*last) as i64;
    let left = live() - future_bytes;
    drop(held);
    assert!(matches!(last.as_mut().poll(&mut cx), Poll::Ready(_)));
    drop(last);
    left
}

fn main() {
    let table = LockTable::<u64>::new();
    // Warm every shard once (its hash table and key-cell pool): what stays
    // is per shard, never per key.
    for k in 0..10_000u64 {
        drop(table.try_lock(k).expect("free"));
    }
    let baseline = live();
    let baseline_rss = rss_kib();

    // Idle keys: a million keys locked and released take nothing.
    for k in 10_000..1_010_000u64 {
        drop(table.try_lock(k).expect("free"));
    }
    assert_eq!(table.len(), 0);
    let after_idle = live();

    let (per_waiter_1, after_1) = storm(&table);
    let (per_waiter_2, after_2) = storm(&table);

    let (key_peak, key_left) = key_storm_leaving_one(&table);
    let before_waiters = live();
    let waiter_left = waiter_storm_leaving_one(&table) - before_waiters;
    let after_all = live();

    println!("| measure | value |");
    println!("|---|---:|");
    println!(
        "| heap after 1M distinct keys locked and released, minus before | {} bytes (len = {}) |",
        after_idle - baseline,
        table.len()
    );
    println!("| table state per waiting future, round 1 | {per_waiter_1:.1} bytes |");
    println!("| table state per waiting future, round 2 | {per_waiter_2:.1} bytes |");
    println!(
        "| heap after storm 1 (1M waiters on one key, all dropped), minus before | {} bytes |",
        after_1 - baseline
    );
    println!(
        "| heap after storm 2, minus after storm 1 | {} bytes |",
        after_2 - after_1
    );
    println!(
        "| table heap at the peak of 1M keys held at once | {:.1} MiB |",
        key_peak as f64 / (1 << 20) as f64
    );
    println!("| table heap with 1 of those keys still held | {key_left} bytes |");
    println!("| table heap with 1 waiter left of 1M cancelled | {waiter_left} bytes |");
    println!(
        "| heap after everything, minus the warm baseline | {} bytes |",
        after_all - baseline
    );
    println!("| RSS before / after both storms | {baseline_rss} KiB / {} KiB (allocator keeps freed pages) |", rss_kib());
    assert!(after_idle - baseline <= 0, "idle keys must take no memory");
    assert!(after_2 <= after_1, "a second storm must not grow the heap");
    assert!(
        key_left < 64 << 10,
        "one key left after a storm must not keep the storm's table"
    );
    assert!(waiter_left <= 0, "waiters take no table memory");
}
