//! Retrying a transaction in one call (`LockTable::run_transaction` and its
//! owned form): an attempt answered as a deadlock's victim, or refused an
//! upgrade because another holder was already upgrading, is run again in a
//! fresh transaction and its value returned; any other failure is returned
//! at once; the attempts are bounded. Errors of borrowed keys go through
//! `?` into a `'static` error. Every future is polled by hand with a noop
//! waker; the backoff is zero, so no timer is involved.

use std::cell::Cell;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use keylock::{
    LockTable, Mode, RetryPolicy, TransactionError, TransactionFailure, TransactionOptions,
    WaitPolicy,
};

mod common;
use common::poll_noop as poll;

/// Retries at once (no timer), at most `n` attempts.
fn at_once(n: u32) -> RetryPolicy {
    RetryPolicy::new()
        .attempts(n)
        .backoff(Duration::ZERO, Duration::ZERO)
}

/// Pending until `open` is set.
async fn gate(open: &Cell<bool>) {
    poll_fn(|_| {
        if open.get() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}

#[test]
fn a_deadlock_victim_is_retried_and_its_value_returned() {
    let table = LockTable::<&str>::new();
    let mut a = table.transaction();
    assert!(poll(std::pin::pin!(a.lock("x", Mode::Exclusive))).is_ready());
    let attempts = Cell::new(0);
    let open = Cell::new(false);
    let mut run =
        Box::pin(
            table.run_transaction_with(TransactionOptions::new(), at_once(3), async |txn| {
                attempts.set(attempts.get() + 1);
                txn.lock("y", Mode::Exclusive).await?;
                if attempts.get() == 1 {
                    gate(&open).await;
                }
                txn.lock("x", Mode::Exclusive).await?;
                Ok::<_, TransactionError<&str>>(attempts.get())
            }),
        );
    // Attempt 1 holds "y" and stops at the gate; `a` (holding "x") waits
    // for "y".
    assert!(poll(run.as_mut()).is_pending());
    let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
    assert!(poll(a_waits.as_mut()).is_pending());
    // Attempt 1 asks for "x": its wait closes the cycle, it is the victim,
    // and its "y" goes to `a`; attempt 2 waits for "y" behind `a`.
    open.set(true);
    assert!(poll(run.as_mut()).is_pending());
    assert_eq!(attempts.get(), 2, "retried at once");
    assert!(matches!(poll(a_waits.as_mut()), Poll::Ready(Ok(_))));
    drop(a_waits);
    a.commit().expect("no lease");
    assert!(matches!(poll(run.as_mut()), Poll::Ready(Ok(2))));
    assert!(table.is_empty(), "the attempt committed");
    assert_eq!(table.deadlock_stats().cycles, 1);
}

#[test]
fn the_last_attempts_error_is_returned_once_they_are_used_up() {
    let table = LockTable::<&str>::new();
    let mut a = table.transaction();
    assert!(poll(std::pin::pin!(a.lock("x", Mode::Exclusive))).is_ready());
    let open = Cell::new(false);
    let mut run =
        Box::pin(
            table.run_transaction_with(TransactionOptions::new(), at_once(1), async |txn| {
                txn.lock("y", Mode::Exclusive).await?;
                gate(&open).await;
                txn.lock("x", Mode::Exclusive).await?;
                Ok::<_, TransactionError<&str>>(())
            }),
        );
    assert!(poll(run.as_mut()).is_pending());
    let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
    assert!(poll(a_waits.as_mut()).is_pending());
    open.set(true);
    match poll(run.as_mut()) {
        Poll::Ready(Err(err @ TransactionError::Deadlock(_))) => assert!(err.is_retryable()),
        other => panic!("the victim's error: {other:?}"),
    }
    assert!(matches!(poll(a_waits.as_mut()), Poll::Ready(Ok(_))));
}

#[test]
fn an_upgrade_conflict_is_retried_like_a_deadlock() {
    let table = LockTable::<&str>::new();
    let mut b = table.transaction();
    assert!(poll(std::pin::pin!(b.lock("k", Mode::Shared))).is_ready());
    let attempts = Cell::new(0);
    let open = Cell::new(false);
    let mut run =
        Box::pin(
            table.run_transaction_with(TransactionOptions::new(), at_once(3), async |txn| {
                attempts.set(attempts.get() + 1);
                txn.lock("k", Mode::Shared).await?;
                if attempts.get() == 1 {
                    gate(&open).await;
                }
                txn.lock("k", Mode::Exclusive).await?;
                Ok::<_, TransactionError<&str>>(attempts.get())
            }),
        );
    assert!(poll(run.as_mut()).is_pending());
    // `b` upgrades first: it waits for attempt 1's shared grant.
    let mut b_up = Box::pin(b.lock("k", Mode::Exclusive));
    assert!(poll(b_up.as_mut()).is_pending());
    // Attempt 1's upgrade is refused (an upgrade conflict), it lets go, `b`
    // upgrades, and attempt 2 waits behind it.
    open.set(true);
    assert!(poll(run.as_mut()).is_pending());
    assert_eq!(attempts.get(), 2);
    assert!(matches!(poll(b_up.as_mut()), Poll::Ready(Ok(_))));
    drop(b_up);
    b.commit().expect("no lease");
    assert!(matches!(poll(run.as_mut()), Poll::Ready(Ok(2))));
    assert!(table.is_empty());
}

#[test]
fn a_failure_that_is_not_retryable_is_returned_at_once() {
    let table = LockTable::<&str>::new();
    let _other = table.try_lock("k").unwrap();
    let attempts = Cell::new(0);
    let mut run = Box::pin(table.run_transaction_with(
        TransactionOptions::new().wait(WaitPolicy::NoWait),
        at_once(5),
        async |txn| {
            attempts.set(attempts.get() + 1);
            txn.lock("k", Mode::Exclusive).await?;
            Ok::<_, TransactionError<&str>>(())
        },
    ));
    match poll(run.as_mut()) {
        Poll::Ready(Err(err @ TransactionError::Busy { key: "k", .. })) => {
            assert!(!err.is_retryable());
        }
        other => panic!("busy: {other:?}"),
    }
    assert_eq!(attempts.get(), 1);
}

/// The owned form; and an error converted away from `TransactionError`
/// inside the closure is retried all the same (the transaction knows).
#[test]
fn the_owned_form_retries_whatever_error_type_the_closure_returns() {
    let table = Arc::new(LockTable::<u32>::new());
    let a = table.clone().transaction_owned();
    assert!(poll(std::pin::pin!(a.lock(1, Mode::Exclusive))).is_ready());
    let attempts = Cell::new(0);
    let open = Cell::new(false);
    let mut run = Box::pin(table.clone().run_transaction_owned_with(
        TransactionOptions::new(),
        at_once(3),
        async |txn| {
            attempts.set(attempts.get() + 1);
            txn.lock(2, Mode::Exclusive).await?;
            if attempts.get() == 1 {
                gate(&open).await;
            }
            txn.lock(1, Mode::Exclusive)
                .await
                .map_err(|e| format!("lost the race: {e}"))?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(attempts.get())
        },
    ));
    assert!(poll(run.as_mut()).is_pending());
    let mut a_waits = Box::pin(a.lock(2, Mode::Exclusive));
    assert!(poll(a_waits.as_mut()).is_pending());
    open.set(true);
    assert!(poll(run.as_mut()).is_pending());
    assert_eq!(attempts.get(), 2);
    assert!(matches!(poll(a_waits.as_mut()), Poll::Ready(Ok(_))));
    drop(a_waits);
    a.commit().expect("no lease");
    assert!(matches!(poll(run.as_mut()), Poll::Ready(Ok(2))));
    assert!(table.is_empty());
}

/// Borrowed keys (`&str` of a local `String`): `?` into a key-free error
/// inside the closure, and from there into a `'static` boxed error.
#[test]
fn borrowed_keys_reach_a_static_error_through_the_key_free_form() {
    fn transfer<'a>(
        table: &LockTable<&'a str>,
        from: &'a str,
        to: &'a str,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let run = table.run_transaction(async |txn| {
            txn.lock(from, Mode::Exclusive).await?;
            txn.lock_with(to, Mode::Exclusive, WaitPolicy::NoWait)
                .await?;
            Ok::<_, TransactionFailure>(())
        });
        let Poll::Ready(out) = poll(std::pin::pin!(run)) else {
            panic!("nothing waits");
        };
        out?;
        Ok(())
    }
    let (from, to) = (String::from("acct-1"), String::from("acct-2"));
    let table = LockTable::new();
    transfer(&table, &from, &to).expect("free");
    let _other = table.try_lock(to.as_str()).unwrap();
    let err = transfer(&table, &from, &to).unwrap_err();
    let failure = err
        .downcast_ref::<TransactionFailure>()
        .expect("the key-free form");
    assert_eq!(failure.key(), Some("\"acct-2\""));
    assert!(!failure.is_retryable());
    assert!(err.to_string().contains("without waiting"), "{err}");
    assert!(table.is_locked(to.as_str()) && !table.is_locked(from.as_str()));
}

/// The backoff sleeps on the table's clock: between half and all of the
/// first pause, the retry waits; past it, it runs.
#[test]
#[cfg(feature = "test-util")]
fn the_backoff_waits_on_the_tables_clock() {
    let clock = keylock::ManualClock::new();
    let table = LockTable::<&str>::builder().clock(clock.clone()).build();
    let mut a = table.transaction();
    assert!(poll(std::pin::pin!(a.lock("x", Mode::Exclusive))).is_ready());
    let attempts = Cell::new(0);
    let open = Cell::new(false);
    let pause = Duration::from_millis(10);
    let mut run = Box::pin(table.run_transaction_with(
        TransactionOptions::new(),
        RetryPolicy::new().attempts(2).backoff(pause, pause),
        async |txn| {
            attempts.set(attempts.get() + 1);
            txn.lock("y", Mode::Exclusive).await?;
            if attempts.get() == 1 {
                gate(&open).await;
            }
            txn.lock("x", Mode::Exclusive).await?;
            Ok::<_, TransactionError<&str>>(attempts.get())
        },
    ));
    assert!(poll(run.as_mut()).is_pending());
    let mut a_waits = Box::pin(a.lock("y", Mode::Exclusive));
    assert!(poll(a_waits.as_mut()).is_pending());
    open.set(true);
    assert!(poll(run.as_mut()).is_pending());
    assert_eq!(attempts.get(), 1, "backing off");
    assert!(matches!(poll(a_waits.as_mut()), Poll::Ready(Ok(_))));
    drop(a_waits);
    a.commit().expect("no lease");
    clock.advance(pause / 2 - Duration::from_nanos(1));
    assert!(poll(run.as_mut()).is_pending());
    assert_eq!(attempts.get(), 1, "under half the pause: still backing off");
    clock.advance(pause / 2 + Duration::from_nanos(1));
    assert!(matches!(poll(run.as_mut()), Poll::Ready(Ok(2))));
    assert!(table.is_empty());
}
