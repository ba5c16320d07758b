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
        // Once the view has been read, every wait is stamped.
        assert!(table.status().is_empty());
        let guard = table.try_lock("k").unwrap();
        waiter_start_is_shown(&table, guard);
        // Behind a leased holder the wait is stamped with the reading the
        // lease check took under the lock, or, where the shard's timer
        // already covers the lease and no check is made, after the unlock:
        // shown all the same.
        let leased = table
            .try_lock_with("k", LockOptions::new().lease(Duration::from_secs(30)))
            .unwrap();
        waiter_start_is_shown(&table, leased);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_plain_wait_reads_no_clock_until_the_view_is_first_read() {
        // Each way of reading the view turns the stamps on.
        let reads: [fn(&LockTable<&str>) -> bool; 3] = [
            |t| t.status().len() == 1,
            |t| t.lock_status("other").is_none(),
            |t| t.holder("other").is_none(),
        ];
        for read in reads {
            let table: LockTable<&str> = LockTable::new();
            let guard = table.try_lock("k").unwrap();
            block(async {
                let mut early = Box::pin(table.lock("k"));
                assert!(poll!(early.as_mut()).is_pending());
                // Read for the first time: the wait that began before is
                // not stamped (no clock was read for it) ...
                let status = table.lock_status("k").unwrap();
                assert_eq!(status.waiters[0].since, None);
                assert_eq!(status.waiters[0].waited_for, None);
                drop(early);
            });
            let table: LockTable<&str> = LockTable::new();
            let guard2 = table.try_lock("k").unwrap();
            assert!(read(&table), "only \"k\" is held");
            block(async {
                // ... and once any read has been made, a new one is.
                let mut late = Box::pin(table.lock("k"));
                assert!(poll!(late.as_mut()).is_pending());
                let status = table.lock_status("k").unwrap();
                assert!(status.waiters[0].since.is_some());
                assert!(status.waiters[0].waited_for.is_some());
                drop(late);
            });
            drop((guard, guard2));
        }
    }

    fn waiter_start_is_shown(table: &LockTable<&str>, guard: keylock::Guard<'_, &str>) {
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

    /// `Display` of the status: one line per key, holders then waiters,
    /// with their labels and durations read on the table's clock.
    #[test]
    fn the_status_reads_as_one_line_per_key_with_labels_and_durations() {
        let clock = ManualClock::new();
        let table: LockTable<&str> = LockTable::builder().clock(clock.clone()).build();
        let flush = table
            .try_lock_with("page", LockOptions::new().lease(30 * SEC).label("flush"))
            .unwrap();
        clock.advance(Duration::from_millis(1200));
        let wait = LockOptions::new().timeout(60 * SEC).label("scan").shared();
        let mut scan = Box::pin(table.lock_with("page", wait));
        assert!(block(async { poll!(scan.as_mut()) }).is_pending());
        clock.advance(Duration::from_millis(300));
        let status = table.status();
        assert_eq!(status.len(), 1);
        let (key, row) = &status[0];
        assert_eq!(row.holders[0].label, Some("flush"));
        assert_eq!(
            row.holders[0].transaction, None,
            "a label is no transaction"
        );
        assert_eq!(row.holders[0].held_for, Some(Duration::from_millis(1500)));
        assert_eq!(
            row.holders[0].lease_left,
            Some(Duration::from_millis(28_500))
        );
        assert_eq!(row.waiters[0].label, Some("scan"));
        assert_eq!(row.waiters[0].waited_for, Some(Duration::from_millis(300)));
        assert_eq!(
            format!("{key}: {row}"),
            format!(
                "page: granted {} exclusive \"flush\" held 1.5s lease 28.5s left; \
                 waiting shared \"scan\" waiting 300ms",
                flush.token()
            )
        );
        clock.advance(29 * SEC);
        let line = table.lock_status("page").unwrap().to_string();
        assert!(line.contains("held 30.5s lease lapsed"), "{line}");
        drop(scan);
        drop(flush);
        assert!(table.is_empty());
    }

    /// A plain lock's label names its grant in a timeout behind it, on the
    /// try-once path and after a wait.
    #[test]
    fn a_timeout_names_the_holders_label() {
        let clock = ManualClock::new();
        let table: LockTable<&str> = LockTable::builder().clock(clock.clone()).build();
        let held = table
            .try_lock_with("page", LockOptions::new().label("flush"))
            .unwrap();
        let now = table
            .try_lock_with("page", LockOptions::new())
            .map(drop)
            .unwrap_err();
        assert_eq!(now, keylock::LockError::WouldBlock { key: None });
        let err =
            block(table.lock_with("page", LockOptions::new().timeout(Duration::ZERO))).unwrap_err();
        let keylock::LockError::Timeout {
            holder,
            holder_label,
            ..
        } = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!(
            (*holder, *holder_label),
            (Some(held.token()), Some("flush"))
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!(
                "held by grant {} of this table (\"flush\")",
                held.token()
            )),
            "{text}"
        );
        let mut waiting = Box::pin(table.lock_with("page", LockOptions::new().timeout(SEC)));
        assert!(block(async { poll!(waiting.as_mut()) }).is_pending());
        clock.advance(SEC);
        let err = block(waiting).unwrap_err();
        assert!(err.to_string().contains("(\"flush\")"), "{err}");
        // Unlabeled holders show no label.
        drop(held);
        let _plain = table.try_lock("page").unwrap();
        let err =
            block(table.lock_with("page", LockOptions::new().timeout(Duration::ZERO))).unwrap_err();
        assert!(matches!(
            err,
            keylock::LockError::Timeout {
                holder_label: None,
                ..
            }
        ));
        assert!(!err.to_string().contains("(\""), "{err}");
    }

    /// A table on a manual clock that names its keys in errors.
    fn naming_table() -> (ManualClock, LockTable<String>) {
        let clock = ManualClock::new();
        let table = LockTable::builder()
            .clock(clock.clone())
            .name_keys()
            .build();
        (clock, table)
    }

    /// A key whose `Debug` panics.
    #[derive(PartialEq, Eq, Hash)]
    struct Hostile(u32);
    impl std::fmt::Debug for Hostile {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            panic!("hostile Debug")
        }
    }

    /// With `name_keys`, a timeout names the key it waited for: at once, after
    /// a wait, and for an upgrade; without it, it says "the key".
    #[test]
    fn a_timeout_names_the_key_when_the_table_names_keys() {
        let (clock, table) = naming_table();
        let _held = table.try_lock("invoice-7".to_string()).unwrap();
        let zero = LockOptions::new().timeout(Duration::ZERO);
        let err = block(table.lock_with("invoice-7".to_string(), zero)).unwrap_err();
        assert!(
            matches!(&err, keylock::LockError::Timeout { key: Some(k), .. } if &**k == "\"invoice-7\""),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("timed out after 0ns waiting for key \"invoice-7\";"),
            "{err}"
        );
        let mut waiting =
            Box::pin(table.lock_with("invoice-7".to_string(), LockOptions::new().timeout(SEC)));
        assert!(block(async { poll!(waiting.as_mut()) }).is_pending());
        clock.advance(SEC);
        let err = block(waiting).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("timed out after 1s waiting for key \"invoice-7\";"),
            "{err}"
        );
        // An upgrade that may not wait.
        let mut a = table.try_lock_shared("row".to_string()).unwrap();
        let _b = table.try_lock_shared("row".to_string()).unwrap();
        let err = block(a.upgrade_with(zero)).unwrap_err();
        assert!(err.to_string().contains("waiting for key \"row\""), "{err}");

        let plain: LockTable<&str> = LockTable::new();
        let _held = plain.try_lock("invoice-7").unwrap();
        let err = block(plain.lock_with("invoice-7", zero)).unwrap_err();
        assert!(matches!(err, keylock::LockError::Timeout { key: None, .. }));
        assert!(err.to_string().contains("waiting for the key;"), "{err}");
    }

    /// With `name_keys`, every error about a key names it: a refused try,
    /// a lapsed or revoked grant (`check`, `renew`, `release_checked`,
    /// `lost()`), an upgrade conflict, a hold released twice or never
    /// detached. Without it, each says "the key".
    #[test]
    fn every_error_names_its_key_when_the_table_names_keys() {
        use keylock::{LockError, TryLockError};
        let (clock, table) = naming_table();
        let named = |err: &dyn std::fmt::Display, key: &str| {
            let text = err.to_string();
            assert!(text.contains(&format!("key \"{key}\"")), "{text}");
            assert!(!text.contains("the key"), "{text}");
        };
        // A refused try, with and without options.
        let held = table.try_lock("job-1".to_string()).unwrap();
        let err = table.try_lock("job-1".to_string()).unwrap_err();
        assert!(matches!(&err, TryLockError::WouldBlock { key: Some(k) } if &**k == "\"job-1\""));
        named(&err, "job-1");
        named(
            &table.try_lock_shared("job-1".to_string()).unwrap_err(),
            "job-1",
        );
        let err = table
            .try_lock_with("job-1".to_string(), LockOptions::new())
            .unwrap_err();
        assert!(matches!(&err, LockError::WouldBlock { key: Some(_) }));
        named(&err, "job-1");
        // A revoked grant: `check`, `renew`, `lost()`, `release_checked`.
        table.revoke("job-1");
        let err = held.check().unwrap_err();
        assert!(matches!(&err, LockError::Expired { key: Some(_), .. }));
        named(&err, "job-1");
        named(&held.renew(SEC).unwrap_err(), "job-1");
        named(&block(held.lost()), "job-1");
        named(&held.release_checked().unwrap_err(), "job-1");
        // A lapsed lease.
        let leased = table
            .try_lock_with("job-2".to_string(), LockOptions::new().lease(SEC))
            .unwrap();
        clock.advance(SEC);
        named(&leased.check().unwrap_err(), "job-2");
        drop(leased);
        // Two shared holders both upgrading.
        let mut a = table.try_lock_shared("row".to_string()).unwrap();
        let mut b = table.try_lock_shared("row".to_string()).unwrap();
        let mut first = Box::pin(a.upgrade());
        assert!(block(async { poll!(first.as_mut()) }).is_pending());
        let err = block(b.upgrade()).unwrap_err();
        assert!(matches!(
            &err,
            LockError::UpgradeConflict { key: Some(_), .. }
        ));
        named(&err, "row");
        drop(first);
        drop((a, b));
        // A hold released twice, and a token that names no hold.
        let hold = block(async {
            let mut txn = table.transaction();
            txn.lock("order-9".to_string(), Mode::Exclusive)
                .await
                .unwrap();
            let hold = txn.detach(&"order-9".to_string()).unwrap();
            txn.commit().unwrap();
            hold
        });
        assert_eq!(table.release_hold("order-9", hold.token), Ok(()));
        let err = table.release_hold("order-9", hold.token).unwrap_err();
        assert!(matches!(&err, LockError::NoSuchHold { key: Some(_), .. }));
        named(&err, "order-9");

        // Without `name_keys`: "the key", and no name.
        let plain: LockTable<&str> = LockTable::new();
        let held = plain.try_lock("job-1").unwrap();
        let err = plain.try_lock("job-1").unwrap_err();
        assert_eq!(err, TryLockError::WouldBlock { key: None });
        assert!(err.to_string().starts_with("the key is held"), "{err}");
        plain.revoke("job-1");
        let err = held.check().unwrap_err();
        assert_eq!(
            err,
            LockError::Expired {
                token: held.token(),
                key: None
            }
        );
        assert!(err.to_string().contains("has lost the key"), "{err}");
    }

    /// A key whose `Debug` calls back into its table (it looks at its own
    /// key's state, which takes that key's shard lock): every error is
    /// named with no lock of the table held, so none of them deadlocks.
    #[test]
    fn a_key_whose_debug_calls_back_into_the_table_is_named_without_a_lock() {
        use std::sync::OnceLock;
        #[derive(PartialEq, Eq, Hash)]
        struct Reentrant(u32);
        static TABLE: OnceLock<LockTable<Reentrant>> = OnceLock::new();
        impl std::fmt::Debug for Reentrant {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let table = TABLE.get().expect("the table");
                let locked = table.is_locked(&Reentrant(self.0));
                write!(f, "R{}{}", self.0, if locked { "+" } else { "-" })
            }
        }
        let table = TABLE.get_or_init(|| LockTable::builder().name_keys().build());
        let held = table.try_lock(Reentrant(1)).unwrap();
        assert_eq!(
            table.try_lock(Reentrant(1)).unwrap_err().to_string(),
            "key R1+ is held or already awaited; use `lock().await` to queue for it"
        );
        let zero = LockOptions::new().timeout(Duration::ZERO);
        let err = block(table.lock_with(Reentrant(1), zero)).unwrap_err();
        assert!(err.to_string().contains("waiting for key R1+"), "{err}");
        table.revoke(&Reentrant(1));
        let err = held.check().unwrap_err();
        assert!(
            err.to_string().contains("lost key R1-"),
            "revoked: free; {err}"
        );
        assert!(held.release_checked().is_err());
        table.assert_consistent();
        assert!(table.is_empty());
    }

    /// A key whose `Debug` panics, named for a refused try: the panic comes
    /// out of `try_lock`, with no lock held, and strands nothing.
    #[test]
    fn a_key_whose_debug_panics_in_a_refused_try_strands_nothing() {
        let table: LockTable<Hostile> = LockTable::builder().name_keys().build();
        let held = table.try_lock(Hostile(1)).unwrap();
        let once = catch_unwind(AssertUnwindSafe(|| table.try_lock(Hostile(1))));
        assert!(once.is_err());
        table.assert_consistent();
        table.revoke(&Hostile(1));
        let once = catch_unwind(AssertUnwindSafe(|| held.check()));
        assert!(once.is_err());
        drop(held);
        table.assert_consistent();
        assert!(table.is_empty());
        assert!(table.try_lock(Hostile(1)).is_ok());
    }

    /// A key whose `Debug` panics, formatted for a timeout: the panic comes
    /// out of the poll, with no lock held, and strands nothing.
    #[test]
    fn a_key_whose_debug_panics_strands_nothing() {
        let clock = ManualClock::new();
        let table: LockTable<Hostile> = LockTable::builder()
            .clock(clock.clone())
            .name_keys()
            .build();
        let held = table.try_lock(Hostile(1)).unwrap();
        let zero = LockOptions::new().timeout(Duration::ZERO);
        let once = catch_unwind(AssertUnwindSafe(|| {
            block(table.lock_with(Hostile(1), zero))
        }));
        assert!(once.is_err());
        let mut waiting = Box::pin(table.lock_with(Hostile(1), LockOptions::new().timeout(SEC)));
        assert!(block(async { poll!(waiting.as_mut()) }).is_pending());
        clock.advance(SEC);
        let waited = catch_unwind(AssertUnwindSafe(|| block(waiting.as_mut())));
        assert!(waited.is_err());
        drop(waiting);
        table.assert_consistent();
        assert_eq!(table.waiters(&Hostile(1)), 0);
        drop(held);
        assert!(table.is_empty());
        assert!(table.try_lock(Hostile(1)).is_ok());
    }

    /// The counters' and the deadlock counters' `Display`: one line each.
    #[test]
    fn stats_read_as_one_line() {
        let table: LockTable<u32> = LockTable::new();
        let held = table.try_lock(1).unwrap();
        assert!(table.try_lock(1).is_err());
        let err = block(table.lock_with(1, LockOptions::new().timeout(Duration::ZERO)));
        assert!(err.is_err());
        drop(held);
        assert_eq!(
            table.stats().to_string(),
            "1 acquisitions, 0 contended, 0 handoffs, 0 cancelled, 0 expired, 1 timed out, \
             0 revoked"
        );
        assert_eq!(
            table.deadlock_stats().to_string(),
            "0 waits, 0 searches, 0 visited, 0 deepest, 0 cycles (0 presumed), 0 reorders"
        );
    }
}
