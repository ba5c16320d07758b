//! Loom models of transactions (owners) ending or cancelling while a
//! multi-key `lock_all` is pending: a borrowed transaction's pending call
//! dropped (then the transaction) while the key it waits for is released; an
//! owned transaction dropped on one thread while the key its pending call
//! waits for is released on another and the call is polled on a third (or
//! while the call's first poll registers its waker, the end then being the
//! only wake it gets); a pending call dropped while its upgrade of a shared
//! key races the other reader's release (the undo by downgrade); two calls
//! of one owned transaction racing for the same new key (one takes it, the
//! other is counted on it, neither waits on its own grant); an owned
//! transaction's end racing the release that grants a pending lock never
//! polled again (nothing held, nobody waiting, before the call is dropped),
//! and the end racing the poll that sees such a lock's grant (the call's
//! cell cancelled before, during or after the poll);
//! deadlock detection racing a release that breaks the cycle (no false
//! answer), the cancel of a waiter of the cycle as it closes (answered
//! once, or not at all, never a hang), and a transaction that holds
//! nothing (not registered) whose wait is closed into a soft cycle by one
//! queueing behind it (found, and broken by moving that one ahead, never
//! missed); an owned transaction's upgrade at once, which makes a queued
//! transaction wait for it, racing its other call's first wait (the cycle
//! answered at that poll or on the wake the upgrade gives, never left
//! pending unwoken: with the epoch read before the waker was registered,
//! this model finds the lost wake-up); an owned transaction's list of its
//! keys, pinned under its lock and cloned after it, racing its unlock of a
//! listed key that a waiter takes.
//!
//! Run with (what `.ci/run` does, then again without `LOOM_MAX_PREEMPTIONS`;
//! each model takes well under a second either way, but model h, whose
//! exhaustive run takes minutes and which caps itself at five preemptions:
//! two seconds):
//!
//! ```text
//! RUSTC_WRAPPER="$PWD/.ci/loom-rustc" LOOM_MAX_PREEMPTIONS=3 \
//!     CARGO_TARGET_DIR=target/loom cargo test --release --features test-util \
//!     --test loom_owners -- --nocapture
//! ```
//!
//! Same approach as `tests/loom.rs` and `tests/loom_modes.rs` (whose helpers
//! are copied here, not shared): one shard and a deterministic hasher;
//! futures pinned in boxes and polled by hand with a waker that counts its
//! wakes in a loom atomic (once no other thread is left, a pending future
//! must have been woken since its last poll started: no lost wake-up).
//! Under `--cfg loom` an owned transaction's state (its mutex and its
//! *ended* mark, `src/transactions/access.rs`) is loom's too, so the end racing a
//! pending call's registration of its waker is explored. Holders of a key
//! are counted in a loom atomic from the moment they have their grant until
//! just before they release it ([`Inside`], [`Rw`]): never two writers,
//! never a writer beside a reader. The keys are picked so that `lock_all`
//! takes them in the order named (its canonical order is by key). Each model checks that every outcome it expects was reached by
//! some interleaving, so that none of its branches is vacuous. No leases
//! or timeouts: `tests/loom_leases.rs` models time.

#[cfg(not(loom))]
#[test]
#[ignore = "a loom model: run it with `.ci/run loom` (the command is in this file's header)"]
fn loom_models_run_only_under_cfg_loom() {}

#[cfg(loom)]
mod models {
    use std::collections::hash_map::DefaultHasher;
    use std::collections::BTreeSet;
    use std::future::Future;
    use std::hash::{BuildHasher, BuildHasherDefault};
    use std::ops::{Deref, DerefMut};
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex as StdMutex};
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Instant;

    use keylock::{LockTable, Mode, OwnedGuard, TransactionError};
    use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use loom::thread;

    type Hasher = BuildHasherDefault<DefaultHasher>;
    type Table = LockTable<u32, Hasher>;
    type Guard = OwnedGuard<u32, Hasher>;

    /// A one-shard table with a deterministic hasher.
    fn table() -> Arc<Table> {
        Arc::new(
            LockTable::<u32>::builder()
                .shards(1)
                .hasher(Hasher::default())
                .build(),
        )
    }

    /// Three keys in `lock_all`'s canonical order (by key).
    fn keys() -> [u32; 3] {
        [1, 2, 3]
    }

    /// The outcomes the interleavings of one model reached.
    #[derive(Default)]
    struct Seen(StdMutex<BTreeSet<&'static str>>);

    impl Seen {
        fn note(&self, outcome: &'static str) {
            self.0.lock().unwrap().insert(outcome);
        }
    }

    /// Runs one model, prints how many interleavings it explored, and checks
    /// that exactly the outcomes in `expect` were reached.
    fn model<F>(name: &str, expect: &[&'static str], f: F)
    where
        F: Fn(&Seen) + Sync + Send + 'static,
    {
        model_within(name, expect, None, f);
    }

    /// [`model`], with at most `cap` preemptions even when the run asks for
    /// none (exhaustive): for a model whose exhaustive run takes minutes.
    fn model_within<F>(name: &str, expect: &[&'static str], cap: Option<usize>, f: F)
    where
        F: Fn(&Seen) + Sync + Send + 'static,
    {
        let iterations = Arc::new(StdAtomicUsize::new(0));
        let seen = Arc::new(Seen::default());
        let start = Instant::now();
        let (counter, outcomes) = (iterations.clone(), seen.clone());
        let mut builder = loom::model::Builder::new();
        if let Some(cap) = cap {
            builder.preemption_bound = Some(builder.preemption_bound.map_or(cap, |b| b.min(cap)));
        }
        builder.check(move || {
            counter.fetch_add(1, Relaxed);
            f(&outcomes);
        });
        let seen = seen.0.lock().unwrap().clone();
        eprintln!(
            "loom model {name}: {} interleavings in {:.2?} (LOOM_MAX_PREEMPTIONS={}); outcomes {seen:?}",
            iterations.load(Relaxed),
            start.elapsed(),
            std::env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "unbounded".into())
                + &cap.map_or(String::new(), |cap| format!(", capped at {cap}")),
        );
        let expect: BTreeSet<_> = expect.iter().copied().collect();
        assert_eq!(seen, expect, "outcomes reached (left) vs expected (right)");
    }

    // ---------------------------------------------------------------------------
    // Wakers, hand-polled futures, holders
    // ---------------------------------------------------------------------------

    /// A waker that counts its wakes in a loom atomic.
    struct CountingWaker {
        wakes: AtomicUsize,
    }

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.fetch_add(1, SeqCst);
        }
    }

    /// A future polled by hand with a counting waker, pinned in a box.
    struct Polled<F: Future> {
        fut: Option<Pin<Box<F>>>,
        counter: Arc<CountingWaker>,
        waker: Waker,
        /// The waker's wakes when the last poll started.
        polled_at: usize,
    }

    impl<F: Future> Polled<F> {
        fn new(fut: F) -> Self {
            let counter = Arc::new(CountingWaker {
                wakes: AtomicUsize::new(0),
            });
            Self {
                fut: Some(Box::pin(fut)),
                waker: Waker::from(counter.clone()),
                counter,
                polled_at: 0,
            }
        }

        /// Polls once; `Some` when the future completed (it is gone then).
        fn poll(&mut self) -> Option<F::Output> {
            self.polled_at = self.wakes();
            let fut = self.fut.as_mut().expect("polled after completion");
            match fut.as_mut().poll(&mut Context::from_waker(&self.waker)) {
                Poll::Ready(out) => {
                    self.fut = None;
                    Some(out)
                }
                Poll::Pending => None,
            }
        }

        fn wakes(&self) -> usize {
            self.counter.wakes.load(SeqCst)
        }

        /// Whether the waker was woken since the last poll started.
        fn woken(&self) -> bool {
            self.wakes() > self.polled_at
        }

        /// Drops the future, cancelling it if it is still pending.
        fn cancel(&mut self) {
            self.fut = None;
        }
    }

    impl<F: Future> Drop for Polled<F> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                // Leak the (pinned, so never freed) future rather than touch
                // the table (and loom) while unwinding, which would abort the
                // test binary and hide the failure's message.
                std::mem::forget(self.fut.take());
            }
        }
    }

    /// Drives a pending future to completion once no other thread is left, as
    /// an executor would: polled only if woken since its last poll started.
    fn finish<F: Future>(w: &mut Polled<F>, what: &str) -> F::Output {
        for _ in 0..3 {
            assert!(
                w.woken(),
                "{what}: pending and not woken since its last poll (lost wake-up)"
            );
            if let Some(out) = w.poll() {
                return out;
            }
        }
        panic!("{what}: woken three times and still pending with nothing left to wait for");
    }

    /// A value (a transaction) that is leaked, not dropped, if the model
    /// fails while it is alive: its drop would touch the table (and loom)
    /// while unwinding.
    struct Quiet<T>(Option<T>);

    impl<T> Quiet<T> {
        fn new(value: T) -> Self {
            Self(Some(value))
        }
    }

    impl<T> Deref for Quiet<T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0.as_ref().unwrap()
        }
    }

    impl<T> DerefMut for Quiet<T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0.as_mut().unwrap()
        }
    }

    impl<T> Drop for Quiet<T> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                std::mem::forget(self.0.take());
            }
        }
    }

    /// How many holders one key has, as the holders themselves see it (all
    /// exclusive).
    struct Inside(AtomicUsize);

    impl Inside {
        fn new() -> Arc<Self> {
            Arc::new(Self(AtomicUsize::new(0)))
        }

        fn enter(&self) {
            let before = self.0.fetch_add(1, SeqCst);
            assert_eq!(before, 0, "two holders of the key at once");
        }

        fn exit(&self) {
            let before = self.0.fetch_sub(1, SeqCst);
            assert_eq!(before, 1, "holder count corrupted");
        }
    }

    /// The holders of one key in both modes: readers in the low bits, a
    /// writer as `WRITER`; each step is one read-modify-write.
    struct Rw(AtomicUsize);

    const WRITER: usize = 1 << 16;

    impl Rw {
        fn new() -> Arc<Self> {
            Arc::new(Self(AtomicUsize::new(0)))
        }

        fn enter(&self, mode: Mode) {
            match mode {
                Mode::Shared => {
                    let before = self.0.fetch_add(1, SeqCst);
                    assert!(before < WRITER, "a reader beside a writer");
                }
                Mode::Exclusive => {
                    let before = self.0.fetch_add(WRITER, SeqCst);
                    assert_eq!(before, 0, "a writer beside another holder");
                }
            }
        }

        fn exit(&self, mode: Mode) {
            match mode {
                Mode::Shared => {
                    let before = self.0.fetch_sub(1, SeqCst);
                    assert!(before % WRITER >= 1, "reader count corrupted");
                }
                Mode::Exclusive => {
                    let before = self.0.fetch_sub(WRITER, SeqCst);
                    assert_eq!(before, WRITER, "writer count corrupted");
                }
            }
        }

        fn is_free(&self) -> bool {
            self.0.load(SeqCst) == 0
        }
    }

    /// Who counts a guard's holding.
    trait Count {
        fn enter(&self, mode: Mode);
        fn exit(&self, mode: Mode);
    }

    impl Count for Inside {
        fn enter(&self, _: Mode) {
            Inside::enter(self);
        }
        fn exit(&self, _: Mode) {
            Inside::exit(self);
        }
    }

    impl Count for Rw {
        fn enter(&self, mode: Mode) {
            Rw::enter(self, mode);
        }
        fn exit(&self, mode: Mode) {
            Rw::exit(self, mode);
        }
    }

    /// A guard counted for as long as it holds its key.
    struct Holding<C: Count> {
        guard: Option<Guard>,
        count: Arc<C>,
        mode: Mode,
    }

    impl<C: Count> Holding<C> {
        fn new(guard: Guard, count: &Arc<C>) -> Self {
            let mode = guard.mode();
            count.enter(mode);
            Self {
                guard: Some(guard),
                count: count.clone(),
                mode,
            }
        }
    }

    impl<C: Count> Drop for Holding<C> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                std::mem::forget(self.guard.take());
                return;
            }
            // Leave before releasing: once released a successor may enter.
            self.count.exit(self.mode);
            drop(self.guard.take());
        }
    }

    const X: Mode = Mode::Exclusive;
    const S: Mode = Mode::Shared;

    // ---------------------------------------------------------------------------
    // (a) a borrowed transaction's pending lock_all dropped, then the owner
    // ---------------------------------------------------------------------------

    /// (a) A borrowed transaction's `lock_all([(a, X), (b, X)])` has taken
    /// `a` and waits for `b`, held by a plain guard; a plain waiter is queued
    /// on `b` behind it. Another thread releases `b` while the owner's thread
    /// drops the pending call and then the transaction.
    ///
    /// Either the call is cancelled before the release (which then grants
    /// the plain waiter), or the release grants the call's waiter and the
    /// drop passes that unobserved grant on. Either way `a` is released by
    /// the undo, the plain waiter is granted `b` and woken once (no lost
    /// wake-up), never beside another holder, and once it is gone the table
    /// is empty and consistent.
    #[test]
    fn borrowed_lock_all_dropped_vs_release() {
        model(
            "a: borrowed lock_all dropped vs release",
            &[
                "cancelled before the grant",
                "dropped with an unobserved grant",
            ],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let inside = Inside::new();
                let held = Holding::new(table.clone().try_lock_owned(b).unwrap(), &inside);
                let mut txn = Quiet::new(table.transaction());
                let mut call = Polled::new(txn.lock_all([(a, X), (b, X)]));
                assert!(call.poll().is_none(), "b is held: the call waits");
                assert!(table.is_locked(&a), "a is taken at once");
                let mut next = Polled::new(table.clone().lock_owned(b));
                assert!(next.poll().is_none(), "b is held: the plain waiter queues");
                assert_eq!(table.waiters(&b), 2);

                let call_waker = call.counter.clone();
                let release = thread::spawn(move || drop(held));
                call.cancel();
                drop(call);
                assert!(txn.is_empty(), "a cancelled call left keys in the set");
                drop(txn);
                release.join().unwrap();

                let call_wakes = call_waker.wakes.load(SeqCst);
                assert!(call_wakes <= 1, "the call woken {call_wakes} times");
                assert!(!table.is_locked(&a), "a still held after the undo");
                let g = Holding::new(finish(&mut next, "the waiter behind the call"), &inside);
                assert_eq!(next.wakes(), 1, "the plain waiter woken more than once");
                drop(g);
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
                let stats = table.stats();
                seen.note(match stats.handoffs {
                    1 => "cancelled before the grant",
                    2 => "dropped with an unobserved grant",
                    n => panic!("{n} handoffs"),
                });
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (b) an owned transaction dropped while its lock_all is pending
    // ---------------------------------------------------------------------------

    /// (b) An `OwnedTransaction` holds `a`; its `lock_all([(b, X), (c, S)])`
    /// waits for `b`, held by a plain guard; a plain waiter is queued on `b`
    /// behind it. Thread B drops the transaction (its last handle) while
    /// thread C releases `b`; the main thread (A) polls the call again if it
    /// is woken meanwhile, and once B and C are done, drives it as an
    /// executor would.
    ///
    /// The call fails with `Ended` (releasing what it got: `b`'s grant, or
    /// its place in the queue), or, if it completed before the end, its keys
    /// are released by the end. No lost wake-up (of the call, and of the
    /// plain waiter, which is then granted `b`, never beside another
    /// holder); at the end nothing is held.
    #[test]
    fn owned_dropped_while_lock_all_pending() {
        model(
            "b: owned transaction dropped while lock_all pending",
            &["ended while pending", "completed, then released by the end"],
            |seen| {
                let table = table();
                let [a, b, c] = keys();
                let inside = Inside::new();
                let txn = table.clone().transaction_owned();
                match Polled::new(txn.lock(a, X)).poll() {
                    Some(Ok(_)) => {}
                    other => panic!("a is free: taken at once, got {other:?}"),
                }
                let held = Holding::new(table.clone().try_lock_owned(b).unwrap(), &inside);
                let mut call = Polled::new(txn.lock_all([(b, X), (c, S)]));
                assert!(call.poll().is_none(), "b is held: the call waits");
                let mut next = Polled::new(table.clone().lock_owned(b));
                assert!(next.poll().is_none(), "b is held: the plain waiter queues");

                let end = thread::spawn(move || drop(txn));
                let release = thread::spawn(move || drop(held));
                let racing = if call.woken() { call.poll() } else { None };
                end.join().unwrap();
                release.join().unwrap();

                let out = match racing {
                    Some(out) => out,
                    None => finish(&mut call, "the pending lock_all"),
                };
                seen.note(match out {
                    Ok(set) => {
                        assert_eq!(set.acquired(), 2);
                        "completed, then released by the end"
                    }
                    Err(TransactionError::Ended) => "ended while pending",
                    Err(e) => panic!("unexpected error: {e}"),
                });
                drop(call);
                assert!(!table.is_locked(&a), "the end did not release a");
                assert!(!table.is_locked(&c), "c held after the end");
                let g = Holding::new(finish(&mut next, "the waiter behind the call"), &inside);
                drop(g);
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (b2) As (b), but the key the call waits for stays held, so only the
    /// end can wake it: thread B drops the transaction while the main thread
    /// polls the call for the first time (it takes `a` at once, then
    /// registers its wait for `b` and its waker with the transaction).
    ///
    /// The call fails with `Ended`: on that poll (the end came first, or
    /// during it), or, left pending, woken by the end (a registration the
    /// end missed would leave it asleep: a lost wake-up). Nothing it took is
    /// held afterwards: only `b`'s plain guard, and once that is gone the
    /// table is empty.
    #[test]
    fn owned_dropped_vs_first_poll_of_lock_all() {
        model(
            "b2: owned transaction dropped vs lock_all's first poll",
            &["ended on the first poll", "ended while pending"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let txn = table.clone().transaction_owned();
                let held = table.clone().try_lock_owned(b).unwrap();
                let mut call = Polled::new(txn.lock_all([(a, X), (b, X)]));

                let end = thread::spawn(move || drop(txn));
                let first = call.poll();
                end.join().unwrap();

                let out = match first {
                    Some(out) => {
                        seen.note("ended on the first poll");
                        out
                    }
                    None => {
                        seen.note("ended while pending");
                        finish(&mut call, "the pending lock_all")
                    }
                };
                match out {
                    Err(TransactionError::Ended) => {}
                    Ok(_) => panic!("b is held: the call cannot complete"),
                    Err(e) => panic!("unexpected error: {e}"),
                }
                drop(call);
                assert!(!table.is_locked(&a), "a held after the end");
                assert_eq!(table.waiters(&b), 0, "the call left a waiter on b");
                drop(held);
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (b3) An owned transaction's single lock waits for `a` (held by a
    /// plain guard) and is never polled again (as a forgotten call): the
    /// end (on one thread) races the release of `a` (on another), which may
    /// hand `a` to the call's waiter first. Either way, once both are done,
    /// nothing is held and nobody waits, before the call is dropped: the
    /// end cancelled the call's lock future (`src/transactions/pending.rs`), taking
    /// its waiter out of the queue, or passing on the grant it had been
    /// handed and never seen.
    #[test]
    fn owned_end_vs_release_while_a_lock_is_never_polled_again() {
        model(
            "b3: owned end vs release, a pending lock never polled again",
            &["released first", "ended first"],
            |seen| {
                let table = table();
                let [a, _, _] = keys();
                let txn = table.clone().transaction_owned();
                let held = table.clone().try_lock_owned(a).unwrap();
                let mut call = Polled::new(txn.lock(a, X));
                assert!(call.poll().is_none(), "a is held: the call waits");
                let order = Arc::new(AtomicUsize::new(0));
                let released = order.clone();
                let release = thread::spawn(move || {
                    drop(held);
                    let _ = released.compare_exchange(0, 1, SeqCst, SeqCst);
                });
                drop(txn);
                let _ = order.compare_exchange(0, 2, SeqCst, SeqCst);
                release.join().unwrap();
                seen.note(if order.load(SeqCst) == 1 {
                    "released first"
                } else {
                    "ended first"
                });
                assert!(!table.is_locked(&a), "a held after the end and the release");
                assert_eq!(table.waiters(&a), 0, "the call left a waiter on a");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
                drop(call);
                assert!(table.is_empty());
            },
        );
    }

    /// (b4) An owned transaction's single lock waits for `a`; `a` is
    /// released (handed to the call's waiter) and the call polled on one
    /// thread while the transaction ends on another: the end cancels the
    /// call's lock future in its cell before, during (the poll has it out
    /// of the cell: the poll drops it) or after the poll that sees the
    /// grant. The call gets `a` and the end releases it, or it fails
    /// `Ended`; either way nothing is held at the end.
    #[test]
    fn owned_end_vs_the_poll_that_sees_a_locks_grant() {
        model(
            "b4: owned end vs the poll that sees a lock's grant",
            &["granted, then released by the end", "ended"],
            |seen| {
                let table = table();
                let [a, _, _] = keys();
                let txn = table.clone().transaction_owned();
                let held = table.clone().try_lock_owned(a).unwrap();
                let mut call = Polled::new(txn.lock(a, X));
                assert!(call.poll().is_none(), "a is held: the call waits");
                let end = thread::spawn(move || drop(txn));
                drop(held);
                let out = match call.poll() {
                    Some(out) => out,
                    None => panic!("granted or ended: the call completes"),
                };
                end.join().unwrap();
                match out {
                    Ok(_) => seen.note("granted, then released by the end"),
                    Err(TransactionError::Ended) => seen.note("ended"),
                    Err(e) => panic!("unexpected error: {e}"),
                }
                drop(call);
                assert!(!table.is_locked(&a), "a held after the end");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (b5) As (b3), for a `lock_all`: an owned transaction's
    /// `lock_all([(a, X), (b, X)])` has taken `a` and waits for `b` (held
    /// by a plain guard), and is never polled again (as a forgotten call).
    /// The end races the release of `b`, which may hand `b` to the call's
    /// waiter first. Either way, once both are done, nothing is held and
    /// nobody waits, before the call is dropped: the end cancelled the
    /// call's cell (`src/transactions/pending.rs`), which had its wait for `b` and
    /// its guard of `a`.
    #[test]
    fn owned_end_vs_release_while_a_lock_all_is_never_polled_again() {
        model(
            "b5: owned end vs release, a pending lock_all never polled again",
            &["released first", "ended first"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let txn = table.clone().transaction_owned();
                let held = table.clone().try_lock_owned(b).unwrap();
                let mut call = Polled::new(txn.lock_all([(a, X), (b, X)]));
                assert!(call.poll().is_none(), "b is held: the call waits");
                assert!(table.is_locked(&a), "a taken before the wait");
                let order = Arc::new(AtomicUsize::new(0));
                let released = order.clone();
                let release = thread::spawn(move || {
                    drop(held);
                    let _ = released.compare_exchange(0, 1, SeqCst, SeqCst);
                });
                drop(txn);
                let _ = order.compare_exchange(0, 2, SeqCst, SeqCst);
                release.join().unwrap();
                seen.note(if order.load(SeqCst) == 1 {
                    "released first"
                } else {
                    "ended first"
                });
                assert!(!table.is_locked(&a), "a held after the end");
                assert!(!table.is_locked(&b), "b held after the end and the release");
                assert_eq!(table.waiters(&b), 0, "the call left a waiter on b");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
                drop(call);
                assert!(table.is_empty());
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (c) a pending lock_all's upgrade dropped vs the other reader's release
    // ---------------------------------------------------------------------------

    /// (c) A borrowed transaction holds `a` shared beside a plain reader; a
    /// plain writer is queued on `a`; `b` is held by a plain guard. Its
    /// `lock_all([(a, X), (b, X)])` waits to upgrade `a`. The plain reader
    /// releases on another thread while the owner's thread polls the call
    /// once more and drops it.
    ///
    /// The upgrade is cancelled before its grant, or granted and never seen
    /// (undone by the upgrade future's drop), or seen by the poll, which
    /// then waits for `b` (undone by the call's downgrade). Every way the
    /// transaction holds `a` shared again, once (with a greater token if
    /// the upgrade was granted); the queued writer is not granted beside it,
    /// and is granted, woken (no lost wake-up), once the transaction is
    /// dropped; at the end nothing is held.
    #[test]
    fn lock_all_upgrade_dropped_vs_reader_release() {
        model(
            "c: lock_all upgrade dropped vs reader release",
            &[
                "upgrade cancelled before its grant",
                "upgrade granted unobserved, undone",
                "upgraded, undone by the call's downgrade",
            ],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let rw = Rw::new();
                let mut txn = Quiet::new(table.transaction());
                let old = match Polled::new(txn.lock(a, S)).poll() {
                    Some(Ok(got)) => got.token,
                    other => panic!("a is free: taken at once, got {other:?}"),
                };
                rw.enter(S);
                let reader = Holding::new(table.clone().try_lock_shared_owned(a).unwrap(), &rw);
                let mut writer = Polled::new(table.clone().lock_owned(a));
                assert!(writer.poll().is_none(), "a is read: the writer queues");
                let blocker = table.clone().try_lock_owned(b).unwrap();

                let outcome = {
                    let mut call = Polled::new(txn.lock_all([(a, X), (b, X)]));
                    assert!(call.poll().is_none(), "another reader: the upgrade waits");
                    let release = thread::spawn(move || drop(reader));
                    assert!(call.poll().is_none(), "b is held: the call cannot complete");
                    // Past the upgrade, the call waits for b.
                    let upgraded = table.waiters(&b) == 1;
                    drop(call);
                    release.join().unwrap();
                    upgraded
                };
                let token = txn.token(&a).expect("a still held");
                let outcome = if outcome {
                    assert!(token > old);
                    "upgraded, undone by the call's downgrade"
                } else if token == old {
                    "upgrade cancelled before its grant"
                } else {
                    assert!(token > old);
                    "upgrade granted unobserved, undone"
                };
                seen.note(outcome);
                assert_eq!(txn.mode(&a), Some(S), "{outcome}");
                assert_eq!(txn.count(&a), 1, "{outcome}");
                assert_eq!(table.waiters(&b), 0, "{outcome}: the call left a waiter");
                if writer.woken() {
                    if let Some(g) = writer.poll() {
                        std::mem::forget(g);
                        panic!("{outcome}: the writer granted beside the transaction's read");
                    }
                }
                rw.exit(S);
                drop(txn);
                let g = Holding::new(finish(&mut writer, "the queued writer"), &rw);
                drop(g);
                drop(blocker);
                assert!(rw.is_free());
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (d) Two calls of one owned transaction for the same new key, polled
    /// once each on two threads, in `mode`: the one that takes the set's
    /// lock first looks the key up, takes it on the table and puts it in,
    /// in that one step; the other then finds it and is counted on the
    /// grant, however the two interleave (it never fails `InFlight`: that
    /// is for a key claimed by a pending call, which a lock had at once
    /// never leaves). Never does a call wait on its own transaction's
    /// grant (a pending call here would wait for ever); the table ends with
    /// the one grant, released by the end.
    fn two_calls_race_for_one_key(name: &str, mode: Mode) {
        model(name, &["the second re-entered"], move |seen| {
            let table = table();
            let [a, _, _] = keys();
            let txn = table.clone().transaction_owned();
            let first = txn.lock(a, mode);
            let second = txn.lock(a, mode);
            let other = thread::spawn(move || Polled::new(second).poll());
            let mine = Polled::new(first).poll();
            let theirs = other.join().unwrap();
            let (Some(mine), Some(theirs)) = (mine, theirs) else {
                panic!("a call of the transaction waited on its own grant");
            };
            let mut kinds = [&mine, &theirs].map(|r| match r {
                Ok(got) => format!("{:?}", got.kind),
                Err(TransactionError::InFlight { key }) if *key == a => "InFlight".into(),
                Err(e) => panic!("unexpected error: {e}"),
            });
            kinds.sort();
            seen.note(match kinds.each_ref().map(String::as_str) {
                ["InFlight", "New"] => {
                    assert_eq!(txn.count(&a), 1);
                    "the second in flight"
                }
                ["New", "Reentered"] => {
                    assert_eq!(txn.count(&a), 2);
                    "the second re-entered"
                }
                other => panic!("outcomes {other:?}"),
            });
            assert_eq!(txn.mode(&a), Some(mode));
            assert!(table.is_locked(&a));
            drop(txn);
            table.assert_consistent();
            assert!(table.is_empty(), "the end left the key held");
        });
    }

    #[test]
    fn owned_two_calls_race_for_one_exclusive_key() {
        two_calls_race_for_one_key("d: two owned calls race for one key, exclusive", X);
    }

    #[test]
    fn owned_two_calls_race_for_one_shared_key() {
        two_calls_race_for_one_key("d2: two owned calls race for one key, shared", S);
    }

    /// (e) Detection racing a release that breaks the cycle: `t` holds
    /// `a`, `u` holds `b` and waits for `a`. Thread B: `t` lets go of `a`
    /// early (`unlock`; `u` is granted it) and then waits for `b`. The main
    /// thread polls `u`'s call meanwhile. `u` waits on `a` no longer (or is
    /// about to be granted it) when `t` starts waiting, so there is never a
    /// cycle: `t`'s wait must never be answered `Deadlock` (a stale edge
    /// read before the grant would give a false one), whether `u`'s call
    /// has seen its grant yet or not. Then `u` commits and `t` gets `b`.
    #[test]
    fn detection_vs_a_release_that_breaks_the_cycle() {
        model(
            "e: detection vs a release that breaks the cycle",
            &["t waited"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let t = table.clone().transaction_owned();
                let u = table.clone().transaction_owned();
                assert!(Polled::new(t.lock(a, X)).poll().is_some());
                assert!(Polled::new(u.lock(b, X)).poll().is_some());
                let mut u_waits = Polled::new(u.lock(a, X));
                assert!(u_waits.poll().is_none(), "a is t's: u waits");

                let tt = thread::spawn(move || {
                    t.unlock(&a).expect("t holds a");
                    let mut t_waits = Polled::new(t.lock(b, X));
                    let first = t_waits.poll();
                    (t, t_waits, first)
                });
                let racing = if u_waits.woken() {
                    u_waits.poll()
                } else {
                    None
                };
                let (t, mut t_waits, first) = tt.join().unwrap();

                match first {
                    None => {}
                    Some(Err(TransactionError::Deadlock(d))) => {
                        panic!("a false deadlock: {d}")
                    }
                    Some(other) => panic!("b is u's: t waits, got {other:?}"),
                }
                let got = match racing {
                    Some(out) => out,
                    None => finish(&mut u_waits, "u's wait for a"),
                };
                assert!(got.is_ok(), "u gets a once t let go: {got:?}");
                drop(u_waits);
                u.commit().expect("no lease");
                let got = finish(&mut t_waits, "t's wait for b");
                assert!(got.is_ok(), "t gets b once u committed: {got:?}");
                seen.note("t waited");
                drop(t_waits);
                t.commit().expect("no lease");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
                assert!(table.recent_deadlocks().is_empty());
            },
        );
    }

    /// (e2) A waiter of the cycle cancelled while the cycle closes: `t`
    /// holds `a` and waits for `b`; `u` holds `b`. Thread B drops `t`'s
    /// call; the main thread polls `u`'s first wait for `a`. Either `u`'s
    /// wait closed the cycle while `t` still waited (`u` is answered
    /// `Deadlock`, naming both), or `t` had left the queue first (`u` just
    /// waits, and gets `a` once `t` commits). Never both answered, never a
    /// hang; nothing is left held.
    #[test]
    fn a_waiter_of_the_cycle_cancelled_while_it_closes() {
        model(
            "e2: a waiter of the cycle cancelled while it closes",
            &["u answered deadlock", "u waited"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let t = table.clone().transaction_owned();
                let u = table.clone().transaction_owned();
                assert!(Polled::new(t.lock(a, X)).poll().is_some());
                assert!(Polled::new(u.lock(b, X)).poll().is_some());
                let mut t_waits = Polled::new(t.lock(b, X));
                assert!(t_waits.poll().is_none(), "b is u's: t waits");

                let cancel = thread::spawn(move || {
                    t_waits.cancel();
                    t
                });
                let mut u_waits = Polled::new(u.lock(a, X));
                let first = u_waits.poll();
                let t = cancel.join().unwrap();

                match first {
                    Some(Err(TransactionError::Deadlock(d))) => {
                        assert_eq!(d.victim(), u.id());
                        assert_eq!(d.cycle().len(), 2, "{d}");
                        seen.note("u answered deadlock");
                        drop(u_waits);
                        u.abort();
                        t.commit().expect("no lease");
                    }
                    None => {
                        seen.note("u waited");
                        t.commit().expect("no lease");
                        let got = finish(&mut u_waits, "u's wait for a");
                        assert!(got.is_ok(), "u gets a once t committed: {got:?}");
                        drop(u_waits);
                        u.commit().expect("no lease");
                    }
                    Some(other) => panic!("a is t's: u waits or is answered, got {other:?}"),
                }
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (f) A transaction that holds nothing, its wait closed into a cycle
    /// from behind: `h` holds `a` shared and waits for `b`, which `y` holds.
    /// The main thread's borrowed transaction `w` (holding nothing: it does
    /// not register) asks `a` exclusive (it waits for `h`); thread B's `y`
    /// asks `a` shared. If `y` queues behind `w` (a waiting writer blocks
    /// later readers), the waits close `y -> w -> h -> y`: `y`'s search
    /// must follow `w` through `a`'s queue, however `w`'s enqueue and poll
    /// interleave with `y`'s. The cycle is soft (`y` waits only for `w`,
    /// queued, and `a`'s holder `h` admits it), so, found, it is broken by
    /// granting `y` ahead of `w` in the poll that closed it (pending, but
    /// woken), and nobody is answered. If `y` came first it is granted with
    /// `h` (no cycle). Never a cycle left unbroken; `w` is never answered.
    #[test]
    fn a_transaction_holding_nothing_closed_into_a_cycle_from_behind() {
        model(
            "f: holding nothing, a cycle closed from behind",
            &["y moved ahead of w", "y granted first"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let h = table.clone().transaction_owned();
                let y = table.clone().transaction_owned();
                assert!(Polled::new(h.lock(a, S)).poll().is_some());
                assert!(Polled::new(y.lock(b, X)).poll().is_some());
                let mut h_waits = Polled::new(h.lock(b, X));
                assert!(h_waits.poll().is_none(), "b is y's: h waits");

                let other = thread::spawn(move || {
                    let mut y_waits = Polled::new(y.lock(a, S));
                    let first = y_waits.poll();
                    (y, y_waits, first)
                });
                let mut w = table.transaction();
                let mut w_waits = Polled::new(w.lock(a, X));
                let mine = w_waits.poll();
                let (y, mut y_waits, theirs) = other.join().unwrap();

                match (mine, theirs) {
                    (Some(Err(TransactionError::Deadlock(d))), None) => {
                        panic!("w holds nothing and is not registered: answered {d}")
                    }
                    (None, Some(Err(TransactionError::Deadlock(d)))) => {
                        panic!("a soft cycle (y may go ahead of w) answered: {d}")
                    }
                    (None, Some(Ok(_))) => {
                        // y was granted a with h before w queued: no cycle.
                        seen.note("y granted first");
                        drop(y_waits);
                        y.commit().expect("no lease");
                        let got = finish(&mut h_waits, "h's wait for b");
                        assert!(got.is_ok(), "h gets b once y committed: {got:?}");
                        h.commit().expect("no lease");
                        let got = finish(&mut w_waits, "w's wait for a");
                        assert!(got.is_ok(), "w gets a: {got:?}");
                        drop(w_waits);
                        drop(w);
                        table.assert_consistent();
                        assert!(table.is_empty(), "entry leaked");
                    }
                    (None, None) => {
                        // y queued behind w and closed the cycle: found,
                        // it was broken by granting y ahead of w.
                        let stats = table.deadlock_stats();
                        assert_eq!(
                            (stats.reorders, stats.cycles),
                            (1, 0),
                            "w -> h -> y -> w closed and nobody answered nor moved"
                        );
                        seen.note("y moved ahead of w");
                        let got = finish(&mut y_waits, "y's wait for a, moved ahead");
                        assert!(got.is_ok(), "y granted ahead of w: {got:?}");
                        drop(y_waits);
                        y.commit().expect("no lease");
                        let got = finish(&mut h_waits, "h's wait for b");
                        assert!(got.is_ok(), "h gets b once y committed: {got:?}");
                        h.commit().expect("no lease");
                        let got = finish(&mut w_waits, "w's wait for a");
                        assert!(got.is_ok(), "w gets a once h committed: {got:?}");
                        drop(w_waits);
                        drop(w);
                        table.assert_consistent();
                        assert!(table.is_empty(), "entry leaked");
                    }
                    (mine, theirs) => panic!("w {mine:?}, y {theirs:?}"),
                }
            },
        );
    }
    /// (g) Two waits that close one cycle at once: `t` holds `a`, `u`
    /// holds `b`; thread B's `t` asks for `b` while the main thread's `u`
    /// asks for `a`. `u` is a borrowed transaction locking a new key: its
    /// wait is searched from only if a waiter is queued on a key it holds,
    /// asked once it is registered (`t`, owned, always searches). However
    /// the two enqueues, registrations and looks interleave, the second to
    /// register finds the first (queued on its key, or registered) and
    /// answers the cycle. Exactly one is answered `Deadlock` (never none: a
    /// hang; never both); the other gets its key once the victim aborts.
    /// The model fails if `u` looks before it registers.
    #[test]
    fn two_waits_closing_one_cycle_at_once() {
        model(
            "g: two waits closing one cycle at once",
            &["t answered deadlock", "u answered deadlock"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let t = table.clone().transaction_owned();
                let mut u = table.transaction();
                assert!(Polled::new(t.lock(a, X)).poll().is_some());
                assert!(Polled::new(u.lock(b, X)).poll().is_some());
                let u_id = u.id();

                let other = thread::spawn(move || {
                    let mut t_waits = Polled::new(t.lock(b, X));
                    let first = t_waits.poll();
                    (t, t_waits, first)
                });
                let mut u_waits = Polled::new(u.lock(a, X));
                let mine = u_waits.poll();
                let (t, mut t_waits, theirs) = other.join().unwrap();

                match (mine, theirs) {
                    (Some(Err(TransactionError::Deadlock(d))), None) => {
                        assert_eq!(d.victim(), u_id, "{d}");
                        assert_eq!(d.cycle().len(), 2, "{d}");
                        seen.note("u answered deadlock");
                        drop(u_waits);
                        u.abort();
                        let got = finish(&mut t_waits, "t's wait for b");
                        assert!(got.is_ok(), "t gets b once u aborted: {got:?}");
                        drop(t_waits);
                        t.commit().expect("no lease");
                    }
                    (None, Some(Err(TransactionError::Deadlock(d)))) => {
                        assert_eq!(d.victim(), t.id(), "{d}");
                        assert_eq!(d.cycle().len(), 2, "{d}");
                        seen.note("t answered deadlock");
                        drop(t_waits);
                        t.abort();
                        let got = finish(&mut u_waits, "u's wait for a");
                        assert!(got.is_ok(), "u gets a once t aborted: {got:?}");
                        drop(u_waits);
                        u.commit().expect("no lease");
                    }
                    (None, None) => panic!("t -> u -> t closed and nobody answered"),
                    (mine, theirs) => panic!("u {mine:?}, t {theirs:?}"),
                }
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// An owned transaction's call upgrades a key it alone holds shared,
    /// at once, while its other call begins a wait on another thread: a
    /// transaction queued for the upgraded key (behind a plain writer, so
    /// no edge to the transaction before) now waits for it, an edge no wait
    /// begins with. Whichever comes first, the waiting call is answered:
    /// at its first poll (its search saw the upgrade, or the epoch moved
    /// while it registered), or on the wake the upgrade's call gave it (the
    /// search again). Never a cycle left pending with no wake.
    #[test]
    fn an_owned_calls_upgrade_racing_its_other_calls_wait() {
        // Exhaustive, 5.6 million interleavings take six minutes: capped
        // at five preemptions (three find the lost wake-up of an epoch read
        // before the waker is stored).
        model_within(
            "h: an owned call's upgrade racing its other call's wait",
            &["answered at the first poll", "answered when woken"],
            Some(5),
            |seen| {
                let table = table();
                let [x, y, _] = keys();
                let t = Arc::new(table.clone().transaction_owned());
                assert!(Polled::new(t.lock(y, S)).poll().is_some());
                let mut writer = Polled::new(table.clone().lock_owned(y));
                assert!(writer.poll().is_none(), "the writer queues behind t");
                let mut w = table.transaction();
                assert!(Polled::new(w.lock(x, X)).poll().is_some());
                let mut w_y = Polled::new(w.lock(y, S));
                assert!(w_y.poll().is_none(), "w queues behind the writer");

                let t2 = t.clone();
                let other = thread::spawn(move || {
                    let mut t_x = Polled::new(t2.lock(x, X));
                    let first = t_x.poll();
                    (t_x, first)
                });
                let upgraded = Polled::new(t.lock(y, X)).poll();
                assert!(
                    matches!(upgraded, Some(Ok(_))),
                    "t, y's only holder, upgrades at once: {upgraded:?}"
                );
                let (mut t_x, first) = other.join().unwrap();
                let answer = match first {
                    Some(answer) => {
                        seen.note("answered at the first poll");
                        answer
                    }
                    None => {
                        seen.note("answered when woken");
                        finish(&mut t_x, "t's wait for x")
                    }
                };
                match answer {
                    Err(TransactionError::Deadlock(d)) => {
                        assert_eq!(d.victim(), t.id(), "{d}");
                    }
                    other => panic!("t -> w -> t closed and t's wait got {other:?}"),
                }
                drop(t_x);
                Arc::try_unwrap(t).ok().expect("one handle left").abort();
                drop(finish(&mut writer, "the writer's wait for y"));
                let got = finish(&mut w_y, "w's wait for y");
                assert!(got.is_ok(), "w gets y once t aborted: {got:?}");
                drop(w_y);
                w.commit().expect("no lease");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }

    /// (i) An owned transaction's list of its keys (`keys()`: each key's
    /// entry pinned under the set's lock, cloned after it) racing its other
    /// call's unlock of one of them, whose key goes to a waiter: the list
    /// names the key or not, each listed key is the one asked, the pin keeps
    /// the released key's cell (and the waiter's grant) intact, and the
    /// entry goes once the last of the pin and the waiter's guard does.
    #[test]
    fn an_owned_transactions_key_list_racing_an_unlock() {
        model(
            "i: an owned transaction's key list vs its unlock of a listed key",
            &["listed", "unlocked first"],
            |seen| {
                let table = table();
                let [a, b, _] = keys();
                let t = Arc::new(table.clone().transaction_owned());
                assert!(Polled::new(t.lock(a, X)).poll().is_some());
                assert!(Polled::new(t.lock(b, S)).poll().is_some());
                let mut waiter = Polled::new(table.clone().lock_owned(a));
                assert!(waiter.poll().is_none(), "t holds a");
                let t2 = t.clone();
                let unlock = thread::spawn(move || t2.unlock(&a).map(|_| ()));
                let mut listed = t.keys();
                unlock.join().unwrap().expect("t held a");
                listed.sort_unstable();
                if listed == [(a, X), (b, S)] {
                    seen.note("listed");
                } else {
                    assert_eq!(listed, [(b, S)], "a list of t's keys");
                    seen.note("unlocked first");
                }
                let got = finish(&mut waiter, "the waiter's wait for a");
                assert!(table.is_locked(&a), "the waiter holds a");
                drop(got);
                drop(waiter);
                assert!(!table.is_locked(&a), "a released");
                Arc::try_unwrap(t)
                    .ok()
                    .expect("one handle left")
                    .commit()
                    .expect("no lease");
                table.assert_consistent();
                assert!(table.is_empty(), "entry leaked");
            },
        );
    }
}
