//! The uncontended fast path, alone, for instruction counting:
//!
//! ```text
//! cargo build --profile bench --example uncontended
//! valgrind --tool=callgrind target/release/examples/uncontended 1000000 try
//! valgrind --tool=callgrind target/release/examples/uncontended 0 try   # baseline
//! ```
//!
//! `(Ir(N) - Ir(0)) / N` is the instruction count of one lock + unlock.
//! Modes: `try` (`try_lock` + drop, the default) and `lock` (`lock(k)` polled
//! once with a no-op waker + drop: the async path without a runtime); for
//! reference, `tokio` (`tokio::sync::Mutex::try_lock` + drop) and `std`
//! (`std::sync::Mutex::lock` + drop, the lock each shard is behind).

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .map_or(1_000_000, |s| s.parse().expect("N: a count"));
    let mode = args.next().unwrap_or_else(|| "try".to_string());

    let table = keylock::LockTable::<u64>::new();
    match mode.as_str() {
        "try" => {
            for _ in 0..n {
                let guard = table.try_lock(black_box(7)).expect("uncontended");
                drop(black_box(guard));
            }
        }
        "lease" => {
            let opts = keylock::LockOptions::new().lease(std::time::Duration::from_secs(3600));
            for _ in 0..n {
                let guard = table
                    .try_lock_with(black_box(7), opts)
                    .expect("uncontended");
                drop(black_box(guard));
            }
        }
        "lock" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let fut = pin!(table.lock(black_box(7)));
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                drop(black_box(guard));
            }
        }
        // Reference points, not keylock: one async mutex and the bare
        // futex mutex the shards use.
        "tokio" => {
            let mutex = tokio::sync::Mutex::new(());
            for _ in 0..n {
                let guard = black_box(&mutex).try_lock().expect("uncontended");
                drop(black_box(guard));
            }
        }
        "std" => {
            let mutex = std::sync::Mutex::new(());
            for _ in 0..n {
                let guard = black_box(&mutex).lock().expect("uncontended");
                drop(black_box(guard));
            }
        }
        other => panic!("unknown mode {other:?}: try | lock | tokio | std"),
    }
    assert!(table.is_empty());
    println!("{mode}: {n} lock+unlock, {:?}", table.stats());
}
