//! One lock table shared by a tokio runtime, async-std tasks and a plain
//! thread at the same time, with a lease and a fencing check at commit.
//!
//! Run with `cargo run --example demo`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keylock::{LockOptions, LockTable};

/// A pretend store that refuses a write fenced by a token older than one it
/// has already seen for that record.
#[derive(Default)]
struct Store {
    highest_token: Mutex<HashMap<String, u64>>,
}

impl Store {
    fn write(&self, record: &str, token: u64) {
        let mut highest = self.highest_token.lock().expect("store");
        let seen = highest.entry(record.to_string()).or_insert(0);
        assert!(token > *seen, "a stale holder tried to write {record}");
        *seen = token;
    }
}

fn main() {
    let table: Arc<LockTable<String>> = Arc::new(LockTable::new());
    let store = Arc::new(Store::default());
    let opts = LockOptions::new()
        .lease(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));

    // tokio: 4 tasks on a multi-thread runtime.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let tokio_side = {
        let (table, store) = (table.clone(), store.clone());
        std::thread::spawn(move || {
            rt.block_on(async {
                let tasks: Vec<_> = (0..4)
                    .map(|i| {
                        let (table, store) = (table.clone(), store.clone());
                        tokio::spawn(async move {
                            for _ in 0..250 {
                                let guard = table
                                    .clone()
                                    .lock_owned_with(format!("account-{}", i % 2), opts)
                                    .await
                                    .expect("lock within 10 s");
                                // Commit only while the lease is live.
                                if let Ok(token) = guard.check() {
                                    store.write(guard.key(), token.get());
                                }
                                tokio::task::yield_now().await;
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task");
                }
            });
        })
    };

    // async-std: 2 tasks.
    let async_std_side = {
        let (table, store) = (table.clone(), store.clone());
        std::thread::spawn(move || {
            async_std::task::block_on(async {
                let tasks: Vec<_> = (0..2)
                    .map(|_| {
                        let (table, store) = (table.clone(), store.clone());
                        async_std::task::spawn(async move {
                            for _ in 0..250 {
                                let guard = table.lock("account-0".to_string()).await;
                                store.write(guard.key(), guard.token().get());
                                async_std::task::yield_now().await;
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await;
                }
            });
        })
    };

    // A plain thread, parking while it waits.
    let thread_side = {
        let (table, store) = (table.clone(), store.clone());
        std::thread::spawn(move || {
            for _ in 0..250 {
                let guard = table.blocking_lock("account-1".to_string());
                store.write(guard.key(), guard.token().get());
            }
        })
    };

    for side in [tokio_side, async_std_side, thread_side] {
        side.join().expect("side finished");
    }

    let stats = table.stats();
    println!("acquisitions: {}", stats.acquisitions);
    println!("contended:    {}", stats.contended);
    println!("handoffs:     {}", stats.handoffs);
    println!("keys left:    {} (idle keys take no memory)", table.len());
    assert_eq!(stats.acquisitions, 4 * 250 + 2 * 250 + 250);
    assert!(table.is_empty());
}
