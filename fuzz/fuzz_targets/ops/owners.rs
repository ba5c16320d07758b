//! Owners (transactions) in the `ops` target: up to [`OWNERS`] borrowed
//! (`Transaction`) or owned (`OwnedTransaction`) transactions over the same
//! table as the plain guards, each checked against a model built on the
//! per-key model: a transaction's grant of a key is a model guard, its new
//! keys and upgrades are model futures (a new key is tried first, as
//! `single.rs` does), and the transaction's own bookkeeping (re-entry
//! counts, keys in flight, the set's slots) is mirrored here.
//!
//! Carried by `StartLock` with `with >= 0xE0` (see [`OwnerOp::of`]): no
//! input of `fuzz/regressions/ops/` has such a byte, so they decode as
//! before.
//!
//! A transaction's calls have plain wakers and keys, but the plain futures
//! around them stay hostile: a release, a grant or a downgrade of an owner
//! may wake a waker that panics, or drop a stored key that panics (an
//! error's key is a clone of the stored one, which keeps its bomb: the
//! harness drops errors defused). Where
//! the crate's state after such a panic is defined (a release: complete; a
//! commit, abort or drop: every key released; a dropped call: undone, the
//! rest of the undo running while unwinding) the call is made and the
//! panic expected; where it is not followed by the model (a poll of a
//! call, which poisons its future; a renewal or a check, which stop at the
//! key that panicked) the model is rolled back and the call not made.

use super::*;
use keylock::{
    AcquireKind, Acquired, LockedSet, OwnedTransaction, Transaction, TransactionError,
    TransactionOptions, WaitPolicy,
};

/// Owner slots of a run.
pub(super) const OWNERS: usize = 6;
/// Pending calls of one owned transaction, at most.
const MAX_OWNER_CALLS: usize = 3;

/// The policy of one call: the transaction's default, or one of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pol {
    Default,
    Of(WaitPolicy),
}

#[derive(Debug, Clone)]
pub(super) enum OwnerKind {
    Lock { key: usize, mode: MMode, policy: Pol },
    LockAll { reqs: Vec<(usize, MMode)>, policy: Pol },
    Poll,
    DropFuture,
    Unlock { key: usize },
    Release { key: usize },
    Commit,
    Abort,
    Drop,
    Renew,
    Check,
}

/// An operation on owner `owner`; if the slot is empty, a transaction is
/// first made there: owned or borrowed, with a lease or not, with a
/// default wait policy.
#[derive(Debug, Clone)]
pub(super) struct OwnerOp {
    owner: usize,
    owned: bool,
    lease: Option<u64>,
    /// The transaction's timeout (its deadline: made plus this).
    timeout: Option<u64>,
    wait: WaitPolicy,
    kind: OwnerKind,
    /// A new call is polled at once (unless `timeout` has bit 7 set).
    poll_now: bool,
    /// Which pending call `Poll` and `DropFuture` pick (`key`, modulo).
    pick: u8,
}

fn policy_of(x: u8) -> WaitPolicy {
    match x % 3 {
        0 => WaitPolicy::Block,
        1 => WaitPolicy::NoWait,
        _ => WaitPolicy::SkipLocked,
    }
}

impl OwnerOp {
    /// The owner operation `StartLock` carries when `with >= 0xE0`:
    /// `waker` bits 4..8 pick the owner (modulo), bits 0..4 the operation;
    /// `key` the key (bits 0..2) and the mode (bit 2: shared), or for a
    /// `lock_all` 1..=3 keys (bits 0..2, 2..4, 4..6; bits 6..8 how many,
    /// modulo 3), their modes from `with` bits 2, 3, 4; `with` bits 0..2
    /// the call's policy (the transaction's, `Block`, `NoWait`,
    /// `SkipLocked`). Operations 0..4 lock, 4..7 `lock_all`, 7 and 15 poll
    /// the owner's pending call, 8 drop it, 9 `unlock`, 10 `release`, 11
    /// `commit`, 12 `abort`, 13 drop the transaction, 14 `renew` (`with`
    /// bit 2) or `check`. A new call is polled at once unless `timeout`
    /// has bit 7 set. A new transaction is owned if `owned`, with the lease
    /// `lease` (see [`lease_of`]), the default policy `timeout % 3` and, if
    /// `timeout` bits 3..7 are 8..16, the timeout `(v - 8) * 2` units (a
    /// deadline for every lock of the transaction).
    pub(super) fn of(key: u8, lease: Option<u8>, timeout: Option<u8>, with: u8, owned: bool, waker: u8) -> Option<Self> {
        if with < 0xE0 {
            return None;
        }
        let policy = match with & 3 {
            0 => Pol::Default,
            p => Pol::Of(policy_of(p - 1)),
        };
        let k = usize::from(key & 3);
        let kind = match waker & 15 {
            0..=3 => OwnerKind::Lock {
                key: k,
                mode: if key & 4 != 0 { MMode::Shared } else { MMode::Exclusive },
                policy,
            },
            4..=6 => {
                let n = 1 + usize::from(key >> 6) % 3;
                let reqs = (0..n)
                    .map(|i| {
                        let k = usize::from(key >> (2 * i)) & 3;
                        let shared = with & (4 << i) != 0;
                        (k, if shared { MMode::Shared } else { MMode::Exclusive })
                    })
                    .collect();
                OwnerKind::LockAll { reqs, policy }
            }
            7 | 15 => OwnerKind::Poll,
            8 => OwnerKind::DropFuture,
            9 => OwnerKind::Unlock { key: k },
            10 => OwnerKind::Release { key: k },
            11 => OwnerKind::Commit,
            12 => OwnerKind::Abort,
            13 => OwnerKind::Drop,
            _ if with & 4 != 0 => OwnerKind::Renew,
            _ => OwnerKind::Check,
        };
        Some(Self {
            owner: usize::from(waker >> 4) % OWNERS,
            owned,
            lease: lease.map(lease_of),
            timeout: timeout.and_then(|t| {
                let v = (t >> 3) & 15;
                (v >= 8).then(|| u64::from(v - 8) * 2 * UNIT)
            }),
            wait: timeout.map_or(WaitPolicy::Block, policy_of),
            kind,
            poll_now: timeout.is_none_or(|t| t & 0x80 == 0),
            pick: key,
        })
    }
}

// ---------------------------------------------------------------------------
// The model of a transaction
// ---------------------------------------------------------------------------

/// One slot of the transaction's held set (`held.rs`), in the set's order
/// (pushed at the end, removed by `swap_remove`): which key a renewal or a
/// check looks at first is the first in this order.
#[derive(Debug, Clone)]
struct MSlot {
    key: usize,
    /// The grant (a model guard); `None` while a new key is in flight.
    gid: Option<Gid>,
    count: usize,
    /// A call has it (in flight, upgrading, or a `lock_all`'s covered key).
    busy: bool,
    /// Its guard is away with an upgrading call.
    away: bool,
}

#[derive(Debug, Clone)]
pub(super) struct MOwner {
    /// `Transaction::id`, as deadlock answers name it.
    id: u64,
    owned: bool,
    lease: Option<u64>,
    /// The transaction's deadline (model time).
    deadline: Option<u64>,
    wait: WaitPolicy,
    slots: Vec<MSlot>,
    ended: bool,
}

impl MOwner {
    fn find(&self, k: usize) -> Option<usize> {
        self.slots.iter().position(|s| s.key == k)
    }
    fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.count > 0).count()
    }
    fn remove(&mut self, k: usize) {
        let at = self.find(k).expect("model: slot");
        self.slots.swap_remove(at);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EKind {
    Covered,
    Upgrade(Gid),
    New,
}

#[derive(Debug, Clone)]
struct Ent {
    key: usize,
    mode: MMode,
    kind: EKind,
    /// A new key's grant.
    got: Option<Gid>,
    upgraded: bool,
    skipped: bool,
}

#[derive(Debug, Clone)]
enum Phase {
    Unpolled,
    One { key: usize, mode: MMode, inner: Fid, kind: EKind },
    All { ents: Vec<Ent>, at: usize, inner: Option<Fid> },
    /// A waiting call whose cell the transaction's end cancelled
    /// (`src/transactions/pending.rs`: a forgotten call keeps nothing): its wait
    /// and the guards it held outside the set are gone; its detector
    /// registration (`inner`'s) stays until the call is polled (it fails
    /// `Ended`) or dropped.
    Cancelled { inner: Fid },
    Done,
}

#[derive(Debug, Clone)]
enum Req {
    One { key: usize, mode: MMode },
    All { reqs: Vec<(usize, MMode)> },
}

/// What a transaction's call is expected to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum MTErr {
    Lock { key: usize, mode: MMode, err: MErr },
    Busy { key: usize, mode: MMode, holder: Option<u64> },
    Expired { key: usize, token: u64 },
    InFlight { key: usize },
    NotHeld { key: usize },
    Ended,
    /// The call's wait closed this cycle (its own wait first).
    Deadlock(MCycle),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum MGot {
    One { token: u64, mode: MMode, count: usize, kind: AcquireKind },
    /// `keys`: what it took and how, listed under `SkipLocked` only.
    All { acquired: usize, reentered: usize, upgraded: usize, skipped: Vec<usize>, keys: Vec<(usize, AcquireKind)> },
}

fn from_lock(key: usize, mode: MMode, waited: bool, err: MErr) -> MTErr {
    match err {
        MErr::Timeout { holder, .. } if !waited => MTErr::Busy { key, mode, holder },
        MErr::Expired(token) => MTErr::Expired { key, token },
        err => MTErr::Lock { key, mode, err },
    }
}

fn mode_of(m: MMode) -> Mode {
    match m {
        MMode::Shared => Mode::Shared,
        MMode::Exclusive => Mode::Exclusive,
    }
}

fn covers(held: MMode, asked: MMode) -> bool {
    held == MMode::Exclusive || asked == MMode::Shared
}

// ---------------------------------------------------------------------------
// The harness side
// ---------------------------------------------------------------------------

enum RTxn<'a> {
    B(Box<Transaction<'a, Key, KeyHash>>),
    O(OwnedTransaction<Key, KeyHash>),
}

enum OOut {
    One(Acquired),
    All(LockedSet<Key>),
}

type OFuture<'a> = Pin<Box<dyn Future<Output = Result<OOut, TransactionError<Key>>> + 'a>>;

struct HOFut<'a> {
    fut: Option<OFuture<'a>>,
    waker: Waker,
    slot: usize,
    req: Req,
    policy: WaitPolicy,
    phase: Phase,
    wakes_at_poll: u64,
    /// Its waker is registered to be woken when the (owned) transaction
    /// ends.
    watching: bool,
    /// The transaction ended while it watched: it must have been woken.
    ended_wake: bool,
}

impl HOFut<'_> {
    fn wakes(&self) -> u64 {
        WAKERS[self.slot].wakes.load(SeqCst)
    }
    fn inner(&self) -> Option<Fid> {
        match &self.phase {
            Phase::One { inner, .. } => Some(*inner),
            Phase::All { inner, .. } => *inner,
            _ => None,
        }
    }
}

pub(super) struct HOwner<'a> {
    /// Its pending calls (at most one for a borrowed transaction, which it
    /// borrows; a few for an owned one). Declared first: they may borrow
    /// `txn`, so they drop first.
    futs: Vec<HOFut<'a>>,
    /// `None` once the (owned) transaction ended with a future pending.
    txn: Option<RTxn<'a>>,
    m: MOwner,
}

#[derive(Default)]
pub(super) struct Owners<'a> {
    slots: [Option<usize>; OWNERS],
    list: BTreeMap<usize, HOwner<'a>>,
    next: usize,
    /// One of the crate's calls made by the current owner operation must
    /// panic (its deferred work); the calls after it run while unwinding.
    must: bool,
    /// Every bomb is defused (the end of a run).
    quiet: bool,
    /// Upgrades of a transaction's call whose key the table stores as an
    /// instance that panics when dropped: the call names the key by a clone
    /// of that instance (known bug `owner_upgrade_key_clone`).
    bomb_names: BTreeSet<Fid>,
    /// The current owner operation starts, polls or drops one of them.
    bomb_touched: bool,
}

/// The model before an owner's call, to roll back to.
struct Snap {
    model: Model,
    m: MOwner,
    futs: Vec<(Phase, u64)>,
}

/// A deadlock's cycle as the model writes it.
fn cycle_of(d: &keylock::Deadlock<Key>) -> MCycle {
    d.cycle()
        .iter()
        .map(|w| (w.transaction.get(), usize::from(w.key.id), MMode::of(w.mode)))
        .collect()
}

fn tkey(e: &TransactionError<Key>) -> Option<usize> {
    e.key().map(|k| usize::from(k.id))
}

impl<'a> Harness<'a> {
    fn owner_hash(&self, k: usize) -> (u64, usize) {
        (key_hash(self.model.cfg.collide, k), k)
    }

    /// The deferred work of the crate's call the model just made (a
    /// release, a downgrade, a poll, ...): its wakes, and the calls back of
    /// a waker, come before the next call's. Once one must panic, the rest
    /// run while unwinding.
    fn owner_call_done(&mut self) {
        let unwinding = self.owners.must || self.owners.quiet;
        self.owners.must |= self.model.flush(unwinding);
    }

    /// What the current owner operation must do: panic or not.
    fn owner_expect(&mut self) -> Expect {
        self.owner_call_done();
        if self.owners.must {
            Expect::Must
        } else {
            Expect::No
        }
    }

    fn owner_snap(&self, inst: usize) -> Snap {
        let o = &self.owners.list[&inst];
        Snap {
            model: self.model.clone(),
            m: o.m.clone(),
            futs: o.futs.iter().map(|f| (f.phase.clone(), f.wakes_at_poll)).collect(),
        }
    }

    fn owner_restore(&mut self, inst: usize, snap: Snap) {
        if self.trace {
            eprintln!("  owner {inst}: skipped (the model does not follow its panic)");
        }
        self.model = snap.model;
        let o = self.owners.list.get_mut(&inst).unwrap();
        o.m = snap.m;
        for (f, (phase, wakes)) in o.futs.iter_mut().zip(snap.futs) {
            (f.phase, f.wakes_at_poll) = (phase, wakes);
        }
    }

    pub(super) fn owner_op(&mut self, op: OwnerOp) {
        if self.trace {
            eprintln!("  owner op {op:?}");
        }
        self.timed = true;
        let inst = match self.owners.slots[op.owner] {
            Some(i) => i,
            None => {
                if matches!(op.kind, OwnerKind::Poll | OwnerKind::DropFuture) {
                    return;
                }
                let mut opts = TransactionOptions::new().wait(op.wait);
                if let Some(l) = op.lease {
                    opts = opts.lease(ns(l));
                }
                if let Some(t) = op.timeout {
                    opts = opts.timeout(ns(t));
                }
                let txn = if op.owned {
                    RTxn::O(Arc::clone(self.table).transaction_owned_with(opts))
                } else {
                    RTxn::B(Box::new(self.table.transaction_with(opts)))
                };
                let id = match &txn {
                    RTxn::O(t) => t.id().get(),
                    RTxn::B(t) => t.id().get(),
                };
                assert!(
                    self.owners.list.values().all(|o| o.m.id != id),
                    "transaction id {id} given twice"
                );
                let i = self.owners.next;
                self.owners.next += 1;
                self.owners.list.insert(
                    i,
                    HOwner {
                        futs: Vec::new(),
                        txn: Some(txn),
                        m: MOwner {
                            id,
                            owned: op.owned,
                            lease: op.lease,
                            deadline: op.timeout.map(|t| self.model.now + t),
                            wait: op.wait,
                            slots: Vec::new(),
                            ended: false,
                        },
                    },
                );
                self.owners.slots[op.owner] = Some(i);
                i
            }
        };
        let o = &self.owners.list[&inst];
        let pending = o.futs.len();
        // A borrowed transaction is borrowed by its pending call.
        let borrowed = pending > 0 && !o.m.owned;
        let full = borrowed || pending >= MAX_OWNER_CALLS;
        // The call picked by `Poll` and `DropFuture`.
        let j = usize::from(op.pick) % pending.max(1);
        match op.kind {
            OwnerKind::Lock { .. } | OwnerKind::LockAll { .. } if full => {}
            OwnerKind::Lock { key, mode, policy } => {
                self.owner_start(inst, Req::One { key, mode }, policy);
                if op.poll_now {
                    self.owner_poll(inst, pending);
                }
            }
            OwnerKind::LockAll { reqs, policy } => {
                self.owner_start(inst, Req::All { reqs }, policy);
                if op.poll_now {
                    self.owner_poll(inst, pending);
                }
            }
            OwnerKind::Poll => {
                if pending > 0 {
                    self.owner_poll(inst, j)
                }
            }
            OwnerKind::DropFuture => {
                if pending > 0 {
                    self.owner_drop_future(inst, j, false)
                }
            }
            _ if borrowed => {}
            OwnerKind::Unlock { key } => self.owner_unlock(inst, key, false),
            OwnerKind::Release { key } => self.owner_unlock(inst, key, true),
            OwnerKind::Commit => self.owner_end(op.owner, inst, 0),
            OwnerKind::Abort => self.owner_end(op.owner, inst, 1),
            OwnerKind::Drop => self.owner_end(op.owner, inst, 2),
            OwnerKind::Renew => self.owner_renew(inst, true),
            OwnerKind::Check => self.owner_renew(inst, false),
        }
    }

    fn owner_start(&mut self, inst: usize, req: Req, policy: Pol) {
        let o = self.owners.list.get_mut(&inst).unwrap();
        let with = match policy {
            Pol::Default => None,
            Pol::Of(p) => Some(p),
        };
        let policy = with.unwrap_or(o.m.wait);
        let reqs: Vec<(Key, Mode)> = match &req {
            Req::One { .. } => Vec::new(),
            Req::All { reqs } => reqs.iter().map(|&(k, m)| (Key::new(k, false), mode_of(m))).collect(),
        };
        let fut: OFuture<'a> = match (o.txn.as_mut().expect("a live transaction"), &req) {
            (RTxn::B(t), req) => {
                // SAFETY: the transaction is boxed and stays put; while the
                // future exists the harness calls nothing else on it (a
                // borrowed owner with a pending call is left alone), and the
                // future is dropped before it (`HOwner::fut` is declared
                // first, and every path drops the future first).
                let t: &'a mut Transaction<'a, Key, KeyHash> =
                    unsafe { &mut *(&mut **t as *mut Transaction<'a, Key, KeyHash>) };
                match (req, with) {
                    (Req::One { key, mode }, None) => {
                        let (k, m) = (Key::new(*key, false), mode_of(*mode));
                        Box::pin(async move { t.lock(k, m).await.map(OOut::One) })
                    }
                    (Req::One { key, mode }, Some(p)) => {
                        let (k, m) = (Key::new(*key, false), mode_of(*mode));
                        Box::pin(async move { t.lock_with(k, m, p).await.map(OOut::One) })
                    }
                    (Req::All { .. }, None) => {
                        Box::pin(async move { t.lock_all(reqs).await.map(OOut::All) })
                    }
                    (Req::All { .. }, Some(p)) => {
                        Box::pin(async move { t.lock_all_with(reqs, p).await.map(OOut::All) })
                    }
                }
            }
            (RTxn::O(t), req) => match (req, with) {
                (Req::One { key, mode }, None) => {
                    let f = t.lock(Key::new(*key, false), mode_of(*mode));
                    Box::pin(async move { f.await.map(OOut::One) })
                }
                (Req::One { key, mode }, Some(p)) => {
                    let f = t.lock_with(Key::new(*key, false), mode_of(*mode), p);
                    Box::pin(async move { f.await.map(OOut::One) })
                }
                (Req::All { .. }, None) => {
                    let f = t.lock_all(reqs);
                    Box::pin(async move { f.await.map(OOut::All) })
                }
                (Req::All { .. }, Some(p)) => {
                    let f = t.lock_all_with(reqs, p);
                    Box::pin(async move { f.await.map(OOut::All) })
                }
            },
        };
        let (slot, waker) = new_waker(WKind::Plain);
        o.futs.push(HOFut {
            fut: Some(fut),
            waker,
            slot,
            req,
            policy,
            phase: Phase::Unpolled,
            wakes_at_poll: 0,
            watching: false,
            ended_wake: false,
        });
    }

    /// The inner lock options' lease and timeout, as the model takes them
    /// (a deadline is a timeout up to it: an inner future is first polled
    /// when it is made; one already passed, no wait at all).
    fn inner_opts(&self, inst: usize, policy: WaitPolicy) -> (Option<u64>, Option<Option<u64>>) {
        let o = &self.owners.list[&inst].m;
        let timeout = if !policy.waits() {
            Some(Some(0))
        } else {
            o.deadline.map(|d| Some(d.saturating_sub(self.model.now)))
        };
        (o.lease, timeout)
    }

    /// The current owner operation polls or drops inner future `inner`:
    /// note an upgrade that names its key by a clone that panics when
    /// dropped (known bug `owner_upgrade_key_clone`).
    fn owner_touch(&mut self, inner: Fid) {
        self.owners.bomb_touched |= self.owners.bomb_names.contains(&inner);
    }

    /// An inner future of transaction `id`'s call pended: the first time
    /// (its waiter is queued now), its wait is registered with the
    /// detector (beside its other waits, if it has any), and
    /// searched (`wait_unless_ended`): `Err` with the cycle it closes.
    fn owner_wait_pends(
        &mut self,
        id: u64,
        inner: Fid,
        key: usize,
        mode: MMode,
        holds_nothing: bool,
    ) -> Result<(), MCycle> {
        let fut = self.model.fut(inner);
        if std::mem::replace(&mut fut.searched, true) {
            return Ok(());
        }
        // access.rs: a borrowed transaction that holds nothing (nothing
        // held, nothing taken by this call) is not registered.
        if holds_nothing {
            return Ok(());
        }
        let entered = self.model.dl_enter(id, inner, key, mode);
        // The wake of a waiter granted ahead of the queue, after the
        // detector's lock (inside the same poll).
        self.owner_call_done();
        if self.trace {
            eprintln!("  transaction {id} waits for key {key} {mode:?}: {entered:?}");
        }
        entered.map(drop)
    }

    fn fresh_fid(&mut self) -> Fid {
        let id = self.next_fid;
        self.next_fid += 1;
        id
    }

    /// The model's answer to one poll of owner `inst`'s call: `None` while
    /// pending.
    fn owner_model_poll(&mut self, inst: usize, j: usize, wakes: u64) -> Option<Result<MGot, MTErr>> {
        let (mut phase, req, policy) = {
            let f = &mut self.owners.list.get_mut(&inst).unwrap().futs[j];
            f.wakes_at_poll = wakes;
            (std::mem::replace(&mut f.phase, Phase::Done), f.req.clone(), f.policy)
        };
        let ended = self.owners.list[&inst].m.ended;
        let id = self.owners.list[&inst].m.id;
        let waits = policy.waits();
        let (lease, timeout) = self.inner_opts(inst, policy);
        let mut parked = Phase::Done;
        let out = loop {
            match phase {
                Phase::Done => unreachable!("model: a finished call polled"),
                Phase::Unpolled if ended => break Some(Err(MTErr::Ended)),
                Phase::Unpolled => match &req {
                    Req::One { key, mode } => {
                        let (key, mode) = (*key, *mode);
                        let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                        match m.find(key) {
                            None => {
                                m.slots.push(MSlot { key, gid: None, count: 0, busy: true, away: false });
                                let tried = self.model.try_lock_for(key, mode, lease, false, id);
                                self.owner_call_done();
                                match tried {
                                    Ok(g) => {
                                        let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                                        let i = m.find(key).unwrap();
                                        let s = &mut m.slots[i];
                                        (s.gid, s.count, s.busy) = (Some(g.gid), 1, false);
                                        break Some(Ok(MGot::One { token: g.token, mode: g.mode, count: 1, kind: AcquireKind::New }));
                                    }
                                    Err(MErr::WouldBlock) => {
                                        let f = self.fresh_fid();
                                        self.model.start(f, key, mode, lease, timeout, false, WKind::Plain);
                                        self.model.fut(f).owner = id;
                                        phase = Phase::One { key, mode, inner: f, kind: EKind::New };
                                        continue;
                                    }
                                    Err(e) => {
                                        self.owners.list.get_mut(&inst).unwrap().m.remove(key);
                                        break Some(Err(from_lock(key, mode, true, e)));
                                    }
                                }
                            }
                            Some(at) => {
                                let s = &mut m.slots[at];
                                let Some(gid) = s.gid.filter(|_| !s.busy) else {
                                    break Some(Err(MTErr::InFlight { key }));
                                };
                                let g = &self.model.guards[&gid];
                                if covers(g.mode, mode) {
                                    s.count += 1;
                                    break Some(Ok(MGot::One { token: g.token, mode: g.mode, count: s.count, kind: AcquireKind::Reentered }));
                                }
                                (s.busy, s.away) = (true, true);
                                let f = self.fresh_fid();
                                if self.model.keys[key].stored_bomb {
                                    self.owners.bomb_names.insert(f);
                                }
                                self.model.start_upgrade(f, gid, timeout.map(|t| t));
                                phase = Phase::One { key, mode, inner: f, kind: EKind::Upgrade(gid) };
                                continue;
                            }
                        }
                    }
                    Req::All { reqs } => {
                        let mut sorted: Vec<(u64, usize, MMode)> = reqs
                            .iter()
                            .map(|&(k, m)| {
                                let (h, k) = self.owner_hash(k);
                                (h, k, m)
                            })
                            .collect();
                        sorted.sort_by_key(|&(_, k, _)| k);
                        let mut merged: Vec<(usize, MMode)> = Vec::new();
                        for (_, k, m) in sorted {
                            match merged.last_mut() {
                                Some(last) if last.0 == k => {
                                    if m == MMode::Exclusive {
                                        last.1 = m;
                                    }
                                }
                                _ => merged.push((k, m)),
                            }
                        }
                        let mut ents = Vec::new();
                        let mut busy = None;
                        {
                            let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                            for &(key, mode) in &merged {
                                let kind = match m.find(key) {
                                    None => {
                                        m.slots.push(MSlot { key, gid: None, count: 0, busy: true, away: false });
                                        EKind::New
                                    }
                                    Some(at) => {
                                        let s = &mut m.slots[at];
                                        let Some(gid) = s.gid.filter(|_| !s.busy) else {
                                            busy = Some(key);
                                            break;
                                        };
                                        s.busy = true;
                                        if covers(self.model.guards[&gid].mode, mode) {
                                            EKind::Covered
                                        } else {
                                            s.away = true;
                                            EKind::Upgrade(gid)
                                        }
                                    }
                                };
                                ents.push(Ent { key, mode, kind, got: None, upgraded: false, skipped: false });
                            }
                        }
                        if let Some(key) = busy {
                            self.owner_undo(inst, &ents, false);
                            break Some(Err(MTErr::InFlight { key }));
                        }
                        phase = Phase::All { ents, at: 0, inner: None };
                        continue;
                    }
                },
                Phase::Cancelled { inner } => {
                    self.model.dl_leave(id, inner);
                    break Some(Err(MTErr::Ended));
                }
                Phase::One { key, mode, inner, kind } => {
                    if ended {
                        self.owner_touch(inner);
                        self.model.dl_leave(id, inner);
                        self.model.drop_fut(inner);
                        self.owner_call_done();
                        if let EKind::Upgrade(gid) = kind {
                            self.model.release(gid);
                            self.owner_call_done();
                        }
                        break Some(Err(MTErr::Ended));
                    }
                    self.owner_touch(inner);
                    let polled = self.model.poll(inner, wakes);
                    self.owner_call_done();
                    match polled {
                        MPoll::Pending => {
                            let asked = if kind == EKind::New { mode } else { MMode::Exclusive };
                            let holds_nothing = {
                                let m = &self.owners.list[&inst].m;
                                !m.owned && kind == EKind::New && m.slots.iter().all(|s| s.count == 0)
                            };
                            if let Err(cycle) = self.owner_wait_pends(id, inner, key, asked, holds_nothing) {
                                // The victim: its wait stops (unregistered,
                                // its lock future dropped), its claim is
                                // given back (a new key's slot goes, an
                                // upgrade's guard is back, shared).
                                self.model.dl_leave(id, inner);
                                self.model.drop_fut(inner);
                                self.owner_call_done();
                                let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                                if kind == EKind::New {
                                    m.remove(key);
                                } else {
                                    let at = m.find(key).unwrap();
                                    (m.slots[at].busy, m.slots[at].away) = (false, false);
                                }
                                break Some(Err(MTErr::Deadlock(cycle)));
                            }
                            parked = Phase::One { key, mode, inner, kind };
                            break None;
                        }
                        MPoll::Ready(r) => {
                            self.model.dl_leave(id, inner);
                            let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                            let at = m.find(key).unwrap();
                            match r {
                                Ok(MDone::Guard(g)) => {
                                    let s = &mut m.slots[at];
                                    (s.gid, s.count, s.busy) = (Some(g.gid), 1, false);
                                    break Some(Ok(MGot::One { token: g.token, mode: g.mode, count: 1, kind: AcquireKind::New }));
                                }
                                Ok(MDone::Upgraded { token, .. }) => {
                                    let s = &mut m.slots[at];
                                    s.count += 1;
                                    (s.busy, s.away) = (false, false);
                                    break Some(Ok(MGot::One { token, mode: MMode::Exclusive, count: s.count, kind: AcquireKind::Upgraded }));
                                }
                                Err(e) => {
                                    if kind == EKind::New {
                                        m.remove(key);
                                    } else {
                                        let s = &mut m.slots[at];
                                        (s.busy, s.away) = (false, false);
                                    }
                                    break Some(Err(from_lock(key, mode, waits, e)));
                                }
                            }
                        }
                    }
                }
                Phase::All { mut ents, at, inner } => {
                    if at == ents.len() {
                        // `finish`: everything into the set at once.
                        let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                        // Which way the crate went: a borrowed call with no
                        // upgrade claims nothing (`take_now`, `wait_sole`):
                        // the keys it took go in at the end, in request
                        // order, and a skipped key was never in the set. A
                        // claiming call (owned, or upgrading) gives a
                        // skipped key's slot back by `swap_remove`.
                        let claimed = m.owned || ents.iter().any(|e| matches!(e.kind, EKind::Upgrade(_)));
                        let (mut acquired, mut reentered, mut upgraded, mut skipped) = (0, 0, 0, Vec::new());
                        let mut keys = Vec::new();
                        for e in &ents {
                            let i = m.find(e.key).unwrap();
                            if e.skipped {
                                skipped.push(e.key);
                                if m.slots[i].count == 0 && claimed {
                                    m.slots.swap_remove(i);
                                } else if m.slots[i].count == 0 {
                                    m.slots.remove(i);
                                } else {
                                    (m.slots[i].busy, m.slots[i].away) = (false, false);
                                }
                                continue;
                            }
                            let s = &mut m.slots[i];
                            let kind = match e.kind {
                                EKind::Covered => {
                                    reentered += 1;
                                    AcquireKind::Reentered
                                }
                                EKind::Upgrade(_) => {
                                    upgraded += 1;
                                    AcquireKind::Upgraded
                                }
                                EKind::New => {
                                    acquired += 1;
                                    s.gid = e.got;
                                    AcquireKind::New
                                }
                            };
                            // Listed, in the canonical order, by a call that
                            // may take fewer keys than asked.
                            if policy == WaitPolicy::SkipLocked {
                                keys.push((e.key, kind));
                            }
                            s.count += 1;
                            (s.busy, s.away) = (false, false);
                        }
                        break Some(Ok(MGot::All { acquired, reentered, upgraded, skipped, keys }));
                    }
                    let e = ents[at].clone();
                    let inner = match (inner, e.kind) {
                        (_, EKind::Covered) => {
                            phase = Phase::All { ents, at: at + 1, inner: None };
                            continue;
                        }
                        (Some(f), _) => f,
                        (None, EKind::New) => {
                            // Tried at once first (`try_lock_kept`); a
                            // future only for a key that must be waited
                            // for (or whose options are invalid).
                            let tried = self.model.try_lock_for(e.key, e.mode, lease, false, id);
                            self.owner_call_done();
                            if let Ok(g) = tried {
                                ents[at].got = Some(g.gid);
                                phase = Phase::All { ents, at: at + 1, inner: None };
                                continue;
                            }
                            let f = self.fresh_fid();
                            self.model.start(f, e.key, e.mode, lease, timeout, false, WKind::Plain);
                            self.model.fut(f).owner = id;
                            f
                        }
                        (None, EKind::Upgrade(gid)) => {
                            let f = self.fresh_fid();
                            if self.model.keys[e.key].stored_bomb {
                                self.owners.bomb_names.insert(f);
                            }
                            self.model.start_upgrade(f, gid, timeout);
                            f
                        }
                    };
                    if ended {
                        self.owner_touch(inner);
                        self.model.dl_leave(id, inner);
                        self.model.drop_fut(inner);
                        self.owner_call_done();
                        self.owner_undo(inst, &ents, true);
                        break Some(Err(MTErr::Ended));
                    }
                    self.owner_touch(inner);
                    let polled = self.model.poll(inner, wakes);
                    self.owner_call_done();
                    if !matches!(polled, MPoll::Pending) {
                        self.model.dl_leave(id, inner);
                    }
                    match polled {
                        MPoll::Pending => {
                            let asked = if e.kind == EKind::New { e.mode } else { MMode::Exclusive };
                            let holds_nothing = {
                                let m = &self.owners.list[&inst].m;
                                !m.owned
                                    && e.kind == EKind::New
                                    && m.slots.iter().all(|s| s.count == 0)
                                    && ents[..at].iter().all(|e| e.got.is_none())
                            };
                            if let Err(cycle) = self.owner_wait_pends(id, inner, e.key, asked, holds_nothing) {
                                // The victim: its wait stops (unregistered,
                                // its lock future dropped), then the stage
                                // undoes the call.
                                self.model.dl_leave(id, inner);
                                self.model.drop_fut(inner);
                                self.owner_call_done();
                                self.owner_undo(inst, &ents, false);
                                break Some(Err(MTErr::Deadlock(cycle)));
                            }
                            parked = Phase::All { ents, at, inner: Some(inner) };
                            break None;
                        }
                        MPoll::Ready(Ok(MDone::Guard(g))) => {
                            ents[at].got = Some(g.gid);
                        }
                        MPoll::Ready(Ok(MDone::Upgraded { .. })) => ents[at].upgraded = true,
                        MPoll::Ready(Err(err))
                            if policy == WaitPolicy::SkipLocked
                                && matches!(err, MErr::Timeout { .. } | MErr::Conflict { .. }) =>
                        {
                            ents[at].skipped = true
                        }
                        MPoll::Ready(Err(err)) => {
                            // `fail`: this entry's claim ends at once (a new
                            // key's slot goes, an upgrade's guard is back),
                            // then the stage undoes the others.
                            let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                            let i = m.find(e.key).unwrap();
                            if m.slots[i].count == 0 {
                                m.slots.swap_remove(i);
                            } else {
                                (m.slots[i].busy, m.slots[i].away) = (false, false);
                            }
                            ents[at].kind = EKind::Covered;
                            ents[at].upgraded = false;
                            let mut rest = ents.clone();
                            rest.remove(at);
                            self.owner_undo(inst, &rest, false);
                            break Some(Err(from_lock(e.key, e.mode, waits, err)));
                        }
                    }
                    phase = Phase::All { ents, at: at + 1, inner: None };
                }
            }
        };
        let f = &mut self.owners.list.get_mut(&inst).unwrap().futs[j];
        f.phase = parked;
        out
    }

    /// A `lock_all`'s stage dropped: its upgrades become shared again,
    /// then every claim ends (new keys released); had the transaction
    /// ended, every guard of the call is released instead. Each downgrade
    /// and release is a call of its own (`owner_call_done`). Returns whether
    /// a downgrade made the first panic.
    fn owner_undo(&mut self, inst: usize, ents: &[Ent], ended: bool) -> bool {
        let before = self.owners.must;
        for e in ents {
            if let (true, EKind::Upgrade(gid)) = (e.upgraded, e.kind) {
                let _ = self.model.downgrade(gid);
                self.owner_call_done();
            }
        }
        let down = self.owners.must && !before;
        let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
        let mut released = Vec::new();
        if ended || m.ended {
            for e in ents {
                match e.kind {
                    EKind::Upgrade(gid) => released.push(gid),
                    EKind::New => released.extend(e.got),
                    EKind::Covered => {}
                }
            }
        } else {
            for e in ents {
                let i = m.find(e.key).expect("model: a claimed slot");
                if m.slots[i].count == 0 {
                    m.slots.swap_remove(i);
                    released.extend(e.got);
                } else {
                    (m.slots[i].busy, m.slots[i].away) = (false, false);
                }
            }
        }
        for g in released {
            self.model.release(g);
            self.owner_call_done();
        }
        down
    }

    fn owner_poll(&mut self, inst: usize, j: usize) {
        let wakes = self.owners.list[&inst].futs[j].wakes();
        let snap = self.owner_snap(inst);
        self.owners.must = false;
        self.owners.bomb_touched = false;
        let want = self.owner_model_poll(inst, j, wakes);
        let expect = self.owner_expect();
        if expect == Expect::Must || (self.owners.bomb_touched && self.known_bugs.owner_upgrade_key_clone) {
            self.owner_restore(inst, snap);
            return;
        }
        let f = &mut self.owners.list.get_mut(&inst).unwrap().futs[j];
        let mut cx = Context::from_waker(&f.waker);
        let fut = f.fut.as_mut().unwrap();
        let got = catch(|| fut.as_mut().poll(&mut cx));
        self.expect_panic("owner poll", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("owner poll");
        let Ok(got) = got else { return };
        if self.trace {
            let g = match &got {
                Poll::Pending => "pending".to_string(),
                Poll::Ready(Ok(_)) => "ok".to_string(),
                Poll::Ready(Err(e)) => format!("{e:?}"),
            };
            eprintln!("  owner {inst}: poll {g}, model {want:?}");
        }
        let what = format!("owner {inst}: poll of {:?}", self.owners.list[&inst].futs[j].req);
        match (got, want) {
            (Poll::Pending, None) => {
                let o = self.owners.list.get_mut(&inst).unwrap();
                let f = &mut o.futs[j];
                f.watching = o.m.owned && !o.m.ended;
                return;
            }
            (Poll::Ready(got), Some(want)) => {
                self.owner_compare_result(&what, &got, want);
                // A deadlock's keys are clones of the table's copies (an
                // upgrade's): the caller's to drop, not the crate's.
                defused(|| drop(got));
            }
            (Poll::Pending, Some(Err(MTErr::Deadlock(cycle)))) => panic!(
                "{what}: crate pending, model: its wait closes the cycle {cycle:?}, which must be answered; detector {}",
                self.model.dl_describe()
            ),
            (Poll::Ready(Err(TransactionError::Deadlock(d))), None) => {
                let cycle = cycle_of(&d);
                // After the call: its own wait is gone from the model's
                // registry (it pends there), so the cycle is judged as is.
                panic!(
                    "{what}: crate answered Deadlock {cycle:?}, the model has no cycle closed by this wait \
                     (a cycle in the model's graph now: {}); detector {}",
                    self.model.dl_is_cycle(&cycle),
                    self.model.dl_describe()
                )
            }
            (got, want) => panic!(
                "{what}: crate {}, model {want:?}",
                if got.is_pending() { "pending" } else { "ready" }
            ),
        }
        self.owner_retire_future(inst, j);
    }

    fn owner_compare_result(&mut self, what: &str, got: &Result<OOut, TransactionError<Key>>, want: Result<MGot, MTErr>) {
        match (got, want) {
            (Ok(OOut::One(a)), Ok(MGot::One { token, mode, count, kind })) => {
                assert_eq!(
                    (a.token.get(), MMode::of(a.mode), a.count, a.kind),
                    (token, mode, count, kind),
                    "{what}: acquired"
                );
                self.seen_token(a.token);
            }
            (Ok(OOut::All(s)), Ok(MGot::All { acquired, reentered, upgraded, skipped, keys })) => {
                let got_skipped: Vec<usize> = s.skipped().iter().map(|k| usize::from(k.id)).collect();
                let got_keys: Vec<(usize, AcquireKind)> = s.keys().iter().map(|(k, how)| (usize::from(k.id), *how)).collect();
                assert_eq!(
                    (s.acquired(), s.reentered(), s.upgraded(), got_skipped, got_keys),
                    (acquired, reentered, upgraded, skipped, keys),
                    "{what}: locked set (acquired, reentered, upgraded, skipped, keys)"
                );
            }
            (Err(e), Err(w)) => self.owner_expect_err(what, e, &w),
            (got, want) => panic!(
                "{what}: crate {:?}, model {want:?}",
                got.as_ref().map(|o| match o {
                    OOut::One(a) => format!("{a:?}"),
                    OOut::All(s) => format!("{s:?}"),
                })
            ),
        }
    }

    fn owner_expect_err(&mut self, what: &str, e: &TransactionError<Key>, w: &MTErr) {
        let key = tkey(e);
        match (e, w) {
            (TransactionError::Lock { mode, error, .. }, MTErr::Lock { key: k, mode: m, err }) => {
                assert_eq!((key, MMode::of(*mode)), (Some(*k), *m), "{what}: {e:?} vs {w:?}");
                self.expect_err(what, error, *err);
            }
            (TransactionError::Busy { mode, holder, .. }, MTErr::Busy { key: k, mode: m, holder: h }) => {
                assert_eq!(
                    (key, MMode::of(*mode), holder.map(FencingToken::get)),
                    (Some(*k), *m, *h),
                    "{what}: {e:?} vs {w:?}"
                );
                if let Some(t) = holder {
                    self.seen_token(*t);
                }
            }
            (TransactionError::Expired { token, .. }, MTErr::Expired { key: k, token: t }) => {
                assert_eq!((key, token.get()), (Some(*k), *t), "{what}: {e:?} vs {w:?}");
            }
            (TransactionError::InFlight { .. }, MTErr::InFlight { key: k })
            | (TransactionError::NotHeld { .. }, MTErr::NotHeld { key: k }) => {
                assert_eq!(key, Some(*k), "{what}: {e:?} vs {w:?}");
            }
            (TransactionError::Ended, MTErr::Ended) => {}
            (TransactionError::Deadlock(d), MTErr::Deadlock(cycle)) => {
                let got = cycle_of(d);
                assert_eq!(
                    got,
                    *cycle,
                    "{what}: the deadlock's cycle (transaction, key, mode), the victim's wait first; detector {}",
                    self.model.dl_describe()
                );
                assert_eq!(
                    Some(d.victim().get()),
                    cycle.first().map(|c| c.0),
                    "{what}: the deadlock's victim"
                );
                assert_eq!(key, Some(cycle[0].1), "{what}: the deadlock error's key");
            }
            (_, MTErr::Deadlock(cycle)) => panic!(
                "{what}: crate {e:?}, model: its wait closes the cycle {cycle:?} (detector {})",
                self.model.dl_describe()
            ),
            _ => panic!("{what}: crate {e:?}, model {w:?}"),
        }
    }

    /// A call that completed or was dropped: no handle of its waker left.
    fn owner_retire_future(&mut self, inst: usize, j: usize) {
        let o = self.owners.list.get_mut(&inst).unwrap();
        let f = o.futs.remove(j);
        let HOFut { fut, waker, slot, .. } = f;
        drop(fut);
        drop(waker);
        assert_eq!(
            WAKERS[slot].handles.load(SeqCst),
            0,
            "owner {inst}: a handle of its call's waker was kept"
        );
        free_waker(slot);
        if o.txn.is_none() && o.futs.is_empty() {
            self.owners.list.remove(&inst);
        }
    }

    /// Drops owner `inst`'s call; `defuse` (at the end of a run): with
    /// every bomb defused, so that a drop the harness skips (a known bug)
    /// still goes.
    fn owner_drop_future(&mut self, inst: usize, j: usize, defuse: bool) {
        let snap = self.owner_snap(inst);
        let (phase, ended, id) = {
            let o = self.owners.list.get_mut(&inst).unwrap();
            let f = &mut o.futs[j];
            (std::mem::replace(&mut f.phase, Phase::Done), o.m.ended, o.m.id)
        };
        self.owners.must = false;
        self.owners.quiet = defuse;
        self.owners.bomb_touched = false;
        let mut undo_panics = false;
        match phase {
            Phase::Unpolled | Phase::Done => {}
            Phase::Cancelled { inner } => self.model.dl_leave(id, inner),
            Phase::One { key, inner, kind, .. } => {
                self.owner_touch(inner);
                self.model.dl_leave(id, inner);
                self.model.drop_fut(inner);
                self.owner_call_done();
                if ended {
                    if let EKind::Upgrade(gid) = kind {
                        self.model.release(gid);
                        self.owner_call_done();
                    }
                } else {
                    let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
                    if kind == EKind::New {
                        m.remove(key);
                    } else {
                        let i = m.find(key).unwrap();
                        (m.slots[i].busy, m.slots[i].away) = (false, false);
                    }
                }
            }
            Phase::All { ents, inner, .. } => {
                if let Some(f) = inner {
                    self.owner_touch(f);
                    self.model.dl_leave(id, f);
                    self.model.drop_fut(f);
                    self.owner_call_done();
                }
                undo_panics = self.owner_undo(inst, &ents, ended);
            }
        }
        let expect = self.owner_expect();
        self.owners.quiet = false;
        if undo_panics && self.known_bugs.owner_undo_wake_panic {
            // Known bug: the undo stops at the panic.
            self.owner_restore(inst, snap);
            return;
        }
        if self.owners.bomb_touched && self.known_bugs.owner_upgrade_key_clone && !defuse {
            // Known bug: the upgrade's clone of its key panics when dropped.
            self.owner_restore(inst, snap);
            return;
        }
        let fut = self.owners.list.get_mut(&inst).unwrap().futs[j].fut.take();
        let got = catch(|| {
            if defuse {
                defused(|| drop(fut))
            } else {
                drop(fut)
            }
        });
        self.expect_panic("owner future drop", got, expect);
        self.check_reentry("owner future drop");
        self.owner_retire_future(inst, j);
    }

    fn owner_unlock(&mut self, inst: usize, key: usize, all: bool) {
        let m = &mut self.owners.list.get_mut(&inst).unwrap().m;
        let mut release = None;
        let want = match m.find(key) {
            None => Err(MTErr::NotHeld { key }),
            Some(i) if m.slots[i].busy => Err(if m.slots[i].count == 0 {
                MTErr::NotHeld { key }
            } else {
                MTErr::InFlight { key }
            }),
            Some(i) => {
                let s = &mut m.slots[i];
                s.count = if all { 0 } else { s.count - 1 };
                let left = s.count;
                if left == 0 {
                    release = s.gid;
                    m.slots.swap_remove(i);
                }
                Ok(left)
            }
        };
        self.owners.must = false;
        if let Some(g) = release {
            self.model.release(g);
        }
        let expect = self.owner_expect();
        let k = Key::new(key, false);
        let txn = self.owners.list.get_mut(&inst).unwrap().txn.as_mut().unwrap();
        let got = catch(|| match (txn, all) {
            (RTxn::B(t), false) => t.unlock(&k),
            (RTxn::B(t), true) => t.release(&k).map(|()| 0),
            (RTxn::O(t), false) => t.unlock(&k),
            (RTxn::O(t), true) => t.release(&k).map(|()| 0),
        });
        self.expect_panic("owner unlock", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("owner unlock");
        let what = format!("owner {inst}: unlock({key}, all {all})");
        match (got, want) {
            (Err(_), _) => {}
            (Ok(Ok(n)), Ok(w)) => assert_eq!(n, w, "{what}: count left"),
            (Ok(Err(e)), Err(w)) => self.owner_expect_err(&what, &e, &w),
            (Ok(got), want) => panic!("{what}: crate {got:?}, model {want:?}"),
        }
    }

    /// The grants a renewal, a check or a commit looks at, in the set's
    /// order (not those away with a call).
    fn owner_guards(&self, inst: usize) -> Vec<(usize, Gid)> {
        self.owners.list[&inst]
            .m
            .slots
            .iter()
            .filter(|s| !s.away)
            .filter_map(|s| s.gid.map(|g| (s.key, g)))
            .collect()
    }

    /// `renew()` (or only `check()`).
    fn owner_renew(&mut self, inst: usize, renew: bool) {
        let snap = self.owner_snap(inst);
        self.owners.must = false;
        let guards = self.owner_guards(inst);
        let mut want = Ok(());
        for &(k, g) in &guards {
            let checked = self.model.check(g);
            self.owner_call_done();
            if let Err(MErr::Expired(token)) = checked {
                want = Err(MTErr::Expired { key: k, token });
                break;
            }
        }
        let lease = self.owners.list[&inst].m.lease.or(self.model.cfg.default_lease);
        if let (Ok(()), true, Some(lease)) = (&want, renew, lease) {
            for &(k, g) in &guards {
                let renewed = self.model.renew(g, lease);
                self.owner_call_done();
                if let Err(e) = renewed {
                    want = Err(from_lock(k, self.model.guards[&g].mode, true, e));
                    break;
                }
            }
        }
        let expect = self.owner_expect();
        if expect == Expect::Must {
            self.owner_restore(inst, snap);
            return;
        }
        let txn = self.owners.list.get_mut(&inst).unwrap().txn.as_mut().unwrap();
        let got = catch(|| match (txn, renew) {
            (RTxn::B(t), true) => t.renew(),
            (RTxn::B(t), false) => t.check(),
            (RTxn::O(t), true) => t.renew(),
            (RTxn::O(t), false) => t.check(),
        });
        self.expect_panic("owner renew", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("owner renew");
        let what = format!("owner {inst}: renew {renew}");
        match (&got, want) {
            (Err(_), _) | (Ok(Ok(())), Ok(())) => {}
            (Ok(Err(e)), Err(w)) => self.owner_expect_err(&what, e, &w),
            (Ok(got), want) => panic!("{what}: crate {got:?}, model {want:?}"),
        }
        // An error's key is a clone of the table's copy: the caller's to
        // drop, not the crate's.
        defused(|| drop(got));
    }

    /// Commit (`how` 0), abort (1) or drop (2) of owner `inst` in slot
    /// `owner`.
    fn owner_end(&mut self, owner: usize, inst: usize, how: u8) {
        let guards = self.owner_guards(inst);
        let lost: Vec<(usize, u64)> = guards
            .iter()
            .filter(|&&(_, g)| self.model.grant_lost(g))
            .map(|&(k, g)| (k, self.model.guards[&g].token))
            .collect();
        self.owners.must = false;
        for &(_, g) in &guards {
            // A commit releases a live grant without copying its key; only
            // the first lost one is named, by a clone the error carries
            // (the caller's to drop): no clone of a stored key is dropped.
            self.model.release(g);
            self.owner_call_done();
        }
        let o = self.owners.list.get_mut(&inst).unwrap();
        o.m.slots.clear();
        o.m.ended = true;
        let mut cancelled = Vec::new();
        for f in &mut o.futs {
            f.ended_wake = f.watching;
            f.watching = false;
            // pending.rs: after the set's keys are released, the end
            // cancels each waiting call's cell: its wait goes first (a new
            // key's waiter leaves the queue, a grant it had not seen passes
            // on; an upgrade is undone and releases the guard it owns),
            // then the guards the call holds outside the set, in its
            // entries' order (a `lock_all`'s new keys and the held keys it
            // claimed to upgrade).
            match &f.phase {
                Phase::One { inner, kind: EKind::New, .. } => cancelled.push((*inner, Vec::new())),
                Phase::One { inner, kind: EKind::Upgrade(gid), .. } => cancelled.push((*inner, vec![*gid])),
                Phase::All { ents, at, inner: Some(inner) } => {
                    let mut guards: Vec<Gid> = Vec::new();
                    if let EKind::Upgrade(gid) = ents[*at].kind {
                        guards.push(gid);
                    }
                    for (i, e) in ents.iter().enumerate() {
                        match e.kind {
                            _ if i == *at => {}
                            EKind::Upgrade(gid) => guards.push(gid),
                            EKind::New => guards.extend(e.got),
                            EKind::Covered => {}
                        }
                    }
                    cancelled.push((*inner, guards));
                }
                _ => continue,
            }
            let (Phase::One { inner, .. } | Phase::All { inner: Some(inner), .. }) = f.phase else {
                unreachable!("matched above")
            };
            f.phase = Phase::Cancelled { inner };
        }
        let txn = o.txn.take().unwrap();
        // A panic in the set's release is caught before the calls are
        // cancelled (`access.rs` `end_with`, the borrowed form's commit and
        // drop), and each call's cancel is caught on its own
        // (`pending::cancel_all`): a panic unwinds the rest of its own
        // step only, and the next step's wakes run (and may panic, or
        // call back) as in any call.
        let mut must = self.owners.must;
        for (inner, guards) in cancelled {
            self.owners.must = false;
            self.owner_touch(inner);
            self.model.drop_fut(inner);
            self.owner_call_done();
            for g in guards {
                self.model.release(g);
                self.owner_call_done();
            }
            must |= self.owners.must;
        }
        self.owners.must = must;
        let expect = self.owner_expect();
        let got = catch(|| match (txn, how) {
            (RTxn::B(t), 0) => t.commit(),
            (RTxn::O(t), 0) => t.commit(),
            (RTxn::B(t), 1) => Ok(t.abort()),
            (RTxn::O(t), 1) => Ok(t.abort()),
            (t, _) => Ok(drop(t)),
        });
        self.expect_panic("owner end", got.as_ref().map(drop).map_err(|p| *p), expect);
        self.check_reentry("owner end");
        let what = format!("owner {inst}: end {how}");
        match &got {
            Err(_) | Ok(Ok(())) if lost.is_empty() || how != 0 => {}
            Err(_) => {}
            Ok(Ok(())) => panic!("{what}: committed with lost grants {lost:?}"),
            // The first lost grant in the set's order.
            Ok(Err(TransactionError::Expired { key, token })) => assert_eq!(
                Some(&(usize::from(key.id), token.get())),
                lost.first(),
                "{what}: Expired {{ key {}, token {token} }}, lost grants {lost:?}",
                key.id
            ),
            Ok(Err(e)) => panic!("{what}: {e:?}"),
        }
        // The error's key is a clone of the table's copy: the caller's to
        // drop, not the crate's.
        defused(|| drop(got));
        self.owners.slots[owner] = None;
        if self.owners.list[&inst].futs.is_empty() {
            self.owners.list.remove(&inst);
        }
    }

    /// Owner futures woken since their last poll, polled (`PollWoken`).
    pub(super) fn owner_poll_woken(&mut self) {
        let woken: Vec<(usize, usize)> = self
            .owners
            .list
            .iter()
            .flat_map(|(&i, o)| o.futs.iter().filter(|f| f.wakes() > f.wakes_at_poll).map(move |f| (i, f.slot)))
            .collect();
        for (i, slot) in woken {
            let at = self.owners.list.get(&i).and_then(|o| o.futs.iter().position(|f| f.slot == slot));
            if let Some(j) = at {
                self.owner_poll(i, j);
            }
        }
    }

    /// Every owner's view against the model's; no lost wakeup of a call;
    /// the deadlocks the table broke last.
    pub(super) fn owner_compare(&self) {
        // The keys are clones of the table's copies: the caller's to drop.
        let recent: Vec<MCycle> = defused(|| self.table.recent_deadlocks().iter().map(cycle_of).collect());
        assert_eq!(
            recent,
            self.model.dl.recent.iter().cloned().collect::<Vec<_>>(),
            "recent_deadlocks()"
        );
        assert_eq!(
            self.table.deadlock_stats().reorders,
            self.model.dl.reorders,
            "deadlock_stats().reorders (soft deadlocks broken); detector {}",
            self.model.dl_describe()
        );
        for (inst, o) in &self.owners.list {
            for f in &o.futs {
                let inner = f.inner().filter(|i| self.model.futs.contains_key(i));
                if inner.is_some_and(|i| self.model.can_progress(i)) || f.ended_wake {
                    assert!(
                        f.wakes() > f.wakes_at_poll,
                        "lost wakeup: owner {inst}'s call can make progress but was not woken"
                    );
                }
                let mut want = usize::from(f.watching);
                if let Some(m) = inner.map(|i| &self.model.futs[&i]) {
                    want += usize::from(m.slot) + usize::from(matches!(m.sleep, Some((_, true))));
                }
                let handles = WAKERS[f.slot].handles.load(SeqCst) - 1;
                // An owned call's registration with its transaction is
                // taken, and woken, when another call of it takes a grant
                // (or begins a wait) while this one waits: the wait searches
                // the graph again on its next poll (`Access::took_grant`),
                // which registers its waker again.
                let rewoken = f.watching && handles + 1 == want && f.wakes() > f.wakes_at_poll;
                assert!(
                    handles == want || rewoken,
                    "owner {inst}'s call: handles of its waker ({:?}): {handles}, want {want}",
                    f.phase
                );
            }
            let Some(txn) = &o.txn else { continue };
            // A borrowed transaction is borrowed by its pending call: safe
            // code cannot look at it until the call is done or dropped (and
            // a fresh `lock_all` fills its set while it waits), so neither
            // does the harness (see `owner_start`).
            if matches!(txn, RTxn::B(_)) && o.futs.iter().any(|f| f.fut.is_some()) {
                continue;
            }
            let m = &o.m;
            let (len, counts): (usize, Vec<(usize, Option<Mode>, Option<FencingToken>)>) = match txn {
                RTxn::B(t) => (t.len(), (0..KEYS as u8).map(|k| (t.count(&k), t.mode(&k), t.token(&k))).collect()),
                RTxn::O(t) => (t.len(), (0..KEYS as u8).map(|k| (t.count(&k), t.mode(&k), t.token(&k))).collect()),
            };
            assert_eq!(len, m.held(), "owner {inst}: len()");
            for (k, got) in counts.into_iter().enumerate() {
                let want = match m.find(k).map(|i| &m.slots[i]) {
                    Some(s) if s.count > 0 => {
                        let g = s.gid.filter(|_| !s.away).map(|g| &self.model.guards[&g]);
                        (s.count, g.map(|g| mode_of(g.mode)), g.map(|g| g.token))
                    }
                    _ => (0, None, None),
                };
                assert_eq!(
                    (got.0, got.1, got.2.map(FencingToken::get)),
                    want,
                    "owner {inst}: count, mode, token of key {k}"
                );
            }
        }
    }

    /// The end of a run: every owner's call dropped, every owner dropped;
    /// nothing of theirs is held.
    pub(super) fn owners_finish(&mut self) {
        let insts: Vec<usize> = self.owners.list.keys().copied().collect();
        for inst in insts {
            // An ended owner goes with its last call.
            while self.owners.list.get(&inst).is_some_and(|o| !o.futs.is_empty()) {
                self.owner_drop_future(inst, 0, true);
                self.compare();
            }
        }
        for owner in 0..OWNERS {
            if let Some(inst) = self.owners.slots[owner] {
                self.owner_end(owner, inst, 2);
                self.compare();
            }
        }
        assert!(self.owners.list.is_empty(), "owners left");
    }
}

// ---------------------------------------------------------------------------
// Deadlock detection (`src/transactions/deadlock.rs`, `src/keys/edges.rs`)
// ---------------------------------------------------------------------------

/// The table's search limit (`Builder::deadlock_search_limit`, default).
const DL_LIMIT: usize = 50;
/// How many broken cycles the table keeps (`Builder::deadlock_history`,
/// default).
const DL_HISTORY: usize = 8;

/// One wait of a cycle: the transaction, the key, the mode asked (an
/// upgrade asks `Exclusive`).
pub(super) type MCycle = Vec<(u64, usize, MMode)>;

/// A wait the search walks through: transaction, key, mode.
type MNode = (u64, usize, MMode);

/// An edge: the transaction waited for, and its waiter's mode if it waits
/// ahead on the same key.
pub(super) type MEdge = (u64, Option<MMode>);

/// A wait registered with the detector.
#[derive(Debug, Clone)]
pub(super) struct MWait {
    key: usize,
    mode: MMode,
    /// The inner future (lock or upgrade) whose wait it is: the
    /// registration ends with it (`wait_unless_ended`'s guard).
    fid: Fid,
    /// Answered as a deadlock's victim (its wait ends in the same call).
    victim: bool,
}

/// The detector's registry, by transaction id (every wait of the
/// transaction, in the order they registered: an owned transaction's
/// pending calls each have one), and the cycles broken, oldest first.
#[derive(Debug, Clone, Default)]
pub(super) struct MDetector {
    waiting: BTreeMap<u64, Vec<MWait>>,
    recent: VecDeque<MCycle>,
    /// Soft deadlocks broken by a grant ahead of the queue
    /// (`DeadlockStats::reorders`).
    reorders: u64,
}

impl MDetector {
    pub(super) fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.recent.is_empty()
    }
}

fn compatible(a: MMode, b: MMode) -> bool {
    a == MMode::Shared && b == MMode::Shared
}

fn want_mode(w: MWant) -> MMode {
    match w {
        MWant::Grant(m) => m,
        MWant::Upgrade { .. } => MMode::Exclusive,
    }
}

impl Model {
    /// edges.rs `wait_edges`: whom `owner`'s waiter on key `k` (the first
    /// of the queue that is `owner`'s) waits for: the waiters ahead of it
    /// of a transaction whose mode excludes its own, then the live holders
    /// of another transaction whose mode excludes it (for an upgrade: every
    /// other holder), duplicates kept, in the search's canonical order (by
    /// transaction, a waiter ahead before a holder); a waiter ahead with its
    /// mode. `None` if `owner` has no waiter queued on `k`.
    pub(super) fn dl_wait_edges(&self, owner: u64, k: usize) -> Option<Vec<MEdge>> {
        let key = &self.keys[k];
        let mut ahead = Vec::new();
        let mut mine = None;
        for f in &key.queue {
            let fut = &self.futs[f];
            if fut.owner == owner {
                mine = Some(fut.want);
                break;
            }
            if fut.owner != 0 {
                ahead.push((fut.owner, want_mode(fut.want)));
            }
        }
        let want = mine?;
        let asked = want_mode(want);
        let mut out: Vec<MEdge> = ahead
            .into_iter()
            .filter(|&(_, m)| !compatible(m, asked))
            .map(|(o, m)| (o, Some(m)))
            .collect();
        for h in key.holders.iter() {
            let blocks = match want {
                MWant::Upgrade { token, .. } => h.token != token,
                MWant::Grant(m) => !compatible(key.mode, m),
            };
            if blocks && h.owner != 0 && h.owner != owner && self.live(h) {
                out.push((h.owner, None));
            }
        }
        // deadlock.rs `edges_of`: the search walks them in canonical order.
        out.sort_by_key(|&(o, ahead)| (o, ahead.is_none()));
        Some(out)
    }

    /// deadlock.rs `registered`: `owner`'s live (not a victim's) registered
    /// waits as nodes, in the order they registered.
    fn dl_live(&self, owner: u64) -> Vec<MNode> {
        self.dl
            .waiting
            .get(&owner)
            .map(|ws| ws.iter().filter(|w| !w.victim).map(|w| (owner, w.key, w.mode)).collect())
            .unwrap_or_default()
    }

    /// deadlock.rs `find_cycle`: the same depth-first walk, in the same
    /// order (a transaction's edges: those of each of its live waits, in
    /// the order they registered, each as `dl_wait_edges` lists them; a
    /// transaction is visited once; at most `DL_LIMIT` visited; a waiter
    /// ahead of an exclusive wait on the same key, with no other live wait,
    /// marked, not followed), through registered waits and waiters ahead on
    /// the key of the wait it comes from (registered or not): the path of
    /// waits from `owner`'s wait `fid` whose last waits for `owner`.
    fn dl_find_cycle(&self, owner: u64, fid: Fid) -> Option<Vec<MNode>> {
        let w = self.dl.waiting.get(&owner)?.iter().find(|w| w.fid == fid && !w.victim)?;
        let start = (owner, w.key, w.mode);
        let first: Vec<(MEdge, MNode)> =
            self.dl_wait_edges(owner, start.1)?.into_iter().map(|e| (e, start)).collect();
        if !first.iter().any(|&((o, ahead), _)| ahead.is_some() || self.dl.waiting.contains_key(&o)) {
            return None;
        }
        let mut path = vec![start];
        let mut visited = vec![owner];
        let mut frames: Vec<(Vec<(MEdge, MNode)>, usize)> = vec![(first, 0)];
        while let Some((edges, next)) = frames.last_mut() {
            let Some(&((to, ahead), from)) = edges.get(*next) else {
                frames.pop();
                path.pop();
                continue;
            };
            *next += 1;
            // The path goes through the wait this edge is of.
            *path.last_mut().unwrap() = from;
            if to == owner {
                return Some(path);
            }
            if visited.contains(&to) {
                continue;
            }
            // deadlock.rs: a holder not registered is a dead end, not marked.
            if ahead.is_none() && !self.dl.waiting.contains_key(&to) {
                continue;
            }
            if visited.len() >= DL_LIMIT {
                continue;
            }
            visited.push(to);
            let nodes = if self.dl.waiting.contains_key(&to) {
                self.dl_live(to)
            } else {
                ahead.map(|m| vec![(to, from.1, m)]).unwrap_or_default()
            };
            // deadlock.rs `passes_over`: a waiter ahead of an exclusive
            // wait, waiting on the same key (its only live wait), is marked,
            // not followed.
            if let [node] = nodes[..] {
                if ahead.is_some() && from.2 == MMode::Exclusive && node.1 == from.1 {
                    continue;
                }
            }
            let mut run = Vec::new();
            for node in nodes {
                if let Some(edges) = self.dl_wait_edges(to, node.1) {
                    run.extend(edges.into_iter().map(|e| (e, node)));
                }
            }
            if let Some(&(_, node)) = run.first() {
                path.push(node);
                frames.push((run, 0));
            }
        }
        None
    }

    /// deadlock.rs `enter_wait`: transaction `owner`'s wait for `key` in
    /// `mode` (inner future `fid`, queued) is registered beside its other
    /// waits, and searched: `Err` with the cycle it closes (the victim's
    /// wait first), recorded in the history.
    pub(super) fn dl_enter(&mut self, owner: u64, fid: Fid, key: usize, mode: MMode) -> Result<bool, MCycle> {
        self.dl.waiting.entry(owner).or_default().push(MWait { key, mode, fid, victim: false });
        if self.dl.waiting.len() == 1 {
            return Ok(true);
        }
        let Some(mut cycle) = self.dl_find_cycle(owner, fid) else {
            return Ok(true);
        };
        // deadlock.rs `break_softly`: a soft deadlock is broken by a grant
        // ahead of the queue, and the wait searches again.
        while self.dl_break_softly(&cycle) {
            self.dl.reorders += 1;
            match self.dl_find_cycle(owner, fid) {
                None => return Ok(true),
                Some(again) => cycle = again,
            }
        }
        // The crate confirms the cycle with its shards locked at once; here
        // nothing changed since the walk, so it must hold.
        for (i, &(o, k, _)) in cycle.iter().enumerate() {
            let next = cycle[(i + 1) % cycle.len()].0;
            assert!(
                self.dl_wait_edges(o, k).is_some_and(|e| e.iter().any(|&(to, _)| to == next)),
                "model: cycle {cycle:?}: {o} is not blocked by {next}"
            );
        }
        let waits = self.dl.waiting.get_mut(&owner).unwrap();
        waits.iter_mut().find(|w| w.fid == fid).unwrap().victim = true;
        let record: MCycle = cycle;
        if self.dl.recent.len() == DL_HISTORY {
            self.dl.recent.pop_front();
        }
        self.dl.recent.push_back(record.clone());
        Err(record)
    }

    /// deadlock.rs `break_softly` and queue/reorder.rs `grant_past_queue`:
    /// the waits of `cycle`, from the last to the first, each tried as a
    /// candidate (asks shared; the only live registered wait of its
    /// transaction), granted if its key is held shared by live holders and
    /// a waiter queued ahead of it (the first of its transaction's there)
    /// asks for what excludes it: unlinked, a fresh token, its lease from
    /// now, woken if armed, counted as a handoff, and the head made to arm
    /// for the holders' deadline. `true` if one was granted.
    fn dl_break_softly(&mut self, cycle: &[MNode]) -> bool {
        for &(o, k, m) in cycle.iter().rev() {
            if m != MMode::Shared {
                continue;
            }
            let live = self.dl_live(o);
            if !(live.len() == 1 && live[0].1 == k) {
                continue;
            }
            let key = &self.keys[k];
            if key.holders.is_empty() || key.mode != MMode::Shared || self.any_lapsed(k) {
                continue;
            }
            let mut blocked = false;
            let mut mine = None;
            for &f in &key.queue {
                let fut = &self.futs[&f];
                if fut.owner == o {
                    mine = Some(f);
                    break;
                }
                blocked |= fut.want != MWant::Grant(MMode::Shared);
            }
            let Some(f) = mine else { continue };
            if self.futs[&f].want != MWant::Grant(MMode::Shared) || !blocked {
                continue;
            }
            self.keys[k].queue.retain(|&x| x != f);
            let token = self.mint(k);
            let (deadline, since) = self.lease_from(self.futs[&f].lease);
            let fut = self.fut(f);
            assert_eq!(fut.state, MState::Waiting, "model: queued future waits");
            fut.state = MState::Granted { token, deadline };
            if std::mem::replace(&mut fut.slot, false) {
                self.wake(f);
            }
            self.keys[k].holders.push(MHolder {
                token,
                deadline,
                since,
                by: By::Slot(f),
                owner: o,
            });
            self.stats.handoffs += 1;
            self.stats.acquisitions += 1;
            self.stats.contended += 1;
            self.nudge_head_for_timer(k);
            return true;
        }
        false
    }

    /// The wait of inner future `fid` ends (resolved, or dropped): its
    /// registration, if `owner` has one for it, goes.
    pub(super) fn dl_leave(&mut self, owner: u64, fid: Fid) {
        if let Some(waits) = self.dl.waiting.get_mut(&owner) {
            waits.retain(|w| w.fid != fid);
            if waits.is_empty() {
                self.dl.waiting.remove(&owner);
            }
        }
    }

    /// Whether `cycle` is a cycle of the model's wait-for graph now: each
    /// wait registered (not a victim's), its waiter queued, blocked by the
    /// next transaction (the last by the first).
    pub(super) fn dl_is_cycle(&self, cycle: &[(u64, usize, MMode)]) -> bool {
        !cycle.is_empty()
            && cycle.iter().enumerate().all(|(i, &(o, k, m))| {
                let next = cycle[(i + 1) % cycle.len()].0;
                self.dl.waiting.get(&o).is_none_or(|ws| ws.iter().any(|w| w.key == k && w.mode == m))
                    && self.dl_wait_edges(o, k).is_some_and(|e| e.iter().any(|&(to, _)| to == next))
            })
    }

    /// The registry and each registered wait's edges, for messages and traces.
    pub(super) fn dl_describe(&self) -> String {
        let waits: Vec<String> = self
            .dl
            .waiting
            .iter()
            .flat_map(|(o, ws)| ws.iter().map(move |w| (o, w)))
            .map(|(o, w)| {
                format!(
                    "{o} waits for key {} {:?} (fut {}{}) blocked by {:?}",
                    w.key,
                    w.mode,
                    w.fid,
                    if w.victim { ", victim" } else { "" },
                    self.dl_wait_edges(*o, w.key)
                )
            })
            .collect();
        format!("[{}]; recent {:?}; reorders {}", waits.join("; "), self.dl.recent, self.dl.reorders)
    }
}
