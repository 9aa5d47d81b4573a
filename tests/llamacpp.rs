//! The llama.cpp worker fixture (`kvhint_e2e::llamacpp`) works as the gateway
//! tests need it to: real llama.cpp servers on 127.0.0.1 serving the tiny
//! Qwen3-vocabulary model, deterministic at temperature 0, tokenizing as HF
//! tokenizers does, and restartable on the same port.

use kvhint_e2e::llamacpp::{hf_ids, LlamaWorker, MODEL_NAME};
use serde_json::{json, Value};

/// Token ids of some English text in Qwen3's vocabulary.
const PROMPT: [u64; 8] = [9707, 1879, 11, 419, 374, 264, 1273, 13];

fn completion(worker: &LlamaWorker) -> String {
    let (status, reply) = worker.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}\n{}", worker.log());
    assert_eq!(reply["usage"]["prompt_tokens"], PROMPT.len(), "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 8, "{reply}");
    reply["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {reply}"))
        .to_string()
}

fn health(worker: &LlamaWorker) -> (u16, String) {
    worker.get("/health")
}

#[test]
fn two_workers_answer_the_same_completion_at_temperature_0() {
    let a = LlamaWorker::start();
    let b = LlamaWorker::start();
    assert_ne!(a.port, b.port);
    for worker in [&a, &b] {
        assert_eq!(worker.url(), format!("http://127.0.0.1:{}", worker.port));
        let (status, body) = health(worker);
        assert_eq!(status, 200, "{body}");
        let (status, models) = worker.get("/v1/models");
        assert_eq!(status, 200, "{models}");
        assert!(models.contains(MODEL_NAME), "{models}");
    }
    let first = completion(&a);
    assert_eq!(completion(&a), first, "the same worker, twice");
    assert_eq!(completion(&b), first, "another worker, same model");
}

#[test]
fn a_chat_completion_renders_qwen3s_template() {
    let worker = LlamaWorker::start();
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let (status, rendered) = worker.post("/apply-template", &json!({"messages": messages}));
    assert_eq!(status, 200, "{rendered}");
    assert_eq!(
        rendered["prompt"], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "Qwen3's own chat template"
    );
    let (status, reply) = worker.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}\n{}", worker.log());
    assert_eq!(reply["object"], "chat.completion", "{reply}");
    assert_eq!(reply["choices"][0]["message"]["role"], "assistant");
    assert!(
        reply["choices"][0]["message"]["content"].is_string(),
        "{reply}"
    );
    // `<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n`: 9 tokens.
    assert_eq!(reply["usage"]["prompt_tokens"], 9, "{reply}");
}

#[test]
fn tokenize_agrees_with_hf_tokenizers() {
    let worker = LlamaWorker::start();
    for text in [
        "Hello world, this is a test.",
        "  leading spaces,\ttabs\nand newlines\n\n",
        "numbers 1234567 and CamelCase_identifiers() -> {\"json\": true}",
        "<|im_start|>user\nHi<|im_end|>",
    ] {
        let (status, reply) = worker.post("/tokenize", &json!({"content": text}));
        assert_eq!(status, 200, "{reply}");
        let ids: Vec<u32> = serde_json::from_value(reply["tokens"].clone()).unwrap();
        assert_eq!(ids, hf_ids(text), "{text:?}");
    }
}

#[test]
fn a_killed_worker_restarts_on_the_same_port() {
    let mut worker = LlamaWorker::start();
    let port = worker.port;
    let before = completion(&worker);
    worker.kill();
    assert!(!worker.is_running());
    let agent = kvhint_e2e::http::agent();
    assert!(
        agent
            .get(&format!("{}/health", worker.url()))
            .call()
            .is_err(),
        "nothing answers on a killed worker's port"
    );
    worker.restart();
    assert_eq!(worker.port, port);
    assert!(worker.is_running());
    assert_eq!(health(&worker).0, 200);
    assert_eq!(completion(&worker), before);

    drop(worker);
    let other = LlamaWorker::start_on(port);
    assert_eq!(other.port, port);
    assert_eq!(completion(&other), before);
}

#[test]
fn slots_answer() {
    let worker = LlamaWorker::start();
    completion(&worker);
    let (status, body) = worker.get("/slots");
    assert_eq!(status, 200, "{body}");
    let slots: Vec<Value> = serde_json::from_str(&body).unwrap();
    assert!(slots.len() >= 2, "a few slots: {body}");
    assert!(slots.iter().all(|s| s["is_processing"] == false), "{body}");
    let (status, metrics) = worker.get("/metrics");
    assert_eq!(status, 200, "{metrics}");
}
