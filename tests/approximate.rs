//! What the router credits workers with, against simulated vLLM engines
//! (`kvhint-sim`, whose `/metrics` carries vLLM's `vllm:cache_config_info` and
//! which publish KV events with vLLM's own publisher): a `kv_events:
//! approximate` worker no more blocks than its engine holds, as the engine says
//! it or as `kv_capacity_tokens` gives it; a busy prefix waited for when it is
//! worth it; an event-fed worker the prompts it is still computing.

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

/// Simulated vLLM engines with 3 ms of prefill a prompt token (a ~700-token
/// prompt is in flight for about 2 s), publishing KV events with vLLM's own
/// publisher.
fn slow_event_fed_sim(workers: usize, capacity_blocks: usize) -> SimFleet {
    let mut args = SimFleet::args(workers, capacity_blocks);
    args.extend([
        "--prefill-us-per-token".to_string(),
        "3000".to_string(),
        "--events".to_string(),
        "--wheel".to_string(),
        kvhint_e2e::provision::vllm_wheel().display().to_string(),
        "--python".to_string(),
        kvhint_e2e::provision::python().display().to_string(),
    ]);
    SimFleet::start(Path::new(env!("CARGO_BIN_EXE_kvhint-sim")), &args)
}

/// Completes `prompt` through the router at `base` on a thread of its own; the
/// thread answers the worker that took it.
fn in_background(base: &str, prompt: String) -> std::thread::JoinHandle<u64> {
    let base = base.to_string();
    std::thread::spawn(move || {
        let (status, worker, body) = call_with(
            &agent(),
            &format!("{base}/v1/completions"),
            &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}),
        );
        assert_eq!(status, 200, "{body}");
        worker
    })
}

/// `n` distinct words tagged `tag` (about 3.5 tokens each).
fn words(tag: &str, n: usize) -> String {
    (0..n).map(|w| format!("{tag}{w}w ")).collect()
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

/// Two simulated vLLM engines publishing KV events with vLLM's own publisher,
/// 3 ms of prefill a prompt token, and kvhint subscribed to both.
fn event_fed(fleet: &SimFleet, dir: &Path, name: &str, credit_in_flight: bool) -> Server {
    event_fed_with(
        fleet,
        dir,
        name,
        &format!("credit_in_flight: {credit_in_flight}"),
    )
}

/// [`event_fed`] with `gateway` settings of the caller's.
fn event_fed_with(fleet: &SimFleet, dir: &Path, name: &str, gateway: &str) -> Server {
    let config = dir.join(name);
    let mut yaml = format!(
        "router:\n  block_size: 16\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n  prefix_wait_ms: 60000\n  {gateway}\n\
         workers:\n",
        qwen3_tokenizer_dir().display(),
    );
    for (i, w) in fleet.workers.iter().enumerate() {
        let (events, replay) = (w.events.as_ref(), w.replay.as_ref());
        let (Some(events), Some(replay)) = (events, replay) else {
            panic!("kvhint-sim --events gave no endpoints: {w:?}");
        };
        yaml.push_str(&format!(
            "  - worker_id: {}\n    http_endpoint: {}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: {{endpoint: \"{events}\", replay_endpoint: \"{replay}\"}}\n",
            i + 1,
            w.url
        ));
    }
    std::fs::write(&config, yaml).unwrap();
    Server::start(&config, &[], dir)
}

/// Completes `prompt` through `server`: the worker that answered and the
/// prompt tokens its engine served from cache.
fn complete_on(server: &Server, prompt: &str) -> (u64, u64) {
    let (status, worker, body) = call_with(
        &agent(),
        &format!("{}/v1/completions", server.base),
        &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{body}");
    let body: Value = serde_json::from_str(&body).unwrap();
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {body}"));
    (worker, cached)
}

/// Which engine of `fleet` is computing a request now (1-based), once one is.
fn engine_running(fleet: &SimFleet) -> u64 {
    let agent = agent();
    let mut running = 0;
    kvhint_e2e::wait::until_true(
        "an engine computing a request",
        std::time::Duration::from_secs(20),
        || {
            let gauge = format!("vllm:num_requests_running{{model_name=\"{MODEL_NAME}\"}}");
            running = fleet
                .workers
                .iter()
                .position(|w| {
                    let (_, metrics) = get(&agent, &format!("{}/metrics", w.url));
                    sample(&metrics, &gauge) >= 1.0
                })
                .map_or(0, |i| i as u64 + 1);
            running > 0
        },
    );
    running
}

#[test]
fn a_request_sharing_a_prefix_an_event_fed_engine_is_still_computing_goes_there_and_reuses_it() {
    // An engine publishes a block once it has computed it: while a ~700-token
    // prompt is prefilling (about 2 s here) the index has nothing of it. The
    // router credits the worker with it while it runs (`credit_in_flight`), so
    // the next request sharing the prefix goes to the same worker, waits for
    // the first to be prefilled, and reuses it, instead of computing it again
    // on the idle worker.
    let fleet = slow_event_fed_sim(2, 4096);
    let dir = private_dir();
    let in_flight_blocks = |server: &Server| {
        let (_, metrics) = server.get("/metrics");
        sample(&metrics, "kvhint_gateway_in_flight_blocks")
    };

    let server = event_fed(&fleet, dir.path(), "credited.yaml", true);
    let prefix = words("a", 200);
    let first = in_background(&server.base, format!("{prefix}first of all"));
    let computing = engine_running(&fleet);
    assert!(
        in_flight_blocks(&server) >= 30.0,
        "the running request's blocks are credited: {}",
        server.log()
    );
    let (worker, cached) = complete_on(&server, &format!("{prefix}second of all"));
    assert_eq!(
        worker, computing,
        "sent away from the prefix being computed"
    );
    assert!(
        cached >= 480,
        "the second request reused only {cached} tokens of the first's prefix"
    );
    assert_eq!(first.join().unwrap(), computing);
    let (_, metrics) = server.get("/metrics");
    assert_eq!(
        sample(
            &metrics,
            "kvhint_gateway_prefix_waits_total{outcome=\"settled\"}"
        ),
        1.0,
        "the second waited for the first's prefill: {metrics}"
    );
    // Both ended: their credits are gone, and the engine's own events hold
    // the prefix now.
    kvhint_e2e::wait::until_true(
        "the ended requests' credits taken back",
        std::time::Duration::from_secs(10),
        || in_flight_blocks(&server) == 0.0,
    );
    let (worker, cached) = complete_on(&server, &format!("{prefix}third of all"));
    assert_eq!(
        worker, computing,
        "the engine's published prefix was not found"
    );
    assert!(cached >= 480, "reused {cached}");
    server.until_idle();
    drop(server);

    // The same without the credit: the second request's prefix is nowhere in
    // the index, and it goes to the idle worker, computing it again.
    let server = event_fed(&fleet, dir.path(), "published-only.yaml", false);
    let prefix = words("b", 200);
    let first = in_background(&server.base, format!("{prefix}first of all"));
    let computing = engine_running(&fleet);
    assert_eq!(in_flight_blocks(&server), 0.0);
    let (worker, cached) = complete_on(&server, &format!("{prefix}second of all"));
    assert_ne!(worker, computing);
    assert_eq!(cached, 0);
    first.join().unwrap();
    server.until_idle();
}

#[test]
fn a_prefix_an_event_fed_engine_must_drop_for_the_prompts_it_is_running_is_not_counted() {
    // One simulated vLLM engine holding 64 blocks of 16 tokens, 3 ms of
    // prefill a prompt token, publishing its KV events. A prompt of ~45
    // blocks is computed and ends: its blocks stay cached, and the index holds
    // them. Then an unrelated ~45-block prompt starts prefilling (~2 s): once
    // its blocks are in, at most 64 − 45 = 19 others fit, so of the first
    // prompt's prefix the engine keeps 19 blocks at most, and says so only
    // once its step ends. A request sharing that prefix, booked meanwhile,
    // must be told what the engine will reuse, not what the index still shows.
    let fleet = slow_event_fed_sim(1, 64);
    let dir = private_dir();
    // What the router said it found cached (`x-kvhint-cached-tokens`) and what
    // the engine reused.
    let told_and_reused = |server: &Server, prompt: &str| -> (u64, u64) {
        let mut response = agent()
            .post(&format!("{}/v1/completions", server.base))
            .header("content-type", "application/json")
            .send(json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}).to_string())
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let told: u64 = response
            .headers()
            .get("x-kvhint-cached-tokens")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or_else(|| panic!("no x-kvhint-cached-tokens: {:?}", response.headers()));
        let body: Value =
            serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
        let reused = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached_tokens in {body}"));
        (told, reused)
    };
    let capacity_known = |server: &Server| {
        server.wait_for("the engine's capacity read", |s| {
            s.status()["workers"][0]["kv_capacity_blocks"] == 64
        });
    };
    let run = |server: &Server, tag: &str| -> (u64, u64) {
        let prefix = words(&format!("{tag}p"), 200);
        let (_, reused) = told_and_reused(server, &format!("{prefix}first of all"));
        assert_eq!(reused, 0, "a new prompt");
        let unrelated = in_background(&server.base, words(&format!("{tag}x"), 210));
        engine_running(&fleet);
        let outcome = told_and_reused(server, &format!("{prefix}second of all"));
        unrelated.join().unwrap();
        server.until_idle();
        outcome
    };

    let server = event_fed_with(
        &fleet,
        dir.path(),
        "anticipating.yaml",
        "anticipate_evictions: true",
    );
    capacity_known(&server);
    let (told, reused) = run(&server, "a");
    assert!(
        reused > 0 && reused <= 19 * 16,
        "the engine kept {reused} tokens of the prefix: the scenario is not what this test is about"
    );
    assert_eq!(
        told, reused,
        "the booking counted blocks the engine was bound to drop"
    );
    drop(server);

    // Without anticipating, the booking counts the whole prefix the index
    // still shows: a phantom.
    let server = event_fed_with(
        &fleet,
        dir.path(),
        "published.yaml",
        "anticipate_evictions: false",
    );
    let (told, reused) = run(&server, "b");
    assert!(reused <= 19 * 16, "reused {reused}");
    assert!(
        told >= 40 * 16,
        "told {told}: the index should still show the whole prefix"
    );
}
