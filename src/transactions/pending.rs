//! What a waiting call holds outside its transaction's set, shared
//! between the call and its transaction, so that the transaction owns its
//! grants whatever the call's future does.
//!
//! A call that must wait keeps, in a [`Pending`] cell (a heap cell behind a
//! small spin lock, reached by an `Arc` from the call and from the
//! transaction's list of pending calls: `Transaction::pending`, or the
//! owned form's state), everything of the table it has outside the set
//! while it waits: the wait itself (a new key's table lock future, its
//! waiter node and the grant once one is handed to it; or an upgrade,
//! which owns the guard it upgrades) and the guards it has taken and not
//! yet put into the set (a `lock_all`'s keys taken before the one it waits
//! for, and the held keys it claimed to upgrade). The call polls the wait
//! through the cell, puts its guards in before it suspends and takes them
//! back when it resumes, and, however it stops waiting (done, failed,
//! dropped), cancels its cell and takes it off the list (`Access::unpend`;
//! a `lock_all` dropped at an await leaves its cancelled cell there, for
//! the next wait or the end to drop), so a transaction whose calls all
//! ended has nothing to cancel and frees nothing of theirs when it ends.
//! A call future that is forgotten
//! (`mem::forget` of its box: safe Rust) never does: its cell stays on the
//! list, and when the transaction ends (commit, abort, drop) it cancels
//! every cell still there, dropping what it holds, which does what
//! dropping any lock future and guard does: a waiter leaves the queue, a
//! grant handed to it and never observed passes on, an upgrade is undone
//! and its guard released, a guard releases its key. So nothing of a
//! transaction stays held after it ended, and a plain lock runs none of
//! this: only a transaction's contended wait makes a cell.
//!
//! The borrowed form's waits for new keys need no cell ([`Parked`]): its
//! transaction is borrowed by the call, so the call parks its wait and
//! its guards in the transaction itself, reached through the borrow.
//! Upgrades, and every wait of the owned form, use cells.
//!
//! The wait is boxed inside the cell, so cancelling moves a pointer out
//! and drops the wait after the cell's lock is released (its drop enters
//! the table, which wakes what it must after its own unlock). A poll takes
//! the wait out of the cell, polls it with no lock held (the poll runs user
//! code: a waker's `clone`, which may call back into the transaction, end
//! it even), and puts it back; an end that cancels meanwhile marks the
//! cell, and the poll drops the wait as it returns. The cell's lock is
//! held only for a few moves, and nothing else is locked inside it.

use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::error::LockError;
use crate::support::recycle::Recycled;
use crate::support::shard_lock::ShardMutex;
use crate::support::token::FencingToken;

/// What a waiting call holds outside its transaction's set, cancellable by
/// the transaction: `L` a table lock future, `U` an upgrade that owns its
/// guard, `G` a guard.
pub(crate) struct Pending<L, U, G> {
    state: ShardMutex<Inner<L, U, G>>,
}

struct Inner<L, U, G> {
    phase: Phase,
    /// The wait, between polls.
    wait: Option<Wait<L, U>>,
    /// The guards the call stowed before suspending, each with the call's
    /// own index for it.
    guards: Taken<G>,
}

/// Only the call polls the wait (one poll at a time: the call's future is
/// polled through `&mut`); the transaction's end may cancel the cell at
/// any time, from any thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The call's: the wait, if any, is in the cell between polls.
    Open,
    /// The wait is out of the cell, being polled (no lock is held while it
    /// is: the poll runs user code, a waker's `clone`).
    Polling,
    /// Cancelled (by the end, or taken back by the call's own undo): what
    /// was in the cell is gone, and the wait is dropped by the poll that
    /// has it out.
    Cancelled,
}

/// A call's wait.
pub(crate) enum Wait<L, U> {
    /// A new key's table lock future.
    Lock(Pin<Recycled<L>>),
    /// An upgrade, owning the guard it upgrades.
    Upgrade(Pin<Recycled<U>>),
}

/// How a wait ended.
pub(crate) enum Waited<G> {
    /// The new key's guard, or the upgraded one.
    Granted(G),
    /// The wait failed; an upgrade's guard is back, shared.
    Failed(Option<G>, LockError),
}

/// The transaction ended (or the call gave its cell up).
#[derive(Debug)]
pub(crate) struct Cancelled;

impl<L, U, G> Pending<L, U, G> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: ShardMutex::new(Inner {
                phase: Phase::Open,
                wait: None,
                guards: Taken::new(),
            }),
        })
    }

    /// Puts the call's next wait into the cell; `Err` (the wait dropped,
    /// after the cell's lock is released) if it was cancelled.
    pub(crate) fn start(&self, wait: Wait<L, U>) -> Result<(), Cancelled> {
        let mut state = self.state.lock();
        if state.phase == Phase::Cancelled {
            drop(state);
            drop(wait);
            return Err(Cancelled);
        }
        debug_assert!(state.wait.is_none(), "one wait at a time");
        state.wait = Some(wait);
        Ok(())
    }

    /// Stows the call's guards in the cell before it suspends; `Err` (the
    /// guards released, after the cell's lock is released) if it was
    /// cancelled. Gathered before the lock is taken.
    pub(crate) fn stow(
        &self,
        guards: impl IntoIterator<Item = (usize, G)>,
    ) -> Result<(), Cancelled> {
        self.stow_all(guards.into_iter().collect())
    }

    /// [`stow`](Self::stow) of a list, moved in whole when the cell has
    /// none (a call that waits many times with many keys taken moves a
    /// pointer each time, not each guard).
    pub(crate) fn stow_all(&self, guards: Taken<G>) -> Result<(), Cancelled> {
        let mut state = self.state.lock();
        if state.phase == Phase::Cancelled {
            drop(state);
            drop(guards);
            return Err(Cancelled);
        }
        if state.guards.is_empty() {
            // The empty list it replaces holds no guard to drop under the
            // lock.
            state.guards = guards;
        } else {
            state.guards.extend(guards);
        }
        Ok(())
    }

    /// Takes the stowed guards back as the call resumes; `Err` if the cell
    /// was cancelled (they were released).
    pub(crate) fn unstow(&self) -> Result<Taken<G>, Cancelled> {
        let mut state = self.state.lock();
        if state.phase == Phase::Cancelled {
            return Err(Cancelled);
        }
        Ok(std::mem::take(&mut state.guards))
    }

    /// Cancels the cell (the transaction ended): its wait and guards are
    /// dropped here, after the cell's lock is released; a wait being polled
    /// is dropped by its poll as it ends.
    pub(crate) fn cancel(&self) {
        let (wait, guards) = {
            let mut state = self.state.lock();
            state.phase = Phase::Cancelled;
            (state.wait.take(), std::mem::take(&mut state.guards))
        };
        // The wait first: an upgrade is undone before its guard goes.
        drop(wait);
        drop(guards);
    }

    /// The call's own undo (its future dropped, or unwinding): takes back
    /// everything the cell holds, an upgrade's guard as `undo` gives it back
    /// (shared), and closes the cell; `None` if the end cancelled it first
    /// (everything was released).
    #[allow(clippy::type_complexity)]
    pub(crate) fn recover(
        &self,
        undo: impl FnOnce(Pin<&mut U>) -> Option<G>,
    ) -> Option<(Taken<G>, Option<G>)> {
        let (wait, guards) = {
            let mut state = self.state.lock();
            if state.phase == Phase::Cancelled {
                return None;
            }
            state.phase = Phase::Cancelled;
            (state.wait.take(), std::mem::take(&mut state.guards))
        };
        let upgraded = match wait {
            Some(Wait::Upgrade(mut upgrade)) => undo(upgrade.as_mut()),
            // A lock's waiter leaves its queue (its unobserved grant passes
            // on) as it drops.
            Some(Wait::Lock(lock)) => {
                drop(lock);
                None
            }
            None => None,
        };
        Some((guards, upgraded))
    }
}

impl<L, U, G> Pending<L, U, G>
where
    L: Future<Output = Result<G, LockError>>,
    U: Future<Output = (G, Result<FencingToken, LockError>)>,
{
    /// Polls the wait, out of the cell (no lock held while it runs):
    /// `Ready(None)` if the cell was cancelled (the transaction ended), or
    /// holds no wait. The wait is dropped once done or cancelled, after the
    /// cell's lock is released; so is an output it gave after the cell was
    /// cancelled. If the poll panics (a waker's `clone`), the wait goes
    /// back into the cell for the call's undo, and the panic goes on.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Option<Waited<G>>> {
        let mut wait = {
            let mut state = self.state.lock();
            if state.phase != Phase::Open {
                return Poll::Ready(None);
            }
            match state.wait.take() {
                Some(wait) => {
                    state.phase = Phase::Polling;
                    wait
                }
                None => return Poll::Ready(None),
            }
        };
        let polled = catch_unwind(AssertUnwindSafe(|| match &mut wait {
            Wait::Lock(lock) => lock.as_mut().poll(cx).map(|out| match out {
                Ok(guard) => Waited::Granted(guard),
                Err(error) => Waited::Failed(None, error),
            }),
            Wait::Upgrade(upgrade) => upgrade.as_mut().poll(cx).map(|(guard, out)| match out {
                Ok(_) => Waited::Granted(guard),
                Err(error) => Waited::Failed(Some(guard), error),
            }),
        }));
        let mut state = self.state.lock();
        let cancelled = state.phase == Phase::Cancelled;
        if !cancelled {
            state.phase = Phase::Open;
        }
        match polled {
            Err(payload) => {
                if !cancelled {
                    state.wait = Some(wait);
                    drop(state);
                } else {
                    drop(state);
                    drop(wait);
                }
                resume_unwind(payload)
            }
            Ok(Poll::Pending) if !cancelled => {
                state.wait = Some(wait);
                Poll::Pending
            }
            Ok(out) => {
                drop(state);
                drop(wait);
                match out {
                    Poll::Ready(out) if !cancelled => Poll::Ready(Some(out)),
                    // The transaction ended meanwhile: the output (a guard)
                    // is released here.
                    out => {
                        drop(out);
                        Poll::Ready(None)
                    }
                }
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The borrowed form's wait for a new key, parked in its transaction
    /// (`Transaction::parked`) while the call waits: the table lock future
    /// of the key waited for and the guards the call took before it. The
    /// transaction is borrowed by the call, so only the call reaches it
    /// while the call lives (no cell, no lock); the call takes it back as
    /// its wait ends, and releases it if dropped. A forgotten call never
    /// does, and the transaction's end (or its next wait, parked or in a
    /// cell: `Access::pend`) drops it:
    /// the waiter leaves its queue, or its unobserved grant passes on, and
    /// the guards are released. One allocation per wait, where a cell takes
    /// two and a lock round trip per step.
    pub(crate) struct Parked<L, G> {
        #[pin]
        lock: L,
        guards: Taken<G>,
    }
}

/// A borrowed transaction's slot for its call's parked wait: none, one in
/// a block of its own ([`Parked`]), or one in the waiting call's own block
/// (a fresh fill's, `fresh.rs`), reached by address ([`InCall`]).
pub(crate) enum ParkedSlot<L, G> {
    Empty,
    Boxed(Pin<Recycled<Parked<L, G>>>),
    InCall(InCall<L>),
}

impl<L, G> ParkedSlot<L, G> {
    /// Whether no wait is parked.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Self::Empty)
    }
}

/// The address of a lock future pinned in a waiting call's own block, so
/// that the transaction can drop it if the call is forgotten: the one
/// allocation of a fresh fill's wait (`fresh.rs`) holds both.
///
/// The call lets go of it ([`let_go`](Self::let_go)) before it drops the
/// lock future itself. A call that never does was forgotten: its block is
/// never freed (its future is never dropped, and the block is freed only
/// by that drop), so the address stays valid, and the slot's holder drops
/// the lock future in place ([`clear_parked`]) and never touches it again.
pub(crate) struct InCall<L>(NonNull<L>);

// SAFETY: an `InCall` stands for the lock future it points to, which only
// the transaction's `&mut` holder reaches through it (to drop it): sending
// the transaction sends that future's ownership, as a box would.
unsafe impl<L: Send> Send for InCall<L> {}
// SAFETY: nothing reaches the lock future through a shared reference.
unsafe impl<L: Sync> Sync for InCall<L> {}

impl<L> InCall<L> {
    /// The wait whose lock future is `lock`.
    ///
    /// # Safety
    ///
    /// `lock` stays where it is, alive, until the slot that gets this lets
    /// go of it ([`let_go`](Self::let_go)) or drops it ([`clear_parked`]);
    /// its memory is freed only after one of them (never, if the call is
    /// forgotten), and nothing else drops it while the slot holds it.
    pub(crate) unsafe fn new(lock: Pin<&mut L>) -> Self {
        // SAFETY: only the address is kept, under the contract above.
        Self(NonNull::from(unsafe { lock.get_unchecked_mut() }))
    }

    /// Takes the wait at `lock` back out of `slot` (its call's own, about
    /// to drop it): the slot no longer reaches it.
    pub(crate) fn let_go<G>(slot: &mut ParkedSlot<L, G>, lock: *const L) {
        debug_assert!(
            matches!(slot, ParkedSlot::InCall(at) if std::ptr::eq(at.0.as_ptr(), lock)),
            "the call's own wait is parked"
        );
        *slot = ParkedSlot::Empty;
    }
}

/// Parks a call's wait: the lock future `lock` makes, not polled yet, put
/// in its block, and the guards the call took. What a forgotten call left in the slot goes first: returns
/// whether there was one (see [`Access::park`](super::access::Access::park)).
pub(crate) fn park<L, G>(
    slot: &mut ParkedSlot<L, G>,
    lock: impl FnOnce() -> L,
    guards: Taken<G>,
) -> bool {
    let forgotten = clear_parked(slot);
    *slot = ParkedSlot::Boxed(Recycled::pin_with(|| Parked {
        lock: lock(),
        guards,
    }));
    forgotten
}

/// Polls the parked wait (only the call that parked it does).
pub(crate) fn poll_parked<L, G>(
    slot: &mut ParkedSlot<L, G>,
    cx: &mut Context<'_>,
) -> Poll<Result<G, LockError>>
where
    L: Future<Output = Result<G, LockError>>,
{
    let ParkedSlot::Boxed(parked) = slot else {
        unreachable!("the call's wait is parked")
    };
    parked.as_mut().project().lock.poll(cx)
}

/// Takes the call's guards back into `guards` as its wait ends, then drops
/// the wait (done, or still queued if the wait stopped otherwise: a
/// deadlock's victim leaves its queue here). The guards are the caller's
/// before the wait drops: if its drop panics (a waker's or a key's),
/// unwinding releases them. (A value being returned when a drop panics is
/// leaked, not dropped: so they are not returned.)
pub(crate) fn unpark<L, G>(slot: &mut ParkedSlot<L, G>, guards: &mut Taken<G>) {
    let ParkedSlot::Boxed(mut parked) = std::mem::replace(slot, ParkedSlot::Empty) else {
        unreachable!("the call's wait is parked")
    };
    *guards = std::mem::take(parked.as_mut().project().guards);
    drop(parked);
}

/// Drops what the slot holds: the wait first (an unobserved grant passes
/// on before the guards go), then the guards, even if the first panics.
/// Returns whether it held anything.
pub(crate) fn clear_parked<L, G>(slot: &mut ParkedSlot<L, G>) -> bool {
    let mut parked = match std::mem::replace(slot, ParkedSlot::Empty) {
        ParkedSlot::Empty => return false,
        ParkedSlot::Boxed(parked) => parked,
        ParkedSlot::InCall(InCall(lock)) => {
            // SAFETY: a wait in its call's block that the call did not let
            // go of (`InCall::new`'s contract): the call was forgotten, its
            // block is never freed, and nothing else drops the lock future;
            // out of the slot now, it is dropped once, here.
            unsafe { std::ptr::drop_in_place(lock.as_ptr()) };
            return true;
        }
    };
    let guards = std::mem::take(parked.as_mut().project().guards);
    let dropped = catch_unwind(AssertUnwindSafe(|| drop(parked)));
    let released = catch_unwind(AssertUnwindSafe(|| drop(guards)));
    // The first panic goes on.
    if let Err(payload) = dropped.and(released) {
        resume_unwind(payload);
    }
    true
}

/// The guards a call has taken and not yet put into its transaction's set,
/// each with the call's index for it: inline up to two (a transfer's), so
/// that moving the list into a cell and back, as the call suspends and
/// resumes, copies a few words, not a large inline array.
pub(crate) type Taken<G> = smallvec::SmallVec<[(usize, G); 2]>;

/// The transaction's list of its calls' cells: one inline (a transaction
/// rarely has more than one call waiting, or forgotten, at a time), so a
/// transaction's first wait allocates no list.
pub(crate) type PendingList<L, U, G> = smallvec::SmallVec<[Arc<Pending<L, U, G>>; 1]>;

/// Cancels every cell of `list` (the transaction ended): each forgotten
/// call's waiter leaves its queue, or its unobserved grant passes on, and
/// its guards are released. A panic in one (a key's `Drop`) does not keep
/// the others from being cancelled; the first is resumed at the end.
pub(crate) fn cancel_all<L, U, G>(list: PendingList<L, U, G>) {
    let mut panic = None;
    for pending in list {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| pending.cancel())) {
            panic.get_or_insert(payload);
        }
    }
    if let Some(payload) = panic {
        resume_unwind(payload);
    }
}

/// Puts `pending` on `list`, first dropping the cells of calls that are
/// gone (only the list holds them: a call cancelled or recovered its cell
/// as it ended). A forgotten call's cell stays: its call never ended.
pub(crate) fn push<L, U, G>(list: &mut PendingList<L, U, G>, pending: &Arc<Pending<L, U, G>>) {
    list.retain(|p| Arc::strong_count(p) > 1);
    list.push(Arc::clone(pending));
}

/// Takes `pending` off `list`, if there; returns it, to drop after any
/// lock the caller holds.
pub(crate) fn remove<L, U, G>(
    list: &mut PendingList<L, U, G>,
    pending: &Arc<Pending<L, U, G>>,
) -> Option<Arc<Pending<L, U, G>>> {
    let at = list.iter().position(|p| Arc::ptr_eq(p, pending))?;
    Some(list.swap_remove(at))
}
