//! One API across scopes: [`ScopedLockTable`], [`ScopedGuard`],
//! [`ScopedError`] and [`ScopedHolder`], the shape the in-process
//! [`LockTable`], the process scope's `ProcessLockTable` and the cluster
//! scope's `ClusterLockTable` share, so that generic code (a job runner, a
//! transaction manager) is written once and runs at any scope.
//!
//! What every scope has is here: locks with options (a lease, a timeout or
//! deadline, shared mode where the scope has it: [`ScopedLockTable::SHARED`]),
//! `try_lock`, who holds a key; on a grant its fencing token, the
//! commit-time `check()`, `renew`, `lost()` (a future that resolves when the
//! grant loses its authority) and `keep_alive`; on a failure what kind it
//! is and, for a timeout or a refused `try_lock`, who kept the key
//! ([`ScopedError::blocker`]). What only one scope has (owned guards,
//! holds, transactions, etcd fences, process labels) stays on its table.
//!
//! `examples/jobs` is a worker pool written once against these traits and
//! run at every scope.

use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::time::Duration;

use crate::{FencingToken, Guard, HolderStatus, LockError, LockOptions, LockTable};

/// What kind of failure a scope's error is, for generic code to act on
/// (its `Display` says the rest, in the scope's terms).
///
/// ```
/// use keylock::{LockError, ScopedError, ScopedErrorKind};
/// let err = LockError::WouldBlock { key: None };
/// assert_eq!(err.kind(), ScopedErrorKind::WouldBlock);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScopedErrorKind {
    /// The key is held (or awaited) and the caller would not wait.
    WouldBlock,
    /// The wait ran out; [`ScopedError::blocker`] says who kept the key
    /// where the scope knows.
    Timeout,
    /// The grant lost its authority (its lease lapsed, it was revoked or
    /// taken over, its session was lost): do not commit its work.
    Expired,
    /// An option was out of range or unsupported at this scope (shared
    /// mode at the process scope, a lease of zero, a keep-alive interval
    /// not shorter than the lease, ...). Nothing was taken.
    InvalidOptions,
    /// What the scope stands on could not be reached for long enough (the
    /// etcd cluster; a lost session): retrying later may succeed. Nothing
    /// is held.
    Unavailable,
    /// Anything else: a file system failure, a damaged state file, a
    /// refused etcd call, ... (the error's `Display` says what).
    Other,
}

/// Who kept a key from a caller, as far as the scope knows: in a timeout
/// or a refused `try_lock` ([`ScopedError::blocker`]).
///
/// ```
/// use std::time::Duration;
/// use keylock::{LockOptions, LockTable, ScopedError};
/// # futures::executor::block_on(async {
/// let table = LockTable::new();
/// let held = table.lock_with("k", LockOptions::new().lease(Duration::from_secs(30))).await.unwrap();
/// let err = table.lock_with("k", LockOptions::new().timeout(Duration::ZERO)).await.unwrap_err();
/// let blocker = err.blocker().expect("a timeout names its holder");
/// assert_eq!(blocker.token, Some(held.token()));
/// # });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Blocker {
    /// The holder's fencing token, if a grant held the key.
    pub token: Option<FencingToken>,
    /// How long that holder had held the key, where the scope knows.
    pub held_for: Option<Duration>,
}

/// The errors of every scope: [`LockError`], `ProcessLockError`,
/// `ClusterLockError`.
///
/// ```
/// use keylock::{LockError, ScopedError, ScopedErrorKind};
/// fn should_retry<E: ScopedError>(err: &E) -> bool {
///     matches!(err.kind(), ScopedErrorKind::Timeout | ScopedErrorKind::Unavailable)
/// }
/// assert!(!should_retry(&LockError::WouldBlock { key: None }));
/// ```
pub trait ScopedError: std::error::Error + Send + Sync + 'static {
    /// What kind of failure this is.
    ///
    /// ```
    /// use keylock::{FencingToken, LockError, ScopedError, ScopedErrorKind};
    /// let err = LockError::Expired { token: FencingToken::new(7).unwrap(), key: None };
    /// assert_eq!(err.kind(), ScopedErrorKind::Expired);
    /// ```
    fn kind(&self) -> ScopedErrorKind;

    /// For a timeout or a refused `try_lock`: who kept the key, as far as
    /// the scope knows (`None` for other errors).
    ///
    /// ```
    /// use keylock::{LockError, ScopedError};
    /// assert_eq!(LockError::WouldBlock { key: None }.blocker(), None); // in-process: not said
    /// ```
    fn blocker(&self) -> Option<Blocker>;
}

/// Who holds a key, at any scope: [`HolderStatus`], `ProcessHolder`,
/// `ClusterHolder` (each says more in its own fields).
///
/// ```
/// use keylock::{LockTable, ScopedHolder};
/// let table = LockTable::new();
/// let guard = table.try_lock("k").unwrap();
/// assert_eq!(table.holder("k").unwrap().token(), guard.token());
/// ```
pub trait ScopedHolder: std::fmt::Debug + Send {
    /// The holder's fencing token.
    ///
    /// ```
    /// use keylock::{LockTable, ScopedHolder};
    /// let table = LockTable::new();
    /// let guard = table.try_lock("k").unwrap();
    /// assert_eq!(ScopedHolder::token(&table.holder("k").unwrap()), guard.token());
    /// ```
    fn token(&self) -> FencingToken;
}

/// A grant of any scope: its fencing token, the commit-time check, its
/// lease (renewed by hand or kept alive) and the loss of its authority.
/// Dropping it releases the key.
///
/// ```
/// # futures::executor::block_on(async {
/// use std::time::Duration;
/// use keylock::{LockOptions, LockTable, ScopedGuard, ScopedLockTable};
///
/// /// Written once: commit only while the grant holds the key.
/// fn commit<G: ScopedGuard>(guard: &G, log: &mut Vec<u64>) -> Result<(), G::Error> {
///     let token = guard.check()?;
///     log.push(token.get());
///     Ok(())
/// }
/// let table = LockTable::new();
/// let opts = LockOptions::new().lease(Duration::from_secs(30));
/// let guard = ScopedLockTable::lock_with(&table, "k", opts).await?;
/// let mut log = Vec::new();
/// commit(&guard, &mut log)?;
/// assert_eq!(log, [guard.token().get()]);
/// # Ok::<(), keylock::LockError>(())
/// # }).unwrap();
/// ```
pub trait ScopedGuard: Send + Sync {
    /// Why a check, a renewal or the grant's authority failed.
    type Error: ScopedError;

    /// The grant's fencing token: strictly increasing per key at the
    /// table's scope.
    ///
    /// ```
    /// use keylock::{LockTable, ScopedGuard};
    /// let table = LockTable::new();
    /// let first = ScopedGuard::token(&table.try_lock("k").unwrap());
    /// assert!(ScopedGuard::token(&table.try_lock("k").unwrap()) > first);
    /// ```
    fn token(&self) -> FencingToken;

    /// Whether the grant has lost its authority: `check()` fails.
    ///
    /// ```
    /// use keylock::{LockTable, ScopedGuard};
    /// let table = LockTable::new();
    /// let guard = table.try_lock("k").unwrap();
    /// table.revoke("k");
    /// assert!(ScopedGuard::is_expired(&guard));
    /// ```
    fn is_expired(&self) -> bool {
        self.check().is_err()
    }

    /// The commit-time fence: `Ok(token)` only while the grant holds its
    /// key, judged now (at the cluster scope, locally against the lease
    /// that carries it). Hand the token to the store, which refuses one
    /// older than the newest it has seen.
    ///
    /// ```
    /// use keylock::{LockTable, ScopedGuard};
    /// let table = LockTable::new();
    /// let guard = table.try_lock("k").unwrap();
    /// assert_eq!(ScopedGuard::check(&guard), Ok(guard.token()));
    /// ```
    fn check(&self) -> Result<FencingToken, Self::Error>;

    /// Extends the grant's lease: to end `lease` from now at the task and
    /// process scopes (a grant without a lease gets one); at the cluster
    /// scope by the TTL of the etcd lease that carries the grant, fixed
    /// when it was granted (`lease` is not used there). A grant that lost
    /// its key is never revived.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropped, the renewal may or may not have been made (at
    /// the cluster scope a keep-alive in flight may still reach etcd).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockTable, ScopedGuard};
    /// let table = LockTable::new();
    /// let guard = table.lock("k").await;
    /// ScopedGuard::renew(&guard, Duration::from_secs(5)).await.unwrap();
    /// assert!(guard.expires_at().is_some());
    /// # });
    /// ```
    fn renew(&self, lease: Duration) -> impl Future<Output = Result<(), Self::Error>> + Send + '_;

    /// A future that resolves when the grant loses its authority (when
    /// `check()` would fail), with the reason; at once if it already has.
    /// Woken by the event itself (a revocation, a lost session) or by a
    /// timer at the lease's deadline, re-armed when the lease is renewed;
    /// never by polling. A grant without a lease may keep it pending for
    /// ever.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping it changes nothing.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, ScopedError, ScopedErrorKind, ScopedGuard};
    /// let table = LockTable::new();
    /// let guard = table.lock("k").await;
    /// table.revoke("k");
    /// assert_eq!(ScopedGuard::lost(&guard).await.kind(), ScopedErrorKind::Expired);
    /// # });
    /// ```
    fn lost(&self) -> impl Future<Output = Self::Error> + Send + '_;

    /// A future that keeps the grant's lease alive until it is dropped:
    /// renewed with `lease` on the first poll and then every `interval`
    /// (at the cluster scope: a grant's own etcd lease is renewed every
    /// `interval` with its TTL; the session's lease is kept alive by the
    /// session). It resolves at the first failure with the reason: the
    /// grant lost its authority, or invalid options (`interval` zero or
    /// not shorter than the lease).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping it stops the renewals.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockTable, ScopedError, ScopedErrorKind, ScopedGuard};
    /// let table = LockTable::new();
    /// let guard = table.lock("k").await;
    /// let keep = ScopedGuard::keep_alive(&guard, Duration::from_secs(9), Duration::from_secs(3));
    /// assert_eq!(keep.await.kind(), ScopedErrorKind::InvalidOptions); // interval >= lease
    /// # });
    /// ```
    fn keep_alive(
        &self,
        interval: Duration,
        lease: Duration,
    ) -> impl Future<Output = Self::Error> + Send + '_;
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
/// let first = bump(&local, "acct-1").await?;
/// assert!(bump(&local, "acct-1").await? > first);
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
    type Guard<'a>: ScopedGuard<Error = Self::Error>
    where
        Self: 'a,
        K: 'a;

    /// Why a lock, a check or a renewal failed.
    type Error: ScopedError;

    /// Who holds a key, as [`holder`](Self::holder) says.
    type Holder: ScopedHolder;

    /// Whether this scope takes keys in shared mode
    /// ([`LockOptions::shared`]); where it does not, a shared lock fails
    /// with [`ScopedErrorKind::InvalidOptions`].
    ///
    /// ```
    /// use keylock::{LockTable, ScopedLockTable};
    /// assert!(<LockTable<String> as ScopedLockTable<String>>::SHARED);
    /// ```
    const SHARED: bool;

    /// Waits for `key` and takes it, in the table's order.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe at every scope: dropped, the future holds nothing and
    /// leaves no waiter behind.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, ScopedLockTable};
    /// let table = LockTable::new();
    /// let guard = ScopedLockTable::lock(&table, "k").await.unwrap();
    /// # drop(guard);
    /// # });
    /// ```
    fn lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
    where
        K: 'a;

    /// Like [`lock`](Self::lock), with options: a lease (the grant's
    /// authority ends at its deadline unless renewed), a timeout or a
    /// deadline (a timeout names who kept the key where the scope knows:
    /// [`ScopedError::blocker`]), shared mode where the scope has it
    /// ([`SHARED`](Self::SHARED)).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockOptions, LockTable, ScopedError, ScopedErrorKind, ScopedLockTable};
    /// let table = LockTable::new();
    /// let _held = table.lock("k").await;
    /// let opts = LockOptions::new().timeout(Duration::from_millis(1));
    /// let err = ScopedLockTable::lock_with(&table, "k", opts).await.unwrap_err();
    /// assert_eq!(err.kind(), ScopedErrorKind::Timeout);
    /// # });
    /// ```
    fn lock_with<'a>(
        &'a self,
        key: K,
        opts: LockOptions,
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
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, ScopedLockTable};
    /// let table = LockTable::new();
    /// let held = ScopedLockTable::try_lock(&table, "k").await.unwrap();
    /// assert!(held.is_some());
    /// assert!(ScopedLockTable::try_lock(&table, "k").await.unwrap().is_none());
    /// # });
    /// ```
    fn try_lock<'a>(
        &'a self,
        key: K,
    ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
    where
        K: 'a;

    /// Like [`try_lock`](Self::try_lock), with options (a lease; shared
    /// mode where the scope has it; a timeout is not used).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockOptions, LockTable, ScopedLockTable};
    /// let table = LockTable::new();
    /// let opts = LockOptions::new().lease(Duration::from_secs(30));
    /// let guard = ScopedLockTable::try_lock_with(&table, "k", opts).await.unwrap().unwrap();
    /// assert!(guard.expires_at().is_some());
    /// # });
    /// ```
    fn try_lock_with<'a>(
        &'a self,
        key: K,
        opts: LockOptions,
    ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
    where
        K: 'a;

    /// Who holds `key` now, if anyone.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, ScopedHolder, ScopedLockTable};
    /// let table = LockTable::new();
    /// let guard = table.lock("k").await;
    /// let holder = ScopedLockTable::holder(&table, &"k").await.unwrap().unwrap();
    /// assert_eq!(holder.token(), guard.token());
    /// # });
    /// ```
    fn holder<'a>(
        &'a self,
        key: &'a K,
    ) -> impl Future<Output = Result<Option<Self::Holder>, Self::Error>> + Send + 'a;
}

impl ScopedError for LockError {
    fn kind(&self) -> ScopedErrorKind {
        match self {
            Self::WouldBlock { .. } => ScopedErrorKind::WouldBlock,
            Self::Timeout { .. } => ScopedErrorKind::Timeout,
            Self::Expired { .. } => ScopedErrorKind::Expired,
            Self::InvalidOptions { .. } => ScopedErrorKind::InvalidOptions,
            _ => ScopedErrorKind::Other,
        }
    }

    fn blocker(&self) -> Option<Blocker> {
        match self {
            Self::Timeout {
                holder, held_for, ..
            } => Some(Blocker {
                token: *holder,
                held_for: *held_for,
            }),
            _ => None,
        }
    }
}

impl ScopedHolder for HolderStatus {
    fn token(&self) -> FencingToken {
        self.token
    }
}

impl<K, S> ScopedGuard for Guard<'_, K, S>
where
    K: Eq + Hash + Send + Sync,
    S: BuildHasher + Send + Sync,
{
    type Error = LockError;

    fn token(&self) -> FencingToken {
        Guard::token(self)
    }

    fn is_expired(&self) -> bool {
        Guard::is_expired(self)
    }

    fn check(&self) -> Result<FencingToken, LockError> {
        Guard::check(self)
    }

    fn renew(&self, lease: Duration) -> impl Future<Output = Result<(), LockError>> + Send + '_ {
        std::future::ready(Guard::renew(self, lease))
    }

    fn lost(&self) -> impl Future<Output = LockError> + Send + '_ {
        Guard::lost(self)
    }

    fn keep_alive(
        &self,
        interval: Duration,
        lease: Duration,
    ) -> impl Future<Output = LockError> + Send + '_ {
        Guard::keep_alive(self, interval, lease)
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
    type Error = LockError;
    type Holder = HolderStatus;
    const SHARED: bool = true;

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

    fn lock_with<'a>(
        &'a self,
        key: K,
        opts: LockOptions,
    ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
    where
        K: 'a,
    {
        LockTable::lock_with(self, key, opts)
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

    fn try_lock_with<'a>(
        &'a self,
        key: K,
        opts: LockOptions,
    ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
    where
        K: 'a,
    {
        std::future::ready(match LockTable::try_lock_with(self, key, opts) {
            Ok(g) => Ok(Some(g)),
            Err(LockError::WouldBlock { .. }) => Ok(None),
            Err(e) => Err(e),
        })
    }

    fn holder<'a>(
        &'a self,
        key: &'a K,
    ) -> impl Future<Output = Result<Option<HolderStatus>, Self::Error>> + Send + 'a {
        std::future::ready(Ok(LockTable::holder(self, key)))
    }
}

#[cfg(target_os = "linux")]
mod process {
    use super::*;
    use crate::process::{ProcessGuard, ProcessHolder, ProcessLockError, ProcessLockTable};

    impl ScopedError for ProcessLockError {
        fn kind(&self) -> ScopedErrorKind {
            match self {
                Self::WouldBlock { .. } => ScopedErrorKind::WouldBlock,
                Self::Timeout { .. } => ScopedErrorKind::Timeout,
                Self::Expired { .. } => ScopedErrorKind::Expired,
                Self::InvalidOptions { .. } => ScopedErrorKind::InvalidOptions,
                _ => ScopedErrorKind::Other,
            }
        }

        fn blocker(&self) -> Option<Blocker> {
            match self {
                Self::WouldBlock { holder, .. } | Self::Timeout { holder, .. } => Some(Blocker {
                    token: holder.as_ref().map(|h| h.token),
                    held_for: holder.as_ref().map(|h| h.held_for),
                }),
                _ => None,
            }
        }
    }

    impl ScopedHolder for ProcessHolder {
        fn token(&self) -> FencingToken {
            self.token
        }
    }

    impl<K: Send + Sync> ScopedGuard for ProcessGuard<'_, K> {
        type Error = ProcessLockError;

        fn token(&self) -> FencingToken {
            ProcessGuard::token(self)
        }

        fn is_expired(&self) -> bool {
            ProcessGuard::is_expired(self)
        }

        fn check(&self) -> Result<FencingToken, ProcessLockError> {
            ProcessGuard::check(self)
        }

        fn renew(
            &self,
            lease: Duration,
        ) -> impl Future<Output = Result<(), ProcessLockError>> + Send + '_ {
            std::future::ready(ProcessGuard::renew(self, lease))
        }

        fn lost(&self) -> impl Future<Output = ProcessLockError> + Send + '_ {
            ProcessGuard::lost(self)
        }

        fn keep_alive(
            &self,
            interval: Duration,
            lease: Duration,
        ) -> impl Future<Output = ProcessLockError> + Send + '_ {
            ProcessGuard::keep_alive(self, interval, lease)
        }
    }

    impl<K: AsRef<[u8]> + Send + Sync> ScopedLockTable<K> for ProcessLockTable<K> {
        type Guard<'a>
            = ProcessGuard<'a, K>
        where
            Self: 'a,
            K: 'a;
        type Error = ProcessLockError;
        type Holder = ProcessHolder;
        const SHARED: bool = false;

        fn lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ProcessLockTable::lock(self, key)
        }

        fn lock_with<'a>(
            &'a self,
            key: K,
            opts: LockOptions,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ProcessLockTable::lock_with(self, key, opts)
        }

        fn try_lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ScopedLockTable::try_lock_with(self, key, LockOptions::new())
        }

        fn try_lock_with<'a>(
            &'a self,
            key: K,
            opts: LockOptions,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            std::future::ready(match ProcessLockTable::try_lock_with(self, key, opts) {
                Ok(g) => Ok(Some(g)),
                Err(ProcessLockError::WouldBlock { .. }) => Ok(None),
                Err(e) => Err(e),
            })
        }

        fn holder<'a>(
            &'a self,
            key: &'a K,
        ) -> impl Future<Output = Result<Option<ProcessHolder>, Self::Error>> + Send + 'a {
            std::future::ready(ProcessLockTable::holder(self, key))
        }
    }
}

#[cfg(feature = "etcd")]
mod cluster {
    use super::*;
    use crate::etcd::{ClusterGuard, ClusterHolder, ClusterLockError, ClusterLockTable};

    impl ScopedError for ClusterLockError {
        fn kind(&self) -> ScopedErrorKind {
            match self {
                Self::WouldBlock { .. } => ScopedErrorKind::WouldBlock,
                Self::Timeout { .. } => ScopedErrorKind::Timeout,
                Self::Expired { .. } => ScopedErrorKind::Expired,
                Self::InvalidOptions { .. } => ScopedErrorKind::InvalidOptions,
                Self::Unavailable { .. } | Self::SessionLost { .. } => ScopedErrorKind::Unavailable,
                _ => ScopedErrorKind::Other,
            }
        }

        fn blocker(&self) -> Option<Blocker> {
            match self {
                Self::WouldBlock { holder, .. } | Self::Timeout { holder, .. } => Some(Blocker {
                    token: holder.as_ref().map(|h| h.token),
                    held_for: holder.as_ref().and_then(|h| h.held_for),
                }),
                _ => None,
            }
        }
    }

    impl ScopedHolder for ClusterHolder {
        fn token(&self) -> FencingToken {
            self.token
        }
    }

    impl<K: Send + Sync> ScopedGuard for ClusterGuard<'_, K> {
        type Error = ClusterLockError;

        fn token(&self) -> FencingToken {
            ClusterGuard::token(self)
        }

        fn is_expired(&self) -> bool {
            ClusterGuard::is_expired(self)
        }

        fn check(&self) -> Result<FencingToken, ClusterLockError> {
            ClusterGuard::check(self)
        }

        fn renew(
            &self,
            _lease: Duration,
        ) -> impl Future<Output = Result<(), ClusterLockError>> + Send + '_ {
            // The etcd lease's TTL was fixed when it was granted.
            let renew = ClusterGuard::renew(self);
            async move { renew.await.map(|_| ()) }
        }

        fn lost(&self) -> impl Future<Output = ClusterLockError> + Send + '_ {
            ClusterGuard::lost(self)
        }

        fn keep_alive(
            &self,
            interval: Duration,
            _lease: Duration,
        ) -> impl Future<Output = ClusterLockError> + Send + '_ {
            ClusterGuard::keep_alive(self, interval)
        }
    }

    impl<K: AsRef<[u8]> + Send + Sync> ScopedLockTable<K> for ClusterLockTable<K> {
        type Guard<'a>
            = ClusterGuard<'a, K>
        where
            Self: 'a,
            K: 'a;
        type Error = ClusterLockError;
        type Holder = ClusterHolder;
        const SHARED: bool = true;

        fn lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ClusterLockTable::lock(self, key)
        }

        fn lock_with<'a>(
            &'a self,
            key: K,
            opts: LockOptions,
        ) -> impl Future<Output = Result<Self::Guard<'a>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ClusterLockTable::lock_with(self, key, opts)
        }

        fn try_lock<'a>(
            &'a self,
            key: K,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            ScopedLockTable::try_lock_with(self, key, LockOptions::new())
        }

        fn try_lock_with<'a>(
            &'a self,
            key: K,
            opts: LockOptions,
        ) -> impl Future<Output = Result<Option<Self::Guard<'a>>, Self::Error>> + Send + 'a
        where
            K: 'a,
        {
            let fut = ClusterLockTable::try_lock_with(self, key, opts);
            async move {
                match fut.await {
                    Ok(g) => Ok(Some(g)),
                    Err(ClusterLockError::WouldBlock { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            }
        }

        fn holder<'a>(
            &'a self,
            key: &'a K,
        ) -> impl Future<Output = Result<Option<ClusterHolder>, Self::Error>> + Send + 'a {
            ClusterLockTable::holder(self, key)
        }
    }
}
