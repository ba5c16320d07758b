//! Every cycle answered (issue 26, item 3), and the detector's own safety
//! checks: a ring longer than the search limit is answered as a presumed
//! deadlock (naming the depth reached), a ring of exactly the limit as a
//! confirmed one; an owned transaction's several pending calls are all in
//! the wait-for graph; a cycle that closes only through a victim's dying
//! wait stays pending. Every future is polled by hand with a noop waker:
//! each assertion is about what one poll answers, never about time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use keylock::{LockTable, Mode, OwnedTransaction, TransactionError};

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

type Call<T> = Pin<Box<dyn Future<Output = Result<T, TransactionError<u32>>>>>;

fn call<T, F>(f: F) -> Call<T>
where
    F: Future<Output = Result<T, TransactionError<u32>>> + 'static,
{
    Box::pin(f)
}

/// A ring of `n` owned transactions on `table`: member `i` holds key `i`
/// and asks for key `i + 1`, in order, so the last closes the ring. Returns
/// the members, their pending calls (all but the last's), and what the
/// last one's first poll answered.
#[allow(clippy::type_complexity)]
fn ring(
    table: &Arc<LockTable<u32>>,
    n: u32,
) -> (
    Vec<OwnedTransaction<u32>>,
    Vec<Call<keylock::Acquired>>,
    Poll<Result<keylock::Acquired, TransactionError<u32>>>,
) {
    let members: Vec<_> = (0..n).map(|_| table.clone().transaction_owned()).collect();
    for (i, m) in members.iter().enumerate() {
        assert!(poll(call(m.lock(i as u32, Mode::Exclusive)).as_mut()).is_ready());
    }
    let mut calls = Vec::new();
    for (i, m) in members.iter().enumerate().take(n as usize - 1) {
        let mut c = call(m.lock(i as u32 + 1, Mode::Exclusive));
        assert!(poll(c.as_mut()).is_pending(), "member {i} waits");
        calls.push(c);
    }
    let mut last = call(members[n as usize - 1].lock(0, Mode::Exclusive));
    let answered = poll(last.as_mut());
    (members, calls, answered)
}

/// The victim (the last member) aborts; the others are granted in turn,
/// from the one behind it down to the first, and commit.
fn unwind(
    table: &LockTable<u32>,
    mut members: Vec<OwnedTransaction<u32>>,
    mut calls: Vec<Call<keylock::Acquired>>,
) {
    members.pop().expect("the victim").abort();
    while let Some(mut c) = calls.pop() {
        assert!(
            matches!(poll(c.as_mut()), Poll::Ready(Ok(_))),
            "granted in turn"
        );
        drop(c);
        members.pop().expect("a member").commit().expect("no lease");
    }
    assert!(table.is_empty(), "nothing stranded");
}

/// Issue 26's example: a ring of 60 under the default limit of 50.
#[test]
fn a_ring_of_sixty_past_the_default_limit_is_answered_as_presumed() {
    let table = Arc::new(LockTable::<u32>::new());
    let (members, calls, answered) = ring(&table, 60);
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("the wait that closes the ring is answered, got {answered:?}");
    };
    assert_eq!(d.victim(), members[59].id());
    assert_eq!(d.presumed_depth(), Some(50), "{d}");
    let text = d.to_string();
    assert!(text.contains("presumed"), "{text}");
    assert!(text.contains("50"), "{text}");
    assert_eq!(table.deadlock_stats().cycles, 1);
    unwind(&table, members, calls);
}

/// The limit's edge: a ring of exactly `limit` transactions is found and
/// confirmed; one longer is presumed, at depth `limit`.
#[test]
fn a_ring_of_the_limit_is_confirmed_and_one_longer_is_presumed() {
    const LIMIT: usize = 5;
    let table = Arc::new(
        LockTable::<u32>::builder()
            .deadlock_search_limit(LIMIT)
            .build(),
    );
    let (members, calls, answered) = ring(&table, LIMIT as u32);
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("a ring of the limit is found: {answered:?}");
    };
    assert_eq!((d.cycle().len(), d.presumed_depth()), (LIMIT, None), "{d}");
    unwind(&table, members, calls);

    let (members, calls, answered) = ring(&table, LIMIT as u32 + 1);
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("a ring one longer is answered: {answered:?}");
    };
    assert_eq!(d.presumed_depth(), Some(LIMIT), "{d}");
    assert!(d.is_presumed());
    assert_eq!(d.cycle()[0].transaction, d.victim());
    unwind(&table, members, calls);
}

/// Issue 26's example: `a` holds x, `b` holds y, `c` holds z; `a.lock(y)`
/// and then `a.lock(z)` are both pending. `c.lock(x)` closes the cycle
/// c -> a -> c through `a`'s second call, and must be answered.
#[test]
fn a_cycle_through_an_owned_transactions_second_pending_call_is_answered() {
    let table = Arc::new(LockTable::<u32>::new());
    let (x, y, z) = (1, 2, 3);
    let a = table.clone().transaction_owned();
    let b = table.clone().transaction_owned();
    let c = table.clone().transaction_owned();
    for (t, k) in [(&a, x), (&b, y), (&c, z)] {
        assert!(poll(call(t.lock(k, Mode::Exclusive)).as_mut()).is_ready());
    }
    let mut a_y = call(a.lock(y, Mode::Exclusive));
    assert!(poll(a_y.as_mut()).is_pending());
    let mut a_z = call(a.lock(z, Mode::Exclusive));
    assert!(poll(a_z.as_mut()).is_pending());
    let mut c_x = call(c.lock(x, Mode::Exclusive));
    let answered = poll(c_x.as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("c's wait closes the cycle through a's second call: {answered:?}");
    };
    assert_eq!(d.victim(), c.id());
    let waits: Vec<_> = d.cycle().iter().map(|w| (w.transaction, w.key)).collect();
    assert_eq!(
        waits,
        [(c.id(), x), (a.id(), z)],
        "named on a's right call: {d}"
    );
    assert!(!d.is_presumed());
    // c aborts: a gets z; b commits: a gets y.
    drop(c_x);
    c.abort();
    assert!(matches!(poll(a_z.as_mut()), Poll::Ready(Ok(_))));
    b.commit().unwrap();
    assert!(matches!(poll(a_y.as_mut()), Poll::Ready(Ok(_))));
    drop((a_y, a_z));
    a.commit().unwrap();
    assert!(table.is_empty());
}

/// The same cycle closed by the second call itself: `c` holds z and waits
/// for x (held by `a`); `a` waits for y, then asks z: that second wait
/// closes a -> c -> a, and is answered.
#[test]
fn an_owned_transactions_second_pending_call_that_closes_a_cycle_is_answered() {
    let table = Arc::new(LockTable::<u32>::new());
    let (x, y, z) = (1, 2, 3);
    let a = table.clone().transaction_owned();
    let b = table.clone().transaction_owned();
    let c = table.clone().transaction_owned();
    for (t, k) in [(&a, x), (&b, y), (&c, z)] {
        assert!(poll(call(t.lock(k, Mode::Exclusive)).as_mut()).is_ready());
    }
    let mut c_x = call(c.lock(x, Mode::Exclusive));
    assert!(poll(c_x.as_mut()).is_pending());
    let mut a_y = call(a.lock(y, Mode::Exclusive));
    assert!(poll(a_y.as_mut()).is_pending());
    let mut a_z = call(a.lock(z, Mode::Exclusive));
    let answered = poll(a_z.as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("a's second wait closes the cycle: {answered:?}");
    };
    let waits: Vec<_> = d.cycle().iter().map(|w| (w.transaction, w.key)).collect();
    assert_eq!(waits, [(a.id(), z), (c.id(), x)], "{d}");
    // Only that call failed: a's wait for y goes on. a aborts; c gets x.
    drop(a_z);
    assert!(poll(a_y.as_mut()).is_pending());
    drop(a_y);
    a.abort();
    assert!(matches!(poll(c_x.as_mut()), Poll::Ready(Ok(_))));
    drop(c_x);
    c.commit().unwrap();
    b.commit().unwrap();
    assert!(table.is_empty());
}

/// Edges that changed after a search cached them produce no answer: `c`'s
/// wait for x cached "blocked by a"; `a` then lets x go (granted to `c`,
/// whose call has not seen it yet, so its wait is still registered) and
/// waits for z, held by `c`. The walk on cached edges finds a -> c -> a;
/// the confirmation with the shards locked refuses it (`c` is no longer
/// queued for x), the walk from the table finds nothing, and `a` waits on.
#[test]
fn a_cycle_found_on_edges_gone_since_they_were_cached_is_not_answered() {
    let table = Arc::new(LockTable::<u32>::new());
    let (x, z, p) = (1, 3, 9);
    let _plain = table.try_lock(p).unwrap();
    let (a, c, d) = (
        table.clone().transaction_owned(),
        table.clone().transaction_owned(),
        table.clone().transaction_owned(),
    );
    assert!(poll(call(a.lock(x, Mode::Exclusive)).as_mut()).is_ready());
    assert!(poll(call(c.lock(z, Mode::Exclusive)).as_mut()).is_ready());
    // d waits (on a plain guard) so that c's wait is searched, and cached.
    let mut d_p = call(d.lock(p, Mode::Exclusive));
    assert!(poll(d_p.as_mut()).is_pending());
    let mut c_x = call(c.lock(x, Mode::Exclusive));
    assert!(poll(c_x.as_mut()).is_pending());
    a.release(&x).unwrap(); // handed to c's waiter, not yet seen
    let mut a_z = call(a.lock(z, Mode::Exclusive));
    let answered = poll(a_z.as_mut());
    assert!(answered.is_pending(), "no cycle on the table: {answered:?}");
    assert_eq!(table.deadlock_stats().cycles, 0);
    assert!(matches!(poll(c_x.as_mut()), Poll::Ready(Ok(_))));
    drop(c_x);
    c.commit().unwrap();
    assert!(matches!(poll(a_z.as_mut()), Poll::Ready(Ok(_))));
    drop((a_z, d_p));
    drop((a, d));
    assert!(table.is_locked(&p) && table.len() == 1);
}

/// A key whose `Clone` of key [`HOOKED`] runs the hook armed on this
/// thread, once: a way to act at the instant the table clones that key.
#[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Hooked(u32);

const HOOKED: u32 = 2;

thread_local! {
    static HOOK: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

impl Clone for Hooked {
    fn clone(&self) -> Self {
        if self.0 == HOOKED {
            // Taken first: the hook may clone keys itself.
            if let Some(hook) = HOOK.with(|h| h.borrow_mut().take()) {
                hook();
            }
        }
        Hooked(self.0)
    }
}

/// A waker that counts its wakes.
struct Recording(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Recording {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A cycle that closes only through a victim's wait, while that wait is
/// still registered, is not a cycle: the victim's wait is about to end.
///
/// `t1` and `t3` hold x shared; `t2` holds y and q; `t1` waits for y. `t2`
/// asks x exclusive: its wait (blocked by `t1` and `t3`) closes
/// t2 -> t1 -> t2, and `t2` is the victim. Its answer names the cycle's
/// keys, cloned after the cycle is recorded and before the victim's wait
/// is unregistered; at the clone of y, `t3` asks q (held by `t2`). Its
/// wait closes t3 -> t2 -> t3 only through `t2`'s victim wait, so it must
/// stay pending (walked as live, the victim's wait would make `t3` a
/// second victim of one cycle). Once `t2` aborts, `t1` and `t3` are woken
/// and granted.
#[test]
fn a_cycle_closing_only_through_a_victims_registered_wait_stays_pending() {
    use std::cell::RefCell;
    use std::rc::Rc;

    let table = Arc::new(LockTable::<Hooked>::new());
    let (x, y, q) = (1, HOOKED, 3);
    let [t1, t2, t3] = [(); 3].map(|()| table.clone().transaction_owned());
    assert!(poll(Box::pin(t1.lock(Hooked(x), Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(t3.lock(Hooked(x), Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(t2.lock(Hooked(y), Mode::Exclusive)).as_mut()).is_ready());
    assert!(poll(Box::pin(t2.lock(Hooked(q), Mode::Exclusive)).as_mut()).is_ready());
    let mut t1_y = Box::pin(t1.lock(Hooked(y), Mode::Exclusive));
    assert!(poll(t1_y.as_mut()).is_pending(), "t1 waits for y: no cycle");

    // The hook: t3's wait for q, polled once at the clone of y.
    let waker = Arc::new(Recording(std::sync::atomic::AtomicUsize::new(0)));
    let t3_q = Rc::new(RefCell::new(Box::pin(t3.lock(Hooked(q), Mode::Exclusive))));
    let seen = Rc::new(RefCell::new(None));
    {
        let (t3_q, seen, table, waker) = (t3_q.clone(), seen.clone(), table.clone(), waker.clone());
        HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let cycles = table.deadlock_stats().cycles;
                let waker = std::task::Waker::from(waker);
                let polled = t3_q
                    .borrow_mut()
                    .as_mut()
                    .poll(&mut Context::from_waker(&waker));
                *seen.borrow_mut() = Some((cycles, polled.map(|r| r.map(drop))));
            }))
        });
    }
    let t2_x = poll(Box::pin(t2.lock(Hooked(x), Mode::Exclusive)).as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = t2_x else {
        panic!("t2 closes t2 -> t1 -> t2: {t2_x:?}");
    };
    assert_eq!(d.victim(), t2.id());
    let (cycles, t3_polled) = seen.borrow_mut().take().expect("the hook ran");
    assert_eq!(cycles, 1, "the hook ran after t2's cycle was recorded");
    assert!(
        t3_polled.is_pending(),
        "t3's cycle runs only through t2's victim wait: {t3_polled:?}"
    );
    assert_eq!(table.deadlock_stats().cycles, 1, "one cycle, one victim");

    t2.abort();
    assert!(matches!(poll(t1_y.as_mut()), Poll::Ready(Ok(_))));
    assert_eq!(
        waker.0.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "t3 woken once"
    );
    let mut t3_q = t3_q.borrow_mut();
    assert!(matches!(poll(t3_q.as_mut()), Poll::Ready(Ok(_))));
    drop(t1_y);
    t1.commit().unwrap();
    t3.commit().unwrap();
    assert!(table.is_empty());
}
