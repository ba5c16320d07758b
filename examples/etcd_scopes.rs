//! One generic function, three scopes: the same `transfer` runs on an
//! in-process `LockTable`, a host-wide `ProcessLockTable` and a cluster-wide
//! `ClusterLockTable` through the `ScopedLockTable` trait.
//!
//! ```sh
//! tests/etcd_cluster/cluster.sh start /tmp/keylock-etcd     # prints the endpoints
//! KEYLOCK_ETCD_ENDPOINTS=http://127.0.0.1:23791,http://127.0.0.1:23792,http://127.0.0.1:23793 \
//!     cargo run --example etcd_scopes --features etcd
//! tests/etcd_cluster/cluster.sh stop /tmp/keylock-etcd
//! ```
//!
//! Without `KEYLOCK_ETCD_ENDPOINTS` the cluster scope is skipped, loudly.

use std::collections::BTreeMap;
use std::sync::Mutex;

use keylock::{ScopedGuard, ScopedLockTable};

/// Moves `amount` from one account to another under both accounts' locks,
/// taken in one global order so that two transfers cannot deadlock.
async fn transfer<T: ScopedLockTable<String>>(
    table: &T,
    ledger: &Mutex<BTreeMap<String, i64>>,
    from: &str,
    to: &str,
    amount: i64,
) -> Result<(u64, u64), T::Error> {
    let (first, second) = if from < to { (from, to) } else { (to, from) };
    let a = table.lock(first.to_owned()).await?;
    let b = table.lock(second.to_owned()).await?;
    // Commit only while both grants still hold their keys.
    assert!(!a.is_expired() && !b.is_expired());
    let mut l = ledger.lock().unwrap();
    *l.entry(from.to_owned()).or_default() -= amount;
    *l.entry(to.to_owned()).or_default() += amount;
    Ok((a.token().get(), b.token().get()))
}

async fn run<T: ScopedLockTable<String>>(scope: &str, table: &T) -> Result<(), T::Error> {
    let ledger = Mutex::new(BTreeMap::new());
    for i in 0..5 {
        let (from, to) = if i % 2 == 0 {
            ("alice", "bob")
        } else {
            ("bob", "alice")
        };
        let tokens = transfer(table, &ledger, from, to, 10).await?;
        println!("{scope:>8}: {from} -> {to}, tokens {tokens:?}");
    }
    let total: i64 = ledger.lock().unwrap().values().sum();
    assert_eq!(total, 0, "money is conserved");
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    run("process", &keylock::LockTable::new()).await?;

    let dir = std::env::temp_dir().join(format!("keylock-example-scopes-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    run("host", &keylock::ProcessLockTable::open(&dir)?).await?;
    std::fs::remove_dir_all(&dir)?;

    match std::env::var("KEYLOCK_ETCD_ENDPOINTS") {
        Ok(eps) if !eps.is_empty() => {
            let eps: Vec<&str> = eps.split(',').collect();
            let opts = keylock::etcd::ClusterOptions::new().prefix("keylock-example");
            let table = keylock::ClusterLockTable::connect_with(eps, opts).await?;
            run("cluster", &table).await?;
        }
        _ => println!(
            "!!! SKIPPED the cluster scope: set KEYLOCK_ETCD_ENDPOINTS (see the top of this file)"
        ),
    }
    Ok(())
}
