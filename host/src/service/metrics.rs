//! Counters of the service and their Prometheus text rendering.
//!
//! Everything counted on the booking path is a plain atomic (the per-policy
//! counters and latency histograms live with the policies, in
//! [`crate::hints::PolicyStats`]), so counting never takes a lock a booking
//! could wait on. The text format is rendered here from those atomics; a
//! metrics crate would put a lock (prometheus-client's histogram) or a registry
//! lookup on the hot path.

use crate::config::Role;
use crate::hints::LATENCY_BUCKETS_US;
use crate::router::{Booking, HintSkip};
use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

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

#[derive(Default)]
pub struct Metrics {
    bookings: [AtomicU64; 3],
    hints_sent: [AtomicU64; 3],
    committed_copies: AtomicU64,
    hints_skipped: [AtomicU64; SKIPS.len()],
    actions_dropped: AtomicU64,
    /// Action types are open-ended (unknown types pass through), so a map; a
    /// type seen before costs a read lock and an atomic add.
    actions_by_type: RwLock<HashMap<String, AtomicU64>>,
    /// API errors by error code.
    errors_by_code: RwLock<HashMap<&'static str, AtomicU64>>,
    pub kv_events: AtomicU64,
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    /// Connections closed by a deadline, by phase (`listener::Phase`).
    connection_timeouts: [AtomicU64; 4],
}

fn bump<K: std::hash::Hash + Eq + Clone>(map: &RwLock<HashMap<K, AtomicU64>>, key: &K, by: u64) {
    if let Ok(read) = map.read() {
        if let Some(counter) = read.get(key) {
            counter.fetch_add(by, Ordering::Relaxed);
            return;
        }
    }
    if let Ok(mut write) = map.write() {
        write
            .entry(key.clone())
            .or_default()
            .fetch_add(by, Ordering::Relaxed);
    }
}

fn sorted<K: Ord + Clone + std::hash::Hash + Eq>(
    map: &RwLock<HashMap<K, AtomicU64>>,
) -> Vec<(K, u64)> {
    let mut entries: Vec<(K, u64)> = map
        .read()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.load(Ordering::Relaxed)))
                .collect()
        })
        .unwrap_or_default();
    entries.sort();
    entries
}

/// Writes one metric family: its help, its type, and its samples.
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// Escapes a label value for the text format.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Counts a booking; `hint_sent` says whether its message went out.
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
            bump(&self.actions_by_type, action_type, 1);
        }
        if booking.dropped_actions > 0 {
            self.actions_dropped
                .fetch_add(booking.dropped_actions as u64, Ordering::Relaxed);
        }
    }

    pub fn error(&self, code: &'static str) {
        bump(&self.errors_by_code, &code, 1);
    }

    pub fn connection_opened(&self) {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connection_closed(&self) {
        self.connections_open.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn connection_timed_out(&self, phase: super::listener::Phase) {
        self.connection_timeouts[phase as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of everything the service counts.
    pub fn render(&self, app: &super::App) -> String {
        let mut out = String::new();
        let out = &mut out;
        let per_role = |counters: &[AtomicU64; 3]| -> Vec<(String, f64)> {
            ROLES
                .iter()
                .map(|role| {
                    (
                        format!("{{role=\"{role}\"}}"),
                        counters[role_index(*role)].load(Ordering::Relaxed) as f64,
                    )
                })
                .collect()
        };
        family(
            out,
            "kvhint_connections_open",
            "gauge",
            "HTTP connections open now (at most --max-connections).",
            &[(
                String::new(),
                self.connections_open.load(Ordering::Relaxed) as f64,
            )],
        );
        family(
            out,
            "kvhint_connections_total",
            "counter",
            "HTTP connections accepted.",
            &[(
                String::new(),
                self.connections_total.load(Ordering::Relaxed) as f64,
            )],
        );
        let timeouts: Vec<(String, f64)> = super::listener::Phase::NAMES
            .iter()
            .zip(&self.connection_timeouts)
            // The handling phase has no deadline of its own: a body read past
            // its deadline is the API error `body_timeout`.
            .filter(|(_, n)| !std::ptr::eq(*n, &self.connection_timeouts[2]))
            .map(|(phase, n)| {
                (
                    format!("{{phase=\"{phase}\"}}"),
                    n.load(Ordering::Relaxed) as f64,
                )
            })
            .collect();
        family(
            out,
            "kvhint_connection_timeouts_total",
            "counter",
            "HTTP connections closed because the peer ran over a deadline, by phase.",
            &timeouts,
        );
        family(
            out,
            "kvhint_bookings_expired_total",
            "counter",
            "Bookings released by the router after router.booking_ttl without a release.",
            &[(String::new(), app.router.expired_bookings() as f64)],
        );
        family(
            out,
            "kvhint_bookings_total",
            "counter",
            "Bookings made, by role.",
            &per_role(&self.bookings),
        );
        family(
            out,
            "kvhint_hints_sent_total",
            "counter",
            "Bookings that carried a hint message, by role.",
            &per_role(&self.hints_sent),
        );
        family(
            out,
            "kvhint_committed_copies_total",
            "counter",
            "Bookings committed to a peer's KV copy.",
            &[(
                String::new(),
                self.committed_copies.load(Ordering::Relaxed) as f64,
            )],
        );
        let skipped: Vec<(String, f64)> = SKIPS
            .iter()
            .enumerate()
            .map(|(i, (_, reason))| {
                (
                    format!("{{reason=\"{reason}\"}}"),
                    self.hints_skipped[i].load(Ordering::Relaxed) as f64,
                )
            })
            .collect();
        family(
            out,
            "kvhint_hints_skipped_total",
            "counter",
            "Bookings without a hint message, by reason.",
            &skipped,
        );
        let actions: Vec<(String, f64)> = sorted(&self.actions_by_type)
            .into_iter()
            .map(|(t, v)| (format!("{{action_type=\"{}\"}}", label(&t)), v as f64))
            .collect();
        family(
            out,
            "kvhint_hint_actions_total",
            "counter",
            "Actions sent in hint messages, by action type.",
            &actions,
        );
        family(
            out,
            "kvhint_hint_actions_dropped_total",
            "counter",
            "Actions dropped over the per-booking cap of 32.",
            &[(
                String::new(),
                self.actions_dropped.load(Ordering::Relaxed) as f64,
            )],
        );
        let errors: Vec<(String, f64)> = sorted(&self.errors_by_code)
            .into_iter()
            .map(|(code, v)| (format!("{{error=\"{code}\"}}"), v as f64))
            .collect();
        family(
            out,
            "kvhint_api_errors_total",
            "counter",
            "API requests refused, by error code.",
            &errors,
        );
        family(
            out,
            "kvhint_kv_events_total",
            "counter",
            "KV events applied to the index.",
            &[(String::new(), self.kv_events.load(Ordering::Relaxed) as f64)],
        );

        // Per policy, across reloads.
        let policies = app.reloader.policy_stats.all();
        let policy_family =
            |name: &str, help: &str, get: &dyn Fn(&crate::hints::PolicyStats) -> u64| {
                let samples: Vec<(String, f64)> = policies
                    .iter()
                    .map(|((role, policy), stats)| {
                        (
                            format!("{{role=\"{}\",policy=\"{}\"}}", label(role), label(policy)),
                            get(stats) as f64,
                        )
                    })
                    .collect();
                (name.to_string(), help.to_string(), samples)
            };
        for (name, help, samples) in [
            policy_family(
                "kvhint_policy_calls_total",
                "Calls of a hint policy.",
                &|s| s.calls.get(),
            ),
            policy_family(
                "kvhint_policy_failures_total",
                "Calls that lost their actions (error, panic or malformed action).",
                &|s| s.failures.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_errors_total",
                "Calls that returned an error.",
                &|s| s.errors.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_actions_total",
                "Actions a policy returned (before the per-booking cap).",
                &|s| s.actions.get(),
            ),
            policy_family(
                "kvhint_policy_panics_total",
                "Calls that panicked (caught in the plugin).",
                &|s| s.panics.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_malformed_total",
                "Calls that returned a malformed action.",
                &|s| s.malformed.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_quarantines_total",
                "Times a policy was quarantined until the next reload.",
                &|s| s.quarantines.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_over_budget_total",
                "Calls that took longer than router.policy_budget_us.",
                &|s| s.over_budget.load(Ordering::Relaxed),
            ),
            policy_family(
                "kvhint_policy_skipped_quarantined_total",
                "Calls skipped because the policy was quarantined.",
                &|s| s.skipped_quarantined.load(Ordering::Relaxed),
            ),
        ] {
            family(out, &name, "counter", &help, &samples);
        }
        let _ = writeln!(
            out,
            "# HELP kvhint_policy_latency_seconds Time inside a hint policy's build_hints.\n# TYPE kvhint_policy_latency_seconds histogram"
        );
        for ((role, policy), stats) in &policies {
            let labels = format!("role=\"{}\",policy=\"{}\"", label(role), label(policy));
            let cumulative = stats.latency.cumulative();
            for (i, count) in cumulative.iter().enumerate() {
                let le = LATENCY_BUCKETS_US
                    .get(i)
                    .map(|us| format!("{}", us / 1e6))
                    .unwrap_or_else(|| "+Inf".to_string());
                let _ = writeln!(
                    out,
                    "kvhint_policy_latency_seconds_bucket{{{labels},le=\"{le}\"}} {count}"
                );
            }
            let _ = writeln!(
                out,
                "kvhint_policy_latency_seconds_sum{{{labels}}} {}",
                stats.latency.sum_seconds()
            );
            let _ = writeln!(
                out,
                "kvhint_policy_latency_seconds_count{{{labels}}} {}",
                cumulative.last().copied().unwrap_or(0)
            );
        }

        // Per role's selection policy, across reloads.
        let selections = app.reloader.policy_stats.all_selection();
        let labels_of = |role: &str, policy: &str| {
            format!("role=\"{}\",policy=\"{}\"", label(role), label(policy))
        };
        family(
            out,
            "kvhint_selection_calls_total",
            "counter",
            "Calls of a role's selection policy.",
            &selections
                .iter()
                .map(|((role, policy), stats)| {
                    (
                        format!("{{{}}}", labels_of(role, policy)),
                        stats.calls.get() as f64,
                    )
                })
                .collect::<Vec<_>>(),
        );
        family(
            out,
            "kvhint_selection_fallbacks_total",
            "counter",
            "Bookings the built-in default selection placed because the role's selection policy failed or is quarantined, by reason (error, panic, out_of_range, quarantined).",
            &selections
                .iter()
                .flat_map(|((role, policy), stats)| {
                    crate::selection::FallbackReason::ALL.map(|reason| {
                        (
                            format!(
                                "{{{},reason=\"{}\"}}",
                                labels_of(role, policy),
                                reason.as_str()
                            ),
                            stats.fallbacks(reason) as f64,
                        )
                    })
                })
                .collect::<Vec<_>>(),
        );
        for (name, help, get) in [
            (
                "kvhint_selection_over_budget_total",
                "Calls of a role's selection policy that took longer than router.policy_budget_us.",
                (|s: &crate::selection::SelectionStats| s.over_budget.load(Ordering::Relaxed))
                    as fn(&crate::selection::SelectionStats) -> u64,
            ),
            (
                "kvhint_selection_quarantines_total",
                "Times a role's selection policy was quarantined until the next reload.",
                |s: &crate::selection::SelectionStats| s.quarantines.load(Ordering::Relaxed),
            ),
        ] {
            family(
                out,
                name,
                "counter",
                help,
                &selections
                    .iter()
                    .map(|((role, policy), stats)| {
                        (
                            format!("{{{}}}", labels_of(role, policy)),
                            get(stats) as f64,
                        )
                    })
                    .collect::<Vec<_>>(),
            );
        }
        family(
            out,
            "kvhint_selection_latency_seconds_sum",
            "counter",
            "Total time inside a role's selection policy.",
            &selections
                .iter()
                .map(|((role, policy), stats)| {
                    (
                        format!("{{{}}}", labels_of(role, policy)),
                        stats.latency.sum_seconds(),
                    )
                })
                .collect::<Vec<_>>(),
        );

        let status = app.reloader.status();
        let snapshot = app.snapshot.load();
        family(
            out,
            "kvhint_reloads_total",
            "counter",
            "Reloads, by result.",
            &[
                ("{result=\"ok\"}".to_string(), status.ok as f64),
                ("{result=\"failed\"}".to_string(), status.failed as f64),
            ],
        );
        family(
            out,
            "kvhint_snapshot_generation",
            "gauge",
            "Generation of the serving snapshot.",
            &[(String::new(), snapshot.generation as f64)],
        );
        family(
            out,
            "kvhint_plugin_libraries_mapped",
            "gauge",
            "Distinct plugin libraries mapped (current and replaced builds; never unloaded).",
            &[(String::new(), app.reloader.loader.libraries_mapped() as f64)],
        );
        family(
            out,
            "kvhint_workers",
            "gauge",
            "Registered workers.",
            &[(String::new(), app.router.workers().len() as f64)],
        );
        family(
            out,
            "kvhint_open_bookings",
            "gauge",
            "Bookings not yet released.",
            &[(String::new(), app.router.open_bookings() as f64)],
        );
        family(
            out,
            "kvhint_kv_index_blocks",
            "gauge",
            "(worker, block) entries in the KV index.",
            &[(String::new(), app.router.index_len() as f64)],
        );
        kv_event_sources(out, &app.engine_events.sources());
        gateway(out, app);
        std::mem::take(out)
    }
}

/// Per-source families of the engine subscriptions, labelled by worker and rank.
fn kv_event_sources(out: &mut String, sources: &[crate::engine_events::SourceView]) {
    use crate::engine_events::stats::SourceStats;
    let labels = |s: &crate::engine_events::SourceView| {
        format!(
            "worker_id=\"{}\",dp_rank=\"{}\"",
            s.worker.worker_id, s.worker.dp_rank
        )
    };
    type Counter = fn(&SourceStats) -> &AtomicU64;
    let counters: [(&str, &str, Counter); 16] = [
        (
            "kvhint_kv_source_other_topic_total",
            "Batches on another topic than the source's (ignored).",
            |s| &s.other_topic,
        ),
        (
            "kvhint_kv_source_duplicates_total",
            "Live batches a replay had already applied.",
            |s| &s.duplicates,
        ),
        (
            "kvhint_kv_source_socket_errors_total",
            "Failed attempts to create, bind or connect the socket.",
            |s| &s.socket_errors,
        ),
        (
            "kvhint_kv_source_reconnects_total",
            "Times the publisher's connection dropped and came back (the worker is rebuilt).",
            |s| &s.reconnects,
        ),
        (
            "kvhint_kv_source_batches_total",
            "Event batches received and decoded.",
            |s| &s.batches,
        ),
        (
            "kvhint_kv_source_blocks_stored_total",
            "Blocks in stored events that counted.",
            |s| &s.blocks_stored,
        ),
        (
            "kvhint_kv_source_decode_errors_total",
            "Malformed batches skipped (each resynchronises the worker).",
            |s| &s.decode_errors,
        ),
        (
            "kvhint_kv_source_frame_errors_total",
            "Messages without the [topic, seq, payload] frames.",
            |s| &s.frame_errors,
        ),
        (
            "kvhint_kv_source_gaps_total",
            "Sequence gaps seen (missed batches).",
            |s| &s.gaps,
        ),
        (
            "kvhint_kv_source_restarts_total",
            "Publisher restarts seen (sequence back to 0).",
            |s| &s.restarts,
        ),
        (
            "kvhint_kv_source_replays_total",
            "Replay requests made to the engine's replay socket.",
            |s| &s.replays,
        ),
        (
            "kvhint_kv_source_replay_failures_total",
            "Replays that failed or timed out.",
            |s| &s.replay_failures,
        ),
        (
            "kvhint_kv_source_resyncs_total",
            "Times the worker's index entries were cleared to rebuild from new events.",
            |s| &s.resyncs,
        ),
        (
            "kvhint_kv_source_dropped_total",
            "Batches the ingestion queue could not take (recovered as gaps).",
            |s| &s.dropped,
        ),
        (
            "kvhint_kv_source_unknown_parent_total",
            "Stored events chaining onto a block the worker never stored.",
            |s| &s.unknown_parent,
        ),
        (
            "kvhint_kv_source_connects_total",
            "Sockets opened (connect or bind).",
            |s| &s.connects,
        ),
    ];
    for (name, help, counter) in counters {
        let samples: Vec<(String, f64)> = sources
            .iter()
            .map(|s| {
                (
                    format!("{{{}}}", labels(s)),
                    counter(s.stats()).load(Ordering::Relaxed) as f64,
                )
            })
            .collect();
        family(out, name, "counter", help, &samples);
    }
    let mut events = Vec::new();
    for s in sources {
        let stats = s.stats();
        for (kind, counter) in [
            ("stored", &stats.stored),
            ("removed", &stats.removed),
            ("cleared", &stats.cleared),
            ("unknown_type", &stats.unknown_type),
            ("other_medium", &stats.other_medium),
            ("other_group", &stats.other_group),
            ("wrong_block_size", &stats.wrong_block_size),
            ("placeholder", &stats.placeholder),
            ("malformed", &stats.malformed_events),
            ("unknown_worker", &stats.unknown_worker),
            ("refused", &stats.refused),
        ] {
            events.push((
                format!("{{{},type=\"{kind}\"}}", labels(s)),
                counter.load(Ordering::Relaxed) as f64,
            ));
        }
    }
    family(
        out,
        "kvhint_kv_source_events_total",
        "counter",
        "Events by type: applied (stored, removed, cleared) or skipped (unknown_type, other_medium, other_group, wrong_block_size, placeholder, malformed; unknown_worker and refused by the index).",
        &events,
    );
    let gauge = |f: &dyn Fn(&SourceStats) -> f64| -> Vec<(String, f64)> {
        sources
            .iter()
            .map(|s| (format!("{{{}}}", labels(s)), f(s.stats())))
            .collect()
    };
    family(
        out,
        "kvhint_kv_source_lag_seconds",
        "gauge",
        "Arrival time of the last batch minus the engine's timestamp on it.",
        &gauge(&|s| s.lag_ms.load(Ordering::Relaxed) as f64 / 1000.0),
    );
    family(
        out,
        "kvhint_kv_source_last_event_age_seconds",
        "gauge",
        "Seconds since the last batch arrived (-1 before the first).",
        &gauge(&|s| s.age_ms().map_or(-1.0, |ms| ms as f64 / 1000.0)),
    );
    family(
        out,
        "kvhint_kv_source_up",
        "gauge",
        "1 while the subscription is live or replaying, 0 while it connects or is stopped.",
        &gauge(&|s| {
            use crate::engine_events::stats::SourceState;
            f64::from(u8::from(matches!(
                s.state(),
                SourceState::Live | SourceState::Replaying
            )))
        }),
    );
}

/// The front door's figures (see `gateway::stats`).
fn gateway(out: &mut String, app: &super::App) {
    use crate::gateway::stats::BUCKETS;
    let stats = &app.gateway.stats;
    family(
        out,
        "kvhint_gateway_releases_total",
        "counter",
        "Bookings the gateway released, by what ended the request.",
        &stats
            .releases()
            .iter()
            .map(|(reason, n)| (format!("{{reason=\"{}\"}}", reason.as_str()), *n as f64))
            .collect::<Vec<_>>(),
    );
    family(
        out,
        "kvhint_gateway_retries_total",
        "counter",
        "Requests booked again on another worker before any byte reached the client.",
        &[(String::new(), stats.retries.load(Ordering::Relaxed) as f64)],
    );
    family(
        out,
        "kvhint_hints_delivered_total",
        "counter",
        "Hint messages forwarded in the engine's own field.",
        &[(
            String::new(),
            stats.hints_delivered.load(Ordering::Relaxed) as f64,
        )],
    );
    family(
        out,
        "kvhint_hints_undeliverable_total",
        "counter",
        "Hint messages not sent because the booked engine takes none on that route.",
        &stats
            .undeliverable_counts()
            .iter()
            .map(|(engine, n)| (format!("{{engine=\"{engine}\"}}"), *n as f64))
            .collect::<Vec<_>>(),
    );
    family(
        out,
        "kvhint_gateway_refused_total",
        "counter",
        "Requests the router answered itself, by status (no worker answered them).",
        &stats
            .refused_counts()
            .iter()
            .map(|(status, n)| (format!("{{status=\"{status}\"}}"), *n as f64))
            .collect::<Vec<_>>(),
    );
    let timings = stats.timings();
    let mut statuses = Vec::new();
    for ((model, worker), t) in &timings {
        for (status, n) in &t.statuses {
            statuses.push((
                format!(
                    "{{model=\"{}\",worker_id=\"{}\",dp_rank=\"{}\",status=\"{status}\"}}",
                    label(model),
                    worker.worker_id,
                    worker.dp_rank
                ),
                *n as f64,
            ));
        }
    }
    family(
        out,
        "kvhint_gateway_upstream_responses_total",
        "counter",
        "Response heads from workers, by model, worker and status.",
        &statuses,
    );
    type Pick = fn(&crate::gateway::stats::Timings) -> &crate::gateway::stats::Histogram;
    let histograms: [(&str, &str, Pick); 4] = [
        (
            "kvhint_gateway_ttfb_seconds",
            "Request received to the worker's response head.",
            |t| &t.ttfb,
        ),
        (
            "kvhint_gateway_duration_seconds",
            "Request received to the response's end.",
            |t| &t.duration,
        ),
        (
            "kvhint_gateway_overhead_seconds",
            "Request received to the request sent to the worker (tokenization included).",
            |t| &t.overhead,
        ),
        (
            "kvhint_gateway_tokenize_seconds",
            "Rendering and tokenizing the prompt.",
            |t| &t.tokenize,
        ),
    ];
    for (name, help, pick) in histograms {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for ((model, worker), t) in &timings {
            let h = pick(t);
            let labels = format!(
                "model=\"{}\",worker_id=\"{}\",dp_rank=\"{}\"",
                label(model),
                worker.worker_id,
                worker.dp_rank
            );
            for (bound, count) in BUCKETS.iter().zip(h.buckets.iter()) {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {count}");
            }
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
        }
    }
    tokenizer_cache(out, &app.snapshot.load().models);
    replication(out, app);
    let mut health = Vec::new();
    for (worker, _) in app.router.workers() {
        if worker.http.is_none() {
            continue;
        }
        let up = app.gateway.health.looks_up(worker.key);
        health.push((
            format!(
                "{{worker_id=\"{}\",dp_rank=\"{}\"}}",
                worker.key.worker_id, worker.key.dp_rank
            ),
            if up { 1.0 } else { 0.0 },
        ));
    }
    family(
        out,
        "kvhint_gateway_worker_up",
        "gauge",
        "1 if the gateway sends requests to the worker now (healthy, circuit not open).",
        &health,
    );
}

/// Each model's cache of tokenized prompt pieces: what it found and what it had to
/// encode (pieces and bytes of text), and what it holds. A model whose tokenizer
/// cannot be cut into pieces exactly has none, and no samples here.
fn tokenizer_cache(out: &mut String, models: &crate::models::Models) {
    let (mut pieces, mut bytes, mut entries, mut held) = (vec![], vec![], vec![], vec![]);
    for name in models.names() {
        let Some(model) = models.get(name) else {
            continue;
        };
        let Ok((stats, n, weight)) = model.tokenizer.piece_cache() else {
            continue;
        };
        let model = label(name);
        for (result, count, size) in [
            ("hit", stats.hits, stats.hit_bytes),
            ("miss", stats.misses, stats.miss_bytes),
        ] {
            let labels = format!("{{model=\"{model}\",result=\"{result}\"}}");
            pieces.push((labels.clone(), count as f64));
            bytes.push((labels, size as f64));
        }
        entries.push((format!("{{model=\"{model}\"}}"), n as f64));
        held.push((format!("{{model=\"{model}\"}}"), weight as f64));
    }
    family(
        out,
        "kvhint_tokenizer_cache_pieces_total",
        "counter",
        "Prompt pieces (text between special tokens) found in the tokenizer cache (hit) or encoded (miss).",
        &pieces,
    );
    family(
        out,
        "kvhint_tokenizer_cache_text_bytes_total",
        "counter",
        "Bytes of prompt text whose ids came from the tokenizer cache (hit) or were encoded (miss).",
        &bytes,
    );
    family(
        out,
        "kvhint_tokenizer_cache_entries",
        "gauge",
        "Pieces the tokenizer cache holds.",
        &entries,
    );
    family(
        out,
        "kvhint_tokenizer_cache_bytes",
        "gauge",
        "What the tokenizer cache holds, in bytes (gateway.tokenizer_cache_mib bounds it).",
        &held,
    );
}

/// Replication (`replication:`): propagation lag of the peers' load, corrections the
/// digests made (0 in steady state: each is a lost message), peers dropped, and
/// messages refused. No samples without replication.
fn replication(out: &mut String, app: &super::App) {
    let Some(replication) = app.replication.get() else {
        return;
    };
    let counters = replication.counters();
    let view = replication.view();
    let name = "kvhint_replication_propagation_lag_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} A peer's load change seen there to applied here (deltas; clocks of both hosts).\n# TYPE {name} histogram"
    );
    let mut cumulative = 0;
    for (bound, count) in crate::replication::LAG_BUCKETS_US
        .iter()
        .zip(counters.lag_buckets.iter())
    {
        cumulative += count.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"{}\"}} {cumulative}",
            *bound as f64 / 1e6
        );
    }
    let count = counters.lag_count.load(Ordering::Relaxed);
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(
        out,
        "{name}_sum {}",
        counters.lag_sum_us.load(Ordering::Relaxed) as f64 / 1e6
    );
    let _ = writeln!(out, "{name}_count {count}");
    family(
        out,
        "kvhint_replication_digest_corrections_total",
        "counter",
        "Worker totals a peer's digest corrected (a message was lost; 0 in steady state).",
        &[(String::new(), view.stats.corrections as f64)],
    );
    family(
        out,
        "kvhint_replication_peers_dropped_total",
        "counter",
        "Peers removed from the sums: silent past replication.peer_timeout_ms, said goodbye, or replaced by a restart under the same name.",
        &[
            ("{reason=\"silent\"}".to_string(), view.stats.dropped_silent as f64),
            ("{reason=\"goodbye\"}".to_string(), view.stats.left as f64),
            ("{reason=\"restarted\"}".to_string(), view.stats.replaced as f64),
        ],
    );
    family(
        out,
        "kvhint_replication_refused_total",
        "counter",
        "Peer messages ignored because the peer uses another block size.",
        &[(String::new(), view.stats.refused_block_size as f64)],
    );
    family(
        out,
        "kvhint_replication_config_mismatches_total",
        "counter",
        "Peers heard with another config or plugin set (their load is summed; warned).",
        &[(String::new(), view.stats.fingerprint_mismatches as f64)],
    );
    family(
        out,
        "kvhint_replication_peers",
        "gauge",
        "Peers whose load is summed now.",
        &[(String::new(), view.peers.len() as f64)],
    );
    family(
        out,
        "kvhint_replication_connected",
        "gauge",
        "1 while connected to NATS.",
        &[(String::new(), f64::from(u8::from(replication.connected())))],
    );
    family(
        out,
        "kvhint_replication_messages_total",
        "counter",
        "Messages published and received on the fleet's subject, and publishes dropped while NATS was away.",
        &[
            ("{direction=\"published\"}".to_string(), counters.published.load(Ordering::Relaxed) as f64),
            ("{direction=\"received\"}".to_string(), counters.received.load(Ordering::Relaxed) as f64),
            ("{direction=\"publish_failed\"}".to_string(), counters.publish_failures.load(Ordering::Relaxed) as f64),
        ],
    );
    family(
        out,
        "kvhint_replication_disconnects_total",
        "counter",
        "Times the connection to NATS was lost.",
        &[(
            String::new(),
            counters.disconnects.load(Ordering::Relaxed) as f64,
        )],
    );
}
