//! The cluster scope (feature `etcd`): the same keyed locks shared by every
//! process, on any machine, that connects to the same etcd v3 cluster
//! ([`ClusterLockTable`]).
//!
//! The shape is the in-process table's: `table.lock(key).await` yields a
//! guard that releases the key on drop; grants carry fencing tokens (the
//! waiter key's create revision, ordered cluster-wide); `try_lock`, owned
//! forms, leases, timeouts and deadlines work as in-process.
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use keylock::{etcd::{ClusterLockTable, ClusterOptions}, LockOptions};
//!
//! let opts = ClusterOptions::new().label("invoice-worker");
//! let table = ClusterLockTable::connect_with(["http://127.0.0.1:2379"], opts).await?;
//! let guard = table
//!     .lock_with("invoice-17", LockOptions::new().timeout(Duration::from_secs(5)))
//!     .await?;
//! guard.check()?; // judged now against the session's lease, no round trip
//! // Fence the write at the store: applied only while the grant holds the key.
//! let txn = etcd_client::Txn::new()
//!     .when([guard.fence().compare()])
//!     .and_then([etcd_client::TxnOp::put("invoices/17", "paid", None)]);
//! assert!(table.client().clone().txn(txn).await?.succeeded());
//! drop(guard);
//! # Ok(()) }
//! ```
//!
//! # The recipe
//!
//! One etcd lease per table (the *session*), kept alive by a task; a waiter
//! key per session under the key's prefix,
//! `<prefix>/<encoded key>/<lease id>`; FIFO by create revision; the
//! enqueue reads the queue's head in the same transaction (an uncontended
//! lock is one round trip); a waiter opens a watch of the deletions under
//! the prefix from now (a current watch, woken as each deletion commits),
//! then reads the keys ahead of it once, and holds the key when all of them
//! are gone. Not etcd's own lock API, and no polling. See
//! `recipe.rs` and docs/ARCHITECTURE.md ("Cluster scope").
//!
//! # Shared and exclusive
//!
//! [`LockOptions::shared`](crate::LockOptions::shared) takes a key as a
//! reader: readers hold it together, a writer (a plain `lock`) alone, FIFO
//! across modes, so a writer waiting behind readers blocks the readers that
//! come after it. A reader's waiter key is `<prefix>/<encoded key>/r-<lease
//! id>-<n>` (one per grant: a table may have several readers of a key at
//! once); a reader waits only for the writers' keys older than its own, a
//! writer for every older key. A reader's fence says that it still reads.
//!
//! # Two tiers
//!
//! Callers of one table queue on an in-process
//! [`LockTable`](crate::LockTable) first (in their mode), so at most one
//! writer of them has a waiter key in etcd per key: a hot key costs etcd
//! one writer per process. Readers of one table share the in-process grant
//! and each enqueue in etcd.
//!
//! # Fencing
//!
//! [`ClusterGuard::check`] is judged locally against the lease that carries
//! the grant: the session knows a bound before which etcd cannot have
//! expired its lease (the send time of the last answered keep-alive plus
//! the TTL), so `check()` needs no round trip and fails at once when
//! keep-alives stop being answered past that bound. At the store,
//! [`ClusterGuard::fence`] gives the compare (`create_revision(waiter key)
//! == token`) to put in your own etcd transactions: etcd itself then
//! refuses a holder that lost the key, whatever its clock says.
//!
//! # Faults
//!
//! - A holder that dies (SIGKILL, a crash, a lost machine) frees its keys
//!   when its session's lease expires: at most the session TTL after its
//!   last keep-alive ([`ClusterOptions::session_ttl`]).
//! - A session whose keep-alives fail past its bound is lost: its guards'
//!   `check()` fails and its waits end with
//!   [`ClusterLockError::SessionLost`]; the table starts a new session for
//!   the next lock.
//! - A lost session stops renewing its lease and revokes it as soon as
//!   etcd answers: after a whole-cluster outage every key comes back within
//!   the session TTL + the request timeout of the cluster's return.
//! - A waiter whose session's lease is revoked (or expires) while it waits
//!   is never granted the key: its wait ends with `SessionLost` and the
//!   waiters behind it go ahead.
//! - A member that dies, or a leader change: every call is retried; a
//!   refused connection is safe to send again, a timeout or a leader
//!   change is ambiguous, and every call is written so that sending it
//!   again is the re-read (see `retry.rs`). Watches and keep-alive streams
//!   are re-established on another member.
//!
//! # Runtime
//!
//! The etcd client needs tokio: create the table inside a tokio runtime. Its
//! calls then run as tasks on that runtime, so the futures of the table may
//! be awaited from any executor (or a plain thread, with
//! [`ClusterLockTable::blocking_lock`]) while the runtime runs. Dropping a
//! guard spawns its release there and never blocks.

mod client;
mod error;
mod guard;
mod key;
mod lost;
mod recipe;
mod retry;
mod session;
#[cfg(test)]
mod sim;
mod table;

/// The monotonic clock of the cluster scope: tokio's, which is the
/// system's monotonic clock unless tokio's time is paused (the crate's
/// simulation runs on paused time).
pub(crate) fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

pub use error::{ClusterHolder, ClusterLockError};
pub use guard::{ClusterGuard, Fence, OwnedClusterGuard};
pub use lost::{ClusterKeepAlive, ClusterLost};
pub use table::{
    ClusterLock, ClusterLockTable, ClusterOptions, ClusterStats, OwnedClusterLock,
    MAX_REQUEST_TIMEOUT, MAX_SESSION_TTL,
};
