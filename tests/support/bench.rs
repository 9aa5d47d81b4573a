//! Helpers shared by the benchmarks (`tests/benches/`): the artefacts built with
//! the bench's own profile, quick mode, verdicts, medians and interleaved A/B timing.

use std::path::Path;
use std::time::Instant;

/// The artefacts built with the bench binary's own profile: optimised under
/// `cargo bench`, debug under `cargo test --benches` (the quick mode CI
/// runs), so host and plugins are always compiled alike.
pub fn artifacts() -> &'static Path {
    if cfg!(debug_assertions) {
        crate::plugins::build_dir()
    } else {
        crate::plugins::release_dir()
    }
}

/// Whether the binary runs as a benchmark (`cargo bench`) rather than as a
/// quick test (`cargo test --benches`).
/// The comma-separated list in the environment variable `var` (a bench's
/// systems, loads or sizes), or `default`'s.
pub fn env_list(var: &str, default: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// The number in the environment variable `var`, or `default` when it is
/// unset or not one.
pub fn env_number<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

pub fn is_bench() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// The verdict on a target: `met` or `NOT met` for a benchmark run, and for
/// a quick run (`cargo test --benches`, debug build, a few iterations) a
/// plain statement that its figures are not measurements.
pub fn verdict(quick: bool, met: bool) -> &'static str {
    match (quick, met) {
        (true, _) => "not judged: a quick debug-build run, whose figures are not measurements; run `cargo bench` to measure",
        (false, true) => "met",
        (false, false) => "NOT met",
    }
}

/// Median of `samples` (sorted in place).
pub fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The `q` quantile (0..=1) of `samples` (sorted in place).
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    samples[i]
}

/// A/B timing in one run: `rounds` rounds, each timing `batch` calls of `a`
/// then of `b` (order alternating per round, so drift hits both alike).
/// Returns the per-call nanoseconds of each round, for `a` and `b`.
pub fn interleaved(
    rounds: usize,
    batch: usize,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> (Vec<f64>, Vec<f64>) {
    let time = |f: &mut dyn FnMut()| {
        let started = Instant::now();
        for _ in 0..batch {
            f();
        }
        started.elapsed().as_nanos() as f64 / batch as f64
    };
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            xs.push(time(&mut a));
            ys.push(time(&mut b));
        } else {
            ys.push(time(&mut b));
            xs.push(time(&mut a));
        }
    }
    (xs, ys)
}

/// [`interleaved`], reduced to the two medians (ns per call of `a`, of `b`).
pub fn interleaved_medians(
    rounds: usize,
    batch: usize,
    a: impl FnMut(),
    b: impl FnMut(),
) -> (f64, f64) {
    let (mut xs, mut ys) = interleaved(rounds, batch, a, b);
    (median(&mut xs), median(&mut ys))
}

/// Selection policy `type_name` with `parameters` from `registry`, as a snapshot
/// builds it: with the built-in default from the same registry as its fallback.
pub fn selection_stage(
    registry: &kvhint::registry::Registry,
    type_name: &str,
    parameters: &serde_json::Value,
    block_size: usize,
) -> kvhint::selection::SelectionStage {
    let settings = kvhint_plugin_api::abi::FfiRouterSettings {
        block_size: block_size as u32,
        seed: 0,
    };
    let construct = |name: &str, parameters: &serde_json::Value| {
        registry
            .construct_selection(name, parameters, &settings)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    kvhint::selection::SelectionStage::new(
        construct(type_name, parameters),
        Some(construct(
            kvhint::selection::FALLBACK_TYPE,
            &serde_json::json!({}),
        )),
        std::sync::Arc::default(),
    )
}

/// Median ns per call of two selection stages on the same request and
/// candidates, interleaved ([`interleaved_medians`]).
pub fn selection_medians(
    rounds: usize,
    batch: usize,
    a: &kvhint::selection::SelectionStage,
    b: &kvhint::selection::SelectionStage,
    request: &kvhint_plugin_api::abi::FfiSelectionRequest<'_>,
    candidates: &[kvhint_plugin_api::abi::FfiCandidate<'_>],
) -> (f64, f64) {
    use std::hint::black_box;
    interleaved_medians(
        rounds,
        batch,
        || {
            black_box(a.select(black_box(request), black_box(candidates)));
        },
        || {
            black_box(b.select(black_box(request), black_box(candidates)));
        },
    )
}
