//! The guards of the process scope: a key held across processes, released
//! on drop.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
use std::time::{Duration, Instant};

use super::acquire::{instant_of_monotonic, Grant, KeyFiles, Named, On};
use super::error::ProcessLockError;
use super::lost::{ProcessKeepAlive, ProcessLost};
use super::stamp::{Word, NO_LEASE, TAKEN};
use super::table::{Inner, ProcessLockTable};
use super::unix;
use crate::{FencingToken, OwnedGuard, DEFAULT_MAX_LEASE};

/// What a guard holds: the key's file (holding the slot's lock), its token,
/// and the in-process grant that keeps the process's other waiters queued.
#[derive(Debug)]
pub(crate) struct Held<K> {
    key: K,
    token: FencingToken,
    /// The key's files, behind a lock: a kernel lock belongs to an open
    /// file, so two threads using one guard must not interleave on it.
    /// `None` once released.
    files: Mutex<Option<KeyFiles>>,
    /// The slot held, and which open file of `files` holds it.
    slot: u32,
    on: On,
    /// Released after the files, so that the next waiter of this process
    /// finds the key's files free.
    local: Option<OwnedGuard<String>>,
    inner: Arc<Inner>,
    /// The wakers of this grant's [`ProcessLost`](super::ProcessLost)
    /// futures, woken by every renewal (a lease moved earlier must re-arm
    /// their timers). A slot per registered future, `None` when free.
    watchers: Mutex<Vec<Watcher>>,
}

/// A loss watcher's slot: taken while its future lives; its waker until
/// woken.
#[derive(Debug, Default)]
struct Watcher {
    used: bool,
    waker: Option<Waker>,
}

/// How a grant stands, read from the shared state.
enum Standing {
    /// The word names this grant and its lease word (the value given) has
    /// not lapsed.
    Live(u64),
    /// The word names this grant, past its lease; nobody took the key yet.
    Lapsed(u64),
    /// The word names another grant, or a taker marked the lease taken:
    /// the key was (or is being) taken over.
    Lost,
    /// The key's path no longer names the grant's file (it was removed or
    /// replaced, or its directory was): another table may lock the file
    /// it names now.
    Replaced,
}

/// How the grant of `token` on `slot` stands now: first whether the key's
/// path still names its file, whole (a `stat`), and only then the file's
/// memory.
///
/// # Errors
///
/// [`ProcessLockError::Damaged`] if the file was shortened from outside.
fn standing(
    files: &KeyFiles,
    token: FencingToken,
    slot: u32,
) -> Result<Standing, ProcessLockError> {
    if files.named()? == Named::Other {
        return Ok(Standing::Replaced);
    }
    let map = &files.map;
    if map.load()
        != (Word {
            token: token.get(),
            slot,
        })
    {
        return Ok(Standing::Lost);
    }
    // Our own slot's stamp: only we write it, but a taker may mark its
    // lease word taken.
    let lease = map.lease(slot).load(Ordering::SeqCst);
    Ok(if lease == TAKEN {
        Standing::Lost
    } else if unix::monotonic_ns() >= lease {
        Standing::Lapsed(lease)
    } else {
        Standing::Live(lease)
    })
}

impl<K> Held<K> {
    pub(crate) fn new(inner: Arc<Inner>, key: K, grant: Grant, local: OwnedGuard<String>) -> Self {
        Self {
            key,
            token: FencingToken::new(grant.token).expect("tokens start at 1"),
            files: Mutex::new(Some(grant.files)),
            slot: grant.slot,
            on: grant.on,
            local: Some(local),
            inner,
            watchers: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn token(&self) -> FencingToken {
        self.token
    }

    fn watchers(&self) -> MutexGuard<'_, Vec<Watcher>> {
        self.watchers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers (or refreshes) the waker of a loss watcher in `slot`.
    /// The waker is cloned before the lock is taken and the one it
    /// replaces dropped after: user code never runs under the lock.
    pub(crate) fn watch(&self, slot: &mut Option<usize>, waker: &Waker) {
        let fresh = Some(waker.clone());
        let old = {
            let mut w = self.watchers();
            let i = match *slot {
                Some(i) => i,
                None => {
                    let i = w.iter().position(|x| !x.used).unwrap_or_else(|| {
                        w.push(Watcher::default());
                        w.len() - 1
                    });
                    w[i].used = true;
                    *slot = Some(i);
                    i
                }
            };
            std::mem::replace(&mut w[i].waker, fresh)
        };
        drop(old);
    }

    /// Frees a loss watcher's slot.
    pub(crate) fn unwatch(&self, slot: usize) {
        let old = self.watchers().get_mut(slot).and_then(|x| {
            x.used = false;
            x.waker.take()
        });
        drop(old);
    }

    /// Wakes every loss watcher (after a renewal): the wakers are taken
    /// out under the lock and woken after it, every one of them even if
    /// one panics (the first panic is then resumed).
    fn wake_watchers(&self) {
        let wakers: Vec<Waker> = self
            .watchers()
            .iter_mut()
            .filter_map(|x| x.waker.take())
            .collect();
        if wakers.is_empty() {
            return;
        }
        let mut panic = None;
        for w in wakers {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake())) {
                panic.get_or_insert(p);
            }
        }
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
    }

    /// How the grant stands now, as `check()` judges it: `Ok(lease)` with
    /// the lease deadline on the host's monotonic clock (`NO_LEASE` for
    /// none) while it holds the key.
    pub(crate) fn judge(&self) -> Result<u64, ProcessLockError> {
        let token = self.token;
        let mut files = self.files();
        let Some(files) = files.as_mut() else {
            return Err(self.expired());
        };
        match standing(files, token, self.slot) {
            Ok(Standing::Live(lease)) => Ok(lease),
            Ok(Standing::Replaced) => {
                // Not to be used again by this process.
                files.stale = true;
                Err(self.expired())
            }
            Ok(Standing::Lapsed(_) | Standing::Lost) => Err(self.expired()),
            Err(err) => {
                if matches!(err, ProcessLockError::Damaged { .. }) {
                    files.stale = true;
                }
                Err(err)
            }
        }
    }

    /// This grant's loss, as an error naming its key.
    fn expired(&self) -> ProcessLockError {
        ProcessLockError::Expired {
            token: self.token,
            key: self.local.as_ref().map_or_else(
                || "(released)".into(),
                |local| super::key::name(local.key()),
            ),
        }
    }

    fn files(&self) -> MutexGuard<'_, Option<KeyFiles>> {
        self.files.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the key's files and how the grant stands.
    fn with_standing<R>(
        &self,
        f: impl FnOnce(&KeyFiles, Standing) -> Result<R, ProcessLockError>,
    ) -> Result<R, ProcessLockError> {
        let files = self.files();
        match files.as_ref() {
            Some(files) => f(files, standing(files, self.token, self.slot)?),
            None => Err(self.expired()),
        }
    }

    fn check(&self) -> Result<FencingToken, ProcessLockError> {
        self.judge().map(|_| self.token)
    }

    fn expires_at(&self) -> Result<Option<Instant>, ProcessLockError> {
        self.with_standing(|_, standing| match standing {
            Standing::Live(lease) | Standing::Lapsed(lease) => {
                Ok((lease != NO_LEASE).then(|| instant_of_monotonic(lease)))
            }
            Standing::Lost | Standing::Replaced => Err(self.expired()),
        })
    }

    pub(crate) fn renew(&self, lease: Duration) -> Result<(), ProcessLockError> {
        let renewed = self.renew_lease(lease);
        // A lease moved (earlier or later): watchers re-arm their timers.
        // A failed renewal changed nothing, but may have found the grant
        // lost: they look again too.
        self.wake_watchers();
        renewed
    }

    fn renew_lease(&self, lease: Duration) -> Result<(), ProcessLockError> {
        if lease.is_zero() || lease > DEFAULT_MAX_LEASE {
            return Err(ProcessLockError::InvalidOptions {
                option: "lease",
                reason: format!("{lease:?} is not between 1ns and {DEFAULT_MAX_LEASE:?}"),
            });
        }
        let slot = self.slot;
        self.with_standing(|files, standing| {
            let Standing::Live(mut seen) = standing else {
                return Err(self.expired());
            };
            let nanos = u64::try_from(lease.as_nanos()).unwrap_or(u64::MAX);
            // A taker marks a lapsed lease word taken before it swaps the
            // state word: of it and this swap, one fails.
            loop {
                let until = unix::monotonic_ns().saturating_add(nanos);
                match files.map.lease(slot).compare_exchange(
                    seen,
                    until,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => return Ok(()),
                    // Renewed by another thread of this guard, or taken.
                    Err(now) if now != TAKEN && unix::monotonic_ns() < now => seen = now,
                    Err(_) => return Err(self.expired()),
                }
            }
        })?;
        if let Some(local) = &self.local {
            let _ = local.renew(lease);
        }
        Ok(())
    }

    /// Writes the release into the slot's cell, then lets the slot and the
    /// in-process grant go. With `checked`, first reads whether the grant
    /// was live to the end: `Ok(token)` if so. Idempotent: a second call
    /// finds nothing to release.
    ///
    /// The cell is written only if the file is still whole (an `fstat`
    /// first: a store into a page beyond a shortened file's end would
    /// raise `SIGBUS`); the slot is let go in any case, and a file found
    /// damaged or replaced is closed, not cached.
    fn release(&mut self, checked: bool) -> Result<FencingToken, ProcessLockError> {
        let token = self.token;
        let Some(mut files) = self.files().take() else {
            return Err(self.expired());
        };
        let verdict = if checked {
            match standing(&files, token, self.slot) {
                Ok(Standing::Live(_)) => Ok(token),
                Ok(Standing::Replaced) => {
                    files.stale = true;
                    Err(self.expired())
                }
                // Lapsed (the cell below frees the key) or taken over (the
                // word names the successor, on another slot: the cell of
                // this grant's slot frees nothing of it).
                Ok(Standing::Lapsed(_) | Standing::Lost) => Err(self.expired()),
                Err(err) => Err(err),
            }
        } else {
            Ok(token)
        };
        let whole = files.whole();
        if whole.is_ok() {
            // While the slot is still held: nobody else writes its cell.
            files.map.release(self.slot, token.get());
        }
        let verdict = match (verdict, whole) {
            (Ok(_), Err(err)) => Err(err),
            (verdict, _) => verdict,
        };
        if matches!(verdict, Err(ProcessLockError::Damaged { .. })) {
            files.stale = true;
        }
        match files.unlock_slot(self.slot, self.on) {
            // No lock left on the files: they may serve the next lock
            // (unless replaced or damaged: `put_back` closes those).
            Ok(()) => self.inner.put_back(files),
            // Closing them frees the lock.
            Err(_) => drop(files),
        }
        drop(self.local.take());
        verdict
    }
}

impl<K> Drop for Held<K> {
    fn drop(&mut self) {
        let _ = self.release(false);
    }
}

macro_rules! process_guard_methods {
    () => {
        /// The key this guard holds.
        pub fn key(&self) -> &K {
            &self.held.key
        }

        /// The fencing token of this grant: above every earlier grant's of
        /// the key, in any process, across restarts.
        pub fn token(&self) -> FencingToken {
            self.held.token
        }

        /// The commit-time fence: `Ok(token)` only while the key's path
        /// still names the grant's state file, that file still names this
        /// grant, and its lease (if any) has not lapsed, judged now on the
        /// host's monotonic clock.
        ///
        /// # Errors
        ///
        /// [`ProcessLockError::Expired`] once the grant lost the key
        /// (taken over, or its file removed or replaced);
        /// [`ProcessLockError::Damaged`] if its file was truncated from
        /// outside; [`ProcessLockError::Io`] if the state file cannot be
        /// read.
        pub fn check(&self) -> Result<FencingToken, ProcessLockError> {
            self.held.check()
        }

        /// Whether the grant has lost its authority (`check()` fails).
        pub fn is_expired(&self) -> bool {
            self.check().is_err()
        }

        /// When the grant's lease ends (`None` without a lease), as the
        /// state file says now.
        ///
        /// # Errors
        ///
        /// [`ProcessLockError::Expired`] if another grant took the key (or
        /// its file was removed or replaced); [`ProcessLockError::Damaged`]
        /// if its file was truncated from outside.
        pub fn expires_at(&self) -> Result<Option<Instant>, ProcessLockError> {
            self.held.expires_at()
        }

        /// Sets the lease to end `lease` from now (a grant without a lease
        /// gets one). A lapsed grant is never revived, even if nobody took
        /// the key yet.
        ///
        /// # Errors
        ///
        /// [`ProcessLockError::Expired`] if the grant lost the key or its
        /// lease lapsed; [`ProcessLockError::Damaged`] if its file was
        /// truncated from outside; [`ProcessLockError::InvalidOptions`] for
        /// a lease of zero or over an hour.
        pub fn renew(&self, lease: Duration) -> Result<(), ProcessLockError> {
            self.held.renew(lease)
        }

        /// A future that resolves when this grant loses its authority (when
        /// `check()` would fail), with the reason: woken by a timer at the
        /// lease deadline, re-armed when the lease is renewed meanwhile;
        /// at once if it has already lost the key. Pending for ever for a
        /// grant without a lease (see [`ProcessLost`]).
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it changes nothing.
        ///
        /// ```
        /// # let dir = std::env::temp_dir().join(format!("keylock-doc-glost-{}", std::process::id()));
        /// # std::fs::create_dir_all(&dir).unwrap();
        /// # futures::executor::block_on(async {
        /// use std::time::Duration;
        /// use keylock::{LockOptions, ProcessLockTable};
        /// let table = ProcessLockTable::open(&dir)?;
        /// let guard = table.lock_with("job", LockOptions::new().lease(Duration::from_millis(10))).await?;
        /// let why = guard.lost().await; // its lease lapses
        /// assert!(why.to_string().contains(r#"lost key "job""#));
        /// # Ok::<(), keylock::ProcessLockError>(())
        /// # }).unwrap();
        /// # std::fs::remove_dir_all(&dir).unwrap();
        /// ```
        pub fn lost(&self) -> ProcessLost<'_, K> {
            ProcessLost::new(&self.held)
        }

        /// A future that keeps this grant's lease alive: renews it with
        /// `lease` on its first poll and then every `interval`, until it
        /// is dropped; it resolves at the first failure with the reason
        /// (see [`ProcessKeepAlive`]).
        ///
        /// # Cancel safety
        ///
        /// Cancel-safe: dropping it stops the renewals.
        ///
        /// ```
        /// # let dir = std::env::temp_dir().join(format!("keylock-doc-gkeep-{}", std::process::id()));
        /// # std::fs::create_dir_all(&dir).unwrap();
        /// # futures::executor::block_on(async {
        /// use std::time::Duration;
        /// use keylock::{ProcessLockError, ProcessLockTable};
        /// let table = ProcessLockTable::open(&dir)?;
        /// let guard = table.lock("job").await?;
        /// // An interval not shorter than the lease is refused at once.
        /// let err = guard.keep_alive(Duration::from_secs(5), Duration::from_secs(5)).await;
        /// assert!(matches!(err, ProcessLockError::InvalidOptions { .. }));
        /// # Ok::<(), ProcessLockError>(())
        /// # }).unwrap();
        /// # std::fs::remove_dir_all(&dir).unwrap();
        /// ```
        pub fn keep_alive(&self, interval: Duration, lease: Duration) -> ProcessKeepAlive<'_, K> {
            ProcessKeepAlive::new(&self.held, interval, lease)
        }

        /// Releases the key and says whether the grant held it, live, to the
        /// end: [`ProcessLockError::Expired`] if its lease had lapsed or
        /// another process had taken it over (whose grant is left alone).
        ///
        /// # Errors
        ///
        /// [`ProcessLockError::Expired`], [`ProcessLockError::Damaged`] if
        /// its file was truncated from outside, or [`ProcessLockError::Io`]
        /// if the state file could not be written (the key is freed all the
        /// same: its slot lock is let go).
        pub fn release_checked(mut self) -> Result<FencingToken, ProcessLockError> {
            self.held.release(true)
        }

        /// Releases the key now; the same as dropping the guard. A release
        /// never fails the caller: a grant that lost the key frees nothing.
        pub fn release(self) {
            drop(self);
        }
    };
}

/// A key held across processes; dropping it releases the key.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-guard-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use std::time::Duration;
/// let table = keylock::ProcessLockTable::open(&dir)?;
/// let opts = keylock::LockOptions::new().lease(Duration::from_secs(30));
/// let guard = table.try_lock_with("row-7", opts)?;
/// let token = guard.check()?; // write with it
/// guard.renew(Duration::from_secs(30))?;
/// assert_eq!(guard.release_checked()?, token);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
#[derive(Debug)]
pub struct ProcessGuard<'a, K> {
    held: Held<K>,
    _table: std::marker::PhantomData<&'a ProcessLockTable<K>>,
}

impl<K> ProcessGuard<'_, K> {
    pub(crate) fn new(held: Held<K>) -> Self {
        Self {
            held,
            _table: std::marker::PhantomData,
        }
    }

    process_guard_methods!();
}

/// A key held across processes, keeping its table alive (`'static`).
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-oguard-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use std::sync::Arc;
/// let table = Arc::new(keylock::ProcessLockTable::open(&dir)?);
/// let guard = table.clone().try_lock_owned("k")?;
/// assert!(Arc::ptr_eq(guard.table(), &table));
/// # drop(guard);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct OwnedProcessGuard<K> {
    held: Held<K>,
    table: Arc<ProcessLockTable<K>>,
}

impl<K: std::fmt::Debug> std::fmt::Debug for OwnedProcessGuard<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedProcessGuard")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl<K> OwnedProcessGuard<K> {
    pub(crate) fn new(table: Arc<ProcessLockTable<K>>, held: Held<K>) -> Self {
        Self { held, table }
    }

    /// The table this guard belongs to.
    pub fn table(&self) -> &Arc<ProcessLockTable<K>> {
        &self.table
    }

    process_guard_methods!();
}
