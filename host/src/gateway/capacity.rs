//! A worker's KV capacity, read from its engine where the engine says it: a
//! `kv_events: approximate` worker's credits stop where the engine's cache does
//! (see `approximate`'s "Capacity"; its `kv_capacity_tokens` wins over what is
//! read, and without either the cap is learned from answers), and bookings on
//! an event-fed worker anticipate the evictions its running requests make
//! certain (`router::workers::Residency`).
//!
//! - vLLM: `GET /metrics`, the info gauge `vllm:cache_config_info`, whose labels
//!   are the cache config: `num_gpu_blocks` × `block_size` tokens (llm-d's
//!   endpoint picker reads the same labels).
//! - SGLang: `GET /server_info` (`/get_server_info` before 0.5), whose
//!   scheduler info carries `max_total_num_tokens`.
//! - llama.cpp says nowhere how much its host-memory prompt cache (`--cache-ram`)
//!   holds, and TensorRT-LLM's and other OpenAI servers' capacity is not served
//!   over HTTP: learned.
//!
//! A read that fails is tried again after [`RETRY`]; one that succeeded is not
//! repeated (an engine's cache is sized when it starts; a restarted engine
//! re-registers, or keeps its size).

use crate::domain::Engine;
use std::time::Duration;

/// Between two reads of an engine that did not say.
pub const RETRY: Duration = Duration::from_secs(60);

/// Where `engine` says its KV capacity, if it does (its row of `Engine::TABLE`).
pub fn path(engine: Engine) -> Option<&'static str> {
    engine.facts().capacity_path
}

/// The capacity in tokens from what `engine` answered at [`path`].
pub fn parse(engine: Engine, body: &[u8]) -> Option<u64> {
    match engine {
        Engine::Vllm => vllm(std::str::from_utf8(body).ok()?),
        Engine::Sglang => sglang(body),
        _ => None,
    }
}

/// `vllm:cache_config_info{block_size="16",…,num_gpu_blocks="31250",…} 1.0`:
/// one series per engine of the server; the first that names both.
fn vllm(metrics: &str) -> Option<u64> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix("vllm:cache_config_info{"))
        .find_map(|rest| {
            let labels = &rest[..rest.rfind('}')?];
            let blocks = label(labels, "num_gpu_blocks")?;
            let size = label(labels, "block_size")?;
            blocks.checked_mul(size).filter(|t| *t > 0)
        })
}

/// A label's value as a number (`None` for `"None"`, vLLM's value before the
/// engine has profiled its memory).
fn label(labels: &str, name: &str) -> Option<u64> {
    let mut rest = labels;
    loop {
        let at = rest.find(name)?;
        let before = rest[..at].chars().next_back();
        let after = &rest[at + name.len()..];
        rest = after;
        if matches!(before, None | Some(',') | Some(' ')) {
            if let Some(value) = after.strip_prefix("=\"") {
                return value[..value.find('"')?].parse().ok();
            }
        }
    }
}

/// `max_total_num_tokens` at the top of SGLang's server info, or in its first
/// data-parallel rank's internal state.
fn sglang(body: &[u8]) -> Option<u64> {
    let info: serde_json::Value = serde_json::from_slice(body).ok()?;
    let tokens = |v: &serde_json::Value| v.get("max_total_num_tokens")?.as_u64();
    tokens(&info)
        .or_else(|| info.get("internal_states")?.get(0).and_then(tokens))
        .filter(|t| *t > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_s_cache_config_info_gives_blocks_times_block_size() {
        let metrics = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"2048\",prefix_caching_hash_algo=\"sha256\"} 1.0\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n";
        assert_eq!(parse(Engine::Vllm, metrics.as_bytes()), Some(2048 * 16));
    }

    #[test]
    fn a_label_that_ends_another_s_name_is_not_taken_for_it() {
        // `num_gpu_blocks_override` comes first and says None.
        let metrics = "vllm:cache_config_info{num_gpu_blocks_override=\"None\",block_size=\"32\",num_gpu_blocks=\"100\"} 1\n";
        assert_eq!(parse(Engine::Vllm, metrics.as_bytes()), Some(3200));
        let unprofiled = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n";
        assert_eq!(parse(Engine::Vllm, unprofiled.as_bytes()), None);
        assert_eq!(parse(Engine::Vllm, b"vllm:num_requests_running 0\n"), None);
    }

    #[test]
    fn sglang_s_server_info_gives_max_total_num_tokens() {
        let top = br#"{"model_path":"m","page_size":1,"max_total_num_tokens":500000}"#;
        assert_eq!(parse(Engine::Sglang, top), Some(500_000));
        let nested = br#"{"model_path":"m","internal_states":[{"max_total_num_tokens":1234}]}"#;
        assert_eq!(parse(Engine::Sglang, nested), Some(1234));
        assert_eq!(parse(Engine::Sglang, b"not json"), None);
        assert_eq!(path(Engine::Llamacpp), None);
    }
}
