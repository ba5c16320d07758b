//! Fencing tokens: unique across the table, strictly increasing per key
//! (also across an idle key's entry being removed), above the table's token
//! floor, and fencing a store across a restart of the table.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use keylock::{FencingToken, LockError, LockOptions, LockTable};

/// A store that fences its writers: it remembers the largest token it
/// accepted and refuses any write carrying a token not greater than that.
#[derive(Debug, Default)]
struct Store {
    largest: u64,
    value: Option<&'static str>,
}

impl Store {
    fn write(&mut self, token: FencingToken, value: &'static str) -> Result<(), u64> {
        if token.get() <= self.largest {
            return Err(self.largest);
        }
        self.largest = token.get();
        self.value = Some(value);
        Ok(())
    }
}

/// A hasher that puts `u64` key `k` in shard `k % shards` (the table picks
/// the shard from bits 32 and up of the hash).
#[derive(Clone, Copy, Debug, Default)]
struct ShardOf;

struct ShardHasher(u64);

impl BuildHasher for ShardOf {
    type Hasher = ShardHasher;
    fn build_hasher(&self) -> ShardHasher {
        ShardHasher(0)
    }
}

impl Hasher for ShardHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, k: u64) {
        self.0 = (k << 32) | (k & 0xffff);
    }
}

fn message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[test]
fn a_restarted_table_with_the_stores_largest_token_as_floor_fences_the_old_holder() {
    let mut store = Store::default();
    let old = Arc::new(LockTable::new());
    // Earlier grants of "row" wrote to the store (which keeps that one row:
    // tokens of different keys are not ordered).
    for _ in 0..3 {
        let g = old.try_lock("row").unwrap();
        store.write(g.token(), "earlier").unwrap();
    }
    // The old holder of "row" writes once, then stalls (a paused process).
    let stale = old.clone().try_lock_owned("row").unwrap();
    store.write(stale.token(), "old holder").unwrap();
    drop(old); // the table goes away; the stalled holder still exists

    // Without a floor, a restarted table starts over and the store refuses
    // every one of its writes: the store cannot tell it from a late writer.
    let naive = LockTable::new();
    let g = naive.try_lock("row").unwrap();
    assert!(
        store.write(g.token(), "naive").is_err(),
        "token {} of a table without a floor passed the store's {}",
        g.token(),
        store.largest
    );
    drop(g);

    // With the floor read back from the store, the new holder's write is
    // accepted, and the old holder's late write is refused.
    let table = LockTable::builder().token_floor(store.largest).build();
    assert_eq!(table.token_floor(), store.largest);
    let fresh = table.try_lock("row").unwrap();
    assert!(fresh.token().get() > store.largest);
    assert_eq!(store.write(fresh.token(), "new holder"), Ok(()));
    assert_eq!(
        store.write(stale.token(), "late write"),
        Err(fresh.token().get()),
        "the old holder's late write was accepted"
    );
    assert_eq!(store.value, Some("new holder"));
    drop(stale);
}

#[test]
fn an_epoch_floor_fences_grants_of_the_old_table_that_never_wrote() {
    // The floor is an epoch bumped at every start, shifted above every
    // token one run mints: no token of the old table, written or not,
    // reaches the new one's.
    let mut store = Store::default();
    let epoch = 7u64;
    let old = Arc::new(LockTable::builder().token_floor(epoch << 32).build());
    let mut stale = Vec::new();
    for key in 0..100u32 {
        stale.push(old.clone().try_lock_owned(key).unwrap());
    }
    drop(old);
    let table = LockTable::builder().token_floor((epoch + 1) << 32).build();
    let fresh = table.try_lock(99u32).unwrap();
    store.write(fresh.token(), "new holder").unwrap();
    for g in &stale {
        assert!(g.token() < fresh.token());
        assert!(store.write(g.token(), "late write").is_err());
    }
    assert_eq!(store.value, Some("new holder"));
}

#[test]
fn tokens_are_unique_across_many_keys_and_shards() {
    for shards in [1, 2, 8, 64] {
        let table = LockTable::builder()
            .shards(shards)
            .token_floor(1000)
            .build();
        let mut seen = HashSet::new();
        let mut held = Vec::new();
        for round in 0..4u64 {
            for key in 0..2_000u64 {
                let g = table.try_lock(key).unwrap();
                let t = g.token().get();
                assert!(t > 1000, "token {t} not above the floor");
                assert!(
                    seen.insert(t),
                    "token {t} handed out twice ({shards} shards)"
                );
                // Keep some held, so that entries both stay and go.
                if (key + round) % 3 == 0 {
                    held.push(g);
                }
            }
            held.clear();
        }
        assert_eq!(seen.len(), 4 * 2_000);
        assert!(table.is_empty());
    }
}

#[test]
fn tokens_strictly_increase_per_key_across_entry_removal() {
    let table = LockTable::builder().shards(4).hasher(ShardOf).build();
    let mut last: HashMap<u64, FencingToken> = HashMap::new();
    for round in 0..50u64 {
        for key in 0..12u64 {
            // Other keys of the same shard mint in between.
            if (key + round) % 5 == 0 {
                continue;
            }
            let g = table.try_lock(key).unwrap();
            if let Some(&before) = last.get(&key) {
                assert!(
                    g.token() > before,
                    "key {key}: {} after {before}",
                    g.token()
                );
            }
            last.insert(key, g.token());
            drop(g);
            // The idle key's entry is gone.
            assert_eq!(table.len(), 0);
        }
    }
}

#[test]
fn tokens_strictly_increase_across_handoff_lapse_and_revoke() {
    let table = LockTable::builder()
        .shards(2)
        .token_floor(u64::MAX >> 1)
        .build();
    let mut last = table.try_lock("k").unwrap().token();
    for i in 0..20 {
        let g = table
            .try_lock_with(
                "k",
                LockOptions::new().lease(std::time::Duration::from_secs(60)),
            )
            .unwrap();
        assert!(g.token() > last);
        last = g.token();
        if i % 2 == 0 {
            assert_eq!(table.revoke("k"), Some(g.token()));
            assert!(g.is_expired());
        }
        drop(g);
    }
}

#[test]
fn the_last_tokens_below_u64_max_are_minted_then_minting_panics_changing_nothing() {
    // One shard: the floor leaves exactly two tokens.
    let table = LockTable::builder()
        .shards(1)
        .token_floor(u64::MAX - 2)
        .build();
    assert_eq!(table.try_lock(1u64).unwrap().token().get(), u64::MAX - 1);
    let last = table.try_lock(2u64).unwrap();
    assert_eq!(last.token().get(), u64::MAX);
    let exhausted = catch_unwind(AssertUnwindSafe(|| table.try_lock(3u64).map(drop)));
    let msg = message(&*exhausted.expect_err("a token after u64::MAX"));
    assert!(msg.contains("exhausted"), "{msg}");
    // Nothing changed: the holder still holds, nothing else was added.
    assert_eq!(last.check(), Ok(last.token()));
    assert_eq!(table.len(), 1);
    assert!(!table.is_locked(&3));
    #[cfg(feature = "test-util")]
    table.assert_consistent();
    drop(last);
    assert!(table.is_empty());
}

#[test]
fn each_shard_runs_out_on_its_own_near_u64_max() {
    // Two shards above u64::MAX - 3: shard 0 mints u64::MAX - 2 and
    // u64::MAX, shard 1 mints u64::MAX - 1; then each is out.
    let table = LockTable::builder()
        .shards(2)
        .hasher(ShardOf)
        .token_floor(u64::MAX - 3)
        .build();
    let even = table.try_lock(0u64).unwrap().token().get();
    let odd = table.try_lock(1u64).unwrap().token().get();
    assert_eq!((even, odd), (u64::MAX - 2, u64::MAX - 1));
    assert_eq!(table.try_lock(2u64).unwrap().token().get(), u64::MAX);
    for key in [1u64, 4] {
        let exhausted = catch_unwind(AssertUnwindSafe(|| table.try_lock(key).map(drop)));
        assert!(exhausted.is_err(), "key {key}: a token past u64::MAX");
    }
    assert!(table.is_empty());
    #[cfg(feature = "test-util")]
    table.assert_consistent();
}

#[test]
fn exhaustion_panics_before_a_revoke_or_lock_changes_anything() {
    let table = LockTable::builder()
        .shards(1)
        .token_floor(u64::MAX - 1)
        .build();
    let holder = table.try_lock(1u64).unwrap();
    assert_eq!(holder.token().get(), u64::MAX);
    // Another key would need a token: none is left.
    assert!(catch_unwind(AssertUnwindSafe(|| table.try_lock(2u64).map(drop))).is_err());
    // A revoke with a waiter queued would hand the key on with a new token:
    // it panics first, and the holder keeps the key.
    let mut waiter = Box::pin(table.lock(1u64));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(waiter.as_mut().poll(&mut cx).is_pending());
    let revoked = catch_unwind(AssertUnwindSafe(|| table.revoke(&1)));
    assert!(
        revoked.is_err(),
        "a revoke handed the key on without a token"
    );
    assert_eq!(holder.check(), Ok(holder.token()));
    assert_eq!(table.waiters(&1), 1);
    drop(waiter);
    // With nobody to hand it to, a revoke needs no token.
    assert_eq!(table.revoke(&1), Some(holder.token()));
    assert!(holder.is_expired());
    drop(holder);
    assert!(table.is_empty());
    #[cfg(feature = "test-util")]
    table.assert_consistent();
}

#[test]
#[should_panic(expected = "token_floor")]
fn builder_rejects_a_floor_that_leaves_a_shard_no_token() {
    let _t: LockTable<u8> = LockTable::builder()
        .shards(8)
        .token_floor(u64::MAX - 7)
        .build();
}

#[test]
fn builder_accepts_the_highest_floor_that_leaves_each_shard_a_token() {
    let table: LockTable<u64, ShardOf> = LockTable::builder()
        .shards(8)
        .hasher(ShardOf)
        .token_floor(u64::MAX - 8)
        .build();
    let mut tokens: Vec<u64> = (0..8u64)
        .map(|k| table.try_lock(k).unwrap().token().get())
        .collect();
    tokens.sort_unstable();
    assert_eq!(tokens, ((u64::MAX - 7)..=u64::MAX).collect::<Vec<_>>());
}

#[test]
fn a_timeout_names_the_holders_grant_of_this_table() {
    let table = LockTable::builder().token_floor(500).build();
    let held = table.try_lock("k").unwrap();
    let err = futures::executor::block_on(
        table.lock_with("k", LockOptions::new().timeout(std::time::Duration::ZERO)),
    )
    .unwrap_err();
    assert!(matches!(err, LockError::Timeout { holder: Some(t), .. } if t == held.token()));
    let text = err.to_string();
    assert!(
        text.contains(&format!("grant {} of this table", held.token())),
        "{text}"
    );
}

#[test]
fn exhaustion_at_a_release_with_waiters_panics_before_anything_changes() {
    for fairness in [keylock::Fairness::Strict, keylock::Fairness::Eventual] {
        let table = LockTable::builder()
            .shards(1)
            .fairness(fairness)
            .token_floor(u64::MAX - 1)
            .build();
        let holder = table.try_lock(1u64).unwrap();
        let mut waiter = Box::pin(table.lock(1u64));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(waiter.as_mut().poll(&mut cx).is_pending());
        // Handing the key to the waiter needs a token: none is left.
        let released = catch_unwind(AssertUnwindSafe(|| drop(holder)));
        assert!(released.is_err(), "{fairness:?}: a handoff without a token");
        // Nothing changed: the grant still holds the key, the waiter waits.
        assert!(table.is_locked(&1), "{fairness:?}");
        assert_eq!(table.waiters(&1), 1, "{fairness:?}");
        #[cfg(feature = "test-util")]
        table.assert_consistent();
        drop(waiter);
        assert_eq!(table.waiters(&1), 0);
        #[cfg(feature = "test-util")]
        table.assert_consistent();
    }
}
