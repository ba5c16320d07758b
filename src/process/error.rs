//! Errors of the process scope, each naming the key (the file only as a
//! detail), or the path or option at fault, and the holder.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use super::holder::ProcessHolder;
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
        /// Who holds it, as its stamp says (`None` if no grant could be
        /// read: see `by`).
        holder: Option<Box<ProcessHolder>>,
        /// Who kept the key: this process, another process, or a kernel
        /// lock on the key's file without a grant.
        by: HeldBy,
        /// The key, quoted as in `Timeout`'s `key`.
        key: Box<str>,
    },
    /// The wait ran out.
    Timeout {
        /// How long the caller waited.
        waited: Duration,
        /// Who held the key when the caller gave up: pid, whether it holds
        /// its kernel lock (is alive), its token, how long it had held the
        /// key, its label. `None` if no grant could be read (see `by`).
        holder: Option<Box<ProcessHolder>>,
        /// Who kept the key when the caller gave up.
        by: HeldBy,
        /// The key waited for: its bytes as a quoted string when they are
        /// UTF-8 (`"k"`), else escaped (`b"\xff"`).
        key: Box<str>,
        /// The key's state file.
        path: PathBuf,
    },
    /// A key's state file was shortened (truncated) by something other than
    /// keylock while in use. The key's state is lost: a grant of it has
    /// lost its authority (do not commit), and the key is refused until the
    /// file is removed (the key then starts afresh, its fencing tokens
    /// included). The process is not harmed: the file's memory is not
    /// touched once its size is found wrong.
    Damaged {
        /// The state file (its message names the key whose file it is).
        path: PathBuf,
        /// Its length when it was found damaged, in bytes.
        len: u64,
    },
    /// The grant lost its authority: its lease lapsed and another process
    /// took the key over, or its state file was removed or replaced (alone
    /// or with its directory: the key's path names another file now, which
    /// others may lock). Do not commit.
    Expired {
        /// The token of the grant that lost the key.
        token: FencingToken,
        /// The key, quoted as in `Timeout`'s `key`.
        key: Box<str>,
    },
}

/// Who kept a key from a caller: in [`ProcessLockError::WouldBlock`] and
/// [`ProcessLockError::Timeout`].
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-heldby-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// use keylock::{process::HeldBy, ProcessLockError, ProcessLockTable};
/// let table = ProcessLockTable::open(&dir)?;
/// let guard = table.try_lock("k")?;
/// let err = table.try_lock("k").unwrap_err();
/// assert!(matches!(err, ProcessLockError::WouldBlock { by: HeldBy::ThisProcess, .. }));
/// # drop(guard);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), ProcessLockError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeldBy {
    /// This process: a grant of this process holds the key (a guard of this
    /// table or of another), or a caller of this process is ahead of this
    /// one in the process's queue for the key (a grant it waits for, if
    /// any, is in `holder`, whoever made it).
    ThisProcess,
    /// Another process: the key's grant names it (its pid is in `holder`);
    /// also a grant whose stamp was not written yet (a few microseconds
    /// after it is made; `holder` says pid 0), whoever made it.
    AnotherProcess,
    /// No grant holds the key, but the kernel lock the next grant needs is
    /// taken by another open file of the key's state file: a waiter (of
    /// this process or another) that the kernel just handed it, about to
    /// take the key, or a program that locks the file outside keylock
    /// (respected for 100 ms, after which the key is taken on another
    /// kernel lock: see docs/ARCHITECTURE.md, "Dead holders and stuck
    /// holders").
    KernelLock,
    /// No grant holds the key, but a waiting process has the next turn (it
    /// holds the key's claim: see docs/ARCHITECTURE.md, "Order across
    /// processes"), and callers of other processes let it go first.
    Claimed,
    /// The grant that kept the key ended while the answer was made: the key
    /// may be free now.
    Ended,
    /// The key's state file could not be read to say who (the error that
    /// says why was set aside for the one being answered).
    Unknown,
}

impl fmt::Display for HeldBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ThisProcess => "this process",
            Self::AnotherProcess => "another process",
            Self::KernelLock => {
                "a kernel lock of another open file of the key's state file, with no grant \
                 (a waiter about to take the key, or a program locking the file outside keylock)"
            }
            Self::Claimed => {
                "a waiting process that has the next turn (its claim), with no grant yet"
            }
            Self::Ended => "a grant that ended as this answer was made (the key may be free now)",
            Self::Unknown => "a holder that could not be read from the key's state file",
        })
    }
}

/// The key a path is the state file of (`<stem>.state`, the stem a key's
/// encoding), quoted, if it is one: named when the error is displayed.
fn key_of(path: &std::path::Path) -> Option<Box<str>> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".state")?;
    super::key::decode(stem)?;
    Some(super::key::name(stem))
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
            Self::Io { op, path, source } => match key_of(path) {
                Some(key) => write!(
                    f,
                    "cannot {op} for key {key} (file `{}`): {source}",
                    path.display()
                ),
                None => write!(f, "cannot {op} `{}`: {source}", path.display()),
            },
            Self::Key {
                key_len,
                encoded_len,
                max,
            } => write!(
                f,
                "a key of {key_len} bytes encodes to a file name of {encoded_len} bytes, over \
                 the limit of {max}; use a shorter key (or a digest of it)"
            ),
            Self::Corrupt { path } => match key_of(path) {
                Some(key) => write!(
                    f,
                    "the file of key {key} (`{}`) is not a keylock state file (or is of a \
                     newer format); left untouched",
                    path.display()
                ),
                None => write!(
                    f,
                    "`{}` is not a keylock state file (or is of a newer format); left untouched",
                    path.display()
                ),
            },
            Self::InvalidOptions { option, reason } => write!(f, "invalid {option}: {reason}"),
            Self::WouldBlock { holder, by, key } => {
                write!(f, "key {key} is held by {by}")?;
                match holder {
                    Some(h) => write!(f, ": {h}"),
                    None => Ok(()),
                }
            }
            Self::Timeout {
                waited,
                holder,
                by,
                key,
                path,
            } => {
                write!(
                    f,
                    "timed out after {waited:?} waiting for key {key} (state file `{}`); held by \
                     {by}",
                    path.display()
                )?;
                match holder {
                    Some(h) => write!(f, ": {h}"),
                    None => Ok(()),
                }
            }
            Self::Damaged { path, len } => match key_of(path) {
                Some(key) => write!(
                    f,
                    "the state file of key {key} was truncated to {len} bytes while in use \
                     (keylock never shortens it): the key's state is lost and no grant of it is \
                     valid; remove the file to start the key afresh (its fencing tokens restart) \
                     (file `{}`)",
                    path.display()
                ),
                None => write!(
                    f,
                    "`{}` was truncated to {len} bytes while in use (keylock never shortens it); \
                     remove it to start the directory afresh",
                    path.display()
                ),
            },
            Self::Expired { token, key } => write!(
                f,
                "grant {token} has lost key {key} (its lease lapsed and another process took \
                 it over, or its file was removed or replaced); do not commit its work"
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
