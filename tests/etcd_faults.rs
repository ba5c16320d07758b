//! The cluster scope under faults, against a real etcd cluster: a holder
//! process killed with SIGKILL, a member and the leader killed and
//! restarted, a holder cut from the cluster, every member killed and
//! restarted, and a history check of fenced critical sections across
//! worker processes with kills.
//!
//! Needs the `etcd` feature, `KEYLOCK_ETCD_ENDPOINTS` and `KEYLOCK_ETCD_DIR`
//! (see `tests/etcd_cluster/`); run serially (`--test-threads 1`): the
//! tests kill members of the shared cluster. Assertions are on
//! outcomes; durations only bound hangs.

#![cfg(all(feature = "etcd", target_os = "linux"))]

mod etcd_cluster;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keylock::etcd::{ClusterLockTable, ClusterOptions};
use keylock::LockOptions;

/// The session TTL of the test tables: long enough that a keep-alive
/// delayed by a busy machine (or a member being killed) does not lose the
/// session; short enough that a dead holder's key is taken over soon.
const SESSION_TTL: u64 = 4;

const HANG: Duration = Duration::from_secs(90);

/// Kills the child holder if the test fails before it does.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn table(endpoints: &[String], prefix: &str, label: &str) -> ClusterLockTable<String> {
    let opts = ClusterOptions::new()
        .prefix(prefix)
        .label(label)
        .session_ttl(Duration::from_secs(SESSION_TTL));
    // The cluster may still be electing a leader after an earlier test
    // killed a member: connect again until it answers (for up to `HANG`).
    let give_up = tokio::time::Instant::now() + HANG;
    loop {
        match ClusterLockTable::connect_with(endpoints, opts.clone()).await {
            Ok(table) => return table,
            Err(err) if tokio::time::Instant::now() < give_up => {
                eprintln!("{label}: the test cluster did not answer yet ({err}); connecting again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("connect to the test cluster: {err:?}"),
        }
    }
}

/// The child half of `sigkill_frees_the_key_after_the_ttl`: takes the key
/// named by `KEYLOCK_ETCD_CHILD_KEY` under `KEYLOCK_ETCD_CHILD_PREFIX`,
/// prints its token, and holds it until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_holder() {
    let (Ok(prefix), Ok(key)) = (
        std::env::var("KEYLOCK_ETCD_CHILD_PREFIX"),
        std::env::var("KEYLOCK_ETCD_CHILD_KEY"),
    ) else {
        return; // not run as a child: nothing to do
    };
    let Some(eps) = etcd_cluster::endpoints("child_holder") else {
        return;
    };
    let t = table(&eps, &prefix, "child").await;
    let g = t.lock(key).await.unwrap();
    println!("HELD {}", g.token().get());
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_frees_the_key_after_the_ttl() {
    let Some(eps) = etcd_cluster::endpoints("sigkill_frees_the_key_after_the_ttl") else {
        return;
    };
    let prefix = etcd_cluster::prefix("sigkill");
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "child_holder",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KEYLOCK_ETCD_CHILD_PREFIX", &prefix)
            .env("KEYLOCK_ETCD_CHILD_KEY", "job")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    // libtest prints "test child_holder ... " on the same line first.
    let child_token: u64 = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended early"
        );
        if let Some(at) = line.find("HELD ") {
            break line[at + "HELD ".len()..].trim().parse().unwrap();
        }
    };
    let t = table(&eps, &prefix, "parent").await;
    let h = t
        .holder("job")
        .await
        .unwrap()
        .expect("the child holds the key");
    assert_eq!(h.token.get(), child_token);
    assert_eq!(h.pid, Some(child.0.id()));
    // SIGKILL: no release, no lease revoke; only the TTL frees the key.
    // SAFETY: kill(2) on the child's pid, which we have not reaped.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGKILL) }, 0);
    child.0.wait().unwrap();
    let g = tokio::time::timeout(HANG, t.lock("job".to_owned()))
        .await
        .expect("taken over after the dead holder's TTL")
        .unwrap();
    assert!(g.token().get() > child_token);
    assert!(g.check().is_ok());
}

/// The member (1, 2 or 3) that leads the cluster now, asked again (for up
/// to `HANG`) while the cluster has none or a member does not answer.
async fn leader(eps: &[String]) -> u32 {
    let give_up = tokio::time::Instant::now() + HANG;
    loop {
        if let Some(n) = leader_once(eps).await {
            return n;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "the cluster has no leader"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn leader_once(eps: &[String]) -> Option<u32> {
    let mut c = etcd_client::Client::connect(eps, None).await.ok()?;
    let leader = c.status().await.ok()?.leader();
    let members = c.member_list().await.ok()?;
    let m = members.members().iter().find(|m| m.id() == leader)?;
    m.name()[1..].parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_killed_and_restarted_keeps_exclusion() {
    churn_through_a_restart("member_killed_and_restarted_keeps_exclusion", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_and_restarted_keeps_exclusion() {
    churn_through_a_restart("leader_killed_and_restarted_keeps_exclusion", true).await;
}

/// Six callers in three tables (each preferring another member) keep
/// taking one key while a member (member 1, or the leader) is killed and
/// restarted: no two hold it at once, tokens increase in grant order, and
/// the key keeps changing hands.
async fn churn_through_a_restart(test: &str, kill_leader: bool) {
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let Some(dir) = etcd_cluster::cluster_dir(test) else {
        return;
    };
    let prefix = etcd_cluster::prefix("member");
    // Each table prefers another member (the first endpoint it is given).
    let mut tables = Vec::new();
    for i in 0..3 {
        let mut mine = eps.clone();
        mine.rotate_left(i);
        tables.push(Arc::new(table(&mine, &prefix, &format!("t{i}")).await));
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in &tables {
        for _ in 0..2 {
            let (t, inside, tokens, stop) = (
                Arc::clone(t),
                Arc::clone(&inside),
                Arc::clone(&tokens),
                Arc::clone(&stop),
            );
            tasks.push(tokio::spawn(async move {
                let mut n = 0;
                while stop.load(Ordering::SeqCst) == 0 || n < 3 {
                    let g = t.lock("k".to_owned()).await.unwrap();
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders at once"
                    );
                    tokens.lock().unwrap().push(g.token());
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(g);
                    n += 1;
                }
            }));
        }
    }
    let wait_for = |n: usize| {
        let tokens = Arc::clone(&tokens);
        async move {
            tokio::time::timeout(HANG, async {
                while tokens.lock().unwrap().len() < n {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("the lock keeps being handed over");
        }
    };
    wait_for(10).await;
    // Kill the member (some table's first endpoint) and let the lock keep
    // changing hands without it.
    let victim = if kill_leader { leader(&eps).await } else { 1 };
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || etcd_cluster::member("kill", &dir2, victim))
        .await
        .unwrap();
    let before = tokens.lock().unwrap().len();
    wait_for(before + 20).await;
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || etcd_cluster::member("restart", &dir2, victim))
        .await
        .unwrap();
    let before = tokens.lock().unwrap().len();
    wait_for(before + 10).await;
    stop.store(1, Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(HANG, task).await.unwrap().unwrap();
    }
    let tokens = tokens.lock().unwrap();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens in grant order: {tokens:?}"
    );
    let retries: u64 = tables
        .iter()
        .map(|t| t.stats().retries_refused + t.stats().retries_ambiguous)
        .sum();
    eprintln!(
        "member {victim} killed and restarted: {} grants, {retries} etcd calls retried",
        tokens.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_cut_from_the_cluster_is_fenced_before_the_takeover() {
    let test = "holder_cut_from_the_cluster_is_fenced_before_the_takeover";
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let Some(dir) = etcd_cluster::cluster_dir(test) else {
        return;
    };
    let prefix = etcd_cluster::prefix("cut");
    // The holder talks to member 2 only; the waiter to members 1 and 3.
    let holder = table(&eps[1..2], &prefix, "cut-off").await;
    let waiter = table(&[eps[0].clone(), eps[2].clone()], &prefix, "waiter").await;
    let old = holder.lock("k".to_owned()).await.unwrap();
    let old_fence = old.fence();
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || etcd_cluster::member("kill", &dir2, 2))
        .await
        .unwrap();
    // The holder's keep-alives now fail; its lease expires; the waiter
    // takes the key over.
    let new = tokio::time::timeout(HANG, waiter.lock("k".to_owned()))
        .await
        .expect("taken over after the cut-off holder's TTL")
        .unwrap();
    assert!(new.token() > old.token());
    // By then the cut-off holder has fenced itself, with no round trip ...
    assert!(old.check().is_err(), "two accepted holders");
    // ... and etcd refuses its fence.
    let mut c = waiter.client().clone();
    let txn = |f: keylock::etcd::Fence| {
        etcd_client::Txn::new()
            .when([f.compare()])
            .and_then([etcd_client::TxnOp::put(format!("{prefix}-data"), "x", None)])
    };
    assert!(!c.txn(txn(old_fence)).await.unwrap().succeeded());
    assert!(c.txn(txn(new.fence())).await.unwrap().succeeded());
    // While cut off, a lock with a timeout fails (its session is lost and
    // a new one cannot be started) instead of hanging.
    let wait = LockOptions::new().timeout(Duration::from_secs(1));
    let cut = tokio::time::timeout(HANG, holder.lock_with("other".to_owned(), wait))
        .await
        .expect("a lock with a timeout returns while etcd cannot be reached");
    assert!(cut.is_err());
    drop(new);
    // Its release frees nothing of the successor's (the compare fails) and
    // lets the table's in-process tier go.
    drop(old);
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || etcd_cluster::member("restart", &dir2, 2))
        .await
        .unwrap();
    // The holder's next lock runs on a new session.
    let again = tokio::time::timeout(HANG, holder.lock("k".to_owned()))
        .await
        .expect("the cut-off table locks again once its member is back")
        .unwrap();
    assert!(again.check().is_ok());
}

/// A small seeded generator (splitmix64), so that a failing history
/// check's schedule can be replayed from the seed it prints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi` (`hi > lo`).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

fn unix_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// How many keys the history check's workers share.
const HISTORY_KEYS: u64 = 3;

/// The worker of `history_check`: critical sections on random keys
/// `h0`..`h2` under `KEYLOCK_ETCD_HISTORY_PREFIX` until the wall clock
/// passes `KEYLOCK_ETCD_HISTORY_UNTIL` (ns since the epoch), each a
/// read-modify-write of the key's counter committed by an etcd transaction
/// that compares the grant's fence. Prints one line per accepted section,
/// `ACCEPT key token read_revision commit_revision value` (the revisions
/// are etcd's: of the counter's read and of the committing transaction),
/// and `UNKNOWN key` for a commit whose answer was lost (it may have been
/// applied).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_worker() {
    let (Ok(prefix), Ok(until), Ok(seed)) = (
        std::env::var("KEYLOCK_ETCD_HISTORY_PREFIX"),
        std::env::var("KEYLOCK_ETCD_HISTORY_UNTIL"),
        std::env::var("KEYLOCK_ETCD_HISTORY_WORKER_SEED"),
    ) else {
        return; // not run as a worker
    };
    let Some(eps) = etcd_cluster::endpoints("history_worker") else {
        return;
    };
    let until: u128 = until.parse().unwrap();
    let mut rng = Rng(seed.parse().unwrap());
    let mut mine = eps.clone();
    mine.rotate_left(rng.range(0, eps.len() as u64) as usize);
    let t = table(&mine, &prefix, "history").await;
    let mut c = t.client().clone();
    while unix_ns() < until {
        let key = format!("h{}", rng.range(0, HISTORY_KEYS));
        let Ok(g) = t.lock(key.clone()).await else {
            // A lost session (a member or the leader down): the next lock
            // starts a new one.
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let counter = format!("{prefix}-counter/{key}");
        let Ok(read) = c.get(counter.clone(), None).await else {
            continue;
        };
        let read_rev = read.header().unwrap().revision();
        let v: u64 = read
            .kvs()
            .first()
            .map_or(0, |kv| kv.value_str().unwrap().parse().unwrap());
        tokio::time::sleep(Duration::from_micros(rng.range(0, 3000))).await;
        let txn = etcd_client::Txn::new()
            .when([g.fence().compare()])
            .and_then([etcd_client::TxnOp::put(counter, (v + 1).to_string(), None)]);
        match c.txn(txn).await {
            Ok(resp) if resp.succeeded() => {
                let commit_rev = resp.header().unwrap().revision();
                println!(
                    "ACCEPT {key} {} {read_rev} {commit_rev} {}",
                    g.token().get(),
                    v + 1
                );
            }
            Ok(_) => {} // refused by the fence: not applied
            Err(_) => println!("UNKNOWN {key}"),
        }
        if rng.range(0, 4) == 0 {
            tokio::time::sleep(Duration::from_micros(rng.range(0, 2000))).await;
        }
        drop(g);
    }
}

/// Restarts the member a test killed if the test fails before it does, so
/// that the tests after it find the whole cluster.
struct RestartOnDrop {
    dir: std::path::PathBuf,
    member: Option<u32>,
}

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if let Some(n) = self.member.take() {
            if !etcd_cluster::try_member("restart", &self.dir, n) {
                eprintln!("!!! member {n} could not be restarted");
            }
        }
    }
}

/// What the history check does at a point of its schedule.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL a running worker (picked at random) ...
    KillWorker,
    /// ... and start a new one.
    StartWorker,
    /// Kill and restart a member that does not lead.
    RestartFollower,
    /// Kill the member that leads ...
    KillLeader,
    /// ... and restart it.
    RestartLeader,
}

/// A Jepsen-style history check: worker processes (the test binary
/// re-invoked) take three keys at random for `HISTORY_RUN`, each critical
/// section a read-modify-write of the key's counter committed by a
/// transaction that compares the grant's fence; meanwhile, on a seeded
/// random schedule, workers are killed with SIGKILL and replaced, a
/// follower is killed and restarted, and the leader is killed and
/// restarted. Checked on etcd's own order (revisions, no clocks): per key,
/// in commit order, tokens increase, each section's read follows the
/// previous section's commit (no overlap), the values written increase (no
/// lost update), and the counter exceeds the number of accepted sections
/// by at most the commits whose outcome is unknown (a killed worker's last
/// section, a commit whose answer was lost).
/// `KEYLOCK_ETCD_HISTORY_SEED=N` replays a schedule (the times, the faults,
/// the workers killed and their keys; which members go down depends on
/// which one leads at the time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_check() {
    const HISTORY_RUN: Duration = Duration::from_secs(30);
    const WORKERS: usize = 4;
    const WORKER_KILLS: usize = 6;
    let test = "history_check";
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let Some(dir) = etcd_cluster::cluster_dir(test) else {
        return;
    };
    let seed: u64 = std::env::var("KEYLOCK_ETCD_HISTORY_SEED").map_or_else(
        |_| (unix_ns() as u64) ^ u64::from(std::process::id()),
        |s| s.parse().unwrap(),
    );
    let ctx = format!("history_check seed {seed} (KEYLOCK_ETCD_HISTORY_SEED={seed} replays it)");
    eprintln!("{ctx}");
    let mut rng = Rng(seed);
    let prefix = etcd_cluster::prefix("history");
    let until = unix_ns() + HISTORY_RUN.as_nanos();
    let mut spawned = 0u64;
    let mut spawn = || {
        spawned += 1;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "history_worker",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KEYLOCK_ETCD_HISTORY_PREFIX", &prefix)
            .env("KEYLOCK_ETCD_HISTORY_UNTIL", until.to_string())
            .env(
                "KEYLOCK_ETCD_HISTORY_WORKER_SEED",
                (seed ^ spawned.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_string(),
            )
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| {
                    l.find("ACCEPT ")
                        .or_else(|| l.find("UNKNOWN "))
                        .map(|at| l[at..].to_owned())
                })
                .collect::<Vec<_>>()
        });
        (KillOnDrop(child), reader)
    };
    // The schedule, in ms from the start.
    let run_ms = HISTORY_RUN.as_millis() as u64;
    let mut schedule = Vec::new();
    for _ in 0..WORKER_KILLS {
        let at = rng.range(1_000, run_ms - 4_000);
        schedule.push((at, Fault::KillWorker));
        schedule.push((at + rng.range(0, 1_500), Fault::StartWorker));
    }
    schedule.push((rng.range(3_000, run_ms / 3), Fault::RestartFollower));
    let leader_at = rng.range(run_ms / 2 - 2_000, run_ms / 2 + 4_000);
    schedule.push((leader_at, Fault::KillLeader));
    schedule.push((leader_at + rng.range(500, 2_500), Fault::RestartLeader));
    schedule.sort_by_key(|&(at, _)| at);
    eprintln!("{ctx}: schedule (ms, fault) {schedule:?}");

    let started = tokio::time::Instant::now();
    let mut running: Vec<_> = (0..WORKERS).map(|_| spawn()).collect();
    let mut done = Vec::new();
    let mut killed_workers = 0;
    let mut killed_leader = RestartOnDrop {
        dir: dir.clone(),
        member: None,
    };
    let mut member_faults = Vec::new();
    for (at, fault) in schedule {
        tokio::time::sleep_until(started + Duration::from_millis(at)).await;
        match fault {
            // (Kills that bunch up before their replacements start leave
            // one worker running at least.)
            Fault::KillWorker if running.len() > 1 => {
                let w = running.remove(rng.range(0, running.len() as u64) as usize);
                // SAFETY: kill(2) on our own child's pid, not yet reaped.
                unsafe { libc::kill(w.0 .0.id() as i32, libc::SIGKILL) };
                killed_workers += 1;
                done.push(w);
            }
            Fault::KillWorker => {}
            Fault::StartWorker => running.push(spawn()),
            Fault::RestartFollower => {
                let leader = leader(&eps).await;
                let n = [1, 2, 3]
                    .into_iter()
                    .filter(|&m| m != leader)
                    .nth(rng.range(0, 2) as usize)
                    .unwrap();
                let dir2 = dir.clone();
                tokio::task::spawn_blocking(move || {
                    etcd_cluster::member("kill", &dir2, n);
                    etcd_cluster::member("restart", &dir2, n);
                })
                .await
                .unwrap();
                member_faults.push(format!("follower {n} restarted"));
            }
            Fault::KillLeader => {
                let n = leader(&eps).await;
                let dir2 = dir.clone();
                tokio::task::spawn_blocking(move || etcd_cluster::member("kill", &dir2, n))
                    .await
                    .unwrap();
                killed_leader.member = Some(n);
            }
            Fault::RestartLeader => {
                let n = killed_leader
                    .member
                    .take()
                    .expect("the leader was killed first");
                let dir2 = dir.clone();
                tokio::task::spawn_blocking(move || etcd_cluster::member("restart", &dir2, n))
                    .await
                    .unwrap();
                member_faults.push(format!("leader {n} killed and restarted"));
            }
        }
    }
    done.extend(running);
    let mut lines = Vec::new();
    for (mut child, reader) in done {
        let status = tokio::task::spawn_blocking(move || {
            let s = child.0.wait().unwrap();
            (s, reader.join().unwrap())
        });
        let (_, out) = tokio::time::timeout(HANG, status)
            .await
            .unwrap_or_else(|_| panic!("{ctx}: a worker did not finish"))
            .unwrap();
        lines.extend(out);
    }
    // (token, read revision, commit revision, value) per key.
    let mut by_key: std::collections::BTreeMap<String, Vec<(i64, i64, u64, u64)>> =
        std::collections::BTreeMap::new();
    let mut unknown = 0;
    let mut accepted = 0;
    for line in &lines {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["ACCEPT", key, token, read, commit, value] => {
                accepted += 1;
                by_key.entry((*key).to_owned()).or_default().push((
                    commit.parse().unwrap(),
                    read.parse().unwrap(),
                    token.parse().unwrap(),
                    value.parse().unwrap(),
                ));
            }
            ["UNKNOWN", _] => unknown += 1,
            // A line cut short by SIGKILL: a section the check cannot
            // count, as if the worker had died before printing it.
            _ => {}
        }
    }
    // Commits that may be in etcd without an ACCEPT line: one per killed
    // worker (killed after its commit, before its print) and each lost
    // answer.
    let unrecorded = killed_workers + unknown;
    let mut c = etcd_client::Client::connect(&eps, None).await.unwrap();
    let mut extra = 0;
    for k in 0..HISTORY_KEYS {
        let key = format!("h{k}");
        let sections = by_key.entry(key.clone()).or_default();
        // Commit order: etcd's revisions are a total order.
        sections.sort();
        for w in sections.windows(2) {
            let ((c0, _, t0, v0), (_, r1, t1, v1)) = (w[0], w[1]);
            assert!(t0 < t1, "{ctx}: {key}: tokens out of commit order {w:?}");
            assert!(
                c0 < r1,
                "{ctx}: {key}: a section read before the previous one committed (overlap) {w:?}"
            );
            assert!(v0 < v1, "{ctx}: {key}: a lost update {w:?}");
        }
        let counter = c
            .get(format!("{prefix}-counter/{key}"), None)
            .await
            .unwrap();
        let n: usize = counter
            .kvs()
            .first()
            .map_or(0, |kv| kv.value_str().unwrap().parse().unwrap());
        assert!(
            n >= sections.len() && n as u64 >= sections.last().map_or(0, |s| s.3),
            "{ctx}: {key}: counter {n} below its {} accepted sections",
            sections.len()
        );
        extra += n - sections.len();
    }
    assert!(
        extra <= unrecorded,
        "{ctx}: {extra} commits without an accepted section, at most {unrecorded} possible \
         ({killed_workers} workers killed, {unknown} answers lost)"
    );
    assert!(accepted >= 40, "{ctx}: only {accepted} accepted sections");
    eprintln!(
        "{ctx}: {accepted} accepted sections on {} keys, no overlap, no lost update; \
         {spawned} workers ({killed_workers} killed), {}, {unknown} commit answers lost, \
         {extra} commits unrecorded",
        by_key.len(),
        member_faults.join(", ")
    );
}

/// Restarts every member if a test that killed them all fails before it
/// restarts them, so that the tests after it find the whole cluster.
struct RestartAllOnDrop {
    dir: std::path::PathBuf,
    armed: bool,
}

impl Drop for RestartAllOnDrop {
    fn drop(&mut self) {
        if self.armed && !etcd_cluster::try_cluster("restart-all", &self.dir) {
            eprintln!("!!! the cluster could not be restarted");
        }
    }
}

/// Issue 27, item 9: every member is killed while a table holds two keys;
/// the application drops one guard during the outage (its release cannot
/// reach etcd) and keeps the other, whose session the table then declares
/// lost; every member is restarted. Every key comes back within the
/// session TTL + the request timeout of the cluster's return: the table
/// that lost its session takes the dropped key again (while the other
/// guard of its old session still lives), and a new table takes the kept
/// one. The old session must not have renewed its lease once it was
/// declared lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_comes_back_after_a_whole_cluster_outage() {
    let test = "every_key_comes_back_after_a_whole_cluster_outage";
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let Some(dir) = etcd_cluster::cluster_dir(test) else {
        return;
    };
    const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
    let prefix = etcd_cluster::prefix("outage");
    let opts = |label: &str| {
        ClusterOptions::new()
            .prefix(&prefix)
            .label(label)
            .session_ttl(Duration::from_secs(SESSION_TTL))
            .request_timeout(REQUEST_TIMEOUT)
    };
    let a = ClusterLockTable::connect_with(&eps, opts("a"))
        .await
        .unwrap();
    let dropped = a.lock("dropped".to_owned()).await.unwrap();
    let kept = a.lock("kept".to_owned()).await.unwrap();
    let old_lease = a.lease_id();
    let mut restart = RestartAllOnDrop {
        dir: dir.clone(),
        armed: true,
    };
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || {
        for n in 1..=3 {
            etcd_cluster::member("kill", &dir2, n);
        }
    })
    .await
    .unwrap();
    // The application lets one key go while etcd is down ...
    drop(dropped);
    // ... and the table fences the other once its lease may have expired.
    tokio::time::timeout(HANG, async {
        while !kept.is_expired() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a guard of a table cut from every member is fenced");
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || {
        assert!(
            etcd_cluster::try_cluster("restart-all", &dir2),
            "restart every member"
        );
    })
    .await
    .unwrap();
    restart.armed = false;
    let back = tokio::time::Instant::now();
    // Every key is back within TTL + request timeout of the cluster's
    // return (the locks' own timeouts say so, naming the holder if not).
    let within = LockOptions::new().timeout(Duration::from_secs(SESSION_TTL) + REQUEST_TIMEOUT);
    let again = tokio::time::timeout(HANG, a.lock_with("dropped".to_owned(), within))
        .await
        .expect("the lock returns")
        .unwrap_or_else(|e| {
            panic!("the key dropped during the outage is still blocked in its table: {e}")
        });
    assert_ne!(again.lease_id(), old_lease);
    assert!(kept.check().is_err(), "the old session's guard is fenced");
    let b = ClusterLockTable::connect_with(&eps, opts("b"))
        .await
        .unwrap();
    let taken = tokio::time::timeout(HANG, b.lock_with("kept".to_owned(), within))
        .await
        .expect("the lock returns")
        .unwrap_or_else(|e| panic!("the key of the lost session is still blocked: {e}"));
    assert!(taken.token() > kept.token());
    taken.check().unwrap();
    eprintln!(
        "both keys taken again {:?} after every member was back",
        back.elapsed()
    );
    drop(kept);
}
