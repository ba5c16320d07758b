//! The wait queue of every key in one shard, and the state machine of a key.
//!
//! A [`ShardState`] lives behind one shard lock. It holds the entry of every
//! key of the shard that is held or awaited, and one slot per waiting future.
//! Everything here runs under that lock and never wakes a waker or drops a
//! key: operations return the [`Waker`] to wake and the key to drop, and the
//! caller does both after unlocking.
//!
//! # The state machine of one key
//!
//! | state          | in the table | holder                         | queue    |
//! |----------------|--------------|--------------------------------|----------|
//! | idle           | no           | -                              | -        |
//! | held           | yes          | a guard                        | any      |
//! | granted        | yes          | a waiter slot that has not run | any      |
//!
//! - idle → held: a lock attempt finds no entry and inserts one.
//! - held/granted + lock attempt: the attempt is queued at the tail (FIFO).
//! - held → granted: the guard releases while a waiter is queued; the head
//!   waiter is unlinked, marked granted with a fresh token, and its waker is
//!   returned to be woken once.
//! - held → idle: the guard releases with no waiter; the entry is removed.
//! - granted → held: the granted waiter is polled and turns into a guard.
//! - granted → granted/idle: the granted waiter is dropped before it ran; it
//!   releases exactly as a guard would, so the grant passes on.
//! - a waiting slot dropped: it is unlinked; the key's state does not change.
//!
//! An entry is in the table exactly while the key has a holder or a waiter,
//! so an idle key occupies no memory.

use std::task::Waker;

use hashbrown::HashTable;
use slab::Slab;

use crate::key_slot::{KeyPool, KeyPtr};
use crate::token::{FencingToken, TokenCounter};

/// "No slot": the end of a queue.
const NIL: u32 = u32::MAX;

/// The state of one key that is held or awaited.
#[derive(Debug)]
struct Entry<K> {
    hash: u64,
    key: KeyPtr<K>,
    /// The token of the current grant, held by a guard or by a granted slot.
    token: FencingToken,
    /// Oldest waiting slot, or `NIL`.
    head: u32,
    /// Newest waiting slot, or `NIL`.
    tail: u32,
    /// Number of slots linked from `head`.
    waiters: u32,
}

/// What a waiter slot knows.
#[derive(Debug)]
enum SlotState {
    /// Linked into its key's queue.
    Waiting,
    /// Unlinked and handed the key with this token; its future has not run yet.
    Granted(FencingToken),
}

/// One waiting future's registration: its only wake slot.
#[derive(Debug)]
struct Slot {
    waker: Option<Waker>,
    state: SlotState,
    prev: u32,
    next: u32,
}

/// A grant: the key's stable address and the token of the grant.
#[derive(Debug)]
pub(crate) struct Grant<K> {
    pub(crate) key: KeyPtr<K>,
    pub(crate) token: FencingToken,
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
    /// The key was free and is now held by the caller.
    Acquired(Grant<K>),
    /// The key is busy; the caller waits in `slot`. `duplicate` is the key the
    /// caller passed, not needed now that the entry's own key is used; drop it
    /// after unlocking.
    Queued {
        slot: u32,
        key: KeyPtr<K>,
        duplicate: K,
    },
}

/// What a release leaves the caller to do after unlocking.
#[derive(Debug)]
#[must_use = "wake the waker and drop the key after unlocking"]
pub(crate) struct Released<K> {
    /// The waiter that was handed the key.
    pub(crate) wake: Option<Waker>,
    /// The key of an entry that went idle, to be dropped outside the lock.
    pub(crate) key: Option<K>,
}

impl<K> Released<K> {
    /// Whether the key went to a waiter.
    pub(crate) fn handed_off(&self) -> bool {
        self.wake.is_some()
    }

    /// Wakes and drops; call only after the shard lock is released.
    #[inline]
    pub(crate) fn finish(self) {
        drop(self.key);
        if let Some(waker) = self.wake {
            waker.wake();
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

impl<K> ShardState<K> {
    pub(crate) fn new() -> Self {
        Self {
            entries: HashTable::new(),
            slots: Slab::new(),
            keys: KeyPool::new(),
            tokens: TokenCounter::new(),
        }
    }

    /// Keys held or awaited in this shard.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Finds a key's entry by a key the caller owns or borrows.
    fn find_by<Q: ?Sized + Eq>(&self, hash: u64, key: &Q) -> Option<&Entry<K>>
    where
        K: std::borrow::Borrow<Q>,
    {
        self.entries.find(hash, |e| {
            // SAFETY: `e` is in the table, so its key slot is live.
            let k: &K = unsafe { e.key.get() };
            k.borrow() == key
        })
    }

    fn entry_mut(&mut self, hash: u64, key: KeyPtr<K>) -> &mut Entry<K> {
        self.entries
            .find_mut(hash, |e| e.key == key)
            .expect("keylock: an entry with a holder or waiter is always in its shard")
    }

    /// Whether the key has a holder (a guard or a granted waiter).
    pub(crate) fn is_held<Q: ?Sized + Eq>(&self, hash: u64, key: &Q) -> bool
    where
        K: std::borrow::Borrow<Q>,
    {
        self.find_by(hash, key).is_some()
    }

    /// How many futures wait for the key.
    pub(crate) fn waiters<Q: ?Sized + Eq>(&self, hash: u64, key: &Q) -> usize
    where
        K: std::borrow::Borrow<Q>,
    {
        self.find_by(hash, key).map_or(0, |e| e.waiters as usize)
    }

    /// Takes the key if it is idle; otherwise gives the key back.
    #[inline]
    pub(crate) fn try_acquire(&mut self, hash: u64, key: K) -> Result<Grant<K>, K>
    where
        K: Eq,
    {
        if self.find_by(hash, &key).is_some() {
            return Err(key);
        }
        Ok(self.insert(hash, key))
    }

    /// Takes the key if it is idle; otherwise queues a slot woken by `waker`.
    #[inline]
    pub(crate) fn acquire_or_enqueue(&mut self, hash: u64, key: K, waker: &Waker) -> Attempt<K>
    where
        K: Eq,
    {
        let found = self.entries.find(hash, |e| {
            // SAFETY: `e` is in the table, so its key slot is live.
            unsafe { e.key.get() == &key }
        });
        match found {
            None => Attempt::Acquired(self.insert(hash, key)),
            Some(entry) => {
                let entry_key = entry.key;
                let slot = self.enqueue(hash, entry_key, waker.clone());
                Attempt::Queued {
                    slot,
                    key: entry_key,
                    duplicate: key,
                }
            }
        }
    }

    fn insert(&mut self, hash: u64, key: K) -> Grant<K> {
        let token = self.tokens.mint();
        let key = self.keys.store(key);
        self.entries.insert_unique(
            hash,
            Entry {
                hash,
                key,
                token,
                head: NIL,
                tail: NIL,
                waiters: 0,
            },
            |e| e.hash,
        );
        Grant { key, token }
    }

    #[cold]
    fn enqueue(&mut self, hash: u64, key: KeyPtr<K>, waker: Waker) -> u32 {
        let vacant = self.slots.vacant_entry();
        let index = u32::try_from(vacant.key())
            .ok()
            .filter(|&i| i != NIL)
            .expect("keylock: more than 2^32 - 1 waiters in one shard");
        let entry = self
            .entries
            .find_mut(hash, |e| e.key == key)
            .expect("keylock: the entry being queued on is present");
        let prev = entry.tail;
        vacant.insert(Slot {
            waker: Some(waker),
            state: SlotState::Waiting,
            prev,
            next: NIL,
        });
        entry.tail = index;
        if prev == NIL {
            entry.head = index;
        }
        entry.waiters += 1;
        if prev != NIL {
            self.slots[prev as usize].next = index;
        }
        index
    }

    /// A waiting future was polled: returns its grant token (and frees its
    /// slot) once the key was handed to it, or updates its waker in place.
    #[inline]
    pub(crate) fn poll_slot(&mut self, slot: u32, waker: &Waker) -> Option<FencingToken> {
        let s = &mut self.slots[slot as usize];
        match s.state {
            SlotState::Granted(token) => {
                self.free_slot(slot);
                Some(token)
            }
            SlotState::Waiting => {
                match &mut s.waker {
                    Some(w) if w.will_wake(waker) => {}
                    w => *w = Some(waker.clone()),
                }
                None
            }
        }
    }

    /// A waiting future was dropped. A granted but unobserved grant is
    /// released as a guard would release it, so it passes on.
    #[cold]
    pub(crate) fn cancel_slot(&mut self, hash: u64, key: KeyPtr<K>, slot: u32) -> Released<K> {
        match self.slots[slot as usize].state {
            SlotState::Granted(token) => {
                self.free_slot(slot);
                self.release(hash, key, token)
            }
            SlotState::Waiting => {
                self.unlink(hash, key, slot);
                // The waker may belong to a dropped runtime: drop it outside
                // the lock, like every other piece of foreign code.
                let wake = self.free_slot(slot);
                drop(wake);
                Released {
                    wake: None,
                    key: None,
                }
            }
        }
    }

    fn free_slot(&mut self, slot: u32) -> Option<Waker> {
        let s = self.slots.remove(slot as usize);
        if self.slots.is_empty() && self.slots.capacity() > SHRINK_ABOVE {
            self.slots = Slab::new();
        }
        s.waker
    }

    fn unlink(&mut self, hash: u64, key: KeyPtr<K>, slot: u32) {
        let (prev, next) = {
            let s = &self.slots[slot as usize];
            (s.prev, s.next)
        };
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        let entry = self.entry_mut(hash, key);
        if entry.head == slot {
            entry.head = next;
        }
        if entry.tail == slot {
            entry.tail = prev;
        }
        entry.waiters -= 1;
    }

    /// The holder of `token` lets go of the key: the head waiter is granted it,
    /// or the entry is removed. A token that is no longer the key's current
    /// grant releases nothing.
    #[inline]
    pub(crate) fn release(&mut self, hash: u64, key: KeyPtr<K>, token: FencingToken) -> Released<K> {
        let Ok(found) = self.entries.find_entry(hash, |e| e.key == key) else {
            return Released {
                wake: None,
                key: None,
            };
        };
        let entry = found.get();
        if entry.token != token {
            return Released {
                wake: None,
                key: None,
            };
        }
        let head = entry.head;
        if head == NIL {
            let (removed, _) = found.remove();
            // SAFETY: the entry was just removed from the table and its only
            // holder is the caller, which is releasing it: nobody reads the
            // slot again.
            let key = unsafe { self.keys.take(removed.key) };
            if self.entries.is_empty() && self.entries.capacity() > SHRINK_ABOVE {
                self.entries = HashTable::new();
            }
            return Released {
                wake: None,
                key: Some(key),
            };
        }
        self.hand_off(hash, key, head)
    }

    #[cold]
    fn hand_off(&mut self, hash: u64, key: KeyPtr<K>, head: u32) -> Released<K> {
        let token = self.tokens.mint();
        let s = &mut self.slots[head as usize];
        let next = s.next;
        s.state = SlotState::Granted(token);
        s.prev = NIL;
        s.next = NIL;
        let wake = s.waker.take();
        if next != NIL {
            self.slots[next as usize].prev = NIL;
        }
        let entry = self.entry_mut(hash, key);
        entry.token = token;
        entry.head = next;
        if next == NIL {
            entry.tail = NIL;
        }
        entry.waiters -= 1;
        Released { wake, key: None }
    }
}

impl<K> Drop for ShardState<K> {
    fn drop(&mut self) {
        // Guards and futures borrow the table, so an entry left now belongs to
        // a guard that was leaked with `mem::forget`: free its key.
        for entry in self.entries.drain() {
            // SAFETY: nothing can reach the entry any more.
            drop(unsafe { self.keys.take(entry.key) });
        }
    }
}
