//! The floor: a measuring stick outside this crate, run by `compare --floor
//! PATH` (or `KEYLOCK_FLOOR=PATH`) after keylock's own measurements.
//!
//! The floor is a minimal keyed lock with keylock's plain-lock semantics and
//! nothing else, timed side by side with tokio's and async-lock's mutexes in
//! its own harness: how fast a keyed async lock can be on this machine
//! today. `compare` runs the binary with no arguments, reads the `proto:`
//! median of its two sections (uncontended hot key; contended, 64 tasks on
//! one key) and its `tokio:` and `async_lock:` rows, and prints keylock
//! against the floor, with the floor's anchors beside this run's so that a
//! reader sees whether the two harnesses agree.
//!
//! The output it reads: a header line per section, starting with `==` and
//! naming `uncontended` or `contended`, then one line per implementation,
//! `name: median [rep rep ...]` (ns per operation). Any other line is
//! ignored.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One row of a section: the median and every repetition, ns/op.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) median: f64,
    pub(crate) reps: Vec<f64>,
}

/// One section of the floor's output.
#[derive(Clone, Debug, Default)]
pub(crate) struct Section {
    /// The largest number in the section's header: its operations per
    /// measurement.
    pub(crate) ops: Option<u64>,
    pub(crate) rows: Vec<Row>,
}

impl Section {
    pub(crate) fn get(&self, name: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.name == name)
    }
}

/// What one run of the floor measured.
#[derive(Clone, Debug)]
pub(crate) struct Floor {
    /// One task, one key, lock+unlock: against W1.
    pub(crate) uncontended: Section,
    /// 64 tasks, one key, a counter increment under the lock: against W6.
    pub(crate) contended: Section,
    pub(crate) wall: Duration,
}

/// Runs the floor at `path` (no arguments; its stderr passes through) and
/// parses what it prints.
pub(crate) fn run(path: &Path) -> Result<Floor, String> {
    let name = display_name(path);
    let started = Instant::now();
    let out = Command::new(path)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not run the floor `{name}`: {e}"))?;
    let wall = started.elapsed();
    if !out.status.success() {
        return Err(format!("the floor `{name}` failed ({})", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (uncontended, contended) =
        parse(&text).map_err(|e| format!("the floor `{name}`'s output did not parse: {e}"))?;
    Ok(Floor {
        uncontended,
        contended,
        wall,
    })
}

/// The binary's file name, not its path: a report names no local paths.
pub(crate) fn display_name(path: &Path) -> String {
    path.file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// The two sections of the floor's output; an error if either is missing or
/// has no `proto:` row.
pub(crate) fn parse(text: &str) -> Result<(Section, Section), String> {
    #[derive(Clone, Copy, PartialEq)]
    enum In {
        Nothing,
        Uncontended,
        Contended,
    }
    let mut at = In::Nothing;
    let (mut uncontended, mut contended) = (None::<Section>, None::<Section>);
    for line in text.lines() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix("==") {
            let lower = header.to_ascii_lowercase();
            let section = Section {
                ops: header
                    .split(|c: char| !c.is_ascii_digit())
                    .filter_map(|n| n.parse::<u64>().ok())
                    .max(),
                rows: Vec::new(),
            };
            at = if lower.contains("uncontended") {
                uncontended = Some(section);
                In::Uncontended
            } else if lower.contains("contended") {
                contended = Some(section);
                In::Contended
            } else {
                In::Nothing
            };
            continue;
        }
        let section = match at {
            In::Nothing => continue,
            In::Uncontended => uncontended.as_mut(),
            In::Contended => contended.as_mut(),
        };
        if let (Some(section), Some(row)) = (section, parse_row(line)) {
            section.rows.push(row);
        }
    }
    let check = |s: Option<Section>, what: &str| -> Result<Section, String> {
        let s = s.ok_or_else(|| format!("no `== {what} ...` header"))?;
        if s.get("proto").is_none() {
            return Err(format!("no `proto:` row under the {what} header"));
        }
        Ok(s)
    };
    Ok((
        check(uncontended, "uncontended")?,
        check(contended, "contended")?,
    ))
}

/// `name: median [rep rep ...]`; `None` for any other line.
fn parse_row(line: &str) -> Option<Row> {
    let (name, rest) = line.split_once(':')?;
    let name = name.trim();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    let rest = rest.trim();
    let median = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    let reps = rest
        .split_once('[')
        .and_then(|(_, r)| r.split_once(']'))
        .map(|(r, _)| {
            r.split_whitespace()
                .filter_map(|x| x.parse::<f64>().ok())
                .collect()
        })
        .unwrap_or_default();
    Some(Row {
        name: name.to_string(),
        median,
        reps,
    })
}

/// One round of `compare --floor-rounds N`: keylock and tokio's mutex on W1
/// and W6 in `compare`'s process, then the floor, minutes apart at most.
#[derive(Clone, Debug)]
pub(crate) struct Round {
    /// The 1-minute load average as the round began.
    pub(crate) load: Option<f64>,
    /// keylock's and tokio's mutex's medians (ns/op) on W1, in this process.
    pub(crate) w1: (f64, f64),
    /// The same on W6.
    pub(crate) w6: (f64, f64),
    /// The lowest handoff share (percent) of keylock's W6 repetitions.
    pub(crate) w6_share: f64,
    /// The floor's run right after.
    pub(crate) floor: Floor,
}

/// What a round sets against the floor on one workload.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Against {
    /// keylock / the floor's `proto`.
    pub(crate) direct: f64,
    /// (keylock / tokio here) / (`proto` / `tokio` in the floor's harness):
    /// the same ratio through the anchor both harnesses time, which cancels
    /// what the two harnesses do differently.
    pub(crate) through_tokio: Option<f64>,
}

impl Round {
    /// keylock against the floor on W1 (`contended` false) or W6.
    pub(crate) fn against(&self, contended: bool) -> Option<Against> {
        let ((ours, tokio), section) = if contended {
            (self.w6, &self.floor.contended)
        } else {
            (self.w1, &self.floor.uncontended)
        };
        let proto = section.get("proto")?.median;
        let through_tokio = section
            .get("tokio")
            .map(|t| (ours / tokio) / (proto / t.median));
        Some(Against {
            direct: ours / proto,
            through_tokio,
        })
    }
}
