//! What `compare` and `showcase` share beyond the workloads: the repetitions
//! of one measurement, the verdict their spread allows, and the progress bar.
//!
//! A verdict says "faster" or "slower" only when the repetitions do not
//! overlap: keylock's slowest repetition beat the other's fastest (faster),
//! or its fastest lost to the other's slowest (slower). Anything else is
//! "≈ (within noise)", whatever the medians say: on a busy machine two
//! medians a few percent apart are not a result.

use indicatif::{ProgressBar, ProgressStyle};

/// The median of `ns` (sorted in place); `None` if empty.
pub(crate) fn median(ns: &mut [f64]) -> Option<f64> {
    ns.sort_by(f64::total_cmp);
    (!ns.is_empty()).then(|| {
        let m = ns.len() / 2;
        if ns.len() % 2 == 1 {
            ns[m]
        } else {
            (ns[m - 1] + ns[m]) / 2.0
        }
    })
}

/// The fastest and slowest of `ns`; `None` if empty.
pub(crate) fn range(ns: &[f64]) -> Option<(f64, f64)> {
    let min = ns.iter().copied().min_by(f64::total_cmp)?;
    let max = ns.iter().copied().max_by(f64::total_cmp)?;
    Some((min, max))
}

/// (max - min) / median of `ns`, in percent; `None` if empty.
pub(crate) fn spread(ns: &[f64]) -> Option<f64> {
    let (min, max) = range(ns)?;
    let med = median(&mut ns.to_vec())?;
    Some((max - min) / med * 100.0)
}

/// How one implementation's repetitions compare with another's, in time per
/// operation (lower is faster).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every repetition of ours took less time than every one of theirs.
    Faster,
    /// Every repetition of ours took more time than every one of theirs.
    Slower,
    /// The repetitions overlap: the difference, if any, is within the noise.
    Within,
}

impl Verdict {
    /// `ours` against `theirs` (ns/op of each repetition); `None` if either
    /// is empty.
    pub(crate) fn of(ours: &[f64], theirs: &[f64]) -> Option<Self> {
        let (our_min, our_max) = range(ours)?;
        let (their_min, their_max) = range(theirs)?;
        Some(if our_max < their_min {
            Self::Faster
        } else if our_min > their_max {
            Self::Slower
        } else {
            Self::Within
        })
    }

    /// The word printed in a table cell.
    pub(crate) fn word(self) -> &'static str {
        match self {
            Self::Faster => "faster",
            Self::Slower => "slower",
            Self::Within => "≈ (within noise)",
        }
    }
}

/// One table cell: `ours` against `theirs` as "median (ratio, verdict)",
/// ratio = median(ours) / median(theirs), shown in the row of `theirs`
/// with `theirs`'s median. `None` if `theirs` has no repetitions.
pub(crate) fn cell(ours: &[f64], theirs: &[f64]) -> Option<String> {
    let their_median = median(&mut theirs.to_vec())?;
    let Some(our_median) = median(&mut ours.to_vec()) else {
        return Some(fmt_ns(their_median));
    };
    let verdict = Verdict::of(ours, theirs)?;
    Some(format!(
        "{} ({:.2}x, {})",
        fmt_ns(their_median),
        our_median / their_median,
        verdict.word()
    ))
}

/// One cell of the cost of an option (a lease, a timeout): `option`'s
/// median, then option / plain keylock (above 1: the option costs time),
/// then the verdict of the option against plain keylock. `None` if `option`
/// has no repetitions.
pub(crate) fn option_cell(option: &[f64], plain: &[f64]) -> Option<String> {
    let option_median = median(&mut option.to_vec())?;
    let Some(plain_median) = median(&mut plain.to_vec()) else {
        return Some(fmt_ns(option_median));
    };
    let word = match Verdict::of(option, plain)? {
        Verdict::Slower => "costs time",
        Verdict::Faster => "faster",
        Verdict::Within => "≈ (within noise)",
    };
    Some(format!(
        "{} ({:.2}x plain, {word})",
        fmt_ns(option_median),
        option_median / plain_median
    ))
}

/// The legend of a table of [`option_cell`]s.
pub(crate) const OPTION_LEGEND: &str = "\
keylock+lease takes every lock with a one-hour lease, keylock+timeout with a \
one-hour timeout: the same table, so these rows are the *cost of the option*, \
not anchors. Each cell is the option's median ns/op, then option / plain \
keylock (1.10x plain: 10% more time per operation), then \"costs time\" only \
if the option's fastest repetition was slower than plain keylock's slowest, \
\"faster\" only if its slowest beat plain keylock's fastest, otherwise \
\"≈ (within noise)\".";

/// The legend printed above a table of [`cell`]s.
pub(crate) const LEGEND: &str = "\
An *anchor* is an implementation keylock is measured against in the same run: \
the keyed locks people write by hand (a `DashMap` of `Arc<tokio::sync::Mutex<()>>`, \
with or without removing idle entries; the `lockable` crate) and single, \
non-keyed mutexes (\"one lock, all keys\": the floor on one key, what a keyed \
lock replaces on many). Each cell is the anchor's median time per operation \
in ns, then the *ratio* keylock / anchor (below 1: keylock takes less time; \
0.50x is twice as fast), then the *verdict*: \"faster\" only if keylock's \
slowest repetition beat the anchor's fastest, \"slower\" only if keylock's \
fastest lost to the anchor's slowest, otherwise \"≈ (within noise)\".";

/// A progress bar on stderr for `len` measurements (hidden when stderr is
/// not a terminal). Its message names the measurement running.
pub(crate) fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{elapsed:>4} [{bar:32}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// ns/op with the precision it deserves.
/// Above this, harness / plain loop (or its inverse) is flagged in the W1
/// check: the harness must run every implementation at the cost a plain loop
/// measures for it.
pub(crate) const PLAIN_TOLERANCE: f64 = 1.15;

/// One row of the W1 check: harness and plain-loop medians, their ratio, and
/// a flag when they disagree by more than [`PLAIN_TOLERANCE`].
pub(crate) fn plain_check_row(name: &str, harness: f64, plain: f64) -> String {
    let flag = if harness / plain > PLAIN_TOLERANCE {
        " **harness slower**"
    } else if plain / harness > PLAIN_TOLERANCE {
        " **harness faster**"
    } else {
        ""
    };
    format!(
        "| {name} | {} | {} | {:.2}{flag} |",
        fmt_ns(harness),
        fmt_ns(plain),
        harness / plain
    )
}

pub(crate) fn fmt_ns(ns: f64) -> String {
    if ns >= 100.0 {
        format!("{ns:.0}")
    } else {
        format!("{ns:.1}")
    }
}
