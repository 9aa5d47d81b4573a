//! One adapter per engine: what a forwarded request looks like to that engine.
//!
//! Facts from the engines' released code (docs/gateway.md, "What reaches the
//! engine", and docs/gateway-hints.md have the table per engine and route):
//! - a pre-tokenized completion prompt goes as `prompt: [ids]` (vLLM, SGLang,
//!   TRT-LLM, llama.cpp), so the engine computes exactly the tokens the router
//!   hashed; SGLang's native `/generate` takes `input_ids`;
//! - the request id goes in `X-Request-Id` (vLLM) or `rid` (SGLang `/generate`);
//!   the dp rank in `X-data-parallel-rank` (vLLM, SGLang's OpenAI routes) or
//!   `routed_dp_rank` (SGLang `/generate`);
//! - a hint reaches an engine only where it takes one: SGLang's `/generate`
//!   `kv_hints`, and a vLLM worker that runs kvhint's endpoint plugin
//!   (`python/kvhint-vllm`, advertised by `runtime_data.kvhint_endpoint_plugin:
//!   true`), whose `/v1/completions` and `/v1/chat/completions` take a body's
//!   `kv_hints` to `generate(kv_hints=...)`. SGLang's OpenAI routes and llama.cpp
//!   drop unknown keys silently, TRT-LLM refuses them with 400, and vLLM's own
//!   OpenAI server ignores them; there the hint is counted as not deliverable and
//!   never sent.
//!
//! Chat requests go as the client wrote them: every engine renders the chat with
//! the model's own template, which the router renders too (with ids golden-tested
//! equal to the engine's), so both hash the same tokens.

use crate::domain::{Engine, HttpTarget, WorkerKey};
use crate::splice::{Body, Edits};

/// The front door's routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// SGLang's native `POST /generate`.
    Generate,
    /// `POST /v1/embeddings`: forwarded as the client wrote it.
    Embeddings,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Generate => "/generate",
            Self::Embeddings => "/v1/embeddings",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
            Self::Generate => "generate",
            Self::Embeddings => "embeddings",
        }
    }

    /// Whether `engine` serves this route at all.
    pub fn served_by(self, engine: Engine) -> bool {
        match self {
            Self::Chat | Self::Completions | Self::Embeddings => true,
            Self::Generate => engine == Engine::Sglang,
        }
    }
}

/// What happened to a booking's hint on its way to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintDelivery {
    /// The booking carried none.
    None,
    /// In the forwarded request, where the engine reads it.
    Delivered,
    /// The engine has no field that takes it on this route: not sent, counted.
    Undeliverable,
}

/// The request to send to the booked worker.
#[derive(Debug)]
pub struct Forward {
    pub path: &'static str,
    pub body: Vec<u8>,
    /// Headers the adapter adds (request id, dp rank).
    pub headers: Vec<(&'static str, String)>,
    pub hint: HintDelivery,
}

/// The prompt as the router tokenized it, for adapters that forward ids, and,
/// on a leg of a disaggregated pair, what the engine's hand-over needs.
pub struct Prompt<'a> {
    pub token_ids: &'a [u32],
    pub handover: Option<Handover<'a>>,
}

/// One leg of a disaggregated pair, as its engine's body says it
/// (`docs/disaggregation.md` has the fields, from each engine's released code).
#[derive(Debug, Clone, Copy)]
pub enum Handover<'a> {
    /// SGLang, either leg (`PDRoutingFields` on its OpenAI routes, the same
    /// fields on `/generate`'s `GenerateReqInput`): the prefill worker's
    /// bootstrap server, the room the router minted for this pair, and the
    /// prefill worker's dp rank (`disagg_prefill_dp_rank`, on both legs, so
    /// that neither server derives it from the room).
    Sglang {
        prefill: bool,
        host: &'a str,
        port: u16,
        room: u64,
        prefill_dp_rank: u32,
    },
    /// vLLM's prefill leg: `kv_transfer_params` asking for a remote decode,
    /// one token, no stream (what vLLM's own disaggregated proxy sends).
    VllmPrefill,
    /// vLLM's decode leg: the `kv_transfer_params` the prefill answered with
    /// (raw JSON, passed as it came).
    VllmDecode { kv_transfer_params: &'a str },
}

/// What a vLLM prefill leg asks of its engine's KV connector.
pub const VLLM_PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Builds what `target` is sent for a request on `route`, booked on `worker` as
/// `request_id`, with `hint` (the engine message) if the booking made one.
pub fn build_forward(
    target: &HttpTarget,
    route: Route,
    body: &Body<'_>,
    prompt: &Prompt<'_>,
    worker: WorkerKey,
    request_id: &str,
    hint: Option<&str>,
) -> Forward {
    let mut edits = Edits::default();
    let mut headers: Vec<(&'static str, String)> = Vec::new();
    let ids = || ids_json(prompt.token_ids);
    let mut delivered = false;
    let engine = target.engine;
    match (engine, route) {
        (Engine::Sglang, Route::Generate) => {
            if body.has("text") {
                edits.remove("text");
            }
            // `/generate` has no `model` field (its request is a dataclass that
            // refuses unknown ones); the router used it to choose the tokenizer.
            if body.has("model") {
                edits.remove("model");
            }
            edits.set("input_ids", ids());
            edits.set("rid", json_string(request_id));
            edits.set("routed_dp_rank", worker.dp_rank.to_string());
            if let Some(hint) = hint {
                edits.set("kv_hints", hint.to_string());
                delivered = true;
            }
        }
        (_, Route::Generate) => {}
        (Engine::Openai, _) => {}
        (_, Route::Completions) => {
            edits.set("prompt", ids());
        }
        (_, Route::Chat | Route::Embeddings) => {}
    }
    match prompt.handover {
        None => {}
        Some(Handover::Sglang {
            prefill,
            host,
            port,
            room,
            prefill_dp_rank,
        }) => {
            edits.set("bootstrap_host", json_string(host));
            edits.set("bootstrap_port", port.to_string());
            edits.set("bootstrap_room", room.to_string());
            edits.set("disagg_prefill_dp_rank", prefill_dp_rank.to_string());
            if prefill {
                // Its answer is drained, never shown: one body, not a stream.
                one_answer(body, &mut edits);
            }
        }
        Some(Handover::VllmPrefill) => {
            edits.set("kv_transfer_params", VLLM_PREFILL_PARAMS.to_string());
            edits.set("max_tokens", "1".into());
            for key in ["max_completion_tokens"] {
                if body.has(key) {
                    edits.set(key, "1".into());
                }
            }
            // A floor above the one token would be refused (vLLM checks
            // min_tokens <= max_tokens).
            if body.has("min_tokens") {
                edits.remove("min_tokens");
            }
            one_answer(body, &mut edits);
        }
        Some(Handover::VllmDecode { kv_transfer_params }) => {
            edits.set("kv_transfer_params", kv_transfer_params.to_string());
        }
    }
    // kvhint's vLLM endpoint plugin takes the envelope on the OpenAI routes.
    if let (Engine::Vllm, Route::Completions | Route::Chat, true, Some(hint)) =
        (engine, route, target.hint_plugin, hint)
    {
        edits.set("kv_hints", hint.to_string());
        delivered = true;
    }
    match engine {
        Engine::Vllm | Engine::Sglang => {
            headers.push(("x-request-id", request_id.to_string()));
            headers.push(("x-data-parallel-rank", worker.dp_rank.to_string()));
        }
        Engine::Trtllm | Engine::Openai | Engine::Llamacpp => {
            headers.push(("x-request-id", request_id.to_string()));
        }
    }
    Forward {
        path: route.path(),
        body: if edits.is_empty() {
            body.text().as_bytes().to_vec()
        } else {
            body.edited(&edits)
        },
        headers,
        hint: match (hint, delivered) {
            (None, _) => HintDelivery::None,
            (Some(_), true) => HintDelivery::Delivered,
            (Some(_), false) => HintDelivery::Undeliverable,
        },
    }
}

/// A prefill leg answers in one body: `stream` off, its options gone.
fn one_answer(body: &Body<'_>, edits: &mut Edits) {
    if body.has("stream") {
        edits.set("stream", "false".into());
    }
    if body.has("stream_options") {
        edits.remove("stream_options");
    }
}

fn ids_json(ids: &[u32]) -> String {
    let mut out = String::with_capacity(ids.len() * 7 + 2);
    out.push('[');
    let mut buffer = itoa_buffer();
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(buffer.format(*id));
    }
    out.push(']');
    out
}

fn itoa_buffer() -> itoa::Buffer {
    itoa::Buffer::new()
}

fn json_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(engine: Engine, hint_plugin: bool) -> HttpTarget {
        HttpTarget {
            base: "http://127.0.0.1:1".into(),
            authority: "127.0.0.1:1".into(),
            engine,
            models: vec!["m".into()],
            hint_plugin,
            api_key: None,
            bootstrap_port: crate::domain::SGLANG_BOOTSTRAP_PORT,
        }
    }

    fn key(dp_rank: u32) -> WorkerKey {
        WorkerKey {
            worker_id: 7,
            dp_rank,
        }
    }

    #[test]
    fn sglang_generate_takes_ids_rid_rank_and_the_hint() {
        let text = r#"{"model":"m","text":"hello","sampling_params":{"max_new_tokens":4}}"#;
        let body = Body::parse(text).unwrap();
        let hint = r#"{"protocol_version":"0.1","message_id":"r","actions":[]}"#;
        let out = build_forward(
            &target(Engine::Sglang, false),
            Route::Generate,
            &body,
            &Prompt {
                token_ids: &[1, 2, 3],
                handover: None,
            },
            key(2),
            "kvh-1",
            Some(hint),
        );
        assert_eq!(out.hint, HintDelivery::Delivered);
        let sent: serde_json::Value = serde_json::from_slice(&out.body).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({
                "sampling_params": {"max_new_tokens": 4},
                "input_ids": [1, 2, 3],
                "rid": "kvh-1",
                "routed_dp_rank": 2,
                "kv_hints": serde_json::from_str::<serde_json::Value>(hint).unwrap(),
            })
        );
    }

    #[test]
    fn an_openai_route_never_carries_the_hint() {
        let text = r#"{"model":"m","prompt":"hello","max_tokens":4}"#;
        let body = Body::parse(text).unwrap();
        for engine in [
            Engine::Vllm,
            Engine::Sglang,
            Engine::Trtllm,
            Engine::Llamacpp,
            Engine::Openai,
        ] {
            let out = build_forward(
                &target(engine, false),
                Route::Completions,
                &body,
                &Prompt {
                    token_ids: &[9, 8],
                    handover: None,
                },
                key(0),
                "kvh-2",
                Some("{}"),
            );
            assert_eq!(out.hint, HintDelivery::Undeliverable, "{engine}");
            let sent = String::from_utf8(out.body).unwrap();
            assert!(!sent.contains("kv_hints"), "{engine}: {sent}");
            if engine == Engine::Openai {
                assert_eq!(sent, text);
            } else {
                assert_eq!(sent, r#"{"model":"m","prompt":[9,8],"max_tokens":4}"#);
            }
        }
    }

    #[test]
    fn a_vllm_worker_with_the_endpoint_plugin_takes_the_hint_on_openai_routes() {
        let hint = r#"{"protocol_version":"0.1","message_id":"r","actions":[]}"#;
        let cases = [
            (
                Route::Completions,
                r#"{"model":"m","prompt":"hello","max_tokens":4}"#,
                r#"{"model":"m","prompt":[9,8],"max_tokens":4,"kv_hints":{"protocol_version":"0.1","message_id":"r","actions":[]}}"#,
            ),
            (
                Route::Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_hints":{"protocol_version":"0.1","message_id":"r","actions":[]}}"#,
            ),
        ];
        for (route, text, want) in cases {
            let body = Body::parse(text).unwrap();
            let prompt = Prompt {
                token_ids: &[9, 8],
                handover: None,
            };
            let out = build_forward(
                &target(Engine::Vllm, true),
                route,
                &body,
                &prompt,
                key(1),
                "kvh-3",
                Some(hint),
            );
            assert_eq!(out.hint, HintDelivery::Delivered, "{route:?}");
            assert_eq!(out.path, route.path());
            let sent: serde_json::Value = serde_json::from_slice(&out.body).unwrap();
            let want: serde_json::Value = serde_json::from_str(want).unwrap();
            assert_eq!(sent, want, "{route:?}");
            // Without the plugin, the same request carries no hint.
            let out = build_forward(
                &target(Engine::Vllm, false),
                route,
                &body,
                &prompt,
                key(1),
                "kvh-3",
                Some(hint),
            );
            assert_eq!(out.hint, HintDelivery::Undeliverable, "{route:?}");
            assert!(!String::from_utf8(out.body).unwrap().contains("kv_hints"));
        }
        // The flag means nothing on another engine.
        for engine in [
            Engine::Sglang,
            Engine::Trtllm,
            Engine::Llamacpp,
            Engine::Openai,
        ] {
            let body = Body::parse(r#"{"model":"m","prompt":"hello"}"#).unwrap();
            let out = build_forward(
                &target(engine, true),
                Route::Completions,
                &body,
                &Prompt {
                    token_ids: &[9, 8],
                    handover: None,
                },
                key(0),
                "kvh-4",
                Some(hint),
            );
            assert_eq!(out.hint, HintDelivery::Undeliverable, "{engine}");
            assert!(!String::from_utf8(out.body).unwrap().contains("kv_hints"));
        }
    }

    #[test]
    fn an_sglang_pair_names_the_prefill_bootstrap_and_the_routers_room_on_both_legs() {
        // A client's own room is replaced: two pairs in one room collide in
        // SGLang's schedulers.
        let text = r#"{"model":"m","text":"hi","bootstrap_room":7,"stream":true,"stream_options":{"include_usage":true}}"#;
        let body = Body::parse(text).unwrap();
        let leg = |prefill: bool| {
            let out = build_forward(
                &target(Engine::Sglang, false),
                Route::Generate,
                &body,
                &Prompt {
                    token_ids: &[1, 2],
                    handover: Some(Handover::Sglang {
                        prefill,
                        host: "10.0.0.5",
                        port: 9001,
                        room: 1 << 62,
                        prefill_dp_rank: 3,
                    }),
                },
                key(if prefill { 3 } else { 1 }),
                "kvh-5",
                None,
            );
            serde_json::from_slice::<serde_json::Value>(&out.body).unwrap()
        };
        let (prefill, decode) = (leg(true), leg(false));
        for sent in [&prefill, &decode] {
            assert_eq!(sent["bootstrap_host"], "10.0.0.5");
            assert_eq!(sent["bootstrap_port"], 9001);
            assert_eq!(sent["bootstrap_room"], 1u64 << 62);
            assert_eq!(sent["disagg_prefill_dp_rank"], 3);
        }
        // The prefill's answer is drained, not streamed; decode streams as asked.
        assert_eq!(prefill["stream"], false);
        assert!(prefill.get("stream_options").is_none());
        assert_eq!(decode["stream"], true);
        assert_eq!(decode["routed_dp_rank"], 1);
        assert_eq!(prefill["routed_dp_rank"], 3);
    }

    #[test]
    fn a_vllm_prefill_asks_one_token_for_a_remote_decode_and_the_decode_carries_its_params() {
        let text = r#"{"model":"m","prompt":"hi","max_tokens":64,"min_tokens":8,"stream":true,"stream_options":{"include_usage":true},"kv_transfer_params":{"client":1}}"#;
        let body = Body::parse(text).unwrap();
        let build = |handover| {
            let out = build_forward(
                &target(Engine::Vllm, false),
                Route::Completions,
                &body,
                &Prompt {
                    token_ids: &[4, 5],
                    handover: Some(handover),
                },
                key(0),
                "kvh-6",
                None,
            );
            serde_json::from_slice::<serde_json::Value>(&out.body).unwrap()
        };
        let prefill = build(Handover::VllmPrefill);
        assert_eq!(
            prefill["kv_transfer_params"],
            serde_json::from_str::<serde_json::Value>(VLLM_PREFILL_PARAMS).unwrap()
        );
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["stream"], false);
        assert!(prefill.get("stream_options").is_none());
        assert!(prefill.get("min_tokens").is_none());
        assert_eq!(prefill["prompt"], serde_json::json!([4, 5]));
        let params =
            r#"{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1]]}"#;
        let decode = build(Handover::VllmDecode {
            kv_transfer_params: params,
        });
        assert_eq!(
            decode["kv_transfer_params"],
            serde_json::from_str::<serde_json::Value>(params).unwrap()
        );
        assert_eq!(decode["max_tokens"], 64);
        assert_eq!(decode["stream"], true);
    }
}
