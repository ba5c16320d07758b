//! Reclaiming idle keys' files: a key file nobody uses is removed, and the
//! key's next file starts its tokens above the removed one's.
//!
//! # When
//!
//! - A table reclaims the files of a key it stops caching: checking in
//!   the files of one key more than [`super::cache::CACHED_KEYS`] evicts
//!   the least recently used key's, and instead of closing them the cache
//!   tries to reclaim them.
//! - A table reclaims every key it caches when it goes away (its last
//!   clone is dropped), in the process that filled the cache.
//! - [`ProcessLockTable::prune`](super::ProcessLockTable::prune) reclaims
//!   the table's cached keys and then every key file of the directory
//!   that nobody uses: those left by tables of processes that died, or by
//!   tables that cached them while another table used them.
//!
//! A key in use is never reclaimed: held, waited for, or cached by
//! any table (of any process) but the reclaimer. A hot key stays cached,
//! so its file lives on and its lock stays four system calls; a job runner
//! keyed by job id keeps at most the cache's worth of files per table.
//!
//! # Who uses a file: the user byte
//!
//! Every table that has a key's file open holds a shared open file
//! description lock of its *user byte* ([`super::unix::USER_BYTE`]), from
//! the open (`open_key`: open, lock, then make sure the path still names
//! the file) until it closes it, however it closes it (the kernel frees the
//! lock of a process that dies). A reclaimer takes that byte *exclusively*
//! on its own open file of the key, without waiting: it succeeds only if
//! no other open file holds it, that is, if no other table has the file
//! open. Then, holding it:
//!
//! 1. it makes sure the path still names its file, whole (the look of
//!    "Files changed from outside", reused);
//! 2. it try-locks slot 0 and the state word's slot, and looks at the
//!    claim byte: a holder or a claimant of a build that does not take the
//!    user byte keeps the file;
//! 3. it makes the file's last token durable under the directory's ceiling
//!    (a no-op but for files whose tokens an earlier build minted) and
//!    raises the directory's token floor to it (see `super::dir`);
//! 4. it removes the path, and closes the file (its locks go with it).
//!
//! # Why two grants of one key are impossible
//!
//! A grant is made on a file its maker holds open and registered, and
//! whose path named it *after* the registration (and, as before, at its
//! judgement). The reclaimer removes the path only while it holds the
//! user byte exclusively, so while no other table is registered: a table
//! that registers later (its shared lock waits for the reclaimer to let
//! go, which it does only after the removal) finds the path naming
//! another file, or none, and opens that. So a removed file never has a
//! user left who could grant on it, and every grant after the removal is
//! made on the path's new file. Stale descriptors of other kinds (a `holder()`
//! look, read-only; a helper's spare open, checked to be the state file's
//! twin) never grant.
//!
//! # Tokens across reclaim
//!
//! The floor is raised before the removal, and a new file's first grant
//! reads the floor after the file was linked (it hands out floor + 1); the
//! kernel orders the removal before the new link, and the link before the
//! read. So the new file's first token is above the removed file's last,
//! in every process. A crash anywhere leaves either the file (reclaimed
//! later, or not at all) or a floor already raised. After a reboot the floor
//! restarts at the directory's durable ceiling, above every token handed
//! out before it.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

use super::acquire::{KeyFiles, Named};
use super::dir::DirState;
use super::error::ProcessLockError;
use super::stamp::{KeyState, FILE_LEN};
use super::table::Inner;
use super::unix;

/// Tries to reclaim `files` (a key's files, holding no slot lock): removes
/// the key's file if nobody else uses it (see the module doc). Closes the
/// files either way. Returns whether the file was removed.
pub(crate) fn reclaim(files: KeyFiles, dir: &DirState) -> bool {
    // Any error (a file damaged, a failing sync) keeps the file: the next
    // user, or the next prune, meets it again.
    try_reclaim(&files, dir).unwrap_or(false)
}

fn try_reclaim(files: &KeyFiles, dir: &DirState) -> Result<bool, ProcessLockError> {
    if files.stale {
        return Ok(false);
    }
    let io = |e| ProcessLockError::io("lock", &files.path, e);
    // Alone: no other open file is registered as a user.
    if !unix::try_lock_range(&files.state, unix::Kind::Exclusive, unix::USER_BYTE, 1).map_err(io)? {
        return Ok(false);
    }
    // Still the file the path names, whole.
    if files.named()? != Named::This {
        return Ok(false);
    }
    // Idle: no holder, no claimant (of a build without the user byte, or a
    // program locking the file outside keylock).
    let word = files.map.load();
    if !unix::try_lock_slot(&files.state, 0).map_err(io)?
        || (word.slot != 0 && !unix::try_lock_slot(&files.state, word.slot).map_err(io)?)
        || unix::range_locked(&files.state, unix::CLAIM_BYTE, 1).map_err(io)?
    {
        return Ok(false);
    }
    // Nobody can grant on the file now: its tokens are final.
    let last = files.map.load().token;
    dir.reserve(last)?;
    dir.fold(last)?;
    match std::fs::remove_file(&files.path) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(ProcessLockError::io("remove", &files.path, err)),
    }
}

/// Removes `state`, opened from `path` and registered as a user, if it
/// is a key file whose creation a power loss cut short: blank (empty, or
/// no header: its data never reached the disk while its name did) and
/// last changed before this boot, and nobody else uses it. Its tokens
/// are below the directory's ceiling, to which the floor restarted with
/// the boot (see `super::dir`), so the key's next file starts above them.
/// A file blanked during this boot was damaged from outside: it is left,
/// and refused, as before. Returns whether the file was removed.
pub(crate) fn remove_blank(state: &File, path: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(meta) = state.metadata() else {
        return false;
    };
    let mut magic = [0u8; 8];
    let blank = meta.len() == 0
        || (meta.len() == FILE_LEN as u64
            && state.read_exact_at(&mut magic, 0).is_ok()
            && magic == [0; 8]);
    let before_boot = matches!(
        (meta.modified(), unix::boot_time()),
        (Ok(changed), Some(boot)) if changed < boot
    );
    if !blank || !before_boot {
        return false;
    }
    let alone = unix::try_lock_range(state, unix::Kind::Exclusive, unix::USER_BYTE, 1);
    let Ok((id, _)) = unix::file_id(state) else {
        return false;
    };
    let named = unix::path_id(path).ok().flatten();
    alone.unwrap_or(false)
        && named.is_some_and(|(named, _)| named == id)
        && std::fs::remove_file(path).is_ok()
}

impl Inner {
    /// Reclaims this table's cached keys, then every key file of the
    /// directory that nobody uses; removes the temporary files of
    /// creators that died. Returns how many key files were removed.
    pub(crate) fn prune(&self) -> Result<usize, ProcessLockError> {
        let mut removed = 0;
        for files in self.cache.drain() {
            removed += usize::from(reclaim(files, &self.dir_state));
        }
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| ProcessLockError::io("read the lock directory", &self.dir, e))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| ProcessLockError::io("read the lock directory", &self.dir, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(stem) = name
                .strip_suffix(".state")
                .filter(|s| s.starts_with("key-"))
            {
                match self.open_idle(stem) {
                    Some(Ok(files)) => removed += usize::from(reclaim(files, &self.dir_state)),
                    Some(Err(blank)) => removed += usize::from(blank),
                    None => {}
                }
            } else if name.starts_with(".keylock-new-") {
                // A creator's temporary file: removed once no creator holds
                // its user byte (a live creator does, and removes its own;
                // the kernel lets a dead one's lock go), whatever PID
                // namespace the creator runs in.
                if let Ok(file) = OpenOptions::new().read(true).write(true).open(entry.path()) {
                    let idle =
                        unix::try_lock_range(&file, unix::Kind::Exclusive, unix::USER_BYTE, 1);
                    if idle.unwrap_or(false) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
        Ok(removed)
    }

    /// A key's files opened for a reclaim, holding its user byte
    /// exclusively: `None` if another table uses the file, or it cannot be
    /// opened; `Some(Err(removed))` if it is not a whole key file (removed
    /// if [`remove_blank`] says so, else left alone).
    fn open_idle(&self, stem: &str) -> Option<Result<KeyFiles, bool>> {
        let path = self.state_path(stem);
        let state = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        if !unix::try_lock_range(&state, unix::Kind::Exclusive, unix::USER_BYTE, 1).ok()? {
            return None;
        }
        let (id, _) = unix::file_id(&state).ok()?;
        let map = match KeyState::map(&state, &path, true, self.dir_state.ceiling().ok()?) {
            Ok(map) => map,
            // Not a whole key file: removed only if a power loss cut its
            // creation short (see `remove_blank`).
            Err(_) => return Some(Err(remove_blank(&state, &path))),
        };
        Some(Ok(KeyFiles::opened(stem, path, state, map, id)))
    }
}
