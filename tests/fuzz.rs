//! Bounded property tests ("fuzzing") of the three parsers that take input from
//! outside: the config parser, the HTTP API's request bodies (through the real
//! handlers, in process), and the trace reader. Each target runs a fixed
//! number of cases, [`CASES`] unless `PROPTEST_CASES` says otherwise, so CI's
//! `cargo test --workspace` stays quick; inputs are random text and mutations
//! of valid inputs (the bundled examples and the API's documented bodies).
//!
//! Properties: nothing panics; every config error names the file and a
//! position (a line and column, or a YAML path); every API answer is a JSON
//! body, a failure is `{"error", "detail"}` and never a 5xx other than 503 for
//! a documented reason; every bad trace line is reported as `trace:LINE:` and
//! counted, and the replay carries on.

use kvhint::config::{self, ConfigError};
use kvhint_e2e::{private_dir, workspace_root, TempDir};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Cases per target (override with `PROPTEST_CASES`).
const CASES: u32 = 512;

fn runner() -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    TestRunner::new(ProptestConfig {
        cases,
        // Nothing written into the source tree; a failure prints its input.
        failure_persistence: None,
        ..ProptestConfig::default()
    })
}

/// Mutations of `seed`: up to eight edits, each deleting a range, inserting
/// one of `tokens`, duplicating a range or replacing a character.
fn mutated(seed: String, tokens: &'static [&'static str]) -> impl Strategy<Value = String> {
    let chars: Vec<char> = seed.chars().collect();
    let n = chars.len().max(1);
    proptest::collection::vec((0..4u8, 0..n, 0..n, 0..tokens.len(), any::<char>()), 0..5).prop_map(
        move |edits| {
            let mut text = chars.clone();
            for (kind, a, b, token, ch) in edits {
                let len = text.len();
                if len == 0 {
                    text.extend(tokens[token].chars());
                    continue;
                }
                let (a, b) = (a % len, b % len);
                let lo = a.min(b);
                let hi = a.max(b).min(lo.saturating_add(16)).min(len);
                match kind {
                    0 => {
                        text.drain(lo..hi);
                    }
                    1 => {
                        for (i, c) in tokens[token].chars().enumerate() {
                            text.insert((a + i).min(text.len()), c);
                        }
                    }
                    2 => {
                        let copy: Vec<char> = text[lo..hi].to_vec();
                        for (i, c) in copy.into_iter().enumerate() {
                            text.insert((b + i).min(text.len()), c);
                        }
                    }
                    _ => text[a] = ch,
                }
            }
            text.into_iter().collect()
        },
    )
}

// ------------------------------------------------------------------ config

const YAML_TOKENS: &[&str] = &[
    "\n",
    "  ",
    ": ",
    "- ",
    "---\n",
    "...\n",
    "{",
    "}",
    "[",
    "]",
    ",",
    "'",
    "\"",
    "#",
    "&a ",
    "*a",
    "!tag ",
    "? ",
    "|\n",
    ">\n",
    "~",
    "null",
    "true",
    "0",
    "-1",
    "1e400",
    "18446744073709551616",
    "\t",
    "\u{feff}",
    "\u{0}",
    "é",
    "type: ",
    "hints: ",
    "parameters: ",
    "worker_selection:\n",
    "router:\n",
    "plugins:\n",
    "kv_events:\n",
    "decode: ",
    "kvcr",
    "kv_fetch",
    "block_size: ",
    "sources:\n",
    "media: ",
    "<<: ",
    "%YAML 1.2\n",
];

/// Valid configs to mutate: the bundled examples and the YAML blocks of the
/// README and `docs/` (the configuration reference, the gateway's and the
/// engines' fleets).
fn config_seeds() -> Vec<String> {
    let root = workspace_root();
    let mut seeds = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("examples")) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) == Some("yaml") {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    seeds.push(text);
                }
            }
        }
    }
    let mut docs = vec![root.join("README.md")];
    if let Ok(entries) = std::fs::read_dir(root.join("docs")) {
        let mut more: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        more.sort();
        docs.extend(
            more.into_iter()
                .filter(|p| p.extension().is_some_and(|e| e == "md")),
        );
    }
    for doc in docs {
        let text = std::fs::read_to_string(doc).unwrap_or_default();
        for block in text.split("```yaml\n").skip(1) {
            if let Some(end) = block.find("```") {
                seeds.push(block[..end].to_string());
            }
        }
    }
    seeds.push(
        "worker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.5}\n    hints:\n      - type: kv_fetch\n        name: f\n        parameters: {min_additional_blocks: 2}\n  prefill: dynamo-default-cost-fn\nrouter: {mode: kv, block_size: 16, seed: 3}\n".into(),
    );
    assert!(seeds.len() >= 3, "seeds found: {}", seeds.len());
    seeds
}

/// Every error names the file, and a line and column within the text (or a
/// YAML path, for an error about a whole section).
fn check_config_errors(file: &Path, text: &str, errors: &[ConfigError]) -> Result<(), String> {
    // YAML breaks lines at `\n`, `\r\n` and a lone `\r`.
    let lines = text.replace("\r\n", "\n").matches(['\n', '\r']).count() + 1;
    for error in errors {
        let shown = error.to_string();
        if error.file != file {
            return Err(format!("error names another file: {shown}"));
        }
        match &error.at {
            Some(at) if at.line > 0 => {
                if at.line > lines || at.column == 0 {
                    return Err(format!(
                        "position {}:{} outside the text ({lines} lines): {shown}",
                        at.line, at.column
                    ));
                }
            }
            Some(at) if !at.path.is_empty() => {}
            _ => return Err(format!("error without a location: {shown}")),
        }
        if error.message.trim().is_empty() {
            return Err(format!("error without a message: {shown}"));
        }
    }
    Ok(())
}

fn config_case(text: &str) -> Result<(), TestCaseError> {
    let file = PathBuf::from("/fuzz/kvhint.yaml");
    let (parsed, errors) = config::parse_lenient(&file, text);
    check_config_errors(&file, text, &errors).map_err(TestCaseError::fail)?;
    // The strict entry point agrees with the lenient one.
    match config::parse(&file, text) {
        Ok(_) => prop_assert!(errors.is_empty() && parsed.is_some()),
        Err(strict) => prop_assert_eq!(strict.0, errors),
    }
    Ok(())
}

#[test]
fn fuzz_the_config_parser_with_random_text() {
    let text = proptest::collection::vec(
        prop_oneof![
            4 => proptest::sample::select(YAML_TOKENS.to_vec()).prop_map(str::to_string),
            1 => any::<char>().prop_map(String::from),
            2 => "[a-z_]{1,12}",
        ],
        0..60,
    )
    .prop_map(|parts| parts.concat());
    runner()
        .run(&text, |text| config_case(&text))
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn fuzz_the_config_parser_with_mutated_examples() {
    let strategy =
        proptest::sample::select(config_seeds()).prop_flat_map(|seed| mutated(seed, YAML_TOKENS));
    runner()
        .run(&strategy, |text| config_case(&text))
        .unwrap_or_else(|e| panic!("{e}"));
}

// --------------------------------------------------------------- HTTP API

const JSON_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\\",
    "null",
    "true",
    "-1",
    "0",
    "1e999",
    "-0.5",
    "18446744073709551616",
    "4294967296",
    "\"\"",
    "\"x\"",
    "\u{0}",
    "\"\\ud800\"",
    "{}",
    "[]",
    "\"hint\":",
    "\"hints\":[],",
    "\"actions\":[]",
    "\"role\":\"decode\",",
    "\"dp_rank\":",
    "\"token_ids\":",
    "\"event\":",
    "\"stored\":",
    "\"removed\":",
    "\"cleared\":null",
    "\"block_hashes\":",
    "\"blocks\":",
    "\"runtime_data\":",
    "\"router_hint\":",
];

/// The API's documented bodies, by endpoint.
fn api_seeds() -> Vec<(&'static str, String)> {
    vec![
        ("/workers", json!({"worker_id": 3, "dp_rank": 0, "role": "decode", "runtime_data": {"router_hint": true, "router_hint_worker_type": "decode", "router_hint_source_control_endpoints": {"0": "tcp://10.0.0.3:23280"}}}).to_string()),
        ("/kv_events", json!({"worker_id": 1, "dp_rank": 0, "event": {"stored": {"parent_block_hash": null, "blocks": [{"block_hash": 11, "token_ids": [1, 2, 3, 4]}, {"block_hash": 12, "token_ids": [5, 6, 7, 8]}]}}}).to_string()),
        ("/kv_events", json!({"worker_id": 1, "event": {"removed": {"block_hashes": [11, 12]}}}).to_string()),
        ("/kv_events", json!({"worker_id": 2, "event": {"cleared": null}}).to_string()),
        ("/book", json!({"request_id": "r", "role": "decode", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "session_context": {"s": 1}, "lora_name": "a", "cache_salt": "b"}).to_string()),
        ("/release", json!({"request_id": "r"}).to_string()),
    ]
}

struct Api {
    app: Arc<kvhint::service::App>,
    /// Answers by status, to show the cases reached the handlers.
    statuses: std::cell::RefCell<std::collections::BTreeMap<u16, u64>>,
    runtime: tokio::runtime::Runtime,
    _dir: TempDir,
}

impl Api {
    fn new() -> Api {
        let dir = private_dir();
        let config = dir.path().join("kvhint.yaml");
        std::fs::write(
            &config,
            "router: {block_size: 4, max_prompt_tokens: 4096}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.5}\n  aggregated:\n    type: dynamo-default-cost-fn\n    hints: [{type: kv_fetch}]\n",
        )
        .unwrap();
        let app = kvhint::service::build_app(&kvhint::service::ServeOptions {
            config,
            mode: None,
            listen: "127.0.0.1:0".parse().unwrap(),
            watch_config: false,
            max_body_bytes: 64 << 10,
            booking_threads: Some(1),
            connections: Default::default(),
            allow_unauthenticated: false,
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let api = Api {
            app,
            statuses: Default::default(),
            runtime,
            _dir: dir,
        };
        for id in [1, 2] {
            let body = json!({"worker_id": id, "role": "decode", "runtime_data": {"router_hint": true, "router_hint_worker_type": "decode", "router_hint_source_control_endpoints": {"0": format!("tcp://10.0.0.{id}:23280")}}});
            let (status, answer) = api.call(
                "POST",
                "/workers",
                "application/json",
                body.to_string().into_bytes(),
            );
            assert!(status == 201 || status == 200, "{answer}");
        }
        api
    }

    /// One request through the real routes and handlers, without a socket.
    fn call(&self, method: &str, uri: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        use tower::ServiceExt;
        let routes = kvhint::service::routes(Arc::clone(&self.app), 64 << 10);
        let request = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", content_type)
            .body(axum::body::Body::from(body))
            .unwrap();
        self.runtime.block_on(async {
            let response =
                tokio::time::timeout(std::time::Duration::from_secs(30), routes.oneshot(request))
                    .await
                    .expect("the API answers within 30 s")
                    .expect("infallible");
            let status = response.status().as_u16();
            *self.statuses.borrow_mut().entry(status).or_default() += 1;
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
                .await
                .expect("a body under 1 MiB");
            let value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            (status, value)
        })
    }
}

fn api_case(api: &Api, method: &str, uri: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    let shown = String::from_utf8_lossy(&body).into_owned();
    let (status, answer) = api.call(method, uri, "application/json", body);
    prop_assert!(
        answer.is_object(),
        "{method} {uri} {shown:?}: {status} answered with a body that is not a JSON object: {answer}"
    );
    if status >= 400 {
        let keys: Vec<&String> = answer
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        prop_assert!(
            answer["error"].is_string() && answer["detail"].is_string() && keys.len() == 2,
            "{method} {uri} {shown:?}: {status} not in the error shape: {answer}"
        );
        let code = answer["error"].as_str().unwrap_or_default();
        prop_assert!(
            status < 500 || (status == 503 && ["no_workers", "overloaded"].contains(&code)),
            "{method} {uri} {shown:?}: {status} {answer}"
        );
    }
    Ok(())
}

#[test]
fn fuzz_the_api_request_bodies_through_the_handlers() {
    let api = Api::new();
    let seeds = api_seeds();
    let endpoints: Vec<&'static str> = seeds.iter().map(|(e, _)| *e).collect();
    // Mutated documented bodies, sent to their own endpoint or another one.
    let mutated_bodies = (
        0..seeds.len(),
        proptest::sample::select(endpoints.clone()),
        any::<bool>(),
    )
        .prop_flat_map(move |(i, other, same)| {
            let (endpoint, seed) = seeds[i].clone();
            mutated(seed, JSON_TOKENS)
                .prop_map(move |body| (if same { endpoint } else { other }, body.into_bytes()))
        });
    // Arbitrary bytes, and arbitrary JSON values.
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z_]{0,10}".prop_map(Value::from),
    ];
    let values = leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    proptest::sample::select(vec![
                        "worker_id",
                        "dp_rank",
                        "role",
                        "runtime_data",
                        "event",
                        "stored",
                        "removed",
                        "blocks",
                        "block_hash",
                        "token_ids",
                        "request_id",
                        "session_context",
                        "lora_name",
                        "cache_salt",
                        "parent_block_hash",
                        "router_hint",
                        "hint"
                    ])
                    .prop_map(str::to_string),
                    "[a-z_]{1,8}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    // Documented bodies with one field (at the top or one level down) replaced
    // by an arbitrary value, or removed: valid JSON, mostly wrong types.
    let field_seeds = api_seeds();
    let replaced_fields = (
        0..field_seeds.len(),
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        proptest::option::of(values.clone()),
    )
        .prop_map(move |(i, outer, inner, value)| {
            let (endpoint, seed) = &field_seeds[i];
            let mut body: Value = serde_json::from_str(seed).expect("a JSON seed");
            let mut target = &mut body;
            for pick in [outer, inner] {
                let Some(map) = target.as_object_mut() else {
                    break;
                };
                let keys: Vec<String> = map.keys().cloned().collect();
                let key = keys[pick.index(keys.len())].clone();
                if map[&key].is_object() && pick.index(2) == 0 {
                    target = map.get_mut(&key).expect("the key just listed");
                    continue;
                }
                match value {
                    Some(value) => map.insert(key, value),
                    None => map.remove(&key),
                };
                break;
            }
            (*endpoint, body.to_string().into_bytes())
        });
    let random_bodies = (
        proptest::sample::select(endpoints),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            values.prop_map(|v| v.to_string().into_bytes()),
        ],
    );
    let strategy = prop_oneof![2 => mutated_bodies, 2 => replaced_fields, 1 => random_bodies];
    runner()
        .run(&strategy, |(endpoint, body)| {
            api_case(&api, "POST", endpoint, body)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // Path and query parameters of the one endpoint that takes them.
    let deregister = ("[0-9a-z%-]{0,24}", "[0-9a-z=&%-]{0,16}");
    runner()
        .run(&deregister, |(id, query)| {
            api_case(
                &api,
                "DELETE",
                &format!("/workers/{id}?{query}"),
                Vec::new(),
            )
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // The cases reached the handlers: some were accepted, some refused.
    let statuses = api.statuses.borrow().clone();
    eprintln!("answers by status: {statuses:?}");
    assert!(
        statuses.keys().any(|s| (200..300).contains(s))
            && statuses.keys().any(|s| (400..500).contains(s) && *s != 400),
        "{statuses:?}"
    );
    // The service still books afterwards.
    let (status, answer) = api.call(
        "POST",
        "/book",
        "application/json",
        json!({"request_id": "after-the-fuzz", "role": "aggregated", "token_ids": [1, 2, 3, 4]})
            .to_string()
            .into_bytes(),
    );
    assert!(status == 200 || status == 503, "{status} {answer}");
}

// ------------------------------------------------------------ trace reader

/// The bundled example's trace and a config for it that needs no plugin file.
fn trace_setup() -> (
    kvhint::snapshot::Snapshot,
    kvhint::loader::Loader,
    String,
    TempDir,
) {
    let fixture = kvhint_e2e::config_file(
        "router: {block_size: 4}\nworker_selection:\n  decode:\n    type: kvcr\n    parameters: {shared_cache_multiplier: 0.75}\n  aggregated:\n    type: dynamo-default-cost-fn\n    hints: [{type: kv_fetch}]\n  prefill: dynamo-default-cost-fn\n",
    );
    let (snapshot, loader) =
        kvhint_e2e::snapshot_of(&fixture, None).unwrap_or_else(|e| panic!("{e}"));
    let trace = std::fs::read_to_string(workspace_root().join("examples/trace.jsonl")).unwrap();
    (snapshot, loader, trace, fixture.dir)
}

fn trace_case(snapshot: &kvhint::snapshot::Snapshot, trace: &[u8]) -> Result<(), TestCaseError> {
    let router = kvhint::router::Router::new(snapshot.block_size);
    let mut out = Vec::new();
    let mut err = Vec::new();
    let summary = kvhint::replay::replay(
        &router,
        snapshot,
        Path::new("trace.jsonl"),
        trace,
        &mut out,
        &mut err,
    );
    let summary = match summary {
        Ok(summary) => summary,
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "the replay stopped instead of reporting the line: {e}"
            )))
        }
    };
    let lines = trace.split(|&b| b == b'\n').count();
    let err = String::from_utf8_lossy(&err);
    let mut reported = 0;
    for line in err.lines() {
        reported += 1;
        let number = line
            .strip_prefix("trace.jsonl:")
            .and_then(|rest| rest.split(':').next())
            .and_then(|n| n.parse::<usize>().ok());
        prop_assert!(
            number.is_some_and(|n| n >= 1 && n <= lines),
            "an error line without its trace line: {line:?}"
        );
    }
    prop_assert_eq!(summary.errors, reported);
    for line in String::from_utf8_lossy(&out).lines() {
        prop_assert!(serde_json::from_str::<Value>(line).is_ok(), "{line}");
    }
    Ok(())
}

#[test]
fn fuzz_the_trace_reader() {
    let (snapshot, _loader, trace, _dir) = trace_setup();
    let mutated_traces = mutated(trace, JSON_TOKENS).prop_map(String::into_bytes);
    let random_lines = proptest::collection::vec(
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..40),
            proptest::sample::select(JSON_TOKENS.to_vec()).prop_map(|t| t.as_bytes().to_vec()),
            Just(b"{\"type\":\"request\",\"request_id\":\"x\",\"role\":\"decode\",\"token_ids\":[1,2,3,4]}".to_vec()),
            Just(b"{\"type\":\"release\",\"request_id\":\"x\"}".to_vec()),
        ],
        0..12,
    )
    .prop_map(|lines| lines.join(&b'\n'));
    let strategy = prop_oneof![mutated_traces, random_lines];
    runner()
        .run(&strategy, |trace| trace_case(&snapshot, &trace))
        .unwrap_or_else(|e| panic!("{e}"));
}
