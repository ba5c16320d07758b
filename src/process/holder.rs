//! The public view of a key's holder at process scope ([`ProcessHolder`]),
//! read from the holder's stamp (`stamp.rs`, [`Stamp::holder`]) and named
//! by the errors of a lock that could not be taken.
//!
//! [`Stamp::holder`]: super::stamp::Stamp::holder

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::FencingToken;

/// Who holds a key, as its owner stamp says, judged at the moment of the
/// read ([`ProcessLockTable::holder`](super::ProcessLockTable::holder), and
/// in [`ProcessLockError::Timeout`](super::ProcessLockError::Timeout) and
/// [`ProcessLockError::WouldBlock`](super::ProcessLockError::WouldBlock)).
///
/// `alive` is the kernel's answer, not a guess from the pid: the holder is
/// alive while it still holds its kernel lock, which the kernel frees the
/// moment the process dies, whatever it died of. A pid may be reused; a
/// kernel lock is not inherited by the pid's next owner.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("keylock-doc-holder-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let table = keylock::ProcessLockTable::open(&dir)?.with_label("nightly-report");
/// let guard = table.try_lock("report")?;
/// let holder = table.holder(&"report")?.expect("held");
/// assert_eq!(holder.pid, std::process::id());
/// assert!(holder.alive);
/// assert_eq!(holder.token, guard.token());
/// assert_eq!(holder.label.as_deref(), Some("nightly-report"));
/// assert!(holder.to_string().contains("nightly-report"));
/// # drop(guard);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), keylock::ProcessLockError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessHolder {
    /// The holder's process id; 0 (and no host, label or lease) for a
    /// grant whose stamp was never written: its holder died, or stopped,
    /// in the microseconds between taking the key and writing its stamp.
    pub pid: u32,
    /// Whether the holder still holds its kernel lock. `false`: it died (or
    /// its files were replaced); the next locker takes the key at once.
    pub alive: bool,
    /// The holder's fencing token.
    pub token: FencingToken,
    /// How long it has held the key.
    pub held_for: Duration,
    /// The time left on its lease: `None` without a lease, zero once it
    /// lapsed (the next waiter takes the key over).
    pub lease_left: Option<Duration>,
    /// When it was granted the key, on the wall clock.
    pub granted_at: SystemTime,
    /// The host it runs on.
    pub hostname: String,
    /// The label of its table, if it set one
    /// ([`ProcessLockTable::with_label`](super::ProcessLockTable::with_label)).
    pub label: Option<String>,
}

impl fmt::Display for ProcessHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if !self.hostname.is_empty() {
            write!(f, " on {}", self.hostname)?;
        }
        if let Some(label) = &self.label {
            write!(f, " ({label:?})")?;
        }
        f.write_str(if self.alive {
            ", alive"
        } else {
            ", dead (its kernel lock is free)"
        })?;
        write!(f, ", token {}, held for {:?}", self.token, self.held_for)?;
        match self.lease_left {
            None => f.write_str(", no lease"),
            Some(left) if left.is_zero() => f.write_str(", lease lapsed"),
            Some(left) => write!(f, ", lease ends in {left:?}"),
        }
    }
}
