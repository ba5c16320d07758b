//! The wait queue of every key in one shard, and the state machine of a key.
//!
//! A [`ShardState`] lives behind one shard lock. It holds the entry of every
//! key of the shard that is held or awaited, and one slot per waiting future.
//! Everything here runs under that lock and never wakes a waker or drops a
//! key: operations record the wakers to wake and the key to drop in a
//! [`Ctx`], which the caller finishes after unlocking.
//!
//! See `docs/ARCHITECTURE.md` for the state machine of one key. In short:
//!
//! - an entry is in the table while its key has a holder, a waiter, or a
//!   fenced guard that still points at the key;
//! - the holder is a guard or a granted slot whose future has not run yet;
//! - a release, a lapse or a revocation hands the key to the head waiter at
//!   once (FIFO), with a fresh token, and wakes it once;
//! - a lapse is noticed whenever the key is next touched (the head waiter's
//!   timer touches it at the deadline); time is read only when a holder has a
//!   lease.

use std::borrow::Borrow;
use std::task::Waker;
use std::time::{Duration, Instant};

use hashbrown::HashTable;
use slab::Slab;

use crate::clock::{Clock, Now};
use crate::error::LockError;
use crate::key_slot::{KeyPool, KeyPtr};
use crate::stats::Counters;
use crate::token::{FencingToken, TokenCounter};

/// "No slot": the end of a queue.
const NIL: u32 = u32::MAX;

/// Who holds a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldBy {
    /// A guard (the future that was granted has run).
    Guard,
    /// A granted slot whose future has not run yet.
    Slot(u32),
}

/// The current grant of a key.
#[derive(Debug, Clone, Copy)]
struct Holder {
    token: FencingToken,
    /// When the grant loses its authority, if it has a lease.
    deadline: Option<Instant>,
    /// When the grant was made, if the clock was read then.
    since: Option<Instant>,
    by: HeldBy,
}

impl Holder {
    /// Whether the grant still has authority at `now` (read only if needed).
    #[inline]
    fn is_live(&self, now: &mut Now<'_>) -> bool {
        self.deadline.is_none_or(|d| now.get() < d)
    }
}

/// The state of one key that is held, awaited or still pointed at.
#[derive(Debug)]
struct Entry<K> {
    hash: u64,
    key: KeyPtr<K>,
    /// The current grant; `None` once it lapsed or was revoked with nobody to
    /// hand the key to.
    holder: Option<Holder>,
    /// Guards that lost the key (lapsed or revoked) but still exist.
    fenced: u32,
    /// Oldest waiting slot, or `NIL`.
    head: u32,
    /// Newest waiting slot, or `NIL`.
    tail: u32,
    /// Number of slots linked from `head`.
    waiters: u32,
}

impl<K> Entry<K> {
    fn is_unused(&self) -> bool {
        self.holder.is_none() && self.head == NIL && self.fenced == 0
    }
}

/// What a waiter slot knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Linked into its key's queue.
    Waiting,
    /// Unlinked and handed the key with this token; its future has not run.
    Granted(FencingToken),
}

/// One waiting future's registration: its only wake slot.
#[derive(Debug)]
struct Slot {
    waker: Option<Waker>,
    state: SlotState,
    /// The lease its grant will carry.
    lease: Option<Duration>,
    prev: u32,
    next: u32,
}

/// A grant handed to a caller.
#[derive(Debug)]
pub(crate) struct Grant<K> {
    pub(crate) key: KeyPtr<K>,
    pub(crate) token: FencingToken,
    pub(crate) deadline: Option<Instant>,
}

// Derived `Clone`/`Copy` would demand `K: Copy`.
impl<K> Clone for Grant<K> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<K> Copy for Grant<K> {}

/// The outcome of a lock attempt that may wait.
#[derive(Debug)]
pub(crate) enum Attempt<K> {
    /// The key was free and is now the caller's.
    Acquired(Grant<K>),
    /// The key is busy; the caller waits in `slot`, and should be woken by
    /// `wake_at` if it is set (it heads the queue of a leased holder).
    Queued {
        slot: u32,
        key: KeyPtr<K>,
        wake_at: Option<Instant>,
    },
}

/// A waiting slot, polled.
#[derive(Debug)]
pub(crate) enum SlotPoll<K> {
    Granted(Grant<K>),
    Waiting { wake_at: Option<Instant> },
}

/// Why a wait gave up, described at the moment it did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Diagnosis {
    pub(crate) holder: Option<FencingToken>,
    pub(crate) held_for: Option<Duration>,
    pub(crate) ahead: usize,
}

/// Wakers to wake, and wakers to drop, after unlocking.
///
/// One operation wakes at most a granted waiter and the next head (so it can
/// arm its lease timer), twice over when a lapse is settled before the
/// operation itself: four is enough, and a spill vector keeps it correct
/// should that reasoning ever be wrong. It discards at most two wakers (a
/// cancelled slot's, a replaced one).
#[derive(Debug, Default)]
struct Deferred {
    wake: [Option<Waker>; 4],
    len: usize,
    spill: Vec<Waker>,
    discard: [Option<Waker>; 2],
}

impl Deferred {
    #[cold]
    fn run(self) {
        drop(self.discard);
        for waker in self.wake.into_iter().flatten() {
            waker.wake();
        }
        for waker in self.spill {
            waker.wake();
        }
    }
}

/// One operation's context: its view of the time, its counters, and what it
/// leaves to do after unlocking (wakes, a key to drop).
///
/// Most operations defer nothing but the drop of a key, so the wake lists
/// are created only when first needed.
#[derive(Debug)]
pub(crate) struct Ctx<'a, K> {
    now: Now<'a>,
    counters: &'a Counters,
    drop_key: Option<K>,
    deferred: Option<Deferred>,
}

impl<'a, K> Ctx<'a, K> {
    #[inline]
    pub(crate) fn new(clock: &'a Clock, counters: &'a Counters) -> Self {
        Self {
            now: Now::new(clock),
            counters,
            drop_key: None,
            deferred: None,
        }
    }

    /// The time this operation judged by (read now if it was not yet).
    pub(crate) fn now(&mut self) -> Instant {
        self.now.get()
    }

    fn deferred(&mut self) -> &mut Deferred {
        self.deferred.get_or_insert_with(Deferred::default)
    }

    /// Wakes `waker` after unlocking.
    fn wake_later(&mut self, waker: Waker) {
        let deferred = self.deferred();
        if let Some(slot) = deferred.wake.get_mut(deferred.len) {
            *slot = Some(waker);
            deferred.len += 1;
        } else {
            deferred.spill.push(waker);
        }
    }

    /// Keeps a discarded waker to drop (not wake) after unlocking.
    fn drop_waker_later(&mut self, waker: Option<Waker>) {
        let Some(waker) = waker else { return };
        let deferred = self.deferred();
        match deferred.discard.iter_mut().find(|w| w.is_none()) {
            Some(free) => *free = Some(waker),
            // Not reached (see `Deferred`); waking spuriously is harmless,
            // dropping under the lock is not.
            None => deferred.spill.push(waker),
        }
    }

    /// Counts a wait that gave up without queueing.
    pub(crate) fn count_timed_out(&self) {
        self.counters.timed_out();
    }

    /// Keeps a key to drop after unlocking.
    pub(crate) fn drop_later(&mut self, key: K) {
        debug_assert!(self.drop_key.is_none());
        self.drop_key = Some(key);
    }

    /// Drops the key of an emptied entry and wakes the waiters handed the key.
    /// Call only after the shard lock is released.
    #[inline(always)]
    pub(crate) fn finish(self) {
        drop(self.drop_key);
        if let Some(deferred) = self.deferred {
            deferred.run();
        }
    }
}

/// All keys of one shard. Touched only under the shard lock.
pub(crate) struct ShardState<K> {
    entries: HashTable<Entry<K>>,
    slots: Slab<Slot>,
    keys: KeyPool<K>,
    tokens: TokenCounter,
}

impl<K> std::fmt::Debug for ShardState<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardState")
            .field("entries", &self.entries.len())
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// Capacity above which an emptied table or slab gives its memory back.
const SHRINK_ABOVE: usize = 1024;

/// The slots of a shard and its token counter: what queue surgery needs
/// beside one entry.
struct Queues<'s> {
    slots: &'s mut Slab<Slot>,
    tokens: &'s mut TokenCounter,
}

impl Queues<'_> {
    fn link_tail<K>(&mut self, entry: &mut Entry<K>, index: u32) {
        let prev = entry.tail;
        {
            let s = &mut self.slots[index as usize];
            s.state = SlotState::Waiting;
            s.prev = prev;
            s.next = NIL;
        }
        if prev == NIL {
            entry.head = index;
        } else {
            self.slots[prev as usize].next = index;
        }
        entry.tail = index;
        entry.waiters += 1;
    }

    fn unlink<K>(&mut self, entry: &mut Entry<K>, index: u32) {
        let (prev, next) = {
            let s = &self.slots[index as usize];
            (s.prev, s.next)
        };
        if prev == NIL {
            entry.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            entry.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        entry.waiters -= 1;
    }

    /// The key has no holder: hands it to the head waiter, if any, and wakes
    /// it (and the next head, so that it can arm its lease timer).
    fn grant_head<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, K>) {
        debug_assert!(entry.holder.is_none());
        let head = entry.head;
        if head == NIL {
            return;
        }
        self.unlink(entry, head);
        let token = self.tokens.mint();
        let s = &mut self.slots[head as usize];
        s.state = SlotState::Granted(token);
        let (deadline, since) = lease_from(s.lease, &mut ctx.now);
        if let Some(waker) = s.waker.take() {
            ctx.wake_later(waker);
        }
        entry.holder = Some(Holder {
            token,
            deadline,
            since,
            by: HeldBy::Slot(head),
        });
        ctx.counters.handed_off();
        self.wake_head_for_timer(entry, ctx);
    }

    /// The holder's deadline changed or the queue got a new head: wake the
    /// head (keeping its registration) so that it re-arms its timer.
    fn wake_head_for_timer<K>(&mut self, entry: &Entry<K>, ctx: &mut Ctx<'_, K>) {
        let leased = entry.holder.is_some_and(|h| h.deadline.is_some());
        if leased && entry.head != NIL {
            if let Some(waker) = &self.slots[entry.head as usize].waker {
                ctx.wake_later(waker.clone());
            }
        }
    }

    /// Takes the key from its current holder (it lapsed or is revoked): a
    /// guard is fenced, a granted slot goes back to the tail of the queue;
    /// then the key goes to the head waiter.
    fn displace<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, K>) -> Option<Holder> {
        let holder = entry.holder.take()?;
        match holder.by {
            HeldBy::Guard => entry.fenced += 1,
            HeldBy::Slot(index) => self.link_tail(entry, index),
        }
        self.grant_head(entry, ctx);
        Some(holder)
    }

    /// Notices a lapsed lease: the holder is displaced and the key passes on.
    #[inline]
    fn settle<K>(&mut self, entry: &mut Entry<K>, ctx: &mut Ctx<'_, K>) {
        if let Some(holder) = entry.holder {
            if !holder.is_live(&mut ctx.now) {
                self.displace(entry, ctx);
                ctx.counters.expired();
            }
        }
    }

    /// A guard-to-be takes a key whose entry has no holder.
    fn take_free<K>(
        &mut self,
        entry: &mut Entry<K>,
        lease: Option<Duration>,
        ctx: &mut Ctx<'_, K>,
    ) -> Grant<K> {
        debug_assert!(entry.holder.is_none() && entry.head == NIL);
        let token = self.tokens.mint();
        let (deadline, since) = lease_from(lease, &mut ctx.now);
        ctx.counters.acquired(false);
        entry.holder = Some(Holder {
            token,
            deadline,
            since,
            by: HeldBy::Guard,
        });
        Grant {
            key: entry.key,
            token,
            deadline,
        }
    }
}

#[inline]
fn lease_from(lease: Option<Duration>, now: &mut Now<'_>) -> (Option<Instant>, Option<Instant>) {
    match lease {
        Some(lease) => {
            let start = now.for_lease(lease);
            (start.checked_add(lease), Some(start))
        }
        None => (None, None),
    }
}

impl<K> ShardState<K> {
    pub(crate) fn new() -> Self {
        Self {
            entries: HashTable::new(),
            slots: Slab::new(),
            keys: KeyPool::new(),
            tokens: TokenCounter::new(),
        }
    }

    /// Keys held, awaited or pointed at by a fenced guard in this shard.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Splits the shard into the entry of `key` and the queue machinery.
    #[inline]
    fn locate(&mut self, hash: u64, key: KeyPtr<K>) -> Option<(&mut Entry<K>, Queues<'_>)> {
        let entry = self.entries.find_mut(hash, |e| e.key == key)?;
        Some((
            entry,
            Queues {
                slots: &mut self.slots,
                tokens: &mut self.tokens,
            },
        ))
    }

    #[inline]
    fn locate_by<Q>(&mut self, hash: u64, key: &Q) -> Option<(&mut Entry<K>, Queues<'_>)>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let entry = self.entries.find_mut(hash, |e| {
            // SAFETY: `e` is in the table, so its key slot is live.
            let k: &K = unsafe { e.key.get() };
            k.borrow() == key
        })?;
        Some((
            entry,
            Queues {
                slots: &mut self.slots,
                tokens: &mut self.tokens,
            },
        ))
    }

    /// Removes the entry of `key` if nothing uses it any more, leaving its
    /// key to be dropped after unlocking.
    fn remove_if_unused(&mut self, hash: u64, key: KeyPtr<K>, ctx: &mut Ctx<'_, K>) {
        let Ok(found) = self.entries.find_entry(hash, |e| e.key == key) else {
            return;
        };
        if !found.get().is_unused() {
            return;
        }
        let (removed, _) = found.remove();
        // SAFETY: the entry was just removed from the table and nothing uses
        // it: no holder, no waiter, no fenced guard.
        ctx.drop_later(unsafe { self.keys.take(removed.key) });
        self.shrink_if_empty();
    }

    /// Gives back the memory of a table emptied after a burst of keys.
    #[inline]
    fn shrink_if_empty(&mut self) {
        if self.entries.is_empty() && self.entries.capacity() > SHRINK_ABOVE {
            self.entries = HashTable::new();
        }
    }

    /// Whether the key has a live holder now.
    pub(crate) fn is_held<Q>(&mut self, hash: u64, key: &Q, ctx: &mut Ctx<'_, K>) -> bool
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key)
            .and_then(|(e, _)| e.holder)
            .is_some_and(|h| h.is_live(&mut ctx.now))
    }

    /// How many futures wait for the key.
    pub(crate) fn waiters<Q>(&mut self, hash: u64, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        self.locate_by(hash, key)
            .map_or(0, |(e, _)| e.waiters as usize)
    }

    /// Takes the key if it has no entry (one probe); otherwise returns the
    /// key's entry and the queues, and gives the caller's key back.
    #[inline]
    fn claim(
        &mut self,
        hash: u64,
        key: K,
        lease: Option<Duration>,
        ctx: &mut Ctx<'_, K>,
    ) -> Result<Grant<K>, (K, &mut Entry<K>, Queues<'_>)>
    where
        K: Eq,
    {
        let ShardState {
            entries,
            slots,
            keys,
            tokens,
        } = self;
        let found = entries.entry(
            hash,
            // SAFETY: `e` is in the table, so its key slot is live.
            |e| unsafe { e.key.get() } == &key,
            |e| e.hash,
        );
        match found {
            hashbrown::hash_table::Entry::Occupied(entry) => {
                Err((key, entry.into_mut(), Queues { slots, tokens }))
            }
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                let token = tokens.mint();
                let (deadline, since) = lease_from(lease, &mut ctx.now);
                ctx.counters.acquired(false);
                let key = keys.store(key);
                vacant.insert(Entry {
                    hash,
                    key,
                    holder: Some(Holder {
                        token,
                        deadline,
                        since,
                        by: HeldBy::Guard,
                    }),
                    fenced: 0,
                    head: NIL,
                    tail: NIL,
                    waiters: 0,
                });
                Ok(Grant {
                    key,
                    token,
                    deadline,
                })
            }
        }
    }

    /// Takes the key if it has no live holder and no waiter; otherwise gives
    /// the key back.
    #[inline]
    pub(crate) fn try_acquire(
        &mut self,
        hash: u64,
        key: K,
        lease: Option<Duration>,
        ctx: &mut Ctx<'_, K>,
    ) -> Result<Grant<K>, K>
    where
        K: Eq,
    {
        let (key, entry, mut queues) = match self.claim(hash, key, lease, ctx) {
            Ok(grant) => return Ok(grant),
            Err(busy) => busy,
        };
        queues.settle(entry, ctx);
        if entry.holder.is_some() {
            return Err(key);
        }
        let grant = queues.take_free(entry, lease, ctx);
        ctx.drop_later(key);
        Ok(grant)
    }

    /// Takes the key if it is free; otherwise queues a slot woken by `waker`.
    #[inline]
    pub(crate) fn acquire_or_enqueue(
        &mut self,
        hash: u64,
        key: K,
        lease: Option<Duration>,
        waker: &Waker,
        ctx: &mut Ctx<'_, K>,
    ) -> Attempt<K>
    where
        K: Eq,
    {
        let (key, entry, mut queues) = match self.claim(hash, key, lease, ctx) {
            Ok(grant) => return Attempt::Acquired(grant),
            Err(busy) => busy,
        };
        queues.settle(entry, ctx);
        // The caller's key is not needed: the entry's own is used.
        ctx.drop_later(key);
        if entry.holder.is_none() {
            return Attempt::Acquired(queues.take_free(entry, lease, ctx));
        }
        let index = enqueue(&mut queues, entry, lease, waker.clone());
        let wake_at = if entry.head == index {
            entry.holder.and_then(|h| h.deadline)
        } else {
            None
        };
        Attempt::Queued {
            slot: index,
            key: entry.key,
            wake_at,
        }
    }

    /// A waiting future was polled: returns its grant (freeing its slot) once
    /// the key is its, or updates its waker in place.
    #[inline]
    pub(crate) fn poll_slot(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        slot: u32,
        waker: &Waker,
        ctx: &mut Ctx<'_, K>,
    ) -> SlotPoll<K> {
        let (entry, mut queues) = self.locate(hash, key).expect(ENTRY_PRESENT);
        // A grant that lapsed before its future ran is void: settling moves
        // this slot back to the tail and passes the key on.
        queues.settle(entry, ctx);
        let s = &mut queues.slots[slot as usize];
        match s.state {
            SlotState::Granted(token) => {
                let holder = entry.holder.as_mut().expect(ENTRY_PRESENT);
                debug_assert_eq!(holder.by, HeldBy::Slot(slot));
                holder.by = HeldBy::Guard;
                let deadline = holder.deadline;
                self.free_slot(slot);
                ctx.counters.acquired(true);
                SlotPoll::Granted(Grant {
                    key,
                    token,
                    deadline,
                })
            }
            SlotState::Waiting => {
                match &mut s.waker {
                    Some(w) if w.will_wake(waker) => {}
                    w => {
                        let old = w.replace(waker.clone());
                        ctx.drop_waker_later(old);
                    }
                }
                let wake_at = if entry.head == slot {
                    entry.holder.and_then(|h| h.deadline)
                } else {
                    None
                };
                SlotPoll::Waiting { wake_at }
            }
        }
    }

    /// A waiting future was dropped. A grant it had not observed is released
    /// as a guard would release it, so it passes on.
    #[cold]
    pub(crate) fn cancel_slot(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        slot: u32,
        ctx: &mut Ctx<'_, K>,
    ) {
        let (entry, mut queues) = self.locate(hash, key).expect(ENTRY_PRESENT);
        match queues.slots[slot as usize].state {
            SlotState::Granted(_) => {
                entry.holder = None;
                queues.grant_head(entry, ctx);
            }
            SlotState::Waiting => {
                let was_head = entry.head == slot;
                queues.unlink(entry, slot);
                if was_head {
                    queues.wake_head_for_timer(entry, ctx);
                }
            }
        }
        ctx.counters.cancelled();
        let waker = self.free_slot(slot);
        // The waker may belong to a dropped runtime: drop it outside the lock.
        ctx.drop_waker_later(waker);
        self.remove_if_unused(hash, key, ctx);
    }

    /// A waiting future's timeout ran out: it leaves the queue, unless the key
    /// was handed to it first, in which case it takes it.
    #[cold]
    pub(crate) fn time_out_slot(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        slot: u32,
        waker: &Waker,
        ctx: &mut Ctx<'_, K>,
    ) -> Result<Grant<K>, Diagnosis> {
        if let SlotPoll::Granted(grant) = self.poll_slot(hash, key, slot, waker, ctx) {
            return Ok(grant);
        }
        let (entry, mut queues) = self.locate(hash, key).expect(ENTRY_PRESENT);
        let mut ahead = 0;
        let mut at = entry.head;
        while at != slot && at != NIL {
            ahead += 1;
            at = queues.slots[at as usize].next;
        }
        let was_head = entry.head == slot;
        queues.unlink(entry, slot);
        if was_head {
            queues.wake_head_for_timer(entry, ctx);
        }
        let holder = entry.holder;
        let now = ctx.now.get();
        let diagnosis = Diagnosis {
            holder: holder.map(|h| h.token),
            held_for: holder
                .and_then(|h| h.since)
                .map(|s| now.saturating_duration_since(s)),
            ahead,
        };
        ctx.counters.timed_out();
        ctx.drop_waker_later(self.free_slot(slot));
        Err(diagnosis)
    }

    /// Describes why the key would make a caller wait, right now.
    pub(crate) fn diagnose(&mut self, hash: u64, key: &K, ctx: &mut Ctx<'_, K>) -> Diagnosis
    where
        K: Eq,
    {
        let Some((entry, _)) = self.locate_by(hash, key) else {
            return Diagnosis {
                holder: None,
                held_for: None,
                ahead: 0,
            };
        };
        let holder = entry.holder;
        let held_for = match holder.and_then(|h| h.since) {
            Some(since) => Some(ctx.now.get().saturating_duration_since(since)),
            None => None,
        };
        Diagnosis {
            holder: holder.map(|h| h.token),
            held_for,
            ahead: entry.waiters as usize,
        }
    }

    fn free_slot(&mut self, slot: u32) -> Option<Waker> {
        let s = self.slots.remove(slot as usize);
        if self.slots.is_empty() && self.slots.capacity() > SHRINK_ABOVE {
            self.slots = Slab::new();
        }
        s.waker
    }

    /// The holder of `token` lets go of the key: it goes to the head waiter,
    /// or the entry is removed. A guard that had lost the key (its token is
    /// no longer current) frees nothing but its own claim on the entry.
    #[inline]
    pub(crate) fn release(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, K>,
    ) {
        let ShardState {
            entries,
            slots,
            keys,
            tokens,
        } = self;
        let Ok(mut found) = entries.find_entry(hash, |e| e.key == key) else {
            debug_assert!(false, "{ENTRY_PRESENT}");
            return;
        };
        let entry = found.get_mut();
        match entry.holder {
            Some(holder) if holder.token == token => {
                entry.holder = None;
                if entry.head != NIL {
                    Queues { slots, tokens }.grant_head(entry, ctx);
                    return;
                }
            }
            _ => {
                debug_assert!(
                    entry.fenced > 0,
                    "a stale release comes from a fenced guard"
                );
                entry.fenced = entry.fenced.saturating_sub(1);
            }
        }
        if entry.is_unused() {
            let (removed, _) = found.remove();
            // SAFETY: the entry was just removed from the table and nothing
            // uses it: no holder, no waiter, no fenced guard.
            ctx.drop_later(unsafe { keys.take(removed.key) });
            self.shrink_if_empty();
        }
    }

    /// Whether grant `token` still has authority; settles a lapse it finds.
    pub(crate) fn check(
        &mut self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        ctx: &mut Ctx<'_, K>,
    ) -> Result<FencingToken, LockError> {
        let (entry, mut queues) = self.locate(hash, key).expect(ENTRY_PRESENT);
        queues.settle(entry, ctx);
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
        ctx: &mut Ctx<'_, K>,
    ) -> Result<Option<Instant>, LockError> {
        let (entry, mut queues) = self.locate(hash, key).expect(ENTRY_PRESENT);
        queues.settle(entry, ctx);
        let Some(holder) = entry.holder.as_mut().filter(|h| h.token == token) else {
            return Err(LockError::Expired { token });
        };
        let start = ctx.now.for_lease(lease);
        holder.deadline = start.checked_add(lease);
        holder.since.get_or_insert(start);
        let deadline = holder.deadline;
        queues.wake_head_for_timer(entry, ctx);
        Ok(deadline)
    }

    /// Forces the live holder of a key out and passes the key on.
    pub(crate) fn revoke<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        ctx: &mut Ctx<'_, K>,
    ) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: ?Sized + Eq,
    {
        let (entry, mut queues) = self.locate_by(hash, key)?;
        let live = entry.holder.is_some_and(|h| h.is_live(&mut ctx.now));
        if !live {
            queues.settle(entry, ctx);
            return None;
        }
        let revoked = queues.displace(entry, ctx).map(|h| h.token);
        ctx.counters.revoked();
        revoked
    }
}

const ENTRY_PRESENT: &str =
    "keylock: an entry with a holder, waiter or fenced guard is in its shard";

/// Links a new slot at the tail of `entry`'s queue.
#[cold]
fn enqueue<K>(
    queues: &mut Queues<'_>,
    entry: &mut Entry<K>,
    lease: Option<Duration>,
    waker: Waker,
) -> u32 {
    let vacant = queues.slots.vacant_entry();
    let index = u32::try_from(vacant.key())
        .ok()
        .filter(|&i| i != NIL)
        .expect("keylock: more than 2^32 - 1 waiters in one shard");
    vacant.insert(Slot {
        waker: Some(waker),
        state: SlotState::Waiting,
        lease,
        prev: NIL,
        next: NIL,
    });
    queues.link_tail(entry, index);
    index
}

#[cfg(any(test, feature = "test-util"))]
impl<K> ShardState<K> {
    /// Checks every structural invariant of the shard; panics naming the
    /// first one broken.
    pub(crate) fn validate(&self) {
        let mut seen = vec![false; self.slots.capacity()];
        for entry in &self.entries {
            assert!(!entry.is_unused(), "an unused entry stayed in the table");
            let mut count = 0;
            let mut prev = NIL;
            let mut at = entry.head;
            while at != NIL {
                let slot = &self.slots[at as usize];
                assert_eq!(slot.state, SlotState::Waiting, "a linked slot is waiting");
                assert_eq!(slot.prev, prev, "prev link of slot {at}");
                assert!(
                    !std::mem::replace(&mut seen[at as usize], true),
                    "slot {at} linked twice"
                );
                count += 1;
                prev = at;
                at = slot.next;
            }
            assert_eq!(entry.tail, prev, "tail is the last linked slot");
            assert_eq!(entry.waiters, count, "waiter count matches the queue");
            if count > 0 {
                assert!(
                    entry.holder.is_some(),
                    "a queue without a holder was not granted"
                );
            }
            if let Some(Holder {
                by: HeldBy::Slot(index),
                token,
                ..
            }) = entry.holder
            {
                let slot = &self.slots[index as usize];
                assert_eq!(
                    slot.state,
                    SlotState::Granted(token),
                    "granted slot holds the token"
                );
                assert!(
                    !std::mem::replace(&mut seen[index as usize], true),
                    "slot {index} twice"
                );
            }
        }
        for (index, _) in &self.slots {
            assert!(seen[index], "slot {index} is neither queued nor holding");
        }
    }
}

impl<K> Drop for ShardState<K> {
    fn drop(&mut self) {
        // Guards and futures borrow the table, so an entry left now belongs to
        // a guard leaked with `mem::forget`: free its key.
        for entry in self.entries.drain() {
            // SAFETY: nothing can reach the entry any more.
            drop(unsafe { self.keys.take(entry.key) });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::Wake;

    use super::*;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    fn waker() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    struct Harness {
        clock: Clock,
        counters: Counters,
        shard: ShardState<u32>,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                clock: Clock::Monotonic,
                counters: Counters::default(),
                shard: ShardState::new(),
            }
        }

        fn run<R>(&mut self, op: impl FnOnce(&mut ShardState<u32>, &mut Ctx<'_, u32>) -> R) -> R {
            let mut ctx = Ctx::new(&self.clock, &self.counters);
            let r = op(&mut self.shard, &mut ctx);
            ctx.finish();
            self.shard.validate();
            r
        }

        fn attempt(&mut self, key: u32, w: &Waker) -> Attempt<u32> {
            self.run(|s, ctx| s.acquire_or_enqueue(u64::from(key), key, None, w, ctx))
        }
    }

    fn queued(a: Attempt<u32>) -> (u32, KeyPtr<u32>) {
        match a {
            Attempt::Queued { slot, key, wake_at } => {
                assert_eq!(wake_at, None);
                (slot, key)
            }
            Attempt::Acquired(_) => panic!("expected to queue"),
        }
    }

    #[test]
    fn fifo_links_survive_cancelling_the_middle_waiter() {
        let mut h = Harness::new();
        let (_, w) = waker();
        let Attempt::Acquired(first) = h.attempt(7, &w) else {
            panic!()
        };
        let (a, key) = queued(h.attempt(7, &w));
        let (b, _) = queued(h.attempt(7, &w));
        let (c, _) = queued(h.attempt(7, &w));
        h.run(|s, ctx| s.cancel_slot(7, key, b, ctx));
        h.run(|s, ctx| s.release(7, key, first.token, ctx));
        let SlotPoll::Granted(ga) = h.run(|s, ctx| s.poll_slot(7, key, a, &w, ctx)) else {
            panic!("a is next")
        };
        assert!(matches!(
            h.run(|s, ctx| s.poll_slot(7, key, c, &w, ctx)),
            SlotPoll::Waiting { .. }
        ));
        h.run(|s, ctx| s.release(7, key, ga.token, ctx));
        let SlotPoll::Granted(gc) = h.run(|s, ctx| s.poll_slot(7, key, c, &w, ctx)) else {
            panic!("c is next")
        };
        assert!(gc.token > ga.token && ga.token > first.token);
        h.run(|s, ctx| s.release(7, key, gc.token, ctx));
        assert_eq!(h.shard.len(), 0);
    }

    #[test]
    fn release_wakes_only_the_head_once() {
        let mut h = Harness::new();
        let Attempt::Acquired(first) = h.attempt(1, &waker().1) else {
            panic!()
        };
        let (ca, wa) = waker();
        let (cb, wb) = waker();
        let (a, key) = queued(h.attempt(1, &wa));
        let (b, _) = queued(h.attempt(1, &wb));
        h.run(|s, ctx| s.release(1, key, first.token, ctx));
        assert_eq!((ca.0.load(SeqCst), cb.0.load(SeqCst)), (1, 0));
        // Re-polling the granted slot and the waiting one wakes nobody.
        let SlotPoll::Granted(g) = h.run(|s, ctx| s.poll_slot(1, key, a, &wa, ctx)) else {
            panic!()
        };
        h.run(|s, ctx| s.poll_slot(1, key, b, &wb, ctx));
        assert_eq!((ca.0.load(SeqCst), cb.0.load(SeqCst)), (1, 0));
        h.run(|s, ctx| s.cancel_slot(1, key, b, ctx));
        h.run(|s, ctx| s.release(1, key, g.token, ctx));
        assert_eq!(h.shard.len(), 0);
    }

    #[test]
    fn a_cancelled_grant_passes_on_or_frees_the_key() {
        let mut h = Harness::new();
        let (_, w) = waker();
        let Attempt::Acquired(first) = h.attempt(3, &w) else {
            panic!()
        };
        let (a, key) = queued(h.attempt(3, &w));
        let (b, _) = queued(h.attempt(3, &w));
        h.run(|s, ctx| s.release(3, key, first.token, ctx));
        h.run(|s, ctx| s.cancel_slot(3, key, a, ctx)); // granted, never observed
        let SlotPoll::Granted(gb) = h.run(|s, ctx| s.poll_slot(3, key, b, &w, ctx)) else {
            panic!("the grant passed to b")
        };
        let (c, _) = queued(h.attempt(3, &w));
        h.run(|s, ctx| s.release(3, key, gb.token, ctx));
        h.run(|s, ctx| s.cancel_slot(3, key, c, ctx));
        assert_eq!(h.shard.len(), 0, "nobody left: the key is freed");
        assert_eq!(h.counters_snapshot().cancelled, 2);
    }

    #[test]
    fn a_stale_release_frees_nothing() {
        let mut h = Harness::new();
        let (_, w) = waker();
        let Attempt::Acquired(first) = h.attempt(9, &w) else {
            panic!()
        };
        let revoked = h.run(|s, ctx| s.revoke(9, &9, ctx));
        assert_eq!(revoked, Some(first.token));
        let Attempt::Acquired(second) = h.attempt(9, &w) else {
            panic!("a revoked key with no waiter is free")
        };
        h.run(|s, ctx| s.release(9, first.key, first.token, ctx));
        assert!(
            h.run(|s, ctx| s.is_held(9, &9, ctx)),
            "the successor still holds it"
        );
        h.run(|s, ctx| s.release(9, second.key, second.token, ctx));
        assert_eq!(h.shard.len(), 0);
    }

    impl Harness {
        fn counters_snapshot(&self) -> crate::Stats {
            let mut stats = crate::Stats::default();
            self.counters.add_to(&mut stats);
            stats
        }
    }
}
