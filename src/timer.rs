//! The one place that talks to a timer crate.
//!
//! A [`Sleep`] wakes a waiting future at an instant: the head of a queue at its
//! holder's lease deadline, or a waiter at its timeout. A timer is only an
//! early wake-up: whoever is woken judges the time again under the shard lock,
//! so a late or lost timer delays a handoff but never breaks it. Real time uses
//! async-io's `Timer`, whose single driver thread serves every table and every
//! runtime; the manual clock keeps its own sleepers.

use std::task::{Context, Poll};
use std::time::Instant;

use crate::clock::Clock;

/// A re-armable timer bound to a table's clock.
#[derive(Debug)]
pub(crate) enum Sleep {
    Real {
        timer: async_io::Timer,
        at: Instant,
    },
    #[cfg(feature = "test-util")]
    Manual {
        clock: crate::clock::ManualClock,
        id: Option<usize>,
        at: Instant,
    },
}

impl Sleep {
    pub(crate) fn new(clock: &Clock, at: Instant) -> Self {
        match clock {
            Clock::Monotonic => Self::Real {
                timer: async_io::Timer::at(at),
                at,
            },
            #[cfg(feature = "test-util")]
            Clock::Manual(clock) => Self::Manual {
                clock: clock.clone(),
                id: None,
                at,
            },
        }
    }

    /// Moves the deadline (a no-op when unchanged).
    pub(crate) fn reset(&mut self, to: Instant) {
        match self {
            Self::Real { timer, at } => {
                if *at != to {
                    *at = to;
                    timer.set_at(to);
                }
            }
            #[cfg(feature = "test-util")]
            Self::Manual { at, .. } => *at = to,
        }
    }

    /// Ready once the deadline has passed; otherwise registers `cx`'s waker.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            Self::Real { timer, .. } => std::pin::Pin::new(timer).poll(cx).map(drop),
            #[cfg(feature = "test-util")]
            Self::Manual { clock, id, at } => {
                if clock.poll_sleep(id, *at, cx.waker()) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

#[cfg(feature = "test-util")]
impl Drop for Sleep {
    fn drop(&mut self) {
        if let Self::Manual {
            clock,
            id: Some(id),
            ..
        } = self
        {
            clock.cancel_sleep(*id);
        }
    }
}

use std::future::Future as _;
