//! Taking, waiting for, releasing and converting a key's grants: the entry
//! points a lock future, a guard and `try_lock` call under the shard lock.

use std::borrow::Borrow;

use crate::error::LockError;
use crate::keys::deferred::Ctx;
use crate::keys::waiter::{Granted, LazyWaiter, Waiter, Want};
use crate::support::fairness::Fairness;
use crate::support::key_map::Index;
use crate::support::key_slot::KeyPtr;
use crate::support::lease::{PackedDuration, Terms};
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::time::clock::{Clock, Now, Stamp};
use crate::time::timer_driver::ShardTimer;

use super::entry::Entry;
use super::handoff::{holder_timer, Keys};
use super::holders::Holder;
use super::{Attempt, Diagnosis, Grant, Patience, Polled, ShardState, ENTRY_PRESENT, NO_DIAGNOSIS};

/// Why a linked waiter leaves its queue ([`ShardState::leave`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leaving {
    /// Its future was dropped: counted `cancelled`; a grant made meanwhile
    /// is released.
    Dropped,
    /// It ran out of time: counted `timed_out`, with a diagnosis; a grant
    /// made meanwhile is taken instead.
    TimedOut,
    /// Its upgrade's grant lost the key (counted `expired` or `revoked`
    /// where that was found): not counted again; a grant made meanwhile is
    /// taken instead.
    Lost,
}

impl<K> Entry<K> {
    /// Whether a newcomer in `mode` may take the key now: the holders admit
    /// it, and (strict fairness) nobody queued is served first. Under
    /// eventual fairness a free key may be taken past the queue, but a held
    /// shared key is not joined past a queued waiter: a queued writer is
    /// never starved by readers.
    #[inline]
    fn open_to(&self, mode: Mode, fairness: Fairness) -> bool {
        if !self.admits(mode) {
            return false;
        }
        self.queue.is_empty() || (fairness == Fairness::Eventual && self.holders.is_empty())
    }
}

impl<K> ShardState<K> {
    /// Takes the key if it is free (strict: and nobody waits); otherwise
    /// leaves the caller's key in `key`.
    #[inline(always)]
    pub(crate) fn try_acquire(
        &mut self,
        hash: u64,
        key: &mut Option<K>,
        mode: Mode,
        terms: Terms,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<Grant<K>>
    where
        K: Eq,
    {
        let counters = ctx.counters();
        match self.claim(hash, key, mode, terms, ctx.clock(), counters) {
            Ok(grant) => Some(grant),
            Err(busy) => self.try_acquire_busy(busy, mode, terms, fairness, ctx),
        }
    }

    /// [`try_acquire`](Self::try_acquire) once [`claim`](Self::claim) found
    /// the key's entry at `index`.
    pub(crate) fn try_acquire_busy(
        &mut self,
        index: Index,
        mode: Mode,
        terms: Terms,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<Grant<K>> {
        let (entry, mut keys) = self.at(index);
        keys.settle(entry, ctx);
        if !entry.open_to(mode, fairness) {
            return None;
        }
        Some(take_now(&mut keys, entry, mode, terms, ctx))
    }

    /// A lock once [`claim`](Self::claim) found the key's entry at `index`:
    /// takes the key if it is open to `mode`; otherwise links `waiter` at the
    /// tail of its queue.
    ///
    /// # Safety
    ///
    /// `waiter` is idle, pinned, and its owner unlinks it (through
    /// [`leave`](Self::leave) or a poll that completes) before freeing it.
    #[allow(clippy::too_many_arguments)] // the one entry point of a wait
    pub(crate) unsafe fn acquire_or_enqueue_busy(
        &mut self,
        index: Index,
        mode: Mode,
        terms: Terms,
        patience: Patience,
        fairness: Fairness,
        waiter: &mut LazyWaiter,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Attempt<K> {
        let (entry, mut keys) = self.at(index);
        keys.settle(entry, ctx);
        if entry.open_to(mode, fairness) {
            return Attempt::Acquired(take_now(&mut keys, entry, mode, terms, ctx));
        }
        let waiter = waiter.get_or_init();
        // SAFETY: the caller's contract.
        unsafe {
            enqueue(
                entry,
                waiter,
                terms,
                patience,
                Want::Grant(mode),
                false,
                ctx,
            )
        }
    }

    /// The common wait, without a [`Ctx`]: an exclusive request under
    /// strict fairness on a key that one holder holds. `waiter` is linked at
    /// the back, needing no timer of its own and arming nothing:
    ///
    /// - with no deadline anywhere (no lease on the holder, no timeout or
    ///   deadline on the wait), at once, reading no clock;
    /// - with a lease on the holder and no deadline of its own, only on the
    ///   real clock and only when the shard's timer already fires by the
    ///   holder's deadline (checked), reading no clock: a lapse, past or to
    ///   come, is settled by that firing;
    /// - with a timeout or deadline on the wait, only on the real clock and
    ///   only when the shard's timer already fires by those deadlines
    ///   (checked), after one clock read that also checks that the
    ///   holder's lease has not lapsed (a lapse is the general path's to
    ///   settle).
    ///
    /// Anything else changes nothing and returns `None`, for
    /// [`acquire_or_enqueue_busy`](Self::acquire_or_enqueue_busy). Both
    /// cases share one body, inline in the first poll: the checks, the
    /// link and the answer are written once, and the timed case makes no
    /// call but the clock's.
    ///
    /// # Safety
    ///
    /// As [`acquire_or_enqueue_busy`](Self::acquire_or_enqueue_busy).
    #[inline(always)]
    pub(crate) unsafe fn enqueue_fast(
        &mut self,
        index: Index,
        (mode, terms, patience): (Mode, Terms, Patience),
        fairness: Fairness,
        waiter: &mut LazyWaiter,
        (timer, clock): (&ShardTimer, &Clock),
    ) -> Option<Attempt<K>> {
        if mode != Mode::Exclusive || fairness != Fairness::Strict {
            return None;
        }
        let entry = self.entries.get_mut(index);
        let held_until = entry.holders.only()?.deadline;
        let (start, until, since) = if !patience.is_timed() {
            // Behind a leased holder, with no deadline of its own: the
            // shard's timer must fire by the holder's deadline, and it then
            // settles the lapse, whether the deadline is still ahead or
            // passed already (on the real clock a timer due in the past
            // fires as soon as the shard is unlocked; a manual clock's only
            // at its next `advance`, so there the general path settles a
            // lapse at once). So no clock is read to ask: a waiter that
            // comes after a lapse is granted by that firing, not by this
            // poll.
            if held_until.is_some()
                && !(clock.fires_due_timers_at_once() && timer.covers(held_until.to_raw()))
            {
                return None;
            }
            (Stamp::NONE, Stamp::NONE, Stamp::NONE)
        } else {
            if !clock.uses_shard_timers() {
                return None;
            }
            let mut now = Now::new(clock);
            if held_until.is_some()
                && !(now.is_before(held_until) && timer.covers(held_until.to_raw()))
            {
                return None;
            }
            let (start, until) = match (patience.timeout.nanos(), patience.deadline.is_some()) {
                // A timeout alone, the common timed wait: here, not a call.
                (Some(nanos), false) => {
                    let start = now.start_for_nanos_inline(nanos);
                    (start, start.plus_nanos(nanos))
                }
                _ => patience.start_and_until(&mut now),
            };
            if until.is_some() && !timer.covers(until.to_raw()) {
                return None;
            }
            // When the wait began, for the status view: its own start if
            // timed, else the coarse reading just taken for the holder's
            // lease (the owner then stamps nothing after unlocking).
            let since = if start.is_some() {
                start
            } else {
                now.coarse_seen()
            };
            (start, until, since)
        };
        let waiter = waiter.get_or_init();
        // SAFETY: the caller's contract; under the shard lock.
        unsafe {
            waiter.prepare(terms, until, Want::Grant(mode), since);
            entry.queue.push_back(waiter);
        }
        Some(Attempt::Queued {
            key: entry.key,
            wake_at: None,
            start,
            until,
        })
    }

    /// A shared holder asks to hold its key exclusively. At once if it is
    /// the only holder (a new token); otherwise `waiter` is linked at the
    /// head of the queue, ahead of every waiter, and is granted when the
    /// other shared holders are gone. Fails if the grant lost the key, or if
    /// another holder is already upgrading (both would wait for ever).
    ///
    /// # Safety
    ///
    /// As [`acquire_or_enqueue_busy`](Self::acquire_or_enqueue_busy).
    pub(crate) unsafe fn upgrade(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        patience: Patience,
        waiter: &mut LazyWaiter,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Attempt<K>, LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        let Some(&mine) = entry.holders.get(token) else {
            return Err(LockError::Expired { token, key: None });
        };
        let grant = |token, entry: &Entry<K>| Grant {
            key: entry.key,
            token,
            deadline: mine.deadline,
            mode: Mode::Exclusive,
        };
        if entry.mode == Mode::Exclusive {
            return Ok(Attempt::Acquired(grant(token, entry)));
        }
        if !entry.queue.is_empty() {
            // The queued waiters now wait for the upgrade too (a deadlock
            // search must read their edges afresh).
            ctx.counters().jumped_queue();
        }
        if entry.holders.only().is_some() {
            // The only holder: exclusive at once, with a fresh token.
            let fresh = keys.tokens.mint();
            entry.holders.remove(token, keys.spares);
            entry.holders.push(
                Holder {
                    token: fresh,
                    ..mine
                },
                keys.spares,
            );
            entry.mode = Mode::Exclusive;
            ctx.counters().acquired(false);
            return Ok(Attempt::Acquired(grant(fresh, entry)));
        }
        if let Some(head) = entry.queue.head() {
            // SAFETY: the head is linked, under the lock.
            if let Want::Upgrade(upgrading) = unsafe { Waiter::want(head) } {
                return Err(LockError::UpgradeConflict {
                    token,
                    upgrading,
                    key: None,
                });
            }
        }
        let waiter = waiter.get_or_init();
        let want = Want::Upgrade(token);
        // SAFETY: the caller's contract.
        Ok(unsafe {
            enqueue(
                entry,
                waiter,
                Terms {
                    lease: PackedDuration::NONE,
                    owner: entry.holders.owner_of(token),
                },
                patience,
                want,
                true,
                ctx,
            )
        })
    }

    /// An exclusive holder keeps the key shared from now on, with the same
    /// token; the shared waiters at the head of the queue are admitted.
    pub(crate) fn downgrade(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<(), LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        if entry.holders.get(token).is_none() {
            return Err(LockError::Expired { token, key: None });
        }
        if entry.mode == Mode::Shared {
            return Ok(());
        }
        if !entry.queue.is_empty() {
            keys.tokens.check_available();
        }
        entry.mode = Mode::Shared;
        keys.admit(entry, ctx);
        Ok(())
    }

    /// A linked waiter is polled: returns its grant once the key is its
    /// (settling a lapse first, and under eventual fairness taking a free key
    /// when it heads the queue); otherwise keeps its stored waker if it wakes
    /// the same task as `current`, or stores `fresh` (cloned by the caller
    /// before locking).
    ///
    /// # Safety
    ///
    /// `waiter` belongs to the caller and was linked into `key`'s queue (it
    /// may have been granted since).
    pub(crate) unsafe fn poll_waiter(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        waiter: &Waiter,
        current: &std::task::Waker,
        mut fresh: Option<std::task::Waker>,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Polled {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        if waiter.seen() == crate::keys::waiter::Seen::Granted {
            ctx.drop_waker_later(fresh);
            return Polled::Granted(waiter.granted());
        }
        let me = std::ptr::NonNull::from(waiter);
        // SAFETY: linked (not granted), under the lock.
        let want = unsafe { Waiter::want(me) };
        if let Want::Upgrade(token) = want {
            if entry.holders.get(token).is_none() {
                // The grant to upgrade lost the key while it waited.
                ctx.drop_waker_later(fresh);
                return Polled::Lost(token);
            }
        }
        let is_head = entry.queue.is_head(waiter);
        if let (true, true, Want::Grant(mode)) = (is_head, entry.holders.is_empty(), want) {
            // Eventual fairness: the key was freed and this head nudged.
            // SAFETY: linked (it heads the queue), under the lock.
            let terms = unsafe {
                Terms {
                    lease: Waiter::lease(me),
                    owner: Waiter::owner(me),
                }
            };
            keys.tokens.check_available();
            // SAFETY: as above.
            unsafe { entry.queue.remove(me) };
            // SAFETY: just unlinked by its owner, under the lock.
            ctx.drop_waker_later(unsafe { waiter.retire() });
            ctx.drop_waker_later(fresh);
            let grant = keys.take(entry, mode, terms, true, ctx);
            // Shared heads behind it join it; the next head must arm a timer
            // for this grant's lease, as after a handoff.
            keys.admit(entry, ctx);
            return Polled::Granted(Granted::new(grant.token, grant.deadline, mode));
        }
        // SAFETY: linked, under the lock, by the owner.
        match unsafe { waiter.arm_locked(current, &mut fresh) } {
            Ok(spare) => ctx.drop_waker_later(spare),
            Err(()) => return Polled::NeedWaker,
        }
        // SAFETY: linked, under the lock, by the owner.
        let wake_at = unsafe { holder_timer(entry, waiter, ctx) };
        Polled::Waiting { wake_at }
    }

    /// A linked waiter gives up (see [`Leaving`]): it leaves the queue. If
    /// it had been granted the key meanwhile, the grant is released as a
    /// guard would release it when its future was dropped (`Err`, the
    /// grant, otherwise: it takes the key instead).
    ///
    /// # Safety
    ///
    /// As [`poll_waiter`](Self::poll_waiter).
    pub(crate) unsafe fn leave(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        waiter: &Waiter,
        why: Leaving,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Diagnosis, Granted> {
        let timed_out = why == Leaving::TimedOut;
        if waiter.seen() == crate::keys::waiter::Seen::Granted {
            let granted = waiter.granted();
            if why != Leaving::Dropped {
                return Err(granted);
            }
            ctx.counters().cancelled();
            self.release(hash, key, granted.token, fairness, ctx);
            return Ok(NO_DIAGNOSIS);
        }
        let (entry, mut keys) = self.locate(hash, key);
        let me = std::ptr::NonNull::from(waiter);
        let mut ahead = 0;
        if timed_out {
            let mut found = false;
            // SAFETY: under the lock.
            unsafe {
                entry.queue.walk(|at, _, _| {
                    found |= at == me;
                    ahead += usize::from(!found);
                });
            }
        }
        let was_head = entry.queue.is_head(waiter);
        // SAFETY: linked (not granted, and only its owner, the caller,
        // unlinks it otherwise), under the lock.
        unsafe { entry.queue.remove(me) };
        // SAFETY: just unlinked by its owner, under the lock.
        ctx.drop_waker_later(unsafe { waiter.retire() });
        if was_head {
            if entry.holders.is_empty() && fairness == Fairness::Eventual {
                // The free key's nudge passes on (a transaction's new head
                // is granted it instead).
                keys.free_key_passes_on(entry, ctx);
            } else {
                // The new head may be admitted now (shared waiters behind a
                // departed writer or upgrade), or must arm a timer.
                keys.admit(entry, ctx);
            }
        }
        let diagnosis = match why {
            Leaving::TimedOut => {
                ctx.counters().timed_out();
                entry.diagnosis(ahead, ctx)
            }
            Leaving::Dropped => {
                ctx.counters().cancelled();
                NO_DIAGNOSIS
            }
            // The grant's loss was counted where it was found.
            Leaving::Lost => NO_DIAGNOSIS,
        };
        self.remove_if_unused(hash, key, ctx);
        Ok(diagnosis)
    }

    /// Describes why the key would make a caller wait, right now.
    pub(crate) fn diagnose(&mut self, hash: u64, key: &K, ctx: &mut Ctx<'_, '_, K>) -> Diagnosis
    where
        K: Eq,
    {
        let Some((entry, _)) = self.locate_by(hash, key) else {
            return NO_DIAGNOSIS;
        };
        let ahead = entry.queue.len();
        entry.diagnosis(ahead, ctx)
    }

    /// Grant `token` of the key becomes a hold: it belongs to no
    /// transaction any more (`hold.rs`). `false` if it no longer holds the
    /// key.
    pub(crate) fn make_hold(&mut self, hash: u64, key: KeyPtr<K>, token: FencingToken) -> bool {
        let (entry, _) = self.locate(hash, key);
        match entry.holders.get_mut(token) {
            Some(holder) => {
                holder.owner = crate::support::token::HOLD_OWNER;
                true
            }
            None => false,
        }
    }

    /// The holder of `token` lets go of the key: the waiters are admitted,
    /// or the entry is removed. A grant that had lost the key (its token no
    /// longer holds it) frees nothing but its own claim on the entry.
    #[inline(always)]
    pub(crate) fn release(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) {
        let Some(index) = self.entries.find(hash, |e| e.key == key) else {
            debug_assert!(false, "{ENTRY_PRESENT}");
            return;
        };
        self.release_at(index, token, fairness, ctx);
    }

    /// [`release`](Self::release) of the entry at `index`, already found.
    #[inline(always)]
    pub(crate) fn release_at(
        &mut self,
        index: Index,
        token: FencingToken,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) {
        let ShardState {
            entries,
            keys,
            tokens,
            fair_at,
            watchers,
            spares,
        } = self;
        let entry = entries.get_mut(index);
        // The common case: the only holder lets go, and nobody waits.
        if entry.holders.is_only(token) && entry.queue.is_empty() {
            entry.holders.clear_only();
        } else if entry.holders.get(token).is_some() {
            // Waiters to admit, or other shared holders remain.
            Keys {
                tokens,
                fair_at,
                watchers,
                spares,
            }
            .let_go(entry, token, fairness, ctx);
            // Only an upgrade that had lost its grant was left waiting, and
            // admission unlinked it (`Keys::admit`): nothing uses the entry.
            if !entry.is_unused() {
                return;
            }
        } else {
            debug_assert!(
                entry.fenced > 0,
                "a stale release comes from a fenced grant"
            );
            entry.fenced = entry.fenced.saturating_sub(1);
        }
        if entry.is_unused() {
            let removed = entries.remove(index);
            // SAFETY: the entry was just removed from the table and nothing
            // uses it: no holder, no waiter, no fenced guard.
            ctx.drop_key_later(unsafe { keys.take(removed.key) });
            removed.forget_unused();
        }
    }

    /// [`release`](Self::release) if grant `token` still holds the key with
    /// a live lease; `false` (nothing done) if it has lost the key, or its
    /// lease has lapsed unnoticed: the caller names the key (its grant keeps
    /// the entry alive) and then releases it as lost.
    pub(crate) fn release_if_live(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> bool {
        // One probe of the map for the look and the release.
        let index = self
            .entries
            .find(hash, |e| e.key == key)
            .expect(ENTRY_PRESENT);
        let live = self
            .entries
            .get_mut(index)
            .holders
            .get(token)
            .is_some_and(|h| h.is_live(ctx.clock()));
        if live {
            self.release_at(index, token, fairness, ctx);
        }
        live
    }

    /// Whether the key has a live holder now, in any mode.
    pub(crate) fn is_held<Q>(&mut self, hash: u64, key: &Q, ctx: &mut Ctx<'_, '_, K>) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key)
            .is_some_and(|(e, _)| e.holders.iter().any(|h| h.is_live(ctx.clock())))
    }

    /// How many futures wait for the key (an upgrade waiting counts).
    pub(crate) fn waiters<Q>(&mut self, hash: u64, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key).map_or(0, |(e, _)| e.queue.len())
    }
}

/// A caller takes a key it is open to; shared waiters at the head (under
/// eventual fairness, on a free key) join it.
#[inline]
fn take_now<K>(
    keys: &mut Keys<'_>,
    entry: &mut Entry<K>,
    mode: Mode,
    terms: Terms,
    ctx: &mut Ctx<'_, '_, K>,
) -> Grant<K> {
    let grant = keys.take(entry, mode, terms, false, ctx);
    if !entry.queue.is_empty() {
        // Past the queue (eventual fairness): the queued waiters now wait
        // for this grant too (a deadlock search must read their edges
        // afresh).
        jumped_queue(ctx);
        if mode == Mode::Shared {
            keys.admit(entry, ctx);
        }
    }
    grant
}

/// Counts a grant past the queue (out of line: only eventual fairness
/// takes this path).
#[cold]
#[inline(never)]
fn jumped_queue<K>(ctx: &Ctx<'_, '_, K>) {
    ctx.counters().jumped_queue();
}

/// Links `waiter` into `entry`'s queue (at the head for an upgrade) with
/// what it asks for and when it gives up.
///
/// # Safety
///
/// As [`ShardState::acquire_or_enqueue_busy`].
#[inline]
unsafe fn enqueue<K>(
    entry: &mut Entry<K>,
    waiter: &Waiter,
    terms: Terms,
    patience: Patience,
    want: Want,
    front: bool,
    ctx: &mut Ctx<'_, '_, K>,
) -> Attempt<K> {
    // When the caller gives up (too far to represent: never), from the
    // time this operation judges by, which the caller reads back.
    let (start, until) = patience.start_and_until(ctx.clock());
    ctx.cover(until);
    // When the wait began, for the status view: the wait's start if it
    // has a timeout; otherwise the owner stamps it after the unlock (no
    // clock is read under the lock for it).
    // SAFETY: the caller's contract; under the shard lock.
    unsafe {
        waiter.prepare(terms, until, want, start);
        if front {
            entry.queue.push_front(waiter);
        } else {
            entry.queue.push_back(waiter);
        }
    }
    // SAFETY: just linked, under the lock. (An upgrade heads the queue
    // now: this arms its timer for the holders' deadlines.)
    let wake_at = unsafe { holder_timer(entry, waiter, ctx) };
    Attempt::Queued {
        key: entry.key,
        wake_at,
        start,
        until,
    }
}
