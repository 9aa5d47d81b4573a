//! Where a long piece of a prompt may be cut so that tokenizing the parts one
//! after the other gives exactly the ids of the whole: then a prompt far over
//! `router.max_prompt_tokens` is refused after about the bound's worth of text
//! is tokenized, not all of it.
//!
//! `tokenizers` encodes a piece (the text between two added tokens) in three
//! steps: it normalizes the piece, cuts it into words with its pre-tokenizer, and
//! runs the model on each word alone. So if the pre-tokenizer's words never
//! cross a point `q`, and neither the normalizer nor the pre-tokenizer looks across
//! it, the ids of the piece are the ids of `piece[..q]` followed by the ids of
//! `piece[q..]`. That holds only for cuts between particular characters, and
//! only for pre-tokenizers whose regex has been read for it: the three below, in
//! the byte-level BPE tokenizers most served models ship. Any other tokenizer is
//! not cut (its pieces are tokenized whole, as before), and [`Cuts::for_tokenizer`]
//! says why.
//!
//! **The regexes.** Qwen2's (Qwen2, 2.5, 3):
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
//! Llama 3's (and Mistral's Tekken) the same with `\p{N}{1,3}`; GPT-2's, inside
//! `ByteLevel` with `use_regex`:
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//! `Split` with `Isolated` keeps every match and every gap as a word. Every
//! character is a letter, a number, white space or none of these, and each of the
//! four starts a match, so the matches follow one another with no gap and the
//! words are exactly the matches `find_iter` finds, each search starting where the
//! last match ended. A cut between `x` (before) and `y` (after) is exact when:
//!
//! 1. no match holds both `x` and `y` (then a match ends at the cut);
//! 2. no match that starts before the cut is found differently when the text ends
//!    at the cut: a backtracking engine's result differs only if some step reads
//!    the character at the cut, and it reads "end of text" instead; the steps
//!    that can read it are the ones right after consuming `x`;
//! 3. the search from the cut on finds what it finds in the part alone: none of the
//!    regexes looks behind (no lookbehind, `\b`, `^` or `\G`).
//!
//! The cuts used, each checked against the alternatives above:
//!
//! - **Anything but white space, then an ASCII space.** A match that holds a
//!   non-space character never goes on to a space: the letter runs, the digit
//!   rules and the contractions take only letters, digits and apostrophes, and the
//!   punctuation run `[^\s\p{L}\p{N}]+[\r\n]*` only newlines after it. After
//!   `x` the steps that read on (`\p{L}`, `\p{N}`, `[^\s\p{L}\p{N}]`, `[\r\n]`)
//!   fail on a space and on the end alike; the one that would not, the lookahead
//!   `(?!\S)`, comes only after white space. This is the cut word-separated
//!   text (Latin, Cyrillic, Greek, Arabic…) has every few bytes.
//! - **A letter, then a non-letter** (`x` an ASCII letter or a CJK ideograph):
//!   only the contractions and the letter runs take a letter, and both end with
//!   it; after it the only step is one more `\p{L}`, which fails on `y` and on
//!   the end alike.
//! - **An ASCII digit, then a non-digit**: only `\p{N}`, `\p{N}{1,3}` or
//!   ` ?\p{N}+` take a digit, none takes `y`, and a repeat that reads on fails on
//!   `y` and on the end alike. With Qwen2's `\p{N}`, which takes one digit and
//!   reads no further, **a digit then a digit** too.
//! - **ASCII punctuation, then an ASCII digit**: punctuation is taken by the
//!   contractions (they need a letter next), by a letter run's optional first
//!   character (it needs a letter next) or by the punctuation run, whose
//!   `[^\s\p{L}\p{N}]+` and `[\r\n]*` fail on a digit and on the end alike.
//! - **A newline, then a character that is not white space** (Qwen2 and Llama 3
//!   only): a run of white space that ends with `\r` or `\n` is taken whole by
//!   `\s*[\r\n]+` (tried before `\s+(?!\S)`, the one alternative whose lookahead
//!   would tell `y` from the end), or is the tail of a punctuation run;
//!   `\s*`, `[\r\n]+` and `[\r\n]*` fail on `y` and on the end alike. GPT-2's
//!   regex has no such alternative (`\s+(?!\S)` would answer differently), so
//!   there this cut is not made.
//!
//! **The normalizer** runs before all this, on the whole piece, so the cut must
//! also be one where normalizing the parts gives the normalized whole, and where
//! the characters on both sides keep their class. None, NFC, NFD, NFKC and NFKD
//! are accepted. `y` is always a character that has no canonical decomposition,
//! never combines with the character before it, and never takes a following
//! character that is not a combining mark: ASCII, the CJK ideographs
//! U+4E00–U+9FA5 (letters in every Unicode version), the ideographic comma and
//! full stop, or one of five full-width punctuation marks, which only NFKC and
//! NFKD change, to the ASCII mark (still punctuation, still not white space). So
//! the normalized parts join to the normalized whole, and what matters is the
//! class of the last character of the normalized first part. Where `x` is drawn
//! from the same characters, that is `x` itself. Before a space, `x` may be any
//! character that is not white space as long as the normalizer makes only
//! canonical changes (none, NFC, NFD): canonical decompositions and compositions
//! turn no other character into white space (the only white space they touch,
//! U+2000 and U+2001, decomposes to white space), so the first part still ends
//! with a character that is not white space. NFKC and NFKD can (U+00A8 becomes a
//! space and a mark), so under them `x` must be ASCII there too.
//!
//! **Added tokens** that are matched after normalization (`normalized: true`)
//! are found inside a piece and could straddle a cut: a tokenizer that has one
//! is not cut. With GPT-2's `add_prefix_space`, `ByteLevel` adds a space to a
//! part that does not start with one: there every part after the first starts
//! with a space (the cut is before one).

use serde_json::Value as Json;
use tokenizers::Tokenizer;

/// Qwen2's pre-tokenizer regex, as its `tokenizer.json` spells it.
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's (and Mistral Tekken's): numbers in threes.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// About how many bytes of a piece are tokenized at once: between two checks of
/// the running count, so a prompt over the bound is refused within this much
/// text of it (a few thousand tokens).
pub const PART_BYTES: usize = 8 << 10;

/// The cuts a tokenizer allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cuts {
    /// After a newline (the Qwen2 and Llama 3 regexes).
    after_newline: bool,
    /// Between two digits (Qwen2's regex: one digit a word).
    digits_apart: bool,
    /// Only before a space (GPT-2's `ByteLevel` with `add_prefix_space`).
    before_space_only: bool,
    /// The normalizer makes compatibility changes (NFKC, NFKD): before a space,
    /// only an ASCII character.
    compatibility: bool,
}

impl Cuts {
    /// The cuts `tokenizer` allows, or why its pieces are tokenized whole.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Cuts, String> {
        let normalizer = serde_json::to_value(tokenizer.get_normalizer())
            .map_err(|e| format!("its normalizer cannot be inspected: {e}"))?;
        let Some(compatibility) = compatibility(&normalizer) else {
            return Err(format!(
                "its normalizer ({}) is not one of NFC, NFD, NFKC and NFKD, whose cuts are known",
                kind(&normalizer)
            ));
        };
        for token in tokenizer.get_added_tokens_decoder().values() {
            if token.normalized && !token.content.is_empty() {
                return Err(format!(
                    "added token {:?} is matched after normalization, inside a piece, \
                     where a cut could split it",
                    token.content
                ));
            }
        }
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer())
            .map_err(|e| format!("its pre-tokenizer cannot be inspected: {e}"))?;
        let field = |o: &Json, key: &str| o.get(key).cloned().unwrap_or(Json::Null);
        let byte_level = |o: &Json, regex: bool| {
            o.get("type").and_then(Json::as_str) == Some("ByteLevel")
                && field(o, "use_regex") == Json::Bool(regex)
        };
        if byte_level(&pre, true) {
            return Ok(Cuts {
                after_newline: false,
                digits_apart: false,
                before_space_only: field(&pre, "add_prefix_space") != Json::Bool(false),
                compatibility,
            });
        }
        if pre.get("type").and_then(Json::as_str) == Some("Sequence") {
            if let Some([split, bytes]) = pre
                .get("pretokenizers")
                .and_then(Json::as_array)
                .map(Vec::as_slice)
            {
                let pattern = split
                    .get("pattern")
                    .and_then(|p| p.get("Regex"))
                    .and_then(Json::as_str);
                if split.get("type").and_then(Json::as_str) == Some("Split")
                    && matches!(pattern, Some(QWEN2_PATTERN | LLAMA3_PATTERN))
                    && field(split, "behavior") == "Isolated"
                    && field(split, "invert") == Json::Bool(false)
                    && byte_level(bytes, false)
                {
                    // `ByteLevel` runs on each word here, and the words are the
                    // same cut or not: its `add_prefix_space` changes nothing.
                    return Ok(Cuts {
                        after_newline: true,
                        digits_apart: pattern == Some(QWEN2_PATTERN),
                        before_space_only: false,
                        compatibility,
                    });
                }
            }
        }
        Err(format!(
            "its pre-tokenizer ({}) is not one whose cuts are known (Qwen2's or Llama 3's \
             regex split before byte-level, or GPT-2's byte-level regex)",
            kind(&pre)
        ))
    }

    /// Where the part of `text` that starts at `from` ends: a cut about
    /// [`PART_BYTES`] on; or, where there is none near (one long word, a run of one
    /// character), the next cut after that, or the end of the text.
    pub fn end_of_part(&self, text: &str, from: usize) -> usize {
        let target = from.saturating_add(PART_BYTES);
        if target >= text.len() {
            return text.len();
        }
        // Back from the target, as far as half a part: text has a cut every few
        // bytes, so this finds one at once and the parts stay near their size.
        let floor = from + PART_BYTES / 2;
        if let Some(q) = (floor..=target).rev().find(|&q| self.cuts_at(text, q)) {
            return q;
        }
        (target + 1..text.len())
            .find(|&q| self.cuts_at(text, q))
            .unwrap_or(text.len())
    }

    /// Whether `text` may be cut before byte `q`.
    pub fn cuts_at(&self, text: &str, q: usize) -> bool {
        if q == 0 || q >= text.len() || !text.is_char_boundary(q) {
            return false;
        }
        match (text[..q].chars().next_back(), text[q..].chars().next()) {
            (Some(x), Some(y)) => self.between(x, y),
            _ => false,
        }
    }

    /// Whether a cut between `x` and `y` is exact (see the module's notes).
    fn between(&self, x: char, y: char) -> bool {
        if y == ' ' {
            return !white_space(x) && (x.is_ascii() || !self.compatibility);
        }
        if self.before_space_only {
            return false;
        }
        let letter = |c: char| c.is_ascii_alphabetic() || ideograph(c);
        let settled = |c: char| c.is_ascii() || ideograph(c) || cjk_punctuation(c);
        if !settled(y) {
            return false;
        }
        (letter(x) && !letter(y))
            || (x.is_ascii_digit() && (self.digits_apart || !y.is_ascii_digit()))
            || (x.is_ascii_punctuation() && y.is_ascii_digit())
            || (self.after_newline
                && matches!(x, '\n' | '\r')
                && (y.is_ascii_graphic() || ideograph(y) || cjk_punctuation(y)))
    }
}

/// White space as the regexes' `\s` may see it: Unicode's `White_Space`, and
/// the two characters older Unicode versions counted in it (U+180E, U+200B)
/// with the byte-order mark, in case the regex engine's tables differ.
fn white_space(c: char) -> bool {
    c.is_whitespace() || matches!(c, '\u{180E}' | '\u{200B}' | '\u{FEFF}')
}

/// CJK Unified Ideographs of Unicode 1.1: letters (`Lo`) in every version of
/// the tables, no decomposition, never composed with a neighbour.
fn ideograph(c: char) -> bool {
    ('\u{4E00}'..='\u{9FA5}').contains(&c)
}

/// Punctuation that ends CJK clauses: the ideographic comma and full stop
/// (no decomposition at all), and the full-width `！，：；？` (only a
/// compatibility decomposition, to the ASCII mark).
fn cjk_punctuation(c: char) -> bool {
    matches!(
        c,
        '\u{3001}' | '\u{3002}' | '\u{FF01}' | '\u{FF0C}' | '\u{FF1A}' | '\u{FF1B}' | '\u{FF1F}'
    )
}

/// Whether a normalizer (as `tokenizer.json` writes it) makes compatibility
/// changes; `None` if it is not one whose effect on a cut is known.
fn compatibility(normalizer: &Json) -> Option<bool> {
    match normalizer {
        Json::Null => Some(false),
        Json::Object(o) => match o.get("type").and_then(Json::as_str) {
            Some("NFC" | "NFD") => Some(false),
            Some("NFKC" | "NFKD") => Some(true),
            Some("Sequence") => {
                let mut any = false;
                for normalizer in o.get("normalizers").and_then(Json::as_array)? {
                    any |= compatibility(normalizer)?;
                }
                Some(any)
            }
            _ => None,
        },
        _ => None,
    }
}

fn kind(value: &Json) -> String {
    match value.get("type").and_then(Json::as_str) {
        Some(kind) => kind.to_string(),
        None if value.is_null() => "none".into(),
        None => "unknown".into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::normalizers::{NormalizerWrapper, Sequence as Normalizers, NFC, NFD, NFKC};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::{AddedToken, SplitDelimiterBehavior};

    /// Text that puts every kind of character next to every other: runs of
    /// white space of each kind, contractions in both cases, digits (ASCII and
    /// not), CJK with its punctuation, combining marks, compatibility
    /// characters NFKC changes (a ligature, a full-width letter, a circled
    /// digit), emoji, and punctuation before letters, digits and newlines.
    pub(crate) const FRAGMENTS: &[&str] = &[
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n",
        "\u{a0}",
        "\u{3000}",
        "don't",
        "I'LL",
        "we've",
        "'s",
        "'",
        "x",
        "The quick brown fox",
        " jumps",
        "123456",
        "7",
        "٣٤٥",
        "中文测试",
        "数据",
        "，",
        "。",
        "、",
        "！",
        "？",
        "：",
        "é",
        "e\u{301}",
        "\u{301}",
        "ﬁne",
        "Ａ",
        "①",
        "Σσς",
        "ß",
        "🙂",
        "🙂🙂",
        "привет мир",
        "Ω ",
        "\u{212b}",
        "\u{958}",
        "¨ ",
        "\u{1161}",
        "\u{2000}",
        "...",
        "--",
        "(x)",
        "$5",
        "#!",
        "a.b",
        "<tag>",
        "x=1;",
        "\u{200b}",
    ];

    /// A byte-level BPE trained here on the fragments, with `normalizer` and
    /// `pre_tokenizer`.
    pub(crate) fn trained(
        normalizer: Option<NormalizerWrapper>,
        pre_tokenizer: PreTokenizerWrapper,
    ) -> Tokenizer {
        let mut tokenizer = Tokenizer::new(BPE::default());
        if let Some(normalizer) = normalizer {
            tokenizer.with_normalizer(Some(normalizer)).unwrap();
        }
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(700)
                .min_frequency(1)
                .show_progress(false)
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .build(),
        );
        let corpus: Vec<String> = texts(300, 24);
        tokenizer.train(&mut trainer, corpus.iter()).unwrap();
        tokenizer
    }

    pub(crate) fn split(pattern: &str) -> PreTokenizerWrapper {
        Sequence::new(vec![
            Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .unwrap()
            .into(),
            ByteLevel::new(false, false, false).into(),
        ])
        .into()
    }

    /// `n` texts of up to `len` fragments in a pseudo-random order.
    pub(crate) fn texts(n: usize, len: u64) -> Vec<String> {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..n)
            .map(|_| {
                (0..1 + next() % len)
                    .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                    .collect()
            })
            .collect()
    }

    fn ids(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer
            .encode_fast(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }

    /// Every tokenizer shape whose cuts are known, as `tokenizer.json` would
    /// give it.
    fn shapes() -> Vec<(&'static str, Tokenizer)> {
        let nfc = || Some(NFC.into());
        let nfkc = || Some(NFKC.into());
        vec![
            ("Qwen2 regex, NFC", trained(nfc(), split(QWEN2_PATTERN))),
            (
                "Qwen2 regex, NFD",
                trained(Some(NFD.into()), split(QWEN2_PATTERN)),
            ),
            (
                "Llama 3 regex, no normalizer",
                trained(None, split(LLAMA3_PATTERN)),
            ),
            (
                "Llama 3 regex, NFKC",
                trained(nfkc(), split(LLAMA3_PATTERN)),
            ),
            (
                "GPT-2 byte-level, NFC then NFKC",
                trained(
                    Some(Normalizers::new(vec![NFC.into(), NFKC.into()]).into()),
                    ByteLevel::new(false, false, true).into(),
                ),
            ),
            (
                "GPT-2 byte-level with a prefix space",
                trained(None, ByteLevel::new(true, false, true).into()),
            ),
        ]
    }

    /// The claim the whole bound stands on, checked at every place it allows:
    /// for each cut `Cuts` accepts in a text, the ids of the two sides one after
    /// the other are the ids of the whole. And the check can fail: cutting at
    /// every character boundary instead does change ids.
    #[test]
    fn every_cut_allowed_gives_the_ids_of_the_whole_text() {
        for (shape, tokenizer) in shapes() {
            let cuts = Cuts::for_tokenizer(&tokenizer)
                .unwrap_or_else(|why| panic!("{shape}: not cut: {why}"));
            let (mut allowed, mut other_differ) = (0, 0);
            for text in texts(400, 12) {
                let whole = ids(&tokenizer, &text);
                for q in (1..text.len()).filter(|&q| text.is_char_boundary(q)) {
                    let mut joined = ids(&tokenizer, &text[..q]);
                    joined.extend(ids(&tokenizer, &text[q..]));
                    if cuts.cuts_at(&text, q) {
                        allowed += 1;
                        assert_eq!(
                            joined,
                            whole,
                            "{shape}: the cut {:?} | {:?} changes the ids",
                            &text[..q],
                            &text[q..]
                        );
                    } else if joined != whole {
                        other_differ += 1;
                    }
                }
            }
            assert!(allowed > 200, "{shape}: only {allowed} cuts tried");
            assert!(other_differ > 100, "{shape}: the check never bites");
            eprintln!(
                "{shape}: {allowed} cuts allowed, all exact; {other_differ} others change the ids"
            );
        }
    }

    #[test]
    fn a_tokenizer_whose_cuts_are_not_known_is_not_cut() {
        let why = |tokenizer: &Tokenizer| Cuts::for_tokenizer(tokenizer).unwrap_err();
        let other = trained(None, split(r"\p{L}+|\s+|\p{N}+|[^\s\p{L}\p{N}]+"));
        assert!(
            why(&other).contains("pre-tokenizer (Sequence)"),
            "{}",
            why(&other)
        );
        let mut lowercase = trained(None, split(QWEN2_PATTERN));
        lowercase
            .with_normalizer(Some(tokenizers::normalizers::Lowercase))
            .unwrap();
        assert!(why(&lowercase).contains("Lowercase"), "{}", why(&lowercase));
        let mut added = trained(Some(NFC.into()), split(QWEN2_PATTERN));
        added
            .add_tokens([AddedToken::from("fox jumps", false)])
            .unwrap();
        assert!(why(&added).contains("fox jumps"), "{}", why(&added));
        // A special token is split out before the pieces: no harm.
        let mut special = trained(Some(NFC.into()), split(QWEN2_PATTERN));
        special
            .add_special_tokens([AddedToken::from("<|im_end|>", true)])
            .unwrap();
        assert!(Cuts::for_tokenizer(&special).is_ok());
    }

    #[test]
    fn parts_end_at_a_cut_near_their_size_or_at_the_next_cut() {
        let cuts = Cuts {
            after_newline: true,
            digits_apart: true,
            before_space_only: false,
            compatibility: false,
        };
        let text = "word ".repeat(10_000);
        let end = cuts.end_of_part(&text, 0);
        assert!((PART_BYTES / 2..=PART_BYTES).contains(&end), "{end}");
        assert!(text[..end].ends_with("word") && text[end..].starts_with(' '));
        // One long word: no cut inside it, so the part runs to its end.
        let text = format!("{} tail", "a".repeat(3 * PART_BYTES));
        assert_eq!(cuts.end_of_part(&text, 0), 3 * PART_BYTES);
        // Short: the whole.
        assert_eq!(cuts.end_of_part("short text", 0), "short text".len());
    }
}
