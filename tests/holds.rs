//! Holds: a transaction detaches a key as a hold that outlives it; the
//! table releases it by key and token (a stale token or another key frees
//! nothing and says so); a hold with a lease lapses and its successor gets a
//! higher token; a hold is never part of a deadlock cycle; a table dropped
//! with holds left frees them.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::poll;
    use keylock::{LockError, LockTable, ManualClock, Mode, TransactionError, TransactionOptions};

    const SEC: Duration = Duration::from_secs(1);

    fn block<F: std::future::Future>(f: F) -> F::Output {
        futures::executor::block_on(f)
    }

    #[test]
    fn a_hold_outlives_its_transaction_until_released_by_key_and_token() {
        block(async {
            let table = LockTable::<&str>::new();
            let mut txn = table.transaction();
            txn.lock("a", Mode::Shared).await.unwrap();
            txn.lock("a", Mode::Shared).await.unwrap(); // re-entered
            txn.lock("b", Mode::Exclusive).await.unwrap();
            let hold = txn.detach(&"a").unwrap();
            assert_eq!((hold.key, hold.mode), ("a", Mode::Shared));
            assert_eq!(txn.count(&"a"), 0, "the re-entry count went with it");
            assert_eq!(txn.len(), 1);
            txn.commit().unwrap();
            assert!(!table.is_locked("b"), "the commit released the rest");
            let holder = table.holder("a").unwrap();
            assert_eq!(holder.token, hold.token);
            assert!(holder.hold && holder.transaction.is_none());

            let mut writer = Box::pin(table.lock("a"));
            assert!(poll!(writer.as_mut()).is_pending(), "the hold holds");
            assert_eq!(
                table.release_hold("b", hold.token),
                Err(LockError::NoSuchHold {
                    token: hold.token,
                    key: None
                })
            );
            assert!(
                poll!(writer.as_mut()).is_pending(),
                "another key frees nothing"
            );
            table.release_hold("a", hold.token).unwrap();
            let guard = writer.await;
            assert!(guard.token() > hold.token);
            assert_eq!(
                table.release_hold("a", hold.token),
                Err(LockError::NoSuchHold {
                    token: hold.token,
                    key: None
                })
            );
            assert!(guard.check().is_ok(), "a stale release freed nothing");
            drop(guard);
            assert!(table.is_empty());
        });
    }

    /// Issue 26, item 7: a token that names no hold (never one, released
    /// already, a plain guard's, or a hold of another key) is answered as
    /// such, not as a grant that lost its key; nothing is freed.
    #[test]
    fn release_hold_of_a_token_that_names_no_hold_says_no_such_hold() {
        block(async {
            let table = LockTable::<&str>::new();
            let guard = table.try_lock("g").unwrap();
            let err = table.release_hold("g", guard.token()).unwrap_err();
            assert_eq!(
                err,
                LockError::NoSuchHold {
                    token: guard.token(),
                    key: None,
                }
            );
            let text = err.to_string();
            assert!(text.contains("no hold"), "{text}");
            assert!(!text.contains("lost the key"), "{text}");
            assert!(guard.check().is_ok(), "a plain guard's token frees nothing");
            let never = keylock::FencingToken::new(u64::MAX - 7).unwrap();
            assert_eq!(
                table.release_hold("g", never),
                Err(LockError::NoSuchHold {
                    token: never,
                    key: None
                })
            );

            let mut txn = table.transaction();
            txn.lock("a", Mode::Exclusive).await.unwrap();
            let hold = txn.detach(&"a").unwrap();
            txn.commit().unwrap();
            assert_eq!(
                table.release_hold("b", hold.token),
                Err(LockError::NoSuchHold {
                    token: hold.token,
                    key: None
                }),
                "a hold of another key"
            );
            assert!(table.is_locked("a"), "put back untouched");
            table.release_hold("a", hold.token).unwrap();
            assert_eq!(
                table.release_hold("a", hold.token),
                Err(LockError::NoSuchHold {
                    token: hold.token,
                    key: None
                }),
                "released already"
            );
            drop(guard);
            assert!(table.is_empty());
        });
    }

    #[test]
    fn a_hold_with_a_lease_lapses_and_its_successor_is_fenced_above_it() {
        let clock = ManualClock::new();
        let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
        block(async {
            let mut txn = table.transaction_with(TransactionOptions::new().lease(SEC));
            txn.lock(7, Mode::Exclusive).await.unwrap();
            let hold = txn.detach(&7).unwrap();
            assert_eq!(hold.lease_deadline, Some(clock.now() + SEC));
            drop(txn);
            let mut next = Box::pin(table.lock(7));
            assert!(poll!(next.as_mut()).is_pending());
            clock.advance(SEC);
            let guard = next.await;
            assert!(guard.token() > hold.token);
            assert!(matches!(
                table.release_hold(&7, hold.token),
                Err(LockError::Expired { .. })
            ));
            assert!(guard.check().is_ok());
            drop(guard);
            table.assert_consistent();
            assert!(table.is_empty(), "the lapsed hold's record is gone");
        });
    }

    #[test]
    fn lapsed_holds_are_swept_by_the_next_hold() {
        let clock = ManualClock::new();
        let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
        block(async {
            let mut txn = table.transaction_with(TransactionOptions::new().lease(SEC));
            txn.lock(1, Mode::Exclusive).await.unwrap();
            txn.detach(&1).unwrap();
            clock.advance(SEC);
            // Nobody releases the lapsed hold; the next detach sweeps it.
            let mut other = table.transaction();
            other.lock(2, Mode::Exclusive).await.unwrap();
            let hold = other.detach(&2).unwrap();
            assert!(!table.is_locked(&1));
            table.release_hold(&2, hold.token).unwrap();
            table.assert_consistent();
            assert!(table.is_empty());
        });
    }

    #[test]
    fn owned_transactions_detach_and_errors_name_the_key() {
        block(async {
            let table = Arc::new(LockTable::<u32>::new());
            let txn = table.clone().transaction_owned();
            assert!(matches!(
                txn.detach(&1),
                Err(TransactionError::NotHeld { key: 1 })
            ));
            txn.lock(1, Mode::Exclusive).await.unwrap();
            let hold = txn.detach(&1).unwrap();
            txn.commit().unwrap();
            assert!(table.is_locked(&1));
            table.release_hold(&1, hold.token).unwrap();
            assert!(table.is_empty());
        });
    }

    #[test]
    fn a_hold_is_never_part_of_a_deadlock() {
        block(async {
            let table = LockTable::<&str>::new();
            let mut t1 = table.transaction();
            let mut t2 = table.transaction();
            t1.lock("x", Mode::Exclusive).await.unwrap();
            let hold = t1.detach(&"x").unwrap();
            t2.lock("y", Mode::Exclusive).await.unwrap();
            let mut t1_waits = Box::pin(t1.lock("y", Mode::Exclusive));
            assert!(poll!(t1_waits.as_mut()).is_pending());
            // t2 waits for "x": held by the hold, which belongs to nobody.
            let mut t2_waits = Box::pin(t2.lock("x", Mode::Exclusive));
            assert!(poll!(t2_waits.as_mut()).is_pending(), "no cycle: t2 waits");
            assert!(table.recent_deadlocks().is_empty());
            table.release_hold("x", hold.token).unwrap();
            assert!(t2_waits.await.is_ok());
            drop(t2);
            assert!(t1_waits.await.is_ok());
        });
    }

    #[test]
    fn a_table_dropped_with_holds_left_frees_them() {
        block(async {
            let table = LockTable::<String>::new();
            let mut txn = table.transaction();
            txn.lock("k".to_string(), Mode::Exclusive).await.unwrap();
            txn.detach(&"k".to_string()).unwrap();
            drop(txn);
            assert_eq!(table.len(), 1);
            drop(table);
        });
    }
}
