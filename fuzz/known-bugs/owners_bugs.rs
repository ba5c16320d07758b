//! Tests of the open bugs the owners model led to (fuzz/README.md, "Bugs
//! found"). Each fails on the code it was written against; move it into
//! `tests/` with its fix. Not compiled here.

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::task::{noop_waker, waker, ArcWake};
use keylock::{LockTable, Mode, TransactionError};

/// Hashes a `u64` key to itself, so that `lock_all`'s canonical order (by
/// hash) is the keys' order.
#[derive(Clone, Copy, Default)]
struct Identity;
struct IdentityHasher(u64);
impl BuildHasher for Identity {
    type Hasher = IdentityHasher;
    fn build_hasher(&self) -> IdentityHasher {
        IdentityHasher(0)
    }
}
impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("u64 keys only")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A waker whose first wake panics.
struct Bomb(AtomicBool);
impl ArcWake for Bomb {
    fn wake_by_ref(me: &Arc<Self>) {
        if !me.0.swap(true, SeqCst) {
            panic!("waker");
        }
    }
}

/// A `lock_all` that upgraded a held shared key and then waits for another
/// is dropped; undoing its upgrade (`Stage::drop` downgrades it) admits a
/// queued reader whose waker panics. The panic leaves `Stage::drop` before
/// it gives its claims back: the upgraded guard, out of the set, is dropped
/// by the unwinding (the transaction loses the key it held before the
/// call), and the set keeps the two slots busy for ever (the key counted
/// but with no mode; every later call for either key fails `InFlight`).
#[test]
fn a_panicking_wake_while_a_dropped_lock_all_undoes_its_upgrade_keeps_the_earlier_lock() {
    let table = LockTable::<u64>::builder().hasher(Identity).build();
    let mut txn = table.transaction();
    futures::executor::block_on(txn.lock(1, Mode::Shared)).unwrap();
    let other = table.try_lock(2).unwrap();

    let noop = noop_waker();
    let mut cx = Context::from_waker(&noop);
    let mut all = Box::pin(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
    // Key 1 is upgraded at once (the only holder); key 2 is waited for.
    assert!(all.as_mut().poll(&mut cx).is_pending());
    assert_eq!(table.waiters(&2), 1);

    // A reader queues behind the upgraded (exclusive) grant of key 1.
    let bomb = waker(Arc::new(Bomb(AtomicBool::new(false))));
    let mut reader = Box::pin(table.lock_shared(1));
    assert!(reader.as_mut().poll(&mut Context::from_waker(&bomb)).is_pending());

    // Dropping the call downgrades key 1 back, which admits the reader and
    // wakes it: its waker panics, and the panic reaches the caller.
    let dropped = catch_unwind(AssertUnwindSafe(|| drop(all)));
    assert!(dropped.is_err(), "the waker's panic is resumed");

    // The transaction holds key 1 shared, as before the call ...
    assert_eq!(txn.count(&1), 1);
    assert_eq!(txn.mode(&1), Some(Mode::Shared), "key 1 as before the call");
    // ... and nothing of key 2.
    assert_eq!(txn.count(&2), 0);
    assert_eq!(txn.len(), 1);
    let Poll::Ready(g) = reader.as_mut().poll(&mut cx) else {
        panic!("the reader was admitted")
    };
    assert_eq!(g.mode(), Mode::Shared);
    drop(g);
    assert!(table.is_locked(&1), "the transaction still holds key 1");
    // Later calls for both keys work.
    drop(other);
    let again = futures::executor::block_on(txn.lock(2, Mode::Exclusive));
    assert!(
        !matches!(again, Err(TransactionError::InFlight { .. })),
        "key 2 is not stuck in flight: {again:?}"
    );
    let again = futures::executor::block_on(txn.lock(1, Mode::Shared));
    assert!(
        !matches!(again, Err(TransactionError::InFlight { .. })),
        "key 1 is not stuck in flight: {again:?}"
    );
}
