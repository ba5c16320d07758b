//! The error of a transaction's operations: which key, and what went wrong
//! with it; whether retrying the transaction may succeed; and its key-free
//! form ([`TransactionFailure`]), for `?` into `anyhow::Error` or
//! `Box<dyn Error>` when keys are borrowed.

use std::fmt;

use crate::error::LockError;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::transactions::deadlock::Deadlock;

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
    /// its keys. A *soft* cycle (one a waiter of it, waiting only for the
    /// queue on a key whose holders admit it, can be granted ahead of the
    /// queue to break) is broken that way instead, with no victim: see
    /// [`Deadlock`](crate::Deadlock).
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

    /// Whether running the transaction again may succeed where this attempt
    /// failed, as PostgreSQL's SQLSTATE class 40 (transaction rollback)
    /// says: `true` for a deadlock's victim ([`Deadlock`](Self::Deadlock))
    /// and for an upgrade refused because another shared holder of the key
    /// was already upgrading ([`LockError::UpgradeConflict`]: the two-way
    /// deadlock the table refuses before it forms). Abort the transaction
    /// and run it again (or let
    /// [`LockTable::run_transaction`](crate::LockTable::run_transaction)
    /// do it). Everything else is `false`: a timeout, a busy key under a
    /// policy that does not wait, a lost grant, a misuse.
    ///
    /// ```
    /// use keylock::{Mode, LockTable};
    /// # futures::executor::block_on(async {
    /// let table = LockTable::<&str>::new();
    /// let mut a = table.transaction();
    /// let mut b = table.transaction();
    /// a.lock("k", Mode::Shared).await?;
    /// b.lock("k", Mode::Shared).await?;
    /// let mut a_up = Box::pin(a.lock("k", Mode::Exclusive));
    /// assert!(futures::poll!(a_up.as_mut()).is_pending());
    /// let err = b.lock("k", Mode::Exclusive).await.unwrap_err();
    /// assert!(err.is_retryable(), "two upgraders: {err}");
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Deadlock(_)
                | Self::Lock {
                    error: LockError::UpgradeConflict { .. },
                    ..
                }
        )
    }

    /// The same error with its key (every key, for a deadlock) passed
    /// through `f`: to own a borrowed key, say. See also
    /// [`TransactionFailure`], which needs no key type at all.
    ///
    /// ```
    /// # use keylock::TransactionError;
    /// let err: TransactionError<&str> = TransactionError::NotHeld { key: "k" };
    /// let owned: TransactionError<String> = err.map_key(str::to_owned);
    /// assert_eq!(owned.key().map(String::as_str), Some("k"));
    /// ```
    #[must_use]
    pub fn map_key<K2>(self, mut f: impl FnMut(K) -> K2) -> TransactionError<K2> {
        match self {
            Self::Lock { key, mode, error } => TransactionError::Lock {
                key: f(key),
                mode,
                error,
            },
            Self::Busy { key, mode, holder } => TransactionError::Busy {
                key: f(key),
                mode,
                holder,
            },
            Self::Expired { key, token } => TransactionError::Expired { key: f(key), token },
            Self::InFlight { key } => TransactionError::InFlight { key: f(key) },
            Self::NotHeld { key } => TransactionError::NotHeld { key: f(key) },
            Self::Ended => TransactionError::Ended,
            Self::Deadlock(deadlock) => TransactionError::Deadlock(deadlock.map_key(f)),
        }
    }

    /// The error of a lock of `key` in `mode` the table refused, in the
    /// terms of the policy it was taken under.
    pub(crate) fn from_lock(key: K, mode: Mode, waited: bool, error: LockError) -> Self {
        match error {
            LockError::Timeout { holder, .. } if !waited => Self::Busy { key, mode, holder },
            LockError::Expired { token, .. } => Self::Expired { key, token },
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

/// A [`TransactionError`] with its key written out (with `K: Debug`)
/// instead of kept: `'static`, `Send + Sync` and free of the key's type,
/// so that a transaction over borrowed keys (`&str`) can `?` its errors
/// into `anyhow::Error` or `Box<dyn Error + Send + Sync>`, which need
/// `'static`. Made by `From` (so `?` converts into it), it keeps what a
/// retry loop and a log need: the message, the key's text, whether a retry
/// may succeed, and the table's [`LockError`] if there was one.
///
/// ```
/// use keylock::{LockTable, Mode, TransactionFailure};
/// # futures::executor::block_on(async {
/// let name = String::from("acct-1");
/// let table = LockTable::new(); // after the key it borrows
/// let _other = table.try_lock(name.as_str()).unwrap();
/// let mut txn = table.transaction();
/// let err = txn
///     .lock_with(name.as_str(), Mode::Exclusive, keylock::WaitPolicy::NoWait)
///     .await
///     .map_err(TransactionFailure::from)
///     .unwrap_err();
/// assert_eq!(err.key(), Some("\"acct-1\""));
/// assert!(!err.is_retryable());
/// let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err); // 'static
/// assert!(boxed.to_string().contains("without waiting"));
/// # });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionFailure {
    message: String,
    key: Option<String>,
    retryable: bool,
    deadlock: bool,
    lock: Option<LockError>,
}

impl TransactionFailure {
    /// As [`TransactionError::is_retryable`].
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// Whether it was a deadlock's victim ([`TransactionError::Deadlock`]).
    #[must_use]
    pub fn is_deadlock(&self) -> bool {
        self.deadlock
    }

    /// The key the error was about, as `K: Debug` writes it.
    #[must_use]
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// What the table said, if the error carried it
    /// ([`TransactionError::Lock`]).
    #[must_use]
    pub fn lock_error(&self) -> Option<&LockError> {
        self.lock.as_ref()
    }
}

impl<K: fmt::Debug> From<TransactionError<K>> for TransactionFailure {
    fn from(error: TransactionError<K>) -> Self {
        Self {
            message: error.to_string(),
            key: error.key().map(|key| format!("{key:?}")),
            retryable: error.is_retryable(),
            deadlock: matches!(error, TransactionError::Deadlock(_)),
            lock: match error {
                TransactionError::Lock { error, .. } => Some(error),
                _ => None,
            },
        }
    }
}

impl fmt::Display for TransactionFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for TransactionFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.lock.as_ref().map(|e| e as _)
    }
}
