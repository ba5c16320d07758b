//! A key's `Eq` panics in a probe (the one user code allowed under a lock)
//! while its `Drop` calls back into the table (every shard) and the owned
//! transactions in play: unwinding must drop no key under any lock. One
//! entry point per test, under a watchdog. And an owned transaction's lock,
//! whose one-step fast path runs under the set's spin lock, drops the
//! caller's key only after it: when counted on a grant the set holds, when
//! the table did not keep it, and when a key's `Eq` panics in the set's
//! search or in the table's probe and unwinds past it.
#![cfg(all(feature = "test-util", not(loom)))]

mod common;
use common::{call_back, watchdog, Collide};

use std::cell::Cell;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use keylock::{Fairness, LockOptions, LockTable, Mode, OwnedTransaction, WaitPolicy};

thread_local! {
    static EQ_ARMED: Cell<bool> = const { Cell::new(false) };
    static PANICKED: Cell<usize> = const { Cell::new(0) };
}

#[derive(Debug, PartialOrd, Ord)]
struct K(u32);
impl Hash for K {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}
impl PartialEq for K {
    fn eq(&self, other: &Self) -> bool {
        if EQ_ARMED.get() && !std::thread::panicking() && (self.0 == 1 || other.0 == 1) {
            EQ_ARMED.set(false);
            PANICKED.set(PANICKED.get() + 1);
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
        call_back::fire();
    }
}

type Table = LockTable<K, Collide>;

fn install(table: &Arc<Table>, txns: Vec<Weak<OwnedTransaction<K, Collide>>>) {
    let table = Arc::downgrade(table);
    call_back::install(move || {
        if let Some(table) = table.upgrade() {
            let _ = table.len();
        }
        for t in txns.iter().filter_map(Weak::upgrade) {
            let _ = t.len();
        }
    });
}

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

/// Runs `op` with K(1) held by someone else and `Eq` armed: `op`'s key
/// (K(2), the same hash) is compared with K(1) and the comparison panics.
fn scenario(name: &'static str, fairness: Fairness, op: impl FnOnce(&Arc<Table>) + Send + 'static) {
    watchdog(name, HUNG, move || {
        let table = Arc::new(
            LockTable::<K>::builder()
                .hasher(Collide)
                .fairness(fairness)
                .build(),
        );
        let held = table.try_lock_shared(K(1)).unwrap();
        install(&table, vec![]);
        EQ_ARMED.set(true);
        let out = catch_unwind(AssertUnwindSafe(|| op(&table)));
        EQ_ARMED.set(false);
        let _ = out;
        assert!(PANICKED.get() > 0, "{name}: the planted Eq panic went off");
        call_back::uninstall();
        drop(held);
        table.assert_consistent();
    });
}

#[test]
fn try_lock() {
    scenario("try_lock", Fairness::default(), |t| drop(t.try_lock(K(2))));
}
#[test]
fn try_lock_shared() {
    scenario("try_lock_shared", Fairness::default(), |t| {
        drop(t.try_lock_shared(K(2)))
    });
}
#[test]
fn try_lock_with() {
    scenario("try_lock_with", Fairness::default(), |t| {
        drop(t.try_lock_with(K(2), LockOptions::new().lease(Duration::from_secs(5))))
    });
}
#[test]
fn try_lock_owned() {
    scenario("try_lock_owned", Fairness::default(), |t| {
        drop(t.clone().try_lock_owned(K(2)))
    });
}
#[test]
fn lock_future() {
    scenario("lock", Fairness::default(), |t| {
        let mut f = Box::pin(t.lock(K(2)));
        let _ = poll(f.as_mut());
    });
}
#[test]
fn lock_with_timeout_future() {
    scenario("lock_with", Fairness::default(), |t| {
        let mut f = Box::pin(t.lock_with(K(2), LockOptions::new().timeout(Duration::ZERO)));
        let _ = poll(f.as_mut());
    });
}
#[test]
fn lock_owned_future() {
    scenario("lock_owned", Fairness::default(), |t| {
        let mut f = Box::pin(t.clone().lock_owned(K(2)));
        let _ = poll(f.as_mut());
    });
}
#[test]
fn blocking_lock_eventual() {
    scenario("blocking_lock", Fairness::Eventual, |t| {
        drop(t.blocking_lock(K(2)))
    });
}
#[test]
fn borrowed_transaction_lock() {
    scenario("txn.lock", Fairness::default(), |t| {
        let mut txn = t.transaction();
        let mut f = Box::pin(txn.lock(K(2), Mode::Exclusive));
        let _ = poll(f.as_mut());
    });
}
#[test]
fn borrowed_transaction_lock_all() {
    scenario("txn.lock_all", Fairness::default(), |t| {
        let mut txn = t.transaction();
        let mut f = Box::pin(txn.lock_all_with(
            [
                (K(2), Mode::Exclusive),
                (K(3), Mode::Exclusive),
                (K(4), Mode::Shared),
            ],
            WaitPolicy::SkipLocked,
        ));
        let _ = poll(f.as_mut());
    });
}
/// An owned `lock_all` whose keys' comparisons with K(1) panic: on a
/// fresh transaction under SKIP LOCKED, and on one holding K(1) shared.
fn owned_lock_all(name: &'static str, holding: bool, policy: WaitPolicy) {
    scenario(name, Fairness::default(), move |t| {
        let txn = Arc::new(t.clone().transaction_owned());
        if holding {
            EQ_ARMED.set(false);
            txn.blocking_lock(K(1), Mode::Shared).unwrap();
        }
        install(t, vec![Arc::downgrade(&txn)]);
        EQ_ARMED.set(true);
        let requests = [
            (K(2), Mode::Exclusive),
            (K(3), Mode::Exclusive),
            (K(4), Mode::Shared),
        ];
        let mut f = Box::pin(txn.lock_all_with(requests, policy));
        let _ = poll(f.as_mut());
    });
}

#[test]
fn owned_transaction_lock_all() {
    owned_lock_all("owned.lock_all", false, WaitPolicy::SkipLocked);
}

#[test]
fn owned_transaction_lock_all_holding() {
    owned_lock_all("owned.lock_all2", true, WaitPolicy::Block);
}

#[test]
fn owned_transaction_detach_unlock() {
    scenario("owned.detach", Fairness::default(), |t| {
        let txn = Arc::new(t.clone().transaction_owned());
        EQ_ARMED.set(false);
        txn.blocking_lock(K(1), Mode::Shared).unwrap();
        txn.blocking_lock(K(3), Mode::Shared).unwrap();
        install(t, vec![Arc::downgrade(&txn)]);
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| txn.detach(&K(3))));
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| txn.unlock(&K(3))));
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| txn.mode(&K(3))));
    });
}
#[test]
fn release_hold_eq() {
    scenario("release_hold", Fairness::default(), |t| {
        EQ_ARMED.set(false);
        let mut txn = t.transaction();
        futures::executor::block_on(txn.lock(K(3), Mode::Shared)).unwrap();
        let h = txn.detach(&K(3)).unwrap();
        drop(txn);
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| t.release_hold(&K(3), h.token)));
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| t.revoke(&K(2))));
        EQ_ARMED.set(true);
        let _ = catch_unwind(AssertUnwindSafe(|| t.lock_status(&K(2))));
        let _ = t.release_hold(&K(3), h.token);
    });
}

/// What a hang of one of this file's tests means.
const HUNG: &str = "a key dropped under a lock as an Eq panic unwound";

/// An owned transaction holding K(1) (and its table), with the call back
/// into both installed.
fn owned_holding_one() -> (Arc<Table>, Arc<OwnedTransaction<K, Collide>>) {
    let table = Arc::new(LockTable::<K>::builder().hasher(Collide).build());
    let txn = Arc::new(table.clone().transaction_owned());
    txn.blocking_lock(K(1), Mode::Exclusive).expect("free");
    install(&table, vec![Arc::downgrade(&txn)]);
    (table, txn)
}

/// Polls `call` once, which must panic with the planted `Eq` panic.
fn poll_panics<F: Future>(call: Pin<&mut F>) {
    let polled = catch_unwind(AssertUnwindSafe(|| poll(call).is_ready()));
    assert!(polled.is_err(), "the planted Eq panic propagates");
    assert!(PANICKED.get() > 0, "the planted Eq panic went off");
}

/// The set's search compares K(2) with the held K(1) and panics: the
/// caller's key unwinds past the set's lock before it drops.
#[test]
fn owned_lock_fast_path_eq_panic_drops_key_outside_the_set_lock() {
    watchdog("owned.fast", HUNG, || {
        let (table, txn) = owned_holding_one();
        EQ_ARMED.set(true);
        poll_panics(Box::pin(txn.lock(K(2), Mode::Exclusive)).as_mut());
        call_back::uninstall();
        assert_eq!(txn.len(), 1);
        table.assert_consistent();
    });
}

/// The table's probe (under the set's lock) compares K(2) with another
/// holder's colliding K(1) and panics: the same.
#[test]
fn owned_lock_fast_path_table_probe_eq_panic_drops_key_outside_the_set_lock() {
    watchdog("owned.probe", HUNG, || {
        let table = Arc::new(LockTable::<K>::builder().hasher(Collide).build());
        let other = table.try_lock(K(1)).expect("free");
        let txn = Arc::new(table.clone().transaction_owned());
        install(&table, vec![Arc::downgrade(&txn)]);
        EQ_ARMED.set(true);
        poll_panics(Box::pin(txn.lock(K(2), Mode::Exclusive)).as_mut());
        call_back::uninstall();
        drop(other);
        assert_eq!(txn.len(), 0);
        table.assert_consistent();
    });
}

/// A key the set holds already, asked again: counted on its grant, the
/// caller's key drops once the set is unlocked; and a key shared with
/// another holder, whose entry keeps the table's own copy: the caller's
/// drops the same way.
#[test]
fn owned_lock_fast_path_drops_an_unkept_key_outside_the_set_lock() {
    watchdog("owned.unkept", HUNG, || {
        let (table, txn) = owned_holding_one();
        let reader = table.try_lock_shared(K(2)).expect("free");
        let before = call_back::fired();
        let got = txn
            .blocking_lock(K(1), Mode::Exclusive)
            .expect("held: counted");
        assert_eq!(got.count, 2, "re-entered");
        assert!(call_back::fired() > before, "the caller's key was dropped");
        let before = call_back::fired();
        txn.blocking_lock(K(2), Mode::Shared)
            .expect("shared with the reader");
        assert!(call_back::fired() > before, "the caller's copy was dropped");
        call_back::uninstall();
        assert_eq!(txn.len(), 2);
        drop(reader);
        table.assert_consistent();
    });
}
