//! A job runner written once (`runner.rs`) against keylock's scope traits
//! and run at every scope: tasks of one process (`LockTable`), the
//! processes of a host (`ProcessLockTable`, Linux) and, with the `etcd`
//! feature and a cluster, the machines of a cluster (`ClusterLockTable`).
//!
//! ```sh
//! cargo run --example jobs
//! # and at the cluster scope too:
//! tests/etcd_cluster/cluster.sh start /tmp/keylock-etcd     # prints the endpoints
//! KEYLOCK_ETCD_ENDPOINTS=http://127.0.0.1:23791,http://127.0.0.1:23792,http://127.0.0.1:23793 \
//!     cargo run --example jobs --features etcd
//! tests/etcd_cluster/cluster.sh stop /tmp/keylock-etcd
//! ```
//!
//! Each run: four workers take 20 jobs (each delivered twice) with a lease
//! kept alive while they work, commit to a store fenced by the grant's
//! token, and every job is committed exactly once; then a worker stuck
//! past its lease is taken over, and its late commit is refused.

mod runner;

use std::time::Duration;

use keylock::ScopedLockTable;
use runner::{Config, Feed, Store};

const JOBS: u64 = 20;

/// Runs the pool on `tables` (two workers per table), then the stale
/// commit, and prints what happened.
async fn run<T: ScopedLockTable<String>>(
    scope: &str,
    tables: &[&T],
    cfg: Config,
) -> Result<(), T::Error> {
    let feed = Feed::new(JOBS, 2);
    let store = Store::default();
    let workers = tables
        .iter()
        .flat_map(|t| [*t, *t])
        .enumerate()
        .map(|(id, table)| runner::worker(table, id, &feed, &store, cfg));
    let done = futures::future::try_join_all(workers).await?;
    runner::assert_exactly_once(&store, JOBS, &done);
    let committed: usize = done.iter().map(|d| d.committed).sum();
    println!(
        "{scope:>8}: {committed} jobs committed once each by {} workers ({:?})",
        done.len(),
        done.iter().map(|d| d.committed).collect::<Vec<_>>()
    );
    let (stuck, next) = runner::stale_commit_is_refused(
        tables[0],
        tables[tables.len() - 1],
        &store,
        JOBS,
        cfg.lease,
    )
    .await?;
    println!(
        "{scope:>8}: a stuck worker's commit with token {stuck} refused after {next} took over"
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = Config {
        lease: Duration::from_millis(500),
        interval: Duration::from_millis(100),
        steps: 20,
    };
    let local = keylock::LockTable::new();
    run("task", &[&local, &local], cfg).await?;

    #[cfg(target_os = "linux")]
    {
        // Two tables on one directory: as two processes would open it.
        let dir = std::env::temp_dir().join(format!("keylock-example-jobs-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let a = keylock::ProcessLockTable::open(&dir)?;
        let b = keylock::ProcessLockTable::open(&dir)?;
        run("process", &[&a, &b], cfg).await?;
        drop((a, b));
        std::fs::remove_dir_all(&dir)?;
    }

    cluster(cfg).await
}

#[cfg(feature = "etcd")]
async fn cluster(cfg: Config) -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("KEYLOCK_ETCD_ENDPOINTS") {
        Ok(eps) if !eps.is_empty() => {
            let eps: Vec<&str> = eps.split(',').collect();
            let prefix = format!("keylock-example-jobs-{}", std::process::id());
            let opts = || keylock::etcd::ClusterOptions::new().prefix(prefix.clone());
            let a = keylock::ClusterLockTable::connect_with(eps.clone(), opts()).await?;
            let b = keylock::ClusterLockTable::connect_with(eps, opts()).await?;
            // etcd leases are whole seconds.
            let cfg = Config {
                lease: Duration::from_secs(2),
                interval: Duration::from_millis(500),
                ..cfg
            };
            run("cluster", &[&a, &b], cfg).await?;
        }
        _ => println!(
            "!!! SKIPPED the cluster scope: set KEYLOCK_ETCD_ENDPOINTS (see the top of this file)"
        ),
    }
    Ok(())
}

#[cfg(not(feature = "etcd"))]
async fn cluster(_: Config) -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "!!! SKIPPED the cluster scope: build with --features etcd (see the top of this file)"
    );
    Ok(())
}
