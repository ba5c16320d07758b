//! Measuring sticks for the cost goals of transactions: the least a
//! transaction can do, and what it then costs. Compiled only with the
//! `probes` feature, for `examples/uncontended.rs` (its `probe_*` modes)
//! and `benches/owners.rs`, and tested here;
//! not part of the API and never used by [`Transaction`](crate::Transaction).
//!
//! Each probe takes its keys as a transaction's fast path does (the
//! table's own attempt, `try_lock_on`, the grant made on the probe's terms:
//! no lease, its transaction id as owner, so that a deadlock search could
//! name it) and leaves out everything else a [`Transaction`] does: no
//! claims, no pending calls, no forgotten futures to answer for, no owned
//! form sharing the code, no detector, no held-set index, no options.
//!
//! - [`BareOne`] holds at most one key and releases it without a check: the
//!   floor of any one-key transaction.
//! - [`Bare`] holds up to two keys in place (more spill to the heap),
//!   counts a key locked again, and at the end releases each key in the
//!   visit that says whether its grant still held it (a lapsed lease): what
//!   a transaction that can hold several keys and tell a lost grant at
//!   commit cannot do without.
//!
//! Neither waits: a key that is not free at once is answered `None`. Their
//! locks return an `async move` block from a plain function, as
//! `Transaction`'s do (an `async fn` copies its arguments into locals of
//! its own as it starts).

use std::hash::{BuildHasher, Hash};

use smallvec::SmallVec;

use crate::support::mode::Mode;
use crate::support::token::TransactionId;
use crate::table::guard::Guard;
use crate::table::LockTable;
use crate::transactions::held::{AcquireKind, Acquired};
use crate::transactions::reach::GuardOps;

/// A transaction of at most one key: its id and its grant.
#[derive(Debug)]
pub struct BareOne<'t, K: Eq + Hash, S: BuildHasher> {
    table: &'t LockTable<K, S>,
    id: TransactionId,
    held: Option<Guard<'t, K, S>>,
}

impl<'t, K: Eq + Hash, S: BuildHasher> BareOne<'t, K, S> {
    /// A new probe on `table`, with a fresh transaction id.
    pub fn begin(table: &'t LockTable<K, S>) -> Self {
        Self {
            table,
            id: TransactionId::next(),
            held: None,
        }
    }

    /// Takes `key` in `mode` if it is free at once (and the probe holds
    /// nothing yet); `None` otherwise.
    #[allow(clippy::manual_async_fn)]
    pub fn lock(
        &mut self,
        key: K,
        mode: Mode,
    ) -> impl std::future::Future<Output = Option<Acquired>> + use<'_, 't, K, S> {
        async move {
            if self.held.is_some() {
                return None;
            }
            let hash = self.table.hash(&key);
            let (guard, acquired) = take_new(self.table, self.id, hash, key, mode)?;
            self.held = Some(guard);
            Some(acquired)
        }
    }

    /// Releases the key held, if any.
    pub fn commit(self) {
        drop(self.held);
    }
}

/// A transaction of several keys: its id and its grants with their
/// re-entry counts, two in place.
#[derive(Debug)]
pub struct Bare<'t, K: Eq + Hash, S: BuildHasher> {
    table: &'t LockTable<K, S>,
    id: TransactionId,
    held: SmallVec<[(Guard<'t, K, S>, usize); 2]>,
}

impl<'t, K: Eq + Hash, S: BuildHasher> Bare<'t, K, S> {
    /// A new probe on `table`, with a fresh transaction id.
    pub fn begin(table: &'t LockTable<K, S>) -> Self {
        Self {
            table,
            id: TransactionId::next(),
            held: SmallVec::new(),
        }
    }

    /// Counts `key` if the probe holds it (in any mode: a probe does not
    /// upgrade), else takes it in `mode` if it is free at once; `None`
    /// otherwise.
    #[allow(clippy::manual_async_fn)]
    pub fn lock(
        &mut self,
        key: K,
        mode: Mode,
    ) -> impl std::future::Future<Output = Option<Acquired>> + use<'_, 't, K, S> {
        async move {
            let hash = self.table.hash(&key);
            for (guard, count) in &mut self.held {
                if GuardOps::hash(guard) == hash && guard.key() == &key {
                    *count += 1;
                    return Some(Acquired {
                        token: guard.token(),
                        mode: guard.mode(),
                        count: *count,
                        kind: AcquireKind::Reentered,
                    });
                }
            }
            let (guard, acquired) = take_new(self.table, self.id, hash, key, mode)?;
            self.held.push((guard, 1));
            Some(acquired)
        }
    }

    /// Takes two keys of a probe that holds nothing yet, in key order, one
    /// key if both name it; how many were taken, or `None` if one was not
    /// free at once (what was taken stays, for `commit`).
    #[allow(clippy::manual_async_fn)]
    pub fn lock_two(
        &mut self,
        mut keys: [(K, Mode); 2],
    ) -> impl std::future::Future<Output = Option<usize>> + use<'_, 't, K, S>
    where
        K: Ord,
    {
        async move {
            debug_assert!(self.held.is_empty(), "a probe's transfer is its first call");
            if keys[1].0 < keys[0].0 {
                keys.swap(0, 1);
            }
            let [(first, first_mode), (second, second_mode)] = keys;
            let terms = self.table.owner_terms(None, self.id.get())?;
            let one = first == second;
            let hash = self.table.hash(&first);
            let guard = self
                .table
                .try_lock_on(hash, first, first_mode, terms)
                .ok()?;
            self.held.push((guard, 1));
            if one {
                return Some(1);
            }
            let hash = self.table.hash(&second);
            let guard = self
                .table
                .try_lock_on(hash, second, second_mode, terms)
                .ok()?;
            self.held.push((guard, 1));
            Some(2)
        }
    }

    /// Releases every key, each in the visit that checks its grant; whether
    /// every grant still held its key.
    pub fn commit(mut self) -> bool {
        let mut live = true;
        for (guard, _) in self.held.drain(..) {
            live &= GuardOps::release_if_live(guard).is_ok();
        }
        live
    }
}

/// A new key taken for transaction `id` if it is free at once, as a
/// transaction's fast path takes it (the table's attempt on the
/// transaction's terms), with what the lock reports.
#[inline(always)]
fn take_new<'t, K: Eq + Hash, S: BuildHasher>(
    table: &'t LockTable<K, S>,
    id: TransactionId,
    hash: u64,
    key: K,
    mode: Mode,
) -> Option<(Guard<'t, K, S>, Acquired)> {
    let terms = table.owner_terms(None, id.get())?;
    let guard = table.try_lock_on(hash, key, mode, terms).ok()?;
    let acquired = Acquired {
        token: guard.token(),
        mode,
        count: 1,
        kind: AcquireKind::New,
    };
    Some((guard, acquired))
}

#[cfg(all(test, not(loom)))]
mod tests {
    //! The probes take, count and release what a transaction would, and
    //! strand nothing when a key's `Eq` or `Drop` panics (they never wait,
    //! so no waker of theirs is ever stored).

    use std::future::Future;
    use std::hash::{Hash, Hasher};
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::{Bare, BareOne};
    use crate::{AcquireKind, LockTable, Mode};

    fn now<F: Future>(f: F) -> F::Output {
        match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("a probe never waits"),
        }
    }

    #[test]
    fn bare_one_takes_one_free_key_and_releases_it() {
        let table = LockTable::<u64>::new();
        let busy = table.try_lock(2).unwrap();
        let mut txn = BareOne::begin(&table);
        assert_eq!(now(txn.lock(2, Mode::Exclusive)), None, "busy: not taken");
        let got = now(txn.lock(1, Mode::Exclusive)).expect("free");
        assert_eq!((got.count, got.kind), (1, AcquireKind::New));
        assert!(table.is_locked(&1));
        assert_eq!(now(txn.lock(3, Mode::Exclusive)), None, "one key at most");
        assert!(!table.is_locked(&3));
        txn.commit();
        drop(busy);
        assert!(table.is_empty());
    }

    #[test]
    fn bare_counts_a_key_again_and_releases_every_key_at_commit() {
        let table = LockTable::<u64>::new();
        let mut txn = Bare::begin(&table);
        let first = now(txn.lock(1, Mode::Exclusive)).unwrap();
        let again = now(txn.lock(1, Mode::Exclusive)).unwrap();
        assert_eq!((again.count, again.kind), (2, AcquireKind::Reentered));
        assert_eq!(again.token, first.token);
        for k in 2..5 {
            now(txn.lock(k, Mode::Shared)).unwrap();
        }
        assert_eq!(table.len(), 4, "spilled past the two in place");
        assert!(txn.commit(), "every grant held its key");
        assert!(table.is_empty());
    }

    #[test]
    fn bare_transfer_takes_its_keys_in_order_merges_one_and_keeps_what_it_took() {
        let table = LockTable::<u64>::new();
        let mut txn = Bare::begin(&table);
        assert_eq!(
            now(txn.lock_two([(7, Mode::Exclusive), (7, Mode::Shared)])),
            Some(1)
        );
        assert!(txn.commit());
        let busy = table.try_lock(9).unwrap();
        let mut txn = Bare::begin(&table);
        assert_eq!(
            now(txn.lock_two([(9, Mode::Exclusive), (3, Mode::Exclusive)])),
            None
        );
        assert!(
            table.is_locked(&3),
            "the lower key was taken first and kept"
        );
        assert!(txn.commit());
        drop(busy);
        assert!(table.is_empty());
    }

    /// A key whose `Eq` or `Drop` panics on demand.
    #[derive(Debug)]
    struct Key {
        id: u64,
        eq_panics: bool,
        drop_panics: bool,
    }

    impl Key {
        fn new(id: u64) -> Self {
            Self {
                id,
                eq_panics: false,
                drop_panics: false,
            }
        }
    }

    impl PartialEq for Key {
        fn eq(&self, other: &Self) -> bool {
            assert!(!self.eq_panics && !other.eq_panics, "Key::eq");
            self.id == other.id
        }
    }

    impl Eq for Key {}

    impl Hash for Key {
        fn hash<H: Hasher>(&self, state: &mut H) {
            self.id.hash(state);
        }
    }

    impl Drop for Key {
        fn drop(&mut self) {
            if self.drop_panics && !std::thread::panicking() {
                panic!("Key::drop");
            }
        }
    }

    #[test]
    fn a_panicking_eq_or_drop_strands_no_key() {
        let table = LockTable::<Key>::new();
        let mut txn = Bare::begin(&table);
        now(txn.lock(Key::new(1), Mode::Exclusive)).unwrap();
        // The scan for a key held again panics in `Eq`: nothing is taken.
        let mut bad = Key::new(1);
        bad.eq_panics = true;
        let lock = catch_unwind(AssertUnwindSafe(|| now(txn.lock(bad, Mode::Exclusive))));
        assert!(lock.is_err());
        assert_eq!(table.len(), 1);
        // The table's copy of key 2 panics as it is dropped at commit: the
        // panic reaches the caller, and every key is released anyway.
        let mut dropper = Key::new(2);
        dropper.drop_panics = true;
        now(txn.lock(dropper, Mode::Exclusive)).unwrap();
        now(txn.lock(Key::new(3), Mode::Exclusive)).unwrap();
        let commit = catch_unwind(AssertUnwindSafe(|| txn.commit()));
        assert!(commit.is_err(), "Key::drop's panic reaches the caller");
        assert!(table.is_empty(), "nothing stranded");
        assert!(table.try_lock(Key::new(3)).is_ok());
    }
}
