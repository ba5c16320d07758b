//! keylock against the keyed-lock options people write today, side by side.
//!
//! ```text
//! cargo run --release --example compare              # full run, ~1-2 minutes on 2 cores
//! cargo run --release --example compare -- --quick   # CI smoke, a few seconds
//! cargo run --release --example compare -- --only W1,W6 --impl keylock,tokio
//! cargo run --release --example compare -- --only bank   # the bank alone
//! ```
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
//! cost a plain loop measures for it. A progress bar goes to stderr (when it
//! is a terminal), tables to stdout. A ratio says "faster" or "slower" only
//! when the repetitions do not overlap (`compare/verdict.rs`).

#[path = "compare/bank.rs"]
mod bank;
#[path = "compare/impls.rs"]
mod impls;
#[path = "compare/plain.rs"]
mod plain;
#[path = "compare/verdict.rs"]
mod verdict;
#[path = "compare/workloads.rs"]
mod workloads;

use std::fmt::Write as _;
use std::mem::{size_of, size_of_val};
use std::sync::Arc;
use std::time::Duration;

use impls::KeyedLock;
use tokio::runtime::Runtime;
use workloads::{Outcome, Workload};

type RunFn = fn(&Runtime, Workload, u64, &Arc<Vec<Vec<u64>>>) -> Option<Outcome>;

/// One implementation, erased.
struct Contender {
    name: &'static str,
    keyed: bool,
    run: RunFn,
    self_check: fn(&Runtime) -> Option<usize>,
    /// Size of its lock future (as created, not polled) and of its guard.
    sizes: fn() -> (usize, usize),
    /// W1 as a plain loop, without the harness.
    plain_w1: fn(&Runtime, u64) -> Duration,
}

const fn contender<I: KeyedLock>(plain_w1: fn(&Runtime, u64) -> Duration) -> Contender {
    Contender {
        name: I::NAME,
        keyed: I::KEYED,
        run: workloads::run::<I>,
        self_check: workloads::self_check::<I>,
        sizes: sizes::<I>,
        plain_w1,
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
    contender::<impls::Keylock>(plain::keylock),
    contender::<impls::KeylockLease>(plain::keylock_lease),
    contender::<impls::KeylockTimeout>(plain::keylock_timeout),
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
        let mut reps = None;
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
        }
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: compare [--quick] [--reps N] [--only W1,W2,...,bank] [--impl keylock,tokio,...]"
    );
    std::process::exit(2)
}

/// All repetitions of one implementation on one workload.
#[derive(Default, Clone)]
struct Cell {
    samples: Vec<Outcome>,
    /// W1 only: the plain loop's ns/op, one per repetition.
    plain: Vec<f64>,
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
}

fn main() {
    let cfg = Config::parse();
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
        .map(|&w| cfg.reps * cfg.impls.len() * if w == Workload::W1 { 2 } else { 1 })
        .sum();
    let bar = verdict::progress(measurements as u64);
    for (wi, &w) in cfg.workloads.iter().enumerate() {
        for rep in 0..cfg.reps {
            for (ii, c) in cfg.impls.iter().enumerate() {
                bar.set_message(format!("{} {}/{} {}", w.id(), rep + 1, cfg.reps, c.name));
                let out = (c.run)(&rt, w, cfg.ops(w), &zipf);
                bar.inc(1);
                let Some(out) = out else {
                    if w == Workload::W1 {
                        bar.inc(1);
                    }
                    continue;
                };
                results[wi][ii].samples.push(out);
                if w == Workload::W1 {
                    bar.set_message(format!(
                        "{} {}/{} {} (plain loop)",
                        w.id(),
                        rep + 1,
                        cfg.reps,
                        c.name
                    ));
                    let ops = cfg.ops(w);
                    let ns = (c.plain_w1)(&rt, ops).as_nanos() as f64 / ops as f64;
                    bar.inc(1);
                    results[wi][ii].plain.push(ns);
                }
            }
        }
    }
    bar.finish_and_clear();
    let bank = cfg.bank.then(|| {
        let shape = bank::BankRun {
            accounts: 64,
            tellers: 32,
            transfers: if cfg.quick { 1_000 } else { 10_000 },
            auditors: 2,
        };
        eprintln!("running the bank...");
        bank::compare(&rt, shape, cfg.reps, Duration::from_secs(120))
    });
    let wall = started.elapsed();

    print!(
        "{}",
        report(&cfg, &results, &leftovers, bank.as_deref(), wall)
    );
}

fn report(
    cfg: &Config,
    results: &[Vec<Cell>],
    leftovers: &[Option<usize>],
    bank: Option<&str>,
    wall: std::time::Duration,
) -> String {
    let mut out = String::new();
    let o = &mut out;
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

    let counted: Vec<usize> = (0..cfg.workloads.len())
        .filter(|&wi| cfg.workloads[wi].counts_handoffs())
        .collect();
    if !counted.is_empty() {
        writeln!(
            o,
            "\n### Handoffs in the last repetition: acquisitions that went to another task than the previous holder\n"
        )
        .unwrap();
        write!(o, "| implementation |").unwrap();
        for &wi in &counted {
            write!(o, " {} |", cfg.workloads[wi].id()).unwrap();
        }
        write!(o, "\n|---|").unwrap();
        for _ in &counted {
            write!(o, "---:|").unwrap();
        }
        o.push('\n');
        for (ii, c) in cfg.impls.iter().enumerate() {
            write!(o, "| {} |", c.name).unwrap();
            for &wi in &counted {
                match results[wi][ii]
                    .last()
                    .and_then(|s| Some((s.handoffs?, s.ops)))
                {
                    None => write!(o, " n/a |").unwrap(),
                    Some((h, ops)) => {
                        write!(o, " {:.1}% |", h as f64 / ops as f64 * 100.0).unwrap()
                    }
                }
            }
            o.push('\n');
        }
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
    out
}

use verdict::{fmt_ns, PLAIN_TOLERANCE};

/// keylock itself with a lease or timeout: compared with plain keylock, not
/// an anchor.
fn is_option(c: &Contender) -> bool {
    c.name.starts_with("keylock+")
}
