//! The support layer: the vocabulary and primitives every other layer
//! uses, and that use nothing of the crate above them: the shard spin lock
//! and the loom shim, the key map and its slots, modes, fencing tokens,
//! fairness, statistics, the lease options and the recycled box of
//! the transactions' waits (and, under the `jitter`
//! feature, the stress tests' random preemption points).

pub(crate) mod fairness;
#[cfg(all(feature = "jitter", not(loom)))]
pub(crate) mod jitter;
pub(crate) mod key_map;
pub(crate) mod key_slot;
pub(crate) mod lease;
pub(crate) mod loom;
pub(crate) mod mode;
pub(crate) mod recycle;
pub(crate) mod shard_lock;
pub(crate) mod spares;
pub(crate) mod stats;
pub(crate) mod token;
