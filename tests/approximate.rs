//! `kv_events: approximate` workers' capacity, against simulated vLLM engines
//! (`kvhint-sim`, whose `/metrics` carries vLLM's `vllm:cache_config_info`):
//! the router credits a worker with no more blocks than its engine holds, as
//! the engine says it or as `kv_capacity_tokens` gives it.

use kvhint_e2e::http::{agent, call_with, get};
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

/// The value of the `/metrics` sample `name` (with its labels), 0 if absent.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn a_request_waits_for_the_in_flight_request_computing_its_long_prefix_but_not_for_a_short_one() {
    // One simulated engine, 3 ms of prefill a prompt token: a ~700-token
    // prompt is in flight for about 2 s, long enough to book the next request
    // while it runs.
    let mut args = SimFleet::args(1, 4096);
    args.extend(["--prefill-us-per-token".to_string(), "3000".to_string()]);
    let fleet = SimFleet::start(Path::new(env!("CARGO_BIN_EXE_kvhint-sim")), &args);
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    let yaml = format!(
        "router:\n  block_size: 16\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n  prefix_wait_ms: 60000\n\
         workers:\n\
         \x20 - worker_id: 1\n    http_endpoint: {}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n",
        qwen3_tokenizer_dir().display(),
        fleet.workers[0].url,
    );
    std::fs::write(&config, yaml).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let url = format!("{}/v1/completions", server.base);
    let complete = |prompt: String| {
        let url = url.clone();
        move || {
            let (status, _, body) = call_with(
                &agent(),
                &url,
                &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}),
            );
            assert_eq!(status, 200, "{body}");
        }
    };
    let waits = |server: &Server| {
        let (_, metrics) = server.get("/metrics");
        let outcome = |o: &str| {
            sample(
                &metrics,
                &format!("kvhint_gateway_prefix_waits_total{{outcome=\"{o}\"}}"),
            )
        };
        (outcome("settled"), outcome("timed_out"), outcome("short"))
    };
    // The engine is computing a request: the router booked and credited it
    // (it credits before it forwards).
    let engine_busy = || {
        let agent = agent();
        kvhint_e2e::wait::until_true(
            "the engine computing a request",
            std::time::Duration::from_secs(20),
            || {
                let (_, metrics) = get(&agent, &format!("{}/metrics", fleet.workers[0].url));
                let running = format!("vllm:num_requests_running{{model_name=\"{MODEL_NAME}\"}}");
                sample(&metrics, &running) == 1.0
            },
        );
    };
    let words = |tag: &str, n: usize| -> String { (0..n).map(|w| format!("{tag}{w}w ")).collect() };

    // A long shared prefix (~700 tokens), already in the index: the request
    // booked while another one is computing it waits for that one to make it
    // reusable, instead of computing it again beside it.
    let long = words("a", 200);
    complete(format!("{long}to begin with"))();
    let first = std::thread::spawn(complete(format!("{long}first of all")));
    engine_busy();
    complete(format!("{long}second of all"))();
    first.join().unwrap();
    assert_eq!(waits(&server), (1.0, 0.0, 0.0), "{}", server.log());

    // A short shared prefix (a block, under prefix_wait_min_tokens' 256): not
    // worth waiting for a whole request; sent at once, and counted.
    let head = words("s", 12);
    complete(format!("{head}{}", words("b", 200)))();
    let third = std::thread::spawn(complete(format!("{head}{}", words("d", 200))));
    engine_busy();
    complete(format!("{head}{}", words("c", 200)))();
    assert_eq!(
        waits(&server),
        (1.0, 0.0, 1.0),
        "the short prefix was waited for: {}",
        server.log()
    );
    third.join().unwrap();
    server.until_idle();
}
