//! Leases, fencing, renewals, revocation and timeouts, driven by a manual
//! clock and by polling futures by hand.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::task::Poll;
    use std::time::Duration;

    use keylock::{LockError, LockTable, ManualClock};

    use crate::common::{counting, lease, poll, ready, table, timeout, wakes, SEC};

    #[test]
    fn lease_lapses_when_judged_now_without_any_timer() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        assert_eq!(g.expires_at(), Some(clock.now() + 5 * SEC));
        clock.advance(5 * SEC - Duration::from_nanos(1));
        assert_eq!(g.check(), Ok(g.token()));
        assert!(!g.is_expired());
        assert!(table.is_locked("k"));
        clock.advance(Duration::from_nanos(1));
        assert!(g.is_expired());
        assert_eq!(
            g.check(),
            Err(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        assert!(!table.is_locked("k"), "a lapsed holder does not count");
        drop(g);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert_eq!(table.stats().expired, 1);
    }

    #[test]
    fn lapse_hands_key_to_head_waiter_woken_by_its_timer() {
        let (clock, table) = table();
        let holder = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        assert_eq!(
            clock.sleepers(),
            1,
            "the head of a leased holder's queue arms one timer"
        );
        clock.advance(2 * SEC);
        assert_eq!(wakes(&c), 1, "the timer woke the head at the deadline");
        let g = ready(&mut waiter, &w, "lapsed key not handed over");
        assert!(g.token() > holder.token());
        assert_eq!(
            holder.check(),
            Err(LockError::Expired {
                token: holder.token(),
                key: None,
            })
        );
        // The stale guard's drop must not free the successor's key.
        drop(holder);
        assert!(table.is_locked("k"));
        assert!(table.try_lock("k").is_err());
        drop(g);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert_eq!(clock.sleepers(), 0);
    }

    #[test]
    fn no_timer_without_leases_or_timeouts() {
        let (clock, table) = table();
        let holder = table.try_lock("k").unwrap();
        let (_, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        assert_eq!(clock.sleepers(), 0);
        drop(holder);
        assert!(poll(&mut waiter, &w).is_ready());
    }

    #[test]
    fn lease_runs_from_handoff_not_from_when_waiter_runs() {
        let (clock, table) = table();
        let holder = table.try_lock("k").unwrap();
        let (_, w) = counting();
        let mut waiter = Box::pin(table.lock_with("k", lease(3 * SEC)));
        assert!(poll(&mut waiter, &w).is_pending());
        let granted_at = clock.now();
        drop(holder);
        clock.advance(SEC);
        let g = ready(&mut waiter, &w, "not granted").unwrap();
        assert_eq!(g.expires_at(), Some(granted_at + 3 * SEC));
    }

    #[test]
    fn grant_that_lapses_unobserved_is_fenced_like_a_guard_and_not_requeued() {
        let (clock, table) = table();
        let holder = table.try_lock("k").unwrap();
        let (ca, wa) = counting();
        let (cb, wb) = counting();
        let mut a = Box::pin(table.lock_with("k", lease(SEC)));
        let mut b = Box::pin(table.lock("k"));
        assert!(poll(&mut a, &wa).is_pending());
        assert!(poll(&mut b, &wb).is_pending());
        drop(holder); // a is granted with a one-second lease
        assert_eq!(wakes(&ca), 1);
        clock.advance(SEC); // ... which lapses before a runs
                            // b is the head now and armed a timer when a was granted.
        assert!(wakes(&cb) >= 1);
        let gb = ready(&mut b, &wb, "b should get the key after a's grant lapsed");
        // a is not queued again: a future that never runs costs the key one
        // lease in all. When it runs, it holds a fenced guard.
        assert_eq!(table.waiters("k"), 0);
        let ga = ready(&mut a, &wa, "a resolves to its (lapsed) grant").unwrap();
        assert!(ga.is_expired());
        assert_eq!(
            ga.check(),
            Err(LockError::Expired {
                token: ga.token(),
                key: None
            })
        );
        assert!(ga.token() < gb.token());
        // Its release frees nothing of b's.
        drop(ga);
        assert!(table.is_locked("k"));
        assert!(gb.check().is_ok());
        drop(gb);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert!(table.try_lock("k").is_ok());
    }

    #[test]
    fn renew_extends_or_shortens_a_live_lease_and_never_revives() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        clock.advance(SEC);
        g.renew(10 * SEC).unwrap();
        assert_eq!(g.expires_at(), Some(clock.now() + 10 * SEC));
        clock.advance(5 * SEC);
        assert!(!g.is_expired());
        g.renew(SEC).unwrap();
        clock.advance(SEC);
        assert!(g.is_expired());
        assert_eq!(
            g.renew(SEC),
            Err(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        assert!(g.is_expired());
        let bad = g.renew(Duration::ZERO).unwrap_err();
        assert!(matches!(
            bad,
            LockError::InvalidOptions {
                option: "lease",
                ..
            }
        ));
    }

    #[test]
    fn renew_gives_a_lease_to_a_guard_without_one() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        assert_eq!(g.expires_at(), None);
        g.renew(SEC).unwrap();
        assert_eq!(g.expires_at(), Some(clock.now() + SEC));
        clock.advance(SEC);
        assert!(g.is_expired());
    }

    #[test]
    fn renew_rearms_the_head_waiters_timer() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        g.renew(SEC / 2).unwrap();
        assert_eq!(wakes(&c), 1, "head woken to re-arm for the shorter lease");
        assert!(poll(&mut waiter, &w).is_pending());
        clock.advance(SEC / 2);
        assert!(wakes(&c) >= 2);
        assert!(poll(&mut waiter, &w).is_ready());
        assert!(g.is_expired());
    }

    #[test]
    fn revoke_fences_the_holder_and_passes_the_key_on() {
        let (_clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        assert_eq!(table.revoke("k"), Some(g.token()));
        assert_eq!(wakes(&c), 1);
        assert!(g.is_expired());
        let next = ready(&mut waiter, &w, "revoked key not handed on");
        drop(g);
        assert!(table.is_locked("k"), "a fenced drop frees nothing");
        assert_eq!(table.revoke("nobody"), None);
        drop(next);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert_eq!(table.stats().revoked, 1);
    }

    #[test]
    fn revoke_of_a_lapsed_holder_returns_none_and_frees_the_key() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(SEC)).unwrap();
        clock.advance(SEC);
        assert_eq!(table.revoke("k"), None);
        let again = table.try_lock("k").unwrap();
        assert!(again.token() > g.token());
        drop(g);
        assert!(table.is_locked("k"));
        drop(again);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn timeout_removes_the_waiter_and_names_the_holder() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(100 * SEC)).unwrap();
        clock.advance(SEC);
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock_with("k", timeout(3 * SEC)));
        assert!(poll(&mut waiter, &w).is_pending());
        assert_eq!(table.waiters("k"), 1);
        clock.advance(3 * SEC);
        assert_eq!(wakes(&c), 1);
        match poll(&mut waiter, &w) {
            Poll::Ready(Err(LockError::Timeout {
                waited,
                holder,
                held_for,
                ahead,
                ..
            })) => {
                assert_eq!(waited, 3 * SEC);
                assert_eq!(holder, Some(g.token()));
                assert_eq!(held_for, Some(4 * SEC));
                assert_eq!(ahead, 0);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(table.waiters("k"), 0);
        assert_eq!(clock.sleepers(), 0);
        drop(waiter);
        drop(g);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert_eq!(table.stats().timed_out, 1);
    }

    #[test]
    fn zero_timeout_does_not_wait() {
        let (_clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let (_, w) = counting();
        let mut f = Box::pin(table.lock_with("k", timeout(Duration::ZERO)));
        match poll(&mut f, &w) {
            Poll::Ready(Err(LockError::Timeout { holder, waited, .. })) => {
                assert_eq!(holder, Some(g.token()));
                assert_eq!(waited, Duration::ZERO);
            }
            other => panic!("expected an immediate timeout, got {other:?}"),
        }
        assert_eq!(table.waiters("k"), 0);
        drop(g);
        let mut f = Box::pin(table.lock_with("k", timeout(Duration::ZERO)));
        assert!(matches!(poll(&mut f, &w), Poll::Ready(Ok(_))));
    }

    #[test]
    fn huge_timeout_waits_for_ever() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let (_, w) = counting();
        let mut f = Box::pin(table.lock_with("k", timeout(Duration::MAX)));
        assert!(poll(&mut f, &w).is_pending());
        assert_eq!(clock.sleepers(), 0);
        clock.advance(Duration::from_secs(1 << 40));
        assert!(poll(&mut f, &w).is_pending());
        drop(g);
        assert!(matches!(poll(&mut f, &w), Poll::Ready(Ok(_))));
    }

    #[test]
    fn hundreds_of_timeouts_leak_nothing() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let (_, w) = counting();
        let mut futs: Vec<_> = (0..300)
            .map(|i| Box::pin(table.lock_with("k", timeout(Duration::from_millis(1 + i % 7)))))
            .collect();
        for f in &mut futs {
            assert!(poll(f, &w).is_pending());
        }
        assert_eq!(table.waiters("k"), 300);
        clock.advance(SEC);
        for f in &mut futs {
            assert!(matches!(
                poll(f, &w),
                Poll::Ready(Err(LockError::Timeout { .. }))
            ));
        }
        assert_eq!(table.waiters("k"), 0);
        assert_eq!(clock.sleepers(), 0);
        drop(futs);
        drop(g);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
        assert_eq!(table.stats().timed_out, 300);
    }

    #[test]
    fn invalid_options_are_refused_before_queueing() {
        let clock = ManualClock::new();
        let table: LockTable<u8> = LockTable::builder()
            .clock(clock)
            .max_lease(10 * SEC)
            .build();
        let held = table.try_lock(1).unwrap();
        let err = table.try_lock_with(2, lease(11 * SEC)).unwrap_err();
        assert_eq!(
            err,
            LockError::InvalidOptions {
                option: "lease",
                value: 11 * SEC,
                min: Duration::from_nanos(1),
                max: 10 * SEC
            }
        );
        assert!(err.to_string().contains("11s") && err.to_string().contains("10s"));
        let (_, w) = counting();
        let mut f = Box::pin(table.lock_with(1, lease(Duration::ZERO)));
        assert!(matches!(
            poll(&mut f, &w),
            Poll::Ready(Err(LockError::InvalidOptions { .. }))
        ));
        assert_eq!(table.waiters(&1), 0);
        drop(held);
        table.assert_consistent();
        assert_eq!(table.len(), 0);
    }

    #[test]
    #[should_panic(expected = "default_lease")]
    fn builder_rejects_a_zero_default_lease() {
        let _t: LockTable<u8> = LockTable::builder().default_lease(Duration::ZERO).build();
    }

    #[test]
    #[should_panic(expected = "default_lease")]
    fn builder_rejects_a_default_lease_above_the_max() {
        let _t: LockTable<u8> = LockTable::builder()
            .max_lease(SEC)
            .default_lease(2 * SEC)
            .build();
    }

    #[test]
    fn default_lease_applies_to_plain_locks() {
        let clock = ManualClock::new();
        let table: LockTable<u8> = LockTable::builder()
            .clock(clock.clone())
            .default_lease(SEC)
            .build();
        let g = table.try_lock(1).unwrap();
        assert_eq!(g.expires_at(), Some(clock.now() + SEC));
        let b = table.blocking_lock(2);
        assert_eq!(b.expires_at(), Some(clock.now() + SEC));
        clock.advance(SEC);
        assert!(g.is_expired() && b.is_expired());
    }

    #[test]
    fn is_expired_always_equals_check_is_err() {
        let (clock, table) = table();
        let a = table.try_lock_with("a", lease(SEC)).unwrap();
        let b = table.try_lock("b").unwrap();
        let c = table.try_lock_with("c", lease(10 * SEC)).unwrap();
        table.revoke("b");
        clock.advance(SEC);
        for g in [&a, &b, &c] {
            assert_eq!(g.is_expired(), g.check().is_err());
        }
        assert!(a.is_expired() && b.is_expired() && !c.is_expired());
    }

    #[test]
    fn tokens_increase_across_lapse_and_idle() {
        let (clock, table) = table();
        let mut last = None;
        for _ in 0..5 {
            let g = table.try_lock_with("k", lease(SEC)).unwrap();
            assert!(last < Some(g.token()));
            last = Some(g.token());
            clock.advance(SEC);
            drop(g);
        }
        table.assert_consistent();
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn plain_locks_never_read_the_clock() {
        let (clock, table) = table();
        let before = clock.reads();
        for _ in 0..100 {
            drop(table.try_lock("k").unwrap());
            let (_, w) = counting();
            let mut f = Box::pin(table.lock("k"));
            let g = ready(&mut f, &w, "free key");
            // Contended, without lease or timeout: a handoff reads no clock either.
            let mut waiter = Box::pin(table.lock("k"));
            assert!(poll(&mut waiter, &w).is_pending());
            drop(g);
            assert!(poll(&mut waiter, &w).is_ready());
        }
        assert_eq!(clock.reads(), before, "no lease, no timeout: no clock read");
        drop(table.try_lock_with("k", lease(SEC)).unwrap());
        assert!(clock.reads() > before, "a lease reads the clock");
    }

    #[test]
    fn a_timeout_after_the_holders_lease_lapsed_takes_the_key_instead_of_giving_up() {
        // Regression: a poll past its timeout gave up without settling the
        // holder's lapse first, and named the lapsed holder in its error.
        let (clock, table) = table();
        let holder = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        let (_, w) = counting();
        let mut f = Box::pin(table.lock_with("k", timeout(3 * SEC)));
        assert!(poll(&mut f, &w).is_pending());
        clock.advance(3 * SEC);
        let guard = match poll(&mut f, &w) {
            Poll::Ready(Ok(g)) => g,
            other => panic!("the key was the waiter's from 2 s on, got {other:?}"),
        };
        assert!(guard.token() > holder.token());
        assert!(holder.is_expired());
        drop(holder);
        assert!(table.is_locked("k"));
        drop(guard);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    /// Every waiter arms its timer for the holder it saw; a handoff to a grant
    /// whose lease ends no earlier than that wakes nobody but the new holder.
    #[test]
    fn handoff_between_leases_of_one_length_wakes_only_the_new_holder() {
        let (clock, table) = table();
        let holder = table.try_lock_with("k", lease(10 * SEC)).unwrap();
        let (ca, wa) = counting();
        let (cb, wb) = counting();
        let mut a = Box::pin(table.lock_with("k", lease(10 * SEC)));
        let mut b = Box::pin(table.lock_with("k", lease(10 * SEC)));
        assert!(poll(&mut a, &wa).is_pending());
        assert!(poll(&mut b, &wb).is_pending());
        assert_eq!(
            clock.sleepers(),
            2,
            "each waiter arms for the holder's lease"
        );
        clock.advance(SEC);
        drop(holder);
        assert_eq!(wakes(&ca), 1, "A is granted");
        assert_eq!(wakes(&cb), 0, "B's timer already covers A's later deadline");
        let ga = ready(&mut a, &wa, "A was granted").unwrap();
        // A's lease ends 11 s from the start; B's timer (armed for 10 s) fires
        // first and B re-arms for A's deadline.
        clock.advance(9 * SEC);
        assert_eq!(wakes(&cb), 1, "B's early timer fired");
        assert!(poll(&mut b, &wb).is_pending(), "A's lease is live");
        clock.advance(SEC);
        assert_eq!(wakes(&cb), 2, "B re-armed for A's deadline");
        let gb = ready(&mut b, &wb, "A's lease lapsed: B takes the key").unwrap();
        assert!(ga.is_expired());
        assert!(gb.token() > ga.token());
        drop((ga, gb, a, b));
        assert_eq!(table.len(), 0);
        assert_eq!(clock.sleepers(), 0);
    }

    /// A handoff to a grant whose lease ends before the next head's timer
    /// would fire nudges that head to re-arm: it takes the key at the earlier
    /// deadline.
    #[test]
    fn handoff_to_a_shorter_lease_rearms_the_next_heads_timer() {
        let (clock, table) = table();
        let holder = table.try_lock_with("k", lease(10 * SEC)).unwrap();
        let (ca, wa) = counting();
        let (cb, wb) = counting();
        let mut a = Box::pin(table.lock_with("k", lease(SEC)));
        let mut b = Box::pin(table.lock("k"));
        assert!(poll(&mut a, &wa).is_pending());
        assert!(poll(&mut b, &wb).is_pending());
        drop(holder);
        assert_eq!(wakes(&ca), 1, "A is granted");
        assert_eq!(
            wakes(&cb),
            1,
            "B is nudged: A's lease ends before B's timer"
        );
        assert!(poll(&mut b, &wb).is_pending(), "B re-arms for A's deadline");
        let ga = ready(&mut a, &wa, "A was granted").unwrap();
        clock.advance(SEC);
        assert_eq!(wakes(&cb), 2, "B's timer fired at A's deadline");
        let gb = ready(&mut b, &wb, "A's 1 s lease lapsed: B takes the key");
        assert!(ga.is_expired());
        drop((ga, gb, a, b));
        assert_eq!(table.len(), 0);
    }

    /// A holder without a lease, then a leased grant: the next head had no
    /// timer, so it is nudged to arm one.
    #[test]
    fn handoff_from_an_unleased_to_a_leased_grant_arms_the_next_head() {
        let (clock, table) = table();
        let holder = table.try_lock("k").unwrap();
        let (_ca, wa) = counting();
        let (cb, wb) = counting();
        let mut a = Box::pin(table.lock_with("k", lease(SEC)));
        let mut b = Box::pin(table.lock("k"));
        assert!(poll(&mut a, &wa).is_pending());
        assert!(poll(&mut b, &wb).is_pending());
        assert_eq!(clock.sleepers(), 0, "no lease, no timeout: no timer");
        drop(holder);
        assert_eq!(wakes(&cb), 1, "B is nudged to arm a timer for A's lease");
        assert!(poll(&mut b, &wb).is_pending());
        assert_eq!(clock.sleepers(), 1);
        let ga = ready(&mut a, &wa, "A was granted").unwrap();
        clock.advance(SEC);
        let gb = ready(&mut b, &wb, "A's lease lapsed: B takes the key");
        drop((ga, gb, a, b));
        assert_eq!(table.len(), 0);
    }
}
