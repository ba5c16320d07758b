//! Criterion version of `examples/compare.rs`: the same workloads (the same
//! code, included from `examples/compare/`), one benchmark group per
//! workload, keylock and its anchors side by side in each group.
//!
//! ```text
//! cargo bench --bench compare                      # all groups, a few minutes
//! cargo bench --bench compare -- w3_handoff        # one group
//! cargo bench --bench compare -- w6_counter        # one group
//! ```
//!
//! Criterion reports the time of one operation: one lock+unlock (W1-W4, W6)
//! or one cancelled wait (W5). Workloads that split their operations over 64
//! tasks round the count up; the time is scaled back to the count asked for.
//! W6's share of handoffs is printed by `examples/compare.rs`, not here.

// Shared with the example, which uses every item; here some go unused.
#[allow(dead_code)]
#[path = "../examples/compare/impls.rs"]
mod impls;
#[allow(dead_code)]
#[path = "../examples/compare/workloads.rs"]
mod workloads;

use std::sync::Arc;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use impls::KeyedLock;
use tokio::runtime::Runtime;
use workloads::Workload;

/// Length of each task's precomputed Zipf sequence (cycled as needed).
const ZIPF_PER_TASK: usize = 4096;

fn bench_one<I: KeyedLock>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    workload: Workload,
    zipf: &Arc<Vec<Vec<u64>>>,
) {
    if (workload.needs_async() && !I::ASYNC)
        || (!I::EXCLUSIVE && !matches!(workload, Workload::W1 | Workload::W2))
    {
        return;
    }
    let id = I::NAME.replace("::", "_");
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let out = workloads::run::<I>(rt, workload, iters, zipf)
                .expect("checked: the implementation runs this workload");
            out.elapsed.mul_f64(iters as f64 / out.ops as f64)
        })
    });
}

fn compare(c: &mut Criterion) {
    let rt = workloads::runtime();
    let zipf = workloads::zipf_sequences(ZIPF_PER_TASK);
    for workload in Workload::ALL {
        let mut group = c.benchmark_group(workload.group());
        group
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .sample_size(20);
        bench_one::<impls::Keylock>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::KeylockLease>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::KeylockTimeout>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::KeylockShared>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::DashMapLeak>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::DashMapCleanup>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::Lockable>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::TokioMutex>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::AsyncLockMutex>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::FuturesMutex>(&mut group, &rt, workload, &zipf);
        bench_one::<impls::ParkingLot>(&mut group, &rt, workload, &zipf);
        group.finish();
    }
}

criterion_group! {
    name = benches;
    // Plots take longer to draw than some groups take to measure.
    config = Criterion::default().without_plots();
    targets = compare
}
criterion_main!(benches);
