//! The fairness policy of a table: strict FIFO (the default) or eventual
//! fairness for hot keys.

use std::time::Duration;

/// How a released key passes to the next caller.
///
/// ```
/// use keylock::{Fairness, LockTable};
/// let table: LockTable<u64> = LockTable::builder().fairness(Fairness::Eventual).build();
/// assert_eq!(table.fairness(), Fairness::Eventual);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fairness {
    /// Every release hands the key directly to the oldest waiter, which owns
    /// it from that moment even before it runs; neither a newcomer nor
    /// `try_lock` can take it. Waiters are served strictly in arrival order.
    #[default]
    Strict,
    /// A release frees the key and wakes the oldest waiter, and a caller that
    /// is already running may take the key first (barging), which spares a
    /// context switch per acquisition on a hot key. Bounded: once the oldest
    /// waiter has waited [`Fairness::EVENTUAL_BOUND`], the next release hands
    /// the key to it directly, as under `Strict`, so every waiter is served.
    /// A transaction's waiter at the head is always handed the key directly
    /// (its call may not be polled again: a forgotten call's wait is the
    /// transaction's until it ends).
    Eventual,
}

impl Fairness {
    /// Under [`Fairness::Eventual`], how long the oldest waiter may be
    /// passed over before a release hands the key to it directly (the same
    /// bound as parking_lot's eventual fairness).
    pub const EVENTUAL_BOUND: Duration = Duration::from_micros(500);
}
