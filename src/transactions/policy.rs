//! What a transaction asks of every lock it takes: how to wait
//! ([`WaitPolicy`]), until when (one deadline) and for how long its grants
//! last (one lease) — [`TransactionOptions`], turned into the
//! [`LockOptions`] of each lock.

use crate::transactions::deadlock::TransactionId;
use std::time::{Duration, Instant};

use crate::support::lease::LockOptions;
use crate::support::mode::Mode;
use crate::time::clock::Clock;

/// What a lock of a transaction does when its key is held by someone else:
/// the three answers PostgreSQL gives (`FOR UPDATE`, `FOR UPDATE NOWAIT`,
/// `FOR UPDATE SKIP LOCKED`).
///
/// ```
/// use keylock::{Mode, TransactionError, TransactionOptions, WaitPolicy};
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let other = table.try_lock("row-1").unwrap();
/// let mut txn = table.transaction_with(TransactionOptions::new().wait(WaitPolicy::NoWait));
/// let err = txn.lock("row-1", Mode::Exclusive).await.unwrap_err();
/// assert!(matches!(err, TransactionError::Busy { key: "row-1", holder: Some(t), .. } if t == other.token()));
/// # });
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitPolicy {
    /// Wait for the key, at most until the transaction's deadline (if it has
    /// one). The default.
    #[default]
    Block,
    /// Do not wait: a key that cannot be had at once fails the call with
    /// [`TransactionError::Busy`](crate::TransactionError::Busy), naming the
    /// key and its holder's token.
    NoWait,
    /// Do not wait, and take what can be had: a multi-key call
    /// ([`Transaction::lock_all`](crate::Transaction::lock_all)) takes the free
    /// keys and reports the others as skipped. A single-key lock has nothing
    /// to take instead and fails as under [`NoWait`](Self::NoWait).
    SkipLocked,
}

impl WaitPolicy {
    /// Whether a lock under this policy waits.
    #[inline]
    #[must_use]
    pub const fn waits(self) -> bool {
        matches!(self, Self::Block)
    }
}

/// The options of a whole transaction: one deadline for every lock it
/// takes, one lease for all its grants, and its default [`WaitPolicy`].
///
/// ```
/// use std::time::Duration;
/// use keylock::{TransactionOptions, WaitPolicy};
/// let opts = TransactionOptions::new()
///     .timeout(Duration::from_secs(2)) // every lock gives up 2 s after the transaction starts
///     .lease(Duration::from_secs(30))
///     .wait(WaitPolicy::Block);
/// assert_eq!(opts.lease_duration(), Some(Duration::from_secs(30)));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransactionOptions {
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    lease: Option<Duration>,
    wait: WaitPolicy,
    label: Option<&'static str>,
}

impl TransactionOptions {
    /// No deadline, no lease of its own (the table's default lease, if any,
    /// applies), [`WaitPolicy::Block`].
    #[must_use]
    pub const fn new() -> Self {
        Self {
            deadline: None,
            timeout: None,
            lease: None,
            wait: WaitPolicy::Block,
            label: None,
        }
    }

    /// A name for the transaction, shown beside its grants and waits in the
    /// table's status view ([`LockTable::status`](crate::LockTable::status)),
    /// for diagnosis: what the transaction is for (`"checkout"`, a job's
    /// name). Costs nothing unless set.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockTable, Mode, TransactionOptions};
    /// let table = LockTable::new();
    /// let mut txn = table.transaction_with(TransactionOptions::new().label("nightly-audit"));
    /// txn.lock("ledger", Mode::Shared).await?;
    /// assert_eq!(table.holder("ledger").unwrap().label, Some("nightly-audit"));
    /// # Ok::<(), keylock::TransactionError<&str>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub const fn label(mut self, label: &'static str) -> Self {
        self.label = Some(label);
        self
    }

    /// The label asked for, if any.
    #[must_use]
    pub const fn label_name(&self) -> Option<&'static str> {
        self.label
    }

    /// Every lock of the transaction waits at most until `deadline`, an
    /// instant on the table's clock (see [`LockOptions::deadline`]). With a
    /// [`timeout`](Self::timeout) too, the earlier wins.
    #[must_use]
    pub const fn deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Every lock of the transaction waits at most until `timeout` after the
    /// transaction was created (read on the table's clock then): a deadline
    /// for the whole transaction, not a budget per lock.
    #[must_use]
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Every grant the transaction takes carries this lease (instead of the
    /// table's default); [`Transaction::renew`](crate::Transaction::renew)
    /// renews them all with it.
    #[must_use]
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How the transaction's locks wait unless a call says otherwise.
    #[must_use]
    pub const fn wait(mut self, policy: WaitPolicy) -> Self {
        self.wait = policy;
        self
    }

    /// The deadline asked for, if any.
    #[must_use]
    pub const fn deadline_instant(&self) -> Option<Instant> {
        self.deadline
    }

    /// The timeout asked for, if any.
    #[must_use]
    pub const fn timeout_duration(&self) -> Option<Duration> {
        self.timeout
    }

    /// The lease asked for, if any.
    #[must_use]
    pub const fn lease_duration(&self) -> Option<Duration> {
        self.lease
    }

    /// The default wait policy.
    #[must_use]
    pub const fn wait_policy(&self) -> WaitPolicy {
        self.wait
    }

    /// Fixes the deadline when the transaction starts: the earlier of the
    /// deadline and now plus the timeout (a timeout past what an `Instant`
    /// can hold bounds nothing).
    #[inline]
    pub(crate) fn resolve(self, clock: &Clock) -> (Resolved, WaitPolicy) {
        let from_timeout = self
            .timeout
            .and_then(|timeout| clock.now().checked_add(timeout));
        let deadline = match (self.deadline, from_timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let resolved = Resolved {
            deadline,
            lease: self.lease,
            id: TransactionId::next(),
        };
        (resolved, self.wait)
    }
}

/// A transaction's options with its deadline fixed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resolved {
    pub(crate) deadline: Option<Instant>,
    pub(crate) lease: Option<Duration>,
    /// The transaction's identity, which its grants and waiters carry.
    pub(crate) id: TransactionId,
}

impl Resolved {
    /// The options of one lock in `mode` under `policy`: the transaction's
    /// lease, and its deadline (blocking) or a zero timeout (not waiting,
    /// which makes the table answer at once and name the holder).
    pub(crate) fn lock_options(&self, mode: Mode, policy: WaitPolicy) -> LockOptions {
        let mut opts = LockOptions::new().mode(mode).for_owner(self.id.get());
        if let Some(lease) = self.lease {
            opts = opts.lease(lease);
        }
        if !policy.waits() {
            opts = opts.timeout(Duration::ZERO);
        } else if let Some(deadline) = self.deadline {
            opts = opts.deadline(deadline);
        }
        opts
    }
}
