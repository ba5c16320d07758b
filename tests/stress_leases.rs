//! Randomised stress with leases that lapse, timeouts that fire and tasks
//! that are aborted, on tokio, async-std and plain threads sharing one table.
//!
//! With leases, two tasks may both *think* they hold a key (the lapsed one has
//! not noticed yet), so mutual exclusion is checked where it matters: at
//! commit. Every commit happens under a store lock and only after `check()`
//! succeeded there; the committed tokens of a key must then never go down (a
//! fenced holder never commits after its successor). A holder that sleeps
//! past its own deadline must see `check()` fail. At the end nothing is left
//! in the table.
//! To add random preemptions around the shard locks, run it with the
//! `jitter` feature and a rate per 10,000 lock and unlock calls:
//! `KEYLOCK_JITTER=200 cargo test --release --features test-util,tokio,jitter --test stress_leases`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keylock::{LockError, LockOptions, LockTable};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEYS: u8 = 3;

#[derive(Default)]
struct Store {
    committed: Mutex<HashMap<u8, u64>>,
    commits: AtomicU64,
    refused: AtomicU64,
    lapses_seen: AtomicU64,
}

impl Store {
    /// Commits under the store lock if the guard's grant is still live.
    fn commit(&self, key: u8, check: impl FnOnce() -> Result<keylock::FencingToken, LockError>) {
        let mut committed = self.committed.lock().unwrap();
        match check() {
            Ok(token) => {
                let last = committed.entry(key).or_insert(0);
                assert!(
                    token.get() >= *last,
                    "key {key}: grant {token} committed after its successor #{last}"
                );
                *last = token.get();
                self.commits.fetch_add(1, SeqCst);
            }
            Err(LockError::Expired { .. }) => {
                self.refused.fetch_add(1, SeqCst);
            }
            Err(other) => panic!("unexpected error from check: {other}"),
        }
    }
}

fn options(rng: &mut StdRng) -> LockOptions {
    let mut opts = LockOptions::new();
    if rng.gen_bool(0.7) {
        opts = opts.lease(Duration::from_micros(rng.gen_range(200..3000)));
    }
    if rng.gen_bool(0.5) {
        opts = opts.timeout(Duration::from_micros(rng.gen_range(0..4000)));
    }
    opts
}

/// What a holder does while holding: sometimes overstay its lease on purpose.
fn overstay(rng: &mut StdRng) -> bool {
    rng.gen_bool(0.1)
}

fn check_lapsed<G>(
    expires: Option<Instant>,
    check: impl Fn() -> Result<G, LockError>,
    store: &Store,
) {
    if let Some(deadline) = expires {
        if Instant::now() >= deadline {
            assert!(
                check().is_err(),
                "a grant past its deadline still passed check()"
            );
            store.lapses_seen.fetch_add(1, SeqCst);
        }
    }
}

#[test]
fn leases_timeouts_and_aborts_across_tokio_async_std_and_threads() {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    let table = Arc::new(LockTable::<u8>::builder().shards(2).build());
    let store = Arc::new(Store::default());

    let tokio_side = {
        let (table, store) = (table.clone(), store.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let mut handles = Vec::new();
                for t in 0..16u64 {
                    let (table, store) = (table.clone(), store.clone());
                    let task = tokio::spawn(async move {
                        let mut rng = StdRng::seed_from_u64(seed ^ t);
                        for _ in 0..150 {
                            let key = rng.gen_range(0..KEYS);
                            let opts = options(&mut rng);
                            let Ok(guard) = table.clone().lock_owned_with(key, opts).await else {
                                continue;
                            };
                            if overstay(&mut rng) {
                                if let Some(deadline) = guard.expires_at() {
                                    tokio::time::sleep_until(deadline.into()).await;
                                }
                                check_lapsed(guard.expires_at(), || guard.check(), &store);
                            } else {
                                tokio::task::yield_now().await;
                            }
                            store.commit(key, || guard.check());
                        }
                    });
                    handles.push(task);
                }
                // Abort a few of them midway.
                tokio::time::sleep(Duration::from_millis(5)).await;
                for h in handles.iter().step_by(5) {
                    h.abort();
                }
                for h in handles {
                    let _ = h.await;
                }
            });
        })
    };

    let async_std_side = {
        let (table, store) = (table.clone(), store.clone());
        std::thread::spawn(move || {
            async_std::task::block_on(async {
                let tasks: Vec<_> = (0..8u64)
                    .map(|t| {
                        let (table, store) = (table.clone(), store.clone());
                        async_std::task::spawn(async move {
                            let mut rng = StdRng::seed_from_u64(seed ^ (100 + t));
                            for _ in 0..150 {
                                let key = rng.gen_range(0..KEYS);
                                let Ok(guard) = table.lock_with(key, options(&mut rng)).await
                                else {
                                    continue;
                                };
                                if overstay(&mut rng) {
                                    if let Some(deadline) = guard.expires_at() {
                                        async_std::task::sleep(
                                            deadline.saturating_duration_since(Instant::now()),
                                        )
                                        .await;
                                    }
                                    check_lapsed(guard.expires_at(), || guard.check(), &store);
                                }
                                store.commit(key, || guard.check());
                                async_std::task::yield_now().await;
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await;
                }
            });
        })
    };

    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let (table, store) = (table.clone(), store.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed ^ (200 + t));
                for _ in 0..150 {
                    let key = rng.gen_range(0..KEYS);
                    let Ok(guard) = table.blocking_lock_with(key, options(&mut rng)) else {
                        continue;
                    };
                    if overstay(&mut rng) {
                        if let Some(deadline) = guard.expires_at() {
                            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                        }
                        check_lapsed(guard.expires_at(), || guard.check(), &store);
                    }
                    store.commit(key, || guard.check());
                }
            })
        })
        .collect();

    tokio_side.join().expect("tokio side");
    async_std_side.join().expect("async-std side");
    for t in threads {
        t.join().expect("thread");
    }

    assert_eq!(table.len(), 0, "everything dropped: no key left");
    for key in 0..KEYS {
        assert_eq!(table.waiters(&key), 0);
        assert!(!table.is_locked(&key));
    }
    let stats = table.stats();
    assert!(store.commits.load(SeqCst) > 0);
    assert!(
        stats.acquisitions >= store.commits.load(SeqCst) + store.refused.load(SeqCst),
        "every commit attempt came from an acquisition: {stats:?}"
    );
    eprintln!(
        "commits {}, refused {}, lapses seen {}, {stats:?}",
        store.commits.load(SeqCst),
        store.refused.load(SeqCst),
        store.lapses_seen.load(SeqCst)
    );
}
