//! Handing a key on: who among the waiters gets it when its holders change,
//! and the timer nudges that keep the head waiter awake for a lease.
//!
//! One rule serves every transition ([`Keys::admit`]): grant the head waiter
//! while the holders admit it, in FIFO order. An exclusive head is granted
//! once nobody holds the key; consecutive shared heads are granted together
//! while the key is free or held shared; an upgrade (linked at the head) is
//! granted once its own shared grant is the only holder. A head the holders
//! do not admit blocks everyone behind it, so a queued writer is never
//! starved by a stream of readers.

use std::time::Instant;

use super::watch::GrantWatchers;
use crate::keys::deferred::Ctx;
use crate::keys::waiter::Waiter;
use crate::support::fairness::Fairness;
use crate::support::lease::{PackedDuration, Terms};
use crate::support::mode::Mode;
use crate::support::token::{is_transaction, FencingToken, TokenCounter};
use crate::time::clock::{Now, Stamp};

use super::entry::{Admission, Entry};
use super::holders::{Holder, HolderSpares};
use super::Grant;

/// What queue surgery needs beside one entry.
pub(super) struct Keys<'s> {
    pub(super) tokens: &'s mut TokenCounter,
    pub(super) fair_at: &'s mut Option<Instant>,
    pub(super) watchers: &'s mut GrantWatchers,
    pub(super) spares: &'s mut HolderSpares,
}

impl Keys<'_> {
    /// Grants the head waiters whatever the holders now admit (see the
    /// module docs), wakes them, and makes sure the next head is woken by
    /// the holders' lease deadline.
    #[inline]
    pub(super) fn admit<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        loop {
            match entry.admission() {
                Admission::Grant(mode) => {
                    self.grant_head(entry, mode, ctx);
                    if mode == Mode::Exclusive {
                        break;
                    }
                }
                Admission::Upgrade => {
                    self.grant_upgrade(entry, ctx);
                    break;
                }
                Admission::Orphan => {
                    // Its grant is gone: it leaves the queue now, told so
                    // (a forgotten upgrade, never polled again, must not
                    // keep the queue behind it), and the next head is
                    // looked at.
                    self.drop_orphan(entry, ctx);
                }
                Admission::Blocked | Admission::Empty => break,
            }
        }
        nudge_head_for_timer(entry, ctx);
    }

    /// Adds grant `token` to the key's holders, who now hold it in `mode`.
    #[inline(always)]
    fn hold<K>(
        &mut self,
        entry: &mut Entry<K>,
        token: FencingToken,
        (deadline, since): (Stamp, Stamp),
        owner: u64,
        mode: Mode,
    ) {
        let holder = Holder {
            token,
            deadline,
            since,
            owner,
        };
        entry.holders.push(holder, self.spares);
        entry.mode = mode;
    }

    /// Grants the head waiter a new grant in `mode` and wakes it.
    fn grant_head<K>(&mut self, entry: &mut Entry<K>, mode: Mode, ctx: &mut Ctx<'_, '_, K>) {
        // Panics (token space exhausted) before anything changes.
        let token = self.tokens.mint();
        // SAFETY: under the shard lock.
        let Some((head, terms)) = (unsafe { entry.queue.pop_front() }) else {
            return;
        };
        let (deadline, since) = grant_times(terms, ctx.clock());
        // SAFETY: just unlinked, under the lock; not touched again.
        let waker = unsafe { Waiter::grant(head, token, deadline, mode) };
        self.hold(entry, token, (deadline, since), terms.owner, mode);
        ctx.counters().handed_off();
        if let Some(waker) = waker {
            ctx.wake_later(waker);
        }
    }

    /// Unlinks the head waiter, an upgrade whose grant lost the key, and
    /// tells it so ([`Waiter::tell_orphaned`]).
    #[cold]
    fn drop_orphan<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        let Some(head) = entry.queue.head() else {
            return;
        };
        // SAFETY: the head is linked, under the shard lock.
        let crate::keys::waiter::Want::Upgrade(token) = (unsafe { Waiter::want(head) }) else {
            return;
        };
        // SAFETY: under the shard lock.
        if unsafe { entry.queue.pop_front() }.is_none() {
            return;
        }
        // SAFETY: just unlinked, under the lock; not touched again.
        if let Some(waker) = unsafe { Waiter::tell_orphaned(head, token) } {
            ctx.wake_later(waker);
        }
    }

    /// Grants the head waiter, an upgrade whose shared grant is the only
    /// holder left, the key exclusively: a new token, the same lease.
    fn grant_upgrade<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        let Some(old) = entry.holders.only().copied() else {
            return;
        };
        // Panics (token space exhausted) before anything changes.
        let token = self.tokens.mint();
        // SAFETY: under the shard lock.
        let Some((head, _)) = (unsafe { entry.queue.pop_front() }) else {
            return;
        };
        entry.holders.remove(old.token, self.spares);
        // SAFETY: just unlinked, under the lock; not touched again.
        let waker = unsafe { Waiter::grant(head, token, old.deadline, Mode::Exclusive) };
        entry.holders.push(Holder { token, ..old }, self.spares);
        entry.mode = Mode::Exclusive;
        ctx.counters().upgrade_handed_off();
        if let Some(waker) = waker {
            ctx.wake_later(waker);
        }
    }

    /// The last holder let go of a key that has waiters: hand it on
    /// (strict), or, under eventual fairness while the shard's fairness
    /// deadline has not come, leave it free and nudge the head to retry,
    /// unless the head is a transaction's (see [`Keys::free_key_passes_on`]).
    #[inline(never)]
    pub(super) fn pass_on<K>(
        &mut self,
        entry: &mut Entry<K>,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) {
        debug_assert!(entry.holders.is_empty());
        if fairness == Fairness::Eventual {
            let now = ctx.now();
            match *self.fair_at {
                Some(at) if now < at => {
                    self.free_key_passes_on(entry, ctx);
                    return;
                }
                _ => {
                    *self.fair_at = Some(now.checked_add(Fairness::EVENTUAL_BOUND).unwrap_or(now));
                }
            }
        }
        self.admit(entry, ctx);
    }

    /// Under eventual fairness, a key left free with waiters (its last
    /// holder let go before the fairness deadline, or its nudged head left):
    /// the head is nudged to take it, or, if the head waits for a
    /// transaction, granted it at once as strict fairness would (with the
    /// shared heads behind it). A transaction's call may have been forgotten
    /// (`mem::forget`: its transaction keeps the wait, and the grant, until
    /// it ends) and never poll: nudged, it would keep the free key from
    /// every waiter behind it until its transaction ended. The shard's
    /// fairness deadline is left as it is: this is not the fair handoff that
    /// restarts it.
    pub(super) fn free_key_passes_on<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        debug_assert!(entry.holders.is_empty());
        // An upgrade at the head of a free key has lost its grant: told so
        // and unlinked first (a forgotten one would never leave).
        while entry.admission() == Admission::Orphan {
            self.drop_orphan(entry, ctx);
        }
        if head_is_a_transactions(entry) {
            self.admit(entry, ctx);
        } else {
            nudge_head(entry, ctx);
        }
    }

    /// The holder `token` lets go of a key that has waiters: the waiters
    /// admitted now are granted (or, once the key is free, it is passed on).
    /// Checks first that tokens are left, so that a panic changes nothing.
    pub(super) fn let_go<K>(
        &mut self,
        entry: &mut Entry<K>,
        token: FencingToken,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) {
        // The waiters need a token, now (a handoff) or when the nudged head
        // takes the key: if none is left, fail before anything changes.
        self.tokens.check_available();
        if entry.holders.is_only(token) {
            entry.holders.clear_only();
        } else {
            entry.holders.remove(token, self.spares);
        }
        if entry.holders.is_empty() {
            self.pass_on(entry, fairness, ctx);
        } else if entry.holders.any_lapsed(ctx.clock()) {
            // Other shared holders remain, one of them lapsed unnoticed: it
            // goes first, and the waiters are admitted once after (a
            // settle), so that admission does not grant a lapsed reader's
            // upgrade.
            self.settle_lapsed(entry, &[], ctx);
        } else {
            // Other shared holders remain: an upgrade at the head may now be
            // the only one.
            self.admit(entry, ctx);
        }
    }

    /// A caller takes the key in `mode` (the holders admit it).
    pub(super) fn take<K>(
        &mut self,
        entry: &mut Entry<K>,
        mode: Mode,
        terms: Terms,
        contended: bool,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Grant<K> {
        debug_assert!(entry.admits(mode));
        let token = self.tokens.mint();
        let (deadline, since) = grant_times(terms, ctx.clock());
        ctx.counters().acquired(contended);
        self.hold(entry, token, (deadline, since), terms.owner, mode);
        Grant {
            key: entry.key,
            token,
            deadline,
            mode,
        }
    }
}

/// The holders' deadlines changed or the queue got a new head: make sure the
/// head is woken by the earliest of them. With shard timers, the shard's
/// timer covers it. Otherwise nudge the head so that it re-arms its own
/// timer, unless the timer it armed already fires by then (every waiter
/// arms for the holders it saw, so with leases of one length a handoff
/// nudges nobody).
#[inline(always)]
pub(super) fn nudge_head_for_timer<K>(entry: &Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
    let deadline = entry.holder_deadline();
    if deadline.is_some() {
        nudge_head_for_deadline(entry, deadline, ctx);
    }
}

/// [`nudge_head_for_timer`] for holders with a lease deadline.
#[inline(never)]
fn nudge_head_for_deadline<K>(entry: &Entry<K>, deadline: Stamp, ctx: &mut Ctx<'_, '_, K>) {
    let Some(head) = entry.queue.head() else {
        return;
    };
    if ctx.cover(deadline) {
        return;
    }
    // SAFETY: the head is linked, and we hold the shard lock.
    let armed = unsafe { Waiter::timer_at(head) };
    if !armed.is_some() || armed > deadline {
        nudge_head(entry, ctx);
    }
}

/// The holder deadline a waiter of `entry` must be woken by: covered by the
/// shard's timer (`None` returned), or returned for the waiter's own timer
/// (any waiter arms one, not only the head: when it heads the queue later,
/// its timer already covers holders whose leases are as long), recorded in
/// its node.
///
/// # Safety
///
/// `waiter` is linked into `entry`'s queue, by its owner, under the lock.
#[inline]
pub(super) unsafe fn holder_timer<K>(
    entry: &Entry<K>,
    waiter: &Waiter,
    ctx: &mut Ctx<'_, '_, K>,
) -> Option<Instant> {
    let deadline = entry.holder_deadline();
    if ctx.cover(deadline) {
        return None;
    }
    // SAFETY: the caller's contract.
    unsafe { waiter.set_timer_at(deadline) };
    deadline.get()
}

/// Whether the head waiter, if any, waits for a transaction (its call may
/// have been forgotten, and never poll).
pub(super) fn head_is_a_transactions<K>(entry: &Entry<K>) -> bool {
    entry.queue.head().is_some_and(|head| {
        // SAFETY: the head is linked, and we hold the shard lock.
        is_transaction(unsafe { Waiter::owner(head) })
    })
}

/// Nudges the head waiter, if any.
pub(super) fn nudge_head<K>(entry: &Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
    if let Some(head) = entry.queue.head() {
        // SAFETY: the head is linked, and we hold the shard lock.
        if let Some(waker) = unsafe { Waiter::nudge(head) } {
            ctx.wake_later(waker);
        }
    }
}

/// The deadline and start of a grant on `terms` (see [`lease_from`]: a
/// grant without a lease reads no clock, so its start is not known).
#[inline(always)]
pub(super) fn grant_times(terms: Terms, now: &mut Now<'_>) -> (Stamp, Stamp) {
    lease_from(terms.lease, now)
}

/// The deadline and start of a grant with `lease`: one clock read and one
/// conversion to a stamp; the deadline is the start plus the lease, in
/// nanoseconds.
#[inline(always)]
pub(super) fn lease_from(lease: PackedDuration, now: &mut Now<'_>) -> (Stamp, Stamp) {
    match lease.nanos() {
        Some(nanos) => {
            let since = now.start_for_nanos(nanos);
            (since.plus_nanos(nanos), since)
        }
        None => (Stamp::NONE, Stamp::NONE),
    }
}
