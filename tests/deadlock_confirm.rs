//! A search whose first cycle fails its confirmation must still find a
//! cycle that holds. The walk reads the table one shard at a time, so the
//! cycle it finds first may run through a waiter that leaves before the
//! confirmation (which locks the cycle's shards together); the wait's real
//! cycle, through another branch the walk had marked visited, was then left
//! unanswered, and both transactions waited for good. Found by the
//! transactions stress (`tests/stress_transactions.rs`) with random
//! preemptions added around the shard locks.
//!
//! Here the waiter leaves at a chosen moment: a key's `Eq`, which the walk
//! runs under the key's shard lock (user code the table allows there), drops
//! the waiting future on the Nth comparison of that key during the search.
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::hash::{BuildHasher, Hash, Hasher};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use keylock::{LockTable, Mode, TransactionError};

thread_local! {
    /// Which comparison of key 3 drops `LEAVER` (0: none).
    static FIRE_AT: Cell<usize> = const { Cell::new(0) };
    /// Comparisons of key 3 seen since armed.
    static SEEN: Cell<usize> = const { Cell::new(0) };
    /// The future whose waiter leaves its queue when it drops.
    static LEAVER: RefCell<Option<Pin<Box<dyn Future<Output = ()>>>>> = const { RefCell::new(None) };
}

#[derive(Debug, Clone, Copy, PartialOrd, Ord)]
struct Key(u32);

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        if self.0 == 3 && other.0 == 3 && FIRE_AT.get() != 0 {
            SEEN.set(SEEN.get() + 1);
            if SEEN.get() == FIRE_AT.get() {
                // Dropped after the slot's borrow ends: its drop locks key
                // 2's shard (not this one's) to leave the queue.
                let leaver = LEAVER.with(|l| l.borrow_mut().take());
                drop(leaver);
            }
        }
        self.0 == other.0
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u32(self.0);
    }
}

/// Key `n` hashes to `n << 32 | n`: in a table of four shards, key 2 and
/// key 3 are in shards of their own.
#[derive(Clone, Copy, Default)]
struct ByKey;

struct ByKeyHasher(u64);

impl Hasher for ByKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (u64::from(n) << 32) | u64::from(n);
    }
}

impl BuildHasher for ByKey {
    type Hasher = ByKeyHasher;
    fn build_hasher(&self) -> ByKeyHasher {
        ByKeyHasher(0)
    }
}

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

/// Whether `b`'s wait, closing the cycle a <-> b while `p`'s waiter (ahead
/// of it) leaves on the `fire_at`th comparison of key 3 during its search,
/// is answered as a deadlock.
fn run(fire_at: usize) -> bool {
    let table: &'static LockTable<Key, ByKey> = Box::leak(Box::new(
        LockTable::builder().shards(4).hasher(ByKey).build(),
    ));
    // Ids in order of creation: the walk from b tries p's edge before a's,
    // and from a, r's before b's (edges go in order of transaction).
    let p = Box::leak(Box::new(table.transaction()));
    let mut r = table.transaction();
    let mut a = table.transaction();
    let mut b = table.transaction();
    // A wait of another transaction, so that a's registration is not alone
    // and searches (caching its edges, as on a busy table).
    let mut c = table.transaction();
    assert!(poll(Box::pin(c.lock(Key(1), Mode::Exclusive)).as_mut()).is_ready());
    let mut d = table.transaction();
    assert!(poll(Box::pin(d.lock(Key(0), Mode::Exclusive)).as_mut()).is_ready());
    let mut d_waits = Box::pin(d.lock(Key(1), Mode::Exclusive));
    assert!(poll(d_waits.as_mut()).is_pending());

    assert!(poll(Box::pin(a.lock(Key(2), Mode::Exclusive)).as_mut()).is_ready());
    assert!(poll(Box::pin(b.lock(Key(3), Mode::Exclusive)).as_mut()).is_ready());
    // p and r, holding nothing, queue behind a on key 2 and behind b on key
    // 3 (not registered: only those queued behind them can wait for them).
    let mut p_waits: Pin<Box<dyn Future<Output = ()>>> = Box::pin(async move {
        let _ = p.lock(Key(2), Mode::Exclusive).await;
    });
    assert!(poll(p_waits.as_mut()).is_pending());
    LEAVER.with(|l| *l.borrow_mut() = Some(p_waits));
    let mut r_waits = Box::pin(r.lock(Key(3), Mode::Exclusive));
    assert!(poll(r_waits.as_mut()).is_pending());
    // a waits for b's key 3 behind r: no cycle yet. Its search caches its
    // edges: r ahead, b holding.
    let mut a_waits = Box::pin(a.lock(Key(3), Mode::Shared));
    assert!(poll(a_waits.as_mut()).is_pending());
    // r leaves: an edge gone, a's cache still valid (a superset).
    drop(r_waits);
    // b waits for a's key 2, behind p: the cycle a <-> b closes. The walk
    // on cached edges meets r gone (one comparison of key 3), so the walk
    // from the table is made: b -> p -> a (the second comparison: p
    // leaves) -> b, a cycle that no longer holds when it is confirmed;
    // b -> a -> b holds.
    FIRE_AT.set(fire_at);
    SEEN.set(0);
    let mut b_waits = Box::pin(b.lock(Key(2), Mode::Shared));
    let answered = matches!(
        poll(b_waits.as_mut()),
        Poll::Ready(Err(TransactionError::Deadlock(_)))
    );
    let seen = SEEN.get();
    FIRE_AT.set(0);
    SEEN.set(seen);
    let fired = LEAVER.with(|l| l.borrow().is_none());
    // Whatever happened, let everything go (p's transaction is leaked: it
    // holds nothing once its wait is gone).
    LEAVER.with(|l| l.borrow_mut().take());
    drop(b_waits);
    drop(b);
    assert!(poll(a_waits.as_mut()).is_ready());
    drop(a_waits);
    drop(a);
    drop(r);
    drop(d_waits);
    drop(d);
    drop(c);
    assert!(fired, "p's waiter left during the search ({fire_at})");
    answered
}

#[test]
fn a_cycle_is_found_when_the_first_one_found_does_not_hold() {
    // p leaves on the second comparison of key 3 in b's search: as the
    // walk from the table reads a's edges, before the confirmation.
    // On a thread of its own, so that a search that went wrong fails the
    // test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let answered = run(2);
        let _ = tx.send((answered, SEEN.get()));
    });
    let (answered, seen) = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the test's thread hung");
    assert!(
        answered,
        "b's wait, closing a <-> b, was left unanswered ({seen} comparisons of key 3)"
    );
}
