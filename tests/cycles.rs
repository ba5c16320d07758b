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
