//! The uncontended fast path, alone, for instruction counting:
//!
//! ```text
//! cargo build --profile bench --example uncontended
//! valgrind --tool=callgrind target/release/examples/uncontended 1000000 try
//! valgrind --tool=callgrind target/release/examples/uncontended 0 try   # baseline
//! ```
//!
//! `(Ir(N) - Ir(0)) / N` is the instruction count of one lock + unlock.
//! Modes: `try` (`try_lock` + drop, the default) and `lock` (`lock(k)` polled
//! once with a no-op waker + drop: the async path without a runtime),
//! `handoff` (a waiter linked, handed the key by a release, polled again:
//! the contended path without threads); for
//! reference, `tokio` (`tokio::sync::Mutex::try_lock` + drop), `async_lock`
//! (`async_lock::Mutex::lock` polled once + drop, as `lock`) and `std`
//! (`std::sync::Mutex::lock` + drop, the lock each shard is behind).
//! `txnwait` / `txnwait_off`: a transaction's wait handed the key by the
//! holder's commit, with deadlock detection and without. `txn2wait` /
//! `guards2wait`: a transfer that waits for one of its two keys, as a
//! transaction and as sorted plain guards; `audit` / `audit_guards`: 64
//! keys shared, one `lock_all` + commit, and as plain guards. These four
//! use a fixed hasher (`fixed_table`), so their counts are the same in
//! every run. `txn0`: a transaction begun and committed with no key, the
//! handle's own cost in `txn1` and `txn2`. With `--features probes`:
//! `probe_one`, `probe1`, `probe2`, the least a transaction can do
//! (`src/transactions/probe.rs`), run as `txn1` / `txn1` / `txn2` are: the
//! floors of the transactions' instruction goals.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll};

/// The `handoff` cycle on a single async mutex: a holder, a waiter that
/// polls `Pending`, the holder's release, the waiter's second poll.
macro_rules! mutex_handoff {
    ($mutex:expr, $n:expr) => {{
        let mutex = $mutex;
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        for _ in 0..$n {
            let holder = black_box(&mutex).try_lock().expect("free");
            let mut fut = pin!(black_box(&mutex).lock());
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            drop(holder);
            let Poll::Ready(guard) = fut.poll(&mut cx) else {
                unreachable!("handed off")
            };
            drop(black_box(guard));
        }
    }};
}

/// A table with a fixed hasher: the keys' hashes, and so where they fall
/// and how they collide, are the same in every run, and so is the count.
fn fixed_table() -> keylock::LockTable<u64, foldhash::fast::FixedState> {
    keylock::LockTable::builder()
        .hasher(foldhash::fast::FixedState::with_seed(7))
        .build()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: u64 = args
        .next()
        .map_or(1_000_000, |s| s.parse().expect("N: a count"));
    let mode = args.next().unwrap_or_else(|| "try".to_string());

    let table = keylock::LockTable::<u64>::new();
    match mode.as_str() {
        "try" => {
            for _ in 0..n {
                let guard = table.try_lock(black_box(7)).expect("uncontended");
                drop(black_box(guard));
            }
        }
        "lease" => {
            let opts = keylock::LockOptions::new().lease(std::time::Duration::from_secs(3600));
            for _ in 0..n {
                let guard = table
                    .try_lock_with(black_box(7), opts)
                    .expect("uncontended");
                drop(black_box(guard));
            }
        }
        // `lock_with(k, opts)` as a user writes it, its `Result` unwrapped:
        // a 30 s lease, or a 30 s timeout.
        "lock_lease" | "lock_timeout" => {
            let thirty = std::time::Duration::from_secs(30);
            let opts = if mode == "lock_lease" {
                keylock::LockOptions::new().lease(thirty)
            } else {
                keylock::LockOptions::new().timeout(thirty)
            };
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let fut = pin!(table.lock_with(black_box(7), opts));
                let Poll::Ready(got) = fut.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                drop(black_box(got.expect("uncontended")));
            }
        }
        // One handoff, polled by hand: a holder, a waiter that links (its
        // first poll), the holder's release handing it the key, the
        // waiter's second poll taking the grant, its guard dropped.
        "handoff" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let holder = table.try_lock(black_box(7)).expect("free");
                let mut fut = pin!(table.lock(black_box(7)));
                assert!(fut.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("handed off")
                };
                drop(black_box(guard));
            }
        }
        // The same with a 30 s timeout or a 30 s lease on the waiter.
        "handoff_timeout" | "handoff_lease" => {
            let opts = if mode == "handoff_lease" {
                keylock::LockOptions::new().lease(std::time::Duration::from_secs(30))
            } else {
                keylock::LockOptions::new().timeout(std::time::Duration::from_secs(30))
            };
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let holder = table.try_lock(black_box(7)).expect("free");
                let mut fut = pin!(table.lock_with(black_box(7), opts));
                assert!(fut.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("handed off")
                };
                drop(black_box(guard.expect("in time")));
            }
        }
        "lock" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let fut = pin!(table.lock(black_box(7)));
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                drop(black_box(guard));
            }
        }
        // The handle alone (`txn0`): begun and committed with no key, its
        // address taken first as every call's borrow takes it (so the move
        // into `commit` is the copy it is after real calls).
        "txn0" => {
            for _ in 0..n {
                let txn = table.transaction();
                black_box(&txn);
                txn.commit().expect("no lease");
            }
        }
        // A transaction: one key locked and committed (`txn1`); a transfer's
        // two keys by `lock_all` (`txn2`), against two plain guards
        // (`guards2`); the owned form (`owned1`).
        "txn1" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut txn = table.transaction();
                {
                    let fut = pin!(txn.lock(black_box(i & 63), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        // The least a transaction can do (`--features probes`; see
        // `src/transactions/probe.rs`): one key and nothing else
        // (`probe_one`), one key in a set that holds several and checks each
        // grant at commit (`probe1`), and a transfer's two keys so
        // (`probe2`), each as `txn1` / `txn2` runs.
        #[cfg(feature = "probes")]
        "probe_one" | "probe1" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let key = black_box(i & 63);
                if mode == "probe_one" {
                    let mut txn = keylock::ProbeBareOne::begin(&table);
                    {
                        let fut = pin!(txn.lock(key, keylock::Mode::Exclusive));
                        let Poll::Ready(got) = fut.poll(&mut cx) else {
                            unreachable!("uncontended")
                        };
                        black_box(got.expect("uncontended"));
                    }
                    txn.commit();
                } else {
                    let mut txn = keylock::ProbeBare::begin(&table);
                    {
                        let fut = pin!(txn.lock(key, keylock::Mode::Exclusive));
                        let Poll::Ready(got) = fut.poll(&mut cx) else {
                            unreachable!("uncontended")
                        };
                        black_box(got.expect("uncontended"));
                    }
                    assert!(txn.commit(), "no lease");
                }
            }
        }
        #[cfg(feature = "probes")]
        "probe2" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut txn = keylock::ProbeBare::begin(&table);
                let keys = [
                    (black_box(i & 63), keylock::Mode::Exclusive),
                    (black_box((i * 7 + 1) & 63), keylock::Mode::Exclusive),
                ];
                {
                    let fut = pin!(txn.lock_two(keys));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                assert!(txn.commit(), "no lease");
            }
        }
        "txn2" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut txn = table.transaction();
                let keys = [
                    (black_box(i & 63), keylock::Mode::Exclusive),
                    (black_box((i * 7 + 1) & 63), keylock::Mode::Exclusive),
                ];
                {
                    let fut = pin!(txn.lock_all(keys));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        // A transfer's two keys locked one call at a time (`txn2_seq`).
        "txn2_seq" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut txn = table.transaction();
                for key in [black_box(i & 63), black_box((i * 7 + 1) & 63)] {
                    let fut = pin!(txn.lock(key, keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        "guards2" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut keys = [black_box(i & 63), black_box((i * 7 + 1) & 63)];
                keys.sort_unstable();
                let first = pin!(table.lock(keys[0]));
                let Poll::Ready(first) = first.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                let second = (keys[1] != keys[0]).then(|| {
                    let fut = pin!(table.lock(keys[1]));
                    let Poll::Ready(g) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    g
                });
                drop(black_box((second, first)));
            }
        }
        // An audit: 64 keys shared by one `lock_all` + commit (`audit`),
        // against 64 plain shared guards (`audit_guards`).
        "audit" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let mut txn = table.transaction();
                {
                    let keys = (0..64u64).map(|k| (black_box(k), keylock::Mode::Shared));
                    let fut = pin!(txn.lock_all(keys));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        "audit_guards" => {
            let table = fixed_table();
            let mut guards = Vec::with_capacity(64);
            for _ in 0..n {
                for k in 0..64u64 {
                    guards.push(table.try_lock_shared(black_box(k)).expect("uncontended"));
                }
                guards.clear();
            }
        }
        // An audit that meets one busy key midway, as the hot bank's do: a
        // teller's transaction holds key 32 exclusive; the audit's
        // `lock_all` of the 64 keys shared takes the keys below it, waits
        // for it (holding those, so its wait is registered), is handed it
        // by the teller's commit, takes the rest and commits
        // (`auditwait`); the same with 64 plain shared guards taken in
        // order (`auditwait_guards`).
        "auditwait" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let mut teller = table.transaction();
                {
                    let fut = pin!(teller.lock(black_box(32), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                let mut audit = table.transaction();
                {
                    let keys = (0..64u64).map(|k| (black_box(k), keylock::Mode::Shared));
                    let mut wait = pin!(audit.lock_all(keys));
                    assert!(wait.as_mut().poll(&mut cx).is_pending());
                    teller.commit().expect("no lease");
                    let Poll::Ready(got) = wait.as_mut().poll(&mut cx) else {
                        unreachable!("handed the key")
                    };
                    black_box(got.expect("granted"));
                }
                audit.commit().expect("no lease");
            }
        }
        "auditwait_guards" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut guards = Vec::with_capacity(64);
            for _ in 0..n {
                let teller = table.try_lock(black_box(32)).expect("free");
                for k in 0..32u64 {
                    let fut = pin!(table.lock_shared(black_box(k)));
                    let Poll::Ready(guard) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    guards.push(guard);
                }
                {
                    let mut wait = pin!(table.lock_shared(black_box(32)));
                    assert!(wait.as_mut().poll(&mut cx).is_pending());
                    drop(teller);
                    let Poll::Ready(guard) = wait.as_mut().poll(&mut cx) else {
                        unreachable!("handed the key")
                    };
                    guards.push(guard);
                }
                for k in 33..64u64 {
                    let fut = pin!(table.lock_shared(black_box(k)));
                    let Poll::Ready(guard) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    guards.push(guard);
                }
                guards.clear();
            }
        }
        // A transaction's contended wait, handed the key by the holder's
        // commit: with deadlock detection (`txnwait`: the wait registered,
        // alone, so nothing searched) and without (`txnwait_off`).
        "txnwait" | "txnwait_off" => {
            let limit = if mode == "txnwait" { 50 } else { 0 };
            let table = keylock::LockTable::<u64>::builder()
                .deadlock_search_limit(limit)
                .build();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let mut holder = table.transaction();
                {
                    let fut = pin!(holder.lock(black_box(i & 63), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                let mut waiter = table.transaction();
                let mut wait = Box::pin(waiter.lock(black_box(i & 63), keylock::Mode::Exclusive));
                assert!(wait.as_mut().poll(&mut cx).is_pending());
                holder.commit().expect("no lease");
                let Poll::Ready(got) = wait.as_mut().poll(&mut cx) else {
                    unreachable!("handed the key")
                };
                black_box(got.expect("granted"));
            }
        }
        // A transfer that waits: a holder transaction has one of the two
        // keys; the waiter's `lock_all` of both takes what it can, waits,
        // is handed the key by the holder's commit, and commits
        // (`txn2wait`). `guards2wait`: the same with sorted plain guards.
        // `txn2wait0`: the same, the holder having the lower key, so the
        // transfer waits at its first key, holding nothing (a teller behind
        // an audit, in the hot bank).
        "txn2wait" | "txn2wait0" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let (a, b) = (black_box(i & 63), black_box((i & 63) + 64));
                let (a, b) = if mode == "txn2wait0" { (b, a) } else { (a, b) };
                let mut holder = table.transaction();
                {
                    let fut = pin!(holder.lock(b, keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                let mut waiter = table.transaction();
                {
                    let keys = [(a, keylock::Mode::Exclusive), (b, keylock::Mode::Exclusive)];
                    let mut wait = pin!(waiter.lock_all(keys));
                    assert!(wait.as_mut().poll(&mut cx).is_pending());
                    holder.commit().expect("no lease");
                    let Poll::Ready(got) = wait.as_mut().poll(&mut cx) else {
                        unreachable!("handed the key")
                    };
                    black_box(got.expect("granted"));
                }
                waiter.commit().expect("no lease");
            }
        }
        "guards2wait0" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let (a, b) = (black_box(i & 63), black_box((i & 63) + 64));
                let holder = table.try_lock(a).expect("free");
                let mut first = pin!(table.lock(a));
                assert!(first.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(first) = first.poll(&mut cx) else {
                    unreachable!("handed the key")
                };
                let second = pin!(table.lock(b));
                let Poll::Ready(second) = second.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                drop(black_box((second, first)));
            }
        }
        "guards2wait" => {
            let table = fixed_table();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let (a, b) = (black_box(i & 63), black_box((i & 63) + 64));
                let holder = table.try_lock(b).expect("free");
                let first = pin!(table.lock(a));
                let Poll::Ready(first) = first.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                let mut second = pin!(table.lock(b));
                assert!(second.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(second) = second.poll(&mut cx) else {
                    unreachable!("handed the key")
                };
                drop(black_box((second, first)));
            }
        }
        // The chain of `benches/owners.rs` (`deadlock/chain8_*`): seven
        // transactions wait in a chain (transaction i holds key i, waits
        // for key i + 1); the timed one waits for key 0 and gives up. With
        // `chain8_held` it holds a key first, so its wait is registered, but
        // nobody waits for that key, so nothing can lead back to it and it
        // is not searched from; with `chain8_awaited` another transaction
        // (holding nothing) waits for that key too, so the wait is searched
        // from, through the chain, 8 deep. Without either it holds nothing
        // and is not registered. `_off`: the same with detection off.
        "chain8" | "chain8_off" | "chain8_held" | "chain8_held_off" | "chain8_awaited"
        | "chain8_awaited_off" => {
            let limit = if mode.ends_with("_off") { 0 } else { 50 };
            let table = keylock::LockTable::<u64>::builder()
                .deadlock_search_limit(limit)
                .build();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut chain: Vec<_> = (0..8).map(|_| table.transaction()).collect();
            for (i, txn) in chain.iter_mut().enumerate() {
                let fut = pin!(txn.lock(i as u64, keylock::Mode::Exclusive));
                assert!(fut.poll(&mut cx).is_ready());
            }
            let mut waits: Vec<_> = chain
                .iter_mut()
                .enumerate()
                .map(|(i, txn)| Box::pin(txn.lock(i as u64 + 1, keylock::Mode::Exclusive)))
                .collect();
            for w in &mut waits[..7] {
                assert!(w.as_mut().poll(&mut cx).is_pending());
            }
            for i in 0..n {
                let mut txn = table.transaction();
                let mut other = table.transaction();
                let mut awaits = None;
                if mode.starts_with("chain8_held") || mode.starts_with("chain8_awaited") {
                    let own = 100 + (i & 63);
                    let fut = pin!(txn.lock(own, keylock::Mode::Exclusive));
                    assert!(fut.poll(&mut cx).is_ready());
                    if mode.starts_with("chain8_awaited") {
                        let mut fut = Box::pin(other.lock(own, keylock::Mode::Exclusive));
                        assert!(fut.as_mut().poll(&mut cx).is_pending());
                        awaits = Some(fut);
                    }
                }
                let mut wait = Box::pin(txn.lock(black_box(0), keylock::Mode::Exclusive));
                assert!(wait.as_mut().poll(&mut cx).is_pending());
                drop(wait);
                drop(awaits);
            }
            drop(waits);
        }
        // A wait queued on a hot key behind 7 waiting transactions, each
        // holding a key of its own (so each is registered): the search goes
        // through the queue (`hot8`), against the same without detection
        // (`hot8_off`).
        "hot8" | "hot8_off" => {
            let limit = if mode.ends_with("_off") { 0 } else { 50 };
            let table = keylock::LockTable::<u64>::builder()
                .deadlock_search_limit(limit)
                .build();
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut holder = table.transaction();
            assert!(pin!(holder.lock(0, keylock::Mode::Exclusive)).poll(&mut cx).is_ready());
            let mut queued: Vec<_> = (0..7).map(|_| table.transaction()).collect();
            for (i, txn) in queued.iter_mut().enumerate() {
                let fut = pin!(txn.lock(1 + i as u64, keylock::Mode::Exclusive));
                assert!(fut.poll(&mut cx).is_ready());
            }
            let mut waits: Vec<_> = queued
                .iter_mut()
                .map(|txn| Box::pin(txn.lock(0, keylock::Mode::Exclusive)))
                .collect();
            for w in &mut waits {
                assert!(w.as_mut().poll(&mut cx).is_pending());
            }
            for i in 0..n {
                let mut txn = table.transaction();
                {
                    let fut = pin!(txn.lock(100 + (i & 63), keylock::Mode::Exclusive));
                    assert!(fut.poll(&mut cx).is_ready());
                }
                let mut wait = Box::pin(txn.lock(black_box(0), keylock::Mode::Exclusive));
                assert!(wait.as_mut().poll(&mut cx).is_pending());
            }
            drop(waits);
        }
        "owned1" => {
            let table = std::sync::Arc::new(keylock::LockTable::<u64>::new());
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for i in 0..n {
                let txn = table.clone().transaction_owned();
                {
                    let fut = pin!(txn.lock(black_box(i & 63), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        // Sixteen keys per iteration, as `benches/owners.rs` does: an owned
        // transaction's locks and commit (`owned16`) against sixteen owned
        // plain guards (`guards_owned16`).
        "owned16" => {
            let table = std::sync::Arc::new(keylock::LockTable::<u64>::new());
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let txn = table.clone().transaction_owned();
                for k in 0..16 {
                    let fut = pin!(txn.lock(black_box(k), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        "txn16" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let mut txn = table.transaction();
                for k in 0..16 {
                    let fut = pin!(txn.lock(black_box(k), keylock::Mode::Exclusive));
                    let Poll::Ready(got) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    black_box(got.expect("uncontended"));
                }
                txn.commit().expect("no lease");
            }
        }
        "guards_owned16" => {
            let table = std::sync::Arc::new(keylock::LockTable::<u64>::new());
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut guards = Vec::with_capacity(16);
            for _ in 0..n {
                for k in 0..16 {
                    let fut = pin!(table.clone().lock_owned(black_box(k)));
                    let Poll::Ready(guard) = fut.poll(&mut cx) else {
                        unreachable!("uncontended")
                    };
                    guards.push(guard);
                }
                guards.clear();
            }
        }
        // Reference points, not keylock: one async mutex and the bare
        // futex mutex the shards use.
        "tokio" => {
            let mutex = tokio::sync::Mutex::new(());
            for _ in 0..n {
                let guard = black_box(&mutex).try_lock().expect("uncontended");
                drop(black_box(guard));
            }
        }
        // One handoff per iteration, as W6 runs it in steady state: a new
        // lock future waits behind the holder, the holder lets go (the key
        // is handed to the waiter), the waiter polls and becomes the holder.
        "chain" => {
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut holder = table.try_lock(black_box(7)).expect("free");
            for _ in 0..n {
                let mut fut = pin!(table.lock(black_box(7)));
                assert!(fut.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("handed off")
                };
                holder = black_box(guard);
            }
        }
        // `chain` with a 30 s lease or a 30 s timeout on every lock.
        "chain_lease" | "chain_timeout" => {
            let thirty = std::time::Duration::from_secs(30);
            let opts = if mode == "chain_lease" {
                keylock::LockOptions::new().lease(thirty)
            } else {
                keylock::LockOptions::new().timeout(thirty)
            };
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut holder = table.try_lock_with(black_box(7), opts).expect("free");
            for _ in 0..n {
                let mut fut = pin!(table.lock_with(black_box(7), opts));
                assert!(fut.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("handed off")
                };
                holder = black_box(guard.expect("in time"));
            }
        }
        "chain_tokio" => {
            let mutex = tokio::sync::Mutex::new(());
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            let mut holder = black_box(&mutex).try_lock().expect("free");
            for _ in 0..n {
                let mut fut = pin!(black_box(&mutex).lock());
                assert!(fut.as_mut().poll(&mut cx).is_pending());
                drop(holder);
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("handed off")
                };
                holder = black_box(guard);
            }
        }
        // The `handoff` cycle on `tokio::sync::Mutex` and on
        // `async_lock::Mutex`, for reference.
        "handoff_tokio" => mutex_handoff!(tokio::sync::Mutex::new(()), n),
        "handoff_async_lock" => mutex_handoff!(async_lock::Mutex::new(()), n),
        // `lock` on one `async_lock::Mutex`: its future polled once, the
        // guard dropped (W1's anchor, in the same loop as `lock`).
        "async_lock" => {
            let mutex = async_lock::Mutex::new(());
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            for _ in 0..n {
                let fut = pin!(black_box(&mutex).lock());
                let Poll::Ready(guard) = fut.poll(&mut cx) else {
                    unreachable!("uncontended")
                };
                drop(black_box(guard));
            }
        }
        "std" => {
            let mutex = std::sync::Mutex::new(());
            for _ in 0..n {
                let guard = black_box(&mutex).lock().expect("uncontended");
                drop(black_box(guard));
            }
        }
        other => panic!(
            "unknown mode {other:?}: try | lease | lock | txn1 | txn2 | guards2 | audit | audit_guards | auditwait | auditwait_guards | chain8 | chain8_off | chain8_held | chain8_held_off | hot8 | hot8_off | owned1 | owned16 | guards_owned16 | tokio | async_lock | std"
        ),
    }
    assert!(table.is_empty());
    println!("{mode}: {n} lock+unlock, {:?}", table.stats());
}
