//! The lock directory's own file, `keylock.dir`: the check that the
//! directory takes kernel locks, made when a table opens it, and its
//! shared words: the *open epoch*, the *token floor* and the durable
//! *token ceiling* of every key of the directory.
//!
//! # Layout (one page, 64-bit words)
//!
//! | offset | what |
//! |--------|------|
//! | 0      | the open epoch |
//! | 8      | the boot id the floor and the published ceiling were last trusted under (16 bytes) |
//! | 24     | the **token floor**: at least every token of every key file reclaimed |
//! | 32     | the **published ceiling**: a ceiling known to be on the disk |
//! | 1024   | ceiling copy A |
//! | 3072   | ceiling copy B |
//!
//! # Tokens across reclaim, restarts and reboots
//!
//! A key's tokens come from its file's state word, and a key file can be
//! reclaimed (removed while nobody uses it, [`super::reclaim`]) and made
//! again. Two words of this file keep the tokens of a key increasing
//! across that:
//!
//! - The **floor** `F`: a reclaimer raises it (`fetch_max`) to the last
//!   token of the file it reclaims *before* it removes the file, and the
//!   first grant of a new file (its word still 0) hands out `F + 1`, read
//!   at that grant (so after the file is linked: a file made from a stale
//!   reading cannot hand out a stale token). So within a boot every new
//!   file of a key starts above every token of its earlier files.
//! - The **ceiling** `C`: every token this build hands out, for any key,
//!   is at most the published ceiling, which is on the disk. A grant whose
//!   token passes it first raises both copies of `C` to the token plus
//!   [`RESERVE_BLOCK`] (`fetch_max`, so concurrent raisers of several keys
//!   never undo each other), syncs the page (`msync`), and only then
//!   raises the published word. After a reboot (the boot id differs), the
//!   first table to open the directory reads the higher valid copy, syncs
//!   the page (a late reset may read copies another table raised and has
//!   not synced yet), then publishes that copy and raises the floor to it; a key file is then reset
//!   to at least that ceiling (see [`super::stamp`]). So a token handed out
//!   before a power loss is below every token after it, whether the key's
//!   file survived, was reclaimed, or was lost with its creation.
//!
//! The two copies lie in different 512-byte sectors: a write torn by a
//! power loss leaves one of them at least at its old, durable value (a
//! copy at or above the token limit is garbage and ignored). Because the
//! ceiling covers every key, a new key file needs no disk sync of its own:
//! its first grants are covered by the ceiling already on the disk (one
//! sync per [`RESERVE_BLOCK`] tokens of the directory's highest key, not
//! one per key). The floor itself is never synced: the page cache keeps it
//! across process crashes, and after a reboot it restarts at the ceiling.
//!
//! # The check, without waiting
//!
//! A table opening the directory creates `keylock.dir` if need be and tries
//! (`F_OFD_SETLK`, never the waiting `F_OFD_SETLKW`) a shared lock of its
//! first byte, let go at once. Taken: the file system has open file
//! description locks. Refused because another open file holds a
//! conflicting lock (a program that locks `keylock.dir` with `fcntl`, a
//! classic POSIX lock included): that proves the same, and nothing of
//! keylock depends on locks of `keylock.dir`, so the open goes on. Only an
//! error that says the file system has no such locks fails it. So `open`
//! never waits for anyone.
//!
//! # The open epoch
//!
//! A table adds one to the epoch before it opens a key's state file from
//! its path. Earlier builds of this format compare it, before a grant on a
//! file they kept open, with the value they last saw, and look at the file
//! again only if it moved; they are kept safe by moving it. This build
//! does not read it: before every grant, and in every `check()`, it makes
//! sure that the key's path still names the file it holds open (device and
//! inode, [`super::unix::FileId`]), which also notices a directory that was
//! removed or moved aside and made again, where no epoch can tell (the
//! epoch lives in the old directory's file).
//!
//! `keylock.dir` is sized (allocated) to one page when a table opens the
//! directory (and then synced with its directory entry, once). Its length
//! is looked at (`fstat`) before every access to its page (a move of the
//! epoch, which is skipped if something shortened the file; a read of the
//! floor or the ceiling, which fails [`ProcessLockError::Damaged`]
//! instead): a mapped page beyond the end of a file raises `SIGBUS`, and a
//! lock must not crash its process because someone else damaged a file
//! (the window left, between the look and the access, is a few
//! instructions with no call between them). The hot path reads no page of
//! it: a grant compares its token with a ceiling this process already
//! knows to be published.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::error::ProcessLockError;
use super::shared::Mapping;
use super::stamp::{boot_words, RESERVE_BLOCK, TOKEN_LIMIT};
use super::unix;

const LEN: usize = 4096;
const EPOCH_AT: usize = 0;
const BOOT_AT: usize = 8;
const FLOOR_AT: usize = 24;
const PUBLISHED_AT: usize = 32;
const CEILING_AT: [usize; 2] = [1024, 3072];
/// The file's name in the lock directory.
pub(crate) const NAME: &str = "keylock.dir";

/// The mapped `keylock.dir` of a table's directory.
#[derive(Debug)]
pub(crate) struct DirState {
    file: File,
    map: Mapping,
    path: PathBuf,
    dir: PathBuf,
    /// Whether this table made sure `keylock.dir`'s directory entry is on
    /// the disk (done before the first ceiling it syncs is relied on).
    entry_synced: AtomicBool,
    /// A ceiling this process knows to be published (a lower bound of the
    /// published word, kept in the process: the hot path reads no page of
    /// a file someone else could have shortened).
    known: AtomicU64,
    /// The highest ceiling this table's syncs made durable (for tests:
    /// what a power loss would leave of its work).
    #[cfg(test)]
    synced: AtomicU64,
}

impl DirState {
    /// Opens (creating if need be) `dir`'s `keylock.dir`, checks that it
    /// takes kernel locks without waiting for any (see the module doc),
    /// sizes it if need be, maps it, and resets its floor and published
    /// ceiling if they were left from another boot.
    pub(crate) fn open(dir: &Path) -> Result<Self, ProcessLockError> {
        let path = dir.join(NAME);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| ProcessLockError::io("create a file in the lock directory", &path, e))?;
        let probe = |file: &File| -> std::io::Result<()> {
            if unix::try_lock_range(file, unix::Kind::Shared, 0, 1)? {
                unix::unlock_range(file, 0, 1)?;
            }
            // Else another open file holds a conflicting lock: locks work.
            Ok(())
        };
        probe(&file).map_err(|e| {
            ProcessLockError::io("take a kernel lock (fcntl F_OFD_SETLK) on", &path, e)
        })?;
        let state = Self::map(file, path, dir)?;
        if !state.this_boot() {
            state.reset_after_reboot()?;
        }
        Ok(state)
    }

    /// Sizes (if need be: then also syncs it and its directory entry) and
    /// maps `file`, the directory's `keylock.dir`.
    fn map(file: File, path: PathBuf, dir: &Path) -> Result<Self, ProcessLockError> {
        let len = file
            .metadata()
            .map_err(|e| ProcessLockError::io("stat", &path, e))?
            .len();
        let mut synced = false;
        if len < LEN as u64 {
            unix::allocate(&file, LEN as u64)
                .and_then(|()| file.sync_all())
                .and_then(|()| unix::sync_dir(dir))
                .map_err(|e| ProcessLockError::io("allocate", &path, e))?;
            synced = true;
        }
        let map =
            Mapping::map(&file, LEN, true).map_err(|e| ProcessLockError::io("map", &path, e))?;
        Ok(Self {
            file,
            map,
            path,
            dir: dir.to_path_buf(),
            entry_synced: AtomicBool::new(synced),
            known: AtomicU64::new(0),
            #[cfg(test)]
            synced: AtomicU64::new(0),
        })
    }

    /// Whether the file is still whole: before every access to its page
    /// (a mapped page beyond the end of a file raises `SIGBUS`).
    fn whole(&self) -> Result<(), ProcessLockError> {
        let (_, len) =
            unix::file_id(&self.file).map_err(|e| ProcessLockError::io("stat", &self.path, e))?;
        if len < LEN as u64 {
            return Err(ProcessLockError::Damaged {
                path: self.path.clone(),
                len,
            });
        }
        Ok(())
    }

    fn this_boot(&self) -> bool {
        let [a, b] = boot_words();
        self.map.word(BOOT_AT).load(Ordering::Acquire) == a
            && self.map.word(BOOT_AT + 8).load(Ordering::Acquire) == b
    }

    /// The durable ceiling on the disk: the higher valid copy.
    fn durable(&self) -> u64 {
        CEILING_AT
            .map(|at| self.map.word(at).load(Ordering::SeqCst))
            .into_iter()
            .filter(|&c| c < TOKEN_LIMIT + RESERVE_BLOCK)
            .max()
            .unwrap_or(0)
    }

    /// The first tables of a boot: the published ceiling is the durable
    /// one, and the floor at least that.
    ///
    /// The copies read here are the page cache's, not the disk's: a table
    /// that read the old boot id may run this late, while a table of this
    /// boot has already raised the copies for a grant (`raise`) and not yet
    /// synced them. Publishing that reading as it is would let a third
    /// table hand out a token that only an unsynced word covers, and a
    /// power loss would then hand it out again. So the page is synced
    /// (`msync`) *after* the reading and before it is published: the
    /// copies only grow (`fetch_max`), so once the sync returns the disk
    /// holds a ceiling at least the one read, and the published word is
    /// again a ceiling known to be on the disk. With that, every step is
    /// idempotent (a store of what is on the disk, a `fetch_max`), so
    /// tables of one boot racing here need no lock (and `open` never waits
    /// for one): a late store of the published word can only lower it,
    /// which costs a sync, never a token.
    fn reset_after_reboot(&self) -> Result<(), ProcessLockError> {
        self.whole()?;
        let ceiling = self.durable();
        self.sync_page()
            .map_err(|e| ProcessLockError::io("sync the token ceiling of", &self.path, e))?;
        // The sync may take long: look at the length again.
        self.whole()?;
        self.map.word(PUBLISHED_AT).store(ceiling, Ordering::SeqCst);
        self.map.word(FLOOR_AT).fetch_max(ceiling, Ordering::SeqCst);
        let [a, b] = boot_words();
        self.map.word(BOOT_AT).store(a, Ordering::SeqCst);
        self.map.word(BOOT_AT + 8).store(b, Ordering::SeqCst);
        Ok(())
    }

    /// Syncs the page (`msync`): every ceiling the copies held before the
    /// call is on the disk when it returns. The caller looked at the
    /// file's length just before.
    fn sync_page(&self) -> std::io::Result<()> {
        #[cfg(test)]
        let seen = self.durable();
        self.map.sync(LEN)?;
        #[cfg(test)]
        self.synced.fetch_max(seen, Ordering::SeqCst);
        Ok(())
    }

    /// Moves the epoch: done before opening a key file from its path.
    /// Skipped if the file was shortened (see the module doc).
    pub(crate) fn bump(&self) {
        if self.whole().is_ok() {
            self.map.word(EPOCH_AT).fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The token floor: the first grant of a new key file hands out one
    /// more.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] if `keylock.dir` was shortened.
    pub(crate) fn floor(&self) -> Result<u64, ProcessLockError> {
        self.whole()?;
        Ok(self.map.word(FLOOR_AT).load(Ordering::SeqCst))
    }

    /// Raises the floor to `token`, the last token of a key file about to
    /// be reclaimed.
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] if `keylock.dir` was shortened.
    pub(crate) fn fold(&self, token: u64) -> Result<(), ProcessLockError> {
        self.whole()?;
        self.map.word(FLOOR_AT).fetch_max(token, Ordering::SeqCst);
        Ok(())
    }

    /// The published ceiling (a key file left from another boot is reset
    /// to at least it).
    ///
    /// # Errors
    ///
    /// [`ProcessLockError::Damaged`] if `keylock.dir` was shortened.
    pub(crate) fn ceiling(&self) -> Result<u64, ProcessLockError> {
        self.whole()?;
        let published = self.map.word(PUBLISHED_AT).load(Ordering::SeqCst);
        self.known.fetch_max(published, Ordering::Relaxed);
        Ok(published)
    }

    /// Makes a ceiling at or above `token` durable before `token` is handed
    /// out: `Ok(true)` if that took a disk sync, `Ok(false)` if one was on
    /// the disk already (one load of a word of this process, usually).
    #[inline]
    pub(crate) fn reserve(&self, token: u64) -> Result<bool, ProcessLockError> {
        if token <= self.known.load(Ordering::Relaxed) {
            return Ok(false);
        }
        self.raise(token)
    }

    #[cold]
    fn raise(&self, token: u64) -> Result<bool, ProcessLockError> {
        if token <= self.ceiling()? {
            return Ok(false);
        }
        let ceiling = token.saturating_add(RESERVE_BLOCK);
        for at in CEILING_AT {
            self.map.word(at).fetch_max(ceiling, Ordering::SeqCst);
        }
        let failed = |e| ProcessLockError::io("reserve fencing tokens in", &self.path, e);
        if !self.entry_synced.load(Ordering::Relaxed) {
            unix::sync_dir(&self.dir).map_err(failed)?;
            self.entry_synced.store(true, Ordering::Relaxed);
        }
        self.sync_page().map_err(failed)?;
        // The sync may take long: look at the length again.
        self.whole()?;
        self.map
            .word(PUBLISHED_AT)
            .fetch_max(ceiling, Ordering::SeqCst);
        self.known.fetch_max(ceiling, Ordering::Relaxed);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("keylock-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The interleaving of a reset left late: a table of this boot raised
    /// the ceiling copies for a grant and is preempted before its sync;
    /// a table that read the old boot id then resets the directory. What
    /// it publishes must be on the disk, or a third table's token covered
    /// by it alone is handed out again after a power loss.
    #[test]
    #[cfg_attr(miri, ignore = "maps files: not under miri")]
    fn a_late_reset_publishes_only_a_ceiling_on_the_disk() {
        let dir = temp("late-reset");
        let first = DirState::open(&dir).unwrap();
        let raised = RESERVE_BLOCK * 7;
        // `raise`, stopped between its `fetch_max` of the copies and its sync.
        for at in CEILING_AT {
            first.map.word(at).fetch_max(raised, Ordering::SeqCst);
        }
        assert_eq!(first.synced.load(Ordering::SeqCst), 0);
        // A table that read the old boot id: forged by the words it read.
        first.map.word(BOOT_AT).store(0, Ordering::SeqCst);
        first.map.word(BOOT_AT + 8).store(0, Ordering::SeqCst);
        let late = DirState::open(&dir).unwrap();
        let published = late.ceiling().unwrap();
        assert_eq!(published, raised, "the reset publishes the copies read");
        // Nobody but the reset synced: what it published, its sync made
        // durable.
        assert!(
            published <= late.synced.load(Ordering::SeqCst),
            "published {published}, on the disk {}",
            late.synced.load(Ordering::SeqCst)
        );
        // A third table hands out tokens up to it without a sync of its own.
        let third = DirState::open(&dir).unwrap();
        assert!(!third.reserve(raised).unwrap());
        assert!(third.reserve(raised + 1).unwrap());
        drop((first, late, third));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
