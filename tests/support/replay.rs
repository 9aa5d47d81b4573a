//! The router in-process: worker registrations, trace records replayed on a
//! fresh router (as `kvhint replay` does), and what a booking's hint holds.

use std::path::Path;

/// A hint-capable decode worker with an endpoint of its own.
pub fn decode_worker(id: u64) -> kvhint::router::workers::WorkerRegistration {
    serde_json::from_value(serde_json::json!({
        "worker_id": id, "role": "decode", "runtime_data": {
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.{}.{}:23280", id / 256, id % 256)}
        }
    }))
    .expect("registration")
}

/// A decode request `id` for `tokens`, with no session, LoRA or cache salt.
pub fn decode_request<'a>(id: &'a str, tokens: &'a [u32]) -> kvhint::router::BookRequest<'a> {
    kvhint::router::BookRequest {
        request_id: id,
        role: kvhint::domain::Role::Decode,
        token_ids: tokens,
        session_context: None,
        lora_name: None,
        cache_salt: None,
        pinned_prefix: &[],
        receive_from: None,
    }
}

/// The first `blocks` full blocks of `prompt` (`block_size` tokens each),
/// stored by one worker in one event, with engine hashes from `engine_base`.
pub fn stored_event(
    prompt: &[u32],
    block_size: usize,
    blocks: usize,
    engine_base: u64,
) -> kvhint::router::index::KvEvent {
    kvhint::router::index::KvEvent::stored(
        None,
        prompt
            .chunks_exact(block_size)
            .take(blocks)
            .enumerate()
            .map(|(i, chunk)| kvhint::router::index::StoredBlock {
                block_hash: engine_base + i as u64,
                token_ids: chunk.into(),
            })
            .collect(),
    )
}

/// Replays trace records (JSON values) on a fresh router; returns each booking
/// as JSON and the error lines.
pub fn replay_records(
    snapshot: &kvhint::snapshot::Snapshot,
    records: &[serde_json::Value],
) -> (Vec<serde_json::Value>, String) {
    let router = kvhint::router::Router::new(snapshot.block_size);
    replay_on(&router, snapshot, records)
}

/// Like [`replay_records`], on a given router (to keep its state between calls).
pub fn replay_on(
    router: &kvhint::router::Router,
    snapshot: &kvhint::snapshot::Snapshot,
    records: &[serde_json::Value],
) -> (Vec<serde_json::Value>, String) {
    let trace: String = records.iter().map(|r| format!("{r}\n")).collect();
    let mut out = Vec::new();
    let mut err = Vec::new();
    kvhint::replay::replay(
        router,
        snapshot,
        Path::new("trace.jsonl"),
        trace.as_bytes(),
        &mut out,
        &mut err,
    )
    .unwrap();
    let bookings = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (bookings, String::from_utf8(err).unwrap())
}

/// The action types of a booking's hint (as the API and replay print it), in
/// order; empty when it carries no hint.
pub fn action_types(booking: &serde_json::Value) -> Vec<String> {
    booking["hint"]["actions"]
        .as_array()
        .map(|actions| {
            actions
                .iter()
                .map(|a| a["action_type"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Trace-record builders for tests.
pub mod trace {
    use serde_json::{json, Value};

    /// A worker; `hint` adds router_hint with worker type `kind` and an
    /// endpoint `tcp://10.0.0.<id>:<23280 + rank>`.
    pub fn worker(id: u64, rank: u32, role: &str, hint: bool, kind: &str) -> Value {
        let runtime_data = if hint {
            json!({
                "router_hint": true,
                "router_hint_worker_type": kind,
                "router_hint_source_control_endpoints": {
                    rank.to_string(): format!("tcp://10.0.0.{id}:{}", 23280 + rank)
                }
            })
        } else {
            json!({})
        };
        json!({"type": "worker", "worker_id": id, "dp_rank": rank, "role": role, "runtime_data": runtime_data})
    }

    /// `tokens` stored by a worker as full blocks, engine hashes from `base`.
    pub fn stored(id: u64, rank: u32, tokens: &[u32], block_size: usize, base: u64) -> Value {
        let blocks: Vec<Value> = tokens
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, chunk)| json!({"block_hash": base + i as u64, "token_ids": chunk}))
            .collect();
        json!({"type": "kv_event", "worker_id": id, "dp_rank": rank,
               "event": {"stored": {"parent_block_hash": null, "blocks": blocks}}})
    }

    pub fn request(id: &str, role: &str, tokens: &[u32]) -> Value {
        json!({"type": "request", "request_id": id, "role": role, "token_ids": tokens})
    }

    pub fn release(id: &str) -> Value {
        json!({"type": "release", "request_id": id})
    }

    /// Tokens `start..start + n`.
    pub fn tokens(start: u32, n: u32) -> Vec<u32> {
        (start..start + n).collect()
    }
}
