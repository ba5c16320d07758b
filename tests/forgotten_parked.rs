//! A borrowed transaction's call forgotten in a wait for a new key parks
//! its wait in the transaction (`pending::Parked`); a grant handed to it
//! later is the transaction's, held outside its set. The next call's wait
//! must let it go first. A wait through a cell (an upgrade, a `lock_all`
//! with an upgrade) did not: it queued behind the transaction's own
//! forgotten grant and waited for it for good, a wait no cycle answers
//! (the detector has no edge from a transaction to itself). Found by
//! `tests/stress_transactions.rs` (seed 12649245).
#![cfg(feature = "test-util")]
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use keylock::{LockTable, Mode};

mod common;
use common::{forget_pending, poll_noop as poll};

/// Polls `f` until it is ready, nine times at the most; the last answer.
fn poll_up_to_nine_times<F: Future + ?Sized>(mut f: Pin<&mut F>) -> Poll<F::Output> {
    let mut got = poll(f.as_mut());
    for _ in 0..8 {
        if got.is_ready() {
            break;
        }
        got = poll(f.as_mut());
    }
    got
}

/// The stress's shape: `lock_all` of a held shared key (upgraded) and of the
/// key the forgotten call was granted shared.
#[test]
fn a_lock_all_with_an_upgrade_lets_go_of_a_forgotten_calls_grant() {
    let table = LockTable::<u32>::new();
    let mut t = table.transaction();
    assert!(poll(Box::pin(t.lock(1, Mode::Shared)).as_mut()).is_ready());
    let other = table.try_lock(3).unwrap();
    // Forgotten while it waits for 3 (shared): its wait is parked in t.
    forget_pending(t.lock_all([(1, Mode::Shared), (3, Mode::Shared)]));
    // 3 is handed to the forgotten call's waiter: t holds it outside its set.
    drop(other);
    // Upgrades 1 (a cell's wait) and asks 3 exclusive.
    let mut call = Box::pin(t.lock_all([(3, Mode::Exclusive), (1, Mode::Exclusive)]));
    let got = poll_up_to_nine_times(call.as_mut());
    assert!(
        matches!(got, Poll::Ready(Ok(_))),
        "t waits for its own forgotten grant: {got:?} {:?}",
        table.status()
    );
    drop(call);
    drop(t);
    assert!(table.status().is_empty(), "{:?}", table.status());
}

/// A single lock's upgrade: the forgotten `lock_all`'s shared grant is
/// shared by the next lock of the key, whose upgrade then waits for it.
#[test]
fn an_upgrade_lets_go_of_a_forgotten_calls_grant() {
    let table = LockTable::<u32>::new();
    let mut t = table.transaction();
    assert!(poll(Box::pin(t.lock(1, Mode::Exclusive)).as_mut()).is_ready());
    let other = table.try_lock(3).unwrap();
    forget_pending(t.lock_all([(3, Mode::Shared)]));
    drop(other);
    // Had at once, shared beside the forgotten call's grant.
    let shared = poll(Box::pin(t.lock(3, Mode::Shared)).as_mut());
    assert!(
        matches!(shared, Poll::Ready(Ok(_))),
        "{shared:?} {:?}",
        table.status()
    );
    let mut call = Box::pin(t.lock(3, Mode::Exclusive));
    let got = poll_up_to_nine_times(call.as_mut());
    assert!(
        matches!(got, Poll::Ready(Ok(_))),
        "t's upgrade waits for its own forgotten grant: {got:?} {:?}",
        table.status()
    );
    drop(call);
    drop(t);
    assert!(table.status().is_empty(), "{:?}", table.status());
}
