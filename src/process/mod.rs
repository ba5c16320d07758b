//! The process scope: the same keyed locks shared by every process of one
//! host that opens the same directory ([`ProcessLockTable`]).
//!
//! Use it where several processes (workers, a CLI beside a server, cron
//! jobs beside a daemon) touch the same records or files. The shape is the
//! in-process table's: `table.lock(key).await` yields a guard that releases
//! the key on drop; grants carry fencing tokens and optional leases;
//! `try_lock`, `blocking_lock`, owned forms, timeouts and deadlines work as
//! in-process.
//!
//! ```
//! # let dir = std::env::temp_dir().join(format!("keylock-doc-mod-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! # futures::executor::block_on(async {
//! use std::time::Duration;
//! use keylock::{LockOptions, ProcessLockTable};
//!
//! let table = ProcessLockTable::open(&dir)?.with_label("invoice-worker");
//! let opts = LockOptions::new()
//!     .lease(Duration::from_secs(30)) // a stuck holder loses the key
//!     .timeout(Duration::from_secs(5)); // and a waiter gives up, naming it
//! let guard = table.lock_with("invoice-17", opts).await?;
//! let token = guard.check()?; // hand it to the store: it refuses older ones
//! # let _ = token;
//! drop(guard);
//! # Ok::<(), keylock::ProcessLockError>(())
//! # }).unwrap();
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```
//!
//! # How a dead holder and a stuck holder both lose the key
//!
//! Each key has a state file, mapped into the memory of every process that
//! uses the key: a *state word* naming the current grant (its token and
//! the *slot* its holder locks), owner stamps and release cells (see
//! `acquire.rs` for the details and docs/ARCHITECTURE.md, "Process
//! scope"). A grant is a compare-and-swap of the state word, made while
//! holding the slot's kernel lock (`flock` of the file for slot 0, an open
//! file description byte-range lock for the others), which the holder
//! keeps for as long as it holds the key:
//!
//! - **A dead holder** loses its kernel lock when it dies, however it dies
//!   (SIGKILL, a crash, a lost container): the kernel frees it and wakes
//!   the next waiter, which finds the word's slot free and takes the key
//!   over. No pid is ever checked (pids are reused) and no age is ever
//!   judged.
//! - **A live holder past its lease** (stopped, stuck, or just slow) keeps
//!   its kernel lock, so the kernel alone cannot take the key from it. Its
//!   stamp carries the lease deadline on the host's monotonic clock; a
//!   waiter woken at that deadline marks the lease taken and swaps the
//!   state word to a higher token on another slot. The old holder's
//!   `check()` loads the word: it no longer names its grant, so the check
//!   fails, and its release frees nothing of the successor's.
//!
//! # Fencing tokens
//!
//! Per key, tokens strictly increase across all processes and restarts,
//! and across the reclaim of the key's file: each grant swaps the state
//! word from the last token to the next; a new file of a key starts above
//! the directory's *token floor*, which every reclaim first raises to the
//! last token of the file it removes; and a durable *token ceiling* of the
//! directory (written and synced once every 1,024 tokens of its highest
//! key) keeps them increasing across a power loss or reboot too. Tokens of
//! different keys are unrelated (a new key may start high).
//!
//! # Waiting
//!
//! Waiters of one process queue on an in-process
//! [`LockTable`](crate::LockTable) first (FIFO, one wake slot each), so at
//! most one waiter per process and key waits on the key's files. That one is
//! woken by the kernel: a helper thread blocks in the lock call and wakes the
//! future, with no polling; a timer wakes it at the holder's lease deadline
//! and at its own deadline. Across processes the kernel decides who is next
//! (kernel locks are not FIFO), within a bound: a waiter that must wait
//! takes the key's *claim* (if no other waiter has it), and no other
//! process then takes the key before it, but for a grant already being
//! made as it claimed (see docs/ARCHITECTURE.md, "Order across
//! processes"). A timeout names the holder: pid, host, label,
//! whether it is alive (holds its kernel lock), its token and how long it
//! has held the key ([`ProcessHolder`]).
//!
//! # Files
//!
//! The directory holds `keylock.dir` (one page, mapped by every table: a
//! counter of key file opens, the token floor and ceiling), and per key in
//! use one file, `key-<encoded>.state` (28 KiB, allocated when created;
//! creating it syncs nothing, since the directory's ceiling covers its
//! tokens).
//!
//! The files of idle keys are *reclaimed* (removed): a table reclaims the
//! files of the keys it stops caching (below) and, when it goes away, of
//! the keys it caches; [`ProcessLockTable::prune`] reclaims the rest (files
//! left by processes that died, say). So a directory holds about one file
//! per key in use or cached, whatever the number of keys ever locked. A
//! file is reclaimed only when no table of any process has it open: every
//! table holds a shared kernel lock of a *user byte* of each key file it
//! keeps open, and a reclaimer must take that byte exclusively (never
//! waiting) before it removes the file; a table that opens the file just
//! then looks at the path again once it holds its shared lock, and opens
//! the key's new file. So no grant is ever made on a removed file (see
//! docs/ARCHITECTURE.md, "Reclaim").
//!
//! Key files are never truncated or replaced by the table, nor removed
//! while in use. Removing, truncating or replacing them from outside while
//! processes use them loses the key's state, but never makes two holders
//! or crashes a process: before every grant a table makes sure
//! that the key's path still names the file it holds open, and whole (a
//! `stat`), so a file removed or replaced, alone or with the whole
//! directory, is opened afresh (the key starts afresh, its tokens from the
//! directory's floor, which may be below the lost file's),
//! and the holder of the old one sees its `check()` fail
//! ([`ProcessLockError::Expired`]); a file shortened (truncated) is
//! refused ([`ProcessLockError::Damaged`]) before its memory is touched,
//! which would raise `SIGBUS` (a truncation landing between that look and
//! the accesses right after it still would: see docs/ARCHITECTURE.md,
//! "Process scope"). See [`MAX_ENCODED_KEY`] for the key encoding.
//!
//! A table keeps the files of the keys it used last open and mapped, at
//! most [`ProcessStats::MAX_CACHED_KEYS`] of them (a descriptor or two
//! each; one more evicts, and reclaims, the least recently used key's), so
//! that taking a key again opens nothing: an uncontended lock and
//! release is four system calls, the lock and the unlock of slot 0, a
//! `stat` of the key's path before the grant and an `fstat` of the file
//! before the release (see docs/ARCHITECTURE.md, "System calls").
//!
//! # File systems
//!
//! Local file systems: ext4, xfs, btrfs, tmpfs (open file description
//! locks need Linux 3.15 or later; the state is shared through the page
//! cache, `mmap` with `MAP_SHARED`). Not NFS or other network file systems
//! (their byte-range locks are the server's, which does not free the
//! locks of a dead client at once, and the processes are on other hosts,
//! whose monotonic clocks differ): use a cluster lock there.
//!
//! # Platforms
//!
//! Linux. The module is compiled only there (it reads the host's monotonic
//! clock and boot id); other Unixes and Windows have no process scope yet.

mod acquire;
mod cache;
mod dir;
mod error;
mod guard;
mod helper;
mod holder;
mod key;
mod lost;
mod reclaim;
mod shared;
mod stamp;
mod table;
mod unix;

pub use error::{HeldBy, ProcessLockError};
pub use guard::{OwnedProcessGuard, ProcessGuard};
pub use holder::ProcessHolder;
pub use key::MAX_ENCODED_KEY;
pub use lost::{ProcessKeepAlive, ProcessLost};
pub use stamp::MAX_LABEL;
pub use table::{OwnedProcessLock, ProcessLock, ProcessLockTable, ProcessStats};

/// Tests only: makes each helper thread the kernel hands a slot wait
/// `delay` before it records the handing, in this process (zero: no wait).
/// A test of a holder that dies as its slot goes to a forgotten waiter's
/// helper uses it to pin the moment between the two.
#[cfg(feature = "test-util")]
#[doc(hidden)]
pub fn delay_handed_marks_for_tests(delay: std::time::Duration) {
    helper::set_handed_mark_delay(delay);
}
