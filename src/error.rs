//! Errors of the lock table, each naming what went wrong and what to do.

use std::fmt;
use std::time::Duration;

use crate::support::token::FencingToken;

/// Why `try_lock` did not take the key.
///
/// ```
/// let table = keylock::LockTable::new();
/// let _held = table.try_lock("k").unwrap();
/// let err = table.try_lock("k").unwrap_err();
/// assert_eq!(err, keylock::TryLockError::WouldBlock);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TryLockError {
    /// The key is held, or other callers already wait for it and are served
    /// first.
    WouldBlock,
}

impl fmt::Display for TryLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WouldBlock => {
                f.write_str("key is held or already awaited; use `lock().await` to queue for it")
            }
        }
    }
}

impl std::error::Error for TryLockError {}

/// Why a lock with options, or a check of a held lock, failed.
///
/// ```
/// use std::time::Duration;
/// let table = keylock::LockTable::<&str>::new();
/// let err = table
///     .try_lock_with("k", keylock::LockOptions::new().lease(Duration::ZERO))
///     .unwrap_err();
/// assert!(matches!(err, keylock::LockError::InvalidOptions { option: "lease", .. }));
/// assert!(err.to_string().contains("lease"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockError {
    /// The key is held or awaited and the caller would not wait.
    WouldBlock,
    /// The wait ran out.
    Timeout {
        /// How long the caller waited.
        waited: Duration,
        /// The token of the key's holder when the caller gave up, if any.
        /// Tokens are unique across the table, so it names exactly one grant
        /// (compare it with a guard's [`token`](crate::Guard::token), or
        /// revoke that grant alone with
        /// [`revoke_grant`](crate::LockTable::revoke_grant)).
        holder: Option<FencingToken>,
        /// That holder's label, if it has one: its
        /// [`LockOptions::label`](crate::LockOptions::label), or its
        /// transaction's
        /// [`TransactionOptions::label`](crate::TransactionOptions::label).
        holder_label: Option<&'static str>,
        /// How long that holder had held the key, when known: the grant had
        /// a lease (or was renewed), so its start was read from the clock.
        held_for: Option<Duration>,
        /// How many others were still queued ahead of the caller.
        ahead: usize,
        /// The key waited for, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
    },
    /// The grant lost its authority: its lease lapsed or it was revoked. Its
    /// guard no longer protects anything; do not commit.
    Expired {
        /// The token of the grant that lapsed.
        token: FencingToken,
    },
    /// [`release_hold`](crate::LockTable::release_hold) was given a token
    /// that names no hold of the key: it was never detached as one (a
    /// plain guard's token, another key's hold, a made-up token), it was
    /// released already, or it lost its key (lapsed or revoked) and its
    /// record was cleared. Nothing was released.
    NoSuchHold {
        /// The token given.
        token: FencingToken,
    },
    /// Another shared holder of the key is already waiting to upgrade to
    /// exclusive: both would wait for the other's shared grant for ever, so
    /// this upgrade fails at once. Release this grant (abort the
    /// transaction) and retry.
    UpgradeConflict {
        /// The grant that asked to upgrade and was refused.
        token: FencingToken,
        /// The shared grant already waiting to upgrade.
        upgrading: FencingToken,
    },
    /// An option was out of range; nothing was queued.
    InvalidOptions {
        /// The option at fault.
        option: &'static str,
        /// The value given.
        value: Duration,
        /// The smallest accepted value.
        min: Duration,
        /// The largest accepted value (the table's `max_lease` for a lease).
        max: Duration,
    },
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WouldBlock => f.write_str(
                "key is held or already awaited; wait with `lock_with` or give a timeout",
            ),
            Self::Timeout {
                waited,
                holder,
                holder_label,
                held_for,
                ahead,
                key,
            } => {
                match key {
                    Some(key) => write!(f, "timed out after {waited:?} waiting for key {key}")?,
                    None => write!(f, "timed out after {waited:?} waiting for the key")?,
                }
                match holder {
                    Some(token) => write!(f, "; held by grant {token} of this table")?,
                    None => f.write_str("; it had no live holder")?,
                }
                if let Some(label) = holder_label {
                    write!(f, " ({label:?})")?;
                }
                if let Some(held) = held_for {
                    write!(f, " for {held:?}")?;
                }
                write!(f, ", {ahead} waiter(s) ahead")
            }
            Self::Expired { token } => write!(
                f,
                "grant {token} has lost the key (lease lapsed or revoked); do not commit its work"
            ),
            Self::NoSuchHold { token } => write!(
                f,
                "no hold of this key has grant {token} (never detached as a hold, released \
                 already, or lost and cleared); nothing was released"
            ),
            Self::UpgradeConflict { token, upgrading } => write!(
                f,
                "grant {token} cannot upgrade to exclusive: shared grant {upgrading} of the same \
                 key is already upgrading, and each would wait for the other; release it and retry"
            ),
            Self::InvalidOptions {
                option,
                value,
                min,
                max,
            } => write!(
                f,
                "invalid {option} {value:?}: must be between {min:?} and {max:?}"
            ),
        }
    }
}

impl std::error::Error for LockError {}

impl From<TryLockError> for LockError {
    fn from(err: TryLockError) -> Self {
        match err {
            TryLockError::WouldBlock => Self::WouldBlock,
        }
    }
}
