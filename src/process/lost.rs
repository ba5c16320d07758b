//! Loss notification and keep-alive at the process scope: [`ProcessLost`],
//! a future that resolves when a grant loses its authority, and
//! [`ProcessKeepAlive`], one that renews a grant's lease every interval
//! and resolves at the first failure.
//!
//! A grant's authority is judged as `check()` judges it: the key's path
//! still names the grant's file, whole, the file's state word names the
//! grant, and its lease word (on the host's monotonic clock) has not
//! passed. Of these, only the lease changes on its own: nobody can take
//! the key from a live holder within its lease. So a `ProcessLost` judges
//! once when polled and then sleeps on the crate's timer until the lease
//! deadline, when it judges again: it resolves at the lapse (or finds the
//! lease renewed, and sleeps again). A renewal through the guard wakes it
//! so that it re-arms at the new deadline (earlier or later). No polling.
//!
//! Without a lease a grant can lose its key only to something outside
//! keylock (its file removed, replaced or truncated), which no event
//! signals: a `ProcessLost` of such a grant stays pending (`check()`, at
//! the commit, sees it).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::acquire::instant_of_monotonic;
use super::error::ProcessLockError;
use super::guard::Held;
use super::stamp::NO_LEASE;
use crate::time::clock::Clock;
use crate::time::timer::Sleep;
use crate::DEFAULT_MAX_LEASE;

/// The future returned by [`ProcessGuard::lost`](super::ProcessGuard::lost)
/// (and [`OwnedProcessGuard::lost`](super::OwnedProcessGuard::lost)):
/// resolves when the grant loses its authority, with the error its
/// `check()` then gives ([`ProcessLockError::Expired`], or
/// [`ProcessLockError::Damaged`] for a file truncated from outside).
///
/// It resolves at the grant's lease deadline (woken by a timer, re-armed
/// if the lease was renewed meanwhile), or immediately if the grant has
/// already lost the key. A grant without a lease loses its key only to
/// its file being removed, replaced or damaged from outside, which nothing
/// signals: its `ProcessLost` stays pending (its `check()` sees it).
///
/// # Cancel safety
///
/// Cancel-safe: dropping it unregisters it and changes nothing else.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-plost-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// # futures::executor::block_on(async {
/// use std::time::Duration;
/// use keylock::{LockOptions, ProcessLockError, ProcessLockTable};
/// let table = ProcessLockTable::open(&dir)?;
/// let opts = LockOptions::new().lease(Duration::from_millis(20));
/// let guard = table.lock_with("job", opts).await?;
/// // Nobody renews it: it lapses, and `lost` says so.
/// let why = guard.lost().await;
/// assert!(matches!(why, ProcessLockError::Expired { token, .. } if token == guard.token()));
/// assert!(guard.check().is_err());
/// # Ok::<(), ProcessLockError>(())
/// # }).unwrap();
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct ProcessLost<'a, K> {
    held: &'a Held<K>,
    /// Its slot among the grant's watchers, while registered.
    slot: Option<usize>,
    /// The timer at the lease deadline.
    sleep: Option<Sleep>,
    /// The lease deadline the timer last fired for.
    fired: Option<u64>,
    done: bool,
}

impl<'a, K> ProcessLost<'a, K> {
    pub(crate) fn new(held: &'a Held<K>) -> Self {
        Self {
            held,
            slot: None,
            sleep: None,
            fired: None,
            done: false,
        }
    }

    fn finish(&mut self, why: ProcessLockError) -> Poll<ProcessLockError> {
        self.done = true;
        // Holds a waker: dropped now.
        self.sleep = None;
        if let Some(slot) = self.slot.take() {
            self.held.unwatch(slot);
        }
        Poll::Ready(why)
    }
}

impl<K> Future for ProcessLost<'_, K> {
    type Output = ProcessLockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ProcessLockError> {
        let this = &mut *self;
        assert!(
            !this.done,
            "keylock: `ProcessLost` polled after it completed"
        );
        // Registered before judging: a renewal after the judgement wakes it.
        this.held.watch(&mut this.slot, cx.waker());
        loop {
            let lease = match this.held.judge() {
                Ok(lease) => lease,
                Err(why) => return this.finish(why),
            };
            if lease == NO_LEASE {
                this.sleep = None;
                return Poll::Pending;
            }
            // The instant of the deadline is read from the clock the lease
            // is judged on; should the timer fire a hair before the judge
            // sees the lapse, the next arming is a millisecond later, so
            // that a deadline is never spun on.
            let mut at = instant_of_monotonic(lease);
            if this.fired == Some(lease) {
                at += Duration::from_millis(1);
            }
            let sleep = match &mut this.sleep {
                Some(sleep) => {
                    sleep.reset(at);
                    sleep
                }
                None => this.sleep.insert(Sleep::new(&Clock::Monotonic, at)),
            };
            if sleep.poll(cx).is_pending() {
                return Poll::Pending;
            }
            // The deadline has passed: judge again.
            this.fired = Some(lease);
        }
    }
}

impl<K> Drop for ProcessLost<'_, K> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.held.unwatch(slot);
        }
    }
}

impl<K> fmt::Debug for ProcessLost<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessLost")
            .field("token", &self.held.token())
            .field("registered", &self.slot.is_some())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// The future returned by
/// [`ProcessGuard::keep_alive`](super::ProcessGuard::keep_alive) (and
/// [`OwnedProcessGuard::keep_alive`](super::OwnedProcessGuard::keep_alive)):
/// renews the grant's lease with `lease` on its first poll and then every
/// `interval` (timed by the crate's timer on the host's monotonic clock),
/// until it is dropped.
///
/// It never resolves while all goes well; it resolves at the first
/// failure, with the reason: the grant lost its authority (noticed by its
/// [`ProcessLost`], or by a renewal: a lapsed grant is never revived), its
/// file was damaged, or [`ProcessLockError::InvalidOptions`] on the first
/// poll for a lease of zero or over [`DEFAULT_MAX_LEASE`], or an interval
/// of zero or not shorter than the lease.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it stops the renewals (the lease then runs out at
/// its deadline) and changes nothing else.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-pkeep-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// # futures::executor::block_on(async {
/// use std::time::Duration;
/// use futures::future::{select, Either};
/// use keylock::{LockOptions, ProcessLockTable};
/// let table = ProcessLockTable::open(&dir)?;
/// let lease = Duration::from_secs(10);
/// let guard = table.lock_with("job", LockOptions::new().lease(lease)).await?;
/// let keep = guard.keep_alive(Duration::from_secs(3), lease);
/// let work = async { 42 }; // long work under the guard
/// match select(std::pin::pin!(work), keep).await {
///     Either::Left((answer, _)) => assert_eq!(answer, 42),
///     Either::Right((why, _)) => panic!("lost the key: {why}"),
/// }
/// let token = guard.check()?; // commit with it
/// # let _ = token;
/// # Ok::<(), keylock::ProcessLockError>(())
/// # }).unwrap();
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct ProcessKeepAlive<'a, K> {
    lost: ProcessLost<'a, K>,
    interval: Duration,
    lease: Duration,
    /// When the next renewal is due: `None` on the first poll.
    next: Option<Instant>,
    sleep: Option<Sleep>,
    invalid: Option<ProcessLockError>,
    done: bool,
}

impl<'a, K> ProcessKeepAlive<'a, K> {
    pub(crate) fn new(held: &'a Held<K>, interval: Duration, lease: Duration) -> Self {
        let invalid = if lease.is_zero() || lease > DEFAULT_MAX_LEASE {
            Some(ProcessLockError::InvalidOptions {
                option: "lease",
                reason: format!("{lease:?} is not between 1ns and {DEFAULT_MAX_LEASE:?}"),
            })
        } else if interval.is_zero() || interval >= lease {
            Some(ProcessLockError::InvalidOptions {
                option: "keep-alive interval",
                reason: format!(
                    "{interval:?} must be above zero and shorter than the lease ({lease:?}), \
                     or the lease lapses between renewals"
                ),
            })
        } else {
            None
        };
        Self {
            lost: ProcessLost::new(held),
            interval,
            lease,
            next: None,
            sleep: None,
            invalid,
            done: false,
        }
    }

    fn fail(&mut self, why: ProcessLockError) -> Poll<ProcessLockError> {
        self.done = true;
        self.sleep = None;
        Poll::Ready(why)
    }
}

impl<K> Future for ProcessKeepAlive<'_, K> {
    type Output = ProcessLockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ProcessLockError> {
        let this = &mut *self;
        assert!(
            !this.done,
            "keylock: `ProcessKeepAlive` polled after it completed"
        );
        if let Some(why) = this.invalid.take() {
            return this.fail(why);
        }
        loop {
            if let Poll::Ready(why) = Pin::new(&mut this.lost).poll(cx) {
                return this.fail(why);
            }
            if let Some(at) = this.next {
                let sleep = match &mut this.sleep {
                    Some(sleep) => {
                        sleep.reset(at);
                        sleep
                    }
                    None => this.sleep.insert(Sleep::new(&Clock::Monotonic, at)),
                };
                if sleep.poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            if let Err(why) = this.lost.held.renew(this.lease) {
                return this.fail(why);
            }
            // The interval is shorter than the lease, itself at most an
            // hour: it cannot overflow the clock.
            this.next = Some(Instant::now() + this.interval);
            // Then look at the loss again: the renewal woke it.
        }
    }
}

impl<K> fmt::Debug for ProcessKeepAlive<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessKeepAlive")
            .field("lost", &self.lost)
            .field("interval", &self.interval)
            .field("lease", &self.lease)
            .field("next", &self.next)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}
