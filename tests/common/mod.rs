//! Helpers shared by the integration tests: a waker that counts its wakes,
//! polling a future by hand (with that waker or a noop one), forgetting a
//! waiting call, lock options, the three ways a test ends a transaction,
//! and (with `test-util`) a table on a manual clock and an eventual table
//! whose fairness deadline is set; a watchdog that turns a hang (user code
//! calling back into a lock held around it) into a failure. Each test
//! crate uses only some of them.
#![allow(dead_code)]

pub(crate) mod call_back;

use std::fmt::Debug;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

#[cfg(feature = "test-util")]
use keylock::{Fairness, LockTable, ManualClock};
use keylock::{LockOptions, OwnedTransaction, Transaction};

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

/// Polls `f` once with a waker that does nothing (`Waker::noop()`), for
/// tests that poll by hand and never wait for a wake.
pub(crate) fn poll_noop<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

/// Boxes `f`, polls it once with a noop waker (it must wait) and forgets it
/// (`mem::forget` of its box, safe Rust: the box is leaked and the future
/// never dropped).
#[track_caller]
pub(crate) fn forget_pending<F: Future>(f: F) {
    let mut f = Box::pin(f);
    assert!(poll_noop(f.as_mut()).is_pending());
    std::mem::forget(f);
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

/// How a test ends a transaction.
#[derive(Debug, Clone, Copy)]
pub(crate) enum End {
    Commit,
    Abort,
    Drop,
}

/// Every way to end a transaction.
pub(crate) const ENDS: [End; 3] = [End::Commit, End::Abort, End::Drop];

impl End {
    /// Ends the owned transaction `t` this way; a commit must succeed
    /// (nothing lost).
    #[track_caller]
    pub(crate) fn end_owned<K, S>(self, t: OwnedTransaction<K, S>)
    where
        K: Eq + Hash + Clone + Debug + 'static,
        S: BuildHasher + 'static,
    {
        match self {
            End::Commit => t.commit().expect("nothing lost: its keys held"),
            End::Abort => t.abort(),
            End::Drop => drop(t),
        }
    }

    /// Ends the borrowed transaction `t` this way; a commit must succeed
    /// (nothing lost).
    #[track_caller]
    pub(crate) fn end_borrowed<K, S>(self, t: Transaction<'_, K, S>)
    where
        K: Eq + Hash + Clone + Debug,
        S: BuildHasher,
    {
        match self {
            End::Commit => t.commit().expect("nothing lost: its keys held"),
            End::Abort => t.abort(),
            End::Drop => drop(t),
        }
    }
}

/// A table of one shard on a manual clock under `Fairness::Eventual` whose
/// fairness deadline is set by one fair handoff (of the key "warm"): time
/// standing still, a later release with waiters leaves the key free (the
/// head only nudged). Nothing is held or queued when it is returned.
#[cfg(feature = "test-util")]
pub(crate) fn warm_eventual_table() -> LockTable<&'static str> {
    warm_eventual_table_on(ManualClock::new())
}

/// [`warm_eventual_table`] on `clock`.
#[cfg(feature = "test-util")]
pub(crate) fn warm_eventual_table_on(clock: ManualClock) -> LockTable<&'static str> {
    let table = LockTable::<&'static str>::builder()
        .shards(1)
        .clock(clock)
        .fairness(Fairness::Eventual)
        .build();
    let warm = table.try_lock("warm").unwrap();
    let mut handed = Box::pin(table.lock("warm"));
    assert!(poll_noop(handed.as_mut()).is_pending());
    drop(warm);
    assert!(poll_noop(handed.as_mut()).is_ready());
    drop(handed);
    assert!(table.is_empty());
    table
}

/// Runs `body` on a thread of its own and fails if it has not finished
/// after 20 s: a hang detector (user code that called back into a lock
/// held around it spins for ever), not a timing assertion. `hung` says
/// what a hang means in the calling test.
pub(crate) fn watchdog(
    name: &'static str,
    hung: &'static str,
    body: impl FnOnce() + Send + 'static,
) {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            body();
            let _ = done.send(());
        })
        .expect("spawn the test body");
    match finished.recv_timeout(Duration::from_secs(20)) {
        Ok(()) => worker.join().expect("the body finished"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(worker.join().expect_err("the body panicked"))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{name}: hung: {hung}"),
    }
}

/// A hasher under which every key collides (one hash, one shard): a probe
/// compares the caller's key with every key there.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Collide;

/// [`Collide`]'s hasher.
pub(crate) struct ConstHasher;

impl std::hash::Hasher for ConstHasher {
    fn finish(&self) -> u64 {
        7
    }
    fn write(&mut self, _: &[u8]) {}
}

impl BuildHasher for Collide {
    type Hasher = ConstHasher;
    fn build_hasher(&self) -> ConstHasher {
        ConstHasher
    }
}
