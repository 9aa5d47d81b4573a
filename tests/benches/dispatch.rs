//! Dynamic vs static: the same `kv_fetch` hint policy linked into the host and
//! loaded from `libkv_fetch.so`, and the same `kvcr` selection policy linked in
//! (the built-in `kvhint-selection`) and loaded from `libkvhint_selection.so`,
//! each measured in one run; and the dispatch cost of a hint policy that does
//! nothing (`noop`, loaded).
//!
//! Both variants of each go through the same registry and the same stable-ABI
//! trait objects (rule R12), so the comparison isolates how the code got into
//! the process: linked into the binary, or dlopened from a file. The selection
//! side is called through the host's own [`SelectionStage`] (with its fallback
//! and counters), on 64 candidates with mixed cached prefixes, loads and peer
//! copies.
//!
//! `cargo bench -p kvhint-e2e --bench dispatch` prints criterion's estimates and
//! then an interleaved A/B measurement per policy: the ratio of the medians
//! (target: loaded / linked ≤ 1.05).

use criterion::{criterion_group, Criterion};
use kvhint::hints::{HintLimits, HintPolicyInstance, HintStage};
use kvhint::registry::Registry;
use kvhint::selection::SelectionStage;
use kvhint_e2e::bench::{
    artifacts, interleaved_medians, is_bench, selection_medians, selection_stage,
};
use kvhint_e2e::registry_of;
use kvhint_plugin_api::testing::{TestBooking, TestCandidate, TestPeer, TestPlacement, TestWorker};
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

/// 64 decode candidates of a 64-block request, hint-capable but for every
/// eighth: cached prefixes spread over 0..=56 blocks, loads that vary (workers
/// that hold more are busier), and, for the capable ones, the best copy a peer
/// holds (the longest prefix beyond the candidate's own, as the router would
/// find it). `kvcr` at 0.5 picks an idle worker on a peer's copy there, which
/// the plain cost would not: the committed-copy path.
fn placement() -> TestPlacement {
    const N: u64 = 64;
    let request_blocks = 64usize;
    // Deterministic, mixed: no candidate order in which cost is monotone.
    let cached = |i: u64| ((i * 37) % 57) as usize;
    let holders: Vec<(u64, usize)> = (0..N).map(|i| (i, cached(i))).collect();
    let candidates = (0..N)
        .map(|i| {
            let mut worker = TestWorker::capable(i);
            worker.router_hint = i % 8 != 3;
            let own = cached(i);
            let peer_copy = worker
                .router_hint
                .then(|| {
                    holders
                        .iter()
                        .filter(|&&(j, held)| j != i && j % 8 != 3 && held > own)
                        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
                        .map(|&(j, held)| (TestWorker::capable(j), held))
                })
                .flatten();
            TestCandidate {
                worker,
                cached_blocks: own,
                active_requests: (i * 7) % 5,
                active_blocks: own as u64 * 3 / 4 + (i * 13) % 9 * 4,
                prefill_blocks: (i * 11) % 7 * 8,
                peer_copy,
            }
        })
        .collect();
    TestPlacement {
        request_id: "req-1".into(),
        role: "decode".into(),
        request_blocks,
        prompt_tokens: request_blocks * 16,
        block_size: 16,
        candidates,
        ..Default::default()
    }
}

/// `kvcr` (multiplier 0.5) from `registry`, as a snapshot builds it.
fn selection(registry: &Registry) -> SelectionStage {
    selection_stage(
        registry,
        "kvcr",
        &serde_json::json!({"shared_cache_multiplier": 0.5}),
        16,
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
        let (linked_ns, loaded_ns) = interleaved_medians(
            rounds,
            batch,
            || {
                black_box(linked.run(black_box(context)));
            },
            || {
                black_box(dynamic.run(black_box(context)));
            },
        );
        println!(
            "kv_fetch per booking, interleaved A/B ({rounds} rounds × {batch}): linked median {linked_ns:.0} ns, loaded median {loaded_ns:.0} ns, ratio loaded/linked = {:.3} (target ≤ 1.05)",
            loaded_ns / linked_ns
        );
    });

    // The same A/B for a selection policy: `kvcr` linked in vs loaded from the
    // built-ins' own crate built as a .so (a registry holding only that file).
    let (selection_plugins, _selection_loader, _selection_dir) =
        registry_of(&["kvhint_selection"], artifacts());
    let linked = selection(&builtin);
    let dynamic = selection(&selection_plugins);
    assert!(linked.origin.to_string().starts_with("built-in"));
    assert!(dynamic.origin.to_string().starts_with("plugin"));
    placement().with_raw(|request, candidates| {
        let candidates = candidates.as_slice();
        // Same answer both ways, by the policy itself (no fallback), or the
        // comparison means nothing.
        let answer = linked.select(request, candidates);
        assert_eq!(answer, dynamic.select(request, candidates));
        assert_eq!(answer.fallback, None, "{answer:?}");
        assert!(answer.commit_kv_copy, "{answer:?}");
        let mut group = c.benchmark_group("kvcr_selection");
        group.bench_function("linked", |b| {
            b.iter(|| black_box(linked.select(black_box(request), black_box(candidates))))
        });
        group.bench_function("loaded", |b| {
            b.iter(|| black_box(dynamic.select(black_box(request), black_box(candidates))))
        });
        group.finish();

        let (rounds, batch) = if is_bench() { (41, 20_000) } else { (3, 100) };
        let (linked_ns, loaded_ns) =
            selection_medians(rounds, batch, &linked, &dynamic, request, candidates);
        println!(
            "kvcr selection per booking, interleaved A/B ({rounds} rounds × {batch}): linked median {linked_ns:.0} ns, loaded median {loaded_ns:.0} ns, ratio loaded/linked = {:.3} (target ≤ 1.05)",
            loaded_ns / linked_ns
        );
    });
}

criterion_group!(dispatch, benches);

fn main() {
    dispatch();
    Criterion::default().configure_from_args().final_summary();
}
