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
//!   key and nudge the head, letting a running caller take it first;
//! - a lapse or a revocation fences the holder (guard or granted waiter alike)
//!   and hands the key on; it is noticed whenever the key is next touched (the
//!   head waiter's timer touches it at the deadline).

use std::borrow::Borrow;
use std::time::{Duration, Instant};

use crate::key_map::KeyMap;

use crate::clock::{Now, Stamp};
use crate::deferred::Ctx;
use crate::error::LockError;
use crate::fairness::Fairness;
use crate::key_slot::{KeyPool, KeyPtr};
use crate::lease::PackedDuration;
use crate::lost::{LossWatchers, Watch};
use crate::token::{FencingToken, TokenCounter};
use crate::waiter::{Granted, LazyWaiter, WaitList, Waiter, WaiterPtr};

/// The current grant of a key.
#[derive(Debug, Clone, Copy)]
struct Holder {
    token: FencingToken,
    /// When the grant loses its authority, if it has a lease.
    deadline: Stamp,
    /// When the grant was made, if the clock was read then.
    since: Stamp,
}

impl Holder {
    /// Whether the grant still has authority at `now` (read only if needed).
    #[inline]
    fn is_live(&self, now: &mut Now<'_>) -> bool {
        !self.deadline.is_some() || now.is_before(self.deadline)
    }
}

/// The state of one key that is held, awaited or still pointed at.
#[derive(Debug)]
struct Entry<K> {
    key: KeyPtr<K>,
    /// The current grant; `None` once it was released (under eventual
    /// fairness, with waiters left), lapsed or was revoked with nobody to
    /// hand the key to.
    holder: Option<Holder>,
    /// Guards (and granted waiters) that lost the key but still exist.
    fenced: u32,
    queue: WaitList,
}

impl<K> Entry<K> {
    #[inline]
    fn is_unused(&self) -> bool {
        self.holder.is_none() && self.queue.is_empty() && self.fenced == 0
    }

    /// What a caller waiting behind `ahead` others would be told now.
    fn diagnosis(&self, ahead: usize, ctx: &mut Ctx<'_, '_, K>) -> Diagnosis {
        let holder = self.holder;
        Diagnosis {
            holder: holder.map(|h| h.token),
            held_for: holder
                .and_then(|h| h.since.get())
                .map(|since| ctx.now().saturating_duration_since(since)),
            ahead,
        }
    }
}

/// A grant handed to a caller.
#[derive(Debug)]
pub(crate) struct Grant<K> {
    pub(crate) key: KeyPtr<K>,
    pub(crate) token: FencingToken,
    pub(crate) deadline: Stamp,
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
    pub(crate) timeout: Option<Duration>,
    pub(crate) deadline: Stamp,
}

impl Patience {
    /// When a wait starting now starts and gives up (none: never), as
    /// stamps; both none for a wait without either.
    fn start_and_until<K>(self, ctx: &mut Ctx<'_, '_, K>) -> (Stamp, Stamp) {
        let after_timeout = match self.timeout {
            Some(timeout) => {
                let start = ctx.clock().start_for(timeout);
                (start, start.plus(timeout))
            }
            None if self.deadline.is_some() => (Stamp::new(Some(ctx.now())), Stamp::NONE),
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
}

/// Why a wait gave up, described at the moment it did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Diagnosis {
    pub(crate) holder: Option<FencingToken>,
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
    /// The wakers of `Lost` futures of this shard's grants (empty unless
    /// loss notification is used).
    loss: LossWatchers,
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

/// What queue surgery needs beside one entry.
struct Keys<'s> {
    tokens: &'s mut TokenCounter,
    fair_at: &'s mut Option<Instant>,
    loss: &'s mut LossWatchers,
}

impl Keys<'_> {
    /// The key has no holder and a waiter: hands it to the head, wakes it
    /// (and the next head, if it must arm a lease timer).
    fn hand_off<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        debug_assert!(entry.holder.is_none());
        // Panics (token space exhausted) before anything changes.
        let token = self.tokens.mint();
        // SAFETY: under the shard lock.
        let Some((head, lease)) = (unsafe { entry.queue.pop_front() }) else {
            return;
        };
        let (deadline, since) = lease_from(lease, ctx.clock());
        // SAFETY: just unlinked, under the lock; not touched again.
        let waker = unsafe { Waiter::grant(head, token, deadline) };
        entry.holder = Some(Holder {
            token,
            deadline,
            since,
        });
        ctx.counters().handed_off();
        ctx.counters().acquired(true);
        if let Some(waker) = waker {
            ctx.wake_later(waker);
        }
        nudge_head_for_timer(entry, ctx);
    }

    /// A holder let go of a key that has waiters: hand it to the head
    /// (strict), or, under eventual fairness while the shard's fairness
    /// deadline has not come, free it and nudge the head to retry.
    #[inline(never)]
    fn pass_on<K>(&mut self, entry: &mut Entry<K>, fairness: Fairness, ctx: &mut Ctx<'_, '_, K>) {
        // The waiters need a token, now (a handoff) or when the nudged head
        // takes the key: if none is left, fail before the holder or the
        // fairness deadline changes.
        self.tokens.check_available();
        if fairness == Fairness::Eventual {
            let now = ctx.now();
            match *self.fair_at {
                Some(at) if now < at => {
                    entry.holder = None;
                    nudge_head(entry, ctx);
                    return;
                }
                _ => {
                    *self.fair_at = Some(now.checked_add(Fairness::EVENTUAL_BOUND).unwrap_or(now));
                }
            }
        }
        entry.holder = None;
        self.hand_off(entry, ctx);
    }

    /// Takes the key from its current holder (it lapsed or is revoked): the
    /// holder is fenced, and the key goes to the head waiter.
    fn displace<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) -> Option<Holder> {
        let holder = entry.holder?;
        // Checked first, so that a panic changes nothing.
        let fenced = entry
            .fenced
            .checked_add(1)
            .expect("keylock: more than 2^32 - 1 fenced guards on one key");
        if !entry.queue.is_empty() {
            self.tokens.check_available();
        }
        entry.holder = None;
        entry.fenced = fenced;
        if !entry.queue.is_empty() {
            self.hand_off(entry, ctx);
        }
        // Its `Lost` futures, if any (one check when there are none).
        self.loss.wake(holder.token, ctx);
        Some(holder)
    }

    /// Notices a lapsed lease: the holder is displaced and the key passes on.
    #[inline]
    fn settle<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
        if let Some(holder) = entry.holder {
            if !holder.is_live(ctx.clock()) {
                self.displace(entry, ctx);
                ctx.counters().expired();
            }
        }
    }

    /// A caller takes a key whose entry has no holder.
    fn take_free<K>(
        &mut self,
        entry: &mut Entry<K>,
        lease: PackedDuration,
        contended: bool,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Grant<K> {
        debug_assert!(entry.holder.is_none());
        let token = self.tokens.mint();
        let (deadline, since) = lease_from(lease, ctx.clock());
        ctx.counters().acquired(contended);
        entry.holder = Some(Holder {
            token,
            deadline,
            since,
        });
        Grant {
            key: entry.key,
            token,
            deadline,
        }
    }
}

/// The holder's deadline changed or the queue got a new head: make sure the
/// head is woken by the holder's deadline. With shard timers, the shard's
/// timer covers it. Otherwise nudge the head so that it re-arms its own
/// timer, unless the timer it armed already fires by then (every waiter
/// arms for the holder it saw, so with leases of one length a handoff nudges
/// nobody).
fn nudge_head_for_timer<K>(entry: &Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
    let Some(deadline) = entry.holder.map(|h| h.deadline) else {
        return;
    };
    if !deadline.is_some() {
        return;
    }
    let Some(head) = entry.queue.head() else {
        return;
    };
    if ctx.cover(deadline) {
        return;
    }
    // SAFETY: the head is linked, and we hold the shard lock.
    let armed = unsafe { Waiter::timer_at(head) };
    if !armed.is_some() || armed > deadline {
        nudge_head(entry, ctx);
    }
}

/// The holder deadline a waiter of `entry` must be woken by: covered by the
/// shard's timer (`None` returned), or returned for the waiter's own timer
/// (any waiter arms one, not only the head: when it heads the queue later,
/// its timer already covers a holder whose lease is as long), recorded in
/// its node.
///
/// # Safety
///
/// `waiter` is linked into `entry`'s queue, by its owner, under the lock.
#[inline]
unsafe fn holder_timer<K>(
    entry: &Entry<K>,
    waiter: &Waiter,
    ctx: &mut Ctx<'_, '_, K>,
) -> Option<Instant> {
    let deadline = entry.holder.map_or(Stamp::NONE, |h| h.deadline);
    if ctx.cover(deadline) {
        return None;
    }
    // SAFETY: the caller's contract.
    unsafe { waiter.set_timer_at(deadline) };
    deadline.get()
}

/// Nudges the head waiter, if any.
fn nudge_head<K>(entry: &Entry<K>, ctx: &mut Ctx<'_, '_, K>) {
    if let Some(head) = entry.queue.head() {
        // SAFETY: the head is linked, and we hold the shard lock.
        if let Some(waker) = unsafe { Waiter::nudge(head) } {
            ctx.wake_later(waker);
        }
    }
}

/// The deadline and start of a grant with `lease`: one clock read and one
/// conversion to a stamp; the deadline is the start plus the lease, in
/// nanoseconds.
#[inline]
fn lease_from(lease: PackedDuration, now: &mut Now<'_>) -> (Stamp, Stamp) {
    match lease.nanos() {
        Some(nanos) => {
            let since = now.start_for_nanos(nanos);
            (since.plus_nanos(nanos), since)
        }
        None => (Stamp::NONE, Stamp::NONE),
    }
}

const ENTRY_PRESENT: &str =
    "keylock: an entry with a holder, waiter or fenced guard is in its shard";

impl<K> ShardState<K> {
    /// An empty shard minting its tokens from `tokens`.
    pub(crate) fn new(tokens: TokenCounter) -> Self {
        Self {
            entries: KeyMap::new(),
            keys: KeyPool::new(),
            tokens,
            fair_at: None,
            loss: LossWatchers::default(),
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
                loss: &mut self.loss,
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
                loss: &mut self.loss,
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
        }
    }

    /// Whether the key has a live holder now.
    pub(crate) fn is_held<Q>(&mut self, hash: u64, key: &Q, ctx: &mut Ctx<'_, '_, K>) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key)
            .and_then(|(e, _)| e.holder)
            .is_some_and(|h| h.is_live(ctx.clock()))
    }

    /// How many futures wait for the key.
    pub(crate) fn waiters<Q>(&mut self, hash: u64, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key).map_or(0, |(e, _)| e.queue.len())
    }

    /// Takes the key if it has no entry (one probe); otherwise returns the
    /// key's entry. The caller's key is moved out of `key` only if it is
    /// stored; if `K: Eq` panics, nothing has changed and the key is still
    /// the caller's, to drop after the lock unwinds.
    #[inline]
    fn claim(
        &mut self,
        hash: u64,
        key: &mut Option<K>,
        lease: PackedDuration,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Grant<K>, (&mut Entry<K>, Keys<'_>)>
    where
        K: Eq,
    {
        let ShardState {
            entries,
            keys,
            tokens,
            fair_at,
            loss,
        } = self;
        let probe = key.as_ref().expect("keylock: the caller's key is present");
        // SAFETY: `e` is in the table, so its key cell is live.
        match entries.find_or_vacant(hash, |e| unsafe { e.key.get() } == probe) {
            Ok(index) => Err((
                entries.get_mut(index),
                Keys {
                    tokens,
                    fair_at,
                    loss,
                },
            )),
            Err(vacant) => {
                // Everything that can panic comes before any change.
                let token = tokens.mint();
                let (deadline, since) = lease_from(lease, ctx.clock());
                let cell = keys.store(key.take().expect("present"));
                ctx.counters().acquired(false);
                vacant.insert(
                    entries,
                    Entry {
                        key: cell,
                        holder: Some(Holder {
                            token,
                            deadline,
                            since,
                        }),
                        fenced: 0,
                        queue: WaitList::default(),
                    },
                );
                Ok(Grant {
                    key: cell,
                    token,
                    deadline,
                })
            }
        }
    }

    /// Takes the key if it is free (strict: and nobody waits); otherwise
    /// leaves the caller's key in `key`.
    #[inline]
    pub(crate) fn try_acquire(
        &mut self,
        hash: u64,
        key: &mut Option<K>,
        lease: PackedDuration,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<Grant<K>>
    where
        K: Eq,
    {
        let (entry, mut keys) = match self.claim(hash, key, lease, ctx) {
            Ok(grant) => return Some(grant),
            Err(busy) => busy,
        };
        keys.settle(entry, ctx);
        if entry.holder.is_some() || (fairness == Fairness::Strict && !entry.queue.is_empty()) {
            return None;
        }
        Some(keys.take_free(entry, lease, false, ctx))
    }

    /// Takes the key if it is free; otherwise links `waiter` at the tail of
    /// its queue. The caller's key stays in `key` unless it was stored.
    ///
    /// # Safety
    ///
    /// `waiter` is idle, pinned, and its owner unlinks it (through
    /// [`cancel`](Self::cancel) or a poll that completes) before freeing it.
    #[inline]
    #[allow(clippy::too_many_arguments)] // the one entry point of a wait
    pub(crate) unsafe fn acquire_or_enqueue(
        &mut self,
        hash: u64,
        key: &mut Option<K>,
        lease: PackedDuration,
        patience: Patience,
        fairness: Fairness,
        waiter: &mut LazyWaiter,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Attempt<K>
    where
        K: Eq,
    {
        let (entry, mut keys) = match self.claim(hash, key, lease, ctx) {
            Ok(grant) => return Attempt::Acquired(grant),
            Err(busy) => busy,
        };
        keys.settle(entry, ctx);
        if entry.holder.is_none() && (fairness == Fairness::Eventual || entry.queue.is_empty()) {
            return Attempt::Acquired(keys.take_free(entry, lease, false, ctx));
        }
        let waiter = waiter.get_or_init();
        // When the caller gives up (too far to represent: never), from the
        // time this operation judges by, which the caller reads back.
        let (start, until) = patience.start_and_until(ctx);
        ctx.cover(until);
        // SAFETY: the caller's contract; under the shard lock.
        unsafe {
            waiter.prepare(lease, until);
            entry.queue.push_back(waiter);
        }
        // SAFETY: just linked, under the lock.
        let wake_at = unsafe { holder_timer(entry, waiter, ctx) };
        Attempt::Queued {
            key: entry.key,
            wake_at,
            start,
            until,
        }
    }

    /// A linked waiter is polled: returns its grant once the key is its
    /// (settling a lapse first, and under eventual fairness taking a free key
    /// when it heads the queue); otherwise keeps its stored waker if it wakes
    /// the same task as `current`, or stores `fresh` (cloned by the caller
    /// before locking).
    ///
    /// # Safety
    ///
    /// `waiter` belongs to the caller and was linked into `key`'s queue (it
    /// may have been granted since).
    pub(crate) unsafe fn poll_waiter(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        waiter: &Waiter,
        current: &std::task::Waker,
        mut fresh: Option<std::task::Waker>,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Polled {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        if waiter.seen() == crate::waiter::Seen::Granted {
            ctx.drop_waker_later(fresh);
            return Polled::Granted(waiter.granted());
        }
        let is_head = entry.queue.is_head(waiter);
        if is_head && entry.holder.is_none() {
            // Eventual fairness: the key was freed and this head nudged.
            let me = std::ptr::NonNull::from(waiter);
            // SAFETY: linked (it heads the queue), under the lock.
            let lease = unsafe { Waiter::lease(me) };
            keys.tokens.check_available();
            // SAFETY: as above.
            unsafe { entry.queue.remove(me) };
            // SAFETY: just unlinked by its owner, under the lock.
            ctx.drop_waker_later(unsafe { waiter.retire() });
            ctx.drop_waker_later(fresh);
            let grant = keys.take_free(entry, lease, true, ctx);
            // The next head must arm a timer for this grant's lease, as
            // after a handoff.
            nudge_head_for_timer(entry, ctx);
            return Polled::Granted(Granted {
                token: grant.token,
                deadline: grant.deadline,
            });
        }
        // SAFETY: linked, under the lock, by the owner.
        match unsafe { waiter.arm_locked(current, &mut fresh) } {
            Ok(spare) => ctx.drop_waker_later(spare),
            Err(()) => return Polled::NeedWaker,
        }
        // SAFETY: linked, under the lock, by the owner.
        let wake_at = unsafe { holder_timer(entry, waiter, ctx) };
        Polled::Waiting { wake_at }
    }

    /// A linked waiter gives up (its future is dropped, or `timed_out`): it
    /// leaves the queue. If it had been granted the key meanwhile, the grant
    /// is released as a guard would release it (`Err`, the grant, when
    /// `timed_out`: a timeout takes the key instead).
    ///
    /// # Safety
    ///
    /// As [`poll_waiter`](Self::poll_waiter).
    pub(crate) unsafe fn leave(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        waiter: &Waiter,
        timed_out: bool,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Diagnosis, Granted> {
        if waiter.seen() == crate::waiter::Seen::Granted {
            let granted = waiter.granted();
            if timed_out {
                return Err(granted);
            }
            ctx.counters().cancelled();
            self.release(hash, key, granted.token, fairness, ctx);
            return Ok(NO_DIAGNOSIS);
        }
        let (entry, _) = self.locate(hash, key);
        let me = std::ptr::NonNull::from(waiter);
        let mut ahead = 0;
        if timed_out {
            let mut found = false;
            // SAFETY: under the lock.
            unsafe {
                entry.queue.walk(|at, _, _| {
                    found |= at == me;
                    ahead += usize::from(!found);
                });
            }
        }
        let was_head = entry.queue.is_head(waiter);
        // SAFETY: linked (not granted, and only its owner, the caller,
        // unlinks it otherwise), under the lock.
        unsafe { entry.queue.remove(me) };
        // SAFETY: just unlinked by its owner, under the lock.
        ctx.drop_waker_later(unsafe { waiter.retire() });
        if was_head {
            if entry.holder.is_none() {
                // Eventual fairness: the free key's nudge passes on.
                nudge_head(entry, ctx);
            } else {
                nudge_head_for_timer(entry, ctx);
            }
        }
        let diagnosis = if timed_out {
            ctx.counters().timed_out();
            entry.diagnosis(ahead, ctx)
        } else {
            ctx.counters().cancelled();
            NO_DIAGNOSIS
        };
        self.remove_if_unused(hash, key, ctx);
        Ok(diagnosis)
    }

    /// Describes why the key would make a caller wait, right now.
    pub(crate) fn diagnose(&mut self, hash: u64, key: &K, ctx: &mut Ctx<'_, '_, K>) -> Diagnosis
    where
        K: Eq,
    {
        let Some((entry, _)) = self.locate_by(hash, key) else {
            return NO_DIAGNOSIS;
        };
        let ahead = entry.queue.len();
        entry.diagnosis(ahead, ctx)
    }

    /// The holder of `token` lets go of the key: it goes to the head waiter,
    /// or the entry is removed. A grant that had lost the key (its token is
    /// no longer current) frees nothing but its own claim on the entry.
    #[inline(always)]
    pub(crate) fn release(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        fairness: Fairness,
        ctx: &mut Ctx<'_, '_, K>,
    ) {
        let ShardState {
            entries,
            keys,
            tokens,
            fair_at,
            loss,
        } = self;
        let Some(index) = entries.find(hash, |e| e.key == key) else {
            debug_assert!(false, "{ENTRY_PRESENT}");
            return;
        };
        let entry = entries.get_mut(index);
        match entry.holder {
            Some(holder) if holder.token == token => {
                if !entry.queue.is_empty() {
                    Keys {
                        tokens,
                        fair_at,
                        loss,
                    }
                    .pass_on(entry, fairness, ctx);
                    return;
                }
                entry.holder = None;
            }
            _ => {
                debug_assert!(
                    entry.fenced > 0,
                    "a stale release comes from a fenced grant"
                );
                entry.fenced = entry.fenced.saturating_sub(1);
            }
        }
        if entry.is_unused() {
            let removed = entries.remove(index);
            // SAFETY: the entry was just removed from the table and nothing
            // uses it: no holder, no waiter, no fenced guard.
            ctx.drop_key_later(unsafe { keys.take(removed.key) });
        }
    }

    /// Whether grant `token` still has authority; settles a lapse it finds.
    pub(crate) fn check(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<FencingToken, LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        match entry.holder {
            Some(h) if h.token == token => Ok(token),
            _ => Err(LockError::Expired { token }),
        }
    }

    /// Gives grant `token` a new deadline `lease` from now, if it still has
    /// authority.
    pub(crate) fn renew(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        lease: Duration,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Stamp, LockError> {
        let (entry, mut keys) = self.locate(hash, key);
        keys.settle(entry, ctx);
        let Some(holder) = entry.holder.as_mut().filter(|h| h.token == token) else {
            return Err(LockError::Expired { token });
        };
        let start = ctx.clock().start_for(lease);
        let deadline = start.plus(lease);
        let before = std::mem::replace(&mut holder.deadline, deadline);
        if !holder.since.is_some() {
            holder.since = start;
        }
        nudge_head_for_timer(entry, ctx);
        // The grant's `Lost` futures armed their timers at the old deadline:
        // an earlier one (or a first one) needs them to re-arm; a later one
        // does not (they fire early, find the grant live, and re-arm).
        if deadline.is_some() && (!before.is_some() || deadline.to_raw() < before.to_raw()) {
            keys.loss.wake(token, ctx);
        }
        Ok(deadline)
    }

    /// The deadline of grant `token` as the table knows it, judged now
    /// without settling anything: `Ok` while it is the key's current grant
    /// (its deadline, which has passed if it lapsed unnoticed), `Err(now)`
    /// once it lost the key.
    pub(crate) fn deadline_of(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Result<Stamp, Instant> {
        let (entry, _) = self.locate(hash, key);
        match entry.holder {
            Some(h) if h.token == token => Ok(h.deadline),
            _ => Err(ctx.now()),
        }
    }

    /// A `Lost` future of grant `token` asks whether it still holds its key
    /// (settling a lapse first, which wakes every watcher of the grant) and
    /// registers, or unregisters once it lost it; see [`LossWatchers::watch`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn watch_loss(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        slot: &mut Option<usize>,
        current: &std::task::Waker,
        fresh: Option<std::task::Waker>,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Watch {
        let (entry, mut keys) = self.locate(hash, key);
        if entry
            .holder
            .is_some_and(|h| h.token == token && !h.is_live(ctx.clock()))
        {
            // The settle below ends this grant and wakes its watchers; this
            // one is running: unregister it first rather than wake it.
            if let Some(i) = slot.take() {
                keys.loss.unwatch(i, ctx);
            }
        }
        keys.settle(entry, ctx);
        let live = match entry.holder {
            Some(h) if h.token == token => Some(h.deadline.get()),
            _ => None,
        };
        keys.loss.watch(slot, token, live, current, fresh, ctx)
    }

    /// A `Lost` future in `slot` is dropped.
    pub(crate) fn unwatch_loss(&mut self, slot: usize, ctx: &mut Ctx<'_, '_, K>) {
        self.loss.unwatch(slot, ctx);
    }

    /// Forces grant `token` of a key out, if it is the key's live holder,
    /// and passes the key on; `false` (after settling a lapse it finds) if
    /// the key changed hands, lapsed, or has no entry.
    pub(crate) fn revoke_grant<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        token: FencingToken,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let Some((entry, mut keys)) = self.locate_by(hash, key) else {
            return false;
        };
        let ours = entry
            .holder
            .is_some_and(|h| h.token == token && h.is_live(ctx.clock()));
        if !ours {
            keys.settle(entry, ctx);
            return false;
        }
        keys.displace(entry, ctx);
        ctx.counters().revoked();
        true
    }

    /// Forces the live holder of a key out and passes the key on.
    pub(crate) fn revoke<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let (entry, mut keys) = self.locate_by(hash, key)?;
        let live = entry.holder.is_some_and(|h| h.is_live(ctx.clock()));
        if !live {
            keys.settle(entry, ctx);
            return None;
        }
        let revoked = keys.displace(entry, ctx).map(|h| h.token);
        ctx.counters().revoked();
        revoked
    }
}

impl<K> ShardState<K> {
    /// The shard's timer fired at `now` (a raw stamp): nudges every waiter
    /// whose timeout has come and the head of every queue whose holder's
    /// lease has lapsed, each of which settles when it polls, collecting
    /// their wakers into `wakers`; returns the earliest deadline still to
    /// come (`u64::MAX`: none). Touches no key.
    pub(crate) fn fire_timers(&mut self, now: u64, wakers: &mut Vec<std::task::Waker>) -> u64 {
        let mut next = u64::MAX;
        let mut due = |at: Stamp, waiter: WaiterPtr, wakers: &mut Vec<_>| {
            let at = at.to_raw();
            if at == 0 {
                return;
            }
            if at <= now {
                // SAFETY: linked, under the shard lock.
                wakers.extend(unsafe { Waiter::nudge(waiter) });
            } else {
                next = next.min(at);
            }
        };
        for (_, entry) in self.entries.iter() {
            let Some(head) = entry.queue.head() else {
                continue;
            };
            if let Some(holder) = entry.holder {
                due(holder.deadline, head, wakers);
            }
            // SAFETY: under the shard lock; every visited waiter is linked.
            unsafe {
                entry
                    .queue
                    .walk(|waiter, _, _| due(Waiter::until(waiter), waiter, wakers));
            }
        }
        next
    }
}

const NO_DIAGNOSIS: Diagnosis = Diagnosis {
    holder: None,
    held_for: None,
    ahead: 0,
};

#[cfg(feature = "test-util")]
impl<K> ShardState<K> {
    /// Checks every structural invariant of the shard; panics naming the
    /// first one broken.
    pub(crate) fn validate(&self, fairness: Fairness) {
        self.loss.validate();
        for (_, entry) in self.entries.iter() {
            assert!(!entry.is_unused(), "an unused entry stayed in the table");
            let mut count = 0;
            let mut expect_prev = None;
            let mut head_nudged = false;
            // SAFETY: we hold the shard lock (the caller does).
            unsafe {
                entry.queue.walk(|at, prev, state| {
                    assert!(
                        crate::waiter::is_linked_state(state),
                        "a linked waiter is waiting"
                    );
                    assert_eq!(prev, expect_prev, "prev link of a waiter");
                    if count == 0 {
                        head_nudged = crate::waiter::is_nudged_state(state);
                    }
                    expect_prev = Some(at);
                    count += 1;
                });
            }
            assert_eq!(entry.queue.len(), count, "waiter count matches the queue");
            if count > 0 && entry.holder.is_none() {
                assert_eq!(
                    fairness,
                    Fairness::Eventual,
                    "a queue without a holder was not granted"
                );
                assert!(
                    head_nudged,
                    "a free key's head waiter was nudged to take it"
                );
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
