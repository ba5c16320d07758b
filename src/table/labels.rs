//! Labels, for the status view and timeouts: which name goes with which
//! transaction id, for as long as the transaction lives, and which with a
//! labeled plain lock (`LockOptions::label`).
//!
//! A plain lock's label is interned: each distinct label gets an owner
//! word from [`LABEL_OWNER`] up, which its grants and waiters carry as a
//! transaction's carry its id (no transaction has one so high), and which
//! the table keeps for its life. Only a labeled lock looks it up.
//!
//! Only labeled transactions are registered. Each holds an [`Alive`] ticket;
//! the registry keeps a weak reference to it, so an entry outlives its
//! transaction only until the registry next grows past twice the entries it
//! had after its last sweep, when dead entries are dropped (no work in any
//! transaction's end, and the registry stays within a constant factor of the
//! live labeled transactions).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};

use crate::support::loom::Mutex;
use crate::support::token::{HOLD_OWNER, LABEL_OWNER};

/// A labeled transaction's ticket: its label is shown while this lives.
pub(crate) type Alive = Arc<()>;

/// The labels of a table's live labeled transactions, by transaction id.
pub(crate) struct Labels {
    state: Mutex<State>,
}

struct State {
    names: HashMap<u64, (&'static str, Weak<()>), foldhash::fast::RandomState>,
    /// Sweep dead entries once `names` grows to this size.
    sweep_at: usize,
    /// Plain locks' labels: the owner word of each is `LABEL_OWNER` plus
    /// its index here.
    plain: Vec<&'static str>,
    plain_ids: HashMap<&'static str, u64, foldhash::fast::RandomState>,
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Labels").finish_non_exhaustive()
    }
}

impl Labels {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                names: HashMap::default(),
                sweep_at: 16,
                plain: Vec::new(),
                plain_ids: HashMap::default(),
            }),
        }
    }

    /// Registers transaction `id`'s `label`; shown while the ticket lives.
    pub(crate) fn register(&self, id: u64, label: &'static str) -> Alive {
        let alive = Arc::new(());
        let mut state = self.state.lock();
        if state.names.len() >= state.sweep_at {
            state.names.retain(|_, (_, alive)| alive.strong_count() > 0);
            state.sweep_at = (state.names.len() * 2).max(16);
        }
        state.names.insert(id, (label, Arc::downgrade(&alive)));
        alive
    }

    /// The owner word of plain locks labeled `label` (interned).
    #[cold]
    #[inline(never)]
    pub(crate) fn plain(&self, label: &'static str) -> u64 {
        let mut state = self.state.lock();
        if let Some(&id) = state.plain_ids.get(label) {
            return id;
        }
        let id = LABEL_OWNER + state.plain.len() as u64;
        debug_assert!(id < HOLD_OWNER);
        state.plain.push(label);
        state.plain_ids.insert(label, id);
        id
    }

    /// The label of each id that has one, among `ids` (in any order).
    pub(crate) fn of(&self, ids: impl Iterator<Item = u64>) -> HashMap<u64, &'static str> {
        let state = self.state.lock();
        if state.names.is_empty() && state.plain.is_empty() {
            return HashMap::new();
        }
        ids.filter_map(|id| {
            if (LABEL_OWNER..HOLD_OWNER).contains(&id) {
                let label = state.plain.get(usize::try_from(id - LABEL_OWNER).ok()?)?;
                return Some((id, *label));
            }
            let (label, alive) = state.names.get(&id)?;
            (alive.strong_count() > 0).then_some((id, *label))
        })
        .collect()
    }

    /// The label of `id`, if it has one.
    pub(crate) fn one(&self, id: u64) -> Option<&'static str> {
        if id == 0 {
            return None;
        }
        self.of(std::iter::once(id)).get(&id).copied()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Labels;

    #[test]
    fn dead_labels_are_swept_as_the_registry_grows() {
        let labels = Labels::new();
        let mut live = Vec::new();
        for id in 1..=1000u64 {
            let alive = labels.register(id, "t");
            if id % 100 == 0 {
                live.push((id, alive));
            }
        }
        let size = labels.state.lock().names.len();
        assert!(
            size <= 2 * 16 + 2 * live.len(),
            "{size} entries for {} live",
            live.len()
        );
        let shown = labels.of(1..=1000);
        assert_eq!(shown.len(), live.len(), "only the live ones are shown");
        assert!(live.iter().all(|(id, _)| shown.get(id) == Some(&"t")));
    }

    #[test]
    fn plain_labels_are_interned_and_named() {
        let labels = Labels::new();
        let flush = labels.plain("flush");
        let scan = labels.plain("scan");
        assert_ne!(flush, scan);
        assert_eq!(labels.plain("flush"), flush, "one id per label");
        assert!(!crate::support::token::is_transaction(flush));
        assert_eq!(labels.one(flush), Some("flush"));
        assert_eq!(labels.one(scan), Some("scan"));
        assert_eq!(labels.one(0), None);
    }
}
