//! Shard timers, driven by a `ManualClock::with_shard_timers()`: each shard
//! keeps one timer for the earliest deadline of its waiters (their timeouts,
//! and the leases of holders with waiters), as tables on the real clock do.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::sync::Arc;
    use std::task::{Poll, Wake, Waker};

    use keylock::{LockError, LockTable, ManualClock};

    use crate::common::{counting, lease, poll, ready, timeout, wakes, SEC};

    fn table() -> (ManualClock, LockTable<u32>) {
        let clock = ManualClock::with_shard_timers();
        let table = LockTable::builder().clock(clock.clone()).shards(1).build();
        (clock, table)
    }

    #[test]
    fn one_shard_timer_serves_every_waiter_and_each_times_out_at_its_own_deadline() {
        let (clock, table) = table();
        let _holder = table.try_lock(1).unwrap();
        let mut waiters: Vec<_> = (1..=4u32)
            .map(|i| {
                let (c, w) = counting();
                (c, w, Box::pin(table.lock_with(1, timeout(i * SEC))))
            })
            .collect();
        for (_, w, f) in &mut waiters {
            assert!(poll(f, w).is_pending());
        }
        assert_eq!(clock.sleepers(), 0, "no waiter arms a timer of its own");
        assert_eq!(clock.armed_shards(), 1, "one timer for the shard");
        for due in 0..4 {
            clock.advance(SEC);
            for (i, (c, w, f)) in waiters.iter_mut().enumerate() {
                if i < due {
                    continue;
                }
                if i == due {
                    assert_eq!(wakes(c), 1, "waiter {i} woken at its deadline");
                    match poll(f, w) {
                        Poll::Ready(Err(LockError::Timeout { waited, ahead, .. })) => {
                            assert_eq!(waited, (i as u32 + 1) * SEC);
                            assert_eq!(ahead, 0, "those ahead already gave up");
                        }
                        other => panic!("waiter {i}: expected a timeout, got {other:?}"),
                    }
                } else {
                    assert_eq!(wakes(c), 0, "waiter {i} woken before its deadline");
                }
            }
        }
        assert_eq!(table.waiters(&1), 0);
        assert_eq!(clock.armed_shards(), 0, "nothing left to time");
    }

    #[test]
    fn a_lapse_is_noticed_by_the_shard_timer_and_the_head_takes_the_key() {
        let (clock, table) = table();
        let holder = table.try_lock_with(1, lease(2 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock(1));
        assert!(poll(&mut waiter, &w).is_pending());
        clock.advance(SEC);
        assert_eq!(wakes(&c), 0, "woken before the lease lapsed");
        clock.advance(SEC);
        assert_eq!(wakes(&c), 1, "the shard timer nudged the head at the lapse");
        let g = ready(&mut waiter, &w, "the lapsed key was not handed over");
        assert!(holder.is_expired());
        assert!(g.token() > holder.token());
        drop((holder, g));
        assert!(table.is_empty());
    }

    /// Key 1 handed over with a 2 s lease to the last waiter in its queue
    /// (no waiter left behind it, so the handoff arms no timer), the
    /// holder's guard forgotten: only the lapse can free the key. With
    /// `busy`, the shard's timer is already armed for another key's later
    /// timeout (10 s) before anyone waits for key 1.
    fn a_leased_handoff_with_no_waiter_left(
        busy: bool,
    ) -> (ManualClock, Arc<LockTable<u32>>, keylock::FencingToken) {
        let (clock, table) = table();
        let table = Arc::new(table);
        let first = table.try_lock(1).unwrap();
        let (_, w) = counting();
        let mut heir = Box::pin(table.lock_with(1, lease(2 * SEC)));
        assert!(poll(&mut heir, &w).is_pending());
        drop(first);
        let held = ready(&mut heir, &w, "handed over").unwrap();
        drop(heir);
        assert_eq!(table.waiters(&1), 0);
        let token = held.token();
        std::mem::forget(held);
        if busy {
            std::mem::forget(table.try_lock(2).unwrap());
            let mut other = Box::pin(table.clone().lock_owned_with(2, timeout(10 * SEC)));
            assert!(poll(&mut other, &w).is_pending());
            std::mem::forget(other);
            assert_eq!(clock.armed_shards(), 1);
        }
        (clock, table, token)
    }

    /// After a leased handoff that left no waiter (and so armed nothing), a
    /// waiter that links later, exclusive or shared, plain or timed, and
    /// with the shard's timer busy with another key or not, makes the timer
    /// cover the holder's lease: it is woken at the lapse and takes the key,
    /// though the holder never lets go.
    #[test]
    fn a_waiter_behind_a_lease_handed_to_the_last_waiter_is_woken_at_the_lapse() {
        for busy in [false, true] {
            for late in ["exclusive", "shared", "timed"] {
                let (clock, table, held) = a_leased_handoff_with_no_waiter_left(busy);
                let (c, w) = counting();
                let got = match late {
                    "exclusive" | "shared" => {
                        let mut f = Box::pin(if late == "shared" {
                            table.lock_shared(1)
                        } else {
                            table.lock(1)
                        });
                        assert!(poll(&mut f, &w).is_pending(), "{late}, busy {busy}");
                        clock.advance(SEC);
                        assert_eq!(wakes(&c), 0, "{late}, busy {busy}: woken early");
                        clock.advance(SEC);
                        assert_eq!(wakes(&c), 1, "{late}, busy {busy}: not woken at the lapse");
                        ready(&mut f, &w, "the lapsed key was not handed over")
                    }
                    _ => {
                        let mut f = Box::pin(table.lock_with(1, timeout(5 * SEC)));
                        assert!(poll(&mut f, &w).is_pending(), "{late}, busy {busy}");
                        clock.advance(SEC);
                        assert_eq!(wakes(&c), 0, "{late}, busy {busy}: woken early");
                        clock.advance(SEC);
                        assert_eq!(wakes(&c), 1, "{late}, busy {busy}: not woken at the lapse");
                        ready(&mut f, &w, "the lapsed key was not handed over").expect("in time")
                    }
                };
                assert!(got.token() > held, "{late}, busy {busy}: a new grant");
                assert!(table.is_locked(&1), "{late}, busy {busy}");
                drop(got);
                assert!(!table.is_locked(&1), "{late}, busy {busy}: left held");
            }
        }
    }

    /// A manual clock fires its shard timers only inside `advance`, so a
    /// timer armed for an instant already past waits for the next one: a
    /// plain wait behind a holder whose lease lapsed must settle the lapse
    /// itself and take the key at its first poll, not link behind it and
    /// count on that timer. Here the timer is left armed in the past by a
    /// waiter leaving another key, whose holder lapsed unnoticed.
    #[test]
    fn a_plain_wait_behind_a_lapsed_holder_takes_the_key_at_once_on_a_manual_clock() {
        let (clock, table) = table();
        let held = table.try_lock_with(1, lease(2 * SEC)).unwrap();
        let _other = table.try_lock_with(2, lease(SEC)).unwrap();
        let (_, w) = counting();
        let mut first = Box::pin(table.lock(2));
        let mut second = Box::pin(table.lock(2));
        assert!(poll(&mut first, &w).is_pending());
        assert!(poll(&mut second, &w).is_pending());
        // Both leases lapse; the firing nudges key 2's head and disarms.
        clock.advance(2 * SEC);
        // Key 2's head leaves: the queue is re-covered, for a deadline
        // already past.
        drop(first);
        assert_eq!(clock.armed_shards(), 1, "armed for key 2's lapsed lease");
        let mut late = Box::pin(table.lock(1));
        let got = ready(
            &mut late,
            &w,
            "key 1's holder lapsed: taken at the first poll",
        );
        assert!(got.token() > held.token());
        drop(got);
        drop(second);
    }

    /// The real-clock bug this guards against: a holder renews (its deadline
    /// moves later) after the shard's timer was armed for the old deadline, then
    /// stalls. The timer fires early, finds the lease live, re-arms for the new
    /// deadline; the waiter gets the key then, not before, not never.
    #[test]
    fn a_renewed_then_stalled_holder_loses_the_key_at_the_renewed_deadline() {
        let (clock, table) = table();
        let holder = table.try_lock_with(1, lease(2 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock(1));
        assert!(poll(&mut waiter, &w).is_pending());
        holder.renew(5 * SEC).unwrap();
        clock.advance(2 * SEC);
        assert_eq!(wakes(&c), 0, "the renewed lease is live: nobody to wake");
        assert_eq!(clock.armed_shards(), 1, "re-armed for the renewed deadline");
        assert!(!holder.is_expired());
        clock.advance(3 * SEC);
        assert_eq!(wakes(&c), 1, "woken at the renewed deadline");
        let g = ready(
            &mut waiter,
            &w,
            "the key was not handed over after the renewed lease",
        );
        assert!(holder.is_expired());
        drop((g, holder));
        assert!(table.is_empty());
    }

    #[test]
    fn a_shortened_lease_moves_the_shard_timer_earlier() {
        let (clock, table) = table();
        let holder = table.try_lock_with(1, lease(10 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock(1));
        assert!(poll(&mut waiter, &w).is_pending());
        holder.renew(SEC).unwrap();
        clock.advance(SEC);
        assert_eq!(wakes(&c), 1, "woken at the shortened deadline");
        assert!(poll(&mut waiter, &w).is_ready());
        drop(holder);
    }

    #[test]
    fn waiters_that_leave_before_their_deadline_leave_no_wake_behind() {
        let (clock, table) = table();
        let holder = table.try_lock(1).unwrap();
        let (c, w) = counting();
        let mut early = Box::pin(table.lock_with(1, timeout(SEC)));
        assert!(poll(&mut early, &w).is_pending());
        drop(early);
        drop(holder);
        clock.advance(2 * SEC);
        assert_eq!(wakes(&c), 0, "a waiter that left was woken");
        assert_eq!(
            clock.armed_shards(),
            0,
            "the stale deadline fired and disarmed"
        );
        assert!(table.is_empty());
    }

    #[test]
    fn dropping_the_table_disarms_its_shard_timers() {
        let clock = ManualClock::with_shard_timers();
        {
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let _holder = table.try_lock(1).unwrap();
            let w = futures::task::noop_waker();
            let mut waiter = Box::pin(table.lock_with(1, timeout(SEC)));
            assert!(poll(&mut waiter, &w).is_pending());
            assert_eq!(clock.armed_shards(), 1);
        }
        assert_eq!(
            clock.armed_shards(),
            0,
            "a dropped table left a shard timer"
        );
        // Nothing left to fire into freed memory (miri and the sanitizers of the
        // fuzz build would see it).
        clock.advance(2 * SEC);
    }

    #[test]
    fn a_panicking_waker_does_not_stop_the_other_due_waiters_from_waking() {
        struct Bomb;
        impl Wake for Bomb {
            fn wake(self: Arc<Self>) {
                panic!("a hostile waker");
            }
        }
        let (clock, table) = table();
        let _holder = table.try_lock(1).unwrap();
        let bomb = Waker::from(Arc::new(Bomb));
        let (c, w) = counting();
        let mut a = Box::pin(table.lock_with(1, timeout(SEC)));
        let mut b = Box::pin(table.lock_with(1, timeout(SEC)));
        assert!(poll(&mut a, &bomb).is_pending());
        assert!(poll(&mut b, &w).is_pending());
        let advanced =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| clock.advance(SEC)));
        assert!(advanced.is_err(), "the waker's panic reaches the caller");
        assert_eq!(wakes(&c), 1, "the other due waiter was still woken");
        assert!(matches!(
            poll(&mut b, &w),
            Poll::Ready(Err(LockError::Timeout { .. }))
        ));
        assert!(matches!(
            poll(&mut a, &w),
            Poll::Ready(Err(LockError::Timeout { .. }))
        ));
        table.assert_consistent();
    }

    /// A waker woken by a shard timer's fire that calls back into the table
    /// (takes a key, queues a new wait with a timeout, which arms the shard
    /// timer again): no lock of the table or the clock is held while it
    /// runs, so nothing deadlocks, and the new wait is timed like any other.
    #[test]
    fn a_waker_woken_by_a_fire_may_call_back_into_the_table() {
        use std::sync::Mutex;

        struct Reenter {
            table: Arc<LockTable<u32>>,
            waits: Mutex<Vec<std::pin::Pin<Box<keylock::futures::LockOwnedWith<u32>>>>>,
            woken: std::sync::atomic::AtomicUsize,
        }
        impl Wake for Reenter {
            fn wake(self: Arc<Self>) {
                self.woken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // Key 2 is free: taken and released under the fire's wake.
                drop(self.table.try_lock(2).expect("key 2 is free"));
                // Key 1 is held: a new wait queues and arms the shard timer.
                let mut wait = Box::pin(self.table.clone().lock_owned_with(1, timeout(SEC)));
                let noop = futures::task::noop_waker();
                assert!(poll(&mut wait, &noop).is_pending());
                self.waits.lock().unwrap().push(wait);
            }
        }

        let clock = ManualClock::with_shard_timers();
        let table = Arc::new(LockTable::builder().clock(clock.clone()).shards(1).build());
        let holder = table.try_lock(1).unwrap();
        let reenter = Arc::new(Reenter {
            table: table.clone(),
            waits: Mutex::new(Vec::new()),
            woken: std::sync::atomic::AtomicUsize::new(0),
        });
        let w = Waker::from(reenter.clone());
        let mut first = Box::pin(table.lock_with(1, timeout(SEC)));
        assert!(poll(&mut first, &w).is_pending());
        clock.advance(SEC);
        assert_eq!(reenter.woken.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(matches!(
            poll(&mut first, &w),
            Poll::Ready(Err(LockError::Timeout { .. }))
        ));
        assert_eq!(table.waiters(&1), 1, "the wait queued from the waker");
        assert_eq!(clock.armed_shards(), 1, "and armed the shard timer");
        clock.advance(SEC);
        let mut waits = std::mem::take(&mut *reenter.waits.lock().unwrap());
        let noop = futures::task::noop_waker();
        assert!(matches!(
            poll(&mut waits[0], &noop),
            Poll::Ready(Err(LockError::Timeout { .. }))
        ));
        drop((waits, first, holder));
        table.assert_consistent();
        assert!(table.is_empty());
    }
}
