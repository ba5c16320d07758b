//! Tables built with `Builder::time_source`: leases and timeouts follow the
//! application's clock and sleeps, not the monotonic clock.
//!
//! `TestTime` is a clock the test moves by hand, whose sleeps complete when
//! it is moved past their deadline (or when the test fires one early). Lock
//! futures are polled by hand with a waker that counts its wakes, so every
//! step is deterministic; the real clock plays no part.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use keylock::{LockError, LockTable, TimeSource};

mod common;
use common::{counting, lease, poll, timeout, wakes, NANO, SEC};

// ---------------------------------------------------------------------------
// A clock moved by hand.
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct SleepState {
    deadline: Option<Instant>,
    /// Fired: by the clock passing the deadline, or early by the test.
    fired: bool,
    waker: Option<Waker>,
    /// Polls after it had already completed.
    polls_after_ready: usize,
    completed: bool,
}

#[derive(Debug)]
struct TimeState {
    now: Instant,
    /// Every sleep ever made, in order.
    sleeps: Vec<Arc<Mutex<SleepState>>>,
}

#[derive(Debug, Clone)]
struct TestTime(Arc<Mutex<TimeState>>);

impl TestTime {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(TimeState {
            now: Instant::now(),
            sleeps: Vec::new(),
        })))
    }

    fn now(&self) -> Instant {
        self.0.lock().unwrap().now
    }

    /// Moves the clock forward and fires every sleep it passed (waking after
    /// unlocking).
    fn advance(&self, by: Duration) {
        let wake: Vec<Waker> = {
            let mut state = self.0.lock().unwrap();
            state.now += by;
            let now = state.now;
            state
                .sleeps
                .iter()
                .filter_map(|sleep| {
                    let mut sleep = sleep.lock().unwrap();
                    if !sleep.fired && sleep.deadline.is_some_and(|d| d <= now) {
                        sleep.fired = true;
                        sleep.waker.take()
                    } else {
                        None
                    }
                })
                .collect()
        };
        wake.into_iter().for_each(Waker::wake);
    }

    /// The deadlines `sleep_until` was called with, in order.
    fn sleep_calls(&self) -> Vec<Instant> {
        let state = self.0.lock().unwrap();
        state
            .sleeps
            .iter()
            .map(|s| s.lock().unwrap().deadline.unwrap())
            .collect()
    }

    /// Sleeps not yet fired whose future still exists (the table holds it).
    fn pending_sleeps(&self) -> usize {
        let state = self.0.lock().unwrap();
        state
            .sleeps
            .iter()
            .filter(|s| Arc::strong_count(s) > 1 && !s.lock().unwrap().fired)
            .count()
    }

    /// Fires the latest sleep now, before its deadline (a timer that fires
    /// early); the clock does not move.
    fn fire_latest_early(&self) {
        let waker = {
            let state = self.0.lock().unwrap();
            let mut sleep = state.sleeps.last().expect("a sleep").lock().unwrap();
            sleep.fired = true;
            sleep.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// How many times a table polled a sleep that had already completed.
    fn polls_after_ready(&self) -> usize {
        let state = self.0.lock().unwrap();
        state
            .sleeps
            .iter()
            .map(|s| s.lock().unwrap().polls_after_ready)
            .sum()
    }
}

struct TestSleep(Arc<Mutex<SleepState>>);

impl Future for TestSleep {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut sleep = self.0.lock().unwrap();
        if sleep.completed {
            // A table re-polling a completed sleep in a loop would spin
            // for ever inside one `poll`: make that an assertion.
            sleep.polls_after_ready += 1;
            assert!(
                sleep.polls_after_ready < 1000,
                "a completed sleep was polled again 1000 times: it was not re-armed"
            );
            return Poll::Ready(());
        }
        if sleep.fired {
            sleep.completed = true;
            return Poll::Ready(());
        }
        sleep.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl TimeSource for TestTime {
    fn now(&self) -> Instant {
        TestTime::now(self)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + Sync>> {
        let mut state = self.0.lock().unwrap();
        let sleep = Arc::new(Mutex::new(SleepState {
            deadline: Some(deadline),
            fired: deadline <= state.now,
            ..SleepState::default()
        }));
        state.sleeps.push(sleep.clone());
        Box::pin(TestSleep(sleep))
    }
}

// ---------------------------------------------------------------------------
// Polling by hand.
// ---------------------------------------------------------------------------

fn table() -> (TestTime, LockTable<&'static str>) {
    let time = TestTime::new();
    let table = LockTable::builder().time_source(time.clone()).build();
    (time, table)
}

// ---------------------------------------------------------------------------
// Leases and timeouts follow the source.
// ---------------------------------------------------------------------------

#[test]
fn a_lease_lapses_exactly_when_the_custom_clock_passes_its_deadline() {
    let (time, table) = table();
    let granted_at = time.now();
    let guard = table.try_lock_with("k", lease(5 * SEC)).unwrap();
    assert_eq!(guard.expires_at(), Some(granted_at + 5 * SEC));

    time.advance(5 * SEC - NANO);
    assert_eq!(guard.check(), Ok(guard.token()));
    assert!(table.is_locked("k"));

    time.advance(NANO);
    assert_eq!(
        guard.check(),
        Err(LockError::Expired {
            token: guard.token(),
            key: None,
        })
    );
    assert!(!table.is_locked("k"));
    drop(guard);
    assert!(table.is_empty());
    assert!(time.sleep_calls().is_empty(), "nobody waited: no sleep");
}

#[test]
fn the_real_clock_plays_no_part() {
    let (_time, table) = table();
    let guard = table
        .try_lock_with("k", lease(Duration::from_millis(1)))
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        guard.check(),
        Ok(guard.token()),
        "the custom clock did not move"
    );
}

#[test]
fn a_waiter_sleeps_until_the_holders_deadline_and_then_gets_the_key() {
    let (time, table) = table();
    let stuck = table.try_lock_with("k", lease(5 * SEC)).unwrap();
    let deadline = stuck.expires_at().unwrap();

    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock("k"));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(
        time.sleep_calls(),
        vec![deadline],
        "one sleep, until the holder's deadline"
    );
    assert_eq!(time.pending_sleeps(), 1);

    time.advance(5 * SEC - NANO);
    assert_eq!(wakes(&c), 0, "the sleep has not completed");
    assert!(
        poll(&mut waiter, &w).is_pending(),
        "the lease is still live"
    );
    assert_eq!(stuck.check(), Ok(stuck.token()));

    time.advance(NANO);
    assert_eq!(wakes(&c), 1, "the completed sleep woke the waiter");
    let Poll::Ready(next) = poll(&mut waiter, &w) else {
        panic!("the lease lapsed: the waiter gets the key");
    };
    assert!(next.token() > stuck.token());
    assert_eq!(next.check(), Ok(next.token()));
    assert!(stuck.check().is_err(), "the stale holder is fenced");
    drop(waiter);
    drop(next);
    drop(stuck);
    assert!(table.is_empty());
    assert_eq!(time.pending_sleeps(), 0, "no sleep left armed");
}

#[test]
fn a_timeout_fires_when_its_sleep_completes() {
    let (time, table) = table();
    let held = table.try_lock("k").unwrap();
    let start = time.now();

    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock_with("k", timeout(2 * SEC)));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(time.sleep_calls(), vec![start + 2 * SEC]);

    time.advance(2 * SEC - NANO);
    assert_eq!(wakes(&c), 0);
    assert!(poll(&mut waiter, &w).is_pending(), "not timed out yet");

    time.advance(NANO);
    assert_eq!(wakes(&c), 1);
    let Poll::Ready(Err(err)) = poll(&mut waiter, &w) else {
        panic!("the timeout ran out");
    };
    assert_eq!(
        err,
        LockError::Timeout {
            waited: 2 * SEC,
            holder: Some(held.token()),
            holder_label: None,
            held_for: None,
            ahead: 0,
            key: None,
        }
    );
    assert_eq!(table.waiters("k"), 0);
    drop(held);
    assert!(table.is_empty());
}

/// A waiter with both a timeout and a leased holder sleeps until the earlier
/// of the two.
#[test]
fn a_waiter_sleeps_until_the_earlier_of_its_timeout_and_the_lease() {
    let (time, table) = table();
    let start = time.now();
    let stuck = table.try_lock_with("k", lease(5 * SEC)).unwrap();
    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock_with("k", timeout(3 * SEC)));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(time.sleep_calls(), vec![start + 3 * SEC]);
    time.advance(3 * SEC);
    assert_eq!(wakes(&c), 1);
    assert!(matches!(
        poll(&mut waiter, &w),
        Poll::Ready(Err(LockError::Timeout { .. }))
    ));
    assert_eq!(stuck.check(), Ok(stuck.token()));

    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock_with("k", timeout(10 * SEC)));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(
        time.sleep_calls().last(),
        Some(&(start + 5 * SEC)),
        "the lease ends before the timeout"
    );
    time.advance(2 * SEC);
    assert_eq!(wakes(&c), 1);
    let Poll::Ready(Ok(next)) = poll(&mut waiter, &w) else {
        panic!("the lease lapsed before the timeout");
    };
    assert!(next.token() > stuck.token());
}

#[test]
fn a_renewal_re_arms_the_waiters_sleep_at_the_new_deadline() {
    let (time, table) = table();
    let start = time.now();
    let holder = table.try_lock_with("k", lease(5 * SEC)).unwrap();
    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock("k"));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(time.sleep_calls(), vec![start + 5 * SEC]);

    time.advance(3 * SEC);
    holder.renew(5 * SEC).unwrap();
    assert_eq!(holder.expires_at(), Some(start + 8 * SEC));
    // The waiter is nudged (or its sleep fires at 5 s and finds the lease
    // live); either way it must end up sleeping until 8 s.
    time.advance(2 * SEC);
    assert!(poll(&mut waiter, &w).is_pending(), "live until 8 s");
    assert_eq!(
        time.sleep_calls().last(),
        Some(&(start + 8 * SEC)),
        "re-armed at the renewed deadline"
    );
    let before = wakes(&c);
    time.advance(3 * SEC - NANO);
    assert_eq!(wakes(&c), before, "nothing fires before 8 s");
    assert!(poll(&mut waiter, &w).is_pending());
    time.advance(NANO);
    assert_eq!(wakes(&c), before + 1, "woken at 8 s");
    let Poll::Ready(next) = poll(&mut waiter, &w) else {
        panic!("the renewed lease lapsed at 8 s");
    };
    assert!(next.token() > holder.token());
    assert!(holder.is_expired());
}

/// The `TimeSource` contract: "one that fires early is simply re-armed".
/// A sleep that completes before its deadline must not be polled again as
/// if it were still pending (a completed future may panic, or stay ready and
/// spin the lock future inside one `poll`): the waiter asks for a new sleep.
#[test]
fn a_sleep_that_fires_early_is_re_armed() {
    let (time, table) = table();
    let stuck = table.try_lock_with("k", lease(5 * SEC)).unwrap();
    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock("k"));
    assert!(poll(&mut waiter, &w).is_pending());
    assert_eq!(time.sleep_calls().len(), 1);

    time.fire_latest_early();
    assert_eq!(wakes(&c), 1);
    assert!(
        poll(&mut waiter, &w).is_pending(),
        "the lease is live: the waiter keeps waiting"
    );
    assert_eq!(
        time.polls_after_ready(),
        0,
        "a completed sleep was polled again"
    );
    assert_eq!(
        time.sleep_calls(),
        vec![stuck.expires_at().unwrap(); 2],
        "re-armed at the same deadline"
    );
    time.advance(5 * SEC);
    assert_eq!(wakes(&c), 2);
    let Poll::Ready(next) = poll(&mut waiter, &w) else {
        panic!("the lease lapsed");
    };
    assert!(next.token() > stuck.token());
}

/// The same, for a timeout's sleep.
#[test]
fn a_timeout_sleep_that_fires_early_is_re_armed() {
    let (time, table) = table();
    let _held = table.try_lock("k").unwrap();
    let (c, w) = counting();
    let mut waiter = Box::pin(table.lock_with("k", timeout(2 * SEC)));
    assert!(poll(&mut waiter, &w).is_pending());
    time.fire_latest_early();
    assert_eq!(wakes(&c), 1);
    assert!(
        poll(&mut waiter, &w).is_pending(),
        "the timeout has not run out on the table's clock"
    );
    assert_eq!(time.polls_after_ready(), 0);
    time.advance(2 * SEC);
    assert!(matches!(
        poll(&mut waiter, &w),
        Poll::Ready(Err(LockError::Timeout { .. }))
    ));
}

/// A blocking wait on a plain thread follows the custom clock too: it times
/// out when the test moves the clock, not before.
#[test]
fn a_blocking_wait_follows_the_custom_clock() {
    let time = TestTime::new();
    let table = Arc::new(LockTable::builder().time_source(time.clone()).build());
    let held = table.try_lock("k").unwrap();
    let t = table.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(t.blocking_lock_with("k", timeout(2 * SEC)).map(drop));
    });
    while table.waiters("k") == 0 {
        std::thread::yield_now();
    }
    // However long real time runs, the custom clock has not moved.
    assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    time.advance(2 * SEC);
    let result = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the blocked thread was not woken by the custom clock");
    assert!(matches!(result, Err(LockError::Timeout { waited, .. }) if waited == 2 * SEC));
    waiter.join().unwrap();
    drop(held);
    assert!(table.is_empty());
}

// ---------------------------------------------------------------------------
// A real-world source: the doc example's async-std timer.
// ---------------------------------------------------------------------------

/// The monotonic clock, with async-std's timer (the `TimeSource` doc example).
#[derive(Debug)]
struct AsyncStdTime;

impl TimeSource for AsyncStdTime {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + Sync>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        Box::pin(async_std::task::sleep(wait))
    }
}

const SHORT: Duration = Duration::from_millis(30);
const HANG_GUARD: Duration = Duration::from_secs(60);

#[async_std::test]
async fn async_std_time_source_times_out() {
    let table = LockTable::builder().time_source(AsyncStdTime).build();
    let held = table.try_lock(1u32).unwrap();
    let start = Instant::now();
    let err = async_std::future::timeout(HANG_GUARD, table.lock_with(1, timeout(SHORT)))
        .await
        .expect("the timeout never fired")
        .unwrap_err();
    match err {
        LockError::Timeout { waited, holder, .. } => {
            assert!(waited >= SHORT, "waited {waited:?}");
            assert!(start.elapsed() >= SHORT);
            assert_eq!(holder, Some(held.token()));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(table.waiters(&1), 0);
    drop(held);
    assert!(table.is_empty());
}

#[async_std::test]
async fn async_std_time_source_hands_over_a_lapsed_key() {
    let table = Arc::new(LockTable::builder().time_source(AsyncStdTime).build());
    let stuck = table.try_lock_with(1u32, lease(SHORT)).unwrap();
    let deadline = stuck.expires_at().unwrap();
    let t = table.clone();
    let next = async_std::future::timeout(
        HANG_GUARD,
        async_std::task::spawn(async move { t.lock_owned(1).await }),
    )
    .await
    .expect("the waiter never got the key");
    assert!(Instant::now() >= deadline);
    assert!(next.token() > stuck.token());
    assert!(stuck.is_expired());
    drop(next);
    drop(stuck);
    assert!(table.is_empty());
}
