//! A broad sweep: a key whose `Clone`, `Hash` and `Drop` call back into
//! the table (every shard), the detector (`deadlock_stats`), the holds
//! (`release_hold`) and the owned transactions in play, driven through the
//! status view, deadlock answers and history, holds, checks and renewals
//! of lost keys, commits, `lock_all` with skips, under a watchdog.
#![cfg(all(feature = "test-util", not(loom)))]

mod common;
use common::call_back::{self, fire};
use common::watchdog;

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use keylock::{
    FencingToken, LockOptions, LockTable, ManualClock, Mode, OwnedTransaction, TransactionError,
    TransactionOptions, WaitPolicy,
};

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct K(u32);
impl Hash for K {
    fn hash<H: Hasher>(&self, state: &mut H) {
        fire();
        self.0.hash(state);
    }
}
impl Clone for K {
    fn clone(&self) -> Self {
        fire();
        K(self.0)
    }
}
impl Drop for K {
    fn drop(&mut self) {
        fire();
    }
}

type Table = LockTable<K>;

fn install(table: &Arc<Table>, txns: Vec<Weak<OwnedTransaction<K>>>) {
    let table = Arc::downgrade(table);
    call_back::install(move || {
        if let Some(table) = table.upgrade() {
            let _ = table.len(); // every shard lock
            let _ = table.deadlock_stats(); // the detector's registry
            let _ = table.release_hold(&K(9999), FencingToken::new(1).unwrap());
            // holds
        }
        for t in txns.iter().filter_map(Weak::upgrade) {
            let _ = t.len(); // the set's lock
        }
    });
}

fn uninstall() {
    call_back::uninstall();
}

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn status_view_clones_keys_unlocked() {
    watchdog("status", HUNG, || {
        let table = Arc::new(Table::new());
        let g = table.try_lock(K(1)).unwrap();
        install(&table, vec![]);
        let mut w = Box::pin(table.lock(K(1)));
        assert!(poll(w.as_mut()).is_pending());
        let s = table.status();
        assert_eq!(s.len(), 1);
        drop(s);
        drop(w);
        drop(g);
        uninstall();
        assert!(call_back::fired() > 0, "the key's methods called back");
    });
}

#[test]
fn deadlock_answer_and_history_clone_keys_unlocked() {
    watchdog("deadlock", HUNG, || {
        let table = Arc::new(Table::builder().deadlock_history(4).build());
        let a = Arc::new(table.clone().transaction_owned());
        let b = Arc::new(table.clone().transaction_owned());
        a.blocking_lock(K(1), Mode::Exclusive).unwrap();
        b.blocking_lock(K(2), Mode::Exclusive).unwrap();
        install(&table, vec![Arc::downgrade(&a), Arc::downgrade(&b)]);
        let mut aw = Box::pin(a.lock(K(2), Mode::Exclusive));
        assert!(poll(aw.as_mut()).is_pending());
        let mut bw = Box::pin(b.lock(K(1), Mode::Exclusive));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = poll(bw.as_mut()) else {
            panic!("b closes the cycle")
        };
        assert_eq!(d.cycle().len(), 2);
        drop(bw);
        let recent = table.recent_deadlocks();
        assert_eq!(recent.len(), 1);
        drop(recent);
        drop(d);
        drop(aw);
        uninstall();
        assert!(call_back::fired() > 0, "the key's methods called back");
    });
}

#[test]
fn holds_detach_and_release_unlocked() {
    watchdog("holds", HUNG, || {
        let table = Arc::new(Table::new());
        let a = Arc::new(table.clone().transaction_owned());
        a.blocking_lock(K(1), Mode::Exclusive).unwrap();
        a.blocking_lock(K(2), Mode::Shared).unwrap();
        install(&table, vec![Arc::downgrade(&a)]);
        let h = a.detach(&K(1)).unwrap();
        let err = a.detach(&K(7)).unwrap_err();
        drop(err);
        let mut b = table.transaction();
        futures::executor::block_on(b.lock(K(3), Mode::Exclusive)).unwrap();
        let h3 = b.detach(&K(3)).unwrap();
        drop(b);
        assert!(table.release_hold(&K(2), h.token).is_err());
        table.release_hold(&K(1), h.token).unwrap();
        table.release_hold(&K(3), h3.token).unwrap();
        drop(h);
        drop(h3);
        let a = Arc::try_unwrap(a).ok().unwrap();
        a.commit().unwrap();
        uninstall();
        assert!(call_back::fired() > 0, "the key's methods called back");
    });
}

#[test]
fn lost_keys_checked_renewed_committed_unlocked() {
    watchdog("lost", HUNG, || {
        let clock = ManualClock::with_shard_timers();
        let table = Arc::new(Table::builder().clock(clock.clone()).build());
        let opts = TransactionOptions::new().lease(Duration::from_secs(1));
        let a = Arc::new(table.clone().transaction_owned_with(opts));
        a.blocking_lock(K(1), Mode::Exclusive).unwrap();
        a.blocking_lock(K(2), Mode::Exclusive).unwrap();
        let mut w = Box::pin(table.lock(K(1)));
        assert!(poll(w.as_mut()).is_pending());
        install(&table, vec![Arc::downgrade(&a)]);
        clock.advance(Duration::from_secs(2));
        assert!(a.check().is_err());
        assert!(a.renew().is_err());
        let Poll::Ready(g) = poll(w.as_mut()) else {
            panic!("the lapsed key passes on")
        };
        drop(g);
        assert!(a.clone().keys().len() <= 2);
        drop(w);
        let a = Arc::try_unwrap(a).ok().unwrap();
        assert!(a.commit().is_err());
        uninstall();
        assert!(call_back::fired() > 0, "the key's methods called back");
    });
}

#[test]
fn lock_all_skip_locked_and_unlock_unlocked() {
    watchdog("lock_all", HUNG, || {
        let table = Arc::new(Table::new());
        let other = table.try_lock(K(2)).unwrap();
        let a = Arc::new(table.clone().transaction_owned());
        a.blocking_lock(K(5), Mode::Shared).unwrap();
        install(&table, vec![Arc::downgrade(&a)]);
        let got = futures::executor::block_on(a.lock_all_with(
            [
                (K(1), Mode::Exclusive),
                (K(2), Mode::Exclusive),
                (K(3), Mode::Shared),
                (K(5), Mode::Exclusive),
            ],
            WaitPolicy::SkipLocked,
        ));
        drop(got);
        let got = futures::executor::block_on(a.lock_all_with(
            [(K(4), Mode::Exclusive), (K(2), Mode::Exclusive)],
            WaitPolicy::NoWait,
        ));
        assert!(got.is_err());
        drop(got);
        let _ = a.unlock(&K(1));
        let _ = a.release(&K(9));
        let _ = a.keys();
        drop(other);
        let _ = table.try_lock_with(K(8), LockOptions::new().lease(Duration::from_secs(1)));
        uninstall();
        assert!(call_back::fired() > 0, "the key's methods called back");
        drop(a);
    });
}

/// What a hang of one of this file's tests means.
const HUNG: &str = "a key method called back into a lock held around it";
