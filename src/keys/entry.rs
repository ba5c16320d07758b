//! The entry of one key: its holder set, its mode, its FIFO queue of waiters
//! and its count of fenced grants.

use crate::keys::deferred::Ctx;
use crate::keys::waiter::{WaitList, Waiter, Want};
use crate::support::key_slot::KeyPtr;
use crate::support::mode::Mode;
use crate::time::clock::Stamp;

use super::holders::Holders;
use super::Diagnosis;

/// The state of one key that is held, awaited or still pointed at.
#[derive(Debug)]
pub(super) struct Entry<K> {
    pub(super) key: KeyPtr<K>,
    /// The current grants; empty once released (under eventual fairness,
    /// with waiters left), lapsed or revoked with nobody to hand the key to.
    pub(super) holders: Holders,
    /// The mode of `holders` (meaningless while it is empty).
    pub(super) mode: Mode,
    /// Guards (and granted waiters) that lost the key but still exist, and
    /// status-view snapshots reading the key (`keys/status.rs`).
    pub(super) fenced: u32,
    pub(super) queue: WaitList,
}

/// What the head waiter of a key may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    /// Nobody waits.
    Empty,
    /// The head waits for the holders to change.
    Blocked,
    /// The head may be granted in this mode now.
    Grant(Mode),
    /// The head upgrades the grant with this token, now the only holder.
    Upgrade,
    /// The head upgrades a grant that has lost the key: it must be told.
    Orphan,
}

impl<K> Entry<K> {
    /// A new entry held by one grant.
    pub(super) fn held(key: KeyPtr<K>, holders: Holders, mode: Mode) -> Self {
        Self {
            key,
            holders,
            mode,
            fenced: 0,
            queue: WaitList::default(),
        }
    }

    #[inline]
    pub(super) fn is_unused(&self) -> bool {
        self.holders.is_empty() && self.queue.is_empty() && self.fenced == 0
    }

    /// Disposes of an unused entry removed from the table without running
    /// its drop glue (an empty holder set owns nothing): one call fewer on
    /// every uncontended release.
    #[inline(always)]
    pub(super) fn forget_unused(self) {
        debug_assert!(self.is_unused());
        std::mem::forget(self);
    }

    /// Disposes of an entry removed from the table as its only holder let
    /// go (nobody waits, no fenced guard), without running its drop glue:
    /// a lone holder owns nothing, and the holder need not be cleared first.
    #[inline(always)]
    pub(super) fn forget_released(self) {
        debug_assert!(self.holders.only().is_some() && self.queue.is_empty() && self.fenced == 0);
        std::mem::forget(self);
    }

    /// Whether a newcomer asking for `mode` may take the key at once (it
    /// still has to respect the queue: see the callers).
    #[inline]
    pub(super) fn admits(&self, mode: Mode) -> bool {
        self.holders.admits(self.mode, mode)
    }

    /// The earliest lease deadline of the holders.
    #[inline]
    pub(super) fn holder_deadline(&self) -> Stamp {
        self.holders.earliest_deadline()
    }

    /// What the head waiter may do given the holders now.
    ///
    /// Under the shard lock.
    pub(super) fn admission(&self) -> Admission {
        let Some(head) = self.queue.head() else {
            return Admission::Empty;
        };
        // SAFETY: the head is linked, and the caller holds the shard lock.
        match unsafe { Waiter::want(head) } {
            Want::Grant(mode) if self.admits(mode) => Admission::Grant(mode),
            Want::Grant(_) => Admission::Blocked,
            Want::Upgrade(token) => match self.holders.only() {
                Some(only) if only.token == token => Admission::Upgrade,
                _ if self.holders.get(token).is_some() => Admission::Blocked,
                _ => Admission::Orphan,
            },
        }
    }

    /// What a caller waiting behind `ahead` others would be told now.
    pub(super) fn diagnosis(&self, ahead: usize, ctx: &mut Ctx<'_, '_, K>) -> Diagnosis {
        let holder = self.holders.any().copied();
        Diagnosis {
            holder: holder.map(|h| h.token),
            owner: holder.map_or(0, |h| h.owner),
            held_for: holder
                .and_then(|h| h.since.get())
                .map(|since| ctx.now().saturating_duration_since(since)),
            ahead,
        }
    }
}
