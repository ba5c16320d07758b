//! The guards of the cluster scope: a key held across the cluster, judged
//! locally against its lease, released on drop by a task.

use std::sync::{Arc, PoisonError};
use std::time::Instant;

use super::error::ClusterLockError;
use super::lost::{ClusterKeepAlive, ClusterLost};
use super::recipe::{self, Grant, GrantLease};
use super::table::{ClusterLockTable, Inner};
use crate::{FencingToken, Mode, OwnedGuard};

/// The fence of a grant at the store: its waiter key and create revision.
/// An etcd transaction that includes [`compare`](Self::compare) applies
/// only while the grant still holds the key (its waiter key, with that
/// create revision, exists), whatever the holder's clock says.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use etcd_client::{Txn, TxnOp};
/// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
/// let guard = table.lock("account-9").await?;
/// let txn = Txn::new()
///     .when([guard.fence().compare()])
///     .and_then([TxnOp::put("accounts/9/balance", "120", None)]);
/// let resp = table.client().clone().txn(txn).await?;
/// assert!(resp.succeeded(), "refused only if the grant had lost the key");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    key: String,
    revision: i64,
}

impl Fence {
    /// The grant's waiter key in etcd.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its create revision (the grant's fencing token).
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// `create_revision(key) == revision`: put it in the `when` of your own
    /// etcd transactions.
    pub fn compare(&self) -> etcd_client::Compare {
        etcd_client::Compare::create_revision(
            self.key.clone(),
            etcd_client::CompareOp::Equal,
            self.revision,
        )
    }
}

/// What a guard holds: the grant in etcd and the in-process grant that
/// keeps this table's other callers queued.
#[derive(Debug)]
pub(crate) struct Held<K> {
    key: K,
    grant: Option<Grant>,
    /// Released after the waiter key is deleted, so that the next caller of
    /// this table never finds it.
    local: Option<OwnedGuard<String>>,
    inner: Arc<Inner>,
}

impl<K> Held<K> {
    pub(crate) fn new(inner: Arc<Inner>, key: K, grant: Grant, local: OwnedGuard<String>) -> Self {
        Self {
            key,
            grant: Some(grant),
            local: Some(local),
            inner,
        }
    }

    fn grant(&self) -> &Grant {
        self.grant.as_ref().expect("a live guard has its grant")
    }

    /// The key's name, for an error.
    fn key_name(&self) -> Box<str> {
        self.local.as_ref().map_or_else(
            || "(released)".into(),
            |local| super::key::name(local.key()),
        )
    }

    /// This grant's loss, as an error naming its key.
    fn expired(&self) -> ClusterLockError {
        ClusterLockError::Expired {
            token: self.grant().token,
            key: self.key_name(),
        }
    }

    /// The lease that carries the grant.
    pub(crate) fn lease(&self) -> &GrantLease {
        &self.grant().lease
    }

    pub(crate) fn check(&self) -> Result<FencingToken, ClusterLockError> {
        let grant = self.grant();
        if grant.lease.is_live() {
            Ok(grant.token)
        } else {
            Err(self.expired())
        }
    }

    pub(crate) async fn renew(&self) -> Result<FencingToken, ClusterLockError> {
        let token = self.check()?;
        let grant = self.grant();
        match &grant.lease {
            GrantLease::Session(session) => {
                let session = Arc::clone(session);
                let task = self
                    .inner
                    .handle
                    .spawn(async move { session.refresh().await });
                task.await.map_err(|_| ClusterLockError::Expired {
                    token,
                    key: self.key_name(),
                })??;
            }
            GrantLease::Own {
                id,
                ttl,
                valid_until,
                ..
            } => {
                let (id, ttl) = (*id, *ttl);
                let etcd = Arc::clone(&self.inner.etcd);
                let task = self.inner.handle.spawn(async move {
                    let sent = super::now();
                    let mut stream = etcd.lease_keep_alive(id).await?;
                    stream.keep_alive().await?;
                    let ttl = stream.message().await?;
                    Ok::<_, etcd_client::Error>((sent, ttl.unwrap_or(0)))
                });
                let (sent, granted) = task
                    .await
                    .map_err(|_| ClusterLockError::Expired {
                        token,
                        key: self.key_name(),
                    })?
                    .map_err(|e| match e {
                        etcd_client::Error::LeaseKeepAliveError(_) => ClusterLockError::Expired {
                            token,
                            key: self.key_name(),
                        },
                        e => ClusterLockError::etcd("renew the grant's lease", e),
                    })?;
                let mut v = valid_until.lock().unwrap_or_else(PoisonError::into_inner);
                // A renewal never revives: sent after the bound, or answered
                // "gone", the grant is lost.
                if granted <= 0 || sent >= *v {
                    *v = sent.min(*v);
                    return Err(ClusterLockError::Expired {
                        token,
                        key: self.key_name(),
                    });
                }
                *v = (*v).max(sent + ttl);
            }
        }
        Ok(token)
    }

    async fn unlock(&mut self) -> Result<FencingToken, ClusterLockError> {
        let name = self.key_name();
        let (Some(grant), Some(local)) = (self.grant.take(), self.local.take()) else {
            unreachable!("unlock consumes the guard");
        };
        let token = grant.token;
        let live = grant.lease.is_live();
        let inner = Arc::clone(&self.inner);
        let task = self.inner.handle.spawn(async move {
            let r = recipe::release(&inner, &grant).await;
            drop(local);
            r
        });
        task.await.map_err(|_| ClusterLockError::Expired {
            token,
            key: name.clone(),
        })??;
        if live {
            Ok(token)
        } else {
            Err(ClusterLockError::Expired { token, key: name })
        }
    }
}

impl<K> Drop for Held<K> {
    fn drop(&mut self) {
        if let (Some(grant), local) = (self.grant.take(), self.local.take()) {
            let inner = Arc::clone(&self.inner);
            // Not blocking in drop: a task deletes the waiter key, then lets
            // the in-process grant go. If the runtime is gone, the key goes
            // with its lease.
            drop(self.inner.handle.spawn(async move {
                let _ = recipe::release(&inner, &grant).await;
                drop(local);
            }));
        }
    }
}

macro_rules! cluster_guard_methods {
    () => {
        /// The key this guard holds.
        pub fn key(&self) -> &K {
            &self.held.key
        }

        /// The mode of this grant: [`Mode::Exclusive`] (a writer, alone)
        /// or [`Mode::Shared`] (a reader, with the key's other readers).
        pub fn mode(&self) -> Mode {
            self.held
                .local
                .as_ref()
                .map_or(Mode::Exclusive, OwnedGuard::mode)
        }

        /// The fencing token of this grant: its waiter key's create
        /// revision, above every earlier grant's of the key in the cluster
        /// (and unique across all keys of the cluster).
        pub fn token(&self) -> FencingToken {
            self.held.grant().token
        }

        /// The fence at the store: the waiter key and its create revision,
        /// to compare in your own etcd transactions.
        pub fn fence(&self) -> Fence {
            let g = self.held.grant();
            Fence {
                key: g.waiter_key.clone(),
                revision: g.revision,
            }
        }

        /// The etcd lease that carries this grant's waiter key (the
        /// session's, or the grant's own).
        pub fn lease_id(&self) -> i64 {
            self.held.grant().lease.id()
        }

        /// The commit-time check, judged now with no round trip:
        /// `Ok(token)` while the lease that carries the grant is certainly
        /// alive (the session's keep-alives are answered, the grant's own
        /// lease has not run out). A session whose keep-alive failed past
        /// its TTL, or was told the lease is gone, fails it at once.
        ///
        /// # Errors
        ///
        /// [`ClusterLockError::Expired`] once the grant may have lost the key.
        pub fn check(&self) -> Result<FencingToken, ClusterLockError> {
            self.held.check()
        }

        /// Whether the grant may have lost its authority (`check()` fails).
        pub fn is_expired(&self) -> bool {
            self.check().is_err()
        }

        /// The instant before which etcd cannot have ended the grant's
        /// lease, as this process knows now (it moves with each answered
        /// keep-alive).
        pub fn expires_at(&self) -> Instant {
            self.held.grant().lease.valid_until()
        }

        /// Renews the lease that carries the grant now, with one round trip:
        /// a keep-alive of the session's lease (all the session's grants
        /// gain), or of the grant's own (its TTL again from now). A grant
        /// that already failed `check()` is never revived.
        ///
        /// # Errors
        ///
        /// [`ClusterLockError::Expired`] if the grant had lost the key or
        /// etcd says its lease is gone; [`ClusterLockError::SessionLost`];
        /// [`ClusterLockError::Unavailable`] if etcd cannot be reached
        /// before the grant's bound (the grant keeps its current bound);
        /// [`ClusterLockError::Etcd`] if etcd refuses the keep-alive.
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: a keep-alive is idempotent; dropped, it may still
        /// extend the lease in etcd, never the local bound.
        pub async fn renew(&self) -> Result<FencingToken, ClusterLockError> {
            self.held.renew().await
        }

        /// A future that resolves when this grant may have lost its
        /// authority (when `check()` would fail), with the reason: the
        /// moment its session is marked lost, or at the lease's bound if
        /// no answered keep-alive moved it; at once if it already has. See
        /// [`ClusterLost`].
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it changes nothing.
        ///
        /// ```no_run
        /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
        /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
        /// let guard = table.lock("job").await?;
        /// table.client().clone().lease_revoke(guard.lease_id()).await.ok();
        /// let why = guard.lost().await; // once the session learns of it
        /// assert!(why.to_string().contains("lost"));
        /// # Ok(()) }
        /// ```
        pub fn lost(&self) -> ClusterLost<'_>
        where
            K: Sync,
        {
            ClusterLost::new(&self.held)
        }

        /// A future that keeps the lease that carries this grant alive
        /// until it is dropped, renewing a lease of the grant's own every
        /// `interval` (the session's lease is kept alive by the session),
        /// and resolves at the first failure with the reason. See
        /// [`ClusterKeepAlive`].
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it stops the renewals.
        ///
        /// ```no_run
        /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
        /// use std::time::Duration;
        /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
        /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(3));
        /// let guard = table.lock_with("job", opts).await?;
        /// // An interval not shorter than the lease's TTL is refused at once.
        /// let err = guard.keep_alive(Duration::from_secs(3)).await;
        /// assert!(matches!(err, keylock::etcd::ClusterLockError::InvalidOptions { .. }));
        /// # Ok(()) }
        /// ```
        pub fn keep_alive(&self, interval: std::time::Duration) -> ClusterKeepAlive<'_>
        where
            K: Sync,
        {
            ClusterKeepAlive::new(&self.held, interval)
        }

        /// Releases the key and waits until etcd has deleted the waiter key
        /// (dropping the guard does the same without waiting). Says whether
        /// the grant held the key, live, to the end.
        ///
        /// # Errors
        ///
        /// [`ClusterLockError::Expired`] if the grant's lease had ended;
        /// [`ClusterLockError::Unavailable`] if the delete could not be made
        /// before the lease's bound, or [`ClusterLockError::Etcd`] if etcd
        /// refused it: the table then retires its session (its other guards
        /// fail `check()`, and its lease is revoked, retried while etcd
        /// cannot be reached), so the key goes with the lease, and the next
        /// lock starts a new session.
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: the release runs as a task and completes anyway.
        pub async fn unlock(mut self) -> Result<FencingToken, ClusterLockError> {
            self.held.unlock().await
        }

        /// Releases the key; the same as dropping the guard.
        pub fn release(self) {
            drop(self);
        }
    };
}

/// A key held across the cluster; dropping it releases the key.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
/// let guard = table.lock("row-7").await?;
/// let token = guard.check()?; // write with it
/// assert_eq!(guard.renew().await?, token);
/// assert_eq!(guard.unlock().await?, token);
/// # Ok(()) }
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
#[derive(Debug)]
pub struct ClusterGuard<'a, K> {
    held: Held<K>,
    _table: std::marker::PhantomData<&'a ClusterLockTable<K>>,
}

impl<K> ClusterGuard<'_, K> {
    pub(crate) fn new(held: Held<K>) -> Self {
        Self {
            held,
            _table: std::marker::PhantomData,
        }
    }

    cluster_guard_methods!();
}

/// A key held across the cluster, keeping its table alive (`'static`).
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// use std::sync::Arc;
/// let table = Arc::new(keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?);
/// let guard = table.clone().lock_owned("k").await?;
/// assert!(Arc::ptr_eq(guard.table(), &table));
/// # drop(guard); Ok(()) }
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct OwnedClusterGuard<K> {
    held: Held<K>,
    table: Arc<ClusterLockTable<K>>,
}

impl<K: std::fmt::Debug> std::fmt::Debug for OwnedClusterGuard<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedClusterGuard")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<K> OwnedClusterGuard<K> {
    pub(crate) fn new(table: Arc<ClusterLockTable<K>>, held: Held<K>) -> Self {
        Self { held, table }
    }

    /// The table this guard belongs to.
    pub fn table(&self) -> &Arc<ClusterLockTable<K>> {
        &self.table
    }

    cluster_guard_methods!();
}
