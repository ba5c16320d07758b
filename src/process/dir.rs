//! The lock directory's own file, `keylock.dir`: the check that the
//! directory takes kernel locks, made when a table opens it, and its
//! shared word, the *open epoch*.
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
//! directory; its other bytes are unused. Its length is looked at
//! (`fstat`) before each move of the epoch, which is skipped if something
//! shortened the file: a mapped page beyond the end of a file raises
//! `SIGBUS`, and a lock must not crash its process because someone else
//! damaged a file (the window left, between the look and the add, is a
//! few instructions with no call between them).

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::error::ProcessLockError;
use super::shared::Mapping;
use super::unix;

const LEN: usize = 4096;
const EPOCH_AT: usize = 0;
/// The file's name in the lock directory.
pub(crate) const NAME: &str = "keylock.dir";

/// The mapped `keylock.dir` of a table's directory.
#[derive(Debug)]
pub(crate) struct DirState {
    file: File,
    map: Mapping,
}

impl DirState {
    /// Opens (creating if need be) `dir`'s `keylock.dir`, checks that it
    /// takes kernel locks without waiting for any (see the module doc),
    /// sizes it if need be and maps it.
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
        Self::map(file, &path)
    }

    /// Sizes (if need be) and maps `file`, the directory's `keylock.dir`.
    fn map(file: File, path: &Path) -> Result<Self, ProcessLockError> {
        let len = file
            .metadata()
            .map_err(|e| ProcessLockError::io("stat", path, e))?
            .len();
        if len < LEN as u64 {
            unix::allocate(&file, LEN as u64)
                .map_err(|e| ProcessLockError::io("allocate", path, e))?;
        }
        let map =
            Mapping::map(&file, LEN, true).map_err(|e| ProcessLockError::io("map", path, e))?;
        Ok(Self { file, map })
    }

    /// Moves the epoch: done before opening a key file from its path.
    /// Skipped if the file was shortened (see the module doc).
    pub(crate) fn bump(&self) {
        if unix::file_id(&self.file).is_ok_and(|(_, len)| len >= LEN as u64) {
            self.map.word(EPOCH_AT).fetch_add(1, Ordering::SeqCst);
        }
    }
}
