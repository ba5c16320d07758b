//! Compile-time checks of the auto traits and standard traits the public
//! types promise. A regression here fails the build of this test.

use std::error::Error;
use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use keylock::futures::{KeepAlive, Lock, LockOwned, Lost};
use keylock::{FencingToken, Guard, LockTable, OwnedGuard, Stats, TryLockError};

fn send<T: Send>() {}
fn sync<T: Sync>() {}
fn unpin<T: Unpin>() {}
fn static_<T: 'static>() {}
fn debug<T: Debug>() {}
fn default<T: Default>() {}
fn error<T: Error + Send + Sync + 'static>() {}
fn token_traits<T: Copy + Ord + Hash + Display + Debug + Send + Sync>() {}
fn stats_traits<T: Clone + Debug>() {}

#[test]
fn table_is_shareable() {
    send::<LockTable<String>>();
    sync::<LockTable<String>>();
    debug::<LockTable<String>>();
    default::<LockTable<String>>();
    send::<Arc<LockTable<String>>>();
    sync::<Arc<LockTable<String>>>();
    // And usable from a spawned thread through an `Arc`.
    let table: Arc<LockTable<String>> = Arc::default();
    let t2 = table.clone();
    std::thread::spawn(move || drop(t2.try_lock("k".to_owned()).unwrap()))
        .join()
        .unwrap();
    assert!(format!("{table:?}").starts_with("LockTable"));
    assert!(table.is_empty());
}

#[test]
fn futures_are_send_and_sync() {
    // The futures are `!Unpin`: a waiting future's queue node lives inside
    // it. Poll them by hand through `pin!` or `Box::pin`, which are `Unpin`.
    send::<Lock<'_, String>>();
    sync::<Lock<'_, String>>();
    unpin::<std::pin::Pin<Box<Lock<'_, String>>>>();
    debug::<Lock<'_, String>>();
    send::<LockOwned<String>>();
    sync::<LockOwned<String>>();
    static_::<LockOwned<String>>();
    debug::<LockOwned<String>>();

    // A `lock().await` held across an await point keeps the task `Send`:
    // this only compiles if the async block is `Send`.
    fn spawnable<F: std::future::Future + Send + 'static>(_: F) {}
    let table: Arc<LockTable<String>> = Arc::default();
    spawnable(async move {
        let g = table.lock("a".to_owned()).await;
        std::future::ready(()).await;
        drop(g);
        let g = table.clone().lock_owned("b".to_owned()).await;
        std::future::ready(()).await;
        drop(g);
    });
}

#[test]
fn loss_and_keep_alive_futures_are_send_sync_and_unpin() {
    // They hold no queue node: `Unpin`, so `select!` and hand polling need
    // no pinning.
    send::<Lost<'_, String>>();
    sync::<Lost<'_, String>>();
    unpin::<Lost<'_, String>>();
    debug::<Lost<'_, String>>();
    send::<KeepAlive<'_, String>>();
    sync::<KeepAlive<'_, String>>();
    unpin::<KeepAlive<'_, String>>();
    debug::<KeepAlive<'_, String>>();

    // Awaited inside a spawned task, beside the work, they keep it `Send`.
    fn spawnable<F: std::future::Future + Send + 'static>(_: F) {}
    let table: Arc<LockTable<String>> = Arc::default();
    spawnable(async move {
        let g = table.clone().lock_owned("a".to_owned()).await;
        let _ = g.lost().await;
        let _ = g
            .keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .await;
    });
}

#[test]
fn guards_are_send_and_sync() {
    send::<Guard<'_, String>>();
    sync::<Guard<'_, String>>();
    debug::<Guard<'_, String>>();
    send::<OwnedGuard<String>>();
    sync::<OwnedGuard<String>>();
    static_::<OwnedGuard<String>>();
    debug::<OwnedGuard<String>>();

    let table = LockTable::new();
    let g = table.try_lock(String::from("k")).unwrap();
    let shown = format!("{g:?}");
    assert!(
        shown.contains("\"k\"") && shown.contains("token"),
        "{shown}"
    );
    // Shared across scoped threads by reference.
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(g.key(), "k"));
    });
}

#[test]
fn error_token_and_stats_traits() {
    error::<TryLockError>();
    token_traits::<FencingToken>();
    stats_traits::<Stats>();

    let table = LockTable::new();
    let g = table.try_lock(1u8).unwrap();
    let err: Box<dyn Error + Send + Sync> = Box::new(table.try_lock(1).unwrap_err());
    assert!(!err.to_string().is_empty());
    let t = g.token();
    assert!(t.to_string().contains(&t.get().to_string()));
    let s = table.stats();
    assert_eq!(s.clone().acquisitions, 1);
    assert!(format!("{s:?}").contains("acquisitions"));
}

#[cfg(target_os = "linux")]
#[test]
fn process_loss_futures_are_send_sync_unpin_debug() {
    use keylock::process::{ProcessKeepAlive, ProcessLost};
    send::<ProcessLost<'_, String>>();
    sync::<ProcessLost<'_, String>>();
    unpin::<ProcessLost<'_, String>>();
    debug::<ProcessLost<'_, String>>();
    send::<ProcessKeepAlive<'_, String>>();
    sync::<ProcessKeepAlive<'_, String>>();
    unpin::<ProcessKeepAlive<'_, String>>();
    debug::<ProcessKeepAlive<'_, String>>();
}

#[test]
fn scope_types_have_their_traits() {
    use keylock::{Blocker, ScopedErrorKind};
    fn copy_eq<T: Copy + Eq + Debug + Send + Sync>() {}
    copy_eq::<ScopedErrorKind>();
    copy_eq::<Blocker>();
}
