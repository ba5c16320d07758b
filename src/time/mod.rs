//! The time layer: the clocks a table reads (the real monotonic clock, the
//! test `ManualClock`, a runtime's clock) and the timers that wake waiters
//! at deadlines and leases at their end. It knows nothing of keys.

pub(crate) mod clock;
pub(crate) mod time_source;
pub(crate) mod timer;
pub(crate) mod timer_driver;
