//! The workloads, written once against [`KeyedLock`] and shared by
//! `examples/compare.rs` and `benches/compare.rs`.
//!
//! Every workload runs on a tokio multi-thread runtime with two workers; the
//! timed part runs in spawned tasks, never in `block_on`'s thread, except the
//! holder of W5's key. Each call builds a fresh lock table and drops it
//! outside the timed region.
//!
//! # A harness must not flatter us
//!
//! Each anchor must run here at the cost a plain loop measures for it.
//! `compare` checks that on every run that includes W1: it times W1 through
//! this harness and, interleaved with it, as a plain loop written with each
//! implementation's own types (`compare/plain.rs`), and prints both.
//!
//! ## Why `async_lock::Mutex` costs 35-50 ns per W1 lock+unlock, not 13-18
//!
//! Not because of the harness: because of the crate. Measured on the 2-core
//! machine of BENCHMARKS.md (busy: load 2-6), 2M iterations, medians of 7-21
//! interleaved runs; instructions per lock+unlock from callgrind
//! (`(Ir(N = 100000) - Ir(N = 0)) / 100000`), which do not depend on load:
//!
//! | async_lock::Mutex, one lock+unlock | ns | instructions |
//! |---|---:|---:|
//! | `try_lock()` + drop, no async, no runtime | 45-47 | 107 |
//! | plain loop `m.lock().await`, mutex local to a spawned task | 47-50 | 120 |
//! | the same loop in `block_on` instead of a spawned task | 46-49 | |
//! | through `KeyedLock::lock` (`impl Future`), no `black_box` | 46-54 | 121 |
//! | this harness's W1 as it was (`black_box` on key and guard) | 50-51 | 126 |
//! | `event_listener::Event::notify(1)` alone, nobody listening | 29-34 | |
//! | plain loop with event-listener pinned to 5.3.0 | 22-26 | |
//!
//! The trait's `impl Future`, `on_worker`'s spawn (once per 2M iterations,
//! outside the timed region), the `Arc` and the `black_box`es add one to six
//! instructions to async_lock's 120, within the noise of its time. No `Box`
//! is involved, `scramble` is not called in W1, and one `Instant` pair
//! around 2M iterations has no granularity to speak of. Even with no
//! runtime, no future and no harness, `try_lock` + drop costs 45-47 ns.
//!
//! The cost is the unlock. `MutexGuard::drop` is a `fetch_sub` plus
//! `Event::notify(1)`, and event-listener 5.4 (what async-lock 3.5 resolves
//! to) issues a full fence (`lock not`) and then locks and unlocks the std
//! mutex of its listener list on every call, even when nobody listens: 5.3.1
//! removed the early return that skipped this (smol-rs/event-listener#139,
//! missed wakeups found by loom). That is five atomic read-modify-writes per
//! lock+unlock, against two for parking_lot or futures (17-23 ns here).
//! With event-listener 5.3.0 the same plain loop runs at 22-26 ns. A figure
//! of 13-18 ns was not reproduced with any harness on this machine with
//! async-lock 3.5 and event-listener 5.4; it fits an older event-listener
//! (or a quieter machine), not the dependencies measured here.
//!
//! ## What the harness did cost, and no longer does
//!
//! Comparing every implementation's W1 through the harness with its plain
//! loop, in instructions per lock+unlock, found three small overheads,
//! all fixed (keylock as of commit 5d5d858):
//!
//! | implementation | harness before | harness now | plain loop |
//! |---|---:|---:|---:|
//! | keylock | 405 | 394 | 393 |
//! | dashmap-leak | 616 | 576 | 577 |
//! | tokio::Mutex | 306 | 300 | 300 |
//! | async_lock::Mutex | 126 | 121 | 120 |
//! | futures::Mutex | 90 | 86 | 85 |
//! | parking_lot::Mutex | 24 | 10 | 8 |
//!
//! - `black_box(&guard)` (4-11 instructions for everyone): removed; dropping
//!   the guard unlocks, which the optimizer cannot remove anyway.
//! - dashmap-leak's `lock` was not inlined, so its 120-byte future went
//!   through a return slot and was moved again (35 instructions, 6%): every
//!   `lock` is `#[inline]` now.
//! - The synchronous floor went through `lock(k).await` of a ready future:
//!   the `.await` keeps the loop's variables in the task's state in memory
//!   (parking_lot: 24 instructions against 8, about 4 ns). W1 and W2 now
//!   lock it with `KeyedLock::lock_sync` in a loop without `.await`, as
//!   synchronous locks are used in async code. keylock and the async anchors
//!   all still go through the same `lock(k).await`.
//!
//! The other way round, as of commit 084b4d3: keylock 443 through the
//! harness, 442 in a plain loop, but keylock+lease 709 against 813 and
//! keylock+timeout 459 against 542, because the plain loop's call to
//! `LockTable::lock_with` is not inlined (its times agree within 4%). That
//! is the inliner's choice at a call site inside keylock's own code, not a
//! layer of the harness; `#[inline]` on `lock_with` would settle it.

use std::future::{poll_fn, Future};
use std::hint::black_box;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tokio::runtime::Runtime;

use super::impls::KeyedLock;

/// Tasks of the contended workloads (W3, W4, W5, W6).
pub(crate) const TASKS: usize = 64;
/// Distinct keys of W4.
pub(crate) const ZIPF_KEYS: usize = 1024;
/// Zipf exponent of W4.
pub(crate) const ZIPF_S: f64 = 1.0;
/// Waiters each W5 task registers before cancelling them all.
pub(crate) const W5_BATCH: usize = 16;

/// The key of the single-key workloads.
pub(crate) const HOT: u64 = 0x5EED;

/// The odd multiplier of [`scramble`].
const SCRAMBLE: u64 = 0x9E37_79B9_7F4A_7C15;

/// Spreads small integers over `u64` (a bijection, so distinct stays distinct).
#[inline]
pub(crate) fn scramble(i: u64) -> u64 {
    i.wrapping_mul(SCRAMBLE)
}

/// The inverse of [`scramble`]'s multiplier modulo 2^64 (Newton's iteration:
/// each step doubles the correct low bits, from 3 to more than 64).
const UNSCRAMBLE: u64 = {
    let mut x = SCRAMBLE;
    let mut i = 0;
    while i < 5 {
        x = x.wrapping_mul(2u64.wrapping_sub(SCRAMBLE.wrapping_mul(x)));
        i += 1;
    }
    assert!(SCRAMBLE.wrapping_mul(x) == 1);
    x
};

/// The integer [`scramble`] spread: W4 finds a key's slot with it.
#[inline]
pub(crate) fn unscramble(key: u64) -> u64 {
    key.wrapping_mul(UNSCRAMBLE)
}

/// The workloads, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Workload {
    W1,
    W2,
    W3,
    W4,
    W5,
    W6,
}

impl Workload {
    pub(crate) const ALL: [Workload; 6] =
        [Self::W1, Self::W2, Self::W3, Self::W4, Self::W5, Self::W6];

    pub(crate) fn id(self) -> &'static str {
        match self {
            Self::W1 => "W1",
            Self::W2 => "W2",
            Self::W3 => "W3",
            Self::W4 => "W4",
            Self::W5 => "W5",
            Self::W6 => "W6",
        }
    }

    /// The criterion group name.
    pub(crate) fn group(self) -> &'static str {
        match self {
            Self::W1 => "w1_hot_key_uncontended",
            Self::W2 => "w2_distinct_keys",
            Self::W3 => "w3_handoff_64_tasks_1_key",
            Self::W4 => "w4_zipf_64_tasks_1024_keys",
            Self::W5 => "w5_cancellation_storm",
            Self::W6 => "w6_counter_64_tasks_1_key",
        }
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::W1 => "one task, one key: lock+unlock loop",
            Self::W2 => "one task, every key distinct, each locked once",
            Self::W3 => "64 tasks, one key, guard held across a yield: every acquisition a handoff",
            Self::W4 => "64 tasks, 1,024 keys Zipf(s=1), guard held across a yield",
            Self::W5 => "64 tasks register 16 waiters each on a held key, yield, then drop them",
            Self::W6 => "64 tasks, one key, only a counter increment under the lock (no yield)",
        }
    }

    /// Whether an implementation that cannot hold a guard across `.await`
    /// can run it. (W6 never holds a guard across an `.await`: the
    /// synchronous floor runs it, blocking a worker while it waits.)
    pub(crate) fn needs_async(self) -> bool {
        matches!(self, Self::W3 | Self::W4 | Self::W5)
    }

    /// Whether it counts handoffs: every contended workload that acquires
    /// (W5 acquires nothing: its key is held throughout and every wait is
    /// cancelled).
    pub(crate) fn counts_handoffs(self) -> bool {
        matches!(self, Self::W3 | Self::W4 | Self::W6)
    }
}

/// What one run measured.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Outcome {
    pub(crate) elapsed: Duration,
    /// Operations timed: acquisitions (W1-W4, W6) or cancelled waits (W5).
    pub(crate) ops: u64,
    /// Entries the implementation still keeps once everything is released.
    pub(crate) entries_left: Option<usize>,
    /// Acquisitions that went to a different task than the previous holder
    /// of the same key (W3, W4, W6): the handoffs. For a strict FIFO lock an
    /// acquisition that is not one means nobody was queued when the holder
    /// released (W6: the other worker was not contending); a barging lock
    /// lets the releaser take the key back while others wait, so its share
    /// says how often the key changed hands at all.
    pub(crate) handoffs: Option<u64>,
}

impl Outcome {
    pub(crate) fn ns_per_op(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.ops.max(1) as f64
    }
}

/// The tokio runtime W1-W6 run on: multi-thread, two workers, and no I/O
/// or time driver, as in the floor's harness (which makes no `epoll` call).
/// None of these workloads uses either driver, and with the I/O driver a
/// parked worker waits in `epoll_wait` and is woken through an event fd:
/// every implementation's contended time grows, and the anchors stop
/// agreeing with the floor's (W6's tokio::Mutex ran 1.20-1.31x the floor's
/// in three runs with the drivers, 1.08-1.17x without).
pub(crate) fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("tokio runtime")
}

/// As [`runtime`], with tokio's drivers: for what uses tokio's time (the
/// bank bounds each run with `tokio::time::timeout` and its tables keep
/// time on tokio's clock, as a tokio program's would; the showcase's story
/// sleeps).
pub(crate) fn runtime_with_drivers() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Runs `workload` for about `ops` operations; `None` if `I` cannot run it.
pub(crate) fn run<I: KeyedLock>(
    rt: &Runtime,
    workload: Workload,
    ops: u64,
    zipf: &Arc<Vec<Vec<u64>>>,
) -> Option<Outcome> {
    if workload.needs_async() && !I::ASYNC {
        return None;
    }
    if !I::EXCLUSIVE && !matches!(workload, Workload::W1 | Workload::W2) {
        return None;
    }
    Some(match workload {
        Workload::W1 => w1_hot_key::<I>(rt, ops),
        Workload::W2 => w2_distinct_keys::<I>(rt, ops),
        Workload::W3 => w3_handoff::<I>(rt, ops),
        Workload::W4 => w4_zipf::<I>(rt, ops, zipf),
        Workload::W5 => w5_cancel_storm::<I>(rt, ops),
        Workload::W6 => w6_counter::<I>(rt, ops),
    })
}

/// Spawns `fut` on a worker and waits for it.
pub(crate) fn on_worker<T: Send + 'static>(
    rt: &Runtime,
    fut: impl Future<Output = T> + Send + 'static,
) -> T {
    rt.block_on(rt.spawn(fut)).expect("workload task panicked")
}

/// Checks that `I` leaves no entry behind in the case that is easiest to get
/// wrong: a waiter cancelled after the key was released to it (or, for
/// barging locks, after the holder left). Returns the entries left.
pub(crate) fn self_check<I: KeyedLock>(rt: &Runtime) -> Option<usize> {
    if !I::ASYNC || !I::EXCLUSIVE {
        // Nothing to wait on: a second shared lock is granted at once.
        return I::create().entries();
    }
    rt.block_on(async {
        let table = I::create();
        let held = table.lock(HOT).await;
        let mut waiter = Box::pin(table.lock(HOT));
        assert!(futures::poll!(&mut waiter).is_pending());
        drop(held);
        drop(waiter);
        table.entries()
    })
}

/// W1: one task locks and unlocks one key `iters` times.
///
/// The key goes through `black_box` so that keylock cannot hash a constant
/// at compile time (a real key is not one); the anchors ignore it. The
/// guard does not: dropping it unlocks, which the optimizer cannot remove.
/// `compare/plain.rs` is the same loop written without the trait. The
/// synchronous floor locks with `lock_sync`, in a loop without `.await`, as
/// its plain loop does (see [`KeyedLock::lock_sync`]).
pub(crate) fn w1_hot_key<I: KeyedLock>(rt: &Runtime, iters: u64) -> Outcome {
    let table = Arc::new(I::create());
    let t = Arc::clone(&table);
    let elapsed = if I::ASYNC {
        on_worker(rt, async move {
            let start = Instant::now();
            for _ in 0..iters {
                let guard = t.lock(black_box(HOT)).await;
                drop(guard);
            }
            start.elapsed()
        })
    } else {
        on_worker(rt, async move {
            let start = Instant::now();
            for _ in 0..iters {
                let guard = t.lock_sync(black_box(HOT));
                drop(guard);
            }
            start.elapsed()
        })
    };
    Outcome {
        elapsed,
        ops: iters,
        entries_left: table.entries(),
        handoffs: None,
    }
}

/// W2: one task locks `keys` distinct keys, each once.
pub(crate) fn w2_distinct_keys<I: KeyedLock>(rt: &Runtime, keys: u64) -> Outcome {
    let table = Arc::new(I::create());
    let t = Arc::clone(&table);
    let elapsed = if I::ASYNC {
        on_worker(rt, async move {
            let start = Instant::now();
            for i in 0..keys {
                let guard = t.lock(scramble(i)).await;
                drop(guard);
            }
            start.elapsed()
        })
    } else {
        // As in W1: the synchronous floor without `.await`.
        on_worker(rt, async move {
            let start = Instant::now();
            for i in 0..keys {
                let guard = t.lock_sync(scramble(i));
                drop(guard);
            }
            start.elapsed()
        })
    };
    let entries_left = table.entries();
    // Dropping a table that leaked a million entries is not part of the run.
    drop(table);
    Outcome {
        elapsed,
        ops: keys,
        entries_left,
        handoffs: None,
    }
}

/// W3: `TASKS` tasks take one key in turn, each holding it across a
/// `yield_now`, so that every other task has queued behind it by the time it
/// releases: for a FIFO lock every acquisition is a handoff. Counts the
/// acquisitions that went to another task than the previous holder.
pub(crate) fn w3_handoff<I: KeyedLock>(rt: &Runtime, total: u64) -> Outcome {
    let per_task = total.div_ceil(TASKS as u64).max(1);
    let table = Arc::new(I::create());
    let last = Arc::new(AtomicUsize::new(usize::MAX));
    let start = Instant::now();
    let handles: Vec<_> = (0..TASKS)
        .map(|id| {
            let t = Arc::clone(&table);
            let last = Arc::clone(&last);
            rt.spawn(async move {
                let mut handoffs = 0u64;
                for _ in 0..per_task {
                    let guard = t.lock(HOT).await;
                    if last.swap(id, Relaxed) != id {
                        handoffs += 1;
                    }
                    tokio::task::yield_now().await;
                    drop(guard);
                }
                handoffs
            })
        })
        .collect();
    let handoffs: u64 = rt.block_on(async {
        let mut sum = 0;
        for h in handles {
            sum += h.await.expect("W3 task panicked");
        }
        sum
    });
    let elapsed = start.elapsed();
    Outcome {
        elapsed,
        ops: per_task * TASKS as u64,
        entries_left: table.entries(),
        handoffs: Some(handoffs),
    }
}

/// The Zipf(`ZIPF_S`) key sequences of W4: one per task, `per_task` keys
/// each, over `ZIPF_KEYS` keys, drawn by inverse CDF from a fixed seed.
pub(crate) fn zipf_sequences(per_task: usize) -> Arc<Vec<Vec<u64>>> {
    let mut cdf: Vec<f64> = (1..=ZIPF_KEYS)
        .map(|rank| 1.0 / (rank as f64).powf(ZIPF_S))
        .collect();
    let mut acc = 0.0;
    for w in &mut cdf {
        acc += *w;
        *w = acc;
    }
    for w in &mut cdf {
        *w /= acc;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x2151_F00D);
    Arc::new(
        (0..TASKS)
            .map(|_| {
                (0..per_task)
                    .map(|_| {
                        let u: f64 = rng.gen();
                        let rank = cdf.partition_point(|&c| c < u).min(ZIPF_KEYS - 1);
                        scramble(rank as u64)
                    })
                    .collect()
            })
            .collect(),
    )
}

/// The last holder of one W4 key, alone on its cache line: it is read and
/// written only under that key's lock, by the task that holds it, so it moves
/// between cores with the key's lock and only then. A key's first
/// acquisition counts as a handoff, as in W3 and W6.
#[repr(align(128))]
struct LastHolder(AtomicUsize);

/// W4: `TASKS` tasks each walk their Zipf key sequence (cycling it if `total`
/// asks for more), holding each key across a `yield_now`. Counts the
/// acquisitions that went to another task than the key's previous holder.
pub(crate) fn w4_zipf<I: KeyedLock>(
    rt: &Runtime,
    total: u64,
    zipf: &Arc<Vec<Vec<u64>>>,
) -> Outcome {
    assert_eq!(zipf.len(), TASKS);
    let per_task = total.div_ceil(TASKS as u64).max(1);
    let table = Arc::new(I::create());
    let last: Arc<Vec<LastHolder>> = Arc::new(
        (0..ZIPF_KEYS)
            .map(|_| LastHolder(AtomicUsize::new(usize::MAX)))
            .collect(),
    );
    let start = Instant::now();
    let handles: Vec<_> = (0..TASKS)
        .map(|id| {
            let t = Arc::clone(&table);
            let zipf = Arc::clone(zipf);
            let last = Arc::clone(&last);
            rt.spawn(async move {
                let keys = &zipf[id];
                let mut handoffs = 0u64;
                for &key in keys.iter().cycle().take(per_task as usize) {
                    let guard = t.lock(key).await;
                    let holder = &last[unscramble(key) as usize].0;
                    if holder.load(Relaxed) != id {
                        holder.store(id, Relaxed);
                        handoffs += 1;
                    }
                    tokio::task::yield_now().await;
                    drop(guard);
                }
                handoffs
            })
        })
        .collect();
    let handoffs: u64 = rt.block_on(async {
        let mut sum = 0;
        for h in handles {
            sum += h.await.expect("W4 task panicked");
        }
        sum
    });
    let elapsed = start.elapsed();
    Outcome {
        elapsed,
        ops: per_task * TASKS as u64,
        entries_left: table.entries(),
        handoffs: Some(handoffs),
    }
}

/// W5: the key is held throughout; `TASKS` tasks, round after round, each
/// create `W5_BATCH` lock futures for it, poll each once (so it registers as
/// a waiter), yield (so that all tasks' waiters are queued together, up to
/// `TASKS * W5_BATCH` deep), then drop them all. Reports time per cancelled
/// wait, creation and registration included.
pub(crate) fn w5_cancel_storm<I: KeyedLock>(rt: &Runtime, total: u64) -> Outcome {
    let per_round = (TASKS * W5_BATCH) as u64;
    let rounds = total.div_ceil(per_round).max(1);
    let table = Arc::new(I::create());
    let elapsed = rt.block_on(async {
        let held = table.lock(HOT).await;
        let start = Instant::now();
        let handles: Vec<_> = (0..TASKS)
            .map(|_| {
                let t = Arc::clone(&table);
                tokio::spawn(async move {
                    for _ in 0..rounds {
                        register_then_cancel(&*t).await;
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.expect("W5 task panicked");
        }
        let elapsed = start.elapsed();
        drop(held);
        elapsed
    });
    Outcome {
        elapsed,
        ops: rounds * per_round,
        entries_left: table.entries(),
        handoffs: None,
    }
}

/// One W5 round of one task.
async fn register_then_cancel<I: KeyedLock>(t: &I) {
    let waiters: [_; W5_BATCH] = std::array::from_fn(|_| t.lock(HOT));
    let mut waiters = pin!(waiters);
    poll_fn(|cx| {
        for i in 0..W5_BATCH {
            // SAFETY: the array is pinned, so each element is pinned too
            // (structural pinning); no element is ever moved out of it.
            let waiter = unsafe { waiters.as_mut().map_unchecked_mut(|a| &mut a[i]) };
            assert!(
                waiter.poll(cx).is_pending(),
                "W5: the key is held, a waiter cannot be granted"
            );
        }
        Poll::Ready(())
    })
    .await;
    tokio::task::yield_now().await;
    // The array drops here, at the end of the round: every waiter is
    // cancelled, oldest first.
}

/// What W6's critical section touches: a counter and the id of the last
/// holder, on their own cache line, read and written with plain (`Relaxed`)
/// loads and stores, never a read-modify-write: the lock is the only thing
/// that orders them, so a lost increment would show a broken exclusion.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct W6State {
    pub(crate) count: AtomicU64,
    pub(crate) last: AtomicUsize,
}

/// W6's run around one acquisition: `TASKS` tasks, started together
/// behind a barrier, each take the key `$lock` names (`$t`: the table, in
/// the task) in turn; the critical section is a counter increment and
/// nothing else (no `.await` while holding). Evaluates to the time, the
/// acquisitions, the handoffs and the table. Shared by the harness's W6
/// and the plain loops of keylock's options (`compare/plain.rs`), so the
/// two run the same tasks around their different lock calls.
macro_rules! w6_tasks {
    ($rt:expr, $total:expr, $name:expr, $table:expr, |$t:ident| $lock:expr) => {{
        let per_task = ($total).div_ceil(crate::workloads::TASKS as u64).max(1);
        let table = std::sync::Arc::new($table);
        let state = std::sync::Arc::new(crate::workloads::W6State::default());
        // All tasks start together, so that both workers contend from the
        // first acquisition: otherwise a lock that never yields to the
        // scheduler can let one worker run task after task uncontended
        // while the other is still idle, and W6 measures no handoff at all.
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(crate::workloads::TASKS));
        let start = std::time::Instant::now();
        let handles: Vec<_> = (0..crate::workloads::TASKS)
            .map(|id| {
                let table = std::sync::Arc::clone(&table);
                let state = std::sync::Arc::clone(&state);
                let barrier = std::sync::Arc::clone(&barrier);
                $rt.spawn(async move {
                    barrier.wait().await;
                    let mut handoffs = 0u64;
                    for _ in 0..per_task {
                        let $t = &*table;
                        let guard = $lock;
                        let n = state.count.load(std::sync::atomic::Ordering::Relaxed);
                        state
                            .count
                            .store(n + 1, std::sync::atomic::Ordering::Relaxed);
                        if state.last.load(std::sync::atomic::Ordering::Relaxed) != id {
                            state.last.store(id, std::sync::atomic::Ordering::Relaxed);
                            handoffs += 1;
                        }
                        drop(guard);
                    }
                    handoffs
                })
            })
            .collect();
        let handoffs: u64 = $rt.block_on(async {
            let mut sum = 0;
            for h in handles {
                sum += h.await.expect("W6 task panicked");
            }
            sum
        });
        let elapsed = start.elapsed();
        let ops = per_task * crate::workloads::TASKS as u64;
        assert_eq!(
            state.count.load(std::sync::atomic::Ordering::Relaxed),
            ops,
            "W6 ({}): increments lost under the lock, exclusion broken",
            $name
        );
        (elapsed, ops, handoffs, table)
    }};
}
// Used by `compare/plain.rs`, which the criterion bench
// (`benches/compare.rs`) does not include.
#[allow(unused_imports)]
pub(crate) use w6_tasks;

/// W6 (see [`w6_tasks`]). Whether an acquisition is a handoff depends on
/// the lock and on scheduling: a task that releases and locks again while
/// nobody waits keeps the key; a fair lock with a queued waiter hands it
/// over. Counts the acquisitions that went to another task than the
/// previous holder, and checks that the counter saw every acquisition.
pub(crate) fn w6_counter<I: KeyedLock>(rt: &Runtime, total: u64) -> Outcome {
    let (elapsed, ops, handoffs, table) =
        w6_tasks!(rt, total, I::NAME, I::create(), |t| t.lock(HOT).await);
    Outcome {
        elapsed,
        ops,
        entries_left: table.entries(),
        handoffs: Some(handoffs),
    }
}
