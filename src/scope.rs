//! One API across scopes: [`ScopedLockTable`] and [`ScopedGuard`], the
//! shape the in-process [`LockTable`], the process scope's
//! `ProcessLockTable` and the cluster scope's `ClusterLockTable` share, so
//! that generic code (a transaction manager, a job runner) is written once
//! and runs at any scope.
//!
//! The traits are deliberately small: lock, try to lock, and the fencing
//! token and standing of a grant. Each table's own methods (options,
//! leases, owned guards, diagnosis) stay on the table.

use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, Hash};

use crate::{FencingToken, Guard, LockTable};

/// A grant of any scope: its fencing token, and whether it still holds its
/// key. Dropping it releases the key.
///
/// ```
/// use keylock::{LockTable, ScopedGuard};
/// fn stamp<G: ScopedGuard>(guard: &G) -> Option<u64> {
///     (!guard.is_expired()).then(|| guard.token().get())
/// }
/// let table = LockTable::new();
/// let guard = table.try_lock("k").unwrap();
/// assert_eq!(stamp(&guard), Some(guard.token().get()));
/// ```
pub trait ScopedGuard: Send {
    /// The grant's fencing token: strictly increasing per key at the
    /// table's scope.
    fn token(&self) -> FencingToken;

    /// Whether the grant has lost its authority (its lease lapsed, it was
    /// revoked or taken over): do not commit its work.
    fn is_expired(&self) -> bool;
}

/// A keyed lock table of any scope: in-process, across the processes of a
/// host, or across a cluster.
///
/// ```
/// # futures::executor::block_on(async {
/// use keylock::{LockTable, ScopedGuard, ScopedLockTable};
///
/// /// Written once, for every scope.
/// async fn bump<T: ScopedLockTable<String>>(table: &T, key: &str) -> Result<u64, T::Error> {
///     let guard = table.lock(key.to_owned()).await?;
///     assert!(table.try_lock(key.to_owned()).await?.is_none(), "held: no second grant");
///     Ok(guard.token().get())
/// }
///
/// let local = LockTable::new();
/// let first = bump(&local, "acct-1").await.unwrap();
/// assert!(bump(&local, "acct-1").await.unwrap() > first);
/// # #[cfg(target_os = "linux")]
/// # {
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-scope-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let processes = keylock::ProcessLockTable::open(&dir)?;
/// let first = bump(&processes, "acct-1").await?;
/// assert!(bump(&processes, "acct-1").await? > first);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub trait ScopedLockTable<K>: Send + Sync {
    /// The guard of a grant; releases the key on drop.
    type Guard<'a>: ScopedGuard
    where
        Self: 'a,
        K: 'a;

    /// Why a lock failed (`Infallible` in-process).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Waits for `key` and takes it, in the table's order (FIFO per key).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe at every scope: dropped, the future holds nothing and
    /// leaves no waiter behind.
    fn lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
    where
        K: 'a;

    /// Takes `key` if nobody holds or awaits it: `Ok(None)` if it is held.
    /// (At the cluster scope this makes round trips to etcd, hence a
    /// future; it never waits for the key.)
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe at every scope, as [`lock`](Self::lock).
    fn try_lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
    where
        K: 'a;
}

impl<K, S> ScopedGuard for Guard<'_, K, S>
where
    K: Eq + Hash + Send + Sync,
    S: BuildHasher + Send + Sync,
{
    fn token(&self) -> FencingToken {
        Guard::token(self)
    }

    fn is_expired(&self) -> bool {
        Guard::is_expired(self)
    }
}

impl<K, S> ScopedLockTable<K> for LockTable<K, S>
where
    K: Eq + Hash + Send + Sync,
    S: BuildHasher + Send + Sync,
{
    type Guard<'a>
        = Guard<'a, K, S>
    where
        Self: 'a,
        K: 'a;
    type Error = Infallible;

    fn lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
    where
        K: 'a,
    {
        let lock = LockTable::lock(self, key);
        async move { Ok(lock.await) }
    }

    fn try_lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
    where
        K: 'a,
    {
        // The one failure is `TryLockError::WouldBlock`: held.
        std::future::ready(Ok(LockTable::try_lock(self, key).ok()))
    }
}

#[cfg(target_os = "linux")]
mod process {
    use super::*;
    use crate::process::{ProcessGuard, ProcessLockError, ProcessLockTable};

    impl<K: Send + Sync> ScopedGuard for ProcessGuard<'_, K> {
        fn token(&self) -> FencingToken {
            ProcessGuard::token(self)
        }

        fn is_expired(&self) -> bool {
            ProcessGuard::is_expired(self)
        }
    }

    impl<K: AsRef<[u8]> + Send + Sync> ScopedLockTable<K> for ProcessLockTable<K> {
        type Guard<'a>
            = ProcessGuard<'a, K>
        where
            Self: 'a,
            K: 'a;
        type Error = ProcessLockError;

        fn lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ProcessLockTable::lock(self, key)
        }

        fn try_lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            let r = match ProcessLockTable::try_lock(self, key) {
                Ok(g) => Ok(Some(g)),
                Err(ProcessLockError::WouldBlock { .. }) => Ok(None),
                Err(e) => Err(e),
            };
            std::future::ready(r)
        }
    }
}

#[cfg(feature = "etcd")]
mod cluster {
    use super::*;
    use crate::etcd::{ClusterGuard, ClusterLockError, ClusterLockTable};

    impl<K: Send + Sync> ScopedGuard for ClusterGuard<'_, K> {
        fn token(&self) -> FencingToken {
            ClusterGuard::token(self)
        }

        fn is_expired(&self) -> bool {
            ClusterGuard::is_expired(self)
        }
    }

    impl<K: AsRef<[u8]> + Send + Sync> ScopedLockTable<K> for ClusterLockTable<K> {
        type Guard<'a>
            = ClusterGuard<'a, K>
        where
            Self: 'a,
            K: 'a;
        type Error = ClusterLockError;

        fn lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ClusterLockTable::lock(self, key)
        }

        fn try_lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            let fut = ClusterLockTable::try_lock(self, key);
            async move {
                match fut.await {
                    Ok(g) => Ok(Some(g)),
                    Err(ClusterLockError::WouldBlock { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            }
        }
    }
}
