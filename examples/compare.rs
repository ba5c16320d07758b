//! keylock against the keyed-lock options people write today, side by side.
//!
//! ```text
//! cargo run --release --example compare              # full run, ~1-2 minutes on 2 cores
//! cargo run --release --example compare -- --quick   # CI smoke, a few seconds
//! cargo run --release --example compare -- --only W1,W6 --impl keylock,tokio
//! cargo run --release --example compare -- --only bank   # the bank alone
//! cargo run --release --example compare -- --require-idle --floor PATH   # a figure that counts
//! cargo run --profile lto --example compare -- --only W1,W4,W6 --reps 7 --require-idle \
//!     --floor PATH --floor-rounds 5   # keylock / floor, round by round
//! ```
//!
//! Against the floor, build with `--profile lto` (fat LTO, one codegen
//! unit: how the floor's binary is built; see Cargo.toml). A default
//! release build runs every implementation, tokio's mutex included, about
//! a tenth slower on W6 than the floor's harness does, and the report's
//! check of the two harnesses says so.
//!
//! Runs every workload (see `compare/workloads.rs`) for every implementation
//! (see `compare/impls.rs`), repeats each measurement, interleaving the
//! implementations so that machine noise spreads over all of them, and prints
//! markdown tables: the median ns/op, and keylock's time divided by each
//! anchor's (below 1: keylock is faster). An anchor is any implementation
//! keylock is measured against: the keyed locks people write today (DashMap
//! of mutexes, lockable) and single, non-keyed mutexes (one lock for every
//! key). With W1 it also times each implementation as a plain loop
//! (`compare/plain.rs`) to check that the harness runs every anchor at the
//! cost a plain loop measures for it, and with W6 keylock and its options
//! (an option's cost on W1 and W6 is read off those loops). A progress bar goes to stderr (when it
//! is a terminal), tables to stdout. A ratio says "faster" or "slower" only
//! when the repetitions do not overlap (`compare/verdict.rs`).
//!
//! A figure counts as evidence only if it was taken on an idle machine. The
//! report opens and closes with the load average (`compare/load.rs`) at the
//! start and end of the run (and lists it before each workload), and warns
//! at the top and at the end when the 1-minute load at the start was above
//! 0.5; `--require-idle` waits for it to drop (`--idle-wait SECS`, default
//! 120) and refuses to measure, with exit status 2, if it does not.
//!
//! Every contended workload that acquires (W3, W4, W6) reports its handoff
//! share: the acquisitions that went to another task than the key's previous
//! holder. W6, the contended goal row, also gets a row per repetition; a
//! repetition of a FIFO lock below 95% handoffs is marked, since its tasks
//! did not contend from both workers throughout.
//!
//! `--floor PATH` (or `KEYLOCK_FLOOR=PATH`) runs a measuring stick after the
//! workloads: a binary that times a minimal keyed lock (`proto`) beside
//! tokio's and async-lock's mutexes in its own harness (`compare/floor.rs`).
//! The report then sets keylock's W1 and W6 against the floor's, and the
//! floor's tokio and async_lock figures beside this run's, so that a reader
//! sees whether the two harnesses agree. With `--floor-rounds N` the floor
//! runs N times, each run right after a round of keylock and tokio's mutex
//! on W1 and W6: the machine's speed drifts by tens of percent over minutes
//! (a shared, virtual machine), so each ratio is taken within one round and
//! the goal reads the median of the rounds' ratios. A "Goals" table at the
//! end reads the ratios the goals are stated in off this one run.

#[path = "compare/bank.rs"]
mod bank;
#[path = "compare/floor.rs"]
mod floor;
#[path = "compare/impls.rs"]
mod impls;
#[path = "compare/load.rs"]
mod load;
#[path = "compare/plain.rs"]
mod plain;
#[path = "compare/verdict.rs"]
mod verdict;
#[path = "compare/workloads.rs"]
mod workloads;

use std::fmt::Write as _;
use std::mem::{size_of, size_of_val};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use impls::KeyedLock;
use load::Load;
use tokio::runtime::Runtime;
use workloads::{Outcome, Workload};

type RunFn = fn(&Runtime, Workload, u64, &Arc<Vec<Vec<u64>>>) -> Option<Outcome>;

/// One implementation, erased.
struct Contender {
    name: &'static str,
    keyed: bool,
    /// Strict FIFO handoff (false: a barging lock).
    fifo: bool,
    run: RunFn,
    self_check: fn(&Runtime) -> Option<usize>,
    /// Size of its lock future (as created, not polled) and of its guard.
    sizes: fn() -> (usize, usize),
    /// W1 as a plain loop, without the harness.
    plain_w1: fn(&Runtime, u64) -> Duration,
    /// W6 as a plain loop (keylock and its options only): what an option's
    /// cost on W6 is read off.
    plain_w6: Option<fn(&Runtime, u64) -> workloads::Outcome>,
}

const fn contender<I: KeyedLock>(plain_w1: fn(&Runtime, u64) -> Duration) -> Contender {
    Contender {
        name: I::NAME,
        keyed: I::KEYED,
        fifo: I::FIFO,
        run: workloads::run::<I>,
        self_check: workloads::self_check::<I>,
        sizes: sizes::<I>,
        plain_w1,
        plain_w6: None,
    }
}

impl Contender {
    /// With W6 as a plain loop too.
    const fn with_plain_w6(mut self, plain_w6: fn(&Runtime, u64) -> workloads::Outcome) -> Self {
        self.plain_w6 = Some(plain_w6);
        self
    }
}

fn sizes<I: KeyedLock>() -> (usize, usize) {
    let table = I::create();
    let future = table.lock(1);
    let future_size = size_of_val(&future);
    drop(future);
    (future_size, size_of::<I::Guard<'static>>())
}

/// keylock first: every ratio is against it.
const CONTENDERS: &[Contender] = &[
    contender::<impls::Keylock>(plain::keylock).with_plain_w6(plain::keylock_w6),
    contender::<impls::KeylockLease>(plain::keylock_lease).with_plain_w6(plain::keylock_lease_w6),
    contender::<impls::KeylockTimeout>(plain::keylock_timeout)
        .with_plain_w6(plain::keylock_timeout_w6),
    contender::<impls::KeylockShared>(plain::keylock_shared),
    contender::<impls::DashMapLeak>(plain::dashmap_leak),
    contender::<impls::DashMapCleanup>(plain::dashmap_cleanup),
    contender::<impls::Lockable>(plain::lockable),
    contender::<impls::TokioMutex>(plain::tokio_mutex),
    contender::<impls::AsyncLockMutex>(plain::async_lock_mutex),
    contender::<impls::FuturesMutex>(plain::futures_mutex),
    contender::<impls::ParkingLot>(plain::parking_lot_mutex),
];

struct Config {
    quick: bool,
    reps: usize,
    workloads: Vec<Workload>,
    impls: Vec<&'static Contender>,
    /// Whether to run the bank (`--only` without `bank` leaves it out).
    bank: bool,
    /// Wait for an idle machine before measuring, or refuse.
    require_idle: bool,
    /// How long `--require-idle` waits.
    idle_wait: Duration,
    /// The floor's binary (`--floor PATH` or `KEYLOCK_FLOOR`).
    floor: Option<PathBuf>,
    /// How many times the floor runs (`--floor-rounds N`): above 1, each
    /// run follows a round of keylock and tokio's mutex on W1 and W6 taken
    /// right before it (`floor::Round`).
    floor_rounds: usize,
}

impl Config {
    /// Operations per measurement.
    fn ops(&self, w: Workload) -> u64 {
        let full = match w {
            Workload::W1 => 2_000_000,
            Workload::W2 => 1_000_000,
            Workload::W3 => 256_000,
            Workload::W4 => 512_000,
            Workload::W5 => 1_048_576,
            Workload::W6 => 1_000_000,
        };
        match (self.quick, w) {
            (false, _) => full,
            // At 1/20, most of W6's tasks finished before another one ran
            // beside them: almost no acquisition waited or was a handoff.
            (true, Workload::W6) => full / 4,
            (true, _) => full / 20,
        }
    }

    fn parse() -> Self {
        let mut quick = false;
        let mut require_idle = false;
        let mut idle_wait = Duration::from_secs(120);
        let mut floor = std::env::var_os("KEYLOCK_FLOOR")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        let mut reps = None;
        let mut floor_rounds = 1;
        let mut only: Option<Vec<String>> = None;
        let mut filter: Option<Vec<String>> = None;
        let mut args = std::env::args().skip(1);
        let list = |s: Option<String>| -> Vec<String> {
            s.unwrap_or_else(|| usage())
                .split(',')
                .map(|x| x.trim().to_ascii_lowercase())
                .collect()
        };
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--reps" => {
                    reps = Some(
                        args.next()
                            .and_then(|n| n.parse().ok())
                            .filter(|&n| n > 0)
                            .unwrap_or_else(|| usage()),
                    )
                }
                "--only" => only = Some(list(args.next())),
                "--impl" => filter = Some(list(args.next())),
                "--require-idle" => require_idle = true,
                "--idle-wait" => {
                    idle_wait = Duration::from_secs(
                        args.next()
                            .and_then(|n| n.parse().ok())
                            .unwrap_or_else(|| usage()),
                    )
                }
                "--floor" => {
                    floor = Some(args.next().map(PathBuf::from).unwrap_or_else(|| usage()))
                }
                "--floor-rounds" => {
                    floor_rounds = args
                        .next()
                        .and_then(|n| n.parse().ok())
                        .filter(|&n| n > 0)
                        .unwrap_or_else(|| usage())
                }
                "--help" | "-h" => {
                    println!("{USAGE}");
                    std::process::exit(0)
                }
                // `cargo bench` passes this to every target it runs.
                "--bench" => {}
                _ => usage(),
            }
        }
        let workloads = Workload::ALL
            .into_iter()
            .filter(|w| {
                only.as_ref()
                    .is_none_or(|o| o.iter().any(|x| x == &w.id().to_ascii_lowercase()))
            })
            .collect();
        let impls = CONTENDERS
            .iter()
            .filter(|c| {
                filter.as_ref().is_none_or(|f| {
                    f.iter()
                        .any(|x| c.name.to_ascii_lowercase().contains(x.as_str()))
                })
            })
            .collect();
        let bank = only.as_ref().is_none_or(|o| o.iter().any(|x| x == "bank"));
        Self {
            quick,
            reps: reps.unwrap_or(if quick { 3 } else { 5 }),
            workloads,
            impls,
            bank,
            require_idle,
            idle_wait,
            floor,
            floor_rounds,
        }
    }
}

const USAGE: &str = "\
usage: compare [--quick] [--reps N] [--only W1,W2,...,bank] [--impl keylock,tokio,...]
               [--require-idle] [--idle-wait SECS] [--floor PATH] [--floor-rounds N]

  --quick           fewer operations and 3 repetitions: a smoke run, not evidence
  --reps N          repetitions of every measurement (default 5, 3 with --quick)
  --only LIST       the workloads to run (W1-W6, bank)
  --impl LIST       the implementations to run (substrings of their names)
  --require-idle    wait for the 1-minute load average to drop to 0.5 before
                    measuring; exit with status 2 if it does not
  --idle-wait SECS  how long --require-idle waits (default 120), looking every 5 s
  --floor PATH      after the workloads, run the floor binary at PATH (no
                    arguments) and set keylock's W1 and W6 against it
                    (default: the KEYLOCK_FLOOR environment variable)
  --floor-rounds N  run the floor N times (default 1), each run right after a
                    round of keylock and tokio's mutex on W1 and W6 (--reps
                    repetitions each, interleaved): keylock / floor is then
                    the median of the rounds' ratios, each taken minutes
                    apart at most, so a drift of the machine cancels";

fn usage() -> ! {
    eprintln!("{USAGE}");
    std::process::exit(2)
}

/// All repetitions of one implementation on one workload.
#[derive(Default, Clone)]
struct Cell {
    samples: Vec<Outcome>,
    /// W1, and W6 for keylock and its options: the plain loop's ns/op, one
    /// per repetition.
    plain: Vec<f64>,
    /// W6 only: the plain loops' runs (for their handoff shares).
    plain_runs: Vec<Outcome>,
    /// W1, keylock with a lease only: one read of the clock a long lease
    /// starts from, in the same loop, ns per read, one per repetition (what
    /// a lease judged on the monotonic clock at the moment it is asked
    /// cannot do without).
    clock: Vec<f64>,
}

fn median(mut ns: Vec<f64>) -> Option<f64> {
    verdict::median(&mut ns)
}

impl Cell {
    fn ns(&self) -> Vec<f64> {
        let mut ns: Vec<f64> = self.samples.iter().map(Outcome::ns_per_op).collect();
        ns.sort_by(f64::total_cmp);
        ns
    }

    fn median(&self) -> Option<f64> {
        median(self.ns())
    }

    /// (max - min) / median, in percent.
    fn spread(&self) -> Option<f64> {
        verdict::spread(&self.ns())
    }

    fn last(&self) -> Option<&Outcome> {
        self.samples.last()
    }

    /// Each repetition's handoff share in percent, in the order run; empty
    /// if the workload counts none.
    fn shares(&self) -> Vec<f64> {
        self.samples.iter().filter_map(share).collect()
    }

    /// The handoff shares of the plain loop's runs (W6).
    fn plain_shares(&self) -> Vec<f64> {
        self.plain_runs.iter().filter_map(share).collect()
    }
}

/// The share of acquisitions that were handoffs, in percent.
fn share(out: &Outcome) -> Option<f64> {
    Some(out.handoffs? as f64 / out.ops.max(1) as f64 * 100.0)
}

/// A handoff share in percent, with two decimals below 1%.
fn fmt_share(s: f64) -> String {
    if s < 1.0 {
        format!("{s:.2}%")
    } else {
        format!("{s:.1}%")
    }
}

/// A W6 repetition of a FIFO lock below this handoff share (percent) did
/// not have both workers contending throughout.
const CONTENDED_SHARE: f64 = 95.0;

/// Whether a W6 repetition with this share is marked: a FIFO lock below
/// [`CONTENDED_SHARE`]. A barging lock's share is its own policy.
fn ran_alone(c: &Contender, share: f64) -> bool {
    c.fifo && share < CONTENDED_SHARE
}

/// The load average at the start, before each workload, and at the end.
struct Loads {
    start: Option<Load>,
    before: Vec<(&'static str, Option<Load>)>,
    end: Option<Load>,
}

impl Loads {
    /// `load average: start X, end Y`, then `uptime`'s form of both.
    fn lines(&self, o: &mut String) {
        writeln!(
            o,
            "load average: start {}, end {} (1-minute; this run's own two workers \
             raise it as the run goes: only the start says whether the machine was idle)",
            load::One(self.start),
            load::One(self.end),
        )
        .unwrap();
        writeln!(
            o,
            "uptime at start: {}; at end: {}",
            load::Uptime(self.start),
            load::Uptime(self.end)
        )
        .unwrap();
    }
}

fn main() {
    let cfg = Config::parse();
    if cfg.require_idle {
        if let Err(why) = load::wait_for_idle(cfg.idle_wait) {
            eprintln!("compare: {why}");
            std::process::exit(2);
        }
    }
    let mut loads = Loads {
        start: load::read(),
        before: Vec::new(),
        end: None,
    };
    if let Some(warning) = load::warning(loads.start) {
        eprintln!("{warning}");
    }
    let rt = workloads::runtime();
    let started = std::time::Instant::now();

    let zipf = if cfg.workloads.contains(&Workload::W4) {
        let per_task = cfg.ops(Workload::W4).div_ceil(workloads::TASKS as u64) as usize;
        workloads::zipf_sequences(per_task)
    } else {
        Arc::new(Vec::new())
    };

    // Not timed: what each leaves behind when a waiter is cancelled after
    // the holder left (reported with the tables).
    let leftovers: Vec<Option<usize>> = cfg.impls.iter().map(|c| (c.self_check)(&rt)).collect();

    // results[w][i]
    let mut results = vec![vec![Cell::default(); cfg.impls.len()]; cfg.workloads.len()];
    let measurements: usize = cfg
        .workloads
        .iter()
        .map(|&w| match w {
            Workload::W1 => cfg.reps * cfg.impls.len() * 2,
            Workload::W6 => {
                cfg.reps
                    * (cfg.impls.len() + cfg.impls.iter().filter(|c| c.plain_w6.is_some()).count())
            }
            _ => cfg.reps * cfg.impls.len(),
        })
        .sum();
    let bar = verdict::progress(measurements as u64);
    for (wi, &w) in cfg.workloads.iter().enumerate() {
        loads.before.push((w.id(), load::read()));
        for rep in 0..cfg.reps {
            for (ii, c) in cfg.impls.iter().enumerate() {
                bar.set_message(format!("{} {}/{} {}", w.id(), rep + 1, cfg.reps, c.name));
                let out = (c.run)(&rt, w, cfg.ops(w), &zipf);
                bar.inc(1);
                let Some(out) = out else {
                    if w == Workload::W1 || (w == Workload::W6 && c.plain_w6.is_some()) {
                        bar.inc(1);
                    }
                    continue;
                };
                results[wi][ii].samples.push(out);
                let plain_message = format!(
                    "{} {}/{} {} (plain loop)",
                    w.id(),
                    rep + 1,
                    cfg.reps,
                    c.name
                );
                if let (Workload::W6, Some(plain_w6)) = (w, c.plain_w6) {
                    bar.set_message(plain_message.clone());
                    let out = plain_w6(&rt, cfg.ops(w));
                    bar.inc(1);
                    results[wi][ii].plain.push(out.ns_per_op());
                    results[wi][ii].plain_runs.push(out);
                }
                if w == Workload::W1 {
                    bar.set_message(plain_message);
                    let ops = cfg.ops(w);
                    let ns = (c.plain_w1)(&rt, ops).as_nanos() as f64 / ops as f64;
                    bar.inc(1);
                    results[wi][ii].plain.push(ns);
                    if c.name == impls::KeylockLease::NAME {
                        let ns = plain::clock_read(&rt, ops).as_nanos() as f64 / ops as f64;
                        results[wi][ii].clock.push(ns);
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    let mut rounds = Vec::new();
    let floor = cfg.floor.as_deref().map(|path| {
        let name = floor::display_name(path);
        if !floor_applies(&cfg) {
            return Err(format!(
                "the floor `{name}` was not run: it measures against keylock's W1 and \
                 W6, and this run has neither"
            ));
        }
        loads.before.push(("floor", load::read()));
        if cfg.floor_rounds == 1 {
            eprintln!("running the floor `{name}` (about 30 s)...");
            return floor::run(path);
        }
        let mut last = None;
        for round in 0..cfg.floor_rounds {
            let load = load::read().map(|l| l.one);
            let (w1, _) = keylock_and_tokio(&cfg, &rt, Workload::W1, &zipf);
            let (w6, w6_share) = keylock_and_tokio(&cfg, &rt, Workload::W6, &zipf);
            eprintln!(
                "floor round {}/{}: running the floor `{name}` (about 30 s)...",
                round + 1,
                cfg.floor_rounds
            );
            let f = floor::run(path)?;
            rounds.push(floor::Round {
                load,
                w1,
                w6,
                w6_share,
                floor: f.clone(),
            });
            last = Some(f);
        }
        Ok(last.expect("at least one round"))
    });
    if let Some(Err(why)) = &floor {
        eprintln!("compare: {why}");
    }
    let bank = cfg.bank.then(|| {
        loads.before.push(("bank", load::read()));
        eprintln!("running the bank...");
        let mut report = String::new();
        let rt = workloads::runtime_with_drivers();
        for accounts in bank::shapes() {
            let shape = bank::shape(accounts, cfg.quick);
            report.push_str(&format!("\n#### {accounts} accounts\n\n"));
            report.push_str(&bank::compare(
                &rt,
                shape,
                cfg.reps,
                Duration::from_secs(120),
            ));
        }
        report
    });
    let wall = started.elapsed();
    loads.end = load::read();
    if let Some(warning) = load::warning(loads.start) {
        eprintln!("{warning}");
    }

    let run = Run {
        cfg: &cfg,
        results: &results,
        loads: &loads,
        floor: floor.as_ref(),
        rounds: &rounds,
    };
    print!("{}", report(&run, &leftovers, bank.as_deref(), wall));
}

/// A round of `--floor-rounds` on `w`: keylock's and tokio's mutex's
/// medians (ns/op) over `--reps` interleaved repetitions, and the lowest
/// handoff share of keylock's (100 where none is counted).
fn keylock_and_tokio(
    cfg: &Config,
    rt: &tokio::runtime::Runtime,
    w: Workload,
    zipf: &Arc<Vec<Vec<u64>>>,
) -> ((f64, f64), f64) {
    let find = |name: &str| {
        CONTENDERS
            .iter()
            .find(|c| c.name == name)
            .expect("a contender of compare's")
    };
    let (ours, tokio) = (find(impls::Keylock::NAME), find(impls::TokioMutex::NAME));
    let (mut k, mut t, mut low) = (Vec::new(), Vec::new(), 100.0f64);
    for _ in 0..cfg.reps {
        let out = (ours.run)(rt, w, cfg.ops(w), zipf).expect("keylock runs W1 and W6");
        low = low.min(share(&out).unwrap_or(100.0));
        k.push(out.ns_per_op());
        let out = (tokio.run)(rt, w, cfg.ops(w), zipf).expect("tokio runs W1 and W6");
        t.push(out.ns_per_op());
    }
    let m = |v: Vec<f64>| median(v).expect("at least one repetition");
    ((m(k), m(t)), low)
}

/// Whether the floor has anything to be set against: keylock on W1 or W6.
fn floor_applies(cfg: &Config) -> bool {
    cfg.impls.iter().any(|c| c.name == impls::Keylock::NAME)
        && cfg
            .workloads
            .iter()
            .any(|w| matches!(w, Workload::W1 | Workload::W6))
}

/// What the report is made of.
struct Run<'a> {
    cfg: &'a Config,
    /// `results[workload][implementation]`.
    results: &'a [Vec<Cell>],
    loads: &'a Loads,
    /// `None`: no `--floor`; `Some(Err)`: it did not run or parse.
    floor: Option<&'a Result<floor::Floor, String>>,
    /// `--floor-rounds` above 1: each round's figures (the last round's
    /// floor is `floor`).
    rounds: &'a [floor::Round],
}

impl Run<'_> {
    /// The repetitions of the implementation `name` on `w`, if both ran.
    fn cell(&self, w: Workload, name: &str) -> Option<(&Contender, &Cell)> {
        let wi = self.cfg.workloads.iter().position(|&x| x == w)?;
        let ii = self.cfg.impls.iter().position(|c| c.name == name)?;
        let cell = &self.results[wi][ii];
        (!cell.samples.is_empty()).then_some((self.cfg.impls[ii], cell))
    }
}

fn report(
    run: &Run<'_>,
    leftovers: &[Option<usize>],
    bank: Option<&str>,
    wall: std::time::Duration,
) -> String {
    let (cfg, results) = (run.cfg, run.results);
    let mut out = String::new();
    let o = &mut out;
    let warning = load::warning(run.loads.start);
    if let Some(w) = &warning {
        writeln!(o, "{w}\n").unwrap();
    }
    run.loads.lines(o);
    if !run.loads.before.is_empty() {
        write!(o, "load average before each workload:").unwrap();
        for (i, (what, l)) in run.loads.before.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(o, "{sep} {what} {}", load::One(*l)).unwrap();
        }
        o.push('\n');
    }
    if cfg.quick {
        writeln!(o, "--quick: a smoke run of fewer operations, not evidence").unwrap();
    }
    o.push('\n');
    let keylock = cfg
        .impls
        .iter()
        .position(|c| c.name == impls::Keylock::NAME);
    let header = |o: &mut String, first: &str| {
        write!(o, "| {first} |").unwrap();
        for w in &cfg.workloads {
            write!(o, " {} |", w.id()).unwrap();
        }
        o.push('\n');
        write!(o, "|---|").unwrap();
        for _ in &cfg.workloads {
            write!(o, "---:|").unwrap();
        }
        o.push('\n');
    };

    writeln!(
        o,
        "### Median ns/op ({} reps{}): keylock against each anchor\n\n{}\n",
        cfg.reps,
        if cfg.quick { ", --quick" } else { "" },
        verdict::LEGEND,
    )
    .unwrap();
    header(o, "implementation");
    for (ii, c) in cfg.impls.iter().enumerate() {
        if is_option(c) {
            continue;
        }
        let name = if c.keyed {
            c.name.to_string()
        } else {
            format!("{} (one lock, all keys)", c.name)
        };
        write!(o, "| {name} |").unwrap();
        for (wi, _) in cfg.workloads.iter().enumerate() {
            let theirs = results[wi][ii].ns();
            let text = match keylock.filter(|&k| k != ii) {
                Some(k) => verdict::cell(&results[wi][k].ns(), &theirs),
                None => median(theirs).map(fmt_ns),
            };
            write!(o, " {} |", text.as_deref().unwrap_or("n/a")).unwrap();
        }
        o.push('\n');
    }

    if let Some(k) = keylock.filter(|_| cfg.impls.iter().any(|c| is_option(c))) {
        writeln!(
            o,
            "\n### Cost of the options: median ns/op against plain keylock\n\n{}\n",
            verdict::OPTION_LEGEND
        )
        .unwrap();
        header(o, "option");
        for (ii, c) in cfg.impls.iter().enumerate() {
            if !is_option(c) {
                continue;
            }
            write!(o, "| {} |", c.name).unwrap();
            for (wi, _) in cfg.workloads.iter().enumerate() {
                let text = verdict::option_cell(&results[wi][ii].ns(), &results[wi][k].ns());
                write!(o, " {} |", text.as_deref().unwrap_or("n/a")).unwrap();
            }
            o.push('\n');
        }
    }

    handoff_tables(o, run);

    writeln!(o, "\n### Spread of the repetitions: (max - min) / median\n").unwrap();
    header(o, "implementation");
    for (ii, c) in cfg.impls.iter().enumerate() {
        write!(o, "| {} |", c.name).unwrap();
        for (wi, _) in cfg.workloads.iter().enumerate() {
            match results[wi][ii].spread() {
                None => write!(o, " n/a |").unwrap(),
                Some(s) => write!(o, " {s:.0}% |").unwrap(),
            }
        }
        o.push('\n');
    }

    if let Some(w1) = cfg.workloads.iter().position(|&w| w == Workload::W1) {
        writeln!(
            o,
            "\n### W1 check: the harness against a plain loop (median ns/op)\n\n\
             A harness must not flatter us: each anchor runs at the cost a plain \
             loop measures for it. The plain loop (`compare/plain.rs`) is W1 \
             written with the implementation's own types, no trait, run \
             interleaved with the harness; harness / plain above {PLAIN_TOLERANCE} \
             is flagged.\n\n\
             | implementation | harness | plain loop | harness / plain |\n|---|---:|---:|---:|"
        )
        .unwrap();
        for (ii, c) in cfg.impls.iter().enumerate() {
            let cell = &results[w1][ii];
            let (Some(h), Some(p)) = (cell.median(), median(cell.plain.clone())) else {
                continue;
            };
            writeln!(o, "{}", verdict::plain_check_row(c.name, h, p)).unwrap();
        }
    }

    if let Some(w6) = cfg.workloads.iter().position(|&w| w == Workload::W6) {
        let rows: Vec<String> = cfg
            .impls
            .iter()
            .enumerate()
            .filter_map(|(ii, c)| {
                let cell = &results[w6][ii];
                let (h, p) = (cell.median()?, median(cell.plain.clone())?);
                let low = cell.plain_shares().into_iter().reduce(f64::min)?;
                Some(format!(
                    "{} {} |",
                    verdict::plain_check_row(c.name, h, p),
                    fmt_share(low)
                ))
            })
            .collect();
        if !rows.is_empty() {
            writeln!(
                o,
                "\n### W6 check: keylock and its options as plain loops (median ns/op)\n\n\
                 The options' W6 goals are read off these loops (`compare/plain.rs`: \
                 W6's own tasks, `lock_with(..).await` unwrapped where it is awaited), \
                 run interleaved with the harness.\n\n\
                 | implementation | harness | plain loop | harness / plain | plain loop's lowest handoff share |\n\
                 |---|---:|---:|---:|---:|"
            )
            .unwrap();
            for row in rows {
                writeln!(o, "{row}").unwrap();
            }
        }
    }

    writeln!(
        o,
        "\n### Entries left after the last repetition (- : keeps no map)\n"
    )
    .unwrap();
    header(o, "implementation");
    for (ii, c) in cfg.impls.iter().enumerate() {
        write!(o, "| {} |", c.name).unwrap();
        for (wi, _) in cfg.workloads.iter().enumerate() {
            match results[wi][ii].last() {
                None => write!(o, " n/a |").unwrap(),
                Some(s) => match s.entries_left {
                    Some(n) => write!(o, " {n} |").unwrap(),
                    None => write!(o, " - |").unwrap(),
                },
            }
        }
        o.push('\n');
    }

    writeln!(
        o,
        "\n### Entries left by a waiter cancelled after the holder released\n\n\
         (Hold k; poll a second `lock(k)` once; drop the guard; drop the waiter.)\n\n\
         | implementation | entries left |\n|---|---:|"
    )
    .unwrap();
    for (c, left) in cfg.impls.iter().zip(leftovers) {
        let left = left.map_or_else(|| "-".to_string(), |n| n.to_string());
        writeln!(o, "| {} | {left} |", c.name).unwrap();
    }

    writeln!(o, "\n### Sizes (bytes): lock future as created, guard\n").unwrap();
    writeln!(o, "| implementation | future | guard |\n|---|---:|---:|").unwrap();
    for c in &cfg.impls {
        let (f, g) = (c.sizes)();
        writeln!(o, "| {} | {f} | {g} |", c.name).unwrap();
    }
    writeln!(
        o,
        "| keylock `LockOwned<u64>` / `OwnedGuard<u64>` | {} | {} |",
        size_of::<keylock::futures::LockOwned<u64>>(),
        size_of::<keylock::OwnedGuard<u64>>()
    )
    .unwrap();

    if let Some(bank) = bank {
        writeln!(
            o,
            "\n### The bank: transactions against DashMap<K, Arc<RwLock<()>>>\n"
        )
        .unwrap();
        o.push_str(bank);
    }

    if let Some(floor) = run.floor {
        floor_tables(o, run, floor);
        rounds_table(o, run);
    }

    writeln!(o, "\nWorkloads:\n").unwrap();
    for w in &cfg.workloads {
        writeln!(
            o,
            "- {} (criterion group `{}`): {} ({} ops)",
            w.id(),
            w.group(),
            w.describe(),
            cfg.ops(*w)
        )
        .unwrap();
    }
    writeln!(o, "\nTotal wall time: {:.1} s", wall.as_secs_f64()).unwrap();

    goals_table(o, run);

    o.push('\n');
    run.loads.lines(o);
    if let Some(w) = &warning {
        writeln!(o, "\n{w}").unwrap();
    }
    out
}

use verdict::{fmt_ns, PLAIN_TOLERANCE};

/// keylock itself with a lease or timeout: compared with plain keylock, not
/// an anchor.
fn is_option(c: &Contender) -> bool {
    c.name.starts_with("keylock+")
}

/// The handoff share of every contended workload that acquires (W3, W4,
/// W6), then W6 repetition by repetition.
fn handoff_tables(o: &mut String, run: &Run<'_>) {
    let (cfg, results) = (run.cfg, run.results);
    let counted: Vec<usize> = (0..cfg.workloads.len())
        .filter(|&wi| cfg.workloads[wi].counts_handoffs())
        .collect();
    let w5 = cfg.workloads.contains(&Workload::W5);
    if counted.is_empty() && !w5 {
        return;
    }
    writeln!(
        o,
        "\n### Handoff share: acquisitions that went to another task than the key's previous holder\n\n\
         Median of the repetitions (lowest-highest). A FIFO lock hands a released key to its \
         oldest waiter: on one contended key (W3, W6) nearly every acquisition is a handoff, and \
         an acquisition that is not one found nobody queued when the holder released. A barging \
         lock lets the releaser take the key back while others wait, so its share, counted the \
         same way, is how often the key changed hands at all. W4 counts per key, over 1,024 Zipf \
         keys (a one-lock anchor has a single key). A key's first acquisition counts as a \
         handoff."
    )
    .unwrap();
    if w5 {
        writeln!(
            o,
            "W5 acquires nothing (its key is held throughout and every wait is cancelled): it has \
             no handoff share."
        )
        .unwrap();
    }
    if counted.is_empty() {
        return;
    }
    write!(o, "\n| implementation | policy |").unwrap();
    for &wi in &counted {
        write!(o, " {} |", cfg.workloads[wi].id()).unwrap();
    }
    write!(o, "\n|---|---|").unwrap();
    for _ in &counted {
        write!(o, "---:|").unwrap();
    }
    o.push('\n');
    for (ii, c) in cfg.impls.iter().enumerate() {
        if counted
            .iter()
            .all(|&wi| results[wi][ii].shares().is_empty())
        {
            // Ran none of them (a shared lock runs only W1 and W2).
            continue;
        }
        let policy = if c.fifo { "FIFO" } else { "barging" };
        write!(o, "| {} | {policy} |", c.name).unwrap();
        for &wi in &counted {
            let shares = results[wi][ii].shares();
            let (Some(m), Some((lo, hi))) = (median(shares.clone()), verdict::range(&shares))
            else {
                write!(o, " n/a |").unwrap();
                continue;
            };
            let single_key = matches!(cfg.workloads[wi], Workload::W3 | Workload::W6);
            let low = shares.iter().filter(|&&s| ran_alone(c, s)).count();
            let mark = if single_key && low > 0 {
                format!(", **{low} of {} below {CONTENDED_SHARE}%**", shares.len())
            } else {
                String::new()
            };
            write!(
                o,
                " {} ({}-{}{mark}) |",
                fmt_share(m),
                fmt_share(lo).trim_end_matches('%'),
                fmt_share(hi)
            )
            .unwrap();
        }
        o.push('\n');
    }

    let Some(w6) = cfg.workloads.iter().position(|&w| w == Workload::W6) else {
        return;
    };
    writeln!(
        o,
        "\n### W6 repetition by repetition: did both workers contend?\n\n\
         W6 is the contended goal row: {} spawned tasks on the two-worker runtime, started \
         together behind a barrier, each looping `lock; counter += 1; unlock` on one key with no \
         yield. A task runs until its lock is not granted at once, so a FIFO lock sees a waiter \
         only when the other worker is running one of the tasks: a FIFO repetition below \
         {CONTENDED_SHARE}% handoffs is marked (for a stretch, one worker ran alone and those \
         acquisitions cost an uncontended lock). A barging lock's share is its own policy and is \
         not marked: where its handoffs are about one per task, each task kept the key for its \
         whole loop while the others waited, and its time is that of a lock that rarely changes \
         hands, not of a handoff.\n\n\
         | implementation | rep | ns/op | handoffs | |\n|---|---:|---:|---:|---|",
        workloads::TASKS
    )
    .unwrap();
    for (ii, c) in cfg.impls.iter().enumerate() {
        for (r, out) in results[w6][ii].samples.iter().enumerate() {
            let (Some(s), Some(n)) = (share(out), out.handoffs) else {
                continue;
            };
            let note = if ran_alone(c, s) {
                format!("(handoffs {s:.0}%: one worker ran alone)")
            } else if !c.fifo && n <= 2 * workloads::TASKS as u64 {
                format!("barging: each task kept the key for its whole loop ({n} handoffs)")
            } else if !c.fifo {
                "barging".to_string()
            } else {
                String::new()
            };
            writeln!(
                o,
                "| {} | {} | {} | {} | {note} |",
                c.name,
                r + 1,
                fmt_ns(out.ns_per_op()),
                fmt_share(s)
            )
            .unwrap();
        }
    }
}

/// The floor's `proto` against keylock, and the floor's anchors beside this
/// run's, disagreeing beyond this either way, are flagged.
const FLOOR_AGREE: f64 = 1.25;

/// keylock against the floor, and whether the two harnesses agree.
fn floor_tables(o: &mut String, run: &Run<'_>, floor: &Result<floor::Floor, String>) {
    writeln!(o, "\n### keylock against the floor\n").unwrap();
    let f = match floor {
        Ok(f) => f,
        Err(why) => {
            writeln!(o, "No floor figures in this run: {why}.").unwrap();
            return;
        }
    };
    writeln!(
        o,
        "The floor is a minimal keyed lock with keylock's plain-lock semantics and nothing else \
         (`proto`), timed in its own harness right after this run's workloads ({:.0} s): how \
         fast a keyed async lock can be on this machine now. Median ns/op (lowest-highest \
         repetition); keylock / floor above 1: keylock takes more time than the floor.\n\n\
         | workload | keylock | floor `proto` | keylock / floor |\n|---|---:|---:|---:|",
        f.wall.as_secs_f64()
    )
    .unwrap();
    let sections = [
        (Workload::W1, &f.uncontended, "uncontended"),
        (Workload::W6, &f.contended, "contended"),
    ];
    for (w, section, what) in sections {
        let proto = section.get("proto").expect("checked by floor::parse");
        let floor_text = with_range(proto.median, &proto.reps);
        let ours = run.cell(w, impls::Keylock::NAME).and_then(|(_, cell)| {
            let ns = cell.ns();
            Some((median(ns.clone())?, ns))
        });
        match ours {
            Some((k, ns)) => writeln!(
                o,
                "| {} (floor: {what}) | {} | {floor_text} | {:.2}x |",
                w.id(),
                with_range(k, &ns),
                k / proto.median
            ),
            None => writeln!(
                o,
                "| {} (floor: {what}) | not run | {floor_text} | n/a |",
                w.id()
            ),
        }
        .unwrap();
    }
    let ops = |w: Workload| {
        if run.cfg.workloads.contains(&w) {
            run.cfg.ops(w).to_string()
        } else {
            "-".to_string()
        }
    };
    let floor_ops = |s: &floor::Section| s.ops.map_or_else(|| "?".to_string(), |n| n.to_string());
    writeln!(
        o,
        "\nOperations per measurement: floor {} (uncontended), {} (contended); this run W1 {}, \
         W6 {}.",
        floor_ops(&f.uncontended),
        floor_ops(&f.contended),
        ops(Workload::W1),
        ops(Workload::W6)
    )
    .unwrap();

    writeln!(
        o,
        "\nThe floor's own anchors beside this run's: near 1, the two harnesses agree on what \
         the machine did; beyond {FLOOR_AGREE}x either way the row is flagged.\n\n\
         | workload | implementation | this run | floor | this run / floor |\n|---|---|---:|---:|---:|"
    )
    .unwrap();
    let pairs = [
        (impls::TokioMutex::NAME, "tokio"),
        (impls::AsyncLockMutex::NAME, "async_lock"),
        (impls::DashMapCleanup::NAME, "dashmap"),
    ];
    for (w, section, _) in sections {
        for (ours, theirs) in pairs {
            let Some(row) = section.get(theirs) else {
                continue;
            };
            let here = run.cell(w, ours).and_then(|(_, cell)| cell.median());
            let (here, ratio) = match here {
                Some(h) => {
                    let r = h / row.median;
                    let flag = if !(1.0 / FLOOR_AGREE..=FLOOR_AGREE).contains(&r) {
                        " **disagree**"
                    } else {
                        ""
                    };
                    (fmt_ns(h), format!("{r:.2}{flag}"))
                }
                None => ("not run".to_string(), "n/a".to_string()),
            };
            writeln!(
                o,
                "| {} | {ours} (floor: `{theirs}`) | {here} | {} | {ratio} |",
                w.id(),
                fmt_ns(row.median)
            )
            .unwrap();
        }
    }
}

/// keylock against the floor round by round (`--floor-rounds`), and the
/// medians of the rounds' ratios.
fn rounds_table(o: &mut String, run: &Run<'_>) {
    if run.rounds.is_empty() {
        return;
    }
    writeln!(
        o,
        "\n### keylock against the floor, round by round\n\n\
         {} rounds, each of keylock and tokio's mutex on W1 and W6 in this process ({} \
         interleaved repetitions each, medians) and then the floor's run: a round takes \
         well under a minute, so each ratio sets two figures of the same minute side by side. \
         *Direct* is keylock / the floor's `proto`; *through tokio* is (keylock / tokio here) / \
         (`proto` / `tokio` in the floor's harness), the same ratio by way of the anchor both \
         harnesses time, which cancels what the two harnesses do differently. Load: the \
         1-minute average as the round began. Handoffs: the lowest share of keylock's W6 \
         repetitions in the round. Harnesses: tokio's mutex here / in the floor's harness, \
         on W6 (near 1: the two harnesses agree; about 1.10 from a default release build, \
         0.96-1.03 from `--profile lto`, which is built as the floor is).\n\n\
         | round | load | W6 keylock | W6 `proto` | W6 direct | W6 through tokio | handoffs | \
         harnesses | W1 keylock | W1 `proto` | W1 direct | W1 through tokio |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        run.rounds.len(),
        run.cfg.reps
    )
    .unwrap();
    let fmt_ratio = |r: Option<f64>| r.map_or_else(|| "n/a".to_string(), |r| format!("{r:.2}x"));
    let proto = |s: &floor::Section| s.get("proto").map_or(f64::NAN, |r| r.median);
    for (i, r) in run.rounds.iter().enumerate() {
        let (w6, w1) = (r.against(true), r.against(false));
        writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            i + 1,
            r.load
                .map_or_else(|| "unknown".to_string(), |l| format!("{l:.2}")),
            fmt_ns(r.w6.0),
            fmt_ns(proto(&r.floor.contended)),
            fmt_ratio(w6.map(|a| a.direct)),
            fmt_ratio(w6.and_then(|a| a.through_tokio)),
            fmt_share(r.w6_share),
            r.floor.contended.get("tokio").map_or_else(
                || "n/a".to_string(),
                |t| format!("{:.2}", r.w6.1 / t.median)
            ),
            fmt_ns(r.w1.0),
            fmt_ns(proto(&r.floor.uncontended)),
            fmt_ratio(w1.map(|a| a.direct)),
            fmt_ratio(w1.and_then(|a| a.through_tokio)),
        )
        .unwrap();
    }
    let med = |f: &dyn Fn(&floor::Round) -> Option<f64>| {
        median(run.rounds.iter().filter_map(f).collect())
    };
    writeln!(
        o,
        "| median | | | | {} | {} | | | | | {} | {} |",
        fmt_ratio(med(&|r| Some(r.against(true)?.direct))),
        fmt_ratio(med(&|r| r.against(true)?.through_tokio)),
        fmt_ratio(med(&|r| Some(r.against(false)?.direct))),
        fmt_ratio(med(&|r| r.against(false)?.through_tokio)),
    )
    .unwrap();
    floor_reach_table(o, run);
}

/// What the floor itself reaches against the anchors of the goals, in its
/// own harness, round by round: a goal set against an anchor that the floor
/// does not reach is beyond any lock with these semantics on this machine.
fn floor_reach_table(o: &mut String, run: &Run<'_>) {
    // (section: contended?, anchor row in the floor's output, label)
    const PAIRS: [(bool, &str, &str); 3] = [
        (true, "tokio", "W6 `proto` / tokio::Mutex"),
        (true, "dashmap", "W6 `proto` / dashmap-cleanup"),
        (false, "async_lock", "W1 `proto` / async_lock::Mutex"),
    ];
    writeln!(
        o,
        "\nWhat the floor itself reaches against the goals' anchors, in its own harness (its \
         run of each round): a goal below the floor's own ratio is out of reach of a minimal \
         keyed lock with these semantics on this machine.\n\n\
         | round | {} | {} | {} |\n|---:|---:|---:|---:|",
        PAIRS[0].2, PAIRS[1].2, PAIRS[2].2
    )
    .unwrap();
    let ratio = |r: &floor::Round, (contended, anchor, _): (bool, &str, &str)| {
        let s = if contended {
            &r.floor.contended
        } else {
            &r.floor.uncontended
        };
        Some(s.get("proto")?.median / s.get(anchor)?.median)
    };
    let fmt = |r: Option<f64>| r.map_or_else(|| "n/a".to_string(), |r| format!("{r:.2}x"));
    for (i, r) in run.rounds.iter().enumerate() {
        writeln!(
            o,
            "| {} | {} | {} | {} |",
            i + 1,
            fmt(ratio(r, PAIRS[0])),
            fmt(ratio(r, PAIRS[1])),
            fmt(ratio(r, PAIRS[2]))
        )
        .unwrap();
    }
    let med = |p| median(run.rounds.iter().filter_map(|r| ratio(r, p)).collect());
    writeln!(
        o,
        "| median | {} | {} | {} |",
        fmt(med(PAIRS[0])),
        fmt(med(PAIRS[1])),
        fmt(med(PAIRS[2]))
    )
    .unwrap();
}

/// The median over `--floor-rounds`' rounds of keylock / `proto` on W6
/// (direct), if rounds ran.
fn rounds_w6_direct(run: &Run<'_>) -> Option<f64> {
    median(
        run.rounds
            .iter()
            .filter_map(|r| Some(r.against(true)?.direct))
            .collect(),
    )
}

/// "median (lowest-highest)", or the median alone without repetitions.
fn with_range(median: f64, reps: &[f64]) -> String {
    match verdict::range(reps) {
        Some((lo, hi)) => format!("{} ({}-{})", fmt_ns(median), fmt_ns(lo), fmt_ns(hi)),
        None => fmt_ns(median),
    }
}

/// What a goal's ratio is taken against.
enum Versus {
    Impl(&'static str),
    /// The floor's `proto` on W6.
    Floor,
}

/// One goal: `ours` / `theirs` on `workload`, at most `goal`.
struct Goal {
    workload: Workload,
    ours: &'static str,
    theirs: Versus,
    goal: f64,
}

const fn goal(workload: Workload, ours: &'static str, theirs: Versus, goal: f64) -> Goal {
    Goal {
        workload,
        ours,
        theirs,
        goal,
    }
}

/// The goals, as ratios of medians in one run.
const GOALS: &[Goal] = {
    use impls::*;
    use Versus::*;
    use Workload::*;
    const K: &str = Keylock::NAME;
    const LEASE: &str = KeylockLease::NAME;
    const TIMEOUT: &str = KeylockTimeout::NAME;
    &[
        goal(W6, K, Impl(TokioMutex::NAME), 0.7),
        goal(W6, K, Impl(DashMapCleanup::NAME), 0.5),
        goal(W6, K, Impl(Lockable::NAME), 0.5),
        goal(W6, K, Floor, 1.25),
        goal(W1, K, Impl(AsyncLockMutex::NAME), 1.0),
        goal(W1, K, Impl(DashMapCleanup::NAME), 0.25),
        goal(W1, K, Impl(Lockable::NAME), 0.25),
        goal(W1, K, Impl(DashMapLeak::NAME), 0.5),
        goal(W1, LEASE, Impl(K), 1.15),
        goal(W1, TIMEOUT, Impl(K), 1.10),
        goal(W6, LEASE, Impl(K), 1.2),
        goal(W6, TIMEOUT, Impl(K), 1.2),
        goal(W4, LEASE, Impl(K), 1.2),
        goal(W4, TIMEOUT, Impl(K), 1.2),
    ]
};

/// The goals, read off this run: ratio of medians, goal, met or not.
fn goals_table(o: &mut String, run: &Run<'_>) {
    writeln!(o, "\n### Goals: ratios of medians in this run\n").unwrap();
    run.loads.lines(o);
    if let Some(w) = load::warning(run.loads.start) {
        writeln!(o, "{w}").unwrap();
    }
    if run.cfg.quick {
        writeln!(o, "--quick: a smoke run of fewer operations, not evidence").unwrap();
    }
    let mut rows = String::new();
    for g in GOALS {
        let Some((oc, ours)) = run.cell(g.workload, g.ours) else {
            continue;
        };
        // An option's cost on W1 and W6 is read off the plain loops, where
        // both sides run in the code a user writes (`lock_with(..).await`
        // and the `Result` unwrapped where it is awaited): the harness's
        // trait wrapper adds a layer of future around an option's call that
        // no user pays (its own row in the W1 check flags it).
        let plain_option = matches!(g.workload, Workload::W1 | Workload::W6)
            && g.ours != impls::Keylock::NAME
            && matches!(g.theirs, Versus::Impl(name) if name == impls::Keylock::NAME);
        let our_median = if plain_option {
            median(ours.plain.clone())
        } else {
            ours.median()
        };
        let Some(our_median) = our_median else {
            continue;
        };
        // Repetitions of a FIFO lock that W6 did not contend throughout.
        let alone = |c: &Contender, cell: &Cell| {
            let shares = if plain_option {
                cell.plain_shares()
            } else {
                cell.shares()
            };
            let low = shares.iter().filter(|&&s| ran_alone(c, s)).count();
            (g.workload == Workload::W6 && low > 0).then(|| {
                format!(
                    "{}: {low} of {} reps below {CONTENDED_SHARE}% handoffs",
                    c.name,
                    shares.len()
                )
            })
        };
        let mut notes: Vec<String> = alone(oc, ours).into_iter().collect();
        // Notes that say how the figure was taken, not whether it contended.
        let mut after: Vec<String> = Vec::new();
        let (label, theirs) = match &g.theirs {
            Versus::Impl(name) => {
                let Some((tc, cell)) = run.cell(g.workload, name) else {
                    continue;
                };
                let m = if plain_option {
                    median(cell.plain.clone())
                } else {
                    cell.median()
                };
                let Some(m) = m else { continue };
                notes.extend(alone(tc, cell));

                (format!("{} / {name}", g.ours), m)
            }
            Versus::Floor => {
                let Some(Ok(f)) = run.floor else { continue };
                let Some(proto) = f.contended.get("proto") else {
                    continue;
                };
                if let Some(ratio) = rounds_w6_direct(run) {
                    // Each round's keylock beside its own floor run: the
                    // median of those ratios, not this run's keylock
                    // against the last floor run (whose repetitions'
                    // handoff shares are not this figure's either).
                    notes.clear();
                    let low = run
                        .rounds
                        .iter()
                        .filter(|r| r.w6_share < CONTENDED_SHARE)
                        .count();
                    if low > 0 {
                        notes.push(format!(
                            "{}: {low} of {} rounds had a rep below {CONTENDED_SHARE}% handoffs",
                            g.ours,
                            run.rounds.len()
                        ));
                    }
                    after.push(format!(
                        "median of {} rounds' ratios (round by round above)",
                        run.rounds.len()
                    ));
                    (format!("{} / floor `proto`", g.ours), our_median / ratio)
                } else {
                    (format!("{} / floor `proto`", g.ours), proto.median)
                }
            }
        };
        let ratio = our_median / theirs;
        let met = match (ratio <= g.goal, notes.is_empty()) {
            (true, true) => "met",
            (false, true) => "not met",
            // A W6 side whose repetitions did not all contend: not the
            // contended figure the goal is about.
            (true, false) => "met, not contended",
            (false, false) => "not met, not contended",
        };
        notes.append(&mut after);
        if plain_option {
            notes.push("plain loops (the code a user writes)".to_string());
            if let (Some(clock), Some((_, plain))) = (
                median(ours.clock.clone()),
                run.cell(g.workload, impls::Keylock::NAME),
            ) {
                if let Some(plain) = median(plain.plain.clone()) {
                    notes.push(format!(
                        "one read of the clock a 30 s lease starts from (coarse monotonic) \
                         alone: {clock:.1} ns, {:.2}x plain's time (the goal leaves {:.1} ns)",
                        1.0 + clock / plain,
                        (g.goal - 1.0) * plain
                    ));
                }
            }
        }
        writeln!(
            rows,
            "| {} | {label} | {ratio:.2}x | ≤ {:.2}x | {met} | {} |",
            g.workload.id(),
            g.goal,
            notes.join("; ")
        )
        .unwrap();
    }
    if rows.is_empty() {
        writeln!(o, "\nNo goal applies: their implementations were not run.").unwrap();
        return;
    }
    writeln!(
        o,
        "\n| workload | ratio | measured | goal | | note |\n|---|---|---:|---:|---|---|"
    )
    .unwrap();
    o.push_str(&rows);
}
