//! Transactions' labels, for the status view: which name goes with which
//! transaction id, for as long as the transaction lives.
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

use crate::loom::Mutex;

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

    /// The label of each id that has one, among `ids` (in any order).
    pub(crate) fn of(&self, ids: impl Iterator<Item = u64>) -> HashMap<u64, &'static str> {
        let state = self.state.lock();
        if state.names.is_empty() {
            return HashMap::new();
        }
        ids.filter_map(|id| {
            let (label, alive) = state.names.get(&id)?;
            (alive.strong_count() > 0).then_some((id, *label))
        })
        .collect()
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
}
