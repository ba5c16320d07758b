//! Hostile callers: keys, wakers and futures that misbehave in every way a
//! caller can make them misbehave without `unsafe`, and what the table must
//! still guarantee when they do.
//!
//! Each test pins one bug. A key whose `Drop` or `Eq` panics, a waker whose
//! `wake`, `clone` or `drop` panics or calls back into the table, a future
//! that is forgotten while it holds a grant, a clock advanced by
//! `Duration::MAX`, keys whose `Eq` disagrees with their `Hash`: none of them
//! may orphan a waiter's registration, strand a key, swallow another waiter's
//! wake, surface in an innocent caller's release, or deadlock the table.
//!
//! Three tests pin intended semantics that differ from the documented
//! behaviour they replace: a waiter granted the key whose grant lapses or is
//! revoked before its future runs is fenced like a guard (it resolves, when
//! it runs, to a guard whose `check()` fails with `LockError::Expired`)
//! instead of going back to the tail of the queue.
//!
//! How the tests are written:
//!
//! - Every future is polled by hand with a [`Hostile`] waker that records its
//!   wakes and can be told to panic on its next wake or drop, to panic on
//!   every clone, or to call back into the table from `clone`. Time is a
//!   [`ManualClock`]. Nothing sleeps, nothing races: each interleaving is
//!   exact. Futures are boxed (`Box::pin`), so nothing here depends on
//!   whether the table's futures are `Unpin`.
//! - Every panic provoked on purpose carries a [`Planted`] payload, so that a
//!   test can tell it from a panic of the table's own (an assertion, "polled
//!   after it completed"), and so that the panic hook stays quiet about it.
//!   A planted bomb never goes off while its thread is already unwinding, so
//!   a failing assertion cannot turn into an abort of the whole binary.
//! - Every test body runs under a [`watchdog`]: a deadlock (user code run
//!   under a shard lock that calls back into the table) fails the test after
//!   [`WATCHDOG`] instead of blocking the suite. It detects hangs only; no
//!   test depends on timing.
//! - After each scenario the test checks that nothing is stranded: waiter
//!   counts, `len()`, the key can be taken again, other keys still work, and
//!   `assert_consistent()` holds.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(all(feature = "test-util", not(loom)))]
mod tests {
    use std::any::Any;
    use std::fmt;
    use std::future::Future;
    use std::hash::{BuildHasher, Hash, Hasher};
    use std::panic::{catch_unwind, panic_any, resume_unwind, AssertUnwindSafe};
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
    use std::sync::{mpsc, Arc, Mutex, Once};
    use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
    use std::thread;
    use std::time::Duration;

    use keylock::{LockError, LockOptions, LockTable, ManualClock, Mode, TransactionOptions};

    /// How long a test body may run before it is declared hung.
    const WATCHDOG: Duration = Duration::from_secs(20);

    /// The lease of every leased grant in this file.
    const LEASE: Duration = Duration::from_secs(10);

    fn leased() -> LockOptions {
        LockOptions::new().lease(LEASE)
    }

    // ---------------------------------------------------------------------------
    // Planted panics, the watchdog, polling by hand.
    // ---------------------------------------------------------------------------

    /// The payload of every panic this file provokes on purpose; names the
    /// callback that panicked.
    #[derive(Debug)]
    struct Planted(&'static str);

    /// Panics with a [`Planted`] payload, unless the thread is already unwinding
    /// (a second panic would abort the whole test binary): then it returns and
    /// the callback behaves.
    fn plant(what: &'static str) {
        if !thread::panicking() {
            panic_any(Planted(what));
        }
    }

    /// Keeps the default panic hook quiet about planted panics.
    fn quiet_planted_panics() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if !info.payload().is::<Planted>() {
                    default(info);
                }
            }));
        });
    }

    fn message(payload: &(dyn Any + Send)) -> String {
        if let Some(planted) = payload.downcast_ref::<Planted>() {
            format!("planted panic in {}", planted.0)
        } else if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "a panic with a non-string payload".to_owned()
        }
    }

    /// The panic `payload` must be a planted one; returns which callback it was.
    #[track_caller]
    fn expect_planted(payload: Box<dyn Any + Send>, what: &str) -> &'static str {
        match payload.downcast::<Planted>() {
            Ok(planted) => planted.0,
            Err(other) => panic!(
                "{what}: expected at most a planted panic, got the table's own: {}",
                message(&*other)
            ),
        }
    }

    /// Runs `body` on its own thread and fails if it does not finish within
    /// [`WATCHDOG`] (a hang detector, not a timing assertion).
    fn watchdog(name: &'static str, body: impl FnOnce() + Send + 'static) {
        quiet_planted_panics();
        let (done, finished) = mpsc::channel::<()>();
        let worker = thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                body();
                let _ = done.send(());
            })
            .expect("spawn the test body");
        match finished.recv_timeout(WATCHDOG) {
            Ok(()) => worker.join().expect("the body finished"),
            Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
                Err(payload) if payload.is::<Planted>() => panic!(
                    "{name}: a {} escaped where the table must not let it out",
                    message(&*payload)
                ),
                Err(payload) => resume_unwind(payload),
                Ok(()) => unreachable!("the body ended without reporting"),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "{name}: still running after {WATCHDOG:?}: the table deadlocked (user code \
             called back into it under a shard lock) or livelocked; the stuck thread is \
             abandoned"
            ),
        }
    }

    /// Polls `fut` once with `waker`, catching a panic.
    fn poll_caught<F: Future + Unpin>(
        fut: &mut F,
        waker: &Waker,
    ) -> Result<Poll<F::Output>, Box<dyn Any + Send>> {
        catch_unwind(AssertUnwindSafe(|| {
            Pin::new(&mut *fut).poll(&mut Context::from_waker(waker))
        }))
    }

    /// Polls `fut` once and expects it to be ready.
    #[track_caller]
    fn ready<F: Future + Unpin>(fut: &mut F, waker: &Waker, what: &str) -> F::Output {
        match poll_caught(fut, waker) {
            Ok(Poll::Ready(out)) => out,
            Ok(Poll::Pending) => panic!("{what}: expected the future to be ready, it is pending"),
            Err(payload) => panic!(
                "{what}: expected the future to be ready, its poll panicked: {}",
                message(&*payload)
            ),
        }
    }

    /// Polls `fut` once and expects it to be pending.
    #[track_caller]
    fn pending<F: Future + Unpin>(fut: &mut F, waker: &Waker, what: &str) {
        match poll_caught(fut, waker) {
            Ok(Poll::Pending) => {}
            Ok(Poll::Ready(_)) => panic!("{what}: expected the future to be pending, it is ready"),
            Err(payload) => panic!(
                "{what}: expected the future to be pending, its poll panicked: {}",
                message(&*payload)
            ),
        }
    }

    /// Polls `fut` once: it may panic with a planted panic (the hostile callback
    /// ran inside the poll); otherwise it must be pending. Returns the planted
    /// panic's callback, if one surfaced.
    #[track_caller]
    fn pending_or_planted<F: Future + Unpin>(
        fut: &mut F,
        waker: &Waker,
        what: &str,
    ) -> Option<&'static str> {
        match poll_caught(fut, waker) {
            Ok(Poll::Pending) => None,
            Ok(Poll::Ready(_)) => panic!("{what}: resolved, but the key was not free"),
            Err(payload) => Some(expect_planted(payload, what)),
        }
    }

    /// Runs `op`, which may panic with a planted panic but must not panic
    /// otherwise; returns its result if it did not panic.
    #[track_caller]
    fn planted_or<R>(what: &str, op: impl FnOnce() -> R) -> Option<R> {
        match catch_unwind(AssertUnwindSafe(op)) {
            Ok(out) => Some(out),
            Err(payload) => {
                expect_planted(payload, what);
                None
            }
        }
    }

    /// A table (from `builder`, on a manual clock) whose key `key` is held
    /// by a grant whose lease has lapsed and whose loss watcher's wake
    /// panics: runs `take` on it, then lets the holder and its watcher go.
    /// Returns the table and how many times the wake panicked.
    fn over_a_lapsed_holder(
        builder: keylock::Builder<u32>,
        key: u32,
        take: impl FnOnce(&Arc<LockTable<u32>>),
    ) -> (Arc<LockTable<u32>>, usize) {
        let clock = ManualClock::new();
        let table = Arc::new(builder.clock(clock.clone()).build());
        let holder = table.try_lock_with(key, leased()).expect("free");
        let watcher = Hostile::new();
        let waker = watcher.waker();
        let mut lost = Box::pin(holder.lost());
        pending(&mut lost, &waker, "the holder's loss watcher");
        clock.advance(LEASE);
        watcher.arm_wake_panic();
        take(&table);
        drop(lost);
        drop(holder);
        (table, watcher.wake_panics())
    }

    /// Runs `op`, which must not panic at all.
    #[track_caller]
    fn no_panic<R>(what: &str, op: impl FnOnce() -> R) -> R {
        match catch_unwind(AssertUnwindSafe(op)) {
            Ok(out) => out,
            Err(payload) => panic!("{what}: must not panic, but did: {}", message(&*payload)),
        }
    }

    // ---------------------------------------------------------------------------
    // Nothing stranded.
    // ---------------------------------------------------------------------------

    /// The key made by `key` is neither held nor awaited and can be taken again.
    #[track_caller]
    fn assert_key_free<K: Eq + Hash, S: BuildHasher>(
        table: &LockTable<K, S>,
        key: impl Fn() -> K,
        what: &str,
    ) {
        table.assert_consistent();
        assert_eq!(table.waiters(&key()), 0, "{what}: nobody waits for the key");
        assert!(!table.is_locked(&key()), "{what}: nobody holds the key");
        let again = table.try_lock(key());
        assert!(
            again.is_ok(),
            "{what}: the key is stranded: try_lock fails with nobody holding or awaiting it"
        );
        drop(again);
        table.assert_consistent();
    }

    /// The table keeps nothing, and a key it never saw works.
    #[track_caller]
    fn assert_table_empty<K: Eq + Hash, S: BuildHasher>(
        table: &LockTable<K, S>,
        fresh: K,
        what: &str,
    ) {
        table.assert_consistent();
        assert_eq!(table.len(), 0, "{what}: an entry was left behind");
        assert!(table.is_empty(), "{what}: is_empty agrees with len");
        let guard = table.try_lock(fresh);
        assert!(guard.is_ok(), "{what}: a fresh key can be taken");
        assert_eq!(table.len(), 1, "{what}: the fresh key is the only entry");
        drop(guard);
        assert_eq!(table.len(), 0, "{what}: the fresh key is released");
        table.assert_consistent();
    }

    // ---------------------------------------------------------------------------
    // A hostile waker.
    // ---------------------------------------------------------------------------

    type Hook = Box<dyn Fn() + Send + Sync>;

    /// The state shared by every handle of one hostile waker: what was done to
    /// it, and how it misbehaves.
    #[derive(Default)]
    struct Hostile {
        /// Wakes delivered (a wake that panicked is not one).
        wakes: AtomicUsize,
        clones: AtomicUsize,
        wake_panics: AtomicUsize,
        drop_panics: AtomicUsize,
        /// The next wake panics (once).
        wake_armed: AtomicBool,
        /// The next drop of a handle panics (once).
        drop_armed: AtomicBool,
        /// Every clone panics while set.
        clone_armed: AtomicBool,
        /// Run by every clone, before it returns (for re-entrance).
        on_clone: Option<Hook>,
        /// Run by every wake, before it is counted (for re-entrance).
        on_wake: Option<Hook>,
    }

    impl Hostile {
        fn new() -> Arc<Self> {
            Arc::new(Self::default())
        }

        /// A waker whose every clone runs `hook` first.
        fn on_clone(hook: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
            Arc::new(Self {
                on_clone: Some(Box::new(hook)),
                ..Self::default()
            })
        }

        /// A waker whose every wake runs `hook` first.
        fn on_wake(hook: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
            Arc::new(Self {
                on_wake: Some(Box::new(hook)),
                ..Self::default()
            })
        }

        /// A new handle (not counted as a clone, and runs no hook).
        fn waker(self: &Arc<Self>) -> Waker {
            let data = Arc::into_raw(self.clone()).cast::<()>();
            // SAFETY: `data` is an `Arc<Hostile>` turned into a raw pointer, which
            // is what every function of `VTABLE` expects.
            unsafe { Waker::from_raw(RawWaker::new(data, &VTABLE)) }
        }

        fn arm_wake_panic(&self) {
            self.wake_armed.store(true, SeqCst);
        }

        fn arm_drop_panic(&self) {
            self.drop_armed.store(true, SeqCst);
        }

        fn disarm_drop_panic(&self) {
            self.drop_armed.store(false, SeqCst);
        }

        fn arm_clone_panic(&self) {
            self.clone_armed.store(true, SeqCst);
        }

        fn disarm_clone_panic(&self) {
            self.clone_armed.store(false, SeqCst);
        }

        fn wakes(&self) -> usize {
            self.wakes.load(SeqCst)
        }

        fn wake_panics(&self) -> usize {
            self.wake_panics.load(SeqCst)
        }

        fn drop_panics(&self) -> usize {
            self.drop_panics.load(SeqCst)
        }

        fn woken(&self) {
            if let Some(hook) = &self.on_wake {
                hook();
            }
            if self.wake_armed.swap(false, SeqCst) && !thread::panicking() {
                self.wake_panics.fetch_add(1, SeqCst);
                plant("Waker::wake");
            }
            self.wakes.fetch_add(1, SeqCst);
        }
    }

    static VTABLE: RawWakerVTable = RawWakerVTable::new(v_clone, v_wake, v_wake_by_ref, v_drop);

    unsafe fn v_clone(data: *const ()) -> RawWaker {
        // SAFETY: `data` is a live `Arc<Hostile>` pointer borrowed for this call.
        let hostile = unsafe { &*data.cast::<Hostile>() };
        if let Some(hook) = &hostile.on_clone {
            hook();
        }
        if hostile.clone_armed.load(SeqCst) && !thread::panicking() {
            // Before the count is taken: the panicking clone leaks nothing.
            plant("Waker::clone");
        }
        hostile.clones.fetch_add(1, SeqCst);
        // SAFETY: as above; the new handle owns the count taken here.
        unsafe { Arc::increment_strong_count(data.cast::<Hostile>()) };
        RawWaker::new(data, &VTABLE)
    }

    unsafe fn v_wake(data: *const ()) {
        // SAFETY: `wake` consumes the handle, whose count is given back when
        // `hostile` drops (also if `woken` panics).
        let hostile = unsafe { Arc::from_raw(data.cast::<Hostile>()) };
        hostile.woken();
    }

    unsafe fn v_wake_by_ref(data: *const ()) {
        // SAFETY: `data` is a live `Arc<Hostile>` pointer borrowed for this call.
        let hostile = unsafe { &*data.cast::<Hostile>() };
        hostile.woken();
    }

    unsafe fn v_drop(data: *const ()) {
        // SAFETY: the handle is dropped, so its count is given back (also if the
        // planted panic fires).
        let hostile = unsafe { Arc::from_raw(data.cast::<Hostile>()) };
        if hostile.drop_armed.swap(false, SeqCst) && !thread::panicking() {
            hostile.drop_panics.fetch_add(1, SeqCst);
            plant("Waker::drop");
        }
    }

    // ---------------------------------------------------------------------------
    // Hostile keys.
    // ---------------------------------------------------------------------------

    type DropHook = Box<dyn FnOnce() + Send + Sync>;

    /// A key compared and hashed by `id` alone. The other fields make one
    /// instance hostile without changing which key it is.
    struct Key {
        id: u32,
        /// Dropping this instance panics (after running `on_drop`).
        drop_panics: bool,
        /// Comparing this instance with any key panics.
        eq_panics: bool,
        /// Hashing this instance panics.
        hash_panics: bool,
        on_drop: Option<DropHook>,
    }

    impl Key {
        fn plain(id: u32) -> Self {
            Self {
                id,
                drop_panics: false,
                eq_panics: false,
                hash_panics: false,
                on_drop: None,
            }
        }

        /// A duplicate of key `id` whose drop counts itself in `drops`, then
        /// panics.
        fn drop_bomb(id: u32, drops: &Arc<AtomicUsize>) -> Self {
            let drops = drops.clone();
            Self {
                id,
                drop_panics: true,
                eq_panics: false,
                hash_panics: false,
                on_drop: Some(Box::new(move || {
                    drops.fetch_add(1, SeqCst);
                })),
            }
        }

        /// Key `id`, whose `Eq` panics and whose drop runs `on_drop`.
        fn eq_bomb(id: u32, on_drop: impl FnOnce() + Send + Sync + 'static) -> Self {
            Self {
                id,
                drop_panics: false,
                eq_panics: true,
                hash_panics: false,
                on_drop: Some(Box::new(on_drop)),
            }
        }
    }

    impl Key {
        /// Key `id`, whose `Hash` panics.
        fn hash_bomb(id: u32) -> Self {
            Self {
                id,
                drop_panics: false,
                eq_panics: false,
                hash_panics: true,
                on_drop: None,
            }
        }
    }

    /// A plain copy (a `lock_all` needs `Clone`): the same key, not hostile.
    impl Clone for Key {
        fn clone(&self) -> Self {
            Self::plain(self.id)
        }
    }

    impl PartialOrd for Key {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }

    impl Ord for Key {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.id.cmp(&other.id)
        }
    }

    impl PartialEq for Key {
        fn eq(&self, other: &Self) -> bool {
            if self.eq_panics || other.eq_panics {
                plant("Key::eq");
            }
            self.id == other.id
        }
    }

    impl Eq for Key {}

    impl Hash for Key {
        fn hash<H: Hasher>(&self, state: &mut H) {
            if self.hash_panics {
                plant("Key::hash");
            }
            self.id.hash(state);
        }
    }

    impl Drop for Key {
        fn drop(&mut self) {
            if let Some(hook) = self.on_drop.take() {
                hook();
            }
            if self.drop_panics {
                plant("Key::drop");
            }
        }
    }

    impl fmt::Debug for Key {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("Key").field(&self.id).finish()
        }
    }

    /// A hasher under which every key collides: one shard, one hash, so a lookup
    /// compares the caller's key with every key of the shard.
    #[derive(Clone, Copy, Debug, Default)]
    struct Collide;

    struct ConstHasher;

    impl Hasher for ConstHasher {
        fn finish(&self) -> u64 {
            0x5a5a_5a5a_5a5a_5a5a
        }

        fn write(&mut self, _: &[u8]) {}
    }

    impl BuildHasher for Collide {
        type Hasher = ConstHasher;

        fn build_hasher(&self) -> ConstHasher {
            ConstHasher
        }
    }

    // ---------------------------------------------------------------------------
    // 1. A key whose `Drop` panics.
    // ---------------------------------------------------------------------------

    /// The caller's key duplicates one the table already keeps, so the table drops
    /// the caller's copy while queueing it; that drop panics. The future must
    /// still own its registration: granted on release, or cancelled when dropped.
    #[test]
    fn a_key_whose_drop_panics_while_queueing_still_owns_its_slot() {
        watchdog("drop-panics-while-queueing", || {
            let table: LockTable<Key> = LockTable::new();
            let drops = Arc::new(AtomicUsize::new(0));
            let probe = Hostile::new();
            let waker = probe.waker();

            // The waiter is granted when the holder releases.
            let held = table.try_lock(Key::plain(1)).expect("key 1 is free");
            let mut fut = Box::pin(table.lock(Key::drop_bomb(1, &drops)));
            pending_or_planted(&mut fut, &waker, "queueing behind the holder");
            assert_eq!(
                table.waiters(&Key::plain(1)),
                1,
                "the future still owns its registration after its key panicked on drop"
            );
            drop(held);
            let guard = ready(
                &mut fut,
                &waker,
                "the waiter whose key panicked on drop is granted on release",
            );
            assert_eq!(guard.key().id, 1);
            assert!(table.is_locked(&Key::plain(1)));
            drop(guard);
            drop(fut);
            assert_key_free(&table, || Key::plain(1), "after the grant");

            // The waiter is dropped instead: its registration goes with it.
            let held = table.try_lock(Key::plain(2)).expect("key 2 is free");
            let mut fut = Box::pin(table.lock(Key::drop_bomb(2, &drops)));
            pending_or_planted(&mut fut, &waker, "queueing behind the holder");
            assert_eq!(
                table.waiters(&Key::plain(2)),
                1,
                "the future still owns its registration after its key panicked on drop"
            );
            drop(fut);
            assert_eq!(
                table.waiters(&Key::plain(2)),
                0,
                "dropping the future removed its registration"
            );
            assert_eq!(table.len(), 1, "only the holder's entry is left");
            drop(held);
            assert_key_free(&table, || Key::plain(2), "after the waiter was dropped");

            assert_eq!(
                drops.load(SeqCst),
                2,
                "each duplicate key was dropped exactly once"
            );
            assert_table_empty(&table, Key::plain(3), "after both waiters");
        });
    }

    /// A key stored in the table whose `Drop` panics, released by a guard
    /// nobody waits behind: the inline release removes the entry, unlocks,
    /// and only then drops the key, so the panic reaches the releaser with
    /// the table already consistent (no entry, shard unlocked, key free).
    #[test]
    fn a_stored_key_whose_drop_panics_on_a_lone_release_strands_nothing() {
        watchdog("drop-panics-on-lone-release", || {
            let table: LockTable<Key> = LockTable::new();
            let drops = Arc::new(AtomicUsize::new(0));
            let waker = Hostile::new().waker();
            for (round, id) in [(0, 5), (1, 6)] {
                let guard = if round == 0 {
                    table.try_lock(Key::drop_bomb(id, &drops)).expect("free")
                } else {
                    let mut fut = Box::pin(table.lock(Key::drop_bomb(id, &drops)));
                    ready(&mut fut, &waker, "an uncontended lock")
                };
                assert!(table.is_locked(&Key::plain(id)));
                let released = catch_unwind(AssertUnwindSafe(|| drop(guard)));
                let payload = released.expect_err("the key's drop panics in the release");
                assert_eq!(expect_planted(payload, "lone release"), "Key::drop");
                assert_eq!(drops.load(SeqCst), round + 1, "the key was dropped once");
                assert_eq!(table.len(), 0, "the entry left before the key was dropped");
                assert_key_free(&table, || Key::plain(id), "after the panicking release");
            }
            assert_table_empty(&table, Key::plain(7), "after both releases");
        });
    }

    // ---------------------------------------------------------------------------
    // 2. A waker whose `wake` panics, woken by an innocent caller.
    // ---------------------------------------------------------------------------

    /// The context-free handoff (a lone exclusive holder lets go, the head
    /// waits exclusively, with or without a lease): the head's wake runs
    /// after the unlock. A wake that panics reaches the releaser with the key
    /// already the head's; a wake that re-enters the table finds it unlocked
    /// (no deadlock) and the key held by the head.
    #[test]
    fn a_plain_handoffs_panicking_or_reentering_wake_runs_unlocked_and_loses_nothing() {
        watchdog("plain-handoff-wake", || {
            for leased_head in [false, true] {
                let table: Arc<LockTable<u32>> = Arc::new(LockTable::new());
                let opts = if leased_head {
                    leased()
                } else {
                    LockOptions::new()
                };
                if leased_head {
                    // A wait with a timeout arms the shard's timer (before
                    // the leases below end), so that a leased handoff finds
                    // its deadline covered and takes the context-free path.
                    let holder = table.try_lock(1).expect("free");
                    let timed = LockOptions::new().timeout(LEASE / 2);
                    let mut armer = Box::pin(table.lock_with(1, timed));
                    pending(&mut armer, &Hostile::new().waker(), "a timed waiter");
                    drop(armer);
                    drop(holder);
                }
                // A wake that panics.
                let hostile = Hostile::new();
                let holder = table.try_lock(1).expect("free");
                let mut head = Box::pin(table.lock_with(1, opts));
                pending(&mut head, &hostile.waker(), "behind the holder");
                hostile.arm_wake_panic();
                let released = catch_unwind(AssertUnwindSafe(|| drop(holder)));
                let payload = released.expect_err("the head's wake panics in the release");
                assert_eq!(expect_planted(payload, "handoff wake"), "Waker::wake");
                assert_eq!(hostile.wake_panics(), 1);
                assert!(table.is_locked(&1), "the key went to the head");
                assert!(table.try_lock(1).is_err(), "and nobody else may take it");
                let guard =
                    ready(&mut head, &Hostile::new().waker(), "the granted head").expect("granted");
                drop(guard);
                drop(head);
                assert_key_free(&table, || 1, "after the panicking wake");

                // A wake that re-enters the table: it must find the shard
                // unlocked, and the key the head's.
                let seen = Arc::new(Mutex::new(None));
                let reenter = {
                    let (table, seen) = (Arc::clone(&table), Arc::clone(&seen));
                    Hostile::on_wake(move || {
                        *seen.lock().unwrap() = Some(table.try_lock(1).is_err());
                    })
                };
                let holder = table.try_lock(1).expect("free");
                let mut head = Box::pin(table.lock_with(1, opts));
                pending(&mut head, &reenter.waker(), "behind the holder");
                drop(holder);
                assert_eq!(reenter.wakes(), 1, "the head was woken once");
                assert_eq!(
                    *seen.lock().unwrap(),
                    Some(true),
                    "inside the wake the key was already the head's"
                );
                let guard =
                    ready(&mut head, &reenter.waker(), "the granted head").expect("granted");
                drop(guard);
                drop(head);
                assert_table_empty(&table, 2, "after the re-entering wake");
            }
        });
    }

    /// W waits behind a leased holder whose lease lapses. An innocent caller
    /// touches the key, settles the lapse and grants W, whose wake panics inside
    /// the innocent call. W must keep its grant and the innocent caller must be
    /// left validly queued (or told no), never orphaned.
    #[test]
    fn a_panicking_wake_during_an_innocent_callers_lapse_settlement_loses_nothing() {
        watchdog("wake-panics-in-innocent-call", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();

            // The innocent caller is a lock future.
            let holder = table.try_lock_with(1, leased()).expect("key 1 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut w = Box::pin(table.lock_with(1, leased()));
            pending(&mut w, &ww, "W queues behind the leased holder");
            clock.advance(LEASE);
            pw.arm_wake_panic();
            let pi = Hostile::new();
            let wi = pi.waker();
            let mut innocent = Box::pin(table.lock(1));
            pending_or_planted(&mut innocent, &wi, "the innocent lock queues behind W");
            assert_eq!(
                pw.wake_panics(),
                1,
                "precondition: the innocent lock settled the lapse and woke W"
            );
            assert!(holder.is_expired(), "the lapsed holder is fenced");
            assert_eq!(
                table.waiters(&1),
                1,
                "the innocent future is still queued, behind W"
            );
            let gw = ready(&mut w, &ww, "W still owns the grant whose wake panicked")
                .expect("no timeout was set");
            assert!(gw.token() > holder.token(), "W's grant is newer");
            assert!(!gw.is_expired());
            pending(
                &mut innocent,
                &wi,
                "the innocent future still waits, with its registration",
            );
            drop(gw);
            assert!(
                pi.wakes() >= 1,
                "the innocent waiter was woken by W's release"
            );
            let gi = ready(&mut innocent, &wi, "the innocent future is granted next");
            drop(holder);
            assert!(!gi.is_expired());
            drop(gi);
            assert_key_free(&table, || 1, "innocent lock");

            // The innocent call is the lapsed holder's own `check()`.
            let holder = table.try_lock_with(2, leased()).expect("key 2 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut w = Box::pin(table.lock_with(2, leased()));
            pending(&mut w, &ww, "W queues behind the leased holder");
            clock.advance(LEASE);
            pw.arm_wake_panic();
            if let Some(checked) = planted_or("the lapsed holder's check()", || holder.check()) {
                assert_eq!(
                    checked,
                    Err(LockError::Expired {
                        token: holder.token(),
                        key: None,
                    })
                );
            }
            assert_eq!(
                pw.wake_panics(),
                1,
                "precondition: check() settled and woke W"
            );
            let gw = ready(&mut w, &ww, "W still owns the grant whose wake panicked")
                .expect("no timeout was set");
            assert!(gw.token() > holder.token());
            assert!(table.try_lock(2).is_err(), "W holds the key");
            drop(gw);
            drop(holder);
            assert_key_free(&table, || 2, "innocent check()");

            // The innocent call is a `try_lock`: it must not take the key W got.
            let holder = table.try_lock_with(3, leased()).expect("key 3 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut w = Box::pin(table.lock_with(3, leased()));
            pending(&mut w, &ww, "W queues behind the leased holder");
            clock.advance(LEASE);
            pw.arm_wake_panic();
            if let Some(taken) = planted_or("an innocent try_lock", || table.try_lock(3).is_ok()) {
                assert!(!taken, "try_lock took the key that was just granted to W");
            }
            assert_eq!(
                pw.wake_panics(),
                1,
                "precondition: try_lock settled and woke W"
            );
            let gw = ready(&mut w, &ww, "W still owns the grant whose wake panicked")
                .expect("no timeout was set");
            assert!(gw.token() > holder.token());
            drop(gw);
            drop(holder);
            assert_key_free(&table, || 3, "innocent try_lock");

            assert_table_empty(&table, 4, "after the three innocent callers");
        });
    }

    // ---------------------------------------------------------------------------
    // 3. A re-poll whose old waker's `drop` panics.
    // ---------------------------------------------------------------------------

    /// A waiting future is re-polled with a new waker; dropping the waker it
    /// replaces panics. The re-poll may panic, but the future must keep its
    /// registration.
    #[test]
    fn a_panicking_wake_in_a_trys_lapse_settlement_releases_the_grant_it_made() {
        watchdog("wake-panics-in-a-try", || {
            type Try = fn(&Arc<LockTable<u32>>, u32);
            // Each way to take a key at once: the try settles the lapsed
            // holder (waking its loss watcher, which panics) and grants the
            // key before any guard owns it.
            let tries: [(&str, Try); 7] = [
                ("try_lock", |t, k| drop(t.try_lock(k))),
                ("try_lock_with", |t, k| {
                    drop(t.try_lock_with(k, LockOptions::new()))
                }),
                ("a transaction's lock", |t, k| {
                    let mut txn = t.transaction();
                    drop(poll_once(txn.lock(k, Mode::Exclusive)));
                }),
                ("a transaction's lock_all of one key", |t, k| {
                    let mut txn = t.transaction();
                    drop(poll_once(txn.lock_all([(k, Mode::Exclusive)])));
                }),
                ("a transaction's lock_all of two keys", |t, k| {
                    let mut txn = t.transaction();
                    drop(poll_once(txn.lock_all([
                        (k, Mode::Exclusive),
                        (k + 1000, Mode::Exclusive),
                    ])));
                }),
                ("a transaction's lock_all of three keys", |t, k| {
                    let mut txn = t.transaction();
                    let keys = [k + 2000, k, k + 1000].map(|k| (k, Mode::Shared));
                    drop(poll_once(txn.lock_all(keys)));
                }),
                ("an owned transaction's lock", |t, k| {
                    let txn = Arc::clone(t).transaction_owned();
                    drop(poll_once(txn.lock(k, Mode::Exclusive)));
                }),
            ];
            for (key, (what, try_it)) in (1..).zip(tries) {
                let builder = LockTable::builder();
                let (table, wake_panics) = over_a_lapsed_holder(builder, key, |table| {
                    let done = planted_or(what, || try_it(table, key));
                    assert!(done.is_none(), "{what}: the watcher's wake panicked");
                });
                assert_eq!(wake_panics, 1, "{what}: the lapse was settled");
                for k in [key, key + 1000, key + 2000] {
                    assert_key_free(&table, || k, what);
                }
            }
        });
    }

    /// Every way to take a key at once over a lapsed holder whose loss
    /// watcher's wake panics (the wake runs after the unlock, once the
    /// grant is made and before any guard owns it) releases the grant it
    /// made: `blocking_lock`'s spin on an eventual table left it held for
    /// good.
    #[test]
    fn every_take_at_once_over_a_lapsed_holder_releases_the_grant_if_a_loss_wake_panics() {
        watchdog("every-take-over-a-lapsed-holder", || {
            type Try = fn(&Arc<LockTable<u32>>, u32);
            let tries: [(&str, bool, Try); 12] = [
                ("blocking_lock (eventual, spin)", true, |t, k| {
                    drop(t.blocking_lock(k))
                }),
                ("blocking_lock_owned (eventual)", true, |t, k| {
                    drop(Arc::clone(t).blocking_lock_owned(k))
                }),
                ("lock poll (eventual)", true, |t, k| {
                    drop(poll_once(t.lock(k)))
                }),
                ("lock poll", false, |t, k| drop(poll_once(t.lock(k)))),
                ("lock_owned poll", false, |t, k| {
                    drop(poll_once(Arc::clone(t).lock_owned(k)))
                }),
                ("lock_shared poll", false, |t, k| {
                    drop(poll_once(t.lock_shared(k)))
                }),
                ("try_lock_shared", false, |t, k| drop(t.try_lock_shared(k))),
                ("try_lock_owned", false, |t, k| {
                    drop(Arc::clone(t).try_lock_owned(k))
                }),
                ("lock_with zero timeout", false, |t, k| {
                    drop(poll_once(
                        t.lock_with(k, LockOptions::new().timeout(Duration::ZERO)),
                    ))
                }),
                ("lock_with timeout", false, |t, k| {
                    drop(poll_once(t.lock_with(
                        k,
                        LockOptions::new().timeout(Duration::from_secs(100)),
                    )))
                }),
                (
                    "an owned transaction's lock_all of two keys",
                    false,
                    |t, k| {
                        let txn = Arc::clone(t).transaction_owned();
                        drop(poll_once(txn.lock_all([
                            (k, Mode::Exclusive),
                            (k + 1000, Mode::Exclusive),
                        ])));
                    },
                ),
                ("a transaction's blocking_lock", false, |t, k| {
                    let mut txn = t.transaction();
                    drop(txn.blocking_lock(k, Mode::Exclusive));
                }),
            ];
            let mut failed = Vec::new();
            for (key, (what, eventual, try_it)) in (1..).zip(tries) {
                let mut builder = LockTable::builder();
                if eventual {
                    builder = builder.fairness(keylock::Fairness::Eventual);
                }
                let (table, _) = over_a_lapsed_holder(builder, key, |table| {
                    drop(catch_unwind(AssertUnwindSafe(|| try_it(table, key))));
                });
                if [key, key + 1000]
                    .iter()
                    .any(|&k| table.try_lock(k).is_err())
                    || !table.is_empty()
                {
                    failed.push(what);
                }
            }
            assert!(failed.is_empty(), "stranded: {failed:?}");
        });
    }

    /// A fresh transaction's transfer whose second try panics (it settles
    /// a lapsed holder of the second key, whose loss watcher's wake
    /// panics), after the first key went into the set: the first comes
    /// back out and is released as the call unwinds, so the transaction
    /// holds nothing of the call (all or nothing), and the second is free.
    #[test]
    fn a_fresh_transfer_whose_second_try_panics_keeps_nothing_of_the_first() {
        watchdog("second-try-panics", || {
            let clock = ManualClock::new();
            let table: Arc<LockTable<u32>> =
                Arc::new(LockTable::builder().clock(clock.clone()).build());
            let holder = table.try_lock_with(2, leased()).expect("free");
            let watcher = Hostile::new();
            let waker = watcher.waker();
            let mut lost = Box::pin(holder.lost());
            pending(&mut lost, &waker, "the holder's loss watcher");
            clock.advance(LEASE);
            watcher.arm_wake_panic();
            let mut txn = table.transaction();
            // Given out of order: 1 is taken first, then 2's try panics.
            let done = planted_or("a transfer whose second try panics", || {
                poll_once(txn.lock_all([(2, Mode::Exclusive), (1, Mode::Exclusive)])).is_ready()
            });
            assert!(done.is_none(), "the watcher's wake panicked");
            assert_eq!(watcher.wake_panics(), 1, "2's lapse was settled");
            assert!(txn.is_empty(), "1 came back out of the set");
            assert!(!table.is_locked(&1), "and was released");
            drop(txn);
            drop(lost);
            drop(holder);
            assert_key_free(&table, || 1, "the first key");
            assert_key_free(&table, || 2, "the second key");
        });
    }

    /// A guard dropped while its thread unwinds hands the key to a waiter
    /// whose wake panics (always, also during an unwind, unlike the
    /// [`Hostile`] waker): the panic is swallowed there (a second panic
    /// while unwinding would abort the process), the first goes on, and
    /// the waiter keeps its grant.
    #[test]
    fn a_guard_dropped_while_unwinding_survives_a_handoff_wake_that_panics() {
        struct AlwaysPanics;
        impl std::task::Wake for AlwaysPanics {
            fn wake(self: Arc<Self>) {
                panic_any(Planted("waker wake, while unwinding"));
            }
        }
        watchdog("handoff-wake-while-unwinding", || {
            let table: LockTable<u32> = LockTable::new();
            let guard = table.try_lock(1).expect("free");
            let waker = Waker::from(Arc::new(AlwaysPanics));
            let mut next = Box::pin(table.lock(1));
            pending(&mut next, &waker, "a waiter whose wake panics");
            let unwound = catch_unwind(AssertUnwindSafe(|| {
                let _guard = guard;
                panic_any(Planted("the holder's own panic"));
            }));
            let first = expect_planted(unwound.expect_err("planted"), "the holder");
            assert_eq!(first, "the holder's own panic");
            let granted = ready(&mut next, Waker::noop(), "the waiter has 1");
            drop((granted, next));
            assert_key_free(&table, || 1, "the handed-off key");
        });
    }

    /// A `release_hold` whose key's `Eq` panics keeps the hold on record:
    /// a later release with a well-behaved key frees it (it was taken off
    /// the record before the compare, and lost with the panic).
    #[test]
    fn a_release_hold_whose_eq_panics_keeps_the_hold() {
        watchdog("release-hold-eq-panics", || {
            let table: LockTable<Key> = LockTable::new();
            let mut txn = table.transaction();
            let got = poll_once(txn.lock(Key::plain(1), Mode::Exclusive));
            assert!(matches!(got, Poll::Ready(Ok(_))));
            let hold = txn.detach(&Key::plain(1)).expect("held");
            txn.commit().expect("no lease");
            let bomb = Key::eq_bomb(1, || {});
            let released = planted_or("release_hold with a panicking Eq", || {
                table.release_hold(&bomb, hold.token)
            });
            assert!(released.is_none(), "the compare panicked");
            drop(bomb);
            assert!(table.is_locked(&Key::plain(1)), "the hold still holds");
            assert_eq!(table.release_hold(&Key::plain(1), hold.token), Ok(()));
            assert_key_free(&table, || Key::plain(1), "the hold's key");
        });
    }

    /// A detach sweeps the records of lapsed holds; one sweep's release
    /// hands its key to a waiter whose wake panics. Every lapsed hold is
    /// still released, and the key being detached is not left with
    /// neither a guard nor a record: the detach fails, and lets it go.
    #[test]
    fn a_sweep_whose_release_panics_strands_neither_the_swept_nor_the_detached() {
        watchdog("sweep-release-panics", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let mut leasing = table.transaction_with(TransactionOptions::new().lease(LEASE));
            for k in [1, 3] {
                let got = poll_once(leasing.lock(k, Mode::Exclusive));
                assert!(matches!(got, Poll::Ready(Ok(_))));
                leasing.detach(&k).expect("held");
            }
            leasing.commit().expect("nothing left");
            let mut txn = table.transaction();
            let got = poll_once(txn.lock(2, Mode::Exclusive));
            assert!(matches!(got, Poll::Ready(Ok(_))));
            let bomb = Hostile::new();
            let waker = bomb.waker();
            let mut on_1 = Box::pin(table.lock(1));
            pending(&mut on_1, &waker, "a waiter for a hold's key");
            clock.advance(LEASE);
            bomb.arm_wake_panic();
            let detached = planted_or("a detach whose sweep's handoff panics", || txn.detach(&2));
            assert!(detached.is_none(), "the waiter's wake panicked");
            assert_eq!(bomb.wake_panics(), 1, "1 was handed to its waiter");
            txn.commit().expect("nothing lost");
            assert_key_free(&table, || 3, "the other lapsed hold's key");
            assert_key_free(&table, || 2, "the key being detached");
            let g1 = ready(&mut on_1, &waker, "the waiter has 1");
            drop((g1, on_1));
            assert_key_free(&table, || 1, "the hold's key the waiter took");
        });
    }

    /// A transaction's call dropped after its key was handed to it: its
    /// undo passes the grant on to the next waiter, whose wake panics. The
    /// call's claim on the key is still given back (its slot was left busy:
    /// the next lock of the key failed with `InFlight`).
    #[test]
    fn a_dropped_calls_undo_that_panics_gives_its_claim_back() {
        watchdog("claim-undo-panics", || {
            let table: LockTable<u32> = LockTable::new();
            let blocker = table.try_lock(1).expect("free");
            let mut txn = table.transaction();
            {
                let mut call = Box::pin(txn.lock(1, Mode::Exclusive));
                assert!(poll_once(call.as_mut()).is_pending(), "1 is held");
                let bomb = Hostile::new();
                let waker = bomb.waker();
                let mut next = Box::pin(table.lock(1));
                pending(&mut next, &waker, "a waiter behind the call");
                drop(blocker);
                bomb.arm_wake_panic();
                let dropped = planted_or("the call's drop", || drop(call));
                assert!(dropped.is_none(), "the next waiter's wake panicked");
                assert_eq!(bomb.wake_panics(), 1, "1 was passed on");
                let g = ready(&mut next, &waker, "the next waiter has 1");
                drop((g, next));
            }
            assert!(txn.is_empty(), "the call left nothing in the set");
            let again = poll_once(txn.lock(1, Mode::Exclusive));
            assert!(
                matches!(again, Poll::Ready(Ok(_))),
                "the key is claimed again: {again:?}"
            );
            txn.commit().expect("no lease");
            assert_key_free(&table, || 1, "the key");
        });
    }

    /// An owned transaction's commit whose release of one key panics (the
    /// plain waiter it hands the key to has a wake that panics) still
    /// cancels the transaction's pending calls: a forgotten call's waiter
    /// leaves its queue, and the key it waited for is free once its holder
    /// goes, not granted to a transaction that has ended.
    #[test]
    fn an_end_whose_release_panics_still_cancels_the_pending_calls() {
        watchdog("end-release-panics", || {
            let table: Arc<LockTable<u32>> = Arc::new(LockTable::new());
            let blocker = table.try_lock(1).expect("free");
            let txn = table.clone().transaction_owned();
            let mut held = Box::pin(txn.lock(2, Mode::Exclusive));
            assert!(matches!(poll_once(held.as_mut()), Poll::Ready(Ok(_))));
            let mut call = Box::pin(txn.lock(1, Mode::Exclusive));
            assert!(poll_once(call.as_mut()).is_pending(), "1 is held");
            std::mem::forget(call);
            let bomb = Hostile::new();
            let waker = bomb.waker();
            let mut waiter = Box::pin(table.lock(2));
            pending(
                &mut waiter,
                &waker,
                "a plain waiter for the transaction's key",
            );
            bomb.arm_wake_panic();
            let committed = planted_or("a commit whose handoff's wake panics", || txn.commit());
            assert!(committed.is_none(), "the waiter's wake panicked");
            assert_eq!(bomb.wake_panics(), 1, "2 was handed to the waiter");
            assert_eq!(table.waiters(&1), 0, "the forgotten call left 1's queue");
            drop(blocker);
            assert_key_free(&table, || 1, "the key the forgotten call waited for");
            let granted = ready(&mut waiter, &waker, "the waiter keeps 2");
            drop(granted);
            drop(waiter);
            drop(held);
            assert_key_free(&table, || 2, "the transaction's key");
        });
    }

    /// A borrowed transaction's commit whose release panics cancels a
    /// forgotten call as an abort would, not while unwinding: the grant
    /// the call never saw passes on, and the next waiter's wake runs as in
    /// any call (here it panics too, which while unwinding would abort the
    /// process; the commit reports the first panic).
    #[test]
    fn a_borrowed_commit_whose_release_panics_cancels_a_forgotten_call_unwound() {
        watchdog("borrowed-commit-release-panics", || {
            let table: LockTable<u32> = LockTable::new();
            let blocker = table.try_lock(1).expect("free");
            let mut txn = table.transaction();
            assert!(matches!(
                poll_once(txn.lock(2, Mode::Exclusive)),
                Poll::Ready(Ok(_))
            ));
            let mut call = Box::pin(txn.lock(1, Mode::Exclusive));
            assert!(poll_once(call.as_mut()).is_pending(), "1 is held");
            std::mem::forget(call);
            let first = Hostile::new();
            let first_waker = first.waker();
            let mut on_2 = Box::pin(table.lock(2));
            pending(
                &mut on_2,
                &first_waker,
                "a waiter for the transaction's key",
            );
            let next = Hostile::new();
            let next_waker = next.waker();
            let mut on_1 = Box::pin(table.lock(1));
            pending(&mut on_1, &next_waker, "a waiter behind the forgotten call");
            drop(blocker);
            assert!(table.is_locked(&1), "granted to the forgotten call");
            first.arm_wake_panic();
            next.arm_wake_panic();
            let committed = planted_or("a commit whose handoff's wake panics", || txn.commit());
            assert!(committed.is_none(), "the first waiter's wake panicked");
            assert_eq!(first.wake_panics(), 1, "2 was handed to its waiter");
            assert_eq!(
                next.wake_panics(),
                1,
                "the forgotten call's grant passed on, and its wake ran unwound"
            );
            let g1 = ready(&mut on_1, &next_waker, "the next waiter has 1");
            let g2 = ready(&mut on_2, &first_waker, "the first waiter has 2");
            drop((g1, g2, on_1, on_2));
            assert_key_free(&table, || 1, "the forgotten call's key");
            assert_key_free(&table, || 2, "the transaction's key");
        });
    }

    /// Polls `fut` once with a waker that does nothing.
    fn poll_once<F: Future>(fut: F) -> Poll<F::Output> {
        let mut fut = std::pin::pin!(fut);
        fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn a_panicking_old_waker_drop_on_repoll_keeps_the_registration() {
        watchdog("old-waker-drop-panics", || {
            let table: LockTable<u32> = LockTable::new();

            // The waiter is granted when the holder releases.
            let held = table.try_lock(1).expect("key 1 is free");
            let old = Hostile::new();
            let old_waker = old.waker();
            let new = Hostile::new();
            let new_waker = new.waker();
            let mut fut = Box::pin(table.lock(1));
            pending(&mut fut, &old_waker, "the waiter queues");
            old.arm_drop_panic();
            pending_or_planted(&mut fut, &new_waker, "the re-poll with a new waker");
            assert_eq!(
                table.waiters(&1),
                1,
                "the future still owns its registration after the old waker's drop panicked"
            );
            drop(held);
            assert_eq!(new.wakes(), 1, "the release woke the waiter's new waker");
            let guard = ready(
                &mut fut,
                &new_waker,
                "the re-polled waiter is granted on release",
            );
            drop(guard);
            drop(fut);
            assert_eq!(old.drop_panics(), 1, "the replaced waker was dropped, once");
            old.disarm_drop_panic();
            assert_key_free(&table, || 1, "after the grant");

            // The waiter is dropped instead.
            let held = table.try_lock(2).expect("key 2 is free");
            let old = Hostile::new();
            let old_waker = old.waker();
            let mut fut = Box::pin(table.lock(2));
            pending(&mut fut, &old_waker, "the waiter queues");
            old.arm_drop_panic();
            pending_or_planted(&mut fut, &new_waker, "the re-poll with a new waker");
            assert_eq!(
                table.waiters(&2),
                1,
                "the future still owns its registration after the old waker's drop panicked"
            );
            drop(fut);
            assert_eq!(table.waiters(&2), 0, "dropping the future removed it");
            assert_eq!(old.drop_panics(), 1, "the replaced waker was dropped, once");
            old.disarm_drop_panic();
            drop(held);
            assert_key_free(&table, || 2, "after the waiter was dropped");

            assert_table_empty(&table, 3, "after both waiters");
        });
    }

    // ---------------------------------------------------------------------------
    // 4. `Waker::clone` that re-enters the table, or panics.
    // ---------------------------------------------------------------------------

    /// Every clone of these wakers asks the table about another key of the same
    /// (only) shard. Cloning under the shard lock would deadlock the lock path,
    /// the re-poll path and the release, renew and revoke paths (which wake the
    /// head waiter for its lease timer).
    #[test]
    fn a_waker_clone_that_reenters_the_table_does_not_deadlock() {
        watchdog("reentrant-clone", || {
            let clock = ManualClock::new();
            let table: Arc<LockTable<u32>> =
                Arc::new(LockTable::builder().shards(1).clock(clock.clone()).build());
            // Held without a lease: asking about it never reads the clock.
            let other = table.try_lock(99).expect("key 99 is free");
            let reentries = Arc::new(AtomicUsize::new(0));
            let reentrant = || {
                let table = Arc::downgrade(&table);
                let reentries = reentries.clone();
                Hostile::on_clone(move || {
                    if let Some(table) = table.upgrade() {
                        if table.is_locked(&99) {
                            reentries.fetch_add(1, SeqCst);
                        }
                    }
                })
            };

            let holder = table.try_lock_with(1, leased()).expect("key 1 is free");
            // lock(): registering the waiter keeps a clone of its waker.
            let r1 = reentrant();
            let mut f1 = Box::pin(table.lock_with(1, leased()));
            pending(&mut f1, &r1.waker(), "the first waiter queues");
            // Re-poll with another waker: the registration's waker is replaced.
            let r2 = reentrant();
            let w2 = r2.waker();
            pending(&mut f1, &w2, "the first waiter is re-polled");
            let r3 = reentrant();
            let w3 = r3.waker();
            let mut f2 = Box::pin(table.lock_with(1, leased()));
            pending(&mut f2, &w3, "the second waiter queues");
            // renew: the head is woken to re-arm its timer.
            holder.renew(LEASE).expect("the holder's lease is live");
            // release: f1 is granted with a lease; f2, the new head, is woken.
            drop(holder);
            let g1 = ready(&mut f1, &w2, "f1 is granted").expect("no timeout");
            // revoke: g1 is forced out; f2 is granted with a lease; f3, the new
            // head, is woken.
            let r4 = reentrant();
            let w4 = r4.waker();
            let mut f3 = Box::pin(table.lock_with(1, leased()));
            pending(&mut f3, &w4, "the third waiter queues");
            assert_eq!(table.revoke(&1), Some(g1.token()));
            assert!(g1.is_expired());
            let g2 = ready(&mut f2, &w3, "f2 is granted by the revocation").expect("no timeout");
            drop(g1);
            assert!(
                g2.check().is_ok(),
                "the stale release freed nothing of f2's"
            );
            drop(g2);
            let g3 = ready(&mut f3, &w4, "f3 is granted").expect("no timeout");
            drop(g3);
            drop((f1, f2, f3));

            assert!(
                reentries.load(SeqCst) > 0,
                "precondition: the table cloned the re-entrant wakers"
            );
            assert_key_free(&*table, || 1, "after the re-entrant wakers");
            drop(other);
            assert_table_empty(&*table, 2, "after the re-entrant wakers");
        });
    }

    /// A waker whose clone asks the table about a *leased* key (which reads the
    /// manual clock) is cloned by a waiter arming its timer on that clock: the
    /// clock must not hold its own lock while it clones or drops wakers.
    #[test]
    fn a_waker_clone_that_reads_the_manual_clock_does_not_deadlock_the_timer() {
        watchdog("clock-reentrant-clone", || {
            let clock = ManualClock::new();
            let table: Arc<LockTable<u32>> =
                Arc::new(LockTable::builder().shards(1).clock(clock.clone()).build());
            // A leased key: asking whether it is locked reads the clock.
            let other = table.try_lock_with(99, leased()).expect("key 99 is free");
            let reentries = Arc::new(AtomicUsize::new(0));
            let hostile = {
                let table = Arc::downgrade(&table);
                let reentries = reentries.clone();
                Hostile::on_clone(move || {
                    if let Some(table) = table.upgrade() {
                        if table.is_locked(&99) {
                            reentries.fetch_add(1, SeqCst);
                        }
                    }
                })
            };
            let waker = hostile.waker();
            let holder = table.try_lock_with(1, leased()).expect("key 1 is free");
            // The head of a leased holder's queue arms a timer on the clock,
            // which registers (clones) this waker.
            let mut f = Box::pin(table.lock_with(1, leased()));
            pending(&mut f, &waker, "the waiter queues and arms its timer");
            pending(&mut f, &waker, "the waiter re-arms its timer");
            assert!(clock.sleepers() >= 1, "precondition: a timer is armed");
            drop(holder);
            let g = ready(&mut f, &waker, "the waiter is granted").expect("no timeout");
            assert!(
                reentries.load(SeqCst) > 0,
                "precondition: the clock cloned the re-entrant waker"
            );
            drop(g);
            drop(f);
            drop(other);
            assert_table_empty(&*table, 2, "after the clock's re-entrant waker");
        });
    }

    /// A waiter's waker panics on clone. That panic may surface in the poll of
    /// the future that owns the waker, never in another caller's `renew`,
    /// release or `revoke` (which wake the head waiter for its lease timer); and
    /// the waiter still gets the key.
    #[test]
    fn a_panicking_waker_clone_never_surfaces_in_another_callers_renew_release_or_revoke() {
        watchdog("clone-panics", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();

            /// Polls X, granted the key, for its guard. Its own poll may surface
            /// its waker's planted clone panic (that is X's own business): then
            /// the bomb is defused and the next poll must yield the guard, the
            /// grant having survived the panic.
            fn granted<F: Future<Output = Result<G, LockError>> + Unpin, G>(
                fut: &mut F,
                hostile: &Hostile,
                waker: &Waker,
                what: &str,
            ) -> G {
                let out = match poll_caught(fut, waker) {
                    Ok(Poll::Ready(out)) => out,
                    Ok(Poll::Pending) => panic!("{what}: still pending, but the key is X's"),
                    Err(payload) => {
                        expect_planted(payload, what);
                        hostile.disarm_clone_panic();
                        ready(fut, waker, what)
                    }
                };
                out.expect("no timeout")
            }

            // renew: X heads the queue of a leased holder.
            let holder = table.try_lock_with(1, leased()).expect("key 1 is free");
            let px = Hostile::new();
            let wx = px.waker();
            let mut x = Box::pin(table.lock_with(1, leased()));
            pending(&mut x, &wx, "X queues at the head");
            px.arm_clone_panic();
            no_panic("the holder's renew()", || holder.renew(LEASE)).expect("live");
            no_panic("the holder's release", || drop(holder));
            let gx = granted(&mut x, &px, &wx, "X after the renew and the release");
            drop(gx);
            drop(x);
            px.disarm_clone_panic();
            assert_key_free(&table, || 1, "renew");

            // release: A heads the queue (leased), X is next.
            let holder = table.try_lock_with(2, leased()).expect("key 2 is free");
            let pa = Hostile::new();
            let wa = pa.waker();
            let mut a = Box::pin(table.lock_with(2, leased()));
            pending(&mut a, &wa, "A queues at the head");
            let px = Hostile::new();
            let wx = px.waker();
            let mut x = Box::pin(table.lock_with(2, leased()));
            pending(&mut x, &wx, "X queues behind A");
            px.arm_clone_panic();
            no_panic("the holder's release", || drop(holder));
            let ga = ready(&mut a, &wa, "A is granted").expect("no timeout");
            no_panic("A's release", || drop(ga));
            let gx = granted(&mut x, &px, &wx, "X after A");
            drop(gx);
            drop((a, x));
            px.disarm_clone_panic();
            assert_key_free(&table, || 2, "release");

            // revoke: A heads the queue (leased), X is next.
            let holder = table.try_lock_with(3, leased()).expect("key 3 is free");
            let mut a = Box::pin(table.lock_with(3, leased()));
            pending(&mut a, &wa, "A queues at the head");
            let px = Hostile::new();
            let wx = px.waker();
            let mut x = Box::pin(table.lock_with(3, leased()));
            pending(&mut x, &wx, "X queues behind A");
            px.arm_clone_panic();
            let revoked = no_panic("revoke()", || table.revoke(&3));
            assert_eq!(revoked, Some(holder.token()));
            assert!(holder.is_expired());
            let ga = ready(&mut a, &wa, "A is granted by the revocation").expect("no timeout");
            no_panic("the revoked holder's release", || drop(holder));
            no_panic("A's release", || drop(ga));
            let gx = granted(&mut x, &px, &wx, "X after A");
            drop(gx);
            drop((a, x));
            px.disarm_clone_panic();
            assert_key_free(&table, || 3, "revoke");

            assert_table_empty(&table, 4, "after the panicking clones");
        });
    }

    // ---------------------------------------------------------------------------
    // 5. Every waker due a wake gets it.
    // ---------------------------------------------------------------------------

    /// One operation wakes two waiters: the head it grants, and (the grant
    /// carrying a lease) the next head, so that it arms its lease timer. The
    /// first wake panics; the second must still be delivered before the panic
    /// (if any) reaches the caller.
    #[test]
    fn every_waker_due_a_wake_is_woken_even_if_an_earlier_one_panics() {
        watchdog("one-wake-panics", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();

            // revoke of a holder without a lease, two leased waiters: B's timer
            // covers no holder deadline, so A's leased grant nudges it.
            let holder = table.try_lock(1).expect("key 1 is free");
            let pa = Hostile::new();
            let wa = pa.waker();
            let mut a = Box::pin(table.lock_with(1, leased()));
            pending(&mut a, &wa, "A queues at the head");
            let pb = Hostile::new();
            let wb = pb.waker();
            let mut b = Box::pin(table.lock_with(1, leased()));
            pending(&mut b, &wb, "B queues behind A");
            let b_before = pb.wakes();
            pa.arm_wake_panic();
            let revoked = planted_or("revoke()", || table.revoke(&1));
            let b_after = pb.wakes();
            assert_eq!(pa.wake_panics(), 1, "precondition: A, granted, was woken");
            assert!(
                b_after > b_before,
                "B (the new head of a leased grant) was not woken because A's wake panicked first"
            );
            if let Some(revoked) = revoked {
                assert_eq!(revoked, Some(holder.token()));
            }
            assert!(holder.is_expired());
            let ga =
                ready(&mut a, &wa, "A keeps the grant whose wake panicked").expect("no timeout");
            pending(&mut b, &wb, "B waits behind A");
            drop(ga);
            let gb = ready(&mut b, &wb, "B is granted after A").expect("no timeout");
            drop(gb);
            drop(holder);
            drop((a, b));
            assert_key_free(&table, || 1, "revoke");

            // release of a holder with two waiters, the first one leased.
            let holder = table.try_lock(2).expect("key 2 is free");
            let pa = Hostile::new();
            let wa = pa.waker();
            let mut a = Box::pin(table.lock_with(2, leased()));
            pending(&mut a, &wa, "A queues at the head");
            let pb = Hostile::new();
            let wb = pb.waker();
            let mut b = Box::pin(table.lock(2));
            pending(&mut b, &wb, "B queues behind A");
            let b_before = pb.wakes();
            pa.arm_wake_panic();
            planted_or("the holder's release", || drop(holder));
            let b_after = pb.wakes();
            assert_eq!(pa.wake_panics(), 1, "precondition: A, granted, was woken");
            assert!(
                b_after > b_before,
                "B (the new head of a leased grant) was not woken because A's wake panicked first"
            );
            let ga =
                ready(&mut a, &wa, "A keeps the grant whose wake panicked").expect("no timeout");
            pending(&mut b, &wb, "B waits behind A");
            drop(ga);
            let gb = ready(&mut b, &wb, "B is granted after A");
            drop(gb);
            drop((a, b));
            assert_key_free(&table, || 2, "release");

            assert_table_empty(&table, 3, "after the panicking wakes");
        });
    }

    /// A plain handoff leaves one wake, done on its own path (no work area):
    /// its panic reaches the releaser, and the grant stays the waiter's.
    #[test]
    fn a_handoffs_only_wake_that_panics_reaches_the_releaser_and_strands_nothing() {
        watchdog("only-wake-panics", || {
            let table: LockTable<u32> = LockTable::new();
            let holder = table.try_lock(1).expect("key 1 is free");
            let pa = Hostile::new();
            let wa = pa.waker();
            let mut a = Box::pin(table.lock(1));
            pending(&mut a, &wa, "A queues behind the holder");
            pa.arm_wake_panic();
            let released = planted_or("the holder's release", || drop(holder));
            assert!(released.is_none(), "the wake's panic reached the releaser");
            assert_eq!(pa.wake_panics(), 1, "A, granted, was woken (and panicked)");
            assert!(table.is_locked(&1), "the key was handed to A, not freed");
            let ga = ready(&mut a, &wa, "A keeps the grant whose wake panicked");
            assert_eq!(table.stats().handoffs, 1, "one handoff counted");
            drop(ga);
            drop(a);
            assert_key_free(&table, || 1, "handoff");
            assert_table_empty(&table, 2, "after the panicking wake");
        });
    }

    /// `ManualClock::advance` wakes every sleeper whose deadline it passed; the
    /// first one's wake panics, the second must still be woken.
    #[test]
    fn manual_clock_advance_wakes_every_due_sleeper_even_if_one_panics() {
        watchdog("clock-wake-panics", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let h1 = table.try_lock_with(1, leased()).expect("key 1 is free");
            let h2 = table.try_lock_with(2, leased()).expect("key 2 is free");
            let pa = Hostile::new();
            let wa = pa.waker();
            let mut a = Box::pin(table.lock(1));
            pending(&mut a, &wa, "A waits for key 1 with a lease timer");
            let pb = Hostile::new();
            let wb = pb.waker();
            let mut b = Box::pin(table.lock(2));
            pending(&mut b, &wb, "B waits for key 2 with a lease timer");
            assert_eq!(clock.sleepers(), 2, "precondition: both timers are armed");
            pa.arm_wake_panic();
            planted_or("ManualClock::advance", || clock.advance(LEASE));
            assert_eq!(pa.wake_panics(), 1, "precondition: A's timer fired");
            assert_eq!(
                pb.wakes(),
                1,
                "B's timer was due too, but its wake was lost because A's panicked first"
            );
            let ga = ready(&mut a, &wa, "A gets key 1 once its holder lapsed");
            let gb = ready(&mut b, &wb, "B gets key 2 once its holder lapsed");
            assert!(h1.is_expired() && h2.is_expired());
            drop((ga, gb, h1, h2, a, b));
            assert_key_free(&table, || 1, "key 1");
            assert_key_free(&table, || 2, "key 2");
            assert_table_empty(&table, 3, "after the clock's wakes");
        });
    }

    // ---------------------------------------------------------------------------
    // 6. A key whose `Eq` panics.
    // ---------------------------------------------------------------------------

    /// Every key collides, so looking up key 2 compares it with the held key 1;
    /// key 2's `Eq` panics. The call panics, and the rejected key must be dropped
    /// only after the shard lock is released: its `Drop` asks the table about
    /// key 1, which would deadlock under the lock.
    #[test]
    fn a_key_whose_eq_panics_is_dropped_after_the_shard_lock_is_released() {
        watchdog("eq-panics", || {
            let table: Arc<LockTable<Key, Collide>> =
                Arc::new(LockTable::builder().hasher(Collide).build());
            let held = table.try_lock(Key::plain(1)).expect("key 1 is free");
            let seen = Arc::new(Mutex::new(Vec::new()));
            let bomb = || {
                let table = Arc::downgrade(&table);
                let seen = seen.clone();
                Key::eq_bomb(2, move || {
                    let table = table.upgrade().expect("the table is alive");
                    let locked = table.is_locked(&Key::plain(1));
                    seen.lock().unwrap().push(locked);
                })
            };

            let outcome = catch_unwind(AssertUnwindSafe(|| table.try_lock(bomb()).is_ok()));
            match outcome {
                Ok(_) => panic!("try_lock with a key whose Eq panics must panic"),
                Err(payload) => assert_eq!(expect_planted(payload, "try_lock"), "Key::eq"),
            }
            assert_eq!(
                *seen.lock().unwrap(),
                [true],
                "try_lock dropped the rejected key once, and its Drop saw key 1 held"
            );

            let probe = Hostile::new();
            let mut fut = Box::pin(table.lock(bomb()));
            match poll_caught(&mut fut, &probe.waker()) {
                Ok(_) => panic!("lock with a key whose Eq panics must panic"),
                Err(payload) => assert_eq!(expect_planted(payload, "lock"), "Key::eq"),
            }
            drop(fut);
            assert_eq!(
                *seen.lock().unwrap(),
                [true, true],
                "lock dropped the rejected key once, and its Drop saw key 1 held"
            );

            table.assert_consistent();
            assert_eq!(table.len(), 1, "only the held key has an entry");
            assert_eq!(table.waiters(&Key::plain(1)), 0);
            assert!(
                table.is_locked(&Key::plain(1)),
                "the held key is still held"
            );
            assert!(held.check().is_ok(), "and its guard still works");
            assert!(table.try_lock(Key::plain(1)).is_err());
            drop(held);
            assert_key_free(&*table, || Key::plain(1), "the held key");
            assert_key_free(&*table, || Key::plain(2), "the rejected key");
            assert_table_empty(&*table, Key::plain(3), "after the panicking Eq");
        });
    }

    // ---------------------------------------------------------------------------
    // 7. Granted waiters that never run, or run late.
    // ---------------------------------------------------------------------------

    /// A queued future with a lease is forgotten, then granted the key. It never
    /// runs, so its grant lapses after one lease; from then on the key must serve
    /// others and then be free, never go back to the forgotten waiter.
    #[test]
    fn a_forgotten_granted_waiter_whose_lease_lapses_never_takes_the_key_again() {
        watchdog("forgotten-granted-waiter", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let holder = table.try_lock(1).expect("key 1 is free");
            let pf = Hostile::new();
            let mut forgotten = Box::pin(table.lock_with(1, leased()));
            assert!(
                forgotten
                    .as_mut()
                    .poll(&mut Context::from_waker(&pf.waker()))
                    .is_pending(),
                "the forgotten waiter queues"
            );
            std::mem::forget(forgotten);
            let po = Hostile::new();
            let wo = po.waker();
            let mut other = Box::pin(table.lock(1));
            pending(&mut other, &wo, "another waiter queues behind it");
            assert_eq!(table.waiters(&1), 2);

            drop(holder);
            assert_eq!(pf.wakes(), 1, "the forgotten waiter was granted the key");
            assert!(table.is_locked(&1));
            pending(&mut other, &wo, "the forgotten waiter's grant is live");
            clock.advance(LEASE);
            let guard = ready(
                &mut other,
                &wo,
                "the other waiter is served after one lease",
            );
            drop(guard);

            for cycle in 0..3 {
                assert_eq!(table.waiters(&1), 0, "cycle {cycle}: nobody waits");
                assert!(
                    !table.is_locked(&1),
                    "cycle {cycle}: the forgotten waiter, whose grant lapsed, holds the key again"
                );
                let guard = table.try_lock(1);
                assert!(
                guard.is_ok(),
                "cycle {cycle}: try_lock fails for ever: the forgotten waiter keeps taking the key"
            );
                drop(guard);
                clock.advance(LEASE);
            }
            let mut late = Box::pin(table.lock(1));
            let guard = ready(&mut late, &wo, "a newcomer gets the key at once");
            drop(guard);
            drop(late);

            table.assert_consistent();
            assert!(
                table.len() <= 1,
                "only the forgotten future's fenced claim may keep an entry"
            );
            let fresh = table.try_lock(2);
            assert!(fresh.is_ok(), "other keys still work");
            drop(fresh);
            table.assert_consistent();
        });
    }

    /// A waiter granted the key whose lease lapses before it runs is fenced like
    /// a guard: the key passes on, and the waiter, when it finally runs,
    /// resolves to an expired guard whose drop frees nothing of its successor's.
    #[test]
    fn a_granted_waiter_whose_lease_lapses_before_it_runs_resolves_to_a_fenced_guard() {
        watchdog("late-granted-waiter", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let holder = table.try_lock(1).expect("key 1 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut late = Box::pin(table.lock_with(1, leased()));
            pending(&mut late, &ww, "the late waiter queues");
            let po = Hostile::new();
            let wo = po.waker();
            let mut other = Box::pin(table.lock(1));
            pending(&mut other, &wo, "another waiter queues behind it");

            drop(holder);
            assert_eq!(pw.wakes(), 1, "the late waiter was granted the key");
            pending(&mut other, &wo, "the late waiter's grant is live");
            clock.advance(LEASE);
            let go = ready(
                &mut other,
                &wo,
                "the other waiter is served after one lease",
            );

            let gl = match poll_caught(&mut late, &ww) {
                Ok(Poll::Ready(out)) => out.expect("no timeout"),
                Ok(Poll::Pending) => panic!(
                    "the waiter whose grant lapsed before it ran was re-queued (pending) instead \
                 of resolving to a fenced guard"
                ),
                Err(payload) => panic!("the late waiter's poll panicked: {}", message(&*payload)),
            };
            assert!(gl.is_expired(), "the late waiter's guard is fenced");
            assert_eq!(
                gl.check(),
                Err(LockError::Expired {
                    token: gl.token(),
                    key: None
                })
            );
            assert!(
                gl.token() < go.token(),
                "its grant came before the successor's"
            );
            drop(gl);
            assert!(table.is_locked(&1), "the fenced guard's drop freed nothing");
            assert_eq!(
                go.check(),
                Ok(go.token()),
                "the successor still holds the key"
            );
            assert!(table.try_lock(1).is_err());
            assert_eq!(table.waiters(&1), 0);
            drop(go);
            drop((late, other));
            assert_key_free(&table, || 1, "after the late waiter");
            assert_table_empty(&table, 2, "after the late waiter");
        });
    }

    /// `revoke` of a waiter that was granted the key but has not run fences it:
    /// it is not re-queued, the key passes to the next waiter or becomes free,
    /// and the waiter resolves to an expired guard.
    #[test]
    fn revoking_a_granted_but_unpolled_waiter_fences_it_instead_of_requeueing_it() {
        watchdog("revoke-granted-waiter", || {
            let table: LockTable<u32> = LockTable::new();

            // Another waiter is queued: the key passes to it, then becomes free.
            let holder = table.try_lock(1).expect("key 1 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut w = Box::pin(table.lock(1));
            pending(&mut w, &ww, "W queues");
            let po = Hostile::new();
            let wo = po.waker();
            let mut other = Box::pin(table.lock(1));
            pending(&mut other, &wo, "another waiter queues behind W");
            drop(holder);
            assert_eq!(pw.wakes(), 1, "W was granted the key");
            let revoked = table
                .revoke(&1)
                .expect("W's unobserved grant is the live holder");
            let go = ready(&mut other, &wo, "the key passed to the other waiter");
            assert!(go.token() > revoked);
            drop(go);
            assert_eq!(table.waiters(&1), 0, "the revoked waiter was re-queued");
            assert!(
                !table.is_locked(&1),
                "the revoked waiter was re-queued and granted the key again"
            );
            let taken = table.try_lock(1);
            assert!(
                taken.is_ok(),
                "the key is free once the other waiter is done"
            );
            let gw = ready(&mut w, &ww, "the revoked waiter resolves");
            assert_eq!(gw.token(), revoked, "to the guard of its revoked grant");
            assert!(gw.is_expired(), "which is fenced");
            assert_eq!(
                gw.check(),
                Err(LockError::Expired {
                    token: revoked,
                    key: None
                })
            );
            drop(gw);
            let taken = taken.expect("checked above");
            assert!(taken.check().is_ok(), "the fenced guard freed nothing");
            drop(taken);
            drop((w, other));
            assert_key_free(&table, || 1, "with another waiter");

            // Nobody else waits: the key becomes free at once.
            let holder = table.try_lock(2).expect("key 2 is free");
            let mut w = Box::pin(table.lock(2));
            pending(&mut w, &ww, "W queues");
            drop(holder);
            let revoked = table
                .revoke(&2)
                .expect("W's unobserved grant is the live holder");
            assert!(
                !table.is_locked(&2),
                "the revoked waiter was granted the key again at once"
            );
            assert_eq!(table.waiters(&2), 0);
            let taken = table.try_lock(2);
            assert!(
                taken.is_ok(),
                "the key is free after revoking its only grant"
            );
            let gw = ready(&mut w, &ww, "the revoked waiter resolves");
            assert_eq!(gw.token(), revoked);
            assert!(gw.is_expired());
            drop(gw);
            let taken = taken.expect("checked above");
            assert!(taken.check().is_ok(), "the fenced guard freed nothing");
            drop(taken);
            drop(w);
            assert_key_free(&table, || 2, "alone");

            assert_table_empty(&table, 3, "after the revocations");
        });
    }

    // ---------------------------------------------------------------------------
    // 8. A clock advanced by `Duration::MAX`.
    // ---------------------------------------------------------------------------

    /// Advancing the manual clock by `Duration::MAX`, twice, and by other huge
    /// amounts saturates instead of overflowing; leases lapse, releases work, and
    /// no two live guards ever hold one key.
    #[test]
    fn manual_clock_advance_by_duration_max_saturates_instead_of_panicking() {
        watchdog("clock-saturates", || {
            let clock = ManualClock::new();
            let table: LockTable<u32> = LockTable::builder().clock(clock.clone()).build();
            let g1 = table.try_lock_with(1, leased()).expect("key 1 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut w = Box::pin(table.lock_with(1, leased()));
            pending(&mut w, &ww, "W waits with a lease timer");
            let g2 = table.try_lock_with(2, leased()).expect("key 2 is free");

            for by in [
                Duration::MAX,
                Duration::MAX,
                Duration::from_secs(u64::MAX / 2),
                Duration::from_nanos(1),
            ] {
                no_panic(&format!("ManualClock::advance({by:?})"), || {
                    clock.advance(by);
                });
            }
            no_panic("ManualClock::now after saturating", || clock.now());
            assert!(pw.wakes() >= 1, "W's lease timer fired");

            // Key 2: the lapsed grant is fenced, the key is taken exactly once.
            assert!(g2.is_expired(), "a leased guard lapsed");
            assert_eq!(
                g2.check(),
                Err(LockError::Expired {
                    token: g2.token(),
                    key: None
                })
            );
            let t1 = table.try_lock(2);
            assert!(t1.is_ok(), "the key whose grant lapsed can be taken");
            assert!(
                table.try_lock(2).is_err(),
                "but only once: two guards would hold one key"
            );
            drop(g2);
            assert!(table.is_locked(&2), "the stale release freed nothing");
            let t1 = t1.expect("checked above");
            assert!(t1.check().is_ok());
            drop(t1);
            assert_key_free(&table, || 2, "key 2");

            // Key 1: the lapsed holder is fenced, W gets the key.
            assert!(g1.is_expired(), "a leased guard lapsed");
            let gw = ready(&mut w, &ww, "W gets the key its holder lost").expect("no timeout");
            assert!(gw.token() > g1.token());
            let intruder = table.try_lock(1);
            assert!(
                intruder.is_err() || gw.is_expired(),
                "two live guards hold key 1"
            );
            drop(intruder);
            drop(g1);
            drop(gw);
            drop(w);
            assert_key_free(&table, || 1, "key 1");

            // A new leased grant after saturation.
            let g3 = table.try_lock_with(3, leased()).expect("key 3 is free");
            let again = table.try_lock_with(3, leased());
            assert!(
                again.is_err() || g3.is_expired(),
                "two live guards hold key 3"
            );
            drop(again);
            drop(g3);
            assert_key_free(&table, || 3, "key 3");

            assert_table_empty(&table, 4, "after saturating the clock");
        });
    }

    // ---------------------------------------------------------------------------
    // 8b. Loss notification with hostile wakers.
    // ---------------------------------------------------------------------------

    /// `Lost` futures are woken after the unlock, by a revoke or by the lapse
    /// their timer finds. Of three on one grant, one's wake panics, one's wake
    /// re-enters the table (it revokes another key's grant, reads the key it
    /// watched and takes and releases a third key), one is plain: every one is
    /// woken, the revoke's own work is complete (the key passed to the waiter),
    /// the panic surfaces only in the revoking call, and nothing is stranded.
    /// Then a `Lost` whose waker's clone panics is not registered (nothing to
    /// wake), and one whose waker's drop panics is unregistered all the same
    /// when dropped.
    #[test]
    fn lost_futures_whose_wakers_panic_or_reenter_strand_nothing() {
        watchdog("lost-hostile-wakers", || {
            let clock = ManualClock::new();
            let table: Arc<LockTable<u32>> =
                Arc::new(LockTable::builder().clock(clock.clone()).build());

            // A revoke wakes all three.
            let holder = table.try_lock_with(1, leased()).expect("key 1 is free");
            let other = table.try_lock(2).expect("key 2 is free");
            let pw = Hostile::new();
            let ww = pw.waker();
            let mut next = Box::pin(table.lock(1));
            pending(&mut next, &ww, "a waiter queues behind the holder");

            let pa = Hostile::new();
            pa.arm_wake_panic();
            let reentered = Arc::new(AtomicUsize::new(0));
            let pb = {
                let (table, reentered) = (table.clone(), reentered.clone());
                Hostile::on_wake(move || {
                    table.revoke(&2);
                    assert!(table.is_locked(&1), "the key passed on before the wake");
                    drop(table.try_lock(3).expect("key 3 is free"));
                    reentered.fetch_add(1, SeqCst);
                })
            };
            let pc = Hostile::new();
            let (wa, wb, wc) = (pa.waker(), pb.waker(), pc.waker());
            let (mut la, mut lb, mut lc) = (holder.lost(), holder.lost(), holder.lost());
            pending(&mut la, &wa, "A watches");
            pending(&mut lb, &wb, "B watches");
            pending(&mut lc, &wc, "C watches");

            let revoked = planted_or("revoke() waking the watchers", || table.revoke(&1));
            assert_eq!(pa.wake_panics(), 1, "A's wake ran (and panicked)");
            assert_eq!(
                reentered.load(SeqCst),
                1,
                "B's wake ran, re-entering the table"
            );
            assert_eq!(pc.wakes(), 1, "C was woken although A's wake panicked");
            assert_eq!(pw.wakes(), 1, "the waiter was handed the key and woken");
            if let Some(revoked) = revoked {
                assert_eq!(revoked, Some(holder.token()));
            }
            assert!(holder.is_expired());
            assert!(other.is_expired(), "B's re-entrant revoke took effect");
            let expired = LockError::Expired {
                token: holder.token(),
                key: None,
            };
            assert_eq!(ready(&mut la, &wa, "A after the revoke"), expired);
            assert_eq!(ready(&mut lb, &wb, "B after the revoke"), expired);
            assert_eq!(ready(&mut lc, &wc, "C after the revoke"), expired);
            let g = ready(&mut next, &ww, "the waiter holds the key");
            assert_eq!(g.check(), Ok(g.token()));
            drop((la, lb, lc));
            drop((g, next));
            drop((holder, other));
            assert_key_free(&table, || 1, "after the revoke");
            assert_key_free(&table, || 2, "after the re-entrant revoke");

            // A lapse found by the timer: the clock's advance wakes the watcher,
            // whose wake panics and re-enters; the watcher then settles the
            // lapse, and the key passes on.
            let holder = table.try_lock_with(4, leased()).expect("key 4 is free");
            let mut next = Box::pin(table.lock(4));
            pending(&mut next, &ww, "a waiter queues behind the leased holder");
            let pl = {
                let table = table.clone();
                Hostile::on_wake(move || {
                    assert!(!table.is_locked(&4), "judged now: the lease lapsed");
                })
            };
            pl.arm_wake_panic();
            let wl = pl.waker();
            let mut lost = holder.lost();
            pending(&mut lost, &wl, "the watcher arms its timer");
            planted_or("advance() past the lease", || clock.advance(LEASE));
            assert_eq!(pl.wake_panics(), 1, "the watcher's timer fired");
            assert!(matches!(
                ready(&mut lost, &wl, "the watcher after the lapse"),
                LockError::Expired { .. }
            ));
            let g = ready(&mut next, &ww, "the lapse handed the key on");
            drop(lost);
            drop((g, next, holder));
            assert_key_free(&table, || 4, "after the lapse");

            // A watcher whose clone panics registers nothing; one whose drop
            // panics is still unregistered.
            let holder = table.try_lock(5).expect("key 5 is free");
            let pk = Hostile::new();
            pk.arm_clone_panic();
            let wk = pk.waker();
            let mut lk = holder.lost();
            assert!(pending_or_planted(&mut lk, &wk, "a watcher whose clone panics").is_some());
            pk.disarm_clone_panic();
            let pd = Hostile::new();
            let wd = pd.waker();
            let mut ld = holder.lost();
            pending(&mut ld, &wd, "a watcher whose drop will panic");
            pd.arm_drop_panic();
            planted_or("dropping the watcher", || drop(ld));
            assert_eq!(pd.drop_panics(), 1, "the registered handle was dropped");
            table.assert_consistent();
            assert_eq!(table.revoke(&5), Some(holder.token()));
            assert_eq!(
                (pk.wakes(), pd.wakes()),
                (0, 0),
                "an unregistered watcher was woken"
            );
            assert!(matches!(
                ready(&mut lk, &wk, "the first watcher"),
                LockError::Expired { .. }
            ));
            drop(lk);
            drop(holder);
            assert_key_free(&table, || 5, "after the hostile watchers");
            assert_table_empty(&table, 6, "after the hostile watchers");
        });
    }

    // ---------------------------------------------------------------------------
    // 9. Keys whose `Eq` disagrees with `Hash`.
    // ---------------------------------------------------------------------------

    /// Equal to nothing, not even itself; every instance hashes alike (the id
    /// only tells instances apart in a debugger).
    #[allow(dead_code)]
    struct NeverEq(u32);

    impl PartialEq for NeverEq {
        fn eq(&self, _: &Self) -> bool {
            false
        }
    }

    impl Eq for NeverEq {}

    impl Hash for NeverEq {
        fn hash<H: Hasher>(&self, state: &mut H) {
            0u8.hash(state);
        }
    }

    /// A source of hashes that differ every time a key is hashed.
    static FICKLE: AtomicU64 = AtomicU64::new(0);

    /// Equal by id, but hashed differently every time.
    struct Fickle(u32);

    impl PartialEq for Fickle {
        fn eq(&self, other: &Self) -> bool {
            self.0 == other.0
        }
    }

    impl Eq for Fickle {}

    impl Hash for Fickle {
        fn hash<H: Hasher>(&self, state: &mut H) {
            FICKLE.fetch_add(1, SeqCst).hash(state);
        }
    }

    /// Equal to everything, and hashed differently every time.
    struct AlwaysEq(u32);

    impl PartialEq for AlwaysEq {
        fn eq(&self, _: &Self) -> bool {
            true
        }
    }

    impl Eq for AlwaysEq {}

    impl Hash for AlwaysEq {
        fn hash<H: Hasher>(&self, state: &mut H) {
            (self.0, FICKLE.fetch_add(1, SeqCst)).hash(state);
        }
    }

    /// Locks, queues, releases and cancels keys made by `key`; whatever the
    /// (unspecified) outcome of each call, nothing may panic and every grant must
    /// pair with its release.
    fn churn<K: Eq + Hash>(table: &LockTable<K>, key: impl Fn(u32) -> K, what: &str) {
        let waker = Waker::noop();
        no_panic(what, || {
            let mut guards = Vec::new();
            for i in 0..6 {
                if let Ok(guard) = table.try_lock(key(i % 2)) {
                    guards.push(guard);
                }
            }
            let mut waiting = Vec::new();
            for i in 0..6 {
                let mut fut = Box::pin(table.lock(key(i % 3)));
                match fut.as_mut().poll(&mut Context::from_waker(waker)) {
                    Poll::Ready(guard) => guards.push(guard),
                    Poll::Pending => waiting.push(fut),
                }
            }
            while let Some(guard) = guards.pop() {
                drop(guard);
            }
            for _ in 0..4 {
                waiting.retain_mut(|fut| {
                    fut.as_mut()
                        .poll(&mut Context::from_waker(waker))
                        .is_pending()
                });
            }
            // Some may still wait or hold an unobserved grant: cancel them.
            drop(waiting);
        });
        table.assert_consistent();
        assert_eq!(
            table.len(),
            0,
            "{what}: a lock did not pair with its release"
        );
    }

    /// `Eq` that disagrees with `Hash` is a logic error of the caller with
    /// unspecified but memory-safe results: no panic inside the table, and every
    /// grant's release finds it.
    #[test]
    fn keys_whose_eq_disagrees_with_hash_still_pair_every_lock_with_its_release() {
        watchdog("eq-disagrees-with-hash", || {
            let table: LockTable<NeverEq> = LockTable::new();
            churn(&table, NeverEq, "Eq always false, one hash");
            let table: LockTable<Fickle> = LockTable::new();
            churn(&table, Fickle, "Eq by id, a new hash every time");
            let table: LockTable<AlwaysEq> = LockTable::new();
            churn(&table, AlwaysEq, "Eq always true, a new hash every time");
            let table: LockTable<AlwaysEq, Collide> = LockTable::builder().hasher(Collide).build();
            no_panic("Eq always true, one hash", || {
                let a = table.try_lock(AlwaysEq(1)).expect("empty table");
                assert!(table.try_lock(AlwaysEq(2)).is_err(), "all keys are one key");
                drop(a);
            });
            assert_eq!(table.len(), 0);
            table.assert_consistent();
        });
    }

    // ---------------------------------------------------------------------------
    // A transaction's waiting `lock_all` under hostile wakers.
    // ---------------------------------------------------------------------------

    /// A transaction's call waits for key 2 (the boxed wait): a `lock_all`
    /// that takes key 1 first, or a `lock` of key 2 alone (its wait parked
    /// in the transaction). The waker panics on clone, wake or drop, or
    /// calls back into the table from clone or wake; then the call is
    /// either completed once the key is released, or dropped while still
    /// queued. Every key ends free and the table empty.
    #[test]
    fn a_transactions_waiting_call_under_hostile_wakers_strands_nothing() {
        use keylock::{Mode, Transaction};
        use std::future::Future;
        use std::pin::Pin;
        /// A call of the transaction that waits for key 2; `true` once it
        /// has every key it asked for.
        type Call = for<'t, 'a> fn(
            &'t mut Transaction<'a, u32>,
        ) -> Pin<Box<dyn Future<Output = bool> + 't>>;
        let calls: [(&str, Call); 2] = [
            ("lock_all of keys 1 and 2", |txn| {
                Box::pin(async move {
                    txn.lock_all([(1, Mode::Exclusive), (2, Mode::Exclusive)])
                        .await
                        .is_ok()
                })
            }),
            ("lock of key 2", |txn| {
                Box::pin(async move { txn.lock(2, Mode::Exclusive).await.is_ok() })
            }),
        ];
        watchdog("transaction-call-hostile-wakers", move || {
            let table: Arc<LockTable<u32>> = Arc::new(LockTable::builder().shards(1).build());
            let reenter = |table: &Arc<LockTable<u32>>| {
                let table = Arc::clone(table);
                move || {
                    drop(table.try_lock(99));
                    let _ = table.is_locked(&1);
                }
            };
            for (call_name, call) in calls {
                for misbehaviour in 0..5 {
                    for complete in [true, false] {
                        let what = format!(
                            "{call_name}: misbehaviour {misbehaviour}, complete {complete}"
                        );
                        let hostile = match misbehaviour {
                            3 => Hostile::on_clone(reenter(&table)),
                            4 => Hostile::on_wake(reenter(&table)),
                            _ => Hostile::new(),
                        };
                        let waker = hostile.waker();
                        let held = table.try_lock(2).expect("key 2 is free");
                        let mut txn = table.transaction();
                        let mut fut = call(&mut txn);
                        match misbehaviour {
                            0 => hostile.arm_clone_panic(),
                            1 => hostile.arm_wake_panic(),
                            2 => hostile.arm_drop_panic(),
                            _ => {}
                        }
                        let queued = match poll_caught(&mut fut, &waker) {
                            Ok(Poll::Pending) => true,
                            Ok(Poll::Ready(_)) => panic!("{what}: key 2 is held"),
                            Err(payload) => {
                                expect_planted(payload, &what);
                                false
                            }
                        };
                        hostile.disarm_clone_panic();
                        if complete && queued {
                            planted_or(&what, || drop(held));
                            match poll_caught(&mut fut, &waker) {
                                Ok(Poll::Ready(taken)) => {
                                    assert!(taken, "{what}: the keys are had");
                                }
                                Ok(Poll::Pending) => panic!("{what}: key 2 was released"),
                                Err(payload) => {
                                    expect_planted(payload, &what);
                                }
                            }
                            planted_or(&what, || drop(fut));
                        } else {
                            // Dropped while queued (or after its poll
                            // panicked): the table drops its waker, unlocked.
                            planted_or(&what, || drop(fut));
                            planted_or(&what, || drop(held));
                        }
                        planted_or(&what, || drop(txn));
                        // The misbehaviour happened where the table runs the waker.
                        match misbehaviour {
                            0 => assert!(!queued, "{what}: the poll's clone panicked"),
                            1 => assert_eq!(
                                hostile.wake_panics(),
                                usize::from(complete),
                                "{what}: the handoff's wake panicked"
                            ),
                            2 => assert_eq!(
                                hostile.drop_panics(),
                                usize::from(!complete),
                                "{what}: the cancelled wait's waker drop panicked"
                            ),
                            3 => assert!(hostile.clones.load(SeqCst) > 0, "{what}: cloned"),
                            _ => assert_eq!(
                                hostile.wakes(),
                                usize::from(complete),
                                "{what}: woken by the handoff"
                            ),
                        }
                        hostile.disarm_drop_panic();
                        drop(waker);
                        assert_key_free(&table, || 1, &what);
                        assert_key_free(&table, || 2, &what);
                        assert_table_empty(&table, 3, &what);
                    }
                }
            }
        });
    }
    /// An owned transaction's `check` and `renew` settle what they find
    /// (a shared co-holder's lapsed lease) and wake whoever that concerns
    /// only after the transaction's own lock is released: a waker that
    /// calls back into the same transaction (its `check`, its `renew`)
    /// runs, and nothing spins on the transaction's lock.
    #[test]
    fn a_wake_from_an_owned_transactions_check_may_call_back_into_it() {
        struct CallsBack {
            txn: Mutex<Option<Arc<keylock::OwnedTransaction<u32>>>>,
            calls: AtomicUsize,
        }
        impl std::task::Wake for CallsBack {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                let txn = self.txn.lock().unwrap().clone();
                if let Some(txn) = txn {
                    self.calls.fetch_add(1, SeqCst);
                    assert!(txn.check().is_ok(), "the transaction's grant is live");
                    assert!(txn.renew().is_ok(), "and renewable");
                }
            }
        }
        for renewing in [false, true] {
            watchdog("owned check wakes after its lock", move || {
                let clock = ManualClock::new();
                let table = Arc::new(LockTable::<u32>::builder().clock(clock.clone()).build());
                let opts = keylock::TransactionOptions::new().lease(100 * LEASE);
                let txn = Arc::new(table.clone().transaction_owned_with(opts));
                futures::executor::block_on(txn.lock(1, keylock::Mode::Shared)).unwrap();
                // A plain shared co-holder with a short lease, whose loss is
                // watched by a waker that calls back into `txn`.
                let short = table
                    .try_lock_with(1, LockOptions::new().shared().lease(LEASE))
                    .unwrap();
                let calls_back = Arc::new(CallsBack {
                    txn: Mutex::new(None),
                    calls: AtomicUsize::new(0),
                });
                let waker = Waker::from(calls_back.clone());
                let mut lost = Box::pin(short.lost());
                let mut cx = Context::from_waker(&waker);
                assert!(lost.as_mut().poll(&mut cx).is_pending());
                // Lapsed (the clock's own wake of the watcher, if any, is
                // not the one this test is about: the waker calls back only
                // once armed, after it).
                clock.advance(2 * LEASE);
                *calls_back.txn.lock().unwrap() = Some(txn.clone());
                // Settled by the transaction's own visit of key 1: the
                // waker runs then.
                if renewing {
                    assert!(txn.renew().is_ok());
                } else {
                    assert!(txn.check().is_ok());
                }
                assert_eq!(calls_back.calls.load(SeqCst), 1, "woken by the settle");
                assert!(lost.as_mut().poll(&mut cx).is_ready());
                calls_back.txn.lock().unwrap().take();
                drop(lost);
                drop(short);
                let Ok(txn) = Arc::try_unwrap(txn) else {
                    panic!("the last handle");
                };
                txn.commit().unwrap();
                assert!(table.is_empty());
            });
        }
    }

    /// A `lock_all` that took a key, then closes a cycle by its wait for
    /// another and is answered as the deadlock's victim, with a waker that
    /// panics when the abandoned wait drops it: the key it took is released
    /// all the same (its guard is the call's before the wait drops, so the
    /// unwinding releases it), in both ways a `lock_all` reaches its wait:
    /// a held set's (`take_now`) and a fresh fill's second wait.
    #[test]
    fn a_deadlock_victims_lock_all_whose_waker_drop_panics_keeps_nothing() {
        use keylock::{Mode, TransactionError};
        const X: Mode = Mode::Exclusive;
        watchdog("victim-waker-drop", || {
            for fresh in [false, true] {
                let what = format!("fresh fill {fresh}");
                let table: LockTable<u32> = LockTable::new();
                let noop = Waker::noop();
                let (mut a, mut b) = (table.transaction(), table.transaction());
                if !fresh {
                    // A holds 9, so its lock_all is not a fresh fill.
                    ready(&mut Box::pin(a.lock(9, X)), noop, &what).expect("free");
                }
                ready(&mut Box::pin(a.lock(3, X)), noop, &what).expect("free");
                ready(&mut Box::pin(b.lock(2, X)), noop, &what).expect("free");
                // B waits for 3 (A's): B -> A.
                let mut b_waits = Box::pin(b.lock(3, X));
                assert!(poll_caught(&mut b_waits, noop).unwrap().is_pending());
                let hostile = Hostile::new();
                let waker = hostile.waker();
                {
                    // A takes 1, waits for 2 (B's): A -> B -> A, A the victim.
                    let mut call = Box::pin(a.lock_all([(1, X), (2, X)]));
                    hostile.arm_drop_panic();
                    match poll_caught(&mut call, &waker) {
                        Ok(Poll::Ready(Err(TransactionError::Deadlock(_)))) => {}
                        Err(payload) => {
                            expect_planted(payload, &what);
                        }
                        Ok(other) => panic!("{what}: {other:?}"),
                    }
                    hostile.disarm_drop_panic();
                }
                assert!(!table.is_locked(&1), "{what}: {:?}", table.status());
                drop(a);
                drop(b_waits);
                drop(b);
                drop(waker);
                assert!(table.is_empty(), "{what}: {:?}", table.status());
            }
        });
    }

    /// A transaction's first `lock_all` whose third key's `Hash` panics
    /// (the keys are hashed as they are taken): the two keys it had taken
    /// go back, and the transaction, which goes on, holds none of them.
    /// All or nothing, under a panic too.
    #[test]
    fn a_fresh_lock_all_whose_third_key_panics_in_hash_keeps_nothing() {
        watchdog("fresh-lock-all-hash-panics", || {
            let table: LockTable<Key> = LockTable::new();
            let mut txn = table.transaction();
            let asked = [
                (Key::hash_bomb(3), Mode::Exclusive),
                (Key::plain(1), Mode::Exclusive),
                (Key::plain(2), Mode::Shared),
            ];
            let out = planted_or("a lock_all whose key panics in Hash", || {
                poll_once(txn.lock_all(asked)).is_ready()
            });
            assert!(out.is_none(), "the third key's Hash panicked");
            assert_eq!(txn.len(), 0, "the transaction holds nothing of the call");
            assert_eq!(
                (txn.count(&Key::plain(1)), txn.count(&Key::plain(2))),
                (0, 0)
            );
            assert_key_free(&table, || Key::plain(1), "after the panic");
            assert_key_free(&table, || Key::plain(2), "after the panic");
            // And it goes on: the same keys, without the bomb.
            let got = poll_once(txn.lock_all([
                (Key::plain(1), Mode::Exclusive),
                (Key::plain(2), Mode::Shared),
            ]));
            let Poll::Ready(got) = got else {
                panic!("free keys")
            };
            assert_eq!(got.expect("free keys").acquired(), 2);
            txn.commit().expect("no lease");
            assert_table_empty(&table, Key::plain(9), "after the commit");
        });
    }

    /// A transaction's first `lock_all` of more keys than its set keeps in
    /// place, whose third key's `Eq` panics in the table's probe (the key
    /// is held, so the probe compares it): the two keys it had taken, kept
    /// aside until the call is done, are released as the panic unwinds,
    /// the transaction holds nothing, and the holder's key is untouched.
    #[test]
    fn a_fresh_lock_all_whose_third_key_panics_in_eq_keeps_nothing() {
        watchdog("fresh-lock-all-eq-panics", || {
            let table: LockTable<Key> = LockTable::new();
            let holder = table.try_lock(Key::plain(3)).expect("key 3 is free");
            let mut txn = table.transaction();
            let dropped = Arc::new(AtomicBool::new(false));
            let bomb = {
                let dropped = dropped.clone();
                Key::eq_bomb(3, move || dropped.store(true, SeqCst))
            };
            let asked = [
                (Key::plain(1), Mode::Exclusive),
                (Key::plain(2), Mode::Shared),
                (bomb, Mode::Exclusive),
            ];
            let out = planted_or("a lock_all whose key panics in Eq", || {
                poll_once(txn.lock_all(asked)).is_ready()
            });
            assert!(out.is_none(), "the third key's Eq panicked");
            assert!(dropped.load(SeqCst), "the panicking key was dropped");
            assert_eq!(txn.len(), 0, "the transaction holds nothing of the call");
            assert_key_free(&table, || Key::plain(1), "after the panic");
            assert_key_free(&table, || Key::plain(2), "after the panic");
            assert!(
                table.try_lock(Key::plain(3)).is_err(),
                "the holder still has key 3"
            );
            drop(holder);
            txn.commit().expect("no lease");
            assert_table_empty(&table, Key::plain(9), "after the holder let go");
        });
    }

    /// A transaction's first `lock_all` takes key 1, whose instance panics
    /// when dropped, and waits for key 2, held elsewhere, until the
    /// transaction's deadline passes. Failing, the call takes key 1 back
    /// out of the set and releases it; the table drops the key it kept for
    /// 1, which panics: the poll panics with it, key 1 is free all the
    /// same, nothing of the call waits for key 2 any more, and the
    /// transaction holds nothing (all or nothing, on a failure too).
    #[test]
    fn a_fresh_lock_all_that_times_out_releases_its_key_whose_drop_panics() {
        watchdog("fresh-lock-all-times-out", || {
            let clock = ManualClock::new();
            let table: LockTable<Key> = LockTable::builder().clock(clock.clone()).build();
            let holder = table.try_lock(Key::plain(2)).expect("key 2 is free");
            let mut txn =
                table.transaction_with(TransactionOptions::new().timeout(Duration::from_secs(1)));
            let drops = Arc::new(AtomicUsize::new(0));
            let asked = [
                (Key::drop_bomb(1, &drops), Mode::Exclusive),
                (Key::plain(2), Mode::Exclusive),
            ];
            let mut call = Box::pin(txn.lock_all(asked));
            pending(&mut call, Waker::noop(), "the call waits for key 2");
            assert!(table.is_locked(&Key::plain(1)), "key 1 was taken");
            assert_eq!(table.waiters(&Key::plain(2)), 1, "and it waits for 2");
            clock.advance(Duration::from_secs(2));
            match poll_caught(&mut call, Waker::noop()) {
                Err(payload) => assert_eq!(expect_planted(payload, "the failure"), "Key::drop"),
                Ok(other) => panic!("the released key's drop panics, not {other:?}"),
            }
            assert_eq!(
                drops.load(SeqCst),
                1,
                "the table dropped the key it kept for 1"
            );
            drop(call);
            assert_eq!(txn.len(), 0, "the transaction holds nothing of the call");
            assert_key_free(&table, || Key::plain(1), "after the failure");
            assert_eq!(table.waiters(&Key::plain(2)), 0, "nobody waits for key 2");
            drop(holder);
            txn.commit().expect("no lease");
            assert_table_empty(&table, Key::plain(9), "after the holder let go");
        });
    }

    /// A lock that waits clones its waker right after linking (user code,
    /// no lock held). A clone that releases the holder gets the waiter
    /// granted before it arms, so the clone is left over, to be dropped
    /// only once the guard exists (the first poll's fast way out hands its
    /// guard back with nothing deferred; this one must not take it). When
    /// that drop panics, the poll panics with the guard built: unwinding
    /// drops the guard, and the key is free.
    #[test]
    fn a_wait_granted_as_it_registers_drops_its_spare_waker_after_the_guard() {
        watchdog("granted-while-registering", || {
            let table: Arc<LockTable<u32>> = Arc::new(LockTable::new());
            for drop_panics in [false, true] {
                let what = if drop_panics {
                    "the spare's drop panics"
                } else {
                    "a quiet drop"
                };
                let holder = Arc::new(Mutex::new(Some(
                    table.clone().try_lock_owned(1).expect("key 1 is free"),
                )));
                let released = Arc::new(AtomicBool::new(false));
                let hostile = {
                    let (holder, released) = (holder.clone(), released.clone());
                    Hostile::on_clone(move || {
                        if let Some(guard) = holder.lock().unwrap().take() {
                            drop(guard);
                            released.store(true, SeqCst);
                        }
                    })
                };
                let waker = hostile.waker();
                let mut fut = Box::pin(table.lock(1));
                if drop_panics {
                    hostile.arm_drop_panic();
                    let polled = poll_caught(&mut fut, &waker);
                    let payload = polled
                        .err()
                        .unwrap_or_else(|| panic!("{what}: the poll panics"));
                    assert_eq!(expect_planted(payload, what), "Waker::drop", "{what}");
                    assert_eq!(hostile.drop_panics(), 1, "{what}: the spare was dropped");
                } else {
                    let guard = ready(&mut fut, &waker, what);
                    assert!(table.is_locked(&1), "{what}: the guard holds the key");
                    assert_eq!(
                        table.stats().handoffs,
                        1,
                        "{what}: handed over by the release"
                    );
                    drop(guard);
                }
                assert!(
                    released.load(SeqCst),
                    "{what}: precondition: the clone released the holder"
                );
                drop(fut);
                assert_key_free(&*table, || 1, what);
            }
            assert_table_empty(&*table, 2, "after the granted registrations");
        });
    }

    /// An owned transaction's waiting call registers its waker with the
    /// transaction, to be woken when the transaction ends (or another of
    /// its calls takes a grant). That waker's clone is user code: here it
    /// reads the transaction's keys, which takes the transaction's own
    /// lock, so a clone made under that lock would spin for ever. Then the
    /// waker's clone panics: the panic surfaces in the call's poll, and the
    /// call dropped leaves nothing behind.
    #[test]
    fn an_owned_calls_waker_clone_that_reads_its_transaction_does_not_deadlock() {
        use keylock::Mode;
        watchdog("owned-call-reentrant-clone", || {
            let table: Arc<LockTable<u32>> = Arc::new(LockTable::builder().shards(1).build());
            let txn = Arc::new(table.clone().transaction_owned());
            assert!(
                txn.blocking_lock(1, Mode::Exclusive).is_ok(),
                "key 1 is free"
            );
            let held = table.try_lock(2).expect("key 2 is free");
            let reads = Arc::new(AtomicUsize::new(0));
            let hostile = {
                let txn = Arc::downgrade(&txn);
                let reads = reads.clone();
                Hostile::on_clone(move || {
                    if let Some(txn) = txn.upgrade() {
                        if txn.keys().contains(&(1, Mode::Exclusive)) {
                            reads.fetch_add(1, SeqCst);
                        }
                    }
                })
            };
            let waker = hostile.waker();
            let mut call = Box::pin(txn.lock(2, Mode::Exclusive));
            pending(&mut call, &waker, "the call waits for key 2");
            assert!(
                reads.load(SeqCst) >= 2,
                "precondition: the table's waiter and the transaction's watch cloned the waker"
            );
            drop(held);
            let got = ready(&mut call, &waker, "the call is granted key 2");
            assert!(got.is_ok(), "the call took key 2: {got:?}");
            drop(call);
            // A waiting call whose waker's clone panics: the panic surfaces
            // in its poll (the call is then done), and dropping the call
            // leaves nothing of it: the key goes on to the next waiter.
            let held = table.try_lock(3).expect("key 3 is free");
            let mut call = Box::pin(txn.lock(3, Mode::Exclusive));
            pending(
                &mut call,
                &Hostile::new().waker(),
                "the call waits for key 3",
            );
            let panicky = Hostile::new();
            panicky.arm_clone_panic();
            let repolled = catch_unwind(AssertUnwindSafe(|| {
                let _ = call
                    .as_mut()
                    .poll(&mut Context::from_waker(&panicky.waker()));
            }));
            assert!(
                repolled.is_err(),
                "the planted clone panic surfaces in the poll"
            );
            panicky.disarm_clone_panic();
            drop(call);
            let mut next = Box::pin(table.lock(3));
            pending(
                &mut next,
                &Hostile::new().waker(),
                "a plain waiter queues for key 3",
            );
            drop(held);
            drop(ready(
                &mut next,
                &Hostile::new().waker(),
                "key 3 goes to the plain waiter",
            ));
            let txn = Arc::try_unwrap(txn)
                .map_err(|_| ())
                .expect("the hook holds a weak handle");
            assert_eq!(txn.keys(), [(1, Mode::Exclusive), (2, Mode::Exclusive)]);
            txn.commit().expect("no lease");
            assert_table_empty(&*table, 3, "after the owned call's re-entrant waker");
        });
    }

    /// A key whose `Clone` and `Drop` call back into the owned transaction
    /// that holds it (by a thread-local handle; once per call, not from
    /// inside a call back).
    #[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
    struct Reentrant(u32);

    thread_local! {
        static REENTERED: std::cell::RefCell<Option<std::sync::Weak<keylock::OwnedTransaction<Reentrant>>>> =
            const { std::cell::RefCell::new(None) };
        static INSIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        static CALLS_BACK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// Reads the transaction through every method that takes its lock (and,
    /// for `keys`, the shard locks of its keys).
    fn call_back_into_transaction() {
        if INSIDE.get() {
            return;
        }
        let Some(txn) = REENTERED.with(|t| t.borrow().as_ref().and_then(std::sync::Weak::upgrade))
        else {
            return;
        };
        INSIDE.set(true);
        let listed = txn.keys().len();
        assert!(
            listed <= txn.len() + 1,
            "listed {listed} of {} keys",
            txn.len()
        );
        let _ = txn.count(&Reentrant(u32::MAX));
        INSIDE.set(false);
        CALLS_BACK.set(CALLS_BACK.get() + 1);
        drop(txn);
    }

    impl Clone for Reentrant {
        fn clone(&self) -> Self {
            call_back_into_transaction();
            Reentrant(self.0)
        }
    }

    impl Drop for Reentrant {
        fn drop(&mut self) {
            call_back_into_transaction();
        }
    }

    /// How many call backs `f` made.
    fn calls_back(f: impl FnOnce()) -> usize {
        let before = CALLS_BACK.get();
        f();
        CALLS_BACK.get() - before
    }

    #[test]
    fn an_owned_transactions_key_whose_clone_and_drop_call_back_into_it_does_not_deadlock() {
        use keylock::{Mode, TransactionError};
        watchdog("owned-key-reentrant-clone", || {
            let table: Arc<LockTable<Reentrant>> = Arc::new(LockTable::builder().shards(1).build());
            let txn = Arc::new(table.clone().transaction_owned());
            REENTERED.with(|t| *t.borrow_mut() = Some(Arc::downgrade(&txn)));
            let waker = Hostile::new().waker();

            // A new key that must be waited for: the claim's name and the
            // table's copy are clones.
            let held = table.try_lock(Reentrant(1)).expect("key 1 is free");
            let mut call = Box::pin(txn.lock(Reentrant(1), Mode::Exclusive));
            let made = calls_back(|| pending(&mut call, &waker, "the call waits for key 1"));
            assert!(
                made >= 2,
                "the wait cloned the key twice ({made} call backs)"
            );
            drop(held);
            let got = ready(&mut call, &waker, "the call is granted key 1");
            assert!(got.is_ok(), "the call took key 1: {got:?}");
            drop(call);

            // An upgrade that waits for another reader: its name is a clone.
            assert!(txn.blocking_lock(Reentrant(2), Mode::Shared).is_ok());
            let reader = table
                .try_lock_shared(Reentrant(2))
                .expect("key 2 is shared");
            let mut call = Box::pin(txn.lock(Reentrant(2), Mode::Exclusive));
            let made = calls_back(|| pending(&mut call, &waker, "the upgrade waits"));
            assert!(made >= 1, "the upgrade cloned its name ({made} call backs)");
            drop(reader);
            let got = ready(&mut call, &waker, "the upgrade is granted");
            assert!(got.is_ok(), "key 2 upgraded: {got:?}");
            drop(call);

            // A `lock_all` whose second key must be waited for: every
            // request's name is a clone.
            let held = table.try_lock(Reentrant(4)).expect("key 4 is free");
            let mut call = Box::pin(txn.lock_all([
                (Reentrant(3), Mode::Exclusive),
                (Reentrant(4), Mode::Exclusive),
            ]));
            let made = calls_back(|| pending(&mut call, &waker, "the lock_all waits for key 4"));
            assert!(
                made >= 2,
                "the lock_all cloned its names ({made} call backs)"
            );
            drop(held);
            let got = ready(&mut call, &waker, "the lock_all is granted");
            assert!(got.is_ok(), "keys 3 and 4 taken: {got:?}");
            drop(call);

            // The list of keys, an unlock of a key not held, a check and a
            // renewal that name a revoked key: each clones a key.
            let made = calls_back(|| {
                let mut keys: Vec<_> = txn.keys().into_iter().map(|(k, m)| (k.0, m)).collect();
                keys.sort();
                assert_eq!(
                    keys,
                    [
                        (1, Mode::Exclusive),
                        (2, Mode::Exclusive),
                        (3, Mode::Exclusive),
                        (4, Mode::Exclusive)
                    ]
                );
            });
            assert!(made >= 4, "the list cloned every key ({made} call backs)");
            let made = calls_back(|| {
                let unheld = txn.unlock(&Reentrant(9));
                assert!(
                    matches!(unheld, Err(TransactionError::NotHeld { key: Reentrant(9) })),
                    "{unheld:?}"
                );
            });
            assert!(made >= 1, "the error's key is a clone ({made} call backs)");
            assert!(table.revoke(&Reentrant(3)).is_some(), "key 3 is revoked");
            let made = calls_back(|| {
                let checked = txn.check();
                assert!(
                    matches!(
                        checked,
                        Err(TransactionError::Expired {
                            key: Reentrant(3),
                            ..
                        })
                    ),
                    "{checked:?}"
                );
                let renewed = txn.renew();
                assert!(
                    matches!(
                        renewed,
                        Err(TransactionError::Expired {
                            key: Reentrant(3),
                            ..
                        })
                    ),
                    "{renewed:?}"
                );
            });
            assert!(made >= 2, "the errors' keys are clones ({made} call backs)");

            REENTERED.with(|t| *t.borrow_mut() = None);
            let txn = Arc::try_unwrap(txn)
                .map_err(|_| ())
                .expect("the call backs hold a weak handle");
            assert!(
                matches!(
                    txn.commit(),
                    Err(TransactionError::Expired {
                        key: Reentrant(3),
                        ..
                    })
                ),
                "the commit names the revoked key"
            );
            assert_table_empty(&*table, Reentrant(5), "after the re-entrant keys");
        });
    }

    /// A forgotten upgrade orphaned by its guard's drop is told as it is
    /// unlinked: a wake that panics there reaches the releaser (the guard's
    /// drop) once, the writer queued behind is still woken and granted, and
    /// nothing is stranded. With a lapsed upgrading grant and a stored key
    /// whose drop panics, the entry still goes once its fenced guard does.
    #[test]
    fn an_orphaned_upgrades_panicking_waker_and_key_strand_nothing() {
        watchdog("orphaned-upgrade-hostile", || {
            // The guard dropped: the notice's wake panics in that drop.
            let table: LockTable<Key> = LockTable::builder().shards(1).build();
            let mut upgrading = table.try_lock_shared(Key::plain(1)).expect("free");
            let reader = table.try_lock_shared(Key::plain(1)).expect("shared");
            let told = Hostile::new();
            {
                let mut up = Box::pin(upgrading.upgrade());
                pending(&mut up, &told.waker(), "the reader holds key 1");
                std::mem::forget(up);
            }
            let writer_waker = Hostile::new();
            let mut writer = Box::pin(table.lock(Key::plain(1)));
            pending(&mut writer, &writer_waker.waker(), "readers hold key 1");
            told.arm_wake_panic();
            let released = catch_unwind(AssertUnwindSafe(|| drop(upgrading)));
            let payload = released.expect_err("the notice's wake panics in the releaser");
            expect_planted(payload, "the orphan's notice");
            assert_eq!(told.wake_panics(), 1, "the orphan was told once");
            assert_eq!(table.waiters(&Key::plain(1)), 1, "only the writer waits");
            drop(reader);
            assert_eq!(
                writer_waker.wakes(),
                1,
                "the writer is woken by the reader's release"
            );
            let guard = ready(&mut writer, &writer_waker.waker(), "the writer takes key 1");
            drop(guard);
            drop(writer);
            assert_key_free(
                &table,
                || Key::plain(1),
                "after the orphan's panicking notice",
            );

            // A lapsed upgrading grant: the reader's release unlinks the
            // orphan (its wake and its waker's drop panic), and the entry,
            // whose stored key's drop panics, goes with the fenced guard.
            let clock = ManualClock::new();
            let table: LockTable<Key> = LockTable::builder().shards(1).clock(clock.clone()).build();
            let drops = Arc::new(AtomicUsize::new(0));
            let lease = LockOptions::new().lease(Duration::from_secs(1)).shared();
            let mut upgrading = table
                .try_lock_with(Key::drop_bomb(2, &drops), lease)
                .expect("free");
            let reader = table.try_lock_shared(Key::plain(2)).expect("shared");
            let told = Hostile::new();
            {
                let mut up = Box::pin(upgrading.upgrade());
                pending(&mut up, &told.waker(), "the reader holds key 2");
                std::mem::forget(up);
            }
            clock.advance(Duration::from_secs(2));
            // The lapse itself may wake the upgrade (its grant's timer).
            let woken_before = told.wakes();
            told.arm_wake_panic();
            told.arm_drop_panic();
            let released = catch_unwind(AssertUnwindSafe(|| drop(reader)));
            if let Err(payload) = released {
                expect_planted(payload, "the lapsed orphan's notice");
            }
            assert_eq!(
                told.wakes() - woken_before + told.wake_panics(),
                1,
                "the orphan was told once"
            );
            assert_eq!(
                table.waiters(&Key::plain(2)),
                0,
                "the orphan left the queue"
            );
            assert!(
                !table.is_locked(&Key::plain(2)),
                "the lapsed grant holds nothing"
            );
            assert_eq!(
                drops.load(SeqCst),
                0,
                "the fenced guard keeps the entry and its key"
            );
            let released = catch_unwind(AssertUnwindSafe(|| drop(upgrading)));
            let payload = released.expect_err("the stored key's drop panics as the entry goes");
            assert_eq!(expect_planted(payload, "the entry's removal"), "Key::drop");
            assert_eq!(drops.load(SeqCst), 1, "the stored key was dropped once");
            assert_table_empty(&table, Key::plain(3), "after the lapsed orphan");
            assert_key_free(&table, || Key::plain(2), "after the lapsed orphan");
        });
    }
}
