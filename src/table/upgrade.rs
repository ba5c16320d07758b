//! The future returned by `upgrade`: a shared grant made exclusive.
//!
//! It is a lock future ([`Acquire`]) started from the guard's grant rather
//! than from a key: the table links its waiter at the head of the key's
//! queue and grants it once the other shared holders are gone. On success
//! the guard's grant changes in place (a new token, the same lease); if the
//! future is dropped after the grant was made but before it looked, the
//! grant is made shared again and the guard takes its new token, so a guard
//! never holds the key exclusively without its caller knowing.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::error::LockError;
use crate::keys::deferred::Leftovers;
use crate::support::lease::LockOptions;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::acquire::Acquire;
use crate::table::guard::{Guard, Held, OwnedGuard};
use crate::table::{DefaultHashBuilder, LockTable};

use pin_project_lite::pin_project;

pin_project! {
    /// The future returned by [`Guard::upgrade`](crate::Guard::upgrade) and
    /// [`OwnedGuard::upgrade`](crate::OwnedGuard::upgrade): resolves to the
    /// grant's new token once it holds the key exclusively.
    ///
    /// # Cancel safety
    ///
    /// Dropping it leaves the guard shared: its waiter leaves the queue, or, if
    /// the upgrade had already been granted, the grant is made shared again
    /// (admitting the shared waiters behind it) and the guard carries its new
    /// token.
    #[must_use = "futures do nothing unless polled"]
    pub struct Upgrade<'g, K, S = DefaultHashBuilder> {
        #[pin]
        inner: Acquire<&'g LockTable<K, S>, K>,
        held: &'g mut Held<K>,
    }

    impl<K, S> PinnedDrop for Upgrade<'_, K, S> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let mut left = Leftovers::default();
            if let Some(granted) = this.inner.cancel_upgrade(&mut left) {
                this.held
                    .regrant(granted.token, granted.deadline, Mode::Shared);
            }
            left.flush();
        }
    }
}

// `Guard::upgrade` is defined here, beside the future it returns, so the
// guard does not import its upgrade (see docs/ARCHITECTURE.md, "The import
// circles left, and why").
macro_rules! upgrade_methods {
    () => {
        /// Makes this shared grant exclusive. It waits only for the other
        /// shared holders of the key: it is served ahead of every queued
        /// waiter (as lock managers do). On success the guard holds the key
        /// exclusively under a new token, greater than every earlier grant's
        /// of the key (the lease deadline stays); the future resolves to it.
        /// An exclusive grant resolves at once with its token.
        ///
        /// # Errors
        ///
        /// [`LockError::UpgradeConflict`] at once if another shared holder is
        /// already upgrading (each would wait for the other: release this
        /// grant and retry); [`LockError::Expired`] if the grant lost the key
        /// (lapsed or revoked) before or while it waited.
        ///
        /// # Cancel safety
        ///
        /// Dropping the future leaves the guard shared; see [`Upgrade`].
        ///
        /// ```
        /// # futures::executor::block_on(async {
        /// let table = keylock::LockTable::new();
        /// let mut reader = table.lock_shared("row-1").await;
        /// let before = reader.token();
        /// let after = reader.upgrade().await?; // the only reader: at once
        /// assert!(after > before);
        /// assert_eq!(reader.mode(), keylock::Mode::Exclusive);
        /// # Ok::<(), keylock::LockError>(())
        /// # }).unwrap();
        /// ```
        pub fn upgrade(&mut self) -> Upgrade<'_, K, S> {
            self.upgrade_with(LockOptions::new())
        }

        /// Like [`upgrade`](Self::upgrade), giving up after the options'
        /// timeout or at their deadline ([`LockError::Timeout`], the guard
        /// still shared); their mode and lease are ignored.
        ///
        /// # Errors
        ///
        /// As [`upgrade`](Self::upgrade), and [`LockError::Timeout`].
        pub fn upgrade_with(&mut self, opts: LockOptions) -> Upgrade<'_, K, S> {
            Upgrade::new(&self.table, &mut self.held, opts)
        }
    };
}

impl<K: Eq + Hash, S: BuildHasher> Guard<'_, K, S> {
    upgrade_methods!();
}

impl<K: Eq + Hash, S: BuildHasher> OwnedGuard<K, S> {
    upgrade_methods!();
}

impl<'g, K: Eq + Hash, S: BuildHasher> Upgrade<'g, K, S> {
    pub(crate) fn new(
        table: &'g LockTable<K, S>,
        held: &'g mut Held<K>,
        opts: LockOptions,
    ) -> Self {
        let inner = Acquire::upgrade(table, held.hash(), held.key_ptr(), held.token(), opts);
        Self { inner, held }
    }
}

impl<K: Eq + Hash, S: BuildHasher> Future for Upgrade<'_, K, S> {
    type Output = Result<FencingToken, LockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let mut left = Leftovers::default();
        let polled = this.inner.as_mut().poll_upgrade(cx, &mut left);
        let out = match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(upgraded)) => {
                let deadline = upgraded.deadline();
                this.held
                    .regrant(upgraded.token(), deadline, Mode::Exclusive);
                Poll::Ready(Ok(upgraded.token()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(*err)),
        };
        let timing = if out.is_ready() {
            this.inner.take_timing()
        } else {
            None
        };
        drop(timing);
        left.flush();
        out
    }
}

impl<K, S> fmt::Debug for Upgrade<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upgrade")
            .field("token", &self.held.token())
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// An upgrade that owns its guard: a transaction's pending call keeps it
    /// in a cell its transaction may cancel when it ends (`transactions/pending.rs`),
    /// so the guard must go where the wait goes. It resolves to the guard and
    /// the upgrade's result: upgraded in place (a new token) on success,
    /// shared as before on failure. Dropped before it resolves, it leaves the
    /// queue (or makes an unobserved grant shared again), then releases the
    /// guard; [`into_guard`](Self::into_guard) gives the guard back instead,
    /// shared.
    pub(crate) struct UpgradeOwned<'t, K, S> {
        #[pin]
        inner: Acquire<&'t LockTable<K, S>, K>,
        // `None` once resolved (the guard went out with the output).
        guard: Option<Guard<'t, K, S>>,
    }

    impl<K, S> PinnedDrop for UpgradeOwned<'_, K, S> {
        fn drop(this: Pin<&mut Self>) {
            // The upgrade is undone first (shared again), then the guard, if
            // still here, drops as the fields do: released.
            let this = this.project();
            let mut left = Leftovers::default();
            if let Some(granted) = this.inner.cancel_upgrade(&mut left) {
                if let Some(guard) = this.guard.as_mut() {
                    guard
                        .held
                        .regrant(granted.token, granted.deadline, Mode::Shared);
                }
            }
            left.flush();
        }
    }
}

impl<'t, K: Eq + Hash, S: BuildHasher> UpgradeOwned<'t, K, S> {
    pub(crate) fn new(guard: Guard<'t, K, S>, opts: LockOptions) -> Self {
        let held = &guard.held;
        let inner = Acquire::upgrade(guard.table, held.hash(), held.key_ptr(), held.token(), opts);
        Self {
            inner,
            guard: Some(guard),
        }
    }
}

impl<'t, K, S> UpgradeOwned<'t, K, S> {
    /// Gives the guard back, shared: the upgrade's waiter leaves the queue,
    /// or a grant it was handed and did not observe is made shared again.
    /// `None` once the future resolved (its output had the guard).
    pub(crate) fn into_guard(self: Pin<&mut Self>) -> Option<Guard<'t, K, S>> {
        let this = self.project();
        let mut left = Leftovers::default();
        let granted = this.inner.cancel_upgrade(&mut left);
        let mut guard = this.guard.take();
        if let (Some(granted), Some(guard)) = (granted, guard.as_mut()) {
            guard
                .held
                .regrant(granted.token, granted.deadline, Mode::Shared);
        }
        left.flush();
        guard
    }
}

impl<'t, K: Eq + Hash, S: BuildHasher> Future for UpgradeOwned<'t, K, S> {
    type Output = (Guard<'t, K, S>, Result<FencingToken, LockError>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let mut left = Leftovers::default();
        let polled = this.inner.as_mut().poll_upgrade(cx, &mut left);
        let out = match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(upgraded)) => {
                let mut guard = this.guard.take().expect("polled after it resolved");
                guard
                    .held
                    .regrant(upgraded.token(), upgraded.deadline(), Mode::Exclusive);
                Poll::Ready((guard, Ok(upgraded.token())))
            }
            Poll::Ready(Err(err)) => {
                let guard = this.guard.take().expect("polled after it resolved");
                Poll::Ready((guard, Err(*err)))
            }
        };
        let timing = if out.is_ready() {
            this.inner.take_timing()
        } else {
            None
        };
        drop(timing);
        left.flush();
        out
    }
}
