//! The one seam between the transaction code and its two public forms: how
//! an owner reaches its table (a borrow, or an `Arc`) and the operations its
//! guards ([`Guard`] or [`OwnedGuard`]) offer. Everything else in
//! `owner/` is written once against these two traits.

use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::time::Duration;

use crate::acquire::{LockOwnedWith, LockWith};
use crate::error::LockError;
use crate::guard::{Guard, OwnedGuard};
use crate::lease::LockOptions;
use crate::mode::Mode;
use crate::table::LockTable;
use crate::token::FencingToken;
use crate::upgrade::Upgrade;

/// How an owner reaches its table, and the guards and lock futures it gets.
pub(crate) trait Reach {
    type Key: Eq + Hash;
    type Hasher: BuildHasher;
    type Guard: GuardOps<Key = Self::Key, Hasher = Self::Hasher>;
    type Lock: Future<Output = Result<Self::Guard, LockError>>;

    fn table(&self) -> &LockTable<Self::Key, Self::Hasher>;

    fn lock_with(&self, key: Self::Key, opts: LockOptions) -> Self::Lock;

    /// One attempt that gives the key back when it cannot be had at once;
    /// `hash` is the table's hash of `key`.
    fn try_lock_kept(
        &self,
        hash: u64,
        key: Self::Key,
        opts: LockOptions,
    ) -> Result<Self::Guard, Self::Key>;
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
    fn lock_with(&self, key: K, opts: LockOptions) -> LockWith<'t, K, S> {
        LockTable::lock_with(*self, key, opts)
    }

    #[inline]
    fn try_lock_kept(&self, hash: u64, key: K, opts: LockOptions) -> Result<Guard<'t, K, S>, K> {
        LockTable::try_lock_kept(*self, hash, key, opts)
    }
}

impl<K: Eq + Hash, S: BuildHasher> Reach for Arc<LockTable<K, S>> {
    type Key = K;
    type Hasher = S;
    type Guard = OwnedGuard<K, S>;
    type Lock = LockOwnedWith<K, S>;

    #[inline]
    fn table(&self) -> &LockTable<K, S> {
        self
    }

    #[inline]
    fn lock_with(&self, key: K, opts: LockOptions) -> LockOwnedWith<K, S> {
        Arc::clone(self).lock_owned_with(key, opts)
    }

    #[inline]
    fn try_lock_kept(&self, hash: u64, key: K, opts: LockOptions) -> Result<OwnedGuard<K, S>, K> {
        Arc::clone(self).try_lock_owned_kept(hash, key, opts)
    }
}

/// What the transaction code does with a guard it holds.
pub(crate) trait GuardOps {
    type Key;
    type Hasher;

    fn key(&self) -> &Self::Key;
    fn mode(&self) -> Mode;
    fn token(&self) -> FencingToken;
    fn check(&self) -> Result<FencingToken, LockError>;
    fn expires_at(&self) -> Option<std::time::Instant>;
    fn renew(&self, lease: Duration) -> Result<(), LockError>;
    fn downgrade(&mut self) -> Result<(), LockError>;
    fn upgrade(&mut self, opts: LockOptions) -> Upgrade<'_, Self::Key, Self::Hasher>;
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

            fn renew(&self, lease: Duration) -> Result<(), LockError> {
                $guard::renew(self, lease)
            }

            fn downgrade(&mut self) -> Result<(), LockError> {
                $guard::downgrade(self)
            }

            fn upgrade(&mut self, opts: LockOptions) -> Upgrade<'_, K, S> {
                $guard::upgrade_with(self, opts)
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
guard_ops!(OwnedGuard);
