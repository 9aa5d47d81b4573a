//! Per policy, across reloads: the hint policies' calls, failures and latency
//! ([`crate::hints::PolicyStats`]) and each role's selection policy's
//! ([`crate::selection::SelectionStats`]), labelled by role and policy type.

use super::{counters, histograms, ConstHistogram};
use crate::hints::PolicyStats;
use crate::selection::{FallbackReason, SelectionStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Every (role, policy)'s figures, as the reloader's registry had them at scrape time.
pub struct PolicyCollector {
    pub hints: Vec<((String, String), Arc<PolicyStats>)>,
    pub selection: Vec<((String, String), Arc<SelectionStats>)>,
}

super::debug_as_name!(PolicyCollector);

fn load(n: &AtomicU64) -> u64 {
    n.load(Ordering::Relaxed)
}

type PolicyCounter = fn(&PolicyStats) -> u64;

/// The hint policies' counter families: name (without `_total`), help, figure.
const POLICY_COUNTERS: [(&str, &str, PolicyCounter); 9] = [
    ("kvhint_policy_calls", "Calls of a hint policy.", |s| {
        s.calls.get()
    }),
    (
        "kvhint_policy_failures",
        "Calls that lost their actions (error, panic or malformed action).",
        |s| load(&s.failures),
    ),
    (
        "kvhint_policy_errors",
        "Calls that returned an error.",
        |s| load(&s.errors),
    ),
    (
        "kvhint_policy_actions",
        "Actions a policy returned (before the per-booking cap).",
        |s| s.actions.get(),
    ),
    (
        "kvhint_policy_panics",
        "Calls that panicked (caught in the plugin).",
        |s| load(&s.panics),
    ),
    (
        "kvhint_policy_malformed",
        "Calls that returned a malformed action.",
        |s| load(&s.malformed),
    ),
    (
        "kvhint_policy_quarantines",
        "Times a policy was quarantined until the next reload.",
        |s| load(&s.quarantines),
    ),
    (
        "kvhint_policy_over_budget",
        "Calls that took longer than router.policy_budget_us.",
        |s| load(&s.over_budget),
    ),
    (
        "kvhint_policy_skipped_quarantined",
        "Calls skipped because the policy was quarantined.",
        |s| load(&s.skipped_quarantined),
    ),
];

type SelectionCounter = fn(&SelectionStats) -> u64;

const SELECTION_COUNTERS: [(&str, &str, SelectionCounter); 2] = [
    (
        "kvhint_selection_over_budget",
        "Calls of a role's selection policy that took longer than router.policy_budget_us.",
        |s| load(&s.over_budget),
    ),
    (
        "kvhint_selection_quarantines",
        "Times a role's selection policy was quarantined until the next reload.",
        |s| load(&s.quarantines),
    ),
];

/// `role`, `policy`.
fn labels((role, policy): &(String, String)) -> [(&'static str, &str); 2] {
    [("role", role), ("policy", policy)]
}

impl Collector for PolicyCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let e = &mut encoder;
        let policies = &self.hints;
        for (name, help, get) in POLICY_COUNTERS {
            counters(
                e,
                name,
                help,
                policies.iter().map(|(key, s)| (labels(key), get(s))),
            )?;
        }
        histograms(
            e,
            "kvhint_policy_latency_seconds",
            "Time inside a hint policy's build_hints.",
            policies
                .iter()
                .map(|(key, s)| (labels(key), ConstHistogram::latency(&s.latency))),
        )?;

        let selections = &self.selection;
        counters(
            e,
            "kvhint_selection_calls",
            "Calls of a role's selection policy.",
            selections
                .iter()
                .map(|(key, s)| (labels(key), s.calls.get())),
        )?;
        counters(
            e,
            "kvhint_selection_fallbacks",
            "Bookings the built-in default selection placed because the role's selection policy failed or is quarantined, by reason (error, panic, out_of_range, quarantined).",
            selections.iter().flat_map(|(key, s)| {
                FallbackReason::ALL.map(|reason| {
                    (
                        (labels(key), [("reason", reason.as_str())]),
                        s.fallbacks(reason),
                    )
                })
            }),
        )?;
        for (name, help, get) in SELECTION_COUNTERS {
            counters(
                e,
                name,
                help,
                selections.iter().map(|(key, s)| (labels(key), get(s))),
            )?;
        }
        // A histogram: its `_sum` is the counter the text had before (named
        // `kvhint_selection_latency_seconds_sum`), now with its buckets and count.
        histograms(
            e,
            "kvhint_selection_latency_seconds",
            "Time inside a role's selection policy.",
            selections
                .iter()
                .map(|(key, s)| (labels(key), ConstHistogram::latency(&s.latency))),
        )
    }
}
