//! Dynamic vs static: the same `kv_fetch` policy linked into the host and
//! loaded from `libkv_fetch.so`, measured in one run; and the dispatch cost of
//! a policy that does nothing (`noop`, loaded).
//!
//! Both `kv_fetch` variants go through the same registry and the same
//! stable-ABI trait objects (rule R12), so the comparison isolates how the code
//! got into the process: linked into the binary, or dlopened from a file.
//!
//! `cargo bench -p kvhint-e2e --bench dispatch` prints criterion's estimates and
//! then an interleaved A/B measurement: the ratio of the medians (target:
//! loaded / linked ≤ 1.05).

use criterion::{criterion_group, Criterion};
use kvhint::hints::{HintLimits, HintPolicyInstance, HintStage};
use kvhint::registry::Registry;
use kvhint_e2e::bench::{artifacts, interleaved, is_bench, median};
use kvhint_e2e::registry_of;
use kvhint_plugin_api::testing::{TestBooking, TestPeer, TestWorker};
use std::hint::black_box;

/// A booking where the booked worker holds 8 blocks and a peer holds 64: one
/// best-effort kv.fetch of 64 root-aligned hashes.
fn booking() -> TestBooking {
    TestBooking {
        request_id: "req-1".into(),
        worker: TestWorker::capable(1),
        cached_blocks: 8,
        prompt_tokens: 64 * 16,
        block_size: 16,
        selection_policy: "dynamo-default-cost-fn".into(),
        block_hashes: (0..64).collect(),
        peers: vec![TestPeer {
            worker: TestWorker::capable(7),
            block_hashes: (7000..7064).collect(),
        }],
        ..Default::default()
    }
}

fn stage(registry: &Registry, type_name: &str) -> HintStage {
    let constructed = registry
        .construct(type_name, &serde_json::json!({}))
        .expect("constructs");
    HintStage::new(
        vec![HintPolicyInstance::new(type_name, constructed)],
        HintLimits::default(),
    )
}

fn benches(c: &mut Criterion) {
    let builtin = Registry::with_builtins().expect("built-ins register");
    let (plugins, _loader, _dir) = registry_of(&["kv_fetch", "fixture_misbehaving"], artifacts());
    let linked = stage(&builtin, "kv_fetch");
    let dynamic = stage(&plugins, "kv_fetch");
    let noop = stage(&plugins, "noop");
    let booking = booking();

    booking.with_raw_context(|context| {
        // Same answer both ways, or the comparison means nothing.
        assert_eq!(linked.run(context).message, dynamic.run(context).message);
        let mut group = c.benchmark_group("kv_fetch");
        group.bench_function("linked", |b| b.iter(|| black_box(linked.run(black_box(context)))));
        group.bench_function("loaded", |b| b.iter(|| black_box(dynamic.run(black_box(context)))));
        group.finish();
        c.bench_function("dispatch/noop_loaded", |b| {
            b.iter(|| black_box(noop.run(black_box(context))))
        });

        let (rounds, batch) = if is_bench() { (41, 20_000) } else { (3, 100) };
        let (mut a, mut b) = interleaved(
            rounds,
            batch,
            || {
                black_box(linked.run(black_box(context)));
            },
            || {
                black_box(dynamic.run(black_box(context)));
            },
        );
        let (linked_ns, loaded_ns) = (median(&mut a), median(&mut b));
        println!(
            "kv_fetch per booking, interleaved A/B ({rounds} rounds × {batch}): linked median {linked_ns:.0} ns, loaded median {loaded_ns:.0} ns, ratio loaded/linked = {:.3} (target ≤ 1.05)",
            loaded_ns / linked_ns
        );
    });
}

criterion_group!(dispatch, benches);

fn main() {
    dispatch();
    Criterion::default().configure_from_args().final_summary();
}
