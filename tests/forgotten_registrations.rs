//! A borrowed transaction's call forgotten in a wait stays registered with
//! the deadlock detector after the transaction's next call cleared its
//! parked wait (the waiter left the queue): the stale wait, exclusive, is
//! read with the edges of the next call's shared waiter on the same key, and
//! the walk passes over the waiter ahead of it as if the transaction waited
//! exclusive there. The cycle through that waiter is never answered.
#![cfg(feature = "test-util")]
use std::task::Poll;

use keylock::{LockTable, Mode, TransactionError};

mod common;
use common::{forget_pending, poll_noop as poll};

#[test]
fn a_forgotten_waits_registration_does_not_hide_a_cycle() {
    let table = LockTable::<&'static str>::new();
    let mut a = table.transaction();
    let mut b = table.transaction();
    let mut w = table.transaction();
    assert!(poll(Box::pin(a.lock("k", Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(b.lock("j", Mode::Exclusive)).as_mut()).is_ready());
    // b asks k exclusive behind a's shared grant, and forgets the call: its
    // wait is registered (b holds j) and never leaves.
    forget_pending(b.lock_all([("k", Mode::Exclusive)]));
    // w (holding nothing) queues exclusive on k behind b's waiter.
    let _m = table.try_lock("m").unwrap();
    let mut w_k = Box::pin(w.lock("k", Mode::Exclusive));
    assert!(poll(w_k.as_mut()).is_pending());
    // b's next call, forgotten too, clears the forgotten wait (its waiter
    // leaves k's queue; its registration stays)...
    forget_pending(b.lock_all([("m", Mode::Exclusive)]));
    // ... and the next queues shared on k behind w: b -> w -> a.
    let mut b_k = Box::pin(b.lock("k", Mode::Shared));
    let first = poll(b_k.as_mut());
    assert!(first.is_pending(), "{first:?} {:?}", table.status());
    // a waits for j, held by b: a -> b -> w -> a.
    let mut a_j = Box::pin(a.lock("j", Mode::Exclusive));
    let got_a = poll(a_j.as_mut());
    let got_b = poll(b_k.as_mut());
    let got_w = poll(w_k.as_mut());
    assert!(
        got_w.is_pending(),
        "w waits behind b's shared grant or for a: {got_w:?}"
    );
    let deadlock = |p: &Poll<Result<keylock::Acquired, TransactionError<&str>>>| {
        matches!(p, Poll::Ready(Err(TransactionError::Deadlock(_))))
    };
    // Answered: a victim told, or the soft cycle broken by granting b's
    // shared wait ahead of w.
    assert!(
        deadlock(&got_a) || deadlock(&got_b) || matches!(got_b, Poll::Ready(Ok(_))),
        "the cycle a -> b -> w -> a is left hanging: {:?}",
        table.status()
    );
}
