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

mod common;
use common::{forget_pending, poll_noop as poll, ENDS};

/// The snippet, borrowed form: the key is released by the blocker
/// after the transaction ended (the grant would come later).
#[test]
fn a_forgotten_borrowed_call_is_not_granted_after_its_transaction_ended() {
    for end in ENDS {
        let table = LockTable::<&str>::new();
        let blocker = table.try_lock("b").unwrap();
        let mut t = table.transaction();
        assert!(poll(std::pin::pin!(t.lock("a", Mode::Exclusive))).is_ready());
        forget_pending(t.lock("b", Mode::Exclusive));
        end.end_borrowed(t);
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
        forget_pending(t.lock("b", Mode::Exclusive));
        drop(blocker); // handed to the forgotten waiter
        assert!(table.is_locked("b"));
        end.end_borrowed(t);
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
            forget_pending(t.lock("b", Mode::Exclusive));
            let mut blocker = Some(blocker);
            if granted_first {
                drop(blocker.take());
            }
            end.end_owned(t);
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
/// order, by key, not the caller's): `(first, second)`, found
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
            let mut t = table.transaction();
            let blocker = forget_waiting_lock_all(&table, &mut t, first, second, granted_first);
            end.end_borrowed(t);
            drop(blocker);
            let what = format!("granted first {granted_first}, {end:?}");
            assert_all_free(&table, &[first, second], &what);
        }
    }
}

/// A borrowed `lock_all` forgotten while it waits (having taken its first
/// key), then another `lock_all` of the same transaction that must wait:
/// the forgotten call's wait, parked in the transaction, is dropped as the
/// new one parks (its waiter leaves the queue, or its unobserved grant
/// passes on); the key it took went into the set as it was taken (the
/// transaction's first call fills its set directly), so the transaction
/// holds it, as any key of its set, until it ends; the new call is granted
/// and completes as usual; nothing is held after the commit.
#[test]
fn a_forgotten_borrowed_lock_all_is_let_go_when_the_next_one_waits() {
    for granted_first in [false, true] {
        let table = LockTable::<&'static str>::new();
        let (first, second) = lock_all_order(&table);
        let (third, fourth) = ("m", "n");
        let later = table.try_lock(fourth).unwrap();
        let mut t = table.transaction();
        let blocker = forget_waiting_lock_all(&table, &mut t, first, second, granted_first);
        let mut g = Box::pin(t.lock_all([(third, Mode::Exclusive), (fourth, Mode::Exclusive)]));
        assert!(poll(g.as_mut()).is_pending(), "{fourth} is held");
        let what = format!("granted first {granted_first}");
        assert!(
            table.is_locked(first),
            "{what}: the forgotten call's key, in the set, let go"
        );
        assert_eq!(
            table.waiters(second),
            0,
            "{what}: the forgotten waiter queued"
        );
        assert_eq!(
            table.is_locked(second),
            blocker.is_some(),
            "{what}: {second} held by the blocker only"
        );
        drop(later);
        let got = poll(g.as_mut());
        assert!(
            matches!(&got, Poll::Ready(Ok(s)) if s.acquired() == 2),
            "{what}: {got:?}"
        );
        drop(g);
        assert_eq!(
            t.len(),
            3,
            "{what}: the second call's keys and the forgotten call's first in the set"
        );
        t.commit().expect("nothing lost");
        drop(blocker);
        assert_all_free(&table, &[first, second, third, fourth], &what);
    }
}

/// A fresh `lock_all` forgotten at its second wait (its lock future in its
/// own block, the transaction keeping its address): the transaction, moved
/// to another thread and dropped there, drops that future in place, and
/// the grant the forgotten call was handed since goes back.
#[test]
fn a_fresh_lock_all_forgotten_at_its_second_wait_is_let_go_by_the_moved_transaction() {
    let table = LockTable::<u64>::new();
    let (b3, b6) = (table.try_lock(3).unwrap(), table.try_lock(6).unwrap());
    let mut txn = table.transaction();
    {
        let mut call = Box::pin(txn.lock_all((1..=7).map(|k| (k, Mode::Exclusive))));
        assert!(poll(call.as_mut()).is_pending());
        drop(b3);
        assert!(poll(call.as_mut()).is_pending(), "waits again, at 6");
        std::mem::forget(call);
    }
    assert_eq!(txn.len(), 5, "the keys below 6 stay in the set");
    drop(b6);
    assert!(table.is_locked(&6), "handed to the forgotten call");
    std::thread::scope(|s| s.spawn(move || drop(txn)).join().unwrap());
    assert!(table.is_empty(), "{:?}", table.status());
}

/// A fresh `lock_all` forgotten while it waits, then a single-key `lock`
/// of the same transaction that waits (parked in a block of its own): the
/// new wait lets go of the forgotten one first, whose waiter leaves its
/// queue.
#[test]
fn a_forgotten_fresh_lock_all_is_let_go_when_a_lock_of_its_transaction_waits() {
    let table = LockTable::<u64>::new();
    let b2 = table.try_lock(2).unwrap();
    let mut txn = table.transaction();
    forget_pending(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
    let b9 = table.try_lock(9).unwrap();
    {
        let mut call = Box::pin(txn.lock(9, Mode::Exclusive));
        assert!(poll(call.as_mut()).is_pending());
        drop(b9);
        assert!(matches!(poll(call.as_mut()), Poll::Ready(Ok(_))));
    }
    drop(b2);
    assert!(!table.is_locked(&2), "the forgotten waiter left the queue");
    txn.commit().unwrap();
    assert!(table.is_empty(), "{:?}", table.status());
}

/// Polls a `lock_all` of `[first, ..]` once (it waits: a later key is
/// busy), checks that it took `first` before its wait, and forgets it.
fn forget_after_first<F: Future + ?Sized>(
    mut f: Pin<Box<F>>,
    table: &LockTable<&'static str>,
    first: &str,
) {
    assert!(poll(f.as_mut()).is_pending());
    assert!(
        table.is_locked(first),
        "the first key taken before the wait"
    );
    std::mem::forget(f);
}

/// `t`'s `lock_all` of `first` and `second` takes `first`, waits for
/// `second` (held by the returned blocker) and is forgotten; with
/// `granted_first` the blocker lets go at once, handing `second` to the
/// forgotten call (unobserved), and `None` is returned.
fn forget_waiting_lock_all<'t>(
    table: &'t LockTable<&'static str>,
    t: &mut keylock::Transaction<'t, &'static str>,
    first: &'static str,
    second: &'static str,
    granted_first: bool,
) -> Option<keylock::Guard<'t, &'static str>> {
    let blocker = table.try_lock(second).unwrap();
    let f = Box::pin(t.lock_all([(first, Mode::Exclusive), (second, Mode::Exclusive)]));
    forget_after_first(f, table, first);
    if granted_first {
        drop(blocker);
        assert!(table.is_locked(second), "granted to the forgotten call");
        return None;
    }
    Some(blocker)
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
            let f = Box::pin(t.lock_all(vec![(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            forget_after_first(f, &table, first);
            let mut blocker = Some(blocker);
            if granted_first {
                drop(blocker.take());
            }
            end.end_owned(t);
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
            let f = Box::pin(t.lock_all([(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            forget_after_first(f, &table, first);
            let mut reader = Some(reader);
            if granted_first {
                drop(reader.take()); // the upgrade is granted, unobserved
            }
            end.end_borrowed(t);
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
            let f = Box::pin(t.lock_all(vec![(first, Mode::Exclusive), (second, Mode::Exclusive)]));
            forget_after_first(f, &table, first);
            let mut reader = Some(reader);
            if granted_first {
                drop(reader.take());
            }
            end.end_owned(t);
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
                    forget_pending(t.lock("k", Mode::Exclusive));
                    if granted_first {
                        drop(reader.take());
                    }
                    end.end_owned(t);
                } else {
                    let mut t = table.transaction();
                    assert!(poll(std::pin::pin!(t.lock("k", Mode::Shared))).is_ready());
                    forget_pending(t.lock("k", Mode::Exclusive));
                    if granted_first {
                        drop(reader.take());
                    }
                    end.end_borrowed(t);
                }
                drop(reader);
                assert_all_free(&table, &["k"], &what);
            }
        }
    }
}

/// Nothing of an ended transaction is held or queued, in a randomized run
/// of both forms' calls (single locks, upgrades, `lock_all`s, `lock_up_to`)
/// polled by hand, some forgotten, some dropped, some left pending, ended
/// by commit, abort or drop at random points, beside plain guards that
/// come and go. After every end the table shows no holder and no waiter of
/// the ended transaction; at the close, once every plain guard is gone,
/// the table is empty and another transaction gets every key. Seeded:
/// the same run every time.
#[test]
fn randomized_runs_with_forgotten_calls_leave_nothing_of_ended_transactions() {
    use keylock::{OwnedGuard, OwnedTransaction, TransactionError, TransactionId};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    type Call = Pin<Box<dyn Future<Output = Result<(), TransactionError<u32>>>>>;
    const KEYS: u32 = 6;

    fn mode(rng: &mut StdRng) -> Mode {
        if rng.gen_bool(0.5) {
            Mode::Shared
        } else {
            Mode::Exclusive
        }
    }

    fn keys(rng: &mut StdRng) -> Vec<(u32, Mode)> {
        (0..rng.gen_range(1..=3))
            .map(|_| (rng.gen_range(0..KEYS), mode(rng)))
            .collect()
    }

    fn owned_call(rng: &mut StdRng, t: &OwnedTransaction<u32>) -> Call {
        match rng.gen_range(0..4) {
            0 | 1 => boxed(t.lock(rng.gen_range(0..KEYS), mode(rng))),
            2 => boxed(t.lock_all(keys(rng))),
            _ => boxed(t.lock_up_to(rng.gen_range(1..3), keys(rng))),
        }
    }

    fn boxed<T, F>(f: F) -> Call
    where
        F: Future<Output = Result<T, TransactionError<u32>>> + 'static,
    {
        Box::pin(async move { f.await.map(drop) })
    }

    fn assert_nothing_of(table: &LockTable<u32>, id: TransactionId, what: &str) {
        for (key, status) in table.status() {
            assert!(
                status.holders.iter().all(|h| h.transaction != Some(id)),
                "{what}: {key} held by ended {id}: {status:?}"
            );
            assert!(
                status.waiters.iter().all(|w| w.transaction != Some(id)),
                "{what}: {key} awaited by ended {id}: {status:?}"
            );
        }
    }

    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let table = Arc::new(LockTable::<u32>::new());
        let mut plain: Vec<OwnedGuard<u32>> = Vec::new();
        let mut txns: Vec<OwnedTransaction<u32>> = Vec::new();
        let mut calls: Vec<Call> = Vec::new();
        for step in 0..60 {
            let what = format!("seed {seed}, step {step}");
            match rng.gen_range(0..10) {
                0 if txns.len() < 4 => txns.push(table.clone().transaction_owned()),
                1 | 2 if !txns.is_empty() => {
                    let t = &txns[rng.gen_range(0..txns.len())];
                    let mut call = owned_call(&mut rng, t);
                    if poll(call.as_mut()).is_pending() {
                        calls.push(call);
                    }
                }
                3 if !calls.is_empty() => {
                    let i = rng.gen_range(0..calls.len());
                    if poll(calls[i].as_mut()).is_ready() {
                        drop(calls.swap_remove(i));
                    }
                }
                4 if !calls.is_empty() => {
                    let call = calls.swap_remove(rng.gen_range(0..calls.len()));
                    if rng.gen_bool(0.5) {
                        std::mem::forget(call);
                    } else {
                        drop(call);
                    }
                }
                5 if !txns.is_empty() => {
                    let t = txns.swap_remove(rng.gen_range(0..txns.len()));
                    let id = t.id();
                    match rng.gen_range(0..3) {
                        0 => drop(t.commit()),
                        1 => t.abort(),
                        _ => drop(t),
                    }
                    assert_nothing_of(&table, id, &what);
                }
                6 => {
                    let key = rng.gen_range(0..KEYS);
                    let got = if rng.gen_bool(0.5) {
                        table.clone().try_lock_owned(key)
                    } else {
                        table.clone().try_lock_shared_owned(key)
                    };
                    plain.extend(got.ok());
                }
                7 if !plain.is_empty() => drop(plain.swap_remove(rng.gen_range(0..plain.len()))),
                8 => {
                    // A borrowed transaction: a few keys, then a call that
                    // may wait (a lock, an upgrade, a lock_all), polled,
                    // then forgotten or dropped, and the end.
                    let mut t = table.transaction();
                    let id = t.id();
                    for (key, m) in keys(&mut rng) {
                        let _ = poll(std::pin::pin!(t.lock_with(
                            key,
                            m,
                            keylock::WaitPolicy::NoWait
                        )));
                    }
                    let forget = rng.gen_bool(0.5);
                    match rng.gen_range(0..3) {
                        0 => {
                            let mut f = Box::pin(t.lock(rng.gen_range(0..KEYS), mode(&mut rng)));
                            let _ = poll(f.as_mut());
                            if forget {
                                std::mem::forget(f);
                            }
                        }
                        1 => {
                            let mut f = Box::pin(t.lock_all(keys(&mut rng)));
                            let _ = poll(f.as_mut());
                            if forget {
                                std::mem::forget(f);
                            }
                        }
                        _ => {
                            let mut f = Box::pin(t.lock_up_to(2, keys(&mut rng)));
                            let _ = poll(f.as_mut());
                            if forget {
                                std::mem::forget(f);
                            }
                        }
                    }
                    match rng.gen_range(0..3) {
                        0 => drop(t.commit()),
                        1 => t.abort(),
                        _ => drop(t),
                    }
                    assert_nothing_of(&table, id, &what);
                }
                _ => {}
            }
        }
        let what = format!("seed {seed}, close");
        for t in txns.drain(..) {
            let id = t.id();
            drop(t);
            assert_nothing_of(&table, id, &what);
        }
        drop(calls);
        drop(plain);
        assert!(table.is_empty(), "{what}: {:?}", table.status());
        let mut other = table.transaction();
        let all = (0..KEYS).map(|k| (k, Mode::Exclusive));
        let got = poll(std::pin::pin!(other.lock_all(all)));
        assert!(matches!(got, Poll::Ready(Ok(_))), "{what}: {got:?}");
    }
}
