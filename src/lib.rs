//! An async, runtime-agnostic table of locks keyed by any `K: Eq + Hash`,
//! exclusive or shared.
//!
//! `table.lock(key).await` resolves when `key` is free and yields a guard;
//! dropping the guard releases the key and hands it, in arrival order, to the
//! next waiter. Use it where a lock per record, row, path or tenant is wanted
//! over millions of distinct keys, a few of them hot, without keeping a mutex
//! alive for every key ever seen: a key that is neither held nor awaited takes
//! no memory.
//!
//! ```
//! # futures::executor::block_on(async {
//! use keylock::LockTable;
//!
//! let table = LockTable::new();
//! let guard = table.lock("invoice-17").await;
//! // ... the invoice is ours until the guard drops ...
//! assert!(table.try_lock("invoice-17").is_err());
//! drop(guard);
//! assert!(table.is_empty());
//! # });
//! ```
//!
//! # Features
//!
//! None is on by default; without any, a table runs its leases and timeouts
//! on the monotonic clock with the crate's own timer, under any runtime or
//! none.
//!
//! - `tokio`: `Builder::tokio_time`, a table on tokio's clock and timer
//!   that spends tokio's cooperative budget (see [Time](#time)).
//! - `test-util`: `ManualClock` and `Builder::clock`, time moved by hand for
//!   deterministic tests (see [Time](#time)).
//! - `etcd`: the cluster scope, module `etcd` (`ClusterLockTable`): the same
//!   locks across machines on an etcd v3 cluster. Needs a tokio runtime,
//!   and `protoc` to build.
//!
//! # Scopes
//!
//! The same shape at three scopes: this in-process [`LockTable`]; the
//! processes of one host (`ProcessLockTable`, Linux); the machines of a
//! cluster (`ClusterLockTable` on etcd, feature `etcd`). At the wider
//! scopes a process's callers queue on an in-process table first, so each
//! process sends at most one waiter per key to the slower tier. Generic
//! code is written once for all of them with [`ScopedLockTable`] and
//! [`ScopedGuard`].
//!
//! # Runtimes
//!
//! Waits are plain futures woken through their [`Waker`](std::task::Waker).
//! The table never calls into a runtime, so one table serves tokio,
//! async-std, smol, `futures::executor` and plain threads
//! ([`LockTable::blocking_lock`]) at the same time.
//!
//! `blocking_lock` parks its thread until the key comes. On a runtime's
//! worker thread that blocks the worker and every task queued on it, and if
//! the holder is one of them the thread waits for ever: call it on plain
//! threads, or off the runtime (`tokio::task::spawn_blocking`,
//! `smol::unblock`), and use [`LockTable::lock`] in async code.
//!
//! # Fairness
//!
//! Strict FIFO per key by default ([`Fairness::Strict`]). A release hands the
//! key directly to the oldest waiter and wakes exactly that waiter, once;
//! until it runs the key is its, and neither newcomers nor
//! [`LockTable::try_lock`] can take it. The woken waiter learns of its grant
//! without taking any lock.
//!
//! For throughput on hot keys, a table built with [`Fairness::Eventual`] lets
//! a caller that is already running take a just-released key instead of
//! waiting for the parked oldest waiter, and forces a direct handoff once a
//! shard has gone [`Fairness::EVENTUAL_BOUND`] (500 µs) without one, so every
//! waiter is served.
//!
//! # Shared and exclusive
//!
//! A plain `lock` is exclusive. [`LockTable::lock_shared`] (or
//! [`LockOptions::shared`] with any entry point) takes a key in
//! [`Mode::Shared`]: shared grants of a key are held together, an exclusive
//! one alone. The queue stays FIFO across modes: a waiting writer blocks the
//! readers that come after it, so writers are never starved, and the readers
//! queued together at its head are granted together when it leaves. A
//! reader can [`upgrade`](Guard::upgrade) to exclusive (it waits only for
//! the other readers, ahead of everyone queued; a second reader upgrading at
//! the same time is refused at once, as it would deadlock) and a writer can
//! [`downgrade`](Guard::downgrade). Every grant, shared too, has its own
//! fencing token, and an exclusive grant's token exceeds every earlier
//! grant's of the key.
//!
//! ```
//! # futures::executor::block_on(async {
//! use keylock::{LockTable, Mode};
//!
//! let table = LockTable::new();
//! let mut reader = table.lock_shared("account-9").await;
//! let other = table.lock_shared("account-9").await; // readers together
//! assert!(table.try_lock("account-9").is_err()); // a writer waits
//! drop(other);
//! let token = reader.upgrade().await?; // the last reader: exclusive now
//! assert_eq!(reader.mode(), Mode::Exclusive);
//! assert_eq!(reader.check()?, token); // a new token, above every reader's
//! # Ok::<(), keylock::LockError>(())
//! # }).unwrap();
//! ```
//!
//! # Futures
//!
//! The lock futures ([`futures`]) are `!Unpin`: a waiting future carries its
//! own queue node, so waiting allocates nothing. `.await` them as usual; to
//! poll one by hand, pin it (`std::pin::pin!` or `Box::pin`).
//!
//! # Cancel safety
//!
//! Every future may be dropped at any await point, from any thread. A waiter
//! owns exactly one wake slot and no callback: dropping it removes the slot,
//! and a waiter dropped after being handed the key passes the key on. An
//! aborted task, a dropped runtime or a panicking thread leaves nothing
//! behind.
//!
//! # Time
//!
//! Leases and timeouts are judged on the table's clock. By default that is
//! the monotonic clock ([`Instant`](std::time::Instant)), served by the
//! crate's own timer thread under any runtime or none: each shard keeps one
//! timer for the earliest deadline of its waiters, so a lock with a lease or
//! a timeout costs about what a plain one does. With the `tokio` feature,
//! [`Builder::tokio_time`] makes a table follow tokio's clock and timer (so
//! `#[tokio::test(start_paused = true)]` drives its leases) and take part in
//! tokio's cooperative budget; [`Builder::time_source`] takes any
//! [`TimeSource`].
//!
//! For tests, the `test-util` feature adds `ManualClock`, given to a table
//! with `Builder::clock`: it moves only when the test calls `advance`, which
//! wakes the waiters whose deadline it passed, so leases and timeouts are
//! tested without sleeping or racing. (Under tokio, a `tokio_time()` table
//! with paused time is the other way.)
//!
//! ```
//! # #[cfg(feature = "test-util")]
//! # {
//! use std::time::Duration;
//! use keylock::{LockOptions, LockTable, ManualClock};
//!
//! let clock = ManualClock::new();
//! let table = LockTable::builder().clock(clock.clone()).build();
//! let guard = table
//!     .try_lock_with("job-9", LockOptions::new().lease(Duration::from_secs(30)))
//!     .unwrap();
//! clock.advance(Duration::from_secs(30));
//! assert!(guard.check().is_err(), "the lease lapsed: the guard is fenced");
//! assert!(table.try_lock("job-9").is_ok(), "and the key is free again");
//! # }
//! ```
//!
//! # Fencing
//!
//! Every grant carries a [`FencingToken`], unique across the table and
//! strictly increasing per key; hand it to the storage you protect so that it
//! can refuse a late writer (any token not above the last one it accepted).
//! To keep that working across a restart, build the new table with a
//! [`Builder::token_floor`] at least every token the old one handed out: a
//! new table mints its tokens afresh, above its floor.
//!
//! # Leases
//!
//! A grant may carry a lease ([`LockOptions::lease`], or the table's
//! [`Builder::default_lease`]): its authority ends at the deadline unless
//! renewed ([`Guard::renew`]). Once it lapses, the key passes to the next
//! waiter without the holder doing anything, and the holder's late release
//! frees nothing. A lease is judged at the moment it is asked: call
//! [`Guard::check`] at commit time and write with the token it returns.
//! To learn of the loss as it happens, await [`Guard::lost`] beside the
//! work; to keep a lease alive while the work runs, run
//! [`Guard::keep_alive`], which also resolves at once on a loss.
//!
//! # Timeouts
//!
//! [`LockOptions::timeout`] bounds a wait (zero: do not wait). When it runs
//! out, [`LockError::Timeout`] says what the caller waited on: the token of
//! the key's holder at that moment, which names exactly one grant of the
//! table; that grant's label, if it has one ([`LockOptions::label`]); how
//! long that holder had held the key, when known (its grant has a lease);
//! how many waiters were still ahead; and, on a table built with
//! [`Builder::name_keys`], the key (as every other error of such a table
//! does).
//!
//! ```
//! # futures::executor::block_on(async {
//! use std::time::Duration;
//! use keylock::{LockError, LockOptions, LockTable};
//!
//! let table = LockTable::builder().name_keys().build();
//! let holder = table.try_lock_with("report", LockOptions::new().label("nightly"))?;
//! let wait = LockOptions::new().timeout(Duration::from_millis(10));
//! let err = table.lock_with("report", wait).await.unwrap_err();
//! // "timed out after 10.1ms waiting for key "report"; held by grant #4 of
//! // this table ("nightly"), 0 waiter(s) ahead"
//! assert!(err.to_string().contains(r#"waiting for key "report""#));
//! let LockError::Timeout { holder: Some(token), holder_label, ahead, .. } = err else {
//!     unreachable!()
//! };
//! assert_eq!((token, holder_label), (holder.token(), Some("nightly")));
//! assert_eq!(ahead, 0);
//! # Ok::<(), LockError>(())
//! # }).unwrap();
//! ```
//!
//! # Revocation
//!
//! An operator can take a stuck key away: [`LockTable::revoke`] forces out
//! whoever holds it now, [`LockTable::revoke_grant`] only the grant a token
//! names (a timeout's diagnosis, a monitor's report), never a successor.
//! Either way the key passes to the next waiter and the revoked guard is
//! fenced at once: its `check()` fails, its `lost()` resolves, and dropping
//! it frees nothing.
//!
//! # Several keys
//!
//! To hold several keys at once, lock them in one global order: sort them,
//! remove duplicates, and lock in that order; two tasks that take the same
//! keys in different orders can each hold one and wait for the other for
//! ever. Plain locks are not re-entrant: locking a key its caller already
//! holds waits on itself (with a timeout, it fails naming the caller's own
//! grant), so keep one guard per key and pass it along, or let a
//! transaction do all of that (below).
//!
//! # Transactions
//!
//! A [`Transaction`] (or [`OwnedTransaction`], `'static`, for tasks that
//! hold it across awaits and spawns) takes many keys for one owner, as a
//! database's lock manager does for a transaction:
//!
//! - **Re-entrant.** Locking a key it holds in the same or a weaker
//!   [`Mode`] is counted and returns at once with the same token; asking a
//!   held shared key exclusive upgrades it. [`Transaction::unlock`] takes
//!   one count back (the key goes at zero), [`Transaction::release`] lets
//!   it go.
//! - **All or nothing.** [`Transaction::lock_all`] takes a set of keys,
//!   each in its mode, duplicates merged (the stronger mode wins), in a
//!   canonical order (the keys' `Ord`, the order plain guards are sorted in
//!   by hand; it must agree with `Eq`, as for any sorted collection), so
//!   that multi-key lockers cannot deadlock each other, nor with code that
//!   sorts its guards; if one key fails, or the
//!   future is dropped, it holds nothing it took and undoes its upgrades.
//! - **One deadline, one lease.** [`TransactionOptions`] bound every lock of
//!   the transaction by one deadline and give all its grants one lease;
//!   [`Transaction::renew`] renews them all, or none if one was lost,
//!   naming it.
//! - **Wait policies.** [`WaitPolicy::Block`] (the default),
//!   [`WaitPolicy::NoWait`] (fail at once, naming the key and its holder),
//!   [`WaitPolicy::SkipLocked`] (a `lock_all` takes the free keys and
//!   lists what it took and skipped): PostgreSQL's `FOR UPDATE`, `NOWAIT`
//!   and `SKIP LOCKED`; [`Transaction::lock_up_to`] takes the first `n`
//!   free candidates in the caller's order, as a queue consumer's
//!   `LIMIT n FOR UPDATE SKIP LOCKED` does; [`Transaction::keys`] lists
//!   what a transaction holds.
//! - **Released at the end.** [`Transaction::commit`] checks that every
//!   grant still holds its key and releases them all;
//!   [`abort`](Transaction::abort) and drop release them all, from any
//!   thread, even while a lock future of an owned transaction is pending
//!   elsewhere (it then fails with [`TransactionError::Ended`]). A call
//!   keeps nothing once its transaction ended, even if its future was
//!   forgotten (`mem::forget`) rather than dropped: the end takes its
//!   waiter out of the queue, or passes on a grant it was handed and never
//!   saw, undoes its upgrade, and releases the keys a `lock_all` had taken
//!   for it. A borrowed transaction's next call that waits for a new key
//!   does the same for a forgotten call's wait at once; the keys a
//!   forgotten first `lock_all` had got (before its wait, and through its
//!   earlier waits) stay the transaction's (counted by
//!   [`Transaction::len`], re-entered by a retry) until it ends.
//!
//! Errors name the key ([`TransactionError`]), so the lock methods ask
//! `K: Clone` (a key is cloned when it goes to the table, never for a
//! re-entry), and `lock_all` asks `K: Ord` (its canonical order is the
//! keys' order).
//!
//! ```
//! # futures::executor::block_on(async {
//! use std::time::Duration;
//! use keylock::{LockTable, Mode, TransactionOptions};
//!
//! let table = LockTable::new();
//! let opts = TransactionOptions::new().timeout(Duration::from_secs(1));
//! let mut transfer = table.transaction_with(opts);
//! // A self-transfer names the account twice: merged, no deadlock.
//! transfer
//!     .lock_all([("acct-1", Mode::Exclusive), ("acct-1", Mode::Exclusive), ("audit", Mode::Shared)])
//!     .await?;
//! transfer.lock("acct-1", Mode::Shared).await?; // re-entrant
//! assert_eq!(transfer.count("acct-1"), 2);
//! transfer.commit()?; // every grant still held: the work may be made durable
//! assert!(table.is_empty());
//! # Ok::<(), keylock::TransactionError<&str>>(())
//! # }).unwrap();
//! ```
//!
//! # Retrying
//!
//! A transaction's wait that closes a cycle of transactions waiting on each
//! other is answered at once, as it begins, with
//! [`TransactionError::Deadlock`] naming the cycle; a *soft* cycle, one
//! that a reader queued behind a writer on a key its holders would let it
//! read closes, is broken instead by granting that reader ahead of the
//! queue, as PostgreSQL's detector does ([`Deadlock`] has the rule), and
//! nobody is aborted.
//!
//! A transaction answered as a deadlock's victim
//! ([`TransactionError::Deadlock`]), or refused an upgrade because another
//! shared holder of the key was already upgrading (the two-way deadlock
//! the table refuses before it forms), should abort and run again:
//! [`TransactionError::is_retryable`] says so for both (PostgreSQL's
//! SQLSTATE class 40). [`LockTable::run_transaction`] does it in one call:
//! it runs an async closure in a fresh transaction, commits it, and runs
//! it again after a bounded, jittered backoff ([`RetryPolicy`]) while an
//! attempt failed retryably, returning the closure's value.
//! [`LockTable::run_transaction_owned`] is the same for an
//! [`OwnedTransaction`]. The closure's error type is its own (anything
//! `From<TransactionError<K>>`); for borrowed keys, [`TransactionFailure`]
//! is a key-free form that `?` converts into, and that converts on into
//! `anyhow::Error` or `Box<dyn Error + Send + Sync>`.
//!
//! ```
//! # futures::executor::block_on(async {
//! use keylock::{LockTable, Mode, TransactionFailure};
//!
//! let accounts = [String::from("acct-1"), String::from("acct-2")];
//! let table = LockTable::new(); // after the keys it borrows
//! let total = table
//!     .run_transaction(async |txn| {
//!         let mut total = 0;
//!         for acct in &accounts {
//!             txn.lock(acct.as_str(), Mode::Shared).await?;
//!             total += acct.len();
//!         }
//!         Ok::<_, TransactionFailure>(total)
//!     })
//!     .await?; // a victim was retried; anything else is returned
//! assert_eq!(total, 12);
//! assert!(table.is_empty()); // committed
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! # }).unwrap();
//! ```
//!
// The link to a feature-gated method; to its type when the feature is off,
// so that `cargo doc` without features has no broken link.
#![cfg_attr(
    feature = "tokio",
    doc = "[`Builder::tokio_time`]: Builder::tokio_time"
)]
#![cfg_attr(not(feature = "tokio"), doc = "[`Builder::tokio_time`]: Builder")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod error;
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub mod etcd;
mod keys;
mod loss;
#[cfg(target_os = "linux")]
#[cfg_attr(docsrs, doc(cfg(target_os = "linux")))]
pub mod process;
mod scope;
mod support;
mod table;
mod time;
mod transactions;

pub use error::{LockError, TryLockError};
#[cfg(feature = "etcd")]
pub use etcd::{ClusterGuard, ClusterLockError, ClusterLockTable, OwnedClusterGuard};
#[cfg(target_os = "linux")]
pub use process::{
    OwnedProcessGuard, ProcessGuard, ProcessHolder, ProcessLockError, ProcessLockTable,
};
pub use scope::{
    Blocker, ScopedError, ScopedErrorKind, ScopedGuard, ScopedHolder, ScopedLockTable,
};
pub use support::fairness::Fairness;
pub use support::lease::{LockOptions, DEFAULT_MAX_LEASE};
pub use support::mode::Mode;
pub use support::stats::Stats;
pub use support::token::FencingToken;
pub use table::guard::{Guard, OwnedGuard};
pub use table::status::{HolderStatus, LockStatus, WaiterStatus};
pub use table::{Builder, DefaultHashBuilder, LockTable};
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use time::clock::ManualClock;
pub use time::time_source::TimeSource;
pub use transactions::deadlock::{CycleWait, Deadlock, DeadlockStats, TransactionId};
pub use transactions::hold::Hold;
/// Measuring sticks for the benchmarks (`probes` feature): not part of the
/// API.
#[cfg(feature = "probes")]
#[doc(hidden)]
pub use transactions::probe::{Bare as ProbeBare, BareOne as ProbeBareOne};
pub use transactions::{
    AcquireKind, Acquired, LockedSet, OwnedTransaction, RetryPolicy, Transaction, TransactionError,
    TransactionFailure, TransactionOptions, WaitPolicy,
};

/// The bytes kept for reuse by transactions' contended waits: in the
/// shared stock and by the calling thread (not other threads' own).
///
/// A transaction's call that must wait boxes its state in a block taken
/// from a small process-wide stock and gives the block back when the wait
/// ends, instead of allocating and freeing it each time (a wait usually
/// ends on another worker thread than the one it began on, and the system
/// allocator serializes that pattern on a lock). The shared stock keeps at
/// most 64 blocks of each of three sizes (256, 512 and 1,024 bytes), made
/// only as waits need them: at most 114,688 bytes; each thread keeps up to
/// 16 of each size of its own before it (28,672 bytes). This counts the
/// shared stock's and the calling thread's. Tests that count allocations
/// subtract what the stock gained while they ran.
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub fn recycled_bytes() -> usize {
    support::recycle::kept_bytes()
}

/// The named futures returned by the table.
pub mod futures {
    pub use crate::loss::keep_alive::KeepAlive;
    pub use crate::loss::lost::Lost;
    pub use crate::table::acquire::{Lock, LockOwned, LockOwnedWith, LockWith};
    pub use crate::table::upgrade::Upgrade;
}

pub mod guide {
    //! The guide: one page per concept, each with examples that run as tests.
    //!
    //! The same pages are in the repository's `docs/` folder.
    //!
    //! - [`entry_points`]: every way to take a key, and what a guard offers.
    //! - [`leases`]: leases, fencing tokens and revocation.
    //! - [`timeouts`]: bounded waits, and what a timeout says it waited on.
    //! - [`cancellation`]: dropping any future at any point.
    //! - [`runtimes`]: one table under every runtime; tokio's clock; `blocking_lock`.
    //! - [`modes`]: shared and exclusive grants, upgrades, fairness.
    //! - [`transactions`]: many keys for one owner, `SKIP LOCKED`, retries.
    //! - [`deadlocks`]: cycles answered at once, holds, the status view.
    //! - [`testing`]: deterministic tests with `ManualClock`.
    //! - [`migrating`]: from `DashMap<K, Arc<Mutex<()>>>`, `lockable`, tokio's `Mutex`.
    //! - [`process`]: the same locks across the processes of a host.
    //! - [`cluster`]: the same locks across machines, on etcd.
    //! - [`scopes`]: generic code for every scope.

    #[doc = include_str!("../docs/entry-points.md")]
    pub mod entry_points {}
    #[doc = include_str!("../docs/leases.md")]
    pub mod leases {}
    #[doc = include_str!("../docs/timeouts.md")]
    pub mod timeouts {}
    #[doc = include_str!("../docs/cancellation.md")]
    pub mod cancellation {}
    #[doc = include_str!("../docs/runtimes.md")]
    pub mod runtimes {}
    #[doc = include_str!("../docs/modes.md")]
    pub mod modes {}
    #[doc = include_str!("../docs/transactions.md")]
    pub mod transactions {}
    #[doc = include_str!("../docs/deadlocks.md")]
    pub mod deadlocks {}
    #[doc = include_str!("../docs/testing.md")]
    pub mod testing {}
    #[doc = include_str!("../docs/migrating.md")]
    pub mod migrating {}
    #[doc = include_str!("../docs/process.md")]
    pub mod process {}
    #[doc = include_str!("../docs/cluster.md")]
    pub mod cluster {}
    #[doc = include_str!("../docs/scopes.md")]
    pub mod scopes {}
}
