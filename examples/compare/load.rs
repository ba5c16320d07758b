//! The machine's load average, read from `/proc/loadavg`: a figure counts as
//! evidence only if it was taken on an idle machine.
//!
//! `compare` reads it at the start and end of the run and before each
//! workload, prints it in the report's header and footer, warns at the top
//! and at the end when the 1-minute load at the start is above
//! [`IDLE_BELOW`], and with `--require-idle` waits for the load to drop
//! before measuring (or refuses to). The run's own two workers raise the
//! load as it goes: only the figure at the start says whether something
//! else was running. Elsewhere than on Linux the load is unknown.

use std::fmt;
use std::time::{Duration, Instant};

/// A 1-minute load average above this means the machine was not idle.
pub(crate) const IDLE_BELOW: f64 = 0.5;

/// How often `--require-idle` looks at the load again.
pub(crate) const IDLE_POLL: Duration = Duration::from_secs(5);

/// The three load averages, as `uptime` prints them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Load {
    pub(crate) one: f64,
    pub(crate) five: f64,
    pub(crate) fifteen: f64,
}

impl Load {
    /// Whether the machine was busy by the 1-minute figure.
    pub(crate) fn busy(self) -> bool {
        self.one > IDLE_BELOW
    }
}

/// The load now; `None` where it cannot be read (not Linux, or no `/proc`).
pub(crate) fn read() -> Option<Load> {
    #[cfg(target_os = "linux")]
    {
        parse(&std::fs::read_to_string("/proc/loadavg").ok()?)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// `/proc/loadavg`'s first three fields.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse(text: &str) -> Option<Load> {
    let mut fields = text.split_whitespace().map(|f| f.parse::<f64>().ok());
    Some(Load {
        one: fields.next()??,
        five: fields.next()??,
        fifteen: fields.next()??,
    })
}

/// The 1-minute figure, or "unknown".
pub(crate) struct One(pub(crate) Option<Load>);

impl fmt::Display for One {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, "{:.2}", l.one),
            None => f.write_str("unknown"),
        }
    }
}

/// `uptime`'s form: "load average: 0.12, 0.30, 0.41".
pub(crate) struct Uptime(pub(crate) Option<Load>);

impl fmt::Display for Uptime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(
                f,
                "load average: {:.2}, {:.2}, {:.2}",
                l.one, l.five, l.fifteen
            ),
            None => f.write_str("load average: unknown (no /proc/loadavg: not Linux)"),
        }
    }
}

/// The warning printed at the top and at the end of a run that started on a
/// busy machine; `None` if it started idle (or the load is unknown).
pub(crate) fn warning(start: Option<Load>) -> Option<String> {
    let l = start.filter(|l| l.busy())?;
    Some(format!(
        "!! load average {:.2} > {IDLE_BELOW} at start: figures are not evidence",
        l.one
    ))
}

/// Waits up to `max` for the 1-minute load to drop to [`IDLE_BELOW`],
/// looking every [`IDLE_POLL`]; returns the load that passed, or `Err` with
/// the reason to refuse (still busy at the deadline, or the load is
/// unknown).
pub(crate) fn wait_for_idle(max: Duration) -> Result<Load, String> {
    let started = Instant::now();
    loop {
        let Some(load) = read() else {
            return Err(
                "--require-idle: the load average is unknown here (no /proc/loadavg), \
                 so an idle machine cannot be checked"
                    .to_string(),
            );
        };
        if !load.busy() {
            return Ok(load);
        }
        let waited = started.elapsed();
        if waited >= max {
            return Err(format!(
                "--require-idle: the 1-minute load average is still {:.2} (> {IDLE_BELOW}) \
                 after {} s; refusing to measure, since figures from a busy machine are \
                 not evidence. Stop what else is running, wait longer (--idle-wait SECS), \
                 or run without --require-idle for a smoke run",
                load.one,
                waited.as_secs()
            ));
        }
        eprintln!(
            "waiting for an idle machine: load average {:.2} > {IDLE_BELOW} ({} s of {} s)",
            load.one,
            waited.as_secs(),
            max.as_secs()
        );
        std::thread::sleep(IDLE_POLL.min(max - waited));
    }
}
