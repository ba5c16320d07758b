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
        Err(ClusterLockError::WouldBlock { holder: Some(h) }) => assert_eq!(h.token, g.token()),
        other => panic!("{other:?}"),
    }
    // Held in this table: WouldBlock from the in-process tier.
    assert!(matches!(
        a.try_lock("k".to_owned()).await,
        Err(ClusterLockError::WouldBlock { holder: None })
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
