//! What an operation leaves to do after it unlocks its shard: wake wakers,
//! drop wakers and keys. This is where user code runs, never under a lock.
//!
//! Every table operation runs as *lock → mutate → unlock → finish*. Under the
//! lock, transitions record through a [`Ctx`] the wakers to wake, the wakers
//! and the keys to drop, into [`Leftovers`] that the caller owns; dropping
//! those (after the unlock) does the work. Each is user
//! code (`Waker::wake`, `Waker::drop`, `K::drop`) and may panic: every waker
//! due a wake is woken and everything is dropped even if one of them panics,
//! and the first panic is resumed afterwards (or swallowed if the thread is
//! already unwinding, where a second panic would abort).

use std::any::Any;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::task::Waker;
use std::time::Instant;

use crate::support::stats::Counters;
use crate::time::clock::ShardHook;
use crate::time::clock::{Clock, Now, Stamp};
use crate::time::timer_driver::ShardTimer;

/// Wakers to wake and to drop after unlocking.
///
/// One operation wakes at most a granted waiter and a head that must arm a
/// timer, twice over when a lapse is settled first: four fit inline, and a
/// spill vector keeps it correct should that ever be wrong.
#[derive(Debug, Default)]
struct Deferred {
    wake: [Option<Waker>; 4],
    len: usize,
    spill: Vec<Waker>,
    discard: [Option<Waker>; 2],
}

/// One operation's context: its view of the time, its counters, and where
/// it records what it leaves to do after unlocking (the caller's
/// [`Leftovers`], dropped after the unlock).
#[derive(Debug)]
pub(crate) struct Ctx<'a, 'l, K> {
    now: Now<'a>,
    counters: &'a Counters,
    /// The shard's timer, used when the table's clock uses shard timers
    /// (the real clock: asked only when a deadline must be covered);
    /// otherwise each waiter arms its own.
    timer: (&'a ShardTimer, ShardHook),
    left: &'l mut Leftovers<K>,
}

/// The work operations leave for after the unlock: keys to drop, wakers to
/// wake and to drop. Dropping it does that work. Owned by the caller's frame,
/// outside the shard lock's scope: a lock future builds its guard first and
/// drops these after, so that if one of them panics, unwinding drops the
/// guard, which releases the key.
///
/// Most operations defer nothing, so the lists are created when first needed.
#[derive(Debug)]
pub(crate) struct Leftovers<K> {
    /// What was recorded (`WAKE`, `WORK` bits): the one byte `drop` reads
    /// on the uncontended path (the fields below have no drop glue).
    dirty: u8,
    /// The first waker to wake, kept apart from `work`: a handoff leaves
    /// this alone, and waking it then neither makes nor moves `work`.
    /// Initialized exactly while `dirty` has `WAKE`.
    wake: MaybeUninit<Waker>,
    /// Initialized exactly while `dirty` has `WORK`.
    work: MaybeUninit<Work<K>>,
}

/// The recorded work itself.
#[derive(Debug)]
struct Work<K> {
    keys: [Option<K>; 2],
    deferred: Deferred,
    /// A shard timer to arm by a deadline (raw stamp), on the table's clock.
    arm: Option<(
        std::ptr::NonNull<ShardTimer>,
        std::ptr::NonNull<Clock>,
        ShardHook,
        u64,
    )>,
}

/// `Leftovers::dirty`: `wake` holds a waker.
const WAKE: u8 = 1;
/// `Leftovers::dirty`: `work` is initialized.
const WORK: u8 = 2;

impl<K> Default for Leftovers<K> {
    #[inline]
    fn default() -> Self {
        Self {
            dirty: 0,
            wake: MaybeUninit::uninit(),
            work: MaybeUninit::uninit(),
        }
    }
}

impl<'a, 'l, K> Ctx<'a, 'l, K> {
    #[inline]
    pub(crate) fn new(
        clock: &'a Clock,
        counters: &'a Counters,
        timer: (&'a ShardTimer, ShardHook),
        left: &'l mut Leftovers<K>,
    ) -> Self {
        Self {
            now: Now::new(clock),
            counters,
            timer,
            left,
        }
    }

    /// Makes sure the shard's timer fires by `at` (none: nothing to do);
    /// `false` if the table has no shard timers.
    #[inline]
    pub(crate) fn cover(&mut self, at: Stamp) -> bool {
        if !self.now.clock().uses_shard_timers() {
            return false;
        }
        let (timer, hook) = self.timer;
        if at.is_some() && timer.lower(at.to_raw()) {
            self.left
                .arm_later(timer, self.now.clock(), hook, at.to_raw());
        }
        true
    }

    /// The time this operation judges by (read now if it was not yet).
    #[inline]
    pub(crate) fn now(&mut self) -> Instant {
        self.now.get()
    }

    /// The operation's lazily read clock.
    #[inline]
    pub(crate) fn clock(&mut self) -> &mut Now<'a> {
        &mut self.now
    }

    #[inline]
    pub(crate) fn counters(&self) -> &'a Counters {
        self.counters
    }

    /// Wakes `waker` after unlocking.
    #[inline]
    pub(crate) fn wake_later(&mut self, waker: Waker) {
        self.left.wake_later(waker);
    }

    /// Drops `waker` (without waking it) after unlocking.
    #[inline]
    pub(crate) fn drop_waker_later(&mut self, waker: Option<Waker>) {
        self.left.drop_waker_later(waker);
    }

    /// Drops `key` after unlocking.
    #[inline]
    pub(crate) fn drop_key_later(&mut self, key: K) {
        self.left.drop_key_later(key);
    }
}

impl<K> Leftovers<K> {
    /// The recorded work, created on first use.
    #[inline]
    fn work(&mut self) -> &mut Work<K> {
        if self.dirty & WORK == 0 {
            self.work.write(Work {
                keys: [None, None],
                deferred: Deferred::default(),
                arm: None,
            });
            self.dirty |= WORK;
        }
        // SAFETY: `dirty` has `WORK`, so `work` is initialized.
        unsafe { self.work.assume_init_mut() }
    }

    fn deferred(&mut self) -> &mut Deferred {
        &mut self.work().deferred
    }

    /// Wakes `waker` when dropped.
    #[inline]
    pub(crate) fn wake_later(&mut self, waker: Waker) {
        if self.dirty & WAKE == 0 {
            self.wake.write(waker);
            self.dirty |= WAKE;
            return;
        }
        let deferred = self.deferred();
        if let Some(slot) = deferred.wake.get_mut(deferred.len) {
            *slot = Some(waker);
            deferred.len += 1;
        } else {
            deferred.spill.push(waker);
        }
    }

    /// Drops `waker` (without waking it) when dropped.
    pub(crate) fn drop_waker_later(&mut self, waker: Option<Waker>) {
        let Some(waker) = waker else { return };
        let deferred = self.deferred();
        match deferred.discard.iter_mut().find(|w| w.is_none()) {
            Some(free) => *free = Some(waker),
            // A spurious wake is harmless; dropping under the lock is not.
            None => deferred.spill.push(waker),
        }
    }

    /// Arms the shard timer `timer` by `at` when dropped.
    fn arm_later(&mut self, timer: &ShardTimer, clock: &Clock, hook: ShardHook, at: u64) {
        let arm = &mut self.work().arm;
        match arm {
            Some((_, _, _, earlier)) if *earlier <= at => {}
            _ => {
                *arm = Some((
                    std::ptr::NonNull::from(timer),
                    std::ptr::NonNull::from(clock),
                    hook,
                    at,
                ));
            }
        }
    }

    /// Drops `key` when dropped (at most two keys: the caller's own, and
    /// that of an entry the operation removed).
    #[inline]
    pub(crate) fn drop_key_later(&mut self, key: K) {
        if !std::mem::needs_drop::<K>() {
            // Dropping it does nothing, so it cannot panic: skip the
            // bookkeeping.
            std::mem::forget(key);
            return;
        }
        match self.work().keys.iter_mut().find(|k| k.is_none()) {
            Some(free) => *free = Some(key),
            None => unreachable!("keylock: an operation drops at most two keys"),
        }
    }

    /// Whether any work was recorded.
    #[inline(always)]
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty != 0
    }

    /// Does the work now (wakes, drops), in place: calling it instead of
    /// `drop(leftovers)` avoids moving the whole struct.
    #[inline(always)]
    pub(crate) fn flush(&mut self) {
        if self.dirty != 0 {
            self.finish();
        }
    }

    /// The work of [`flush`](Self::flush), out of line.
    #[inline(never)]
    fn finish(&mut self) {
        if self.dirty == WAKE {
            self.wake_alone();
        } else {
            self.run();
        }
    }

    /// Wakes the only waker the operation left: a panic in it is the
    /// operation's to resume, as `run` would (nothing else is left to do),
    /// or is swallowed if the thread is already unwinding.
    #[inline(always)]
    fn wake_alone(&mut self) {
        debug_assert_eq!(self.dirty, WAKE);
        self.dirty = 0;
        // SAFETY: `dirty` had `WAKE`, so `wake` is initialized; clearing the
        // flag first hands it to this function, which reads it out once.
        let waker = unsafe { self.wake.assume_init_read() };
        if std::thread::panicking() {
            let _ = catch_unwind(AssertUnwindSafe(|| waker.wake()));
        } else {
            waker.wake();
        }
    }

    #[cold]
    #[inline(never)]
    fn run(&mut self) {
        let dirty = std::mem::replace(&mut self.dirty, 0);
        debug_assert_ne!(dirty & WORK, 0);
        // SAFETY: `dirty` had `WORK`, so `work` is initialized; clearing the
        // flag first hands it over to this function, which reads it out once.
        let Work {
            keys,
            deferred,
            arm,
        } = unsafe { self.work.assume_init_read() };
        // SAFETY: as for `work`: `dirty` had `WAKE`, and was cleared.
        let first_wake = (dirty & WAKE != 0).then(|| unsafe { self.wake.assume_init_read() });
        let mut first: Option<Box<dyn Any + Send>> = None;
        let mut note = |r: Result<(), Box<dyn Any + Send>>| {
            if let Err(p) = r {
                first.get_or_insert(p);
            }
        };
        if let Some((timer, clock, hook, at)) = arm {
            // SAFETY: the operation that recorded these borrows the table,
            // which owns the shard's timer and the clock, until after this
            // runs.
            let (timer, clock) = unsafe { (timer.as_ref(), clock.as_ref()) };
            // Only fails if the timer thread cannot start.
            note(catch_unwind(AssertUnwindSafe(|| {
                timer.arm(clock, hook, at)
            })));
        }
        let Deferred {
            wake,
            spill,
            discard,
            ..
        } = deferred;
        for waker in first_wake
            .into_iter()
            .chain(wake.into_iter().flatten())
            .chain(spill)
        {
            note(catch_unwind(AssertUnwindSafe(|| waker.wake())));
        }
        for waker in discard.into_iter().flatten() {
            note(catch_unwind(AssertUnwindSafe(|| drop(waker))));
        }
        for key in keys.into_iter().flatten() {
            note(catch_unwind(AssertUnwindSafe(|| drop(key))));
        }
        if let Some(panic) = first {
            if !std::thread::panicking() {
                resume_unwind(panic);
            }
        }
    }
}

impl<K> Drop for Leftovers<K> {
    #[inline(always)]
    fn drop(&mut self) {
        // `work` is `MaybeUninit`: `run` is what drops it, when it is there.
        self.flush();
    }
}
