//! Cancellation from the outside: aborted tasks, dropped runtimes, panicking
//! holders, grants abandoned before they ran, futures dropped on another
//! thread, forgotten guards and futures.

mod probe;

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use keylock::{LockTable, TryLockError};
use probe::{pending, ready, Probe};

/// Yields to the tokio scheduler until `cond` holds.
async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn aborted_waiting_task_leaves_no_waiter() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned("k").unwrap();
    let task = tokio::spawn({
        let table = table.clone();
        async move {
            let _g = table.lock_owned("k").await;
            unreachable!("the key is never released to this task");
        }
    });
    until(|| table.waiters("k") == 1).await;

    task.abort();
    let err = task.await.unwrap_err();
    assert!(err.is_cancelled());
    assert_eq!(table.waiters("k"), 0);
    assert_eq!(table.stats().cancelled, 1);
    assert!(table.is_locked("k"));

    drop(holder);
    assert_eq!(table.len(), 0);
    // The key works, waited for or not.
    let g = table.lock("k").await;
    drop(g);
    assert_eq!(table.len(), 0);
    assert_eq!(
        table.stats().handoffs,
        0,
        "nobody was left to hand the key to"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_waiting_tasks_on_a_multi_thread_runtime_leave_no_waiter() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(1u64).unwrap();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let table = table.clone();
            tokio::spawn(async move { table.lock_owned(1).await.token() })
        })
        .collect();
    until(|| table.waiters(&1) == 8).await;
    // Abort every other one; the rest are served once the holder lets go.
    for t in tasks.iter().step_by(2) {
        t.abort();
    }
    until(|| tasks.iter().step_by(2).all(|t| t.is_finished())).await;
    assert_eq!(table.waiters(&1), 4);
    assert_eq!(table.stats().cancelled, 4);
    drop(holder);
    let mut served = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(_) => served += 1,
            Err(e) => {
                assert!(e.is_cancelled());
                assert_eq!(i % 2, 0);
            }
        }
    }
    // Idle tasks that are aborted are never polled again.
    assert_eq!(served, 4);
    assert_eq!(table.stats().acquisitions, 5);
    assert_eq!(table.waiters(&1), 0);
    assert_eq!(table.len(), 0);
}

#[test]
fn dropping_a_runtime_with_pending_waiters_removes_them() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(String::from("res")).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    for _ in 0..8 {
        let table = table.clone();
        rt.spawn(async move {
            let _g = table.lock_owned(String::from("res")).await;
            unreachable!("the holder never lets go while the runtime lives");
        });
    }
    rt.block_on(until(|| table.waiters("res") == 8));
    drop(rt);

    assert_eq!(table.waiters("res"), 0);
    assert!(table.is_locked("res"));
    assert_eq!(table.stats().cancelled, 8);
    // The tasks' handles of the table are gone too.
    assert_eq!(Arc::strong_count(&table), 2);
    drop(holder);
    assert_eq!(table.len(), 0);
    assert_eq!(table.stats().handoffs, 0);
}

#[test]
fn dropping_a_runtime_whose_woken_waiters_never_ran_passes_every_grant_on() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(5u32).unwrap();
    // A current-thread runtime runs its tasks only inside `block_on`.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    for _ in 0..5 {
        let (table, ran) = (table.clone(), ran.clone());
        rt.spawn(async move {
            let _g = table.lock_owned(5).await;
            ran.fetch_add(1, SeqCst);
        });
    }
    rt.block_on(until(|| table.waiters(&5) == 5));
    // The release grants the key to the first task, which cannot run now.
    drop(holder);
    assert!(table.is_locked(&5));
    assert_eq!(table.waiters(&5), 4);
    drop(rt);

    assert_eq!(ran.load(SeqCst), 0);
    assert_eq!(
        table.len(),
        0,
        "the abandoned grant was passed on and finally freed"
    );
    assert!(table.try_lock(5).is_ok());
    let stats = table.stats();
    assert_eq!(stats.cancelled, 5);
    // The holder's grant, and each grant passed along the dropped waiters
    // (how many depends on the order the runtime drops its tasks in).
    // (and the `try_lock` above).
    assert_eq!(stats.acquisitions, 2 + stats.handoffs);
    assert!((1..=5).contains(&stats.handoffs));
}

#[test]
fn a_thread_that_panics_holding_a_guard_frees_the_key() {
    let table = Arc::new(LockTable::new());
    let t = std::thread::spawn({
        let table = table.clone();
        move || {
            let _g = table.blocking_lock(3u64);
            panic!("holder panics");
        }
    });
    assert!(t.join().is_err());
    assert!(!table.is_locked(&3));
    assert_eq!(table.len(), 0);
    let g = table.try_lock(3).unwrap();
    drop(g);
    assert!(
        futures::executor::block_on(Box::pin(table.lock(3)))
            .token()
            .get()
            > 0
    );
    assert_eq!(table.len(), 0);
}

#[test]
fn a_panicking_holder_hands_the_key_to_a_thread_waiting_behind_it() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(3u64).unwrap();
    let first = holder.token();
    let panicker = std::thread::spawn(move || {
        let _g = holder;
        panic!("holder panics");
    });
    let waiter = std::thread::spawn({
        let table = table.clone();
        move || table.blocking_lock(3).token()
    });
    assert!(panicker.join().is_err());
    assert!(waiter.join().unwrap() > first);
    assert_eq!(table.len(), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_task_that_panics_holding_a_guard_frees_the_key() {
    let table = Arc::new(LockTable::new());
    let task = tokio::spawn({
        let table = table.clone();
        async move {
            let _g = table.lock_owned(8u8).await;
            tokio::task::yield_now().await;
            panic!("task panics");
        }
    });
    assert!(task.await.unwrap_err().is_panic());
    assert_eq!(table.len(), 0);
    drop(table.lock(8).await);
    assert_eq!(table.len(), 0);
}

#[test]
fn a_waiter_granted_then_aborted_before_it_ran_passes_the_key_on() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(2u64).unwrap();
    let t0 = holder.token();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let spawn = |name: &'static str| {
        let table = table.clone();
        rt.spawn(async move { (name, table.lock_owned(2).await.token()) })
    };
    let a = spawn("a");
    rt.block_on(until(|| table.waiters(&2) == 1));
    let b = spawn("b");
    rt.block_on(until(|| table.waiters(&2) == 2));

    // `a` is handed the key, but the runtime is not running: abort it first.
    drop(holder);
    assert_eq!(table.waiters(&2), 1);
    a.abort();
    let ra = rt.block_on(a);
    assert!(ra.unwrap_err().is_cancelled());
    // The abandoned grant went on to `b` (which may have run since).
    assert_eq!(table.waiters(&2), 0);
    assert_eq!(table.stats().handoffs, 2, "holder -> a, then a -> b");
    let (name, tb) = rt.block_on(b).unwrap();
    assert_eq!(name, "b");
    assert!(tb > t0);
    assert_eq!(table.len(), 0);
    let stats = table.stats();
    assert_eq!(stats.cancelled, 1);
    assert_eq!(stats.handoffs, 2);
    assert_eq!(
        stats.acquisitions, 3,
        "the holder, a (granted, aborted before it ran) and b"
    );
}

#[test]
fn a_waiting_future_dropped_on_another_thread() {
    let table = Arc::new(LockTable::new());
    let holder = table.try_lock(1u64).unwrap();
    let (p, q) = (Probe::new(), Probe::new());
    let (wp, wq) = (p.waker(), q.waker());
    let mut a = Box::pin(table.clone().lock_owned(1));
    let mut b = Box::pin(table.clone().lock_owned(1));
    pending(&mut a, &wp);
    pending(&mut b, &wq);
    std::thread::spawn(move || drop(a)).join().unwrap();
    assert_eq!(table.waiters(&1), 1);
    assert_eq!(
        p.live_wakers(1),
        1,
        "the table gave back the dropped waiter's waker"
    );
    drop(holder);
    assert_eq!((p.wakes(), q.wakes()), (0, 1));
    drop(ready(&mut b, &wq));
    assert_eq!(table.len(), 0);
}

#[test]
fn a_granted_future_dropped_on_another_thread_passes_the_key_on() {
    let table = LockTable::new();
    let holder = table.try_lock(1u64).unwrap();
    let (p, q) = (Probe::new(), Probe::new());
    let (wp, wq) = (p.waker(), q.waker());
    let mut a = Box::pin(table.lock(1));
    let mut b = Box::pin(table.lock(1));
    pending(&mut a, &wp);
    pending(&mut b, &wq);
    drop(holder);
    assert_eq!(p.wakes(), 1);
    // `Lock` is `Send`: a scoped thread may drop it.
    std::thread::scope(|s| {
        s.spawn(move || drop(a));
    });
    assert_eq!(q.wakes(), 1);
    assert!(table.is_locked(&1));
    let gb = ready(&mut b, &wq);
    // A guard dropped on another thread releases too.
    std::thread::scope(|s| {
        s.spawn(move || drop(gb));
    });
    assert_eq!(table.len(), 0);
}

#[test]
fn futures_polled_on_one_thread_can_be_repolled_and_completed_on_another() {
    let table = Arc::new(LockTable::new());
    let holder = table.clone().try_lock_owned(4u8).unwrap();
    let p = Probe::new();
    let wp = p.waker();
    let mut fut = Box::pin(table.clone().lock_owned(4));
    pending(&mut fut, &wp);
    let t = std::thread::spawn(move || {
        let q = Probe::new();
        let wq = q.waker();
        pending(&mut fut, &wq);
        (fut, q, wq)
    });
    let (mut fut, q, wq) = t.join().unwrap();
    std::thread::spawn(move || drop(holder)).join().unwrap();
    assert_eq!((p.wakes(), q.wakes()), (0, 1));
    let g = std::thread::spawn(move || ready(&mut fut, &wq))
        .join()
        .unwrap();
    assert_eq!(*g.key(), 4);
    drop(g);
    assert_eq!(table.len(), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn select_losing_branch_drops_the_wait() {
    let table = LockTable::new();
    let holder = table.try_lock(9u64).unwrap();
    for _ in 0..10 {
        tokio::select! {
            biased;
            _ = Box::pin(table.lock(9)) => unreachable!("the key is held"),
            _ = tokio::task::yield_now() => {}
        }
        assert_eq!(table.waiters(&9), 0);
    }
    assert_eq!(table.stats().cancelled, 10);
    drop(holder);
    assert_eq!(table.len(), 0);
    let g = table.try_lock(9).unwrap();
    assert_eq!(
        table.try_lock(9).unwrap_err(),
        TryLockError::WouldBlock { key: None }
    );
    drop(g);
    assert_eq!(table.len(), 0);
}

/// A key that counts how often it is dropped.
struct CountedKey(u32, Arc<AtomicUsize>);

impl PartialEq for CountedKey {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for CountedKey {}
impl Hash for CountedKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}
impl Drop for CountedKey {
    fn drop(&mut self) {
        self.1.fetch_add(1, SeqCst);
    }
}

#[test]
fn every_key_handed_in_is_dropped_exactly_once() {
    let drops = Arc::new(AtomicUsize::new(0));
    let key = |k| CountedKey(k, drops.clone());
    let table = LockTable::new();
    let w = Probe::new().waker();

    let holder = table.try_lock(key(1)).unwrap();
    // A failed try_lock gives its key back to be dropped.
    assert!(table.try_lock(key(1)).is_err());
    assert_eq!(drops.load(SeqCst), 1);
    // Queued waiters drop their duplicate key at once: the entry's key is used.
    let mut a = Box::pin(table.lock(key(1)));
    let mut b = Box::pin(table.lock(key(1)));
    let c = Box::pin(table.lock(key(1))); // never polled
    pending(&mut a, &w);
    pending(&mut b, &w);
    assert_eq!(drops.load(SeqCst), 3);
    drop(c);
    assert_eq!(drops.load(SeqCst), 4);
    drop(holder);
    drop(a); // granted, unobserved: passes on to b
    let gb = ready(&mut b, &w);
    assert_eq!(gb.key().0, 1);
    assert_eq!(
        drops.load(SeqCst),
        4,
        "the table's key lives while the key is held"
    );
    drop(gb);
    assert_eq!(drops.load(SeqCst), 5);
    drop(b);
    assert_eq!(drops.load(SeqCst), 5);
    assert_eq!(table.len(), 0);
}

#[test]
fn a_forgotten_guard_and_a_forgotten_waiter_are_cleaned_up_with_the_table() {
    let drops = Arc::new(AtomicUsize::new(0));
    let p = Probe::new();
    let table = LockTable::new();
    let guard = table.try_lock(CountedKey(1, drops.clone())).unwrap();
    let mut fut = Box::pin(table.lock(CountedKey(1, drops.clone())));
    pending(&mut fut, &p.waker());
    assert_eq!(drops.load(SeqCst), 1);
    std::mem::forget(guard);
    std::mem::forget(fut);
    assert!(table.is_locked(&CountedKey(1, drops.clone())));
    assert_eq!(drops.load(SeqCst), 2);
    assert_eq!(
        p.live_wakers(1),
        1,
        "the forgotten waiter's node, inside the leaked future, keeps its waker"
    );
    drop(table);
    assert_eq!(
        drops.load(SeqCst),
        3,
        "the table's own key was dropped with the table"
    );
    // The table never owned the waker: it leaks with the forgotten future.
    assert_eq!(p.live_wakers(1), 1);
}

/// The queue's head keeps no `prev` link: after a handoff pops `a`, the new
/// head `b` still names `a` in its stored link. Cancelling `b` then must not
/// follow that link, which would rewrite the links of `a`'s node, where the
/// table published `a`'s grant: `a` (granted, not yet polled) must still
/// read its grant, and `c` must come next.
#[test]
fn cancelling_the_new_head_after_a_handoff_leaves_the_granted_waiter_its_grant() {
    let table = LockTable::new();
    let probe = Probe::new();
    let waker = probe.waker();
    let holder = table.try_lock("k").unwrap();
    let mut a = Box::pin(table.lock("k"));
    let mut b = Box::pin(table.lock("k"));
    let mut c = Box::pin(table.lock("k"));
    pending(&mut a, &waker);
    pending(&mut b, &waker);
    pending(&mut c, &waker);
    assert_eq!(table.waiters("k"), 3);

    let t0 = holder.token();
    drop(holder); // `a` is granted the key and unlinked; `b` heads the queue.
    assert_eq!(table.waiters("k"), 2);
    drop(b); // cancels the head
    assert_eq!(table.waiters("k"), 1);
    assert_eq!(table.stats().cancelled, 1);

    let ga = ready(&mut a, &waker);
    assert!(ga.token() > t0, "a's grant, published before b left");
    assert!(table.try_lock("k").is_err());
    let ta = ga.token();
    drop(ga); // hands the key to `c`, the only waiter left
    assert_eq!(table.waiters("k"), 0);
    let gc = ready(&mut c, &waker);
    assert!(gc.token() > ta);
    drop(gc);
    assert_eq!(table.len(), 0);
    assert_eq!(table.stats().handoffs, 2, "holder -> a -> c");
}
