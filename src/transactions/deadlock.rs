//! Deadlock detection for transactions: the registry of the transactions
//! that wait, the search of the wait-for graph when one starts to wait, and
//! the table's record of the cycles it broke.
//!
//! A transaction that must wait registers its wait here (after its waiter
//! is queued) and searches, under the registry's one lock, for a path of
//! waits from the keys it waits on back to itself: the edges at each key are
//! read from the table, one shard at a time ([`ShardState::wait_edges`]:
//! holders and waiters ahead whose modes exclude the wait). The walk goes
//! through registered waits and through waiters queued ahead on the key it
//! comes from (their wait is there). A transaction that holds nothing and
//! can get nothing while it waits does not register: only a transaction
//! queued behind it on its key can wait for it, and that one registers
//! later and follows it through the queue. Registration and
//! search happen together under that mutex, so of the transactions whose
//! waits close a cycle, only the last to register finds it: it is the
//! *victim*, answered with [`Deadlock`] at once; the others keep waiting and
//! proceed once the victim's call gives up its wait (and, as it should, the
//! victim aborts). Unless the cycle is *soft*: a shared wait of it, the
//! only wait of its transaction, queued behind a waiter that excludes it on
//! a key whose holders admit it, is granted ahead of the queue instead
//! (`break_softly`, the key machine's `grant_past_queue`), and the wait
//! searches again; only a cycle no such grant breaks is answered.
//!
//! A registered wait keeps the edges a search last read for it, with its
//! shard's count of queue jumps then; while that count stands, later
//! searches use them (a superset of the table's: see [`Read`]), and redo the
//! walk from the table whenever its answer might not be the table's. A
//! waiter ahead of an exclusive wait on the same key is passed over (see
//! [`passes_over`]).
//!
//! A wait that nothing can lead back to does not search: a borrowed
//! transaction's lock of a new key, once registered, asks whether a waiter
//! is queued on any key its transaction holds; if none is, no cycle runs
//! through it (a
//! waiter queued behind it follows it through the queue in its own search,
//! and one that queues on its keys later searches later and finds it
//! registered). See `LockTable::enter_wait` and docs/ARCHITECTURE.md.
//!
//! No false answers: the edges read one shard at a time may be stale (a
//! holder released since, a waiter granted since), so a cycle found is
//! confirmed with the shards of all its keys locked at once, in shard
//! order: every edge holds at that instant, so the cycle was real. Only
//! transactions that wait are registered, so a grant of a transaction that
//! is not waiting ends every path through it.
//!
//! Bounded: one search visits at most the table's search limit of
//! transactions ([`Builder::deadlock_search_limit`](crate::Builder::deadlock_search_limit));
//! a wait whose search reaches it without closing a cycle is answered as a
//! *presumed* deadlock (as RocksDB does past its depth limit), naming the
//! depth reached and the chain followed; so is a cycle that changed
//! before every one of a search's confirmations (at most 16 walks of the
//! table: see `search`). So no cycle is left unanswered.
//! Nothing here runs while no transaction waits, and plain guards never
//! reach it. No user code but `K: Eq` runs under the registry's mutex: keys are held in
//! `Arc`s (cloned into the answer after it is released); `K: Eq` runs in
//! the table's probes, as everywhere, and in [`passes_over`] (two waits'
//! keys of one hash).
//!
//! [`ShardState::wait_edges`]: crate::keys::ShardState::wait_edges

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use smallvec::SmallVec;

use crate::keys::deferred::Leftovers;
use crate::support::mode::Mode;
use crate::support::shard_lock::ShardMutex;
use crate::table::LockTable;
use crate::transactions::hold::Holds;

pub use crate::support::token::TransactionId;

/// One wait of a deadlock cycle: `transaction` waits for `key` in `mode`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CycleWait<K> {
    /// The waiting transaction.
    pub transaction: TransactionId,
    /// The key it waits for.
    pub key: K,
    /// The mode it asked for (an upgrade asks for [`Mode::Exclusive`]).
    pub mode: Mode,
}

/// A cycle of transactions waiting on each other, broken by answering one
/// of them, the victim, with this (as
/// [`TransactionError::Deadlock`](crate::TransactionError::Deadlock)).
///
/// `cycle` starts with the victim; each wait is blocked by the transaction
/// of the next one (it holds the key, or waits ahead of it for the key in a
/// mode that excludes it), and the last by the victim. The victim is the
/// transaction whose wait closed the cycle.
///
/// ```
/// use keylock::{LockTable, Mode, TransactionError};
/// # futures::executor::block_on(async {
/// let table = LockTable::<&str>::new();
/// let mut a = table.transaction();
/// let mut b = table.transaction();
/// a.lock("x", Mode::Exclusive).await?;
/// b.lock("y", Mode::Exclusive).await?;
/// // `a` waits for "y" (held by `b`)...
/// let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
/// assert!(futures::poll!(a_waits.as_mut()).is_pending());
/// // ...and `b`'s wait for "x" closes the cycle: `b` is the victim.
/// let Err(TransactionError::Deadlock(deadlock)) = b.lock("x", Mode::Exclusive).await else {
///     panic!("a deadlock");
/// };
/// assert_eq!(deadlock.victim(), b.id());
/// assert_eq!(deadlock.cycle().len(), 2);
/// assert_eq!(deadlock.cycle()[0].key, "x");
/// drop(b); // the victim aborts: `a` gets "y"
/// assert!(a_waits.await.is_ok());
/// # Ok::<(), TransactionError<&str>>(())
/// # }).unwrap();
/// ```
///
/// # Soft deadlocks
///
/// A wait is blocked *hard* by a holder whose mode excludes it, *softly* by
/// a waiter queued ahead of it whose mode excludes it (FIFO: a reader
/// queued behind a writer waits for the writer, even while the key's
/// holders are readers). A cycle that runs through a soft edge may be
/// broken without a victim, by changing the order of a queue, as
/// PostgreSQL's deadlock detector does: if a wait of the cycle asks for its
/// key shared, is the only wait of its transaction, and the key's holders
/// admit it, that waiter is granted at once, ahead of the waiters queued
/// before it, in the poll that closed the cycle (the waits are tried from
/// the cycle's last to its first, the closing wait last). Nobody gets this
/// error then; [`DeadlockStats::reorders`] counts the waiters so granted.
/// The error answers only a cycle no such grant breaks: a *hard* one (every
/// wait blocked by a holder), or one whose soft waiters the holders would
/// not admit. Outside a cycle, queues stay strictly FIFO.
///
/// ```
/// use keylock::{LockTable, Mode};
/// # futures::executor::block_on(async {
/// // PostgreSQL's deadlock-soft: d1 and d2 read a1 and a2; e1 and e2 wait
/// // to write them; d1 asks a2 (queued behind e2), d2 asks a1 (behind e1).
/// let table = LockTable::<&str>::new();
/// let (mut d1, mut d2) = (table.transaction(), table.transaction());
/// let (mut e1, mut e2) = (table.transaction(), table.transaction());
/// d1.lock("a1", Mode::Shared).await?;
/// d2.lock("a2", Mode::Shared).await?;
/// let mut e1_waits = Box::pin(e1.lock("a1", Mode::Exclusive));
/// let mut e2_waits = Box::pin(e2.lock("a2", Mode::Exclusive));
/// assert!(futures::poll!(e1_waits.as_mut()).is_pending());
/// assert!(futures::poll!(e2_waits.as_mut()).is_pending());
/// let mut d1_waits = Box::pin(d1.lock("a2", Mode::Shared));
/// assert!(futures::poll!(d1_waits.as_mut()).is_pending());
/// // d2's wait closes d2 -> e1 -> d1 -> e2 -> d2: d1 is granted a2 ahead
/// // of e2 (d2, its holder, reads it too), and nobody is aborted.
/// let mut d2_waits = Box::pin(d2.lock("a1", Mode::Shared));
/// assert!(futures::poll!(d2_waits.as_mut()).is_pending());
/// assert!(futures::poll!(d1_waits.as_mut()).is_ready());
/// assert_eq!(table.deadlock_stats().reorders, 1);
/// drop(d1_waits);
/// drop(d1); // e1 writes a1, then d2 reads it; then e2 writes a2
/// e1_waits.await?;
/// drop(e1);
/// d2_waits.await?;
/// drop(d2);
/// e2_waits.await?;
/// # Ok::<(), keylock::TransactionError<&str>>(())
/// # }).unwrap();
/// ```
///
/// # Bounds
///
/// A search visits at most the table's search limit of transactions
/// ([`Builder::deadlock_search_limit`](crate::Builder::deadlock_search_limit),
/// 50 by default). A wait whose search reached the limit without closing a
/// cycle is answered too, as a *presumed* deadlock (as RocksDB does past
/// its depth limit): [`presumed_depth`](Self::presumed_depth) is then the
/// depth reached, and [`cycle`](Self::cycle) the chain of waits the search
/// followed up to it (not closed: its last wait is blocked by a
/// transaction the search did not go past). A wait-for chain that long is
/// answered whether or not it closes further on: raise the limit if
/// transactions legitimately wait in chains that long. A cycle the search
/// found, but which changed each time before it could be confirmed (a
/// wait it ran through ended, a holder let go) on 16 walks of the table
/// in a row, is answered as presumed too ([`presumed_depth`](Self::presumed_depth)
/// is then `None`): rather than leave a wait in a cycle no search answers.
/// Only keys whose `Eq` disagrees with itself, or a table changing under
/// every walk, come there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deadlock<K> {
    cycle: Vec<CycleWait<K>>,
    /// Why the deadlock is presumed, not confirmed (`None`: confirmed).
    presumed: Option<Presumed>,
}

/// Why a deadlock is presumed rather than confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presumed {
    /// The search reached its limit: the depth it reached, and the
    /// transaction it did not go past (blocking the chain's last wait).
    Depth(usize, TransactionId),
    /// The cycle was found on every walk of the table but changed each
    /// time before it could be confirmed: the number of walks.
    Unconfirmed(usize),
}

impl<K> Deadlock<K> {
    /// The transaction answered (the first of the cycle).
    #[must_use]
    pub fn victim(&self) -> TransactionId {
        self.cycle[0].transaction
    }

    /// The waits of the cycle, the victim's first (for a presumed
    /// deadlock, the chain the search followed up to its limit).
    #[must_use]
    pub fn cycle(&self) -> &[CycleWait<K>] {
        &self.cycle
    }

    /// `Some(depth)` if the deadlock is presumed, not confirmed: the search
    /// from the victim's wait reached its limit of `depth` transactions
    /// without closing a cycle (see the type's doc). `None` for a cycle
    /// found and confirmed.
    #[must_use]
    pub fn presumed_depth(&self) -> Option<usize> {
        match self.presumed {
            Some(Presumed::Depth(depth, _)) => Some(depth),
            _ => None,
        }
    }

    /// Whether the deadlock is presumed, not confirmed: the search reached
    /// its limit ([`presumed_depth`](Self::presumed_depth)), or the cycle
    /// it found changed before it could be confirmed on every one of its
    /// walks of the table (see the type's doc).
    #[must_use]
    pub fn is_presumed(&self) -> bool {
        self.presumed.is_some()
    }

    /// The same cycle with each key passed through `f` (to own a borrowed
    /// key, or to name it another way).
    ///
    /// ```
    /// use keylock::Deadlock;
    /// fn owned(deadlock: Deadlock<&str>) -> Deadlock<String> {
    ///     deadlock.map_key(str::to_owned)
    /// }
    /// # let _ = owned;
    /// ```
    #[must_use]
    pub fn map_key<K2>(self, mut f: impl FnMut(K) -> K2) -> Deadlock<K2> {
        Deadlock {
            cycle: self
                .cycle
                .into_iter()
                .map(|w| CycleWait {
                    transaction: w.transaction,
                    key: f(w.key),
                    mode: w.mode,
                })
                .collect(),
            presumed: self.presumed,
        }
    }
}

impl<K: fmt::Debug> fmt::Display for Deadlock<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.presumed {
            None => write!(f, "deadlock: ")?,
            Some(Presumed::Depth(depth, _)) => write!(
                f,
                "presumed deadlock: the search for a cycle through {}'s wait reached its \
                 limit of {depth} transactions without closing one: ",
                self.victim()
            )?,
            Some(Presumed::Unconfirmed(walks)) => write!(
                f,
                "presumed deadlock: a cycle through {}'s wait was found on each of {walks} \
                 walks of the table and changed each time before it could be confirmed: ",
                self.victim()
            )?,
        }
        for (i, wait) in self.cycle.iter().enumerate() {
            let next = match (self.cycle.get(i + 1), self.presumed) {
                (Some(next), _) => next.transaction,
                (None, Some(Presumed::Depth(_, beyond))) => beyond,
                (None, _) => self.cycle[0].transaction,
            };
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(
                f,
                "{} waits for {:?} ({}), blocked by {next}",
                wait.transaction, wait.key, wait.mode
            )?;
        }
        if let Some(Presumed::Depth(..)) = self.presumed {
            f.write_str(", not searched further")?;
        }
        write!(f, " ({} is the victim)", self.victim())
    }
}

pub(crate) use crate::keys::{Edge, Edges};

/// What the transaction layer keeps per table, made when a transaction
/// first needs it: the deadlock detector and the holds.
pub(crate) struct TransactionState<K> {
    pub(crate) detector: Detector<K>,
    pub(crate) holds: Holds<K>,
}

/// The state is shared as the table is: `Send + Sync` when the keys are
/// (what `LayerState` relies on, checked here at compile time).
const _: () = {
    #[allow(dead_code)] // never called: it only has to compile
    fn shared_as_the_table<K: Send + Sync>() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<TransactionState<K>>();
    }
};

impl<K, S> LockTable<K, S> {
    /// The transaction layer's state of this table, made on first use.
    #[inline]
    pub(crate) fn transaction_state(&self) -> &TransactionState<K> {
        let (slot, limit, history) = self.transaction_slot();
        // SAFETY: this is the slot's one accessor: it always names
        // `TransactionState<K>`.
        unsafe {
            slot.get_or_init(|| TransactionState {
                detector: Detector::new(limit, history),
                holds: Holds::new(),
            })
        }
    }

    /// The deadlock detector of the table's transactions.
    #[inline]
    pub(crate) fn detector(&self) -> &Detector<K> {
        &self.transaction_state().detector
    }

    /// The table's holds.
    #[inline]
    pub(crate) fn holds(&self) -> &Holds<K> {
        &self.transaction_state().holds
    }
}

/// A wait the search walks through: a registered one, or one reached as a
/// waiter ahead on the key of the wait before it.
struct Node<'r, K> {
    owner: u64,
    hash: u64,
    key: &'r Arc<K>,
    mode: Mode,
    /// The registered wait, whose edges are cached (`None`: a waiter ahead
    /// that is not registered).
    wait: Option<&'r Wait<K>>,
}

impl<'r, K> Node<'r, K> {
    /// `owner`'s registered wait as a node, unless it is a victim's (its
    /// wait is about to end: no search goes through it).
    fn registered(owner: u64, wait: &'r Wait<K>) -> Option<Self> {
        (!wait.victim).then_some(Node {
            owner,
            hash: wait.hash,
            key: &wait.key,
            mode: wait.mode,
            wait: Some(wait),
        })
    }
}

impl<K> Clone for Node<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Node<'_, K> {}

/// How deep a search goes before its path and visited set allocate.
const INLINE_DEPTH: usize = 16;

/// A transaction's live (not a victim's) registered waits: none, one, or
/// several.
enum Live<'r, K> {
    None,
    One(Node<'r, K>),
    Several,
}

fn one_live<K>(owner: u64, waits: &Waits<K>) -> Live<'_, K> {
    let mut live = waits.iter().filter_map(|w| Node::registered(owner, w));
    match (live.next(), live.next()) {
        (None, _) => Live::None,
        (Some(node), None) => Live::One(node),
        (Some(_), Some(_)) => Live::Several,
    }
}

/// The id of the wait whose key cell is `key` (see [`Wait::id`]).
pub(crate) fn wait_id<K>(key: &Arc<K>) -> usize {
    Arc::as_ptr(key).cast::<()>() as usize
}

/// A cycle as recorded: keys shared with the registry, cloned on reading;
/// for a presumed deadlock, why (for one past the limit, the chain the
/// search followed, with the depth it reached and the transaction it did
/// not go past).
type Record<K> = (Vec<(u64, Arc<K>, Mode)>, Option<Presumed>);

/// A cycle a search found, with the hash of each of its waits' keys.
type Found<K> = (Record<K>, Vec<u64>);

/// How many times one search walks the table at most while the cycles it
/// finds there do not hold by the time they are confirmed (see
/// `LockTable::search`).
const WALKS_AGAIN: usize = 16;

/// The registry and its bounds; one per table.
pub(crate) struct Detector<K> {
    registry: ShardMutex<Registry<K>>,
    /// Most transactions one search visits (0: detection off).
    limit: usize,
    /// How many broken cycles are kept for [`LockTable::recent_deadlocks`].
    keep: usize,
}

/// A transaction's registered waits: one per pending call that waits (an
/// owned transaction may have several), in the order they registered.
type Waits<K> = SmallVec<[Wait<K>; 1]>;

struct Registry<K> {
    /// By transaction id (a counter: foldhash, not SipHash).
    waiting: HashMap<u64, Waits<K>, foldhash::fast::RandomState>,
    recent: VecDeque<Record<K>>,
    counts: DeadlockStats,
}

/// What the table's deadlock detector has done since the table was built
/// ([`LockTable::deadlock_stats`]): how many waits it saw, how many it
/// searched from, how far the searches went, how many cycles it broke.
///
/// ```
/// use keylock::{LockTable, Mode};
/// # futures::executor::block_on(async {
/// let table = LockTable::<u32>::new();
/// let mut a = table.transaction();
/// a.lock(1, Mode::Exclusive).await?;
/// let mut b = table.transaction();
/// b.lock(2, Mode::Exclusive).await?;
/// let mut waits = Box::pin(b.lock(1, Mode::Exclusive));
/// assert!(futures::poll!(waits.as_mut()).is_pending());
/// let stats = table.deadlock_stats();
/// assert_eq!((stats.waits, stats.searches), (1, 0)); // nobody else waits
/// # Ok::<(), keylock::TransactionError<u32>>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadlockStats {
    /// Transactions' waits registered (each wait of a transaction's call,
    /// once, when it starts to wait; not the waits of transactions that
    /// hold nothing, which need no registration: see
    /// [`LockTable::deadlock_stats`]).
    pub waits: u64,
    /// Waits that searched the wait-for graph: another transaction was
    /// waiting too, one the wait waits for was among them, and something
    /// could lead back to the wait (a waiter queued on a key its
    /// transaction holds; upgrades, and a `lock_all` that holds keys
    /// outside its transaction's set while it waits, always count).
    pub searches: u64,
    /// Transactions visited by all searches together (the waiting
    /// transaction itself not counted, nor holders that wait for nothing:
    /// dead ends).
    pub visited: u64,
    /// The most transactions one search visited.
    pub deepest: u64,
    /// Cycles answered (each with one victim), presumed ones included.
    pub cycles: u64,
    /// Of those, the presumed ones: waits whose search reached the limit
    /// without closing a cycle (see [`Deadlock::presumed_depth`]), or
    /// whose cycle changed before each of the search's confirmations (see
    /// [`Deadlock::is_presumed`]).
    pub presumed: u64,
    /// Soft deadlocks resolved without a victim: cycles broken by granting
    /// a waiter of the cycle ahead of the queued waiters that blocked it,
    /// on a key whose holders admit it (see [`Deadlock`], soft deadlocks).
    /// Each counts one waiter moved; such a cycle is not in
    /// [`cycles`](Self::cycles).
    pub reorders: u64,
}

/// One line: each counter by name.
///
/// ```
/// let table = keylock::LockTable::<u32>::new();
/// let line = table.deadlock_stats().to_string();
/// assert!(line.starts_with("0 waits, 0 searches"), "{line}");
/// ```
impl fmt::Display for DeadlockStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} waits, {} searches, {} visited, {} deepest, {} cycles ({} presumed), \
             {} reorders",
            self.waits,
            self.searches,
            self.visited,
            self.deepest,
            self.cycles,
            self.presumed,
            self.reorders
        )
    }
}

/// A registered wait.
struct Wait<K> {
    /// Which of its transaction's waits it is: the address of the call's
    /// key cell (`Arc`), which the wait keeps alive, so no other wait of
    /// the transaction has it meanwhile.
    id: usize,
    hash: u64,
    key: Arc<K>,
    mode: Mode,
    /// Answered as a deadlock's victim: its wait is about to end, so no
    /// search goes through it.
    victim: bool,
    /// Its edges as a search last read them from the table, in canonical
    /// order, with the count of queue jumps of the key's shard then
    /// ([`LockTable::queue_jumps`]). While that count has not moved, they
    /// are a superset of its edges now: edges only go (a holder leaves, a
    /// waiter ahead leaves or is granted and stays the same transaction)
    /// unless something jumps the queue. Boxed: most waits are never
    /// searched through, and a small entry is cheap to register and remove.
    edges: RefCell<Option<Box<(u64, Edges)>>>,
}

/// Where a search reads a registered wait's edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// From the wait's cache while it is valid (a superset of its edges).
    Cached,
    /// From the table, every time (exact; the cache is refreshed).
    Table,
}

/// What one depth-first walk found.
struct Walk<'r, K> {
    /// The cycle, as its waits in order.
    cycle: Option<Vec<Node<'r, K>>>,
    /// Transactions visited, if a search was made.
    visited: Option<u64>,
    /// A walk on cached edges that may have missed a cycle the table has, or
    /// found another first: it was cut short by the limit, or followed a
    /// waiter ahead that is no longer queued where a cached edge said (an
    /// edge gone since), and marked it visited unexpanded.
    may_miss: bool,
    /// A walk on cached edges that passed over a waiter ahead (see
    /// [`passes_over`]) on the word of a cached edge, or followed a waiter
    /// ahead that is not registered on one (its mode taken from the edge):
    /// either may be gone, so its answer may not be the table's.
    may_differ: bool,
    /// Where the limit first cut the walk: the path to the wait whose edge
    /// it did not follow, and that edge's transaction.
    cut: Option<(Vec<Node<'r, K>>, u64)>,
}

/// Whether the walk passes over `to`, reached from `from` as a waiter ahead
/// of it: without following it, only marking it visited. That is so when
/// `from` asks for its key exclusively and `to`'s wait is on the same key:
/// everything `to` waits for there (holders, waiters ahead of it),
/// `from` waits for too (an exclusive request is blocked by every holder
/// and every waiter ahead; `from` holds no key it waits for, and is behind
/// `to`), so the branch adds nothing the walk does not take from `from`.
/// On a hot key this turns a search through every waiter of the queue
/// into a look at each.
fn passes_over<K: Eq>(from: &Node<'_, K>, edge: Edge, to: &Node<'_, K>) -> bool {
    edge.ahead.is_some()
        && from.mode == Mode::Exclusive
        && to.hash == from.hash
        && (Arc::ptr_eq(to.key, from.key) || **to.key == **from.key)
}

impl<K> fmt::Debug for Detector<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Detector")
            .field("limit", &self.limit)
            .field("keep", &self.keep)
            .finish_non_exhaustive()
    }
}

impl<K> Detector<K> {
    pub(crate) fn new(limit: usize, keep: usize) -> Self {
        Self {
            registry: ShardMutex::new(Registry {
                waiting: HashMap::default(),
                recent: VecDeque::new(),
                counts: DeadlockStats::default(),
            }),
            limit,
            keep,
        }
    }

    /// Whether waits are searched at all.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.limit > 0
    }

    /// Unregisters `owner`'s wait `id` (its call stopped waiting,
    /// however).
    /// How many transactions have waits registered.
    #[cfg(test)]
    pub(crate) fn registered(&self) -> usize {
        self.registry.lock().waiting.len()
    }

    /// Drops every wait `owner` still has registered: its transaction
    /// ended with calls forgotten in a wait, whose registrations never
    /// leave by themselves (their futures never drop). Left, each would
    /// stay in the registry for good, and keep a lone wait from skipping
    /// its search.
    #[cold]
    pub(crate) fn forget_owner(&self, owner: u64) {
        let gone = self.registry.lock().waiting.remove(&owner);
        // The keys' `Arc`s (perhaps their last) drop after the unlock.
        drop(gone);
    }

    pub(crate) fn leave(&self, owner: u64, id: usize) {
        let gone = {
            let mut registry = self.registry.lock();
            match registry.waiting.get_mut(&owner) {
                None => (None, None),
                Some(waits) => {
                    let gone = waits
                        .iter()
                        .position(|w| w.id == id)
                        .map(|at| waits.remove(at));
                    let emptied = if waits.is_empty() {
                        registry.waiting.remove(&owner)
                    } else {
                        None
                    };
                    (gone, emptied)
                }
            }
        };
        // The key's `Arc` (perhaps its last) drops after the unlock.
        drop(gone);
    }
}

impl<K: Eq + Hash, S: BuildHasher> LockTable<K, S> {
    /// Registers a wait of `owner` for `key` (hash `hash`) in `mode`, whose
    /// waiter is queued, beside `owner`'s other waits if it has any (an
    /// owned transaction's other pending calls), under the id of `key`'s
    /// cell ([`wait_id`], which [`Detector::leave`] takes), and searches
    /// for a cycle it closes, unless `awaited` (asked once it is
    /// registered, under the registry's lock) says nothing waits on a key
    /// `owner` holds: `Err` with the cycle if there is one (then this call
    /// of `owner` is its victim).
    ///
    /// `sole`: the transaction has one call at a time (the borrowed form).
    /// A wait of it registered before is then a forgotten call's, whose
    /// waiter this call's wait took out of its queue as it parked
    /// (`pending::park`): its future never drops, so it never leaves, and
    /// it is dropped here. Left, it would stand in the graph with the
    /// edges the table gives the transaction's live waiter on its key
    /// (read by key and transaction), under its own mode: an exclusive
    /// one passes over the waiter ahead of a shared one (`passes_over`),
    /// hiding a cycle through it; and as a second live wait it keeps a
    /// soft cycle through the transaction from being broken.
    pub(crate) fn enter_wait(
        &self,
        owner: u64,
        hash: u64,
        key: Arc<K>,
        mode: Mode,
        sole: bool,
        awaited: impl FnOnce() -> bool,
    ) -> Result<(), Deadlock<K>>
    where
        K: Clone,
    {
        let detector = self.detector();
        let id = wait_id(&key);
        let mut left = Leftovers::default();
        let mut stale = Waits::new();
        let (found, dropped) = {
            let mut registry = detector.registry.lock();
            // Beside the transaction's other waits, if it has any (an
            // owned transaction's other pending calls): every wait is in
            // the graph. The borrowed form's earlier ones are forgotten
            // calls' whose waiters are gone (see above): dropped.
            let waits = registry.waiting.entry(owner).or_default();
            if sole {
                stale = std::mem::take(waits);
            }
            waits.push(Wait {
                id,
                hash,
                key,
                mode,
                victim: false,
                edges: RefCell::new(None),
            });
            registry.counts.waits += 1;
            // A cycle needs another registered wait: a transaction that
            // holds something (see `wait_unless_ended` for those that hold
            // nothing). And it needs a way back into this transaction: a
            // waiter queued on a key it holds, or one queued behind it here.
            // One behind it followed it through the queue in its own search
            // (registered or not, a waiter ahead is followed where it
            // waits), so only the first is asked, now that this wait is
            // registered: a waiter that queues on its keys later searches
            // later, under this mutex, and finds this wait registered.
            let alone = registry.waiting.len() == 1;
            let (found, visited) = if alone || !awaited() {
                (None, None)
            } else {
                self.search(&registry, owner, id, detector.limit)
            };
            self.conclude(&mut registry, owner, id, found, visited, &mut left)
        };
        // The wake of a waiter granted ahead of the queue, if any: no lock
        // is held now. (The stale waits' keys drop after the unlock.)
        left.flush();
        drop(dropped);
        drop(stale);
        match found {
            None => Ok(()),
            Some(record) => Err(answer(&record)),
        }
    }

    /// Searches again from `owner`'s registered wait `id` (not a victim's):
    /// a call of the same transaction took a grant that queued waiters now
    /// wait for (a grant past the queue, an upgrade at once) while this wait
    /// was pending, an edge into a waiting transaction that no wait's
    /// registration searched through. `Err` with the cycle if there is one
    /// (this wait is then its victim, marked as at registration).
    pub(crate) fn search_again(&self, owner: u64, id: usize) -> Result<(), Deadlock<K>>
    where
        K: Clone,
    {
        let detector = self.detector();
        if !detector.is_on() {
            return Ok(());
        }
        let mut left = Leftovers::default();
        let (found, dropped) = {
            let mut registry = detector.registry.lock();
            let live = registry
                .waiting
                .get(&owner)
                .and_then(|waits| waits.iter().find(|w| w.id == id))
                .is_some_and(|w| !w.victim);
            if !live {
                return Ok(());
            }
            let (found, visited) = self.search(&registry, owner, id, detector.limit);
            self.conclude(&mut registry, owner, id, found, visited, &mut left)
        };
        left.flush();
        drop(dropped);
        match found {
            None => Ok(()),
            Some(record) => Err(answer(&record)),
        }
    }

    /// What a search from `owner`'s wait `id` found, concluded under the
    /// registry's lock: soft cycles broken by a grant ahead of the queue
    /// (searching again after each), a cycle left marks the wait its
    /// victim and is recorded. Returns the cycle, and a record the history
    /// let go of (to drop after the lock).
    #[allow(clippy::type_complexity)]
    fn conclude(
        &self,
        registry: &mut Registry<K>,
        owner: u64,
        id: usize,
        mut found: Option<Found<K>>,
        visited: Option<u64>,
        left: &mut Leftovers<K>,
    ) -> (Option<Record<K>>, Option<Record<K>>) {
        let detector = self.detector();
        if let Some(visited) = visited {
            let counts = &mut registry.counts;
            counts.searches += 1;
            counts.visited += visited;
            counts.deepest = counts.deepest.max(visited);
        }
        // A soft deadlock: a confirmed cycle that granting one of its
        // waiters ahead of the queue breaks. Each grant takes a waiter
        // out of the graph for good (its transaction waits for nothing
        // else), so this ends; the wait searches again after each, and
        // is answered only for a cycle no grant breaks.
        while let Some((record, hashes)) = &found {
            if record.1.is_some() || !self.break_softly(registry, record, hashes, left) {
                break;
            }
            registry.counts.reorders += 1;
            let (again, visited) = self.search(registry, owner, id, detector.limit);
            if let Some(visited) = visited {
                let counts = &mut registry.counts;
                counts.visited += visited;
                counts.deepest = counts.deepest.max(visited);
            }
            found = again;
        }
        let found = found.map(|(record, _)| record);
        let mut dropped = None;
        if let Some(record) = &found {
            registry.counts.cycles += 1;
            registry.counts.presumed += u64::from(record.1.is_some());
            let waits = registry.waiting.get_mut(&owner);
            let wait = waits.and_then(|w| w.iter_mut().find(|w| w.id == id));
            wait.expect("registered above").victim = true;
            if detector.keep > 0 {
                if registry.recent.len() == detector.keep {
                    dropped = registry.recent.pop_front();
                }
                registry.recent.push_back(record.clone());
            }
        }
        (found, dropped)
    }

    /// The cycles the table broke most recently, oldest first (as many as
    /// [`Builder::deadlock_history`](crate::Builder::deadlock_history)
    /// keeps), for diagnosis, as RocksDB's deadlock info buffer.
    ///
    /// ```
    /// let table = keylock::LockTable::<u32>::new();
    /// assert!(table.recent_deadlocks().is_empty());
    /// ```
    pub fn recent_deadlocks(&self) -> Vec<Deadlock<K>>
    where
        K: Clone,
    {
        let records: Vec<Record<K>> = self
            .detector()
            .registry
            .lock()
            .recent
            .iter()
            .cloned()
            .collect();
        records.iter().map(|r| answer(r)).collect()
    }

    /// What the detector has done so far (see [`DeadlockStats`]).
    ///
    /// A wait of a transaction that holds nothing (a borrowed transaction's
    /// call with nothing taken yet) is neither registered nor searched
    /// from: nothing but a transaction queued behind it on its key can wait
    /// for it, and such a transaction's search follows it through the
    /// queue. So a hot key that transactions lock one at a time costs the
    /// detector nothing.
    pub fn deadlock_stats(&self) -> DeadlockStats {
        self.detector().registry.lock().counts
    }

    /// A cycle through `owner`'s registered wait, found and confirmed, as
    /// recorded; and how many transactions the search visited, if one was
    /// made.
    ///
    /// The walk reads each registered wait's edges from its cache while the
    /// cache is valid: a superset of the edges the table has. A cycle found
    /// that way is confirmed on the table; if it does not hold, or if the
    /// walk may have missed one or found another first (cut by the limit,
    /// misled by an edge gone since, or trusting a cached edge's word on a
    /// waiter ahead: see [`Walk`]), the walk is made again from the table.
    /// Every edge the
    /// table has is in the cache and the order of the edges is canonical,
    /// so a cycle that holds is the one the walk from the table would find
    /// first (a branch the cache adds either reaches `owner`, through an
    /// edge that is gone, and then the cycle does not hold, or never
    /// reaches it, and only marks transactions that cannot).
    fn search(
        &self,
        registry: &Registry<K>,
        owner: u64,
        id: usize,
        limit: usize,
    ) -> (Option<Found<K>>, Option<u64>) {
        let walk = self.find_cycle(registry, owner, id, limit, Read::Cached);
        let (cycle, visited) = match walk.cycle {
            Some(cycle) if !walk.may_differ && !walk.may_miss && self.confirm(&cycle) => {
                (Some((cycle, None)), walk.visited)
            }
            None if !walk.may_miss && !walk.may_differ => (None, walk.visited),
            _ => {
                let mut walks = 0;
                loop {
                    walks += 1;
                    let exact = self.find_cycle(registry, owner, id, limit, Read::Table);
                    match exact.cycle {
                        Some(cycle) if self.confirm(&cycle) => {
                            break (Some((cycle, None)), exact.visited)
                        }
                        // The walk reads one shard at a time: the cycle it
                        // found first ran through an edge gone before the
                        // confirmation (a waiter ahead that left, a holder
                        // that let go). Another cycle through this wait may
                        // hold all the same, down a branch the walk did not
                        // take (its transactions were reached first, and
                        // marked visited, through the edge now gone), and
                        // no wait need begin later to find it: so the table
                        // is walked again, as it is now. Each time round,
                        // an edge the walk followed went since it read it;
                        // the walks are bounded all the same (a key whose
                        // `Eq` disagrees with itself could keep the walk
                        // and the confirmation apart for good, under the
                        // detector's lock).
                        // Past that, the cycle it found last is answered
                        // as a presumed deadlock (never a wait left in a
                        // cycle no search answers).
                        Some(_) if walks < WALKS_AGAIN => {}
                        Some(cycle) => {
                            let presumed = Presumed::Unconfirmed(walks);
                            break (Some((cycle, Some(presumed))), exact.visited);
                        }
                        // No cycle, and the walk from the table reached the
                        // limit: a presumed deadlock (the chain it followed).
                        None => {
                            let found = exact.cut.map(|(path, beyond)| {
                                let beyond = TransactionId::from_raw(beyond);
                                (path, Some(Presumed::Depth(limit, beyond)))
                            });
                            break (found, exact.visited);
                        }
                    }
                }
            }
        };
        let record = cycle.map(|(c, presumed)| {
            let waits = c
                .iter()
                .map(|n| (n.owner, Arc::clone(n.key), n.mode))
                .collect();
            ((waits, presumed), c.iter().map(|n| n.hash).collect())
        });
        (record, visited)
    }

    /// Breaks the confirmed cycle `record` (its waits' key hashes in
    /// `hashes`) by granting one of its waiters ahead of the queue, if one
    /// can be: `true` if one was (its wake left in `left`, for after the
    /// registry's lock).
    ///
    /// A candidate waits for the key shared and is the only live wait of
    /// its transaction (registered: a waiter ahead reached unregistered is
    /// not known to wait nowhere else); the key machine grants it only if
    /// the key's holders admit it and a queued waiter ahead excludes it
    /// ([`ShardState::grant_past_queue`]): its edge in the cycle was a soft
    /// one. Granted, it waits for nothing, so every cycle through it is
    /// broken and none can form through it; the waiters it passed now wait
    /// for it (a new edge into a transaction that waits for nothing). A
    /// waiter the holders would not admit is never moved: it would still
    /// wait, and a cycle through the waiters it passed could then close
    /// with no wait beginning to find it.
    ///
    /// The waits are tried from the cycle's last to its first (the wait
    /// that closed it last), as PostgreSQL's detector tries the soft edges
    /// it found deepest first.
    ///
    /// [`ShardState::grant_past_queue`]: crate::keys::ShardState::grant_past_queue
    fn break_softly(
        &self,
        registry: &Registry<K>,
        record: &Record<K>,
        hashes: &[u64],
        left: &mut Leftovers<K>,
    ) -> bool {
        record
            .0
            .iter()
            .zip(hashes)
            .rev()
            .any(|((to, key, mode), &hash)| {
                let only =
                    registry
                        .waiting
                        .get(to)
                        .is_some_and(|waits| match one_live(*to, waits) {
                            Live::One(node) => Arc::ptr_eq(node.key, key),
                            Live::None | Live::Several => false,
                        });
                *mode == Mode::Shared
                    && only
                    && self.with_shard_leaving(hash, left, |state, ctx| {
                        state.grant_past_queue(hash, key, *to, ctx)
                    })
            })
    }

    /// A cycle of waits through `owner`'s wait `id`, as its waits in order
    /// (each blocked by the next, the last by `owner`), if the search finds
    /// one within `limit` transactions visited; and how many were visited,
    /// if a search was made. The walk follows registered waits (all of a
    /// transaction's, when it has several: an owned transaction's pending
    /// calls), and waiters ahead on the key of the wait it comes from
    /// (whose wait is there, registered or not: a transaction that holds
    /// nothing does not register, and only those queued behind it can wait
    /// for it). Edges are tried in canonical order (by transaction; a
    /// waiter ahead before a holder), a transaction's waits in the order
    /// they registered.
    fn find_cycle<'r>(
        &self,
        registry: &'r Registry<K>,
        owner: u64,
        id: usize,
        limit: usize,
        read: Read,
    ) -> Walk<'r, K> {
        let mut walk = Walk {
            cycle: None,
            visited: None,
            may_miss: false,
            may_differ: false,
            cut: None,
        };
        let Some(start) = registry
            .waiting
            .get(&owner)
            .and_then(|waits| waits.iter().find(|w| w.id == id))
            .and_then(|w| Node::registered(owner, w))
        else {
            return walk;
        };
        // The edges of the transactions on the path, one run per
        // transaction (the edges of all its waits, one after the other),
        // end to end (a stack: a run goes when its transaction leaves the
        // path); beside each edge, the wait it is an edge of (an index into
        // `nodes`, a stack alike).
        let mut edges: SmallVec<[Edge; 2 * INLINE_DEPTH]> = SmallVec::new();
        let Some(fresh) = self.edges_into(&start, read, &mut edges) else {
            return walk;
        };
        // The common case: nothing the wait waits for is waiting itself
        // (waiters ahead of an exclusive wait are passed over: see
        // `passes_over`), so there is nothing to walk.
        let leads_on = |&edge: &Edge| match registry.waiting.get(&edge.to) {
            Some(waits) => match one_live(edge.to, waits) {
                Live::None => false,
                Live::One(to) => !passes_over(&start, edge, &to),
                Live::Several => true,
            },
            // Followed only as a waiter ahead, on the start's key.
            None => edge.ahead.is_some() && start.mode == Mode::Shared,
        };
        if !edges.iter().any(leads_on) {
            return walk;
        }
        let mut origins: SmallVec<[u32; 2 * INLINE_DEPTH]> = smallvec::smallvec![0; edges.len()];
        let mut nodes: SmallVec<[Node<'r, K>; INLINE_DEPTH]> = smallvec::smallvec![start];
        // Room in place for a search of `INLINE_DEPTH` transactions (the
        // issue's depth 8, twice over): no allocation until past it. The
        // path holds, for each transaction on it, the wait of the edge
        // being followed from it.
        let mut path: SmallVec<[Node<'r, K>; INLINE_DEPTH]> = smallvec::smallvec![start];
        let mut visited: SmallVec<[u64; INLINE_DEPTH]> = smallvec::smallvec![owner];
        // One frame per transaction on the path: where its runs of edges
        // and of waits start, the next edge to try, and whether the path up
        // to it is fresh: its edges and those of every wait before it on
        // the path read from the table in this walk. A stale branch may
        // reach a transaction first and mark it visited; that is harmless
        // for a registered transaction (expanded alike whatever the way
        // in: all its waits), not for a waiter ahead that is not
        // registered (expanded on the key it was reached by) nor for one
        // passed over (not expanded at all).
        let mut frames: SmallVec<[(usize, usize, bool, usize); INLINE_DEPTH]> =
            smallvec::smallvec![(0, 0, fresh, 0)];
        while let Some(&mut (run, ref mut next, fresh, nodes_run)) = frames.last_mut() {
            let Some(&edge) = edges.get(*next) else {
                frames.pop();
                path.pop();
                edges.truncate(run);
                origins.truncate(run);
                nodes.truncate(nodes_run);
                continue;
            };
            // The path goes through the wait this edge is of.
            let from = nodes[origins[*next] as usize];
            *path.last_mut().expect("a frame per node") = from;
            *next += 1;
            if edge.to == owner {
                walk.cycle = Some(path.to_vec());
                break;
            }
            if visited.contains(&edge.to) {
                continue;
            }
            let waits = registry.waiting.get(&edge.to);
            if waits.is_none() && edge.ahead.is_none() {
                // A holder that is not waiting (as far as the registry
                // knows): a dead end, not marked visited, so that the walk
                // may still follow it where it waits ahead of another wait
                // (a stale edge cannot hide it then).
                continue;
            }
            if visited.len() >= limit {
                walk.may_miss = true;
                if walk.cut.is_none() {
                    walk.cut = Some((path.to_vec(), edge.to));
                }
                continue;
            }
            visited.push(edge.to);
            let run = edges.len();
            let nodes_run = nodes.len();
            let mut read_fresh = true;
            match waits {
                Some(waits) => {
                    // A transaction with one live wait, on this key, queued
                    // ahead of an exclusive wait: passed over. With several
                    // (an owned transaction's calls), the others may lead
                    // elsewhere: every one is followed.
                    if let Live::One(to) = one_live(edge.to, waits) {
                        if passes_over(&from, edge, &to) {
                            walk.may_differ |= !fresh;
                            continue;
                        }
                    }
                    for wait in waits {
                        let Some(node) = Node::registered(edge.to, wait) else {
                            continue; // a victim's: its wait is ending
                        };
                        // A wait no longer queued (granted, not yet
                        // unregistered) has no edge.
                        if let Some(f) = self.edges_into(&node, read, &mut edges) {
                            read_fresh &= f;
                            origins.resize(edges.len(), nodes.len() as u32);
                            nodes.push(node);
                        }
                    }
                }
                None => {
                    let mode = edge.ahead.expect("a dead end otherwise");
                    let node = Node {
                        owner: edge.to,
                        mode,
                        wait: None,
                        ..from
                    };
                    // A waiter ahead that is not registered is named by the
                    // edge, mode and all, and expanded on the key it was
                    // reached by: off a fresh path, the edge (its mode: it
                    // may have left and queued again, asking for another)
                    // or the way in may be gone, and so may any pass-over
                    // made on its word.
                    walk.may_differ |= !fresh;
                    if passes_over(&from, edge, &node) {
                        continue;
                    }
                    match self.edges_into(&node, read, &mut edges) {
                        Some(f) => {
                            read_fresh = f;
                            origins.resize(edges.len(), nodes.len() as u32);
                            nodes.push(node);
                        }
                        // No longer queued where the edge said: the edge
                        // may be gone, and the transaction, now marked
                        // visited, may wait elsewhere.
                        None => walk.may_miss = true,
                    }
                }
            }
            if nodes.len() > nodes_run {
                path.push(nodes[nodes_run]);
                frames.push((run, run, fresh && read_fresh, nodes_run));
            }
        }
        walk.visited = Some(visited.len() as u64 - 1);
        walk
    }

    /// Appends to `out` the transactions the wait `node` waits for, in
    /// canonical order: from its cache while that is valid
    /// (`Read::Cached`), else from the table (then cached). Whether they
    /// were read from the table; `None` if its waiter is not queued there.
    fn edges_into<const N: usize>(
        &self,
        node: &Node<'_, K>,
        read: Read,
        out: &mut SmallVec<[Edge; N]>,
    ) -> Option<bool>
    where
        [Edge; N]: smallvec::Array<Item = Edge>,
    {
        if let (Read::Cached, Some(wait)) = (read, node.wait) {
            if let Some(cached) = &*wait.edges.borrow() {
                let (jumps, edges) = &**cached;
                if *jumps == self.queue_jumps(node.hash) {
                    out.extend_from_slice(edges);
                    return Some(false);
                }
            }
        }
        let mut fresh = Edges::new();
        let jumps = self.wait_edges(node.hash, node.key, node.owner, &mut fresh)?;
        // Canonical: the same order whatever order the table keeps its
        // holders and waiters in, so that a cached list and a fresh one
        // are walked alike.
        let canonical = |e: &Edge| (e.to, e.ahead.is_none());
        if !fresh.is_sorted_by_key(canonical) {
            fresh.sort_by_key(canonical);
        }
        out.extend_from_slice(&fresh);
        if let Some(wait) = node.wait {
            let mut cached = wait.edges.borrow_mut();
            match &mut *cached {
                // The box is reused.
                Some(cached) => **cached = (jumps, fresh),
                None => *cached = Some(Box::new((jumps, fresh))),
            }
        }
        Some(true)
    }

    /// Whether every wait of `cycle` is blocked by the next one's
    /// transaction (the last by the first's) with the shards of all its
    /// keys locked at once: the cycle is real at that instant.
    fn confirm(&self, cycle: &[Node<'_, K>]) -> bool {
        #[cfg(all(test, not(loom)))]
        if tests::confirmation_fails() {
            return false;
        }
        let edges: Vec<(u64, &K, u64, u64)> = cycle
            .iter()
            .enumerate()
            .map(|(i, n)| {
                (
                    n.hash,
                    &**n.key,
                    n.owner,
                    cycle[(i + 1) % cycle.len()].owner,
                )
            })
            .collect();
        self.edges_hold(&edges)
    }
}

/// The answer for a recorded cycle (keys cloned: no lock is held).
fn answer<K: Clone>(record: &Record<K>) -> Deadlock<K> {
    let (waits, presumed) = record;
    Deadlock {
        presumed: *presumed,
        cycle: waits
            .iter()
            .map(|(o, key, mode)| CycleWait {
                transaction: TransactionId::from_raw(*o),
                key: K::clone(key),
                mode: *mode,
            })
            .collect(),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};

    use crate::{LockTable, Mode, TransactionError};

    thread_local! {
        /// How many of this thread's next confirmations fail as if the
        /// cycle had changed since its walk (the race, made at will).
        static FAILING_CONFIRMATIONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// Whether this confirmation fails (see [`FAILING_CONFIRMATIONS`]).
    pub(super) fn confirmation_fails() -> bool {
        FAILING_CONFIRMATIONS.with(|n| {
            let left = n.get();
            n.set(left.saturating_sub(1));
            left > 0
        })
    }

    fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(Waker::noop()))
    }

    /// A 2-cycle closed while its confirmations fail `failing` times: `a`
    /// holds 1 and waits for 2, `b` holds 2 and asks for 1. Returns what
    /// `b`'s wait got at its first poll (`None`: pending).
    fn close_a_cycle_failing(failing: usize) -> Option<String> {
        let table = LockTable::<u32>::new();
        let (mut a, mut b) = (table.transaction(), table.transaction());
        assert!(poll(Box::pin(a.lock(1, Mode::Exclusive)).as_mut()).is_ready());
        assert!(poll(Box::pin(b.lock(2, Mode::Exclusive)).as_mut()).is_ready());
        let mut a_waits = Box::pin(a.lock(2, Mode::Exclusive));
        assert!(poll(a_waits.as_mut()).is_pending(), "b holds 2");
        let b_id = b.id();
        FAILING_CONFIRMATIONS.with(|n| n.set(failing));
        let mut b_waits = Box::pin(b.lock(1, Mode::Exclusive));
        let got = poll(b_waits.as_mut());
        FAILING_CONFIRMATIONS.with(|n| n.set(0));
        let answer = match got {
            Poll::Pending => None,
            Poll::Ready(Err(TransactionError::Deadlock(d))) => {
                assert_eq!(d.victim(), b_id, "{d}");
                assert_eq!(d.cycle().len(), 2, "{d}");
                assert_eq!(d.presumed_depth(), None, "{d}");
                Some(format!(
                    "{}{d}",
                    if d.is_presumed() { "presumed " } else { "" }
                ))
            }
            Poll::Ready(other) => panic!("b's wait closes a -> b -> a, got {other:?}"),
        };
        drop(b_waits);
        drop(b);
        assert!(poll(a_waits.as_mut()).is_ready(), "a gets 2 once b is gone");
        drop(a_waits);
        drop(a);
        assert!(table.is_empty(), "nothing left");
        answer
    }

    /// A cycle whose confirmation fails (a wait it ran through changed
    /// since the walk) is walked again and answered once it holds; one
    /// that changes on every walk is answered all the same, as a presumed
    /// deadlock, never left unanswered.
    #[test]
    fn a_cycle_that_fails_its_confirmations_is_still_answered() {
        let confirmed =
            close_a_cycle_failing(3).expect("answered after three failed confirmations");
        assert!(!confirmed.starts_with("presumed"), "{confirmed}");
        for failing in [super::WALKS_AGAIN + 1, 1000] {
            let presumed = close_a_cycle_failing(failing).unwrap_or_else(|| {
                panic!("{failing} failed confirmations: the cycle was left unanswered")
            });
            assert!(
                presumed.starts_with("presumed ") && presumed.contains("changed each time"),
                "{presumed}"
            );
        }
    }

    /// A transaction that ends with a call forgotten in a registered wait
    /// (it held a key, so the wait registered) leaves nothing in the
    /// detector: the forgotten future never drops, so its registration
    /// would otherwise stay for good.
    #[test]
    #[cfg_attr(miri, ignore = "forgets futures on purpose: leaks")]
    fn an_ended_transactions_forgotten_registrations_leave_the_detector() {
        for owned in [false, true] {
            let table = Arc::new(LockTable::<u32>::new());
            let blocker = table.try_lock(2).expect("free");
            if owned {
                let t = table.clone().transaction_owned();
                assert!(poll(Box::pin(t.lock(1, Mode::Exclusive)).as_mut()).is_ready());
                let mut call = Box::pin(t.lock(2, Mode::Exclusive));
                assert!(poll(call.as_mut()).is_pending());
                std::mem::forget(call);
                assert_eq!(table.detector().registered(), 1, "owned: registered");
                drop(t);
            } else {
                let mut t = table.transaction();
                assert!(poll(Box::pin(t.lock(1, Mode::Exclusive)).as_mut()).is_ready());
                let mut call = Box::pin(t.lock(2, Mode::Exclusive));
                assert!(poll(call.as_mut()).is_pending());
                std::mem::forget(call);
                assert_eq!(table.detector().registered(), 1, "borrowed: registered");
                drop(t);
            }
            assert_eq!(
                table.detector().registered(),
                0,
                "owned {owned}: the ended transaction's forgotten wait is still registered"
            );
            drop(blocker);
            assert!(table.is_empty(), "owned {owned}: nothing left");
        }
    }

    /// The same through `commit`, which skips the drop glue when the
    /// transaction owns nothing more.
    #[test]
    #[cfg_attr(miri, ignore = "forgets a future on purpose: leaks")]
    fn a_committed_transactions_forgotten_registration_leaves_the_detector() {
        let table = LockTable::<u32>::new();
        let blocker = table.try_lock(2).expect("free");
        let mut t = table.transaction();
        assert!(poll(Box::pin(t.lock(1, Mode::Exclusive)).as_mut()).is_ready());
        let mut call = Box::pin(t.lock(2, Mode::Exclusive));
        assert!(poll(call.as_mut()).is_pending());
        std::mem::forget(call);
        // The next call clears the forgotten one's parked wait (its waiter
        // leaves the queue) and takes its key at once: nothing of the
        // forgotten call is left in the transaction but its registration.
        drop(blocker);
        assert!(poll(Box::pin(t.lock(2, Mode::Exclusive)).as_mut()).is_ready());
        assert_eq!(table.detector().registered(), 1, "registered");
        t.commit().expect("no lease");
        assert_eq!(
            table.detector().registered(),
            0,
            "still registered after the commit"
        );
        assert!(table.is_empty(), "nothing left");
    }
}
