//! Errors of the lock table.

use std::fmt;

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
            Self::WouldBlock => f.write_str(
                "key is held or already awaited; use `lock().await` to queue for it",
            ),
        }
    }
}

impl std::error::Error for TryLockError {}
