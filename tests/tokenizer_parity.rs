//! The router's token ids equal the engines' own, for the same request: checked
//! against vLLM 0.34.0's renderer (`vllm-rs render`, from its wheel) for chats
//! (plain, multi-turn, with tools, with a template option) and completions, and
//! against llama.cpp's `/tokenize` for completion prompts. The router hashes
//! these ids to find cached prefixes; an id off by one token shifts every block.
//! Every comparison runs twice, so both the cold path (every piece encoded) and
//! the warm one (pieces from the tokenizer cache) must equal the engine's ids.

use kvhint::models::{ChatRequest, ModelTokenizer};
use kvhint_e2e::engines::vllm_render::Renderer;
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, LlamaWorker};
use serde_json::{json, Value};

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::load(qwen3_tokenizer_dir(), 64 << 20).expect("Qwen3's tokenizer loads")
}

/// The chat requests compared: what a template has to get right.
fn chats() -> Vec<(&'static str, Value)> {
    let weather = json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city, now. Use <city> names as written locally.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. \"Zürich\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}});
    vec![
        (
            "plain",
            json!({"messages": [{"role": "user", "content": "Hello there!"}]}),
        ),
        (
            "system and turns",
            json!({"messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another, over 100 — and explain?\nTwo lines."}]}),
        ),
        (
            "content parts",
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}]}),
        ),
        (
            "tools",
            json!({"messages": [
                {"role": "system", "content": "Use tools when they help."},
                {"role": "user", "content": "Weather in Zürich?"}],
                "tools": [weather.clone()]}),
        ),
        (
            "a tool call and its result",
            json!({"messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": -3}"}],
                "tools": [weather]}),
        ),
        (
            "enable_thinking false",
            json!({"messages": [{"role": "user", "content": "Think less."}],
                   "chat_template_kwargs": {"enable_thinking": false}}),
        ),
        (
            "reasoning in history",
            json!({"messages": [
                {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
                {"role": "user", "content": "2+2?"}]}),
        ),
    ]
}

fn prompts() -> Vec<&'static str> {
    vec![
        "Hello world",
        "  leading spaces, trailing spaces  ",
        "Unicode: Zürich, 東京, emoji 🚀, combining é",
        "Code:\nfn main() {\n    println!(\"{}\", 1 + 1);\n}\n",
        "<|im_start|>user\nspecial tokens in text<|im_end|>",
        "numbers 1234567890 and 3.14159",
    ]
}

#[test]
fn chat_and_completion_ids_equal_vllm_s_own_renderer() {
    let tokenizer = tokenizer();
    let vllm = Renderer::start(qwen3_tokenizer_dir(), "qwen3");
    for round in ["cold", "warm"] {
        for (name, mut request) in chats() {
            let (ours, _) = tokenizer
                .encode_chat(&serde_json::from_value::<ChatRequest>(request.clone()).unwrap())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            request["model"] = json!("qwen3");
            let theirs = vllm.chat(&request);
            assert_eq!(
                ours, theirs,
                "{round} chat {name:?}: the router's ids differ from vLLM's"
            );
        }
        for prompt in prompts() {
            let (ours, _) = tokenizer.encode_prompt(prompt).unwrap();
            let theirs = vllm.completion(&json!({"model": "qwen3", "prompt": prompt}));
            assert_eq!(ours, theirs, "{round} completion {prompt:?}");
        }
    }
    let (stats, entries, _) = tokenizer
        .piece_cache()
        .expect("Qwen3's tokenizer is cut into pieces at its special tokens");
    assert!(
        entries > 0 && stats.hits > 0,
        "the warm round found nothing in the cache: {stats:?}"
    );
}

#[test]
fn completion_ids_equal_llama_cpp_s_own_tokenizer() {
    let tokenizer = tokenizer();
    let worker = LlamaWorker::start();
    for prompt in prompts().into_iter().chain(prompts()) {
        let (ours, _) = tokenizer.encode_prompt(prompt).unwrap();
        let (status, reply) = worker.post(
            "/tokenize",
            &json!({"content": prompt, "parse_special": true}),
        );
        assert_eq!(status, 200, "{reply}");
        let theirs: Vec<u32> = reply["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ours, theirs, "{prompt:?}");
    }
}

/// The piece cache on a real model's tokenizer: texts where Qwen3's added tokens
/// (special and not: `<|im_start|>`, `<think>`, `<tool_call>`) sit against
/// spaces, newlines, partial tokens and multi-byte text give, cold and warm, the
/// ids the whole text gives.
#[test]
fn cached_pieces_equal_the_whole_text_on_qwen3_s_tokenizer() {
    const FRAGMENTS: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|endoftext|>",
        "<|im_",
        "user\n",
        "You are a careful assistant who answers in one line.",
        " ",
        "  ",
        "\n",
        "\n\n",
        "Zürich 東京 🚀",
        "don't",
        "1234567",
        "x",
    ];
    let tokenizer = tokenizer();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let texts: Vec<String> = (0..300)
        .map(|_| {
            (0..(next() % 20))
                .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                .collect()
        })
        .collect();
    for round in ["cold", "warm"] {
        for text in &texts {
            let (ours, _) = tokenizer.encode_prompt(text).unwrap();
            assert_eq!(
                ours,
                tokenizer.encode_uncached(text, true).unwrap(),
                "{round}: {text:?}"
            );
        }
    }
    let (stats, _, _) = tokenizer.piece_cache().unwrap();
    assert!(stats.hits > 0, "{stats:?}");
}
