//! Loss notification: `guard.lost()` resolves when the grant loses its
//! authority (a lapse, noticed by its own timer or by anyone; a revoke, by
//! key or by token), not before, and not on a renewal that moves the
//! deadline; every `Lost` of a grant is woken; dropping one unregisters it.
//! Time is a `ManualClock`; futures are polled by hand, then awaited under
//! tokio, async-std and on a plain thread.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};

    use keylock::{LockError, LockTable};

    use crate::common::{lease, table, NANO, SEC, W};

    #[test]
    fn lost_resolves_at_the_lapse_and_not_before() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        assert_eq!(clock.sleepers(), 1, "a timer at the deadline");
        clock.advance(5 * SEC - NANO);
        assert_eq!(w.wakes(), 0, "woken before the deadline");
        assert!(w.poll(&mut lost).is_pending());
        clock.advance(NANO);
        assert_eq!(w.wakes(), 1, "the timer woke it at the deadline");
        assert_eq!(
            w.poll(&mut lost),
            Poll::Ready(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        assert_eq!(
            w.wakes(),
            1,
            "it noticed the lapse itself: no wake of its own"
        );
        assert_eq!(table.stats().expired, 1, "it noticed the lapse");
        assert_eq!(clock.sleepers(), 0);
        drop(lost);
        table.assert_consistent();
    }

    #[test]
    fn the_lapse_passes_the_key_to_the_waiter_when_lost_notices_it() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(SEC)).unwrap();
        let (lw, ww) = (W::new(), W::new());
        let mut lost = g.lost();
        assert!(lw.poll(&mut lost).is_pending());
        let mut waiter = Box::pin(table.lock("k"));
        assert!(ww.poll(&mut waiter).is_pending());
        clock.advance(SEC);
        assert!(lw.wakes() >= 1 && ww.wakes() >= 1);
        // The loss future is polled first: it settles the lapse, the key goes on.
        assert!(lw.poll(&mut lost).is_ready());
        let next = match ww.poll(&mut waiter) {
            Poll::Ready(g) => g,
            Poll::Pending => panic!("the lapsed key was not handed on"),
        };
        assert!(next.token() > g.token());
        assert_eq!(table.stats().handoffs, 1);
    }

    #[test]
    fn lost_resolves_at_once_on_revoke() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        assert_eq!(clock.sleepers(), 0, "no lease: no timer");
        assert_eq!(table.revoke("k"), Some(g.token()));
        assert_eq!(w.wakes(), 1, "the revoke woke it");
        assert_eq!(
            w.poll(&mut lost),
            Poll::Ready(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
    }

    #[test]
    fn lost_resolves_on_a_targeted_revoke_and_not_on_a_stale_one() {
        let (_clock, table) = table();
        let first = table.try_lock("k").unwrap();
        let stale = first.token();
        drop(first);
        let g = table.try_lock_with("k", lease(60 * SEC)).unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        assert!(!table.revoke_grant("k", stale));
        assert_eq!(w.wakes(), 0, "woken by a revoke of another grant");
        assert!(w.poll(&mut lost).is_pending());
        assert!(table.revoke_grant("k", g.token()));
        assert_eq!(w.wakes(), 1);
        assert!(w.poll(&mut lost).is_ready());
    }

    #[test]
    fn a_renewal_that_extends_the_lease_does_not_make_lost_fire() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        clock.advance(3 * SEC);
        g.renew(10 * SEC).unwrap(); // now ends at 13 s
        assert_eq!(w.wakes(), 0, "a later deadline needs no wake");
        clock.advance(2 * SEC); // the old deadline: its timer fires
        assert_eq!(w.wakes(), 1);
        assert!(w.poll(&mut lost).is_pending(), "fired at the old deadline");
        assert_eq!(clock.sleepers(), 1, "re-armed at the new deadline");
        clock.advance(8 * SEC - NANO);
        assert_eq!(w.wakes(), 1);
        assert!(!g.is_expired());
        clock.advance(NANO);
        assert_eq!(w.wakes(), 2);
        assert!(w.poll(&mut lost).is_ready());
    }

    #[test]
    fn a_renewal_that_shortens_the_lease_rearms_lost_earlier() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(10 * SEC)).unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        g.renew(2 * SEC).unwrap();
        assert_eq!(w.wakes(), 1, "an earlier deadline wakes it to re-arm");
        assert!(w.poll(&mut lost).is_pending());
        clock.advance(2 * SEC);
        assert_eq!(w.wakes(), 2, "its timer fired at the new deadline");
        assert!(w.poll(&mut lost).is_ready());
    }

    #[test]
    fn a_renewal_that_gives_a_lease_arms_lost() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        assert_eq!(clock.sleepers(), 0);
        g.renew(SEC).unwrap();
        assert_eq!(w.wakes(), 1);
        assert!(w.poll(&mut lost).is_pending());
        assert_eq!(clock.sleepers(), 1);
        clock.advance(SEC);
        assert!(w.poll(&mut lost).is_ready());
    }

    #[test]
    fn every_lost_future_of_a_grant_is_woken() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(4 * SEC)).unwrap();
        let other = table.try_lock_with("other", lease(4 * SEC)).unwrap();
        let ws: Vec<W> = (0..6).map(|_| W::new()).collect();
        let mut losts: Vec<_> = ws.iter().map(|_| g.lost()).collect();
        for (w, l) in ws.iter().zip(&mut losts) {
            assert!(w.poll(l).is_pending());
        }
        let ow = W::new();
        let mut other_lost = other.lost();
        assert!(ow.poll(&mut other_lost).is_pending());
        // A lapse noticed by someone else (here `check`) wakes them all at once,
        // before their own timers would.
        clock.advance(4 * SEC);
        assert!(g.check().is_err());
        for (w, l) in ws.iter().zip(&mut losts) {
            assert!(w.wakes() >= 1, "a Lost was never woken");
            assert_eq!(
                w.poll(l),
                Poll::Ready(LockError::Expired {
                    token: g.token(),
                    key: None
                })
            );
        }
        // The other grant's Lost is woken by its own timer, not resolved by ours.
        assert_eq!(ow.wakes(), 1);
        assert!(ow.poll(&mut other_lost).is_ready());
        drop(losts);
        table.assert_consistent();
    }

    #[test]
    fn several_lost_futures_are_all_woken_by_a_revoke() {
        let (_clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let ws: Vec<W> = (0..10).map(|_| W::new()).collect();
        let mut losts: Vec<_> = ws.iter().map(|_| g.lost()).collect();
        for (w, l) in ws.iter().zip(&mut losts) {
            assert!(w.poll(l).is_pending());
        }
        // Dropping some in between unregisters them; the rest are still woken.
        let dropped: Vec<_> = losts.drain(..3).collect();
        drop(dropped);
        assert_eq!(table.revoke("k"), Some(g.token()));
        for w in &ws[..3] {
            assert_eq!(w.wakes(), 0, "a dropped Lost was woken");
        }
        for (w, l) in ws[3..].iter().zip(&mut losts) {
            assert_eq!(w.wakes(), 1);
            assert!(w.poll(l).is_ready());
        }
    }

    #[test]
    fn lost_of_a_grant_already_lost_is_ready_at_once() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(SEC)).unwrap();
        clock.advance(2 * SEC);
        let w = W::new();
        assert_eq!(
            w.poll(&mut g.lost()),
            Poll::Ready(LockError::Expired {
                token: g.token(),
                key: None
            })
        );
        let h = table.try_lock("k").unwrap();
        table.revoke("k");
        assert!(w.poll(&mut h.lost()).is_ready());
        assert_eq!(clock.sleepers(), 0);
        table.assert_consistent();
    }

    #[test]
    fn a_repoll_with_a_new_waker_replaces_the_old_one() {
        let (_clock, table) = table();
        let g = table.try_lock("k").unwrap();
        let (a, b) = (W::new(), W::new());
        let mut lost = g.lost();
        assert!(a.poll(&mut lost).is_pending());
        assert!(b.poll(&mut lost).is_pending());
        assert_eq!(
            Arc::strong_count(&a.counter),
            2,
            "the replaced waker is still held"
        );
        table.revoke("k");
        assert_eq!((a.wakes(), b.wakes()), (0, 1));
        assert!(b.poll(&mut lost).is_ready());
        drop(lost);
        assert_eq!(Arc::strong_count(&b.counter), 2, "a waker leaked");
    }

    #[test]
    fn dropping_a_pending_lost_unregisters_it_and_releases_its_waker() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(SEC)).unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        assert_eq!(Arc::strong_count(&w.counter), 4, "table and timer hold it");
        drop(lost);
        assert_eq!(Arc::strong_count(&w.counter), 2, "a waker was kept");
        assert_eq!(clock.sleepers(), 0);
        table.revoke("k");
        assert_eq!(w.wakes(), 0);
        table.assert_consistent();
        drop(g);
        assert!(table.is_empty());
    }

    #[test]
    fn lost_costs_nothing_until_asked_and_never_reads_the_clock_without_a_lease() {
        let (clock, table) = table();
        let reads = clock.reads();
        let g = table.try_lock("k").unwrap();
        let w = W::new();
        let mut lost = g.lost();
        assert!(w.poll(&mut lost).is_pending());
        drop(lost);
        drop(g);
        assert_eq!(clock.reads(), reads);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_a_task_awaiting_lost_ends_when_the_grant_is_revoked() {
        let table = Arc::new(LockTable::<&str>::new());
        let guard = table.clone().lock_owned("job").await;
        let token = guard.token();
        let (registered_tx, registered_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut lost = guard.lost();
            assert!(futures::poll!(&mut lost).is_pending(), "live: pending");
            registered_tx.send(()).unwrap();
            let why = lost.await;
            (why, guard.is_expired())
        });
        registered_rx.await.unwrap();
        assert!(table.revoke_grant("job", token));
        assert_eq!(
            task.await.unwrap(),
            (LockError::Expired { token, key: None }, true)
        );
        assert!(table.is_empty());
    }

    #[async_std::test]
    async fn async_std_lost_resolves_on_revoke_from_another_task() {
        let table = Arc::new(LockTable::<u32>::new());
        let guard = table.clone().lock_owned(1).await;
        let token = guard.token();
        let revoker = async_std::task::spawn({
            let table = table.clone();
            async move { table.revoke(&1) }
        });
        // Registered before or after the revoke: it resolves either way.
        assert_eq!(guard.lost().await, LockError::Expired { token, key: None });
        assert_eq!(revoker.await, Some(token));
    }

    #[test]
    fn threads_lost_blocks_a_thread_until_the_revoke() {
        let table = Arc::new(LockTable::<u32>::new());
        let guard = table.clone().try_lock_owned(1).unwrap();
        let token = guard.token();
        let (tx, rx) = std::sync::mpsc::channel();
        let watcher = std::thread::spawn(move || {
            let mut lost = guard.lost();
            let waker = Waker::noop();
            assert!(Pin::new(&mut lost)
                .poll(&mut Context::from_waker(waker))
                .is_pending());
            tx.send(()).unwrap();
            futures::executor::block_on(lost)
        });
        rx.recv().unwrap();
        assert!(table.revoke_grant(&1, token));
        assert_eq!(
            watcher.join().unwrap(),
            LockError::Expired { token, key: None }
        );
    }
}
