//! The words every layer shares: roles, router modes, worker identity and what a
//! worker advertises. It imports nothing of the crate, so any module may use it
//! without creating a cycle.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A worker as the router addresses it: one engine data-parallel rank.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "worker {} dp_rank {}", self.worker_id, self.dp_rank)
    }
}

/// `--router-mode`: KV-aware selection (with hints), or one of the non-KV modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterMode {
    Kv,
    RoundRobin,
    Random,
}

impl RouterMode {
    pub const NAMES: &'static [&'static str] = &["kv", "round-robin", "random"];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "kv" => Some(Self::Kv),
            "round-robin" => Some(Self::RoundRobin),
            "random" => Some(Self::Random),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
        }
    }

    pub fn is_kv(self) -> bool {
        self == Self::Kv
    }
}

impl fmt::Display for RouterMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `kv_events.thread_policy`: how the threads of the event path (engine subscriptions,
/// the ingestion thread) are scheduled beside booking threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ThreadPolicy {
    /// Linux's `SCHED_BATCH`: the same share of the CPU, but a thread that wakes does
    /// not preempt one that is running; when every core is busy it runs when the
    /// scheduler next preempts (at its tick, every few milliseconds).
    #[default]
    Batch,
    /// The default policy (`SCHED_OTHER`): a thread that wakes may preempt a booking.
    Normal,
}

impl ThreadPolicy {
    pub const NAMES: &'static [&'static str] = &["batch", "normal"];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "batch" => Some(Self::Batch),
            "normal" => Some(Self::Normal),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Normal => "normal",
        }
    }
}

/// The roles a worker can serve and a request can ask for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Aggregated,
    Prefill,
    Decode,
}

impl Role {
    pub const NAMES: &'static [&'static str] = &["aggregated", "prefill", "decode"];

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "aggregated" => Some(Self::Aggregated),
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Aggregated => "aggregated",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A worker registration as it arrives (HTTP body or trace record).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerRegistration {
    pub worker_id: u64,
    #[serde(default)]
    pub dp_rank: u32,
    pub role: Role,
    #[serde(default)]
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
    /// Where this worker's engine publishes KV events, if the router should subscribe.
    #[serde(default)]
    pub kv_events: Option<crate::event_source::KvEventSource>,
}

/// A registered worker (one dp rank of one engine).
#[derive(Debug, Clone, PartialEq)]
pub struct Worker {
    pub key: WorkerKey,
    pub role: Role,
    /// Advertises `router_hint: true`: can receive hint messages (rule R6).
    pub router_hint: bool,
    /// `router_hint_worker_type` ("" if absent).
    pub worker_type: Arc<str>,
    /// This rank's entry of `router_hint_source_control_endpoints` ("" if none).
    pub source_control_endpoint: Arc<str>,
    pub runtime_data: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("worker {worker_id} rank {dp_rank}: runtime_data.{key} {problem}")]
pub struct RuntimeDataError {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub key: &'static str,
    pub problem: String,
}

impl Worker {
    pub fn from_registration(registration: WorkerRegistration) -> Result<Self, RuntimeDataError> {
        let key = WorkerKey {
            worker_id: registration.worker_id,
            dp_rank: registration.dp_rank,
        };
        let fail = |field: &'static str, problem: String| RuntimeDataError {
            worker_id: key.worker_id,
            dp_rank: key.dp_rank,
            key: field,
            problem,
        };
        let data = &registration.runtime_data;
        let router_hint = match data.get("router_hint") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(other) => {
                return Err(fail(
                    "router_hint",
                    format!("must be true or false, found {other}"),
                ))
            }
        };
        let worker_type = match data.get("router_hint_worker_type") {
            None | Some(serde_json::Value::Null) => "",
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(other) => {
                return Err(fail(
                    "router_hint_worker_type",
                    format!("must be a string, found {other}"),
                ))
            }
        };
        // Dynamo advertises one endpoint per global dp rank: {"0": "tcp://…", …}.
        let endpoints: BTreeMap<String, String> =
            match data.get("router_hint_source_control_endpoints") {
                None | Some(serde_json::Value::Null) => BTreeMap::new(),
                Some(value) => serde_json::from_value(value.clone()).map_err(|_| {
                    fail(
                        "router_hint_source_control_endpoints",
                        format!("must map dp ranks to endpoints, like {{\"0\": \"tcp://10.0.0.7:23280\"}}; found {value}"),
                    )
                })?,
            };
        let mut endpoint = "";
        for (rank, value) in &endpoints {
            match rank.parse::<u32>() {
                Ok(rank) if rank == key.dp_rank => endpoint = value.as_str(),
                Ok(_) => {}
                Err(_) => {
                    return Err(fail(
                        "router_hint_source_control_endpoints",
                        format!("has key {rank:?}, which is not a dp rank number"),
                    ))
                }
            }
        }
        Ok(Self {
            key,
            role: registration.role,
            router_hint,
            worker_type: Arc::from(worker_type),
            source_control_endpoint: Arc::from(endpoint),
            runtime_data: registration.runtime_data,
        })
    }
}

/// What one booking may ask of the router (from `router:`, per snapshot): each
/// bound keeps a single caller from growing the router's memory without limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BookingLimits {
    /// `router.max_prompt_tokens`: longer prompts are refused before any work.
    pub max_prompt_tokens: usize,
    /// `router.max_request_id_bytes`: an open booking keeps its id.
    pub max_request_id_bytes: usize,
    /// `router.max_open_bookings`: bookings held open at once, over all workers.
    pub max_open_bookings: usize,
}

impl Default for BookingLimits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: 262_144,
            max_request_id_bytes: 256,
            max_open_bookings: 100_000,
        }
    }
}
