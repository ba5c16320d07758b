//! [`ClusterLockTable`]: the cluster scope's table, its options, its entry
//! points and its named futures.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::client::{Etcd, EtcdClient};
use super::error::{ClusterHolder, ClusterLockError};
use super::guard::{ClusterGuard, Held, OwnedClusterGuard};
use super::key;
use super::now;
use super::recipe::{self, Grant, Undo};
use super::retry::RetryCounts;
use super::session::Session;
use crate::{LockError, LockOptions, LockTable, Mode, OwnedGuard, DEFAULT_MAX_LEASE};

/// The longest session TTL [`ClusterOptions::session_ttl`] accepts: one
/// hour (a dead process's keys stay blocked this long).
pub const MAX_SESSION_TTL: Duration = Duration::from_secs(3600);

/// The shortest request timeout [`ClusterOptions::request_timeout`]
/// accepts.
const MIN_REQUEST_TIMEOUT: Duration = Duration::from_millis(1);

/// The longest request timeout [`ClusterOptions::request_timeout`]
/// accepts: one hour.
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(3600);

/// How a [`ClusterLockTable`] connects and names its keys.
///
/// ```
/// use std::time::Duration;
/// let opts = keylock::etcd::ClusterOptions::new()
///     .prefix("billing/locks")
///     .session_ttl(Duration::from_secs(5))
///     .label("invoice-worker");
/// # let _ = opts;
/// ```
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    prefix: String,
    session_ttl: Duration,
    request_timeout: Duration,
    label: Option<String>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl ClusterOptions {
    /// The defaults: prefix `keylock`, a session TTL of 10 s, a request
    /// timeout of 2 s, no label.
    pub fn new() -> Self {
        Self {
            prefix: "keylock".to_owned(),
            session_ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(2),
            label: None,
        }
    }

    /// The etcd key prefix of the table's waiter keys (no trailing `/`).
    /// Tables that share keys must use the same prefix.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into().trim_end_matches('/').to_owned();
        self
    }

    /// The TTL of the session's lease, in whole seconds (rounded up; etcd
    /// raises it to its own minimum, 1.5 times its election timeout). A
    /// process that dies frees its keys this long after its last
    /// keep-alive; a process cut from the cluster fences its guards at most
    /// this long after its last answered keep-alive, and a lock that cannot
    /// start a session gives up after it (see
    /// [`request_timeout`](Self::request_timeout)).
    ///
    /// Above zero (a fraction of a second counts as one second) and at
    /// most one hour ([`MAX_SESSION_TTL`]):
    /// [`connect_with`](ClusterLockTable::connect_with) refuses others
    /// with [`ClusterLockError::InvalidOptions`].
    #[must_use]
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// How long one etcd call may take before it is treated as ambiguous
    /// and sent again (see the [module documentation](super#faults)). A
    /// lock without a timeout that must start a session gives up after the
    /// session TTL or this, whichever is longer, with
    /// [`ClusterLockError::Unavailable`].
    ///
    /// From 1 ms to one hour ([`MAX_REQUEST_TIMEOUT`]):
    /// [`connect_with`](ClusterLockTable::connect_with) refuses others
    /// with [`ClusterLockError::InvalidOptions`].
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Refuses an option out of its range, naming it and the range.
    fn validate(&self) -> Result<(), ClusterLockError> {
        let out_of_range = |option: &'static str, v: Duration, range: String| {
            Err(ClusterLockError::InvalidOptions {
                option,
                reason: format!("{v:?} is out of range: {range}"),
            })
        };
        if self.session_ttl.is_zero() || self.session_ttl > MAX_SESSION_TTL {
            return out_of_range(
                "session_ttl",
                self.session_ttl,
                format!(
                    "give a TTL above zero and at most {MAX_SESSION_TTL:?} (whole seconds; a \
                     fraction counts as one)"
                ),
            );
        }
        if self.request_timeout < MIN_REQUEST_TIMEOUT || self.request_timeout > MAX_REQUEST_TIMEOUT
        {
            return out_of_range(
                "request_timeout",
                self.request_timeout,
                format!(
                    "give a timeout between {MIN_REQUEST_TIMEOUT:?} and {MAX_REQUEST_TIMEOUT:?}"
                ),
            );
        }
        Ok(())
    }

    /// Names this table's grants in their waiter keys (a service, a job),
    /// for timeout messages and [`ClusterLockTable::holder`].
    #[must_use]
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}

/// What every guard and future of a table shares.
pub(crate) struct Inner {
    /// The etcd calls (the client seam).
    pub(crate) etcd: Arc<dyn Etcd>,
    /// The etcd client behind `etcd`, for [`ClusterLockTable::client`]:
    /// `None` only for the tables of the crate's simulation.
    client: Option<etcd_client::Client>,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) prefix: String,
    pub(crate) label: Option<String>,
    session_ttl: Duration,
    /// How long one etcd call may take ([`ClusterOptions::request_timeout`]).
    pub(crate) request_timeout: Duration,
    /// The current session; replaced by a new one when it is lost.
    session: tokio::sync::Mutex<Arc<Session>>,
    /// The in-process tier: one queue per key, so that at most one caller
    /// of this table at a time has a waiter key in etcd.
    pub(crate) local: Arc<LockTable<String>>,
    /// Waiter keys of this table in etcd now (waiting or holding).
    pub(crate) etcd_waiters: AtomicUsize,
    /// Numbers shared grants' waiter keys (one per grant).
    pub(crate) readers: AtomicU64,
    pub(crate) counts: RetryCounts,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("prefix", &self.prefix)
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

impl Inner {
    /// The live session, starting a new one if the current one was lost
    /// (retrying until `deadline`).
    async fn session(&self, deadline: Instant) -> Result<Arc<Session>, ClusterLockError> {
        let mut current = self.session.lock().await;
        if !current.state.is_live() {
            *current = Arc::new(
                Session::start(
                    &self.etcd,
                    &self.handle,
                    self.session_ttl,
                    &self.counts,
                    deadline,
                )
                .await?,
            );
        }
        Ok(Arc::clone(&current))
    }
}

/// A table of keyed locks shared by every process that connects to the same
/// etcd cluster with the same prefix; see the [module
/// documentation](super).
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// use keylock::etcd::ClusterLockTable;
///
/// let table = ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
/// let guard = table.lock("invoice-17").await?;
/// // ... no other process of the cluster holds "invoice-17" now ...
/// let token = guard.check()?; // fence the write with it
/// drop(guard);
/// assert!(table.lock("invoice-17").await?.token() > token);
/// # Ok(()) }
/// ```
pub struct ClusterLockTable<K> {
    inner: Arc<Inner>,
    _key: PhantomData<fn(K) -> K>,
}

impl<K> std::fmt::Debug for ClusterLockTable<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterLockTable")
            .field("prefix", &self.inner.prefix)
            .field("label", &self.inner.label)
            .finish_non_exhaustive()
    }
}

/// Counts of a [`ClusterLockTable`], read cheaply.
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
/// let table = keylock::etcd::ClusterLockTable::<&str>::connect(["http://127.0.0.1:2379"]).await?;
/// assert_eq!(table.stats().etcd_waiters, 0);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterStats {
    /// Waiter keys of this table in etcd now, waiting or holding: at most
    /// one per key, since the table's other callers queue in the process.
    pub etcd_waiters: usize,
    /// etcd calls sent again after a refused connection (safe retries).
    pub retries_refused: u64,
    /// etcd calls sent again after an ambiguous failure (a timeout, a
    /// leader change, a broken stream), as re-reads.
    pub retries_ambiguous: u64,
}

/// One line: each counter by name.
///
/// ```no_run
/// # async fn f() -> Result<(), keylock::etcd::ClusterLockError> {
/// let table = keylock::etcd::ClusterLockTable::<&str>::connect(["http://127.0.0.1:2379"]).await?;
/// let line = table.stats().to_string();
/// assert!(line.starts_with("0 etcd waiters"), "{line}");
/// # Ok(()) }
/// # let _ = f;
/// ```
impl std::fmt::Display for ClusterStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} etcd waiters, {} retries after a refusal, {} retries after an ambiguous failure",
            self.etcd_waiters, self.retries_refused, self.retries_ambiguous
        )
    }
}

impl<K> ClusterLockTable<K> {
    /// Connects to the etcd cluster at `endpoints` (`http://host:port`)
    /// with the default [`ClusterOptions`], and starts the session (grants
    /// its lease and keeps it alive). Call it inside a tokio runtime: the
    /// table runs its etcd calls on it, whatever runtime later awaits its
    /// futures.
    ///
    /// # Errors
    ///
    /// [`ClusterLockError::NoRuntime`] outside a tokio runtime;
    /// [`ClusterLockError::InvalidOptions`] for an option out of range;
    /// [`ClusterLockError::Etcd`] if the endpoints are invalid or etcd
    /// refuses the lease; [`ClusterLockError::Unavailable`] if no member
    /// grants it within the session TTL (or the request timeout, if
    /// longer).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropped before it resolves, it leaves at most a lease
    /// that expires after its TTL.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// let table = keylock::etcd::ClusterLockTable::<String>::connect([
    ///     "http://10.0.0.1:2379",
    ///     "http://10.0.0.2:2379",
    ///     "http://10.0.0.3:2379",
    /// ])
    /// .await?;
    /// # let _ = table; Ok(()) }
    /// ```
    pub async fn connect<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<Self, ClusterLockError> {
        Self::connect_with(endpoints, ClusterOptions::new()).await
    }

    /// Like [`connect`](Self::connect), with options.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    ///
    /// # Cancel safety
    ///
    /// As [`connect`](Self::connect).
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use keylock::etcd::{ClusterLockTable, ClusterOptions};
    /// let opts = ClusterOptions::new().prefix("jobs").label("scheduler");
    /// let table = ClusterLockTable::<String>::connect_with(["http://127.0.0.1:2379"], opts).await?;
    /// # let _ = table; Ok(()) }
    /// ```
    pub async fn connect_with<E: AsRef<str>>(
        endpoints: impl IntoIterator<Item = E>,
        opts: ClusterOptions,
    ) -> Result<Self, ClusterLockError> {
        opts.validate()?;
        let handle =
            tokio::runtime::Handle::try_current().map_err(|_| ClusterLockError::NoRuntime)?;
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.as_ref().to_owned())
            .collect();
        let connect = etcd_client::ConnectOptions::new()
            .with_timeout(opts.request_timeout)
            .with_connect_timeout(opts.request_timeout)
            .with_keep_alive(Duration::from_secs(2), opts.request_timeout);
        let client = etcd_client::Client::connect(&endpoints, Some(connect))
            .await
            .map_err(|e| ClusterLockError::etcd("connect", e))?;
        let etcd: Arc<dyn Etcd> = Arc::new(EtcdClient(client.clone()));
        Self::start(etcd, Some(client), handle, opts, RetryCounts::default()).await
    }

    /// A table on the simulation's model of etcd (the crate's tests), its
    /// retries' jitter seeded with `seed`.
    #[cfg(test)]
    pub(crate) async fn on_model(
        etcd: Arc<dyn Etcd>,
        opts: ClusterOptions,
        seed: u64,
    ) -> Result<Self, ClusterLockError> {
        opts.validate()?;
        let handle =
            tokio::runtime::Handle::try_current().map_err(|_| ClusterLockError::NoRuntime)?;
        Self::start(etcd, None, handle, opts, RetryCounts::seeded(seed)).await
    }

    /// Starts the session on `etcd` and makes the table.
    async fn start(
        etcd: Arc<dyn Etcd>,
        client: Option<etcd_client::Client>,
        handle: tokio::runtime::Handle,
        opts: ClusterOptions,
        counts: RetryCounts,
    ) -> Result<Self, ClusterLockError> {
        // A cluster that cannot be reached fails the connect, after
        // retrying for one session TTL (or one request timeout, if longer).
        let bound = now() + opts.session_ttl.max(opts.request_timeout);
        let session = Session::start(&etcd, &handle, opts.session_ttl, &counts, bound).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                etcd,
                client,
                handle,
                prefix: opts.prefix,
                label: opts.label,
                session_ttl: opts.session_ttl,
                request_timeout: opts.request_timeout,
                session: tokio::sync::Mutex::new(Arc::new(session)),
                local: Arc::new(LockTable::new()),
                etcd_waiters: AtomicUsize::new(0),
                readers: AtomicU64::new(0),
                counts,
            }),
            _key: PhantomData,
        })
    }

    /// The etcd client the table uses, for the caller's own calls (for
    /// example a transaction fenced by [`ClusterGuard::fence`]).
    pub fn client(&self) -> &etcd_client::Client {
        self.inner
            .client
            .as_ref()
            .expect("a table made by connect has its etcd client")
    }

    /// The key prefix of the table's waiter keys.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The etcd lease of the current session (a new one after a session is
    /// lost; 0 while a new session is being started).
    pub fn lease_id(&self) -> i64 {
        self.inner
            .session
            .try_lock()
            .map_or(0, |s| s.state.lease_id)
    }

    /// The current session's lease and whether the table has declared it
    /// lost (`None` while a new session is being started): for the
    /// simulation's checks.
    #[cfg(test)]
    pub(crate) fn session_state(&self) -> Option<(i64, bool)> {
        self.inner
            .session
            .try_lock()
            .ok()
            .map(|s| (s.state.lease_id, !s.state.is_live()))
    }

    /// Counts of this table (this process only).
    pub fn stats(&self) -> ClusterStats {
        ClusterStats {
            etcd_waiters: self.inner.etcd_waiters.load(Ordering::Relaxed),
            retries_refused: self.inner.counts.refused.load(Ordering::Relaxed),
            retries_ambiguous: self.inner.counts.ambiguous.load(Ordering::Relaxed),
        }
    }

    /// How many callers of this table wait for `key` in the process (behind
    /// the one with a waiter key in etcd, if any).
    pub fn waiters<Q: AsRef<[u8]> + ?Sized>(&self, key: &Q) -> usize {
        self.inner.local.waiters(&key::encode(key.as_ref()))
    }

    /// The etcd key prefix under which `key`'s waiter keys live (with its
    /// trailing `/`): the oldest key under it is the holder's.
    pub fn key_prefix<Q: AsRef<[u8]> + ?Sized>(&self, key: &Q) -> String {
        key::key_prefix(&self.inner.prefix, &key::encode(key.as_ref()))
    }

    /// Who holds `key` now, as its waiter key says (any process of the
    /// cluster); `None` if nobody holds or waits for it.
    ///
    /// # Errors
    ///
    /// [`ClusterLockError::Etcd`] if etcd cannot be read.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads.
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
    /// let guard = table.lock("k").await?;
    /// assert_eq!(table.holder(&"k").await?.unwrap().token, guard.token());
    /// # Ok(()) }
    /// ```
    pub async fn holder<Q: AsRef<[u8]> + ?Sized>(
        &self,
        key: &Q,
    ) -> Result<Option<ClusterHolder>, ClusterLockError> {
        let prefix = self.key_prefix(key);
        let inner = Arc::clone(&self.inner);
        let task = self
            .inner
            .handle
            .spawn(async move { inner.etcd.oldest(&prefix).await });
        let resp = task
            .await
            .map_err(|e| {
                ClusterLockError::etcd(
                    "read the holder",
                    etcd_client::Error::Internal(e.to_string()),
                )
            })?
            .map_err(|e| ClusterLockError::etcd("read the holder", e))?;
        Ok(resp.as_ref().and_then(super::client::Entry::holder))
    }
}

/// The deadline of a call: the earlier of its timeout and its deadline.
fn deadline_of(opts: &LockOptions, now: Instant) -> Option<Instant> {
    let by_timeout = opts.timeout_duration().map(|t| now.checked_add(t));
    match (by_timeout, opts.deadline_instant()) {
        (Some(None), d) | (None, d) => d,
        (Some(Some(t)), Some(d)) => Some(t.min(d)),
        (Some(Some(t)), None) => Some(t),
    }
}

fn check_options(opts: &LockOptions) -> Result<Option<Duration>, ClusterLockError> {
    if let Some(label) = opts.label_name() {
        return Err(ClusterLockError::InvalidOptions {
            option: "label",
            reason: format!(
                "{label:?}: the cluster scope labels a table's grants, not one lock's; use \
                 `ClusterOptions::label`"
            ),
        });
    }
    match opts.lease_duration() {
        Some(lease) if lease.is_zero() || lease > DEFAULT_MAX_LEASE => {
            Err(ClusterLockError::InvalidOptions {
                option: "lease",
                reason: format!("{lease:?} is not between 1ns and {DEFAULT_MAX_LEASE:?}"),
            })
        }
        lease => Ok(lease),
    }
}

/// The whole acquisition: the in-process tier, then etcd (on the table's
/// runtime, so that any executor may await it).
async fn acquire<K: AsRef<[u8]>>(
    inner: Arc<Inner>,
    key: K,
    opts: LockOptions,
    wait: bool,
) -> Result<Held<K>, ClusterLockError> {
    let started = now();
    let own_lease = check_options(&opts)?;
    let mode = opts.lock_mode();
    let stem = key::encode(key.as_ref());
    let deadline = if wait {
        deadline_of(&opts, started)
    } else {
        None
    };
    let local = if wait {
        let mut local_opts = LockOptions::new().mode(mode);
        if let Some(d) = deadline {
            local_opts = local_opts.deadline(d);
        }
        match Arc::clone(&inner.local)
            .lock_owned_with(stem.clone(), local_opts)
            .await
        {
            Ok(guard) => guard,
            Err(LockError::Timeout { .. }) => {
                return Err(ClusterLockError::Timeout {
                    waited: now().saturating_duration_since(started),
                    holder: None,
                    ahead: 0,
                    key: key::name(&stem),
                })
            }
            Err(other) => {
                return Err(ClusterLockError::InvalidOptions {
                    option: "options",
                    reason: other.to_string(),
                })
            }
        }
    } else {
        Arc::clone(&inner.local)
            .try_lock_owned_with(stem.clone(), LockOptions::new().mode(mode))
            .map_err(|_| ClusterLockError::WouldBlock {
                holder: None,
                key: key::name(&stem),
            })?
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task_inner = Arc::clone(&inner);
    drop(inner.handle.spawn(remote(
        task_inner, stem, mode, own_lease, deadline, wait, started, local, tx,
    )));
    match rx.await {
        Ok(Ok((grant, local))) => Ok(Held::new(inner, key, grant, local)),
        Ok(Err(err)) => Err(err),
        Err(_) => Err(ClusterLockError::etcd(
            "run the etcd calls",
            etcd_client::Error::Internal("the table's tokio runtime has shut down".into()),
        )),
    }
}

type Outcome = Result<(Grant, OwnedGuard<String>), ClusterLockError>;

/// The etcd half, run as a task: it owns the in-process grant until it
/// hands both over, and undoes its waiter key if the caller gave up or it
/// failed (the in-process grant goes only after that).
#[allow(clippy::too_many_arguments)]
async fn remote(
    inner: Arc<Inner>,
    stem: String,
    mode: Mode,
    own_lease: Option<Duration>,
    deadline: Option<Instant>,
    wait: bool,
    started: Instant,
    local: OwnedGuard<String>,
    mut tx: tokio::sync::oneshot::Sender<Outcome>,
) {
    // A session (a new one if the last was lost), within the caller's
    // deadline and abandoned if the caller gives up. Without a deadline
    // (a plain lock, a try_lock), within the session TTL (or the request
    // timeout, if longer): a cluster that cannot grant a lease by then is
    // unavailable, and the caller is told so rather than kept waiting.
    let session = async {
        match deadline {
            Some(d) => tokio::time::timeout_at(d.into(), inner.session(d))
                .await
                .unwrap_or_else(|_| {
                    Err(ClusterLockError::Timeout {
                        waited: now().saturating_duration_since(started),
                        holder: None,
                        ahead: 0,
                        key: key::name(&stem),
                    })
                }),
            None => {
                let bound = started + inner.session_ttl.max(inner.request_timeout);
                inner.session(bound).await
            }
        }
    };
    let session = tokio::select! {
        biased;
        () = tx.closed() => return,
        s = session => s,
    };
    let session = match session {
        Ok(s) => s,
        Err(err) => {
            drop(local);
            let _ = tx.send(Err(err));
            return;
        }
    };
    let undo = Undo::default();
    let outcome = tokio::select! {
        biased;
        () = tx.closed() => None,
        r = recipe::acquire(&inner, &session, &stem, mode, own_lease, deadline, wait, started, &undo) => Some(r),
    };
    match outcome {
        Some(Ok(grant)) => {
            if let Err(Ok((grant, local))) = tx.send(Ok((grant, local))) {
                // The caller gave up just as the key came: let it go.
                let _ = recipe::release(&inner, &grant).await;
                drop(local);
            }
        }
        Some(Err(err)) => {
            undo.run(&inner, Some(&session)).await;
            drop(local);
            let _ = tx.send(Err(err));
        }
        None => {
            undo.run(&inner, Some(&session)).await;
            drop(local);
        }
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The future of [`ClusterLockTable::lock`], [`lock_with`](ClusterLockTable::lock_with),
/// [`try_lock`](ClusterLockTable::try_lock) and
/// [`try_lock_with`](ClusterLockTable::try_lock_with).
///
/// # Cancel safety
///
/// Cancel-safe: dropped while queued in the process, it leaves the queue;
/// dropped later, its etcd task deletes the waiter key it wrote (or
/// releases the key, if it had just been granted) and only then lets the
/// next caller of the process in. It never leaves a key held.
#[must_use = "futures do nothing unless polled"]
pub struct ClusterLock<'a, K> {
    inner: BoxFuture<'a, Result<ClusterGuard<'a, K>, ClusterLockError>>,
}

impl<K> std::fmt::Debug for ClusterLock<'_, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterLock").finish_non_exhaustive()
    }
}

impl<'a, K> Future for ClusterLock<'a, K> {
    type Output = Result<ClusterGuard<'a, K>, ClusterLockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// The future of [`ClusterLockTable::lock_owned`],
/// [`lock_owned_with`](ClusterLockTable::lock_owned_with) and
/// [`try_lock_owned`](ClusterLockTable::try_lock_owned).
///
/// # Cancel safety
///
/// Cancel-safe, as [`ClusterLock`].
#[must_use = "futures do nothing unless polled"]
pub struct OwnedClusterLock<K> {
    inner: BoxFuture<'static, Result<OwnedClusterGuard<K>, ClusterLockError>>,
}

impl<K> std::fmt::Debug for OwnedClusterLock<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedClusterLock").finish_non_exhaustive()
    }
}

impl<K> Future for OwnedClusterLock<K> {
    type Output = Result<OwnedClusterGuard<K>, ClusterLockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<K: AsRef<[u8]> + Send> ClusterLockTable<K> {
    /// Waits until no other process of the cluster (and no other caller of
    /// this table) holds `key`, and takes it.
    ///
    /// Callers of this table queue in the process first, in arrival order;
    /// the first of them enqueues a waiter key in etcd, in create-revision
    /// order with every other process's, and is woken by a watch when its
    /// predecessor's key is deleted.
    ///
    /// # Errors
    ///
    /// [`ClusterLockError::SessionLost`] if the session's lease ended
    /// while waiting; [`ClusterLockError::Unavailable`] if etcd did not
    /// answer within the session TTL (or the request timeout, if longer);
    /// [`ClusterLockError::Etcd`] if etcd refused a call for good. Nothing
    /// is held after an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
    /// let guard = table.lock("config.toml").await?;
    /// assert_eq!(*guard.key(), "config.toml");
    /// # Ok(()) }
    /// ```
    pub fn lock<'a>(&'a self, key: K) -> ClusterLock<'a, K>
    where
        K: 'a,
    {
        self.lock_with(key, LockOptions::new())
    }

    /// Like [`lock`](Self::lock), with a lease, a timeout and/or a deadline
    /// ([`LockOptions`]). A lease gives the grant an etcd lease of its own
    /// (whole seconds, rounded up), not kept alive: at its end etcd deletes
    /// the waiter key and the next waiter takes the key, unless
    /// [`renew`](ClusterGuard::renew)ed. The timeout and deadline bound the
    /// whole wait, in the process and in etcd. Shared mode
    /// ([`LockOptions::shared`]) takes the key as a reader: readers hold it
    /// together, a writer alone, FIFO across modes (a waiting writer
    /// blocks the readers behind it).
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock); [`ClusterLockError::Timeout`] naming the
    /// holder (its lease id, token and how long it has held the key) when
    /// the wait runs out; [`ClusterLockError::InvalidOptions`] for a lease
    /// of zero or over an hour.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::time::Duration;
    /// use keylock::{etcd::{ClusterLockError, ClusterLockTable}, LockOptions};
    /// let table = ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
    /// let wait = LockOptions::new().timeout(Duration::from_secs(2));
    /// match table.lock_with("job", wait).await {
    ///     Ok(guard) => { /* ... */ drop(guard) }
    ///     Err(ClusterLockError::Timeout { holder: Some(h), .. }) => {
    ///         eprintln!("lease {:x} has held it for {:?}", h.lease_id, h.held_for)
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn lock_with<'a>(&'a self, key: K, opts: LockOptions) -> ClusterLock<'a, K>
    where
        K: 'a,
    {
        let inner = Arc::clone(&self.inner);
        ClusterLock {
            inner: Box::pin(
                async move { acquire(inner, key, opts, true).await.map(ClusterGuard::new) },
            ),
        }
    }

    /// Like [`lock`](Self::lock), for a table behind an [`Arc`]: the guard
    /// is `'static`.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`OwnedClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?);
    /// let guard = table.clone().lock_owned("job").await?;
    /// tokio::spawn(async move { drop(guard) });
    /// # Ok(()) }
    /// ```
    pub fn lock_owned(self: Arc<Self>, key: K) -> OwnedClusterLock<K>
    where
        K: 'static,
    {
        self.lock_owned_with(key, LockOptions::new())
    }

    /// Like [`lock_with`](Self::lock_with), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`lock_with`](Self::lock_with).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`OwnedClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::{sync::Arc, time::Duration};
    /// let table = Arc::new(keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?);
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(5));
    /// let guard = table.clone().lock_owned_with("job", opts).await?;
    /// assert!(guard.lease_id() != table.lease_id(), "a lease of its own");
    /// # Ok(()) }
    /// ```
    pub fn lock_owned_with(self: Arc<Self>, key: K, opts: LockOptions) -> OwnedClusterLock<K>
    where
        K: 'static,
    {
        let inner = Arc::clone(&self.inner);
        OwnedClusterLock {
            inner: Box::pin(async move {
                acquire(inner, key, opts, true)
                    .await
                    .map(|held| OwnedClusterGuard::new(self, held))
            }),
        }
    }

    /// Blocks the calling thread until `key` is taken: [`lock`](Self::lock)
    /// for plain threads. Do not call it on a runtime's worker thread (the
    /// table's etcd calls run on its tokio runtime, which must keep
    /// running).
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?);
    /// let t = table.clone();
    /// std::thread::spawn(move || {
    ///     let guard = t.blocking_lock("nightly").unwrap();
    ///     drop(guard);
    /// })
    /// .join()
    /// .unwrap();
    /// # Ok(()) }
    /// ```
    pub fn blocking_lock(&self, key: K) -> Result<ClusterGuard<'_, K>, ClusterLockError> {
        crate::table::blocking::block_on(self.lock(key))
    }

    /// Takes `key` if nobody holds or waits for it, in this process or in
    /// etcd; never waits for the key (it does wait for etcd's answers: one
    /// enqueue and one read, and a delete when the key is held).
    ///
    /// # Errors
    ///
    /// [`ClusterLockError::WouldBlock`] naming the holder, and as
    /// [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
    /// let guard = table.try_lock("k").await?;
    /// let err = table.try_lock("k").await.unwrap_err();
    /// assert!(matches!(err, keylock::etcd::ClusterLockError::WouldBlock { .. }));
    /// # drop(guard); Ok(()) }
    /// ```
    pub fn try_lock<'a>(&'a self, key: K) -> ClusterLock<'a, K>
    where
        K: 'a,
    {
        self.try_lock_with(key, LockOptions::new())
    }

    /// Like [`try_lock`](Self::try_lock), with a lease; the timeout and
    /// deadline are ignored.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock), and
    /// [`ClusterLockError::InvalidOptions`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::time::Duration;
    /// let table = keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?;
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(10));
    /// let guard = table.try_lock_with("k", opts).await?;
    /// # drop(guard); Ok(()) }
    /// ```
    pub fn try_lock_with<'a>(&'a self, key: K, opts: LockOptions) -> ClusterLock<'a, K>
    where
        K: 'a,
    {
        let inner = Arc::clone(&self.inner);
        ClusterLock {
            inner: Box::pin(async move {
                acquire(inner, key, opts, false)
                    .await
                    .map(ClusterGuard::new)
            }),
        }
    }

    /// Like [`try_lock`](Self::try_lock), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`OwnedClusterLock`].
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), keylock::etcd::ClusterLockError> {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::etcd::ClusterLockTable::connect(["http://127.0.0.1:2379"]).await?);
    /// let guard: keylock::etcd::OwnedClusterGuard<&str> = table.clone().try_lock_owned("k").await?;
    /// # drop(guard); Ok(()) }
    /// ```
    pub fn try_lock_owned(self: Arc<Self>, key: K) -> OwnedClusterLock<K>
    where
        K: 'static,
    {
        let inner = Arc::clone(&self.inner);
        OwnedClusterLock {
            inner: Box::pin(async move {
                acquire(inner, key, LockOptions::new(), false)
                    .await
                    .map(|held| OwnedClusterGuard::new(self, held))
            }),
        }
    }
}
