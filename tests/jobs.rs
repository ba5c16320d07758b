//! The job runner of `examples/jobs`, written once against the scope
//! traits, run here at the task scope (`LockTable`) and the process scope
//! (`ProcessLockTable`, two tables on one directory, as two processes
//! would open it); `tests/etcd.rs` runs it at the cluster scope. Each run
//! asserts that every job is committed exactly once, that the store never
//! refused a worker whose grant was live (two live grants of one job), and
//! that it refuses a stuck worker's token once a newer grant took the job
//! over.
//! No assertion depends on timing: `HANG` only keeps a broken build from
//! hanging.

#[path = "../examples/jobs/runner.rs"]
mod runner;

use std::time::Duration;

use keylock::{LockTable, ScopedLockTable};
use runner::{Config, Done, Feed, Store};

const HANG: Duration = Duration::from_secs(60);
const JOBS: u64 = 40;

fn config() -> Config {
    Config {
        lease: Duration::from_millis(400),
        interval: Duration::from_millis(50),
        steps: 16,
    }
}

/// Runs the pool, two workers per table, then the stale commit.
async fn run<T: ScopedLockTable<String>>(tables: &[&T]) -> Vec<Done> {
    let feed = Feed::new(JOBS, 2);
    let store = Store::default();
    let workers = tables
        .iter()
        .flat_map(|t| [*t, *t])
        .enumerate()
        .map(|(id, table)| runner::worker(table, id, &feed, &store, config()));
    let done = tokio::time::timeout(HANG, futures::future::try_join_all(workers))
        .await
        .expect("the pool hung")
        .unwrap();
    runner::assert_exactly_once(&store, JOBS, &done);
    let (stuck, next) = tokio::time::timeout(
        HANG,
        runner::stale_commit_is_refused(
            tables[0],
            tables[tables.len() - 1],
            &store,
            JOBS,
            Duration::from_millis(30),
        ),
    )
    .await
    .expect("the takeover hung")
    .unwrap();
    assert!(next > stuck);
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runner_at_the_task_scope_commits_each_job_once_and_fences_a_stuck_worker() {
    let table = LockTable::new();
    let done = run(&[&table, &table]).await;
    assert_eq!(
        done.iter().map(|d| d.committed).sum::<usize>(),
        JOBS as usize
    );
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_runner_at_the_process_scope_commits_each_job_once_and_fences_a_stuck_worker() {
    let dir = std::env::temp_dir().join(format!("keylock-jobs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let a = keylock::ProcessLockTable::open(&dir).unwrap();
    let b = keylock::ProcessLockTable::open(&dir).unwrap();
    let done = run(&[&a, &b]).await;
    assert_eq!(
        done.iter().map(|d| d.committed).sum::<usize>(),
        JOBS as usize
    );
    drop((a, b));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The store itself: a token older than the job's fence is refused, for a
/// claim and for a commit; a second commit of a job is refused.
#[test]
fn the_store_refuses_stale_tokens_and_second_commits() {
    use keylock::FencingToken;
    use runner::Refused;
    let t = |n| FencingToken::new(n).unwrap();
    let store = Store::default();
    assert_eq!(store.claim(1, t(5)), Ok(false));
    assert_eq!(
        store.claim(1, t(4)),
        Err(Refused::Stale {
            job: 1,
            token: t(4),
            newest: t(5)
        })
    );
    assert_eq!(store.claim(1, t(7)), Ok(false));
    assert_eq!(
        store.commit(1, t(5), 0, 2),
        Err(Refused::Stale {
            job: 1,
            token: t(5),
            newest: t(7)
        })
    );
    assert_eq!(store.commit(1, t(7), 1, 2), Ok(()));
    assert_eq!(store.commit(1, t(8), 2, 2), Err(Refused::Done { job: 1 }));
    assert_eq!(store.claim(1, t(9)), Ok(true));
    assert_eq!(store.commits(1).len(), 1);
}
