//! Many keys at once: a transaction's all-or-nothing `lock_all`.
//!
//! # The order
//!
//! The requests are sorted by the key's `Ord` (the order a user sorts plain
//! guards in by hand, so a program that mixes both cannot deadlock between
//! them; and keys asked in order, a range or a scan, are sorted in one pass
//! over them), and a key asked twice is asked once, in the stronger mode.
//! `Ord` must agree with `Eq`, as for any sorted collection: a key that
//! sorts apart from its equal is not merged with it, and the call then
//! waits for itself. When every key is new or covered and
//! every new one can be had at once, they are taken in that order and put
//! into the set in one step (at the version of the set the call looked at).
//! Otherwise every key is claimed in the held set, and the keys that need
//! the table (new ones, and held shared ones asked exclusive: upgrades) are
//! taken one by one in that order (keeping the ones already taken), each
//! waiting at most until the transaction's deadline.
//!
//! # Why it does not deadlock
//!
//! Say a transaction is *ascending* if each of its waits is for a key not
//! below (in this order) any key it holds: a new key above all it holds,
//! or an upgrade of the highest it holds. A `lock_all` of a transaction
//! that held nothing before, or only keys below (or equal to) the ones it
//! asks, is ascending throughout. Among ascending transactions no cycle of
//! waits can form. Follow a wait from `T` (waiting for key `k`) to a
//! transaction `U` it waits behind: `U` holds `k`, or is queued ahead of
//! `T` on `k`. If `U` holds `k` and waits, it waits for a key `k' > k`, or
//! upgrades `k` itself (`k' = k`). If `U` is queued on `k` it waits for
//! `k' = k`. So keys never decrease along a chain of waits, and a cycle
//! would have to stay on one key `k`. On one key, the queue is FIFO and its
//! waiters wait only for the holders, and a holder waiting on `k` is
//! upgrading: an upgrade waits only for the *other shared holders*, ahead of
//! every queued waiter, and a second upgrader of the key is refused at once
//! by the table ([`LockError::UpgradeConflict`](crate::LockError)). So a
//! cycle would need two upgraders of one key, which cannot exist.
//!
//! A transaction that locks keys one at a time out of this order, or asks a
//! `lock_all` for keys below ones it already holds, is not covered: give
//! it a deadline ([`TransactionOptions::timeout`](crate::TransactionOptions)).
//!
//! # All or nothing, and cancellation
//!
//! What the call takes stays in a [`Stage`] until every key is had: then it
//! all goes into the set at once (no user code runs there, so that cannot
//! fail halfway). If a key fails, or the future is dropped at any await, or
//! a key's `Eq`/`Hash`/`Ord` panics, the stage undoes the call: new keys
//! are released, upgrades it made are undone by a downgrade (the grant is
//! shared again, as before the call, under the token the upgrade gave it),
//! and keys it only counted are left as they were.

use std::future::Future;
use std::mem;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::support::lease::Terms;
use crate::support::mode::Mode;
use crate::support::recycle::Recycled;
use crate::transactions::access::{
    wait_unless_ended, Access, Ended, Holding, LockOf, PendingOf, Stop, UpgradingOf, WaitFor,
};
use crate::transactions::access::{GuardOf, KeyOf, Owner, SetOf};
use crate::transactions::error::TransactionError;
use crate::transactions::fresh::FreshWait;
use crate::transactions::held::{AcquireKind, Begin, Found, HeldSet, UNINDEXED_MAX};
use crate::transactions::pending::{self, Taken, Wait, Waited};
use crate::transactions::policy::WaitPolicy;
use crate::transactions::reach::{GuardOps, Reach};
use crate::transactions::single;
use crate::transactions::Few;
use crate::LockError;

/// What a [`lock_all`](crate::Transaction::lock_all) or a
/// [`lock_up_to`](crate::Transaction::lock_up_to) did: how many keys it
/// took, re-entered and upgraded; the keys it took and how, and the keys
/// it skipped, when it may take fewer keys than asked
/// ([`WaitPolicy::SkipLocked`], `lock_up_to`).
///
/// ```
/// use keylock::{AcquireKind, Mode, TransactionOptions, WaitPolicy};
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let _other = table.try_lock(2).unwrap();
/// let mut txn = table.transaction_with(TransactionOptions::new().wait(WaitPolicy::SkipLocked));
/// let got = txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive), (3, Mode::Shared)]).await?;
/// assert_eq!(got.acquired(), 2);
/// assert_eq!(got.skipped(), &[2]);
/// let mut keys: Vec<_> = got.keys().to_vec();
/// keys.sort_by_key(|&(key, _)| key);
/// assert_eq!(keys, [(1, AcquireKind::New), (3, AcquireKind::New)]);
/// assert_eq!(txn.len(), 2);
/// # Ok::<(), keylock::TransactionError<i32>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct LockedSet<K> {
    acquired: usize,
    reentered: usize,
    upgraded: usize,
    /// The skipped keys and the keys listed, boxed and made only when one
    /// of them has something: the common result (counts only) is four
    /// words, cheap to build, move and drop. `None` reads as both empty.
    lists: Option<Box<Lists<K>>>,
}

/// A [`LockedSet`]'s lists, when it has any.
#[derive(Clone)]
struct Lists<K> {
    skipped: Vec<K>,
    keys: Vec<(K, AcquireKind)>,
}

impl<K: std::fmt::Debug> std::fmt::Debug for LockedSet<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // As the derived form over the fields the set had before its lists
        // were boxed.
        f.debug_struct("LockedSet")
            .field("acquired", &self.acquired)
            .field("reentered", &self.reentered)
            .field("upgraded", &self.upgraded)
            .field("skipped", &self.skipped())
            .field("keys", &self.keys())
            .finish()
    }
}

impl<K: PartialEq> PartialEq for LockedSet<K> {
    fn eq(&self, other: &Self) -> bool {
        // Lists compared as slices: no lists equals empty ones.
        self.acquired == other.acquired
            && self.reentered == other.reentered
            && self.upgraded == other.upgraded
            && self.skipped() == other.skipped()
            && self.keys() == other.keys()
    }
}

impl<K: Eq> Eq for LockedSet<K> {}

impl<K> LockedSet<K> {
    fn new(skipped: Vec<K>) -> Self {
        let mut set = Self::counted(0, 0);
        if !skipped.is_empty() {
            set.lists = Some(Box::new(Lists {
                skipped,
                keys: Vec::new(),
            }));
        }
        set
    }

    /// A result with counts only (no list).
    #[inline]
    pub(crate) fn counted(acquired: usize, reentered: usize) -> Self {
        Self {
            acquired,
            reentered,
            upgraded: 0,
            lists: None,
        }
    }

    /// The lists, made if there are none yet.
    fn lists_mut(&mut self) -> &mut Lists<K> {
        self.lists.get_or_insert_with(|| {
            Box::new(Lists {
                skipped: Vec::new(),
                keys: Vec::new(),
            })
        })
    }

    /// The skipped keys, to add to.
    fn skipped_mut(&mut self) -> &mut Vec<K> {
        &mut self.lists_mut().skipped
    }

    /// The keys listed, to add to.
    fn keys_mut(&mut self) -> &mut Vec<(K, AcquireKind)> {
        &mut self.lists_mut().keys
    }

    /// Counts one key got `kind`-wise.
    fn count(&mut self, kind: AcquireKind) {
        match kind {
            AcquireKind::New => self.acquired += 1,
            AcquireKind::Reentered => self.reentered += 1,
            AcquireKind::Upgraded => self.upgraded += 1,
        }
    }

    /// How many keys the call took that the transaction did not hold.
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("a", Mode::Exclusive).await?;
    /// let got = txn.lock_all([("a", Mode::Exclusive), ("b", Mode::Exclusive)]).await?;
    /// assert_eq!((got.acquired(), got.reentered()), (1, 1));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn acquired(&self) -> usize {
        self.acquired
    }

    /// How many keys the transaction already held in a covering mode (each
    /// counted once more, as a re-entrant lock would).
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("a", Mode::Exclusive).await?;
    /// let got = txn.lock_all([("a", Mode::Shared)]).await?;
    /// assert_eq!(got.reentered(), 1);
    /// assert_eq!(txn.count("a"), 2);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn reentered(&self) -> usize {
        self.reentered
    }

    /// How many held shared keys the call upgraded to exclusive.
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("a", Mode::Shared).await?;
    /// let got = txn.lock_all([("a", Mode::Exclusive)]).await?;
    /// assert_eq!(got.upgraded(), 1);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn upgraded(&self) -> usize {
        self.upgraded
    }

    /// The keys skipped because they could not be had at once
    /// ([`WaitPolicy::SkipLocked`], and
    /// [`lock_up_to`](crate::Transaction::lock_up_to); a skipped upgrade
    /// leaves its key held shared): for a `lock_all`, in the canonical
    /// order (see the module doc), not the caller's; for `lock_up_to`, in
    /// the candidates' order.
    ///
    /// ```
    /// use keylock::{Mode, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let _other = table.try_lock("b").unwrap();
    /// let mut txn = table.transaction();
    /// let got = txn.lock_all_with([("a", Mode::Exclusive), ("b", Mode::Exclusive)], WaitPolicy::SkipLocked).await?;
    /// assert_eq!(got.skipped(), &["b"]);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn skipped(&self) -> &[K] {
        self.lists.as_ref().map_or(&[], |lists| &lists.skipped)
    }

    /// The skipped keys, by value.
    ///
    /// ```
    /// use keylock::Mode;
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let _other = table.try_lock(2).unwrap();
    /// let mut txn = table.transaction();
    /// let got = txn.lock_up_to(5, [(1, Mode::Exclusive), (2, Mode::Exclusive)]).await?;
    /// assert_eq!(got.into_skipped(), vec![2]);
    /// # Ok::<(), keylock::TransactionError<i32>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn into_skipped(self) -> Vec<K> {
        self.lists.map_or_else(Vec::new, |lists| lists.skipped)
    }

    /// The keys the call took, each with how it got it (taken new,
    /// re-entered, upgraded), in the order it took them: the canonical
    /// order for a `lock_all` (see the module doc), the candidates' order
    /// for [`lock_up_to`](crate::Transaction::lock_up_to).
    ///
    /// Listed by the calls that may take fewer keys than asked: a
    /// `lock_all` under [`WaitPolicy::SkipLocked`], and `lock_up_to`.
    /// Under the other policies a `lock_all` takes every requested key or
    /// fails, so its requests are the list, and it leaves this empty (it
    /// clones no key to make it).
    ///
    /// ```
    /// use keylock::{AcquireKind, Mode, WaitPolicy};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("held", Mode::Shared).await?;
    /// let got = txn
    ///     .lock_all_with([("held", Mode::Exclusive), ("new", Mode::Shared)], WaitPolicy::SkipLocked)
    ///     .await?;
    /// let mut keys = got.keys().to_vec();
    /// keys.sort_by_key(|&(key, _)| key);
    /// assert_eq!(keys, [("held", AcquireKind::Upgraded), ("new", AcquireKind::New)]);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn keys(&self) -> &[(K, AcquireKind)] {
        self.lists.as_ref().map_or(&[], |lists| &lists.keys)
    }

    /// The keys taken (as [`keys`](Self::keys) lists them) and the keys
    /// skipped, by value.
    ///
    /// ```
    /// use keylock::{AcquireKind, Mode};
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let _other = table.try_lock("job-1").unwrap();
    /// let mut txn = table.transaction();
    /// let got = txn.lock_up_to(1, [("job-1", Mode::Exclusive), ("job-2", Mode::Exclusive)]).await?;
    /// let (taken, skipped) = got.into_parts();
    /// assert_eq!(taken, [("job-2", AcquireKind::New)]);
    /// assert_eq!(skipped, ["job-1"]);
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn into_parts(self) -> (Vec<(K, AcquireKind)>, Vec<K>) {
        self.lists.map_or_else(
            || (Vec::new(), Vec::new()),
            |lists| (lists.keys, lists.skipped),
        )
    }
}

/// One request, once hashed.
pub(crate) struct Request<K> {
    pub(crate) hash: u64,
    /// Moved into the table when the key is locked.
    pub(crate) key: Option<K>,
    pub(crate) mode: Mode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Covered,
    Upgrade,
    New,
}

/// What the call has of one request.
struct Staged<G> {
    hash: u64,
    id: u64,
    kind: Kind,
    /// A new key's guard once granted, or the held guard being upgraded.
    guard: Option<G>,
    /// This call upgraded `guard`: undone by a downgrade.
    upgraded: bool,
    skipped: bool,
}

/// Everything the call claimed; undoes it when dropped unless finished.
struct Stage<'a, A: Access> {
    access: &'a mut A,
    entries: Few<Staged<GuardOf<A>>>,
    /// The cell (`pending.rs`) that has the call's wait and every guard of
    /// `entries` while the call waits, so that the transaction's end
    /// releases them even if the call's future is forgotten; made at the
    /// first wait.
    away: Option<Arc<PendingOf<A::R>>>,
    /// The entry whose guard the waiting upgrade in `away` owns.
    upgrading: Option<usize>,
    done: bool,
}

impl<A: Access> Stage<'_, A> {
    /// Before a wait: puts `wait` and every guard of the entries into the
    /// cell (made, and put on the transaction's list, the first time);
    /// `Err` if the transaction ended (they were released).
    fn stow(
        &mut self,
        wait: Wait<LockOf<A>, UpgradingOf<A>>,
    ) -> Result<Arc<PendingOf<A::R>>, Ended> {
        let cell = match &self.away {
            Some(cell) => Arc::clone(cell),
            None => {
                let cell = PendingOf::<A::R>::new();
                self.access.pend(&cell)?;
                self.away = Some(Arc::clone(&cell));
                cell
            }
        };
        cell.start(wait).map_err(|_| Ended)?;
        let guards = self
            .entries
            .iter_mut()
            .enumerate()
            .filter_map(|(i, entry)| entry.guard.take().map(|guard| (i, guard)));
        cell.stow(guards).map_err(|_| Ended)?;
        Ok(cell)
    }

    /// After a wait: the guards back from the cell; `Err` if the
    /// transaction ended meanwhile (they were released).
    fn unstow(&mut self) -> Result<(), Ended> {
        let Some(cell) = &self.away else {
            return Ok(());
        };
        for (i, guard) in cell.unstow().map_err(|_| Ended)? {
            self.entries[i].guard = Some(guard);
        }
        Ok(())
    }

    /// The error for request `i`, undoing its claim to get the key's name.
    fn fail(
        &mut self,
        i: usize,
        mode: Mode,
        waited: bool,
        error: LockError,
    ) -> TransactionError<KeyOf<A>> {
        let entry = &mut self.entries[i];
        let (hash, id, guard) = (entry.hash, entry.id, entry.guard.take());
        // Its claim ends here; the others are undone when the stage drops.
        entry.kind = Kind::Covered;
        entry.upgraded = false;
        let name = self.access.with(|set| set.abandon(hash, id, guard));
        match name {
            Ok((Some(key), rest)) => {
                drop(rest);
                TransactionError::from_lock(key, mode, waited, error)
            }
            Ok((None, _)) | Err(Ended) => TransactionError::Ended,
        }
    }

    /// Puts everything into the set at once; with `record`, lists the
    /// keys taken (a covered key's name is its request's, the others' the
    /// claim's copy).
    fn finish(
        mut self,
        requests: &mut [Request<KeyOf<A>>],
        record: bool,
    ) -> Result<LockedSet<KeyOf<A>>, TransactionError<KeyOf<A>>> {
        self.done = true;
        // The cell is empty now (every wait over, every guard back): off
        // the transaction's list.
        if let Some(cell) = self.away.take() {
            self.access.unpend(&cell);
        }
        let mut entries = mem::take(&mut self.entries);
        let mut out = LockedSet::new(Vec::new());
        debug_assert!(self.upgrading.is_none(), "no wait in flight");
        let mut names: Few<_> = Few::new();
        let mut rest: Few<_> = Few::new();
        let finished = self.access.with(|set| {
            for (j, entry) in entries.iter_mut().enumerate() {
                let guard = entry.guard.take();
                if entry.skipped {
                    let (name, guard) = set.abandon(entry.hash, entry.id, guard);
                    if let Some(name) = name {
                        out.skipped_mut().push(name);
                    }
                    rest.push(guard);
                    continue;
                }
                let kind = match entry.kind {
                    Kind::Covered => AcquireKind::Reentered,
                    Kind::Upgrade => AcquireKind::Upgraded,
                    Kind::New => AcquireKind::New,
                };
                match set.settle(entry.hash, entry.id, guard, kind) {
                    Ok((_, name)) => {
                        out.count(kind);
                        if !record {
                            names.push(name);
                            continue;
                        }
                        let key = match kind {
                            AcquireKind::Reentered => requests[j].key.take(),
                            AcquireKind::New | AcquireKind::Upgraded => name,
                        };
                        if let Some(key) = key {
                            out.keys_mut().push((key, kind));
                        }
                    }
                    Err(guard) => rest.push(guard),
                }
            }
        });
        // After unlocking: the keys' clones, and (had the transaction
        // ended) every guard of the call, released.
        drop(names);
        drop(rest);
        drop(entries);
        match finished {
            Ok(()) => Ok(out),
            Err(Ended) => Err(TransactionError::Ended),
        }
    }
}

impl<A: Access> Drop for Stage<'_, A> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Everything the cell has comes back first (its wait goes, a
        // waiting upgrade's guard comes back shared), unless the
        // transaction's end cancelled it (then it was all released).
        // A panic in any step (a wake as the wait goes, a key's drop) is
        // held until the claims are given back.
        let mut panicked = None;
        if let Some(cell) = self.away.take() {
            let recovered = catch_unwind(AssertUnwindSafe(|| {
                cell.recover(GuardOf::<A>::upgrade_undone)
            }));
            match recovered {
                Ok(Some((guards, upgraded))) => {
                    for (i, guard) in guards {
                        self.entries[i].guard = Some(guard);
                    }
                    if let (Some(i), Some(guard)) = (self.upgrading, upgraded) {
                        self.entries[i].guard = Some(guard);
                    }
                }
                Ok(None) => {}
                Err(payload) => panicked = Some(payload),
            }
            self.access.unpend(&cell);
        }
        let mut entries = mem::take(&mut self.entries);
        // Outside the set's lock (a downgrade wakes waiters): the upgrades
        // this call made become shared again. A waker that panics there
        // (user code, run as the downgrade returns) must not keep the rest
        // from being undone and the claims from being given back: its panic
        // is held until then (the guard is shared already: the table sets
        // its mode under the shard lock).
        for entry in &mut entries {
            if entry.upgraded {
                if let Some(guard) = entry.guard.as_mut() {
                    // A grant that lost its key has nothing to undo.
                    let undo = catch_unwind(AssertUnwindSafe(|| {
                        let _ = guard.downgrade();
                    }));
                    if let Err(payload) = undo {
                        panicked.get_or_insert(payload);
                    }
                }
            }
        }
        let mut leftovers: Few<_> = Few::new();
        let _ = self.access.with(|set| {
            for entry in &mut entries {
                leftovers.push(set.abandon(entry.hash, entry.id, entry.guard.take()));
            }
        });
        // After unlocking: new keys' guards (released), keys' clones, and,
        // had the transaction ended, every guard of the call.
        drop(leftovers);
        drop(entries);
        // Resumed once everything is given back (swallowed if this drop runs
        // during an unwind already, where a second panic would abort).
        if let Some(payload) = panicked {
            if !std::thread::panicking() {
                resume_unwind(payload);
            }
        }
    }
}

/// Whether a failed lock under a policy that does not wait only found the
/// key taken (skip it), rather than something wrong (fail the call).
fn is_taken(error: &LockError) -> bool {
    matches!(
        error,
        LockError::Timeout { .. } | LockError::UpgradeConflict { .. }
    )
}

/// Sorts the requests into the canonical order (by key) and merges
/// duplicates (the stronger mode wins), where they are: keys asked in
/// order (a range, a scan) are sorted in one pass over them.
fn sort_and_merge<K: Ord>(requests: &mut Few<(K, Mode)>) {
    // Keys asked in strictly increasing order (a range, a scan) are sorted
    // and distinct already: one pass, and nothing to merge.
    if requests.is_sorted_by(|a, b| a.0 < b.0) {
        return;
    }
    requests.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    requests.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 = kept.1.max(later.1);
        }
        same
    });
}

/// The requests in the canonical order, merged ([`sort_and_merge`]), each
/// with the table's hash of its key.
fn order<R: Reach>(reach: &R, requests: &mut Few<(R::Key, Mode)>) -> Few<Request<R::Key>>
where
    R::Key: Ord,
{
    sort_and_merge(requests);
    let table = reach.table();
    requests
        .drain(..)
        .map(|(key, mode)| Request {
            hash: table.hash(&key),
            key: Some(key),
            mode,
        })
        .collect()
}

/// Locks every requested key for the transaction, all or nothing; see the
/// module doc.
///
/// Everything up to the first wait happens in a plain function: an
/// uncontended call creates no lock future and its future stays a few
/// words (moving a large future costs more than the locks); only a call
/// that must wait boxes the rest.
///
/// A plain function returning an `async move` block, not an `async fn`:
/// an `async fn` copies its arguments into locals of its own as it starts;
/// the block uses them where they are, in the future.
// Not an `async fn`: see the doc above.
#[allow(clippy::manual_async_fn)]
pub(crate) fn lock_all<A: Access>(
    mut access: A,
    mut requests: Few<(KeyOf<A>, Mode)>,
    policy: WaitPolicy,
) -> impl Future<Output = Result<LockedSet<KeyOf<A>>, TransactionError<KeyOf<A>>>>
where
    KeyOf<A>: Ord + Clone,
{
    async move {
        // The requests are read where they are (in this future), not moved.
        let out = match lock_all_now(&mut access, &mut requests, policy) {
            // Made anew in the future's output: nothing else is copied.
            Ok(Now::Counted {
                acquired,
                reentered,
            }) => return Ok(LockedSet::counted(acquired, reentered)),
            Ok(Now::Done(done)) => done,
            Err(wait) => { wait }.await,
        };
        access.owner().note(&out);
        if out.is_ok() {
            access.took_grant();
        }
        out
    }
}

/// The call as far as it goes without waiting: done, or the boxed rest.
///
/// The borrowed form's common case runs without claims (see
/// [`Access::SOLE`]): the set is looked at once (every
/// key new or covered), each new key is taken on the table at once, and
/// everything goes into the set in one step if the set is still at the
/// version it was looked at. Anything else (a key held in a weaker mode or
/// busy, a key that is not free, the set changed meanwhile) goes the
/// claiming way, keeping the guards already taken.
#[allow(clippy::type_complexity)]
fn lock_all_now<'a, A: Access>(
    access: &'a mut A,
    requests: &mut Few<(KeyOf<A>, Mode)>,
    policy: WaitPolicy,
) -> Result<
    Now<A>,
    Rest<
        impl Future<Output = Outcome<A>> + 'a,
        impl Future<Output = Outcome<A>> + 'a,
        FreshWait<'a, A>,
    >,
>
where
    KeyOf<A>: Ord + Clone,
{
    if A::SOLE && (1..=2).contains(&requests.len()) && policy != WaitPolicy::SkipLocked {
        return match few_now(access, requests) {
            Few2::Done {
                acquired,
                reentered,
            } => Ok(Now::Counted {
                acquired,
                reentered,
            }),
            Few2::Ended => Ok(Now::Done(Err(TransactionError::Ended))),
            Few2::Busy { wanted, taken, at } => Err(Rest::Sole(Recycled::pin_with(|| {
                wait_sole(access, taken, wanted, at, policy)
            }))),
            Few2::Fresh {
                requests,
                at,
                terms,
            } => Err(Rest::Fresh(Recycled::pin_with(|| {
                FreshWait::new(access, requests, (at, at), terms, policy)
            }))),
            Few2::Other(requests) => claim_all(access, requests, Taken::new(), policy)
                .map(Now::Done)
                .map_err(Rest::Claimed),
        };
    }
    if A::SOLE
        && policy != WaitPolicy::SkipLocked
        && requests.len() <= UNINDEXED_MAX
        && access.with(|set| set.is_vacant()).unwrap_or(false)
    {
        return match take_fresh(access, requests) {
            Ok(done) => Ok(Now::Done(done)),
            Err((requests, filled, terms)) => Err(Rest::Fresh(Recycled::pin_with(|| {
                FreshWait::new(access, requests, (0, filled), terms, policy)
            }))),
        };
    }
    let mut requests = order(&access.owner().reach, requests);
    let mut taken = Taken::new();
    if A::SOLE {
        // Filled by `take_now` only if the set has slots.
        let mut found: Few<Found> = Few::new();
        // Four in place, as the requests (a small call allocates nothing);
        // the waiting way keeps them in its own list.
        let mut took: Few<(usize, GuardOf<A>)> = Few::new();
        match take_now(access, &mut requests, &mut found, &mut took, policy) {
            Ok(done) => return Ok(Now::Done(done)),
            Err(Fallback::Busy { at, version }) => {
                // Room for every key: the wait way pushes the rest.
                let mut taken = Taken::with_capacity(requests.len());
                taken.extend(took);
                return Err(Rest::Sole(Recycled::pin(wait_sole(
                    access,
                    taken,
                    Wanted::held(requests, found, version),
                    at,
                    policy,
                ))));
            }
            Err(Fallback::Other | Fallback::Moved) => taken = took.into_iter().collect(),
        }
    }
    claim_all(access, requests, taken, policy)
        .map(Now::Done)
        .map_err(Rest::Claimed)
}

/// The borrowed form's `lock_all` into a transaction that holds nothing
/// (a fresh transaction's first call: an audit's, a batch's), not
/// skipping: every key is new, so none is looked up in the set. The
/// requests are sorted into the canonical order and merged where they are,
/// each key is hashed as it is tried and taken at once, and goes into the
/// set as it is. When a key is not free at once, the keys taken before it
/// stay in the set, for the waiting way ([`FreshWait`], which takes them
/// back out if the call fails or is dropped): `Err` with the requests from
/// that key on (the list the waiting way keeps), how many keys the set
/// has of the call, and the call's terms.
#[allow(clippy::type_complexity)]
#[inline(never)]
fn take_fresh<A: Access>(
    access: &mut A,
    requests: &mut Few<(KeyOf<A>, Mode)>,
) -> Result<Outcome<A>, (Few<Request<KeyOf<A>>>, usize, Option<Terms>)>
where
    KeyOf<A>: Ord + Clone,
{
    sort_and_merge(requests);
    let n = requests.len();
    let Some((owner, set)) = access.sole() else {
        unreachable!("the borrowed form")
    };
    // Each key goes into the fill as it is taken, and the fill into the
    // set when the call is done or must wait (the call has the
    // transaction to itself: nothing sees the set meanwhile). A panic (a
    // key's `Hash` or `Eq`) drops the fill, which releases the keys taken;
    // a key not free at once leaves them in the set for the waiting way,
    // which takes them out if the call fails: all or nothing.
    let mut fill = set.begin_fill(n);
    // The terms of every grant, resolved once (a lease out of range:
    // `None`, nothing tried, and the wait reports it), as `few_now`'s.
    let reach = &owner.reach;
    let terms = reach
        .table()
        .owner_terms(owner.opts.lease, owner.opts.id.get());
    let mut rest = requests.drain(..).enumerate();
    while let Some((i, (key, mode))) = rest.next() {
        let hash = reach.table().hash(&key);
        let tried = match terms {
            Some(terms) => reach.try_lock_on(hash, key, mode, terms),
            None => Err(key),
        };
        let key = match tried {
            Ok(guard) => {
                fill.push(guard);
                continue;
            }
            Err(key) => key,
        };
        // Not free at once: the requests from this one on, as the waiting
        // way keeps them, the rest hashed now (before the fill is put: a
        // `Hash` that panics still drops the fill).
        let mut list: Few<Request<KeyOf<A>>> = Few::with_capacity(n - i);
        list.push(Request {
            hash,
            key: Some(key),
            mode,
        });
        list.extend(rest.map(|(_, (key, mode))| Request {
            hash: reach.table().hash(&key),
            key: Some(key),
            mode,
        }));
        set.put_fill(fill);
        if i > 0 {
            set.filled();
        }
        return Err((list, i, terms));
    }
    set.put_fill(fill);
    set.filled();
    Ok(Ok(LockedSet::counted(n, 0)))
}

/// A vacant set being filled by [`take_fresh`]: if the fill is left
/// unfinished (a panic), the guards pushed so far come back out of the set
/// and are released, so the transaction holds nothing of the call.
struct Filling<'s, G: GuardOps<Key = K>, K: Eq> {
    set: &'s mut HeldSet<G, K>,
    done: bool,
}

impl<G: GuardOps<Key = K>, K: Eq> Drop for Filling<'_, G, K> {
    fn drop(&mut self) {
        if !self.done {
            // Out of the set first, then released (a key's drop may panic:
            // the rest are released as the list unwinds).
            let taken: Vec<G> = self.set.unfill().collect();
            drop(taken);
        }
    }
}

/// What [`lock_all_now`] did without waiting.
enum Now<A: Access> {
    /// Every key in the set, none skipped: how many were taken and how
    /// many counted (the call's [`LockedSet`] is made in its output).
    Counted { acquired: usize, reentered: usize },
    /// Done otherwise: the outcome.
    Done(Outcome<A>),
}

/// Where [`few_now`] left a call.
enum Few2<A: Access> {
    /// Everything in the set: how many keys were taken, how many counted.
    Done { acquired: usize, reentered: usize },
    /// The transaction has ended.
    Ended,
    /// A key held in a weaker mode, or busy with another call: the
    /// requests (ordered and merged) for the claiming way, nothing taken.
    Other(Few<Request<KeyOf<A>>>),
    /// A fresh fill's request `at` is not free at once: the requests (the
    /// ones before `at` are in the set, as its only keys) for
    /// [`FreshWait`].
    Fresh {
        requests: Few<Request<KeyOf<A>>>,
        at: usize,
        terms: Option<Terms>,
    },
    /// Request `at` is not free at once: what the waiting way starts
    /// from (the state [`take_now`] leaves).
    Busy {
        wanted: Wanted<KeyOf<A>>,
        taken: Taken<GuardOf<A>>,
        at: usize,
    },
}

/// A `lock_all` of one or two keys in the borrowed form (a transfer's),
/// not skipping: [`order`] and [`take_now`] without their lists. The two
/// requests are put in the canonical order in place (by key) and merged
/// if they are one key; each is looked up in the set,
/// each new one taken on the table at once, and both go into the set in
/// one step (the transaction is borrowed by the call: its set cannot
/// change meanwhile). The lists are built only when the call must wait or
/// claim. `requests` is left empty.
fn few_now<A: Access>(access: &mut A, requests: &mut Few<(KeyOf<A>, Mode)>) -> Few2<A>
where
    KeyOf<A>: Ord + Clone,
{
    debug_assert!(A::SOLE && (1..=2).contains(&requests.len()));
    let (first, second) = {
        let mut both = requests.drain(..);
        (both.next(), both.next())
    };
    let Some((key, mode)) = first else {
        unreachable!("one or two requests")
    };
    let table = access.owner().reach.table();
    let mut a = Request {
        hash: table.hash(&key),
        key: Some(key),
        mode,
    };
    let b = match second {
        None => None,
        Some((key, mode)) => {
            let mut b = Request {
                hash: table.hash(&key),
                key: Some(key),
                mode,
            };
            // The order `order` sorts into: by key.
            match a.key.cmp(&b.key) {
                std::cmp::Ordering::Greater => mem::swap(&mut a, &mut b),
                std::cmp::Ordering::Less | std::cmp::Ordering::Equal => {}
            }
            if a.hash == b.hash && a.key == b.key {
                a.mode = a.mode.max(b.mode);
                None
            } else {
                Some(b)
            }
        }
    };
    // A vacant set (a fresh transaction's transfer) has neither key: both
    // go to the table at once, nothing looked up (`few_vacant`).
    if let Some((owner, set)) = access.sole() {
        if set.is_vacant() {
            return few_vacant(owner, set, a, b);
        }
    }
    let looked = access.with(|set| {
        let mut found = |r: &Request<KeyOf<A>>| {
            let key = r.key.as_ref().expect("not taken yet");
            set.find(r.hash, key, r.mode)
        };
        let (found_a, found_b) = (found(&a), b.as_ref().map(found));
        (found_a, found_b, set.version())
    });
    let Ok((found_a, found_b, version)) = looked else {
        return Few2::Ended;
    };
    let lists = |a, b: Option<Request<KeyOf<A>>>| {
        let mut requests = Few::new();
        requests.push(a);
        requests.extend(b);
        requests
    };
    if found_a == Found::Other || found_b == Some(Found::Other) {
        return Few2::Other(lists(a, b));
    }
    let founds = || {
        let mut found = Few::new();
        found.push(found_a);
        found.extend(found_b);
        found
    };
    // Request `at` is not free at once: what the waiting way starts from.
    let busy = |a, b, taken, at| Few2::Busy {
        wanted: Wanted::held(lists(a, b), founds(), version),
        taken,
        at,
    };
    // The borrowed form: the owner and the set, with no lock of its own.
    let Some((owner, set)) = access.sole() else {
        unreachable!("the borrowed form")
    };
    debug_assert_eq!(set.version(), version, "a borrowed transaction's set moved");
    // The terms of both keys' grants, resolved once (a lease out of range:
    // `None`, and the wait reports it).
    let terms = owner
        .reach
        .table()
        .owner_terms(owner.opts.lease, owner.opts.id.get());
    let try_ = |r: &mut Request<KeyOf<A>>| try_request(&owner.reach, terms, r);
    let mut guard_a = None;
    if found_a == Found::Absent {
        match try_(&mut a) {
            Ok(guard) => guard_a = Some(guard),
            Err(()) => {
                return busy(a, b, Taken::new(), 0);
            }
        }
    }
    let mut b = b;
    let mut guard_b = None;
    if let (Some(r), Some(Found::Absent)) = (b.as_mut(), found_b) {
        match try_(r) {
            Ok(guard) => guard_b = Some(guard),
            Err(()) => {
                let mut taken = Taken::new();
                taken.extend(guard_a.map(|guard| (0, guard)));
                return busy(a, b, taken, 1);
            }
        }
    }
    let (mut acquired, mut reentered) = (0, 0);
    for found in [Some(found_a), found_b] {
        if let Some(Found::Covered { at }) = found {
            set.reenter(at);
            reentered += 1;
        }
    }
    if let Some(guard) = guard_a {
        set.insert(a.hash, guard);
        acquired += 1;
    }
    if let (Some(guard), Some(r)) = (guard_b, &b) {
        set.insert(r.hash, guard);
        acquired += 1;
    }
    Few2::Done {
        acquired,
        reentered,
    }
}

/// [`few_now`] into a vacant set (a fresh transaction's transfer): both
/// requests are new, none is looked up in the set. Inline, so that each
/// guard goes from the table's probe into its slot.
#[inline(always)]
fn few_vacant<A: Access>(
    owner: &Owner<A::R>,
    set: &mut SetOf<A::R>,
    mut a: Request<KeyOf<A>>,
    b: Option<Request<KeyOf<A>>>,
) -> Few2<A> {
    // The terms of both keys' grants, resolved once (a lease out of range:
    // `None`, and the wait reports it).
    let terms = owner
        .reach
        .table()
        .owner_terms(owner.opts.lease, owner.opts.id.get());
    let try_ = |r: &mut Request<KeyOf<A>>| try_request(&owner.reach, terms, r);
    // Request `at` is not free at once: what the waiting way starts from,
    // a fresh fill (the keys before `at` stay in the set, as the set's
    // only keys: see `Wanted::fresh`).
    let busy = |set: &mut HeldSet<GuardOf<A>, KeyOf<A>>, a, b: Option<_>, at| {
        if at > 0 {
            set.filled();
        }
        // Pushed one by one: `extend` of an `Option` costs a growth check
        // and a size hint's arithmetic several times a push's.
        let mut requests = Few::new();
        requests.push(a);
        if let Some(b) = b {
            requests.push(b);
        }
        Few2::Fresh {
            requests,
            at,
            terms,
        }
    };
    // Both new, into a vacant set (a fresh transaction's transfer):
    // each guard goes into its slot as it is had, from the table's
    // probe, as a fresh fill's. Not kept aside in an option first: a
    // guard stored in words and copied on at once in wider pieces
    // makes each of those loads wait for the stores it straddles.
    let acquired = 1 + usize::from(b.is_some());
    set.reserve_vacant(acquired);
    // A panic (a key's `Eq` in the probe) takes `a` back out of the
    // set, released as it unwinds: all or nothing.
    let mut fill = Filling { set, done: false };
    let mut b = b;
    match try_(&mut a) {
        Ok(guard) => fill.set.push_new(guard),
        Err(()) => {
            fill.done = true;
            return busy(fill.set, a, b, 0);
        }
    }
    if let Some(r) = b.as_mut() {
        match try_(r) {
            Ok(guard) => fill.set.push_new(guard),
            Err(()) => {
                // `a` stays in the set, for the waiting way, which takes
                // it back out if the call fails or is dropped.
                fill.done = true;
                return busy(fill.set, a, b, 1);
            }
        }
    }
    fill.done = true;
    fill.set.filled();
    Few2::Done {
        acquired,
        reentered: 0,
    }
}

/// One attempt at request `r`'s key on `terms` (`None`: a lease out of
/// range, not tried); the key stays in `r` if it was not had. Inline, so
/// that the guard goes from the table's probe into the caller's registers.
#[inline(always)]
pub(crate) fn try_request<R: Reach>(
    reach: &R,
    terms: Option<Terms>,
    r: &mut Request<R::Key>,
) -> Result<R::Guard, ()> {
    let key = r.key.take().expect("taken once");
    let tried = match terms {
        Some(terms) => reach.try_lock_on(r.hash, key, r.mode, terms),
        None => Err(key),
    };
    tried.map_err(|key| r.key = Some(key))
}

/// What a `lock_all` ends with.
pub(crate) type Outcome<A> = Result<LockedSet<KeyOf<A>>, TransactionError<KeyOf<A>>>;

/// The rest of a call that must wait: the borrowed form's, or the
/// claiming way's (each boxed, so the call's own future stays small).
enum Rest<L, R, F> {
    Sole(Pin<Recycled<L>>),
    Claimed(Pin<Recycled<R>>),
    /// A fresh fill's ([`FreshWait`]).
    Fresh(Pin<Recycled<F>>),
}

impl<L: Future, R: Future<Output = L::Output>, F: Future<Output = L::Output>> Future
    for Rest<L, R, F>
{
    type Output = L::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<L::Output> {
        match self.get_mut() {
            Rest::Sole(rest) => rest.as_mut().poll(cx),
            Rest::Claimed(rest) => rest.as_mut().poll(cx),
            Rest::Fresh(rest) => rest.as_mut().poll(cx),
        }
    }
}

/// Why the fast path could not finish; `taken` keeps what it got.
enum Fallback {
    /// Request `at` is not free at once (the set was at `version`).
    Busy { at: usize, version: u64 },
    /// A key is held in a weaker mode, or busy with another call.
    Other,
    /// The set changed since it was looked at.
    Moved,
}

/// The fast path of [`lock_all_now`]: done (everything in the set, or the
/// transaction ended), or [`Fallback`] with the guards taken so far in
/// `taken` (by request index) and the other requests' keys in `requests`.
#[allow(clippy::type_complexity)]
fn take_now<A: Access>(
    access: &mut A,
    requests: &mut Few<Request<KeyOf<A>>>,
    found: &mut Few<Found>,
    taken: &mut Few<(usize, GuardOf<A>)>,
    policy: WaitPolicy,
) -> Result<Outcome<A>, Fallback>
where
    KeyOf<A>: Ord + Clone,
{
    let looked = access.with(|set| {
        // A set with no slot has none of the keys: every request is new,
        // which an empty `found` says (see `found_at`) without a list.
        if set.is_vacant() {
            return Some(set.version());
        }
        found.reserve(requests.len());
        for request in requests.iter() {
            let key = request.key.as_ref().expect("not taken yet");
            match set.find(request.hash, key, request.mode) {
                Found::Other => return None,
                f => found.push(f),
            }
        }
        Some(set.version())
    });
    let version = match looked {
        Err(Ended) => return Ok(Err(TransactionError::Ended)),
        Ok(None) => return Err(Fallback::Other),
        Ok(Some(version)) => version,
    };
    // The terms of every grant, resolved once, as `few_now`'s.
    let owner = access.owner();
    let terms = owner
        .reach
        .table()
        .owner_terms(owner.opts.lease, owner.opts.id.get());
    for (i, request) in requests.iter_mut().enumerate() {
        if found_at(found, i) != Found::Absent {
            continue;
        }
        match try_request(&owner.reach, terms, request) {
            Ok(guard) => taken.push((i, guard)),
            Err(()) => return Err(Fallback::Busy { at: i, version }),
        }
    }
    put_all(
        access,
        requests,
        found,
        version,
        taken,
        Vec::new(),
        policy == WaitPolicy::SkipLocked,
    )
}

/// What the set had of request `i`: an empty `found` means a set with no
/// slot, which has none of the keys.
#[inline]
fn found_at(found: &[Found], i: usize) -> Found {
    found.get(i).copied().unwrap_or(Found::Absent)
}

/// Puts what a call without claims got into the set in one step, if the
/// set is still at `version` (no user code runs then); else
/// [`Fallback::Moved`].
fn put_all<A: Access, T: smallvec::Array<Item = (usize, GuardOf<A>)>>(
    access: &mut A,
    requests: &[Request<KeyOf<A>>],
    found: &[Found],
    version: u64,
    taken: &mut smallvec::SmallVec<T>,
    skipped: Vec<KeyOf<A>>,
    record: bool,
) -> Result<Outcome<A>, Fallback>
where
    KeyOf<A>: Clone,
{
    let mut out = LockedSet::new(skipped);
    if record {
        // The keys taken, in order: a covered key's name is its request's
        // (still there: only new keys went to the table), a new one's the
        // table's copy, through its guard.
        let mut guards = taken.iter().peekable();
        for (i, request) in requests.iter().enumerate() {
            if let Found::Covered { .. } = found_at(found, i) {
                if let Some(key) = &request.key {
                    out.keys_mut().push((key.clone(), AcquireKind::Reentered));
                }
            } else if let Some((_, guard)) = guards.next_if(|(at, _)| *at == i) {
                out.keys_mut().push((guard.key().clone(), AcquireKind::New));
            }
        }
    }
    let put = access.with(|set| {
        if set.version() != version {
            return false;
        }
        if taken.len() > 4 {
            set.reserve(taken.len());
        }
        for f in found {
            if let Found::Covered { at } = *f {
                set.reenter(at);
                out.reentered += 1;
            }
        }
        out.acquired += set.insert_all(taken.drain(..).map(|(_, guard)| guard));
        true
    });
    match put {
        // The guards (had it ended) are released as `taken` drops.
        Err(Ended) => Ok(Err(TransactionError::Ended)),
        Ok(true) => Ok(Ok(out)),
        Ok(false) => Err(Fallback::Moved),
    }
}

/// The borrowed form's wait (see [`Access::SOLE`]): from request `from`
/// on, each new key is tried at once, else waited for (in the canonical
/// order, holding what the call took: as sorted plain guards would); then
/// everything goes into the set in one step. Nothing is claimed: the
/// transaction is borrowed by this call, so the set cannot change
/// meanwhile. Each wait is parked in the transaction with the guards taken
/// so far ([`pending::Parked`]: released at its end if this future is
/// forgotten). Dropped at an await, or failing, the call releases what it
/// took (its guards drop) and the set is as it was.
///
/// A plain function returning an `async move` block, not an `async fn`:
/// an `async fn` keeps its arguments and its own copies of them side by
/// side in the future (here 432 bytes twice), and this future is boxed: a
/// box past the allocator's small-block size (1,032 bytes for glibc's
/// per-thread cache) makes every contended call lock an allocator arena
/// when the box is freed on another thread (`tests/alloc.rs` checks it).
// Not an `async fn`: see the doc above.
#[allow(clippy::manual_async_fn)]
fn wait_sole<A: Access>(
    access: &mut A,
    mut taken: Taken<GuardOf<A>>,
    mut wanted: Wanted<KeyOf<A>>,
    from: usize,
    policy: WaitPolicy,
) -> impl Future<Output = Outcome<A>> + '_
where
    KeyOf<A>: Ord + Clone,
{
    async move {
        // (The fields of `wanted` are used where they are: moved out into
        // locals of their own, they would be copied within this future.)
        let mut skipped = Vec::new();
        // The terms of every grant, resolved once for the call (as
        // `take_now`'s): the keys after a wait are tried inline on them.
        let terms = {
            let owner = access.owner();
            owner
                .reach
                .table()
                .owner_terms(owner.opts.lease, owner.opts.id.get())
        };
        'call: {
            for i in from..wanted.requests.len() {
                if found_at(&wanted.found, i) != Found::Absent {
                    continue;
                }
                let (hash, mode) = (wanted.requests[i].hash, wanted.requests[i].mode);
                // Request `from` was found not free just now: it waits at once.
                // The others are tried inline, on the call's terms.
                if i != from {
                    if let Ok(guard) =
                        try_request(&access.owner().reach, terms, &mut wanted.requests[i])
                    {
                        taken.push((i, guard));
                        continue;
                    }
                }
                let key = wanted.requests[i].key.take().expect("taken once");
                // The name for the detector, an error or a skip (the key goes to
                // the table).
                let name = key.clone();
                // Whether the transaction holds anything, asked before the
                // guards taken so far are parked.
                let holding = if A::SOLE
                    && taken.is_empty()
                    && access.with(|set| set.holds_nothing()).unwrap_or(false)
                {
                    Holding::Nothing
                } else {
                    Holding::Unknown
                };
                // The wait and the guards taken so far are parked in the
                // transaction (`pending::Parked`), so that its end releases
                // them if this future is forgotten; if it is dropped here
                // (cancelled, or unwinding), `call` releases them.
                let opts = access.owner().opts.lock_options(mode, policy);
                access.park(hash, key, opts, mem::take(&mut taken));
                let call = ParkedCall {
                    access: &mut *access,
                    done: false,
                };
                let wait = WaitFor {
                    hash,
                    key: &name,
                    mode,
                    holding,
                };
                let waited = wait_unless_ended(&mut *call.access, wait, |access, cx| {
                    pending::poll_parked(access.parked(), cx)
                })
                .await;
                call.finish(&mut taken);
                match waited {
                    Err(stop) => break 'call Err(stop.into()),
                    Ok(Ok(guard)) => taken.push((i, guard)),
                    Ok(Err(error)) if policy == WaitPolicy::SkipLocked && is_taken(&error) => {
                        skipped.push(name);
                    }
                    Ok(Err(error)) => {
                        break 'call Err(TransactionError::from_lock(
                            name,
                            mode,
                            policy.waits(),
                            error,
                        ))
                    }
                }
            }
            let record = policy == WaitPolicy::SkipLocked;
            match put_all(
                access,
                &wanted.requests,
                &wanted.found,
                wanted.version,
                &mut taken,
                skipped,
                record,
            ) {
                Ok(done) => done,
                // The call has the transaction to itself: its set cannot move.
                Err(_) => unreachable!("a borrowed transaction's set changed during its call"),
            }
        }
    }
}

/// What a borrowed `lock_all` waits for ([`wait_sole`]): its requests in
/// the canonical order, what the set had of each (empty: none), and the
/// set's version then.
struct Wanted<K> {
    requests: Few<Request<K>>,
    found: Few<Found>,
    version: u64,
}

impl<K> Wanted<K> {
    /// The requests of a call that left nothing in the set.
    fn held(requests: Few<Request<K>>, found: Few<Found>, version: u64) -> Self {
        Self {
            requests,
            found,
            version,
        }
    }
}

/// A borrowed `lock_all` waiting with its wait parked in its transaction
/// ([`pending::Parked`]): dropped before [`finish`](Self::finish) (the
/// call cancelled at its await, or unwinding), it releases what is parked:
/// the waiter leaves its queue (or its unobserved grant passes on) and the
/// guards the call took are released, so the transaction is as it was.
struct ParkedCall<'a, A: Access> {
    access: &'a mut A,
    done: bool,
}

impl<A: Access> ParkedCall<'_, A> {
    /// The wait is over: its guards back into `taken` (see
    /// [`pending::unpark`]), the wait dropped.
    fn finish(mut self, taken: &mut Taken<GuardOf<A>>) {
        self.done = true;
        pending::unpark(self.access.parked(), taken);
    }
}

impl<A: Access> Drop for ParkedCall<'_, A> {
    fn drop(&mut self) {
        if !self.done {
            pending::clear_parked(self.access.parked());
        }
    }
}

/// A request's key: its own, or, once the fast path took it to the table,
/// its guard's.
fn request_key<'k, G: GuardOps>(request: &'k Request<G::Key>, guard: Option<&'k G>) -> &'k G::Key {
    match (&request.key, guard) {
        (Some(key), _) => key,
        (None, Some(guard)) => guard.key(),
        (None, None) => unreachable!("a request's key or its guard"),
    }
}

/// The claiming way: every key claimed in the set (the guards the fast
/// path took go to their claims), then the rest taken in order, waiting
/// where needed (boxed).
fn claim_all<A: Access>(
    access: &mut A,
    mut requests: Few<Request<KeyOf<A>>>,
    taken: Taken<GuardOf<A>>,
    policy: WaitPolicy,
) -> Result<Outcome<A>, Pin<Recycled<impl Future<Output = Outcome<A>> + '_>>>
where
    KeyOf<A>: Ord + Clone,
{
    let mut stage = Stage {
        access,
        entries: Few::with_capacity(requests.len()),
        away: None,
        upgrading: None,
        done: false,
    };
    // The owned form's set is behind a lock: each request's name for its
    // claim is cloned before it (user code); the copies not taken drop
    // after it.
    let mut names: Few<Option<KeyOf<A>>> = if A::SOLE {
        Few::new()
    } else {
        let mut mine = taken.iter().peekable();
        requests
            .iter()
            .enumerate()
            .map(|(i, request)| {
                let guard = mine.next_if(|(at, _)| *at == i).map(|(_, guard)| guard);
                Some(request_key(request, guard).clone())
            })
            .collect()
    };
    let mut taken = taken.into_iter().peekable();
    let began = {
        let Stage {
            access, entries, ..
        } = &mut stage;
        access.with(|set| {
            set.reserve(requests.len());
            let mut unnamed = None;
            for (i, request) in requests.iter().enumerate() {
                let mut mine = taken.next_if(|(at, _)| *at == i).map(|(_, guard)| guard);
                let key = request_key(request, mine.as_ref());
                // Pushed as soon as claimed: a panic in the next key's `Eq`
                // leaves the stage to undo this one.
                // A key the transaction's other call took while this one
                // was taking it too (two shared grants) is a conflict: this
                // call is the one in flight (its claim is given back, and a
                // guard taken out to upgrade put back, as the stage drops).
                let name = names.get_mut(i).unwrap_or(&mut unnamed);
                let (id, kind, guard, conflict) =
                    match set.begin(request.hash, key, request.mode, false, name) {
                        Err(_busy) => return Err((i, mine)),
                        Ok(Begin::Covered { id, .. }) => (id, Kind::Covered, None, mine.is_some()),
                        Ok(Begin::Upgrade { id, guard }) => {
                            (id, Kind::Upgrade, Some(guard), mine.is_some())
                        }
                        Ok(Begin::New { id }) => (id, Kind::New, mine.take(), false),
                    };
                entries.push(Staged {
                    hash: request.hash,
                    id,
                    kind,
                    guard,
                    upgraded: false,
                    skipped: false,
                });
                if conflict {
                    return Err((i, mine));
                }
            }
            Ok(())
        })
    };
    // Whatever is left of the fast path's guards is released here (had the
    // transaction ended, or a claim failed), after unlocking.
    drop(taken);
    drop(names);
    match began {
        Err(Ended) => return Ok(Err(TransactionError::Ended)),
        Ok(Err((i, mine))) => {
            let key = match (requests[i].key.take(), mine) {
                (Some(key), _) => key,
                (None, Some(guard)) => guard.key().clone(),
                (None, None) => unreachable!("a request's key or its guard"),
            };
            return Ok(Err(TransactionError::InFlight { key }));
        }
        Ok(Ok(())) => {}
    }

    // Every key that can be had at once, in order, until the first that
    // must be waited for (or upgraded): the rest is the slow path's.
    for (i, request) in requests.iter_mut().enumerate() {
        match stage.entries[i].kind {
            Kind::Covered => continue,
            Kind::Upgrade => return Err(Recycled::pin(wait_rest(stage, requests, i, policy))),
            Kind::New if stage.entries[i].guard.is_some() => continue,
            Kind::New => {
                let key = request.key.take().expect("locked once");
                let opts = stage.access.owner().opts.lock_options(request.mode, policy);
                match stage
                    .access
                    .owner()
                    .reach
                    .try_lock_kept(request.hash, key, opts)
                {
                    Ok(guard) => stage.entries[i].guard = Some(guard),
                    Err(key) => {
                        request.key = Some(key);
                        return Err(Recycled::pin(wait_rest(stage, requests, i, policy)));
                    }
                }
            }
        }
    }
    Ok(stage.finish(&mut requests, policy == WaitPolicy::SkipLocked))
}

/// The slow path: the requests from `from` on, waiting where needed.
///
/// A plain function returning an `async move` block, for the size of its
/// boxed future (see [`wait_sole`]).
// Not an `async fn`: see the doc above.
#[allow(clippy::manual_async_fn)]
fn wait_rest<'a, A: Access>(
    mut stage: Stage<'a, A>,
    mut requests: Few<Request<KeyOf<A>>>,
    from: usize,
    policy: WaitPolicy,
) -> impl Future<Output = Result<LockedSet<KeyOf<A>>, TransactionError<KeyOf<A>>>> + 'a
where
    KeyOf<A>: Ord + Clone,
{
    async move {
        let skip = policy == WaitPolicy::SkipLocked;
        for (i, request) in requests.iter_mut().enumerate().skip(from) {
            let opts = stage.access.owner().opts.lock_options(request.mode, policy);
            let result = match stage.entries[i].kind {
                Kind::Covered => continue,
                Kind::New if stage.entries[i].guard.is_some() => continue,
                Kind::New => {
                    let key = request.key.take().expect("locked once");
                    // Tried at once first (it never barges past queued waiters,
                    // so fairness is the same): an uncontended key creates no
                    // lock future. The key goes to the table only if it takes
                    // it; a busy one comes back for the wait.
                    let reach = &stage.access.owner().reach;
                    let key = match reach.try_lock_kept(request.hash, key, opts) {
                        Ok(guard) => {
                            stage.entries[i].guard = Some(guard);
                            continue;
                        }
                        Err(key) => key,
                    };
                    let name = key.clone();
                    let lock = stage
                        .access
                        .owner()
                        .reach
                        .lock_with(request.hash, key, opts);
                    let Ok(cell) = stage.stow(Wait::Lock(Recycled::pin(lock))) else {
                        return Err(TransactionError::Ended);
                    };
                    let wait = WaitFor {
                        hash: request.hash,
                        key: &name,
                        mode: request.mode,
                        holding: Holding::Unknown,
                    };
                    let waited =
                        wait_unless_ended(&mut *stage.access, wait, |_, cx| cell.poll(cx)).await;
                    if stage.unstow().is_err() {
                        return Err(TransactionError::Ended);
                    }
                    match waited {
                        Ok(Some(Waited::Granted(guard))) => {
                            stage.entries[i].guard = Some(guard);
                            Ok(Ok(()))
                        }
                        Ok(Some(Waited::Failed(_, error))) => Ok(Err(error)),
                        Ok(None) => Err(Stop::Ended),
                        Err(stop) => Err(stop),
                    }
                }
                Kind::Upgrade => {
                    let guard = stage.entries[i].guard.take().expect("held");
                    // The caller's key names the wait (never a clone of the
                    // table's: its drop, last, comes after the flag below).
                    let name = match request.key.take() {
                        Some(key) => key,
                        None => guard.key().clone(),
                    };
                    let wait = WaitFor {
                        hash: request.hash,
                        key: &name,
                        mode: Mode::Exclusive,
                        holding: Holding::Unknown,
                    };
                    // The upgrade owns the guard while it waits, in the
                    // cell: the stage's undo takes it back from there.
                    stage.upgrading = Some(i);
                    let upgrade = Recycled::pin(guard.upgrade_owned(opts));
                    let Ok(cell) = stage.stow(Wait::Upgrade(upgrade)) else {
                        return Err(TransactionError::Ended);
                    };
                    let waited =
                        wait_unless_ended(&mut *stage.access, wait, |_, cx| cell.poll(cx)).await;
                    if stage.unstow().is_err() {
                        return Err(TransactionError::Ended);
                    }
                    match waited {
                        Ok(Some(Waited::Granted(guard))) => {
                            stage.upgrading = None;
                            let entry = &mut stage.entries[i];
                            entry.guard = Some(guard);
                            entry.upgraded = true;
                            Ok(Ok(()))
                        }
                        Ok(Some(Waited::Failed(guard, error))) => {
                            stage.upgrading = None;
                            stage.entries[i].guard = guard;
                            Ok(Err(error))
                        }
                        Ok(None) => Err(Stop::Ended),
                        // The upgrade is still in the cell: the stage's
                        // undo takes its guard back.
                        Err(stop) => Err(stop),
                    }
                }
            };
            match result {
                Err(stop) => return Err(stop.into()),
                Ok(Ok(())) => {}
                Ok(Err(error)) if skip && is_taken(&error) => stage.entries[i].skipped = true,
                Ok(Err(error)) => return Err(stage.fail(i, request.mode, policy.waits(), error)),
            }
        }
        stage.finish(&mut requests, skip)
    }
}

/// Takes up to `limit` of `candidates`, in their order, each only if it
/// can be had at once (PostgreSQL's `LIMIT n FOR UPDATE SKIP LOCKED`): a
/// key the transaction holds in a covering mode counts (re-entered), one
/// it holds shared and asks exclusive is upgraded if that can be done at
/// once, and a key that cannot be had at once is skipped (an upgrade's key
/// stays shared). It stops once `limit` keys are taken, leaving the rest
/// untouched. Each candidate is a lock of its own that never waits, so the
/// order cannot deadlock; an error other than a key being taken ends the
/// call, the keys taken before it staying the transaction's (as a sequence
/// of `NOWAIT` locks would leave them).
pub(crate) async fn lock_up_to<A: Access>(
    mut access: A,
    limit: usize,
    candidates: Vec<(KeyOf<A>, Mode)>,
) -> Outcome<A>
where
    KeyOf<A>: Clone,
{
    let mut out = LockedSet::new(Vec::new());
    let mut failed = None;
    for (key, mode) in candidates {
        if out.keys().len() == limit {
            break;
        }
        let name = key.clone();
        let got = match single::lock_now(&mut access, key, mode, WaitPolicy::NoWait) {
            Ok(done) => done,
            Err(wait) => { wait }.await,
        };
        match got {
            Ok(acquired) => {
                out.count(acquired.kind);
                out.keys_mut().push((name, acquired.kind));
            }
            Err(TransactionError::Busy { .. }) => out.skipped_mut().push(name),
            Err(TransactionError::Lock { error, .. }) if is_taken(&error) => {
                out.skipped_mut().push(name);
            }
            Err(error) => {
                failed = Some(error);
                break;
            }
        }
    }
    let out = match failed {
        None => Ok(out),
        Some(error) => Err(error),
    };
    access.owner().note(&out);
    out
}

#[cfg(all(test, not(loom)))]
mod tests {
    //! A fresh transaction's transfer (`few_now` into a vacant set: each
    //! guard written into its slot in place), with keys that own memory,
    //! so that miri sees every guard and key moved, kept and let go.

    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use crate::{LockTable, Mode, TransactionError, WaitPolicy};

    fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        fut.poll(&mut Context::from_waker(Waker::noop()))
    }

    fn pair(a: &str, b: &str) -> [(String, Mode); 2] {
        [
            (a.to_string(), Mode::Exclusive),
            (b.to_string(), Mode::Exclusive),
        ]
    }

    #[test]
    fn a_fresh_transfer_holds_both_keys_then_releases_them() {
        let table = LockTable::<String>::new();
        let mut txn = table.transaction();
        // Given out of order: taken in the canonical one.
        let got = futures::executor::block_on(txn.lock_all(pair("b", "a"))).unwrap();
        assert_eq!(got.acquired(), 2);
        assert_eq!(txn.len(), 2);
        assert!(table.is_locked("a") && table.is_locked("b"));
        // Re-entered through the set the transfer filled.
        let again = futures::executor::block_on(txn.lock("a".to_string(), Mode::Exclusive));
        assert_eq!(again.map(|a| a.count), Ok(2));
        txn.commit().unwrap();
        assert!(table.is_empty());
        // A self-transfer: one key, once.
        let mut txn = table.transaction();
        let got = futures::executor::block_on(txn.lock_all(pair("a", "a"))).unwrap();
        assert_eq!((got.acquired(), txn.len()), (1, 1));
        drop(txn);
        assert!(table.is_empty());
    }

    #[test]
    fn a_fresh_transfer_whose_second_key_is_busy_keeps_nothing_of_the_first() {
        let table = LockTable::<String>::new();
        let blocker = table.try_lock("b".to_string()).unwrap();
        let mut txn = table.transaction();
        let err =
            futures::executor::block_on(txn.lock_all_with(pair("a", "b"), WaitPolicy::NoWait))
                .unwrap_err();
        assert!(matches!(err, TransactionError::Busy { ref key, .. } if key == "b"));
        assert!(txn.is_empty(), "a came back out of the set");
        assert!(!table.is_locked("a"), "and was released");
        // Waiting instead: the call takes a, waits for b, gets both.
        {
            let mut call = pin!(txn.lock_all(pair("b", "a")));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(table.is_locked("a"), "a is the waiting call's");
            drop(blocker);
            let Poll::Ready(got) = poll_once(call.as_mut()) else {
                panic!("b was handed to the waiting call");
            };
            assert_eq!(got.map(|g| g.acquired()), Ok(2));
        }
        assert_eq!(txn.len(), 2);
        txn.commit().unwrap();
        assert!(table.is_empty());
    }

    #[test]
    fn a_fresh_transfer_whose_first_key_is_busy_takes_nothing_until_it_is_free() {
        let table = LockTable::<String>::new();
        let blocker = table.try_lock("a".to_string()).unwrap();
        let mut txn = table.transaction();
        {
            let mut call = pin!(txn.lock_all(pair("a", "b")));
            assert!(poll_once(call.as_mut()).is_pending());
            assert!(!table.is_locked("b"), "b is not taken before a");
        } // dropped while it waits: nothing kept
        assert!(txn.is_empty());
        drop(blocker);
        assert!(table.is_empty());
        drop(txn);
    }
}
