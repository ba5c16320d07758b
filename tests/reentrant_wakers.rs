//! A sweep with a waker whose `clone`, `wake`, `wake_by_ref` and `drop`
//! call back into the table (every shard), the detector and the owned
//! transactions in play, under a watchdog.
#![cfg(all(feature = "test-util", not(loom)))]

mod common;
use common::call_back::{self, fire};
use common::watchdog;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::Duration;

use keylock::{LockOptions, LockTable, ManualClock, Mode, OwnedTransaction, TransactionOptions};

static VTABLE: RawWakerVTable = RawWakerVTable::new(
    |p| {
        fire();
        RawWaker::new(p, &VTABLE)
    },
    |_| fire(),
    |_| fire(),
    |_| fire(),
);

fn hostile() -> Waker {
    // SAFETY: the vtable ignores the data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

fn install(table: &Arc<LockTable<u32>>, txns: Vec<Weak<OwnedTransaction<u32>>>) {
    let table = Arc::downgrade(table);
    call_back::install(move || {
        if let Some(table) = table.upgrade() {
            let _ = table.len();
            let _ = table.deadlock_stats();
        }
        for t in txns.iter().filter_map(Weak::upgrade) {
            let _ = t.len();
        }
    });
}

fn poll<F: Future + ?Sized>(f: Pin<&mut F>, w: &Waker) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(w))
}

/// Polls unless done; a ready output is dropped, and so is the future.
fn step<F: Future>(f: &mut Option<Pin<Box<F>>>, w: &Waker) {
    if let Some(fut) = f.as_mut() {
        if poll(fut.as_mut(), w).is_ready() {
            *f = None;
        }
    }
}

#[test]
fn owned_transaction_waits_deadlock_and_end() {
    watchdog("owned", HUNG, || {
        let w = hostile();
        let table = Arc::new(LockTable::<u32>::new());
        let a = Arc::new(table.clone().transaction_owned());
        let b = Arc::new(table.clone().transaction_owned());
        a.blocking_lock(1, Mode::Exclusive).unwrap();
        a.blocking_lock(5, Mode::Shared).unwrap();
        b.blocking_lock(2, Mode::Exclusive).unwrap();
        b.blocking_lock(5, Mode::Shared).unwrap();
        install(&table, vec![Arc::downgrade(&a), Arc::downgrade(&b)]);
        // Two waits of a: registers wakers in a's set, wake_waits on the second.
        let mut a1 = Some(Box::pin(a.lock(2, Mode::Exclusive)));
        step(&mut a1, &w);
        assert!(a1.is_some());
        let mut a2 = Some(Box::pin(a.lock(3, Mode::Exclusive)));
        let g3 = table.try_lock(3).unwrap();
        step(&mut a2, &w);
        assert!(a2.is_some());
        step(&mut a1, &w);
        // An upgrade wait.
        let mut a3 = Some(Box::pin(a.lock(5, Mode::Exclusive)));
        step(&mut a3, &w);
        // b closes a cycle.
        let mut b1 = Some(Box::pin(b.lock(1, Mode::Exclusive)));
        step(&mut b1, &w);
        step(&mut a1, &w);
        drop(b1);
        drop(g3);
        step(&mut a2, &w);
        step(&mut a3, &w);
        step(&mut a1, &w);
        // Ended with pending calls: their wakers are woken by the end.
        let b = Arc::try_unwrap(b).ok().unwrap();
        drop(b);
        step(&mut a1, &w);
        std::mem::forget(a2);
        let a = Arc::try_unwrap(a).map_err(|_| "shared").unwrap();
        drop(a);
        step(&mut a1, &w);
        step(&mut a3, &w);
        assert!(call_back::fired() > 0, "the waker's methods called back");
        table.assert_consistent();
        call_back::uninstall();
    });
}

#[test]
fn lost_and_sleeps_on_a_manual_clock() {
    for timers in [false, true] {
        watchdog("lost", HUNG, move || {
            let w = hostile();
            let clock = if timers {
                ManualClock::with_shard_timers()
            } else {
                ManualClock::new()
            };
            let table = Arc::new(LockTable::<u32>::builder().clock(clock.clone()).build());
            install(&table, vec![]);
            let g = table
                .try_lock_with(1, LockOptions::new().lease(Duration::from_secs(2)))
                .unwrap();
            let mut lost = Some(Box::pin(g.lost()));
            step(&mut lost, &w);
            assert!(lost.is_some());
            g.renew(Duration::from_secs(1)).unwrap();
            step(&mut lost, &w);
            let mut waiter = Some(Box::pin(
                table.lock_with(1, LockOptions::new().timeout(Duration::from_secs(5))),
            ));
            step(&mut waiter, &w);
            let mut up = Some(Box::pin(table.lock_shared(1)));
            step(&mut up, &w);
            clock.advance(Duration::from_secs(3));
            step(&mut lost, &w);
            step(&mut waiter, &w);
            drop(lost);
            drop(g);
            step(&mut up, &w);
            step(&mut waiter, &w);
            assert!(call_back::fired() > 0, "the waker's methods called back");
            table.assert_consistent();
            call_back::uninstall();
        });
    }
}

#[test]
fn borrowed_transaction_and_upgrade() {
    watchdog("borrowed", HUNG, || {
        let w = hostile();
        let table = Arc::new(
            LockTable::<u32>::builder()
                .clock(ManualClock::new())
                .build(),
        );
        install(&table, vec![]);
        let mut s1 = table.try_lock_shared(1).unwrap();
        let s2 = table.try_lock_shared(1).unwrap();
        {
            let mut up = Box::pin(s1.upgrade());
            assert!(poll(up.as_mut(), &w).is_pending());
        }
        let mut t = table.transaction_with(TransactionOptions::new().lease(Duration::from_secs(9)));
        {
            let mut f = Box::pin(t.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
            let _ = poll(f.as_mut(), &w);
        }
        drop(s2);
        drop(s1);
        let mut t2 = table.transaction();
        let mut f = Box::pin(t2.lock(1, Mode::Shared));
        let _ = poll(f.as_mut(), &w);
        drop(f);
        drop(t2);
        drop(t);
        assert!(call_back::fired() > 0, "the waker's methods called back");
        table.assert_consistent();
        call_back::uninstall();
    });
}

/// What a hang of one of this file's tests means.
const HUNG: &str = "a waker method called back into a lock held around it";
