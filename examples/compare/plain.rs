//! W1 written as plain loops, one per implementation, with its own types and
//! no [`KeyedLock`](super::impls::KeyedLock) trait in between: what anyone
//! timing one of these locks by hand would write. `compare` runs them next to
//! the harness's W1 to check that the harness charges no implementation more
//! (or less) than its plain loop costs.
//!
//! W6 is written the same way for keylock and its options
//! (`lock_with(..).await` and the `Result` unwrapped where it is awaited): an
//! option's cost on W6, like on W1, is read off these loops, not off the
//! harness's trait wrapper, which adds a layer of future around an option's
//! call that no user writes. They run W6's own tasks ([`w6_tasks`]), so the
//! handoff share is counted the same way.
//!
//! Like the harness, each loop runs in a spawned task on the two-worker
//! runtime, times only the loop, and passes the key through `black_box` (the
//! non-keyed locks ignore it). The lock is a local of the task.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use super::impls::LONG_LEASE;
use super::workloads::{on_worker, w6_tasks, Outcome, HOT};

/// Times `$iters` runs of `$body` (one lock+unlock of `$key` on `$lock`) in
/// a task on a worker.
macro_rules! plain_loop {
    ($rt:expr, $iters:expr, $make:expr, |$lock:ident, $key:ident| $body:block) => {{
        let iters: u64 = $iters;
        on_worker($rt, async move {
            let $lock = $make;
            let start = Instant::now();
            for _ in 0..iters {
                let $key = black_box(HOT);
                $body
            }
            start.elapsed()
        })
    }};
}

pub(crate) fn keylock(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, keylock::LockTable::<u64>::new(), |t, k| {
        let guard = t.lock(k).await;
        drop(guard);
    })
}

pub(crate) fn keylock_lease(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, keylock::LockTable::<u64>::new(), |t, k| {
        let opts = keylock::LockOptions::new().lease(LONG_LEASE);
        let guard = t.lock_with(k, opts).await.expect("valid lease");
        drop(guard);
    })
}

pub(crate) fn keylock_timeout(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, keylock::LockTable::<u64>::new(), |t, k| {
        let opts = keylock::LockOptions::new().timeout(LONG_LEASE);
        let guard = t.lock_with(k, opts).await.expect("uncontended");
        drop(guard);
    })
}

/// One read of the clock a long lease starts from (the kernel's coarse
/// monotonic clock on Linux; `Instant::now` elsewhere) per iteration, in
/// the same loop: the least a lease judged on the monotonic clock when it
/// is asked adds to a lock.
pub(crate) fn clock_read(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, (), |_unit, _k| {
        black_box(coarse_now());
    })
}

#[cfg(target_os = "linux")]
fn coarse_now() -> libc::timespec {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and the clock id exists on
    // every Linux since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts
}

#[cfg(not(target_os = "linux"))]
fn coarse_now() -> Instant {
    Instant::now()
}

pub(crate) fn keylock_shared(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, keylock::LockTable::<u64>::new(), |t, k| {
        let guard = t.lock_shared(k).await;
        drop(guard);
    })
}

type Map = dashmap::DashMap<u64, Arc<tokio::sync::Mutex<()>>>;

pub(crate) fn dashmap_leak(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, Map::new(), |m, k| {
        let mutex = Arc::clone(&m.entry(k).or_default());
        let guard = mutex.lock_owned().await;
        drop(guard);
    })
}

pub(crate) fn dashmap_cleanup(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, Map::new(), |m, k| {
        let mutex = Arc::clone(&m.entry(k).or_default());
        let guard = mutex.lock_owned().await;
        drop(guard);
        m.remove_if(&k, |_, m| Arc::strong_count(m) == 1);
    })
}

pub(crate) fn lockable(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, lockable::LockPool::<u64>::new(), |p, k| {
        let guard = p.async_lock(k).await;
        drop(guard);
    })
}

pub(crate) fn tokio_mutex(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, tokio::sync::Mutex::new(()), |m, _k| {
        let guard = m.lock().await;
        drop(guard);
    })
}

pub(crate) fn async_lock_mutex(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, async_lock::Mutex::new(()), |m, _k| {
        let guard = m.lock().await;
        drop(guard);
    })
}

pub(crate) fn futures_mutex(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, futures::lock::Mutex::new(()), |m, _k| {
        let guard = m.lock().await;
        drop(guard);
    })
}

pub(crate) fn parking_lot_mutex(rt: &Runtime, iters: u64) -> Duration {
    plain_loop!(rt, iters, parking_lot::Mutex::new(()), |m, _k| {
        let guard = m.lock();
        drop(guard);
    })
}

/// W6 on a plain keylock table, `lock_with(HOT, opts)` awaited in each
/// task (`opts` none: `lock(HOT)`).
fn keylock_w6_with(rt: &Runtime, total: u64, opts: Option<keylock::LockOptions>) -> Outcome {
    let (elapsed, ops, handoffs, table) = match opts {
        None => w6_tasks!(
            rt,
            total,
            "keylock",
            keylock::LockTable::<u64>::new(),
            |t| t.lock(HOT).await
        ),
        Some(opts) => w6_tasks!(
            rt,
            total,
            "keylock",
            keylock::LockTable::<u64>::new(),
            |t| t
                .lock_with(HOT, opts)
                .await
                .expect("a long lease and timeout, granted in time")
        ),
    };
    Outcome {
        elapsed,
        ops,
        entries_left: Some(table.len()),
        handoffs: Some(handoffs),
    }
}

pub(crate) fn keylock_w6(rt: &Runtime, total: u64) -> Outcome {
    keylock_w6_with(rt, total, None)
}

pub(crate) fn keylock_lease_w6(rt: &Runtime, total: u64) -> Outcome {
    keylock_w6_with(
        rt,
        total,
        Some(keylock::LockOptions::new().lease(LONG_LEASE)),
    )
}

pub(crate) fn keylock_timeout_w6(rt: &Runtime, total: u64) -> Outcome {
    keylock_w6_with(
        rt,
        total,
        Some(keylock::LockOptions::new().timeout(LONG_LEASE)),
    )
}
