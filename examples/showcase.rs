//! keylock in under a minute: what it does, then how it compares.
//!
//! ```text
//! cargo run --release --example showcase              # ~30 s: the story, then the comparison
//! cargo run --release --example showcase -- --quick   # ~5 s: the story, a short comparison
//! cargo run --release --example showcase -- --story   # the story alone, under a second
//! cargo run --release --example showcase -- --svg docs/showcase.svg
//! ```
//!
//! Part 1 (`showcase/story.rs`) tells the story: one table shared by tokio,
//! async-std and a plain thread with FIFO handoff; a lease lapsing and the
//! successor's fencing token refusing the stale holder's write; a timeout
//! that names its holder, acted on with `revoke_grant`; cancellation that
//! leaves nothing behind. Every value it prints is checked first.
//!
//! Part 2 (`showcase/bench.rs`) measures keylock against the keyed locks
//! people write by hand, with `compare`'s workloads and harness
//! (`compare/*.rs`). It opens with the workloads, each with one sentence on
//! what its figures mean for a user (where keylock wins, where it ties,
//! where a single mutex is the right tool), then prints markdown tables
//! whose verdicts say "faster" or "slower" only when the repetitions do not
//! overlap, and writes an SVG chart (`showcase/chart.rs`; default
//! `target/showcase.svg`). A progress bar goes to stderr; everything else
//! to stdout.
//!
//! Build it in release: a debug build measures the debug build.

#[path = "showcase/bench.rs"]
mod bench;
#[path = "showcase/chart.rs"]
mod chart;
// Shared with `compare`, which uses every item; here some go unused.
#[allow(dead_code)]
#[path = "compare/impls.rs"]
mod impls;
#[allow(dead_code)]
#[path = "compare/plain.rs"]
mod plain;
#[path = "showcase/story.rs"]
mod story;
#[path = "compare/verdict.rs"]
mod verdict;
#[allow(dead_code)]
#[path = "compare/workloads.rs"]
mod workloads;

use std::path::PathBuf;

struct Args {
    quick: bool,
    story_only: bool,
    reps: Option<usize>,
    svg: PathBuf,
}

fn usage() -> ! {
    eprintln!("usage: showcase [--quick] [--story] [--reps N] [--svg PATH]");
    std::process::exit(2)
}

fn parse() -> Args {
    let mut args = Args {
        quick: false,
        story_only: false,
        reps: None,
        svg: PathBuf::from("target/showcase.svg"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => args.quick = true,
            "--story" => args.story_only = true,
            "--reps" => {
                args.reps = Some(
                    it.next()
                        .and_then(|n| n.parse().ok())
                        .filter(|&n| n > 0)
                        .unwrap_or_else(|| usage()),
                )
            }
            "--svg" => args.svg = it.next().map(PathBuf::from).unwrap_or_else(|| usage()),
            _ => usage(),
        }
    }
    args
}

fn main() {
    let args = parse();
    if cfg!(debug_assertions) {
        println!("(a debug build: part 2 measures the debug build; run with --release)\n");
    }

    // The story sleeps (tokio's timers); the measurements run as compare's.
    let story = story::run(&workloads::runtime_with_drivers());
    let rt = workloads::runtime();
    println!("\nPart 1 took {:.0} ms.", story.as_secs_f64() * 1000.0);
    if args.story_only {
        return;
    }

    println!("\n# Part 2: keylock against the hand-written keyed locks\n");
    println!("{}", bench::preface(args.quick));
    let reps = args.reps.unwrap_or(if args.quick { 3 } else { 5 });
    let results = bench::run(&rt, args.quick, reps);
    print!("{}", results.report());
    match chart::write(&results, &args.svg) {
        Ok(()) => println!("\nChart: {}", args.svg.display()),
        Err(e) => {
            eprintln!("showcase: could not write {}: {e}", args.svg.display());
            std::process::exit(1);
        }
    }
}
