//! An upgrade whose shared grant is gone (its guard dropped after the
//! upgrade future was forgotten, or its lease lapsed) leaves the key's
//! queue as soon as admission finds it, told why: a forgotten upgrade,
//! never polled again, must not keep the waiters behind it for ever, and
//! one that is polled again fails with the grant's loss. Under both
//! fairness policies.
#![cfg(feature = "test-util")]
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{forget_pending, poll_noop as poll, warm_eventual_table_on};
use keylock::{LockError, LockOptions, LockTable, ManualClock};

/// A one-shard strict table on a manual clock, and an eventual one (its
/// fairness deadline set, so that a release with waiters before it leaves
/// the key free and nudges the head), each with its clock.
fn tables() -> [(&'static str, Arc<LockTable<&'static str>>, ManualClock); 2] {
    let clock = ManualClock::new();
    let strict = LockTable::<&'static str>::builder()
        .shards(1)
        .clock(clock.clone())
        .build();
    let eventual = ManualClock::new();
    [
        ("strict", Arc::new(strict), clock),
        (
            "eventual",
            Arc::new(warm_eventual_table_on(eventual.clone())),
            eventual,
        ),
    ]
}

/// Polls a waiter the key was just freed for: granted by the release
/// (strict), or nudged to take the free key as it polls (eventual, before
/// the shard's fairness deadline), in which case the first poll may find
/// it pending and the second takes it.
fn take_when_free<F: std::future::Future>(
    mut f: std::pin::Pin<&mut F>,
) -> std::task::Poll<F::Output> {
    match poll(f.as_mut()) {
        std::task::Poll::Pending => poll(f),
        ready => ready,
    }
}

#[test]
fn a_forgotten_upgrade_whose_guard_was_dropped_does_not_block_the_queue() {
    for (name, table, _) in tables() {
        let mut upgrading = table.try_lock_shared("k").expect("free");
        let reader = table.try_lock_shared("k").expect("shared");
        forget_pending(upgrading.upgrade());
        drop(upgrading);
        // A writer queues behind the forgotten upgrade.
        let mut writer = Box::pin(table.lock("k"));
        assert!(
            poll(writer.as_mut()).is_pending(),
            "{name}: the reader holds k"
        );
        drop(reader);
        let got = take_when_free(writer.as_mut());
        assert!(
            got.is_ready(),
            "{name}: the writer stalls behind a forgotten upgrade: {:?}",
            table.status()
        );
        drop(got);
        drop(writer);
        assert!(table.is_empty(), "{name}: {:?}", table.status());
    }
}

#[test]
fn an_orphaned_upgrade_alone_in_the_queue_leaves_no_entry_behind() {
    for (name, table, _) in tables() {
        let mut upgrading = table.try_lock_shared("k").expect("free");
        let reader = table.try_lock_shared("k").expect("shared");
        forget_pending(upgrading.upgrade());
        drop(upgrading);
        drop(reader);
        assert!(table.is_empty(), "{name}: {:?}", table.status());
        assert!(table.try_lock("k").is_ok(), "{name}: k is free");
    }
}

#[test]
fn a_forgotten_upgrade_whose_lease_lapsed_does_not_block_the_queue() {
    for (name, table, clock) in tables() {
        let lease = LockOptions::new().lease(Duration::from_secs(1)).shared();
        let upgrading = {
            let mut g = table.try_lock_with("k", lease).expect("free");
            let reader = table.try_lock_shared("k").expect("shared");
            forget_pending(g.upgrade());
            let mut writer = Box::pin(table.lock("k"));
            assert!(poll(writer.as_mut()).is_pending(), "{name}: readers hold k");
            clock.advance(Duration::from_secs(2));
            // The upgrading grant has lapsed (its guard lives on, fenced).
            drop(reader);
            let got = take_when_free(writer.as_mut());
            assert!(
                got.is_ready(),
                "{name}: the writer stalls behind a forgotten, lapsed upgrade: {:?}",
                table.status()
            );
            g
        };
        drop(upgrading);
        assert!(table.is_empty(), "{name}: {:?}", table.status());
    }
}

#[test]
fn an_orphaned_upgrade_polled_again_fails_with_its_grants_loss() {
    for (name, table, clock) in tables() {
        let lease = LockOptions::new().lease(Duration::from_secs(1)).shared();
        let mut g = table.try_lock_with("k", lease).expect("free");
        let old = g.token();
        let reader = table.try_lock_shared("k").expect("shared");
        let mut up = Box::pin(g.upgrade());
        assert!(poll(up.as_mut()).is_pending(), "{name}: the reader holds k");
        let mut writer = Box::pin(table.lock("k"));
        assert!(poll(writer.as_mut()).is_pending(), "{name}: readers hold k");
        clock.advance(Duration::from_secs(2));
        drop(reader);
        // The writer went first: the upgrade had left the queue.
        let got = take_when_free(writer.as_mut());
        let std::task::Poll::Ready(writer_guard) = got else {
            panic!("{name}: the writer takes k: {:?}", table.status());
        };
        match poll(up.as_mut()) {
            std::task::Poll::Ready(Err(LockError::Expired { token, .. })) => {
                assert_eq!(token, old, "{name}: the lost grant is named")
            }
            other => panic!("{name}: the upgrade learns its grant's loss: {other:?}"),
        }
        drop(up);
        assert_eq!(g.token(), old, "{name}: the guard keeps its (lost) grant");
        drop(writer_guard);
        drop(writer);
        drop(g);
        assert!(table.is_empty(), "{name}: {:?}", table.status());
    }
}
