//! `kv_events: approximate` workers' capacity, against simulated vLLM engines
//! (`kvhint-sim`, whose `/metrics` carries vLLM's `vllm:cache_config_info`):
//! the router credits a worker with no more blocks than its engine holds, as
//! the engine says it or as `kv_capacity_tokens` gives it.

use kvhint_e2e::http::{agent, call_with};
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, MODEL_NAME};
use kvhint_e2e::sim::SimFleet;
use kvhint_e2e::{private_dir, Server};
use serde_json::{json, Value};
use std::path::Path;

fn sim(workers: usize, capacity_blocks: usize) -> SimFleet {
    let mut args = SimFleet::args(workers, capacity_blocks);
    args.extend(["--speedup".to_string(), "50".to_string()]);
    SimFleet::start(Path::new(env!("CARGO_BIN_EXE_kvhint-sim")), &args)
}

fn worker(status: &Value, id: u64) -> &Value {
    status["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["worker_id"] == id))
        .unwrap_or_else(|| panic!("no worker {id} in {status}"))
}

#[test]
fn an_approximate_worker_s_credits_stop_at_the_capacity_its_engine_reports_or_its_entry_gives() {
    // Each simulated engine holds 64 blocks of 16 tokens and says so in
    // `vllm:cache_config_info`; worker 2's entry says 640 tokens (40 blocks).
    let fleet = sim(2, 64);
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    let yaml = format!(
        "router:\n  block_size: 16\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n  approximate_ttl_s: 600\n  health:\n    interval_ms: 100\n\
         workers:\n\
         \x20 - worker_id: 1\n    http_endpoint: {}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n\
         \x20 - worker_id: 2\n    http_endpoint: {}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n    kv_capacity_tokens: 640\n",
        qwen3_tokenizer_dir().display(),
        fleet.workers[0].url,
        fleet.workers[1].url,
    );
    std::fs::write(&config, yaml).unwrap();
    let server = Server::start(&config, &[], dir.path());
    server.wait_for("worker 1's capacity read from its engine", |s| {
        let status = s.status();
        worker(&status, 1)["approximate_capacity_blocks"] == 64
    });
    let status = server.status();
    assert_eq!(
        worker(&status, 2)["approximate_capacity_blocks"],
        40,
        "{status}"
    );
    for id in [1, 2] {
        assert_eq!(
            worker(&status, id)["approximate_capacity_learned"],
            false,
            "{status}"
        );
    }

    // Twelve different prompts of ~20 blocks each: ~240 blocks over two
    // workers that hold 64 and 40.
    let agent = agent();
    for i in 0..12 {
        let prompt: String = (0..90).map(|w| format!("p{i}w{w} ")).collect();
        let (status, _, body) = call_with(
            &agent,
            &format!("{}/v1/completions", server.base),
            &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(status, 200, "{body}");
    }
    let status = server.status();
    let blocks = |id| worker(&status, id)["approximate_blocks"].as_u64().unwrap();
    assert!(
        blocks(1) <= 64,
        "worker 1 credited past its 64 blocks: {status}"
    );
    assert!(
        blocks(2) <= 40,
        "worker 2 credited past its 40 blocks: {status}"
    );
    assert!(
        blocks(1) + blocks(2) >= 40,
        "the workers were credited with what they were sent: {status}"
    );
    server.until_idle();
}
