//! The cluster scope against a real etcd cluster: exclusion, FIFO, timeouts
//! with their diagnosis, try_lock, owned guards, the two tiers, leases and
//! the fence.
//!
//! Needs the `etcd` feature and a cluster named by `KEYLOCK_ETCD_ENDPOINTS`
//! (see `tests/etcd_cluster/`); without one every test says so and passes.
//! Assertions are on outcomes only (who held the key, in which order, with
//! which tokens); durations are generous bounds against hangs.

#![cfg(feature = "etcd")]

mod etcd_cluster;
#[path = "../examples/jobs/runner.rs"]
mod runner;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keylock::etcd::{ClusterLockError, ClusterLockTable, ClusterOptions};
use keylock::LockOptions;

/// The session TTL of the test tables: long enough that a keep-alive
/// delayed by a busy machine (or a member being killed) does not lose the
/// session; short enough that a dead holder's key is taken over soon.
const SESSION_TTL: u64 = 4;

const HANG: Duration = Duration::from_secs(60);

async fn table(endpoints: &[String], prefix: &str, label: &str) -> ClusterLockTable<String> {
    let opts = ClusterOptions::new()
        .prefix(prefix)
        .label(label)
        .session_ttl(Duration::from_secs(SESSION_TTL));
    ClusterLockTable::connect_with(endpoints, opts)
        .await
        .expect("connect to the test cluster")
}

async fn count_keys(t: &ClusterLockTable<String>, key: &str) -> usize {
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let resp = t
        .client()
        .clone()
        .get(t.key_prefix(key), Some(opts))
        .await
        .unwrap();
    usize::try_from(resp.count()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_across_tables() {
    let Some(eps) = etcd_cluster::endpoints("exclusion_across_tables") else {
        return;
    };
    let prefix = etcd_cluster::prefix("exclusion");
    let mut tables = Vec::new();
    for i in 0..3 {
        tables.push(Arc::new(table(&eps, &prefix, &format!("table-{i}")).await));
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, t) in tables.iter().enumerate() {
        for _ in 0..4 {
            let t = Arc::clone(t);
            let inside = Arc::clone(&inside);
            let tokens = Arc::clone(&tokens);
            tasks.push(tokio::spawn(async move {
                for _ in 0..3 {
                    let g = t.lock("hot".to_owned()).await.unwrap();
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    g.check().unwrap();
                    tokens.lock().unwrap().push((g.token(), i));
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(g);
                }
            }));
        }
    }
    for task in tasks {
        tokio::time::timeout(HANG, task).await.unwrap().unwrap();
    }
    let tokens = tokens.lock().unwrap();
    assert_eq!(tokens.len(), 36);
    // Tokens are create revisions: in the order the key was held, strictly
    // increasing.
    assert!(tokens.windows(2).all(|w| w[0].0 < w[1].0), "{tokens:?}");
    // Each table got the key (no starvation).
    for i in 0..3 {
        assert!(tokens.iter().any(|&(_, t)| t == i));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_across_tables() {
    let Some(eps) = etcd_cluster::endpoints("fifo_across_tables") else {
        return;
    };
    let prefix = etcd_cluster::prefix("fifo");
    let holder = table(&eps, &prefix, "holder").await;
    let g = holder.lock("k".to_owned()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let t = Arc::new(table(&eps, &prefix, &format!("w{i}")).await);
        let order = Arc::clone(&order);
        tasks.push(tokio::spawn(async move {
            let g = t.lock("k".to_owned()).await.unwrap();
            order.lock().unwrap().push(i);
            drop(g);
        }));
        // Enqueued (its waiter key is in etcd) before the next one starts.
        let want = i + 2;
        tokio::time::timeout(HANG, async {
            while count_keys(&holder, "k").await < want {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap();
    }
    drop(g);
    for task in tasks {
        tokio::time::timeout(HANG, task).await.unwrap().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
}

fn shared() -> LockOptions {
    LockOptions::new().shared()
}

/// Waits until `n` waiter keys of `key` are in etcd.
async fn until_keys(t: &ClusterLockTable<String>, key: &str, n: usize) {
    tokio::time::timeout(HANG, async {
        while count_keys(t, key).await < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the waiter keys appear");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_a_key() {
    let Some(eps) = etcd_cluster::endpoints("readers_share_a_key") else {
        return;
    };
    let prefix = etcd_cluster::prefix("readers");
    let mut other = eps.clone();
    other.rotate_left(1);
    let a = table(&eps, &prefix, "a").await;
    let b = table(&other, &prefix, "b").await;
    // Two readers in one table, a third in another (on another member).
    let r1 = a.lock_with("k".to_owned(), shared()).await.unwrap();
    let r2 = a.lock_with("k".to_owned(), shared()).await.unwrap();
    let r3 = b.try_lock_with("k".to_owned(), shared()).await.unwrap();
    for r in [&r1, &r2, &r3] {
        assert_eq!(r.mode(), keylock::Mode::Shared);
        assert!(r.check().is_ok());
    }
    assert!(r1.token() < r2.token() && r2.token() < r3.token());
    assert_eq!(count_keys(&a, "k").await, 3);
    // A writer is refused while they read, in either table.
    assert!(matches!(
        b.try_lock("k".to_owned()).await,
        Err(ClusterLockError::WouldBlock { .. })
    ));
    assert!(matches!(
        a.try_lock("k".to_owned()).await,
        Err(ClusterLockError::WouldBlock { .. })
    ));
    // Each reader's fence holds at the store until it lets go.
    let mut c = a.client().clone();
    let fenced = |f: keylock::etcd::Fence| {
        etcd_client::Txn::new()
            .when([f.compare()])
            .and_then([etcd_client::TxnOp::get(format!("{prefix}-x"), None)])
    };
    let f1 = r1.fence();
    assert!(c.txn(fenced(f1.clone())).await.unwrap().succeeded());
    r1.unlock().await.unwrap();
    assert!(!c.txn(fenced(f1)).await.unwrap().succeeded());
    assert!(c.txn(fenced(r2.fence())).await.unwrap().succeeded());
    r2.unlock().await.unwrap();
    let last_reader = r3.unlock().await.unwrap();
    // All gone: a writer takes it at once, after every reader.
    let w = b.try_lock("k".to_owned()).await.unwrap();
    assert_eq!(w.mode(), keylock::Mode::Exclusive);
    assert!(w.token() > last_reader);
    assert_eq!(count_keys(&a, "k").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_excludes_readers() {
    let Some(eps) = etcd_cluster::endpoints("a_writer_excludes_readers") else {
        return;
    };
    let prefix = etcd_cluster::prefix("writer");
    let mut other = eps.clone();
    other.rotate_left(1);
    let a = table(&eps, &prefix, "writer").await;
    let b = Arc::new(table(&other, &prefix, "reader").await);
    let w = a.lock("k".to_owned()).await.unwrap();
    assert!(matches!(
        b.try_lock_with("k".to_owned(), shared()).await,
        Err(ClusterLockError::WouldBlock { .. })
    ));
    let reader = {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            let r = b.lock_with("k".to_owned(), shared()).await.unwrap();
            r.unlock().await.unwrap()
        })
    };
    until_keys(&a, "k", 2).await;
    // It waits while the writer holds the key (its key is older).
    assert!(!reader.is_finished());
    let w_token = w.unlock().await.unwrap();
    let r_token = tokio::time::timeout(HANG, reader).await.unwrap().unwrap();
    assert!(r_token > w_token);
}

/// FIFO across modes: a writer waiting behind a reader blocks the readers
/// that come after it, so a stream of readers cannot starve it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_blocks_later_readers() {
    let Some(eps) = etcd_cluster::endpoints("a_waiting_writer_blocks_later_readers") else {
        return;
    };
    let prefix = etcd_cluster::prefix("rwfifo");
    let mut tables = Vec::new();
    for i in 0..3 {
        let mut mine = eps.clone();
        mine.rotate_left(i);
        tables.push(Arc::new(table(&mine, &prefix, &format!("t{i}")).await));
    }
    let r1 = tables[0].lock_with("k".to_owned(), shared()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let (held_tx, held_rx) = tokio::sync::oneshot::channel();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let writer = {
        let (t, order) = (Arc::clone(&tables[1]), Arc::clone(&order));
        tokio::spawn(async move {
            let w = t.lock("k".to_owned()).await.unwrap();
            order.lock().unwrap().push("writer");
            held_tx.send(w.token()).unwrap();
            go_rx.await.unwrap();
            w.unlock().await.unwrap();
        })
    };
    until_keys(&tables[0], "k", 2).await;
    // A later reader is refused: the writer waits ahead of it.
    assert!(matches!(
        tables[2].try_lock_with("k".to_owned(), shared()).await,
        Err(ClusterLockError::WouldBlock { .. })
    ));
    let reader = {
        let (t, order) = (Arc::clone(&tables[2]), Arc::clone(&order));
        tokio::spawn(async move {
            let r = t.lock_with("k".to_owned(), shared()).await.unwrap();
            order.lock().unwrap().push("reader");
            r.unlock().await.unwrap()
        })
    };
    until_keys(&tables[0], "k", 3).await;
    assert!(order.lock().unwrap().is_empty());
    // The first reader goes: the writer, then the later reader.
    r1.unlock().await.unwrap();
    let w_token = tokio::time::timeout(HANG, held_rx).await.unwrap().unwrap();
    assert!(
        !reader.is_finished(),
        "a reader got in while the writer held the key"
    );
    assert_eq!(*order.lock().unwrap(), vec!["writer"]);
    go_tx.send(()).unwrap();
    tokio::time::timeout(HANG, writer).await.unwrap().unwrap();
    let r_token = tokio::time::timeout(HANG, reader).await.unwrap().unwrap();
    assert!(r_token > w_token);
    assert_eq!(*order.lock().unwrap(), vec!["writer", "reader"]);
}

/// Readers and writers in three tables (each on another member) take one
/// key in turn: a writer is always alone, a reader never meets a writer,
/// and writers' tokens increase in grant order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_exclude_each_other() {
    let Some(eps) = etcd_cluster::endpoints("readers_and_writers_exclude_each_other") else {
        return;
    };
    let prefix = etcd_cluster::prefix("rwchurn");
    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let write_tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let mut mine = eps.clone();
        mine.rotate_left(i);
        let t = Arc::new(table(&mine, &prefix, &format!("t{i}")).await);
        for j in 0..3usize {
            let (t, readers, writers, write_tokens) = (
                Arc::clone(&t),
                Arc::clone(&readers),
                Arc::clone(&writers),
                Arc::clone(&write_tokens),
            );
            tasks.push(tokio::spawn(async move {
                for n in 0..12usize {
                    // Two tasks in three read: a mix that keeps readers
                    // together and writers between them.
                    if (n + j) % 3 != 0 {
                        let r = t.lock_with("k".to_owned(), shared()).await.unwrap();
                        readers.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(writers.load(Ordering::SeqCst), 0, "a reader met a writer");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        readers.fetch_sub(1, Ordering::SeqCst);
                        r.unlock().await.unwrap();
                    } else {
                        let w = t.lock("k".to_owned()).await.unwrap();
                        assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0, "two writers");
                        assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer met a reader");
                        write_tokens.lock().unwrap().push(w.token());
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        writers.fetch_sub(1, Ordering::SeqCst);
                        w.unlock().await.unwrap();
                    }
                }
            }));
        }
    }
    for task in tasks {
        tokio::time::timeout(HANG, task).await.unwrap().unwrap();
    }
    let tokens = write_tokens.lock().unwrap();
    assert_eq!(tokens.len(), 36);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_names_the_holder() {
    let Some(eps) = etcd_cluster::endpoints("timeout_names_the_holder") else {
        return;
    };
    let prefix = etcd_cluster::prefix("timeout");
    let a = table(&eps, &prefix, "holder-a").await;
    let b = table(&eps, &prefix, "waiter-b").await;
    let g = a.lock("report".to_owned()).await.unwrap();
    // Let the holder stamp its grant (done right after the grant).
    tokio::time::timeout(HANG, async {
        while a
            .holder("report")
            .await
            .unwrap()
            .unwrap()
            .held_for
            .is_none()
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    let wait = LockOptions::new().timeout(Duration::from_millis(300));
    let err = b.lock_with("report".to_owned(), wait).await.unwrap_err();
    let ClusterLockError::Timeout {
        holder: Some(h),
        ahead,
        ..
    } = &err
    else {
        panic!("not a timeout naming the holder: {err}");
    };
    assert!(
        err.to_string().contains("waiting for key \"report\""),
        "the key named: {err}"
    );
    // A lock's own label is refused: the table's labels its grants.
    let refused = b
        .lock_with("other".to_owned(), LockOptions::new().label("one-lock"))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            ClusterLockError::InvalidOptions {
                option: "label",
                ..
            }
        ),
        "{refused}"
    );
    assert_eq!(h.lease_id, g.lease_id());
    assert_eq!(h.token, g.token());
    assert_eq!(h.label.as_deref(), Some("holder-a"));
    assert_eq!(h.pid, Some(std::process::id()));
    assert!(h.held_for.is_some());
    assert_eq!(*ahead, 1);
    let msg = err.to_string();
    assert!(msg.contains(&format!("{:x}", g.lease_id())), "{msg}");
    assert!(msg.contains("held for"), "{msg}");
    // The timed-out waiter left nothing behind.
    assert_eq!(count_keys(&a, "report").await, 1);
    assert_eq!(b.stats().etcd_waiters, 0);
    drop(g);
    let g = tokio::time::timeout(HANG, b.lock("report".to_owned()))
        .await
        .unwrap()
        .unwrap();
    drop(g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_lock_and_owned_guards() {
    let Some(eps) = etcd_cluster::endpoints("try_lock_and_owned_guards") else {
        return;
    };
    let prefix = etcd_cluster::prefix("try");
    let a = Arc::new(table(&eps, &prefix, "a").await);
    let b = table(&eps, &prefix, "b").await;
    let g = Arc::clone(&a).try_lock_owned("k".to_owned()).await.unwrap();
    // Held in another table: WouldBlock naming it, nothing left in etcd.
    match b.try_lock("k".to_owned()).await {
        Err(ClusterLockError::WouldBlock {
            holder: Some(h),
            key,
        }) => {
            assert_eq!(h.token, g.token());
            assert_eq!(&*key, "\"k\"");
        }
        other => panic!("{other:?}"),
    }
    // Held in this table: WouldBlock from the in-process tier.
    assert!(matches!(
        a.try_lock("k".to_owned()).await,
        Err(ClusterLockError::WouldBlock { holder: None, .. })
    ));
    assert_eq!(count_keys(&b, "k").await, 1);
    let token = g.token();
    // An owned guard moves to another task, and is released there.
    tokio::spawn(async move { g.unlock().await.unwrap() })
        .await
        .unwrap();
    let g2 = b.try_lock("k".to_owned()).await.unwrap();
    assert!(g2.token() > token);
    assert_eq!(
        g2.fence().revision(),
        i64::try_from(g2.token().get()).unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tiers_one_waiter_key_per_table() {
    let Some(eps) = etcd_cluster::endpoints("two_tiers_one_waiter_key_per_table") else {
        return;
    };
    let prefix = etcd_cluster::prefix("tiers");
    let holder = table(&eps, &prefix, "holder").await;
    let waiters = Arc::new(table(&eps, &prefix, "waiters").await);
    let g = holder.lock("k".to_owned()).await.unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let t = Arc::clone(&waiters);
        let done = Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            let g = t.lock("k".to_owned()).await.unwrap();
            done.fetch_add(1, Ordering::SeqCst);
            drop(g);
        }));
    }
    tokio::time::timeout(HANG, async {
        while waiters.waiters("k") < 7 || count_keys(&holder, "k").await < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    // Eight callers, one waiter key: the holder's and one for the table.
    assert_eq!(count_keys(&holder, "k").await, 2);
    assert_eq!(waiters.stats().etcd_waiters, 1);
    assert_eq!(waiters.waiters("k"), 7);
    drop(g);
    for task in tasks {
        tokio::time::timeout(HANG, task).await.unwrap().unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), 8);
    tokio::time::timeout(HANG, async {
        while count_keys(&holder, "k").await > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_refuses_a_lost_grant() {
    let Some(eps) = etcd_cluster::endpoints("fence_refuses_a_lost_grant") else {
        return;
    };
    let prefix = etcd_cluster::prefix("fence");
    let a = table(&eps, &prefix, "a").await;
    let b = table(&eps, &prefix, "b").await;
    // A grant with a lease of its own, not renewed: it lapses.
    let opts = LockOptions::new().lease(Duration::from_secs(1));
    let old = a.lock_with("acct".to_owned(), opts).await.unwrap();
    assert_ne!(old.lease_id(), a.lease_id());
    let fence = old.fence();
    // b waits, and takes the key when the lease ends.
    let new = tokio::time::timeout(HANG, b.lock("acct".to_owned()))
        .await
        .unwrap()
        .unwrap();
    assert!(new.token() > old.token());
    assert!(old.check().is_err(), "the lapsed grant is fenced locally");
    assert!(old.renew().await.is_err(), "and never revived");
    let mut client = b.client().clone();
    let write = |f: keylock::etcd::Fence, v: &'static str| {
        etcd_client::Txn::new()
            .when([f.compare()])
            .and_then([etcd_client::TxnOp::put(format!("{prefix}-data"), v, None)])
    };
    assert!(!client.txn(write(fence, "late")).await.unwrap().succeeded());
    assert!(client
        .txn(write(new.fence(), "ok"))
        .await
        .unwrap()
        .succeeded());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waiter_leaves_nothing() {
    let Some(eps) = etcd_cluster::endpoints("cancelled_waiter_leaves_nothing") else {
        return;
    };
    let prefix = etcd_cluster::prefix("cancel");
    let a = table(&eps, &prefix, "a").await;
    let b = table(&eps, &prefix, "b").await;
    let g = a.lock("k".to_owned()).await.unwrap();
    {
        let mut fut = Box::pin(b.lock("k".to_owned()));
        tokio::time::timeout(HANG, async {
            loop {
                tokio::select! {
                    _ = &mut fut => panic!("granted while held"),
                    () = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
                if count_keys(&a, "k").await == 2 {
                    break;
                }
            }
        })
        .await
        .unwrap();
    } // dropped while waiting in etcd
    tokio::time::timeout(HANG, async {
        while count_keys(&a, "k").await != 1 || b.stats().etcd_waiters != 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    drop(g);
    let g = tokio::time::timeout(HANG, b.lock("k".to_owned()))
        .await
        .unwrap()
        .unwrap();
    g.unlock().await.unwrap();
}

/// Generic code written once against [`ScopedLockTable`]: counts in a shared
/// cell under the lock, and checks the tokens increase.
async fn bump_many<T>(table: &T, key: &str, counter: &Mutex<u64>, rounds: usize) -> Vec<u64>
where
    T: keylock::ScopedLockTable<String>,
{
    use keylock::ScopedGuard;
    let mut tokens = Vec::new();
    for _ in 0..rounds {
        let guard = table.lock(key.to_owned()).await.unwrap();
        assert!(
            table.try_lock(key.to_owned()).await.unwrap().is_none(),
            "a second grant while held"
        );
        assert!(!guard.is_expired());
        *counter.lock().unwrap() += 1;
        tokens.push(guard.token().get());
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_api_across_scopes() {
    let counter = Mutex::new(0);
    // In-process.
    let local = keylock::LockTable::new();
    let t1 = bump_many(&local, "acct", &counter, 3).await;
    // Across the processes of this host.
    let dir = std::env::temp_dir().join(format!("keylock-scopes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let host = keylock::ProcessLockTable::open(&dir).unwrap();
    let t2 = bump_many(&host, "acct", &counter, 3).await;
    std::fs::remove_dir_all(&dir).unwrap();
    for t in [&t1, &t2] {
        assert!(t.windows(2).all(|w| w[0] < w[1]), "{t:?}");
    }
    // Across the cluster.
    let Some(eps) = etcd_cluster::endpoints("one_api_across_scopes (cluster part)") else {
        return;
    };
    let cluster = table(&eps, &etcd_cluster::prefix("scopes"), "scopes").await;
    let t3 = bump_many(&cluster, "acct", &counter, 3).await;
    assert!(t3.windows(2).all(|w| w[0] < w[1]), "{t3:?}");
    assert_eq!(*counter.lock().unwrap(), 9);
}

/// A table whose keep-alives are far apart (a TTL of 30 s: one every 10 s),
/// so that a test can revoke its lease and act before its keep-alive task
/// could notice.
async fn slow_table(endpoints: &[String], prefix: &str, label: &str) -> ClusterLockTable<String> {
    let opts = ClusterOptions::new()
        .prefix(prefix)
        .label(label)
        .session_ttl(Duration::from_secs(30));
    ClusterLockTable::connect_with(endpoints, opts)
        .await
        .expect("connect to the test cluster")
}

/// Waits until exactly `n` waiter keys of `key` are in etcd.
async fn until_exactly(t: &ClusterLockTable<String>, key: &str, n: usize) {
    tokio::time::timeout(HANG, async {
        while count_keys(t, key).await != n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{key} never had exactly {n} waiter keys"));
}

/// The answer of a lock whose session's lease was revoked while it waited:
/// `SessionLost` naming that lease, never a grant.
fn assert_session_lost(
    r: Result<keylock::etcd::OwnedClusterGuard<String>, ClusterLockError>,
    lease: i64,
) {
    match r {
        Err(ClusterLockError::SessionLost { lease_id, .. }) => assert_eq!(lease_id, lease),
        Ok(g) => panic!(
            "a waiter whose lease {lease:x} was revoked was granted the key (token {}, \
             check() {:?})",
            g.token(),
            g.check()
        ),
        Err(e) => panic!("not SessionLost: {e}"),
    }
}

/// etcd's `TestMutexLockSessionExpired`, ported: a waiter whose session's
/// lease is revoked while it waits is not granted the key when the holder
/// lets go; it answers `SessionLost`, and its table's next lock runs on a
/// new session and takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_waiter_is_not_granted() {
    let Some(eps) = etcd_cluster::endpoints("a_revoked_waiter_is_not_granted") else {
        return;
    };
    let prefix = etcd_cluster::prefix("revoked");
    let a = table(&eps, &prefix, "a").await;
    let b = Arc::new(slow_table(&eps, &prefix, "b").await);
    let ga = a.lock("k".to_owned()).await.unwrap();
    let wb = tokio::spawn(Arc::clone(&b).lock_owned("k".to_owned()));
    until_keys(&a, "k", 2).await;
    let lease = b.lease_id();
    b.client().clone().lease_revoke(lease).await.unwrap();
    ga.unlock().await.unwrap();
    let rb = tokio::time::timeout(HANG, wb)
        .await
        .expect("the revoked waiter's lock returns")
        .unwrap();
    assert_session_lost(rb, lease);
    // The key is free, and b's next lock takes it on a new session.
    let g = tokio::time::timeout(HANG, b.lock("k".to_owned()))
        .await
        .expect("the table locks again after losing its session")
        .unwrap();
    assert_ne!(g.lease_id(), lease);
    g.check().unwrap();
    assert_eq!(count_keys(&a, "k").await, 1);
}

/// etcd's `TestMutexWaitsOnCurrentHolder`, ported: the waiter just ahead
/// of a new one loses its session (its lease is revoked) while the first
/// holder still holds the key; the new waiter waits on that holder, not on
/// the deleted predecessor, takes the key when the holder lets go, and the
/// victim's lock returns without the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_waits_on_the_current_holder() {
    let Some(eps) = etcd_cluster::endpoints("a_waiter_waits_on_the_current_holder") else {
        return;
    };
    let prefix = etcd_cluster::prefix("current");
    let first = table(&eps, &prefix, "first").await;
    let victim = Arc::new(slow_table(&eps, &prefix, "victim").await);
    let next = Arc::new(table(&eps, &prefix, "next").await);
    let g1 = first.lock("k".to_owned()).await.unwrap();
    let victim_wait = tokio::spawn(Arc::clone(&victim).lock_owned("k".to_owned()));
    until_keys(&first, "k", 2).await;
    let next_wait = tokio::spawn(Arc::clone(&next).lock_owned("k".to_owned()));
    until_keys(&first, "k", 3).await;
    let lease = victim.lease_id();
    victim.client().clone().lease_revoke(lease).await.unwrap();
    // etcd has deleted the victim's waiter key.
    until_exactly(&first, "k", 2).await;
    assert!(
        !next_wait.is_finished(),
        "the new waiter took the key while the first holder held it"
    );
    let t1 = g1.unlock().await.unwrap();
    let g = tokio::time::timeout(HANG, next_wait)
        .await
        .expect("the new waiter takes the key once the holder lets go")
        .unwrap()
        .unwrap();
    assert!(g.token() > t1);
    g.check().unwrap();
    let rv = tokio::time::timeout(HANG, victim_wait)
        .await
        .expect("the victim's lock returns once the holder lets go")
        .unwrap();
    assert_session_lost(rv, lease);
    assert_eq!(
        first.holder("k").await.unwrap().map(|h| h.token),
        Some(g.token())
    );
}

/// Issue 27, item 8: a holder, a waiter `b` whose lease is revoked, and a
/// waiter `c` behind it. When the holder lets go, `b` answers
/// `SessionLost` and `c` takes the key; never two guards that pass
/// `check()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_waiter_and_the_one_behind_it_are_never_both_granted() {
    let test = "a_revoked_waiter_and_the_one_behind_it_are_never_both_granted";
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let prefix = etcd_cluster::prefix("revoked2");
    let a = table(&eps, &prefix, "a").await;
    let b = Arc::new(slow_table(&eps, &prefix, "b").await);
    let c = Arc::new(table(&eps, &prefix, "c").await);
    let ga = a.lock("k".to_owned()).await.unwrap();
    let gb = tokio::spawn(Arc::clone(&b).lock_owned("k".to_owned()));
    until_keys(&a, "k", 2).await;
    let gc = tokio::spawn(Arc::clone(&c).lock_owned("k".to_owned()));
    until_keys(&a, "k", 3).await;
    let lease = b.lease_id();
    b.client().clone().lease_revoke(lease).await.unwrap();
    ga.unlock().await.unwrap();
    let gc = tokio::time::timeout(HANG, gc)
        .await
        .expect("c takes the key")
        .unwrap()
        .unwrap();
    let gb = tokio::time::timeout(HANG, gb)
        .await
        .expect("b's lock returns")
        .unwrap();
    assert_session_lost(gb, lease);
    gc.check().unwrap();
    // c's fence holds at the store.
    let txn = etcd_client::Txn::new()
        .when([gc.fence().compare()])
        .and_then([etcd_client::TxnOp::put(format!("{prefix}-data"), "c", None)]);
    assert!(c.client().clone().txn(txn).await.unwrap().succeeded());
}

/// A lock (here a `try_lock`, granted at once) on a session whose lease
/// was revoked answers `SessionLost`, not an etcd error, and the next
/// lock runs on a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_session_is_replaced_on_the_next_lock() {
    let Some(eps) = etcd_cluster::endpoints("a_revoked_session_is_replaced_on_the_next_lock")
    else {
        return;
    };
    let prefix = etcd_cluster::prefix("replaced");
    let b = Arc::new(slow_table(&eps, &prefix, "b").await);
    let lease = b.lease_id();
    b.client().clone().lease_revoke(lease).await.unwrap();
    match Arc::clone(&b).try_lock_owned("k".to_owned()).await {
        // The session's keep-alive (due 10 s after the grant) found the
        // lease gone first: a new session took the key, as it may.
        Ok(g) if g.lease_id() != lease => {
            eprintln!(
                "the keep-alive noticed the revoke first; the enqueue's answer was not tested"
            )
        }
        r => assert_session_lost(r, lease),
    }
    let g = tokio::time::timeout(HANG, b.try_lock("k".to_owned()))
        .await
        .expect("the next lock returns")
        .expect("the next lock runs on a new session");
    assert_ne!(g.lease_id(), lease);
    g.check().unwrap();
}

/// Options out of range are refused by `connect`, before any etcd call,
/// with an error naming the option and its range (they used to panic on
/// an instant's overflow, or to make every call fail after seconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_out_of_range_are_refused() {
    let cases = [
        (
            "session_ttl",
            ClusterOptions::new().session_ttl(Duration::MAX),
        ),
        (
            "session_ttl",
            ClusterOptions::new().session_ttl(Duration::ZERO),
        ),
        (
            "session_ttl",
            ClusterOptions::new().session_ttl(Duration::from_secs(3601)),
        ),
        (
            "request_timeout",
            ClusterOptions::new().request_timeout(Duration::MAX),
        ),
        (
            "request_timeout",
            ClusterOptions::new().request_timeout(Duration::ZERO),
        ),
    ];
    for (name, opts) in cases {
        // No etcd at this address: the options are refused before it
        // would matter.
        let r = tokio::time::timeout(
            HANG,
            ClusterLockTable::<String>::connect_with(["http://127.0.0.1:9"], opts),
        )
        .await
        .unwrap_or_else(|_| panic!("{name}: connect does not answer"));
        match r {
            Err(ClusterLockError::InvalidOptions { option, .. }) => assert_eq!(option, name),
            Err(e) => panic!("{name}: not InvalidOptions: {e}"),
            Ok(_) => panic!("{name}: accepted"),
        }
    }
    let err = ClusterLockTable::<String>::connect_with(
        ["http://127.0.0.1:9"],
        ClusterOptions::new().request_timeout(Duration::ZERO),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("request_timeout") && msg.contains("between 1ms and 3600s"),
        "{msg}"
    );
    let err = ClusterLockTable::<String>::connect_with(
        ["http://127.0.0.1:9"],
        ClusterOptions::new().session_ttl(Duration::MAX),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("session_ttl") && msg.contains("at most 3600s"),
        "{msg}"
    );
}

/// A plain `lock()` (no timeout) on a table cut off from the cluster
/// returns an error once its session cannot be kept or started (within
/// the session TTL and the request timeout), instead of waiting for ever;
/// so does the next one, which must start a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_lock_on_an_unreachable_cluster_returns() {
    let Some(eps) = etcd_cluster::endpoints("a_plain_lock_on_an_unreachable_cluster_returns")
    else {
        return;
    };
    let proxy = etcd_cluster::Proxy::start(&eps[0]);
    let opts = ClusterOptions::new()
        .prefix(etcd_cluster::prefix("unreachable"))
        .session_ttl(Duration::from_secs(2))
        .request_timeout(Duration::from_secs(1));
    let t = ClusterLockTable::connect_with([proxy.url()], opts)
        .await
        .expect("connect through the proxy");
    t.lock("a".to_owned())
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    let held = t.lock("held".to_owned()).await.unwrap();
    proxy.cut();
    let lock = |key: &'static str| {
        let t = &t;
        async move {
            let r = tokio::time::timeout(HANG, t.lock(key.to_owned()))
                .await
                .unwrap_or_else(|_| {
                    panic!("a plain lock of {key:?} on an unreachable cluster never returned")
                });
            match r {
                Err(
                    ClusterLockError::Unavailable { .. } | ClusterLockError::SessionLost { .. },
                ) => {}
                Err(e) => panic!("lock of {key:?}: not Unavailable or SessionLost: {e}"),
                Ok(_) => panic!("lock of {key:?} granted on an unreachable cluster"),
            }
        }
    };
    // While the session may still be live: the enqueue cannot be sent.
    lock("a").await;
    // Once the session is certainly lost (its guards fenced), the next lock
    // must start a new session, and cannot.
    tokio::time::timeout(HANG, async {
        while !held.is_expired() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a guard of a table cut off from the cluster is fenced");
    lock("b").await;
    drop(held);
}

/// The store's revision now (a read's header).
async fn revision_now(t: &ClusterLockTable<String>) -> i64 {
    t.client()
        .clone()
        .get("keylock-test/revision-probe", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision()
}

/// The predecessor read counts a waiter key exactly one revision older
/// than the caller's (`max_create_revision = mine - 1`): a writer's and a
/// reader's `try_lock` enqueued at the revision right after the holder's
/// are refused. (Nothing else writes to the test cluster meanwhile, so the
/// enqueue lands at holder + 1; its undo at holder + 2 confirms it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_one_revision_behind_the_holder_waits_for_it() {
    let Some(eps) = etcd_cluster::endpoints("a_waiter_one_revision_behind_the_holder_waits_for_it")
    else {
        return;
    };
    let prefix = etcd_cluster::prefix("adjacent");
    let a = table(&eps, &prefix, "a").await;
    let b = table(&eps, &prefix, "b").await;
    for shared_try in [false, true] {
        let mut adjacent = false;
        for _ in 0..20 {
            let g = a.lock("k".to_owned()).await.unwrap();
            let holder = i64::try_from(g.token().get()).unwrap();
            let opts = if shared_try {
                shared()
            } else {
                LockOptions::new()
            };
            match b.try_lock_with("k".to_owned(), opts).await {
                Err(ClusterLockError::WouldBlock { .. }) => {}
                Ok(w) => panic!(
                    "try_lock (shared: {shared_try}) granted token {} while the holder, token \
                     {holder}, holds the key",
                    w.token()
                ),
                Err(e) => panic!("{e}"),
            }
            // The enqueue at holder + 1 and its undo at holder + 2.
            adjacent = revision_now(&a).await == holder + 2;
            g.unlock().await.unwrap();
            if adjacent {
                break;
            }
        }
        assert!(
            adjacent,
            "never arranged an enqueue one revision after the holder's (something else writes)"
        );
    }
}

/// The job runner of `examples/jobs`, written once against the scope
/// traits (and run at the task and process scopes by `tests/jobs.rs`), at
/// the cluster scope: two tables, two workers each, every job delivered
/// twice; each committed exactly once, no live grant refused by the store,
/// and a stuck worker's late commit refused once its own lease ran out and
/// a newer grant took the job over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runner_at_the_cluster_scope_commits_each_job_once_and_fences_a_stuck_worker() {
    let Some(eps) = etcd_cluster::endpoints("job_runner_at_the_cluster_scope") else {
        return;
    };
    let prefix = etcd_cluster::prefix("jobs");
    let (a, b) = (
        table(&eps, &prefix, "jobs-a").await,
        table(&eps, &prefix, "jobs-b").await,
    );
    const JOBS: u64 = 12;
    let cfg = runner::Config {
        // etcd leases are whole seconds.
        lease: Duration::from_secs(3),
        interval: Duration::from_millis(500),
        steps: 8,
    };
    let feed = runner::Feed::new(JOBS, 2);
    let store = runner::Store::default();
    let workers = [&a, &a, &b, &b]
        .into_iter()
        .enumerate()
        .map(|(id, t)| runner::worker(t, id, &feed, &store, cfg));
    let done = tokio::time::timeout(HANG, futures::future::try_join_all(workers))
        .await
        .expect("the pool hung")
        .unwrap();
    runner::assert_exactly_once(&store, JOBS, &done);
    let (stuck, next) = tokio::time::timeout(
        HANG,
        runner::stale_commit_is_refused(&a, &b, &store, JOBS, Duration::from_secs(1)),
    )
    .await
    .expect("the takeover hung")
    .unwrap();
    assert!(next > stuck);
}

/// `ClusterGuard::lost` resolves when the session's lease is revoked
/// behind the table's back (its keep-alive is answered "gone"), and the
/// guard's `check()` fails with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_lost_resolves_when_the_session_lease_is_revoked() {
    let Some(eps) =
        etcd_cluster::endpoints("cluster_lost_resolves_when_the_session_lease_is_revoked")
    else {
        return;
    };
    let t = table(&eps, &etcd_cluster::prefix("lost"), "lost").await;
    let g = t.lock("k".to_owned()).await.unwrap();
    g.check().unwrap();
    t.client().clone().lease_revoke(g.lease_id()).await.unwrap();
    let why = tokio::time::timeout(HANG, g.lost())
        .await
        .expect("lost() never resolved");
    assert!(
        matches!(&why, ClusterLockError::Expired { token, key } if *token == g.token() && &**key == "\"k\""),
        "{why}"
    );
    assert!(g.check().is_err());
}

/// A grant with a lease of its own: `keep_alive` renews it on its first
/// poll (the bound moves), refuses an interval not shorter than the TTL,
/// and without renewals `lost()` resolves at the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keep_alive_renews_an_own_lease_and_lost_resolves_at_its_bound() {
    let Some(eps) = etcd_cluster::endpoints("cluster_keep_alive_renews_an_own_lease") else {
        return;
    };
    let t = table(&eps, &etcd_cluster::prefix("keep"), "keep").await;
    let opts = LockOptions::new().lease(Duration::from_secs(2));
    let g = t.lock_with("k".to_owned(), opts).await.unwrap();
    let why = g.keep_alive(Duration::from_secs(2)).await;
    assert!(
        matches!(why, ClusterLockError::InvalidOptions { .. }),
        "{why}"
    );
    let before = g.expires_at();
    {
        let keep = g.keep_alive(Duration::from_millis(500));
        let moved = async {
            while g.expires_at() <= before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::select! {
            why = keep => panic!("keep-alive failed: {why}"),
            () = moved => {}
            () = tokio::time::sleep(HANG) => panic!("the bound never moved"),
        }
    }
    // No more renewals: lost at the bound.
    let why = tokio::time::timeout(HANG, g.lost())
        .await
        .expect("lost() never resolved");
    assert!(matches!(why, ClusterLockError::Expired { .. }), "{why}");
    assert!(g.check().is_err());
}
