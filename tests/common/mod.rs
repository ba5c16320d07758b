//! Helpers shared by the integration tests: a waker that counts its wakes,
//! polling a future by hand, lock options, and (with `test-util`) a table on
//! a manual clock. Each test crate uses only some of them.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use keylock::LockOptions;
#[cfg(feature = "test-util")]
use keylock::{LockTable, ManualClock};

pub(crate) const SEC: Duration = Duration::from_secs(1);
pub(crate) const NANO: Duration = Duration::from_nanos(1);

/// Counts the wakes of the waker made from it.
pub(crate) struct Counter(AtomicUsize);

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// A waker that counts its wakes, and the counter to read them from.
pub(crate) fn counting() -> (Arc<Counter>, Waker) {
    let c = Arc::new(Counter(AtomicUsize::new(0)));
    (c.clone(), Waker::from(c))
}

/// How many times the counter's waker has been woken.
pub(crate) fn wakes(c: &Counter) -> usize {
    c.0.load(SeqCst)
}

/// Polls `f` once with `waker`.
pub(crate) fn poll<F: Future + Unpin>(f: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(waker))
}

/// Polls `f` once with `waker` and returns its output; panics with `what` if
/// it is still pending.
pub(crate) fn ready<F: Future + Unpin>(f: &mut F, waker: &Waker, what: &str) -> F::Output {
    match poll(f, waker) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("{what}"),
    }
}

/// A counting waker that polls futures itself: `w.poll(&mut f)`.
pub(crate) struct W {
    pub(crate) counter: Arc<Counter>,
    pub(crate) waker: Waker,
}

impl W {
    pub(crate) fn new() -> Self {
        let (counter, waker) = counting();
        Self { counter, waker }
    }

    pub(crate) fn wakes(&self) -> usize {
        wakes(&self.counter)
    }

    pub(crate) fn poll<F: Future + Unpin>(&self, f: &mut F) -> Poll<F::Output> {
        poll(f, &self.waker)
    }
}

/// Options with a lease of `d`.
pub(crate) fn lease(d: Duration) -> LockOptions {
    LockOptions::new().lease(d)
}

/// Options with a timeout of `d`.
pub(crate) fn timeout(d: Duration) -> LockOptions {
    LockOptions::new().timeout(d)
}

/// A table on a fresh manual clock, and the clock.
#[cfg(feature = "test-util")]
pub(crate) fn table() -> (ManualClock, LockTable<&'static str>) {
    let clock = ManualClock::new();
    let table = LockTable::builder().clock(clock.clone()).build();
    (clock, table)
}
