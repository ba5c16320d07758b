//! A fresh fill's wait: the borrowed form's `lock_all` into a transaction
//! that held nothing (a transfer's, an audit's), once a key was not free
//! at once.
//!
//! Every key the call gets goes into the set as it is had (the set holds
//! only the call's keys). The table's lock future for the key waited for
//! is in this future's own block, and its address in the transaction's
//! parked slot (`pending::InCall`), so that the transaction's end drops it
//! if this future is forgotten: one allocation per wait. The state is a
//! few words beside the requests and the lock future, stepped by hand:
//! park the key that was not free, wait (registered with the deadlock
//! detector once queued, if the transaction holds a key), put the grant
//! in, try the rest at once, park the next that is not free.
//!
//! Done, it leaves its keys in the set. Failed (a timeout, a deadlock's
//! victim) or dropped (cancelled, or unwinding), it takes every key of the
//! call back out of the set and releases it, so the transaction holds
//! nothing, as before the call; its parked wait leaves its queue (or its
//! unobserved grant passes on). Forgotten, its keys stay in the set and its
//! parked wait stays in the transaction: both go with the transaction's
//! end, or the parked wait with its next wait.

use std::future::Future;
use std::marker::PhantomPinned;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::support::lease::Terms;
use crate::transactions::access::{Access, GuardOf, Holding, KeyOf, LockOf, Stop};
use crate::transactions::deadlock::wait_id;
use crate::transactions::error::TransactionError;
use crate::transactions::multi::{try_request, LockedSet, Outcome, Request};
use crate::transactions::pending::{self, InCall};
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
    /// A wait is parked: `lock` is alive, its address in the transaction's
    /// parked slot, and the wait is counted in the transaction's waits.
    parked: bool,
    /// The table's lock future for request `at`, while `parked`.
    lock: MaybeUninit<LockOf<A>>,
    /// `lock` is pinned here (its waiter is linked into a queue).
    _pinned: PhantomPinned,
    /// The parked wait was polled into its queue (and looked at by the
    /// detector).
    searched: bool,
    /// Registered with the deadlock detector, under this id.
    detecting: Option<usize>,
    /// The call has its answer: nothing to undo.
    done: bool,
}

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
            lock: MaybeUninit::uninit(),
            _pinned: PhantomPinned,
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

    /// Parks the wait for request `at`: its lock future made in `lock`, its
    /// address in the transaction's parked slot, counted in its waits.
    ///
    /// Called only on a pinned future (see `poll`): `lock` stays where it
    /// is made.
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
        // A forgotten call's wait goes first.
        self.access.clear_forgotten();
        let lock = self.access.owner().reach.lock_with(hash, key, opts);
        let lock = self.lock.write(lock);
        // SAFETY: `lock` is in this future's block, which is pinned (it is
        // never moved, `poll`), and is dropped in place only once the slot
        // let go of it (`end_wait`, as the wait ends or this future drops);
        // a forgotten future's block is never freed, and the slot drops it.
        let in_call = unsafe { InCall::new(Pin::new_unchecked(lock)) };
        *self.access.parked() = pending::ParkedSlot::InCall(in_call);
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
        // SAFETY: `parked`: `lock` is alive, pinned where it was made.
        let lock = unsafe { Pin::new_unchecked(self.lock.assume_init_mut()) };
        if let Poll::Ready(out) = lock.poll(cx) {
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

    /// The call failed with `error`: its keys go, as when it is dropped
    /// (its wait has ended already).
    fn fail(&mut self, error: TransactionError<KeyOf<A>>) -> Poll<Outcome<A>> {
        debug_assert!(!self.parked, "the wait ended before its outcome was used");
        self.undo();
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
        // Out of the slot, then dropped here, in place.
        InCall::let_go(self.access.parked(), self.lock.as_ptr());
        // SAFETY: it was alive (`parked`), the slot no longer reaches it,
        // and `parked` is down: it is dropped once, even if its drop panics.
        let dropped = catch_unwind(AssertUnwindSafe(|| unsafe { self.lock.assume_init_drop() }));
        left.or(dropped.err())
    }
}

impl<A: Access> Future for FreshWait<'_, A>
where
    KeyOf<A>: Clone,
{
    type Output = Outcome<A>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome<A>> {
        // SAFETY: nothing is moved out of the future: `lock`, the one part
        // that must stay in place, is made, polled and dropped where it is.
        let this = unsafe { self.get_unchecked_mut() };
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
    #[inline]
    fn drop(&mut self) {
        if !self.done {
            self.undo();
        }
    }
}

impl<A: Access> FreshWait<'_, A> {
    /// The call has no answer but a failure (its wait failed, or it was
    /// dropped: cancelled at its await, or unwinding): a parked wait ends
    /// (its waiter leaves its queue, or its unobserved grant passes on),
    /// then every key of the call is taken back out of the set and
    /// released, even if the first step panics; the transaction holds
    /// nothing, as before the call.
    #[cold]
    #[inline(never)]
    fn undo(&mut self) {
        let mut panicked = None;
        if self.parked {
            panicked = self.end_wait();
        }
        self.done = true;
        let taken = self.access.with(|set| set.unfill_all().collect::<Vec<_>>());
        // Released here, out of the set (a key's drop may panic: the rest
        // are released as the list unwinds).
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(taken))) {
            panicked.get_or_insert(payload);
        }
        // Swallowed if this runs during an unwind already (the drop of a
        // future unwinding), where a second panic would abort.
        if let Some(payload) = panicked {
            if !std::thread::panicking() {
                resume_unwind(payload);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    //! The wait's lock future in its own block, reached by the transaction
    //! by address: here in the crate, so that the miri step runs it.

    use std::alloc::{dealloc, Layout};
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use super::FreshWait;
    use crate::transactions::access::{Access, Direct};
    use crate::transactions::multi::Request;
    use crate::transactions::policy::WaitPolicy;
    use crate::transactions::Few;
    use crate::{LockTable, Mode};

    fn poll_once<F: Future>(fut: Pin<&mut F>) -> Poll<F::Output> {
        fut.poll(&mut Context::from_waker(std::task::Waker::noop()))
    }

    fn requests(table: &LockTable<u64>, keys: &[u64]) -> Few<Request<u64>> {
        keys.iter()
            .map(|&key| Request {
                hash: table.hash(&key),
                key: Some(key),
                mode: Mode::Exclusive,
            })
            .collect()
    }

    type Table<'t> = &'t LockTable<u64>;

    /// The fresh wait of `keys` (the first not free), polled once: parked.
    fn parked<'a, 'b, 't>(
        access: &'a mut Direct<'b, Table<'t>>,
        table: &LockTable<u64>,
        keys: &[u64],
    ) -> Pin<Box<FreshWait<'a, Direct<'b, Table<'t>>>>> {
        let terms = table.owner_terms(None, access.owner().opts.id.get());
        let requests = requests(table, keys);
        let mut wait = Box::pin(FreshWait::new(
            access,
            requests,
            (0, 0),
            terms,
            WaitPolicy::Block,
        ));
        assert!(poll_once(wait.as_mut()).is_pending());
        wait
    }

    #[test]
    fn a_fresh_wait_handed_its_key_takes_it_and_one_dropped_leaves_its_queue() {
        let table = LockTable::<u64>::new();
        let mut txn = table.transaction();
        // Handed the key.
        let blocker = table.try_lock(1).unwrap();
        {
            let mut access = txn.direct();
            let mut wait = parked(&mut access, &table, &[1, 2]);
            drop(blocker);
            let Poll::Ready(got) = poll_once(wait.as_mut()) else {
                panic!("handed 1")
            };
            assert_eq!(got.map(|set| set.acquired()), Ok(2));
        }
        assert!(txn.parked.is_empty(), "the wait let go of its slot");
        assert_eq!(txn.len(), 2);
        txn.commit().unwrap();
        // Dropped while it waits.
        let blocker = table.try_lock(2).unwrap();
        let mut txn = table.transaction();
        drop(parked(&mut txn.direct(), &table, &[2]));
        assert!(txn.parked.is_empty() && txn.set.waits == 0);
        drop(blocker);
        assert!(table.is_empty(), "no waiter was left in the queue");
        drop(txn);
    }

    /// A forgotten wait's block is never freed: the transaction drops its
    /// lock future there, by address, as it ends or as its next call parks
    /// a wait. (The test frees the block afterwards, without dropping the
    /// wait, so that miri's leak check still runs.)
    #[test]
    fn a_forgotten_fresh_wait_is_dropped_in_its_block_by_the_transaction() {
        for next_call in [false, true] {
            let table = LockTable::<u64>::new();
            let blocker = table.try_lock(1).unwrap();
            let mut txn = table.transaction();
            let (block, layout) = {
                let mut access = txn.direct();
                let wait = parked(&mut access, &table, &[1]);
                let layout = Layout::for_value(&*wait);
                // SAFETY: forgotten: never moved, never dropped.
                let raw = Box::into_raw(unsafe { Pin::into_inner_unchecked(wait) });
                (raw.cast::<u8>(), layout)
            };
            assert!(!txn.parked.is_empty(), "parked by address");
            // Handed to the forgotten wait, unobserved.
            drop(blocker);
            assert!(table.is_locked(&1));
            if next_call {
                // The next call's wait lets go of the forgotten one first:
                // the key passes on to it.
                let other = table.try_lock(2).unwrap();
                let mut call = Box::pin(txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)]));
                assert!(poll_once(call.as_mut()).is_pending(), "waits for 2");
                assert!(table.is_locked(&1), "1 is the new call's");
                drop(other);
                let Poll::Ready(got) = poll_once(call.as_mut()) else {
                    panic!("handed 2")
                };
                assert_eq!(got.map(|set| set.acquired()), Ok(2));
                drop(call);
                txn.commit().unwrap();
            } else {
                drop(txn);
            }
            assert!(table.is_empty(), "nothing of the forgotten wait is held");
            // SAFETY: the block of the forgotten wait, whose lock future the
            // transaction dropped; the rest of it owns nothing (one-word
            // keys), so it is freed without its drop.
            unsafe { dealloc(block, layout) };
        }
    }
}
