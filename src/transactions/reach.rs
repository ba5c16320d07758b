//! The one seam between the transaction code and its two public forms: how
//! an owner reaches its table (a borrow, or an `Arc` kept by the owned
//! form's state, [`Pinned`]) and the operations its guards ([`Guard`])
//! offer. Everything else in `transactions/` is written once against these two
//! traits.

use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::time::Duration;

use crate::error::LockError;
use crate::keys::deferred::Leftovers;
use crate::support::lease::{LockOptions, Terms};
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::acquire::LockWith;
use crate::table::guard::Guard;
use crate::table::upgrade::UpgradeOwned;
use crate::table::LockTable;

/// How an owner reaches its table, and the guards and lock futures it gets.
pub(crate) trait Reach {
    type Key: Eq + Hash;
    type Hasher: BuildHasher;
    type Guard: GuardOps<Key = Self::Key, Hasher = Self::Hasher>;
    type Lock: Future<Output = Result<Self::Guard, LockError>>;

    fn table(&self) -> &LockTable<Self::Key, Self::Hasher>;

    /// The table's lock future for `key`, whose hash is `hash`.
    fn lock_with(&self, hash: u64, key: Self::Key, opts: LockOptions) -> Self::Lock;

    /// One attempt that gives the key back when it cannot be had at once;
    /// `hash` is the table's hash of `key`.
    fn try_lock_kept(
        &self,
        hash: u64,
        key: Self::Key,
        opts: LockOptions,
    ) -> Result<Self::Guard, Self::Key>;

    /// [`try_lock_kept`](Self::try_lock_kept) on terms resolved once for a
    /// call (see [`LockTable::owner_terms`]), inline.
    fn try_lock_on(
        &self,
        hash: u64,
        key: Self::Key,
        mode: Mode,
        terms: Terms,
    ) -> Result<Self::Guard, Self::Key>;

    /// [`try_lock_kept`](Self::try_lock_kept) that wakes and drops nothing
    /// (see [`LockTable::try_lock_leaving`]): for a caller holding its
    /// set's lock, whose slot keeps the key unless the table keeps it.
    fn try_lock_leaving(
        &self,
        hash: u64,
        key: &mut Option<Self::Key>,
        opts: LockOptions,
        left: &mut Leftovers<Self::Key>,
    ) -> Option<Self::Guard>;
}

impl<'t, K: Eq + Hash, S: BuildHasher> Reach for &'t LockTable<K, S> {
    type Key = K;
    type Hasher = S;
    type Guard = Guard<'t, K, S>;
    type Lock = LockWith<'t, K, S>;

    #[inline]
    fn table(&self) -> &LockTable<K, S> {
        self
    }

    #[inline]
    fn lock_with(&self, hash: u64, key: K, opts: LockOptions) -> LockWith<'t, K, S> {
        LockWith::new_hashed(*self, hash, key, opts)
    }

    #[inline]
    fn try_lock_kept(&self, hash: u64, key: K, opts: LockOptions) -> Result<Guard<'t, K, S>, K> {
        LockTable::try_lock_kept(*self, hash, key, opts)
    }

    #[inline(always)]
    fn try_lock_on(
        &self,
        hash: u64,
        key: K,
        mode: Mode,
        terms: Terms,
    ) -> Result<Guard<'t, K, S>, K> {
        LockTable::try_lock_on(*self, hash, key, mode, terms)
    }

    #[inline]
    fn try_lock_leaving(
        &self,
        hash: u64,
        key: &mut Option<K>,
        opts: LockOptions,
        left: &mut Leftovers<K>,
    ) -> Option<Guard<'t, K, S>> {
        LockTable::try_lock_leaving(*self, hash, key, opts, left)
    }
}

/// An owned transaction's way to its table: the table's `Arc`, kept in the
/// transaction's shared state, and guards and lock futures that borrow the
/// table for as long as that state lives, instead of each keeping an `Arc`
/// of its own. That spares two atomic read-modify-writes per key (the
/// count's increment at the grant and decrement at the release), which are
/// most of what an uncontended key costs beyond its shard's lock
/// (BENCHMARKS.md, issue 11's goals).
///
/// # The invariant that makes it sound
///
/// Every guard and lock future made through a `Pinned` is dropped before
/// the `Pinned` is. They live in three places only, and none is ever handed
/// to the caller (an owned transaction's calls return [`Acquired`], its
/// detach a [`Hold`], which keep no reference to the table):
///
/// - the transaction's state (`access::Shared`), which drops its set of
///   guards before its `Owner` (field order) and releases them in `end`
///   while borrowing itself;
/// - a pending call's future, which keeps an `Arc` of that state: its
///   guards and lock futures borrow the `Arc` (through the call's `Claim`),
///   so they are dropped before it;
/// - the frame of a method of the transaction, which borrows the state.
///
/// [`Acquired`]: crate::Acquired
/// [`Hold`]: crate::Hold
pub(crate) struct Pinned<K, S>(Arc<LockTable<K, S>>);

impl<K, S> Pinned<K, S> {
    pub(crate) fn new(table: Arc<LockTable<K, S>>) -> Self {
        Self(table)
    }

    pub(crate) fn arc(&self) -> &Arc<LockTable<K, S>> {
        &self.0
    }

    /// The table, borrowed for as long as the caller needs it: see the
    /// type's invariant, which its callers in this module keep.
    #[inline]
    fn extended(&self) -> &'static LockTable<K, S> {
        // SAFETY: the `Arc` keeps the table alive for as long as `self`
        // lives, and every guard and lock future made from this reference
        // is dropped before `self` (the type's invariant), so it is never
        // used after the table could be freed.
        unsafe { &*Arc::as_ptr(&self.0) }
    }
}

impl<K, S> std::fmt::Debug for Pinned<K, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Pinned").finish_non_exhaustive()
    }
}

impl<K: Eq + Hash + 'static, S: BuildHasher + 'static> Reach for Pinned<K, S> {
    type Key = K;
    type Hasher = S;
    type Guard = Guard<'static, K, S>;
    type Lock = LockWith<'static, K, S>;

    #[inline]
    fn table(&self) -> &LockTable<K, S> {
        &self.0
    }

    #[inline]
    fn lock_with(&self, hash: u64, key: K, opts: LockOptions) -> LockWith<'static, K, S> {
        LockWith::new_hashed(self.extended(), hash, key, opts)
    }

    #[inline]
    fn try_lock_kept(
        &self,
        hash: u64,
        key: K,
        opts: LockOptions,
    ) -> Result<Guard<'static, K, S>, K> {
        LockTable::try_lock_kept(self.extended(), hash, key, opts)
    }

    #[inline(always)]
    fn try_lock_on(
        &self,
        hash: u64,
        key: K,
        mode: Mode,
        terms: Terms,
    ) -> Result<Guard<'static, K, S>, K> {
        LockTable::try_lock_on(self.extended(), hash, key, mode, terms)
    }

    #[inline]
    fn try_lock_leaving(
        &self,
        hash: u64,
        key: &mut Option<K>,
        opts: LockOptions,
        left: &mut Leftovers<K>,
    ) -> Option<Guard<'static, K, S>> {
        LockTable::try_lock_leaving(self.extended(), hash, key, opts, left)
    }
}

/// What the transaction code does with a guard it holds.
pub(crate) trait GuardOps {
    type Key;
    type Hasher;

    fn key(&self) -> &Self::Key;
    /// The table's hash of the key.
    fn hash(&self) -> u64;
    fn mode(&self) -> Mode;
    fn token(&self) -> FencingToken;
    fn check(&self) -> Result<FencingToken, LockError>;
    /// [`check`](Self::check), leaving wakes and drops in `left` (under
    /// the set's lock).
    fn check_leaving(&self, left: &mut Leftovers<Self::Key>) -> Result<FencingToken, LockError>;
    fn expires_at(&self) -> Option<std::time::Instant>;
    /// Renews the grant's lease, leaving wakes and drops in `left`.
    fn renew_leaving(
        &self,
        lease: Duration,
        left: &mut Leftovers<Self::Key>,
    ) -> Result<(), LockError>;
    /// Whether a waiter is queued on the key (see
    /// [`LockTable::is_awaited`]).
    fn is_awaited(&self) -> bool;
    fn downgrade(&mut self) -> Result<(), LockError>;
    /// An upgrade that owns the guard (see [`UpgradeOwned`]), for a wait
    /// its transaction may cancel (`pending.rs`).
    type Upgrading: Future<Output = (Self, Result<FencingToken, LockError>)>
    where
        Self: Sized;
    fn upgrade_owned(self, opts: LockOptions) -> Self::Upgrading
    where
        Self: Sized;
    /// The guard of an owning upgrade back, shared (`None` once resolved).
    fn upgrade_undone(upgrading: std::pin::Pin<&mut Self::Upgrading>) -> Option<Self>
    where
        Self: Sized;
    /// Releases the key if the grant still holds it, live; else gives the
    /// guard back (see [`Guard::release_if_live`]).
    fn release_if_live(self) -> Result<FencingToken, Self>
    where
        Self: Sized;
    /// Hands the grant to `table` (its own) as a hold (see `hold.rs`).
    fn into_hold(self, table: &LockTable<Self::Key, Self::Hasher>)
    where
        Self: Sized;
}

macro_rules! guard_ops {
    ($($lt:lifetime,)? $guard:ident) => {
        impl<$($lt,)? K: Eq + Hash, S: BuildHasher> GuardOps for $guard<$($lt,)? K, S> {
            type Key = K;
            type Hasher = S;

            #[inline]
            fn key(&self) -> &K {
                $guard::key(self)
            }

            #[inline(always)]
            fn hash(&self) -> u64 {
                self.held.hash()
            }

            #[inline]
            fn mode(&self) -> Mode {
                $guard::mode(self)
            }

            #[inline]
            fn token(&self) -> FencingToken {
                $guard::token(self)
            }

            fn check(&self) -> Result<FencingToken, LockError> {
                $guard::check(self)
            }

            fn expires_at(&self) -> Option<std::time::Instant> {
                $guard::expires_at(self)
            }

            fn check_leaving(
                &self,
                left: &mut Leftovers<K>,
            ) -> Result<FencingToken, LockError> {
                $guard::check_leaving(self, left)
            }

            fn renew_leaving(&self, lease: Duration, left: &mut Leftovers<K>) -> Result<(), LockError> {
                $guard::renew_leaving(self, lease, left)
            }

            fn is_awaited(&self) -> bool {
                $guard::is_awaited(self)
            }

            fn downgrade(&mut self) -> Result<(), LockError> {
                $guard::downgrade(self)
            }

            type Upgrading = UpgradeOwned<$($lt,)? K, S>;

            fn upgrade_owned(self, opts: LockOptions) -> Self::Upgrading {
                UpgradeOwned::new(self, opts)
            }

            fn upgrade_undone(
                upgrading: std::pin::Pin<&mut Self::Upgrading>,
            ) -> Option<Self> {
                upgrading.into_guard()
            }

            #[inline]
            fn release_if_live(self) -> Result<FencingToken, Self> {
                $guard::release_if_live(self)
            }

            fn into_hold(self, table: &LockTable<K, S>) {
                table.adopt_hold($guard::into_held(self));
            }
        }
    };
}

guard_ops!('t, Guard);

/// The invariant of [`Pinned`], exercised where miri runs (`--lib`): an
/// owned transaction outliving every other `Arc` of its table, its guards
/// released by the end, a pending call's lock future and claim dropped
/// after the transaction, and one completed on another thread after it.
#[cfg(all(test, not(loom)))]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};

    use crate::{LockTable, Mode, TransactionError};

    fn poll_once<F: Future>(fut: &mut std::pin::Pin<&mut F>) -> Poll<F::Output> {
        fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn guards_and_pending_calls_never_outlive_the_table() {
        let table = Arc::new(LockTable::<String>::new());
        let txn = table.clone().transaction_owned();
        let blocker = table.clone().transaction_owned();
        for k in ["a", "b", "c"] {
            let got = futures::executor::block_on(txn.lock(k.to_string(), Mode::Exclusive));
            assert_eq!(got.map(|g| g.count), Ok(1));
        }
        futures::executor::block_on(blocker.lock("d".to_string(), Mode::Shared)).unwrap();
        // A pending call of `txn`: queued behind `blocker`, with its claim
        // (a copy of the key) and its table lock future.
        let pending = txn.lock("d".to_string(), Mode::Exclusive);
        // The caller's own `Arc`s go: only the transactions keep the table.
        drop(table);
        {
            let mut pending = pin!(pending);
            assert!(poll_once(&mut pending).is_pending());
            drop(txn); // the end: releases a, b and c; the call is woken
            assert_eq!(
                poll_once(&mut pending),
                Poll::Ready(Err(TransactionError::Ended))
            );
        } // the future, its claim and its lock future go after `txn`
          // A call made by `blocker`, completed on another thread after
          // `blocker` itself was dropped there.
        let later = blocker.lock("e".to_string(), Mode::Exclusive);
        let done = std::thread::spawn(move || {
            drop(blocker);
            futures::executor::block_on(later)
        });
        assert_eq!(done.join().unwrap(), Err(TransactionError::Ended));
    }

    /// An owned transaction's waiting upgrades (single and in a
    /// `lock_all`), whose cells own the guard they upgrade
    /// (`pending.rs`, `UpgradeOwned`): one dropped while it waits (its
    /// guard back, shared), one pending when the transaction ends (the end
    /// releases it), each outliving every other `Arc` of the table.
    #[test]
    fn waiting_upgrades_own_their_guards_and_never_outlive_the_table() {
        let table = Arc::new(LockTable::<String>::new());
        let reader = table.clone().transaction_owned();
        let txn = table.clone().transaction_owned();
        for k in ["a", "b"] {
            futures::executor::block_on(reader.lock(k.to_string(), Mode::Shared)).unwrap();
            futures::executor::block_on(txn.lock(k.to_string(), Mode::Shared)).unwrap();
        }
        drop(table);
        {
            let mut up = pin!(txn.lock("a".to_string(), Mode::Exclusive));
            assert!(poll_once(&mut up).is_pending(), "another reader holds a");
        } // dropped: a is back, shared
        assert_eq!(txn.mode("a"), Some(Mode::Shared));
        let all = txn.lock_all(vec![
            ("a".to_string(), Mode::Exclusive),
            ("b".to_string(), Mode::Exclusive),
        ]);
        let single = txn.lock("a".to_string(), Mode::Shared); // re-entered
        {
            let mut all = pin!(all);
            assert!(poll_once(&mut all).is_pending());
            assert_eq!(
                futures::executor::block_on(single).map(|g| g.count),
                Err(TransactionError::InFlight {
                    key: "a".to_string()
                }),
                "a is the lock_all's"
            );
            drop(txn); // the end releases a and b, the upgrade's guard too
            assert_eq!(
                poll_once(&mut all),
                Poll::Ready(Err(TransactionError::Ended))
            );
        }
        drop(reader);
    }
}
