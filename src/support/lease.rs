//! Per-call options (lease, timeout) and their validation.
//!
//! A lease bounds how long a grant keeps its authority, measured on the
//! table's monotonic clock from the moment the key is granted; a timeout
//! bounds how long a caller waits. Both are checked here before anything is
//! queued.

use std::time::{Duration, Instant};

use crate::error::LockError;
use crate::support::mode::Mode;

/// The longest lease a table accepts unless its builder says otherwise.
pub const DEFAULT_MAX_LEASE: Duration = Duration::from_secs(3600);

/// How to take one lock: in which [`Mode`] (exclusive unless told), with a
/// lease, a timeout or a deadline, any of them or none.
///
/// ```
/// use std::time::Duration;
/// let opts = keylock::LockOptions::new()
///     .lease(Duration::from_secs(30))
///     .timeout(Duration::from_millis(500));
/// assert_eq!(opts.lease_duration(), Some(Duration::from_secs(30)));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockOptions {
    lease: Option<Duration>,
    timeout: Option<Duration>,
    deadline: Option<Instant>,
    mode: Mode,
    /// The transaction the grant is for (0: none); see [`Terms`].
    owner: u64,
    /// The caller's name for the grant, for the status view and timeouts.
    label: Option<&'static str>,
}

impl LockOptions {
    /// Exclusive, no lease (unless the table has a default one) and no
    /// timeout.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            lease: None,
            timeout: None,
            deadline: None,
            mode: Mode::Exclusive,
            owner: 0,
            label: None,
        }
    }

    /// The grant is for the transaction `owner` (0: none): recorded with
    /// the grant and with its waiter, for deadlock detection and the status
    /// view.
    #[must_use]
    pub(crate) const fn for_owner(mut self, owner: u64) -> Self {
        self.owner = owner;
        self
    }

    /// The transaction the grant is for (0: none).
    pub(crate) const fn owner_id(&self) -> u64 {
        self.owner
    }

    /// Names the grant: the status view shows `label` with it
    /// ([`HolderStatus::label`](crate::HolderStatus::label), and a waiter's
    /// [`WaiterStatus::label`](crate::WaiterStatus::label) while it waits),
    /// and a caller that times out waiting behind it reads it in its
    /// [`LockError::Timeout`]. Meant for a fixed set of names (each distinct
    /// label is kept by the table for its life); a lock without one pays
    /// nothing for it. The process and cluster scopes label a table's
    /// grants instead (`ProcessLockTable::with_label`,
    /// `ClusterOptions::label`) and refuse it with `InvalidOptions`.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockError, LockOptions, LockTable};
    /// let table = LockTable::new();
    /// let _flush = table.lock_with("page-4", LockOptions::new().label("flush")).await?;
    /// assert_eq!(table.holder("page-4").unwrap().label, Some("flush"));
    /// let err = table
    ///     .lock_with("page-4", LockOptions::new().timeout(Duration::ZERO))
    ///     .await
    ///     .unwrap_err();
    /// assert!(matches!(err, LockError::Timeout { holder_label: Some("flush"), .. }));
    /// assert!(err.to_string().contains(r#""flush""#), "{err}");
    /// # Ok::<(), keylock::LockError>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub const fn label(mut self, label: &'static str) -> Self {
        self.label = Some(label);
        self
    }

    /// The label given, if any.
    #[must_use]
    pub const fn label_name(&self) -> Option<&'static str> {
        self.label
    }

    /// Take the key in `mode`: [`Mode::Exclusive`] (the default) or
    /// [`Mode::Shared`], held together with other shared grants.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockOptions, LockTable, Mode};
    /// let table = LockTable::new();
    /// let read = LockOptions::new().mode(Mode::Shared);
    /// let a = table.lock_with("page-4", read).await?;
    /// let b = table.lock_with("page-4", read).await?; // held together
    /// assert_eq!((a.mode(), b.mode()), (Mode::Shared, Mode::Shared));
    /// assert!(table.try_lock("page-4").is_err(), "a writer waits for both");
    /// # Ok::<(), keylock::LockError>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub const fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Shorthand for `.mode(Mode::Shared)`.
    #[must_use]
    pub const fn shared(self) -> Self {
        self.mode(Mode::Shared)
    }

    /// The mode asked for.
    #[must_use]
    pub const fn lock_mode(&self) -> Mode {
        self.mode
    }

    /// The grant loses its authority this long after it is made: `check()`
    /// fails from then on and the key passes to the next waiter. Must be
    /// positive and at most the table's `max_lease`.
    #[must_use]
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Give up waiting after this long, with [`LockError::Timeout`]. Zero
    /// means "do not wait"; a timeout too large for the clock to represent
    /// means "wait for ever". `try_lock_with` ignores it.
    #[must_use]
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Give up waiting at this instant, with [`LockError::Timeout`], as a
    /// timeout would: with both, the earlier wins. The instant is on the
    /// table's clock: [`Instant::now`] for the default clock, the manual
    /// clock's `now()` for a `ManualClock`, tokio's (as a std `Instant`)
    /// under `Builder::tokio_time`. A deadline already passed means "do not
    /// wait". `try_lock_with` ignores it. One deadline serves several locks:
    /// each gets what is left of it.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::{Duration, Instant};
    /// let table = keylock::LockTable::new();
    /// let deadline = Instant::now() + Duration::from_secs(5);
    /// let opts = keylock::LockOptions::new().deadline(deadline);
    /// let a = table.lock_with("a", opts).await?;
    /// let b = table.lock_with("b", opts).await?; // the same deadline
    /// # drop((a, b));
    /// # Ok::<(), keylock::LockError>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub const fn deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The deadline asked for, if any.
    #[must_use]
    pub const fn deadline_instant(&self) -> Option<Instant> {
        self.deadline
    }

    /// The lease asked for, if any.
    #[must_use]
    pub const fn lease_duration(&self) -> Option<Duration> {
        self.lease
    }

    /// The timeout asked for, if any.
    #[must_use]
    pub const fn timeout_duration(&self) -> Option<Duration> {
        self.timeout
    }
}

/// The lease limits of a table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeasePolicy {
    pub(crate) default: Option<Duration>,
    /// `default`, packed once (what a plain `lock` carries).
    pub(crate) default_packed: PackedDuration,
    pub(crate) max: Duration,
    /// `max`, packed once: a lease is checked in one word.
    pub(crate) max_packed: PackedDuration,
}

/// The smallest lease accepted.
pub(crate) const MIN_LEASE: Duration = Duration::from_nanos(1);

impl LeasePolicy {
    /// Checks a lease against the table's bounds.
    #[inline]
    pub(crate) fn check(&self, lease: Duration) -> Result<Duration, LockError> {
        if lease < MIN_LEASE || lease > self.max {
            return Err(LockError::InvalidOptions {
                option: "lease",
                value: lease,
                min: MIN_LEASE,
                max: self.max,
            });
        }
        Ok(lease)
    }

    /// [`check`](Self::check), packed: the lease's nanoseconds compared
    /// with the packed bounds, one word each. Packing is exact below 584
    /// years; a lease packed to the saturated value (or to zero, too short)
    /// is judged by `check` itself, so the answer is always `check`'s.
    #[inline]
    pub(crate) fn check_packed(&self, lease: Duration) -> Result<PackedDuration, LockError> {
        let packed = PackedDuration::pack(Some(lease));
        if packed.0 == 0 || packed.0 > self.max_packed.0 || packed.0 >= PackedDuration::HUGE {
            return self
                .check(lease)
                .map(|lease| PackedDuration::pack(Some(lease)));
        }
        Ok(packed)
    }

    /// The lease a call gets, packed: its own, else the table's default;
    /// validated.
    #[inline]
    pub(crate) fn resolve(&self, asked: Option<Duration>) -> Result<PackedDuration, LockError> {
        match asked {
            // The default was validated when the table was built.
            None => Ok(self.default_packed),
            Some(lease) => self.check_packed(lease),
        }
    }
}

/// An optional duration in one word (nanoseconds; `u64::MAX` for none), so
/// that lock futures and waiter nodes stay small. A duration of 584 years or
/// more reads back as `Duration::MAX`: "too long to represent", which the
/// callers treat as for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackedDuration(u64);

/// What a new grant carries besides its mode: its lease, and the
/// transaction it is for (0: none, a plain guard; from
/// [`LABEL_OWNER`](crate::support::token::LABEL_OWNER): a labeled plain guard;
/// [`HOLD_OWNER`](crate::support::token::HOLD_OWNER): a hold).
/// A waiter carries them from its request to its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Terms {
    pub(crate) lease: PackedDuration,
    pub(crate) owner: u64,
}

impl Terms {
    /// A lease, for no transaction.
    #[inline(always)]
    pub(crate) const fn lease(lease: PackedDuration) -> Self {
        Self { lease, owner: 0 }
    }
}

impl PackedDuration {
    pub(crate) const NONE: Self = Self(u64::MAX);

    /// A zero duration, packed.
    pub(crate) const ZERO: Self = Self(0);

    /// The word it is stored as.
    #[inline(always)]
    pub(crate) const fn bits(self) -> u64 {
        self.0
    }

    /// Back from [`bits`](Self::bits).
    #[inline(always)]
    pub(crate) const fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    #[inline]
    pub(crate) fn pack(duration: Option<Duration>) -> Self {
        match duration {
            None => Self::NONE,
            // Word arithmetic, not `as_nanos`'s 128 bits: this runs on every
            // lock with a lease or timeout.
            Some(d) => Self(
                d.as_secs()
                    .checked_mul(1_000_000_000)
                    .and_then(|n| n.checked_add(u64::from(d.subsec_nanos())))
                    .map_or(Self::HUGE, |n| n.min(Self::HUGE)),
            ),
        }
    }

    #[inline(always)]
    pub(crate) fn get(self) -> Option<Duration> {
        if self.0 == u64::MAX {
            return None;
        }
        Some(if self.0 == Self::HUGE {
            Duration::MAX
        } else {
            Duration::from_nanos(self.0)
        })
    }

    pub(crate) const HUGE: u64 = u64::MAX - 1;

    /// The duration in nanoseconds (`u64::MAX - 1`: too long to represent),
    /// or `None`.
    #[inline(always)]
    pub(crate) fn nanos(self) -> Option<u64> {
        (self.0 != u64::MAX).then_some(self.0)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::time::Duration;

    use super::{LeasePolicy, PackedDuration, DEFAULT_MAX_LEASE};

    fn policy(max: Duration) -> LeasePolicy {
        LeasePolicy {
            default: None,
            default_packed: PackedDuration::NONE,
            max,
            max_packed: PackedDuration::pack(Some(max)),
        }
    }

    /// The one-word check answers as the check of durations, at every
    /// edge: too short, the bounds, one past them, and leases too long for
    /// a word, under the default bound and under bounds a word cannot hold.
    #[test]
    fn the_packed_check_answers_as_the_check_of_durations() {
        let nanos = Duration::from_nanos;
        let huge = nanos(PackedDuration::HUGE);
        for max in [
            DEFAULT_MAX_LEASE,
            nanos(1),
            huge - nanos(1),
            huge,
            huge + nanos(1),
            Duration::MAX,
        ] {
            let policy = policy(max);
            for lease in [
                Duration::ZERO,
                nanos(1),
                Duration::from_millis(1),
                max.saturating_sub(nanos(1)),
                max,
                max.saturating_add(nanos(1)),
                huge - nanos(1),
                huge,
                huge + nanos(1),
                Duration::MAX,
            ] {
                let exact = policy.check(lease);
                let packed = policy.check_packed(lease);
                assert_eq!(
                    packed.is_ok(),
                    exact.is_ok(),
                    "max {max:?}, lease {lease:?}"
                );
                match (packed, exact) {
                    (Ok(packed), Ok(exact)) => {
                        assert_eq!(packed, PackedDuration::pack(Some(exact)));
                    }
                    (Err(packed), Err(exact)) => assert_eq!(packed, exact),
                    _ => unreachable!(),
                }
            }
        }
    }
}
