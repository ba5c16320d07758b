//! The directory's shared word: the *open epoch*, counted in
//! `keylock.dir`, mapped by every table of the directory.
//!
//! A table that opens a key's state file from its path (a new key, or one
//! whose files it does not keep open) first adds one to the epoch. A table
//! that takes a key on files it kept open compares the epoch with the one
//! it saw when it last made sure those files were still linked; only if it
//! moved does it look again (`fstat`: `nlink != 0`), and if the file was
//! deleted, it opens the path afresh. So a cached descriptor of a deleted
//! or replaced file is noticed before any other process can lock the file
//! that replaced it (that process opens it, which moves the epoch first),
//! and an uncontended lock of a cached key makes no `fstat` while nobody
//! opens key files. A holder's `check()` looks itself (`fstat`), every
//! time.
//!
//! `keylock.dir` is sized (allocated) to one page when a table opens the
//! directory; its other bytes are unused. Like the key files, it must not
//! be shortened while tables use it.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::error::ProcessLockError;
use super::shared::Mapping;
use super::unix;

const LEN: usize = 4096;
const EPOCH_AT: usize = 0;

/// The mapped `keylock.dir` of a table's directory.
#[derive(Debug)]
pub(crate) struct DirState {
    map: Mapping,
}

impl DirState {
    /// Sizes (if need be) and maps `file`, the directory's `keylock.dir`.
    pub(crate) fn map(file: &File, path: &Path) -> Result<Self, ProcessLockError> {
        let len = file
            .metadata()
            .map_err(|e| ProcessLockError::io("stat", path, e))?
            .len();
        if len < LEN as u64 {
            unix::allocate(file, LEN as u64)
                .map_err(|e| ProcessLockError::io("allocate", path, e))?;
        }
        let map =
            Mapping::map(file, LEN, true).map_err(|e| ProcessLockError::io("map", path, e))?;
        Ok(Self { map })
    }

    /// The open epoch now.
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.map.word(EPOCH_AT).load(Ordering::SeqCst)
    }

    /// Moves the epoch: done before opening a key file from its path.
    pub(crate) fn bump(&self) {
        self.map.word(EPOCH_AT).fetch_add(1, Ordering::SeqCst);
    }
}
