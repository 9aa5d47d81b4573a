//! The gateway delivers the router's hint to the engines that take one over
//! HTTP, checked with the engines' own code:
//!
//! - SGLang 0.5.23: two SGLang workers behind `kvhint serve`, whose `http_endpoint`s
//!   are capture servers started here (they record each body and answer a fixed
//!   SGLang-shaped `/generate`); the peer's KV blocks are fed by SGLang's own
//!   publisher (`tests/engines/sglang_publisher.py`), so the `kv.fetch` names the
//!   engine's own hashes. A `/generate` with `text` is forwarded with the
//!   tokenizer's `input_ids`, `rid`, `routed_dp_rank` and `kv_hints`, and the body
//!   passes SGLang's own contract gate and strict `KvHintsEnvelope` decoding
//!   (`tests/engines/validate_sglang_body.py`). An OpenAI route to the same
//!   workers carries no `kv_hints` and is counted undeliverable.
//! - vLLM 0.34.0 through kvhint's endpoint plugin (`python/kvhint-vllm`): two vLLM
//!   workers advertising the plugin (`runtime_data.kvhint_endpoint_plugin`), the
//!   peer fed by vLLM 0.23.0's own publisher; `/v1/completions` is forwarded with
//!   `kv_hints`, and that body goes through the plugin under vLLM 0.34.0's own
//!   plugin loader and interface into a stubbed engine client's
//!   `generate(kv_hints=...)`, decoded as vLLM's `KvHintsEnvelope`
//!   (`tests/engines/vllm_endpoint_plugin.py`). Without the flag, the same route
//!   carries no hint and counts it undeliverable.
//!
//! Everything (the Python environment with SGLang, fastapi and tokenizers, the
//! vLLM wheels, the Qwen3 tokenizer) comes from `kvhint_e2e::provision`. Every read
//! from a child or a socket has a deadline.

use kvhint_e2e::engines::capture::Upstream;
use kvhint_e2e::engines::{run_checker, until_joined, Publisher};
use kvhint_e2e::http::{book, book_and_release, metric_or_zero, register_worker, release};
use kvhint_e2e::llamacpp::{hf_ids, qwen3_tokenizer_dir};
use kvhint_e2e::process::free_port;
use kvhint_e2e::provision::vllm_plugin_wheel;
use kvhint_e2e::wait::Waiting;
use kvhint_e2e::{private_dir, workspace_root, Server, TempDir};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

const BLOCK: usize = 16;
const MODEL: &str = "qwen3";

/// A prompt of several 16-token blocks in Qwen3's vocabulary.
const TEXT: &str = "The quick brown fox jumps over the lazy dog while the router decides \
    where the request should go. Every block of sixteen tokens that a peer already holds \
    can be fetched instead of computed again, and the hint names those blocks by the \
    engine's own hashes so that the receiving engine can pull them from its peer. A longer \
    prompt makes more blocks, and more blocks make the test say more about the hashes.";

// ---------------------------------------------------------------------------
// The fleet.

struct Fleet {
    server: Server,
    upstreams: [Upstream; 2],
    dir: TempDir,
}

fn control_endpoint(id: u64) -> String {
    format!("tcp://10.0.0.{id}:23280")
}

/// `kvhint serve` with model `qwen3` booked as decode under kvcr + kv_fetch, and
/// workers 1 and 2 of `engine` (hint-capable, with `extra` runtime data) at two
/// capture servers; worker 2's engine publishes its KV events at `events`.
fn fleet(engine: &str, extra: Value, events: Value) -> Fleet {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!(
            "router:\n  mode: kv\n  block_size: {BLOCK}\n\
             worker_selection:\n  decode:\n    type: kvcr\n    hints:\n      - type: kv_fetch\n\
             models:\n  {MODEL}:\n    tokenizer: {}\n    role: decode\n",
            qwen3_tokenizer_dir().display()
        ),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    let upstreams = [Upstream::start(), Upstream::start()];
    for (id, upstream) in [1u64, 2].iter().zip(&upstreams) {
        let mut runtime_data = json!({
            "router_hint": true, "router_hint_worker_type": "decode",
            "router_hint_source_control_endpoints": {"0": control_endpoint(*id)}});
        for (k, v) in extra.as_object().unwrap() {
            runtime_data[k] = v.clone();
        }
        let mut body = json!({"worker_id": id, "role": "decode", "runtime_data": runtime_data,
                              "http_endpoint": upstream.url(), "engine": engine,
                              "models": [MODEL]});
        if *id == 2 {
            body["kv_events"] = events.clone();
        }
        register_worker(&server, &body);
    }
    Fleet {
        server,
        upstreams,
        dir,
    }
}

/// The engine's BlockStored events for the prompt's full blocks, chained.
fn publish_blocks(publisher: &mut Publisher, ids: &[u32], hashes: &[i64]) {
    let events: Vec<Value> = ids
        .chunks_exact(BLOCK)
        .zip(hashes)
        .enumerate()
        .map(|(i, (tokens, hash))| {
            json!({"type": "BlockStored", "block_hashes": [hash],
                   "parent_block_hash": if i == 0 { Value::Null } else { json!(hashes[i - 1]) },
                   "token_ids": tokens, "block_size": BLOCK, "medium": "GPU"})
        })
        .collect();
    publisher.publish(Value::Array(events), false);
}

/// Waits until worker 2 holds the prompt's `blocks`, then loads it with open
/// bookings of the prompt until kvcr books one on worker 1 with a copy from
/// worker 2 (that booking is released): the next booking of the prompt goes to
/// worker 1 with a `kv.fetch` from worker 2.
fn load_the_holder(server: &Server, ids: &[u32], blocks: usize) {
    let mut n = 0;
    Waiting::new(
        &format!("worker 2 to hold {blocks} blocks"),
        Duration::from_secs(30),
    )
    .report(|| format!("{}\n{}", server.status()["kv_event_sources"], server.log()))
    .until(|| {
        n += 1;
        let booking = book_and_release(server, &format!("probe-{n}"), ids);
        (booking["worker_id"] == 2 && booking["cached_blocks"].as_u64() == Some(blocks as u64))
            .then_some(())
    });
    for i in 0..20 {
        let id = format!("load-{i}");
        let booking = book(server, &id, "decode", ids);
        if booking["worker_id"] == 1 {
            assert_eq!(
                the_fetch(&booking["hint"])["source_control_endpoint"],
                control_endpoint(2),
                "{booking}"
            );
            release(server, &id);
            return;
        }
    }
    panic!(
        "kvcr never booked the prompt away from its loaded holder\n{}",
        server.log()
    );
}

/// [`fleet`] of `engine` workers (with `extra` runtime data), worker 2
/// subscribed to `publisher` on `port`: once the subscription hears it, the
/// prompt's blocks (`ids`, engine `hashes`) are published and the holder
/// loaded ([`load_the_holder`]), so the next booking of the prompt goes to
/// worker 1 with a `kv.fetch` from worker 2.
fn primed_fleet(
    engine: &str,
    extra: Value,
    port: u16,
    publisher: &mut Publisher,
    ids: &[u32],
    hashes: &[i64],
) -> Fleet {
    let fleet = fleet(
        engine,
        extra,
        json!({"endpoint": format!("tcp://127.0.0.1:{port}")}),
    );
    until_joined(&fleet.server, publisher);
    publish_blocks(publisher, ids, hashes);
    load_the_holder(&fleet.server, ids, ids.len() / BLOCK);
    fleet
}

/// The one `kv.fetch` action in an envelope.
fn the_fetch(envelope: &Value) -> &Value {
    let fetches: Vec<&Value> = envelope["actions"]
        .as_array()
        .unwrap_or_else(|| panic!("no actions: {envelope}"))
        .iter()
        .filter(|a| a["action_type"] == "kv.fetch")
        .collect();
    assert_eq!(fetches.len(), 1, "{envelope}");
    &fetches[0]["payload"]
}

fn hashes_of(payload: &Value) -> Vec<i64> {
    payload["block_hashes"]
        .as_array()
        .unwrap_or_else(|| panic!("{payload}"))
        .iter()
        .map(|h| h.as_i64().or_else(|| h.as_u64().map(|u| u as i64)).unwrap())
        .collect()
}

fn write_json(dir: &Path, name: &str, value: &Value) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
    path
}

// ---------------------------------------------------------------------------

#[test]
fn sglang_generate_gets_input_ids_rid_rank_and_a_kv_fetch_its_own_code_accepts() {
    let ids = hf_ids(TEXT);
    let blocks = ids.len() / BLOCK;
    assert!(blocks >= 4, "{} tokens", ids.len());
    // SGLang's hashes are signed 64-bit values.
    let hashes: Vec<i64> = (0..blocks as i64)
        .map(|i| match i {
            0 => -5,
            1 => i64::MIN + 1,
            _ => 77 + 1_000_003 * i,
        })
        .collect();
    let port = free_port();
    let mut publisher = Publisher::sglang(&[
        "--endpoint".into(),
        format!("tcp://127.0.0.1:{port}"),
        "--bind".into(),
    ]);
    let fleet = primed_fleet("sglang", json!({}), port, &mut publisher, &ids, &hashes);
    let server = &fleet.server;

    let (status, reply) = server.post(
        "/generate",
        &json!({"model": MODEL, "text": TEXT, "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(status, 200, "{reply}\n{}", server.log());
    assert_eq!(
        reply["text"], "ok",
        "the engine's answer passes through: {reply}"
    );
    assert!(fleet.upstreams[1].posts("/generate").is_empty());
    let sent = fleet.upstreams[0].posts("/generate");
    assert_eq!(sent.len(), 1, "one forward, to worker 1");
    let body = &sent[0];
    assert_eq!(body["input_ids"], json!(ids), "the tokenizer's ids: {body}");
    assert!(
        body.get("text").is_none() && body.get("model").is_none(),
        "{body}"
    );
    assert_eq!(body["sampling_params"], json!({"max_new_tokens": 1}));
    assert!(
        body["rid"].as_str().is_some_and(|r| !r.is_empty()),
        "{body}"
    );
    assert_eq!(body["routed_dp_rank"], 0, "{body}");
    let fetch = the_fetch(&body["kv_hints"]);
    assert_eq!(fetch["source_control_endpoint"], control_endpoint(2));
    assert_eq!(
        hashes_of(fetch),
        hashes,
        "the kv.fetch names exactly the hashes SGLang's publisher published"
    );

    // SGLang's own contract gate and strict envelope decoding accept it.
    let file = write_json(fleet.dir.path(), "generate.json", body);
    let report = run_checker("validate_sglang_body.py", &[file.as_os_str()]);
    assert_eq!(report["input_ids"], json!(ids));
    assert_eq!(report["rid"], body["rid"]);
    assert_eq!(report["routed_dp_rank"], 0);
    assert_eq!(hashes_of(the_fetch(&report["kv_hints"])), hashes);
    assert_eq!(report["gate_kv_hints"], report["kv_hints"]);
    assert_eq!(metric_or_zero(server, "kvhint_hints_delivered_total "), 1.0);

    // An OpenAI route to SGLang: its OpenAI server drops kv_hints, so none is sent,
    // and the hint is counted undeliverable.
    let undeliverable = "kvhint_hints_undeliverable_total{engine=\"sglang\"} ";
    assert_eq!(metric_or_zero(server, undeliverable), 0.0);
    fleet.upstreams[0].clear();
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": TEXT, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}\n{}", server.log());
    let sent = fleet.upstreams[0].posts("/v1/completions");
    assert_eq!(sent.len(), 1, "to worker 1, which the booking would hint");
    assert!(sent[0].get("kv_hints").is_none(), "{}", sent[0]);
    assert_eq!(sent[0]["prompt"], json!(ids));
    assert_eq!(metric_or_zero(server, undeliverable), 1.0);
    drop(publisher);
}

#[test]
fn a_vllm_worker_with_kvhints_endpoint_plugin_gets_the_hint_into_generate() {
    let ids = hf_ids(TEXT);
    let blocks = ids.len() / BLOCK;
    // vLLM's default integer hashes, below 2^63.
    let hashes: Vec<i64> = (0..blocks as i64)
        .map(|i| 4_000_000_007 * (i + 1))
        .collect();
    let port = free_port();
    // vLLM binds only a wildcard host.
    let mut publisher = Publisher::vllm(&["--endpoint".into(), format!("tcp://*:{port}")]);
    let fleet = primed_fleet(
        "vllm",
        json!({"kvhint_endpoint_plugin": true}),
        port,
        &mut publisher,
        &ids,
        &hashes,
    );
    let server = &fleet.server;

    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": TEXT, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}\n{}", server.log());
    assert_eq!(reply["choices"][0]["text"], "ok", "{reply}");
    let sent = fleet.upstreams[0].posts("/v1/completions");
    assert_eq!(sent.len(), 1, "one forward, to worker 1");
    let body = &sent[0];
    assert_eq!(body["prompt"], json!(ids), "{body}");
    let fetch = the_fetch(&body["kv_hints"]);
    assert_eq!(fetch["source_control_endpoint"], control_endpoint(2));
    assert_eq!(hashes_of(fetch), hashes, "vLLM's publisher's hashes");

    // Through the plugin, under vLLM 0.34.0's own loader and interface, into
    // generate(kv_hints=...) as vLLM's KvHintsEnvelope.
    let file = write_json(fleet.dir.path(), "completions.json", body);
    let plugin = workspace_root().join("python/kvhint-vllm");
    let report = run_checker(
        "vllm_endpoint_plugin.py",
        &[
            "--wheel".as_ref(),
            vllm_plugin_wheel().as_os_str(),
            "--plugin".as_ref(),
            plugin.as_os_str(),
            "--body".as_ref(),
            file.as_os_str(),
        ],
    );
    assert_eq!(report["kv_hints"], body["kv_hints"]);
    assert!(
        report["chat_kv_hints"].is_object(),
        "the chat route too: {report}"
    );
    assert_eq!(metric_or_zero(server, "kvhint_hints_delivered_total "), 1.0);
    let undeliverable = "kvhint_hints_undeliverable_total{engine=\"vllm\"} ";
    assert_eq!(metric_or_zero(server, undeliverable), 0.0);
    drop(publisher);
}

#[test]
fn a_vllm_worker_without_the_plugin_gets_no_hint_and_it_is_counted() {
    let ids = hf_ids(TEXT);
    let blocks = ids.len() / BLOCK;
    let hashes: Vec<i64> = (0..blocks as i64).map(|i| 17 + i).collect();
    let port = free_port();
    // vLLM binds only a wildcard host.
    let mut publisher = Publisher::vllm(&["--endpoint".into(), format!("tcp://*:{port}")]);
    let fleet = primed_fleet("vllm", json!({}), port, &mut publisher, &ids, &hashes);
    let server = &fleet.server;
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": TEXT, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{reply}\n{}", server.log());
    let sent = fleet.upstreams[0].posts("/v1/completions");
    assert_eq!(sent.len(), 1);
    assert!(sent[0].get("kv_hints").is_none(), "{}", sent[0]);
    assert_eq!(
        metric_or_zero(server, "kvhint_hints_undeliverable_total{engine=\"vllm\"} "),
        1.0
    );
    drop(publisher);
}
