//! The gateway's config sections (`models:`, `workers:`, `gateway:`) and a worker
//! registration's HTTP fields: every mistake is refused with its place (file,
//! YAML path, line and column, or the API field) and what to write instead. Each
//! case asserts the whole list of errors.

use kvhint_e2e::errors::{config_errors as errors, config_errors_naming};
use kvhint_e2e::{private_dir, Server};
use serde_json::json;

const ROLES: &str = "worker_selection:\n  aggregated: dynamo-default-cost-fn\n";

#[test]
fn a_worker_entry_s_mistakes_are_each_located() {
    let yaml = format!(
        "{ROLES}workers:\n\
         \x20 - worker_id: 1\n\
         \x20   http_endpoint: ftp://10.0.0.7:8000\n\
         \x20   engine: vllm\n\
         \x20   models: [m]\n\
         \x20   api_key_file: no-such.key\n\
         \x20 - worker_id: 2\n\
         \x20   http_endpoint: http://10.0.0.8\n\
         \x20   engine: tgi\n\
         \x20   models: []\n\
         \x20   kv_events: sometimes\n\
         \x20 - worker_id: 3\n\
         \x20   engin: sglang\n"
    );
    assert_eq!(
        errors(&yaml),
        vec![
            "kvhint.yaml:5:20: workers[0].http_endpoint: http_endpoint is \"ftp://10.0.0.7:8000\": write the engine's HTTP address like http://10.0.0.7:8000 or https://worker-1.example:443",
            "kvhint.yaml:8:19: workers[0].api_key_file: <dir>/no-such.key: there is no such file; write the worker's API key in it, readable by this user only: `(umask 077; cat > <dir>/no-such.key)`",
            "kvhint.yaml:10:20: workers[1].http_endpoint: http_endpoint is \"http://10.0.0.8\": name the port, like http://10.0.0.7:8000 or https://worker-1.example:443",
            "kvhint.yaml:11:13: workers[1].engine: unknown engine `tgi`; expected one of: vllm, sglang, trtllm, llamacpp, openai",
            "kvhint.yaml:12:13: workers[1].models: `models` is a non-empty list of model names, like [qwen3-8b]",
            "kvhint.yaml:13:16: workers[1].kv_events: `kv_events` is `approximate` (the engine publishes none) or where it publishes, {endpoint: tcp://…, replay_endpoint: …}",
            "kvhint.yaml:14:5: workers[2]: a worker needs `http_endpoint`: where the engine serves HTTP, like http://10.0.0.7:8000",
            "kvhint.yaml:14:5: workers[2]: a worker needs `engine`: which adapter talks to it: vllm, sglang, trtllm, llamacpp or openai",
            "kvhint.yaml:14:5: workers[2]: a worker needs `models`: the model names it serves, as clients write them in `model`",
            "kvhint.yaml:15:5: workers[2].engin: unknown key `engin` (did you mean `engine`?); expected one of: worker_id, dp_size, role, runtime_data, http_endpoint, engine, models, kv_events, kv_capacity_tokens, api_key_file",
        ]
    );
}

#[test]
fn kv_capacity_tokens_is_a_positive_count_for_approximate_workers_only() {
    let yaml = format!(
        "{ROLES}workers:\n\
         \x20 - worker_id: 1\n\
         \x20   http_endpoint: http://10.0.0.7:8000\n\
         \x20   engine: llamacpp\n\
         \x20   models: [m]\n\
         \x20   kv_events: approximate\n\
         \x20   kv_capacity_tokens: 0\n\
         \x20 - worker_id: 2\n\
         \x20   http_endpoint: http://10.0.0.8:8000\n\
         \x20   engine: vllm\n\
         \x20   models: [m]\n\
         \x20   kv_capacity_tokens: 65536\n"
    );
    assert_eq!(
        errors(&yaml),
        vec![
            "kvhint.yaml:9:25: workers[0].kv_capacity_tokens: expected a whole number from 1 to 1099511627776, found `0`",
            "kvhint.yaml:14:25: workers[1].kv_capacity_tokens: `kv_capacity_tokens` bounds what the router credits a `kv_events: approximate` worker with; this worker is not one (a worker whose engine publishes KV events says what it holds): remove it, or set `kv_events: approximate`",
        ]
    );
}

#[test]
fn a_model_without_its_tokenizer_names_the_file() {
    assert_eq!(
        errors(&format!("{ROLES}models:\n  qwen3:\n    tokenizer: no-such-dir\n")),
        vec![
            "kvhint.yaml:4:3: models.qwen3.tokenizer: <dir>/no-such-dir/tokenizer.json: not found: a model's tokenizer directory holds the tokenizer.json and tokenizer_config.json its engine loads (as on the model's hub page); point `tokenizer` at the model's tokenizer directory"
        ]
    );
    assert_eq!(
        errors(&format!("{ROLES}models:\n  other:\n    role: decode\n")),
        vec![
            "kvhint.yaml:4:3: models.other: a model needs `tokenizer`: the directory holding its tokenizer.json and tokenizer_config.json (the files its engine loads)"
        ]
    );
}

#[test]
fn a_model_booked_under_a_role_the_config_does_not_configure_is_refused() {
    let tokenizer = kvhint_e2e::llamacpp::qwen3_tokenizer_dir();
    assert_eq!(
        errors(&format!(
            "{ROLES}models:\n  m:\n    tokenizer: {}\n    role: decode\n",
            tokenizer.display()
        )),
        vec![
            "kvhint.yaml:4:3: models.m.role: model m is booked under role decode, which `worker_selection` does not configure: add `worker_selection.decode` or set this model's `role`"
        ]
    );
}

#[test]
fn a_broken_tokenizer_file_is_a_located_error() {
    let dir = private_dir();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        "{\"not\": \"a tokenizer\"}",
    )
    .unwrap();
    let yaml = format!(
        "{ROLES}models:\n  m:\n    tokenizer: {}\n",
        dir.path().display()
    );
    // The text after "can load: " is the HF tokenizers library's own error,
    // matched exactly rather than normalized: it is serde_json's parse error
    // (tokenizers reads tokenizer.json with serde_json and passes the error on),
    // whose wording has not changed in years, and Cargo.lock pins both crates.
    // If an upgrade changes it, this is where to look at what a user now reads.
    assert_eq!(
        config_errors_naming(&yaml, &[(dir.path(), "<tokenizer>")]),
        vec![
            "kvhint.yaml:4:3: models.m.tokenizer: <tokenizer>/tokenizer.json: not a tokenizer HF tokenizers can load: expected `,` or `}` at line 1 column 7; point `tokenizer` at the model's tokenizer directory"
        ]
    );
}

#[test]
fn gateway_settings_out_of_range_are_located() {
    let yaml = format!(
        "{ROLES}gateway:\n  max_attempts: 0\n  idle_timeout_ms: fast\n  health:\n    failures: 0\n    every: 1\n    paths: {{tgi: /health, sglang: health_generate}}\n  tokenizer_cache_mib: 4096000\n  tracing:\n    otlp_endpoint: 127.0.0.1:4317\n    sample_percent: 101\n  tls_ca_file: no-such-ca.pem\n  prefix_wait_min_tokens: lots\n  credit_in_flight: sometimes\n  anticipate_evictions: often\n"
    );
    assert_eq!(
        errors(&yaml),
        vec![
            "kvhint.yaml:4:17: gateway.max_attempts: expected a whole number from 1 to 10, found `0`",
            "kvhint.yaml:5:20: gateway.idle_timeout_ms: expected a whole number from 1 to 86400000, found `fast`",
            "kvhint.yaml:7:15: gateway.health.failures: expected a whole number from 1 to 100, found `0`",
            "kvhint.yaml:8:5: gateway.health.every: unknown key `every`; expected one of: interval_ms, timeout_ms, failures, successes, paths",
            "kvhint.yaml:9:13: gateway.health.paths.tgi: unknown engine `tgi`; expected one of: vllm, sglang, trtllm, llamacpp, openai",
            "kvhint.yaml:9:35: gateway.health.paths.sglang: health path \"health_generate\": an absolute path on the worker, like /health or /health_generate (at most 256 characters, no spaces)",
            "kvhint.yaml:10:24: gateway.tokenizer_cache_mib: expected a whole number from 0 to 1048576, found `4096000`",
            "kvhint.yaml:12:20: gateway.tracing.otlp_endpoint: \"127.0.0.1:4317\" is not an OTLP/gRPC address; write it like http://127.0.0.1:4317",
            "kvhint.yaml:13:21: gateway.tracing.sample_percent: expected a whole number from 0 to 100, found `101`",
            "kvhint.yaml:14:16: gateway.tls_ca_file: <dir>/no-such-ca.pem: there is no such file; point `tls_ca_file` at the PEM file of the CA certificates that signed the workers' certificates",
            "kvhint.yaml:15:27: gateway.prefix_wait_min_tokens: expected a whole number from 0 to 16777216, found `lots`",
            "kvhint.yaml:16:21: gateway.credit_in_flight: unknown value `sometimes`; expected one of: true, false",
            "kvhint.yaml:17:25: gateway.anticipate_evictions: unknown value `often`; expected one of: true, false",
        ]
    );
}

#[test]
fn a_registration_s_http_fields_are_checked_and_the_error_names_the_field() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, ROLES).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let cases = [
        (
            json!({"worker_id": 1, "role": "aggregated", "http_endpoint": "http://10.0.0.7:8000/v1", "engine": "vllm", "models": ["m"]}),
            "worker 1 rank 0: http_endpoint is \"http://10.0.0.7:8000/v1\": only a scheme, host and port, like http://10.0.0.7:8000 or https://worker-1.example:443 (no path, query or user info)",
        ),
        (
            json!({"worker_id": 1, "role": "aggregated", "http_endpoint": "http://10.0.0.7:8000", "models": ["m"]}),
            "worker 1 rank 0: engine is missing: say which engine serves http://10.0.0.7:8000 (vllm, sglang, trtllm, llamacpp, openai)",
        ),
        (
            json!({"worker_id": 1, "role": "aggregated", "engine": "vllm", "models": ["m"]}),
            "worker 1 rank 0: http_endpoint is missing: `engine` and `models` say how the gateway forwards to a worker, which needs its http_endpoint, like http://10.0.0.7:8000",
        ),
        (
            json!({"worker_id": 1, "role": "aggregated", "http_endpoint": "http://10.0.0.7:8000", "engine": "vllm", "models": []}),
            "worker 1 rank 0: models is empty: list the model names http://10.0.0.7:8000 serves, as clients name them in `model`",
        ),
        (
            json!({"worker_id": 1, "role": "aggregated", "http_endpoint": "http://10.0.0.7:8000", "engine": "vllm", "models": ["m"], "kv_capacity_tokens": 4096}),
            "worker 1 rank 0: kv_capacity_tokens is only for `kv_events: approximate` workers: a worker whose engine publishes KV events tells the router what it holds; remove it",
        ),
        (
            json!({"worker_id": 1, "role": "aggregated", "http_endpoint": "http://10.0.0.7:8000", "engine": "llamacpp", "models": ["m"], "kv_events": "approximate", "kv_capacity_tokens": 0}),
            "worker 1 rank 0: kv_capacity_tokens is 0: give the tokens of KV the engine holds (its KV cache and any prompt cache), or leave it out to have the router learn it",
        ),
    ];
    for (body, detail) in cases {
        let (status, reply) = server.post("/workers", &body);
        assert_eq!(status, 422, "{body}: {reply}");
        assert_eq!(reply["detail"], detail, "{body}: {reply}");
    }
    let (status, reply) = server.post(
        "/workers",
        &json!({"worker_id": 1, "role": "aggregated", "engine": "nginx"}),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["detail"]
            .as_str()
            .unwrap()
            .contains("unknown variant `nginx`"),
        "{reply}"
    );
    assert_eq!(server.status()["workers"], json!([]));
}

#[test]
fn a_registration_at_the_router_s_own_address_or_past_max_workers_is_refused() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(&config, format!("{ROLES}gateway:\n  max_workers: 2\n")).unwrap();
    let server = Server::start(&config, &[], dir.path());
    let port = server.address().rsplit_once(':').unwrap().1.to_string();
    let worker = |id: u64, endpoint: &str| json!({"worker_id": id, "role": "aggregated", "http_endpoint": endpoint, "engine": "vllm", "models": ["m"]});
    // The router's own address, as written or as `localhost`: every request
    // sent there would come back to it.
    for endpoint in [server.base.clone(), format!("http://localhost:{port}")] {
        let (status, reply) = server.post("/workers", &worker(1, &endpoint));
        assert_eq!(status, 422, "{endpoint}: {reply}");
        let detail = reply["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("this router's own address"), "{reply}");
    }
    // Two workers fit; a third does not; updating one already there does.
    for id in [1, 2] {
        let (status, reply) =
            server.post("/workers", &worker(id, &format!("http://10.0.0.{id}:8000")));
        assert_eq!(status, 201, "{reply}");
    }
    let (status, reply) = server.post("/workers", &worker(3, "http://10.0.0.3:8000"));
    assert_eq!(status, 503, "{reply}");
    assert_eq!(reply["error"], "too_many_workers", "{reply}");
    assert!(
        reply["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("gateway.max_workers (2)"),
        "{reply}"
    );
    let (status, reply) = server.post("/workers", &worker(2, "http://10.0.0.9:8000"));
    assert_eq!(status, 200, "{reply}");
    // A config that lists more than it allows says so, at its `workers`.
    let yaml = format!(
        "{ROLES}gateway:\n  max_workers: 1\nworkers:\n  - {{worker_id: 1, http_endpoint: \"http://10.0.0.1:8000\", engine: vllm, models: [m]}}\n  - {{worker_id: 2, http_endpoint: \"http://10.0.0.2:8000\", engine: vllm, models: [m]}}\n"
    );
    assert_eq!(
        errors(&yaml),
        vec!["kvhint.yaml:6:3: workers: 2 workers, more than gateway.max_workers (1); raise it, or list fewer"]
    );
}

/// Issue 45: each model's prompts are encoded by the fast encoder where it
/// passes its self-test at load, unless the model's entry pins 0.23
/// (`encoder: hf`, an operator's way back from a release candidate); status
/// says which, and why.
#[test]
fn a_model_s_encoder_is_chosen_by_its_self_test_unless_the_config_pins_hf() {
    let tokenizer = kvhint_e2e::llamacpp::qwen3_tokenizer_dir();
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!(
            "{ROLES}models:\n  chosen:\n    tokenizer: {t}\n  pinned:\n    tokenizer: {t}\n    encoder: hf\n",
            t = tokenizer.display()
        ),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    let models = server.status()["models"].clone();
    assert_eq!(
        models,
        json!([
            {"name": "chosen", "encoder": "tokenizers 1.0.0-rc.3", "encoder_fallback": null,
             "content_format": "string", "content_format_origin": "detected"},
            {"name": "pinned", "encoder": "tokenizers 0.23.2",
             "encoder_fallback": "tokenizers 0.23.2 was asked for (`encoder: hf`)",
             "content_format": "string", "content_format_origin": "detected"},
        ]),
        "{models}"
    );
    drop(server);
    assert_eq!(
        errors(&format!(
            "{ROLES}models:\n  m:\n    tokenizer: {}\n    encoder: fast\n",
            tokenizer.display()
        )),
        vec![
            "kvhint.yaml:6:14: models.m.encoder: unknown encoder `fast`; expected one of: auto, hf"
        ]
    );
}

/// A model's chat template gets each message's content in vLLM's content
/// format for it, detected from the template ("string" for Qwen3's, which
/// reads content as text) unless the entry sets
/// `chat_template_content_format` (as vLLM's `--chat-template-content-format`);
/// status says which and where it came from; another value is a located error.
#[test]
fn a_model_s_content_format_is_detected_unless_the_config_sets_it() {
    let tokenizer = kvhint_e2e::llamacpp::qwen3_tokenizer_dir();
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    std::fs::write(
        &config,
        format!(
            "{ROLES}models:\n  detected:\n    tokenizer: {t}\n  parts:\n    tokenizer: {t}\n    \
             chat_template_content_format: openai\n  text:\n    tokenizer: {t}\n    \
             chat_template_content_format: string\n",
            t = tokenizer.display()
        ),
    )
    .unwrap();
    let server = Server::start(&config, &[], dir.path());
    let formats: Vec<_> = server.status()["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| json!([m["name"], m["content_format"], m["content_format_origin"]]))
        .collect();
    assert_eq!(
        formats,
        vec![
            json!(["detected", "string", "detected"]),
            json!(["parts", "openai", "configured"]),
            json!(["text", "string", "configured"]),
        ]
    );
    drop(server);
    assert_eq!(
        errors(&format!(
            "{ROLES}models:\n  m:\n    tokenizer: {}\n    chat_template_content_format: list\n",
            tokenizer.display()
        )),
        vec![
            "kvhint.yaml:6:35: models.m.chat_template_content_format: unknown content format \
             `list`; expected one of: auto, string, openai"
        ]
    );
}

/// A worker the config lists leaves when a reload no longer lists it (and a rank
/// past a lowered `dp_size` with it), whether or not it publishes KV events:
/// the fleet once followed only the listed workers with a KV-event source, so
/// an engine taken out of `workers:` kept being sent requests.
#[test]
fn a_worker_the_config_no_longer_lists_is_deregistered_on_reload() {
    let dir = private_dir();
    let config = dir.path().join("kvhint.yaml");
    let listing = |workers: &[(u64, u32)]| {
        let mut yaml = format!("{ROLES}workers:\n");
        for (id, dp_size) in workers {
            yaml.push_str(&format!(
                "  - {{worker_id: {id}, dp_size: {dp_size}, http_endpoint: \"http://10.0.0.{id}:8000\", engine: llamacpp, models: [m], kv_events: approximate}}\n"
            ));
        }
        yaml
    };
    let registered = |server: &Server| -> Vec<(u64, u64)> {
        let mut keys: Vec<(u64, u64)> = server.status()["workers"]
            .as_array()
            .expect("status lists the workers")
            .iter()
            .map(|w| {
                (
                    w["worker_id"].as_u64().unwrap_or(u64::MAX),
                    w["dp_rank"].as_u64().unwrap_or(u64::MAX),
                )
            })
            .collect();
        keys.sort();
        keys
    };
    std::fs::write(&config, listing(&[(1, 2), (2, 1)])).unwrap();
    let server = Server::start(&config, &[], dir.path());
    assert_eq!(registered(&server), [(1, 0), (1, 1), (2, 0)]);
    // A worker registered by its own call is its own: a reload of a config
    // that never listed it leaves it.
    let own = json!({"worker_id": 3, "role": "aggregated", "http_endpoint": "http://10.0.0.3:8000", "engine": "vllm", "models": ["m"]});
    assert_eq!(server.post("/workers", &own).0, 201);
    std::fs::write(&config, listing(&[(1, 1)])).unwrap();
    let (status, reply) = server.post("/admin/reload", &json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(registered(&server), [(1, 0), (3, 0)]);
}
