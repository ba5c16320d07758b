//! The futures returned by `lock`, `lock_owned` and their `_with` variants,
//! and the one state machine they share.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::LockError;
use crate::keys::deferred::Leftovers;
use crate::keys::waiter::{Armed, Granted, LazyWaiter, Seen, Waiter};
use crate::keys::{Attempt, Diagnosis, Grant, Leaving, Patience, Polled, ShardState};
use crate::support::key_map::Index;
use crate::support::key_slot::KeyPtr;
use crate::support::lease::{LockOptions, PackedDuration, Terms};
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::guard::{Guard, Held, OwnedGuard};
use crate::table::{DefaultHashBuilder, LockTable};
use crate::time::clock::{Now, Stamp};
use crate::time::timer::Sleep;

use pin_project_lite::pin_project;

/// Where an acquisition stands.
enum State<K> {
    /// Not polled yet: owns the key it was given, to take in `mode`.
    Start { key: K, mode: Mode },
    /// Not polled yet: upgrades a shared grant of the key at `key` (its
    /// token is kept in the `lease` word, which an upgrade does not use).
    StartUpgrade { key: KeyPtr<K> },
    /// The options were invalid; reported on the first poll.
    Invalid(Box<LockError>),
    /// The waiter node is linked into the queue of the key at `key` (or was
    /// granted it and has not looked yet).
    Linked { key: KeyPtr<K> },
    /// Completed; the grant belongs to a guard now.
    Done,
}

/// What a lock asks for: the terms of its grant (its lease, or for an
/// upgrade the token it upgrades, and the transaction it is for, 0: none)
/// and how long it waits (its timeout, and when the caller gives up, none:
/// no deadline). Kept together, so that the general first poll
/// ([`start_busy`]) is handed them by one reference into the future.
#[derive(Debug, Clone, Copy)]
struct Asks {
    terms: Terms,
    patience: Patience,
}

/// When a wait with a timeout started and when it gives up, as stamps (one
/// word each, none until it first waits; `until` none also when the timeout
/// is too long to represent: it waits for ever).
#[derive(Debug, Clone, Copy, Default)]
struct Timing {
    start: Stamp,
    until: Stamp,
}

pin_project! {
    /// The acquisition state machine shared by every lock future.
    ///
    /// `T` is how it reaches the table: a borrow or an `Arc`.
    ///
    /// # Pinning
    ///
    /// `waiter` is linked into the key's queue by address while the state is
    /// `Linked`, so the future is `!Unpin` and the waiter never moves once
    /// polled: `poll` reaches it only through `Pin`, and `Drop` unlinks it.
    pub(crate) struct Acquire<T: TableHandle<K>, K> {
        table: Option<T>,
        hash: u64,
        // Dropped by hand in `Drop` (`drop_rest`), with `waiter`, behind the
        // same inline check as `sleep`.
        state: ManuallyDrop<State<K>>,
        asks: Asks,
        timing: Timing,
        // The waiter's own timer, on clocks without shard timers (boxed:
        // most waits never need one, so a lock future stays small). Dropped
        // by hand in `Drop`, behind an inline check: a completed future (the
        // common case) then makes no call to drop it.
        sleep: ManuallyDrop<Option<Box<Sleep>>>,
        // The queue node, written only when the future first has to wait.
        #[pin]
        waiter: ManuallyDrop<LazyWaiter>,
    }

    impl<T: TableHandle<K>, K> PinnedDrop for Acquire<T, K> {
        #[inline(always)]
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // A completed lock without a timer (the common case) owns
            // nothing but its waiter node, if it waited: a few inline
            // checks, and no call, so that the drop glue is small enough to
            // be inlined where the future is dropped.
            if matches!(**this.state, State::Done) && this.sleep.is_none() {
                // SAFETY: dropped in place, once, here in `Drop`; the field
                // is not used again. The node is not linked: a completed
                // future took its grant.
                unsafe { ManuallyDrop::drop(this.waiter.get_unchecked_mut()) };
                return;
            }
            // SAFETY: the waiter is dropped in place, never moved; this is
            // the future's `Drop`, so its fields are not used again.
            unsafe {
                drop_rest(
                    this.sleep,
                    this.table,
                    *this.hash,
                    this.state,
                    this.waiter.get_unchecked_mut(),
                );
            }
        }
    }
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
    K: Eq + Hash,
    S: BuildHasher,
{
    #[inline(always)]
    fn new(table: T, key: K, opts: LockOptions) -> Self {
        let hash = table.hash(&key);
        Self::new_hashed(table, hash, key, opts)
    }

    /// [`new`](Self::new) with the table's hash of `key` known.
    #[inline(always)]
    fn new_hashed(table: T, hash: u64, key: K, opts: LockOptions) -> Self {
        let (lease, timeout) = (opts.lease_duration(), opts.timeout_duration());
        let mode = opts.lock_mode();
        let owner = table.owner_for(&opts);
        let (state, lease) = match lease {
            // The default was validated when the table was built.
            None => (State::Start { key, mode }, table.leases().default_packed),
            Some(asked) => match table.leases().check_packed(asked) {
                Ok(lease) => (State::Start { key, mode }, lease),
                Err(err) => (State::Invalid(Box::new(err)), PackedDuration::NONE),
            },
        };
        Self {
            table: Some(table),
            hash,
            state: ManuallyDrop::new(state),
            asks: Asks {
                terms: Terms { lease, owner },
                patience: Patience {
                    timeout: PackedDuration::pack(timeout),
                    deadline: Stamp::new(opts.deadline_instant()),
                },
            },
            timing: Timing::default(),
            sleep: ManuallyDrop::new(None),
            waiter: ManuallyDrop::new(LazyWaiter::new()),
        }
    }

    /// An upgrade of the shared grant `token` of the key at `key` (the
    /// options' timeout and deadline bound the wait).
    pub(crate) fn upgrade(
        table: T,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        opts: LockOptions,
    ) -> Self {
        Self {
            table: Some(table),
            hash,
            state: ManuallyDrop::new(State::StartUpgrade { key }),
            asks: Asks {
                terms: Terms {
                    lease: PackedDuration::from_bits(token.get()),
                    owner: 0,
                },
                patience: Patience {
                    timeout: PackedDuration::pack(opts.timeout_duration()),
                    deadline: Stamp::new(opts.deadline_instant()),
                },
            },
            timing: Timing::default(),
            sleep: ManuallyDrop::new(None),
            waiter: ManuallyDrop::new(LazyWaiter::new()),
        }
    }

    /// Under a tokio table, one unit of the task's cooperative budget: a
    /// poll that finds the budget spent returns `Pending` (having scheduled
    /// the task again) before touching the table.
    #[cfg(feature = "tokio")]
    #[inline(always)]
    fn poll_budget(
        &self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<tokio::task::coop::RestoreOnPending>> {
        match self.table.as_deref() {
            Some(table) if table.clock().is_tokio() => {
                tokio::task::coop::poll_proceed(cx).map(Some)
            }
            _ => Poll::Ready(None),
        }
    }

    /// The two common polls, ahead of the state machine, each handing back
    /// a grant whole ([`First::Taken`]: nothing deferred, no timer), from
    /// which the caller builds its output at once:
    ///
    /// - the first poll: a key with no entry is taken; a busy key's wait is
    ///   linked under the same lock, and answered as the state machine's
    ///   poll ([`First::Polled`]);
    /// - the poll of a waiter the table granted the key (the wake of a
    ///   handoff), when it has no timer of its own to drop.
    ///
    /// Any other poll, and a first poll that must judge its deadline
    /// first, is the state machine's ([`First::Machine`]).
    #[inline(always)]
    pub(crate) fn poll_first(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> First<T, K> {
        // SAFETY: as in `poll_acquire`: nothing here moves the waiter.
        let this = unsafe { self.get_unchecked_mut() };
        match *this.state {
            State::Start { .. }
                if this.asks.patience.timeout != PackedDuration::ZERO
                    && !this.asks.patience.deadline.is_some() => {}
            State::Linked { key } if this.sleep.is_none() => {
                // The grant is published through the waiter: no lock
                // needed to see it.
                // SAFETY: `Linked`: the waiter was linked, so initialized.
                let waiter = unsafe { this.waiter.get_unchecked() };
                if waiter.seen() != Seen::Granted {
                    return First::Machine;
                }
                let granted = waiter.granted();
                return First::Taken(this.finish_granted(key, granted));
            }
            _ => return First::Machine,
        }
        let State::Start { key, mode } = std::mem::replace(&mut *this.state, State::Done) else {
            unreachable!()
        };
        match this.claim_or_wait(key, mode, cx, left) {
            // A key with no entry defers nothing (a wait granted as it
            // registered leaves a waker to drop, after the output exists:
            // the caller's general path).
            Ok(Step::Ready(out)) if !left.is_dirty() => First::Taken(out),
            step => {
                // SAFETY: re-pinned: `this` came from a pinned reference.
                let this = unsafe { Pin::new_unchecked(this) };
                First::Polled(this.poll_started(step, cx, left))
            }
        }
    }

    /// [`poll_first`](Self::poll_first) past a key taken at once: the
    /// wait's first answer, then on as the state machine's poll.
    #[inline(always)]
    fn poll_started(
        self: Pin<&mut Self>,
        step: Result<Step<(T, Held<K>)>, Box<LockError>>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Poll<Acquired<T, K>> {
        // SAFETY: as in `poll_acquire`.
        let this = unsafe { self.get_unchecked_mut() };
        let again = match step {
            Err(err) => return Poll::Ready(Err(err)),
            Ok(Step::Ready(out)) => return Poll::Ready(Ok(out)),
            Ok(Step::Wait(at)) => this.arm_timer(at, cx).is_ready(),
            Ok(Step::Parked) => false,
            Ok(Step::Again) => true,
        };
        if !again {
            return Poll::Pending;
        }
        // Nudged while registering, or a deadline already passed: judge
        // again. SAFETY: re-pinned: `this` came from a pinned reference.
        unsafe { Pin::new_unchecked(this) }.poll_acquire(cx, left)
    }

    /// [`poll_acquire`](Self::poll_acquire) out of line, for the futures of
    /// a lock with options: the polls [`poll_first`](Self::poll_first) does
    /// not cover (a waiter not granted yet, one with a timer of its own, a
    /// first poll with a deadline), kept out of the future's own poll so
    /// that its inline common polls stay small. (Measured: `lock_with`
    /// with a timeout, uncontended, 19.1-19.4 ns inline, 17.4-17.7 ns out of
    /// line; the plain futures keep it inline, where out of line cost the
    /// 64-task handoff about 8%.)
    #[inline(never)]
    pub(crate) fn poll_machine(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Poll<Acquired<T, K>> {
        self.poll_acquire(cx, left)
    }

    /// Takes the timer state out, to drop once the output exists.
    #[inline]
    pub(crate) fn take_timing(self: Pin<&mut Self>) -> Option<Box<Sleep>> {
        self.project().sleep.take()
    }

    /// When the caller gives up, if it has started waiting with a timeout.
    fn until(&self) -> Option<Instant> {
        self.timing.until.get()
    }

    /// Polls for the grant; on `Ready(Ok)` also gives back the table handle.
    /// Work left for after the output is built goes to `left`, which the
    /// caller drops after building its guard.
    ///
    /// # Panics
    ///
    /// User code (the key's `Drop`, a waker's `clone`, `wake` or `drop`) may
    /// panic out of this; the state is then always consistent: the waiter is
    /// `Linked` while it is in a queue, and `Drop` unlinks it.
    #[inline(always)]
    pub(crate) fn poll_acquire(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Poll<Acquired<T, K>> {
        // SAFETY: the intrusive list's pin boundary. The steps below link
        // `waiter` into the key's queue by address (through the queue's own
        // `unsafe` calls, whose contract is a pinned node); they never move
        // it or `self`, and `Drop` unlinks it. Nothing else is structurally
        // pinned.
        let this = unsafe { self.get_unchecked_mut() };
        loop {
            let wake_at = match &*this.state {
                State::Start { .. } => {
                    let State::Start { key, mode } =
                        std::mem::replace(&mut *this.state, State::Done)
                    else {
                        unreachable!()
                    };
                    match this.start(key, mode, cx, left)? {
                        Step::Ready(out) => return Poll::Ready(Ok(out)),
                        Step::Wait(at) => at,
                        Step::Parked => return Poll::Pending,
                        Step::Again => continue,
                    }
                }
                &State::StartUpgrade { key } => {
                    *this.state = State::Done;
                    let token = FencingToken::new(this.asks.terms.lease.bits())
                        .expect("keylock: an upgrade keeps its token");
                    match this.start_upgrade(key, token, cx, left)? {
                        Step::Ready(out) => return Poll::Ready(Ok(out)),
                        Step::Wait(at) => at,
                        Step::Parked => return Poll::Pending,
                        Step::Again => continue,
                    }
                }
                &State::Linked { key } => match this.poll_linked(key, cx, left)? {
                    Step::Ready(out) => return Poll::Ready(Ok(out)),
                    Step::Wait(at) => at,
                    Step::Parked => return Poll::Pending,
                    Step::Again => continue,
                },
                State::Invalid(_) => {
                    let State::Invalid(err) = std::mem::replace(&mut *this.state, State::Done)
                    else {
                        unreachable!()
                    };
                    return Poll::Ready(Err(err));
                }
                State::Done => panic!("keylock: lock future polled after it completed"),
            };
            if this.arm_timer(wake_at, cx).is_pending() {
                return Poll::Pending;
            }
            // A deadline has already passed: judge again.
        }
    }

    /// The terms a grant of this lock carries: its lease and owner.
    #[inline(always)]
    fn terms(&self) -> Terms {
        self.asks.terms
    }

    /// The first poll of a lock with a zero timeout or a deadline (any
    /// other first poll is [`poll_first`](Self::poll_first)'s): judge the
    /// deadline, then take the key, or link the waiter and arm its waker.
    #[inline(never)]
    fn start(
        &mut self,
        key: K,
        mode: Mode,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        let table = self.table.as_deref().expect("present until completion");
        let terms = self.terms();
        // A deadline already passed is a zero timeout (the clock is read only
        // when there is a deadline). A plain lock has neither: one check.
        let timed = self.asks.patience.timeout != PackedDuration::NONE
            || self.asks.patience.deadline.is_some();
        if timed
            && (self.asks.patience.timeout == PackedDuration::ZERO
                || self.asks.patience.deadline.is_some()
                    && Stamp::new(Some(table.clock().now())) >= self.asks.patience.deadline)
        {
            return match try_once(table, self.hash, key, mode, terms, left) {
                Ok(grant) => Ok(Step::Ready(self.finish(grant))),
                Err((diagnosis, name)) => Err(Box::new(timeout_error(
                    table,
                    Duration::ZERO,
                    diagnosis,
                    name,
                ))),
            };
        }
        self.claim_or_wait(key, mode, cx, left)
    }

    /// The first poll past any deadline check: the key taken if it has no
    /// entry, else the waiter linked and its waker armed, under the same
    /// shard lock (the common wait inline, its arguments in registers).
    #[inline(always)]
    fn claim_or_wait(
        &mut self,
        key: K,
        mode: Mode,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        let table = self.table.as_deref().expect("present until completion");
        let terms = self.terms();
        let shard = table.shard(self.hash);
        // Declared before the shard guard: if `K: Eq` panics during the
        // probe, the guard unlocks first and the key is dropped after.
        let mut key = Some(key);
        let mut state = shard.state.lock();
        // A key with no entry is taken here, inline, with nothing deferred.
        let mut now = Now::new(table.clock());
        match state.claim(self.hash, &mut key, mode, terms, &mut now, &shard.counters) {
            Ok(grant) => {
                drop(state);
                Ok(Step::Ready(self.finish(grant)))
            }
            Err(index) => {
                let patience = self.asks.patience;
                // The common wait (exclusive, strict FIFO, behind one
                // holder; with a lease or timeout only if the shard's timer
                // covers it) is linked here, inline: its arguments stay in
                // registers.
                // SAFETY: the waiter is idle and pinned (we are, through
                // `Pin`), and `Drop` unlinks it before it is freed.
                let fast = unsafe {
                    state.enqueue_fast(
                        index,
                        (mode, terms, patience),
                        table.fairness(),
                        &mut self.waiter,
                        (&shard.timer, table.clock()),
                    )
                };
                if let Some(queued) = fast {
                    drop(state);
                    // After unlocking: `K::drop` is user code.
                    if let Some(key) = key {
                        left.drop_key_later(key);
                    }
                    // The common wait has no timer to arm: it waits without
                    // a deadline, or its clock has shard timers (its
                    // conditions), and it is behind no lease the shard's
                    // timer does not cover (`wake_at` is none).
                    return match self.started(queued, cx, left)? {
                        Step::Wait(None) => Ok(Step::Parked),
                        step => Ok(step),
                    };
                }
                // SAFETY: as above.
                let attempt = unsafe {
                    start_busy(
                        table,
                        state,
                        (self.hash, index, key),
                        (mode, &self.asks),
                        &mut self.waiter,
                        left,
                    )
                };
                self.started(attempt, cx, left)
            }
        }
    }

    /// The first poll of an upgrade: at once, or linked at the head of the
    /// queue, or refused.
    #[cold]
    #[inline(never)]
    fn start_upgrade(
        &mut self,
        key: KeyPtr<K>,
        token: FencingToken,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        let table = self.table.as_deref().expect("present until completion");
        let timeout = self.asks.patience.timeout.get();
        let passed = self.asks.patience.deadline.is_some()
            && Stamp::new(Some(table.clock().now())) >= self.asks.patience.deadline;
        let patience = self.asks.patience;
        let shard = table.shard(self.hash);
        let mut state = shard.state.lock();
        let mut ctx = shard.ctx(table.clock(), left);
        // SAFETY: the waiter is idle and pinned (we are, through `Pin`), and
        // `Drop` unlinks it before it is freed.
        let attempt =
            unsafe { state.upgrade(self.hash, key, token, patience, &mut self.waiter, &mut ctx) };
        let attempt = match attempt {
            Ok(Attempt::Queued { .. }) if timeout == Some(Duration::ZERO) || passed => {
                // Would wait, and may not: leave at once.
                // SAFETY: just linked by us, under the lock.
                let left_now = unsafe {
                    state.leave(
                        self.hash,
                        key,
                        self.waiter.get(),
                        Leaving::TimedOut,
                        table.fairness(),
                        &mut ctx,
                    )
                };
                drop(state);
                return match left_now {
                    Ok(diagnosis) => {
                        // SAFETY: the guard being upgraded still holds the
                        // key, so its entry stays in the table.
                        let name = table.name_key(unsafe { key.get() });
                        Err(Box::new(timeout_error(
                            table,
                            Duration::ZERO,
                            diagnosis,
                            name,
                        )))
                    }
                    Err(granted) => Ok(Step::Ready(self.finish_granted(key, granted))),
                };
            }
            other => other,
        };
        drop(state);
        let attempt = attempt.map_err(|err| {
            // SAFETY: the guard being upgraded still holds the key, so its
            // entry stays in the table.
            Box::new(err.with_key(|| table.name_key(unsafe { key.get() })))
        })?;
        self.started(attempt, cx, left)
    }

    /// What the first poll's attempt came to: the grant, or a linked waiter
    /// whose waker is registered now.
    #[inline(always)]
    fn started(
        &mut self,
        attempt: Attempt<K>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        match attempt {
            Attempt::Acquired(grant) => Ok(Step::Ready(self.finish(grant))),
            Attempt::Queued {
                key,
                wake_at,
                start,
                until,
            } => {
                // Recorded before any user code runs: from here on `Drop`
                // unlinks the waiter whatever panics.
                self.set_state(State::Linked { key });
                self.timing = Timing { start, until };
                // SAFETY: queued: the waiter was linked, so initialized.
                let waiter = unsafe { self.waiter.get_unchecked() };
                if !start.is_some() {
                    // When the wait began, for the status view: the coarse
                    // clock's reading on the real clock once the view has
                    // been read (none before, none on other clocks), taken
                    // after the unlock (unless one was taken under the
                    // lock already). The view's flag first: it is off
                    // unless a view was read, and then nothing is stamped.
                    let table = self.table.as_deref().expect("present until completion");
                    if table.watches_wait_starts() && !waiter.is_stamped() {
                        waiter.stamp_since(table.wait_stamp());
                    }
                }
                // SAFETY: our own waiter, just linked, armed once.
                match unsafe { waiter.arm_unlocked(cx.waker().clone()) } {
                    Armed::Stored => Ok(Step::Wait(wake_at)),
                    Armed::Granted(spare) => {
                        let granted = waiter.granted();
                        left.drop_waker_later(spare);
                        Ok(Step::Ready(self.finish_granted(key, granted)))
                    }
                    Armed::Nudged(spare) => {
                        drop(spare);
                        Ok(Step::Again)
                    }
                }
            }
        }
    }

    /// A later poll of a linked waiter: inline up to its grant (the common
    /// later poll: the wake of a handoff).
    #[inline(always)]
    fn poll_linked(
        &mut self,
        key: KeyPtr<K>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        // The grant is published through the waiter: no lock needed to see it.
        // SAFETY: `Linked`: the waiter was linked, so initialized.
        let waiter = unsafe { self.waiter.get_unchecked() };
        if waiter.seen() == Seen::Granted {
            let granted = waiter.granted();
            return Ok(Step::Ready(self.finish_granted(key, granted)));
        }
        self.poll_linked_slow(key, cx, left)
    }

    /// [`poll_linked`](Self::poll_linked) of a waiter not granted (yet).
    #[inline(never)]
    fn poll_linked_slow(
        &mut self,
        key: KeyPtr<K>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        match self.poll_linked_locked(key, cx, None, left)? {
            Step::Again => {
                // The waker must be stored anew: clone it outside the lock.
                let fresh = cx.waker().clone();
                self.poll_linked_locked(key, cx, Some(fresh), left)
            }
            step => Ok(step),
        }
    }

    #[cold]
    fn poll_linked_locked(
        &mut self,
        key: KeyPtr<K>,
        cx: &mut Context<'_>,
        fresh: Option<Waker>,
        left: &mut Leftovers<K>,
    ) -> Result<Step<(T, Held<K>)>, Box<LockError>> {
        let table = self.table.as_deref().expect("present until completion");
        let shard = table.shard(self.hash);
        let mut ctx = shard.ctx(table.clock(), left);
        let gave_up = self.until().is_some_and(|until| ctx.now() >= until);
        // A wait that gives up stores no waker; its clone is dropped here,
        // before locking (`Waker::drop` is user code).
        let (fresh, name) = if gave_up {
            drop(fresh);
            // Named now, before locking (`Debug` is user code): the waiter
            // is still linked.
            // SAFETY: our waiter is linked into `key`'s queue, which keeps
            // its entry in the table.
            (None, table.name_key(unsafe { key.get() }))
        } else {
            (fresh, None)
        };
        let polled = {
            let mut state = shard.state.lock();
            // Polled first even past its deadline: the wait still takes the
            // key if it is its by now (a lapse settled, or under eventual
            // fairness a free key at the head); only then does it give up.
            // SAFETY: our own waiter, linked into `key`'s queue. `fresh` was
            // cloned before locking: `Waker::clone` is user code.
            let polled = unsafe {
                state.poll_waiter(
                    self.hash,
                    key,
                    self.waiter.get(),
                    cx.waker(),
                    fresh,
                    &mut ctx,
                )
            };
            match polled {
                Polled::Granted(granted) => Outcome::Granted(granted),
                // SAFETY: as above.
                _ if gave_up => match unsafe {
                    state.leave(
                        self.hash,
                        key,
                        self.waiter.get(),
                        Leaving::TimedOut,
                        table.fairness(),
                        &mut ctx,
                    )
                } {
                    Ok(diagnosis) => Outcome::GaveUp(diagnosis),
                    Err(granted) => Outcome::Granted(granted),
                },
                Polled::Waiting { wake_at } => Outcome::Waiting(wake_at),
                Polled::NeedWaker => Outcome::NeedWaker,
                Polled::Lost(token) => {
                    // SAFETY: as above.
                    match unsafe {
                        state.leave(
                            self.hash,
                            key,
                            self.waiter.get(),
                            Leaving::Lost,
                            table.fairness(),
                            &mut ctx,
                        )
                    } {
                        Ok(_) => Outcome::Lost(token),
                        Err(granted) => Outcome::Granted(granted),
                    }
                }
            }
        };
        let now = gave_up.then(|| ctx.now());
        match polled {
            Outcome::Granted(granted) => Ok(Step::Ready(self.finish_granted(key, granted))),
            Outcome::Waiting(wake_at) => Ok(Step::Wait(wake_at)),
            Outcome::NeedWaker => Ok(Step::Again),
            Outcome::Lost(token) => {
                *self.state = State::Done;
                // SAFETY: the guard being upgraded still points at the key,
                // so its entry stays in the table.
                let key = table.name_key(unsafe { key.get() });
                Err(Box::new(LockError::Expired { token, key }))
            }
            Outcome::GaveUp(diagnosis) => {
                *self.state = State::Done;
                let start = self.timing.start.get();
                let waited = match (start, now) {
                    (Some(start), Some(now)) => now.saturating_duration_since(start),
                    _ => Duration::ZERO,
                };
                Err(Box::new(timeout_error(table, waited, diagnosis, name)))
            }
        }
    }

    /// Moves from a state that owns nothing (`Linked`, or `Done` after the
    /// first poll took its key out) to `next`, running no drop glue: the
    /// old state has none to run, and the call to the enum's glue (for the
    /// other variants) is skipped on every lock.
    #[inline(always)]
    fn set_state(&mut self, next: State<K>) {
        let old = std::mem::replace(&mut *self.state, next);
        debug_assert!(matches!(old, State::Done | State::Linked { .. }));
        // Owns nothing (see above); were it to, that would leak, not free.
        std::mem::forget(old);
    }

    /// [`finish`](Self::finish) of a waiter's grant (the state may still
    /// say `Linked`).
    #[inline]
    fn finish_granted(&mut self, key: KeyPtr<K>, granted: Granted) -> (T, Held<K>) {
        self.set_state(State::Done);
        // As `finish`, from the grant as published (deadline and mode
        // packed already, as a guard keeps them).
        let table = self.table.take().expect("present until completion");
        let held = Held::from_granted(self.hash, key, granted.token, granted.packed);
        (table, held)
    }

    /// The output of a grant taken on the first poll, whose dispatch in
    /// [`poll_acquire`](Self::poll_acquire) set the state to `Done` already.
    #[inline(always)]
    fn finish(&mut self, grant: Grant<K>) -> (T, Held<K>) {
        debug_assert!(matches!(*self.state, State::Done));
        // The timing (an armed timer holds a clone of a waker, user code to
        // drop) stays until the future is dropped, after its guard exists.
        let table = self.table.take().expect("present until completion");
        let held = Held::new(self.hash, grant);
        (table, held)
    }

    /// Arms the timer for the earliest of the holder's lease deadline (when
    /// this waiter heads the queue) and the caller's own timeout.
    #[inline(always)]
    fn arm_timer(&mut self, wake_at: Option<Instant>, cx: &mut Context<'_>) -> Poll<()> {
        let table = self.table.as_deref().expect("present until completion");
        if table.clock().uses_shard_timers() {
            // The shard's timer wakes this waiter at its deadlines.
            return Poll::Pending;
        }
        self.arm_own_timer(wake_at, cx)
    }

    /// [`arm_timer`](Self::arm_timer) on a clock without shard timers.
    #[inline(never)]
    fn arm_own_timer(&mut self, wake_at: Option<Instant>, cx: &mut Context<'_>) -> Poll<()> {
        let table = self.table.as_deref().expect("present until completion");
        let at = match (wake_at, self.until()) {
            (Some(a), Some(b)) => a.min(b),
            (Some(at), None) | (None, Some(at)) => at,
            (None, None) => {
                *self.sleep = None;
                return Poll::Pending;
            }
        };
        let sleep = match &mut *self.sleep {
            Some(sleep) => {
                sleep.reset(at);
                sleep
            }
            None => self.sleep.insert(Box::new(Sleep::new(table.clock(), at))),
        };
        sleep.poll(cx)
    }
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
{
    /// An upgrade is dropped: unlinks its waiter, or, if it was granted and
    /// has not looked, makes that exclusive grant shared again and returns
    /// it (its token replaced the old one's).
    pub(crate) fn cancel_upgrade(self: Pin<&mut Self>, left: &mut Leftovers<K>) -> Option<Granted> {
        let this = self.project();
        let State::Linked { key } = **this.state else {
            return None;
        };
        **this.state = State::Done;
        let hash = *this.hash;
        let table = this.table.as_deref()?;
        let shard = table.shard(hash);
        let mut ctx = shard.ctx(table.clock(), left);
        let mut state = shard.state.lock();
        let waiter = this.waiter.get();
        if waiter.seen() == Seen::Granted {
            let granted = waiter.granted();
            if granted.is_orphan_notice() {
                // Told its grant lost the key: unlinked, nothing to undo.
                return None;
            }
            // Shared again; it cannot have lost the key unseen: a lapse
            // would only make this fail, and the guard then finds out.
            let _ = state.downgrade(hash, key, granted.token, &mut ctx);
            return Some(granted);
        }
        // SAFETY: our own waiter, linked (not granted: checked under the
        // lock, which every grant takes).
        let _ = unsafe {
            state.leave(
                hash,
                key,
                waiter,
                Leaving::Dropped,
                table.fairness(),
                &mut ctx,
            )
        };
        None
    }
}

impl<T, K, S> Acquire<T, K>
where
    T: TableHandle<K> + Deref<Target = LockTable<K, S>>,
    K: Eq + Hash,
    S: BuildHasher,
{
    /// [`poll_acquire`](Self::poll_acquire) of an upgrade, to the upgraded
    /// grant; the notice that the grant it upgrades lost the key while it
    /// waited ([`Granted::is_orphan_notice`]) is the error it stands for.
    #[inline]
    pub(crate) fn poll_upgrade(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        left: &mut Leftovers<K>,
    ) -> Poll<Result<Held<K>, Box<LockError>>> {
        match self.poll_acquire(cx, left) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            // An upgrade is only ever granted exclusive.
            Poll::Ready(Ok((table, held))) if held.mode() == Mode::Shared => {
                // SAFETY: the guard being upgraded still points at the key
                // (fenced, having lost it), so its entry stays in the table.
                let key = table.name_key(unsafe { held.key_ptr().get() });
                Poll::Ready(Err(Box::new(LockError::Expired {
                    token: held.token(),
                    key,
                })))
            }
            Poll::Ready(Ok((_, held))) => Poll::Ready(Ok(held)),
        }
    }
}

/// A completed acquisition: the table handle and the grant, or why it failed.
pub(crate) type Acquired<T, K> = Result<(T, Held<K>), Box<LockError>>;

/// What a locked poll of a linked waiter found.
enum Outcome {
    Granted(Granted),
    Waiting(Option<Instant>),
    NeedWaker,
    GaveUp(Diagnosis),
    Lost(FencingToken),
}

/// What [`Acquire::poll_first`] came to.
pub(crate) enum First<T, K> {
    /// The key is taken, with nothing deferred and no timer: build the
    /// output now.
    Taken((T, Held<K>)),
    /// The first poll went on (it waits, or was granted or failed while
    /// linking): as `poll_acquire`'s result.
    Polled(Poll<Acquired<T, K>>),
    /// Not a first poll the fast step covers: poll the state machine.
    Machine,
}

/// What one step of a poll came to.
enum Step<O> {
    Ready(O),
    /// Waiting; arm a timer for this instant if set.
    Wait(Option<Instant>),
    /// Waiting, with no timer to arm (the first poll's common wait:
    /// [`Acquire::arm_timer`] would arm none).
    Parked,
    /// Poll again at once (nudged while registering).
    Again,
}

/// The first poll on a key that has an entry (at `index`, in `state`, the
/// key's shard, locked), past the common wait (`enqueue_fast`): the key is
/// taken if it is open to the caller, or `waiter` linked by the general
/// path. Out of line: the first step covers a free key and the common
/// wait.
///
/// # Safety
///
/// As [`ShardState::acquire_or_enqueue_busy`].
#[inline(never)]
unsafe fn start_busy<K, S>(
    table: &LockTable<K, S>,
    state: impl DerefMut<Target = ShardState<K>>,
    (hash, index, key): (u64, Index, Option<K>),
    (mode, asks): (Mode, &Asks),
    waiter: &mut LazyWaiter,
    left: &mut Leftovers<K>,
) -> Attempt<K> {
    let Asks { terms, patience } = *asks;
    // In this order, so that unwinding unlocks before it drops the key.
    let key = key;
    let mut state = state;
    let mut ctx = table.shard(hash).ctx(table.clock(), left);
    // SAFETY: the caller's contract.
    let attempt = unsafe {
        state.acquire_or_enqueue_busy(
            index,
            mode,
            terms,
            patience,
            table.fairness(),
            waiter,
            &mut ctx,
        )
    };
    drop(state);
    if let Some(key) = key {
        ctx.drop_key_later(key);
    }
    attempt
}

/// A timeout's error: what it waited on, the holder named by its label,
/// the key by the table's [`name_keys`](crate::Builder::name_keys). Made
/// after the shard lock is released.
#[cold]
fn timeout_error<K, S>(
    table: &LockTable<K, S>,
    waited: Duration,
    diagnosis: Diagnosis,
    key: Option<Box<str>>,
) -> LockError {
    LockError::Timeout {
        waited,
        holder: diagnosis.holder,
        holder_label: table.labels().one(diagnosis.owner),
        held_for: diagnosis.held_for,
        ahead: diagnosis.ahead,
        key,
    }
}

/// A zero timeout: one attempt, no queueing.
fn try_once<K: Eq + Hash, S: BuildHasher>(
    table: &LockTable<K, S>,
    hash: u64,
    key: K,
    mode: Mode,
    terms: Terms,
    left: &mut Leftovers<K>,
) -> Result<Grant<K>, (Diagnosis, Option<Box<str>>)> {
    let shard = table.shard(hash);
    let mut key = Some(key);
    let mut ctx = shard.ctx(table.clock(), left);
    let result = {
        let mut state = shard.state.lock();
        match state.try_acquire(hash, &mut key, mode, terms, table.fairness(), &mut ctx) {
            Some(grant) => Ok(grant),
            None => {
                let probe = key.as_ref().expect("kept on failure");
                let diagnosis = state.diagnose(hash, probe, &mut ctx);
                ctx.counters().timed_out();
                Err(diagnosis)
            }
        }
    };
    let result = match result {
        Ok(grant) => Ok(grant),
        // Named after the unlock: `Debug` is user code.
        Err(diagnosis) => Err((diagnosis, key.as_ref().and_then(|k| table.name_key(k)))),
    };
    if let Some(key) = key {
        ctx.drop_key_later(key);
    }
    result
}

/// `Drop` past the common case: leaves the queue if linked, then drops the
/// timer (user code: it holds a waker), the state (the key, if the future
/// never ran) and the waiter node (its waker), in that order, each also if
/// an earlier step panics.
///
/// # Safety
///
/// Called once, from the future's `Drop`: nothing uses these fields after.
#[cold]
#[inline(never)]
unsafe fn drop_rest<T: TableHandle<K>, K>(
    sleep: &mut ManuallyDrop<Option<Box<Sleep>>>,
    table: &Option<T>,
    hash: u64,
    state: &mut ManuallyDrop<State<K>>,
    waiter: &mut ManuallyDrop<LazyWaiter>,
) {
    /// Drops its field when dropped, also while unwinding.
    struct DropOnExit<'a, V>(&'a mut ManuallyDrop<V>);
    impl<V> Drop for DropOnExit<'_, V> {
        fn drop(&mut self) {
            // SAFETY: `drop_rest`'s contract: dropped once, never used again.
            unsafe { ManuallyDrop::drop(self.0) };
        }
    }
    // Dropped in the reverse order of their declaration.
    let linked = match **state {
        State::Linked { key } => Some(key),
        _ => None,
    };
    let waiter = DropOnExit(waiter);
    let _state = DropOnExit(state);
    let _sleep = DropOnExit(sleep);
    if let Some(key) = linked {
        leave(table, hash, key, waiter.0);
    }
}

/// A dropped future's waiter is unlinked (or its unobserved grant
/// released) before its memory goes.
#[cold]
#[inline(never)]
fn leave<T: TableHandle<K>, K>(table: &Option<T>, hash: u64, key: KeyPtr<K>, waiter: &LazyWaiter) {
    if let Some(table) = table.as_ref() {
        table.leave(hash, key, waiter.get());
    }
}

/// How an acquisition reaches its table: a borrow or an `Arc`.
pub(crate) trait TableHandle<K> {
    /// Unlinks a dropped future's waiter; see [`LockTable::leave`].
    fn leave(&self, hash: u64, key: KeyPtr<K>, waiter: &Waiter);
}

impl<K, S> TableHandle<K> for &LockTable<K, S> {
    fn leave(&self, hash: u64, key: KeyPtr<K>, waiter: &Waiter) {
        LockTable::leave(self, hash, key, waiter);
    }
}

impl<K, S> TableHandle<K> for Arc<LockTable<K, S>> {
    fn leave(&self, hash: u64, key: KeyPtr<K>, waiter: &Waiter) {
        LockTable::leave(self, hash, key, waiter);
    }
}

impl<T: TableHandle<K>, K> fmt::Debug for Acquire<T, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match *self.state {
            State::Start { .. } | State::StartUpgrade { .. } => "start",
            State::Invalid(_) => "invalid",
            State::Linked { .. } => "waiting",
            State::Done => "done",
        };
        f.debug_struct("Acquire")
            .field("state", &state)
            .field("lease", &self.asks.terms.lease)
            .field("timeout", &self.asks.patience.timeout)
            .field("timing", &self.timing)
            .field("sleep", &*self.sleep)
            .finish_non_exhaustive()
    }
}

macro_rules! lock_future {
    (
        $(#[$meta:meta])*
        $name:ident<$($lt:lifetime,)? K, S>, handle: $handle:ty, output: $out:ty,
        map: |$table:ident, $held:ident| $make:expr, result: $result:ident,
        machine: $machine:ident
    ) => {
        pin_project! {
            $(#[$meta])*
            #[must_use = "futures do nothing unless polled"]
            pub struct $name<$($lt,)? K, S = DefaultHashBuilder> {
                #[pin]
                inner: Acquire<$handle, K>,
            }
        }

        impl<$($lt,)? K: Eq + Hash, S: BuildHasher> $name<$($lt,)? K, S> {
            #[inline(always)]
            pub(crate) fn new(table: $handle, key: K, opts: LockOptions) -> Self {
                Self {
                    inner: Acquire::new(table, key, opts),
                }
            }

            /// [`new`](Self::new) with `hash`, the table's hash of `key`.
            #[inline(always)]
            #[allow(dead_code)] // not every handle's future is made so
            pub(crate) fn new_hashed(table: $handle, hash: u64, key: K, opts: LockOptions) -> Self {
                Self {
                    inner: Acquire::new_hashed(table, hash, key, opts),
                }
            }
        }

        impl<$($lt,)? K: Eq + Hash, S: BuildHasher> Future for $name<$($lt,)? K, S> {
            type Output = $out;

            #[inline(always)]
            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
                let mut inner = self.project().inner;
                #[cfg(feature = "tokio")]
                let coop = match inner.as_ref().get_ref().poll_budget(cx) {
                    Poll::Ready(coop) => coop,
                    Poll::Pending => return Poll::Pending,
                };
                let mut left = Leftovers::default();
                let polled = match inner.as_mut().poll_first(cx, &mut left) {
                    First::Taken(($table, $held)) => {
                        #[cfg(feature = "tokio")]
                        if let Some(coop) = coop {
                            coop.made_progress();
                        }
                        return Poll::Ready(lock_future!(@$result Ok::<_, Box<LockError>>($make)));
                    }
                    First::Polled(polled) => polled,
                    First::Machine => inner.as_mut().$machine(cx, &mut left),
                };
                #[cfg(feature = "tokio")]
                if polled.is_ready() {
                    if let Some(coop) = coop {
                        coop.made_progress();
                    }
                }
                // A completed wait's timer (its sleeper holds a clone of a
                // waker, user code to drop) goes after the guard exists too.
                let timing = if polled.is_ready() { inner.take_timing() } else { None };
                if !left.is_dirty() && timing.is_none() {
                    // Nothing deferred, so no user code left to run: build
                    // the output straight from the poll's result, without
                    // keeping it in memory across a flush (moving it out of
                    // there after word-sized stores stalls the load).
                    return match polled {
                        Poll::Ready(r) => Poll::Ready(lock_future!(@$result r.map(|($table, $held)| $make))),
                        Poll::Pending => Poll::Pending,
                    };
                }
                let out = match polled {
                    Poll::Ready(r) => Poll::Ready(lock_future!(@$result r.map(|($table, $held)| $make))),
                    Poll::Pending => Poll::Pending,
                };
                // After the guard exists: should dropping a key or a waker
                // panic now, unwinding drops the guard, which releases.
                drop(timing);
                left.flush();
                out
            }
        }

        impl<$($lt,)? K, S> fmt::Debug for $name<$($lt,)? K, S> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&self.inner).finish()
            }
        }
    };
    (@infallible $r:expr) => {
        match $r {
            Ok(guard) => guard,
            // A plain lock has no timeout and a lease validated when the
            // table was built.
            Err(err) => unreachable!("keylock: a plain lock cannot fail: {err}"),
        }
    };
    (@fallible $r:expr) => {
        $r.map_err(|err| *err)
    };
}

lock_future! {
    /// The future returned by [`LockTable::lock`]: resolves to a [`Guard`]
    /// once the key is this caller's.
    ///
    /// # Cancel safety
    ///
    /// Dropping it at any point leaves the table as if `lock` had never been
    /// called, or, if the key had already been handed to it, passes the key
    /// on.
    Lock<'a, K, S>, handle: &'a LockTable<K, S>, output: Guard<'a, K, S>,
    map: |table, held| Guard::new(table, held), result: infallible,
    machine: poll_acquire
}

lock_future! {
    /// The future returned by [`LockTable::lock_owned`]: resolves to an
    /// [`OwnedGuard`] once the key is this caller's.
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`].
    LockOwned<K, S>, handle: Arc<LockTable<K, S>>, output: OwnedGuard<K, S>,
    map: |table, held| OwnedGuard::new(table, held), result: infallible,
    machine: poll_acquire
}

lock_future! {
    /// The future returned by [`LockTable::lock_with`]: resolves to a
    /// [`Guard`], or to a [`LockError`] if the options were invalid or the
    /// timeout ran out.
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`]. A timeout is the same as dropping the future at that
    /// moment, except that it reports what it waited on.
    LockWith<'a, K, S>, handle: &'a LockTable<K, S>, output: Result<Guard<'a, K, S>, LockError>,
    map: |table, held| Guard::new(table, held), result: fallible,
    machine: poll_machine
}

lock_future! {
    /// The future returned by [`LockTable::lock_owned_with`]: as [`LockWith`],
    /// resolving to an [`OwnedGuard`].
    ///
    /// # Cancel safety
    ///
    /// As [`Lock`].
    LockOwnedWith<K, S>, handle: Arc<LockTable<K, S>>, output: Result<OwnedGuard<K, S>, LockError>,
    map: |table, held| OwnedGuard::new(table, held), result: fallible,
    machine: poll_machine
}
