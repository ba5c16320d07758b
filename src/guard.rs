//! Guards: proof of holding a key, released on drop.

use std::fmt;
use std::sync::Arc;

use crate::key_slot::KeyPtr;
use crate::queue::Grant;
use crate::table::{DefaultHashBuilder, LockTable};
use crate::token::FencingToken;

/// What a guard holds: where its key lives and the token of its grant.
#[derive(Debug)]
pub(crate) struct Held<K> {
    pub(crate) hash: u64,
    pub(crate) grant: Grant<K>,
}

impl<K> Held<K> {
    #[inline]
    fn key(&self) -> &K {
        // SAFETY: the entry stays in the table while this grant's guard
        // exists (the guard's release is what removes it).
        unsafe { self.grant.key.get() }
    }

    #[inline]
    fn key_ptr(&self) -> KeyPtr<K> {
        self.grant.key
    }
}

/// Holds a key of a [`LockTable`]; dropping it releases the key to the oldest
/// waiter.
///
/// ```
/// let table = keylock::LockTable::new();
/// let guard = table.try_lock("k").unwrap();
/// assert_eq!(*guard.key(), "k");
/// guard.release();
/// assert!(!table.is_locked("k"));
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct Guard<'a, K, S = DefaultHashBuilder> {
    table: &'a LockTable<K, S>,
    held: Held<K>,
}

impl<'a, K, S> Guard<'a, K, S> {
    pub(crate) fn new(table: &'a LockTable<K, S>, held: Held<K>) -> Self {
        Self { table, held }
    }

    /// The key this guard holds.
    #[inline]
    pub fn key(&self) -> &K {
        self.held.key()
    }

    /// The fencing token of this grant; see [`FencingToken`].
    #[inline]
    pub fn token(&self) -> FencingToken {
        self.held.grant.token
    }

    /// Releases the key now; the same as dropping the guard.
    #[inline]
    pub fn release(self) {
        drop(self);
    }
}

impl<K, S> Drop for Guard<'_, K, S> {
    #[inline]
    fn drop(&mut self) {
        self.table
            .release(self.held.hash, self.held.key_ptr(), self.held.grant.token);
    }
}

impl<K: fmt::Debug, S> fmt::Debug for Guard<'_, K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("key", self.key())
            .field("token", &self.token())
            .finish()
    }
}

/// Like [`Guard`], but keeps its table alive through an [`Arc`], so it is
/// `'static` and can move into spawned tasks.
///
/// ```
/// use std::sync::Arc;
/// let table = Arc::new(keylock::LockTable::new());
/// let guard = table.clone().try_lock_owned(1).unwrap();
/// std::thread::spawn(move || drop(guard)).join().unwrap();
/// assert!(table.is_empty());
/// ```
#[must_use = "the key is released as soon as the guard is dropped"]
#[clippy::has_significant_drop]
pub struct OwnedGuard<K, S = DefaultHashBuilder> {
    table: Arc<LockTable<K, S>>,
    held: Held<K>,
}

impl<K, S> OwnedGuard<K, S> {
    pub(crate) fn new(table: Arc<LockTable<K, S>>, held: Held<K>) -> Self {
        Self { table, held }
    }

    /// The key this guard holds.
    #[inline]
    pub fn key(&self) -> &K {
        self.held.key()
    }

    /// The fencing token of this grant; see [`FencingToken`].
    #[inline]
    pub fn token(&self) -> FencingToken {
        self.held.grant.token
    }

    /// The table this guard belongs to.
    #[inline]
    pub fn table(&self) -> &Arc<LockTable<K, S>> {
        &self.table
    }

    /// Releases the key now; the same as dropping the guard.
    #[inline]
    pub fn release(self) {
        drop(self);
    }
}

impl<K, S> Drop for OwnedGuard<K, S> {
    #[inline]
    fn drop(&mut self) {
        self.table
            .release(self.held.hash, self.held.key_ptr(), self.held.grant.token);
    }
}

impl<K: fmt::Debug, S> fmt::Debug for OwnedGuard<K, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedGuard")
            .field("key", self.key())
            .field("token", &self.token())
            .finish()
    }
}
