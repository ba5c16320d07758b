//! Waiting for a kernel lock without blocking the caller: a helper thread
//! makes the blocking lock call (`flock` of the key's file for slot 0,
//! `fcntl(F_OFD_SETLKW)` on one byte of it for the others) and wakes the waiting future when the kernel grants it.
//!
//! A [`KernelWait`] owns one request. The helper thread blocks in the kernel
//! until the lock is its, then publishes the locked file in the request's
//! cell and wakes the stored waker (one slot, updated in place on re-poll).
//! No polling: the kernel wakes the helper, the helper wakes the future.
//!
//! # Cancellation
//!
//! A thread blocked in a lock call cannot be called back. Dropping a
//! [`KernelWait`] marks its cell abandoned instead: if the helper already
//! holds the lock, the drop closes the file, which frees it; if it is still
//! blocked, it keeps waiting, and when the kernel grants it the lock it finds
//! the cell abandoned and closes the file at once. So an abandoned wait
//! holds the lock for an instant at most (the time to see the flag), never a
//! key (taking a key needs its state written as well), and the thread is
//! busy only until the lock it waits on is released or its holder dies.
//!
//! A future forgotten (`mem::forget`) while it waits never drops: its
//! helper, handed the lock, keeps it for ever. So the helper records, as
//! it gets the lock, that the kernel handed the slot to a waiter
//! ([`super::stamp::mark_handed`]): judges then take it for a slot locked
//! with no grant, not for a live holder, and take the key on another slot
//! after a short patience (see `acquire.rs`).
//!
//! Helpers are pooled: an idle helper waits up to [`IDLE`] for the next
//! request, then exits, so a steady stream of waits spawns no threads.

use std::collections::VecDeque;
use std::fs::File;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::{stamp, unix};

/// How long an idle helper thread waits for work before it exits.
pub(crate) const IDLE: Duration = Duration::from_secs(5);

type Job = Box<dyn FnOnce() + Send>;

/// The idle helpers, each a channel to a thread waiting for a job.
static IDLE_HELPERS: Mutex<VecDeque<(usize, mpsc::Sender<Job>)>> = Mutex::new(VecDeque::new());
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
/// Helper threads blocked in the kernel right now (for tests and stats).
static BLOCKED: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here panics while holding these locks; ignore poisoning.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `job` on an idle helper thread, or a new one.
fn spawn(job: Job) -> io::Result<()> {
    let mut job = job;
    loop {
        let idle = lock(&IDLE_HELPERS).pop_back();
        match idle {
            Some((_, tx)) => match tx.send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(back)) => job = back, // it exited: next
            },
            None => break,
        }
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("keylock-process".into())
        .spawn(move || {
            job();
            loop {
                lock(&IDLE_HELPERS).push_back((id, tx.clone()));
                match rx.recv_timeout(IDLE) {
                    Ok(job) => job(),
                    Err(RecvTimeoutError::Timeout) => {
                        let mut idle = lock(&IDLE_HELPERS);
                        if let Some(at) = idle.iter().position(|(i, _)| *i == id) {
                            idle.remove(at);
                            return;
                        }
                        drop(idle);
                        // Claimed as the timeout ran out: its job comes.
                        match rx.recv() {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        })
        .map(drop)
}

/// Runs `wait`, a blocking lock call, on the calling thread, counted as a
/// kernel wait.
pub(crate) fn wait_here<R>(wait: impl FnOnce() -> R) -> R {
    BLOCKED.fetch_add(1, Ordering::Relaxed);
    let out = wait();
    BLOCKED.fetch_sub(1, Ordering::Relaxed);
    out
}

/// How many threads (helpers, or callers of `blocking_lock`) are blocked in
/// the kernel on a lock right now, in this process.
pub(crate) fn blocked() -> usize {
    BLOCKED.load(Ordering::Relaxed)
}

enum Cell {
    Waiting(Option<Waker>),
    Done(io::Result<File>),
    Taken,
    Abandoned,
}

/// A kernel lock being waited for on a helper thread; resolves to the file,
/// holding the lock.
///
/// # Cancel safety
///
/// Dropping it frees the lock if it was granted, or has the helper free it
/// the moment it is (see the module doc).
#[derive(Debug)]
pub(crate) struct KernelWait {
    cell: Arc<Mutex<Cell>>,
}

impl std::fmt::Debug for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Waiting(_) => "Waiting",
            Self::Done(_) => "Done",
            Self::Taken => "Taken",
            Self::Abandoned => "Abandoned",
        })
    }
}

impl KernelWait {
    /// Starts waiting for the kernel lock of slot `slot` of `file`.
    pub(crate) fn start(file: File, slot: u32) -> io::Result<Self> {
        let cell = Arc::new(Mutex::new(Cell::Waiting(None)));
        let theirs = Arc::clone(&cell);
        spawn(Box::new(move || {
            // Mapped before the wait, and dropped after the wake (at the
            // end of this job): off the handoff's path.
            let page = stamp::HandedPage::map(&file);
            BLOCKED.fetch_add(1, Ordering::Relaxed);
            let result = unix::lock_slot(&file, slot);
            BLOCKED.fetch_sub(1, Ordering::Relaxed);
            if result.is_ok() {
                // Before the future can see it (it may never look: see
                // `stamp::mark_handed`).
                #[cfg(feature = "test-util")]
                delay_handed_mark();
                stamp::mark_handed(&file, &page, slot);
            }
            let result = result.map(|()| file);
            let mut cell = lock(&theirs);
            match std::mem::replace(&mut *cell, Cell::Taken) {
                Cell::Waiting(waker) => {
                    *cell = Cell::Done(result);
                    drop(cell);
                    if let Some(waker) = waker {
                        waker.wake();
                    }
                }
                // Nobody wants it any more: closing the file frees the lock
                // (its page's mapping first, which keeps the file open).
                _ => {
                    *cell = Cell::Abandoned;
                    drop(cell);
                    drop(page);
                    drop(result);
                    return;
                }
            }
            // The page is unmapped here, after the wake. Until then the
            // file stays open (a mapping keeps it so), and with it the
            // slot's lock should the future close it at once: for these
            // few instructions longer, never beyond this job.
            drop(page);
        }))?;
        Ok(Self { cell })
    }
}

impl Future for KernelWait {
    type Output = io::Result<File>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // `Waker::clone` and drop are user code: outside the cell lock.
        let mut fresh = Some(cx.waker().clone());
        let mut cell = lock(&self.cell);
        let out = match &mut *cell {
            Cell::Waiting(slot) => {
                if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    std::mem::swap(slot, &mut fresh);
                }
                Poll::Pending
            }
            Cell::Done(_) => match std::mem::replace(&mut *cell, Cell::Taken) {
                Cell::Done(result) => Poll::Ready(result),
                _ => unreachable!("matched Done"),
            },
            Cell::Taken | Cell::Abandoned => {
                Poll::Ready(Err(io::Error::other("kernel wait polled after completion")))
            }
        };
        drop(cell);
        drop(fresh);
        out
    }
}

impl Drop for KernelWait {
    fn drop(&mut self) {
        let mut cell = lock(&self.cell);
        let before = std::mem::replace(&mut *cell, Cell::Abandoned);
        drop(cell);
        // A granted lock is freed by closing its file, outside the cell lock.
        drop(before);
    }
}

/// Tests only: how long a helper handed a slot waits before it records the
/// handing (`stamp::mark_handed`), in milliseconds (0: not at all). Widens
/// the window in which a judgement sees the slot locked and not yet marked
/// handed, so that a test can pin it.
#[cfg(feature = "test-util")]
static HANDED_MARK_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Tests only: sets the delay of [`delay_handed_mark`].
#[cfg(feature = "test-util")]
pub(crate) fn set_handed_mark_delay(delay: Duration) {
    let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    HANDED_MARK_DELAY_MS.store(ms, Ordering::Relaxed);
}

#[cfg(feature = "test-util")]
fn delay_handed_mark() {
    let ms = HANDED_MARK_DELAY_MS.load(Ordering::Relaxed);
    if ms > 0 {
        std::thread::sleep(Duration::from_millis(ms));
    }
}
