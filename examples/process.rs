//! The process scope, with real processes: a short demonstration, then the
//! takeover times the issue asks for.
//!
//! ```text
//! cargo run --release --example process
//! ```
//!
//! 1. Two processes take turns on one key; the tokens increase across them.
//! 2. SIGKILL takeover, 20 times: a holder process is killed while this
//!    process waits on the key at the file level; the time from `kill` to
//!    this process holding the key (median and max).
//! 3. Lease takeover of a stopped holder, 5 times: a holder with a 100 ms
//!    lease is SIGSTOPped; the time from its lease deadline to this process
//!    holding the key.
//!
//! The holders are this example re-invoked with `KEYLOCK_EXAMPLE_HOLDER`.
//!
//! `cargo run --release --example process -- --loop N` instead takes and
//! releases one key N times (`try_lock` + drop) in one process and exits: run
//! it under `strace -c -f` with N = 0 and N = 10000 to count the system
//! calls of one uncontended lock+unlock (see BENCHMARKS.md).

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keylock::{LockOptions, ProcessLockTable};

const ROLE: &str = "KEYLOCK_EXAMPLE_HOLDER";

/// The holder: takes the key (with a lease if asked), says so, and holds it
/// until stdin closes.
fn holder(dir: &str, lease_ms: Option<u64>) {
    let table = ProcessLockTable::open(dir)
        .unwrap()
        .with_label("example holder");
    let mut opts = LockOptions::new();
    if let Some(ms) = lease_ms {
        opts = opts.lease(Duration::from_millis(ms));
    }
    let guard = table.blocking_lock_with("demo", opts).unwrap();
    println!("locked {}", guard.token());
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(guard);
}

fn spawn_holder(dir: &std::path::Path, lease_ms: Option<u64>) -> (Child, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(ms) = lease_ms {
        cmd.env("KEYLOCK_EXAMPLE_LEASE_MS", ms.to_string());
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line.trim().to_owned())
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of our own child; no memory involved.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0);
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// `--loop N`: N uncontended lock+unlock of one key, nothing else.
fn uncontended_loop(n: u64) {
    let dir = std::env::temp_dir().join(format!("keylock-example-loop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let table = ProcessLockTable::open(&dir).unwrap();
    for _ in 0..n {
        drop(table.try_lock("k").unwrap());
    }
    drop(table);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn main() {
    if let Ok(dir) = std::env::var(ROLE) {
        let lease = std::env::var("KEYLOCK_EXAMPLE_LEASE_MS")
            .ok()
            .map(|s| s.parse().unwrap());
        holder(&dir, lease);
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, n] = args.as_slice() {
        if flag == "--loop" {
            uncontended_loop(n.parse().expect("--loop N"));
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("keylock-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let table = ProcessLockTable::open(&dir)
        .unwrap()
        .with_label("example main");

    // 1. Turns across processes.
    let (mut child, line) = spawn_holder(&dir, None);
    println!("another process: {line}");
    let err = table
        .try_lock("demo")
        .expect_err("the other process holds it");
    println!("try_lock: {err}");
    drop(child.stdin.take()); // it releases
    child.wait().unwrap();
    let guard = table.blocking_lock("demo").unwrap();
    println!("this process: locked {} (higher)", guard.token());
    drop(guard);

    // 2. SIGKILL takeover.
    let mut times = Vec::new();
    for _ in 0..20 {
        let (mut child, _) = spawn_holder(&dir, None);
        let waiter = std::thread::scope(|s| {
            let w = s.spawn(|| {
                let guard = table.blocking_lock("demo").unwrap();
                let at = Instant::now();
                drop(guard);
                at
            });
            // Until the waiter's helper thread blocks in the kernel.
            while table.stats().kernel_waits == 0 {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(5));
            let killed = Instant::now();
            signal(&child, libc::SIGKILL);
            let got = w.join().unwrap();
            got - killed
        });
        child.wait().unwrap();
        times.push(waiter);
    }
    println!(
        "takeover after SIGKILL (20 runs): median {:?}, max {:?}",
        median(times.clone()),
        times.iter().max().unwrap()
    );

    // 3. Lease takeover of a stopped holder.
    let mut late = Vec::new();
    for _ in 0..5 {
        let (mut child, _) = spawn_holder(&dir, Some(100));
        signal(&child, libc::SIGSTOP);
        let holder = table.holder(&"demo").unwrap().expect("held");
        let lapse = Instant::now() + holder.lease_left.unwrap();
        let guard = table.blocking_lock("demo").unwrap();
        late.push(Instant::now().saturating_duration_since(lapse));
        drop(guard);
        signal(&child, libc::SIGCONT);
        drop(child.stdin.take());
        child.wait().unwrap();
    }
    println!(
        "takeover of a stopped holder after its lease lapsed (5 runs): median {:?} past the deadline, max {:?}",
        median(late.clone()),
        late.iter().max().unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
