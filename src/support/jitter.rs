//! Random preemption points for stress tests (feature `jitter`).
//!
//! The shard lock calls [`jitter`] as it locks and after it unlocks. With
//! probability `KEYLOCK_JITTER` in 10,000 (read once; unset or 0: never) the
//! thread then yields, spins a few thousand iterations or sleeps up to
//! 200 µs, so that the schedules a stress test explores include the rare
//! interleavings of a thread preempted around a shard's critical section.
//! Without the feature there is no call at all; under loom neither (loom
//! explores the schedules itself).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Duration;

/// The rate, per 10,000 calls, from `KEYLOCK_JITTER`.
fn rate() -> u64 {
    static RATE: OnceLock<u64> = OnceLock::new();
    *RATE.get_or_init(|| {
        std::env::var("KEYLOCK_JITTER")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// The next number of this thread's xorshift generator, seeded per thread.
fn next() -> u64 {
    static SEEDS: AtomicU64 = AtomicU64::new(0);
    thread_local!(static STATE: Cell<u64> = const { Cell::new(0) });
    STATE.with(|state| {
        let mut x = state.get();
        if x == 0 {
            // splitmix64 of a per-thread counter: distinct, never 0.
            let mut z = SEEDS
                .fetch_add(1, Relaxed)
                .wrapping_add(1)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x = (z ^ (z >> 31)) | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

/// A preemption point: usually nothing; at the configured rate, a yield
/// (half the time), a spin of up to 5,000 iterations (three in eight) or a
/// sleep of up to 200 µs (one in eight).
#[inline]
pub(crate) fn jitter() {
    let rate = rate();
    if rate == 0 {
        return;
    }
    let x = next();
    if x % 10_000 >= rate {
        return;
    }
    match (x >> 20) % 8 {
        0 => std::thread::sleep(Duration::from_micros((x >> 30) % 200)),
        1..=3 => {
            for _ in 0..(x >> 30) % 5_000 {
                std::hint::spin_loop();
            }
        }
        _ => std::thread::yield_now(),
    }
}
