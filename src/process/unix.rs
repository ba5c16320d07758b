//! The platform layer of the process scope (Linux): the host-wide monotonic
//! clock, the boot identity, the host name, and kernel file locks.
//!
//! Everything above this file speaks of "the monotonic clock in
//! nanoseconds", "this boot" and "lock this file"; only this file knows that
//! they are `CLOCK_MONOTONIC`, `/proc/sys/kernel/random/boot_id` and
//! open file description byte-range locks (`fcntl(F_OFD_SETLK)`) (the
//! shared memory of a key is [`super::shared`]'s). A port to another Unix or to
//! Windows is a sibling of this file.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Once, OnceLock};

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the host
/// (it counts from boot and never steps), so a lease deadline written by one
/// process is judged by another on the same scale. std's `Instant` reads the
/// same clock but does not expose its value.
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC is
    // supported by every Linux kernel; clock_gettime writes only `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "keylock: clock_gettime(CLOCK_MONOTONIC) failed");
    #[allow(clippy::cast_sign_loss)] // the monotonic clock is never negative
    let (secs, nanos) = (ts.tv_sec as u64, ts.tv_nsec as u64);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

/// This boot's identity (the kernel's random boot id), or zeros where it
/// cannot be read. A stamp written under another boot id names a holder
/// that cannot be alive, and a monotonic deadline that means nothing now.
pub(crate) fn boot_id() -> [u8; 16] {
    static BOOT: OnceLock<[u8; 16]> = OnceLock::new();
    *BOOT.get_or_init(|| {
        let mut id = [0u8; 16];
        if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
            let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
            if hex.len() == 32 {
                for (i, pair) in hex.chunks(2).enumerate() {
                    let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                    id[i] = digit(pair[0]) << 4 | digit(pair[1]);
                }
            }
        }
        id
    })
}

/// The host name, for the owner stamp (empty if it cannot be read).
pub(crate) fn hostname() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    })
}

/// The byte of a key's state file whose lock is taken (briefly) by the
/// first process of a boot to map the file, to reset the state left from
/// before the reboot.
pub(crate) const BOOT_BYTE: u64 = 0;

/// The most slots a key may use (one per stuck holder taken over): slot 0
/// is the `flock` lock of the file, slot `N` the lock of byte `1 + N`.
pub(crate) const MAX_SLOTS: u32 = 64;

/// The byte of a key's state file whose lock a waiting process holds while
/// it has the next turn (the claim; see `acquire.rs`, "Order across
/// processes"): past every slot's byte.
pub(crate) const CLAIM_BYTE: u64 = 2 + MAX_SLOTS as u64;

/// The byte of a key's state file that every table using the file holds a
/// shared lock of, for as long as it keeps the file open (cached, waiting
/// or holding): a reclaimer must take it exclusively, so it reclaims only a
/// file nobody else has open (see `super::reclaim`).
pub(crate) const USER_BYTE: u64 = CLAIM_BYTE + 1;

/// The byte of a key's state file whose lock is slot `slot` (1 and up;
/// slot 0 is the file's `flock` lock).
const fn slot_byte(slot: u32) -> u64 {
    1 + slot as u64
}

/// What a range lock call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Exclusive,
    Shared,
}

/// An open file description (OFD) lock request on `len` bytes from `start`.
fn ofd_request(kind: Option<Kind>, start: u64, len: u64) -> libc::flock {
    // SAFETY: `libc::flock` is a plain C struct of integers, for which all
    // zeros is a valid value (and `l_pid` must be 0 for OFD locks).
    let mut req: libc::flock = unsafe { std::mem::zeroed() };
    #[allow(clippy::cast_possible_truncation)] // F_* constants fit in a short
    {
        req.l_type = match kind {
            Some(Kind::Exclusive) => libc::F_WRLCK,
            Some(Kind::Shared) => libc::F_RDLCK,
            None => libc::F_UNLCK,
        } as libc::c_short;
        req.l_whence = libc::SEEK_SET as libc::c_short;
    }
    #[allow(clippy::cast_possible_wrap)] // offsets below 2^63
    {
        req.l_start = start as libc::off_t;
        req.l_len = len as libc::off_t;
    }
    req
}

/// One `fcntl(2)` OFD lock call, retried on `EINTR`.
fn ofd(file: &File, cmd: libc::c_int, req: &mut libc::flock) -> io::Result<()> {
    loop {
        // SAFETY: `req` is a valid, exclusively borrowed `flock` struct for
        // the duration of the call, and `file` keeps its descriptor open;
        // the OFD lock commands read and write only `*req`.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, req as *mut libc::flock) };
        if rc != -1 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Takes the lock of `len` bytes from `start` of `file` if no other open
/// file description holds a conflicting one now: `Ok(false)` if one does.
/// All or nothing: no byte of the range is locked when it fails.
///
/// These are open file description locks (`F_OFD_SETLK`): owned by the open
/// file (not the process, unlike classic POSIX locks, and unaffected by
/// closing other descriptors of the file), freed by the kernel when the
/// last descriptor of it closes, which a process that dies does whatever it
/// dies of. Locks of one open file never conflict with each other.
pub(crate) fn try_lock_range(file: &File, kind: Kind, start: u64, len: u64) -> io::Result<bool> {
    let mut req = ofd_request(Some(kind), start, len);
    match ofd(file, libc::F_OFD_SETLK, &mut req) {
        Ok(()) => Ok(true),
        // EAGAIN (EWOULDBLOCK), or EACCES on some file systems.
        Err(err) if matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => Ok(false),
        Err(err) => Err(err),
    }
}

/// Blocks the calling thread until the lock of `len` bytes from `start` is
/// `file`'s.
pub(crate) fn lock_range(file: &File, kind: Kind, start: u64, len: u64) -> io::Result<()> {
    let mut req = ofd_request(Some(kind), start, len);
    ofd(file, libc::F_OFD_SETLKW, &mut req)
}

/// Lets the lock of `len` bytes from `start` go (closing the file's last
/// descriptor does too).
pub(crate) fn unlock_range(file: &File, start: u64, len: u64) -> io::Result<()> {
    let mut req = ofd_request(None, start, len);
    ofd(file, libc::F_OFD_SETLK, &mut req)
}

/// Whether another open file description holds an exclusive lock on a byte
/// of the range now (`F_OFD_GETLK`: a look, no lock taken).
pub(crate) fn range_locked(file: &File, start: u64, len: u64) -> io::Result<bool> {
    let mut req = ofd_request(Some(Kind::Shared), start, len);
    ofd(file, libc::F_OFD_GETLK, &mut req)?;
    Ok(i32::from(req.l_type) != libc::F_UNLCK)
}

/// Whose lock would refuse an exclusive lock of the range now
/// (`F_OFD_GETLK`, a look, no lock taken): `None` if none would;
/// `Some(None)` for an open file description lock (keylock's own);
/// `Some(Some(pid))` for a classic POSIX lock of process `pid` (a program
/// outside keylock).
pub(crate) fn range_owner(file: &File, start: u64, len: u64) -> io::Result<Option<Option<i32>>> {
    let mut req = ofd_request(Some(Kind::Exclusive), start, len);
    ofd(file, libc::F_OFD_GETLK, &mut req)?;
    if i32::from(req.l_type) == libc::F_UNLCK {
        return Ok(None);
    }
    Ok(Some((req.l_pid > 0).then_some(req.l_pid)))
}

/// One `flock(2)` call, retried on `EINTR`: `Ok(false)` if a non-blocking
/// request found the lock taken.
fn flock(file: &File, op: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: `file` keeps its descriptor open for the call, which
        // touches no memory of ours.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EWOULDBLOCK) if op & libc::LOCK_NB != 0 => return Ok(false),
            _ => return Err(err),
        }
    }
}

// Slot locks. Slot 0, the one of every uncontended grant, is the `flock`
// lock of the whole state file: a `flock` call costs about half an OFD
// byte-range call here (see BENCHMARKS.md). Slots 1 and up (used only
// after lease takeovers) are OFD locks of byte `1 + N`. On Linux the two
// kinds do not interact; both belong to the open file and are freed by the
// kernel when its last descriptor closes, however the process ends.

/// Takes slot `slot`'s lock on `file` if it is free now: `Ok(false)` if
/// another open file holds it.
#[inline]
pub(crate) fn try_lock_slot(file: &File, slot: u32) -> io::Result<bool> {
    if slot == 0 {
        flock(file, libc::LOCK_EX | libc::LOCK_NB)
    } else {
        try_lock_range(file, Kind::Exclusive, slot_byte(slot), 1)
    }
}

/// Blocks the calling thread until slot `slot`'s lock is `file`'s.
pub(crate) fn lock_slot(file: &File, slot: u32) -> io::Result<()> {
    if slot == 0 {
        flock(file, libc::LOCK_EX).map(drop)
    } else {
        lock_range(file, Kind::Exclusive, slot_byte(slot), 1)
    }
}

/// Lets slot `slot`'s lock, held on `file`, go.
#[inline]
pub(crate) fn unlock_slot(file: &File, slot: u32) -> io::Result<()> {
    if slot == 0 {
        flock(file, libc::LOCK_UN).map(drop)
    } else {
        unlock_range(file, slot_byte(slot), 1)
    }
}

/// Whether another open file holds slot `slot`'s lock now. For slot 0
/// (`flock` has no look without a lock) a shared lock is tried and at once
/// let go: it may make a concurrent try-lock of the slot fail for that
/// instant, which then waits for the slot and is woken at once.
pub(crate) fn slot_locked(file: &File, slot: u32) -> io::Result<bool> {
    if slot == 0 {
        let got = flock(file, libc::LOCK_SH | libc::LOCK_NB)?;
        if got {
            flock(file, libc::LOCK_UN)?;
        }
        Ok(!got)
    } else {
        range_locked(file, slot_byte(slot), 1)
    }
}

static PID: AtomicU32 = AtomicU32::new(0);
static PID_CACHED: AtomicBool = AtomicBool::new(false);

/// Run in a forked child: its pid is not its parent's.
unsafe extern "C" fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
}

/// This process's id, read once (and again in a child after `fork`).
/// std's `process::id` makes a system call each time.
pub(crate) fn pid() -> u32 {
    let pid = PID.load(Ordering::Relaxed);
    if pid != 0 {
        return pid;
    }
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        // SAFETY: the handler only stores to an atomic (async-signal-safe,
        // as a forked child's handlers must be); registering has no other
        // precondition.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forget_pid)) };
        PID_CACHED.store(rc == 0, Ordering::Relaxed);
    });
    let pid = std::process::id();
    if PID_CACHED.load(Ordering::Relaxed) {
        PID.store(pid, Ordering::Relaxed);
    }
    pid
}

/// Which file an open descriptor or a path names: its device and inode
/// numbers. While a descriptor of a file is open, its inode cannot be
/// freed, so no other file of that device gets its number: a path whose
/// identity is an open file's names that very file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// The identity and length of an open file (`fstat`).
pub(crate) fn file_id(file: &File) -> io::Result<(FileId, u64)> {
    let meta = file.metadata()?;
    Ok((FileId::of(&meta), meta.len()))
}

/// The identity and length of the file `path` names now (`stat`, following
/// symbolic links as `open` does), or `None` if it names none.
pub(crate) fn path_id(path: &Path) -> io::Result<Option<(FileId, u64)>> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(Some((FileId::of(&meta), meta.len()))),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err),
    }
}

/// When the host booted, on the wall clock (`btime` of `/proc/stat`),
/// read once; `None` if it cannot be read.
pub(crate) fn boot_time() -> Option<std::time::SystemTime> {
    static BOOT: std::sync::OnceLock<Option<std::time::SystemTime>> = std::sync::OnceLock::new();
    *BOOT.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let secs: u64 = stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
    })
}

/// Allocates the first `len` bytes of `file` on the disk
/// (`posix_fallocate`): a full disk fails here.
pub(crate) fn allocate(file: &File, len: u64) -> io::Result<()> {
    #[allow(clippy::cast_possible_wrap)] // a few kilobytes
    let len = len as libc::off_t;
    loop {
        // SAFETY: `file` keeps its descriptor open for the call, which
        // touches no memory of ours.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        match rc {
            0 => return Ok(()),
            libc::EINTR => {}
            errno => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

/// Makes a new directory entry durable (`fsync` of the directory).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
