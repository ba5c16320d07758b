//! Revocation by key and token (`revoke_grant`), and the truth a guard tells
//! after any revocation: `is_expired()` and `expires_at()` report the loss at
//! once. Driven by a manual clock and hand polling, then under tokio,
//! async-std and plain threads.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::sync::atomic::Ordering::SeqCst;
    use std::sync::{mpsc, Arc, Mutex};
    use std::task::Poll;
    use std::time::Instant;

    use keylock::{FencingToken, LockError, LockTable};

    use crate::common::{counting, lease, poll, ready, table, timeout, wakes, SEC};

    #[test]
    fn revoke_grant_revokes_the_named_live_grant_and_passes_the_key_on() {
        let (clock, table) = table();
        let holder = table.try_lock_with("k", lease(10 * SEC)).unwrap();
        let (c, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        clock.advance(SEC);
        assert!(table.revoke_grant("k", holder.token()));
        assert_eq!(wakes(&c), 1, "the waiter was handed the key and woken");
        // The revoked guard tells the truth at once.
        assert!(holder.is_expired());
        assert_eq!(
            holder.check(),
            Err(LockError::Expired {
                token: holder.token(),
                key: None,
            })
        );
        assert_eq!(
            holder.expires_at(),
            Some(clock.now()),
            "revoked: now, not the old deadline"
        );
        assert_eq!(
            holder.renew(SEC),
            Err(LockError::Expired {
                token: holder.token(),
                key: None,
            })
        );
        let next = ready(
            &mut waiter,
            &w,
            "the revoked key did not pass to the waiter",
        );
        assert!(next.token() > holder.token());
        // Revoking the old grant again touches nobody.
        assert!(!table.revoke_grant("k", holder.token()));
        assert_eq!(next.check(), Ok(next.token()));
        assert_eq!(next.expires_at(), None);
        assert_eq!(table.stats().revoked, 1);
        drop(holder); // stale: frees nothing
        assert!(table.is_locked("k"));
        drop(next);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn revoke_grant_does_nothing_once_the_key_changed_hands() {
        let (_clock, table) = table();
        let first = table.try_lock("k").unwrap();
        let stale = first.token();
        let (_, w) = counting();
        let mut waiter = Box::pin(table.lock("k"));
        assert!(poll(&mut waiter, &w).is_pending());
        drop(first); // handed to the waiter, which has not run yet
        assert!(!table.revoke_grant("k", stale), "revoked the successor");
        let next = ready(&mut waiter, &w, "not granted");
        assert_eq!(next.check(), Ok(next.token()));
        assert_eq!(table.stats().revoked, 0);
        // The plain revoke, by contrast, takes whoever holds the key now.
        assert_eq!(table.revoke("k"), Some(next.token()));
        assert!(next.is_expired());
    }

    #[test]
    fn revoke_grant_needs_the_right_key_and_token() {
        let (_clock, table) = table();
        let a = table.try_lock("a").unwrap();
        let b = table.try_lock("b").unwrap();
        // Tokens are unique across the table: b's token never names a's grant.
        assert!(!table.revoke_grant("a", b.token()));
        assert!(!table.revoke_grant("c", a.token()), "no such key");
        assert!(!a.is_expired() && !b.is_expired());
        assert_eq!(a.expires_at(), None);
        assert!(table.revoke_grant("a", a.token()));
        assert!(a.is_expired());
        assert!(!b.is_expired());
        assert_eq!(table.stats().revoked, 1);
    }

    #[test]
    fn revoke_grant_acts_on_the_token_a_timeout_names_even_an_unobserved_grant() {
        let (clock, table) = table();
        let holder = table.try_lock("k").unwrap();
        let (c, w) = counting();
        let mut stuck = Box::pin(table.lock_with("k", lease(5 * SEC)));
        assert!(poll(&mut stuck, &w).is_pending());
        drop(holder); // granted to `stuck`, whose task never runs
        assert_eq!(wakes(&c), 1);
        let mut probe = Box::pin(table.lock_with("k", timeout(SEC)));
        let (_, pw) = counting();
        assert!(poll(&mut probe, &pw).is_pending());
        clock.advance(SEC);
        let named = match poll(&mut probe, &pw) {
            Poll::Ready(Err(LockError::Timeout {
                holder: Some(t), ..
            })) => t,
            other => panic!("expected a timeout naming the holder, got {other:?}"),
        };
        assert!(table.revoke_grant("k", named));
        assert!(!table.is_locked("k"));
        // The stuck future, when it finally runs, holds a revoked grant.
        let fenced = ready(&mut stuck, &w, "a granted future resolves").unwrap();
        assert_eq!(fenced.token(), named);
        assert!(fenced.is_expired());
        let at = fenced.expires_at().expect("a lost grant reports when");
        assert_eq!(at, clock.now(), "revoked before its deadline: now");
        assert!(table.try_lock("k").is_ok());
    }

    #[test]
    fn a_lapsed_grant_is_not_revoked_and_reports_its_deadline() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(2 * SEC)).unwrap();
        let deadline = clock.now() + 2 * SEC;
        assert_eq!(g.expires_at(), Some(deadline));
        clock.advance(3 * SEC);
        // Lapsed, not yet noticed by anyone: already reported in the past.
        assert_eq!(g.expires_at(), Some(deadline));
        assert!(
            !table.revoke_grant("k", g.token()),
            "a lapsed grant is not revoked"
        );
        assert_eq!(table.stats().expired, 1, "the revoke noticed the lapse");
        assert_eq!(table.stats().revoked, 0);
        assert_eq!(
            g.expires_at(),
            Some(deadline),
            "the deadline, not the time of the call"
        );
        let next = table.try_lock("k").unwrap();
        assert_eq!(g.expires_at(), Some(deadline));
        drop((g, next));
    }

    #[test]
    fn expires_at_of_a_revoked_guard_without_a_lease_is_never_later_than_now() {
        let (clock, table) = table();
        let g = table.try_lock("k").unwrap();
        assert_eq!(g.expires_at(), None, "no lease: never");
        assert_eq!(table.revoke("k"), Some(g.token()));
        for _ in 0..3 {
            let at = g.expires_at().expect("a revoked grant has ended");
            assert!(at <= clock.now());
            clock.advance(SEC);
        }
    }

    #[test]
    fn expires_at_of_a_renewed_guard_follows_the_table() {
        let (clock, table) = table();
        let g = table.try_lock_with("k", lease(SEC)).unwrap();
        g.renew(5 * SEC).unwrap();
        assert_eq!(g.expires_at(), Some(clock.now() + 5 * SEC));
        clock.advance(2 * SEC);
        assert!(table.revoke_grant("k", g.token()));
        assert_eq!(
            g.expires_at(),
            Some(clock.now()),
            "revoked before the renewed deadline"
        );
    }

    /// Revoking with the token of a grant already released never touches the
    /// grants that follow it, under real concurrency: holders on several
    /// threads keep checking their own grants while a revoker throws every
    /// released token back at the table.
    #[test]
    fn threads_stale_revoke_grant_never_hits_the_current_holder() {
        let table = Arc::new(LockTable::<u8>::new());
        let released: Arc<Mutex<Vec<FencingToken>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let revoker = {
            let (table, released, stop) = (table.clone(), released.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut tried = 0usize;
                while !stop.load(SeqCst) || tried == 0 {
                    let tokens: Vec<FencingToken> = released.lock().unwrap().clone();
                    for t in tokens {
                        assert!(!table.revoke_grant(&0, t), "revoked by a stale token {t}");
                        tried += 1;
                    }
                    std::thread::yield_now();
                }
                tried
            })
        };
        let holders: Vec<_> = (0..3)
            .map(|_| {
                let (table, released) = (table.clone(), released.clone());
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        let g = table.blocking_lock(0);
                        for _ in 0..3 {
                            assert_eq!(g.check(), Ok(g.token()), "a live grant was revoked");
                            std::thread::yield_now();
                        }
                        let t = g.token();
                        drop(g);
                        released.lock().unwrap().push(t);
                    }
                })
            })
            .collect();
        for h in holders {
            h.join().unwrap();
        }
        stop.store(true, SeqCst);
        assert!(revoker.join().unwrap() > 0);
        assert_eq!(table.stats().revoked, 0);
        assert!(table.is_empty());
    }

    #[test]
    fn threads_revoke_grant_frees_a_blocked_locker() {
        let table = Arc::new(LockTable::<u8>::new());
        let holder = table.clone().try_lock_owned(1).unwrap();
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let table = table.clone();
            std::thread::spawn(move || {
                let g = table.blocking_lock(1);
                tx.send(g.token()).unwrap();
                assert_eq!(g.check(), Ok(g.token()));
            })
        };
        assert!(table.revoke_grant(&1, holder.token()));
        let next = rx.recv().unwrap();
        assert!(next > holder.token());
        assert!(holder.is_expired());
        assert!(holder.expires_at().unwrap() <= Instant::now());
        waiter.join().unwrap();
        assert!(!table.revoke_grant(&1, holder.token()));
        drop(holder);
        assert!(table.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokio_revoke_grant_passes_the_key_and_the_guard_tells_the_truth() {
        let table = Arc::new(LockTable::<&str>::new());
        let holder = table
            .clone()
            .lock_owned_with("job", lease(60 * SEC))
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let table = table.clone();
            async move { table.lock_owned("job").await }
        });
        assert!(table.revoke_grant("job", holder.token()));
        let next = waiter.await.unwrap();
        assert!(next.token() > holder.token());
        assert!(holder.is_expired());
        assert!(holder.expires_at().unwrap() <= Instant::now());
        // A later revoke of the old grant leaves the new holder alone.
        assert!(!table.revoke_grant("job", holder.token()));
        assert_eq!(next.check(), Ok(next.token()));
        drop(holder);
        drop(next);
        assert!(table.is_empty());
    }

    #[async_std::test]
    async fn async_std_revoke_grant_passes_the_key_and_the_guard_tells_the_truth() {
        let table = Arc::new(LockTable::<u32>::new());
        let holder = table.clone().lock_owned(9).await;
        let waiter = async_std::task::spawn({
            let table = table.clone();
            async move { table.lock_owned(9).await }
        });
        assert_eq!(holder.expires_at(), None);
        assert!(table.revoke_grant(&9, holder.token()));
        let next = waiter.await;
        assert!(holder.is_expired());
        assert!(holder.expires_at().unwrap() <= Instant::now());
        assert!(!table.revoke_grant(&9, holder.token()));
        assert_eq!(next.check(), Ok(next.token()));
        drop((holder, next));
        assert!(table.is_empty());
    }
}
