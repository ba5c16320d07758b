//! Fencing tokens: the proof a holder gives that it owns what it releases.

use std::fmt;

/// A number that identifies one grant of one key.
///
/// # Invariants
///
/// - The tokens of successive grants of the same key strictly increase, even
///   across the key's entry being removed from the table while idle and created
///   again later (tokens are drawn from a per-shard counter and a key always
///   lives in the same shard).
/// - A token is never zero.
///
/// Pass it to the storage you protect and have that storage reject writes that
/// carry a token smaller than one it has already seen: a holder that lost its
/// authority can then never overwrite its successor's work.
///
/// ```
/// let table = keylock::LockTable::new();
/// let first = table.try_lock("row-7").unwrap().token();
/// let second = table.try_lock("row-7").unwrap().token();
/// assert!(second > first);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(std::num::NonZeroU64);

impl FencingToken {
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
#[derive(Debug)]
pub(crate) struct TokenCounter {
    next: u64,
}

impl TokenCounter {
    pub(crate) fn new() -> Self {
        Self { next: 1 }
    }

    /// Mints the next token.
    ///
    /// At one grant per nanosecond the counter lasts 584 years; should it ever
    /// run out, this panics before any state is changed rather than hand out a
    /// token that does not increase.
    #[inline]
    pub(crate) fn mint(&mut self) -> FencingToken {
        self.check_available();
        let token = FencingToken::from_raw(self.next);
        self.next += 1;
        token
    }

    /// Panics, as [`mint`](Self::mint) would, if no token is left; for
    /// callers that must fail before they change anything.
    #[inline]
    pub(crate) fn check_available(&self) {
        assert!(
            self.next != u64::MAX,
            "keylock: fencing token space of a shard exhausted (2^64 grants)"
        );
    }
}
