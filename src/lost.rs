//! Loss notification: the [`Lost`] future a guard hands out, which resolves
//! when its grant loses its authority, and the per-shard registry of those
//! futures' wakers ([`LossWatchers`]).
//!
//! A grant loses its authority when it is *displaced*: its lease lapsed and
//! the lapse was noticed, or it was revoked (`revoke`, `revoke_grant`). Every
//! displacement runs under the shard lock through one function
//! (`Keys::displace` in `queue.rs`), which hands the wakers registered for
//! the displaced token to the operation's leftovers, woken after the unlock.
//! A lapse nobody notices is noticed by the `Lost` future itself: it arms a
//! timer at the grant's deadline and, when it fires, asks the table again
//! (settling the lapse). A renewal that moves the deadline earlier wakes the
//! watchers so that they re-arm; one that moves it later does not: their
//! timer fires at the old deadline, they find the grant live, and re-arm.
//!
//! The registry is a slab of slots (token, waker) behind the shard lock: no
//! `unsafe`, no node inside the future, and nothing at all for a guard that
//! never asks: it stays an empty `Vec` until a `Lost` registers, and a
//! displacement looks at it only after checking that it holds a watcher.
//! Releases never look: a `Lost` borrows its guard, so a grant being
//! released has no watcher left (except a `Lost` leaked with `mem::forget`,
//! whose slot stays taken and is never woken again: tokens are not reused).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use crate::deferred::Ctx;
use crate::error::LockError;
use crate::guard::Held;
use crate::table::{DefaultHashBuilder, LockTable};
use crate::timer::Sleep;
use crate::token::FencingToken;

/// The wakers of the `Lost` futures of one shard. Touched only under the
/// shard lock.
///
/// # Invariants
///
/// `live` is the number of `Used` slots; `free` heads a list of the `Free`
/// ones, threaded through them.
#[derive(Debug, Default)]
pub(crate) struct LossWatchers {
    slots: Vec<Slot>,
    free: Option<usize>,
    live: usize,
}

#[derive(Debug)]
enum Slot {
    Free {
        next: Option<usize>,
    },
    Used {
        token: FencingToken,
        /// `None` once taken to wake the watcher, until it polls again.
        waker: Option<Waker>,
    },
}

impl LossWatchers {
    /// Whether no watcher is registered: the one check a displacement makes
    /// when nobody uses loss notification.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Registers a watcher of grant `token`; returns its slot.
    fn register(&mut self, token: FencingToken, waker: Waker) -> usize {
        let used = Slot::Used {
            token,
            waker: Some(waker),
        };
        self.live += 1;
        match self.free {
            Some(i) => {
                let Slot::Free { next } = std::mem::replace(&mut self.slots[i], used) else {
                    unreachable!("keylock: the free list holds free slots")
                };
                self.free = next;
                i
            }
            None => {
                self.slots.push(used);
                self.slots.len() - 1
            }
        }
    }

    /// The waker stored in slot `i`, to keep or replace.
    fn waker_mut(&mut self, i: usize) -> &mut Option<Waker> {
        match &mut self.slots[i] {
            Slot::Used { waker, .. } => waker,
            Slot::Free { .. } => unreachable!("keylock: a watcher's slot is in use"),
        }
    }

    /// Frees slot `i`; returns its waker, to drop after unlocking.
    fn remove(&mut self, i: usize) -> Option<Waker> {
        let freed = std::mem::replace(&mut self.slots[i], Slot::Free { next: self.free });
        let Slot::Used { waker, .. } = freed else {
            unreachable!("keylock: a watcher's slot is in use")
        };
        self.free = Some(i);
        self.live -= 1;
        waker
    }

    /// Wakes (after unlocking) every watcher of grant `token`.
    #[inline]
    pub(crate) fn wake<K>(&mut self, token: FencingToken, ctx: &mut Ctx<'_, '_, K>) {
        if !self.is_empty() {
            self.wake_slow(token, ctx);
        }
    }

    #[cold]
    #[inline(never)]
    fn wake_slow<K>(&mut self, token: FencingToken, ctx: &mut Ctx<'_, '_, K>) {
        for slot in &mut self.slots {
            if let Slot::Used { token: t, waker } = slot {
                if *t == token {
                    if let Some(waker) = waker.take() {
                        ctx.wake_later(waker);
                    }
                }
            }
        }
    }

    /// Checks the invariants; for `validate`.
    #[cfg(feature = "test-util")]
    pub(crate) fn validate(&self) {
        let used = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Used { .. }))
            .count();
        assert_eq!(used, self.live, "loss watchers counted");
        let mut free = 0;
        let mut at = self.free;
        while let Some(i) = at {
            let Slot::Free { next } = self.slots[i] else {
                panic!("a loss watcher's slot in use is on the free list");
            };
            free += 1;
            assert!(
                free <= self.slots.len(),
                "the free list of loss watchers loops"
            );
            at = next;
        }
        assert_eq!(used + free, self.slots.len(), "every free slot is listed");
    }
}

/// What a watcher found, under the shard lock.
#[derive(Debug)]
pub(crate) enum Watch {
    /// The grant has lost the key; the watcher is unregistered.
    Lost,
    /// The grant holds the key; the watcher is registered with a waker.
    /// Arm a timer for the deadline, if it has one.
    Live { deadline: Option<Instant> },
    /// The waker must be stored and the caller brought no clone: clone it
    /// (outside the lock) and ask again.
    NeedWaker,
}

impl LossWatchers {
    /// The watcher in `slot` (registered there if `Some`) of grant `token`,
    /// which `live` says still holds its key (with `deadline`): registers
    /// it, or keeps its waker if that wakes the same task as `current`, or
    /// stores `fresh`; the replaced waker is dropped after unlocking.
    pub(crate) fn watch<K>(
        &mut self,
        slot: &mut Option<usize>,
        token: FencingToken,
        live: Option<Option<Instant>>,
        current: &Waker,
        fresh: Option<Waker>,
        ctx: &mut Ctx<'_, '_, K>,
    ) -> Watch {
        let Some(deadline) = live else {
            if let Some(i) = slot.take() {
                ctx.drop_waker_later(self.remove(i));
            }
            ctx.drop_waker_later(fresh);
            return Watch::Lost;
        };
        match *slot {
            None => match fresh {
                Some(waker) => *slot = Some(self.register(token, waker)),
                None => return Watch::NeedWaker,
            },
            Some(i) => {
                let stored = self.waker_mut(i);
                // `will_wake` compares pointers: no user code.
                if !stored.as_ref().is_some_and(|w| w.will_wake(current)) {
                    match fresh {
                        Some(waker) => {
                            let old = stored.replace(waker);
                            ctx.drop_waker_later(old);
                        }
                        None => return Watch::NeedWaker,
                    }
                } else {
                    ctx.drop_waker_later(fresh);
                }
            }
        }
        Watch::Live { deadline }
    }

    /// Unregisters the watcher in `slot`.
    pub(crate) fn unwatch<K>(&mut self, slot: usize, ctx: &mut Ctx<'_, '_, K>) {
        ctx.drop_waker_later(self.remove(slot));
    }
}

/// The future returned by [`Guard::lost`](crate::Guard::lost) and
/// [`OwnedGuard::lost`](crate::OwnedGuard::lost): resolves when the grant
/// loses its authority, to [`LockError::Expired`] with its token.
///
/// It resolves when the grant's lease lapses (at the deadline, woken by a
/// timer, re-armed if the grant is renewed meanwhile), or at once when it is
/// revoked ([`LockTable::revoke`], [`LockTable::revoke_grant`]); immediately
/// if that already happened. A grant without a lease that is never revoked
/// keeps it pending for ever. Every `Lost` of a grant is woken, however many
/// there are.
///
/// # Cancel safety
///
/// Cancel-safe: dropping it unregisters it and changes nothing else.
///
/// ```
/// # futures::executor::block_on(async {
/// let table = keylock::LockTable::new();
/// let guard = table.lock("job").await;
/// let token = guard.token();
/// assert!(table.revoke_grant("job", token));
/// let why = guard.lost().await;
/// assert_eq!(why, keylock::LockError::Expired { token });
/// # });
/// ```
#[must_use = "futures do nothing unless polled"]
pub struct Lost<'a, K, S = DefaultHashBuilder> {
    table: &'a LockTable<K, S>,
    held: &'a Held<K>,
    /// Its slot in the shard's watchers, while registered.
    slot: Option<usize>,
    /// The timer at the grant's deadline.
    sleep: Option<Sleep>,
    done: bool,
}

impl<'a, K, S> Lost<'a, K, S> {
    pub(crate) fn new(table: &'a LockTable<K, S>, held: &'a Held<K>) -> Self {
        Self {
            table,
            held,
            slot: None,
            sleep: None,
            done: false,
        }
    }

    /// The table of the grant watched.
    pub(crate) fn table(&self) -> &'a LockTable<K, S> {
        self.table
    }

    /// Renews the grant watched; see `Guard::renew`.
    pub(crate) fn renew(&self, lease: std::time::Duration) -> Result<(), LockError> {
        self.held.renew(self.table, lease)
    }

    fn watch(&mut self, cx: &Context<'_>) -> Watch {
        let watch = self
            .held
            .watch(self.table, &mut self.slot, cx.waker(), None);
        match watch {
            Watch::NeedWaker => {
                // `Waker::clone` is user code: outside the lock.
                let fresh = cx.waker().clone();
                self.held
                    .watch(self.table, &mut self.slot, cx.waker(), Some(fresh))
            }
            watch => watch,
        }
    }
}

impl<K, S> Future for Lost<'_, K, S> {
    type Output = LockError;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<LockError> {
        let this = &mut *self;
        assert!(!this.done, "keylock: `Lost` polled after it completed");
        loop {
            match this.watch(cx) {
                Watch::Lost => {
                    this.done = true;
                    // Holds a waker: dropped here, outside any lock.
                    this.sleep = None;
                    return Poll::Ready(LockError::Expired {
                        token: this.held.token(),
                    });
                }
                Watch::NeedWaker => unreachable!("keylock: a fresh waker was given"),
                Watch::Live { deadline: None } => {
                    this.sleep = None;
                    return Poll::Pending;
                }
                Watch::Live { deadline: Some(at) } => {
                    let sleep = match &mut this.sleep {
                        Some(sleep) => {
                            sleep.reset(at);
                            sleep
                        }
                        None => this.sleep.insert(Sleep::new(this.table.clock(), at)),
                    };
                    if sleep.poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // The deadline has passed: ask again, which settles the
                    // lapse (a renewal since then moved the deadline: re-arm).
                }
            }
        }
    }
}

impl<K, S> Drop for Lost<'_, K, S> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.held.unwatch(self.table, slot);
        }
    }
}

impl<K, S> fmt::Debug for Lost<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lost")
            .field("token", &self.held.token())
            .field("registered", &self.slot.is_some())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}
