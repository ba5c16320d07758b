//! Retries of etcd calls: which failures are safe to retry, which are
//! ambiguous, and the backoff between attempts.
//!
//! - **Refused** (the member is down: connection refused or reset, no
//!   route): the request never reached etcd, so it is safe to send again
//!   (to another member; the client's balancer may pick the dead one again,
//!   hence the retries).
//! - **Ambiguous** (a timeout, a leader change, a stream cut mid-call): the
//!   request may or may not have been applied. Every call the table makes is
//!   written so that sending it again *is* the re-read: the waiter key is
//!   named by the lease (a put-if-absent that finds it returns its
//!   revision), deletes compare the create revision, reads change nothing.
//! - **Fatal** (bad arguments, permissions, a lease that no longer exists):
//!   returned at once.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::error::ClusterLockError;

/// How a failed call may be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Never reached etcd: send again.
    Refused,
    /// May have been applied: send again, as a re-read.
    Ambiguous,
    /// Retrying does not help.
    Fatal,
}

/// Classifies a client error.
pub(crate) fn classify(err: &etcd_client::Error) -> Failure {
    use etcd_client::Error as E;
    match err {
        E::TransportError(_) | E::IoError(_) => Failure::Refused,
        E::GRpcStatus(status) => {
            use tonic_code::*;
            let msg = status.message().to_ascii_lowercase();
            match status.code() as i32 {
                UNAVAILABLE
                    if msg.contains("refused")
                        || msg.contains("connect")
                        || msg.contains("dns")
                        || msg.contains("transport") =>
                {
                    Failure::Refused
                }
                UNAVAILABLE | DEADLINE_EXCEEDED | CANCELLED | UNKNOWN | ABORTED | INTERNAL => {
                    Failure::Ambiguous
                }
                _ => Failure::Fatal,
            }
        }
        E::WatchError(_) | E::LeaseKeepAliveError(_) | E::Internal(_) => Failure::Ambiguous,
        _ => Failure::Fatal,
    }
}

/// Whether etcd refused a call because the lease it names does not exist
/// (revoked, or expired): a put with the lease, a keep-alive of it.
pub(crate) fn lease_not_found(err: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    match err {
        E::GRpcStatus(status) => status.message().contains("lease not found"),
        E::LeaseKeepAliveError(m) => m.contains("not found"),
        _ => false,
    }
}

/// gRPC status codes (as numbers, so that the crate needs no direct tonic
/// dependency).
mod tonic_code {
    pub(super) const CANCELLED: i32 = 1;
    pub(super) const UNKNOWN: i32 = 2;
    pub(super) const DEADLINE_EXCEEDED: i32 = 4;
    pub(super) const ABORTED: i32 = 10;
    pub(super) const INTERNAL: i32 = 13;
    pub(super) const UNAVAILABLE: i32 = 14;
}

/// Counts of retried calls, for [`ClusterStats`](super::ClusterStats), and
/// the state of the backoff jitter of the calls they count.
#[derive(Debug)]
pub(crate) struct RetryCounts {
    pub(crate) refused: AtomicU64,
    pub(crate) ambiguous: AtomicU64,
    /// A xorshift state (never 0).
    jitter: AtomicU64,
}

impl Default for RetryCounts {
    /// Jitter seeded from the clock and the process id.
    fn default() -> Self {
        let seed = u64::from(Instant::now().elapsed().subsec_nanos())
            ^ (u64::from(std::process::id()) << 32);
        Self::seeded(seed)
    }
}

impl RetryCounts {
    /// Jitter seeded with `seed`: the same seed, the same pauses (the
    /// crate's simulation replays a run from its seed).
    pub(crate) fn seeded(seed: u64) -> Self {
        Self {
            refused: AtomicU64::new(0),
            ambiguous: AtomicU64::new(0),
            jitter: AtomicU64::new(seed | 0x9E37_79B9_7F4A_7C15),
        }
    }

    /// A pause in `[0, max)`: a small xorshift.
    fn jitter(&self, max: Duration) -> Duration {
        let mut x = self.jitter.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.jitter.store(x, Ordering::Relaxed);
        let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1);
        Duration::from_nanos(x % nanos)
    }
}

/// Runs `call` until it succeeds, fails fatally
/// ([`ClusterLockError::Etcd`]), or `deadline` passes
/// ([`ClusterLockError::Unavailable`], with the last failure). A refused
/// call is sent again at once the first time, then with jittered backoff
/// from 5 ms up to 250 ms; an ambiguous one with the same backoff.
pub(crate) async fn retry<T, F, Fut>(
    op: &'static str,
    counts: &RetryCounts,
    deadline: Option<Instant>,
    mut call: F,
) -> Result<T, ClusterLockError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let began = super::now();
    let mut backoff = Duration::from_millis(5);
    let mut attempt = 0u32;
    loop {
        let err = match call().await {
            Ok(v) => return Ok(v),
            Err(err) => err,
        };
        let kind = classify(&err);
        match kind {
            Failure::Fatal => return Err(ClusterLockError::etcd(op, err)),
            Failure::Refused => counts.refused.fetch_add(1, Ordering::Relaxed),
            Failure::Ambiguous => counts.ambiguous.fetch_add(1, Ordering::Relaxed),
        };
        attempt += 1;
        let pause = if kind == Failure::Refused && attempt == 1 {
            Duration::ZERO
        } else {
            let p = backoff / 2 + counts.jitter(backoff / 2);
            backoff = (backoff * 2).min(Duration::from_millis(250));
            p
        };
        let now = super::now();
        if deadline.is_some_and(|d| now + pause >= d) {
            return Err(ClusterLockError::Unavailable {
                op,
                waited: now - began,
                source: err,
            });
        }
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let refused = etcd_client::Error::IoError(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        assert_eq!(classify(&refused), Failure::Refused);
        let args = etcd_client::Error::InvalidArgs("x".into());
        assert_eq!(classify(&args), Failure::Fatal);
        let watch = etcd_client::Error::WatchError("cut".into());
        assert_eq!(classify(&watch), Failure::Ambiguous);
        assert!(!lease_not_found(&watch));
        let gone = etcd_client::Error::LeaseKeepAliveError("lease not found".into());
        assert!(lease_not_found(&gone));
    }
}
