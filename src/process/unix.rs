//! The platform layer of the process scope (Linux): the host-wide monotonic
//! clock, the boot identity, the host name, and kernel file locks.
//!
//! Everything above this file speaks of "the monotonic clock in
//! nanoseconds", "this boot" and "lock this file"; only this file knows that
//! they are `CLOCK_MONOTONIC`, `/proc/sys/kernel/random/boot_id` and
//! `flock(2)`. A port to another Unix or to
//! Windows is a sibling of this file.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::OnceLock;

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

/// One `flock(2)` call on `file`, retried on `EINTR`. (std's `File::lock`
/// makes the same call, but needs Rust 1.89, above the crate's MSRV.)
fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock takes a file descriptor, which `file` keeps open for
        // the duration of the call, and an operation; it touches no memory.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// A non-blocking `flock`: `Ok(false)` when another open file description
/// holds a conflicting lock.
fn try_flock(file: &File, op: libc::c_int) -> io::Result<bool> {
    match flock(file, op | libc::LOCK_NB) {
        Ok(()) => Ok(true),
        Err(err) if err.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(err) => Err(err),
    }
}

/// Takes `file`'s exclusive kernel lock if it is free now: `Ok(false)` when
/// another open file description holds it.
pub(crate) fn try_lock(file: &File) -> io::Result<bool> {
    try_flock(file, libc::LOCK_EX)
}

/// Takes `file`'s shared kernel lock if no exclusive holder has it now.
pub(crate) fn try_lock_shared(file: &File) -> io::Result<bool> {
    try_flock(file, libc::LOCK_SH)
}

/// Blocks the calling thread until `file`'s exclusive kernel lock is its.
pub(crate) fn lock(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_EX)
}

/// Blocks the calling thread until `file`'s shared kernel lock is its.
pub(crate) fn lock_shared(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_SH)
}

/// Lets `file`'s kernel lock go (closing the file does too).
pub(crate) fn unlock(file: &File) -> io::Result<()> {
    flock(file, libc::LOCK_UN)
}

/// Whether `file` was unlinked from its directory since it was opened: a
/// lock on it then protects nothing that a later opener of the path sees.
pub(crate) fn is_unlinked(file: &File) -> io::Result<bool> {
    Ok(file.metadata()?.nlink() == 0)
}

/// Makes a new directory entry durable (`fsync` of the directory).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
