//! An async, runtime-agnostic table of exclusive locks keyed by any
//! `K: Eq + Hash`.
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
//! # Runtimes
//!
//! Waits are plain futures woken through their [`Waker`](std::task::Waker).
//! The table never calls into a runtime, so one table serves tokio,
//! async-std, smol, `futures::executor` and plain threads
//! ([`LockTable::blocking_lock`]) at the same time.
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
//! For tests, the `test-util` feature adds `ManualClock`, which moves only
//! when told to:
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
//! can refuse a late writer. To keep that working across a restart, build the
//! new table with a [`Builder::token_floor`] at least every token the old one
//! handed out.
//!
//! # Leases
//!
//! A grant may carry a lease ([`LockOptions::lease`], or the table's
//! default): its authority ends at the deadline unless renewed
//! ([`Guard::renew`]), judged at the moment it is asked ([`Guard::check`]).
//! An operator can take a key away ([`LockTable::revoke`]) or one named
//! grant ([`LockTable::revoke_grant`]). To learn of the loss as it happens,
//! await [`Guard::lost`] beside the work; to keep a lease alive while the
//! work runs, run [`Guard::keep_alive`], which also resolves at once on a
//! loss.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod acquire;
mod blocking;
mod clock;
mod deferred;
mod error;
mod fairness;
mod guard;
mod keep_alive;
mod key_map;
mod key_slot;
mod lease;
mod loom;
mod lost;
mod queue;
mod shard_lock;
mod stats;
mod table;
mod time_source;
mod timer;
mod timer_driver;
mod token;
mod waiter;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use clock::ManualClock;
pub use error::{LockError, TryLockError};
pub use fairness::Fairness;
pub use guard::{Guard, OwnedGuard};
pub use lease::{LockOptions, DEFAULT_MAX_LEASE};
pub use stats::Stats;
pub use table::{Builder, DefaultHashBuilder, LockTable};
pub use time_source::TimeSource;
pub use token::FencingToken;

/// The named futures returned by the table.
pub mod futures {
    pub use crate::acquire::{Lock, LockOwned, LockOwnedWith, LockWith};
    pub use crate::keep_alive::KeepAlive;
    pub use crate::lost::Lost;
}
