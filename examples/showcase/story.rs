//! Part 1 of the showcase: what keylock does, in four short scenes, each
//! printed with the values it really produced and checked with `assert!`
//! before it is printed, so the story cannot drift from the code.
//!
//! Real time, in milliseconds: the whole story takes well under a second.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use keylock::{FencingToken, LockError, LockOptions, LockTable};
use tokio::runtime::Runtime;

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn title(n: u32, text: &str) {
    println!("\n## {n}. {text}\n");
}

/// Waits until `cond` holds (bounded only so that a bug fails instead of
/// hanging: a loaded machine may take its time).
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "showcase: timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs the four scenes on `rt`; returns how long they took.
pub(crate) fn run(rt: &Runtime) -> Duration {
    let started = Instant::now();
    println!("# Part 1: what keylock does\n");
    println!("Every value below comes from this run and is checked before it is printed.");
    runtimes(rt);
    fencing(rt);
    diagnosis(rt);
    cancellation(rt);
    started.elapsed()
}

/// Scene 1: one table, a tokio task, an async-std task and a plain thread,
/// queued in that order behind a held key and served in that order.
fn runtimes(rt: &Runtime) {
    title(1, "One table shared by tokio, async-std and a plain thread");
    println!("The key \"ledger\" is held; three waiters queue, each on its own runtime.");
    println!("On release the key is handed over in arrival order (FIFO), one grant each.");
    let table: Arc<LockTable<&'static str>> = Arc::new(LockTable::new());
    let served = Arc::new(Mutex::new(Vec::<(&str, FencingToken)>::new()));
    let held = table.try_lock("ledger").expect("a fresh table");

    let tokio_task = {
        let (table, served) = (Arc::clone(&table), Arc::clone(&served));
        rt.spawn(async move {
            let guard = table.lock("ledger").await;
            served.lock().unwrap().push(("tokio task", guard.token()));
        })
    };
    wait_until("the tokio task waits", || table.waiters("ledger") == 1);
    let async_std_task = {
        let (table, served) = (Arc::clone(&table), Arc::clone(&served));
        async_std::task::spawn(async move {
            let guard = table.lock("ledger").await;
            served
                .lock()
                .unwrap()
                .push(("async-std task", guard.token()));
        })
    };
    wait_until("the async-std task waits", || table.waiters("ledger") == 2);
    let thread = {
        let (table, served) = (Arc::clone(&table), Arc::clone(&served));
        std::thread::spawn(move || {
            let guard = table.blocking_lock("ledger");
            served.lock().unwrap().push(("plain thread", guard.token()));
        })
    };
    wait_until("the thread waits", || table.waiters("ledger") == 3);
    println!(
        "   holder {} releases with {} waiters queued",
        held.token(),
        table.waiters("ledger")
    );
    drop(held);
    rt.block_on(tokio_task).expect("tokio task");
    async_std::task::block_on(async_std_task);
    thread.join().expect("thread");

    let served = served.lock().unwrap().clone();
    let names: Vec<&str> = served.iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["tokio task", "async-std task", "plain thread"]);
    assert!(served.windows(2).all(|w| w[0].1 < w[1].1));
    let stats = table.stats();
    assert_eq!(stats.handoffs, 3);
    let order: Vec<String> = served
        .iter()
        .map(|(name, token)| format!("{name} {token}"))
        .collect();
    println!(
        "   served: {} (each grant's fencing token is higher than the last)",
        order.join(" -> ")
    );
    println!(
        "   handoffs: {}, keys left in the table: {}",
        stats.handoffs,
        table.len()
    );
    assert_eq!(table.len(), 0);
}

/// A toy store that remembers the highest fencing token it has seen per
/// record and refuses any write fenced by an older one.
#[derive(Default)]
struct Store {
    records: Mutex<HashMap<&'static str, (u64, &'static str)>>,
}

impl Store {
    fn write(
        &self,
        record: &'static str,
        token: FencingToken,
        value: &'static str,
    ) -> Result<(), String> {
        let mut records = self.records.lock().unwrap();
        let entry = records.entry(record).or_insert((0, ""));
        if token.get() < entry.0 {
            return Err(format!(
                "refused: token {token} is older than #{} already written",
                entry.0
            ));
        }
        *entry = (token.get(), value);
        Ok(())
    }
}

/// Scene 2: a lease lapses during a pause, the key passes on, and the store
/// refuses the stale holder's late write by its token.
fn fencing(rt: &Runtime) {
    title(
        2,
        "A lease lapses; the successor's token fences the stale write",
    );
    println!(
        "A takes \"account-7\" with a 20 ms lease, then stalls 40 ms (a GC pause, a slow disk)."
    );
    println!(
        "B, waiting, gets the key when the lease lapses; the store then refuses A's late write."
    );
    let table: Arc<LockTable<&'static str>> = Arc::new(LockTable::new());
    let store = Store::default();
    rt.block_on(async {
        // Read before A's grant: its lease ends 20 ms after this or later.
        let a_granted = Instant::now();
        let a = table
            .lock_with("account-7", LockOptions::new().lease(ms(20)))
            .await
            .expect("free key, valid lease");
        let b = tokio::spawn({
            let wait = Arc::clone(&table)
                .lock_owned_with("account-7", LockOptions::new().timeout(ms(30_000)));
            async move {
                let guard = wait.await;
                (guard, Instant::now())
            }
        });
        tokio::time::sleep(ms(40)).await; // A's pause
        let a_stalled = a_granted.elapsed();
        let (b, b_granted) = b.await.expect("task");
        let b = b.expect("granted once A's lease lapsed");
        assert!(
            b_granted - a_granted >= ms(20),
            "B was granted before A's lease ended"
        );
        assert!(b.token() > a.token());
        store
            .write("account-7", b.token(), "B's balance")
            .expect("B holds the newest token");
        println!(
            "   A holds {}; B is granted {} {:.0?} after A (the lease was 20 ms) and writes",
            a.token(),
            b.token(),
            b_granted - a_granted
        );

        let a_check = a.check().expect_err("A's lease lapsed");
        assert_eq!(
            a_check,
            LockError::Expired {
                token: a.token(),
                key: None
            }
        );
        println!("   A wakes after {a_stalled:.0?}; A.check(): {a_check}");
        let refused = store
            .write("account-7", a.token(), "A's stale balance")
            .expect_err("the store fences A out");
        println!("   A writes anyway with {}: {refused}", a.token());
        drop(a);
        assert!(b.check().is_ok() && table.is_locked("account-7"));
        println!("   A's late release frees nothing: B still holds the key, its check() is Ok");
        let records = store.records.lock().unwrap();
        assert_eq!(records["account-7"], (b.token().get(), "B's balance"));
    });
}

/// Scene 3: a timeout that names the holder, and the operator acting on it
/// with `revoke_grant`, which the holder's `lost()` future sees at once.
fn diagnosis(rt: &Runtime) {
    title(
        3,
        "A timeout names its holder; revoke_grant acts on the diagnosis",
    );
    println!("A job holds \"nightly-report\" (60 s lease); a caller gives up after 10 ms.");
    println!(
        "The error names the grant in the way; revoking that grant wakes the job's lost() future."
    );
    let table: LockTable<&'static str> = LockTable::new();
    rt.block_on(async {
        let job = table
            .lock_with(
                "nightly-report",
                LockOptions::new().lease(Duration::from_secs(60)),
            )
            .await
            .expect("free key, valid lease");
        tokio::time::sleep(ms(5)).await;
        let err = table
            .lock_with("nightly-report", LockOptions::new().timeout(ms(10)))
            .await
            .expect_err("the job holds the key");
        let LockError::Timeout {
            holder: Some(holder),
            held_for: Some(held_for),
            ahead: 0,
            waited,
            ..
        } = err
        else {
            panic!("showcase: expected a timeout naming its holder, got {err:?}");
        };
        assert_eq!(holder, job.token());
        assert!(waited >= ms(10) && held_for >= waited);
        println!("   LockError: {err}");

        let mut lost = std::pin::pin!(job.lost());
        assert!(
            (&mut lost).now_or_never().is_none(),
            "the job still holds the key"
        );
        assert!(table.revoke_grant("nightly-report", holder));
        let why = (&mut lost)
            .now_or_never()
            .expect("lost() resolves at once after a revocation");
        assert_eq!(
            why,
            LockError::Expired {
                token: holder,
                key: None
            }
        );
        println!(
            "   revoke_grant(\"nightly-report\", {holder}) = true; job.lost() resolves at once:"
        );
        println!("   {why}");
        assert!(!table.revoke_grant("nightly-report", holder));
        let next = table
            .try_lock("nightly-report")
            .expect("the key is free again");
        println!(
            "   the same revoke again is refused (false); the next caller is granted {}",
            next.token()
        );
    });
}

/// Scene 4: waiters that are aborted or dropped leave nothing behind.
fn cancellation(rt: &Runtime) {
    title(4, "Cancellation leaves nothing behind");
    println!("100 tokio tasks queue on a held key and are aborted; one more wait is dropped by");
    println!("tokio::time::timeout. No callback, no registration, no entry stays in the table.");
    let table: Arc<LockTable<u64>> = Arc::new(LockTable::new());
    rt.block_on(async {
        let holder = table.lock(7).await;
        let tasks: Vec<_> = (0..100)
            .map(|_| tokio::spawn(Arc::clone(&table).lock_owned(7)))
            .collect();
        while table.waiters(&7) < 100 {
            tokio::task::yield_now().await;
        }
        let queued = table.waiters(&7);
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            assert!(task.await.expect_err("aborted").is_cancelled());
        }
        let timed_out = tokio::time::timeout(ms(5), table.lock(7)).await;
        assert!(timed_out.is_err(), "the key is held");
        let after = table.waiters(&7);
        assert_eq!((queued, after), (100, 0));
        println!("   waiters: {queued} queued, {after} after the aborts and the dropped future");
        drop(holder);
    });
    let stats = table.stats();
    assert_eq!(stats.cancelled, 101);
    assert_eq!(table.len(), 0);
    println!(
        "   holder released: table.len() = {}, cancelled waits counted: {}",
        table.len(),
        stats.cancelled
    );
}
