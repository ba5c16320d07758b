//! The cross-process acquisition of one key: the judgement made under the
//! key's short kernel lock, and the wait between judgements.
//!
//! # The file of a key, and its locks
//!
//! A key has one file, `<stem>.state`: the token state, the owner stamp and
//! the release cells ([`super::stamp`]). Its kernel locks are open file
//! description locks on single bytes of it (never on its data; see
//! [`super::unix`]):
//!
//! - byte 0 is the *state lock*: held only while the state is read and
//!   written, never while waiting;
//! - byte `1 + N` is *slot* `N`. The holder of a key holds the lock of the
//!   slot the state names, for as long as it holds the key. Usually that is
//!   slot 0; other slots are used only after a lease takeover (below).
//!
//! An uncontended lock takes bytes 0 and 1 (the state lock and slot 0) in
//! one call: the two steps are one system call when slot 0 is free, and
//! fall back to the state lock alone when it is not.
//!
//! # The judgement (under the state lock)
//!
//! With the state read, and the stamp counted as no holder if its token is
//! in its slot's release cell (the holder released it):
//!
//! 1. **No holder.** Take the key on a slot the caller already holds (slot
//!    0 taken with the state lock, or a slot the kernel just handed it);
//!    else try-lock the state's slot; if it is locked, another process's
//!    waiter was just handed it by the kernel and is about to take the key:
//!    wait for that slot.
//! 2. **A holder, and its slot is free** (or the caller already holds it):
//!    the holder is dead (a live holder keeps its slot locked until after it
//!    wrote its release, and the kernel frees the locks of a process that
//!    dies, however it dies). Take the key over, on that slot.
//! 3. **A live holder whose lease lapsed** (its slot is locked, and the
//!    host's monotonic clock is past the deadline in its stamp): take the
//!    key over on *another* slot (one the caller holds, or the first free
//!    one). The stamp now names the new holder, its token and its slot; the
//!    old holder still holds its old slot, which no longer means anything.
//! 4. **A live holder within its lease**: wait for its slot, and wake at its
//!    lease deadline to judge again.
//!
//! Taking the key mints the next token (durably above every earlier one,
//! see [`super::stamp`]) and writes the stamp, then lets the state lock go.
//!
//! # Release, check
//!
//! A holder releases without the state lock: it writes its token into its
//! slot's release cell, then lets the slot go. Only the holder of a slot
//! writes that slot's cell, so no lock is needed; a holder that was taken
//! over writes the cell of its old slot, which the stamp no longer names,
//! so it frees nothing of the successor's. A stuck holder's `check()` reads
//! the state under the state lock (shared): the token there is no longer
//! its own, so the check fails.
//!
//! # The wait
//!
//! Waiting for a slot (or for the state lock, when another process sits in
//! it for longer than a few yields) is a blocking lock call on a helper
//! thread ([`super::helper`]) (or, for `blocking_lock` without a deadline
//! and a holder without a lease, on the caller's own thread), on a second open of the key's file (a lock
//! of the open file the caller already uses would not wait): the kernel
//! wakes it when the lock is released or its holder dies, with no polling.
//! A timer (the crate's own) wakes the waiter at the holder's lease deadline
//! and at the caller's deadline. Only a state in which every slot is locked
//! by stuck holders (not reachable without 64 of them) falls back to
//! sleeping with jittered backoff.

use std::fs::{File, OpenOptions};
use std::future::poll_fn;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use super::error::ProcessLockError;
use super::helper::{self, KernelWait};
use super::stamp::{unix_now_ns, ProcessHolder, Stamp, State, FILE_LEN, MAX_SLOTS};
use super::table::Inner;
use super::unix::{self, slot_byte, Kind, STATE_BYTE};
use crate::clock::Clock;
use crate::timer::Sleep;

/// How many times an acquirer yields and tries the state lock again before
/// it waits for it on a helper thread: the state lock is held for a few
/// system calls at a time.
const STATE_SPINS: u32 = 4;

/// The open files of one key, used by one acquirer or guard at a time (see
/// [`super::cache`]).
#[derive(Debug)]
pub(crate) struct KeyFiles {
    pub(crate) stem: String,
    pub(crate) path: PathBuf,
    /// The state file: the state lock, and the slot of a key taken without
    /// waiting.
    pub(crate) state: File,
    /// A second open of the state file: the one a helper thread waits on
    /// (its locks belong to another open file than `state`'s), and so the
    /// holder of the slot of a key taken after such a wait.
    pub(crate) spare: Option<File>,
}

/// Which open file of a key holds a slot's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum On {
    State,
    Spare,
}

/// A slot whose lock the caller holds.
#[derive(Debug, Clone, Copy)]
struct Have {
    slot: u32,
    on: On,
}

/// A key taken: its files, the locked slot and the token.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) files: KeyFiles,
    pub(crate) slot: u32,
    pub(crate) on: On,
    pub(crate) token: u64,
}

enum Step {
    Granted {
        slot: u32,
        on: On,
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

impl KeyFiles {
    fn file(&self, on: On) -> &File {
        match on {
            On::State => &self.state,
            On::Spare => self.spare.as_ref().expect("a slot is held on the spare"),
        }
    }

    /// Lets slot `slot`, held on `on`, go.
    pub(crate) fn unlock_slot(&self, slot: u32, on: On) -> Result<(), ProcessLockError> {
        unix::unlock_range(self.file(on), slot_byte(slot), 1)
            .map_err(|e| ProcessLockError::io("unlock", &self.path, e))
    }

    fn unlock_state(&self) -> Result<(), ProcessLockError> {
        unix::unlock_range(&self.state, STATE_BYTE, 1)
            .map_err(|e| ProcessLockError::io("unlock", &self.path, e))
    }

    /// Tries the state lock; with slot 0 in the same call if `with_slot0`
    /// (then `Some(true)` says both were taken, `Some(false)` the state lock
    /// alone); `None` if another open file holds the state lock.
    fn try_state(&self, with_slot0: bool) -> Result<Option<bool>, ProcessLockError> {
        let io = |e| ProcessLockError::io("lock", &self.path, e);
        // The state byte and slot 0's are adjacent: one range, one call.
        const _: () = assert!(STATE_BYTE + 1 == slot_byte(0));
        if with_slot0
            && unix::try_lock_range(&self.state, Kind::Exclusive, STATE_BYTE, 2).map_err(io)?
        {
            return Ok(Some(true));
        }
        if unix::try_lock_range(&self.state, Kind::Exclusive, STATE_BYTE, 1).map_err(io)? {
            return Ok(Some(false));
        }
        Ok(None)
    }

    /// Try-locks slot `slot` on the state file.
    fn try_slot(&self, slot: u32) -> Result<bool, ProcessLockError> {
        unix::try_lock_range(&self.state, Kind::Exclusive, slot_byte(slot), 1)
            .map_err(|e| ProcessLockError::io("lock", &self.path, e))
    }

    /// Whether the state file was deleted since it was opened: its path
    /// then names another file (or none), whose locks are not ours.
    fn unlinked(&self) -> Result<bool, ProcessLockError> {
        unix::is_unlinked(&self.state).map_err(|e| ProcessLockError::io("stat", &self.path, e))
    }
}

impl Inner {
    pub(crate) fn state_path(&self, stem: &str) -> PathBuf {
        self.dir.join(format!("{stem}.state"))
    }

    /// A key's files: from the descriptor cache, else opened.
    #[inline]
    fn key_files(&self, stem: &str) -> Result<KeyFiles, ProcessLockError> {
        match self.cache.checkout(stem) {
            Some(files) => Ok(files),
            None => self.open_key(stem),
        }
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
            spare: None,
        })
    }

    /// Puts a key's files, which hold no lock now, back into the cache.
    pub(crate) fn put_back(&self, files: KeyFiles) {
        self.cache.checkin(files);
    }

    /// A second open file of the key, for a helper thread to wait on.
    fn spare(&self, files: &mut KeyFiles) -> Result<File, ProcessLockError> {
        match files.spare.take() {
            Some(file) => Ok(file),
            None => open_rw(&files.path)
                .map_err(|e| ProcessLockError::io("open the state file", &files.path, e)),
        }
    }

    /// The judgement, made by a caller holding the key's state lock on
    /// `files.state`. `have` is a slot the caller holds already; it is let
    /// go unless the key is taken on it.
    fn judge(
        &self,
        files: &KeyFiles,
        have: Option<Have>,
        lease: Option<Duration>,
    ) -> Result<Step, ProcessLockError> {
        let mut state = State::load(&files.state, &files.path)?;
        let now = unix::monotonic_ns();
        let current = state.slot;
        let let_go = |have: Option<Have>| match have {
            Some(h) => files.unlock_slot(h.slot, h.on),
            None => Ok(()),
        };
        let (slot, on) = match state.holding() {
            None => match have {
                // Nobody holds the key: any slot of ours will do.
                Some(h) => (h.slot, h.on),
                None if files.try_slot(current)? => (current, On::State),
                None => {
                    return Ok(Step::WaitSlot {
                        slot: current,
                        lease_deadline: None,
                    })
                }
            },
            Some(holder) => match have {
                // The holder's slot is ours: it is dead.
                Some(h) if h.slot == current => (h.slot, h.on),
                have => {
                    if files.try_slot(current)? {
                        // Free: the holder is dead.
                        let_go(have)?;
                        (current, On::State)
                    } else if holder.lease_deadline.is_some_and(|d| now >= d) {
                        // Alive, past its lease: take over on another slot.
                        match have {
                            Some(h) => (h.slot, h.on),
                            None => match self.free_slot(files, current)? {
                                Some(slot) => (slot, On::State),
                                None => return Ok(Step::Backoff),
                            },
                        }
                    } else {
                        let_go(have)?;
                        return Ok(Step::WaitSlot {
                            slot: current,
                            lease_deadline: holder.lease_deadline,
                        });
                    }
                }
            },
        };
        // On an error from here the caller drops (closes) the files: the
        // slot is let go with them, nothing is held.
        let token = state.mint(&files.state, &files.path)?;
        let lease_deadline =
            lease.map(|l| now.saturating_add(u64::try_from(l.as_nanos()).unwrap_or(u64::MAX)));
        state.slot = slot;
        state.holder = Some(Stamp {
            pid: unix::pid(),
            token,
            lease_deadline,
            granted_mono: now,
            granted_unix_ns: unix_now_ns(),
            host: unix::hostname().to_owned(),
            label: self.label.clone(),
        });
        state.store(&files.state, &files.path)?;
        Ok(Step::Granted { slot, on, token })
    }

    fn free_slot(&self, files: &KeyFiles, except: u32) -> Result<Option<u32>, ProcessLockError> {
        for slot in (0..MAX_SLOTS).filter(|&s| s != except) {
            if files.try_slot(slot)? {
                return Ok(Some(slot));
            }
        }
        Ok(None)
    }

    /// One judgement by a caller that just took the state lock on
    /// `files.state` (and `have`); both are let go, but for the slot of a
    /// grant. `None`: the file had been deleted, `files` is opened afresh.
    fn judge_locked(
        &self,
        files: &mut KeyFiles,
        have: Option<Have>,
        lease: Option<Duration>,
    ) -> Result<Option<Step>, ProcessLockError> {
        if files.unlinked()? {
            // Closing the deleted file's descriptors lets its locks go.
            *files = self.open_key(&files.stem)?;
            return Ok(None);
        }
        let step = self.judge(files, have, lease);
        // On any error the caller drops the files, which frees their locks.
        let unlocked = files.unlock_state();
        let step = step?;
        unlocked?;
        Ok(Some(step))
    }

    /// Takes the key now if no live holder has it (no wait beyond a moment
    /// of contention on the state lock).
    pub(crate) fn try_acquire(
        &self,
        stem: &str,
        lease: Option<Duration>,
    ) -> Result<Result<Grant, Option<Box<ProcessHolder>>>, ProcessLockError> {
        let mut files = self.key_files(stem)?;
        let mut backoff = Backoff::new();
        for _ in 0..64 {
            let Some(slot0) = files.try_state(true)? else {
                if backoff.step > 6 {
                    break;
                }
                std::thread::sleep(backoff.next());
                continue;
            };
            let have = slot0.then_some(Have {
                slot: 0,
                on: On::State,
            });
            match self.judge_locked(&mut files, have, lease)? {
                None => {}
                Some(Step::Granted { slot, on, token }) => {
                    return Ok(Ok(Grant {
                        files,
                        slot,
                        on,
                        token,
                    }))
                }
                Some(Step::WaitSlot { .. } | Step::Backoff) => break,
            }
        }
        self.put_back(files);
        Ok(Err(self.holder_of(stem)?.map(Box::new)))
    }

    /// Waits for the key until `deadline`.
    pub(crate) async fn acquire(
        &self,
        stem: &str,
        lease: Option<Duration>,
        deadline: Option<Instant>,
        started: Instant,
        on_this_thread: bool,
    ) -> Result<Grant, ProcessLockError> {
        self.file_waiters.fetch_add(1, Ordering::Relaxed);
        let _count = DecOnDrop(&self.file_waiters);
        let mut files = self.key_files(stem)?;
        // A slot the kernel handed a helper thread, on `files.spare`.
        let mut have: Option<Have> = None;
        let mut pending: Option<(u32, KernelWait)> = None;
        let mut backoff = Backoff::new();
        loop {
            let mut locked = files.try_state(have.is_none())?;
            for _ in 0..STATE_SPINS {
                if locked.is_some() {
                    break;
                }
                std::thread::yield_now();
                locked = files.try_state(have.is_none())?;
            }
            let slot0 = match locked {
                Some(slot0) => slot0,
                None => {
                    // Another process sits in the state lock: have the
                    // kernel wake us when it leaves, on a new open file (the
                    // spare may hold a slot).
                    let file = open_rw(&files.path)
                        .map_err(|e| ProcessLockError::io("open the state file", &files.path, e))?;
                    let mut wait =
                        KernelWait::start(file, Kind::Exclusive, STATE_BYTE).map_err(|e| {
                            ProcessLockError::io("start a helper thread for", &files.path, e)
                        })?;
                    match wait_until(&mut wait, deadline).await {
                        Some(Ok(file)) => {
                            // The new open file is the state file now; the
                            // old one (no locks) becomes the spare if free.
                            let old = std::mem::replace(&mut files.state, file);
                            if files.spare.is_none() && have.is_none() {
                                files.spare = Some(old);
                            }
                        }
                        Some(Err(e)) => return Err(ProcessLockError::io("lock", &files.path, e)),
                        None => return Err(self.timeout(stem, started)),
                    }
                    false
                }
            };
            if slot0 {
                have = Some(Have {
                    slot: 0,
                    on: On::State,
                });
            }
            let Some(step) = self.judge_locked(&mut files, have.take(), lease)? else {
                pending = None;
                continue;
            };
            match step {
                Step::Granted { slot, on, token } => {
                    return Ok(Grant {
                        files,
                        slot,
                        on,
                        token,
                    })
                }
                Step::WaitSlot {
                    slot,
                    lease_deadline,
                } => {
                    if on_this_thread && deadline.is_none() && lease_deadline.is_none() {
                        // Only the kernel can end this wait: make it here,
                        // on the caller's own (blocking) thread.
                        drop(pending.take());
                        let file = self.spare(&mut files)?;
                        helper::wait_here(|| {
                            unix::lock_range(&file, Kind::Exclusive, slot_byte(slot), 1)
                        })
                        .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
                        files.spare = Some(file);
                        have = Some(Have {
                            slot,
                            on: On::Spare,
                        });
                        continue;
                    }
                    if pending.as_ref().is_none_or(|(s, _)| *s != slot) {
                        drop(pending.take());
                        let file = self.spare(&mut files)?;
                        let wait = KernelWait::start(file, Kind::Exclusive, slot_byte(slot))
                            .map_err(|e| {
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
                            files.spare = Some(file);
                            have = Some(Have {
                                slot,
                                on: On::Spare,
                            });
                            pending = None;
                        }
                        Some(Err(e)) => return Err(ProcessLockError::io("lock", &files.path, e)),
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
            if unix::try_lock_range(&file, Kind::Shared, STATE_BYTE, 1)
                .map_err(|e| ProcessLockError::io("lock", &path, e))?
            {
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
        let Some(stamp) = state.holding() else {
            return Ok(None);
        };
        // Alive while its slot is locked: a look at the lock, taking none.
        let alive = unix::range_locked(&file, slot_byte(state.slot), 1)
            .map_err(|e| ProcessLockError::io("lock", &path, e))?;
        drop(file);
        Ok(ProcessHolder::from_stamp(
            stamp,
            alive,
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
        let seed = unix::monotonic_ns() ^ (u64::from(unix::pid()) << 32) | 1;
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
