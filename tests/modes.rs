//! Shared and exclusive modes on the core table, upgrade and downgrade.
//!
//! Deterministic first: futures are polled by hand with a waker that counts
//! its wakes, and leases and timeouts run on a `ManualClock`, so every
//! assertion is about order and state, never about time:
//!
//! - the compatibility rule through every entry point (async, owned, `try_`,
//!   `_with`, and the blocking forms on threads);
//! - FIFO between modes: a queued exclusive request blocks later shared ones,
//!   a stream of shared requests never starves it, consecutive shared waiters
//!   at the head are granted together and stop at the next exclusive one;
//! - fencing tokens: one per shared grant, an exclusive grant's above every
//!   earlier grant's of the key;
//! - upgrade (at once when alone; else after the other shared holders, ahead
//!   of every queued waiter; the second upgrader's conflict; lapse, revoke,
//!   timeout and cancellation while waiting) and downgrade (admits the shared
//!   waiters at the head of the queue, keeps its token);
//! - leases, `check`, `renew`, `lost`, `revoke_grant` per shared grant,
//!   `revoke` of every shared holder; `is_locked`, `waiters`, `len`, `stats`.
//!
//! Then a readers/writers stress under tokio (multi-thread), async-std, smol
//! and plain threads, with upgrades, downgrades and cancellation at random
//! points: never a writer together with anyone, reader counts consistent,
//! the table empty and consistent at the end.

#[cfg(not(feature = "test-util"))]
#[test]
#[ignore = "needs --features test-util (or --all-features)"]
fn needs_feature_test_util() {}

#[cfg(feature = "test-util")]
mod common;

#[cfg(feature = "test-util")]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Poll, Wake, Waker};

    use keylock::{
        FencingToken, Guard, LockError, LockOptions, LockTable, ManualClock, Mode, OwnedGuard,
        TryLockError,
    };

    use crate::common::{lease, poll, table, timeout, SEC, W};

    type Table = LockTable<&'static str>;

    const K: &str = "k";

    fn shared() -> LockOptions {
        LockOptions::new().shared()
    }

    fn exclusive() -> LockOptions {
        LockOptions::new().mode(Mode::Exclusive)
    }

    /// An `Arc` table on a fresh manual clock (the owned entry points need
    /// one).
    fn arc_table() -> (ManualClock, Arc<Table>) {
        let clock = ManualClock::new();
        let table = Arc::new(LockTable::builder().clock(clock.clone()).build());
        (clock, table)
    }

    /// Polls `f` once; panics with `what` unless it is still pending.
    #[track_caller]
    fn pending<F: Future + Unpin>(f: &mut F, w: &W, what: &str)
    where
        F::Output: std::fmt::Debug,
    {
        if let Poll::Ready(out) = w.poll(f) {
            panic!("{what}: resolved with {out:?}");
        }
    }

    /// Polls `f` once; panics with `what` if it is still pending.
    #[track_caller]
    fn ready<F: Future + Unpin>(f: &mut F, w: &W, what: &str) -> F::Output {
        match w.poll(f) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("{what}: still pending"),
        }
    }

    /// Spins (yielding the thread) until `key` has `n` queued waiters: an event,
    /// not a time.
    fn until_waiters(table: &Table, n: usize) {
        while table.waiters(&K) != n {
            std::thread::yield_now();
        }
    }

    // -----------------------------------------------------------------------
    // Mode and LockOptions
    // -----------------------------------------------------------------------

    #[test]
    fn mode_order_compatibility_and_display() {
        assert_eq!(Mode::default(), Mode::Exclusive);
        assert!(Mode::Shared < Mode::Exclusive);
        assert_eq!(Mode::Shared.max(Mode::Exclusive), Mode::Exclusive);
        assert!(Mode::Shared.is_compatible_with(Mode::Shared));
        assert!(!Mode::Shared.is_compatible_with(Mode::Exclusive));
        assert!(!Mode::Exclusive.is_compatible_with(Mode::Shared));
        assert!(!Mode::Exclusive.is_compatible_with(Mode::Exclusive));
        assert!(Mode::Exclusive.covers(Mode::Exclusive));
        assert!(Mode::Exclusive.covers(Mode::Shared));
        assert!(Mode::Shared.covers(Mode::Shared));
        assert!(!Mode::Shared.covers(Mode::Exclusive));
        assert_eq!(Mode::Shared.to_string(), "shared");
        assert_eq!(Mode::Exclusive.to_string(), "exclusive");
        assert_eq!(LockOptions::new().lock_mode(), Mode::Exclusive);
        assert_eq!(LockOptions::new().shared().lock_mode(), Mode::Shared);
        assert_eq!(
            LockOptions::new()
                .shared()
                .mode(Mode::Exclusive)
                .lock_mode(),
            Mode::Exclusive
        );
        // The mode survives the other options.
        let opts = LockOptions::new().shared().lease(SEC).timeout(SEC);
        assert_eq!(opts.lock_mode(), Mode::Shared);
    }

    // -----------------------------------------------------------------------
    // The compatibility rule, through every entry point
    // -----------------------------------------------------------------------

    /// Every way to ask for a key that does not block the thread.
    #[derive(Clone, Copy, Debug)]
    enum Entry {
        Lock,
        LockOwned,
        LockWith(Mode),
        LockOwnedWith(Mode),
        LockShared,
        LockSharedOwned,
        TryLock,
        TryLockOwned,
        TryLockWith(Mode),
        TryLockOwnedWith(Mode),
        TryLockShared,
        TryLockSharedOwned,
    }

    impl Entry {
        const SHARED: [Entry; 8] = [
            Entry::LockWith(Mode::Shared),
            Entry::LockOwnedWith(Mode::Shared),
            Entry::LockShared,
            Entry::LockSharedOwned,
            Entry::TryLockWith(Mode::Shared),
            Entry::TryLockOwnedWith(Mode::Shared),
            Entry::TryLockShared,
            Entry::TryLockSharedOwned,
        ];

        const EXCLUSIVE: [Entry; 8] = [
            Entry::Lock,
            Entry::LockOwned,
            Entry::LockWith(Mode::Exclusive),
            Entry::LockOwnedWith(Mode::Exclusive),
            Entry::TryLock,
            Entry::TryLockOwned,
            Entry::TryLockWith(Mode::Exclusive),
            Entry::TryLockOwnedWith(Mode::Exclusive),
        ];

        /// The async entry points (they queue).
        const WAITING_SHARED: [Entry; 4] = [
            Entry::LockWith(Mode::Shared),
            Entry::LockOwnedWith(Mode::Shared),
            Entry::LockShared,
            Entry::LockSharedOwned,
        ];

        fn mode(self) -> Mode {
            match self {
                Entry::LockWith(m)
                | Entry::LockOwnedWith(m)
                | Entry::TryLockWith(m)
                | Entry::TryLockOwnedWith(m) => m,
                Entry::LockShared
                | Entry::LockSharedOwned
                | Entry::TryLockShared
                | Entry::TryLockSharedOwned => Mode::Shared,
                Entry::Lock | Entry::LockOwned | Entry::TryLock | Entry::TryLockOwned => {
                    Mode::Exclusive
                }
            }
        }

        /// Asks for `K` and takes it if that needs no wait: an async entry
        /// point is polled once and dropped (cancelled) if pending.
        fn attempt(self, table: &Arc<Table>) -> Option<Any<'_>> {
            let w = W::new();
            let opts = LockOptions::new().mode(self.mode());
            macro_rules! once {
                ($fut:expr, $wrap:expr) => {{
                    let mut fut = Box::pin($fut);
                    match w.poll(&mut fut) {
                        Poll::Ready(g) => Some($wrap(g)),
                        Poll::Pending => None,
                    }
                }};
            }
            let ok = |r: Result<_, LockError>| r.expect("no options that can fail");
            let ok_owned = |r: Result<_, LockError>| r.expect("no options that can fail");
            match self {
                Entry::Lock => once!(table.lock(K), Any::B),
                Entry::LockOwned => once!(table.clone().lock_owned(K), Any::O),
                Entry::LockShared => once!(table.lock_shared(K), Any::B),
                Entry::LockSharedOwned => once!(table.clone().lock_shared_owned(K), Any::O),
                Entry::LockWith(_) => once!(table.lock_with(K, opts), |r| Any::B(ok(r))),
                Entry::LockOwnedWith(_) => {
                    once!(table.clone().lock_owned_with(K, opts), |r| Any::O(
                        ok_owned(r)
                    ))
                }
                Entry::TryLock => table.try_lock(K).ok().map(Any::B),
                Entry::TryLockOwned => table.clone().try_lock_owned(K).ok().map(Any::O),
                Entry::TryLockShared => table.try_lock_shared(K).ok().map(Any::B),
                Entry::TryLockSharedOwned => {
                    table.clone().try_lock_shared_owned(K).ok().map(Any::O)
                }
                Entry::TryLockWith(_) => match table.try_lock_with(K, opts) {
                    Ok(g) => Some(Any::B(g)),
                    Err(e) => {
                        assert_eq!(e, LockError::WouldBlock { key: None }, "{self:?}");
                        None
                    }
                },
                Entry::TryLockOwnedWith(_) => match table.clone().try_lock_owned_with(K, opts) {
                    Ok(g) => Some(Any::O(g)),
                    Err(e) => {
                        assert_eq!(e, LockError::WouldBlock { key: None }, "{self:?}");
                        None
                    }
                },
            }
        }
    }

    /// A guard of either kind.
    enum Any<'a> {
        B(Guard<'a, &'static str>),
        O(OwnedGuard<&'static str>),
    }

    impl Any<'_> {
        fn mode(&self) -> Mode {
            match self {
                Any::B(g) => g.mode(),
                Any::O(g) => g.mode(),
            }
        }

        fn token(&self) -> FencingToken {
            match self {
                Any::B(g) => g.token(),
                Any::O(g) => g.token(),
            }
        }
    }

    #[test]
    fn shared_is_held_together_with_shared_through_every_entry_point() {
        for first in Entry::SHARED {
            for second in Entry::SHARED {
                let (_clock, table) = arc_table();
                let a = first.attempt(&table).expect("a free key is taken at once");
                assert_eq!(a.mode(), Mode::Shared, "{first:?}");
                let b = second
                    .attempt(&table)
                    .unwrap_or_else(|| panic!("{second:?} after {first:?}: shared + shared"));
                assert_eq!(b.mode(), Mode::Shared, "{second:?}");
                assert_ne!(a.token(), b.token(), "each shared grant has its own token");
                assert!(table.is_locked(&K));
                for x in Entry::EXCLUSIVE {
                    assert!(
                        x.attempt(&table).is_none(),
                        "{x:?} took a key held shared by {first:?} and {second:?}"
                    );
                }
                assert_eq!(table.waiters(&K), 0, "the cancelled attempts left");
                drop(a);
                assert!(table.is_locked(&K), "one shared holder is left");
                drop(b);
                table.assert_consistent();
                assert!(table.is_empty());
            }
        }
    }

    #[test]
    fn an_exclusive_holder_excludes_every_entry_point_of_either_mode() {
        for holder in Entry::EXCLUSIVE {
            for other in Entry::SHARED.iter().chain(&Entry::EXCLUSIVE) {
                let (_clock, table) = arc_table();
                let x = holder.attempt(&table).expect("a free key is taken at once");
                assert_eq!(x.mode(), Mode::Exclusive, "{holder:?}");
                assert!(
                    other.attempt(&table).is_none(),
                    "{other:?} took a key held by {holder:?}"
                );
                assert_eq!(table.waiters(&K), 0);
                drop(x);
                let y = other.attempt(&table).expect("free again");
                assert_eq!(y.mode(), other.mode());
                drop(y);
                table.assert_consistent();
                assert!(table.is_empty());
            }
        }
    }

    #[test]
    fn a_shared_holder_excludes_every_exclusive_entry_point() {
        for holder in Entry::SHARED {
            for x in Entry::EXCLUSIVE {
                let (_clock, table) = arc_table();
                let s = holder.attempt(&table).unwrap();
                assert!(
                    x.attempt(&table).is_none(),
                    "{x:?} took a key held by {holder:?}"
                );
                drop(s);
                assert!(x.attempt(&table).is_some(), "{x:?} once free");
                table.assert_consistent();
                assert!(table.is_empty());
            }
        }
    }

    #[test]
    fn queued_shared_futures_of_every_entry_point_are_granted_together() {
        let (_clock, table) = arc_table();
        let x = table.try_lock(K).unwrap();
        let ws: Vec<W> = (0..4).map(|_| W::new()).collect();
        let mut a = Box::pin(table.lock_with(K, shared()));
        let mut b = Box::pin(table.clone().lock_owned_with(K, shared()));
        let mut c = Box::pin(table.lock_shared(K));
        let mut d = Box::pin(table.clone().lock_shared_owned(K));
        pending(
            &mut a,
            &ws[0],
            "lock_with(shared) behind an exclusive holder",
        );
        pending(&mut b, &ws[1], "lock_owned_with(shared)");
        pending(&mut c, &ws[2], "lock_shared");
        pending(&mut d, &ws[3], "lock_shared_owned");
        assert_eq!(table.waiters(&K), 4);
        drop(x);
        for (i, w) in ws.iter().enumerate() {
            assert_eq!(w.wakes(), 1, "shared waiter {i} woken once");
        }
        // Granted when the holder left, before any of them ran.
        assert_eq!(table.waiters(&K), 0);
        let a = ready(&mut a, &ws[0], "a").unwrap();
        let b = ready(&mut b, &ws[1], "b").unwrap();
        let c = ready(&mut c, &ws[2], "c");
        let d = ready(&mut d, &ws[3], "d");
        let modes = [a.mode(), b.mode(), c.mode(), d.mode()];
        assert_eq!(modes, [Mode::Shared; 4]);
        let mut tokens = vec![a.token(), b.token(), c.token(), d.token()];
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), 4, "distinct tokens");
        assert!(table.try_lock(K).is_err());
        drop((a, b, c, d));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn each_waiting_shared_entry_point_waits_for_an_exclusive_holder() {
        for e in Entry::WAITING_SHARED {
            let (_clock, table) = arc_table();
            let x = table.try_lock(K).unwrap();
            let w = W::new();
            let opts = shared();
            // Each future polled by hand: pending, woken by the release, granted.
            macro_rules! check {
                ($fut:expr) => {{
                    let mut f = Box::pin($fut);
                    assert!(w.poll(&mut f).is_pending(), "{e:?}");
                    assert_eq!(table.waiters(&K), 1);
                    assert_eq!(w.wakes(), 0);
                    drop(x);
                    assert_eq!(w.wakes(), 1, "{e:?}: woken by the release");
                    match w.poll(&mut f) {
                        Poll::Ready(g) => g,
                        Poll::Pending => panic!("{e:?}: not granted"),
                    }
                }};
            }
            let mode = match e {
                Entry::LockWith(_) => check!(table.lock_with(K, opts)).unwrap().mode(),
                Entry::LockOwnedWith(_) => check!(table.clone().lock_owned_with(K, opts))
                    .unwrap()
                    .mode(),
                Entry::LockShared => check!(table.lock_shared(K)).mode(),
                Entry::LockSharedOwned => check!(table.clone().lock_shared_owned(K)).mode(),
                _ => unreachable!(),
            };
            assert_eq!(mode, Mode::Shared, "{e:?}");
            table.assert_consistent();
            assert!(table.is_empty());
        }
    }

    #[test]
    fn blocking_shared_on_threads_wait_for_an_exclusive_holder_and_are_granted_together() {
        let table = LockTable::<&'static str>::new();
        let x = table.try_lock(K).unwrap();
        let entered = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let (table, entered) = (&table, &entered);
            let hs = [
                s.spawn(move || {
                    let g = table.blocking_lock_shared(K);
                    entered.fetch_add(1, SeqCst);
                    g.mode()
                }),
                s.spawn(move || {
                    let g = table.blocking_lock_with(K, shared()).unwrap();
                    entered.fetch_add(1, SeqCst);
                    g.mode()
                }),
            ];
            until_waiters(table, 2);
            assert_eq!(
                entered.load(SeqCst),
                0,
                "a blocked reader entered a written key"
            );
            assert!(table.is_locked(&K));
            drop(x);
            // The release granted both at once: nobody is queued any more.
            assert_eq!(table.waiters(&K), 0, "both shared waiters granted together");
            for h in hs {
                assert_eq!(h.join().unwrap(), Mode::Shared);
            }
        });
        assert_eq!(entered.load(SeqCst), 2);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn blocking_exclusive_on_threads_waits_for_every_shared_holder() {
        let table = LockTable::<&'static str>::new();
        let s1 = table.blocking_lock_shared(K);
        let s2 = table.blocking_lock_with(K, shared()).unwrap();
        assert_ne!(s1.token(), s2.token());
        let inside = AtomicUsize::new(0);
        std::thread::scope(|s| {
            let (table, inside) = (&table, &inside);
            let h1 = s.spawn(move || {
                let g = table.blocking_lock(K);
                assert_eq!(inside.fetch_add(1, SeqCst), 0, "two writers");
                let t = g.token();
                inside.fetch_sub(1, SeqCst);
                (g.mode(), t)
            });
            until_waiters(table, 1);
            let h2 = s.spawn(move || {
                let g = table.blocking_lock_with(K, exclusive()).unwrap();
                assert_eq!(inside.fetch_add(1, SeqCst), 0, "two writers");
                let t = g.token();
                inside.fetch_sub(1, SeqCst);
                (g.mode(), t)
            });
            until_waiters(table, 2);
            drop(s1);
            assert_eq!(table.waiters(&K), 2, "a writer entered beside a reader");
            assert_eq!(inside.load(SeqCst), 0);
            let last_shared = s2.token();
            drop(s2);
            let (m1, x1) = h1.join().unwrap();
            let (m2, x2) = h2.join().unwrap();
            assert_eq!((m1, m2), (Mode::Exclusive, Mode::Exclusive));
            assert!(
                x1 > last_shared && x2 > x1,
                "FIFO, and tokens above every earlier"
            );
        });
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // FIFO fairness between modes
    // -----------------------------------------------------------------------

    #[test]
    fn a_queued_exclusive_blocks_later_shared_requests() {
        let (_clock, table) = table();
        let s1 = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "an exclusive request behind a shared holder");
        // The key is held only shared, but a writer waits: readers queue.
        assert_eq!(
            table.try_lock_shared(K).err(),
            Some(TryLockError::WouldBlock { key: None })
        );
        assert_eq!(
            table.try_lock_with(K, shared()).err(),
            Some(LockError::WouldBlock { key: None })
        );
        let ws = W::new();
        let mut s2 = Box::pin(table.lock_shared(K));
        pending(&mut s2, &ws, "a shared request behind a queued exclusive");
        assert_eq!(table.waiters(&K), 2);
        drop(s1);
        assert_eq!(wx.wakes(), 1, "the writer is woken");
        assert_eq!(ws.wakes(), 0, "the reader behind it is not");
        let x = ready(&mut x, &wx, "the writer got the key");
        assert!(table.try_lock_shared(K).is_err());
        pending(&mut s2, &ws, "still behind the writer");
        drop(x);
        assert_eq!(ws.wakes(), 1);
        let s2 = ready(&mut s2, &ws, "the reader follows the writer");
        assert_eq!(s2.mode(), Mode::Shared);
        drop(s2);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_stream_of_shared_requests_never_starves_a_queued_exclusive() {
        let (_clock, table) = table();
        // Round after round: two readers hold, a writer queues, readers keep
        // arriving while the original ones leave one by one. The writer is
        // served as soon as the readers that were there before it are gone,
        // before every reader that came after it.
        let mut holders = vec![
            table.try_lock_shared(K).unwrap(),
            table.try_lock_shared(K).unwrap(),
        ];
        let mut last_writer = FencingToken::new(1).unwrap();
        for round in 0..5 {
            let wx = W::new();
            let mut x = Box::pin(table.lock(K));
            pending(&mut x, &wx, "the writer queues behind readers");
            let mut late = Vec::new();
            while let Some(h) = holders.pop() {
                let w = W::new();
                let mut r = Box::pin(table.lock_shared(K));
                pending(&mut r, &w, "a reader arriving after the writer waits");
                late.push((r, w));
                assert!(
                    table.try_lock_shared(K).is_err(),
                    "no barging past the writer"
                );
                drop(h);
                if !holders.is_empty() {
                    assert_eq!(wx.wakes(), 0, "round {round}: readers still hold");
                    pending(&mut x, &wx, "readers still hold");
                }
            }
            assert_eq!(wx.wakes(), 1, "round {round}: the writer is served");
            for (_, w) in &late {
                assert_eq!(
                    w.wakes(),
                    0,
                    "round {round}: a late reader overtook the writer"
                );
            }
            let xg = ready(&mut x, &wx, "the writer holds the key");
            assert!(xg.token() > last_writer);
            last_writer = xg.token();
            assert_eq!(table.waiters(&K), late.len());
            drop(xg);
            // Every late reader is admitted together.
            for (r, w) in &mut late {
                assert_eq!(w.wakes(), 1);
                let g = ready(r, w, "late reader granted after the writer");
                assert!(g.token() > last_writer);
                holders.push(g);
            }
            assert_eq!(table.waiters(&K), 0);
        }
        drop(holders);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn consecutive_shared_waiters_at_the_head_are_granted_together_up_to_the_next_exclusive() {
        let (_clock, table) = table();
        let x0 = table.try_lock(K).unwrap();
        let w: Vec<W> = (0..5).map(|_| W::new()).collect();
        let mut s1 = Box::pin(table.lock_shared(K));
        let mut s2 = Box::pin(table.lock_with(K, shared()));
        let mut s3 = Box::pin(table.lock_shared(K));
        let mut x1 = Box::pin(table.lock_with(K, exclusive()));
        let mut s4 = Box::pin(table.lock_shared(K));
        pending(&mut s1, &w[0], "s1");
        pending(&mut s2, &w[1], "s2");
        pending(&mut s3, &w[2], "s3");
        pending(&mut x1, &w[3], "x1");
        pending(&mut s4, &w[4], "s4");
        assert_eq!(table.waiters(&K), 5);
        let handoffs = table.stats().handoffs;
        let t0 = x0.token();
        drop(x0);
        assert_eq!(
            w.iter().map(W::wakes).collect::<Vec<_>>(),
            [1, 1, 1, 0, 0],
            "the three shared waiters at the head are woken, not x1 nor s4 behind it"
        );
        assert_eq!(table.waiters(&K), 2);
        assert_eq!(table.stats().handoffs, handoffs + 3);
        let g1 = ready(&mut s1, &w[0], "s1");
        let g2 = ready(&mut s2, &w[1], "s2").unwrap();
        let g3 = ready(&mut s3, &w[2], "s3");
        let mut ts = [g1.token(), g2.token(), g3.token()];
        ts.sort();
        assert!(
            ts[0] > t0 && ts[0] < ts[1] && ts[1] < ts[2],
            "distinct tokens"
        );
        pending(&mut x1, &w[3], "x1 waits for the three readers");
        pending(&mut s4, &w[4], "s4 waits behind x1");
        drop(g1);
        drop(g3);
        assert_eq!(w[3].wakes(), 0, "one reader still holds");
        drop(g2);
        assert_eq!(w[3].wakes(), 1);
        assert_eq!(w[4].wakes(), 0);
        let gx = ready(&mut x1, &w[3], "x1").unwrap();
        assert!(
            gx.token() > ts[2],
            "an exclusive token exceeds every earlier grant's"
        );
        pending(&mut s4, &w[4], "s4 waits for x1");
        drop(gx);
        let g4 = ready(&mut s4, &w[4], "s4");
        drop(g4);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_shared_request_joins_shared_holders_at_once_when_nobody_waits() {
        let (_clock, table) = table();
        let s1 = table.try_lock_shared(K).unwrap();
        let w = W::new();
        let mut s2 = Box::pin(table.lock_shared(K));
        let s2 = ready(&mut s2, &w, "nobody waits: joins at once");
        assert_eq!(
            table.stats().contended,
            0,
            "a shared join is not a contended grant"
        );
        drop((s1, s2));
        assert!(table.is_empty());
    }

    #[test]
    fn a_cancelled_exclusive_waiter_lets_the_shared_ones_behind_it_in() {
        let (_clock, table) = table();
        let s1 = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let (wa, wb) = (W::new(), W::new());
        let mut a = Box::pin(table.lock_shared(K));
        let mut b = Box::pin(table.lock_shared(K));
        pending(&mut a, &wa, "a behind x");
        pending(&mut b, &wb, "b behind x");
        drop(x);
        // The readers now head the queue of a key held shared: admitted.
        assert_eq!(
            (wa.wakes(), wb.wakes()),
            (1, 1),
            "readers behind a cancelled writer"
        );
        let a = ready(&mut a, &wa, "a");
        let b = ready(&mut b, &wb, "b");
        assert!(table.try_lock_shared(K).is_ok());
        drop((s1, a, b));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // Tokens
    // -----------------------------------------------------------------------

    #[test]
    fn every_shared_grant_has_its_own_token_and_an_exclusive_exceeds_all_earlier() {
        let (_clock, table) = arc_table();
        let mut earlier = Vec::new();
        let a = table.try_lock_shared(K).unwrap();
        let b = table.clone().try_lock_shared_owned(K).unwrap();
        let c = table.try_lock_with(K, shared()).unwrap();
        let d = table.clone().try_lock_owned_with(K, shared()).unwrap();
        earlier.extend([a.token(), b.token(), c.token(), d.token()]);
        let mut uniq = earlier.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(uniq.len(), 4, "one token per shared grant");
        // Queued behind them, an exclusive request; granted once all are gone.
        let w = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &w, "x");
        drop((d, a, c));
        pending(&mut x, &w, "b still holds");
        drop(b);
        let x = ready(&mut x, &w, "x");
        assert!(
            earlier.iter().all(|&t| x.token() > t),
            "exclusive {} not above every earlier grant {earlier:?}",
            x.token()
        );
        earlier.push(x.token());
        drop(x);
        // Shared grants after it, then another exclusive one.
        let e = table.try_lock_shared(K).unwrap();
        let f = table.try_lock_shared(K).unwrap();
        earlier.extend([e.token(), f.token()]);
        drop((e, f));
        let y = table.try_lock(K).unwrap();
        assert!(earlier.iter().all(|&t| y.token() > t));
        drop(y);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // Upgrade
    // -----------------------------------------------------------------------

    #[test]
    fn a_sole_shared_holder_upgrades_at_once_with_a_greater_token() {
        let (_clock, table) = table();
        // Earlier grants of the key, shared and exclusive.
        drop(table.try_lock(K).unwrap());
        let other = table.try_lock_shared(K).unwrap();
        let mut a = table.try_lock_shared(K).unwrap();
        let highest = other.token().max(a.token());
        drop(other);
        let before = a.token();
        let w = W::new();
        let t = ready(&mut Box::pin(a.upgrade()), &w, "alone: upgrades at once").unwrap();
        assert!(
            t > highest && t > before,
            "a new token above every earlier grant"
        );
        assert_eq!(a.token(), t);
        assert_eq!(a.mode(), Mode::Exclusive);
        assert_eq!(a.check(), Ok(t));
        assert!(table.try_lock_shared(K).is_err());
        assert!(table.try_lock(K).is_err());
        drop(a);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_sole_shared_holder_upgrades_ahead_of_a_queued_exclusive() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x queues behind the reader");
        let w = W::new();
        let t = ready(&mut Box::pin(a.upgrade()), &w, "alone: at once").unwrap();
        assert_eq!(a.mode(), Mode::Exclusive);
        assert_eq!(wx.wakes(), 0);
        drop(a);
        let x = ready(&mut x, &wx, "x follows");
        assert!(x.token() > t);
        drop(x);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_waits_for_the_other_shared_holders_and_is_served_before_every_waiter() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let c = table.try_lock_shared(K).unwrap();
        let (ta, tb, tc) = (a.token(), b.token(), c.token());
        // Queued before the upgrade: a writer, then a reader behind it.
        let (wx, ws, wu) = (W::new(), W::new(), W::new());
        let mut x = Box::pin(table.lock(K));
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut x, &wx, "x");
        pending(&mut s, &ws, "s");
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b and c still hold");
            assert_eq!(table.waiters(&K), 3, "a waiting upgrade counts as a waiter");
            drop(b);
            assert_eq!(wu.wakes(), 0, "c still holds");
            pending(&mut up, &wu, "c still holds");
            drop(c);
            assert_eq!(wu.wakes(), 1, "the upgrade is served first");
            assert_eq!((wx.wakes(), ws.wakes()), (0, 0), "not the queued waiters");
            let t = ready(&mut up, &wu, "upgraded").unwrap();
            assert!(t > ta && t > tb && t > tc);
        }
        assert_eq!(a.mode(), Mode::Exclusive);
        assert_eq!(table.waiters(&K), 2);
        assert!(table.is_locked(&K));
        pending(&mut x, &wx, "x waits for the upgraded writer");
        let tu = a.token();
        drop(a);
        assert_eq!((wx.wakes(), ws.wakes()), (1, 0));
        let xg = ready(&mut x, &wx, "x");
        assert!(xg.token() > tu);
        drop(xg);
        let sg = ready(&mut s, &ws, "s");
        drop(sg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_second_upgrader_gets_upgrade_conflict_at_once_and_stays_shared() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let mut b = table.try_lock_shared(K).unwrap();
        let mut c = table.try_lock_shared(K).unwrap();
        let (ta, tb, tc) = (a.token(), b.token(), c.token());
        let wa = W::new();
        let mut up = Box::pin(a.upgrade());
        pending(&mut up, &wa, "a waits for b and c");
        let w = W::new();
        for (g, t) in [(&mut b, tb), (&mut c, tc)] {
            let err = ready(&mut Box::pin(g.upgrade()), &w, "conflict at once").unwrap_err();
            assert_eq!(
                err,
                LockError::UpgradeConflict {
                    token: t,
                    upgrading: ta,
                    key: None,
                }
            );
            assert!(err.to_string().contains("upgrad"), "{err}");
            assert_eq!(g.mode(), Mode::Shared, "the refused upgrader stays shared");
            assert_eq!(g.token(), t);
            assert_eq!(g.check(), Ok(t));
        }
        // A conflict is not a wait; try again: still refused.
        assert!(matches!(
            ready(&mut Box::pin(b.upgrade_with(timeout(SEC))), &w, "again"),
            Err(LockError::UpgradeConflict { .. })
        ));
        assert_eq!(table.waiters(&K), 1, "only a's upgrade waits");
        drop(b);
        drop(c);
        assert_eq!(wa.wakes(), 1);
        let t = ready(&mut up, &wa, "a upgrades once the refused ones leave").unwrap();
        assert!(t > tc);
        drop(up);
        assert_eq!(a.mode(), Mode::Exclusive);
        drop(a);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_after_a_finished_upgrade_is_no_conflict() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let mut b = table.try_lock_shared(K).unwrap();
        let w = W::new();
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &w, "b holds");
        } // dropped: a is shared again, nobody upgrades
        assert_eq!(a.mode(), Mode::Shared);
        let wb = W::new();
        let mut upb = Box::pin(b.upgrade());
        pending(
            &mut upb,
            &wb,
            "b waits for a: no conflict with a dropped upgrade",
        );
        drop(a);
        assert_eq!(wb.wakes(), 1);
        ready(&mut upb, &wb, "b upgraded").unwrap();
        drop(upb);
        assert_eq!(b.mode(), Mode::Exclusive);
        drop(b);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_whose_lease_lapses_while_waiting_is_expired_and_frees_the_queue() {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x behind the readers");
        let wu = W::new();
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            clock.advance(SEC);
            assert!(wu.wakes() >= 1, "the lapse woke the waiting upgrade");
            assert_eq!(
                ready(&mut up, &wu, "a lapsed upgrade resolves"),
                Err(LockError::Expired {
                    token: ta,
                    key: None
                })
            );
        }
        assert!(a.is_expired());
        assert_eq!(
            a.check(),
            Err(LockError::Expired {
                token: ta,
                key: None
            })
        );
        assert_eq!(table.waiters(&K), 1, "only x waits");
        pending(&mut x, &wx, "b still holds");
        let before = wx.wakes();
        drop(b);
        assert!(
            wx.wakes() > before,
            "the lapsed upgrade does not block the queue"
        );
        let xg = ready(&mut x, &wx, "x");
        assert!(xg.token() > ta);
        drop(a); // fenced: frees nothing
        assert!(table.is_locked(&K));
        assert_eq!(xg.check(), Ok(xg.token()));
        drop(xg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_revoked_while_waiting_is_expired_and_frees_the_queue() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let wu = W::new();
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            assert!(table.revoke_grant(&K, ta));
            assert_eq!(wu.wakes(), 1, "the revocation woke the waiting upgrade");
            assert_eq!(
                ready(&mut up, &wu, "revoked"),
                Err(LockError::Expired {
                    token: ta,
                    key: None
                })
            );
        }
        assert_eq!(a.mode(), Mode::Shared);
        assert!(a.is_expired());
        assert_eq!(table.waiters(&K), 1);
        let stats = table.stats();
        assert_eq!(
            (stats.revoked, stats.timed_out, stats.cancelled),
            (1, 0, 0),
            "the upgrade neither ran out of time nor was dropped: only the revoke counts"
        );
        drop(b);
        let xg = ready(&mut x, &wx, "x after the last live reader");
        drop(a);
        drop(xg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_of_a_lost_grant_is_expired_at_once() {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        clock.advance(SEC);
        let w = W::new();
        let ta = a.token();
        let got = ready(&mut Box::pin(a.upgrade()), &w, "at once");
        assert_eq!(
            got,
            Err(LockError::Expired {
                token: ta,
                key: None
            })
        );
        let mut c = table.try_lock_shared(K).unwrap();
        let tc = c.token();
        assert!(table.revoke_grant(&K, tc));
        let got = ready(&mut Box::pin(c.upgrade()), &w, "at once");
        assert_eq!(
            got,
            Err(LockError::Expired {
                token: tc,
                key: None
            })
        );
        assert_eq!(table.waiters(&K), 0, "nothing queued");
        assert_eq!(b.check(), Ok(b.token()), "b is untouched");
        drop((a, b, c));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn the_other_holders_lapsing_grants_the_waiting_upgrade() {
        let (clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let wu = W::new();
        let mut up = Box::pin(a.upgrade());
        pending(&mut up, &wu, "b holds");
        clock.advance(SEC);
        assert!(wu.wakes() >= 1, "b's lapse woke the upgrade");
        let t = ready(&mut up, &wu, "upgraded once b lapsed").unwrap();
        drop(up);
        assert!(t > b.token());
        assert!(b.is_expired());
        pending(&mut x, &wx, "x still waits, for the upgraded a");
        drop(b);
        assert!(a.check().is_ok());
        drop(a);
        drop(ready(&mut x, &wx, "x"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn upgrade_with_a_timeout_gives_up_and_leaves_the_guard_shared() {
        let (clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let wu = W::new();
        {
            let mut up = Box::pin(a.upgrade_with(timeout(SEC)));
            pending(&mut up, &wu, "b holds");
            clock.advance(SEC / 2);
            pending(&mut up, &wu, "half the timeout");
            clock.advance(SEC / 2);
            assert!(wu.wakes() >= 1, "the timeout woke the upgrade");
            match ready(&mut up, &wu, "timed out") {
                Err(LockError::Timeout { waited, holder, .. }) => {
                    assert_eq!(waited, SEC);
                    assert!(holder.is_some(), "b held the key");
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
        }
        assert_eq!(a.mode(), Mode::Shared);
        assert_eq!(a.token(), ta);
        assert_eq!(a.check(), Ok(ta));
        // With a deadline instead: the same.
        {
            let at = clock.now() + SEC;
            let mut up = Box::pin(a.upgrade_with(LockOptions::new().deadline(at)));
            pending(&mut up, &wu, "b holds");
            clock.advance(SEC);
            assert!(matches!(
                ready(&mut up, &wu, "deadline"),
                Err(LockError::Timeout { .. })
            ));
        }
        // Mode and lease in the options are ignored.
        {
            let opts = LockOptions::new().shared().lease(SEC).timeout(SEC);
            let mut up = Box::pin(a.upgrade_with(opts));
            pending(&mut up, &wu, "b holds");
            drop(b);
            let t = ready(&mut up, &wu, "upgraded").unwrap();
            assert!(t > ta);
        }
        assert_eq!(
            a.mode(),
            Mode::Exclusive,
            "upgraded although opts said shared"
        );
        assert_eq!(a.expires_at(), None, "the grant keeps its (absent) lease");
        clock.advance(10 * SEC);
        assert!(a.check().is_ok());
        assert_eq!(wx.wakes(), 0);
        drop(a);
        drop(ready(&mut x, &wx, "x after the upgraded holder"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgrade_keeps_the_lease_deadline() {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(2 * SEC)).unwrap();
        let deadline = a.expires_at();
        assert!(deadline.is_some());
        clock.advance(SEC);
        let w = W::new();
        ready(&mut Box::pin(a.upgrade()), &w, "alone").unwrap();
        assert_eq!(a.expires_at(), deadline);
        clock.advance(SEC);
        assert!(
            a.is_expired(),
            "the upgraded grant lapses at the old deadline"
        );
        assert!(table.try_lock(K).is_ok());
        drop(a);
        table.assert_consistent();
    }

    #[test]
    fn dropping_a_pending_upgrade_leaves_the_guard_shared_and_the_queue_moving() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let (wx, ws) = (W::new(), W::new());
        let mut x = Box::pin(table.lock(K));
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut x, &wx, "x");
        pending(&mut s, &ws, "s");
        let wu = W::new();
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            assert_eq!(table.waiters(&K), 3);
        }
        assert_eq!(table.waiters(&K), 2, "the dropped upgrade left the queue");
        assert_eq!(a.mode(), Mode::Shared);
        assert_eq!(a.token(), ta);
        assert_eq!(a.check(), Ok(ta));
        drop(b);
        assert_eq!(wx.wakes(), 0, "a still holds shared");
        drop(a);
        assert_eq!((wx.wakes(), ws.wakes()), (1, 0));
        let xg = ready(&mut x, &wx, "x");
        drop(xg);
        let sg = ready(&mut s, &ws, "s");
        drop(sg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn dropping_a_granted_but_unobserved_upgrade_leaves_a_shared_guard_with_the_new_token() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let wu = W::new();
        let ws = W::new();
        let mut s = Box::pin(table.lock_shared(K));
        let s_ready;
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            drop(b);
            assert_eq!(wu.wakes(), 1, "granted");
            // A reader arriving now finds the key exclusively held.
            match ws.poll(&mut s) {
                Poll::Pending => s_ready = false,
                Poll::Ready(g) => panic!("a reader joined an upgraded grant: {:?}", g.mode()),
            }
        } // dropped before it looked
        assert!(!s_ready);
        assert_eq!(
            a.mode(),
            Mode::Shared,
            "never exclusive without its caller knowing"
        );
        assert!(a.token() > ta, "the guard carries the upgrade's new token");
        assert_eq!(a.check(), Ok(a.token()));
        // Made shared again: the reader at the head is admitted.
        assert_eq!(ws.wakes(), 1, "the undo admits the shared waiter");
        let sg = ready(&mut s, &ws, "s");
        assert!(table.try_lock(K).is_err());
        drop((a, sg));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn upgrading_an_exclusive_guard_is_a_no_op() {
        let (_clock, table) = table();
        let mut x = table.try_lock(K).unwrap();
        let tx = x.token();
        let ws = W::new();
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut s, &ws, "s behind x");
        let w = W::new();
        assert_eq!(ready(&mut Box::pin(x.upgrade()), &w, "at once"), Ok(tx));
        assert_eq!(
            ready(&mut Box::pin(x.upgrade_with(timeout(SEC))), &w, "at once"),
            Ok(tx)
        );
        assert_eq!(x.token(), tx);
        assert_eq!(x.mode(), Mode::Exclusive);
        assert_eq!(table.waiters(&K), 1);
        assert_eq!(ws.wakes(), 0);
        drop(x);
        drop(ready(&mut s, &ws, "s"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn owned_guards_upgrade_and_downgrade() {
        let (_clock, table) = arc_table();
        let mut a = table.clone().try_lock_shared_owned(K).unwrap();
        let b = table.clone().try_lock_shared_owned(K).unwrap();
        let w = W::new();
        let mut up = Box::pin(a.upgrade());
        pending(&mut up, &w, "b holds");
        drop(b);
        let t = ready(&mut up, &w, "upgraded").unwrap();
        drop(up);
        assert_eq!((a.mode(), a.token()), (Mode::Exclusive, t));
        a.downgrade().unwrap();
        assert_eq!((a.mode(), a.token()), (Mode::Shared, t));
        let c = table.clone().try_lock_shared_owned(K).unwrap();
        drop((a, c));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // Downgrade
    // -----------------------------------------------------------------------

    #[test]
    fn a_downgrade_admits_the_shared_waiters_at_the_head_and_no_one_behind_an_exclusive() {
        let (_clock, table) = table();
        let mut x = table.try_lock(K).unwrap();
        let tx = x.token();
        let w: Vec<W> = (0..4).map(|_| W::new()).collect();
        let mut s1 = Box::pin(table.lock_shared(K));
        let mut s2 = Box::pin(table.lock_with(K, shared()));
        let mut x2 = Box::pin(table.lock(K));
        let mut s3 = Box::pin(table.lock_shared(K));
        pending(&mut s1, &w[0], "s1");
        pending(&mut s2, &w[1], "s2");
        pending(&mut x2, &w[2], "x2");
        pending(&mut s3, &w[3], "s3");
        assert_eq!(x.downgrade(), Ok(()));
        assert_eq!(x.mode(), Mode::Shared);
        assert_eq!(x.token(), tx, "a downgrade keeps the token");
        assert_eq!(x.check(), Ok(tx));
        assert_eq!(
            w.iter().map(W::wakes).collect::<Vec<_>>(),
            [1, 1, 0, 0],
            "the readers at the head, not the writer nor the reader behind it"
        );
        assert_eq!(table.waiters(&K), 2);
        let g1 = ready(&mut s1, &w[0], "s1");
        let g2 = ready(&mut s2, &w[1], "s2").unwrap();
        assert!(g1.token() > tx && g2.token() > tx);
        assert!(table.try_lock_shared(K).is_err(), "x2 waits: no barging");
        pending(&mut x2, &w[2], "x2 waits for three readers");
        drop(x);
        drop(g1);
        assert_eq!(w[2].wakes(), 0);
        let top = g2.token();
        drop(g2);
        let gx = ready(&mut x2, &w[2], "x2");
        assert!(gx.token() > top);
        pending(&mut s3, &w[3], "s3 behind x2");
        drop(gx);
        drop(ready(&mut s3, &w[3], "s3"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_downgrade_with_an_exclusive_waiter_at_the_head_admits_nobody() {
        let (_clock, table) = table();
        let mut x = table.try_lock(K).unwrap();
        let (wx, ws) = (W::new(), W::new());
        let mut x2 = Box::pin(table.lock(K));
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut x2, &wx, "x2");
        pending(&mut s, &ws, "s");
        x.downgrade().unwrap();
        assert_eq!((wx.wakes(), ws.wakes()), (0, 0));
        assert!(table.try_lock_shared(K).is_err());
        drop(x);
        assert_eq!((wx.wakes(), ws.wakes()), (1, 0));
        drop(ready(&mut x2, &wx, "x2"));
        drop(ready(&mut s, &ws, "s"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_downgraded_holder_shares_with_new_readers_and_can_upgrade_again() {
        let (_clock, table) = table();
        let mut x = table.try_lock(K).unwrap();
        let tx = x.token();
        x.downgrade().unwrap();
        assert_eq!(x.downgrade(), Ok(()), "already shared: nothing to do");
        assert_eq!(x.mode(), Mode::Shared);
        let r = table
            .try_lock_shared(K)
            .expect("a downgraded key admits readers");
        assert!(table.try_lock(K).is_err());
        let w = W::new();
        let mut up = Box::pin(x.upgrade());
        pending(&mut up, &w, "r holds");
        let tr = r.token();
        drop(r);
        let t = ready(&mut up, &w, "upgraded").unwrap();
        drop(up);
        assert!(t > tx && t > tr);
        assert_eq!(x.mode(), Mode::Exclusive);
        drop(x);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn a_downgrade_of_a_lost_grant_is_expired() {
        let (clock, table) = table();
        let mut x = table.try_lock_with(K, lease(SEC)).unwrap();
        clock.advance(SEC);
        assert_eq!(
            x.downgrade(),
            Err(LockError::Expired {
                token: x.token(),
                key: None
            })
        );
        let mut y = table.try_lock(K).expect("the lapsed key is free");
        assert!(table.revoke_grant(&K, y.token()));
        assert_eq!(
            y.downgrade(),
            Err(LockError::Expired {
                token: y.token(),
                key: None
            })
        );
        // Neither lost grant let a reader in beside a live holder.
        let z = table.try_lock(K).expect("free");
        assert!(table.try_lock_shared(K).is_err());
        drop((x, y, z));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // Leases, check, renew, lost, revoke per shared grant
    // -----------------------------------------------------------------------

    #[test]
    fn one_shared_grant_lapsing_fences_it_alone_and_a_writer_waits_for_all() {
        let (clock, table) = table();
        let a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_with(K, shared().lease(3 * SEC)).unwrap();
        let c = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        clock.advance(SEC);
        assert_eq!(
            a.check(),
            Err(LockError::Expired {
                token: a.token(),
                key: None
            })
        );
        assert_eq!(b.check(), Ok(b.token()));
        assert_eq!(c.check(), Ok(c.token()));
        pending(&mut x, &wx, "b and c still hold");
        clock.advance(2 * SEC);
        assert!(b.is_expired());
        assert!(c.check().is_ok());
        pending(&mut x, &wx, "c still holds");
        assert!(table.is_locked(&K));
        drop(a); // fenced: frees nothing
        drop(b);
        pending(&mut x, &wx, "c still holds");
        let tc = c.token();
        drop(c);
        let xg = ready(&mut x, &wx, "x once every reader is gone");
        assert!(xg.token() > tc);
        drop(xg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn the_lapse_of_the_last_shared_grants_hands_the_key_on_by_itself() {
        let (clock, table) = table();
        let a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_with(K, shared().lease(2 * SEC)).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        clock.advance(SEC);
        pending(&mut x, &wx, "b still holds");
        clock.advance(SEC);
        assert!(wx.wakes() >= 1, "the last lapse woke the writer");
        let xg = ready(&mut x, &wx, "x without anyone releasing");
        assert!(xg.token() > b.token() && xg.token() > a.token());
        drop((a, b)); // fenced
        assert!(table.is_locked(&K));
        assert_eq!(xg.check(), Ok(xg.token()));
        drop(xg);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn renew_works_per_shared_grant() {
        let (clock, table) = table();
        let a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        a.renew(5 * SEC).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        clock.advance(SEC);
        assert!(b.is_expired());
        assert_eq!(
            b.renew(SEC),
            Err(LockError::Expired {
                token: b.token(),
                key: None
            })
        );
        assert_eq!(a.check(), Ok(a.token()), "a was renewed");
        pending(&mut x, &wx, "a holds");
        clock.advance(4 * SEC);
        assert!(a.is_expired());
        drop(ready(&mut x, &wx, "x after a's renewed lease"));
        drop((a, b));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn lost_and_revoke_grant_work_per_shared_grant() {
        let (_clock, table) = table();
        let a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let (wla, wlb) = (W::new(), W::new());
        let mut la = Box::pin(a.lost());
        let mut lb = Box::pin(b.lost());
        pending(&mut la, &wla, "a holds");
        pending(&mut lb, &wlb, "b holds");
        assert!(table.revoke_grant(&K, a.token()));
        assert!(!table.revoke_grant(&K, a.token()), "once");
        assert_eq!(wla.wakes(), 1);
        assert_eq!(wlb.wakes(), 0, "only the revoked grant's watcher");
        assert_eq!(
            ready(&mut la, &wla, "a lost"),
            LockError::Expired {
                token: a.token(),
                key: None
            }
        );
        pending(&mut lb, &wlb, "b still holds");
        assert_eq!(b.check(), Ok(b.token()));
        pending(&mut x, &wx, "b still holds");
        assert!(table.revoke_grant(&K, b.token()));
        assert_eq!(wlb.wakes(), 1);
        assert_eq!(wx.wakes(), 1, "the last revocation hands the key on");
        drop((la, lb));
        let xg = ready(&mut x, &wx, "x");
        drop((a, b));
        assert!(table.is_locked(&K));
        drop(xg);
        assert_eq!(table.stats().revoked, 2);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn revoke_forces_out_every_shared_holder() {
        let (_clock, table) = table();
        let a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let c = table.try_lock_shared(K).unwrap();
        let highest = a.token().max(b.token()).max(c.token());
        let (wx, ws) = (W::new(), W::new());
        let mut x = Box::pin(table.lock(K));
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut x, &wx, "x");
        pending(&mut s, &ws, "s");
        assert_eq!(table.revoke(&K), Some(highest), "the highest token revoked");
        for g in [&a, &b, &c] {
            assert!(g.is_expired());
            assert_eq!(
                g.check(),
                Err(LockError::Expired {
                    token: g.token(),
                    key: None
                })
            );
        }
        assert_eq!((wx.wakes(), ws.wakes()), (1, 0), "the writer at the head");
        let xg = ready(&mut x, &wx, "x");
        assert!(xg.token() > highest);
        drop((a, b, c)); // fenced
        assert_eq!(xg.check(), Ok(xg.token()));
        assert_eq!(table.revoke(&K), Some(xg.token()));
        assert_eq!(ws.wakes(), 1);
        let sg = ready(&mut s, &ws, "s");
        assert_eq!(table.stats().revoked, 4);
        drop((xg, sg));
        assert_eq!(table.revoke(&K), None);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    /// A revoke that finds the other reader's lease lapsed does not settle
    /// that lapse first: doing so would grant the waiting upgrade (a new
    /// token) before the revoke reaches the upgrader, which would escape
    /// it. Both go at once: the lapse counted expired, the upgrader revoked
    /// and its upgrade failed.
    #[test]
    fn revoke_meeting_a_lapse_fails_the_upgrade_it_would_have_granted() {
        let (clock, table) = table();
        let a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let mut b = table.try_lock_shared(K).unwrap();
        let tb = b.token();
        let wu = W::new();
        let mut up = Box::pin(b.upgrade());
        pending(&mut up, &wu, "a holds");
        clock.advance(SEC);
        assert_eq!(table.revoke(&K), Some(tb), "the live upgrader is revoked");
        assert_eq!(
            ready(&mut up, &wu, "revoked"),
            Err(LockError::Expired {
                token: tb,
                key: None
            })
        );
        drop(up);
        let stats = table.stats();
        assert_eq!((stats.expired, stats.revoked), (1, 1));
        assert!(b.is_expired());
        assert!(!table.is_locked(&K), "nobody holds the key");
        drop((a, b));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    /// Two readers: `a`'s lease lapses unnoticed while its upgrade waits
    /// behind `b`; then `b` lets go by `act` (a `revoke_grant`, a release).
    /// The lapsed reader goes with it, before anyone is admitted, so its
    /// upgrade fails rather than being granted a new token on a lease
    /// already past.
    fn a_lapsed_readers_upgrade_fails_when_the_other_goes(
        act: impl FnOnce(&Table, Guard<'_, &'static str>),
        revoked: u64,
    ) {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let ta = a.token();
        let wu = W::new();
        let mut up = Box::pin(a.upgrade());
        pending(&mut up, &wu, "b holds");
        clock.advance(SEC);
        act(&table, b);
        assert_eq!(
            ready(&mut up, &wu, "lapsed"),
            Err(LockError::Expired {
                token: ta,
                key: None
            })
        );
        drop(up);
        let stats = table.stats();
        assert_eq!(
            (stats.expired, stats.revoked, stats.handoffs),
            (1, revoked, 0)
        );
        assert!(!table.is_locked(&K), "nobody holds the key");
        drop(a);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn revoke_grant_meeting_a_lapse_does_not_grant_the_lapsed_readers_upgrade() {
        a_lapsed_readers_upgrade_fails_when_the_other_goes(
            |table, b| {
                assert!(table.revoke_grant(&K, b.token()));
                drop(b); // fenced: frees nothing
            },
            1,
        );
    }

    #[test]
    fn a_release_meeting_a_lapse_does_not_grant_the_lapsed_readers_upgrade() {
        a_lapsed_readers_upgrade_fails_when_the_other_goes(|_, b| drop(b), 0);
    }

    #[test]
    fn revoke_during_an_upgrade_fails_it_and_hands_the_key_on() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let wu = W::new();
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            assert!(table.revoke(&K).is_some());
            assert!(wu.wakes() >= 1);
            assert!(matches!(
                ready(&mut up, &wu, "revoked"),
                Err(LockError::Expired { .. })
            ));
        }
        assert_eq!(wx.wakes(), 1);
        let xg = ready(&mut x, &wx, "x");
        assert!(a.is_expired() && b.is_expired());
        drop((a, b, xg));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // A group of shared waiters behind a grant that ends without a release
    // -----------------------------------------------------------------------

    /// Both manual clocks: one timer per waiter, or one per shard (as on the
    /// real clock).
    fn clocks() -> [(&'static str, ManualClock); 2] {
        [
            ("waiter timers", ManualClock::new()),
            ("shard timers", ManualClock::with_shard_timers()),
        ]
    }

    /// Polls each still-pending future of `group` that was woken, as an
    /// executor would, until all are granted; panics if one is left pending
    /// and unwoken (a lost wake-up: its task would sleep for ever).
    #[track_caller]
    fn drain<F: Future + Unpin>(group: &mut [(Option<F>, W, usize)], what: &str) -> Vec<F::Output> {
        let mut out = Vec::new();
        loop {
            let mut progressed = false;
            for (f, w, seen) in group.iter_mut() {
                let Some(fut) = f.as_mut() else { continue };
                if w.wakes() > *seen {
                    *seen = w.wakes();
                    progressed = true;
                    if let Poll::Ready(g) = w.poll(fut) {
                        out.push(g);
                        *f = None;
                    }
                }
            }
            if group.iter().all(|(f, _, _)| f.is_none()) {
                return out;
            }
            assert!(
                progressed,
                "{what}: {} waiter(s) pending and never woken again (lost wake-up)",
                group.iter().filter(|(f, _, _)| f.is_some()).count()
            );
        }
    }

    #[test]
    fn an_exclusive_lapse_admits_every_shared_waiter_at_the_head() {
        for (name, clock) in clocks() {
            let table: Table = LockTable::builder().clock(clock.clone()).build();
            let x = table.try_lock_with(K, lease(SEC)).unwrap();
            let mut group: Vec<_> = (0..3)
                .map(|_| (Some(Box::pin(table.lock_shared(K))), W::new(), 0))
                .collect();
            for (f, w, _) in &mut group {
                pending(f.as_mut().unwrap(), w, name);
            }
            let wx = W::new();
            let mut x2 = Box::pin(table.lock(K));
            pending(&mut x2, &wx, name);
            clock.advance(SEC);
            let gs = drain(&mut group, name);
            assert_eq!(gs.len(), 3, "{name}");
            assert!(gs
                .iter()
                .all(|g| g.mode() == Mode::Shared && g.token() > x.token()));
            pending(&mut x2, &wx, "the writer behind the readers waits");
            drop(x);
            drop(gs);
            drop(ready(&mut x2, &wx, name));
            table.assert_consistent();
            assert!(table.is_empty(), "{name}");
        }
    }

    #[test]
    fn revoking_an_exclusive_holder_admits_every_shared_waiter_at_the_head() {
        for by_token in [false, true] {
            let (_clock, table) = table();
            let x = table.try_lock(K).unwrap();
            let mut group: Vec<_> = (0..3)
                .map(|_| (Some(Box::pin(table.lock_shared(K))), W::new(), 0))
                .collect();
            for (f, w, _) in &mut group {
                pending(f.as_mut().unwrap(), w, "queued");
            }
            if by_token {
                assert!(table.revoke_grant(&K, x.token()));
            } else {
                assert_eq!(table.revoke(&K), Some(x.token()));
            }
            for (_, w, _) in &group {
                assert_eq!(w.wakes(), 1, "every reader at the head is woken");
            }
            let gs = drain(&mut group, "after a revocation");
            assert_eq!(gs.len(), 3);
            drop((x, gs));
            table.assert_consistent();
            assert!(table.is_empty());
        }
    }

    #[test]
    fn a_head_exclusive_waiter_timing_out_admits_the_shared_waiters_behind_it() {
        for (name, clock) in clocks() {
            let table: Table = LockTable::builder().clock(clock.clone()).build();
            let s1 = table.try_lock_shared(K).unwrap();
            let wx = W::new();
            let mut x = Box::pin(table.lock_with(K, timeout(SEC)));
            pending(&mut x, &wx, name);
            let mut group: Vec<_> = (0..2)
                .map(|_| (Some(Box::pin(table.lock_shared(K))), W::new(), 0))
                .collect();
            for (f, w, _) in &mut group {
                pending(f.as_mut().unwrap(), w, name);
            }
            clock.advance(SEC);
            assert!(wx.wakes() >= 1, "{name}: the timeout woke the writer");
            assert!(matches!(
                ready(&mut x, &wx, name),
                Err(LockError::Timeout { .. })
            ));
            // The readers behind it now head the queue of a key held shared.
            let gs = drain(&mut group, name);
            assert_eq!(gs.len(), 2, "{name}");
            drop((s1, gs));
            table.assert_consistent();
            assert!(table.is_empty(), "{name}");
        }
    }

    #[test]
    fn a_granted_shared_waiter_dropped_unobserved_passes_only_its_own_grant_on() {
        let (_clock, table) = table();
        let x = table.try_lock(K).unwrap();
        let w: Vec<W> = (0..4).map(|_| W::new()).collect();
        let mut s1 = Box::pin(table.lock_shared(K));
        let mut s2 = Box::pin(table.lock_shared(K));
        let mut x2 = Box::pin(table.lock(K));
        let mut s3 = Box::pin(table.lock_shared(K));
        pending(&mut s1, &w[0], "s1");
        pending(&mut s2, &w[1], "s2");
        pending(&mut x2, &w[2], "x2");
        pending(&mut s3, &w[3], "s3");
        drop(x);
        drop(s1); // granted, never looked at
        assert_eq!(w[2].wakes(), 0, "s2 still holds: x2 waits");
        let g2 = ready(&mut s2, &w[1], "s2");
        pending(&mut x2, &w[2], "x2");
        drop(g2);
        assert_eq!((w[2].wakes(), w[3].wakes()), (1, 0));
        drop(x2); // granted, never looked at: passes it on to s3
        assert_eq!(w[3].wakes(), 1);
        drop(ready(&mut s3, &w[3], "s3"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn undoing_an_unobserved_upgrade_admits_no_reader_behind_a_queued_writer() {
        let (_clock, table) = table();
        let mut a = table.try_lock_shared(K).unwrap();
        let b = table.try_lock_shared(K).unwrap();
        let (wx, ws, wu) = (W::new(), W::new(), W::new());
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut s, &ws, "s behind x");
        {
            let mut up = Box::pin(a.upgrade());
            pending(&mut up, &wu, "b holds");
            drop(b);
            assert_eq!(wu.wakes(), 1);
        } // granted, never looked at: undone
        assert_eq!(a.mode(), Mode::Shared);
        assert_eq!(
            (wx.wakes(), ws.wakes()),
            (0, 0),
            "x heads the queue; s waits behind it"
        );
        pending(&mut s, &ws, "s behind x");
        let ta = a.token();
        drop(a);
        let xg = ready(&mut x, &wx, "x");
        assert!(xg.token() > ta);
        drop(xg);
        drop(ready(&mut s, &ws, "s"));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgraded_grant_answers_to_its_new_token_only() {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(10 * SEC)).unwrap();
        let old = a.token();
        let w = W::new();
        let new = ready(&mut Box::pin(a.upgrade()), &w, "alone").unwrap();
        assert!(
            !table.revoke_grant(&K, old),
            "the old token names no grant any more"
        );
        assert_eq!(a.check(), Ok(new));
        a.renew(20 * SEC).unwrap();
        clock.advance(15 * SEC);
        assert_eq!(a.check(), Ok(new), "renewed after the upgrade");
        let wl = W::new();
        {
            let mut lost = Box::pin(a.lost());
            pending(&mut lost, &wl, "live");
            assert!(table.revoke_grant(&K, new));
            assert_eq!(wl.wakes(), 1);
            assert_eq!(
                ready(&mut lost, &wl, "lost"),
                LockError::Expired {
                    token: new,
                    key: None
                }
            );
        }
        assert!(
            table.try_lock_shared(K).is_ok(),
            "the revoked upgraded grant left"
        );
        assert_eq!(
            a.downgrade(),
            Err(LockError::Expired {
                token: new,
                key: None
            })
        );
        drop(a);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    #[test]
    fn an_upgraded_grant_that_lapses_hands_the_key_on() {
        let (clock, table) = table();
        let mut a = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        let w = W::new();
        let t = ready(&mut Box::pin(a.upgrade()), &w, "alone").unwrap();
        let mut group: Vec<_> = (0..2)
            .map(|_| (Some(Box::pin(table.lock_shared(K))), W::new(), 0))
            .collect();
        for (f, w, _) in &mut group {
            pending(f.as_mut().unwrap(), w, "behind the upgraded writer");
        }
        clock.advance(SEC);
        let gs = drain(&mut group, "after the upgraded grant lapsed");
        assert!(gs.iter().all(|g| g.token() > t));
        assert!(a.is_expired());
        drop((a, gs));
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // is_locked, waiters, len, stats
    // -----------------------------------------------------------------------

    #[test]
    fn monitors_stay_meaningful_with_shared_holders() {
        let (clock, table) = table();
        assert!(!table.is_locked(&K));
        let a = table.try_lock_shared(K).unwrap();
        assert!(table.is_locked(&K), "held shared is locked");
        assert_eq!(table.len(), 1);
        assert_eq!(table.waiters(&K), 0);
        let b = table.try_lock_with(K, shared().lease(SEC)).unwrap();
        assert_eq!(table.len(), 1, "one key");
        assert_eq!(table.stats().acquisitions, 2, "each shared grant counts");
        let wx = W::new();
        let mut x = Box::pin(table.lock(K));
        pending(&mut x, &wx, "x");
        let ws = W::new();
        let mut s = Box::pin(table.lock_shared(K));
        pending(&mut s, &ws, "s");
        assert_eq!(table.waiters(&K), 2);
        drop(a);
        assert!(table.is_locked(&K), "b still holds");
        clock.advance(SEC); // b lapses: the writer's timer wakes it
        assert!(
            !table.is_locked(&K),
            "a lapsed shared holder does not count"
        );
        let xg = ready(&mut x, &wx, "x");
        assert!(table.is_locked(&K), "the writer holds it");
        assert_eq!(table.waiters(&K), 1);
        drop(xg);
        assert_eq!(table.waiters(&K), 0);
        let sg = ready(&mut s, &ws, "s");
        assert!(table.is_locked(&K));
        assert_eq!(table.len(), 1, "b's fenced guard and s");
        drop(sg);
        assert!(!table.is_locked(&K), "only a fenced guard is left");
        drop(b);
        let st = table.stats();
        assert_eq!(st.acquisitions, 4);
        assert_eq!(st.contended, 2);
        assert_eq!(st.handoffs, 2);
        assert_eq!(st.expired, 1);
        assert_eq!(table.len(), 0);
        table.assert_consistent();
        assert!(table.is_empty());
    }

    // -----------------------------------------------------------------------
    // Wakers run outside the table's lock
    // -----------------------------------------------------------------------

    /// A waker that calls back into the table when woken (deadlocks if woken
    /// under a shard lock).
    struct Reenter {
        table: Arc<Table>,
        wakes: AtomicUsize,
    }

    impl Wake for Reenter {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            let _ = self.table.is_locked(&K);
            let _ = self.table.waiters(&K);
            drop(self.table.try_lock_shared(K));
            self.wakes.fetch_add(1, SeqCst);
        }
    }

    #[test]
    fn a_group_grant_and_a_downgrade_wake_outside_the_table_lock() {
        let (_clock, table) = arc_table();
        let wake = Arc::new(Reenter {
            table: table.clone(),
            wakes: AtomicUsize::new(0),
        });
        let waker = Waker::from(wake.clone());
        let mut x = table.try_lock(K).unwrap();
        let mut a = Box::pin(table.lock_shared(K));
        let mut b = Box::pin(table.lock_shared(K));
        assert!(poll(&mut a, &waker).is_pending());
        assert!(poll(&mut b, &waker).is_pending());
        x.downgrade().unwrap();
        assert_eq!(wake.wakes.load(SeqCst), 2);
        let ga = match poll(&mut a, &waker) {
            Poll::Ready(g) => g,
            Poll::Pending => panic!("a"),
        };
        let mut c = Box::pin(table.lock(K));
        assert!(poll(&mut c, &waker).is_pending());
        let mut d = Box::pin(table.lock_shared(K));
        assert!(poll(&mut d, &waker).is_pending());
        drop((x, ga));
        drop(b); // granted, unobserved: passes the key on to c
        assert_eq!(wake.wakes.load(SeqCst), 3);
        drop(c); // granted, unobserved: passes it on to d
        assert_eq!(wake.wakes.load(SeqCst), 4);
        drop(d);
        table.assert_consistent();
        assert!(table.is_empty());
    }
}

/// Readers and writers under every runtime, with upgrades, downgrades and
/// cancellation at random points.
#[cfg(feature = "test-util")]
mod stress {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use futures::future::{select, Either};
    use keylock::{Fairness, FencingToken, LockError, LockOptions, LockTable, Mode};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const KEYS: usize = 2;

    /// What every worker shares: the table and, per key, how many readers
    /// and writers are inside their critical sections.
    struct Rw {
        table: Arc<LockTable<usize>>,
        readers: [AtomicUsize; KEYS],
        writers: [AtomicUsize; KEYS],
        /// The highest token any holder of the key has seen.
        top: [AtomicU64; KEYS],
        max_readers: AtomicUsize,
        violations: AtomicUsize,
        sections: AtomicU64,
        upgrades: AtomicU64,
        downgrades: AtomicU64,
        conflicts: AtomicU64,
    }

    impl Rw {
        fn new() -> Arc<Self> {
            Self::with(Fairness::Strict)
        }

        fn with(fairness: Fairness) -> Arc<Self> {
            Arc::new(Self {
                table: Arc::new(LockTable::builder().fairness(fairness).build()),
                readers: Default::default(),
                writers: Default::default(),
                top: Default::default(),
                max_readers: AtomicUsize::new(0),
                violations: AtomicUsize::new(0),
                sections: AtomicU64::new(0),
                upgrades: AtomicU64::new(0),
                downgrades: AtomicU64::new(0),
                conflicts: AtomicU64::new(0),
            })
        }

        fn violation(&self, what: &str) {
            eprintln!("violation: {what}");
            self.violations.fetch_add(1, SeqCst);
        }

        /// A new token seen: an exclusive one must exceed every earlier one.
        fn token(&self, key: usize, token: FencingToken, mode: Mode) {
            let before = self.top[key].fetch_max(token.get(), SeqCst);
            if mode == Mode::Exclusive && before >= token.get() {
                self.violation("an exclusive token not above an earlier grant's");
            }
        }

        #[track_caller]
        fn check(&self, expect_sharing: bool) {
            assert_eq!(
                self.violations.load(SeqCst),
                0,
                "exclusion or token order broken"
            );
            for k in 0..KEYS {
                assert_eq!(self.readers[k].load(SeqCst), 0);
                assert_eq!(self.writers[k].load(SeqCst), 0);
                assert!(!self.table.is_locked(&k));
                assert_eq!(self.table.waiters(&k), 0);
            }
            assert!(self.sections.load(SeqCst) > 0);
            if expect_sharing {
                assert!(
                    self.max_readers.load(SeqCst) >= 2,
                    "no two readers ever held a key together"
                );
            }
            assert!(self.table.is_empty(), "len {}", self.table.len());
            self.table.assert_consistent();
            eprintln!(
                "sections {} upgrades {} downgrades {} conflicts {} max readers {}; {:?}",
                self.sections.load(SeqCst),
                self.upgrades.load(SeqCst),
                self.downgrades.load(SeqCst),
                self.conflicts.load(SeqCst),
                self.max_readers.load(SeqCst),
                self.table.stats()
            );
        }
    }

    /// A critical section: counted in `readers` or `writers` from the grant
    /// until it is dropped (declared after the guard, so dropped before it
    /// releases, also when the task is cancelled).
    struct Section<'a> {
        rw: &'a Rw,
        key: usize,
        mode: Mode,
    }

    impl<'a> Section<'a> {
        fn enter(rw: &'a Rw, key: usize, mode: Mode, token: FencingToken) -> Self {
            rw.sections.fetch_add(1, SeqCst);
            rw.token(key, token, mode);
            match mode {
                Mode::Shared => {
                    let n = rw.readers[key].fetch_add(1, SeqCst) + 1;
                    rw.max_readers.fetch_max(n, SeqCst);
                    if rw.writers[key].load(SeqCst) != 0 {
                        rw.violation("a reader beside a writer");
                    }
                }
                Mode::Exclusive => {
                    if rw.writers[key].fetch_add(1, SeqCst) != 0 {
                        rw.violation("two writers");
                    }
                    if rw.readers[key].load(SeqCst) != 0 {
                        rw.violation("a writer beside a reader");
                    }
                }
            }
            Self { rw, key, mode }
        }

        /// The upgrade was observed: from the only reader to the writer.
        fn upgraded(&mut self, token: FencingToken) {
            assert_eq!(self.mode, Mode::Shared);
            let rw = self.rw;
            rw.token(self.key, token, Mode::Exclusive);
            if rw.writers[self.key].fetch_add(1, SeqCst) != 0 {
                rw.violation("an upgrade beside a writer");
            }
            if rw.readers[self.key].fetch_sub(1, SeqCst) != 1 {
                rw.violation("an upgrade beside another reader");
            }
            self.mode = Mode::Exclusive;
        }

        /// About to downgrade: from the writer to a reader (before the
        /// downgrade admits other readers).
        fn downgrading(&mut self) {
            assert_eq!(self.mode, Mode::Exclusive);
            let rw = self.rw;
            rw.readers[self.key].fetch_add(1, SeqCst);
            if rw.writers[self.key].fetch_sub(1, SeqCst) != 1 {
                rw.violation("writer count corrupted");
            }
            self.mode = Mode::Shared;
        }
    }

    impl Drop for Section<'_> {
        fn drop(&mut self) {
            let count = match self.mode {
                Mode::Shared => &self.rw.readers[self.key],
                Mode::Exclusive => &self.rw.writers[self.key],
            };
            if count.fetch_sub(1, SeqCst) == 0 {
                self.rw.violation("section count underflow");
            }
        }
    }

    /// Yields once to whichever executor polls it.
    struct YieldNow(bool);

    impl Future for YieldNow {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.0 {
                Poll::Ready(())
            } else {
                self.0 = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }

    async fn yield_now() {
        YieldNow(false).await
    }

    /// Ready after `n` polls: a cancellation source that needs no timer.
    async fn after_polls(n: u32) {
        for _ in 0..n {
            yield_now().await;
        }
    }

    /// Runs `fut` unless it is still pending after `n` polls of the
    /// canceller (then drops it wherever it is).
    async fn cancel_after<F: Future>(n: Option<u32>, fut: F) -> Option<F::Output> {
        match n {
            None => Some(fut.await),
            Some(n) => match select(std::pin::pin!(fut), std::pin::pin!(after_polls(n))).await {
                Either::Left((out, _)) => Some(out),
                Either::Right(((), _)) => None,
            },
        }
    }

    /// One operation on a key: take it (in a random mode, by a random entry
    /// point), hold it across a few yields, maybe upgrade or downgrade.
    async fn op(rw: &Rw, rng: &mut StdRng) {
        let key = rng.gen_range(0..KEYS);
        let table = &*rw.table;
        match rng.gen_range(0..6) {
            // Shared, then perhaps an upgrade.
            0..=2 => {
                let mut g = match rng.gen_range(0..4) {
                    0 => table.lock_shared(key).await,
                    1 => table
                        .lock_with(key, LockOptions::new().shared())
                        .await
                        .unwrap(),
                    2 => match table.try_lock_shared(key) {
                        Ok(g) => g,
                        Err(_) => return,
                    },
                    _ => {
                        // Owned, then back to a borrowed section below.
                        // The guard is declared before the section: dropped
                        // after it, also when the task is cancelled.
                        let mut g = rw.table.clone().lock_shared_owned(key).await;
                        let mut s = Section::enter(rw, key, Mode::Shared, g.token());
                        hold(rng).await;
                        if rng.gen_bool(0.3) {
                            upgrade(rw, &mut std::pin::pin!(g.upgrade()), &mut s, rng).await;
                            rw.token(key, g.token(), Mode::Shared);
                            hold(rng).await;
                        }
                        drop(s);
                        drop(g);
                        return;
                    }
                };
                let mut s = Section::enter(rw, key, Mode::Shared, g.token());
                hold(rng).await;
                if rng.gen_bool(0.4) {
                    upgrade(rw, &mut std::pin::pin!(g.upgrade()), &mut s, rng).await;
                    // Whatever happened, the guard carries its current token.
                    rw.token(key, g.token(), Mode::Shared);
                    hold(rng).await;
                }
                drop(s);
                drop(g);
            }
            // Exclusive, then perhaps a downgrade.
            _ => {
                let mut g = match rng.gen_range(0..3) {
                    0 => table.lock(key).await,
                    1 => table
                        .lock_with(key, LockOptions::new().mode(Mode::Exclusive))
                        .await
                        .unwrap(),
                    _ => match table.try_lock(key) {
                        Ok(g) => g,
                        Err(_) => return,
                    },
                };
                let mut s = Section::enter(rw, key, Mode::Exclusive, g.token());
                hold(rng).await;
                if rng.gen_bool(0.4) {
                    s.downgrading();
                    g.downgrade().expect("no leases: a downgrade cannot fail");
                    rw.downgrades.fetch_add(1, SeqCst);
                    hold(rng).await;
                }
                drop(s);
                drop(g);
            }
        }
    }

    /// Awaits an upgrade (perhaps cancelled after a few polls) and accounts
    /// for its outcome in the section.
    async fn upgrade<F>(rw: &Rw, up: &mut F, s: &mut Section<'_>, rng: &mut StdRng)
    where
        F: Future<Output = Result<FencingToken, LockError>> + Unpin,
    {
        let budget = if rng.gen_bool(0.3) {
            Some(rng.gen_range(0..4))
        } else {
            None
        };
        match cancel_after(budget, up).await {
            Some(Ok(t)) => {
                s.upgraded(t);
                rw.upgrades.fetch_add(1, SeqCst);
            }
            Some(Err(LockError::UpgradeConflict { .. })) => {
                rw.conflicts.fetch_add(1, SeqCst);
            }
            Some(Err(e)) => rw.violation(&format!("unexpected upgrade error {e}")),
            None => {}
        }
    }

    async fn hold(rng: &mut StdRng) {
        for _ in 0..rng.gen_range(0..3) {
            yield_now().await;
        }
    }

    /// A worker of any runtime: `iters` operations, each perhaps cancelled
    /// after a few polls.
    async fn worker(rw: Arc<Rw>, seed: u64, iters: usize) {
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..iters {
            let budget = if rng.gen_bool(0.25) {
                Some(rng.gen_range(0..6))
            } else {
                None
            };
            let mut op_rng = StdRng::seed_from_u64(rng.gen());
            cancel_after(budget, op(&rw, &mut op_rng)).await;
        }
    }

    const TASKS: u64 = 16;
    const ITERS: usize = 1000;

    #[test]
    fn tokio_multi_thread_readers_writers_with_cancellation() {
        tokio_stress(Fairness::Strict);
    }

    #[test]
    fn tokio_multi_thread_readers_writers_with_cancellation_eventual_fairness() {
        tokio_stress(Fairness::Eventual);
    }

    fn tokio_stress(fairness: Fairness) {
        let rw = Rw::with(fairness);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for t in 0..TASKS {
                let rw2 = rw.clone();
                tasks.push(tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(1000 + t);
                    for i in 0..ITERS {
                        let mut op_rng = StdRng::seed_from_u64(rng.gen());
                        if i % 3 == 0 {
                            // Cancelled by a tiny timeout, wherever it is.
                            let d = Duration::from_micros(rng.gen_range(1..50));
                            let _ = tokio::time::timeout(d, op(&rw2, &mut op_rng)).await;
                        } else {
                            let budget = rng.gen_bool(0.25).then(|| rng.gen_range(0..6));
                            cancel_after(budget, op(&rw2, &mut op_rng)).await;
                        }
                    }
                }));
            }
            // Tasks aborted at random points, while others keep going.
            let mut aborted = Vec::new();
            for t in 0..8u64 {
                let rw2 = rw.clone();
                let h = tokio::spawn(worker(rw2, 5000 + t, 1_000_000));
                for _ in 0..(t * 7 + 3) {
                    tokio::task::yield_now().await;
                }
                h.abort();
                aborted.push(h);
            }
            for t in tasks {
                t.await.unwrap();
            }
            for h in aborted {
                let _ = h.await;
            }
        });
        drop(rt);
        rw.check(true);
    }

    #[test]
    fn async_std_readers_writers_with_cancellation() {
        let rw = Rw::new();
        async_std::task::block_on(async {
            let tasks: Vec<_> = (0..TASKS)
                .map(|t| async_std::task::spawn(worker(rw.clone(), 2000 + t, ITERS)))
                .collect();
            for t in tasks {
                t.await;
            }
        });
        rw.check(true);
    }

    #[test]
    fn smol_readers_writers_with_cancellation() {
        let rw = Rw::new();
        let ex = smol::Executor::new();
        std::thread::scope(|s| {
            let (stop, done) = smol::channel::unbounded::<()>();
            // Two threads run the executor.
            for _ in 0..2 {
                let (ex, done) = (&ex, done.clone());
                s.spawn(move || smol::block_on(ex.run(done.recv())));
            }
            smol::block_on(ex.run(async {
                let tasks: Vec<_> = (0..TASKS)
                    .map(|t| ex.spawn(worker(rw.clone(), 3000 + t, ITERS)))
                    .collect();
                for t in tasks {
                    t.await;
                }
            }));
            drop(stop);
        });
        rw.check(true);
    }

    #[test]
    fn threads_readers_writers_with_blocking_locks() {
        thread_stress(Fairness::Strict);
    }

    #[test]
    fn threads_readers_writers_with_blocking_locks_eventual_fairness() {
        thread_stress(Fairness::Eventual);
    }

    fn thread_stress(fairness: Fairness) {
        let rw = Rw::with(fairness);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let rw = &*rw;
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(4000 + t);
                    let table = &*rw.table;
                    for _ in 0..1000 {
                        let key = rng.gen_range(0..KEYS);
                        if rng.gen_bool(0.5) {
                            let mut g = if rng.gen_bool(0.5) {
                                table.blocking_lock_shared(key)
                            } else {
                                let opts = LockOptions::new().shared();
                                match rng.gen_bool(0.2) {
                                    // A tiny timeout: sometimes gives up.
                                    true => match table.blocking_lock_with(
                                        key,
                                        opts.timeout(Duration::from_micros(20)),
                                    ) {
                                        Ok(g) => g,
                                        Err(LockError::Timeout { .. }) => continue,
                                        Err(e) => panic!("{e}"),
                                    },
                                    false => table.blocking_lock_with(key, opts).unwrap(),
                                }
                            };
                            let mut sec = Section::enter(rw, key, Mode::Shared, g.token());
                            spin(&mut rng);
                            if rng.gen_bool(0.3) {
                                match futures::executor::block_on(g.upgrade()) {
                                    Ok(tk) => {
                                        sec.upgraded(tk);
                                        rw.upgrades.fetch_add(1, SeqCst);
                                    }
                                    Err(LockError::UpgradeConflict { .. }) => {
                                        rw.conflicts.fetch_add(1, SeqCst);
                                    }
                                    Err(e) => panic!("{e}"),
                                }
                                spin(&mut rng);
                            }
                            drop(sec);
                            drop(g);
                        } else {
                            let mut g = if rng.gen_bool(0.5) {
                                table.blocking_lock(key)
                            } else {
                                table.blocking_lock_with(key, LockOptions::new()).unwrap()
                            };
                            let mut sec = Section::enter(rw, key, Mode::Exclusive, g.token());
                            spin(&mut rng);
                            if rng.gen_bool(0.3) {
                                sec.downgrading();
                                g.downgrade().unwrap();
                                rw.downgrades.fetch_add(1, SeqCst);
                                spin(&mut rng);
                            }
                            drop(sec);
                            drop(g);
                        }
                    }
                });
            }
        });
        rw.check(false);
    }

    fn spin(rng: &mut StdRng) {
        for _ in 0..rng.gen_range(0..200) {
            std::hint::spin_loop();
        }
        if rng.gen_bool(0.1) {
            std::thread::yield_now();
        }
    }

    /// Found by the fuzz harness's model of modes: each failed before its fix.
    mod fuzz_regressions {
        use std::future::Future;
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::pin::pin;
        use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
        use std::time::Duration;

        use keylock::{LockError, LockOptions, LockTable, ManualClock, Mode};

        fn cx() -> Context<'static> {
            Context::from_waker(Waker::noop())
        }

        /// `revoke` forces out every holder found when it is called; a shared
        /// holder whose upgrade was waiting must not come out of it exclusive.
        #[test]
        fn revoke_does_not_let_a_pending_upgrade_escape() {
            let table = LockTable::new();
            let b = table.try_lock_shared(1).unwrap(); // first in the holder set
            let mut a = table.try_lock_shared(1).unwrap();
            let ta = a.token();
            let mut up = pin!(a.upgrade()); // waits for b
            assert!(up.as_mut().poll(&mut cx()).is_pending());
            let revoked = table.revoke(&1);
            assert_eq!(revoked, Some(ta), "both grants revoked, the highest named");
            assert!(!table.is_locked(&1), "nobody holds the key after revoke");
            assert_eq!(
                up.as_mut().poll(&mut cx()),
                Poll::Ready(Err(LockError::Expired {
                    token: ta,
                    key: None
                }))
            );
            drop(b);
        }

        /// A settle that finds both shared holders lapsed must not grant the
        /// upgrade of one of them (under a new token with the lapsed deadline).
        #[test]
        fn lapse_of_both_readers_does_not_grant_the_upgrade() {
            let clock = ManualClock::new();
            let table = LockTable::<u8>::builder().clock(clock.clone()).build();
            let lease = LockOptions::new().shared().lease(Duration::from_millis(1));
            let b = table.try_lock_with(1, lease).unwrap();
            let mut a = table.try_lock_with(1, lease).unwrap();
            let ta = a.token();
            let mut up = pin!(a.upgrade());
            assert!(up.as_mut().poll(&mut cx()).is_pending());
            clock.advance(Duration::from_millis(2));
            assert!(b.check().is_err()); // settles both lapses
            assert_eq!(
                up.as_mut().poll(&mut cx()),
                Poll::Ready(Err(LockError::Expired {
                    token: ta,
                    key: None
                }))
            );
            assert_eq!(table.stats().expired, 2);
        }

        unsafe fn clone(p: *const ()) -> RawWaker {
            RawWaker::new(p, &BOMB)
        }
        unsafe fn wake(_: *const ()) {
            panic!("waker wake");
        }
        unsafe fn noop(_: *const ()) {}
        static BOMB: RawWakerVTable = RawWakerVTable::new(clone, wake, wake, noop);

        /// A downgrade whose wake of an admitted reader panics has still made the
        /// grant shared: the guard must say so.
        #[test]
        fn downgrade_whose_wake_panics_leaves_the_guard_shared() {
            let table = LockTable::new();
            let mut w = table.try_lock(1).unwrap();
            // SAFETY: the vtable ignores the data pointer.
            let bomb = unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &BOMB)) };
            let mut reader = pin!(table.lock_shared(1));
            assert!(reader
                .as_mut()
                .poll(&mut Context::from_waker(&bomb))
                .is_pending());
            let r = catch_unwind(AssertUnwindSafe(|| w.downgrade()));
            assert!(r.is_err(), "the reader's wake panicked");
            assert!(
                table.try_lock_shared(1).is_ok(),
                "the table holds it shared"
            );
            assert_eq!(w.mode(), Mode::Shared);
        }
    }
}
