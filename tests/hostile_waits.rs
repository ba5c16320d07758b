//! A transaction's contended waits (their recycled boxes, parked waits
//! and cells, their detector registrations) under hostile keys, wakers and
//! forgotten futures: whatever panics, nothing is stranded, and a wait
//! whose end panics (the drop of its registration's copy of the key)
//! releases the grant it was returning before the panic goes on. No
//! threads, so miri's leak check runs: a block neither freed nor back in
//! the stock is reported, a double drop or use after free is UB.

#![cfg(feature = "test-util")]

mod common;

use std::cmp::Ordering;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use keylock::{LockTable, Mode};

/// What the keys of a test do when armed.
#[derive(Default)]
struct Bombs {
    hash: AtomicBool,
    eq: AtomicBool,
    drop: AtomicBool,
}

#[derive(Clone)]
struct K(u32, Arc<Bombs>);

impl std::fmt::Debug for K {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "K({})", self.0)
    }
}

fn boom(flag: &AtomicBool, what: &str) {
    if flag.load(SeqCst) && !std::thread::panicking() {
        panic!("planted: {what}");
    }
}

impl Hash for K {
    fn hash<H: Hasher>(&self, h: &mut H) {
        boom(&self.1.hash, "hash");
        self.0.hash(h);
    }
}
impl PartialEq for K {
    fn eq(&self, o: &Self) -> bool {
        boom(&self.1.eq, "eq");
        self.0 == o.0
    }
}
impl Eq for K {}
impl PartialOrd for K {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for K {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.cmp(&o.0)
    }
}
impl Drop for K {
    fn drop(&mut self) {
        boom(&self.1.drop, "drop");
    }
}

/// A waker whose clone, wake or drop panic when armed.
struct WakerBombs {
    clone: AtomicBool,
    wake: AtomicBool,
    drop: AtomicBool,
    live: AtomicUsize,
}

static WB: WakerBombs = WakerBombs {
    clone: AtomicBool::new(false),
    wake: AtomicBool::new(false),
    drop: AtomicBool::new(false),
    live: AtomicUsize::new(0),
};

fn vt_clone(p: *const ()) -> RawWaker {
    boom(&WB.clone, "waker clone");
    WB.live.fetch_add(1, SeqCst);
    RawWaker::new(p, &VT)
}
fn vt_wake(_: *const ()) {
    // Consumed even if the wake panics.
    WB.live.fetch_sub(1, SeqCst);
    boom(&WB.wake, "wake");
}
fn vt_wake_by_ref(_: *const ()) {
    boom(&WB.wake, "wake");
}
fn vt_drop(_: *const ()) {
    WB.live.fetch_sub(1, SeqCst);
    boom(&WB.drop, "waker drop");
}
static VT: RawWakerVTable = RawWakerVTable::new(vt_clone, vt_wake, vt_wake_by_ref, vt_drop);

fn hostile_waker() -> Waker {
    WB.live.fetch_add(1, SeqCst);
    // SAFETY: the vtable's functions ignore the data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VT)) }
}

fn disarm_waker() {
    WB.clone.store(false, SeqCst);
    WB.wake.store(false, SeqCst);
    WB.drop.store(false, SeqCst);
}

fn poll_caught<F: Future + ?Sized>(f: Pin<&mut F>, w: &Waker) -> Option<Poll<F::Output>> {
    catch_unwind(AssertUnwindSafe(|| f.poll(&mut Context::from_waker(w)))).ok()
}

fn caught(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}

impl Bombs {
    /// Arms one bomb: the key's `Hash` (0), `Eq` (1) or `Drop` (2), or
    /// the waker's `clone` (3), `wake` (4) or `drop` (5).
    fn arm(&self, bomb: usize) {
        match bomb {
            0 => self.hash.store(true, SeqCst),
            1 => self.eq.store(true, SeqCst),
            2 => self.drop.store(true, SeqCst),
            3 => WB.clone.store(true, SeqCst),
            4 => WB.wake.store(true, SeqCst),
            _ => WB.drop.store(true, SeqCst),
        }
    }

    /// Disarms every bomb, the key's and the waker's.
    fn disarm(&self) {
        self.hash.store(false, SeqCst);
        self.eq.store(false, SeqCst);
        self.drop.store(false, SeqCst);
        disarm_waker();
    }
}

/// Every one of `keys` can be had, and the table keeps no entry: nothing
/// was stranded.
fn assert_nothing_stranded(table: &LockTable<K>, keys: impl IntoIterator<Item = K>, what: &str) {
    for key in keys {
        let n = key.0;
        assert!(table.try_lock(key).is_ok(), "{what}: key {n} stranded");
    }
    assert!(table.is_empty(), "{what}: an entry left");
}

/// A borrowed lock_all waits for key 1; then each of the key's bombs and
/// each of the waker's goes off at the second poll or at the drop.
#[test]
fn borrowed_lock_all_with_hostile_keys_and_wakers() {
    for bomb in 0..6 {
        for complete in [true, false] {
            let bombs = Arc::new(Bombs::default());
            let k = |n| K(n, Arc::clone(&bombs));
            let table: LockTable<K> = LockTable::builder().shards(1).build();
            let holder = table.try_lock(k(1)).unwrap();
            let mut txn = table.transaction();
            let w = hostile_waker();
            {
                let mut fut =
                    Box::pin(txn.lock_all([(k(1), Mode::Exclusive), (k(2), Mode::Exclusive)]));
                assert!(matches!(poll_caught(fut.as_mut(), &w), Some(Poll::Pending)));
                bombs.arm(bomb);
                if complete {
                    caught(|| drop(holder));
                    let _ = poll_caught(fut.as_mut(), &w);
                    caught(|| drop(fut));
                } else {
                    caught(|| drop(fut));
                    caught(|| drop(holder));
                }
            }
            caught(|| drop(txn));
            bombs.disarm();
            drop(w);
            assert_nothing_stranded(
                &table,
                [k(1), k(2)],
                &format!("bomb {bomb}, complete {complete}"),
            );
        }
    }
    assert_eq!(WB.live.load(SeqCst), 0);
}

/// The owned form: a shared hold of key 1 upgraded by a lock_all that
/// also waits (the upgrade's boxed future and the cell), then hostile
/// keys and wakers; and a single `lock` of a busy key.
#[test]
fn owned_upgrade_and_lock_with_hostile_keys() {
    owned_upgrade_scenarios(|bomb, complete| !(bomb == 2 && complete));
}

/// The owned form's upgrade is granted, and the end of its wait drops the
/// registration's copy of the key, whose `Drop` panics: the granted guard
/// the wait was returning is released before the panic goes on (it was
/// leaked, and key 1 held for good, when the wait ended in a guard's drop
/// as it returned).
#[test]
fn owned_upgrade_whose_registration_key_drop_panics_strands_nothing() {
    owned_upgrade_scenarios(|bomb, complete| bomb == 2 && complete);
}

fn owned_upgrade_scenarios(pick: impl Fn(usize, bool) -> bool) {
    for bomb in 0..3 {
        for complete in [true, false] {
            if !pick(bomb, complete) {
                continue;
            }
            let bombs = Arc::new(Bombs::default());
            let k = |n| K(n, Arc::clone(&bombs));
            let table: Arc<LockTable<K>> = Arc::new(LockTable::builder().shards(1).build());
            let txn = Arc::clone(&table).transaction_owned();
            let w = common::W::new();
            let mut first = Box::pin(txn.lock(k(1), Mode::Shared));
            assert!(w.poll(&mut first).is_ready());
            drop(first);
            let other = table.try_lock_shared(k(1)).unwrap();
            let mut up = Box::pin(txn.lock_all([(k(1), Mode::Exclusive), (k(2), Mode::Exclusive)]));
            assert!(w.poll(&mut up).is_pending());
            bombs.arm(bomb);
            if complete {
                caught(|| drop(other));
                caught(|| {
                    let _ = w.poll(&mut up);
                });
                caught(|| drop(up));
            } else {
                caught(|| drop(up));
                caught(|| drop(other));
            }
            caught(|| drop(txn));
            bombs.disarm();
            assert_nothing_stranded(
                &table,
                [k(1), k(2)],
                &format!("bomb {bomb}, complete {complete}"),
            );
        }
    }
}

/// Forgotten mid-wait (both forms, lock and lock_all): the transaction's
/// end drops what it parked or celled; the forgotten future's own box
/// leaks as a Box would. Not for miri (leaks on purpose).
#[test]
#[cfg_attr(miri, ignore = "forgets on purpose")]
fn forgotten_waits_strand_nothing() {
    let table: Arc<LockTable<u64>> = Arc::new(LockTable::builder().shards(1).build());
    for round in 0..200 {
        let holder = table.try_lock(1).unwrap();
        {
            let mut txn = table.transaction();
            if round % 2 == 0 {
                common::forget_pending(txn.lock_all([(2, Mode::Exclusive), (1, Mode::Exclusive)]));
            } else {
                common::forget_pending(txn.lock(1, Mode::Exclusive));
            }
            // The next wait of the same transaction drops the forgotten one's.
            let mut again = Box::pin(txn.lock(1, Mode::Shared));
            let p = common::poll_noop(again.as_mut());
            assert!(
                !matches!(p, std::task::Poll::Ready(Ok(_))),
                "round {round}: {p:?}"
            );
            drop(again);
            if round % 3 == 0 {
                txn.abort();
            }
        }
        let owned = Arc::clone(&table).transaction_owned();
        common::forget_pending(owned.lock_all([(2, Mode::Exclusive), (1, Mode::Exclusive)]));
        drop(owned);
        drop(holder);
        assert!(table.is_empty(), "round {round}");
    }
    table.assert_consistent();
}

/// The borrowed form, registered with the detector (it holds key 0 when
/// it waits for key 1): the registration's key drop panics as the wait
/// ends granted.
#[test]
fn borrowed_registered_wait_whose_key_drop_panics_strands_nothing() {
    for single in [false, true] {
        let bombs = Arc::new(Bombs::default());
        let k = |n| K(n, Arc::clone(&bombs));
        let table: LockTable<K> = LockTable::builder().shards(1).build();
        let holder = table.try_lock(k(1)).unwrap();
        let mut txn = table.transaction();
        let w = common::W::new();
        {
            let mut first = Box::pin(txn.lock(k(0), Mode::Exclusive));
            assert!(w.poll(&mut first).is_ready());
        }
        {
            let mut fut: Pin<Box<dyn Future<Output = bool> + '_>> = if single {
                Box::pin(async { txn.lock(k(1), Mode::Exclusive).await.is_ok() })
            } else {
                Box::pin(async {
                    txn.lock_all([(k(1), Mode::Exclusive), (k(2), Mode::Exclusive)])
                        .await
                        .is_ok()
                })
            };
            assert!(w.poll(&mut fut).is_pending());
            bombs.arm(2);
            caught(|| drop(holder));
            caught(|| {
                let _ = w.poll(&mut fut);
            });
            caught(|| drop(fut));
        }
        caught(|| drop(txn));
        bombs.disarm();
        assert_nothing_stranded(&table, [k(0), k(1), k(2)], &format!("single {single}"));
    }
}
