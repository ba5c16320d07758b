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
//! the table, which wakes what it must after its own unlock). A poll holds
//! the cell's lock while it polls: the table's shard lock is taken inside
//! it, never the other way, and the transaction's own lock (owned form) is
//! never held across either.

use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::shard_lock::ShardMutex;

/// A waiting call's lock future, cancellable by its transaction.
pub(crate) struct PendingLock<F> {
    /// `None` once the call completed with it or the transaction cancelled
    /// it.
    future: ShardMutex<Option<Pin<Box<F>>>>,
}

impl<F> PendingLock<F> {
    pub(crate) fn new(future: F) -> Arc<Self> {
        Arc::new(Self {
            future: ShardMutex::new(Some(Box::pin(future))),
        })
    }

    /// Drops the future (after the cell's lock is released), unless the
    /// call already has its output.
    pub(crate) fn cancel(&self) {
        let future = self.future.lock().take();
        drop(future);
    }
}

impl<F: Future> PendingLock<F> {
    /// Polls the future: `Ready(None)` if it was cancelled. Once it is
    /// ready, the box is dropped (after the cell's lock is released).
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        let mut cell = self.future.lock();
        let Some(future) = cell.as_mut() else {
            return Poll::Ready(None);
        };
        let out = future.as_mut().poll(cx);
        let done = match out {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(out) => out,
        };
        let spent = cell.take();
        drop(cell);
        drop(spent);
        Poll::Ready(Some(done))
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
