//! Transactions: re-entrancy counts, upgrades through a stronger mode,
//! release of everything on commit, abort and drop (from another thread,
//! and while a lock future is pending on another task), all-or-nothing
//! multi-key locks under cancellation at random poll points, duplicates
//! merged, no deadlock among many multi-key lockers (tokio, async-std,
//! threads), wait policies, the transaction-wide deadline and all-or-nothing
//! renewal (on a manual clock: no sleeps, no timed assertions), and hostile
//! keys.

mod common;

use std::collections::HashSet;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::Poll;

use keylock::{
    AcquireKind, LockError, LockTable, Mode, OwnedTransaction, TransactionError,
    TransactionOptions, WaitPolicy,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use common::W;

type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

fn block<F: Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}

fn poll_once<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
}

// ---------------------------------------------------------------- re-entry

#[test]
fn reentry_is_counted_and_takes_nothing_twice() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    let first = block(txn.lock("k", Mode::Exclusive)).unwrap();
    assert_eq!((first.kind, first.count), (AcquireKind::New, 1));
    let grants = table.stats().acquisitions;
    for n in 2..=4 {
        let again = block(txn.lock("k", Mode::Exclusive)).unwrap();
        assert_eq!(again.kind, AcquireKind::Reentered);
        assert_eq!(again.count, n);
        assert_eq!(again.token, first.token, "the same grant");
    }
    // A weaker mode is covered by the exclusive grant.
    let weaker = block(txn.lock("k", Mode::Shared)).unwrap();
    assert_eq!(
        (weaker.kind, weaker.mode, weaker.count),
        (AcquireKind::Reentered, Mode::Exclusive, 5)
    );
    assert_eq!(
        table.stats().acquisitions,
        grants,
        "no grant was taken again"
    );
    assert_eq!(txn.count("k"), 5);
    assert_eq!(txn.len(), 1);

    // unlock takes back one count at a time; the key goes at zero.
    for left in (1..5).rev() {
        assert_eq!(txn.unlock(&"k"), Ok(left));
        assert!(table.is_locked("k"));
    }
    assert_eq!(txn.unlock(&"k"), Ok(0));
    assert!(!table.is_locked("k"));
    assert!(txn.is_empty());
    assert_eq!(
        txn.unlock(&"k"),
        Err(TransactionError::NotHeld { key: "k" })
    );
}

/// Past a few keys the held set is indexed: counts, removals (which move
/// slots) and re-entry stay right over many keys.
#[test]
fn many_keys_keep_their_counts() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    for k in 0..100u32 {
        txn.blocking_lock(k, Mode::Shared).unwrap();
        if k % 3 == 0 {
            txn.blocking_lock(k, Mode::Exclusive).unwrap(); // upgraded
        }
    }
    for k in (0..100u32).step_by(2) {
        let left = txn.unlock(&k).unwrap();
        assert_eq!(left, usize::from(k % 3 == 0), "key {k}");
    }
    let got = txn
        .blocking_lock_all((50..150u32).map(|k| (k, Mode::Shared)))
        .unwrap();
    for k in 0..150u32 {
        let before = if k < 100 {
            1 + usize::from(k % 3 == 0) - usize::from(k % 2 == 0)
        } else {
            0
        };
        let expected = before + usize::from(k >= 50);
        assert_eq!(txn.count(&k), expected, "key {k}");
        assert_eq!(table.is_locked(&k), expected > 0, "key {k}");
        if expected > 0 {
            let mode = if k < 100 && k % 3 == 0 {
                Mode::Exclusive
            } else {
                Mode::Shared
            };
            assert_eq!(txn.mode(&k), Some(mode), "key {k}");
        }
    }
    let new_keys = (50..150u32)
        .filter(|k| *k >= 100 || (k % 2 == 0 && k % 3 != 0))
        .count();
    assert_eq!(got.acquired(), new_keys);
    assert_eq!(got.acquired() + got.reentered(), 100);
    for k in 0..150u32 {
        while txn.count(&k) > 0 {
            txn.unlock(&k).unwrap();
        }
    }
    assert!(txn.is_empty());
    assert!(table.is_empty());
}

/// A set of more than 1,024 keys, filled by one `lock_all` and then by
/// single calls (its index built as keys go in past that, not by a later
/// lookup): every key is found by the queries, absent ones are not, and
/// early releases and re-entries keep each key's own count.
#[test]
fn a_large_set_is_found_by_queries_alone() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    let got = txn
        .blocking_lock_all((0..1500u32).map(|k| (k, Mode::Shared)))
        .unwrap();
    assert_eq!(got.acquired(), 1500);
    for k in 0..1500u32 {
        assert_eq!(txn.count(&k), 1, "key {k}");
        assert_eq!(txn.mode(&k), Some(Mode::Shared), "key {k}");
        assert!(txn.token(&k).is_some(), "key {k}");
    }
    for k in 1500..1600u32 {
        assert_eq!(txn.count(&k), 0, "key {k}");
        assert_eq!(txn.mode(&k), None, "key {k}");
    }
    for k in (0..1500u32).step_by(7) {
        assert_eq!(txn.unlock(&k).unwrap(), 0, "key {k}");
    }
    for k in 1500..1600u32 {
        txn.blocking_lock(k, Mode::Exclusive).unwrap();
    }
    for k in (1..1500u32).step_by(5) {
        let again = txn.blocking_lock(k, Mode::Shared).unwrap();
        let before = usize::from(k % 7 != 0);
        assert_eq!(again.count, before + 1, "key {k}");
    }
    for k in 0..1600u32 {
        let expected = if k >= 1500 {
            1
        } else {
            usize::from(k % 7 != 0) + usize::from(k % 5 == 1)
        };
        assert_eq!(txn.count(&k), expected, "key {k}");
        assert_eq!(table.is_locked(&k), expected > 0, "key {k}");
    }
    txn.commit().unwrap();
    assert!(table.is_empty());
}

/// Up to sixteen keys a set is searched by a scan of their hashes: every key
/// is still found, with its own count, after early releases move the last
/// key into each freed place, and after the set grows past the scan and
/// shrinks again.
#[test]
fn a_small_set_finds_every_key_after_early_releases() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    let mut counts = [0usize; 24];
    for k in 0..16u32 {
        for _ in 0..=k % 3 {
            txn.blocking_lock(k, Mode::Exclusive).unwrap();
            counts[k as usize] += 1;
        }
    }
    let check = |txn: &keylock::Transaction<'_, u32>, counts: &[usize; 24]| {
        for (k, &want) in counts.iter().enumerate() {
            assert_eq!(txn.count(&(k as u32)), want, "key {k}");
            assert_eq!(table.is_locked(&(k as u32)), want > 0, "key {k}");
        }
    };
    check(&txn, &counts);
    for k in [0u32, 7, 15, 3, 9, 1] {
        txn.release(&k).unwrap();
        counts[k as usize] = 0;
        check(&txn, &counts);
    }
    // Past the scan (an index takes over), then back under it.
    for k in 16..24u32 {
        txn.blocking_lock(k, Mode::Shared).unwrap();
        counts[k as usize] = 1;
    }
    check(&txn, &counts);
    for k in [16u32, 2, 23, 11, 20, 4] {
        txn.release(&k).unwrap();
        counts[k as usize] = 0;
        check(&txn, &counts);
    }
    txn.blocking_lock(0, Mode::Shared).unwrap();
    counts[0] = 1;
    check(&txn, &counts);
    txn.commit().unwrap();
    assert!(table.is_empty());
}

#[test]
fn release_lets_a_key_go_whatever_its_count() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    txn.blocking_lock(1, Mode::Shared).unwrap();
    txn.blocking_lock(1, Mode::Shared).unwrap();
    txn.blocking_lock(2, Mode::Shared).unwrap();
    txn.release(&1).unwrap();
    assert_eq!(txn.count(&1), 0);
    assert!(!table.is_locked(&1));
    assert!(table.is_locked(&2));
    assert_eq!(txn.release(&1), Err(TransactionError::NotHeld { key: 1 }));
}

#[test]
fn a_stronger_mode_upgrades_the_held_grant() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    let shared = block(txn.lock("k", Mode::Shared)).unwrap();
    let reader = table.try_lock_shared("k").unwrap();
    // The upgrade waits for the other reader only.
    let w = W::new();
    let mut up: BoxFut<'_, _> = Box::pin(txn.lock("k", Mode::Exclusive));
    assert!(w.poll(&mut up).is_pending());
    drop(reader);
    assert!(
        w.wakes() > 0,
        "the last other reader's release wakes the upgrade"
    );
    let Poll::Ready(up_res) = w.poll(&mut up) else {
        panic!("the upgrade completes once alone")
    };
    drop(up);
    let up_res = up_res.unwrap();
    assert_eq!(up_res.kind, AcquireKind::Upgraded);
    assert_eq!(up_res.mode, Mode::Exclusive);
    assert_eq!(up_res.count, 2);
    assert!(up_res.token > shared.token, "an upgrade is a new grant");
    assert_eq!(txn.mode("k"), Some(Mode::Exclusive));
    assert_eq!(txn.token("k"), Some(up_res.token));
    assert!(table.try_lock_shared("k").is_err(), "exclusive now");
}

#[test]
fn a_cancelled_upgrade_leaves_the_key_shared() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    block(txn.lock("k", Mode::Shared)).unwrap();
    let reader = table.try_lock_shared("k").unwrap();
    let w = W::new();
    let mut up: BoxFut<'_, _> = Box::pin(txn.lock("k", Mode::Exclusive));
    assert!(w.poll(&mut up).is_pending());
    drop(up);
    assert_eq!(txn.mode("k"), Some(Mode::Shared));
    assert_eq!(txn.count("k"), 1);
    drop(reader);
    assert!(table.try_lock_shared("k").is_ok(), "still shared");
}

#[test]
fn two_transactions_upgrading_one_key_do_not_deadlock() {
    let table = LockTable::new();
    let mut a = table.transaction();
    let mut b = table.transaction();
    block(a.lock("k", Mode::Shared)).unwrap();
    block(b.lock("k", Mode::Shared)).unwrap();
    let w = W::new();
    let mut up_a: BoxFut<'_, _> = Box::pin(a.lock("k", Mode::Exclusive));
    assert!(w.poll(&mut up_a).is_pending());
    let err = block(b.lock("k", Mode::Exclusive)).unwrap_err();
    assert!(
        matches!(
            err,
            TransactionError::Lock {
                key: "k",
                error: LockError::UpgradeConflict { .. },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        b.mode("k"),
        Some(Mode::Shared),
        "the refused upgrade leaves b shared"
    );
    b.abort();
    assert!(matches!(w.poll(&mut up_a), Poll::Ready(Ok(_))));
}

// -------------------------------------------------------------- release all

fn hold_three(txn: &mut keylock::Transaction<'_, u32>) {
    block(txn.lock_all([
        (1, Mode::Exclusive),
        (2, Mode::Shared),
        (3, Mode::Exclusive),
    ]))
    .unwrap();
    block(txn.lock(1, Mode::Exclusive)).unwrap();
}

#[test]
fn commit_releases_everything() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    hold_three(&mut txn);
    assert_eq!(table.len(), 3);
    txn.commit().unwrap();
    assert!(table.is_empty());
}

#[test]
fn commit_reports_a_lost_grant_and_releases_all_the_same() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    hold_three(&mut txn);
    let token = txn.token(&2).unwrap();
    assert!(table.revoke_grant(&2, token));
    assert_eq!(
        txn.check(),
        Err(TransactionError::Expired { key: 2, token })
    );
    assert_eq!(
        txn.commit(),
        Err(TransactionError::Expired { key: 2, token })
    );
    assert!(table.is_empty());

    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    txn.blocking_lock_all([(1, Mode::Exclusive), (2, Mode::Shared)])
        .unwrap();
    txn.commit().unwrap();
    assert!(table.is_empty());
    let txn = table.clone().transaction_owned();
    txn.blocking_lock_all([(1, Mode::Exclusive), (2, Mode::Shared)])
        .unwrap();
    let token = txn.token(&1).unwrap();
    assert!(table.revoke_grant(&1, token));
    assert_eq!(
        txn.commit(),
        Err(TransactionError::Expired { key: 1, token })
    );
    assert!(table.is_empty());
}

#[test]
fn abort_releases_everything() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    hold_three(&mut txn);
    txn.abort();
    assert!(table.is_empty());
}

#[test]
fn drop_releases_everything_from_another_thread() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    hold_three(&mut txn);
    std::thread::scope(|s| {
        s.spawn(move || drop(txn));
    });
    assert!(table.is_empty());

    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    txn.blocking_lock_all([(1, Mode::Exclusive), (2, Mode::Shared)])
        .unwrap();
    std::thread::spawn(move || drop(txn)).join().unwrap();
    assert!(table.is_empty());
}

#[test]
fn owned_drop_wakes_a_pending_lock_which_ends_holding_nothing() {
    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    txn.blocking_lock("a", Mode::Exclusive).unwrap();
    let other = table.try_lock("b").unwrap();
    let w = W::new();
    let mut pending = Box::pin(txn.lock("b", Mode::Exclusive));
    assert!(w.poll(&mut pending).is_pending());
    assert_eq!(table.waiters("b"), 1);
    drop(txn);
    assert!(
        !table.is_locked("a"),
        "the transaction's keys are released at once"
    );
    assert!(w.wakes() > 0, "the pending lock is woken");
    assert!(matches!(
        w.poll(&mut pending),
        Poll::Ready(Err(TransactionError::Ended))
    ));
    assert_eq!(table.waiters("b"), 0);
    drop(other);
    drop(pending);
    assert!(table.is_empty());
}

#[test]
fn owned_drop_after_a_grant_not_yet_seen_releases_it() {
    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    let other = table.try_lock("b").unwrap();
    let w = W::new();
    let mut pending = Box::pin(txn.lock("b", Mode::Exclusive));
    assert!(w.poll(&mut pending).is_pending());
    drop(other); // hands "b" to the pending lock, which has not run yet
    drop(txn);
    assert!(matches!(
        w.poll(&mut pending),
        Poll::Ready(Err(TransactionError::Ended))
    ));
    assert!(
        !table.is_locked("b"),
        "what it got after the end is released"
    );
    drop(pending);
    assert!(table.is_empty());
}

#[test]
fn owned_drop_while_an_upgrade_is_pending_releases_the_key() {
    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    txn.blocking_lock("k", Mode::Shared).unwrap();
    let reader = table.try_lock_shared("k").unwrap();
    let w = W::new();
    let mut up = Box::pin(txn.lock("k", Mode::Exclusive));
    assert!(w.poll(&mut up).is_pending());
    assert_eq!(txn.count("k"), 1, "counted as held while upgrading");
    drop(txn);
    assert!(matches!(
        w.poll(&mut up),
        Poll::Ready(Err(TransactionError::Ended))
    ));
    drop(up);
    drop(reader);
    assert!(table.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_drop_while_a_lock_is_pending_on_another_task() {
    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    txn.lock("a", Mode::Exclusive).await.unwrap();
    let other = table.clone().try_lock_owned("b").unwrap();
    let task = tokio::spawn(txn.lock("b", Mode::Exclusive));
    while table.waiters("b") == 0 {
        tokio::task::yield_now().await;
    }
    drop(txn);
    assert!(!table.is_locked("a"));
    let out = task.await.unwrap();
    assert_eq!(out, Err(TransactionError::Ended));
    assert_eq!(table.waiters("b"), 0);
    drop(other);
    assert!(table.is_empty());
}

/// Two locks of one owned transaction for one new key, on two threads at
/// once, many times: however they interleave, one takes the key and the
/// other re-enters it (a lock had at once leaves nothing in flight for the
/// other to fail `InFlight` on, and neither waits on its own transaction's
/// grant), and the end releases the one grant.
#[test]
fn two_owned_locks_of_one_new_key_at_once_take_it_once() {
    let table = Arc::new(LockTable::<u32>::new());
    for round in 0..2_000 {
        let txn = Arc::new(table.clone().transaction_owned());
        let mode = if round % 2 == 0 {
            Mode::Exclusive
        } else {
            Mode::Shared
        };
        let start = Arc::new(std::sync::Barrier::new(2));
        let (t, b) = (txn.clone(), start.clone());
        let other = std::thread::spawn(move || {
            b.wait();
            block(t.lock(7, mode))
        });
        start.wait();
        let mine = block(txn.lock(7, mode)).expect("granted or re-entered");
        let theirs = other.join().unwrap().expect("granted or re-entered");
        let mut kinds = [mine.kind, theirs.kind];
        kinds.sort_by_key(|k| *k != AcquireKind::New);
        assert_eq!(kinds, [AcquireKind::New, AcquireKind::Reentered]);
        assert_eq!((mine.token, txn.count(&7)), (theirs.token, 2));
        Arc::into_inner(txn)
            .expect("the thread is done")
            .commit()
            .unwrap();
        assert!(table.is_empty(), "round {round}: the end left the key held");
    }
}

/// A lock whose try on the table unwinds (the key's `Eq` panics as the
/// table compares it with the held one) leaves no mark of its attempt: the
/// next lock of that key by the same owned transaction waits and takes it
/// as usual (a mark left behind would make it wait for ever for an attempt
/// that ended).
#[test]
fn an_owned_lock_whose_try_panics_leaves_the_key_lockable() {
    #[derive(Debug, Clone)]
    struct Bomb {
        id: u32,
        armed: bool,
    }
    impl PartialEq for Bomb {
        fn eq(&self, other: &Self) -> bool {
            assert!(!self.armed && !other.armed, "a planted panic in Eq");
            self.id == other.id
        }
    }
    impl Eq for Bomb {}
    impl Hash for Bomb {
        fn hash<H: Hasher>(&self, state: &mut H) {
            self.id.hash(state);
        }
    }
    let key = |armed| Bomb { id: 1, armed };

    let table = Arc::new(LockTable::new());
    let other = table.try_lock(key(false)).unwrap();
    let txn = table.clone().transaction_owned();
    let tried = catch_unwind(AssertUnwindSafe(|| {
        block(txn.lock(key(true), Mode::Exclusive))
    }));
    assert!(tried.is_err(), "the planted panic reaches the caller");
    assert_eq!(txn.len(), 0);

    let w = W::new();
    let mut again = Box::pin(txn.lock(key(false), Mode::Exclusive));
    assert!(w.poll(&mut again).is_pending(), "queued behind the holder");
    drop(other);
    let Poll::Ready(got) = w.poll(&mut again) else {
        panic!("granted at the release")
    };
    assert_eq!(got.unwrap().kind, AcquireKind::New);
    assert_eq!(txn.count(&key(false)), 1);
    txn.commit().unwrap();
    assert!(table.is_empty());
}

#[test]
fn two_pending_calls_of_one_owner_for_one_key_do_not_wait_on_each_other() {
    let table = Arc::new(LockTable::new());
    let txn = table.clone().transaction_owned();
    let other = table.try_lock("k").unwrap();
    let w = W::new();
    let mut first = Box::pin(txn.lock("k", Mode::Exclusive));
    assert!(w.poll(&mut first).is_pending());
    let second = block(txn.lock("k", Mode::Exclusive));
    assert_eq!(second, Err(TransactionError::InFlight { key: "k" }));
    let all = block(txn.lock_all(vec![("j", Mode::Shared), ("k", Mode::Shared)]));
    assert_eq!(all, Err(TransactionError::InFlight { key: "k" }));
    assert!(!table.is_locked("j"), "the refused lock_all took nothing");
    drop(other);
    assert!(matches!(w.poll(&mut first), Poll::Ready(Ok(_))));
    assert_eq!(txn.count("k"), 1);
}

// --------------------------------------------------------------- lock_all

#[test]
fn lock_all_merges_duplicates_stronger_mode_wins() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    let got = block(txn.lock_all([
        ("a", Mode::Shared),
        ("b", Mode::Shared),
        ("a", Mode::Exclusive),
        ("b", Mode::Shared),
        ("a", Mode::Shared),
    ]))
    .unwrap();
    assert_eq!(got.acquired(), 2);
    assert_eq!(txn.mode("a"), Some(Mode::Exclusive));
    assert_eq!(txn.mode("b"), Some(Mode::Shared));
    assert_eq!(txn.count("a"), 1);
    assert_eq!(table.stats().acquisitions, 2);
}

/// Keys asked in order, some twice in a row (a scan that met a key again):
/// already sorted, but still merged; keys in strictly increasing order are
/// taken as they are.
#[test]
fn lock_all_in_key_order_still_merges_repeated_keys() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    // Polled once: a repeated key taken twice would wait on the
    // transaction itself, and show as `Pending` here.
    let got = poll_once(
        std::pin::pin!(txn.lock_all([
            ("a", Mode::Shared),
            ("a", Mode::Exclusive),
            ("b", Mode::Shared),
            ("c", Mode::Shared),
            ("c", Mode::Shared),
        ]))
        .as_mut(),
    );
    let Poll::Ready(got) = got else {
        panic!("a repeated key was not merged: the call waits on itself")
    };
    let got = got.unwrap();
    assert_eq!(got.acquired(), 3);
    assert_eq!(txn.mode("a"), Some(Mode::Exclusive));
    assert_eq!(txn.count("c"), 1);
    assert_eq!(table.stats().acquisitions, 3);
    let mut other = table.transaction();
    let got = block(other.lock_all([
        ("d", Mode::Shared),
        ("e", Mode::Shared),
        ("f", Mode::Exclusive),
    ]))
    .unwrap();
    assert_eq!(got.acquired(), 3);
    assert_eq!(other.mode("f"), Some(Mode::Exclusive));
    assert_eq!(table.stats().acquisitions, 6);
}

#[test]
fn self_transfer_does_not_deadlock() {
    let table = Arc::new(LockTable::new());
    let mut txn = table.transaction();
    block(txn.lock_all([(7, Mode::Exclusive), (7, Mode::Exclusive)])).unwrap();
    assert_eq!(txn.count(&7), 1);
    // And again, re-entrantly, through the owned form on a plain thread.
    let owned = table.clone().transaction_owned();
    owned
        .blocking_lock_all([(8, Mode::Exclusive), (8, Mode::Exclusive)])
        .unwrap();
    owned
        .blocking_lock_all([(8, Mode::Exclusive), (8, Mode::Exclusive)])
        .unwrap();
    assert_eq!(owned.count(&8), 2);
}

#[test]
fn lock_all_reenters_and_upgrades_held_keys() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    block(txn.lock("held-x", Mode::Exclusive)).unwrap();
    block(txn.lock("held-s", Mode::Shared)).unwrap();
    let got = block(txn.lock_all([
        ("held-x", Mode::Shared),
        ("held-s", Mode::Exclusive),
        ("new", Mode::Shared),
    ]))
    .unwrap();
    assert_eq!((got.acquired(), got.reentered(), got.upgraded()), (1, 1, 1));
    assert_eq!(txn.count("held-x"), 2);
    assert_eq!(txn.count("held-s"), 2);
    assert_eq!(txn.mode("held-s"), Some(Mode::Exclusive));
    assert_eq!(txn.count("new"), 1);
}

#[test]
fn lock_all_is_all_or_nothing_when_a_key_fails() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    block(txn.lock("x", Mode::Shared)).unwrap();
    let held = table.try_lock("m").unwrap();
    let reqs = [
        ("a", Mode::Exclusive),
        ("m", Mode::Exclusive),
        ("z", Mode::Shared),
        ("x", Mode::Exclusive),
    ];
    let err = block(txn.lock_all_with(reqs, WaitPolicy::NoWait)).unwrap_err();
    assert_eq!(
        err,
        TransactionError::Busy {
            key: "m",
            mode: Mode::Exclusive,
            holder: Some(held.token())
        }
    );
    assert!(err.to_string().contains("\"m\""), "{err}");
    assert!(!table.is_locked("a") && !table.is_locked("z"));
    assert_eq!(txn.len(), 1);
    assert_eq!(
        txn.mode("x"),
        Some(Mode::Shared),
        "an upgrade it made is undone"
    );
    assert_eq!(txn.count("x"), 1);
    assert!(table.try_lock_shared("x").is_ok());
}

/// The state of a scenario for cancellation: a transaction holding `s`
/// shared and `x` exclusive, others holding some of the keys a `lock_all`
/// asks for, released one by one at random between polls.
#[test]
fn lock_all_dropped_at_random_poll_points_holds_nothing_it_took() {
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let table = LockTable::new();
        let mut txn = table.transaction();
        block(txn.lock("s", Mode::Shared)).unwrap();
        block(txn.lock("x", Mode::Exclusive)).unwrap();
        let s_token = txn.token("s").unwrap();
        let x_token = txn.token("x").unwrap();
        // Others: a reader of "s" (the upgrade waits for it), holders of
        // some new keys.
        let mut others = vec![table.try_lock_shared("s").unwrap()];
        for key in ["n1", "n2", "n3", "n4"] {
            if rng.gen_bool(0.5) {
                others.push(if rng.gen_bool(0.5) {
                    table.try_lock(key).unwrap()
                } else {
                    table.try_lock_shared(key).unwrap()
                });
            }
        }
        others.shuffle(&mut rng);
        let mut reqs = vec![
            ("s", Mode::Exclusive),
            ("x", Mode::Shared),
            ("n1", Mode::Exclusive),
            ("n2", Mode::Shared),
            ("n3", Mode::Exclusive),
            ("n4", Mode::Exclusive),
            ("n1", Mode::Shared),
        ];
        reqs.shuffle(&mut rng);
        let polls = rng.gen_range(0..8);
        let w = W::new();
        let mut completed = false;
        {
            let mut fut: BoxFut<'_, _> = Box::pin(txn.lock_all(reqs));
            for _ in 0..polls {
                if let Poll::Ready(out) = w.poll(&mut fut) {
                    out.unwrap();
                    completed = true;
                    break;
                }
                if !others.is_empty() {
                    let i = rng.gen_range(0..others.len());
                    drop(others.swap_remove(i));
                }
            }
            // Dropped here, wherever it was.
        }
        if completed {
            // Then it all went in: exactly once.
            assert_eq!(txn.mode("s"), Some(Mode::Exclusive), "seed {seed}");
            assert_eq!(txn.len(), 6, "seed {seed}");
            continue;
        }
        // Nothing the call took is held, and the earlier keys are as they were.
        assert_eq!(txn.len(), 2, "seed {seed}");
        assert_eq!(
            (txn.count("s"), txn.mode("s")),
            (1, Some(Mode::Shared)),
            "seed {seed}"
        );
        assert_eq!(
            (txn.count("x"), txn.token("x")),
            (1, Some(x_token)),
            "seed {seed}"
        );
        assert!(txn.token("s").unwrap() >= s_token, "seed {seed}");
        drop(others);
        for key in ["n1", "n2", "n3", "n4"] {
            assert!(!table.is_locked(key), "seed {seed}: {key} stayed held");
            assert_eq!(table.waiters(key), 0, "seed {seed}");
        }
        assert!(
            table.try_lock_shared("s").is_ok(),
            "seed {seed}: s is shared again"
        );
        assert!(table.try_lock("x").is_err(), "seed {seed}");
        drop(txn);
        assert!(table.is_empty(), "seed {seed}");
    }
}

// -------------------------------------------------- no deadlock, runtimes

/// Per key: -1 while held exclusive, else the number of shared holders.
struct Exclusion {
    state: Vec<AtomicIsize>,
    violations: AtomicUsize,
}

const KEYS: u64 = 8;

impl Exclusion {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: (0..KEYS).map(|_| AtomicIsize::new(0)).collect(),
            violations: AtomicUsize::new(0),
        })
    }

    fn enter(&self, held: &[(u64, Mode)]) {
        for &(key, mode) in held {
            let cell = &self.state[key as usize];
            let ok = match mode {
                Mode::Exclusive => cell.compare_exchange(0, -1, SeqCst, SeqCst).is_ok(),
                Mode::Shared => cell
                    .fetch_update(SeqCst, SeqCst, |v| (v >= 0).then_some(v + 1))
                    .is_ok(),
            };
            if !ok {
                self.violations.fetch_add(1, SeqCst);
            }
        }
    }

    fn leave(&self, held: &[(u64, Mode)]) {
        for &(key, mode) in held {
            let cell = &self.state[key as usize];
            match mode {
                Mode::Exclusive => cell.store(0, SeqCst),
                Mode::Shared => {
                    cell.fetch_sub(1, SeqCst);
                }
            }
        }
    }
}

/// A random request over overlapping keys, in random order, with
/// duplicates; and the merged set it should hold.
type Requests = Vec<(u64, Mode)>;

fn random_request(rng: &mut StdRng) -> (Requests, Requests) {
    let n = rng.gen_range(1..=4);
    let mut reqs: Requests = (0..n)
        .map(|_| {
            let mode = if rng.gen_bool(0.4) {
                Mode::Shared
            } else {
                Mode::Exclusive
            };
            (rng.gen_range(0..KEYS), mode)
        })
        .collect();
    reqs.shuffle(rng);
    let mut merged: Requests = Vec::new();
    for &(key, mode) in &reqs {
        match merged.iter_mut().find(|(k, _)| *k == key) {
            Some((_, m)) => *m = (*m).max(mode),
            None => merged.push((key, mode)),
        }
    }
    (reqs, merged)
}

async fn worker(table: Arc<LockTable<u64>>, ex: Arc<Exclusion>, seed: u64, rounds: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..rounds {
        let (reqs, merged) = random_request(&mut rng);
        let txn: OwnedTransaction<u64> = table.clone().transaction_owned();
        let got = txn.lock_all(reqs).await.unwrap();
        assert_eq!(got.acquired(), merged.len());
        ex.enter(&merged);
        // Yield through a real wake, so that other tasks run meanwhile.
        for _ in 0..rng.gen_range(1..3) {
            YieldNow(false).await;
        }
        ex.leave(&merged);
        txn.commit().unwrap();
    }
}

struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

fn check_end(table: &LockTable<u64>, ex: &Exclusion) {
    assert_eq!(
        ex.violations.load(SeqCst),
        0,
        "two grants held a key against each other"
    );
    assert!(table.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_lock_all_callers_never_deadlock_tokio() {
    let table = Arc::new(LockTable::new());
    let ex = Exclusion::new();
    let tasks: Vec<_> = (0..16)
        .map(|seed| tokio::spawn(worker(table.clone(), ex.clone(), seed, 200)))
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    check_end(&table, &ex);
}

#[async_std::test]
async fn many_lock_all_callers_never_deadlock_async_std() {
    let table = Arc::new(LockTable::new());
    let ex = Exclusion::new();
    let tasks: Vec<_> = (0..16)
        .map(|seed| async_std::task::spawn(worker(table.clone(), ex.clone(), 100 + seed, 200)))
        .collect();
    for task in tasks {
        task.await;
    }
    check_end(&table, &ex);
}

#[test]
fn many_lock_all_callers_never_deadlock_threads() {
    let table: Arc<LockTable<u64>> = Arc::new(LockTable::new());
    let ex = Exclusion::new();
    std::thread::scope(|s| {
        for seed in 0..8u64 {
            let (table, ex) = (&table, &ex);
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(200 + seed);
                for round in 0..300 {
                    let (reqs, merged) = random_request(&mut rng);
                    if round % 2 == 0 {
                        // The borrowed form, blocking.
                        let mut txn = table.transaction();
                        txn.blocking_lock_all(reqs).unwrap();
                        ex.enter(&merged);
                        std::thread::yield_now();
                        ex.leave(&merged);
                        txn.commit().unwrap();
                    } else {
                        // The owned form, on futures' executor.
                        let txn = table.clone().transaction_owned();
                        block(txn.lock_all(reqs)).unwrap();
                        ex.enter(&merged);
                        std::thread::yield_now();
                        ex.leave(&merged);
                        drop(txn);
                    }
                }
            });
        }
    });
    check_end(&table, &ex);
}

/// A hasher that hashes a `u64` to itself: the table's order of hashes is
/// then the keys' order, which is also `lock_all`'s canonical order (the
/// keys' `Ord`, whatever the hasher: see `Reversed`).
#[derive(Default, Clone)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Ordered = std::hash::BuildHasherDefault<Identity>;

/// Transactions that take keys in two `lock_all` calls, the second asking
/// only keys at or above the highest of the first (re-entering or
/// upgrading it): the documented deadlock-free pattern, upgrades included.
/// A refused double upgrade is an error, not a wait: abort and go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ascending_transactions_with_upgrades_never_deadlock() {
    let table: Arc<LockTable<u64, Ordered>> =
        Arc::new(LockTable::builder().hasher(Ordered::default()).build());
    let ex = Exclusion::new();
    let conflicts = Arc::new(AtomicUsize::new(0));
    let upgrades = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..16u64)
        .map(|seed| {
            let (table, ex) = (table.clone(), ex.clone());
            let (conflicts, upgrades) = (conflicts.clone(), upgrades.clone());
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(300 + seed);
                for _ in 0..200 {
                    let txn = table.clone().transaction_owned();
                    let (first, _) = random_request(&mut rng);
                    txn.lock_all(first).await.unwrap();
                    let top = (0..KEYS).rev().find(|k| txn.count(k) > 0).unwrap();
                    let mut second = vec![(
                        top,
                        if rng.gen_bool(0.5) {
                            Mode::Exclusive
                        } else {
                            Mode::Shared
                        },
                    )];
                    for k in top + 1..KEYS {
                        if rng.gen_bool(0.3) {
                            second.push((
                                k,
                                if rng.gen_bool(0.5) {
                                    Mode::Exclusive
                                } else {
                                    Mode::Shared
                                },
                            ));
                        }
                    }
                    second.shuffle(&mut rng);
                    match txn.lock_all(second).await {
                        Ok(got) => {
                            upgrades.fetch_add(got.upgraded(), SeqCst);
                        }
                        Err(TransactionError::Lock {
                            error: LockError::UpgradeConflict { .. },
                            ..
                        }) => {
                            conflicts.fetch_add(1, SeqCst);
                            continue; // aborted by the drop
                        }
                        Err(err) => panic!("{err}"),
                    }
                    let held: Requests = (0..KEYS)
                        .filter_map(|k| txn.mode(&k).map(|m| (k, m)))
                        .collect();
                    ex.enter(&held);
                    YieldNow(false).await;
                    ex.leave(&held);
                    txn.commit().unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(ex.violations.load(SeqCst), 0);
    assert!(upgrades.load(SeqCst) > 0, "the scenario upgrades");
    assert!(table.is_empty());
    // Refused double upgrades happen or not, by chance; either way no wait.
    drop(conflicts);
}

/// The owned form's `lock_all`, dropped at random points while other
/// holders come and go, and its owner ended while one is pending.
#[test]
fn owned_lock_all_dropped_or_ended_at_random_points_holds_nothing_it_took() {
    for seed in 0..200u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let table = Arc::new(LockTable::new());
        let txn = table.clone().transaction_owned();
        txn.blocking_lock("s", Mode::Shared).unwrap();
        let mut others = vec![table.try_lock_shared("s").unwrap()];
        for key in ["n1", "n2", "n3"] {
            if rng.gen_bool(0.6) {
                others.push(table.try_lock(key).unwrap());
            }
        }
        others.shuffle(&mut rng);
        let mut reqs = vec![
            ("s", Mode::Exclusive),
            ("n1", Mode::Exclusive),
            ("n2", Mode::Shared),
            ("n3", Mode::Exclusive),
        ];
        reqs.shuffle(&mut rng);
        let end_owner = rng.gen_bool(0.5);
        let w = W::new();
        let mut fut = Box::pin(txn.lock_all(reqs));
        let mut out = None;
        for _ in 0..rng.gen_range(0..6) {
            if let Poll::Ready(done) = w.poll(&mut fut) {
                out = Some(done);
                break;
            }
            if !others.is_empty() {
                let i = rng.gen_range(0..others.len());
                drop(others.swap_remove(i));
            }
        }
        if end_owner {
            drop(txn);
            if out.is_none() {
                match w.poll(&mut fut) {
                    Poll::Ready(done) => {
                        assert_eq!(done, Err(TransactionError::Ended), "seed {seed}")
                    }
                    Poll::Pending => panic!("seed {seed}: an ended transaction's call is pending"),
                }
            }
            drop(fut);
            drop(others);
            assert!(table.is_empty(), "seed {seed}");
            continue;
        }
        drop(fut);
        if let Some(done) = out {
            done.unwrap();
            assert_eq!(txn.len(), 4, "seed {seed}");
            continue;
        }
        assert_eq!(txn.len(), 1, "seed {seed}");
        assert_eq!(
            (txn.count("s"), txn.mode("s")),
            (1, Some(Mode::Shared)),
            "seed {seed}"
        );
        drop(others);
        for key in ["n1", "n2", "n3"] {
            assert!(!table.is_locked(key), "seed {seed}: {key} stayed held");
        }
        assert!(table.try_lock_shared("s").is_ok(), "seed {seed}");
        drop(txn);
        assert!(table.is_empty(), "seed {seed}");
    }
}

// ------------------------------------------------------------ wait policies

#[test]
fn nowait_fails_at_once_naming_the_key_and_its_holder() {
    let table = LockTable::new();
    let holder = table.try_lock("k").unwrap();
    let mut txn = table.transaction_with(TransactionOptions::new().wait(WaitPolicy::NoWait));
    let w = W::new();
    let mut fut: BoxFut<'_, _> = Box::pin(txn.lock("k", Mode::Shared));
    let Poll::Ready(out) = w.poll(&mut fut) else {
        panic!("NoWait never waits")
    };
    drop(fut);
    assert_eq!(
        out,
        Err(TransactionError::Busy {
            key: "k",
            mode: Mode::Shared,
            holder: Some(holder.token())
        })
    );
    assert_eq!(table.waiters("k"), 0);
    // A shared holder does not stop a shared NoWait lock; an upgrade past it is busy.
    drop(holder);
    let reader = table.try_lock_shared("k").unwrap();
    block(txn.lock("k", Mode::Shared)).unwrap();
    let err = block(txn.lock("k", Mode::Exclusive)).unwrap_err();
    assert!(
        matches!(
            err,
            TransactionError::Busy {
                key: "k",
                mode: Mode::Exclusive,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(txn.mode("k"), Some(Mode::Shared));
    drop(reader);
}

#[test]
fn skip_locked_takes_the_free_keys_and_reports_the_others() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    block(txn.lock("up", Mode::Shared)).unwrap();
    let _reader = table.try_lock_shared("up").unwrap();
    let _w = table.try_lock("w").unwrap();
    let _r = table.try_lock_shared("r").unwrap();
    let reqs = [
        ("free", Mode::Exclusive),
        ("w", Mode::Shared),
        ("r", Mode::Shared), // shared with a reader: free
        ("r2", Mode::Shared),
        ("up", Mode::Exclusive), // the upgrade cannot happen at once
    ];
    let got = block(txn.lock_all_with(reqs, WaitPolicy::SkipLocked)).unwrap();
    let skipped: HashSet<_> = got.skipped().iter().copied().collect();
    assert_eq!(skipped, HashSet::from(["w", "up"]));
    assert_eq!(got.acquired(), 3);
    assert_eq!(got.upgraded(), 0);
    assert_eq!(
        txn.mode("up"),
        Some(Mode::Shared),
        "a skipped upgrade stays shared"
    );
    assert_eq!(txn.count("up"), 1);
    assert_eq!(txn.count("w"), 0);
    for key in ["free", "r", "r2"] {
        assert_eq!(txn.count(key), 1, "{key}");
    }
    // A single lock under SkipLocked has nothing to skip to: it is busy.
    let err = block(txn.lock_with("w", Mode::Exclusive, WaitPolicy::SkipLocked)).unwrap_err();
    assert!(matches!(err, TransactionError::Busy { key: "w", .. }));
}

/// Under `SkipLocked`, a `lock_all` lists each key it took and how, beside
/// the keys it skipped: a new key, a covered one (re-entered) and an
/// upgrade, on the path that claims keys (a held key in a weaker mode) and
/// on the one that does not, in both forms.
#[test]
fn skip_locked_lists_the_keys_it_took_and_how() {
    fn check(got: &keylock::LockedSet<&'static str>, want: &[(&'static str, AcquireKind)]) {
        let keys: HashSet<_> = got.keys().iter().copied().collect();
        assert_eq!(keys, want.iter().copied().collect::<HashSet<_>>());
        assert_eq!(got.keys().len(), want.len(), "each key once");
        assert_eq!(
            got.keys().len(),
            got.acquired() + got.reentered() + got.upgraded(),
            "the list agrees with the counts"
        );
        assert_eq!(got.skipped(), &["w"]);
    }
    let table = Arc::new(LockTable::new());
    let _w = table.try_lock("w").unwrap();
    // The borrowed form without claims: every key new or covered.
    let mut txn = table.transaction();
    block(txn.lock("held", Mode::Exclusive)).unwrap();
    let reqs = [
        ("free", Mode::Exclusive),
        ("w", Mode::Exclusive),
        ("held", Mode::Shared),
    ];
    let got = block(txn.lock_all_with(reqs, WaitPolicy::SkipLocked)).unwrap();
    check(
        &got,
        &[("free", AcquireKind::New), ("held", AcquireKind::Reentered)],
    );
    txn.abort();
    // With an upgrade (the claiming path), borrowed and owned.
    let reqs = [
        ("free", Mode::Exclusive),
        ("w", Mode::Exclusive),
        ("held", Mode::Shared),
        ("up", Mode::Exclusive),
    ];
    let want = [
        ("free", AcquireKind::New),
        ("held", AcquireKind::Reentered),
        ("up", AcquireKind::Upgraded),
    ];
    let mut txn = table.transaction();
    block(txn.lock("held", Mode::Exclusive)).unwrap();
    block(txn.lock("up", Mode::Shared)).unwrap();
    let got = block(txn.lock_all_with(reqs, WaitPolicy::SkipLocked)).unwrap();
    check(&got, &want);
    assert_eq!(txn.mode("up"), Some(Mode::Exclusive));
    txn.abort();
    let txn = table.clone().transaction_owned();
    block(txn.lock("held", Mode::Exclusive)).unwrap();
    block(txn.lock("up", Mode::Shared)).unwrap();
    let got = block(txn.lock_all_with(reqs, WaitPolicy::SkipLocked)).unwrap();
    check(&got, &want);
    let (keys, skipped) = got.into_parts();
    assert_eq!((keys.len(), skipped), (3, vec!["w"]));
    drop(txn);
    assert_eq!(table.len(), 1, "only the blocker's key");
}

/// `lock_up_to` takes the first `n` candidates that can be had at once,
/// in the caller's order, skipping the others, and leaves the rest
/// untouched: two consumers of one queue share it out without waiting.
#[test]
fn lock_up_to_takes_the_first_n_free_candidates_in_order() {
    let table = Arc::new(LockTable::new());
    let _busy = [table.try_lock(2).unwrap(), table.try_lock(4).unwrap()];
    let jobs = || {
        (1..=7)
            .map(|job| (job, Mode::Exclusive))
            .collect::<Vec<_>>()
    };
    let mut first = table.transaction();
    let got = block(first.lock_up_to(3, jobs())).unwrap();
    let new = |keys: &[u32]| {
        keys.iter()
            .map(|&k| (k, AcquireKind::New))
            .collect::<Vec<_>>()
    };
    assert_eq!(got.keys(), new(&[1, 3, 5]), "in the candidates' order");
    assert_eq!(got.skipped(), &[2, 4]);
    assert_eq!(got.acquired(), 3);
    for untouched in [6, 7] {
        assert!(!table.is_locked(&untouched), "{untouched} untouched");
    }
    // A second consumer, owned: what is left.
    let second = table.clone().transaction_owned();
    let got = block(second.lock_up_to(3, jobs())).unwrap();
    assert_eq!(got.keys(), new(&[6, 7]));
    assert_eq!(got.skipped(), &[1, 2, 3, 4, 5]);
    assert_eq!(second.len(), 2);
    // A key the transaction holds counts as taken (re-entered); one held
    // shared beside another reader cannot be upgraded at once: skipped,
    // and stays shared.
    let table = LockTable::new();
    let _reader = table.try_lock_shared(10).unwrap();
    let mut txn = table.transaction();
    block(txn.lock(10, Mode::Shared)).unwrap();
    block(txn.lock(11, Mode::Exclusive)).unwrap();
    let cands = [
        (10, Mode::Exclusive),
        (11, Mode::Shared),
        (12, Mode::Exclusive),
        (13, Mode::Exclusive),
    ];
    let got = block(txn.lock_up_to(2, cands)).unwrap();
    assert_eq!(
        got.keys(),
        [(11, AcquireKind::Reentered), (12, AcquireKind::New)]
    );
    assert_eq!((got.reentered(), got.acquired()), (1, 1));
    assert_eq!(got.skipped(), &[10]);
    assert_eq!(
        txn.mode(&10),
        Some(Mode::Shared),
        "a skipped upgrade stays shared"
    );
    assert_eq!(txn.count(&13), 0, "past the limit: untouched");
    assert!(!table.is_locked(&13));
    // A limit of zero takes nothing.
    let got = block(txn.lock_up_to(0, [(13, Mode::Exclusive)])).unwrap();
    assert!(got.keys().is_empty() && got.skipped().is_empty());
    // An error other than a key being taken ends the call, naming it (a
    // second pending call of an owned transaction on the same key).
    let table = Arc::new(LockTable::new());
    let blocker = table.try_lock(20).unwrap();
    let txn = table.clone().transaction_owned();
    let mut waiting = Box::pin(txn.lock(20, Mode::Exclusive));
    assert!(poll_once(waiting.as_mut()).is_pending());
    let err = block(txn.lock_up_to(2, [(21, Mode::Exclusive), (20, Mode::Exclusive)])).unwrap_err();
    assert!(
        matches!(err, TransactionError::InFlight { key: 20 }),
        "{err}"
    );
    drop(blocker);
    assert!(block(waiting).is_ok());
}

/// A transaction lists the keys it holds, each with its mode.
#[test]
fn a_transactions_keys_are_listed_with_their_modes() {
    let table = Arc::new(LockTable::new());
    let mut txn = table.transaction();
    block(txn.lock_all([("a", Mode::Exclusive), ("b", Mode::Shared)])).unwrap();
    block(txn.lock("a", Mode::Shared)).unwrap(); // re-entered: listed once
    let keys: HashSet<_> = txn.keys().collect();
    assert_eq!(
        keys,
        HashSet::from([(&"a", Mode::Exclusive), (&"b", Mode::Shared)])
    );
    txn.release(&"b").unwrap();
    assert_eq!(txn.keys().collect::<Vec<_>>(), [(&"a", Mode::Exclusive)]);
    drop(txn);
    let txn = table.clone().transaction_owned();
    block(txn.lock_all(vec![("a", Mode::Exclusive), ("b", Mode::Shared)])).unwrap();
    let keys: HashSet<_> = txn.keys().into_iter().collect();
    assert_eq!(
        keys,
        HashSet::from([("a", Mode::Exclusive), ("b", Mode::Shared)])
    );
    txn.abort();
    assert!(table.is_empty());
}

// ------------------------------------------------------- hostile keys

static HOSTILE: AtomicBool = AtomicBool::new(false);

/// A key whose `Eq` (and `Hash`, for ids above 100) panics while
/// `HOSTILE` is set.
#[derive(Debug, Clone, PartialOrd, Ord)]
struct Hostile(u32);

impl PartialEq for Hostile {
    fn eq(&self, other: &Self) -> bool {
        if HOSTILE.load(SeqCst) && (self.0 == 13 || other.0 == 13) {
            panic!("hostile Eq");
        }
        self.0 == other.0
    }
}
impl Eq for Hostile {}
impl Hash for Hostile {
    fn hash<H: Hasher>(&self, state: &mut H) {
        if HOSTILE.load(SeqCst) && self.0 > 100 {
            panic!("hostile Hash");
        }
        self.0.hash(state);
    }
}

#[test]
fn a_key_whose_eq_or_hash_panics_strands_nothing() {
    let table = LockTable::new();
    let mut txn = table.transaction();
    block(txn.lock_all([(Hostile(13), Mode::Shared), (Hostile(1), Mode::Exclusive)])).unwrap();
    HOSTILE.store(true, SeqCst);
    // Eq panics while the held set is searched for 13.
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = block(txn.lock(Hostile(13), Mode::Exclusive));
    }));
    assert!(panicked.is_err());
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let reqs = (2..12)
            .map(|i| (Hostile(i), Mode::Exclusive))
            .chain([(Hostile(13), Mode::Exclusive)]);
        let _ = block(txn.lock_all(reqs));
    }));
    assert!(panicked.is_err());
    // Hash panics before anything is taken.
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = block(txn.lock_all([
            (Hostile(5), Mode::Exclusive),
            (Hostile(101), Mode::Exclusive),
        ]));
    }));
    assert!(panicked.is_err());
    HOSTILE.store(false, SeqCst);
    // Nothing the failed calls claimed stayed, the earlier keys did.
    assert_eq!(txn.len(), 2);
    assert_eq!(txn.mode(&Hostile(13)), Some(Mode::Shared));
    assert_eq!(txn.count(&Hostile(13)), 1);
    assert_eq!(
        table.len(),
        2,
        "only the transaction's two keys are in the table"
    );
    drop(txn);
    assert!(table.is_empty());
}

// ---------------------------------------------------------- send / sync

#[test]
fn owned_transactions_and_their_futures_are_send_and_static() {
    fn send_static<T: Send + 'static>(_: &T) {}
    fn send_sync<T: Send + Sync>() {}
    send_sync::<OwnedTransaction<String>>();
    send_sync::<keylock::Transaction<'static, String>>();
    send_sync::<TransactionError<String>>();
    let table = Arc::new(LockTable::<String>::new());
    fn send<T: Send>(_: &T) {}
    let mut borrowed = table.transaction();
    send(&borrowed.lock("k".to_owned(), Mode::Exclusive));
    send(&borrowed.lock_all([("k".to_owned(), Mode::Exclusive)]));
    drop(borrowed);
    let txn = table.transaction_owned();
    send_static(&txn.lock("k".to_owned(), Mode::Exclusive));
    send_static(&txn.lock_all(vec![("k".to_owned(), Mode::Exclusive)]));
    let err: Box<dyn std::error::Error + Send + Sync> = Box::new(TransactionError::<String>::Ended);
    assert!(err.to_string().contains("ended"));
}

// ------------------------------------------------- deadline and leases

#[cfg(feature = "test-util")]
mod manual_clock {
    use std::time::Duration;

    use keylock::{LockError, LockTable, ManualClock, Mode, TransactionError, TransactionOptions};

    use crate::common::{SEC, W};
    use crate::BoxFut;
    use std::task::Poll;

    fn table() -> (ManualClock, LockTable<&'static str>) {
        let clock = ManualClock::new();
        (clock.clone(), LockTable::builder().clock(clock).build())
    }

    #[test]
    fn every_lock_waits_until_the_transaction_deadline_at_most() {
        let (clock, table) = table();
        let a = table.try_lock("a").unwrap();
        let b = table.try_lock("b").unwrap();
        let mut txn = table.transaction_with(TransactionOptions::new().timeout(10 * SEC));
        assert_eq!(txn.deadline(), Some(clock.now() + 10 * SEC));
        let w = W::new();
        let mut fut: BoxFut<'_, _> =
            Box::pin(txn.lock_all([("a", Mode::Exclusive), ("b", Mode::Exclusive)]));
        assert!(w.poll(&mut fut).is_pending());
        // Six seconds in, one key comes free; the other is waited for
        // until the same deadline, not six seconds more.
        clock.advance(6 * SEC);
        assert!(w.poll(&mut fut).is_pending());
        drop(a);
        assert!(w.poll(&mut fut).is_pending(), "b is still held");
        clock.advance(4 * SEC - Duration::from_nanos(1));
        assert!(w.poll(&mut fut).is_pending());
        clock.advance(Duration::from_nanos(1));
        let Poll::Ready(out) = w.poll(&mut fut) else {
            panic!("the deadline passed")
        };
        drop(fut);
        let err = out.unwrap_err();
        assert!(
            matches!(err, TransactionError::Lock { key: "b", error: LockError::Timeout { holder: Some(t), .. }, .. } if t == b.token()),
            "{err}"
        );
        assert!(txn.is_empty(), "all or nothing: a was let go");
        assert!(!table.is_locked("a"));
        // A lock after the deadline gives up at once.
        let c = table.try_lock("c").unwrap();
        let err = futures::executor::block_on(txn.lock("c", Mode::Shared)).unwrap_err();
        assert!(matches!(
            err,
            TransactionError::Lock {
                key: "c",
                error: LockError::Timeout { .. },
                ..
            }
        ));
        drop(c);
    }

    #[test]
    fn every_grant_carries_the_transaction_lease_and_renew_renews_all() {
        let (clock, table) = table();
        let mut txn = table.transaction_with(TransactionOptions::new().lease(10 * SEC));
        txn.blocking_lock("a", Mode::Exclusive).unwrap();
        txn.blocking_lock("b", Mode::Shared).unwrap();
        clock.advance(6 * SEC);
        txn.renew().unwrap();
        clock.advance(6 * SEC);
        txn.check().expect("renewed at 6 s: live until 16 s");
        clock.advance(4 * SEC);
        let err = txn.check().unwrap_err();
        assert!(matches!(err, TransactionError::Expired { .. }));
    }

    #[test]
    fn commit_judges_each_grant_as_it_lets_go() {
        let (clock, table) = table();
        let mut txn = table.transaction_with(TransactionOptions::new().lease(10 * SEC));
        txn.blocking_lock("a", Mode::Exclusive).unwrap();
        clock.advance(5 * SEC);
        txn.blocking_lock("b", Mode::Shared).unwrap();
        let a = txn.token("a").unwrap();
        clock.advance(5 * SEC); // "a" lapses now, unnoticed by anyone
        assert_eq!(
            txn.commit(),
            Err(TransactionError::Expired { key: "a", token: a })
        );
        assert!(table.is_empty());
    }

    #[test]
    fn renew_is_all_or_nothing_and_names_the_lapsed_key() {
        let (clock, table) = table();
        let mut txn = table.transaction_with(TransactionOptions::new().lease(10 * SEC));
        txn.blocking_lock("early", Mode::Exclusive).unwrap(); // lapses at 10 s
        clock.advance(6 * SEC);
        txn.blocking_lock("late", Mode::Exclusive).unwrap(); // lapses at 16 s
        let late = txn.token("late").unwrap();
        let early = txn.token("early").unwrap();
        clock.advance(5 * SEC); // 11 s
        let err = txn.renew().unwrap_err();
        assert_eq!(
            err,
            TransactionError::Expired {
                key: "early",
                token: early
            }
        );
        assert!(err.to_string().contains("\"early\""), "{err}");
        // None was renewed: "late" still lapses at 16 s.
        clock.advance(5 * SEC - Duration::from_nanos(1));
        assert!(table.is_locked("late"));
        clock.advance(Duration::from_nanos(1));
        assert!(
            !table.is_locked("late"),
            "a renewal would have kept it to 21 s"
        );
        // Both lapsed now; the check names one of them.
        let err = txn.check().unwrap_err();
        assert!(matches!(err.key(), Some(&"early" | &"late")), "{err}");
        assert_eq!(txn.token("late"), Some(late), "still the grant it was");
    }
}

/// Found by the fuzz harness's model of owners: failed before its fix.
mod fuzz_regressions {

    use std::future::Future;
    use std::hash::{BuildHasher, Hasher};
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use futures::task::{noop_waker, waker, ArcWake};
    use keylock::{LockTable, Mode, TransactionError};

    /// Hashes a `u64` key to itself (the table's order of hashes is the
    /// keys' order, as `lock_all`'s canonical order is).
    #[derive(Clone, Copy, Default)]
    struct Identity;
    struct IdentityHasher(u64);
    impl BuildHasher for Identity {
        type Hasher = IdentityHasher;
        fn build_hasher(&self) -> IdentityHasher {
            IdentityHasher(0)
        }
    }
    impl Hasher for IdentityHasher {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, _: &[u8]) {
            unreachable!("u64 keys only")
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = n;
        }
    }

    /// A waker whose first wake panics.
    struct Bomb(AtomicBool);
    impl ArcWake for Bomb {
        fn wake_by_ref(me: &Arc<Self>) {
            if !me.0.swap(true, SeqCst) {
                panic!("waker");
            }
        }
    }

    /// A `lock_all` that upgraded a held shared key and then waits for another
    /// is dropped; undoing its upgrade (`Stage::drop` downgrades it) admits a
    /// queued reader whose waker panics. The panic leaves `Stage::drop` before
    /// it gives its claims back: the upgraded guard, out of the set, is dropped
    /// by the unwinding (the transaction loses the key it held before the
    /// call), and the set keeps the two slots busy for ever (the key counted
    /// but with no mode; every later call for either key fails `InFlight`).
    #[test]
    fn a_panicking_wake_while_a_dropped_lock_all_undoes_its_upgrade_keeps_the_earlier_lock() {
        let table = LockTable::<u64>::builder().hasher(Identity).build();
        let mut txn = table.transaction();
        futures::executor::block_on(txn.lock(1, Mode::Shared)).unwrap();
        let other = table.try_lock(2).unwrap();

        let noop = noop_waker();
        let mut cx = Context::from_waker(&noop);
        let mut all = Box::pin(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
        // Key 1 is upgraded at once (the only holder); key 2 is waited for.
        assert!(all.as_mut().poll(&mut cx).is_pending());
        assert_eq!(table.waiters(&2), 1);

        // A reader queues behind the upgraded (exclusive) grant of key 1.
        let bomb = waker(Arc::new(Bomb(AtomicBool::new(false))));
        let mut reader = Box::pin(table.lock_shared(1));
        assert!(reader
            .as_mut()
            .poll(&mut Context::from_waker(&bomb))
            .is_pending());

        // Dropping the call downgrades key 1 back, which admits the reader and
        // wakes it: its waker panics, and the panic reaches the caller.
        let dropped = catch_unwind(AssertUnwindSafe(|| drop(all)));
        assert!(dropped.is_err(), "the waker's panic is resumed");

        // The transaction holds key 1 shared, as before the call ...
        assert_eq!(txn.count(&1), 1);
        assert_eq!(txn.mode(&1), Some(Mode::Shared), "key 1 as before the call");
        // ... and nothing of key 2.
        assert_eq!(txn.count(&2), 0);
        assert_eq!(txn.len(), 1);
        let Poll::Ready(g) = reader.as_mut().poll(&mut cx) else {
            panic!("the reader was admitted")
        };
        assert_eq!(g.mode(), Mode::Shared);
        drop(g);
        assert!(table.is_locked(&1), "the transaction still holds key 1");
        // Later calls for both keys work.
        drop(other);
        let again = futures::executor::block_on(txn.lock(2, Mode::Exclusive));
        assert!(
            !matches!(again, Err(TransactionError::InFlight { .. })),
            "key 2 is not stuck in flight: {again:?}"
        );
        let again = futures::executor::block_on(txn.lock(1, Mode::Shared));
        assert!(
            !matches!(again, Err(TransactionError::InFlight { .. })),
            "key 1 is not stuck in flight: {again:?}"
        );
    }
}

/// A hasher that hashes every key alike: the canonical order of a
/// `lock_all` is then the keys' `Ord` alone.
#[derive(Default, Clone)]
struct Tie;

impl Hasher for Tie {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, _: &[u8]) {}
}

type Tied = std::hash::BuildHasherDefault<Tie>;

/// A hasher that orders `u64` keys' hashes against the keys' order: a
/// `lock_all` still takes the keys in their own order (its canonical
/// order is by key, not by the table's hash), as code that sorts its
/// plain guards by hand does.
#[derive(Default, Clone)]
struct Against(u64);

impl Hasher for Against {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = u64::MAX - n;
    }
}

type Reversed = std::hash::BuildHasherDefault<Against>;

/// A `lock_all` of one or two keys (a transfer's): a key asked twice is
/// taken once in the stronger mode, a covered key is re-entered beside a
/// new one, a held shared key is upgraded, and the keys are taken in the
/// canonical order whatever order they are asked in (by key, whatever the
/// table's hashes: the same, in key order, or against it): the lower key
/// is held while the call waits for the higher one, and a call dropped
/// while it waits keeps nothing.
#[test]
fn a_two_key_lock_all_merges_reenters_upgrades_and_keeps_the_order() {
    let table = LockTable::<u64>::new();
    let mut txn = table.transaction();
    let got = block(txn.lock_all([(1, Mode::Shared), (1, Mode::Exclusive)])).unwrap();
    assert_eq!((got.acquired(), got.reentered()), (1, 0));
    assert_eq!((txn.mode(&1), txn.count(&1)), (Some(Mode::Exclusive), 1));
    let got = block(txn.lock_all([(2, Mode::Exclusive), (1, Mode::Shared)])).unwrap();
    assert_eq!((got.acquired(), got.reentered(), got.upgraded()), (1, 1, 0));
    assert_eq!((txn.count(&1), txn.count(&2)), (2, 1));
    let got = block(txn.lock_all([(2, Mode::Shared)])).unwrap();
    assert_eq!((got.acquired(), got.reentered()), (0, 1));
    assert_eq!(txn.count(&2), 2);
    txn.commit().unwrap();
    assert!(table.is_empty());

    let mut txn = table.transaction();
    block(txn.lock(1, Mode::Shared)).unwrap();
    let got = block(txn.lock_all([(3, Mode::Exclusive), (1, Mode::Exclusive)])).unwrap();
    assert_eq!((got.acquired(), got.upgraded()), (1, 1));
    assert_eq!(
        (txn.mode(&1), txn.mode(&3)),
        (Some(Mode::Exclusive), Some(Mode::Exclusive))
    );
    drop(txn);
    assert!(table.is_empty());

    fn in_order<S: std::hash::BuildHasher + Default>() {
        let table = LockTable::<u64>::builder().hasher(S::default()).build();
        let mut txn = table.transaction();
        // The higher key busy: the lower one is taken, and held while the
        // call waits.
        let blocker = table.try_lock(20).unwrap();
        {
            let mut call =
                std::pin::pin!(txn.lock_all([(20, Mode::Exclusive), (10, Mode::Exclusive)]));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(table.is_locked(&10), "the lower key first");
            drop(blocker);
            let Poll::Ready(got) = poll_once(call.as_mut()) else {
                panic!("handed the key")
            };
            assert_eq!(got.unwrap().acquired(), 2);
        }
        assert_eq!(txn.len(), 2);
        txn.commit().unwrap();
        assert!(table.is_empty());
        // Dropped while it waits for the higher key: the lower one goes.
        let mut txn = table.transaction();
        let blocker = table.try_lock(20).unwrap();
        {
            let mut call =
                std::pin::pin!(txn.lock_all([(20, Mode::Shared), (10, Mode::Exclusive)]));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(table.is_locked(&10));
        }
        assert!(!table.is_locked(&10));
        assert_eq!(txn.len(), 0);
        drop(blocker);
        // Three keys (the general way, not the transfer's): the two lower
        // ones are taken, and held while the call waits for the highest.
        let blocker = table.try_lock(30).unwrap();
        {
            let mut call = std::pin::pin!(txn.lock_all([
                (30, Mode::Exclusive),
                (10, Mode::Shared),
                (20, Mode::Exclusive)
            ]));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(table.is_locked(&10) && table.is_locked(&20));
            drop(blocker);
            let Poll::Ready(got) = poll_once(call.as_mut()) else {
                panic!("handed the key")
            };
            assert_eq!(got.unwrap().acquired(), 3);
        }
        for key in [10, 20, 30] {
            txn.release(&key).unwrap();
        }
        // The lower key busy: nothing is taken while the call waits.
        let blocker = table.try_lock(10).unwrap();
        {
            let mut call =
                std::pin::pin!(txn.lock_all([(20, Mode::Exclusive), (10, Mode::Exclusive)]));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(!table.is_locked(&20), "nothing above a key waited for");
        }
        drop(blocker);
        drop(txn);
        assert!(table.is_empty());
    }
    in_order::<Ordered>();
    in_order::<Tied>();
    in_order::<Reversed>();
}

/// A fresh transaction's `lock_all` of many keys (its first call, asked in
/// any order) that finds one busy: it holds the keys below it while it
/// waits and none above; dropped, it keeps nothing; forgotten, its
/// transaction's end releases everything it took or is handed later; let
/// through, it has them all.
#[test]
fn a_fresh_lock_all_of_many_keys_waits_holding_the_keys_below_the_busy_one() {
    let table = LockTable::<u64>::new();
    let asked = || {
        [
            (7, Mode::Shared),
            (2, Mode::Exclusive),
            (5, Mode::Exclusive),
            (0, Mode::Shared),
            (9, Mode::Exclusive),
            (2, Mode::Shared),
        ]
    };
    let below = [0, 2];
    let above = [7, 9];
    // Dropped while it waits.
    let blocker = table.try_lock(5).unwrap();
    let mut txn = table.transaction();
    {
        let mut call = Box::pin(txn.lock_all(asked()));
        assert!(poll_once(call.as_mut()).is_pending());
        assert!(
            below.iter().all(|k| table.is_locked(k)),
            "the keys below, held"
        );
        assert!(above.iter().all(|k| !table.is_locked(k)), "none above");
    }
    assert_eq!((txn.len(), table.len()), (0, 1), "dropped: nothing kept");
    // Failing (a transaction that does not wait): the keys below come back
    // out of the set and are released, all or nothing.
    {
        let mut nowait = table.transaction_with(TransactionOptions::new().wait(WaitPolicy::NoWait));
        let Poll::Ready(got) = poll_once(Box::pin(nowait.lock_all(asked())).as_mut()) else {
            panic!("a transaction that does not wait answers at once")
        };
        assert!(
            matches!(got, Err(TransactionError::Busy { key: 5, .. })),
            "{got:?}"
        );
        assert_eq!((nowait.len(), table.len()), (0, 1), "failed: nothing kept");
        assert!(
            below.iter().all(|k| !table.is_locked(k)),
            "the keys below, released"
        );
    }
    // Let through.
    {
        let mut call = Box::pin(txn.lock_all(asked()));
        assert!(poll_once(call.as_mut()).is_pending());
        drop(blocker);
        let Poll::Ready(got) = poll_once(call.as_mut()) else {
            panic!("handed the key")
        };
        assert_eq!(got.unwrap().acquired(), 5, "five keys, 2 asked twice");
    }
    assert_eq!(txn.mode(&2), Some(Mode::Exclusive), "the stronger mode");
    assert_eq!(txn.mode(&0), Some(Mode::Shared));
    txn.commit().unwrap();
    assert!(table.is_empty());
    // Forgotten while it waits, then handed the key.
    let blocker = table.try_lock(5).unwrap();
    let mut txn = table.transaction();
    let mut call = Box::pin(txn.lock_all(asked()));
    assert!(poll_once(call.as_mut()).is_pending());
    std::mem::forget(call);
    drop(blocker);
    assert!(table.is_locked(&5), "handed to the forgotten call");
    drop(txn);
    assert!(
        table.is_empty(),
        "the end released what the forgotten call had"
    );
}

/// A fresh `lock_all` that meets a busy key, is handed it, then meets
/// another: it waits for each in turn, holding the keys below the one it
/// waits for; dropped at its second wait, it keeps nothing.
#[test]
fn a_fresh_fill_waits_for_each_busy_key_in_turn() {
    let table = LockTable::<u64>::new();
    let keys = || (1..=7).map(|k| (k, Mode::Exclusive));
    let held = |keys: &[u64]| keys.iter().all(|k| table.is_locked(k));
    let (b3, b6) = (table.try_lock(3).unwrap(), table.try_lock(6).unwrap());
    let mut txn = table.transaction();
    {
        let mut call = Box::pin(txn.lock_all(keys()));
        assert!(poll_once(call.as_mut()).is_pending());
        assert!(held(&[1, 2]) && !table.is_locked(&4), "waits at 3");
        drop(b3);
        assert!(poll_once(call.as_mut()).is_pending(), "then at 6");
        assert!(held(&[1, 2, 3, 4, 5]) && !table.is_locked(&7));
        drop(b6);
        let Poll::Ready(got) = poll_once(call.as_mut()) else {
            panic!("handed 6")
        };
        assert_eq!(got.unwrap().acquired(), 7);
    }
    assert_eq!(txn.len(), 7);
    txn.commit().unwrap();
    assert!(table.is_empty());
    // Dropped at its second wait.
    let (b3, b6) = (table.try_lock(3).unwrap(), table.try_lock(6).unwrap());
    let mut txn = table.transaction();
    {
        let mut call = Box::pin(txn.lock_all(keys()));
        assert!(poll_once(call.as_mut()).is_pending());
        drop(b3);
        assert!(poll_once(call.as_mut()).is_pending());
        assert!(held(&[1, 2, 3, 4, 5]));
    }
    assert_eq!((txn.len(), table.len()), (0, 1), "only 6's holder is left");
    drop((b6, txn));
    assert!(table.is_empty());
}

/// A transaction that held more than the linear scan's keys (so its set
/// built an index), released them all, and then locks keys anew in one
/// `lock_all` (a fresh fill of its vacant set): the set finds the new keys
/// (counted, re-entered, released), not an index of none of them that
/// would send a re-entry to wait behind the transaction's own grant.
#[test]
fn a_fresh_fill_after_the_set_was_indexed_keeps_its_keys_findable() {
    let table = LockTable::<u32>::new();
    let mut txn = table.transaction_with(TransactionOptions::new().wait(WaitPolicy::NoWait));
    block(async {
        txn.lock_all((0..20).map(|k| (k, Mode::Exclusive)))
            .await
            .unwrap();
        // The first release indexes the set (more than 16 keys).
        for k in 0..20 {
            txn.release(&k).unwrap();
        }
        assert_eq!(txn.len(), 0);
        txn.lock_all([
            (100, Mode::Exclusive),
            (101, Mode::Exclusive),
            (102, Mode::Exclusive),
        ])
        .await
        .unwrap();
        assert_eq!(txn.len(), 3);
        assert_eq!(txn.count(&101), 1, "the set finds its own key");
        let again = txn.lock(101, Mode::Exclusive).await;
        assert_eq!(
            again.map(|got| got.count),
            Ok(2),
            "re-entered, not refused by its own grant"
        );
        assert_eq!(txn.release(&101), Ok(()));
    });
    txn.commit().unwrap();
    assert!(table.is_empty());
}
