//! The keyed table: a sharded map from key to its wait queue.
//!
//! A key's hash picks its shard; each shard is a mutex around a
//! [`ShardState`] on its own cache line, in the manner of parking_lot's
//! parking lot: the check and the enqueue happen under the same shard lock,
//! so a wakeup cannot be missed, and the lock is released before any waker is
//! woken or any key is dropped.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::acquire::{Lock, LockOwned};
use crate::error::TryLockError;
use crate::guard::{Guard, Held, OwnedGuard};
use crate::key_slot::KeyPtr;
use crate::loom::Mutex;
use crate::queue::{Grant, Released, ShardState};
use crate::stats::{Counters, Stats};
use crate::token::FencingToken;

/// The hasher a table uses unless told otherwise: fast, and seeded per table.
pub type DefaultHashBuilder = foldhash::fast::RandomState;

/// One shard: its lock-protected state and its counters.
pub(crate) struct Shard<K> {
    pub(crate) state: Mutex<ShardState<K>>,
    pub(crate) counters: Counters,
}

/// A table of exclusive locks, one per key, whose waits are futures.
///
/// `lock(key).await` resolves to a [`Guard`] once `key` is free; dropping the
/// guard releases the key and hands it to the oldest waiter. Keys that are
/// neither held nor awaited take no memory.
///
/// # Fairness
///
/// Waiters for one key are served strictly in arrival order: a release hands
/// the key directly to the oldest waiter, and until that waiter runs the key
/// is its. `try_lock` never barges past a queue.
///
/// # Cancel safety
///
/// Every future the table returns may be dropped at any point, on any thread.
/// A waiting future removes its registration; one that had already been
/// handed the key passes it on to the next waiter, or frees it.
///
/// # Key bounds
///
/// Keys are `Eq + Hash`. A key is moved into the table once and never cloned:
/// the guard borrows the table's copy. Sharing the table between threads needs
/// `K: Send + Sync`, because one thread drops a key another moved in and every
/// holder reads it.
///
/// ```
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let guard = table.lock("account-42").await;
/// assert!(table.is_locked("account-42"));
/// drop(guard);
/// assert!(table.is_empty());
/// # });
/// ```
pub struct LockTable<K, S = DefaultHashBuilder> {
    shards: Box<[CachePadded<Shard<K>>]>,
    mask: usize,
    hasher: S,
}

impl<K: Eq + Hash> LockTable<K> {
    /// Creates a table with the default shard count and hasher.
    ///
    /// ```
    /// let table: keylock::LockTable<u64> = keylock::LockTable::new();
    /// assert!(table.is_empty());
    /// ```
    #[must_use]
    pub fn new() -> Self {
        Builder::new().build()
    }

    /// Starts configuring a table.
    ///
    /// ```
    /// let table: keylock::LockTable<String> = keylock::LockTable::builder().shards(8).build();
    /// assert_eq!(table.shard_count(), 8);
    /// ```
    #[must_use]
    pub fn builder() -> Builder {
        Builder::new()
    }
}

impl<K: Eq + Hash> Default for LockTable<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, S> fmt::Debug for LockTable<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockTable")
            .field("shards", &self.shards.len())
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl<K, S> LockTable<K, S> {
    /// Number of keys that are held or awaited.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let a = table.try_lock('a').unwrap();
    /// assert_eq!(table.len(), 1);
    /// drop(a);
    /// assert_eq!(table.len(), 0);
    /// ```
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.state.lock().len()).sum()
    }

    /// Whether no key is held or awaited.
    ///
    /// ```
    /// let table: keylock::LockTable<u8> = keylock::LockTable::new();
    /// assert!(table.is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.state.lock().len() == 0)
    }

    /// Number of shards (a power of two).
    ///
    /// ```
    /// let table: keylock::LockTable<u8> = keylock::LockTable::builder().shards(3).build();
    /// assert_eq!(table.shard_count(), 4);
    /// ```
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Cumulative counters, summed over the shards without locking them.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let _g = table.try_lock(7).unwrap();
    /// assert_eq!(table.stats().acquisitions, 1);
    /// ```
    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for shard in self.shards.iter() {
            shard.counters.add_to(&mut stats);
        }
        stats
    }

    #[inline]
    pub(crate) fn shard(&self, hash: u64) -> &Shard<K> {
        // The low bits pick a bucket inside the shard's table and the top
        // seven its tag: take the shard from the bits in between.
        &self.shards[(hash >> 32) as usize & self.mask]
    }

    /// Releases the grant `token` of the key at `key`; the holder gives proof
    /// of ownership with its token, so a stale release frees nothing.
    #[inline]
    pub(crate) fn release(&self, hash: u64, key: KeyPtr<K>, token: FencingToken) {
        let shard = self.shard(hash);
        let released = {
            let mut state = shard.state.lock();
            let released = state.release(hash, key, token);
            if released.handed_off() {
                shard.counters.handed_off();
            }
            released
        };
        released.finish();
    }

    /// Drops a waiting future's registration; a grant it had not observed yet
    /// passes on.
    #[cold]
    pub(crate) fn cancel(&self, hash: u64, key: KeyPtr<K>, slot: u32) {
        let shard = self.shard(hash);
        let released: Released<K> = {
            let mut state = shard.state.lock();
            let released = state.cancel_slot(hash, key, slot);
            shard.counters.cancelled();
            if released.handed_off() {
                shard.counters.handed_off();
            }
            released
        };
        released.finish();
    }
}

impl<K, S> LockTable<K, S>
where
    K: Eq + Hash,
    S: BuildHasher,
{
    #[inline]
    pub(crate) fn hash<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Waits until `key` is free and takes it.
    ///
    /// Waiters are served in arrival order. The wait registers one wake slot,
    /// updated in place when the future is polled again.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: dropping the future before it completes leaves the table as
    /// if it had never been called; if the key had already been handed to it,
    /// the key passes to the next waiter.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let guard = table.lock(1u64).await;
    /// assert_eq!(*guard.key(), 1);
    /// # });
    /// ```
    #[inline]
    pub fn lock(&self, key: K) -> Lock<'_, K, S> {
        let hash = self.hash(&key);
        Lock::new(self, hash, key)
    }

    /// Like [`lock`](Self::lock), for a table behind an [`Arc`]: the guard
    /// keeps the table alive and is `'static`.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard: keylock::OwnedGuard<&str> = table.clone().lock_owned("job").await;
    /// assert!(table.is_locked("job"));
    /// # drop(guard);
    /// # });
    /// ```
    #[inline]
    pub fn lock_owned(self: Arc<Self>, key: K) -> LockOwned<K, S> {
        let hash = self.hash(&key);
        LockOwned::new(self, hash, key)
    }

    /// Takes `key` if it is free and nobody waits for it.
    ///
    /// # Errors
    ///
    /// [`TryLockError::WouldBlock`] if the key is held or awaited.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.try_lock("a").unwrap();
    /// assert!(table.try_lock("a").is_err());
    /// drop(guard);
    /// assert!(table.try_lock("a").is_ok());
    /// ```
    #[inline]
    pub fn try_lock(&self, key: K) -> Result<Guard<'_, K, S>, TryLockError> {
        let hash = self.hash(&key);
        self.try_acquire(hash, key).map(|grant| Guard::new(self, Held { hash, grant }))
    }

    /// Like [`try_lock`](Self::try_lock), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// [`TryLockError::WouldBlock`] if the key is held or awaited.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().try_lock_owned(5).unwrap();
    /// assert_eq!(guard.key(), &5);
    /// ```
    #[inline]
    pub fn try_lock_owned(self: Arc<Self>, key: K) -> Result<OwnedGuard<K, S>, TryLockError> {
        let hash = self.hash(&key);
        let grant = self.try_acquire(hash, key)?;
        Ok(OwnedGuard::new(self, Held { hash, grant }))
    }

    #[inline]
    fn try_acquire(&self, hash: u64, key: K) -> Result<Grant<K>, TryLockError> {
        let shard = self.shard(hash);
        let mut state = shard.state.lock();
        match state.try_acquire(hash, key) {
            Ok(grant) => {
                shard.counters.acquired(false);
                Ok(grant)
            }
            Err(key) => {
                drop(state);
                drop(key);
                Err(TryLockError::WouldBlock)
            }
        }
    }

    /// Blocks the current thread until `key` is free and takes it.
    ///
    /// For plain threads only: calling it from async code blocks the executor
    /// thread, and deadlocks it if the holder runs on that same thread. Use
    /// [`lock`](Self::lock) there.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.blocking_lock("file.txt");
    /// assert!(table.is_locked("file.txt"));
    /// # drop(guard);
    /// ```
    pub fn blocking_lock(&self, key: K) -> Guard<'_, K, S> {
        futures_executor::block_on(self.lock(key))
    }

    /// Whether `key` is held now.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let _g = table.try_lock(String::from("user:1")).unwrap();
    /// assert!(table.is_locked("user:1"));
    /// assert!(!table.is_locked("user:2"));
    /// ```
    pub fn is_locked<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.shard(hash).state.lock().is_held(hash, key)
    }

    /// How many futures wait for `key` (not counting its holder).
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// assert_eq!(table.waiters(&3), 0);
    /// ```
    pub fn waiters<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.shard(hash).state.lock().waiters(hash, key)
    }
}

/// Configures a [`LockTable`].
///
/// ```
/// let table: keylock::LockTable<u32> = keylock::LockTable::builder().shards(16).build();
/// assert_eq!(table.shard_count(), 16);
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Builder<S = DefaultHashBuilder> {
    shards: Option<usize>,
    hasher: S,
}

impl Builder {
    fn new() -> Self {
        Self {
            shards: None,
            hasher: DefaultHashBuilder::default(),
        }
    }
}

impl<S> Builder<S> {
    /// Number of shards, rounded up to a power of two. More shards mean less
    /// contention between unrelated keys; the default is four per available
    /// core. Zero is rejected by [`build`](Self::build).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = Some(shards);
        self
    }

    /// The hasher that spreads keys over shards and buckets.
    ///
    /// ```
    /// let table: keylock::LockTable<u8, std::hash::RandomState> =
    ///     keylock::LockTable::builder().hasher(std::hash::RandomState::new()).build();
    /// # drop(table);
    /// ```
    pub fn hasher<T: BuildHasher>(self, hasher: T) -> Builder<T> {
        Builder {
            shards: self.shards,
            hasher,
        }
    }

    /// Builds the table.
    ///
    /// # Panics
    ///
    /// If `shards(0)` or more than 2^16 shards were asked for.
    pub fn build<K>(self) -> LockTable<K, S> {
        let shards = match self.shards {
            Some(0) => panic!("keylock: Builder::shards must be at least 1, got 0"),
            Some(n) if n > MAX_SHARDS => {
                panic!("keylock: Builder::shards must be at most {MAX_SHARDS}, got {n}")
            }
            Some(n) => n,
            None => default_shards(),
        }
        .next_power_of_two();
        let shards: Box<[CachePadded<Shard<K>>]> = (0..shards)
            .map(|_| {
                CachePadded::new(Shard {
                    state: Mutex::new(ShardState::new()),
                    counters: Counters::default(),
                })
            })
            .collect();
        LockTable {
            mask: shards.len() - 1,
            shards,
            hasher: self.hasher,
        }
    }
}

const MAX_SHARDS: usize = 1 << 16;

fn default_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 4).clamp(4, 1024)
}
