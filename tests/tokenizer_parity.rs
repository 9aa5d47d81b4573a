//! The router's token ids equal the engines' own, for the same request: checked
//! against vLLM 0.34.0's renderer (`vllm-rs render`, from its wheel) for chats
//! (plain, multi-turn, with tools, with a template option) and completions, and
//! against llama.cpp's `/tokenize` for completion prompts. The router hashes
//! these ids to find cached prefixes; an id off by one token shifts every block.
//! Every comparison runs twice, so both the cold path (every piece encoded) and
//! the warm one (pieces from the tokenizer cache) must equal the engine's ids.
//! And every comparison runs through each encoder the router uses: the fast one
//! (`tokenizers` 1.0.0-rc.3, which Qwen3's tokenizer is loaded with) and
//! `tokenizers` 0.23.2 (forced), which it falls back to.

use kvhint::models::encoder::{FAST, HF};
use kvhint::models::{ChatRequest, EncoderOptions, ModelTokenizer};
use kvhint_e2e::engines::vllm_render::Renderer;
use kvhint_e2e::llamacpp::{qwen3_tokenizer_dir, LlamaWorker};
use serde_json::{json, Value};

/// Qwen3's tokenizer as the router loads it: with the fast encoder, which
/// passed its self-test.
fn tokenizer() -> ModelTokenizer {
    let tokenizer =
        ModelTokenizer::load(qwen3_tokenizer_dir(), 64 << 20).expect("Qwen3's tokenizer loads");
    assert_eq!(
        tokenizer.encoder(),
        (FAST, None),
        "Qwen3's tokenizer is encoded by the fast encoder"
    );
    tokenizer
}

/// Qwen3's tokenizer encoded by `tokenizers` 0.23.2, as a model the fast
/// encoder cannot take is.
fn hf_tokenizer() -> ModelTokenizer {
    let options = EncoderOptions {
        force_hf: true,
        ..EncoderOptions::default()
    };
    let tokenizer = ModelTokenizer::load_with(qwen3_tokenizer_dir(), 64 << 20, &options)
        .expect("Qwen3's tokenizer loads");
    assert_eq!(tokenizer.encoder().0, HF);
    tokenizer
}

/// Each encoder the router uses, by name.
fn encoders() -> [(&'static str, ModelTokenizer); 2] {
    [(FAST, tokenizer()), (HF, hf_tokenizer())]
}

/// The chat requests compared: every model's (`kvhint_e2e::tokenizers::chats`)
/// and what Qwen3's template adds (a tool call, thinking).
fn chats() -> Vec<(&'static str, Value)> {
    let weather = kvhint_e2e::tokenizers::chats()
        .into_iter()
        .find(|(name, _)| *name == "tools")
        .map(|(_, chat)| chat["tools"][0].clone())
        .expect("the common chats have a tool");
    let mut chats = kvhint_e2e::tokenizers::chats();
    chats.extend(vec![
        (
            "a tool call and its result, no answer yet",
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
    ]);
    chats
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
    let vllm = Renderer::start(qwen3_tokenizer_dir(), "qwen3");
    for (encoder, tokenizer) in encoders() {
        for round in ["cold", "warm"] {
            for (name, mut request) in chats() {
                let (ours, _) = tokenizer
                    .encode_chat(&serde_json::from_value::<ChatRequest>(request.clone()).unwrap())
                    .unwrap_or_else(|e| panic!("{encoder}: {name}: {e}"));
                request["model"] = json!("qwen3");
                let theirs = vllm.chat(&request);
                assert_eq!(
                    ours, theirs,
                    "{encoder}, {round} chat {name:?}: the router's ids differ from vLLM's"
                );
            }
            for prompt in prompts() {
                let (ours, _) = tokenizer.encode_prompt(prompt).unwrap();
                let theirs = vllm.completion(&json!({"model": "qwen3", "prompt": prompt}));
                assert_eq!(ours, theirs, "{encoder}, {round} completion {prompt:?}");
            }
        }
        let (stats, entries, _) = tokenizer
            .piece_cache()
            .expect("Qwen3's tokenizer is cut into pieces at its special tokens");
        assert!(
            entries > 0 && stats.hits > 0,
            "{encoder}: the warm round found nothing in the cache: {stats:?}"
        );
    }
}

#[test]
fn completion_ids_equal_llama_cpp_s_own_tokenizer() {
    let worker = LlamaWorker::start();
    for (encoder, tokenizer) in encoders() {
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
            assert_eq!(ours, theirs, "{encoder}: {prompt:?}");
        }
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
    let [(_, fast), (_, hf)] = encoders();
    for (encoder, tokenizer) in [(FAST, &fast), (HF, &hf)] {
        for round in ["cold", "warm"] {
            for text in &texts {
                let (ours, _) = tokenizer.encode_prompt(text).unwrap();
                assert_eq!(
                    ours,
                    tokenizer.encode_uncached(text, true).unwrap(),
                    "{encoder}, {round}: {text:?}"
                );
                // And the fast encoder's ids are 0.23's, whole and in pieces.
                assert_eq!(
                    ours,
                    hf.encode_uncached(text, true).unwrap(),
                    "{encoder}, {round}: {text:?}"
                );
            }
        }
        let (stats, _, _) = tokenizer.piece_cache().unwrap();
        assert!(stats.hits > 0, "{encoder}: {stats:?}");
    }
}

/// Forcing `tokenizers` 0.23.2 gives the fast encoder's ids: on the chats and
/// prompts above, with and without special tokens, on long real text (this
/// repository's docs and sources, cut at random points, so every kind of
/// whitespace run, code and table is in it) and under a bound.
#[test]
fn forcing_hf_gives_the_fast_encoder_s_ids() {
    let [(_, fast), (_, hf)] = encoders();
    for (name, request) in chats() {
        let request = serde_json::from_value::<ChatRequest>(request).unwrap();
        assert_eq!(
            fast.encode_chat(&request).unwrap().0,
            hf.encode_chat(&request).unwrap().0,
            "chat {name:?}"
        );
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut corpus = String::new();
    for file in [
        "docs/gateway.md",
        "docs/api.md",
        "BENCHMARKS.md",
        "host/src/models/tokenizer.rs",
        "host/src/models/pieces.rs",
    ] {
        corpus.push_str(&std::fs::read_to_string(root.join(file)).unwrap_or_default());
    }
    assert!(
        corpus.len() > 100_000,
        "the corpus is this repository's text"
    );
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    let floor = |mut i: usize| {
        while !corpus.is_char_boundary(i) {
            i -= 1;
        }
        i
    };
    let mut texts: Vec<String> = prompts().into_iter().map(str::to_string).collect();
    for _ in 0..200 {
        let start = floor(next() % corpus.len());
        let end = floor((start + 1 + next() % 20_000).min(corpus.len()));
        texts.push(corpus[start..end].to_string());
    }
    texts.push(corpus.clone());
    for text in &texts {
        for special in [true, false] {
            let want = hf.encode_uncached(text, special).unwrap();
            assert_eq!(
                fast.encode_uncached(text, special).unwrap(),
                want,
                "{text:?}"
            );
            // Through the piece cache (each tokenizer's own, left in the same state).
            assert_eq!(fast.encode_text(text, special).unwrap(), want, "{text:?}");
            assert_eq!(hf.encode_text(text, special).unwrap(), want, "{text:?}");
        }
        // Bounded: the same refusal, stopped at the same point (or the same ids),
        // from both.
        let max = 1 + next() % 3_000;
        let (a, b) = (
            fast.encode_prompt_within(text, max),
            hf.encode_prompt_within(text, max),
        );
        match (a, b) {
            (Ok(a), Ok(b)) => assert_eq!(a.0, b.0, "{text:?}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            (a, b) => panic!("within {max}: fast {a:?}, 0.23 {b:?}"),
        }
    }
}

/// A fast encoder that gives other ids than 0.23 on the self-test corpus is
/// turned off for the model, with the reason: here it loads a copy of Qwen3's
/// `tokenizer.json` with the ids of " the" and " and" swapped (a real encoder
/// on a real file, giving other ids), while 0.23 loads the model's own.
#[test]
fn a_self_test_mismatch_turns_the_fast_encoder_off() {
    let dir = tempfile::tempdir().unwrap();
    let original = qwen3_tokenizer_dir().join("tokenizer.json");
    let mut json: Value = serde_json::from_slice(&std::fs::read(&original).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let (the, and) = (vocab["Ġthe"].clone(), vocab["Ġand"].clone());
    vocab.insert("Ġthe".into(), and);
    vocab.insert("Ġand".into(), the);
    let altered = dir.path().join("tokenizer.json");
    std::fs::write(&altered, serde_json::to_vec(&json).unwrap()).unwrap();
    let options = EncoderOptions {
        fast_file: Some(altered),
        ..EncoderOptions::default()
    };
    let tokenizer = ModelTokenizer::load_with(qwen3_tokenizer_dir(), 64 << 20, &options).unwrap();
    let (encoder, why) = tokenizer.encoder();
    assert_eq!(encoder, HF, "the mismatch must turn the fast encoder off");
    let why = why.expect("the reason is kept");
    assert!(why.contains("self-test mismatch"), "{why}");
    // And its ids are 0.23's on the model's own file.
    let reference = hf_tokenizer();
    for text in [
        "the cat and the dog",
        "Hello world",
        "<|im_start|>user
the<|im_end|>",
    ] {
        assert_eq!(
            tokenizer.encode_prompt(text).unwrap().0,
            reference.encode_prompt(text).unwrap().0
        );
    }
}
