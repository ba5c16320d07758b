//! Benchmarks of the cluster scope against etcd's own lock API (which is
//! also what `etcd-client`'s `lock` helper calls) on the same cluster:
//!
//! - **uncontended** lock + unlock, one process (each unlock waits until
//!   etcd has deleted the key);
//! - **handoff** between two processes connected to different members:
//!   both lock the same key in a loop, and a holder releases only once the
//!   other process waits (its waiter key is in etcd); a handoff is the time
//!   from the holder starting its release to the other process holding the
//!   key (both on this host's wall clock);
//! - **takeover** after the holder is killed with SIGKILL: from the kill to
//!   the waiter holding the key (goal: at most the session TTL + 0.5 s).
//! - **leader takeover** (`--leader-takeover [RUNS] [TTL]`, needs
//!   `KEYLOCK_ETCD_DIR`, the directory given to `cluster.sh start`): a
//!   holder process connected to the leader member only, a waiter
//!   connected to another member only; the holder and the leader member
//!   are killed with SIGKILL at once, and the time from the kills to the
//!   waiter holding the key is measured (goal: at most the election
//!   timeout + TTL + 1 s); the member is restarted between runs. Also
//!   printed: when the waiter's member first named a new leader.
//!
//! ```sh
//! tests/etcd_cluster/cluster.sh start /tmp/keylock-etcd
//! KEYLOCK_ETCD_ENDPOINTS=$(tests/etcd_cluster/cluster.sh endpoints /tmp/keylock-etcd) \
//!     cargo run --release --features etcd --example etcd_bench -- [ROUNDS]
//! KEYLOCK_ETCD_ENDPOINTS=$(tests/etcd_cluster/cluster.sh endpoints /tmp/keylock-etcd) \
//!     KEYLOCK_ETCD_DIR=/tmp/keylock-etcd \
//!     cargo run --release --features etcd --example etcd_bench -- --leader-takeover 5 2
//! tests/etcd_cluster/cluster.sh stop /tmp/keylock-etcd
//! ```

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keylock::etcd::{ClusterLockTable, ClusterOptions};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn endpoints() -> Vec<String> {
    std::env::var("KEYLOCK_ETCD_ENDPOINTS")
        .expect("set KEYLOCK_ETCD_ENDPOINTS (see the top of examples/etcd_bench.rs)")
        .split(',')
        .map(str::to_owned)
        .collect()
}

async fn keylock_table(endpoint: &str, prefix: &str, ttl: u64) -> Res<ClusterLockTable<String>> {
    let opts = ClusterOptions::new()
        .prefix(prefix)
        .session_ttl(Duration::from_secs(ttl));
    Ok(ClusterLockTable::connect_with([endpoint], opts).await?)
}

/// Waits (up to 2 s) until `prefix` has two keys: the holder's and the
/// other process's waiter, so that the release is a handoff.
async fn until_other_waits(c: &mut etcd_client::Client, prefix: &str) -> Res<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    while Instant::now() < deadline {
        if c.get(prefix, Some(opts.clone())).await?.count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    Ok(())
}

/// One side of a handoff run: `rounds` grants, each logged as
/// (grant time, release start time) on the wall clock.
async fn handoff_side(
    kind: &str,
    endpoint: &str,
    prefix: &str,
    rounds: usize,
) -> Res<Vec<(u128, u128)>> {
    let mut log = Vec::with_capacity(rounds);
    match kind {
        "keylock" => {
            let t = keylock_table(endpoint, prefix, 10).await?;
            let mut c = t.client().clone();
            let key_prefix = t.key_prefix("hot");
            for _ in 0..rounds {
                let g = t.lock("hot".to_owned()).await?;
                let granted = wall_ns();
                until_other_waits(&mut c, &key_prefix).await?;
                let release = wall_ns();
                g.unlock().await?;
                log.push((granted, release));
            }
        }
        _ => {
            let mut c = etcd_client::Client::connect([endpoint], None).await?;
            let lease = c.lease_grant(10, None).await?.id();
            let (_keeper, _stream) = c.lease_keep_alive(lease).await?;
            let name = format!("{prefix}/etcd-lock");
            for _ in 0..rounds {
                let opts = etcd_client::LockOptions::new().with_lease(lease);
                let key = c.lock(name.clone(), Some(opts)).await?.key().to_vec();
                let granted = wall_ns();
                until_other_waits(&mut c, &format!("{name}/")).await?;
                let release = wall_ns();
                c.unlock(key).await?;
                log.push((granted, release));
            }
            c.lease_revoke(lease).await?;
        }
    }
    Ok(log)
}

fn median(mut v: Vec<Duration>) -> (Duration, Duration, usize) {
    v.sort();
    let n = v.len();
    if n == 0 {
        return (Duration::ZERO, Duration::ZERO, 0);
    }
    (v[n / 2], v[(n * 9 / 10).min(n - 1)], n)
}

async fn handoff(kind: &str, eps: &[String], rounds: usize) -> Res<()> {
    let prefix = format!("keylock-bench/{}-{}", std::process::id(), wall_ns());
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child", kind, &eps[1], &prefix, &rounds.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let own = handoff_side(kind, &eps[0], &prefix, rounds).await?;
    let mut theirs = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line?;
        let mut it = line.split_whitespace();
        if let (Some(g), Some(r)) = (it.next(), it.next()) {
            theirs.push((g.parse::<u128>()?, r.parse::<u128>()?));
        }
    }
    child.wait()?;
    // Grants in order (exclusion makes grant times a total order); a
    // handoff is a grant following the other process's release.
    let mut all: Vec<(u128, u128, u8)> = own
        .into_iter()
        .map(|(g, r)| (g, r, 0))
        .chain(theirs.into_iter().map(|(g, r)| (g, r, 1)))
        .collect();
    all.sort();
    let gaps: Vec<Duration> = all
        .windows(2)
        .filter(|w| w[0].2 != w[1].2)
        .map(|w| Duration::from_nanos(u64::try_from(w[1].0.saturating_sub(w[0].1)).unwrap()))
        .collect();
    let (med, p90, n) = median(gaps);
    println!("handoff, two processes on two members, {kind:>16}: median {med:>10.2?}, p90 {p90:>10.2?} ({n} handoffs)");
    Ok(())
}

async fn uncontended(eps: &[String], rounds: usize) -> Res<()> {
    let prefix = format!("keylock-bench/{}-{}", std::process::id(), wall_ns());
    let t = keylock_table(&eps[0], &prefix, 10).await?;
    let mut v = Vec::new();
    for i in 0..rounds {
        let start = Instant::now();
        let g = t.lock(format!("k{}", i % 8)).await?;
        g.unlock().await?;
        v.push(start.elapsed());
    }
    let (med, p90, _) = median(v);
    println!(
        "uncontended lock+unlock, {:>16}: median {med:>10.2?}, p90 {p90:>10.2?}",
        "keylock"
    );
    let mut c = etcd_client::Client::connect([&eps[0]], None).await?;
    let lease = c.lease_grant(10, None).await?.id();
    let (_keeper, _stream) = c.lease_keep_alive(lease).await?;
    let mut v = Vec::new();
    for i in 0..rounds {
        let start = Instant::now();
        let opts = etcd_client::LockOptions::new().with_lease(lease);
        let key = c
            .lock(format!("{prefix}/e{}", i % 8), Some(opts))
            .await?
            .key()
            .to_vec();
        c.unlock(key).await?;
        v.push(start.elapsed());
    }
    let (med, p90, _) = median(v);
    println!(
        "uncontended lock+unlock, {:>16}: median {med:>10.2?}, p90 {p90:>10.2?}",
        "etcd lock API"
    );
    // The floor: one plain put (a round trip and a raft commit).
    let mut v = Vec::new();
    for i in 0..rounds {
        let start = Instant::now();
        c.put(format!("{prefix}/put{}", i % 8), "x", None).await?;
        v.push(start.elapsed());
    }
    let (med, p90, _) = median(v);
    println!("one etcd put (the floor),                  median {med:>10.2?}, p90 {p90:>10.2?}");
    // The handoff's floor: a delete sent to one member, seen by a watch on
    // another (what a keylock handoff costs at least: the holder's delete
    // and one watch event).
    let mut w = etcd_client::Client::connect([&eps[1]], None).await?;
    let key = format!("{prefix}/floor");
    let mut stream = w
        .watch(
            key.as_str(),
            Some(
                etcd_client::WatchOptions::new()
                    .with_filters([etcd_client::WatchFilterType::NoPut]),
            ),
        )
        .await?;
    stream.message().await?; // created
    let mut v = Vec::new();
    for _ in 0..rounds {
        c.put(key.as_str(), "x", None).await?;
        let start = Instant::now();
        let mut d = c.clone();
        let k = key.clone();
        // The event may come before the delete's answer: time the event.
        let delete = tokio::spawn(async move { d.delete(k, None).await });
        loop {
            let resp = stream.message().await?.ok_or("the watch ended")?;
            if !resp.events().is_empty() {
                break;
            }
        }
        v.push(start.elapsed());
        delete.await??;
    }
    let (med, p90, _) = median(v);
    println!("delete, seen by a watch on another member,  median {med:>10.2?}, p90 {p90:>10.2?} (the handoff's floor)");
    let all = etcd_client::DeleteOptions::new().with_prefix();
    c.delete(format!("{prefix}/"), Some(all)).await?;
    c.lease_revoke(lease).await?;
    Ok(())
}

async fn takeover(eps: &[String], ttl: u64) -> Res<()> {
    let prefix = format!("keylock-bench/{}-{}", std::process::id(), wall_ns());
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--holder", &eps[1], &prefix, &ttl.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
    assert!(
        line.starts_with("HELD"),
        "the holder did not take the key: {line:?}"
    );
    let t = keylock_table(&eps[0], &prefix, ttl).await?;
    let killed = Instant::now();
    // SAFETY: kill(2) on our own child's pid, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait()?;
    let g = t.lock("job".to_owned()).await?;
    println!(
        "takeover after SIGKILL of the holder (session TTL {ttl} s): {:.2?}",
        killed.elapsed()
    );
    drop(g);
    Ok(())
}

/// The member (1, 2 or 3, from its name `mN`) that the cluster names its
/// leader, asked of every endpoint in turn until one answers.
async fn leader_member(eps: &[String]) -> Res<usize> {
    let mut c = etcd_client::Client::connect(eps, None).await?;
    let leader = c.status().await?.leader();
    let members = c.member_list().await?;
    let m = members
        .members()
        .iter()
        .find(|m| m.id() == leader)
        .ok_or("the leader is not a member")?;
    Ok(m.name()[1..].parse()?)
}

fn cluster_sh(cmd: &str, dir: &str, n: usize) -> Res<()> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/etcd_cluster/cluster.sh");
    let status = Command::new("bash")
        .args([script, cmd, dir, &n.to_string()])
        .status()?;
    if !status.success() {
        return Err(format!("cluster.sh {cmd} {n} failed").into());
    }
    Ok(())
}

/// One run of the leader takeover: returns (kill -> waiter holds the key,
/// kill -> the waiter's member names a new leader).
async fn leader_takeover(eps: &[String], dir: &str, ttl: u64) -> Res<(Duration, Duration)> {
    let leader = leader_member(eps).await?;
    let other = leader % eps.len() + 1;
    let (leader_ep, other_ep) = (&eps[leader - 1], &eps[other - 1]);
    let prefix = format!("keylock-bench/{}-{}", std::process::id(), wall_ns());
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--holder", leader_ep, &prefix, &ttl.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line)?;
    assert!(
        line.starts_with("HELD"),
        "the holder did not take the key: {line:?}"
    );
    let t = std::sync::Arc::new(keylock_table(other_ep, &prefix, ttl).await?);
    let mut c = t.client().clone();
    let key_prefix = t.key_prefix("job");
    let waiter = {
        let t = std::sync::Arc::clone(&t);
        tokio::spawn(async move {
            loop {
                // A session lost meanwhile (its keep-alives go through the
                // dead leader too) is started again by the next lock.
                match std::sync::Arc::clone(&t).lock_owned("job".to_owned()).await {
                    Ok(g) => return (Instant::now(), g),
                    Err(e) => eprintln!("  the waiter's lock failed ({e}); again"),
                }
            }
        })
    };
    // The waiter's key is in etcd (it waits behind the holder's).
    until_other_waits(&mut c, &key_prefix).await?;
    // Who leads, as the waiter's member sees it, polled every 10 ms.
    let mut s = etcd_client::Client::connect([other_ep], None).await?;
    let leader_id = s.status().await?.leader();
    let pid: i32 = std::fs::read_to_string(format!("{dir}/m{leader}.pid"))?
        .trim()
        .parse()?;
    let killed = Instant::now();
    // SAFETY: kill(2) on our own child's pid (not yet reaped) and on the
    // member's pid, which cluster.sh recorded.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGKILL);
        libc::kill(pid, libc::SIGKILL);
    }
    std::fs::remove_file(format!("{dir}/m{leader}.pid"))?;
    child.wait()?;
    let elected = tokio::spawn(async move {
        loop {
            if let Ok(st) = s.status().await {
                if st.leader() != 0 && st.leader() != leader_id {
                    return Instant::now();
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let (held, g) = waiter.await?;
    let elected = elected.await?;
    drop(g);
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        cluster_sh("restart", &dir, leader).map_err(|e| e.to_string())
    })
    .await??;
    Ok((held - killed, elected - killed))
}

async fn leader_takeovers(eps: &[String], runs: usize, ttl: u64) -> Res<()> {
    let dir = std::env::var("KEYLOCK_ETCD_DIR")
        .expect("set KEYLOCK_ETCD_DIR (the directory given to cluster.sh start)");
    let mut takeovers = Vec::new();
    for i in 0..runs {
        let (took, elected) = leader_takeover(eps, &dir, ttl).await?;
        println!(
            "leader takeover {}: new leader seen after {elected:.2?}, key held after {took:.2?} (TTL {ttl} s)",
            i + 1
        );
        takeovers.push(took);
        // Let the restarted member catch up before the next run.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    takeovers.sort();
    println!(
        "takeover with the leader killed (session TTL {ttl} s, {runs} runs): median {:.2?}, max {:.2?}",
        takeovers[runs / 2],
        takeovers[runs - 1]
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let rounds = args[5].parse()?;
        for (g, r) in handoff_side(&args[2], &args[3], &args[4], rounds).await? {
            println!("{g} {r}");
        }
        return Ok(());
    }
    if args.get(1).map(String::as_str) == Some("--holder") {
        let t = keylock_table(&args[2], &args[3], args[4].parse()?).await?;
        let _g = t.lock("job".to_owned()).await?;
        println!("HELD");
        tokio::time::sleep(Duration::from_secs(600)).await;
        return Ok(());
    }
    if args.get(1).map(String::as_str) == Some("--leader-takeover") {
        let runs = args.get(2).map_or(Ok(5), |r| r.parse())?;
        let ttl = args.get(3).map_or(Ok(2), |r| r.parse())?;
        return leader_takeovers(&endpoints(), runs.max(1), ttl).await;
    }
    let rounds = args.get(1).map_or(Ok(200), |r| r.parse())?;
    let eps = endpoints();
    assert!(eps.len() >= 2, "two members at least");
    uncontended(&eps, rounds).await?;
    handoff("keylock", &eps, rounds).await?;
    handoff("etcd lock API", &eps, rounds.min(50)).await?;
    for _ in 0..3 {
        takeover(&eps, 2).await?;
    }
    Ok(())
}
