//! The clock seam: where the table reads the time.
//!
//! Users get the monotonic clock ([`std::time::Instant`]); a wall-clock step
//! can therefore never extend a lease. Under the `test-util` feature a
//! [`ManualClock`] moves only when told to, so tests, loom models and the fuzz
//! harness drive leases and timeouts by hand.

use std::time::{Duration, Instant};

#[cfg(feature = "test-util")]
pub use manual::ManualClock;

/// Which clock a table reads.
#[derive(Debug, Clone, Default)]
pub(crate) enum Clock {
    /// `Instant::now()`, and the crate's timer thread.
    #[default]
    Monotonic,
    /// tokio's clock (`tokio::time::Instant`, paused time included) and
    /// timer.
    #[cfg(feature = "tokio")]
    Tokio,
    /// The application's own.
    Custom(std::sync::Arc<dyn crate::time::time_source::TimeSource>),
    /// Time that moves by hand.
    #[cfg(feature = "test-util")]
    Manual(ManualClock),
}

/// Leases at least this long start from the coarse clock (see
/// [`Clock::grant_stamp`]); shorter ones from the precise clock.
pub(crate) const COARSE_LEASE: Duration = Duration::from_secs(10);
#[allow(clippy::cast_possible_truncation)] // ten seconds fit
const COARSE_LEASE_NANOS: u64 = COARSE_LEASE.as_nanos() as u64;

/// A deadline further than this past the coarse clock's reading is surely
/// still ahead of the precise clock: the coarse clock is the precise one as
/// of the last kernel tick, a few milliseconds behind (measured up to 16 ms
/// on a loaded machine), never a second.
const COARSE_SLACK: u64 = 1_000_000_000;

impl Clock {
    /// The time a grant with a lease of `lease` starts from, as a stamp.
    ///
    /// For a long lease, the kernel's coarse monotonic clock: a few times
    /// cheaper to read than the precise one, and never ahead of it (it is the
    /// same clock, read at the last tick), so a deadline computed from it can
    /// only come out *earlier*, by how far the coarse clock lags: a lease is
    /// never extended, at most shortened by a few milliseconds (measured up
    /// to 16 ms on a loaded 2-core machine: 0.16% of the shortest lease that
    /// starts from it). Authority is always judged against the precise
    /// clock.
    #[inline]
    pub(crate) fn grant_stamp(&self, lease_nanos: u64) -> Stamp {
        match self {
            Self::Monotonic if lease_nanos >= COARSE_LEASE_NANOS => coarse::stamp(),
            _ => Stamp::new(Some(self.now())),
        }
    }

    #[inline]
    pub(crate) fn now(&self) -> Instant {
        match self {
            Self::Monotonic => Instant::now(),
            #[cfg(feature = "tokio")]
            Self::Tokio => tokio::time::Instant::now().into_std(),
            Self::Custom(source) => source.now(),
            #[cfg(feature = "test-util")]
            Self::Manual(clock) => clock.read(),
        }
    }

    /// When a wait without a timeout begins, for the status view: the
    /// coarse clock's reading on the real clock (a cheap read), none on the
    /// others (a wait without a timeout reads no other clock).
    #[inline]
    pub(crate) fn wait_stamp(&self) -> Stamp {
        match self {
            Self::Monotonic => coarse::stamp(),
            #[allow(unreachable_patterns)]
            _ => Stamp::NONE,
        }
    }

    /// Whether waiters are woken at their deadlines by their shard's timer
    /// (the real clock) rather than each by its own.
    #[inline(always)]
    pub(crate) fn uses_shard_timers(&self) -> bool {
        match self {
            Self::Monotonic => true,
            #[cfg(feature = "test-util")]
            Self::Manual(clock) => clock.uses_shard_timers(),
            _ => false,
        }
    }

    /// Whether a shard timer armed for an instant already past fires as
    /// soon as the shard is unlocked: the real clock's timer thread does; a
    /// manual clock fires only inside `advance`, so a due timer there waits
    /// for the next one.
    #[inline(always)]
    pub(crate) fn fires_due_timers_at_once(&self) -> bool {
        matches!(self, Self::Monotonic)
    }

    /// Whether the table's futures take part in tokio's cooperative budget.
    #[inline(always)]
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn is_tokio(&self) -> bool {
        #[cfg(feature = "tokio")]
        if let Self::Tokio = self {
            return true;
        }
        false
    }

    /// Whether the running task has spent its tokio cooperative budget
    /// (under a tokio clock; `false` under any other, and outside a tokio
    /// runtime): a lock future polled now would return `Pending` before it
    /// touches the table.
    #[inline]
    pub(crate) fn budget_spent(&self) -> bool {
        #[cfg(feature = "tokio")]
        if self.is_tokio() {
            return !tokio::task::coop::has_budget_remaining();
        }
        false
    }
}

/// An optional instant in one word, for the table's per-key state: 1 plus the
/// nanoseconds after a process-wide epoch, or 0 for none.
///
/// The epoch lies a century before the first stamp is taken (where the
/// platform can represent that; otherwise at that moment), so every instant
/// a table meets is after it. An instant more than 584 years after the epoch
/// is stored as none: for a deadline that means "never", as a deadline too
/// far to represent as an `Instant` already does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub(crate) struct Stamp(u64);

// `Stamp::pack_with` computes the bit from the discriminants.
const _: () = assert!(
    crate::support::mode::Mode::Shared as u64 == 0
        && crate::support::mode::Mode::Exclusive as u64 == 1
);

impl Stamp {
    pub(crate) const NONE: Self = Self(0);

    /// This deadline and a grant's `mode` in one word: the mode in the top
    /// bit (set: shared), which a stamp (nanoseconds since the process's
    /// clock epoch) reaches only after 292 years; the deadline in the rest.
    /// What a guard keeps, and what a waiter's grant is published as.
    #[inline(always)]
    pub(crate) fn pack_with(self, mode: crate::support::mode::Mode) -> u64 {
        // Branch-free: `Shared` is 0 and `Exclusive` 1.
        let bit = ((mode as u64) ^ 1) << 63;
        (self.0 & !Self::SHARED_BIT) | bit
    }

    /// The top bit of [`pack_with`](Self::pack_with)'s word: shared.
    pub(crate) const SHARED_BIT: u64 = 1 << 63;

    /// The deadline and mode [`pack_with`](Self::pack_with) packed.
    #[inline(always)]
    pub(crate) fn unpack(packed: u64) -> (Self, crate::support::mode::Mode) {
        let mode = if packed & Self::SHARED_BIT == 0 {
            crate::support::mode::Mode::Exclusive
        } else {
            crate::support::mode::Mode::Shared
        };
        (Self(packed & !Self::SHARED_BIT), mode)
    }

    fn epoch() -> Instant {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *EPOCH.get_or_init(|| {
            let now = Instant::now();
            now.checked_sub(Duration::from_secs(100 * 365 * 24 * 3600))
                .unwrap_or(now)
        })
    }

    #[inline]
    pub(crate) fn new(at: Option<Instant>) -> Self {
        let Some(at) = at else { return Self::NONE };
        let nanos = at.saturating_duration_since(Self::epoch()).as_nanos();
        match u64::try_from(nanos) {
            Ok(n) if n < u64::MAX - 1 => Self(n + 1),
            _ => Self::NONE,
        }
    }

    #[inline]
    pub(crate) fn get(self) -> Option<Instant> {
        match self.0 {
            0 => None,
            n => Self::epoch().checked_add(Duration::from_nanos(n - 1)),
        }
    }

    #[inline]
    pub(crate) fn is_some(self) -> bool {
        self.0 != 0
    }

    /// This stamp plus `nanos`; none stays none, and an overflow is none
    /// ("too far to represent": never).
    #[inline]
    pub(crate) fn plus_nanos(self, nanos: u64) -> Self {
        match self.0.checked_add(nanos) {
            Some(n) if self.0 != 0 && n < u64::MAX => Self(n),
            _ => Self::NONE,
        }
    }

    /// This stamp plus `d`; none stays none, and an overflow is none ("too
    /// far to represent": never).
    #[inline]
    pub(crate) fn plus(self, d: Duration) -> Self {
        if self.0 == 0 {
            return Self::NONE;
        }
        let nanos = d
            .as_secs()
            .checked_mul(1_000_000_000)
            .and_then(|n| n.checked_add(u64::from(d.subsec_nanos())))
            .and_then(|n| n.checked_add(self.0));
        match nanos {
            Some(n) if n < u64::MAX => Self(n),
            _ => Self::NONE,
        }
    }

    /// The stamp as one word, to keep in an atomic.
    #[inline]
    pub(crate) fn to_raw(self) -> u64 {
        self.0
    }

    #[inline]
    pub(crate) fn from_raw(raw: u64) -> Self {
        Self(raw)
    }
}

/// The current time, read at most once per operation and only if needed.
#[derive(Debug)]
pub(crate) struct Now<'a> {
    clock: &'a Clock,
    at: Option<Instant>,
    /// The coarse clock's reading, if this operation took one (real clock
    /// only): a long lease or timeout starts from it, and a wait is stamped
    /// with it, rather than reading it again.
    coarse: Stamp,
}

impl<'a> Now<'a> {
    pub(crate) fn new(clock: &'a Clock) -> Self {
        Self {
            clock,
            at: None,
            coarse: Stamp::NONE,
        }
    }

    /// The coarse clock's reading this operation took (none: it took none).
    #[inline]
    pub(crate) fn coarse_seen(&self) -> Stamp {
        self.coarse
    }

    /// The clock this reads.
    #[inline]
    pub(crate) fn clock(&self) -> &'a Clock {
        self.clock
    }

    #[inline]
    pub(crate) fn get(&mut self) -> Instant {
        *self.at.get_or_insert_with(|| self.clock.now())
    }

    /// The start of a lease, or of a wait with a timeout, of `lease`: the
    /// time already read by this operation, else [`Clock::grant_stamp`] (so
    /// a timeout of 10 s or more may give up early by the coarse clock's
    /// lag, as such a lease may end early).
    #[inline]
    pub(crate) fn start_for(&mut self, lease: Duration) -> Stamp {
        self.start_for_nanos(
            crate::support::lease::PackedDuration::pack(Some(lease))
                .nanos()
                .unwrap_or(0),
        )
    }

    /// [`start_for`](Self::start_for) a duration in nanoseconds.
    #[inline]
    pub(crate) fn start_for_nanos(&mut self, nanos: u64) -> Stamp {
        match self.at {
            Some(at) => Stamp::new(Some(at)),
            // The coarse reading already taken is what `grant_stamp` would
            // read again (only the real clock takes one).
            None if self.coarse.is_some() && nanos >= COARSE_LEASE_NANOS => self.coarse,
            None => self.clock.grant_stamp(nanos),
        }
    }

    /// [`start_for_nanos`](Self::start_for_nanos) with the real clock's
    /// coarse read made in place, not through [`Clock::grant_stamp`]'s
    /// call: for the contended path's one reading (a wait's timeout, a
    /// handoff's lease), kept apart so that the other callers stay small.
    #[inline(always)]
    pub(crate) fn start_for_nanos_inline(&mut self, nanos: u64) -> Stamp {
        if self.at.is_none()
            && nanos >= COARSE_LEASE_NANOS
            && matches!(self.clock, Clock::Monotonic)
        {
            if !self.coarse.is_some() {
                self.coarse = coarse::stamp();
            }
            return self.coarse;
        }
        self.start_for_nanos(nanos)
    }

    /// Whether `deadline` (some) is still ahead. On the real clock a
    /// deadline more than a second past the coarse clock's reading is
    /// answered from that reading alone; a nearer one reads the precise
    /// clock.
    #[inline(always)]
    pub(crate) fn is_before(&mut self, deadline: Stamp) -> bool {
        if self.at.is_none() && matches!(self.clock, Clock::Monotonic) {
            let stamp = coarse::stamp();
            self.coarse = stamp;
            let coarse = stamp.to_raw();
            if coarse.saturating_add(COARSE_SLACK) < deadline.to_raw() {
                return true;
            }
        }
        deadline.get().is_none_or(|deadline| self.get() < deadline)
    }
}

/// The coarse monotonic clock, as a [`Stamp`].
/// How a clock's timer fires a shard's timer (the real clock's timer
/// thread, or a manual clock's `advance`): `fire(ptr, now, wakers)` locks
/// the shard, collects the wakers of the waiters due at `now` and returns
/// the shard's next deadline (a raw stamp; `u64::MAX`: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShardHook {
    pub(crate) ptr: *const (),
    pub(crate) fire: unsafe fn(*const (), u64, &mut std::vec::Vec<std::task::Waker>) -> u64,
}

// SAFETY: `ptr` is only passed back to `fire`, which reaches the shard under
// its lock (touching no key), and only while the shard's table exists: the
// table cancels its shards' timers before its memory goes, and a fire runs
// under the wheel lock that the cancel takes.
unsafe impl Send for ShardHook {}

#[cfg(target_os = "linux")]
mod coarse {
    use std::sync::OnceLock;
    use std::time::Instant;

    use super::Stamp;

    /// A stamp and a raw `CLOCK_MONOTONIC` reading (nanoseconds) taken just
    /// after it: the raw reading is not earlier than the stamp's instant, so
    /// times mapped through this pair come out no later than the truth.
    static ANCHOR: OnceLock<(u64, u64)> = OnceLock::new();

    #[inline]
    fn read(clock: libc::clockid_t) -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; both clock ids exist on
        // every Linux since 2.6.32, and on failure `ts` stays zero, which maps
        // to the anchor (never later than now).
        unsafe { libc::clock_gettime(clock, &mut ts) };
        // Both clocks count from boot: never negative, and nanoseconds fit
        // in 64 bits for 584 years (plain arithmetic: this is on the path of
        // every wait).
        #[allow(clippy::cast_sign_loss)]
        let (secs, nanos) = (ts.tv_sec as u64, ts.tv_nsec as u64);
        secs.wrapping_mul(1_000_000_000).wrapping_add(nanos)
    }

    /// Now, at the resolution of the kernel tick, never later than
    /// `Instant::now()`: the anchor's stamp plus the coarse clock's advance
    /// since the anchor's raw reading, one subtraction and one addition.
    #[inline]
    pub(crate) fn stamp() -> Stamp {
        let &(base, raw) = ANCHOR.get_or_init(|| {
            let base = Stamp::new(Some(Instant::now())).to_raw();
            (base, read(libc::CLOCK_MONOTONIC))
        });
        // Before the anchor (its tick had not ended): the anchor itself,
        // which is still not later than now.
        let coarse = read(libc::CLOCK_MONOTONIC_COARSE);
        Stamp::from_raw(base.saturating_add(coarse.saturating_sub(raw)))
    }
}

/// Elsewhere: the precise clock.
#[cfg(not(target_os = "linux"))]
mod coarse {
    use super::Stamp;

    #[inline]
    pub(crate) fn stamp() -> Stamp {
        Stamp::new(Some(std::time::Instant::now()))
    }
}

#[cfg(feature = "test-util")]
mod manual {
    use std::sync::atomic::Ordering::{Relaxed, SeqCst};
    use std::sync::Arc;
    use std::task::Waker;
    use std::time::{Duration, Instant};

    use slab::Slab;

    use super::ShardHook;
    use crate::support::loom::{AtomicU64, Mutex};

    /// `elapsed + by`, cut down so that `base + result` is representable.
    fn saturating_elapsed(base: Instant, elapsed: Duration, by: Duration) -> Duration {
        let want = elapsed.saturating_add(by);
        if base.checked_add(want).is_some() {
            return want;
        }
        // Binary search for the largest representable offset in
        // [elapsed, want].
        let (mut lo, mut hi) = (elapsed, want);
        while hi.saturating_sub(lo) > Duration::from_nanos(1) {
            let mid = lo + (hi - lo) / 2;
            if base.checked_add(mid).is_some() {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// A clock that moves only when [`advance`](Self::advance) is called.
    ///
    /// Give it to a table with [`Builder::clock`](crate::Builder::clock); every
    /// lease and timeout of that table is then judged against it, and
    /// advancing it wakes the waiters whose deadline it passed.
    ///
    /// By default each waiter that needs a timer arms its own sleeper
    /// ([`sleepers`](Self::sleepers) counts them). A clock made with
    /// [`with_shard_timers`](Self::with_shard_timers) drives tables the way
    /// the real clock does: each shard keeps one timer for the earliest
    /// deadline of its waiters, and advancing the clock fires the shards due.
    ///
    /// Needs the `test-util` feature.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keylock::{LockOptions, LockTable, ManualClock};
    ///
    /// let clock = ManualClock::new();
    /// let table = LockTable::builder().clock(clock.clone()).build();
    /// let guard = table
    ///     .try_lock_with("k", LockOptions::new().lease(Duration::from_secs(5)))
    ///     .unwrap();
    /// clock.advance(Duration::from_secs(5));
    /// assert!(guard.is_expired());
    /// ```
    #[derive(Clone, Debug)]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub struct ManualClock {
        inner: Arc<Inner>,
    }

    #[derive(Debug)]
    struct Inner {
        base: Instant,
        /// Nanoseconds since `base`, readable without the lock: a table
        /// reads the clock under a shard lock, and a fire takes a shard lock
        /// under this clock's lock.
        elapsed: AtomicU64,
        state: Mutex<State>,
        /// How many times a table read this clock.
        reads: std::sync::atomic::AtomicU64,
        shard_timers: bool,
    }

    #[derive(Debug, Default)]
    struct State {
        elapsed: Duration,
        sleepers: Slab<(Instant, Option<Waker>)>,
        /// Shard timers: the shard's address, how to fire it, and the
        /// deadline it is armed for (a raw stamp; `u64::MAX`: none).
        shards: Vec<(usize, ShardHook, u64)>,
    }

    impl Default for ManualClock {
        fn default() -> Self {
            Self::new()
        }
    }

    impl ManualClock {
        /// A clock standing at an arbitrary instant.
        #[must_use]
        pub fn new() -> Self {
            Self::make(false)
        }

        /// A clock standing at an arbitrary instant whose tables keep one
        /// timer per shard, as tables on the real clock do.
        ///
        /// ```
        /// use std::future::Future;
        /// use std::time::Duration;
        /// use keylock::{LockOptions, LockTable, ManualClock};
        ///
        /// let clock = ManualClock::with_shard_timers();
        /// let table = LockTable::builder().clock(clock.clone()).build();
        /// let _holder = table.try_lock("k").unwrap();
        /// let mut wait = Box::pin(table.lock_with("k", LockOptions::new().timeout(Duration::from_secs(1))));
        /// let waker = futures::task::noop_waker();
        /// let mut cx = std::task::Context::from_waker(&waker);
        /// assert!(wait.as_mut().poll(&mut cx).is_pending());
        /// assert_eq!(clock.armed_shards(), 1);
        /// assert_eq!(clock.sleepers(), 0);
        /// clock.advance(Duration::from_secs(1));
        /// assert!(wait.as_mut().poll(&mut cx).is_ready());
        /// ```
        #[must_use]
        pub fn with_shard_timers() -> Self {
            Self::make(true)
        }

        fn make(shard_timers: bool) -> Self {
            Self {
                inner: Arc::new(Inner {
                    base: Instant::now(),
                    elapsed: AtomicU64::new(0),
                    state: Mutex::new(State::default()),
                    reads: std::sync::atomic::AtomicU64::new(0),
                    shard_timers,
                }),
            }
        }

        /// The clock's current time.
        #[must_use]
        pub fn now(&self) -> Instant {
            self.inner.base + Duration::from_nanos(self.inner.elapsed.load(SeqCst))
        }

        /// How many times a table has read this clock (to show which paths
        /// never do).
        #[must_use]
        pub fn reads(&self) -> u64 {
            self.inner.reads.load(Relaxed)
        }

        /// A read by a table: counted.
        pub(crate) fn read(&self) -> Instant {
            self.inner.reads.fetch_add(1, Relaxed);
            self.now()
        }

        pub(crate) fn uses_shard_timers(&self) -> bool {
            self.inner.shard_timers
        }

        /// Moves the clock forward and wakes every sleeper whose deadline it
        /// reached, and fires every shard timer it reached. Saturates: past
        /// the latest instant the platform can represent, the clock stays
        /// there.
        pub fn advance(&self, by: Duration) {
            let mut wake = Vec::new();
            {
                let mut state = self.inner.state.lock();
                state.elapsed = saturating_elapsed(self.inner.base, state.elapsed, by);
                let nanos = u64::try_from(state.elapsed.as_nanos()).unwrap_or(u64::MAX);
                self.inner.elapsed.store(nanos, SeqCst);
                let now = self.inner.base + state.elapsed;
                for (_, (at, waker)) in state.sleepers.iter_mut() {
                    if *at <= now {
                        wake.extend(waker.take());
                    }
                }
                // Fired under this clock's lock, which `cancel_shard` takes:
                // a table cancels before its shards go.
                let now = super::Stamp::new(Some(now)).to_raw();
                for (_, hook, at) in state.shards.iter_mut() {
                    if *at <= now {
                        // SAFETY: the shard's table is alive: it cancels
                        // its shards' timers (under this lock) when dropped.
                        *at = unsafe { (hook.fire)(hook.ptr, now, &mut wake) };
                    }
                }
            }
            // Every due sleeper is woken even if a waker panics; the first
            // panic is resumed afterwards.
            let mut first = None;
            for waker in wake {
                let woke = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
                if let Err(panic) = woke {
                    first.get_or_insert(panic);
                }
            }
            if let Some(panic) = first {
                std::panic::resume_unwind(panic);
            }
        }

        /// Number of armed timers (sleepers registered and not yet fired).
        #[must_use]
        pub fn sleepers(&self) -> usize {
            let state = self.inner.state.lock();
            state
                .sleepers
                .iter()
                .filter(|(_, (_, w))| w.is_some())
                .count()
        }

        /// Number of shard timers armed for a deadline (clocks made with
        /// [`with_shard_timers`](Self::with_shard_timers)).
        #[must_use]
        pub fn armed_shards(&self) -> usize {
            let state = self.inner.state.lock();
            state
                .shards
                .iter()
                .filter(|(_, _, at)| *at != u64::MAX)
                .count()
        }

        /// Makes sure shard `hook` fires by `at` (a raw stamp).
        pub(crate) fn arm_shard(&self, hook: ShardHook, at: u64) {
            let mut state = self.inner.state.lock();
            let key = hook.ptr as usize;
            match state.shards.iter_mut().find(|(p, _, _)| *p == key) {
                Some((_, _, armed)) => *armed = (*armed).min(at),
                None => state.shards.push((key, hook, at)),
            }
        }

        /// Forgets shard `ptr`'s timer; it is never fired again.
        pub(crate) fn cancel_shard(&self, ptr: *const ()) {
            let mut state = self.inner.state.lock();
            state.shards.retain(|(p, _, _)| *p != ptr as usize);
        }

        /// Registers (or re-registers) sleeper `id` until `at`; `true` if
        /// `at` has already passed.
        pub(crate) fn poll_sleep(
            &self,
            id: &mut Option<usize>,
            at: Instant,
            waker: &Waker,
        ) -> bool {
            // User code (`Waker::clone`, `Waker::drop`) runs outside the
            // clock's lock: a waker may call back into a table that reads
            // this clock.
            let fresh = waker.clone();
            let old = {
                let mut state = self.inner.state.lock();
                let now = self.inner.base + state.elapsed;
                if at <= now {
                    let removed = id.take().map(|i| state.sleepers.remove(i));
                    drop(state);
                    drop(removed);
                    drop(fresh);
                    return true;
                }
                match *id {
                    Some(i) => std::mem::replace(&mut state.sleepers[i], (at, Some(fresh))).1,
                    None => {
                        *id = Some(state.sleepers.insert((at, Some(fresh))));
                        None
                    }
                }
            };
            drop(old);
            false
        }

        pub(crate) fn cancel_sleep(&self, id: usize) {
            let removed = self.inner.state.lock().sleepers.remove(id);
            // Dropped after the clock's lock (user code).
            drop(removed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{coarse, Clock, COARSE_LEASE};

    #[test]
    // Real time in loops of thousands, and `clock_getres`: not for miri.
    #[cfg_attr(miri, ignore)]
    fn coarse_time_is_never_later_than_the_precise_clock() {
        for _ in 0..10_000 {
            let coarse = coarse::stamp().get().unwrap();
            let precise = Instant::now();
            assert!(coarse <= precise, "{coarse:?} > {precise:?}");
        }
    }

    #[test]
    // Real time in loops of thousands, and `clock_getres`: not for miri.
    #[cfg_attr(miri, ignore)]
    fn is_before_answers_as_the_precise_clock_would() {
        let clock = Clock::Monotonic;
        for ahead in [
            Duration::ZERO,
            Duration::from_millis(1),
            Duration::from_secs(2),
            Duration::from_secs(3600),
        ] {
            for _ in 0..1000 {
                let before = Instant::now();
                let deadline = super::Stamp::new(Some(before + ahead));
                let answer = super::Now::new(&clock).is_before(deadline);
                let after = Instant::now();
                if after < before + ahead {
                    assert!(answer, "{ahead:?} ahead, answered passed");
                }
                if ahead.is_zero() {
                    assert!(!answer, "a deadline already reached answered ahead");
                }
            }
        }
    }

    /// The kernel's tick, as the resolution of the coarse clock.
    #[cfg(target_os = "linux")]
    fn tick() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec and the clock id exists
        // on every Linux since 2.6.32.
        let ok = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        assert_eq!(ok, 0, "clock_getres(CLOCK_MONOTONIC_COARSE)");
        Duration::new(
            u64::try_from(ts.tv_sec).unwrap(),
            u32::try_from(ts.tv_nsec).unwrap(),
        )
    }

    /// Elsewhere there is no coarse clock: long leases use the precise one.
    #[cfg(not(target_os = "linux"))]
    fn tick() -> Duration {
        Duration::ZERO
    }

    /// A lease starts no later than its grant (so it never ends after now
    /// plus the lease); a short one starts exactly at the grant on the
    /// precise clock, a long one at the coarse clock's reading then, which is
    /// the precise clock as of the last tick.
    #[test]
    // Real time in loops of thousands, and `clock_getres`: not for miri.
    #[cfg_attr(miri, ignore)]
    fn a_lease_never_ends_after_now_plus_lease_nor_starts_before_its_clock() {
        let clock = Clock::Monotonic;
        let tick = tick();
        let leases = [
            Duration::from_millis(10),
            COARSE_LEASE - Duration::from_nanos(1),
            COARSE_LEASE,
            Duration::from_secs(30),
        ];
        // How far behind the precise clock each long lease's start came out.
        let mut behind = Vec::new();
        let began = Instant::now();
        let mut rounds = 0;
        // Many ticks long, so that a start stuck at an old reading, or
        // drifting behind, shows.
        while rounds < 10_000 || began.elapsed() < 50 * tick {
            rounds += 1;
            for lease in leases {
                let coarse_before = coarse::stamp().get().unwrap();
                let before = Instant::now();
                let nanos = u64::try_from(lease.as_nanos()).unwrap();
                let start = clock.grant_stamp(nanos).get().unwrap();
                let after = Instant::now();
                assert!(
                    start <= after,
                    "a {lease:?} lease would start in the future"
                );
                if lease < COARSE_LEASE {
                    assert!(
                        start >= before,
                        "a {lease:?} lease starts {:?} before its grant: not from the \
                         precise clock",
                        before - start
                    );
                } else {
                    assert!(
                        start >= coarse_before,
                        "a {lease:?} lease starts {:?} before the coarse clock read just \
                         before its grant",
                        coarse_before - start
                    );
                    behind.push(before.saturating_duration_since(start));
                }
            }
        }
        // Up to a tick behind, give or take a late tick. Not asserted of every
        // start: a loaded host may process a tick late, leaving the coarse
        // clock behind by more for a while (a virtual machine's timekeeping
        // tick can run a fraction of a tick late throughout). But most starts
        // must be within two: the coarse clock is the precise one as of the
        // last tick, not an older or offset time.
        behind.sort_unstable();
        let quartile = behind[behind.len() / 4];
        assert!(
            quartile <= 2 * tick,
            "three quarters of the long leases started {quartile:?} or more before their \
             grant: more than two ticks ({tick:?} each)"
        );
    }
}
