//! The one place a wait meets a timer.
//!
//! A [`Sleep`] wakes a waiting future at an instant: a waiter at the lease
//! deadline of the holder it waits on, or at its own timeout. A timer is only
//! an early wake-up: whoever is woken judges the time again under the shard
//! lock, so a late or lost timer delays a handoff but never breaks it.
//!
//! Real time uses the crate's own timer thread ([`crate::time::timer_driver`]),
//! which serves every table and every runtime and costs a heap push, not a
//! cross-thread wake-up, per registration. A tokio table uses tokio's timer
//! (so paused time works), a custom [`TimeSource`](crate::TimeSource) its own
//! sleeps, and the manual clock keeps its own sleepers.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::time::clock::Clock;
use crate::time::time_source::TimeSource;
use crate::time::timer_driver::{Driver, Registration, TimerState};

/// A re-armable timer bound to a table's clock.
pub(crate) enum Sleep {
    Real {
        registration: Option<Registration>,
        at: Instant,
    },
    #[cfg(feature = "tokio")]
    Tokio(Pin<Box<tokio::time::Sleep>>),
    Custom {
        source: Arc<dyn TimeSource>,
        sleep: Pin<Box<dyn Future<Output = ()> + Send + Sync>>,
        at: Instant,
        /// The sleep completed: a future that completed is never polled
        /// again, so a re-arm at the same deadline makes a new one.
        done: bool,
    },
    #[cfg(feature = "test-util")]
    Manual {
        clock: crate::time::clock::ManualClock,
        id: Option<usize>,
        at: Instant,
    },
}

impl std::fmt::Debug for Sleep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, at) = match self {
            Self::Real { at, .. } => ("real", Some(*at)),
            #[cfg(feature = "tokio")]
            Self::Tokio(sleep) => ("tokio", Some(sleep.deadline().into_std())),
            Self::Custom { at, .. } => ("custom", Some(*at)),
            #[cfg(feature = "test-util")]
            Self::Manual { at, .. } => ("manual", Some(*at)),
        };
        f.debug_struct("Sleep")
            .field("clock", &kind)
            .field("at", &at)
            .finish()
    }
}

impl Sleep {
    pub(crate) fn new(clock: &Clock, at: Instant) -> Self {
        match clock {
            Clock::Monotonic => Self::Real {
                registration: None,
                at,
            },
            #[cfg(feature = "tokio")]
            Clock::Tokio => match tokio::runtime::Handle::try_current() {
                Ok(_) => Self::Tokio(Box::pin(tokio::time::sleep_until(at.into()))),
                // Outside a runtime (a blocking lock on a plain thread): the
                // real timer, at the same instant.
                Err(_) => Self::Real {
                    registration: None,
                    at,
                },
            },
            Clock::Custom(source) => Self::Custom {
                sleep: source.sleep_until(at),
                source: source.clone(),
                at,
                done: false,
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
            // Applied by the next poll, which always follows.
            Self::Real { at, .. } => *at = to,
            #[cfg(feature = "tokio")]
            Self::Tokio(sleep) => {
                if sleep.deadline().into_std() != to {
                    sleep.as_mut().reset(to.into());
                }
            }
            Self::Custom {
                source,
                sleep,
                at,
                done,
            } => {
                // A sleep that completed while the table's clock had not
                // reached its deadline (the source's timer ran early) is
                // re-armed, never polled again.
                if *at != to || *done {
                    *at = to;
                    *done = false;
                    *sleep = source.sleep_until(to);
                }
            }
            #[cfg(feature = "test-util")]
            Self::Manual { at, .. } => *at = to,
        }
    }

    /// Ready once the deadline has passed; otherwise registers `cx`'s waker.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            Self::Real { registration, at } => poll_real(registration, *at, cx),
            #[cfg(feature = "tokio")]
            Self::Tokio(sleep) => sleep.as_mut().poll(cx),
            Self::Custom { sleep, done, .. } => {
                if *done {
                    return Poll::Ready(());
                }
                let polled = sleep.as_mut().poll(cx);
                *done = polled.is_ready();
                polled
            }
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

/// The real timer: ready once the process's timer thread fired it for `at`
/// (no clock read here: the waiter judges the time itself once woken).
fn poll_real(registration: &mut Option<Registration>, at: Instant, cx: &Context<'_>) -> Poll<()> {
    let driver = Driver::get();
    let Some(armed) = *registration else {
        // `Waker::clone` is user code: cloned before the driver locks.
        *registration = Some(driver.register(at, cx.waker().clone()));
        return Poll::Pending;
    };
    match driver.poll(armed, at, cx.waker()) {
        TimerState::Fired => {
            *registration = None;
            driver.cancel(armed);
            Poll::Ready(())
        }
        TimerState::Armed { needs_waker } => {
            if needs_waker {
                driver.set_waker(armed, cx.waker().clone());
            }
            Poll::Pending
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        match self {
            Self::Real {
                registration: Some(registration),
                ..
            } => Driver::get().cancel(*registration),
            #[cfg(feature = "test-util")]
            Self::Manual {
                clock,
                id: Some(id),
                ..
            } => clock.cancel_sleep(*id),
            _ => {}
        }
    }
}
