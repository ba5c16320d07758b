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
    Invalid(LockError),
    /// Registered in `slot` of the key's queue.
    Waiting { slot: u32, key: KeyPtr<K> },
    /// Completed; the grant belongs to a guard now.
    Done,
}

/// The caller's bound on its wait.
#[derive(Debug, Clone, Copy)]
enum Patience {
    /// Wait as long as it takes.
    Forever,
    /// Not started yet: starts at the first poll.
    For(Duration),
    /// Started at `start`; gives up at `until`.
    Until { start: Instant, until: Instant },
}

/// The acquisition state machine shared by every lock future.
///
/// `T` is how it reaches the table: a borrow or an `Arc`.
struct Acquire<T: TableHandle<K>, K> {
    table: Option<T>,
    hash: u64,
    state: State<K>,
    lease: Option<Duration>,
    patience: Patience,
    sleep: Option<Sleep>,
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
    K: Eq + Hash,
    S: BuildHasher,
{
    fn new(table: T, key: K, lease: Option<Duration>, timeout: Option<Duration>) -> Self {
        let hash = table.hash(&key);
        let (state, lease) = match table.leases().resolve(lease) {
            Ok(lease) => (State::Start(key), lease),
            Err(err) => (State::Invalid(err), None),
        };
        Self {
            table: Some(table),
            hash,
            state,
            lease,
            patience: timeout.map_or(Patience::Forever, Patience::For),
            sleep: None,
        }
    }

    /// Polls for the grant; on `Ready(Ok)` also gives back the table handle.
    fn poll_acquire(&mut self, cx: &mut Context<'_>) -> Poll<Result<(T, Held<K>), LockError>> {
        loop {
            let table = self
                .table
                .as_deref()
                .expect("keylock: lock future polled after it completed");
            let shard = table.shard(self.hash);
            let mut ctx = Ctx::new(table.clock(), &shard.counters);
            let (outcome, wake_at) = match std::mem::replace(&mut self.state, State::Done) {
                State::Invalid(err) => return Poll::Ready(Err(err)),
                State::Done => panic!("keylock: lock future polled after it completed"),
                State::Start(key) => {
                    if let Patience::For(timeout) = self.patience {
                        let start = ctx.now();
                        self.patience = match start.checked_add(timeout) {
                            Some(until) => Patience::Until { start, until },
                            // Too far to represent: wait for ever.
                            None => Patience::Forever,
                        };
                        if timeout.is_zero() {
                            let lease = self.lease;
                            return Poll::Ready(
                                match try_once(table, self.hash, key, lease, ctx) {
                                    Ok(grant) => Ok(self.finish(grant)),
                                    Err(diagnosis) => Err(self.timeout_error(None, diagnosis)),
                                },
                            );
                        }
                    }
                    let mut state = shard.state.lock();
                    let attempt =
                        state.acquire_or_enqueue(self.hash, key, self.lease, cx.waker(), &mut ctx);
                    drop(state);
                    ctx.finish();
                    match attempt {
                        Attempt::Acquired(grant) => (Ok(grant), None),
                        Attempt::Queued { slot, key, wake_at } => {
                            self.state = State::Waiting { slot, key };
                            (Err(None), wake_at)
                        }
                    }
                }
                State::Waiting { slot, key } => {
                    let gave_up = match self.patience {
                        Patience::Until { until, .. } => ctx.now() >= until,
                        _ => false,
                    };
                    let mut state = shard.state.lock();
                    let result = if gave_up {
                        match state.time_out_slot(self.hash, key, slot, cx.waker(), &mut ctx) {
                            Ok(grant) => (Ok(grant), None),
                            Err(diagnosis) => (Err(Some(diagnosis)), None),
                        }
                    } else {
                        match state.poll_slot(self.hash, key, slot, cx.waker(), &mut ctx) {
                            SlotPoll::Granted(grant) => (Ok(grant), None),
                            SlotPoll::Waiting { wake_at } => {
                                self.state = State::Waiting { slot, key };
                                (Err(None), wake_at)
                            }
                        }
                    };
                    drop(state);
                    let now = gave_up.then(|| ctx.now());
                    ctx.finish();
                    match result {
                        (Err(Some(diagnosis)), _) => {
                            self.sleep = None;
                            return Poll::Ready(Err(self.timeout_error(now, diagnosis)));
                        }
                        other => other,
                    }
                }
            };
            match outcome {
                Ok(grant) => return Poll::Ready(Ok(self.finish(grant))),
                Err(_) => {
                    if self.arm_timer(wake_at, cx).is_pending() {
                        return Poll::Pending;
                    }
                    // A deadline has already passed: judge again.
                }
            }
        }
    }

    fn timeout_error(&self, now: Option<Instant>, diagnosis: Diagnosis) -> LockError {
        let waited = match (self.patience, now) {
            (Patience::Until { start, .. }, Some(now)) => now.saturating_duration_since(start),
            _ => Duration::ZERO,
        };
        LockError::Timeout {
            waited,
            holder: diagnosis.holder,
            held_for: diagnosis.held_for,
            ahead: diagnosis.ahead,
        }
    }

    fn finish(&mut self, grant: Grant<K>) -> (T, Held<K>) {
        self.sleep = None;
        let table = self.table.take().expect("present until completion");
        let held = Held::new(self.hash, grant, table.epoch());
        (table, held)
    }

    /// Arms the timer for the earliest of the holder's lease deadline (when
    /// this waiter heads the queue) and the caller's own timeout.
    fn arm_timer(&mut self, wake_at: Option<Instant>, cx: &mut Context<'_>) -> Poll<()> {
        let until = match self.patience {
            Patience::Until { until, .. } => Some(until),
            _ => None,
        };
        let at = match (wake_at, until) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(at) => at,
                None => {
                    self.sleep = None;
                    return Poll::Pending;
                }
            },
        };
        let table = self.table.as_deref().expect("present until completion");
        let sleep = match &mut self.sleep {
            Some(sleep) => {
                sleep.reset(at);
                sleep
            }
            None => self.sleep.insert(Sleep::new(table.clock(), at)),
        };
        sleep.poll(cx)
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
            .field("patience", &self.patience)
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
