//! The public seam for time: where a table reads the clock and how it
//! sleeps.
//!
//! Every table reads one clock for its leases and timeouts. The default is
//! the monotonic clock ([`Instant::now`]) with the crate's own timer thread,
//! which works under any runtime and none. A table can instead follow
//! tokio's clock and timer (feature `tokio`, [`Builder::tokio_time`]), so
//! that `#[tokio::test(start_paused = true)]` drives its leases and timeouts,
//! or any [`TimeSource`] of the application's ([`Builder::time_source`]).
//! Tests that want to move time by hand use the `test-util` feature's
//! `ManualClock` ([`Builder::clock`]).
//!
//! [`Builder::tokio_time`]: crate::Builder::tokio_time
//! [`Builder::time_source`]: crate::Builder::time_source
//! [`Builder::clock`]: crate::Builder::clock

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

/// A clock and a timer for a table's leases and timeouts.
///
/// `now` must be monotonic (never go back); leases are judged against it
/// whenever a grant is checked, and `sleep_until` only wakes waiters early
/// enough to notice: a sleep that fires late delays a handoff, never breaks
/// one, and one that fires early is simply re-armed.
///
/// `now` is read at the instant a grant is judged, which is inside the
/// table's critical sections: it runs while a shard's lock (and, for an
/// owned transaction's checks and renewals, the transaction's own lock, or
/// the holds' and the deadlock detector's) is held. It is the one method of
/// user code besides a key's `Eq` that the table calls under a lock, so it
/// must return promptly, must not call back into the table or its
/// transactions (that would wait on the lock it is called under for ever),
/// and must not panic. `sleep_until` is called with no lock held.
///
/// ```
/// use std::future::Future;
/// use std::pin::Pin;
/// use std::time::Instant;
///
/// /// The monotonic clock, with async-std's timer.
/// #[derive(Debug)]
/// struct AsyncStdTime;
///
/// impl keylock::TimeSource for AsyncStdTime {
///     fn now(&self) -> Instant {
///         Instant::now()
///     }
///     fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + Sync>> {
///         let wait = deadline.saturating_duration_since(Instant::now());
///         Box::pin(async_std::task::sleep(wait))
///     }
/// }
///
/// let table = keylock::LockTable::builder().time_source(AsyncStdTime).build();
/// # let _ = table.try_lock(1).unwrap();
/// ```
pub trait TimeSource: Send + Sync + fmt::Debug + 'static {
    /// The current time. Must never go back; called under the table's
    /// locks (see the trait's doc): it must not call back into the table,
    /// nor panic.
    fn now(&self) -> Instant;

    /// A future that completes at or after `deadline` (on this clock). It is
    /// `Sync` so that the lock futures that hold it stay `Sync`.
    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Future<Output = ()> + Send + Sync>>;
}
