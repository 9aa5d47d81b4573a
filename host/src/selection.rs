//! The selection stage: a role's selection policy, called across the ABI, with
//! the fallback that keeps a booking alive when the policy misbehaves.
//!
//! Every selection policy is a plugin, the built-ins included (`kvhint-selection`,
//! linked in and registered like any `.so`, rule R12), so the router only ever
//! talks to one through [`FfiSelectionPolicyBox`]. It sees the request and the
//! candidates the router prepared (cached prefix, load, and — when it asks — the
//! best copy a hint-capable peer could supply) and answers an index. It never
//! sees hints: selection happens first and hints cannot change it (rule R1).
//!
//! An error, a panic (caught on the plugin side) or an answer out of range — an
//! index past the candidates, or a committed copy the policy did not declare or
//! the candidate does not have — books that request with the built-in default
//! selection (`dynamo-default-cost-fn`, default parameters) instead, and is
//! counted per policy and reason. A booking never fails because of its
//! selection policy.
//!
//! As for hint policies (`hints.rs`), a selection policy that has panicked
//! `quarantine_after_panics` times, or whose last `quarantine_after_overruns`
//! calls in a row all ran over `router.policy_budget_us`, is quarantined until
//! the next reload: its role is booked by the fallback without calling it
//! (reason `quarantined`), so a broken plugin neither floods the log with a
//! warning per booking nor keeps every booking waiting on it.

use crate::domain::{Role, WorkerView};
use crate::policy_common::{
    ffi_identity, ffi_worker, reuse, HintLimits, Quarantine, QuarantineState,
};
pub use crate::policy_common::{FallbackReason, SelectionStats};
use crate::registry::{ConstructedSelection, ErrorKind, Origin};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr};
use kvhint_plugin_api::abi::{
    FfiCandidate, FfiPeerCopy, FfiSelectionPolicyBox, FfiSelectionRequest,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The built-in selection policy a failing one falls back to.
pub const FALLBACK_TYPE: &str = "dynamo-default-cost-fn";

/// A request to place, as the router describes it: plain values, from which the
/// stage builds the ABI's record (so an ABI change stops here, not in the router).
#[derive(Debug, Clone, Copy)]
pub struct SelectionRequest<'a> {
    pub request_id: &'a str,
    pub role: Role,
    /// Full blocks in the prompt.
    pub request_blocks: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub lora_name: Option<&'a str>,
    pub cache_salt: Option<&'a str>,
    /// The session context as JSON object text, if any.
    pub session_context: Option<&'a str>,
}

/// One worker the request could go to, as the router describes it.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub worker: WorkerView<'a>,
    /// Leading request blocks this worker already holds.
    pub cached_blocks: usize,
    /// Open bookings on it, the blocks they hold, and those still to prefill.
    pub active_requests: u64,
    pub active_blocks: u64,
    pub prefill_blocks: u64,
    /// The best copy a peer could supply: the peer and the leading request blocks
    /// it holds (only when the policy wants peer copies; see
    /// [`SelectionStage::wants_peer_copies`]).
    pub peer_copy: Option<(WorkerView<'a>, usize)>,
}

/// A booking's candidates, kept in the form the policy reads, so the router's
/// views are turned into ABI records once, as they are pushed, and never copied
/// again. Its buffer comes from, and goes back to, a [`SpareCandidates`].
pub struct Candidates<'a> {
    records: Vec<FfiCandidate<'a>>,
}

impl<'a> Candidates<'a> {
    pub fn push(&mut self, candidate: Candidate<'a>) {
        self.records.push(FfiCandidate {
            worker: ffi_worker(candidate.worker),
            cached_blocks: candidate.cached_blocks as u64,
            active_requests: candidate.active_requests,
            active_blocks: candidate.active_blocks,
            prefill_blocks: candidate.prefill_blocks,
            peer_copy: match candidate.peer_copy {
                Some((source, cached_blocks)) => ROption::RSome(FfiPeerCopy {
                    source: ffi_worker(source),
                    cached_blocks: cached_blocks as u64,
                }),
                None => ROption::RNone,
            },
        });
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Candidate `index`'s cached prefix, in blocks (0 past the end).
    pub fn cached_blocks(&self, index: usize) -> usize {
        self.records
            .get(index)
            .map_or(0, |c| c.cached_blocks as usize)
    }
}

/// The buffer a thread's bookings build their [`Candidates`] in, reused from one
/// booking to the next so the hot path does not allocate it per call.
#[derive(Default)]
pub struct SpareCandidates {
    spare: Vec<FfiCandidate<'static>>,
}

impl SpareCandidates {
    /// An empty list in the spare buffer (which is empty until it comes back).
    pub fn take<'a>(&mut self) -> Candidates<'a> {
        Candidates {
            records: reuse(std::mem::take(&mut self.spare)),
        }
    }

    /// Takes the list's buffer back for the next booking.
    pub fn put_back(&mut self, candidates: Candidates<'_>) {
        self.spare = reuse(candidates.records);
    }

    /// Bytes the buffer keeps between bookings.
    pub fn retained_bytes(&self) -> usize {
        self.spare.capacity() * std::mem::size_of::<FfiCandidate<'static>>()
    }
}

/// What a selection decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen {
    pub index: usize,
    /// Commit the booking to the chosen candidate's peer copy (rule R5).
    pub commit_kv_copy: bool,
    /// Set when the fallback placed it.
    pub fallback: Option<FallbackReason>,
}

/// A role's constructed selection policy.
pub struct SelectionStage {
    pub type_name: String,
    pub origin: Arc<Origin>,
    kv_aware: bool,
    commits_kv_copies: bool,
    wants_peer_copies: bool,
    policy: FfiSelectionPolicyBox,
    /// The built-in default, for when `policy` fails; `None` when `policy` is it.
    fallback: Option<FfiSelectionPolicyBox>,
    pub stats: Arc<SelectionStats>,
    limits: HintLimits,
    /// Of this instance: a reload builds a fresh one, which starts clean.
    quarantine: QuarantineState,
}

impl SelectionStage {
    pub fn new(
        constructed: ConstructedSelection,
        fallback: Option<ConstructedSelection>,
        stats: Arc<SelectionStats>,
    ) -> Self {
        Self::with_limits(constructed, fallback, stats, HintLimits::default())
    }

    /// With the quarantine thresholds and time budget of `limits` (the same
    /// settings as a role's hint policies).
    pub fn with_limits(
        constructed: ConstructedSelection,
        fallback: Option<ConstructedSelection>,
        stats: Arc<SelectionStats>,
        limits: HintLimits,
    ) -> Self {
        Self {
            limits,
            quarantine: QuarantineState::default(),
            kv_aware: constructed.kv_aware(),
            commits_kv_copies: constructed.commits_kv_copies(),
            wants_peer_copies: constructed.wants_peer_copies(),
            type_name: constructed.type_name,
            origin: constructed.origin,
            policy: constructed.policy,
            fallback: fallback.map(|f| f.policy),
            stats,
        }
    }

    /// Whether it reads cached prefixes (rule R4: hints run only under one).
    pub fn kv_aware(&self) -> bool {
        self.kv_aware
    }

    /// Whether, with its parameters, it may commit bookings to KV copies (R5).
    pub fn commits_kv_copies(&self) -> bool {
        self.commits_kv_copies
    }

    /// Whether the router must fill each candidate's peer copy.
    pub fn wants_peer_copies(&self) -> bool {
        self.wants_peer_copies
    }

    /// Whether it is skipped until the next reload.
    pub fn is_quarantined(&self) -> bool {
        self.quarantine.is_quarantined()
    }

    /// Why it is quarantined, if it is.
    pub fn quarantine(&self) -> Option<Quarantine> {
        self.quarantine.reason()
    }

    fn quarantined(&self, why: &str) {
        self.stats.quarantines.fetch_add(1, Ordering::Relaxed);
        tracing::error!(policy = %self.type_name, why, "selection policy quarantined until the next reload; its role is booked by the built-in default selection");
    }

    /// The policy's choice among the router's `candidates` (not empty), or the
    /// fallback's.
    pub fn select_candidates(
        &self,
        request: &SelectionRequest<'_>,
        candidates: &Candidates<'_>,
    ) -> Chosen {
        self.select(
            &FfiSelectionRequest {
                request_id: RStr::from_str(request.request_id),
                role: RStr::from_str(request.role.as_str()),
                request_blocks: request.request_blocks as u64,
                prompt_tokens: request.prompt_tokens as u64,
                block_size: request.block_size as u32,
                identity: ffi_identity(request.lora_name, request.cache_salt),
                session_context: RStr::from_str(request.session_context.unwrap_or("")),
            },
            &candidates.records,
        )
    }

    /// The policy's choice among `candidates` (not empty), or the fallback's: the
    /// ABI's records as they are (the benches and tests build them directly).
    pub fn select(
        &self,
        request: &FfiSelectionRequest<'_>,
        candidates: &[FfiCandidate<'_>],
    ) -> Chosen {
        if self.is_quarantined() {
            return self.fall_back(request, candidates, FallbackReason::Quarantined);
        }
        self.stats.calls.add(1);
        let started = Instant::now();
        let answer = self.policy.select(request, RSlice::from_slice(candidates));
        let took = started.elapsed().as_nanos() as u64;
        self.stats.latency.observe(took);
        let timed = self.quarantine.timed(took, &self.limits);
        if timed.over_budget {
            self.stats.over_budget.fetch_add(1, Ordering::Relaxed);
        }
        if timed.quarantined_after.is_some() {
            self.quarantined("its calls keep running over router.policy_budget_us");
        }
        let reason = match answer {
            RResult::ROk(selection) => {
                let index = usize::try_from(selection.index).unwrap_or(usize::MAX);
                let copy_ok = !selection.commit_kv_copy
                    || (self.commits_kv_copies
                        && candidates.get(index).is_some_and(|c| c.peer_copy.is_some()));
                if index < candidates.len() && copy_ok {
                    return Chosen {
                        index,
                        commit_kv_copy: selection.commit_kv_copy,
                        fallback: None,
                    };
                }
                tracing::warn!(
                    policy = %self.type_name,
                    index = selection.index,
                    candidates = candidates.len(),
                    commit_kv_copy = selection.commit_kv_copy,
                    "selection policy answered out of range; booked by the built-in default selection"
                );
                FallbackReason::OutOfRange
            }
            RResult::RErr(e) => {
                let reason = match ErrorKind::of(&e) {
                    ErrorKind::Panicked => FallbackReason::Panic,
                    _ => FallbackReason::Error,
                };
                tracing::warn!(policy = %self.type_name, reason = reason.as_str(), error = %e.message, "selection policy failed; booked by the built-in default selection");
                if reason == FallbackReason::Panic
                    && self.quarantine.panicked(&self.limits).is_some()
                {
                    self.quarantined("it keeps panicking");
                }
                reason
            }
        };
        self.fall_back(request, candidates, reason)
    }

    /// Books with the built-in default instead (the first candidate if even
    /// that fails), counting why.
    fn fall_back(
        &self,
        request: &FfiSelectionRequest<'_>,
        candidates: &[FfiCandidate<'_>],
        reason: FallbackReason,
    ) -> Chosen {
        self.stats.fallbacks[reason as usize].fetch_add(1, Ordering::Relaxed);
        let index = self
            .fallback
            .as_ref()
            .and_then(
                |fallback| match fallback.select(request, RSlice::from_slice(candidates)) {
                    RResult::ROk(s) => usize::try_from(s.index).ok(),
                    RResult::RErr(_) => None,
                },
            )
            .filter(|&i| i < candidates.len())
            .unwrap_or(0);
        Chosen {
            index,
            commit_kv_copy: false,
            fallback: Some(reason),
        }
    }
}
