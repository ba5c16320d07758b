//! A hook that hostile user code (a key's `Clone`, `Hash` or `Drop`, a
//! waker's methods) runs to call back into the table and its transactions:
//! if the crate ran that code under one of its locks, the call back would
//! wait on that lock for ever (a watchdog turns that into a failure). Per
//! thread; a call back from inside the hook does nothing.
use std::cell::{Cell, RefCell};
use std::rc::Rc;

thread_local! {
    static HOOK: RefCell<Option<Rc<dyn Fn()>>> = const { RefCell::new(None) };
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
    static FIRED: Cell<usize> = const { Cell::new(0) };
}

/// Makes `hook` what [`fire`] runs on this thread.
pub(crate) fn install(hook: impl Fn() + 'static) {
    HOOK.with(|h| *h.borrow_mut() = Some(Rc::new(hook)));
}

/// No hook on this thread any more (what it holds is dropped here).
pub(crate) fn uninstall() {
    let hook = HOOK.with(|h| h.borrow_mut().take());
    drop(hook);
}

/// Runs the installed hook, unless called from inside it.
pub(crate) fn fire() {
    if IN_HOOK.get() {
        return;
    }
    let hook = HOOK.with(|h| h.borrow().clone());
    if let Some(hook) = hook {
        IN_HOOK.set(true);
        hook();
        IN_HOOK.set(false);
        FIRED.set(FIRED.get() + 1);
    }
}

/// How many times the hook ran on this thread.
pub(crate) fn fired() -> usize {
    FIRED.get()
}
