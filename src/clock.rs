//! The clock seam: where the table reads the time.
//!
//! Users get the monotonic clock ([`std::time::Instant`]); a wall-clock step
//! can therefore never extend a lease. Under the `test-util` feature a
//! [`ManualClock`] moves only when told to, so tests, loom models and the fuzz
//! harness drive leases and timeouts by hand.

use std::time::Instant;

#[cfg(feature = "test-util")]
pub use manual::ManualClock;

/// Which clock a table reads.
#[derive(Debug, Clone, Default)]
pub(crate) enum Clock {
    /// `Instant::now()`.
    #[default]
    Monotonic,
    /// Time that moves by hand.
    #[cfg(feature = "test-util")]
    Manual(ManualClock),
}

impl Clock {
    #[inline]
    pub(crate) fn now(&self) -> Instant {
        match self {
            Self::Monotonic => Instant::now(),
            #[cfg(feature = "test-util")]
            Self::Manual(clock) => clock.read(),
        }
    }
}

/// The current time, read at most once per operation and only if needed.
#[derive(Debug)]
pub(crate) struct Now<'a> {
    clock: &'a Clock,
    at: Option<Instant>,
}

impl<'a> Now<'a> {
    pub(crate) fn new(clock: &'a Clock) -> Self {
        Self { clock, at: None }
    }

    #[inline]
    pub(crate) fn get(&mut self) -> Instant {
        *self.at.get_or_insert_with(|| self.clock.now())
    }
}

#[cfg(feature = "test-util")]
mod manual {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    use std::task::Waker;
    use std::time::{Duration, Instant};

    use slab::Slab;

    use crate::loom::Mutex;

    /// A clock that moves only when [`advance`](Self::advance) is called.
    ///
    /// Give it to a table with [`Builder::clock`](crate::Builder::clock); every
    /// lease and timeout of that table is then judged against it, and
    /// advancing it wakes the waiters whose deadline it passed.
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
    pub struct ManualClock {
        inner: Arc<Inner>,
    }

    #[derive(Debug)]
    struct Inner {
        base: Instant,
        state: Mutex<State>,
        /// How many times a table read this clock.
        reads: AtomicU64,
    }

    #[derive(Debug, Default)]
    struct State {
        elapsed: Duration,
        sleepers: Slab<(Instant, Option<Waker>)>,
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
            Self {
                inner: Arc::new(Inner {
                    base: Instant::now(),
                    state: Mutex::new(State::default()),
                    reads: AtomicU64::new(0),
                }),
            }
        }

        /// The clock's current time.
        #[must_use]
        pub fn now(&self) -> Instant {
            self.inner.base + self.inner.state.lock().elapsed
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

        /// Moves the clock forward and wakes every sleeper whose deadline it
        /// reached.
        pub fn advance(&self, by: Duration) {
            let mut wake = Vec::new();
            {
                let mut state = self.inner.state.lock();
                state.elapsed += by;
                let now = self.inner.base + state.elapsed;
                for (_, (at, waker)) in state.sleepers.iter_mut() {
                    if *at <= now {
                        wake.extend(waker.take());
                    }
                }
            }
            wake.into_iter().for_each(Waker::wake);
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

        /// Registers (or re-registers) sleeper `id` until `at`; `true` if
        /// `at` has already passed.
        pub(crate) fn poll_sleep(
            &self,
            id: &mut Option<usize>,
            at: Instant,
            waker: &Waker,
        ) -> bool {
            let mut state = self.inner.state.lock();
            let now = self.inner.base + state.elapsed;
            if at <= now {
                if let Some(i) = id.take() {
                    state.sleepers.remove(i);
                }
                return true;
            }
            match *id {
                Some(i) => state.sleepers[i] = (at, Some(waker.clone())),
                None => *id = Some(state.sleepers.insert((at, Some(waker.clone())))),
            }
            false
        }

        pub(crate) fn cancel_sleep(&self, id: usize) {
            self.inner.state.lock().sleepers.remove(id);
        }
    }
}
