//! A forgotten transaction call at the head of a queue never keeps a free
//! key from the waiters behind it. Under `Fairness::Eventual` a release
//! before the shard's fairness deadline used to leave the key free and only
//! nudge the head, which must poll to take it: a transaction's call whose
//! future was forgotten (`mem::forget` of its box, safe Rust; the
//! transaction keeps its wait, so that the grant goes to the transaction)
//! never polls, and every waiter behind it stalled until the transaction
//! ended. The same for a lapsed holder's lease noticed by the shard's timer,
//! which nudged the head alone. Every future is polled by hand with a noop
//! (or counting) waker; the clock is a `ManualClock`.
#![cfg(feature = "test-util")]
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use keylock::{Fairness, LockOptions, LockTable, ManualClock, Mode};

mod common;
use common::{counting, forget_pending, poll_noop as poll, wakes, warm_eventual_table, ENDS};

/// Polls `f` up to twice; whether it became ready.
fn ready_within_two<F: Future + ?Sized>(mut f: Pin<&mut F>) -> bool {
    poll(f.as_mut()).is_ready() || poll(f.as_mut()).is_ready()
}

/// The stress's shape: T's forgotten shared call heads the queue, a plain
/// shared lock and another transaction's shared call wait behind it; the
/// holder releases before the fairness deadline.
#[test]
fn an_eventual_release_does_not_leave_a_free_key_behind_a_forgotten_call() {
    for how in ENDS {
        let table = Arc::new(warm_eventual_table());
        let holder = table.try_lock("k").unwrap();
        let t = table.clone().transaction_owned();
        forget_pending(t.lock("k", Mode::Shared));
        let mut plain = Box::pin(table.lock_shared("k"));
        assert!(poll(plain.as_mut()).is_pending());
        let u = table.clone().transaction_owned();
        let mut other = Box::pin(u.lock("k", Mode::Shared));
        assert!(poll(other.as_mut()).is_pending());
        assert_eq!(table.waiters("k"), 3);

        drop(holder); // before the fairness deadline: the clock never moved
        assert!(
            ready_within_two(plain.as_mut()),
            "{how:?}: the plain reader stalls behind the forgotten call: {:?}",
            table.status()
        );
        assert!(
            ready_within_two(other.as_mut()),
            "{how:?}: the other transaction stalls behind the forgotten call: {:?}",
            table.status()
        );
        drop(plain);
        drop(other);
        drop(u);
        // The forgotten call's grant is the transaction's, until it ends.
        assert!(table.is_locked("k"), "{how:?}: {:?}", table.status());
        assert!(table.try_lock("k").is_err());
        how.end_owned(t);
        assert!(table.is_empty(), "{how:?}: {:?}", table.status());
        assert!(table.try_lock("k").is_ok(), "{how:?}");
    }
}

/// The key is free (a plain head nudged) when that head leaves, and T's
/// forgotten call becomes the head: the key must not stay free behind it.
#[test]
fn a_free_key_whose_nudged_head_leaves_does_not_stall_behind_a_forgotten_call() {
    for how in ENDS {
        let table = Arc::new(warm_eventual_table());
        let holder = table.try_lock("k").unwrap();
        let mut nudged = Box::pin(table.lock("k"));
        assert!(poll(nudged.as_mut()).is_pending());
        let t = table.clone().transaction_owned();
        forget_pending(t.lock("k", Mode::Shared));
        let mut plain = Box::pin(table.lock_shared("k"));
        assert!(poll(plain.as_mut()).is_pending());

        drop(holder); // the key is left free, the plain head nudged
        assert!(!table.is_locked("k"), "precondition: the key is left free");
        drop(nudged); // the forgotten call heads the queue
        assert!(
            ready_within_two(plain.as_mut()),
            "{how:?}: the reader stalls behind the forgotten call: {:?}",
            table.status()
        );
        drop(plain);
        assert!(table.is_locked("k"), "{how:?}: {:?}", table.status());
        how.end_owned(t);
        assert!(table.is_empty(), "{how:?}: {:?}", table.status());
    }
}

/// The shard's timer notices a holder's lapsed lease and used to nudge the
/// head alone, which settles the lapse when it polls; a forgotten call at
/// the head never does, and the waiters behind (which rely on the shard's
/// timer, arming none of their own) slept on. Both fairnesses.
#[test]
fn a_lapse_noticed_by_the_shard_timer_wakes_past_a_forgotten_call() {
    for fairness in [Fairness::Strict, Fairness::Eventual] {
        for how in ENDS {
            let clock = ManualClock::with_shard_timers();
            let table = Arc::new(
                LockTable::<&'static str>::builder()
                    .shards(1)
                    .clock(clock.clone())
                    .fairness(fairness)
                    .build(),
            );
            let holder = table
                .try_lock_with("k", LockOptions::new().lease(Duration::from_millis(10)))
                .unwrap();
            let t = table.clone().transaction_owned();
            forget_pending(t.lock("k", Mode::Shared));
            let (woken, waker) = counting();
            let mut plain = Box::pin(table.lock_shared("k"));
            assert!(common::poll(&mut plain, &waker).is_pending());

            clock.advance(Duration::from_millis(20)); // the holder's lease lapses
            assert!(
                wakes(&woken) > 0,
                "{fairness:?} {how:?}: the reader behind the forgotten call is not woken: {:?}",
                table.status()
            );
            assert!(
                ready_within_two(plain.as_mut()),
                "{fairness:?} {how:?}: {:?}",
                table.status()
            );
            drop(plain);
            drop(holder);
            assert!(table.is_locked("k"), "{fairness:?} {how:?}: T's grant");
            how.end_owned(t);
            assert!(
                table.is_empty(),
                "{fairness:?} {how:?}: {:?}",
                table.status()
            );
        }
    }
}
