//! Loom models of the per-key state machine: loom runs each model under every
//! interleaving of its threads (bounded by `LOOM_MAX_PREEMPTIONS`) at every
//! shard-lock acquisition and every loom atomic access, so the release,
//! hand-off, poll, cancel and try-lock paths race in all their orders.
//!
//! Run with (what `.ci/run` does, then again without `LOOM_MAX_PREEMPTIONS`,
//! which explores every interleaving; each model takes well under a second
//! either way):
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
//! Under `--cfg loom` the shard locks are loom's (`src/loom.rs`). Shared
//! state outside them stays `std` and is not modeled: the per-shard
//! statistics (counters only, written under the shard lock) and a guard's
//! cached lease deadline. The models use no leases or timeouts: those wait on
//! async-io timers, which do not run under loom.
//!
//! Every model uses one shard and a deterministic hasher, so the state is
//! small and every loom replay sees the same hashes. Futures are polled by
//! hand with a waker that counts its wakes in a loom atomic, so the models can
//! assert "woken exactly once" and "never woken". "Never two holders" is a
//! loom atomic counter that every holder raises while it holds the key (from
//! the moment it acquires until just before it releases) and that must never
//! exceed one.
#![cfg(loom)]

use std::collections::hash_map::DefaultHasher;
use std::future::Future;
use std::hash::BuildHasherDefault;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
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
    let mut fut = std::pin::pin!(fut);
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
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

/// Runs one model with the loom settings from the environment and prints how
/// many interleavings it explored and how long that took.
fn model<F>(name: &str, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let iterations = Arc::new(StdAtomicUsize::new(0));
    let start = Instant::now();
    let counter = iterations.clone();
    loom::model(move || {
        counter.fetch_add(1, Relaxed);
        f();
    });
    eprintln!(
        "loom model {name}: {} interleavings in {:.2?} (LOOM_MAX_PREEMPTIONS={})",
        iterations.load(Relaxed),
        start.elapsed(),
        std::env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "unbounded".into()),
    );
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

/// A future polled by hand with a counting waker.
struct Polled<F> {
    fut: Option<F>,
    counter: Arc<CountingWaker>,
    waker: Waker,
}

impl<F: Future + Unpin> Polled<F> {
    fn new(fut: F) -> Self {
        let counter = CountingWaker::new();
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

    /// Whether the future is still pending (not completed, not dropped).
    fn pending(&self) -> bool {
        self.fut.is_some()
    }

    /// Wakes of the current waker.
    fn wakes(&self) -> usize {
        self.counter.wakes()
    }

    /// Switches to a fresh waker for the next polls (as a task that moved to
    /// another executor would); returns the old one's counter.
    fn switch_waker(&mut self) -> Arc<CountingWaker> {
        let fresh = CountingWaker::new();
        self.waker = Waker::from(fresh.clone());
        std::mem::replace(&mut self.counter, fresh)
    }

    /// Drops the future, cancelling it if it is still waiting.
    fn cancel(&mut self) {
        self.fut = None;
    }
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
/// and the key lockable again; the waiter is woken at most once.
#[test]
fn release_vs_cancel_of_granted_waiter() {
    model("a: release vs cancel", || {
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
        drop(Holding::new(
            table.clone().try_lock_owned(KEY).expect("key must be free"),
            &inside,
        ));
        assert_eq!(table.len(), 0);
    });
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
    model("a2: release vs cancel, successor polls", || {
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
    model("b: two waiters + release", || {
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
    model("c: lock vs lock", || {
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
        assert_eq!(table.len(), 0, "entry leaked");
    });
}

/// (c2) Lock vs lock with real blocking: two threads each `block_on` the lock,
/// hold, and release. A lost wake-up leaves a thread parked forever, which
/// loom reports as a deadlock.
#[test]
fn lock_vs_lock_block_on() {
    model("c2: lock vs lock, block_on", || {
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
    model("d: release vs cancel vs try_lock", || {
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
    model("d2: release vs cancel vs newcomer lock", || {
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
    model("e: release vs re-poll with a new waker", || {
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
    model("f: 2 blocking lockers + 1 abandoned future", || {
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
        assert_eq!(table.len(), 0, "entry leaked");
    });
}
