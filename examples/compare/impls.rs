//! The contenders: keylock and the keyed-lock options people write today,
//! behind one small trait so that every workload runs the same code for each.
//!
//! Keys are `u64`. The non-keyed mutexes ignore the key: they stand for "one
//! lock for everything", which is what a keyed lock must beat (or at least
//! approach) on a single key, and what it is meant to replace on many.

use std::future::Future;
use std::sync::Arc;

use dashmap::DashMap;
use parking_lot::lock_api::RawMutex as _;

/// One keyed-lock implementation.
pub(crate) trait KeyedLock: Send + Sync + 'static {
    /// What a successful `lock` returns; dropping it unlocks.
    type Guard<'a>: Send
    where
        Self: 'a;

    /// Short name for tables and progress lines.
    const NAME: &'static str;

    /// Whether a guard may be held across an `.await` and a waiter can be
    /// pending (false for the synchronous floor, which blocks its worker
    /// thread while it waits: it runs only the workloads that never hold a
    /// guard across an `.await`).
    const ASYNC: bool = true;

    /// Whether the key matters (false: one lock for every key).
    const KEYED: bool = true;

    /// Whether a guard excludes every other (false for a shared lock, which
    /// runs only the uncontended workloads W1 and W2: with shared guards
    /// nothing waits, and W6's counter would race).
    const EXCLUSIVE: bool = true;

    /// Whether a released key goes to the oldest waiter, never back to a
    /// releaser that locks again while others wait (false for the barging
    /// locks: async_lock's, futures' and parking_lot's mutexes let any
    /// locker take a free lock, and are fair only eventually or not at
    /// all). For a FIFO lock on one contended key nearly every acquisition
    /// is a handoff to another task; `compare` flags a W6 repetition where
    /// it was not.
    const FIFO: bool = true;

    fn create() -> Self;

    /// Inlined in every implementation: a `lock` that is not inlined returns
    /// its future through a return slot and then moves it into the caller's
    /// state, which a plain loop does not pay (DashMap+leak: 612 instructions
    /// per W1 lock+unlock through the trait against 577 in a plain loop;
    /// 576 with `#[inline]`).
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_;

    /// The synchronous floor only (`ASYNC == false`): lock without a future,
    /// as synchronous locks are used in async code. W1 and W2 call this for
    /// it instead of `lock(k).await`: an `.await` in the loop, even of a
    /// ready future, keeps the loop's variables in the task's state in
    /// memory, 11 instructions per lock+unlock on top of parking_lot's 8
    /// (callgrind), which a plain loop of a synchronous lock never pays.
    fn lock_sync(&self, _key: u64) -> Self::Guard<'_> {
        unreachable!("{} is asynchronous: lock(k).await it", Self::NAME)
    }

    /// Entries the implementation still keeps (`None` if it keeps no map).
    fn entries(&self) -> Option<usize>;
}

// ---------------------------------------------------------------- keylock --

/// `keylock::LockTable<u64>` with `lock(k).await`.
pub(crate) struct Keylock(keylock::LockTable<u64>);

impl KeyedLock for Keylock {
    type Guard<'a> = keylock::Guard<'a, u64>;
    const NAME: &'static str = "keylock";

    fn create() -> Self {
        Self(keylock::LockTable::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.lock(key)
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

pin_project_lite::pin_project! {
    /// `fut.await.expect(msg)`, as a user's async code writes it around
    /// `lock_with`: the `Result` unwrapped where the lock future is polled.
    /// Not an `async` block: one that calls `lock_with` inside keeps the
    /// table, key and options it captured beside the lock future (288
    /// bytes against the plain lock's 184), and one that takes the made
    /// future keeps it twice (376); a user's code keeps the lock future
    /// alone across its `.await`, as this does.
    pub(crate) struct Expect<F> {
        #[pin]
        fut: F,
        msg: &'static str,
    }
}

impl<F> Expect<F> {
    #[inline]
    fn new(fut: F, msg: &'static str) -> Self {
        Self { fut, msg }
    }
}

impl<F, T, E> Future for Expect<F>
where
    F: Future<Output = Result<T, E>>,
    E: std::fmt::Debug,
{
    type Output = T;

    #[inline]
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<T> {
        let this = self.project();
        let msg = *this.msg;
        this.fut.poll(cx).map(|r| r.expect(msg))
    }
}

/// A lease long enough never to lapse during a run: what it costs is the
/// clock read at the grant and the deadline kept with it.
pub(crate) const LONG_LEASE: std::time::Duration = std::time::Duration::from_secs(3600);

/// keylock, every lock with a lease (`lock_with(k, lease)`).
pub(crate) struct KeylockLease(keylock::LockTable<u64>);

impl KeyedLock for KeylockLease {
    type Guard<'a> = keylock::Guard<'a, u64>;
    const NAME: &'static str = "keylock+lease";

    fn create() -> Self {
        Self(keylock::LockTable::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        let opts = keylock::LockOptions::new().lease(LONG_LEASE);
        Expect::new(self.0.lock_with(key, opts), "no timeout, valid lease")
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// keylock, every lock with a timeout (`lock_with(k, timeout)`).
pub(crate) struct KeylockTimeout(keylock::LockTable<u64>);

impl KeyedLock for KeylockTimeout {
    type Guard<'a> = keylock::Guard<'a, u64>;
    const NAME: &'static str = "keylock+timeout";

    fn create() -> Self {
        Self(keylock::LockTable::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        let opts = keylock::LockOptions::new().timeout(LONG_LEASE);
        Expect::new(self.0.lock_with(key, opts), "never times out in a run")
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// keylock, every lock shared (`lock_shared(k)`): W1 and W2 only, the cost
/// of a shared grant beside an exclusive one.
pub(crate) struct KeylockShared(keylock::LockTable<u64>);

impl KeyedLock for KeylockShared {
    type Guard<'a> = keylock::Guard<'a, u64>;
    const NAME: &'static str = "keylock+shared";
    const EXCLUSIVE: bool = false;

    fn create() -> Self {
        Self(keylock::LockTable::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.lock_shared(key)
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

// ---------------------------------------------- DashMap<K, Arc<Mutex<()>>> --

type TokioMutexArc = Arc<tokio::sync::Mutex<()>>;

/// `DashMap<u64, Arc<tokio::sync::Mutex<()>>>`, entries never removed: the
/// one-liner most code starts with. Leaks one entry per key ever locked.
pub(crate) struct DashMapLeak(DashMap<u64, TokioMutexArc>);

impl KeyedLock for DashMapLeak {
    type Guard<'a> = tokio::sync::OwnedMutexGuard<()>;
    const NAME: &'static str = "dashmap-leak";

    fn create() -> Self {
        Self(DashMap::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        let mutex = Arc::clone(&self.0.entry(key).or_default());
        mutex.lock_owned()
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// `DashMap<u64, Arc<tokio::sync::Mutex<()>>>` that removes an entry once
/// nobody holds or awaits it.
///
/// Correctness argument: a clone of the `Arc` is only ever made under the
/// shard's write lock (`entry().or_default()`), and every handle, after
/// dropping its clone, calls `remove_if(strong_count == 1)`, which checks
/// under the same lock. So a count of 1 seen under the lock means nobody else
/// has a clone and nobody can take one before the entry is gone. Waiters that
/// are cancelled run the same cleanup (see [`Cleanup`]), so cancellation does
/// not leak entries either.
pub(crate) struct DashMapCleanup(DashMap<u64, TokioMutexArc>);

/// Removes the key's entry if the map's own `Arc` is the last one. Declared
/// before the `Arc` clone it guards, so it drops after it, on completion
/// and on cancellation alike.
struct Cleanup<'a> {
    map: &'a DashMap<u64, TokioMutexArc>,
    key: u64,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        self.map
            .remove_if(&self.key, |_, m| Arc::strong_count(m) == 1);
    }
}

/// The guard of [`DashMapCleanup`]: unlocks (dropping its `Arc`) first, then
/// cleans up.
pub(crate) struct CleanupGuard<'a> {
    _guard: tokio::sync::OwnedMutexGuard<()>,
    _cleanup: Cleanup<'a>,
}

impl KeyedLock for DashMapCleanup {
    type Guard<'a> = CleanupGuard<'a>;
    const NAME: &'static str = "dashmap-cleanup";

    fn create() -> Self {
        Self(DashMap::new())
    }

    #[inline]
    async fn lock(&self, key: u64) -> Self::Guard<'_> {
        let cleanup = Cleanup { map: &self.0, key };
        let mutex = Arc::clone(&self.0.entry(key).or_default());
        let guard = mutex.lock_owned().await;
        CleanupGuard {
            _guard: guard,
            _cleanup: cleanup,
        }
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

// --------------------------------------------------------------- lockable --

/// `lockable::LockPool<u64>` with `async_lock(k).await`.
pub(crate) struct Lockable(lockable::LockPool<u64>);

impl KeyedLock for Lockable {
    type Guard<'a> = <lockable::LockPool<u64> as lockable::Lockable<u64, ()>>::Guard<'a>;
    const NAME: &'static str = "lockable";

    fn create() -> Self {
        Self(lockable::LockPool::new())
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.async_lock(key)
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.num_locked())
    }
}

// ------------------------------------------------- single, non-keyed locks --

/// One `tokio::sync::Mutex<()>` for every key.
pub(crate) struct TokioMutex(tokio::sync::Mutex<()>);

impl KeyedLock for TokioMutex {
    type Guard<'a> = tokio::sync::MutexGuard<'a, ()>;
    const NAME: &'static str = "tokio::Mutex";
    const KEYED: bool = false;

    fn create() -> Self {
        Self(tokio::sync::Mutex::new(()))
    }

    #[inline]
    fn lock(&self, _key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.lock()
    }

    fn entries(&self) -> Option<usize> {
        None
    }
}

/// One `async_lock::Mutex<()>` for every key.
pub(crate) struct AsyncLockMutex(async_lock::Mutex<()>);

impl KeyedLock for AsyncLockMutex {
    type Guard<'a> = async_lock::MutexGuard<'a, ()>;
    const NAME: &'static str = "async_lock::Mutex";
    const KEYED: bool = false;
    /// Barges: a free lock goes to whoever calls first; a waiter starved for
    /// 0.5 ms switches it to fair handoff until it is served.
    const FIFO: bool = false;

    fn create() -> Self {
        Self(async_lock::Mutex::new(()))
    }

    #[inline]
    fn lock(&self, _key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.lock()
    }

    fn entries(&self) -> Option<usize> {
        None
    }
}

/// One `futures::lock::Mutex<()>` for every key.
pub(crate) struct FuturesMutex(futures::lock::Mutex<()>);

impl KeyedLock for FuturesMutex {
    type Guard<'a> = futures::lock::MutexGuard<'a, ()>;
    const NAME: &'static str = "futures::Mutex";
    const KEYED: bool = false;
    /// Barges, and is never fair: unlocking wakes a waiter, which competes
    /// with every other locker.
    const FIFO: bool = false;

    fn create() -> Self {
        Self(futures::lock::Mutex::new(()))
    }

    #[inline]
    fn lock(&self, _key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        self.0.lock()
    }

    fn entries(&self) -> Option<usize> {
        None
    }
}

/// One `parking_lot::Mutex` for every key: the synchronous floor. Its raw lock
/// is used so that the guard is `Send` (parking_lot's own guard is not, without
/// the `send_guard` feature); it is never held across an `.await`.
pub(crate) struct ParkingLot(parking_lot::RawMutex);

/// Unlocks a [`ParkingLot`] on drop.
pub(crate) struct ParkingLotGuard<'a>(&'a parking_lot::RawMutex);

impl Drop for ParkingLotGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: this guard was created by `ParkingLot::lock` right after
        // taking the lock, and is its only owner; parking_lot's raw mutex may
        // be unlocked from any thread.
        unsafe { self.0.unlock() }
    }
}

impl KeyedLock for ParkingLot {
    type Guard<'a> = ParkingLotGuard<'a>;
    const NAME: &'static str = "parking_lot::Mutex";
    const ASYNC: bool = false;
    const KEYED: bool = false;
    /// Barges, with eventual fairness (a fair unlock about every 0.5 ms).
    const FIFO: bool = false;

    fn create() -> Self {
        Self(parking_lot::RawMutex::INIT)
    }

    #[inline]
    fn lock(&self, key: u64) -> impl Future<Output = Self::Guard<'_>> + Send + '_ {
        std::future::ready(self.lock_sync(key))
    }

    #[inline]
    fn lock_sync(&self, _key: u64) -> Self::Guard<'_> {
        self.0.lock();
        ParkingLotGuard(&self.0)
    }

    fn entries(&self) -> Option<usize> {
        None
    }
}
