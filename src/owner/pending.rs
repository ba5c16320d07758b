//! A waiting call's table lock future, shared between the call and its
//! transaction, so that the transaction owns its grants whatever the call's
//! future does.
//!
//! A call that must wait for a new key keeps the table's lock future (its
//! waiter node, and the grant once one is handed to it) in a
//! [`PendingLock`]: a heap cell behind a small spin lock, reached by an
//! `Arc` from the call and from the transaction's list of pending calls
//! (`Transaction::pending`, or the owned form's state). The call polls the
//! future through the cell and, however it stops waiting (done, failed,
//! dropped), takes itself off the list. A call future that is forgotten
//! (`mem::forget` of its box: safe Rust) never does: its cell stays on the
//! list, and when the transaction ends (commit, abort, drop) it cancels
//! every cell still there, dropping the lock future it holds, which does
//! what dropping any lock future does: its waiter leaves the queue, or the
//! grant it was handed and never observed passes on to the next waiter. So
//! nothing of a transaction stays held after it ended, and a plain lock
//! runs none of this: only a transaction's contended wait makes a cell.
//!
//! The future is boxed inside the cell, so cancelling moves a pointer out
//! and drops the future after the cell's lock is released (its drop enters
//! the table, which wakes what it must after its own unlock). A poll takes
//! the box out of the cell, polls it with no lock held (the poll runs user
//! code: a waker's `clone`, which may call back into the transaction, end
//! it even), and puts it back; an end that cancels meanwhile marks the
//! cell, and the poll drops the future as it returns. The cell's lock is
//! held only for a few stores, and nothing else is locked inside it.

use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::shard_lock::ShardMutex;

/// A waiting call's lock future, cancellable by its transaction.
pub(crate) struct PendingLock<F> {
    state: ShardMutex<Cell<F>>,
}

/// Where the call's lock future is. Only the call polls it (one poll at a
/// time: the call's future is polled through `&mut`); the transaction's end
/// may cancel it at any time, from any thread.
enum Cell<F> {
    /// In the cell, between polls.
    Idle(Pin<Box<F>>),
    /// Out of the cell, being polled (no lock is held while it is: the poll
    /// runs user code, a waker's `clone`).
    Polling,
    /// Cancelled by the end: dropped, or to be dropped by the poll that has
    /// it out.
    Cancelled,
    /// Completed: its output went to the call.
    Done,
}

impl<F> PendingLock<F> {
    pub(crate) fn new(future: F) -> Arc<Self> {
        Arc::new(Self {
            state: ShardMutex::new(Cell::Idle(Box::pin(future))),
        })
    }

    /// Cancels the future: dropped here (after the cell's lock is
    /// released) if it is in the cell, by its poll as it ends if it is
    /// being polled; nothing if it completed.
    pub(crate) fn cancel(&self) {
        let taken = {
            let mut state = self.state.lock();
            match std::mem::replace(&mut *state, Cell::Cancelled) {
                Cell::Idle(future) => Some(future),
                Cell::Done => {
                    *state = Cell::Done;
                    None
                }
                Cell::Polling | Cell::Cancelled => None,
            }
        };
        drop(taken);
    }
}

impl<F: Future> PendingLock<F> {
    /// Polls the future, out of the cell (no lock held while it runs):
    /// `Ready(None)` if it was cancelled (the transaction ended). An output
    /// it gives is returned even if the end cancelled it meanwhile (the
    /// call then settles into an ended transaction, which releases it).
    /// The future is dropped once done or cancelled, after the cell's lock
    /// is released.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        let mut future = {
            let mut state = self.state.lock();
            match std::mem::replace(&mut *state, Cell::Polling) {
                Cell::Idle(future) => future,
                other => {
                    *state = other;
                    return Poll::Ready(None);
                }
            }
        };
        // A panic here (a waker's `clone`) drops the future as it unwinds:
        // its waiter leaves the queue; the cell stays `Polling`, which a
        // later cancel turns into `Cancelled`.
        let polled = future.as_mut().poll(cx);
        let mut state = self.state.lock();
        match polled {
            Poll::Ready(out) => {
                *state = Cell::Done;
                drop(state);
                drop(future);
                Poll::Ready(Some(out))
            }
            Poll::Pending if matches!(*state, Cell::Cancelled) => {
                drop(state);
                drop(future);
                Poll::Ready(None)
            }
            Poll::Pending => {
                *state = Cell::Idle(future);
                Poll::Pending
            }
        }
    }
}

/// The transaction's list of its calls' cells.
pub(crate) type PendingList<F> = Vec<Arc<PendingLock<F>>>;

/// Cancels every cell of `list` (the transaction ended): each forgotten
/// call's waiter leaves its queue, or its unobserved grant passes on. A
/// panic in one (a key's `Drop`) does not keep the others from being
/// cancelled; the first is resumed at the end.
pub(crate) fn cancel_all<F>(list: PendingList<F>) {
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
/// gone (only the list holds them: a call's guard cancelled its cell as
/// it dropped). A forgotten call's cell stays: its guard never dropped.
pub(crate) fn push<F>(list: &mut PendingList<F>, pending: &Arc<PendingLock<F>>) {
    list.retain(|p| Arc::strong_count(p) > 1);
    list.push(Arc::clone(pending));
}

/// The call's hold on its cell: cancels it when dropped (the call's future
/// dropped, or done), so a dropped call leaves nothing queued.
pub(crate) struct CancelOnDrop<F>(pub(crate) Arc<PendingLock<F>>);

impl<F> Drop for CancelOnDrop<F> {
    fn drop(&mut self) {
        self.0.cancel();
    }
}
