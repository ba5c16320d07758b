//! The futures returned by `lock`, `lock_owned` and their `_with` variants,
//! and the one state machine they share.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::LockError;
use crate::guard::{Guard, Held, OwnedGuard};
use crate::key_slot::KeyPtr;
use crate::queue::{Attempt, Ctx, Diagnosis, Grant, SlotPoll};
use crate::table::{DefaultHashBuilder, LockTable};
use crate::timer::Sleep;

/// Where an acquisition stands.
enum State<K> {
    /// Not polled yet: owns the key it was given.
    Start(K),
    /// The options were invalid; reported on the first poll.
    Invalid(Box<LockError>),
    /// Registered in `slot` of the key's queue.
    Waiting { slot: u32, key: KeyPtr<K> },
    /// Completed; the grant belongs to a guard now.
    Done,
}

/// The clock state of a wait that needs one: a timeout, or a timer at the
/// holder's lease deadline. Boxed, so that a plain lock future stays small
/// and only waits that use time pay for it.
#[derive(Debug)]
struct Timing {
    /// When the wait started (`None` until it first had to wait).
    start: Option<Instant>,
    /// When the caller gives up; `None` to wait for ever.
    until: Option<Instant>,
    sleep: Option<Sleep>,
}

/// The acquisition state machine shared by every lock future.
///
/// `T` is how it reaches the table: a borrow or an `Arc`.
struct Acquire<T: TableHandle<K>, K> {
    table: Option<T>,
    hash: u64,
    state: State<K>,
    lease: Option<Duration>,
    timeout: Option<Duration>,
    timing: Option<Box<Timing>>,
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
    K: Eq + Hash,
    S: BuildHasher,
{
    #[inline]
    fn new(table: T, key: K, lease: Option<Duration>, timeout: Option<Duration>) -> Self {
        let hash = table.hash(&key);
        let (state, lease) = match table.leases().resolve(lease) {
            Ok(lease) => (State::Start(key), lease),
            Err(err) => (State::Invalid(Box::new(err)), None),
        };
        Self {
            table: Some(table),
            hash,
            state,
            lease,
            timeout,
            timing: None,
        }
    }

    /// When the caller gives up, if it has started waiting with a timeout.
    fn until(&self) -> Option<Instant> {
        self.timing.as_ref().and_then(|t| t.until)
    }

    /// Polls for the grant; on `Ready(Ok)` also gives back the table handle.
    #[inline]
    fn poll_acquire(&mut self, cx: &mut Context<'_>) -> Poll<Result<(T, Held<K>), LockError>> {
        loop {
            let table = self
                .table
                .as_deref()
                .expect("keylock: lock future polled after it completed");
            let shard = table.shard(self.hash);
            let mut ctx = Ctx::new(table.clock(), &shard.counters);
            let wake_at = match std::mem::replace(&mut self.state, State::Done) {
                State::Start(key) => {
                    if self.timeout == Some(Duration::ZERO) {
                        let lease = self.lease;
                        return Poll::Ready(match try_once(table, self.hash, key, lease, ctx) {
                            Ok(grant) => Ok(self.finish(grant)),
                            Err(diagnosis) => Err(timeout_error(Duration::ZERO, diagnosis)),
                        });
                    }
                    let attempt = {
                        let mut state = shard.state.lock();
                        state.acquire_or_enqueue(self.hash, key, self.lease, cx.waker(), &mut ctx)
                    };
                    let started = match (&attempt, self.timeout) {
                        (Attempt::Queued { .. }, Some(timeout)) => {
                            let start = ctx.now();
                            // Too far to represent: wait for ever.
                            Some((start, start.checked_add(timeout)))
                        }
                        _ => None,
                    };
                    ctx.finish();
                    match attempt {
                        Attempt::Acquired(grant) => return Poll::Ready(Ok(self.finish(grant))),
                        Attempt::Queued { slot, key, wake_at } => {
                            self.state = State::Waiting { slot, key };
                            if let Some((start, until)) = started {
                                self.timing = Some(Box::new(Timing {
                                    start: Some(start),
                                    until,
                                    sleep: None,
                                }));
                            }
                            wake_at
                        }
                    }
                }
                State::Waiting { slot, key } => {
                    let gave_up = self.until().is_some_and(|until| ctx.now() >= until);
                    let polled = {
                        let mut state = shard.state.lock();
                        if gave_up {
                            match state.time_out_slot(self.hash, key, slot, cx.waker(), &mut ctx) {
                                Ok(grant) => Polled::Granted(grant),
                                Err(diagnosis) => Polled::GaveUp(diagnosis),
                            }
                        } else {
                            match state.poll_slot(self.hash, key, slot, cx.waker(), &mut ctx) {
                                SlotPoll::Granted(grant) => Polled::Granted(grant),
                                SlotPoll::Waiting { wake_at } => Polled::Waiting(wake_at),
                            }
                        }
                    };
                    let now = gave_up.then(|| ctx.now());
                    ctx.finish();
                    match polled {
                        Polled::Granted(grant) => return Poll::Ready(Ok(self.finish(grant))),
                        Polled::GaveUp(diagnosis) => {
                            let start = self.timing.take().and_then(|t| t.start);
                            let waited = match (start, now) {
                                (Some(start), Some(now)) => now.saturating_duration_since(start),
                                _ => Duration::ZERO,
                            };
                            return Poll::Ready(Err(timeout_error(waited, diagnosis)));
                        }
                        Polled::Waiting(wake_at) => {
                            self.state = State::Waiting { slot, key };
                            wake_at
                        }
                    }
                }
                State::Invalid(err) => return Poll::Ready(Err(*err)),
                State::Done => panic!("keylock: lock future polled after it completed"),
            };
            if self.arm_timer(wake_at, cx).is_pending() {
                return Poll::Pending;
            }
            // A deadline has already passed: judge again.
        }
    }

    #[inline]
    fn finish(&mut self, grant: Grant<K>) -> (T, Held<K>) {
        self.timing = None;
        let table = self.table.take().expect("present until completion");
        let held = Held::new(self.hash, grant);
        (table, held)
    }

    /// Arms the timer for the earliest of the holder's lease deadline (when
    /// this waiter heads the queue) and the caller's own timeout.
    fn arm_timer(&mut self, wake_at: Option<Instant>, cx: &mut Context<'_>) -> Poll<()> {
        let at = match (wake_at, self.until()) {
            (Some(a), Some(b)) => a.min(b),
            (Some(at), None) | (None, Some(at)) => at,
            (None, None) => {
                if let Some(timing) = &mut self.timing {
                    timing.sleep = None;
                }
                return Poll::Pending;
            }
        };
        let table = self.table.as_deref().expect("present until completion");
        let timing = self.timing.get_or_insert_with(|| {
            Box::new(Timing {
                start: None,
                until: None,
                sleep: None,
            })
        });
        let sleep = match &mut timing.sleep {
            Some(sleep) => {
                sleep.reset(at);
                sleep
            }
            None => timing.sleep.insert(Sleep::new(table.clock(), at)),
        };
        sleep.poll(cx)
    }
}

/// What polling a waiting slot found.
enum Polled<K> {
    Granted(Grant<K>),
    GaveUp(Diagnosis),
    Waiting(Option<Instant>),
}

fn timeout_error(waited: Duration, diagnosis: Diagnosis) -> LockError {
    LockError::Timeout {
        waited,
        holder: diagnosis.holder,
        held_for: diagnosis.held_for,
        ahead: diagnosis.ahead,
    }
}

/// A zero timeout: one attempt, no queueing.
fn try_once<K: Eq + Hash, S: BuildHasher>(
    table: &LockTable<K, S>,
    hash: u64,
    key: K,
    lease: Option<Duration>,
    mut ctx: Ctx<'_, K>,
) -> Result<Grant<K>, Diagnosis> {
    let mut state = table.shard(hash).state.lock();
    let result = match state.try_acquire(hash, key, lease, &mut ctx) {
        Ok(grant) => Ok(grant),
        Err(key) => {
            let diagnosis = state.diagnose(hash, &key, &mut ctx);
            ctx.count_timed_out();
            ctx.drop_later(key);
            Err(diagnosis)
        }
    };
    drop(state);
    ctx.finish();
    result
}

impl<T: TableHandle<K>, K> Drop for Acquire<T, K> {
    fn drop(&mut self) {
        if let State::Waiting { slot, key } = self.state {
            if let Some(table) = self.table.as_ref() {
                table.cancel(self.hash, key, slot);
            }
        }
    }
}

/// How an acquisition reaches its table: a borrow or an `Arc`.
pub(crate) trait TableHandle<K> {
    /// Drops the registration in `slot`; see [`LockTable::cancel`].
    fn cancel(&self, hash: u64, key: KeyPtr<K>, slot: u32);
}

impl<K, S> TableHandle<K> for &LockTable<K, S> {
    fn cancel(&self, hash: u64, key: KeyPtr<K>, slot: u32) {
        LockTable::cancel(self, hash, key, slot);
    }
}

impl<K, S> TableHandle<K> for Arc<LockTable<K, S>> {
    fn cancel(&self, hash: u64, key: KeyPtr<K>, slot: u32) {
        LockTable::cancel(self, hash, key, slot);
    }
}

impl<T: TableHandle<K>, K> fmt::Debug for Acquire<T, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Start(_) => "start",
            State::Invalid(_) => "invalid",
            State::Waiting { .. } => "waiting",
            State::Done => "done",
        };
        f.debug_struct("Acquire")
            .field("state", &state)
            .field("lease", &self.lease)
            .field("timeout", &self.timeout)
            .field("timing", &self.timing)
            .finish()
    }
}

macro_rules! lock_future {
    (
        $(#[$meta:meta])*
        $name:ident<$($lt:lifetime,)? K, S>, handle: $handle:ty, output: $out:ty,
        map: |$table:ident, $held:ident| $make:expr, result: $result:ident
    ) => {
        $(#[$meta])*
        #[must_use = "futures do nothing unless polled"]
        pub struct $name<$($lt,)? K, S = DefaultHashBuilder> {
            inner: Acquire<$handle, K>,
        }

        impl<$($lt,)? K: Eq + Hash, S: BuildHasher> $name<$($lt,)? K, S> {
            pub(crate) fn new(
                table: $handle,
                key: K,
                lease: Option<Duration>,
                timeout: Option<Duration>,
            ) -> Self {
                Self {
                    inner: Acquire::new(table, key, lease, timeout),
                }
            }
        }

        impl<$($lt,)? K: Eq + Hash, S: BuildHasher> Future for $name<$($lt,)? K, S> {
            type Output = $out;

            #[inline]
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
                self.inner
                    .poll_acquire(cx)
                    .map(|r| lock_future!(@$result r.map(|($table, $held)| $make)))
            }
        }

        // The key is never pinned: it is moved into the table on the first
        // poll, and the timer is boxed by its own crate or polled by `&mut`.
        impl<$($lt,)? K, S> Unpin for $name<$($lt,)? K, S> {}

        impl<$($lt,)? K, S> fmt::Debug for $name<$($lt,)? K, S> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&self.inner).finish()
            }
        }
    };
    (@infallible $r:expr) => {
        match $r {
            Ok(guard) => guard,
            // A plain lock has no timeout and a lease validated when the
            // table was built.
            Err(err) => unreachable!("keylock: a plain lock cannot fail: {err}"),
        }
    };
    (@fallible $r:expr) => {
        $r
    };
}

lock_future! {
    /// The future returned by [`LockTable::lock`]: resolves to a [`Guard`]
    /// once the key is this caller's.
    ///
    /// # Cancel safety
    ///
    /// Dropping it at any point leaves the table as if `lock` had never been
    /// called, or, if the key had already been handed to it, passes the key
    /// on.
    Lock<'a, K, S>, handle: &'a LockTable<K, S>, output: Guard<'a, K, S>,
    map: |table, held| Guard::new(table, held), result: infallible
}

lock_future! {
    /// The future returned by [`LockTable::lock_owned`]: resolves to an
    /// [`OwnedGuard`] once the key is this caller's.
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`].
    LockOwned<K, S>, handle: Arc<LockTable<K, S>>, output: OwnedGuard<K, S>,
    map: |table, held| OwnedGuard::new(table, held), result: infallible
}

lock_future! {
    /// The future returned by [`LockTable::lock_with`]: resolves to a
    /// [`Guard`], or to a [`LockError`] if the options were invalid or the
    /// timeout ran out.
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`]. A timeout is the same as dropping the future at that
    /// moment, except that it reports what it waited on.
    LockWith<'a, K, S>, handle: &'a LockTable<K, S>, output: Result<Guard<'a, K, S>, LockError>,
    map: |table, held| Guard::new(table, held), result: fallible
}

lock_future! {
    /// The future returned by [`LockTable::lock_owned_with`]: as [`LockWith`],
    /// resolving to an [`OwnedGuard`].
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`].
    LockOwnedWith<K, S>, handle: Arc<LockTable<K, S>>, output: Result<OwnedGuard<K, S>, LockError>,
    map: |table, held| OwnedGuard::new(table, held), result: fallible
}
