//! The job runner, written once against keylock's scope traits
//! (`ScopedLockTable`, `ScopedGuard`, `ScopedError`) and run unchanged at
//! the task, process and cluster scopes (`examples/jobs/main.rs`,
//! `tests/jobs.rs`, `tests/etcd.rs`).
//!
//! A pool of workers takes jobs by id from a feed that delivers each job
//! at least once (a redelivering queue: here every job comes twice). A
//! worker locks the job's key with a lease, raises the job's fence at the
//! store to its grant's token (and skips a job already done), works while
//! a keep-alive renews the lease, checks the grant and commits. The store
//! refuses a token older than the job's fence, so a worker whose grant was
//! taken over (its lease lapsed while it was stuck) cannot commit over, or
//! before, its successor's work. A worker that loses its grant mid-work
//! gives the job back to the feed.

#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{select, Either};
use keylock::{
    FencingToken, LockOptions, ScopedError, ScopedErrorKind, ScopedGuard, ScopedLockTable,
};

/// The jobs to do, each delivered at least once.
#[derive(Debug, Default)]
pub struct Feed {
    queue: Mutex<VecDeque<u64>>,
}

impl Feed {
    /// A feed of jobs `0..jobs`, each delivered `times` times.
    pub fn new(jobs: u64, times: usize) -> Self {
        let mut queue = VecDeque::new();
        for _ in 0..times {
            queue.extend(0..jobs);
        }
        Self {
            queue: Mutex::new(queue),
        }
    }

    fn next(&self) -> Option<u64> {
        self.queue.lock().unwrap().pop_front()
    }

    fn give_back(&self, job: u64) {
        self.queue.lock().unwrap().push_back(job);
    }
}

/// Why the store refused a claim or a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The token is older than the job's fence, the newest token the store
    /// has seen for it: the grant was taken over by a newer one.
    Stale {
        job: u64,
        token: FencingToken,
        newest: FencingToken,
    },
    /// The job has a commit already.
    Done { job: u64 },
}

/// One accepted commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub token: FencingToken,
    pub worker: usize,
    pub result: u64,
}

#[derive(Debug, Default)]
struct Job {
    /// The newest token seen for the job.
    fence: Option<FencingToken>,
    commits: Vec<Commit>,
}

/// A store fenced by the lock's tokens (a database row with a `fence`
/// column, written with conditional updates). A grant raises the job's
/// fence to its token when it starts (`claim`), so that a commit from any
/// older grant is refused from then on, whether it comes before or after
/// the new grant's own.
#[derive(Debug, Default)]
pub struct Store {
    jobs: Mutex<HashMap<u64, Job>>,
}

impl Store {
    fn fenced(job: u64, state: &Job, token: FencingToken) -> Result<(), Refused> {
        match state.fence {
            Some(newest) if token < newest => Err(Refused::Stale { job, token, newest }),
            _ => Ok(()),
        }
    }

    /// Raises `job`'s fence to `token`; says whether the job is done.
    pub fn claim(&self, job: u64, token: FencingToken) -> Result<bool, Refused> {
        let mut jobs = self.jobs.lock().unwrap();
        let state = jobs.entry(job).or_default();
        Self::fenced(job, state, token)?;
        state.fence = Some(token);
        Ok(!state.commits.is_empty())
    }

    /// Commits `result` for `job` under `token`: refused if a newer grant
    /// raised the fence, or the job has a commit.
    pub fn commit(
        &self,
        job: u64,
        token: FencingToken,
        worker: usize,
        result: u64,
    ) -> Result<(), Refused> {
        let mut jobs = self.jobs.lock().unwrap();
        let state = jobs.entry(job).or_default();
        Self::fenced(job, state, token)?;
        if !state.commits.is_empty() {
            return Err(Refused::Done { job });
        }
        state.fence = Some(token);
        state.commits.push(Commit {
            token,
            worker,
            result,
        });
        Ok(())
    }

    /// The commits of `job`, oldest first.
    pub fn commits(&self, job: u64) -> Vec<Commit> {
        self.jobs
            .lock()
            .unwrap()
            .get(&job)
            .map(|j| j.commits.clone())
            .unwrap_or_default()
    }
}

/// How the workers lock and keep their jobs.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// The lease of a job's grant.
    pub lease: Duration,
    /// How often a working worker renews it.
    pub interval: Duration,
    /// How many steps a job's work takes (each yields to the executor).
    pub steps: u32,
}

/// What one worker did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// Jobs it committed.
    pub committed: usize,
    /// Deliveries of jobs found done already.
    pub skipped: usize,
    /// Jobs given back: its grant was lost mid-work, or the store refused.
    pub given_back: usize,
    /// Refusals by the store while the worker's grant still passed
    /// `check()`: a newer grant of the job existed beside a live one. The
    /// lock's exclusion makes this zero at every scope.
    pub overlaps: usize,
}

/// The key of a job.
pub fn key(job: u64) -> String {
    format!("job-{job}")
}

/// The work: `steps` yields, then an answer.
async fn work(job: u64, steps: u32) -> u64 {
    for _ in 0..steps {
        YieldNow(false).await;
    }
    job * 2
}

/// One worker: takes jobs from `feed` until it is empty.
pub async fn worker<T: ScopedLockTable<String>>(
    table: &T,
    id: usize,
    feed: &Feed,
    store: &Store,
    cfg: Config,
) -> Result<Done, T::Error> {
    let mut done = Done::default();
    while let Some(job) = feed.next() {
        let opts = LockOptions::new().lease(cfg.lease);
        let guard = table.lock_with(key(job), opts).await?;
        match store.claim(job, guard.token()) {
            Ok(false) => {}
            Ok(true) => {
                done.skipped += 1;
                continue;
            }
            Err(Refused::Stale { .. } | Refused::Done { .. }) => {
                // A newer grant of the job exists: ours lost it already.
                done.overlaps += usize::from(guard.check().is_ok());
                done.given_back += 1;
                continue;
            }
        }
        let keep = guard.keep_alive(cfg.interval, cfg.lease);
        let result = match select(pin!(work(job, cfg.steps)), pin!(keep)).await {
            Either::Left((result, _)) => result,
            Either::Right((why, _)) => {
                if why.kind() == ScopedErrorKind::InvalidOptions {
                    return Err(why);
                }
                // Lost mid-work: someone else will do it.
                feed.give_back(job);
                done.given_back += 1;
                continue;
            }
        };
        // The commit-time fence: the grant's token, if it still holds.
        let token = match guard.check() {
            Ok(token) => token,
            Err(_) => {
                feed.give_back(job);
                done.given_back += 1;
                continue;
            }
        };
        match store.commit(job, token, id, result) {
            Ok(()) => done.committed += 1,
            Err(Refused::Stale { .. } | Refused::Done { .. }) => {
                // A newer grant has the job: nothing to redo.
                done.overlaps += usize::from(guard.check().is_ok());
                done.given_back += 1;
            }
        }
    }
    Ok(done)
}

/// A worker stuck past its lease (locking through `stuck_on`) is taken
/// over by another (locking through `next_on`: another process's table,
/// or the same one), and its late commit is refused by the store: the
/// fence, at any scope. Returns the stuck grant's token and its
/// successor's.
///
/// (At the cluster scope the successor must lock through another table:
/// a table's own callers queue behind its guards, lapsed or not, until
/// they are dropped.)
pub async fn stale_commit_is_refused<T: ScopedLockTable<String>>(
    stuck_on: &T,
    next_on: &T,
    store: &Store,
    job: u64,
    short: Duration,
) -> Result<(FencingToken, FencingToken), T::Error> {
    let stuck = stuck_on
        .lock_with(key(job), LockOptions::new().lease(short))
        .await?;
    assert_eq!(store.claim(job, stuck.token()), Ok(false));
    // It renews nothing: its lease lapses, and `lost` says so.
    let why = stuck.lost().await;
    assert_eq!(why.kind(), ScopedErrorKind::Expired, "{why}");
    assert!(stuck.check().is_err(), "a lost grant passes check()");
    // Another worker takes the job over and commits it.
    let next = next_on
        .lock_with(key(job), LockOptions::new().lease(short * 30))
        .await?;
    assert!(next.token() > stuck.token());
    assert_eq!(store.claim(job, next.token()), Ok(false));
    store
        .commit(job, next.check()?, 1, job * 2)
        .expect("the newest grant's commit is accepted");
    // The stuck worker wakes up and commits without checking: refused.
    let late = store.commit(job, stuck.token(), 0, 0);
    assert_eq!(
        late,
        Err(Refused::Stale {
            job,
            token: stuck.token(),
            newest: next.token(),
        })
    );
    Ok((stuck.token(), next.token()))
}

/// Checks a run of `jobs` jobs: each committed exactly once, with the
/// answer, and no worker refused by the store while its grant was live.
pub fn assert_exactly_once(store: &Store, jobs: u64, done: &[Done]) {
    let overlaps: usize = done.iter().map(|d| d.overlaps).sum();
    assert_eq!(overlaps, 0, "two live grants of one job: {done:?}");
    for job in 0..jobs {
        let commits = store.commits(job);
        assert_eq!(commits.len(), 1, "job {job} committed {commits:?}");
        assert_eq!(commits[0].result, job * 2);
    }
}

/// Yields once to the executor (runtime-agnostic).
struct YieldNow(bool);

impl Future for YieldNow {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
