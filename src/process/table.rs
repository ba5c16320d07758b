//! [`ProcessLockTable`]: the process scope's table, its entry points and
//! its named futures.

use std::future::Future;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::acquire::Grant;
use super::cache::{FileCache, CACHED_KEYS};
use super::dir::DirState;
use super::error::{HeldBy, ProcessLockError};
use super::guard::{Held, OwnedProcessGuard, ProcessGuard};
use super::holder::ProcessHolder;
use super::key;
use super::stamp::MAX_LABEL;
use crate::{LockError, LockOptions, LockTable, Mode, OwnedGuard, DEFAULT_MAX_LEASE};

/// What every guard and future of a table shares.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) dir: PathBuf,
    pub(crate) label: Option<String>,
    /// The in-process queue: one entry per key, so that at most one waiter
    /// of this process at a time goes to the key's files.
    pub(crate) local: Arc<LockTable<String>>,
    /// Waiters of this table at the file level right now.
    pub(crate) file_waiters: AtomicUsize,
    /// The open files of recently used keys (shared with the tables made
    /// from this one by `with_label`).
    pub(crate) cache: Arc<FileCache>,
    /// The directory's `keylock.dir` (shared with the tables made from this
    /// one by `with_label`).
    pub(crate) dir_state: Arc<DirState>,
}

/// A table of keyed locks shared by every process of the host that opens
/// the same directory; see the [module documentation](crate::process).
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-table-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// # futures::executor::block_on(async {
/// let table = keylock::ProcessLockTable::open(&dir)?;
/// let guard = table.lock("invoice-17").await?;
/// // ... no other process (or task of this one) holds "invoice-17" now ...
/// let token = guard.check()?; // fence the write with it
/// drop(guard);
/// assert!(table.lock("invoice-17").await?.token() > token);
/// # Ok::<(), keylock::ProcessLockError>(())
/// # }).unwrap();
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
pub struct ProcessLockTable<K> {
    inner: Arc<Inner>,
    _key: PhantomData<fn(K) -> K>,
}

impl<K> std::fmt::Debug for ProcessLockTable<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessLockTable")
            .field("dir", &self.inner.dir)
            .field("label", &self.inner.label)
            .finish_non_exhaustive()
    }
}

/// Counts of a [`ProcessLockTable`], read cheaply.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-stats-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let table = keylock::ProcessLockTable::<&str>::open(&dir)?;
/// assert_eq!(table.stats().file_waiters, 0);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessStats {
    /// Waiters of this table at the file level now: at most one per key,
    /// since the others queue in the process first.
    pub file_waiters: usize,
    /// Threads of this process (all tables) blocked in the kernel on a
    /// key's file now: helper threads, and callers of
    /// [`blocking_lock`](ProcessLockTable::blocking_lock) waiting without a
    /// deadline.
    pub kernel_waits: usize,
    /// Keys whose files this table keeps open between uses now (at most
    /// [`MAX_CACHED_KEYS`](Self::MAX_CACHED_KEYS); a key held is not
    /// counted: its guard has its files).
    pub cached_keys: usize,
}

/// One line: each gauge by name.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-pstats-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let table = keylock::ProcessLockTable::<&str>::open(&dir)?;
/// let line = table.stats().to_string();
/// assert!(line.starts_with("0 file waiters, 0 kernel waits"), "{line}");
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
impl std::fmt::Display for ProcessStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} file waiters, {} kernel waits, {} cached keys",
            self.file_waiters, self.kernel_waits, self.cached_keys
        )
    }
}

impl ProcessStats {
    /// The most keys whose files a table keeps open between uses (two
    /// descriptors each at most): taking a key whose files are open costs
    /// no `open`; one more key closes the least recently used key's files.
    pub const MAX_CACHED_KEYS: usize = CACHED_KEYS;
}

impl<K: AsRef<[u8]>> ProcessLockTable<K> {
    /// Opens the table kept in `dir`, which must exist and be writable, on a
    /// file system with open file description locks (local ext4, xfs,
    /// btrfs, tmpfs: yes; see the
    /// [module documentation](crate::process#file-systems)). Checks both
    /// now, by trying a kernel lock on `dir/keylock.dir`; it never waits
    /// for one (a lock another program holds on that file proves the file
    /// system's locks as well).
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Io`] naming `dir` (or its `keylock.dir`) when it
    /// is missing, not a directory, unwritable, or refuses locks.
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-open-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::<String>::open(&dir)?;
    /// assert_eq!(table.dir(), dir.as_path());
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, ProcessLockError> {
        let dir = dir.as_ref().to_path_buf();
        let meta = std::fs::metadata(&dir)
            .map_err(|e| ProcessLockError::io("open the lock directory", &dir, e))?;
        if !meta.is_dir() {
            return Err(ProcessLockError::io(
                "open the lock directory",
                &dir,
                std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            ));
        }
        let dir_state = Arc::new(DirState::open(&dir)?);
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                label: None,
                local: Arc::new(LockTable::new()),
                file_waiters: AtomicUsize::new(0),
                cache: Arc::new(FileCache::new(Arc::clone(&dir_state))),
                dir_state,
            }),
            _key: PhantomData,
        })
    }

    /// Names this table's grants in their owner stamps (a service, a job,
    /// a worker), for [`holder`](Self::holder) and timeout messages. At most
    /// [`MAX_LABEL`] bytes are kept, cut at a character boundary. Call it
    /// before the first lock (a label set later starts a new in-process
    /// queue).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-label-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::<&str>::open(&dir)?.with_label("cron: nightly");
    /// assert_eq!(table.label(), Some("cron: nightly"));
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    #[must_use]
    pub fn with_label(self, label: impl Into<String>) -> Self {
        let mut label = label.into();
        let mut len = label.len().min(MAX_LABEL);
        while !label.is_char_boundary(len) {
            len -= 1;
        }
        label.truncate(len);
        Self {
            inner: Arc::new(Inner {
                dir: self.inner.dir.clone(),
                label: Some(label),
                local: Arc::clone(&self.inner.local),
                file_waiters: AtomicUsize::new(0),
                cache: Arc::clone(&self.inner.cache),
                dir_state: Arc::clone(&self.inner.dir_state),
            }),
            _key: PhantomData,
        }
    }
}

impl<K> ProcessLockTable<K> {
    /// The directory the table keeps its files in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The label of this table's grants, if set.
    pub fn label(&self) -> Option<&str> {
        self.inner.label.as_deref()
    }

    /// Counts of this table (this process only).
    pub fn stats(&self) -> ProcessStats {
        ProcessStats {
            file_waiters: self.inner.file_waiters.load(Ordering::Relaxed),
            kernel_waits: super::helper::blocked(),
            cached_keys: self.inner.cache.len(),
        }
    }

    /// How many callers of this process wait for `key` in the process's
    /// queue (behind the one at the file level, if any); 0 for a key that
    /// cannot be encoded.
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-waiters-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::<&str>::open(&dir)?;
    /// assert_eq!(table.waiters(&"k"), 0);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn waiters<Q: AsRef<[u8]> + ?Sized>(&self, key: &Q) -> usize {
        key::encode(key.as_ref()).map_or(0, |stem| self.inner.local.waiters(&stem))
    }

    /// Reclaims the files of idle keys: this table's cached keys, then
    /// every key file of the directory that no table of any process uses
    /// (holds, waits for, or caches), such as those left by processes that
    /// died. Returns how many key files were removed.
    ///
    /// A table already reclaims the files of the keys it stops caching
    /// (beyond [`ProcessStats::MAX_CACHED_KEYS`]) and, when it goes away,
    /// of the keys it caches; `prune` is for the rest, and for a directory
    /// that must be small now. A key reclaimed keeps its fencing tokens
    /// increasing: its next file starts above its last token (see the
    /// [module documentation](crate::process#files)). Keys in use, and
    /// files that are not whole key files, are left alone. It never waits
    /// for a lock; it reads the directory, and opens and maps each key
    /// file, so its cost grows with the directory.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Io`] naming the directory if it cannot be read.
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-prune-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let first = table.try_lock("job-17")?.token();
    /// let held = table.try_lock("job-18")?;
    /// assert_eq!(table.prune()?, 1); // job-17's file; job-18 is held
    /// assert!(table.try_lock("job-17")?.token() > first);
    /// # drop(held);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn prune(&self) -> Result<usize, ProcessLockError> {
        self.inner.prune()
    }
}

/// The deadline of a call: the earlier of its timeout and its deadline.
fn deadline_of(opts: &LockOptions, now: Instant) -> Option<Instant> {
    let by_timeout = opts.timeout_duration().map(|t| now.checked_add(t));
    match (by_timeout, opts.deadline_instant()) {
        // A timeout too long to represent: for ever, unless a deadline.
        (Some(None), d) | (None, d) => d,
        (Some(Some(t)), Some(d)) => Some(t.min(d)),
        (Some(Some(t)), None) => Some(t),
    }
}

fn check_options(opts: &LockOptions) -> Result<Option<Duration>, ProcessLockError> {
    if opts.lock_mode() != Mode::Exclusive {
        return Err(ProcessLockError::InvalidOptions {
            option: "mode",
            reason: "the process scope takes keys exclusively only".into(),
        });
    }
    if let Some(label) = opts.label_name() {
        return Err(ProcessLockError::InvalidOptions {
            option: "label",
            reason: format!(
                "{label:?}: the process scope labels a table's grants, not one lock's; use \
                 `ProcessLockTable::with_label`"
            ),
        });
    }
    match opts.lease_duration() {
        Some(lease) if lease.is_zero() || lease > DEFAULT_MAX_LEASE => {
            Err(ProcessLockError::InvalidOptions {
                option: "lease",
                reason: format!("{lease:?} is not between 1ns and {DEFAULT_MAX_LEASE:?}"),
            })
        }
        lease => Ok(lease),
    }
}

/// The in-process half of a lock: the local grant of the key's stem.
async fn local_lock(
    inner: &Inner,
    stem: &str,
    lease: Option<Duration>,
    deadline: Option<Instant>,
    started: Instant,
) -> Result<OwnedGuard<String>, ProcessLockError> {
    let mut opts = LockOptions::new();
    if let Some(lease) = lease {
        opts = opts.lease(lease);
    }
    if let Some(deadline) = deadline {
        opts = opts.deadline(deadline);
    }
    match Arc::clone(&inner.local)
        .lock_owned_with(stem.to_owned(), opts)
        .await
    {
        Ok(guard) => Ok(guard),
        Err(LockError::Timeout { .. }) => Err(inner.timeout(stem, started, HeldBy::ThisProcess)),
        Err(other) => Err(ProcessLockError::InvalidOptions {
            option: "options",
            reason: other.to_string(),
        }),
    }
}

/// The whole acquisition: in-process queue, then the key's files.
async fn acquire<K: AsRef<[u8]>>(
    inner: Arc<Inner>,
    key: K,
    opts: LockOptions,
    on_this_thread: bool,
) -> Result<Held<K>, ProcessLockError> {
    let started = Instant::now();
    let lease = check_options(&opts)?;
    let stem = key::encode(key.as_ref())?;
    let deadline = deadline_of(&opts, started);
    let local = local_lock(&inner, &stem, lease, deadline, started).await?;
    let grant = inner
        .acquire(&stem, lease, deadline, started, on_this_thread)
        .await?;
    if let Some(lease) = lease {
        // The local lease runs from the file grant too (a hint only: the
        // file's stamp is the authority).
        let _ = local.renew(lease);
    }
    Ok(Held::new(inner, key, grant, local))
}

fn try_acquire<K: AsRef<[u8]>>(
    inner: &Arc<Inner>,
    key: K,
    opts: &LockOptions,
) -> Result<Held<K>, ProcessLockError> {
    let lease = check_options(opts)?;
    let stem = key::encode(key.as_ref())?;
    let local = match Arc::clone(&inner.local).try_lock_owned(stem.clone()) {
        Ok(local) => local,
        Err(_) => {
            // Another caller of this process has the key or is ahead; the
            // file says who holds it.
            let (holder, by) = inner.blocker(&stem, HeldBy::ThisProcess);
            return Err(ProcessLockError::WouldBlock {
                holder,
                by,
                key: key::name(&stem),
            });
        }
    };
    match inner.try_grant(&stem, lease)? {
        Ok(grant) => Ok(held(inner, key, grant, local, lease)),
        Err(no_grant) => {
            drop(local);
            let (holder, by) = inner.who_holds(&stem, no_grant)?;
            Err(ProcessLockError::WouldBlock {
                holder: holder.map(Box::new),
                by,
                key: key::name(&stem),
            })
        }
    }
}

/// A guard's state for `grant`, whose local lease runs from now too (a
/// hint only: the file's stamp is the authority).
fn held<K>(
    inner: &Arc<Inner>,
    key: K,
    grant: Grant,
    local: OwnedGuard<String>,
    lease: Option<Duration>,
) -> Held<K> {
    if let Some(lease) = lease {
        let _ = local.renew(lease);
    }
    Held::new(Arc::clone(inner), key, grant, local)
}

/// The first step of a blocking lock, and the first poll of a lock future:
/// takes the key if it is free now (no
/// waiter of this process ahead, no live holder), without the future and
/// the diagnosis of a failed `try_lock`. Gives the key back if not.
fn try_first<K: AsRef<[u8]>>(
    inner: &Arc<Inner>,
    key: K,
    opts: &LockOptions,
) -> Result<Result<Held<K>, K>, ProcessLockError> {
    let lease = check_options(opts)?;
    let Ok(stem) = key::encode(key.as_ref()) else {
        return Ok(Err(key)); // the full path reports it
    };
    let Ok(local) = Arc::clone(&inner.local).try_lock_owned(stem.clone()) else {
        return Ok(Err(key));
    };
    Ok(match inner.try_grant(&stem, lease)? {
        Ok(grant) => Ok(held(inner, key, grant, local, lease)),
        Err(_) => Err(key),
    })
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The future of [`ProcessLockTable::lock`] and
/// [`ProcessLockTable::lock_with`].
///
/// # Cancel safety
///
/// Cancel-safe: dropped while queued in the process, it leaves the queue;
/// dropped while waiting on the key's files, it abandons its kernel wait (a
/// helper thread still blocked in the kernel frees the lock the moment it
/// gets it) and holds nothing; it never leaves a key held.
#[must_use = "futures do nothing unless polled"]
pub struct ProcessLock<'a, K> {
    /// Until the first poll: what it tries at once, without a future.
    first: Option<(Arc<Inner>, K, LockOptions)>,
    /// The whole acquisition, made only if the first try did not take it.
    rest: Option<BoxFuture<'a, Result<ProcessGuard<'a, K>, ProcessLockError>>>,
}

// Nothing is pinned structurally: `K` and the options are moved out by
// value on the first poll, and the rest is boxed.
impl<K> Unpin for ProcessLock<'_, K> {}

impl<K> std::fmt::Debug for ProcessLock<'_, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessLock").finish_non_exhaustive()
    }
}

impl<'a, K: AsRef<[u8]> + Send + 'a> Future for ProcessLock<'a, K> {
    type Output = Result<ProcessGuard<'a, K>, ProcessLockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some((inner, key, opts)) = this.first.take() {
            // As `blocking_lock`: a free key is taken here, with no boxed
            // future, no in-process wait and no clock read.
            match try_first(&inner, key, &opts) {
                Err(err) => return Poll::Ready(Err(err)),
                Ok(Ok(held)) => return Poll::Ready(Ok(ProcessGuard::new(held))),
                Ok(Err(key)) => {
                    this.rest = Some(Box::pin(async move {
                        acquire(inner, key, opts, false)
                            .await
                            .map(ProcessGuard::new)
                    }));
                }
            }
        }
        this.rest
            .as_mut()
            .expect("`ProcessLock` polled after completion")
            .as_mut()
            .poll(cx)
    }
}

/// The future of [`ProcessLockTable::lock_owned`] and
/// [`ProcessLockTable::lock_owned_with`].
///
/// # Cancel safety
///
/// Cancel-safe, as [`ProcessLock`].
#[must_use = "futures do nothing unless polled"]
pub struct OwnedProcessLock<K> {
    /// Until the first poll: what it tries at once, without a future.
    first: Option<(Arc<ProcessLockTable<K>>, K, LockOptions)>,
    /// The whole acquisition, made only if the first try did not take it.
    rest: Option<BoxFuture<'static, Result<OwnedProcessGuard<K>, ProcessLockError>>>,
}

// As `ProcessLock`: nothing is pinned structurally.
impl<K> Unpin for OwnedProcessLock<K> {}

impl<K> std::fmt::Debug for OwnedProcessLock<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedProcessLock").finish_non_exhaustive()
    }
}

impl<K: AsRef<[u8]> + Send + 'static> Future for OwnedProcessLock<K> {
    type Output = Result<OwnedProcessGuard<K>, ProcessLockError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some((table, key, opts)) = this.first.take() {
            match try_first(&table.inner, key, &opts) {
                Err(err) => return Poll::Ready(Err(err)),
                Ok(Ok(held)) => return Poll::Ready(Ok(OwnedProcessGuard::new(table, held))),
                Ok(Err(key)) => {
                    let inner = Arc::clone(&table.inner);
                    this.rest = Some(Box::pin(async move {
                        acquire(inner, key, opts, false)
                            .await
                            .map(|held| OwnedProcessGuard::new(table, held))
                    }));
                }
            }
        }
        this.rest
            .as_mut()
            .expect("`OwnedProcessLock` polled after completion")
            .as_mut()
            .poll(cx)
    }
}

impl<K: AsRef<[u8]> + Send> ProcessLockTable<K> {
    /// Waits until no other process (and no other task of this one) holds
    /// `key`, and takes it.
    ///
    /// Waiters of this process queue in the process first, in arrival
    /// order; the first of them waits on the key's files, woken by the
    /// kernel when the holder releases the key or dies.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Key`] for a key that cannot be encoded,
    /// [`ProcessLockError::Io`] naming the file when the file system fails
    /// (full disk, permissions), [`ProcessLockError::Corrupt`] for a state
    /// file that is not one of ours, [`ProcessLockError::Damaged`] for one
    /// truncated from outside while this table kept it open. Nothing is
    /// held after an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ProcessLock`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-lock-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// # futures::executor::block_on(async {
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let guard = table.lock("config.toml").await?;
    /// assert_eq!(*guard.key(), "config.toml");
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// # }).unwrap();
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    pub fn lock<'a>(&'a self, key: K) -> ProcessLock<'a, K>
    where
        K: 'a,
    {
        self.lock_with(key, LockOptions::new())
    }

    /// Like [`lock`](Self::lock), with a lease (the grant's authority ends
    /// at its deadline, and a waiter of any process then takes the key
    /// over), a timeout and/or a deadline (bounding the whole wait, in the
    /// process and on the files). Shared mode is not supported.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock); [`ProcessLockError::Timeout`] naming the
    /// holder (and whether it is this process, another, or a kernel lock
    /// without a grant: [`HeldBy`](super::HeldBy)) when the wait runs out; [`ProcessLockError::InvalidOptions`]
    /// for a lease of zero or over an hour, or shared mode.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe; see [`ProcessLock`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-lockwith-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockOptions, ProcessLockError, ProcessLockTable};
    /// let table = ProcessLockTable::open(&dir)?;
    /// let held = table.lock_with("job", LockOptions::new().lease(Duration::from_secs(30))).await?;
    /// let wait = LockOptions::new().timeout(Duration::from_millis(20));
    /// let err = table.lock_with("job", wait).await.unwrap_err();
    /// assert!(matches!(err, ProcessLockError::Timeout { .. }));
    /// assert!(err.to_string().contains(&format!("pid {}", std::process::id())));
    /// # drop(held);
    /// # Ok::<(), ProcessLockError>(())
    /// # }).unwrap();
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    pub fn lock_with<'a>(&'a self, key: K, opts: LockOptions) -> ProcessLock<'a, K>
    where
        K: 'a,
    {
        ProcessLock {
            first: Some((Arc::clone(&self.inner), key, opts)),
            rest: None,
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
    /// Cancel-safe; see [`OwnedProcessLock`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-owned-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// # futures::executor::block_on(async {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::ProcessLockTable::open(&dir)?);
    /// let guard = table.clone().lock_owned("job").await?;
    /// std::thread::spawn(move || drop(guard)).join().unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// # }).unwrap();
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    pub fn lock_owned(self: Arc<Self>, key: K) -> OwnedProcessLock<K>
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
    /// Cancel-safe; see [`OwnedProcessLock`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-ownedw-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// # futures::executor::block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// let table = Arc::new(keylock::ProcessLockTable::open(&dir)?);
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(5));
    /// let guard = table.clone().lock_owned_with("job", opts).await?;
    /// assert!(guard.expires_at()?.is_some());
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// # }).unwrap();
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// ```
    pub fn lock_owned_with(self: Arc<Self>, key: K, opts: LockOptions) -> OwnedProcessLock<K>
    where
        K: 'static,
    {
        OwnedProcessLock {
            first: Some((self, key, opts)),
            rest: None,
        }
    }

    /// Blocks the calling thread until `key` is taken; [`lock`](Self::lock)
    /// for plain threads. Without a deadline, and while the holder has no
    /// lease, the thread itself waits in the kernel for the key's lock;
    /// otherwise it parks and a helper thread waits in the kernel. Do not
    /// call it on an async runtime's worker thread.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-blocking-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let guard = table.blocking_lock("nightly")?;
    /// assert!(table.try_lock("nightly").is_err());
    /// # drop(guard);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn blocking_lock(&self, key: K) -> Result<ProcessGuard<'_, K>, ProcessLockError> {
        self.blocking_lock_with(key, LockOptions::new())
    }

    /// Like [`blocking_lock`](Self::blocking_lock), with options as
    /// [`lock_with`](Self::lock_with).
    ///
    /// # Errors
    ///
    /// As [`lock_with`](Self::lock_with).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-blockingw-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// use std::time::Duration;
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let _held = table.try_lock("k")?;
    /// let opts = keylock::LockOptions::new().timeout(Duration::ZERO);
    /// assert!(table.blocking_lock_with("k", opts).is_err());
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn blocking_lock_with(
        &self,
        key: K,
        opts: LockOptions,
    ) -> Result<ProcessGuard<'_, K>, ProcessLockError> {
        // The calling thread may block in the kernel itself (no helper
        // thread, one wake-up less per handoff) when nothing but the
        // kernel can end the wait: no deadline, a holder without a lease.
        let key = match try_first(&self.inner, key, &opts)? {
            Ok(held) => return Ok(ProcessGuard::new(held)),
            Err(key) => key,
        };
        let inner = Arc::clone(&self.inner);
        crate::table::blocking::block_on(async move {
            acquire(inner, key, opts, true).await.map(ProcessGuard::new)
        })
    }

    /// Takes `key` now if no live holder has it: a holder that died is taken
    /// over at once, as is one whose lease lapsed; a live holder (or a
    /// waiter of this process ahead) answers [`ProcessLockError::WouldBlock`]
    /// naming it, and saying whose it is ([`HeldBy`](super::HeldBy)).
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::WouldBlock`], and as [`lock`](Self::lock).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-try-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let guard = table.try_lock("k")?;
    /// let err = table.try_lock("k").unwrap_err();
    /// assert!(matches!(err, keylock::ProcessLockError::WouldBlock { .. }));
    /// # drop(guard);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn try_lock(&self, key: K) -> Result<ProcessGuard<'_, K>, ProcessLockError> {
        self.try_lock_with(key, LockOptions::new())
    }

    /// Like [`try_lock`](Self::try_lock), with a lease; the timeout and
    /// deadline are ignored.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock), and
    /// [`ProcessLockError::InvalidOptions`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-trywith-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// use std::time::Duration;
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(10));
    /// let guard = table.try_lock_with("k", opts)?;
    /// assert!(guard.expires_at()?.is_some());
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn try_lock_with(
        &self,
        key: K,
        opts: LockOptions,
    ) -> Result<ProcessGuard<'_, K>, ProcessLockError> {
        try_acquire(&self.inner, key, &opts).map(ProcessGuard::new)
    }

    /// Like [`try_lock`](Self::try_lock), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock).
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-tryowned-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::ProcessLockTable::open(&dir)?);
    /// let guard: keylock::OwnedProcessGuard<&str> = table.clone().try_lock_owned("k")?;
    /// # drop(guard);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn try_lock_owned(
        self: Arc<Self>,
        key: K,
    ) -> Result<OwnedProcessGuard<K>, ProcessLockError> {
        let held = try_acquire(&self.inner, key, &LockOptions::new())?;
        Ok(OwnedProcessGuard::new(self, held))
    }
}

impl<K> ProcessLockTable<K> {
    /// Who holds `key` now, as its owner stamp says, with the kernel's word
    /// on whether it is alive; `None` if nobody holds it (or it was never
    /// locked). Works from any process, whether or not it opened the table
    /// with the same label or key type.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Key`], [`ProcessLockError::Io`],
    /// [`ProcessLockError::Corrupt`].
    ///
    /// ```
    /// # let dir = std::env::temp_dir().join(format!("keylock-doc-holderof-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let table = keylock::ProcessLockTable::open(&dir)?;
    /// assert!(table.holder(&"k")?.is_none());
    /// let guard = table.try_lock("k")?;
    /// assert_eq!(table.holder(&"k")?.unwrap().token, guard.token());
    /// # drop(guard);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), keylock::ProcessLockError>(())
    /// ```
    pub fn holder<Q: AsRef<[u8]> + ?Sized>(
        &self,
        key: &Q,
    ) -> Result<Option<ProcessHolder>, ProcessLockError> {
        let stem = key::encode(key.as_ref())?;
        self.inner.holder_of(&stem)
    }
}
