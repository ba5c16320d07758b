//! The process scope against the kernel floor and a mkdir lock.
//!
//! ```text
//! cargo bench --bench process
//! ```
//!
//! - `process_uncontended`: one process takes and releases one key:
//!   `ProcessLockTable::try_lock` + drop, against a plain `flock` +
//!   unlock of one open file (the kernel floor).
//! - `process_handoff`: two processes hand one key back and forth. Each
//!   round trip is two handoffs: the partner process (this bench binary
//!   re-invoked) and this one each take the key, find it is their turn (a
//!   byte in a file read under the lock), pass the turn and release. A
//!   process that takes the key out of turn releases it and takes it again.
//!   Against the same protocol on one `flock`ed file (the kernel floor) and
//!   on a mkdir lock that retries with jittered backoff (from 100 µs,
//!   doubling to 2 ms), the lock of the issue's reference document.
//!
//! Each sample spawns a partner process and times from its "ready" line to
//! the end of this process's share of the round trips.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::Criterion;
use keylock::ProcessLockTable;

const ROLE: &str = "KEYLOCK_BENCH_PARTNER";

fn flock(file: &File, op: libc::c_int) {
    // SAFETY: flock on an fd `file` keeps open; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
    assert_eq!(rc, 0, "flock");
}

/// A lock for the handoff protocol.
trait Lock {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R;
}

struct Keylock(ProcessLockTable<&'static str>);
impl Lock for Keylock {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let guard = self.0.blocking_lock("hot").unwrap();
        let out = f();
        drop(guard);
        out
    }
}

struct Flock(File);
impl Lock for Flock {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R {
        flock(&self.0, libc::LOCK_EX);
        let out = f();
        flock(&self.0, libc::LOCK_UN);
        out
    }
}

struct Mkdir(PathBuf, u64);
impl Lock for Mkdir {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let mut pause = 100_000u64;
        while std::fs::create_dir(&self.0).is_err() {
            // xorshift jitter in [0.5, 1.5) x pause
            self.1 ^= self.1 << 13;
            self.1 ^= self.1 >> 7;
            self.1 ^= self.1 << 17;
            std::thread::sleep(Duration::from_nanos(pause / 2 + self.1 % pause));
            pause = (pause * 2).min(2_000_000);
        }
        let out = f();
        std::fs::remove_dir(&self.0).unwrap();
        out
    }
}

/// Runs a critical section under one of the locks.
type Locker = Box<dyn FnMut(&mut dyn FnMut())>;

fn make_lock(kind: &str, dir: &Path) -> Locker {
    match kind {
        "keylock" => {
            let mut l = Keylock(ProcessLockTable::open(dir).unwrap());
            Box::new(move |f| l.with(f))
        }
        "flock" => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.join("plain.lock"))
                .unwrap();
            let mut l = Flock(file);
            Box::new(move |f| l.with(f))
        }
        "mkdir" => {
            let mut l = Mkdir(dir.join("mkdir.lock"), u64::from(std::process::id()) | 1);
            Box::new(move |f| l.with(f))
        }
        other => panic!("unknown lock {other}"),
    }
}

/// Takes `turns` turns of the protocol as player `me` (0 or 1).
fn play(kind: &str, dir: &Path, me: u8, turns: u64, ready: impl FnOnce()) {
    let turn_file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("turn"))
        .unwrap();
    let mut lock = make_lock(kind, dir);
    ready();
    let mut done = 0;
    while done < turns {
        let mut mine = false;
        lock(&mut || {
            let mut b = [0u8];
            turn_file.read_exact_at(&mut b, 0).unwrap();
            if b[0] == me {
                turn_file.write_all_at(&[1 - me], 0).unwrap();
                mine = true;
            }
        });
        if mine {
            done += 1;
        }
    }
}

/// Round trips between this process and a partner, timed.
fn handoff(kind: &str, rounds: u64) -> Duration {
    let dir = std::env::temp_dir().join(format!("keylock-bench-{}-{kind}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("turn"), [0u8]).unwrap();
    let mut partner = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, format!("{kind} {rounds}"))
        .env("KEYLOCK_BENCH_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(partner.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let start = Instant::now();
    play(kind, &dir, 0, rounds, || {});
    let elapsed = start.elapsed();
    assert!(partner.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).unwrap();
    elapsed
}

fn partner(spec: &str) {
    let (kind, rounds) = spec.split_once(' ').unwrap();
    let dir = PathBuf::from(std::env::var("KEYLOCK_BENCH_DIR").unwrap());
    play(kind, &dir, 1, rounds.parse().unwrap(), || println!("ready"));
}

fn uncontended(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("keylock-bench-u-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut group = c.benchmark_group("process_uncontended");
    let table = ProcessLockTable::open(&dir).unwrap();
    group.bench_function("keylock_try_lock_drop", |b| {
        b.iter(|| drop(table.try_lock("k").unwrap()))
    });
    group.bench_function("keylock_blocking_lock_drop", |b| {
        b.iter(|| drop(table.blocking_lock("k").unwrap()))
    });
    let file = File::create(dir.join("plain.lock")).unwrap();
    group.bench_function("plain_flock_unlock", |b| {
        b.iter(|| {
            flock(&file, libc::LOCK_EX);
            flock(&file, libc::LOCK_UN);
        })
    });
    group.finish();
    std::fs::remove_dir_all(&dir).unwrap();
}

fn handoffs(c: &mut Criterion) {
    let mut group = c.benchmark_group("process_handoff_round_trip");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for kind in ["flock", "keylock", "mkdir"] {
        group.bench_function(kind, |b| b.iter_custom(|rounds| handoff(kind, rounds)));
    }
    group.finish();
}

fn main() {
    if let Ok(spec) = std::env::var(ROLE) {
        partner(&spec);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    uncontended(&mut c);
    handoffs(&mut c);
    c.final_summary();
}
