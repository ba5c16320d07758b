//! One table, every executor: tokio (multi-thread and current-thread),
//! async-std, smol, `futures::executor`, plain threads, and all of them at once
//! on the same keys.
//!
//! Mutual exclusion is checked with an "inside" counter per key that every
//! holder increments on entry and decrements on exit: seeing anything but 0 on
//! entry (or 1 on exit) is a violation. Each holder also checks that its
//! fencing token is greater than the previous holder's.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use keylock::{FencingToken, LockTable};

const KEYS: usize = 3;

/// Yields once to whatever executor polls it, without naming that executor.
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

fn yield_now() -> YieldNow {
    YieldNow(false)
}

/// Everything the workers share.
struct Shared {
    table: Arc<LockTable<u64>>,
    inside: [AtomicUsize; KEYS],
    last_token: [AtomicU64; KEYS],
    violations: AtomicUsize,
    done: AtomicUsize,
    go: AtomicBool,
}

impl Shared {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            table: Arc::new(LockTable::new()),
            inside: Default::default(),
            last_token: Default::default(),
            violations: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            go: AtomicBool::new(true),
        })
    }

    fn enter(&self, key: u64, token: FencingToken) {
        let k = key as usize;
        if self.inside[k].fetch_add(1, SeqCst) != 0 {
            self.violations.fetch_add(1, SeqCst);
        }
        if self.last_token[k].swap(token.get(), SeqCst) >= token.get() {
            self.violations.fetch_add(1, SeqCst);
        }
    }

    fn exit(&self, key: u64) {
        if self.inside[key as usize].fetch_sub(1, SeqCst) != 1 {
            self.violations.fetch_add(1, SeqCst);
        }
        self.done.fetch_add(1, SeqCst);
    }

    #[track_caller]
    fn check(&self, expected: usize) {
        assert_eq!(
            self.violations.load(SeqCst),
            0,
            "mutual exclusion or token order broken"
        );
        assert_eq!(self.done.load(SeqCst), expected);
        assert_eq!(self.table.stats().acquisitions, expected as u64);
        assert!(self.inside.iter().all(|c| c.load(SeqCst) == 0));
        assert_eq!(self.table.len(), 0);
        assert!(self.table.is_empty());
    }
}

/// An async worker: `iters` critical sections over the keys, alternating
/// `lock` and `lock_owned`, yielding inside each one so that others queue.
async fn worker(shared: Arc<Shared>, id: usize, iters: usize) {
    while !shared.go.load(SeqCst) {
        yield_now().await;
    }
    for i in 0..iters {
        let key = ((i * 7 + id) % KEYS) as u64;
        if i % 2 == 0 {
            let guard = shared.table.lock(key).await;
            assert_eq!(*guard.key(), key);
            shared.enter(key, guard.token());
            yield_now().await;
            shared.exit(key);
        } else {
            let guard = shared.table.clone().lock_owned(key).await;
            shared.enter(key, guard.token());
            yield_now().await;
            shared.exit(key);
        }
    }
}

/// A thread worker: `try_lock` when the key happens to be free, otherwise
/// `blocking_lock`.
fn thread_worker(shared: &Shared, id: usize, iters: usize) {
    while !shared.go.load(SeqCst) {
        std::thread::yield_now();
    }
    for i in 0..iters {
        let key = ((i * 5 + id) % KEYS) as u64;
        let guard = match shared.table.try_lock(key) {
            Ok(guard) => guard,
            Err(_) => shared.table.blocking_lock(key),
        };
        shared.enter(key, guard.token());
        std::thread::yield_now();
        shared.exit(key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_multi_thread() {
    let shared = Shared::new();
    let tasks: Vec<_> = (0..16)
        .map(|id| tokio::spawn(worker(shared.clone(), id, 100)))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    shared.check(1600);
}

#[tokio::test(flavor = "current_thread")]
async fn tokio_current_thread() {
    let shared = Shared::new();
    let tasks: Vec<_> = (0..16)
        .map(|id| tokio::spawn(worker(shared.clone(), id, 100)))
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    shared.check(1600);
    // On one thread, a holder that yields is always overtaken by a queued
    // task: waits must have happened.
    assert!(shared.table.stats().contended > 0);
    assert!(shared.table.stats().handoffs > 0);
}

#[async_std::test]
async fn async_std_tasks() {
    let shared = Shared::new();
    let tasks: Vec<_> = (0..16)
        .map(|id| async_std::task::spawn(worker(shared.clone(), id, 100)))
        .collect();
    for t in tasks {
        t.await;
    }
    shared.check(1600);
}

#[test]
fn smol_executor() {
    let shared = Shared::new();
    let ex = smol::Executor::new();
    smol::block_on(ex.run(async {
        let tasks: Vec<_> = (0..16)
            .map(|id| ex.spawn(worker(shared.clone(), id, 100)))
            .collect();
        for t in tasks {
            t.await;
        }
    }));
    shared.check(1600);
    assert!(shared.table.stats().contended > 0);
}

#[test]
fn futures_local_pool_and_block_on() {
    use futures::task::LocalSpawnExt;
    let shared = Shared::new();
    let mut pool = futures::executor::LocalPool::new();
    for id in 0..16 {
        pool.spawner()
            .spawn_local(worker(shared.clone(), id, 100))
            .unwrap();
    }
    pool.run();
    shared.check(1600);
    assert!(shared.table.stats().contended > 0);

    // And plain `block_on`, one future at a time.
    futures::executor::block_on(worker(shared.clone(), 0, 30));
    shared.check(1630);
}

#[test]
fn std_threads_with_blocking_lock() {
    let shared = Shared::new();
    std::thread::scope(|s| {
        for id in 0..4 {
            let shared = &shared;
            s.spawn(move || thread_worker(shared, id, 200));
        }
    });
    shared.check(800);
}

#[test]
fn all_runtimes_and_threads_share_one_table_at_once() {
    const ITERS: usize = 150;
    let shared = Shared::new();
    // Nobody starts before every worker of every runtime has been spawned.
    shared.go.store(false, SeqCst);

    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let tokio_tasks: Vec<_> = (0..4)
        .map(|id| tokio_rt.spawn(worker(shared.clone(), id, ITERS)))
        .collect();

    let std_tasks: Vec<_> = (4..8)
        .map(|id| async_std::task::spawn(worker(shared.clone(), id, ITERS)))
        .collect();

    let smol_thread = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let ex = smol::Executor::new();
            smol::block_on(ex.run(async {
                let tasks: Vec<_> = (8..12)
                    .map(|id| ex.spawn(worker(shared.clone(), id, ITERS)))
                    .collect();
                for t in tasks {
                    t.await;
                }
            }));
        })
    };

    let futures_thread = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            use futures::task::LocalSpawnExt;
            let mut pool = futures::executor::LocalPool::new();
            for id in 12..16 {
                pool.spawner()
                    .spawn_local(worker(shared.clone(), id, ITERS))
                    .unwrap();
            }
            pool.run();
        })
    };

    let threads: Vec<_> = (16..18)
        .map(|id| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                while !shared.go.load(SeqCst) {
                    std::thread::yield_now();
                }
                for i in 0..ITERS {
                    let key = ((i + id) % KEYS) as u64;
                    let guard = if i % 2 == 0 {
                        shared.table.blocking_lock(key)
                    } else {
                        loop {
                            match shared.table.try_lock(key) {
                                Ok(guard) => break guard,
                                Err(_) => std::thread::yield_now(),
                            }
                        }
                    };
                    shared.enter(key, guard.token());
                    std::thread::yield_now();
                    shared.exit(key);
                }
            })
        })
        .collect();

    shared.go.store(true, SeqCst);

    tokio_rt.block_on(async {
        for t in tokio_tasks {
            t.await.unwrap();
        }
    });
    async_std::task::block_on(async {
        for t in std_tasks {
            t.await;
        }
    });
    smol_thread.join().unwrap();
    futures_thread.join().unwrap();
    for t in threads {
        t.join().unwrap();
    }
    drop(tokio_rt);

    shared.check(18 * ITERS);
    let stats = shared.table.stats();
    assert!(stats.contended <= stats.acquisitions);
    assert!(stats.handoffs >= stats.contended);
    assert_eq!(stats.cancelled, 0);
}

/// Waiters from different executors on one key are served in the order they
/// queued, whichever executor each runs on.
#[test]
fn fifo_across_executors() {
    let table = Arc::new(LockTable::new());
    let order = Arc::new(Mutex::new(Vec::new()));
    let holder = table.try_lock(0u64).unwrap();

    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let mut waits: Vec<Box<dyn FnOnce()>> = Vec::new();
    for i in 0..6 {
        let (table2, order2) = (table.clone(), order.clone());
        let fut = async move {
            let guard = table2.lock_owned(0).await;
            order2.lock().unwrap().push(i);
            drop(guard);
        };
        match i % 3 {
            0 => {
                let h = tokio_rt.spawn(fut);
                let rt = tokio_rt.handle().clone();
                waits.push(Box::new(move || rt.block_on(h).unwrap()));
            }
            1 => {
                let h = async_std::task::spawn(fut);
                waits.push(Box::new(move || async_std::task::block_on(h)));
            }
            _ => {
                let h = std::thread::spawn(move || futures::executor::block_on(fut));
                waits.push(Box::new(move || h.join().unwrap()));
            }
        }
        // Wait until this waiter has queued before starting the next one.
        while table.waiters(&0) != i + 1 {
            std::thread::yield_now();
        }
    }
    drop(holder);
    for w in waits {
        w();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3, 4, 5]);
    drop(tokio_rt);
    assert_eq!(table.len(), 0);
}
