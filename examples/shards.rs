//! How a table's shard count bears on contended multi-key work: the measure
//! behind the default (sixteen shards per core).
//!
//! ```text
//! cargo run --release --example shards            # 2 workers, 64 and 100,000 keys
//! cargo run --release --example shards -- 1       # the same on 1 worker
//! ```
//!
//! 32 tasks on a multi-thread tokio runtime each make 20,000 transfers: two
//! random keys, sorted, locked one after the other with plain guards, then
//! both released (the bank's tellers, without a ledger). The same run is
//! repeated on tables of 4 to 128 shards, interleaved, 9 times; the report
//! gives the median time per transfer for each shard count, and how often
//! a shard's lock was found taken is what the difference is made of: a
//! shard's lock is held for a whole lock or release, so two workers that
//! meet on one shard wait for each other even on different keys.

use std::sync::Arc;
use std::time::Instant;

use keylock::LockTable;

const TASKS: u64 = 32;
const TRANSFERS: u64 = 20_000;
const REPS: usize = 9;
const SHARDS: [usize; 6] = [4, 8, 16, 32, 64, 128];

/// Time per transfer, in ns, of one run on a table of `shards` shards.
fn run(rt: &tokio::runtime::Runtime, shards: usize, keys: u64) -> f64 {
    let table = Arc::new(LockTable::<u64>::builder().shards(shards).build());
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|id| {
            let table = Arc::clone(&table);
            rt.spawn(async move {
                // xorshift64, seeded per task: the same keys for every table.
                let mut x = (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for _ in 0..TRANSFERS {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let mut pair = [x % keys, (x >> 32) % keys];
                    pair.sort_unstable();
                    let first = table.lock(pair[0]).await;
                    let second = if pair[1] != pair[0] {
                        Some(table.lock(pair[1]).await)
                    } else {
                        None
                    };
                    drop((second, first));
                }
            })
        })
        .collect();
    rt.block_on(async {
        for task in tasks {
            task.await.expect("a transfer task panicked");
        }
    });
    let elapsed = start.elapsed();
    assert!(table.is_empty(), "every key released");
    elapsed.as_nanos() as f64 / (TASKS * TRANSFERS) as f64
}

fn main() {
    let workers: usize = std::env::args()
        .nth(1)
        .map_or(2, |n| n.parse().expect("usage: shards [WORKERS]"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .build()
        .expect("tokio runtime");
    println!(
        "{TASKS} tasks on {workers} worker(s), {TRANSFERS} transfers each (two random keys, \
         sorted, locked in turn); median ns per transfer of {REPS} interleaved runs \
         (fastest-slowest)\n"
    );
    println!(
        "| keys | {} |",
        SHARDS.map(|s| format!("{s} shards")).join(" | ")
    );
    println!("|---:|{}", "---:|".repeat(SHARDS.len()));
    for keys in [64, 100_000] {
        let mut times = vec![Vec::with_capacity(REPS); SHARDS.len()];
        for _ in 0..REPS {
            for (i, &shards) in SHARDS.iter().enumerate() {
                times[i].push(run(&rt, shards, keys));
            }
        }
        let cells: Vec<String> = times
            .iter_mut()
            .map(|t| {
                t.sort_by(f64::total_cmp);
                format!("{:.0} ({:.0}-{:.0})", t[REPS / 2], t[0], t[REPS - 1])
            })
            .collect();
        println!("| {keys} | {} |", cells.join(" | "));
    }
}
