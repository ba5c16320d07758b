//! One key: a transaction's re-entrant lock (count, upgrade or take), and
//! the operations over every key it holds (check, renew).
//!
//! A lock first looks at the held set and, for a new key, tries it on the
//! table, in one step on the set ([`Access::fast`]; in the owned form under
//! the set's lock, the table's shard locked inside it, nothing woken or
//! dropped until both are released): a key held in a covering mode is
//! counted and the call returns at once; a new key had at once goes into
//! the set — no claim, no copy of the key, and no other call of the
//! transaction can see it in between, so two locks of one new key at once
//! take it once and count it once. What that step does not finish — a key
//! held shared and asked exclusive, a key not free at once, a key busy
//! with another call — is claimed ([`HeldSet::begin`]): a key held shared
//! and asked exclusive has its guard taken out and upgraded; a new key that
//! was not free waits on the table (a second call for a key claimed by a
//! pending one fails [`InFlight`](TransactionError::InFlight)). Until the
//! call settles, a [`Claim`] owns what it took: dropped (the future
//! cancelled, or unwinding), it gives the upgraded-or-not guard back as the
//! cancelled upgrade left it (shared), and releases a new key's guard, so a
//! cancelled call leaves the transaction as it was.
//!
//! Everything up to the wait runs in a plain function (`lock_now`), and the
//! wait is boxed: the lock future keeps only its arguments and one pointer,
//! so moving it (into `pin!`, into a caller's future) copies little, and an
//! uncontended lock allocates nothing.

use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::keys::deferred::Leftovers;
use crate::support::mode::Mode;
use crate::support::recycle::Recycled;
use crate::transactions::access::{
    wait_unless_ended, Access, Ended, Fast, GuardOf, Holding, KeyOf, Owner, PendingOf, SetOf, Stop,
    WaitFor,
};
use crate::transactions::error::TransactionError;
use crate::transactions::held::{AcquireKind, Acquired, Begin, HeldSet};
use crate::transactions::pending::{self, Taken, Wait, Waited};
use crate::transactions::policy::WaitPolicy;
use crate::transactions::reach::{GuardOps, Reach};

/// A pending call's hold on one slot of the set; gives it back when
/// dropped unless settled.
struct Claim<'a, A: Access> {
    access: &'a mut A,
    hash: u64,
    id: u64,
    /// The guard being upgraded, or the new key's once granted.
    guard: Option<GuardOf<A>>,
    /// The cell of the call's wait (`pending.rs`), which has the guard
    /// while an upgrade waits: taken back (the upgrade undone, shared) if
    /// the call is dropped, cancelled if the transaction ends first.
    away: Option<Arc<PendingOf<A::R>>>,
    /// The borrowed form's new key: its wait is parked in the transaction
    /// (`pending::Parked`), dropped (its waiter leaving the queue, or its
    /// unobserved grant passed on) if the call is.
    parked: bool,
    settled: bool,
}

impl<A: Access> Claim<'_, A> {
    /// Puts the guard into the set and counts the grant.
    #[inline]
    fn settle(mut self, kind: AcquireKind) -> Result<Acquired, TransactionError<KeyOf<A>>> {
        self.settled = true;
        let (hash, id, guard) = (self.hash, self.id, self.guard.take());
        let settled = self.access.with(|set| set.settle(hash, id, guard, kind));
        match settled {
            Ok(Ok((acquired, name))) => {
                drop(name);
                Ok(acquired)
            }
            // The transaction ended meanwhile: the guard is released here.
            Ok(Err(_)) | Err(Ended) => Err(TransactionError::Ended),
        }
    }

    /// How the call's wait ended: granted (a new key's guard, or the
    /// upgraded one), the guard goes into the set as `kind`; failed (with an
    /// upgrade's guard back, shared), the slot is given back and the error
    /// names the key; stopped (a deadlock, the end), the claim undoes itself
    /// as it drops.
    fn ended(
        mut self,
        waited: Result<Option<Waited<GuardOf<A>>>, Stop<KeyOf<A>>>,
        kind: AcquireKind,
        mode: Mode,
        policy: WaitPolicy,
    ) -> Result<Acquired, TransactionError<KeyOf<A>>> {
        match waited {
            Err(stop) => Err(stop.into()),
            // Cancelled: the transaction ended.
            Ok(None) => Err(TransactionError::Ended),
            Ok(Some(Waited::Granted(guard))) => {
                self.guard = Some(guard);
                self.settle(kind)
            }
            Ok(Some(Waited::Failed(guard, error))) => {
                self.guard = guard;
                match self.abandon() {
                    Some(key) => Err(TransactionError::from_lock(
                        key,
                        mode,
                        policy.waits(),
                        error,
                    )),
                    None => Err(TransactionError::Ended),
                }
            }
        }
    }

    /// Gives the slot back without a grant; returns the key's clone, for
    /// the error.
    fn abandon(mut self) -> Option<KeyOf<A>> {
        self.settled = true;
        let (hash, id, guard) = (self.hash, self.id, self.guard.take());
        match self.access.with(|set| set.abandon(hash, id, guard)) {
            Ok((name, rest)) => {
                drop(rest);
                name
            }
            Err(Ended) => None,
        }
    }
}

impl<A: Access> Drop for Claim<'_, A> {
    fn drop(&mut self) {
        // A step's panic (a wake as a waiter leaves, a key's drop) is held
        // until the claim is given back: the slot must not stay busy.
        let mut panicked = None;
        if self.parked {
            // The call's own undo: its waiter leaves the queue.
            self.parked = false;
            let access = &mut *self.access;
            let cleared = catch_unwind(AssertUnwindSafe(|| pending::clear_parked(access.parked())));
            panicked = cleared.err();
        }
        if let Some(away) = self.away.take() {
            // The call's own undo: its wait goes (a new key's waiter leaves
            // the queue), an upgrade's guard comes back, shared.
            let recovered = catch_unwind(AssertUnwindSafe(|| {
                away.recover(GuardOf::<A>::upgrade_undone)
            }));
            match recovered {
                Ok(Some((_, Some(upgraded)))) => self.guard = Some(upgraded),
                Ok(_) => {}
                Err(payload) => {
                    panicked.get_or_insert(payload);
                }
            }
            // Done with: off the transaction's list.
            self.access.unpend(&away);
        }
        if !self.settled {
            let (hash, id, guard) = (self.hash, self.id, self.guard.take());
            // If the transaction ended, `with` does not run and the guard is
            // dropped (released) with the closure.
            if let Ok((name, rest)) = self.access.with(|set| set.abandon(hash, id, guard)) {
                drop(rest);
                drop(name);
            }
        }
        // Swallowed if this drop runs during an unwind already, where a
        // second panic would abort.
        if let Some(payload) = panicked {
            if !std::thread::panicking() {
                resume_unwind(payload);
            }
        }
    }
}

/// Locks `key` in `mode` for the transaction; see the module doc.
///
/// The uncontended path runs without a future of the table's: a new key is
/// first tried at once (`try_lock_with`, which never barges past queued
/// waiters, so fairness is the same); only a key that must be waited for
/// (or named with its holder, under a policy that does not wait) goes to
/// the boxed slow path, so this future stays a few words.
///
/// A plain function returning an `async move` block, not an `async fn`:
/// an `async fn` copies its arguments into locals of its own as it starts;
/// the block uses them where they are, in the future.
// Not an `async fn`: see the doc above.
#[allow(clippy::manual_async_fn)]
pub(crate) fn lock<A: Access>(
    mut access: A,
    key: KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> impl Future<Output = Result<Acquired, TransactionError<KeyOf<A>>>>
where
    KeyOf<A>: Clone,
{
    async move {
        // Everything but the wait happens in a plain function, so that this
        // future keeps only its arguments and a box across its one await.
        // Its result is taken apart in a statement of its own, which ends
        // before the await: a result matched in the same expression as the
        // await would be kept in the future, written there in words and
        // read back at once in wider pieces, each load waiting for the
        // stores it straddles.
        let out = 'out: {
            let wait = match lock_now(&mut access, key, mode, policy) {
                // Made anew in the future's output: only the grant is
                // copied. (The borrowed form has no other call to tell of
                // its grant, see `Access::took_grant`.)
                Ok(Ok(acquired)) if A::SOLE => return Ok(acquired),
                Ok(Ok(acquired)) => break 'out Ok(acquired),
                Ok(Err(error)) => break 'out Err(error),
                Err(wait) => wait,
            };
            wait.await
        };
        access.owner().note(&out);
        if out.is_ok() {
            access.took_grant();
        }
        out
    }
}

/// The lock as far as it goes without waiting: done, or the boxed wait.
#[allow(clippy::type_complexity)]
#[inline(always)]
pub(crate) fn lock_now<A: Access>(
    access: &mut A,
    key: KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> Result<
    Result<Acquired, TransactionError<KeyOf<A>>>,
    Pin<Recycled<impl Future<Output = Result<Acquired, TransactionError<KeyOf<A>>>> + '_>>,
>
where
    KeyOf<A>: Clone,
{
    let hash = access.owner().reach.table().hash(&key);
    // The fast path (see `Access::fast`): a covered key is counted; a new
    // key is tried on the table and put in, in one step on the set (no
    // claim, no copy of the key).
    let fast = if A::SOLE {
        // The borrowed form holds no lock of its own around the step: the
        // table's own attempt, inline, on terms resolved here (a lease out
        // of range: not tried, and the wait reports it), doing its wakes
        // and drops as it returns.
        let owner = access.owner();
        let terms = owner
            .reach
            .table()
            .owner_terms(owner.opts.lease, owner.opts.id.get());
        access.fast(hash, key, mode, |owner, slot| {
            let terms = terms?;
            let key = slot.take()?;
            owner
                .reach
                .try_lock_on(hash, key, mode, terms)
                .map_err(|key| *slot = Some(key))
                .ok()
        })
    } else {
        lock_fast_leaving(access, hash, key, mode, policy)
    };
    let (tried, mut key) = match fast {
        Fast::Done(acquired) => return Ok(Ok(acquired)),
        // Not free at once (or options the wait will report): the
        // claiming path, which waits with the claim's copy.
        Fast::NotFree(key) => (true, key),
        Fast::Other(key) => (false, key),
        Fast::Ended(key) => {
            drop(key);
            return Ok(Err(TransactionError::Ended));
        }
    };
    // The owned form's set is behind a lock: the key's name for a claim is
    // cloned before it (user code), and a copy not taken drops after it.
    let mut name = (!A::SOLE).then(|| key.clone());
    let begun = access.with(|set| set.begin(hash, &key, mode, true, &mut name));
    drop(name);
    let begun = match begun {
        Err(Ended) => return Ok(Err(TransactionError::Ended)),
        Ok(Err(_busy)) => return Ok(Err(TransactionError::InFlight { key })),
        Ok(Ok(begun)) => begun,
    };
    let (id, guard) = match begun {
        Begin::Covered { acquired, .. } => return Ok(Ok(acquired)),
        Begin::New { id } => (id, None),
        Begin::Upgrade { id, guard } => (id, Some(guard)),
    };
    let upgrading = guard.is_some();
    let mut claim = Claim {
        access,
        hash,
        id,
        guard,
        away: None,
        parked: false,
        settled: false,
    };
    if !upgrading && !tried {
        let opts = claim.access.owner().opts.lock_options(mode, policy);
        // The hash is the one the held set was searched with: the key is
        // not hashed twice. A key that cannot be had at once (or invalid
        // options, which the wait reports) goes to the wait, which locks
        // the claim's copy of it.
        match claim.access.owner().reach.try_lock_kept(hash, key, opts) {
            Ok(guard) => {
                claim.guard = Some(guard);
                return Ok(claim.settle(AcquireKind::New));
            }
            Err(k) => key = k,
        }
    }
    Err(Recycled::pin(wait(claim, upgrading, key, mode, policy)))
}

/// [`lock_now`]'s fast path in the owned form, whose step holds the set's
/// lock: what the table leaves to do after its shard's unlock is done
/// here, and a copy of the key it did not keep is dropped in
/// [`Access::fast`], both after the set's lock is released.
#[inline]
fn lock_fast_leaving<A: Access>(
    access: &mut A,
    hash: u64,
    key: KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> Fast<KeyOf<A>> {
    let opts = access.owner().opts.lock_options(mode, policy);
    // Dropped in place at the end (a `drop(left)` would move, and so copy,
    // the whole record first), after the set's lock.
    let mut left = Leftovers::default();
    access.fast(hash, key, mode, |owner, slot| {
        owner.reach.try_lock_leaving(hash, slot, opts, &mut left)
    })
}

/// The slow path: a new key that was not free at once, or an upgrade.
///
/// `key` is the caller's: it names the wait for deadlock detection, and
/// drops (after the call settled) at the end.
async fn wait<A: Access>(
    claim: Claim<'_, A>,
    upgrading: bool,
    key: KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> Result<Acquired, TransactionError<KeyOf<A>>>
where
    KeyOf<A>: Clone,
{
    let name = key;
    if upgrading {
        return upgrade(claim, &name, mode, policy).await;
    }
    if !A::SOLE {
        return wait_new(claim, &name, mode, policy).await;
    }
    // The borrowed form's wait for a new key, written out here rather than
    // in an `async fn` of its own: that would keep a second copy of the
    // claim and of the lock future in this boxed future, and move them into
    // it as it starts (936 bytes boxed, against 760). The transaction is
    // borrowed by this call, its only one, so the lock future is parked in
    // the transaction itself (`pending::Parked`: dropped at its end if this
    // future is forgotten, by the claim if it is dropped) and polled
    // there, with no cell.
    let mut claim = claim;
    let opts = claim.access.owner().opts.lock_options(mode, policy);
    claim
        .access
        .park(claim.hash, name.clone(), opts, Taken::new());
    claim.parked = true;
    // Nothing else can take a key for the transaction while it waits, so
    // it holds its set's keys (and those of a call it forgot while it
    // waited: the set counts those).
    let holding = if claim
        .access
        .with(|set| set.holds_nothing())
        .unwrap_or(false)
    {
        Holding::Nothing
    } else {
        Holding::TheSet
    };
    let wait = WaitFor {
        hash: claim.hash,
        key: &name,
        mode,
        holding,
    };
    let waited = wait_unless_ended(&mut *claim.access, wait, |access, cx| {
        pending::poll_parked(access.parked(), cx)
    })
    .await;
    claim.parked = false;
    // Nothing was parked with it: the slot's list stays empty.
    pending::unpark(claim.access.parked(), &mut Taken::new());
    let waited = waited.map(|out| {
        Some(match out {
            Ok(guard) => Waited::Granted(guard),
            Err(error) => Waited::Failed(None, error),
        })
    });
    claim.ended(waited, AcquireKind::New, mode, policy)
}

/// The table's lock future for a claim's new key, in `mode` under the
/// transaction's options: the caller's key went to the attempt, so it
/// locks a copy of the caller's name for the wait, made here, outside any
/// lock (the claim's copy is behind the owned form's set lock, where a
/// key's `Clone`, user code, may not run).
fn lock_named<R: Reach>(
    owner: &Owner<R>,
    hash: u64,
    name: &R::Key,
    mode: Mode,
    policy: WaitPolicy,
) -> R::Lock
where
    R::Key: Clone,
{
    owner
        .reach
        .lock_with(hash, name.clone(), owner.opts.lock_options(mode, policy))
}

/// A new key that was not free at once, in the owned form: wait for it on
/// the table (under a policy that does not wait, the zero-timeout wait
/// names the holder). The borrowed form's is written out in [`wait`].
async fn wait_new<A: Access>(
    mut claim: Claim<'_, A>,
    name: &KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> Result<Acquired, TransactionError<KeyOf<A>>>
where
    KeyOf<A>: Clone,
{
    // A transaction ended meanwhile is found as the wait is pended.
    let lock = lock_named(claim.access.owner(), claim.hash, name, mode, policy);
    // The lock future lives in a cell the transaction can reach too, so
    // that if this call's future is forgotten, the transaction's end still
    // takes its waiter out of the queue, or passes on its grant
    // (`pending.rs`); dropped, the call takes it back itself (the claim).
    let cell = PendingOf::<A::R>::new();
    if cell.start(Wait::Lock(Recycled::pin(lock))).is_err() || claim.access.pend(&cell).is_err() {
        return Err(TransactionError::Ended);
    }
    claim.away = Some(Arc::clone(&cell));
    // The owned form: another call may take a key for the transaction
    // meanwhile.
    let wait = WaitFor {
        hash: claim.hash,
        key: name,
        mode,
        holding: Holding::Unknown,
    };
    let waited = wait_unless_ended(&mut *claim.access, wait, |_, cx| cell.poll(cx)).await;
    claim.ended(waited, AcquireKind::New, mode, policy)
}

/// A key held shared, asked exclusive: upgrade its guard.
async fn upgrade<A: Access>(
    mut claim: Claim<'_, A>,
    name: &KeyOf<A>,
    mode: Mode,
    policy: WaitPolicy,
) -> Result<Acquired, TransactionError<KeyOf<A>>>
where
    KeyOf<A>: Clone,
{
    let opts = claim.access.owner().opts.lock_options(mode, policy);
    // The upgrade owns the guard while it waits, in a cell the transaction
    // can reach too (`pending.rs`): forgotten, the call's guard is still
    // released when the transaction ends; dropped, the claim takes it back
    // (shared).
    let guard = claim.guard.take().expect("set by the caller");
    let cell = PendingOf::<A::R>::new();
    let started = cell.start(Wait::Upgrade(Recycled::pin(guard.upgrade_owned(opts))));
    debug_assert!(started.is_ok(), "a new cell");
    claim.away = Some(Arc::clone(&cell));
    if claim.access.pend(&cell).is_err() {
        return Err(TransactionError::Ended);
    }
    let wait = WaitFor {
        hash: claim.hash,
        key: name,
        mode: Mode::Exclusive,
        holding: Holding::Unknown,
    };
    let upgraded = wait_unless_ended(&mut *claim.access, wait, |_, cx| cell.poll(cx)).await;
    claim.ended(upgraded, AcquireKind::Upgraded, mode, policy)
}

/// The first grant of the set that has lost its key, if any, as an error
/// naming it by `name` (a clone of its key; under the owned form's lock, a
/// pin of it, cloned once the lock is released).
pub(crate) fn first_lost<G, K, N>(
    set: &HeldSet<G, K>,
    left: &mut Settled<K>,
    name: impl Fn(&G) -> N,
) -> Option<TransactionError<N>>
where
    G: GuardOps<Key = K>,
    K: Eq,
{
    set.guards().find_map(|guard| {
        let checked = left.leaving(|left| guard.check_leaving(left));
        checked.err().map(|_| TransactionError::Expired {
            key: name(guard),
            token: guard.token(),
        })
    })
}

/// What checks and renewals of a set's grants leave to do (wakes, drops
/// of what they settled), one record per visit that left anything: done
/// when dropped, after the set's lock (owned form) is released, so no
/// waker runs under it.
pub(crate) struct Settled<K>(Vec<Leftovers<K>>);

impl<K> Drop for Settled<K> {
    fn drop(&mut self) {
        // Every record's work is done even if one's wake panics (then the
        // first panic goes on once all are done).
        let mut first = None;
        for mut left in self.0.drain(..) {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| left.flush())) {
                first.get_or_insert(payload);
            }
        }
        if let Some(payload) = first {
            resume_unwind(payload);
        }
    }
}

impl<K> Settled<K> {
    pub(crate) fn new() -> Self {
        Self(Vec::new())
    }

    /// Runs one table visit with a record of its own, kept if it left work.
    fn leaving<T>(&mut self, visit: impl FnOnce(&mut Leftovers<K>) -> T) -> T {
        let mut left = Leftovers::default();
        let out = visit(&mut left);
        if left.is_dirty() {
            self.0.push(left);
        }
        out
    }
}

/// Renews every grant of the set with `lease`, all or nothing as far as a
/// lapse goes: every grant is checked first and none is renewed if one has
/// lost its key (the error names it by `name`, as [`first_lost`]). Without
/// a lease, only the check.
pub(crate) fn renew<R: Reach, N>(
    set: &SetOf<R>,
    lease: Option<Duration>,
    left: &mut Settled<R::Key>,
    name: impl Fn(&R::Guard) -> N,
) -> Result<(), TransactionError<N>> {
    if let Some(err) = first_lost(set, left, &name) {
        return Err(err);
    }
    let Some(lease) = lease else {
        return Ok(());
    };
    for guard in set.guards() {
        // A grant that lapses between its check and its renewal (its
        // deadline passed in that instant) fails here; the ones renewed
        // before it stay renewed, which grants nothing to a transaction
        // that cannot commit any more.
        let renewed = left.leaving(|left| guard.renew_leaving(lease, left));
        renewed
            .map_err(|error| TransactionError::from_lock(name(guard), guard.mode(), true, error))?;
    }
    Ok(())
}
