//! What the two policy stages (selection, hints) share: the counters of each
//! policy (kept across reloads), the quarantine that skips a misbehaving one until
//! the next reload, the limits both apply (rule R7's action cap, R8's panic count,
//! the time budget), and the ABI's worker record built from a plain view.
//!
//! Its own module so that neither stage imports the other: the selection stage
//! and the hint stage each depend on this, and nothing here on them.

use crate::counters::Counter;
use crate::domain::WorkerView;
use abi_stable::std_types::RStr;
use kvhint_plugin_api::abi::{FfiRequestIdentity, FfiWorker};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

pub use crate::counters::{LatencyHistogram, LATENCY_BUCKETS_US};

/// The hard cap on actions in one message (rule R7).
pub const MAX_ACTIONS: usize = 32;

/// Counters of one policy of one role. They outlive reloads (a reload hands the
/// new instance the same counters), so metrics stay monotonic.
#[derive(Debug, Default)]
pub struct PolicyStats {
    /// Counted per thread ([`crate::counters`]): every booking adds to it.
    pub calls: Counter,
    pub failures: AtomicU64,
    pub errors: AtomicU64,
    pub panics: AtomicU64,
    pub malformed: AtomicU64,
    /// Counted per thread, like `calls`.
    pub actions: Counter,
    pub skipped_quarantined: AtomicU64,
    pub quarantines: AtomicU64,
    /// Calls that took longer than the time budget.
    pub over_budget: AtomicU64,
    pub latency: LatencyHistogram,
}

/// The counters of every (role, policy name) seen, across reloads: hint
/// policies by instance name, selection policies by type.
#[derive(Debug, Default)]
pub struct PolicyStatsRegistry {
    stats: parking_lot::Mutex<BTreeMap<(String, String), Arc<PolicyStats>>>,
    selection: parking_lot::Mutex<BTreeMap<(String, String), Arc<SelectionStats>>>,
}

impl PolicyStatsRegistry {
    /// The counters for a role's selection policy, created on first use.
    pub fn selection(&self, role: &str, policy: &str) -> Arc<SelectionStats> {
        let mut stats = self.selection.lock();
        Arc::clone(
            stats
                .entry((role.to_string(), policy.to_string()))
                .or_default(),
        )
    }

    /// Every (role, selection policy) with its counters, sorted.
    pub fn all_selection(&self) -> Vec<((String, String), Arc<SelectionStats>)> {
        let stats = self.selection.lock();
        stats
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect()
    }

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

/// Whether a policy instance (hint or selection) is skipped until the next reload,
/// and the counts that decide it (rule R8, `router.policy_budget_us`).
#[derive(Debug, Default)]
pub struct QuarantineState {
    panics: AtomicU64,
    /// Calls in a row over the time budget.
    overruns: AtomicU64,
    /// Why it was quarantined: [`Quarantine`] as a number (0: it is not).
    reason: AtomicU8,
}

/// What one call's duration meant for its policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    pub over_budget: bool,
    /// Set when this call quarantined the policy: the overruns in a row.
    pub quarantined_after: Option<u64>,
}

impl QuarantineState {
    pub fn is_quarantined(&self) -> bool {
        self.reason.load(Ordering::Relaxed) != 0
    }

    pub fn reason(&self) -> Option<Quarantine> {
        match self.reason.load(Ordering::Relaxed) {
            1 => Some(Quarantine::Panics),
            2 => Some(Quarantine::OverBudget),
            _ => None,
        }
    }

    /// Quarantines it for `reason` (the first reason sticks); true if it was not yet.
    fn enter(&self, reason: Quarantine) -> bool {
        self.reason
            .compare_exchange(0, reason as u8, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Counts a call that took `took_ns` against the budget of `limits`.
    pub fn timed(&self, took_ns: u64, limits: &HintLimits) -> Timed {
        if limits.budget_ns > 0 && took_ns > limits.budget_ns {
            let overruns = self.overruns.fetch_add(1, Ordering::Relaxed) + 1;
            let quarantined =
                overruns >= limits.quarantine_after_overruns && self.enter(Quarantine::OverBudget);
            return Timed {
                over_budget: true,
                quarantined_after: quarantined.then_some(overruns),
            };
        }
        if self.overruns.load(Ordering::Relaxed) != 0 {
            // Only a write when there is something to reset: every booking
            // thread calls this, and a store on each call would bounce the
            // cache line between them.
            self.overruns.store(0, Ordering::Relaxed);
        }
        Timed {
            over_budget: false,
            quarantined_after: None,
        }
    }

    /// Counts a panic; the panics so far if this one quarantined the policy.
    pub fn panicked(&self, limits: &HintLimits) -> Option<u64> {
        let panics = self.panics.fetch_add(1, Ordering::Relaxed) + 1;
        (panics >= limits.quarantine_after_panics && self.enter(Quarantine::Panics))
            .then_some(panics)
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

/// Why a booking was placed by the fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    Error = 0,
    Panic = 1,
    OutOfRange = 2,
    /// Not called: quarantined until the next reload.
    Quarantined = 3,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 4] = [
        Self::Error,
        Self::Panic,
        Self::OutOfRange,
        Self::Quarantined,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Panic => "panic",
            Self::OutOfRange => "out_of_range",
            Self::Quarantined => "quarantined",
        }
    }
}

/// Counters of one role's selection policy, kept across reloads.
#[derive(Debug, Default)]
pub struct SelectionStats {
    /// Counted per thread ([`crate::counters`]): every booking adds to it.
    pub calls: Counter,
    /// By [`FallbackReason`].
    pub fallbacks: [AtomicU64; 4],
    /// Calls that took longer than the time budget.
    pub over_budget: AtomicU64,
    /// Times the policy was quarantined until a reload.
    pub quarantines: AtomicU64,
    pub latency: LatencyHistogram,
}

impl SelectionStats {
    pub fn fallbacks(&self, reason: FallbackReason) -> u64 {
        self.fallbacks[reason as usize].load(Ordering::Relaxed)
    }
}

/// A worker's ABI record, from the plain view the router hands the stages.
pub(crate) fn ffi_worker(worker: WorkerView<'_>) -> FfiWorker<'_> {
    FfiWorker {
        worker_id: worker.key.worker_id,
        dp_rank: worker.key.dp_rank,
        router_hint: worker.router_hint,
        worker_type: RStr::from_str(worker.worker_type),
        source_control_endpoint: RStr::from_str(worker.source_control_endpoint),
    }
}

/// A request's identity beyond its tokens as the ABI carries it ("" for none).
pub(crate) fn ffi_identity<'a>(
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
) -> FfiRequestIdentity<'a> {
    FfiRequestIdentity {
        lora_name: RStr::from_str(lora_name.unwrap_or("")),
        cache_salt: RStr::from_str(cache_salt.unwrap_or("")),
    }
}

/// A reused `Vec` of borrowed FFI records: emptied, then collected in place
/// into a `Vec` of the caller's lifetime, which keeps the allocation.
pub(crate) fn reuse<T, U>(mut spare: Vec<T>) -> Vec<U> {
    spare.clear();
    spare.into_iter().filter_map(|_| None).collect()
}
