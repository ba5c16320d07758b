//! The state machine of one key, driven by hand: every future here is polled
//! explicitly with a counting waker, so each interleaving is exact and every
//! wake, clone and drop of a waker is observed.

mod probe;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use keylock::{FencingToken, LockTable, TryLockError};
use probe::{pending, poll_once, ready, Probe};

/// `(acquisitions, contended, handoffs, cancelled)`.
fn counts<K>(table: &LockTable<K>) -> (u64, u64, u64, u64) {
    let s = table.stats();
    (s.acquisitions, s.contended, s.handoffs, s.cancelled)
}

#[test]
fn one_wake_slot_per_waiter_however_often_repolled() {
    let table = LockTable::new();
    let holder = table.try_lock(1u64).unwrap();

    let probes: Vec<_> = (0..3).map(|_| Probe::new()).collect();
    let wakers: Vec<_> = probes.iter().map(Probe::waker).collect();
    let mut futs: Vec<_> = (0..3).map(|_| Box::pin(table.lock(1u64))).collect();

    for _ in 0..1000 {
        for (fut, waker) in futs.iter_mut().zip(&wakers) {
            pending(fut, waker);
        }
    }
    assert_eq!(table.waiters(&1), 3);
    assert_eq!(table.len(), 1);
    for p in &probes {
        // The registration cloned the waker once; 999 re-polls with the same
        // waker neither cloned it again nor woke it.
        assert_eq!(p.clones(), 1);
        assert_eq!(p.wakes(), 0);
        // One handle held by the test, one by the table.
        assert_eq!(p.live_wakers(1), 2);
    }

    drop(holder);
    assert_eq!(
        probes.iter().map(|p| p.wakes()).collect::<Vec<_>>(),
        [1, 0, 0]
    );
    for (i, fut) in futs.iter_mut().enumerate() {
        let guard = ready(fut, &wakers[i]);
        assert_eq!(*guard.key(), 1);
        drop(guard);
    }
    assert_eq!(
        probes.iter().map(|p| p.wakes()).collect::<Vec<_>>(),
        [1, 1, 1]
    );
    for p in &probes {
        assert_eq!(p.clones(), 1);
        // The table holds no waker any more.
        assert_eq!(p.live_wakers(1), 1);
    }
    drop(futs);
    assert_eq!(table.len(), 0);
    assert!(table.is_empty());
}

#[test]
fn fifo_handoff_to_five_waiters_waking_only_the_head() {
    let table = LockTable::new();
    let mut guard = table.try_lock("k").unwrap();
    let first = guard.token();

    let probes: Vec<_> = (0..5).map(|_| Probe::new()).collect();
    let wakers: Vec<_> = probes.iter().map(Probe::waker).collect();
    let mut futs: Vec<_> = (0..5).map(|_| Box::pin(table.lock("k"))).collect();
    for (fut, waker) in futs.iter_mut().zip(&wakers) {
        pending(fut, waker);
    }
    assert_eq!(table.waiters("k"), 5);

    let mut last = first;
    for i in 0..5 {
        drop(guard);
        // Exactly waiter i was woken, exactly once; every later waiter none.
        for (j, p) in probes.iter().enumerate() {
            let expect = usize::from(j <= i);
            assert_eq!(p.wakes(), expect, "after release #{i}, waiter {j}");
        }
        assert_eq!(table.waiters("k"), 4 - i);
        // Later waiters polled now are still pending (they cannot jump ahead).
        for (fut, waker) in futs.iter_mut().zip(&wakers).skip(i + 1) {
            pending(fut, waker);
        }
        guard = ready(&mut futs[i], &wakers[i]);
        assert!(guard.token() > last, "tokens increase across handoffs");
        last = guard.token();
        assert_eq!(probes[i].wakes(), 1, "the head is woken once");
    }
    drop(guard);
    assert!(probes.iter().all(|p| p.wakes() == 1));
    drop(futs);
    assert_eq!(table.len(), 0);
}

#[test]
fn granted_waiter_is_woken_exactly_once_whatever_happens_around_it() {
    let table = LockTable::new();
    let holder = table.try_lock(7u32).unwrap();
    let (pa, pb, pc) = (Probe::new(), Probe::new(), Probe::new());
    let (wa, wb, wc) = (pa.waker(), pb.waker(), pc.waker());
    let mut a = Box::pin(table.lock(7));
    let mut b = Box::pin(table.lock(7));
    pending(&mut a, &wa);
    pending(&mut b, &wb);

    drop(holder);
    assert_eq!((pa.wakes(), pb.wakes()), (1, 0));

    // Churn around the granted waiter: a newcomer queues, the other waiter is
    // re-polled and dropped, `try_lock` fails.
    let mut c = Box::pin(table.lock(7));
    pending(&mut c, &wc);
    pending(&mut b, &wb);
    drop(b);
    assert_eq!(
        table.try_lock(7).unwrap_err(),
        TryLockError::WouldBlock { key: None }
    );
    assert_eq!(pa.wakes(), 1);

    let guard = ready(&mut a, &wa);
    assert_eq!(pa.wakes(), 1);
    drop(guard);
    // The release woke the next waiter, never the old holder again.
    assert_eq!((pa.wakes(), pb.wakes(), pc.wakes()), (1, 0, 1));
    drop(ready(&mut c, &wc));
    assert_eq!((pa.wakes(), pb.wakes(), pc.wakes()), (1, 0, 1));
    assert_eq!(table.len(), 0);
}

#[test]
fn try_lock_would_block_while_a_grant_is_pending_and_unobserved() {
    let table = Arc::new(LockTable::new());
    let holder = table.try_lock(3u8).unwrap();
    let p = Probe::new();
    let w = p.waker();
    let mut fut = Box::pin(table.lock(3));
    pending(&mut fut, &w);

    drop(holder);
    assert_eq!(p.wakes(), 1);
    // Granted but not polled: the key is the waiter's.
    assert!(table.is_locked(&3));
    assert_eq!(table.waiters(&3), 0);
    assert_eq!(table.len(), 1);
    for _ in 0..3 {
        assert_eq!(
            table.try_lock(3).unwrap_err(),
            TryLockError::WouldBlock { key: None }
        );
        assert_eq!(
            table.clone().try_lock_owned(3).unwrap_err(),
            TryLockError::WouldBlock { key: None }
        );
    }
    // Failed attempts neither queue nor count (the holder's grant and the
    // waiter's are the two acquisitions).
    assert_eq!(table.waiters(&3), 0);
    assert_eq!(table.stats().acquisitions, 2);

    let guard = ready(&mut fut, &w);
    assert!(table.is_locked(&3));
    guard.release();
    assert!(!table.is_locked(&3));
    assert!(table.try_lock(3).is_ok());
    assert_eq!(table.len(), 0);
}

#[test]
fn newcomer_lock_queues_behind_the_granted_waiter() {
    let table = LockTable::new();
    let holder = table.try_lock('x').unwrap();
    let (pa, pb) = (Probe::new(), Probe::new());
    let (wa, wb) = (pa.waker(), pb.waker());
    let mut a = Box::pin(table.lock('x'));
    pending(&mut a, &wa);
    drop(holder);

    // A newcomer arrives after the grant but before `a` runs.
    let mut b = Box::pin(table.lock('x'));
    pending(&mut b, &wb);
    assert_eq!(table.waiters(&'x'), 1);

    let ga = ready(&mut a, &wa);
    pending(&mut b, &wb);
    assert_eq!(pb.wakes(), 0);
    let ta = ga.token();
    drop(ga);
    assert_eq!(pb.wakes(), 1);
    let gb = ready(&mut b, &wb);
    assert!(gb.token() > ta);
    drop(gb);
    assert_eq!(table.len(), 0);
}

#[test]
fn dropping_a_granted_unobserved_future_passes_the_key_on() {
    let table = LockTable::new();
    let holder = table.try_lock(String::from("row")).unwrap();
    let t0 = holder.token();
    let (pa, pb) = (Probe::new(), Probe::new());
    let (wa, wb) = (pa.waker(), pb.waker());
    let mut a = Box::pin(table.lock(String::from("row")));
    let mut b = Box::pin(table.lock(String::from("row")));
    pending(&mut a, &wa);
    pending(&mut b, &wb);

    drop(holder);
    assert_eq!((pa.wakes(), pb.wakes()), (1, 0));
    drop(a);
    // The grant passed to b, which was woken once.
    assert_eq!(pb.wakes(), 1);
    assert_eq!(table.waiters("row"), 0);
    assert!(table.is_locked("row"));
    assert!(table.try_lock(String::from("row")).is_err());
    let gb = ready(&mut b, &wb);
    assert_eq!(gb.key(), "row");
    assert!(gb.token() > t0);
    drop(gb);
    assert_eq!(table.len(), 0);
    assert_eq!(pa.wakes(), 1);
}

#[test]
fn dropping_the_last_granted_unobserved_future_frees_the_key() {
    let table = LockTable::new();
    let holder = table.try_lock(9i64).unwrap();
    let p = Probe::new();
    let w = p.waker();
    let mut a = Box::pin(table.lock(9));
    pending(&mut a, &w);
    drop(holder);
    assert!(table.is_locked(&9));
    drop(a);
    assert!(!table.is_locked(&9));
    assert_eq!(table.len(), 0);
    // The key works again, with a later token.
    let g = table.try_lock(9).unwrap();
    assert_eq!(table.len(), 1);
    drop(g);
    assert_eq!(table.len(), 0);
}

#[test]
fn dropping_waiting_futures_anywhere_in_the_queue_keeps_the_order_of_the_rest() {
    let table = LockTable::new();
    let mut guard = table.try_lock(5u16).unwrap();
    let probes: Vec<_> = (0..7).map(|_| Probe::new()).collect();
    let wakers: Vec<_> = probes.iter().map(Probe::waker).collect();
    let mut futs: Vec<_> = (0..7).map(|_| Some(Box::pin(table.lock(5)))).collect();
    for (fut, waker) in futs.iter_mut().zip(&wakers) {
        pending(fut.as_mut().unwrap(), waker);
    }
    // Drop the head, one in the middle and the tail while they wait.
    for i in [0, 3, 6] {
        futs[i] = None;
        // Its registration (and the table's waker handle) is gone.
        assert_eq!(probes[i].live_wakers(1), 1);
    }
    assert_eq!(table.waiters(&5), 4);
    // A newcomer joins after the drops: it must be served last.
    let late = Probe::new();
    let late_w = late.waker();
    let mut late_fut = Box::pin(table.lock(5));
    pending(&mut late_fut, &late_w);
    assert_eq!(table.waiters(&5), 5);

    for i in [1, 2, 4, 5] {
        drop(guard);
        assert_eq!(probes[i].wakes(), 1);
        assert!(probes
            .iter()
            .enumerate()
            .all(|(j, p)| j <= i || p.wakes() == 0));
        assert_eq!(late.wakes(), 0);
        guard = ready(futs[i].as_mut().unwrap(), &wakers[i]);
    }
    drop(guard);
    assert_eq!(late.wakes(), 1);
    drop(ready(&mut late_fut, &late_w));
    for i in [0, 3, 6] {
        assert_eq!(probes[i].wakes(), 0, "a dropped waiter is never woken");
    }
    drop(futs);
    assert_eq!(table.len(), 0);
    assert_eq!(table.stats().cancelled, 3);
}

#[test]
fn repolling_with_a_different_waker_replaces_it() {
    let table = LockTable::new();
    let holder = table.try_lock(1u8).unwrap();
    let (old, new) = (Probe::new(), Probe::new());
    let mut fut = Box::pin(table.lock(1));
    pending(&mut fut, &old.waker());
    assert_eq!(
        old.live_wakers(1),
        1,
        "the table holds one handle of the old waker"
    );

    // A clone of the same waker is recognised (`will_wake`): no new clone.
    let old_w = old.waker();
    let old_w2 = old_w.clone();
    let clones = old.clones();
    pending(&mut fut, &old_w2);
    assert_eq!(old.clones(), clones);
    drop((old_w, old_w2));

    pending(&mut fut, &new.waker());
    assert_eq!(old.live_wakers(1), 0, "the old waker handle was given back");
    assert_eq!(new.live_wakers(1), 1);

    drop(holder);
    assert_eq!(old.wakes(), 0, "the replaced waker is not woken");
    assert_eq!(new.wakes(), 1);
    let guard = ready(&mut fut, &new.waker());
    drop(guard);
    assert_eq!(new.live_wakers(1), 0);
    assert_eq!(table.len(), 0);
}

#[test]
fn tokens_strictly_increase_across_handoffs_and_idle_periods() {
    let table = LockTable::<u32>::builder().shards(4).build();
    let keys = 0u32..16;
    let mut seen: Vec<Vec<FencingToken>> = vec![Vec::new(); 16];
    let p = Probe::new();
    let w = p.waker();

    for round in 0..20 {
        for k in keys.clone() {
            if (round + k) % 3 == 0 {
                // Idle -> held -> idle.
                let g = table.try_lock(k).unwrap();
                seen[k as usize].push(g.token());
            } else {
                // A holder and two waiters: two handoffs, then idle.
                let mut g = table.try_lock(k).unwrap();
                seen[k as usize].push(g.token());
                let mut a = Box::pin(table.lock(k));
                let mut b = Box::pin(table.lock(k));
                pending(&mut a, &w);
                pending(&mut b, &w);
                drop(g);
                g = ready(&mut a, &w);
                seen[k as usize].push(g.token());
                drop(g);
                g = ready(&mut b, &w);
                seen[k as usize].push(g.token());
                drop(g);
            }
            assert!(!table.is_locked(&k));
        }
    }
    for (k, tokens) in seen.iter().enumerate() {
        assert!(tokens.len() >= 20);
        for pair in tokens.windows(2) {
            assert!(pair[0] < pair[1], "key {k}: {} then {}", pair[0], pair[1]);
        }
        assert!(tokens.iter().all(|t| t.get() != 0));
    }
    assert_eq!(table.len(), 0);
}

#[test]
fn stats_are_exact_for_a_scripted_scenario() {
    let table = LockTable::new();
    let p = Probe::new();
    let w = p.waker();
    assert_eq!(counts(&table), (0, 0, 0, 0));

    // Uncontended try_lock.
    let g1 = table.try_lock(1u64).unwrap();
    assert_eq!(counts(&table), (1, 0, 0, 0));
    // A failed try_lock counts nothing.
    assert!(table.try_lock(1).is_err());
    // Three waiters.
    let mut a = Box::pin(table.lock(1));
    let mut b = Box::pin(table.lock(1));
    let mut c = Box::pin(table.lock(1));
    pending(&mut a, &w);
    pending(&mut b, &w);
    pending(&mut c, &w);
    assert_eq!(counts(&table), (1, 0, 0, 0));

    // Handoff to a: a contended acquisition, counted when granted.
    drop(g1);
    assert_eq!(counts(&table), (2, 1, 1, 0));
    let ga = ready(&mut a, &w);
    assert_eq!(counts(&table), (2, 1, 1, 0));
    // b gives up while waiting.
    drop(b);
    assert_eq!(counts(&table), (2, 1, 1, 1));
    // Handoff to c, which is dropped before it runs: the grant frees the key.
    drop(ga);
    assert_eq!(counts(&table), (3, 2, 2, 1));
    drop(c);
    assert_eq!(counts(&table), (3, 2, 2, 2));
    assert!(!table.is_locked(&1));

    // Key 2: uncontended lock().await, then a handoff to d, dropped before it
    // runs with e behind it: the grant passes on to e (one more handoff).
    let g2 = ready(&mut Box::pin(table.lock(2)), &w);
    assert_eq!(counts(&table), (4, 2, 2, 2));
    let mut d = Box::pin(table.lock(2));
    let mut e = Box::pin(table.lock(2));
    pending(&mut d, &w);
    pending(&mut e, &w);
    drop(g2);
    assert_eq!(counts(&table), (5, 3, 3, 2));
    drop(d);
    assert_eq!(counts(&table), (6, 4, 4, 3));
    let ge = ready(&mut e, &w);
    assert_eq!(counts(&table), (6, 4, 4, 3));
    drop(ge);
    assert_eq!(counts(&table), (6, 4, 4, 3));

    // A future never polled, and one dropped after completing, count nothing.
    drop(Box::pin(table.lock(3)));
    let mut f = Box::pin(table.lock(3));
    drop(ready(&mut f, &w));
    drop(f);
    assert_eq!(counts(&table), (7, 4, 4, 3));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_waker_that_reenters_the_table_on_wake_does_not_deadlock() {
    // One shard: every key shares the shard lock the release just used.
    let table: Arc<LockTable<u32>> = Arc::new(LockTable::<u32>::builder().shards(1).build());
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let p = {
        let (table, log) = (table.clone(), log.clone());
        Probe::on_wake(move || {
            let same = table.try_lock(1).map(|g| g.token());
            let other = table.try_lock(2).map(|g| g.token());
            let mut log = log.lock().unwrap();
            log.push(format!("same:{}", same.is_ok()));
            log.push(format!("other:{}", other.is_ok()));
            log.push(format!("locked:{}", table.is_locked(&1)));
            log.push(format!("waiters:{}", table.waiters(&1)));
            log.push(format!("len:{}", table.len()));
        })
    };
    let w = p.waker();
    let holder = table.clone().try_lock_owned(1).unwrap();
    let mut fut = Box::pin(table.clone().lock_owned(1));
    pending(&mut fut, &w);

    // Run the release on another thread so that a deadlock shows up as a
    // failed test instead of a hung one.
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        drop(holder);
        tx.send(()).unwrap();
        fut
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("release deadlocked in a re-entrant waker");
    let mut fut = t.join().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        [
            "same:false",
            "other:true",
            "locked:true",
            "waiters:0",
            "len:1"
        ]
    );
    assert_eq!(p.wakes(), 1);
    drop(ready(&mut fut, &w));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_waker_that_reenters_on_wake_from_a_cancelled_grant_does_not_deadlock() {
    let table: Arc<LockTable<u32>> = Arc::new(LockTable::<u32>::builder().shards(1).build());
    let reentered = Arc::new(AtomicUsize::new(0));
    let pb = {
        let (table, reentered) = (table.clone(), reentered.clone());
        Probe::on_wake(move || {
            assert!(table.try_lock(1).is_err());
            drop(table.try_lock(2).unwrap());
            reentered.fetch_add(1, SeqCst);
        })
    };
    let pa = Probe::new();
    let (wa, wb) = (pa.waker(), pb.waker());
    let holder = table.clone().try_lock_owned(1).unwrap();
    let mut a = Box::pin(table.clone().lock_owned(1));
    let mut b = Box::pin(table.clone().lock_owned(1));
    pending(&mut a, &wa);
    pending(&mut b, &wb);
    drop(holder);

    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Dropping the granted `a` passes the key to `b`, whose waker re-enters.
        drop(a);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("cancel deadlocked in a re-entrant waker");
    assert_eq!(reentered.load(SeqCst), 1);
    drop(ready(&mut b, &wb));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_waker_that_panics_in_wake_leaves_the_table_consistent() {
    let table = LockTable::new();
    let p = Probe::on_wake(|| resume_unwind(Box::new("waker panicked")));
    let (q, r) = (Probe::new(), Probe::new());
    let (wp, wq, wr) = (p.waker(), q.waker(), r.waker());
    let holder = table.try_lock(4u64).unwrap();
    let t0 = holder.token();
    let mut a = Box::pin(table.lock(4));
    let mut b = Box::pin(table.lock(4));
    pending(&mut a, &wp);
    pending(&mut b, &wq);

    let res = catch_unwind(AssertUnwindSafe(|| holder.release()));
    assert!(
        res.is_err(),
        "the waker's panic reaches the releasing thread"
    );
    assert_eq!(p.wakes(), 1);
    // The key went to `a` all the same; `b` still waits behind it.
    assert!(table.is_locked(&4));
    assert_eq!(table.waiters(&4), 1);
    assert!(table.try_lock(4).is_err());
    pending(&mut b, &wq);
    let ga = ready(&mut a, &wp);
    assert!(ga.token() > t0);
    drop(ga);
    assert_eq!(q.wakes(), 1);
    let gb = ready(&mut b, &wq);
    drop(gb);
    assert_eq!(table.len(), 0);

    // The table still works for that key and others, contended or not.
    let g = table.try_lock(4).unwrap();
    let mut c = Box::pin(table.lock(4));
    pending(&mut c, &wr);
    drop(g);
    drop(ready(&mut c, &wr));
    drop(table.try_lock(5).unwrap());
    assert_eq!(table.len(), 0);
}

#[test]
fn a_waker_that_panics_when_a_cancelled_grant_passes_on_leaves_the_table_consistent() {
    let table = LockTable::new();
    let p = Probe::on_wake(|| resume_unwind(Box::new("waker panicked")));
    let q = Probe::new();
    let (wp, wq) = (p.waker(), q.waker());
    let holder = table.try_lock(4u64).unwrap();
    let mut a = Box::pin(table.lock(4));
    let mut b = Box::pin(table.lock(4));
    pending(&mut a, &wq);
    pending(&mut b, &wp);
    drop(holder);
    assert_eq!(q.wakes(), 1);

    // Dropping granted `a` hands the key to `b`, whose waker panics.
    assert!(catch_unwind(AssertUnwindSafe(|| drop(a))).is_err());
    assert_eq!(p.wakes(), 1);
    assert!(table.is_locked(&4));
    assert_eq!(table.waiters(&4), 0);
    drop(ready(&mut b, &wp));
    assert_eq!(table.len(), 0);
    drop(table.try_lock(4).unwrap());
    assert_eq!(table.len(), 0);
}

/// Runs `scenario` on its own thread with a waker-drop hook that checks, from
/// yet another thread, that the table is not locked while a waker handle the
/// table held is dropped. Returns how many drops saw the table locked.
fn drops_under_lock(
    scenario: impl FnOnce(&Arc<LockTable<u32>>, &std::task::Waker) + Send + 'static,
) -> usize {
    let table: Arc<LockTable<u32>> = Arc::new(LockTable::<u32>::builder().shards(1).build());
    let armed = Arc::new(AtomicBool::new(false));
    let blocked = Arc::new(AtomicUsize::new(0));
    let p = {
        let (table, armed, blocked) = (table.clone(), armed.clone(), blocked.clone());
        Probe::on_drop(move || {
            if !armed.load(SeqCst) {
                return;
            }
            // If the shard lock is held by this thread now, the helper blocks
            // until this drop returns. Wait generously, then record it.
            let (tx, rx) = mpsc::channel();
            let t = table.clone();
            std::thread::spawn(move || {
                let _ = t.len();
                let _ = tx.send(());
            });
            if rx.recv_timeout(Duration::from_secs(10)).is_err() {
                blocked.fetch_add(1, SeqCst);
            }
        })
    };
    let w = p.waker();
    let t2 = table.clone();
    let armed2 = armed.clone();
    std::thread::spawn(move || {
        armed2.store(true, SeqCst);
        scenario(&t2, &w);
        armed2.store(false, SeqCst);
    })
    .join()
    .unwrap();
    assert_eq!(table.len(), 0);
    blocked.load(SeqCst)
}

/// The module docs promise that no foreign code runs under a shard lock, and
/// `cancel_slot` says the waker "may belong to a dropped runtime: drop it
/// outside the lock". Dropping a waiting future must therefore drop the
/// table's waker handle after the shard lock is released.
#[test]
fn cancelling_a_waiter_drops_its_waker_outside_the_shard_lock() {
    let blocked = drops_under_lock(|table, w| {
        // Control: a handle dropped outside the table is not reported.
        drop(w.clone());
        let holder = table.try_lock(1).unwrap();
        let mut fut = Box::pin(table.lock(1));
        pending(&mut fut, w);
        drop(fut); // the table's handle of `w` is dropped here
        drop(holder);
    });
    assert_eq!(
        blocked, 0,
        "a waker was dropped while the shard lock was held"
    );
}

/// Same promise on the re-poll path: replacing a waiter's waker with a new one
/// drops the old handle, which must happen outside the shard lock too.
#[test]
fn replacing_a_waiters_waker_drops_the_old_one_outside_the_shard_lock() {
    let blocked = drops_under_lock(|table, w| {
        let holder = table.try_lock(1).unwrap();
        let mut fut = Box::pin(table.lock(1));
        pending(&mut fut, w);
        let other = Probe::new().waker();
        pending(&mut fut, &other); // the table's handle of `w` is dropped here
        drop(holder);
        drop(ready(&mut fut, &other));
    });
    assert_eq!(
        blocked, 0,
        "a waker was dropped while the shard lock was held"
    );
}

#[test]
fn lock_owned_follows_the_same_state_machine() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(11u64).unwrap();
    let (pa, pb) = (Probe::new(), Probe::new());
    let (wa, wb) = (pa.waker(), pb.waker());
    let mut a = Box::pin(table.clone().lock_owned(11));
    let mut b = Box::pin(table.clone().lock_owned(11));
    for _ in 0..100 {
        pending(&mut a, &wa);
        pending(&mut b, &wb);
    }
    assert_eq!((pa.clones(), pb.clones()), (1, 1));
    assert_eq!(table.waiters(&11), 2);
    drop(holder);
    assert_eq!((pa.wakes(), pb.wakes()), (1, 0));
    assert!(table.clone().try_lock_owned(11).is_err());
    // Granted `a` dropped unobserved: `b` gets the key.
    drop(a);
    assert_eq!(pb.wakes(), 1);
    let gb = ready(&mut b, &wb);
    assert!(Arc::ptr_eq(gb.table(), &table));
    assert_eq!(*gb.key(), 11);
    // The completed future gave its handle of the table to the guard.
    assert_eq!(Arc::strong_count(&table), 2);
    drop(gb);
    assert_eq!(table.len(), 0);
    assert_eq!(Arc::strong_count(&table), 1);
    drop(b);
}

#[test]
fn polling_a_completed_future_again_panics_and_harms_nothing() {
    let table = LockTable::new();
    let p = Probe::new();
    let w = p.waker();
    let mut fut = Box::pin(table.lock(1u8));
    let g = ready(&mut fut, &w);
    let again = catch_unwind(AssertUnwindSafe(|| poll_once(&mut fut, &w).is_ready()));
    assert!(again.is_err());
    assert!(table.is_locked(&1));
    drop(fut);
    assert!(
        table.is_locked(&1),
        "dropping the completed future leaves the guard's hold"
    );
    drop(g);
    assert_eq!(table.len(), 0);
}
