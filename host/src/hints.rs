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

use crate::envelope::{self, ActionId, Envelope, EnvelopeAction, MAX_ACTIONS};
use crate::registry::{ConstructedPolicy, Origin};
use abi_stable::std_types::{RResult, RVec};
use kvhint_plugin_api::abi::{FfiAction, FfiErrorKind, FfiHintContext, FfiHintPolicyBox};
use kvhint_plugin_api::policy::Commitments;
use serde_json::value::RawValue;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Counters of one policy instance. Read by metrics and the status endpoint.
#[derive(Debug, Default)]
pub struct PolicyStats {
    pub calls: AtomicU64,
    pub failures: AtomicU64,
    pub errors: AtomicU64,
    pub panics: AtomicU64,
    pub malformed: AtomicU64,
    pub actions: AtomicU64,
    pub skipped_quarantined: AtomicU64,
    /// Total time inside `build_hints`, for the mean; histograms live in metrics.
    pub nanos: AtomicU64,
    quarantined: AtomicBool,
}

impl PolicyStats {
    pub fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
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
    pub stats: PolicyStats,
}

impl HintPolicyInstance {
    pub fn new(name: impl Into<String>, constructed: ConstructedPolicy) -> Self {
        Self {
            name: name.into(),
            type_name: constructed.type_name,
            origin: constructed.origin,
            commitments: constructed.commitments,
            policy: constructed.policy,
            stats: PolicyStats::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HintLimits {
    pub max_actions: usize,
    /// Panics after which a policy is skipped until the next reload.
    pub quarantine_after_panics: u64,
}

impl Default for HintLimits {
    fn default() -> Self {
        Self {
            max_actions: MAX_ACTIONS,
            quarantine_after_panics: 3,
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
        let mut results: Vec<RVec<FfiAction>> = Vec::with_capacity(self.policies.len());
        for instance in &self.policies {
            if let Some(actions) = self.call(instance, context, &mut outcome.failures) {
                results.push(actions);
            }
        }

        let mut actions: Vec<EnvelopeAction<'_>> = Vec::new();
        for action in results.iter().flatten() {
            if actions.len() == self.limits.max_actions {
                outcome.dropped_over_cap += 1;
                continue;
            }
            // Validated in `call`, so this cannot fail; a failure would only
            // drop the action, never the booking.
            let Ok(payload) = serde_json::from_str::<&RawValue>(action.payload_json.as_str())
            else {
                continue;
            };
            actions.push(EnvelopeAction {
                action_id: ActionId(actions.len() + 1),
                action_type: action.action_type.as_str(),
                action_version: action.action_version.as_str(),
                payload,
            });
        }
        if actions.is_empty() {
            return outcome;
        }
        outcome.action_types = actions.iter().map(|a| a.action_type.to_string()).collect();
        let envelope = Envelope {
            protocol_version: envelope::PROTOCOL_VERSION,
            message_id: context.request_id.as_str(),
            actions: &actions,
        };
        match serde_json::to_string(&envelope) {
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
        if stats.is_quarantined() {
            stats.skipped_quarantined.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let result = instance.policy.build_hints(context);
        stats
            .nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
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
                if let Some(problem) = actions.iter().find_map(|a| {
                    envelope::malformed(
                        a.action_type.as_str(),
                        a.action_version.as_str(),
                        a.payload_json.as_str(),
                    )
                }) {
                    stats.malformed.fetch_add(1, Ordering::Relaxed);
                    return fail(FailureKind::Malformed, problem);
                }
                stats
                    .actions
                    .fetch_add(actions.len() as u64, Ordering::Relaxed);
                Some(actions)
            }
            RResult::RErr(e) if e.kind == FfiErrorKind::Panicked => {
                let panics = stats.panics.fetch_add(1, Ordering::Relaxed) + 1;
                if panics >= self.limits.quarantine_after_panics {
                    stats.quarantined.store(true, Ordering::Relaxed);
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
