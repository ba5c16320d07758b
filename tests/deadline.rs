//! `LockOptions::deadline`: a wait gives up at an instant on the table's
//! clock, as a timeout would; with both, the earlier wins; a deadline already
//! passed does not wait. Under both kinds of manual-clock timers, and the
//! real clock.

mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::time::{Duration, Instant};

    use keylock::{LockError, LockOptions, LockTable, ManualClock};

    use crate::common::{counting, poll, wakes, SEC};

    fn tables() -> Vec<(ManualClock, LockTable<&'static str>)> {
        [ManualClock::new(), ManualClock::with_shard_timers()]
            .into_iter()
            .map(|clock| {
                let table = LockTable::builder().clock(clock.clone()).build();
                (clock, table)
            })
            .collect()
    }

    #[test]
    fn a_wait_gives_up_at_its_deadline_and_names_the_holder() {
        for (clock, table) in tables() {
            let holder = table.try_lock("k").unwrap();
            let (c, w) = counting();
            let deadline = clock.now() + 3 * SEC;
            let mut wait = Box::pin(table.lock_with("k", LockOptions::new().deadline(deadline)));
            assert!(poll(&mut wait, &w).is_pending());
            clock.advance(2 * SEC);
            assert_eq!(wakes(&c), 0, "woken before its deadline");
            assert!(poll(&mut wait, &w).is_pending());
            clock.advance(SEC);
            assert!(wakes(&c) >= 1, "not woken at its deadline");
            match poll(&mut wait, &w) {
                std::task::Poll::Ready(Err(LockError::Timeout {
                    waited, holder: h, ..
                })) => {
                    assert_eq!(waited, 3 * SEC);
                    assert_eq!(h, Some(holder.token()));
                }
                other => panic!("expected a timeout at the deadline, got {other:?}"),
            }
            assert_eq!(table.waiters(&"k"), 0);
        }
    }

    #[test]
    fn with_a_timeout_too_the_earlier_wins() {
        for (clock, table) in tables() {
            let _holder = table.try_lock("k").unwrap();
            let (_c, w) = counting();
            let early_deadline = LockOptions::new()
                .timeout(10 * SEC)
                .deadline(clock.now() + SEC);
            let early_timeout = LockOptions::new()
                .timeout(SEC)
                .deadline(clock.now() + 10 * SEC);
            let mut a = Box::pin(table.lock_with("k", early_deadline));
            let mut b = Box::pin(table.lock_with("k", early_timeout));
            assert!(poll(&mut a, &w).is_pending());
            assert!(poll(&mut b, &w).is_pending());
            clock.advance(SEC);
            for (name, f) in [("deadline first", &mut a), ("timeout first", &mut b)] {
                match poll(f, &w) {
                    std::task::Poll::Ready(Err(LockError::Timeout { waited, .. })) => {
                        assert_eq!(waited, SEC, "{name}");
                    }
                    other => panic!("{name}: expected a timeout after 1 s, got {other:?}"),
                }
            }
        }
    }

    #[test]
    fn a_deadline_already_passed_does_not_wait() {
        for (clock, table) in tables() {
            let holder = table.try_lock("k").unwrap();
            let (_c, w) = counting();
            let past = clock.now();
            clock.advance(SEC);
            let mut wait = Box::pin(table.lock_with("k", LockOptions::new().deadline(past)));
            match poll(&mut wait, &w) {
                std::task::Poll::Ready(Err(LockError::Timeout {
                    waited, holder: h, ..
                })) => {
                    assert_eq!(waited, Duration::ZERO);
                    assert_eq!(h, Some(holder.token()));
                }
                other => panic!("expected an immediate timeout, got {other:?}"),
            }
            assert_eq!(table.waiters(&"k"), 0, "it never queued");
            drop(holder);
            // A free key is still taken, deadline passed or not.
            let mut free = Box::pin(table.lock_with("k", LockOptions::new().deadline(past)));
            assert!(matches!(poll(&mut free, &w), std::task::Poll::Ready(Ok(_))));
        }
    }

    #[test]
    fn a_granted_wait_ignores_its_deadline() {
        for (clock, table) in tables() {
            let holder = table.try_lock("k").unwrap();
            let (c, w) = counting();
            let deadline = clock.now() + 5 * SEC;
            let mut wait = Box::pin(table.lock_with("k", LockOptions::new().deadline(deadline)));
            assert!(poll(&mut wait, &w).is_pending());
            drop(holder);
            assert_eq!(wakes(&c), 1);
            let guard = match poll(&mut wait, &w) {
                std::task::Poll::Ready(Ok(g)) => g,
                other => panic!("expected the key, got {other:?}"),
            };
            clock.advance(10 * SEC);
            assert_eq!(
                guard.check(),
                Ok(guard.token()),
                "a deadline is not a lease"
            );
        }
    }

    #[test]
    fn a_blocking_wait_on_a_thread_gives_up_at_its_deadline() {
        let table = LockTable::new();
        let _holder = table.try_lock("k").unwrap();
        let deadline = Instant::now() + Duration::from_millis(20);
        let got = table.blocking_lock_with("k", LockOptions::new().deadline(deadline));
        assert!(matches!(got, Err(LockError::Timeout { .. })), "{got:?}");
        assert!(Instant::now() >= deadline, "gave up before its deadline");
    }
}

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn deadline_tests_need_test_util() {}
