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

mod common;
use common::poll_noop as poll;

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
    assert_eq!((d.cycle().len(), d.is_presumed()), (LIMIT, false), "{d}");
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

// ---------------------------------------------------------------------------
// PostgreSQL's isolation specs deadlock-simple, deadlock-hard, deadlock-soft
// and deadlock-soft-2, step by step. Each session is an owned transaction;
// each waiting step a future polled by hand with a waker that records its
// wakes, polled again only once woken (as an executor would). The log is
// the order steps complete in, commits included: PostgreSQL's expected
// output from the first step that completes after waiting on.
// ---------------------------------------------------------------------------

/// A waker that counts its wakes.
#[derive(Default)]
struct Recorder(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Recorder {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
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

/// A step that waits: its future, its recording waker, and the wakes seen
/// at its last poll.
struct Waiting {
    name: &'static str,
    fut: Call<keylock::Acquired>,
    wakes: Arc<Recorder>,
    seen: usize,
}

/// The steps of a spec that wait, and the log of completions.
#[derive(Default)]
struct Spec {
    waiting: Vec<Waiting>,
    log: Vec<&'static str>,
}

impl Spec {
    /// Runs step `name` (a lock call): `true` if it completed at once,
    /// `false` if it waits (kept, to be polled once woken). A deadlock or
    /// any other error fails the test.
    fn step(&mut self, name: &'static str, fut: Call<keylock::Acquired>) -> bool {
        let mut w = Waiting {
            name,
            fut,
            wakes: Arc::default(),
            seen: 0,
        };
        let waker = Waker::from(w.wakes.clone());
        match w.fut.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(Ok(_)) => true,
            Poll::Ready(Err(e)) => panic!("step {name}: {e}"),
            Poll::Pending => {
                self.waiting.push(w);
                false
            }
        }
    }

    /// A step that ends a session (commit, abort), logged.
    fn end(&mut self, name: &'static str, end: impl FnOnce()) {
        end();
        self.log.push(name);
    }

    /// Polls every waiting step woken since its last poll, until none is:
    /// the ones that complete are logged, in the order they complete.
    fn run(&mut self) {
        loop {
            let woken = self
                .waiting
                .iter()
                .position(|w| w.wakes.0.load(std::sync::atomic::Ordering::SeqCst) != w.seen);
            let Some(at) = woken else { return };
            let w = &mut self.waiting[at];
            w.seen = w.wakes.0.load(std::sync::atomic::Ordering::SeqCst);
            let waker = Waker::from(w.wakes.clone());
            match w.fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                Poll::Ready(Ok(_)) => {
                    let done = self.waiting.remove(at);
                    self.log.push(done.name);
                }
                Poll::Ready(Err(e)) => panic!("step {}: {e}", w.name),
                Poll::Pending => {}
            }
        }
    }

    /// The steps still waiting, by name.
    fn still_waiting(&self) -> Vec<&'static str> {
        self.waiting.iter().map(|w| w.name).collect()
    }
}

/// deadlock-soft: d1 and d2 hold a1 and a2 shared; e1 and e2 wait for them
/// exclusive; d1 asks a2 shared (queued behind e2: a soft edge), and d2's
/// ask of a1 shared (behind e1) closes d2 -> e1 -> d1 -> e2 -> d2, a cycle
/// with two soft edges. As PostgreSQL's detector does, the queue is
/// reordered instead of aborting anyone: d1 goes ahead of e2 on a2, whose
/// holder (d2, shared) admits it, and is granted at once; everyone
/// completes, in PostgreSQL's order.
#[test]
fn deadlock_soft_reorders_the_queue_and_everyone_completes() {
    let table = Arc::new(LockTable::<u32>::new());
    let (a1, a2) = (1, 2);
    let [d1, d2, e1, e2] = [(); 4].map(|()| table.clone().transaction_owned());
    let mut spec = Spec::default();
    assert!(spec.step("d1a1", call(d1.lock(a1, Mode::Shared))));
    assert!(spec.step("d2a2", call(d2.lock(a2, Mode::Shared))));
    assert!(!spec.step("e1l", call(e1.lock(a1, Mode::Exclusive))));
    assert!(!spec.step("e2l", call(e2.lock(a2, Mode::Exclusive))));
    assert!(!spec.step("d1a2", call(d1.lock(a2, Mode::Shared))));
    // The wait that closes the cycle is not answered: it waits on.
    assert!(!spec.step("d2a1", call(d2.lock(a1, Mode::Shared))));
    spec.run();
    assert_eq!(spec.log, ["d1a2"], "d1 granted at once, ahead of e2");
    assert_eq!(spec.still_waiting(), ["e1l", "e2l", "d2a1"]);
    let stats = table.deadlock_stats();
    assert_eq!((stats.cycles, stats.reorders), (0, 1), "{stats:?}");
    assert!(table.recent_deadlocks().is_empty());
    // a2 is held shared by both d1 and d2; e2 still waits.
    assert_eq!(table.waiters(&a2), 1);
    spec.end("d1c", || d1.commit().unwrap());
    spec.run();
    spec.end("e1c", || e1.commit().unwrap());
    spec.run();
    spec.end("d2c", || d2.commit().unwrap());
    spec.run();
    spec.end("e2c", || e2.commit().unwrap());
    spec.run();
    assert_eq!(
        spec.log,
        ["d1a2", "d1c", "e1l", "e1c", "d2a1", "d2c", "e2l", "e2c"]
    );
    assert!(spec.waiting.is_empty());
    assert!(table.is_empty(), "nothing held after");
    assert_eq!(table.deadlock_stats().cycles, 0);
}

/// deadlock-soft-2, in two modes (PostgreSQL's SHARE UPDATE EXCLUSIVE,
/// self-exclusive, as `Exclusive` on a1 and, against ACCESS EXCLUSIVE
/// waiters and an ACCESS SHARE holder, as `Shared` on a2): s1 holds a1, s2
/// holds a2 shared and waits for a1; s3 and s4 wait for a2 exclusive; s1's
/// ask of a2 shared closes s1 -> s3 -> s2 -> s1 and s1 -> s4 -> s2 -> s1.
/// Going ahead of s3 alone would leave the second cycle: s1 goes ahead of
/// both, granted at once by a2's shared holder, in the poll that closed
/// the cycles.
#[test]
fn deadlock_soft_2_moves_the_waiter_ahead_of_every_writer_blocking_it() {
    let table = Arc::new(LockTable::<u32>::new());
    let (a1, a2) = (1, 2);
    let [s1, s2, s3, s4] = [(); 4].map(|()| table.clone().transaction_owned());
    let mut spec = Spec::default();
    assert!(spec.step("s1a", call(s1.lock(a1, Mode::Exclusive))));
    assert!(spec.step("s2a", call(s2.lock(a2, Mode::Shared))));
    assert!(!spec.step("s2b", call(s2.lock(a1, Mode::Exclusive))));
    assert!(!spec.step("s3a", call(s3.lock(a2, Mode::Exclusive))));
    assert!(!spec.step("s4a", call(s4.lock(a2, Mode::Exclusive))));
    // Granted in the poll that closed the cycles (woken: it completes on
    // its next poll).
    assert!(!spec.step("s1b", call(s1.lock(a2, Mode::Shared))));
    spec.run();
    assert_eq!(spec.log, ["s1b"]);
    assert_eq!(spec.still_waiting(), ["s2b", "s3a", "s4a"]);
    assert_eq!(table.waiters(&a2), 2, "s3 and s4 still queued, in order");
    let stats = table.deadlock_stats();
    assert_eq!((stats.cycles, stats.reorders), (0, 1), "{stats:?}");
    spec.end("s1c", || s1.commit().unwrap());
    spec.run();
    spec.end("s2c", || s2.commit().unwrap());
    spec.run();
    spec.end("s3c", || s3.commit().unwrap());
    spec.run();
    spec.end("s4c", || s4.commit().unwrap());
    spec.run();
    assert_eq!(
        spec.log,
        ["s1b", "s1c", "s2b", "s2c", "s3a", "s3c", "s4a", "s4c"]
    );
    assert!(spec.waiting.is_empty());
    assert!(table.is_empty(), "nothing held after");
}

/// deadlock-hard: eight sessions each hold their table and ask the next
/// one's; s8's ask of a1 closes a cycle of holder edges only: a hard
/// deadlock, answered at once (s8 the victim, the cycle of eight named),
/// no queue reordered; the others complete in turn as each commits.
#[test]
fn deadlock_hard_answers_the_closing_wait_and_the_rest_complete_in_order() {
    let table = Arc::new(LockTable::<u32>::new());
    let s: Vec<_> = (0..8).map(|_| table.clone().transaction_owned()).collect();
    const LOCKS: [&str; 7] = ["s1a2", "s2a3", "s3a4", "s4a5", "s5a6", "s6a7", "s7a8"];
    const COMMITS: [&str; 8] = ["s1c", "s2c", "s3c", "s4c", "s5c", "s6c", "s7c", "s8c"];
    let mut spec = Spec::default();
    for (i, t) in s.iter().enumerate() {
        assert!(spec.step("held", call(t.lock(i as u32 + 1, Mode::Exclusive))));
    }
    for (i, t) in s.iter().enumerate().take(7) {
        assert!(!spec.step(LOCKS[i], call(t.lock(i as u32 + 2, Mode::Exclusive))));
    }
    let mut s8a1 = call(s[7].lock(1, Mode::Exclusive));
    let answered = poll(s8a1.as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("s8a1 closes a hard cycle: {answered:?}");
    };
    assert_eq!(d.victim(), s[7].id());
    assert_eq!(d.cycle().len(), 8, "{d}");
    assert!(!d.is_presumed());
    let stats = table.deadlock_stats();
    assert_eq!((stats.cycles, stats.reorders), (1, 0), "{stats:?}");
    drop(s8a1);
    spec.run();
    assert!(
        spec.log.is_empty(),
        "nothing moves before the victim aborts"
    );
    let mut s = s;
    for i in (0..8).rev() {
        let t = s.pop().unwrap();
        spec.end(COMMITS[i], || t.commit().unwrap());
        spec.run();
    }
    assert_eq!(
        spec.log,
        [
            "s8c", "s7a8", "s7c", "s6a7", "s6c", "s5a6", "s5c", "s4a5", "s4c", "s3a4", "s3c",
            "s2a3", "s2c", "s1a2", "s1c"
        ]
    );
    assert!(table.is_empty(), "nothing held after");
}

/// deadlock-simple: two shared holders of a1 both ask it exclusive. s1's
/// upgrade waits; s2's cannot be reordered past it (an upgrade heads the
/// queue, and s1 holds a1 too): answered at once, as a retryable error;
/// once s2 aborts, s1's upgrade completes.
#[test]
fn deadlock_simple_answers_the_second_upgrade_at_once() {
    let table = Arc::new(LockTable::<u32>::new());
    let a1 = 1;
    let [s1, s2] = [(); 2].map(|()| table.clone().transaction_owned());
    let mut spec = Spec::default();
    assert!(spec.step("s1as", call(s1.lock(a1, Mode::Shared))));
    assert!(spec.step("s2as", call(s2.lock(a1, Mode::Shared))));
    assert!(!spec.step("s1ae", call(s1.lock(a1, Mode::Exclusive))));
    let mut s2ae = call(s2.lock(a1, Mode::Exclusive));
    let answered = poll(s2ae.as_mut());
    let Poll::Ready(Err(e)) = answered else {
        panic!("s2ae is answered at once: {answered:?}");
    };
    assert!(e.is_retryable(), "{e}");
    assert_eq!(table.deadlock_stats().reorders, 0);
    drop(s2ae);
    spec.end("s2 aborts", || s2.abort());
    spec.run();
    spec.end("s1c", || s1.commit().unwrap());
    assert_eq!(spec.log, ["s2 aborts", "s1ae", "s1c"]);
    assert!(table.is_empty(), "nothing held after");
}

/// A cycle through a soft edge that no reordering can break is still
/// answered: `w` asks x shared behind `e`'s exclusive wait, but x is held
/// exclusive by `h` (its holder does not admit `w` either), and `h` waits
/// for y, `w`'s: w -> e -> h -> w (`e` made first, so the walk takes
/// w's soft edge before its hard one). Nobody is moved.
#[test]
fn a_soft_edge_whose_key_holders_exclude_the_waiter_is_still_a_deadlock() {
    let table = Arc::new(LockTable::<u32>::new());
    let (x, y) = (1, 2);
    let [e, h, w] = [(); 3].map(|()| table.clone().transaction_owned());
    let mut spec = Spec::default();
    assert!(spec.step("hx", call(h.lock(x, Mode::Exclusive))));
    assert!(spec.step("wy", call(w.lock(y, Mode::Exclusive))));
    assert!(!spec.step("ex", call(e.lock(x, Mode::Exclusive))));
    assert!(!spec.step("hy", call(h.lock(y, Mode::Shared))));
    let mut wx = call(w.lock(x, Mode::Shared));
    let answered = poll(wx.as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("no reordering breaks the cycle: {answered:?}");
    };
    assert_eq!(d.victim(), w.id());
    let order: Vec<_> = d.cycle().iter().map(|c| c.transaction).collect();
    assert_eq!(
        order,
        [w.id(), e.id(), h.id()],
        "through the soft edge: {d}"
    );
    let stats = table.deadlock_stats();
    assert_eq!((stats.cycles, stats.reorders), (1, 0), "{stats:?}");
    drop(wx);
    spec.end("w aborts", || w.abort());
    spec.run();
    spec.end("hc", || h.commit().unwrap());
    spec.run();
    spec.end("ec", || e.commit().unwrap());
    assert_eq!(spec.log, ["w aborts", "hy", "hc", "ex", "ec"]);
    assert!(table.is_empty());
}

/// Strict FIFO everywhere else: a reader queued behind a writer on a key
/// its holders admit stays behind it while no cycle runs through it.
#[test]
fn a_soft_wait_outside_any_cycle_keeps_its_place() {
    let table = Arc::new(LockTable::<u32>::new());
    let (a, b) = (1, 2);
    let [r, w, q] = [(); 3].map(|()| table.clone().transaction_owned());
    let mut spec = Spec::default();
    assert!(spec.step("ra", call(r.lock(a, Mode::Shared))));
    assert!(spec.step("qb", call(q.lock(b, Mode::Exclusive))));
    assert!(!spec.step("wa", call(w.lock(a, Mode::Exclusive))));
    // q holds b and waits behind w: a search runs (r holds a, awaited),
    // finds no cycle, and nobody is moved.
    assert!(!spec.step("qa", call(q.lock(a, Mode::Shared))));
    spec.run();
    assert!(spec.log.is_empty());
    assert_eq!(table.waiters(&a), 2);
    assert_eq!(table.deadlock_stats().reorders, 0);
    spec.end("rc", || r.commit().unwrap());
    spec.run();
    spec.end("wc", || w.commit().unwrap());
    spec.run();
    spec.end("qc", || q.commit().unwrap());
    assert_eq!(spec.log, ["rc", "wa", "wc", "qa", "qc"]);
    assert!(table.is_empty());
}

/// A waker that calls back into the table when woken: it reads the
/// detector's stats (the detector's lock) and a key's state (its shard's
/// lock), and keeps what it saw. Woken under either lock, it would hang.
struct Reentrant {
    table: Arc<LockTable<u32>>,
    key: u32,
    saw: std::sync::Mutex<Vec<(u64, bool)>>,
}

impl std::task::Wake for Reentrant {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let reorders = self.table.deadlock_stats().reorders;
        let locked = self.table.is_locked(&self.key);
        self.saw.lock().unwrap().push((reorders, locked));
    }
}

/// The soft deadlock of deadlock-soft, as a table with d1 and d2 reading
/// a1 and a2, e1 and e2 waiting to write them, and d1's ask of a2 pending
/// (polled with `d1_waker`). Returns the sessions (d1, d2, e1, e2), the
/// pending calls (e1's, e2's, d1's) and d2's closing call, not yet polled.
#[allow(clippy::type_complexity)]
fn soft_setup(
    table: &Arc<LockTable<u32>>,
    d1_waker: &Waker,
) -> (
    [OwnedTransaction<u32>; 4],
    [Call<keylock::Acquired>; 3],
    Call<keylock::Acquired>,
) {
    let [d1, d2, e1, e2] = [(); 4].map(|()| table.clone().transaction_owned());
    assert!(poll(call(d1.lock(1, Mode::Shared)).as_mut()).is_ready());
    assert!(poll(call(d2.lock(2, Mode::Shared)).as_mut()).is_ready());
    let mut e1l = call(e1.lock(1, Mode::Exclusive));
    assert!(poll(e1l.as_mut()).is_pending());
    let mut e2l = call(e2.lock(2, Mode::Exclusive));
    assert!(poll(e2l.as_mut()).is_pending());
    let mut d1a2 = call(d1.lock(2, Mode::Shared));
    let first = d1a2.as_mut().poll(&mut Context::from_waker(d1_waker));
    assert!(first.is_pending());
    let d2a1 = call(d2.lock(1, Mode::Shared));
    ([d1, d2, e1, e2], [e1l, e2l, d1a2], d2a1)
}

/// The wake of the waiter granted ahead of the queue runs with no lock
/// held, after the reorder was counted: its waker reads the detector's
/// stats and the key's state from inside `wake`.
#[test]
fn a_soft_deadlocks_grant_wakes_its_waiter_with_no_lock_held() {
    let table = Arc::new(LockTable::<u32>::new());
    let reentrant = Arc::new(Reentrant {
        table: table.clone(),
        key: 2,
        saw: Default::default(),
    });
    let d1_waker = Waker::from(reentrant.clone());
    let ([d1, d2, e1, e2], [mut e1l, mut e2l, mut d1a2], mut d2a1) = soft_setup(&table, &d1_waker);
    assert!(poll(d2a1.as_mut()).is_pending());
    assert_eq!(
        *reentrant.saw.lock().unwrap(),
        [(1, true)],
        "woken once, after the reorder was counted, a2 held"
    );
    assert!(matches!(poll(d1a2.as_mut()), Poll::Ready(Ok(_))));
    drop(d1a2);
    d1.commit().unwrap();
    assert!(matches!(poll(e1l.as_mut()), Poll::Ready(Ok(_))));
    drop(e1l);
    e1.commit().unwrap();
    assert!(matches!(poll(d2a1.as_mut()), Poll::Ready(Ok(_))));
    drop(d2a1);
    d2.commit().unwrap();
    assert!(matches!(poll(e2l.as_mut()), Poll::Ready(Ok(_))));
    drop(e2l);
    e2.commit().unwrap();
    assert!(table.is_empty());
}

/// A waker that panics when woken.
struct Bomb;

impl std::task::Wake for Bomb {
    fn wake(self: Arc<Self>) {
        panic!("Bomb::wake");
    }
}

/// The waiter granted ahead of the queue has a waker that panics: the poll
/// that closed the cycle panics as it wakes it (after every lock is let
/// go), and the grant stands, complete: the waiter sees it when polled
/// again, nothing is stranded, and the closing call, dropped, leaves the
/// queue.
#[test]
fn a_soft_deadlocks_grant_whose_wake_panics_still_stands() {
    let table = Arc::new(LockTable::<u32>::new());
    let bomb = Waker::from(Arc::new(Bomb));
    let ([d1, d2, e1, e2], [mut e1l, mut e2l, mut d1a2], mut d2a1) = soft_setup(&table, &bomb);
    let closing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll(d2a1.as_mut())));
    assert!(
        closing.is_err(),
        "the wake's panic reaches the closing poll"
    );
    assert_eq!(table.deadlock_stats().reorders, 1);
    drop(d2a1);
    #[cfg(feature = "test-util")]
    table.assert_consistent();
    assert!(matches!(poll(d1a2.as_mut()), Poll::Ready(Ok(_))), "granted");
    drop(d1a2);
    d1.commit().unwrap();
    assert!(matches!(poll(e1l.as_mut()), Poll::Ready(Ok(_))));
    drop(e1l);
    e1.commit().unwrap();
    d2.commit().unwrap();
    assert!(matches!(poll(e2l.as_mut()), Poll::Ready(Ok(_))));
    drop(e2l);
    e2.commit().unwrap();
    assert!(table.is_empty(), "nothing stranded");
}

/// A waiter is moved ahead only if its wait is its transaction's only one:
/// granted, it must wait for nothing (the waiters it passed now wait for
/// it). deadlock-soft-2 with s1 (owned) also waiting for a key a plain
/// guard holds: s1's soft wait is not moved, and its cycle is answered.
#[test]
fn a_soft_waiter_whose_transaction_waits_elsewhere_too_is_not_moved() {
    let table = Arc::new(LockTable::<u32>::new());
    let (a1, a2, p) = (1, 2, 9);
    let plain = table.try_lock(p).unwrap();
    let [s1, s2, s3] = [(); 3].map(|()| table.clone().transaction_owned());
    assert!(poll(call(s1.lock(a1, Mode::Exclusive)).as_mut()).is_ready());
    assert!(poll(call(s2.lock(a2, Mode::Shared)).as_mut()).is_ready());
    let mut s2b = call(s2.lock(a1, Mode::Exclusive));
    assert!(poll(s2b.as_mut()).is_pending());
    let mut s3a = call(s3.lock(a2, Mode::Exclusive));
    assert!(poll(s3a.as_mut()).is_pending());
    let mut s1p = call(s1.lock(p, Mode::Exclusive));
    assert!(poll(s1p.as_mut()).is_pending());
    let mut s1b = call(s1.lock(a2, Mode::Shared));
    let answered = poll(s1b.as_mut());
    let Poll::Ready(Err(TransactionError::Deadlock(d))) = answered else {
        panic!("s1 waits elsewhere too: not moved, answered: {answered:?}");
    };
    let order: Vec<_> = d.cycle().iter().map(|c| c.transaction).collect();
    assert_eq!(order, [s1.id(), s3.id(), s2.id()], "{d}");
    let stats = table.deadlock_stats();
    assert_eq!((stats.cycles, stats.reorders), (1, 0), "{stats:?}");
    assert_eq!(table.waiters(&a2), 1, "s3 alone queued on a2");
    drop((s1b, s1p));
    s1.abort();
    assert!(matches!(poll(s2b.as_mut()), Poll::Ready(Ok(_))));
    drop(s2b);
    s2.commit().unwrap();
    assert!(matches!(poll(s3a.as_mut()), Poll::Ready(Ok(_))));
    drop(s3a);
    s3.commit().unwrap();
    drop(plain);
    assert!(table.is_empty());
}
