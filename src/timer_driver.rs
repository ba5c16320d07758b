//! The real clock's timer: one thread for the whole process, and a heap of
//! deadlines behind one mutex.
//!
//! A waiter with a timeout, or one that waits on a leased holder, needs to be
//! woken at an instant. A general-purpose reactor timer wakes its reactor
//! thread for every registration (a system call and a cross-thread wake-up),
//! which a contended lock would pay on every wait. Here registering is a heap
//! push under an uncontended mutex, and the timer thread is woken only when a
//! new deadline is earlier than the one it already sleeps toward. Timeouts and
//! leases of one length arrive in deadline order, so in the common case
//! nobody is woken until a deadline actually comes.
//!
//! # Protocol
//!
//! - A [`Registration`] names a slot (index and generation). The slot holds
//!   the deadline and the waker; `queued` says whether the heap holds an entry
//!   for the slot's current deadline. Heap entries that no longer match their
//!   slot (re-armed, cancelled) are *stale*: skipped when popped, and dropped
//!   wholesale when they outnumber the live ones.
//! - The thread pops every due entry, takes the wakers, computes the earliest
//!   remaining deadline (its `target`), unlocks, wakes, and parks until the
//!   target. A registration earlier than the target lowers it and unparks the
//!   thread (a permit, so an unpark between unlock and park is not lost).
//! - Wakers are cloned before locking and woken or dropped after unlocking:
//!   no user code runs under the mutex. A waker that panics in `wake` is
//!   caught on the timer thread and the others are still woken.
//! - A timer is only an early wake-up: the woken future judges the time again
//!   itself, so a late fire delays, never breaks.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::Waker;
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::clock::Stamp;

/// One armed timer: which slot, and which use of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registration {
    slot: u32,
    generation: u32,
}

/// The process's timer.
#[derive(Debug)]
pub(crate) struct Driver {
    wheel: Mutex<Wheel>,
    thread: OnceLock<Thread>,
}

#[derive(Debug)]
struct Wheel {
    /// (deadline stamp, slot, generation), earliest first.
    heap: BinaryHeap<Reverse<(u64, u32, u32)>>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Heap entries that match no slot any more (an upper bound).
    stale: usize,
    /// The deadline the thread sleeps toward (`u64::MAX`: none).
    target: u64,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    /// The deadline, as a raw [`Stamp`].
    at: u64,
    queued: bool,
    waker: Option<Waker>,
}

static DRIVER: Driver = Driver {
    wheel: Mutex::new(Wheel::new()),
    thread: OnceLock::new(),
};

impl Driver {
    /// The process's timer, its thread started on first use.
    ///
    /// # Panics
    ///
    /// If the operating system refuses to start the thread.
    pub(crate) fn get() -> &'static Driver {
        DRIVER.thread.get_or_init(|| {
            std::thread::Builder::new()
                .name("keylock-timer".into())
                .spawn(|| DRIVER.run())
                .expect("keylock: cannot start the timer thread")
                .thread()
                .clone()
        });
        &DRIVER
    }

    fn unpark(&self) {
        if let Some(thread) = self.thread.get() {
            thread.unpark();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Wheel> {
        // Nothing panics under this lock but allocation; the state stays
        // consistent, so a poisoned lock is used as is.
        self.wheel.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms a new timer for `at`, to wake `waker`.
    pub(crate) fn register(&self, at: Instant, waker: Waker) -> Registration {
        let at = raw(at);
        let (registration, unpark) = {
            let mut wheel = self.lock();
            let slot = match wheel.free.pop() {
                Some(slot) => slot,
                None => {
                    let slot = u32::try_from(wheel.slots.len())
                        .expect("keylock: more than 2^32 armed timers");
                    wheel.slots.push(Slot::default());
                    slot
                }
            };
            let entry = &mut wheel.slots[slot as usize];
            entry.at = at;
            entry.waker = Some(waker);
            entry.queued = true;
            let registration = Registration {
                slot,
                generation: entry.generation,
            };
            wheel
                .heap
                .push(Reverse((at, slot, registration.generation)));
            (registration, wheel.lower_target(at))
        };
        if unpark {
            self.unpark();
        }
        registration
    }

    /// Moves a timer to `at`. Keeps its waker if that wakes the same task as
    /// `current` and answers `None`; otherwise answers `Some(())`: the caller
    /// clones `current` (outside any lock) and calls [`set_waker`](Self::set_waker).
    pub(crate) fn rearm(
        &self,
        registration: Registration,
        at: Instant,
        current: &Waker,
    ) -> Option<()> {
        let at = raw(at);
        let (needs_waker, unpark) = {
            let mut wheel = self.lock();
            let unpark = wheel.move_to(registration, at);
            let slot = &wheel.slots[registration.slot as usize];
            let keeps = slot.waker.as_ref().is_some_and(|w| w.will_wake(current));
            (!keeps, unpark)
        };
        if unpark {
            self.unpark();
        }
        needs_waker.then_some(())
    }

    /// Stores a fresh waker in a timer (after [`rearm`](Self::rearm) asked
    /// for one); the old one is dropped after unlocking.
    pub(crate) fn set_waker(&self, registration: Registration, waker: Waker) {
        let (old, unpark) = {
            let mut wheel = self.lock();
            let slot = &mut wheel.slots[registration.slot as usize];
            debug_assert_eq!(slot.generation, registration.generation);
            let old = slot.waker.replace(waker);
            let at = slot.at;
            // Fired meanwhile (its waker taken, or missing): queue it again,
            // so that the new waker is woken at once.
            let unpark = if slot.queued {
                false
            } else {
                wheel.move_to(registration, at)
            };
            (old, unpark)
        };
        if unpark {
            self.unpark();
        }
        drop(old);
    }

    /// Disarms a timer; its waker is dropped after unlocking.
    pub(crate) fn cancel(&self, registration: Registration) {
        let waker = {
            let mut wheel = self.lock();
            let slot = &mut wheel.slots[registration.slot as usize];
            debug_assert_eq!(slot.generation, registration.generation);
            let was_queued = slot.queued;
            let waker = slot.waker.take();
            slot.generation = slot.generation.wrapping_add(1);
            slot.queued = false;
            slot.at = 0;
            wheel.free.push(registration.slot);
            if was_queued {
                wheel.stale += 1;
                wheel.compact_if_stale();
            }
            waker
        };
        drop(waker);
    }

    /// The timer thread: fire what is due, sleep until the next deadline.
    fn run(&self) -> ! {
        let mut due = Vec::new();
        loop {
            let sleep = {
                let mut wheel = self.lock();
                let now = raw(Instant::now());
                wheel.pop_due(now, &mut due);
                wheel.target = wheel.heap.peek().map_or(u64::MAX, |e| e.0 .0);
                (wheel.target != u64::MAX).then(|| Duration::from_nanos(wheel.target - now))
            };
            for waker in due.drain(..) {
                // A waker that panics must not stop the process's timer.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
            }
            match sleep {
                Some(d) => std::thread::park_timeout(d),
                None => std::thread::park(),
            }
        }
    }
}

impl Wheel {
    const fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            stale: 0,
            target: u64::MAX,
        }
    }

    /// Lowers the thread's target to `at` if earlier; `true` if the thread
    /// must be woken to see it.
    fn lower_target(&mut self, at: u64) -> bool {
        if at < self.target {
            self.target = at;
            true
        } else {
            false
        }
    }

    /// Sets a slot's deadline, queueing a heap entry for it unless one is
    /// already queued for that deadline; `true` if the thread must be woken.
    fn move_to(&mut self, registration: Registration, at: u64) -> bool {
        let slot = &mut self.slots[registration.slot as usize];
        debug_assert_eq!(slot.generation, registration.generation);
        if slot.queued && slot.at == at {
            return false;
        }
        if slot.queued {
            self.stale += 1;
        }
        slot.at = at;
        slot.queued = true;
        self.heap
            .push(Reverse((at, registration.slot, registration.generation)));
        let unpark = self.lower_target(at);
        self.compact_if_stale();
        unpark
    }

    /// Pops every entry due at `now`, collecting the wakers of live ones.
    fn pop_due(&mut self, now: u64, due: &mut Vec<Waker>) {
        while let Some(&Reverse((at, slot, generation))) = self.heap.peek() {
            if at > now {
                break;
            }
            self.heap.pop();
            let entry = &mut self.slots[slot as usize];
            if entry.generation == generation && entry.queued && entry.at == at {
                entry.queued = false;
                due.extend(entry.waker.take());
            } else {
                self.stale = self.stale.saturating_sub(1);
            }
        }
    }

    /// Rebuilds the heap from the live slots once stale entries dominate, so
    /// that re-armed and cancelled timers cost memory only briefly.
    fn compact_if_stale(&mut self) {
        if self.stale < 64 || self.stale < self.heap.len() / 2 {
            return;
        }
        let live: Vec<_> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.queued)
            .map(|(i, s)| Reverse((s.at, i as u32, s.generation)))
            .collect();
        self.heap = BinaryHeap::from(live);
        self.stale = 0;
    }
}

/// An instant as a raw stamp (0 never occurs for a real instant).
fn raw(at: Instant) -> u64 {
    match Stamp::new(Some(at)).to_raw() {
        // Too far to represent: never fires.
        0 => u64::MAX - 1,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::Wake;

    use super::*;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    fn wheel() -> Wheel {
        Wheel::new()
    }

    fn arm(wheel: &mut Wheel, at: u64, waker: &Waker) -> Registration {
        let slot = wheel.slots.len() as u32;
        wheel.slots.push(Slot::default());
        let registration = Registration {
            slot,
            generation: 0,
        };
        wheel.slots[slot as usize].waker = Some(waker.clone());
        wheel.move_to(registration, at);
        registration
    }

    #[test]
    fn due_entries_fire_in_order_and_later_ones_wait() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut wheel = wheel();
        arm(&mut wheel, 10, &waker);
        arm(&mut wheel, 30, &waker);
        assert_eq!(wheel.target, 10, "the earliest deadline is the target");
        let mut due = Vec::new();
        wheel.pop_due(20, &mut due);
        assert_eq!(due.len(), 1, "only the entry due by 20 fires");
        wheel.pop_due(30, &mut due);
        assert_eq!(due.len(), 2);
        assert!(wheel.heap.is_empty());
    }

    #[test]
    fn a_moved_timer_fires_once_at_its_new_deadline() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut wheel = wheel();
        let r = arm(&mut wheel, 10, &waker);
        assert!(!wheel.move_to(r, 50), "a later deadline wakes no thread");
        let mut due = Vec::new();
        wheel.pop_due(40, &mut due);
        assert!(due.is_empty(), "the stale entry at 10 does not fire");
        wheel.pop_due(50, &mut due);
        assert_eq!(due.len(), 1);
        assert!(
            wheel.move_to(r, 5),
            "an earlier deadline than the target wakes the thread"
        );
    }

    #[test]
    fn stale_entries_are_compacted_away() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut wheel = wheel();
        let r = arm(&mut wheel, 1, &waker);
        for at in 2..1000 {
            wheel.move_to(r, at);
        }
        assert!(
            wheel.heap.len() < 200,
            "re-arming one timer 1000 times left {} heap entries",
            wheel.heap.len()
        );
        let mut due = Vec::new();
        wheel.pop_due(998, &mut due);
        assert!(due.is_empty());
        wheel.pop_due(999, &mut due);
        assert_eq!(due.len(), 1, "the live deadline survives compaction");
    }

    #[test]
    fn the_thread_wakes_a_registered_waker_at_its_deadline() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let driver = Driver::get();
        let r = driver.register(Instant::now(), Waker::from(count.clone()));
        // Bounded only so that a bug fails instead of hanging.
        let give_up = Instant::now() + Duration::from_secs(30);
        while count.0.load(SeqCst) == 0 {
            assert!(Instant::now() < give_up, "the timer thread never fired");
            std::thread::yield_now();
        }
        driver.cancel(r);
    }
}
