//! Loss notification and keep-alive at the cluster scope: [`ClusterLost`],
//! a future that resolves when a grant loses its authority, and
//! [`ClusterKeepAlive`], one that renews the lease of a grant that has its
//! own every interval and resolves at the first failure.
//!
//! A grant's authority is judged as `check()` judges it, locally: the lease
//! that carries it is certainly alive (not marked lost, and within the
//! bound before which etcd cannot have ended it). The bound moves only
//! forward with each answered keep-alive, and the session is marked lost
//! by its keep-alive task (etcd says the lease is gone, the table revoked
//! it, keep-alives failed past the bound). So a `ClusterLost` judges once,
//! then waits for the first of two events, each with no polling: the
//! session marked lost (a watch channel the session flips once), or the
//! crate's timer at the bound, when it judges again (the bound has moved:
//! it waits again). It runs on any executor: neither event needs tokio's
//! timer.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::error::ClusterLockError;
use super::guard::Held;
use super::recipe::GrantLease;
use crate::time::clock::Clock;
use crate::time::timer::Sleep;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The future returned by [`ClusterGuard::lost`](super::ClusterGuard::lost)
/// (and [`OwnedClusterGuard::lost`](super::OwnedClusterGuard::lost)):
/// resolves when the grant may have lost its authority, with the error its
/// `check()` then gives ([`ClusterLockError::Expired`]).
///
/// It resolves the moment the session is marked lost (etcd said its lease
/// is gone, it was revoked, or keep-alives failed past its bound), or at
/// the bound itself when no answered keep-alive moved it (woken by a
/// timer); at once if the grant had already lost its key. A grant with a
/// lease of its own resolves at that lease's bound unless renewed
/// ([`ClusterGuard::renew`](super::ClusterGuard::renew),
/// [`ClusterGuard::keep_alive`](super::ClusterGuard::keep_alive)).
///
/// # Cancel safety
///
/// Cancel-safe: dropping it changes nothing.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// use futures::future::{select, Either};
/// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
/// let guard = table.lock("job").await?;
/// let work = async { /* long work under the guard */ };
/// match select(std::pin::pin!(work), guard.lost()).await {
///     Either::Left(((), _)) => { guard.check()?; /* commit */ }
///     Either::Right((why, _)) => eprintln!("stopped: {why}"),
/// }
/// # Ok(()) }
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct ClusterLost<'a> {
    inner: BoxFuture<'a, ClusterLockError>,
}

impl<'a> ClusterLost<'a> {
    pub(crate) fn new<K: Sync>(held: &'a Held<K>) -> Self {
        Self {
            inner: Box::pin(watch(held)),
        }
    }
}

impl Future for ClusterLost<'_> {
    type Output = ClusterLockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ClusterLockError> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ClusterLost<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterLost").finish_non_exhaustive()
    }
}

/// Waits until `check()` fails, and returns its error.
async fn watch<K>(held: &Held<K>) -> ClusterLockError {
    let mut lost_rx = match held.lease() {
        GrantLease::Session(s) => Some(s.state.lost_receiver()),
        GrantLease::Own { .. } => None,
    };
    // The bound the timer last fired for: should it fire a hair before the
    // judgement sees the bound passed, the next arming is a millisecond
    // later, so that a bound is never spun on.
    let mut fired: Option<Instant> = None;
    loop {
        if let Err(why) = held.check() {
            return why;
        }
        let bound = held.lease().valid_until();
        let at = if fired == Some(bound) {
            bound + Duration::from_millis(1)
        } else {
            bound
        };
        let mut sleep = Sleep::new(&Clock::Monotonic, at);
        let mut timer = pin!(poll_fn(move |cx| sleep.poll(cx)));
        let timed_out = match &mut lost_rx {
            Some(rx) => {
                let mut changed = pin!(rx.changed());
                poll_fn(|cx| {
                    if let Poll::Ready(r) = changed.as_mut().poll(cx) {
                        // A closed channel (never, while a grant keeps its
                        // session) leaves the timer alone to wake it.
                        if r.is_ok() {
                            return Poll::Ready(false);
                        }
                    }
                    timer.as_mut().poll(cx).map(|()| true)
                })
                .await
            }
            None => {
                timer.await;
                true
            }
        };
        if timed_out {
            fired = Some(bound);
        }
    }
}

/// The future returned by
/// [`ClusterGuard::keep_alive`](super::ClusterGuard::keep_alive) (and
/// [`OwnedClusterGuard::keep_alive`](super::OwnedClusterGuard::keep_alive)):
/// keeps the lease that carries the grant alive until it is dropped, and
/// resolves at the first failure with the reason.
///
/// A grant carried by the session's lease (a lock without
/// [`LockOptions::lease`](crate::LockOptions::lease)) is kept alive by the
/// session's own task already: this future renews nothing and resolves
/// when the grant is lost (as [`ClusterLost`]). A grant with a lease of its
/// own is renewed on the first poll and then every `interval` (one round
/// trip each, with etcd's TTL of that lease), and the future resolves at
/// the first failed renewal or the first loss.
///
/// # Errors
///
/// It resolves to [`ClusterLockError::InvalidOptions`] on the first poll if
/// `interval` is zero or not shorter than the TTL of the lease that
/// carries the grant (the lease would end between renewals).
///
/// # Cancel safety
///
/// Cancel-safe: dropping it stops the renewals (a renewal in flight may
/// still extend the lease in etcd, never the local bound) and changes
/// nothing else.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// use std::time::Duration;
/// use futures::future::{select, Either};
/// use keylock::LockOptions;
/// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
/// let guard = table.lock_with("job", LockOptions::new().lease(Duration::from_secs(6))).await?;
/// let keep = guard.keep_alive(Duration::from_secs(2));
/// let work = async { /* long work under the guard */ };
/// match select(std::pin::pin!(work), keep).await {
///     Either::Left(((), _)) => { guard.check()?; /* commit */ }
///     Either::Right((why, _)) => eprintln!("stopped: {why}"),
/// }
/// # Ok(()) }
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct ClusterKeepAlive<'a> {
    inner: BoxFuture<'a, ClusterLockError>,
}

impl<'a> ClusterKeepAlive<'a> {
    pub(crate) fn new<K: Sync>(held: &'a Held<K>, interval: Duration) -> Self {
        Self {
            inner: Box::pin(keep_alive(held, interval)),
        }
    }
}

impl Future for ClusterKeepAlive<'_> {
    type Output = ClusterLockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ClusterLockError> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ClusterKeepAlive<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterKeepAlive").finish_non_exhaustive()
    }
}

async fn keep_alive<K: Sync>(held: &Held<K>, interval: Duration) -> ClusterLockError {
    let ttl = held.lease().ttl();
    if interval.is_zero() || interval >= ttl {
        return ClusterLockError::InvalidOptions {
            option: "keep-alive interval",
            reason: format!(
                "{interval:?} must be above zero and shorter than the lease's TTL ({ttl:?}), \
                 or the lease ends between renewals"
            ),
        };
    }
    let mut lost = pin!(watch(held));
    if matches!(held.lease(), GrantLease::Session(_)) {
        // The session's task keeps its lease alive.
        return lost.await;
    }
    loop {
        if let Err(why) = held.renew().await {
            return why;
        }
        let mut sleep = Sleep::new(&Clock::Monotonic, Instant::now() + interval);
        let lost_first = poll_fn(|cx| {
            if let Poll::Ready(why) = lost.as_mut().poll(cx) {
                return Poll::Ready(Some(why));
            }
            sleep.poll(cx).map(|()| None)
        })
        .await;
        if let Some(why) = lost_first {
            return why;
        }
    }
}
