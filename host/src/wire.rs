//! The JSON shapes requests and results take, shared by the HTTP service and
//! the replay trace so the two stay the same language.

use crate::domain::{Role, WorkerKey};
use crate::hints::{FailureKind, PolicyFailure};
use crate::router::index::KvEvent;
use crate::router::workers::WorkerRegistration;
use crate::router::{BookRequest, Booking, HintSkip};
use crate::selection::FALLBACK_TYPE;
use crate::snapshot::RoleRuntime;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerRef {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
}

impl WorkerRef {
    pub fn key(&self) -> WorkerKey {
        WorkerKey {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KvEventBody {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
    pub event: KvEvent,
}

impl KvEventBody {
    pub fn key(&self) -> WorkerKey {
        WorkerKey {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
        }
    }
}

/// A request to book. There is deliberately no field for hints: only the
/// router attaches them.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BookBody {
    pub request_id: String,
    pub role: Role,
    pub token_ids: Vec<u32>,
    #[serde(default)]
    pub session_context: Option<serde_json::Map<String, serde_json::Value>>,
    /// The LoRA adapter the request runs under, as the engine's events name it.
    #[serde(default)]
    pub lora_name: Option<String>,
    /// The request's cache salt (vLLM's and SGLang's `cache_salt`).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

impl BookBody {
    /// The session context as JSON text, for the hint context.
    pub fn session_text(&self) -> Option<String> {
        self.session_context
            .as_ref()
            .map(|map| serde_json::Value::Object(map.clone()).to_string())
    }

    pub fn request<'a>(&'a self, session: Option<&'a str>) -> BookRequest<'a> {
        BookRequest {
            request_id: &self.request_id,
            role: self.role,
            token_ids: &self.token_ids,
            session_context: session,
            lora_name: self.lora_name.as_deref(),
            cache_salt: self.cache_salt.as_deref(),
            pinned_prefix: &[],
            receive_from: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    pub request_id: String,
}

/// One line of a replay trace.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TraceRecord {
    Worker(WorkerRegistration),
    Deregister(WorkerRef),
    KvEvent(KvEventBody),
    Request(BookBody),
    Release(ReleaseBody),
}

#[derive(Debug, Serialize)]
pub struct CopyView {
    pub source_worker_id: u64,
    pub source_dp_rank: u32,
    pub first_block: usize,
    pub last_block: usize,
}

#[derive(Debug, Serialize)]
pub struct FailureView<'a> {
    pub policy: &'a str,
    pub kind: &'static str,
    pub message: &'a str,
}

pub fn failure_kind(kind: FailureKind) -> &'static str {
    match kind {
        FailureKind::Error => "error",
        FailureKind::Panic => "panic",
        FailureKind::Malformed => "malformed",
    }
}

/// The selection-policy type that placed `booking`, booked on `role`: the role's
/// own, or the built-in default it fell back to (`selection_fallback`).
pub fn selection_policy<'a>(role: &'a RoleRuntime, booking: &Booking) -> &'a str {
    if booking.selection_fallback.is_some() {
        FALLBACK_TYPE
    } else {
        &role.booking_selection_type
    }
}

/// A booking as the API and replay print it; `hint` is the engine message
/// embedded as JSON, exactly as the worker receives it.
#[derive(Debug, Serialize)]
pub struct BookingView<'a> {
    pub request_id: &'a str,
    pub role: Role,
    pub worker_id: u64,
    pub dp_rank: u32,
    /// The selection-policy type that placed it: the role's own, or the built-in
    /// default when `selection_fallback` says the role's own failed.
    pub selection_policy: &'a str,
    pub cached_blocks: usize,
    pub request_blocks: usize,
    pub committed_copy: Option<CopyView>,
    pub hint: Option<&'a RawValue>,
    pub hint_skipped: Option<HintSkip>,
    pub dropped_actions: usize,
    pub policy_failures: Vec<FailureView<'a>>,
    /// Why the built-in default selection placed it, when the role's selection
    /// policy failed (`error`, `panic`, `out_of_range`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selection_fallback: Option<&'static str>,
}

impl<'a> BookingView<'a> {
    /// `booking` as `role` (the role it was booked on, from the same snapshot) made it.
    pub fn new(booking: &'a Booking, role: &'a RoleRuntime) -> Self {
        Self {
            request_id: &booking.request_id,
            role: booking.role,
            worker_id: booking.worker.worker_id,
            dp_rank: booking.worker.dp_rank,
            selection_policy: selection_policy(role, booking),
            cached_blocks: booking.cached_blocks,
            request_blocks: booking.request_blocks,
            selection_fallback: booking.selection_fallback,
            committed_copy: booking.committed_copy.map(|c| CopyView {
                source_worker_id: c.source.worker_id,
                source_dp_rank: c.source.dp_rank,
                first_block: c.first_block,
                last_block: c.last_block,
            }),
            hint: booking.hint.message(),
            hint_skipped: booking.hint_skipped(),
            dropped_actions: booking.dropped_actions,
            policy_failures: booking
                .policy_failures
                .iter()
                .map(|f: &PolicyFailure| FailureView {
                    policy: &f.policy,
                    kind: failure_kind(f.kind),
                    message: &f.message,
                })
                .collect(),
        }
    }
}
