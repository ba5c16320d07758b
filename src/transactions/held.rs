//! The keys a transaction holds: one slot per key with its guard and its
//! re-entry count, found by the table's own hash.
//!
//! The slots are found by the hash the table computed for the key, compared
//! through the guard's `key()` (the table's copy of the key): no second
//! hasher, no copy of held keys. Up to [`LINEAR_MAX`] keys they are found
//! by a scan of the slots comparing their stored hashes (a transaction
//! usually holds a few keys, and a scan of a few beats a hash table; the
//! first [`INLINE`] are kept in place, so a transfer allocates nothing, and
//! an empty set is not scanned at all); past that, a
//! `hashbrown::HashTable` of positions keyed by that same hash indexes
//! them, built at the first lookup that may change the set (keys going in
//! are not indexed one by one: a large `lock_all` that is then committed
//! never builds it; a query of a set without it scans, and past
//! [`UNINDEXED_MAX`] keys it is built as they go in, so that a scan stays
//! short). A slot whose guard is away — a new key being locked, or a held
//! one being upgraded by a pending call — keeps a clone of the key (and its
//! hash) to be compared with in the guard's place, and is
//! *busy*: a second call for that key fails at once
//! ([`TransactionError::InFlight`](crate::TransactionError::InFlight))
//! instead of waiting on its own owner. A call finds its slots again by
//! `(hash, id)`, which runs no user code, so finishing or undoing a call
//! cannot panic halfway.
//!
//! # Invariants
//!
//! - `count` is how many grants of the key the transaction has been given
//!   (re-entries included); it is 0 only while a new key is in flight.
//! - A slot has its guard, or, only while `busy`, the key's clone and hash
//!   in its place (`Body::Away`): exactly one of the two.
//! - User code (`Eq`, `Clone`, `Drop` of keys) runs in a method only before
//!   it changes anything, and nothing is dropped inside: what leaves the set
//!   is returned to the caller, to drop after releasing any lock it holds.
//!   A caller that holds a lock around the set runs only `Eq` in it: it
//!   hands [`HeldSet::begin`] the key's clone, made before locking.

use std::borrow::Borrow;

use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::transactions::error::TransactionError;
use crate::transactions::reach::GuardOps;

/// What a transaction's lock got: the grant's token and mode, how many
/// times the transaction now holds the key, and whether this call took it,
/// re-entered it or upgraded it.
///
/// ```
/// use keylock::{AcquireKind, Mode};
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let mut txn = table.transaction();
/// let first = txn.lock("k", Mode::Shared).await?;
/// assert_eq!((first.kind, first.count), (AcquireKind::New, 1));
/// let again = txn.lock("k", Mode::Shared).await?;
/// assert_eq!((again.kind, again.count, again.token), (AcquireKind::Reentered, 2, first.token));
/// let up = txn.lock("k", Mode::Exclusive).await?;
/// assert_eq!((up.kind, up.count, up.mode), (AcquireKind::Upgraded, 3, Mode::Exclusive));
/// assert!(up.token > first.token);
/// # Ok::<(), keylock::TransactionError<&str>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Acquired {
    /// The token of the transaction's grant of the key (after an upgrade,
    /// the new one).
    pub token: FencingToken,
    /// The mode the transaction now holds the key in.
    pub mode: Mode,
    /// How many times the transaction now holds the key (each lock counts;
    /// [`unlock`](crate::Transaction::unlock) takes one back).
    pub count: usize,
    /// What this call did.
    pub kind: AcquireKind,
}

/// What a transaction's lock did to get its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AcquireKind {
    /// Took a key the transaction did not hold.
    New,
    /// The transaction already held the key in the mode asked or a stronger
    /// one: counted, nothing taken.
    Reentered,
    /// The transaction held the key shared and asked for exclusive: its
    /// grant was upgraded (a new token).
    Upgraded,
}

/// How many keys a set keeps in place, before it allocates.
const INLINE: usize = 2;

/// How many more keys a set makes room for when it first allocates: room
/// for 16 in all, as many as the linear scan covers (PostgreSQL sizes a
/// backend's lock table for 16), so that a transaction of up to 16 keys
/// allocates once and never grows.
const INITIAL_CAPACITY: usize = LINEAR_MAX - INLINE;

/// One held (or in-flight) key; see the module's invariants.
///
/// Kept to seven words (for a key of one word), so that a transaction,
/// which keeps two slots in place, stays small enough to move cheaply
/// (`commit` takes it by value): the hash is the guard's own (the table's
/// hash of the key), or kept beside the key's clone while the guard is
/// away, and the busy mark is the count's top bit.
#[derive(Debug)]
pub(crate) struct Slot<G, K> {
    id: u64,
    /// The count, and [`BUSY`] while a pending call has the slot.
    word: usize,
    body: Body<G, K>,
}

/// A slot's guard, or, while a pending call has it away, the key's clone
/// and hash (exactly one of them: see the module's invariants).
#[derive(Debug)]
enum Body<G, K> {
    Guard(G),
    Away { hash: u64, name: K },
}

/// The busy mark in [`Slot::word`].
const BUSY: usize = 1 << (usize::BITS - 1);

impl<G: GuardOps<Key = K>, K> Slot<G, K> {
    fn is<Q: Eq + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        match &self.body {
            Body::Guard(guard) => guard.key().borrow() == key,
            Body::Away { name, .. } => name.borrow() == key,
        }
    }

    #[inline(always)]
    fn hash(&self) -> u64 {
        match &self.body {
            Body::Guard(guard) => guard.hash(),
            Body::Away { hash, .. } => *hash,
        }
    }

    #[inline]
    pub(crate) fn count(&self) -> usize {
        self.word & !BUSY
    }

    #[inline]
    fn set_count(&mut self, count: usize) {
        debug_assert!(count & BUSY == 0, "a count that fits");
        self.word = (self.word & BUSY) | count;
    }

    #[inline]
    fn busy(&self) -> bool {
        self.word & BUSY != 0
    }

    #[inline]
    fn set_busy(&mut self, busy: bool) {
        self.word = if busy {
            self.word | BUSY
        } else {
            self.word & !BUSY
        };
    }

    #[inline]
    pub(crate) fn guard(&self) -> Option<&G> {
        match &self.body {
            Body::Guard(guard) => Some(guard),
            Body::Away { .. } => None,
        }
    }

    /// Takes the guard out, leaving `name` (a clone of its key) in its
    /// place (the caller saw the guard there).
    fn take_guard(&mut self, name: K) -> G {
        let hash = self.hash();
        match std::mem::replace(&mut self.body, Body::Away { hash, name }) {
            Body::Guard(guard) => guard,
            Body::Away { .. } => unreachable!("the caller saw the guard"),
        }
    }

    /// Puts `guard` in; returns the key's clone that kept its place, if
    /// any. A slot that has a guard already keeps it, and `guard` comes
    /// back.
    fn put_guard(&mut self, guard: G) -> Result<Option<K>, G> {
        if let Body::Guard(_) = self.body {
            return Err(guard);
        }
        match std::mem::replace(&mut self.body, Body::Guard(guard)) {
            Body::Away { name, .. } => Ok(Some(name)),
            Body::Guard(_) => unreachable!("checked above"),
        }
    }

    /// The slot's guard, taken out (the slot drops without releasing it).
    pub(crate) fn into_guard(self) -> Option<G> {
        match self.body {
            Body::Guard(guard) => Some(guard),
            Body::Away { .. } => None,
        }
    }

    /// The key's clone, if the guard is away.
    fn into_name(self) -> Option<K> {
        match self.body {
            Body::Guard(_) => None,
            Body::Away { name, .. } => Some(name),
        }
    }
}

/// A fill of a vacant set built aside; see [`HeldSet::begin_fill`].
pub(crate) struct Fill<G, K> {
    slots: Vec<Slot<G, K>>,
    /// The id of the first slot (the set's next when the fill began).
    first: u64,
}

impl<G, K> Fill<G, K> {
    /// Adds a new key's guard, counted once.
    #[inline(always)]
    pub(crate) fn push(&mut self, guard: G) {
        let id = self.first + self.slots.len() as u64;
        self.slots.push(Slot {
            id,
            word: 1,
            body: Body::Guard(guard),
        });
    }
}

/// What [`HeldSet::find`] found of a requested key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// No slot: lock it on the table, then [`HeldSet::insert`] it.
    Absent,
    /// Held in a mode that covers the request, at this position.
    Covered { at: usize },
    /// Held in a weaker mode, or busy with another call: the claiming
    /// path ([`HeldSet::begin`]) decides.
    Other,
}

/// A call's claim on a key, made by [`HeldSet::begin`].
#[derive(Debug)]
pub(crate) enum Begin<G> {
    /// Held in a mode that covers the request.
    Covered { id: u64, acquired: Acquired },
    /// Held shared, asked exclusive: the guard, to upgrade and give back.
    Upgrade { id: u64, guard: G },
    /// Not held: lock it and give the guard to [`HeldSet::settle`].
    New { id: u64 },
}

/// The key is busy with another call of the transaction.
#[derive(Debug)]
pub(crate) struct Busy;

/// Why [`HeldSet::unlock`] did nothing.
#[derive(Debug)]
pub(crate) enum NotReleased {
    NotHeld,
    Busy,
}

/// The keys a transaction holds; see the module doc.
#[derive(Debug)]
pub(crate) struct HeldSet<G, K> {
    /// The slots, in no particular order; the first [`INLINE`] in place
    /// (a transfer's two keys allocate nothing).
    slots: SmallVec<[Slot<G, K>; INLINE]>,
    /// Positions in `slots` by hash, once there are more than
    /// [`LINEAR_MAX`] of them and a lookup that may change the set asked
    /// ([`index_if_large`](Self::index_if_large)); `None` until then (a
    /// lookup scans). When `Some`, it indexes every slot.
    index: Option<Box<HashTable<usize>>>,
    next_id: u64,
    /// How many slots have a count above zero (32 bits, as `waits`: the
    /// two share a word, keeping a transaction within 256 bytes).
    held: u32,
    /// How many of the transaction's calls are in a wait (counted by the
    /// borrowed form only): more than the one asking means another call,
    /// forgotten while it waited, may hold a grant outside the set.
    pub(crate) waits: u32,
    /// Bumped by every change of the slots but a re-entry's count: a call
    /// that looked at the set, let go of it (an owned transaction's lock)
    /// and comes back to the same version finds what it left.
    version: u64,
}

/// Up to this many keys a set is searched linearly (comparing stored hashes
/// first): a transaction usually holds a few keys, and a scan of a few
/// words costs less than hashing into a table; past it, an index by hash
/// keeps a lookup constant.
const LINEAR_MAX: usize = 16;

/// The most slots a set keeps without an index: past it the index is built
/// as keys go in, so that a query (which takes the set by shared reference
/// and cannot build it) scans at most this many slots, and a loop of
/// queries over a large transaction stays linear.
pub(crate) const UNINDEXED_MAX: usize = 1024;

impl<G, K> Default for HeldSet<G, K> {
    #[inline]
    fn default() -> Self {
        Self {
            slots: SmallVec::new(),
            index: None,
            next_id: 0,
            held: 0,
            waits: 0,
            version: 0,
        }
    }
}

impl<G, K> HeldSet<G, K> {
    /// No slot at all: nothing held, nothing in flight.
    #[inline]
    pub(crate) fn is_vacant(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether a set [`release_checked`] has emptied (no slot, no index)
    /// owns nothing at all: no memory of its own (its slots in place).
    /// Dropping such a set frees nothing. Only where its slots live is
    /// left to ask.
    #[inline]
    pub(crate) fn owns_nothing_released(&self) -> bool {
        debug_assert!(self.slots.is_empty() && self.index.is_none());
        !self.slots.spilled()
    }
}

impl<G: GuardOps<Key = K>, K> HeldSet<G, K> {
    /// The position of the slot with `hash` that `is` accepts.
    #[inline]
    fn position(&self, hash: u64, mut is: impl FnMut(&Slot<G, K>) -> bool) -> Option<usize> {
        match &self.index {
            None => {
                // Without an index (at most `LINEAR_MAX` slots, or an index
                // not built yet): the stored hashes are compared first, the
                // key only on a match.
                self.slots
                    .iter()
                    .position(|slot| slot.hash() == hash && is(slot))
            }
            Some(index) => index.find(hash, |&at| is(&self.slots[at])).copied(),
        }
    }

    /// Adds a slot (no user code runs), written in place on the common
    /// path (see [`write_slot`](Self::write_slot)).
    #[inline(always)]
    fn push(&mut self, id: u64, word: usize, body: Body<G, K>) {
        let at = self.slots.len();
        // The common case, inline: room in place (or already on the heap),
        // and no index to keep (none is made here: see `index_if_large`).
        if self.index.is_none() && (at != INLINE || self.slots.spilled()) && at < UNINDEXED_MAX {
            self.version += 1;
            self.write_slot(id, word, body);
            return;
        }
        self.push_slow(Slot { id, word, body });
    }

    /// A slot past a full set's capacity, out of [`write_slot`]'s path.
    ///
    /// [`write_slot`]: Self::write_slot
    #[cold]
    #[inline(never)]
    fn grow_and_push(&mut self, slot: Slot<G, K>) {
        self.slots.push(slot);
    }

    /// Writes a new slot past the last, in place.
    ///
    /// Not `slots.push(Slot { .. })`: that builds the slot in a stack
    /// temporary with word-sized stores and copies it over at once with
    /// 16-byte loads, each of which straddles two of those stores and so
    /// waits for them to leave the store buffer (a failed store-to-load
    /// forward, about a dozen cycles each). The same stall came back when
    /// the guard was live across the call that grows a full set: the
    /// compiler kept it in a stack temporary for that call's sake and
    /// copied it over the same way. So a full set hands the slot whole to
    /// a cold call, and on the common path nothing is called between the
    /// guard and its place. Measured with `perf` on `txn1` and `txn2` of
    /// `examples/uncontended.rs`, and with `transfer_uncontended` of
    /// `benches/owners.rs` (BENCHMARKS.md).
    #[inline(always)]
    fn write_slot(&mut self, id: u64, word: usize, body: Body<G, K>) {
        let len = self.slots.len();
        if len == self.slots.capacity() {
            // The slot goes to the call whole: the guard is not held
            // across a call on the common path, where it would be
            // spilled to a stack temporary (see above).
            self.grow_and_push(Slot { id, word, body });
            return;
        }
        // SAFETY: the capacity is above `len`, so the place is in bounds of
        // the slots' memory (in place or on the heap) and uninitialized;
        // every field of the slot is written before `set_len` counts it,
        // and nothing between can panic.
        unsafe {
            let slot = self.slots.as_mut_ptr().add(len);
            std::ptr::addr_of_mut!((*slot).id).write(id);
            std::ptr::addr_of_mut!((*slot).word).write(word);
            std::ptr::addr_of_mut!((*slot).body).write(body);
            self.slots.set_len(len + 1);
        }
    }

    /// [`push`](Self::push) past the inline slots, or with the index.
    #[cold]
    #[inline(never)]
    fn push_slow(&mut self, slot: Slot<G, K>) {
        self.version += 1;
        let at = self.slots.len();
        let hash = slot.hash();
        if self.slots.len() == INLINE && !self.slots.spilled() {
            // Past the inline slots: room for the rest of the linear scan's
            // keys at once, not growth a few at a time.
            self.slots.reserve_exact(INITIAL_CAPACITY);
        }
        self.slots.push(slot);
        let slots = &self.slots;
        // Without an index, none is made here (see `index_if_large`) unless
        // the set has grown past what a query may scan.
        match &mut self.index {
            Some(index) => {
                index.insert_unique(hash, at, |&i| slots[i].hash());
            }
            None if slots.len() > UNINDEXED_MAX => self.build_index(),
            None => {}
        }
    }

    /// Indexes a set of more than [`LINEAR_MAX`] slots that has no index
    /// yet: called by every lookup that may change the set, so that a
    /// transaction that goes on with many keys finds each in constant
    /// time.
    #[inline(always)]
    fn index_if_large(&mut self) {
        if self.index.is_none() && self.slots.len() > LINEAR_MAX {
            self.build_index();
        }
    }

    #[cold]
    #[inline(never)]
    fn build_index(&mut self) {
        let slots = &self.slots;
        // Room for as many slots as were made room for: no rehash while
        // more go in.
        let mut index = HashTable::with_capacity(slots.capacity().max(slots.len() * 2));
        for (i, slot) in slots.iter().enumerate() {
            index.insert_unique(slot.hash(), i, |&i| slots[i].hash());
        }
        self.index = Some(Box::new(index));
    }

    /// Removes the slot at `at` (no user code runs; the slot is returned,
    /// to drop later).
    fn remove(&mut self, at: usize) -> Slot<G, K> {
        self.version += 1;
        let last = self.slots.len() - 1;
        if let Some(index) = &mut self.index {
            let slots = &self.slots;
            if let Ok(entry) = index.find_entry(slots[at].hash(), |&i| i == at) {
                entry.remove();
            }
            if at != last {
                // The last slot moves into `at`.
                if let Some(moved) = index.find_mut(slots[last].hash(), |&i| i == last) {
                    *moved = at;
                }
            }
        }
        self.slots.swap_remove(at)
    }
}

impl<G: GuardOps<Key = K>, K: Eq> HeldSet<G, K> {
    /// Whether the transaction holds nothing, as far as a call of the
    /// borrowed form can tell: no key in the set, and no call forgotten in
    /// a wait (whose waiter may since have been granted a key for it).
    pub(crate) fn holds_nothing(&self) -> bool {
        self.held == 0 && self.waits == 0
    }

    /// Whether a waiter may be queued on a key the transaction holds, asked
    /// by the borrowed form's one call in a wait (its own slot is busy, its
    /// key not held yet): a visit to each held key's shard. `true` without
    /// looking past [`LINEAR_MAX`] keys, or if another call is counted in a
    /// wait (one forgotten there: its waiter may have been granted a key
    /// for the transaction that the set does not know of).
    pub(crate) fn is_awaited(&self) -> bool {
        self.waits > 1
            || self.slots.len() > LINEAR_MAX
            || self
                .slots
                .iter()
                .any(|slot| !slot.busy() && slot.guard().is_some_and(G::is_awaited))
    }

    /// How many keys the transaction holds (a key being upgraded counts, a
    /// new key in flight does not).
    pub(crate) fn len(&self) -> usize {
        self.held as usize
    }

    pub(crate) fn get<Q: Eq + ?Sized>(&self, hash: u64, key: &Q) -> Option<&Slot<G, K>>
    where
        K: Borrow<Q>,
    {
        let at = self.position(hash, |slot| slot.is(key))?;
        Some(&self.slots[at]).filter(|slot| slot.count() > 0)
    }

    /// Makes room for `additional` more keys (a `lock_all`).
    pub(crate) fn reserve(&mut self, additional: usize) {
        self.slots.reserve(additional);
        if let Some(index) = &mut self.index {
            let slots = &self.slots;
            index.reserve(additional, |&i| slots[i].hash());
        }
    }

    /// The guards held now (not those a pending call has away).
    pub(crate) fn guards(&self) -> impl Iterator<Item = &G> {
        self.slots.iter().filter_map(Slot::guard)
    }

    /// The set's version (see the field): a fast path looks, takes keys on
    /// the table without holding the set, and puts them in only if the
    /// version is still the one it saw.
    #[inline]
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// What a fast path finds of `key` asked in `mode`, changing nothing
    /// (user code, `Eq`, runs in the search).
    #[inline(always)]
    pub(crate) fn find(&mut self, hash: u64, key: &K, mode: Mode) -> Found {
        // A transaction's first call finds an empty set: no scan.
        if self.slots.is_empty() {
            return Found::Absent;
        }
        self.index_if_large();
        let Some(at) = self.position(hash, |slot| slot.is(key)) else {
            return Found::Absent;
        };
        let slot = &self.slots[at];
        match slot.guard() {
            Some(guard) if !slot.busy() && guard.mode().covers(mode) => Found::Covered { at },
            _ => Found::Other,
        }
    }

    /// Counts one more grant of the covered slot at `at` (found by
    /// [`find`](Self::find) at the current version).
    #[inline]
    pub(crate) fn reenter(&mut self, at: usize) -> Acquired {
        let slot = &mut self.slots[at];
        let count = slot.count() + 1;
        slot.set_count(count);
        let guard = slot.guard().expect("covered: held, not busy");
        Acquired {
            token: guard.token(),
            mode: guard.mode(),
            count,
            kind: AcquireKind::Reentered,
        }
    }

    /// Puts a new key's guard in, counted once (no user code runs).
    #[inline(always)]
    pub(crate) fn insert(&mut self, hash: u64, guard: G) -> Acquired {
        let acquired = Acquired {
            token: guard.token(),
            mode: guard.mode(),
            count: 1,
            kind: AcquireKind::New,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.held += 1;
        debug_assert_eq!(hash, guard.hash());
        self.push(id, 1, Body::Guard(guard));
        acquired
    }

    /// Puts new keys' guards in, each counted once, as [`insert`] one by
    /// one would (no user code runs); returns how many went in. More than
    /// a few, without an index, are written in one pass, the set's
    /// counters set once.
    ///
    /// [`insert`]: Self::insert
    #[inline]
    pub(crate) fn insert_all(&mut self, guards: impl ExactSizeIterator<Item = G>) -> usize {
        let n = guards.len();
        if n <= INLINE || self.index.is_some() || self.slots.len() + n > UNINDEXED_MAX {
            for guard in guards {
                let hash = guard.hash();
                self.insert(hash, guard);
            }
            return n;
        }
        self.insert_many(guards)
    }

    /// [`insert_all`](Self::insert_all) of more than a few, without an
    /// index.
    #[inline(never)]
    fn insert_many(&mut self, guards: impl ExactSizeIterator<Item = G>) -> usize {
        let n = guards.len();
        if self.slots.len() + n > INLINE && !self.slots.spilled() {
            // Past the inline slots: room for the linear scan's keys at
            // least, as `push` makes.
            self.slots.reserve_exact(n.max(LINEAR_MAX));
        }
        let first = self.next_id;
        self.slots
            .extend(guards.zip(first..).map(|(guard, id)| Slot {
                id,
                word: 1,
                body: Body::Guard(guard),
            }));
        self.next_id = first + n as u64;
        // A set cannot have 2^32 slots (56 bytes each: 224 GiB).
        self.held += n as u32;
        self.version += 1;
        n
    }

    /// Makes room for `n` new keys in a vacant set about to be filled
    /// ([`push_new`](Self::push_new)). A set that was indexed and emptied
    /// since keeps its index (a removal never drops it): with no slot, it
    /// indexes nothing, and it goes here, so that the fill, which does not
    /// keep one, leaves none stale (a lookup through it would miss every
    /// key filled in).
    #[inline]
    pub(crate) fn reserve_vacant(&mut self, n: usize) {
        debug_assert!(self.is_vacant());
        self.index = None;
        if n > INLINE && !self.slots.spilled() {
            self.slots.reserve_exact(n.max(LINEAR_MAX));
        }
    }

    /// Puts a new key's guard into a set being filled from vacant, with at
    /// most [`UNINDEXED_MAX`] keys in all (no index to keep), counted once
    /// (no user code runs). The version moves once, when the fill is
    /// [`filled`](Self::filled); an [`unfill`](Self::unfill) leaves the set
    /// as it was.
    #[inline]
    pub(crate) fn push_new(&mut self, guard: G) {
        debug_assert!(self.index.is_none() && self.slots.len() < UNINDEXED_MAX);
        let id = self.next_id;
        self.next_id += 1;
        self.held += 1;
        self.write_slot(id, 1, Body::Guard(guard));
    }

    /// Begins a fill of this vacant set with `n` new keys, more than it
    /// keeps in place (an audit's): the slots are built aside, in a list
    /// of their own with room for all of them, and go into the set whole
    /// ([`put_fill`](Self::put_fill)). A push there is a plain list's,
    /// where one into the set's own slots asks at each step where they
    /// live. Dropped before it is put, the fill releases its guards, in
    /// the order they were pushed, and the set is as it was.
    #[inline]
    pub(crate) fn begin_fill(&self, n: usize) -> Fill<G, K> {
        debug_assert!(self.is_vacant());
        Fill {
            slots: Vec::with_capacity(n.max(LINEAR_MAX)),
            first: self.next_id,
        }
    }

    /// Puts a fill begun on this set (still vacant) into it: its keys are
    /// the set's only ones, each counted once, and the room left is the
    /// set's. The version does not move ([`filled`](Self::filled) moves
    /// it), so that a fill that took nothing leaves the set as it was. An
    /// index kept from before (a set indexed, then emptied) goes, as in
    /// [`reserve_vacant`](Self::reserve_vacant).
    #[inline]
    pub(crate) fn put_fill(&mut self, fill: Fill<G, K>) {
        debug_assert!(self.is_vacant() && fill.first == self.next_id);
        let n = fill.slots.len();
        self.index = None;
        self.next_id = fill.first + n as u64;
        // A set cannot have 2^32 slots (56 bytes each: 224 GiB).
        self.held += n as u32;
        // The fill's list becomes the set's slots as it is (its room is
        // more than the slots kept in place: no copy).
        self.slots = SmallVec::from_vec(fill.slots);
    }

    /// The fill is done: the set has changed.
    #[inline]
    pub(crate) fn filled(&mut self) {
        self.version += 1;
    }

    /// The fill is given up: every guard pushed comes back out, in the
    /// order it went in, and the set is vacant again, at the version it
    /// had (no user code runs; the guards are returned, not dropped).
    pub(crate) fn unfill(&mut self) -> impl Iterator<Item = G> + '_ {
        self.held = 0;
        self.slots.drain(..).filter_map(Slot::into_guard)
    }

    /// A fill kept while its call waited is given up (the call failed, or
    /// was dropped): every guard comes back out and the set is vacant again,
    /// at a new version (no user code runs; the guards are returned).
    pub(crate) fn unfill_all(&mut self) -> impl Iterator<Item = G> + '_ {
        self.version += 1;
        self.unfill()
    }

    /// Claims `key` for a call asking for `mode`: a covered key is counted
    /// at once if `reenter` (else marked busy until the call settles); a
    /// weaker one gives its guard to be upgraded; an absent one gets an
    /// in-flight slot. A slot that needs the key's name takes `name`'s
    /// copy, made by a caller that holds a lock around this call (a key's
    /// `Clone` is user code), or else clones `key` here.
    #[inline]
    pub(crate) fn begin(
        &mut self,
        hash: u64,
        key: &K,
        mode: Mode,
        reenter: bool,
        name: &mut Option<K>,
    ) -> Result<Begin<G>, Busy>
    where
        K: Clone,
    {
        self.index_if_large();
        // User code (`Eq`) runs in the search, before anything changes.
        let Some(at) = self.position(hash, |slot| slot.is(key)) else {
            // User code first: a panicking clone leaves the set as it was.
            let name = name.take().unwrap_or_else(|| key.clone());
            let id = self.next_id;
            self.next_id += 1;
            self.push(id, BUSY, Body::Away { hash, name });
            return Ok(Begin::New { id });
        };
        let slot = &mut self.slots[at];
        let Some(guard) = slot.guard().filter(|_| !slot.busy()) else {
            return Err(Busy);
        };
        if guard.mode().covers(mode) {
            let acquired = Acquired {
                token: guard.token(),
                mode: guard.mode(),
                count: slot.count() + 1,
                kind: AcquireKind::Reentered,
            };
            if reenter {
                slot.set_count(acquired.count);
            } else {
                slot.set_busy(true);
                self.version += 1;
            }
            return Ok(Begin::Covered {
                id: slot.id,
                acquired,
            });
        }
        let name = name.take().unwrap_or_else(|| key.clone());
        slot.set_busy(true);
        self.version += 1;
        let guard = slot.take_guard(name);
        Ok(Begin::Upgrade { id: slot.id, guard })
    }

    /// Ends a call's claim on slot `id` with success: its guard (a new or
    /// upgraded grant; `None` for a covered key) goes back, the count goes
    /// up. Returns what the call got, and the key's clone to drop; if the
    /// slot is gone, the guard comes back instead.
    #[inline]
    pub(crate) fn settle(
        &mut self,
        hash: u64,
        id: u64,
        guard: Option<G>,
        kind: AcquireKind,
    ) -> Result<(Acquired, Option<K>), Option<G>> {
        self.index_if_large();
        let Some(at) = self.position(hash, |slot| slot.id == id) else {
            return Err(guard);
        };
        self.version += 1;
        let slot = &mut self.slots[at];
        let name = match guard {
            Some(guard) => match slot.put_guard(guard) {
                Ok(name) => name,
                // A guard for a slot that has its own: never made.
                Err(guard) => return Err(Some(guard)),
            },
            None => None,
        };
        let Some(held) = slot.guard() else {
            // A new key settled without its guard: not a success after all.
            return Err(None);
        };
        let (token, held_mode) = (held.token(), held.mode());
        let count = slot.count() + 1;
        if count == 1 {
            self.held += 1;
        }
        slot.set_count(count);
        slot.set_busy(false);
        let acquired = Acquired {
            token,
            mode: held_mode,
            count,
            kind,
        };
        Ok((acquired, name))
    }

    /// Ends a call's claim on slot `id` without taking anything: a key held
    /// before gets `guard` back (as the call leaves it) and its count as it
    /// was; a new key's slot goes. Returns the key's clone (for an error, or
    /// to drop) and whatever guard could not be put back (a new key's, or
    /// one whose slot is gone), to drop.
    pub(crate) fn abandon(
        &mut self,
        hash: u64,
        id: u64,
        guard: Option<G>,
    ) -> (Option<K>, Option<G>) {
        self.index_if_large();
        let Some(at) = self.position(hash, |slot| slot.id == id) else {
            return (None, guard);
        };
        if self.slots[at].count() == 0 {
            let slot = self.remove(at);
            return (slot.into_name(), guard);
        }
        self.version += 1;
        let slot = &mut self.slots[at];
        slot.set_busy(false);
        match guard {
            Some(guard) => match slot.put_guard(guard) {
                Ok(name) => (name, None),
                // The slot kept its own guard (a covered key's claim).
                Err(guard) => (None, Some(guard)),
            },
            None if slot.guard().is_some() => (None, None),
            None => {
                // A held key whose guard the call did not give back (a
                // call gives back what it took, so this is not met): the
                // key is not held any more, and its slot goes.
                let slot = self.remove(at);
                self.held -= 1;
                (slot.into_name(), None)
            }
        }
    }

    /// Takes back one grant of `key`: returns the count left and, at zero,
    /// the slot (its guard releases the key when dropped). With `all`, takes
    /// back every grant.
    pub(crate) fn unlock<Q: Eq + ?Sized>(
        &mut self,
        hash: u64,
        key: &Q,
        all: bool,
    ) -> Result<(usize, Option<Slot<G, K>>), NotReleased>
    where
        K: Borrow<Q>,
    {
        self.index_if_large();
        let Some(at) = self.position(hash, |slot| slot.is(key)) else {
            return Err(NotReleased::NotHeld);
        };
        let slot = &mut self.slots[at];
        if slot.busy() {
            return Err(if slot.count() == 0 {
                NotReleased::NotHeld
            } else {
                NotReleased::Busy
            });
        }
        let count = if all { 0 } else { slot.count() - 1 };
        slot.set_count(count);
        if count > 0 {
            return Ok((count, None));
        }
        let slot = self.remove(at);
        self.held -= 1;
        Ok((0, Some(slot)))
    }

    /// Empties the set into the returned one, for the caller to drop
    /// (releasing every key) after unlocking whatever it holds.
    pub(crate) fn take(&mut self) -> Self {
        std::mem::take(self)
    }
}

/// Releases every key of `set`, each in one visit to the table that also
/// says whether its grant still held it (`release_checked`); returns the
/// first that did not, named (its key and token: the caller makes the
/// error, so that a commit's result is built in place). Keys a pending
/// call has away are released by that call. Every key is released even if
/// a clone panics (see `Drop`).
pub(crate) fn release_checked<G, K>(set: &mut HeldSet<G, K>) -> Option<(K, FencingToken)>
where
    G: GuardOps<Key = K>,
    K: Clone,
{
    let mut lost = None;
    set.held = 0;
    set.index = None;
    set.version += 1;
    for slot in set.slots.drain(..) {
        let Some(guard) = slot.into_guard() else {
            continue;
        };
        // A live grant is released in one visit, its key not copied; a lost
        // one comes back, is named (the first only: its grant keeps the
        // table's copy of the key alive) and released as lost.
        if let Err(lost_guard) = guard.release_if_live() {
            if lost.is_none() {
                lost = Some((lost_guard.key().clone(), lost_guard.token()));
            }
            drop(lost_guard);
        }
    }
    lost
}

/// The error of a commit whose [`release_checked`] found `lost`.
#[inline]
pub(crate) fn lost_to_result<K>(
    lost: Option<(K, FencingToken)>,
) -> Result<(), TransactionError<K>> {
    match lost {
        None => Ok(()),
        Some((key, token)) => Err(TransactionError::Expired { key, token }),
    }
}

// No `Drop`: a `Vec` drops every slot even if one's drop panics (a key's
// `Drop`, a waker), so every key is released.

#[cfg(all(test, not(loom)))]
mod tests {
    /// A transaction is moved by value into `commit`, and the caller's copy
    /// is a `memcpy` of the whole handle (it was borrowed by the calls
    /// before, so the move is not elided): up to 256 bytes that copy takes
    /// about 30 instructions, past it about 65 (glibc's AVX copy). Two
    /// slots in place are most of the handle. Sizes of a 64-bit target.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_transaction_of_one_word_keys_is_at_most_256_bytes() {
        type G = crate::table::guard::Guard<'static, u64>;
        assert_eq!(std::mem::size_of::<super::Slot<G, u64>>(), 56);
        assert!(std::mem::size_of::<crate::Transaction<'static, u64>>() <= 256);
    }

    /// The output of a lock future that is ready at its first poll.
    fn ready<F: std::future::Future>(f: F) -> F::Output {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::pin!(f).poll(&mut cx) {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => panic!("uncontended"),
        }
    }

    /// Every way a slot goes in (`write_slot`: in place inline, in place on
    /// the heap, and through the cold growth of a full set), each keeping
    /// its key's count, mode and grant, all released at the commit. Here in
    /// the crate so that the miri step runs the in-place writes too.
    #[test]
    fn a_full_set_grown_by_single_calls_keeps_every_key() {
        use crate::Mode;
        let table = crate::LockTable::<u32>::new();
        let mut txn = table.transaction();
        // Sixteen new keys at once: a set of exactly its capacity, no index.
        let got = ready(txn.lock_all((0..16u32).map(|k| (k, Mode::Exclusive)))).unwrap();
        assert_eq!(got.acquired(), 16);
        // The first finds the set full and grows it; the rest go in place.
        for k in 16..20u32 {
            let acquired = ready(txn.lock(k, Mode::Shared)).unwrap();
            assert_eq!(acquired.count, 1, "key {k}");
            assert_eq!(acquired.mode, Mode::Shared, "key {k}");
            assert_eq!(txn.token(&k), Some(acquired.token), "key {k}");
        }
        // Re-entered, not put in again.
        assert_eq!(ready(txn.lock(17, Mode::Shared)).unwrap().count, 2);
        assert_eq!(txn.len(), 20);
        for k in 0..20u32 {
            let mode = if k < 16 {
                Mode::Exclusive
            } else {
                Mode::Shared
            };
            assert_eq!(txn.mode(&k), Some(mode), "key {k}");
            assert_eq!(txn.count(&k), 1 + usize::from(k == 17), "key {k}");
            assert!(table.is_locked(&k), "key {k}");
        }
        assert_eq!(txn.count(&20), 0);
        txn.commit().unwrap();
        assert!(table.is_empty());
        // Two single keys: in place, inline.
        let mut txn = table.transaction();
        for k in [7u32, 8] {
            assert_eq!(ready(txn.lock(k, Mode::Exclusive)).unwrap().count, 1);
        }
        assert_eq!(txn.len(), 2);
        drop(txn);
        assert!(table.is_empty());
    }
}
