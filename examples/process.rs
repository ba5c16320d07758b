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
//! `cargo run --release --example process -- --new-keys N` instead takes
//! and releases N distinct keys, each once, and prints the median time of
//! the first lock of a new key (`try_lock` + drop) next to raw `flock` on a
//! new file (`open(O_CREAT)` + `flock` + unlock + `close`), and the disk the
//! directory takes per idle key once the table reclaimed what it cached
//! (`prune`): a job runner keyed by job id.
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

/// `--new-keys N`: the first lock of N new keys, against raw `flock` on N
/// new files; then the disk per idle key after reclaim.
fn new_keys(n: usize) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let root = std::env::temp_dir().join(format!("keylock-example-new-{}", std::process::id()));
    let dir = root.join("keylock");
    let raw = root.join("flock");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::create_dir_all(&raw).unwrap();
    let disk = |dir: &std::path::Path| -> (usize, u64) {
        let entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let bytes = entries
            .iter()
            .map(|e| e.metadata().unwrap().blocks() * 512)
            .sum();
        (entries.len(), bytes)
    };
    let table = ProcessLockTable::open(&dir).unwrap();
    let mut keylock = Vec::with_capacity(n);
    let mut flock = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("job-{i}");
        let at = Instant::now();
        drop(table.try_lock(key.clone()).unwrap());
        keylock.push(at.elapsed());
        let at = Instant::now();
        let file = std::fs::File::create(raw.join(&key)).unwrap();
        // SAFETY: flock(2) on a descriptor `file` keeps open; no memory.
        unsafe {
            assert_eq!(libc::flock(file.as_raw_fd(), libc::LOCK_EX), 0);
            assert_eq!(libc::flock(file.as_raw_fd(), libc::LOCK_UN), 0);
        }
        drop(file);
        flock.push(at.elapsed());
    }
    let (files_before, bytes_before) = disk(&dir);
    let pruned = table.prune().unwrap();
    let (files_after, bytes_after) = disk(&dir);
    let (raw_files, raw_bytes) = disk(&raw);
    let (k, f) = (median(keylock), median(flock));
    println!(
        "first lock of a new key ({n} keys): keylock try_lock + drop median {k:?}, \
         raw flock on a new file median {f:?} ({:.1}x)",
        k.as_secs_f64() / f.as_secs_f64()
    );
    println!(
        "disk after {n} idle keys: {files_before} files, {bytes_before} bytes while cached; \
         after prune ({pruned} reclaimed) {files_after} files, {bytes_after} bytes \
         ({} bytes per idle key); raw flock files: {raw_files} files, {raw_bytes} bytes",
        bytes_after / n as u64
    );
    drop(table);
    std::fs::remove_dir_all(&root).unwrap();
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
        if flag == "--new-keys" {
            new_keys(n.parse().expect("--new-keys N"));
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
