//! A key's shared memory: its state file mapped (`mmap`, `MAP_SHARED`) into
//! every process that uses the key, and read and written as aligned 64-bit
//! atomic words.
//!
//! Every process that maps the same file sees the same physical pages (the
//! file's page cache), so an atomic compare-and-swap on a word of the
//! mapping is atomic across processes, as it is across threads. Only this
//! file touches the mapping's memory; everything above it speaks of "the
//! word at offset N".
//!
//! # Invariants
//!
//! - A [`Mapping`] covers a whole file whose length was checked against the
//!   expected length before mapping it, and the file is never shortened by
//!   the table. A file truncated by someone else while mapped makes an
//!   access beyond its new end raise `SIGBUS`: the users of a mapping look
//!   at the file's length (`stat`/`fstat`) before they touch it, and stop
//!   using it once it is short (see [`super::acquire`]). Files are sized
//!   with `posix_fallocate` when created, so the blocks exist and a full
//!   disk fails the creation, never a later store.
//! - Word offsets are multiples of 8 and inside the mapping (checked).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// A shared mapping of a whole file (see the module doc).
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory accessed only through atomics
// (`word`), which any thread may do; the pointer is owned and unmapped once.
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` only hands out `&AtomicU64`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `file` (whose length the caller checked),
    /// readable, and writable if `writable` (the file must be open for
    /// writing then).
    pub(crate) fn map(file: &File, len: usize, writable: bool) -> io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new mapping chosen by the kernel (null hint), of a
        // descriptor kept open for the call; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<AtomicU64>()).ok_or_else(|| io::Error::other("null"))?;
        Ok(Self { ptr, len })
    }

    /// The 64-bit word at byte offset `at`.
    #[inline]
    pub(crate) fn word(&self, at: usize) -> &AtomicU64 {
        assert!(at % 8 == 0 && at + 8 <= self.len, "word {at} out of range");
        // SAFETY: `at` is 8-aligned and inside the mapping (checked above),
        // the mapping is page-aligned, so the pointer is aligned for
        // `AtomicU64`; the memory stays mapped for `&self`'s lifetime, and
        // it is only ever accessed atomically (by every process: all of
        // them go through this function), so no data race is possible. A
        // read-only mapping is only loaded from (a lock-free 64-bit load
        // never writes).
        unsafe { &*self.ptr.as_ptr().add(at / 8) }
    }

    /// Writes the mapping's first `len` bytes back to the disk and waits
    /// (`msync(MS_SYNC)`: a `fdatasync` of that range).
    pub(crate) fn sync(&self, len: usize) -> io::Result<()> {
        // SAFETY: the range is inside our own live mapping (clamped).
        let rc = unsafe { libc::msync(self.ptr.as_ptr().cast(), len.min(self.len), libc::MS_SYNC) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this length and is
        // unmapped once, here; no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}
