//! The cluster scope under faults, against a real etcd cluster: a holder
//! process killed with SIGKILL, a member and the leader killed and
//! restarted, a holder cut from the cluster, and a history check of fenced
//! critical sections across worker processes with kills.
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
    ClusterLockTable::connect_with(endpoints, opts)
        .await
        .expect("connect to the test cluster")
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

/// The member (1, 2 or 3) that leads the cluster now.
async fn leader(eps: &[String]) -> u32 {
    let mut c = etcd_client::Client::connect(eps, None).await.unwrap();
    let leader = c.status().await.unwrap().leader();
    let members = c.member_list().await.unwrap();
    let m = members
        .members()
        .iter()
        .find(|m| m.id() == leader)
        .expect("the leader is a member");
    m.name()[1..].parse().unwrap()
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
    let wait = keylock::LockOptions::new().timeout(Duration::from_secs(1));
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

/// The worker of `history_check`: `KEYLOCK_ETCD_HISTORY_OPS` critical
/// sections on keys `h0`..`h2` under `KEYLOCK_ETCD_HISTORY_PREFIX`, each a
/// read-modify-write of the key's counter committed by an etcd transaction
/// that compares the grant's fence. Prints one line per accepted section:
/// `ACCEPT key token granted_ns committed_ns`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_worker() {
    let (Ok(prefix), Ok(ops)) = (
        std::env::var("KEYLOCK_ETCD_HISTORY_PREFIX"),
        std::env::var("KEYLOCK_ETCD_HISTORY_OPS"),
    ) else {
        return; // not run as a worker
    };
    let Some(eps) = etcd_cluster::endpoints("history_worker") else {
        return;
    };
    let ops: usize = ops.parse().unwrap();
    let mut mine = eps.clone();
    mine.rotate_left(std::process::id() as usize % eps.len());
    let t = table(&mine, &prefix, "history").await;
    let mut c = t.client().clone();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    };
    for i in 0..ops {
        let key = format!("h{}", (i + std::process::id() as usize) % 3);
        let Ok(g) = t.lock(key.clone()).await else {
            continue; // a lost session (a member restarting): next one
        };
        let granted = now();
        let counter = format!("{prefix}-counter/{key}");
        let Ok(read) = c.get(counter.clone(), None).await else {
            continue;
        };
        let v: u64 = read
            .kvs()
            .first()
            .map_or(0, |kv| kv.value_str().unwrap().parse().unwrap());
        tokio::time::sleep(Duration::from_millis(1)).await;
        let txn = etcd_client::Txn::new()
            .when([g.fence().compare()])
            .and_then([etcd_client::TxnOp::put(counter, (v + 1).to_string(), None)]);
        if let Ok(resp) = c.txn(txn).await {
            if resp.succeeded() {
                println!("ACCEPT {key} {} {granted} {}", g.token().get(), now());
            }
        }
        drop(g);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_check() {
    let test = "history_check";
    let Some(eps) = etcd_cluster::endpoints(test) else {
        return;
    };
    let Some(dir) = etcd_cluster::cluster_dir(test) else {
        return;
    };
    let prefix = etcd_cluster::prefix("history");
    let spawn = |ops: usize| {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "history_worker",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KEYLOCK_ETCD_HISTORY_PREFIX", &prefix)
            .env("KEYLOCK_ETCD_HISTORY_OPS", ops.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(out)
                .lines()
                .map_while(Result::ok)
                .filter_map(|l| l.find("ACCEPT ").map(|at| l[at..].to_owned()))
                .collect::<Vec<_>>()
        });
        (KillOnDrop(child), reader)
    };
    let mut workers: Vec<_> = (0..3).map(|_| spawn(40)).collect();
    // Faults while they run: a worker killed (its keys go with its lease),
    // a member restarted, another worker started.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // SAFETY: kill(2) on our own child's pid, not yet reaped.
    unsafe { libc::kill(workers[0].0 .0.id() as i32, libc::SIGKILL) };
    let dir2 = dir.clone();
    tokio::task::spawn_blocking(move || {
        etcd_cluster::member("kill", &dir2, 3);
        etcd_cluster::member("restart", &dir2, 3);
    })
    .await
    .unwrap();
    workers.push(spawn(40));
    let mut accepted = Vec::new();
    for (mut child, reader) in workers {
        let status = tokio::task::spawn_blocking(move || {
            let s = child.0.wait().unwrap();
            (s, reader.join().unwrap())
        });
        let (_, lines) = tokio::time::timeout(HANG, status).await.unwrap().unwrap();
        accepted.extend(lines);
    }
    // Per key: accepted sections, in grant order, have increasing tokens and
    // never overlap; the counter counts every accepted section (the killed
    // worker may have committed one it did not live to print).
    let mut by_key: std::collections::BTreeMap<String, Vec<(u128, u128, u64)>> =
        std::collections::BTreeMap::new();
    for line in &accepted {
        let f: Vec<&str> = line.split_whitespace().collect();
        by_key.entry(f[1].to_owned()).or_default().push((
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
            f[2].parse().unwrap(),
        ));
    }
    let mut c = etcd_client::Client::connect(&eps, None).await.unwrap();
    for (key, sections) in &mut by_key {
        sections.sort();
        for w in sections.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "{key}: overlapping accepted sections {w:?}"
            );
            assert!(w[0].2 < w[1].2, "{key}: tokens out of order {w:?}");
        }
        let counter = c
            .get(format!("{prefix}-counter/{key}"), None)
            .await
            .unwrap();
        let n: usize = counter.kvs()[0].value_str().unwrap().parse().unwrap();
        assert!(
            n == sections.len() || n == sections.len() + 1,
            "{key}: counter {n}, {} accepted sections",
            sections.len()
        );
    }
    assert!(accepted.len() >= 40, "{} accepted sections", accepted.len());
    eprintln!(
        "{} accepted sections on {} keys, no overlap",
        accepted.len(),
        by_key.len()
    );
}
