//! Disaggregated prefill and decode through `kvhint serve`
//! (`models.<name>.disaggregation`), against fake engines on 127.0.0.1 that
//! record every request (`kvhint_e2e::pd`):
//!
//! - vLLM: the prefill leg first (`kv_transfer_params` asking for a remote
//!   decode, one token, one body), then the decode leg with exactly the
//!   `kv_transfer_params` the prefill answered; the client gets the decode's
//!   answer. A prefill that answers none leaves the decode worker alone, counted.
//! - SGLang: both legs at once, naming the prefill worker's bootstrap server
//!   and one room the router mints per request (a client's room is replaced).
//! - Failures before any byte reached the client book the pair again without
//!   the failed prefill worker; with none left, `on_prefill_failure` decides.
//! - Each leg's body passes the engines' own code
//!   (`tests/engines/validate_disagg_body.py`: SGLang 0.5.23, vLLM 0.34.0).
//! - 1,000 clients going away at random points leave no booking open.
//! - `kvhint check` locates every combination the gateway could not serve.

use kvhint_e2e::engines::run_checker;
use kvhint_e2e::http::{call, cut_off_requests, metric_or_zero, metrics, sum_of};
use kvhint_e2e::llamacpp::qwen3_tokenizer_dir;
use kvhint_e2e::pd::{closed_port, Fake, Recorded, Reply};
use kvhint_e2e::provision::vllm_plugin_wheel;
use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{config_file, kvhint_bin, private_dir, Server};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MODEL: &str = "m";

const TEXT: &str = "The quick brown fox jumps over the lazy dog while the router decides \
    where the request should go: one pool computes the prompt, another generates the answer, \
    and the KV cache is handed over between them the way the engine does it.";

/// What vLLM's proxy examples send a prefill worker.
fn proxy_prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// What a vLLM prefill worker (NIXL connector) answers for its KV.
fn kv_params() -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2]],
           "remote_engine_id": "eng", "remote_request_id": "r", "remote_host": "10.0.0.7",
           "remote_port": 5600, "tp_size": 1})
}

fn vllm_prefill_answer(params: Option<Value>) -> Reply {
    let mut answer = json!({"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}});
    if let Some(params) = params {
        answer["kv_transfer_params"] = params;
    }
    Reply::Json(200, answer)
}

fn sglang_prefill_answer() -> Reply {
    Reply::Json(
        200,
        json!({"text": "a", "meta_info": {"id": "p", "finish_reason": {"type": "length", "length": 1},
               "prompt_tokens": 40, "completion_tokens": 1, "cached_tokens": 0}}),
    )
}

/// A decode worker's answer, in the route's shape, streamed if asked.
fn decode_answer(request: &Recorded) -> Reply {
    let chat = request.path == "/v1/chat/completions";
    if request.body["stream"] == true {
        let event = |text: &str| {
            if chat {
                json!({"id": "d", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
            } else {
                json!({"id": "d", "object": "text_completion", "created": 0, "model": MODEL,
                       "choices": [{"index": 0, "text": text, "finish_reason": null}]})
            }
        };
        return Reply::Sse(vec![event("dec"), event("oded")]);
    }
    let answer = match request.path.as_str() {
        "/generate" => json!({"text": "decoded", "meta_info": {"id": "d",
            "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 40,
            "completion_tokens": 2, "cached_tokens": 0}}),
        "/v1/chat/completions" => json!({"id": "d", "object": "chat.completion", "created": 0,
            "model": MODEL, "choices": [{"index": 0, "finish_reason": "length",
            "message": {"role": "assistant", "content": "decoded"}}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}}),
        _ => json!({"id": "d", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "decoded", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}}),
    };
    Reply::Json(200, answer)
}

/// A worker of the config: (id, role, engine, endpoint, extra flow-map entries).
struct W<'a>(u64, &'a str, &'a str, String, &'a str);

fn config_yaml(disaggregation: &str, gateway: &str, workers: &[W<'_>]) -> String {
    let mut yaml = format!(
        "router:\n  block_size: 16\n\
         worker_selection:\n  prefill: dynamo-default-cost-fn\n  decode: dynamo-default-cost-fn\n\
         models:\n  {MODEL}:\n    tokenizer: {}\n    disaggregation:\n{disaggregation}\
         gateway:\n  health:\n    interval_ms: 0\n{gateway}\
         workers:\n",
        qwen3_tokenizer_dir().display()
    );
    for W(id, role, engine, endpoint, extra) in workers {
        yaml.push_str(&format!(
            "  - {{worker_id: {id}, role: {role}, engine: {engine}, http_endpoint: \"{endpoint}\", models: [{MODEL}]{extra}}}\n"
        ));
    }
    yaml
}

fn serve(dir: &kvhint_e2e::TempDir, yaml: &str) -> Server {
    let path = dir.path().join("kvhint.yaml");
    std::fs::write(&path, yaml).unwrap();
    Server::start(&path, &[], dir.path())
}

/// A vLLM pair: two prefill workers and one decode worker.
fn vllm_server(
    dir: &kvhint_e2e::TempDir,
    disaggregation: &str,
    p1: String,
    p2: String,
    d: String,
) -> Server {
    vllm_server_with(dir, disaggregation, "", "", [p1, p2, d])
}

/// [`vllm_server`] with `gateway:` lines and the decode worker's extra
/// flow-map entries.
fn vllm_server_with(
    dir: &kvhint_e2e::TempDir,
    disaggregation: &str,
    gateway: &str,
    decode_extra: &str,
    [p1, p2, d]: [String; 3],
) -> Server {
    serve(
        dir,
        &config_yaml(
            disaggregation,
            gateway,
            &[
                W(1, "prefill", "vllm", p1, ""),
                W(2, "prefill", "vllm", p2, ""),
                W(3, "decode", "vllm", d, decode_extra),
            ],
        ),
    )
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, String) {
    let (status, _, text) = call(&format!("{}{path}", server.base), body);
    (status, text)
}

fn all_posts(fakes: &[&Fake]) -> Vec<Recorded> {
    fakes.iter().flat_map(|f| f.posts()).collect()
}

fn legs(server: &Server, leg: &str, outcome: &str) -> f64 {
    metric_or_zero(
        server,
        &format!("kvhint_gateway_pair_legs_total{{leg=\"{leg}\",outcome=\"{outcome}\"}}"),
    )
}

fn pair_path(server: &Server, path: &str) -> f64 {
    metric_or_zero(
        server,
        &format!("kvhint_gateway_disaggregated_total{{path=\"{path}\"}}"),
    )
}

// ---------------------------------------------------------------------------
// vLLM

#[test]
fn a_vllm_pair_prefills_then_decodes_with_the_kv_transfer_params_the_prefill_returned() {
    let p1 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let p2 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", p1.url(), p2.url(), d.url());

    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 8, "stream": false,
                      "min_tokens": 2, "temperature": 0});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{text}\n{}", server.log());
    assert!(
        text.contains("decoded"),
        "the decode worker's answer: {text}"
    );

    let prefills = all_posts(&[&p1, &p2]);
    assert_eq!(prefills.len(), 1, "one prefill leg: {prefills:?}");
    let prefill = &prefills[0];
    assert_eq!(prefill.path, "/v1/completions");
    assert_eq!(prefill.body["kv_transfer_params"], proxy_prefill_params());
    assert_eq!(prefill.body["max_tokens"], 1);
    assert_eq!(prefill.body["stream"], false);
    assert!(prefill.body.get("min_tokens").is_none(), "{}", prefill.body);
    let decodes = d.posts();
    assert_eq!(decodes.len(), 1, "{decodes:?}");
    let decode = &decodes[0];
    assert_eq!(decode.path, "/v1/completions");
    assert_eq!(decode.body["kv_transfer_params"], kv_params());
    assert_eq!(decode.body["max_tokens"], 8);
    let id = decode.header("x-request-id").expect("decode x-request-id");
    assert_eq!(
        prefill.header("x-request-id"),
        Some(format!("{id}-prefill").as_str())
    );

    assert_eq!(pair_path(&server, "prefill_decode"), 1.0);
    assert_eq!(legs(&server, "prefill", "answered"), 1.0);
    assert_eq!(legs(&server, "decode", "answered"), 1.0);
    server.until_idle();

    // A streamed chat: the prefill leg is one body, the client's is a stream.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": TEXT}],
                      "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}});
    let (status, text) = post(&server, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{text}");
    assert!(
        text.contains("data:") && text.contains("oded"),
        "streamed: {text}"
    );
    let prefills = all_posts(&[&p1, &p2]);
    assert_eq!(prefills.len(), 2);
    let prefill = &prefills[1];
    assert_eq!(prefill.path, "/v1/chat/completions");
    assert_eq!(prefill.body["stream"], false);
    assert!(
        prefill.body.get("stream_options").is_none(),
        "{}",
        prefill.body
    );
    assert_eq!(prefill.body["kv_transfer_params"], proxy_prefill_params());
    let decode = &d.posts()[1];
    assert_eq!(decode.body["stream"], true);
    assert_eq!(decode.body["kv_transfer_params"], kv_params());
    assert_eq!(pair_path(&server, "prefill_decode"), 2.0);
    server.until_idle();
    assert_eq!(server.status()["open_bookings"], 0);
}

#[test]
fn a_vllm_prefill_answering_no_kv_transfer_params_leaves_decode_alone_and_is_counted() {
    let p1 = Fake::start(|_, _| vllm_prefill_answer(None));
    let p2 = Fake::start(|_, _| vllm_prefill_answer(None));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", p1.url(), p2.url(), d.url());
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 8});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("decoded"), "{text}");
    assert_eq!(all_posts(&[&p1, &p2]).len(), 1);
    let decodes = d.posts();
    assert_eq!(decodes.len(), 1);
    assert!(
        decodes[0].body.get("kv_transfer_params").is_none(),
        "{}",
        decodes[0].body
    );
    assert_eq!(
        metric_or_zero(&server, "kvhint_gateway_kv_not_transferred_total"),
        1.0
    );
    server.until_idle();
}

#[test]
fn a_failing_vllm_prefill_worker_is_left_out_and_the_pair_booked_again() {
    let bad = Fake::start(|_, _| Reply::Json(503, json!({"error": "overloaded"})));
    let good = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", bad.url(), good.url(), d.url());
    // The policy ties the two prefill workers; ask until the failing one was tried.
    for i in 0..20 {
        let body = json!({"model": MODEL, "prompt": format!("{i}: {TEXT}"), "max_tokens": 4});
        let (status, text) = post(&server, "/v1/completions", &body);
        assert_eq!(status, 200, "{text}\n{}", server.log());
        assert!(text.contains("decoded"), "{text}");
        if !bad.posts().is_empty() {
            break;
        }
    }
    let failed = bad.posts().len();
    assert!(failed >= 1, "the failing prefill worker was never tried");
    assert_eq!(legs(&server, "prefill", "failed"), failed as f64);
    // Every request was prefilled on the good worker and decoded with its KV.
    let decodes = d.posts();
    assert_eq!(good.posts().len(), decodes.len());
    assert!(decodes
        .iter()
        .all(|r| r.body["kv_transfer_params"] == kv_params()));
    assert_eq!(
        pair_path(&server, "prefill_decode"),
        decodes.len() as f64 + failed as f64
    );
    assert_eq!(pair_path(&server, "decode_alone_prefill_failed"), 0.0);
    server.until_idle();
}

#[test]
fn every_vllm_prefill_worker_failing_falls_back_to_decode_alone() {
    let refused = format!("http://127.0.0.1:{}", closed_port());
    let bad = Fake::start(|_, _| Reply::Json(503, json!({"error": "overloaded"})));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", refused, bad.url(), d.url());
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 4});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{text}\n{}", server.log());
    assert!(text.contains("decoded"), "{text}");
    let decodes = d.posts();
    assert_eq!(decodes.len(), 1, "{decodes:?}");
    assert!(
        decodes[0].body.get("kv_transfer_params").is_none(),
        "{}",
        decodes[0].body
    );
    assert_eq!(pair_path(&server, "decode_alone_prefill_failed"), 1.0);
    assert!(legs(&server, "prefill", "failed") >= 1.0);
    assert_eq!(legs(&server, "prefill", "answered"), 0.0);
    server.until_idle();
}

#[test]
fn every_vllm_prefill_worker_failing_with_on_prefill_failure_fail_is_an_error() {
    let refused = format!("http://127.0.0.1:{}", closed_port());
    let bad = Fake::start(|_, _| Reply::Json(503, json!({"error": "overloaded"})));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(
        &dir,
        "      mode: vllm\n      on_prefill_failure: fail\n",
        refused,
        bad.url(),
        d.url(),
    );
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 4});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert!((500..600).contains(&status), "{status} {text}");
    let error: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(
        d.posts().is_empty(),
        "no decode leg was sent: {:?}",
        d.posts()
    );
    assert_eq!(pair_path(&server, "decode_alone_prefill_failed"), 0.0);
    server.until_idle();
}

// ---------------------------------------------------------------------------
// SGLang

#[test]
fn conditional_disaggregation_skips_the_prefill_leg_once_the_decode_pool_holds_the_prompt() {
    let p1 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let p2 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    // The decode worker publishes no KV events: the router credits it with
    // what it was sent (the prompt it received from the prefill worker).
    let server = vllm_server_with(
        &dir,
        "      mode: vllm\n      decode_alone_within_tokens: 32\n",
        "",
        ", kv_events: approximate",
        [p1.url(), p2.url(), d.url()],
    );
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 4});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 200, "{text}\n{}", server.log());
    // A cold decode pool: the prompt is computed apart.
    assert_eq!(pair_path(&server, "prefill_decode"), 1.0);
    assert_eq!(all_posts(&[&p1, &p2]).len(), 1);
    // The same prompt again, once the credit is in the index (it is queued
    // without waiting): the decode worker holds all of it but the last
    // partial block, within 32 tokens, so no prefill leg goes out.
    let mut skipped = false;
    for _ in 0..50 {
        let before = all_posts(&[&p1, &p2]).len();
        let (status, text) = post(&server, "/v1/completions", &body);
        assert_eq!(status, 200, "{text}");
        if pair_path(&server, "decode_alone_cached") >= 1.0 {
            assert_eq!(
                all_posts(&[&p1, &p2]).len(),
                before,
                "a skipped prefill leg was sent"
            );
            skipped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        skipped,
        "the warm decode pool never served the prompt alone\n{}",
        server.log()
    );
    let last = d.posts().pop().expect("a decode request");
    assert!(
        last.body.get("kv_transfer_params").is_none(),
        "{}",
        last.body
    );
    // A prompt the decode pool has not seen still goes through a prefill worker.
    let before = all_posts(&[&p1, &p2]).len();
    let other = json!({"model": MODEL, "prompt": format!("Something else entirely. {TEXT}"), "max_tokens": 4});
    let (status, _) = post(&server, "/v1/completions", &other);
    assert_eq!(status, 200);
    assert_eq!(all_posts(&[&p1, &p2]).len(), before + 1);
    server.until_idle();
}

#[test]
fn the_decode_leg_s_kv_fetch_names_the_prefill_worker_as_the_source_of_its_blocks() {
    let p = Fake::start(|_, _| sglang_prefill_answer());
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let yaml = config_yaml(
        "      mode: sglang\n",
        "",
        &[
            W(1, "prefill", "sglang", p.url(), ", runtime_data: {router_hint: true, router_hint_worker_type: prefill, router_hint_source_control_endpoints: {\"0\": \"tcp://10.0.0.1:5557\"}}"),
            W(2, "decode", "sglang", d.url(), ", runtime_data: {router_hint: true, router_hint_worker_type: decode, router_hint_source_control_endpoints: {\"0\": \"tcp://10.0.0.2:5557\"}}"),
        ],
    )
    .replace(
        "  decode: dynamo-default-cost-fn\n",
        "  decode:\n    type: dynamo-default-cost-fn\n    hints:\n      - type: kv_fetch\n",
    );
    let server = serve(&dir, &yaml);
    let body = json!({"text": TEXT, "sampling_params": {"max_new_tokens": 4}});
    let (status, text) = post(&server, "/generate", &body);
    assert_eq!(status, 200, "{text}\n{}", server.log());
    let decode = d.posts().pop().expect("the decode leg");
    let actions = decode.body["kv_hints"]["actions"]
        .as_array()
        .unwrap_or_else(|| panic!("the decode leg carries a hint: {}", decode.body));
    assert_eq!(actions.len(), 1, "{actions:?}");
    assert_eq!(actions[0]["action_type"], "kv.fetch");
    let payload = &actions[0]["payload"];
    // The prefill worker, not a decode peer, is the blocks' source: every
    // full block of the prompt, which the decode worker holds none of.
    assert_eq!(payload["source_control_endpoint"], "tcp://10.0.0.1:5557");
    let blocks = payload["block_hashes"].as_array().expect("block_hashes");
    let prompt_tokens = decode.body["input_ids"]
        .as_array()
        .expect("input_ids")
        .len();
    assert_eq!(blocks.len(), prompt_tokens / 16, "{payload}");
    // The prefill leg's own booking made no fetch (no peer holds the prompt).
    let prefill = p.posts().pop().expect("the prefill leg");
    assert!(prefill.body.get("kv_hints").is_none(), "{}", prefill.body);
    assert_eq!(metric_or_zero(&server, "kvhint_hints_delivered_total"), 1.0);
    server.until_idle();
}

/// Waits (bounded) until `fake` has a POST that `done` accepts.
fn until_recorded(fake: &Fake, what: &str, done: impl Fn(&Recorded) -> bool) {
    for _ in 0..500 {
        if fake.posts().iter().any(&done) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what}: {:?}", fake.posts());
}

#[test]
fn a_client_leaving_during_the_prefill_leg_aborts_it_on_its_engine_and_releases_both_legs() {
    let p1 = Fake::start(|_, _| Reply::Hang);
    let p2 = Fake::start(|_, _| Reply::Hang);
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", p1.url(), p2.url(), d.url());
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 4});
    let client = kvhint_e2e::http::raw_post(server.address(), "/v1/completions", &body);
    let prefill_of = |f: &Fake| !f.posts().is_empty();
    for _ in 0..500 {
        if prefill_of(&p1) || prefill_of(&p2) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let prefill = if prefill_of(&p1) { &p1 } else { &p2 };
    assert_eq!(prefill.posts().len(), 1, "the prefill leg is out");
    drop(client);
    // The router closes the prefill leg's connection: the engine aborts it.
    until_recorded(prefill, "the prefill leg was never abandoned", |r| {
        r.abandoned
    });
    server.until_idle();
    assert!(d.posts().is_empty(), "no decode leg after the client left");
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"client_disconnect\"}"
        ),
        2.0,
        "both legs released as the client's leaving"
    );
}

#[test]
fn a_silent_prefill_leg_times_out_and_releases_both_legs() {
    let p1 = Fake::start(|_, _| Reply::Hang);
    let p2 = Fake::start(|_, _| Reply::Hang);
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = vllm_server_with(
        &dir,
        "      mode: vllm\n",
        "  response_timeout_ms: 300\n",
        "",
        [p1.url(), p2.url(), d.url()],
    );
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 4});
    let (status, text) = post(&server, "/v1/completions", &body);
    assert_eq!(status, 504, "{text}\n{}", server.log());
    assert!(text.contains("prefill leg"), "{text}");
    assert_eq!(legs(&server, "prefill", "timed_out"), 1.0);
    server.until_idle();
    assert!(d.posts().is_empty());
    let held: Vec<Recorded> = all_posts(&[&p1, &p2]);
    assert_eq!(held.len(), 1);
    until_recorded(
        if p1.posts().is_empty() { &p2 } else { &p1 },
        "the silent prefill leg's connection was never closed",
        |r| r.abandoned,
    );
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"response_timeout\"}"
        ),
        1.0
    );
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"pair_abandoned\"}"
        ),
        1.0
    );
}

#[test]
fn a_decode_stream_gone_silent_is_cut_at_the_idle_timeout_and_both_legs_end_released() {
    let p1 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let p2 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let d = Fake::start(|_, _| {
        Reply::Stall(vec![
            json!({"id": "d", "object": "text_completion", "created": 0,
            "model": MODEL, "choices": [{"index": 0, "text": "first", "finish_reason": null}]}),
        ])
    });
    let dir = private_dir();
    let server = vllm_server_with(
        &dir,
        "      mode: vllm\n",
        "  idle_timeout_ms: 400\n",
        "",
        [p1.url(), p2.url(), d.url()],
    );
    let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 64, "stream": true});
    // The head and the first token come; then the stream is cut (the
    // connection closes without the stream's end).
    let mut client = kvhint_e2e::http::raw_post(server.address(), "/v1/completions", &body);
    let got = kvhint_e2e::http::read_some(&mut client, 1 << 20);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("first"), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    until_recorded(
        &d,
        "the silent decode leg's connection was never closed",
        |r| r.abandoned,
    );
    server.until_idle();
    let released = |reason: &str| {
        metric_or_zero(
            &server,
            &format!("kvhint_gateway_releases_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(released("idle_timeout"), 1.0, "the decode leg");
    assert_eq!(
        released("completed"),
        1.0,
        "the prefill leg, read to its end"
    );
    assert_eq!(legs(&server, "decode", "answered"), 1.0);
}

#[test]
fn a_healthy_decode_stream_longer_than_the_idle_timeout_is_never_cut() {
    let p1 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    let p2 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
    // Ten tokens 100 ms apart: a second in all, past a 300 ms idle timeout,
    // but never silent that long.
    let d = Fake::start(|_, _| {
        let token = |i: usize| {
            json!({"id": "d", "object": "text_completion", "created": 0, "model": MODEL,
                   "choices": [{"index": 0, "text": format!("t{i} "), "finish_reason": null}]})
        };
        Reply::Paced((0..10).map(token).collect(), Duration::from_millis(100))
    });
    let dir = private_dir();
    let server = vllm_server_with(
        &dir,
        "      mode: vllm\n",
        "  idle_timeout_ms: 300\n  response_timeout_ms: 300\n",
        "",
        [p1.url(), p2.url(), d.url()],
    );
    for _ in 0..3 {
        let body = json!({"model": MODEL, "prompt": TEXT, "max_tokens": 10, "stream": true});
        let (status, text) = post(&server, "/v1/completions", &body);
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("t9") && text.contains("[DONE]"), "{text}");
    }
    server.until_idle();
    let released = |reason: &str| {
        metric_or_zero(
            &server,
            &format!("kvhint_gateway_releases_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(released("completed"), 6.0, "both legs of three requests");
    assert_eq!(released("idle_timeout"), 0.0);
}

#[test]
fn each_pool_keeps_its_own_cache_affinity() {
    // Every worker is credited with what it was sent (no KV events): a
    // prompt's repeats find it on the prefill worker and on the decode worker
    // that took it first, the two pools' pictures apart (one shared picture
    // is what collapses a peer's disaggregated routing to random).
    let prefills: Vec<Fake> = (0..2)
        .map(|_| Fake::start(|_, _| vllm_prefill_answer(Some(kv_params()))))
        .collect();
    let decodes: Vec<Fake> = (0..2)
        .map(|_| Fake::start(|r, _| decode_answer(r)))
        .collect();
    let dir = private_dir();
    let approximate = ", kv_events: approximate";
    let server = serve(
        &dir,
        &config_yaml(
            "      mode: vllm\n",
            "",
            &[
                W(1, "prefill", "vllm", prefills[0].url(), approximate),
                W(2, "prefill", "vllm", prefills[1].url(), approximate),
                W(3, "decode", "vllm", decodes[0].url(), approximate),
                W(4, "decode", "vllm", decodes[1].url(), approximate),
            ],
        ),
    );
    let prompts: Vec<String> = (0..4)
        .map(|i| format!("Conversation {i} about something quite different. {TEXT} {TEXT}"))
        .collect();
    for _round in 0..3 {
        for (i, prompt) in prompts.iter().enumerate() {
            // `user` passes through untouched: it tells the legs' prompts apart.
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2,
                              "user": format!("p{i}")});
            let (status, text) = post(&server, "/v1/completions", &body);
            assert_eq!(status, 200, "{text}");
            // The credit is queued without waiting: let it land.
            std::thread::sleep(Duration::from_millis(30));
        }
    }
    let took = |fakes: &[Fake], i: usize| -> Vec<usize> {
        let user = format!("p{i}");
        (0..fakes.len())
            .filter(|&w| {
                fakes[w]
                    .posts()
                    .iter()
                    .any(|r| r.body["user"] == user.as_str())
            })
            .collect()
    };
    for i in 0..prompts.len() {
        let (p, d) = (took(&prefills, i), took(&decodes, i));
        assert_eq!(
            p.len(),
            1,
            "prompt {i}'s prefill legs went to prefill workers {p:?}"
        );
        assert_eq!(
            d.len(),
            1,
            "prompt {i}'s decode legs went to decode workers {d:?}"
        );
    }
    server.until_idle();
}

fn room_of(r: &Recorded) -> u64 {
    r.body["bootstrap_room"]
        .as_u64()
        .unwrap_or_else(|| panic!("no bootstrap_room: {}", r.body))
}

#[test]
fn sglang_legs_are_sent_at_once_in_one_minted_room_naming_the_prefill_bootstrap_server() {
    let p1 = Fake::start(|_, _| sglang_prefill_answer());
    let p2 = Fake::start(|_, _| sglang_prefill_answer());
    let d = Fake::start(|r, _| decode_answer(r));
    let dir = private_dir();
    let server = serve(
        &dir,
        &config_yaml(
            "      mode: sglang\n",
            "",
            &[
                W(
                    1,
                    "prefill",
                    "sglang",
                    p1.url(),
                    ", runtime_data: {disaggregation_bootstrap_port: 9001}",
                ),
                W(2, "prefill", "sglang", p2.url(), ""),
                W(3, "decode", "sglang", d.url(), ""),
            ],
        ),
    );
    let mut rooms = Vec::new();
    for (i, (path, body)) in [
        (
            "/generate",
            json!({"model": MODEL, "text": TEXT, "sampling_params": {"max_new_tokens": 8}, "bootstrap_room": 7}),
        ),
        (
            "/generate",
            json!({"model": MODEL, "text": TEXT, "sampling_params": {"max_new_tokens": 8}}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 8, "bootstrap_room": 7}),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (status, text) = post(&server, path, &body);
        assert_eq!(status, 200, "{text}\n{}", server.log());
        assert!(text.contains("decoded"), "{text}");
        let decode = d.posts()[i].clone();
        assert_eq!(decode.path, path);
        // The prefill leg is drained in the background: wait for its record.
        let prefill = Waiting::new("the prefill leg", Duration::from_secs(10)).until(|| {
            all_posts(&[&p1, &p2])
                .into_iter()
                .find(|p| p.body["bootstrap_room"] == decode.body["bootstrap_room"])
        });
        assert_eq!(prefill.path, path);
        let port = if p1.posts().iter().any(|p| room_of(p) == room_of(&prefill)) {
            9001
        } else {
            8998
        };
        for leg in [&prefill, &decode] {
            assert_eq!(leg.body["bootstrap_host"], "127.0.0.1", "{}", leg.body);
            assert_eq!(leg.body["bootstrap_port"], port, "{}", leg.body);
            assert_eq!(leg.body["disagg_prefill_dp_rank"], 0, "{}", leg.body);
            assert!(room_of(leg) < 1 << 63);
        }
        assert_eq!(room_of(&prefill), room_of(&decode));
        assert_ne!(room_of(&decode), 7, "the client's room is replaced");
        rooms.push(room_of(&decode));
    }
    rooms.sort_unstable();
    rooms.dedup();
    assert_eq!(rooms.len(), 3, "a room per request: {rooms:?}");
    assert_eq!(pair_path(&server, "prefill_decode"), 3.0);
    assert_eq!(legs(&server, "prefill", "answered"), 3.0);
    server.until_idle();
}

#[test]
fn a_failing_sglang_prefill_abandons_the_waiting_decode_leg_and_books_the_pair_again() {
    // Rooms the decode worker was sent, so the failing prefill answers only
    // once its decode leg is waiting there.
    let waiting: Arc<Mutex<Vec<Value>>> = Arc::default();
    let seen = Arc::clone(&waiting);
    let bad = Fake::start(move |r, _| {
        let room = r.body["bootstrap_room"].clone();
        for _ in 0..500 {
            if seen.lock().unwrap().contains(&room) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Reply::Json(503, json!({"error": "overloaded"}))
    });
    let good = Fake::start(|_, _| sglang_prefill_answer());
    let record = Arc::clone(&waiting);
    let d = Fake::start(move |r, _| {
        record
            .lock()
            .unwrap()
            .push(r.body["bootstrap_room"].clone());
        if r.body["bootstrap_port"] == 9001 {
            // Its KV would come from the failing prefill worker: it waits.
            Reply::Hang
        } else {
            decode_answer(r)
        }
    });
    let dir = private_dir();
    let server = serve(
        &dir,
        &config_yaml(
            "      mode: sglang\n",
            "",
            &[
                W(
                    1,
                    "prefill",
                    "sglang",
                    bad.url(),
                    ", runtime_data: {disaggregation_bootstrap_port: 9001}",
                ),
                W(2, "prefill", "sglang", good.url(), ""),
                W(3, "decode", "sglang", d.url(), ""),
            ],
        ),
    );
    for i in 0..20 {
        let body = json!({"model": MODEL, "text": format!("{i}: {TEXT}"), "sampling_params": {"max_new_tokens": 4}});
        let (status, text) = post(&server, "/generate", &body);
        assert_eq!(status, 200, "{text}\n{}", server.log());
        assert!(text.contains("decoded"), "{text}");
        if !bad.posts().is_empty() {
            break;
        }
    }
    let failed = bad.posts();
    assert!(
        !failed.is_empty(),
        "the failing prefill worker was never tried"
    );
    // The decode leg that waited on it was abandoned: its connection closed.
    Waiting::new("the abandoned decode leg", Duration::from_secs(10))
        .report(|| format!("{:?}", d.posts()))
        .until(|| {
            d.posts()
                .iter()
                .filter(|r| r.body["bootstrap_port"] == 9001)
                .all(|r| r.abandoned)
                .then_some(())
        });
    let abandoned: Vec<_> = d.posts().into_iter().filter(|r| r.abandoned).collect();
    assert_eq!(abandoned.len(), failed.len());
    for (gone, prefill) in abandoned.iter().zip(&failed) {
        assert_eq!(room_of(gone), room_of(prefill));
    }
    // Every request's answering pair went to the good prefill worker.
    let answered: Vec<_> = d.posts().into_iter().filter(|r| !r.abandoned).collect();
    assert!(answered.iter().all(|r| r.body["bootstrap_port"] == 8998));
    assert_eq!(legs(&server, "prefill", "failed"), failed.len() as f64);
    assert_eq!(
        metric_or_zero(
            &server,
            "kvhint_gateway_releases_total{reason=\"pair_abandoned\"}"
        ),
        failed.len() as f64
    );
    server.until_idle();
}

// ---------------------------------------------------------------------------
// The engines' own code

/// Runs `validate_disagg_body.py` on `body`; its one JSON line, which must say ok.
fn validate(dir: &Path, engine: &str, route: &str, leg: &str, body: &Value) -> Value {
    let file = dir.join(format!("{engine}-{route}-{leg}.json"));
    std::fs::write(&file, serde_json::to_vec(body).unwrap()).unwrap();
    let wheel = vllm_plugin_wheel();
    run_checker(
        "validate_disagg_body.py",
        &[
            "--wheel".as_ref(),
            wheel.as_os_str(),
            engine.as_ref(),
            route.as_ref(),
            leg.as_ref(),
            file.as_os_str(),
        ],
    )
}

/// The first value under `key` anywhere in `value`.
fn find<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    match value {
        Value::Object(map) => map
            .get(key)
            .or_else(|| map.values().find_map(|v| find(v, key))),
        Value::Array(items) => items.iter().find_map(|v| find(v, key)),
        _ => None,
    }
}

#[test]
fn each_leg_s_body_passes_the_engines_own_code() {
    let work = private_dir();
    // vLLM: completions and chat.
    {
        let p1 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
        let p2 = Fake::start(|_, _| vllm_prefill_answer(Some(kv_params())));
        let d = Fake::start(|r, _| decode_answer(r));
        let dir = private_dir();
        let server = vllm_server(&dir, "      mode: vllm\n", p1.url(), p2.url(), d.url());
        for (route, path, body) in [
            (
                "completions",
                "/v1/completions",
                json!({"model": MODEL, "prompt": TEXT, "max_tokens": 8, "stream": true}),
            ),
            (
                "chat",
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": TEXT}],
                       "max_completion_tokens": 8}),
            ),
        ] {
            p1.clear();
            p2.clear();
            d.clear();
            let (status, text) = post(&server, path, &body);
            assert_eq!(status, 200, "{text}");
            let prefill = all_posts(&[&p1, &p2]).remove(0);
            let decode = d.posts().remove(0);
            validate(work.path(), "vllm", route, "prefill", &prefill.body);
            validate(work.path(), "vllm", route, "decode", &decode.body);
        }
    }
    // SGLang: generate and chat; both legs decode the same room.
    {
        let p = Fake::start(|_, _| sglang_prefill_answer());
        let d = Fake::start(|r, _| decode_answer(r));
        let dir = private_dir();
        let server = serve(
            &dir,
            &config_yaml(
                "      mode: sglang\n",
                "",
                &[
                    W(
                        1,
                        "prefill",
                        "sglang",
                        p.url(),
                        ", runtime_data: {disaggregation_bootstrap_port: 9001}",
                    ),
                    W(2, "decode", "sglang", d.url(), ""),
                ],
            ),
        );
        for (route, path, body) in [
            (
                "generate",
                "/generate",
                json!({"model": MODEL, "text": TEXT, "sampling_params": {"max_new_tokens": 8}}),
            ),
            (
                "chat",
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 8}),
            ),
        ] {
            p.clear();
            d.clear();
            let (status, text) = post(&server, path, &body);
            assert_eq!(status, 200, "{text}");
            let prefill = Waiting::new("the prefill leg", Duration::from_secs(10))
                .until(|| p.posts().into_iter().next());
            let decode = d.posts().remove(0);
            let a = validate(work.path(), "sglang", route, "prefill", &prefill.body);
            let b = validate(work.path(), "sglang", route, "decode", &decode.body);
            let (ra, rb) = (find(&a, "bootstrap_room"), find(&b, "bootstrap_room"));
            assert!(ra.is_some() && ra == rb, "one room: {a}\n{b}");
            assert_eq!(ra.unwrap(), &decode.body["bootstrap_room"]);
            assert_eq!(find(&b, "bootstrap_port"), Some(&json!(9001)), "{b}");
        }
    }
}

// ---------------------------------------------------------------------------
// Disconnects

/// A tiny pseudo-random delay (0 to 2 ms), different per call.
fn jitter() {
    static N: AtomicU64 = AtomicU64::new(0x2545_f491_4f6c_dd1d);
    let n = N.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    let z = (n ^ (n >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    std::thread::sleep(Duration::from_micros((z >> 40) % 2_000));
}

#[test]
fn a_thousand_vllm_pairs_cut_off_at_random_points_leave_nothing_open() {
    let p1 = Fake::start(|_, _| {
        jitter();
        vllm_prefill_answer(Some(kv_params()))
    });
    let p2 = Fake::start(|_, _| {
        jitter();
        vllm_prefill_answer(Some(kv_params()))
    });
    let d = Fake::start(|r, _| {
        jitter();
        decode_answer(r)
    });
    let dir = private_dir();
    let server = vllm_server(&dir, "      mode: vllm\n", p1.url(), p2.url(), d.url());
    let ends = cut_off_requests(server.address(), MODEL, 8, 125, 0x5eed_d15a);
    assert_eq!(ends.iter().sum::<usize>(), 1000);
    server.until_idle();
    let text = metrics(&server);
    let released = sum_of(&text, "kvhint_gateway_releases_total{");
    let booked = sum_of(&text, "kvhint_bookings_total{");
    assert_eq!(released, booked, "every booking released once:\n{text}");
    assert!(
        booked > 500.0,
        "most requests were booked: {booked}\n{text}"
    );
    assert!(pair_path(&server, "prefill_decode") > 250.0, "{text}");
}

// ---------------------------------------------------------------------------
// kvhint check

/// `kvhint check` on `yaml`: exits 1 with exactly this one located error
/// (the temporary directory cut from the front), and says so.
fn check_refuses(yaml: &str, expected: &str) {
    let fixture = config_file(yaml);
    let output = Command::new(kvhint_bin())
        .args(["check", "--config"])
        .arg(&fixture.path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter_map(|l| Some(&l[l.find("kvhint.yaml:")?..]))
        .collect();
    assert_eq!(errors, [expected], "{stderr}");
    assert!(stderr.contains("1 error found"), "{stderr}");
}

#[test]
fn kvhint_check_locates_every_disaggregation_it_could_not_serve() {
    let t = qwen3_tokenizer_dir().display().to_string();
    let head = |model_extra: &str, disaggregation: &str| {
        format!(
            "router:\n  block_size: 16\n\
             worker_selection:\n  prefill: dynamo-default-cost-fn\n  decode: dynamo-default-cost-fn\n  aggregated: dynamo-default-cost-fn\n\
             models:\n  m:\n    tokenizer: {t}\n{model_extra}    disaggregation:\n{disaggregation}\
             workers:\n"
        )
    };
    let worker = |id: u64, role: &str, engine: &str, extra: &str| {
        format!("  - {{worker_id: {id}, role: {role}, engine: {engine}, http_endpoint: \"http://10.0.0.{id}:8000\", models: [m]{extra}}}\n")
    };
    let pair = |engine: &str| {
        format!(
            "{}{}",
            worker(1, "prefill", engine, ""),
            worker(2, "decode", engine, "")
        )
    };
    // Lines: 1 router, 2 block_size, 3 worker_selection, 4-6 roles, 7 models,
    // 8 m, 9 tokenizer, then the model's extra lines, disaggregation, its keys.
    check_refuses(
        &format!(
            "{}{}",
            head("    role: decode\n", "      mode: vllm\n"),
            pair("vllm")
        ),
        "kvhint.yaml:10:11: models.m.role: model m is disaggregated: its prompts are booked on role prefill and its answers on role decode; remove `role`",
    );
    check_refuses(
        &format!(
            "{}{}{}",
            head("", "      mode: vllm\n"),
            pair("vllm"),
            worker(3, "aggregated", "vllm", "")
        ),
        "kvhint.yaml:15:6: workers[2]: worker 3 serves model m, which is disaggregated, as role aggregated; give it `role: prefill` or `role: decode` (the engine's --disaggregation-mode), or take m out of its models",
    );
    check_refuses(
        &format!(
            "{}{}{}",
            head("", "      mode: vllm\n"),
            pair("vllm"),
            worker(3, "prefill", "sglang", "")
        ),
        "kvhint.yaml:15:6: workers[2]: worker 3 is a prefill worker of model m, which is disaggregated with mode vllm: both pools of a pair run vllm, whose hand-over the router speaks",
    );
    check_refuses(
        &format!(
            "{}{}",
            head(
                "",
                "      mode: sglang\n      decode_alone_within_tokens: 64\n"
            ),
            pair("sglang")
        ),
        "kvhint.yaml:12:7: models.m.disaggregation.decode_alone_within_tokens: an SGLang decode server (--disaggregation-mode decode) cannot compute a prompt itself, so the prefill leg is never skipped: remove `decode_alone_within_tokens`",
    );
    check_refuses(
        &format!(
            "{}{}",
            head("", "      mode: sglang\n      on_prefill_failure: decode_alone\n"),
            pair("sglang")
        ),
        "kvhint.yaml:12:7: models.m.disaggregation.on_prefill_failure: an SGLang decode server (--disaggregation-mode decode) cannot compute a prompt itself: a request whose prefill fails on every prefill worker fails; set `on_prefill_failure: fail` or remove it",
    );
    check_refuses(
        &format!(
            "{}{}{}",
            head("", "      mode: vllm\n"),
            pair("vllm"),
            worker(
                3,
                "prefill",
                "vllm",
                ", runtime_data: {disaggregation_bootstrap_port: 9001}"
            )
        ),
        "kvhint.yaml:15:6: workers[2]: worker 3 has runtime_data.disaggregation_bootstrap_port, which only an SGLang prefill worker serves (its --disaggregation-bootstrap-port); remove it",
    );
}
