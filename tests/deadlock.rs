//! Deadlock detection: cycles of two, three and five transactions (exclusive
//! and shared modes, an upgrade, a wait behind a queued waiter, `lock_all`)
//! each end with exactly one `Deadlock` answer and every other transaction
//! committed, under tokio, async-std and plain threads; waits without a
//! cycle never get one; plain guards are never part of a cycle; the table
//! keeps the cycles it broke. No timed assertions: every wait ends because
//! the victim aborts.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier};

use std::task::Poll;

use futures::poll;
use keylock::{LockTable, Mode, OwnedTransaction, TransactionError};

mod common;

fn block<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}

/// How a ring of `n` transactions ended: deadlock answers and commits.
#[derive(Debug, Default)]
struct Ends {
    deadlocks: AtomicUsize,
    commits: AtomicUsize,
}

/// Transaction `i` of a ring: holds key `i`, then (once all hold theirs)
/// asks for key `i + 1`. Exactly one of the ring must be answered.
async fn ring_member(
    table: Arc<LockTable<u32>>,
    n: u32,
    i: u32,
    held: impl std::future::Future<Output = ()>,
    ends: Arc<Ends>,
) {
    let txn: OwnedTransaction<u32> = table.clone().transaction_owned();
    txn.lock(i, Mode::Exclusive).await.expect("own key");
    held.await;
    match txn.lock((i + 1) % n, Mode::Exclusive).await {
        Ok(_) => {
            txn.commit().expect("no lease");
            ends.commits.fetch_add(1, SeqCst);
        }
        Err(TransactionError::Deadlock(d)) => {
            assert_eq!(d.victim(), txn.id());
            assert_eq!(d.cycle().len(), n as usize, "the whole ring: {d}");
            assert_eq!(d.cycle()[0].key, (i + 1) % n);
            ends.deadlocks.fetch_add(1, SeqCst);
            txn.abort();
        }
        Err(other) => panic!("unexpected: {other}"),
    }
}

fn check_ring(table: &LockTable<u32>, ends: &Ends, n: usize) {
    assert_eq!(ends.deadlocks.load(SeqCst), 1, "exactly one victim");
    assert_eq!(ends.commits.load(SeqCst), n - 1, "everyone else commits");
    assert!(table.is_empty(), "nothing stranded");
    let recent = table.recent_deadlocks();
    assert_eq!(recent.len(), 1);
    assert_eq!(recent[0].cycle().len(), n);
}

#[test]
fn rings_of_two_three_and_five_under_tokio() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    for n in [2u32, 3, 5] {
        for _ in 0..20 {
            let table = Arc::new(LockTable::new());
            let ends = Arc::new(Ends::default());
            let barrier = Arc::new(tokio::sync::Barrier::new(n as usize));
            rt.block_on(async {
                let tasks: Vec<_> = (0..n)
                    .map(|i| {
                        let barrier = barrier.clone();
                        tokio::spawn(ring_member(
                            table.clone(),
                            n,
                            i,
                            async move {
                                barrier.wait().await;
                            },
                            ends.clone(),
                        ))
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap();
                }
            });
            check_ring(&table, &ends, n as usize);
        }
    }
}

#[async_std::test]
async fn rings_under_async_std() {
    for n in [2u32, 3, 5] {
        let table = Arc::new(LockTable::new());
        let ends = Arc::new(Ends::default());
        let barrier = Arc::new(tokio::sync::Barrier::new(n as usize));
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let barrier = barrier.clone();
                async_std::task::spawn(ring_member(
                    table.clone(),
                    n,
                    i,
                    async move {
                        barrier.wait().await;
                    },
                    ends.clone(),
                ))
            })
            .collect();
        for t in tasks {
            t.await;
        }
        check_ring(&table, &ends, n as usize);
    }
}

#[test]
fn rings_of_threads_with_blocking_locks() {
    for n in [2u32, 3, 5] {
        for _ in 0..10 {
            let table = Arc::new(LockTable::new());
            let ends = Arc::new(Ends::default());
            let barrier = Arc::new(Barrier::new(n as usize));
            let threads: Vec<_> = (0..n)
                .map(|i| {
                    let (table, ends, barrier) = (table.clone(), ends.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        let mut txn = table.transaction();
                        txn.blocking_lock(i, Mode::Exclusive).expect("own key");
                        barrier.wait();
                        match txn.blocking_lock((i + 1) % n, Mode::Exclusive) {
                            Ok(_) => {
                                txn.commit().expect("no lease");
                                ends.commits.fetch_add(1, SeqCst);
                            }
                            Err(TransactionError::Deadlock(d)) => {
                                assert_eq!(d.victim(), txn.id());
                                ends.deadlocks.fetch_add(1, SeqCst);
                            }
                            Err(other) => panic!("unexpected: {other}"),
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            check_ring(&table, &ends, n as usize);
        }
    }
}

#[test]
fn shared_holders_asking_exclusive_form_a_cycle() {
    block(async {
        let table = LockTable::<&str>::new();
        let mut a = table.transaction();
        let mut b = table.transaction();
        let mut reader = table.transaction();
        a.lock("x", Mode::Shared).await.unwrap();
        b.lock("y", Mode::Shared).await.unwrap();
        // A third reader of "x" outside the cycle.
        reader.lock("x", Mode::Shared).await.unwrap();
        let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        let Poll::Ready(Err(TransactionError::Deadlock(d))) =
            poll!(Box::pin(b.lock("x", Mode::Exclusive)))
        else {
            panic!("b closes the cycle");
        };
        assert_eq!(d.victim(), b.id());
        assert_eq!(d.cycle()[0].mode, Mode::Exclusive);
        assert_eq!(d.cycle()[1].key, "y");
        assert!(d.to_string().contains("deadlock"), "{d}");
        drop(b);
        assert!(a_waits.await.is_ok());
        reader.commit().unwrap();
    });
}

#[test]
fn an_upgrade_waiting_for_a_reader_that_waits_for_it_is_a_cycle() {
    block(async {
        let table = LockTable::<&str>::new();
        let mut a = table.transaction();
        let mut b = table.transaction();
        a.lock("x", Mode::Shared).await.unwrap();
        a.lock("z", Mode::Exclusive).await.unwrap();
        b.lock("x", Mode::Shared).await.unwrap();
        let b_id = b.id();
        // Now b holds "x" shared and waits for "z" (a's); a upgrades "x".
        let mut b_waits = Box::pin(b.lock("z", Mode::Shared));
        assert!(poll!(b_waits.as_mut()).is_pending());
        let Poll::Ready(Err(TransactionError::Deadlock(d))) =
            poll!(Box::pin(a.lock("x", Mode::Exclusive)))
        else {
            panic!("a's upgrade closes the cycle");
        };
        assert_eq!(d.victim(), a.id());
        assert_eq!(d.cycle()[0].key, "x");
        assert_eq!(d.cycle()[1].transaction, b_id);
        drop(a);
        assert!(b_waits.await.is_ok());
    });
}

/// A wait of a transaction that holds nothing closes no cycle (only a
/// transaction queued behind it could wait for it, and that one's search
/// follows it through the queue), so it is not registered, however long
/// the chain of waits ahead of it; the same wait of a transaction that
/// holds a key is registered, and searched from once a waiter is queued on
/// a key it holds (before, nothing can lead back to it). Counted by
/// `deadlock_stats`.
#[test]
fn a_transaction_that_holds_nothing_is_not_registered() {
    block(async {
        let table = LockTable::<u32>::new();
        // A chain: t[i] holds key i and waits for key i + 1; t[3] holds 3.
        let mut t: Vec<_> = (0..4).map(|_| table.transaction()).collect();
        for (i, txn) in t.iter_mut().enumerate() {
            txn.lock(i as u32, Mode::Exclusive).await.unwrap();
        }
        let mut chain = Vec::new();
        for (i, txn) in t.iter_mut().take(3).enumerate() {
            let mut wait = Box::pin(txn.lock(i as u32 + 1, Mode::Exclusive));
            assert!(poll!(wait.as_mut()).is_pending());
            chain.push(wait);
        }
        let before = table.deadlock_stats();
        assert_eq!(before.waits, 3);

        // Holds nothing: not registered, not searched from.
        let mut empty = table.transaction();
        let mut waits = Box::pin(empty.lock(0, Mode::Exclusive));
        assert!(poll!(waits.as_mut()).is_pending());
        assert_eq!(table.deadlock_stats(), before);
        drop(waits);

        // The same with `lock_all` (both keys held: it waits for the first
        // in its order having taken nothing).
        let mut empty = table.transaction();
        let mut waits = Box::pin(empty.lock_all([(0, Mode::Exclusive), (1, Mode::Exclusive)]));
        assert!(poll!(waits.as_mut()).is_pending());
        assert_eq!(table.deadlock_stats(), before);
        drop(waits);

        // Holds a key nobody waits for: registered, not searched from.
        let mut holder = table.transaction();
        holder.lock(8, Mode::Exclusive).await.unwrap();
        let mut waits = Box::pin(holder.lock(0, Mode::Exclusive));
        assert!(poll!(waits.as_mut()).is_pending());
        let after = table.deadlock_stats();
        assert_eq!((after.waits, after.searches), (4, before.searches));
        assert_eq!(after.deepest, before.deepest);
        drop(waits);

        // Holds a key another waits for (even one that holds nothing):
        // registered and searched from, through the chain.
        let mut other = table.transaction();
        let mut other_waits = Box::pin(other.lock(8, Mode::Shared));
        assert!(poll!(other_waits.as_mut()).is_pending());
        let mut waits = Box::pin(holder.lock(0, Mode::Exclusive));
        assert!(poll!(waits.as_mut()).is_pending());
        let after = table.deadlock_stats();
        assert_eq!((after.waits, after.searches), (5, before.searches + 1));
        // t3 holds 3 and waits for nothing: a dead end, not counted.
        assert_eq!(after.deepest, 3, "t0, t1 and t2 visited");
        assert_eq!(after.cycles, 0);
        drop(waits);
        drop(other_waits);
        drop(chain);
    });
}

/// A cycle through a transaction that holds nothing (so is not
/// registered): `w` waits for `a` exclusive behind `h`'s shared grant; `y`,
/// queued behind `w` for `a` shared, holds `b`, which `h` waits for. `y`
/// closes `y -> w -> h -> y`; its search follows `w` through `a`'s queue
/// (the skip rule). The cycle is soft (`y` waits only for `w`, queued, and
/// `a`'s holder admits it), so it is broken by granting `y` ahead of `w`,
/// in the poll that closed it: found or not is told at once by the stats,
/// and a cycle missed would leave `y` waiting.
#[test]
fn a_cycle_through_a_transaction_that_holds_nothing_is_found_through_the_queue() {
    block(async {
        let table = LockTable::<&str>::new();
        let (mut h, mut w, mut y) = (
            table.transaction(),
            table.transaction(),
            table.transaction(),
        );
        h.lock("a", Mode::Shared).await.unwrap();
        y.lock("b", Mode::Exclusive).await.unwrap();
        let mut h_waits = Box::pin(h.lock("b", Mode::Exclusive));
        assert!(poll!(h_waits.as_mut()).is_pending());
        let mut w_waits = Box::pin(w.lock("a", Mode::Exclusive));
        assert!(poll!(w_waits.as_mut()).is_pending());
        let mut y_waits = Box::pin(y.lock("a", Mode::Shared));
        assert!(poll!(y_waits.as_mut()).is_pending());
        let stats = table.deadlock_stats();
        assert_eq!(
            (stats.cycles, stats.reorders),
            (0, 1),
            "y closes the cycle (the skip rule: w, queued ahead unregistered, is followed) \
             and is moved ahead of w: {stats:?}"
        );
        assert!(poll!(y_waits.as_mut()).is_ready(), "granted ahead of w");
        assert!(poll!(w_waits.as_mut()).is_pending());
        drop(y_waits);
        drop(y); // y commits: h gets b, commits; w gets a
        assert!(h_waits.await.is_ok());
        drop(h);
        assert!(w_waits.await.is_ok());
        drop(w);
        assert!(table.is_empty());
    });
}

/// A wait behind a queued writer is an edge, and a cycle through it is a
/// soft deadlock: t1 holds "a" shared, t2 waits for it exclusive, t3 (which
/// holds "b") asks it shared behind t2; t1's ask of "b" closes t1 -> t3 ->
/// t2 -> t1. t3's wait is the soft edge, on a key whose holder (t1, shared)
/// admits it: t3 is granted "a" ahead of t2, and nobody is aborted (see
/// tests/cycles.rs for PostgreSQL's specs).
#[test]
fn a_wait_behind_a_queued_writer_is_an_edge() {
    block(async {
        let table = LockTable::<&str>::new();
        let mut t1 = table.transaction();
        let mut t2 = table.transaction();
        let mut t3 = table.transaction();
        t1.lock("a", Mode::Shared).await.unwrap();
        t3.lock("b", Mode::Exclusive).await.unwrap();
        // t2 queues for "a" exclusive, behind t1's shared grant.
        let mut t2_waits = Box::pin(t2.lock("a", Mode::Exclusive));
        assert!(poll!(t2_waits.as_mut()).is_pending());
        // t3 asks "a" shared: compatible with t1, but queued behind t2.
        let mut t3_waits = Box::pin(t3.lock("a", Mode::Shared));
        assert!(poll!(t3_waits.as_mut()).is_pending());
        assert_eq!(table.deadlock_stats().reorders, 0, "no cycle yet");
        // t1 asks "b" (t3's): t1 -> t3 -> t2 -> t1, broken by moving t3
        // ahead of t2; t1 waits on for t3.
        let mut t1_waits = Box::pin(t1.lock("b", Mode::Shared));
        assert!(poll!(t1_waits.as_mut()).is_pending());
        let stats = table.deadlock_stats();
        assert_eq!((stats.cycles, stats.reorders), (0, 1), "{stats:?}");
        assert!(
            poll!(t3_waits.as_mut()).is_ready(),
            "t3 granted ahead of t2"
        );
        assert!(poll!(t2_waits.as_mut()).is_pending());
        drop(t3_waits);
        drop(t3);
        assert!(t1_waits.await.is_ok());
        drop(t1);
        assert!(t2_waits.await.is_ok());
        drop(t2);
        assert!(table.is_empty());
    });
}

#[test]
fn lock_all_takes_part_in_cycles_and_releases_what_it_took() {
    block(async {
        let table = LockTable::<u32>::new();
        let mut a = table.transaction();
        let mut b = table.transaction();
        b.lock(2, Mode::Exclusive).await.unwrap();
        // a takes 1 (and 3), then waits for 2 in the canonical order, or
        // waits for 2 first: either way it waits for b.
        let mut a_waits = Box::pin(a.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
        assert!(poll!(a_waits.as_mut()).is_pending());
        if table.is_locked(&1) {
            // a holds 1: b's wait for it closes the cycle.
            let Poll::Ready(Err(TransactionError::Deadlock(d))) =
                poll!(Box::pin(b.lock(1, Mode::Exclusive)))
            else {
                panic!("b closes the cycle");
            };
            assert_eq!(d.victim(), b.id());
            drop(b);
            assert_eq!(a_waits.await.unwrap().acquired(), 2);
        } else {
            // a waits for 2 before taking 1: no cycle, b takes 1.
            b.lock(1, Mode::Exclusive).await.unwrap();
            b.commit().unwrap();
            assert_eq!(a_waits.await.unwrap().acquired(), 2);
        }
        drop(a);
        assert!(table.is_empty());
    });
}

/// Two keys of `table` in the order a `lock_all` takes them (its canonical
/// order, by key): `(first, second)`, found by a `lock_all`
/// that waits for one of them while the other is free.
fn lock_all_order(table: &LockTable<u32>, x: u32, y: u32) -> (u32, u32) {
    let blocker = table.try_lock(y).unwrap();
    let mut t = table.transaction();
    let mut f = Box::pin(t.lock_all([(x, Mode::Exclusive), (y, Mode::Exclusive)]));
    let pending = block(async { poll!(f.as_mut()).is_pending() });
    assert!(pending);
    let x_first = table.is_locked(&x);
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

/// A `lock_all` that took its first key and waits for its second is in the
/// wait-for graph (it holds a key outside its set while it waits): the
/// wait for that first key that closes the cycle is answered at once.
/// Both forms; the keys are picked so that the `lock_all` takes one first.
#[test]
fn a_lock_all_waiting_with_a_key_taken_closes_a_cycle_that_is_answered() {
    for owned in [false, true] {
        let table = Arc::new(LockTable::<u32>::new());
        let (first, second) = lock_all_order(&table, 1, 2);
        let mut b = table.transaction();
        block(b.lock(second, Mode::Exclusive)).unwrap();
        let reqs = [(first, Mode::Exclusive), (second, Mode::Exclusive)];
        let owned_a = table.clone().transaction_owned();
        let mut borrowed_a = table.transaction();
        let mut a_waits: std::pin::Pin<Box<dyn std::future::Future<Output = _>>> = if owned {
            Box::pin(owned_a.lock_all(reqs))
        } else {
            Box::pin(borrowed_a.lock_all(reqs))
        };
        assert!(block(async { poll!(a_waits.as_mut()).is_pending() }));
        assert!(table.is_locked(&first), "the lock_all took its first key");
        let closing = block(async { poll!(Box::pin(b.lock(first, Mode::Exclusive))) });
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("owned {owned}: b's wait closes the cycle: {closing:?}");
        };
        assert_eq!(d.victim(), b.id());
        drop(b);
        assert_eq!(block(a_waits).unwrap().acquired(), 2);
        drop(owned_a);
        drop(borrowed_a);
        assert!(table.is_empty());
    }
}

#[test]
fn a_deadlocked_lock_all_releases_what_it_had_taken() {
    block(async {
        let table = LockTable::<u32>::new();
        let mut b = table.transaction();
        b.lock(1, Mode::Exclusive).await.unwrap();
        b.lock(2, Mode::Exclusive).await.unwrap();
        let mut a_holds = table.transaction();
        a_holds.lock(3, Mode::Exclusive).await.unwrap();
        // b waits for 3 (a_holds's): no cycle.
        let mut b_waits = Box::pin(b.lock(3, Mode::Exclusive));
        assert!(poll!(b_waits.as_mut()).is_pending());
        // a_holds asks for 1 and 2 at once: it closes a -> b -> a.
        let got = a_holds
            .lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)])
            .await;
        let Err(TransactionError::Deadlock(d)) = got else {
            panic!("a_holds closes the cycle: {got:?}");
        };
        assert_eq!(d.victim(), a_holds.id());
        assert_eq!(a_holds.len(), 1, "the failed lock_all took nothing");
        drop(a_holds);
        assert!(b_waits.await.is_ok());
        drop(b);
        assert!(table.is_empty());
    });
}

#[test]
fn long_waits_without_a_cycle_never_answer_deadlock() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let table = Arc::new(LockTable::<u32>::new());
    rt.block_on(async {
        // Everyone locks in ascending order: queues, no cycle.
        let tasks: Vec<_> = (0..16u32)
            .map(|t| {
                let table = table.clone();
                tokio::spawn(async move {
                    for round in 0..50u32 {
                        let txn = table.clone().transaction_owned();
                        let first = (t + round) % 4;
                        let mode = if round % 3 == 0 {
                            Mode::Shared
                        } else {
                            Mode::Exclusive
                        };
                        txn.lock(first, mode).await.expect("no cycle, no deadline");
                        txn.lock(first + 4, Mode::Exclusive)
                            .await
                            .expect("no cycle, no deadline");
                        tokio::task::yield_now().await;
                        txn.commit().unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    assert!(table.recent_deadlocks().is_empty());
    assert!(table.is_empty());
}

#[test]
fn a_plain_guard_is_never_part_of_a_cycle() {
    block(async {
        let table = LockTable::<&str>::new();
        let mut a = table.transaction();
        a.lock("x", Mode::Exclusive).await.unwrap();
        let guard = table.lock("y").await;
        let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        // The guard's holder may wait for "x", but the table cannot know.
        drop(guard);
        assert!(a_waits.await.is_ok());
        assert!(table.recent_deadlocks().is_empty());
    });
}

/// A labeled plain guard or waiter carries its label where a
/// transaction's grant carries its id: it is still no transaction, never a
/// node of the wait-for graph, and a cycle through its key is found as
/// without it.
#[test]
fn a_labeled_plain_lock_is_never_part_of_a_cycle() {
    block(async {
        let table = LockTable::<&str>::new();
        let labeled = keylock::LockOptions::new().label("flush");
        let mut a = table.transaction();
        a.lock("x", Mode::Exclusive).await.unwrap();
        let guard = table.lock_with("y", labeled).await.unwrap();
        let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        let holder = table.holder("y").unwrap();
        assert_eq!((holder.transaction, holder.label), (None, Some("flush")));
        drop(guard);
        assert!(a_waits.await.is_ok());
        assert!(table.recent_deadlocks().is_empty());

        // A cycle of two with a labeled plain waiter queued in it.
        let mut b = table.transaction();
        b.lock("z", Mode::Exclusive).await.unwrap();
        let mut plain = Box::pin(table.lock_with("z", labeled));
        assert!(poll!(plain.as_mut()).is_pending());
        let mut a_waits = Box::pin(a.lock("z", Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        let waiters = table.lock_status("z").unwrap().waiters;
        assert_eq!(
            (waiters[0].transaction, waiters[0].label),
            (None, Some("flush"))
        );
        let Poll::Ready(Err(TransactionError::Deadlock(d))) =
            poll!(Box::pin(b.lock("x", Mode::Exclusive)))
        else {
            panic!("b closes the cycle");
        };
        assert_eq!(d.victim(), b.id());
        assert_eq!(d.cycle().len(), 2, "{d}");
        drop(b);
        drop(plain.await);
        assert!(a_waits.await.is_ok());
        a.commit().unwrap();
        assert!(table.is_empty());
    });
}

#[test]
fn detection_can_be_turned_off_and_history_is_bounded() {
    block(async {
        let off = LockTable::<u32>::builder().deadlock_search_limit(0).build();
        let mut a = off.transaction();
        let mut b = off.transaction();
        a.lock(1, Mode::Exclusive).await.unwrap();
        b.lock(2, Mode::Exclusive).await.unwrap();
        let mut a_waits = Box::pin(a.lock(2, Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        let mut b_waits = Box::pin(b.lock(1, Mode::Exclusive));
        assert!(poll!(b_waits.as_mut()).is_pending(), "off: b just waits");
        drop(b_waits);
        drop(b);
        assert!(a_waits.await.is_ok());

        let table = LockTable::<u32>::builder().deadlock_history(2).build();
        for round in 0..3u32 {
            let mut a = table.transaction();
            let mut b = table.transaction();
            a.lock(10 * round, Mode::Exclusive).await.unwrap();
            b.lock(10 * round + 1, Mode::Exclusive).await.unwrap();
            let mut a_waits = Box::pin(a.lock(10 * round + 1, Mode::Exclusive));
            assert!(poll!(a_waits.as_mut()).is_pending());
            assert!(matches!(
                b.lock(10 * round, Mode::Exclusive).await,
                Err(TransactionError::Deadlock(_))
            ));
            drop(b);
            assert!(a_waits.await.is_ok());
        }
        let recent = table.recent_deadlocks();
        assert_eq!(recent.len(), 2, "the last two only");
        assert_eq!(recent[0].cycle()[0].key, 10);
        assert_eq!(recent[1].cycle()[0].key, 20);
    });
}

/// A registered wait elsewhere, so that later registrations search (and
/// keep the edges they read): `x` holds "x1" and waits for "x2", held by
/// `y`. Returns `y` and x's wait (pending once polled), to keep alive.
#[allow(clippy::type_complexity)]
fn bystanders<'t>(
    table: &'t LockTable<&'static str>,
) -> (
    keylock::Transaction<'t, &'static str>,
    std::pin::Pin<Box<dyn std::future::Future<Output = ()> + 't>>,
) {
    let mut x = table.transaction();
    let mut y = table.transaction();
    block(x.lock("x1", Mode::Exclusive)).unwrap();
    block(y.lock("x2", Mode::Exclusive)).unwrap();
    let x_waits = Box::pin(async move {
        let _ = x.lock("x2", Mode::Exclusive).await;
    });
    (y, x_waits)
}

#[test]
fn an_upgrade_past_a_queued_reader_adds_an_edge_the_detector_sees() {
    let table = LockTable::<&'static str>::new();
    let (_y, mut x_waits) = bystanders(&table);
    block(async {
        assert!(poll!(x_waits.as_mut()).is_pending());
        let mut u = table.transaction();
        let mut w = table.transaction();
        u.lock("k", Mode::Shared).await.unwrap();
        // A plain writer queues behind u's shared grant; w, holding "w",
        // queues shared behind the writer. w waits for nobody a
        // transaction holds (the writer is a plain guard; u's shared grant
        // admits it), and its registration reads and keeps those edges.
        let mut writer = Box::pin(table.lock("k"));
        assert!(poll!(writer.as_mut()).is_pending());
        w.lock("w", Mode::Exclusive).await.unwrap();
        let w_id = w.id();
        let mut w_waits = Box::pin(w.lock("k", Mode::Shared));
        assert!(poll!(w_waits.as_mut()).is_pending());
        assert_eq!(table.deadlock_stats().waits, 2, "x and w registered");
        // u, the only holder, upgrades at once: w now waits for u too.
        let up = u.lock("k", Mode::Exclusive).await.unwrap();
        assert_eq!(up.kind, keylock::AcquireKind::Upgraded);
        // u asks for w's key: u -> w -> u, through the edge the upgrade
        // added after w's edges were read.
        let closing = poll!(Box::pin(u.lock("w", Mode::Exclusive)));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("u closes the cycle through the upgrade's edge: {closing:?}");
        };
        let order: Vec<_> = d.cycle().iter().map(|c| c.transaction).collect();
        assert_eq!(order, [u.id(), w_id], "{d}");
        drop(u);
        assert!(poll!(writer.as_mut()).is_ready(), "the writer is next");
        drop(writer);
        assert!(w_waits.await.is_ok());
    });
}

#[cfg(feature = "test-util")]
#[test]
fn a_grant_past_the_queue_under_eventual_fairness_adds_an_edge_the_detector_sees() {
    // Time stands still: once a handoff has set the shard's fairness
    // deadline, every release within it leaves the key free.
    let table = common::warm_eventual_table();
    let (_y, mut x_waits) = bystanders(&table);
    block(async {
        assert!(poll!(x_waits.as_mut()).is_pending());
        // w, holding "w", waits for "k" behind a plain guard and a plain
        // waiter (a transaction's head would be handed the key): no edge.
        let mut w = table.transaction();
        w.lock("w", Mode::Exclusive).await.unwrap();
        let w_id = w.id();
        let plain = table.try_lock("k").unwrap();
        let mut nudged = Box::pin(table.lock("k"));
        assert!(poll!(nudged.as_mut()).is_pending());
        let mut w_waits = Box::pin(w.lock("k", Mode::Exclusive));
        assert!(poll!(w_waits.as_mut()).is_pending());
        assert_eq!(table.deadlock_stats().waits, 2, "x and w registered");
        // The release leaves "k" free (the plain head is only nudged), and
        // t takes it past the queue: w now waits for t.
        drop(plain);
        assert!(
            !table.is_locked("k"),
            "left free, the plain head only nudged"
        );
        let mut t = table.transaction();
        t.lock("k", Mode::Exclusive).await.unwrap();
        // The plain waiter leaves: w heads the queue, behind t's grant.
        drop(nudged);
        // t asks for w's key: t -> w -> t.
        let closing = poll!(Box::pin(t.lock("w", Mode::Exclusive)));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("t closes the cycle through the barging grant's edge: {closing:?}");
        };
        let order: Vec<_> = d.cycle().iter().map(|c| c.transaction).collect();
        assert_eq!(order, [t.id(), w_id], "{d}");
        drop(t);
        assert!(w_waits.await.is_ok());
    });
}

/// A cached edge to a waiter ahead that holds nothing may name it with a
/// mode it no longer asks for (it left and queued again, in another
/// mode): the walk must not pass anyone over on that word. Here the stale
/// mode would have hidden the cycle s -> t -> s.
#[test]
fn a_stale_cached_mode_of_a_waiter_ahead_does_not_hide_a_cycle() {
    let table = LockTable::<&'static str>::new();
    let (_y, mut x_waits) = bystanders(&table);
    block(async {
        assert!(poll!(x_waits.as_mut()).is_pending());
        let (mut s, mut w, mut t) = (
            table.transaction(),
            table.transaction(),
            table.transaction(),
        );
        let (s_id, w_id, t_id) = (s.id(), w.id(), t.id());
        assert!(w_id < t_id, "ids in creation order");
        s.lock("k", Mode::Shared).await.unwrap();
        w.lock("ks", Mode::Shared).await.unwrap();
        t.lock("ks", Mode::Shared).await.unwrap();
        // A plain writer queues on "k" behind s's shared grant; v, holding
        // nothing (so never registered), queues exclusive behind it.
        let mut writer = Box::pin(table.lock("k"));
        assert!(poll!(writer.as_mut()).is_pending());
        let mut v = table.transaction();
        let mut v_waits = Box::pin(v.lock("k", Mode::Exclusive));
        assert!(poll!(v_waits.as_mut()).is_pending());
        // w queues shared behind v: its registration keeps the edge to v,
        // marked exclusive.
        let mut w_waits = Box::pin(w.lock("k", Mode::Shared));
        assert!(poll!(w_waits.as_mut()).is_pending());
        // v leaves (nothing jumps the queue), t queues exclusive (its walk
        // passes over w, so w's kept edges stay as they were), and v queues
        // again, shared, behind t.
        drop(v_waits);
        let mut t_waits = Box::pin(t.lock("k", Mode::Exclusive));
        assert!(poll!(t_waits.as_mut()).is_pending());
        let mut v_again = Box::pin(v.lock("k", Mode::Shared));
        assert!(poll!(v_again.as_mut()).is_pending());
        // s asks "ks" exclusive (held shared by w and t): t waits for s's
        // grant of "k", s for t's of "ks".
        let closing = poll!(Box::pin(s.lock("ks", Mode::Exclusive)));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("s closes the cycle s -> t -> s: {closing:?}");
        };
        let order: Vec<_> = d.cycle().iter().map(|c| c.transaction).collect();
        assert_eq!(order, [s_id, t_id], "{d}");
        drop(s);
        assert!(poll!(writer.as_mut()).is_ready(), "the writer is next");
        drop(writer);
        drop(t_waits);
        drop(t);
        assert!(poll!(w_waits.as_mut()).is_ready());
        assert!(poll!(v_again.as_mut()).is_ready());
    });
}

/// A walk on kept edges that met a waiter ahead gone from where an edge
/// said may find a cycle the table's own walk would not find first: it
/// walks again from the table, and answers the table's cycle.
#[test]
fn a_waiter_ahead_gone_from_a_kept_edge_does_not_change_the_cycle_answered() {
    let table = LockTable::<&'static str>::new();
    let (_y, mut x_waits) = bystanders(&table);
    block(async {
        assert!(poll!(x_waits.as_mut()).is_pending());
        let mut v = table.transaction();
        let (mut a, mut b, mut c, mut s) = (
            table.transaction(),
            table.transaction(),
            table.transaction(),
            table.transaction(),
        );
        let ids = [s.id(), a.id(), b.id(), v.id()];
        assert!(v.id() < b.id() && b.id() < c.id(), "ids in creation order");
        a.lock("k0", Mode::Exclusive).await.unwrap();
        b.lock("k1", Mode::Exclusive).await.unwrap();
        c.lock("kc", Mode::Exclusive).await.unwrap();
        // Exclusive: b's wait on "k2" below is blocked by s's grant too (a
        // hard edge), so the cycle is a hard one, answered, not reordered.
        s.lock("k2", Mode::Exclusive).await.unwrap();
        // v (holding nothing) queues on "k1"; a queues shared behind it and
        // keeps the edges [v ahead, b holding].
        let mut v_waits = Box::pin(v.lock("k1", Mode::Exclusive));
        assert!(poll!(v_waits.as_mut()).is_pending());
        let mut a_waits = Box::pin(a.lock("k1", Mode::Shared));
        assert!(poll!(a_waits.as_mut()).is_pending());
        // v moves to "k2" (behind s's grant); c and then b queue behind it
        // there.
        drop(v_waits);
        let mut v_again = Box::pin(v.lock("k2", Mode::Exclusive));
        assert!(poll!(v_again.as_mut()).is_pending());
        let mut c_waits = Box::pin(c.lock("k2", Mode::Exclusive));
        assert!(poll!(c_waits.as_mut()).is_pending());
        let mut b_waits = Box::pin(b.lock("k2", Mode::Shared));
        assert!(poll!(b_waits.as_mut()).is_pending());
        // s asks for a's key: s -> a -> b -> v -> s, the cycle the table's
        // own walk finds first (c waits for s too, after v).
        let closing = poll!(Box::pin(s.lock("k0", Mode::Exclusive)));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("s closes a cycle: {closing:?}");
        };
        let order: Vec<_> = d.cycle().iter().map(|w| w.transaction).collect();
        assert_eq!(order, ids, "{d}");
        drop(s);
        assert!(poll!(v_again.as_mut()).is_ready(), "v is next on k2");
        drop(v_again);
        drop(v);
        assert!(poll!(c_waits.as_mut()).is_ready());
        drop(c_waits);
        drop(c);
        assert!(poll!(b_waits.as_mut()).is_ready());
        drop(b_waits);
        drop(b);
        assert!(poll!(a_waits.as_mut()).is_ready());
    });
}

/// An owned transaction whose registered call ended may still wait, not
/// registered, on several keys. A walk on kept edges that reaches it by a
/// stale way in (here through `c`'s kept edge to `y`, which has let go of
/// "a") must not mark it visited on the wrong key: the cycle o -> c -> x ->
/// u -> o runs through u's wait on "k3", not on "k2".
#[test]
fn an_owned_transaction_waiting_on_two_keys_unregistered_is_found_on_the_right_one() {
    let table = Arc::new(LockTable::<&'static str>::new());
    block(async {
        let _k2 = table.try_lock("k2").unwrap();
        let _u1 = table.try_lock("u1").unwrap();
        let mut q = table.transaction();
        let y: OwnedTransaction<&str> = table.clone().transaction_owned();
        let mut x = table.transaction();
        let mut c = table.transaction();
        let u: OwnedTransaction<&str> = table.clone().transaction_owned();
        let mut o = table.transaction();
        q.lock("a", Mode::Shared).await.unwrap();
        y.lock("a", Mode::Shared).await.unwrap();
        x.lock("a", Mode::Shared).await.unwrap();
        c.lock("o", Mode::Exclusive).await.unwrap();
        o.lock("k3", Mode::Shared).await.unwrap();
        // u waits on three keys; the registered call ends, the other two
        // wait on, not registered.
        let mut u1 = Box::pin(u.lock("u1", Mode::Exclusive));
        assert!(poll!(u1.as_mut()).is_pending());
        let mut u2 = Box::pin(u.lock("k2", Mode::Exclusive));
        assert!(poll!(u2.as_mut()).is_pending());
        let mut u3 = Box::pin(u.lock("k3", Mode::Exclusive));
        assert!(poll!(u3.as_mut()).is_pending());
        drop(u1);
        let mut y_waits = Box::pin(y.lock("k2", Mode::Shared));
        assert!(poll!(y_waits.as_mut()).is_pending());
        let mut q_waits = Box::pin(q.lock("k2", Mode::Exclusive));
        assert!(poll!(q_waits.as_mut()).is_pending());
        let mut x_waits = Box::pin(x.lock("k3", Mode::Shared));
        assert!(poll!(x_waits.as_mut()).is_pending());
        // c waits for q, y and x on "a", and keeps those edges.
        let mut c_waits = Box::pin(c.lock("a", Mode::Exclusive));
        assert!(poll!(c_waits.as_mut()).is_pending());
        // q leaves, y lets go of "a": c now waits for x alone.
        drop(q_waits);
        drop(q);
        y.release(&"a").unwrap();
        // o closes the cycle o -> c -> x -> u -> o, soft at x (queued
        // behind u on "k3", whose holder o admits it): found, it is broken
        // by granting x ahead of u (missed, nobody would be moved).
        let mut closing = Box::pin(o.lock("o", Mode::Exclusive));
        assert!(poll!(closing.as_mut()).is_pending());
        let stats = table.deadlock_stats();
        assert_eq!((stats.cycles, stats.reorders), (0, 1), "{stats:?}");
        assert!(poll!(x_waits.as_mut()).is_ready(), "x granted ahead of u");
        assert!(poll!(u3.as_mut()).is_pending());
        drop(closing);
        drop(o);
        drop(u3);
        drop(u2);
        drop(x_waits);
        drop(y_waits);
        drop(c_waits);
    });
}

/// A kept edge may name a transaction as a holder of a key it has let go
/// of since, and which now waits elsewhere holding nothing (so is not
/// registered). Reached that way it is a dead end, and must not be marked
/// visited: reached as a waiter ahead, it closes the cycle s -> w -> z ->
/// h -> s.
#[test]
fn a_holder_gone_from_a_kept_edge_does_not_hide_it_waiting_ahead() {
    block(async {
        let table = LockTable::<&'static str>::new();
        let (mut s, mut h, mut z, mut a, mut w) = (
            table.transaction(),
            table.transaction(),
            table.transaction(),
            table.transaction(),
            table.transaction(),
        );
        assert!(a.id() < w.id(), "ids in creation order");
        s.lock("k3", Mode::Exclusive).await.unwrap();
        h.lock("k2", Mode::Shared).await.unwrap();
        let mut h_waits = Box::pin(h.lock("k3", Mode::Exclusive));
        assert!(poll!(h_waits.as_mut()).is_pending());
        z.lock("k1", Mode::Shared).await.unwrap();
        let _plain = table.try_lock_shared("k1").unwrap();
        // a waits for "k1" and keeps the edge to z, holding it.
        a.lock("k0", Mode::Shared).await.unwrap();
        let mut a_waits = Box::pin(a.lock("k1", Mode::Exclusive));
        assert!(poll!(a_waits.as_mut()).is_pending());
        // z lets go of "k1" (a still waits for the plain grant) and, holding
        // nothing, queues for "k2" behind h's grant; w queues behind z.
        z.release(&"k1").unwrap();
        w.lock("k0", Mode::Shared).await.unwrap();
        let mut z_waits = Box::pin(z.lock("k2", Mode::Exclusive));
        assert!(poll!(z_waits.as_mut()).is_pending());
        let mut w_waits = Box::pin(w.lock("k2", Mode::Shared));
        assert!(poll!(w_waits.as_mut()).is_pending());
        // s closes the cycle s -> w -> z -> h -> s, soft at w (queued
        // behind z on "k2", whose holder h admits it): found, it is broken
        // by granting w ahead of z (missed, nobody would be moved).
        let mut closing = Box::pin(s.lock("k0", Mode::Exclusive));
        assert!(poll!(closing.as_mut()).is_pending());
        let stats = table.deadlock_stats();
        assert_eq!((stats.cycles, stats.reorders), (0, 1), "{stats:?}");
        assert!(poll!(w_waits.as_mut()).is_ready(), "w granted ahead of z");
        assert!(poll!(z_waits.as_mut()).is_pending());
        drop(w_waits);
        drop(w); // s still waits for a's grant of "k0"
        assert!(poll!(closing.as_mut()).is_pending());
        drop(a_waits);
        drop(a);
        assert!(poll!(closing.as_mut()).is_ready());
        drop(closing);
        drop(s);
        assert!(poll!(h_waits.as_mut()).is_ready());
        drop(h_waits);
        drop(h);
        assert!(poll!(z_waits.as_mut()).is_ready());
    });
}

/// A key whose `Eq` panics once armed, on the given call.
#[derive(Debug, Clone)]
struct Fuse {
    id: u32,
    calls_left: Arc<AtomicUsize>,
}

impl PartialEq for Fuse {
    fn eq(&self, other: &Self) -> bool {
        let left = self.calls_left.load(SeqCst);
        if left == 1 {
            self.calls_left.store(0, SeqCst);
            panic!("Fuse::eq");
        }
        if left > 1 {
            self.calls_left.store(left - 1, SeqCst);
        }
        self.id == other.id
    }
}

impl Eq for Fuse {}

impl std::hash::Hash for Fuse {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.id.hash(state);
    }
}

/// A key's `Eq` that panics during the search a wait makes leaves the
/// wait unregistered once its future is dropped: the transaction's next
/// wait is registered and searched, and answers the cycle it closes.
#[test]
fn a_search_that_panics_in_a_keys_eq_leaves_nothing_registered() {
    let fuse = Arc::new(AtomicUsize::new(0));
    let key = |id| Fuse {
        id,
        calls_left: Arc::clone(&fuse),
    };
    let table = LockTable::<Fuse>::new();
    block(async {
        let (mut t, mut u, mut x) = (
            table.transaction(),
            table.transaction(),
            table.transaction(),
        );
        t.lock(key(1), Mode::Exclusive).await.unwrap();
        u.lock(key(2), Mode::Exclusive).await.unwrap();
        x.lock(key(3), Mode::Exclusive).await.unwrap();
        x.lock(key(4), Mode::Exclusive).await.unwrap();
        // x waits for u's key: registered, so t's wait below searches; y
        // (which holds nothing) waits for t's key, so t's wait is awaited.
        let mut x_waits = Box::pin(x.lock(key(2), Mode::Exclusive));
        assert!(poll!(x_waits.as_mut()).is_pending());
        let mut y = table.transaction();
        let mut y_waits = Box::pin(y.lock(key(1), Mode::Exclusive));
        assert!(poll!(y_waits.as_mut()).is_pending());
        // t asks for x's key: a try and the probe that queues it compare
        // once each, the search's read of t's own edges next: that one
        // panics (the registration counted below shows it came after).
        assert_eq!(table.deadlock_stats().waits, 1);
        fuse.store(3, SeqCst);
        let mut t_waits = Box::pin(t.lock(key(3), Mode::Exclusive));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
            let _ = std::future::Future::poll(t_waits.as_mut(), &mut cx);
        }));
        assert!(panicked.is_err(), "the search's key comparison panicked");
        assert_eq!(fuse.load(SeqCst), 0, "the fuse blew");
        assert_eq!(
            table.deadlock_stats().waits,
            2,
            "in the search, after t registered"
        );
        drop(t_waits);
        // t waits again, for x's other key; u asks for t's key and closes
        // u -> t -> x -> u, found only if t's new wait is registered (a
        // registration left from the panicked wait would say t waits for
        // key 3, where it no longer does).
        let mut t_again = Box::pin(t.lock(key(4), Mode::Exclusive));
        assert!(poll!(t_again.as_mut()).is_pending());
        let closing = poll!(Box::pin(u.lock(key(1), Mode::Exclusive)));
        let Poll::Ready(Err(TransactionError::Deadlock(d))) = closing else {
            panic!("u closes the cycle through t's new wait: {closing:?}");
        };
        assert_eq!(d.victim(), u.id(), "{d}");
        drop(u);
        assert!(poll!(x_waits.as_mut()).is_ready());
        drop(x_waits);
        drop(x);
        assert!(poll!(t_again.as_mut()).is_ready());
        drop(t_again);
        drop(t);
        assert!(poll!(y_waits.as_mut()).is_ready());
    });
}

/// A wait is not searched when no waiter is queued on a key its
/// transaction holds, as far as its set knows. A borrowed `lock_all` that
/// waits while the transaction holds nothing claims nothing in the set; if
/// that future is forgotten (`mem::forget`), its waiter is later granted
/// the key for the transaction, outside its set. The transaction's next
/// wait, an upgrade (which waits in a cell), lets go of the forgotten
/// grant before it queues, as a parked wait does (it once kept it, and was
/// answered as closing the cycle through it; kept, the same grant of a key
/// the upgrade asks for made it wait for its own transaction for good:
/// `tests/forgotten_parked.rs`): the cycle never forms.
#[test]
fn a_forgotten_calls_grant_is_let_go_when_the_next_wait_upgrades() {
    block(async {
        let table = LockTable::<u32>::new();
        let (a, p) = (1, 3);
        let plain = table.lock(a).await;
        let mut txn_c = table.transaction();
        {
            let mut waits = Box::pin(txn_c.lock_all([(a, Mode::Exclusive)]));
            assert!(poll!(waits.as_mut()).is_pending());
            std::mem::forget(waits);
        }
        txn_c.lock(p, Mode::Shared).await.unwrap();
        drop(plain); // `a` goes to the forgotten call's waiter
        assert!(table.is_locked(&a));

        let mut txn_p = table.transaction();
        txn_p.lock(p, Mode::Shared).await.unwrap();
        // p waits for `a`, held for c: p -> c.
        let mut p_waits = Box::pin(txn_p.lock(a, Mode::Exclusive));
        assert!(poll!(p_waits.as_mut()).is_pending());
        // c upgrades `p`, which p holds too. The upgrade's wait (a cell)
        // lets go of the forgotten call's parked wait first, as a parked
        // wait does: `a` goes on to p, and c -> p -> c never forms.
        let mut c_up = Box::pin(txn_c.lock(p, Mode::Exclusive));
        let polled = poll!(c_up.as_mut());
        assert!(polled.is_pending(), "{polled:?}");
        assert!(matches!(poll!(p_waits.as_mut()), Poll::Ready(Ok(_))));
        drop(p_waits);
        txn_p.commit().unwrap();
        assert!(c_up.await.is_ok());
    });
}

/// The same with a new key: the borrowed form's wait for a new key parks
/// in its transaction, and parking lets go of what a forgotten call left
/// there, so the forgotten grant is handed on before the wait registers
/// and the cycle it would have closed never forms: the other transaction
/// gets the key, and this wait is granted when it commits.
#[test]
fn a_forgotten_calls_grant_is_let_go_when_the_next_wait_parks() {
    block(async {
        let table = LockTable::<u32>::new();
        let (a, p) = (1, 3);
        let plain = table.lock(a).await;
        let mut txn_c = table.transaction();
        {
            let mut waits = Box::pin(txn_c.lock_all([(a, Mode::Exclusive)]));
            assert!(poll!(waits.as_mut()).is_pending());
            std::mem::forget(waits);
        }
        drop(plain); // `a` goes to the forgotten call's waiter
        assert!(table.is_locked(&a));
        let mut txn_p = table.transaction();
        txn_p.lock(p, Mode::Exclusive).await.unwrap();
        let mut p_waits = Box::pin(txn_p.lock(a, Mode::Exclusive));
        assert!(poll!(p_waits.as_mut()).is_pending());
        let mut c_waits = Box::pin(txn_c.lock(p, Mode::Exclusive));
        assert!(
            poll!(c_waits.as_mut()).is_pending(),
            "no cycle: c waits for p"
        );
        let got = poll!(p_waits.as_mut());
        assert!(
            matches!(got, Poll::Ready(Ok(_))),
            "a handed on to p: {got:?}"
        );
        drop(p_waits);
        txn_p.commit().unwrap();
        let got = poll!(c_waits.as_mut());
        assert!(matches!(got, Poll::Ready(Ok(_))), "p handed to c: {got:?}");
        drop(c_waits);
        txn_c.commit().unwrap();
        assert!(table.is_empty());
    });
}

/// A transaction's first `lock_all` keeps the keys it gets in its set as it
/// gets them, also after a wait: when it then closes a cycle, it is the
/// victim and takes every one of them back out, and the transaction it
/// waited for gets its key. Three keys (the fill of a vacant set: `1` free,
/// `2` held by `w`, `3` by `u`): `t` takes `1`, waits for `2`; `u` waits
/// for `1` (or queues behind `t` on `2`); `w` lets `2` go, `t` takes it and
/// waits for `3`, closing `t -> u -> t`.
#[test]
fn a_first_lock_all_that_closes_a_cycle_after_a_wait_gives_back_every_key() {
    for u_waits_on_second in [false, true] {
        let what = format!("u waits on the second key: {u_waits_on_second}");
        let table = LockTable::<u32>::new();
        let mut w = table.transaction();
        assert!(common::poll_noop(std::pin::pin!(w.lock(2, Mode::Exclusive))).is_ready());
        let mut u = table.transaction();
        assert!(common::poll_noop(std::pin::pin!(u.lock(3, Mode::Exclusive))).is_ready());
        let mut t = table.transaction();
        let t_id = t.id();
        let keys = [
            (1, Mode::Exclusive),
            (2, Mode::Exclusive),
            (3, Mode::Exclusive),
        ];
        let mut tf = Box::pin(t.lock_all(keys));
        assert!(common::poll_noop(tf.as_mut()).is_pending());
        assert!(table.is_locked(&1), "{what}: the free key taken first");
        let mut uf = Box::pin(u.lock(if u_waits_on_second { 2 } else { 1 }, Mode::Exclusive));
        assert!(
            common::poll_noop(uf.as_mut()).is_pending(),
            "{what}: no cycle yet"
        );
        drop(w);
        match common::poll_noop(tf.as_mut()) {
            Poll::Ready(Err(TransactionError::Deadlock(d))) => {
                assert_eq!(d.victim(), t_id, "{what}");
            }
            other => panic!("{what}: t closes the cycle: {other:?}"),
        }
        drop(tf);
        assert_eq!(t.len(), 0, "{what}: all or nothing");
        assert!(
            matches!(common::poll_noop(uf.as_mut()), Poll::Ready(Ok(_))),
            "{what}: u gets its key"
        );
        drop(uf);
        drop(u);
        drop(t);
        assert!(table.is_empty(), "{what}: {:?}", table.status());
    }
}

/// The same with two keys (a transfer into a vacant set): `t` waits for `1`
/// holding nothing; `u` holds `2` and queues behind `t` on `1`; granted
/// `1`, `t` finds `2` busy and waits, closing `t -> u -> t`: `t` is the
/// victim and gives `1` back, which `u` gets.
#[test]
fn a_first_transfer_that_closes_a_cycle_after_its_wait_gives_back_its_key() {
    let table = LockTable::<u32>::new();
    let mut w = table.transaction();
    assert!(common::poll_noop(std::pin::pin!(w.lock(1, Mode::Exclusive))).is_ready());
    let mut u = table.transaction();
    assert!(common::poll_noop(std::pin::pin!(u.lock(2, Mode::Exclusive))).is_ready());
    let mut t = table.transaction();
    let t_id = t.id();
    let mut tf = Box::pin(t.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
    assert!(common::poll_noop(tf.as_mut()).is_pending());
    let mut uf = Box::pin(u.lock(1, Mode::Exclusive));
    assert!(common::poll_noop(uf.as_mut()).is_pending());
    drop(w);
    match common::poll_noop(tf.as_mut()) {
        Poll::Ready(Err(TransactionError::Deadlock(d))) => assert_eq!(d.victim(), t_id),
        other => panic!("t closes the cycle: {other:?}"),
    }
    drop(tf);
    assert_eq!(t.len(), 0, "all or nothing");
    assert!(matches!(common::poll_noop(uf.as_mut()), Poll::Ready(Ok(_))));
    drop(uf);
    drop(u);
    drop(t);
    assert!(table.is_empty(), "{:?}", table.status());
}
