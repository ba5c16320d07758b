//! The contended handoff alone, for profiling: 64 tasks on a two-worker
//! tokio runtime lock one key in a loop, with only a counter increment
//! under the lock (no yield), so that every acquisition is a handoff
//! between tasks running on both workers (the handoff share is printed).
//!
//! ```text
//! cargo build --profile bench --example handoff
//! perf record -g target/release/examples/handoff keylock 2000000
//! target/release/examples/handoff tokio 2000000
//! target/release/examples/handoff keylock 2000000 1   # one worker: no parking
//! target/release/examples/handoff keylock-lease 2000000 # a 30 s lease on every lock
//! target/release/examples/handoff keylock-timeout 2000000
//! target/release/examples/handoff keylock 2000000 2 40  # 40 steps of extra work under the lock
//! ```
//!
//! The fourth argument adds that many steps of busy work (a `black_box`
//! loop, timed alone first and printed) to every critical section: how much
//! the contended time grows per nanosecond of work on the handoff's path.
//!
//! `examples/compare.rs` is the comparison (its W6 is this workload); this
//! binary runs one implementation, so a profile shows only its cost.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

const TASKS: usize = 64;
/// The lease or timeout of the `keylock-lease` and `keylock-timeout` runs.
const LONG: std::time::Duration = std::time::Duration::from_secs(30);

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "keylock".to_string());
    let total: u64 = args
        .next()
        .map_or(1_000_000, |s| s.parse().expect("a count of acquisitions"));
    let workers: usize = args
        .next()
        .map_or(2, |s| s.parse().expect("a count of worker threads"));
    let work: u64 = args
        .next()
        .map_or(0, |s| s.parse().expect("a count of work steps"));
    if work > 0 {
        const ROUNDS: u32 = 1_000_000;
        let start = Instant::now();
        for _ in 0..ROUNDS {
            busy(work);
        }
        println!(
            "extra work under the lock: {work} steps, {:.1} ns alone",
            start.elapsed().as_nanos() as f64 / f64::from(ROUNDS)
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .build()
        .expect("a runtime");
    let per_task = total.div_ceil(TASKS as u64);
    let kind = Kind::from(which.as_str());
    // What the critical section touches, as in `compare`'s W6
    // (`W6State`): the counter and the last holder on one cache line,
    // read and written with plain loads and stores under the lock.
    let state = Arc::new(State {
        count: AtomicU64::new(0),
        last: AtomicUsize::new(usize::MAX),
    });
    let handoffs = Arc::new(AtomicU64::new(0));
    #[cfg(feature = "tokio")]
    let keylock = Arc::new(if kind == Kind::KeylockTokio {
        let _rt = rt.enter();
        keylock::LockTable::<u64>::builder().tokio_time().build()
    } else {
        keylock::LockTable::<u64>::new()
    });
    #[cfg(not(feature = "tokio"))]
    let keylock = Arc::new(keylock::LockTable::<u64>::new());
    let tokio = Arc::new(tokio::sync::Mutex::new(()));
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|id| {
            let (state, handoffs) = (state.clone(), handoffs.clone());
            let (keylock, tokio) = (keylock.clone(), tokio.clone());
            let barrier = Arc::clone(&barrier);
            rt.spawn(async move {
                // All at once, as in `compare`'s W6: otherwise the first
                // tasks may finish before the others start.
                barrier.wait().await;
                let mut mine = 0;
                for _ in 0..per_task {
                    let mut note = || {
                        if work > 0 {
                            busy(work);
                        }
                        let n = state.count.load(Relaxed);
                        state.count.store(n + 1, Relaxed);
                        if state.last.load(Relaxed) != id {
                            state.last.store(id, Relaxed);
                            mine += 1;
                        }
                    };
                    match kind {
                        Kind::Tokio => {
                            let guard = tokio.lock().await;
                            note();
                            drop(guard);
                        }
                        Kind::KeylockLease => {
                            let opts = keylock::LockOptions::new().lease(LONG);
                            let guard = keylock.lock_with(7, opts).await.expect("a valid lease");
                            note();
                            drop(guard);
                        }
                        Kind::KeylockTimeout => {
                            let opts = keylock::LockOptions::new().timeout(LONG);
                            let guard = keylock.lock_with(7, opts).await.expect("in time");
                            note();
                            drop(guard);
                        }
                        Kind::Keylock | Kind::KeylockTokio => {
                            let guard = keylock.lock(7).await;
                            note();
                            drop(guard);
                        }
                    }
                }
                handoffs.fetch_add(mine, Relaxed);
            })
        })
        .collect();
    rt.block_on(async {
        for t in tasks {
            t.await.expect("a task");
        }
    });
    let elapsed = start.elapsed();
    let n = state.count.load(Relaxed);
    println!(
        "{which}: {:.1} ns/acquisition, {n} acquisitions, handoff share {:.1}%",
        elapsed.as_nanos() as f64 / n as f64,
        100.0 * handoffs.load(Relaxed) as f64 / n as f64
    );
}

/// The critical section's shared state (`compare`'s `W6State`).
struct State {
    count: AtomicU64,
    last: AtomicUsize,
}

/// Which lock the tasks take, chosen once from the first argument.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Keylock,
    KeylockTokio,
    KeylockLease,
    KeylockTimeout,
    Tokio,
}

impl From<&str> for Kind {
    fn from(which: &str) -> Self {
        match which {
            "keylock" => Self::Keylock,
            "keylock-tokio" => Self::KeylockTokio,
            "keylock-lease" => Self::KeylockLease,
            "keylock-timeout" => Self::KeylockTimeout,
            "tokio" => Self::Tokio,
            other => panic!(
                "which lock: keylock, keylock-tokio, keylock-lease, keylock-timeout or tokio, not {other:?}"
            ),
        }
    }
}

/// `steps` iterations the compiler cannot remove: the extra work.
#[inline(never)]
fn busy(steps: u64) {
    for i in 0..steps {
        std::hint::black_box(i);
    }
}
