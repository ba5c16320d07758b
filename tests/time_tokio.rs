//! Tables built with `Builder::tokio_time()`: leases and timeouts follow
//! tokio's clock (paused and auto-advanced time included), the lock futures
//! spend tokio's cooperative budget, and outside a runtime a wait with a
//! timer falls back to the crate's own timer.
//!
//! Under paused time nothing here depends on how fast the machine is: virtual
//! time moves only when the test (or auto-advance) moves it, so a 2 s timeout
//! takes no real time; nothing asserts on real time, and the only real waits
//! are outer hang guards.

#[cfg(not(feature = "tokio"))]
#[test]
#[ignore = "needs --features tokio (or --all-features)"]
fn needs_feature_tokio() {}

#[cfg(feature = "tokio")]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;

    use keylock::{LockError, LockOptions, LockTable};
    use tokio::time::Instant as TokioInstant;

    const SEC: Duration = Duration::from_secs(1);

    /// An outer bound on a wait that must end, in virtual time under paused
    /// time (so exceeding it fails at once) and in real time elsewhere. It says
    /// nothing about how soon the wait should end.
    const HANG_GUARD: Duration = Duration::from_secs(60);

    fn lease(d: Duration) -> LockOptions {
        LockOptions::new().lease(d)
    }

    fn timeout(d: Duration) -> LockOptions {
        LockOptions::new().timeout(d)
    }

    fn tokio_table<K: Eq + std::hash::Hash>() -> LockTable<K> {
        LockTable::builder().tokio_time().build()
    }

    // ---------------------------------------------------------------------------
    // Paused time drives leases, lapses, timeouts and renewals.
    // ---------------------------------------------------------------------------

    #[tokio::test(start_paused = true)]
    async fn a_lease_lapses_by_virtual_time() {
        let table = tokio_table();
        let granted_at = TokioInstant::now();
        let guard = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        assert_eq!(
            guard.expires_at(),
            Some((granted_at + 5 * SEC).into_std()),
            "the lease is measured on tokio's clock"
        );

        tokio::time::advance(4 * SEC).await;
        assert_eq!(guard.check(), Ok(guard.token()), "live after 4 virtual s");
        assert!(table.is_locked("k"));

        tokio::time::advance(2 * SEC).await;
        assert_eq!(
            guard.check(),
            Err(LockError::Expired {
                token: guard.token(),
                key: None,
            }),
            "lapsed after 6 virtual s"
        );
        assert!(!table.is_locked("k"));
        drop(guard);
        assert!(table.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_lapses_exactly_at_its_virtual_deadline() {
        let table = tokio_table();
        let guard = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        tokio::time::advance(5 * SEC - Duration::from_millis(1)).await;
        assert!(!guard.is_expired(), "1 ms before the deadline");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(guard.is_expired(), "at the deadline");
    }

    /// The holder never releases; auto-advance moves virtual time to its
    /// deadline only because the waiter armed a tokio timer there.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_gets_the_key_of_a_stalled_holder_when_virtual_time_passes_its_deadline() {
        let table = Arc::new(tokio_table());
        let start = TokioInstant::now();
        let stuck = table.try_lock_with("k", lease(5 * SEC)).unwrap();
        let deadline = stuck.expires_at().unwrap();

        let t = table.clone();
        let waiter = tokio::spawn(async move {
            let guard = t.lock_owned("k").await;
            (guard, TokioInstant::now())
        });
        let (next, granted_at) = tokio::time::timeout(HANG_GUARD, waiter)
            .await
            .expect("the waiter was never woken at the holder's virtual deadline")
            .unwrap();

        assert!(granted_at.into_std() >= deadline, "handed over early");
        assert!(
            granted_at < start + 6 * SEC,
            "handed over {:?} after the start: not by the lease's timer",
            granted_at - start
        );
        assert!(next.token() > stuck.token());
        assert!(stuck.check().is_err(), "the stale holder is fenced");
        assert_eq!(next.check(), Ok(next.token()));
        drop(next);
        drop(stuck);
        assert!(table.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_fires_after_two_virtual_seconds() {
        let table = tokio_table();
        let held = table.try_lock(7u32).unwrap();
        let start = TokioInstant::now();
        let err = tokio::time::timeout(HANG_GUARD, table.lock_with(7, timeout(2 * SEC)))
            .await
            .expect("the timeout never fired")
            .unwrap_err();
        let elapsed = start.elapsed();
        match err {
            LockError::Timeout { waited, holder, .. } => {
                assert!(waited >= 2 * SEC, "waited {waited:?}");
                assert!(waited < 3 * SEC, "waited {waited:?}");
                assert_eq!(holder, Some(held.token()));
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(elapsed >= 2 * SEC && elapsed < 3 * SEC, "{elapsed:?}");
        assert_eq!(table.waiters(&7), 0);
        drop(held);
        assert!(table.is_empty());
    }

    /// A renewal at virtual 3 s moves the deadline from 5 s to 8 s: a waiter
    /// queued (and timed) before the renewal still waits at 6 s and gets the key
    /// at 8 s.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_moves_the_deadline_in_virtual_time() {
        let table = Arc::new(tokio_table());
        let start = TokioInstant::now();
        let holder = table
            .clone()
            .try_lock_owned_with("k", lease(5 * SEC))
            .unwrap();

        let t = table.clone();
        let waiter = tokio::spawn(async move {
            let guard = t.lock_owned("k").await;
            (guard, TokioInstant::now())
        });
        while table.waiters("k") == 0 {
            tokio::task::yield_now().await;
        }

        tokio::time::advance(3 * SEC).await;
        holder.renew(5 * SEC).unwrap();
        assert_eq!(holder.expires_at(), Some((start + 8 * SEC).into_std()));

        tokio::time::advance(3 * SEC).await;
        // Past the first deadline: the waiter's timer for it has fired.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            holder.check(),
            Ok(holder.token()),
            "live at 6 s after renewing at 3 s for 5 s"
        );
        assert!(
            !waiter.is_finished(),
            "handed over before the renewed deadline"
        );
        assert_eq!(table.waiters("k"), 1);

        let (next, granted_at) = tokio::time::timeout(HANG_GUARD, waiter)
            .await
            .expect("the waiter never got the key after the renewed deadline")
            .unwrap();
        assert!(granted_at >= start + 8 * SEC, "{:?}", granted_at - start);
        assert!(granted_at < start + 9 * SEC, "{:?}", granted_at - start);
        assert!(next.token() > holder.token());
        assert!(holder.is_expired());
        drop(next);
        drop(holder);
        assert!(table.is_empty());
    }

    /// The contrast that is why `tokio_time()` exists: a default table reads the
    /// monotonic clock, which paused time does not move.
    #[tokio::test(start_paused = true)]
    async fn a_default_table_does_not_follow_virtual_time() {
        let default = LockTable::new();
        let tokio = tokio_table();
        let plain = default.try_lock_with("k", lease(30 * SEC)).unwrap();
        let followed = tokio.try_lock_with("k", lease(30 * SEC)).unwrap();
        tokio::time::advance(31 * SEC).await;
        assert!(
            followed.is_expired(),
            "the tokio table follows virtual time"
        );
        assert_eq!(
            plain.check(),
            Ok(plain.token()),
            "the default table's 30 s lease is live after 31 virtual seconds"
        );
        assert!(default.is_locked("k"));
    }

    // ---------------------------------------------------------------------------
    // The cooperative budget.
    // ---------------------------------------------------------------------------

    /// Takes and drops an always-free key in a loop with no other await, until
    /// `flag` is set or `bound` iterations ran; returns the iterations run.
    async fn lock_loop<F, Fut>(flag: &AtomicBool, bound: usize, mut lock: F) -> usize
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future,
    {
        for i in 0..bound {
            if flag.load(SeqCst) {
                return i;
            }
            drop(lock().await);
        }
        bound
    }

    /// Spawns a task that sets a flag; on a current-thread runtime it can run
    /// only when the test's own future returns `Pending`.
    fn spawn_flag_setter() -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        tokio::spawn(async move { f.store(true, SeqCst) });
        flag
    }

    const YIELD_BOUND: usize = 1_000_000;

    /// Well above tokio's budget of 128 polls per task poll.
    const NO_YIELD_RUN: usize = 10_000;

    #[tokio::test(flavor = "current_thread")]
    async fn a_tokio_table_lock_loop_yields_to_other_tasks() {
        let table = Arc::new(tokio_table::<u64>());

        let flag = spawn_flag_setter();
        let ran = lock_loop(&flag, YIELD_BOUND, || table.lock(1)).await;
        assert!(ran < NO_YIELD_RUN, "lock: the other task ran after {ran}");

        let flag = spawn_flag_setter();
        let ran = lock_loop(&flag, YIELD_BOUND, || table.clone().lock_owned(1)).await;
        assert!(
            ran < NO_YIELD_RUN,
            "lock_owned: the other task ran after {ran}"
        );

        let flag = spawn_flag_setter();
        let ran = lock_loop(&flag, YIELD_BOUND, || async {
            table.lock_with(1, lease(SEC)).await.unwrap()
        })
        .await;
        assert!(
            ran < NO_YIELD_RUN,
            "lock_with: the other task ran after {ran}"
        );

        let flag = spawn_flag_setter();
        let ran = lock_loop(&flag, YIELD_BOUND, || async {
            table
                .clone()
                .lock_owned_with(1, timeout(SEC))
                .await
                .unwrap()
        })
        .await;
        assert!(
            ran < NO_YIELD_RUN,
            "lock_owned_with: the other task ran after {ran}"
        );
        assert!(table.is_empty());
    }

    /// Spends the running task's cooperative budget: a lock future polled
    /// next returns `Pending` before it touches the table.
    fn spend_budget(cx: &mut std::task::Context<'_>) {
        for _ in 0..NO_YIELD_RUN {
            match tokio::task::coop::poll_proceed(cx) {
                std::task::Poll::Ready(unit) => unit.made_progress(),
                std::task::Poll::Pending => return,
            }
        }
        panic!("the task has no budget to spend");
    }

    /// Polls `a` and `b` (the two calls of a deadlock) in turn, yielding to
    /// the runtime between rounds, until one of them is answered; the
    /// answer, or `None` if both still waited after a bound of rounds (no
    /// wait found the cycle: both would wait for ever).
    async fn first_answer<A, B, T>(
        mut a: std::pin::Pin<&mut A>,
        mut b: std::pin::Pin<&mut B>,
    ) -> Option<Result<T, keylock::TransactionError<u64>>>
    where
        A: std::future::Future<Output = Result<T, keylock::TransactionError<u64>>>,
        B: std::future::Future<Output = Result<T, keylock::TransactionError<u64>>>,
    {
        for _ in 0..16 {
            if let std::task::Poll::Ready(out) = futures::poll!(a.as_mut()) {
                return Some(out);
            }
            if let std::task::Poll::Ready(out) = futures::poll!(b.as_mut()) {
                return Some(out);
            }
            tokio::task::yield_now().await;
        }
        None
    }

    /// A test that a transaction's wait whose first poll finds its task's
    /// budget spent (its lock future would return `Pending` before it is
    /// queued) still searches for the cycle it closes, once it is queued:
    /// `a` holds 1 and waits (`$a_wait`) for 2 with its budget spent; `b`
    /// holds 2 and waits (`$b_wait`) for 1 before `a`'s wait is queued (so
    /// `b` finds no cycle: `a` waits nowhere yet); then `a`'s wait queues
    /// and must find the cycle. Deterministic: one task polls both by hand.
    macro_rules! budget_spent_wait_finds_its_cycle {
        ($(#[$doc:meta])* $name:ident, |$a:ident| $a_wait:expr, |$b:ident| $b_wait:expr) => {
            $(#[$doc])*
            #[tokio::test(flavor = "current_thread")]
            async fn $name() {
                use keylock::{Mode, TransactionError};
                use std::future::Future;
                let table = tokio_table::<u64>();
                let (mut $a, mut $b) = (table.transaction(), table.transaction());
                $a.lock(1, Mode::Exclusive).await.unwrap();
                $b.lock(2, Mode::Exclusive).await.unwrap();
                let mut a_wait = std::pin::pin!($a_wait);
                std::future::poll_fn(|cx| {
                    spend_budget(cx);
                    assert!(a_wait.as_mut().poll(cx).is_pending(), "2 is held");
                    std::task::Poll::Ready(())
                })
                .await;
                tokio::task::yield_now().await;
                let mut b_wait = std::pin::pin!($b_wait);
                assert!(futures::poll!(b_wait.as_mut()).is_pending(), "1 is held");
                let answer = first_answer(a_wait.as_mut(), b_wait.as_mut()).await;
                assert!(
                    matches!(answer, Some(Err(TransactionError::Deadlock(_)))),
                    "the cycle was not found: {answer:?}"
                );
            }
        };
    }

    budget_spent_wait_finds_its_cycle!(
        /// Through `lock`'s wait.
        a_wait_first_polled_with_the_budget_spent_finds_its_cycle,
        |a| a.lock(2, Mode::Exclusive),
        |b| b.lock(1, Mode::Exclusive)
    );

    budget_spent_wait_finds_its_cycle!(
        /// Through `lock_all`'s wait.
        a_lock_all_first_polled_with_the_budget_spent_finds_its_cycle,
        |a| a.lock_all([(2, Mode::Exclusive), (3, Mode::Exclusive)]),
        |b| b.lock_all([(1, Mode::Exclusive)])
    );

    /// Deterministic on a current-thread runtime: a default table's lock futures
    /// complete at once and never return `Pending`, so the test's future never
    /// yields and the spawned task cannot run until it does.
    #[tokio::test(flavor = "current_thread")]
    async fn a_default_table_lock_loop_does_not_yield() {
        let table = LockTable::<u64>::new();
        let flag = spawn_flag_setter();
        let ran = lock_loop(&flag, NO_YIELD_RUN, || table.lock(1)).await;
        assert_eq!(ran, NO_YIELD_RUN, "the other task ran after {ran}");
        assert!(!flag.load(SeqCst));
        // It was runnable all along: one yield lets it run.
        tokio::task::yield_now().await;
        assert!(flag.load(SeqCst));
    }

    // ---------------------------------------------------------------------------
    // Outside a runtime: the crate's timer at the same instant.
    // ---------------------------------------------------------------------------

    /// Runs `f` on a plain thread (no runtime) and waits for it, at most
    /// `HANG_GUARD`.
    fn on_plain_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            assert!(tokio::runtime::Handle::try_current().is_err());
            let _ = tx.send(f());
        });
        match rx.recv_timeout(HANG_GUARD) {
            Ok(out) => {
                thread.join().unwrap();
                out
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::panic::resume_unwind(thread.join().unwrap_err())
            }
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("the plain thread hung"),
        }
    }

    const SHORT: Duration = Duration::from_millis(30);

    #[test]
    fn blocking_timeout_on_a_tokio_table_without_a_runtime() {
        let table = Arc::new(tokio_table::<&str>());
        let held = table.try_lock("x").unwrap();
        let t = table.clone();
        let err = on_plain_thread(move || {
            let start = std::time::Instant::now();
            let err = t.blocking_lock_with("x", timeout(SHORT)).unwrap_err();
            (err, start.elapsed())
        });
        let (err, elapsed) = err;
        match err {
            LockError::Timeout { waited, holder, .. } => {
                assert!(waited >= SHORT, "waited {waited:?}");
                assert!(elapsed >= SHORT, "returned after {elapsed:?}");
                assert_eq!(holder, Some(held.token()));
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert_eq!(table.waiters("x"), 0);
        drop(held);
        assert!(table.is_empty());
    }

    #[test]
    fn blocking_waiter_on_a_tokio_table_without_a_runtime_gets_a_lapsed_key() {
        let table = Arc::new(tokio_table::<&str>());
        let stuck = table.try_lock_with("x", lease(SHORT)).unwrap();
        let deadline = stuck.expires_at().unwrap();
        let t = table.clone();
        let (token, at) = on_plain_thread(move || {
            let next = t.blocking_lock("x");
            (next.token(), std::time::Instant::now())
        });
        assert!(at >= deadline, "handed over before the deadline");
        assert!(token > stuck.token());
        assert!(stuck.check().is_err());
        drop(stuck);
        assert!(table.is_empty());
    }

    #[test]
    fn blocking_waiter_with_a_timeout_on_a_tokio_table_gets_a_lapsed_key_first() {
        let table = Arc::new(tokio_table::<&str>());
        let stuck = table.try_lock_with("x", lease(SHORT)).unwrap();
        let t = table.clone();
        let token = on_plain_thread(move || {
            t.blocking_lock_with("x", timeout(HANG_GUARD))
                .expect("the lease lapses long before the timeout")
                .token()
        });
        assert!(token > stuck.token());
        assert!(stuck.is_expired());
    }

    /// In a runtime's context but off its workers (`spawn_blocking`), a blocking
    /// wait uses tokio's timer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocking_timeout_on_a_tokio_table_in_spawn_blocking() {
        let table = Arc::new(tokio_table::<&str>());
        let held = table.try_lock("x").unwrap();
        let t = table.clone();
        let err = tokio::time::timeout(
            HANG_GUARD,
            tokio::task::spawn_blocking(move || {
                t.blocking_lock_with("x", timeout(SHORT)).map(drop)
            }),
        )
        .await
        .expect("the blocking wait hung")
        .unwrap()
        .unwrap_err();
        assert!(
            matches!(err, LockError::Timeout { waited, .. } if waited >= SHORT),
            "{err}"
        );
        assert_eq!(table.waiters("x"), 0);
        drop(held);
        assert!(table.is_empty());
    }

    // ---------------------------------------------------------------------------
    // Deadlines off tokio's millisecond grid.
    // ---------------------------------------------------------------------------

    /// Runs `f` on a current-thread runtime with paused time, on a thread of its
    /// own, and waits for it at most `HANG_GUARD` of real time: a lock future
    /// that spins inside one poll cannot be stopped by a virtual-time guard.
    fn paused<F, Fut>(f: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .unwrap();
            rt.block_on(f());
            let _ = tx.send(());
        });
        match rx.recv_timeout(HANG_GUARD) {
            Ok(()) => thread.join().unwrap(),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::panic::resume_unwind(thread.join().unwrap_err())
            }
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("the paused runtime hung"),
        }
    }

    /// tokio's timer works in whole milliseconds; a lease or a timeout that is
    /// not a whole number of them must still be judged on time: the waiter is
    /// not handed the key before the deadline, and is not left waiting after it.
    #[test]
    fn deadlines_between_milliseconds_in_virtual_time() {
        paused(|| async {
            let odd = [
                Duration::from_nanos(1),
                Duration::from_micros(1_500),
                Duration::from_nanos(2_000_000_001),
                Duration::from_nanos(999_999),
            ];
            let table = Arc::new(tokio_table::<u32>());
            for (i, d) in odd.into_iter().enumerate() {
                let key = i as u32;
                // A lease off the grid.
                let stuck = table.try_lock_with(key, lease(d)).unwrap();
                let deadline = stuck.expires_at().unwrap();
                let t = table.clone();
                let waiter = tokio::spawn(async move {
                    let g = t.lock_owned(key).await;
                    (g, TokioInstant::now())
                });
                let (next, at) = tokio::time::timeout(HANG_GUARD, waiter)
                    .await
                    .expect("the waiter was not woken after a lease off the grid")
                    .unwrap();
                assert!(at.into_std() >= deadline, "{d:?}: handed over early");
                assert!(
                    at.into_std() < deadline + Duration::from_millis(2),
                    "{d:?}: handed over {:?} late",
                    at.into_std() - deadline
                );
                assert!(next.token() > stuck.token());
                drop(next);
                drop(stuck);

                // A timeout off the grid.
                let held = table.try_lock(key).unwrap();
                let start = TokioInstant::now();
                let err = tokio::time::timeout(HANG_GUARD, table.lock_with(key, timeout(d)))
                    .await
                    .expect("the timeout off the grid never fired")
                    .unwrap_err();
                assert!(
                    matches!(err, LockError::Timeout { waited, .. } if waited >= d),
                    "{d:?}: {err}"
                );
                assert!(start.elapsed() >= d);
                assert!(start.elapsed() < d + Duration::from_millis(2));
                drop(held);
            }
            assert!(table.is_empty());
        });
    }
}
