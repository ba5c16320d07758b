//! Loom models of the races that involve time: a lease lapsing while its
//! holder releases, a timeout running out while the key is handed over, a
//! revocation racing a release or a lapse, and a renewal racing a lapse.
//!
//! Time is a [`ManualClock`]: under `--cfg loom` its internal mutex is loom's
//! (`src/loom.rs`), so `clock.advance()` on one loom thread races, at every
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
//! shared): one shard and a deterministic hasher; futures polled by hand with
//! a waker that counts its wakes in a loom atomic; an `Inside` counter that
//! must never exceed one. With leases and revocation a holder's authority can
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
#![cfg(all(loom, feature = "test-util"))]

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeSet;
use std::future::Future;
use std::hash::BuildHasherDefault;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex as StdMutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use keylock::{FencingToken, LockError, LockOptions, LockTable, ManualClock, OwnedGuard};
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

/// A future polled by hand with a counting waker.
struct Polled<F> {
    fut: Option<F>,
    counter: Arc<CountingWaker>,
    waker: Waker,
}

impl<F: Future + Unpin> Polled<F> {
    fn new(fut: F) -> Self {
        let counter = Arc::new(CountingWaker {
            wakes: AtomicUsize::new(0),
        });
        Self {
            fut: Some(fut),
            waker: Waker::from(counter.clone()),
            counter,
        }
    }

    /// Polls once; `Some` when the future completed (it is gone then).
    fn poll(&mut self) -> Option<F::Output> {
        let fut = self.fut.as_mut().expect("polled after completion");
        match Pin::new(fut).poll(&mut Context::from_waker(&self.waker)) {
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
///   released or lapsed, whichever came first hands it over. The waiter's
///   timer must have woken it (no lost wake-up).
/// - Never two grants with authority: `Inside`, plus thread 2's `check()`
///   fails if, before it started, thread 2 could already see the clock
///   advanced or the waiter granted.
/// - The stale guard's drop never frees the waiter's grant: after both
///   threads the waiter's guard still checks `Ok`, the key is locked and
///   `try_lock` fails.
/// - Tokens increase; no timer is left armed; the table is empty at the end.
///
/// With `waiter_lease = Some(L)` a grant made by the release *before* the
/// advance lapses, unobserved, with that same advance: the re-poll must then
/// void it (the slot is requeued and, being alone, re-granted with a newer
/// token), never return the lapsed grant.
fn lapse_vs_release(seen: &Seen, waiter_lease: Option<Duration>) {
    const L: Duration = Duration::from_secs(2);
    let clock = ManualClock::new();
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
    assert_eq!(clock.sleepers(), 1, "the head arms a timer at the deadline");
    let advanced = Arc::new(AtomicBool::new(false));
    let granted = Arc::new(AtomicBool::new(false));

    let t1 = {
        let (clock, inside) = (clock.clone(), inside.clone());
        let (advanced, granted) = (advanced.clone(), granted.clone());
        thread::spawn(move || {
            holder_auth.end(); // the lapse ends it, if the release has not
            clock.advance(L);
            advanced.store(true, SeqCst);
            assert!(
                waiter.wakes() >= 1,
                "the lapse did not wake the head waiter (its timer)"
            );
            let g = waiter
                .poll()
                .expect("the holder lapsed or released: the head must be granted")
                .expect("no timeout, valid lease: cannot fail");
            let h = Holding::new(g, &inside);
            granted.store(true, SeqCst);
            assert_eq!(h.guard().check(), Ok(h.token()), "fresh grant not live");
            h
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
    let h = t1.join().unwrap();
    let checked_ok = t2.join().unwrap();
    seen.note(if checked_ok {
        "holder checked Ok"
    } else {
        "holder checked Err"
    });

    assert!(h.token() > holder_token, "token did not increase");
    assert_holds(&table, &h, "waiter after the stale guard's drop");
    assert_eq!(table.waiters(&KEY), 0);
    assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
    // A lapse is counted when it is noticed: a holder that releases after
    // the advance but before anything judged its lease is not counted.
    let expired = table.stats().expired;
    assert!(expired <= 1, "expired {expired}");
    seen.note(if expired == 1 {
        "lapse counted"
    } else {
        "no lapse counted"
    });
    if waiter_lease.is_none() {
        // Whichever came first handed the key over, once.
        assert_eq!(h.token().get(), holder_token.get() + 1, "one grant only");
    } else if h.token().get() != holder_token.get() + 1 {
        // The release granted the waiter before the advance, which lapsed
        // that unobserved grant: it was voided and made again.
        assert_eq!(h.token().get(), holder_token.get() + 2, "one re-grant only");
        assert_eq!(expired, 1, "the voided grant was not counted as expired");
        seen.note("unobserved grant voided, re-granted");
    }
    drop(h);
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
        |seen| lapse_vs_release(seen, None),
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
            "unobserved grant voided, re-granted",
        ],
        |seen| lapse_vs_release(seen, Some(Duration::from_secs(2))),
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
fn timeout_vs_grant(seen: &Seen, holder_lease: Option<Duration>) {
    const T: Duration = Duration::from_secs(3);
    let clock = ManualClock::new();
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
    assert_eq!(clock.sleepers(), 1, "one timer: the timeout (or the lapse)");
    let released = Arc::new(AtomicBool::new(false));

    let t1 = {
        let (clock, inside, released) = (clock.clone(), inside.clone(), released.clone());
        thread::spawn(move || {
            if holder_lease.is_some() {
                holder_auth.end(); // the advance lapses it
            }
            clock.advance(T);
            assert!(waiter.wakes() >= 1, "the timer did not wake the waiter");
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
    assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
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
fn b_timeout_vs_grant() {
    model(
        "b: timeout vs grant",
        &["granted by the release", "timed out"],
        |seen| timeout_vs_grant(seen, None),
    );
}

#[test]
fn b2_timeout_vs_grant_lapse_at_the_same_instant() {
    model(
        "b2: timeout vs grant, lapse at the timeout",
        &["granted by the lapse", "granted by the release"],
        |seen| timeout_vs_grant(seen, Some(Duration::from_secs(3))),
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
/// - `revoke` returns `Some(holder's token)` iff it came before the release.
///   If the release came first the key had already been handed to the
///   waiter, and `revoke` displaces that unobserved grant instead: it returns
///   its token (newer than the holder's), and the waiter, alone in the queue,
///   is granted again with a newer one. It never returns `None` here: the key
///   always has a live holder.
/// - Cross-checks: thread 1 saw the release done before revoking ⇒ not the
///   holder's token; thread 2 saw the revocation done before its `check()` ⇒
///   the check fails and the holder's token was revoked; the holder's check
///   fails only if it was revoked (no lease).
/// - The waiter's poll after the revocation always completes: it is granted
///   exactly once, and its grant survives the revoked guard's later drop.
/// - Never two holders; table empty at the end.
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
                    let h = Holding::new(g, &inside);
                    assert!(h.token() > r, "token did not increase past the revoked one");
                    assert_eq!(h.guard().check(), Ok(h.token()), "fresh grant not live");
                    (r, h, waiter)
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
            let (r, h, waiter) = t1.join().unwrap();
            let holder_fenced = t2.join().unwrap();

            if holder_fenced {
                assert_eq!(r, holder_token, "the holder was fenced, so it was revoked");
            }
            seen.note(if holder_fenced {
                "holder checked Err"
            } else {
                "holder checked Ok"
            });
            if r == holder_token {
                seen.note("revoked the holder");
                // Revoked before the release: the waiter got the next token and
                // the release was stale.
                assert_eq!(h.token().get(), holder_token.get() + 1);
            } else {
                // Released first: the waiter's unobserved grant was revoked and
                // the waiter granted again.
                seen.note("revoked the waiter's unobserved grant");
                assert_eq!(r.get(), holder_token.get() + 1, "revoked an unknown grant");
                assert_eq!(h.token().get(), holder_token.get() + 2);
            }
            assert_holds(&table, &h, "waiter after the revoked guard's drop");
            assert_eq!(table.waiters(&KEY), 0);
            assert_eq!(table.stats().revoked, 1);
            assert!(!waiter.pending());
            assert!(
                waiter.wakes() >= 1,
                "the waiter was granted but never woken"
            );
            drop(h);
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
fn renew_vs_lapse(seen: &Seen, with_waiter: bool) {
    const L: Duration = Duration::from_secs(2);
    const L2: Duration = Duration::from_secs(5);
    const PAST: Duration = Duration::from_secs(3);
    let clock = ManualClock::new();
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
        assert_eq!(clock.sleepers(), 1);
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
                    Err(LockError::Expired { token }),
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
                assert_eq!(clock.sleepers(), 1, "the head re-arms at the new deadline");
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
            assert_eq!(g.check(), Err(LockError::Expired { token }));
            assert!(g.is_expired());
        }
        Err(e) => {
            seen.note("renewal refused: lapsed");
            assert_eq!(e, LockError::Expired { token }, "renew failed otherwise");
            assert!(!saw_renewed);
            assert_eq!(g.check(), Err(LockError::Expired { token }), "revived");
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
    assert_eq!(clock.sleepers(), 0, "a timer stayed armed");
    table.assert_consistent();
    assert_eq!(table.len(), 0, "entry leaked");
}

#[test]
fn d_renew_vs_lapse() {
    model(
        "d: renew vs lapse",
        &["renewed", "renewal refused: lapsed"],
        |seen| renew_vs_lapse(seen, false),
    );
}

#[test]
fn d2_renew_vs_lapse_with_waiter() {
    model(
        "d2: renew vs lapse, waiter queued",
        &["renewed", "renewal refused: lapsed"],
        |seen| renew_vs_lapse(seen, true),
    );
}
