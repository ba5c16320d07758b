//! Waiting on a plain thread: the `blocking_` methods park the calling thread
//! until its lock future is woken.
//!
//! The waker unparks the thread that waits; it is made once per thread and
//! reused, so a blocking wait allocates nothing once warm. No executor is
//! entered, so a blocking lock works on any thread, even inside another
//! executor's `block_on` (it blocks that executor's thread while it waits).

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

/// Wakes a parked thread.
struct Unparker(Thread);

impl Wake for Unparker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

thread_local! {
    static WAKER: Waker = Waker::from(Arc::new(Unparker(std::thread::current())));
}

/// Polls `future` to completion on this thread, parking between polls.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    WAKER.with(|waker| {
        let mut cx = Context::from_waker(waker);
        loop {
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                return out;
            }
            // A wake before this park leaves the thread's token set, so the
            // park returns at once: no wakeup is lost. Spurious returns just
            // poll again.
            std::thread::park();
        }
    })
}
