//! The error of a transaction's operations: which key, and what went wrong
//! with it.

use std::fmt;

use crate::deadlock::Deadlock;
use crate::error::LockError;
use crate::mode::Mode;
use crate::token::FencingToken;

/// Why a transaction's lock, renewal or check failed. Every variant about a
/// key names it: the error carries a clone of the key (so the transaction
/// methods that can fail ask `K: Clone`; keys are cloned only when a
/// request reaches the table, never for a re-entry), and its `Display`
/// shows it with `K: Debug`.
///
/// ```
/// use std::time::Duration;
/// use keylock::{Mode, TransactionError, TransactionOptions};
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let _other = table.try_lock("acct-7").unwrap();
/// let opts = TransactionOptions::new().timeout(Duration::from_millis(5));
/// let mut txn = table.transaction_with(opts);
/// let err = txn.lock("acct-7", Mode::Shared).await.unwrap_err();
/// assert!(matches!(err, TransactionError::Lock { key: "acct-7", .. }));
/// assert!(err.to_string().starts_with("shared lock of \"acct-7\" failed: timed out"));
/// # });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransactionError<K> {
    /// The table did not grant `key`: the transaction's deadline passed
    /// ([`LockError::Timeout`], naming the holder), the options were out of
    /// range, or an upgrade conflicted with another holder's
    /// ([`LockError::UpgradeConflict`]). Nothing of the call is held.
    Lock {
        /// The key asked for.
        key: K,
        /// The mode asked for.
        mode: Mode,
        /// What the table said.
        error: LockError,
    },
    /// Under [`WaitPolicy::NoWait`](crate::WaitPolicy::NoWait) (or
    /// `SkipLocked` for one key): `key` could not be had at once.
    Busy {
        /// The key asked for.
        key: K,
        /// The mode asked for.
        mode: Mode,
        /// The token of the grant holding it then, if any (none: only
        /// waiters queued ahead, served first).
        holder: Option<FencingToken>,
    },
    /// A grant of the transaction lost its authority: its lease lapsed or
    /// it was revoked. Abort: its work is no longer protected.
    Expired {
        /// The key whose grant was lost.
        key: K,
        /// That grant's token.
        token: FencingToken,
    },
    /// Another call of this transaction is already locking or upgrading
    /// `key` (a concurrent future of an
    /// [`OwnedTransaction`](crate::OwnedTransaction)); await it first. Two
    /// requests of one owner for one key never wait on each other.
    InFlight {
        /// The key asked for.
        key: K,
    },
    /// [`unlock`](crate::Transaction::unlock) of a key the transaction does
    /// not hold.
    NotHeld {
        /// The key asked for.
        key: K,
    },
    /// The transaction ended (committed, aborted or dropped) while this call
    /// was pending; what the call had taken has been released.
    Ended,
    /// The call's wait closed a cycle of transactions waiting on each other,
    /// and this transaction was chosen to break it: the call took nothing
    /// (a `lock_all` released what it had taken). Abort the transaction
    /// (and retry it): the others of the cycle proceed once it lets go of
    /// its keys.
    Deadlock(Deadlock<K>),
}

impl<K> TransactionError<K> {
    /// The key the error is about, if any (for a deadlock: the key this
    /// transaction waited for).
    pub fn key(&self) -> Option<&K> {
        match self {
            Self::Lock { key, .. }
            | Self::Busy { key, .. }
            | Self::Expired { key, .. }
            | Self::InFlight { key }
            | Self::NotHeld { key } => Some(key),
            Self::Deadlock(deadlock) => Some(&deadlock.cycle()[0].key),
            Self::Ended => None,
        }
    }

    /// The error of a lock of `key` in `mode` the table refused, in the
    /// terms of the policy it was taken under.
    pub(crate) fn from_lock(key: K, mode: Mode, waited: bool, error: LockError) -> Self {
        match error {
            LockError::Timeout { holder, .. } if !waited => Self::Busy { key, mode, holder },
            LockError::Expired { token } => Self::Expired { key, token },
            error => Self::Lock { key, mode, error },
        }
    }
}

impl<K: fmt::Debug> fmt::Display for TransactionError<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lock { key, mode, error } => write!(f, "{mode} lock of {key:?} failed: {error}"),
            Self::Busy { key, mode, holder } => {
                write!(f, "{key:?} cannot be locked {mode} without waiting: ")?;
                match holder {
                    Some(token) => write!(f, "held by grant {token}"),
                    None => f.write_str("earlier waiters are served first"),
                }
            }
            Self::Expired { key, token } => write!(
                f,
                "the transaction's grant {token} of {key:?} has lost the key (lease lapsed or \
                 revoked); abort, do not commit its work"
            ),
            Self::InFlight { key } => write!(
                f,
                "another call of this transaction is already locking {key:?}; await it first"
            ),
            Self::NotHeld { key } => write!(f, "the transaction does not hold {key:?}"),
            Self::Ended => f.write_str(
                "the transaction ended (committed, aborted or dropped) while this lock was \
                 pending; what it had taken was released",
            ),
            Self::Deadlock(deadlock) => write!(f, "{deadlock}; abort and retry"),
        }
    }
}

impl<K: fmt::Debug> std::error::Error for TransactionError<K> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Lock { error, .. } => Some(error),
            _ => None,
        }
    }
}
