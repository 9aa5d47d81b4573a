//! The router's built-in selection policies: `cache-aware` (the default),
//! `dynamo-default-cost-fn`, `kvcr`, `round-robin` and `random`.
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

/// Expected time to first token, weighing what a miss costs the cache.
pub const CACHE_AWARE: &str = "cache-aware";
/// Dynamo's default cost function.
pub const DEFAULT_COST_FN: &str = "dynamo-default-cost-fn";
/// The default cost, crediting a peer's KV copy; commits bookings to copies.
pub const KVCR: &str = "kvcr";
/// The next candidate in turn.
pub const ROUND_ROBIN: &str = "round-robin";
/// A seeded, uniformly random candidate.
pub const RANDOM: &str = "random";

/// Registers the five selection-policy types.
pub fn register(registry: &mut HintRegistry) -> Result<(), RegistryError> {
    registry.register_selection_policy(CACHE_AWARE, Arc::new(construct_cache_aware))?;
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

fn two() -> f64 {
    2.0
}

fn tenth() -> f64 {
    0.1
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheAwareParameters {
    /// A block this request must prefill, against one already queued for
    /// prefill on the worker.
    #[serde(default = "two")]
    miss_weight: f64,
    /// A block the worker's open bookings hold (decode load), against one
    /// queued for prefill.
    #[serde(default = "tenth")]
    decode_weight: f64,
    /// Costs this close to the lowest (in queued blocks) are ties.
    #[serde(default = "one")]
    tie_blocks: f64,
}

/// `cache-aware`: the worker where the request's first token comes soonest,
/// counting what a miss costs the fleet's caches.
///
/// A request's time to first token on a worker is about the prefill queued
/// there ahead of it plus its own uncached blocks. Taken alone, that estimate
/// sends a request away from the worker holding its prefix as soon as that
/// worker is a little busier, and the prefix is then computed and cached on
/// both, which crowds out what each cache held: a block this request must
/// prefill therefore weighs `miss_weight` times a queued one. Decode load
/// weighs little: it slows a worker's next prefill only slightly. Costs within
/// `tie_blocks` of the lowest are ties, broken by fewer open requests, then in
/// turn, so that new prefixes spread over idle workers instead of piling onto
/// the first.
struct CacheAware {
    miss_weight: f64,
    decode_weight: f64,
    tie_blocks: f64,
    /// The next turn among tied candidates.
    turn: AtomicUsize,
}

fn construct_cache_aware(parameters: &Parameters) -> Result<SelectionPolicyConstructor, HintError> {
    let p: CacheAwareParameters = parameters.deserialize()?;
    for (name, value) in [
        ("miss_weight", p.miss_weight),
        ("decode_weight", p.decode_weight),
        ("tie_blocks", p.tie_blocks),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(HintError::bad_parameters(format!(
                "`{name}` must be a number ≥ 0, found {value}"
            )));
        }
    }
    Ok(SelectionPolicyConstructor::shared(CacheAware {
        miss_weight: p.miss_weight,
        decode_weight: p.decode_weight,
        tie_blocks: p.tie_blocks,
        turn: AtomicUsize::new(0),
    }))
}

impl CacheAware {
    fn cost(&self, candidate: &Candidate<'_>, request_blocks: usize) -> f64 {
        let uncached = request_blocks.saturating_sub(candidate.cached_blocks()) as f64;
        candidate.prefill_blocks() as f64
            + self.miss_weight * uncached
            + self.decode_weight * candidate.active_blocks() as f64
    }
}

impl SelectionPolicy for CacheAware {
    fn select(
        &self,
        request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Result<Selection, HintError> {
        let request_blocks = request.request_blocks();
        let lowest = candidates
            .iter()
            .map(|c| self.cost(&c, request_blocks))
            .fold(f64::INFINITY, f64::min);
        if !lowest.is_finite() {
            return Err(no_candidates());
        }
        // The ties, and among them the fewest open requests; two passes over
        // the candidates rather than a list, so a booking allocates nothing.
        let tie = |c: &Candidate<'_>| self.cost(c, request_blocks) <= lowest + self.tie_blocks;
        let fewest = candidates
            .iter()
            .filter(|c| tie(c))
            .map(|c| c.active_requests())
            .min()
            .unwrap_or(0);
        let equal = |c: &Candidate<'_>| tie(c) && c.active_requests() == fewest;
        let tied = candidates.iter().filter(|c| equal(c)).count();
        // Taken in turn, so that new prefixes (and prompts that share nothing)
        // alternate over idle workers instead of piling onto the first.
        let turn = if tied > 1 {
            self.turn.fetch_add(1, Ordering::Relaxed) % tied
        } else {
            0
        };
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| equal(c))
            .nth(turn)
            .map(|(i, _)| Selection::worker(i))
            .ok_or_else(no_candidates)
    }
}

/// Random draws from a splitmix64 generator: one atomic add per draw, seeded
/// with `router.seed`, so a replay with the same seed draws the same.
struct Draws {
    state: AtomicU64,
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl Draws {
    fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed ^ GOLDEN_GAMMA),
        }
    }

    fn next(&self) -> u64 {
        let mut z = self
            .state
            .fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
            .wrapping_add(GOLDEN_GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&self, n: u64) -> u64 {
        self.next() % n.max(1)
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
    draws: Draws,
}

fn construct_random(parameters: &Parameters) -> Result<SelectionPolicyConstructor, HintError> {
    parameters.deserialize::<NoParameters>()?;
    Ok(SelectionPolicyConstructor::shared(Random {
        draws: Draws::new(parameters.router().seed),
    }))
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
        Ok(Selection::worker(
            self.draws.below(candidates.len() as u64) as usize
        ))
    }
}

#[cfg(test)]
mod tests;
