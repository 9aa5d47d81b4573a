//! Selection policies: which worker a request is booked on.
//!
//! They see a candidate list the router prepared (cached prefix, load, and — for
//! `kvcr` — the best copy a hint-capable peer could supply) and return an index.
//! They never see hints: selection happens first and hints cannot change it
//! (rule R1). Every policy breaks exact ties by the lowest worker id, then dp
//! rank (the candidates arrive in that order), so replays are reproducible.
//!
//! The policies sit behind [`SelectionRegistry`], the same shape as the hint
//! registry (named types, an origin, a provider that validates parameters), so
//! they can later come from plugins too.

use crate::domain::WorkerKey;
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One worker the request could go to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub key: WorkerKey,
    /// Leading request blocks this worker already holds.
    pub cached_blocks: usize,
    pub active_blocks: u64,
    pub prefill_blocks: u64,
    /// For a worker that can receive hints: the eligible peer holding the
    /// longest prefix beyond this worker's, with that prefix length in blocks.
    pub peer_copy: Option<(WorkerKey, usize)>,
}

pub struct SelectionInput<'a> {
    /// Full blocks in the prompt.
    pub request_blocks: usize,
    pub candidates: &'a [Candidate],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selected {
    pub index: usize,
    /// The peer whose copy the booking was committed to (rule R5).
    pub committed_copy_from: Option<WorkerKey>,
}

pub trait SelectionPolicy: Send + Sync {
    /// Whether the router must fill `Candidate::peer_copy`.
    fn wants_peer_copies(&self) -> bool {
        false
    }
    /// Whether, with its parameters, this policy commits bookings to KV copies.
    fn commits_kv_copies(&self) -> bool {
        false
    }
    fn select(&self, input: &SelectionInput<'_>) -> Option<Selected>;
}

/// Dynamo's default cost: new prefill work (weighted) plus decode load, lower
/// is better. `overlap` is the prefix the worker would not have to prefill.
fn cost(candidate: &Candidate, request_blocks: usize, overlap: f64, weight: f64) -> f64 {
    let new_prefill = (request_blocks as f64 - overlap).max(0.0);
    let prefill = candidate.prefill_blocks as f64 + new_prefill;
    let decode = candidate.active_blocks as f64 + request_blocks as f64;
    weight * prefill + decode
}

/// The index of the lowest cost; the first (lowest key) wins exact ties.
fn argmin(candidates: &[Candidate], cost: impl Fn(&Candidate) -> f64) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, candidate) in candidates.iter().enumerate() {
        let c = cost(candidate);
        if best.is_none_or(|(_, b)| c < b) {
            best = Some((i, c));
        }
    }
    best.map(|(i, _)| i)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostFnParameters {
    /// Weight of prefill work against decode load (Dynamo's
    /// `overlap_score_weight`).
    #[serde(default = "one")]
    pub overlap_score_weight: f64,
}

fn one() -> f64 {
    1.0
}

pub struct DefaultCostFn {
    weight: f64,
}

impl SelectionPolicy for DefaultCostFn {
    fn select(&self, input: &SelectionInput<'_>) -> Option<Selected> {
        argmin(input.candidates, |c| {
            cost(c, input.request_blocks, c.cached_blocks as f64, self.weight)
        })
        .map(|index| Selected {
            index,
            committed_copy_from: None,
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvcrParameters {
    #[serde(default = "one")]
    pub overlap_score_weight: f64,
    /// How much a block a peer can supply counts against one held locally
    /// (0 = not at all, 1 = as much). Above 0, the policy commits copies.
    #[serde(default = "half")]
    pub shared_cache_multiplier: f64,
}

fn half() -> f64 {
    0.5
}

/// `kvcr`: the default cost, crediting the prefix a hint-capable peer holds
/// beyond the worker's own, times `shared_cache_multiplier`. When that credit
/// decides the booking — the winner would not have won without it — the booking
/// is committed to fetching that copy.
pub struct Kvcr {
    weight: f64,
    multiplier: f64,
}

impl SelectionPolicy for Kvcr {
    fn wants_peer_copies(&self) -> bool {
        self.multiplier > 0.0
    }

    fn commits_kv_copies(&self) -> bool {
        self.multiplier > 0.0
    }

    fn select(&self, input: &SelectionInput<'_>) -> Option<Selected> {
        let credited = |c: &Candidate| {
            let extra = c
                .peer_copy
                .map(|(_, blocks)| blocks.saturating_sub(c.cached_blocks))
                .unwrap_or(0);
            c.cached_blocks as f64 + self.multiplier * extra as f64
        };
        let index = argmin(input.candidates, |c| {
            cost(c, input.request_blocks, credited(c), self.weight)
        })?;
        let without = argmin(input.candidates, |c| {
            cost(c, input.request_blocks, c.cached_blocks as f64, self.weight)
        });
        let committed_copy_from = if self.multiplier > 0.0 && without != Some(index) {
            input.candidates[index].peer_copy.map(|(peer, _)| peer)
        } else {
            None
        };
        Some(Selected {
            index,
            committed_copy_from,
        })
    }
}

/// `round-robin`: the next candidate in turn.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl SelectionPolicy for RoundRobin {
    fn select(&self, input: &SelectionInput<'_>) -> Option<Selected> {
        if input.candidates.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Some(Selected {
            index: turn % input.candidates.len(),
            committed_copy_from: None,
        })
    }
}

/// `random`: a uniformly random candidate, from a seeded generator so a replay
/// with the same seed books the same workers.
pub struct Random {
    state: AtomicU64,
}

impl Random {
    pub fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed ^ 0x9E37_79B9_7F4A_7C15),
        }
    }
}

impl SelectionPolicy for Random {
    fn select(&self, input: &SelectionInput<'_>) -> Option<Selected> {
        if input.candidates.is_empty() {
            return None;
        }
        // splitmix64: one atomic add per draw, good enough spread for load.
        let mut z = self
            .state
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Some(Selected {
            index: (z % input.candidates.len() as u64) as usize,
            committed_copy_from: None,
        })
    }
}

/// What a provider needs beyond the parameters.
#[derive(Debug, Clone, Copy, Default)]
pub struct SelectionEnv {
    pub seed: u64,
}

type Provider = fn(&serde_json::Value, SelectionEnv) -> Result<Arc<dyn SelectionPolicy>, String>;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectionError {
    #[error("unknown selection policy `{name}`; known: {known}")]
    UnknownType { name: String, known: String },
    #[error("bad parameters for selection policy `{name}` ({origin}): {message}")]
    BadParameters {
        name: String,
        origin: String,
        message: String,
    },
}

struct SelectionType {
    name: &'static str,
    origin: &'static str,
    /// Whether it is a KV-aware policy (what `--router-mode kv` books with).
    kv_aware: bool,
    provider: Provider,
}

/// Every selection-policy type the router knows.
pub struct SelectionRegistry {
    types: Vec<SelectionType>,
}

fn parse<T: serde::de::DeserializeOwned>(parameters: &serde_json::Value) -> Result<T, String> {
    T::deserialize(parameters).map_err(|e| e.to_string())
}

fn check_weight(weight: f64) -> Result<(), String> {
    if weight.is_finite() && weight >= 0.0 {
        Ok(())
    } else {
        Err(format!(
            "`overlap_score_weight` must be ≥ 0, found {weight}"
        ))
    }
}

impl Default for SelectionRegistry {
    fn default() -> Self {
        Self::with_builtins()
    }
}

impl SelectionRegistry {
    pub fn with_builtins() -> Self {
        let types = vec![
            SelectionType {
                name: "dynamo-default-cost-fn",
                origin: "built-in",
                kv_aware: true,
                provider: |parameters, _| {
                    let p: CostFnParameters = parse(parameters)?;
                    check_weight(p.overlap_score_weight)?;
                    Ok(Arc::new(DefaultCostFn {
                        weight: p.overlap_score_weight,
                    }))
                },
            },
            SelectionType {
                name: "kvcr",
                origin: "built-in",
                kv_aware: true,
                provider: |parameters, _| {
                    let p: KvcrParameters = parse(parameters)?;
                    check_weight(p.overlap_score_weight)?;
                    if !(0.0..=1.0).contains(&p.shared_cache_multiplier) {
                        return Err(format!(
                            "`shared_cache_multiplier` must be between 0 and 1, found {}",
                            p.shared_cache_multiplier
                        ));
                    }
                    Ok(Arc::new(Kvcr {
                        weight: p.overlap_score_weight,
                        multiplier: p.shared_cache_multiplier,
                    }))
                },
            },
            SelectionType {
                name: "round-robin",
                origin: "built-in",
                kv_aware: false,
                provider: |parameters, _| {
                    parse::<NoParameters>(parameters)?;
                    Ok(Arc::new(RoundRobin::default()))
                },
            },
            SelectionType {
                name: "random",
                origin: "built-in",
                kv_aware: false,
                provider: |parameters, env| {
                    parse::<NoParameters>(parameters)?;
                    Ok(Arc::new(Random::new(env.seed)))
                },
            },
        ];
        Self { types }
    }

    pub fn names(&self) -> String {
        self.types
            .iter()
            .map(|t| t.name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether `name` is a KV-aware selection policy.
    pub fn is_kv_aware(&self, name: &str) -> bool {
        self.types.iter().any(|t| t.name == name && t.kv_aware)
    }

    pub fn construct(
        &self,
        name: &str,
        parameters: &serde_json::Value,
        env: SelectionEnv,
    ) -> Result<Arc<dyn SelectionPolicy>, SelectionError> {
        let selection_type = self.types.iter().find(|t| t.name == name).ok_or_else(|| {
            SelectionError::UnknownType {
                name: name.to_string(),
                known: self.names(),
            }
        })?;
        (selection_type.provider)(parameters, env).map_err(|message| {
            SelectionError::BadParameters {
                name: name.to_string(),
                origin: selection_type.origin.to_string(),
                message,
            }
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParameters {}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(id: u64) -> WorkerKey {
        WorkerKey {
            worker_id: id,
            dp_rank: 0,
        }
    }

    fn candidate(id: u64, cached: usize, active: u64) -> Candidate {
        Candidate {
            key: key(id),
            cached_blocks: cached,
            active_blocks: active,
            prefill_blocks: 0,
            peer_copy: None,
        }
    }

    fn policy(name: &str, parameters: serde_json::Value) -> Arc<dyn SelectionPolicy> {
        SelectionRegistry::with_builtins()
            .construct(name, &parameters, SelectionEnv::default())
            .unwrap()
    }

    #[test]
    fn cost_fn_prefers_the_cached_prefix_then_the_lower_load() {
        let p = policy("dynamo-default-cost-fn", json!({}));
        let cs = [candidate(1, 0, 0), candidate(2, 4, 0)];
        let input = SelectionInput {
            request_blocks: 8,
            candidates: &cs,
        };
        assert_eq!(p.select(&input).unwrap().index, 1);
        let cs = [candidate(1, 0, 0), candidate(2, 4, 100)];
        let input = SelectionInput {
            request_blocks: 8,
            candidates: &cs,
        };
        assert_eq!(p.select(&input).unwrap().index, 0);
    }

    #[test]
    fn exact_ties_go_to_the_first_candidate() {
        let p = policy("dynamo-default-cost-fn", json!({}));
        let cs = [candidate(1, 2, 0), candidate(2, 2, 0)];
        let input = SelectionInput {
            request_blocks: 8,
            candidates: &cs,
        };
        assert_eq!(p.select(&input).unwrap().index, 0);
    }

    #[test]
    fn kvcr_commits_the_copy_only_when_the_credit_decides() {
        let p = policy("kvcr", json!({"shared_cache_multiplier": 1.0}));
        assert!(p.commits_kv_copies());
        // Worker 1 is idle but cold; worker 2 is warm but loaded; worker 3
        // holds the prefix. Credit makes idle worker 1 win with 3's copy.
        let mut cold = candidate(1, 0, 0);
        cold.peer_copy = Some((key(3), 8));
        let cs = [cold, candidate(2, 0, 1), candidate(3, 8, 40)];
        let input = SelectionInput {
            request_blocks: 8,
            candidates: &cs,
        };
        let selected = p.select(&input).unwrap();
        assert_eq!(selected.index, 0);
        assert_eq!(
            selected.committed_copy_from, None,
            "1 wins without the credit too"
        );

        let mut cold = candidate(1, 0, 2);
        cold.peer_copy = Some((key(3), 8));
        let cs = [cold, candidate(2, 0, 0), candidate(3, 8, 40)];
        let input = SelectionInput {
            request_blocks: 8,
            candidates: &cs,
        };
        let selected = p.select(&input).unwrap();
        assert_eq!(selected.index, 0);
        assert_eq!(selected.committed_copy_from, Some(key(3)));
    }

    #[test]
    fn kvcr_with_zero_multiplier_commits_nothing() {
        let p = policy("kvcr", json!({"shared_cache_multiplier": 0}));
        assert!(!p.commits_kv_copies());
    }

    #[test]
    fn parameters_are_validated() {
        let registry = SelectionRegistry::with_builtins();
        let env = SelectionEnv::default();
        let err = registry
            .construct("kvcr", &json!({"shared_cache_multiplier": 2}), env)
            .err()
            .unwrap();
        assert!(err.to_string().contains("between 0 and 1"), "{err}");
        let err = registry
            .construct("kvcr", &json!({"shared_cache": 1}), env)
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("unknown field `shared_cache`"),
            "{err}"
        );
        let err = registry.construct("kv-cr", &json!({}), env).err().unwrap();
        assert!(
            err.to_string()
                .contains("known: dynamo-default-cost-fn, kvcr"),
            "{err}"
        );
    }

    #[test]
    fn round_robin_cycles_and_random_is_reproducible() {
        let cs = [candidate(1, 0, 0), candidate(2, 0, 0), candidate(3, 0, 0)];
        let input = SelectionInput {
            request_blocks: 1,
            candidates: &cs,
        };
        let rr = policy("round-robin", json!({}));
        let turns: Vec<usize> = (0..4).map(|_| rr.select(&input).unwrap().index).collect();
        assert_eq!(turns, [0, 1, 2, 0]);
        let registry = SelectionRegistry::with_builtins();
        let draw = |seed| {
            let p = registry
                .construct("random", &json!({}), SelectionEnv { seed })
                .unwrap();
            (0..16)
                .map(|_| p.select(&input).unwrap().index)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert!(draw(7).iter().any(|&i| i != draw(7)[0]), "not constant");
    }
}
