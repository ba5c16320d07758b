//! The shard table's lock-and-release cycle on `KeyMap` against
//! `hashbrown::HashTable`: probe for an absent key and insert its entry, then
//! find the entry by pointer equality and remove it, with 0, 8, 1000 and
//! 2000 other keys live in the table (2000 keys fill `KeyMap` to its maximum
//! load, half its slots).
//!
//! ```text
//! cargo bench --bench key_map
//! ```
//!
//! `bare` runs the cycle alone; `locked` takes and releases an uncontended
//! spin lock around each of its two table operations, as a shard does. Both
//! tables run in alternating batches and the minimum and median batch are
//! reported: the minimum is the figure to compare on a busy machine.

// The module is crate-private; here it is compiled on its own and the bench
// uses only part of it.
#[allow(dead_code, unreachable_pub, unused_imports)]
#[path = "../src/support/key_map.rs"]
mod key_map;

use std::hash::BuildHasher;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hashbrown::HashTable;
use key_map::KeyMap;

/// An entry the size of a shard's: a pointer to the key in its own heap slot
/// and the key's state.
struct Entry {
    key: &'static u64,
    _state: [u64; 8],
}

/// The same with the hash inside, which `HashTable` needs to rehash.
struct HashedEntry {
    hash: u64,
    entry: Entry,
}

fn entry(key: &'static u64) -> Entry {
    Entry {
        key,
        _state: [0; 8],
    }
}

/// Keys in their heap slots, with their hashes.
fn keys(range: std::ops::Range<u64>) -> Vec<(u64, &'static u64)> {
    let hasher = foldhash::fast::FixedState::with_seed(17);
    range
        .map(|k| (hasher.hash_one(k), &*Box::leak(Box::new(k))))
        .collect()
}

/// Distinct absent keys the cycle walks through, so that it probes from
/// many homes.
const ABSENT: u64 = 1024;

/// The table operations of one cycle.
trait Table {
    fn with_keys(live: &[(u64, &'static u64)]) -> Self;
    /// Probes for the absent `key` and inserts its entry.
    fn lock(&mut self, hash: u64, key: &'static u64);
    /// Finds the entry of `key` by pointer and removes it.
    fn unlock(&mut self, hash: u64, key: &'static u64);
}

impl Table for KeyMap<Entry> {
    fn with_keys(live: &[(u64, &'static u64)]) -> Self {
        let mut map = KeyMap::new();
        for &(hash, key) in live {
            map.lock(hash, key);
        }
        map
    }

    #[inline]
    fn lock(&mut self, hash: u64, key: &'static u64) {
        match self.find_or_vacant(hash, |e| *e.key == *key) {
            Ok(_) => unreachable!("the key is absent"),
            Err(vacant) => {
                vacant.insert(self, entry(key));
            }
        }
    }

    #[inline]
    fn unlock(&mut self, hash: u64, key: &'static u64) {
        let index = self.find(hash, |e| std::ptr::eq(e.key, key)).unwrap();
        black_box(self.remove(index));
    }
}

impl Table for HashTable<HashedEntry> {
    fn with_keys(live: &[(u64, &'static u64)]) -> Self {
        let mut table = HashTable::new();
        for &(hash, key) in live {
            table.lock(hash, key);
        }
        table
    }

    #[inline]
    fn lock(&mut self, hash: u64, key: &'static u64) {
        match self.entry(hash, |e| *e.entry.key == *key, |e| e.hash) {
            hashbrown::hash_table::Entry::Occupied(_) => unreachable!("the key is absent"),
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                vacant.insert(HashedEntry {
                    hash,
                    entry: entry(key),
                });
            }
        }
    }

    #[inline]
    fn unlock(&mut self, hash: u64, key: &'static u64) {
        let Ok(found) = self.find_entry(hash, |e| std::ptr::eq(e.entry.key, key)) else {
            unreachable!("the key is present")
        };
        black_box(found.remove());
    }
}

/// An uncontended test-and-set lock around each operation, as in a shard.
#[inline]
fn locked<R>(lock: &AtomicBool, op: impl FnOnce() -> R) -> R {
    while lock
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
    let r = op();
    lock.store(false, Ordering::Release);
    r
}

/// One table under test, ready to run cycles.
struct Runner {
    name: &'static str,
    /// Runs `n` cycles; returns the nanoseconds per cycle.
    run: Box<dyn FnMut(usize) -> f64>,
    samples: Vec<f64>,
}

fn runner<T: Table + 'static>(name: &'static str, live: u64, lock: bool) -> Runner {
    let absent = keys(1_000_000..1_000_000 + ABSENT);
    let mut table = T::with_keys(&keys(0..live));
    let spin = AtomicBool::new(false);
    let mut next = 0;
    let run = move |n: usize| {
        let start = Instant::now();
        for _ in 0..n {
            let (hash, key) = absent[next];
            next = (next + 1) % absent.len();
            if lock {
                locked(&spin, || table.lock(hash, key));
                locked(&spin, || table.unlock(hash, key));
            } else {
                table.lock(hash, key);
                table.unlock(hash, key);
            }
        }
        start.elapsed().as_nanos() as f64 / n as f64
    };
    Runner {
        name,
        run: Box::new(run),
        samples: Vec::new(),
    }
}

/// Rounds per case; each round times a batch of every table in turn, so that
/// noise from other processes falls on both alike.
const ROUNDS: usize = 300;
const BATCH: usize = 4096;

fn main() {
    println!("ns per cycle (min / median of {ROUNDS} batches of {BATCH})");
    for lock in [false, true] {
        for live in [0, 8, 1000, 2000] {
            let mut runners = [
                runner::<KeyMap<Entry>>("KeyMap", live, lock),
                runner::<HashTable<HashedEntry>>("hashbrown", live, lock),
            ];
            for _ in 0..ROUNDS {
                for r in &mut runners {
                    let ns = (r.run)(BATCH);
                    r.samples.push(ns);
                }
            }
            for r in &mut runners {
                r.samples.sort_by(f64::total_cmp);
                println!(
                    "{:6} {:4} live  {:9}  {:5.1} / {:5.1}",
                    if lock { "locked" } else { "bare" },
                    live,
                    r.name,
                    r.samples[0],
                    r.samples[ROUNDS / 2],
                );
            }
        }
    }
}
