//! Tests of the open bugs the modes model found (fuzz/README.md, "Bugs
//! found", 4 and 5). Each fails on the code it was written against; move it
//! into `tests/` with its fix (it needs the `test-util` feature for
//! `ManualClock`), and the matching input of `known-bugs/ops/` into
//! `regressions/ops/`. Not compiled here.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::pin;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::Duration;

use keylock::{LockError, LockOptions, LockTable, ManualClock, Mode};

fn cx() -> Context<'static> {
    Context::from_waker(Waker::noop())
}

/// `revoke` forces out every holder found when it is called; a shared
/// holder whose upgrade was waiting must not come out of it exclusive.
#[test]
fn revoke_does_not_let_a_pending_upgrade_escape() {
    let table = LockTable::new();
    let b = table.try_lock_shared(1).unwrap(); // first in the holder set
    let mut a = table.try_lock_shared(1).unwrap();
    let ta = a.token();
    let mut up = pin!(a.upgrade()); // waits for b
    assert!(up.as_mut().poll(&mut cx()).is_pending());
    let revoked = table.revoke(&1);
    assert_eq!(revoked, Some(ta), "both grants revoked, the highest named");
    assert!(!table.is_locked(&1), "nobody holds the key after revoke");
    assert_eq!(
        up.as_mut().poll(&mut cx()),
        Poll::Ready(Err(LockError::Expired { token: ta }))
    );
    drop(b);
}

/// A settle that finds both shared holders lapsed must not grant the
/// upgrade of one of them (under a new token with the lapsed deadline).
#[test]
fn lapse_of_both_readers_does_not_grant_the_upgrade() {
    let clock = ManualClock::new();
    let table = LockTable::<u8>::builder().clock(clock.clone()).build();
    let lease = LockOptions::new().shared().lease(Duration::from_millis(1));
    let b = table.try_lock_with(1, lease).unwrap();
    let mut a = table.try_lock_with(1, lease).unwrap();
    let ta = a.token();
    let mut up = pin!(a.upgrade());
    assert!(up.as_mut().poll(&mut cx()).is_pending());
    clock.advance(Duration::from_millis(2));
    assert!(b.check().is_err()); // settles both lapses
    assert_eq!(
        up.as_mut().poll(&mut cx()),
        Poll::Ready(Err(LockError::Expired { token: ta }))
    );
    assert_eq!(table.stats().expired, 2);
}

unsafe fn clone(p: *const ()) -> RawWaker {
    RawWaker::new(p, &BOMB)
}
unsafe fn wake(_: *const ()) {
    panic!("waker wake");
}
unsafe fn noop(_: *const ()) {}
static BOMB: RawWakerVTable = RawWakerVTable::new(clone, wake, wake, noop);

/// A downgrade whose wake of an admitted reader panics has still made the
/// grant shared: the guard must say so.
#[test]
fn downgrade_whose_wake_panics_leaves_the_guard_shared() {
    let table = LockTable::new();
    let mut w = table.try_lock(1).unwrap();
    // SAFETY: the vtable ignores the data pointer.
    let bomb = unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &BOMB)) };
    let mut reader = pin!(table.lock_shared(1));
    assert!(reader
        .as_mut()
        .poll(&mut Context::from_waker(&bomb))
        .is_pending());
    let r = catch_unwind(AssertUnwindSafe(|| w.downgrade()));
    assert!(r.is_err(), "the reader's wake panicked");
    assert!(table.try_lock_shared(1).is_ok(), "the table holds it shared");
    assert_eq!(w.mode(), Mode::Shared);
}
