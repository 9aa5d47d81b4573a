//! The hint stage: one booking's context through a role's ordered hint
//! policies, into at most one engine-format message.
//!
//! Rules enforced here, after the worker is booked (R1: the stage only reads the
//! booking):
//! - R7: actions are numbered `a1`, `a2`, … in policy order, at most
//!   [`MAX_ACTIONS`]; the surplus (from the later policies) is dropped and counted.
//! - R8: a policy that errors, panics (caught on the plugin side) or returns a
//!   malformed action loses all of its own actions for this booking and nothing
//!   else; failures are counted per policy, and a policy that has panicked
//!   `quarantine_after_panics` times is skipped until the next reload (a reload
//!   builds fresh instances). The stage never fails the booking.
//! - The time budget: plugins run in the router's process, on the booking's
//!   thread, so a policy that blocks holds up every booking behind it. A call
//!   that takes longer than `router.policy_budget_us` is counted; a policy whose
//!   last `quarantine_after_overruns` calls in a row all ran over is quarantined
//!   until the next reload, like one that keeps panicking. Calls in a row, not in
//!   total, so a healthy policy preempted now and then is never quarantined; and
//!   many of them (20 by default, over a 10 ms budget), because one stall of the
//!   whole process (CPU throttling of its cgroup, a VM pause) delays every call
//!   in flight at once. An overrunning call's actions still go out: it did
//!   finish.

use crate::domain::Worker;
use crate::envelope::{self, MAX_ACTIONS};
use crate::registry::{ConstructedPolicy, Origin};
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RVec};
use kvhint_plugin_api::abi::{
    FfiAction, FfiErrorKind, FfiHintContext, FfiHintPolicyBox, FfiKvCopy, FfiPeer, FfiWorker,
};
use kvhint_plugin_api::policy::Commitments;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Upper bounds (in microseconds) of the policy-latency histogram buckets.
pub const LATENCY_BUCKETS_US: [f64; 12] = [
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// A lock-free latency histogram: one atomic add per observation, so timing a
/// policy costs the booking path no lock.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Counts per bucket of [`LATENCY_BUCKETS_US`], plus one for +Inf.
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_nanos: AtomicU64,
}

impl LatencyHistogram {
    pub fn observe(&self, nanos: u64) {
        let micros = nanos as f64 / 1000.0;
        let bucket = LATENCY_BUCKETS_US
            .iter()
            .position(|&bound| micros <= bound)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf, i.e. the total count).
    pub fn cumulative(&self) -> Vec<u64> {
        let mut total = 0;
        self.buckets
            .iter()
            .map(|b| {
                total += b.load(Ordering::Relaxed);
                total
            })
            .collect()
    }

    /// Total time observed, in nanoseconds.
    pub fn sum_nanos(&self) -> u64 {
        self.sum_nanos.load(Ordering::Relaxed)
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// Counters of one policy of one role. They outlive reloads (a reload hands the
/// new instance the same counters), so metrics stay monotonic.
#[derive(Debug, Default)]
pub struct PolicyStats {
    pub calls: AtomicU64,
    pub failures: AtomicU64,
    pub errors: AtomicU64,
    pub panics: AtomicU64,
    pub malformed: AtomicU64,
    pub actions: AtomicU64,
    pub skipped_quarantined: AtomicU64,
    pub quarantines: AtomicU64,
    /// Calls that took longer than the time budget.
    pub over_budget: AtomicU64,
    pub latency: LatencyHistogram,
}

/// The counters of every (role, policy name) seen, across reloads.
#[derive(Debug, Default)]
pub struct PolicyStatsRegistry {
    stats: parking_lot::Mutex<BTreeMap<(String, String), Arc<PolicyStats>>>,
}

impl PolicyStatsRegistry {
    /// The counters for a role's policy, created on first use.
    pub fn get(&self, role: &str, policy: &str) -> Arc<PolicyStats> {
        let mut stats = self.stats.lock();
        Arc::clone(
            stats
                .entry((role.to_string(), policy.to_string()))
                .or_default(),
        )
    }

    /// Every (role, policy) with its counters, sorted.
    pub fn all(&self) -> Vec<((String, String), Arc<PolicyStats>)> {
        let stats = self.stats.lock();
        stats
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }
}

/// One hint policy as a role runs it.
pub struct HintPolicyInstance {
    /// The item's `name` (its `type` unless the role lists the type twice).
    pub name: String,
    pub type_name: String,
    pub origin: Arc<Origin>,
    pub commitments: Commitments,
    policy: FfiHintPolicyBox,
    pub stats: Arc<PolicyStats>,
    /// Panics of this instance; quarantine is per snapshot, so a reload (a new
    /// instance) gives a fixed plugin a fresh start.
    panics: AtomicU64,
    /// Calls in a row over the time budget.
    overruns: AtomicU64,
    quarantined: AtomicBool,
    /// Why it was quarantined: [`Quarantine`] as a number (0: it is not).
    quarantine_reason: AtomicU8,
}

/// Why a policy is skipped until the next reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quarantine {
    Panics = 1,
    OverBudget = 2,
}

impl Quarantine {
    pub fn as_str(self) -> &'static str {
        match self {
            Quarantine::Panics => "panics",
            Quarantine::OverBudget => "over_budget",
        }
    }
}

impl HintPolicyInstance {
    /// An instance with counters of its own.
    pub fn new(name: impl Into<String>, constructed: ConstructedPolicy) -> Self {
        Self::with_stats(name, constructed, Arc::default())
    }

    /// An instance counting into shared counters (see [`PolicyStatsRegistry`]).
    pub fn with_stats(
        name: impl Into<String>,
        constructed: ConstructedPolicy,
        stats: Arc<PolicyStats>,
    ) -> Self {
        Self {
            name: name.into(),
            type_name: constructed.type_name,
            origin: constructed.origin,
            commitments: constructed.commitments,
            policy: constructed.policy,
            stats,
            panics: AtomicU64::new(0),
            overruns: AtomicU64::new(0),
            quarantined: AtomicBool::new(false),
            quarantine_reason: AtomicU8::new(0),
        }
    }

    pub fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Why it is quarantined, if it is.
    pub fn quarantine(&self) -> Option<Quarantine> {
        match self.quarantine_reason.load(Ordering::Relaxed) {
            1 => Some(Quarantine::Panics),
            2 => Some(Quarantine::OverBudget),
            _ => None,
        }
    }

    /// Quarantines it for `reason` (the first reason sticks); true if it was not yet.
    fn quarantine_for(&self, reason: Quarantine) -> bool {
        if self.quarantined.swap(true, Ordering::Relaxed) {
            return false;
        }
        self.quarantine_reason
            .store(reason as u8, Ordering::Relaxed);
        self.stats.quarantines.fetch_add(1, Ordering::Relaxed);
        true
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HintLimits {
    pub max_actions: usize,
    /// Panics after which a policy is skipped until the next reload.
    pub quarantine_after_panics: u64,
    /// `router.policy_budget_us` in nanoseconds: a call longer than this is over
    /// budget (0: no budget).
    pub budget_ns: u64,
    /// Calls in a row over budget after which a policy is skipped until the
    /// next reload.
    pub quarantine_after_overruns: u64,
}

impl Default for HintLimits {
    fn default() -> Self {
        Self {
            max_actions: MAX_ACTIONS,
            quarantine_after_panics: 3,
            budget_ns: 10_000_000,
            quarantine_after_overruns: 20,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    Error,
    Panic,
    Malformed,
}

/// A policy that lost its actions for one booking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyFailure {
    pub policy: String,
    pub kind: FailureKind,
    pub message: String,
}

/// What the stage produced for one booking.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HintOutcome {
    /// The engine-format message, if any action survived.
    pub message: Option<String>,
    /// Action types in the message, in order (for metrics and summaries).
    pub action_types: Vec<String>,
    /// Actions dropped over the cap (rule R7).
    pub dropped_over_cap: usize,
    pub failures: Vec<PolicyFailure>,
    /// Whether a policy that declares `Commitments::KV_COPY` returned actions
    /// that made it into the message (so a committed copy was sent).
    pub kv_copy_sent: bool,
}

/// A role's ordered hint policies.
pub struct HintStage {
    policies: Vec<HintPolicyInstance>,
    limits: HintLimits,
}

impl HintStage {
    pub fn new(policies: Vec<HintPolicyInstance>, limits: HintLimits) -> Self {
        Self { policies, limits }
    }

    pub fn policies(&self) -> &[HintPolicyInstance] {
        &self.policies
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// Runs every policy on `context` and builds the message.
    pub fn run(&self, context: &FfiHintContext<'_>) -> HintOutcome {
        let mut outcome = HintOutcome::default();
        // Each policy's actions, kept as the plugin allocated them; the envelope
        // borrows from them.
        let mut results: Vec<(RVec<FfiAction>, bool)> = Vec::with_capacity(self.policies.len());
        for instance in &self.policies {
            if let Some(actions) = self.call(instance, context, &mut outcome.failures) {
                let sender = instance.commitments.contains(Commitments::KV_COPY);
                results.push((actions, sender));
            }
        }

        let mut actions: Vec<&FfiAction> = Vec::new();
        for (result, sender) in &results {
            for action in result.iter() {
                if actions.len() == self.limits.max_actions {
                    outcome.dropped_over_cap += 1;
                } else {
                    actions.push(action);
                    outcome.kv_copy_sent |= *sender;
                }
            }
        }
        if actions.is_empty() {
            return outcome;
        }
        outcome.action_types = actions
            .iter()
            .map(|a| a.action_type.as_str().to_string())
            .collect();
        match envelope::write(context.request_id.as_str(), &actions) {
            Ok(text) => outcome.message = Some(text),
            Err(e) => {
                tracing::error!(error = %e, "could not encode a hint message; the booking goes out without one")
            }
        }
        outcome
    }

    /// Calls one policy; `None` when it loses its actions for this booking.
    fn call(
        &self,
        instance: &HintPolicyInstance,
        context: &FfiHintContext<'_>,
        failures: &mut Vec<PolicyFailure>,
    ) -> Option<RVec<FfiAction>> {
        let stats = &instance.stats;
        if instance.is_quarantined() {
            stats.skipped_quarantined.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let result = instance.policy.build_hints(context);
        let took = started.elapsed().as_nanos() as u64;
        stats.latency.observe(took);
        if self.limits.budget_ns > 0 && took > self.limits.budget_ns {
            stats.over_budget.fetch_add(1, Ordering::Relaxed);
            let overruns = instance.overruns.fetch_add(1, Ordering::Relaxed) + 1;
            if overruns >= self.limits.quarantine_after_overruns
                && instance.quarantine_for(Quarantine::OverBudget)
            {
                tracing::error!(
                    policy = %instance.name,
                    overruns,
                    last_call_us = took / 1000,
                    budget_us = self.limits.budget_ns / 1000,
                    "hint policy quarantined until the next reload: its calls keep running over router.policy_budget_us (plugins run in the router's process and must not block)"
                );
            }
        } else if instance.overruns.load(Ordering::Relaxed) != 0 {
            // Only a write when there is something to reset: every booking
            // thread calls this, and a store on each call would bounce the
            // cache line between them.
            instance.overruns.store(0, Ordering::Relaxed);
        }
        let mut fail = |kind: FailureKind, message: String| {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(policy = %instance.name, kind = ?kind, %message, "hint policy dropped its actions for this booking");
            failures.push(PolicyFailure {
                policy: instance.name.clone(),
                kind,
                message,
            });
            None
        };
        match result {
            RResult::ROk(actions) => {
                if let Some(problem) = actions.iter().find_map(envelope::malformed) {
                    stats.malformed.fetch_add(1, Ordering::Relaxed);
                    return fail(FailureKind::Malformed, problem);
                }
                stats
                    .actions
                    .fetch_add(actions.len() as u64, Ordering::Relaxed);
                Some(actions)
            }
            RResult::RErr(e) if e.kind == FfiErrorKind::Malformed => {
                stats.malformed.fetch_add(1, Ordering::Relaxed);
                fail(FailureKind::Malformed, e.message.into_string())
            }
            RResult::RErr(e) if e.kind == FfiErrorKind::Panicked => {
                stats.panics.fetch_add(1, Ordering::Relaxed);
                let panics = instance.panics.fetch_add(1, Ordering::Relaxed) + 1;
                if panics >= self.limits.quarantine_after_panics
                    && instance.quarantine_for(Quarantine::Panics)
                {
                    tracing::error!(policy = %instance.name, panics, "hint policy quarantined until the next reload");
                }
                fail(FailureKind::Panic, e.message.into_string())
            }
            RResult::RErr(e) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                fail(FailureKind::Error, e.message.into_string())
            }
        }
    }
}

/// Why a booking carries no hint message although it may have had one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HintSkip {
    /// The role is not on the KV path: `--router-mode` is not `kv`, or its
    /// selection policy is not KV-aware (rule R4).
    NotKvPath,
    /// The role resolves to no hint policies.
    NoPolicies,
    /// The booked worker does not advertise `router_hint` (rule R6).
    WorkerNotHintCapable,
    /// The policies ran and returned no action.
    NoActions,
    /// The message was not valid JSON, so it was not sent. Only a plugin that
    /// implements the raw ABI trait by hand, bypassing the plugin-api adapter,
    /// can cause this.
    MalformedMessage,
}

/// A booking's hint: the one message that goes to the booked worker, or why
/// there is none. The message was validated once, here, where it was made.
#[derive(Debug, Clone)]
pub enum Hint {
    Sent {
        /// The engine-format message (rule R10), valid JSON, embedded as is.
        message: Box<RawValue>,
        /// Its action types, in order.
        action_types: Vec<String>,
    },
    Skipped(HintSkip),
}

impl Hint {
    pub fn message(&self) -> Option<&RawValue> {
        match self {
            Self::Sent { message, .. } => Some(message),
            Self::Skipped(_) => None,
        }
    }

    pub fn skipped(&self) -> Option<HintSkip> {
        match self {
            Self::Sent { .. } => None,
            Self::Skipped(skip) => Some(*skip),
        }
    }

    pub fn action_types(&self) -> &[String] {
        match self {
            Self::Sent { action_types, .. } => action_types,
            Self::Skipped(_) => &[],
        }
    }
}

impl PartialEq for Hint {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (
                Self::Sent {
                    message: a,
                    action_types: at,
                },
                Self::Sent {
                    message: b,
                    action_types: bt,
                },
            ) => a.get() == b.get() && at == bt,
            (Self::Skipped(a), Self::Skipped(b)) => a == b,
            _ => false,
        }
    }
}

/// What the router hands the hint stage for one booking (read-only, rule R1).
pub struct BookedRequest<'a> {
    pub request_id: &'a str,
    pub worker: &'a Worker,
    /// Leading request blocks the booked worker already holds.
    pub cached_blocks: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
    /// JSON object text, if the request had a session context.
    pub session_context: Option<&'a str>,
    pub selection_policy: &'a str,
    pub block_hashes: &'a [u64],
}

/// The KV copy a booking was committed to, as the hint stage shows it.
pub struct CommittedCopyView<'a> {
    pub source: &'a Worker,
    pub first_block: usize,
    /// The source's engine hashes of blocks `0..last_block`, root-aligned.
    pub block_hashes: &'a [u64],
}

/// What the hint stage did for one booking.
#[derive(Debug, Clone, PartialEq)]
pub struct HintResult {
    pub hint: Hint,
    /// Actions dropped over the cap (rule R7).
    pub dropped_actions: usize,
    pub failures: Vec<PolicyFailure>,
    /// Whether a committed copy's sender got its actions into the message that
    /// went out; if not, the copy will not happen.
    pub kv_copy_sent: bool,
}

fn ffi_worker(worker: &Worker) -> FfiWorker<'_> {
    FfiWorker {
        worker_id: worker.key.worker_id,
        dp_rank: worker.key.dp_rank,
        router_hint: worker.router_hint,
        worker_type: RStr::from_str(&worker.worker_type),
        source_control_endpoint: RStr::from_str(&worker.source_control_endpoint),
    }
}

impl HintStage {
    /// Builds the borrowed context for a booking, runs the policies on it, and
    /// validates the message. `peers`: the other workers holding a prefix of the
    /// request, longest first, each with its engine hashes of that prefix.
    pub fn run_booking<'a>(
        &self,
        booked: &BookedRequest<'a>,
        peers: impl Iterator<Item = (&'a Worker, &'a [u64])>,
        committed: Option<CommittedCopyView<'a>>,
    ) -> HintResult {
        let peers: Vec<FfiPeer<'a>> = peers
            .map(|(worker, hashes)| FfiPeer {
                worker: ffi_worker(worker),
                cached_blocks: hashes.len() as u64,
                block_hashes: RSlice::from_slice(hashes),
            })
            .collect();
        let context = FfiHintContext {
            request_id: RStr::from_str(booked.request_id),
            worker: ffi_worker(booked.worker),
            cached_blocks: booked.cached_blocks as u64,
            prompt_tokens: booked.prompt_tokens as u64,
            block_size: booked.block_size as u32,
            session_context: RStr::from_str(booked.session_context.unwrap_or("")),
            selection_policy: RStr::from_str(booked.selection_policy),
            block_hashes: RSlice::from_slice(booked.block_hashes),
            peers: RSlice::from_slice(&peers),
            committed_kv_copy: match committed {
                Some(copy) => ROption::RSome(FfiKvCopy {
                    source: ffi_worker(copy.source),
                    first_block: copy.first_block as u64,
                    block_hashes: RSlice::from_slice(copy.block_hashes),
                }),
                None => ROption::RNone,
            },
        };
        let outcome = self.run(&context);
        let hint = match outcome.message {
            None => Hint::Skipped(HintSkip::NoActions),
            Some(text) => match RawValue::from_string(text) {
                Ok(message) => Hint::Sent {
                    message,
                    action_types: outcome.action_types,
                },
                Err(e) => {
                    tracing::error!(request = ?booked.request_id, error = %e, "a hint message is not valid JSON and is not sent; a plugin bypasses the plugin-api adapter");
                    Hint::Skipped(HintSkip::MalformedMessage)
                }
            },
        };
        HintResult {
            kv_copy_sent: outcome.kv_copy_sent && matches!(hint, Hint::Sent { .. }),
            hint,
            dropped_actions: outcome.dropped_over_cap,
            failures: outcome.failures,
        }
    }
}
