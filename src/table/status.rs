//! The lock status view: who holds and who waits for each key, as
//! PostgreSQL's `pg_locks` or RocksDB's lock status data show it.
//!
//! Each key's holders and waiters are read under its shard lock (consistent
//! per key; the shards are read one after another, so the view as a whole
//! is not one instant). Keys are cloned after the shard lock is released:
//! the snapshot pins each entry it read (`keys/status.rs`) and unpins it
//! once its key is cloned, so no user code runs under a shard lock, and a
//! `Clone` that panics leaves every pin undone. Nothing of this runs unless
//! asked for.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::time::{Duration, Instant};

use crate::keys::waiter::Want;
use crate::keys::{RawStatus, RawWaiter};
use crate::support::key_slot::KeyPtr;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::support::token::TransactionId;
use crate::table::LockTable;
use crate::time::clock::Now;

/// One grant holding a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderStatus {
    /// The grant's fencing token.
    pub token: FencingToken,
    /// The mode it holds the key in.
    pub mode: Mode,
    /// The transaction it was made for (none: a plain guard).
    pub transaction: Option<TransactionId>,
    /// That transaction's label, if it has one
    /// ([`TransactionOptions::label`](crate::TransactionOptions::label)).
    pub label: Option<&'static str>,
    /// When it was granted, if the table read the time then: grants with a
    /// lease (a grant without one reads no clock, so that an uncontended
    /// lock stays free of clock reads).
    pub since: Option<Instant>,
    /// When its lease ends, if it has one.
    pub lease_deadline: Option<Instant>,
    /// How long it had held the key when the view was read (known when
    /// `since` is).
    pub held_for: Option<Duration>,
    /// How much of its lease was left when the view was read (zero once
    /// the deadline passed; none without a lease).
    pub lease_left: Option<Duration>,
    /// Its lease has lapsed: the next waiter takes the key at the next
    /// settle (a lock, a release, a timer).
    pub lapsed: bool,
    /// It is a hold: detached from its transaction, released through the
    /// table by key and token
    /// ([`LockTable::release_hold`](crate::LockTable::release_hold)).
    pub hold: bool,
}

/// One waiter of a key, in queue order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaiterStatus {
    /// The mode it asks for.
    pub mode: Mode,
    /// It is an upgrade of a shared grant (it heads the queue).
    pub upgrade: bool,
    /// The transaction it waits for (none: a plain lock future).
    pub transaction: Option<TransactionId>,
    /// That transaction's label, if it has one.
    pub label: Option<&'static str>,
    /// When it started to wait. Known for a wait with a timeout or
    /// deadline (it reads the clock anyway), and on the real clock for
    /// every wait that began after the table's status view was first read
    /// ([`status`](crate::LockTable::status),
    /// [`lock_status`](crate::LockTable::lock_status) or
    /// [`holder`](crate::LockTable::holder)), to the coarse clock's
    /// precision. Until the view is read a wait without a timeout reads no
    /// clock, so a table nobody inspects pays nothing for this field: read
    /// the view once at start-up to have every wait stamped.
    pub since: Option<Instant>,
    /// How long it had waited when the view was read (known when `since`
    /// is).
    pub waited_for: Option<Duration>,
}

/// Who holds and who waits for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockStatus {
    /// The holders, oldest first where the table keeps that order (an
    /// exclusive grant is the only one).
    pub holders: Vec<HolderStatus>,
    /// The waiters, head of the queue first.
    pub waiters: Vec<WaiterStatus>,
}

fn id_of(owner: u64) -> Option<TransactionId> {
    TransactionId::from_owner(owner)
}

impl LockStatus {
    /// The status as read at `now` (the table's clock), transactions named
    /// by `labels`.
    fn from_raw(raw: RawStatus, labels: &HashMap<u64, &'static str>, now: Instant) -> Self {
        LockStatus {
            holders: raw
                .holders
                .iter()
                .map(|h| {
                    let since = h.since.get();
                    let lease_deadline = h.deadline.get();
                    HolderStatus {
                        token: h.token,
                        mode: raw.mode,
                        transaction: id_of(h.owner),
                        label: labels.get(&h.owner).copied(),
                        since,
                        lease_deadline,
                        held_for: since.map(|at| now.saturating_duration_since(at)),
                        lease_left: lease_deadline.map(|at| at.saturating_duration_since(now)),
                        lapsed: h.lapsed,
                        hold: h.owner == crate::support::token::HOLD_OWNER,
                    }
                })
                .collect(),
            waiters: raw.waiters.iter().map(|w| waiter(w, labels, now)).collect(),
        }
    }
}

/// A duration as the status view shows it: `1.2s`, `350ms`, `20µs`.
struct Short(Duration);

impl fmt::Display for Short {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d >= Duration::from_secs(1) {
            write!(f, "{:.1}s", d.as_secs_f64())
        } else if d >= Duration::from_millis(1) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}µs", d.as_micros())
        }
    }
}

/// `transaction 3 "flush"`, or `"flush"` alone for a labeled plain lock.
fn owner(
    f: &mut fmt::Formatter<'_>,
    transaction: Option<TransactionId>,
    label: Option<&str>,
) -> fmt::Result {
    if let Some(id) = transaction {
        write!(f, " {id}")?;
    }
    if let Some(label) = label {
        write!(f, " {label:?}")?;
    }
    Ok(())
}

/// One line: `#5 exclusive transaction 3 "flush" held 1.2s lease 28.8s
/// left`, as a row of PostgreSQL's `pg_locks` reads.
///
/// ```
/// # futures::executor::block_on(async {
/// use std::time::Duration;
/// let table = keylock::LockTable::new();
/// let guard = table
///     .lock_with("job-7", keylock::LockOptions::new().lease(Duration::from_secs(30)))
///     .await?;
/// let line = table.holder("job-7").unwrap().to_string();
/// assert!(line.starts_with(&format!("{} exclusive", guard.token())), "{line}");
/// assert!(line.contains(" held ") && line.contains("s left"), "{line}");
/// # Ok::<(), keylock::LockError>(())
/// # }).unwrap();
/// ```
impl fmt::Display for HolderStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.token, self.mode)?;
        if self.hold {
            f.write_str(" hold")?;
        }
        owner(f, self.transaction, self.label)?;
        if let Some(held) = self.held_for {
            write!(f, " held {}", Short(held))?;
        }
        if self.lapsed {
            f.write_str(" lease lapsed")?;
        } else if let Some(left) = self.lease_left {
            write!(f, " lease {} left", Short(left))?;
        }
        Ok(())
    }
}

/// One line: `exclusive upgrade transaction 4 waiting 0.3s`.
///
/// ```
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let _held = table.lock("job-7").await;
/// let mut waiting = Box::pin(table.lock_shared("job-7"));
/// assert!(futures::poll!(waiting.as_mut()).is_pending());
/// let status = table.lock_status("job-7").unwrap();
/// assert!(status.waiters[0].to_string().starts_with("shared"));
/// # });
/// ```
impl fmt::Display for WaiterStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.mode)?;
        if self.upgrade {
            f.write_str(" upgrade")?;
        }
        owner(f, self.transaction, self.label)?;
        if let Some(waited) = self.waited_for {
            write!(f, " waiting {}", Short(waited))?;
        }
        Ok(())
    }
}

/// One line per key, as PostgreSQL's `pg_locks` reads: the holders after
/// `granted`, then the waiters in queue order after `waiting`, each as its
/// own `Display` shows it, separated by commas.
///
/// ```
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let guard = table.lock("job-7").await;
/// let mut waiting = Box::pin(table.lock("job-7"));
/// assert!(futures::poll!(waiting.as_mut()).is_pending());
/// for (key, status) in table.status() {
///     let line = format!("{key}: {status}");
///     assert!(line.starts_with(&format!("job-7: granted {} exclusive", guard.token())));
///     assert!(line.contains("; waiting exclusive"), "{line}");
/// }
/// # });
/// ```
impl fmt::Display for LockStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("granted ")?;
        if self.holders.is_empty() {
            f.write_str("none")?;
        }
        for (i, holder) in self.holders.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{holder}")?;
        }
        if !self.waiters.is_empty() {
            f.write_str("; waiting ")?;
            for (i, waiter) in self.waiters.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{waiter}")?;
            }
        }
        Ok(())
    }
}

/// The transaction ids a status names.
fn ids(raw: &RawStatus) -> impl Iterator<Item = u64> + '_ {
    let holders = raw.holders.iter().map(|h| h.owner);
    holders.chain(raw.waiters.iter().map(|w| w.owner))
}

fn waiter(w: &RawWaiter, labels: &HashMap<u64, &'static str>, now: Instant) -> WaiterStatus {
    let (mode, upgrade) = match w.want {
        Want::Grant(mode) => (mode, false),
        Want::Upgrade(_) => (Mode::Exclusive, true),
    };
    WaiterStatus {
        mode,
        upgrade,
        transaction: id_of(w.owner),
        label: labels.get(&w.owner).copied(),
        since: w.since.get(),
        waited_for: w.since.get().map(|at| now.saturating_duration_since(at)),
    }
}

/// Pinned entries of one shard not yet unpinned; unpins the rest if
/// dropped early (a key's `Clone` panicked).
struct Pins<'t, K: Eq + Hash, S: BuildHasher> {
    table: &'t LockTable<K, S>,
    left: std::vec::IntoIter<(u64, KeyPtr<K>, RawStatus)>,
}

impl<K: Eq + Hash, S: BuildHasher> Drop for Pins<'_, K, S> {
    fn drop(&mut self) {
        for (hash, key, _) in self.left.by_ref() {
            self.table.unpin(hash, key);
        }
    }
}

/// A key whose entry is pinned (see `keys/status.rs`): its key cell stays
/// live, and is never written, until this drops and unpins it, so the key
/// can be read (cloned: user code) outside every lock.
pub(crate) struct PinnedKey<'t, K: Eq + Hash, S: BuildHasher> {
    table: &'t LockTable<K, S>,
    hash: u64,
    key: KeyPtr<K>,
}

impl<K: Eq + Hash, S: BuildHasher> PinnedKey<'_, K, S> {
    pub(crate) fn key(&self) -> &K {
        // SAFETY: the entry is pinned until `self` drops, so its key cell
        // is live and never written meanwhile.
        unsafe { self.key.get() }
    }
}

impl<K: Eq + Hash, S: BuildHasher> Drop for PinnedKey<'_, K, S> {
    fn drop(&mut self) {
        self.table.unpin(self.hash, self.key);
    }
}

impl<K: Eq + Hash, S: BuildHasher> LockTable<K, S> {
    /// Every key that is held or awaited, with its holders and waiters: a
    /// lock status view for diagnosis. Each key's entry is read at one
    /// instant; different keys at different ones.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, Mode};
    /// let table = LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("row-1", Mode::Shared).await?;
    /// let status = table.status();
    /// assert_eq!(status.len(), 1);
    /// let (key, row) = &status[0];
    /// assert_eq!(*key, "row-1");
    /// assert_eq!(row.holders[0].mode, Mode::Shared);
    /// assert_eq!(row.holders[0].transaction, Some(txn.id()));
    /// assert!(row.waiters.is_empty());
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn status(&self) -> Vec<(K, LockStatus)>
    where
        K: Clone,
    {
        self.watch_wait_starts();
        let mut out = Vec::new();
        for index in 0..self.shard_count() {
            let mut raw = Vec::new();
            {
                let mut now = Now::new(self.clock());
                let mut state = self.shard_at(index).state.lock();
                state.snapshot(&mut now, &mut raw);
            }
            let mut pins = Pins {
                table: self,
                left: raw.into_iter(),
            };
            for (hash, key, status) in pins.left.by_ref() {
                let pinned = PinnedKey {
                    table: self,
                    hash,
                    key,
                };
                let cloned = pinned.key().clone();
                let labels = self.labels().of(ids(&status));
                let now = self.clock().now();
                out.push((cloned, LockStatus::from_raw(status, &labels, now)));
            }
        }
        out
    }

    /// Who holds and who waits for `key` (none if nobody does), read at one
    /// instant.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// assert!(table.lock_status("job-7").is_none());
    /// let guard = table.lock("job-7").await;
    /// let status = table.lock_status("job-7").unwrap();
    /// assert_eq!(status.holders[0].token, guard.token());
    /// assert_eq!(status.holders[0].transaction, None);
    /// # });
    /// ```
    pub fn lock_status<Q>(&self, key: &Q) -> Option<LockStatus>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.watch_wait_starts();
        let hash = self.hash(key);
        let raw = self.with_shard(hash, |state, ctx| state.status_of(hash, key, ctx.clock()))?;
        let labels = self.labels().of(ids(&raw));
        Some(LockStatus::from_raw(raw, &labels, self.clock().now()))
    }

    /// The grant holding `key` (the oldest, if several share it), if any.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// assert!(table.holder("job-7").is_none());
    /// let guard = table.lock("job-7").await;
    /// assert_eq!(table.holder("job-7").unwrap().token, guard.token());
    /// # });
    /// ```
    pub fn holder<Q>(&self, key: &Q) -> Option<HolderStatus>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.lock_status(key)?.holders.into_iter().next()
    }

    /// Pins the entry of `guard`'s key (a guard of this table), so that the
    /// key can be cloned once every lock is released (an owned
    /// transaction's list of its keys).
    pub(crate) fn pin_key(
        &self,
        guard: &crate::table::guard::Guard<'_, K, S>,
    ) -> PinnedKey<'_, K, S> {
        debug_assert!(std::ptr::eq(guard.table, self), "a guard of this table");
        let (hash, key) = (guard.held.hash(), guard.held.key_ptr());
        self.with_shard(hash, |state, _| state.pin(hash, key));
        PinnedKey {
            table: self,
            hash,
            key,
        }
    }

    /// Lets go of a pin on the entry of `key` (a snapshot's, or a
    /// [`PinnedKey`]'s).
    fn unpin(&self, hash: u64, key: KeyPtr<K>) {
        self.with_shard(hash, |state, ctx| state.unpin(hash, key, ctx));
    }
}
