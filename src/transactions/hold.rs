//! Holds: grants that outlive the transaction that took them.
//!
//! A transaction can detach one of its keys as a hold
//! ([`Transaction::detach`](crate::Transaction::detach)): the grant keeps its
//! key, mode, token and lease, but belongs to no transaction (its owner word
//! in the table becomes the hold mark, so it is never part of a deadlock
//! cycle) and to no guard. The table keeps the grant in its hold registry,
//! by token, in place of the guard; [`LockTable::release_hold`] releases it
//! by key and token later, from anywhere. A hold with a lease lapses like
//! any grant: the next waiter takes the key, and the hold's record (like a
//! lapsed guard) is cleared by the next operation on the registry, which
//! first sweeps out the records of holds that lost their key.
//!
//! No user code runs under the registry's mutex: keys are compared and
//! cloned outside it, and the table is entered after it is released.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Instant;

use crate::error::LockError;
use crate::support::loom::Mutex;
use crate::support::mode::Mode;
use crate::support::token::FencingToken;
use crate::table::guard::Held;
use crate::table::LockTable;

/// A grant detached from its transaction, as
/// [`Transaction::detach`](crate::Transaction::detach) returns it: what to
/// release it by later ([`LockTable::release_hold`]), and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hold<K> {
    /// The key held.
    pub key: K,
    /// The grant's fencing token: the proof of ownership a release gives.
    pub token: FencingToken,
    /// The mode it holds the key in.
    pub mode: Mode,
    /// When its lease ends, if it has one.
    pub lease_deadline: Option<Instant>,
}

/// The grants the table holds for their holds, by token.
pub(crate) struct Holds<K> {
    records: Mutex<HashMap<FencingToken, Held<K>, foldhash::fast::RandomState>>,
}

impl<K> Holds<K> {
    pub(crate) fn new() -> Self {
        Self {
            records: Mutex::new(HashMap::default()),
        }
    }
}

impl<K> fmt::Debug for Holds<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holds").finish_non_exhaustive()
    }
}

impl<K: Eq + Hash, S: BuildHasher> LockTable<K, S> {
    /// Takes over `held`, a grant whose guard is gone, as a hold.
    /// The caller sweeps first ([`sweep_holds`](Self::sweep_holds)), while
    /// it still has a guard: a sweep's release that panics (a handoff's
    /// wake) then unwinds through the guard, which lets the key go,
    /// rather than through a grant with neither a guard nor a record.
    pub(crate) fn adopt_hold(&self, held: Held<K>) {
        let (hash, key, token) = (held.hash(), held.key_ptr(), held.token());
        self.with_shard(hash, |state, _| state.make_hold(hash, key, token));
        let old = self.holds().records.lock().insert(token, held);
        debug_assert!(old.is_none(), "tokens are unique");
    }

    /// Releases the hold of `key` with `token`: `Ok` if it held the key
    /// and now lets it go (the next waiter takes it). Otherwise nothing of
    /// anyone else's is freed, and the error says why:
    /// [`LockError::Expired`] if the hold lost the key meanwhile (its lease
    /// lapsed, or it was revoked) and its record was still kept;
    /// [`LockError::NoSuchHold`] if `token` names no hold of `key` (never
    /// one, another key's, released already, or lost and swept away).
    ///
    /// ```
    /// # futures::executor::block_on(async {
    /// use keylock::{LockError, LockTable, Mode};
    /// let table = LockTable::new();
    /// let mut txn = table.transaction();
    /// txn.lock("order-9", Mode::Exclusive).await?;
    /// let hold = txn.detach(&"order-9")?;
    /// txn.commit()?; // the hold outlives the transaction
    /// assert!(table.is_locked("order-9"));
    /// table.release_hold("order-9", hold.token)?;
    /// assert!(!table.is_locked("order-9"));
    /// // A second release frees nothing, and says so.
    /// assert_eq!(
    ///     table.release_hold("order-9", hold.token),
    ///     Err(LockError::NoSuchHold { token: hold.token, key: None })
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn release_hold<Q>(&self, key: &Q, token: FencingToken) -> Result<(), LockError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + fmt::Debug + ?Sized,
    {
        // Formatted after the records' lock is released: `Debug` is user
        // code.
        let name = || {
            self.names_keys()
                .then(|| format!("{key:?}").into_boxed_str())
        };
        // The records' lock is released at the end of this statement,
        // before `name` may run.
        let removed = self.holds().records.lock().remove(&token);
        let Some(held) = removed else {
            return Err(LockError::NoSuchHold { token, key: name() });
        };
        // The comparison is user code: if it panics, the record goes back
        // first (the hold is not lost with it).
        let same = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the record keeps the grant's entry (its holder, or its
            // fenced count once lost) until it is released below.
            unsafe { held.key_ptr().get() }.borrow() == key
        }));
        let same = match same {
            Ok(same) => same,
            Err(payload) => {
                self.holds().records.lock().insert(token, held);
                resume_unwind(payload)
            }
        };
        if !same {
            // A token of another key: put it back, free nothing.
            self.holds().records.lock().insert(token, held);
            return Err(LockError::NoSuchHold { token, key: name() });
        }
        if self.release_if_live(held.hash(), held.key_ptr(), token) {
            Ok(())
        } else {
            // Lost meanwhile: its record goes (as a lapsed guard's drop).
            held.release(self);
            Err(LockError::Expired { token, key: name() })
        }
    }

    /// Drops the records of holds that lost their key (lapsed or revoked),
    /// as their guards' drops would.
    pub(crate) fn sweep_holds(&self) {
        let lost: Vec<Held<K>> = {
            let mut records = self.holds().records.lock();
            if records.is_empty() {
                return;
            }
            // Read only (no settle, so no wake or drop under the mutex);
            // each record keeps its entry, so its key cell is current.
            let lost: Vec<FencingToken> = records
                .values()
                .filter(|h| !self.grant_is_live(h.hash(), h.key_ptr(), h.token()))
                .map(Held::token)
                .collect();
            lost.iter().filter_map(|t| records.remove(t)).collect()
        };
        // Released as their guards would be: a lapsed grant still in place
        // lets go, a displaced one drops its fenced claim. Each is released
        // even if an earlier one panics (a handoff's wake, a key's drop);
        // the first panic goes on.
        let mut panic = None;
        for held in lost {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| held.release(self))) {
                panic.get_or_insert(payload);
            }
        }
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }
}
