//! An owned transaction's lock runs its one-step fast path under the set's
//! spin lock. The caller's key must never be dropped there (its `Drop` is
//! user code, which may call back into the transaction and would spin on
//! that lock for ever): not when the key is counted on a grant the set
//! already has, not when the table did not keep it, and not when a key's
//! `Eq` panics in the set's search or in the table's probe and unwinds
//! past it. Each test's key calls back into the transaction as it drops;
//! a watchdog turns a hang into a failure.
#![cfg(all(feature = "test-util", not(loom)))]

mod common;
use common::watchdog;

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::hash::{BuildHasher, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Waker};

use keylock::{LockTable, Mode, OwnedTransaction};

#[derive(Clone, Copy, Default)]
struct Collide;
struct ConstHasher;
impl Hasher for ConstHasher {
    fn finish(&self) -> u64 {
        7
    }
    fn write(&mut self, _: &[u8]) {}
}
impl BuildHasher for Collide {
    type Hasher = ConstHasher;
    fn build_hasher(&self) -> ConstHasher {
        ConstHasher
    }
}

thread_local! {
    static TXN: RefCell<Option<Weak<OwnedTransaction<K, Collide>>>> = const { RefCell::new(None) };
    static EQ_ARMED: Cell<bool> = const { Cell::new(false) };
    static CALLED_BACK: Cell<usize> = const { Cell::new(0) };
}

#[derive(Debug)]
struct K(u32);

impl Hash for K {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl PartialEq for K {
    fn eq(&self, other: &Self) -> bool {
        if EQ_ARMED.get() && !std::thread::panicking() {
            EQ_ARMED.set(false);
            panic!("planted K::eq");
        }
        self.0 == other.0
    }
}
impl Eq for K {}
impl Clone for K {
    fn clone(&self) -> Self {
        K(self.0)
    }
}
impl Drop for K {
    fn drop(&mut self) {
        // Calls back into the transaction: spins forever if its lock is held.
        let txn = TXN.with(|t| t.borrow().as_ref().and_then(Weak::upgrade));
        if let Some(txn) = txn {
            let _ = txn.len();
            CALLED_BACK.set(CALLED_BACK.get() + 1);
        }
    }
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> std::thread::Result<std::task::Poll<F::Output>> {
    catch_unwind(AssertUnwindSafe(|| {
        Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
    }))
}

/// `lock`'s fast path: the caller's key is owned by `fast_in`, run under the
/// set's lock; `set.find`'s `Eq` panics and the key drops there.
#[test]
fn owned_lock_fast_path_eq_panic_drops_key_outside_the_set_lock() {
    watchdog("fast", HUNG, || {
        let table = Arc::new(LockTable::<K>::builder().hasher(Collide).build());
        let txn = Arc::new(table.clone().transaction_owned());
        txn.blocking_lock(K(1), Mode::Exclusive).unwrap();
        TXN.with(|t| *t.borrow_mut() = Some(Arc::downgrade(&txn)));
        EQ_ARMED.set(true);
        let mut call = Box::pin(txn.lock(K(2), Mode::Exclusive));
        let polled = poll_once(&mut call);
        assert!(polled.is_err(), "the planted Eq panic propagates");
        drop(call);
        TXN.with(|t| *t.borrow_mut() = None);
        assert_eq!(txn.len(), 1);
    });
}

/// `lock`'s fast path on an empty set: the table's probe (under the set's
/// lock) compares the caller's key with another holder's colliding key; its
/// `Eq` panics and the key, owned by `try_lock_leaving`, drops under the
/// set's lock.
#[test]
fn owned_lock_fast_path_table_probe_eq_panic_drops_key_outside_the_set_lock() {
    watchdog("probe", HUNG, || {
        let table = Arc::new(LockTable::<K>::builder().hasher(Collide).build());
        let other = table.try_lock(K(1)).expect("free");
        let txn = Arc::new(table.clone().transaction_owned());
        TXN.with(|t| *t.borrow_mut() = Some(Arc::downgrade(&txn)));
        EQ_ARMED.set(true);
        let mut call = Box::pin(txn.lock(K(2), Mode::Exclusive));
        let polled = poll_once(&mut call);
        assert!(polled.is_err(), "the planted Eq panic propagates");
        drop(call);
        TXN.with(|t| *t.borrow_mut() = None);
        drop(other);
        assert_eq!(txn.len(), 0);
    });
}

/// A key the set holds already, asked again: counted on its grant, the
/// caller's key drops once the set is unlocked; and a key shared with
/// another holder, whose entry the table keeps its own key for: the
/// caller's copy drops the same way.
#[test]
fn owned_lock_fast_path_drops_an_unkept_key_outside_the_set_lock() {
    watchdog("unkept", HUNG, || {
        let table = Arc::new(LockTable::<K>::builder().hasher(Collide).build());
        let reader = table.try_lock_shared(K(2)).expect("free");
        let txn = Arc::new(table.clone().transaction_owned());
        txn.blocking_lock(K(1), Mode::Exclusive).unwrap();
        TXN.with(|t| *t.borrow_mut() = Some(Arc::downgrade(&txn)));
        let before = CALLED_BACK.get();
        let got = txn
            .blocking_lock(K(1), Mode::Exclusive)
            .expect("held: counted");
        assert_eq!(got.count, 2, "re-entered");
        assert!(CALLED_BACK.get() > before, "the caller's key was dropped");
        let before = CALLED_BACK.get();
        txn.blocking_lock(K(2), Mode::Shared)
            .expect("shared with the reader");
        assert!(CALLED_BACK.get() > before, "the caller's copy was dropped");
        TXN.with(|t| *t.borrow_mut() = None);
        assert_eq!(txn.len(), 2);
        drop(reader);
    });
}

/// What a hang of one of this file's tests means.
const HUNG: &str = "a key dropped under the set's lock called back into the transaction";
