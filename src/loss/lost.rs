//! Loss notification: the [`Lost`] future a guard hands out, which resolves
//! when its grant loses its authority. It is a layer over the key machine's
//! grant watchers (`keys/watch.rs`): the key machine keeps, per shard, the
//! wakers of whoever watches a grant, and wakes them when the grant ends.
//!
//! A grant loses its authority when it is *displaced*: its lease lapsed and
//! the lapse was noticed, or it was revoked (`revoke`, `revoke_grant`). Every
//! displacement runs under the shard lock through one function
//! (`Keys::displace` in `queue.rs`), which hands the wakers registered for
//! the displaced token to the operation's leftovers, woken after the unlock.
//! A lapse nobody notices is noticed by the `Lost` future itself: it arms a
//! timer at the grant's deadline and, when it fires, asks the table again
//! (settling the lapse). A renewal that moves the deadline earlier wakes the
//! watchers so that they re-arm; one that moves it later does not: their
//! timer fires at the old deadline, they find the grant live, and re-arm.
//!
//! The registry is a slab of slots (token, waker) behind the shard lock: no
//! `unsafe`, no node inside the future, and nothing at all for a guard that
//! never asks: it stays an empty `Vec` until a `Lost` registers, and a
//! displacement looks at it only after checking that it holds a watcher.
//! Releases never look: a `Lost` borrows its guard, so a grant being
//! released has no watcher left (except a `Lost` leaked with `mem::forget`,
//! whose slot stays taken and is never woken again: tokens are not reused).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::error::LockError;
use crate::keys::Watch;
use crate::table::guard::Held;
use crate::table::{DefaultHashBuilder, LockTable};
use crate::time::timer::Sleep;

/// The future returned by [`Guard::lost`](crate::Guard::lost) and
/// [`OwnedGuard::lost`](crate::OwnedGuard::lost): resolves when the grant
/// loses its authority, to [`LockError::Expired`] with its token.
///
/// It resolves when the grant's lease lapses (at the deadline, woken by a
/// timer, re-armed if the grant is renewed meanwhile), or at once when it is
/// revoked ([`LockTable::revoke`], [`LockTable::revoke_grant`]); immediately
/// if that already happened. A grant without a lease that is never revoked
/// keeps it pending for ever. Every `Lost` of a grant is woken, however many
/// there are.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it unregisters it and changes nothing else.
///
/// ```
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let guard = table.lock("job").await;
/// let token = guard.token();
/// assert!(table.revoke_grant("job", token));
/// let why = guard.lost().await;
/// assert_eq!(why, keylock::LockError::Expired { token, key: None });
/// # });
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct Lost<'a, K, S = DefaultHashBuilder> {
    table: &'a LockTable<K, S>,
    held: &'a Held<K>,
    /// Its slot in the shard's watchers, while registered.
    slot: Option<usize>,
    /// The timer at the grant's deadline.
    sleep: Option<Sleep>,
    done: bool,
}

impl<'a, K, S> Lost<'a, K, S> {
    pub(crate) fn new(table: &'a LockTable<K, S>, held: &'a Held<K>) -> Self {
        Self {
            table,
            held,
            slot: None,
            sleep: None,
            done: false,
        }
    }

    /// The table of the grant watched.
    pub(crate) fn table(&self) -> &'a LockTable<K, S> {
        self.table
    }

    /// Renews the grant watched; see `Guard::renew`.
    pub(crate) fn renew(&self, lease: std::time::Duration) -> Result<(), LockError> {
        self.held.renew(self.table, lease)
    }

    fn watch(&mut self, cx: &Context<'_>) -> Watch {
        let watch = self
            .held
            .watch(self.table, &mut self.slot, cx.waker(), None);
        match watch {
            Watch::NeedWaker => {
                // `Waker::clone` is user code: outside the lock.
                let fresh = cx.waker().clone();
                self.held
                    .watch(self.table, &mut self.slot, cx.waker(), Some(fresh))
            }
            watch => watch,
        }
    }
}

impl<K, S> Future for Lost<'_, K, S> {
    type Output = LockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LockError> {
        let this = &mut *self;
        assert!(!this.done, "keylock: `Lost` polled after it completed");
        loop {
            match this.watch(cx) {
                Watch::Lost => {
                    this.done = true;
                    // Holds a waker: dropped here, outside any lock.
                    this.sleep = None;
                    return Poll::Ready(LockError::Expired {
                        token: this.held.token(),
                        // SAFETY: the guard `held` belongs to points at
                        // the key, which keeps its entry in the table.
                        key: this.table.name_key(unsafe { this.held.key_ptr().get() }),
                    });
                }
                Watch::NeedWaker => unreachable!("keylock: a fresh waker was given"),
                Watch::Live { deadline: None } => {
                    this.sleep = None;
                    return Poll::Pending;
                }
                Watch::Live { deadline: Some(at) } => {
                    let sleep = match &mut this.sleep {
                        Some(sleep) => {
                            sleep.reset(at);
                            sleep
                        }
                        None => this.sleep.insert(Sleep::new(this.table.clock(), at)),
                    };
                    if sleep.poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // The deadline has passed: ask again, which settles the
                    // lapse (a renewal since then moved the deadline: re-arm).
                }
            }
        }
    }
}

impl<K, S> Drop for Lost<'_, K, S> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.held.unwatch(self.table, slot);
        }
    }
}

impl<K, S> fmt::Debug for Lost<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lost")
            .field("token", &self.held.token())
            .field("registered", &self.slot.is_some())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// A guard's [`lost`](crate::Guard::lost): loss notification is a layer
/// over the guard, defined here rather than in `guard.rs`.
macro_rules! loss_methods {
    () => {
        /// A future that resolves when this grant loses its authority: its
        /// lease lapses (woken by a timer at the deadline; a renewal
        /// meanwhile is taken into account) or it is revoked (woken at
        /// once). It resolves to [`LockError::Expired`] with this grant's
        /// token, immediately if that has already happened.
        ///
        /// Several may be made and awaited at once (say, one per task that
        /// works under the guard); each is woken. Creating none costs
        /// nothing.
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it changes nothing.
        ///
        /// ```
        /// # futures::executor::block_on(async {
        /// use futures::future::{select, Either};
        /// let table = keylock::LockTable::new();
        /// let guard = table.lock("job").await;
        /// table.revoke("job"); // an operator takes the key away
        /// let work = std::future::pending::<()>(); // long work under the guard
        /// match select(std::pin::pin!(work), guard.lost()).await {
        ///     Either::Left(_) => unreachable!(),
        ///     Either::Right((why, _)) => assert!(why.to_string().contains("lost the key")),
        /// };
        /// # });
        /// ```
        pub fn lost(&self) -> Lost<'_, K, S> {
            Lost::new(&*self.table, &self.held)
        }
    };
}

impl<K, S> crate::Guard<'_, K, S> {
    loss_methods!();
}

impl<K, S> crate::OwnedGuard<K, S> {
    loss_methods!();
}
