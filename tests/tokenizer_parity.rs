//! The router's token ids equal the engines' own, for the same request: checked
//! against vLLM 0.34.0's renderer (`vllm-rs render`, from its wheel) for chats
//! (plain, multi-turn, with tools, with a template option) and completions, and
//! against llama.cpp's `/tokenize` for completion prompts. The router hashes
//! these ids to find cached prefixes; an id off by one token shifts every block.

use kvhint::models::{ChatRequest, ModelTokenizer};
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, LlamaWorker};
use kvhint_e2e::vllm_render::Renderer;
use serde_json::{json, Value};

fn tokenizer() -> ModelTokenizer {
    ModelTokenizer::load(qwen3_tokenizer_dir()).expect("Qwen3's tokenizer loads")
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
    for (name, mut request) in chats() {
        let ours = tokenizer
            .encode_chat(&serde_json::from_value::<ChatRequest>(request.clone()).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        request["model"] = json!("qwen3");
        let theirs = vllm.chat(&request);
        assert_eq!(
            ours, theirs,
            "chat {name:?}: the router's ids differ from vLLM's"
        );
    }
    for prompt in prompts() {
        let ours = tokenizer.encode_prompt(prompt).unwrap();
        let theirs = vllm.completion(&json!({"model": "qwen3", "prompt": prompt}));
        assert_eq!(ours, theirs, "completion {prompt:?}");
    }
}

#[test]
fn completion_ids_equal_llama_cpp_s_own_tokenizer() {
    let tokenizer = tokenizer();
    let worker = LlamaWorker::start();
    for prompt in prompts() {
        let ours = tokenizer.encode_prompt(prompt).unwrap();
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
