//! Many OS threads on a few hot keys: keylock's `blocking_lock` against the
//! map of mutexes threaded code writes today.
//!
//! ```text
//! cargo run --release --example threads              # 1 s per cell, 5 reps: ~50 s
//! cargo run --release --example threads -- --quick   # 0.2 s per cell, 3 reps: a few seconds
//! cargo run --release --example threads -- --threads 64 --reps 7 --ms 500
//! ```
//!
//! 64, 128 and 256 threads share 16 hot keys. Each thread, in a loop, picks
//! one of the keys uniformly at random (its own xorshift generator), locks it,
//! increments that key's counter (nothing else under the lock) and releases
//! it. Each cell runs for a fixed time; the table shows the median throughput
//! of the repetitions, which are interleaved (rep 1 of every cell, then rep
//! 2, ...) so that a burst of machine noise hits all of them.
//!
//! The contenders:
//!
//! - keylock strict: `LockTable::new()` (the default, `Fairness::Strict`),
//!   `table.blocking_lock(k)`;
//! - keylock eventual: `LockTable::builder().fairness(Fairness::Eventual)`,
//!   `table.blocking_lock(k)`;
//! - the anchor, `parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<()>>>>`:
//!   lock the map, get or insert the key's `Arc`, clone it, unlock the map,
//!   lock the key's mutex. Its entries are never removed (16 here).
//!
//! The counters are read and written with plain (`Relaxed`) loads and stores,
//! never a read-modify-write, so only the lock keeps increments from being
//! lost: after each run the counters must add up to the operations counted,
//! or the run panics.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use keylock::{Fairness, LockTable};

/// Hot keys shared by all threads.
const KEYS: usize = 16;

/// Something that runs `f` while holding `key`'s lock.
trait Contender: Sync {
    fn with_lock(&self, key: u64, f: impl FnOnce());

    /// Entries kept once every lock is released.
    fn entries(&self) -> usize;
}

impl Contender for LockTable<u64> {
    fn with_lock(&self, key: u64, f: impl FnOnce()) {
        let guard = self.blocking_lock(key);
        f();
        drop(guard);
    }

    fn entries(&self) -> usize {
        self.len()
    }
}

/// The anchor: a global map of per-key mutexes, entries never removed.
#[derive(Default)]
struct ParkingLotMap(parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<()>>>>);

impl Contender for ParkingLotMap {
    fn with_lock(&self, key: u64, f: impl FnOnce()) {
        let mutex = Arc::clone(self.0.lock().entry(key).or_default());
        let guard = mutex.lock();
        f();
        drop(guard);
    }

    fn entries(&self) -> usize {
        self.0.lock().len()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Impl {
    Strict,
    Eventual,
    Anchor,
}

impl Impl {
    const ALL: [Impl; 3] = [Self::Strict, Self::Eventual, Self::Anchor];

    fn name(self) -> &'static str {
        match self {
            Self::Strict => "keylock strict",
            Self::Eventual => "keylock eventual",
            Self::Anchor => "parking_lot map",
        }
    }

    fn run(self, threads: usize, duration: Duration) -> Sample {
        match self {
            Self::Strict => measure(&LockTable::<u64>::new(), threads, duration),
            Self::Eventual => {
                let table = LockTable::<u64>::builder()
                    .fairness(Fairness::Eventual)
                    .build();
                measure(&table, threads, duration)
            }
            Self::Anchor => measure(&ParkingLotMap::default(), threads, duration),
        }
    }
}

/// A key's counter, on its own cache line (the keys are independent: no
/// false sharing between them).
#[derive(Default)]
#[repr(align(128))]
struct Counter(AtomicU64);

/// One run of one cell.
#[derive(Clone, Copy)]
struct Sample {
    ops: u64,
    elapsed: Duration,
}

impl Sample {
    fn mops(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64() / 1e6
    }
}

/// Spreads small integers over `u64` (a bijection: distinct keys stay
/// distinct).
fn scramble(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `threads` threads lock random keys of `KEYS` for `duration`.
fn measure<C: Contender>(table: &C, threads: usize, duration: Duration) -> Sample {
    let keys: [u64; KEYS] = std::array::from_fn(|i| scramble(i as u64 + 1));
    let counters: Vec<Counter> = (0..KEYS).map(|_| Counter::default()).collect();
    let stop = AtomicBool::new(false);
    let total = AtomicU64::new(0);
    let start_line = Barrier::new(threads + 1);
    let elapsed = std::thread::scope(|s| {
        for t in 0..threads {
            let (keys, counters, stop, total, start_line) =
                (&keys, &counters, &stop, &total, &start_line);
            std::thread::Builder::new()
                .stack_size(64 * 1024)
                .spawn_scoped(s, move || {
                    // xorshift64, seeded per thread (never 0).
                    let mut x = scramble(t as u64 + 1) | 1;
                    let mut ops = 0u64;
                    start_line.wait();
                    while !stop.load(Relaxed) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = (x >> 32) as usize % KEYS;
                        let counter = &counters[i].0;
                        table.with_lock(keys[i], || {
                            counter.store(counter.load(Relaxed) + 1, Relaxed);
                        });
                        ops += 1;
                    }
                    total.fetch_add(ops, Relaxed);
                })
                .expect("spawn a thread");
        }
        start_line.wait();
        let start = Instant::now();
        std::thread::sleep(duration);
        stop.store(true, Relaxed);
        start.elapsed()
    });
    let ops = total.load(Relaxed);
    let counted: u64 = counters.iter().map(|c| c.0.load(Relaxed)).sum();
    assert_eq!(
        counted, ops,
        "per-key counters add up to {counted}, threads counted {ops}: increments lost, exclusion broken"
    );
    assert!(
        table.entries() <= KEYS,
        "more entries than keys after the run"
    );
    Sample { ops, elapsed }
}

struct Config {
    quick: bool,
    reps: usize,
    duration: Duration,
    threads: Vec<usize>,
}

fn usage() -> ! {
    eprintln!("usage: threads [--quick] [--reps N] [--ms MILLISECONDS] [--threads 64,128,256]");
    std::process::exit(2)
}

impl Config {
    fn parse() -> Self {
        let mut quick = false;
        let mut reps = None;
        let mut ms = None;
        let mut threads = vec![64, 128, 256];
        let mut args = std::env::args().skip(1);
        let number = |s: Option<String>| -> u64 {
            s.and_then(|s| s.trim().parse().ok())
                .filter(|&n| n > 0)
                .unwrap_or_else(|| usage())
        };
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--reps" => reps = Some(number(args.next()) as usize),
                "--ms" => ms = Some(number(args.next())),
                "--threads" => {
                    threads = args
                        .next()
                        .unwrap_or_else(|| usage())
                        .split(',')
                        .map(|n| number(Some(n.to_string())) as usize)
                        .collect()
                }
                _ => usage(),
            }
        }
        Self {
            quick,
            reps: reps.unwrap_or(if quick { 3 } else { 5 }),
            duration: Duration::from_millis(ms.unwrap_or(if quick { 200 } else { 1000 })),
            threads,
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn main() {
    let cfg = Config::parse();
    let started = Instant::now();
    // mops[threads][impl][rep]
    let mut mops = vec![vec![Vec::new(); Impl::ALL.len()]; cfg.threads.len()];
    for rep in 0..cfg.reps {
        for (ti, &threads) in cfg.threads.iter().enumerate() {
            for (ii, imp) in Impl::ALL.into_iter().enumerate() {
                let sample = imp.run(threads, cfg.duration);
                eprintln!(
                    "   [{}/{}] {threads:>3} threads  {:<17} {:>6.2} M ops/s ({} ops, counters match)",
                    rep + 1,
                    cfg.reps,
                    imp.name(),
                    sample.mops(),
                    sample.ops
                );
                mops[ti][ii].push(sample.mops());
            }
        }
    }
    let wall = started.elapsed();

    let mut o = String::new();
    writeln!(
        o,
        "### {KEYS} hot keys, OS threads, lock + counter increment + unlock: \
         median M ops/s ({} reps of {} ms{})\n",
        cfg.reps,
        cfg.duration.as_millis(),
        if cfg.quick { ", --quick" } else { "" }
    )
    .unwrap();
    writeln!(
        o,
        "Anchor: `parking_lot::Mutex<HashMap<u64, Arc<parking_lot::Mutex<()>>>>`. \
         Ratio = keylock ops/s / anchor ops/s, a throughput ratio: above 1, \
         keylock does more operations per second (this is the inverse of \
         `compare`'s time ratio).\n"
    )
    .unwrap();
    writeln!(
        o,
        "| threads | keylock strict | keylock eventual | parking_lot map | \
         strict / anchor | eventual / anchor | spread (max-min)/median: strict, eventual, anchor |"
    )
    .unwrap();
    writeln!(o, "|---:|---:|---:|---:|---:|---:|---|").unwrap();
    for (ti, &threads) in cfg.threads.iter().enumerate() {
        let m: Vec<f64> = mops[ti].iter().map(|v| median(v.clone())).collect();
        let spread: Vec<String> = mops[ti]
            .iter()
            .zip(&m)
            .map(|(v, &med)| {
                let max = v.iter().copied().fold(f64::MIN, f64::max);
                let min = v.iter().copied().fold(f64::MAX, f64::min);
                format!("{:.0}%", (max - min) / med * 100.0)
            })
            .collect();
        writeln!(
            o,
            "| {threads} | {:.2} | {:.2} | {:.2} | {:.2}x | {:.2}x | {} |",
            m[0],
            m[1],
            m[2],
            m[0] / m[2],
            m[1] / m[2],
            spread.join(", ")
        )
        .unwrap();
    }
    writeln!(
        o,
        "\nEvery run checked: the per-key counters add up to the operations counted. \
         Total wall time: {:.1} s",
        wall.as_secs_f64()
    )
    .unwrap();
    print!("{o}");
}
