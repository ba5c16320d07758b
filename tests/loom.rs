//! Loom models of the per-key state machine: loom runs each model under every
//! interleaving of its threads (bounded by `LOOM_MAX_PREEMPTIONS`) at every
//! shard-lock acquisition and every loom atomic access, so the release,
//! hand-off, poll, cancel and try-lock paths race in all their orders.
//!
//! Run with (what `.ci/run` does, then again without `LOOM_MAX_PREEMPTIONS`,
//! which explores every interleaving; each model takes well under a second
//! either way, except (b) and (f), a few seconds each when exhaustive):
//!
//! ```text
//! RUSTC_WRAPPER="$PWD/.ci/loom-rustc" LOOM_MAX_PREEMPTIONS=3 \
//!     CARGO_TARGET_DIR=target/loom cargo test --release --test loom -- --nocapture
//! ```
//!
//! The wrapper passes `--cfg loom` to keylock's own crates only. The plain
//! `RUSTFLAGS="--cfg loom"` would also reach keylock's dependencies, some of
//! which (async-io via parking and concurrent-queue; the dev-dependencies
//! tokio, async-lock, event-listener, bytes) do not compile under it; see
//! `.ci/loom-rustc`. The file uses nothing but keylock, loom (default
//! features) and std.
//!
//! Under `--cfg loom` the shard locks are loom's, and so are the waiter
//! node's state word and cells (`src/support/loom.rs`, `src/keys/waiter.rs`): a grant is
//! published into the node of a waiting future, which its owner takes
//! without the shard lock, and the owner registers its waker without the
//! lock right after linking. Loom explores those lock-free races and checks
//! every access to the node's cells for a data race. Shared state outside
//! them stays `std` and is not modeled: the per-shard statistics (counters
//! only, written under the shard lock) and a guard's cached lease deadline.
//! The models use no leases or timeouts: those wait on async-io timers,
//! which do not run under loom (`tests/loom_leases.rs` drives them with the
//! manual clock, and models eventual fairness, which reads it).
//!
//! Every model uses one shard and a deterministic hasher, so the state is
//! small and every loom replay sees the same hashes. Lock futures are
//! `!Unpin` (their waiter node is linked by address), so each is pinned in a
//! box and polled by hand with a waker that counts its wakes in a loom
//! atomic: the models assert "woken exactly once", "never woken", and, once
//! no other thread is left, that a pending future was woken since its last
//! poll started (else its wake-up was lost: an executor would never poll it
//! again). "Never two holders" is a loom atomic counter that every holder
//! raises while it holds the key (from the moment it acquires until just
//! before it releases) and that must never exceed one. Models with several
//! outcomes check that every one of them is reached by some interleaving.

#[cfg(not(loom))]
#[test]
#[ignore = "a loom model: run it with `.ci/run loom` (the command is in this file's header)"]
fn loom_models_run_only_under_cfg_loom() {}

#[cfg(loom)]
mod models {
    use std::collections::hash_map::DefaultHasher;
    use std::collections::BTreeSet;
    use std::future::Future;
    use std::hash::BuildHasherDefault;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex as StdMutex};
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Instant;

    use keylock::{FencingToken, LockTable, OwnedGuard};
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use loom::sync::Mutex;
    use loom::thread;

    /// `loom::future::block_on` needs loom's `futures` feature, which keylock's
    /// manifest does not turn on: this is the same thing on loom's park/unpark. A
    /// wake-up that never comes leaves the thread parked, and loom reports the
    /// deadlock.
    fn block_on<F: Future>(fut: F) -> F::Output {
        struct Unpark(thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.unpark();
            }
        }
        // Pinned in a box that is leaked if the model fails meanwhile (loom
        // reports a deadlock by panicking in `park`): dropping the future would
        // touch loom while unwinding, which aborts the test binary and hides the
        // failure's message.
        let mut fut = std::mem::ManuallyDrop::new(Box::pin(fut));
        let waker = Waker::from(Arc::new(Unpark(thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                drop(std::mem::ManuallyDrop::into_inner(fut));
                return out;
            }
            thread::park();
        }
    }

    type Hasher = BuildHasherDefault<DefaultHasher>;
    type Table = LockTable<u32, Hasher>;
    type Guard = OwnedGuard<u32, Hasher>;

    const KEY: u32 = 7;

    /// A one-shard table with a deterministic hasher.
    fn table() -> Arc<Table> {
        Arc::new(
            LockTable::<u32>::builder()
                .shards(1)
                .hasher(Hasher::default())
                .build(),
        )
    }

    /// The outcomes the interleavings of one model reached (plain std: written
    /// by the model's threads, read once loom is done).
    #[derive(Default)]
    struct Seen(StdMutex<BTreeSet<&'static str>>);

    impl Seen {
        fn note(&self, outcome: &'static str) {
            self.0.lock().unwrap().insert(outcome);
        }
    }

    /// Runs one model with the loom settings from the environment, prints how
    /// many interleavings it explored and how long that took, and checks that
    /// every outcome in `expect` was reached by some interleaving (so that no
    /// branch of the model's assertions is vacuous) and no other was.
    fn model<F>(name: &str, expect: &[&'static str], f: F)
    where
        F: Fn(&Seen) + Sync + Send + 'static,
    {
        let iterations = Arc::new(StdAtomicUsize::new(0));
        let seen = Arc::new(Seen::default());
        let start = Instant::now();
        let (counter, outcomes) = (iterations.clone(), seen.clone());
        loom::model(move || {
            counter.fetch_add(1, Relaxed);
            f(&outcomes);
        });
        let seen = seen.0.lock().unwrap().clone();
        eprintln!(
        "loom model {name}: {} interleavings in {:.2?} (LOOM_MAX_PREEMPTIONS={}); outcomes {seen:?}",
        iterations.load(Relaxed),
        start.elapsed(),
        std::env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "unbounded".into()),
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

    impl CountingWaker {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                wakes: AtomicUsize::new(0),
            })
        }

        fn wakes(&self) -> usize {
            self.wakes.load(SeqCst)
        }
    }

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.fetch_add(1, SeqCst);
        }
    }

    /// A future polled by hand with a counting waker. Lock futures are `!Unpin`
    /// (their waiter node is linked into the queue by address), so the future is
    /// pinned in a box before its first poll and moved only as that box.
    struct Polled<F: Future> {
        fut: Option<Pin<Box<F>>>,
        counter: Arc<CountingWaker>,
        waker: Waker,
        /// The current waker's wakes when the last poll started: a wake counted
        /// above it came during or after that poll, so an executor would poll
        /// the future again.
        polled_at: usize,
    }

    impl<F: Future> Polled<F> {
        fn new(fut: F) -> Self {
            let counter = CountingWaker::new();
            Self {
                fut: Some(Box::pin(fut)),
                waker: Waker::from(counter.clone()),
                counter,
                polled_at: 0,
            }
        }

        /// Polls once; `Some` when the future completed (it is gone then).
        fn poll(&mut self) -> Option<F::Output> {
            let fut = self.fut.as_mut().expect("polled after completion");
            self.polled_at = self.counter.wakes();
            match fut.as_mut().poll(&mut Context::from_waker(&self.waker)) {
                Poll::Ready(out) => {
                    self.fut = None;
                    Some(out)
                }
                Poll::Pending => None,
            }
        }

        /// Whether the future is still pending (not completed, not dropped).
        fn pending(&self) -> bool {
            self.fut.is_some()
        }

        /// Wakes of the current waker.
        fn wakes(&self) -> usize {
            self.counter.wakes()
        }

        /// Whether the current waker was woken since the last poll started (an
        /// executor would poll the future again).
        fn woken(&self) -> bool {
            self.wakes() > self.polled_at
        }

        /// Switches to a fresh waker for the next polls (as a task that moved to
        /// another executor would); returns the old one's counter.
        fn switch_waker(&mut self) -> Arc<CountingWaker> {
            let fresh = CountingWaker::new();
            self.waker = Waker::from(fresh.clone());
            self.polled_at = 0;
            std::mem::replace(&mut self.counter, fresh)
        }

        /// Drops the future, cancelling it if it is still waiting.
        fn cancel(&mut self) {
            self.fut = None;
        }
    }

    impl<F: Future> Drop for Polled<F> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                // As `Holding`'s drop: leak the (pinned, so never freed) future.
                std::mem::forget(self.fut.take());
            }
        }
    }

    /// Drives a pending future to completion once no other thread is left, as an
    /// executor would: it is polled only if woken since its last poll started,
    /// so a future left pending and unwoken is a lost wake-up (a real task would
    /// sleep for ever).
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

    /// How many holders the key has, as the holders themselves see it.
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

    /// A guard that counts itself in `Inside` for as long as it holds the key.
    struct Holding<G> {
        guard: Option<G>,
        inside: Arc<Inside>,
    }

    impl<G> Holding<G> {
        fn new(guard: G, inside: &Arc<Inside>) -> Self {
            inside.enter();
            Self {
                guard: Some(guard),
                inside: inside.clone(),
            }
        }
    }

    impl Holding<Guard> {
        fn token(&self) -> FencingToken {
            self.guard.as_ref().unwrap().token()
        }
    }

    impl<G> Drop for Holding<G> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                // A model failed: leak the guard rather than touch the table
                // (and loom) while unwinding, which would abort the test binary
                // and hide the failure's message.
                std::mem::forget(self.guard.take());
                return;
            }
            // Leave before releasing: once released the successor may enter.
            self.inside.exit();
            drop(self.guard.take());
        }
    }

    // ---------------------------------------------------------------------------
    // Models
    // ---------------------------------------------------------------------------

    /// (a) Release vs cancel of the waiter being granted.
    ///
    /// The key is held and one waiter is queued (polled once, pending). Thread A
    /// drops the guard while thread B drops the waiter. Either the cancel comes
    /// first (A's release then finds no waiter and frees the key), or the release
    /// grants the waiter and B's drop releases that unobserved grant. Either way
    /// nobody holds a guard afterwards, so the key must be free, the table empty
    /// and the key lockable again; the waiter is woken at most once. A grant
    /// counts as an acquisition when it is made, even if its future is dropped
    /// before it runs.
    #[test]
    fn release_vs_cancel_of_granted_waiter() {
        model(
            "a: release vs cancel",
            &[
                "dropped before the grant",
                "dropped with an unobserved grant",
            ],
            |seen| {
                let table = table();
                let inside = Inside::new();
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
                let mut waiter = Polled::new(table.clone().lock_owned(KEY));
                assert!(waiter.poll().is_none(), "the key is held: must queue");
                assert_eq!(table.waiters(&KEY), 1);

                let a = thread::spawn(move || drop(holder));
                let b = thread::spawn(move || {
                    waiter.cancel();
                    waiter
                });
                a.join().unwrap();
                let waiter = b.join().unwrap();

                assert!(!table.is_locked(&KEY), "key held with no guard alive");
                assert_eq!(table.waiters(&KEY), 0);
                assert_eq!(table.len(), 0, "entry leaked");
                assert!(waiter.wakes() <= 1, "waiter woken {} times", waiter.wakes());
                let stats = table.stats();
                assert_eq!(stats.cancelled, 1);
                assert_eq!(
                    stats.acquisitions,
                    1 + stats.handoffs,
                    "a grant made was not counted"
                );
                seen.note(if stats.handoffs == 1 {
                    "dropped with an unobserved grant"
                } else {
                    "dropped before the grant"
                });
                drop(Holding::new(
                    table.clone().try_lock_owned(KEY).expect("key must be free"),
                    &inside,
                ));
                table.assert_consistent();
                assert_eq!(table.len(), 0);
            },
        );
    }

    /// (a2) Release vs cancel of the head waiter, with a second waiter behind it
    /// that is polled concurrently.
    ///
    /// A drops the guard, B drops the head waiter, C polls the second waiter once
    /// (and, if granted, holds and releases). In every order the grant must pass
    /// on to the second waiter: it is woken exactly once, and by the end it has
    /// been or is now granted. Never two holders; table empty at the end.
    #[test]
    fn release_vs_cancel_passes_grant_on() {
        model("a2: release vs cancel, successor polls", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
            let mut head = Polled::new(table.clone().lock_owned(KEY));
            let mut next = Polled::new(table.clone().lock_owned(KEY));
            assert!(head.poll().is_none());
            assert!(next.poll().is_none());
            assert_eq!(table.waiters(&KEY), 2);

            let a = thread::spawn(move || drop(holder));
            let b = thread::spawn(move || {
                head.cancel();
                head
            });
            let c = {
                let inside = inside.clone();
                thread::spawn(move || {
                    if let Some(g) = next.poll() {
                        drop(Holding::new(g, &inside));
                    }
                    next
                })
            };
            a.join().unwrap();
            let head = b.join().unwrap();
            let mut next = c.join().unwrap();

            assert!(head.wakes() <= 1, "head woken {} times", head.wakes());
            assert_eq!(
                next.wakes(),
                1,
                "successor woken {} times (0 = lost grant)",
                next.wakes()
            );
            if next.pending() {
                let g = next.poll().expect("successor woken but not granted");
                drop(Holding::new(g, &inside));
            }
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (b) Two waiters and a release.
    ///
    /// The key is held; W1 then W2 queue. A releases while B polls W1 once and C
    /// polls W2 once; whoever completes holds, records its grant and releases.
    /// FIFO: W2 is never granted before W1; while W1 holds, W2 stays queued and
    /// unwoken. No lost grant: each waiter is woken exactly once over the run and
    /// is granted on the poll after it. Tokens increase in grant order, and the
    /// table is empty once everything is dropped.
    #[test]
    fn two_waiters_and_release() {
        model("b: two waiters + release", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let grants = Arc::new(Mutex::new(Vec::new()));
            let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
            let first_token = holder.token();
            let mut w1 = Polled::new(table.clone().lock_owned(KEY));
            let mut w2 = Polled::new(table.clone().lock_owned(KEY));
            assert!(w1.poll().is_none());
            assert!(w2.poll().is_none());

            let a = thread::spawn(move || drop(holder));
            let poller = |mut w: Polled<_>, id: u8| {
                let inside = inside.clone();
                let grants = grants.clone();
                thread::spawn(move || {
                    if let Some(g) = w.poll() {
                        let h = Holding::new(g, &inside);
                        grants.lock().unwrap().push((id, h.token()));
                        drop(h);
                    }
                    w
                })
            };
            let b = poller(w1, 1);
            let c = poller(w2, 2);
            a.join().unwrap();
            let mut w1 = b.join().unwrap();
            let mut w2 = c.join().unwrap();

            // A has released; finish, in FIFO order, what the threads left.
            if w1.pending() {
                assert!(w2.pending(), "W2 granted before W1: FIFO broken");
                assert_eq!(table.waiters(&KEY), 1, "W2 must still be queued");
                assert_eq!(w2.wakes(), 0, "W2 woken while W1 has the key");
                assert_eq!(w1.wakes(), 1, "W1 handed the key but not woken once");
                let h = Holding::new(w1.poll().expect("W1 woken but not granted"), &inside);
                grants.lock().unwrap().push((1, h.token()));
                assert!(w2.poll().is_none(), "W2 granted while W1 holds the key");
                assert!(
                    table.clone().try_lock_owned(KEY).is_err(),
                    "try_lock took a held key"
                );
                drop(h);
            }
            if w2.pending() {
                assert_eq!(w2.wakes(), 1, "W2 handed the key but not woken once");
                let h = Holding::new(w2.poll().expect("W2 woken but not granted"), &inside);
                grants.lock().unwrap().push((2, h.token()));
                drop(h);
            }
            assert_eq!(w1.wakes(), 1, "W1 woken {} times", w1.wakes());
            assert_eq!(w2.wakes(), 1, "W2 woken {} times", w2.wakes());

            let grants = grants.lock().unwrap().clone();
            let order: Vec<u8> = grants.iter().map(|&(id, _)| id).collect();
            assert_eq!(order, [1, 2], "grants out of FIFO order");
            assert!(
                first_token < grants[0].1 && grants[0].1 < grants[1].1,
                "tokens not increasing: {first_token:?} {grants:?}"
            );
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (c) Lock vs lock on a free key, each polled once on its own thread.
    ///
    /// Exactly one acquires directly and keeps holding; the other queues and is
    /// not woken. After the holder releases, the waiter is woken exactly once and
    /// granted with a larger token.
    #[test]
    fn lock_vs_lock_on_free_key() {
        model("c: lock vs lock", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let locker = || {
                let table = table.clone();
                let inside = inside.clone();
                thread::spawn(move || {
                    let mut w = Polled::new(table.lock_owned(KEY));
                    let held = w.poll().map(|g| Holding::new(g, &inside));
                    (held, w)
                })
            };
            let t1 = locker();
            let t2 = locker();
            let (h1, w1) = t1.join().unwrap();
            let (h2, w2) = t2.join().unwrap();

            let (holder, mut waiter) = match (h1, h2) {
                (Some(h), None) => (h, w2),
                (None, Some(h)) => (h, w1),
                (Some(_), Some(_)) => panic!("both acquired the key directly"),
                (None, None) => panic!("neither acquired the free key"),
            };
            assert!(table.is_locked(&KEY));
            assert_eq!(table.waiters(&KEY), 1);
            assert_eq!(waiter.wakes(), 0, "waiter woken while the key is held");
            assert!(
                waiter.poll().is_none(),
                "waiter granted while the key is held"
            );

            let first = holder.token();
            drop(holder);
            assert_eq!(
                waiter.wakes(),
                1,
                "release must wake the waiter exactly once"
            );
            let h = Holding::new(waiter.poll().expect("woken waiter not granted"), &inside);
            assert!(h.token() > first, "token did not increase");
            drop(h);
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (c2) Lock vs lock with real blocking: two threads each `block_on` the lock,
    /// hold, and release. A lost wake-up leaves a thread parked forever, which
    /// loom reports as a deadlock.
    #[test]
    fn lock_vs_lock_block_on() {
        model("c2: lock vs lock, block_on", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let table = table.clone();
                    let inside = inside.clone();
                    thread::spawn(move || {
                        let g = block_on(table.lock(KEY));
                        drop(Holding::new(g, &inside));
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
            assert_eq!(table.stats().acquisitions, 2);
        });
    }

    /// (d) Release vs cancel vs `try_lock` from a third thread.
    ///
    /// `try_lock` must never barge past a pending grant: it may succeed only once
    /// the holder has started releasing and the waiter has started cancelling.
    /// Never two holders; table empty at the end; waiter woken at most once.
    #[test]
    fn release_vs_cancel_vs_try_lock() {
        model("d: release vs cancel vs try_lock", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let released = Arc::new(AtomicBool::new(false));
            let cancelled = Arc::new(AtomicBool::new(false));
            let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
            let mut waiter = Polled::new(table.clone().lock_owned(KEY));
            assert!(waiter.poll().is_none());

            let a = {
                let released = released.clone();
                thread::spawn(move || {
                    released.store(true, SeqCst);
                    drop(holder);
                })
            };
            let b = {
                let cancelled = cancelled.clone();
                thread::spawn(move || {
                    cancelled.store(true, SeqCst);
                    waiter.cancel();
                    waiter
                })
            };
            let c = {
                let table = table.clone();
                let inside = inside.clone();
                thread::spawn(move || {
                    if let Ok(g) = table.try_lock_owned(KEY) {
                        assert!(released.load(SeqCst), "try_lock took a held key");
                        assert!(
                            cancelled.load(SeqCst),
                            "try_lock barged past a queued or granted waiter"
                        );
                        drop(Holding::new(g, &inside));
                    }
                })
            };
            a.join().unwrap();
            let waiter = b.join().unwrap();
            c.join().unwrap();

            assert!(waiter.wakes() <= 1, "waiter woken {} times", waiter.wakes());
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (d2) Release vs cancel vs a newcomer's `lock` (polled once).
    ///
    /// The newcomer either acquires a free key, or queues behind whatever is
    /// left; if it queued, the release/cancel pair must pass the grant on to it
    /// (woken exactly once, granted on the next poll). Never two holders.
    #[test]
    fn release_vs_cancel_vs_newcomer() {
        model("d2: release vs cancel vs newcomer lock", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
            let mut waiter = Polled::new(table.clone().lock_owned(KEY));
            assert!(waiter.poll().is_none());

            let a = thread::spawn(move || drop(holder));
            let b = thread::spawn(move || {
                waiter.cancel();
                waiter
            });
            let c = {
                let table = table.clone();
                let inside = inside.clone();
                thread::spawn(move || {
                    let mut w = Polled::new(table.lock_owned(KEY));
                    if let Some(g) = w.poll() {
                        drop(Holding::new(g, &inside));
                    }
                    w
                })
            };
            a.join().unwrap();
            let waiter = b.join().unwrap();
            let mut newcomer = c.join().unwrap();

            assert!(waiter.wakes() <= 1, "waiter woken {} times", waiter.wakes());
            if newcomer.pending() {
                assert_eq!(
                    newcomer.wakes(),
                    1,
                    "queued newcomer never granted (lost grant)"
                );
                let g = newcomer.poll().expect("newcomer woken but not granted");
                drop(Holding::new(g, &inside));
            } else {
                assert_eq!(
                    newcomer.wakes(),
                    0,
                    "newcomer acquired directly but was woken"
                );
            }
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (e) Release vs a re-poll that switches wakers.
    ///
    /// A waiter registered with waker 1 is polled again, on another thread, with
    /// waker 2 while the holder releases. Exactly one wake must be delivered, to
    /// the waker registered at the moment of the hand-off: if the re-poll found
    /// the grant it completes (waker 1 may have been woken, waker 2 never); if it
    /// stayed pending, waker 2 must be woken and waker 1 never.
    #[test]
    fn release_vs_repoll_with_new_waker() {
        model("e: release vs re-poll with a new waker", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
            let mut waiter = Polled::new(table.clone().lock_owned(KEY));
            assert!(waiter.poll().is_none());

            let a = thread::spawn(move || drop(holder));
            let b = {
                let inside = inside.clone();
                thread::spawn(move || {
                    let old = waiter.switch_waker();
                    if let Some(g) = waiter.poll() {
                        drop(Holding::new(g, &inside));
                    }
                    (old, waiter)
                })
            };
            a.join().unwrap();
            let (old, mut waiter) = b.join().unwrap();

            if waiter.pending() {
                assert_eq!(old.wakes(), 0, "stale waker woken after it was replaced");
                assert_eq!(waiter.wakes(), 1, "current waker not woken: lost wake-up");
                let g = waiter.poll().expect("woken waiter not granted");
                drop(Holding::new(g, &inside));
            } else {
                assert!(old.wakes() <= 1, "old waker woken {} times", old.wakes());
                assert_eq!(
                    waiter.wakes(),
                    0,
                    "new waker woken after the grant was taken"
                );
            }
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (f) Two blocking lockers and a third thread that gives up: it polls a lock
    /// future once and drops it (a timeout or `select!` losing the race), holding
    /// and releasing first if that one poll acquired. Whatever the order, a grant
    /// that reaches the abandoning future must pass on, or a blocked thread
    /// would park forever (loom reports a deadlock). Never two holders; empty
    /// table at the end.
    #[test]
    fn blocking_lockers_and_abandoned_future() {
        model("f: 2 blocking lockers + 1 abandoned future", &[], |_| {
            let table = table();
            let inside = Inside::new();
            let mut threads: Vec<_> = (0..2)
                .map(|_| {
                    let table = table.clone();
                    let inside = inside.clone();
                    thread::spawn(move || {
                        let g = block_on(table.lock(KEY));
                        drop(Holding::new(g, &inside));
                    })
                })
                .collect();
            threads.push({
                let table = table.clone();
                let inside = inside.clone();
                thread::spawn(move || {
                    let mut w = Polled::new(table.lock(KEY));
                    if let Some(g) = w.poll() {
                        drop(Holding::new(g, &inside));
                    }
                    w.cancel();
                })
            });
            for t in threads {
                t.join().unwrap();
            }
            table.assert_consistent();
            assert_eq!(table.len(), 0, "entry leaked");
        });
    }

    /// (g) Release vs the head waiter's lock-free poll, then its drop, with a
    /// successor queued behind it.
    ///
    /// The key is held; W1 then W2 queue. Thread A drops the guard, which grants
    /// W1: it unlinks W1, writes the grant into W1's node and publishes it with
    /// a release store of the node's state word. Thread B polls W1 once (a grant
    /// already published is taken without the shard lock: loom checks that the
    /// grant's cells are read only after the granter's writes) and, if it is
    /// granted, holds the key and releases it; otherwise it drops W1, which may
    /// race the grant itself: the drop either unlinks W1 before it is granted or
    /// releases its unobserved grant. In every order the key reaches W2 once: W2
    /// is woken exactly once and granted on its next poll. Never two holders;
    /// every grant made counts as an acquisition; the table is clean at the end.
    #[test]
    fn release_vs_head_poll_then_drop() {
        model(
            "g: release vs the head's lock-free poll / drop",
            &[
                "head served",
                "head dropped before its grant",
                "head dropped with an unobserved grant",
            ],
            |seen| {
                let table = table();
                let inside = Inside::new();
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
                let mut w1 = Polled::new(table.clone().lock_owned(KEY));
                let mut w2 = Polled::new(table.clone().lock_owned(KEY));
                assert!(w1.poll().is_none());
                assert!(w2.poll().is_none());

                let a = thread::spawn(move || drop(holder));
                let b = {
                    let inside = inside.clone();
                    thread::spawn(move || match w1.poll() {
                        Some(g) => {
                            drop(Holding::new(g, &inside));
                            (true, w1)
                        }
                        None => {
                            w1.cancel();
                            (false, w1)
                        }
                    })
                };
                a.join().unwrap();
                let (served, w1) = b.join().unwrap();
                assert!(w1.wakes() <= 1, "W1 woken {} times", w1.wakes());
                assert!(w2.pending(), "W2 cannot complete without being polled");
                table.assert_consistent();

                let g = finish(&mut w2, "W2 (the key passed on)");
                assert_eq!(w2.wakes(), 1, "W2 woken {} times", w2.wakes());
                drop(Holding::new(g, &inside));
                let stats = table.stats();
                assert_eq!(
                    stats.acquisitions,
                    1 + stats.handoffs,
                    "a grant made was not counted"
                );
                seen.note(match (served, stats.handoffs) {
                    (true, 2) => "head served",
                    (false, 1) => "head dropped before its grant",
                    (false, 2) => "head dropped with an unobserved grant",
                    other => panic!("unexpected outcome {other:?}"),
                });
                assert_eq!(stats.cancelled, u64::from(!served));
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (h) A first poll that queues and registers its waker without the lock,
    /// vs the holder's release.
    ///
    /// The key is held. Thread A drops the guard; thread B creates a lock future
    /// and polls it once: it takes the free key, or links its waiter and then,
    /// after unlocking, stores its waker and compare-and-swaps the node's state
    /// `WAITING → ARMED`, racing the release's grant (a compare-and-swap
    /// `WAITING → GRANTED`, or, if it sees `ARMED`, taking the waker and storing
    /// `GRANTED`). No wake-up is lost: B's poll either returns the key at once
    /// (free, or granted while it registered: then nobody wakes it), or it is
    /// woken exactly once and granted on its next poll.
    #[test]
    fn first_poll_registration_vs_release() {
        model(
            "h: first poll's lock-free registration vs release",
            &[
                "took the free key",
                "granted while registering",
                "woken by the grant",
            ],
            |seen| {
                let table = table();
                let inside = Inside::new();
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);

                let a = thread::spawn(move || drop(holder));
                let b = {
                    let (table, inside) = (table.clone(), inside.clone());
                    thread::spawn(move || {
                        let mut w = Polled::new(table.lock_owned(KEY));
                        let ready = w.poll().map(|g| drop(Holding::new(g, &inside)));
                        (ready.is_some(), w)
                    })
                };
                a.join().unwrap();
                let (ready, mut w) = b.join().unwrap();
                table.assert_consistent();

                let handoffs = table.stats().handoffs;
                if ready {
                    assert_eq!(w.wakes(), 0, "completed on its first poll, yet woken");
                    seen.note(if handoffs == 0 {
                        "took the free key"
                    } else {
                        "granted while registering"
                    });
                } else {
                    let g = finish(&mut w, "the queued first poll");
                    assert_eq!(w.wakes(), 1, "woken {} times", w.wakes());
                    assert_eq!(handoffs, 1);
                    drop(Holding::new(g, &inside));
                    seen.note("woken by the grant");
                }
                let stats = table.stats();
                assert_eq!((stats.acquisitions, stats.contended), (2, handoffs));
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }
}
