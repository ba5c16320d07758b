//! Timers under load: tokio (multi-thread), async-std and plain threads on
//! one table, taking a few keys with leases of a few milliseconds and short
//! timeouts. Some holders stall past their lease without releasing (only a
//! timer can then move the key on to a waiter without a timeout of its own),
//! waits are cancelled at random, and tasks are aborted. The load runs on the
//! default table (the real clock's shard timers), on a `tokio_time()` table
//! and on one with a custom time source (whose waiters arm timers of their
//! own).
//!
//! What is asserted, and why it is sound:
//!
//! - Every `check()` of a guard is made under its key's ledger lock, so the
//!   ledger sees the checks of one key in the order they happened. Tokens are
//!   handed out in grant order, and a grant happens only once every older
//!   grant has lost the key, so once a token passed `check()`, no smaller
//!   token of that key may pass it again. Each time a guard passes, every
//!   other guard of the key that still exists with a smaller token is checked
//!   too, at that moment, and must fail: no two live guards of one key at
//!   once.
//! - A grant's token is new for its key (tokens strictly increase), and a
//!   grant that failed `check()` never passes it again.
//! - A holder that slept past its deadline fails `check()`.
//! - At the end, with every guard and future dropped, the table is empty and
//!   its internal invariants hold.
//!
//! A watchdog bounds the whole run: a lost wake-up fails it as a hang.
//! To add random preemptions around the shard locks, run it with the
//! `jitter` feature and a rate per 10,000 lock and unlock calls:
//! `KEYLOCK_JITTER=200 cargo test --release --features test-util,tokio,jitter --test stress_timers`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use keylock::{FencingToken, Guard, LockError, LockOptions, LockTable, OwnedGuard};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KEYS: usize = 3;
const HANG_GUARD: Duration = Duration::from_secs(60);

type Table = LockTable<u8>;

/// A guard whose authority can be checked from any thread.
trait Check: Send + Sync {
    fn check(&self) -> Result<FencingToken, LockError>;
}

impl Check for Guard<'static, u8> {
    fn check(&self) -> Result<FencingToken, LockError> {
        Guard::check(self)
    }
}

impl Check for OwnedGuard<u8> {
    fn check(&self) -> Result<FencingToken, LockError> {
        OwnedGuard::check(self)
    }
}

/// What the ledger knows of one key.
#[derive(Default)]
struct KeyLog {
    /// Every token granted.
    granted: HashSet<u64>,
    /// Tokens that failed `check()` once.
    dead: HashSet<u64>,
    /// The largest token that ever passed `check()`.
    newest_live: u64,
    /// The guards that exist now, by id.
    registered: Vec<(u64, u64, Arc<dyn Check>)>,
}

#[derive(Default)]
struct Ledger {
    keys: [Mutex<KeyLog>; KEYS],
    next_id: AtomicU64,
    checks_ok: AtomicU64,
    checks_failed: AtomicU64,
    cross_checks: AtomicU64,
    stalls: AtomicU64,
    grants: AtomicU64,
    timeouts: AtomicU64,
    cancelled: AtomicU64,
}

impl Ledger {
    /// Checks `guard` (token `token`) under the key's lock and judges the
    /// result against everything seen so far.
    fn judge(&self, log: &mut KeyLog, key: u8, token: u64, guard: &dyn Check) -> bool {
        match guard.check() {
            Ok(t) => {
                assert_eq!(t.get(), token);
                assert!(
                    !log.dead.contains(&token),
                    "key {key}: grant {token} passed check() after it had failed it"
                );
                assert!(
                    token >= log.newest_live,
                    "key {key}: grant {token} passed check() after the newer grant {} had",
                    log.newest_live
                );
                log.newest_live = token;
                for (_, other, g) in &log.registered {
                    if *other < token {
                        self.cross_checks.fetch_add(1, SeqCst);
                        assert!(
                            g.check().is_err(),
                            "key {key}: grants {other} and {token} both passed check() at once"
                        );
                    }
                }
                self.checks_ok.fetch_add(1, SeqCst);
                true
            }
            Err(LockError::Expired {
                token: t,
                key: None,
            }) => {
                assert_eq!(t.get(), token);
                log.dead.insert(token);
                self.checks_failed.fetch_add(1, SeqCst);
                false
            }
            Err(other) => panic!("unexpected error from check(): {other}"),
        }
    }
}

/// A guard registered with the ledger; dropping it unregisters it, then
/// releases the key.
struct Held {
    ledger: Arc<Ledger>,
    key: u8,
    id: u64,
    token: u64,
    expires_at: Option<Instant>,
    guard: Option<Arc<dyn Check>>,
}

impl Held {
    fn new(
        ledger: &Arc<Ledger>,
        key: u8,
        token: FencingToken,
        expires_at: Option<Instant>,
        guard: Arc<dyn Check>,
    ) -> Self {
        let id = ledger.next_id.fetch_add(1, SeqCst);
        let token = token.get();
        ledger.grants.fetch_add(1, SeqCst);
        let mut log = ledger.keys[key as usize].lock().unwrap();
        assert!(
            log.granted.insert(token),
            "key {key}: token {token} was granted twice"
        );
        ledger.judge(&mut log, key, token, &*guard);
        log.registered.push((id, token, guard.clone()));
        drop(log);
        Self {
            ledger: ledger.clone(),
            key,
            id,
            token,
            expires_at,
            guard: Some(guard),
        }
    }

    fn check(&self) -> bool {
        let mut log = self.ledger.keys[self.key as usize].lock().unwrap();
        let guard = self.guard.as_ref().unwrap();
        self.ledger.judge(&mut log, self.key, self.token, &**guard)
    }

    /// After sleeping past the deadline: the grant must have lapsed.
    fn assert_lapsed(&self) {
        let deadline = self.expires_at.expect("stalls only with a lease");
        assert!(Instant::now() >= deadline);
        assert!(
            !self.check(),
            "key {}: grant {} passed check() after its deadline",
            self.key,
            self.token
        );
        self.ledger.stalls.fetch_add(1, SeqCst);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut log = match self.ledger.keys[self.key as usize].lock() {
            Ok(log) => log,
            // Another assertion failed: still release the key.
            Err(poisoned) => poisoned.into_inner(),
        };
        let at = log.registered.iter().position(|(id, ..)| *id == self.id);
        let entry = at.map(|at| log.registered.swap_remove(at));
        drop(log);
        // The registry's clone first, then ours: the last one releases.
        drop(entry);
        drop(self.guard.take());
    }
}

/// What a caller asks for and does, drawn at random.
struct Plan {
    key: u8,
    opts: LockOptions,
    /// Hold past the lease without releasing, then this much more.
    stall: Option<Duration>,
    /// Drop the wait after this long (a cancellation), if it has not ended.
    cancel_after: Option<Duration>,
}

fn plan(rng: &mut StdRng) -> Plan {
    let key = rng.gen_range(0..KEYS as u8);
    let leased = rng.gen_bool(0.8);
    let mut opts = LockOptions::new();
    if leased {
        opts = opts.lease(Duration::from_micros(rng.gen_range(500..4_000)));
    }
    if rng.gen_bool(0.4) {
        opts = opts.timeout(Duration::from_micros(rng.gen_range(0..6_000)));
    }
    let stall =
        (leased && rng.gen_bool(0.15)).then(|| Duration::from_micros(rng.gen_range(0..6_000)));
    let cancel_after = rng
        .gen_bool(0.1)
        .then(|| Duration::from_micros(rng.gen_range(0..3_000)));
    Plan {
        key,
        opts,
        stall,
        cancel_after,
    }
}

fn outcome<G>(ledger: &Ledger, result: Result<G, LockError>) -> Option<G> {
    match result {
        Ok(guard) => Some(guard),
        Err(LockError::Timeout { .. }) => {
            ledger.timeouts.fetch_add(1, SeqCst);
            None
        }
        Err(other) => panic!("unexpected lock error: {other}"),
    }
}

const ROUNDS: usize = 500;

async fn tokio_worker(table: &'static Table, arc: Arc<Table>, ledger: Arc<Ledger>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..ROUNDS {
        let p = plan(&mut rng);
        // Alternate borrowed and owned guards.
        let wait = async {
            if round % 2 == 0 {
                let guard = outcome(&ledger, table.lock_with(p.key, p.opts).await)?;
                let (token, at) = (guard.token(), guard.expires_at());
                Some(Held::new(&ledger, p.key, token, at, Arc::new(guard)))
            } else {
                let guard = outcome(&ledger, arc.clone().lock_owned_with(p.key, p.opts).await)?;
                let (token, at) = (guard.token(), guard.expires_at());
                Some(Held::new(&ledger, p.key, token, at, Arc::new(guard)))
            }
        };
        let held = match p.cancel_after {
            Some(after) => match tokio::time::timeout(after, wait).await {
                Ok(held) => held,
                Err(_) => {
                    ledger.cancelled.fetch_add(1, SeqCst);
                    None
                }
            },
            None => wait.await,
        };
        let Some(held) = held else { continue };
        match (p.stall, held.expires_at) {
            (Some(extra), Some(deadline)) => {
                tokio::time::sleep_until((deadline + extra).into()).await;
                held.assert_lapsed();
            }
            _ => {
                tokio::task::yield_now().await;
                held.check();
            }
        }
    }
}

async fn async_std_worker(table: &'static Table, ledger: Arc<Ledger>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..ROUNDS {
        let p = plan(&mut rng);
        let wait = async {
            let guard = outcome(&ledger, table.lock_with(p.key, p.opts).await)?;
            let (token, at) = (guard.token(), guard.expires_at());
            Some(Held::new(&ledger, p.key, token, at, Arc::new(guard)))
        };
        let held = match p.cancel_after {
            Some(after) => match async_std::future::timeout(after, wait).await {
                Ok(held) => held,
                Err(_) => {
                    ledger.cancelled.fetch_add(1, SeqCst);
                    None
                }
            },
            None => wait.await,
        };
        let Some(held) = held else { continue };
        match (p.stall, held.expires_at) {
            (Some(extra), Some(deadline)) => {
                let until = deadline + extra;
                async_std::task::sleep(until.saturating_duration_since(Instant::now())).await;
                held.assert_lapsed();
            }
            _ => {
                async_std::task::yield_now().await;
                held.check();
            }
        }
    }
}

fn thread_worker(table: &'static Table, ledger: &Arc<Ledger>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..ROUNDS {
        let p = plan(&mut rng);
        let Some(guard) = outcome(ledger, table.blocking_lock_with(p.key, p.opts)) else {
            continue;
        };
        let (token, at) = (guard.token(), guard.expires_at());
        let held = Held::new(ledger, p.key, token, at, Arc::new(guard));
        match (p.stall, held.expires_at) {
            (Some(extra), Some(deadline)) => {
                std::thread::sleep((deadline + extra).saturating_duration_since(Instant::now()));
                held.assert_lapsed();
            }
            _ => {
                held.check();
            }
        }
    }
}

#[test]
fn shard_timers_under_load_across_tokio_async_std_and_threads() {
    run(LockTable::builder().shards(2).build());
}

/// The same load on a table whose waiters each arm their own timer: tokio's
/// in tokio tasks, the crate's timer elsewhere (async-std, plain threads).
#[cfg(feature = "tokio")]
#[test]
fn tokio_time_waiter_timers_under_load_across_tokio_async_std_and_threads() {
    run(LockTable::builder().shards(2).tokio_time().build());
}

#[cfg(not(feature = "tokio"))]
#[test]
#[ignore = "needs --features tokio (or --all-features)"]
fn tokio_time_waiter_timers_under_load_across_tokio_async_std_and_threads() {}

/// The monotonic clock with async-io's timer, as an application's own
/// [`keylock::TimeSource`]: each waiter sleeps on its own timer, from any
/// runtime or thread.
#[derive(Debug)]
struct AsyncIoTime;

impl keylock::TimeSource for AsyncIoTime {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep_until(
        &self,
        deadline: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + Sync>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        Box::pin(async_std::task::sleep(wait))
    }
}

#[test]
fn custom_time_source_timers_under_load_across_tokio_async_std_and_threads() {
    run(LockTable::builder()
        .shards(2)
        .time_source(AsyncIoTime)
        .build());
}

fn run(table: Table) {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    // Leaked: borrowed guards must be `'static` to move between the ledger
    // and spawned tasks.
    let arc: Arc<Table> = Arc::new(table);
    let table: &'static Table = Box::leak(Box::new(arc.clone()));
    let ledger = Arc::new(Ledger::default());
    let started = Instant::now();

    let (done_tx, done_rx) = mpsc::channel::<&'static str>();
    let mut sides = Vec::new();

    {
        let (arc, ledger, done) = (arc.clone(), ledger.clone(), done_tx.clone());
        sides.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let mut rng = StdRng::seed_from_u64(seed);
                let handles: Vec<_> = (0..12u64)
                    .map(|t| {
                        let (arc, ledger) = (arc.clone(), ledger.clone());
                        tokio::spawn(tokio_worker(table, arc, ledger, seed ^ t))
                    })
                    .collect();
                // Abort a few tasks at random moments, whatever they are
                // doing (waiting, holding, stalling).
                for h in handles.iter().step_by(4) {
                    tokio::time::sleep(Duration::from_millis(rng.gen_range(1..40))).await;
                    h.abort();
                }
                for h in handles {
                    match h.await {
                        Ok(()) => {}
                        Err(e) if e.is_cancelled() => {}
                        Err(e) => std::panic::resume_unwind(e.into_panic()),
                    }
                }
            });
            let _ = done.send("tokio");
        }));
    }
    {
        let (ledger, done) = (ledger.clone(), done_tx.clone());
        sides.push(std::thread::spawn(move || {
            async_std::task::block_on(async {
                let tasks: Vec<_> = (0..6u64)
                    .map(|t| {
                        async_std::task::spawn(async_std_worker(
                            table,
                            ledger.clone(),
                            seed ^ (100 + t),
                        ))
                    })
                    .collect();
                for t in tasks {
                    t.await;
                }
            });
            let _ = done.send("async-std");
        }));
    }
    for t in 0..3u64 {
        let (ledger, done) = (ledger.clone(), done_tx.clone());
        sides.push(std::thread::spawn(move || {
            thread_worker(table, &ledger, seed ^ (200 + t));
            let _ = done.send("thread");
        }));
    }
    drop(done_tx);

    let watchdog = started + HANG_GUARD;
    for _ in 0..sides.len() {
        match done_rx.recv_timeout(watchdog.saturating_duration_since(Instant::now())) {
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "hang: some side did not finish within {HANG_GUARD:?} (seed {seed}); \
                 table {table:?}, waiters {:?}",
                (0..KEYS as u8)
                    .map(|k| table.waiters(&k))
                    .collect::<Vec<_>>()
            ),
            // A side panicked: its join below reports why.
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for side in sides {
        if let Err(panic) = side.join() {
            eprintln!("seed {seed}");
            std::panic::resume_unwind(panic);
        }
    }

    assert!(table.is_empty(), "everything dropped, yet {table:?}");
    #[cfg(feature = "test-util")]
    table.assert_consistent();
    for key in 0..KEYS as u8 {
        assert_eq!(table.waiters(&key), 0);
        assert!(!table.is_locked(&key));
        assert!(ledger.keys[key as usize]
            .lock()
            .unwrap()
            .registered
            .is_empty());
    }
    let stats = table.stats();
    let grants = ledger.grants.load(SeqCst);
    assert!(grants > 0);
    assert!(ledger.checks_ok.load(SeqCst) > 0);
    assert!(
        stats.acquisitions >= grants,
        "every guard seen came from an acquisition: {stats:?}"
    );
    eprintln!(
        "{:?}: grants {grants}, checks ok {} failed {}, cross-checks {}, stalls {}, \
         timeouts {}, cancelled {}, {stats:?}",
        started.elapsed(),
        ledger.checks_ok.load(SeqCst),
        ledger.checks_failed.load(SeqCst),
        ledger.cross_checks.load(SeqCst),
        ledger.stalls.load(SeqCst),
        ledger.timeouts.load(SeqCst),
        ledger.cancelled.load(SeqCst),
    );
}
