//! Breaking a soft deadlock: one waiter granted ahead of the waiters queued
//! before it, on a key whose holders already admit it.
//!
//! Strict FIFO is the rule everywhere in the key machine; this is its one
//! exception, and nothing in the key machine calls it. The deadlock
//! detector (`deadlock.rs`) does, under its own lock, and only to break a
//! cycle of waits it found and confirmed that runs through this waiter's
//! wait for the queue ahead of it (a *soft* edge: the waiter waits for
//! queued waiters, not for a holder). Named in the key machine's terms: a
//! key, an owner id, a shared ask.

use crate::keys::deferred::Ctx;
use crate::keys::waiter::{Waiter, WaiterPtr, Want};
use crate::support::mode::Mode;

use super::handoff::{grant_times, nudge_head_for_timer};
use super::holders::Holder;
use super::ShardState;

impl<K> ShardState<K> {
    /// Grants `owner`'s waiter on the key equal to `key` (the first of the
    /// queue that is `owner`'s, as [`wait_edges`](Self::wait_edges) reads
    /// it) the key now, ahead of the waiters queued before it, if
    ///
    /// - it asks for the key shared (not an upgrade),
    /// - the key is held, every holder's lease is live, and the holders
    ///   admit a shared grant (they hold it shared), and
    /// - a waiter queued ahead of it asks for what excludes it (so it waits
    ///   only for the queue: without the jump it would be granted in turn).
    ///
    /// The grant is made as a handoff is (a fresh token, the lease measured
    /// from now, the waiter woken after unlocking), and counted as one; the
    /// shard's count of queue jumps moves (the waiters it passed now wait
    /// for it). The head waiter is left where it is (an exclusive wait or
    /// an upgrade: the holders do not admit it, before or after), and is
    /// nudged to arm its timer if the new grant's lease ends first.
    /// `false` (nothing changed) otherwise. `K: Eq` runs in the probe.
    pub(crate) fn grant_past_queue(
        &mut self,
        hash: u64,
        key: &K,
        owner: u64,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> bool
    where
        K: Eq,
    {
        let Some((entry, keys)) = self.locate_by(hash, key) else {
            return false;
        };
        if entry.holders.is_empty()
            || !entry.admits(Mode::Shared)
            || entry.holders.any_lapsed(ctx.clock())
        {
            return false;
        }
        let mut blocked = false;
        let mut mine: Option<(WaiterPtr, Want)> = None;
        // SAFETY: under the shard lock; the nodes visited are linked, and
        // each is read only here, under the lock.
        unsafe {
            entry.queue.walk(|ptr, _, _| {
                if mine.is_some() {
                    return;
                }
                let want = Waiter::want(ptr);
                if Waiter::owner(ptr) == owner {
                    mine = Some((ptr, want));
                } else {
                    blocked |= !matches!(want, Want::Grant(Mode::Shared));
                }
            });
        }
        let Some((me, Want::Grant(Mode::Shared))) = mine else {
            return false;
        };
        if !blocked {
            return false;
        }
        // Panics (token space exhausted) before anything changes.
        let token = keys.tokens.mint();
        // SAFETY: linked, under the lock.
        let (lease, owner) = unsafe { (Waiter::lease(me), Waiter::owner(me)) };
        // SAFETY: as above.
        unsafe { entry.queue.remove(me) };
        let terms = crate::support::lease::Terms { lease, owner };
        let (deadline, since) = grant_times(terms, ctx.clock());
        // SAFETY: just unlinked, under the lock; not touched again.
        let waker = unsafe { Waiter::grant(me, token, deadline, Mode::Shared) };
        entry.holders.push(
            Holder {
                token,
                deadline,
                since,
                owner,
            },
            keys.spares,
        );
        ctx.counters().handed_off();
        ctx.counters().jumped_queue();
        if let Some(waker) = waker {
            ctx.wake_later(waker);
        }
        nudge_head_for_timer(entry, ctx);
        true
    }
}
