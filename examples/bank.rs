//! A bank on keylock, beside the same bank written the way users write it
//! today.
//!
//! ```text
//! cargo run --release --features tokio --example bank  # 5 repetitions of each shape
//! cargo run --release --example bank -- --quick        # 1 repetition, small
//! ```
//!
//! Tellers transfer money between random accounts (two accounts locked
//! exclusively; a self-transfer asks one account twice, which a
//! transaction merges) while auditors lock every account shared and check
//! the total. keylock runs each operation as a [`keylock::Transaction`]:
//! `lock_all` de-duplicates, orders and takes the accounts all or nothing,
//! and `commit` releases them. A fourth bank locks each transfer's accounts
//! one by one in the order asked, unsorted: transfers then deadlock with
//! each other and with audits, the table answers each cycle at once with
//! `TransactionError::Deadlock`, and the victim aborts and retries (the
//! report counts the retries). The other bank is a
//! `DashMap<u64, Arc<tokio::sync::RwLock<()>>>` whose callers sort and
//! de-duplicate their keys by hand and lock them one by one. Both run on the
//! same two-worker tokio runtime, interleaved, repetition by repetition
//! (`examples/compare.rs` runs the same comparison). Two more rows bound
//! what any keyed table could reach here: the same bank with one tokio, or
//! async-lock, reader-writer lock per account made up front (no map at
//! all), and the harness with no locks. The run fails if money
//! is created or lost, if an audit sees a transfer half done, or if
//! anything hangs.

#[path = "compare/bank.rs"]
mod bank;
#[allow(dead_code)]
#[path = "compare/verdict.rs"]
mod verdict;

use std::time::Duration;

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    println!("# The bank\n");
    for accounts in bank::shapes() {
        let shape = bank::shape(accounts, quick);
        println!("## {accounts} accounts\n");
        let report = bank::compare(
            &rt,
            shape,
            if quick { 1 } else { 5 },
            Duration::from_secs(120),
        );
        println!("{report}");
    }
}
