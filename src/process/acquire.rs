//! The cross-process acquisition of one key: the judgement made under the
//! key's short kernel lock, and the wait between judgements.
//!
//! # The files of a key
//!
//! - `<stem>.state`: the token state and the owner stamp
//!   ([`super::stamp`]). Its kernel lock (`flock`) is the *state lock*: held
//!   only while the state is read and written, never while waiting.
//! - `<stem>.slot<N>`: the *slot* files. The holder of a key holds the
//!   kernel lock of the slot the state names, for as long as it holds the
//!   key. Usually that is slot 0; other slots are used only after a lease
//!   takeover (below).
//!
//! # The judgement (under the state lock)
//!
//! With the state read:
//!
//! 1. **No holder.** Take the state's slot (try-lock it); if it is locked,
//!    another process's waiter was just handed it by the kernel and is about
//!    to take the key: wait for that slot.
//! 2. **A holder, and its slot is free** (or the caller already holds it):
//!    the holder is dead (a live holder keeps its slot locked until after it
//!    cleared the stamp, and the kernel frees the lock of a process that
//!    dies, however it dies). Take the key over, on that slot.
//! 3. **A live holder whose lease lapsed** (its slot is locked, and the
//!    host's monotonic clock is past the deadline in its stamp): take the
//!    key over on *another* slot, the first free one. The stamp now names
//!    the new holder, its token and its slot; the old holder still holds its
//!    old slot, which no longer means anything.
//! 4. **A live holder within its lease**: wait for its slot, and wake at its
//!    lease deadline to judge again.
//!
//! Taking the key mints the next token (durably above every earlier one,
//! see [`super::stamp`]) and writes the stamp, then lets the state lock go.
//!
//! A stuck holder's `check()` and release read the state under the state
//! lock: the token there is no longer theirs, so the check fails and the
//! release changes nothing (it only closes its old slot file).
//!
//! # The wait
//!
//! Waiting for a slot (or for the state lock, when another process is
//! inside it) is a blocking `flock` on a helper thread ([`super::helper`]):
//! the kernel wakes it when the lock is released or its holder dies, with
//! no polling. A timer (the crate's own) wakes the waiter at the holder's
//! lease deadline and at the caller's deadline. Only a state in which every
//! slot is locked by stuck holders (not reachable without 64 of them) falls
//! back to sleeping with jittered backoff.

use std::fs::{File, OpenOptions};
use std::future::poll_fn;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use super::error::ProcessLockError;
use super::helper::KernelWait;
use super::stamp::{unix_now_ns, ProcessHolder, Stamp, State, FILE_LEN};
use super::table::Inner;
use super::unix;
use crate::clock::Clock;
use crate::timer::Sleep;

/// The most slot files a key may use (one per stuck holder taken over).
pub(crate) const MAX_SLOTS: u32 = 64;

/// The open state file of one key.
#[derive(Debug)]
pub(crate) struct KeyFiles {
    pub(crate) stem: String,
    pub(crate) path: PathBuf,
    pub(crate) state: File,
}

/// A key taken: the locked slot and the token.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) files: KeyFiles,
    pub(crate) slot_file: File,
    pub(crate) token: u64,
}

enum Step {
    Granted {
        slot: File,
        token: u64,
    },
    /// Wait for this slot's kernel lock; judge again at the lease deadline.
    WaitSlot {
        slot: u32,
        lease_deadline: Option<u64>,
    },
    /// Every slot is locked (by stuck holders): sleep and judge again.
    Backoff,
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

impl Inner {
    pub(crate) fn state_path(&self, stem: &str) -> PathBuf {
        self.dir.join(format!("{stem}.state"))
    }

    fn slot_path(&self, stem: &str, slot: u32) -> PathBuf {
        self.dir.join(format!("{stem}.slot{slot}"))
    }

    /// Opens (creating if need be) a key's state file.
    pub(crate) fn open_key(&self, stem: &str) -> Result<KeyFiles, ProcessLockError> {
        let path = self.state_path(stem);
        let state = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                match OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&path)
                {
                    Ok(file) => {
                        // Size it now, so a full disk shows here, before
                        // any key is held, and make its entry durable: the
                        // key's token ceiling lives in it.
                        file.set_len(FILE_LEN as u64)
                            .and_then(|()| file.sync_all())
                            .and_then(|()| unix::sync_dir(&self.dir))
                            .map_err(|e| ProcessLockError::io("create the state file", &path, e))?;
                        file
                    }
                    Err(err) if err.kind() == io::ErrorKind::AlreadyExists => open_rw(&path)
                        .map_err(|e| ProcessLockError::io("open the state file", &path, e))?,
                    Err(err) => {
                        return Err(ProcessLockError::io("create the state file", &path, err))
                    }
                }
            }
            Err(err) => return Err(ProcessLockError::io("open the state file", &path, err)),
        };
        Ok(KeyFiles {
            stem: stem.to_owned(),
            path,
            state,
        })
    }

    fn open_slot(&self, stem: &str, slot: u32) -> Result<File, ProcessLockError> {
        let path = self.slot_path(stem, slot);
        open_rw(&path).map_err(|e| ProcessLockError::io("open the slot file", &path, e))
    }

    /// Try-locks a slot; `None` if another holds it.
    fn try_slot(&self, stem: &str, slot: u32) -> Result<Option<File>, ProcessLockError> {
        for _ in 0..3 {
            let file = self.open_slot(stem, slot)?;
            let path = || self.slot_path(stem, slot);
            if !unix::try_lock(&file).map_err(|e| ProcessLockError::io("lock", path(), e))? {
                return Ok(None);
            }
            // Locked a file that was deleted since it was opened: the path
            // now names another file (or none). Open it again.
            if !unix::is_unlinked(&file).map_err(|e| ProcessLockError::io("stat", path(), e))? {
                return Ok(Some(file));
            }
        }
        Ok(None)
    }

    /// The judgement, made by a caller holding the key's state lock
    /// exclusively. `mine` is a slot the caller holds already.
    fn judge(
        &self,
        files: &KeyFiles,
        mine: Option<(u32, File)>,
        lease: Option<Duration>,
    ) -> Result<Step, ProcessLockError> {
        let mut state = State::load(&files.state, &files.path)?;
        let now = unix::monotonic_ns();
        let current = state.slot;
        let (slot, slot_file) = match &state.holder {
            None => match mine {
                Some((m, file)) if m == current => (current, file),
                other => {
                    drop(other);
                    match self.try_slot(&files.stem, current)? {
                        Some(file) => (current, file),
                        None => {
                            return Ok(Step::WaitSlot {
                                slot: current,
                                lease_deadline: None,
                            })
                        }
                    }
                }
            },
            Some(holder) => match mine {
                // The holder's slot is ours: it is dead.
                Some((m, file)) if m == current => (current, file),
                mine => {
                    if let Some(file) = self.try_slot(&files.stem, current)? {
                        // Free: the holder is dead.
                        drop(mine);
                        (current, file)
                    } else if holder.lease_deadline.is_some_and(|d| now >= d) {
                        // Alive, past its lease: take over on another slot.
                        match mine {
                            Some(m) => m,
                            None => match self.free_slot(&files.stem, current)? {
                                Some(found) => found,
                                None => return Ok(Step::Backoff),
                            },
                        }
                    } else {
                        return Ok(Step::WaitSlot {
                            slot: current,
                            lease_deadline: holder.lease_deadline,
                        });
                    }
                }
            },
        };
        let token = state.mint(&files.state, &files.path)?;
        let lease_deadline =
            lease.map(|l| now.saturating_add(u64::try_from(l.as_nanos()).unwrap_or(u64::MAX)));
        state.slot = slot;
        state.holder = Some(Stamp {
            pid: std::process::id(),
            token,
            lease_deadline,
            granted_mono: now,
            granted_unix_ns: unix_now_ns(),
            host: unix::hostname().to_owned(),
            label: self.label.clone(),
        });
        // On an error the slot file closes: nothing is held.
        state.store(&files.state, &files.path)?;
        Ok(Step::Granted {
            slot: slot_file,
            token,
        })
    }

    fn free_slot(&self, stem: &str, except: u32) -> Result<Option<(u32, File)>, ProcessLockError> {
        for slot in (0..MAX_SLOTS).filter(|&s| s != except) {
            if let Some(file) = self.try_slot(stem, slot)? {
                return Ok(Some((slot, file)));
            }
        }
        Ok(None)
    }

    /// One judgement under the state lock, which the caller already holds
    /// on `files.state`; the lock is let go before returning.
    fn judge_locked(
        &self,
        files: &mut KeyFiles,
        mine: Option<(u32, File)>,
        lease: Option<Duration>,
    ) -> Result<Option<Step>, ProcessLockError> {
        let unlinked = unix::is_unlinked(&files.state)
            .map_err(|e| ProcessLockError::io("stat", &files.path, e));
        let step = match unlinked {
            Ok(false) => self.judge(files, mine, lease).map(Some),
            Ok(true) => Ok(None),
            Err(e) => Err(e),
        };
        let _ = unix::unlock(&files.state);
        if matches!(step, Ok(None)) {
            // Deleted since opened: the path names another file now.
            *files = self.open_key(&files.stem)?;
        }
        step
    }

    /// Takes the key now if no live holder has it (no wait beyond a moment
    /// of contention on the state lock).
    pub(crate) fn try_acquire(
        &self,
        stem: &str,
        lease: Option<Duration>,
    ) -> Result<Result<Grant, Option<Box<ProcessHolder>>>, ProcessLockError> {
        let mut files = self.open_key(stem)?;
        let mut backoff = Backoff::new();
        for _ in 0..64 {
            let locked = unix::try_lock(&files.state)
                .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
            if !locked {
                if backoff.step > 6 {
                    break;
                }
                std::thread::sleep(backoff.next());
                continue;
            }
            match self.judge_locked(&mut files, None, lease)? {
                None => {}
                Some(Step::Granted { slot, token, .. }) => {
                    return Ok(Ok(Grant {
                        files,
                        slot_file: slot,
                        token,
                    }))
                }
                Some(Step::WaitSlot { .. } | Step::Backoff) => break,
            }
        }
        Ok(Err(self.holder_of(stem)?.map(Box::new)))
    }

    /// Waits for the key until `deadline`.
    pub(crate) async fn acquire(
        &self,
        stem: &str,
        lease: Option<Duration>,
        deadline: Option<Instant>,
        started: Instant,
    ) -> Result<Grant, ProcessLockError> {
        self.file_waiters.fetch_add(1, Ordering::Relaxed);
        let _count = DecOnDrop(&self.file_waiters);
        let mut files = self.open_key(stem)?;
        let mut mine: Option<(u32, File)> = None;
        let mut pending: Option<(u32, KernelWait)> = None;
        let mut backoff = Backoff::new();
        loop {
            let locked = unix::try_lock(&files.state)
                .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
            if !locked {
                // Another process is inside the state lock: have the kernel
                // wake us when it leaves.
                let file = open_rw(&files.path)
                    .map_err(|e| ProcessLockError::io("open the state file", &files.path, e))?;
                let mut wait = KernelWait::start(file, false).map_err(|e| {
                    ProcessLockError::io("start a helper thread for", &files.path, e)
                })?;
                match wait_until(&mut wait, deadline).await {
                    Some(Ok(file)) => files.state = file,
                    Some(Err(e)) => return Err(ProcessLockError::io("lock", &files.path, e)),
                    None => return Err(self.timeout(stem, started)),
                }
            }
            let step = self.judge_locked(&mut files, mine.take(), lease)?;
            let Some(step) = step else { continue };
            match step {
                Step::Granted { slot, token, .. } => {
                    return Ok(Grant {
                        files,
                        slot_file: slot,
                        token,
                    })
                }
                Step::WaitSlot {
                    slot,
                    lease_deadline,
                } => {
                    if pending.as_ref().is_none_or(|(s, _)| *s != slot) {
                        let file = self.open_slot(stem, slot)?;
                        let wait = KernelWait::start(file, false).map_err(|e| {
                            ProcessLockError::io("start a helper thread for", &files.path, e)
                        })?;
                        pending = Some((slot, wait));
                    }
                    let lapse = lease_deadline.map(instant_of_monotonic);
                    let wake = match (deadline, lapse) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    let (_, wait) = pending.as_mut().expect("set above");
                    match wait_until(wait, wake).await {
                        Some(Ok(file)) => {
                            mine = Some((slot, file));
                            pending = None;
                        }
                        Some(Err(e)) => {
                            let path = self.slot_path(stem, slot);
                            return Err(ProcessLockError::io("lock", path, e));
                        }
                        None => {
                            if deadline.is_some_and(|d| Instant::now() >= d) {
                                return Err(self.timeout(stem, started));
                            }
                            // The holder's lease deadline: judge again.
                        }
                    }
                }
                Step::Backoff => {
                    let at = Instant::now() + backoff.next();
                    let at = deadline.map_or(at, |d| d.min(at));
                    Sleeper::new(at).await;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(self.timeout(stem, started));
                    }
                }
            }
        }
    }

    pub(crate) fn timeout(&self, stem: &str, started: Instant) -> ProcessLockError {
        ProcessLockError::Timeout {
            waited: started.elapsed(),
            // Diagnosis must never replace the timeout it explains.
            holder: self.holder_of(stem).ok().flatten().map(Box::new),
            path: self.state_path(stem),
        }
    }

    /// Reads a key's owner stamp and asks the kernel whether its holder is
    /// alive.
    pub(crate) fn holder_of(&self, stem: &str) -> Result<Option<ProcessHolder>, ProcessLockError> {
        let path = self.state_path(stem);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(ProcessLockError::io("open the state file", &path, err)),
        };
        // The state lock, shared; if a process sits in it (stopped?) for
        // long, read without it: a torn read then shows no holder.
        let mut locked = false;
        let mut backoff = Backoff::new();
        while backoff.step < 8 {
            if unix::try_lock_shared(&file).map_err(|e| ProcessLockError::io("lock", &path, e))? {
                locked = true;
                break;
            }
            std::thread::sleep(backoff.next());
        }
        let state = State::load(&file, &path);
        let state = match state {
            Ok(state) => state,
            Err(ProcessLockError::Corrupt { .. }) if !locked => return Ok(None),
            Err(err) => return Err(err),
        };
        let Some(stamp) = &state.holder else {
            return Ok(None);
        };
        // Alive while its slot is locked: probe it shared (probes do not
        // exclude each other).
        let slot = self.open_slot(stem, state.slot)?;
        let free = unix::try_lock_shared(&slot)
            .map_err(|e| ProcessLockError::io("lock", self.slot_path(stem, state.slot), e))?;
        drop(slot);
        drop(file);
        Ok(ProcessHolder::from_stamp(
            stamp,
            !free,
            unix::monotonic_ns(),
        ))
    }
}

struct DecOnDrop<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for DecOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The instant of a reading of the host's monotonic clock (the same clock
/// as [`Instant`] on Linux).
pub(crate) fn instant_of_monotonic(ns: u64) -> Instant {
    let now_ns = unix::monotonic_ns();
    let now = Instant::now();
    if ns >= now_ns {
        now + Duration::from_nanos(ns - now_ns)
    } else {
        now.checked_sub(Duration::from_nanos(now_ns - ns))
            .unwrap_or(now)
    }
}

/// Awaits `wait`, or `at` (`None`), whichever comes first.
async fn wait_until(wait: &mut KernelWait, at: Option<Instant>) -> Option<io::Result<File>> {
    let mut sleep = at.map(|at| Sleep::new(&Clock::Monotonic, at));
    poll_fn(|cx| {
        if let Poll::Ready(out) = Pin::new(&mut *wait).poll(cx) {
            return Poll::Ready(Some(out));
        }
        match &mut sleep {
            Some(sleep) => sleep.poll(cx).map(|()| None),
            None => Poll::Pending,
        }
    })
    .await
}

use std::future::Future;

/// A sleep on the crate's timer.
struct Sleeper(Sleep);

impl Sleeper {
    fn new(at: Instant) -> Self {
        Self(Sleep::new(&Clock::Monotonic, at))
    }
}

impl Future for Sleeper {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        self.0.poll(cx)
    }
}

/// Jittered exponential backoff: 50 µs doubling to 5 ms, each pause drawn
/// from [0.5, 1.5) of its nominal length, so that retrying processes do not
/// wake in lockstep.
pub(crate) struct Backoff {
    step: u32,
    seed: u64,
}

impl Backoff {
    pub(crate) fn new() -> Self {
        let seed = unix::monotonic_ns() ^ (u64::from(std::process::id()) << 32) | 1;
        Self { step: 0, seed }
    }

    pub(crate) fn next(&mut self) -> Duration {
        let nominal = (50_000u64 << self.step.min(7)).min(5_000_000);
        self.step += 1;
        // xorshift64
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let jitter = nominal / 2 + self.seed % nominal;
        Duration::from_nanos(jitter)
    }
}
