//! Two threads run random operations on one shared `LockTable`, and check the
//! invariants that survive concurrency:
//!
//! - mutual exclusion: without leases or revocation, a per-key "inside"
//!   counter never exceeds one, and every `check()` passes;
//! - with leases and revocation: a grant never passes `check()` (or renew, or
//!   is revoked as live by `revoke` or `revoke_grant`, or is handed out live)
//!   once a later grant of the same key has been seen live — authority never
//!   goes backwards; `revoke_grant` revokes only a grant of the key it names,
//!   whose guard then reports `is_expired()` and an `expires_at()` not later
//!   than the call;
//! - fencing tokens strictly increase per key as seen by each thread, except
//!   for a future granted the key whose grant lapsed or was revoked before it
//!   ran: it resolves to that older grant, which must fail `check()`;
//! - no lost wakeup: at the end each thread releases everything and then
//!   polls its remaining futures *only when woken*; they must all complete;
//! - no panics; with everything dropped `len() == 0`, no timer is left armed,
//!   the counters the threads can tally exactly (cancelled, timed_out,
//!   revoked) match `stats()`, and `acquisitions`, `contended` and
//!   `handoffs` lie within the bounds the threads' tallies allow (a grant is
//!   counted when it is made, even if its future is dropped before it runs).
//!
//! The table is strict FIFO or, by a flag of the input, `Fairness::Eventual`
//! (a release may free the key for a running caller to take first).
//!
//! With modes (a flag, honoured without leases): locks may be shared, and
//! guards upgrade and downgrade. The "inside" counter then counts readers
//! and writers of the key: never a writer with anyone else; tokens and
//! authority are judged against the exclusive grants seen live (an older
//! shared grant stays live beside a newer one).

#![no_main]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use keylock::futures::LockWith;
use keylock::{Fairness, Guard, LockError, LockOptions, LockTable, ManualClock, Mode};
use libfuzzer_sys::fuzz_target;

const KEYS: usize = 4;
const MAX_OPS: usize = 128;
const MAX_FUTS: usize = 6;
const MAX_GUARDS: usize = 3;
/// How long the final drain may go without any progress before it is
/// declared stuck (a lost wakeup).
const STUCK_AFTER: Duration = Duration::from_secs(10);

#[derive(Arbitrary, Debug)]
struct Input {
    /// A real (monotonic) clock instead of a shared `ManualClock`.
    real_clock: bool,
    /// Bit 0: allow leases, renewals and revocation (else mutual exclusion
    /// is exact). Bit 1: `Fairness::Eventual`. Bit 2: a manual clock with
    /// shard timers (`ManualClock::with_shard_timers`), as the real clock
    /// has, instead of per-waiter timers. Bit 3 (honoured only without
    /// leases): modes — bit 2 of a `TryLock` or `Start` key asks for a
    /// shared lock, and `Advance { by }` with `by >> 2 != 0` upgrades (odd)
    /// or downgrades (even) guard `by >> 3` (modulo) instead.
    flags: u8,
    /// 1 or 4 shards.
    one_shard: bool,
    a: Vec<TOp>,
    b: Vec<TOp>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum TOp {
    TryLock {
        key: u8,
        lease: Option<u8>,
    },
    /// `lock_with` and poll once.
    Start {
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
    },
    Poll {
        fut: u8,
    },
    PollWoken,
    DropFuture {
        fut: u8,
    },
    Release {
        guard: u8,
    },
    Renew {
        guard: u8,
        lease: u8,
    },
    Check {
        guard: u8,
    },
    /// A short critical section with the guard.
    Work {
        guard: u8,
    },
    Revoke {
        key: u8,
    },
    /// Advance the manual clock, or spin a little on the real one.
    Advance {
        by: u8,
    },
    Yield,
}

struct Counter(AtomicU64);
impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// One writer inside a key, in `Shared::inside` (a reader counts one).
const WRITER: i64 = 1 << 20;

struct Shared {
    clock: Option<ManualClock>,
    leases: bool,
    /// Shared locks, upgrades and downgrades (only without leases).
    modes: bool,
    /// Threads inside a critical section of the key (exact only without
    /// leases): `WRITER` per exclusive holder, one per shared one.
    inside: [AtomicI64; KEYS],
    /// The largest token of the key ever observed live (of an exclusive
    /// grant: every grant live later is at least that).
    max_live: [AtomicU64; KEYS],
}

impl Shared {
    /// One time unit: a millisecond on the manual clock, 20 µs on the real one.
    fn unit(&self) -> Duration {
        if self.clock.is_some() {
            Duration::from_millis(1)
        } else {
            Duration::from_micros(20)
        }
    }

    fn lease(&self, x: u8) -> Duration {
        if x >= 248 && self.clock.is_none() {
            // Long enough for the real clock's coarse lease start.
            return Duration::from_secs(1) + self.unit() * u32::from(x - 248);
        }
        self.unit() * (u32::from(x % 8) + 1)
    }

    /// The time the table judges by.
    fn now(&self) -> Instant {
        match &self.clock {
            Some(clock) => clock.now(),
            None => Instant::now(),
        }
    }

    fn observed_live(&self, what: &str, k: usize, token: u64, before: u64) {
        self.observed_live_in(what, k, token, before, Mode::Exclusive);
    }

    /// A grant in `mode` seen live: not older than an exclusive grant seen
    /// live before; an exclusive one raises the bar.
    fn observed_live_in(&self, what: &str, k: usize, token: u64, before: u64, mode: Mode) {
        assert!(
            token >= before,
            "{what}: grant {token} of key {k} is live after grant {before} was seen live"
        );
        if mode == Mode::Exclusive {
            self.max_live[k].fetch_max(token, SeqCst);
        }
    }

    /// Enters key `k`'s critical section in `mode`: no writer with anyone.
    fn enter(&self, what: &str, k: usize, mode: Mode) {
        if self.leases {
            return;
        }
        match mode {
            Mode::Exclusive => {
                let was = self.inside[k].fetch_add(WRITER, SeqCst);
                assert_eq!(was, 0, "{what}: a writer of key {k} with others ({was:#x})");
            }
            Mode::Shared => {
                let was = self.inside[k].fetch_add(1, SeqCst);
                assert!(
                    was < WRITER,
                    "{what}: a reader of key {k} with a writer ({was:#x})"
                );
            }
        }
    }

    fn leave(&self, k: usize, mode: Mode) {
        if self.leases {
            return;
        }
        let by = if mode == Mode::Exclusive { WRITER } else { 1 };
        let was = self.inside[k].fetch_sub(by, SeqCst);
        assert!(was >= by, "inside counter of key {k} on release ({was:#x})");
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    /// Guards obtained (`try_lock`, or a future that resolved to one).
    acquisitions: u64,
    /// Futures that returned `Pending` and then a guard: contended for sure.
    contended: u64,
    /// Futures that returned a guard on their first poll. They may have been
    /// contended too: a first poll that queues can find the holder's lease
    /// already lapsed when it arms its timer, and judge again at once.
    first_poll_ok: u64,
    cancelled: u64,
    timed_out: u64,
    revoked: u64,
    /// Upgrades dropped pending (cancelled, unless granted meanwhile).
    upgrades_dropped: u64,
}

impl Tally {
    fn plus(self, o: Self) -> Self {
        Self {
            acquisitions: self.acquisitions + o.acquisitions,
            contended: self.contended + o.contended,
            first_poll_ok: self.first_poll_ok + o.first_poll_ok,
            cancelled: self.cancelled + o.cancelled,
            timed_out: self.timed_out + o.timed_out,
            revoked: self.revoked + o.revoked,
            upgrades_dropped: self.upgrades_dropped + o.upgrades_dropped,
        }
    }
}

struct TFut<'a> {
    key: usize,
    fut: Pin<Box<LockWith<'a, u8>>>,
    counter: Arc<Counter>,
    waker: Waker,
    seen: u64,
    pended: bool,
    /// `max_live` of its key before it was first polled.
    before: u64,
}

struct Worker<'a> {
    table: &'a LockTable<u8>,
    shared: &'a Shared,
    futs: Vec<TFut<'a>>,
    guards: Vec<(usize, Guard<'a, u8>)>,
    last_token: [u64; KEYS],
    tally: Tally,
}

impl<'a> Worker<'a> {
    fn got(&mut self, what: &str, k: usize, g: Guard<'a, u8>, before: u64) {
        let t = g.token().get();
        let mode = g.mode();
        assert_eq!(usize::from(*g.key()), k);
        assert!(
            t > before,
            "{what}: new grant {t} of key {k} not above {before}, seen live before"
        );
        if t > self.last_token[k] {
            self.shared.observed_live_in(what, k, t, before, mode);
            self.last_token[k] = t;
        } else if mode == Mode::Shared && self.shared.modes {
            // A shared grant made before one this thread has seen since
            // (granted to a future that had not run): both are live.
            self.shared.observed_live_in(what, k, t, before, mode);
        } else {
            // A future granted the key whose grant lapsed or was revoked
            // before it ran resolves to that (fenced) grant: older than one
            // this thread has seen since, and never live again.
            assert!(
                self.shared.leases,
                "{what}: token of key {k} went from {} to {t} in one thread",
                self.last_token[k]
            );
            assert!(
                g.check().is_err(),
                "{what}: grant {t} of key {k} is live after grant {} was seen in this thread",
                self.last_token[k]
            );
        }
        self.shared.enter(what, k, mode);
        self.tally.acquisitions += 1;
        self.guards.push((k, g));
    }

    fn release(&mut self, i: usize) {
        let (k, g) = self.guards.remove(i);
        self.shared.leave(k, g.mode());
        drop(g);
    }

    fn check(&mut self, i: usize) {
        let (k, g) = &self.guards[i];
        let before = self.shared.max_live[*k].load(SeqCst);
        match g.check() {
            Ok(t) => {
                assert_eq!(t, g.token());
                self.shared
                    .observed_live_in("check", *k, t.get(), before, g.mode());
            }
            Err(LockError::Expired { token, key: None }) => {
                assert_eq!(token, g.token());
                assert!(
                    self.shared.leases,
                    "check() failed without leases or revoke"
                );
            }
            Err(e) => panic!("check(): {e:?}"),
        }
    }

    /// Polls future `i`; true if it completed.
    fn poll(&mut self, i: usize) -> bool {
        let f = &mut self.futs[i];
        let k = f.key;
        f.seen = f.counter.0.load(SeqCst);
        if !f.pended {
            f.before = self.shared.max_live[k].load(SeqCst);
        }
        let mut cx = Context::from_waker(&f.waker);
        let r = match f.fut.as_mut().poll(&mut cx) {
            Poll::Pending => {
                f.pended = true;
                return false;
            }
            Poll::Ready(r) => r,
        };
        let f = self.futs.remove(i);
        match r {
            Ok(g) => {
                if f.pended {
                    self.tally.contended += 1;
                } else {
                    self.tally.first_poll_ok += 1;
                }
                self.got("lock", k, g, f.before);
            }
            Err(LockError::Timeout { .. }) => self.tally.timed_out += 1,
            Err(e) => panic!("lock_with: {e:?}"),
        }
        true
    }

    fn drop_fut(&mut self, i: usize) {
        let f = self.futs.remove(i);
        if f.pended {
            self.tally.cancelled += 1;
        }
    }

    fn step(&mut self, op: TOp) {
        let sh = self.shared;
        match op {
            TOp::TryLock { key, lease } => {
                if self.guards.len() >= MAX_GUARDS {
                    return;
                }
                let k = usize::from(key) % KEYS;
                let before = sh.max_live[k].load(SeqCst);
                let shared = sh.modes && key & 4 != 0;
                let r = match lease.filter(|_| sh.leases) {
                    Some(l) => self
                        .table
                        .try_lock_with(k as u8, LockOptions::new().lease(sh.lease(l))),
                    None if shared => self.table.try_lock_shared(k as u8).map_err(LockError::from),
                    None => self.table.try_lock(k as u8).map_err(LockError::from),
                };
                match r {
                    Ok(g) => self.got("try_lock", k, g, before),
                    Err(LockError::WouldBlock { key: None }) => {}
                    Err(e) => panic!("try_lock: {e:?}"),
                }
            }
            TOp::Start {
                key,
                lease,
                timeout,
            } => {
                if self.futs.len() >= MAX_FUTS {
                    return;
                }
                let k = usize::from(key) % KEYS;
                let mut opts = LockOptions::new();
                if sh.modes && key & 4 != 0 {
                    opts = opts.shared();
                }
                if let Some(l) = lease.filter(|_| sh.leases) {
                    opts = opts.lease(sh.lease(l));
                }
                if let Some(t) = timeout {
                    opts = opts.timeout(sh.unit() * u32::from(t % 12));
                }
                let counter = Arc::new(Counter(AtomicU64::new(0)));
                self.futs.push(TFut {
                    key: k,
                    fut: Box::pin(self.table.lock_with(k as u8, opts)),
                    waker: Waker::from(Arc::clone(&counter)),
                    counter,
                    seen: 0,
                    pended: false,
                    before: 0,
                });
                self.poll(self.futs.len() - 1);
            }
            TOp::Poll { fut } => {
                if !self.futs.is_empty() {
                    self.poll(usize::from(fut) % self.futs.len());
                }
            }
            TOp::PollWoken => {
                let mut i = 0;
                while i < self.futs.len() {
                    let f = &self.futs[i];
                    if f.counter.0.load(SeqCst) > f.seen && self.poll(i) {
                        continue;
                    }
                    i += 1;
                }
            }
            TOp::DropFuture { fut } => {
                if !self.futs.is_empty() {
                    self.drop_fut(usize::from(fut) % self.futs.len());
                }
            }
            TOp::Release { guard } => {
                if !self.guards.is_empty() {
                    self.release(usize::from(guard) % self.guards.len());
                }
            }
            TOp::Renew { guard, lease } => {
                if sh.leases && !self.guards.is_empty() {
                    let i = usize::from(guard) % self.guards.len();
                    let (k, g) = &self.guards[i];
                    let before = sh.max_live[*k].load(SeqCst);
                    match g.renew(sh.lease(lease)) {
                        Ok(()) => sh.observed_live("renew", *k, g.token().get(), before),
                        Err(LockError::Expired { token, key: None }) => assert_eq!(token, g.token()),
                        Err(e) => panic!("renew: {e:?}"),
                    }
                }
            }
            TOp::Check { guard } => {
                if !self.guards.is_empty() {
                    self.check(usize::from(guard) % self.guards.len());
                }
            }
            TOp::Work { guard } => {
                if !self.guards.is_empty() {
                    let i = usize::from(guard) % self.guards.len();
                    let k = self.guards[i].0;
                    let mode = self.guards[i].1.mode();
                    for _ in 0..3 {
                        if !sh.leases {
                            let n = sh.inside[k].load(SeqCst);
                            match mode {
                                Mode::Exclusive => assert_eq!(n, WRITER, "exclusion of key {k}"),
                                Mode::Shared => assert!(
                                    (1..WRITER).contains(&n),
                                    "a reader of key {k} with a writer ({n:#x})"
                                ),
                            }
                        }
                        std::thread::yield_now();
                    }
                    self.check(i);
                }
            }
            TOp::Revoke { key } if key & 0x80 != 0 => {
                // `revoke_grant` of one of this thread's guards, named by
                // `key`'s bits 2..7, on `key % KEYS` (maybe another key:
                // tokens are unique across the table, so that one fails).
                if sh.leases && !self.guards.is_empty() {
                    let k = usize::from(key) % KEYS;
                    let i = usize::from(key >> 2) % self.guards.len();
                    let (gk, g) = &self.guards[i];
                    let before = sh.max_live[*gk].load(SeqCst);
                    if self.table.revoke_grant(&(k as u8), g.token()) {
                        assert_eq!(k, *gk, "revoke_grant revoked a grant of another key");
                        sh.observed_live("revoke_grant", k, g.token().get(), before);
                        self.tally.revoked += 1;
                        // The revoked guard tells the truth at once.
                        assert!(g.is_expired(), "a revoked grant is not expired");
                        let at = g.expires_at().expect("a revoked grant has ended");
                        let now = sh.now();
                        assert!(at <= now, "a revoked grant expires after the call");
                    }
                }
            }
            TOp::Revoke { key } => {
                if sh.leases {
                    let k = usize::from(key) % KEYS;
                    let before = sh.max_live[k].load(SeqCst);
                    if let Some(t) = self.table.revoke(&(k as u8)) {
                        sh.observed_live("revoke", k, t.get(), before);
                        self.tally.revoked += 1;
                    }
                }
            }
            TOp::Advance { by } if sh.modes && by >> 2 != 0 => {
                if !self.guards.is_empty() {
                    let i = usize::from(by >> 3) % self.guards.len();
                    if by & 4 != 0 {
                        self.upgrade(i);
                    } else {
                        self.downgrade(i);
                    }
                }
            }
            TOp::Advance { by } => match &sh.clock {
                Some(clock) => clock.advance(sh.unit() * u32::from(by % 4)),
                None => {
                    let until = Instant::now() + sh.unit() * u32::from(by % 4);
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                }
            },
            TOp::Yield => {
                std::thread::yield_now();
                self.table.assert_consistent();
            }
        }
    }

    /// Upgrades guard `i`: polled a few times (the other thread may hold the
    /// key shared), then dropped if still pending (its guard stays shared).
    fn upgrade(&mut self, i: usize) {
        let sh = self.shared;
        let (k, g) = &mut self.guards[i];
        let k = *k;
        let was = g.mode();
        let before = sh.max_live[k].load(SeqCst);
        let old = g.token();
        let counter = Arc::new(Counter(AtomicU64::new(0)));
        let waker = Waker::from(Arc::clone(&counter));
        let mut cx = Context::from_waker(&waker);
        let mut up = Box::pin(g.upgrade());
        let mut out = None;
        for _ in 0..20 {
            if let Poll::Ready(r) = up.as_mut().poll(&mut cx) {
                out = Some(r);
                break;
            }
            std::thread::yield_now();
        }
        let pended = out.is_none();
        drop(up);
        match out {
            Some(Ok(t)) => {
                assert_eq!(g.mode(), Mode::Exclusive);
                assert_eq!(g.token(), t);
                if was == Mode::Exclusive {
                    assert_eq!(t, old, "an exclusive guard's upgrade changes nothing");
                } else {
                    assert!(
                        t > old && t.get() > before,
                        "upgrade: token {t} not above {before}"
                    );
                    // Exclusive now: nobody else may be inside.
                    let was = sh.inside[k].fetch_add(WRITER - 1, SeqCst);
                    assert_eq!(was, 1, "upgrade of key {k}: others inside ({was:#x})");
                    sh.observed_live("upgrade", k, t.get(), before);
                }
            }
            Some(Err(LockError::UpgradeConflict { token, .. })) => {
                assert_eq!(token, old);
                assert_eq!(g.mode(), Mode::Shared);
            }
            Some(Err(e)) => panic!("upgrade: {e:?}"),
            None => {
                // Dropped pending: shared again (maybe under the token of
                // a grant made meanwhile, never exclusive unseen).
                assert_eq!(g.mode(), Mode::Shared);
                assert!(g.token() >= old);
                self.tally.upgrades_dropped += u64::from(pended);
            }
        }
    }

    /// Downgrades guard `i` (an exclusive one counts itself a reader first:
    /// the readers it admits may enter before the call returns).
    fn downgrade(&mut self, i: usize) {
        let (k, g) = &mut self.guards[i];
        let exclusive = g.mode() == Mode::Exclusive;
        if exclusive && !self.shared.leases {
            self.shared.inside[*k].fetch_sub(WRITER - 1, SeqCst);
        }
        let token = g.token();
        g.downgrade().expect("downgrade without leases or revoke");
        assert_eq!(g.mode(), Mode::Shared);
        assert_eq!(g.token(), token, "downgrade keeps the token");
    }

    /// Releases every guard, then completes every future, polling each only
    /// when it was woken.
    fn drain(&mut self, barrier: &Barrier) {
        while !self.guards.is_empty() {
            self.release(self.guards.len() - 1);
        }
        barrier.wait();
        let mut last_progress = Instant::now();
        while !self.futs.is_empty() {
            let mut progressed = false;
            let mut i = 0;
            while i < self.futs.len() {
                let f = &self.futs[i];
                if f.counter.0.load(SeqCst) > f.seen {
                    progressed = true;
                    if self.poll(i) {
                        // Hand the key straight on.
                        while !self.guards.is_empty() {
                            self.release(self.guards.len() - 1);
                        }
                        continue;
                    }
                }
                i += 1;
            }
            if progressed {
                last_progress = Instant::now();
            } else {
                assert!(
                    last_progress.elapsed() < STUCK_AFTER,
                    "lost wakeup: {} future(s) never woken: keys {:?}",
                    self.futs.len(),
                    self.futs.iter().map(|f| f.key).collect::<Vec<_>>()
                );
                std::thread::yield_now();
            }
        }
    }
}

fn work(table: &LockTable<u8>, shared: &Shared, barrier: &Barrier, ops: &[TOp]) -> Tally {
    let mut w = Worker {
        table,
        shared,
        futs: Vec::new(),
        guards: Vec::new(),
        last_token: [0; KEYS],
        tally: Tally::default(),
    };
    barrier.wait();
    for &op in ops.iter().take(MAX_OPS) {
        w.step(op);
    }
    w.drain(barrier);
    w.tally
}

fn run(input: Input) {
    let shard_timers = input.flags & 4 != 0;
    let clock = (!input.real_clock).then(|| {
        if shard_timers {
            ManualClock::with_shard_timers()
        } else {
            ManualClock::new()
        }
    });
    let leases = input.flags & 1 != 0;
    let modes = !leases && input.flags & 8 != 0;
    let eventual = input.flags & 2 != 0;
    let mut builder = LockTable::builder()
        .shards(if input.one_shard { 1 } else { 4 })
        .fairness(if eventual {
            Fairness::Eventual
        } else {
            Fairness::Strict
        });
    if let Some(c) = &clock {
        builder = builder.clock(c.clone());
    }
    let table: LockTable<u8> = builder.build();
    let shared = Shared {
        clock: clock.clone(),
        leases,
        modes,
        inside: Default::default(),
        max_live: Default::default(),
    };
    let barrier = Barrier::new(2);
    let (ta, tb) = std::thread::scope(|s| {
        let a = s.spawn(|| work(&table, &shared, &barrier, &input.a));
        let b = s.spawn(|| work(&table, &shared, &barrier, &input.b));
        (a.join(), b.join())
    });
    let (ta, tb) = match (ta, tb) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => std::panic::resume_unwind(e),
    };
    table.assert_consistent();
    assert_eq!(table.len(), 0, "len() with everything dropped");
    assert!(table.is_empty());
    if let Some(c) = &clock {
        assert_eq!(c.sleepers(), 0, "timers left armed");
        // A shard timer may stay armed for a deadline that no longer
        // exists; once that passes, it fires, finds nothing and disarms.
        c.advance(Duration::from_secs(3600 * 24 * 365));
        assert_eq!(c.armed_shards(), 0, "shard timers left armed");
    }
    let st = table.stats();
    let t = ta.plus(tb);
    assert_eq!(st.timed_out, t.timed_out, "{st:?}");
    assert_eq!(st.revoked, t.revoked, "{st:?}");
    if modes {
        // An upgrade counts an acquisition when made at once, a handoff
        // when granted from the queue, and a cancellation when dropped
        // waiting (not once granted): only bounds.
        assert!(st.acquisitions >= t.acquisitions, "{st:?} {t:?}");
        assert!(st.cancelled >= t.cancelled, "{st:?} {t:?}");
        assert!(
            st.cancelled <= t.cancelled + t.upgrades_dropped,
            "{st:?} {t:?}"
        );
        for k in 0..KEYS {
            assert_eq!(shared.inside[k].load(SeqCst), 0);
        }
        return;
    }
    // A grant is counted when it is made: a future dropped (cancelled) after
    // its grant was made, before it ran, counts as acquired and contended.
    assert!(st.acquisitions >= t.acquisitions, "{st:?} {t:?}");
    assert!(
        st.acquisitions <= t.acquisitions + t.cancelled,
        "{st:?} {t:?}"
    );
    assert!(st.contended >= t.contended, "{st:?} {t:?}");
    assert!(
        st.contended <= t.contended + t.first_poll_ok + t.cancelled,
        "{st:?} {t:?}"
    );
    assert_eq!(st.cancelled, t.cancelled, "{st:?}");
    assert_eq!(st.timed_out, t.timed_out, "{st:?}");
    assert_eq!(st.revoked, t.revoked, "{st:?}");
    if eventual {
        // A head that takes a key freed for it is contended, not handed off.
        assert!(st.handoffs <= st.contended, "{st:?}");
    } else {
        assert_eq!(st.handoffs, st.contended, "{st:?}");
    }
    for k in 0..KEYS {
        assert_eq!(shared.inside[k].load(SeqCst), 0);
    }
}

fuzz_target!(|input: Input| run(input));
