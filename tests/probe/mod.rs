//! Test support shared by the hand-polled tests: a waker that counts what is
//! done to it, and a way to poll a future once with a chosen waker.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

type Hook = Box<dyn Fn() + Send + Sync>;

/// The shared state behind a counting waker.
///
/// The waker is built by hand on a `RawWakerVTable` (rather than through
/// `std::task::Wake`) so that clones and drops can be counted as well as wakes.
pub(crate) struct Probe {
    wakes: AtomicUsize,
    clones: AtomicUsize,
    drops: AtomicUsize,
    on_wake: Option<Hook>,
    on_drop: Option<Hook>,
}

impl Probe {
    pub(crate) fn new() -> Arc<Self> {
        Self::build(None, None)
    }

    /// A probe whose waker runs `hook` every time it is woken.
    pub(crate) fn on_wake(hook: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Self::build(Some(Box::new(hook)), None)
    }

    /// A probe whose waker runs `hook` every time one of its handles is
    /// dropped (not when it is consumed by `wake`).
    pub(crate) fn on_drop(hook: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Self::build(None, Some(Box::new(hook)))
    }

    fn build(on_wake: Option<Hook>, on_drop: Option<Hook>) -> Arc<Self> {
        Arc::new(Self {
            wakes: AtomicUsize::new(0),
            clones: AtomicUsize::new(0),
            drops: AtomicUsize::new(0),
            on_wake,
            on_drop,
        })
    }

    /// A new waker handle (not counted as a clone).
    pub(crate) fn waker(self: &Arc<Self>) -> Waker {
        let data = Arc::into_raw(self.clone()).cast::<()>();
        // SAFETY: `data` is an `Arc<Probe>` turned into a raw pointer, which is
        // what every function of `VTABLE` expects.
        unsafe { Waker::from_raw(RawWaker::new(data, &VTABLE)) }
    }

    /// Times woken, through `wake` or `wake_by_ref`.
    pub(crate) fn wakes(&self) -> usize {
        self.wakes.load(SeqCst)
    }

    /// Times a waker handle was cloned.
    pub(crate) fn clones(&self) -> usize {
        self.clones.load(SeqCst)
    }

    /// Times a waker handle was dropped without being woken through.
    pub(crate) fn drops(&self) -> usize {
        self.drops.load(SeqCst)
    }

    /// Waker handles alive now, other than the `Arc`s the test holds itself.
    pub(crate) fn live_wakers(self: &Arc<Self>, test_refs: usize) -> usize {
        Arc::strong_count(self) - test_refs
    }

    fn woken(&self) {
        self.wakes.fetch_add(1, SeqCst);
        if let Some(hook) = &self.on_wake {
            hook();
        }
    }
}

static VTABLE: RawWakerVTable = RawWakerVTable::new(v_clone, v_wake, v_wake_by_ref, v_drop);

unsafe fn v_clone(data: *const ()) -> RawWaker {
    let probe = data.cast::<Probe>();
    // SAFETY: `data` is a live `Arc<Probe>` pointer (see `Probe::waker`).
    unsafe {
        (*probe).clones.fetch_add(1, SeqCst);
        Arc::increment_strong_count(probe);
    }
    RawWaker::new(data, &VTABLE)
}

unsafe fn v_wake(data: *const ()) {
    // SAFETY: `wake` consumes the handle, whose `Arc` count we take back.
    let probe = unsafe { Arc::from_raw(data.cast::<Probe>()) };
    probe.woken();
}

unsafe fn v_wake_by_ref(data: *const ()) {
    // SAFETY: `data` is a live `Arc<Probe>` pointer borrowed for this call.
    let probe = unsafe { &*data.cast::<Probe>() };
    probe.woken();
}

unsafe fn v_drop(data: *const ()) {
    // SAFETY: the handle is dropped, so its `Arc` count is given back.
    let probe = unsafe { Arc::from_raw(data.cast::<Probe>()) };
    probe.drops.fetch_add(1, SeqCst);
    if let Some(hook) = &probe.on_drop {
        hook();
    }
}

/// Polls `fut` once with `waker`.
pub(crate) fn poll_once<F: Future + Unpin>(fut: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(fut).poll(&mut Context::from_waker(waker))
}

/// Polls `fut` once with `waker` and expects `Pending`.
#[track_caller]
pub(crate) fn pending<F: Future + Unpin>(fut: &mut F, waker: &Waker) {
    assert!(
        poll_once(fut, waker).is_pending(),
        "expected the future to be pending"
    );
}

/// Polls `fut` once with `waker` and expects it to be ready.
#[track_caller]
pub(crate) fn ready<F: Future + Unpin>(fut: &mut F, waker: &Waker) -> F::Output {
    match poll_once(fut, waker) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("expected the future to be ready"),
    }
}
