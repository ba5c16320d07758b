//! A fresh fill's wait: the borrowed form's `lock_all` into a transaction
//! that held nothing (a transfer's, an audit's), once a key was not free
//! at once.
//!
//! Every key the call gets goes into the set as it is had (the set holds
//! only the call's keys); the key waited for is parked in the transaction
//! (`pending::Parked`), so that its end releases it if this future is
//! forgotten. The state is a few words beside the requests, stepped by
//! hand: park the key that was not free, wait (registered with the
//! deadlock detector once queued, if the transaction holds a key), put
//! the grant in, try the rest at once, park the next that is not free.
//!
//! Done, it leaves its keys in the set. Failed (a timeout, a deadlock's
//! victim) or dropped (cancelled, or unwinding), it takes every key of the
//! call back out of the set and releases it, so the transaction holds
//! nothing, as before the call; its parked wait leaves its queue (or its
//! unobserved grant passes on). Forgotten, its keys stay in the set and its
//! parked wait stays in the transaction: both go with the transaction's
//! end, or the parked wait with its next wait.

use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::support::lease::Terms;
use crate::transactions::access::{Access, GuardOf, Holding, KeyOf, Stop};
use crate::transactions::deadlock::wait_id;
use crate::transactions::error::TransactionError;
use crate::transactions::multi::{try_request, LockedSet, Outcome, Request};
use crate::transactions::pending::{self, Taken};
use crate::transactions::policy::WaitPolicy;
use crate::transactions::reach::Reach;
use crate::transactions::Few;
use crate::LockError;

/// A panic caught while a wait was undone, resumed once the rest is done.
type Payload = Box<dyn std::any::Any + Send>;

/// How a parked wait ended: the table's answer, or stopped (a deadlock).
type Waited<A> = Result<Result<GuardOf<A>, LockError>, Stop<KeyOf<A>>>;

/// The wait of a fresh fill; see the module doc.
pub(crate) struct FreshWait<'a, A: Access> {
    access: &'a mut A,
    /// The call's requests, in the canonical order, from the first not
    /// taken at once (the ones before it, if listed, are in the set).
    requests: Few<Request<KeyOf<A>>>,
    /// The request waited for, or tried next.
    at: usize,
    /// How many of the call's keys are in the set.
    count: usize,
    policy: WaitPolicy,
    /// The terms of every grant, resolved once for the call.
    terms: Option<Terms>,
    /// Request `at` was found not free just now: it is parked at once.
    busy: bool,
    /// The parked wait's key, for the detector and an error.
    name: Option<KeyOf<A>>,
    /// What the transaction held when the wait began.
    holding: Holding,
    /// A wait is parked in the transaction and counted in its waits.
    parked: bool,
    /// The parked wait was polled into its queue (and looked at by the
    /// detector).
    searched: bool,
    /// Registered with the deadlock detector, under this id.
    detecting: Option<usize>,
    /// The call has its answer: nothing to undo.
    done: bool,
}

// Nothing of it is pinned: the lock future it waits on is in its own block.
impl<A: Access> Unpin for FreshWait<'_, A> {}

impl<'a, A: Access> FreshWait<'a, A>
where
    KeyOf<A>: Clone,
{
    /// The wait of a fill that left `count` keys of the call in the set and
    /// found request `at` of `requests` not free, on the call's `terms`.
    pub(crate) fn new(
        access: &'a mut A,
        requests: Few<Request<KeyOf<A>>>,
        (at, count): (usize, usize),
        terms: Option<Terms>,
        policy: WaitPolicy,
    ) -> Self {
        Self {
            access,
            requests,
            at,
            count,
            policy,
            terms,
            busy: true,
            name: None,
            holding: Holding::Nothing,
            parked: false,
            searched: false,
            detecting: None,
            done: false,
        }
    }

    /// Puts a key had into the set.
    fn push(&mut self, guard: GuardOf<A>) {
        let Some((_, set)) = self.access.sole() else {
            unreachable!("the borrowed form")
        };
        set.push_new(guard);
        set.filled();
        self.count += 1;
    }

    /// Tries the requests from `at` on, each at once, until one is not
    /// free (`false`) or all are had.
    fn try_rest(&mut self) -> bool {
        while self.at < self.requests.len() {
            let Some((owner, _)) = self.access.sole() else {
                unreachable!("the borrowed form")
            };
            let tried = try_request(&owner.reach, self.terms, &mut self.requests[self.at]);
            match tried {
                Ok(guard) => {
                    self.push(guard);
                    self.at += 1;
                }
                Err(()) => return false,
            }
        }
        true
    }

    /// Parks the wait for request `at`: its lock future in the
    /// transaction, counted in its waits.
    fn park(&mut self) {
        let request = &mut self.requests[self.at];
        let (hash, mode) = (request.hash, request.mode);
        let key = request.key.take().expect("taken once");
        // The name for the detector and an error (the key goes to the
        // table).
        self.name = Some(key.clone());
        // Asked before the wait is parked (a forgotten call's, cleared
        // there, is counted in the set's waits until then).
        let holds_nothing = self.access.with(|set| set.holds_nothing());
        self.holding = if holds_nothing.unwrap_or(false) {
            Holding::Nothing
        } else {
            // Everything the call holds is in the set.
            Holding::TheSet
        };
        let opts = self.access.owner().opts.lock_options(mode, self.policy);
        self.access.park(hash, key, opts, Taken::new());
        self.parked = true;
        self.searched = false;
        self.access.wait_begins();
    }

    /// Polls the parked wait; once it is queued, registers it with the
    /// detector (if the transaction holds a key) and answers a cycle it
    /// closes.
    fn poll_parked(&mut self, cx: &mut Context<'_>) -> Poll<Waited<A>> {
        if !self.searched && self.access.owner().reach.table().clock().budget_spent() {
            // With no budget left, a lock future returns `Pending` before
            // it is queued, and a search now would miss a cycle it closes
            // (see `wait_unless_ended`): the task's next turn goes on.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Poll::Ready(out) = pending::poll_parked(self.access.parked(), cx) {
            return Poll::Ready(Ok(out));
        }
        if !self.searched {
            self.searched = true;
            let table = self.access.owner().reach.table();
            if table.detector().is_on() && self.holding != Holding::Nothing {
                let name = self.name.as_ref().expect("named as parked");
                let key = Arc::new(name.clone());
                let request = &self.requests[self.at];
                let (hash, mode) = (request.hash, request.mode);
                let owner = self.access.owner();
                let id = owner.opts.id.get();
                // Set first: if the search panics (a key's `Eq`), the wait
                // it registered leaves as this future drops.
                self.detecting = Some(wait_id(&key));
                let access = &*self.access;
                let registered = owner
                    .reach
                    .table()
                    .enter_wait(id, hash, key, mode, true, || access.set_is_awaited());
                if let Err(deadlock) = registered {
                    return Poll::Ready(Err(Stop::Deadlock(deadlock)));
                }
            }
        }
        Poll::Pending
    }

    /// The call failed with `error`: its keys go.
    fn fail(&mut self, error: TransactionError<KeyOf<A>>) -> Poll<Outcome<A>> {
        self.unfill();
        Poll::Ready(Err(error))
    }
}

impl<A: Access> FreshWait<'_, A> {
    /// Ends the parked wait: uncounted, unregistered, and its lock future
    /// dropped (done, or leaving its queue). Each step runs even if one
    /// before panics (an old waker's drop, a key's): the first panic is
    /// returned.
    fn end_wait(&mut self) -> Option<Payload> {
        self.parked = false;
        self.access.wait_ends();
        let left = self.detecting.take().and_then(|id| {
            let owner = self.access.owner();
            let (detector, owner_id) = (owner.reach.table().detector(), owner.opts.id.get());
            catch_unwind(AssertUnwindSafe(|| detector.leave(owner_id, id))).err()
        });
        let parked = self.access.parked();
        let cleared = catch_unwind(AssertUnwindSafe(|| pending::clear_parked(parked))).err();
        left.or(cleared)
    }

    /// Takes every key of the call back out of the set and releases it
    /// (the call failed or was dropped): the transaction holds nothing.
    fn unfill(&mut self) {
        self.done = true;
        let taken = self.access.with(|set| set.unfill_all().collect::<Vec<_>>());
        // Released here, out of the set (a key's drop may panic: the rest
        // are released as the list unwinds).
        drop(taken);
    }
}

impl<A: Access> Future for FreshWait<'_, A>
where
    KeyOf<A>: Clone,
{
    type Output = Outcome<A>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome<A>> {
        let this = self.get_mut();
        debug_assert!(!this.done, "polled after its answer");
        loop {
            if this.parked {
                let waited = match this.poll_parked(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(waited) => waited,
                };
                // The wait ends before its outcome is used: a panic in its
                // end drops the outcome (a grant is released) and goes on,
                // and this future's drop takes the call's keys back out.
                if let Some(payload) = this.end_wait() {
                    drop(catch_unwind(AssertUnwindSafe(|| drop(waited))));
                    resume_unwind(payload);
                }
                let name = this.name.take().expect("named as parked");
                match waited {
                    Ok(Ok(guard)) => {
                        this.push(guard);
                        this.at += 1;
                        drop(name);
                    }
                    Ok(Err(error)) => {
                        let mode = this.requests[this.at].mode;
                        let waits = this.policy.waits();
                        return this.fail(TransactionError::from_lock(name, mode, waits, error));
                    }
                    Err(stop) => {
                        drop(name);
                        return this.fail(stop.into());
                    }
                }
            }
            // Request `at` was found not free just now: it waits at once.
            // The others are tried first.
            if !std::mem::take(&mut this.busy) && this.try_rest() {
                this.done = true;
                return Poll::Ready(Ok(LockedSet::counted(this.count, 0)));
            }
            this.park();
        }
    }
}

impl<A: Access> Drop for FreshWait<'_, A> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Cancelled at its await, or unwinding: the wait ends (its waiter
        // leaves its queue, or its unobserved grant passes on), then the
        // call's keys go, even if the first panics.
        let mut panicked = None;
        if self.parked {
            panicked = self.end_wait();
        }
        self.done = true;
        let taken = self.access.with(|set| set.unfill_all().collect::<Vec<_>>());
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(taken))) {
            panicked.get_or_insert(payload);
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
