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
/// assert_eq!(err, keylock::TryLockError::WouldBlock { key: None });
///
/// // A table that names keys says which one.
/// let table = keylock::LockTable::builder().name_keys().build();
/// let _held = table.try_lock("k").unwrap();
/// let err = table.try_lock("k").unwrap_err();
/// assert_eq!(err.to_string(), "key \"k\" is held or already awaited; use `lock().await` to queue for it");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TryLockError {
    /// The key is held, or other callers already wait for it and are served
    /// first.
    WouldBlock {
        /// The key, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
    },
}

impl fmt::Display for TryLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WouldBlock { key } => {
                write_key(f, key)?;
                f.write_str(" is held or already awaited; use `lock().await` to queue for it")
            }
        }
    }
}

/// "key K" if the error names its key, else "the key".
fn write_key(f: &mut fmt::Formatter<'_>, key: &Option<Box<str>>) -> fmt::Result {
    match key {
        Some(key) => write!(f, "key {key}"),
        None => f.write_str("the key"),
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
    WouldBlock {
        /// The key, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
    },
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
        /// Its key, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
    },
    /// [`release_hold`](crate::LockTable::release_hold) was given a token
    /// that names no hold of the key: it was never detached as one (a
    /// plain guard's token, another key's hold, a made-up token), it was
    /// released already, or it lost its key (lapsed or revoked) and its
    /// record was cleared. Nothing was released.
    NoSuchHold {
        /// The token given.
        token: FencingToken,
        /// The key given, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
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
        /// The key, by its `Debug` form, if the table names keys
        /// ([`Builder::name_keys`](crate::Builder::name_keys)).
        key: Option<Box<str>>,
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
            Self::WouldBlock { key } => {
                write_key(f, key)?;
                f.write_str(" is held or already awaited; wait with `lock_with` or give a timeout")
            }
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
            Self::Expired { token, key } => {
                write!(f, "grant {token} has lost ")?;
                write_key(f, key)?;
                f.write_str(" (lease lapsed or revoked); do not commit its work")
            }
            Self::NoSuchHold { token, key } => {
                write!(f, "no hold of ")?;
                write_key(f, key)?;
                write!(
                    f,
                    " has grant {token} (never detached as a hold, released already, or lost \
                     and cleared); nothing was released"
                )
            }
            Self::UpgradeConflict {
                token,
                upgrading,
                key,
            } => {
                write!(f, "grant {token} cannot upgrade ")?;
                write_key(f, key)?;
                write!(
                    f,
                    " to exclusive: shared grant {upgrading} of it is already upgrading, and \
                     each would wait for the other; release it and retry"
                )
            }
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
            TryLockError::WouldBlock { key } => Self::WouldBlock { key },
        }
    }
}

impl LockError {
    /// The error with its key's name (from the table's
    /// [`name_key`](crate::LockTable)), if it has a key field that is still
    /// empty. Called by the table after it unlocked: naming runs user code.
    pub(crate) fn with_key(mut self, name: impl FnOnce() -> Option<Box<str>>) -> Self {
        match &mut self {
            Self::WouldBlock { key }
            | Self::Timeout { key, .. }
            | Self::Expired { key, .. }
            | Self::NoSuchHold { key, .. }
            | Self::UpgradeConflict { key, .. } => {
                if key.is_none() {
                    *key = name();
                }
            }
            Self::InvalidOptions { .. } => {}
        }
        self
    }
}
