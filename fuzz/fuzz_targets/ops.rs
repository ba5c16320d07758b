//! Differential fuzzing of one `LockTable` against a plain reference model.
//!
//! The model has modes: a key's holder set (one exclusive grant or many
//! shared ones, each with its token and lease), a FIFO queue of requests
//! (shared, exclusive, or an upgrade at the head) and one admission rule
//! (`Model::admit`); shared locks come through every entry point, and
//! guards upgrade (a future, polled by hand) and downgrade. Transactions
//! (owners: re-entrant locks, `lock_all`, wait policies, commit, abort,
//! drop) share the table with the plain guards and futures, against a model
//! built on this one (`ops/owners.rs`).
//!
//! Every future is boxed, pinned and polled by hand with its own waker, and
//! time is a `ManualClock`, so a run is fully deterministic. After every step
//! the harness compares the table with the model (`is_locked`, `waiters`,
//! `len`, `stats`, armed timers, every waker's wakes and live handles, the
//! results of calls made from inside wakers) and checks the liveness rule that
//! a future able to make progress has been woken since it was last polled.
//!
//! Callers may be hostile: keys whose `Drop` panics, wakers whose `wake`,
//! `clone` or `drop` panics or whose `wake` / `clone` calls back into the
//! table, futures that are forgotten or never polled again. Every operation
//! runs under `catch_unwind`; a panic must be one of ours ("planted"), must
//! be expected by the model, and leaves the table in the state the model
//! says. See `fuzz/README.md`.

#![no_main]
#![feature(cfg_sanitize)]

use std::any::Any;
use std::borrow::Borrow;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, Hash, Hasher};
use std::panic::{catch_unwind, panic_any, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use keylock::futures::{Lock, LockOwned, LockOwnedWith, LockWith, Lost, Upgrade};
use keylock::{
    Fairness, FencingToken, Guard, LockError, LockOptions, LockTable, ManualClock, Mode,
    OwnedGuard, Stats,
};
use libfuzzer_sys::fuzz_target;

#[path = "ops/owners.rs"]
mod owners;

/// Keys are `0..KEYS`.
const KEYS: usize = 4;
/// One time unit of the inputs: a millisecond, in nanoseconds.
const UNIT: u64 = 1_000_000;
/// `Fairness::EVENTUAL_BOUND`, in nanoseconds.
const EVENTUAL_BOUND: u64 = 500_000;
const MAX_OPS: usize = 256;
/// Futures the harness may still poll, at once.
const MAX_FUTS: usize = 12;
/// Futures forgotten or abandoned (never polled again), per run.
const MAX_ABANDONED: usize = 6;
/// How far the final phase moves the clock between attempts to take a key:
/// past every lease an input can ask for, and past the fairness deadline.
const STRAND_STEP: u64 = 10 * UNIT;
/// The hash every key gets in "collide" mode.
const COLLIDE_HASH: u64 = 0x0123_4567_89ab_cdef;
/// How many futures one process leaks with a real `mem::forget` before
/// `Forget` only abandons them (so that a long run's memory stays bounded).
const FORGET_BUDGET: usize = 50_000;

static FORGOTTEN: AtomicUsize = AtomicUsize::new(0);
/// Allocations made at start-up, one freed per future forgotten.
static RESERVE: Mutex<Vec<Box<u64>>> = Mutex::new(Vec::new());

/// The environment switches (see `fuzz/README.md`), read once.
#[derive(Debug, Clone, Copy)]
struct Settings {
    /// `KEYLOCK_FUZZ_TRACE`: log each operation and the model after it.
    trace: bool,
    /// `KEYLOCK_FUZZ_LOOSE_WAKES`: check only the no-lost-wakeup rule, not
    /// exact wake counts (to test the harness itself).
    loose_wakes: bool,
    /// `KEYLOCK_FUZZ_KNOWN_BUGS`.
    known_bugs: KnownBugs,
    /// `KEYLOCK_FUZZ_FORGET_BUDGET`: real `mem::forget`s per process.
    forget_budget: usize,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

fn settings() -> Settings {
    *SETTINGS.get_or_init(|| Settings {
        trace: std::env::var_os("KEYLOCK_FUZZ_TRACE").is_some(),
        loose_wakes: std::env::var_os("KEYLOCK_FUZZ_LOOSE_WAKES").is_some(),
        known_bugs: KnownBugs::from_env(),
        forget_budget: std::env::var("KEYLOCK_FUZZ_FORGET_BUDGET")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(FORGET_BUDGET, |b: usize| b.min(FORGET_BUDGET)),
    })
}

// ---------------------------------------------------------------------------
// Input
// ---------------------------------------------------------------------------

#[derive(Arbitrary, Debug)]
struct Input {
    config: Config,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct Config {
    /// The first input byte: `% 3` picks 1, 2 or 4 shards; bit 7 picks
    /// `Fairness::Eventual` (else `Strict`).
    shards: u8,
    /// Bit 0: every key gets the same hash (one shard, one hash bucket
    /// chain). The other bits pick the table's token floor: see
    /// [`floor_of`].
    collide: u8,
    /// The table's default lease, in units (clamped to `1..=max`).
    default_lease: Option<u8>,
    /// The table's maximum lease, in units (`1..=8`); `None` = the crate's default.
    max_lease: Option<u8>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    /// Create a lock future (not polled yet). `key`: see [`key_of`] (some
    /// keys' `Drop` panics); `lease`: see [`lease_of`]; `timeout`: see
    /// [`timeout_of`]; `with`: see [`Entry`] (bit 0 forces `lock_with` even
    /// without options, bits 1..4 a shared lock, once a `bool`); `owned`
    /// uses the `Arc` variants; `waker`: see [`kind_of`].
    StartLock {
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
        with: u8,
        owned: bool,
        waker: u8,
    },
    Poll {
        fut: u8,
    },
    /// Poll with a new waker (of the same kind): the table and the timer
    /// must drop the old one.
    PollNewWaker {
        fut: u8,
    },
    /// Poll, in order, every future woken since it was last polled.
    PollWoken,
    DropFuture {
        fut: u8,
    },
    /// Never poll this future again: `mem::forget` it (a borrowing future),
    /// or keep it to drop at the very end (an owned one, or past the
    /// process's forget budget).
    Forget {
        fut: u8,
    },
    DropGuard {
        guard: u8,
    },
    ReleaseGuard {
        guard: u8,
    },
    /// `try_lock` and its variants; `with` as for `StartLock`.
    TryLock {
        key: u8,
        lease: Option<u8>,
        with: u8,
        owned: bool,
    },
    Renew {
        guard: u8,
        lease: u8,
    },
    /// `revoke(key % KEYS)`; with bit 7 of `key` set, `revoke_grant` of that
    /// key and a token picked by bits 2..7 among the tokens of the guards
    /// and those the harness has seen (see [`Harness::revoke_grant`]).
    Revoke {
        key: u8,
    },
    Check {
        guard: u8,
    },
    /// `check()` every guard, in order.
    CheckAll,
    /// Advance the clock by `by % 16` units.
    Advance {
        by: u8,
    },
    /// Advance the clock by `(by % 8) * 100` µs (around the fairness
    /// deadline); with any of bits 3..8 set, a mode operation instead (see
    /// [`ModeOp::of`]).
    AdvanceMicros {
        by: u8,
    },
    /// Advance the clock by `by % 8` nanoseconds (to land beside deadlines).
    AdvanceNanos {
        by: u8,
    },
}

/// A key (`x % KEYS`) and whether its `Drop` panics (one byte in eight).
fn key_of(x: u8) -> (usize, bool) {
    (usize::from(x) % KEYS, x & 0x70 == 0x70)
}

/// A lease in nanoseconds: 0..=9 units (0 is invalid), or 1..=6 ns.
fn lease_of(x: u8) -> u64 {
    if x >= 250 {
        u64::from(x - 249)
    } else {
        u64::from(x % 10) * UNIT
    }
}

/// A timeout in nanoseconds (`None` = `Duration::MAX`, "for ever"):
/// 0..=11 units (0 = do not wait), or 1..=15 ns.
fn timeout_of(x: u8) -> Option<u64> {
    match x {
        255 => None,
        240..=254 => Some(u64::from(x - 239)),
        _ => Some(u64::from(x % 12) * UNIT),
    }
}

/// How a future's waker behaves: half of them are plain.
fn kind_of(x: u8, own: usize) -> WKind {
    if x < 128 {
        return WKind::Plain;
    }
    // Another key than the future's own.
    let other = (own + 1 + usize::from(x >> 3) % (KEYS - 1)) % KEYS;
    match x % 8 {
        0 | 1 => WKind::WakeBomb,
        2 => WKind::CloneBomb,
        3 => WKind::DropBomb,
        4 | 5 => WKind::ReenterWake(other),
        _ => WKind::ReenterClone(other),
    }
}

/// How a lock entry point is picked, from the `with` byte of `StartLock` and
/// `TryLock` (a `bool` in older inputs: only bit 0 was read, so bits 1..
/// add modes without changing what an old input's bit 0 meant).
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Bit 0: `*_with` even without options.
    with: bool,
    /// Bits 1 and 2 both set (one byte in four): a shared lock.
    shared: bool,
    /// Bit 3 (shared): the shorthand (`lock_shared`, `try_lock_shared`, ...)
    /// when no option is asked for; else `LockOptions::shared()`, or with
    /// bit 4 `LockOptions::mode(Mode::Shared)`.
    shorthand: bool,
    by_mode: bool,
}

impl Entry {
    fn of(x: u8) -> Self {
        Self {
            with: x & 1 != 0,
            shared: x & 6 == 6,
            shorthand: x & 8 != 0,
            by_mode: x & 16 != 0,
        }
    }

    fn mode(self) -> MMode {
        if self.shared {
            MMode::Shared
        } else {
            MMode::Exclusive
        }
    }

    /// The options' mode, on `opts`.
    fn apply(self, opts: LockOptions) -> LockOptions {
        match (self.shared, self.by_mode) {
            (false, _) => opts,
            (true, false) => opts.shared(),
            (true, true) => opts.mode(Mode::Shared),
        }
    }
}

/// An operation on modes, carried by `AdvanceMicros { by }` when
/// `by >> 3 != 0` (old inputs' `AdvanceMicros` read only `by % 8`).
#[derive(Debug, Clone, Copy)]
enum ModeOp {
    /// `upgrade()` (timeout `None`) or `upgrade_with(timeout)` of guard
    /// `guard` (modulo): a new future, not polled yet.
    Upgrade {
        guard: usize,
        timeout: Option<Option<u64>>,
    },
    /// `downgrade()` of guard `guard` (modulo).
    Downgrade { guard: usize },
}

impl ModeOp {
    fn of(by: u8) -> Option<Self> {
        let hi = by >> 3;
        let guard = usize::from(by & 7);
        match hi {
            0 => None,
            1..=20 => Some(ModeOp::Upgrade {
                guard,
                timeout: match hi % 5 {
                    0 | 1 => None,
                    2 => Some(Some(0)),
                    3 => Some(Some(u64::from(hi % 4 + 1) * UNIT)),
                    _ => Some(if hi > 10 { None } else { Some(u64::from(hi)) }),
                },
            }),
            _ => Some(ModeOp::Downgrade { guard }),
        }
    }
}

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

/// Bugs of the crate the harness can look past (`KEYLOCK_FUZZ_KNOWN_BUGS`:
/// `all`, `none`, or a comma-separated list of the names below), to fuzz
/// beyond them until they are fixed. Unset, it looks past the open bugs in
/// [`KnownBugs::OPEN`] (so that CI's fuzz smoke tests everything else);
/// `none` looks past nothing. See `fuzz/README.md`.
#[derive(Debug, Clone, Copy, Default)]
struct KnownBugs {
    /// `try_lock`: the caller's key dropped (panicking) after the grant was
    /// made, before the guard exists, leaks the grant.
    try_lock_key_drop: bool,
    /// A granted future completing drops its timer (and the clock's handle
    /// of its waker, which panics) before its guard exists: the grant leaks.
    timer_waker_drop: bool,
    /// `Guard::downgrade` whose wakes (of the shared waiters it admits)
    /// panic after the unlock: the table holds the grant shared, the guard
    /// still reports `Mode::Exclusive` (`Held::downgrade` sets its mode
    /// after `downgrade_grant` returns). The harness then skips a downgrade
    /// the model says must panic.
    downgrade_wake_panic: bool,
    /// A settle that finds several lapsed holders, and `revoke`, displace
    /// them one by one and admit the waiters after each: an upgrade waiting
    /// at the head whose grant is about to be displaced too is granted
    /// first, under a new token that escapes. After a settle, the key is
    /// held exclusively by that new grant, lapsed already (the upgrade
    /// resolves `Ok`, its guard's `check()` fails; a waiter arms a timer in
    /// the past); after `revoke`, the upgraded grant stays live and
    /// exclusive, and `revoke` does not name it.
    upgrade_mid_displace: bool,
    /// A dropped (or failed) `lock_all` undoes an upgrade it made by a
    /// downgrade in `Stage::drop`; if that downgrade's wakes panic, the
    /// panic leaves `Stage::drop` before the claims are given back: the
    /// upgraded guard is dropped by the unwinding (the transaction loses
    /// the key it held before the call) and the set keeps the call's slots
    /// in flight. The harness then skips a drop of an owner's call whose
    /// undo the model says must panic. Fixed (`regressions/ops/`).
    owner_undo_wake_panic: bool,
    /// A transaction's upgrade (its `lock`, or a `lock_all` of a key it
    /// holds shared) names its key, for deadlock detection, by a clone of
    /// the instance the table stores (`guard.key().clone()`), and the
    /// detector's registration by another clone: if that instance panics
    /// when dropped, so do the clones, inside the call's poll or drop, after
    /// the upgrade was granted; the call then leaves the transaction with
    /// the key upgraded (a `lock_all`'s stage does not undo an upgrade
    /// whose wait ended in that panic). The harness then skips a poll or a
    /// drop of a call that starts, polls or drops such an upgrade. Open.
    owner_upgrade_key_clone: bool,
}

impl KnownBugs {
    /// Found and not fixed yet: looked past unless `KEYLOCK_FUZZ_KNOWN_BUGS`
    /// says otherwise. The others are fixed, and their inputs are replayed
    /// from `fuzz/regressions/`.
    const OPEN: &'static str = "";

    fn from_env() -> Self {
        let v = std::env::var("KEYLOCK_FUZZ_KNOWN_BUGS").unwrap_or_else(|_| Self::OPEN.into());
        let all = v == "all" || v == "1";
        let has = |name: &str| all || v.split(',').any(|x| x.trim() == name);
        Self {
            try_lock_key_drop: has("try_lock_key_drop"),
            timer_waker_drop: has("timer_waker_drop"),
            downgrade_wake_panic: has("downgrade_wake_panic"),
            upgrade_mid_displace: has("upgrade_mid_displace"),
            owner_undo_wake_panic: has("owner_undo_wake_panic"),
            owner_upgrade_key_clone: has("owner_upgrade_key_clone"),
        }
    }
}

// ---------------------------------------------------------------------------
// Planted panics
// ---------------------------------------------------------------------------

/// The payload of every panic the harness provokes on purpose.
#[derive(Debug)]
struct Planted(&'static str);

thread_local! {
    /// Set while the harness drops its own handles, and at teardown: no
    /// bomb goes off and no waker calls back into the table.
    static DEFUSED: Cell<bool> = const { Cell::new(false) };
    /// What wakers did from inside the table's calls.
    static REENTRY: RefCell<Vec<Reentry>> = const { RefCell::new(Vec::new()) };
    /// The table of the current run, for wakers that call back into it.
    static TABLE: RefCell<Weak<Table>> = const { RefCell::new(Weak::new()) };
}

fn quiet() -> bool {
    DEFUSED.with(Cell::get) || std::thread::panicking()
}

fn plant(what: &'static str) {
    if !quiet() {
        panic_any(Planted(what));
    }
}

fn defused<R>(f: impl FnOnce() -> R) -> R {
    let was = DEFUSED.with(|d| d.replace(true));
    let r = f();
    DEFUSED.with(|d| d.set(was));
    r
}

/// Chains a panic hook that keeps planted panics quiet (and keeps
/// libFuzzer's hook, which aborts, away from them).
fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !info.payload().is::<Planted>() {
                prev(info);
            }
        }));
    });
}

/// Runs `f`; a planted panic is returned as `Err`, any other is resumed.
fn catch<R>(f: impl FnOnce() -> R) -> Result<R, &'static str> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => Ok(r),
        Err(payload) => match payload.downcast::<Planted>() {
            Ok(p) => Err(p.0),
            Err(other) => resume_unwind(other),
        },
    }
}

fn message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Keys: compared and hashed by id; some panic when dropped
// ---------------------------------------------------------------------------

#[derive(Debug)]
struct Key {
    id: u8,
    /// Dropping this instance panics. Not part of `Eq`/`Hash`.
    bomb: bool,
}

impl Key {
    fn new(k: usize, bomb: bool) -> Self {
        Self { id: k as u8, bomb }
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h);
    }
}

impl Clone for Key {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            bomb: self.bomb,
        }
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

impl Borrow<u8> for Key {
    fn borrow(&self) -> &u8 {
        &self.id
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        if self.bomb {
            plant("key drop");
        }
    }
}

// ---------------------------------------------------------------------------
// Deterministic hashing, so that the model knows each key's shard
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct KeyHash {
    collide: bool,
}

struct KeyHasher {
    collide: bool,
    h: u64,
}

impl BuildHasher for KeyHash {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            collide: self.collide,
            h: 0,
        }
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.h
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u8(b);
        }
    }
    fn write_u8(&mut self, k: u8) {
        self.h = key_hash(self.collide, usize::from(k));
    }
}

/// Bits 32.. pick the shard (`(hash >> 32) & mask`): the shard is `k & mask`.
/// Low bits and the top seven differ too.
fn key_hash(collide: bool, k: usize) -> u64 {
    if collide {
        COLLIDE_HASH
    } else {
        let k = k as u64;
        (k << 57) | (k << 32) | k.wrapping_mul(0x9e37_79b9)
    }
}

fn shard_of(cfg: &TableCfg, k: usize) -> usize {
    (key_hash(cfg.collide, k) >> 32) as usize & (cfg.shards - 1)
}

type Table = LockTable<Key, KeyHash>;

/// The token floor picked by bits 1..8 of the config's second byte (`v`):
/// none, an epoch (`v << 32`), near the top of the token space (a million
/// tokens per shard left: a run mints far fewer, so none runs out), or an
/// arbitrary value.
fn floor_of(byte: u8, shards: usize) -> u64 {
    let v = u64::from(byte >> 1);
    match v % 4 {
        0 => 0,
        1 => v << 32,
        2 => u64::MAX - shards as u64 * (1 << 20) - v,
        _ => v.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 2,
    }
}

#[derive(Debug, Clone, Copy)]
struct TableCfg {
    shards: usize,
    collide: bool,
    token_floor: u64,
    default_lease: Option<u64>,
    max_lease: u64,
    eventual: bool,
}

impl TableCfg {
    fn from(c: Config) -> Self {
        let shards = [1, 2, 4][usize::from(c.shards % 3)];
        let max_lease = match c.max_lease {
            Some(m) => u64::from(m % 8 + 1) * UNIT,
            None => keylock::DEFAULT_MAX_LEASE.as_nanos() as u64,
        };
        let default_lease = c
            .default_lease
            .map(|d| (u64::from(d % 9) * UNIT).clamp(1, max_lease));
        Self {
            shards,
            collide: c.collide & 1 == 1,
            token_floor: floor_of(c.collide, shards),
            default_lease,
            max_lease,
            eventual: c.shards & 0x80 != 0,
        }
    }
}

// ---------------------------------------------------------------------------
// Wakers: counting, possibly hostile
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WKind {
    Plain,
    /// Every `wake` panics (after counting the wake).
    WakeBomb,
    /// Every `clone` panics.
    CloneBomb,
    /// Every `drop` of a handle panics (after releasing it).
    DropBomb,
    /// `wake` asks `is_locked(k)` and `try_lock(k)` of the table (then
    /// drops the guard).
    ReenterWake(usize),
    /// `clone` asks `waiters(k)` and `len()` of the table (no clock read:
    /// the manual clock clones a waker under its own lock).
    ReenterClone(usize),
}

impl WKind {
    /// Its panics surface only in its owner's polls and drops, at points the
    /// model does not pin down.
    fn own_bomb(self) -> bool {
        matches!(self, WKind::CloneBomb | WKind::DropBomb)
    }
}

/// What a waker did from inside a table call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reentry {
    IsLocked { key: usize, locked: bool },
    TryLock { key: usize, token: Option<u64> },
}

/// The state behind every handle of one waker: a slot of a static pool, so
/// that a waker kept by a forgotten future leaks no memory.
struct WState {
    kind: AtomicU64,
    wakes: AtomicU64,
    /// Live handles (the harness's own included).
    handles: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: WState = WState {
    kind: AtomicU64::new(0),
    wakes: AtomicU64::new(0),
    handles: AtomicUsize::new(0),
};
/// Enough for every waker of one run plus those forgotten futures keep.
const SLOTS: usize = FORGET_BUDGET + 4 * MAX_OPS;
static WAKERS: [WState; SLOTS] = [FREE_SLOT; SLOTS];
/// Free slots of `WAKERS`, filled at initialization.
static FREE_WAKERS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

impl WKind {
    fn encode(self) -> u64 {
        match self {
            WKind::Plain => 0,
            WKind::WakeBomb => 1,
            WKind::CloneBomb => 2,
            WKind::DropBomb => 3,
            WKind::ReenterWake(k) => 0x100 | k as u64,
            WKind::ReenterClone(k) => 0x200 | k as u64,
        }
    }

    fn decode(x: u64) -> Self {
        let k = (x & 0xff) as usize;
        match x {
            0 => WKind::Plain,
            1 => WKind::WakeBomb,
            2 => WKind::CloneBomb,
            3 => WKind::DropBomb,
            _ if x & 0x100 != 0 => WKind::ReenterWake(k),
            _ => WKind::ReenterClone(k),
        }
    }
}

impl WState {
    fn kind(&self) -> WKind {
        WKind::decode(self.kind.load(SeqCst))
    }
}

static VTABLE: RawWakerVTable = RawWakerVTable::new(w_clone, w_wake, w_wake_by_ref, w_drop);

/// A new waker in a free slot: its index, and the harness's own handle.
fn new_waker(kind: WKind) -> (usize, Waker) {
    let i = FREE_WAKERS
        .lock()
        .unwrap()
        .pop()
        .expect("a free waker slot") as usize;
    let s = &WAKERS[i];
    s.kind.store(kind.encode(), SeqCst);
    s.wakes.store(0, SeqCst);
    s.handles.store(1, SeqCst);
    let ptr = (s as *const WState).cast::<()>();
    // SAFETY: `ptr` is a slot of a static; the vtable below treats it so.
    let waker = unsafe { Waker::from_raw(RawWaker::new(ptr, &VTABLE)) };
    (i, waker)
}

/// Gives a waker's slot back (none of its handles is left).
fn free_waker(i: usize) {
    debug_assert_eq!(WAKERS[i].handles.load(SeqCst), 0);
    FREE_WAKERS.lock().unwrap().push(i as u32);
}

unsafe fn w_state<'a>(p: *const ()) -> &'a WState {
    // SAFETY: every handle points to a slot of `WAKERS`.
    unsafe { &*p.cast::<WState>() }
}

unsafe fn w_clone(p: *const ()) -> RawWaker {
    // SAFETY: a live handle.
    let s = unsafe { w_state(p) };
    if !quiet() {
        match s.kind() {
            WKind::CloneBomb => plant("waker clone"),
            WKind::ReenterClone(k) => {
                if let Some(table) = TABLE.with(|t| t.borrow().upgrade()) {
                    let _ = table.waiters(&(k as u8));
                    let _ = table.len();
                }
            }
            _ => {}
        }
    }
    s.handles.fetch_add(1, SeqCst);
    RawWaker::new(p, &VTABLE)
}

fn on_wake(s: &WState) {
    s.wakes.fetch_add(1, SeqCst);
    if quiet() {
        return;
    }
    match s.kind() {
        WKind::WakeBomb => plant("waker wake"),
        WKind::ReenterWake(k) => {
            if let Some(table) = TABLE.with(|t| t.borrow().upgrade()) {
                let locked = table.is_locked(&(k as u8));
                REENTRY.with(|r| r.borrow_mut().push(Reentry::IsLocked { key: k, locked }));
                let got = table.try_lock(Key::new(k, false));
                let token = got.as_ref().ok().map(|g| g.token().get());
                REENTRY.with(|r| r.borrow_mut().push(Reentry::TryLock { key: k, token }));
                drop(got);
            }
        }
        _ => {}
    }
}

unsafe fn w_wake(p: *const ()) {
    // SAFETY: a live handle, consumed.
    let s = unsafe { w_state(p) };
    let r = catch_unwind(AssertUnwindSafe(|| on_wake(s)));
    s.handles.fetch_sub(1, SeqCst);
    if let Err(payload) = r {
        resume_unwind(payload);
    }
}

unsafe fn w_wake_by_ref(p: *const ()) {
    // SAFETY: a live handle.
    on_wake(unsafe { w_state(p) });
}

unsafe fn w_drop(p: *const ()) {
    // SAFETY: a live handle, dropped.
    let s = unsafe { w_state(p) };
    s.handles.fetch_sub(1, SeqCst);
    if s.kind() == WKind::DropBomb {
        plant("waker drop");
    }
}

// ---------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------

type Fid = usize;
type Gid = usize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    Guard(Gid),
    /// A granted future that has not observed its grant.
    Slot(Fid),
}

#[derive(Debug, Clone, Copy)]
struct MHolder {
    token: u64,
    deadline: Option<u64>,
    since: Option<u64>,
    by: By,
    /// The transaction the grant was made for (0: none), as the table
    /// records it for deadlock detection.
    owner: u64,
}

/// The grants holding one key, in the order the table keeps them
/// (`keys/holders.rs`: the first inline, the rest in a vector; a removal of
/// the first moves the last of the rest into its place, any other removal
/// swaps the last into the gap). The order decides which holder a timeout's
/// diagnosis names and in which order a settle or a `revoke` displaces them.
#[derive(Debug, Default, Clone)]
struct MHolders {
    first: Option<MHolder>,
    rest: Vec<MHolder>,
}

impl MHolders {
    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    /// The holder, if exactly one grant holds the key.
    fn only(&self) -> Option<MHolder> {
        if self.rest.is_empty() {
            self.first
        } else {
            None
        }
    }

    /// The holder a diagnosis names.
    fn any(&self) -> Option<MHolder> {
        self.first
    }

    fn push(&mut self, h: MHolder) {
        if self.first.is_none() {
            self.first = Some(h);
        } else {
            self.rest.push(h);
        }
    }

    fn iter(&self) -> impl Iterator<Item = &MHolder> {
        self.first.iter().chain(self.rest.iter())
    }

    fn get(&self, token: u64) -> Option<MHolder> {
        self.iter().find(|h| h.token == token).copied()
    }

    fn get_mut(&mut self, token: u64) -> Option<&mut MHolder> {
        self.first
            .iter_mut()
            .chain(self.rest.iter_mut())
            .find(|h| h.token == token)
    }

    fn remove(&mut self, token: u64) -> Option<MHolder> {
        match self.first {
            Some(first) if first.token == token => {
                self.first = self.rest.pop();
                Some(first)
            }
            _ => {
                let at = self.rest.iter().position(|h| h.token == token)?;
                Some(self.rest.swap_remove(at))
            }
        }
    }

    /// The earliest lease deadline among the holders.
    fn earliest_deadline(&self) -> Option<u64> {
        self.iter().filter_map(|h| h.deadline).min()
    }
}

#[derive(Debug, Default, Clone)]
struct MKey {
    holders: MHolders,
    /// The mode of `holders` (meaningless while there is none).
    mode: MMode,
    queue: VecDeque<Fid>,
    /// Grants (guards, or granted futures not yet run) that lost the key
    /// and still exist.
    fenced: u32,
    last_token: u64,
    /// The key instance the table keeps panics when dropped.
    stored_bomb: bool,
}

impl MKey {
    fn unused(&self) -> bool {
        self.holders.is_empty() && self.queue.is_empty() && self.fenced == 0
    }

    /// Whether grants in `mode` may join the holders now.
    fn admits(&self, mode: MMode) -> bool {
        self.holders.is_empty() || (self.mode == MMode::Shared && mode == MMode::Shared)
    }
}

/// `keylock::Mode`, in the model.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum MMode {
    Shared,
    #[default]
    Exclusive,
}

impl MMode {
    fn of(m: Mode) -> Self {
        match m {
            Mode::Shared => MMode::Shared,
            Mode::Exclusive => MMode::Exclusive,
        }
    }
}

/// What a queued request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MWant {
    /// A lock future: a new grant in this mode.
    Grant(MMode),
    /// An upgrade of guard `gid`'s shared grant `token` (linked at the head).
    Upgrade { gid: Gid, token: u64 },
}

/// What the head of a key's queue may do now (`keys/entry.rs`
/// `Admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MAdmission {
    Empty,
    Blocked,
    Grant(MMode),
    Upgrade,
    Orphan,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MState {
    Unpolled,
    /// Its options were invalid (the lease asked for, in ns).
    Invalid(u64),
    Waiting,
    /// Granted (and maybe fenced since): what it resolves to when it runs.
    Granted {
        token: u64,
        deadline: Option<u64>,
    },
    /// An upgrade unlinked from the head because its grant (`token`) lost
    /// the key (handoff.rs `drop_orphan`): it resolves to that error.
    Orphaned {
        token: u64,
    },
}

#[derive(Debug, Clone, Copy)]
enum MPat {
    Forever,
    /// Not started; `None` = `Duration::MAX`.
    For(Option<u64>),
    Until {
        start: u64,
        until: u64,
    },
}

#[derive(Debug, Clone)]
struct MFut {
    key: usize,
    lease: Option<u64>,
    patience: MPat,
    state: MState,
    want: MWant,
    /// The key instance it was given panics when dropped.
    bomb: bool,
    kind: WKind,
    /// The table holds its waker (its node is `ARMED`).
    slot: bool,
    /// Its timer: deadline, and whether a waker is registered with the clock.
    sleep: Option<(u64, bool)>,
    /// The holder deadline its timer covers, as last told under the lock
    /// (waiter.rs `timer_at`): every waiter arms for the holders it saw.
    timer_at: Option<u64>,
    /// Wakes the model expects it to have received.
    wakes: u64,
    /// Wakes it had received when it was last polled.
    wakes_at_poll: u64,
    /// Its last poll panicked in its own waker's `clone` or `drop`: where
    /// its waker and timer stand is unknown until it is polled cleanly.
    tainted: bool,
    /// Never polled again (forgotten or abandoned).
    abandoned: bool,
    /// It has boxed timer state (it waited with a timeout, or armed a timer).
    timing: bool,
    /// The transaction it waits for (0: none): a transaction's inner lock
    /// future, or an upgrade of a transaction's grant (the grant's owner).
    owner: u64,
    /// A transaction's wait: it pended once already, and the deadlock
    /// search ran then (or the transaction had a wait registered).
    searched: bool,
}

impl MFut {
    fn upgrade_of(&self) -> Option<Gid> {
        match self.want {
            MWant::Upgrade { gid, .. } => Some(gid),
            MWant::Grant(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
struct MGuard {
    key: usize,
    token: u64,
    mode: MMode,
    expires: Option<u64>,
    /// Its `lost()` future, if the harness keeps one.
    watch: Option<MWatch>,
    /// Its pending `upgrade()` future, which borrows it mutably: nothing
    /// else touches the guard meanwhile.
    upgrading: Option<Fid>,
}

/// A guard's `Lost` future (polled with a plain waker).
#[derive(Debug, Clone, Default)]
struct MWatch {
    /// Registered with the table, and its slot holds a waker.
    armed: bool,
    /// Its timer: deadline, and whether a waker is registered with the clock.
    sleep: Option<(u64, bool)>,
    /// Wakes the model expects it to have received.
    wakes: u64,
    /// Wakes it had received when it was last polled.
    wakes_at_poll: u64,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct MStats {
    acquisitions: u64,
    contended: u64,
    handoffs: u64,
    cancelled: u64,
    expired: u64,
    timed_out: u64,
    revoked: u64,
}

impl MStats {
    fn of(s: &Stats) -> Self {
        Self {
            acquisitions: s.acquisitions,
            contended: s.contended,
            handoffs: s.handoffs,
            cancelled: s.cancelled,
            expired: s.expired,
            timed_out: s.timed_out,
            revoked: s.revoked,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MGrant {
    gid: Gid,
    token: u64,
    deadline: Option<u64>,
    mode: MMode,
}

/// What a future resolves to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MDone {
    /// A lock future: a guard.
    Guard(MGrant),
    /// An upgrade: guard `gid` is exclusive now, under `token`.
    Upgraded { gid: Gid, token: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MErr {
    Invalid(u64),
    Timeout {
        waited: u64,
        holder: Option<u64>,
        held_for: Option<u64>,
        ahead: usize,
    },
    Expired(u64),
    WouldBlock,
    Conflict {
        token: u64,
        upgrading: u64,
    },
}

#[derive(Debug, Clone, Copy)]
enum MPoll {
    Pending,
    Ready(Result<MDone, MErr>),
}

/// Whether an operation must, may or must not panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    No,
    May,
    Must,
}

#[derive(Debug, Clone)]
struct Model {
    cfg: TableCfg,
    now: u64,
    keys: [MKey; KEYS],
    futs: BTreeMap<Fid, MFut>,
    guards: BTreeMap<Gid, MGuard>,
    shard_tokens: [u64; 4],
    /// Per shard, under eventual fairness: from when on a release hands off.
    fair_at: [Option<u64>; 4],
    stats: MStats,
    next_gid: Gid,
    /// Wakes of the current call, for after its unlock: who, of what kind.
    outbox: Vec<(Fid, WKind)>,
    /// Keys whose `Drop` panics dropped by the current call.
    bomb_keys: u32,
    /// What wakers are expected to have done from inside the table.
    log: Vec<Reentry>,
    /// An eventual-fairness release with waiters read the clock.
    read_clock: bool,
    /// Known bug `upgrade_mid_displace`: several holders leave one by one.
    one_by_one: bool,
    /// The last poll found its timer due at once and judged again.
    looped: bool,
    /// The table's deadlock detector: the waits of transactions it knows
    /// of, and the cycles it broke (`owners.rs`).
    dl: owners::MDetector,
}

impl Model {
    fn new(cfg: TableCfg, known_bugs: KnownBugs) -> Self {
        Self {
            cfg,
            now: 0,
            keys: Default::default(),
            futs: BTreeMap::new(),
            guards: BTreeMap::new(),
            shard_tokens: [0; 4],
            fair_at: [None; 4],
            stats: MStats::default(),
            next_gid: 0,
            outbox: Vec::new(),
            bomb_keys: 0,
            log: Vec::new(),
            read_clock: false,
            one_by_one: known_bugs.upgrade_mid_displace,
            looped: false,
            dl: owners::MDetector::default(),
        }
    }

    fn live(&self, h: &MHolder) -> bool {
        h.deadline.is_none_or(|d| self.now < d)
    }

    /// `is_locked(k)`: a live holder, in any mode.
    fn is_locked(&self, k: usize) -> bool {
        self.keys[k].holders.iter().any(|h| self.live(h))
    }

    fn any_lapsed(&self, k: usize) -> bool {
        self.keys[k].holders.iter().any(|h| !self.live(h))
    }

    fn lease_valid(&self, lease: u64) -> bool {
        lease >= 1 && lease <= self.cfg.max_lease
    }

    /// Shard `s` of `S` mints `floor + 1 + s + n * S`, `n = 0, 1, ...`.
    fn mint(&mut self, k: usize) -> u64 {
        let s = shard_of(&self.cfg, k);
        let n = self.shard_tokens[s];
        self.shard_tokens[s] += 1;
        let t = self.cfg.token_floor + 1 + s as u64 + n * self.cfg.shards as u64;
        assert!(
            t > self.cfg.token_floor,
            "model: tokens are above the floor"
        );
        assert!(
            t > self.keys[k].last_token,
            "model: tokens increase per key"
        );
        self.keys[k].last_token = t;
        t
    }

    fn lease_from(&self, lease: Option<u64>) -> (Option<u64>, Option<u64>) {
        match lease {
            Some(l) => (Some(self.now + l), Some(self.now)),
            None => (None, None),
        }
    }

    fn fut(&mut self, f: Fid) -> &mut MFut {
        self.futs.get_mut(&f).expect("model: future exists")
    }

    fn guard(&mut self, g: Gid) -> &mut MGuard {
        self.guards.get_mut(&g).expect("model: guard exists")
    }

    fn new_guard(&mut self, k: usize, token: u64, deadline: Option<u64>, mode: MMode) -> Gid {
        let gid = self.next_gid;
        self.next_gid += 1;
        self.guards.insert(
            gid,
            MGuard {
                key: k,
                token,
                mode,
                expires: deadline,
                watch: None,
                upgrading: None,
            },
        );
        gid
    }

    fn wake(&mut self, f: Fid) {
        let fut = self.fut(f);
        fut.wakes += 1;
        let kind = fut.kind;
        self.outbox.push((f, kind));
    }

    /// Does what the current call left for after its unlock (wakes, and
    /// what they call back into the table); true if that panics. While
    /// `unwinding`, nothing panics and no waker calls back.
    fn flush(&mut self, unwinding: bool) -> bool {
        let wakes = std::mem::take(&mut self.outbox);
        let mut panicked = std::mem::take(&mut self.bomb_keys) > 0 && !unwinding;
        for (_, kind) in wakes {
            if unwinding {
                continue;
            }
            match kind {
                WKind::WakeBomb => panicked = true,
                WKind::ReenterWake(k) => panicked |= self.reenter(k),
                _ => {}
            }
        }
        panicked
    }

    /// A waker's `is_locked(k)`, `try_lock(k)`, drop of the guard.
    fn reenter(&mut self, k: usize) -> bool {
        let locked = self.is_locked(k);
        self.log.push(Reentry::IsLocked { key: k, locked });
        let saved = std::mem::take(&mut self.outbox);
        let got = self.try_lock(k, MMode::Exclusive, None, false);
        if self.flush(false) {
            assert!(got.is_err(), "model: a successful try_lock leaves no work");
            self.outbox = saved;
            return true;
        }
        self.log.push(Reentry::TryLock {
            key: k,
            token: got.ok().map(|g| g.token),
        });
        let mut panicked = false;
        if let Ok(g) = got {
            self.release(g.gid);
            panicked = self.flush(false);
        }
        self.outbox = saved;
        panicked
    }

    /// queue.rs `nudge_head`.
    fn nudge_head(&mut self, k: usize) {
        if let Some(&f) = self.keys[k].queue.front() {
            let fut = self.fut(f);
            if fut.slot {
                fut.slot = false;
                self.wake(f);
            }
        }
    }

    /// handoff.rs `nudge_head_for_timer`: the head is nudged only if the
    /// timer it armed would fire after the holders' earliest deadline.
    fn nudge_head_for_timer(&mut self, k: usize) {
        let Some(deadline) = self.keys[k].holders.earliest_deadline() else {
            return;
        };
        if let Some(&h) = self.keys[k].queue.front() {
            if self.futs[&h].timer_at.is_none_or(|at| at > deadline) {
                self.nudge_head(k);
            }
        }
    }

    /// entry.rs `admission`.
    fn admission(&self, k: usize) -> MAdmission {
        let key = &self.keys[k];
        let Some(&head) = key.queue.front() else {
            return MAdmission::Empty;
        };
        match self.futs[&head].want {
            MWant::Grant(m) if key.admits(m) => MAdmission::Grant(m),
            MWant::Grant(_) => MAdmission::Blocked,
            MWant::Upgrade { token, .. } => match key.holders.only() {
                Some(only) if only.token == token => MAdmission::Upgrade,
                _ if key.holders.get(token).is_some() => MAdmission::Blocked,
                _ => MAdmission::Orphan,
            },
        }
    }

    /// handoff.rs `admit`: the one admission rule. Grants the head while the
    /// holders admit it (consecutive shared heads together; an upgrade once
    /// its grant is the only holder); an orphaned upgrade is unlinked and
    /// told (the next head is looked at); then the head is made to arm for
    /// the holders' deadline.
    fn admit(&mut self, k: usize) {
        loop {
            match self.admission(k) {
                MAdmission::Grant(m) => {
                    self.grant_head(k, m);
                    if m == MMode::Exclusive {
                        break;
                    }
                }
                MAdmission::Upgrade => {
                    self.grant_upgrade(k);
                    break;
                }
                MAdmission::Orphan => self.drop_orphan(k),
                MAdmission::Blocked | MAdmission::Empty => break,
            }
        }
        self.nudge_head_for_timer(k);
    }

    /// handoff.rs `drop_orphan`: the head upgrade, whose grant lost the
    /// key, leaves the queue, told; woken if armed.
    fn drop_orphan(&mut self, k: usize) {
        let f = self.keys[k].queue.pop_front().expect("model: a waiter");
        let fut = self.fut(f);
        let MWant::Upgrade { token, .. } = fut.want else {
            panic!("model: an orphan is an upgrade");
        };
        assert_eq!(fut.state, MState::Waiting, "model: queued upgrade waits");
        fut.state = MState::Orphaned { token };
        let armed = std::mem::replace(&mut fut.slot, false);
        if armed {
            self.wake(f);
        }
    }

    /// handoff.rs `grant_head`: a fresh token, its lease from now; woken.
    fn grant_head(&mut self, k: usize, mode: MMode) {
        let f = self.keys[k].queue.pop_front().expect("model: a waiter");
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(self.futs[&f].lease);
        let owner = self.futs[&f].owner;
        let fut = self.fut(f);
        assert_eq!(fut.state, MState::Waiting, "model: queued future waits");
        fut.state = MState::Granted { token, deadline };
        let armed = std::mem::replace(&mut fut.slot, false);
        if armed {
            self.wake(f);
        }
        let key = &mut self.keys[k];
        key.holders.push(MHolder {
            token,
            deadline,
            since,
            by: By::Slot(f),
            owner,
        });
        key.mode = mode;
        self.stats.handoffs += 1;
        self.stats.acquisitions += 1;
        self.stats.contended += 1;
    }

    /// handoff.rs `grant_upgrade`: the head upgrade's grant, now the only
    /// holder, is exclusive under a fresh token, same lease.
    fn grant_upgrade(&mut self, k: usize) {
        let token = self.mint(k);
        let old = self.keys[k].holders.only().expect("model: the only holder");
        let f = self.keys[k].queue.pop_front().expect("model: a waiter");
        self.keys[k].holders.remove(old.token);
        let fut = self.fut(f);
        assert_eq!(fut.state, MState::Waiting, "model: queued upgrade waits");
        fut.state = MState::Granted {
            token,
            deadline: old.deadline,
        };
        let armed = std::mem::replace(&mut fut.slot, false);
        if armed {
            self.wake(f);
        }
        let key = &mut self.keys[k];
        key.holders.push(MHolder {
            token,
            by: By::Slot(f),
            ..old
        });
        key.mode = MMode::Exclusive;
        self.stats.handoffs += 1;
    }

    /// handoff.rs `free_key_passes_on`: a key left free under eventual
    /// fairness goes to a transaction's head (a forgotten call never polls
    /// to take it), with the shared heads behind it; a plain head is
    /// nudged to take it.
    fn free_key_passes_on(&mut self, k: usize) {
        while self.admission(k) == MAdmission::Orphan {
            self.drop_orphan(k);
        }
        let head_owner = self.keys[k].queue.front().map(|f| self.futs[f].owner);
        if head_owner.is_some_and(|o| o != 0) {
            self.admit(k);
        } else {
            self.nudge_head(k);
        }
    }

    /// handoff.rs `pass_on`: the last holder let go of a key with waiters.
    fn pass_on(&mut self, k: usize) {
        if self.cfg.eventual {
            self.read_clock = true;
            let s = shard_of(&self.cfg, k);
            match self.fair_at[s] {
                Some(at) if self.now < at => {
                    self.free_key_passes_on(k);
                    return;
                }
                _ => self.fair_at[s] = Some(self.now + EVENTUAL_BOUND),
            }
        }
        self.admit(k);
    }

    /// Grant `token` loses the key (lapse or revocation): it is fenced, a
    /// granted future that has not run exactly like a guard; the waiters
    /// are admitted as the remaining holders allow.
    fn displace(&mut self, k: usize, token: u64) -> Option<MHolder> {
        let h = self.fence(k, token)?;
        if !self.keys[k].queue.is_empty() {
            self.admit(k);
        }
        Some(h)
    }

    /// Grant `token` leaves the holders, fenced, and its `Lost` futures are
    /// woken; nobody is admitted yet.
    fn fence(&mut self, k: usize, token: u64) -> Option<MHolder> {
        let h = self.keys[k].holders.remove(token)?;
        self.keys[k].fenced += 1;
        // lapse.rs `displace`: the grant's `Lost` futures.
        if let By::Guard(g) = h.by {
            self.wake_watch(g);
        }
        Some(h)
    }

    /// Displaces several holders at once (a settle finding several lapsed,
    /// a `revoke`): all leave, then the waiters are admitted. Returns which
    /// of them were displaced. With the known bug `upgrade_mid_displace`,
    /// as the crate does: one by one, admitting after each, so that an
    /// upgrade whose grant is about to be displaced may be granted first
    /// (under a new token, which escapes: lapsed, or live after a revoke).
    fn displace_all(&mut self, k: usize, tokens: &[u64]) -> Vec<u64> {
        if self.one_by_one {
            return tokens
                .iter()
                .filter(|&&t| self.displace(k, t).is_some())
                .copied()
                .collect();
        }
        let gone: Vec<u64> = tokens
            .iter()
            .filter(|&&t| self.fence(k, t).is_some())
            .copied()
            .collect();
        if !gone.is_empty() && !self.keys[k].queue.is_empty() {
            self.admit(k);
        }
        gone
    }

    /// Wakes guard `g`'s `Lost` future if its waker is with the table.
    fn wake_watch(&mut self, g: Gid) {
        if let Some(w) = self.guards.get_mut(&g).and_then(|g| g.watch.as_mut()) {
            if std::mem::take(&mut w.armed) {
                w.wakes += 1;
            }
        }
    }

    /// A new `Lost` of guard `g` (not polled yet).
    fn watch_start(&mut self, g: Gid) {
        self.guard(g).watch = Some(MWatch::default());
    }

    /// lost.rs `Lost::poll`: `true` if it resolves (the grant lost its key).
    fn watch_poll(&mut self, g: Gid, wakes_now: u64) -> bool {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.guard(g).watch.as_mut().unwrap().wakes_at_poll = wakes_now;
        // lapse.rs `watch_loss`: a lapse of its own grant it is about to
        // settle unregisters it first (no wake of its own).
        if self.keys[k]
            .holders
            .get(token)
            .is_some_and(|h| !self.live(&h))
        {
            self.guard(g).watch.as_mut().unwrap().armed = false;
        }
        self.settle(k);
        let now = self.now;
        let live = self.keys[k].holders.get(token);
        let w = self.guard(g).watch.as_mut().unwrap();
        match live {
            Some(h) => {
                w.armed = true;
                w.sleep = h.deadline.map(|d| {
                    assert!(d > now, "model: a live grant's deadline is ahead");
                    (d, true)
                });
                false
            }
            None => {
                self.guard(g).watch = None;
                true
            }
        }
    }

    /// Notices lapses (only the operations that "touch" the key call this):
    /// every lapsed holder, in the table's order, is displaced.
    fn settle(&mut self, k: usize) {
        if !self.any_lapsed(k) {
            return;
        }
        let lapsed = self.count_lapsed(k);
        self.displace_all(k, &lapsed);
    }

    /// The tokens of `k`'s lapsed holders, counted expired (per lapsed
    /// grant found, displaced or not: lapse.rs).
    fn count_lapsed(&mut self, k: usize) -> Vec<u64> {
        let lapsed: Vec<u64> = self.keys[k]
            .holders
            .iter()
            .filter(|h| !self.live(h))
            .map(|h| h.token)
            .collect();
        self.stats.expired += lapsed.len() as u64;
        lapsed
    }

    fn grant_to_guard(
        &mut self,
        k: usize,
        mode: MMode,
        lease: Option<u64>,
        contended: bool,
        owner: u64,
    ) -> MGrant {
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(lease);
        self.stats.acquisitions += 1;
        if contended {
            self.stats.contended += 1;
        }
        let gid = self.new_guard(k, token, deadline, mode);
        let key = &mut self.keys[k];
        key.holders.push(MHolder {
            token,
            deadline,
            since,
            by: By::Guard(gid),
            owner,
        });
        key.mode = mode;
        MGrant {
            gid,
            token,
            deadline,
            mode,
        }
    }

    /// No entry: the key is created, and the caller's instance is kept.
    fn claim(&mut self, k: usize, mode: MMode, lease: Option<u64>, bomb: bool, owner: u64) -> MGrant {
        assert!(self.keys[k].unused());
        self.keys[k].stored_bomb = bomb;
        self.grant_to_guard(k, mode, lease, false, owner)
    }

    /// waiting.rs `open_to`: the holders admit `mode` and (strict) nobody
    /// waits; under eventual fairness a free key may be taken past the
    /// queue, a held shared one is never joined past it.
    fn open_to(&self, k: usize, mode: MMode) -> bool {
        let key = &self.keys[k];
        key.admits(mode) && (key.queue.is_empty() || (self.cfg.eventual && key.holders.is_empty()))
    }

    /// waiting.rs `take_now`: shared waiters at the head join a shared
    /// newcomer.
    fn take_now(&mut self, k: usize, mode: MMode, lease: Option<u64>, owner: u64) -> MGrant {
        let g = self.grant_to_guard(k, mode, lease, false, owner);
        if mode == MMode::Shared && !self.keys[k].queue.is_empty() {
            self.admit(k);
        }
        g
    }

    /// waiting.rs `try_acquire`; the caller's key is dropped unless kept.
    fn try_acquire(
        &mut self,
        k: usize,
        mode: MMode,
        lease: Option<u64>,
        bomb: bool,
        owner: u64,
    ) -> Option<MGrant> {
        if self.keys[k].unused() {
            return Some(self.claim(k, mode, lease, bomb, owner));
        }
        self.bomb_keys += u32::from(bomb);
        self.settle(k);
        if !self.open_to(k, mode) {
            return None;
        }
        Some(self.take_now(k, mode, lease, owner))
    }

    fn resolve(&self, lease: Option<u64>) -> Result<Option<u64>, u64> {
        match lease.or(self.cfg.default_lease) {
            Some(l) if !self.lease_valid(l) => Err(l),
            l => Ok(l),
        }
    }

    fn try_lock(
        &mut self,
        k: usize,
        mode: MMode,
        lease: Option<u64>,
        bomb: bool,
    ) -> Result<MGrant, MErr> {
        self.try_lock_for(k, mode, lease, bomb, 0)
    }

    /// `try_lock` of a grant made for transaction `owner` (0: none).
    fn try_lock_for(
        &mut self,
        k: usize,
        mode: MMode,
        lease: Option<u64>,
        bomb: bool,
        owner: u64,
    ) -> Result<MGrant, MErr> {
        match self.resolve(lease) {
            Err(l) => {
                self.bomb_keys += u32::from(bomb);
                Err(MErr::Invalid(l))
            }
            Ok(lease) => self
                .try_acquire(k, mode, lease, bomb, owner)
                .ok_or(MErr::WouldBlock),
        }
    }

    /// A new future (not polled). With invalid options it drops the
    /// caller's key at once (the harness gives it a harmless one).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        f: Fid,
        k: usize,
        mode: MMode,
        lease: Option<u64>,
        timeout: Option<Option<u64>>,
        bomb: bool,
        kind: WKind,
    ) {
        let (state, lease) = match self.resolve(lease) {
            Err(l) => {
                assert!(
                    !bomb,
                    "model: a future with invalid options drops its key at once"
                );
                (MState::Invalid(l), None)
            }
            Ok(l) => (MState::Unpolled, l),
        };
        self.insert_fut(f, k, lease, timeout, state, MWant::Grant(mode), bomb, kind);
    }

    /// A new `upgrade()` future of guard `g` (not polled), with a plain
    /// waker.
    fn start_upgrade(&mut self, f: Fid, g: Gid, timeout: Option<Option<u64>>) {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.guard(g).upgrading = Some(f);
        let want = MWant::Upgrade { gid: g, token };
        self.insert_fut(
            f,
            k,
            None,
            timeout,
            MState::Unpolled,
            want,
            false,
            WKind::Plain,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_fut(
        &mut self,
        f: Fid,
        k: usize,
        lease: Option<u64>,
        timeout: Option<Option<u64>>,
        state: MState,
        want: MWant,
        bomb: bool,
        kind: WKind,
    ) {
        self.futs.insert(
            f,
            MFut {
                key: k,
                lease,
                patience: timeout.map_or(MPat::Forever, MPat::For),
                state,
                want,
                bomb,
                kind,
                slot: false,
                sleep: None,
                timer_at: None,
                wakes: 0,
                wakes_at_poll: 0,
                tainted: false,
                abandoned: false,
                timing: false,
                owner: 0,
                searched: false,
            },
        );
    }

    /// Arms `f`'s timer at the earliest of `wake_at` and its timeout; true if
    /// that has passed already (only a lapsed holder left in place can make
    /// it so): the future then judges again at once (acquire.rs
    /// `poll_acquire`: its boxed timer is ready, nothing registered).
    #[must_use]
    fn arm_timer(&mut self, f: Fid, wake_at: Option<u64>) -> bool {
        let now = self.now;
        let one_by_one = self.one_by_one;
        let fut = self.fut(f);
        let until = match fut.patience {
            MPat::Until { until, .. } => Some(until),
            _ => None,
        };
        let at = match (wake_at, until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        fut.timing |= at.is_some();
        if at.is_some_and(|at| at <= now) {
            assert!(one_by_one, "model: a timer is armed in the future only");
            fut.sleep = None;
            self.looped = true;
            return true;
        }
        fut.sleep = at.map(|at| (at, true));
        false
    }

    /// A granted future runs: a lock future resolves to a guard of its
    /// grant, an upgrade makes its guard exclusive under the new token,
    /// fenced or not (no lock is taken, nothing is settled or counted).
    fn observe_grant(&mut self, k: usize, f: Fid, token: u64, deadline: Option<u64>) -> MDone {
        let fut = self.futs.remove(&f).expect("model: future exists");
        let (gid, done) = match fut.want {
            MWant::Grant(mode) => {
                let gid = self.new_guard(k, token, deadline, mode);
                let done = MDone::Guard(MGrant {
                    gid,
                    token,
                    deadline,
                    mode,
                });
                (gid, done)
            }
            MWant::Upgrade { gid, .. } => {
                let g = self.guard(gid);
                g.token = token;
                g.mode = MMode::Exclusive;
                g.expires = deadline;
                g.upgrading = None;
                (gid, MDone::Upgraded { gid, token })
            }
        };
        self.claim_slot(k, f, token, gid);
        done
    }

    /// Grant `token`, held by future `f` until now, is guard `gid`'s.
    fn claim_slot(&mut self, k: usize, f: Fid, token: u64, gid: Gid) {
        match self.keys[k].holders.get_mut(token) {
            Some(h) => {
                assert_eq!(h.by, By::Slot(f), "model: the grant is the future's");
                h.by = By::Guard(gid);
            }
            None => assert!(self.keys[k].fenced > 0, "model: a fenced grant is counted"),
        }
    }

    /// The head of a key freed under eventual fairness takes it; shared
    /// heads behind it join it, and the next head arms for its lease.
    fn head_takes(&mut self, k: usize, f: Fid, mode: MMode) -> MGrant {
        let head = self.keys[k].queue.pop_front();
        assert_eq!(head, Some(f));
        let (lease, owner) = (self.futs[&f].lease, self.futs[&f].owner);
        self.futs.remove(&f);
        let g = self.grant_to_guard(k, mode, lease, true, owner);
        self.admit(k);
        g
    }

    /// Links `f` into its key's queue (at the head for an upgrade): armed,
    /// its timer at the earliest of its timeout and the holders' deadline.
    #[must_use]
    fn enqueue(&mut self, k: usize, f: Fid, front: bool) -> bool {
        let now = self.now;
        if front {
            self.keys[k].queue.push_front(f);
        } else {
            self.keys[k].queue.push_back(f);
        }
        let fut = self.fut(f);
        let patience = fut.patience;
        fut.state = MState::Waiting;
        // A timeout (even `Duration::MAX`, "for ever") boxes timer state
        // when the future first waits.
        fut.timing |= matches!(patience, MPat::For(_));
        fut.patience = match patience {
            MPat::For(Some(t)) => MPat::Until {
                start: now,
                until: now + t,
            },
            _ => MPat::Forever,
        };
        fut.slot = true;
        let wake_at = self.keys[k].holders.earliest_deadline();
        self.fut(f).timer_at = wake_at;
        self.arm_timer(f, wake_at)
    }

    /// The diagnosis of a timeout: the first holder, `ahead` waiters.
    fn diagnosis(&self, k: usize, waited: u64, ahead: usize) -> MErr {
        let h = self.keys[k].holders.any();
        MErr::Timeout {
            waited,
            holder: h.map(|h| h.token),
            held_for: h.and_then(|h| h.since).map(|s| self.now - s),
            ahead,
        }
    }

    fn poll(&mut self, f: Fid, wakes_now: u64) -> MPoll {
        self.looped = false;
        let fut = self.fut(f);
        fut.wakes_at_poll = wakes_now;
        let k = fut.key;
        let want = fut.want;
        match self.futs[&f].state {
            MState::Invalid(v) => {
                self.futs.remove(&f);
                MPoll::Ready(Err(MErr::Invalid(v)))
            }
            MState::Unpolled => match want {
                MWant::Grant(mode) => self.first_poll(k, f, mode),
                MWant::Upgrade { gid, token } => self.first_poll_upgrade(k, f, gid, token),
            },
            MState::Granted { token, deadline } => {
                MPoll::Ready(Ok(self.observe_grant(k, f, token, deadline)))
            }
            MState::Orphaned { token } => self.observe_orphaned(f, token),
            MState::Waiting => self.poll_waiting(k, f, want),
        }
    }

    /// An orphaned upgrade polls: its grant's loss (acquire.rs
    /// `poll_upgrade`).
    fn observe_orphaned(&mut self, f: Fid, token: u64) -> MPoll {
        let fut = self.futs.remove(&f).expect("model: the future");
        if let Some(g) = fut.upgrade_of() {
            self.guard(g).upgrading = None;
        }
        MPoll::Ready(Err(MErr::Expired(token)))
    }

    /// A later poll of a linked waiter.
    fn poll_waiting(&mut self, k: usize, f: Fid, want: MWant) -> MPoll {
        let now = self.now;
        {
            {
                // Settled first: a wait past its timeout still takes the key
                // if it is its by now (a lapse handed it over, or a free key
                // at the head under eventual fairness); only then it gives up.
                self.settle(k);
                match self.futs[&f].state {
                    MState::Granted { token, deadline } => {
                        return MPoll::Ready(Ok(self.observe_grant(k, f, token, deadline)));
                    }
                    MState::Orphaned { token } => return self.observe_orphaned(f, token),
                    _ => {}
                }
                let gave_up =
                    matches!(self.futs[&f].patience, MPat::Until { until, .. } if now >= until);
                if let MWant::Upgrade { gid, token } = want {
                    if self.keys[k].holders.get(token).is_none() {
                        // Its grant lost the key while it waited: it leaves
                        // (acquire.rs: through `leave`, `Leaving::Lost`).
                        if gave_up {
                            return self.time_out(k, f);
                        }
                        let _ = self.leave(k, f, MLeaving::Lost);
                        self.guard(gid).upgrading = None;
                        return MPoll::Ready(Err(MErr::Expired(token)));
                    }
                }
                let head = self.keys[k].queue.front() == Some(&f);
                if let (true, true, MWant::Grant(mode)) =
                    (head, self.keys[k].holders.is_empty(), want)
                {
                    return MPoll::Ready(Ok(MDone::Guard(self.head_takes(k, f, mode))));
                }
                if gave_up {
                    return self.time_out(k, f);
                }
                self.fut(f).slot = true;
                let wake_at = self.keys[k].holders.earliest_deadline();
                self.fut(f).timer_at = wake_at;
                if self.arm_timer(f, wake_at) {
                    return self.poll_waiting(k, f, want);
                }
                MPoll::Pending
            }
        }
    }

    /// The first poll of a lock future.
    fn first_poll(&mut self, k: usize, f: Fid, mode: MMode) -> MPoll {
        let MFut {
            lease,
            bomb,
            patience,
            owner,
            ..
        } = self.futs[&f];
        if let MPat::For(Some(0)) = patience {
            self.futs.remove(&f);
            return MPoll::Ready(match self.try_acquire(k, mode, lease, bomb, owner) {
                Some(g) => Ok(MDone::Guard(g)),
                None => {
                    self.stats.timed_out += 1;
                    let ahead = self.keys[k].queue.len();
                    Err(self.diagnosis(k, 0, ahead))
                }
            });
        }
        if self.keys[k].unused() {
            self.futs.remove(&f);
            return MPoll::Ready(Ok(MDone::Guard(self.claim(k, mode, lease, bomb, owner))));
        }
        self.bomb_keys += u32::from(bomb);
        self.settle(k);
        if self.open_to(k, mode) {
            self.futs.remove(&f);
            return MPoll::Ready(Ok(MDone::Guard(self.take_now(k, mode, lease, owner))));
        }
        if self.enqueue(k, f, false) {
            return self.poll_waiting(k, f, MWant::Grant(mode));
        }
        MPoll::Pending
    }

    /// The first poll of an upgrade (waiting.rs `upgrade`, acquire.rs
    /// `start_upgrade`).
    fn first_poll_upgrade(&mut self, k: usize, f: Fid, gid: Gid, token: u64) -> MPoll {
        self.settle(k);
        let Some(mine) = self.keys[k].holders.get(token) else {
            self.futs.remove(&f);
            self.guard(gid).upgrading = None;
            return MPoll::Ready(Err(MErr::Expired(token)));
        };
        if self.keys[k].mode == MMode::Exclusive {
            self.futs.remove(&f);
            self.guard(gid).upgrading = None;
            return MPoll::Ready(Ok(MDone::Upgraded { gid, token }));
        }
        if self.keys[k].holders.only().is_some() {
            // The only holder: exclusive at once, with a fresh token.
            let fresh = self.mint(k);
            let key = &mut self.keys[k];
            key.holders.remove(token);
            key.holders.push(MHolder {
                token: fresh,
                ..mine
            });
            key.mode = MMode::Exclusive;
            self.stats.acquisitions += 1;
            self.futs.remove(&f);
            let g = self.guard(gid);
            g.token = fresh;
            g.mode = MMode::Exclusive;
            g.upgrading = None;
            return MPoll::Ready(Ok(MDone::Upgraded { gid, token: fresh }));
        }
        if let Some(&head) = self.keys[k].queue.front() {
            if let MWant::Upgrade {
                token: upgrading, ..
            } = self.futs[&head].want
            {
                self.futs.remove(&f);
                self.guard(gid).upgrading = None;
                return MPoll::Ready(Err(MErr::Conflict { token, upgrading }));
            }
        }
        // Its waiter carries its grant's transaction (waiting.rs `upgrade`).
        self.fut(f).owner = mine.owner;
        if let MPat::For(Some(0)) = self.futs[&f].patience {
            // Would wait, and may not: linked and left at once, under the
            // lock (no waker stored, no timer armed).
            self.keys[k].queue.push_front(f);
            self.fut(f).state = MState::Waiting;
            let err = self.leave(k, f, MLeaving::TimedOut);
            self.guard(gid).upgrading = None;
            return MPoll::Ready(Err(err.expect("model: a timeout's diagnosis")));
        }
        if self.enqueue(k, f, true) {
            return self.poll_waiting(k, f, MWant::Upgrade { gid, token });
        }
        MPoll::Pending
    }

    /// waiting.rs `leave` of a linked waiter that was not granted (and
    /// drops the model's future): with `timed_out`, the diagnosis of now.
    fn leave(&mut self, k: usize, f: Fid, why: MLeaving) -> Option<MErr> {
        let ahead = self.keys[k]
            .queue
            .iter()
            .position(|&x| x == f)
            .expect("model: waiting future is queued");
        self.keys[k].queue.remove(ahead);
        let fut = self.futs.remove(&f).expect("model: future exists");
        self.after_leaving(k, ahead == 0);
        let err = match why {
            MLeaving::TimedOut => {
                self.stats.timed_out += 1;
                let waited = match fut.patience {
                    MPat::Until { start, .. } => self.now - start,
                    _ => 0,
                };
                Some(self.diagnosis(k, waited, ahead))
            }
            MLeaving::Dropped => {
                self.stats.cancelled += 1;
                None
            }
            // waiting.rs `Leaving::Lost`: the loss was counted where found.
            MLeaving::Lost => None,
        };
        self.remove_if_unused(k);
        err
    }

    /// queue.rs `leave` with `timed_out` (after the poll's settle).
    fn time_out(&mut self, k: usize, f: Fid) -> MPoll {
        if let Some(g) = self.futs[&f].upgrade_of() {
            self.guard(g).upgrading = None;
        }
        let err = self
            .leave(k, f, MLeaving::TimedOut)
            .expect("model: a timeout's diagnosis");
        MPoll::Ready(Err(err))
    }

    /// A waiter left the queue: a new head may be admitted (shared waiters
    /// behind a departed writer or upgrade), must arm its timer, or (a free
    /// key, eventual fairness) is nudged to take the key.
    fn after_leaving(&mut self, k: usize, was_head: bool) {
        if was_head {
            if self.keys[k].holders.is_empty() && self.cfg.eventual {
                self.free_key_passes_on(k);
            } else {
                self.admit(k);
            }
        }
    }

    fn remove_if_unused(&mut self, k: usize) {
        if self.keys[k].unused() {
            self.bomb_keys += u32::from(std::mem::take(&mut self.keys[k].stored_bomb));
        }
    }

    /// A future is dropped: queue.rs `leave` if it had queued; an upgrade
    /// granted but not observed is made shared again (upgrade.rs).
    fn drop_fut(&mut self, f: Fid) {
        let fut = self.futs[&f].clone();
        let k = fut.key;
        match (fut.state, fut.want) {
            (MState::Unpolled, _) => {
                self.futs.remove(&f);
                self.bomb_keys += u32::from(fut.bomb);
            }
            (MState::Invalid(_), _) | (MState::Orphaned { .. }, _) => {
                self.futs.remove(&f);
            }
            (MState::Waiting, _) => {
                let _ = self.leave(k, f, MLeaving::Dropped);
            }
            (MState::Granted { token, .. }, MWant::Grant(_)) => {
                self.futs.remove(&f);
                self.stats.cancelled += 1;
                self.release_token(k, token);
            }
            (MState::Granted { token, deadline }, MWant::Upgrade { gid, .. }) => {
                self.futs.remove(&f);
                // acquire.rs `cancel_upgrade`: `downgrade` of the new grant
                // (its error ignored); the guard carries the new token,
                // shared.
                let _ = self.downgrade_token(k, token);
                self.claim_slot(k, f, token, gid);
                let g = self.guard(gid);
                g.token = token;
                g.mode = MMode::Shared;
                g.expires = deadline;
            }
        }
        if let Some(g) = fut.upgrade_of() {
            self.guard(g).upgrading = None;
        }
    }

    /// waiting.rs `release`: by token; a stale one frees nothing.
    fn release_token(&mut self, k: usize, token: u64) {
        if self.keys[k].holders.get(token).is_some() {
            let last = self.keys[k].holders.only().is_some();
            if last && self.keys[k].queue.is_empty() {
                self.keys[k].holders.remove(token);
            } else {
                // handoff.rs `let_go`.
                self.keys[k].holders.remove(token);
                if self.keys[k].holders.is_empty() {
                    self.pass_on(k);
                } else if self.any_lapsed(k) {
                    // A lapsed other holder goes first, admission once after.
                    self.settle(k);
                } else {
                    self.admit(k);
                }
                // waiting.rs `release_at`: an orphaned upgrade unlinked may
                // have been all that was left.
                self.remove_if_unused(k);
                return;
            }
        } else {
            assert!(self.keys[k].fenced > 0, "model: fenced count");
            self.keys[k].fenced -= 1;
        }
        self.remove_if_unused(k);
    }

    /// A guard drops.
    fn release(&mut self, g: Gid) {
        let guard = self.guards.remove(&g).expect("model: guard exists");
        assert!(guard.upgrading.is_none(), "model: a guard being upgraded");
        if let Some(h) = self.keys[guard.key].holders.get(guard.token) {
            assert_eq!(h.by, By::Guard(g), "model: the guard's grant");
        }
        self.release_token(guard.key, guard.token);
    }

    fn check(&mut self, g: Gid) -> Result<u64, MErr> {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.settle(k);
        match self.keys[k].holders.get(token) {
            Some(_) => Ok(token),
            None => Err(MErr::Expired(token)),
        }
    }

    /// waiting.rs `downgrade` of grant `token` of key `k`.
    fn downgrade_token(&mut self, k: usize, token: u64) -> Result<(), MErr> {
        self.settle(k);
        if self.keys[k].holders.get(token).is_none() {
            return Err(MErr::Expired(token));
        }
        if self.keys[k].mode == MMode::Shared {
            return Ok(());
        }
        self.keys[k].mode = MMode::Shared;
        self.admit(k);
        Ok(())
    }

    /// `Guard::downgrade`.
    fn downgrade(&mut self, g: Gid) -> Result<(), MErr> {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.downgrade_token(k, token)?;
        self.guard(g).mode = MMode::Shared;
        Ok(())
    }

    fn renew(&mut self, g: Gid, lease: u64) -> Result<(), MErr> {
        if !self.lease_valid(lease) {
            return Err(MErr::Invalid(lease));
        }
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.settle(k);
        let now = self.now;
        match self.keys[k].holders.get_mut(token) {
            Some(h) => {
                let before = h.deadline.replace(now + lease);
                h.since.get_or_insert(now);
                self.guard(g).expires = Some(now + lease);
                self.nudge_head_for_timer(k);
                // lapse.rs `renew`: an earlier (or first) deadline wakes the
                // grant's `Lost` futures to re-arm.
                if before.is_none_or(|b| now + lease < b) {
                    self.wake_watch(g);
                }
                Ok(())
            }
            None => Err(MErr::Expired(token)),
        }
    }

    /// lapse.rs `revoke`: every holder found when the call came (after the
    /// settle) is displaced, in the table's order; the highest token.
    fn revoke(&mut self, k: usize) -> Option<u64> {
        if self.keys[k].unused() {
            return None;
        }
        // The holders when the call comes, lapsed and live: not a waiter
        // that settling a lapse would admit. All are displaced at once,
        // the lapse not settled first (lapse.rs `revoke`): an upgrade at
        // the head is not granted to a grant this call revokes.
        let (live, lapsed): (Vec<MHolder>, Vec<MHolder>) =
            self.keys[k].holders.iter().copied().partition(|h| self.live(h));
        let live: Vec<u64> = live.iter().map(|h| h.token).collect();
        let all: Vec<u64> = lapsed.iter().map(|h| h.token).chain(live.iter().copied()).collect();
        self.stats.expired += lapsed.len() as u64;
        let gone = self.displace_all(k, &all);
        let gone: Vec<u64> = gone.into_iter().filter(|t| live.contains(t)).collect();
        self.stats.revoked += gone.len() as u64;
        let revoked = gone.into_iter().max();
        // A revoked guard's `expires_at()` reads the clock (it reports the
        // time of the call).
        self.read_clock |= revoked.is_some();
        revoked
    }

    /// lapse.rs `revoke_grant`: only grant `t`, if it is a live holder.
    fn revoke_grant(&mut self, k: usize, t: u64) -> bool {
        if self.keys[k].unused() {
            return false;
        }
        if self.keys[k].holders.get(t).is_some_and(|h| self.live(&h)) {
            // lapse.rs `revoke_grant`: lapsed holders go with it, before
            // anyone is admitted.
            if self.any_lapsed(k) {
                let mut gone = self.count_lapsed(k);
                gone.push(t);
                self.displace_all(k, &gone);
            } else {
                self.displace(k, t);
            }
            self.stats.revoked += 1;
            self.read_clock = true;
            return true;
        }
        self.settle(k);
        false
    }

    /// What guard `g`'s `expires_at()` reports: its grant's deadline while
    /// it holds the key (lapsed or not); once it lost the key, its deadline
    /// if that has passed, else the time of the call.
    fn expires_at(&self, g: Gid) -> Option<u64> {
        let guard = &self.guards[&g];
        match self.keys[guard.key].holders.get(guard.token) {
            Some(h) => h.deadline,
            None => Some(guard.expires.map_or(self.now, |d| d.min(self.now))),
        }
    }

    fn advance(&mut self, by: u64) {
        self.now += by;
        let now = self.now;
        let due: Vec<Fid> = self
            .futs
            .iter_mut()
            .filter_map(|(&f, fut)| match &mut fut.sleep {
                Some((at, armed @ true)) if *at <= now => {
                    *armed = false;
                    Some(f)
                }
                _ => None,
            })
            .collect();
        for f in due {
            self.wake(f);
        }
        for g in self.guards.values_mut() {
            if let Some(MWatch {
                sleep: Some((at, armed @ true)),
                wakes,
                ..
            }) = &mut g.watch
            {
                if *at <= now {
                    *armed = false;
                    *wakes += 1;
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.keys.iter().filter(|k| !k.unused()).count()
    }

    fn armed_timers(&self, tainted: bool) -> usize {
        let watches = self
            .guards
            .values()
            .filter(|g| {
                matches!(
                    g.watch,
                    Some(MWatch {
                        sleep: Some((_, true)),
                        ..
                    })
                )
            })
            .count();
        self.futs
            .values()
            .filter(|f| f.tainted == tainted && matches!(f.sleep, Some((_, true))))
            .count()
            + if tainted { 0 } else { watches }
    }

    /// Whether guard `g`'s grant has lost its authority by now (so its
    /// `Lost` must have been woken since it was last polled).
    fn grant_lost(&self, g: Gid) -> bool {
        let guard = &self.guards[&g];
        self.keys[guard.key]
            .holders
            .get(guard.token)
            .is_none_or(|h| !self.live(&h))
    }

    /// Whether polling `f` now would change anything (so it must have been
    /// woken since it was last polled).
    fn can_progress(&self, f: Fid) -> bool {
        let fut = &self.futs[&f];
        let key = &self.keys[fut.key];
        if fut.tainted {
            return false;
        }
        match fut.state {
            MState::Granted { .. } | MState::Orphaned { .. } => true,
            MState::Waiting => {
                let timed_out =
                    matches!(fut.patience, MPat::Until { until, .. } if self.now >= until);
                let head = key.queue.front() == Some(&f);
                let orphan = match fut.want {
                    MWant::Upgrade { token, .. } => key.holders.get(token).is_none(),
                    MWant::Grant(_) => false,
                };
                let free = key.holders.is_empty() || self.any_lapsed(fut.key);
                timed_out || orphan || (head && free)
            }
            MState::Unpolled | MState::Invalid(_) => false,
        }
    }

    /// Whether guard `g` waits for its upgrade's grant to be observed (the
    /// grant is counted by the future, not the guard).
    fn upgrade_granted(&self, g: &MGuard) -> bool {
        g.upgrading
            .is_some_and(|f| matches!(self.futs[&f].state, MState::Granted { .. }))
    }

    /// The model's own invariants.
    fn self_check(&self) {
        for (i, key) in self.keys.iter().enumerate() {
            assert!(
                key.mode == MMode::Shared || key.holders.len() <= 1,
                "model: an exclusive key has one holder"
            );
            match self.admission(i) {
                MAdmission::Empty | MAdmission::Blocked => {}
                MAdmission::Grant(_) if key.holders.is_empty() => {
                    assert!(self.cfg.eventual, "model: strict waiters imply a holder");
                    let head = &self.futs[&key.queue[0]];
                    assert!(
                        head.tainted || !head.slot,
                        "model: the head of a free key was nudged"
                    );
                }
                other => panic!("model: key {i}'s head is admitted but waits: {other:?}"),
            }
            for (at, f) in key.queue.iter().enumerate() {
                assert_eq!(self.futs[f].state, MState::Waiting);
                assert_eq!(self.futs[f].key, i);
                if let MWant::Upgrade { .. } = self.futs[f].want {
                    assert_eq!(at, 0, "model: an upgrade waits at the head");
                }
            }
            let held = |t: u64| key.holders.get(t).is_some();
            let fenced_guards = self
                .guards
                .values()
                .filter(|g| g.key == i && !held(g.token) && !self.upgrade_granted(g))
                .count();
            let fenced_slots = self
                .futs
                .values()
                .filter(|f| {
                    f.key == i && matches!(f.state, MState::Granted { token, .. } if !held(token))
                })
                .count();
            assert_eq!(
                fenced_guards + fenced_slots,
                key.fenced as usize,
                "model: fenced count of key {i}"
            );
            for h in key.holders.iter() {
                match h.by {
                    By::Guard(g) => assert_eq!(self.guards[&g].token, h.token),
                    By::Slot(f) => assert!(matches!(
                        self.futs[&f].state,
                        MState::Granted { token, .. } if token == h.token
                    )),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The real thing
// ---------------------------------------------------------------------------

enum AnyFut<'a> {
    Plain(Pin<Box<Lock<'a, Key, KeyHash>>>),
    With(Pin<Box<LockWith<'a, Key, KeyHash>>>),
    Owned(Pin<Box<LockOwned<Key, KeyHash>>>),
    OwnedWith(Pin<Box<LockOwnedWith<Key, KeyHash>>>),
    /// A guard's `upgrade()`: it borrows the (boxed) guard mutably, so the
    /// harness leaves that guard alone until the future is gone.
    Upgrade(Pin<Box<Upgrade<'a, Key, KeyHash>>>),
}

/// What a future resolves to.
enum Out<'a> {
    Guard(AnyGuard<'a>),
    /// An upgrade's new token.
    Upgraded(FencingToken),
}

impl<'a> AnyFut<'a> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Out<'a>, LockError>> {
        let guard = |g| Out::Guard(g);
        match self {
            AnyFut::Plain(f) => f.as_mut().poll(cx).map(|g| Ok(guard(AnyGuard::B(g)))),
            AnyFut::With(f) => f
                .as_mut()
                .poll(cx)
                .map(|r| r.map(|g| guard(AnyGuard::B(g)))),
            AnyFut::Owned(f) => f.as_mut().poll(cx).map(|g| Ok(guard(AnyGuard::O(g)))),
            AnyFut::OwnedWith(f) => f
                .as_mut()
                .poll(cx)
                .map(|r| r.map(|g| guard(AnyGuard::O(g)))),
            AnyFut::Upgrade(f) => f.as_mut().poll(cx).map(|r| r.map(Out::Upgraded)),
        }
    }

    fn owned(&self) -> bool {
        matches!(self, AnyFut::Owned(_) | AnyFut::OwnedWith(_))
    }

    /// `mem::forget` of the pinned box: its `Drop` never runs, its memory is
    /// never freed (and not reported as a leak).
    fn forget(self) {
        fn leak<T>(b: Pin<Box<T>>) {
            ignore_leak((&*b as *const T).cast());
            std::mem::forget(b);
        }
        match self {
            AnyFut::Plain(f) => leak(f),
            AnyFut::With(f) => leak(f),
            AnyFut::Owned(f) => leak(f),
            AnyFut::OwnedWith(f) => leak(f),
            AnyFut::Upgrade(_) => unreachable!("an upgrade is never forgotten"),
        }
    }
}

#[cfg(sanitize = "address")]
extern "C" {
    fn __lsan_ignore_object(p: *const std::ffi::c_void);
}

#[allow(unused_variables)]
fn ignore_leak(p: *const std::ffi::c_void) {
    // SAFETY: `p` points into a live heap allocation.
    #[cfg(sanitize = "address")]
    unsafe {
        __lsan_ignore_object(p)
    };
}

enum AnyGuard<'a> {
    B(Guard<'a, Key, KeyHash>),
    O(OwnedGuard<Key, KeyHash>),
}

macro_rules! on_guard {
    ($g:expr, |$x:ident| $e:expr) => {
        match $g {
            AnyGuard::B($x) => $e,
            AnyGuard::O($x) => $e,
        }
    };
}

impl AnyGuard<'_> {
    fn token(&self) -> FencingToken {
        on_guard!(self, |g| g.token())
    }
    fn mode(&self) -> Mode {
        on_guard!(self, |g| g.mode())
    }
    fn downgrade(&mut self) -> Result<(), LockError> {
        on_guard!(self, |g| g.downgrade())
    }
    fn key(&self) -> usize {
        usize::from(on_guard!(self, |g| g.key().id))
    }
    fn check(&self) -> Result<FencingToken, LockError> {
        on_guard!(self, |g| g.check())
    }
    fn is_expired(&self) -> bool {
        on_guard!(self, |g| g.is_expired())
    }
    fn expires_at(&self) -> Option<Instant> {
        on_guard!(self, |g| g.expires_at())
    }
    fn renew(&self, lease: Duration) -> Result<(), LockError> {
        on_guard!(self, |g| g.renew(lease))
    }
    fn release(self) {
        on_guard!(self, |g| g.release())
    }
}

struct HFut<'a> {
    id: Fid,
    /// `None` once really forgotten.
    fut: Option<AnyFut<'a>>,
    /// The harness's own handle of its current waker.
    waker: Waker,
    /// The slots of every waker it was polled with, the current one last.
    wakers: Vec<usize>,
    owned: bool,
}

impl<'a> HFut<'a> {
    /// Wakes received, through any of its wakers.
    fn wakes(&self) -> u64 {
        self.wakers
            .iter()
            .map(|&w| WAKERS[w].wakes.load(SeqCst))
            .sum()
    }

    /// Handles of its wakers kept by the table or the clock.
    fn foreign_handles(&self) -> usize {
        let all: usize = self
            .wakers
            .iter()
            .map(|&w| WAKERS[w].handles.load(SeqCst))
            .sum();
        all - 1
    }

    fn new_waker(&mut self) {
        let kind = WAKERS[*self.wakers.last().unwrap()].kind();
        let (slot, waker) = new_waker(kind);
        let old = std::mem::replace(&mut self.waker, waker);
        defused(|| drop(old));
        self.wakers.push(slot);
    }

    fn poll(&mut self) -> Poll<Result<Out<'a>, LockError>> {
        let mut cx = Context::from_waker(&self.waker);
        self.fut.as_mut().expect("a live future").poll(&mut cx)
    }
}

struct HGuard<'a> {
    id: Gid,
    /// Its `lost()` future, which borrows `guard`: declared first, so that
    /// it drops first; every path that drops the guard drops it before.
    lost: Option<HLost<'a>>,
    /// Boxed, so that it stays put while `lost` borrows it.
    guard: Box<AnyGuard<'a>>,
}

/// A guard's `Lost` future and its (plain) waker.
struct HLost<'a> {
    lost: Lost<'a, Key, KeyHash>,
    waker: Waker,
    slot: usize,
}

impl HLost<'_> {
    fn wakes(&self) -> u64 {
        WAKERS[self.slot].wakes.load(SeqCst)
    }

    /// Handles of its waker kept by the table or the clock.
    fn foreign_handles(&self) -> usize {
        WAKERS[self.slot].handles.load(SeqCst) - 1
    }

    /// Drops it; the table and the clock must keep no handle of its waker.
    fn retire(self, gid: Gid) {
        let HLost { lost, waker, slot } = self;
        drop(lost);
        defused(|| drop(waker));
        assert_eq!(
            WAKERS[slot].handles.load(SeqCst),
            0,
            "the Lost of guard {gid}: the table or the clock kept a handle of its waker"
        );
        free_waker(slot);
    }
}

struct Harness<'a> {
    table: &'a Arc<Table>,
    clock: ManualClock,
    base: Instant,
    futs: Vec<HFut<'a>>,
    /// Forgotten or abandoned futures (never polled again).
    abandoned: Vec<HFut<'a>>,
    guards: Vec<HGuard<'a>>,
    model: Model,
    next_fid: Fid,
    /// Per key, the largest token seen on a live grant.
    last_seen: [u64; KEYS],
    /// Every token a guard was handed out with: a grant has one guard at
    /// most, and tokens are unique across the table.
    handed_out: std::collections::HashSet<u64>,
    /// Tokens seen lately (guards', a timeout's holder), for `revoke_grant`.
    tokens_seen: Vec<FencingToken>,
    trace: bool,
    /// A lease or a timeout has been asked for (or the table has a default
    /// lease): until then the table must never read its clock.
    timed: bool,
    /// `ManualClock::reads()` once the table was built (building reads it).
    reads_at_build: u64,
    /// Check only the no-lost-wakeup rule, not exact wake counts
    /// (`KEYLOCK_FUZZ_LOOSE_WAKES`, to test the harness itself).
    loose_wakes: bool,
    /// Tolerate the known bugs (`KEYLOCK_FUZZ_KNOWN_BUGS`).
    known_bugs: KnownBugs,
    /// Transactions (see `ops/owners.rs`).
    owners: owners::Owners<'a>,
}

impl<'a> Harness<'a> {
    fn at(&self, n: u64) -> Instant {
        self.base + ns(n)
    }

    fn expect_err(&self, what: &str, got: &LockError, want: MErr) {
        let ok = match (got, want) {
            (
                LockError::InvalidOptions {
                    option,
                    value,
                    min,
                    max,
                },
                MErr::Invalid(v),
            ) => {
                *option == "lease"
                    && *value == ns(v)
                    && *min == ns(1)
                    && *max == ns(self.model.cfg.max_lease)
            }
            (
                LockError::Timeout {
                    waited,
                    holder,
                    held_for,
                    ahead,
                    ..
                },
                MErr::Timeout {
                    waited: w,
                    holder: h,
                    held_for: hf,
                    ahead: a,
                },
            ) => {
                *waited == ns(w)
                    && holder.map(FencingToken::get) == h
                    && *held_for == hf.map(ns)
                    && *ahead == a
            }
            (LockError::Expired { token, key: None }, MErr::Expired(t)) => token.get() == t,
            (LockError::WouldBlock { key: None }, MErr::WouldBlock) => true,
            (
                LockError::UpgradeConflict { token, upgrading, key: None },
                MErr::Conflict {
                    token: t,
                    upgrading: u,
                },
            ) => token.get() == t && upgrading.get() == u,
            _ => false,
        };
        assert!(ok, "{what}: crate said {got:?}, model says {want:?}");
    }

    /// Whether a call panicked as the model expects.
    fn expect_panic(&self, what: &str, got: Result<(), &'static str>, want: Expect) {
        match (got, want) {
            (Ok(()), Expect::Must) => {
                panic!("{what}: the model expects a planted panic, none came")
            }
            (Err(p), Expect::No) => panic!("{what}: unexpected planted panic in {p}"),
            _ => {}
        }
        if let Err(p) = got {
            if self.trace {
                eprintln!("  {what}: planted panic in {p}");
            }
        }
    }

    /// The model's expectation for a call, from what it left to do.
    fn flush(&mut self, may: bool) -> Expect {
        if self.model.flush(false) {
            Expect::Must
        } else if may {
            Expect::May
        } else {
            Expect::No
        }
    }

    /// What wakers did from inside the call must be what the model says.
    fn check_reentry(&mut self, what: &str) {
        let got: Vec<Reentry> = REENTRY.with(|r| std::mem::take(&mut *r.borrow_mut()));
        let want = std::mem::take(&mut self.model.log);
        assert_eq!(got, want, "{what}: calls made from inside wakers");
    }

    /// A guard the crate handed out: it must be the model's grant.
    fn accept_guard(&mut self, what: &str, guard: AnyGuard<'a>, want: MGrant, key: usize) {
        assert_eq!(guard.key(), key, "{what}: guard of the wrong key");
        assert_eq!(guard.token().get(), want.token, "{what}: token");
        assert_eq!(MMode::of(guard.mode()), want.mode, "{what}: mode");
        self.new_token(what, key, want.token, want.mode);
        assert_eq!(
            guard.expires_at(),
            self.model.expires_at(want.gid).map(|d| self.at(d)),
            "{what}: expires_at"
        );
        self.seen_token(guard.token());
        self.guards.push(HGuard {
            id: want.gid,
            lost: None,
            guard: Box::new(guard),
        });
    }

    /// A token handed out for key `key` in `mode`: above the floor, never
    /// handed out before; an exclusive grant that holds the key is above
    /// every grant of the key seen so far.
    fn new_token(&mut self, what: &str, key: usize, t: u64, mode: MMode) {
        assert!(
            t > self.model.cfg.token_floor,
            "{what}: token {t} not above the floor"
        );
        assert!(
            self.handed_out.insert(t),
            "{what}: token {t} handed out twice in one table"
        );
        if self.model.keys[key].holders.get(t).is_some() {
            assert!(
                mode == MMode::Shared || t > self.last_seen[key],
                "{what}: exclusive token {t} not above every earlier grant of key {key}"
            );
            self.last_seen[key] = self.last_seen[key].max(t);
        }
    }

    /// A guard the crate built but lost to a panic: unwinding dropped it,
    /// which released it (nothing of that release may panic or call back).
    fn released_by_unwinding(&mut self, gid: Gid) {
        self.model.release(gid);
        self.model.flush(true);
    }

    fn step(&mut self, op: Op) {
        if self.trace {
            eprintln!("op {op:?}");
        }
        match op {
            Op::StartLock {
                key,
                lease,
                timeout,
                with,
                owned,
                waker,
            } => match owners::OwnerOp::of(key, lease, timeout, with, owned, waker) {
                Some(op) => self.owner_op(op),
                None => self.start_lock(key, lease, timeout, with, owned, waker),
            },
            Op::Poll { fut } => {
                if !self.futs.is_empty() {
                    self.poll_at(usize::from(fut) % self.futs.len(), false);
                }
            }
            Op::PollNewWaker { fut } => {
                if !self.futs.is_empty() {
                    self.poll_at(usize::from(fut) % self.futs.len(), true);
                }
            }
            Op::PollWoken => {
                let woken: Vec<Fid> = self
                    .futs
                    .iter()
                    .filter(|f| f.wakes() > self.model.futs[&f.id].wakes_at_poll)
                    .map(|f| f.id)
                    .collect();
                for id in woken {
                    if let Some(i) = self.futs.iter().position(|f| f.id == id) {
                        self.poll_at(i, false);
                    }
                }
                self.owner_poll_woken();
            }
            Op::DropFuture { fut } => {
                if !self.futs.is_empty() {
                    let f = self.futs.remove(usize::from(fut) % self.futs.len());
                    self.drop_future(f);
                }
            }
            Op::Forget { fut } => {
                // An upgrade is never forgotten: it borrows its guard.
                let upgrade =
                    |h: &Self, i: usize| h.model.futs[&h.futs[i].id].upgrade_of().is_some();
                if !self.futs.is_empty()
                    && self.abandoned.len() < MAX_ABANDONED
                    && !upgrade(self, usize::from(fut) % self.futs.len())
                {
                    let mut f = self.futs.remove(usize::from(fut) % self.futs.len());
                    let m = self.model.fut(f.id);
                    m.abandoned = true;
                    // A real `mem::forget` when the future leaks nothing but
                    // its own box: it borrows the table (an owned one would
                    // leak the table), has no timer state (boxed, holding the
                    // clock), no boxed error, and its wakers are known.
                    let leaks_only_its_box = !f.owned
                        && !m.timing
                        && !m.tainted
                        && !matches!(m.state, MState::Invalid(_));
                    if leaks_only_its_box && FORGOTTEN.load(SeqCst) < settings().forget_budget {
                        FORGOTTEN.fetch_add(1, SeqCst);
                        f.fut.take().unwrap().forget();
                        // One allocation of the reserve made at start-up is
                        // freed for the one leaked: libFuzzer sees as many
                        // frees as allocations, so it keeps checking each
                        // input for leaks.
                        drop(RESERVE.lock().unwrap().pop());
                    }
                    self.abandoned.push(f);
                }
            }
            Op::DropGuard { guard } | Op::ReleaseGuard { guard } => {
                if let Some(i) = self.free_guard(guard) {
                    let g = self.guards.remove(i);
                    self.drop_guard(g, matches!(op, Op::ReleaseGuard { .. }));
                }
            }
            Op::TryLock {
                key,
                lease,
                with,
                owned,
            } => {
                let (k, bomb) = key_of(key);
                // Known bug: a `try_lock` whose key's drop panics after it
                // took an existing entry leaks the grant.
                let bomb = bomb && !self.known_bugs.try_lock_key_drop;
                self.try_lock(k, lease.map(lease_of), Entry::of(with), owned, bomb);
            }
            Op::Renew { guard, lease } => {
                if let Some(i) = self.free_guard(guard) {
                    self.renew(i, lease_of(lease));
                }
            }
            Op::Revoke { key } if key & 0x80 != 0 => {
                let (k, _) = key_of(key);
                self.revoke_grant(k, usize::from((key >> 2) & 0x1f));
            }
            Op::Revoke { key } => {
                let (k, _) = key_of(key);
                let want = self.model.revoke(k);
                let expect = self.flush(false);
                let got = catch(|| self.table.revoke(&(k as u8)));
                self.expect_panic("revoke", got.map(drop), expect);
                if let Ok(got) = got {
                    assert_eq!(got.map(FencingToken::get), want, "revoke({k})");
                    if let Some(t) = got {
                        self.seen_token(t);
                    }
                }
                self.check_reentry("revoke");
            }
            Op::Check { guard } => {
                if let Some(i) = self.free_guard(guard) {
                    self.check_guard(i);
                }
            }
            Op::CheckAll => {
                // Per key: exclusive and shared guards that pass `check()`.
                let mut live = [(0, 0); KEYS];
                for i in 0..self.guards.len() {
                    if !self.busy(i) && self.check_guard(i) == Some(true) {
                        let g = &self.guards[i].guard;
                        let n = &mut live[g.key()];
                        match g.mode() {
                            Mode::Exclusive => n.0 += 1,
                            Mode::Shared => n.1 += 1,
                        }
                    }
                }
                for (k, (x, s)) in live.iter().enumerate() {
                    assert!(
                        *x == 0 || (*x == 1 && *s == 0),
                        "{x} exclusive and {s} shared guards of key {k} pass check() at once"
                    );
                }
            }
            Op::Advance { by } => self.advance(u64::from(by % 16) * UNIT),
            Op::AdvanceMicros { by } => match ModeOp::of(by) {
                None => self.advance(u64::from(by % 8) * 100_000),
                Some(ModeOp::Upgrade { guard, timeout }) => {
                    if let Some(i) = self.free_guard(guard as u8) {
                        self.start_upgrade(i, timeout);
                    }
                }
                Some(ModeOp::Downgrade { guard }) => {
                    if let Some(i) = self.free_guard(guard as u8) {
                        self.downgrade(i);
                    }
                }
            },
            Op::AdvanceNanos { by } if by & 0x80 != 0 => {
                if let Some(i) = self.free_guard((by >> 3) & 7) {
                    self.watch(i, by & 0x40 != 0);
                }
            }
            Op::AdvanceNanos { by } => self.advance(u64::from(by % 8)),
        }
    }

    /// Whether guard `i` is borrowed by its pending upgrade.
    fn busy(&self, i: usize) -> bool {
        self.model.guards[&self.guards[i].id].upgrading.is_some()
    }

    /// Guard `pick` (modulo), unless it is borrowed by its upgrade.
    fn free_guard(&self, pick: u8) -> Option<usize> {
        if self.guards.is_empty() {
            return None;
        }
        let i = usize::from(pick) % self.guards.len();
        (!self.busy(i)).then_some(i)
    }

    /// `upgrade()` / `upgrade_with(timeout)` of guard `i`: a new future (not
    /// polled yet) with a plain waker. Not for a guard with a `Lost`, which
    /// borrows it.
    fn start_upgrade(&mut self, i: usize, timeout: Option<Option<u64>>) {
        if self.futs.len() >= MAX_FUTS || self.guards[i].lost.is_some() {
            return;
        }
        self.timed |= timeout.is_some();
        let gid = self.guards[i].id;
        let id = self.next_fid;
        self.next_fid += 1;
        self.model.start_upgrade(id, gid, timeout);
        // SAFETY: the guard is boxed and stays put; while the future exists
        // the harness does not touch the guard (`busy`), and the future is
        // dropped before the guard on every path (futures are dropped
        // first at the end; a busy guard is never dropped).
        let guard: &'a mut AnyGuard<'a> =
            unsafe { &mut *(&mut *self.guards[i].guard as *mut AnyGuard<'a>) };
        let fut = match timeout {
            None => on_guard!(guard, |g| g.upgrade()),
            Some(t) => {
                let opts = LockOptions::new().timeout(t.map_or(Duration::MAX, ns));
                on_guard!(guard, |g| g.upgrade_with(opts))
            }
        };
        let (slot, waker) = new_waker(WKind::Plain);
        self.futs.push(HFut {
            id,
            owned: false,
            fut: Some(AnyFut::Upgrade(Box::pin(fut))),
            waker,
            wakers: vec![slot],
        });
    }

    /// `downgrade()` of guard `i` (not with a `Lost`, which borrows it).
    fn downgrade(&mut self, i: usize) {
        if self.guards[i].lost.is_some() {
            return;
        }
        let gid = self.guards[i].id;
        let before = self
            .known_bugs
            .downgrade_wake_panic
            .then(|| self.model.clone());
        let want = self.model.downgrade(gid);
        let expect = self.flush(false);
        if let (Some(before), Expect::Must) = (before, expect) {
            // Known bug: the guard would keep reporting `Exclusive`.
            self.model = before;
            return;
        }
        let got = catch(|| self.guards[i].guard.downgrade());
        self.expect_panic("downgrade", got.as_ref().map(drop).map_err(|p| *p), expect);
        match (&got, want) {
            // Its wakes after the unlock panicked; the change is complete.
            (Err(_), _) => {}
            (Ok(Ok(())), Ok(())) => {}
            (Ok(Err(e)), Err(w)) => self.expect_err("downgrade", e, w),
            _ => panic!("downgrade of guard {gid}: crate {got:?}, model {want:?}"),
        }
        self.check_reentry("downgrade");
    }

    #[allow(clippy::too_many_arguments)]
    fn start_lock(
        &mut self,
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
        with: u8,
        owned: bool,
        waker: u8,
    ) {
        let entry = Entry::of(with);
        let with = entry.with;
        if self.futs.len() >= MAX_FUTS {
            return;
        }
        let (k, bomb) = key_of(key);
        let lease = lease.map(lease_of);
        let timeout = timeout.map(timeout_of);
        self.timed |= lease.is_some() || timeout.is_some();
        let mut kind = kind_of(waker, k);

        if self.known_bugs.timer_waker_drop && kind == WKind::DropBomb {
            // Known bug: a waker whose drop panics, dropped with the timer
            // when a granted future completes, loses the grant.
            kind = WKind::Plain;
        }
        // One future at a time calls back into the table from `wake`, so
        // that the order of wakes within one call does not matter.
        if matches!(kind, WKind::ReenterWake(_))
            && self
                .model
                .futs
                .values()
                .any(|f| matches!(f.kind, WKind::ReenterWake(_)))
        {
            kind = WKind::Plain;
        }
        // A lock future built with invalid options drops its key at once; if
        // that panics, the future (its boxed error, and its `Arc` of the
        // table) is leaked by the language: the return value is not dropped
        // when a later local's drop panics (rust-lang/rust#47949).
        let bomb = bomb && self.model.resolve(lease).is_ok();
        let plain = !with && lease.is_none() && timeout.is_none();
        let shorthand = plain && entry.shared && entry.shorthand;
        let plain = plain && !entry.shared;
        let mut opts = entry.apply(LockOptions::new());
        if let Some(l) = lease {
            opts = opts.lease(ns(l));
        }
        if let Some(t) = timeout {
            opts = opts.timeout(t.map_or(Duration::MAX, ns));
        }
        let id = self.next_fid;
        self.next_fid += 1;
        self.model
            .start(id, k, entry.mode(), lease, timeout, bomb, kind);
        let table = self.table;
        let fut = match catch(|| {
            let key = Key::new(k, bomb);
            match (plain || shorthand, owned) {
                (true, false) if shorthand => AnyFut::Plain(Box::pin(table.lock_shared(key))),
                (true, true) if shorthand => {
                    AnyFut::Owned(Box::pin(Arc::clone(table).lock_shared_owned(key)))
                }
                (true, false) => AnyFut::Plain(Box::pin(table.lock(key))),
                (true, true) => AnyFut::Owned(Box::pin(Arc::clone(table).lock_owned(key))),
                (false, false) => AnyFut::With(Box::pin(table.lock_with(key, opts))),
                (false, true) => {
                    AnyFut::OwnedWith(Box::pin(Arc::clone(table).lock_owned_with(key, opts)))
                }
            }
        }) {
            Ok(fut) => fut,
            Err(p) => panic!("creating a lock future: unexpected planted panic in {p}"),
        };
        let (slot, waker) = new_waker(kind);
        self.futs.push(HFut {
            id,
            owned: fut.owned(),
            fut: Some(fut),
            waker,
            wakers: vec![slot],
        });
    }

    fn try_lock(&mut self, k: usize, lease: Option<u64>, entry: Entry, owned: bool, bomb: bool) {
        self.timed |= lease.is_some();
        let mut opts = entry.apply(LockOptions::new());
        if let Some(l) = lease {
            opts = opts.lease(ns(l));
        }
        let want = self.model.try_lock(k, entry.mode(), lease, bomb);
        let expect = self.flush(false);
        let table = self.table;
        let plain = !entry.with && lease.is_none();
        let got = catch(|| -> Result<AnyGuard<'a>, LockError> {
            let key = Key::new(k, bomb);
            if plain && entry.shared && entry.shorthand {
                return if owned {
                    Arc::clone(table)
                        .try_lock_shared_owned(key)
                        .map(AnyGuard::O)
                        .map_err(LockError::from)
                } else {
                    table
                        .try_lock_shared(key)
                        .map(AnyGuard::B)
                        .map_err(LockError::from)
                };
            }
            match (!plain || entry.shared, owned) {
                (false, false) => table
                    .try_lock(key)
                    .map(AnyGuard::B)
                    .map_err(LockError::from),
                (false, true) => Arc::clone(table)
                    .try_lock_owned(key)
                    .map(AnyGuard::O)
                    .map_err(LockError::from),
                (true, false) => table.try_lock_with(key, opts).map(AnyGuard::B),
                (true, true) => Arc::clone(table)
                    .try_lock_owned_with(key, opts)
                    .map(AnyGuard::O),
            }
        });
        match got {
            Ok(got) => {
                self.expect_panic("try_lock", Ok(()), expect);
                match (got, want) {
                    (Ok(g), Ok(w)) => self.accept_guard("try_lock", g, w, k),
                    (Err(e), Err(w)) => self.expect_err("try_lock", &e, w),
                    (got, want) => panic!(
                        "try_lock({k}): crate {:?}, model {want:?}",
                        got.map(|g| g.token())
                    ),
                }
            }
            Err(p) => {
                self.expect_panic("try_lock", Err(p), expect);
                // The guard, if any, was dropped by unwinding.
                if let Ok(w) = want {
                    self.released_by_unwinding(w.gid);
                }
            }
        }
        self.check_reentry("try_lock");
    }

    fn renew(&mut self, i: usize, lease: u64) {
        self.timed = true;
        let gid = self.guards[i].id;
        let want = self.model.renew(gid, lease);
        let expect = self.flush(false);
        let got = catch(|| self.guards[i].guard.renew(ns(lease)));
        self.expect_panic("renew", got.as_ref().map(drop).map_err(|p| *p), expect);
        match (&got, want) {
            // The result is lost to a panic (a wake after the unlock); the
            // guard's copy of its deadline was written under the lock, so it
            // is checked below like any other.
            (Err(_), _) => {}
            (Ok(Ok(())), Ok(())) => {}
            (Ok(Err(e)), Err(w)) => self.expect_err("renew", e, w),
            _ => panic!("renew: crate {got:?}, model {want:?}"),
        }
        let g = &self.guards[i];
        let want = self.model.expires_at(g.id).map(|d| self.at(d));
        assert_eq!(g.guard.expires_at(), want, "expires_at after renew");
        self.check_reentry("renew");
    }

    /// Guard `i`'s `Lost` future: made and polled if it has none, else
    /// polled, or dropped if `drop_it`.
    fn watch(&mut self, i: usize, drop_it: bool) {
        let gid = self.guards[i].id;
        if drop_it {
            if let Some(lost) = self.guards[i].lost.take() {
                self.model.guards.get_mut(&gid).unwrap().watch = None;
                lost.retire(gid);
            }
            return;
        }
        if self.guards[i].lost.is_none() {
            // SAFETY: the guard is boxed and stays put; `HGuard::lost` is
            // dropped before the guard on every path (`drop_guard`, this
            // function, and field order when the harness is dropped).
            let guard: &'a AnyGuard<'a> =
                unsafe { &*(&*self.guards[i].guard as *const AnyGuard<'a>) };
            let lost = on_guard!(guard, |g| g.lost());
            let (slot, waker) = new_waker(WKind::Plain);
            self.guards[i].lost = Some(HLost { lost, waker, slot });
            self.model.watch_start(gid);
        }
        let h = self.guards[i].lost.as_mut().unwrap();
        let wakes = h.wakes();
        let want = self.model.watch_poll(gid, wakes);
        let expect = self.flush(false);
        let got = catch(|| {
            let h = self.guards[i].lost.as_mut().unwrap();
            Pin::new(&mut h.lost).poll(&mut Context::from_waker(&h.waker))
        });
        self.expect_panic("Lost poll", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("Lost poll");
        let h = self.guards[i].lost.take().unwrap();
        let token = self.guards[i].guard.token();
        match got {
            // A waiter's wake in the poll's deferred work panicked (the
            // poll's own change is complete): where the Lost stands is not
            // pinned down; drop it.
            Err(_) => {
                self.model.guards.get_mut(&gid).unwrap().watch = None;
                h.retire(gid);
            }
            Ok(Poll::Ready(err)) => {
                assert!(want, "Lost of guard {gid} resolved; the model says live");
                assert_eq!(err, LockError::Expired { token, key: None }, "Lost of guard {gid}");
                h.retire(gid);
            }
            Ok(Poll::Pending) => {
                assert!(!want, "Lost of guard {gid} pending; the model says lost");
                self.guards[i].lost = Some(h);
            }
        }
    }

    /// `revoke_grant(k, t)`, `t` the `pick`-th (modulo) of the guards'
    /// tokens followed by the tokens seen before (released, fenced, of
    /// other keys, named by a timeout): only a live holder's own token
    /// revokes anything.
    fn revoke_grant(&mut self, k: usize, pick: usize) {
        // The model's copy of each guard's token: a guard borrowed by its
        // upgrade is not touched.
        let candidates: Vec<FencingToken> = self
            .guards
            .iter()
            .map(|g| FencingToken::new(self.model.guards[&g.id].token).expect("above zero"))
            .chain(self.tokens_seen.iter().copied())
            .collect();
        if candidates.is_empty() {
            return;
        }
        let t = candidates[pick % candidates.len()];
        let want = self.model.revoke_grant(k, t.get());
        let expect = self.flush(false);
        let got = catch(|| self.table.revoke_grant(&(k as u8), t));
        self.expect_panic("revoke_grant", got.map(drop), expect);
        if let Ok(got) = got {
            assert_eq!(got, want, "revoke_grant({k}, {t})");
        }
        self.check_reentry("revoke_grant");
    }

    /// Remembers a token for `revoke_grant` to pick (the last few).
    fn seen_token(&mut self, t: FencingToken) {
        if !self.tokens_seen.contains(&t) {
            if self.tokens_seen.len() == 16 {
                self.tokens_seen.remove(0);
            }
            self.tokens_seen.push(t);
        }
    }

    fn advance(&mut self, by: u64) {
        self.model.advance(by);
        let expect = self.flush(false);
        let got = catch(|| self.clock.advance(ns(by)));
        self.expect_panic("advance", got, expect);
        self.check_reentry("advance");
    }

    fn drop_guard(&mut self, mut g: HGuard<'a>, release: bool) {
        // Its `Lost` borrows it: dropped first (that runs nothing of the
        // caller's: a plain waker).
        if let Some(lost) = g.lost.take() {
            self.model.guards.get_mut(&g.id).unwrap().watch = None;
            lost.retire(g.id);
        }
        self.model.release(g.id);
        let expect = self.flush(false);
        let got = catch(|| {
            if release {
                (*g.guard).release();
            } else {
                drop(g.guard);
            }
        });
        self.expect_panic("guard drop", got, expect);
        self.check_reentry("guard drop");
    }

    fn drop_future(&mut self, mut f: HFut<'a>) {
        let may = self.model.futs[&f.id].kind.own_bomb();
        self.model.drop_fut(f.id);
        let expect = self.flush(may);
        let fut = f.fut.take();
        let got = catch(|| drop(fut));
        self.expect_panic("future drop", got, expect);
        self.check_reentry("future drop");
        self.retire(f);
    }

    /// `is_expired()` then `check()` on guard `i`; whether it is live, if
    /// known (a call may panic: a wake of a lapse it settles).
    fn check_guard(&mut self, i: usize) -> Option<bool> {
        let id = self.guards[i].id;
        let want = self.model.check(id);
        let expect = self.flush(false);
        let expired = catch(|| self.guards[i].guard.is_expired());
        self.expect_panic("is_expired", expired.map(drop), expect);
        self.check_reentry("is_expired");
        if let Ok(expired) = expired {
            assert_eq!(expired, want.is_err(), "is_expired() of guard {id}");
        }
        let want = self.model.check(id);
        let expect = self.flush(false);
        let got = catch(|| self.guards[i].guard.check());
        self.expect_panic("check", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("check");
        let live = match (&got, want) {
            (Err(_), _) => None,
            (Ok(Ok(t)), Ok(w)) => {
                assert_eq!(t.get(), w, "check() token");
                Some(true)
            }
            (Ok(Err(e)), Err(w)) => {
                self.expect_err("check", e, w);
                Some(false)
            }
            _ => panic!("check() of guard {id}: crate {got:?}, model {want:?}"),
        };
        if let (Ok(expired), Some(live)) = (expired, live) {
            assert_eq!(expired, !live, "is_expired() == check().is_err()");
        }
        let want = self.model.expires_at(id).map(|d| self.at(d));
        assert_eq!(self.guards[i].guard.expires_at(), want, "expires_at");
        live
    }

    fn poll_at(&mut self, i: usize, new_waker: bool) {
        if new_waker {
            self.futs[i].new_waker();
        }
        let id = self.futs[i].id;
        let k = self.model.futs[&id].key;
        let wakes = self.futs[i].wakes();
        let m = self.model.fut(id);
        let kind = m.kind;
        if m.tainted {
            // Its wakes since the panic are not predicted; this poll
            // re-registers everything.
            m.wakes = wakes;
        }
        let before = (self.model.one_by_one && kind.own_bomb()).then(|| self.model.clone());
        let want = self.model.poll(id, wakes);
        // A waker's own `clone` or `drop` may panic anywhere in the poll:
        // before the poll's deferred work (which then runs while unwinding:
        // no panics, no calls back into the table) or within it.
        let may = kind.own_bomb();
        if let (Some(before), true) = (before, self.model.looped) {
            // Known bug `upgrade_mid_displace`: a timer armed in the past
            // makes the poll judge again; its own waker may panic in between
            // (arming), which the model does not follow. Not polled.
            self.model = before;
            return;
        }
        let mut unwound = may.then(|| {
            let mut m = self.model.clone();
            m.flush(true);
            m
        });
        let expect = self.flush(may);
        let got = catch(|| self.futs[i].poll());
        let reentry: Vec<Reentry> = REENTRY.with(|r| r.borrow().clone());
        if got.is_err() && reentry != self.model.log {
            if let Some(m) = unwound.take() {
                self.model = m;
            }
        }
        self.check_reentry("poll");
        let got = match got {
            Ok(got) => {
                self.expect_panic("poll", Ok(()), expect);
                got
            }
            Err(p) => {
                self.expect_panic("poll", Err(p), expect);
                match want {
                    MPoll::Pending => {
                        if may {
                            self.model.fut(id).tainted = true;
                        }
                    }
                    MPoll::Ready(r) => {
                        // An upgrade changed its guard in place before its
                        // deferred work ran: nothing was lost.
                        if let Ok(MDone::Guard(w)) = r {
                            self.released_by_unwinding(w.gid);
                        }
                        let f = self.futs.remove(i);
                        self.retire(f);
                    }
                }
                return;
            }
        };
        match (got, want) {
            (Poll::Pending, MPoll::Pending) => {
                self.model.fut(id).tainted = false;
                if new_waker {
                    self.futs[i].wakers[..self.futs[i].wakers.len() - 1]
                        .iter()
                        .for_each(|&w| {
                            assert_eq!(
                                WAKERS[w].handles.load(SeqCst),
                                0,
                                "future {id}: a replaced waker is still held"
                            );
                        });
                }
            }
            (Poll::Ready(Ok(Out::Guard(g))), MPoll::Ready(Ok(MDone::Guard(w)))) => {
                self.accept_guard("poll", g, w, k);
                let f = self.futs.remove(i);
                self.retire(f);
            }
            (
                Poll::Ready(Ok(Out::Upgraded(t))),
                MPoll::Ready(Ok(MDone::Upgraded { gid, token })),
            ) => {
                assert_eq!(t.get(), token, "upgrade of guard {gid}: token");
                let f = self.futs.remove(i);
                self.retire(f);
                if !self.handed_out.contains(&token) {
                    self.new_token("upgrade", k, token, MMode::Exclusive);
                }
                self.seen_token(t);
                let g = self.guards.iter().find(|g| g.id == gid).expect("its guard");
                assert_eq!(
                    g.guard.token(),
                    t,
                    "upgrade of guard {gid}: the guard's token"
                );
                assert_eq!(
                    g.guard.mode(),
                    Mode::Exclusive,
                    "upgrade of guard {gid}: mode"
                );
            }
            (Poll::Ready(Err(e)), MPoll::Ready(Err(w))) => {
                self.expect_err("poll", &e, w);
                if let LockError::Timeout {
                    holder: Some(t), ..
                } = e
                {
                    self.seen_token(t);
                }
                let f = self.futs.remove(i);
                self.retire(f);
            }
            (got, want) => panic!(
                "poll of future {id} (key {k}): crate {:?}, model {want:?}",
                got.map(|r| r.map(|g| match g {
                    Out::Guard(g) => g.token(),
                    Out::Upgraded(t) => t,
                }))
            ),
        }
    }

    /// A future that completed or was dropped: the table and the clock must
    /// keep no handle of its wakers.
    fn retire(&mut self, f: HFut<'a>) {
        let HFut {
            id,
            fut,
            waker,
            wakers,
            ..
        } = f;
        // A completed future: dropping it runs nothing of the caller's.
        drop(fut);
        defused(|| drop(waker));
        for &w in &wakers {
            assert_eq!(
                WAKERS[w].handles.load(SeqCst),
                0,
                "future {id}: the table or the clock kept a handle of its waker"
            );
            free_waker(w);
        }
    }

    /// The model's view, for `KEYLOCK_FUZZ_TRACE`.
    fn dump(&self) {
        let m = &self.model;
        eprintln!("  now {} sleepers {}", m.now, self.clock.sleepers());
        for (k, key) in m.keys.iter().enumerate() {
            if !key.unused() {
                eprintln!(
                    "  key {k}: {:?} holders {:?} queue {:?} fenced {}",
                    key.mode,
                    key.holders.iter().collect::<Vec<_>>(),
                    key.queue,
                    key.fenced
                );
            }
        }
        for (id, f) in &m.futs {
            eprintln!(
                "  fut {id}: key {} {:?} {:?} {:?} slot {} sleep {:?} wakes {}{}{}",
                f.key,
                f.want,
                f.state,
                f.kind,
                f.slot,
                f.sleep,
                f.wakes,
                if f.tainted { " tainted" } else { "" },
                if f.abandoned { " abandoned" } else { "" },
            );
        }
        if !m.dl.is_empty() {
            eprintln!("  deadlock detector: {}", m.dl_describe());
        }
    }

    /// Compares everything observable without side effects.
    fn compare(&self) {
        self.model.self_check();
        self.owner_compare();
        self.table.assert_consistent();
        for k in 0..KEYS {
            let key = k as u8;
            assert_eq!(
                self.table.is_locked(&key),
                self.model.is_locked(k),
                "is_locked({k}) at {}",
                self.model.now
            );
            assert_eq!(
                self.table.waiters(&key),
                self.model.keys[k].queue.len(),
                "waiters({k})"
            );
        }
        assert_eq!(self.table.len(), self.model.len(), "len()");
        assert_eq!(self.table.is_empty(), self.model.len() == 0, "is_empty()");
        assert_eq!(MStats::of(&self.table.stats()), self.model.stats, "stats()");
        let sleepers = self.clock.sleepers();
        let sure = self.model.armed_timers(false);
        let tainted = self.model.futs.values().filter(|f| f.tainted).count();
        assert!(
            sleepers >= sure && sleepers <= sure + tainted,
            "armed timers: {sleepers}, model {sure} (+ up to {tainted})"
        );
        if !self.timed && !self.model.read_clock {
            assert_eq!(
                self.clock.reads(),
                self.reads_at_build,
                "the table read its clock with no lease, timeout or contended eventual release"
            );
        }
        for g in &self.guards {
            let mg = &self.model.guards[&g.id];
            if mg.upgrading.is_some() {
                // Borrowed by its upgrade: not touched.
                continue;
            }
            assert_eq!(g.guard.token().get(), mg.token, "token of guard {}", g.id);
            assert_eq!(MMode::of(g.guard.mode()), mg.mode, "mode of guard {}", g.id);
            let want = self.model.expires_at(g.id).map(|d| self.at(d));
            assert_eq!(g.guard.expires_at(), want, "expires_at of guard {}", g.id);
            let m = self.model.guards[&g.id].watch.as_ref();
            assert_eq!(g.lost.is_some(), m.is_some(), "guard {}: a Lost", g.id);
            if let (Some(h), Some(m)) = (&g.lost, m) {
                if self.model.grant_lost(g.id) {
                    assert!(
                        h.wakes() > m.wakes_at_poll,
                        "lost wakeup: the Lost of guard {} was not woken ({m:?})",
                        g.id
                    );
                }
                let want = usize::from(m.armed) + usize::from(matches!(m.sleep, Some((_, true))));
                assert_eq!(
                    h.foreign_handles(),
                    want,
                    "the Lost of guard {}: handles of its waker held by the table and the clock ({m:?})",
                    g.id
                );
                if !self.loose_wakes {
                    assert_eq!(
                        h.wakes(),
                        m.wakes,
                        "wakes of the Lost of guard {} ({m:?})",
                        g.id
                    );
                }
            }
        }
        for f in self.futs.iter().chain(&self.abandoned) {
            let m = &self.model.futs[&f.id];
            // The rule first: a future that would make progress if polled
            // has been woken since it was last polled (no lost wakeup).
            if self.model.can_progress(f.id) {
                assert!(
                    f.wakes() > m.wakes_at_poll,
                    "lost wakeup: future {} can make progress but was not woken ({m:?})",
                    f.id
                );
            }
            // Its waker's handles: the table's (if its node is armed) and
            // the clock's (if its timer is armed), and no other.
            let foreign = f.foreign_handles();
            if m.tainted {
                assert!(foreign <= 2, "future {}: waker handles pile up", f.id);
            } else {
                let want = usize::from(m.slot) + usize::from(matches!(m.sleep, Some((_, true))));
                assert_eq!(
                    foreign, want,
                    "future {}: handles of its waker held by the table and the clock ({m:?})",
                    f.id
                );
            }
            // Then the exact count: one wake per grant, one per nudge (to arm
            // a timer, or to take a key freed under eventual fairness), one
            // per timer that fired.
            if !self.loose_wakes && !m.tainted {
                assert_eq!(f.wakes(), m.wakes, "wakes of future {} ({m:?})", f.id);
            }
        }
    }

    /// Every key can be taken, once the futures that are never polled again
    /// have cost it at most one lease each.
    fn take_every_key(&mut self) {
        for k in 0..KEYS {
            let on_key: Vec<&MFut> = self.model.futs.values().filter(|f| f.key == k).collect();
            // One that holds or awaits the key without a lease may keep it.
            let for_ever = on_key.iter().any(|f| {
                f.lease.is_none() && matches!(f.state, MState::Waiting | MState::Granted { .. })
            });
            let bound = on_key.len() + 2;
            let mut rounds = 0;
            loop {
                let want = self.model.try_lock(k, MMode::Exclusive, None, false);
                let expect = self.flush(false);
                let got = catch(|| self.table.try_lock(Key::new(k, false)));
                let panicked = got.as_ref().map(drop).map_err(|p| *p);
                self.expect_panic("final try_lock", panicked, expect);
                self.check_reentry("final try_lock");
                match (got, want) {
                    (Ok(Ok(g)), Ok(w)) => {
                        assert_eq!(g.token().get(), w.token, "final try_lock({k}): token");
                        self.model.release(w.gid);
                        let expect = self.flush(false);
                        let got = catch(|| drop(g));
                        self.expect_panic("final release", got, expect);
                        self.check_reentry("final release");
                        self.compare();
                        break;
                    }
                    // A wake of the lapse it settled panicked: it failed.
                    (Err(_), Err(MErr::WouldBlock)) | (Ok(Err(_)), Err(MErr::WouldBlock)) => {}
                    (got, want) => panic!(
                        "final try_lock({k}): crate {:?}, model {want:?}",
                        got.map(|r| r.map(|g| g.token()))
                    ),
                }
                self.compare();
                rounds += 1;
                assert!(
                    for_ever || rounds <= bound,
                    "key {k} is stranded: still not free after {rounds} leases"
                );
                if rounds > bound {
                    break;
                }
                self.advance(STRAND_STEP);
                self.compare();
            }
        }
    }
}

fn run(input: Input) {
    let cfg = TableCfg::from(input.config);
    let Settings {
        trace,
        loose_wakes,
        known_bugs,
        ..
    } = settings();
    if trace {
        eprintln!("config {cfg:?}");
    }
    let clock = ManualClock::new();
    let base = clock.now();
    let mut builder = LockTable::<Key>::builder()
        .hasher(KeyHash {
            collide: cfg.collide,
        })
        .clock(clock.clone())
        .shards(cfg.shards)
        .max_lease(ns(cfg.max_lease))
        .token_floor(cfg.token_floor)
        .fairness(if cfg.eventual {
            Fairness::Eventual
        } else {
            Fairness::Strict
        });
    if let Some(d) = cfg.default_lease {
        builder = builder.default_lease(ns(d));
    }
    let table = Arc::new(builder.build());
    REENTRY.with(|r| r.borrow_mut().clear());
    TABLE.with(|t| *t.borrow_mut() = Arc::downgrade(&table));
    let mut h = Harness {
        table: &table,
        clock: clock.clone(),
        base,
        futs: Vec::new(),
        abandoned: Vec::new(),
        guards: Vec::new(),
        model: Model::new(cfg, known_bugs),
        next_fid: 0,
        last_seen: [0; KEYS],
        handed_out: std::collections::HashSet::new(),
        tokens_seen: Vec::new(),
        trace,
        loose_wakes,
        known_bugs,
        timed: cfg.default_lease.is_some(),
        reads_at_build: clock.reads(),
        owners: owners::Owners::default(),
    };
    for op in input.ops.into_iter().take(MAX_OPS) {
        h.step(op);
        if trace {
            h.dump();
        }
        h.compare();
    }
    if trace {
        eprintln!("final phase");
    }
    // Every owner's call, then every owner; then every future that is
    // still polled, then every guard.
    h.owners_finish();
    while let Some(f) = h.futs.pop() {
        h.drop_future(f);
        h.compare();
    }
    while let Some(g) = h.guards.pop() {
        h.drop_guard(g, false);
        h.compare();
    }
    // No stranded key, whatever the futures that are never polled again.
    h.take_every_key();
    // Abandoned futures are dropped now; forgotten ones never are.
    for f in std::mem::take(&mut h.abandoned) {
        if f.fut.is_some() {
            h.drop_future(f);
        } else {
            // Its wakers' handles stay with the leaked future (and their
            // slots with them); the model keeps it.
            let HFut { waker, wakers, .. } = f;
            defused(|| drop(waker));
            for w in wakers {
                if WAKERS[w].handles.load(SeqCst) == 0 {
                    free_waker(w);
                }
            }
        }
        h.compare();
    }
    // Left: only what forgotten futures still hold.
    let forgotten_keys = h.model.len();
    assert_eq!(table.len(), forgotten_keys, "len() with everything dropped");
    assert_eq!(
        clock.sleepers(),
        h.model.armed_timers(false),
        "timers left armed"
    );
    assert_eq!(MStats::of(&table.stats()), h.model.stats, "final stats()");
    drop(h);
    TABLE.with(|t| *t.borrow_mut() = Weak::new());
    assert_eq!(
        Arc::strong_count(&table),
        1,
        "an owned guard or future leaked"
    );
    defused(|| {
        drop(table);
        drop(clock);
    });
}

/// Start-up, outside any run: what the runs keep for the whole process is
/// allocated here, so that a run frees as much as it allocates.
fn init() {
    install_hook();
    FREE_WAKERS.lock().unwrap().extend((0..SLOTS as u32).rev());
    RESERVE
        .lock()
        .unwrap()
        .extend((0..settings().forget_budget).map(|i| Box::new(i as u64)));
    REENTRY.with(|r| r.borrow_mut().reserve(4 * MAX_OPS));
}

fuzz_target!(init: init(), |input: Input| {
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| run(input))) {
        // A planted panic that escaped the harness's own `catch` is a bug of
        // the harness; anything else is the crate's (or a failed check).
        let what = p
            .downcast_ref::<Planted>()
            .map(|p| format!("planted panic in {} escaped", p.0))
            .unwrap_or_else(|| message(&*p));
        eprintln!("{what}");
        std::process::abort();
    }
});

/// waiting.rs `Leaving`: why a queued future leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MLeaving {
    Dropped,
    TimedOut,
    Lost,
}

