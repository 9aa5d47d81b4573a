//! The service's own figures: what a booking, an error answer and a connection
//! count ([`Metrics`], atomics only), and the router's state read at scrape time
//! (reloads, snapshot, workers, open bookings, index size).

use super::labels::LabelCounts;
use super::{counter, counters, gauge};
use crate::config::Role;
use crate::router::{Booking, HintSkip};
use crate::service::listener::{ConnectionCounts, Phase};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

fn role_index(role: Role) -> usize {
    match role {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

const ROLES: [Role; 3] = [Role::Aggregated, Role::Prefill, Role::Decode];

const SKIPS: [(HintSkip, &str); 4] = [
    (HintSkip::NotKvPath, "not_kv_path"),
    (HintSkip::NoPolicies, "no_policies"),
    (HintSkip::WorkerNotHintCapable, "worker_not_hint_capable"),
    (HintSkip::NoActions, "no_actions"),
];

/// What the service counts: atomics a booking, an error answer or a connection adds
/// to, read by [`BookingCollector`] at scrape time.
#[derive(Debug, Default)]
pub struct Metrics {
    bookings: [AtomicU64; 3],
    hints_sent: [AtomicU64; 3],
    committed_copies: AtomicU64,
    hints_skipped: [AtomicU64; SKIPS.len()],
    actions_dropped: AtomicU64,
    /// Action types are open-ended (plugins name them): lock-free and bounded.
    actions_by_type: LabelCounts,
    /// API errors by error code.
    errors_by_code: LabelCounts,
    pub kv_events: AtomicU64,
    /// What the listener counts of its connections (it owns them: it knows
    /// nothing of the rest of the service's figures).
    pub connections: Arc<ConnectionCounts>,
}

impl Metrics {
    /// Counts a booking; `hint_sent` says whether its message went out. Atomics only:
    /// this runs on the booking thread.
    pub fn booked(&self, booking: &Booking, hint_sent: bool) {
        let role = role_index(booking.role);
        self.bookings[role].fetch_add(1, Ordering::Relaxed);
        if hint_sent {
            self.hints_sent[role].fetch_add(1, Ordering::Relaxed);
        }
        if booking.committed_copy.is_some() {
            self.committed_copies.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(skip) = booking.hint_skipped() {
            if let Some(i) = SKIPS.iter().position(|(s, _)| *s == skip) {
                self.hints_skipped[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        for action_type in booking.action_types() {
            self.actions_by_type.add(action_type, 1);
        }
        if booking.dropped_actions > 0 {
            self.actions_dropped
                .fetch_add(booking.dropped_actions as u64, Ordering::Relaxed);
        }
    }

    pub fn error(&self, code: &'static str) {
        self.errors_by_code.add(code, 1);
    }
}

/// [`Metrics`] at scrape time.
pub struct BookingCollector(pub Arc<Metrics>);

/// The router's state, read at scrape time by whoever holds it.
#[derive(Debug, Clone, Default)]
pub struct StateCollector {
    pub expired_bookings: u64,
    pub reloads_ok: u64,
    pub reloads_failed: u64,
    pub generation: u64,
    pub libraries_mapped: usize,
    pub workers: usize,
    pub open_bookings: usize,
    pub index_blocks: usize,
}

super::debug_as_name!(BookingCollector);

impl Collector for BookingCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let m = &*self.0;
        let e = &mut encoder;
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        let per_role = |counts: &[AtomicU64; 3]| {
            ROLES.map(|role| ([("role", role.as_str())], load(&counts[role_index(role)])))
        };
        gauge(
            e,
            "kvhint_connections_open",
            "HTTP connections open now (at most --max-connections).",
            load(&m.connections.open) as f64,
        )?;
        counter(
            e,
            "kvhint_connections",
            "HTTP connections accepted.",
            load(&m.connections.total),
        )?;
        counters(
            e,
            "kvhint_connection_timeouts",
            "HTTP connections closed because the peer ran over a deadline, by phase.",
            Phase::NAMES
                .iter()
                .zip(&m.connections.timeouts)
                .enumerate()
                // The handling phase has no deadline of its own: a body read past
                // its deadline is the API error `body_timeout`.
                .filter(|(i, _)| *i != 2)
                .map(|(_, (phase, n))| ([("phase", *phase)], load(n))),
        )?;
        counters(
            e,
            "kvhint_bookings",
            "Bookings made, by role.",
            per_role(&m.bookings),
        )?;
        counters(
            e,
            "kvhint_hints_sent",
            "Bookings that carried a hint message, by role.",
            per_role(&m.hints_sent),
        )?;
        counter(
            e,
            "kvhint_committed_copies",
            "Bookings committed to a peer's KV copy.",
            load(&m.committed_copies),
        )?;
        counters(
            e,
            "kvhint_hints_skipped",
            "Bookings without a hint message, by reason.",
            SKIPS
                .iter()
                .zip(&m.hints_skipped)
                .map(|((_, reason), n)| ([("reason", *reason)], load(n))),
        )?;
        counters(
            e,
            "kvhint_hint_actions",
            "Actions sent in hint messages, by action type (the first 64 types apart, any more under \"other\").",
            m.actions_by_type
                .counts()
                .into_iter()
                .map(|(kind, n)| ([("action_type", kind)], n)),
        )?;
        counter(
            e,
            "kvhint_hint_actions_dropped",
            "Actions dropped over the per-booking cap of 32.",
            load(&m.actions_dropped),
        )?;
        counters(
            e,
            "kvhint_api_errors",
            "API requests refused, by error code.",
            m.errors_by_code
                .counts()
                .into_iter()
                .map(|(code, n)| ([("error", code)], n)),
        )?;
        counter(
            e,
            "kvhint_kv_events",
            "KV events applied to the index.",
            load(&m.kv_events),
        )
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let state = self;
        let e = &mut encoder;
        counter(
            e,
            "kvhint_bookings_expired",
            "Bookings released by the router after router.booking_ttl without a release.",
            state.expired_bookings,
        )?;
        counters(
            e,
            "kvhint_reloads",
            "Reloads, by result.",
            [
                ([("result", "ok")], state.reloads_ok),
                ([("result", "failed")], state.reloads_failed),
            ],
        )?;
        gauge(
            e,
            "kvhint_snapshot_generation",
            "Generation of the serving snapshot.",
            state.generation as f64,
        )?;
        gauge(
            e,
            "kvhint_plugin_libraries_mapped",
            "Distinct plugin libraries mapped (current and replaced builds; never unloaded).",
            state.libraries_mapped as f64,
        )?;
        gauge(
            e,
            "kvhint_workers",
            "Registered workers.",
            state.workers as f64,
        )?;
        gauge(
            e,
            "kvhint_open_bookings",
            "Bookings not yet released.",
            state.open_bookings as f64,
        )?;
        gauge(
            e,
            "kvhint_kv_index_blocks",
            "(worker, block) entries in the KV index.",
            state.index_blocks as f64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::metrics::encode;
    use prometheus_client::registry::Registry;

    fn rendered(metrics: &Arc<Metrics>, openmetrics: bool) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(BookingCollector(Arc::clone(metrics))));
        encode(&registry, openmetrics).1
    }

    #[test]
    fn the_service_counters_read_as_they_did_before_the_crate_and_as_openmetrics() {
        let metrics = Arc::new(Metrics::default());
        metrics.connections.opened();
        metrics.connections.opened();
        metrics.connections.closed();
        for kind in ["kv.fetch", "kv.prefetch", "kv.fetch", "with \"quote\""] {
            metrics.actions_by_type.add(kind, 1);
        }
        metrics.error("bad_request");
        let text = rendered(&metrics, false);
        for lines in [
            "# HELP kvhint_connections_open HTTP connections open now (at most --max-connections).\n# TYPE kvhint_connections_open gauge\nkvhint_connections_open 1\n",
            "# HELP kvhint_connections_total HTTP connections accepted.\n# TYPE kvhint_connections_total counter\nkvhint_connections_total 2\n",
            "# TYPE kvhint_connection_timeouts_total counter\nkvhint_connection_timeouts_total{phase=\"idle\"} 0\nkvhint_connection_timeouts_total{phase=\"header\"} 0\nkvhint_connection_timeouts_total{phase=\"write\"} 0\n",
            "# TYPE kvhint_bookings_total counter\nkvhint_bookings_total{role=\"aggregated\"} 0\nkvhint_bookings_total{role=\"prefill\"} 0\nkvhint_bookings_total{role=\"decode\"} 0\n",
            "kvhint_hint_actions_total{action_type=\"kv.fetch\"} 2\nkvhint_hint_actions_total{action_type=\"kv.prefetch\"} 1\nkvhint_hint_actions_total{action_type=\"with \\\"quote\\\"\"} 1\n",
            "# TYPE kvhint_api_errors_total counter\nkvhint_api_errors_total{error=\"bad_request\"} 1\n",
        ] {
            assert!(text.contains(lines), "{lines}\nnot in\n{text}");
        }
        assert!(!text.contains("# EOF"));
        let open = rendered(&metrics, true);
        assert!(
            open.contains("# TYPE kvhint_connections counter\nkvhint_connections_total 2\n"),
            "{open}"
        );
        assert!(
            open.contains("\nkvhint_hint_actions_total{action_type=\"kv.fetch\"} 2\n"),
            "{open}"
        );
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

    #[test]
    fn invented_action_types_leave_the_rendered_text_bounded() {
        let metrics = Arc::new(Metrics::default());
        for i in 0..1_000 {
            metrics.actions_by_type.add(&format!("invented.{i}"), 1);
        }
        let text = rendered(&metrics, false);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvhint_hint_actions_total{"))
            .collect();
        assert_eq!(lines.len(), super::super::labels::MAX_LABELS + 1, "{text}");
        assert!(lines.contains(&"kvhint_hint_actions_total{action_type=\"other\"} 936"));
    }
}
