//! The two fairness policies: strict FIFO handoff (the default) and eventual
//! fairness (a running caller may take a released key, bounded by a forced
//! direct handoff once the shard's fairness deadline has passed). Driven by a
//! manual clock and hand-polled futures, plus a thread stress that checks
//! exclusion and that every waiter is served.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::Poll;

    use keylock::{Fairness, LockTable, ManualClock};

    use crate::common::{counting, poll, wakes};

    fn eventual() -> (ManualClock, LockTable<u32>) {
        let clock = ManualClock::new();
        let table = LockTable::builder()
            .clock(clock.clone())
            .fairness(Fairness::Eventual)
            .build();
        (clock, table)
    }

    #[test]
    fn strict_is_the_default_and_a_release_hands_the_key_to_the_waiter() {
        let table = LockTable::new();
        assert_eq!(table.fairness(), Fairness::Strict);
        let holder = table.try_lock(1u32).unwrap();
        let (c, w) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &w).is_pending());
        drop(holder);
        assert_eq!(wakes(&c), 1);
        // The key is the waiter's before it runs: nobody can barge.
        assert!(table.try_lock(1).is_err());
        assert!(matches!(poll(&mut a, &w), Poll::Ready(_)));
        table.assert_consistent();
    }

    #[test]
    fn eventual_the_first_contended_release_of_a_shard_hands_off_directly() {
        // No fairness deadline is set yet: the first release is a fair one.
        let (_clock, table) = eventual();
        let holder = table.try_lock(1).unwrap();
        let (c, w) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &w).is_pending());
        drop(holder);
        assert_eq!(wakes(&c), 1);
        assert!(table.try_lock(1).is_err(), "handed to the waiter directly");
        assert!(matches!(poll(&mut a, &w), Poll::Ready(_)));
        table.assert_consistent();
        assert_eq!(table.stats().handoffs, 1);
    }

    #[test]
    fn eventual_a_release_before_the_deadline_lets_a_running_caller_take_the_key() {
        let (_clock, table) = eventual();
        let holder = table.try_lock(1).unwrap();
        let (ca, wa) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &wa).is_pending());
        // The first release is fair and starts the shard's fairness deadline.
        drop(holder);
        let Poll::Ready(ga) = poll(&mut a, &wa) else {
            panic!("a was handed the key")
        };
        let (cb, wb) = counting();
        let mut b = Box::pin(table.lock(1));
        assert!(poll(&mut b, &wb).is_pending());
        // Before the deadline: the release frees the key and nudges b.
        let ta = ga.token();
        drop(ga);
        assert_eq!(wakes(&cb), 1, "the head is woken to retry");
        assert!(!table.is_locked(&1));
        assert_eq!(table.waiters(&1), 1);
        table.assert_consistent();
        // A running caller takes it first (barging).
        let barger = table.try_lock(1).expect("a free key may be taken");
        // b, woken, finds it held and waits again, still at the head.
        assert!(poll(&mut b, &wb).is_pending());
        assert_eq!(table.waiters(&1), 1);
        // The barger's release nudges b again; this time b takes it.
        drop(barger);
        assert_eq!(wakes(&cb), 2);
        let Poll::Ready(gb) = poll(&mut b, &wb) else {
            panic!("b takes the freed key when it polls")
        };
        assert!(gb.token() > ta);
        drop(gb);
        assert_eq!(wakes(&ca), 1);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn eventual_once_the_deadline_passed_a_release_hands_off_directly_again() {
        let (clock, table) = eventual();
        let holder = table.try_lock(1).unwrap();
        let (_, w) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &w).is_pending());
        drop(holder); // fair: starts the deadline
        let Poll::Ready(ga) = poll(&mut a, &w) else {
            panic!()
        };
        let mut b = Box::pin(table.lock(1));
        assert!(poll(&mut b, &w).is_pending());
        clock.advance(Fairness::EVENTUAL_BOUND);
        drop(ga);
        // Past the deadline: b owns the key before it runs.
        assert!(table.try_lock(1).is_err(), "no barging past the bound");
        assert!(table.is_locked(&1));
        assert!(matches!(poll(&mut b, &w), Poll::Ready(_)));
        assert_eq!(table.stats().handoffs, 2);
        table.assert_consistent();
    }

    #[test]
    fn eventual_a_nudged_head_that_is_dropped_passes_the_nudge_on() {
        let (_clock, table) = eventual();
        let holder = table.try_lock(1).unwrap();
        let (_, w) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &w).is_pending());
        drop(holder); // fair
        let Poll::Ready(ga) = poll(&mut a, &w) else {
            panic!()
        };
        let (_, wb) = counting();
        let (cc, wc) = counting();
        let mut b = Box::pin(table.lock(1));
        let mut c = Box::pin(table.lock(1));
        assert!(poll(&mut b, &wb).is_pending());
        assert!(poll(&mut c, &wc).is_pending());
        drop(ga); // unfair: frees the key, nudges b
        drop(b); // b never retries: its nudge must reach c, or the key strands
        assert_eq!(wakes(&cc), 1, "the next head is nudged");
        table.assert_consistent();
        assert!(matches!(poll(&mut c, &wc), Poll::Ready(_)));
        drop(c);
        assert!(table.is_empty());
    }

    /// Threads hammer a few keys with `blocking_lock` under both policies: no two
    /// holders at once, every thread makes progress, the table ends empty.
    fn hammer(fairness: Fairness) {
        const THREADS: usize = 16;
        const KEYS: u32 = 2;
        const PER_THREAD: u64 = 2_000;
        let table = Arc::new(LockTable::<u32>::builder().fairness(fairness).build());
        let inside: Arc<Vec<AtomicBool>> =
            Arc::new((0..KEYS).map(|_| AtomicBool::new(false)).collect());
        let total = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (table, inside, total) = (table.clone(), inside.clone(), total.clone());
                std::thread::spawn(move || {
                    for i in 0..PER_THREAD {
                        let key = ((t as u64 + i) % u64::from(KEYS)) as u32;
                        let guard = table.blocking_lock(key);
                        assert!(
                            !inside[key as usize].swap(true, SeqCst),
                            "two holders of key {key}"
                        );
                        std::hint::spin_loop();
                        inside[key as usize].store(false, SeqCst);
                        drop(guard);
                        total.fetch_add(1, SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("every thread finishes: no waiter starves");
        }
        assert_eq!(total.load(SeqCst), THREADS as u64 * PER_THREAD);
        assert!(table.is_empty());
        table.assert_consistent();
    }

    #[test]
    fn eventual_threads_keep_exclusion_and_all_finish() {
        hammer(Fairness::Eventual);
    }

    #[test]
    fn strict_threads_keep_exclusion_and_all_finish() {
        hammer(Fairness::Strict);
    }

    #[test]
    fn eventual_tokio_tasks_on_one_key_all_finish() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let table = Arc::new(
            LockTable::<u32>::builder()
                .fairness(Fairness::Eventual)
                .build(),
        );
        let count = Arc::new(AtomicU64::new(0));
        rt.block_on(async {
            let tasks: Vec<_> = (0..32)
                .map(|_| {
                    let (table, count) = (table.clone(), count.clone());
                    tokio::spawn(async move {
                        for _ in 0..500 {
                            let g = table.lock(7).await;
                            count.fetch_add(1, SeqCst);
                            drop(g);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        assert_eq!(count.load(SeqCst), 32 * 500);
        assert!(table.is_empty());
    }

    #[test]
    fn eventual_a_nudged_head_past_its_timeout_takes_the_free_key() {
        // Regression: under eventual fairness a poll past its timeout gave up
        // although a release had freed the key and nudged this waiter, the head.
        let (clock, table) = eventual();
        let holder = table.try_lock(1).unwrap();
        let (_, w) = counting();
        let mut a = Box::pin(table.lock(1));
        assert!(poll(&mut a, &w).is_pending());
        drop(holder); // fair: starts the fairness deadline
        let Poll::Ready(ga) = poll(&mut a, &w) else {
            panic!()
        };
        let opts = keylock::LockOptions::new().timeout(std::time::Duration::from_micros(100));
        let mut b = Box::pin(table.lock_with(1, opts));
        assert!(poll(&mut b, &w).is_pending());
        drop(ga); // before the deadline: frees the key, nudges b
        clock.advance(std::time::Duration::from_micros(100));
        match poll(&mut b, &w) {
            Poll::Ready(Ok(g)) => drop(g),
            other => panic!("b heads the queue of a free key, got {other:?}"),
        }
        table.assert_consistent();
        assert!(table.is_empty());
    }
}
