//! Leases and timeouts on the real monotonic clock and the real timer, under
//! tokio, async-std and a blocked thread. Bounds are generous and nothing is
//! asserted about how soon something happened: only that it did, and in the
//! right order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keylock::{LockError, LockOptions, LockTable};

const SHORT: Duration = Duration::from_millis(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_waiter_gets_a_key_whose_holder_never_releases() {
    let table = Arc::new(LockTable::new());
    let stuck = table
        .try_lock_with("k", LockOptions::new().lease(SHORT))
        .unwrap();
    // The holder neither drops nor polls anything: only the waiter's timer
    // can move the key on.
    let t = table.clone();
    let next = tokio::spawn(async move { t.lock_owned("k").await.token() })
        .await
        .unwrap();
    assert!(next > stuck.token());
    assert!(stuck.is_expired());
    assert!(Instant::now() >= stuck.expires_at().unwrap());
    drop(stuck);
    assert!(table.is_empty());
}

#[async_std::test]
async fn async_std_timeout_reports_the_holder() {
    let table = LockTable::new();
    let held = table.try_lock(1u32).unwrap();
    let start = Instant::now();
    let err = table
        .lock_with(1, LockOptions::new().timeout(SHORT))
        .await
        .unwrap_err();
    match err {
        LockError::Timeout { waited, holder, .. } => {
            assert!(waited >= SHORT);
            assert!(start.elapsed() >= SHORT);
            assert_eq!(holder, Some(held.token()));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert_eq!(table.waiters(&1), 0);
    drop(held);
    assert!(table.is_empty());
}

#[test]
fn blocked_thread_is_woken_at_the_holders_deadline() {
    let table = Arc::new(LockTable::new());
    let stuck = table
        .try_lock_with(5u8, LockOptions::new().lease(SHORT))
        .unwrap();
    let t = table.clone();
    let waiter = std::thread::spawn(move || t.blocking_lock(5).token());
    let next = waiter.join().unwrap();
    assert!(next > stuck.token());
    assert!(stuck.check().is_err());
    drop(stuck);
    assert!(table.is_empty());
}

#[test]
fn blocked_thread_times_out_and_leaves_nothing() {
    let table = LockTable::new();
    let held = table.try_lock("x").unwrap();
    let err = table
        .blocking_lock_with("x", LockOptions::new().timeout(SHORT))
        .unwrap_err();
    assert!(matches!(err, LockError::Timeout { .. }), "{err}");
    assert_eq!(table.waiters("x"), 0);
    drop(held);
    assert!(table.is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn smol_and_tokio_share_leases_on_one_table() {
    let table = Arc::new(LockTable::<u64>::builder().default_lease(SHORT).build());
    let first = table.try_lock(9).unwrap();
    let t = table.clone();
    // A smol waiter on another thread gets the key when the default lease
    // of the tokio-side holder lapses.
    let token = std::thread::spawn(move || smol::block_on(async { t.lock(9).await.token() }))
        .join()
        .unwrap();
    assert!(token > first.token());
    assert!(first.is_expired());
    drop(first);
    assert!(table.is_empty());
}
