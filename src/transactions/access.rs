//! How a call reaches its transaction's state: directly through `&mut` (a
//! [`Transaction`](crate::Transaction), whose calls borrow it), or through
//! an `Arc` shared with the pending futures of an
//! [`OwnedTransaction`](crate::OwnedTransaction), behind a lock (the
//! table's spin lock, `shard_lock.rs`: its sections are a search of the set
//! and a few stores), with an *ended* mark.
//!
//! # Ending an owned transaction
//!
//! Commit, abort and drop end the transaction the same way, from any
//! thread: under the lock it is marked ended and its set of keys is taken;
//! after unlocking, the keys are released and every pending future is woken.
//! A woken future (or one that completes on its own) finds the mark at its
//! next step, releases what it had got (its guard, or its waiter slot) and
//! fails with [`TransactionError::Ended`](crate::TransactionError::Ended).
//! A future that is never polled again (or is forgotten) keeps nothing
//! of the table once the end is done with it: a waiting call keeps its
//! wait (a new key's table lock future, an upgrade) and the guards it has
//! outside the set (a `lock_all`'s) in a cell the transaction cancels as
//! it ends (`pending.rs`), so its waiter leaves the queue, a grant handed
//! to it and not yet seen passes on, and its guards are released.
//!
//! No guard is released, no key dropped and no waker of a pending future
//! woken while the lock is held: they are user code (a waker may call back
//! into the transaction), nor is a pending future's waker cloned under it
//! (the clone is made first). One kind of user code does run under it: a
//! key's `Eq` while the set is searched (a panic there leaves the state as
//! it was, and the unwinding releases the lock). A key's `Clone` and `Drop`
//! never do: a claim's copy of its key is made before the lock is taken,
//! and a key to be named (`keys()`, an error) is pinned in the table under
//! it and cloned after it (`LockTable::pin_key`). The wakes of
//! [`Lost`](crate::futures::Lost) watchers that a `renew` or a `check`
//! settles run after the lock is released (`single::Settled`).
//!
//! The lock (loom's mutex under loom) and the mark come from the loom shim
//! (`crate::support::loom`), so the loom models (`tests/loom_owners.rs`) explore the
//! end racing a pending call.

use std::future::poll_fn;
use std::ops::DerefMut;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::support::lease::LockOptions;
use crate::support::loom::{AtomicBool, AtomicU64};
use crate::support::mode::Mode;
use crate::support::shard_lock::ShardMutex;
use crate::transactions::deadlock::{wait_id, Deadlock};
use crate::transactions::error::TransactionError;
use crate::transactions::held::{Acquired, Found, HeldSet};
use crate::transactions::pending::{self, ParkedSlot, Pending, PendingList, Taken};
use crate::transactions::policy::{Resolved, WaitPolicy};
use crate::transactions::reach::{GuardOps, Reach};

/// The key type of an owner behind the access `A`.
pub(crate) type KeyOf<A> = <<A as Access>::R as Reach>::Key;
/// The guard type of an owner behind the access `A`.
pub(crate) type GuardOf<A> = <<A as Access>::R as Reach>::Guard;

/// The set of keys of an owner reaching its table through `R`.
pub(crate) type SetOf<R> = HeldSet<<R as Reach>::Guard, <R as Reach>::Key>;

/// A pending call's cell (`pending.rs`) for an owner reaching its table
/// through `R`.
pub(crate) type PendingOf<R> =
    Pending<<R as Reach>::Lock, <<R as Reach>::Guard as GuardOps>::Upgrading, <R as Reach>::Guard>;

/// The list of pending calls' cells of an owner reaching its table
/// through `R`.
pub(crate) type PendingListOf<R> = PendingList<
    <R as Reach>::Lock,
    <<R as Reach>::Guard as GuardOps>::Upgrading,
    <R as Reach>::Guard,
>;

/// The borrowed form's slot for its call's parked wait (`pending.rs`), for
/// an owner reaching its table through `R`.
pub(crate) type ParkedOf<R> = ParkedSlot<<R as Reach>::Lock, <R as Reach>::Guard>;

/// What does not change during a transaction: its table and options.
#[derive(Debug)]
pub(crate) struct Owner<R> {
    pub(crate) reach: R,
    pub(crate) opts: Resolved,
    /// What its calls do with a key that is not free (beside `retryable`:
    /// the two share a word).
    pub(crate) wait: WaitPolicy,
    /// Keeps the transaction's label registered with its table while the
    /// transaction lives (labeled transactions only).
    pub(crate) _label: Option<crate::table::labels::Alive>,
    /// Set when a call of the transaction failed in a way that a retry
    /// of the whole transaction may not (it was a deadlock's victim, or its
    /// upgrade conflicted with another's): what the retry helper
    /// (`retry.rs`) asks, whatever error the caller's closure returned.
    /// Written only on those failures.
    pub(crate) retryable: AtomicBool,
}

impl<R> Owner<R> {
    pub(crate) fn new(
        reach: R,
        (opts, wait): (Resolved, WaitPolicy),
        label: Option<crate::table::labels::Alive>,
    ) -> Self {
        Self {
            reach,
            opts,
            wait,
            _label: label,
            retryable: AtomicBool::new(false),
        }
    }

    /// Whether dropping the owner frees nothing (no label registered; its
    /// reach is a borrow).
    #[inline]
    pub(crate) fn owns_nothing(&self) -> bool
    where
        R: Copy,
    {
        self._label.is_none()
    }

    /// Notes `out`'s failure, if retryable (see [`Owner::retryable`]).
    #[inline]
    pub(crate) fn note<T, K>(&self, out: &Result<T, TransactionError<K>>) {
        if let Err(error) = out {
            if error.is_retryable() {
                self.note_retryable();
            }
        }
    }

    #[cold]
    fn note_retryable(&self) {
        self.retryable.store(true, Ordering::Relaxed);
    }

    /// Whether a call failed retryably (see [`Owner::retryable`]).
    pub(crate) fn failed_retryably(&self) -> bool {
        self.retryable.load(Ordering::Relaxed)
    }
}

/// The transaction ended while a call was pending.
#[derive(Debug)]
pub(crate) struct Ended;

/// A call's way to its transaction.
pub(crate) trait Access {
    type R: Reach;

    /// Whether this call is the transaction's only one (the borrowed form):
    /// then a `lock_all` may take keys on the table before it claims them
    /// in the set. With other calls pending (the owned form), a `lock_all`
    /// claims first, so that a second call for the same key fails
    /// `InFlight` rather than waiting on its own transaction's grant (a
    /// single lock's attempt is marked instead: see [`look`](Self::look)).
    const SOLE: bool;

    fn owner(&self) -> &Owner<Self::R>;

    /// Runs `f` on the set of keys, unless the transaction has ended.
    fn with<T>(&mut self, f: impl FnOnce(&mut SetOf<Self::R>) -> T) -> Result<T, Ended>;

    /// The owner and the set at once, in the borrowed form ([`SOLE`]: the
    /// call has the transaction to itself, and no lock is held); `None` in
    /// the owned form.
    ///
    /// [`SOLE`]: Self::SOLE
    fn sole(&mut self) -> Option<Sole<'_, Self::R>>;

    /// A lock's fast path, in one step on the set (under its lock, in the
    /// owned form): a key held in a covering mode is counted; an absent one
    /// is tried on the table by `try_` (which must wake and drop nothing:
    /// see [`Reach::try_lock_leaving`]) and, if had, put in. User code
    /// (`Eq`) runs in the search and the table's probe. The key is kept in
    /// a slot of the caller's that `try_` takes it from (and leaves it in
    /// if the table did not keep it): in the owned form the slot outlives
    /// the lock, so the key is dropped after it even if an `Eq` panics.
    fn fast(
        &mut self,
        hash: u64,
        key: KeyOf<Self>,
        mode: Mode,
        try_: impl FnOnce(&Owner<Self::R>, &mut Option<KeyOf<Self>>) -> Option<GuardOf<Self>>,
    ) -> Fast<KeyOf<Self>>;

    /// Whether the transaction has ended (cheap, no lock).
    fn is_ended(&self) -> bool;

    /// Whether a waiter is queued on any key the set holds (so may wait
    /// for the transaction); `true` if that cannot be told cheaply.
    fn set_is_awaited(&self) -> bool;

    /// A call starts a wait (counted by the borrowed form, whose
    /// [`set_is_awaited`](Self::set_is_awaited) must know of a forgotten
    /// call, which may hold a grant outside the set).
    fn wait_begins(&mut self);

    /// The wait [`wait_begins`](Self::wait_begins) counted is over.
    fn wait_ends(&mut self);

    /// A call of the transaction took a grant (done, `Ok`): if another
    /// call of it waits (the owned form), queued waiters may now wait for
    /// this grant (one taken past the queue, an upgrade at once) with no
    /// wait beginning, so no search ran through the new edge. The other
    /// calls' waits are woken to search again ([`epoch`](Self::epoch)).
    fn took_grant(&self);

    /// Counts [`took_grant`](Self::took_grant)'s that woke waits: a wait
    /// whose count moved since it last searched searches again.
    fn epoch(&self) -> u64;

    /// Registers `waker` (in `slot`) to be woken when the transaction ends;
    /// returns whether it already has.
    fn watch(&mut self, slot: &mut Option<usize>, waker: &Waker) -> bool;

    fn unwatch(&mut self, slot: usize);

    /// Puts a waiting call's lock future on the transaction's list of
    /// pending calls (`pending.rs`), which the transaction's end cancels;
    /// `Err` if it has ended.
    fn pend(&mut self, pending: &Arc<PendingOf<Self::R>>) -> Result<(), Ended>;

    /// Takes a call's cell off the list once the call is done with it
    /// (its wait over, its cell cancelled or emptied), so that a
    /// transaction whose calls all ended has nothing to cancel when it
    /// ends. A forgotten call never gets here: its cell stays on the list.
    fn unpend(&mut self, pending: &Arc<PendingOf<Self::R>>);

    /// The slot where the borrowed form's `lock_all` parks its wait
    /// (`pending::Parked`); the owned form's calls use cells.
    fn parked(&mut self) -> &mut ParkedOf<Self::R>;

    /// [`owner`](Self::owner) and [`parked`](Self::parked) at once.
    fn owner_and_parked(&mut self) -> (&Owner<Self::R>, &mut ParkedOf<Self::R>);

    /// Parks the borrowed form's wait for a new key (`pending::park`): the
    /// table's lock future for `key` (hash `hash`) on `opts`, made for its
    /// block (not polled yet), and the guards the call took. A wait still
    /// parked is a forgotten call's (the transaction is borrowed by this
    /// call): its waiter leaves its queue here, and its registration with
    /// the deadlock detector goes with it (see [`forget_forgotten`]).
    fn park(
        &mut self,
        hash: u64,
        key: KeyOf<Self>,
        opts: LockOptions,
        guards: Taken<GuardOf<Self>>,
    ) {
        let (owner, parked) = self.owner_and_parked();
        if pending::park(parked, || owner.reach.lock_with(hash, key, opts), guards) {
            forget_forgotten(self.owner());
        }
    }

    /// Lets go of a wait still parked before the borrowed form's call parks
    /// one in its own block (`fresh.rs`): a forgotten call's, as in
    /// [`park`](Self::park).
    fn clear_forgotten(&mut self) {
        if pending::clear_parked(self.parked()) {
            forget_forgotten(self.owner());
        }
    }
}

/// A borrowed transaction let go of a forgotten call's wait (parking the
/// next call's, or waiting through a cell): its registrations with the
/// deadlock detector go now, not when the next wait registers (which
/// drops them too: `LockTable::enter_wait`). In between, the next call's
/// waiter may be queued on the same key, and the table gives a registered
/// wait the edges of the transaction's waiter on its key: a search then
/// read the forgotten wait's mode over the new waiter's edges, and an
/// exclusive registration over a shared waiter passed over the waiter
/// ahead of it (`passes_over`), marking it visited: a cycle through that
/// waiter, closed by the searching wait, went unanswered for good.
/// Registrations of the borrowed form's other forgotten calls (waiting in
/// cells) go too, as that registration drops them.
fn forget_forgotten<R: Reach>(owner: &Owner<R>) {
    owner
        .reach
        .table()
        .detector()
        .forget_owner(owner.opts.id.get());
}

/// The owner and the set of a borrowed transaction, at once
/// ([`Access::sole`]).
pub(crate) type Sole<'a, R> = (&'a Owner<R>, &'a mut SetOf<R>);

/// The table lock future of an owner's calls.
pub(crate) type LockOf<A> = <<A as Access>::R as Reach>::Lock;

/// An owner's calls' owning upgrade (see [`GuardOps::upgrade_owned`]).
pub(crate) type UpgradingOf<A> = <<<A as Access>::R as Reach>::Guard as GuardOps>::Upgrading;

/// What [`Access::fast`] did.
#[derive(Debug)]
pub(crate) enum Fast<K> {
    /// Counted on a covering grant, or taken: done.
    Done(Acquired),
    /// Not free at once: the key back, for the claiming path's wait.
    NotFree(K),
    /// Held in a weaker mode, or busy with another call: the claiming path.
    Other(K),
    /// The transaction has ended (the key, to drop).
    Ended(K),
}

/// The borrowed form: the call has the transaction to itself, and it cannot
/// end while the call is pending.
pub(crate) struct Direct<'a, R: Reach> {
    pub(crate) owner: &'a Owner<R>,
    pub(crate) set: &'a mut SetOf<R>,
    /// The transaction's pending calls (see `pending.rs`).
    pub(crate) pending: &'a mut PendingListOf<R>,
    pub(crate) parked: &'a mut ParkedOf<R>,
}

impl<R: Reach> Access for Direct<'_, R> {
    type R = R;

    const SOLE: bool = true;

    #[inline]
    fn owner(&self) -> &Owner<R> {
        self.owner
    }

    #[inline]
    fn with<T>(&mut self, f: impl FnOnce(&mut SetOf<R>) -> T) -> Result<T, Ended> {
        Ok(f(self.set))
    }

    #[inline]
    fn sole(&mut self) -> Option<Sole<'_, R>> {
        Some((self.owner, &mut *self.set))
    }

    #[inline]
    fn fast(
        &mut self,
        hash: u64,
        key: KeyOf<Self>,
        mode: Mode,
        try_: impl FnOnce(&Owner<R>, &mut Option<KeyOf<Self>>) -> Option<GuardOf<Self>>,
    ) -> Fast<KeyOf<Self>> {
        fast_in(self.set, self.owner, hash, &mut Some(key), mode, try_)
    }

    #[inline]
    fn is_ended(&self) -> bool {
        false
    }

    fn set_is_awaited(&self) -> bool {
        self.set.is_awaited()
    }

    #[inline]
    fn wait_begins(&mut self) {
        self.set.waits += 1;
    }

    #[inline]
    fn wait_ends(&mut self) {
        self.set.waits -= 1;
    }

    /// The borrowed form's call is its transaction's only one.
    #[inline]
    fn took_grant(&self) {}

    #[inline]
    fn epoch(&self) -> u64 {
        0
    }

    #[inline]
    fn watch(&mut self, _: &mut Option<usize>, _: &Waker) -> bool {
        false
    }

    #[inline]
    fn unwatch(&mut self, _: usize) {}

    fn pend(&mut self, pending: &Arc<PendingOf<R>>) -> Result<(), Ended> {
        // A wait through a cell (an upgrade, a `lock_all` that upgrades)
        // lets go of a forgotten call's parked wait first, as `park` does:
        // with the transaction borrowed by this call, a wait still parked
        // is a forgotten call's, and a grant handed to it is held outside
        // the set, where this wait would queue behind it for good (the
        // detector has no edge from a transaction to itself).
        if pending::clear_parked(self.parked) {
            forget_forgotten(self.owner);
        }
        pending::push(self.pending, pending);
        Ok(())
    }

    #[inline]
    fn unpend(&mut self, pending: &Arc<PendingOf<R>>) {
        drop(pending::remove(self.pending, pending));
    }

    #[inline]
    fn parked(&mut self) -> &mut ParkedOf<R> {
        self.parked
    }

    #[inline]
    fn owner_and_parked(&mut self) -> (&Owner<R>, &mut ParkedOf<R>) {
        (self.owner, self.parked)
    }
}

/// The owned form's state, shared by the handle and its pending futures.
///
/// Field order is drop order: the state (its guards) goes before the owner
/// (its way to the table), which the guards may borrow (`reach::Pinned`).
pub(crate) struct Shared<R: Reach> {
    /// The table's spin lock (see `shard_lock.rs`): its sections are a
    /// search of the set and a few stores, and it unlocks with a store, not
    /// a read-modify-write (two calls per lock: a look and a put).
    state: ShardMutex<State<R>>,
    /// Set once, under `state`'s lock; read without it as a hint.
    ended: AtomicBool,
    /// How many of its calls wait now (a forgotten one for good).
    waits: AtomicU64,
    /// Bumped when a call took a grant while others waited
    /// ([`Access::took_grant`]).
    epoch: AtomicU64,
    owner: Owner<R>,
}

/// [`Access::fast`] on a set the caller has to itself. The key stays in
/// `slot` unless the table kept it: the caller drops what is left there
/// (after any lock it holds).
#[inline]
fn fast_in<R: Reach>(
    set: &mut SetOf<R>,
    owner: &Owner<R>,
    hash: u64,
    slot: &mut Option<R::Key>,
    mode: Mode,
    try_: impl FnOnce(&Owner<R>, &mut Option<R::Key>) -> Option<R::Guard>,
) -> Fast<R::Key> {
    let Some(key) = slot.as_ref() else {
        unreachable!("the caller's key, in its slot")
    };
    match set.find(hash, key, mode) {
        Found::Covered { at } => Fast::Done(set.reenter(at)),
        Found::Absent => match try_(owner, slot) {
            Some(guard) => Fast::Done(set.insert(hash, guard)),
            None => Fast::NotFree(slot.take().expect("kept when not taken")),
        },
        Found::Other => Fast::Other(slot.take().expect("not taken")),
    }
}

struct State<R: Reach> {
    set: SetOf<R>,
    /// Pending calls' lock futures, cancelled when the transaction ends
    /// (see `pending.rs`).
    pending: PendingListOf<R>,
    /// The wakers of pending futures, woken when the transaction ends.
    watchers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl<R: Reach> Shared<R> {
    pub(crate) fn new(owner: Owner<R>) -> Self {
        Self {
            state: ShardMutex::new(State {
                set: HeldSet::default(),
                pending: PendingList::new(),
                watchers: Vec::new(),
                free: Vec::new(),
            }),
            ended: AtomicBool::new(false),
            waits: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            owner,
        }
    }

    pub(crate) fn owner(&self) -> &Owner<R> {
        &self.owner
    }

    /// Bumps the epoch and wakes every pending call (their wakers taken
    /// out: each registers again as it polls), after the lock is released.
    #[cold]
    fn wake_waits(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let wakers: Vec<Waker> = {
            let mut state = self.lock();
            state.watchers.iter_mut().filter_map(Option::take).collect()
        };
        let mut panic = None;
        for waker in wakers {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| waker.wake())) {
                panic.get_or_insert(payload);
            }
        }
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    /// The state, whatever a panic in user code (a key's `Eq` during a
    /// lookup) left it: the set changes only after user code ran,
    /// so a lock released by a panic guards a consistent set (its poison,
    /// if any, is ignored).
    fn lock(&self) -> impl DerefMut<Target = State<R>> + '_ {
        self.state.lock()
    }

    /// Runs `f` on the set unless the transaction ended.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mut SetOf<R>) -> T) -> Result<T, Ended> {
        let mut state = self.lock();
        if self.ended.load(Ordering::Relaxed) {
            // `f` may own a guard or a key: released after unlocking.
            drop(state);
            drop(f);
            return Err(Ended);
        }
        Ok(f(&mut state.set))
    }

    /// Ends the transaction: releases every key it holds and wakes its
    /// pending futures (see the module doc). Idempotent.
    pub(crate) fn end(&self) {
        self.end_with(|set| drop(set.take()));
    }

    /// Ends the transaction, giving its keys to `release` (run after
    /// unlocking; what it leaves in the set is dropped after it), then
    /// wakes its pending futures, even if `release` panics. `None` if it
    /// had already ended, or if a panic was swallowed because the thread
    /// is already unwinding.
    pub(crate) fn end_with<T>(&self, release: impl FnOnce(&mut SetOf<R>) -> T) -> Option<T> {
        // Taken out once, then worked on in place (not moved again: the set
        // is a few hundred bytes).
        let mut slots;
        let pending;
        let watchers;
        {
            let mut state = self.lock();
            if self.ended.swap(true, Ordering::Relaxed) {
                return None;
            }
            slots = state.set.take();
            state.free = Vec::new();
            pending = std::mem::take(&mut state.pending);
            watchers = std::mem::take(&mut state.watchers);
        }
        // Release first, so the keys are free by the time anyone is woken;
        // a panic there (a key's drop, a handoff's wake) still releases the
        // rest (see `HeldSet`'s drop), still cancels the pending calls and
        // still wakes everyone. The pending calls' lock futures go next (a
        // forgotten call's waiter leaves its queue, its unobserved grant
        // passes on: `pending.rs`).
        let released = catch_unwind(AssertUnwindSafe(|| release(&mut slots)));
        // Whatever `release` left (a panic midway: the rest of the keys).
        let rest = catch_unwind(AssertUnwindSafe(|| drop(slots)));
        let cancelled = catch_unwind(AssertUnwindSafe(|| pending::cancel_all(pending)));
        if self.waits.load(Ordering::SeqCst) != 0 {
            // Calls forgotten in a wait may have left registrations with
            // the deadlock detector that never leave by themselves (live
            // calls, woken below, find theirs gone: harmless).
            let owner = &self.owner;
            owner
                .reach
                .table()
                .detector()
                .forget_owner(owner.opts.id.get());
        }
        let mut panic = rest.err().or(cancelled.err());
        for waker in watchers.into_iter().flatten() {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| waker.wake())) {
                panic.get_or_insert(payload);
            }
        }
        // The first panic goes on, unless the thread is already unwinding
        // (an end in a drop during a panic): a second panic there would
        // abort the process; the keys are released all the same.
        let first = match released {
            Ok(out) => match panic {
                None => return Some(out),
                Some(payload) => payload,
            },
            Err(payload) => payload,
        };
        if !std::thread::panicking() {
            resume_unwind(first);
        }
        None
    }
}

impl<R: Reach> Access for Arc<Shared<R>> {
    type R = R;

    const SOLE: bool = false;

    #[inline]
    fn owner(&self) -> &Owner<R> {
        &self.owner
    }

    #[inline]
    fn sole(&mut self) -> Option<Sole<'_, R>> {
        None
    }

    #[inline]
    fn with<T>(&mut self, f: impl FnOnce(&mut SetOf<R>) -> T) -> Result<T, Ended> {
        Shared::with(self, f)
    }

    fn fast(
        &mut self,
        hash: u64,
        key: KeyOf<Self>,
        mode: Mode,
        try_: impl FnOnce(&Owner<R>, &mut Option<KeyOf<Self>>) -> Option<GuardOf<Self>>,
    ) -> Fast<KeyOf<Self>> {
        // Declared before the lock, so dropped after it: a key counted on
        // a held grant, one the table did not keep, or one an `Eq` panic
        // unwinds past, drops with the set unlocked (its `Drop` is user
        // code, which may call back into the transaction).
        let mut slot = Some(key);
        let mut state = self.lock();
        if self.ended.load(Ordering::Relaxed) {
            drop(state);
            return Fast::Ended(slot.take().expect("not taken"));
        }
        // The whole step under the set's lock: no other call of the
        // transaction sees the key between its look and its grant, so two
        // locks of one new key take it once and count it once, and neither
        // queues behind its own transaction's grant.
        fast_in(&mut state.set, &self.owner, hash, &mut slot, mode, try_)
    }

    #[inline]
    fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Relaxed)
    }

    /// Never asked (the owned form's waits are [`Holding::Unknown`]):
    /// looking would take the set's lock under the detector's, whose one
    /// mutex would then wait on any transaction's lock (and the `K: Eq`
    /// that runs under it).
    fn set_is_awaited(&self) -> bool {
        true
    }

    fn wait_begins(&mut self) {
        // What this call took before its wait (a `lock_all`'s keys) may be
        // waited for now by waiters queued before it took them: the
        // transaction's other waits search again (`took_grant`).
        if self.waits.fetch_add(1, Ordering::SeqCst) != 0 {
            self.wake_waits();
        }
    }

    fn wait_ends(&mut self) {
        self.waits.fetch_sub(1, Ordering::SeqCst);
    }

    #[inline]
    fn took_grant(&self) {
        if self.waits.load(Ordering::SeqCst) != 0 {
            self.wake_waits();
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn watch(&mut self, slot: &mut Option<usize>, waker: &Waker) -> bool {
        // A waker's clone is user code (it may call back into this
        // transaction, whose lock is a spin lock): made before locking, and
        // only if the registered waker would not do; the waker it replaces
        // is dropped after unlocking.
        let mut fresh = None;
        loop {
            let mut locked = self.lock();
            if self.ended.load(Ordering::Relaxed) {
                drop(locked);
                return true;
            }
            let state = &mut *locked;
            let registered = slot.and_then(|index| state.watchers[index].as_ref());
            if registered.is_some_and(|current| current.will_wake(waker)) {
                drop(locked);
                return false;
            }
            let Some(waker) = fresh.take() else {
                drop(locked);
                fresh = Some(waker.clone());
                continue;
            };
            let index = match *slot {
                Some(index) => index,
                None => {
                    let index = match state.free.pop() {
                        Some(index) => index,
                        None => {
                            state.watchers.push(None);
                            state.watchers.len() - 1
                        }
                    };
                    *slot = Some(index);
                    index
                }
            };
            let old = state.watchers[index].replace(waker);
            drop(locked);
            drop(old);
            return false;
        }
    }

    fn pend(&mut self, pending: &Arc<PendingOf<R>>) -> Result<(), Ended> {
        let mut state = self.lock();
        if self.ended.load(Ordering::Relaxed) {
            return Err(Ended);
        }
        pending::push(&mut state.pending, pending);
        Ok(())
    }

    fn unpend(&mut self, pending: &Arc<PendingOf<R>>) {
        let removed = {
            let mut state = self.lock();
            // After the end the list is gone (its cells cancelled).
            if self.ended.load(Ordering::Relaxed) {
                return;
            }
            pending::remove(&mut state.pending, pending)
        };
        // The cell (its last reference, perhaps) is freed unlocked.
        drop(removed);
    }

    fn parked(&mut self) -> &mut ParkedOf<R> {
        unreachable!("only the borrowed form's lock_all parks its wait")
    }

    fn owner_and_parked(&mut self) -> (&Owner<R>, &mut ParkedOf<R>) {
        unreachable!("only the borrowed form's lock_all parks its wait")
    }

    fn unwatch(&mut self, slot: usize) {
        let mut state = self.lock();
        if self.ended.load(Ordering::Relaxed) {
            // The watchers went with the end.
            return;
        }
        let old = state.watchers[slot].take();
        state.free.push(slot);
        drop(state);
        drop(old);
    }
}

/// What stopped a wait before its future completed.
#[derive(Debug)]
pub(crate) enum Stop<K> {
    /// The transaction ended.
    Ended,
    /// The wait closed a deadlock cycle, and the transaction is its victim.
    Deadlock(Deadlock<K>),
}

impl<K> From<Stop<K>> for TransactionError<K> {
    fn from(stop: Stop<K>) -> Self {
        match stop {
            Stop::Ended => TransactionError::Ended,
            Stop::Deadlock(deadlock) => TransactionError::Deadlock(deadlock),
        }
    }
}

/// A transaction's wait for a key, for deadlock detection: the key, its
/// hash and the mode asked for. The key is the caller's (or a clone of
/// it); a wait the detector registers gets a clone of its own, in a cell
/// the registry holds alone, dropped when the wait leaves (as the call's
/// wait ends: a key whose `Drop` panics there unwinds through a call that
/// undoes itself, as any panic in its wait does).
pub(crate) struct WaitFor<'k, K> {
    pub(crate) hash: u64,
    pub(crate) key: &'k K,
    pub(crate) mode: Mode,
    /// What the transaction holds while this call waits.
    pub(crate) holding: Holding,
}

/// What a waiting call knows its transaction holds, for deadlock
/// detection (see `LockTable::enter_wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holding {
    /// No grant, and no other call can give it one while this one waits.
    Nothing,
    /// Exactly the keys of its set, unless another of its calls is (or was,
    /// and was forgotten) in a wait, which the set counts: the borrowed
    /// form's lock of a new key.
    TheSet,
    /// Grants of this call outside the set (a `lock_all`'s, an upgrade's),
    /// or keys another call may take meanwhile (the owned form).
    Unknown,
}

/// Awaits a lock of `wait`, polled by `poll` (given the access: a parked
/// wait is reached through it), unless the transaction ends first (then
/// the caller drops the lock, releasing what it had). Once it is queued, the wait
/// is registered with the table's deadlock detector; if it closes a cycle,
/// the wait stops with [`Stop::Deadlock`] (and the caller drops the lock,
/// leaving the queue).
pub(crate) async fn wait_unless_ended<A: Access, T>(
    access: &mut A,
    wait: WaitFor<'_, KeyOf<A>>,
    mut poll: impl FnMut(&mut A, &mut Context<'_>) -> Poll<T>,
) -> Result<T, Stop<KeyOf<A>>>
where
    KeyOf<A>: Clone,
{
    /// Unregisters the waker and the wait when the wait ends, however it
    /// ends: at its end ([`end`](Watch::end)), or as it drops (the call
    /// cancelled, or unwinding).
    struct Watch<'a, A: Access> {
        access: &'a mut A,
        slot: Option<usize>,
        /// Registered with the detector, under this id.
        detecting: Option<usize>,
        ended: bool,
    }
    impl<A: Access> Watch<'_, A> {
        /// Unregisters both; a panic in either (an old waker's drop, the
        /// drop of the registration's copy of the key: user code) is
        /// returned, after both have run, not raised: a wait left
        /// registered would hold its key and could close false cycles.
        fn end(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
            self.ended = true;
            self.access.wait_ends();
            let unwatched = self.slot.take().and_then(|slot| {
                let access = &mut *self.access;
                catch_unwind(AssertUnwindSafe(|| access.unwatch(slot))).err()
            });
            let left = self.detecting.take().and_then(|id| {
                let owner = self.access.owner();
                let detector = owner.reach.table().detector();
                let id_of_owner = owner.opts.id.get();
                catch_unwind(AssertUnwindSafe(|| detector.leave(id_of_owner, id))).err()
            });
            unwatched.or(left)
        }
    }
    impl<A: Access> Drop for Watch<'_, A> {
        fn drop(&mut self) {
            if self.ended {
                return;
            }
            if let Some(payload) = self.end() {
                if !std::thread::panicking() {
                    resume_unwind(payload);
                }
            }
        }
    }

    access.wait_begins();
    let mut watch = Watch {
        access,
        slot: None,
        detecting: None,
        ended: false,
    };
    let mut searched = false;
    let mut epoch = 0;
    let out = poll_fn(|cx| {
        if watch.access.is_ended() {
            return Poll::Ready(Err(Stop::Ended));
        }
        if !searched && watch.access.owner().reach.table().clock().budget_spent() {
            // Under tokio's budget a lock future polled with none left
            // returns `Pending` before it is queued, and the search below
            // would find no cycle through a wait not queued yet, nor run
            // again once it is (a cycle it closes would be missed for
            // good). So the first poll waits for the task's next turn,
            // which has budget again.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Poll::Ready(out) = poll(&mut *watch.access, cx) {
            return Poll::Ready(Ok(out));
        }
        if !searched {
            epoch = watch.access.epoch();
            // Queued now (a first poll made with budget returns `Pending`
            // only once queued): the first time, look for a cycle this
            // wait closes.
            searched = true;
            let owner = watch.access.owner();
            let table = owner.reach.table();
            // A transaction that holds nothing, and can get nothing while
            // this call waits (the borrowed form's only call), is waited
            // for only by transactions queued behind it on this key, which
            // come after it and whose searches follow it through the queue
            // (`deadlock.rs`): it closes no cycle and is not registered.
            if table.detector().is_on() && wait.holding != Holding::Nothing {
                // The wait's key cell, shared with the registry (its address
                // is the wait's id): made only for a wait it registers.
                let key = Arc::new(wait.key.clone());
                let id = owner.opts.id.get();
                // Whether anyone may wait for the transaction through a key
                // it holds: asked once the wait is registered.
                let access = &*watch.access;
                let awaited = || wait.holding != Holding::TheSet || access.set_is_awaited();
                // Set first: if the search panics (a key's `Eq`), the wait
                // it registered is unregistered as the guard drops. (A
                // transaction's other pending calls have waits of their
                // own, each under its call's key cell.)
                watch.detecting = Some(wait_id(&key));
                if let Err(deadlock) =
                    table.enter_wait(id, wait.hash, key, wait.mode, A::SOLE, awaited)
                {
                    // Registered: the guard unregisters it as it drops.
                    return Poll::Ready(Err(Stop::Deadlock(deadlock)));
                }
            }
        }
        if watch.access.watch(&mut watch.slot, cx.waker()) {
            return Poll::Ready(Err(Stop::Ended));
        }
        if let Some(wait_id) = watch.detecting {
            // Another call of the transaction took a grant since this wait
            // last searched: an edge into the transaction may have appeared
            // with no wait beginning (see `Access::took_grant`). Asked after
            // the waker is registered: a grant whose wake came before it
            // (and so woke nobody) bumped the epoch before it took the
            // wakers, so it shows here.
            let now = watch.access.epoch();
            if now != epoch {
                epoch = now;
                let owner = watch.access.owner();
                let table = owner.reach.table();
                if let Err(deadlock) = table.search_again(owner.opts.id.get(), wait_id) {
                    return Poll::Ready(Err(Stop::Deadlock(deadlock)));
                }
            }
        }
        Poll::Pending
    })
    .await;
    // The wait ends here, not as the watch drops: a panic in its end would
    // otherwise unwind out of this future while it returns `out`, and a
    // value being returned when a drop panics is leaked, not dropped (a
    // granted guard, its key held for good). So `out` is dropped first
    // (released) and the panic goes on.
    if let Some(payload) = watch.end() {
        drop(catch_unwind(AssertUnwindSafe(|| drop(out))));
        resume_unwind(payload);
    }
    out
}
