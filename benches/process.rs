//! The process scope against the kernel floor and a mkdir lock.
//!
//! ```text
//! cargo bench --bench process
//! ```
//!
//! - `process_uncontended`: one process takes and releases one key:
//!   `ProcessLockTable::try_lock` + drop (and `blocking_lock`, and the async
//!   `lock` under `futures::executor::block_on`), against a plain `flock` +
//!   unlock of one open file (the kernel floor).
//! - `process_new_key`: the first lock of a new key (`try_lock` + drop of
//!   a key never locked, on one table, so that one cached key is evicted
//!   and its file reclaimed per lock, as in a job runner keyed by job id),
//!   against a plain `flock` + unlock of a new file (`open(O_CREAT)`,
//!   `flock`, unlock, `close`). `cargo run --release --example process --
//!   --new-keys N` prints the same with the disk per idle key after
//!   `prune`.
//! - `process_calls`: the system calls one uncontended lock+unlock of the
//!   process scope makes (four: lock slot 0, a `stat` of the key's path,
//!   an `fstat` before the release's store, unlock; `today_four_in_sequence`;
//!   see BENCHMARKS.md), made by hand on an open file with nothing else, as
//!   a sequence and one by one: the floor of the design, and what each call
//!   costs (the path's `stat` also relative to an open directory); the
//!   older three-call sequence, the same with `flock` (the alternative of
//!   one slot file per slot), and the seven calls of format 2 (a state
//!   lock, `pread` and `pwrite` of the state) for comparison.
//! - `process_handoff_round_trip`: two processes hand one key back and
//!   forth. Each round trip is two handoffs: the partner process (this bench
//!   binary re-invoked) and this one each take the key, find it is their
//!   turn (a byte in a file read under the lock), pass the turn and release.
//!   A process that takes the key out of turn releases it and takes it
//!   again. Against the same protocol on one `flock`ed file (the kernel
//!   floor) and on a mkdir lock whose waiters retry with jittered backoff
//!   from 100 µs doubling to 2 ms (`mkdir_fast`, a tuned mkdir lock).
//! - `process_handoff_round_trip_reference`: the same protocol on the mkdir
//!   lock of the issue's reference document, at its cadence: a waiter
//!   retries after `retryMs * (0.5 + random)` with its default `retryMs` of
//!   80 ms (`mkdir_reference`). Flat sampling, few round trips per sample,
//!   so that a sample stays a second or two.
//!
//! - `process_handoff_to_a_waiter` (and `..._reference` for the mkdir lock
//!   at the reference's cadence): the latency of one handoff to a process
//!   that is already waiting. The holder waits, holding the key, until the
//!   other process has said (a flag in a file) that it is about to lock,
//!   then 200 µs more so that it is asleep in its wait (in the kernel, or in
//!   a backoff sleep), then writes the time (`CLOCK_MONOTONIC`, one clock
//!   for both processes) and releases; the waiter, once it holds the key,
//!   reads that time: the latency is the difference. A process whose turn
//!   it is not does not lock (it watches the turn byte without the lock),
//!   so nobody barges. Criterion gets the sum of the latencies (not the
//!   wall time, which includes the 200 µs holds); the bench also prints the
//!   median and the 10th and 90th percentiles of every handoff measured.
//!   `keylock` waits with `blocking_lock`, `keylock_async` with the async
//!   `lock` under `futures::executor::block_on` (through the scope's helper
//!   thread and the waiter's waker). `wake_hop` is not a lock: one thread
//!   waking a future parked in `block_on` on another, the step an async
//!   waiter adds to a kernel handoff (its helper thread is woken by the
//!   kernel, then wakes the future).
//!
//! Each sample spawns a partner process and times from its "ready" line to
//! the end of this process's share of the round trips (or sums the
//! latencies of this process's acquisitions).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode};
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

/// The async path: `lock` polled by `futures::executor::block_on`, so a
/// waiter waits through the scope's helper thread and its waker.
struct KeylockAsync(ProcessLockTable<&'static str>);
impl Lock for KeylockAsync {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let guard = futures::executor::block_on(self.0.lock("hot")).unwrap();
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

/// A mkdir lock: `mkdir` takes it, `rmdir` releases it; a waiter sleeps
/// `pause * (0.5 + random)` between tries, `pause` starting at `first_ns`
/// and doubling up to `max_ns` (equal: a fixed mean, as the reference's).
struct Mkdir {
    path: PathBuf,
    seed: u64,
    first_ns: u64,
    max_ns: u64,
}
impl Lock for Mkdir {
    fn with<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let mut pause = self.first_ns;
        while std::fs::create_dir(&self.path).is_err() {
            // xorshift jitter in [0.5, 1.5) x pause
            self.seed ^= self.seed << 13;
            self.seed ^= self.seed >> 7;
            self.seed ^= self.seed << 17;
            std::thread::sleep(Duration::from_nanos(pause / 2 + self.seed % pause));
            pause = (pause * 2).min(self.max_ns);
        }
        let out = f();
        std::fs::remove_dir(&self.path).unwrap();
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
        "keylock_async" => {
            let mut l = KeylockAsync(ProcessLockTable::open(dir).unwrap());
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
        "mkdir_fast" | "mkdir_reference" => {
            let (first_ns, max_ns) = if kind == "mkdir_fast" {
                (100_000, 2_000_000)
            } else {
                (80_000_000, 80_000_000) // retryMs = 80, no growth
            };
            let mut l = Mkdir {
                path: dir.join("mkdir.lock"),
                // A new draw per lock (not the same sequence per sample).
                seed: (u64::from(std::process::id()) << 32 ^ now_ns()) | 1,
                first_ns,
                max_ns,
            };
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

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The turn file of `play_waiting`: the turn (byte 0), the release time of
/// the last handoff (bytes 8-15), "about to lock" flags (byte 16 + player).
const RELEASED_AT: u64 = 8;
const WAITING_AT: u64 = 16;

/// Takes `turns` turns as player `me`, each a handoff to a waiter (see the
/// module doc); returns the sum of the latencies of this player's
/// acquisitions that followed a release by the other (ns).
fn play_waiting(
    kind: &'static str,
    dir: &Path,
    me: u8,
    turns: u64,
    other_waits_after: impl Fn(u64) -> bool,
    ready: impl FnOnce(),
) -> Vec<u64> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("turn"))
        .unwrap();
    let mut lock = make_lock(kind, dir);
    ready();
    let (mut latencies, mut done) = (Vec::new(), 0u64);
    let other = 1 - me;
    while done < turns {
        // No barging: wait (without the lock) until the other passed the
        // turn, so that every lock call is a handoff to a waiter.
        let mut b = [0u8];
        loop {
            file.read_exact_at(&mut b, 0).unwrap();
            if b[0] == me {
                break;
            }
            std::thread::yield_now();
        }
        file.write_all_at(&[1], WAITING_AT + u64::from(me)).unwrap();
        let mut mine = false;
        lock(&mut || {
            let got = now_ns();
            let mut b = [0u8];
            file.read_exact_at(&mut b, 0).unwrap();
            if b[0] != me {
                return;
            }
            mine = true;
            let mut t = [0u8; 8];
            file.read_exact_at(&mut t, RELEASED_AT).unwrap();
            let released = u64::from_le_bytes(t);
            if released != 0 {
                latencies.push(got - released);
            }
            file.write_all_at(&[0], WAITING_AT + u64::from(me)).unwrap();
            file.write_all_at(&[other], 0).unwrap();
            if other_waits_after(done + 1) {
                // Hold until the other is about to lock, and then asleep in
                // its wait.
                let mut w = [0u8];
                loop {
                    file.read_exact_at(&mut w, WAITING_AT + u64::from(other))
                        .unwrap();
                    if w[0] == 1 {
                        break;
                    }
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            file.write_all_at(&now_ns().to_le_bytes(), RELEASED_AT)
                .unwrap();
        });
        if mine {
            done += 1;
        }
    }
    latencies
}

/// `hops` times: a thread, 200 µs after a future parked `block_on`'s thread
/// (so that it sleeps), reads the clock and wakes the future's waker; the
/// latency is from that reading to the future running again. This is the
/// step an async waiter of the process scope adds to a kernel handoff: the
/// kernel wakes the helper thread blocked in the lock call (as it wakes a
/// blocked `flock` caller), and the helper wakes the future.
fn wake_hops(hops: u64) -> Duration {
    use std::sync::{Arc, Mutex};
    use std::task::{Poll, Waker};
    #[derive(Default)]
    struct Hop {
        waker: Option<Waker>,
        woken_at: Option<Instant>,
    }
    let mut total = Duration::ZERO;
    for _ in 0..hops {
        let hop = Arc::new(Mutex::new(Hop::default()));
        let theirs = Arc::clone(&hop);
        let waker_thread = std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_micros(200));
            let mut hop = theirs.lock().unwrap();
            if let Some(waker) = hop.waker.take() {
                hop.woken_at = Some(Instant::now());
                drop(hop);
                waker.wake();
                return;
            }
        });
        let latency = futures::executor::block_on(std::future::poll_fn(|cx| {
            let mut hop = hop.lock().unwrap();
            match hop.woken_at {
                Some(at) => Poll::Ready(at.elapsed()),
                None => {
                    hop.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        }));
        waker_thread.join().unwrap();
        LATENCIES
            .lock()
            .unwrap()
            .push(("wake_hop", latency.as_nanos() as u64));
        total += latency;
    }
    total
}

/// Every latency `handoff_waiting` measured, by lock, for the medians
/// printed at the end (criterion's estimates are means, which a few
/// handoffs delayed by the scheduler of a busy machine dominate).
static LATENCIES: std::sync::Mutex<Vec<(&'static str, u64)>> = std::sync::Mutex::new(Vec::new());

fn print_latency_medians() {
    let all = LATENCIES.lock().unwrap();
    let mut kinds: Vec<&str> = all.iter().map(|(k, _)| *k).collect();
    kinds.dedup();
    if kinds.is_empty() {
        return;
    }
    println!("handoff to a waiter, all measured handoffs (warm-up included):");
    println!(
        "{:<16} {:>9} {:>12} {:>12} {:>12}",
        "lock", "handoffs", "p10", "median", "p90"
    );
    for kind in kinds {
        let mut v: Vec<u64> = all
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, l)| *l)
            .collect();
        v.sort_unstable();
        let at = |q: usize| Duration::from_nanos(v[(v.len() - 1) * q / 100]);
        println!(
            "{:<16} {:>9} {:>12?} {:>12?} {:>12?}",
            kind,
            v.len(),
            at(10),
            at(50),
            at(90)
        );
    }
}

/// `handoffs` handoffs from a partner to this process, each to a waiting
/// waiter: the sum of their latencies.
fn handoff_waiting(kind: &'static str, handoffs: u64) -> Duration {
    let dir = std::env::temp_dir().join(format!("keylock-bench-w-{}-{kind}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("turn"), [0u8; 32]).unwrap();
    let mut partner = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, format!("{kind} {handoffs} waiting"))
        .env("KEYLOCK_BENCH_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(partner.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    // Player 0 takes the first turn and one after each of the partner's:
    // `handoffs + 1` turns; the partner waits for its last one.
    let latencies = play_waiting(kind, &dir, 0, handoffs + 1, |k| k <= handoffs, || {});
    assert_eq!(latencies.len() as u64, handoffs);
    assert!(partner.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).unwrap();
    let total = Duration::from_nanos(latencies.iter().sum());
    LATENCIES
        .lock()
        .unwrap()
        .extend(latencies.into_iter().map(|l| (kind, l)));
    total
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
    let parts: Vec<&str> = spec.split(' ').collect();
    let dir = PathBuf::from(std::env::var("KEYLOCK_BENCH_DIR").unwrap());
    let (kind, rounds) = (parts[0], parts[1].parse().unwrap());
    if parts.get(2) == Some(&"waiting") {
        let kind: &'static str = match kind {
            "flock" => "flock",
            "keylock" => "keylock",
            "keylock_async" => "keylock_async",
            "mkdir_fast" => "mkdir_fast",
            "mkdir_reference" => "mkdir_reference",
            other => panic!("unknown lock {other}"),
        };
        play_waiting(kind, &dir, 1, rounds, |_| true, || println!("ready"));
    } else {
        play(kind, &dir, 1, rounds, || println!("ready"));
    }
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
    // The async path, as a caller outside a runtime polls it.
    group.bench_function("keylock_async_lock_drop", |b| {
        b.iter(|| drop(futures::executor::block_on(table.lock("k")).unwrap()))
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

fn new_keys(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("keylock-bench-n-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let raw = dir.join("plain");
    std::fs::create_dir_all(&raw).unwrap();
    let mut group = c.benchmark_group("process_new_key");
    let table = ProcessLockTable::open(&dir).unwrap();
    let mut n = 0u64;
    group.bench_function("keylock_first_try_lock_drop", |b| {
        b.iter(|| {
            n += 1;
            drop(table.try_lock(format!("job-{n}")).unwrap());
        })
    });
    let mut n = 0u64;
    group.bench_function("plain_flock_new_file", |b| {
        b.iter(|| {
            n += 1;
            let file = File::create(raw.join(n.to_string())).unwrap();
            flock(&file, libc::LOCK_EX);
            flock(&file, libc::LOCK_UN);
        })
    });
    group.finish();
    drop(table);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn handoffs(c: &mut Criterion) {
    let mut group = c.benchmark_group("process_handoff_round_trip");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for kind in ["flock", "keylock", "mkdir_fast"] {
        group.bench_function(kind, |b| b.iter_custom(|rounds| handoff(kind, rounds)));
    }
    group.finish();
    // About 80 ms per handoff: flat sampling, 10 samples of a few round
    // trips each.
    let mut group = c.benchmark_group("process_handoff_round_trip_reference");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_millis(500));
    group.bench_function("mkdir_reference", |b| {
        b.iter_custom(|rounds| handoff("mkdir_reference", rounds))
    });
    group.finish();

    // Criterion sees the latencies, not the 200 µs holds: short
    // measurement times keep the wall time of a run to seconds.
    let mut group = c.benchmark_group("process_handoff_to_a_waiter");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(1))
        .warm_up_time(Duration::from_millis(100));
    for kind in ["flock", "keylock", "keylock_async", "mkdir_fast"] {
        group.bench_function(kind, |b| b.iter_custom(|n| handoff_waiting(kind, n)));
    }
    // Not a lock: the step the async path adds to a handoff, alone.
    group.bench_function("wake_hop", |b| b.iter_custom(wake_hops));
    group.finish();
    let mut group = c.benchmark_group("process_handoff_to_a_waiter_reference");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(300));
    group.bench_function("mkdir_reference", |b| {
        b.iter_custom(|n| handoff_waiting("mkdir_reference", n))
    });
    group.finish();
}

/// The system calls of one uncontended lock+unlock, by hand: open file
/// description lock of slot 0's byte, `fstat` (the file is still linked),
/// unlock (the state is in shared memory: no call); and those of format 2:
/// lock of the state and slot bytes, `fstat`, `pread` of the state,
/// `pwrite` of the stamp, unlock of the state byte; on release, `pwrite`
/// of the release cell and unlock of the slot byte.
fn calls(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("keylock-bench-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("calls.state"))
        .unwrap();
    file.set_len(2048).unwrap();
    let mut buf = [0u8; 2048];
    let stamp = [7u8; 512];
    let mut group = c.benchmark_group("process_calls");
    group.bench_function("three_in_sequence", |b| {
        b.iter(|| {
            ofd(&file, libc::F_WRLCK, 1, 1);
            assert_eq!(file.metadata().unwrap().len(), 2048);
            ofd(&file, libc::F_UNLCK, 1, 1);
        })
    });
    // The same with `flock` on a slot file of its own (the alternative
    // design: one file per slot).
    group.bench_function("flock_three_in_sequence", |b| {
        b.iter(|| {
            flock(&file, libc::LOCK_EX | libc::LOCK_NB);
            assert_eq!(file.metadata().unwrap().len(), 2048);
            flock(&file, libc::LOCK_UN);
        })
    });
    group.bench_function("flock_lock_unlock_pair", |b| {
        b.iter(|| {
            flock(&file, libc::LOCK_EX | libc::LOCK_NB);
            flock(&file, libc::LOCK_UN);
        })
    });
    group.bench_function("format_2_seven_in_sequence", |b| {
        b.iter(|| {
            ofd(&file, libc::F_WRLCK, 0, 2);
            assert_eq!(file.metadata().unwrap().len(), 2048);
            file.read_exact_at(&mut buf, 0).unwrap();
            file.write_all_at(&stamp, 0).unwrap();
            ofd(&file, libc::F_UNLCK, 0, 1);
            file.write_all_at(&buf[..8], 1536).unwrap();
            ofd(&file, libc::F_UNLCK, 1, 1);
        })
    });
    // The same steps with `flock` on two files (a state file and a slot
    // file), the design before byte-range locks: nine calls (two locks
    // cannot be one call across files; each file's identity is checked).
    let slot = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("calls.slot0"))
        .unwrap();
    group.bench_function("flock_two_files_nine_in_sequence", |b| {
        b.iter(|| {
            flock(&file, libc::LOCK_EX | libc::LOCK_NB);
            assert_eq!(file.metadata().unwrap().len(), 2048);
            file.read_exact_at(&mut buf, 0).unwrap();
            flock(&slot, libc::LOCK_EX | libc::LOCK_NB);
            assert_eq!(slot.metadata().unwrap().len(), 0);
            file.write_all_at(&stamp, 0).unwrap();
            flock(&file, libc::LOCK_UN);
            file.write_all_at(&buf[..8], 1536).unwrap();
            flock(&slot, libc::LOCK_UN);
        })
    });
    group.bench_function("ofd_lock_unlock_pair", |b| {
        b.iter(|| {
            ofd(&file, libc::F_WRLCK, 1, 1);
            ofd(&file, libc::F_UNLCK, 1, 1);
        })
    });
    // Today's uncontended lock + unlock, by hand: lock slot 0, `stat` of
    // the key's path (it still names the open file, whole), `fstat` before
    // the release's store (still whole), unlock. The floor of the design
    // with the checks of issue 27 items 1 and 3.
    let path = dir.join("calls.state");
    let ino = std::os::unix::fs::MetadataExt::ino(&file.metadata().unwrap());
    group.bench_function("today_four_in_sequence", |b| {
        b.iter(|| {
            flock(&file, libc::LOCK_EX | libc::LOCK_NB);
            let meta = std::fs::metadata(&path).unwrap();
            assert_eq!(std::os::unix::fs::MetadataExt::ino(&meta), ino);
            assert_eq!(file.metadata().unwrap().len(), 2048);
            flock(&file, libc::LOCK_UN);
        })
    });
    group.bench_function("stat_of_the_path", |b| {
        b.iter(|| std::fs::metadata(&path).unwrap().len())
    });
    // The same look relative to an open directory (one component to walk,
    // but blind to the directory itself being moved aside).
    let dir_fd = File::open(&dir).unwrap();
    let name = std::ffi::CString::new("calls.state").unwrap();
    group.bench_function("stat_relative_to_the_directory", |b| {
        b.iter(|| {
            // SAFETY: all zeros is a valid `stat` struct, filled by the call.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `dir_fd` stays open, `name` is a C string, `st` is
            // borrowed for the call.
            let rc = unsafe { libc::fstatat(dir_fd.as_raw_fd(), name.as_ptr(), &mut st, 0) };
            assert_eq!(rc, 0, "fstatat");
            st.st_ino
        })
    });
    group.bench_function("fstat", |b| b.iter(|| file.metadata().unwrap().len()));
    group.bench_function("pread_2048", |b| {
        b.iter(|| file.read_exact_at(&mut buf, 0).unwrap())
    });
    group.bench_function("pwrite_512", |b| {
        b.iter(|| file.write_all_at(&stamp, 0).unwrap())
    });
    group.bench_function("pwrite_8", |b| {
        b.iter(|| file.write_all_at(&stamp[..8], 1536).unwrap())
    });
    group.finish();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An open file description lock call (`F_OFD_SETLK`) on `len` bytes.
fn ofd(file: &File, kind: libc::c_int, start: i64, len: i64) {
    // SAFETY: all zeros is a valid `flock` struct (l_pid must be 0).
    let mut req: libc::flock = unsafe { std::mem::zeroed() };
    req.l_type = kind as libc::c_short;
    req.l_whence = libc::SEEK_SET as libc::c_short;
    req.l_start = start;
    req.l_len = len;
    // SAFETY: `req` is a valid flock struct borrowed for the call; `file`
    // keeps its descriptor open.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut req) };
    assert_eq!(rc, 0, "fcntl");
}

fn main() {
    if let Ok(spec) = std::env::var(ROLE) {
        partner(&spec);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    uncontended(&mut c);
    new_keys(&mut c);
    calls(&mut c);
    handoffs(&mut c);
    c.final_summary();
    print_latency_medians();
}
