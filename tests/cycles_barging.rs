//! Cycles that no new wait closes (issue 26, item 3): an owned
//! transaction's call takes a grant that a queued waiter must now wait for
//! (a grant past the queue under eventual fairness, an upgrade at once)
//! while another call of the same transaction already waits. The edge into
//! the waiting transaction appears with no wait beginning, so the waiting
//! call must search again; one of the two waits is answered as a deadlock.
//! Every future is polled by hand with a noop waker.
#![cfg(feature = "test-util")]
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use keylock::{Fairness, LockTable, ManualClock, Mode, TransactionError};

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn an_owned_calls_grant_past_the_queue_closing_a_cycle_is_answered() {
    let table = Arc::new(
        LockTable::<&'static str>::builder()
            .shards(1)
            .clock(ManualClock::new())
            .fairness(Fairness::Eventual)
            .build(),
    );
    // One fair handoff sets the shard's deadline: later releases leave the key free.
    let warm = table.try_lock("warm").unwrap();
    let mut handed = Box::pin(table.lock("warm"));
    assert!(poll(handed.as_mut()).is_pending());
    drop(warm);
    assert!(poll(handed.as_mut()).is_ready());
    drop(handed);

    let w = table.clone().transaction_owned();
    let t = table.clone().transaction_owned();
    assert!(poll(Box::pin(w.lock("x", Mode::Exclusive)).as_mut()).is_ready());
    let plain = table.try_lock("y").unwrap();
    // A plain waiter heads y's queue: the key is left free for it alone (a
    // transaction's head would be handed the key).
    let mut nudged = Box::pin(table.lock("y"));
    assert!(poll(nudged.as_mut()).is_pending());
    // t waits for w's x (w waits for nothing yet: no cycle).
    let mut t_x = Box::pin(t.lock("x", Mode::Exclusive));
    assert!(poll(t_x.as_mut()).is_pending());
    // w waits for y behind a plain guard and a plain waiter (no edge).
    let mut w_y = Box::pin(w.lock("y", Mode::Exclusive));
    assert!(poll(w_y.as_mut()).is_pending());
    drop(plain);
    // t's second call takes y past the nudged plain head and w's waiter:
    // w -> t -> w.
    let mut t_y = Box::pin(t.lock("y", Mode::Exclusive));
    assert!(
        matches!(poll(t_y.as_mut()), Poll::Ready(Ok(_))),
        "precondition: t takes y past the queue"
    );
    // The plain waiter leaves; w's waiter heads y's queue, behind t's grant.
    drop(nudged);
    let a = poll(t_x.as_mut());
    let b = if a.is_pending() {
        poll(w_y.as_mut())
    } else {
        Poll::Pending
    };
    let answered = |p: &Poll<Result<keylock::Acquired, TransactionError<&str>>>| {
        matches!(p, Poll::Ready(Err(TransactionError::Deadlock(_))))
    };
    assert!(
        answered(&a) || answered(&b),
        "the cycle w -> t -> w is left hanging: {:?}",
        table.status()
    );
    // The victim's transaction aborts: the other proceeds.
    if answered(&a) {
        drop(t_x);
        drop(t);
        assert!(poll(w_y.as_mut()).is_ready());
    } else {
        drop(w_y);
        drop(w);
        assert!(poll(t_x.as_mut()).is_ready());
    }
}

/// Strict fairness: an owned transaction's second call upgrades a key it
/// alone holds shared, while its first call waits; a shared waiter queued
/// behind a plain writer now waits for it, closing a cycle no wait began.
#[test]
fn an_owned_calls_upgrade_closing_a_cycle_is_answered() {
    let table = Arc::new(LockTable::<&'static str>::new());
    let t = table.clone().transaction_owned();
    assert!(poll(Box::pin(t.lock("y", Mode::Shared)).as_mut()).is_ready());
    let mut writer = Box::pin(table.lock("y"));
    assert!(poll(writer.as_mut()).is_pending());
    let w = table.clone().transaction_owned();
    assert!(poll(Box::pin(w.lock("x", Mode::Exclusive)).as_mut()).is_ready());
    let mut t_x = Box::pin(t.lock("x", Mode::Exclusive));
    assert!(poll(t_x.as_mut()).is_pending());
    let mut w_y = Box::pin(w.lock("y", Mode::Shared));
    assert!(poll(w_y.as_mut()).is_pending());
    let mut t_up = Box::pin(t.lock("y", Mode::Exclusive));
    assert!(
        matches!(poll(t_up.as_mut()), Poll::Ready(Ok(_))),
        "precondition: t, y's only holder, upgrades at once"
    );
    let a = poll(t_x.as_mut());
    let b = if a.is_pending() {
        poll(w_y.as_mut())
    } else {
        Poll::Pending
    };
    let answered = |p: &Poll<Result<keylock::Acquired, TransactionError<&str>>>| {
        matches!(p, Poll::Ready(Err(TransactionError::Deadlock(_))))
    };
    assert!(
        answered(&a) || answered(&b),
        "the cycle w -> t -> w is left hanging: {:?}",
        table.status()
    );
    drop(writer);
    // The victim's transaction aborts: the other proceeds.
    if answered(&a) {
        drop(t_x);
        drop(t);
        assert!(poll(w_y.as_mut()).is_ready());
    } else {
        drop(w_y);
        drop(w);
        assert!(poll(t_x.as_mut()).is_ready());
    }
}
