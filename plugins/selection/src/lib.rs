//! The router's four built-in selection policies: `dynamo-default-cost-fn`,
//! `kvcr`, `round-robin` and `random`.
//!
//! They live in a plugin crate, not in the router, so that built-ins and
//! plugins take one path (rule R12): the router links this crate in and hands
//! its root module to the same registry code a loaded `.so` goes through, and
//! the policies cross the same stable-ABI adapters. The crate is `rlib` and
//! `cdylib`, so the same code also builds as `libkvhint_selection.so`.
//!
//! A selection policy sees the candidate list the router prepared (cached
//! prefix, load and — for `kvcr` — the best copy a hint-capable peer could
//! supply) and names one. It never sees hints: selection happens first and
//! hints cannot change it (rule R1). The candidates arrive ordered by worker
//! id, then dp rank, and every policy here breaks exact ties by taking the
//! first, so replays are reproducible.

use kvhint_plugin_api::prelude::*;
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Dynamo's default cost function.
pub const DEFAULT_COST_FN: &str = "dynamo-default-cost-fn";
/// The default cost, crediting a peer's KV copy; commits bookings to copies.
pub const KVCR: &str = "kvcr";
/// The next candidate in turn.
pub const ROUND_ROBIN: &str = "round-robin";
/// A seeded, uniformly random candidate.
pub const RANDOM: &str = "random";

/// Registers the four selection-policy types.
pub fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
    registry.register_selection_policy(DEFAULT_COST_FN, Arc::new(construct_default_cost_fn))?;
    registry.register_selection_policy(KVCR, Arc::new(construct_kvcr))?;
    registry.register_selection_policy(ROUND_ROBIN, Arc::new(construct_round_robin))?;
    registry.register_selection_policy(RANDOM, Arc::new(construct_random))?;
    Ok(())
}

export_plugin!(register);

fn no_candidates() -> HintError {
    HintError::new("no candidates to select from")
}

/// Dynamo's default cost: new prefill work (weighted) plus decode load, lower
/// is better. `overlap` is the prefix the worker would not have to prefill.
fn cost(candidate: &Candidate<'_>, request_blocks: usize, overlap: f64, weight: f64) -> f64 {
    let new_prefill = (request_blocks as f64 - overlap).max(0.0);
    let prefill = candidate.prefill_blocks() as f64 + new_prefill;
    let decode = candidate.active_blocks() as f64 + request_blocks as f64;
    weight * prefill + decode
}

/// The index of the lowest cost; the first (lowest key) wins exact ties.
fn argmin(candidates: &Candidates<'_>, cost: impl Fn(&Candidate<'_>) -> f64) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, candidate) in candidates.iter().enumerate() {
        let c = cost(&candidate);
        if best.is_none_or(|(_, b)| c < b) {
            best = Some((i, c));
        }
    }
    best.map(|(i, _)| i)
}

fn one() -> f64 {
    1.0
}

fn half() -> f64 {
    0.5
}

fn check_weight(weight: f64) -> Result<(), HintError> {
    if weight.is_finite() && weight >= 0.0 {
        Ok(())
    } else {
        Err(HintError::bad_parameters(format!(
            "`overlap_score_weight` must be ≥ 0, found {weight}"
        )))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CostFnParameters {
    /// Weight of prefill work against decode load (Dynamo's
    /// `overlap_score_weight`).
    #[serde(default = "one")]
    overlap_score_weight: f64,
}

/// `dynamo-default-cost-fn`: the lowest [`cost`], with the worker's own cached
/// prefix as the overlap.
struct DefaultCostFn {
    weight: f64,
}

fn construct_default_cost_fn(
    parameters: &Parameters,
) -> Result<SelectionPolicyConstructor, HintError> {
    let p: CostFnParameters = parameters.deserialize()?;
    check_weight(p.overlap_score_weight)?;
    Ok(SelectionPolicyConstructor::shared(DefaultCostFn {
        weight: p.overlap_score_weight,
    }))
}

impl SelectionPolicy for DefaultCostFn {
    fn select(
        &self,
        request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError> {
        let request_blocks = request.request_blocks();
        argmin(candidates, |c| {
            cost(c, request_blocks, c.cached_blocks() as f64, self.weight)
        })
        .map(Selection::worker)
        .ok_or_else(no_candidates)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvcrParameters {
    #[serde(default = "one")]
    overlap_score_weight: f64,
    /// How much a block a peer can supply counts against one held locally
    /// (0 = not at all, 1 = as much). Above 0, the policy commits copies.
    #[serde(default = "half")]
    shared_cache_multiplier: f64,
}

/// `kvcr`: the default cost, crediting the prefix a hint-capable peer holds
/// beyond the worker's own, times `shared_cache_multiplier`. When that credit
/// decides the booking — the winner would not have won without it — the
/// booking is committed to fetching that copy.
struct Kvcr {
    weight: f64,
    multiplier: f64,
}

fn construct_kvcr(parameters: &Parameters) -> Result<SelectionPolicyConstructor, HintError> {
    let p: KvcrParameters = parameters.deserialize()?;
    check_weight(p.overlap_score_weight)?;
    if !(0.0..=1.0).contains(&p.shared_cache_multiplier) {
        return Err(HintError::bad_parameters(format!(
            "`shared_cache_multiplier` must be between 0 and 1, found {}",
            p.shared_cache_multiplier
        )));
    }
    Ok(SelectionPolicyConstructor::shared(Kvcr {
        weight: p.overlap_score_weight,
        multiplier: p.shared_cache_multiplier,
    }))
}

impl SelectionPolicy for Kvcr {
    fn commits_kv_copies(&self) -> bool {
        self.multiplier > 0.0
    }

    fn wants_peer_copies(&self) -> bool {
        self.multiplier > 0.0
    }

    fn select(
        &self,
        request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError> {
        let request_blocks = request.request_blocks();
        let credited = |c: &Candidate<'_>| {
            let extra = c
                .peer_copy()
                .map(|copy| copy.cached_blocks().saturating_sub(c.cached_blocks()))
                .unwrap_or(0);
            c.cached_blocks() as f64 + self.multiplier * extra as f64
        };
        let index = argmin(candidates, |c| {
            cost(c, request_blocks, credited(c), self.weight)
        })
        .ok_or_else(no_candidates)?;
        let without = argmin(candidates, |c| {
            cost(c, request_blocks, c.cached_blocks() as f64, self.weight)
        });
        let has_copy = candidates
            .get(index)
            .is_some_and(|c| c.peer_copy().is_some());
        if self.multiplier > 0.0 && without != Some(index) && has_copy {
            Ok(Selection::with_kv_copy(index))
        } else {
            Ok(Selection::worker(index))
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

/// `round-robin`: the next candidate in turn.
#[derive(Default)]
struct RoundRobin {
    next: AtomicUsize,
}

fn construct_round_robin(parameters: &Parameters) -> Result<SelectionPolicyConstructor, HintError> {
    parameters.deserialize::<NoParameters>()?;
    Ok(SelectionPolicyConstructor::shared(RoundRobin::default()))
}

impl SelectionPolicy for RoundRobin {
    fn kv_aware(&self) -> bool {
        false
    }

    fn select(
        &self,
        _request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError> {
        if candidates.is_empty() {
            return Err(no_candidates());
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(Selection::worker(turn % candidates.len()))
    }
}

/// `random`: a uniformly random candidate, from a generator seeded with
/// `router.seed`, so a replay with the same seed books the same workers.
struct Random {
    state: AtomicU64,
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl Random {
    fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed ^ GOLDEN_GAMMA),
        }
    }
}

fn construct_random(parameters: &Parameters) -> Result<SelectionPolicyConstructor, HintError> {
    parameters.deserialize::<NoParameters>()?;
    Ok(SelectionPolicyConstructor::shared(Random::new(
        parameters.router().seed,
    )))
}

impl SelectionPolicy for Random {
    fn kv_aware(&self) -> bool {
        false
    }

    fn select(
        &self,
        _request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError> {
        if candidates.is_empty() {
            return Err(no_candidates());
        }
        // splitmix64: one atomic add per draw, good enough spread for load.
        let mut z = self
            .state
            .fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
            .wrapping_add(GOLDEN_GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Ok(Selection::worker((z % candidates.len() as u64) as usize))
    }
}

#[cfg(test)]
mod tests;
