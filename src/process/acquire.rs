//! The cross-process acquisition of one key: the judgement, made on the
//! key's shared state word, and the wait between judgements.
//!
//! # The file of a key, its memory, and its locks
//!
//! A key has one file, `<stem>.state`, mapped into every process that uses
//! it ([`super::shared`]): the state word (the current grant's token and
//! slot), the release cells, the owner stamps and the token ceilings
//! ([`super::stamp`]). Its kernel locks say who is alive (never what the
//! state is; see [`super::unix`]): *slot* 0 is the `flock` lock of the
//! file, slot `N` (1 and up) the open file description lock of its byte
//! `1 + N`. The holder of a key holds the lock of the slot the state word
//! names, for as long as it holds the key. Usually that is slot 0; other
//! slots are used only after a lease takeover (below). Byte 0 is locked
//! only by the first process of a boot to map the file (to reset the state
//! left from before the reboot).
//!
//! An uncontended lock is one lock call (slot 0), a `stat` of the key's
//! path (below), and a compare-and-swap of the state word in memory; its
//! release is an `fstat` of the file (its length), a store into the slot's
//! release cell and one unlock call.
//!
//! # The files named by the path, whole
//!
//! A table opens a key's file only through [`Inner::open_key`], which
//! registers it as a user of the file (a shared lock of its user byte)
//! and then looks at the path once more: so a file a reclaimer removes
//! ([`super::reclaim`]) is never one a table keeps open. The look below
//! remains for files removed or replaced from outside.
//!
//! Before every judgement (so before every grant) the acquirer makes sure
//! that the key's path still names the file it holds open (device and
//! inode): a table keeps key files open between uses, and the directory,
//! or a key's file, may have been removed or moved aside and made again
//! meanwhile (a temporary-file cleaner, an operator). Locks of the old file
//! would not exclude a holder of the new one, so a file the path no longer
//! names is closed (its locks go with it) and the path opened afresh. The
//! same look tells the file's length: a file shortened by someone else is
//! refused ([`ProcessLockError::Damaged`]) before its mapping is touched,
//! since a mapped page beyond the end of a file raises `SIGBUS`.
//!
//! Both looks are made at one instant: a file replaced (or shortened) right
//! after it, before the grant's compare-and-swap, is as one replaced during
//! the hold. The grant's `check()` makes the same look every time and
//! fails ([`ProcessLockError::Expired`], or `Damaged`) once the path names
//! another file, and its release looks at the file's length (`fstat`)
//! before it stores into the mapping. The windows left run from a look to
//! the last access of the memory after it: for `check()` and a release,
//! loads or a store with no call between; for a judgement, at most a few
//! lock calls that never wait (the length is looked at again after the
//! disk sync of a new token ceiling, the one call that may take long).
//! A truncation that lands in one still raises `SIGBUS`, which no look can
//! prevent short of giving up the shared mapping.
//!
//! # The judgement (no lock but the slots)
//!
//! With the state word read, and its grant counted as released if its
//! token is in its slot's release cell:
//!
//! 1. **Released (or no grant yet).** Take the key on a slot the caller
//!    already holds (slot 0, tried first, or a slot the kernel just handed
//!    it); else try-lock the word's slot; if it is locked, another
//!    process's waiter was just handed it by the kernel and is about to
//!    take the key: wait for that slot, for at most [`NO_GRANT_PATIENCE`]
//!    (counted from the first judgement that saw it, in the file). An open
//!    file that holds it longer with no grant will not take the key (the
//!    helper of a lock future forgotten while it waited, a stopped
//!    process, a program locking the file outside keylock): the key is
//!    then taken on another free slot. Should the slot's holder swap
//!    after all, its swap from the old word fails, and it judges again.
//! 2. **A grant, and its slot is free** (or the caller holds it): the
//!    holder is dead (a live holder keeps its slot locked until after it
//!    wrote its release, and the kernel frees the locks of a process that
//!    dies, however it dies). Take the key over, on that slot.
//!
//!    **A grant whose slot the kernel handed to a waiter**: the slot is
//!    locked, but the file's *handed word* equals the state word (a helper
//!    thread, handed the slot, records the word if it named the slot
//!    unreleased: `stamp::mark_handed`). Its holder let the slot go
//!    without a release, so it died, and the open file that holds the slot
//!    made no grant: as in step 1, wait for it at most
//!    [`NO_GRANT_PATIENCE`], then take the key on another free slot. So a
//!    lock future forgotten while it waited for a holder that was then
//!    killed does not strand the key. Never two holders: the slot's open
//!    file can take the key only by a swap from this same word, and of two
//!    swaps from one word one fails.
//! 3. **A live holder whose lease lapsed** (its slot is locked, its stamp
//!    is written and its lease word is past on the host's monotonic
//!    clock): mark the lease word taken (compare-and-swap: a `renew`
//!    racing it fails, or it makes this one fail), then take the key over
//!    on *another* slot (one the caller holds, or the first free one). The
//!    old holder still holds its old slot, which no longer means anything.
//! 4. **A live holder within its lease**, or one whose stamp is not
//!    written yet (between its grant and its stamp: microseconds): wait for
//!    its slot, and wake at its lease deadline (or in a millisecond, for an
//!    unwritten stamp) to judge again. A holder without a lease is judged
//!    again too, at least every [`NO_LEASE_RECHECK_MAX`] (not by a
//!    blocking wait with no deadline, which waits in the kernel): it may
//!    have died as the kernel handed its slot to a forgotten waiter's
//!    helper, which nothing else would tell the wait.
//!
//! Taking the key is a compare-and-swap of the state word from the word
//! judged to the next token and the caller's slot (in a file that never
//! granted, the directory's token floor plus one: see [`super::dir`]): if
//! another process changed the word meanwhile (a grant, a takeover), the
//! swap fails and the caller judges again, keeping the slot it locked. The
//! winner then makes the directory's token ceiling durable if its token
//! passed it, and writes its stamp.
//!
//! # The claim (order across processes)
//!
//! Kernel locks are not FIFO: a process that releases and locks again at
//! once beats the waiter the kernel woke, whose thread has yet to run. So a
//! waiter that must wait (step 4, or a slot locked with no grant) takes the
//! key's claim if it is free: the OFD lock of the claim byte (a try-lock),
//! then the claim word set to a value of its own. Before taking the key
//! (steps 1 to 3), every judgement loads the claim word: one naming
//! another waiter whose claim lock is held makes it let go of its slot and
//! judge again after a jittered backoff ([`Step::Defer`]); a word whose
//! lock is free was left by a waiter that died or gave up, and is cleared.
//! So is a claim deferred to for longer than [`CLAIM_PATIENCE`] (counted
//! from the first deferral, kept in the file beside the claim word): a
//! claimant stopped, or whose future is no longer polled, holds nobody
//! back for longer. The claimant clears the word and lets its lock go once
//! granted; closing its files (an error, a timeout, a cancelled wait) lets
//! the lock go.
//!
//! # Release, check
//!
//! A holder releases with a store of its token into its slot's release
//! cell, then lets the slot go. Only the holder of a slot writes that
//! slot's cell and stamp, so no lock is needed; a holder that was taken
//! over writes the cell of its old slot, which the word no longer names,
//! so it frees nothing of the successor's. A stuck holder's `check()` loads
//! the word: it no longer names its token and slot, so the check fails.
//!
//! # The wait
//!
//! Waiting for a slot is a blocking lock call on a helper thread
//! ([`super::helper`]) (or, for `blocking_lock` without a deadline and a
//! holder without a lease, on the caller's own thread), on a second open
//! of the key's file (a lock of the open file the caller already uses would
//! not wait): the kernel wakes it when the lock is released or its holder
//! dies, with no polling. A timer (the crate's own) wakes the waiter at the
//! holder's lease deadline and at the caller's deadline. Only a state in
//! which every slot is locked by stuck holders (not reachable without 64 of
//! them) falls back to sleeping with jittered backoff.

use std::fs::{File, OpenOptions};
use std::future::poll_fn;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use super::error::{HeldBy, ProcessLockError};
use super::helper::{self, KernelWait};
use super::holder::ProcessHolder;
use super::reclaim::remove_blank;
use super::stamp::{init_file, unix_now_ns, KeyState, NewStamp, Stamp, Word, FILE_LEN, TAKEN};
use super::table::Inner;
use super::unix::{self, FileId, MAX_SLOTS};
use crate::time::clock::Clock;
use crate::time::timer::Sleep;

/// How long judgements defer to a claim while the key is free for its
/// claimant to take: a claimant that has not taken it by then (stopped,
/// its future no longer polled) loses the claim.
const CLAIM_PATIENCE: Duration = Duration::from_millis(100);

/// How long an opener of a key file keeps trying to register as its user
/// while another open file holds the user byte exclusively (a reclaimer
/// holds it for a few calls; see [`super::reclaim`]).
const REGISTER_PATIENCE: Duration = Duration::from_secs(2);

/// Registers `state`, just opened from `path`, as a user of its file (a
/// shared lock of the user byte, not waited for): `Ok(false)` if a
/// reclaimer holds the byte now.
///
/// # Errors
///
/// [`ProcessLockError::Io`] naming the file and the process if a program
/// outside keylock holds a classic POSIX write lock over that byte (a
/// lock of the whole file): keylock's files are keylock's to lock.
fn register(state: &File, path: &Path) -> Result<bool, ProcessLockError> {
    let failed = |e| ProcessLockError::io("lock", path, e);
    if unix::try_lock_range(state, unix::Kind::Shared, unix::USER_BYTE, 1).map_err(failed)? {
        return Ok(true);
    }
    match unix::range_owner(state, unix::USER_BYTE, 1).map_err(failed)? {
        // Let go meanwhile, or a reclaimer's (an open file description
        // lock): try again.
        None | Some(None) => Ok(false),
        Some(Some(pid)) => Err(ProcessLockError::io(
            "register as a user of",
            path,
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "a program outside keylock (pid {pid}) holds a POSIX write lock on it; \
                     keylock's files must not be locked outside keylock"
                ),
            ),
        )),
    }
}

/// How long judgements wait for a slot locked with no grant (the word's
/// grant released): a taker the kernel just handed the slot swaps the
/// word within microseconds; an open file that holds it longer (the
/// helper of a forgotten lock future, a stopped process, a program locking
/// the file outside keylock) is passed by then, the key taken on another
/// slot.
const NO_GRANT_PATIENCE: Duration = Duration::from_millis(100);

/// How soon a waiter judges again when the holder's stamp was not written
/// yet (it is written microseconds after the grant; its lease is unknown
/// until then).
const UNSTAMPED_RECHECK: Duration = Duration::from_millis(1);

/// The longest a wait for a live holder without a lease goes without
/// judging again: it judges after [`NO_GRANT_PATIENCE`], then twice as long
/// each time up to this. A holder that died as the kernel handed its slot
/// to another open file's helper (a forgotten lock future's) is seen dead
/// once the helper has recorded the handing (`stamp::mark_handed`), which
/// it does as soon as it runs; nothing else would wake the wait.
const NO_LEASE_RECHECK_MAX: Duration = Duration::from_millis(800);

/// The open files of one key, used by one acquirer or guard at a time (see
/// [`super::cache`]).
#[derive(Debug)]
pub(crate) struct KeyFiles {
    /// Shared with the cache's index (no copy per check-in).
    pub(crate) stem: std::sync::Arc<str>,
    pub(crate) path: PathBuf,
    /// The state file: the slot of a key taken without waiting.
    pub(crate) state: File,
    /// The state file, mapped.
    pub(crate) map: KeyState,
    /// A second open of the state file: the one a helper thread waits on
    /// (its locks belong to another open file than `state`'s), and so the
    /// holder of the slot of a key taken after such a wait.
    pub(crate) spare: Option<File>,
    /// Which file `state` is: the path must still name it.
    pub(crate) id: FileId,
    /// Found replaced or damaged by its holder: not to be cached again.
    pub(crate) stale: bool,
}

impl KeyFiles {
    /// A key's files as just opened and mapped: no spare yet, not stale.
    pub(crate) fn opened(
        stem: &str,
        path: PathBuf,
        state: File,
        map: KeyState,
        id: FileId,
    ) -> Self {
        Self {
            stem: std::sync::Arc::from(stem),
            path,
            state,
            map,
            spare: None,
            id,
            stale: false,
        }
    }
}

/// What a key's path names, against the files a table holds open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Named {
    /// The open file, whole.
    This,
    /// Another file, or none: the open one was removed or replaced.
    Other,
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
    /// Wait for this slot's kernel lock; judge again at `recheck` (on the
    /// host's monotonic clock) if it comes first. `free`: the word's grant
    /// was released, so the slot is locked with no grant (a waiter about to
    /// take the key, or a lock taken outside keylock).
    WaitSlot {
        slot: u32,
        recheck: Option<u64>,
        free: bool,
    },
    /// Every slot is locked (by stuck holders): sleep and judge again.
    Backoff,
    /// The key is free (or free to take over), but another process's
    /// waiter holds the claim: it goes first. Sleep and judge again.
    Defer,
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(false)
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
        unix::unlock_slot(self.file(on), slot)
            .map_err(|e| ProcessLockError::io("unlock", &self.path, e))
    }

    /// Try-locks slot `slot` on the state file.
    fn try_slot(&self, slot: u32) -> Result<bool, ProcessLockError> {
        unix::try_lock_slot(&self.state, slot)
            .map_err(|e| ProcessLockError::io("lock", &self.path, e))
    }

    /// Whether the key's path still names the open state file (whose
    /// locks are then the ones every other opener of the path sees), and,
    /// if so, whether it is still whole (`stat` of the path).
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] if the path names the open file and
    /// it was shortened: its mapping must not be touched.
    pub(crate) fn named(&self) -> Result<Named, ProcessLockError> {
        match unix::path_id(&self.path).map_err(|e| ProcessLockError::io("stat", &self.path, e))? {
            Some((id, len)) if id == self.id => {
                if len < FILE_LEN as u64 {
                    return Err(self.damaged(len));
                }
                Ok(Named::This)
            }
            _ => Ok(Named::Other),
        }
    }

    /// Whether the open state file is still whole, whatever the path names
    /// now (`fstat`): before a store into its mapping.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] if it was shortened.
    pub(crate) fn whole(&self) -> Result<(), ProcessLockError> {
        let (_, len) =
            unix::file_id(&self.state).map_err(|e| ProcessLockError::io("stat", &self.path, e))?;
        if len < FILE_LEN as u64 {
            return Err(self.damaged(len));
        }
        Ok(())
    }

    fn damaged(&self, len: u64) -> ProcessLockError {
        ProcessLockError::Damaged {
            path: self.path.clone(),
            len,
        }
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

    /// Creates a key's state file, whole: made under a temporary name,
    /// then linked to its path (so that no process ever opens a state file
    /// without its header), unless another process did first. Neither the
    /// file nor the directory is synced: the key's tokens are covered by
    /// the directory's durable ceiling (see `super::dir`), so a power loss
    /// that loses the new file (or its contents) loses no token.
    ///
    /// While it makes the file, the creator holds the temporary file's user
    /// byte shared (as any user of a key file does): that is how `prune`
    /// tells a live creator's temporary file from one left by a creator
    /// that died (the kernel lets a dead process's locks go), in any PID
    /// namespace. Should a prune remove the temporary file all the same (in
    /// the instant between its creation and that lock), the link finds it
    /// gone and the creation starts again under a new name.
    fn create_key(&self, path: &Path) -> Result<(), ProcessLockError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let mut attempts = 0;
        loop {
            let tmp = self.dir.join(format!(
                ".keylock-new-{}-{}",
                unix::pid(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| ProcessLockError::io("create the state file", &tmp, e))?;
            // Allocated now, so a full disk shows here, before any key is
            // held.
            let made = unix::try_lock_range(&file, unix::Kind::Shared, unix::USER_BYTE, 1)
                .and_then(|_| init_file(&file))
                .and_then(|()| std::fs::hard_link(&tmp, path));
            drop(file);
            let _ = std::fs::remove_file(&tmp);
            attempts += 1;
            return match made {
                Ok(()) => Ok(()),
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                // The temporary file was pruned before its creator's lock.
                Err(err) if err.kind() == io::ErrorKind::NotFound && attempts < 3 => continue,
                Err(err) => Err(ProcessLockError::io("create the state file", path, err)),
            };
        }
    }

    /// Opens (creating if need be), registers as a user (see
    /// [`super::reclaim`]) and maps a key's state file.
    ///
    /// The registration is a shared lock of the file's user byte, taken
    /// without waiting; only a reclaimer (which holds it exclusively for a
    /// few calls, and then removes the file or lets it be) refuses it, and
    /// the open is then made again after a short pause. Once registered,
    /// the path is looked at again: a file it no longer names was
    /// reclaimed (or removed from outside) between the open and the lock,
    /// and is given up for the path's.
    pub(crate) fn open_key(&self, stem: &str) -> Result<KeyFiles, ProcessLockError> {
        let path = self.state_path(stem);
        let mut backoff = Backoff::new();
        let mut paused = Duration::ZERO;
        loop {
            // Before the open: for tables of earlier builds (see `super::dir`).
            self.dir_state.bump();
            let state = match open_rw(&path) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    self.create_key(&path)?;
                    match open_rw(&path) {
                        Ok(file) => file,
                        // Reclaimed as soon as made (by a prune): again.
                        Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                        Err(err) => {
                            return Err(ProcessLockError::io("open the state file", &path, err))
                        }
                    }
                }
                Err(err) => return Err(ProcessLockError::io("open the state file", &path, err)),
            };
            if !register(&state, &path)? {
                // A reclaimer has it for an instant.
                drop(state);
                let pause = backoff.next();
                paused += pause;
                if paused > REGISTER_PATIENCE {
                    return Err(ProcessLockError::io(
                        "register as a user of",
                        &path,
                        io::Error::new(
                            io::ErrorKind::WouldBlock,
                            "another open file keeps its user byte locked exclusively",
                        ),
                    ));
                }
                std::thread::sleep(pause);
                continue;
            }
            let (id, _) =
                unix::file_id(&state).map_err(|e| ProcessLockError::io("stat", &path, e))?;
            let named = unix::path_id(&path).map_err(|e| ProcessLockError::io("stat", &path, e))?;
            if named.is_none_or(|(named, _)| named != id) {
                continue; // reclaimed before we registered: the path's file
            }
            let map = match KeyState::map(&state, &path, true, self.dir_state.ceiling()?) {
                Ok(map) => map,
                // A file whose creation a power loss cut short: removed,
                // and made afresh (see `super::reclaim::remove_blank`).
                Err(ProcessLockError::Corrupt { .. }) if remove_blank(&state, &path) => continue,
                Err(err) => return Err(err),
            };
            return Ok(KeyFiles::opened(stem, path, state, map, id));
        }
    }

    /// Puts a key's files, which hold no lock now, back into the cache
    /// (closes them if they were found replaced or damaged).
    pub(crate) fn put_back(&self, files: KeyFiles) {
        if !files.stale {
            self.cache.checkin(files);
        }
    }

    /// A second open file of the key, for a helper thread to wait on;
    /// `None` if the path no longer names the open state file (the next
    /// judgement opens the path's afresh).
    fn spare(&self, files: &mut KeyFiles) -> Result<Option<File>, ProcessLockError> {
        if let Some(file) = files.spare.take() {
            return Ok(Some(file));
        }
        let file = match open_rw(&files.path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => {
                return Err(ProcessLockError::io(
                    "open the state file",
                    &files.path,
                    err,
                ))
            }
        };
        let (id, _) =
            unix::file_id(&file).map_err(|e| ProcessLockError::io("stat", &files.path, e))?;
        Ok((id == files.id).then_some(file))
    }

    /// The judgement (see the module doc). `have` is a slot the caller
    /// holds already; it is let go unless the key is taken on it. On an
    /// error the caller drops (closes) the files, which frees their locks.
    fn judge(
        &self,
        files: &KeyFiles,
        mut have: Option<Have>,
        lease: Option<Duration>,
        claim: u64,
    ) -> Result<Step, ProcessLockError> {
        let map = &files.map;
        let let_go = |have: Option<Have>| match have {
            Some(h) => files.unlock_slot(h.slot, h.on),
            None => Ok(()),
        };
        loop {
            let word = map.load();
            let current = word.slot;
            let mine = match have {
                // The grant's slot is ours: its holder released or died.
                Some(h) if h.slot == current => h,
                _ if map.released(word) => match have {
                    Some(h) => h,
                    None if files.try_slot(current)? => Have {
                        slot: current,
                        on: On::State,
                    },
                    None => match self.locked_with_no_grant(files, current)? {
                        Ok(have) => have,
                        Err(step) => return Ok(step),
                    },
                },
                _ if files.try_slot(current)? => {
                    // Free: the holder is dead.
                    let_go(have.take())?;
                    Have {
                        slot: current,
                        on: On::State,
                    }
                }
                // Locked, but the kernel handed the slot to a waiter's
                // helper after the holder died (`stamp::mark_handed`): a
                // slot locked with no grant, as above (the helper's future
                // may never swap: forgotten). Its swap, if it comes, is
                // from this same word, so one of it and ours fails.
                _ if map.handed(word) => match have {
                    Some(h) => h,
                    None => match self.locked_with_no_grant(files, current)? {
                        Ok(have) => have,
                        Err(step) => return Ok(step),
                    },
                },
                _ => {
                    let now = unix::monotonic_ns();
                    let Some(deadline) = map.lease_of(word) else {
                        // Alive, its stamp not written yet.
                        let_go(have)?;
                        let soon = u64::try_from(UNSTAMPED_RECHECK.as_nanos()).unwrap_or(0);
                        return Ok(Step::WaitSlot {
                            slot: current,
                            recheck: Some(now.saturating_add(soon)),
                            free: false,
                        });
                    };
                    if now < deadline {
                        // Alive, within its lease (or without one).
                        let_go(have)?;
                        return Ok(Step::WaitSlot {
                            slot: current,
                            recheck: (deadline != super::stamp::NO_LEASE).then_some(deadline),
                            free: false,
                        });
                    }
                    // Alive, past its lease. A waiter with the claim takes
                    // it over first.
                    if self.claimed_by_another(files, claim)? {
                        let_go(have)?;
                        return Ok(Step::Defer);
                    }
                    // Mark it taken, so that a renew racing us fails (or
                    // makes us fail and judge again).
                    if deadline != TAKEN
                        && map
                            .lease(current)
                            .compare_exchange(deadline, TAKEN, Ordering::SeqCst, Ordering::SeqCst)
                            .is_err()
                    {
                        continue;
                    }
                    // Take over on another slot.
                    match have {
                        Some(h) => h,
                        None => match self.free_slot(files, current)? {
                            Some(slot) => Have {
                                slot,
                                on: On::State,
                            },
                            None => return Ok(Step::Backoff),
                        },
                    }
                }
            };
            if self.claimed_by_another(files, claim)? {
                // Another process's waiter has the next turn.
                let_go(Some(mine))?;
                return Ok(Step::Defer);
            }
            let floor = || self.dir_state.floor();
            let Some(token) = map.swap(word, mine.slot, &files.path, floor)? else {
                // The word moved: judge again, keeping the slot we hold.
                have = Some(mine);
                continue;
            };
            test_hook::after_swap();
            if map.no_grant_since().load(Ordering::Relaxed) != 0 {
                map.no_grant_since().store(0, Ordering::SeqCst);
            }
            if self.dir_state.reserve(token)? {
                // A disk sync may take long: look at the file's length
                // again before the stamp's stores (see the module doc).
                files.whole()?;
            }
            let now = unix::monotonic_ns();
            let lease_deadline =
                lease.map(|l| now.saturating_add(u64::try_from(l.as_nanos()).unwrap_or(u64::MAX)));
            map.write_stamp(
                mine.slot,
                &NewStamp {
                    pid: unix::pid(),
                    token,
                    lease_deadline,
                    granted_mono: now,
                    granted_unix_ns: unix_now_ns(),
                    host: unix::hostname(),
                    label: self.label.as_deref(),
                },
            );
            return Ok(Step::Granted {
                slot: mine.slot,
                on: mine.on,
                token,
            });
        }
    }

    /// Whether a waiter other than the caller (whose claim is `claim`, or
    /// 0) holds the key's claim: the claim word names it and its lock is
    /// held. A claim word whose lock is free was left by a waiter that
    /// died or gave up: it is cleared here. One load when no claim is out.
    #[inline]
    fn claimed_by_another(&self, files: &KeyFiles, claim: u64) -> Result<bool, ProcessLockError> {
        let word = files.map.claim().load(Ordering::SeqCst);
        if word == 0 || word == claim {
            return Ok(false);
        }
        self.claim_alive(files, word)
    }

    #[cold]
    fn claim_alive(&self, files: &KeyFiles, word: u64) -> Result<bool, ProcessLockError> {
        let map = &files.map;
        // A look at the lock, taking none (locks of the caller's own open
        // file are not seen, and it holds no claim).
        let held = unix::range_locked(&files.state, unix::CLAIM_BYTE, 1)
            .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
        if held {
            // Deferred to for how long? A claimant that does not take a
            // free key within its patience (stopped, its future no longer
            // polled) loses the claim.
            let now = unix::monotonic_ns().max(1);
            let since =
                match map
                    .claim_since()
                    .compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => now,
                    Err(since) => since,
                };
            let patience = u64::try_from(CLAIM_PATIENCE.as_nanos()).unwrap_or(u64::MAX);
            if now.saturating_sub(since) < patience {
                return Ok(true);
            }
        }
        // Dead, or out of patience: cleared.
        if map
            .claim()
            .compare_exchange(word, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            map.claim_since().store(0, Ordering::SeqCst);
        }
        Ok(false)
    }

    /// Takes the key's claim for a waiter that must wait, if no other
    /// waiter holds it: its lock (on the state file's open file), then the
    /// claim word. Returns the claim, or 0 if another waiter has it.
    fn take_claim(&self, files: &KeyFiles) -> Result<u64, ProcessLockError> {
        let got = unix::try_lock_range(&files.state, unix::Kind::Exclusive, unix::CLAIM_BYTE, 1)
            .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
        if !got {
            return Ok(0);
        }
        let claim = next_claim();
        files.map.claim_since().store(0, Ordering::SeqCst);
        files.map.claim().store(claim, Ordering::SeqCst);
        Ok(claim)
    }

    /// Gives the claim back (after the grant): the word first, then its
    /// lock, so that a claim word with its lock free is always a dead one.
    fn drop_claim(&self, files: &KeyFiles, claim: u64) -> Result<(), ProcessLockError> {
        if files
            .map
            .claim()
            .compare_exchange(claim, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            files.map.claim_since().store(0, Ordering::SeqCst);
        }
        unix::unlock_range(&files.state, unix::CLAIM_BYTE, 1)
            .map_err(|e| ProcessLockError::io("unlock", &files.path, e))
    }

    /// The key's slot `current` is locked with no grant: waited for up to
    /// the patience (`Err`: the step to wait), then the key is taken on
    /// another free slot (`Ok`; a late taker's swap then fails), or every
    /// slot is locked (`Err(Backoff)`).
    fn locked_with_no_grant(
        &self,
        files: &KeyFiles,
        current: u32,
    ) -> Result<Result<Have, Step>, ProcessLockError> {
        Ok(match no_grant_patience(files) {
            Some(until) => Err(Step::WaitSlot {
                slot: current,
                recheck: Some(until),
                free: true,
            }),
            None => match self.free_slot(files, current)? {
                Some(slot) => Ok(Have {
                    slot,
                    on: On::State,
                }),
                None => Err(Step::Backoff),
            },
        })
    }

    fn free_slot(&self, files: &KeyFiles, except: u32) -> Result<Option<u32>, ProcessLockError> {
        for slot in (0..MAX_SLOTS).filter(|&s| s != except) {
            if files.try_slot(slot)? {
                return Ok(Some(slot));
            }
        }
        Ok(None)
    }

    /// One judgement, first making sure that the key's path still names
    /// the open file, whole (the caller may hold `have`; see the module
    /// doc). `None`: the path names another file (or none); `files` is
    /// opened afresh (and `have` let go with the old one).
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] for a file shortened by someone else;
    /// the caller drops (closes) the files, which lets `have` go.
    #[inline]
    fn judge_checked(
        &self,
        files: &mut KeyFiles,
        have: Option<Have>,
        lease: Option<Duration>,
        claim: u64,
    ) -> Result<Option<Step>, ProcessLockError> {
        if files.named()? == Named::Other {
            // Closing the old file's descriptors lets its locks go (the
            // claim's included).
            *files = self.open_key(&std::sync::Arc::clone(&files.stem))?;
            return Ok(None);
        }
        self.judge(files, have, lease, claim).map(Some)
    }

    /// Takes the key now if no live holder has it (no wait): `Err(by)` if
    /// one has, where `by` says who kept it should its file show no grant
    /// by the time it is read ([`Self::who_holds`]): [`HeldBy::KernelLock`]
    /// if the judgement found the slot locked with no grant, else
    /// [`HeldBy::Ended`].
    pub(crate) fn try_grant(
        &self,
        stem: &str,
        lease: Option<Duration>,
    ) -> Result<Result<Grant, HeldBy>, ProcessLockError> {
        let mut files = self.key_files(stem)?;
        let mut by = HeldBy::Ended;
        for _ in 0..4 {
            let have = files.try_slot(0)?.then_some(Have {
                slot: 0,
                on: On::State,
            });
            match self.judge_checked(&mut files, have, lease, 0)? {
                None => {}
                Some(Step::Granted { slot, on, token }) => {
                    return Ok(Ok(Grant {
                        files,
                        slot,
                        on,
                        token,
                    }))
                }
                Some(Step::WaitSlot { free, .. }) => {
                    if free {
                        by = HeldBy::KernelLock;
                    }
                    break;
                }
                Some(Step::Defer) => {
                    by = HeldBy::Claimed;
                    break;
                }
                Some(Step::Backoff) => break,
            }
        }
        self.put_back(files);
        Ok(Err(by))
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
        // The key's claim, once this waiter holds it (0: not); given back
        // with the grant, or with the files (closing them frees its lock).
        let mut claim = 0;
        // The slot of a live holder without a lease this wait judged again
        // for, and how many times (see `NO_LEASE_RECHECK_MAX` below).
        let mut rechecked: Option<(u32, u32)> = None;
        loop {
            if have.is_none() && files.try_slot(0)? {
                have = Some(Have {
                    slot: 0,
                    on: On::State,
                });
            }
            let Some(step) = self.judge_checked(&mut files, have.take(), lease, claim)? else {
                pending = None;
                claim = 0;
                continue;
            };
            if claim == 0 && matches!(step, Step::WaitSlot { .. }) {
                // This waiter must wait: it takes the next turn, unless
                // another waiter has it.
                claim = self.take_claim(&files)?;
            }
            match step {
                Step::Granted { slot, on, token } => {
                    if claim != 0 {
                        self.drop_claim(&files, claim)?;
                    }
                    return Ok(Grant {
                        files,
                        slot,
                        on,
                        token,
                    });
                }
                Step::WaitSlot {
                    slot,
                    recheck,
                    free,
                } => {
                    // A live holder without a lease: only its release ends
                    // the wait. But the holder may have died just as the
                    // kernel handed its slot to another open file's helper
                    // (a forgotten lock future's), which records the
                    // handing (`stamp::mark_handed`) only after the kernel
                    // woke it: a judgement between the two sees a live
                    // holder, and would wait for good; so would a wait
                    // begun before the holder died, if the kernel handed
                    // the slot to the forgotten helper rather than to its
                    // own. So a wait for such a holder's slot judges again
                    // after `NO_GRANT_PATIENCE`, then twice that, up to
                    // `NO_LEASE_RECHECK_MAX`, for as long as it waits.
                    // (Not a blocking wait with no deadline, which waits in
                    // the kernel on the caller's thread, with no timer: a
                    // handoff to it would take a thread hop more.)
                    let in_kernel = on_this_thread && deadline.is_none();
                    let recheck = match recheck {
                        None if in_kernel => None,
                        None if !free => {
                            let n = match rechecked {
                                Some((at, n)) if at == slot => n,
                                _ => 0,
                            };
                            rechecked = Some((slot, n.saturating_add(1)));
                            let patience = NO_GRANT_PATIENCE
                                .saturating_mul(1 << n.min(8))
                                .min(NO_LEASE_RECHECK_MAX);
                            let patience = u64::try_from(patience.as_nanos()).unwrap_or(u64::MAX);
                            Some(unix::monotonic_ns().saturating_add(patience))
                        }
                        recheck => recheck,
                    };
                    if in_kernel && recheck.is_none() {
                        // Only the kernel can end this wait: make it here,
                        // on the caller's own (blocking) thread.
                        drop(pending.take());
                        let Some(file) = self.spare(&mut files)? else {
                            continue;
                        };
                        helper::wait_here(|| unix::lock_slot(&file, slot))
                            .map_err(|e| ProcessLockError::io("lock", &files.path, e))?;
                        rechecked = None;
                        files.spare = Some(file);
                        have = Some(Have {
                            slot,
                            on: On::Spare,
                        });
                        continue;
                    }
                    if pending.as_ref().is_none_or(|(s, _)| *s != slot) {
                        drop(pending.take());
                        let Some(file) = self.spare(&mut files)? else {
                            continue;
                        };
                        let wait = KernelWait::start(file, slot).map_err(|e| {
                            ProcessLockError::io("start a helper thread for", &files.path, e)
                        })?;
                        pending = Some((slot, wait));
                    }
                    let lapse = recheck.map(instant_of_monotonic);
                    let wake = match (deadline, lapse) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    let (_, wait) = pending.as_mut().expect("set above");
                    match wait_until(wait, wake).await {
                        Some(Ok(file)) => {
                            rechecked = None;
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
                                let no_grant = if free {
                                    HeldBy::KernelLock
                                } else {
                                    HeldBy::Ended
                                };
                                return Err(self.timeout(stem, started, no_grant));
                            }
                            // The holder's lease deadline: judge again.
                        }
                    }
                }
                Step::Backoff | Step::Defer => {
                    let at = Instant::now() + backoff.next();
                    let at = deadline.map_or(at, |d| d.min(at));
                    Sleeper::new(at).await;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        let no_grant = if matches!(step, Step::Defer) {
                            HeldBy::Claimed
                        } else {
                            HeldBy::Ended
                        };
                        return Err(self.timeout(stem, started, no_grant));
                    }
                }
            }
        }
    }

    /// The timeout of a wait for `stem`, naming who kept the key;
    /// `no_grant` says who, should the key's file show no grant (see
    /// [`Self::who_holds`]): [`HeldBy::ThisProcess`] for a wait that ran
    /// out in the process's own queue.
    pub(crate) fn timeout(
        &self,
        stem: &str,
        started: Instant,
        no_grant: HeldBy,
    ) -> ProcessLockError {
        // Diagnosis must never replace the timeout it explains.
        let (holder, by) = self.blocker(stem, no_grant);
        ProcessLockError::Timeout {
            waited: started.elapsed(),
            holder,
            by,
            key: super::key::name(stem),
            path: self.state_path(stem),
        }
    }

    /// Who kept `stem` from a caller, for an error: as [`Self::who_holds`]
    /// says. Never fails: a file that cannot be read is said so (unless
    /// `no_grant` is [`HeldBy::ThisProcess`], which stays true).
    pub(crate) fn blocker(
        &self,
        stem: &str,
        no_grant: HeldBy,
    ) -> (Option<Box<ProcessHolder>>, HeldBy) {
        match self.who_holds(stem, no_grant) {
            Ok((holder, by)) => (holder.map(Box::new), by),
            Err(_) if no_grant == HeldBy::ThisProcess => (None, HeldBy::ThisProcess),
            Err(_) => (None, HeldBy::Unknown),
        }
    }

    /// Reads a key's state word and owner stamp and asks the kernel whether
    /// its holder is alive.
    pub(crate) fn holder_of(&self, stem: &str) -> Result<Option<ProcessHolder>, ProcessLockError> {
        self.who_holds(stem, HeldBy::Ended)
            .map(|(holder, _)| holder)
    }

    /// Who holds a key now, from its file alone: its grant's stamp (and
    /// whether its holder is alive, from the kernel) and whose it is
    /// (this process if the stamp's pid is ours); with no grant, the
    /// caller's `no_grant` (what it knows of the moment before: a slot it
    /// found locked with no grant, a caller of this process ahead of it,
    /// or nothing). A key without a grant is never probed with a lock of
    /// its own, which could make another process's `try_lock` fail.
    pub(crate) fn who_holds(
        &self,
        stem: &str,
        no_grant: HeldBy,
    ) -> Result<(Option<ProcessHolder>, HeldBy), ProcessLockError> {
        let path = self.state_path(stem);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok((None, no_grant)),
            Err(err) => return Err(ProcessLockError::io("open the state file", &path, err)),
        };
        let map = KeyState::map(&file, &path, false, 0)?;
        if !map.this_boot() {
            // Written before a reboot: nobody holds it now.
            return Ok((None, no_grant));
        }
        let mut word = map.load();
        let mut stamp = None;
        for _ in 0..16 {
            if map.released(word) {
                return Ok((None, no_grant));
            }
            stamp = map.read_stamp(word);
            if stamp.is_some() {
                break;
            }
            // Its stamp is being written: a moment.
            std::thread::yield_now();
            word = map.load();
        }
        let now = unix::monotonic_ns();
        let stamp = stamp.unwrap_or_else(|| unstamped(word, now));
        // Alive while its slot is locked: a look at the lock, taking none.
        let alive = unix::slot_locked(&file, word.slot)
            .map_err(|e| ProcessLockError::io("lock", &path, e))?;
        drop(map);
        drop(file);
        let by = if stamp.pid == unix::pid() {
            HeldBy::ThisProcess
        } else {
            HeldBy::AnotherProcess
        };
        Ok((stamp.holder(alive, now), by))
    }
}

/// What is known of a grant whose stamp was never written (its holder
/// died, or is stopped, between its grant and its stamp).
fn unstamped(word: Word, now: u64) -> Stamp {
    Stamp {
        pid: 0,
        token: word.token,
        lease_deadline: None,
        granted_mono: now,
        granted_unix_ns: unix_now_ns(),
        host: String::new(),
        label: None,
    }
}

/// A test hook: with the `test-util` feature, a process whose environment
/// has `KEYLOCK_TEST_DIE_AFTER_SWAP` set aborts right after winning a
/// grant's swap, before its stamp is written (the tests of a taker dying
/// there). Without the feature it is nothing.
mod test_hook {
    #[cfg(feature = "test-util")]
    pub(super) fn after_swap() {
        static DIE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *DIE.get_or_init(|| std::env::var_os("KEYLOCK_TEST_DIE_AFTER_SWAP").is_some()) {
            std::process::abort();
        }
    }

    #[cfg(not(feature = "test-util"))]
    #[inline(always)]
    pub(super) fn after_swap() {}
}

/// A judgement found the word's grant released and its slot locked by
/// another open file: `Some(until)` while that has lasted less than
/// [`NO_GRANT_PATIENCE`] (counted from the first judgement that saw it
/// since the last grant, kept in the file), `None` once it has.
#[cold]
fn no_grant_patience(files: &KeyFiles) -> Option<u64> {
    let since_word = files.map.no_grant_since();
    let now = unix::monotonic_ns().max(1);
    let since = match since_word.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => now,
        Err(since) => since,
    };
    let patience = u64::try_from(NO_GRANT_PATIENCE.as_nanos()).unwrap_or(u64::MAX);
    let until = since.saturating_add(patience);
    (now < until).then_some(until)
}

/// A claim word no other waiter of any process uses at once: this
/// process's pid and a counter of its claims (never 0).
fn next_claim() -> u64 {
    static COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    u64::from(unix::pid()) << 32 | u64::from(n) | 1 << 31
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
