//! Token ids of a prompt's pieces, cached, so a shared system prompt or the
//! earlier turns of a chat are tokenized once, not on every request.
//!
//! Tokenization is not cut-and-paste in general: BPE merges and the
//! pre-tokenizer's regex look across any point one might pick. There is one
//! exception, and this cache stands on it alone (as `smg`'s L1 cache does): HF
//! `tokenizers` first splits a text at every added token that is not normalized
//! (`<|im_start|>`, `<|im_end|>`, `<s>`: what chat templates write between turns),
//! and then normalizes, pre-tokenizes and encodes each piece between them on its
//! own (`AddedVocabulary::extract_and_normalize`). So the ids of a text are the
//! ids of its pieces with the added tokens' ids between them, and a piece's ids can
//! be kept under the piece's text. The split here is the one `tokenizers` makes:
//! the same automaton (`daachorse`, leftmost-longest) over the same tokens, run
//! only where a token may start (`Splitter`).
//!
//! Where a tokenizer does something that depends on where a piece sits, the cache
//! is off for it and every text is encoded whole ([`PieceCache::for_tokenizer`]
//! says why): an added token that takes the spaces around it or only whole
//! words, a Metaspace that prepends to the first piece only, BPE dropout,
//! truncation or padding, special tokens encoded as text. A post-processor that
//! adds tokens (a BOS) is run on the joined ids, as `encode` runs it.
//!
//! Entries are keyed by the piece's whole text (compared on a hit, never a hash
//! alone: the ids are forwarded to the engine, so a collision would change another
//! client's prompt) and weighed in bytes; the least useful go first when the
//! budget is full (`quick_cache`'s S3-FIFO).
//!
//! Encoding takes a bound (`router.max_prompt_tokens`) and stops as soon as the
//! running count passes it: after each piece, and inside a long piece after each
//! part of about [`PART_BYTES`], cut where the
//! tokenizer's own words end ([`Cuts`]). A prompt far over the bound then costs
//! about what a prompt at the bound costs, and one under it gets the ids it
//! always got.

use super::cover::Cover;
use super::cuts::{Cuts, PART_BYTES};
use super::encoder::{Affixes, Encode};
use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use tokenizers::{Encoding, Token, Tokenizer};

/// Bytes an entry costs beyond its text and ids (the table slot, two `Arc`
/// headers and lengths), so a cache of tiny pieces still keeps to its budget.
const ENTRY_OVERHEAD: u64 = 64;

/// A part longer than this (no cut near: one long word, a run of one
/// character) is first bounded from below ([`Cover`]) against the room left,
/// and tokenized only if it may fit.
const LONG_PART: usize = 4 * PART_BYTES;

/// A piece shorter than this is encoded each time rather than cached: the
/// newlines and role names between two special tokens cost less to encode than
/// a cache entry costs to keep.
const MIN_CACHED_PIECE: usize = 16;

#[derive(Clone)]
struct ByBytes;

impl Weighter<Arc<str>, Arc<[u32]>> for ByBytes {
    fn weight(&self, key: &Arc<str>, ids: &Arc<[u32]>) -> u64 {
        key.len() as u64 + 4 * ids.len() as u64 + ENTRY_OVERHEAD
    }
}

/// What a tokenization cost: pieces found in the cache, pieces encoded, and the
/// bytes of text each covered.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PieceStats {
    pub hits: u64,
    pub misses: u64,
    pub hit_bytes: u64,
    pub miss_bytes: u64,
}

/// Why encoding stopped short of the ids.
#[derive(Debug)]
pub enum Stop {
    /// The tokenizer failed.
    Failed(tokenizers::Error),
    /// The running count passed the bound: `counted` tokens (the post-processor's
    /// included) in the first `read` bytes of the text, and the rest not read.
    Over { counted: usize, read: usize },
}

impl From<tokenizers::Error> for Stop {
    fn from(e: tokenizers::Error) -> Self {
        Stop::Failed(e)
    }
}

/// The cache of one tokenizer's pieces.
pub struct PieceCache {
    /// The added tokens `tokenizers` splits at first, with their ids.
    splitter: Option<Splitter>,
    /// How many tokens the post-processor adds when asked to (a BOS, an EOS).
    post_added: usize,
    /// Those tokens' ids, where they are fixed ([`Affixes`]): copied around the
    /// joined ids, rather than the post-processor run on them.
    affixes: Option<Affixes>,
    /// Where a long piece may be cut, or why it is tokenized whole.
    cuts: Result<Cuts, String>,
    /// None when `gateway.tokenizer_cache_mib` is 0: pieces are still encoded
    /// apart (the bound is checked after each), none is kept.
    cache: Option<Cache<Arc<str>, Arc<[u32]>, ByBytes>>,
    /// Made the first time a long part needs it (the automaton of a large
    /// vocabulary takes some megabytes); `None` if this tokenizer's tokens do
    /// not cover their text's bytes.
    cover: OnceLock<Option<Cover>>,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_bytes: AtomicU64,
    miss_bytes: AtomicU64,
}

impl std::fmt::Debug for PieceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceCache")
            .field("entries", &self.cache.as_ref().map(Cache::len))
            .field("bytes", &self.cache.as_ref().map(Cache::weight))
            .field("cuts", &self.cuts)
            .finish()
    }
}

impl PieceCache {
    /// A cache of at most `budget` bytes for `tokenizer` (none when it is 0), or
    /// why its pieces cannot be encoded apart exactly (the caller then encodes
    /// every text whole).
    pub fn for_tokenizer(tokenizer: &Tokenizer, budget: u64) -> Result<PieceCache, String> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("tokenizer.json sets truncation or padding".into());
        }
        if tokenizer.get_encode_special_tokens() {
            return Err("the tokenizer encodes special tokens as text".into());
        }
        let mut pairs = Vec::new();
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.single_word || token.lstrip || token.rstrip {
                return Err(format!(
                    "added token {:?} takes the spaces around it or only whole words, so \
                     where it splits depends on its neighbours",
                    token.content
                ));
            }
            if !token.normalized && !token.content.is_empty() {
                pairs.push((token.content, id));
            }
        }
        let pre_tokenizer = serde_json::to_value(tokenizer.get_pre_tokenizer())
            .map_err(|e| format!("its pre-tokenizer cannot be inspected: {e}"))?;
        if any_object(&pre_tokenizer, &|o| {
            o.get("type").and_then(|t| t.as_str()) == Some("Metaspace")
                && o.get("prepend_scheme").and_then(|p| p.as_str()) == Some("first")
        }) {
            return Err("its Metaspace pre-tokenizer prepends to the first piece only".into());
        }
        let model = serde_json::to_value(tokenizer.get_model())
            .map_err(|e| format!("its model cannot be inspected: {e}"))?;
        if model.get("dropout").is_some_and(|d| !d.is_null()) {
            return Err("its BPE model sets dropout (encoding is random)".into());
        }
        let splitter = if pairs.is_empty() {
            None
        } else {
            Some(Splitter::new(pairs)?)
        };
        let post_added = tokenizer
            .get_post_processor()
            .map_or(0, |p| tokenizers::PostProcessor::added_tokens(p, false));
        let affixes = Affixes::of(tokenizer).filter(|a| a.len() == post_added);
        // A rough guess of the entry count; the weight decides what stays.
        let items = (budget / 4096).clamp(16, 1 << 20) as usize;
        Ok(PieceCache {
            splitter,
            post_added,
            affixes,
            cuts: Cuts::for_tokenizer(tokenizer),
            cache: (budget > 0).then(|| Cache::with_weighter(items, budget, ByBytes)),
            cover: OnceLock::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_bytes: AtomicU64::new(0),
            miss_bytes: AtomicU64::new(0),
        })
    }

    /// The ids `tokenizer.encode(text, add_special)` gives, from cached pieces
    /// where it can, with what it found in the cache; or [`Stop::Over`] as soon as
    /// the count (with the tokens the post-processor would add) passes `max`.
    /// The parts are encoded by `tokenizer`'s encoder (0.23 or the fast one).
    pub fn encode<E: Encode>(
        &self,
        tokenizer: &E,
        text: &str,
        add_special: bool,
        max: usize,
    ) -> Result<(Vec<u32>, PieceStats), Stop> {
        let mut run = Run {
            ids: Vec::new(),
            stats: PieceStats::default(),
            max,
            added: if add_special { self.post_added } else { 0 },
        };
        let done = self.pieces(tokenizer, text, &mut run);
        // Counted whether or not the text was encoded to the end: the work a
        // refused prompt cost shows in the totals.
        let stats = run.stats;
        self.hits.fetch_add(stats.hits, Ordering::Relaxed);
        self.misses.fetch_add(stats.misses, Ordering::Relaxed);
        self.hit_bytes.fetch_add(stats.hit_bytes, Ordering::Relaxed);
        self.miss_bytes
            .fetch_add(stats.miss_bytes, Ordering::Relaxed);
        done?;
        let mut ids = run.ids;
        if add_special && self.post_added > 0 {
            if let Some(affixes) = &self.affixes {
                let mut out = Vec::with_capacity(ids.len() + affixes.len());
                affixes.around(&ids, &mut out);
                return Ok((out, stats));
            }
            // What `encode` does last, on the joined ids: only the ids are read
            // back, so the tokens' text and offsets can stay empty.
            let tokens = ids
                .iter()
                .map(|&id| Token::new(id, String::new(), (0, 0)))
                .collect();
            let encoding =
                tokenizer
                    .hf()
                    .post_process(Encoding::from_tokens(tokens, 0), None, true)?;
            ids = encoding.get_ids().to_vec();
        }
        Ok((ids, stats))
    }

    /// Where a long piece is cut, if it is.
    pub fn cuts(&self) -> Option<Cuts> {
        self.cuts.as_ref().ok().copied()
    }

    /// Why a long piece is tokenized whole for this tokenizer, if it is.
    pub fn uncut(&self) -> Option<&str> {
        self.cuts.as_ref().err().map(String::as_str)
    }

    fn pieces<E: Encode>(&self, tokenizer: &E, text: &str, run: &mut Run) -> Result<(), Stop> {
        let mut at = 0;
        if let Some(splitter) = &self.splitter {
            let mut from = 0;
            while let Some((start, end, id)) = splitter.next(text, from) {
                self.piece(tokenizer, text, at..start, run)?;
                run.ids.push(id);
                run.check(end)?;
                (at, from) = (end, end);
            }
        }
        self.piece(tokenizer, text, at..text.len(), run)
    }

    /// Encodes `text[span]`, a piece, onto `run`: from the cache, or part by part
    /// with the count checked after each.
    fn piece<E: Encode>(
        &self,
        tokenizer: &E,
        text: &str,
        span: std::ops::Range<usize>,
        run: &mut Run,
    ) -> Result<(), Stop> {
        let (start, piece) = (span.start, &text[span]);
        if piece.is_empty() {
            return Ok(());
        }
        let cache = self
            .cache
            .as_ref()
            .filter(|_| piece.len() >= MIN_CACHED_PIECE);
        if let Some(cached) = cache.and_then(|c| c.get(piece)) {
            run.stats.hits += 1;
            run.stats.hit_bytes += piece.len() as u64;
            run.ids.extend_from_slice(&cached);
            return run.check(start + piece.len());
        }
        run.stats.misses += 1;
        let first = run.ids.len();
        let mut at = 0;
        while at < piece.len() {
            let (end, known) = match &self.cuts {
                Ok(cuts) => (cuts.end_of_part(piece, at), true),
                // Not cut: its pre-tokenizer's shape is not known either, so
                // neither is whether its tokens spell every byte (the cover's
                // premise).
                Err(_) => (piece.len(), false),
            };
            let room = run.room();
            // A part of n bytes has at most n tokens: only a long part that may
            // not fit is worth bounding first.
            if known && end - at > LONG_PART && end - at > room {
                let least = self
                    .cover(tokenizer.hf())
                    .and_then(|cover| cover.more_than(tokenizer.hf(), &piece[at..end], room));
                if let Some((least, read)) = least {
                    return Err(Stop::Over {
                        counted: run.counted().saturating_add(least),
                        read: start + at + read,
                    });
                }
            }
            tokenizer.encode_onto(&piece[at..end], false, &mut run.ids)?;
            run.stats.miss_bytes += (end - at) as u64;
            at = end;
            run.check(start + at)?;
        }
        if let Some(cache) = cache {
            cache.insert(Arc::from(piece), Arc::from(&run.ids[first..]));
        }
        Ok(())
    }

    /// The vocabulary's cover, made on first use (only tokenizers whose pieces
    /// are cut get there).
    fn cover(&self, tokenizer: &Tokenizer) -> Option<&Cover> {
        self.cover
            .get_or_init(|| match Cover::for_tokenizer(tokenizer) {
                Ok(cover) => {
                    tracing::info!(
                        "bounding long prompt parts with the vocabulary's cover ({} KiB)",
                        cover.heap_bytes() >> 10
                    );
                    Some(cover)
                }
                Err(why) => {
                    tracing::info!(
                        "a long prompt part with no cut is tokenized whole before the bound \
                         is checked: {why}"
                    );
                    None
                }
            })
            .as_ref()
    }

    /// Totals since the cache was made, and what it holds now (entries, bytes).
    pub fn totals(&self) -> (PieceStats, u64, u64) {
        let stats = PieceStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_bytes: self.hit_bytes.load(Ordering::Relaxed),
            miss_bytes: self.miss_bytes.load(Ordering::Relaxed),
        };
        match &self.cache {
            Some(cache) => (stats, cache.len() as u64, cache.weight()),
            None => (stats, 0, 0),
        }
    }

    /// Whether pieces are kept (`gateway.tokenizer_cache_mib` is not 0).
    pub fn keeps(&self) -> bool {
        self.cache.is_some()
    }
}

/// Finds the added tokens in a text as `tokenizers` does: leftmost first, the
/// longest of those that start there (`daachorse`'s leftmost-longest
/// automaton, as `tokenizers`' `aho-corasick` one).
///
/// The automaton run over the whole text cost a quarter of a new prompt's
/// tokenization; but a token can start only at a byte that begins one (`<` for
/// most models' tokens, and a few more for Gemma's runs of white space), and
/// those are found by a plain scan. At each such byte, the automaton runs on the
/// next [`longest`](Self::longest) bytes only: the longest token that starts
/// there fits in them, so it is found there (as the window's first match, at
/// its start) if there is one. The matches are then those of the automaton run
/// over the whole text: leftmost-longest is, from where the last match ended,
/// the first position where some token starts, and the longest token there.
struct Splitter {
    automaton: DoubleArrayAhoCorasick<u32>,
    /// The bytes some token starts with.
    starts: [bool; 256],
    /// The one byte every token starts with, if it is one and ASCII (a
    /// `memchr` finds it).
    only_start: Option<char>,
    /// The longest token's length in bytes.
    longest: usize,
}

impl Splitter {
    fn new(pairs: Vec<(String, u32)>) -> Result<Splitter, String> {
        let mut starts = [false; 256];
        let mut longest = 0;
        for (token, _) in &pairs {
            starts[usize::from(token.as_bytes()[0])] = true;
            longest = longest.max(token.len());
        }
        let mut first = (0..=255u8).filter(|&b| starts[usize::from(b)]);
        let only_start = match (first.next(), first.next()) {
            (Some(b), None) if b.is_ascii() => Some(char::from(b)),
            _ => None,
        };
        let automaton = DoubleArrayAhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build_with_values(pairs)
            .map_err(|e| format!("its added tokens cannot be matched: {e}"))?;
        Ok(Splitter {
            automaton,
            starts,
            only_start,
            longest,
        })
    }

    /// The first added token in `text` at or after byte `from` (a char
    /// boundary): its start, end and id.
    fn next(&self, text: &str, mut from: usize) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        loop {
            let at = match self.only_start {
                Some(c) => from + text[from..].find(c)?,
                None => {
                    from + bytes[from..]
                        .iter()
                        .position(|&b| self.starts[usize::from(b)])?
                }
            };
            let window = &bytes[at..bytes.len().min(at + self.longest)];
            if let Some(m) = self.automaton.leftmost_find_iter(window).next() {
                if m.start() == 0 {
                    return Some((at, at + m.end(), m.value()));
                }
            }
            // No token starts at `at`; the next char boundary is past its byte
            // (an ASCII byte, or a UTF-8 lead byte whose char is skipped).
            from = at + 1;
            while !text.is_char_boundary(from) {
                from += 1;
            }
        }
    }
}

/// One text's encoding under way.
struct Run {
    ids: Vec<u32>,
    stats: PieceStats,
    /// The most tokens the text may have, the post-processor's included.
    max: usize,
    /// The tokens the post-processor will add.
    added: usize,
}

impl Run {
    /// The tokens so far, with the post-processor's.
    fn counted(&self) -> usize {
        self.ids.len().saturating_add(self.added)
    }

    /// How many more tokens fit.
    fn room(&self) -> usize {
        self.max.saturating_sub(self.counted())
    }

    /// [`Stop::Over`] if the ids so far (the first `read` bytes' worth) and the
    /// post-processor's are more than `max`: no later token takes one away.
    fn check(&self, read: usize) -> Result<(), Stop> {
        let counted = self.counted();
        if counted > self.max {
            return Err(Stop::Over { counted, read });
        }
        Ok(())
    }
}

/// Whether `value` or anything inside it is an object `test` accepts.
fn any_object(
    value: &serde_json::Value,
    test: &dyn Fn(&serde_json::Map<String, serde_json::Value>) -> bool,
) -> bool {
    match value {
        serde_json::Value::Object(o) => test(o) || o.values().any(|v| any_object(v, test)),
        serde_json::Value::Array(items) => items.iter().any(|v| any_object(v, test)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    const FRAGMENTS: &[&str] = &[
        "<|im_start|>",
        "<|im_end|>",
        "<|im_st",
        "im_end|>",
        "<s>",
        "system\n",
        "user\n",
        "assistant\n",
        "You are a helpful assistant.",
        " hello",
        "hello world",
        "  ",
        "\n\n",
        "\n",
        "The quick brown fox jumps over the lazy dog. ",
        "naïve café ",
        "数字 123 ",
        "🙂",
        "don't",
        "x",
    ];

    /// A byte-level BPE trained here, with chat-style special tokens, a BOS its
    /// post-processor adds, and an added token that is normalized.
    fn trained(with_bos: bool) -> Tokenizer {
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default()));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(400)
                .min_frequency(1)
                .show_progress(false)
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .build(),
        );
        let corpus: Vec<String> = (0..200)
            .map(|i| FRAGMENTS[i % FRAGMENTS.len()].repeat(1 + i % 3))
            .collect();
        tokenizer.train(&mut trainer, corpus.iter()).unwrap();
        tokenizer
            .add_special_tokens([
                AddedToken::from("<|im_start|>", true),
                AddedToken::from("<|im_end|>", true),
                AddedToken::from("<s>", true),
            ])
            .unwrap();
        tokenizer
            .add_tokens([AddedToken::from("hello world", false)])
            .unwrap();
        if with_bos {
            let bos = tokenizer.token_to_id("<s>").unwrap();
            tokenizer.with_post_processor(Some(
                TemplateProcessing::builder()
                    .try_single("<s> $A")
                    .unwrap()
                    .special_tokens(vec![("<s>", bos)])
                    .build()
                    .unwrap(),
            ));
        }
        tokenizer
    }

    /// Texts made of the fragments above in a pseudo-random order, so special
    /// tokens sit next to spaces, newlines, partial tokens and multi-byte text.
    fn texts(n: usize) -> Vec<String> {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..n)
            .map(|_| {
                let len = (next() % 24) as usize;
                (0..len)
                    .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
                    .collect()
            })
            .collect()
    }

    fn whole(tokenizer: &Tokenizer, text: &str, special: bool) -> Vec<u32> {
        tokenizer.encode(text, special).unwrap().get_ids().to_vec()
    }

    #[test]
    fn cached_pieces_give_the_ids_the_whole_text_gives_cold_and_warm() {
        for with_bos in [false, true] {
            let tokenizer = trained(with_bos);
            let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
            assert_eq!(cache.post_added, usize::from(with_bos));
            // The BOS is copied before the ids, not added by the post-processor.
            assert_eq!(
                cache.affixes.as_ref().map(Affixes::before),
                Some(&[tokenizer.token_to_id("<s>").unwrap()][..usize::from(with_bos)])
            );
            for round in ["cold", "warm"] {
                for text in texts(400) {
                    for special in [false, true] {
                        let (ids, _) = cache
                            .encode(&tokenizer, &text, special, usize::MAX)
                            .unwrap();
                        assert_eq!(
                            ids,
                            whole(&tokenizer, &text, special),
                            "{round}, bos {with_bos}, add_special {special}: {text:?}"
                        );
                    }
                }
            }
            let (stats, entries, _) = cache.totals();
            assert!(entries > 0 && stats.hits > 0, "{stats:?}");
        }
    }

    /// The splitter's scan (a byte some token starts with, then the automaton
    /// on the longest token's length from there) finds what the automaton
    /// finds run over the whole text, with tokens that start with several
    /// different bytes (ASCII and not), that are prefixes of one another, and
    /// runs of one character (Gemma's white-space tokens).
    #[test]
    fn the_splitter_finds_what_the_automaton_finds_over_the_whole_text() {
        let token_sets: [&[&str]; 3] = [
            &["<|im_start|>", "<|im_end|>", "<s>"],
            &[
                "\n",
                "\n\n",
                "\n\n\n",
                "\t\t",
                "▁▁",
                "▁▁▁▁",
                "<b>",
                "<br>",
                "<|x|>",
                "|",
            ],
            &["ab", "abc", "bcd", "é", "éé", "数字", "c"],
        ];
        let pieces = [
            "<|im_start|>",
            "<|im_st",
            "<s>",
            "<",
            "<b",
            "<br",
            "<br>",
            "<b>",
            "\n",
            "\n\n",
            "\t",
            "\t\t\t",
            "▁",
            "▁▁▁",
            "|",
            "||",
            "<|x|",
            "ab",
            "abcd",
            "bc",
            "é",
            "e\u{301}",
            "数字",
            "数",
            " ",
            "plain text ",
            "c",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for tokens in token_sets {
            let pairs: Vec<(String, u32)> = tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), i as u32))
                .collect();
            let splitter = Splitter::new(pairs).unwrap();
            for _ in 0..2000 {
                let text: String = (0..next() % 30)
                    .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                    .collect();
                let want: Vec<(usize, usize, u32)> = splitter
                    .automaton
                    .leftmost_find_iter(&text)
                    .map(|m| (m.start(), m.end(), m.value()))
                    .collect();
                let mut got = Vec::new();
                let mut from = 0;
                while let Some(m) = splitter.next(&text, from) {
                    got.push(m);
                    from = m.1;
                }
                assert_eq!(got, want, "{tokens:?} in {text:?}");
            }
        }
    }

    #[test]
    fn a_shared_system_prompt_is_encoded_once_and_then_found() {
        let tokenizer = trained(false);
        let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
        let system = "<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n";
        let first = format!("{system}<|im_start|>user\nWhat is a fox?<|im_end|>\n");
        let second = format!("{system}<|im_start|>user\nWhat is a lazy dog?<|im_end|>\n");
        let (_, cold) = cache.encode(&tokenizer, &first, false, usize::MAX).unwrap();
        let (ids, warm) = cache
            .encode(&tokenizer, &second, false, usize::MAX)
            .unwrap();
        assert_eq!(ids, whole(&tokenizer, &second, false));
        // The system prompt's text is found; the new question is encoded; the
        // newlines and role names between special tokens are too short to keep.
        assert_eq!(cold.hits, 0);
        assert_eq!(warm.hits, 1, "{warm:?}");
        assert_eq!(
            warm.hit_bytes,
            "system\nYou are a helpful assistant. Answer briefly.".len() as u64
        );
        // Again: both long pieces found; the two "\n" between the turns encoded.
        let (_, again) = cache
            .encode(&tokenizer, &second, false, usize::MAX)
            .unwrap();
        assert_eq!((again.hits, again.misses), (2, 2), "{again:?}");
    }

    #[test]
    fn the_budget_bounds_what_is_kept() {
        let tokenizer = trained(false);
        let cache = PieceCache::for_tokenizer(&tokenizer, 64 << 10).unwrap();
        for i in 0..2_000 {
            let text = format!("{} {i} <|im_end|>", FRAGMENTS[8].repeat(8));
            cache.encode(&tokenizer, &text, false, usize::MAX).unwrap();
        }
        let (_, entries, bytes) = cache.totals();
        assert!(bytes <= 64 << 10, "{bytes} bytes held");
        assert!(entries < 2_000, "{entries} entries");
    }

    #[test]
    fn a_tokenizer_whose_pieces_depend_on_their_place_is_not_cached() {
        // A budget of 0 keeps nothing, but still encodes the pieces apart (the
        // bound is checked after each).
        assert!(!PieceCache::for_tokenizer(&trained(false), 0)
            .unwrap()
            .keeps());

        let mut lstrip = trained(false);
        lstrip
            .add_special_tokens([AddedToken::from("<mask>", true).lstrip(true)])
            .unwrap();
        let why = PieceCache::for_tokenizer(&lstrip, 1 << 20).unwrap_err();
        assert!(why.contains("<mask>"), "{why}");

        let mut first = trained(false);
        first.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true)));
        let why = PieceCache::for_tokenizer(&first, 1 << 20).unwrap_err();
        assert!(why.contains("first piece"), "{why}");

        let mut dropout = Tokenizer::new(BPE::builder().dropout(0.1).build().unwrap());
        dropout.with_pre_tokenizer(Some(ByteLevel::default()));
        let why = PieceCache::for_tokenizer(&dropout, 1 << 20).unwrap_err();
        assert!(why.contains("dropout"), "{why}");
    }

    /// A Qwen-shaped tokenizer (its regex, NFC, byte-level BPE) with chat
    /// special tokens, and a BOS its post-processor adds if `with_bos`.
    fn qwen_shaped(with_bos: bool) -> Tokenizer {
        use crate::models::cuts::{tests, QWEN2_PATTERN};
        let mut tokenizer = tests::trained(
            Some(tokenizers::normalizers::NFC.into()),
            tests::split(QWEN2_PATTERN),
        );
        tokenizer
            .add_special_tokens([
                AddedToken::from("<|im_start|>", true),
                AddedToken::from("<|im_end|>", true),
                AddedToken::from("<s>", true),
            ])
            .unwrap();
        if with_bos {
            let bos = tokenizer.token_to_id("<s>").unwrap();
            tokenizer.with_post_processor(Some(
                TemplateProcessing::builder()
                    .try_single("<s> $A")
                    .unwrap()
                    .special_tokens(vec![("<s>", bos)])
                    .build()
                    .unwrap(),
            ));
        }
        tokenizer
    }

    /// Long texts, each several parts long: the fragments in a pseudo-random
    /// order, with special tokens now and then, runs of white space and words
    /// longer than a part (so parts end where no cut is near), and lengths
    /// around the part size.
    fn long_texts() -> Vec<String> {
        use crate::models::cuts::{tests, PART_BYTES};
        let words = tests::texts(4_000, 8);
        let mut out = Vec::new();
        for (i, size) in [
            PART_BYTES - 1,
            PART_BYTES,
            PART_BYTES + 1,
            PART_BYTES + 7,
            2 * PART_BYTES + 3,
            3 * PART_BYTES,
            5 * PART_BYTES + 11,
            7 * PART_BYTES,
        ]
        .into_iter()
        .enumerate()
        {
            let mut text = String::new();
            let mut n = i * 97;
            while text.len() < size {
                n += 1;
                match n % 61 {
                    0 => text.push_str("<|im_end|>\n<|im_start|>user\n"),
                    1 if i % 2 == 0 => text.push_str(&" ".repeat(PART_BYTES / 3)),
                    2 if i % 3 == 0 => text.push_str(&"z".repeat(PART_BYTES + 5)),
                    // Longer than a long part: bounded from below first.
                    4 if i == 7 => text.push_str(&"y".repeat(LONG_PART + 3)),
                    3 => text.push_str(&"\n".repeat(40)),
                    _ => text.push_str(&words[n % words.len()]),
                }
            }
            // Cut to the size exactly where a character allows: lengths next
            // to the part size.
            let mut end = size.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            out.push(text);
        }
        out
    }

    #[test]
    fn long_pieces_tokenized_part_by_part_give_the_ids_of_the_whole_text() {
        for with_bos in [false, true] {
            let tokenizer = qwen_shaped(with_bos);
            let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
            assert_eq!(cache.uncut(), None);
            for text in long_texts() {
                for special in [false, true] {
                    let (ids, stats) = cache
                        .encode(&tokenizer, &text, special, usize::MAX)
                        .unwrap();
                    assert_eq!(
                        ids,
                        whole(&tokenizer, &text, special),
                        "bos {with_bos}, add_special {special}, {} bytes",
                        text.len()
                    );
                    // Under the bound: every byte but the special tokens' was
                    // encoded or found, once.
                    let specials = text.matches("<|im_end|>").count() * "<|im_end|>".len()
                        + text.matches("<|im_start|>").count() * "<|im_start|>".len();
                    assert_eq!(
                        stats.hit_bytes + stats.miss_bytes + specials as u64,
                        text.len() as u64
                    );
                }
            }
        }
    }

    #[test]
    fn a_prompt_far_over_the_bound_is_refused_after_tokenizing_about_the_bound() {
        use crate::models::cuts::PART_BYTES;
        const MAX: usize = 2_000;
        let tokenizer = qwen_shaped(true);
        let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
        // 4 MiB of text: one piece, and the same between special tokens.
        let sentence = "The quick brown fox jumps over the lazy dog, don't 123 中文，数据。\n";
        let plain = sentence.repeat((4 << 20) / sentence.len());
        let chat = format!(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{plain}<|im_end|>\n<|im_start|>assistant\n"
        );
        // What the bound's worth of this text is, in bytes.
        let per_token = sentence.len() as f64 / whole(&tokenizer, sentence, false).len() as f64;
        let at_the_bound = (MAX as f64 * per_token) as u64;
        for (name, text) in [("one piece", &plain), ("a chat", &chat)] {
            let Err(Stop::Over { counted, read }) = cache.encode(&tokenizer, text, true, MAX)
            else {
                panic!("{name}: not refused");
            };
            assert!(counted > MAX, "{name}: {counted}");
            // Within a part of the bound: the count stops at the first check past it.
            assert!(counted <= MAX + PART_BYTES, "{name}: {counted}");
            assert!(
                read as u64 <= at_the_bound + 2 * PART_BYTES as u64,
                "{name}: read {read} of {}",
                text.len()
            );
        }
        let (stats, _, _) = cache.totals();
        // Both texts together: about twice the bound's bytes were tokenized, of 8 MiB.
        assert!(
            stats.miss_bytes <= 2 * (at_the_bound + 2 * PART_BYTES as u64),
            "{} bytes tokenized for a bound of about {at_the_bound}",
            stats.miss_bytes
        );

        // No cut at all for megabytes (one word; CJK with no punctuation; one
        // word after a short sentence): bounded from below, nothing of it
        // tokenized.
        let tokenized = || cache.totals().0.miss_bytes;
        for (name, text) in [
            ("one word", "z".repeat(4 << 20)),
            ("CJK", "中文数据".repeat(1 << 18)),
            (
                "a sentence, then one word",
                format!("{sentence}{}", "q".repeat(4 << 20)),
            ),
        ] {
            let before = tokenized();
            let Err(Stop::Over { counted, read }) = cache.encode(&tokenizer, &text, true, MAX)
            else {
                panic!("{name}: not refused");
            };
            assert!(counted > MAX, "{name}: {counted}");
            assert!(
                read < text.len() / 4,
                "{name}: read {read} of {}",
                text.len()
            );
            assert!(tokenized() - before <= sentence.len() as u64, "{name}");
        }

        // A tokenizer whose cuts are not known stops only after the piece:
        // the whole text, as before.
        let mut uncut = qwen_shaped(true);
        uncut
            .with_normalizer(Some(tokenizers::normalizers::Lowercase))
            .unwrap();
        let cache = PieceCache::for_tokenizer(&uncut, 1 << 20).unwrap();
        assert!(cache.uncut().is_some());
        let short = &plain[..plain.len() / 64];
        assert!(matches!(
            cache.encode(&uncut, short, true, MAX),
            Err(Stop::Over { read, .. }) if read == short.len()
        ));
    }

    #[test]
    fn a_prompt_at_the_bound_is_encoded_and_one_token_more_is_refused() {
        let tokenizer = qwen_shaped(true);
        let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
        for text in long_texts() {
            let ids = whole(&tokenizer, &text, true);
            let n = ids.len();
            assert_eq!(cache.encode(&tokenizer, &text, true, n).unwrap().0, ids);
            match cache.encode(&tokenizer, &text, true, n - 1) {
                // The BOS is counted: the count passes n - 1 with the last token.
                Err(Stop::Over { counted, .. }) => assert_eq!(counted, n),
                other => panic!("{} bytes, bound {}: {other:?}", text.len(), n - 1),
            }
        }
    }
}
