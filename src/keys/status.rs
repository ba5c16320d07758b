//! What the status view reads of a key under the shard lock: its holders
//! and its waiters in queue order. Nothing changes but a pin: a snapshot of
//! the whole shard counts each entry it read among the entry's fenced
//! grants, so that the entry, and the key cell the view clones its key from
//! after the lock is released, stay until the view unpins it.

use std::borrow::Borrow;

use smallvec::SmallVec;

use crate::keys::deferred::Ctx;
use crate::keys::waiter::{Waiter, Want};
use crate::support::key_slot::KeyPtr;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::time::clock::{Now, Stamp};

use super::entry::Entry;
use super::{ShardState, ENTRY_PRESENT};

/// One grant of a key, as read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawHolder {
    pub(crate) token: FencingToken,
    pub(crate) owner: u64,
    pub(crate) since: Stamp,
    pub(crate) deadline: Stamp,
    /// Its lease has lapsed (it is displaced at the next settle).
    pub(crate) lapsed: bool,
}

/// One waiter of a key, as read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawWaiter {
    pub(crate) owner: u64,
    pub(crate) want: Want,
    pub(crate) since: Stamp,
}

/// A key's holders (all in `mode`) and waiters, head first.
#[derive(Debug, Clone)]
pub(crate) struct RawStatus {
    pub(crate) mode: Mode,
    pub(crate) holders: SmallVec<[RawHolder; 1]>,
    pub(crate) waiters: Vec<RawWaiter>,
}

fn read<K>(entry: &Entry<K>, now: &mut Now<'_>) -> RawStatus {
    let holders = entry
        .holders
        .iter()
        .map(|h| RawHolder {
            token: h.token,
            owner: h.owner,
            since: h.since,
            deadline: h.deadline,
            lapsed: !h.is_live(now),
        })
        .collect();
    let mut waiters = Vec::new();
    // SAFETY: under the shard lock; the nodes visited are linked and read
    // only here.
    unsafe {
        entry.queue.walk(|ptr, _, _| {
            waiters.push(RawWaiter {
                owner: Waiter::owner(ptr),
                want: Waiter::want(ptr),
                since: Waiter::since(ptr),
            });
        });
    }
    RawStatus {
        mode: entry.mode,
        holders,
        waiters,
    }
}

impl<K> ShardState<K> {
    /// The status of the key, if it is held or awaited.
    pub(crate) fn status_of<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        now: &mut Now<'_>,
    ) -> Option<RawStatus>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let (entry, _) = self.locate_by(hash, key)?;
        let status = read(entry, now);
        (!status.holders.is_empty() || !status.waiters.is_empty()).then_some(status)
    }

    /// The status of every key of the shard that is held or awaited, with
    /// its hash and key cell, each entry pinned: the caller unpins each one
    /// with [`unpin`](Self::unpin).
    pub(crate) fn snapshot(
        &mut self,
        now: &mut Now<'_>,
        out: &mut Vec<(u64, KeyPtr<K>, RawStatus)>,
    ) {
        for (hash, entry) in self.entries.iter_mut() {
            let status = read(entry, now);
            if status.holders.is_empty() && status.waiters.is_empty() {
                continue;
            }
            add_pin(entry);
            out.push((hash, entry.key, status));
        }
    }

    /// Pins the entry of `key`, which a guard (live or fenced) keeps in the
    /// table, as [`snapshot`](Self::snapshot) pins what it read: its key
    /// can then be cloned after the shard lock is released, until
    /// [`unpin`](Self::unpin).
    pub(crate) fn pin(&mut self, hash: u64, key: KeyPtr<K>) {
        let index = self
            .entries
            .find(hash, |e| e.key == key)
            .expect(ENTRY_PRESENT);
        add_pin(self.entries.get_mut(index));
    }

    /// Lets go of a pin [`snapshot`](Self::snapshot) took; the entry goes
    /// if nothing else uses it.
    pub(crate) fn unpin(&mut self, hash: u64, key: KeyPtr<K>, ctx: &mut Ctx<'_, '_, K>) {
        let index = self
            .entries
            .find(hash, |e| e.key == key)
            .expect(ENTRY_PRESENT);
        let entry = self.entries.get_mut(index);
        debug_assert!(entry.fenced > 0, "pinned by a snapshot or a pin");
        entry.fenced = entry.fenced.saturating_sub(1);
        if entry.is_unused() {
            let removed = self.entries.remove(index);
            // SAFETY: the entry was just removed from the table and nothing
            // uses it: no holder, no waiter, no fenced guard or pin.
            ctx.drop_key_later(unsafe { self.keys.take(removed.key) });
            removed.forget_unused();
        }
    }
}

/// One more pin on `entry` (counted with its fenced guards: an entry is
/// not removed while any is left).
fn add_pin<K>(entry: &mut Entry<K>) {
    entry.fenced = entry
        .fenced
        .checked_add(1)
        .expect("keylock: more than 2^32 - 1 fenced guards on one key");
}
