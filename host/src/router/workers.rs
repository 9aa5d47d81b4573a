//! Workers as the router knows them: identity, role, and the runtime-data keys
//! Dynamo uses to advertise hint support (`router_hint`,
//! `router_hint_worker_type`, `router_hint_source_control_endpoints`).

use super::kv_index::WorkerKey;
use crate::config::Role;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;

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

/// The load a worker carries from its open bookings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Load {
    pub active_requests: u64,
    /// KV blocks held by open requests (their prompts).
    pub active_blocks: u64,
    /// Blocks still to prefill for open requests (their uncached part).
    pub prefill_blocks: u64,
}
