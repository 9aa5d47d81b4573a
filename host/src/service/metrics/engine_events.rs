//! The engine subscriptions' figures ([`SourceStats`]), one sample per source,
//! labelled by worker and rank.

use super::{counters, gauges, WorkerLabels};
use crate::engine_events::stats::{SourceState, SourceStats};
use crate::engine_events::EngineEvents;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub struct SourceCollector(pub Arc<EngineEvents>);

super::debug_as_name!(SourceCollector);

type Counter = fn(&SourceStats) -> &AtomicU64;

/// Name (without `_total`), help, figure.
const COUNTERS: [(&str, &str, Counter); 17] = [
    (
        "kvhint_kv_source_other_topic",
        "Batches on another topic than the source's (ignored).",
        |s| &s.other_topic,
    ),
    (
        "kvhint_kv_source_duplicates",
        "Live batches a replay had already applied.",
        |s| &s.duplicates,
    ),
    (
        "kvhint_kv_source_socket_errors",
        "Failed attempts to create, bind or connect the socket.",
        |s| &s.socket_errors,
    ),
    (
        "kvhint_kv_source_handshake_failures",
        "Peers that accepted a connection but failed the ZMTP handshake: not a ZMQ publisher.",
        |s| &s.handshake_failures,
    ),
    (
        "kvhint_kv_source_reconnects",
        "Times the publisher's connection dropped and came back (the worker is rebuilt).",
        |s| &s.reconnects,
    ),
    (
        "kvhint_kv_source_batches",
        "Event batches received and decoded.",
        |s| &s.batches,
    ),
    (
        "kvhint_kv_source_blocks_stored",
        "Blocks in stored events that counted.",
        |s| &s.blocks_stored,
    ),
    (
        "kvhint_kv_source_decode_errors",
        "Malformed batches skipped (each resynchronises the worker).",
        |s| &s.decode_errors,
    ),
    (
        "kvhint_kv_source_frame_errors",
        "Messages without the [topic, seq, payload] frames.",
        |s| &s.frame_errors,
    ),
    (
        "kvhint_kv_source_gaps",
        "Sequence gaps seen (missed batches).",
        |s| &s.gaps,
    ),
    (
        "kvhint_kv_source_restarts",
        "Publisher restarts seen (sequence back to 0).",
        |s| &s.restarts,
    ),
    (
        "kvhint_kv_source_replays",
        "Replay requests made to the engine's replay socket.",
        |s| &s.replays,
    ),
    (
        "kvhint_kv_source_replay_failures",
        "Replays that failed or timed out.",
        |s| &s.replay_failures,
    ),
    (
        "kvhint_kv_source_resyncs",
        "Times the worker's index entries were cleared to rebuild from new events.",
        |s| &s.resyncs,
    ),
    (
        "kvhint_kv_source_dropped",
        "Batches the ingestion queue could not take (recovered as gaps).",
        |s| &s.dropped,
    ),
    (
        "kvhint_kv_source_unknown_parent",
        "Stored events chaining onto a block the worker never stored.",
        |s| &s.unknown_parent,
    ),
    (
        "kvhint_kv_source_connects",
        "Sockets opened (connect or bind).",
        |s| &s.connects,
    ),
];

/// `type` label value, figure.
const EVENTS: [(&str, Counter); 11] = [
    ("stored", |s| &s.stored),
    ("removed", |s| &s.removed),
    ("cleared", |s| &s.cleared),
    ("unknown_type", |s| &s.unknown_type),
    ("other_medium", |s| &s.other_medium),
    ("other_group", |s| &s.other_group),
    ("wrong_block_size", |s| &s.wrong_block_size),
    ("placeholder", |s| &s.placeholder),
    ("malformed", |s| &s.malformed_events),
    ("unknown_worker", |s| &s.unknown_worker),
    ("refused", |s| &s.refused),
];

impl Collector for SourceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let e = &mut encoder;
        let sources = self.0.sources();
        let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
        for (name, help, counter) in COUNTERS {
            counters(
                e,
                name,
                help,
                sources
                    .iter()
                    .map(|s| (WorkerLabels(s.worker), load(counter(s.stats())))),
            )?;
        }
        counters(
            e,
            "kvhint_kv_source_events",
            "Events by type: applied (stored, removed, cleared) or skipped (unknown_type, other_medium, other_group, wrong_block_size, placeholder, malformed; unknown_worker and refused by the index).",
            sources.iter().flat_map(|s| {
                EVENTS.map(|(kind, counter)| {
                    (
                        (WorkerLabels(s.worker), [("type", kind)]),
                        load(counter(s.stats())),
                    )
                })
            }),
        )?;
        let per_source = |f: fn(&SourceStats) -> f64| {
            sources
                .iter()
                .map(move |s| (WorkerLabels(s.worker), f(s.stats())))
        };
        gauges(
            e,
            "kvhint_kv_source_lag_seconds",
            "Arrival time of the last batch minus the engine's timestamp on it.",
            per_source(|s| s.lag_ms.load(Ordering::Relaxed) as f64 / 1000.0),
        )?;
        gauges(
            e,
            "kvhint_kv_source_last_event_age_seconds",
            "Seconds since the last batch arrived (-1 before the first).",
            per_source(|s| s.age_ms().map_or(-1.0, |ms| ms as f64 / 1000.0)),
        )?;
        gauges(
            e,
            "kvhint_kv_source_state",
            "1 for the state the subscription is in (connecting, live, replaying, stopped, failed: its socket could not be made, bound or connected, and is retried), 0 for the others.",
            sources.iter().flat_map(|s| {
                let now = s.stats().state();
                SourceState::ALL.map(|state| {
                    (
                        (WorkerLabels(s.worker), [("state", state.as_str())]),
                        f64::from(u8::from(state == now)),
                    )
                })
            }),
        )?;
        gauges(
            e,
            "kvhint_kv_source_up",
            "1 while the subscription is live or replaying, 0 while it connects or is stopped.",
            per_source(|s| {
                f64::from(u8::from(matches!(
                    s.state(),
                    SourceState::Live | SourceState::Replaying
                )))
            }),
        )
    }
}
