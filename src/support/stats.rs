//! Cumulative counters of a table, cheap to read.
//!
//! Each shard keeps its own counters on its own cache line, written only under
//! the shard lock (a plain load and store, no read-modify-write), so counting
//! adds no shared cache line and no atomic contention to the hot path.
//! Reading sums the shards without locking them.

use std::sync::atomic::{
    AtomicU64,
    Ordering::{Relaxed, SeqCst},
};

/// A snapshot of a table's cumulative counters.
///
/// Counters are summed shard by shard without stopping the table, so a
/// snapshot taken while the table is busy may be a few events apart between
/// fields.
///
/// ```
/// let table = keylock::LockTable::new();
/// drop(table.try_lock(1).unwrap());
/// assert_eq!(table.stats().acquisitions, 1);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Grants made, waited for or not. A grant to a waiting future counts
    /// when it is made, even if the future is dropped before it runs.
    pub acquisitions: u64,
    /// Grants made to a future that had queued behind another holder.
    pub contended: u64,
    /// Grants made to a queued waiter: the key passed straight on, after a
    /// release, a lapse, a revocation or a dropped grant.
    pub handoffs: u64,
    /// Waits abandoned by dropping the future (before or after being granted).
    pub cancelled: u64,
    /// Grants whose lease was found lapsed (by a waiter's timer, a `check`,
    /// or any touch of the key) before their holder released them. A holder
    /// that releases after its deadline but before anyone noticed is counted
    /// as a plain release: nobody was kept waiting by it.
    pub expired: u64,
    /// Waits that ran out of time.
    pub timed_out: u64,
    /// Grants forced out by `revoke` or `revoke_grant`.
    pub revoked: u64,
}

/// One line: each counter by name.
///
/// ```
/// let table = keylock::LockTable::new();
/// drop(table.try_lock(1).unwrap());
/// let line = table.stats().to_string();
/// assert!(line.starts_with("1 acquisitions, 0 contended"), "{line}");
/// ```
impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} acquisitions, {} contended, {} handoffs, {} cancelled, {} expired, \
             {} timed out, {} revoked",
            self.acquisitions,
            self.contended,
            self.handoffs,
            self.cancelled,
            self.expired,
            self.timed_out,
            self.revoked
        )
    }
}

/// One shard's counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Grants taken at once (no wait).
    fresh: AtomicU64,
    /// Grants taken by a waiter that took the key itself (under eventual
    /// fairness, a nudged head finding the key free).
    taken_after_wait: AtomicU64,
    /// Grants handed to a waiter by a release: an acquisition, contended,
    /// and a handoff, counted with one write (the hot path of a contended
    /// key writes nothing else here).
    granted_on_release: AtomicU64,
    /// Upgrades handed to a waiting upgrader: a handoff only.
    upgrades_granted: AtomicU64,
    cancelled: AtomicU64,
    expired: AtomicU64,
    timed_out: AtomicU64,
    revoked: AtomicU64,
    /// Grants and waiters that went past queued waiters (an upgrade, a grant
    /// past the queue under eventual fairness): each may add wait-for edges
    /// to waits queued on the shard, which the deadlock detector's cached
    /// edges do not have (`deadlock.rs`). Not reported in [`Stats`].
    queue_jumps: AtomicU64,
}

/// Adds one; the caller holds the shard lock, so no other writer races.
#[inline]
fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Relaxed).wrapping_add(1), Relaxed);
}

impl Counters {
    /// A grant taken by its caller (`waited`: after waiting for it).
    #[inline]
    pub(crate) fn acquired(&self, waited: bool) {
        bump(if waited {
            &self.taken_after_wait
        } else {
            &self.fresh
        });
    }

    /// A grant handed by a release to the head waiter.
    #[inline]
    pub(crate) fn handed_off(&self) {
        bump(&self.granted_on_release);
    }

    /// An upgrade handed to the waiting upgrader.
    #[inline]
    pub(crate) fn upgrade_handed_off(&self) {
        bump(&self.upgrades_granted);
    }

    #[inline]
    pub(crate) fn cancelled(&self) {
        bump(&self.cancelled);
    }

    #[inline]
    pub(crate) fn expired(&self) {
        bump(&self.expired);
    }

    #[inline]
    pub(crate) fn timed_out(&self) {
        bump(&self.timed_out);
    }

    #[inline]
    pub(crate) fn revoked(&self) {
        bump(&self.revoked);
    }

    /// A grant or waiter went past the shard's queued waiters (see
    /// `queue_jumps`).
    ///
    /// Sequentially consistent (the store is on this rare path, the load is
    /// a plain load on x86): a search that reads the count without the
    /// shard lock sees every jump that came before it in the one order all
    /// such operations share, as a read under the lock would.
    #[inline]
    pub(crate) fn jumped_queue(&self) {
        let jumps = self.queue_jumps.load(Relaxed);
        self.queue_jumps.store(jumps.wrapping_add(1), SeqCst);
    }

    /// How many times anything went past the shard's queued waiters: edges
    /// read from the shard are still a superset of its edges while this has
    /// not moved.
    #[inline]
    pub(crate) fn queue_jumps(&self) -> u64 {
        self.queue_jumps.load(SeqCst)
    }

    pub(crate) fn add_to(&self, stats: &mut Stats) {
        let fresh = self.fresh.load(Relaxed);
        let taken = self.taken_after_wait.load(Relaxed);
        let granted = self.granted_on_release.load(Relaxed);
        let upgrades = self.upgrades_granted.load(Relaxed);
        stats.acquisitions += fresh.wrapping_add(taken).wrapping_add(granted);
        stats.contended += taken.wrapping_add(granted);
        stats.handoffs += granted.wrapping_add(upgrades);
        stats.cancelled += self.cancelled.load(Relaxed);
        stats.expired += self.expired.load(Relaxed);
        stats.timed_out += self.timed_out.load(Relaxed);
        stats.revoked += self.revoked.load(Relaxed);
    }
}
