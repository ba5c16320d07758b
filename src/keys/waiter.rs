//! The waiter node a waiting future carries, and the protocol by which a
//! grant is published into it.
//!
//! A lock future that has to wait links a [`Waiter`] that lives inside the
//! (pinned) future into its key's FIFO queue: an intrusive doubly linked
//! list, so waiting allocates nothing and the table keeps no per-waiter state
//! of its own. The queue links and the grant are written only under the
//! shard lock; the node's `state` word lets the owner learn of its grant, and
//! hand over its waker, without taking that lock.
//!
//! # States
//!
//! | `state`   | linked | waker cell            | grant cell                    |
//! |-----------|--------|-----------------------|-------------------------------|
//! | `IDLE`    | no     | owner's               | owner's                       |
//! | `WAITING` | yes    | owner's (no waker yet, or it was taken to wake the owner) | table's (under the lock) |
//! | `ARMED`   | yes    | table's (under the lock) | table's (under the lock)    |
//! | `NUDGED`  | yes    | owner's (its waker was taken and woken, or it is registering) | table's (under the lock) |
//! | `GRANTED` | no     | owner's               | owner's, read-only: the grant |
//!
//! Transitions, and who makes them:
//!
//! - `IDLE → WAITING`: the owner links the node, under the lock.
//! - `WAITING → ARMED`: the owner, after writing its waker into the waker
//!   cell; a compare-and-swap, *without* the lock (right after linking) or a
//!   store under it (re-registering on a later poll).
//! - `ARMED | WAITING → NUDGED`: the table *nudges* the owner without
//!   granting (so that it arms a timer, or retries a free key under eventual
//!   fairness), under the lock: from `ARMED` it takes the waker out to wake
//!   it; from `WAITING` (the owner is between linking and arming) it only
//!   flips the word, so that the owner's compare-and-swap fails and it polls
//!   again instead of sleeping.
//! - `NUDGED → ARMED`: the owner re-registers on its next poll, under the lock.
//! - `WAITING | ARMED | NUDGED → GRANTED`: the table, under the lock, after unlinking
//!   the node, writing the grant and taking the waker (if `ARMED`). It is the
//!   table's **last access to the node**: from then on the owner may read the
//!   grant, complete, and free the node, with no lock.
//! - `WAITING | ARMED → IDLE`: the owner unlinks itself (cancel, timeout, or
//!   taking a free key under eventual fairness), under the lock.
//!
//! # Why no wakeup is lost
//!
//! The owner's lock-free registration writes the waker and then
//! compare-and-swaps `WAITING → ARMED`; a grant compare-and-swaps `WAITING →
//! GRANTED` or, having seen `ARMED`, takes the waker before storing
//! `GRANTED`. The two compare-and-swaps on one word are ordered: either the
//! owner armed first (the table takes and wakes its waker), or the grant came
//! first (the owner's compare-and-swap fails, and it is still running, so it
//! takes its grant at once). A nudge is ordered the same way. Neither ever
//! reads the waker cell unless it saw `ARMED`, which the owner sets only
//! after its write (release/acquire).

use std::marker::PhantomPinned;
use std::ptr::NonNull;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::task::Waker;

use crate::support::lease::{PackedDuration, Terms};
use crate::support::loom::{AtomicU64, AtomicU8, UnsafeCell};
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::time::clock::Stamp;

const IDLE: u8 = 0;
const WAITING: u8 = 1;
const ARMED: u8 = 2;
const GRANTED: u8 = 3;
const NUDGED: u8 = 4;

/// A pointer to a linked waiter. Dereferenced only under the shard lock
/// while the node is linked (see [`Waiter`]'s invariants).
pub(crate) type WaiterPtr = NonNull<Waiter>;

/// A waiting future's node: its one wake slot and its place in the queue.
///
/// # Invariants
///
/// - While `state` is `WAITING` or `ARMED` the node is linked into exactly one
///   key's queue, its memory is pinned, and the future that owns it unlinks it
///   (under the shard lock) before its memory is released: its `Drop` does.
/// - The table dereferences a [`WaiterPtr`] only under the shard lock and only
///   while the node is linked; the store of `GRANTED` is its last access.
#[derive(Debug)]
pub(crate) struct Waiter {
    state: AtomicU8,
    /// What the owner asks for (`ASK_*`), with `Node::ask`. Written by the
    /// owner while the node is idle (before linking, under the lock), read
    /// under the lock while linked: an atomic only so that it can sit in the
    /// state word's padding, shared with the table without `unsafe`.
    kind: AtomicU8,
    /// The owner's waker; see the module's state table for who may touch it.
    waker: UnsafeCell<Option<Waker>>,
    /// Links and the lease asked for while linked; the grant once made.
    node: UnsafeCell<Node>,
    /// When it began to wait (a raw stamp; 0: not known yet), for the status
    /// view: the wait's own start if it has a timeout, written under the lock
    /// when it links; otherwise stamped by the owner from the coarse clock
    /// right after the unlock, so that no clock is read under the lock.
    since: AtomicU64,
    _pinned: PhantomPinned,
}

/// The part of a waiter written under the shard lock.
#[derive(Debug)]
struct Node {
    slot: NodeSlot,
    /// The lease the grant will carry (its bits), or for an upgrade the
    /// token of the shared grant to upgrade: what `Waiter::kind` says.
    ask: u64,
    /// The holder's lease deadline this waiter's timer covers, as last told
    /// under the lock (none: no timer for the holder). A release that makes
    /// a holder with an earlier deadline nudges the head to re-arm; one with
    /// the same or a later deadline does not.
    timer_at: Stamp,
    /// When the owner gives up waiting (none: never), for the shard's timer.
    until: Stamp,
    /// The transaction the waiter is for (0: none); for an upgrade, its
    /// shared grant's.
    owner: u64,
}

const ASK_EXCLUSIVE: u8 = 0;
const ASK_SHARED: u8 = 1;
const ASK_UPGRADE: u8 = 2;

/// What a waiter asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    /// A new grant in this mode.
    Grant(Mode),
    /// The shared grant with this token, made exclusive.
    Upgrade(FencingToken),
}

/// A linked node's links, or, once unlinked and granted, its grant: the
/// links are dead by then, so the grant reuses their room (the future stays
/// small, and moving it stays cheap).
#[derive(Debug, Clone, Copy)]
enum NodeSlot {
    Links {
        prev: Option<WaiterPtr>,
        next: Option<WaiterPtr>,
    },
    Grant {
        token: FencingToken,
        /// The deadline and mode, packed ([`Stamp::pack_with`]): the form
        /// a guard keeps them in, made here where the mode is known.
        packed: u64,
    },
}

impl Node {
    #[inline]
    fn links(&mut self) -> (&mut Option<WaiterPtr>, &mut Option<WaiterPtr>) {
        if !matches!(self.slot, NodeSlot::Links { .. }) {
            self.slot = NodeSlot::Links {
                prev: None,
                next: None,
            };
        }
        match &mut self.slot {
            NodeSlot::Links { prev, next } => (prev, next),
            NodeSlot::Grant { .. } => unreachable!(),
        }
    }
}

/// A future's waiter node, written only when the future first has to wait,
/// so that a lock that does not wait writes one flag, not the node.
///
/// Laid out in order (`repr(C)`), the flag first: next to the future's
/// other fields, so that the stores that build a lock future cover the flag
/// without spanning the (uninitialized) node.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct LazyWaiter {
    live: bool,
    node: std::mem::MaybeUninit<Waiter>,
}

impl LazyWaiter {
    #[inline]
    pub(crate) const fn new() -> Self {
        Self {
            live: false,
            node: std::mem::MaybeUninit::uninit(),
        }
    }

    /// The node, initialized now if it was not.
    #[inline]
    pub(crate) fn get_or_init(&mut self) -> &Waiter {
        if !self.live {
            self.node.write(Waiter::new());
            self.live = true;
        }
        // SAFETY: `live` is set, so the node is initialized.
        unsafe { self.node.assume_init_ref() }
    }

    /// The node, known initialized: [`get`](Self::get) without its check.
    ///
    /// # Safety
    ///
    /// The node was initialized ([`get_or_init`](Self::get_or_init)): a
    /// future that linked its node (its state says so) has.
    #[inline(always)]
    pub(crate) unsafe fn get_unchecked(&self) -> &Waiter {
        debug_assert!(self.live, "keylock: the waiter node is initialized");
        // SAFETY: initialized (the caller's contract).
        unsafe { self.node.assume_init_ref() }
    }

    /// The node, which a linked or granted future has initialized.
    ///
    /// # Panics
    ///
    /// If it was never initialized (a bug in the caller).
    #[inline]
    pub(crate) fn get(&self) -> &Waiter {
        assert!(self.live, "keylock: the waiter node is initialized");
        // SAFETY: `live` is set, so the node is initialized.
        unsafe { self.node.assume_init_ref() }
    }
}

impl Drop for LazyWaiter {
    #[inline(always)]
    fn drop(&mut self) {
        if self.live {
            // SAFETY: initialized (`live`), dropped once, here; the owner
            // unlinked it first (its `Drop` runs before the fields').
            unsafe { self.node.assume_init_drop() };
        }
    }
}

/// How the owner's lock-free registration went.
#[derive(Debug)]
pub(crate) enum Armed {
    /// The waker is stored; the table will wake it.
    Stored,
    /// The node was granted meanwhile; here is the unused waker.
    Granted(Option<Waker>),
    /// The node was nudged meanwhile: poll again; here is the unused waker.
    Nudged(Option<Waker>),
}

/// A grant read out of a waiter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Granted {
    pub(crate) token: FencingToken,
    pub(crate) deadline: Stamp,
    /// `deadline` and the grant's mode packed ([`Stamp::pack_with`]), as
    /// published.
    pub(crate) packed: u64,
}

impl Granted {
    /// The grant of `token` with `deadline`, in `mode`.
    #[inline(always)]
    pub(crate) fn new(token: FencingToken, deadline: Stamp, mode: Mode) -> Self {
        Self {
            token,
            deadline,
            packed: deadline.pack_with(mode),
        }
    }

    /// Whether this, published to an *upgrade*, is the notice that the
    /// grant it upgrades lost the key ([`Waiter::tell_orphaned`]): an
    /// upgrade is only ever granted exclusive.
    #[inline]
    pub(crate) fn is_orphan_notice(&self) -> bool {
        Stamp::unpack(self.packed).1 == Mode::Shared
    }
}

/// What a waiter's state word says, for its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Not linked.
    Idle,
    /// Linked, waiting.
    Waiting,
    /// Granted: the table is done with the node.
    Granted,
}

// SAFETY: the cells are shared between the owner and the table under the
// protocol above (the shard lock, or the state word's release/acquire
// handover); a `Waker` is `Send + Sync`.
unsafe impl Send for Waiter {}
// SAFETY: as above.
unsafe impl Sync for Waiter {}

impl Waiter {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU8::new(IDLE),
            kind: AtomicU8::new(ASK_EXCLUSIVE),
            waker: UnsafeCell::new(None),
            node: UnsafeCell::new(Node {
                slot: NodeSlot::Links {
                    prev: None,
                    next: None,
                },
                ask: PackedDuration::NONE.bits(),
                timer_at: Stamp::NONE,
                until: Stamp::NONE,
                owner: 0,
            }),
            since: AtomicU64::new(0),
            _pinned: PhantomPinned,
        }
    }

    /// The owner's view of the state (acquire: a `Granted` answer makes the
    /// grant readable).
    #[inline]
    pub(crate) fn seen(&self) -> Seen {
        match self.state.load(Acquire) {
            IDLE => Seen::Idle,
            GRANTED => Seen::Granted,
            _ => Seen::Waiting,
        }
    }

    /// The grant, once [`seen`](Self::seen) answered `Granted` (or under the
    /// shard lock after the table granted it).
    #[inline]
    pub(crate) fn granted(&self) -> Granted {
        debug_assert_eq!(self.state.load(Relaxed), GRANTED);
        let node = self.node.get_mut();
        // SAFETY: `GRANTED` was observed with acquire ordering (or under the
        // lock that the table's store happened under): the table wrote the
        // grant before its release store of `GRANTED` and never touches the
        // node again, so this read races with nothing.
        let slot = unsafe { node.deref() }.slot;
        match slot {
            NodeSlot::Grant { token, packed } => {
                let (deadline, _) = Stamp::unpack(packed);
                Granted {
                    token,
                    deadline,
                    packed,
                }
            }
            NodeSlot::Links { .. } => unreachable!("keylock: a granted node holds its grant"),
        }
    }

    /// Prepares an idle node for linking: records the lease its grant will
    /// carry. Owner only, while idle.
    ///
    /// # Safety
    ///
    /// The node must be idle (not linked) and owned by the caller.
    #[inline]
    pub(crate) unsafe fn prepare(&self, terms: Terms, until: Stamp, want: Want, since: Stamp) {
        debug_assert_eq!(self.state.load(Relaxed), IDLE);
        let node = self.node.get_mut();
        // SAFETY: an idle node is its owner's alone (caller's contract).
        let node = unsafe { node.deref() };
        let (kind, ask) = match want {
            Want::Grant(Mode::Exclusive) => (ASK_EXCLUSIVE, terms.lease.bits()),
            Want::Grant(Mode::Shared) => (ASK_SHARED, terms.lease.bits()),
            Want::Upgrade(token) => (ASK_UPGRADE, token.get()),
        };
        self.kind.store(kind, Relaxed);
        node.ask = ask;
        node.owner = terms.owner;
        self.since.store(since.to_raw(), Relaxed);
        node.timer_at = Stamp::NONE;
        node.until = until;
        node.slot = NodeSlot::Links {
            prev: None,
            next: None,
        };
    }

    /// Registers the owner's waker right after linking, without the lock.
    ///
    /// # Safety
    ///
    /// Owner only, once per link, right after linking (the node is the
    /// owner's, pinned, and linked with no waker).
    #[inline]
    pub(crate) unsafe fn arm_unlocked(&self, waker: Waker) -> Armed {
        // The table reads the waker cell only in `ARMED`, which only we set.
        {
            let cell = self.waker.get_mut();
            // SAFETY: before `ARMED` the waker cell is the owner's.
            let slot = unsafe { cell.deref() };
            debug_assert!(slot.is_none(), "an unarmed node holds no waker");
            // Written over, not replaced: an unarmed node holds no waker
            // (`retire` and the grant take it), so there is nothing to drop
            // (were there one, it would leak, not be freed twice).
            // SAFETY: `slot` is a valid, exclusive place (above).
            unsafe { std::ptr::write(slot, Some(waker)) };
        }
        match self
            .state
            .compare_exchange(WAITING, ARMED, Release, Acquire)
        {
            Ok(_) => Armed::Stored,
            Err(state) => {
                let cell = self.waker.get_mut();
                // SAFETY: granted or nudged: the waker cell is still the
                // owner's (the table reads it only in `ARMED`).
                let waker = unsafe { cell.deref() }.take();
                if state == GRANTED {
                    Armed::Granted(waker)
                } else {
                    debug_assert_eq!(state, NUDGED);
                    Armed::Nudged(waker)
                }
            }
        }
    }

    /// Keeps the stored waker if it wakes the same task as `current`;
    /// otherwise stores `fresh` (a clone of `current` the owner made before
    /// locking). Returns the waker no longer needed, to drop after unlocking,
    /// or `Err(())` if a waker must be stored and the owner brought none.
    ///
    /// # Safety
    ///
    /// Under the shard lock, by the owner, while the node is linked.
    pub(crate) unsafe fn arm_locked(
        &self,
        current: &Waker,
        fresh: &mut Option<Waker>,
    ) -> Result<Option<Waker>, ()> {
        let cell = self.waker.get_mut();
        // SAFETY: under the lock, the owner is the only other party, and it is
        // the caller.
        let slot = unsafe { cell.deref() };
        let armed = self.state.load(Relaxed) == ARMED;
        if armed && slot.as_ref().is_some_and(|w| w.will_wake(current)) {
            return Ok(fresh.take());
        }
        let fresh = fresh.take().ok_or(())?;
        let old = slot.replace(fresh);
        self.state.store(ARMED, Release);
        Ok(old)
    }

    /// Nudges the owner of a linked node without granting: returns its waker
    /// to wake, if it was armed (otherwise it is registering right now, or
    /// was nudged already, and will poll again by itself).
    ///
    /// # Safety
    ///
    /// Under the shard lock, while the node is linked.
    pub(crate) unsafe fn nudge(this: WaiterPtr) -> Option<Waker> {
        // SAFETY: linked, under the lock: alive.
        let me = unsafe { this.as_ref() };
        match me.state.load(Acquire) {
            ARMED => {
                let waker = {
                    let cell = me.waker.get_mut();
                    // SAFETY: in `ARMED` the waker cell is the table's.
                    unsafe { cell.deref() }.take()
                };
                me.state.store(NUDGED, Relaxed);
                waker
            }
            WAITING => {
                // The owner is between linking and arming: make its
                // compare-and-swap fail, so that it polls again.
                let _ = me.state.compare_exchange(WAITING, NUDGED, AcqRel, Acquire);
                // Armed meanwhile: take the waker after all.
                if me.state.load(Acquire) == ARMED {
                    // SAFETY: as above.
                    return unsafe { Self::nudge(this) };
                }
                None
            }
            _ => None,
        }
    }

    /// Publishes a grant to an unlinked node and returns its waker to wake.
    /// The node must not be touched again: its owner may free it at once.
    ///
    /// # Safety
    ///
    /// Under the shard lock; the node was linked and has just been unlinked.
    #[inline(always)]
    pub(crate) unsafe fn grant(
        this: WaiterPtr,
        token: FencingToken,
        deadline: Stamp,
        mode: Mode,
    ) -> Option<Waker> {
        // SAFETY: linked until just now, so alive (the owner unlinks under
        // the lock before it frees the node, and we hold it).
        let me = unsafe { this.as_ref() };
        {
            let node = me.node.get_mut();
            // SAFETY: the grant cell is the table's under the lock.
            unsafe { node.deref() }.slot = NodeSlot::Grant {
                token,
                packed: deadline.pack_with(mode),
            };
        }
        let mut state = me.state.load(Acquire);
        loop {
            if state == ARMED {
                let waker = {
                    let cell = me.waker.get_mut();
                    // SAFETY: in `ARMED` the waker cell is the table's (the
                    // owner changes an armed node only under the lock, which
                    // we hold).
                    unsafe { cell.deref() }.take()
                };
                me.state.store(GRANTED, Release);
                return waker;
            }
            debug_assert!(state == WAITING || state == NUDGED);
            match me.state.compare_exchange(state, GRANTED, AcqRel, Acquire) {
                // The owner had not armed (it is running, or was woken by a
                // nudge) and will see this when it polls.
                Ok(_) => return None,
                Err(now) => state = now,
            }
        }
    }

    /// Tells an upgrade, just unlinked from the head of its queue, that the
    /// grant it upgrades (`token`) lost the key, and returns its waker to
    /// wake. Published as a grant the owner reads the way it reads any
    /// (so a forgotten upgrade need not be polled for the queue behind it
    /// to move): `token` itself, shared, which no upgrade is ever granted
    /// ([`Granted::is_orphan_notice`]). The node must not be touched again.
    ///
    /// # Safety
    ///
    /// As [`grant`](Self::grant).
    pub(crate) unsafe fn tell_orphaned(this: WaiterPtr, token: FencingToken) -> Option<Waker> {
        // SAFETY: the caller's contract is `grant`'s.
        unsafe { Self::grant(this, token, Stamp::NONE, Mode::Shared) }
    }

    /// Marks an unlinked node idle again (cancelled, or took a free key
    /// itself) and takes its waker, to drop after unlocking.
    ///
    /// # Safety
    ///
    /// Under the shard lock, by the owner, the node just unlinked.
    pub(crate) unsafe fn retire(&self) -> Option<Waker> {
        let cell = self.waker.get_mut();
        // SAFETY: under the lock, by the owner: nobody else touches it.
        let waker = unsafe { cell.deref() }.take();
        self.state.store(IDLE, Relaxed);
        waker
    }

    /// The lease the node's grant will carry (under the lock, while linked).
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    pub(crate) unsafe fn lease(this: WaiterPtr) -> PackedDuration {
        // SAFETY: linked, under the lock (caller's contract).
        let node = unsafe { this.as_ref() }.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        PackedDuration::from_bits(unsafe { node.deref() }.ask)
    }

    /// When the node began to wait (none: not stamped yet, or no clock
    /// was read for it), under the lock, while linked.
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    pub(crate) unsafe fn since(this: WaiterPtr) -> Stamp {
        // SAFETY: linked, so alive (caller's contract).
        Stamp::from_raw(unsafe { this.as_ref() }.since.load(Relaxed))
    }

    /// Whether the node's wait start is known already (it was linked with
    /// one, read under the lock). Owner only, right after linking.
    #[inline]
    pub(crate) fn is_stamped(&self) -> bool {
        self.since.load(Relaxed) != 0
    }

    /// The owner stamps when its wait began, right after linking it and
    /// unlocking (a status view may read it at any time: an atomic).
    #[inline]
    pub(crate) fn stamp_since(&self, since: Stamp) {
        self.since.store(since.to_raw(), Relaxed);
    }

    /// The transaction the node waits for (0: none), under the lock, while
    /// linked.
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    pub(crate) unsafe fn owner(this: WaiterPtr) -> u64 {
        // SAFETY: linked, under the lock (caller's contract).
        let node = unsafe { this.as_ref() }.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        unsafe { node.deref() }.owner
    }
}

impl Waiter {
    /// Records the holder deadline the owner is about to arm its timer for.
    ///
    /// # Safety
    ///
    /// Under the shard lock, by the owner, while linked.
    #[inline]
    pub(crate) unsafe fn set_timer_at(&self, at: Stamp) {
        let node = self.node.get_mut();
        // SAFETY: linked, under the lock (caller's contract).
        unsafe { node.deref() }.timer_at = at;
    }

    /// When a linked waiter gives up (none: never).
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    #[inline]
    pub(crate) unsafe fn until(this: WaiterPtr) -> Stamp {
        // SAFETY: linked, under the lock (caller's contract).
        let node = unsafe { this.as_ref() }.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        unsafe { node.deref() }.until
    }

    /// What a linked waiter asks for.
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    #[inline]
    pub(crate) unsafe fn want(this: WaiterPtr) -> Want {
        // SAFETY: linked, under the lock (caller's contract).
        let me = unsafe { this.as_ref() };
        let node = me.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        let ask = unsafe { node.deref() }.ask;
        match me.kind.load(Relaxed) {
            ASK_SHARED => Want::Grant(Mode::Shared),
            ASK_UPGRADE => {
                Want::Upgrade(FencingToken::new(ask).expect("keylock: an upgrade names a token"))
            }
            _ => Want::Grant(Mode::Exclusive),
        }
    }

    /// The lease a linked waiter asks for with an exclusive grant (`None`:
    /// it asks for a shared grant or an upgrade).
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    #[inline(always)]
    pub(crate) unsafe fn exclusive_lease(this: WaiterPtr) -> Option<PackedDuration> {
        // SAFETY: linked, under the lock (caller's contract).
        let me = unsafe { this.as_ref() };
        let node = me.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        let ask = unsafe { node.deref() }.ask;
        (me.kind.load(Relaxed) == ASK_EXCLUSIVE).then(|| PackedDuration::from_bits(ask))
    }

    /// The holder deadline a linked waiter's timer covers.
    ///
    /// # Safety
    ///
    /// Under the shard lock, while linked.
    #[inline]
    pub(crate) unsafe fn timer_at(this: WaiterPtr) -> Stamp {
        // SAFETY: linked, under the lock (caller's contract).
        let node = unsafe { this.as_ref() }.node.get_mut();
        // SAFETY: as above: the node cell is the table's.
        unsafe { node.deref() }.timer_at
    }
}

/// A key's FIFO queue of waiters, threaded through the waiters themselves.
/// Touched only under the shard lock.
///
/// The head's `prev` link is not kept: it is `None` by definition, and
/// [`pop_front`](Self::pop_front) leaves the new head's stale link as it
/// is, so that a handoff writes only the node it grants, not its
/// successor's (another task's memory, often another core's cache line).
/// Every reader of `prev` asks whether the node is the head first.
#[derive(Debug, Default)]
pub(crate) struct WaitList {
    head: Option<WaiterPtr>,
    tail: Option<WaiterPtr>,
    len: u32,
}

// SAFETY: the list only holds pointers to `Waiter`s, which are `Send + Sync`,
// and it is touched only under the shard lock.
unsafe impl Send for WaitList {}

impl WaitList {
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.head.is_none()
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    #[inline]
    pub(crate) fn head(&self) -> Option<WaiterPtr> {
        self.head
    }

    /// Whether `waiter` heads the queue.
    #[inline]
    pub(crate) fn is_head(&self, waiter: &Waiter) -> bool {
        self.head == Some(NonNull::from(waiter))
    }

    /// Links `waiter` at the tail.
    ///
    /// # Safety
    ///
    /// Under the shard lock; `waiter` is idle, prepared, pinned, and its owner
    /// unlinks it before freeing it.
    #[inline(always)]
    pub(crate) unsafe fn push_back(&mut self, waiter: &Waiter) {
        let ptr = NonNull::from(waiter);
        {
            let node = waiter.node.get_mut();
            // SAFETY: an idle node is touched by nobody else.
            let (prev, next) = unsafe { node.deref() }.links();
            *prev = self.tail;
            *next = None;
        }
        match self.tail {
            // SAFETY: the tail is linked, and we hold the lock.
            Some(tail) => unsafe { set_next(tail, Some(ptr)) },
            None => self.head = Some(ptr),
        }
        self.tail = Some(ptr);
        self.len = self
            .len
            .checked_add(1)
            .expect("keylock: more than 2^32 - 1 waiters on one key");
        waiter.state.store(WAITING, Relaxed);
    }

    /// Links `waiter` at the head, ahead of every other waiter (an upgrade).
    ///
    /// # Safety
    ///
    /// As [`push_back`](Self::push_back).
    pub(crate) unsafe fn push_front(&mut self, waiter: &Waiter) {
        let ptr = NonNull::from(waiter);
        {
            let node = waiter.node.get_mut();
            // SAFETY: an idle node is touched by nobody else.
            let (prev, next) = unsafe { node.deref() }.links();
            *prev = None;
            *next = self.head;
        }
        match self.head {
            // SAFETY: the head is linked, and we hold the lock.
            Some(head) => unsafe { set_prev(head, Some(ptr)) },
            None => self.tail = Some(ptr),
        }
        self.head = Some(ptr);
        self.len = self
            .len
            .checked_add(1)
            .expect("keylock: more than 2^32 - 1 waiters on one key");
        waiter.state.store(WAITING, Relaxed);
    }

    /// Unlinks `waiter` from anywhere in the queue.
    ///
    /// # Safety
    ///
    /// Under the shard lock; `waiter` is linked into this list.
    pub(crate) unsafe fn remove(&mut self, waiter: WaiterPtr) {
        let is_head = self.head == Some(waiter);
        let (prev, next) = {
            // SAFETY: linked, under the lock.
            let node = unsafe { waiter.as_ref() }.node.get_mut();
            // SAFETY: as above.
            let (prev, next) = unsafe { node.deref() }.links();
            // The head's own link may be stale: it has none.
            let prev = prev.take().filter(|_| !is_head);
            (prev, next.take())
        };
        match prev {
            // SAFETY: linked neighbours, under the lock.
            Some(prev) => unsafe { set_next(prev, next) },
            None => self.head = next,
        }
        match next {
            // SAFETY: as above.
            Some(next) => unsafe { set_prev(next, prev) },
            None => self.tail = prev,
        }
        self.len -= 1;
    }

    /// Unlinks the head, returning it and the lease it asked for.
    ///
    /// # Safety
    ///
    /// Under the shard lock.
    #[inline]
    pub(crate) unsafe fn pop_front(&mut self) -> Option<(WaiterPtr, Terms)> {
        let head = self.head?;
        // SAFETY: the head is linked, under the lock.
        let terms = unsafe {
            Terms {
                lease: Waiter::lease(head),
                owner: Waiter::owner(head),
            }
        };
        let next = {
            // SAFETY: as above.
            let node = unsafe { head.as_ref() }.node.get_mut();
            // SAFETY: as above.
            let (prev, next) = unsafe { node.deref() }.links();
            *prev = None;
            next.take()
        };
        // The new head's `prev` still names `head`: a head's link is not
        // read (see the type's doc), so it is not written either.
        self.head = next;
        if next.is_none() {
            self.tail = None;
        }
        self.len -= 1;
        Some((head, terms))
    }

    /// Unlinks `head`, the head, to be granted at once: its links are dead
    /// from here on (the grant overwrites them), so they are read, not
    /// reset. Returns the transaction it waits for.
    ///
    /// # Safety
    ///
    /// Under the shard lock; `head` is this list's head (from
    /// [`head`](Self::head), no change since), and the caller grants it
    /// ([`Waiter::grant`]) before the lock is released.
    #[inline(always)]
    pub(crate) unsafe fn pop_head_for_grant(&mut self, head: WaiterPtr) -> u64 {
        debug_assert!(self.head == Some(head));
        let (next, owner) = {
            // SAFETY: the head is linked, under the lock.
            let node = unsafe { head.as_ref() }.node.get_mut();
            // SAFETY: as above.
            let node = unsafe { node.deref() };
            let next = match node.slot {
                NodeSlot::Links { next, .. } => next,
                // A linked node holds links (`push_*` writes them).
                NodeSlot::Grant { .. } => None,
            };
            (next, node.owner)
        };
        // The new head's `prev` still names `head`: a head's link is not
        // read (see the type's doc), so it is not written either.
        self.head = next;
        if next.is_none() {
            self.tail = None;
        }
        self.len -= 1;
        owner
    }

    /// Visits every linked waiter, head first: its address, its `prev` link
    /// and its raw state word.
    ///
    /// # Safety
    ///
    /// Under the shard lock.
    pub(crate) unsafe fn walk(&self, mut visit: impl FnMut(WaiterPtr, Option<WaiterPtr>, u8)) {
        let mut at = self.head;
        let mut first = true;
        while let Some(ptr) = at {
            // SAFETY: linked, under the lock.
            let me = unsafe { ptr.as_ref() };
            let (prev, next) = {
                let node = me.node.get_mut();
                // SAFETY: as above.
                let (prev, next) = unsafe { node.deref() }.links();
                // The head has no `prev` (its stored link may be stale).
                (if first { None } else { *prev }, *next)
            };
            first = false;
            // The node's cell is released first: `visit` may read it.
            visit(ptr, prev, me.state.load(Relaxed));
            at = next;
        }
    }
}

/// Whether a raw state word (from [`WaitList::walk`]) is a linked state.
#[cfg(feature = "test-util")]
pub(crate) fn is_linked_state(state: u8) -> bool {
    state == WAITING || state == ARMED || state == NUDGED
}

/// Whether a raw state word (from [`WaitList::walk`]) says "nudged".
#[cfg(feature = "test-util")]
pub(crate) fn is_nudged_state(state: u8) -> bool {
    state == NUDGED
}

/// # Safety
///
/// Under the shard lock; `at` is linked.
unsafe fn set_next(at: WaiterPtr, next: Option<WaiterPtr>) {
    // SAFETY: caller's contract.
    let node = unsafe { at.as_ref() }.node.get_mut();
    // SAFETY: as above.
    *unsafe { node.deref() }.links().1 = next;
}

/// # Safety
///
/// Under the shard lock; `at` is linked.
unsafe fn set_prev(at: WaiterPtr, prev: Option<WaiterPtr>) {
    // SAFETY: caller's contract.
    let node = unsafe { at.as_ref() }.node.get_mut();
    // SAFETY: as above.
    *unsafe { node.deref() }.links().0 = prev;
}
