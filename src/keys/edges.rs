//! Who a waiting transaction waits for at one key: the edges of the
//! wait-for graph that deadlock detection walks, read under the shard lock.
//!
//! A transaction's waiter on a key waits for
//!
//! - every holder of the key whose mode excludes what it asks for (for an
//!   upgrade: every other shared holder), and
//! - every waiter queued ahead of it whose mode excludes its own (the queue
//!   is FIFO: those are granted first; an upgrade heads the queue).
//!
//! Only grants and waiters made for a transaction name one (see
//! [`Terms`](crate::support::lease::Terms)); a plain guard waits for nothing the
//! table knows of, so it is never part of a cycle. A holder whose lease has
//! lapsed blocks nobody (the next settle admits past it). Nothing here
//! changes the shard: the detector reads the same edges twice (to find a
//! cycle, then to confirm it with every shard of the cycle locked at once).

use smallvec::SmallVec;

use crate::keys::waiter::{Waiter, Want};
use crate::support::key_slot::KeyPtr;
use crate::support::mode::Mode;
use crate::support::token::is_transaction;
use crate::time::clock::Now;

use super::ShardState;

/// One edge of the wait-for graph out of a wait: the owner it waits
/// for, and, if that transaction waits ahead of it on the same key, the
/// mode of that waiter (its wait is on this key: the search follows it
/// whether or not it is registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Edge {
    pub(crate) to: u64,
    pub(crate) ahead: Option<Mode>,
}

/// Edges, few at a time (a key's queue of up to 8 in place).
pub(crate) type Edges = SmallVec<[Edge; 8]>;

/// The mode a waiter's grant will have.
fn mode_of(want: Want) -> Mode {
    match want {
        Want::Grant(mode) => mode,
        Want::Upgrade(_) => Mode::Exclusive,
    }
}

impl<K> ShardState<K> {
    /// Whether any waiter is queued on the key at `key` (its entry kept by
    /// a grant): an upgrade heads the queue, so it counts too.
    pub(crate) fn is_awaited(&mut self, hash: u64, key: KeyPtr<K>) -> bool {
        let (entry, _) = self.locate(hash, key);
        !entry.queue.is_empty()
    }

    /// Appends to `out` the transactions that `owner`'s waiter on the key
    /// waits for (0 never: plain guards are left out; duplicates are kept),
    /// each marked with the mode of its waiter if it waits ahead on this
    /// key (then its wait is here: the detector follows it even if it is
    /// not registered).
    /// `false` if `owner` has no waiter queued on the key.
    pub(crate) fn wait_edges(
        &mut self,
        hash: u64,
        key: &K,
        owner: u64,
        out: &mut Edges,
        now: &mut Now<'_>,
    ) -> bool
    where
        K: Eq,
    {
        debug_assert_ne!(owner, 0, "only a transaction's waits have edges");
        let Some((entry, _)) = self.locate_by(hash, key) else {
            return false;
        };
        let mut ahead: SmallVec<[(u64, Mode); 8]> = SmallVec::new();
        let mut mine = None;
        // SAFETY: under the shard lock; the nodes visited are linked, and
        // each is read only here, under the lock.
        unsafe {
            entry.queue.walk(|ptr, _, _| {
                if mine.is_some() {
                    return;
                }
                let (who, want) = (Waiter::owner(ptr), Waiter::want(ptr));
                if who == owner {
                    mine = Some(want);
                } else if is_transaction(who) {
                    ahead.push((who, mode_of(want)));
                }
            });
        }
        let Some(want) = mine else {
            return false;
        };
        let asked = mode_of(want);
        out.extend(
            ahead
                .iter()
                .filter(|&&(_, mode)| !mode.is_compatible_with(asked))
                .map(|&(who, mode)| Edge {
                    to: who,
                    ahead: Some(mode),
                }),
        );
        let held = entry.mode;
        for holder in entry.holders.iter() {
            let blocks = match want {
                Want::Upgrade(token) => holder.token != token,
                Want::Grant(mode) => !held.is_compatible_with(mode),
            };
            let transaction = is_transaction(holder.owner);
            if blocks && transaction && holder.owner != owner && holder.is_live(now) {
                out.push(Edge {
                    to: holder.owner,
                    ahead: None,
                });
            }
        }
        true
    }
}
