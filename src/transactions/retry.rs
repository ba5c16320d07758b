//! Retrying a transaction in one call: [`LockTable::run_transaction`] (and
//! its owned form) runs a closure in a fresh transaction, commits it if
//! the closure succeeds, and runs it again, after a bounded, jittered
//! backoff, if the attempt failed in a way a retry may not
//! ([`TransactionError::is_retryable`]: a deadlock's victim, an upgrade
//! conflict).
//!
//! Whether an attempt is retried is known from its transaction, not from
//! the closure's error: the transaction notes a retryable failure of any
//! of its calls (`Owner::retryable`), so a closure may convert errors into
//! its own type (`anyhow::Error`, a [`TransactionFailure`], an enum of its
//! own) and still be retried. The backoff sleeps on the table's clock
//! (`crate::time::timer::Sleep`): no runtime is asked for.

use std::future::poll_fn;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::time::Duration;

use crate::table::LockTable;
use crate::time::timer::Sleep;
use crate::transactions::error::TransactionError;
use crate::transactions::policy::TransactionOptions;
use crate::transactions::{OwnedTransaction, Transaction};

#[cfg(doc)]
use crate::transactions::error::TransactionFailure;

/// How [`LockTable::run_transaction_with`] retries: at most `attempts`
/// runs in all; before the n-th retry, a pause drawn at random between
/// half and all of `first · 2^(n-1)`, capped at `max` (jitter, so that
/// the transactions of a broken cycle do not collide again in step).
///
/// The default: 10 attempts, backoff from 1 ms up to 100 ms.
///
/// ```
/// use std::time::Duration;
/// let retry = keylock::RetryPolicy::new()
///     .attempts(5)
///     .backoff(Duration::from_millis(2), Duration::from_millis(50));
/// assert_eq!(retry.max_attempts(), 5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    attempts: u32,
    first: Duration,
    max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryPolicy {
    /// 10 attempts, backoff from 1 ms up to 100 ms.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            attempts: 10,
            first: Duration::from_millis(1),
            max: Duration::from_millis(100),
        }
    }

    /// At most `attempts` runs of the closure in all (at least 1: 0 counts
    /// as 1, a run without retries).
    #[must_use]
    pub const fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// The backoff before the first retry is drawn from up to `first`,
    /// doubling each retry, never above `max`. `Duration::ZERO` retries at
    /// once.
    #[must_use]
    pub const fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first = first;
        self.max = max;
        self
    }

    /// The most runs of the closure.
    #[must_use]
    pub const fn max_attempts(&self) -> u32 {
        self.attempts
    }

    /// The pause before retry `retry` (1 for the first), for transaction
    /// `id`: uniform over `[b/2, b]`, `b = min(max, first · 2^(retry-1))`.
    fn pause(&self, id: u64, retry: u32) -> Duration {
        let doubled = self
            .first
            .checked_mul(
                1u32.checked_shl(retry.saturating_sub(1))
                    .unwrap_or(u32::MAX),
            )
            .unwrap_or(self.max);
        let bound = doubled.min(self.max);
        let nanos = u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX);
        if nanos == 0 {
            return Duration::ZERO;
        }
        // Per-process random seed (foldhash's), mixed with the
        // transaction and the attempt: transactions of one cycle differ.
        let draw = foldhash::fast::RandomState::default().hash_one((id, retry));
        Duration::from_nanos(nanos / 2 + draw % (nanos - nanos / 2 + 1))
    }
}

/// What one attempt came to.
enum Attempt<T, E> {
    Done(Result<T, E>),
    Retry(E),
}

impl<K: Eq + Hash, S: BuildHasher> LockTable<K, S> {
    /// Runs `f` in a fresh [`Transaction`] and commits it, retrying as
    /// [`RetryPolicy::new`] says (10 attempts, 1 to 100 ms jittered
    /// backoff) while an attempt fails retryably: one of its calls was
    /// answered as a deadlock's victim or with an upgrade conflict
    /// ([`TransactionError::is_retryable`]), whatever error `f` then
    /// returned. Returns `f`'s value once an attempt commits.
    ///
    /// `f`'s error type `E` is the caller's: it takes the transaction's
    /// errors by `From` (so `?` works inside `f`), for instance
    /// [`TransactionError<K>`] itself, [`TransactionFailure`] (key-free:
    /// for borrowed keys, then `?` into `anyhow::Error`), or
    /// `anyhow::Error` for `'static` keys. An attempt whose `f` fails
    /// otherwise is not retried: its error is returned. Once the attempts
    /// are used up, the last attempt's error is returned.
    ///
    /// Each attempt is a new transaction (a new id; a timeout of the
    /// options counts from its start), and ends before the next begins;
    /// the backoff sleeps on the table's clock.
    ///
    /// # Errors
    ///
    /// `f`'s error, or the commit's ([`TransactionError::Expired`], a grant
    /// lost its key: not retried, the work was not protected).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropped, the pending attempt's transaction is dropped
    /// (everything it holds released), as `f`'s future is.
    ///
    /// ```
    /// use keylock::{LockTable, Mode, TransactionFailure};
    /// # futures::executor::block_on(async {
    /// let (from, to) = (String::from("acct-1"), String::from("acct-2"));
    /// let table = LockTable::new(); // after the keys it borrows
    /// // Borrowed keys, an error type free of them: `?` all the way.
    /// let moved = table
    ///     .run_transaction(async |txn| {
    ///         txn.lock(from.as_str(), Mode::Exclusive).await?;
    ///         txn.lock(to.as_str(), Mode::Exclusive).await?;
    ///         Ok::<_, TransactionFailure>(100)
    ///     })
    ///     .await?;
    /// assert_eq!(moved, 100);
    /// assert!(table.is_empty()); // committed
    /// # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_transaction<'t, T, E, F>(&'t self, f: F) -> Result<T, E>
    where
        F: for<'a> AsyncFnMut(&'a mut Transaction<'t, K, S>) -> Result<T, E>,
        E: From<TransactionError<K>>,
        K: Clone,
    {
        self.run_transaction_with(TransactionOptions::new(), RetryPolicy::new(), f)
            .await
    }

    /// As [`run_transaction`](Self::run_transaction), each attempt with
    /// `opts` and retried as `retry` says.
    ///
    /// # Errors
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// # Cancel safety
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// ```
    /// use keylock::{LockTable, Mode, RetryPolicy, TransactionError, TransactionOptions};
    /// # futures::executor::block_on(async {
    /// let table = LockTable::<u64>::new();
    /// let got = table
    ///     .run_transaction_with(TransactionOptions::new(), RetryPolicy::new().attempts(3), async |txn| {
    ///         txn.lock_all([(1, Mode::Exclusive), (2, Mode::Shared)]).await?;
    ///         Ok::<_, TransactionError<u64>>(txn.len())
    ///     })
    ///     .await?;
    /// assert_eq!(got, 2);
    /// # Ok::<(), TransactionError<u64>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_transaction_with<'t, T, E, F>(
        &'t self,
        opts: TransactionOptions,
        retry: RetryPolicy,
        mut f: F,
    ) -> Result<T, E>
    where
        F: for<'a> AsyncFnMut(&'a mut Transaction<'t, K, S>) -> Result<T, E>,
        E: From<TransactionError<K>>,
        K: Clone,
    {
        let mut attempt = 1;
        loop {
            let mut txn = self.transaction_with(opts);
            let id = txn.id().get();
            let out = f(&mut txn).await;
            let done = match out {
                Ok(value) => Attempt::Done(txn.commit().map(|()| value).map_err(E::from)),
                Err(error) if txn.owner.failed_retryably() => {
                    drop(txn);
                    Attempt::Retry(error)
                }
                Err(error) => Attempt::Done(Err(error)),
            };
            match done {
                Attempt::Done(out) => return out,
                Attempt::Retry(error) if attempt >= retry.attempts => return Err(error),
                Attempt::Retry(error) => {
                    drop(error);
                    self.back_off(retry.pause(id, attempt)).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Sleeps `pause` on the table's clock.
    async fn back_off(&self, pause: Duration) {
        if pause.is_zero() {
            return;
        }
        let Some(at) = self.clock().now().checked_add(pause) else {
            return;
        };
        let mut sleep = Sleep::new(self.clock(), at);
        poll_fn(|cx| sleep.poll(cx)).await;
    }

    /// As [`run_transaction`](Self::run_transaction), in a fresh
    /// [`OwnedTransaction`] each attempt (`f` gets it by reference; its
    /// calls are `'static` futures, which `f` may run on other tasks).
    ///
    /// # Errors
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// # Cancel safety
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keylock::{LockTable, Mode, TransactionError};
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(LockTable::<u64>::new());
    /// let n = table
    ///     .clone()
    ///     .run_transaction_owned(async |txn| {
    ///         txn.lock(7, Mode::Exclusive).await?;
    ///         Ok::<_, TransactionError<u64>>(txn.len())
    ///     })
    ///     .await?;
    /// assert_eq!(n, 1);
    /// assert!(table.is_empty());
    /// # Ok::<(), TransactionError<u64>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_transaction_owned<T, E, F>(self: Arc<Self>, f: F) -> Result<T, E>
    where
        F: for<'a> AsyncFnMut(&'a OwnedTransaction<K, S>) -> Result<T, E>,
        E: From<TransactionError<K>>,
        K: Clone + 'static,
        S: 'static,
    {
        self.run_transaction_owned_with(TransactionOptions::new(), RetryPolicy::new(), f)
            .await
    }

    /// As [`run_transaction_owned`](Self::run_transaction_owned), each
    /// attempt with `opts` and retried as `retry` says.
    ///
    /// # Errors
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// # Cancel safety
    ///
    /// As [`run_transaction`](Self::run_transaction).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use keylock::{LockTable, Mode, RetryPolicy, TransactionError, TransactionOptions};
    /// # futures::executor::block_on(async {
    /// let table = Arc::new(LockTable::<u64>::new());
    /// let opts = TransactionOptions::new().timeout(Duration::from_secs(5));
    /// table
    ///     .run_transaction_owned_with(opts, RetryPolicy::new(), async |txn| {
    ///         txn.lock(1, Mode::Shared).await.map(drop)
    ///     })
    ///     .await?;
    /// # Ok::<(), TransactionError<u64>>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_transaction_owned_with<T, E, F>(
        self: Arc<Self>,
        opts: TransactionOptions,
        retry: RetryPolicy,
        mut f: F,
    ) -> Result<T, E>
    where
        F: for<'a> AsyncFnMut(&'a OwnedTransaction<K, S>) -> Result<T, E>,
        E: From<TransactionError<K>>,
        K: Clone + 'static,
        S: 'static,
    {
        let mut attempt = 1;
        loop {
            let txn = Arc::clone(&self).transaction_owned_with(opts);
            let id = txn.id().get();
            let out = f(&txn).await;
            let done = match out {
                Ok(value) => Attempt::Done(txn.commit().map(|()| value).map_err(E::from)),
                Err(error) if txn.owner().failed_retryably() => {
                    drop(txn);
                    Attempt::Retry(error)
                }
                Err(error) => Attempt::Done(Err(error)),
            };
            match done {
                Attempt::Done(out) => return out,
                Attempt::Retry(error) if attempt >= retry.attempts => return Err(error),
                Attempt::Retry(error) => {
                    drop(error);
                    self.back_off(retry.pause(id, attempt)).await;
                    attempt += 1;
                }
            }
        }
    }
}
