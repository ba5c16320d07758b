//! Loom models of the races that involve time: a lease lapsing while its
//! holder releases, a timeout running out while the key is handed over, a
//! revocation racing a release or a lapse, a renewal racing a lapse, a grant
//! that lapses before its future runs (it is fenced like a guard, never
//! queued again), and eventual fairness (a release that frees the key and
//! nudges the head, racing bargers, the head's poll and the fairness
//! deadline, which is judged by the clock), and loss notification (a
//! `Lost` future racing a lapse, a `revoke_grant`, and its own drop and the
//! guard's release racing a `revoke`; a keep-alive's renewal racing a
//! `revoke_grant`).
//!
//! Time is a [`ManualClock`]: under `--cfg loom` its internal mutex is loom's
//! (`src/support/loom.rs`), so `clock.advance()` on one loom thread races, at every
//! lock acquisition, with the table's operations (which read the clock under
//! the shard lock) on another. Its sleepers are the timers of a manual-clock
//! table, so a waiter's timer firing is part of what is explored; no async-io
//! timer is involved.
//!
//! Run with (what `.ci/run` does, then again without `LOOM_MAX_PREEMPTIONS`):
//!
//! ```text
//! RUSTC_WRAPPER="$PWD/.ci/loom-rustc" LOOM_MAX_PREEMPTIONS=3 \
//!     CARGO_TARGET_DIR=target/loom cargo test --release --features test-util \
//!     --test loom_leases -- --nocapture
//! ```
//!
//! Same approach as `tests/loom.rs` (whose helpers are copied here, not
//! shared): one shard and a deterministic hasher; `!Unpin` lock futures
//! pinned in boxes and polled by hand with a waker that counts its wakes in a
//! loom atomic (once no other thread is left, a pending future must have been
//! woken since its last poll started: no lost wake-up); an `Inside` counter
//! that must never exceed one. With leases and revocation a holder's authority can
//! end without the holder doing anything, so a holder is counted in `Inside`
//! until the *first* of its release and the event that ends its authority
//! (the clock advance past its deadline, a revocation): [`Authority::end`].
//! That bookkeeping alone proves little (a grant can only follow those
//! events), so the models also cross-check `check()` against what other
//! threads published through loom atomics: a `check()` that starts after a
//! thread has seen the successor granted, or seen the clock advanced past the
//! deadline, or seen the revocation return, must fail. And each model checks
//! that every outcome it expects (e.g. "granted" and "timed out") was reached
//! by some interleaving, so that none of its branches is vacuous.
//!
//! Not modeled (plain `std`, as in `tests/loom.rs`): the per-shard statistics
//! and a guard's cached lease deadline, read here only after the joins.

#[cfg(not(all(loom, feature = "test-util")))]
#[test]
#[ignore = "a loom model: run it with `.ci/run loom` (the command is in this file's header)"]
fn loom_models_run_only_under_cfg_loom() {}

#[cfg(all(loom, feature = "test-util"))]
mod models {
    use std::collections::hash_map::DefaultHasher;
    use std::collections::BTreeSet;
    use std::future::Future;
    use std::hash::BuildHasherDefault;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex as StdMutex};
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::{Duration, Instant};

    use keylock::{
        Fairness, FencingToken, LockError, LockOptions, LockTable, ManualClock, OwnedGuard,
    };
    use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use loom::sync::Mutex;
    use loom::thread;

    type Hasher = BuildHasherDefault<DefaultHasher>;
    type Table = LockTable<u32, Hasher>;
    type Guard = OwnedGuard<u32, Hasher>;

    const KEY: u32 = 7;
    const NANO: Duration = Duration::from_nanos(1);

    /// A one-shard table with a deterministic hasher, judged by `clock`.
    fn table(clock: &ManualClock) -> Arc<Table> {
        Arc::new(
            LockTable::<u32>::builder()
                .shards(1)
                .hasher(Hasher::default())
                .clock(clock.clone())
                .build(),
        )
    }

    /// A manual clock whose tables keep one timer per shard (as on the real
    /// clock) or one per waiter.
    fn manual(shard_timers: bool) -> ManualClock {
        if shard_timers {
            ManualClock::with_shard_timers()
        } else {
            ManualClock::new()
        }
    }

    /// Armed timers of either kind.
    fn timers(clock: &ManualClock) -> usize {
        clock.sleepers() + clock.armed_shards()
    }

    fn lease(d: Duration) -> LockOptions {
        LockOptions::new().lease(d)
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
    // Wakers, hand-polled futures, holders (as in tests/loom.rs)
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

    /// A future polled by hand with a counting waker. Lock futures are `!Unpin`,
    /// so the future is pinned in a box before its first poll.
    struct Polled<F: Future> {
        fut: Option<Pin<Box<F>>>,
        counter: Arc<CountingWaker>,
        waker: Waker,
        /// The waker's wakes when the last poll started (see [`woken`]).
        ///
        /// [`woken`]: Self::woken
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

        fn pending(&self) -> bool {
            self.fut.is_some()
        }

        fn wakes(&self) -> usize {
            self.counter.wakes.load(SeqCst)
        }

        /// Whether the waker was woken since the last poll started: a wake
        /// during or after a poll makes an executor poll the future again.
        fn woken(&self) -> bool {
            self.wakes() > self.polled_at
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

    /// How many grants with authority the key has, as the model sees them.
    struct Inside(AtomicUsize);

    impl Inside {
        fn new() -> Arc<Self> {
            Arc::new(Self(AtomicUsize::new(0)))
        }

        fn enter(&self) {
            let before = self.0.fetch_add(1, SeqCst);
            assert_eq!(before, 0, "two holders with authority at once");
        }

        fn exit(&self) {
            let before = self.0.fetch_sub(1, SeqCst);
            assert_eq!(before, 1, "holder count corrupted");
        }
    }

    /// One grant's authority: counted in `Inside` from the grant until the first
    /// of its release and whatever else ends it (a lapse, a revocation), which
    /// the thread causing it declares by calling [`end`](Self::end) just before.
    ///
    /// `end` is a loom mutex, not a flag swap: a thread that finds the authority
    /// already ended must also find it already out of `Inside`, or it could let a
    /// successor enter in between.
    struct Authority {
        live: Mutex<bool>,
        inside: Arc<Inside>,
    }

    impl Authority {
        fn new(inside: &Arc<Inside>) -> Arc<Self> {
            inside.enter();
            Arc::new(Self {
                live: Mutex::new(true),
                inside: inside.clone(),
            })
        }

        fn end(&self) {
            let mut live = self.live.lock().unwrap();
            if std::mem::replace(&mut *live, false) {
                self.inside.exit();
            }
        }
    }

    /// A guard with its authority; dropping it ends the authority, then releases.
    struct Holding {
        guard: Option<Guard>,
        authority: Arc<Authority>,
    }

    impl Holding {
        fn new(guard: Guard, inside: &Arc<Inside>) -> Self {
            Self {
                guard: Some(guard),
                authority: Authority::new(inside),
            }
        }

        fn guard(&self) -> &Guard {
            self.guard.as_ref().unwrap()
        }

        fn token(&self) -> FencingToken {
            self.guard().token()
        }
    }

    impl Drop for Holding {
        fn drop(&mut self) {
            if std::thread::panicking() {
                // A model failed: leak the guard rather than touch the table
                // (and loom) while unwinding, which would abort the test binary
                // and hide the failure's message.
                std::mem::forget(self.guard.take());
                return;
            }
            // Leave before releasing: once released the successor may enter.
            self.authority.end();
            drop(self.guard.take());
        }
    }

    /// The guard holds the key now: live, locked, and nobody else can take it.
    fn assert_holds(table: &Arc<Table>, h: &Holding, what: &str) {
        assert_eq!(h.guard().check(), Ok(h.token()), "{what}: lost its grant");
        assert!(
            !h.guard().is_expired(),
            "{what}: is_expired != check().is_err()"
        );
        assert!(table.is_locked(&KEY), "{what}: key not locked");
        assert!(
            table.clone().try_lock_owned(KEY).is_err(),
            "{what}: try_lock took a held key"
        );
    }

    // ---------------------------------------------------------------------------
    // (a) lapse vs release
    // ---------------------------------------------------------------------------

    /// (a) A lease lapsing vs its holder's release.
    ///
    /// The holder has lease `L`; a waiter (lease `waiter_lease`) heads the queue,
    /// polled once, so its timer is armed at the holder's deadline. Thread 1
    /// advances the clock by `L` (the lapse) and then re-polls the waiter; thread
    /// 2 checks the holder's grant and then drops its guard.
    ///
    /// - The re-poll must complete with the key: by then the holder either
    ///   released or lapsed, whichever came first hands it over, once (the
    ///   waiter's token is the holder's plus one). The waiter's timer, or the
    ///   release, must have woken it (no lost wake-up).
    /// - Never two grants with authority: `Inside`, plus thread 2's `check()`
    ///   fails if, before it started, thread 2 could already see the clock
    ///   advanced or the waiter granted.
    /// - The stale guard's drop never frees the waiter's grant: after both
    ///   threads the waiter's guard still checks `Ok`, the key is locked and
    ///   `try_lock` fails.
    /// - No timer is left armed; the table is empty at the end.
    ///
    /// With `waiter_lease = Some(L)` a grant made by the release *before* the
    /// advance lapses, unobserved, with that same advance. The waiter is never
    /// queued again: its re-poll completes with that grant, fenced like a guard
    /// whose lease lapsed (`check()` fails, counted as expired), and the key is
    /// free for anyone else (its guard keeps the entry until it is dropped).
    fn lapse_vs_release(seen: &Seen, waiter_lease: Option<Duration>, shard_timers: bool) {
        const L: Duration = Duration::from_secs(2);
        let clock = manual(shard_timers);
        let table = table(&clock);
        let inside = Inside::new();
        let holder = Holding::new(
            table.clone().try_lock_owned_with(KEY, lease(L)).unwrap(),
            &inside,
        );
        let holder_token = holder.token();
        let holder_auth = holder.authority.clone();
        let opts = match waiter_lease {
            Some(l) => lease(l),
            None => LockOptions::new(),
        };
        let mut waiter = Polled::new(table.clone().lock_owned_with(KEY, opts));
        assert!(waiter.poll().is_none(), "the key is held: must queue");
        assert_eq!(timers(&clock), 1, "the head arms a timer at the deadline");
        let advanced = Arc::new(AtomicBool::new(false));
        let granted = Arc::new(AtomicBool::new(false));

        let t1 = {
            let (clock, inside) = (clock.clone(), inside.clone());
            let (advanced, granted) = (advanced.clone(), granted.clone());
            thread::spawn(move || {
                holder_auth.end(); // the lapse ends it, if the release has not
                clock.advance(L);
                advanced.store(true, SeqCst);
                // A waiter's own timer holds a clone of its waker and fires
                // whatever happened; a shard's timer nudges only waiters still
                // queued, so a grant made by the release may still be on its way
                // to the waker (the end of the model checks no wake is lost).
                assert!(
                    shard_timers || waiter.woken(),
                    "the lapse did not wake the head waiter (its timer), nor did the release"
                );
                let g = waiter
                    .poll()
                    .expect("the holder lapsed or released: the head must be granted")
                    .expect("no timeout, valid lease: cannot fail");
                let token = g.token();
                match g.check() {
                    Ok(t) => {
                        assert_eq!(t, token);
                        let h = Holding::new(g, &inside);
                        granted.store(true, SeqCst);
                        Ok(h)
                    }
                    Err(e) => {
                        // Granted by the release before the advance, which
                        // lapsed that grant before the future ran: fenced.
                        assert_eq!(e, LockError::Expired { token, key: None });
                        assert!(waiter_lease.is_some(), "a grant without a lease lapsed");
                        assert!(g.is_expired(), "is_expired != check().is_err()");
                        Err(g)
                    }
                }
            })
        };
        let t2 = thread::spawn(move || {
            let saw_advanced = advanced.load(SeqCst);
            let saw_granted = granted.load(SeqCst);
            let checked = holder.guard().check();
            if saw_advanced {
                assert!(checked.is_err(), "lapsed lease still checks Ok");
            }
            if saw_granted {
                assert!(
                    checked.is_err(),
                    "holder checks Ok after its successor was granted"
                );
            }
            drop(holder);
            checked.is_ok()
        });
        let got = t1.join().unwrap();
        let checked_ok = t2.join().unwrap();
        seen.note(if checked_ok {
            "holder checked Ok"
        } else {
            "holder checked Err"
        });

        assert_eq!(table.waiters(&KEY), 0);
        assert_eq!(timers(&clock), 0, "a timer stayed armed");
        // A lapse is counted when it is noticed: a holder that releases after
        // the advance but before anything judged its lease is not counted.
        let expired = table.stats().expired;
        assert!(expired <= 1, "expired {expired}");
        seen.note(if expired == 1 {
            "lapse counted"
        } else {
            "no lapse counted"
        });
        // Whichever came first handed the key over, once; never re-granted.
        assert_eq!(table.stats().handoffs, 1, "one handoff only");
        match got {
            Ok(h) => {
                assert_eq!(h.token().get(), holder_token.get() + 1, "one grant only");
                assert_holds(&table, &h, "waiter after the stale guard's drop");
                drop(h);
            }
            Err(fenced) => {
                seen.note("unobserved grant lapsed: fenced");
                assert_eq!(fenced.token().get(), holder_token.get() + 1);
                assert_eq!(expired, 1, "the fenced grant was not counted as expired");
                assert!(!table.is_locked(&KEY), "a lapsed grant still holds the key");
                assert_eq!(table.len(), 1, "the fenced guard keeps its entry");
                let next = table
                    .clone()
                    .try_lock_owned(KEY)
                    .expect("the fenced grant's key is free");
                assert!(next.token() > fenced.token(), "token did not increase");
                drop(fenced); // stale: must not free `next`
                assert!(table.is_locked(&KEY), "a fenced guard's drop freed the key");
                drop(next);
            }
        }
        table.assert_consistent();
        assert_eq!(table.len(), 0, "entry leaked");
    }

    #[test]
    fn a_lapse_vs_release() {
        model(
            "a: lapse vs release",
            &[
                "holder checked Ok",
                "holder checked Err",
                "lapse counted",
                "no lapse counted",
            ],
            |seen| lapse_vs_release(seen, None, false),
        );
    }

    #[test]
    fn a2_lapse_vs_release_leased_waiter() {
        model(
            "a2: lapse vs release, leased waiter",
            &[
                "holder checked Ok",
                "holder checked Err",
                "lapse counted",
                "no lapse counted",
                "unobserved grant lapsed: fenced",
            ],
            |seen| lapse_vs_release(seen, Some(Duration::from_secs(2)), false),
        );
    }

    // ---------------------------------------------------------------------------
    // (b) timeout vs grant
    // ---------------------------------------------------------------------------

    /// (b) A waiter's timeout vs the holder's release.
    ///
    /// The holder has `holder_lease` (none, or exactly the timeout); a waiter
    /// with timeout `T` is polled once. Thread 1 advances the clock by `T` and
    /// re-polls the waiter, which must complete; thread 2 drops the holder.
    ///
    /// - The waiter ends with `Ok(guard)` or `Timeout`, never both: one output,
    ///   and if it timed out the key is free afterwards (no grant leaked to a
    ///   dead slot): not locked, no waiter, `len() == 0`, `try_lock` succeeds.
    /// - A `Timeout` names the holder still holding, waited exactly `T`, nobody
    ///   ahead; it is only possible when the release came after the timeout
    ///   (thread 1 cannot time out once it has seen the release done).
    /// - With `holder_lease = Some(T)` the lapse and the timeout coincide: the
    ///   lapse is settled first, so the waiter always gets the key.
    /// - `Ok` means a live grant with a newer token; never two holders.
    fn timeout_vs_grant(seen: &Seen, holder_lease: Option<Duration>, shard_timers: bool) {
        const T: Duration = Duration::from_secs(3);
        let clock = manual(shard_timers);
        let table = table(&clock);
        let inside = Inside::new();
        let opts = match holder_lease {
            Some(l) => lease(l),
            None => LockOptions::new(),
        };
        let holder = Holding::new(
            table.clone().try_lock_owned_with(KEY, opts).unwrap(),
            &inside,
        );
        let holder_token = holder.token();
        let holder_auth = holder.authority.clone();
        let mut waiter = Polled::new(
            table
                .clone()
                .lock_owned_with(KEY, LockOptions::new().timeout(T)),
        );
        assert!(waiter.poll().is_none(), "the key is held: must queue");
        assert_eq!(timers(&clock), 1, "one timer: the timeout (or the lapse)");
        let released = Arc::new(AtomicBool::new(false));

        let t1 = {
            let (clock, inside, released) = (clock.clone(), inside.clone(), released.clone());
            thread::spawn(move || {
                if holder_lease.is_some() {
                    holder_auth.end(); // the advance lapses it
                }
                clock.advance(T);
                // As in (a): a shard timer does not wake a granted waiter.
                assert!(
                    shard_timers || waiter.wakes() >= 1,
                    "the timer did not wake the waiter"
                );
                let saw_released = released.load(SeqCst);
                let out = waiter
                    .poll()
                    .expect("the timeout passed: the waiter must complete");
                match out {
                    Ok(g) => {
                        let h = Holding::new(g, &inside);
                        assert!(h.token() > holder_token, "token did not increase");
                        assert_eq!(h.guard().check(), Ok(h.token()), "fresh grant not live");
                        Ok(h)
                    }
                    Err(LockError::Timeout {
                        waited,
                        holder,
                        ahead,
                        ..
                    }) => {
                        assert!(!saw_released, "timed out after the key was released");
                        assert!(
                            holder_lease.is_none(),
                            "timed out although the holder's lease lapsed at that instant"
                        );
                        assert_eq!(holder, Some(holder_token), "timeout names the holder");
                        assert_eq!(waited, T);
                        assert_eq!(ahead, 0);
                        Err(())
                    }
                    Err(other) => panic!("unexpected error {other:?}"),
                }
            })
        };
        let t2 = {
            let released = released.clone();
            thread::spawn(move || {
                drop(holder);
                released.store(true, SeqCst);
            })
        };
        let out = t1.join().unwrap();
        t2.join().unwrap();

        assert_eq!(table.waiters(&KEY), 0, "a waiter is left");
        assert_eq!(timers(&clock), 0, "a timer stayed armed");
        match out {
            Ok(h) => {
                assert_holds(&table, &h, "waiter granted before its timeout");
                assert_eq!(table.stats().timed_out, 0);
                seen.note(if table.stats().expired == 1 {
                    "granted by the lapse"
                } else {
                    "granted by the release"
                });
                drop(h);
            }
            Err(()) => {
                seen.note("timed out");
                assert!(!table.is_locked(&KEY), "timed out, yet the key is held");
                assert_eq!(table.len(), 0, "timed out, yet the entry stayed");
                assert_eq!(table.stats().timed_out, 1);
                drop(
                    table
                        .clone()
                        .try_lock_owned(KEY)
                        .expect("timed out and released: the key must be free"),
                );
            }
        }
        table.assert_consistent();
        assert_eq!(table.len(), 0, "entry leaked");
    }

    #[test]
    fn a3_lapse_vs_release_shard_timers() {
        model(
            "a3: lapse vs release, shard timers",
            &[
                "holder checked Ok",
                "holder checked Err",
                "lapse counted",
                "no lapse counted",
            ],
            |seen| lapse_vs_release(seen, None, true),
        );
    }

    #[test]
    fn b5_timeout_vs_grant_shard_timers() {
        model(
            "b5: timeout vs grant, shard timers",
            &["granted by the release", "timed out"],
            |seen| timeout_vs_grant(seen, None, true),
        );
    }

    #[test]
    fn b6_timeout_vs_grant_lapse_at_the_same_instant_shard_timers() {
        model(
            "b6: timeout vs grant, lapse at the timeout, shard timers",
            &["granted by the lapse", "granted by the release"],
            |seen| timeout_vs_grant(seen, Some(Duration::from_secs(3)), true),
        );
    }

    #[test]
    fn b_timeout_vs_grant() {
        model(
            "b: timeout vs grant",
            &["granted by the release", "timed out"],
            |seen| timeout_vs_grant(seen, None, false),
        );
    }

    #[test]
    fn b2_timeout_vs_grant_lapse_at_the_same_instant() {
        model(
            "b2: timeout vs grant, lapse at the timeout",
            &["granted by the lapse", "granted by the release"],
            |seen| timeout_vs_grant(seen, Some(Duration::from_secs(3)), false),
        );
    }

    /// (b3) A waiter's timeout vs the holder's release vs the waiter's own poll,
    /// each on its own thread.
    ///
    /// The holder has no lease; a waiter with timeout `T` is polled once (its
    /// timer armed at `T`). Thread 1 advances the clock by `T`; thread 2 drops
    /// the holder; the main thread polls the waiter once meanwhile. The poll
    /// races both: it may find the grant published (lock-free), judge its
    /// timeout against a clock that moves under it, or give up under the shard
    /// lock just as the release would grant it (it then takes the grant).
    ///
    /// - One output: `Ok` (the next token, live) or `Timeout` (naming the holder
    ///   that still held, waited exactly `T`, nobody ahead), and `Timeout` only
    ///   if the release had not happened: a poll that started after seeing the
    ///   release done is granted; one that started after seeing the advance done
    ///   completes.
    /// - A waiter still pending after both threads is woken (by its timer or the
    ///   grant: no lost wake-up) and granted on its next poll.
    /// - After a timeout the key is free and the table empty; no timer is left
    ///   armed; never two holders.
    ///
    /// Under eventual fairness (`T` within the fairness bound, so the release
    /// frees the key and nudges the waiter instead of granting it) the same must
    /// hold: a waiter whose key was released before its timeout is served.
    fn timeout_vs_release_vs_poll(seen: &Seen, fairness: Fairness) {
        let clock = ManualClock::new();
        let inside = Inside::new();
        let (t, table, holder) = match fairness {
            Fairness::Strict => {
                let table = table(&clock);
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
                (Duration::from_secs(3), table, holder)
            }
            _ => {
                let (table, holder) = eventual_table(&clock, &inside);
                (Fairness::EVENTUAL_BOUND / 5, table, holder)
            }
        };
        let holder_token = holder.token();
        let mut waiter = Polled::new(
            table
                .clone()
                .lock_owned_with(KEY, LockOptions::new().timeout(t)),
        );
        assert!(waiter.poll().is_none(), "the key is held: must queue");
        assert_eq!(clock.sleepers(), 1, "one timer: the timeout");
        let released = Arc::new(AtomicBool::new(false));
        let advanced = Arc::new(AtomicBool::new(false));

        let t1 = {
            let (clock, advanced) = (clock.clone(), advanced.clone());
            thread::spawn(move || {
                clock.advance(t);
                advanced.store(true, SeqCst);
            })
        };
        let t2 = {
            let released = released.clone();
            thread::spawn(move || {
                drop(holder);
                released.store(true, SeqCst);
            })
        };
        let saw_released = released.load(SeqCst);
        let saw_advanced = advanced.load(SeqCst);
        let raced = waiter.poll();
        t1.join().unwrap();
        t2.join().unwrap();

        if saw_released || saw_advanced {
            assert!(raced.is_some(), "granted or timed out, yet still pending");
        }
        let got = match raced {
            Some(Err(LockError::Timeout {
                waited,
                holder,
                ahead,
                ..
            })) => {
                seen.note("timed out");
                assert!(!saw_released, "timed out after the key was released");
                assert_eq!(holder, Some(holder_token), "timeout names the holder");
                assert_eq!(waited, t);
                assert_eq!(ahead, 0);
                None
            }
            Some(Err(other)) => panic!("unexpected error {other:?}"),
            Some(Ok(g)) => {
                seen.note("granted in the race");
                Some(g)
            }
            None => {
                let g = finish(&mut waiter, "the waiter (timer or grant)")
                    .expect("released before it polled again: granted");
                seen.note("granted afterwards");
                Some(g)
            }
        };
        assert_eq!(table.waiters(&KEY), 0, "a waiter is left");
        assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
        match got {
            Some(g) => {
                let h = Holding::new(g, &inside);
                assert_eq!(h.token().get(), holder_token.get() + 1, "one grant only");
                assert_holds(&table, &h, "the granted waiter");
                assert_eq!(table.stats().timed_out, 0);
                drop(h);
            }
            None => {
                assert!(!table.is_locked(&KEY), "timed out, yet the key is held");
                assert_eq!(table.stats().timed_out, 1);
                drop(
                    table
                        .clone()
                        .try_lock_owned(KEY)
                        .expect("timed out and released: the key must be free"),
                );
            }
        }
        table.assert_consistent();
        assert_eq!(table.len(), 0, "entry leaked");
    }

    #[test]
    fn b3_timeout_vs_grant_vs_poll() {
        model(
            "b3: timeout vs grant vs the waiter's poll",
            &["timed out", "granted in the race", "granted afterwards"],
            |seen| timeout_vs_release_vs_poll(seen, Fairness::Strict),
        );
    }

    #[test]
    fn b4_eventual_timeout_vs_release_vs_poll() {
        model(
            "b4: eventual: timeout vs release vs the waiter's poll",
            &["timed out", "granted in the race", "granted afterwards"],
            |seen| timeout_vs_release_vs_poll(seen, Fairness::Eventual),
        );
    }

    // ---------------------------------------------------------------------------
    // (c) revoke vs release
    // ---------------------------------------------------------------------------

    /// (c) `revoke` vs the holder's release, with a waiter queued.
    ///
    /// Thread 1 revokes the key and then polls the waiter; thread 2 checks the
    /// holder's grant and drops its guard.
    ///
    /// - `revoke` returns `Some(holder's token)` iff it came before the release;
    ///   the key then passes to the waiter, whose poll completes with a live
    ///   grant that survives the revoked guard's later drop.
    /// - If the release came first the key had already been handed to the
    ///   waiter, and `revoke` takes that unobserved grant instead: it returns its
    ///   token (the holder's plus one). The waiter is never queued again: its
    ///   poll completes with that revoked grant, fenced like a guard (`check()`
    ///   fails), and the key is free for anyone else.
    /// - `revoke` never returns `None` here: the key always has a live holder.
    /// - Cross-checks: thread 1 saw the release done before revoking ⇒ not the
    ///   holder's token; thread 2 saw the revocation done before its `check()` ⇒
    ///   the check fails and the holder's token was revoked; the holder's check
    ///   fails only if it was revoked (no lease).
    /// - The waiter is woken; never two holders; table empty at the end.
    #[test]
    fn c_revoke_vs_release() {
        model(
            "c: revoke vs release",
            &[
                "revoked the holder",
                "revoked the waiter's unobserved grant",
                "holder checked Ok",
                "holder checked Err",
            ],
            |seen| {
                let clock = ManualClock::new();
                let table = table(&clock);
                let inside = Inside::new();
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
                let holder_token = holder.token();
                let holder_auth = holder.authority.clone();
                let mut waiter = Polled::new(table.clone().lock_owned(KEY));
                assert!(waiter.poll().is_none(), "the key is held: must queue");
                let released = Arc::new(AtomicBool::new(false));
                let revoked = Arc::new(AtomicBool::new(false));

                let t1 = {
                    let (table, inside) = (table.clone(), inside.clone());
                    let (released, revoked) = (released.clone(), revoked.clone());
                    thread::spawn(move || {
                        let saw_released = released.load(SeqCst);
                        holder_auth.end(); // the revocation ends it, if the release has not
                        let r = table.revoke(&KEY);
                        revoked.store(true, SeqCst);
                        let r = r.expect("the key always has a live holder: revoke is Some");
                        if saw_released {
                            assert_ne!(r, holder_token, "revoked a holder that had released");
                        }
                        // (Its wake may still be on its way: the release wakes it
                        // after unlocking. Counted after the joins.)
                        let g = waiter
                            .poll()
                            .expect("revoked: the key must have passed to the waiter");
                        if g.token() == r {
                            // The release granted it, then the revocation took it.
                            assert_eq!(
                                g.check(),
                                Err(LockError::Expired {
                                    token: r,
                                    key: None
                                }),
                                "a revoked grant checks Ok"
                            );
                            return (r, Err(g), waiter);
                        }
                        let h = Holding::new(g, &inside);
                        assert!(h.token() > r, "token did not increase past the revoked one");
                        assert_eq!(h.guard().check(), Ok(h.token()), "fresh grant not live");
                        (r, Ok(h), waiter)
                    })
                };
                let t2 = thread::spawn(move || {
                    let saw_revoked = revoked.load(SeqCst);
                    let checked = holder.guard().check();
                    if saw_revoked {
                        assert!(checked.is_err(), "revoked guard still checks Ok");
                    }
                    drop(holder);
                    released.store(true, SeqCst);
                    checked.is_err()
                });
                let (r, got, waiter) = t1.join().unwrap();
                let holder_fenced = t2.join().unwrap();

                if holder_fenced {
                    assert_eq!(r, holder_token, "the holder was fenced, so it was revoked");
                }
                seen.note(if holder_fenced {
                    "holder checked Err"
                } else {
                    "holder checked Ok"
                });
                assert_eq!(table.waiters(&KEY), 0);
                assert_eq!(table.stats().revoked, 1);
                assert_eq!(table.stats().handoffs, 1, "one handoff only");
                assert!(!waiter.pending());
                assert!(
                    waiter.wakes() >= 1,
                    "the waiter was granted but never woken"
                );
                match got {
                    Ok(h) => {
                        seen.note("revoked the holder");
                        // Revoked before the release: the waiter got the next
                        // token and the release was stale.
                        assert_eq!(r, holder_token);
                        assert_eq!(h.token().get(), holder_token.get() + 1);
                        assert_holds(&table, &h, "waiter after the revoked guard's drop");
                        drop(h);
                    }
                    Err(fenced) => {
                        // Released first: the waiter's unobserved grant was
                        // revoked, and the waiter completed with it, fenced.
                        seen.note("revoked the waiter's unobserved grant");
                        assert_eq!(r.get(), holder_token.get() + 1, "revoked an unknown grant");
                        assert!(
                            !table.is_locked(&KEY),
                            "a revoked grant still holds the key"
                        );
                        let next = table
                            .clone()
                            .try_lock_owned(KEY)
                            .expect("the revoked grant's key is free");
                        assert!(next.token() > r, "token did not increase");
                        drop(fenced); // stale: must not free `next`
                        assert!(table.is_locked(&KEY), "a fenced guard's drop freed the key");
                        drop(next);
                    }
                }
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (c2) `revoke` vs the holder's lease lapsing, with a waiter queued.
    ///
    /// The holder has lease `L`; a waiter heads the queue. Thread 1 revokes the
    /// key; thread 2 advances the clock by `L`. Then the waiter is polled.
    ///
    /// - `revoke` returns `Some(holder's token)` iff it came before the lapse,
    ///   and `None` after it: a lapsed holder is not revoked (the lapse is
    ///   settled instead, and counted as such). Thread 1 saw the advance done
    ///   before revoking ⇒ `None`; thread 2 saw the revocation done before
    ///   advancing ⇒ `Some`.
    /// - Either way the key passed to the waiter exactly once, with the next
    ///   token; the holder's check fails; its later drop frees nothing.
    #[test]
    fn c2_revoke_vs_lapse() {
        model(
            "c2: revoke vs lapse",
            &["revoked the holder", "revoke found it lapsed"],
            |seen| {
                const L: Duration = Duration::from_secs(2);
                let clock = ManualClock::new();
                let table = table(&clock);
                let inside = Inside::new();
                let holder = Holding::new(
                    table.clone().try_lock_owned_with(KEY, lease(L)).unwrap(),
                    &inside,
                );
                let holder_token = holder.token();
                let mut waiter = Polled::new(table.clone().lock_owned(KEY));
                assert!(waiter.poll().is_none(), "the key is held: must queue");
                let advanced = Arc::new(AtomicBool::new(false));
                let revoked = Arc::new(AtomicBool::new(false));

                let t1 = {
                    let table = table.clone();
                    let auth = holder.authority.clone();
                    let (advanced, revoked) = (advanced.clone(), revoked.clone());
                    thread::spawn(move || {
                        let saw_advanced = advanced.load(SeqCst);
                        auth.end(); // the revocation ends it, if the lapse has not
                        let r = table.revoke(&KEY);
                        revoked.store(true, SeqCst);
                        if saw_advanced {
                            assert_eq!(r, None, "revoked a lapsed holder");
                        }
                        r
                    })
                };
                let t2 = {
                    let clock = clock.clone();
                    let auth = holder.authority.clone();
                    thread::spawn(move || {
                        let saw_revoked = revoked.load(SeqCst);
                        auth.end(); // the lapse ends it, if the revocation has not
                        clock.advance(L);
                        advanced.store(true, SeqCst);
                        saw_revoked
                    })
                };
                let r = t1.join().unwrap();
                let saw_revoked = t2.join().unwrap();

                match r {
                    Some(t) => {
                        seen.note("revoked the holder");
                        assert_eq!(t, holder_token, "revoked something else");
                        assert_eq!((table.stats().revoked, table.stats().expired), (1, 0));
                    }
                    None => {
                        seen.note("revoke found it lapsed");
                        assert!(!saw_revoked, "revoke returned None before the lapse");
                        assert_eq!((table.stats().revoked, table.stats().expired), (0, 1));
                    }
                }
                assert!(
                    waiter.wakes() >= 1,
                    "the waiter was handed the key but not woken"
                );
                let h = Holding::new(
                    waiter
                        .poll()
                        .expect("revoked or lapsed: the waiter must be granted"),
                    &inside,
                );
                assert_eq!(h.token().get(), holder_token.get() + 1, "one grant only");
                assert!(
                    holder.guard().is_expired(),
                    "revoked or lapsed guard checks Ok"
                );
                drop(holder); // stale: must not free the waiter's grant
                assert_holds(&table, &h, "waiter after the stale guard's drop");
                assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
                drop(h);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (f) unobserved grants
    // ---------------------------------------------------------------------------

    /// (f) A grant to a waiter that never runs costs the key at most one lease:
    /// the next head arms its timer at that grant's deadline, even when its own
    /// poll races the nudge that tells it to.
    ///
    /// The key is held (no lease); W1 (lease `L`) then W2 queue. Thread A drops
    /// the guard: W1 is granted (its lease starting now) and W2, the new head,
    /// is nudged to arm a timer at W1's deadline. Thread B polls W2 once
    /// meanwhile. W1's task never runs. With no other thread left, W2 is polled
    /// while woken, and must then be waiting on a timer (no lost nudge); the
    /// clock passes `L`, the timer wakes W2, and W2 is granted: W1's lapsed,
    /// unobserved grant is fenced (counted as expired), never re-queued. When
    /// W1 finally runs it completes with that fenced grant, whose drop frees
    /// nothing. Never two holders; the table is clean at the end.
    #[test]
    fn f_unobserved_grant_costs_one_lease() {
        model(
            "f: unobserved leased grant vs the next head's timer",
            &[
                "head armed its timer in the race",
                "head armed its timer after",
            ],
            |seen| {
                const L: Duration = Duration::from_secs(2);
                let clock = ManualClock::new();
                let table = table(&clock);
                let inside = Inside::new();
                let holder = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &inside);
                let holder_token = holder.token();
                let mut w1 = Polled::new(table.clone().lock_owned_with(KEY, lease(L)));
                let mut w2 = Polled::new(table.clone().lock_owned(KEY));
                assert!(w1.poll().is_none(), "the key is held: must queue");
                assert!(w2.poll().is_none(), "the key is held: must queue");
                assert_eq!(clock.sleepers(), 0, "no lease, no timer");

                let a = thread::spawn(move || drop(holder));
                let b = thread::spawn(move || {
                    assert!(w2.poll().is_none(), "W1 is ahead: W2 cannot be granted");
                    w2
                });
                a.join().unwrap();
                let mut w2 = b.join().unwrap();
                table.assert_consistent();

                seen.note(if w2.woken() {
                    "head armed its timer after"
                } else {
                    "head armed its timer in the race"
                });
                for _ in 0..3 {
                    if !w2.woken() {
                        break;
                    }
                    assert!(
                        w2.poll().is_none(),
                        "W1's grant is live: W2 cannot be granted"
                    );
                }
                assert!(!w2.woken(), "W2 woken again and again");
                assert_eq!(
                    clock.sleepers(),
                    1,
                    "the new head of an unobserved leased grant armed no timer"
                );
                clock.advance(L);
                let h = Holding::new(finish(&mut w2, "W2 (its timer)"), &inside);
                assert_eq!(h.token().get(), holder_token.get() + 2);
                assert_holds(&table, &h, "W2 after W1's lapse");
                assert_eq!(table.stats().expired, 1, "the lapse was not counted");
                assert!(w1.woken(), "W1 was granted but never woken");
                let fenced = w1.poll().expect("W1 was granted").expect("valid lease");
                assert_eq!(fenced.token().get(), holder_token.get() + 1);
                assert!(fenced.is_expired(), "a lapsed grant checks Ok");
                drop(fenced); // stale: must not free W2's grant
                assert_holds(&table, &h, "W2 after the fenced guard's drop");
                drop(h);
                assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (f2) An unobserved grant that has lapsed: its future is dropped while the
    /// next head's poll notices the lapse.
    ///
    /// The key was handed to W1 (lease `L`), whose task has not run; W2 heads
    /// the queue with its timer armed; the clock has passed `L`, so W1's grant
    /// has lapsed but nothing has noticed. Thread A drops W1's future, which
    /// releases its grant by token; thread B polls W2, which settles the lapse
    /// (fencing W1's grant and granting W2) unless the release came first
    /// (granting W2 directly; a lapse nobody noticed is not counted). Either
    /// way W2 completes with the key, once, and W1's stale release never frees
    /// it. Never two holders; the table is clean at the end.
    #[test]
    fn f2_lapsed_unobserved_grant_dropped_vs_next_head_poll() {
        model(
            "f2: lapsed unobserved grant dropped vs the next head's poll",
            &["the lapse was noticed first", "the drop released first"],
            |seen| {
                const L: Duration = Duration::from_secs(2);
                let clock = ManualClock::new();
                let table = table(&clock);
                let inside = Inside::new();
                let holder = table.clone().try_lock_owned(KEY).unwrap();
                let holder_token = holder.token();
                let mut w1 = Polled::new(table.clone().lock_owned_with(KEY, lease(L)));
                let mut w2 = Polled::new(table.clone().lock_owned(KEY));
                assert!(w1.poll().is_none(), "the key is held: must queue");
                assert!(w2.poll().is_none(), "the key is held: must queue");
                drop(holder);
                assert!(w2.poll().is_none(), "W1 is ahead: W2 cannot be granted");
                assert_eq!(clock.sleepers(), 1, "W2 arms a timer at W1's deadline");
                clock.advance(L);
                assert!(w2.woken(), "W2's timer did not fire");

                let a = thread::spawn(move || drop(w1));
                let b = {
                    let inside = inside.clone();
                    thread::spawn(move || {
                        let g = w2
                            .poll()
                            .expect("W1 lapsed or released: W2 must be granted");
                        let h = Holding::new(g, &inside);
                        assert_eq!(h.guard().check(), Ok(h.token()), "fresh grant not live");
                        h
                    })
                };
                a.join().unwrap();
                let h = b.join().unwrap();

                assert_eq!(
                    h.token().get(),
                    holder_token.get() + 2,
                    "one grant to W2 only"
                );
                assert_holds(&table, &h, "W2 after W1's drop");
                let stats = table.stats();
                assert_eq!((stats.cancelled, stats.handoffs), (1, 2));
                assert_eq!(stats.acquisitions, 3);
                seen.note(if stats.expired == 1 {
                    "the lapse was noticed first"
                } else {
                    "the drop released first"
                });
                drop(h);
                assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (d) renew vs lapse
    // ---------------------------------------------------------------------------

    /// (d) `renew` vs the clock passing the old deadline.
    ///
    /// The guard has lease `L` = 2 s. Thread 1 renews it for `L2` = 5 s; thread
    /// 2 advances the clock by 3 s, past the old deadline (and before the new
    /// one). With `with_waiter`, a waiter heads the queue (its timer armed at the
    /// old deadline).
    ///
    /// - `is_expired() == check().is_err()` afterwards.
    /// - A renewal that returned `Ok` came before the lapse: the guard is live
    ///   until the new deadline minus one nanosecond and expired at it;
    ///   `expires_at()` is the new deadline; a waiter is not granted until then,
    ///   and its timer (re-armed at the new deadline) wakes it exactly then.
    /// - A renewal that returned `Err(Expired)` left the grant lapsed, never
    ///   revived: `check()` fails now and after more time, `expires_at()` is
    ///   unchanged, and the key is free or the waiter's.
    /// - Thread 1 saw the advance done before renewing ⇒ `Err(Expired)`.
    fn renew_vs_lapse(seen: &Seen, with_waiter: bool, shard_timers: bool) {
        const L: Duration = Duration::from_secs(2);
        const L2: Duration = Duration::from_secs(5);
        const PAST: Duration = Duration::from_secs(3);
        let clock = manual(shard_timers);
        let table = table(&clock);
        let inside = Inside::new();
        let t0 = clock.now();
        let holder = Holding::new(
            table.clone().try_lock_owned_with(KEY, lease(L)).unwrap(),
            &inside,
        );
        let token = holder.token();
        let holder_auth = holder.authority.clone();
        let mut waiter = with_waiter.then(|| {
            let mut w = Polled::new(table.clone().lock_owned(KEY));
            assert!(w.poll().is_none(), "the key is held: must queue");
            assert_eq!(timers(&clock), 1);
            w
        });
        let advanced = Arc::new(AtomicBool::new(false));
        let renewed = Arc::new(AtomicBool::new(false));

        let t1 = {
            let (advanced, renewed) = (advanced.clone(), renewed.clone());
            thread::spawn(move || {
                let saw_advanced = advanced.load(SeqCst);
                let r = holder.guard().renew(L2);
                if r.is_ok() {
                    renewed.store(true, SeqCst);
                }
                if saw_advanced {
                    assert_eq!(
                        r,
                        Err(LockError::Expired { token, key: None }),
                        "renewed a lapsed grant"
                    );
                }
                (r, holder)
            })
        };
        let t2 = {
            let clock = clock.clone();
            thread::spawn(move || {
                let saw_renewed = renewed.load(SeqCst);
                if !saw_renewed {
                    // The advance may be the lapse: it ends the authority (an
                    // over-approximation when the renewal comes first, which only
                    // makes `Inside` stricter).
                    holder_auth.end();
                }
                clock.advance(PAST);
                advanced.store(true, SeqCst);
                saw_renewed
            })
        };
        let (r, holder) = t1.join().unwrap();
        let saw_renewed = t2.join().unwrap();
        let g = holder.guard();
        assert_eq!(
            g.is_expired(),
            g.check().is_err(),
            "is_expired != check().is_err()"
        );
        match r {
            Ok(()) => {
                seen.note("renewed");
                assert_eq!(g.check(), Ok(token), "renewed guard lapsed early");
                assert_eq!(
                    g.expires_at(),
                    Some(t0 + L2),
                    "expires_at is the new deadline"
                );
                assert!(table.is_locked(&KEY));
                if let Some(w) = &mut waiter {
                    assert!(
                        w.poll().is_none(),
                        "waiter granted while the renewed lease is live"
                    );
                    assert_eq!(table.waiters(&KEY), 1);
                    assert_eq!(timers(&clock), 1, "the head re-arms at the new deadline");
                }
                clock.advance(L2 - PAST - NANO);
                assert_eq!(
                    g.check(),
                    Ok(token),
                    "renewed guard lapsed before its deadline"
                );
                assert!(!g.is_expired());
                let wakes = waiter.as_ref().map(Polled::wakes);
                holder.authority.end(); // the next nanosecond lapses it
                clock.advance(NANO);
                if let Some(w) = &waiter {
                    assert_eq!(
                        Some(w.wakes()),
                        wakes.map(|n| n + 1),
                        "timer at the new deadline"
                    );
                }
                assert_eq!(g.check(), Err(LockError::Expired { token, key: None }));
                assert!(g.is_expired());
            }
            Err(e) => {
                seen.note("renewal refused: lapsed");
                assert_eq!(
                    e,
                    LockError::Expired { token, key: None },
                    "renew failed otherwise"
                );
                assert!(!saw_renewed);
                assert_eq!(
                    g.check(),
                    Err(LockError::Expired { token, key: None }),
                    "revived"
                );
                assert!(g.is_expired());
                assert_eq!(
                    g.expires_at(),
                    Some(t0 + L),
                    "a failed renewal changed expires_at"
                );
                clock.advance(L2);
                assert!(g.is_expired(), "revived by time");
            }
        }
        holder.authority.end();
        if let Some(mut w) = waiter {
            assert!(w.pending());
            let h = Holding::new(
                w.poll()
                    .expect("the lease lapsed: the waiter must be granted"),
                &inside,
            );
            assert!(h.token() > token, "token did not increase");
            drop(holder); // stale: must not free the waiter's grant
            assert_holds(&table, &h, "waiter after the lapsed guard's drop");
            drop(h);
        } else {
            drop(holder);
            assert!(!table.is_locked(&KEY));
        }
        assert_eq!(timers(&clock), 0, "a timer stayed armed");
        table.assert_consistent();
        assert_eq!(table.len(), 0, "entry leaked");
    }

    #[test]
    fn d_renew_vs_lapse() {
        model(
            "d: renew vs lapse",
            &["renewed", "renewal refused: lapsed"],
            |seen| renew_vs_lapse(seen, false, false),
        );
    }

    #[test]
    fn d2_renew_vs_lapse_with_waiter() {
        model(
            "d2: renew vs lapse, waiter queued",
            &["renewed", "renewal refused: lapsed"],
            |seen| renew_vs_lapse(seen, true, false),
        );
    }

    #[test]
    fn d3_renew_vs_lapse_with_waiter_shard_timers() {
        model(
            "d3: renew vs lapse, waiter queued, shard timers",
            &["renewed", "renewal refused: lapsed"],
            |seen| renew_vs_lapse(seen, true, true),
        );
    }

    // ---------------------------------------------------------------------------
    // (e) eventual fairness
    // ---------------------------------------------------------------------------

    /// A one-shard table under eventual fairness, judged by `clock`, with its
    /// fairness deadline running: a shard's first contended release hands the
    /// key to the head directly and starts the deadline, so the releases that
    /// follow, until the clock has moved `Fairness::EVENTUAL_BOUND`, free the key
    /// and nudge the head instead. Returns the guard of that first handoff,
    /// holding the key (counted in `inside`). Stats so far: 2 acquisitions, 1
    /// contended, 1 handoff.
    fn eventual_table(clock: &ManualClock, inside: &Arc<Inside>) -> (Arc<Table>, Holding) {
        let table = Arc::new(
            LockTable::<u32>::builder()
                .shards(1)
                .hasher(Hasher::default())
                .clock(clock.clone())
                .fairness(Fairness::Eventual)
                .build(),
        );
        let first = table.clone().try_lock_owned(KEY).unwrap();
        let mut w = Polled::new(table.clone().lock_owned(KEY));
        assert!(w.poll().is_none(), "the key is held: must queue");
        drop(first);
        let g = w
            .poll()
            .expect("a shard's first contended release hands the key over");
        assert_eq!(table.stats().handoffs, 1);
        (table, Holding::new(g, inside))
    }

    /// (e1) Eventual fairness: a release that frees the key and nudges the head
    /// vs a barging `try_lock` vs the head's own poll, each on its own thread.
    ///
    /// The key is held (the fairness deadline running) and one waiter heads the
    /// queue. Thread A drops the guard: the key is freed and the head nudged
    /// (its waker taken and woken). Thread B `try_lock`s, and if it gets the key,
    /// holds and releases it (freeing it again, nudging the head again). The
    /// main thread polls the head once: it takes the key if it is free, or
    /// re-registers its waker. Never two holders (`try_lock` barges only past a
    /// free key, never past a holder); a free key with a waiter always has its
    /// head nudged (`assert_consistent`); the head is served in the end, woken
    /// each time it has to be (no lost wake-up); no release hands off directly
    /// before the deadline.
    #[test]
    fn e1_eventual_release_vs_barging_try_lock_vs_head_poll() {
        model(
            "e1: eventual: release vs barging try_lock vs the head's poll",
            &[
                "barger took the free key",
                "barger refused",
                "head took the key in the race",
                "head took the key afterwards",
            ],
            |seen| {
                let clock = ManualClock::new();
                let inside = Inside::new();
                let (table, holder) = eventual_table(&clock, &inside);
                let mut head = Polled::new(table.clone().lock_owned(KEY));
                assert!(head.poll().is_none(), "the key is held: must queue");

                let a = thread::spawn(move || drop(holder));
                let b = {
                    let (table, inside) = (table.clone(), inside.clone());
                    thread::spawn(move || match table.try_lock_owned(KEY) {
                        Ok(g) => {
                            drop(Holding::new(g, &inside));
                            true
                        }
                        Err(_) => false,
                    })
                };
                let raced = head.poll().map(|g| drop(Holding::new(g, &inside)));
                a.join().unwrap();
                let barged = b.join().unwrap();
                table.assert_consistent();

                seen.note(if raced.is_some() {
                    "head took the key in the race"
                } else {
                    let g = finish(&mut head, "the nudged head");
                    drop(Holding::new(g, &inside));
                    "head took the key afterwards"
                });
                seen.note(if barged {
                    "barger took the free key"
                } else {
                    "barger refused"
                });
                let stats = table.stats();
                assert_eq!(stats.handoffs, 1, "handed off before the fairness deadline");
                assert_eq!(stats.contended, 2, "the head's take counts as contended");
                assert_eq!(stats.acquisitions, 3 + u64::from(barged));
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (e2) Eventual fairness: a release that frees the key and nudges the head
    /// vs a newcomer's `lock` (polled once).
    ///
    /// The newcomer takes the key if it is free (barging past the nudged head),
    /// or queues behind the head. Then, with no other thread left, the head and
    /// the newcomer are driven to completion, each polled only when woken: both
    /// are served, the head first unless the newcomer barged. Never two holders;
    /// a free key's head is nudged; no direct handoff before the deadline.
    #[test]
    fn e2_eventual_release_vs_newcomer_lock() {
        model(
            "e2: eventual: release vs a newcomer's lock",
            &["newcomer barged", "newcomer queued"],
            |seen| {
                let clock = ManualClock::new();
                let inside = Inside::new();
                let (table, holder) = eventual_table(&clock, &inside);
                let mut head = Polled::new(table.clone().lock_owned(KEY));
                assert!(head.poll().is_none(), "the key is held: must queue");

                let a = thread::spawn(move || drop(holder));
                let b = {
                    let (table, inside) = (table.clone(), inside.clone());
                    thread::spawn(move || {
                        let mut newcomer = Polled::new(table.lock_owned(KEY));
                        let barged = newcomer.poll().map(|g| drop(Holding::new(g, &inside)));
                        (barged.is_some(), newcomer)
                    })
                };
                a.join().unwrap();
                let (barged, mut newcomer) = b.join().unwrap();
                table.assert_consistent();

                let h = Holding::new(finish(&mut head, "the nudged head"), &inside);
                if !barged {
                    assert!(newcomer.pending());
                    assert!(
                        newcomer.poll().is_none(),
                        "the newcomer took the key from the head"
                    );
                }
                drop(h);
                if !barged {
                    let g = finish(&mut newcomer, "the newcomer behind the head");
                    drop(Holding::new(g, &inside));
                }
                seen.note(if barged {
                    "newcomer barged"
                } else {
                    "newcomer queued"
                });
                let stats = table.stats();
                assert_eq!(stats.handoffs, 1, "handed off before the fairness deadline");
                assert_eq!(stats.acquisitions, 4);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (e3) Eventual fairness: a first poll that queues and registers its waker
    /// without the lock vs a release that frees the key and nudges it.
    ///
    /// The key is held, nobody waits. Thread A drops the guard; thread B polls a
    /// new lock future once. If B has linked its waiter but not yet armed it, the
    /// nudge only flips the node's state `WAITING → NUDGED`, so that B's
    /// compare-and-swap fails and B polls again at once, taking the free key
    /// (counted as contended), instead of sleeping with nobody left to wake it.
    /// If B had armed, the nudge wakes it. No lost wake-up; never two holders;
    /// no direct handoff before the deadline.
    #[test]
    fn e3_eventual_first_poll_registration_vs_nudge() {
        model(
            "e3: eventual: first poll's lock-free registration vs nudge",
            &[
                "took the free key",
                "nudged while registering",
                "woken by the nudge",
            ],
            |seen| {
                let clock = ManualClock::new();
                let inside = Inside::new();
                let (table, holder) = eventual_table(&clock, &inside);

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

                let contended = table.stats().contended - 1;
                if ready {
                    assert_eq!(w.wakes(), 0, "completed on its first poll, yet woken");
                    seen.note(if contended == 0 {
                        "took the free key"
                    } else {
                        "nudged while registering"
                    });
                } else {
                    let g = finish(&mut w, "the queued first poll");
                    assert_eq!(w.wakes(), 1, "woken {} times", w.wakes());
                    drop(Holding::new(g, &inside));
                    seen.note("woken by the nudge");
                }
                let stats = table.stats();
                assert_eq!(stats.handoffs, 1, "handed off before the fairness deadline");
                assert_eq!(stats.acquisitions, 3);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (e4) Eventual fairness: the fairness deadline passing vs a release.
    ///
    /// The key is held and a waiter heads the queue. Thread A advances the clock
    /// by `Fairness::EVENTUAL_BOUND`; thread B drops the guard. A release that
    /// reads the clock before the advance frees the key and nudges the head; one
    /// after it hands the key to the head directly (and restarts the deadline).
    /// A release that started after seeing the advance done hands off. Either
    /// way the head is woken and served.
    #[test]
    fn e4_eventual_deadline_vs_release() {
        model(
            "e4: eventual: fairness deadline vs release",
            &["freed and nudged the head", "handed off: deadline passed"],
            |seen| {
                let clock = ManualClock::new();
                let inside = Inside::new();
                let (table, holder) = eventual_table(&clock, &inside);
                let mut head = Polled::new(table.clone().lock_owned(KEY));
                assert!(head.poll().is_none(), "the key is held: must queue");
                let advanced = Arc::new(AtomicBool::new(false));

                let a = {
                    let (clock, advanced) = (clock.clone(), advanced.clone());
                    thread::spawn(move || {
                        clock.advance(Fairness::EVENTUAL_BOUND);
                        advanced.store(true, SeqCst);
                    })
                };
                let b = thread::spawn(move || {
                    let saw_advanced = advanced.load(SeqCst);
                    drop(holder);
                    saw_advanced
                });
                a.join().unwrap();
                let saw_advanced = b.join().unwrap();
                table.assert_consistent();

                let handed_off = table.stats().handoffs == 2;
                if saw_advanced {
                    assert!(
                        handed_off,
                        "a release past the fairness deadline did not hand off"
                    );
                }
                let g = finish(&mut head, "the head");
                assert_eq!(head.wakes(), 1, "head woken {} times", head.wakes());
                drop(Holding::new(g, &inside));
                seen.note(if handed_off {
                    "handed off: deadline passed"
                } else {
                    "freed and nudged the head"
                });
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (e5) Eventual fairness: a release that frees the key and nudges the head
    /// vs the head's poll, then its drop, with a successor queued behind it.
    ///
    /// Thread A drops the guard (the key is freed, the head W1 nudged). Thread B
    /// polls W1 once (it takes the key if it is free, then holds and releases
    /// it) and otherwise drops it. A nudged head that is dropped must pass the
    /// nudge on to the new head W2, or the free key would wait for a poll that
    /// never comes. With no other thread left, W2 is woken and served. Never two
    /// holders; a free key's head is nudged; no direct handoff before the
    /// deadline.
    #[test]
    fn e5_eventual_release_vs_head_poll_then_drop() {
        model(
            "e5: eventual: release vs the head's poll / drop",
            &[
                "head served",
                "dropped the nudged head",
                "dropped the head, release not seen",
            ],
            |seen| {
                let clock = ManualClock::new();
                let inside = Inside::new();
                let (table, holder) = eventual_table(&clock, &inside);
                let mut w1 = Polled::new(table.clone().lock_owned(KEY));
                let mut w2 = Polled::new(table.clone().lock_owned(KEY));
                assert!(w1.poll().is_none(), "the key is held: must queue");
                assert!(w2.poll().is_none(), "the key is held: must queue");
                let released = Arc::new(AtomicBool::new(false));

                let a = {
                    let released = released.clone();
                    thread::spawn(move || {
                        drop(holder);
                        released.store(true, SeqCst);
                    })
                };
                let b = {
                    let inside = inside.clone();
                    thread::spawn(move || {
                        if let Some(g) = w1.poll() {
                            drop(Holding::new(g, &inside));
                            return "head served";
                        }
                        let saw_released = released.load(SeqCst);
                        drop(w1);
                        if saw_released {
                            "dropped the nudged head"
                        } else {
                            "dropped the head, release not seen"
                        }
                    })
                };
                a.join().unwrap();
                seen.note(b.join().unwrap());
                table.assert_consistent();

                let g = finish(&mut w2, "W2 (the nudge passed on)");
                drop(Holding::new(g, &inside));
                let stats = table.stats();
                assert_eq!(stats.handoffs, 1, "handed off before the fairness deadline");
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (l) loss notification
    // ---------------------------------------------------------------------------

    /// (l1) A `Lost` future's poll vs the lapse of its grant.
    ///
    /// The holder has lease `L`; its `Lost` was polled once (registered, its
    /// timer armed at the deadline). Thread 1 advances the clock by `L`; the
    /// main thread polls the `Lost` meanwhile, which reads the clock under the
    /// shard lock and re-registers its timer with the clock.
    ///
    /// - A poll that started after seeing the advance done resolves.
    /// - A `Lost` still pending afterwards was woken (its timer, or the settle
    ///   of the lapse: no lost wake-up) and resolves on its next poll, to
    ///   `Expired` with the holder's token; the lapse is counted once; no timer
    ///   is left armed.
    #[test]
    fn l1_loss_vs_lapse() {
        model(
            "l1: loss vs lapse",
            &["lost in the race", "lost when woken"],
            |seen| {
                const L: Duration = Duration::from_secs(2);
                let clock = ManualClock::new();
                let table = table(&clock);
                let guard = table.clone().try_lock_owned_with(KEY, lease(L)).unwrap();
                let token = guard.token();
                let mut lost = Polled::new(guard.lost());
                assert!(lost.poll().is_none(), "live: pending");
                assert_eq!(clock.sleepers(), 1, "a timer at the deadline");
                let advanced = Arc::new(AtomicBool::new(false));

                let t1 = {
                    let (clock, advanced) = (clock.clone(), advanced.clone());
                    thread::spawn(move || {
                        clock.advance(L);
                        advanced.store(true, SeqCst);
                    })
                };
                let saw_advanced = advanced.load(SeqCst);
                let raced = lost.poll();
                if saw_advanced {
                    assert!(raced.is_some(), "polled after the lapse, still pending");
                }
                t1.join().unwrap();

                let out = match raced {
                    Some(out) => {
                        seen.note("lost in the race");
                        out
                    }
                    None => {
                        seen.note("lost when woken");
                        finish(&mut lost, "the loss future after the lapse")
                    }
                };
                assert_eq!(out, LockError::Expired { token, key: None });
                assert!(guard.is_expired());
                assert_eq!(table.stats().expired, 1, "the lapse counted once");
                assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
                drop(lost);
                drop(guard);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (l2) A `Lost` future's first poll (its registration, which clones the
    /// waker outside the shard lock between two locked sections) vs
    /// `revoke_grant` of its grant.
    ///
    /// - `revoke_grant` names the live holder: it always revokes.
    /// - A poll that started after seeing the revocation done resolves; one
    ///   left pending was registered before the revocation, which woke it (no
    ///   lost wake-up), and it resolves on its next poll.
    /// - The revoked guard reports it at once: `is_expired()`, and
    ///   `expires_at()` not later than now.
    #[test]
    fn l2_loss_vs_revoke_grant() {
        model(
            "l2: loss vs revoke_grant",
            &["found it revoked", "woken by the revoke"],
            |seen| {
                let clock = ManualClock::new();
                let table = table(&clock);
                let guard = table.clone().try_lock_owned(KEY).unwrap();
                let token = guard.token();
                let mut lost = Polled::new(guard.lost());
                let revoked = Arc::new(AtomicBool::new(false));

                let t1 = {
                    let (table, revoked) = (table.clone(), revoked.clone());
                    thread::spawn(move || {
                        assert!(
                            table.revoke_grant(&KEY, token),
                            "the live holder is revoked"
                        );
                        revoked.store(true, SeqCst);
                    })
                };
                let saw_revoked = revoked.load(SeqCst);
                let raced = lost.poll();
                if saw_revoked {
                    assert!(raced.is_some(), "polled after the revoke, still pending");
                }
                t1.join().unwrap();

                let out = match raced {
                    Some(out) => {
                        seen.note("found it revoked");
                        out
                    }
                    None => {
                        seen.note("woken by the revoke");
                        finish(&mut lost, "the loss future after the revoke")
                    }
                };
                assert_eq!(out, LockError::Expired { token, key: None });
                assert!(guard.is_expired());
                assert!(guard.expires_at().unwrap() <= clock.now());
                assert_eq!(table.stats().revoked, 1);
                drop(lost);
                drop(guard);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (l3) The owner drops its `Lost` future and releases its guard vs a
    /// `revoke` of the key.
    ///
    /// - `revoke` returns the holder's token iff it came before the release
    ///   (there is no waiter), and wakes the `Lost` only if it came before the
    ///   `Lost` was dropped.
    /// - Whichever order: the registry keeps no handle of the waker (its wake
    ///   consumed it, or the drop removed it), the table ends empty and
    ///   consistent (the registry's own invariants included).
    #[test]
    fn l3_loss_dropped_and_release_vs_revoke() {
        model(
            "l3: loss dropped, release vs revoke",
            &[
                "revoked while watched",
                "revoked after the watcher left",
                "released before the revoke",
            ],
            |seen| {
                let clock = ManualClock::new();
                let table = table(&clock);
                let guard = table.clone().try_lock_owned(KEY).unwrap();
                let token = guard.token();
                let mut lost = Polled::new(guard.lost());
                assert!(lost.poll().is_none(), "live: pending");
                let counter = lost.counter.clone();

                let t1 = {
                    let table = table.clone();
                    thread::spawn(move || table.revoke(&KEY))
                };
                drop(lost);
                drop(guard);
                let revoked = t1.join().unwrap();

                let wakes = counter.wakes.load(SeqCst);
                match revoked {
                    Some(t) => {
                        assert_eq!(t, token, "revoked something else");
                        seen.note(if wakes == 1 {
                            "revoked while watched"
                        } else {
                            "revoked after the watcher left"
                        });
                    }
                    None => {
                        assert_eq!(wakes, 0, "woken without a revoke");
                        seen.note("released before the revoke");
                    }
                }
                assert!(wakes <= 1, "woken {wakes} times");
                assert_eq!(
                    Arc::strong_count(&counter),
                    1,
                    "the table kept a handle of the waker"
                );
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (l4) A keep-alive's renewal vs `revoke_grant` of its grant.
    ///
    /// The holder has lease `L`; its keep-alive (interval `L / 2`) is polled for
    /// the first time, which renews the lease and registers its `Lost`, while
    /// thread 1 revokes the grant by its token.
    ///
    /// - The revoke always succeeds: the grant is live until it comes, and a
    ///   renewal never revives a revoked grant.
    /// - The keep-alive resolves to `Expired` with the token: in the race (its
    ///   renewal was refused, or its `Lost` found the grant revoked), or, left
    ///   pending, it was woken by the revoke (no lost wake-up: the revocation is
    ///   noticed at once, not at the next renewal) and resolves when polled.
    #[test]
    fn l4_keep_alive_renewal_vs_revoke_grant() {
        model(
            "l4: keep-alive renewal vs revoke_grant",
            &["noticed in the race", "woken by the revoke"],
            |seen| {
                const L: Duration = Duration::from_secs(4);
                let clock = ManualClock::new();
                let table = table(&clock);
                let guard = table.clone().try_lock_owned_with(KEY, lease(L)).unwrap();
                let token = guard.token();
                let mut keep = Polled::new(guard.keep_alive(L / 2, L));

                let t1 = {
                    let table = table.clone();
                    thread::spawn(move || {
                        assert!(table.revoke_grant(&KEY, token), "the live grant is revoked");
                    })
                };
                let raced = keep.poll();
                t1.join().unwrap();

                let out = match raced {
                    Some(out) => {
                        seen.note("noticed in the race");
                        out
                    }
                    None => {
                        seen.note("woken by the revoke");
                        finish(&mut keep, "the keep-alive after the revoke")
                    }
                };
                assert_eq!(out, LockError::Expired { token, key: None });
                assert!(guard.is_expired(), "revived by a renewal");
                assert_eq!(table.stats().revoked, 1);
                drop(keep);
                assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
                drop(guard);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }
}
