//! The bank: concurrent transfers between accounts (each locks two accounts
//! exclusively, a self-transfer one account asked twice) and audits (each
//! locks every account shared and sums the balances), written twice:
//!
//! - on keylock, with one [`keylock::Transaction`] per transfer or audit
//!   (`lock_all`: duplicates merged, a canonical order, all or nothing);
//! - on keylock, with transfers that lock their two accounts one by one in
//!   the order asked (no sorting), so that transfers and audits deadlock:
//!   the table answers each cycle with `TransactionError::Deadlock`, and
//!   the victim aborts and retries (counted);
//! - as users write it today: a `DashMap<u64, Arc<tokio::sync::RwLock<()>>>`,
//!   the keys of each operation sorted and de-duplicated by hand, then
//!   locked one by one (`write_owned` for a transfer, `read_owned` for an
//!   audit), its entries kept for ever; and the same map with cleanup: after
//!   releasing, an operation removes each of its entries that nobody else
//!   holds (`remove_if` on the `Arc`'s count), so an idle account costs no
//!   memory, as in keylock;
//! - on keylock, with plain guards sorted by hand (what a transaction is
//!   judged against).
//!
//! With the `tokio` feature (`cargo run --release --features tokio
//! --example bank`), keylock's tables are built with
//! `Builder::tokio_time()`, as a tokio program's would be: their lock
//! futures spend tokio's cooperative budget, as tokio's `RwLock` does.
//!
//! Two shapes are run: 64 accounts with 2 auditors (hot: transfers
//! contend) and 100,000 accounts with transfers alone (cool: nearly every
//! transfer is uncontended, so what shows is the per-transaction cost; see
//! [`shape`] for why without audits).
//!
//! Balances are plain loads and stores of atomics (no read-modify-write), so
//! a lock that let two transfers of one account in together would lose an
//! update, and an audit that saw a transfer half done would see a wrong
//! total: the run checks both. Shared by `examples/bank.rs` and
//! `examples/compare.rs`. With `BANK_STATS` set in the environment, each
//! keylock run prints its table's counters (grants, waits) to stderr; with
//! `BANK_AUDITORS=N`, N auditors in both shapes; with `BANK_ACCOUNTS=N`,
//! only the shape of N accounts runs; with
//! `BANK_ONLY=txn`, `dashmap`, `cleanup`, `guards` or `unsorted`, only that bank runs (to profile
//! one bank at a time, e.g. under `perf record`; `floor` is the same
//! harness with no locks at all, the ceiling no lock can pass: it loses
//! updates, so it is reported but not checked; `fixed` is the bank with one
//! tokio, then one async-lock, reader-writer lock per account made when it
//! opens, looked up by index: no map at all, the most any keyed table of
//! those locks could reach); with `BANK_DETECTION=off`,
//! the transactions bank's table has deadlock detection off (the cost of
//! detection on real contended waits: run it against the default); with
//! `BANK_GUARDS_FOR=transfers` (or `audits`), the transactions bank does
//! that part with sorted plain guards on its table, as the guards bank
//! does, and the other part with transactions (which part of the gap
//! between the two banks is whose).

use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use keylock::{LockTable, Mode, TransactionError};
use tokio::runtime::Runtime;

/// The bank's two shapes, in accounts: hot (transfers contend) and cool
/// (nearly every transfer is uncontended: the per-transaction cost).
pub(crate) const SHAPES: &[usize] = &[64, 100_000];

/// The shapes to run: [`SHAPES`], or only the one `BANK_ACCOUNTS=N` names
/// (to profile one shape at a time).
pub(crate) fn shapes() -> Vec<usize> {
    match std::env::var("BANK_ACCOUNTS") {
        Ok(n) => vec![n
            .parse()
            .expect("BANK_ACCOUNTS: a number of accounts, e.g. 100000")],
        Err(_) => SHAPES.to_vec(),
    }
}

/// keylock's tables here spend tokio's cooperative budget, as tokio's own
/// locks do (`Builder::tokio_time`), when the `tokio` feature is on.
trait Cooperative {
    fn cooperative(self) -> Self;
}

impl Cooperative for keylock::Builder<u64> {
    fn cooperative(self) -> Self {
        #[cfg(feature = "tokio")]
        return self.tokio_time();
        #[cfg(not(feature = "tokio"))]
        self
    }
}

/// The run of one shape: 32 tellers, each making 10,000 transfers (1,000
/// with `quick`) among 64 accounts with 2 auditors, or among 100,000
/// accounts with none: there an audit locks every account, and what it
/// would measure is the audit, not the transactions (a keylock
/// transaction's `lock_all` takes every free key in one poll, so under
/// tokio an audit of 100,000 accounts holds its worker for the whole call,
/// where tokio's own locks yield every 128). `BANK_AUDITORS=N` sets the
/// auditors of both shapes.
pub(crate) fn shape(accounts: usize, quick: bool) -> BankRun {
    let cool = accounts > 1_000;
    BankRun {
        accounts,
        tellers: 32,
        transfers: if quick { 1_000 } else { 10_000 },
        auditors: auditors().unwrap_or(if cool { 0 } else { 2 }),
    }
}

/// The auditors asked for by `BANK_AUDITORS`, if any (0 leaves only the
/// transfers).
fn auditors() -> Option<usize> {
    std::env::var("BANK_AUDITORS")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// Each account's opening balance.
pub(crate) const OPENING: i64 = 1_000;

/// The balances every bank keeps, behind whatever locks it uses.
pub(crate) struct Ledger(Vec<AtomicI64>);

impl Ledger {
    fn new(accounts: usize) -> Self {
        Self((0..accounts).map(|_| AtomicI64::new(OPENING)).collect())
    }

    /// Moves `amount` from `from` to `to`; the caller holds both exclusively.
    /// Load, then store: not atomic on purpose (see the module docs).
    fn transfer(&self, from: u64, to: u64, amount: i64) {
        let (from, to) = (&self.0[from as usize], &self.0[to as usize]);
        from.store(from.load(Relaxed) - amount, Relaxed);
        to.store(to.load(Relaxed) + amount, Relaxed);
    }

    /// The sum of every balance; the caller holds every account shared.
    fn total(&self) -> i64 {
        self.0.iter().map(|b| b.load(Relaxed)).sum()
    }
}

/// A bank: transfers and audits over one ledger.
pub(crate) trait Bank: Send + Sync + 'static {
    const NAME: &'static str;

    fn open(accounts: usize) -> Self;

    fn ledger(&self) -> &Ledger;

    /// The lock table's counters, if it has some.
    fn stats(&self) -> String {
        String::new()
    }

    /// Operations retried after a deadlock answer.
    fn retries(&self) -> u64 {
        0
    }

    /// Locks `from` and `to` exclusively, moves `amount`, unlocks.
    fn transfer(&self, from: u64, to: u64, amount: i64) -> impl Future<Output = ()> + Send + '_;

    /// Locks every account shared and returns the total.
    fn audit(&self) -> impl Future<Output = i64> + Send + '_;
}

/// The bank on keylock: one transaction per operation.
pub(crate) struct KeylockBank {
    table: LockTable<u64>,
    ledger: Ledger,
    /// The part done with plain guards instead (`BANK_GUARDS_FOR`).
    guards_for: GuardsFor,
}

/// Which part of the transactions bank runs on plain guards.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GuardsFor {
    Neither,
    Transfers,
    Audits,
}

impl GuardsFor {
    fn from_env() -> Self {
        match std::env::var("BANK_GUARDS_FOR").as_deref() {
            Err(_) => Self::Neither,
            Ok("transfers") => Self::Transfers,
            Ok("audits") => Self::Audits,
            Ok(other) => panic!("BANK_GUARDS_FOR: `transfers` or `audits`, not {other:?}"),
        }
    }
}

/// A transfer on sorted plain guards: `from` and `to` locked in key order.
async fn guards_transfer(table: &LockTable<u64>, ledger: &Ledger, from: u64, to: u64, amount: i64) {
    let mut keys = [from, to];
    keys.sort_unstable();
    let first = table.lock(keys[0]).await;
    let second = if keys[1] != keys[0] {
        Some(table.lock(keys[1]).await)
    } else {
        None
    };
    ledger.transfer(from, to, amount);
    drop((second, first));
}

/// An audit on plain shared guards, every account in order.
async fn guards_audit(table: &LockTable<u64>, ledger: &Ledger) -> i64 {
    let accounts = ledger.0.len() as u64;
    let mut guards = Vec::with_capacity(accounts as usize);
    for a in 0..accounts {
        guards.push(table.lock_shared(a).await);
    }
    let total = ledger.total();
    drop(guards);
    total
}

/// The transactions bank's table: with `BANK_DETECTION=off` in the
/// environment, deadlock detection is off (`deadlock_search_limit(0)`), to
/// measure what detection costs its contended waits (its transfers lock in
/// a canonical order, so it never deadlocks either way).
fn transactions_table() -> LockTable<u64> {
    let off = std::env::var("BANK_DETECTION").is_ok_and(|v| v == "off");
    LockTable::builder()
        .cooperative()
        .deadlock_search_limit(if off { 0 } else { 50 })
        .build()
}

impl Bank for KeylockBank {
    const NAME: &'static str = "keylock (transactions)";

    fn open(accounts: usize) -> Self {
        Self {
            table: transactions_table(),
            ledger: Ledger::new(accounts),
            guards_for: GuardsFor::from_env(),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn stats(&self) -> String {
        format!("{:?} {:?}", self.table.stats(), self.table.deadlock_stats())
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        if self.guards_for == GuardsFor::Transfers {
            return guards_transfer(&self.table, &self.ledger, from, to, amount).await;
        }
        let mut txn = self.table.transaction();
        txn.lock_all([(from, Mode::Exclusive), (to, Mode::Exclusive)])
            .await
            .expect("no deadline: a transfer always gets its accounts");
        self.ledger.transfer(from, to, amount);
        txn.commit().expect("no lease: the grants cannot lapse");
    }

    async fn audit(&self) -> i64 {
        if self.guards_for == GuardsFor::Audits {
            return guards_audit(&self.table, &self.ledger).await;
        }
        let accounts = self.ledger.0.len() as u64;
        let mut txn = self.table.transaction();
        txn.lock_all((0..accounts).map(|a| (a, Mode::Shared)))
            .await
            .expect("no deadline: an audit always gets its accounts");
        let total = self.ledger.total();
        txn.commit().expect("no lease: the grants cannot lapse");
        total
    }
}

/// The bank on keylock transactions whose transfers lock their accounts in
/// the order asked, unsorted: transfers deadlock with each other and with
/// audits; each cycle's victim aborts and retries.
pub(crate) struct KeylockUnorderedBank {
    table: LockTable<u64>,
    ledger: Ledger,
    retries: AtomicU64,
}

impl KeylockUnorderedBank {
    /// Counts a retry after a deadlock answer; anything else is a bug here.
    fn retry(&self, error: TransactionError<u64>) {
        assert!(
            matches!(error, TransactionError::Deadlock(_)),
            "no deadline, no lease: only a deadlock fails a lock: {error}"
        );
        self.retries.fetch_add(1, Relaxed);
    }
}

impl Bank for KeylockUnorderedBank {
    const NAME: &'static str = "keylock (transactions, unsorted, deadlocks retried)";

    fn open(accounts: usize) -> Self {
        Self {
            table: LockTable::builder().cooperative().build(),
            ledger: Ledger::new(accounts),
            retries: AtomicU64::new(0),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn stats(&self) -> String {
        format!("{:?} {:?}", self.table.stats(), self.table.deadlock_stats())
    }

    fn retries(&self) -> u64 {
        self.retries.load(Relaxed)
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        loop {
            let mut txn = self.table.transaction();
            // `from` first, then `to`: two transfers between the same two
            // accounts in opposite directions form a cycle.
            let locked = match txn.lock(from, Mode::Exclusive).await {
                Ok(_) => txn.lock(to, Mode::Exclusive).await.map(drop),
                Err(e) => Err(e),
            };
            match locked {
                Ok(()) => {
                    self.ledger.transfer(from, to, amount);
                    txn.commit().expect("no lease: the grants cannot lapse");
                    return;
                }
                // The victim aborts (dropping `txn`), and tries again.
                Err(error) => self.retry(error),
            }
        }
    }

    async fn audit(&self) -> i64 {
        let accounts = self.ledger.0.len() as u64;
        loop {
            let mut txn = self.table.transaction();
            match txn.lock_all((0..accounts).map(|a| (a, Mode::Shared))).await {
                Ok(_) => {
                    let total = self.ledger.total();
                    txn.commit().expect("no lease: the grants cannot lapse");
                    return total;
                }
                Err(error) => self.retry(error),
            }
        }
    }
}

/// The bank on keylock's plain guards, keys sorted by hand (for
/// comparison with the transactions).
pub(crate) struct KeylockGuardsBank {
    table: LockTable<u64>,
    ledger: Ledger,
}

impl Bank for KeylockGuardsBank {
    const NAME: &'static str = "keylock (sorted guards)";

    fn open(accounts: usize) -> Self {
        Self {
            table: LockTable::builder().cooperative().build(),
            ledger: Ledger::new(accounts),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn stats(&self) -> String {
        format!("{:?}", self.table.stats())
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        guards_transfer(&self.table, &self.ledger, from, to, amount).await;
    }

    async fn audit(&self) -> i64 {
        guards_audit(&self.table, &self.ledger).await
    }
}

type RwLockArc = Arc<tokio::sync::RwLock<()>>;

/// A reader-writer lock a fixed-lock bank can use: tokio's or async-lock's.
pub(crate) trait AccountLock: Default + Send + Sync + 'static {
    const NAME: &'static str;
    fn write(&self) -> impl Future<Output = impl Send + '_> + Send + '_;
    fn read(&self) -> impl Future<Output = impl Send + '_> + Send + '_;
}

impl AccountLock for tokio::sync::RwLock<()> {
    const NAME: &'static str = "a tokio RwLock per account, allocated up front (no map)";
    fn write(&self) -> impl Future<Output = impl Send + '_> + Send + '_ {
        self.write()
    }
    fn read(&self) -> impl Future<Output = impl Send + '_> + Send + '_ {
        self.read()
    }
}

impl AccountLock for async_lock::RwLock<()> {
    const NAME: &'static str = "an async-lock RwLock per account, allocated up front (no map)";
    fn write(&self) -> impl Future<Output = impl Send + '_> + Send + '_ {
        self.write()
    }
    fn read(&self) -> impl Future<Output = impl Send + '_> + Send + '_ {
        self.read()
    }
}

/// The bank with one lock per account, made when the bank opens and never
/// looked up: no map, no insert, no removal. What the best reader-writer
/// locks of the field reach when nothing is keyed, sorted by hand as the
/// DashMap bank is: the ceiling of any lock table built on such locks.
pub(crate) struct FixedLocksBank<L> {
    locks: Vec<L>,
    ledger: Ledger,
}

impl<L: AccountLock> Bank for FixedLocksBank<L> {
    const NAME: &'static str = L::NAME;

    fn open(accounts: usize) -> Self {
        Self {
            locks: (0..accounts).map(|_| L::default()).collect(),
            ledger: Ledger::new(accounts),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        let mut keys = [from, to];
        keys.sort_unstable();
        let first = self.locks[keys[0] as usize].write().await;
        let second = if keys[1] != keys[0] {
            Some(self.locks[keys[1] as usize].write().await)
        } else {
            None
        };
        self.ledger.transfer(from, to, amount);
        drop((second, first));
    }

    async fn audit(&self) -> i64 {
        let mut guards = Vec::with_capacity(self.locks.len());
        for lock in &self.locks {
            guards.push(lock.read().await);
        }
        let total = self.ledger.total();
        drop(guards);
        total
    }
}

/// The harness with no locks: what the tellers and auditors cost by
/// themselves (tasks, yields, clocks, the ledger). No lock can make a bank
/// faster than this; it loses updates and sees half-done transfers, so its
/// runs are not checked.
pub(crate) struct NoLockBank {
    ledger: Ledger,
}

impl Bank for NoLockBank {
    const NAME: &'static str = "no locks (the harness's ceiling; unchecked)";

    fn open(accounts: usize) -> Self {
        Self {
            ledger: Ledger::new(accounts),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        self.ledger.transfer(from, to, amount);
    }

    async fn audit(&self) -> i64 {
        self.ledger.total()
    }
}

/// The bank as written by hand today: a map of reader-writer locks, keys
/// sorted and de-duplicated before locking; with `CLEANUP`, after releasing,
/// each of the operation's entries is removed if nobody else holds its lock
/// (the map holds the only `Arc`), so the map keeps only the accounts in
/// use; without, entries are kept for ever.
pub(crate) struct HandBank<const CLEANUP: bool> {
    locks: DashMap<u64, RwLockArc>,
    ledger: Ledger,
}

/// The hand-written bank, its entries kept.
pub(crate) type DashMapBank = HandBank<false>;
/// The hand-written bank with cleanup.
pub(crate) type DashMapCleanupBank = HandBank<true>;

impl<const CLEANUP: bool> HandBank<CLEANUP> {
    fn lock_of(&self, account: u64) -> RwLockArc {
        Arc::clone(&self.locks.entry(account).or_default())
    }

    /// With `CLEANUP`, removes `account`'s entry unless someone else holds
    /// or waits for its lock.
    fn clean(&self, account: u64) {
        if CLEANUP {
            self.locks
                .remove_if(&account, |_, lock| Arc::strong_count(lock) == 1);
        }
    }
}

impl<const CLEANUP: bool> Bank for HandBank<CLEANUP> {
    const NAME: &'static str = if CLEANUP {
        "DashMap<K, Arc<RwLock<()>>> (sorted, cleanup)"
    } else {
        "DashMap<K, Arc<RwLock<()>>> (sorted)"
    };

    fn open(accounts: usize) -> Self {
        Self {
            locks: DashMap::new(),
            ledger: Ledger::new(accounts),
        }
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    async fn transfer(&self, from: u64, to: u64, amount: i64) {
        let mut keys = [from, to];
        keys.sort_unstable();
        let first = self.lock_of(keys[0]).write_owned().await;
        let second = if keys[1] != keys[0] {
            Some(self.lock_of(keys[1]).write_owned().await)
        } else {
            None
        };
        self.ledger.transfer(from, to, amount);
        drop((second, first));
        self.clean(keys[0]);
        if keys[1] != keys[0] {
            self.clean(keys[1]);
        }
    }

    async fn audit(&self) -> i64 {
        let accounts = self.ledger.0.len() as u64;
        let mut guards = Vec::with_capacity(accounts as usize);
        for a in 0..accounts {
            guards.push(self.lock_of(a).read_owned().await);
        }
        let total = self.ledger.total();
        drop(guards);
        for a in 0..accounts {
            self.clean(a);
        }
        total
    }
}

/// The shape of one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BankRun {
    pub(crate) accounts: usize,
    /// Tasks doing transfers.
    pub(crate) tellers: usize,
    /// Transfers per teller.
    pub(crate) transfers: u64,
    /// Tasks doing audits, back to back, while the transfers run.
    pub(crate) auditors: usize,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub(crate) struct BankOutcome {
    pub(crate) elapsed: Duration,
    pub(crate) transfers: u64,
    pub(crate) audits: u64,
    /// Every transfer's wait for its locks, in ns, sorted.
    pub(crate) transfer_waits: Vec<u64>,
    /// Audits that saw a total other than the opening total.
    pub(crate) bad_audits: u64,
    /// Operations retried after a deadlock answer.
    pub(crate) retries: u64,
    /// The closing total, which must equal the opening total.
    pub(crate) closing: i64,
    pub(crate) opening: i64,
}

impl BankOutcome {
    pub(crate) fn transfers_per_sec(&self) -> f64 {
        self.transfers as f64 / self.elapsed.as_secs_f64()
    }

    pub(crate) fn audits_per_sec(&self) -> f64 {
        self.audits as f64 / self.elapsed.as_secs_f64()
    }

    /// The `p`-th percentile of the transfers' waits (0.0..=1.0).
    pub(crate) fn wait(&self, p: f64) -> Duration {
        let i = ((self.transfer_waits.len() as f64 - 1.0) * p).round() as usize;
        Duration::from_nanos(self.transfer_waits.get(i).copied().unwrap_or(0))
    }

    /// Panics, naming what broke, unless the money was conserved and every
    /// audit saw the opening total.
    pub(crate) fn assert_conserved(&self, bank: &str) {
        assert_eq!(
            self.closing, self.opening,
            "{bank}: money was created or lost (a transfer's update was lost)"
        );
        assert_eq!(
            self.bad_audits, 0,
            "{bank}: an audit saw a transfer half done"
        );
    }
}

/// A small, fast generator (xorshift64*), one per task, seeded per task.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Runs the bank `B` on `rt`: the tellers' transfers, with the auditors
/// auditing back to back until the last transfer is done. Panics if the run
/// takes longer than `hang` (nothing may hang).
pub(crate) fn run<B: Bank>(rt: &Runtime, shape: BankRun, hang: Duration) -> BankOutcome {
    let bank = Arc::new(B::open(shape.accounts));
    let opening = bank.ledger().total();
    let done = Arc::new(AtomicU64::new(0));
    let outcome = rt.block_on(async {
        let start = Instant::now();
        let mut auditors = Vec::new();
        for _ in 0..shape.auditors {
            let (bank, done) = (Arc::clone(&bank), Arc::clone(&done));
            auditors.push(tokio::spawn(async move {
                let (mut audits, mut bad) = (0u64, 0u64);
                while done.load(Relaxed) < shape.tellers as u64 {
                    bad += u64::from(bank.audit().await != opening);
                    audits += 1;
                    tokio::task::yield_now().await;
                }
                (audits, bad)
            }));
        }
        let mut tellers = Vec::new();
        for t in 0..shape.tellers {
            let (bank, done) = (Arc::clone(&bank), Arc::clone(&done));
            tellers.push(tokio::spawn(async move {
                let mut rng =
                    Rng(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
                let mut waits = Vec::with_capacity(shape.transfers as usize);
                let accounts = shape.accounts as u64;
                for _ in 0..shape.transfers {
                    let from = rng.next() % accounts;
                    let to = rng.next() % accounts;
                    let amount = (rng.next() % 100) as i64;
                    let asked = Instant::now();
                    bank.transfer(from, to, amount).await;
                    waits.push(asked.elapsed().as_nanos() as u64);
                    // One transfer per request: a teller's task gives the
                    // worker back between requests, as a server's would
                    // (without it, a lock that never makes its caller yield
                    // lets one teller run a thousand transfers in a row).
                    tokio::task::yield_now().await;
                }
                done.fetch_add(1, Relaxed);
                waits
            }));
        }
        let all = async {
            let mut waits = Vec::new();
            for teller in tellers {
                waits.extend(teller.await.expect("a teller panicked"));
            }
            let elapsed = start.elapsed();
            let (mut audits, mut bad) = (0, 0);
            for auditor in auditors {
                let (a, b) = auditor.await.expect("an auditor panicked");
                audits += a;
                bad += b;
            }
            (elapsed, waits, audits, bad)
        };
        tokio::time::timeout(hang, all)
            .await
            .unwrap_or_else(|_| panic!("{}: the bank hung (no progress in {hang:?})", B::NAME))
    });
    let (elapsed, mut transfer_waits, audits, bad_audits) = outcome;
    if std::env::var_os("BANK_STATS").is_some() {
        eprintln!("{}: {}", B::NAME, bank.stats());
    }
    transfer_waits.sort_unstable();
    BankOutcome {
        elapsed,
        transfers: shape.tellers as u64 * shape.transfers,
        audits,
        transfer_waits,
        bad_audits,
        retries: bank.retries(),
        closing: bank.ledger().total(),
        opening,
    }
}

/// Runs both banks `reps` times, interleaved, checks every run, and returns
/// the markdown report: throughput, audits and latency of each, and
/// keylock's throughput against the hand-written bank's.
pub(crate) fn compare(rt: &Runtime, shape: BankRun, reps: usize, hang: Duration) -> String {
    use std::fmt::Write as _;
    let (mut ours, mut theirs, mut guards, mut unsorted, mut floor) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut cleanup = Vec::new();
    let (mut fixed_tokio, mut fixed_async) = (Vec::new(), Vec::new());
    let only = std::env::var("BANK_ONLY").unwrap_or_default();
    let runs = |name: &str| only.is_empty() || only == name;
    for _ in 0..reps {
        if runs("txn") {
            ours.push(checked::<KeylockBank>(rt, shape, hang));
        }
        if runs("dashmap") {
            theirs.push(checked::<DashMapBank>(rt, shape, hang));
        }
        if runs("cleanup") {
            cleanup.push(checked::<DashMapCleanupBank>(rt, shape, hang));
        }
        if runs("guards") {
            guards.push(checked::<KeylockGuardsBank>(rt, shape, hang));
        }
        if runs("unsorted") {
            unsorted.push(checked::<KeylockUnorderedBank>(rt, shape, hang));
        }
        if runs("floor") {
            floor.push(run::<NoLockBank>(rt, shape, hang));
        }
        if runs("fixed") {
            fixed_tokio.push(checked::<FixedLocksBank<tokio::sync::RwLock<()>>>(
                rt, shape, hang,
            ));
            fixed_async.push(checked::<FixedLocksBank<async_lock::RwLock<()>>>(
                rt, shape, hang,
            ));
        }
    }
    let mut o = String::new();
    writeln!(
        o,
        "{} accounts; {} tellers x {} transfers (two accounts exclusive, a self-transfer one); \
         {} auditors back to back (every account shared); median of {reps} interleaved runs. \
         Latency: a transfer from asking for its accounts to releasing them.\n",
        shape.accounts, shape.tellers, shape.transfers, shape.auditors
    )
    .unwrap();
    writeln!(
        o,
        "| bank | transfers/s | audits/s | transfer p50 | transfer p99 | deadlocks retried |"
    )
    .unwrap();
    writeln!(o, "|---|---:|---:|---:|---:|---:|").unwrap();
    row(&mut o, KeylockBank::NAME, &ours);
    row(&mut o, DashMapBank::NAME, &theirs);
    row(&mut o, DashMapCleanupBank::NAME, &cleanup);
    row(&mut o, KeylockGuardsBank::NAME, &guards);
    row(&mut o, KeylockUnorderedBank::NAME, &unsorted);
    row(&mut o, NoLockBank::NAME, &floor);
    row(
        &mut o,
        <tokio::sync::RwLock<()> as AccountLock>::NAME,
        &fixed_tokio,
    );
    row(
        &mut o,
        <async_lock::RwLock<()> as AccountLock>::NAME,
        &fixed_async,
    );
    // Time per transfer, so that the verdict reads as for the workloads.
    let per =
        |o: &[BankOutcome]| -> Vec<f64> { o.iter().map(|o| 1e9 / o.transfers_per_sec()).collect() };
    let (our_ns, their_ns, floor_ns) = (per(&ours), per(&theirs), per(&floor));
    let med = |v: &[f64]| super::verdict::median(&mut v.to_vec()).unwrap_or(f64::NAN);
    let word = super::verdict::Verdict::of(&our_ns, &their_ns).map_or("", |v| v.word());
    writeln!(
        o,
        "\nkeylock's transfer throughput: {:.2}x the hand-written bank's ({word}). \
         Money was conserved and every audit balanced, in every run of both.",
        med(&their_ns) / med(&our_ns)
    )
    .unwrap();
    if !ours.is_empty() {
        // The goals are in time per transfer: a transaction's against each
        // anchor's, medians of the interleaved runs.
        let against = |name: &str, runs: &[BankOutcome]| {
            (!runs.is_empty()).then(|| format!("{:.2}x {name}", med(&our_ns) / med(&per(runs))))
        };
        let ratios: Vec<String> = [
            against("keylock's sorted guards", &guards),
            against("the DashMap bank (entries kept)", &theirs),
            against("the DashMap bank with cleanup", &cleanup),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !ratios.is_empty() {
            writeln!(
                o,
                "A transaction's time per transfer: {}.",
                ratios.join(", ")
            )
            .unwrap();
        }
    }
    if !fixed_tokio.is_empty() {
        writeln!(
            o,
            "With a lock per account made up front (no map, no lookup, no entry to make or \
             remove: what a keyed table of those locks could at best reach), tokio's RwLock \
             runs {:.2}x and async-lock's {:.2}x the hand-written bank's transfers.",
            med(&their_ns) / med(&per(&fixed_tokio)),
            med(&their_ns) / med(&per(&fixed_async)),
        )
        .unwrap();
    }
    if !floor.is_empty() {
        writeln!(
            o,
            "With no locks at all, the same harness runs {:.2}x the hand-written bank's \
             transfers: no lock can take a bank past that.",
            med(&their_ns) / med(&floor_ns)
        )
        .unwrap();
    }
    o
}

fn checked<B: Bank>(rt: &Runtime, shape: BankRun, hang: Duration) -> BankOutcome {
    let out = run::<B>(rt, shape, hang);
    out.assert_conserved(B::NAME);
    out
}

fn row(o: &mut String, name: &str, runs: &[BankOutcome]) {
    use std::fmt::Write as _;
    let med = |f: &dyn Fn(&BankOutcome) -> f64| -> f64 {
        super::verdict::median(&mut runs.iter().map(f).collect::<Vec<_>>()).unwrap_or(0.0)
    };
    let dur = |ns: f64| Duration::from_nanos(ns as u64);
    writeln!(
        o,
        "| {name} | {:.0} | {:.0} | {:.1?} | {:.1?} | {:.0} |",
        med(&|r| r.transfers_per_sec()),
        med(&|r| r.audits_per_sec()),
        dur(med(&|r| r.wait(0.5).as_nanos() as f64)),
        dur(med(&|r| r.wait(0.99).as_nanos() as f64)),
        med(&|r| r.retries as f64),
    )
    .unwrap();
}
