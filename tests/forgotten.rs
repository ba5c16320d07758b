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
