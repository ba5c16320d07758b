//! Keeping leases alive: [`KeepAlive`], a future that renews one or more
//! guards every interval until it is dropped, and resolves at the first
//! failure.
//!
//! It is built from the two primitives a caller would use by hand: a timer
//! at each renewal (the crate's `Sleep`, on the first guard's table clock)
//! and one [`Lost`] future per guard, so that a revocation is noticed the
//! moment it happens rather than at the next renewal. Renewals judge
//! authority in the table as `renew` always does: a lapsed or revoked grant
//! is never revived, and the renewal fails instead.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::LockError;
use crate::loss::lost::Lost;
use crate::support::lease::MIN_LEASE;
use crate::table::guard::{Guard, OwnedGuard};
use crate::table::DefaultHashBuilder;
use crate::time::timer::Sleep;

/// The future returned by [`Guard::keep_alive`] and
/// [`OwnedGuard::keep_alive`]: renews the guard's lease (and those of the
/// guards added with [`and`](Self::and) / [`and_owned`](Self::and_owned))
/// every `interval`, with a lease of `lease` from each renewal, until it is
/// dropped.
///
/// The first renewal happens on the first poll, then one every `interval`
/// (timed by the first guard's table). It never resolves while all goes
/// well; it resolves at the first failure, with the reason:
///
/// - [`LockError::Expired`] with a grant's token, the moment that grant
///   loses its authority: revoked (by
///   [`revoke`](crate::LockTable::revoke) or
///   [`revoke_grant`](crate::LockTable::revoke_grant)), noticed at once
///   through the grant's [`lost`](Guard::lost) future and not one interval
///   later; or lapsed before a renewal reached it (the task did not run in
///   time);
/// - [`LockError::InvalidOptions`] on the first poll if `lease` is out of
///   the table's range, or `interval` is zero or not shorter than `lease`
///   (the lease would lapse between renewals).
///
/// Run it beside the work it protects, and stop the work when it resolves:
///
/// ```
/// # futures::executor::block_on(async {
/// use std::time::Duration;
/// use futures::future::{select, Either};
///
/// let table = keylock::LockTable::new();
/// let guard = table.lock("job").await;
/// let token = guard.token();
/// let keep_alive = guard.keep_alive(Duration::from_secs(10), Duration::from_secs(30));
/// let work = async {
///     // ... long work under the guard; here an operator revokes it ...
///     table.revoke_grant("job", token);
///     std::future::pending::<()>().await
/// };
/// match select(std::pin::pin!(work), keep_alive).await {
///     Either::Left(_) => unreachable!(),
///     Either::Right((why, _)) => assert_eq!(why, keylock::LockError::Expired { token, key: None }),
/// };
/// # });
/// ```
///
/// # Cancel safety
///
/// Cancel-safe: dropping it stops the renewals (the lease then runs out at
/// its deadline) and changes nothing else.
#[must_use = "futures do nothing unless polled"]
pub struct KeepAlive<'a, K, S = DefaultHashBuilder> {
    /// One per guard: its loss, and through it the guard and its table.
    watched: Vec<Lost<'a, K, S>>,
    interval: Duration,
    lease: Duration,
    /// When the next renewal is due.
    next: Next,
    sleep: Option<Sleep>,
    /// Invalid options, reported by the first poll.
    invalid: Option<LockError>,
    done: bool,
}

impl<'a, K, S> KeepAlive<'a, K, S> {
    pub(crate) fn new(lost: Lost<'a, K, S>, interval: Duration, lease: Duration) -> Self {
        let invalid = lost
            .table()
            .leases()
            .check(lease)
            .err()
            .or_else(|| check_interval(interval, lease).err());
        Self {
            watched: vec![lost],
            interval,
            lease,
            next: Next::Now,
            sleep: None,
            invalid,
            done: false,
        }
    }

    /// Also keeps `guard`'s lease alive, on the same schedule; the future
    /// resolves at the first failure of any of them.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// let table = keylock::LockTable::new();
    /// let (a, b) = (table.lock("a").await, table.lock("b").await);
    /// let both = a
    ///     .keep_alive(Duration::from_secs(1), Duration::from_secs(3))
    ///     .and(&b);
    /// table.revoke("b");
    /// assert_eq!(both.await, keylock::LockError::Expired { token: b.token(), key: None });
    /// # });
    /// ```
    pub fn and(self, guard: &'a Guard<'_, K, S>) -> Self {
        self.watch(guard.lost())
    }

    /// As [`and`](Self::and), for an [`OwnedGuard`].
    pub fn and_owned(self, guard: &'a OwnedGuard<K, S>) -> Self {
        self.watch(guard.lost())
    }

    fn watch(mut self, lost: Lost<'a, K, S>) -> Self {
        if self.invalid.is_none() {
            self.invalid = lost.table().leases().check(self.lease).err();
        }
        self.watched.push(lost);
        self
    }

    fn fail(&mut self, err: LockError) -> Poll<LockError> {
        self.done = true;
        // Holds a waker: dropped here, outside any lock.
        self.sleep = None;
        Poll::Ready(err)
    }
}

/// When a keep-alive renews next.
#[derive(Debug, Clone, Copy)]
enum Next {
    /// On the next poll (the first).
    Now,
    At(Instant),
    /// An interval too long for the clock to represent: never again.
    Never,
}

fn check_interval(interval: Duration, lease: Duration) -> Result<(), LockError> {
    if interval < MIN_LEASE || interval >= lease {
        return Err(LockError::InvalidOptions {
            option: "keep-alive interval",
            value: interval,
            min: MIN_LEASE,
            max: lease.saturating_sub(MIN_LEASE),
        });
    }
    Ok(())
}

impl<K, S> Future for KeepAlive<'_, K, S> {
    type Output = LockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LockError> {
        let this = &mut *self;
        assert!(!this.done, "keylock: `KeepAlive` polled after it completed");
        if let Some(err) = this.invalid.take() {
            return this.fail(err);
        }
        loop {
            for lost in &mut this.watched {
                if let Poll::Ready(err) = Pin::new(lost).poll(cx) {
                    return this.fail(err);
                }
            }
            let at = match this.next {
                Next::Now => None,
                Next::At(at) => Some(at),
                Next::Never => {
                    this.sleep = None;
                    return Poll::Pending;
                }
            };
            if let Some(at) = at {
                let clock = this.watched[0].table().clock();
                let sleep = match &mut this.sleep {
                    Some(sleep) => {
                        sleep.reset(at);
                        sleep
                    }
                    None => this.sleep.insert(Sleep::new(clock, at)),
                };
                if sleep.poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            for lost in &this.watched {
                if let Err(err) = lost.renew(this.lease) {
                    return this.fail(err);
                }
            }
            let now = this.watched[0].table().clock().now();
            this.next = now.checked_add(this.interval).map_or(Next::Never, Next::At);
            // Then look at the losses again: a renewal may have woken them.
        }
    }
}

impl<K, S> fmt::Debug for KeepAlive<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeepAlive")
            .field("watched", &self.watched)
            .field("interval", &self.interval)
            .field("lease", &self.lease)
            .field("next", &self.next)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// A guard's [`keep_alive`](crate::Guard::keep_alive), a layer over its
/// [`lost`](crate::Guard::lost).
macro_rules! keep_alive_methods {
    () => {
        /// A future that keeps this grant's lease alive: it renews it with
        /// `lease` on its first poll and then every `interval` until it is
        /// dropped, and resolves at the first failure with the reason (a
        /// revocation is noticed at once); see [`KeepAlive`]. Add more
        /// guards with [`KeepAlive::and`].
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it stops the renewals.
        ///
        /// ```
        /// # futures::executor::block_on(async {
        /// use std::time::Duration;
        /// let table = keylock::LockTable::new();
        /// let guard = table.lock("job").await;
        /// let keep = guard.keep_alive(Duration::from_secs(30), Duration::ZERO);
        /// let err = keep.await; // a zero lease is refused at once
        /// assert!(matches!(err, keylock::LockError::InvalidOptions { option: "lease", .. }));
        /// # });
        /// ```
        pub fn keep_alive(&self, interval: Duration, lease: Duration) -> KeepAlive<'_, K, S> {
            KeepAlive::new(self.lost(), interval, lease)
        }
    };
}

impl<K, S> crate::Guard<'_, K, S> {
    keep_alive_methods!();
}

impl<K, S> crate::OwnedGuard<K, S> {
    keep_alive_methods!();
}
