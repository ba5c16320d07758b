//! Differential fuzzing of one `LockTable` against a plain reference model.
//!
//! Every future is polled by hand with its own counting waker, and time is a
//! `ManualClock`, so a run is fully deterministic. After every step the
//! harness compares the table with the model (`is_locked`, `waiters`, `len`,
//! `stats`, armed timers, every waker's wake count and handle count) and
//! checks the liveness rule that a future able to make progress has been
//! woken since it was last polled. See `fuzz/README.md`.

#![no_main]

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use keylock::futures::{Lock, LockOwned, LockOwnedWith, LockWith};
use keylock::{
    FencingToken, Guard, LockError, LockOptions, LockTable, ManualClock, OwnedGuard, Stats,
};
use libfuzzer_sys::fuzz_target;

/// Keys are `0..KEYS`.
const KEYS: usize = 4;
/// One time unit of the inputs: a millisecond, in nanoseconds.
const UNIT: u64 = 1_000_000;
const MAX_OPS: usize = 256;
/// Live (not yet completed) futures at once.
const MAX_FUTS: usize = 12;
/// The hash every key gets in "collide" mode.
const COLLIDE_HASH: u64 = 0x0123_4567_89ab_cdef;

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
    /// 1, 2 or 4 shards.
    shards: u8,
    /// Every key gets the same hash (one shard, one hash bucket chain).
    collide: bool,
    /// The table's default lease, in units (clamped to `1..=max`).
    default_lease: Option<u8>,
    /// The table's maximum lease, in units (`1..=8`); `None` = the crate's default.
    max_lease: Option<u8>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    /// Create a lock future (not polled yet). `lease`: see [`lease_of`];
    /// `timeout`: see [`timeout_of`]. `with` forces `lock_with` even
    /// without options; `owned` uses the `Arc` variants.
    StartLock {
        key: u8,
        lease: Option<u8>,
        timeout: Option<u8>,
        with: bool,
        owned: bool,
    },
    Poll {
        fut: u8,
    },
    /// Poll with a new waker: the table and the timer must drop the old one.
    PollNewWaker {
        fut: u8,
    },
    /// Poll, in order, every future woken since it was last polled.
    PollWoken,
    DropFuture {
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
    /// Advance the clock by `by % 8` nanoseconds (to land beside deadlines).
    AdvanceNanos {
        by: u8,
    },
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

fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
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
        let k = u64::from(k);
        // Bits 32.. pick the shard (`(hash >> 32) & mask`): the shard is
        // `k & mask`. Low bits and the top seven (hashbrown's tag) differ too.
        self.h = if self.collide {
            COLLIDE_HASH
        } else {
            (k << 57) | (k << 32) | k.wrapping_mul(0x9e37_79b9)
        };
    }
}

fn shard_of(cfg: &TableCfg, k: usize) -> usize {
    let hash = if cfg.collide {
        COLLIDE_HASH
    } else {
        let k = k as u64;
        (k << 57) | (k << 32) | k.wrapping_mul(0x9e37_79b9)
    };
    (hash >> 32) as usize & (cfg.shards - 1)
}

type Table = LockTable<u8, KeyHash>;

#[derive(Debug, Clone, Copy)]
struct TableCfg {
    shards: usize,
    collide: bool,
    default_lease: Option<u64>,
    max_lease: u64,
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
            collide: c.collide,
            default_lease,
            max_lease,
        }
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

#[derive(Debug, Default)]
struct MKey {
    holder: Option<MHolder>,
    queue: VecDeque<Fid>,
    /// Guards that lost the key and still exist.
    fenced: u32,
    last_token: u64,
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
    Granted(u64),
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

#[derive(Debug)]
struct MFut {
    key: usize,
    lease: Option<u64>,
    patience: MPat,
    state: MState,
    /// The table holds its waker in its slot.
    slot_waker: bool,
    /// Its timer: deadline, and whether a waker is registered with the clock.
    sleep: Option<(u64, bool)>,
    /// Wakes the model expects it to have received.
    wakes: u64,
    /// Wakes it had received when it was last polled.
    wakes_at_poll: u64,
}

#[derive(Debug)]
struct MGuard {
    key: usize,
    token: u64,
    expires: Option<u64>,
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

#[derive(Debug)]
enum MPoll {
    Pending,
    Ready(Result<MGrant, MErr>),
}

#[derive(Debug)]
struct Model {
    cfg: TableCfg,
    now: u64,
    keys: [MKey; KEYS],
    futs: BTreeMap<Fid, MFut>,
    guards: BTreeMap<Gid, MGuard>,
    shard_tokens: [u64; 4],
    stats: MStats,
    next_gid: Gid,
}

impl Model {
    fn new(cfg: TableCfg) -> Self {
        Self {
            cfg,
            now: 0,
            keys: Default::default(),
            futs: BTreeMap::new(),
            guards: BTreeMap::new(),
            shard_tokens: [0; 4],
            stats: MStats::default(),
            next_gid: 0,
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

    fn mint(&mut self, k: usize) -> u64 {
        let s = shard_of(&self.cfg, k);
        self.shard_tokens[s] += 1;
        let t = self.shard_tokens[s];
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
            },
        );
        gid
    }

    /// queue.rs `wake_head_for_timer`.
    fn wake_head_for_timer(&mut self, k: usize) {
        let leased = self.keys[k].holder.is_some_and(|h| h.deadline.is_some());
        if let (true, Some(&f)) = (leased, self.keys[k].queue.front()) {
            let fut = self.fut(f);
            if fut.slot_waker {
                fut.wakes += 1;
            }
        }
    }

    /// queue.rs `grant_head`.
    fn grant_head(&mut self, k: usize) {
        assert!(self.keys[k].holder.is_none());
        let Some(f) = self.keys[k].queue.pop_front() else {
            return;
        };
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(self.futs[&f].lease);
        let fut = self.fut(f);
        assert_eq!(fut.state, MState::Waiting, "model: queued future waits");
        fut.state = MState::Granted(token);
        if fut.slot_waker {
            fut.slot_waker = false;
            fut.wakes += 1;
        }
        self.keys[k].holder = Some(MHolder {
            token,
            deadline,
            since,
            by: By::Slot(f),
        });
        self.stats.handoffs += 1;
        self.wake_head_for_timer(k);
    }

    /// The holder loses the key (lapse or revocation): a guard is fenced, an
    /// unobserved grant goes back to the tail; the key goes to the head.
    fn displace(&mut self, k: usize) -> Option<MHolder> {
        let h = self.keys[k].holder.take()?;
        match h.by {
            By::Guard(_) => self.keys[k].fenced += 1,
            By::Slot(f) => {
                self.keys[k].queue.push_back(f);
                self.fut(f).state = MState::Waiting;
            }
        }
        self.grant_head(k);
        Some(h)
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

    fn take_free(&mut self, k: usize, lease: Option<u64>) -> MGrant {
        assert!(self.keys[k].holder.is_none() && self.keys[k].queue.is_empty());
        let token = self.mint(k);
        let (deadline, since) = self.lease_from(lease);
        self.stats.acquisitions += 1;
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

    fn try_acquire(&mut self, k: usize, lease: Option<u64>) -> Option<MGrant> {
        self.settle(k);
        if self.keys[k].holder.is_some() {
            None
        } else {
            Some(self.take_free(k, lease))
        }
    }

    fn try_lock(&mut self, k: usize, lease: Option<u64>) -> Result<MGrant, MErr> {
        let lease = lease.or(self.cfg.default_lease);
        if let Some(l) = lease.filter(|&l| !self.lease_valid(l)) {
            return Err(MErr::Invalid(l));
        }
        self.try_acquire(k, lease).ok_or(MErr::WouldBlock)
    }

    fn start(&mut self, f: Fid, k: usize, lease: Option<u64>, timeout: Option<Option<u64>>) {
        let lease = lease.or(self.cfg.default_lease);
        let (state, lease) = match lease {
            Some(l) if !self.lease_valid(l) => (MState::Invalid(l), None),
            l => (MState::Unpolled, l),
        };
        self.futs.insert(
            f,
            MFut {
                key: k,
                lease,
                patience: timeout.map_or(MPat::Forever, MPat::For),
                state,
                slot_waker: false,
                sleep: None,
                wakes: 0,
                wakes_at_poll: 0,
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
        fut.sleep = at.map(|at| {
            assert!(at > now, "model: a timer is armed in the future only");
            (at, true)
        });
    }

    /// queue.rs `poll_slot`.
    fn poll_slot(&mut self, k: usize, f: Fid) -> Result<MGrant, Option<u64>> {
        self.settle(k);
        match self.futs[&f].state {
            MState::Granted(token) => {
                let h = self.keys[k]
                    .holder
                    .expect("model: granted key has a holder");
                assert_eq!(h.by, By::Slot(f));
                assert_eq!(h.token, token);
                let gid = self.new_guard(k, token, h.deadline);
                self.keys[k].holder.as_mut().unwrap().by = By::Guard(gid);
                self.stats.acquisitions += 1;
                self.stats.contended += 1;
                self.futs.remove(&f);
                Ok(MGrant {
                    gid,
                    token,
                    deadline: h.deadline,
                })
            }
            MState::Waiting => {
                self.fut(f).slot_waker = true;
                let head = self.keys[k].queue.front() == Some(&f);
                Err(if head {
                    self.keys[k].holder.and_then(|h| h.deadline)
                } else {
                    None
                })
            }
            s => unreachable!("model: poll_slot in state {s:?}"),
        }
    }

    fn poll(&mut self, f: Fid, wakes_now: u64) -> MPoll {
        self.fut(f).wakes_at_poll = wakes_now;
        let k = self.futs[&f].key;
        let now = self.now;
        match self.futs[&f].state {
            MState::Invalid(v) => {
                self.futs.remove(&f);
                MPoll::Ready(Err(MErr::Invalid(v)))
            }
            MState::Unpolled => {
                if let MPat::For(t) = self.futs[&f].patience {
                    self.fut(f).patience = match t {
                        Some(t) => MPat::Until {
                            start: now,
                            until: now + t,
                        },
                        None => MPat::Forever,
                    };
                    if t == Some(0) {
                        let lease = self.futs[&f].lease;
                        self.futs.remove(&f);
                        return MPoll::Ready(match self.try_acquire(k, lease) {
                            Some(g) => Ok(g),
                            None => {
                                let h = self.keys[k].holder.unwrap();
                                self.stats.timed_out += 1;
                                Err(MErr::Timeout {
                                    waited: 0,
                                    holder: Some(h.token),
                                    held_for: h.since.map(|s| now - s),
                                    ahead: self.keys[k].queue.len(),
                                })
                            }
                        });
                    }
                }
                self.settle(k);
                if self.keys[k].holder.is_none() {
                    let lease = self.futs[&f].lease;
                    self.futs.remove(&f);
                    return MPoll::Ready(Ok(self.take_free(k, lease)));
                }
                self.keys[k].queue.push_back(f);
                let fut = self.fut(f);
                fut.state = MState::Waiting;
                fut.slot_waker = true;
                let wake_at = if self.keys[k].queue.front() == Some(&f) {
                    self.keys[k].holder.and_then(|h| h.deadline)
                } else {
                    None
                };
                self.arm_timer(f, wake_at);
                MPoll::Pending
            }
            MState::Waiting | MState::Granted(_) => {
                let gave_up = match self.futs[&f].patience {
                    MPat::Until { until, .. } => now >= until,
                    _ => false,
                };
                if gave_up {
                    let MPat::Until { start, .. } = self.futs[&f].patience else {
                        unreachable!()
                    };
                    match self.time_out_slot(k, f) {
                        Ok(g) => MPoll::Ready(Ok(g)),
                        Err((holder, held_for, ahead)) => MPoll::Ready(Err(MErr::Timeout {
                            waited: now - start,
                            holder,
                            held_for,
                            ahead,
                        })),
                    }
                } else {
                    match self.poll_slot(k, f) {
                        Ok(g) => MPoll::Ready(Ok(g)),
                        Err(wake_at) => {
                            self.arm_timer(f, wake_at);
                            MPoll::Pending
                        }
                    }
                }
            }
        }
    }

    /// queue.rs `time_out_slot`.
    #[allow(clippy::type_complexity)]
    fn time_out_slot(
        &mut self,
        k: usize,
        f: Fid,
    ) -> Result<MGrant, (Option<u64>, Option<u64>, usize)> {
        if let Ok(g) = self.poll_slot(k, f) {
            return Ok(g);
        }
        let ahead = self.keys[k]
            .queue
            .iter()
            .position(|&x| x == f)
            .expect("model: waiting future is queued");
        self.keys[k].queue.remove(ahead);
        if ahead == 0 {
            self.wake_head_for_timer(k);
        }
        let h = self.keys[k].holder;
        self.stats.timed_out += 1;
        self.futs.remove(&f);
        Err((
            h.map(|h| h.token),
            h.and_then(|h| h.since).map(|s| self.now - s),
            ahead,
        ))
    }

    /// A future is dropped: queue.rs `cancel_slot` if it had a slot.
    fn drop_fut(&mut self, f: Fid) {
        let fut = self.futs.remove(&f).expect("model: future exists");
        let k = fut.key;
        match fut.state {
            MState::Unpolled | MState::Invalid(_) => return,
            MState::Waiting => {
                let at = self.keys[k].queue.iter().position(|&x| x == f).unwrap();
                self.keys[k].queue.remove(at);
                if at == 0 {
                    self.wake_head_for_timer(k);
                }
            }
            MState::Granted(token) => {
                let h = self.keys[k]
                    .holder
                    .take()
                    .expect("model: granted key has a holder");
                assert_eq!((h.by, h.token), (By::Slot(f), token));
                self.grant_head(k);
            }
        }
        self.stats.cancelled += 1;
    }

    /// queue.rs `release`: the guard drops.
    fn release(&mut self, g: Gid) {
        let guard = self.guards.remove(&g).expect("model: guard exists");
        let k = guard.key;
        match self.keys[k].holder {
            Some(h) if h.token == guard.token => {
                assert_eq!(h.by, By::Guard(g));
                self.keys[k].holder = None;
                self.grant_head(k);
            }
            _ => {
                assert!(self.keys[k].fenced > 0, "model: fenced count");
                self.keys[k].fenced -= 1;
            }
        }
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
                h.deadline = Some(now + lease);
                h.since.get_or_insert(now);
                self.guards.get_mut(&g).unwrap().expires = Some(now + lease);
                self.wake_head_for_timer(k);
                Ok(())
            }
            _ => Err(MErr::Expired(token)),
        }
    }

    fn revoke(&mut self, k: usize) -> Option<u64> {
        if self.live_holder(k).is_none() {
            self.settle(k);
            return None;
        }
        let h = self.displace(k).unwrap();
        self.stats.revoked += 1;
        Some(h.token)
    }

    fn advance(&mut self, by: u64) {
        self.now += by;
        let now = self.now;
        for fut in self.futs.values_mut() {
            if let Some((at, armed @ true)) = &mut fut.sleep {
                if *at <= now {
                    *armed = false;
                    fut.wakes += 1;
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.keys.iter().filter(|k| !k.unused()).count()
    }

    fn armed_timers(&self) -> usize {
        self.futs
            .values()
            .filter(|f| matches!(f.sleep, Some((_, true))))
            .count()
    }

    /// Whether polling `f` now would change anything (so it must have been
    /// woken since it was last polled).
    fn can_progress(&self, f: Fid) -> bool {
        let fut = &self.futs[&f];
        let k = &self.keys[fut.key];
        match fut.state {
            MState::Granted(_) => true,
            MState::Waiting => {
                let timed_out =
                    matches!(fut.patience, MPat::Until { until, .. } if self.now >= until);
                let head_of_lapsed =
                    k.queue.front() == Some(&f) && k.holder.is_some_and(|h| !self.live(&h));
                timed_out || head_of_lapsed
            }
            MState::Unpolled | MState::Invalid(_) => false,
        }
    }

    /// The model's own invariants.
    fn self_check(&self) {
        for (i, key) in self.keys.iter().enumerate() {
            if !key.queue.is_empty() {
                assert!(key.holder.is_some(), "model: waiters imply a holder");
            }
            for f in &key.queue {
                assert_eq!(self.futs[f].state, MState::Waiting);
                assert_eq!(self.futs[f].key, i);
            }
            let fenced = self
                .guards
                .iter()
                .filter(|(g, mg)| mg.key == i && key.holder.is_none_or(|h| h.by != By::Guard(**g)))
                .count();
            assert_eq!(
                fenced, key.fenced as usize,
                "model: fenced count of key {i}"
            );
            if let Some(h) = key.holder {
                match h.by {
                    By::Guard(g) => assert_eq!(self.guards[&g].token, h.token),
                    By::Slot(f) => assert_eq!(self.futs[&f].state, MState::Granted(h.token)),
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The real thing
// ---------------------------------------------------------------------------

/// A waker that counts its wakes. Its handles are counted by the `Arc`.
struct Counter(AtomicU64);

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

enum AnyFut<'a> {
    Plain(Lock<'a, u8, KeyHash>),
    With(LockWith<'a, u8, KeyHash>),
    Owned(LockOwned<u8, KeyHash>),
    OwnedWith(LockOwnedWith<u8, KeyHash>),
}

enum AnyGuard<'a> {
    B(Guard<'a, u8, KeyHash>),
    O(OwnedGuard<u8, KeyHash>),
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
    fn key(&self) -> u8 {
        on_guard!(self, |g| *g.key())
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
    fut: AnyFut<'a>,
    /// The counter behind `waker`, the waker of the latest poll.
    counter: Arc<Counter>,
    waker: Waker,
    /// Counters of the wakers it was polled with before.
    old: Vec<Arc<Counter>>,
}

fn counting_waker() -> (Arc<Counter>, Waker) {
    let counter = Arc::new(Counter(AtomicU64::new(0)));
    let waker = Waker::from(Arc::clone(&counter));
    (counter, waker)
}

impl<'a> HFut<'a> {
    /// Wakes received, through any of its wakers.
    fn wakes(&self) -> u64 {
        self.counter.0.load(SeqCst) + self.old.iter().map(|c| c.0.load(SeqCst)).sum::<u64>()
    }

    fn new_waker(&mut self) {
        let (counter, waker) = counting_waker();
        self.waker = waker;
        let old = std::mem::replace(&mut self.counter, counter);
        self.old.push(old);
    }

    /// No handle of a replaced waker may be kept.
    fn check_old_wakers(&self) {
        for c in &self.old {
            assert_eq!(
                Arc::strong_count(c),
                1,
                "future {}: a replaced waker is still held",
                self.id
            );
        }
    }

    fn poll(&mut self) -> Poll<Result<AnyGuard<'a>, LockError>> {
        let mut cx = Context::from_waker(&self.waker);
        match &mut self.fut {
            AnyFut::Plain(f) => Pin::new(f).poll(&mut cx).map(|g| Ok(AnyGuard::B(g))),
            AnyFut::With(f) => Pin::new(f).poll(&mut cx).map(|r| r.map(AnyGuard::B)),
            AnyFut::Owned(f) => Pin::new(f).poll(&mut cx).map(|g| Ok(AnyGuard::O(g))),
            AnyFut::OwnedWith(f) => Pin::new(f).poll(&mut cx).map(|r| r.map(AnyGuard::O)),
        }
    }
}

struct HGuard<'a> {
    id: Gid,
    guard: AnyGuard<'a>,
}

struct Harness<'a> {
    table: &'a Arc<Table>,
    clock: ManualClock,
    base: Instant,
    futs: Vec<HFut<'a>>,
    guards: Vec<HGuard<'a>>,
    model: Model,
    next_fid: Fid,
    /// Per key, the last token seen by the harness (from any guard).
    last_seen: [u64; KEYS],
    trace: bool,
    /// A lease or a timeout has been asked for (or the table has a default
    /// lease): until then the table must never read its clock.
    timed: bool,
    /// `ManualClock::reads()` once the table was built (building reads it).
    reads_at_build: u64,
    /// Check only the no-lost-wakeup rule, not exact wake counts
    /// (`KEYLOCK_FUZZ_LOOSE_WAKES`, to test the harness itself).
    loose_wakes: bool,
}

fn key_of(k: u8) -> usize {
    usize::from(k) % KEYS
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

    /// A guard the crate handed out: it must be the model's grant.
    fn accept_guard(&mut self, what: &str, guard: AnyGuard<'a>, want: MGrant, key: usize) {
        assert_eq!(guard.key() as usize, key, "{what}: guard of the wrong key");
        assert_eq!(guard.token().get(), want.token, "{what}: token");
        assert!(
            guard.token().get() > self.last_seen[key],
            "{what}: fencing token did not increase for key {key}"
        );
        self.last_seen[key] = guard.token().get();
        assert_eq!(
            guard.expires_at(),
            want.deadline.map(|d| self.at(d)),
            "{what}: expires_at"
        );
        if let Some(d) = want.deadline {
            assert!(d > self.model.now, "{what}: resolved to a lapsed grant");
        }
        self.guards.push(HGuard {
            id: want.gid,
            guard,
        });
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
            } => {
                if self.futs.len() >= MAX_FUTS {
                    return;
                }
                let k = key_of(key);
                let lease = lease.map(lease_of);
                let timeout = timeout.map(timeout_of);
                self.timed |= lease.is_some() || timeout.is_some();
                let plain = !with && lease.is_none() && timeout.is_none();
                let mut opts = LockOptions::new();
                if let Some(l) = lease {
                    opts = opts.lease(ns(l));
                }
                if let Some(t) = timeout {
                    opts = opts.timeout(t.map_or(Duration::MAX, ns));
                }
                let table = self.table;
                let fut = match (plain, owned) {
                    (true, false) => AnyFut::Plain(table.lock(k as u8)),
                    (true, true) => AnyFut::Owned(Arc::clone(table).lock_owned(k as u8)),
                    (false, false) => AnyFut::With(table.lock_with(k as u8, opts)),
                    (false, true) => {
                        AnyFut::OwnedWith(Arc::clone(table).lock_owned_with(k as u8, opts))
                    }
                };
                let id = self.next_fid;
                self.next_fid += 1;
                let (counter, waker) = counting_waker();
                self.futs.push(HFut {
                    id,
                    fut,
                    counter,
                    waker,
                    old: Vec::new(),
                });
                self.model.start(id, k, lease, timeout);
            }
            Op::Poll { fut } => {
                if !self.futs.is_empty() {
                    self.poll_at(usize::from(fut) % self.futs.len());
                }
            }
            Op::PollNewWaker { fut } => {
                if !self.futs.is_empty() {
                    let i = usize::from(fut) % self.futs.len();
                    self.futs[i].new_waker();
                    let id = self.futs[i].id;
                    self.poll_at(i);
                    if let Some(f) = self.futs.iter().find(|f| f.id == id) {
                        f.check_old_wakers();
                    }
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
                        self.poll_at(i);
                    }
                }
            }
            Op::DropFuture { fut } => {
                if !self.futs.is_empty() {
                    let f = self.futs.remove(usize::from(fut) % self.futs.len());
                    self.model.drop_fut(f.id);
                    self.retire(f);
                }
            }
            Op::DropGuard { guard } | Op::ReleaseGuard { guard } => {
                if !self.guards.is_empty() {
                    let g = self.guards.remove(usize::from(guard) % self.guards.len());
                    self.model.release(g.id);
                    if matches!(op, Op::DropGuard { .. }) {
                        drop(g.guard);
                    } else {
                        g.guard.release();
                    }
                }
            }
            Op::TryLock {
                key,
                lease,
                with,
                owned,
            } => {
                let k = key_of(key);
                let lease = lease.map(lease_of);
                self.timed |= lease.is_some();
                let mut opts = LockOptions::new();
                if let Some(l) = lease {
                    opts = opts.lease(ns(l));
                }
                let table = self.table;
                let got: Result<AnyGuard<'a>, LockError> = match (with || lease.is_some(), owned) {
                    (false, false) => table
                        .try_lock(k as u8)
                        .map(AnyGuard::B)
                        .map_err(LockError::from),
                    (false, true) => Arc::clone(table)
                        .try_lock_owned(k as u8)
                        .map(AnyGuard::O)
                        .map_err(LockError::from),
                    (true, false) => table.try_lock_with(k as u8, opts).map(AnyGuard::B),
                    (true, true) => Arc::clone(table)
                        .try_lock_owned_with(k as u8, opts)
                        .map(AnyGuard::O),
                };
                let want = self.model.try_lock(k, lease);
                match (got, want) {
                    (Ok(g), Ok(w)) => self.accept_guard("try_lock", g, w, k),
                    (Err(e), Err(w)) => self.expect_err("try_lock", &e, w),
                    (got, want) => panic!(
                        "try_lock({k}): crate {:?}, model {want:?}",
                        got.map(|g| g.token())
                    ),
                }
            }
            Op::Renew { guard, lease } => {
                if !self.guards.is_empty() {
                    let i = usize::from(guard) % self.guards.len();
                    let lease = lease_of(lease);
                    self.timed = true;
                    let got = self.guards[i].guard.renew(ns(lease));
                    let want = self.model.renew(self.guards[i].id, lease);
                    match (&got, want) {
                        (Ok(()), Ok(())) => {}
                        (Err(e), Err(w)) => self.expect_err("renew", e, w),
                        _ => panic!("renew: crate {got:?}, model {want:?}"),
                    }
                    let g = &self.guards[i];
                    let want = self.model.guards[&g.id].expires.map(|d| self.at(d));
                    assert_eq!(g.guard.expires_at(), want, "expires_at after renew");
                }
            }
            Op::Revoke { key } => {
                let k = key_of(key);
                let got = self.table.revoke(&(k as u8)).map(FencingToken::get);
                let want = self.model.revoke(k);
                assert_eq!(got, want, "revoke({k})");
            }
            Op::Check { guard } => {
                if !self.guards.is_empty() {
                    self.check_guard(usize::from(guard) % self.guards.len());
                }
            }
            Op::CheckAll => {
                let mut live = [0; KEYS];
                for i in 0..self.guards.len() {
                    if self.check_guard(i) {
                        live[self.guards[i].guard.key() as usize] += 1;
                    }
                }
                for (k, n) in live.iter().enumerate() {
                    assert!(*n <= 1, "{n} guards of key {k} pass check() at once");
                }
            }
            Op::Advance { by } => {
                let by = u64::from(by % 16) * UNIT;
                self.model.advance(by);
                self.clock.advance(ns(by));
            }
            Op::AdvanceNanos { by } => {
                let by = u64::from(by % 8);
                self.model.advance(by);
                self.clock.advance(ns(by));
            }
        }
    }

    /// `is_expired()` then `check()` on guard `i`; true if it is live.
    fn check_guard(&mut self, i: usize) -> bool {
        let g = &self.guards[i];
        let expired = g.guard.is_expired();
        let want = self.model.check(g.id);
        assert_eq!(expired, want.is_err(), "is_expired() of guard {}", g.id);
        let got = g.guard.check();
        let want = self.model.check(g.id);
        match (&got, want) {
            (Ok(t), Ok(w)) => assert_eq!(t.get(), w, "check() token"),
            (Err(e), Err(w)) => self.expect_err("check", e, w),
            _ => panic!("check() of guard {}: crate {got:?}, model {want:?}", g.id),
        }
        assert_eq!(expired, got.is_err(), "is_expired() == check().is_err()");
        let want = self.model.guards[&g.id].expires.map(|d| self.at(d));
        assert_eq!(g.guard.expires_at(), want, "expires_at");
        got.is_ok()
    }

    fn poll_at(&mut self, i: usize) {
        let id = self.futs[i].id;
        let k = self.model.futs[&id].key;
        let wakes = self.futs[i].wakes();
        let want = self.model.poll(id, wakes);
        let got = match self.futs[i].poll() {
            Poll::Pending => None,
            Poll::Ready(r) => Some(r),
        };
        match (got, want) {
            (None, MPoll::Pending) => {}
            (Some(Ok(g)), MPoll::Ready(Ok(w))) => {
                self.accept_guard("poll", g, w, k);
                let f = self.futs.remove(i);
                self.retire(f);
            }
            (Some(Err(e)), MPoll::Ready(Err(w))) => {
                self.expect_err("poll", &e, w);
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
    /// keep no handle of its waker.
    fn retire(&mut self, f: HFut<'a>) {
        let HFut {
            id,
            fut,
            counter,
            waker,
            old,
        } = f;
        drop(fut);
        drop(waker);
        for c in old.iter().chain([&counter]) {
            assert_eq!(
                Arc::strong_count(c),
                1,
                "future {id}: the table or the clock kept a handle of its waker"
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
        assert_eq!(
            self.clock.sleepers(),
            self.model.armed_timers(),
            "armed timers"
        );
        if !self.timed {
            assert_eq!(
                self.clock.reads(),
                self.reads_at_build,
                "the table read its clock with no lease or timeout in play"
            );
        }
        for g in &self.guards {
            let want = self.model.guards[&g.id].expires.map(|d| self.at(d));
            assert_eq!(g.guard.expires_at(), want, "expires_at of guard {}", g.id);
        }
        // The rule first: a future that would make progress if polled has
        // been woken since it was last polled (no lost wakeup).
        for f in &self.futs {
            let m = &self.model.futs[&f.id];
            if self.model.can_progress(f.id) {
                assert!(
                    f.wakes() > m.wakes_at_poll,
                    "lost wakeup: future {} can make progress but was not woken ({m:?})",
                    f.id
                );
            }
            // Ours, plus at most the table's slot and the clock's sleeper.
            assert!(Arc::strong_count(&f.counter) <= 4, "waker handles pile up");
        }
        // Then the exact count: one wake per grant, one per "re-arm your
        // timer" nudge of a leased holder's head, one per timer that fired.
        if !self.loose_wakes {
            for f in &self.futs {
                let m = &self.model.futs[&f.id];
                assert_eq!(f.wakes(), m.wakes, "wakes of future {} ({m:?})", f.id);
            }
        }
    }
}

fn run(input: Input) {
    let cfg = TableCfg::from(input.config);
    let trace = std::env::var_os("KEYLOCK_FUZZ_TRACE").is_some();
    if trace {
        eprintln!("config {cfg:?}");
    }
    let clock = ManualClock::new();
    let base = clock.now();
    let mut builder = LockTable::<u8>::builder()
        .hasher(KeyHash {
            collide: cfg.collide,
        })
        .clock(clock.clone())
        .shards(cfg.shards)
        .max_lease(ns(cfg.max_lease));
    if let Some(d) = cfg.default_lease {
        builder = builder.default_lease(ns(d));
    }
    let table = Arc::new(builder.build());
    let mut h = Harness {
        table: &table,
        clock: clock.clone(),
        base,
        futs: Vec::new(),
        guards: Vec::new(),
        model: Model::new(cfg),
        next_fid: 0,
        last_seen: [0; KEYS],
        trace,
        loose_wakes: std::env::var_os("KEYLOCK_FUZZ_LOOSE_WAKES").is_some(),
        timed: cfg.default_lease.is_some(),
        reads_at_build: clock.reads(),
    };
    for op in input.ops.into_iter().take(MAX_OPS) {
        h.step(op);
        h.compare();
    }
    // Drop everything: futures first, then guards.
    while let Some(f) = h.futs.pop() {
        h.model.drop_fut(f.id);
        h.retire(f);
        h.compare();
    }
    while let Some(g) = h.guards.pop() {
        h.model.release(g.id);
        drop(g.guard);
        h.compare();
    }
    assert_eq!(table.len(), 0, "len() with everything dropped");
    assert!(table.is_empty());
    assert_eq!(clock.sleepers(), 0, "timers left armed");
    assert_eq!(h.model.len(), 0);
    assert_eq!(MStats::of(&table.stats()), h.model.stats, "final stats()");
    drop(h);
    assert_eq!(
        Arc::strong_count(&table),
        1,
        "an owned guard or future leaked"
    );
}

fuzz_target!(|input: Input| run(input));
