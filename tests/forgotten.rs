//! A transaction owns its grants whatever its call futures do (issue 26,
//! item 2): a lock call future that is forgotten (`mem::forget` of its
//! box, safe Rust) while it waits leaves nothing held once its transaction
//! ends, whether its key was granted to it before the end or would be
//! after. Both forms; commit, abort and drop. Futures are polled by hand
//! with a noop waker: every assertion is about the table's state after a
//! step, never about time. (The forgotten boxes are leaked, by design.)

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use keylock::{LockTable, Mode};

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

#[derive(Debug, Clone, Copy)]
enum End {
    Commit,
    Abort,
    Drop,
}

const ENDS: [End; 3] = [End::Commit, End::Abort, End::Drop];

/// The snippet, borrowed form: the key is released by the blocker
/// after the transaction ended (the grant would come later).
#[test]
fn a_forgotten_borrowed_call_is_not_granted_after_its_transaction_ended() {
    for end in ENDS {
        let table = LockTable::<&str>::new();
        let blocker = table.try_lock("b").unwrap();
        let mut t = table.transaction();
        assert!(poll(std::pin::pin!(t.lock("a", Mode::Exclusive))).is_ready());
        let mut f = Box::pin(t.lock("b", Mode::Exclusive));
        assert!(poll(f.as_mut()).is_pending());
        std::mem::forget(f);
        match end {
            End::Commit => t.commit().expect("its keys held"),
            End::Abort => t.abort(),
            End::Drop => drop(t),
        }
        drop(blocker);
        assert!(!table.is_locked("b"), "{end:?}: {:?}", table.status());
        assert!(table.is_empty(), "{end:?}: {:?}", table.status());
    }
}

/// Borrowed form: the key is granted to the forgotten call before the
/// transaction ends (unobserved): the end releases it.
#[test]
fn a_forgotten_borrowed_calls_grant_is_released_when_its_transaction_ends() {
    for end in ENDS {
        let table = LockTable::<&str>::new();
        let blocker = table.try_lock("b").unwrap();
        let mut t = table.transaction();
        let mut f = Box::pin(t.lock("b", Mode::Exclusive));
        assert!(poll(f.as_mut()).is_pending());
        std::mem::forget(f);
        drop(blocker); // handed to the forgotten waiter
        assert!(table.is_locked("b"));
        match end {
            End::Commit => t.commit().expect("nothing lost"),
            End::Abort => t.abort(),
            End::Drop => drop(t),
        }
        assert!(table.is_empty(), "{end:?}: {:?}", table.status());
        assert!(table.try_lock("b").is_ok(), "{end:?}: free for the next");
    }
}

/// The owned form, both orders.
#[test]
fn a_forgotten_owned_call_leaves_nothing_held_after_its_transaction_ended() {
    for granted_first in [false, true] {
        for end in ENDS {
            let table = Arc::new(LockTable::<&str>::new());
            let blocker = table.try_lock("b").unwrap();
            let t = table.clone().transaction_owned();
            let mut f = Box::pin(t.lock("b", Mode::Exclusive));
            assert!(poll(f.as_mut()).is_pending());
            std::mem::forget(f);
            let mut blocker = Some(blocker);
            if granted_first {
                drop(blocker.take());
            }
            match end {
                End::Commit => t.commit().expect("nothing lost"),
                End::Abort => t.abort(),
                End::Drop => drop(t),
            }
            drop(blocker);
            assert!(
                table.is_empty(),
                "granted first {granted_first}, {end:?}: {:?}",
                table.status()
            );
        }
    }
}

/// A call that is not forgotten but still pending when its owned
/// transaction ends fails `Ended` and holds nothing, as before.
#[test]
fn a_pending_owned_call_fails_ended_and_holds_nothing() {
    let table = Arc::new(LockTable::<&str>::new());
    let blocker = table.try_lock("b").unwrap();
    let t = table.clone().transaction_owned();
    let mut f = Box::pin(t.lock("b", Mode::Exclusive));
    assert!(poll(f.as_mut()).is_pending());
    drop(t);
    assert!(matches!(
        poll(f.as_mut()),
        Poll::Ready(Err(keylock::TransactionError::Ended))
    ));
    drop(blocker);
    assert!(table.is_empty());
    drop(f);
    assert!(table.is_empty());
}

/// The call's lock future is polled with no lock of the transaction's
/// held: a waker whose `clone` (run by the table as the waiter queues)
/// ends the transaction does not spin; the call fails `Ended` and nothing
/// stays queued or held.
#[test]
fn a_waker_that_ends_the_transaction_while_the_call_polls_does_not_spin() {
    use std::cell::RefCell;
    use std::task::{RawWaker, RawWakerVTable};

    thread_local! {
        static END: RefCell<Option<keylock::OwnedTransaction<&'static str>>> =
            const { RefCell::new(None) };
    }
    fn clone(_: *const ()) -> RawWaker {
        // The first clone ends the transaction (dropped here, in the poll).
        END.with(|end| drop(end.borrow_mut().take()));
        RawWaker::new(std::ptr::null(), &VTABLE)
    }
    fn noop(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);

    let table = Arc::new(LockTable::<&'static str>::new());
    let blocker = table.try_lock("b").unwrap();
    let t = table.clone().transaction_owned();
    let mut f = Box::pin(t.lock("b", Mode::Exclusive));
    END.with(|end| *end.borrow_mut() = Some(t));
    // SAFETY: the vtable's functions ignore the data pointer (null) and
    // uphold `RawWaker`'s contract (clone returns a waker of the same
    // vtable; wake and drop do nothing).
    let waker = unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) };
    let polled = f.as_mut().poll(&mut Context::from_waker(&waker));
    assert!(
        matches!(polled, Poll::Ready(Err(keylock::TransactionError::Ended))),
        "{polled:?}"
    );
    assert!(END.with(|end| end.borrow().is_none()), "the clone ended it");
    assert_eq!(table.waiters("b"), 0, "nothing queued");
    drop(blocker);
    assert!(table.is_empty());
}

/// The two keys of a `lock_all` in the order it takes them (its canonical
/// order is the table's hash, not the caller's): `(first, second)`, found
/// by a probe on a scratch table of the same hasher that holds the second
/// and sees whether the first was taken before the wait.
fn lock_all_order(table: &LockTable<&'static str>) -> (&'static str, &'static str) {
    let (x, y) = ("x", "y");
    let blocker = table.try_lock(y).unwrap();
    let mut t = table.transaction();
    let mut f = Box::pin(t.lock_all([(x, Mode::Exclusive), (y, Mode::Exclusive)]));
    assert!(poll(f.as_mut()).is_pending());
    let x_first = table.is_locked(x);
    drop(f);
    drop(t);
    drop(blocker);
    assert!(table.is_empty());
    if x_first {
        (x, y)
    } else {
        (y, x)
    }
}

/// Asserts that nothing is held or queued and that another locker gets
/// every key.
fn assert_all_free(table: &LockTable<&'static str>, keys: &[&'static str], what: &str) {
    assert!(table.is_empty(), "{what}: {:?}", table.status());
    assert_eq!(table.len(), 0, "{what}");
    for &key in keys {
        assert_eq!(table.waiters(key), 0, "{what}: {key} queued");
    }
    let mut other = table.transaction();
    let got = poll(std::pin::pin!(
        other.lock_all(keys.iter().map(|&k| (k, Mode::Exclusive)))
    ));
    assert!(
        matches!(&got, Poll::Ready(Ok(s)) if s.acquired() == keys.len()),
        "{what}: {got:?}"
    );
}

/// A borrowed transaction's `lock_all` forgotten while it waits for its
/// second key, having taken the first: when the transaction ends, the key
/// it took is released and the one it waits for is never granted to it
/// (or, granted before the end, released by it).
#[test]
fn a_forgotten_borrowed_lock_all_leaves_nothing_held_after_its_transaction_ended() {
    for granted_first in [false, true] {
        for end in ENDS {
            let table = LockTable::<&'static str>::new();
            let (first, second) = lock_all_order(&table);
            let blocker = table.try_lock(second).unwrap();
            let mut t = table.transaction();
            let mut f = Box::pin(t.lock_all([(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            assert!(poll(f.as_mut()).is_pending());
            assert!(
                table.is_locked(first),
                "the first key taken before the wait"
            );
            std::mem::forget(f);
            let mut blocker = Some(blocker);
            if granted_first {
                drop(blocker.take()); // handed to the forgotten call
            }
            match end {
                End::Commit => t.commit().expect("nothing lost"),
                End::Abort => t.abort(),
                End::Drop => drop(t),
            }
            drop(blocker);
            let what = format!("granted first {granted_first}, {end:?}");
            assert_all_free(&table, &[first, second], &what);
        }
    }
}

/// The owned form: its `lock_all` forgotten in the same state.
#[test]
fn a_forgotten_owned_lock_all_leaves_nothing_held_after_its_transaction_ended() {
    for granted_first in [false, true] {
        for end in ENDS {
            let table = Arc::new(LockTable::<&'static str>::new());
            let (first, second) = lock_all_order(&table);
            let blocker = table.try_lock(second).unwrap();
            let t = table.clone().transaction_owned();
            let mut f =
                Box::pin(t.lock_all(vec![(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            assert!(poll(f.as_mut()).is_pending());
            assert!(
                table.is_locked(first),
                "the first key taken before the wait"
            );
            std::mem::forget(f);
            let mut blocker = Some(blocker);
            if granted_first {
                drop(blocker.take());
            }
            match end {
                End::Commit => t.commit().expect("nothing lost"),
                End::Abort => t.abort(),
                End::Drop => drop(t),
            }
            drop(blocker);
            let what = format!("granted first {granted_first}, {end:?}");
            assert_all_free(&table, &[first, second], &what);
        }
    }
}

/// A borrowed transaction's `lock_all` that waits on a key it must claim
/// (one it holds shared, asked exclusive, beside a new one that is taken
/// first): forgotten, the transaction's end releases both.
#[test]
fn a_forgotten_borrowed_lock_all_with_an_upgrade_leaves_nothing_held() {
    for granted_first in [false, true] {
        for end in ENDS {
            let table = LockTable::<&'static str>::new();
            let (first, second) = lock_all_order(&table);
            let reader = table.try_lock_shared(second).unwrap();
            let mut t = table.transaction();
            assert!(poll(std::pin::pin!(t.lock(second, Mode::Shared))).is_ready());
            let mut f = Box::pin(t.lock_all([(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            assert!(poll(f.as_mut()).is_pending());
            assert!(
                table.is_locked(first),
                "the first key taken before the wait"
            );
            std::mem::forget(f);
            let mut reader = Some(reader);
            if granted_first {
                drop(reader.take()); // the upgrade is granted, unobserved
            }
            match end {
                End::Commit => t.commit().expect("nothing lost"),
                End::Abort => t.abort(),
                End::Drop => drop(t),
            }
            drop(reader);
            let what = format!("granted first {granted_first}, {end:?}");
            assert_all_free(&table, &[first, second], &what);
        }
    }
}

/// The owned form's `lock_all` with an upgrade, forgotten.
#[test]
fn a_forgotten_owned_lock_all_with_an_upgrade_leaves_nothing_held() {
    for granted_first in [false, true] {
        for end in ENDS {
            let table = Arc::new(LockTable::<&'static str>::new());
            let (first, second) = lock_all_order(&table);
            let reader = table.try_lock_shared(second).unwrap();
            let t = table.clone().transaction_owned();
            assert!(poll(std::pin::pin!(t.lock(second, Mode::Shared))).is_ready());
            let mut f =
                Box::pin(t.lock_all(vec![(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            assert!(poll(f.as_mut()).is_pending());
            assert!(
                table.is_locked(first),
                "the first key taken before the wait"
            );
            std::mem::forget(f);
            let mut reader = Some(reader);
            if granted_first {
                drop(reader.take());
            }
            match end {
                End::Commit => t.commit().expect("nothing lost"),
                End::Abort => t.abort(),
                End::Drop => drop(t),
            }
            drop(reader);
            let what = format!("granted first {granted_first}, {end:?}");
            assert_all_free(&table, &[first, second], &what);
        }
    }
}

/// A single upgrade (a key the transaction holds shared, asked exclusive
/// while another reader holds it) forgotten: the end releases the key,
/// whether the upgrade was granted before it or not.
#[test]
fn a_forgotten_upgrade_leaves_nothing_held_after_its_transaction_ended() {
    for owned in [false, true] {
        for granted_first in [false, true] {
            for end in ENDS {
                let table = Arc::new(LockTable::<&'static str>::new());
                let reader = table.try_lock_shared("k").unwrap();
                let what = format!("owned {owned}, granted first {granted_first}, {end:?}");
                let mut reader = Some(reader);
                if owned {
                    let t = table.clone().transaction_owned();
                    assert!(poll(std::pin::pin!(t.lock("k", Mode::Shared))).is_ready());
                    let mut f = Box::pin(t.lock("k", Mode::Exclusive));
                    assert!(poll(f.as_mut()).is_pending());
                    std::mem::forget(f);
                    if granted_first {
                        drop(reader.take());
                    }
                    match end {
                        End::Commit => t.commit().expect("nothing lost"),
                        End::Abort => t.abort(),
                        End::Drop => drop(t),
                    }
                } else {
                    let mut t = table.transaction();
                    assert!(poll(std::pin::pin!(t.lock("k", Mode::Shared))).is_ready());
                    let mut f = Box::pin(t.lock("k", Mode::Exclusive));
                    assert!(poll(f.as_mut()).is_pending());
                    std::mem::forget(f);
                    if granted_first {
                        drop(reader.take());
                    }
                    match end {
                        End::Commit => t.commit().expect("nothing lost"),
                        End::Abort => t.abort(),
                        End::Drop => drop(t),
                    }
                }
                drop(reader);
                assert_all_free(&table, &["k"], &what);
            }
        }
    }
}
