//! The keyed table: a sharded map from key to its wait queue.
//!
//! A key's hash picks its shard; each shard is a mutex around a
//! [`ShardState`] on its own cache line, in the manner of parking_lot's
//! parking lot: the check and the enqueue happen under the same shard lock,
//! so a wakeup cannot be missed, and the lock is released before any waker is
//! woken or any key is dropped.

pub(crate) mod acquire;
pub(crate) mod blocking;
pub(crate) mod guard;
pub(crate) mod labels;
pub(crate) mod layer_state;
pub(crate) mod status;
pub(crate) mod upgrade;

use std::borrow::Borrow;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;
use std::ops::DerefMut;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_utils::CachePadded;

use crate::error::{LockError, TryLockError};
use crate::keys::deferred::{Ctx, Leftovers};
use crate::keys::waiter::Waiter;
use crate::keys::{Grant, ShardState, ENTRY_PRESENT};
use crate::support::fairness::Fairness;
use crate::support::key_map::Index;
use crate::support::key_slot::KeyPtr;
use crate::support::lease::{
    LeasePolicy, LockOptions, PackedDuration, Terms, DEFAULT_MAX_LEASE, MIN_LEASE,
};
use crate::support::mode::Mode;
use crate::support::shard_lock::ShardMutex;
use crate::support::stats::{Counters, Stats};
use crate::support::token::{FencingToken, TokenCounter};
use crate::table::acquire::{Lock, LockOwned, LockOwnedWith, LockWith};
use crate::table::guard::{Guard, Held, OwnedGuard};
use crate::table::labels::Labels;
use crate::table::layer_state::LayerState;
use crate::time::clock::ShardHook;
use crate::time::clock::{Clock, Now};
use crate::time::timer_driver::ShardTimer;

/// The hasher a table uses unless told otherwise: fast, and seeded per table.
pub type DefaultHashBuilder = foldhash::fast::RandomState;

/// One shard: its lock-protected state and its counters (after it, in
/// order: the lock and the hot part of the state share the first cache line).
#[repr(C)]
pub(crate) struct Shard<K> {
    pub(crate) state: ShardMutex<ShardState<K>>,
    pub(crate) counters: Counters,
    /// Wakes the shard's waiters at their deadlines (real clock only).
    pub(crate) timer: ShardTimer,
}

impl<K> Shard<K> {
    /// An operation's context on this shard, made after locking it.
    #[inline(always)]
    pub(crate) fn ctx<'a, 'l>(
        &'a self,
        clock: &'a Clock,
        left: &'l mut Leftovers<K>,
    ) -> Ctx<'a, 'l, K> {
        let hook = ShardHook {
            ptr: std::ptr::from_ref(self).cast(),
            fire: fire_shard::<K>,
        };
        Ctx::new(clock, &self.counters, (&self.timer, hook), left)
    }
}

/// The timer thread fires a shard's timer: nudges the waiters due at `now`
/// and returns the shard's next deadline.
///
/// # Safety
///
/// `ptr` is a `&Shard<K>` of a table that still exists (a table cancels its
/// shards' timers when it is dropped; see [`ShardHook`]).
unsafe fn fire_shard<K>(ptr: *const (), now: u64, wakers: &mut Vec<std::task::Waker>) -> u64 {
    // SAFETY: the caller's contract.
    let shard = unsafe { &*ptr.cast::<Shard<K>>() };
    let mut state = shard.state.lock();
    let next = state.fire_timers(now, wakers);
    shard.timer.set_armed(next);
    next
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
    clock: Clock,
    leases: LeasePolicy,
    fairness: Fairness,
    token_floor: u64,
    /// The transaction layer's state (its deadlock detector and its holds),
    /// made when a transaction first needs it; the table never reads it.
    transactions: LayerState,
    /// The transaction layer's settings: the most transactions a deadlock
    /// search visits (0: off), and how many broken cycles are kept.
    deadlock_limit: usize,
    deadlock_history: usize,
    /// Labeled transactions' labels (see `labels.rs`).
    labels: Labels,
    /// How errors name a key ([`Builder::name_keys`]); read only when an
    /// error is made.
    key_name: Option<fn(&K) -> Box<str>>,
    /// Set once the status view is first read: from then on a wait without
    /// a timeout reads the coarse clock to stamp when it began (the view's
    /// `since`). Until then it reads no clock: a table whose view nobody
    /// reads pays nothing for it. A hint, read and written relaxed: a wait
    /// that links while the view is first read may go unstamped.
    wait_starts: std::sync::atomic::AtomicBool,
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
        Self::builder().build()
    }

    /// Starts configuring a table.
    ///
    /// ```
    /// let table: keylock::LockTable<String> = keylock::LockTable::builder().shards(8).build();
    /// assert_eq!(table.shard_count(), 8);
    /// ```
    pub fn builder() -> Builder<K> {
        Builder::new()
    }
}

impl<K: Eq + Hash> Default for LockTable<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K, S> Drop for LockTable<K, S> {
    fn drop(&mut self) {
        // After this, the timer thread never touches the shards again.
        for shard in self.shards.iter() {
            let ptr: *const Shard<K> = &**shard;
            shard.timer.cancel(&self.clock, ptr.cast());
        }
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
    /// A key whose holder's lease lapsed, or whose fenced guard still exists,
    /// may still be counted until that guard is dropped or the key is next
    /// touched.
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

    /// The fairness policy the table was built with.
    ///
    /// ```
    /// let table: keylock::LockTable<u8> = keylock::LockTable::new();
    /// assert_eq!(table.fairness(), keylock::Fairness::Strict);
    /// ```
    pub fn fairness(&self) -> Fairness {
        self.fairness
    }

    /// The floor the table was built with: every token it mints is greater
    /// (see [`Builder::token_floor`]).
    ///
    /// ```
    /// let table: keylock::LockTable<u8> = keylock::LockTable::builder().token_floor(41).build();
    /// assert_eq!(table.token_floor(), 41);
    /// assert!(table.try_lock(0).unwrap().token().get() > 41);
    /// ```
    pub fn token_floor(&self) -> u64 {
        self.token_floor
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
        let index = self.shard_index(hash);
        debug_assert!(index < self.shards.len());
        // SAFETY: `mask` is the shard count (a power of two) minus one, so
        // `index` is in bounds.
        unsafe { self.shards.get_unchecked(index) }
    }

    /// Checks the table's internal invariants (queue links, waiter counts,
    /// every waiter slot accounted for, no idle entry kept), panicking with the
    /// one broken. For tests and fuzzing; needs the `test-util` feature.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    #[doc(hidden)]
    pub fn assert_consistent(&self) {
        for shard in self.shards.iter() {
            shard.state.lock().validate(self.fairness);
        }
    }

    /// The index of the shard of `hash`. The low bits pick a bucket inside
    /// the shard's table and the top seven its tag: the shard comes from
    /// the bits in between.
    #[inline(always)]
    fn shard_index(&self, hash: u64) -> usize {
        (hash >> 32) as usize & self.mask
    }

    /// The shard at `index` (below [`shard_count`](Self::shard_count)).
    pub(crate) fn shard_at(&self, index: usize) -> &Shard<K> {
        &self.shards[index]
    }

    /// The labels of the table's labeled transactions.
    #[inline]
    pub(crate) fn labels(&self) -> &Labels {
        &self.labels
    }

    /// The owner word a grant asked for with `opts` carries: its
    /// transaction's id, or its label's (looked up only when it has one).
    #[inline(always)]
    pub(crate) fn owner_for(&self, opts: &LockOptions) -> u64 {
        match opts.label_name() {
            Some(label) if opts.owner_id() == 0 => self.labels.plain(label),
            _ => opts.owner_id(),
        }
    }

    /// The transaction layer's slot (see `layer_state.rs`), and its
    /// settings: the deadlock search limit and history.
    #[inline]
    pub(crate) fn transaction_slot(&self) -> (&LayerState, usize, usize) {
        (
            &self.transactions,
            self.deadlock_limit,
            self.deadlock_history,
        )
    }

    /// The transactions `owner`'s waiter on `key` waits for, appended to
    /// `out`, and the shard's count of queue jumps when they were read (see
    /// [`queue_jumps`](Self::queue_jumps)); `None` if it has no waiter
    /// queued there. See `keys/edges.rs`.
    pub(crate) fn wait_edges(
        &self,
        hash: u64,
        key: &K,
        owner: u64,
        out: &mut crate::keys::Edges,
    ) -> Option<u64>
    where
        K: Eq,
    {
        let mut now = Now::new(&self.clock);
        let shard = self.shard(hash);
        let mut state = shard.state.lock();
        let jumps = shard.counters.queue_jumps();
        state
            .wait_edges(hash, key, owner, out, &mut now)
            .then_some(jumps)
    }

    /// Whether a waiter is queued on the key of `hash` at `key` (a grant
    /// keeps its entry in the table): any waiter that may wait for its
    /// holders, and so an edge of the wait-for graph into them. Nothing is
    /// settled or woken (safe under the detector's lock).
    pub(crate) fn is_awaited(&self, hash: u64, key: KeyPtr<K>) -> bool {
        let mut state = self.shard(hash).state.lock();
        state.is_awaited(hash, key)
    }

    /// How many times a grant or waiter went past the queued waiters of the
    /// shard of `hash`: while it has not moved, the edges read from that
    /// shard are a superset of its waits' edges now (the only other changes
    /// remove edges, or turn a waiter ahead into a holder: the same
    /// transaction).
    #[inline]
    pub(crate) fn queue_jumps(&self, hash: u64) -> u64 {
        self.shard(hash).counters.queue_jumps()
    }

    /// Whether every edge `(hash, key, owner, next)` holds (`owner`'s
    /// waiter on `key` waits for `next`) with the shards of all the keys
    /// locked at once. The shards are locked in index order; nothing else
    /// holds two shard locks, so this cannot deadlock with anything.
    pub(crate) fn edges_hold(&self, edges: &[(u64, &K, u64, u64)]) -> bool
    where
        K: Eq,
    {
        let mut indices: Vec<usize> = edges.iter().map(|e| self.shard_index(e.0)).collect();
        indices.sort_unstable();
        indices.dedup();
        let mut locked: Vec<_> = indices
            .iter()
            .map(|&i| self.shards[i].state.lock())
            .collect();
        let mut now = Now::new(&self.clock);
        let mut out = crate::keys::Edges::new();
        edges.iter().all(|&(hash, key, owner, next)| {
            let at = indices
                .binary_search(&self.shard_index(hash))
                .expect("locked above");
            out.clear();
            locked[at].wait_edges(hash, key, owner, &mut out, &mut now)
                && out.iter().any(|e| e.to == next)
        })
    }

    #[inline]
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// When a wait without a timeout began, for the status view: the
    /// coarse clock's reading on the real clock once the view has been read
    /// (see [`watch_wait_starts`](Self::watch_wait_starts)), else none (no
    /// clock read).
    #[inline]
    pub(crate) fn wait_stamp(&self) -> crate::time::clock::Stamp {
        if self.wait_starts.load(std::sync::atomic::Ordering::Relaxed) {
            self.clock.wait_stamp()
        } else {
            crate::time::clock::Stamp::NONE
        }
    }

    /// Whether waits are stamped (a status view was read): if not,
    /// [`wait_stamp`](Self::wait_stamp) is none.
    #[inline(always)]
    pub(crate) fn watches_wait_starts(&self) -> bool {
        self.wait_starts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The status view is being read: stamp every wait from now on. Written
    /// once (a load first keeps later readers off the line).
    #[inline]
    pub(crate) fn watch_wait_starts(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.wait_starts.load(Relaxed) {
            self.wait_starts.store(true, Relaxed);
        }
    }

    #[inline]
    pub(crate) fn leases(&self) -> &LeasePolicy {
        &self.leases
    }

    /// Runs `op` on the shard of `hash` under its lock, then wakes and drops
    /// what it left to do, after unlocking.
    #[inline(always)]
    pub(crate) fn with_shard<R>(
        &self,
        hash: u64,
        op: impl FnOnce(&mut ShardState<K>, &mut Ctx<'_, '_, K>) -> R,
    ) -> R {
        let mut left = Leftovers::default();
        let result = self.with_shard_leaving(hash, &mut left, op);
        left.flush();
        result
    }

    /// [`with_shard`](Self::with_shard), leaving what must be done after
    /// unlocking (wakes, drops) in `left`, which the caller drops (or
    /// flushes) later: for a caller that holds a lock of its own around the
    /// operation, and must not run user code under it.
    #[inline(always)]
    pub(crate) fn with_shard_leaving<R>(
        &self,
        hash: u64,
        left: &mut Leftovers<K>,
        op: impl FnOnce(&mut ShardState<K>, &mut Ctx<'_, '_, K>) -> R,
    ) -> R {
        let shard = self.shard(hash);
        let mut state = shard.state.lock();
        // Made after locking: stores made before a locked compare-and-swap
        // must drain before it completes.
        let mut ctx = shard.ctx(&self.clock, left);
        let result = op(&mut state, &mut ctx);
        drop(state);
        result
    }

    /// Releases the grant `token` of the key at `key`; the holder gives proof
    /// of ownership with its token, so a stale release frees nothing.
    ///
    /// The common release (the only holder lets go, nobody waits) runs
    /// inline, with nothing deferred; the rest out of line.
    #[inline(always)]
    pub(crate) fn release(&self, hash: u64, key: KeyPtr<K>, token: FencingToken) {
        let shard = self.shard(hash);
        // A shard held by another thread is waited for out of line, so that
        // this path keeps nothing across the wait.
        match shard.state.try_lock() {
            Some(state) => self.release_locked(shard, state, hash, key, token),
            None => self.release_contended(hash, key, token),
        }
    }

    /// [`release`](Self::release) when the shard's lock was taken.
    #[cold]
    #[inline(never)]
    fn release_contended(&self, hash: u64, key: KeyPtr<K>, token: FencingToken) {
        let shard = self.shard(hash);
        let state = shard.state.lock();
        self.release_locked(shard, state, hash, key, token);
    }

    /// [`release`](Self::release) under the shard's lock (`state`).
    #[inline(always)]
    fn release_locked(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) {
        let mut state = state;
        match state.release_alone(hash, key, token) {
            Ok(key) => {
                drop(state);
                // After unlocking: `K::drop` is user code.
                drop(key);
            }
            // Out of line, so that the lone release above stays small.
            Err(Some(index)) => self.release_busy(shard, state, index, token),
            Err(None) => self.release_general(shard, state, None, token),
        }
    }

    /// [`release`](Self::release) of a key with waiters, other holders or
    /// fenced guards, or of a fenced grant; `state` is the shard's, locked.
    /// The common handoff (a plain head granted the key) is inline here.
    ///
    /// A head without a lease is handed the key here, with no call but the
    /// last (so that this keeps nothing across a call, and saves no
    /// registers); one with a lease reads the clock, in
    /// [`release_leased`](Self::release_leased).
    #[inline(never)]
    fn release_busy(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        index: Index,
        token: FencingToken,
    ) {
        let mut state = state;
        let Some(head) = state.plain_head(index, token, self.fairness) else {
            return self.release_general(shard, state, Some(index), token);
        };
        if head.1.nanos().is_some() {
            // Six words of arguments, all in registers: a tail call.
            return self.release_leased(shard, state, index, token);
        }
        let shard_parts = (&shard.counters, &shard.timer, &self.clock);
        // SAFETY: `head` is `plain_head`'s answer, just now, under this lock.
        match unsafe { state.hand_off_to(index, head, shard_parts) } {
            Some(waker) => {
                drop(state);
                // After unlocking: `Waker::wake` is user code.
                if let Some(waker) = waker {
                    wake_unlocked(waker);
                }
            }
            None => self.release_general(shard, state, Some(index), token),
        }
    }

    /// [`release_busy`](Self::release_busy) of a plain head with a lease
    /// ([`ShardState::plain_head`] found it, under this lock): its grant
    /// reads the clock.
    #[inline(never)]
    fn release_leased(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        index: Index,
        token: FencingToken,
    ) {
        let mut state = state;
        let shard_parts = (&shard.counters, &shard.timer, &self.clock);
        // SAFETY: `plain_head` found a plain head at `index` under this
        // lock, and nothing changed since (the caller).
        let Some(head) = (unsafe { state.plain_head_again(index) }) else {
            return self.release_general(shard, state, Some(index), token);
        };
        // SAFETY: as above.
        if let Some(waker) = unsafe { state.hand_off_to(index, head, shard_parts) } {
            drop(state);
            // After unlocking: `Waker::wake` is user code.
            if let Some(waker) = waker {
                wake_unlocked(waker);
            }
            return;
        }
        self.release_general(shard, state, Some(index), token);
    }

    /// [`release_busy`](Self::release_busy) past the plain handoff.
    #[cold]
    #[inline(never)]
    fn release_general(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        index: Option<Index>,
        token: FencingToken,
    ) {
        // Declared before the shard guard, so dropped after it: the wakes
        // and drops it holds run unlocked, also when unwinding.
        let mut left = Leftovers::default();
        let mut state = state;
        match index {
            Some(index) => {
                let mut ctx = shard.ctx(&self.clock, &mut left);
                state.release_at(index, token, self.fairness, &mut ctx);
            }
            None => debug_assert!(false, "{ENTRY_PRESENT}"),
        }
        drop(state);
        left.flush();
    }

    /// Releases grant `token` if it still holds the key, live (`true`);
    /// otherwise does nothing (`false`): the grant is lost, and its holder
    /// names the key before releasing it.
    ///
    /// A grant without a lease is live while it holds the key: released as
    /// [`release`](Self::release) releases, with no clock read.
    #[inline]
    pub(crate) fn release_if_live(&self, hash: u64, key: KeyPtr<K>, token: FencingToken) -> bool {
        let shard = self.shard(hash);
        let mut state = shard.state.lock();
        match state.release_unleased(hash, key, token) {
            Ok(key) => {
                drop(state);
                // After unlocking: `K::drop` is user code.
                drop(key);
                true
            }
            Err(Some(index)) => {
                self.release_busy(shard, state, index, token);
                true
            }
            Err(None) => self.release_if_live_general(shard, state, hash, key, token),
        }
    }

    /// [`release_if_live`](Self::release_if_live) of a leased or lost grant.
    #[cold]
    #[inline(never)]
    fn release_if_live_general(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) -> bool {
        // Declared before the shard guard, so dropped after it.
        let mut left = Leftovers::default();
        let mut state = state;
        let mut ctx = shard.ctx(&self.clock, &mut left);
        let live = state.release_if_live(hash, key, token, self.fairness, &mut ctx);
        drop(state);
        left.flush();
        live
    }

    /// Unlinks a dropped future's waiter; a grant it had not observed yet is
    /// released as a guard would release it.
    #[cold]
    pub(crate) fn leave(&self, hash: u64, key: KeyPtr<K>, waiter: &Waiter) {
        let fairness = self.fairness;
        self.with_shard(hash, |state, ctx| {
            // SAFETY: called only by the waiter's owner, from its `Drop`,
            // while the waiter is linked into `key`'s queue or granted.
            let _ = unsafe {
                state.leave(
                    hash,
                    key,
                    waiter,
                    crate::keys::Leaving::Dropped,
                    fairness,
                    ctx,
                )
            };
        });
    }

    /// Whether grant `token` holds the key with a live lease; nothing is
    /// settled, so nothing is woken or dropped (safe under another lock).
    pub(crate) fn grant_is_live(&self, hash: u64, key: KeyPtr<K>, token: FencingToken) -> bool {
        let mut now = Now::new(&self.clock);
        let mut state = self.shard(hash).state.lock();
        state.is_live(hash, key, token, &mut now)
    }

    pub(crate) fn check_grant(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) -> Result<FencingToken, LockError> {
        let checked = self.with_shard(hash, |state, ctx| state.check(hash, key, token, ctx));
        self.named(key, checked)
    }

    /// `result`, its error naming `key` if the table names keys. Called
    /// after the shard lock is released (naming runs the key's `Debug`), by
    /// a guard's own call (a caller under a lock of its own, a transaction,
    /// names keys itself).
    fn named<T>(&self, key: KeyPtr<K>, result: Result<T, LockError>) -> Result<T, LockError> {
        result.map_err(|err| {
            // SAFETY: the caller's guard points at `key`, which keeps its
            // entry, and the key in it, in the table.
            err.with_key(|| self.name_key(unsafe { key.get() }))
        })
    }

    /// [`check_grant`](Self::check_grant), leaving the wakes and drops of
    /// what it settles in `left` (for a caller under a lock of its own).
    pub(crate) fn check_grant_leaving(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        left: &mut Leftovers<K>,
    ) -> Result<FencingToken, LockError> {
        self.with_shard_leaving(hash, left, |state, ctx| state.check(hash, key, token, ctx))
    }

    /// Renews grant `token`; on success its new deadline is stored into
    /// `cache` (the guard's copy) under the shard lock, so the copy is never
    /// behind the table, even if waking the head waiter then panics.
    pub(crate) fn renew_grant(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        lease: Duration,
        cache: &crate::table::guard::GrantCache,
    ) -> Result<(), LockError> {
        let mut left = Leftovers::default();
        let renewed = self.renew_grant_leaving(hash, key, token, lease, cache, &mut left);
        left.flush();
        self.named(key, renewed)
    }

    /// [`renew_grant`](Self::renew_grant), leaving the wakes and drops of
    /// what it settles in `left` (for a caller under a lock of its own).
    pub(crate) fn renew_grant_leaving(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        lease: Duration,
        cache: &crate::table::guard::GrantCache,
        left: &mut Leftovers<K>,
    ) -> Result<(), LockError> {
        let lease = self.leases.check(lease)?;
        self.with_shard_leaving(hash, left, |state, ctx| {
            let deadline = state.renew(hash, key, token, lease, ctx)?;
            // A lease too long for the clock to represent never ends: it
            // reads back as no deadline.
            cache.set_deadline(deadline);
            Ok(())
        })
    }

    /// See [`ShardState::watch_grant`].
    pub(crate) fn watch_grant(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        slot: &mut Option<usize>,
        current: &std::task::Waker,
        fresh: Option<std::task::Waker>,
    ) -> crate::keys::Watch {
        self.with_shard(hash, |state, ctx| {
            state.watch_grant(hash, key, token, slot, current, fresh, ctx)
        })
    }

    /// See [`ShardState::unwatch_grant`].
    pub(crate) fn unwatch_grant(&self, hash: u64, slot: usize) {
        self.with_shard(hash, |state, ctx| state.unwatch_grant(slot, ctx));
    }

    /// Makes grant `token` shared; see [`ShardState::downgrade`].
    pub(crate) fn downgrade_grant(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
        cache: &crate::table::guard::GrantCache,
    ) -> Result<(), LockError> {
        let downgraded = self.with_shard(hash, |state, ctx| {
            state.downgrade(hash, key, token, ctx)?;
            cache.set_shared();
            Ok(())
        });
        self.named(key, downgraded)
    }

    /// See [`ShardState::deadline_of`].
    pub(crate) fn grant_deadline(
        &self,
        hash: u64,
        key: KeyPtr<K>,
        token: FencingToken,
    ) -> Result<crate::time::clock::Stamp, std::time::Instant> {
        self.with_shard(hash, |state, ctx| state.deadline_of(hash, key, token, ctx))
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
    #[inline(always)]
    pub fn lock(&self, key: K) -> Lock<'_, K, S> {
        Lock::new(self, key, LockOptions::new())
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
    #[inline(always)]
    pub fn lock_owned(self: Arc<Self>, key: K) -> LockOwned<K, S> {
        LockOwned::new(self, key, LockOptions::new())
    }

    /// Like [`lock`](Self::lock), with a lease and/or a timeout.
    ///
    /// The lease (the call's own, else the table's default) is measured from
    /// the moment the key is granted, even if this future runs later. Invalid
    /// options fail on the first poll, before anything is queued.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a lease out of range;
    /// [`LockError::Timeout`] when the timeout ran out, naming the holder at
    /// that moment.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockError, LockOptions, LockTable};
    /// let table = LockTable::new();
    /// let held = table.lock("k").await;
    /// let err = table
    ///     .lock_with("k", LockOptions::new().timeout(Duration::from_millis(10)))
    ///     .await
    ///     .unwrap_err();
    /// assert!(matches!(err, LockError::Timeout { holder: Some(t), .. } if t == held.token()));
    /// # });
    /// ```
    #[inline(always)]
    pub fn lock_with(&self, key: K, opts: LockOptions) -> LockWith<'_, K, S> {
        LockWith::new(self, key, opts)
    }

    /// Like [`lock_with`](Self::lock_with), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`lock_with`](Self::lock_with).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::{sync::Arc, time::Duration};
    /// let table = Arc::new(keylock::LockTable::new());
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(10));
    /// let guard = table.clone().lock_owned_with(3, opts).await.unwrap();
    /// assert!(guard.expires_at().is_some());
    /// # });
    /// ```
    #[inline(always)]
    pub fn lock_owned_with(self: Arc<Self>, key: K, opts: LockOptions) -> LockOwnedWith<K, S> {
        LockOwnedWith::new(self, key, opts)
    }

    /// Waits until `key` can be held shared and takes it in
    /// [`Mode::Shared`]: together with any other shared holders, never with
    /// an exclusive one. The queue stays FIFO: while an exclusive request
    /// waits, later shared requests wait behind it (writers are not
    /// starved), and consecutive shared waiters are granted together.
    ///
    /// The same as `lock_with(key, LockOptions::new().shared())`, without
    /// the `Result`.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// let table = keylock::LockTable::new();
    /// let a = table.lock_shared("config").await;
    /// let b = table.lock_shared("config").await; // held together
    /// assert_ne!(a.token(), b.token()); // each grant has its own token
    /// assert!(table.try_lock("config").is_err());
    /// # });
    /// ```
    #[inline(always)]
    pub fn lock_shared(&self, key: K) -> Lock<'_, K, S> {
        Lock::new(self, key, LockOptions::new().shared())
    }

    /// Like [`lock_shared`](Self::lock_shared), for a table behind an
    /// [`Arc`].
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`lock`](Self::lock).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().lock_shared_owned(7).await;
    /// assert_eq!(guard.mode(), keylock::Mode::Shared);
    /// # });
    /// ```
    #[inline(always)]
    pub fn lock_shared_owned(self: Arc<Self>, key: K) -> LockOwned<K, S> {
        LockOwned::new(self, key, LockOptions::new().shared())
    }

    /// Takes `key` shared if no exclusive grant holds it and nobody waits
    /// for it (a waiting writer is served first).
    ///
    /// # Errors
    ///
    /// [`TryLockError::WouldBlock { key: None }`] if the key is held exclusively or
    /// awaited.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let a = table.try_lock_shared("k").unwrap();
    /// let b = table.try_lock_shared("k").unwrap();
    /// assert!(table.try_lock("k").is_err());
    /// # drop((a, b));
    /// ```
    #[inline]
    pub fn try_lock_shared(&self, key: K) -> Result<Guard<'_, K, S>, TryLockError> {
        let hash = self.hash(&key);
        let (grant, spare) = self.try_acquire(
            hash,
            key,
            Mode::Shared,
            Terms::lease(self.leases.default_packed),
        );
        let key_name = self.key_name;
        let guard = grant.map(|grant| Guard::new(self, Held::new(hash, grant)));
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(TryLockError::WouldBlock { key })
    }

    /// Like [`try_lock_shared`](Self::try_lock_shared), for a table behind
    /// an [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`try_lock_shared`](Self::try_lock_shared).
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().try_lock_shared_owned(5).unwrap();
    /// assert_eq!(guard.mode(), keylock::Mode::Shared);
    /// ```
    #[inline]
    pub fn try_lock_shared_owned(
        self: Arc<Self>,
        key: K,
    ) -> Result<OwnedGuard<K, S>, TryLockError> {
        let hash = self.hash(&key);
        let (grant, spare) = self.try_acquire(
            hash,
            key,
            Mode::Shared,
            Terms::lease(self.leases.default_packed),
        );
        let key_name = self.key_name;
        let guard = grant.map(|grant| OwnedGuard::new(self, Held::new(hash, grant)));
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(TryLockError::WouldBlock { key })
    }

    /// Blocks the current thread until `key` can be held shared and takes
    /// it; see [`blocking_lock`](Self::blocking_lock) for where to call it.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let a = table.blocking_lock_shared("file.txt");
    /// let b = table.blocking_lock_shared("file.txt");
    /// assert_eq!(b.mode(), keylock::Mode::Shared);
    /// # drop((a, b));
    /// ```
    pub fn blocking_lock_shared(&self, key: K) -> Guard<'_, K, S> {
        crate::table::blocking::block_on(self.lock_shared(key))
    }

    /// Takes `key` if it is free and nobody waits for it.
    ///
    /// # Errors
    ///
    /// [`TryLockError::WouldBlock { key: None }`] if the key is held or awaited.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.try_lock("a").unwrap();
    /// assert!(table.try_lock("a").is_err());
    /// drop(guard);
    /// assert!(table.try_lock("a").is_ok());
    /// ```
    #[inline(always)]
    pub fn try_lock(&self, key: K) -> Result<Guard<'_, K, S>, TryLockError> {
        let hash = self.hash(&key);
        let (grant, spare) = self.try_acquire(
            hash,
            key,
            Mode::Exclusive,
            Terms::lease(self.leases.default_packed),
        );
        let key_name = self.key_name;
        let guard = grant.map(|grant| Guard::new(self, Held::new(hash, grant)));
        // After the guard exists: if the spare key's drop panics, unwinding
        // drops the guard, which releases.
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(TryLockError::WouldBlock { key })
    }

    /// Like [`try_lock`](Self::try_lock), with a lease (the timeout, if any,
    /// is ignored: this never waits).
    ///
    /// # Errors
    ///
    /// [`LockError::WouldBlock { key: None }`] if the key is held or awaited;
    /// [`LockError::InvalidOptions`] for a lease out of range.
    ///
    /// ```
    /// use std::time::Duration;
    /// let table = keylock::LockTable::new();
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(1));
    /// let guard = table.try_lock_with("k", opts).unwrap();
    /// assert!(!guard.is_expired());
    /// ```
    pub fn try_lock_with(&self, key: K, opts: LockOptions) -> Result<Guard<'_, K, S>, LockError> {
        let lease = self.leases.resolve(opts.lease_duration())?;
        let hash = self.hash(&key);
        let (grant, spare) =
            self.try_acquire(hash, key, opts.lock_mode(), terms_of(self, lease, &opts));
        let key_name = self.key_name;
        let guard = grant.map(|grant| Guard::new(self, Held::new(hash, grant)));
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(LockError::WouldBlock { key })
    }

    /// Like [`try_lock`](Self::try_lock), for a table behind an [`Arc`].
    ///
    /// # Errors
    ///
    /// [`TryLockError::WouldBlock { key: None }`] if the key is held or awaited.
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
        let (grant, spare) = self.try_acquire(
            hash,
            key,
            Mode::Exclusive,
            Terms::lease(self.leases.default_packed),
        );
        let key_name = self.key_name;
        let guard = grant.map(|grant| OwnedGuard::new(self, Held::new(hash, grant)));
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(TryLockError::WouldBlock { key })
    }

    /// Like [`try_lock_with`](Self::try_lock_with), for a table behind an
    /// [`Arc`].
    ///
    /// # Errors
    ///
    /// As [`try_lock_with`](Self::try_lock_with).
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().try_lock_owned_with(1, Default::default()).unwrap();
    /// assert_eq!(guard.expires_at(), None);
    /// ```
    pub fn try_lock_owned_with(
        self: Arc<Self>,
        key: K,
        opts: LockOptions,
    ) -> Result<OwnedGuard<K, S>, LockError> {
        let lease = self.leases.resolve(opts.lease_duration())?;
        let hash = self.hash(&key);
        let (grant, spare) =
            self.try_acquire(hash, key, opts.lock_mode(), terms_of(&self, lease, &opts));
        let key_name = self.key_name;
        let guard = grant.map(|grant| OwnedGuard::new(self, Held::new(hash, grant)));
        let key = if guard.is_none() {
            would_block_name(key_name, spare.as_ref())
        } else {
            None
        };
        drop(spare);
        guard.ok_or(LockError::WouldBlock { key })
    }

    /// One attempt with `opts` that gives the caller's key back if the key
    /// could not be taken at once (or the options are invalid: the wait
    /// that follows reports that), for a caller that then waits for it.
    /// `hash` is the table's hash of `key`, which the caller has computed.
    pub(crate) fn try_lock_kept(
        &self,
        hash: u64,
        key: K,
        opts: LockOptions,
    ) -> Result<Guard<'_, K, S>, K> {
        let Ok(lease) = self.leases.resolve(opts.lease_duration()) else {
            return Err(key);
        };
        self.try_lock_on(hash, key, opts.lock_mode(), terms_of(self, lease, &opts))
    }

    /// The terms of an owner's grants (a transaction's: its id, and its
    /// lease or else the table's default), resolved once for all the keys
    /// of a call; `None` for a lease out of range (the wait that follows
    /// reports it).
    #[inline]
    pub(crate) fn owner_terms(&self, lease: Option<Duration>, owner: u64) -> Option<Terms> {
        let lease = match lease {
            None => self.leases.default_packed,
            Some(lease) => self.leases.check_packed(lease).ok()?,
        };
        Some(Terms { lease, owner })
    }

    /// [`try_lock_kept`](Self::try_lock_kept) on terms resolved by
    /// [`owner_terms`](Self::owner_terms), inline: the probe and insert of
    /// a free key run in the caller's frame, the grant in its registers.
    #[inline(always)]
    pub(crate) fn try_lock_on(
        &self,
        hash: u64,
        key: K,
        mode: Mode,
        terms: Terms,
    ) -> Result<Guard<'_, K, S>, K> {
        debug_assert_eq!(hash, self.hash(&key));
        match self.try_acquire(hash, key, mode, terms) {
            (Some(grant), spare) => {
                let guard = Guard::new(self, Held::new(hash, grant));
                // After the guard exists: if the spare key's drop panics,
                // unwinding drops the guard, which releases.
                drop(spare);
                Ok(guard)
            }
            (None, spare) => Err(spare.expect("kept when not taken")),
        }
    }

    /// [`try_lock_kept`](Self::try_lock_kept) for a caller that holds a lock
    /// of its own (an owned transaction's set): nothing is woken or dropped
    /// here. What the attempt leaves to do is left in `left`; the caller's
    /// key is taken from its slot only if the table keeps it (also if an
    /// `Eq` panics in the probe), so that the caller drops both after
    /// releasing its lock.
    #[inline]
    pub(crate) fn try_lock_leaving(
        &self,
        hash: u64,
        key: &mut Option<K>,
        opts: LockOptions,
        left: &mut Leftovers<K>,
    ) -> Option<Guard<'_, K, S>> {
        let Ok(lease) = self.leases.resolve(opts.lease_duration()) else {
            return None;
        };
        let (mode, terms, fairness) = (
            opts.lock_mode(),
            terms_of(self, lease, &opts),
            self.fairness,
        );
        let grant = self.with_shard_leaving(hash, left, |state, ctx| {
            state.try_acquire(hash, key, mode, terms, fairness, ctx)
        })?;
        Some(Guard::new(self, Held::new(hash, grant)))
    }

    /// One attempt; returns the grant, and the caller's key if the table
    /// did not keep it, for the caller to drop once its guard exists.
    ///
    /// A key with no entry is taken inline, with nothing deferred; a busy
    /// key goes on out of line.
    #[inline(always)]
    fn try_acquire(
        &self,
        hash: u64,
        key: K,
        mode: Mode,
        terms: Terms,
    ) -> (Option<Grant<K>>, Option<K>) {
        // Outside the shard lock: if `K: Eq` panics during the probe, the
        // lock is released before the key is dropped.
        let mut key = Some(key);
        let shard = self.shard(hash);
        let mut state = shard.state.lock();
        let mut now = Now::new(&self.clock);
        match state.claim(hash, &mut key, mode, terms, &mut now, &shard.counters) {
            Ok(grant) => {
                drop(state);
                (Some(grant), key)
            }
            Err(index) => (
                self.try_acquire_busy(shard, state, hash, index, mode, terms),
                key,
            ),
        }
    }

    /// [`try_acquire`](Self::try_acquire) of a key that has an entry (at
    /// `index`); `state` is the shard's, locked.
    #[cold]
    #[inline(never)]
    fn try_acquire_busy(
        &self,
        shard: &Shard<K>,
        state: impl DerefMut<Target = ShardState<K>>,
        hash: u64,
        index: Index,
        mode: Mode,
        terms: Terms,
    ) -> Option<Grant<K>> {
        // As in `release_busy`: dropped after the shard guard.
        let mut left = Leftovers::default();
        let mut state = state;
        let grant = {
            let mut ctx = shard.ctx(&self.clock, &mut left);
            state.try_acquire_busy(index, mode, terms, self.fairness, &mut ctx)
        };
        drop(state);
        self.flush_for_grant(hash, grant, &mut left)
    }

    /// Runs what a try left to do after unlocking (`left`: a lapsed
    /// holder's loss watchers' wakes, say), then hands `grant` on. The
    /// wakes are user code: if one panics, the grant, not yet any guard's,
    /// is released as the panic unwinds, not stranded.
    #[inline(always)]
    fn flush_for_grant(
        &self,
        hash: u64,
        grant: Option<Grant<K>>,
        // By reference: the record is a few hundred bytes, and a move
        // copies it.
        left: &mut Leftovers<K>,
    ) -> Option<Grant<K>> {
        let Some(grant) = grant else {
            left.flush();
            return None;
        };
        let undo = ReleaseOnUnwind {
            table: self,
            hash,
            key: grant.key,
            token: grant.token,
        };
        left.flush();
        std::mem::forget(undo);
        Some(grant)
    }

    /// Blocks the current thread until `key` is free and takes it.
    ///
    /// The thread parks and is unparked when the key is handed to it (under
    /// [`Fairness::Eventual`] it first spins briefly, taking the key as soon
    /// as it is free). No executor is entered, so this works on any thread,
    /// including inside another executor's `block_on`.
    ///
    /// # Blocking inside async code
    ///
    /// On a runtime's worker thread this blocks the worker, and every task
    /// queued on it, until the key comes: if the holder is a task that needs
    /// that worker to run (a current-thread runtime, or all workers blocked
    /// this way), it never runs and the thread waits for ever. Use
    /// [`lock`](Self::lock) in async code, or move the call off the runtime
    /// (`tokio::task::spawn_blocking`, `smol::unblock`).
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let guard = table.blocking_lock("file.txt");
    /// assert!(table.is_locked("file.txt"));
    /// # drop(guard);
    /// ```
    pub fn blocking_lock(&self, key: K) -> Guard<'_, K, S> {
        let hash = self.hash(&key);
        let mut key = Some(key);
        if let Some(grant) = self.spin_for(hash, &mut key) {
            let guard = Guard::new(self, Held::new(hash, grant));
            // After the guard exists (see `try_lock`).
            drop(key);
            return guard;
        }
        let key = key.expect("kept while not acquired");
        crate::table::blocking::block_on(self.lock(key))
    }

    /// Under eventual fairness, a blocking locker first spins briefly, taking
    /// the key as soon as it is free (as parking_lot's mutex does), so that a
    /// short critical section costs no park and unpark. Under strict
    /// fairness a free key goes to the queue, so spinning would not help.
    #[inline]
    fn spin_for(&self, hash: u64, key: &mut Option<K>) -> Option<Grant<K>> {
        if self.fairness != Fairness::Eventual {
            return None;
        }
        let terms = Terms::lease(self.leases.default_packed);
        let backoff = crossbeam_utils::Backoff::new();
        while !backoff.is_completed() {
            let fairness = self.fairness;
            let mut left = Leftovers::default();
            let grant = self.with_shard_leaving(hash, &mut left, |state, ctx| {
                state.try_acquire(hash, key, Mode::Exclusive, terms, fairness, ctx)
            });
            if let Some(grant) = self.flush_for_grant(hash, grant, &mut left) {
                return Some(grant);
            }
            // Spins, then yields the thread (as parking_lot does), a bounded
            // number of times.
            backoff.snooze();
        }
        None
    }

    /// Like [`blocking_lock`](Self::blocking_lock), for a table behind an
    /// [`Arc`]: the guard keeps the table alive and is `'static`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let table = Arc::new(keylock::LockTable::new());
    /// let guard = table.clone().blocking_lock_owned("job");
    /// std::thread::spawn(move || drop(guard)).join().unwrap();
    /// assert!(table.is_empty());
    /// ```
    pub fn blocking_lock_owned(self: Arc<Self>, key: K) -> OwnedGuard<K, S> {
        crate::table::blocking::block_on(self.lock_owned(key))
    }

    /// Like [`blocking_lock`](Self::blocking_lock), with a lease and/or a
    /// timeout. The thread is woken by the timer at a holder's lease deadline
    /// or at its own timeout.
    ///
    /// # Errors
    ///
    /// As [`lock_with`](Self::lock_with).
    ///
    /// ```
    /// use std::time::Duration;
    /// let table = keylock::LockTable::new();
    /// let _held = table.try_lock(1).unwrap();
    /// let opts = keylock::LockOptions::new().timeout(Duration::ZERO);
    /// assert!(table.blocking_lock_with(1, opts).is_err());
    /// ```
    pub fn blocking_lock_with(
        &self,
        key: K,
        opts: LockOptions,
    ) -> Result<Guard<'_, K, S>, LockError> {
        crate::table::blocking::block_on(self.lock_with(key, opts))
    }

    /// Forces the live holder of `key` out (an operator's action on a stuck
    /// key) and returns its token; the key goes to the next waiter. The
    /// revoked guard is fenced: its `check()` fails and dropping it frees
    /// nothing, and its `expires_at()` reports an instant not later than
    /// now. `None` if the key had no live holder.
    ///
    /// To revoke one particular grant, and not whoever holds the key by the
    /// time the call runs, use [`revoke_grant`](Self::revoke_grant).
    ///
    /// A waiter that had been handed the key but has not run yet is treated
    /// exactly like a guard: it is fenced, and when it runs it resolves to a
    /// guard whose `check()` fails. It is not queued again, so a future that
    /// never runs cannot keep a key.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let stuck = table.try_lock("k").unwrap();
    /// assert_eq!(table.revoke("k"), Some(stuck.token()));
    /// assert!(stuck.is_expired());
    /// assert!(table.try_lock("k").is_ok());
    /// ```
    pub fn revoke<Q>(&self, key: &Q) -> Option<FencingToken>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.with_shard(hash, |state, ctx| state.revoke(hash, key, ctx))
    }

    /// Forces out grant `token` of `key`, if it is still the key's live
    /// holder, and passes the key on to the next waiter, as
    /// [`revoke`](Self::revoke) does; returns whether it did.
    ///
    /// Unlike `revoke`, it never takes the key from someone else: if the key
    /// changed hands since `token` was seen (released, lapsed, revoked,
    /// handed to the next waiter), this does nothing and returns `false`.
    /// Use it to act on a diagnosis: the token a [`LockError::Timeout`]
    /// names, or one reported by a monitor, names exactly one grant of the
    /// table.
    ///
    /// ```
    /// let table = keylock::LockTable::new();
    /// let first = table.try_lock("k").unwrap();
    /// let stale = first.token();
    /// drop(first);
    /// let second = table.try_lock("k").unwrap();
    /// // The grant that was seen stuck has gone: the new holder is left alone.
    /// assert!(!table.revoke_grant("k", stale));
    /// assert!(!second.is_expired());
    /// assert!(table.revoke_grant("k", second.token()));
    /// assert!(second.is_expired());
    /// assert!(second.expires_at().unwrap() <= std::time::Instant::now());
    /// ```
    pub fn revoke_grant<Q>(&self, key: &Q, token: FencingToken) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.with_shard(hash, |state, ctx| state.revoke_grant(hash, key, token, ctx))
    }

    /// Whether `key` has a live holder now (a holder whose lease lapsed does
    /// not count).
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
        self.with_shard(hash, |state, ctx| state.is_held(hash, key, ctx))
    }

    /// How many futures wait for `key` (not counting its holder).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::{future::Future, pin::pin, task::Context};
    /// let table = keylock::LockTable::new();
    /// let held = table.lock(3).await;
    /// let mut waiting = pin!(table.lock(3));
    /// let mut cx = Context::from_waker(std::task::Waker::noop());
    /// assert!(waiting.as_mut().poll(&mut cx).is_pending());
    /// assert_eq!(table.waiters(&3), 1);
    /// # drop(held);
    /// # });
    /// ```
    pub fn waiters<Q>(&self, key: &Q) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hash(key);
        self.with_shard(hash, |state, _| state.waiters(hash, key))
    }
}

/// Configures a [`LockTable`].
///
/// ```
/// let table: keylock::LockTable<u32> = keylock::LockTable::builder().shards(16).build();
/// assert_eq!(table.shard_count(), 16);
/// ```
#[must_use]
pub struct Builder<K, S = DefaultHashBuilder> {
    _keys: PhantomData<fn() -> K>,
    shards: Option<usize>,
    hasher: S,
    default_lease: Option<Duration>,
    max_lease: Duration,
    clock: Clock,
    fairness: Fairness,
    token_floor: u64,
    deadlock_limit: usize,
    deadlock_history: usize,
    key_name: Option<fn(&K) -> Box<str>>,
}

// Written out: derived impls would demand `K: Clone + Debug`.
impl<K, S: Clone> Clone for Builder<K, S> {
    fn clone(&self) -> Self {
        Self {
            _keys: PhantomData,
            shards: self.shards,
            hasher: self.hasher.clone(),
            default_lease: self.default_lease,
            max_lease: self.max_lease,
            clock: self.clock.clone(),
            fairness: self.fairness,
            token_floor: self.token_floor,
            deadlock_limit: self.deadlock_limit,
            deadlock_history: self.deadlock_history,
            key_name: self.key_name,
        }
    }
}

impl<K, S> fmt::Debug for Builder<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("shards", &self.shards)
            .field("default_lease", &self.default_lease)
            .field("max_lease", &self.max_lease)
            .field("clock", &self.clock)
            .field("fairness", &self.fairness)
            .field("token_floor", &self.token_floor)
            .field("deadlock_limit", &self.deadlock_limit)
            .field("deadlock_history", &self.deadlock_history)
            .field("name_keys", &self.key_name.is_some())
            .finish_non_exhaustive()
    }
}

impl<K> Builder<K> {
    fn new() -> Self {
        Self {
            _keys: PhantomData,
            shards: None,
            hasher: DefaultHashBuilder::default(),
            default_lease: None,
            max_lease: DEFAULT_MAX_LEASE,
            clock: Clock::default(),
            fairness: Fairness::Strict,
            token_floor: 0,
            deadlock_limit: DEFAULT_DEADLOCK_LIMIT,
            deadlock_history: DEFAULT_DEADLOCK_HISTORY,
            key_name: None,
        }
    }
}

impl<K: fmt::Debug, S> Builder<K, S> {
    /// Errors of this table name the key they are about, by its `Debug`
    /// form: a [`LockError::Timeout`](crate::LockError::Timeout) says which
    /// key it waited for, a refused `try_lock`
    /// ([`TryLockError::WouldBlock`](crate::TryLockError::WouldBlock),
    /// [`LockError::WouldBlock`](crate::LockError::WouldBlock)) which key
    /// was busy, and a lost grant
    /// ([`LockError::Expired`](crate::LockError::Expired), from `check`,
    /// `renew`, `release_checked` or `lost()`), a refused upgrade
    /// ([`LockError::UpgradeConflict`](crate::LockError::UpgradeConflict))
    /// and a hold released in vain
    /// ([`LockError::NoSuchHold`](crate::LockError::NoSuchHold)) which key
    /// they are about (each in its `key` field and its message). The key is
    /// formatted only when such an error is made, after the table's locks
    /// are released, never on a lock that succeeds. A transaction's errors
    /// carry the key itself ([`TransactionError`](crate::TransactionError)),
    /// and the process and cluster scopes always name it.
    ///
    /// Without it (the default, since a table's keys need not be `Debug`)
    /// an error says "the key" and names the grant and the queue, and the
    /// caller knows the key it asked for.
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use std::time::Duration;
    /// use keylock::{LockOptions, LockTable};
    /// let table = LockTable::builder().name_keys().build();
    /// let _held = table.lock("invoice-7").await;
    /// let err = table
    ///     .lock_with("invoice-7", LockOptions::new().timeout(Duration::ZERO))
    ///     .await
    ///     .unwrap_err();
    /// assert!(err.to_string().contains(r#"key "invoice-7""#), "{err}");
    /// # });
    /// ```
    pub fn name_keys(mut self) -> Self {
        self.key_name = Some(debug_name::<K>);
        self
    }
}

/// The name of a key a `try_lock` could not take (given back to it as
/// `key`), for its error, if the table names keys. Runs the key's `Debug`:
/// called after the shard lock is released.
#[cold]
#[inline(never)]
fn would_block_name<K>(name: Option<fn(&K) -> Box<str>>, key: Option<&K>) -> Option<Box<str>> {
    Some(name?(key?))
}

/// A key's `Debug` form, for an error.
fn debug_name<K: fmt::Debug>(key: &K) -> Box<str> {
    format!("{key:?}").into_boxed_str()
}

impl<K, S> LockTable<K, S> {
    /// The key's name for an error, if the table names keys
    /// ([`Builder::name_keys`]). Runs the key's `Debug`: never under a
    /// shard lock.
    #[cold]
    pub(crate) fn name_key(&self, key: &K) -> Option<Box<str>> {
        self.key_name.map(|name| name(key))
    }

    /// Whether the table names keys in its errors ([`Builder::name_keys`]).
    pub(crate) fn names_keys(&self) -> bool {
        self.key_name.is_some()
    }
}

impl<K, S> Builder<K, S> {
    /// Number of shards, rounded up to a power of two. More shards mean less
    /// contention between unrelated keys (a shard's lock is held for a whole
    /// lock or release); the default is sixteen per available core, at most
    /// 1,024, each about 512 bytes. Zero is rejected by [`build`](Self::build).
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
    pub fn hasher<T: BuildHasher>(self, hasher: T) -> Builder<K, T> {
        Builder {
            _keys: PhantomData,
            shards: self.shards,
            hasher,
            default_lease: self.default_lease,
            max_lease: self.max_lease,
            clock: self.clock,
            fairness: self.fairness,
            token_floor: self.token_floor,
            deadlock_limit: self.deadlock_limit,
            deadlock_history: self.deadlock_history,
            key_name: self.key_name,
        }
    }

    /// A lease for every grant that does not ask for its own, including plain
    /// `lock`, `try_lock`, `blocking_lock` and `lock_owned`. Checked by
    /// [`build`](Self::build): positive and at most the maximum lease.
    ///
    /// ```
    /// use std::time::Duration;
    /// let table = keylock::LockTable::builder().default_lease(Duration::from_secs(30)).build();
    /// let guard = table.try_lock("k").unwrap();
    /// assert!(guard.expires_at().is_some());
    /// ```
    pub fn default_lease(mut self, lease: Duration) -> Self {
        self.default_lease = Some(lease);
        self
    }

    /// The longest lease a lock or renewal may ask for (one hour unless set).
    /// Must be positive.
    ///
    /// ```
    /// use std::time::Duration;
    /// let table = keylock::LockTable::builder().max_lease(Duration::from_secs(60)).build();
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(61));
    /// assert!(table.try_lock_with("k", opts).is_err());
    /// ```
    pub fn max_lease(mut self, max: Duration) -> Self {
        self.max_lease = max;
        self
    }

    /// The fairness policy: [`Fairness::Strict`] (the default) or
    /// [`Fairness::Eventual`] for throughput on hot keys.
    ///
    /// ```
    /// let table: keylock::LockTable<u8> =
    ///     keylock::LockTable::builder().fairness(keylock::Fairness::Eventual).build();
    /// # drop(table);
    /// ```
    pub fn fairness(mut self, fairness: Fairness) -> Self {
        self.fairness = fairness;
        self
    }

    /// The most transactions one deadlock search visits (50 unless set;
    /// 0 turns detection off). When a transaction starts to wait, the table
    /// looks for a cycle of transactions waiting on each other that its
    /// wait closes, and answers it with
    /// [`TransactionError::Deadlock`](crate::TransactionError::Deadlock);
    /// a wait whose search reaches this bound without closing a cycle is
    /// answered as a presumed deadlock (RocksDB's rule past its depth
    /// limit; see [`Deadlock::presumed_depth`](crate::Deadlock::presumed_depth)).
    /// Plain guards are never searched.
    ///
    /// ```
    /// let table: keylock::LockTable<u8> =
    ///     keylock::LockTable::builder().deadlock_search_limit(8).build();
    /// # drop(table);
    /// ```
    pub fn deadlock_search_limit(mut self, limit: usize) -> Self {
        self.deadlock_limit = limit;
        self
    }

    /// How many broken deadlock cycles the table keeps for
    /// [`LockTable::recent_deadlocks`] (8 unless set; 0 keeps none).
    ///
    /// ```
    /// let table: keylock::LockTable<u8> =
    ///     keylock::LockTable::builder().deadlock_history(32).build();
    /// # drop(table);
    /// ```
    pub fn deadlock_history(mut self, cycles: usize) -> Self {
        self.deadlock_history = cycles;
        self
    }

    /// Judge leases and timeouts by tokio's clock and timer
    /// (`tokio::time::Instant`, `tokio::time::sleep_until`), so that paused
    /// and auto-advanced test time drive them; and make the table's lock
    /// futures take part in tokio's cooperative budget, as tokio's own
    /// `Mutex` does, so that a loop of always-free locks yields to the other
    /// tasks of its worker.
    ///
    /// A wait with a timer outside any tokio runtime (`blocking_lock_with` on
    /// a plain thread) uses the crate's own timer at the same instant; inside
    /// one, the runtime must have its timer enabled (`enable_time`, or
    /// `enable_all`), as for any `tokio::time::sleep`.
    ///
    /// Needs the `tokio` feature.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// use std::time::Duration;
    /// let table = keylock::LockTable::builder().tokio_time().build();
    /// let lease = keylock::LockOptions::new().lease(Duration::from_secs(5));
    /// let guard = table.lock_with("k", lease).await.unwrap();
    /// tokio::time::sleep(Duration::from_secs(6)).await; // virtual seconds
    /// assert!(guard.is_expired());
    /// # }
    /// ```
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub fn tokio_time(mut self) -> Self {
        self.clock = Clock::Tokio;
        self
    }

    /// Judge leases and timeouts by the application's own clock and timer;
    /// see [`TimeSource`](crate::TimeSource).
    pub fn time_source(mut self, source: impl crate::TimeSource) -> Self {
        self.clock = Clock::Custom(std::sync::Arc::new(source));
        self
    }

    /// Every [`FencingToken`] the table mints is greater than `floor` (0
    /// unless set).
    ///
    /// This is how to fence a store across restarts. A new table mints its
    /// tokens afresh, so without a floor they may be smaller than tokens the
    /// store already accepted from the table before the restart: a store that
    /// refuses any token not greater than the last one it accepted would
    /// refuse the new process, and one that forgets would accept a late write
    /// from the old one. At startup, give the new table a floor at least every
    /// token the old table handed out:
    ///
    /// - the largest token the store accepted (read it back from the store),
    ///   if every grant of the old table that may still write has written
    ///   once (a grant that never wrote may carry a larger token); or the
    ///   largest token your application recorded durably as it got its grants;
    /// - or an epoch, bumped durably at every start and shifted above the
    ///   tokens of one run, e.g. `epoch << 32`, as long as no run's tokens
    ///   reach the next epoch's floor (2^32 above its own: about 2^32 grants
    ///   spread over the shards; shift further for busier runs).
    ///
    /// Every token of the new table is then greater than any of the old one.
    ///
    /// Checked by [`build`](Self::build): the floor must leave at least one
    /// token for every shard, i.e. be at most `u64::MAX` minus the shard
    /// count. Tokens above a high floor run out sooner (minting panics once a
    /// shard's run out, before anything changes).
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    ///
    /// // The store keeps the largest token it accepted, durably.
    /// let last_accepted = AtomicU64::new(0);
    /// let write = |token: keylock::FencingToken| {
    ///     last_accepted.fetch_max(token.get(), SeqCst) < token.get()
    /// };
    ///
    /// let before_restart = keylock::LockTable::new();
    /// let stale = before_restart.try_lock("row").unwrap().token();
    /// assert!(write(stale));
    ///
    /// // The process restarts: the new table starts above what the store saw.
    /// let table = keylock::LockTable::builder()
    ///     .token_floor(last_accepted.load(SeqCst))
    ///     .build();
    /// assert!(write(table.try_lock("row").unwrap().token()));
    /// assert!(!write(stale), "the old holder's late write is refused");
    /// ```
    pub fn token_floor(mut self, floor: u64) -> Self {
        self.token_floor = floor;
        self
    }

    /// Judge leases and timeouts by a [`ManualClock`](crate::ManualClock)
    /// that moves only when told to.
    ///
    /// Needs the `test-util` feature.
    ///
    /// ```
    /// use std::time::Duration;
    /// let clock = keylock::ManualClock::new();
    /// let table = keylock::LockTable::builder().clock(clock.clone()).build();
    /// let opts = keylock::LockOptions::new().lease(Duration::from_secs(1));
    /// let guard = table.try_lock_with("k", opts).unwrap();
    /// clock.advance(Duration::from_secs(1));
    /// assert!(guard.is_expired());
    /// ```
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn clock(mut self, clock: crate::time::clock::ManualClock) -> Self {
        self.clock = Clock::Manual(clock);
        self
    }

    /// Builds the table.
    ///
    /// # Panics
    ///
    /// If `shards(0)` or more than 2^16 shards were asked for, if the maximum
    /// lease is zero, if the default lease is zero or above the maximum, or
    /// if the token floor leaves no token for some shard (it is above
    /// `u64::MAX` minus the shard count).
    pub fn build(self) -> LockTable<K, S> {
        assert!(
            self.max_lease >= MIN_LEASE,
            "keylock: Builder::max_lease must be positive, got {:?}",
            self.max_lease
        );
        if let Some(lease) = self.default_lease {
            assert!(
                lease >= MIN_LEASE && lease <= self.max_lease,
                "keylock: Builder::default_lease must be between {MIN_LEASE:?} and the maximum \
                 lease {:?}, got {lease:?}",
                self.max_lease
            );
        }
        let shards = match self.shards {
            Some(0) => panic!("keylock: Builder::shards must be at least 1, got 0"),
            Some(n) if n > MAX_SHARDS => {
                panic!("keylock: Builder::shards must be at most {MAX_SHARDS}, got {n}")
            }
            Some(n) => n,
            None => default_shards(),
        }
        .next_power_of_two();
        let floor = self.token_floor;
        assert!(
            floor <= u64::MAX - shards as u64,
            "keylock: Builder::token_floor must leave a token for each of the {shards} shards \
             (be at most u64::MAX - {shards}), got {floor}"
        );
        let shards: Box<[CachePadded<Shard<K>>]> = (0..shards)
            .map(|index| {
                let tokens = TokenCounter::new(floor, index as u64, shards as u64);
                CachePadded::new(Shard {
                    state: ShardMutex::new(ShardState::new(tokens)),
                    counters: Counters::default(),
                    timer: ShardTimer::new(),
                })
            })
            .collect();
        LockTable {
            mask: shards.len() - 1,
            shards,
            hasher: self.hasher,
            clock: self.clock,
            leases: LeasePolicy {
                default: self.default_lease,
                default_packed: crate::support::lease::PackedDuration::pack(self.default_lease),
                max: self.max_lease,
                max_packed: crate::support::lease::PackedDuration::pack(Some(self.max_lease)),
            },
            fairness: self.fairness,
            token_floor: floor,
            transactions: LayerState::new(),
            deadlock_limit: self.deadlock_limit,
            deadlock_history: self.deadlock_history,
            labels: Labels::new(),
            key_name: self.key_name,
            wait_starts: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

const MAX_SHARDS: usize = 1 << 16;

/// The most transactions one deadlock search visits, unless set.
pub(crate) const DEFAULT_DEADLOCK_LIMIT: usize = 50;

/// How many broken cycles a table keeps for diagnosis, unless set.
pub(crate) const DEFAULT_DEADLOCK_HISTORY: usize = 8;

/// Shards per available core, unless set ([`Builder::shards`]).
///
/// A shard's lock is held for a whole lock or release (the probe, the entry,
/// the queue), not only for a map lookup as in a sharded map of mutexes, so
/// threads that meet on one shard wait for each other even on different
/// keys. `examples/shards.rs` measures it: on two cores, two workers locking
/// pairs of random keys took a third less time per pair at sixteen shards
/// per core than at four, while one worker alone ran the same up to 32
/// shards (BENCHMARKS.md). Each shard is about 512 bytes (448 padded to
/// the cache-line pair on x86-64): 16 KiB a table on two cores.
const SHARDS_PER_CORE: usize = 16;

fn default_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * SHARDS_PER_CORE).clamp(SHARDS_PER_CORE, 1024)
}

/// The terms of a grant asked for with `opts`, its lease resolved.
#[inline(always)]
fn terms_of<K, S>(table: &LockTable<K, S>, lease: PackedDuration, opts: &LockOptions) -> Terms {
    Terms {
        lease,
        owner: table.owner_for(opts),
    }
}

/// Releases a grant that no guard owns yet if dropped (by a panic in
/// [`LockTable::try_acquire_busy`]'s wakes); forgotten once the grant is
/// handed on.
struct ReleaseOnUnwind<'a, K, S> {
    table: &'a LockTable<K, S>,
    hash: u64,
    key: KeyPtr<K>,
    token: FencingToken,
}

impl<K, S> Drop for ReleaseOnUnwind<'_, K, S> {
    fn drop(&mut self) {
        self.table.release(self.hash, self.key, self.token);
    }
}

/// A handoff's wake from a guard dropped while its thread unwinds: a
/// panic of the waker (another task's) would abort the process there, so
/// it is swallowed, as the deferred list does; the grant stays the
/// waiter's.
#[cold]
#[inline(never)]
fn wake_while_unwinding(waker: std::task::Waker) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
}

/// Wakes a waiter handed a key, after unlocking (`Waker::wake` is user
/// code), also while unwinding (see [`wake_while_unwinding`]). Out of line:
/// the handoff calls it last, so that it keeps nothing across a call.
#[inline(never)]
fn wake_unlocked(waker: std::task::Waker) {
    if std::thread::panicking() {
        wake_while_unwinding(waker);
    } else {
        waker.wake();
    }
}
