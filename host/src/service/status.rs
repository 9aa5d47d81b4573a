//! `GET /admin/status`: what the router is running, as typed records.
//!
//! Each record names every field an operator's tooling reads, so a field is
//! renamed or dropped only by changing a type here (docs/api.md describes them),
//! not by editing a JSON literal in a handler. The records borrow from the
//! snapshot and the router for the one request that serializes them.

use super::App;
use crate::domain::{Role, WorkerKey};
use crate::engine_events::stats::NO_SEQ;
use crate::gateway::health::HealthView;
use crate::replication::merge::PeerStatus;
use crate::replication::StatsView;
use crate::router::workers::Load;
use crate::selection::FallbackReason;
use crate::service::reload::ReloadStatus;
use crate::snapshot::{HintsFrom, PluginSummary};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

#[derive(Serialize)]
pub struct Status<'a> {
    pub generation: u64,
    pub config_file: &'a Path,
    pub router_mode: &'static str,
    pub block_size: usize,
    pub plugins: &'a [PluginSummary],
    pub roles: Vec<RoleStatus<'a>>,
    pub libraries_mapped: usize,
    pub reloads: ReloadStatus,
    pub workers: Vec<WorkerStatus>,
    pub models: Vec<ModelStatus<'a>>,
    pub open_bookings: usize,
    pub expired_bookings: u64,
    pub booking_ttl_s: u64,
    /// Whether the API asks callers for tokens.
    pub auth: bool,
    pub kv_event_sources: Vec<SourceStatus>,
    pub kv_events_thread_policy: &'static str,
    pub thread_policy_refusals: u64,
    /// `null` unless `replication:` is configured.
    pub replication: Option<ReplicationStatus<'a>>,
}

/// Load shared with other replicas: the peers, the age of each one's last
/// message, and the checksum of the summed view (equal on replicas that agree).
#[derive(Serialize)]
pub struct ReplicationStatus<'a> {
    pub name: &'a str,
    pub fleet: &'a str,
    pub incarnation: u64,
    pub connected: bool,
    pub ready: bool,
    pub peers: Vec<PeerStatus>,
    pub refused: Vec<RefusedPeer>,
    pub checksum: String,
    pub stats: StatsView,
}

/// A peer whose messages are ignored.
#[derive(Serialize)]
pub struct RefusedPeer {
    pub name: String,
    pub block_size: u64,
    pub reason: &'static str,
}

/// A served model: which library encodes its prompts (`tokenizers 1.0.0-rc.3`
/// where it passed its self-test at load, else `tokenizers 0.23.2`) and, when
/// it is 0.23, why; and the content format its chat template gets (`string`
/// or `openai`), `detected` from the template or `configured`.
#[derive(Serialize)]
pub struct ModelStatus<'a> {
    pub name: &'a str,
    pub encoder: &'static str,
    pub encoder_fallback: Option<&'a str>,
    pub content_format: &'static str,
    pub content_format_origin: &'static str,
}

/// A role: its selection policy, as configured and as it books, and its hints.
#[derive(Serialize)]
pub struct RoleStatus<'a> {
    pub role: Role,
    pub selection: &'a str,
    pub booked_by: &'a str,
    pub selection_origin: String,
    pub selection_quarantined: bool,
    pub selection_quarantine_reason: Option<&'static str>,
    /// Bookings the built-in fallback placed, by why.
    pub selection_fallbacks: BTreeMap<&'static str, u64>,
    pub parameters: &'a serde_json::Value,
    pub commits_kv_copies: bool,
    pub hints_from: HintsFrom,
    pub hints: Vec<HintStatus<'a>>,
}

/// A hint policy of a role, in the order it runs.
#[derive(Serialize)]
pub struct HintStatus<'a> {
    pub name: &'a str,
    #[serde(rename = "type")]
    pub type_name: &'a str,
    pub origin: String,
    pub commitments: String,
    pub quarantined: bool,
    pub quarantine_reason: Option<&'static str>,
}

/// A registered worker with its load, where the gateway reaches it, and its health.
#[derive(Serialize)]
pub struct WorkerStatus {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub role: Role,
    pub router_hint: bool,
    pub load: Load,
    pub http_endpoint: Option<String>,
    pub engine: Option<&'static str>,
    pub models: Option<Vec<String>>,
    /// `events` (the engine publishes KV events) or `approximate`.
    pub kv_events: &'static str,
    pub approximate_blocks: Option<usize>,
    /// The most blocks an approximate worker is credited with, and whether that
    /// cap was learned from the engine's answers (see `docs/gateway.md`).
    pub approximate_capacity_blocks: Option<u64>,
    pub approximate_capacity_learned: Option<bool>,
    /// An event-fed worker's KV capacity as bookings anticipate evictions with
    /// it (`None`: unknown, or `gateway.anticipate_evictions` off), and the
    /// distinct blocks its running requests pin (`gateway.credit_in_flight`).
    pub kv_capacity_blocks: Option<u32>,
    pub pinned_blocks: Option<u32>,
    pub health: Option<HealthView>,
}

/// An engine's KV-event subscription: where, its state, and how far it got.
#[derive(Serialize)]
pub struct SourceStatus {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub origin: &'static str,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// `bind` or `connect`.
    pub mode: &'static str,
    pub state: &'static str,
    pub last_error: Option<String>,
    /// Failed attempts to create, bind or connect the socket (each retried).
    pub socket_errors: u64,
    /// Peers that accepted but failed the ZMTP handshake (not a publisher).
    pub handshake_failures: u64,
    pub last_seq: Option<u64>,
    pub last_event_age_ms: Option<u64>,
    pub lag_ms: u64,
    pub batches: u64,
    pub gaps: u64,
    pub replays: u64,
    pub resyncs: u64,
    pub restarts: u64,
    pub reconnects: u64,
    pub decode_errors: u64,
    pub unknown_parent: u64,
    pub dropped: u64,
    /// How the engine writes block hashes: `signed`, `digest` or `unsigned`.
    pub hashes: &'static str,
}

pub async fn status(State(app): State<Arc<App>>) -> Response {
    let snapshot = app.snapshot.load_full();
    let roles = snapshot
        .roles
        .iter()
        .map(|role| {
            let selection = role.booking_selection();
            RoleStatus {
                role: role.role,
                selection: &role.selection_type,
                booked_by: &role.booking_selection_type,
                selection_origin: selection.origin.to_string(),
                selection_quarantined: selection.is_quarantined(),
                selection_quarantine_reason: selection.quarantine().map(|q| q.as_str()),
                selection_fallbacks: FallbackReason::ALL
                    .iter()
                    .map(|r| (r.as_str(), selection.stats.fallbacks(*r)))
                    .collect(),
                parameters: &role.selection_parameters,
                commits_kv_copies: role.commits_kv_copies,
                hints_from: role.hints_from,
                hints: role
                    .hints
                    .policies()
                    .iter()
                    .map(|p| HintStatus {
                        name: &p.name,
                        type_name: &p.type_name,
                        origin: p.origin.to_string(),
                        commitments: p.commitments.to_string(),
                        quarantined: p.is_quarantined(),
                        quarantine_reason: p.quarantine().map(|q| q.as_str()),
                    })
                    .collect(),
            }
        })
        .collect();
    let workers = app
        .router
        .workers()
        .iter()
        .map(|(worker, load)| {
            let residency = (!worker.approximate_kv)
                .then(|| app.router.load_cell(worker.key).map(|c| c.residency()))
                .flatten();
            WorkerStatus {
                worker_id: worker.key.worker_id,
                dp_rank: worker.key.dp_rank,
                role: worker.role,
                router_hint: worker.router_hint,
                load: *load,
                http_endpoint: worker.http.as_ref().map(|h| h.base.to_string()),
                engine: worker.http.as_ref().map(|h| h.engine.as_str()),
                models: worker
                    .http
                    .as_ref()
                    .map(|h| h.models.iter().map(|m| m.to_string()).collect()),
                kv_events: if worker.approximate_kv {
                    "approximate"
                } else {
                    "events"
                },
                approximate_blocks: worker
                    .approximate_kv
                    .then(|| app.gateway.approximate.blocks(worker.key)),
                approximate_capacity_blocks: worker.approximate_kv.then(|| {
                    app.gateway
                        .approximate
                        .cap(worker.key, snapshot.gateway.approximate_max_blocks)
                        .0
                }),
                approximate_capacity_learned: worker.approximate_kv.then(|| {
                    app.gateway
                        .approximate
                        .cap(worker.key, snapshot.gateway.approximate_max_blocks)
                        .1
                }),
                kv_capacity_blocks: residency
                    .map(|r| r.capacity_blocks)
                    .filter(|blocks| *blocks > 0),
                pinned_blocks: residency.map(|r| r.pinned_blocks),
                health: app.gateway.health.view(worker.key),
            }
        })
        .collect();
    let models = snapshot
        .models
        .names()
        .iter()
        .filter_map(|name| snapshot.models.get(name))
        .map(|model| {
            let (encoder, encoder_fallback) = model.tokenizer.encoder();
            let (format, origin) = model.tokenizer.content_format();
            ModelStatus {
                name: &model.name,
                encoder,
                encoder_fallback,
                content_format: format.as_str(),
                content_format_origin: origin,
            }
        })
        .collect();
    Json(Status {
        generation: snapshot.generation,
        config_file: &snapshot.config_file,
        router_mode: snapshot.mode.as_str(),
        block_size: snapshot.block_size,
        plugins: &snapshot.plugins,
        roles,
        libraries_mapped: app.reloader.loader.libraries_mapped(),
        reloads: app.reloader.status(),
        workers,
        models,
        open_bookings: app.router.open_bookings(),
        expired_bookings: app.router.expired_bookings(),
        booking_ttl_s: snapshot.booking_ttl_s,
        auth: snapshot.tokens.is_some(),
        kv_event_sources: kv_event_sources(&app),
        kv_events_thread_policy: app.ingest.scheduling().get().as_str(),
        thread_policy_refusals: app.ingest.scheduling().refusals(),
        replication: app.replication.get().map(|replication| {
            let view = replication.view();
            ReplicationStatus {
                name: replication.name(),
                fleet: replication.fleet(),
                incarnation: replication.incarnation(),
                connected: replication.connected(),
                ready: view.ready,
                peers: view.peers,
                refused: view
                    .refused
                    .into_iter()
                    .map(|(name, block_size)| RefusedPeer {
                        name,
                        block_size,
                        reason: "another block size",
                    })
                    .collect(),
                checksum: crate::replication::checksum(&app.router),
                stats: view.stats,
            }
        }),
    })
    .into_response()
}

fn kv_event_sources(app: &App) -> Vec<SourceStatus> {
    app.engine_events
        .sources()
        .iter()
        .map(|source| {
            let stats = source.stats();
            let last_seq = stats.last_seq.load(Ordering::Relaxed);
            let key: WorkerKey = source.worker;
            SourceStatus {
                worker_id: key.worker_id,
                dp_rank: key.dp_rank,
                origin: source.origin.as_str(),
                endpoint: source.endpoints.events.clone(),
                replay_endpoint: source.endpoints.replay.clone(),
                topic: source.endpoints.topic.clone(),
                mode: if source.endpoints.bind {
                    "bind"
                } else {
                    "connect"
                },
                state: stats.state().as_str(),
                last_error: stats.last_error(),
                socket_errors: stats.socket_errors.load(Ordering::Relaxed),
                handshake_failures: stats.handshake_failures.load(Ordering::Relaxed),
                last_seq: (last_seq != NO_SEQ).then_some(last_seq),
                last_event_age_ms: stats.age_ms(),
                lag_ms: stats.lag_ms.load(Ordering::Relaxed),
                batches: stats.batches.load(Ordering::Relaxed),
                gaps: stats.gaps.load(Ordering::Relaxed),
                replays: stats.replays.load(Ordering::Relaxed),
                resyncs: stats.resyncs.load(Ordering::Relaxed),
                restarts: stats.restarts.load(Ordering::Relaxed),
                reconnects: stats.reconnects.load(Ordering::Relaxed),
                decode_errors: stats.decode_errors.load(Ordering::Relaxed),
                unknown_parent: stats.unknown_parent.load(Ordering::Relaxed),
                dropped: stats.dropped.load(Ordering::Relaxed),
                hashes: if stats.signed_hashes.load(Ordering::Relaxed) {
                    "signed"
                } else if stats.digest_hashes.load(Ordering::Relaxed) {
                    "digest"
                } else {
                    "unsigned"
                },
            }
        })
        .collect()
}
