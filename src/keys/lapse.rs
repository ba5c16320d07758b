//! Authority: lapses, revocations, renewals, checks and the shard's timer.
//!
//! A grant loses the key in exactly one place, [`Keys::displace`]: a lapse
//! being settled or a revoke. The grant is fenced (its guard, or a granted
//! waiter that has not run yet, keeps the entry alive through the fenced
//! count, and its late release frees nothing), its `Lost` futures are woken,
//! and the key's waiters are admitted as the remaining holders allow.

use std::borrow::Borrow;
use std::time::{Duration, Instant};

use super::watch::Watch;
use crate::error::LockError;
use crate::keys::deferred::Ctx;
use crate::keys::waiter::{Waiter, WaiterPtr};
use crate::support::key_slot::KeyPtr;
use crate::support::token::{is_transaction, FencingToken};
use crate::time::clock::{Now, Stamp};

use super::entry::Entry;
use super::handoff::{nudge_head_for_timer, Keys};
use super::holders::Holder;
use super::ShardState;

impl Keys<'_> {
    /// Takes the key from grant `token` (it lapsed or is revoked): the grant
    /// is fenced, its watchers woken, and the waiters admitted.
    pub(super) fn displace<K>(
        &mut self,
        entry: &mut Entry<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<Holder> {
        let holder = self.fence(entry, token, ctx)?;
        if !entry.queue.is_empty() {
            self.admit(entry, ctx);
        }
        Some(holder)
    }

    /// Takes the key from grant `token` without admitting anyone yet: the
    /// caller fences every grant that goes at once, then admits once (so
    /// that, say, an upgrade is never granted between two of them).
    fn fence<K>(
        &mut self,
        entry: &mut Entry<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<Holder> {
        entry.holders.get(token)?;
        // Checked first, so that a panic changes nothing.
        let fenced = entry
            .fenced
            .checked_add(1)
            .expect("keylock: more than 2^32 - 1 fenced guards on one key");
        if !entry.queue.is_empty() {
            self.tokens.check_available();
        }
        let holder = entry.holders.remove(token, self.spares)?;
        entry.fenced = fenced;
        // Its `Lost` futures, if any (one check when there are none).
        self.watchers.wake(holder.token, ctx);
        Some(holder)
    }

    /// Fences every grant of `tokens` that still holds the key, then admits
    /// the waiters once; returns the highest token fenced.
    fn displace_all<K>(
        &mut self,
        entry: &mut Entry<K>,
        tokens: &[FencingToken],
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<FencingToken> {
        let mut highest = None;
        for &token in tokens {
            if self.fence(entry, token, ctx).is_some() {
                highest = highest.max(Some(token));
            }
        }
        if highest.is_some() && !entry.queue.is_empty() {
            self.admit(entry, ctx);
        }
        highest
    }

    /// Notices lapsed leases: each lapsed holder is displaced.
    #[inline]
    pub(super) fn settle<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        if entry.holders.any_lapsed(ctx.clock()) {
            self.settle_lapsed(entry, &[], ctx);
        }
    }

    /// Displaces every lapsed holder (counted expired) and the grants of
    /// `also` (a revoke's, counted by the caller) all at once, then admits
    /// the waiters once; returns the highest token fenced. Admitting between
    /// two of them could grant an upgrade to a grant that is itself lapsed,
    /// or that this very call displaces.
    #[cold]
    pub(super) fn settle_lapsed<K>(
        &mut self,
        entry: &mut Entry<K>,
        also: &[FencingToken],
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<FencingToken> {
        let mut gone: Vec<FencingToken> = {
            let now = ctx.clock();
            let mut lapsed = Vec::new();
            for holder in entry.holders.iter() {
                if !holder.is_live(now) {
                    lapsed.push(holder.token);
                }
            }
            lapsed
        };
        for _ in &gone {
            ctx.counters().expired();
        }
        gone.extend_from_slice(also);
        self.displace_all(entry, &gone, ctx)
    }
}

impl<K> ShardState<K> {
    /// Whether grant `token` still has authority; settles a lapse it finds.
    pub(crate) fn check(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<FencingToken, LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        match entry.holders.get(token) {
            Some(_) => Ok(token),
            None => Err(LockError::Expired { token, key: None }),
        }
    }

    /// Whether grant `token` holds the key with a live lease, read only
    /// (nothing settled: no wake, no drop follows).
    pub(crate) fn is_live(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        now: &mut Now<'_>,
    ) -> bool {
        let (entry, _) = self.locate(hash, key);
        entry.holders.get(token).is_some_and(|h| h.is_live(now))
    }

    /// Gives grant `token` a new deadline `lease` from now, if it still has
    /// authority.
    pub(crate) fn renew(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        lease: Duration,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Stamp, LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        let start = ctx.clock().start_for(lease);
        let Some(holder) = entry.holders.get_mut(token) else {
            return Err(LockError::Expired { token, key: None });
        };
        let deadline = start.plus(lease);
        let before = std::mem::replace(&mut holder.deadline, deadline);
        if !holder.since.is_some() {
            holder.since = start;
        }
        nudge_head_for_timer(entry, ctx);
        // The grant's `Lost` futures armed their timers at the old deadline:
        // an earlier one (or a first one) needs them to re-arm; a later one
        // does not (they fire early, find the grant live, and re-arm).
        if deadline.is_some() && (!before.is_some() || deadline.to_raw() < before.to_raw()) {
            keys.watchers.wake(token, ctx);
        }
        Ok(deadline)
    }

    /// The deadline of grant `token` as the table knows it, judged now
    /// without settling anything: `Ok` while it holds the key (its deadline,
    /// which has passed if it lapsed unnoticed), `Err(now)` once it lost it.
    pub(crate) fn deadline_of(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Stamp, Instant> {
        let (entry, _) = self.locate(hash, key);
        match entry.holders.get(token) {
            Some(h) => Ok(h.deadline),
            None => Err(ctx.now()),
        }
    }

    /// A `Lost` future of grant `token` asks whether it still holds its key
    /// (settling a lapse first, which wakes every watcher of the grant) and
    /// registers, or unregisters once it lost it; see
    /// [`GrantWatchers::watch`](super::watch::GrantWatchers::watch).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn watch_grant(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        slot: &mut Option<usize>,
        current: &std::task::Waker,
        fresh: Option<std::task::Waker>,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Watch {
        let (entry, mut keys) = self.locate(hash, key);
        if entry
            .holders
            .get(token)
            .is_some_and(|h| !h.is_live(ctx.clock()))
        {
            // The settle below ends this grant and wakes its watchers; this
            // one is running: unregister it first rather than wake it.
            if let Some(i) = slot.take() {
                keys.watchers.unwatch(i, ctx);
            }
        }
        keys.settle(entry, ctx);
        let live = entry.holders.get(token).map(|h| h.deadline.get());
        keys.watchers.watch(slot, token, live, current, fresh, ctx)
    }

    /// A `Lost` future in `slot` is dropped.
    pub(crate) fn unwatch_grant(&mut self, slot: usize, ctx: &mut Ctx<'_, '_, K>) {
        self.watchers.unwatch(slot, ctx);
    }

    /// Forces grant `token` of a key out, if it is a live holder of the key,
    /// and admits the waiters; `false` (after settling a lapse it finds) if
    /// the grant no longer holds it, lapsed, or the key has no entry.
    pub(crate) fn revoke_grant<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let Some((entry, mut keys)) = self.locate_by(hash, key) else {
            return false;
        };
        let ours = entry
            .holders
            .get(token)
            .is_some_and(|h| h.is_live(ctx.clock()));
        if !ours {
            keys.settle(entry, ctx);
            return false;
        }
        if entry.holders.any_lapsed(ctx.clock()) {
            // Lapsed holders go with it, before anyone is admitted (as
            // `revoke`): admitting first could grant a lapsed reader's
            // waiting upgrade.
            keys.settle_lapsed(entry, &[token], ctx);
        } else {
            keys.displace(entry, token, ctx);
        }
        ctx.counters().revoked();
        true
    }

    /// Forces every live holder of a key out and admits the waiters; returns
    /// the highest token revoked.
    pub(crate) fn revoke<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let (entry, mut keys) = self.locate_by(hash, key)?;
        // The live holders when the call came: not a waiter that settling a
        // lapse would admit.
        let live: Vec<FencingToken> = {
            let now = ctx.clock();
            entry
                .holders
                .iter()
                .filter(|h| h.is_live(now))
                .map(|h| h.token)
                .collect()
        };
        for _ in &live {
            ctx.counters().revoked();
        }
        // The lapsed go with them, all fenced before anyone is admitted (the
        // lapse is not settled first): an upgrade waiting at the head is not
        // granted to a grant this very call revokes.
        let displaced = keys.settle_lapsed(entry, &live, ctx);
        displaced.and(live.into_iter().max())
    }

    /// The shard's timer fired at `now` (a raw stamp): nudges every waiter
    /// whose timeout has come and the head of every queue one of whose
    /// holders' lease has lapsed (and, if that head waits for a
    /// transaction, the waiters behind it up to the first that does not),
    /// each of which settles when it polls,
    /// collecting their wakers into `wakers`; returns the earliest deadline
    /// still to come (`u64::MAX`: none). Touches no key.
    pub(crate) fn fire_timers(&mut self, now: u64, wakers: &mut Vec<std::task::Waker>) -> u64 {
        let mut next = u64::MAX;
        let mut due = |at: Stamp, waiter: WaiterPtr, wakers: &mut Vec<_>| {
            let at = at.to_raw();
            if at == 0 {
                return;
            }
            if at <= now {
                // SAFETY: linked, under the shard lock.
                wakers.extend(unsafe { Waiter::nudge(waiter) });
            } else {
                next = next.min(at);
            }
        };
        for (_, entry) in self.entries.iter() {
            let Some(head) = entry.queue.head() else {
                continue;
            };
            let lapse = entry.holder_deadline();
            due(lapse, head, wakers);
            // A lapse is settled by whichever waiter polls next, the head
            // nudged for it. A transaction's call at the head may have been
            // forgotten (its transaction keeps the wait until it ends) and
            // never poll, and the waiters behind it arm no timer of their
            // own for the holders: nudge them too, up to the first that
            // waits for no transaction (it polls).
            let lapsed = lapse.is_some() && lapse.to_raw() <= now;
            // SAFETY: the head is linked, under the shard lock.
            if lapsed && is_transaction(unsafe { Waiter::owner(head) }) {
                let mut reached = false;
                // SAFETY: under the shard lock; every visited waiter is linked.
                unsafe {
                    entry.queue.walk(|waiter, _, _| {
                        if reached || waiter == head {
                            return;
                        }
                        wakers.extend(Waiter::nudge(waiter));
                        reached = !is_transaction(Waiter::owner(waiter));
                    });
                }
            }
            // SAFETY: under the shard lock; every visited waiter is linked.
            unsafe {
                entry
                    .queue
                    .walk(|waiter, _, _| due(Waiter::until(waiter), waiter, wakers));
            }
        }
        next
    }
}
