//! Randomised stress on a few hot keys, mixing completed waits with waits
//! cancelled by timeouts, by aborting their task, and by dropping the future
//! after one poll. Bounded to a few seconds on two cores.
//!
//! Every holder checks mutual exclusion (an "inside" counter per key) and that
//! its fencing token exceeds the previous holder's; the test counts every
//! acquisition it observes and compares with the table's statistics.
//! To add random preemptions around the shard locks, run it with the
//! `jitter` feature and a rate per 10,000 lock and unlock calls:
//! `KEYLOCK_JITTER=200 cargo test --release --features test-util,tokio,jitter --test stress`.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use keylock::{FencingToken, LockTable};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEYS: usize = 4;

struct Shared {
    table: Arc<LockTable<usize>>,
    inside: [AtomicUsize; KEYS],
    last_token: [AtomicU64; KEYS],
    violations: AtomicUsize,
    acquired: AtomicU64,
    gave_up: AtomicU64,
}

impl Shared {
    fn new(shards: usize) -> Arc<Self> {
        Arc::new(Self {
            table: Arc::new(LockTable::<usize>::builder().shards(shards).build()),
            inside: Default::default(),
            last_token: Default::default(),
            violations: AtomicUsize::new(0),
            acquired: AtomicU64::new(0),
            gave_up: AtomicU64::new(0),
        })
    }

    /// Called right after an acquisition, before any await point, so that an
    /// aborted task cannot hold the key without being counted.
    fn enter(&self, key: usize, token: FencingToken) {
        self.acquired.fetch_add(1, SeqCst);
        if self.inside[key].fetch_add(1, SeqCst) != 0 {
            self.violations.fetch_add(1, SeqCst);
        }
        if self.last_token[key].swap(token.get(), SeqCst) >= token.get() {
            self.violations.fetch_add(1, SeqCst);
        }
    }

    fn exit(&self, key: usize) {
        if self.inside[key].fetch_sub(1, SeqCst) != 1 {
            self.violations.fetch_add(1, SeqCst);
        }
    }

    #[track_caller]
    fn check(&self) {
        let stats = self.table.stats();
        assert_eq!(
            self.violations.load(SeqCst),
            0,
            "mutual exclusion or token order broken"
        );
        assert!(self.inside.iter().all(|c| c.load(SeqCst) == 0));
        assert_eq!(self.table.len(), 0);
        // Every grant is counted when made; the ones the test never saw went
        // to futures dropped before they ran, each counted as cancelled.
        let acquired = self.acquired.load(SeqCst);
        assert!(stats.acquisitions >= acquired);
        assert!(stats.acquisitions - acquired <= stats.cancelled);
        assert!(stats.contended <= stats.acquisitions);
        // Every give-up the test saw registered first, so it was counted.
        assert!(stats.cancelled >= self.gave_up.load(SeqCst));
        for k in 0..KEYS {
            assert_eq!(self.table.waiters(&k), 0);
            assert!(!self.table.is_locked(&k));
        }
    }
}

/// A critical section that may be exited while a task is aborted: it leaves
/// the key on drop, before the guard (declared first) releases it.
struct Inside<'a>(&'a Shared, usize);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.exit(self.1);
    }
}

async fn hold(shared: &Shared, key: usize, token: FencingToken, rng: &mut StdRng) {
    shared.enter(key, token);
    let _inside = Inside(shared, key);
    for _ in 0..rng.gen_range(0..3) {
        tokio::task::yield_now().await;
    }
}

#[test]
fn tokio_tasks_with_timeouts_and_aborts() {
    tokio_stress(16);
}

/// All keys in one shard: every operation contends on the same shard lock.
#[test]
fn tokio_tasks_with_timeouts_and_aborts_on_one_shard() {
    tokio_stress(1);
}

fn tokio_stress(shards: usize) {
    const TASKS: usize = 64;
    const ITERS: usize = 300;
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let shared = Shared::new(shards);
    rt.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(seed ^ t as u64);
                    for _ in 0..ITERS {
                        let key = rng.gen_range(0..KEYS);
                        match rng.gen_range(0..4) {
                            0 => {
                                let g = shared.table.lock(key).await;
                                hold(&shared, key, g.token(), &mut rng).await;
                            }
                            1 => {
                                let wait = Duration::from_micros(rng.gen_range(0..300));
                                match tokio::time::timeout(
                                    wait,
                                    Box::pin(shared.table.clone().lock_owned(key)),
                                )
                                .await
                                {
                                    Ok(g) => hold(&shared, key, g.token(), &mut rng).await,
                                    Err(_) => {
                                        shared.gave_up.fetch_add(1, SeqCst);
                                    }
                                }
                            }
                            2 => {
                                // A task that is aborted at once, or after it
                                // had a chance to queue or even acquire.
                                let shared2 = shared.clone();
                                let mut rng2 = StdRng::seed_from_u64(rng.gen());
                                let task = tokio::spawn(async move {
                                    let g = shared2.table.clone().lock_owned(key).await;
                                    hold(&shared2, key, g.token(), &mut rng2).await;
                                });
                                for _ in 0..rng.gen_range(0..3) {
                                    tokio::task::yield_now().await;
                                }
                                task.abort();
                                match task.await {
                                    Ok(()) => {}
                                    Err(e) => assert!(e.is_cancelled()),
                                }
                            }
                            _ => {
                                if let Ok(g) = shared.table.try_lock(key) {
                                    hold(&shared, key, g.token(), &mut rng).await;
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    drop(rt);
    shared.check();
    assert!(shared.acquired.load(SeqCst) > 0);
}

#[test]
fn threads_mixing_blocking_lock_try_lock_and_abandoned_waits() {
    const THREADS: usize = 6;
    const ITERS: usize = 1500;
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let shared = Shared::new(8);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let shared = &shared;
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed ^ t as u64);
                let waker = futures::task::noop_waker();
                let cx = &mut Context::from_waker(&waker);
                for _ in 0..ITERS {
                    let key = rng.gen_range(0..KEYS);
                    let guard = match rng.gen_range(0..4) {
                        0 => Some(shared.table.blocking_lock(key)),
                        1 => shared.table.try_lock(key).ok(),
                        2 => {
                            // Poll a few times without waiting, then give up:
                            // the future may be queued, granted, or done.
                            let mut fut = Box::pin(shared.table.lock(key));
                            let mut got = None;
                            for _ in 0..rng.gen_range(1..4) {
                                if let std::task::Poll::Ready(g) =
                                    std::pin::Pin::new(&mut fut).poll(cx)
                                {
                                    got = Some(g);
                                    break;
                                }
                                std::thread::yield_now();
                            }
                            if got.is_none() {
                                shared.gave_up.fetch_add(1, SeqCst);
                            }
                            got
                        }
                        _ => {
                            let g = futures::executor::block_on(Box::pin(
                                shared.table.clone().lock_owned(key),
                            ));
                            shared.enter(key, g.token());
                            std::thread::yield_now();
                            shared.exit(key);
                            None
                        }
                    };
                    if let Some(g) = guard {
                        shared.enter(key, g.token());
                        if rng.gen_bool(0.5) {
                            std::thread::yield_now();
                        }
                        shared.exit(key);
                    }
                }
            });
        }
    });
    shared.check();
}
