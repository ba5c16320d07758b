//! The futures returned by `lock` and `lock_owned`, and the one state machine
//! they share.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::guard::{Guard, Held, OwnedGuard};
use crate::key_slot::KeyPtr;
use crate::queue::{Attempt, Grant};
use crate::table::{DefaultHashBuilder, LockTable};

/// Where an acquisition stands.
enum State<K> {
    /// Not polled yet: owns the key it was given.
    Start(K),
    /// Registered in `slot` of the key's queue.
    Waiting { slot: u32, key: KeyPtr<K> },
    /// Completed; the grant belongs to a guard now.
    Done,
}

/// The acquisition state machine shared by [`Lock`] and [`LockOwned`].
///
/// `T` is how it reaches the table: a borrow or an `Arc`.
struct Acquire<T: TableHandle<K>, K> {
    table: Option<T>,
    hash: u64,
    state: State<K>,
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
    K: Eq + Hash,
    S: BuildHasher,
{
    fn new(table: T, hash: u64, key: K) -> Self {
        Self {
            table: Some(table),
            hash,
            state: State::Start(key),
        }
    }

    /// Polls for the grant; on `Ready` also gives back the table handle.
    #[inline]
    fn poll_acquire(&mut self, cx: &mut Context<'_>) -> Poll<(T, Held<K>)> {
        let table = self
            .table
            .as_deref()
            .expect("keylock: lock future polled after it completed");
        let shard = table.shard(self.hash);
        let grant = match std::mem::replace(&mut self.state, State::Done) {
            State::Start(key) => {
                let mut state = shard.state.lock();
                match state.acquire_or_enqueue(self.hash, key, cx.waker()) {
                    Attempt::Acquired(grant) => {
                        shard.counters.acquired(false);
                        drop(state);
                        grant
                    }
                    Attempt::Queued {
                        slot,
                        key,
                        duplicate,
                    } => {
                        drop(state);
                        self.state = State::Waiting { slot, key };
                        drop(duplicate);
                        return Poll::Pending;
                    }
                }
            }
            State::Waiting { slot, key } => {
                let mut state = shard.state.lock();
                match state.poll_slot(slot, cx.waker()) {
                    Some(token) => {
                        shard.counters.acquired(true);
                        drop(state);
                        Grant { key, token }
                    }
                    None => {
                        drop(state);
                        self.state = State::Waiting { slot, key };
                        return Poll::Pending;
                    }
                }
            }
            State::Done => panic!("keylock: lock future polled after it completed"),
        };
        let table = self.table.take().expect("checked above");
        Poll::Ready((
            table,
            Held {
                hash: self.hash,
                grant,
            },
        ))
    }
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
            State::Waiting { .. } => "waiting",
            State::Done => "done",
        };
        f.debug_struct("Acquire").field("state", &state).finish()
    }
}

/// The future returned by [`LockTable::lock`]: resolves to a [`Guard`] once
/// the key is this caller's.
///
/// # Cancel safety
///
/// Dropping it at any point leaves the table as if `lock` had never been
/// called, or, if the key had already been handed to it, passes the key on.
#[must_use = "futures do nothing unless polled"]
pub struct Lock<'a, K, S = DefaultHashBuilder> {
    inner: Acquire<&'a LockTable<K, S>, K>,
}

impl<'a, K: Eq + Hash, S: BuildHasher> Lock<'a, K, S> {
    pub(crate) fn new(table: &'a LockTable<K, S>, hash: u64, key: K) -> Self {
        Self {
            inner: Acquire::new(table, hash, key),
        }
    }
}

impl<'a, K: Eq + Hash, S: BuildHasher> Future for Lock<'a, K, S> {
    type Output = Guard<'a, K, S>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner
            .poll_acquire(cx)
            .map(|(table, held)| Guard::new(table, held))
    }
}

// The key is never pinned: it is moved into the table on the first poll.
impl<K, S> Unpin for Lock<'_, K, S> {}

impl<K, S> fmt::Debug for Lock<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Lock").field(&self.inner).finish()
    }
}

/// The future returned by [`LockTable::lock_owned`]: resolves to an
/// [`OwnedGuard`] once the key is this caller's.
///
/// # Cancel safety
///
/// As [`Lock`].
#[must_use = "futures do nothing unless polled"]
pub struct LockOwned<K, S = DefaultHashBuilder> {
    inner: Acquire<Arc<LockTable<K, S>>, K>,
}

impl<K: Eq + Hash, S: BuildHasher> LockOwned<K, S> {
    pub(crate) fn new(table: Arc<LockTable<K, S>>, hash: u64, key: K) -> Self {
        Self {
            inner: Acquire::new(table, hash, key),
        }
    }
}

impl<K: Eq + Hash, S: BuildHasher> Future for LockOwned<K, S> {
    type Output = OwnedGuard<K, S>;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner
            .poll_acquire(cx)
            .map(|(table, held)| OwnedGuard::new(table, held))
    }
}

// The key is never pinned: it is moved into the table on the first poll.
impl<K, S> Unpin for LockOwned<K, S> {}

impl<K, S> fmt::Debug for LockOwned<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("LockOwned").field(&self.inner).finish()
    }
}
