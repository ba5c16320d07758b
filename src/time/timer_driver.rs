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

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::Waker;
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::time::clock::{Clock, ShardHook, Stamp};

/// One armed timer: which wheel, which slot, and which use of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registration {
    wheel: u32,
    slot: u32,
    generation: u32,
}

/// What polling an armed timer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimerState {
    /// It fired for the deadline asked about (or a later one).
    Fired,
    /// Armed; `needs_waker`: its waker does not wake the polling task.
    Armed { needs_waker: bool },
}

/// Wheels, each behind its own lock; a thread registers in the wheel it was
/// given on first use, so threads rarely share one.
const WHEELS: usize = 8;

/// The process's timer.
#[derive(Debug)]
pub(crate) struct Driver {
    wheels: [CachePadded<Mutex<Wheel>>; WHEELS],
    /// The earliest deadline the thread will wake for (a raw stamp;
    /// `u64::MAX`: none). Lowered by registrations, which then unpark it.
    target: AtomicU64,
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
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    /// The deadline, as a raw [`Stamp`].
    at: u64,
    /// A heap entry for `at` exists; false once it fired.
    queued: bool,
    waker: Option<Waker>,
    /// A shard's timer: fired by calling into the shard, not by a waker.
    hook: Option<ShardHook>,
}

/// A shard's timer: the earliest deadline it is armed for (raw stamp;
/// `u64::MAX`: none), read and lowered under the shard lock, and its
/// registration with the driver, made on first use.
///
/// Invariant: every deadline in the shard (a waiter's timeout, the lease of a
/// holder with waiters) is at or after `armed`, and the driver fires the
/// shard by `armed`, or is about to be told so by the operation that lowered
/// it (after that operation unlocks the shard).
#[derive(Debug)]
pub(crate) struct ShardTimer {
    armed: AtomicU64,
    registration: OnceLock<Registration>,
}

impl ShardTimer {
    pub(crate) const fn new() -> Self {
        Self {
            armed: AtomicU64::new(u64::MAX),
            registration: OnceLock::new(),
        }
    }

    /// Under the shard lock: lowers the armed deadline to `at` if it is
    /// earlier; `true` if the driver must then be told ([`arm`](Self::arm),
    /// after unlocking).
    #[inline]
    pub(crate) fn lower(&self, at: u64) -> bool {
        if at < self.armed.load(Relaxed) {
            self.armed.store(at, Relaxed);
            true
        } else {
            false
        }
    }

    /// Under the shard lock: whether the timer already fires by `at` (a
    /// stamp's raw value), so that covering `at` needs nothing.
    #[inline(always)]
    pub(crate) fn covers(&self, at: u64) -> bool {
        at >= self.armed.load(Relaxed)
    }

    /// Under the shard lock, from a fire: the deadline it is armed for now.
    pub(crate) fn set_armed(&self, at: u64) {
        self.armed.store(at, Relaxed);
    }

    /// After unlocking: makes sure `clock`'s timer fires the shard by `at`.
    pub(crate) fn arm(&self, clock: &Clock, hook: ShardHook, at: u64) {
        #[cfg(feature = "test-util")]
        if let Clock::Manual(manual) = clock {
            manual.arm_shard(hook, at);
            return;
        }
        let _ = clock;
        let driver = Driver::get();
        let registration = *self.registration.get_or_init(|| driver.register_hook(hook));
        driver.arm_hook(registration, at);
    }

    /// Disarms the timer of the shard at `ptr` for good; once this returns,
    /// no timer touches the shard again.
    pub(crate) fn cancel(&self, clock: &Clock, ptr: *const ()) {
        #[cfg(feature = "test-util")]
        if let Clock::Manual(manual) = clock {
            manual.cancel_shard(ptr);
        }
        let _ = (clock, ptr);
        if let Some(registration) = self.registration.get() {
            Driver::get().cancel(*registration);
        }
    }
}

static DRIVER: Driver = Driver {
    wheels: [const { CachePadded::new(Mutex::new(Wheel::new())) }; WHEELS],
    target: AtomicU64::new(u64::MAX),
    thread: OnceLock::new(),
};

thread_local! {
    /// The wheel this thread registers in.
    static WHEEL: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Hands out wheels to threads, round robin.
static NEXT_WHEEL: AtomicUsize = AtomicUsize::new(0);

fn my_wheel() -> u32 {
    WHEEL
        .try_with(|cell| {
            *cell.get().get_or_insert_with(|| {
                let wheel = (NEXT_WHEEL.fetch_add(1, Relaxed) % WHEELS) as u32;
                cell.set(Some(wheel));
                wheel
            })
        })
        .unwrap_or(0)
}

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

    fn lock(&self, wheel: u32) -> MutexGuard<'_, Wheel> {
        // Nothing panics under these locks but allocation; the state stays
        // consistent, so a poisoned lock is used as is.
        self.wheels[wheel as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes sure the thread wakes by `at`.
    fn wake_by(&self, at: u64) {
        if at < self.target.fetch_min(at, SeqCst) {
            if let Some(thread) = self.thread.get() {
                thread.unpark();
            }
        }
    }

    /// A slot for a shard's timer, not armed yet.
    fn register_hook(&self, hook: ShardHook) -> Registration {
        let wheel = ((hook.ptr as usize >> 6) % WHEELS) as u32;
        let mut guard = self.lock(wheel);
        let w = &mut *guard;
        let slot = w.allocate();
        let entry = &mut w.slots[slot as usize];
        entry.hook = Some(hook);
        entry.at = u64::MAX;
        Registration {
            wheel,
            slot,
            generation: entry.generation,
        }
    }

    /// Makes sure a shard's timer fires by `at`.
    fn arm_hook(&self, registration: Registration, at: u64) {
        {
            let mut wheel = self.lock(registration.wheel);
            let slot = &wheel.slots[registration.slot as usize];
            if slot.queued && slot.at <= at {
                return;
            }
            wheel.move_to(registration, at);
        }
        self.wake_by(at);
    }

    /// Arms a new timer for `at`, to wake `waker`. Does not read the clock:
    /// a deadline already past fires at once, from the timer thread.
    pub(crate) fn register(&self, at: Instant, waker: Waker) -> Registration {
        let at = raw(at);
        let wheel = my_wheel();
        let registration = {
            let mut guard = self.lock(wheel);
            let w = &mut *guard;
            let slot = match w.free.pop() {
                Some(slot) => slot,
                None => {
                    let slot =
                        u32::try_from(w.slots.len()).expect("keylock: more than 2^32 armed timers");
                    w.slots.push(Slot::default());
                    slot
                }
            };
            let entry = &mut w.slots[slot as usize];
            entry.at = at;
            entry.waker = Some(waker);
            entry.queued = true;
            let registration = Registration {
                wheel,
                slot,
                generation: entry.generation,
            };
            w.heap.push(Reverse((at, slot, registration.generation)));
            registration
        };
        self.wake_by(at);
        registration
    }

    /// Polls an armed timer for deadline `at` (which may have moved since it
    /// was armed): `Ready` if it fired for `at` or a later deadline, without
    /// reading the clock. Otherwise it is (re)armed for `at`, and keeps its
    /// waker if that wakes the same task as `current`; when it does not,
    /// `Pending(true)` asks the caller to clone `current` (outside any lock)
    /// and hand it to [`set_waker`](Self::set_waker).
    pub(crate) fn poll(
        &self,
        registration: Registration,
        at: Instant,
        current: &Waker,
    ) -> TimerState {
        let at = raw(at);
        let needs_waker = {
            let mut wheel = self.lock(registration.wheel);
            let slot = &wheel.slots[registration.slot as usize];
            debug_assert_eq!(slot.generation, registration.generation);
            if !slot.queued && at <= slot.at {
                return TimerState::Fired;
            }
            wheel.move_to(registration, at);
            let slot = &wheel.slots[registration.slot as usize];
            !slot.waker.as_ref().is_some_and(|w| w.will_wake(current))
        };
        self.wake_by(at);
        TimerState::Armed { needs_waker }
    }

    /// Stores a fresh waker in a timer (after [`poll`](Self::poll) asked
    /// for one); the old one is dropped after unlocking.
    pub(crate) fn set_waker(&self, registration: Registration, waker: Waker) {
        let (old, at) = {
            let mut wheel = self.lock(registration.wheel);
            let slot = &mut wheel.slots[registration.slot as usize];
            debug_assert_eq!(slot.generation, registration.generation);
            let old = slot.waker.replace(waker);
            let at = slot.at;
            // Fired meanwhile, without a waker to wake: queue it again, so
            // that the new waker is woken.
            if !slot.queued {
                wheel.move_to(registration, at);
            }
            (old, at)
        };
        self.wake_by(at);
        drop(old);
    }

    /// Disarms a timer; its waker is dropped after unlocking.
    pub(crate) fn cancel(&self, registration: Registration) {
        let waker = {
            let mut guard = self.lock(registration.wheel);
            let wheel = &mut *guard;
            let slot = &mut wheel.slots[registration.slot as usize];
            debug_assert_eq!(slot.generation, registration.generation);
            let was_queued = slot.queued;
            let waker = slot.waker.take();
            slot.generation = slot.generation.wrapping_add(1);
            slot.queued = false;
            slot.at = 0;
            slot.hook = None;
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
    ///
    /// Before it looks at the wheels it raises the target to "none": a
    /// registration made while it looks lowers the target and unparks it
    /// (the permit makes the coming park return at once), so no deadline
    /// is slept through.
    fn run(&self) -> ! {
        let mut due = Vec::new();
        loop {
            self.target.store(u64::MAX, SeqCst);
            let now = raw(Instant::now());
            let mut next = u64::MAX;
            for wheel in 0..WHEELS as u32 {
                let mut wheel = self.lock(wheel);
                wheel.pop_due(now, &mut due);
                if let Some(e) = wheel.heap.peek() {
                    next = next.min(e.0 .0);
                }
            }
            for waker in due.drain(..) {
                // A waker that panics must not stop the process's timer.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
            }
            self.target.fetch_min(next, SeqCst);
            match self.target.load(SeqCst) {
                u64::MAX => std::thread::park(),
                target => {
                    let now = raw(Instant::now());
                    if target > now {
                        std::thread::park_timeout(Duration::from_nanos(target - now));
                    }
                }
            }
        }
    }
}

impl Wheel {
    fn allocate(&mut self) -> u32 {
        match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot =
                    u32::try_from(self.slots.len()).expect("keylock: more than 2^32 armed timers");
                self.slots.push(Slot::default());
                slot
            }
        }
    }

    const fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            stale: 0,
        }
    }

    /// Sets a slot's deadline, queueing a heap entry for it unless one is
    /// already queued for that deadline.
    fn move_to(&mut self, registration: Registration, at: u64) {
        let slot = &mut self.slots[registration.slot as usize];
        debug_assert_eq!(slot.generation, registration.generation);
        if slot.queued && slot.at == at {
            return;
        }
        if slot.queued {
            self.stale += 1;
        }
        slot.at = at;
        slot.queued = true;
        self.heap
            .push(Reverse((at, registration.slot, registration.generation)));
        self.compact_if_stale();
    }

    /// Pops every entry due at `now`, collecting the wakers of live ones and
    /// firing the shards' timers (each locks its shard; see [`ShardHook`]),
    /// which are queued again for their shards' next deadlines.
    fn pop_due(&mut self, now: u64, due: &mut Vec<Waker>) {
        let mut fired = Vec::new();
        while let Some(&Reverse((at, slot, generation))) = self.heap.peek() {
            if at > now {
                break;
            }
            self.heap.pop();
            let entry = &mut self.slots[slot as usize];
            if entry.generation == generation && entry.queued && entry.at == at {
                entry.queued = false;
                match entry.hook {
                    Some(hook) => fired.push((slot, generation, hook)),
                    None => due.extend(entry.waker.take()),
                }
            } else {
                self.stale = self.stale.saturating_sub(1);
            }
        }
        for (slot, generation, hook) in fired {
            // SAFETY: the shard exists: its table cancels this slot (under
            // this wheel's lock, which we hold) before it goes.
            let next = unsafe { (hook.fire)(hook.ptr, now, due) };
            let entry = &self.slots[slot as usize];
            if next != u64::MAX && (!entry.queued || next < entry.at) {
                self.move_to(
                    Registration {
                        wheel: 0,
                        slot,
                        generation,
                    },
                    next,
                );
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
            wheel: 0,
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
        assert_eq!(
            wheel.heap.peek().map(|e| e.0 .0),
            Some(10),
            "earliest first"
        );
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
        wheel.move_to(r, 50);
        let mut due = Vec::new();
        wheel.pop_due(40, &mut due);
        assert!(due.is_empty(), "the stale entry at 10 does not fire");
        wheel.pop_due(50, &mut due);
        assert_eq!(due.len(), 1);
        assert!(!wheel.slots[r.slot as usize].queued, "fired: not queued");
        due.clear();
        wheel.slots[r.slot as usize].waker = Some(waker.clone());
        wheel.move_to(r, 60);
        wheel.pop_due(60, &mut due);
        assert_eq!(due.len(), 1, "re-armed after firing, it fires again");
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
    // The timer thread outlives the test, which miri reports as a leak.
    #[cfg_attr(miri, ignore)]
    fn the_thread_wakes_a_registered_waker_at_its_deadline() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let driver = Driver::get();
        let at = Instant::now() + Duration::from_millis(1);
        let waker = Waker::from(count.clone());
        let r = driver.register(at, waker.clone());
        // Bounded only so that a bug fails instead of hanging.
        let give_up = Instant::now() + Duration::from_secs(30);
        while count.0.load(SeqCst) == 0 {
            assert!(Instant::now() < give_up, "the timer thread never fired");
            std::thread::yield_now();
        }
        assert!(Instant::now() >= at, "fired before its deadline");
        assert_eq!(driver.poll(r, at, &waker), TimerState::Fired);
        // Moved far past the deadline it fired for: armed again (nothing can
        // fire it during the test), its waker spent, then kept.
        let far = Instant::now() + Duration::from_secs(3600);
        assert_eq!(
            driver.poll(r, far, &waker),
            TimerState::Armed { needs_waker: true },
            "moved past the deadline it fired for: armed again, its waker spent"
        );
        driver.set_waker(r, waker.clone());
        assert_eq!(
            driver.poll(r, far, &waker),
            TimerState::Armed { needs_waker: false },
            "the same task's waker is kept"
        );
        // Moved earlier again: it fires at the new deadline.
        let near = Instant::now() + Duration::from_millis(1);
        assert_eq!(
            driver.poll(r, near, &waker),
            TimerState::Armed { needs_waker: false }
        );
        while count.0.load(SeqCst) == 1 {
            assert!(Instant::now() < give_up, "the re-armed timer never fired");
            std::thread::yield_now();
        }
        assert!(Instant::now() >= near);
        driver.cancel(r);
    }
}
