//! A borrowed transaction's call forgotten in a wait leaves its wait
//! registered with the deadlock detector: the next call's wait takes the
//! forgotten waiter out of its queue as it parks, and drops the forgotten
//! registration as it registers its own. In between (the next call's
//! waiter queued, not yet registered) a search by another transaction
//! read the forgotten registration with the edges the table gives the
//! transaction's new waiter on that key, under the forgotten wait's mode:
//! an exclusive registration over a shared waiter passed over the waiter
//! ahead of it (`passes_over`), marking it visited, so a cycle through that
//! waiter, closed by the searching wait, went unanswered for good. Found by
//! `tests/stress_transactions.rs` with random preemptions around the shard
//! locks (seed 20101842).
#![cfg(feature = "test-util")]
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use keylock::{LockTable, Mode, TransactionError};

fn poll<F: Future + ?Sized>(f: Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

/// 1: the next clone of [`pausing`] pauses (2) until the other thread is
/// done (3).
static STAGE: AtomicU32 = AtomicU32::new(0);

fn pausing() -> Waker {
    fn clone(_: *const ()) -> RawWaker {
        if STAGE
            .compare_exchange(1, 2, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            while STAGE.load(Ordering::SeqCst) != 3 {
                std::thread::yield_now();
            }
        }
        RawWaker::new(std::ptr::null(), &VTABLE)
    }
    fn noop(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, noop, noop, noop);
    // SAFETY: the vtable's functions ignore the data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

fn is_deadlock<T, K>(polled: &Poll<Result<T, TransactionError<K>>>) -> bool {
    matches!(polled, Poll::Ready(Err(TransactionError::Deadlock(_))))
}

/// x holds 1 (shared) and waits for 2; c holds 2 and waits for 4, held
/// shared by a and b; b waits for 1 exclusive, behind x: the cycle
/// c -> b -> x -> c. a's forgotten call waited for 1 exclusive behind b;
/// a's next call waits for 1 shared, and c's wait searches between its
/// queueing and its registration. a is taken first from c (created
/// first), through its forgotten exclusive registration: b, ahead of a's
/// waiter on 1, was passed over and marked visited, and c's edge to b
/// (a holder of 4) was not followed. a's own search then finds the cycle
/// through a and breaks it by granting a's shared wait past b; once a
/// commits, nothing searches again and c, b and x wait for good.
#[test]
fn a_search_between_a_forgotten_calls_wait_and_the_next_ones_registration_finds_the_cycle() {
    let table = LockTable::<u32>::new();
    let mut x = table.transaction();
    let mut a = table.transaction();
    let mut b = table.transaction();
    let mut c = table.transaction();
    assert!(poll(Box::pin(x.lock(1, Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(a.lock(4, Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(b.lock(4, Mode::Shared)).as_mut()).is_ready());
    assert!(poll(Box::pin(c.lock(2, Mode::Exclusive)).as_mut()).is_ready());

    let mut xw = Box::pin(x.lock_all([(2, Mode::Exclusive)]));
    assert!(poll(xw.as_mut()).is_pending());
    let mut bw = Box::pin(b.lock_all([(1, Mode::Exclusive)]));
    assert!(poll(bw.as_mut()).is_pending());
    // Forgotten while it waits for 1, behind b: its wait stays registered.
    let mut forgotten = Box::pin(a.lock_all([(1, Mode::Exclusive)]));
    assert!(poll(forgotten.as_mut()).is_pending());
    std::mem::forget(forgotten);

    // Made here, polled first below (a future does nothing until polled).
    let mut cw = Box::pin(c.lock_all([(4, Mode::Exclusive)]));
    let mut aw = Box::pin(a.lock(1, Mode::Shared));
    let (mut a_got, mut c_got) = std::thread::scope(|s| {
        let cw = &mut cw;
        let other = s.spawn(move || {
            while STAGE.load(Ordering::SeqCst) != 2 {
                std::thread::yield_now();
            }
            // a's shared waiter is queued on 1, its wait not registered yet.
            let got = poll(cw.as_mut());
            STAGE.store(3, Ordering::SeqCst);
            got
        });
        let waker = pausing();
        STAGE.store(1, Ordering::SeqCst);
        let got = poll_with(aw.as_mut(), &waker);
        assert_eq!(STAGE.load(Ordering::SeqCst), 3, "the pause was taken");
        (got, other.join().unwrap())
    });
    let mut answered = is_deadlock(&c_got) || is_deadlock(&a_got);
    if a_got.is_pending() {
        a_got = poll(aw.as_mut());
        answered |= is_deadlock(&a_got);
    }
    drop(aw);
    drop(a_got);
    // Whatever a got, it ends: its keys go.
    drop(a);
    let mut x_got = poll(xw.as_mut());
    let mut b_got = poll(bw.as_mut());
    if c_got.is_pending() {
        c_got = poll(cw.as_mut());
    }
    answered |= is_deadlock(&x_got) || is_deadlock(&b_got) || is_deadlock(&c_got);
    assert!(
        answered,
        "the cycle c -> b -> x -> c is left unanswered: {:?}",
        table.status()
    );
    // A victim's keys go when its transaction ends; the rest then finish.
    drop(cw);
    drop(c_got);
    drop(c);
    for _ in 0..4 {
        if x_got.is_pending() {
            x_got = poll(xw.as_mut());
        }
        if b_got.is_pending() {
            b_got = poll(bw.as_mut());
        }
    }
    drop((xw, bw, x_got, b_got));
    drop((x, b));
    assert!(table.status().is_empty(), "{:?}", table.status());
}

fn poll_with<F: Future + ?Sized>(f: Pin<&mut F>, waker: &Waker) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(waker))
}
