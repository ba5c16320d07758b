//! Grant watchers: the key machine's hook for a grant that ends. A watcher
//! of grant `token` stores one waker here, under the shard lock, and is woken
//! when that grant is displaced (a lapse noticed, a revocation) or its
//! deadline moves earlier (a renewal). The loss layer (`lost.rs`) builds the
//! `Lost` future on it; the key machine knows nothing of that future.
//!
//! The registry is a slab of slots (token, waker): no `unsafe`, no node
//! inside the watcher, and nothing at all for a table whose grants nobody
//! watches: it stays an empty `Vec`, and a displacement looks at it only
//! after checking that it holds a watcher. Releases never look: a watcher
//! borrows its guard, so a grant being released has no watcher left (except
//! one leaked with `mem::forget`, whose slot stays taken and is never woken
//! again: tokens are not reused).

use std::task::Waker;
use std::time::Instant;

use crate::keys::deferred::Ctx;
use crate::support::token::FencingToken;

/// The wakers of the watchers of this shard's grants (a `Lost` future is
/// one). Touched only under the
/// shard lock.
///
/// # Invariants
///
/// `live` is the number of `Used` slots; `free` heads a list of the `Free`
/// ones, threaded through them.
#[derive(Debug, Default)]
pub(crate) struct GrantWatchers {
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

impl GrantWatchers {
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

impl GrantWatchers {
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
