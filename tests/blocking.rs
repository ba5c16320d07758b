//! The `blocking_` methods park the calling thread with a waker of their own:
//! they work on plain threads and inside another executor's `block_on`
//! (which would refuse a nested `block_on`), and their owned form outlives
//! the borrow of the table.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use keylock::LockTable;

#[test]
fn blocking_lock_inside_futures_block_on_takes_a_free_key() {
    let table = LockTable::new();
    let token = futures::executor::block_on(async {
        let guard = table.blocking_lock("free");
        assert!(table.is_locked("free"));
        guard.token()
    });
    assert!(token.get() > 0);
    assert!(table.is_empty());
}

#[test]
fn blocking_lock_inside_futures_block_on_waits_for_a_release_from_another_thread() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(1u32).unwrap();
    let (tx, rx) = mpsc::channel();
    let waiter = {
        let table = table.clone();
        std::thread::spawn(move || {
            futures::executor::block_on(async {
                tx.send(()).unwrap();
                let guard = table.blocking_lock(1);
                guard.token()
            })
        })
    };
    rx.recv().unwrap();
    // Wait until the other thread is queued, then release.
    while table.waiters(&1) == 0 {
        std::thread::yield_now();
    }
    let first = holder.token();
    drop(holder);
    let second = waiter.join().unwrap();
    assert!(second > first);
    assert!(table.is_empty());
}

#[test]
fn blocking_lock_owned_moves_to_another_thread() {
    let table = Arc::new(LockTable::new());
    let guard = table.clone().blocking_lock_owned(String::from("job"));
    assert!(table.is_locked("job"));
    std::thread::spawn(move || drop(guard)).join().unwrap();
    assert!(table.is_empty());
}

#[test]
fn blocking_lock_with_a_timeout_gives_up_and_leaves_nothing() {
    let table = LockTable::new();
    let _held = table.try_lock(5u8).unwrap();
    let opts = keylock::LockOptions::new().timeout(Duration::from_millis(20));
    let err = table.blocking_lock_with(5, opts).unwrap_err();
    assert!(matches!(err, keylock::LockError::Timeout { .. }));
    assert_eq!(table.waiters(&5), 0);
}
