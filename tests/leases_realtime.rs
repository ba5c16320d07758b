//! Leases and timeouts on the real monotonic clock and the real timer, under
//! tokio, async-std and a blocked thread. Bounds are generous and nothing is
//! asserted about how soon something happened: only that it did, and in the
//! right order, and where a lease's deadline may lie relative to clock reads
//! taken around its grant.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use keylock::{LockError, LockOptions, LockTable};

const SHORT: Duration = Duration::from_millis(30);

/// An outer bound on a wait that must end: exceeding it fails the test as a
/// hang. It says nothing about how soon the wait should end.
const HANG_GUARD: Duration = Duration::from_secs(30);

fn lease(d: Duration) -> LockOptions {
    LockOptions::new().lease(d)
}

/// Polls `fut` once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    Pin::new(fut).poll(&mut Context::from_waker(Waker::noop()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_waiter_gets_a_key_whose_holder_never_releases() {
    let table = Arc::new(LockTable::new());
    let stuck = table
        .try_lock_with("k", LockOptions::new().lease(SHORT))
        .unwrap();
    // The holder neither drops nor polls anything: only the waiter's timer
    // can move the key on.
    let t = table.clone();
    let next = tokio::spawn(async move { t.lock_owned("k").await.token() })
        .await
        .unwrap();
    assert!(next > stuck.token());
    assert!(stuck.is_expired());
    assert!(Instant::now() >= stuck.expires_at().unwrap());
    drop(stuck);
    assert!(table.is_empty());
}

#[async_std::test]
async fn async_std_timeout_reports_the_holder() {
    let table = LockTable::new();
    let held = table.try_lock(1u32).unwrap();
    let start = Instant::now();
    let err = table
        .lock_with(1, LockOptions::new().timeout(SHORT))
        .await
        .unwrap_err();
    match err {
        LockError::Timeout { waited, holder, .. } => {
            assert!(waited >= SHORT);
            assert!(start.elapsed() >= SHORT);
            assert_eq!(holder, Some(held.token()));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(table.waiters(&1), 0);
    drop(held);
    assert!(table.is_empty());
}

#[test]
fn blocked_thread_is_woken_at_the_holders_deadline() {
    let table = Arc::new(LockTable::new());
    let stuck = table
        .try_lock_with(5u8, LockOptions::new().lease(SHORT))
        .unwrap();
    let t = table.clone();
    let waiter = std::thread::spawn(move || t.blocking_lock(5).token());
    let next = waiter.join().unwrap();
    assert!(next > stuck.token());
    assert!(stuck.check().is_err());
    drop(stuck);
    assert!(table.is_empty());
}

#[test]
fn blocked_thread_times_out_and_leaves_nothing() {
    let table = LockTable::new();
    let held = table.try_lock("x").unwrap();
    let err = table
        .blocking_lock_with("x", LockOptions::new().timeout(SHORT))
        .unwrap_err();
    assert!(matches!(err, LockError::Timeout { .. }), "{err}");
    assert_eq!(table.waiters("x"), 0);
    drop(held);
    assert!(table.is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn smol_and_tokio_share_leases_on_one_table() {
    let table = Arc::new(LockTable::<u64>::builder().default_lease(SHORT).build());
    let first = table.try_lock(9).unwrap();
    let t = table.clone();
    // A smol waiter on another thread gets the key when the default lease
    // of the tokio-side holder lapses.
    let token = std::thread::spawn(move || smol::block_on(async { t.lock(9).await.token() }))
        .join()
        .unwrap();
    assert!(token > first.token());
    assert!(first.is_expired());
    drop(first);
    assert!(table.is_empty());
}

// ---------------------------------------------------------------------------
// A renewal re-arms the waiting head's real timer.
// ---------------------------------------------------------------------------

/// The holder renews (moving its deadline later) while a waiter is queued and
/// has armed its timer for the old deadline, then never releases: the waiter
/// must still get the key, after the renewed deadline. A timer left at the
/// old deadline fires too early, finds the lease live, and nothing wakes the
/// waiter again.
#[tokio::test(flavor = "current_thread")]
async fn a_waiter_armed_before_a_renewal_gets_the_key_after_the_renewed_deadline() {
    // The renewal must come before the first lease lapses. Should the
    // machine stall that long between the grant and the renewal, start over
    // with longer leases.
    let mut first = Duration::from_millis(300);
    loop {
        if renewed_then_stalled(first).await {
            return;
        }
        assert!(
            first < Duration::from_secs(5),
            "the renewal kept coming after the lease had lapsed"
        );
        first *= 2;
    }
}

/// One run of the scenario with a first lease of `first`; `false` if the
/// renewal came too late (the lease had lapsed) and proved nothing.
async fn renewed_then_stalled(first: Duration) -> bool {
    let table = Arc::new(LockTable::new());
    let holder = table.try_lock_with("k", lease(first)).unwrap();
    let first_deadline = holder.expires_at().unwrap();
    let mut waiter = Box::pin(table.clone().lock_owned("k"));
    // Pending: queued at the head, and waiting for the holder's deadline as
    // it stood then.
    assert!(poll_once(&mut waiter).is_pending());
    assert_eq!(table.waiters("k"), 1);
    match holder.renew(2 * first) {
        Ok(()) => {}
        Err(LockError::Expired { .. }) => return false,
        Err(other) => panic!("renew failed: {other}"),
    }
    let renewed = holder.expires_at().unwrap();
    assert!(
        renewed > first_deadline,
        "the renewal did not move the deadline later"
    );
    // The holder stalls from here on: it neither releases nor touches the key.
    // The waiter runs in a task of its own, polled only when it is woken: the
    // hang guard waits on the task's handle, so its own wake-up at the end
    // cannot poll the waiter into noticing the lapse.
    let next = tokio::time::timeout(HANG_GUARD, tokio::spawn(waiter))
        .await
        .expect(
            "the waiter never got the key of a holder that renewed and stalled: its \
             timer was not re-armed for the renewed deadline",
        )
        .unwrap();
    assert!(
        Instant::now() >= renewed,
        "handed over before the renewed deadline"
    );
    assert!(next.token() > holder.token());
    assert!(holder.is_expired());
    assert_eq!(table.waiters("k"), 0);
    drop(next);
    drop(holder);
    assert!(table.is_empty());
    true
}

// ---------------------------------------------------------------------------
// Where a lease starts: never after the grant, and for a short lease never
// before it (the precise clock).
// ---------------------------------------------------------------------------

/// Shorter than a kernel tick, so that starting it from the coarse clock (up
/// to a tick behind) would show.
const TINY: Duration = Duration::from_millis(2);

const ROUNDS: usize = 2_000;

#[track_caller]
fn assert_starts_at_grant(expires_at: Option<Instant>, before: Instant, lease: Duration) {
    let end = expires_at.expect("a leased grant has a deadline");
    assert!(
        end >= before + lease,
        "a {lease:?} lease ends {:?} before the clock read just before its grant, plus \
         the lease: it started from a clock behind the precise one",
        (before + lease) - end
    );
}

#[test]
fn a_short_lease_never_ends_before_its_grant_plus_the_lease() {
    let table = LockTable::new();
    for _ in 0..ROUNDS {
        let before = Instant::now();
        let guard = table.try_lock_with("k", lease(TINY)).unwrap();
        assert_starts_at_grant(guard.expires_at(), before, TINY);
    }
    assert!(table.is_empty());
}

#[test]
fn a_short_lease_handed_over_never_ends_before_the_release_plus_the_lease() {
    let table = LockTable::new();
    for _ in 0..ROUNDS {
        // A holder without a lease, so the release reads no clock of its own.
        let holder = table.try_lock("k").unwrap();
        let mut waiter = Box::pin(table.lock_with("k", lease(TINY)));
        assert!(poll_once(&mut waiter).is_pending());
        let before = Instant::now();
        drop(holder);
        let Poll::Ready(next) = poll_once(&mut waiter) else {
            panic!("the release handed the key to the waiter");
        };
        let next = next.unwrap();
        assert_starts_at_grant(next.expires_at(), before, TINY);
    }
    assert!(table.is_empty());
}

#[test]
fn a_short_renewal_never_ends_before_the_renewal_plus_the_lease() {
    let table = LockTable::new();
    for _ in 0..ROUNDS {
        // Without a lease until renewed, so the renewal reads no clock to
        // judge a lapse first.
        let guard = table.try_lock("k").unwrap();
        let before = Instant::now();
        guard.renew(TINY).unwrap();
        assert_starts_at_grant(guard.expires_at(), before, TINY);
    }
    assert!(table.is_empty());
}

/// A lease of a second or more may start from the kernel's coarse clock: never
/// later than the grant (a lease is never extended), and behind it by at most
/// a tick, well under 1% of the lease. The 1% is asserted for leases of 10 s
/// and more, where it is 100 ms or more: a loaded host can process a tick
/// late and leave the coarse clock more than 10 ms behind (1% of 1 s).
#[test]
fn a_long_lease_never_ends_after_its_grant_plus_the_lease() {
    let table = LockTable::new();
    for lease_len in [
        Duration::from_secs(1),
        Duration::from_secs(10),
        Duration::from_secs(30),
        keylock::DEFAULT_MAX_LEASE,
    ] {
        for _ in 0..ROUNDS / 4 {
            let before = Instant::now();
            let guard = table.try_lock_with("k", lease(lease_len)).unwrap();
            let after = Instant::now();
            let end = guard.expires_at().expect("a leased grant has a deadline");
            assert!(
                end <= after + lease_len,
                "a {lease_len:?} lease was extended by {:?}",
                end - (after + lease_len)
            );
            if lease_len >= Duration::from_secs(10) {
                let shortest = before + lease_len - lease_len / 100;
                assert!(
                    end >= shortest,
                    "a {lease_len:?} lease was shortened by more than 1%: it ends {:?} \
                     before the clock read just before its grant, plus the lease",
                    (before + lease_len) - end
                );
            }
        }
    }
    assert!(table.is_empty());
}
