//! The state machine of every key of one shard.
//!
//! A [`ShardState`] lives behind one shard lock. It holds the entry of every
//! key of the shard that is held, awaited, or still pointed at by a fenced
//! guard. Waiters are not stored here: each waiting future links its own
//! [`Waiter`] node into its key's [`WaitList`] (see `waiter.rs`). Nothing here
//! runs user code except `K: Eq` during a probe: wakes and drops are recorded
//! in a [`Ctx`] and done after unlocking.
//!
//! See `docs/ARCHITECTURE.md` for the state machine of one key. In short:
//!
//! - an entry is in the table while its key has a holder, a waiter, or a
//!   fenced guard that still points at the key;
//! - a holder is a grant (token, lease deadline); it belongs to a guard, or to
//!   a waiter whose future has not run yet: the table does not tell them
//!   apart, so a granted waiter is treated exactly like a guard;
//! - a release hands the key to the head waiter at once (FIFO), with a fresh
//!   token, and wakes it once; under eventual fairness it may instead free the
//!   key and nudge the head, letting a running caller take it first (not a
//!   transaction's head, which may never poll: it is granted at once);
//! - a lapse or a revocation fences the holder (guard or granted waiter alike)
//!   and hands the key on; it is noticed whenever the key is next touched (the
//!   head waiter's timer touches it at the deadline).

pub(crate) mod deferred;
pub(crate) mod waiter;

use std::borrow::Borrow;
use std::time::{Duration, Instant};

use crate::support::key_map::{Index, KeyMap};

use crate::keys::deferred::Ctx;
use crate::keys::waiter::{Granted, Waiter, WaiterPtr};
use crate::support::fairness::Fairness;
use crate::support::key_slot::{KeyPool, KeyPtr};
use crate::support::lease::{PackedDuration, Terms};
use crate::support::mode::Mode;
use crate::support::stats::Counters;
use crate::support::token::{FencingToken, TokenCounter};
use crate::time::clock::{Clock, Now, Stamp};
use crate::time::timer_driver::ShardTimer;
use watch::GrantWatchers;

mod edges;
mod entry;
mod handoff;
mod holders;
mod lapse;
mod reorder;
mod status;
mod waiting;
mod watch;

pub(crate) use edges::{Edge, Edges};
use entry::Entry;
use handoff::{grant_times, Keys};
use holders::{Holder, HolderSpares, Holders};
pub(crate) use status::{RawStatus, RawWaiter};
pub(crate) use waiting::Leaving;
pub(crate) use watch::Watch;

/// A grant handed to a caller.
#[derive(Debug)]
pub(crate) struct Grant<K> {
    pub(crate) key: KeyPtr<K>,
    pub(crate) token: FencingToken,
    pub(crate) deadline: Stamp,
    pub(crate) mode: Mode,
}

/// The outcome of a lock attempt that may wait.
#[derive(Debug)]
pub(crate) enum Attempt<K> {
    /// The key was free and is now the caller's.
    Acquired(Grant<K>),
    /// The key is busy; the caller's waiter is linked, and should be woken
    /// by `wake_at` if it is set (the lease deadline of the holder it waits on).
    Queued {
        key: KeyPtr<K>,
        wake_at: Option<Instant>,
        /// With a timeout: when the wait started and when it gives up.
        start: Stamp,
        until: Stamp,
    },
}

/// How long a waiter waits: a timeout from when it starts to wait, a
/// deadline, both (the earlier wins), or neither.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Patience {
    /// The timeout, packed (none: no timeout): in nanoseconds, as the
    /// stamps it is added to.
    pub(crate) timeout: PackedDuration,
    pub(crate) deadline: Stamp,
}

impl Patience {
    /// When a wait starting now starts and gives up (none: never), as
    /// stamps; both none for a wait without either.
    #[inline(always)]
    fn start_and_until(self, now: &mut Now<'_>) -> (Stamp, Stamp) {
        if !self.is_timed() {
            return (Stamp::NONE, Stamp::NONE);
        }
        self.start_and_until_timed(now)
    }

    /// Whether the wait has a timeout or a deadline.
    #[inline(always)]
    fn is_timed(self) -> bool {
        self.timeout != PackedDuration::NONE || self.deadline.is_some()
    }

    #[inline(never)]
    fn start_and_until_timed(self, now: &mut Now<'_>) -> (Stamp, Stamp) {
        let after_timeout = match self.timeout.nanos() {
            Some(nanos) => {
                let start = now.start_for_nanos(nanos);
                (start, start.plus_nanos(nanos))
            }
            None if self.deadline.is_some() => (Stamp::new(Some(now.get())), Stamp::NONE),
            None => return (Stamp::NONE, Stamp::NONE),
        };
        let (start, until) = after_timeout;
        let until = match (until.is_some(), self.deadline.is_some()) {
            (true, true) => until.min(self.deadline),
            (false, _) => self.deadline,
            (true, false) => until,
        };
        (start, until)
    }
}

/// A linked waiter, polled under the lock.
#[derive(Debug)]
pub(crate) enum Polled {
    /// The key is the waiter's (it is unlinked).
    Granted(Granted),
    /// Still waiting; arm a timer for `wake_at` if set.
    Waiting { wake_at: Option<Instant> },
    /// Its waker must be stored, and the caller brought no clone: clone it
    /// (outside the lock) and poll again.
    NeedWaker,
    /// An upgrade whose shared grant (this token) lost the key while it
    /// waited: it must leave the queue.
    Lost(FencingToken),
}

/// Why a wait gave up, described at the moment it did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Diagnosis {
    pub(crate) holder: Option<FencingToken>,
    /// The holder's owner word (0: none), for its label.
    pub(crate) owner: u64,
    pub(crate) held_for: Option<Duration>,
    pub(crate) ahead: usize,
}

/// All keys of one shard. Touched only under the shard lock.
///
/// Laid out in order (`repr(C)`): what every locked section touches (the
/// map's header, the token counter, the fairness deadline) comes first, so
/// that with the lock word in front of it it fills one cache line, and a
/// contended handoff moves one line between cores, not four.
#[repr(C)]
pub(crate) struct ShardState<K> {
    entries: KeyMap<Entry<K>>,
    tokens: TokenCounter,
    /// Under eventual fairness: from when on a release must hand its key to
    /// the head waiter directly (`None`: at the next release).
    fair_at: Option<Instant>,
    keys: KeyPool<K>,
    /// Empty vectors for keys' shared holders beyond the first.
    spares: HolderSpares,
    /// The wakers of whoever watches this shard's grants end (empty unless
    /// a layer watches one: the loss layer's `Lost`).
    watchers: GrantWatchers,
}

// SAFETY: the entries' wait lists point at `Waiter`s owned by futures on
// other threads (`Send + Sync`), touched only under the shard lock; keys are
// moved in and dropped by whichever thread removes them, and read by every
// holder (`K: Send + Sync`).
unsafe impl<K: Send + Sync> Send for ShardState<K> {}

impl<K> std::fmt::Debug for ShardState<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardState")
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

pub(crate) const ENTRY_PRESENT: &str =
    "keylock: an entry with a holder, waiter or fenced guard is in its shard";

impl<K> ShardState<K> {
    /// An empty shard minting its tokens from `tokens`.
    pub(crate) fn new(tokens: TokenCounter) -> Self {
        Self {
            entries: KeyMap::new(),
            keys: KeyPool::new(),
            tokens,
            fair_at: None,
            spares: HolderSpares::default(),
            watchers: GrantWatchers::default(),
        }
    }

    /// Keys held, awaited or pointed at by a fenced guard in this shard.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The entry at `key` (found by the key cell's address, no user code) and
    /// the machinery to change it.
    #[inline]
    fn locate(&mut self, hash: u64, key: KeyPtr<K>) -> (&mut Entry<K>, Keys<'_>) {
        let index = self
            .entries
            .find(hash, |e| e.key == key)
            .expect(ENTRY_PRESENT);
        let entry = self.entries.get_mut(index);
        (
            entry,
            Keys {
                tokens: &mut self.tokens,
                fair_at: &mut self.fair_at,
                watchers: &mut self.watchers,
                spares: &mut self.spares,
            },
        )
    }

    /// The entry of a key equal to `key` (`K: Eq` runs here).
    #[inline]
    fn locate_by<Q>(&mut self, hash: u64, key: &Q) -> Option<(&mut Entry<K>, Keys<'_>)>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let index = self.entries.find(hash, |e| {
            // SAFETY: `e` is in the table, so its key cell is live.
            let k: &K = unsafe { e.key.get() };
            k.borrow() == key
        })?;
        let entry = self.entries.get_mut(index);
        Some((
            entry,
            Keys {
                tokens: &mut self.tokens,
                fair_at: &mut self.fair_at,
                watchers: &mut self.watchers,
                spares: &mut self.spares,
            },
        ))
    }

    /// Removes the entry at `key` if nothing uses it any more; its key is
    /// dropped after unlocking.
    fn remove_if_unused(&mut self, hash: u64, key: KeyPtr<K>, ctx: &mut Ctx<'_, '_, K>) {
        let Some(index) = self.entries.find(hash, |e| e.key == key) else {
            return;
        };
        if self.entries.get(index).is_unused() {
            // The map shrinks (with hysteresis) as entries leave.
            let removed = self.entries.remove(index);
            // SAFETY: the entry was just removed from the table and nothing
            // uses it: no holder, no waiter, no fenced guard.
            ctx.drop_key_later(unsafe { self.keys.take(removed.key) });
            removed.forget_unused();
        }
    }

    /// The first step of every lock, inline and without a [`Ctx`]: takes the
    /// key if it has no entry (one probe, one insert, a token), reading the
    /// clock only for a lease. Otherwise returns the index of the key's
    /// entry, for the rest of the attempt under the same lock (`*_busy`).
    /// The caller's key is moved out of `key` only if it is stored; if
    /// `K: Eq` panics, nothing has changed and the key is still the
    /// caller's, to drop after the lock unwinds.
    #[inline(always)]
    pub(crate) fn claim(
        &mut self,
        hash: u64,
        key: &mut Option<K>,
        mode: Mode,
        terms: Terms,
        now: &mut Now<'_>,
        counters: &Counters,
    ) -> Result<Grant<K>, Index>
    where
        K: Eq,
    {
        let probe = key.as_ref().expect("keylock: the caller's key is present");
        let found = self.entries.find_or_vacant(hash, |e| {
            // SAFETY: `e` is in the table, so its key cell is live.
            let k: &K = unsafe { e.key.get() };
            k == probe
        });
        match found {
            Ok(index) => Err(index),
            Err(vacant) => {
                // Everything that can panic comes before any change.
                let token = self.tokens.mint();
                let (deadline, since) = grant_times(terms, now);
                let cell = self.keys.store(key.take().expect("present"));
                counters.acquired(false);
                let holders = Holders::one(Holder {
                    token,
                    deadline,
                    since,
                    owner: terms.owner,
                });
                vacant.insert(&mut self.entries, Entry::held(cell, holders, mode));
                Ok(Grant {
                    key: cell,
                    token,
                    deadline,
                    mode,
                })
            }
        }
    }

    /// The entry at `index` (from [`claim`](Self::claim) or a probe, with no
    /// insert or remove since) and the machinery to change it.
    #[inline]
    fn at(&mut self, index: Index) -> (&mut Entry<K>, Keys<'_>) {
        let ShardState {
            entries,
            tokens,
            fair_at,
            watchers,
            spares,
            ..
        } = self;
        (
            entries.get_mut(index),
            Keys {
                tokens,
                fair_at,
                watchers,
                spares,
            },
        )
    }

    /// [`release_alone`](Self::release_alone) for a holder that must prove
    /// it is live (a transaction's release): a grant without a lease is live
    /// while it holds the key, so no clock is read. `Ok`: released alone, its
    /// key returned to drop after unlocking. `Err(Some(index))`: a live grant
    /// without a lease on a busy key, for
    /// [`release_at`](Self::release_at). `Err(None)`: anything else (a
    /// leased or lost grant, no entry), for
    /// [`release_if_live`](Self::release_if_live); nothing changed.
    ///
    /// The common case (the only holder, without a lease, nobody waiting,
    /// no fenced guard) is one pass over the map, as
    /// [`release_alone`](Self::release_alone)'s: the probe checks the entry
    /// it finds and takes it out.
    #[inline(always)]
    pub(crate) fn release_unleased(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) -> Result<K, Option<Index>> {
        let removed = self.entries.remove_if(
            hash,
            |e| e.key == key,
            |e| {
                matches!(e.holders.only(), Some(h) if h.token == token && !h.deadline.is_some())
                    && e.queue.is_empty()
                    && e.fenced == 0
            },
        );
        match removed {
            Ok(removed) => {
                // SAFETY: the entry was just removed from the table and
                // nothing uses it: no waiter, no fenced guard, and its only
                // holder lets go.
                let key = unsafe { self.keys.take(removed.key) };
                removed.forget_released();
                Ok(key)
            }
            Err(None) => Err(None),
            Err(Some(index)) => self.unleased_busy(index, token),
        }
    }

    /// [`release_unleased`](Self::release_unleased) of an entry the
    /// one-pass release did not take: `Err(Some(index))` for a live grant
    /// without a lease (other holders, waiters or fenced guards),
    /// `Err(None)` for anything else.
    #[inline]
    fn unleased_busy(&self, index: Index, token: FencingToken) -> Result<K, Option<Index>> {
        match self.entries.get(index).holders.get(token) {
            Some(holder) if !holder.deadline.is_some() => Err(Some(index)),
            _ => Err(None),
        }
    }

    /// The common handoff, without a [`Ctx`], its checks: grant `token`,
    /// the only holder of the key at `index`, lets go under strict
    /// fairness, and the head waiter asks for the key exclusively. Returns
    /// the head and the lease its grant will carry, for
    /// [`hand_off_to`](Self::hand_off_to); anything else (eventual
    /// fairness, other holders, a shared or upgrading head, no waiter)
    /// returns `None`, for [`release_at`](Self::release_at). Changes
    /// nothing.
    #[inline(always)]
    pub(crate) fn plain_head(
        &mut self,
        index: Index,
        token: FencingToken,
        fairness: Fairness,
    ) -> Option<(WaiterPtr, PackedDuration)> {
        if fairness != Fairness::Strict {
            return None;
        }
        let entry = self.entries.get_mut(index);
        let head = entry.queue.head()?;
        // SAFETY: the head is linked, under the shard lock (the caller's).
        let lease = unsafe { Waiter::exclusive_lease(head) }?;
        if !entry.holders.is_only(token) {
            return None;
        }
        Some((head, lease))
    }

    /// What [`plain_head`](Self::plain_head) returned, read again without
    /// its checks (`None` only if the caller broke the contract).
    ///
    /// # Safety
    ///
    /// `plain_head` returned some for `index` under the same hold of the
    /// shard lock, with no change since.
    #[inline(always)]
    pub(crate) unsafe fn plain_head_again(
        &mut self,
        index: Index,
    ) -> Option<(WaiterPtr, PackedDuration)> {
        let head = self.entries.get_mut(index).queue.head()?;
        // SAFETY: the head is linked, under the shard lock (the caller's).
        let lease = unsafe { Waiter::exclusive_lease(head) }?;
        Some((head, lease))
    }

    /// The common handoff past [`plain_head`](Self::plain_head): the head
    /// is granted a new token (and its lease, from one clock read) and
    /// returned its waker, to wake after unlocking (`None` inside: it was
    /// not armed, and sees the grant when it polls). With waiters left
    /// behind the head and a lease the shard's timer does not cover yet,
    /// changes nothing and returns `None`, for
    /// [`release_at`](Self::release_at). With no token left it panics
    /// before it changes anything, as `release_at` would (the mint checks
    /// first). A head without a lease reads no clock (so the caller makes
    /// no call).
    ///
    /// What the general path would do beside this is nothing here: a
    /// granted exclusive head ends the admission, and the next head, if any,
    /// is woken by the new holder's deadline through the shard's timer,
    /// which already fires by then (checked), so nobody is nudged; with no
    /// next head, nothing is woken by that deadline (a later waiter covers
    /// it as it links).
    ///
    /// # Safety
    ///
    /// `(head, lease)` is what [`plain_head`](Self::plain_head) returned for
    /// `index` under the same hold of the shard lock, with no change since.
    #[inline(always)]
    pub(crate) unsafe fn hand_off_to(
        &mut self,
        index: Index,
        (head, lease): (WaiterPtr, PackedDuration),
        shard: (&Counters, &ShardTimer, &Clock),
    ) -> Option<Option<std::task::Waker>> {
        let (entry, keys) = self.at(index);
        let (deadline, since) = if lease.nanos().is_none() {
            (Stamp::NONE, Stamp::NONE)
        } else {
            // Only a waiter left behind the new holder needs waking by its
            // deadline (as `nudge_head_for_timer`, which skips an empty
            // queue): with none, nothing needs covering.
            lease_times(lease, shard, entry.queue.len() > 1)?
        };
        // Grants the head the key exclusively, in place of its only holder.
        // Panics (no token left) before anything changes.
        let fresh = keys.tokens.mint();
        // SAFETY: under the shard lock; `head` is the head (the caller's
        // contract: nothing changed the queue since), granted right below.
        let owner = unsafe { entry.queue.pop_head_for_grant(head) };
        // SAFETY: just unlinked, under the lock; not touched again.
        let waker = unsafe { Waiter::grant(head, fresh, deadline, Mode::Exclusive) };
        entry.holders.replace_only(Holder {
            token: fresh,
            deadline,
            since,
            owner,
        });
        entry.mode = Mode::Exclusive;
        shard.0.handed_off();
        Some(waker)
    }

    /// The common release, inline and without a [`Ctx`]: grant `token` is
    /// the only holder of the key at `key`, nobody waits for it and no fenced
    /// guard points at it, so its entry goes and the key is returned, to be
    /// dropped after unlocking. Otherwise changes nothing and returns the
    /// entry's index for [`release_at`](Self::release_at) (none: no entry,
    /// which a release never meets).
    #[inline(always)]
    pub(crate) fn release_alone(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) -> Result<K, Option<Index>> {
        let removed = self.entries.remove_if(
            hash,
            |e| e.key == key,
            // The queue first: a key with waiters (the handoff) is told
            // apart at the first check.
            |e| e.queue.is_empty() && e.holders.is_only(token) && e.fenced == 0,
        )?;
        // SAFETY: the entry was just removed from the table and nothing uses
        // it: no waiter, no fenced guard, and its only holder lets go.
        let key = unsafe { self.keys.take(removed.key) };
        removed.forget_released();
        Ok(key)
    }
}

/// The deadline and start of a handed-off grant with `lease`, on the real
/// clock, if nothing must cover that deadline (no waiter is left behind
/// the grant: not `waiters_left`) or the shard's timer already fires by it (so that the
/// handoff arms nothing); `None` otherwise.
#[inline(always)]
fn lease_times(
    lease: crate::support::lease::PackedDuration,
    (_, timer, clock): (&Counters, &ShardTimer, &Clock),
    waiters_left: bool,
) -> Option<(Stamp, Stamp)> {
    if !clock.uses_shard_timers() {
        return None;
    }
    // As `lease_from`, its clock read in place.
    let nanos = lease.nanos()?;
    let since = Now::new(clock).start_for_nanos_inline(nanos);
    let deadline = since.plus_nanos(nanos);
    (!waiters_left || timer.covers(deadline.to_raw())).then_some((deadline, since))
}

pub(crate) const NO_DIAGNOSIS: Diagnosis = Diagnosis {
    holder: None,
    owner: 0,
    held_for: None,
    ahead: 0,
};

#[cfg(feature = "test-util")]
impl<K> ShardState<K> {
    /// Checks every structural invariant of the shard; panics naming the
    /// first one broken.
    pub(crate) fn validate(&self, fairness: Fairness) {
        self.watchers.validate();
        for (_, entry) in self.entries.iter() {
            assert!(!entry.is_unused(), "an unused entry stayed in the table");
            let mut count = 0;
            let mut expect_prev = None;
            let mut head_nudged = false;
            // SAFETY: we hold the shard lock (the caller does).
            unsafe {
                entry.queue.walk(|at, prev, state| {
                    assert!(
                        crate::keys::waiter::is_linked_state(state),
                        "a linked waiter is waiting"
                    );
                    assert_eq!(prev, expect_prev, "prev link of a waiter");
                    if count == 0 {
                        head_nudged = crate::keys::waiter::is_nudged_state(state);
                    }
                    expect_prev = Some(at);
                    count += 1;
                });
            }
            assert_eq!(entry.queue.len(), count, "waiter count matches the queue");
            assert!(
                entry.mode == Mode::Shared || entry.holders.len() <= 1,
                "an exclusive key has at most one holder"
            );
            match entry.admission() {
                entry::Admission::Empty | entry::Admission::Blocked => {}
                entry::Admission::Grant(_) if entry.holders.is_empty() => {
                    assert_eq!(
                        fairness,
                        Fairness::Eventual,
                        "a queue without a holder was not granted"
                    );
                    assert!(
                        head_nudged,
                        "a free key's head waiter was nudged to take it"
                    );
                    assert!(
                        !handoff::head_is_a_transactions(entry),
                        "a free key's head waiter is a transaction's (granted, not nudged)"
                    );
                }
                other => panic!("a head waiter the holders admit was left waiting: {other:?}"),
            }
        }
    }
}

impl<K> Drop for ShardState<K> {
    fn drop(&mut self) {
        // Guards and futures borrow the table, so an entry left now belongs to
        // a guard or future leaked with `mem::forget`: free its key.
        for entry in self.entries.drain() {
            // SAFETY: nothing can reach the entry any more.
            drop(unsafe { self.keys.take(entry.key) });
        }
    }
}
