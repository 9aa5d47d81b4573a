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
//! the same automaton (`daachorse`, leftmost-longest) over the same tokens.
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

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokenizers::{Encoding, Token, Tokenizer};

/// Bytes an entry costs beyond its text and ids (the table slot, two `Arc`
/// headers and lengths), so a cache of tiny pieces still keeps to its budget.
const ENTRY_OVERHEAD: u64 = 64;

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

/// The cache of one tokenizer's pieces.
pub struct PieceCache {
    /// The added tokens `tokenizers` splits at first, with their ids.
    splitter: Option<DoubleArrayAhoCorasick<u32>>,
    /// Whether the post-processor adds tokens when asked to (a BOS, an EOS).
    post_adds: bool,
    cache: Cache<Arc<str>, Arc<[u32]>, ByBytes>,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_bytes: AtomicU64,
    miss_bytes: AtomicU64,
}

impl std::fmt::Debug for PieceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceCache")
            .field("entries", &self.cache.len())
            .field("bytes", &self.cache.weight())
            .finish()
    }
}

impl PieceCache {
    /// A cache of at most `budget` bytes for `tokenizer`, or why its pieces cannot
    /// be encoded apart exactly (the caller then encodes every text whole).
    pub fn for_tokenizer(tokenizer: &Tokenizer, budget: u64) -> Result<PieceCache, String> {
        if budget == 0 {
            return Err("gateway.tokenizer_cache_mib is 0".into());
        }
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
            Some(
                DoubleArrayAhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build_with_values(pairs)
                    .map_err(|e| format!("its added tokens cannot be matched: {e}"))?,
            )
        };
        let post_adds = tokenizer
            .get_post_processor()
            .is_some_and(|p| tokenizers::PostProcessor::added_tokens(p, false) > 0);
        // A rough guess of the entry count; the weight decides what stays.
        let items = (budget / 4096).clamp(16, 1 << 20) as usize;
        Ok(PieceCache {
            splitter,
            post_adds,
            cache: Cache::with_weighter(items, budget, ByBytes),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_bytes: AtomicU64::new(0),
            miss_bytes: AtomicU64::new(0),
        })
    }

    /// The ids `tokenizer.encode(text, add_special)` gives, from cached pieces
    /// where it can; with what it found in the cache.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        add_special: bool,
    ) -> tokenizers::Result<(Vec<u32>, PieceStats)> {
        let mut ids = Vec::new();
        let mut stats = PieceStats::default();
        let mut at = 0;
        if let Some(splitter) = &self.splitter {
            for m in splitter.leftmost_find_iter(text) {
                self.piece(tokenizer, &text[at..m.start()], &mut ids, &mut stats)?;
                ids.push(m.value());
                at = m.end();
            }
        }
        self.piece(tokenizer, &text[at..], &mut ids, &mut stats)?;
        self.hits.fetch_add(stats.hits, Ordering::Relaxed);
        self.misses.fetch_add(stats.misses, Ordering::Relaxed);
        self.hit_bytes.fetch_add(stats.hit_bytes, Ordering::Relaxed);
        self.miss_bytes
            .fetch_add(stats.miss_bytes, Ordering::Relaxed);
        if add_special && self.post_adds {
            // What `encode` does last, on the joined ids: only the ids are read
            // back, so the tokens' text and offsets can stay empty.
            let tokens = ids
                .iter()
                .map(|&id| Token::new(id, String::new(), (0, 0)))
                .collect();
            let encoding = tokenizer.post_process(Encoding::from_tokens(tokens, 0), None, true)?;
            ids = encoding.get_ids().to_vec();
        }
        Ok((ids, stats))
    }

    fn piece(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        ids: &mut Vec<u32>,
        stats: &mut PieceStats,
    ) -> tokenizers::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() >= MIN_CACHED_PIECE {
            if let Some(cached) = self.cache.get(piece) {
                stats.hits += 1;
                stats.hit_bytes += piece.len() as u64;
                ids.extend_from_slice(&cached);
                return Ok(());
            }
        }
        let encoding = tokenizer.encode_fast(piece, false)?;
        stats.misses += 1;
        stats.miss_bytes += piece.len() as u64;
        ids.extend_from_slice(encoding.get_ids());
        if piece.len() >= MIN_CACHED_PIECE {
            self.cache
                .insert(Arc::from(piece), Arc::from(encoding.get_ids()));
        }
        Ok(())
    }

    /// Totals since the cache was made, and what it holds now (entries, bytes).
    pub fn totals(&self) -> (PieceStats, u64, u64) {
        let stats = PieceStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_bytes: self.hit_bytes.load(Ordering::Relaxed),
            miss_bytes: self.miss_bytes.load(Ordering::Relaxed),
        };
        (stats, self.cache.len() as u64, self.cache.weight())
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
            assert_eq!(cache.post_adds, with_bos);
            for round in ["cold", "warm"] {
                for text in texts(400) {
                    for special in [false, true] {
                        let (ids, _) = cache.encode(&tokenizer, &text, special).unwrap();
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

    #[test]
    fn a_shared_system_prompt_is_encoded_once_and_then_found() {
        let tokenizer = trained(false);
        let cache = PieceCache::for_tokenizer(&tokenizer, 1 << 20).unwrap();
        let system = "<|im_start|>system\nYou are a helpful assistant. Answer briefly.<|im_end|>\n";
        let first = format!("{system}<|im_start|>user\nWhat is a fox?<|im_end|>\n");
        let second = format!("{system}<|im_start|>user\nWhat is a lazy dog?<|im_end|>\n");
        let (_, cold) = cache.encode(&tokenizer, &first, false).unwrap();
        let (ids, warm) = cache.encode(&tokenizer, &second, false).unwrap();
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
        let (_, again) = cache.encode(&tokenizer, &second, false).unwrap();
        assert_eq!((again.hits, again.misses), (2, 2), "{again:?}");
    }

    #[test]
    fn the_budget_bounds_what_is_kept() {
        let tokenizer = trained(false);
        let cache = PieceCache::for_tokenizer(&tokenizer, 64 << 10).unwrap();
        for i in 0..2_000 {
            let text = format!("{} {i} <|im_end|>", FRAGMENTS[8].repeat(8));
            cache.encode(&tokenizer, &text, false).unwrap();
        }
        let (_, entries, bytes) = cache.totals();
        assert!(bytes <= 64 << 10, "{bytes} bytes held");
        assert!(entries < 2_000, "{entries} entries");
    }

    #[test]
    fn a_tokenizer_whose_pieces_depend_on_their_place_is_not_cached() {
        assert!(PieceCache::for_tokenizer(&trained(false), 0).is_err());

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
}
