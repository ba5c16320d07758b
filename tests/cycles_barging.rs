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
use std::task::Poll;

use keylock::{Acquired, LockTable, Mode, OwnedTransaction, TransactionError};

mod common;
use common::{poll_noop as poll, warm_eventual_table};

type Key = &'static str;

/// Polls t's wait, then (if it still waits) w's: one of them must be
/// answered as the cycle's victim. Whether t's was.
fn one_wait_is_answered<F>(table: &LockTable<Key>, t_x: Pin<&mut F>, w_y: Pin<&mut F>) -> bool
where
    F: Future<Output = Result<Acquired, TransactionError<Key>>> + ?Sized,
{
    let a = poll(t_x);
    let b = if a.is_pending() {
        poll(w_y)
    } else {
        Poll::Pending
    };
    let answered = |p: &Poll<Result<Acquired, TransactionError<Key>>>| {
        matches!(p, Poll::Ready(Err(TransactionError::Deadlock(_))))
    };
    assert!(
        answered(&a) || answered(&b),
        "the cycle w -> t -> w is left hanging: {:?}",
        table.status()
    );
    answered(&a)
}

/// The victim's transaction (t's if `t_answered`, else w's) ends with its
/// waiting call; the other's waiting call is then granted.
fn the_other_proceeds<F: Future + ?Sized>(
    t_answered: bool,
    t: OwnedTransaction<Key>,
    mut t_x: Pin<Box<F>>,
    w: OwnedTransaction<Key>,
    mut w_y: Pin<Box<F>>,
) {
    if t_answered {
        drop(t_x);
        drop(t);
        assert!(poll(w_y.as_mut()).is_ready());
    } else {
        drop(w_y);
        drop(w);
        assert!(poll(t_x.as_mut()).is_ready());
    }
}

#[test]
fn an_owned_calls_grant_past_the_queue_closing_a_cycle_is_answered() {
    // One fair handoff has set the shard's deadline: later releases leave
    // the key free.
    let table = Arc::new(warm_eventual_table());

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
    let t_answered = one_wait_is_answered(&table, t_x.as_mut(), w_y.as_mut());
    // The victim's transaction aborts: the other proceeds.
    the_other_proceeds(t_answered, t, t_x, w, w_y);
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
    let t_answered = one_wait_is_answered(&table, t_x.as_mut(), w_y.as_mut());
    drop(writer);
    // The victim's transaction aborts: the other proceeds.
    the_other_proceeds(t_answered, t, t_x, w, w_y);
}
