//! Which library turns a model's text into ids: HF `tokenizers` 1.0.0-rc.3 where
//! it gives 0.23's ids, HF `tokenizers` 0.23.2 otherwise.
//!
//! 0.23 (with Oniguruma, as the engines' Python tokenizers) is what the engines
//! compute, and it costs milliseconds for a few thousand new tokens; 1.0.0-rc.3
//! encodes the same text 40–170× faster (BENCHMARKS.md, "Tokenizing"). An id the
//! router gets wrong shifts every block hash after it, so the fast encoder is used
//! for a model only when it loads that model's `tokenizer.json` and then gives
//! 0.23's ids on a self-test corpus (whitespace runs, Unicode, digits, long words,
//! every added token in context, with and without the special tokens the
//! post-processor adds); else 0.23 encodes, with the reason logged and shown by
//! `kvhint check` and `/admin/status`. Everything else (the piece cache's split
//! at added tokens, the post-processor, decoding, `token_strs`) stays on 0.23:
//! only the encoding of text is switched.

use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;
use tokenizers_fast::pipeline::{EncodeOptions, PipelineToken, PipelineTokenizer};

/// The encoder every model can use: the one the engines match.
pub const HF: &str = "tokenizers 0.23.2";
/// The fast encoder, used where it passes its self-test.
pub const FAST: &str = "tokenizers 1.0.0-rc.3";

/// How a model's encoder is picked (tests and benches compare the two).
#[derive(Debug, Clone, Default)]
pub struct EncoderOptions {
    /// Encode with 0.23 even where the fast encoder would pass.
    pub force_hf: bool,
    /// For tests only: the file the fast encoder loads instead of the model's
    /// `tokenizer.json` (one it encodes differently), to show that a self-test
    /// mismatch turns it off.
    #[doc(hidden)]
    pub fast_file: Option<PathBuf>,
}

/// Encodes text to ids: `tokenizers::Tokenizer` (0.23) and [`Encoder`].
pub trait Encode {
    /// The 0.23 tokenizer: its added tokens, post-processor, normalizer and
    /// vocabulary are what the piece cache and cuts read.
    fn hf(&self) -> &Tokenizer;
    /// `text`'s ids (with the special tokens the post-processor adds, if
    /// `add_special`), appended to `out`.
    fn encode_onto(
        &self,
        text: &str,
        add_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error>;
}

impl Encode for Tokenizer {
    fn hf(&self) -> &Tokenizer {
        self
    }

    fn encode_onto(
        &self,
        text: &str,
        add_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        out.extend_from_slice(self.encode_fast(text, add_special)?.get_ids());
        Ok(())
    }
}

/// The ids a post-processor puts around one sequence's ids when asked to add
/// its special tokens (a BOS before, an EOS after): found once, by running 0.23's
/// post-processor on stand-in ids, so that adding them to a text's ids costs a
/// copy, not an `Encoding` built and post-processed token by token (which cost
/// more than encoding the text with the fast encoder).
///
/// Every post-processor 0.23 has (template, BERT, RoBERTa, byte-level and
/// sequences of them) adds the same ids whatever the sequence's ids are; the
/// stand-ins check that this one does, at four lengths, and where it does not
/// (or where truncation or padding could change the ids) there are no affixes
/// and the post-processor runs on each text's ids as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Affixes {
    before: Vec<u32>,
    after: Vec<u32>,
}

impl Affixes {
    /// `tokenizer`'s affixes, or `None` if its post-processor is not seen to
    /// just put fixed ids around the sequence.
    pub fn of(tokenizer: &Tokenizer) -> Option<Affixes> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return None;
        }
        // Ids no vocabulary has, so none is taken for one the post-processor adds.
        let stand_ins = [u32::MAX - 3, u32::MAX - 2, u32::MAX - 1];
        let process = |ids: &[u32]| -> Option<Vec<u32>> {
            let tokens = ids
                .iter()
                .map(|&id| tokenizers::Token::new(id, String::new(), (0, 0)))
                .collect();
            let encoding = tokenizers::Encoding::from_tokens(tokens, 0);
            let processed = tokenizer.post_process(encoding, None, true).ok()?;
            Some(processed.get_ids().to_vec())
        };
        let one = process(&stand_ins[..1])?;
        let at = one.iter().position(|&id| id == stand_ins[0])?;
        let affixes = Affixes {
            before: one[..at].to_vec(),
            after: one[at + 1..].to_vec(),
        };
        for n in 0..=stand_ins.len() {
            let mut want = Vec::new();
            affixes.around(&stand_ins[..n], &mut want);
            if process(&stand_ins[..n])? != want {
                return None;
            }
        }
        Some(affixes)
    }

    /// How many ids the affixes are.
    pub fn len(&self) -> usize {
        self.before.len() + self.after.len()
    }

    /// Whether there are none (the post-processor adds nothing).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `ids` with the affixes around them, appended to `out`.
    pub fn around(&self, ids: &[u32], out: &mut Vec<u32>) {
        out.reserve(self.len() + ids.len());
        out.extend_from_slice(&self.before);
        out.extend_from_slice(ids);
        out.extend_from_slice(&self.after);
    }

    /// What [`around`](Self::around) puts before the ids.
    pub fn before(&self) -> &[u32] {
        &self.before
    }

    /// What [`around`](Self::around) puts after the ids.
    pub fn after(&self) -> &[u32] {
        &self.after
    }
}

/// A model's 0.23 tokenizer and, where it passed, the fast encoder.
pub struct Encoder {
    hf: Tokenizer,
    fast: Option<PipelineTokenizer>,
    /// The ids 0.23's post-processor adds around a text's, where they are
    /// fixed: the fast encoder then encodes the text alone and they are copied
    /// around it (`encode_into` with special tokens builds a whole `Encoding`).
    affixes: Option<Affixes>,
    /// Why the fast encoder is not used, when it is not.
    fallback: Option<String>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("name", &self.name())
            .field("fallback", &self.fallback)
            .finish()
    }
}

impl Encode for Encoder {
    fn hf(&self) -> &Tokenizer {
        &self.hf
    }

    fn encode_onto(
        &self,
        text: &str,
        add_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        match &self.fast {
            Some(fast) => fast_onto(fast, self.affixes.as_ref(), text, add_special, out),
            None => self.hf.encode_onto(text, add_special, out),
        }
    }
}

impl Encoder {
    /// 0.23 alone (the fast encoder not tried), with the reason shown.
    pub fn hf_only(hf: Tokenizer, why: impl Into<String>) -> Encoder {
        Encoder {
            hf,
            fast: None,
            affixes: None,
            fallback: Some(why.into()),
        }
    }

    /// Loads `file` with 0.23 (an error if it cannot) and picks the encoder:
    /// the fast one if it loads `options.fast_file` (else `file`) and passes the
    /// self-test.
    pub fn load(file: &Path, options: &EncoderOptions) -> Result<Encoder, tokenizers::Error> {
        // Both readers take about a second on a large vocabulary: the fast one
        // reads on a thread of its own meanwhile.
        std::thread::scope(|scope| {
            let fast = (!options.force_hf).then(|| {
                let fast_file = options.fast_file.as_deref().unwrap_or(file);
                scope.spawn(move || load_fast(fast_file))
            });
            let hf = Tokenizer::from_file(file)?;
            Ok(match fast {
                None => Encoder::hf_only(hf, format!("{HF} was asked for (`encoder: hf`)")),
                Some(loading) => {
                    // A release candidate's reader: a panic in it costs only
                    // the speed-up, not the model (or the process).
                    let fast = loading
                        .join()
                        .unwrap_or_else(|_| Err(format!("{FAST} panicked loading it")));
                    Encoder::choose(hf, file, fast)
                }
            })
        })
    }

    /// The fast encoder if it loaded and passes the self-test, else `hf`.
    fn choose(hf: Tokenizer, file: &Path, fast: Result<PipelineTokenizer, String>) -> Encoder {
        let affixes = Affixes::of(&hf);
        let chosen = fast.and_then(|fast| {
            self_test(&hf, &fast, affixes.as_ref())?;
            Ok(fast)
        });
        match chosen {
            Ok(fast) => {
                tracing::info!(
                    tokenizer = %file.display(),
                    "encoding with {FAST}: it gives {HF}'s ids on the self-test corpus"
                );
                Encoder {
                    hf,
                    fast: Some(fast),
                    affixes,
                    fallback: None,
                }
            }
            Err(why) => {
                tracing::warn!(
                    tokenizer = %file.display(),
                    "encoding with {HF} (slower), not {FAST}: {why}"
                );
                Encoder::hf_only(hf, why)
            }
        }
    }

    /// The library that encodes: [`FAST`] or [`HF`].
    pub fn name(&self) -> &'static str {
        if self.fast.is_some() {
            FAST
        } else {
            HF
        }
    }

    /// Why the fast encoder is not used, when it is not.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }
}

/// `text`'s ids by the fast encoder, appended to `out`; with `add_special` and
/// `affixes`, the text's ids alone with the affixes copied around them.
fn fast_onto(
    fast: &PipelineTokenizer,
    affixes: Option<&Affixes>,
    text: &str,
    add_special: bool,
    out: &mut Vec<u32>,
) -> Result<(), tokenizers::Error> {
    if let (true, Some(affixes)) = (add_special, affixes) {
        out.extend_from_slice(affixes.before());
        fast_onto(fast, None, text, false, out)?;
        out.extend_from_slice(affixes.after());
        return Ok(());
    }
    let options = EncodeOptions {
        add_special_tokens: add_special,
        ..EncodeOptions::default()
    };
    // `encode_into` appends `PipelineToken`s (a transparent u32); they are read
    // back as ids into the caller's vector.
    let mut tokens: Vec<PipelineToken> = Vec::with_capacity(text.len() / 3);
    fast.encode_into(text, &options, &mut tokens)?;
    out.extend_from_slice(PipelineToken::cast_slice(&tokens));
    Ok(())
}

/// The fast encoder on `file`: read as the 1.0 reader reads a file written by
/// 0.x (converted to its canonical form first), or why it cannot be.
fn load_fast(file: &Path) -> Result<PipelineTokenizer, String> {
    let canonical = tokenizers_fast::canonicalize_file(file)
        .map_err(|e| format!("{FAST} cannot convert it: {e}"))?;
    tokenizers_fast::from_json(&canonical).map_err(|e| format!("{FAST} cannot load it: {e}"))
}

/// Texts where encoders tend to part: whitespace runs and line ends (the
/// `\s+(?!\S)` alternatives), contractions, digits, scripts and emoji,
/// combining marks and compatibility forms (normalizers), control bytes, code,
/// long words and runs, and prose.
const SELF_TEST_TEXTS: &[&str] = &[
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    " ",
    "  ",
    "     ",
    "\t",
    "\t\t x",
    "\n",
    "\n\n\n",
    "\r\n",
    " \n \n  \n",
    "a  b   c    d\n\n  e",
    "line one\n\n\nline two   \n\tindented",
    "x\u{a0}y\u{3000}z\u{2028}w",
    "don't I'LL we've She'S they'd you're",
    "1234567890 3.14159 1,000,000 0x1F 1e-9 ٣٤٥ ١٢ ５",
    "Zürich, 東京, Привет мир, مرحبا بالعالم, नमस्ते, 안녕하세요, ภาษาไทย",
    "🚀 👍🏽 👨‍👩‍👧 e\u{301} ﬁ Ａ Å\u{200b}x",
    "\u{0}\u{7}\u{1b}[0m\u{7f}",
    "fn main() {\n    println!(\"{}\", 1 + 1);\n}\n",
    "<div class=\"a\">&amp; <br/></div> {\"key\": [1, 2.5, null]}",
    "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "The router hashes the token ids an engine will compute, so it must render and \
     tokenize exactly as the engine does: an id off by one token shifts every block.",
];

/// Whether `fast` gives `hf`'s ids on the self-test corpus (plus long runs and
/// every added token of this tokenizer in context), with the special tokens
/// added and without; the first text where it does not, if any.
fn self_test(
    hf: &Tokenizer,
    fast: &PipelineTokenizer,
    affixes: Option<&Affixes>,
) -> Result<(), String> {
    let mut texts: Vec<String> = SELF_TEST_TEXTS.iter().map(|t| t.to_string()).collect();
    texts.push("a".repeat(500));
    texts.push("abc".repeat(200));
    texts.push("中文".repeat(150));
    texts.push("🚀".repeat(60));
    texts.push(" ".repeat(300) + "x");
    texts.push("\n".repeat(100));
    texts.push("9".repeat(400));
    // Every added token (special or not), between text, against spaces and
    // newlines, twice in a row, and cut short.
    let mut added: Vec<(u32, String)> = hf
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, token)| (id, token.content))
        .filter(|(_, content)| !content.is_empty())
        .collect();
    added.sort();
    for chunk in added.chunks(64) {
        let mut text = String::new();
        for (i, (_, token)) in chunk.iter().enumerate() {
            match i % 4 {
                0 => text.push_str(&format!("x{token}y")),
                1 => text.push_str(&format!(" {token} \n")),
                2 => text.push_str(&format!("{token}{token}")),
                _ => text.push_str(&format!("user\n{token}\n\nHello, {token}")),
            }
        }
        texts.push(text);
    }
    if let Some((_, token)) = added.first() {
        let half: String = token.chars().take(token.chars().count() / 2).collect();
        texts.push(format!("{half} {token}{half}"));
    }
    let mut ours = Vec::new();
    for text in &texts {
        for add_special in [true, false] {
            let want = hf
                .encode_fast(text.as_str(), add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string());
            ours.clear();
            // A panic in the release candidate is a failed self-test.
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                fast_onto(fast, affixes, text, add_special, &mut ours).map_err(|e| e.to_string())
            }))
            .unwrap_or_else(|_| Err("panicked".into()));
            let same = match (&want, &got) {
                (Ok(want), Ok(())) => *want == ours,
                // Both refusing the text is agreement enough: it is never encoded.
                (Err(_), Err(_)) => true,
                _ => false,
            };
            if !same {
                let shown: String = text.chars().take(60).collect();
                return Err(match (want, got) {
                    (Ok(want), Ok(())) => {
                        let at = want
                            .iter()
                            .zip(&ours)
                            .position(|(a, b)| a != b)
                            .unwrap_or(want.len().min(ours.len()));
                        format!(
                            "self-test mismatch on {shown:?} (add_special {add_special}): \
                             {HF} gives {} ids, {FAST} {}, first differing at {at}",
                            want.len(),
                            ours.len()
                        )
                    }
                    (Ok(_), Err(e)) => format!(
                        "self-test failed: {FAST} cannot encode {shown:?} (add_special \
                         {add_special}), which {HF} encodes: {e}"
                    ),
                    (Err(e), _) => format!(
                        "self-test failed: {HF} cannot encode {shown:?} (add_special \
                         {add_special}), which {FAST} encodes: {e}"
                    ),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cuts::{tests, LLAMA3_PATTERN, QWEN2_PATTERN};

    /// `tokenizer` written to a file of its own, as a model's `tokenizer.json`.
    fn file(tokenizer: &Tokenizer, name: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("kvhint-encoder-{}-{name}.json", std::process::id()));
        tokenizer.save(&path, false).unwrap();
        path
    }

    /// Whatever encoder is picked, its ids are 0.23's; a file the fast encoder
    /// cannot encode with (a pattern its pre-tokenizer has no built-in for, and
    /// no regex engine in this build: it loads, then fails on every text) leaves
    /// 0.23 with the reason.
    #[test]
    fn the_picked_encoder_gives_0_23_s_ids_or_says_why_not() {
        let shapes = [
            ("qwen2", tests::split(QWEN2_PATTERN)),
            ("llama3", tests::split(LLAMA3_PATTERN)),
            ("words", tests::split(r"[a-z]+|[0-9]|\s+|[^a-z0-9\s]+")),
        ];
        let mut picked = Vec::new();
        for (name, pre_tokenizer) in shapes {
            let hf = tests::trained(Some(tokenizers::normalizers::NFC.into()), pre_tokenizer);
            let path = file(&hf, name);
            let encoder = Encoder::load(&path, &EncoderOptions::default()).unwrap();
            std::fs::remove_file(&path).ok();
            match encoder.fallback() {
                None => assert_eq!(encoder.name(), FAST),
                Some(why) => {
                    assert_eq!(encoder.name(), HF);
                    assert!(!why.is_empty());
                }
            }
            for text in tests::texts(200, 30) {
                let mut ours = Vec::new();
                encoder.encode_onto(&text, true, &mut ours).unwrap();
                let want = hf.encode_fast(text.as_str(), true).unwrap();
                assert_eq!(
                    ours,
                    want.get_ids(),
                    "{name} ({}): {text:?}",
                    encoder.name()
                );
            }
            picked.push((name, encoder.name(), encoder.fallback().map(str::to_string)));
        }
        // The word pattern is none the fast encoder knows.
        assert_eq!(picked[2].1, HF, "{picked:?}");
        let forced = EncoderOptions {
            force_hf: true,
            ..EncoderOptions::default()
        };
        let hf = tests::trained(None, tests::split(QWEN2_PATTERN));
        let path = file(&hf, "forced");
        let encoder = Encoder::load(&path, &forced).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!(
            (encoder.name(), encoder.fallback()),
            (HF, Some("tokenizers 0.23.2 was asked for (`encoder: hf`)"))
        );
    }

    /// The ids a post-processor adds around a sequence are found once and
    /// copied around a text's: with a BOS and an EOS, a byte-level one (adds
    /// nothing), a sequence of both, and none; the fast encoder then encodes
    /// the text alone and gives 0.23's ids with the special tokens added.
    #[test]
    fn the_post_processor_s_ids_are_copied_around_the_text_s() {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::processors::sequence::Sequence;
        use tokenizers::processors::template::TemplateProcessing;
        use tokenizers::processors::PostProcessorWrapper;
        let mut hf = tests::trained(None, tests::split(LLAMA3_PATTERN));
        let template = |single: &str| -> PostProcessorWrapper {
            TemplateProcessing::builder()
                .try_single(single)
                .unwrap()
                .special_tokens(vec![("<s>", 700), ("</s>", 701)])
                .build()
                .unwrap()
                .into()
        };
        let byte_level: PostProcessorWrapper = ByteLevel::new(true, false, true).into();
        let processors: [(Option<PostProcessorWrapper>, &[u32], &[u32]); 5] = [
            (None, &[], &[]),
            (Some(byte_level.clone()), &[], &[]),
            (Some(template("<s> $A </s>")), &[700], &[701]),
            (Some(template("<s> <s> $A")), &[700, 700], &[]),
            (
                Some(Sequence::new(vec![byte_level, template("<s> $A")]).into()),
                &[700],
                &[],
            ),
        ];
        for (i, (processor, before, after)) in processors.into_iter().enumerate() {
            hf.with_post_processor(processor);
            let affixes = Affixes::of(&hf).unwrap();
            assert_eq!((affixes.before(), affixes.after()), (before, after), "{i}");
            let path = file(&hf, &format!("affixes-{i}"));
            let encoder = Encoder::load(&path, &EncoderOptions::default()).unwrap();
            std::fs::remove_file(&path).ok();
            assert_eq!(encoder.name(), FAST, "{i}: {:?}", encoder.fallback());
            for text in tests::texts(100, 30) {
                let mut ours = Vec::new();
                encoder.encode_onto(&text, true, &mut ours).unwrap();
                let want = hf.encode_fast(text.as_str(), true).unwrap();
                assert_eq!(ours, want.get_ids(), "{i}: {text:?}");
            }
        }
        // Truncation could cut the ids: no affixes, the post-processor runs.
        hf.with_truncation(Some(tokenizers::TruncationParams::default()))
            .unwrap();
        assert_eq!(Affixes::of(&hf), None);
    }
}
