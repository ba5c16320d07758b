//! Transactions: owners that hold many keys of one table, re-entrantly,
//! and release them all at once.
//!
//! Two public forms, [`Transaction`] (borrows its table; its calls borrow
//! it) and [`OwnedTransaction`] (keeps its table alive through an `Arc`;
//! `'static`, its calls are `'static` futures that may run on other
//! tasks), are thin wrappers over one implementation, written against two
//! seams: how an owner reaches its table and guards (`reach.rs`) and how a
//! call reaches the owner's state (`access.rs`: `&mut`, or an `Arc` shared
//! with pending futures). The rest has one file per concern: the set of
//! held keys with their re-entry counts (`held.rs`), one key's lock and
//! the operations over all keys (`single.rs`), many keys at once
//! (`multi.rs`), wait policies and options (`policy.rs`), errors
//! (`error.rs`), retrying a whole transaction (`retry.rs`), and the cells
//! through which a transaction cancels its calls' waits when it ends, so
//! that a forgotten call keeps nothing (`pending.rs`). `probe.rs` (feature
//! `probes`, for benchmarks only) is the least a transaction can do, the
//! measuring stick of their instruction goals.
//!
//! # The life of a transaction
//!
//! Created from a table ([`LockTable::transaction`] and friends), it fixes
//! its deadline (the earlier of its options' deadline and timeout) and
//! lease. Each lock is re-entrant: a key held in the mode asked or a
//! stronger one is counted and returned at once; a key held shared and
//! asked exclusive is upgraded ([`Guard::upgrade`](crate::Guard::upgrade));
//! a new key is locked on the table with the transaction's lease, waiting
//! (under [`WaitPolicy::Block`]) at most until its deadline.
//! [`unlock`](Transaction::unlock) takes one count back and releases the
//! key at zero (PostgreSQL's advisory unlock);
//! [`release`](Transaction::release) lets it go whatever its count.
//! [`commit`](Transaction::commit) checks that every grant still holds its
//! key, then releases them all; [`abort`](Transaction::abort) and drop
//! release them all, from any thread.

pub(crate) mod deadlock;
pub(crate) mod hold;

mod access;
mod error;
mod fresh;
mod held;
mod multi;
mod pending;
mod policy;
#[cfg(feature = "probes")]
pub(crate) mod probe;
mod reach;
mod retry;
mod single;

use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::guard::Guard;
use crate::table::{DefaultHashBuilder, LockTable};
use crate::transactions::hold::Hold;

use access::{Direct, Owner, SetOf, Shared};
use held::{HeldSet, NotReleased};
use reach::{GuardOps, Pinned, Reach};

pub use error::{TransactionError, TransactionFailure};
pub use retry::RetryPolicy;

/// A per-call list: inline up to four items (a transfer's two accounts, a
/// small `lock_all`), on the heap past that.
pub(crate) type Few<T> = smallvec::SmallVec<[T; 4]>;
/// A call's requests as a [`Few`]: pushed one by one, which costs a small
/// call less than `collect` (that reserves by the size hint first); a
/// larger one is collected.
#[inline]
fn few<T>(items: impl IntoIterator<Item = T>) -> Few<T> {
    let items = items.into_iter();
    let mut few = Few::new();
    if items.size_hint().0 > few.inline_size() {
        // Collected as a plain list, which it then becomes as it is (past
        // the inline size: no copy): a list's collect writes each item in
        // place, where the small vector's asks at each step where its
        // items live.
        return Few::from_vec(items.collect());
    }
    for item in items {
        few.push(item);
    }
    few
}

pub use held::{AcquireKind, Acquired};
pub use multi::LockedSet;
pub use policy::{TransactionOptions, WaitPolicy};

/// The borrowed form of a transaction: a handle that takes many keys of a
/// [`LockTable`] for one owner, re-entrantly, and releases them all when
/// committed, aborted or dropped. See the [crate doc](crate#transactions).
///
/// ```
/// use keylock::{Mode, LockTable};
/// # futures::executor::block_on(async {
/// let table = LockTable::new();
/// let mut txn = table.transaction();
/// txn.lock_all([("from", Mode::Exclusive), ("to", Mode::Exclusive)]).await?;
/// txn.lock("from", Mode::Shared).await?; // re-entrant: counted, nothing taken
/// assert_eq!(txn.count("from"), 2);
/// assert!(table.try_lock("to").is_err());
/// txn.commit()?;
/// assert!(table.is_empty());
/// # Ok::<(), keylock::TransactionError<&str>>(())
/// # }).unwrap();
/// ```
#[must_use = "a transaction releases its keys as soon as it is dropped"]
pub struct Transaction<'t, K, S = DefaultHashBuilder> {
    owner: Owner<&'t LockTable<K, S>>,
    set: HeldSet<Guard<'t, K, S>, K>,
    /// The lock futures of its waiting calls, cancelled when it ends, so a
    /// forgotten call keeps nothing (`pending.rs`).
    pending: pending::PendingList<
        crate::table::acquire::LockWith<'t, K, S>,
        crate::table::upgrade::UpgradeOwned<'t, K, S>,
        Guard<'t, K, S>,
    >,
    /// The wait a call for a new key parked here while it waits, with the
    /// guards it took (`pending::Parked`): a forgotten call's is dropped
    /// when the transaction ends or its next call parks a wait.
    parked: pending::ParkedSlot<crate::table::acquire::LockWith<'t, K, S>, Guard<'t, K, S>>,
}

impl<K, S> Drop for Transaction<'_, K, S> {
    fn drop(&mut self) {
        self.end_now();
    }
}

impl<K, S> Transaction<'_, K, S> {
    /// Releases what the transaction holds and cancels its forgotten
    /// calls (its drop; a commit whose release panicked). Idempotent.
    #[inline]
    fn end_now(&mut self) {
        // Nothing held and no call's cell or parked wait (a committed
        // transaction, or one that took nothing): nothing to release, and
        // the fields' own drops free what little they own.
        if self.set.is_vacant()
            && self.pending.is_empty()
            && self.parked.is_empty()
            && self.set.waits == 0
        {
            return;
        }
        // Calls forgotten in a wait (no live call is left: `&mut self`):
        // their registrations with the deadlock detector go too.
        let forgotten = self.set.waits != 0;
        // As the owned form's end: the set's keys first (a panic in a key's
        // drop still releases the rest, see `HeldSet`), then what a
        // forgotten call has outside the set (its waiter leaves its queue,
        // or its unobserved grant passes on; its guards are released),
        // whatever the first did.
        let set = std::mem::take(&mut self.set);
        let released = catch_unwind(AssertUnwindSafe(|| drop(set)));
        let parked = catch_unwind(AssertUnwindSafe(|| {
            pending::clear_parked(&mut self.parked);
        }));
        let pending = std::mem::take(&mut self.pending);
        let cancelled = catch_unwind(AssertUnwindSafe(|| pending::cancel_all(pending)));
        if forgotten {
            self.set.waits = 0;
            let owner = &self.owner;
            let detector = owner.reach.detector();
            detector.forget_owner(owner.opts.id.get());
        }
        // The first panic goes on, unless the thread is already unwinding
        // (a drop during a panic): a second panic would abort the process.
        if let Err(payload) = released.and(parked).and(cancelled) {
            if !std::thread::panicking() {
                resume_unwind(payload);
            }
        }
    }
}

/// The owned form of a transaction: like [`Transaction`], but it keeps its
/// table alive through an [`Arc`], so it is `'static` and moves across
/// awaits and spawns, and its lock futures are `'static` too (each holds
/// an `Arc` of the transaction's state).
///
/// Ending the transaction (commit, abort, drop) while one of its lock
/// futures is pending, on this task or another, releases everything the
/// transaction holds at once, what its pending calls had got for it
/// included (even a call whose future is never polled again), and wakes
/// the future, which fails with [`TransactionError::Ended`]. Two of its futures
/// pending at once for the same key do not wait on each other: the second
/// fails at once with [`TransactionError::InFlight`].
///
/// ```
/// use std::sync::Arc;
/// use keylock::{LockTable, Mode};
/// # futures::executor::block_on(async {
/// let table = Arc::new(LockTable::new());
/// let txn = table.clone().transaction_owned();
/// let lock = txn.lock(7u64, Mode::Exclusive); // a 'static future
/// std::thread::spawn(move || futures::executor::block_on(lock)).join().unwrap()?;
/// assert!(table.is_locked(&7));
/// drop(txn);
/// assert!(table.is_empty());
/// # Ok::<(), keylock::TransactionError<u64>>(())
/// # }).unwrap();
/// ```
#[must_use = "a transaction releases its keys as soon as it is dropped"]
pub struct OwnedTransaction<K, S = DefaultHashBuilder>
where
    K: Eq + Hash + 'static,
    S: BuildHasher + 'static,
{
    shared: Arc<Shared<Pinned<K, S>>>,
}

impl<K: Eq + Hash, S: BuildHasher> LockTable<K, S> {
    /// Starts a [`Transaction`] on this table, with default options: no
    /// deadline, the table's default lease, [`WaitPolicy::Block`].
    ///
    /// ```
    /// let table = keylock::LockTable::<u32>::new();
    /// let txn = table.transaction();
    /// assert!(txn.is_empty());
    /// ```
    #[inline]
    pub fn transaction(&self) -> Transaction<'_, K, S> {
        self.transaction_with(TransactionOptions::new())
    }

    /// Starts a [`Transaction`] with `opts`: its deadline (fixed now, from
    /// the timeout) bounds every lock it takes, its lease is every grant's.
    ///
    /// ```
    /// use std::time::Duration;
    /// let table = keylock::LockTable::<u32>::new();
    /// let txn = table.transaction_with(
    ///     keylock::TransactionOptions::new().timeout(Duration::from_secs(1)),
    /// );
    /// assert!(txn.deadline().is_some());
    /// ```
    #[inline]
    pub fn transaction_with(&self, opts: TransactionOptions) -> Transaction<'_, K, S> {
        let name = opts.label_name();
        let opts = opts.resolve(self.clock());
        let label = name.map(|label| self.labels().register(opts.0.id.get(), label));
        Transaction {
            owner: Owner::new(self, opts, label),
            set: HeldSet::default(),
            pending: pending::PendingList::new(),
            parked: pending::ParkedSlot::Empty,
        }
    }

    /// Starts an [`OwnedTransaction`] on this table, with default options.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::<u32>::new());
    /// let txn = table.transaction_owned();
    /// assert!(txn.is_empty());
    /// ```
    pub fn transaction_owned(self: Arc<Self>) -> OwnedTransaction<K, S>
    where
        K: 'static,
        S: 'static,
    {
        self.transaction_owned_with(TransactionOptions::new())
    }

    /// Starts an [`OwnedTransaction`] with `opts` (see
    /// [`transaction_with`](Self::transaction_with)).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// let table = Arc::new(keylock::LockTable::<u32>::new());
    /// let opts = keylock::TransactionOptions::new().lease(Duration::from_secs(30));
    /// let txn = table.transaction_owned_with(opts);
    /// # drop(txn);
    /// ```
    pub fn transaction_owned_with(
        self: Arc<Self>,
        opts: TransactionOptions,
    ) -> OwnedTransaction<K, S>
    where
        K: 'static,
        S: 'static,
    {
        let name = opts.label_name();
        let opts = opts.resolve(self.clock());
        let label = name.map(|label| self.labels().register(opts.0.id.get(), label));
        OwnedTransaction {
            shared: Arc::new(Shared::new(Owner::new(Pinned::new(self), opts, label))),
        }
    }
}

/// The lease `renew` renews with: the transaction's, else the table's
/// default.
fn renewal_lease<R: Reach>(owner: &Owner<R>) -> Option<std::time::Duration> {
    owner.opts.lease.or(owner.reach.table().leases().default)
}

/// The methods both forms share, over the set of keys they hold.
fn count_of<R: Reach, Q>(
    set: &SetOf<R>,
    hash: u64,
    key: &Q,
) -> (usize, Option<Mode>, Option<FencingToken>)
where
    R::Key: Borrow<Q>,
    Q: Eq + ?Sized,
{
    match set.get(hash, key) {
        None => (0, None, None),
        Some(slot) => (
            slot.count(),
            slot.guard().map(GuardOps::mode),
            slot.guard().map(GuardOps::token),
        ),
    }
}

/// The count left after an unlock and, at zero, the slot to drop.
type Unlocked<R> = (
    usize,
    Option<held::Slot<<R as Reach>::Guard, <R as Reach>::Key>>,
);

/// Detaches the slot `unlock_in` took out of the set as a hold of the
/// table (see `hold.rs`), if its grant still holds the key.
fn detach_slot<R: Reach>(
    table: &LockTable<R::Key, R::Hasher>,
    slot: Option<held::Slot<R::Guard, R::Key>>,
    key: &R::Key,
) -> Result<Hold<R::Key>, TransactionError<R::Key>>
where
    R::Key: Clone,
{
    let Some(guard) = slot.and_then(held::Slot::into_guard) else {
        return Err(TransactionError::NotHeld { key: key.clone() });
    };
    // Lost holds' records go first, while this guard still owns its grant
    // (see `adopt_hold`).
    table.sweep_holds();
    if guard.check().is_err() {
        // Lost: the guard drops (released as lost), and no hold is made.
        return Err(TransactionError::Expired {
            key: key.clone(),
            token: guard.token(),
        });
    }
    let hold = Hold {
        key: key.clone(),
        token: guard.token(),
        mode: guard.mode(),
        lease_deadline: guard.expires_at(),
    };
    guard.into_hold(table);
    Ok(hold)
}

fn unlock_in<R: Reach>(
    set: &mut SetOf<R>,
    hash: u64,
    key: &R::Key,
    all: bool,
) -> Result<Unlocked<R>, TransactionError<R::Key>>
where
    R::Key: Clone,
{
    set.unlock(hash, key, all)
        .map_err(|why| not_released(why, key))
}

/// The error of an unlock that did nothing, naming its key (a clone: made
/// after any lock around the set is released).
fn not_released<K: Clone>(why: NotReleased, key: &K) -> TransactionError<K> {
    match why {
        NotReleased::NotHeld => TransactionError::NotHeld { key: key.clone() },
        NotReleased::Busy => TransactionError::InFlight { key: key.clone() },
    }
}

impl<'t, K: Eq + Hash, S: BuildHasher> Transaction<'t, K, S> {
    fn direct(&mut self) -> Direct<'_, &'t LockTable<K, S>> {
        Direct {
            owner: &self.owner,
            set: &mut self.set,
            pending: &mut self.pending,
            parked: &mut self.parked,
        }
    }

    /// The table this transaction locks keys of.
    #[must_use]
    pub fn table(&self) -> &'t LockTable<K, S> {
        self.owner.reach
    }

    /// The deadline every lock of the transaction waits until at most, if
    /// any (on the table's clock).
    #[must_use]
    pub fn deadline(&self) -> Option<Instant> {
        self.owner.opts.deadline
    }

    /// Locks `key` in `mode` for the transaction, under its default
    /// [`WaitPolicy`]. Re-entrant: a key it holds in `mode` or a stronger
    /// one is counted and returned at once (the same token); a key it holds
    /// shared, asked exclusive, is upgraded (a new token); a new key is
    /// locked on the table with the transaction's lease, waiting at most
    /// until its deadline.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Lock`] (the deadline passed, naming the holder;
    /// options out of range; an upgrade conflicting with another holder's),
    /// [`TransactionError::Busy`] (a policy that does not wait, naming the
    /// holder), [`TransactionError::Expired`] (an upgrade of a grant that
    /// lost its key). Each names the key.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropped before it completes, it leaves the transaction
    /// as it was (a new key is not taken, or released; a key being
    /// upgraded stays shared).
    ///
    /// ```
    /// use keylock::{AcquireKind, Mode};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// let a = txn.lock("row", Mode::Exclusive).await?;
    /// let b = txn.lock("row", Mode::Exclusive).await?; // no self-deadlock
    /// assert_eq!((b.kind, b.count, b.token), (AcquireKind::Reentered, 2, a.token));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock<'a>(
        &'a mut self,
        key: K,
        mode: Mode,
    ) -> impl Future<Output = Result<Acquired, TransactionError<K>>> + use<'a, 't, K, S>
    where
        K: Clone,
    {
        let policy = self.owner.wait;
        single::lock(self.direct(), key, mode, policy)
    }

    /// Like [`lock`](Self::lock), under `policy` instead of the
    /// transaction's default.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```
    /// use keylock::{Mode, TransactionError, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let _held = table.try_lock_shared(1).unwrap();
    /// let mut txn = table.transaction();
    /// assert!(txn.lock_with(1, Mode::Shared, WaitPolicy::NoWait).await.is_ok());
    /// let err = txn.lock_with(1, Mode::Exclusive, WaitPolicy::NoWait).await.unwrap_err();
    /// assert!(matches!(err, TransactionError::Busy { key: 1, .. }), "the other reader stays");
    /// # });
    /// ```
    pub fn lock_with<'a>(
        &'a mut self,
        key: K,
        mode: Mode,
        policy: WaitPolicy,
    ) -> impl Future<Output = Result<Acquired, TransactionError<K>>> + use<'a, 't, K, S>
    where
        K: Clone,
    {
        single::lock(self.direct(), key, mode, policy)
    }

    /// Locks every requested key, each in its mode, all or nothing, under
    /// the transaction's default [`WaitPolicy`]. Duplicates are merged (the
    /// stronger mode wins); keys the transaction holds are re-entered or
    /// upgraded as [`lock`](Self::lock) would; the others are taken in a
    /// canonical order, the keys' `Ord`, that keeps multi-key lockers from
    /// deadlocking (see the [crate doc](crate#transactions); `Ord` must
    /// agree with `Eq`: a key that sorts apart from its equal is not merged
    /// with it, and the call waits for itself), every wait bounded by the
    /// transaction's deadline. Under [`WaitPolicy::SkipLocked`] it takes
    /// what it can and reports the rest in [`LockedSet::skipped`].
    ///
    /// The iterator is consumed at the call.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock), for the first key that failed; nothing of
    /// the call is then held. [`TransactionError::InFlight`] never happens
    /// here, a `Transaction`'s calls being one at a time.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropped at any await, it holds nothing it took for the
    /// call and leaves the transaction's earlier keys as they were (an
    /// upgrade it made is undone by a downgrade).
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// // A self-transfer asks the same account twice: merged, no deadlock.
    /// let got = txn.lock_all([("acct-1", Mode::Exclusive), ("acct-1", Mode::Shared)]).await?;
    /// assert_eq!(got.acquired(), 1);
    /// assert_eq!(txn.mode("acct-1"), Some(Mode::Exclusive));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_all<'a, I>(
        &'a mut self,
        requests: I,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<'a, 't, K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        let policy = self.owner.wait;
        self.lock_all_with(requests, policy)
    }

    /// Like [`lock_all`](Self::lock_all), under `policy`.
    ///
    /// # Errors
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// # Cancel safety
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// ```
    /// use keylock::{Mode, TransactionError, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let other = table.try_lock("b").unwrap();
    /// let mut txn = table.transaction();
    /// let reqs = [("a", Mode::Exclusive), ("b", Mode::Exclusive)];
    /// let err = txn.lock_all_with(reqs, WaitPolicy::NoWait).await.unwrap_err();
    /// assert!(matches!(err, TransactionError::Busy { key: "b", holder: Some(t), .. } if t == other.token()));
    /// assert!(txn.is_empty(), "all or nothing: \"a\" was let go");
    /// # });
    /// ```
    pub fn lock_all_with<'a, I>(
        &'a mut self,
        requests: I,
        policy: WaitPolicy,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<'a, 't, K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        multi::lock_all(self.direct(), few(requests), policy)
    }

    /// Takes up to `limit` of `candidates`, in the candidates' order, each
    /// only if it can be had at once, skipping the others: PostgreSQL's
    /// `SELECT … ORDER BY … LIMIT n FOR UPDATE SKIP LOCKED`, as a queue
    /// consumer uses it. A key the transaction holds in the mode asked or a
    /// stronger one counts (re-entered); one held shared and asked
    /// exclusive is upgraded if that can be done at once, else skipped
    /// (it stays shared); a key that cannot be had at once is skipped. Once
    /// `limit` keys are taken the call stops: the rest of the candidates
    /// are untouched (not tried, not listed). The [`LockedSet`] lists the
    /// keys taken and how, and the keys skipped, both in the candidates'
    /// order.
    ///
    /// No candidate is waited for, so taking them in the caller's order
    /// (rather than `lock_all`'s canonical one) cannot deadlock. Unlike
    /// `lock_all`, it is not all or nothing: each candidate is a lock of its
    /// own, as a sequence of `NOWAIT` locks would be.
    ///
    /// # Errors
    ///
    /// An error other than a candidate being taken by someone else ends
    /// the call ([`TransactionError::Lock`] for options out of range,
    /// [`TransactionError::Expired`] for an upgrade of a grant that lost
    /// its key), naming the key; the keys taken before it stay the
    /// transaction's.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it completes, the keys it took stay the
    /// transaction's (each was a lock of its own), and the candidate being
    /// tried is not taken (an upgrade stays shared).
    ///
    /// ```
    /// use keylock::{AcquireKind, Mode};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let jobs = [(1, Mode::Exclusive), (2, Mode::Exclusive), (3, Mode::Exclusive), (4, Mode::Exclusive)];
    /// let mut worker_a = table.transaction();
    /// let got = worker_a.lock_up_to(2, jobs).await?;
    /// assert_eq!(got.keys(), [(1, AcquireKind::New), (2, AcquireKind::New)]);
    /// let mut worker_b = table.transaction();
    /// let got = worker_b.lock_up_to(2, jobs).await?;
    /// assert_eq!(got.skipped(), &[1, 2]);
    /// assert_eq!(got.keys(), [(3, AcquireKind::New), (4, AcquireKind::New)]);
    /// # Ok::<(), keylock::TransactionError<i32>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_up_to<'a, I>(
        &'a mut self,
        limit: usize,
        candidates: I,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<'a, 't, K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Clone,
    {
        let candidates: Vec<(K, Mode)> = candidates.into_iter().collect();
        multi::lock_up_to(self.direct(), limit, candidates)
    }

    /// [`lock`](Self::lock), parking the thread until it completes (for
    /// plain threads; see [`LockTable::blocking_lock`] about runtimes).
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.blocking_lock(1, keylock::Mode::Exclusive).unwrap();
    /// assert!(table.is_locked(&1));
    /// ```
    pub fn blocking_lock(&mut self, key: K, mode: Mode) -> Result<Acquired, TransactionError<K>>
    where
        K: Clone,
    {
        crate::table::blocking::block_on(self.lock(key, mode))
    }

    /// [`lock_all`](Self::lock_all), parking the thread until it completes.
    ///
    /// # Errors
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// ```
    /// use keylock::Mode;
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.blocking_lock_all([(2, Mode::Shared), (1, Mode::Exclusive)]).unwrap();
    /// assert_eq!(txn.len(), 2);
    /// ```
    pub fn blocking_lock_all<I>(&mut self, requests: I) -> Result<LockedSet<K>, TransactionError<K>>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        crate::table::blocking::block_on(self.lock_all(requests))
    }

    /// Takes back one count of `key` and releases it when none is left
    /// (PostgreSQL's advisory unlock); returns the count left. The mode
    /// stays what it was (an upgraded key stays exclusive until released).
    ///
    /// # Errors
    ///
    /// [`TransactionError::NotHeld`] if the transaction does not hold `key`.
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("k", Mode::Exclusive).await?;
    /// txn.lock("k", Mode::Exclusive).await?;
    /// assert_eq!(txn.unlock(&"k")?, 1);
    /// assert!(table.is_locked("k"));
    /// assert_eq!(txn.unlock(&"k")?, 0);
    /// assert!(!table.is_locked("k"));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn unlock(&mut self, key: &K) -> Result<usize, TransactionError<K>>
    where
        K: Clone,
    {
        let hash = self.owner.reach.hash(key);
        let (left, slot) = unlock_in::<&LockTable<K, S>>(&mut self.set, hash, key, false)?;
        drop(slot);
        Ok(left)
    }

    /// Releases `key` now, whatever its count.
    ///
    /// # Errors
    ///
    /// [`TransactionError::NotHeld`] if the transaction does not hold `key`.
    ///
    /// ```
    /// use keylock::Mode;
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.blocking_lock("k", Mode::Shared).unwrap();
    /// txn.blocking_lock("k", Mode::Shared).unwrap();
    /// txn.release(&"k").unwrap();
    /// assert!(table.is_empty());
    /// ```
    pub fn release(&mut self, key: &K) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        let hash = self.owner.reach.hash(key);
        let (_, slot) = unlock_in::<&LockTable<K, S>>(&mut self.set, hash, key, true)?;
        drop(slot);
        Ok(())
    }

    /// The transaction's identity: unique in the process, carried by its
    /// grants and waits, and named by a [`Deadlock`](crate::Deadlock).
    ///
    /// ```
    /// let table = keylock::LockTable::<u32>::new();
    /// assert_ne!(table.transaction().id(), table.transaction().id());
    /// ```
    #[must_use]
    pub fn id(&self) -> crate::TransactionId {
        self.owner.opts.id
    }

    /// Detaches `key` from the transaction as a hold: the grant keeps its
    /// key, mode, token and lease, but no longer belongs to the transaction
    /// (its commit, abort or drop leave it alone, and it is never part of
    /// a deadlock cycle). Release it later through the table, by key and
    /// token ([`LockTable::release_hold`]), from any thread; with a lease,
    /// it also lapses. The transaction's re-entry count of the key goes
    /// with it. Fails with [`TransactionError::NotHeld`] if the transaction
    /// does not hold `key`, [`TransactionError::InFlight`] if a call of it
    /// is upgrading `key`, [`TransactionError::Expired`] if the grant lost
    /// the key (it is released, and no hold is made).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, Mode};
    /// let table = LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("file-3", Mode::Exclusive).await?;
    /// let hold = txn.detach(&"file-3")?;
    /// drop(txn);
    /// assert_eq!(table.holder("file-3").unwrap().token, hold.token);
    /// table.release_hold("file-3", hold.token)?;
    /// assert!(table.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn detach(&mut self, key: &K) -> Result<Hold<K>, TransactionError<K>>
    where
        K: Clone,
    {
        let hash = self.owner.reach.hash(key);
        let (_, slot) = unlock_in::<&LockTable<K, S>>(&mut self.set, hash, key, true)?;
        detach_slot::<&LockTable<K, S>>(self.owner.reach, slot, key)
    }

    /// How many keys the transaction holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// The keys the transaction holds, each with the mode it holds it in
    /// (each once, whatever its count), in no particular order.
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock_all([("a", Mode::Exclusive), ("b", Mode::Shared)]).await?;
    /// let mut keys: Vec<_> = txn.keys().collect();
    /// keys.sort();
    /// assert_eq!(keys, [(&"a", Mode::Exclusive), (&"b", Mode::Shared)]);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn keys(&self) -> impl Iterator<Item = (&K, Mode)> + use<'_, 't, K, S> {
        self.set
            .guards()
            .map(|guard| (GuardOps::key(guard), GuardOps::mode(guard)))
    }

    /// Whether the transaction holds no key.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many times the transaction holds `key` (0: not held).
    #[must_use]
    pub fn count<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        count_of::<&LockTable<K, S>, Q>(&self.set, self.owner.reach.hash(key), key).0
    }

    /// The mode the transaction holds `key` in, if it does.
    #[must_use]
    pub fn mode<Q>(&self, key: &Q) -> Option<Mode>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        count_of::<&LockTable<K, S>, Q>(&self.set, self.owner.reach.hash(key), key).1
    }

    /// The fencing token of the transaction's grant of `key`, if it holds
    /// it.
    #[must_use]
    pub fn token<Q>(&self, key: &Q) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        count_of::<&LockTable<K, S>, Q>(&self.set, self.owner.reach.hash(key), key).2
    }

    /// The commit-time fence for the whole transaction: `Ok` only if every
    /// grant still holds its key (no lease lapsed, none revoked), judged
    /// now.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Expired`] naming the first key found lost.
    pub fn check(&self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        single::first_lost(&self.set, &mut single::Settled::new(), |guard| {
            guard.key().clone()
        })
        .map_or(Ok(()), Err)
    }

    /// Renews every grant's lease (with the transaction's lease, else the
    /// table's default; with neither, only checks), all or nothing: if one
    /// grant has lost its key, none is renewed and the error names it.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Expired`] naming the key that was lost.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keylock::{Mode, TransactionError, TransactionOptions};
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction_with(TransactionOptions::new().lease(Duration::from_secs(60)));
    /// txn.blocking_lock("a", Mode::Exclusive).unwrap();
    /// txn.blocking_lock("b", Mode::Exclusive).unwrap();
    /// txn.renew().unwrap();
    /// table.revoke("b");
    /// let err = txn.renew().unwrap_err();
    /// assert!(matches!(err, TransactionError::Expired { key: "b", .. }));
    /// ```
    pub fn renew(&self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        single::renew::<&LockTable<K, S>, _>(
            &self.set,
            renewal_lease(&self.owner),
            &mut single::Settled::new(),
            |guard| guard.key().clone(),
        )
    }

    /// Releases every key, each checked as it goes (one visit to the table
    /// per key, [`Guard::release_checked`]): `Ok` only if every grant still
    /// held its key when it let go, so the transaction's work may be made
    /// durable only then.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Expired`] naming a key whose grant had been lost
    /// (lapsed or revoked); every key is released all the same.
    #[inline]
    pub fn commit(mut self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        // In place: the set is not moved out of the transaction.
        let no_calls = self.calls_own_nothing();
        let lost = if no_calls {
            // Nothing to cancel: a panic in the release (a key's drop, a
            // handoff's wake) unwinds through the drop, which releases the
            // rest of the set.
            held::release_checked(&mut self.set)
        } else {
            self.release_then_cancel()
        };
        // Either way the set was released (`release_checked` empties it).
        if no_calls
            && self.set.owns_nothing_released()
            && self.set.waits == 0
            && self.owner.owns_nothing()
        {
            // Nothing left to release or free: skip the drop glue.
            std::mem::forget(self);
        }
        // Made here, once the transaction is gone: built in the caller's
        // place, not moved there.
        held::lost_to_result(lost)
    }

    /// A commit's release when a forgotten call left something to cancel:
    /// a panic in the release is caught, so that the drop cancels the
    /// calls as an abort would, not while unwinding; then it goes on to
    /// the caller.
    #[cold]
    fn release_then_cancel(&mut self) -> Option<(K, FencingToken)>
    where
        K: Clone,
    {
        match catch_unwind(AssertUnwindSafe(|| held::release_checked(&mut self.set))) {
            Ok(lost) => lost,
            Err(payload) => {
                // Its own panic, if any, is dropped: the first goes on.
                drop(catch_unwind(AssertUnwindSafe(|| self.end_now())));
                resume_unwind(payload)
            }
        }
    }

    /// Whether no forgotten call left anything: no pending call's cell, no
    /// memory of the list's, no parked wait. With the set's and the
    /// owner's `owns_nothing`, every field that owns something is asked
    /// before a commit skips the drop glue.
    #[inline]
    fn calls_own_nothing(&self) -> bool {
        let Self {
            owner: _,
            set: _,
            pending,
            parked,
        } = self;
        !pending.spilled() && pending.is_empty() && parked.is_empty()
    }

    /// Releases every key the transaction holds; the same as dropping it.
    pub fn abort(self) {
        drop(self);
    }
}

impl<K, S> fmt::Debug for Transaction<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction")
            .field("opts", &self.owner.opts)
            .finish_non_exhaustive()
    }
}

impl<K: Eq + Hash + 'static, S: BuildHasher + 'static> OwnedTransaction<K, S> {
    fn owner(&self) -> &Owner<Pinned<K, S>> {
        self.shared.owner()
    }

    /// The table this transaction locks keys of.
    #[must_use]
    pub fn table(&self) -> &Arc<LockTable<K, S>> {
        self.owner().reach.arc()
    }

    /// The deadline every lock of the transaction waits until at most.
    #[must_use]
    pub fn deadline(&self) -> Option<Instant> {
        self.owner().opts.deadline
    }

    /// As [`Transaction::lock`]; the future is `'static` (it holds an `Arc`
    /// of the transaction's state) and may run on any task. Ending the
    /// transaction while it is pending releases what the call got (the end
    /// does, at once) and makes it fail with [`TransactionError::Ended`].
    ///
    /// # Errors
    ///
    /// As [`Transaction::lock`], and [`TransactionError::InFlight`] if
    /// another pending call of the transaction is locking the same key,
    /// [`TransactionError::Ended`] if the transaction ended.
    ///
    /// # Cancel safety
    ///
    /// As [`Transaction::lock`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.lock("k", Mode::Shared).await?;
    /// txn.lock("k", Mode::Exclusive).await?; // upgraded
    /// assert_eq!(txn.mode("k"), Some(Mode::Exclusive));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock(
        &self,
        key: K,
        mode: Mode,
    ) -> impl Future<Output = Result<Acquired, TransactionError<K>>> + use<K, S>
    where
        K: Clone,
    {
        let policy = self.owner().wait;
        self.lock_with(key, mode, policy)
    }

    /// As [`lock`](Self::lock), under `policy`.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// # Cancel safety
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::{Mode, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.lock_with(3, Mode::Exclusive, WaitPolicy::NoWait).await?;
    /// # Ok::<(), keylock::TransactionError<i32>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_with(
        &self,
        key: K,
        mode: Mode,
        policy: WaitPolicy,
    ) -> impl Future<Output = Result<Acquired, TransactionError<K>>> + use<K, S>
    where
        K: Clone,
    {
        single::lock(Arc::clone(&self.shared), key, mode, policy)
    }

    /// As [`Transaction::lock_all`]; the future is `'static` if the
    /// iterator's type is (it is consumed at the call: pass a collection).
    ///
    /// # Errors
    ///
    /// As [`Transaction::lock_all`], and [`TransactionError::InFlight`] if
    /// another pending call of the transaction is locking one of the keys,
    /// [`TransactionError::Ended`] if the transaction ended.
    ///
    /// # Cancel safety
    ///
    /// As [`Transaction::lock_all`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.lock_all(vec![(1, Mode::Exclusive), (2, Mode::Shared)]).await?;
    /// assert_eq!(txn.len(), 2);
    /// # Ok::<(), keylock::TransactionError<i32>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_all<I>(
        &self,
        requests: I,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        let policy = self.owner().wait;
        self.lock_all_with(requests, policy)
    }

    /// As [`lock_all`](Self::lock_all), under `policy`.
    ///
    /// # Errors
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// # Cancel safety
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::{Mode, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(keylock::LockTable::new());
    /// let _other = table.try_lock(2).unwrap();
    /// let txn = table.clone().transaction_owned();
    /// let got = txn.lock_all_with(vec![(1, Mode::Exclusive), (2, Mode::Exclusive)], WaitPolicy::SkipLocked).await?;
    /// assert_eq!(got.skipped(), &[2]);
    /// # Ok::<(), keylock::TransactionError<i32>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_all_with<I>(
        &self,
        requests: I,
        policy: WaitPolicy,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        multi::lock_all(Arc::clone(&self.shared), few(requests), policy)
    }

    /// As [`Transaction::lock_up_to`]; the future is `'static` (the
    /// candidates are collected at the call).
    ///
    /// # Errors
    ///
    /// As [`Transaction::lock_up_to`], and [`TransactionError::InFlight`]
    /// if another pending call of the transaction is locking a candidate,
    /// [`TransactionError::Ended`] if the transaction ended.
    ///
    /// # Cancel safety
    ///
    /// As [`Transaction::lock_up_to`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(keylock::LockTable::new());
    /// let _taken = table.try_lock("job-1").unwrap();
    /// let txn = table.clone().transaction_owned();
    /// let jobs = vec![("job-1", Mode::Exclusive), ("job-2", Mode::Exclusive), ("job-3", Mode::Exclusive)];
    /// let got = txn.lock_up_to(1, jobs).await?;
    /// assert_eq!(got.skipped(), &["job-1"]);
    /// assert_eq!(txn.len(), 1);
    /// assert!(!table.is_locked("job-3"));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    pub fn lock_up_to<I>(
        &self,
        limit: usize,
        candidates: I,
    ) -> impl Future<Output = Result<LockedSet<K>, TransactionError<K>>> + use<K, S, I>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Clone,
    {
        let candidates: Vec<(K, Mode)> = candidates.into_iter().collect();
        multi::lock_up_to(Arc::clone(&self.shared), limit, candidates)
    }

    /// [`lock`](Self::lock), parking the thread until it completes.
    ///
    /// # Errors
    ///
    /// As [`lock`](Self::lock).
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.blocking_lock(1, keylock::Mode::Exclusive).unwrap();
    /// assert!(table.is_locked(&1));
    /// ```
    pub fn blocking_lock(&self, key: K, mode: Mode) -> Result<Acquired, TransactionError<K>>
    where
        K: Clone,
    {
        crate::table::blocking::block_on(self.lock(key, mode))
    }

    /// [`lock_all`](Self::lock_all), parking the thread until it completes.
    ///
    /// # Errors
    ///
    /// As [`lock_all`](Self::lock_all).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::Mode;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.blocking_lock_all([(1, Mode::Exclusive), (1, Mode::Shared)]).unwrap();
    /// assert_eq!(txn.count(&1), 1);
    /// ```
    pub fn blocking_lock_all<I>(&self, requests: I) -> Result<LockedSet<K>, TransactionError<K>>
    where
        I: IntoIterator<Item = (K, Mode)>,
        K: Ord + Clone,
    {
        crate::table::blocking::block_on(self.lock_all(requests))
    }

    /// As [`Transaction::unlock`].
    ///
    /// # Errors
    ///
    /// [`TransactionError::NotHeld`] if the transaction does not hold `key`;
    /// [`TransactionError::InFlight`] if a pending call is upgrading or
    /// counting it; [`TransactionError::Ended`] once it ended.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.blocking_lock(1, keylock::Mode::Exclusive).unwrap();
    /// assert_eq!(txn.unlock(&1), Ok(0));
    /// assert!(table.is_empty());
    /// ```
    pub fn unlock(&self, key: &K) -> Result<usize, TransactionError<K>>
    where
        K: Clone,
    {
        self.unlock_impl(key, false)
    }

    /// As [`Transaction::release`].
    ///
    /// # Errors
    ///
    /// As [`unlock`](Self::unlock).
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.blocking_lock(1, keylock::Mode::Exclusive).unwrap();
    /// txn.blocking_lock(1, keylock::Mode::Exclusive).unwrap();
    /// txn.release(&1).unwrap();
    /// assert!(table.is_empty());
    /// ```
    pub fn release(&self, key: &K) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        self.unlock_impl(key, true).map(drop)
    }

    fn unlock_impl(&self, key: &K, all: bool) -> Result<usize, TransactionError<K>>
    where
        K: Clone,
    {
        let hash = self.owner().reach.table().hash(key);
        let unlocked = self
            .shared
            .with(|set| set.unlock(hash, key, all))
            .map_err(|_| TransactionError::Ended)?;
        // The slot (its guard releases the key) drops after unlocking, and
        // the error's key is cloned then.
        let (left, slot) = unlocked.map_err(|why| not_released(why, key))?;
        drop(slot);
        Ok(left)
    }

    fn query<Q, T>(
        &self,
        key: &Q,
        pick: impl FnOnce((usize, Option<Mode>, Option<FencingToken>)) -> T,
    ) -> Option<T>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.owner().reach.table().hash(key);
        self.shared
            .with(|set| pick(count_of::<Pinned<K, S>, Q>(set, hash, key)))
            .ok()
    }

    /// As [`Transaction::detach`]; [`TransactionError::Ended`] once the
    /// transaction ended.
    pub fn detach(&self, key: &K) -> Result<Hold<K>, TransactionError<K>>
    where
        K: Clone,
    {
        let hash = self.owner().reach.table().hash(key);
        let (_, slot) = self
            .shared
            .with(|set| set.unlock(hash, key, true))
            .map_err(|_| TransactionError::Ended)?
            .map_err(|why| not_released(why, key))?;
        detach_slot::<Pinned<K, S>>(self.owner().reach.table(), slot, key)
    }

    /// The transaction's identity (see [`Transaction::id`]).
    #[must_use]
    pub fn id(&self) -> crate::TransactionId {
        self.owner().opts.id
    }

    /// How many keys the transaction holds (0 once it ended).
    #[must_use]
    pub fn len(&self) -> usize {
        self.shared.with(|set| set.len()).unwrap_or(0)
    }

    /// The keys the transaction holds, each with its mode, as
    /// [`Transaction::keys`] lists them, cloned (the set is shared with
    /// pending calls); a key a pending call has away (being upgraded) is
    /// not listed, and none once the transaction ended.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::Mode;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let txn = table.clone().transaction_owned();
    /// txn.blocking_lock(7, Mode::Shared).unwrap();
    /// assert_eq!(txn.keys(), [(7, Mode::Shared)]);
    /// ```
    #[must_use]
    pub fn keys(&self) -> Vec<(K, Mode)>
    where
        K: Clone,
    {
        // Each key's entry is pinned under the set's lock and the key cloned
        // after it (user code: a key's `Clone` may call back into the
        // transaction); the pins go as the list is made.
        let table = self.owner().reach.table();
        let pinned: Vec<_> = self
            .shared
            .with(|set| {
                set.guards()
                    .map(|guard| (table.pin_key(guard), GuardOps::mode(guard)))
                    .collect()
            })
            .unwrap_or_default();
        pinned
            .iter()
            .map(|(key, mode)| (key.key().clone(), *mode))
            .collect()
    }

    /// Whether the transaction holds no key.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// As [`Transaction::count`].
    #[must_use]
    pub fn count<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.query(key, |(count, _, _)| count).unwrap_or(0)
    }

    /// As [`Transaction::mode`] (`None` too while a pending call upgrades
    /// it).
    #[must_use]
    pub fn mode<Q>(&self, key: &Q) -> Option<Mode>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.query(key, |(_, mode, _)| mode).flatten()
    }

    /// As [`Transaction::token`] (`None` too while a pending call upgrades
    /// it).
    #[must_use]
    pub fn token<Q>(&self, key: &Q) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.query(key, |(_, _, token)| token).flatten()
    }

    /// As [`Transaction::check`] (keys a pending call has away are not
    /// checked).
    ///
    /// # Errors
    ///
    /// As [`Transaction::check`], and [`TransactionError::Ended`].
    pub fn check(&self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        // What the checks settle is woken after the set's lock is released.
        let mut settled = single::Settled::new();
        // A lost key is named by a pin, cloned after the lock is released.
        let table = self.owner().reach.table();
        let checked = self.shared.with(|set| {
            single::first_lost(set, &mut settled, |guard| table.pin_key(guard)).map_or(Ok(()), Err)
        });
        drop(settled);
        checked
            .map_err(|_| TransactionError::Ended)?
            .map_err(|error| error.map_key(|pinned| pinned.key().clone()))
    }

    /// As [`Transaction::renew`].
    ///
    /// # Errors
    ///
    /// As [`Transaction::renew`], and [`TransactionError::Ended`].
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use keylock::{Mode, TransactionOptions};
    /// let table = Arc::new(keylock::LockTable::new());
    /// let opts = TransactionOptions::new().lease(Duration::from_secs(60));
    /// let txn = table.clone().transaction_owned_with(opts);
    /// txn.blocking_lock("a", Mode::Exclusive).unwrap();
    /// txn.renew().unwrap();
    /// ```
    pub fn renew(&self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        let lease = renewal_lease(self.owner());
        // What the renewals settle is woken after the set's lock is released.
        let mut settled = single::Settled::new();
        // A lost key is named by a pin, cloned after the lock is released.
        let table = self.owner().reach.table();
        let renewed = self.shared.with(|set| {
            single::renew::<Pinned<K, S>, _>(set, lease, &mut settled, |guard| table.pin_key(guard))
        });
        drop(settled);
        renewed
            .map_err(|_| TransactionError::Ended)?
            .map_err(|error| error.map_key(|pinned| pinned.key().clone()))
    }

    /// As [`Transaction::commit`]: ends the transaction, releasing every
    /// key checked. A key a pending call has away (an upgrade in flight, a
    /// `lock_all`'s keys) is released by the end too, unjudged.
    ///
    /// # Errors
    ///
    /// As [`Transaction::commit`]; [`TransactionError::Ended`] if it had
    /// already ended (it cannot: commit takes the handle).
    pub fn commit(self) -> Result<(), TransactionError<K>>
    where
        K: Clone,
    {
        self.shared
            .end_with(held::release_checked)
            .map_or(Err(TransactionError::Ended), held::lost_to_result)
    }

    /// Ends the transaction, releasing every key; the same as dropping it.
    pub fn abort(self) {
        drop(self);
    }
}

impl<K: Eq + Hash + 'static, S: BuildHasher + 'static> Drop for OwnedTransaction<K, S> {
    fn drop(&mut self) {
        self.shared.end();
    }
}

impl<K: Eq + Hash + 'static, S: BuildHasher + 'static> fmt::Debug for OwnedTransaction<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedTransaction")
            .field("opts", &self.owner().opts)
            .finish_non_exhaustive()
    }
}
