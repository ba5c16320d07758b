//! Errors of the process scope, each naming the path or the holder at fault.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use super::stamp::ProcessHolder;
use crate::FencingToken;

/// Why a process-scope lock, check or read failed.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-err-{}", std::process::id()));
/// let err = keylock::ProcessLockTable::<&str>::open(dir.join("missing")).unwrap_err();
/// assert!(matches!(err, keylock::ProcessLockError::Io { .. }));
/// assert!(err.to_string().contains("missing"), "the message names the path");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum ProcessLockError {
    /// A file operation failed: the directory is missing or unwritable, the
    /// file system refuses locks, the disk is full, ... Nothing is held.
    Io {
        /// What was being done ("open the lock directory", "write the owner
        /// stamp", ...).
        op: &'static str,
        /// The file or directory it was done to.
        path: PathBuf,
        /// The operating system's answer.
        source: io::Error,
    },
    /// The key cannot be mapped to a file name: its encoding (see
    /// [`MAX_ENCODED_KEY`](super::MAX_ENCODED_KEY)) is too long.
    Key {
        /// The key's length in bytes.
        key_len: usize,
        /// The length its encoding would have.
        encoded_len: usize,
        /// The longest encoding accepted.
        max: usize,
    },
    /// A key's state file holds something that is not a keylock state (or a
    /// state of a newer format): it is left untouched and the key refused,
    /// rather than restarting its fencing tokens.
    Corrupt {
        /// The state file.
        path: PathBuf,
    },
    /// An option was out of range or unsupported; nothing was taken.
    InvalidOptions {
        /// The option at fault.
        option: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// The key is held by a live holder and the caller would not wait.
    WouldBlock {
        /// Who holds it, as its stamp says.
        holder: Option<Box<ProcessHolder>>,
    },
    /// The wait ran out.
    Timeout {
        /// How long the caller waited.
        waited: Duration,
        /// Who held the key when the caller gave up: pid, whether it holds
        /// its kernel lock (is alive), its token, how long it had held the
        /// key, its label. `None` if the key had no holder (another waiter
        /// of this process was ahead).
        holder: Option<Box<ProcessHolder>>,
        /// The key's state file.
        path: PathBuf,
    },
    /// The grant lost its authority: its lease lapsed and another process
    /// took the key over, or its state file was deleted. Do not commit.
    Expired {
        /// The token of the grant that lost the key.
        token: FencingToken,
    },
}

impl ProcessLockError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

impl fmt::Display for ProcessLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { op, path, source } => {
                write!(f, "cannot {op} `{}`: {source}", path.display())
            }
            Self::Key {
                key_len,
                encoded_len,
                max,
            } => write!(
                f,
                "a key of {key_len} bytes encodes to a file name of {encoded_len} bytes, over \
                 the limit of {max}; use a shorter key (or a digest of it)"
            ),
            Self::Corrupt { path } => write!(
                f,
                "`{}` is not a keylock state file (or is of a newer format); left untouched",
                path.display()
            ),
            Self::InvalidOptions { option, reason } => write!(f, "invalid {option}: {reason}"),
            Self::WouldBlock { holder } => {
                f.write_str("the key is held")?;
                match holder {
                    Some(h) => write!(f, " by {h}"),
                    None => f.write_str(" (by another waiter of this process)"),
                }
            }
            Self::Timeout {
                waited,
                holder,
                path,
            } => {
                write!(
                    f,
                    "timed out after {waited:?} waiting for `{}`",
                    path.display()
                )?;
                match holder {
                    Some(h) => write!(f, "; held by {h}"),
                    None => f.write_str("; it had no holder (a waiter of this process was ahead)"),
                }
            }
            Self::Expired { token } => write!(
                f,
                "grant {token} has lost the key (its lease lapsed and another process took it \
                 over, or its files were deleted); do not commit its work"
            ),
        }
    }
}

impl std::error::Error for ProcessLockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
