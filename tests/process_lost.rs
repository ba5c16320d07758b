//! `ProcessGuard::lost` and `ProcessGuard::keep_alive`: loss judged as
//! `check()` judges it, woken by a timer at the lease deadline and by
//! renewals, never by polling. No assertion depends on timing: `HANG` only
//! keeps a broken build from hanging, and the ordering of two deadlines is
//! that of two leases of very different lengths taken one after the other.
#![cfg(target_os = "linux")]

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use futures::executor::block_on;
use keylock::{LockOptions, ProcessLockError, ProcessLockTable};

const HANG: Duration = Duration::from_secs(60);

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("keylock-plost-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn lease(d: Duration) -> LockOptions {
    LockOptions::new().lease(d)
}

/// Awaits `fut` on a thread of its own, failing if it hangs.
fn within<F: Future + Send>(fut: F) -> F::Output
where
    F::Output: Send,
{
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(block_on(fut));
        });
        rx.recv_timeout(HANG).expect("hung")
    })
}

#[derive(Default)]
struct CountWaker(AtomicUsize);

impl Wake for CountWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn lost_resolves_when_the_lease_lapses_and_check_fails_with_it() {
    let dir = temp_dir("lapse");
    let table = ProcessLockTable::open(&dir).unwrap();
    let guard = table
        .try_lock_with("k", lease(Duration::from_millis(20)))
        .unwrap();
    let why = within(guard.lost());
    assert!(
        matches!(&why, ProcessLockError::Expired { token, key } if *token == guard.token() && &**key == "\"k\""),
        "{why}"
    );
    assert!(guard.check().is_err());
    // A grant already lost: at once, on the first poll.
    let waker = Waker::from(Arc::new(CountWaker::default()));
    let mut lost = Box::pin(guard.lost());
    assert!(lost
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_ready());
    drop(lost);
    drop(guard);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_renewal_wakes_lost_which_rearms_at_the_new_deadline() {
    let dir = temp_dir("renew");
    let table = ProcessLockTable::open(&dir).unwrap();
    let a = table
        .try_lock_with("a", lease(Duration::from_millis(30)))
        .unwrap();
    let count = Arc::new(CountWaker::default());
    let waker = Waker::from(Arc::clone(&count));
    let mut cx = Context::from_waker(&waker);
    let mut lost = Box::pin(a.lost());
    assert!(lost.as_mut().poll(&mut cx).is_pending());
    // Renewed far past its first deadline: the watcher is woken to re-arm.
    a.renew(Duration::from_secs(3600)).unwrap();
    assert_eq!(count.0.load(Ordering::SeqCst), 1, "a renewal wakes lost()");
    assert!(lost.as_mut().poll(&mut cx).is_pending());
    // A grant taken after `a`, with a longer first lease, lapses after
    // `a`'s first deadline: once it has, `a` (renewed) is still live.
    let b = table
        .try_lock_with("b", lease(Duration::from_millis(60)))
        .unwrap();
    within(b.lost());
    assert!(
        lost.as_mut().poll(&mut cx).is_pending(),
        "renewed: not lost"
    );
    assert!(a.check().is_ok());
    // Renewed much shorter: it resolves at the new deadline, not in an hour.
    a.renew(Duration::from_millis(10)).unwrap();
    let why = within(lost);
    assert!(matches!(why, ProcessLockError::Expired { .. }), "{why}");
    drop((a, b));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lost_resolves_when_the_key_file_is_removed_and_keep_alive_with_it() {
    let dir = temp_dir("removed");
    let table = ProcessLockTable::open(&dir).unwrap();
    let guard = table
        .try_lock_with("k", lease(Duration::from_secs(3600)))
        .unwrap();
    let keep = guard.keep_alive(Duration::from_millis(5), Duration::from_secs(3600));
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    // The next renewal finds the key's path names no file of the grant.
    let why = within(keep);
    assert!(matches!(why, ProcessLockError::Expired { .. }), "{why}");
    assert!(guard.check().is_err());
    drop(guard);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn keep_alive_renews_on_its_first_poll_and_refuses_bad_options() {
    let dir = temp_dir("keep");
    let table = ProcessLockTable::open(&dir).unwrap();
    let guard = table
        .try_lock_with("k", lease(Duration::from_secs(1)))
        .unwrap();
    let before = guard.expires_at().unwrap().unwrap();
    let waker = Waker::from(Arc::new(CountWaker::default()));
    let mut keep = Box::pin(guard.keep_alive(Duration::from_secs(60), Duration::from_secs(3600)));
    assert!(keep
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    let after = guard.expires_at().unwrap().unwrap();
    assert!(
        after > before + Duration::from_secs(1000),
        "the first poll renews with the lease given"
    );
    drop(keep);
    for (interval, lease) in [
        (Duration::ZERO, Duration::from_secs(1)),
        (Duration::from_secs(2), Duration::from_secs(1)),
        (Duration::from_secs(1), Duration::from_secs(1)),
        (Duration::from_secs(1), Duration::ZERO),
        (Duration::from_secs(1), Duration::from_secs(7200)),
    ] {
        let why = within(guard.keep_alive(interval, lease));
        assert!(
            matches!(why, ProcessLockError::InvalidOptions { .. }),
            "{interval:?}/{lease:?}: {why}"
        );
    }
    assert!(guard.check().is_ok(), "refused options change nothing");
    drop(guard);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_renewal_whose_watcher_wake_panics_still_wakes_the_others_and_renews() {
    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("hostile waker");
        }
    }
    let dir = temp_dir("hostile");
    let table = ProcessLockTable::open(&dir).unwrap();
    let guard = table
        .try_lock_with("k", lease(Duration::from_secs(60)))
        .unwrap();
    let bad = Waker::from(Arc::new(Panics));
    let count = Arc::new(CountWaker::default());
    let good = Waker::from(Arc::clone(&count));
    let mut l1 = Box::pin(guard.lost());
    let mut l2 = Box::pin(guard.lost());
    assert!(l1
        .as_mut()
        .poll(&mut Context::from_waker(&bad))
        .is_pending());
    assert!(l2
        .as_mut()
        .poll(&mut Context::from_waker(&good))
        .is_pending());
    let renewed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guard.renew(Duration::from_secs(3600))
    }));
    assert!(renewed.is_err(), "the waker's panic reaches the renewer");
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "the other watcher is woken"
    );
    let left = guard.expires_at().unwrap().unwrap() - std::time::Instant::now();
    assert!(left > Duration::from_secs(1000), "the renewal was made");
    assert!(l2
        .as_mut()
        .poll(&mut Context::from_waker(&good))
        .is_pending());
    drop((l1, l2));
    drop(guard);
    std::fs::remove_dir_all(&dir).unwrap();
}
