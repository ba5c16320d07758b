//! Errors of the cluster scope, each naming the holder, the lease or the
//! etcd call at fault.

use std::fmt;
use std::time::Duration;

use crate::FencingToken;

/// Who holds a key of a [`ClusterLockTable`](super::ClusterLockTable), as
/// its waiter key in etcd says.
///
/// ```
/// # let holder: Option<keylock::etcd::ClusterHolder> = None;
/// if let Some(h) = holder {
///     println!("held by lease {:x} (pid {:?} on {:?}) for {:?}", h.lease_id, h.pid, h.host, h.held_for);
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterHolder {
    /// The etcd lease the holder's waiter key is attached to: its session's
    /// (or its grant's own, for a grant with a lease). The key is freed when
    /// this lease ends.
    pub lease_id: i64,
    /// The holder's fencing token: its waiter key's create revision.
    pub token: FencingToken,
    /// How long the holder has held the key, by the wall clock of the
    /// holder's host when it took it and the caller's now. A holder that
    /// waited restamps its key right after the grant; until then this
    /// counts from its enqueue. `None` if the waiter key does not say.
    pub held_for: Option<Duration>,
    /// The holder's process id, if it said.
    pub pid: Option<u32>,
    /// The holder's host name, if it said.
    pub host: Option<String>,
    /// The holder's table label ([`ClusterOptions::label`](super::ClusterOptions::label)).
    pub label: Option<String>,
}

impl fmt::Display for ClusterHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lease {:x} (token {}", self.lease_id, self.token)?;
        if let Some(pid) = self.pid {
            write!(f, ", pid {pid}")?;
        }
        if let Some(host) = &self.host {
            write!(f, " on {host}")?;
        }
        if let Some(label) = &self.label {
            write!(f, ", label {label:?}")?;
        }
        match self.held_for {
            Some(d) => write!(f, ", held for {d:?})"),
            None => f.write_str(")"),
        }
    }
}

/// Why a cluster-scope lock, check or renewal failed.
///
/// ```
/// let err = keylock::etcd::ClusterLockError::NoRuntime;
/// assert!(err.to_string().contains("tokio"));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterLockError {
    /// The table was not created inside a tokio runtime (its etcd client
    /// needs one).
    NoRuntime,
    /// An etcd call failed in a way that retrying does not cure (bad
    /// endpoints, permissions, ...). Nothing is held.
    Etcd {
        /// What was being done ("connect", "enqueue the waiter key", ...).
        op: &'static str,
        /// The client's answer.
        source: etcd_client::Error,
    },
    /// etcd did not answer a call (every member it tried refused the
    /// connection or timed out, or the cluster had no leader) for as long
    /// as the call could wait: the caller's deadline, or without one the
    /// session's TTL (or the request timeout, if longer). Nothing is held.
    Unavailable {
        /// What was being done ("grant the session lease", ...).
        op: &'static str,
        /// How long it was tried.
        waited: Duration,
        /// The last failure.
        source: etcd_client::Error,
    },
    /// An option was out of range or unsupported; nothing was taken.
    InvalidOptions {
        /// The option at fault.
        option: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// The key is held (or another waiter is ahead) and the caller would not
    /// wait.
    WouldBlock {
        /// Who holds it, as its waiter key says; `None` when the one ahead
        /// is a caller of this process (queued on the in-process tier).
        holder: Option<Box<ClusterHolder>>,
        /// The key, quoted as in `Timeout`'s `key`.
        key: Box<str>,
    },
    /// The wait ran out.
    Timeout {
        /// How long the caller waited.
        waited: Duration,
        /// Who held the key when the caller gave up (its lease id, token,
        /// and how long it had held it); `None` if the one ahead was a
        /// caller of this process, or the key had no holder yet.
        holder: Option<Box<ClusterHolder>>,
        /// How many waiter keys of other processes were ahead in etcd.
        ahead: usize,
        /// The key waited for: its bytes as a quoted string when they are
        /// UTF-8 (`"k"`), else escaped (`b"\xff"`).
        key: Box<str>,
    },
    /// The session's lease could not be kept alive (or was revoked): every
    /// guard of the session is fenced, and waits of the session end.
    SessionLost {
        /// The session's lease.
        lease_id: i64,
        /// What happened.
        reason: String,
    },
    /// The caller's waiter key was deleted while it waited, by another etcd
    /// client (its lease still lives): the key was not taken, and the
    /// waiters behind it go ahead. Nothing is held.
    WaiterKeyDeleted {
        /// The waiter key that was deleted.
        key: String,
    },
    /// The grant lost its authority: its lease ended (the session's
    /// keep-alive failed, or the grant's own lease lapsed). Do not commit.
    Expired {
        /// The token of the grant that lost the key.
        token: FencingToken,
        /// The key, quoted as in `Timeout`'s `key`.
        key: Box<str>,
    },
}

impl ClusterLockError {
    pub(crate) fn etcd(op: &'static str, source: etcd_client::Error) -> Self {
        Self::Etcd { op, source }
    }
}

impl fmt::Display for ClusterLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoRuntime => f.write_str(
                "no tokio runtime: create a ClusterLockTable inside one (its etcd client needs it)",
            ),
            Self::Etcd { op, source } => write!(f, "etcd: cannot {op}: {source}"),
            Self::Unavailable { op, waited, source } => write!(
                f,
                "etcd unavailable: could not {op} in {waited:?} of trying (no member answered, \
                 or no leader): {source}"
            ),
            Self::InvalidOptions { option, reason } => write!(f, "invalid {option}: {reason}"),
            Self::WouldBlock { holder, key } => {
                write!(f, "key {key} is held")?;
                match holder {
                    Some(h) => write!(f, " by {h}"),
                    None => f.write_str(" (by a caller of this process, or one is ahead)"),
                }
            }
            Self::Timeout {
                waited,
                holder,
                ahead,
                key,
            } => {
                write!(f, "timed out after {waited:?} waiting for key {key}")?;
                match holder {
                    Some(h) => write!(f, "; held by {h}")?,
                    None => {
                        f.write_str("; no holder in etcd (a caller of this process was ahead)")?
                    }
                }
                write!(f, "; {ahead} waiter(s) of other processes ahead")
            }
            Self::SessionLost { lease_id, reason } => write!(
                f,
                "the session's lease {lease_id:x} was lost ({reason}); its grants are fenced"
            ),
            Self::WaiterKeyDeleted { key } => write!(
                f,
                "the waiter key {key} was deleted by another etcd client while it waited \
                 (its lease lives); the key was not taken"
            ),
            Self::Expired { token, key } => write!(
                f,
                "grant {token} has lost key {key} (its lease ended); do not commit its work"
            ),
        }
    }
}

impl std::error::Error for ClusterLockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Etcd { source, .. } | Self::Unavailable { source, .. } => Some(source),
            _ => None,
        }
    }
}
