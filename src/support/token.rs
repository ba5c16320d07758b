//! Identities the table hands out: fencing tokens, the proof a holder gives
//! that it owns what it releases, and the ids of transactions (owners).

use std::cell::Cell;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A number that identifies one grant of a [`LockTable`](crate::LockTable).
///
/// # Invariants
///
/// - **Unique across the table**: no two grants of one table, of the same key
///   or of different keys, ever carry the same token.
/// - **Strictly increasing per key**: the tokens of successive grants of the
///   same key strictly increase, even across the key's entry being removed
///   from the table while idle and created again later.
/// - **Above the floor**: every token is greater than the table's
///   [`token_floor`](crate::Builder::token_floor) (0 unless set), so a token
///   is never zero.
///
/// Tokens of *different* keys are not ordered by time: each shard of the
/// table mints its own, without a counter shared by the whole table.
///
/// Pass it to the storage you protect and have that storage refuse writes
/// that carry a token not greater than the last one it accepted: a holder
/// that lost its authority can then never overwrite its successor's work.
/// To keep that true across a restart of the process, give the new table a
/// floor at least the largest token the storage has seen (see
/// [`Builder::token_floor`](crate::Builder::token_floor)).
///
/// ```
/// let table = keylock::LockTable::new();
/// let first = table.try_lock("row-7").unwrap().token();
/// let second = table.try_lock("row-7").unwrap().token();
/// assert!(second > first);
/// let other = table.try_lock("row-8").unwrap().token();
/// assert!(other != first && other != second);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(std::num::NonZeroU64);

impl FencingToken {
    /// A token read back as a number (from a store, a log, an operator's
    /// command), e.g. to name the grant to
    /// [`revoke_grant`](crate::LockTable::revoke_grant); `None` for zero,
    /// which is never a token.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.try_lock("k").unwrap();
    /// let stored: u64 = guard.token().get();
    /// let named = keylock::FencingToken::new(stored).unwrap();
    /// assert!(table.revoke_grant("k", named));
    /// assert!(guard.is_expired());
    /// assert_eq!(keylock::FencingToken::new(0), None);
    /// ```
    #[inline]
    #[must_use]
    pub fn new(raw: u64) -> Option<Self> {
        std::num::NonZeroU64::new(raw).map(Self)
    }

    /// The token as a number, to store beside the data it fences.
    #[inline]
    #[must_use]
    pub fn get(self) -> u64 {
        self.0.get()
    }

    #[inline]
    pub(crate) fn from_raw(raw: u64) -> Self {
        Self(std::num::NonZeroU64::new(raw).expect("keylock: a fencing token is never zero"))
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The source of a shard's tokens. Touched only under the shard lock.
///
/// Shard `index` of a table of `stride` shards (a power of two) mints
/// `floor + 1 + index + n * stride` for `n = 0, 1, 2, ...`: the shards'
/// sequences are disjoint, so tokens are unique across the table, and each
/// strictly increases, so the tokens of a key (which always lives in the same
/// shard) do too, with no counter shared between shards.
///
/// # Invariants
///
/// `next` is the token the next [`mint`](Self::mint) returns, or 0 once the
/// sequence has passed `u64::MAX` (0 is never a token: every token is above
/// the floor).
#[derive(Debug)]
pub(crate) struct TokenCounter {
    next: u64,
    stride: u64,
}

impl TokenCounter {
    /// The counter of shard `index` of `stride` shards, minting tokens above
    /// `floor`.
    ///
    /// # Panics
    ///
    /// If `floor + 1 + index` does not fit in a `u64` (the builder checks
    /// this first, with a message naming the option), or the stride is zero.
    pub(crate) fn new(floor: u64, index: u64, stride: u64) -> Self {
        assert!(
            stride > 0 && index < stride,
            "keylock: shard index in range"
        );
        let next = floor
            .checked_add(1)
            .and_then(|n| n.checked_add(index))
            .expect("keylock: the token floor leaves room for every shard's first token");
        Self { next, stride }
    }

    /// Mints the next token.
    ///
    /// At one grant per nanosecond a shard's sequence lasts 584 years divided
    /// by the shard count (and less above a high floor); should it ever run
    /// out, this panics before any state is changed rather than hand out a
    /// token that does not increase.
    #[inline]
    pub(crate) fn mint(&mut self) -> FencingToken {
        self.check_available();
        let token = FencingToken::from_raw(self.next);
        self.next = self.next.checked_add(self.stride).unwrap_or(0);
        token
    }

    /// Panics, as [`mint`](Self::mint) would, if no token is left; for
    /// callers that must fail before they change anything.
    #[inline]
    pub(crate) fn check_available(&self) {
        assert!(
            self.next != 0,
            "keylock: fencing token space of a shard exhausted (no token left above \
             u64::MAX - shard count; lower the table's token floor)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::TokenCounter;

    #[test]
    fn shards_mint_disjoint_increasing_sequences_above_the_floor() {
        let mut counters: Vec<_> = (0..4).map(|i| TokenCounter::new(100, i, 4)).collect();
        let mut all = std::collections::BTreeSet::new();
        for (i, counter) in counters.iter_mut().enumerate() {
            let mut last = 100;
            for n in 0..50u64 {
                let t = counter.mint().get();
                assert_eq!(t, 101 + i as u64 + 4 * n);
                assert!(t > last);
                last = t;
                assert!(all.insert(t), "token {t} minted twice");
            }
        }
    }

    #[test]
    fn the_last_token_is_u64_max_then_minting_panics() {
        let mut c = TokenCounter::new(u64::MAX - 2, 0, 1);
        assert_eq!(c.mint().get(), u64::MAX - 1);
        assert_eq!(c.mint().get(), u64::MAX);
        let exhausted = std::panic::catch_unwind(move || c.check_available());
        assert!(exhausted.is_err());
    }

    #[test]
    fn a_stride_that_steps_past_u64_max_exhausts_the_shard() {
        // Shard 1 of 2 above u64::MAX - 3: u64::MAX - 1, then u64::MAX + 1
        // (none).
        let mut c = TokenCounter::new(u64::MAX - 3, 1, 2);
        assert_eq!(c.mint().get(), u64::MAX - 1);
        let exhausted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.mint()));
        assert!(exhausted.is_err());
        // Still exhausted, and nothing was handed out.
        assert!(std::panic::catch_unwind(move || c.check_available()).is_err());
    }
}

/// The owner word of a grant detached from its transaction as a hold
/// (`hold.rs`): it belongs to no transaction, and no guard. Owner words are
/// this module's vocabulary (a [`TransactionId`] is one), so the key machine
/// and the status view read it here.
pub(crate) const HOLD_OWNER: u64 = u64::MAX;

/// Owner words from here up (below [`HOLD_OWNER`]) name a labeled plain
/// grant: no transaction, only a label (`labels.rs`).
pub(crate) const LABEL_OWNER: u64 = 1 << 62;

/// The owner word is a transaction's (not none, a label or a hold).
#[inline]
pub(crate) const fn is_transaction(owner: u64) -> bool {
    owner != 0 && owner < LABEL_OWNER
}

/// The identity of a transaction ([`Transaction::id`](crate::Transaction::id)):
/// unique in the process, named in [`Deadlock`](crate::Deadlock) answers.
///
/// ```
/// let table = keylock::LockTable::<u32>::new();
/// let (a, b) = (table.transaction(), table.transaction());
/// assert_ne!(a.id(), b.id());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransactionId(NonZeroU64);

impl TransactionId {
    /// A new identity, never given before in this process.
    pub(crate) fn next() -> Self {
        // Each thread takes identities from a block of its own, so threads
        // that start transactions do not contend on one counter. Identities
        // only need to differ: no ordering with other memory is needed.
        const BLOCK: u64 = 1024;
        static BLOCKS: AtomicU64 = AtomicU64::new(1);
        thread_local! {
            static LOCAL: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
        }
        let id = LOCAL.with(|local| {
            let (mut next, mut end) = local.get();
            if next == end {
                next = BLOCKS.fetch_add(BLOCK, Relaxed);
                end = next + BLOCK;
            }
            local.set((next + 1, end));
            next
        });
        Self(NonZeroU64::new(id).expect("keylock: transaction ids exhausted"))
    }

    /// The identity as a number (never 0).
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// The id a grant or waiter carries, if it is a transaction's (0: none).
    pub(crate) fn from_owner(owner: u64) -> Option<Self> {
        if !is_transaction(owner) {
            return None;
        }
        NonZeroU64::new(owner).map(Self)
    }

    pub(crate) fn from_raw(raw: u64) -> Self {
        Self(NonZeroU64::new(raw).expect("a registered transaction"))
    }
}

impl fmt::Display for TransactionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transaction {}", self.0)
    }
}
