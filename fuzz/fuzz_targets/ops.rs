//! Differential fuzzing of one `LockTable` against a plain reference model.
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
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, Hash, Hasher};
use std::panic::{catch_unwind, panic_any, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use keylock::futures::{Lock, LockOwned, LockOwnedWith, LockWith, Lost};
use keylock::{
    Fairness, FencingToken, Guard, LockError, LockOptions, LockTable, ManualClock, OwnedGuard,
    Stats,
};
use libfuzzer_sys::fuzz_target;

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
    /// [`timeout_of`]; `with` forces `lock_with` even without options;
    /// `owned` uses the `Arc` variants; `waker`: see [`kind_of`].
    StartLock {
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
        with: bool,
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
    TryLock {
        key: u8,
        lease: Option<u8>,
        with: bool,
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
    /// Advance the clock by `(by % 8) * 100` µs (around the fairness deadline).
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

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

/// Bugs of the crate the harness can look past (`KEYLOCK_FUZZ_KNOWN_BUGS`:
/// `all`, or a comma-separated list of the names below), to fuzz beyond
/// them until they are fixed. See `fuzz/README.md`.
#[derive(Debug, Clone, Copy, Default)]
struct KnownBugs {
    /// `try_lock`: the caller's key dropped (panicking) after the grant was
    /// made, before the guard exists, leaks the grant.
    try_lock_key_drop: bool,
    /// A granted future completing drops its timer (and the clock's handle
    /// of its waker, which panics) before its guard exists: the grant leaks.
    timer_waker_drop: bool,
    /// Eventual fairness: the head taking a freed key with a lease does not
    /// nudge the next head to arm its timer.
    head_nudge: bool,
}

impl KnownBugs {
    fn from_env() -> Self {
        let Ok(v) = std::env::var("KEYLOCK_FUZZ_KNOWN_BUGS") else {
            return Self::default();
        };
        let all = v == "all" || v == "1";
        let has = |name: &str| all || v.split(',').any(|x| x.trim() == name);
        Self {
            try_lock_key_drop: has("try_lock_key_drop"),
            timer_waker_drop: has("timer_waker_drop"),
            head_nudge: has("head_nudge"),
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
}

#[derive(Debug, Default, Clone)]
struct MKey {
    holder: Option<MHolder>,
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
        self.holder.is_none() && self.queue.is_empty() && self.fenced == 0
    }
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
    /// The key instance it was given panics when dropped.
    bomb: bool,
    kind: WKind,
    /// The table holds its waker (its node is `ARMED`).
    slot: bool,
    /// Its timer: deadline, and whether a waker is registered with the clock.
    sleep: Option<(u64, bool)>,
    /// The holder deadline its timer covers, as last told under the lock
    /// (waiter.rs `timer_at`): every waiter arms for the holder it saw.
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
    /// Compatibility with a known bug (`KEYLOCK_FUZZ_KNOWN_BUGS`): it became
    /// the head of a leased holder without the nudge to arm its timer.
    missed_nudge: bool,
}

#[derive(Debug, Clone)]
struct MGuard {
    key: usize,
    token: u64,
    expires: Option<u64>,
    /// Its `lost()` future, if the harness keeps one.
    watch: Option<MWatch>,
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
}

#[derive(Debug, Clone, Copy)]
enum MPoll {
    Pending,
    Ready(Result<MGrant, MErr>),
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
    known_bugs: KnownBugs,
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
            known_bugs,
        }
    }

    fn live(&self, h: &MHolder) -> bool {
        h.deadline.is_none_or(|d| self.now < d)
    }

    fn live_holder(&self, k: usize) -> Option<MHolder> {
        self.keys[k].holder.filter(|h| self.live(h))
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

    fn new_guard(&mut self, k: usize, token: u64, deadline: Option<u64>) -> Gid {
        let gid = self.next_gid;
        self.next_gid += 1;
        self.guards.insert(
            gid,
            MGuard {
                key: k,
                token,
                expires: deadline,
                watch: None,
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
        let locked = self.live_holder(k).is_some();
        self.log.push(Reentry::IsLocked { key: k, locked });
        let saved = std::mem::take(&mut self.outbox);
        let got = self.try_lock(k, None, false);
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
            fut.missed_nudge = false;
            if fut.slot {
                fut.slot = false;
                self.wake(f);
            }
        }
    }

    /// queue.rs `nudge_head_for_timer`: the head is nudged only if the
    /// timer it armed would fire after the holder's deadline.
    fn nudge_head_for_timer(&mut self, k: usize) {
        let Some(deadline) = self.keys[k].holder.and_then(|h| h.deadline) else {
            return;
        };
        if let Some(&h) = self.keys[k].queue.front() {
            if self.futs[&h].timer_at.is_none_or(|at| at > deadline) {
                self.nudge_head(k);
            }
        }
    }

    /// queue.rs `hand_off`.
    fn hand_off(&mut self, k: usize) {
        assert!(self.keys[k].holder.is_none());
        let f = self.keys[k].queue.pop_front().expect("model: a waiter");
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(self.futs[&f].lease);
        let fut = self.fut(f);
        assert_eq!(fut.state, MState::Waiting, "model: queued future waits");
        fut.state = MState::Granted { token, deadline };
        fut.missed_nudge = false;
        let armed = std::mem::replace(&mut fut.slot, false);
        if armed {
            self.wake(f);
        }
        self.keys[k].holder = Some(MHolder {
            token,
            deadline,
            since,
            by: By::Slot(f),
        });
        self.stats.handoffs += 1;
        self.stats.acquisitions += 1;
        self.stats.contended += 1;
        self.nudge_head_for_timer(k);
    }

    /// queue.rs `pass_on`: the holder let go of a key with waiters.
    fn pass_on(&mut self, k: usize) {
        if self.cfg.eventual {
            self.read_clock = true;
            let s = shard_of(&self.cfg, k);
            match self.fair_at[s] {
                Some(at) if self.now < at => {
                    self.keys[k].holder = None;
                    self.nudge_head(k);
                    return;
                }
                _ => self.fair_at[s] = Some(self.now + EVENTUAL_BOUND),
            }
        }
        self.keys[k].holder = None;
        self.hand_off(k);
    }

    /// The holder loses the key (lapse or revocation): it is fenced, a
    /// granted future that has not run exactly like a guard; the key goes
    /// to the head.
    fn displace(&mut self, k: usize) -> Option<MHolder> {
        let h = self.keys[k].holder.take()?;
        self.keys[k].fenced += 1;
        if !self.keys[k].queue.is_empty() {
            self.hand_off(k);
        }
        // queue.rs `displace`: the grant's `Lost` futures.
        if let By::Guard(g) = h.by {
            self.wake_watch(g);
        }
        Some(h)
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
        self.guards.get_mut(&g).unwrap().watch = Some(MWatch::default());
    }

    /// lost.rs `Lost::poll`: `true` if it resolves (the grant lost its key).
    fn watch_poll(&mut self, g: Gid, wakes_now: u64) -> bool {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        let w = self.guards.get_mut(&g).unwrap().watch.as_mut().unwrap();
        w.wakes_at_poll = wakes_now;
        // queue.rs `watch_loss`: a lapse of its own grant it is about to
        // settle unregisters it first (no wake of its own).
        if self.keys[k]
            .holder
            .is_some_and(|h| h.token == token && !self.live(&h))
        {
            self.guards
                .get_mut(&g)
                .unwrap()
                .watch
                .as_mut()
                .unwrap()
                .armed = false;
        }
        self.settle(k);
        let now = self.now;
        let live = self.keys[k].holder.filter(|h| h.token == token);
        let w = self.guards.get_mut(&g).unwrap().watch.as_mut().unwrap();
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
                self.guards.get_mut(&g).unwrap().watch = None;
                true
            }
        }
    }

    /// Notices a lapse (only the operations that "touch" the key call this).
    fn settle(&mut self, k: usize) {
        if let Some(h) = self.keys[k].holder {
            if !self.live(&h) {
                self.displace(k);
                self.stats.expired += 1;
            }
        }
    }

    fn grant_to_guard(&mut self, k: usize, lease: Option<u64>, contended: bool) -> MGrant {
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(lease);
        self.stats.acquisitions += 1;
        if contended {
            self.stats.contended += 1;
        }
        let gid = self.new_guard(k, token, deadline);
        self.keys[k].holder = Some(MHolder {
            token,
            deadline,
            since,
            by: By::Guard(gid),
        });
        MGrant {
            gid,
            token,
            deadline,
        }
    }

    /// No entry: the key is created, and the caller's instance is kept.
    fn claim(&mut self, k: usize, lease: Option<u64>, bomb: bool) -> MGrant {
        assert!(self.keys[k].unused());
        self.keys[k].stored_bomb = bomb;
        self.grant_to_guard(k, lease, false)
    }

    /// queue.rs `try_acquire`; the caller's key is dropped unless kept.
    fn try_acquire(&mut self, k: usize, lease: Option<u64>, bomb: bool) -> Option<MGrant> {
        if self.keys[k].unused() {
            return Some(self.claim(k, lease, bomb));
        }
        self.bomb_keys += u32::from(bomb);
        self.settle(k);
        let key = &self.keys[k];
        if key.holder.is_some() || (!self.cfg.eventual && !key.queue.is_empty()) {
            return None;
        }
        Some(self.grant_to_guard(k, lease, false))
    }

    fn resolve(&self, lease: Option<u64>) -> Result<Option<u64>, u64> {
        match lease.or(self.cfg.default_lease) {
            Some(l) if !self.lease_valid(l) => Err(l),
            l => Ok(l),
        }
    }

    fn try_lock(&mut self, k: usize, lease: Option<u64>, bomb: bool) -> Result<MGrant, MErr> {
        match self.resolve(lease) {
            Err(l) => {
                self.bomb_keys += u32::from(bomb);
                Err(MErr::Invalid(l))
            }
            Ok(lease) => self.try_acquire(k, lease, bomb).ok_or(MErr::WouldBlock),
        }
    }

    /// A new future (not polled). With invalid options it drops the
    /// caller's key at once (the harness gives it a harmless one).
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        f: Fid,
        k: usize,
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
        self.futs.insert(
            f,
            MFut {
                key: k,
                lease,
                patience: timeout.map_or(MPat::Forever, MPat::For),
                state,
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
                missed_nudge: false,
            },
        );
    }

    fn arm_timer(&mut self, f: Fid, wake_at: Option<u64>) {
        let now = self.now;
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
        fut.sleep = at.map(|at| {
            assert!(at > now, "model: a timer is armed in the future only");
            (at, true)
        });
    }

    /// A granted future runs: it resolves to a guard of its grant, fenced or
    /// not (no lock is taken, nothing is settled or counted).
    fn observe_grant(&mut self, k: usize, f: Fid, token: u64, deadline: Option<u64>) -> MGrant {
        self.futs.remove(&f);
        let gid = self.new_guard(k, token, deadline);
        match self.keys[k].holder.as_mut() {
            Some(h) if h.by == By::Slot(f) => {
                assert_eq!(h.token, token);
                h.by = By::Guard(gid);
            }
            _ => assert!(self.keys[k].fenced > 0, "model: a fenced grant is counted"),
        }
        MGrant {
            gid,
            token,
            deadline,
        }
    }

    /// The head of a key freed under eventual fairness takes it.
    fn head_takes(&mut self, k: usize, f: Fid) -> MGrant {
        let head = self.keys[k].queue.pop_front();
        assert_eq!(head, Some(f));
        let lease = self.futs[&f].lease;
        self.futs.remove(&f);
        let g = self.grant_to_guard(k, lease, true);
        // The queue has a new head and the holder may have a lease: it must
        // arm its timer (as after a handoff).
        if self.known_bugs.head_nudge {
            let leased = self.keys[k].holder.is_some_and(|h| h.deadline.is_some());
            if let (true, Some(&h)) = (leased, self.keys[k].queue.front()) {
                self.fut(h).missed_nudge = true;
            }
        } else {
            self.nudge_head_for_timer(k);
        }
        g
    }

    fn poll(&mut self, f: Fid, wakes_now: u64) -> MPoll {
        let fut = self.fut(f);
        fut.wakes_at_poll = wakes_now;
        fut.missed_nudge = false;
        let k = fut.key;
        let now = self.now;
        match self.futs[&f].state {
            MState::Invalid(v) => {
                self.futs.remove(&f);
                MPoll::Ready(Err(MErr::Invalid(v)))
            }
            MState::Unpolled => {
                let MFut {
                    lease,
                    bomb,
                    patience,
                    ..
                } = self.futs[&f];
                if let MPat::For(Some(0)) = patience {
                    self.futs.remove(&f);
                    return MPoll::Ready(match self.try_acquire(k, lease, bomb) {
                        Some(g) => Ok(g),
                        None => {
                            let key = &self.keys[k];
                            let h = key.holder;
                            let ahead = key.queue.len();
                            self.stats.timed_out += 1;
                            Err(MErr::Timeout {
                                waited: 0,
                                holder: h.map(|h| h.token),
                                held_for: h.and_then(|h| h.since).map(|s| now - s),
                                ahead,
                            })
                        }
                    });
                }
                if self.keys[k].unused() {
                    self.futs.remove(&f);
                    return MPoll::Ready(Ok(self.claim(k, lease, bomb)));
                }
                self.bomb_keys += u32::from(bomb);
                self.settle(k);
                let key = &self.keys[k];
                if key.holder.is_none() && (self.cfg.eventual || key.queue.is_empty()) {
                    self.futs.remove(&f);
                    return MPoll::Ready(Ok(self.grant_to_guard(k, lease, false)));
                }
                self.keys[k].queue.push_back(f);
                let fut = self.fut(f);
                fut.state = MState::Waiting;
                // A timeout (even `Duration::MAX`, "for ever") boxes timer
                // state when the future first waits.
                fut.timing |= matches!(patience, MPat::For(_));
                fut.patience = match patience {
                    MPat::For(Some(t)) => MPat::Until {
                        start: now,
                        until: now + t,
                    },
                    _ => MPat::Forever,
                };
                fut.slot = true;
                let wake_at = self.keys[k].holder.and_then(|h| h.deadline);
                self.fut(f).timer_at = wake_at;
                self.arm_timer(f, wake_at);
                MPoll::Pending
            }
            MState::Granted { token, deadline } => {
                MPoll::Ready(Ok(self.observe_grant(k, f, token, deadline)))
            }
            MState::Waiting => {
                // Settled first: a wait past its timeout still takes the key
                // if it is its by now (a lapse handed it over, or a free key
                // at the head under eventual fairness); only then it gives up.
                self.settle(k);
                if let MState::Granted { token, deadline } = self.futs[&f].state {
                    return MPoll::Ready(Ok(self.observe_grant(k, f, token, deadline)));
                }
                let head = self.keys[k].queue.front() == Some(&f);
                if head && self.keys[k].holder.is_none() {
                    return MPoll::Ready(Ok(self.head_takes(k, f)));
                }
                if let MPat::Until { start, until } = self.futs[&f].patience {
                    if now >= until {
                        return self.time_out(k, f, start);
                    }
                }
                self.fut(f).slot = true;
                let wake_at = self.keys[k].holder.and_then(|h| h.deadline);
                self.fut(f).timer_at = wake_at;
                self.arm_timer(f, wake_at);
                MPoll::Pending
            }
        }
    }

    /// queue.rs `leave` with `timed_out` (after the poll's settle): the
    /// diagnosis of now.
    fn time_out(&mut self, k: usize, f: Fid, start: u64) -> MPoll {
        let ahead = self.keys[k]
            .queue
            .iter()
            .position(|&x| x == f)
            .expect("model: waiting future is queued");
        self.keys[k].queue.remove(ahead);
        self.futs.remove(&f);
        self.after_leaving(k, ahead == 0);
        self.stats.timed_out += 1;
        let h = self.keys[k].holder;
        let err = MErr::Timeout {
            waited: self.now - start,
            holder: h.map(|h| h.token),
            held_for: h.and_then(|h| h.since).map(|s| self.now - s),
            ahead,
        };
        self.remove_if_unused(k);
        MPoll::Ready(Err(err))
    }

    /// A waiter left the queue: a new head must arm its timer, or take a
    /// free key.
    fn after_leaving(&mut self, k: usize, was_head: bool) {
        if was_head {
            if self.keys[k].holder.is_none() {
                self.nudge_head(k);
            } else {
                self.nudge_head_for_timer(k);
            }
        }
    }

    fn remove_if_unused(&mut self, k: usize) {
        if self.keys[k].unused() {
            self.bomb_keys += u32::from(std::mem::take(&mut self.keys[k].stored_bomb));
        }
    }

    /// A future is dropped: queue.rs `leave` if it had queued.
    fn drop_fut(&mut self, f: Fid) {
        let fut = self.futs.remove(&f).expect("model: future exists");
        let k = fut.key;
        match fut.state {
            MState::Unpolled => self.bomb_keys += u32::from(fut.bomb),
            MState::Invalid(_) => {}
            MState::Waiting => {
                let at = self.keys[k].queue.iter().position(|&x| x == f).unwrap();
                self.keys[k].queue.remove(at);
                self.after_leaving(k, at == 0);
                self.stats.cancelled += 1;
                self.remove_if_unused(k);
            }
            MState::Granted { token, .. } => {
                self.stats.cancelled += 1;
                self.release_token(k, token);
            }
        }
    }

    /// queue.rs `release`: by token; a stale one frees nothing.
    fn release_token(&mut self, k: usize, token: u64) {
        match self.keys[k].holder {
            Some(h) if h.token == token => {
                if !self.keys[k].queue.is_empty() {
                    self.pass_on(k);
                    return;
                }
                self.keys[k].holder = None;
            }
            _ => {
                assert!(self.keys[k].fenced > 0, "model: fenced count");
                self.keys[k].fenced -= 1;
            }
        }
        self.remove_if_unused(k);
    }

    /// A guard drops.
    fn release(&mut self, g: Gid) {
        let guard = self.guards.remove(&g).expect("model: guard exists");
        if let Some(h) = self.keys[guard.key].holder {
            if h.by == By::Guard(g) {
                assert_eq!(h.token, guard.token);
            }
        }
        self.release_token(guard.key, guard.token);
    }

    fn check(&mut self, g: Gid) -> Result<u64, MErr> {
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.settle(k);
        match self.keys[k].holder {
            Some(h) if h.token == token => Ok(token),
            _ => Err(MErr::Expired(token)),
        }
    }

    fn renew(&mut self, g: Gid, lease: u64) -> Result<(), MErr> {
        if !self.lease_valid(lease) {
            return Err(MErr::Invalid(lease));
        }
        let (k, token) = (self.guards[&g].key, self.guards[&g].token);
        self.settle(k);
        let now = self.now;
        match self.keys[k].holder.as_mut() {
            Some(h) if h.token == token => {
                let before = h.deadline.replace(now + lease);
                h.since.get_or_insert(now);
                self.guards.get_mut(&g).unwrap().expires = Some(now + lease);
                self.nudge_head_for_timer(k);
                // queue.rs `renew`: an earlier (or first) deadline wakes the
                // grant's `Lost` futures to re-arm.
                if before.is_none_or(|b| now + lease < b) {
                    self.wake_watch(g);
                }
                Ok(())
            }
            _ => Err(MErr::Expired(token)),
        }
    }

    fn revoke(&mut self, k: usize) -> Option<u64> {
        if self.keys[k].unused() {
            return None;
        }
        if self.live_holder(k).is_none() {
            self.settle(k);
            return None;
        }
        let h = self.displace(k).unwrap();
        self.stats.revoked += 1;
        // The revoked guard's `expires_at()` reads the clock (it reports
        // the time of the call).
        self.read_clock = true;
        Some(h.token)
    }

    /// queue.rs `revoke_grant`: only grant `t`, if it is the live holder.
    fn revoke_grant(&mut self, k: usize, t: u64) -> bool {
        if self.keys[k].unused() {
            return false;
        }
        if self.live_holder(k).is_some_and(|h| h.token == t) {
            self.displace(k);
            self.stats.revoked += 1;
            self.read_clock = true;
            return true;
        }
        self.settle(k);
        false
    }

    /// What guard `g`'s `expires_at()` reports: its grant's deadline while
    /// it is the key's current grant (lapsed or not); once it lost the key,
    /// its deadline if that has passed, else the time of the call.
    fn expires_at(&self, g: Gid) -> Option<u64> {
        let guard = &self.guards[&g];
        match self.keys[guard.key].holder {
            Some(h) if h.token == guard.token => h.deadline,
            _ => Some(guard.expires.map_or(self.now, |d| d.min(self.now))),
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
            .holder
            .is_none_or(|h| h.token != guard.token || !self.live(&h))
    }

    /// Whether polling `f` now would change anything (so it must have been
    /// woken since it was last polled).
    fn can_progress(&self, f: Fid) -> bool {
        let fut = &self.futs[&f];
        let k = &self.keys[fut.key];
        if fut.tainted || fut.missed_nudge {
            return false;
        }
        match fut.state {
            MState::Granted { .. } => true,
            MState::Waiting => {
                let timed_out =
                    matches!(fut.patience, MPat::Until { until, .. } if self.now >= until);
                let head = k.queue.front() == Some(&f);
                let free = k.holder.is_none_or(|h| !self.live(&h));
                timed_out || (head && free)
            }
            MState::Unpolled | MState::Invalid(_) => false,
        }
    }

    /// The model's own invariants.
    fn self_check(&self) {
        for (i, key) in self.keys.iter().enumerate() {
            if !key.queue.is_empty() && key.holder.is_none() {
                assert!(self.cfg.eventual, "model: strict waiters imply a holder");
                let head = &self.futs[&key.queue[0]];
                assert!(
                    head.tainted || !head.slot,
                    "model: the head of a free key was nudged"
                );
            }
            for f in &key.queue {
                assert_eq!(self.futs[f].state, MState::Waiting);
                assert_eq!(self.futs[f].key, i);
            }
            let holder_token = key.holder.map(|h| h.token);
            let fenced_guards = self
                .guards
                .values()
                .filter(|g| g.key == i && Some(g.token) != holder_token)
                .count();
            let fenced_slots = self
                .futs
                .values()
                .filter(|f| {
                    f.key == i
                        && matches!(f.state, MState::Granted { token, .. } if Some(token) != holder_token)
                })
                .count();
            assert_eq!(
                fenced_guards + fenced_slots,
                key.fenced as usize,
                "model: fenced count of key {i}"
            );
            if let Some(h) = key.holder {
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
}

impl<'a> AnyFut<'a> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<AnyGuard<'a>, LockError>> {
        match self {
            AnyFut::Plain(f) => f.as_mut().poll(cx).map(|g| Ok(AnyGuard::B(g))),
            AnyFut::With(f) => f.as_mut().poll(cx).map(|r| r.map(AnyGuard::B)),
            AnyFut::Owned(f) => f.as_mut().poll(cx).map(|g| Ok(AnyGuard::O(g))),
            AnyFut::OwnedWith(f) => f.as_mut().poll(cx).map(|r| r.map(AnyGuard::O)),
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

    fn poll(&mut self) -> Poll<Result<AnyGuard<'a>, LockError>> {
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
            (LockError::Expired { token }, MErr::Expired(t)) => token.get() == t,
            (LockError::WouldBlock, MErr::WouldBlock) => true,
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
        let t = want.token;
        assert!(
            t > self.model.cfg.token_floor,
            "{what}: token {t} not above the floor"
        );
        assert!(
            self.handed_out.insert(t),
            "{what}: token {t} handed out twice in one table"
        );
        let current = self.model.keys[key].holder.is_some_and(|h| h.token == t);
        if current {
            assert!(
                t > self.last_seen[key],
                "{what}: fencing token did not increase for key {key}"
            );
            self.last_seen[key] = t;
        }
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
            } => self.start_lock(key, lease, timeout, with, owned, waker),
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
            }
            Op::DropFuture { fut } => {
                if !self.futs.is_empty() {
                    let f = self.futs.remove(usize::from(fut) % self.futs.len());
                    self.drop_future(f);
                }
            }
            Op::Forget { fut } => {
                if !self.futs.is_empty() && self.abandoned.len() < MAX_ABANDONED {
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
                if !self.guards.is_empty() {
                    let g = self.guards.remove(usize::from(guard) % self.guards.len());
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
                self.try_lock(k, lease.map(lease_of), with, owned, bomb);
            }
            Op::Renew { guard, lease } => {
                if !self.guards.is_empty() {
                    let i = usize::from(guard) % self.guards.len();
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
                if !self.guards.is_empty() {
                    self.check_guard(usize::from(guard) % self.guards.len());
                }
            }
            Op::CheckAll => {
                let mut live = [0; KEYS];
                for i in 0..self.guards.len() {
                    if self.check_guard(i) == Some(true) {
                        live[self.guards[i].guard.key()] += 1;
                    }
                }
                for (k, n) in live.iter().enumerate() {
                    assert!(*n <= 1, "{n} guards of key {k} pass check() at once");
                }
            }
            Op::Advance { by } => self.advance(u64::from(by % 16) * UNIT),
            Op::AdvanceMicros { by } => self.advance(u64::from(by % 8) * 100_000),
            Op::AdvanceNanos { by } if by & 0x80 != 0 => {
                if !self.guards.is_empty() {
                    let i = usize::from((by >> 3) & 7) % self.guards.len();
                    self.watch(i, by & 0x40 != 0);
                }
            }
            Op::AdvanceNanos { by } => self.advance(u64::from(by % 8)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start_lock(
        &mut self,
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
        with: bool,
        owned: bool,
        waker: u8,
    ) {
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
        let mut opts = LockOptions::new();
        if let Some(l) = lease {
            opts = opts.lease(ns(l));
        }
        if let Some(t) = timeout {
            opts = opts.timeout(t.map_or(Duration::MAX, ns));
        }
        let id = self.next_fid;
        self.next_fid += 1;
        self.model.start(id, k, lease, timeout, bomb, kind);
        let table = self.table;
        let fut = match catch(|| {
            let key = Key::new(k, bomb);
            match (plain, owned) {
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

    fn try_lock(&mut self, k: usize, lease: Option<u64>, with: bool, owned: bool, bomb: bool) {
        self.timed |= lease.is_some();
        let mut opts = LockOptions::new();
        if let Some(l) = lease {
            opts = opts.lease(ns(l));
        }
        let want = self.model.try_lock(k, lease, bomb);
        let expect = self.flush(false);
        let table = self.table;
        let got = catch(|| -> Result<AnyGuard<'a>, LockError> {
            let key = Key::new(k, bomb);
            match (with || lease.is_some(), owned) {
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
                assert_eq!(err, LockError::Expired { token }, "Lost of guard {gid}");
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
        let candidates: Vec<FencingToken> = self
            .guards
            .iter()
            .map(|g| g.guard.token())
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
        let want = self.model.poll(id, wakes);
        // A waker's own `clone` or `drop` may panic anywhere in the poll:
        // before the poll's deferred work (which then runs while unwinding:
        // no panics, no calls back into the table) or within it.
        let may = kind.own_bomb();
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
                        if let Ok(w) = r {
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
            (Poll::Ready(Ok(g)), MPoll::Ready(Ok(w))) => {
                self.accept_guard("poll", g, w, k);
                let f = self.futs.remove(i);
                self.retire(f);
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
                got.map(|r| r.map(|g| g.token()))
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
                    "  key {k}: holder {:?} queue {:?} fenced {}",
                    key.holder, key.queue, key.fenced
                );
            }
        }
        for (id, f) in &m.futs {
            eprintln!(
                "  fut {id}: key {} {:?} {:?} slot {} sleep {:?} wakes {}{}{}",
                f.key,
                f.state,
                f.kind,
                f.slot,
                f.sleep,
                f.wakes,
                if f.tainted { " tainted" } else { "" },
                if f.abandoned { " abandoned" } else { "" },
            );
        }
    }

    /// Compares everything observable without side effects.
    fn compare(&self) {
        self.model.self_check();
        self.table.assert_consistent();
        for k in 0..KEYS {
            let key = k as u8;
            assert_eq!(
                self.table.is_locked(&key),
                self.model.live_holder(k).is_some(),
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
            if !self.loose_wakes && !m.tainted && !m.missed_nudge {
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
                let want = self.model.try_lock(k, None, false);
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
    // Drop every future that is still polled, then every guard.
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
