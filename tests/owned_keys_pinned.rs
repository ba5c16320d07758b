//! `OwnedTransaction::keys()` pins each listed key's entry under the set's
//! lock and clones the key after it. A key released between the list and
//! its clone (here by the first clone calling back into the transaction)
//! must still be cloned from a live cell, and its entry go with the pin.
#![cfg(all(feature = "test-util", not(loom)))]

use std::cell::RefCell;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Weak};

use keylock::{LockTable, Mode, OwnedTransaction};

/// A key that knows whether its own instance was dropped (its flag, kept
/// alive by `ALL`, so a stale copy can still be read).
#[derive(Debug)]
struct P {
    id: u32,
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

thread_local! {
    static PTXN: RefCell<Option<Weak<OwnedTransaction<P>>>> = const { RefCell::new(None) };
    static UNLOCK_ON_CLONE: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static ALL: RefCell<Vec<Arc<std::sync::atomic::AtomicBool>>> = const { RefCell::new(Vec::new()) };
}

impl P {
    fn new(id: u32) -> Self {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        ALL.with(|a| a.borrow_mut().push(dropped.clone()));
        P { id, dropped }
    }
}
impl PartialEq for P {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for P {}
impl Hash for P {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.id.hash(h);
    }
}
impl Clone for P {
    fn clone(&self) -> Self {
        assert!(
            !self.dropped.load(std::sync::atomic::Ordering::SeqCst),
            "cloned key {} from a cell whose key was dropped (entry not pinned)",
            self.id
        );
        let unlock: Vec<u32> = UNLOCK_ON_CLONE.with(|u| std::mem::take(&mut *u.borrow_mut()));
        if !unlock.is_empty() {
            let txn = PTXN
                .with(|t| t.borrow().as_ref().and_then(Weak::upgrade))
                .unwrap();
            for id in unlock.into_iter().filter(|&id| id != self.id) {
                txn.unlock(&P::new(id)).expect("held");
            }
        }
        P::new(self.id)
    }
}
impl Drop for P {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `keys()` pins every listed key's entry: a key released (its entry gone
/// but for the pin) between the list and its clone is still cloned from a
/// live cell. Fails if the pin is taken away.
#[test]
fn owned_keys_clone_survives_a_release_between_list_and_clone() {
    let table = Arc::new(LockTable::<P>::builder().shards(1).build());
    let txn = Arc::new(table.clone().transaction_owned());
    for id in [1, 2, 3] {
        txn.blocking_lock(P::new(id), Mode::Exclusive).unwrap();
    }
    PTXN.with(|t| *t.borrow_mut() = Some(Arc::downgrade(&txn)));
    // The first clone `keys()` makes releases every other key.
    UNLOCK_ON_CLONE.with(|u| *u.borrow_mut() = vec![1, 2, 3]);
    let mut listed: Vec<u32> = txn.keys().into_iter().map(|(k, _)| k.id).collect();
    listed.sort_unstable();
    assert_eq!(listed, [1, 2, 3], "listed under the lock: all three");
    assert_eq!(txn.len(), 1);
    assert_eq!(
        table.len(),
        1,
        "the released keys' entries went with their pins"
    );
    PTXN.with(|t| *t.borrow_mut() = None);
}
