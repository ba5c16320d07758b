//! The hash table of one shard's entries: open addressing, linear probing,
//! each value stored beside its full 64-bit hash in a single array of slots.
//!
//! It exists because the uncontended lock path probes the table right after
//! taking the shard's spin lock, and a measured prototype found that
//! `hashbrown`'s chain of dependent loads (control bytes, then the bucket)
//! serialises behind the lock's atomic: 34 ns for a lock-and-release cycle
//! against 15 ns with a small linear-probing table like this one.
//!
//! The map never calls user code on its own. The caller passes the hash and
//! an equality closure, which is called only on a full-hash match; growing
//! and shrinking rehash from the stored hashes. Deletion shifts the following
//! entries back (no tombstones), and the table shrinks with hysteresis once
//! a burst of keys is gone, so an idle shard holds a few slots, not the high
//! water mark.

use std::fmt;

/// Slots of the smallest allocated table, and the floor a table shrinks to.
const MIN_SLOTS: usize = 8;

/// The maximum load, in eighths of the slots: a table of `n` slots holds at
/// most `n * MAX_LOAD_EIGHTHS / 8` values before it doubles. Measured with
/// the cycle of `benches/key_map.rs` at loads from 4/8 to 7/8: small tables
/// run the same at any of them, but a table of a few thousand keys near a
/// load of 3/4 takes twice as long per cycle as at 1/2 (long probes for
/// absent keys, long backward shifts).
const MAX_LOAD_EIGHTHS: usize = 4;

/// A table never shrinks below this many slots (4 KiB of entries in a shard
/// of the lock table): a shard whose live set wobbles around a few dozen
/// keys never reallocates, and what a storm leaves behind is this small.
const KEEP_SLOTS: usize = 64;

/// A table larger than [`KEEP_SLOTS`] shrinks once fewer than one slot in
/// `SHRINK_BELOW` is in use, ...
const SHRINK_BELOW: usize = 8;

/// ... to the smallest size (at least [`KEEP_SLOTS`]) at which at most one
/// slot in `SHRINK_TO` is in use. Between `1 / SHRINK_TO` and the maximum
/// load lie enough inserts to pay for the next reallocation, and between half
/// the maximum load (just after doubling) and `1 / SHRINK_BELOW` enough
/// removals: no workload makes the table reallocate more than once every
/// `O(slots)` operations.
const SHRINK_TO: usize = 4;

// The hysteresis: a shrunk table is below the maximum load, and a table just
// doubled is above the load that shrinks it.
const _: () = assert!(SHRINK_TO * MAX_LOAD_EIGHTHS > 8 && SHRINK_BELOW * MAX_LOAD_EIGHTHS > 16);

/// How many values a table of `slots` slots holds before it grows.
#[inline]
const fn max_len(slots: usize) -> usize {
    slots / 8 * MAX_LOAD_EIGHTHS
}

/// One slot: a value and its hash, or empty (`value` is `None`; the hash of
/// an empty slot is meaningless).
struct Slot<V> {
    hash: u64,
    value: Option<V>,
}

impl<V> Slot<V> {
    const EMPTY: Self = Self {
        hash: 0,
        value: None,
    };
}

/// A hash table from a caller-supplied 64-bit hash to values `V`.
///
/// The slot count is zero or a power of two of at least [`MIN_SLOTS`], and
/// at least one slot is always empty, so every probe ends. A value sits at
/// the first slot at or after `hash & mask` (cyclically), with no empty slot
/// between: probing stops at the first empty slot.
pub(crate) struct KeyMap<V> {
    slots: Vec<Slot<V>>,
    len: usize,
    /// `len` at which an insert first doubles the table ([`max_len`] of the
    /// slot count, kept so that an insert compares one word).
    grow_at: usize,
    /// `len` below which a remove shrinks the table (zero: it never does at
    /// this size), kept for the same reason.
    shrink_at: usize,
    /// Bumped by every structural change, to catch stale indices in debug
    /// builds.
    #[cfg(debug_assertions)]
    stamp: u32,
    /// Reallocations so far (growing or shrinking), for the tests.
    #[cfg(test)]
    reallocs: usize,
}

/// The position of a value in a [`KeyMap`].
///
/// It is valid until the next insert or remove on that map (either may move
/// values); using it afterwards is a logic error, caught in debug builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Index {
    slot: usize,
    #[cfg(debug_assertions)]
    stamp: u32,
}

/// The empty slot where an absent value goes, found by
/// [`KeyMap::find_or_vacant`] with room already made for the insert.
///
/// Insert with [`Vacant::insert`] into the same map, before any other insert
/// or remove on it (a logic error otherwise, caught in debug builds).
#[derive(Debug)]
#[must_use = "a vacant slot does nothing unless a value is inserted"]
pub(crate) struct Vacant {
    slot: usize,
    hash: u64,
    #[cfg(debug_assertions)]
    stamp: u32,
}

impl<V> fmt::Debug for KeyMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyMap")
            .field("len", &self.len)
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl<V> Default for KeyMap<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> KeyMap<V> {
    /// An empty map; allocates nothing until the first insert.
    pub(crate) const fn new() -> Self {
        Self {
            slots: Vec::new(),
            len: 0,
            grow_at: 0,
            shrink_at: 0,
            #[cfg(debug_assertions)]
            stamp: 0,
            #[cfg(test)]
            reallocs: 0,
        }
    }

    /// Number of values.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the map holds no value.
    #[inline]
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many values the map holds before it reallocates to grow.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.grow_at
    }

    #[inline]
    fn index(&self, slot: usize) -> Index {
        Index {
            slot,
            #[cfg(debug_assertions)]
            stamp: self.stamp,
        }
    }

    #[inline]
    fn changed(&mut self) {
        #[cfg(debug_assertions)]
        {
            self.stamp = self.stamp.wrapping_add(1);
        }
    }

    /// Probes for `hash`: `Ok(slot)` of the value matching `eq`, or
    /// `Err(slot)` of the empty slot that ends the probe (any value when the
    /// map has no slots). Mutates nothing, so a panic in `eq` leaves the map
    /// as it was.
    #[inline]
    fn probe(&self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Result<usize, usize> {
        // With no slots the mask is all ones and `get` fails at once.
        let mask = self.slots.len().wrapping_sub(1);
        let mut i = hash as usize & mask;
        loop {
            let Some(slot) = self.slots.get(i) else {
                return Err(i);
            };
            match &slot.value {
                Some(value) => {
                    if slot.hash == hash && eq(value) {
                        return Ok(i);
                    }
                }
                None => return Err(i),
            }
            i = (i + 1) & mask;
        }
    }

    /// Finds the value of `hash` for which `eq` holds. `eq` is called only on
    /// values stored with exactly this hash.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<Index> {
        self.probe(hash, eq).ok().map(|slot| self.index(slot))
    }

    /// Finds the value of `hash` for which `eq` holds, or else the slot where
    /// it goes, making room first: [`Vacant::insert`] then neither probes
    /// again nor reallocates. If `eq` panics the map is left untouched.
    #[inline]
    pub(crate) fn find_or_vacant(
        &mut self,
        hash: u64,
        eq: impl FnMut(&V) -> bool,
    ) -> Result<Index, Vacant> {
        match self.probe(hash, eq) {
            Ok(slot) => Ok(self.index(slot)),
            Err(mut slot) => {
                if self.len >= self.grow_at {
                    // Rare (amortised over the inserts that filled the
                    // table): the slot found is gone with the old array, so
                    // find the new one, by hash alone, as the value is absent.
                    self.resize(self.grown_slots());
                    slot = self.empty_slot(hash);
                }
                Err(Vacant {
                    slot,
                    hash,
                    #[cfg(debug_assertions)]
                    stamp: self.stamp,
                })
            }
        }
    }

    /// The value at `index`.
    ///
    /// # Panics
    ///
    /// If `index` is stale and its slot is now empty or gone.
    #[inline]
    pub(crate) fn get(&self, index: Index) -> &V {
        #[cfg(debug_assertions)]
        debug_assert_eq!(index.stamp, self.stamp, "stale KeyMap index");
        self.slots[index.slot]
            .value
            .as_ref()
            .expect("stale KeyMap index")
    }

    /// The value at `index`, mutably.
    ///
    /// # Panics
    ///
    /// If `index` is stale and its slot is now empty or gone.
    ///
    /// Inline always: a few instructions, on the handoff's path twice (the
    /// wait's enqueue and the release's handoff), where a call cost more
    /// than its body.
    #[inline(always)]
    pub(crate) fn get_mut(&mut self, index: Index) -> &mut V {
        #[cfg(debug_assertions)]
        debug_assert_eq!(index.stamp, self.stamp, "stale KeyMap index");
        self.slots[index.slot]
            .value
            .as_mut()
            .expect("stale KeyMap index")
    }

    /// Finds the value of `hash` for which `eq` holds and removes it if
    /// `take` says so, in one probe: `Ok(value)` removed (as by
    /// [`remove`](Self::remove)), `Err(Some(index))` found and kept (`take`
    /// may have changed it), `Err(None)` absent. `eq` is called only on
    /// values stored with exactly this hash.
    #[inline(always)]
    pub(crate) fn remove_if(
        &mut self,
        hash: u64,
        eq: impl FnMut(&V) -> bool,
        take: impl FnOnce(&mut V) -> bool,
    ) -> Result<V, Option<Index>> {
        // `probe`, holding on to the slot it finds (no second bounds check).
        let mut eq = eq;
        let mask = self.slots.len().wrapping_sub(1);
        let mut i = hash as usize & mask;
        let value = loop {
            let Some(slot) = self.slots.get_mut(i) else {
                return Err(None);
            };
            let found = match &mut slot.value {
                Some(value) => slot.hash == hash && eq(value),
                None => return Err(None),
            };
            if found {
                if !slot.value.as_mut().is_some_and(take) {
                    return Err(Some(self.index(i)));
                }
                break slot.value.take();
            }
            i = (i + 1) & mask;
        };
        let value = value.expect("found");
        self.close_hole(i);
        Ok(value)
    }

    /// Removes the value at `index` and returns it. The entries after it
    /// shift back into its slot where they may (no tombstone is left), then
    /// the table shrinks if it is mostly empty.
    ///
    /// # Panics
    ///
    /// If `index` is stale and its slot is now empty or gone.
    #[inline(always)]
    pub(crate) fn remove(&mut self, index: Index) -> V {
        #[cfg(debug_assertions)]
        debug_assert_eq!(index.stamp, self.stamp, "stale KeyMap index");
        let value = self.slots[index.slot]
            .value
            .take()
            .expect("stale KeyMap index");
        self.close_hole(index.slot);
        value
    }

    /// After the value at `hole` was taken out: the entries after it shift
    /// back where they may, then the table shrinks if it is mostly empty.
    #[inline(always)]
    fn close_hole(&mut self, hole: usize) {
        let mut hole = hole;
        self.len -= 1;
        self.changed();
        let mask = self.slots.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let slot = &self.slots[i];
            if slot.value.is_none() {
                break;
            }
            // The value at `i` may move back to the hole if the hole lies
            // between its home slot and `i` (cyclically): then no empty slot
            // comes between its home and its new place.
            let home = slot.hash as usize & mask;
            if i.wrapping_sub(home) & mask >= i.wrapping_sub(hole) & mask {
                self.slots.swap(hole, i);
                hole = i;
            }
        }
        if self.len < self.shrink_at {
            self.shrink();
        }
    }

    #[cold]
    #[inline(never)]
    fn shrink(&mut self) {
        self.resize(Self::shrunk_slots(self.len));
    }

    /// Every value with its hash, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> {
        self.slots
            .iter()
            .filter_map(|slot| slot.value.as_ref().map(|value| (slot.hash, value)))
    }

    /// Every value with its hash, mutable, in no particular order.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut V)> {
        self.slots
            .iter_mut()
            .filter_map(|slot| slot.value.as_mut().map(|value| (slot.hash, value)))
    }

    /// Takes every value out, leaving the map empty with no allocation; the
    /// values not consumed are dropped with the iterator.
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = V> {
        let slots = std::mem::take(&mut self.slots);
        self.len = 0;
        self.set_thresholds();
        self.changed();
        slots.into_iter().filter_map(|slot| slot.value)
    }

    /// Sets `grow_at` and `shrink_at` for the current slot count.
    fn set_thresholds(&mut self) {
        let slots = self.slots.len();
        self.grow_at = max_len(slots);
        self.shrink_at = if slots > KEEP_SLOTS {
            slots / SHRINK_BELOW
        } else {
            0
        };
    }

    /// The slot count after doubling (or the first allocation).
    fn grown_slots(&self) -> usize {
        match self.slots.len() {
            0 => MIN_SLOTS,
            n => n.checked_mul(2).expect("KeyMap capacity overflow"),
        }
    }

    /// The slot count a table of `len` values shrinks to.
    fn shrunk_slots(len: usize) -> usize {
        (len * SHRINK_TO).next_power_of_two().max(KEEP_SLOTS)
    }

    /// The first empty slot from the home of `hash` on. The table must have
    /// an empty slot.
    fn empty_slot(&self, hash: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = hash as usize & mask;
        while self.slots[i].value.is_some() {
            i = (i + 1) & mask;
        }
        i
    }

    /// Moves every value into a fresh array of `slots` slots, using the
    /// stored hashes only.
    #[cold]
    #[inline(never)]
    fn resize(&mut self, slots: usize) {
        debug_assert!(slots.is_power_of_two() && slots >= MIN_SLOTS);
        debug_assert!(self.len <= max_len(slots));
        let mut fresh = Vec::with_capacity(slots);
        fresh.resize_with(slots, || Slot::EMPTY);
        let old = std::mem::replace(&mut self.slots, fresh);
        for slot in old {
            if slot.value.is_some() {
                let i = self.empty_slot(slot.hash);
                self.slots[i] = slot;
            }
        }
        self.set_thresholds();
        self.changed();
        #[cfg(test)]
        {
            self.reallocs += 1;
        }
    }
}

impl Vacant {
    /// Inserts `value` in the slot found, without probing or reallocating,
    /// and returns its index.
    ///
    /// # Panics
    ///
    /// In debug builds, if `map` is not the map that found the slot, or was
    /// changed since.
    ///
    /// Always inline: a few stores, on the path of every free key's grant
    /// (the compiler otherwise calls it from large callers, moving the
    /// entry through memory).
    #[inline(always)]
    pub(crate) fn insert<V>(self, map: &mut KeyMap<V>, value: V) -> Index {
        #[cfg(debug_assertions)]
        debug_assert_eq!(self.stamp, map.stamp, "stale KeyMap vacant slot");
        let slot = &mut map.slots[self.slot];
        slot.hash = self.hash;
        // Empty, unless the caller broke the contract above: then the value
        // there is leaked (not dropped: no code runs), a logic error caught
        // in debug builds.
        let old = slot.value.replace(value);
        debug_assert!(old.is_none(), "stale KeyMap vacant slot");
        std::mem::forget(old);
        map.len += 1;
        map.changed();
        map.index(self.slot)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::rc::Rc;

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    // The map allocates nothing, so it can be built in a constant.
    const _EMPTY: KeyMap<u64> = KeyMap::new();

    impl<V> KeyMap<V> {
        /// An empty map with `slots` slots allocated.
        fn with_slots(slots: usize) -> Self {
            let mut map = Self::new();
            map.resize(slots);
            map
        }

        fn slot_count(&self) -> usize {
            self.slots.len()
        }

        /// Every invariant of the table, checked slot by slot.
        fn check(&self) {
            let n = self.slots.len();
            assert!(
                n == 0 || (n.is_power_of_two() && n >= MIN_SLOTS),
                "{n} slots"
            );
            let used = self.slots.iter().filter(|s| s.value.is_some()).count();
            assert_eq!(used, self.len, "len counts the occupied slots");
            assert!(self.len <= max_len(n), "load within the limit");
            assert_eq!(self.grow_at, max_len(n), "the growth threshold");
            let shrink_at = if n > KEEP_SLOTS { n / SHRINK_BELOW } else { 0 };
            assert_eq!(self.shrink_at, shrink_at, "the shrink threshold");
            if n == 0 {
                return;
            }
            assert!(used < n, "an empty slot ends every probe");
            let mask = n - 1;
            for (i, slot) in self.slots.iter().enumerate() {
                if slot.value.is_some() {
                    let mut j = slot.hash as usize & mask;
                    while j != i {
                        assert!(
                            self.slots[j].value.is_some(),
                            "empty slot {j} between the home and slot {i}"
                        );
                        j = (j + 1) & mask;
                    }
                }
            }
        }
    }

    fn splitmix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// The hash functions the differential test runs with.
    #[derive(Debug, Clone, Copy)]
    enum Hashing {
        /// Well spread.
        Mixed,
        /// Only a few distinct full hashes: `eq` must tell keys apart.
        FewHashes,
        /// Distinct full hashes, all equal in their low 32 bits: one long
        /// cluster that `eq` is never asked about.
        SameLowBits,
        /// The key itself: neighbouring homes, runs across the wrap-around.
        Identity,
    }

    impl Hashing {
        fn hash(self, key: u64) -> u64 {
            match self {
                Self::Mixed => splitmix(key),
                Self::FewHashes => splitmix(key % 23),
                Self::SameLowBits => (splitmix(key) << 32) | 0x2a,
                Self::Identity => key,
            }
        }
    }

    /// Keeps a map of `(key, payload)` in step with a `HashMap`.
    struct Model {
        map: KeyMap<(u64, u64)>,
        model: HashMap<u64, u64>,
        hashing: Hashing,
    }

    impl Model {
        fn eq(&self, key: u64) -> impl FnMut(&(u64, u64)) -> bool {
            let (hashing, hash) = (self.hashing, self.hashing.hash(key));
            move |v: &(u64, u64)| {
                assert_eq!(hashing.hash(v.0), hash, "eq called on another hash");
                v.0 == key
            }
        }

        fn insert(&mut self, key: u64, payload: u64) {
            let hash = self.hashing.hash(key);
            let eq = self.eq(key);
            match self.map.find_or_vacant(hash, eq) {
                Ok(index) => {
                    let old = self.model.insert(key, payload).expect("present in both");
                    let v = self.map.get_mut(index);
                    assert_eq!(*v, (key, old));
                    v.1 = payload;
                }
                Err(vacant) => {
                    assert!(self.model.insert(key, payload).is_none(), "absent in both");
                    let index = vacant.insert(&mut self.map, (key, payload));
                    assert_eq!(*self.map.get(index), (key, payload));
                }
            }
        }

        fn remove(&mut self, key: u64) {
            let hash = self.hashing.hash(key);
            let found = self.map.find(hash, self.eq(key));
            match (found, self.model.remove(&key)) {
                (Some(index), Some(payload)) => {
                    assert_eq!(self.map.remove(index), (key, payload));
                }
                (None, None) => {}
                (found, expected) => panic!("{key}: found {found:?}, expected {expected:?}"),
            }
        }

        fn find(&self, key: u64) {
            let hash = self.hashing.hash(key);
            let found = self.map.find(hash, self.eq(key)).map(|i| *self.map.get(i));
            assert_eq!(found, self.model.get(&key).map(|&p| (key, p)));
        }

        fn compare_all(&self) {
            assert_eq!(self.map.len(), self.model.len());
            assert_eq!(self.map.is_empty(), self.model.is_empty());
            let mut seen = HashMap::new();
            for (hash, &(key, payload)) in self.map.iter() {
                assert_eq!(hash, self.hashing.hash(key));
                assert!(seen.insert(key, payload).is_none(), "{key} twice");
            }
            assert_eq!(seen, self.model);
        }
    }

    #[test]
    fn differential_against_std() {
        let (seeds, ops) = if cfg!(miri) { (2, 400) } else { (24, 20_000) };
        for seed in 0..seeds {
            for hashing in [
                Hashing::Mixed,
                Hashing::FewHashes,
                Hashing::SameLowBits,
                Hashing::Identity,
            ] {
                let mut rng = StdRng::seed_from_u64(seed);
                let keys = if seed % 2 == 0 { 40 } else { 1000 };
                let mut m = Model {
                    map: KeyMap::new(),
                    model: HashMap::new(),
                    hashing,
                };
                // Phases that mostly insert, then mostly remove, so that the
                // table grows and shrinks.
                let mut insert_bias = 0.8;
                for op in 0..ops {
                    if op % 997 == 0 {
                        insert_bias = 1.0 - insert_bias;
                    }
                    let key = rng.gen_range(0..keys);
                    match rng.gen_range(0..10) {
                        0..=3 if rng.gen_bool(insert_bias) => m.insert(key, rng.gen()),
                        0..=3 => m.remove(key),
                        4..=6 => m.find(key),
                        7 | 8 => {
                            // Remove a key that is surely present.
                            if let Some(&k) = m.model.keys().next() {
                                m.remove(k);
                            }
                        }
                        _ => m.insert(key, rng.gen()),
                    }
                    if cfg!(miri) || op % 61 == 0 {
                        m.map.check();
                    }
                    if op % 1999 == 0 {
                        m.compare_all();
                    }
                }
                m.map.check();
                m.compare_all();
                let mut drained: Vec<_> = m.map.drain().collect();
                drained.sort_unstable();
                let mut expected: Vec<_> = m.model.into_iter().collect();
                expected.sort_unstable();
                assert_eq!(drained, expected);
                assert!(m.map.is_empty());
                assert_eq!(m.map.slot_count(), 0);
                m.map.check();
            }
        }
    }

    /// `(n << 32) | home`: a distinct full hash whose home is `home` in any
    /// table of up to 2^32 slots.
    fn at_home(n: u64, home: u64) -> u64 {
        (n << 32) | home
    }

    fn slot_of(map: &KeyMap<u64>, hash: u64) -> usize {
        map.find(hash, |&v| v == hash).expect("present").slot
    }

    fn put(map: &mut KeyMap<u64>, hash: u64) {
        let vacant = map.find_or_vacant(hash, |&v| v == hash).unwrap_err();
        vacant.insert(map, hash);
    }

    #[test]
    fn backward_shift_across_the_wrap_around() {
        // In 16 slots: a and c live at home 14, b and d at 15, e at 0, so
        // the run 14, 15, 0, 1, 2 crosses the end of the array.
        const N: u64 = 16;
        assert!(max_len(N as usize) >= 5);
        let [a, b, c, d, e] = [
            at_home(1, N - 2),
            at_home(2, N - 1),
            at_home(3, N - 2),
            at_home(4, N - 1),
            at_home(5, 0),
        ];
        let build = || {
            let mut map = KeyMap::with_slots(N as usize);
            for h in [a, b, c, d, e] {
                put(&mut map, h);
            }
            assert_eq!(map.slot_count(), N as usize);
            map.check();
            map
        };
        let end = N as usize;
        let mut map = build();
        assert_eq!(
            [a, b, c, d, e].map(|h| slot_of(&map, h)),
            [end - 2, end - 1, 0, 1, 2]
        );

        // Removing a: c moves back to its home, d to slot 0 (past the end of
        // the array), e to 1; b stays at its home.
        let index = map.find(a, |&v| v == a).unwrap();
        assert_eq!(map.remove(index), a);
        map.check();
        assert_eq!(
            [b, c, d, e].map(|h| slot_of(&map, h)),
            [end - 1, end - 2, 0, 1]
        );

        // Removing b from the last slot: c (home end - 2) moves back across
        // the wrap into it, d (home end - 1) to 0, e (home 0) to 1.
        let mut map = build();
        let index = map.find(b, |&v| v == b).unwrap();
        assert_eq!(map.remove(index), b);
        map.check();
        assert_eq!(
            [a, c, d, e].map(|h| slot_of(&map, h)),
            [end - 2, end - 1, 0, 1]
        );

        // Removing c from slot 0: d (home end - 1) moves to 0, e to 1.
        let mut map = build();
        let index = map.find(c, |&v| v == c).unwrap();
        assert_eq!(map.remove(index), c);
        map.check();
        assert_eq!(
            [a, b, d, e].map(|h| slot_of(&map, h)),
            [end - 2, end - 1, 0, 1]
        );

        // A value at its home just after the wrap never moves before it.
        let mut map = KeyMap::with_slots(N as usize);
        let [x, y, z] = [at_home(1, N - 1), at_home(2, 0), at_home(3, 1)];
        for h in [x, y, z] {
            put(&mut map, h);
        }
        let index = map.find(x, |&v| v == x).unwrap();
        map.remove(index);
        map.check();
        assert_eq!([y, z].map(|h| slot_of(&map, h)), [0, 1]);
    }

    #[test]
    fn backward_shift_random_runs_near_the_wrap() {
        // Homes crowded around the end of a 16-slot table, removed in random
        // order (the table shrinks to 8 slots on the way).
        const N: u64 = 16;
        let rounds = if cfg!(miri) { 50 } else { 20_000 };
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..rounds {
            let mut map = KeyMap::with_slots(N as usize);
            let count = rng.gen_range(1..=max_len(N as usize));
            let mut live: Vec<u64> = (0..count as u64)
                .map(|n| at_home(n + 1, [N - 3, N - 2, N - 1, 0, 1][rng.gen_range(0..5)]))
                .collect();
            for &h in &live {
                put(&mut map, h);
            }
            assert_eq!(map.slot_count(), N as usize);
            map.check();
            while !live.is_empty() {
                let h = live.swap_remove(rng.gen_range(0..live.len()));
                let index = map.find(h, |&v| v == h).unwrap();
                assert_eq!(map.remove(index), h);
                map.check();
                for &h in &live {
                    slot_of(&map, h);
                }
            }
        }
    }

    #[test]
    fn shrinks_after_a_storm() {
        let n = if cfg!(miri) { 2_000 } else { 100_000 };
        let mut map = KeyMap::new();
        for key in 0..n {
            let hash = splitmix(key);
            let vacant = map.find_or_vacant(hash, |&v| v == key).unwrap_err();
            vacant.insert(&mut map, key);
        }
        let peak = map.slot_count();
        assert!(peak >= n as usize);
        let grown = map.reallocs;
        for key in 1..n {
            let index = map.find(splitmix(key), |&v| v == key).unwrap();
            assert_eq!(map.remove(index), key);
        }
        map.check();
        assert_eq!(map.len(), 1);
        // Back to the kept size: a kilobyte or so for the shard.
        assert_eq!(map.slot_count(), KEEP_SLOTS);
        assert!(map.slot_count() * std::mem::size_of::<Slot<u64>>() <= 2048);
        // Halving at most once per halving of the live set.
        let shrinks = map.reallocs - grown;
        assert!(
            shrinks <= peak.trailing_zeros() as usize,
            "{shrinks} shrinks"
        );
        assert!(map.find(splitmix(0), |&v| v == 0).is_some());
    }

    #[test]
    fn oscillation_does_not_thrash() {
        let cycles = if cfg!(miri) { 200 } else { 10_000 };
        let mut map = KeyMap::new();
        let mut next = 0u64;
        let mut live = Vec::new();
        let mut insert = |map: &mut KeyMap<u64>, live: &mut Vec<u64>| {
            next += 1;
            put(map, splitmix(next));
            live.push(splitmix(next));
        };
        let remove = |map: &mut KeyMap<u64>, live: &mut Vec<u64>| {
            let h = live.pop().unwrap();
            let index = map.find(h, |&v| v == h).unwrap();
            map.remove(index);
        };

        // The empty table keeps its smallest array: lock and unlock of one
        // key never allocates after the first time.
        insert(&mut map, &mut live);
        remove(&mut map, &mut live);
        let before = map.reallocs;
        for _ in 0..cycles {
            insert(&mut map, &mut live);
            remove(&mut map, &mut live);
        }
        assert_eq!(map.reallocs, before);
        assert_eq!(map.slot_count(), MIN_SLOTS);

        // Around the growth limit, with each amplitude.
        for amplitude in 1..=3 {
            while map.len() < map.capacity() {
                insert(&mut map, &mut live);
            }
            let before = map.reallocs;
            for _ in 0..cycles {
                for _ in 0..amplitude {
                    insert(&mut map, &mut live);
                }
                for _ in 0..amplitude {
                    remove(&mut map, &mut live);
                }
            }
            assert!(map.reallocs - before <= 1, "grow limit, {amplitude}");
        }

        // Around the shrink limit: grow big, remove until the first shrink.
        while map.slot_count() < 1024 {
            insert(&mut map, &mut live);
        }
        let before = map.reallocs;
        while map.reallocs == before {
            remove(&mut map, &mut live);
        }
        for amplitude in 1..=3 {
            let before = map.reallocs;
            for _ in 0..cycles {
                for _ in 0..amplitude {
                    remove(&mut map, &mut live);
                }
                for _ in 0..amplitude {
                    insert(&mut map, &mut live);
                }
            }
            assert_eq!(map.reallocs, before, "shrink limit, {amplitude}");
        }
        map.check();
    }

    #[test]
    fn no_size_reallocates_on_every_oscillation() {
        // Every live count, reached by growing and by shrinking, then moved
        // up and down by one or two, either way first: at most one
        // reallocation, then none.
        let (sizes, cycles) = if cfg!(miri) { (20, 8) } else { (300, 50) };
        let mut next = 0u64;
        for target in 2..sizes {
            for from_above in [false, true] {
                let mut map = KeyMap::new();
                let mut live = Vec::new();
                let peak = if from_above { 4 * target + 40 } else { target };
                while live.len() < peak {
                    next += 1;
                    put(&mut map, splitmix(next));
                    live.push(splitmix(next));
                }
                while live.len() > target {
                    let h = live.pop().unwrap();
                    let index = map.find(h, |&v| v == h).unwrap();
                    map.remove(index);
                }
                for amplitude in 1..=2 {
                    for up_first in [false, true] {
                        let before = map.reallocs;
                        for _ in 0..cycles {
                            for phase in [up_first, !up_first] {
                                for _ in 0..amplitude {
                                    if phase {
                                        next += 1;
                                        put(&mut map, splitmix(next));
                                        live.push(splitmix(next));
                                    } else {
                                        let h = live.pop().unwrap();
                                        let index = map.find(h, |&v| v == h).unwrap();
                                        map.remove(index);
                                    }
                                }
                            }
                        }
                        assert!(
                            map.reallocs - before <= 1,
                            "{target} keys (from above: {from_above}), \
                             amplitude {amplitude} (up first: {up_first}): \
                             {} reallocations",
                            map.reallocs - before,
                        );
                    }
                }
                map.check();
            }
        }
    }

    #[test]
    fn reallocations_are_amortised() {
        // A random walk of the live count over several orders of magnitude:
        // every reallocation of `s` slots is paid for by `Ω(s)` operations.
        let ops = if cfg!(miri) { 3_000 } else { 300_000 };
        let mut rng = StdRng::seed_from_u64(3);
        let mut map = KeyMap::new();
        let mut live = Vec::new();
        let mut work = 0;
        let mut next = 0u64;
        for op in 0..ops {
            let grow = (op / 5_000) % 2 == 0;
            let before = (map.reallocs, map.slot_count());
            if live.is_empty() || rng.gen_bool(if grow { 0.6 } else { 0.4 }) {
                next += 1;
                let h = splitmix(next);
                put(&mut map, h);
                live.push(h);
            } else {
                let h = live.swap_remove(rng.gen_range(0..live.len()));
                let index = map.find(h, |&v| v == h).unwrap();
                map.remove(index);
            }
            if map.reallocs != before.0 {
                work += before.1.max(map.slot_count());
            }
        }
        assert!(work <= 4 * ops, "{work} slots moved in {ops} operations");
    }

    #[test]
    fn a_panicking_eq_leaves_the_map_unchanged() {
        // Values that all share one full hash, so `eq` runs on a probe.
        let hash = 0xdead_beef;
        let mut map = KeyMap::new();
        let mut n = 0;
        while map.len() < map.capacity() || map.slot_count() < 16 {
            n += 1;
            let vacant = map.find_or_vacant(hash, |&(k, _)| k == n).unwrap_err();
            vacant.insert(&mut map, (n, Rc::new(())));
        }
        map.check();
        // At the growth limit: an insert would reallocate first.
        assert_eq!(map.len(), map.capacity());
        let snapshot = |map: &KeyMap<(u64, Rc<()>)>| -> Vec<Option<(u64, u64, usize)>> {
            map.slots
                .iter()
                .map(|s| {
                    s.value
                        .as_ref()
                        .map(|(k, rc)| (s.hash, *k, Rc::strong_count(rc)))
                })
                .collect()
        };
        let before = snapshot(&map);
        let reallocs = map.reallocs;

        for after_calls in [0, 1, 5] {
            let calls = Cell::new(0);
            let eq = |_: &(u64, Rc<()>)| {
                calls.set(calls.get() + 1);
                assert!(calls.get() <= after_calls, "eq panics");
                false
            };
            let result = catch_unwind(AssertUnwindSafe(|| {
                let _ = map.find_or_vacant(hash, eq);
            }));
            assert!(result.is_err());
            assert_eq!(snapshot(&map), before);
            assert_eq!(map.reallocs, reallocs);
            map.check();

            let result = catch_unwind(AssertUnwindSafe(|| {
                calls.set(0);
                map.find(hash, eq)
            }));
            assert!(result.is_err());
            assert_eq!(snapshot(&map), before);
        }
        // The map still works.
        let index = map.find(hash, |&(k, _)| k == 3).unwrap();
        assert_eq!(map.remove(index).0, 3);
        map.check();
    }

    /// A value that records its drop.
    #[derive(Debug)]
    struct Tracked {
        id: usize,
        drops: Rc<RefCell<Vec<u32>>>,
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.drops.borrow_mut()[self.id] += 1;
        }
    }

    #[test]
    fn values_drop_exactly_once() {
        let n = if cfg!(miri) { 300 } else { 3_000 };
        let drops = Rc::new(RefCell::new(vec![0u32; 2 * n]));
        let hash = |id: usize| splitmix(id as u64 % 97);
        let make = |id| Tracked {
            id,
            drops: Rc::clone(&drops),
        };
        let insert = |map: &mut KeyMap<Tracked>, id| {
            let vacant = map.find_or_vacant(hash(id), |t| t.id == id).unwrap_err();
            vacant.insert(map, make(id));
        };
        let remove = |map: &mut KeyMap<Tracked>, id| {
            let index = map.find(hash(id), |t: &Tracked| t.id == id).unwrap();
            map.remove(index)
        };

        let mut map = KeyMap::new();
        for id in 0..n {
            insert(&mut map, id);
        }
        // Removed values are the caller's: dropped once, by the caller.
        for id in (0..n).step_by(3) {
            let t = remove(&mut map, id);
            assert_eq!(drops.borrow()[id], 0);
            drop(t);
        }
        // Shrinking moves values without dropping them.
        for id in (0..n).filter(|id| id % 3 != 0 && id % 10 != 1) {
            drop(remove(&mut map, id));
        }
        map.check();
        assert!(drops.borrow()[..n].iter().all(|&d| d <= 1));
        // A half-consumed drain drops the rest.
        let mut drain = map.drain();
        let first = drain.next().unwrap();
        drop(drain);
        assert_eq!(drops.borrow()[first.id], 0);
        drop(first);
        assert!(map.is_empty());
        // The rest go with the map.
        for id in n..2 * n {
            insert(&mut map, id);
        }
        drop(map);
        assert!(
            drops.borrow().iter().all(|&d| d == 1),
            "{:?}",
            drops.borrow()
        );
    }

    #[test]
    fn new_allocates_nothing() {
        let map: KeyMap<u64> = KeyMap::new();
        assert_eq!((map.len(), map.capacity(), map.slot_count()), (0, 0, 0));
        assert!(map.find(42, |_| unreachable!()).is_none());
        assert_eq!(map.iter().count(), 0);
        // The first insert allocates the smallest table.
        let mut map = map;
        put(&mut map, 42);
        assert_eq!(map.slot_count(), MIN_SLOTS);
        assert_eq!(map.iter().collect::<Vec<_>>(), [(42, &42)]);
    }

    #[test]
    fn eq_runs_only_on_a_full_hash_match() {
        let mut map = KeyMap::new();
        for n in 0..5 {
            put(&mut map, at_home(n + 1, 3));
        }
        // Same home, different full hash: no call.
        assert!(map.find(at_home(99, 3), |_| unreachable!()).is_none());
        assert!(map
            .find_or_vacant(at_home(99, 3), |_| unreachable!())
            .is_err());
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "stale KeyMap index")]
    fn a_stale_index_is_caught() {
        let mut map = KeyMap::new();
        put(&mut map, 1);
        put(&mut map, 2);
        let index = map.find(1, |&v| v == 1).unwrap();
        put(&mut map, 3);
        map.get(index);
    }
}
