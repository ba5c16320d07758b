//! Guards: proof of holding a key, released on drop, fenced when their
//! authority ends.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::error::LockError;
use crate::keys::deferred::Leftovers;
use crate::keys::Grant;
use crate::keys::Watch;
use crate::support::key_slot::KeyPtr;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::{DefaultHashBuilder, LockTable};
use crate::time::clock::Stamp;

/// What a guard holds: where its key lives, the token of its grant and its
/// lease deadline as last known to it.
#[derive(Debug)]
pub(crate) struct Held<K> {
    hash: u64,
    key: KeyPtr<K>,
    token: FencingToken,
    /// The lease deadline as granted or last renewed through this guard, and
    /// the grant's mode, in one word (see [`GrantCache`]); the deadline is
    /// kept to report when a lapsed grant
    /// ended once the table has let go of it. One word, so that a guard is
    /// five words and cheap to move. Written under the shard lock.
    deadline: GrantCache,
}

/// A guard's copy of its grant's deadline (a [`Stamp`], zero: none) and
/// mode, packed in one word so that a guard stays five words: the mode in
/// the top bit, which a stamp (nanoseconds since the process's clock epoch)
/// reaches only after 292 years.
#[derive(Debug)]
pub(crate) struct GrantCache(AtomicU64);

const SHARED_BIT: u64 = Stamp::SHARED_BIT;

impl GrantCache {
    #[inline(always)]
    fn new(deadline: Stamp, mode: Mode) -> Self {
        Self(AtomicU64::new(Self::pack(deadline, mode)))
    }

    /// The cache of a deadline and mode already packed
    /// ([`Stamp::pack_with`]).
    #[inline(always)]
    fn from_packed(packed: u64) -> Self {
        Self(AtomicU64::new(packed))
    }

    #[inline(always)]
    fn pack(deadline: Stamp, mode: Mode) -> u64 {
        deadline.pack_with(mode)
    }

    #[inline]
    pub(crate) fn deadline(&self) -> Stamp {
        Stamp::from_raw(self.0.load(Relaxed) & !SHARED_BIT)
    }

    #[inline]
    fn mode(&self) -> Mode {
        if self.0.load(Relaxed) & SHARED_BIT == 0 {
            Mode::Exclusive
        } else {
            Mode::Shared
        }
    }

    /// Shared from now on (a downgrade, under the shard lock).
    pub(crate) fn set_shared(&self) {
        self.0.fetch_or(SHARED_BIT, Relaxed);
    }

    /// A new deadline, the same mode (a renewal; the mode changes only
    /// through `&mut`, so nothing races this).
    pub(crate) fn set_deadline(&self, deadline: Stamp) {
        self.0.store(Self::pack(deadline, self.mode()), Relaxed);
    }

    fn set(&mut self, deadline: Stamp, mode: Mode) {
        *self.0.get_mut() = Self::pack(deadline, mode);
    }
}

impl<K> Held<K> {
    /// A waiter's grant of the key at `key`: its token, and its deadline
    /// and mode as published, packed ([`Stamp::pack_with`]).
    #[inline(always)]
    pub(crate) fn from_granted(
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        packed: u64,
    ) -> Self {
        Self {
            hash,
            key,
            token,
            deadline: GrantCache::from_packed(packed),
        }
    }

    #[inline]
    pub(crate) fn new(hash: u64, grant: Grant<K>) -> Self {
        Self {
            hash,
            key: grant.key,
            token: grant.token,
            deadline: GrantCache::new(grant.deadline, grant.mode),
        }
    }

    /// The grant changed in place (an upgrade, or its undoing): a new token
    /// and deadline, in `mode`.
    pub(crate) fn regrant(&mut self, token: FencingToken, deadline: Stamp, mode: Mode) {
        self.token = token;
        self.deadline.set(deadline, mode);
    }

    #[inline]
    pub(crate) fn mode(&self) -> Mode {
        self.deadline.mode()
    }

    #[inline]
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    #[inline]
    pub(crate) fn key_ptr(&self) -> KeyPtr<K> {
        self.key
    }

    /// The deadline as last known to the guard.
    pub(crate) fn deadline(&self) -> Stamp {
        self.deadline.deadline()
    }

    fn downgrade<S>(&mut self, table: &LockTable<K, S>) -> Result<(), LockError> {
        // The mode is written under the shard lock, as the table makes the
        // grant shared: a wake that panics after the unlock cannot leave the
        // guard reporting the old mode.
        table.downgrade_grant(self.hash, self.key, self.token, &self.deadline)
    }

    #[inline]
    pub(crate) fn token(&self) -> FencingToken {
        self.token
    }

    /// See [`LockTable::watch_grant`].
    pub(crate) fn watch<S>(
        &self,
        table: &LockTable<K, S>,
        slot: &mut Option<usize>,
        current: &Waker,
        fresh: Option<Waker>,
    ) -> Watch {
        table.watch_grant(self.hash, self.key, self.token, slot, current, fresh)
    }

    pub(crate) fn unwatch<S>(&self, table: &LockTable<K, S>, slot: usize) {
        table.unwatch_grant(self.hash, slot);
    }

    #[inline]
    fn key(&self) -> &K {
        // SAFETY: the entry stays in its table while this guard exists: its
        // release (or, once fenced, its fenced count) keeps it there.
        unsafe { self.key.get() }
    }

    #[inline(always)]
    pub(crate) fn release<S>(&self, table: &LockTable<K, S>) {
        table.release(self.hash, self.key, self.token);
    }

    /// Releases the grant if it still holds the key, live; `false`: lost,
    /// nothing done (the guard releases it as lost when dropped).
    #[inline]
    fn release_if_live<S>(&self, table: &LockTable<K, S>) -> bool {
        table.release_if_live(self.hash, self.key, self.token)
    }

    fn check<S>(&self, table: &LockTable<K, S>) -> Result<FencingToken, LockError> {
        table.check_grant(self.hash, self.key, self.token)
    }

    fn check_leaving<S>(
        &self,
        table: &LockTable<K, S>,
        left: &mut Leftovers<K>,
    ) -> Result<FencingToken, LockError> {
        table.check_grant_leaving(self.hash, self.key, self.token, left)
    }

    /// The deadline as the table knows it while the grant is current; once
    /// it lost the key, its last known deadline if that has passed, else
    /// the time of the call (the table does not keep when it was revoked).
    fn expires_at<S>(&self, table: &LockTable<K, S>) -> Option<Instant> {
        match table.grant_deadline(self.hash, self.key, self.token) {
            Ok(deadline) => deadline.get(),
            Err(now) => Some(match self.deadline.deadline().get() {
                Some(deadline) => deadline.min(now),
                None => now,
            }),
        }
    }

    pub(crate) fn renew<S>(
        &self,
        table: &LockTable<K, S>,
        lease: Duration,
    ) -> Result<(), LockError> {
        table.renew_grant(self.hash, self.key, self.token, lease, &self.deadline)
    }

    fn renew_leaving<S>(
        &self,
        table: &LockTable<K, S>,
        lease: Duration,
        left: &mut Leftovers<K>,
    ) -> Result<(), LockError> {
        table.renew_grant_leaving(self.hash, self.key, self.token, lease, &self.deadline, left)
    }
}

macro_rules! guard_methods {
    () => {
        /// The key this guard holds.
        #[inline]
        pub fn key(&self) -> &K {
            self.held.key()
        }

        /// The mode of this grant: [`Mode::Exclusive`] (what `lock` takes),
        /// or [`Mode::Shared`], held together with other shared grants.
        #[inline]
        pub fn mode(&self) -> Mode {
            self.held.mode()
        }

        /// Makes this exclusive grant shared, keeping its token: the shared
        /// waiters at the head of the key's queue are admitted at once (a
        /// waiting exclusive request, and everyone behind it, keeps waiting).
        /// A shared grant stays as it is.
        ///
        /// # Errors
        ///
        /// [`LockError::Expired`] if the grant has already lost the key.
        ///
        /// ```
        /// let table = keylock::LockTable::new();
        /// let mut writer = table.try_lock("doc").unwrap();
        /// assert!(table.try_lock_shared("doc").is_err());
        /// writer.downgrade().unwrap();
        /// assert_eq!(writer.mode(), keylock::Mode::Shared);
        /// let reader = table.try_lock_shared("doc").unwrap(); // held together now
        /// # drop((writer, reader));
        /// ```
        pub fn downgrade(&mut self) -> Result<(), LockError> {
            self.held.downgrade(&self.table)
        }

        /// The fencing token of this grant; see [`FencingToken`].
        #[inline]
        pub fn token(&self) -> FencingToken {
            self.held.token
        }

        /// Whether this grant has lost its authority: its lease lapsed (judged
        /// now, on the monotonic clock) or it was revoked. Always equal to
        /// `self.check().is_err()`.
        pub fn is_expired(&self) -> bool {
            self.check().is_err()
        }

        /// The commit-time fence: `Ok(token)` only while the grant's lease is
        /// live and it was not revoked, judged at the moment of the call.
        ///
        /// # Errors
        ///
        /// [`LockError::Expired`] once the grant has lost the key.
        pub fn check(&self) -> Result<FencingToken, LockError> {
            self.held.check(&self.table)
        }

        /// When this grant's authority ends, judged now by the table: the
        /// lease deadline (as granted or last renewed), or `None` for a live
        /// grant without a lease (it never lapses).
        ///
        /// Once the grant has lost the key it reports an instant not later
        /// than the call: its deadline if the lease lapsed, else (it was
        /// revoked by [`LockTable::revoke`] or
        /// [`LockTable::revoke_grant`]) the time of the call. So
        /// `expires_at()` is `Some(t)` with `t` in the past exactly when
        /// [`is_expired`](Self::is_expired) is true. Takes the shard's lock;
        /// never changes anything.
        pub fn expires_at(&self) -> Option<Instant> {
            self.held.expires_at(&self.table)
        }

        /// Sets the lease to end `lease` from now (shorter or longer; a grant
        /// without a lease gets one). A lapsed or revoked grant is never
        /// revived.
        ///
        /// # Errors
        ///
        /// [`LockError::InvalidOptions`] for a lease out of the table's range;
        /// [`LockError::Expired`] if the grant has already lost the key.
        pub fn renew(&self, lease: Duration) -> Result<(), LockError> {
            self.held.renew(&self.table, lease)
        }

        /// Releases the key now; the same as dropping the guard.
        #[inline]
        pub fn release(self) {
            drop(self);
        }
    };
}

/// Holds a key of a [`LockTable`]; dropping it releases the key to the oldest
/// waiter.
///
/// A guard whose lease lapsed or that was revoked is *fenced*: its
/// [`check`](Self::check) fails and dropping it frees nothing that belongs to
/// its successor.
///
/// ```
/// use std::time::Duration;
/// let table = keylock::LockTable::new();
/// let guard = table
///     .try_lock_with("k", keylock::LockOptions::new().lease(Duration::from_secs(30)))
///     .unwrap();
/// let token = guard.check().expect("lease is live"); // fence the write with it
/// assert_eq!(token, guard.token());
/// guard.release();
/// assert!(!table.is_locked("k"));
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct Guard<'a, K, S = DefaultHashBuilder> {
    pub(crate) table: &'a LockTable<K, S>,
    pub(crate) held: Held<K>,
}

impl<'a, K, S> Guard<'a, K, S> {
    pub(crate) fn new(table: &'a LockTable<K, S>, held: Held<K>) -> Self {
        Self { table, held }
    }

    /// Releases the key and says whether the grant still held it when
    /// it let go: [`check`](Self::check) and release in one step (one
    /// visit to the table), for a commit that must know its work was
    /// protected to the end.
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] if the grant had lost the key (lapsed or
    /// revoked) by then; nothing of a successor's is freed.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.try_lock("k").unwrap();
    /// let token = guard.token();
    /// assert_eq!(guard.release_checked(), Ok(token));
    /// let revoked = table.try_lock("k").unwrap();
    /// table.revoke("k");
    /// assert!(revoked.release_checked().is_err());
    /// ```
    pub fn release_checked(self) -> Result<FencingToken, LockError> {
        self.release_if_live().map_err(|lost| LockError::Expired {
            token: lost.token(),
            key: lost.table.name_key(lost.key()),
        })
    }

    /// [`check`](Self::check), leaving the wakes and drops of what it
    /// settles in `left`: for a transaction's set, under its lock.
    pub(crate) fn check_leaving(&self, left: &mut Leftovers<K>) -> Result<FencingToken, LockError> {
        self.held.check_leaving(self.table, left)
    }

    /// [`renew`](Self::renew), leaving the wakes and drops of what it
    /// settles in `left`.
    pub(crate) fn renew_leaving(
        &self,
        lease: Duration,
        left: &mut Leftovers<K>,
    ) -> Result<(), LockError> {
        self.held.renew_leaving(self.table, lease, left)
    }

    /// Whether a waiter is queued on the guard's key (one that may wait for
    /// this grant): see [`LockTable::is_awaited`].
    pub(crate) fn is_awaited(&self) -> bool {
        self.table.is_awaited(self.held.hash(), self.held.key_ptr())
    }

    /// Releases the key if the grant still holds it, live (one visit to
    /// the table); a grant that lost it comes back, to be named and then
    /// dropped (released as lost).
    #[inline]
    pub(crate) fn release_if_live(self) -> Result<FencingToken, Self> {
        let token = self.token();
        // `Drop` must not run once the table released the grant, even if
        // the release's deferred work (a key's drop, a wake) panics: a
        // borrowed guard owns nothing else.
        let this = std::mem::ManuallyDrop::new(self);
        if this.held.release_if_live(this.table) {
            Ok(token)
        } else {
            Err(std::mem::ManuallyDrop::into_inner(this))
        }
    }

    /// The grant, out of the guard, which is gone without releasing it:
    /// the table's hold registry takes it over (a hold).
    pub(crate) fn into_held(self) -> Held<K> {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used again and its `Drop` never runs, so
        // the grant is read out exactly once.
        unsafe { std::ptr::read(&this.held) }
    }

    guard_methods!();
}

impl<K, S> Drop for Guard<'_, K, S> {
    #[inline(always)]
    fn drop(&mut self) {
        self.held.release(self.table);
    }
}

impl<K: fmt::Debug, S> fmt::Debug for Guard<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("key", self.key())
            .field("token", &self.token())
            .finish()
    }
}

/// Like [`Guard`], but keeps its table alive through an [`Arc`], so it is
/// `'static` and can move into spawned tasks.
///
/// ```
/// use std::sync::Arc;
/// let table = Arc::new(keylock::LockTable::new());
/// let guard = table.clone().try_lock_owned(1).unwrap();
/// std::thread::spawn(move || drop(guard)).join().unwrap();
/// assert!(table.is_empty());
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct OwnedGuard<K, S = DefaultHashBuilder> {
    pub(crate) table: Arc<LockTable<K, S>>,
    pub(crate) held: Held<K>,
}

impl<K, S> OwnedGuard<K, S> {
    pub(crate) fn new(table: Arc<LockTable<K, S>>, held: Held<K>) -> Self {
        Self { table, held }
    }

    /// The table this guard belongs to.
    #[inline]
    pub fn table(&self) -> &Arc<LockTable<K, S>> {
        &self.table
    }

    /// Releases the key and says whether the grant still held it when
    /// it let go: [`check`](Self::check) and release in one step (one
    /// visit to the table), for a commit that must know its work was
    /// protected to the end.
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] if the grant had lost the key (lapsed or
    /// revoked) by then; nothing of a successor's is freed.
    ///
    /// ```
    /// let table = std::sync::Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().try_lock_owned("k").unwrap();
    /// let token = guard.token();
    /// assert_eq!(guard.release_checked(), Ok(token));
    /// let revoked = table.clone().try_lock_owned("k").unwrap();
    /// table.revoke("k");
    /// assert!(revoked.release_checked().is_err());
    /// ```
    pub fn release_checked(self) -> Result<FencingToken, LockError> {
        self.release_if_live().map_err(|lost| LockError::Expired {
            token: lost.token(),
            key: lost.table.name_key(lost.key()),
        })
    }

    /// As [`Guard::release_if_live`].
    #[inline]
    pub(crate) fn release_if_live(self) -> Result<FencingToken, Self> {
        let token = self.token();
        // `Drop` must not run once the table released the grant, even if
        // the release's deferred work (a key's drop, a wake) panics.
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used again and its `Drop` never runs, so
        // the table's `Arc` and the grant are read out exactly once: the
        // `Arc` drops here (also if the release panics), or both go back
        // into a guard for a grant that was not released.
        let (table, held) = unsafe { (std::ptr::read(&this.table), std::ptr::read(&this.held)) };
        if held.release_if_live(&table) {
            Ok(token)
        } else {
            Err(Self { table, held })
        }
    }

    guard_methods!();
}

impl<K, S> Drop for OwnedGuard<K, S> {
    #[inline]
    fn drop(&mut self) {
        self.held.release(&self.table);
    }
}

impl<K: fmt::Debug, S> fmt::Debug for OwnedGuard<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedGuard")
            .field("key", self.key())
            .field("token", &self.token())
            .finish()
    }
}
