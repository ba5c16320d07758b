//! Loom models of the races that modes add to a key's state machine: a shared
//! release racing an exclusive waiter's grant, an upgrade racing another
//! shared holder's release, an upgrade racing the revocation of the grant
//! it upgrades (unlinked and told, the writer behind it not held up), a
//! downgrade racing queued (and arriving) waiters
//! of both modes, and two shared holders upgrading at once.
//!
//! Run with (what `.ci/run` does, then again without `LOOM_MAX_PREEMPTIONS`):
//!
//! ```text
//! RUSTC_WRAPPER="$PWD/.ci/loom-rustc" LOOM_MAX_PREEMPTIONS=3 \
//!     CARGO_TARGET_DIR=target/loom cargo test --release --features test-util \
//!     --test loom_modes -- --nocapture
//! ```
//!
//! Same approach as `tests/loom.rs` (whose helpers are copied here, not
//! shared): one shard and a deterministic hasher; `!Unpin` lock futures
//! pinned in boxes and polled by hand with a waker that counts its wakes in a
//! loom atomic (once no other thread is left, a pending future must have been
//! woken since its last poll started: no lost wake-up), or driven on a loom
//! thread by a `block_on` that parks (a wake-up that never comes is a loom
//! deadlock). Mutual exclusion between modes is one loom atomic, [`Rw`]:
//! readers in its low bits, a writer as a high bit, changed by one
//! read-modify-write per step (enter, leave, upgrade, downgrade), so every
//! step sees every other in one order. A holder is counted from the moment
//! it has its grant until just before it releases (or just before it
//! downgrades). Each model checks that every outcome it expects was reached
//! by some interleaving, so that none of its branches is vacuous. No leases
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
    use std::hash::BuildHasherDefault;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
    use std::sync::{Arc, Mutex as StdMutex};
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Instant;

    use keylock::{FencingToken, LockError, LockTable, Mode, OwnedGuard};
    use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use loom::thread;

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

    /// `loom::future::block_on` needs loom's `futures` feature: the same thing
    /// on loom's park/unpark (as in `tests/loom.rs`). Returns the output and
    /// how many polls it took.
    fn block_on<F: Future>(fut: F) -> (F::Output, usize) {
        struct Unpark(thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.unpark();
            }
        }
        // Leaked if the model fails meanwhile: dropping it would touch loom
        // while unwinding, which aborts and hides the failure's message.
        let mut fut = std::mem::ManuallyDrop::new(Box::pin(fut));
        let waker = Waker::from(Arc::new(Unpark(thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut polls = 0;
        loop {
            polls += 1;
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                drop(std::mem::ManuallyDrop::into_inner(fut));
                return (out, polls);
            }
            thread::park();
        }
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

        fn pending(&self) -> bool {
            self.fut.is_some()
        }

        fn wakes(&self) -> usize {
            self.counter.wakes.load(SeqCst)
        }

        /// Whether the waker was woken since the last poll started.
        fn woken(&self) -> bool {
            self.wakes() > self.polled_at
        }
    }

    impl<F: Future> Drop for Polled<F> {
        fn drop(&mut self) {
            if std::thread::panicking() {
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

    /// The key's holders as they see themselves: readers in the low bits, a
    /// writer as `WRITER`; each step is one read-modify-write.
    struct Rw(AtomicUsize);

    const WRITER: usize = 1 << 16;

    impl Rw {
        fn new() -> Arc<Self> {
            Arc::new(Self(AtomicUsize::new(0)))
        }

        /// Enters in `mode`; returns the readers that were inside already.
        fn enter(&self, mode: Mode) -> usize {
            match mode {
                Mode::Shared => {
                    let before = self.0.fetch_add(1, SeqCst);
                    assert!(before < WRITER, "a reader beside a writer");
                    before
                }
                Mode::Exclusive => {
                    let before = self.0.fetch_add(WRITER, SeqCst);
                    assert_eq!(before, 0, "a writer beside another holder");
                    0
                }
            }
        }

        fn exit(&self, mode: Mode) {
            let before = match mode {
                Mode::Shared => self.0.fetch_sub(1, SeqCst),
                Mode::Exclusive => self.0.fetch_sub(WRITER, SeqCst),
            };
            match mode {
                Mode::Shared => assert!(before % WRITER >= 1, "reader count corrupted"),
                Mode::Exclusive => assert_eq!(before, WRITER, "writer count corrupted"),
            }
        }

        /// The only reader becomes the writer.
        fn upgraded(&self) {
            let before = self.0.fetch_add(WRITER - 1, SeqCst);
            assert_eq!(before, 1, "upgraded beside another holder");
        }

        /// The writer becomes a reader (before the downgrade admits others).
        fn downgrading(&self) {
            let before = self.0.fetch_sub(WRITER - 1, SeqCst);
            assert_eq!(before, WRITER, "downgrading while not the only writer");
        }

        fn is_free(&self) -> bool {
            self.0.load(SeqCst) == 0
        }
    }

    /// A guard counted in `Rw` for as long as it holds the key.
    struct Holding {
        guard: Option<Guard>,
        rw: Arc<Rw>,
        mode: Mode,
    }

    impl Holding {
        fn new(guard: Guard, rw: &Arc<Rw>) -> Self {
            let mode = guard.mode();
            rw.enter(mode);
            Self {
                guard: Some(guard),
                rw: rw.clone(),
                mode,
            }
        }

        fn guard(&mut self) -> &mut Guard {
            self.guard.as_mut().unwrap()
        }

        fn token(&self) -> FencingToken {
            self.guard.as_ref().unwrap().token()
        }

        /// Upgrades, waiting on this loom thread; accounts for the outcome.
        fn upgrade(&mut self) -> (Result<FencingToken, LockError>, usize) {
            let (out, polls) = block_on(self.guard().upgrade());
            if out.is_ok() {
                assert_eq!(self.guard().mode(), Mode::Exclusive);
                self.rw.upgraded();
                self.mode = Mode::Exclusive;
            } else {
                assert_eq!(self.guard().mode(), Mode::Shared);
            }
            (out, polls)
        }

        fn downgrade(&mut self) {
            self.rw.downgrading();
            self.mode = Mode::Shared;
            self.guard().downgrade().expect("a live grant downgrades");
        }
    }

    impl Drop for Holding {
        fn drop(&mut self) {
            if std::thread::panicking() {
                std::mem::forget(self.guard.take());
                return;
            }
            // Leave before releasing: once released a successor may enter.
            self.rw.exit(self.mode);
            drop(self.guard.take());
        }
    }

    // ---------------------------------------------------------------------------
    // (a) shared releases vs an exclusive waiter's grant
    // ---------------------------------------------------------------------------

    /// (a) Two shared holders release on two threads while the exclusive
    /// waiter queued behind them polls on a third (the main one).
    ///
    /// Whichever release is last grants the writer, once; its poll (or, when
    /// the grant came after, a wake) completes it. Until the writer has held
    /// and released the key, no shared request can be taken (`try_lock_shared`
    /// from a releasing thread fails: a writer waits). Never a writer beside a
    /// reader; the writer's token exceeds both readers'; no lost wake-up; the
    /// table is empty at the end.
    #[test]
    fn shared_releases_vs_exclusive_grant() {
        model(
            "a: shared releases vs exclusive grant",
            &["granted on the racing poll", "granted after the race"],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let s1 = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let s2 = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let top = s1.token().max(s2.token());
                let mut x = Polled::new(table.clone().lock_owned(KEY));
                assert!(x.poll().is_none(), "two readers hold: the writer queues");

                let releaser = |h: Holding| {
                    let table = table.clone();
                    thread::spawn(move || {
                        drop(h);
                        assert!(
                            table.clone().try_lock_shared_owned(KEY).is_err(),
                            "a reader barged past the queued writer"
                        );
                    })
                };
                let a = releaser(s1);
                let b = releaser(s2);
                let on_poll = x.poll();
                a.join().unwrap();
                b.join().unwrap();
                let g = match on_poll {
                    Some(g) => {
                        seen.note("granted on the racing poll");
                        g
                    }
                    None => {
                        seen.note("granted after the race");
                        finish(&mut x, "the writer")
                    }
                };
                assert!(x.wakes() <= 1, "writer woken {} times", x.wakes());
                assert!(g.token() > top, "exclusive token not above the readers'");
                let h = Holding::new(g, &rw);
                assert_eq!(h.mode, Mode::Exclusive);
                drop(h);
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (b) upgrade vs another shared holder's release
    // ---------------------------------------------------------------------------

    /// (b) A shared holder upgrades on one thread while the other shared
    /// holder releases on another; an exclusive waiter queued before the
    /// upgrade is polled on the main thread.
    ///
    /// The upgrade succeeds (at once if the release came first, else after
    /// it, woken by it), with a token above both readers'; it is served
    /// before the queued writer, which is granted only once the upgraded
    /// holder releases, with a greater token still. Never a writer beside
    /// anyone; no lost wake-up.
    #[test]
    fn upgrade_vs_shared_release() {
        model(
            "b: upgrade vs shared release",
            &["upgraded at once", "upgraded after waiting"],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let mut a = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let b = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let top = a.token().max(b.token());
                let mut x = Polled::new(table.clone().lock_owned(KEY));
                assert!(x.poll().is_none(), "readers hold: the writer queues");

                let up = thread::spawn(move || {
                    let (out, polls) = a.upgrade();
                    let t = out.expect("the only upgrader cannot fail");
                    assert!(t > top, "upgraded token not above the readers'");
                    assert_eq!(a.token(), t);
                    drop(a);
                    (t, polls)
                });
                let rel = thread::spawn(move || drop(b));
                // Counted at once: a writer served before the upgraded holder
                // left would meet it in `Rw`.
                let racing = x.poll().map(|g| Holding::new(g, &rw));
                rel.join().unwrap();
                let (t, polls) = up.join().unwrap();
                seen.note(if polls == 1 {
                    "upgraded at once"
                } else {
                    "upgraded after waiting"
                });
                let h = match racing {
                    Some(h) => h,
                    None => {
                        Holding::new(finish(&mut x, "the writer after the upgraded holder"), &rw)
                    }
                };
                assert!(h.token() > t, "the writer's token not above the upgrade's");
                drop(h);
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (b2) A shared holder polls an upgrade once and drops it on one thread
    /// while the other shared holder releases on another, which may grant the
    /// upgrade before, during or after that poll; an exclusive waiter queued
    /// before the upgrade waits on the main thread.
    ///
    /// Never exclusive without the caller knowing: after the dropped upgrade
    /// the guard is shared (with its old token if the cancel came first, with
    /// the upgrade's new, greater token if the grant came first and was
    /// undone), unless the poll itself saw the upgrade complete. Either way
    /// the guard's grant is live and the queued writer gets the key only once
    /// it is released, woken (no lost wake-up), with a greater token.
    #[test]
    fn dropped_upgrade_vs_shared_release() {
        model(
            "b2: dropped upgrade vs shared release",
            &[
                "upgrade cancelled before its grant",
                "upgrade granted unobserved, undone",
                "upgrade completed on its poll",
            ],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let mut a = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let b = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let old = a.token();
                let mut x = Polled::new(table.clone().lock_owned(KEY));
                assert!(x.poll().is_none(), "readers hold: the writer queues");

                let up = thread::spawn(move || {
                    let polled = {
                        let mut up = Polled::new(a.guard().upgrade());
                        up.poll()
                    }; // dropped here if still pending
                    let outcome = match polled {
                        Some(Ok(t)) => {
                            assert!(t > old);
                            a.rw.upgraded();
                            a.mode = Mode::Exclusive;
                            "upgrade completed on its poll"
                        }
                        Some(Err(e)) => panic!("unexpected upgrade error: {e}"),
                        None if a.token() == old => "upgrade cancelled before its grant",
                        None => {
                            assert!(a.token() > old, "a new token must be greater");
                            "upgrade granted unobserved, undone"
                        }
                    };
                    let expect = if outcome == "upgrade completed on its poll" {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    };
                    assert_eq!(a.guard().mode(), expect, "{outcome}");
                    assert_eq!(a.guard().check(), Ok(a.token()), "{outcome}: grant lost");
                    (a, outcome)
                });
                let rel = thread::spawn(move || drop(b));
                rel.join().unwrap();
                let (a, outcome) = up.join().unwrap();
                seen.note(outcome);
                assert!(
                    x.pending() && x.poll().is_none(),
                    "the writer was served while {outcome} still holds"
                );
                let ta = a.token();
                drop(a);
                let g = finish(&mut x, "the writer after the upgrader");
                assert!(g.token() > ta);
                drop(Holding::new(g, &rw));
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (b3) A shared holder's upgrade waits (another reader holds) on one
    /// thread, while another revokes the upgrading grant; a writer queued
    /// behind the upgrade waits on the main thread.
    ///
    /// The upgrade fails with its grant's loss (`Expired`, naming the old
    /// token), whether the revocation came before its first poll or while it
    /// waited: in the second case admission unlinks it and tells it, and it
    /// is woken (no lost wake-up). Either way the writer is not held up by
    /// it: once the other reader releases, it is granted, woken.
    #[test]
    fn upgrade_vs_revocation_of_its_grant() {
        model(
            "b3: upgrade vs revocation of its grant",
            &[
                "revoked before the upgrade linked",
                "revoked while it waited",
            ],
            |seen| {
                let table = table();
                let mut a = table.clone().try_lock_shared_owned(KEY).unwrap();
                let b = table.clone().try_lock_shared_owned(KEY).unwrap();
                let old = a.token();
                let mut x = Polled::new(table.clone().lock_owned(KEY));
                assert!(x.poll().is_none(), "readers hold: the writer queues");

                let up = thread::spawn(move || {
                    let (out, polls) = block_on(a.upgrade());
                    match out {
                        Err(LockError::Expired { token, .. }) => assert_eq!(token, old),
                        other => panic!("the revoked upgrade: {other:?}"),
                    }
                    (a, polls)
                });
                let revoker = table.clone();
                let rev = thread::spawn(move || {
                    assert!(revoker.revoke_grant(&KEY, old), "the grant was live");
                });
                rev.join().unwrap();
                let (a, polls) = up.join().unwrap();
                seen.note(if polls == 1 {
                    "revoked before the upgrade linked"
                } else {
                    "revoked while it waited"
                });
                assert!(
                    x.poll().is_none(),
                    "the writer was served beside the other reader"
                );
                drop(b);
                let g = finish(&mut x, "the writer after the reader");
                assert!(g.token() > old);
                drop(g);
                drop(a);
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (c) downgrade vs queued waiters
    // ---------------------------------------------------------------------------

    /// (c) The writer downgrades and later releases on one thread while the
    /// shared waiter and the exclusive waiter queued behind it (in that
    /// order) poll on two others.
    ///
    /// The downgrade admits the shared waiter (it is woken by the time the
    /// downgrade returns) and never the writer: the reader holds beside the
    /// downgraded holder or after it, the writer only once both are gone,
    /// with a token above both. No lost wake-up; empty at the end.
    #[test]
    fn downgrade_vs_queued_shared_and_exclusive() {
        model(
            "c: downgrade vs queued waiters",
            &["reader granted on its racing poll", "reader granted after"],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let mut x = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &rw);
                let tx = x.token();
                let mut s = Polled::new(table.clone().lock_shared_owned(KEY));
                let mut x2 = Polled::new(table.clone().lock_owned(KEY));
                assert!(s.poll().is_none());
                assert!(x2.poll().is_none());

                let down = {
                    let table = table.clone();
                    thread::spawn(move || {
                        x.downgrade();
                        // Only the writer is left in the queue: the reader at
                        // its head was admitted by the downgrade itself.
                        assert_eq!(
                            table.waiters(&KEY),
                            1,
                            "the downgrade did not admit the shared waiter at the head"
                        );
                        drop(x);
                    })
                };
                let reader = {
                    let rw = rw.clone();
                    thread::spawn(move || {
                        let g = s.poll().map(|g| Holding::new(g, &rw));
                        (s, g)
                    })
                };
                let writer = {
                    let rw = rw.clone();
                    thread::spawn(move || {
                        let g = x2.poll().map(|g| Holding::new(g, &rw));
                        (x2, g)
                    })
                };
                down.join().unwrap();
                let (mut s, sg) = reader.join().unwrap();
                let (mut x2, xg) = writer.join().unwrap();
                assert!(xg.is_none(), "the writer was granted while the reader held");
                assert!(s.wakes() <= 1, "reader woken {} times", s.wakes());
                let sg = match sg {
                    Some(h) => {
                        seen.note("reader granted on its racing poll");
                        h
                    }
                    None => {
                        seen.note("reader granted after");
                        Holding::new(finish(&mut s, "the admitted reader"), &rw)
                    }
                };
                assert!(sg.token() > tx);
                assert!(x2.pending());
                let ts = sg.token();
                drop(sg);
                let g = finish(&mut x2, "the writer after the readers");
                assert!(g.token() > ts);
                drop(Holding::new(g, &rw));
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    /// (c2) The writer downgrades (then releases) on one thread while a new
    /// shared request and a new exclusive request arrive on two others, each
    /// driven to completion there.
    ///
    /// Whatever the order: never a writer beside anyone, nobody left waiting
    /// (a lost wake-up is a loom deadlock), and an exclusive grant's token
    /// above every earlier grant's. The reader is granted before the writer
    /// in some interleavings and after it in others.
    #[test]
    fn downgrade_vs_arriving_shared_and_exclusive() {
        model(
            "c2: downgrade vs arriving waiters",
            &["reader before writer", "reader after writer"],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let mut x = Holding::new(table.clone().try_lock_owned(KEY).unwrap(), &rw);
                let tx = x.token();

                let down = thread::spawn(move || {
                    x.downgrade();
                    drop(x);
                });
                let reader = {
                    let (table, rw) = (table.clone(), rw.clone());
                    thread::spawn(move || {
                        let (g, _) = block_on(table.lock_shared_owned(KEY));
                        let h = Holding::new(g, &rw);
                        h.token()
                    })
                };
                let (g, _) = block_on(table.clone().lock_owned(KEY));
                let h = Holding::new(g, &rw);
                let tw = h.token();
                assert!(tw > tx);
                drop(h);
                down.join().unwrap();
                let tr = reader.join().unwrap();
                assert!(tr > tx);
                seen.note(if tr < tw {
                    "reader before writer"
                } else {
                    "reader after writer"
                });
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }

    // ---------------------------------------------------------------------------
    // (d) two upgrades at once
    // ---------------------------------------------------------------------------

    /// (d) Two shared holders upgrade at once, each on its own thread; an
    /// exclusive waiter is queued behind them.
    ///
    /// Exactly one upgrade succeeds and the other gets `UpgradeConflict` (at
    /// once: one poll) naming the first; never both waiting (that would be a
    /// loom deadlock: each thread waits for the other's shared grant). The
    /// loser releases, the winner holds alone, then the queued writer gets
    /// the key with a greater token.
    #[test]
    fn two_upgrades_at_once() {
        model(
            "d: two upgrades at once",
            &["first upgrader won", "second upgrader won"],
            |seen| {
                let table = table();
                let rw = Rw::new();
                let a = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let b = Holding::new(table.clone().try_lock_shared_owned(KEY).unwrap(), &rw);
                let (ta, tb) = (a.token(), b.token());
                let mut x = Polled::new(table.clone().lock_owned(KEY));
                assert!(x.poll().is_none());

                let upgrader = |mut h: Holding, other: FencingToken| {
                    thread::spawn(move || {
                        let mine = h.token();
                        let (out, polls) = h.upgrade();
                        match out {
                            Ok(t) => {
                                drop(h);
                                Ok(t)
                            }
                            Err(LockError::UpgradeConflict {
                                token,
                                upgrading,
                                key: None,
                            }) => {
                                assert_eq!(polls, 1, "a conflict is reported at once");
                                assert_eq!((token, upgrading), (mine, other));
                                drop(h);
                                Err(())
                            }
                            Err(e) => panic!("unexpected upgrade error: {e}"),
                        }
                    })
                };
                let ja = upgrader(a, tb);
                let jb = upgrader(b, ta);
                let (ra, rb) = (ja.join().unwrap(), jb.join().unwrap());
                let t = match (ra, rb) {
                    (Ok(t), Err(())) => {
                        seen.note("first upgrader won");
                        t
                    }
                    (Err(()), Ok(t)) => {
                        seen.note("second upgrader won");
                        t
                    }
                    other => panic!("exactly one upgrade must succeed: {other:?}"),
                };
                assert!(t > ta && t > tb);
                let g = finish(&mut x, "the writer after the upgraded holder");
                assert!(g.token() > t);
                drop(Holding::new(g, &rw));
                assert!(rw.is_free());
                table.assert_consistent();
                assert_eq!(table.len(), 0, "entry leaked");
            },
        );
    }
}
