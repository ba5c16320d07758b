//! The descriptor cache: the open (and mapped) state files of the keys a
//! table used last, so that taking a key again opens nothing.
//!
//! # Invariants
//!
//! - A cached [`KeyFiles`] holds no kernel lock: it is checked in only
//!   after its slot lock was let go (a failed unlock drops the
//!   files instead, and closing them frees their locks).
//! - A [`KeyFiles`] is used by one acquirer or guard at a time: it is
//!   *checked out* (removed from the cache) for the whole acquisition and
//!   hold, because a kernel lock belongs to an open file, and two users of
//!   one open file would not exclude each other. A second user of the same
//!   key opens the file afresh.
//! - At most [`CACHED_KEYS`] keys per table (two descriptors each at most):
//!   checking in one more evicts the files of the least recently used key,
//!   which are reclaimed (the key's file removed, if no other table uses
//!   it; see [`super::reclaim`]) and closed. A table that goes away
//!   reclaims every key it caches.
//! - Every cached [`KeyFiles`] is registered as a user of its file (it
//!   holds the file's user byte shared), so no other table reclaims it.
//! - After a `fork`, the child's copy of the cache is dropped, not used:
//!   the child shares the parent's open files, so its locks on them would
//!   not exclude the parent's.
//!
//! The files of a key in use are never deleted by the table, and before
//! every judgement an acquirer makes sure that the key's path still names the
//! file it holds open (device and inode; see [`super::acquire`]), opening
//! the path again if not; so a cached descriptor of a file that was
//! removed or replaced, alone or with its whole directory, is never used
//! for a grant.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::acquire::KeyFiles;
use super::dir::DirState;
use super::reclaim::reclaim;
use super::unix;

/// The most keys whose files a table keeps open between uses.
pub(crate) const CACHED_KEYS: usize = 64;

#[derive(Debug, Default)]
struct Entries {
    /// The process that filled the cache.
    pid: u32,
    tick: u64,
    /// By stem: when last checked in, and the files.
    map: HashMap<Arc<str>, (u64, KeyFiles), foldhash::fast::RandomState>,
}

/// The open files of recently used keys (see the module doc).
#[derive(Debug)]
pub(crate) struct FileCache {
    entries: Mutex<Entries>,
    /// The directory's `keylock.dir`, for reclaims.
    dir: Arc<DirState>,
}

impl FileCache {
    pub(crate) fn new(dir: Arc<DirState>) -> Self {
        Self {
            entries: Mutex::default(),
            dir,
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        // Nothing panics while holding it; ignore poisoning.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the files of `stem` out of the cache, if it has them.
    #[inline]
    pub(crate) fn checkout(&self, stem: &str) -> Option<KeyFiles> {
        let pid = unix::pid();
        let mut entries = self.entries();
        if entries.pid != pid {
            // New, or forked: these are the parent's open files.
            let stale = std::mem::take(&mut entries.map);
            entries.pid = pid;
            drop(entries);
            drop(stale);
            return None;
        }
        entries.map.remove(stem).map(|(_, files)| files)
    }

    /// Puts `files`, which hold no kernel lock, back into the cache,
    /// closing the least recently used key's if it is full.
    #[inline]
    pub(crate) fn checkin(&self, files: KeyFiles) {
        let pid = unix::pid();
        let mut entries = self.entries();
        if entries.pid != pid {
            // New, or forked (then `files` may be the parent's open file
            // too, held by a guard the child inherited: not cached).
            let forked = entries.pid != 0;
            let stale = std::mem::take(&mut entries.map);
            entries.pid = pid;
            drop(entries);
            drop(stale);
            if forked {
                return;
            }
            entries = self.entries();
        }
        entries.tick += 1;
        let tick = entries.tick;
        let mut evicted = None;
        if entries.map.len() >= CACHED_KEYS && !entries.map.contains_key(&files.stem) {
            let oldest = entries
                .map
                .iter()
                .min_by_key(|(_, (t, _))| *t)
                .map(|(stem, _)| Arc::clone(stem));
            evicted = oldest.and_then(|stem| entries.map.remove(&stem));
        }
        let replaced = entries.map.insert(Arc::clone(&files.stem), (tick, files));
        drop(entries);
        // Closing (and reclaiming) files is system calls: outside the lock.
        if let Some((_, evicted)) = evicted {
            reclaim(evicted, &self.dir);
        }
        // Another open of a key cached now: the cached one keeps the file.
        drop(replaced);
    }

    /// Takes every cached key's files out of the cache (for a prune); none
    /// in a process that did not fill it (a forked child).
    pub(crate) fn drain(&self) -> Vec<KeyFiles> {
        let mut entries = self.entries();
        let all = std::mem::take(&mut entries.map);
        let ours = entries.pid == unix::pid();
        drop(entries);
        if !ours {
            drop(all);
            return Vec::new();
        }
        all.into_values().map(|(_, files)| files).collect()
    }

    /// How many keys' files are open in the cache.
    pub(crate) fn len(&self) -> usize {
        self.entries().map.len()
    }
}

impl Drop for FileCache {
    /// The table is gone: its cached keys are reclaimed, in the process
    /// that filled the cache (a forked child only closes its copies).
    fn drop(&mut self) {
        for files in self.drain() {
            reclaim(files, &self.dir);
        }
    }
}
