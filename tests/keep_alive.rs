//! `KeepAlive`: renews leases every interval for as long as it runs, and
//! resolves at the first failure: a revocation at once (through the loss
//! future), a lapse it could not prevent, invalid options. Time is a
//! `ManualClock`; futures are polled by hand, and once under tokio.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::sync::Arc;
    use std::task::Poll;
    use std::time::Duration;

    use keylock::{LockError, LockTable, ManualClock};

    use crate::common::{lease, table, SEC, W};

    #[test]
    fn keep_alive_keeps_a_lease_alive_across_many_intervals() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        let (w, ww) = (W::new(), W::new());
        let mut waiter = Box::pin(table.lock("k"));
        assert!(ww.poll(&mut waiter).is_pending());
        let mut keep = g.keep_alive(SEC, 3 * SEC);
        assert!(w.poll(&mut keep).is_pending());
        assert_eq!(
            g.expires_at(),
            Some(clock.now() + 3 * SEC),
            "renewed at once"
        );
        for round in 0..50 {
            let woken = w.wakes();
            clock.advance(SEC);
            assert!(
                w.wakes() > woken,
                "round {round}: its timer did not wake it"
            );
            assert!(w.poll(&mut keep).is_pending(), "round {round}: resolved");
            assert_eq!(g.expires_at(), Some(clock.now() + 3 * SEC), "round {round}");
            assert_eq!(g.check(), Ok(g.token()));
        }
        // 50 s on a 3 s lease, and the waiter never got the key.
        assert!(ww.poll(&mut waiter).is_pending());
        assert_eq!(table.stats().expired, 0);
        // Dropped: the renewals stop, and the lease runs out.
        drop(keep);
        clock.advance(3 * SEC);
        assert!(g.is_expired());
        assert!(ww.poll(&mut waiter).is_ready());
    }

    #[test]
    fn keep_alive_reports_a_revoke_at_once() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        let mut keep = g.keep_alive(10 * SEC, 30 * SEC);
        assert!(w.poll(&mut keep).is_pending());
        clock.advance(SEC);
        let woken = w.wakes();
        assert!(table.revoke_grant("k", g.token()));
        assert!(w.wakes() > woken, "the revoke did not wake it");
        // No time has passed: it was not the next renewal that noticed.
        assert_eq!(
            w.poll(&mut keep),
            Poll::Ready(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
    }

    #[test]
    fn keep_alive_reports_a_lapse_it_was_not_polled_in_time_to_prevent() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        let mut keep = g.keep_alive(SEC, 2 * SEC);
        assert!(w.poll(&mut keep).is_pending());
        // The task did not run for 5 s: the lease lapsed at 2 s.
        clock.advance(5 * SEC);
        assert_eq!(
            w.poll(&mut keep),
            Poll::Ready(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        assert!(g.is_expired());
    }

    #[test]
    fn keep_alive_refuses_invalid_options_on_its_first_poll() {
        let clock = ManualClock::new();
        let table = LockTable::builder()
            .clock(clock)
            .max_lease(10 * SEC)
            .build();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        for (interval, lease, option) in [
            (SEC, Duration::ZERO, "lease"),
            (SEC, 11 * SEC, "lease"),
            (Duration::ZERO, SEC, "keep-alive interval"),
            (SEC, SEC, "keep-alive interval"),
            (2 * SEC, SEC, "keep-alive interval"),
        ] {
            match w.poll(&mut g.keep_alive(interval, lease)) {
                Poll::Ready(LockError::InvalidOptions { option: o, .. }) => {
                    assert_eq!(o, option, "{interval:?} / {lease:?}");
                }
                other => panic!("{interval:?} / {lease:?}: {other:?}"),
            }
        }
        assert_eq!(g.expires_at(), None, "an invalid keep-alive renewed");
    }

    #[test]
    fn keep_alive_of_several_guards_renews_them_all_and_reports_the_first_loss() {
        let clock = ManualClock::new();
        let table = Arc::new(LockTable::builder().clock(clock.clone()).build());
        let a = table.try_lock("a").unwrap();
        let b = table.try_lock("b").unwrap();
        let c = table.clone().try_lock_owned("c").unwrap();
        let w = W::new();
        let mut keep = a.keep_alive(SEC, 2 * SEC).and(&b).and_owned(&c);
        assert!(w.poll(&mut keep).is_pending());
        for _ in 0..5 {
            clock.advance(SEC);
            assert!(w.poll(&mut keep).is_pending());
            for g in [a.expires_at(), b.expires_at(), c.expires_at()] {
                assert_eq!(g, Some(clock.now() + 2 * SEC));
            }
        }
        assert_eq!(table.revoke("b"), Some(b.token()));
        assert_eq!(
            w.poll(&mut keep),
            Poll::Ready(LockError::Expired {
                token: b.token(),
                key: None
            })
        );
        assert!(!a.is_expired() && !c.is_expired());
    }

    #[tokio::test]
    async fn tokio_keep_alive_task_ends_when_its_grant_is_revoked() {
        let clock = ManualClock::new();
        let table = Arc::new(LockTable::builder().clock(clock.clone()).build());
        let guard = table.clone().lock_owned("job").await;
        let token = guard.token();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let keep = guard.keep_alive(SEC, 5 * SEC);
            let mut keep = std::pin::pin!(keep);
            // Renewed on the first poll; then tell the test.
            assert!(futures::poll!(keep.as_mut()).is_pending());
            started_tx.send(guard.expires_at()).unwrap();
            keep.await
        });
        let renewed = started_rx.await.unwrap();
        assert_eq!(renewed, Some(clock.now() + 5 * SEC));
        clock.advance(3 * SEC);
        assert!(table.revoke_grant("job", token));
        assert_eq!(task.await.unwrap(), LockError::Expired { token, key: None });
        assert!(table.is_empty());
    }
}
