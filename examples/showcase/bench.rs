//! Part 2 of the showcase: keylock against the hand-written keyed locks, on
//! a subset of `compare`'s workloads sized to run in about half a minute
//! (`--quick`: a few seconds), with the same harness, the same interleaving
//! of implementations and the same W1 check against plain loops.
//!
//! Returns the measurements for the chart and prints markdown tables: one
//! per question, one measure per cell.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use crate::impls::{self, KeyedLock};
use crate::verdict::{self, fmt_ns, PLAIN_TOLERANCE};
use crate::workloads::{self, Outcome, Workload};

/// Runs one workload for about so many operations (`workloads::run`).
type RunFn = fn(&Runtime, Workload, u64, &Arc<Vec<Vec<u64>>>) -> Option<Outcome>;

/// One implementation, erased.
pub(crate) struct Contender {
    pub(crate) name: &'static str,
    keyed: bool,
    /// keylock with a lease or timeout: compared with plain keylock.
    option: bool,
    run: RunFn,
    plain_w1: fn(&Runtime, u64) -> Duration,
}

const fn contender<I: KeyedLock>(
    option: bool,
    plain_w1: fn(&Runtime, u64) -> Duration,
) -> Contender {
    Contender {
        name: I::NAME,
        keyed: I::KEYED,
        option,
        run: workloads::run::<I>,
        plain_w1,
    }
}

/// keylock first, then the anchors, then keylock's options.
pub(crate) const CONTENDERS: &[Contender] = &[
    contender::<impls::Keylock>(false, crate::plain::keylock),
    contender::<impls::DashMapLeak>(false, crate::plain::dashmap_leak),
    contender::<impls::DashMapCleanup>(false, crate::plain::dashmap_cleanup),
    contender::<impls::Lockable>(false, crate::plain::lockable),
    contender::<impls::TokioMutex>(false, crate::plain::tokio_mutex),
    contender::<impls::AsyncLockMutex>(false, crate::plain::async_lock_mutex),
    contender::<impls::KeylockLease>(true, crate::plain::keylock_lease),
    contender::<impls::KeylockTimeout>(true, crate::plain::keylock_timeout),
];

/// The workloads shown (W5, the cancellation storm, is left to `compare`).
pub(crate) const WORKLOADS: [Workload; 5] = [
    Workload::W1,
    Workload::W2,
    Workload::W3,
    Workload::W4,
    Workload::W6,
];

/// Operations per measurement: half of `compare`'s full run, a twelfth
/// with `--quick` (W6 a quarter, so that its tasks still overlap).
fn ops(w: Workload, quick: bool) -> u64 {
    let full: u64 = match w {
        Workload::W1 => 2_000_000,
        Workload::W2 => 1_000_000,
        Workload::W3 => 256_000,
        Workload::W4 => 512_000,
        Workload::W5 => 1_048_576,
        Workload::W6 => 1_000_000,
    };
    match (quick, w) {
        (false, _) => full / 2,
        (true, Workload::W6) => full / 4,
        (true, _) => full / 12,
    }
}

/// What a workload's figures mean for a user: where keylock wins, where
/// it ties, where a single mutex is the right tool. Drawn from the runs on
/// an idle machine in BENCHMARKS.md; the tables of this run follow.
fn meaning(w: Workload) -> &'static str {
    match w {
        Workload::W1 => {
            "the price of a lock nobody contends: keylock wins against every keyed map \
             (no `Arc` clone, no entry made and removed per lock) and against tokio's and \
             async_lock's single mutexes, though they have no map to look up; a synchronous \
             mutex takes less time still: if you only ever lock one thing, one mutex is the \
             simpler tool."
        }
        Workload::W2 => {
            "many keys, each touched once (requests on distinct ids): keylock wins against \
             the maps and keeps no entry afterwards (the leaky map keeps one per key: see \
             \"Keys left\"), and against the single mutexes, which also make every key \
             wait for every other."
        }
        Workload::W3 => {
            "a hot key held across an `.await`: every lock waits, and most of the time goes \
             to waking and switching tasks, not to the lock: keylock comes out ahead of each \
             (0.7-0.85x on an idle machine), by less than on the other rows."
        }
        Workload::W4 => {
            "what a keyed lock is for: tasks on different keys proceed together, so keylock \
             wins against the single mutexes (where all 64 tasks queue on one lock) and \
             wins or ties against the hand-written maps."
        }
        Workload::W5 => "the cost of waits that are cancelled (not shown here: see `compare`).",
        Workload::W6 => {
            "a tiny critical section on one hot key: when the tasks contend (a handoff \
             share near 100% under \"Handoffs\"), keylock hands the key to the oldest \
             waiter every time and beats the maps and tokio's mutex; at a low share the \
             tasks did not overlap (one worker ran alone, as on a busy machine) and the row \
             is an uncontended loop. async_lock's mutex lets the releasing task take the key \
             straight back (it barges), so it often runs a task's whole loop without a \
             handoff and can be several times faster, with figures that vary run to run: \
             for one hot key with tiny critical sections and no need for arrival order, a \
             single barging mutex is the right tool."
        }
    }
}

/// The opening of Part 2, printed before it runs: the workloads, each with
/// what its figures mean for a user.
pub(crate) fn preface(quick: bool) -> String {
    let mut o = String::new();
    writeln!(
        o,
        "Every workload runs on a tokio runtime with 2 workers; keylock runs against \
         the keyed locks people write by hand and against single mutexes (one lock for \
         all keys: not keyed, the floor on one key). Each workload, then what its figures \
         mean for you:\n"
    )
    .unwrap();
    for w in WORKLOADS {
        writeln!(
            o,
            "- {}: {} ({} ops per repetition).\n  For you: {}",
            w.id(),
            w.describe(),
            ops(w, quick),
            meaning(w)
        )
        .unwrap();
    }
    if quick {
        writeln!(
            o,
            "\n--quick: a few repetitions of short runs, noisier than the full run; \
             a figure that counts is taken as BENCHMARKS.md says."
        )
        .unwrap();
    }
    o
}

/// Every repetition of every contender on every workload.
pub(crate) struct Results {
    pub(crate) reps: usize,
    pub(crate) quick: bool,
    /// ns/op, `[workload][contender][repetition]`.
    pub(crate) ns: Vec<Vec<Vec<f64>>>,
    /// W1 only: the plain loops' ns/op, `[contender][repetition]`.
    plain: Vec<Vec<f64>>,
    /// The last repetition's outcome, `[workload][contender]`.
    last: Vec<Vec<Option<Outcome>>>,
    pub(crate) wall: Duration,
}

/// Runs every workload, `reps` times, the contenders interleaved within
/// each repetition.
pub(crate) fn run(rt: &Runtime, quick: bool, reps: usize) -> Results {
    let started = Instant::now();
    let per_task = ops(Workload::W4, quick).div_ceil(workloads::TASKS as u64) as usize;
    let zipf = workloads::zipf_sequences(per_task);
    let n = CONTENDERS.len();
    let mut results = Results {
        reps,
        quick,
        ns: vec![vec![Vec::new(); n]; WORKLOADS.len()],
        plain: vec![Vec::new(); n],
        last: vec![vec![None; n]; WORKLOADS.len()],
        wall: Duration::ZERO,
    };
    // W1 runs twice per contender: through the harness and as a plain loop.
    let bar = verdict::progress(((WORKLOADS.len() + 1) * reps * n) as u64);
    for (wi, &w) in WORKLOADS.iter().enumerate() {
        for rep in 0..reps {
            for (ci, c) in CONTENDERS.iter().enumerate() {
                bar.set_message(format!("{} {}/{reps} {}", w.id(), rep + 1, c.name));
                let out = (c.run)(rt, w, ops(w, quick), &zipf).expect("every contender is async");
                bar.inc(1);
                results.ns[wi][ci].push(out.ns_per_op());
                results.last[wi][ci] = Some(out);
                if w == Workload::W1 {
                    bar.set_message(format!("W1 {}/{reps} {} (plain loop)", rep + 1, c.name));
                    let iters = ops(w, quick);
                    let t = (c.plain_w1)(rt, iters);
                    results.plain[ci].push(t.as_nanos() as f64 / iters as f64);
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    results.wall = started.elapsed();
    results
}

impl Results {
    /// The markdown report.
    pub(crate) fn report(&self) -> String {
        let mut out = String::new();
        let o = &mut out;
        let keylock = 0;
        let header = |o: &mut String, first: &str| {
            write!(o, "| {first} |").unwrap();
            for w in WORKLOADS {
                write!(o, " {} |", w.id()).unwrap();
            }
            write!(o, "\n|---|").unwrap();
            for _ in WORKLOADS {
                write!(o, "---:|").unwrap();
            }
            o.push('\n');
        };

        writeln!(
            o,
            "### keylock against each anchor: median ns/op of {} repetitions{}\n\n{}\n",
            self.reps,
            if self.quick { " (--quick)" } else { "" },
            verdict::LEGEND
        )
        .unwrap();
        header(o, "implementation");
        for (ci, c) in CONTENDERS.iter().enumerate() {
            if c.option {
                continue;
            }
            if ci == keylock {
                write!(o, "| **keylock** |").unwrap();
            } else if c.keyed {
                write!(o, "| {} |", c.name).unwrap();
            } else {
                write!(o, "| {} (one lock, all keys) |", c.name).unwrap();
            }
            for wi in 0..WORKLOADS.len() {
                let text = if ci == keylock {
                    verdict::median(&mut self.ns[wi][ci].clone())
                        .map(|ns| format!("**{}**", fmt_ns(ns)))
                } else {
                    verdict::cell(&self.ns[wi][keylock], &self.ns[wi][ci])
                };
                write!(o, " {} |", text.as_deref().unwrap_or("n/a")).unwrap();
            }
            o.push('\n');
        }

        writeln!(
            o,
            "\n### Cost of the options: median ns/op against plain keylock\n\n{}\n",
            verdict::OPTION_LEGEND
        )
        .unwrap();
        header(o, "option");
        for (ci, c) in CONTENDERS.iter().enumerate().filter(|(_, c)| c.option) {
            write!(o, "| {} |", c.name).unwrap();
            for wi in 0..WORKLOADS.len() {
                let text = verdict::option_cell(&self.ns[wi][ci], &self.ns[wi][keylock]);
                write!(o, " {} |", text.as_deref().unwrap_or("n/a")).unwrap();
            }
            o.push('\n');
        }

        writeln!(
            o,
            "\n### Spread of the repetitions: (max - min) / median\n\n\
             How far one implementation's repetitions disagree on this machine: \
             a difference smaller than this is noise.\n"
        )
        .unwrap();
        header(o, "implementation");
        for (ci, c) in CONTENDERS.iter().enumerate() {
            write!(o, "| {} |", c.name).unwrap();
            for wi in 0..WORKLOADS.len() {
                match verdict::spread(&self.ns[wi][ci]) {
                    Some(s) => write!(o, " {s:.0}% |").unwrap(),
                    None => write!(o, " n/a |").unwrap(),
                }
            }
            o.push('\n');
        }

        writeln!(
            o,
            "\n### Keys left in the map after the last repetition (- : one lock, no map)\n"
        )
        .unwrap();
        header(o, "implementation");
        for (ci, c) in CONTENDERS.iter().enumerate() {
            write!(o, "| {} |", c.name).unwrap();
            for wi in 0..WORKLOADS.len() {
                match self.last[wi][ci].map(|out| out.entries_left) {
                    Some(Some(n)) => write!(o, " {n} |").unwrap(),
                    Some(None) => write!(o, " - |").unwrap(),
                    None => write!(o, " n/a |").unwrap(),
                }
            }
            o.push('\n');
        }

        writeln!(
            o,
            "\n### Handoffs in the last repetition (W3, W6): acquisitions that went to \
             another task than the previous holder\n\n\
             | implementation | W3 | W6 |\n|---|---:|---:|"
        )
        .unwrap();
        let w3 = WORKLOADS.iter().position(|&w| w == Workload::W3).unwrap();
        let w6 = WORKLOADS.iter().position(|&w| w == Workload::W6).unwrap();
        for (ci, c) in CONTENDERS.iter().enumerate() {
            write!(o, "| {} |", c.name).unwrap();
            for wi in [w3, w6] {
                match self.last[wi][ci].and_then(|out| Some((out.handoffs?, out.ops))) {
                    Some((h, ops)) => {
                        write!(o, " {:.1}% |", h as f64 / ops as f64 * 100.0).unwrap()
                    }
                    None => write!(o, " n/a |").unwrap(),
                }
            }
            o.push('\n');
        }

        writeln!(
            o,
            "\n### W1 check: the harness against a plain loop (median ns/op)\n\n\
             A harness must not flatter keylock: each implementation runs here at \
             the cost a plain loop of its own types measures for it, interleaved \
             with the harness; harness / plain above {PLAIN_TOLERANCE} or below \
             1/{PLAIN_TOLERANCE} is flagged.\n\n\
             | implementation | harness | plain loop | harness / plain |\n|---|---:|---:|---:|"
        )
        .unwrap();
        let w1 = WORKLOADS.iter().position(|&w| w == Workload::W1).unwrap();
        for (ci, c) in CONTENDERS.iter().enumerate() {
            let (Some(h), Some(p)) = (
                verdict::median(&mut self.ns[w1][ci].clone()),
                verdict::median(&mut self.plain[ci].clone()),
            ) else {
                continue;
            };
            writeln!(o, "{}", verdict::plain_check_row(c.name, h, p)).unwrap();
        }

        writeln!(o, "\nPart 2 wall time: {:.1} s", self.wall.as_secs_f64()).unwrap();
        out
    }
}
