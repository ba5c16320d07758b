//! The lock status view: holders and waiters of each key, with their modes,
//! tokens, transactions and times; `holder`, `lock_status`, `status`; a
//! revoke by the token the view showed; and a key whose `Clone` panics
//! strands nothing.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::time::Duration;

    use futures::poll;
    use keylock::{LockOptions, LockTable, ManualClock, Mode};

    const SEC: Duration = Duration::from_secs(1);

    fn block<F: std::future::Future>(f: F) -> F::Output {
        futures::executor::block_on(f)
    }

    #[test]
    fn a_plain_guard_and_a_leased_one() {
        let clock = ManualClock::new();
        let table: LockTable<&str> = LockTable::builder().clock(clock.clone()).build();
        assert!(table.holder("a").is_none());
        assert!(table.status().is_empty());
        let plain = table.try_lock("a").unwrap();
        let leased = table
            .try_lock_with("b", LockOptions::new().lease(SEC))
            .unwrap();
        let a = table.holder("a").unwrap();
        assert_eq!(a.token, plain.token());
        assert_eq!(a.mode, Mode::Exclusive);
        assert_eq!(a.transaction, None);
        assert_eq!(a.lease_deadline, None);
        assert!(!a.lapsed);
        let b = table.holder("b").unwrap();
        assert_eq!(b.token, leased.token());
        assert_eq!(b.since, Some(clock.now()));
        assert_eq!(b.lease_deadline, Some(clock.now() + SEC));
        clock.advance(SEC);
        assert!(table.holder("b").unwrap().lapsed, "judged now");
        let mut keys: Vec<_> = table.status().into_iter().map(|(k, _)| k).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["a", "b"]);
        drop((plain, leased));
        assert!(table.status().is_empty());
        assert!(table.is_empty(), "the snapshot's pins are gone");
    }

    #[test]
    fn shared_holders_and_a_queue_of_transactions_in_order() {
        let clock = ManualClock::new();
        let table: LockTable<&str> = LockTable::builder().clock(clock.clone()).build();
        block(async {
            let mut r1 = table.transaction();
            let mut r2 = table.transaction();
            let mut w = table.transaction();
            r1.lock("k", Mode::Shared).await.unwrap();
            r2.lock("k", Mode::Shared).await.unwrap();
            let (r1_id, r2_id, w_id) = (r1.id(), r2.id(), w.id());
            let mut w_waits = Box::pin(w.lock("k", Mode::Exclusive));
            assert!(poll!(w_waits.as_mut()).is_pending());
            clock.advance(SEC);
            let mut plain = Box::pin(table.lock_shared("k"));
            assert!(poll!(plain.as_mut()).is_pending());
            // r1 upgrades: it heads the queue.
            let mut up = Box::pin(r1.lock("k", Mode::Exclusive));
            assert!(poll!(up.as_mut()).is_pending());

            let status = table.lock_status("k").unwrap();
            let holders: Vec<_> = status.holders.iter().map(|h| h.transaction).collect();
            assert_eq!(holders, [Some(r1_id), Some(r2_id)]);
            assert!(status.holders.iter().all(|h| h.mode == Mode::Shared));
            let waiters: Vec<_> = status
                .waiters
                .iter()
                .map(|w| (w.transaction, w.mode, w.upgrade))
                .collect();
            assert_eq!(
                waiters,
                [
                    (Some(r1_id), Mode::Exclusive, true),
                    (Some(w_id), Mode::Exclusive, false),
                    (None, Mode::Shared, false),
                ]
            );
            // A manual clock is read for waits with a timeout only.
            assert!(status.waiters.iter().all(|w| w.since.is_none()));
            let all = table.status();
            assert_eq!(all.len(), 1);
            assert_eq!(all[0].1, status);
            drop(up);
            drop(w_waits);
            drop(plain);
        });
        assert!(table.status().iter().all(|(_, s)| s.waiters.is_empty()));
    }

    #[test]
    fn on_the_real_clock_a_waiter_shows_when_it_began_to_wait() {
        let table: LockTable<&str> = LockTable::new();
        let guard = table.try_lock("k").unwrap();
        let before = std::time::Instant::now();
        block(async {
            let mut waits = Box::pin(table.lock("k"));
            assert!(poll!(waits.as_mut()).is_pending());
            let since = table.lock_status("k").unwrap().waiters[0].since;
            let since = since.expect("the real clock stamps every wait");
            assert!(since <= std::time::Instant::now());
            // The coarse clock lags by at most a tick (a few ms): compare
            // with a margin that is not a timing assertion on the code.
            assert!(since + Duration::from_secs(1) >= before);
            drop(guard);
            assert!(poll!(waits.as_mut()).is_ready());
        });
    }

    #[test]
    fn labels_name_transactions_while_they_live() {
        use keylock::TransactionOptions;
        let table: LockTable<&str> = LockTable::new();
        block(async {
            let mut job = table.transaction_with(TransactionOptions::new().label("nightly-job"));
            let mut web = table.transaction_with(TransactionOptions::new().label("checkout"));
            let mut plain = table.transaction();
            job.lock("k", Mode::Exclusive).await.unwrap();
            let mut web_waits = Box::pin(web.lock("k", Mode::Shared));
            assert!(poll!(web_waits.as_mut()).is_pending());
            let mut plain_waits = Box::pin(plain.lock("k", Mode::Shared));
            assert!(poll!(plain_waits.as_mut()).is_pending());
            let status = table.lock_status("k").unwrap();
            assert_eq!(status.holders[0].label, Some("nightly-job"));
            let labels: Vec<_> = status.waiters.iter().map(|w| w.label).collect();
            assert_eq!(labels, [Some("checkout"), None]);
            drop((web_waits, plain_waits));
        });
    }

    #[test]
    fn revoke_the_grant_the_view_showed_and_nothing_else() {
        let table: LockTable<&str> = LockTable::new();
        let first = table.try_lock("k").unwrap();
        let seen = table.holder("k").unwrap().token;
        drop(first);
        let second = table.try_lock("k").unwrap();
        assert!(!table.revoke_grant("k", seen), "the key changed hands");
        assert!(second.check().is_ok());
        let now = table.holder("k").unwrap().token;
        assert!(table.revoke_grant("k", now));
        assert!(second.check().is_err());
    }

    static ARMED: AtomicBool = AtomicBool::new(false);

    /// A key whose clone panics while [`ARMED`].
    #[derive(Debug, PartialEq, Eq, Hash)]
    struct Bomb(u32);

    impl Clone for Bomb {
        fn clone(&self) -> Self {
            assert!(!ARMED.load(SeqCst), "a key's Clone panics");
            Bomb(self.0)
        }
    }

    #[test]
    fn a_panicking_key_clone_strands_nothing() {
        let table: LockTable<Bomb> = LockTable::builder().shards(1).build();
        let guards: Vec<_> = (0..4).map(|i| table.try_lock(Bomb(i)).unwrap()).collect();
        ARMED.store(true, SeqCst);
        assert!(catch_unwind(AssertUnwindSafe(|| table.status())).is_err());
        ARMED.store(false, SeqCst);
        assert_eq!(table.status().len(), 4, "still held, still listed");
        drop(guards);
        table.assert_consistent();
        assert!(table.is_empty(), "every pin was undone");
    }
}
