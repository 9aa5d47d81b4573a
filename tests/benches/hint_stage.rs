//! The hint stage: 1, 4 and 8 policies producing fetch hints of 16, 256 and
//! 4,096 hashes each, envelope included — and the host's own overhead in it
//! (the stage's time minus the time spent inside the policies' `build_hints`),
//! as p50 and p99 for the DESIGN §8 target case: 4 policies, 256 hashes.
//!
//! `cargo bench -p kvhint-e2e --bench hint_stage`

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use kvhint::catalog::{self, PluginFile};
use kvhint::hints::{HintLimits, HintPolicyInstance, HintStage};
use kvhint::loader::{Loader, LoaderOptions};
use kvhint::registry::Registry;
use kvhint_e2e::bench::{artifacts, is_bench, quantile};
use kvhint_e2e::private_dir;
use kvhint_plugin_api::testing::{TestBooking, TestPeer, TestWorker};
use std::hint::black_box;
use std::time::Instant;

fn booking(hashes: u64) -> TestBooking {
    TestBooking {
        request_id: "req-1".into(),
        worker: TestWorker::capable(1),
        cached_blocks: 0,
        prompt_tokens: hashes as usize * 16,
        block_size: 16,
        selection_policy: "dynamo-default-cost-fn".into(),
        block_hashes: (0..hashes).collect(),
        peers: vec![TestPeer {
            worker: TestWorker::capable(7),
            block_hashes: (1 << 40..(1 << 40) + hashes).collect(),
        }],
        ..Default::default()
    }
}

/// `n` instances of the loaded `kv_fetch`, each sending one fetch.
fn stage(registry: &Registry, n: usize) -> HintStage {
    let policies = (0..n)
        .map(|i| {
            let constructed = registry
                .construct("kv_fetch", &serde_json::json!({}))
                .expect("constructs");
            HintPolicyInstance::new(format!("kv_fetch_{i}"), constructed)
        })
        .collect();
    HintStage::new(policies, HintLimits::default())
}

fn benches(c: &mut Criterion) {
    let dir = private_dir();
    let loader = Loader::new(&LoaderOptions {
        cache_dir: dir.path().join("cache"),
        max_libraries: 16,
    })
    .expect("cache");
    let copy = dir.path().join("libkv_fetch.so");
    std::fs::copy(artifacts().join("libkv_fetch.so"), &copy).expect("copy");
    let mut registry = Registry::new();
    for report in catalog::load_into(
        &loader,
        &mut registry,
        &[PluginFile {
            path: copy,
            sha256: None,
        }],
    ) {
        report.result.expect("loads");
    }

    let mut group = c.benchmark_group("hint_stage");
    for policies in [1, 4, 8] {
        let stage = stage(&registry, policies);
        for hashes in [16u64, 256, 4096] {
            let booking = booking(hashes);
            booking.with_raw_context(|context| {
                assert_eq!(stage.run(context).action_types.len(), policies);
                group.throughput(Throughput::Elements(policies as u64));
                group.bench_with_input(
                    BenchmarkId::new(format!("{policies}_policies"), format!("{hashes}_hashes")),
                    context,
                    |b, context| b.iter(|| black_box(stage.run(black_box(context)))),
                );
            });
        }
    }
    group.finish();

    // Host overhead: per run, the stage's wall time minus the time its
    // policies spent in build_hints (which the stage itself measures).
    let stage = stage(&registry, 4);
    let runs = if is_bench() { 200_000 } else { 200 };
    booking(256).with_raw_context(|context| {
        let inside = || -> u64 {
            stage
                .policies()
                .iter()
                .map(|p| p.stats.latency.sum_nanos())
                .sum()
        };
        let mut overhead = Vec::with_capacity(runs);
        let mut total = Vec::with_capacity(runs);
        for _ in 0..runs {
            let before = inside();
            let started = Instant::now();
            black_box(stage.run(black_box(context)));
            let elapsed = started.elapsed().as_nanos() as f64;
            total.push(elapsed);
            overhead.push(elapsed - (inside() - before) as f64);
        }
        println!(
            "hint stage, 4 policies × 256 hashes, {runs} runs: total p50 {:.0} ns p99 {:.0} ns; host overhead p50 {:.0} ns p99 {:.0} ns (target p99 ≤ 2000 ns)",
            quantile(&mut total, 0.5),
            quantile(&mut total, 0.99),
            quantile(&mut overhead, 0.5),
            quantile(&mut overhead, 0.99),
        );
    });
}

criterion_group!(hint_stage, benches);

fn main() {
    hint_stage();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
