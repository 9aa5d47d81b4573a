//! A lower bound on the tokens of a long stretch of text that no cut splits (one
//! huge word, a run of one character, CJK with no punctuation), so that such a
//! prompt far over `router.max_prompt_tokens` is refused without tokenizing it.
//!
//! A byte-level BPE writes a text as tokens of its vocabulary, one after the
//! other, that spell the normalized text's bytes exactly: the pre-tokenizers
//! whose pieces are cut ([`super::cuts`]) keep every byte, the model starts from
//! one symbol a byte (every byte has one) and only ever merges two neighbours
//! into a longer vocabulary entry. However the pre-tokenizer splits the text and
//! whatever merges BPE picks, its answer is one way of covering the bytes with
//! vocabulary entries, so it takes at least as many tokens as the fewest entries
//! that cover them. That fewest is a shortest path: `fewest[j]` = 1 + the least
//! `fewest[j - len]` over the entries of length `len` that end at byte `j`, found
//! with an Aho-Corasick automaton of every entry's bytes, left to right, a step
//! for each entry that ends at a byte (a few in text; for Qwen3, up to 86 in a
//! run of spaces). It can stop early: the entry that covers the byte at `k`
//! starts at most `longest` bytes before, so every cover of the whole has at
//! least 1 + min(`fewest` over the last `longest` boundaries) tokens. A ByteLevel
//! `add_prefix_space` only adds bytes, so only adds tokens.
//!
//! BPE comes close to the fewest: with Qwen3's vocabulary, 8 MiB of one letter
//! and 8 MiB of CJK with no punctuation, bounded against 262,144 tokens, were
//! refused after 2.1 MB and 1.6 MB, within 4% of where BPE's own count passes
//! the bound; tokenizing them whole cost all 8 MiB. Where BPE is further from
//! the fewest the bound refuses later, and a stretch it does not refuse is
//! tokenized as before.

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use tokenizers::models::ModelWrapper;
use tokenizers::{NormalizedString, Normalizer, Tokenizer};

/// Bytes of text normalized at a time while the bound is computed.
const STEP: usize = 64 << 10;

/// How many bytes between two looks at the bound.
const CHECK: usize = 4 << 10;

/// Every vocabulary entry of a byte-level BPE, as the bytes it stands for.
pub struct Cover {
    /// Each entry's bytes, with its length as the value.
    entries: DoubleArrayAhoCorasick<u32>,
    /// The longest entry, in bytes.
    longest: usize,
}

impl std::fmt::Debug for Cover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cover")
            .field("longest", &self.longest)
            .field("bytes", &self.entries.heap_bytes())
            .finish()
    }
}

impl Cover {
    /// For `tokenizer` (whose pieces are cut, so it is byte-level: see
    /// [`super::cuts`]), or why its tokens do not cover their text's bytes.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Cover, String> {
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return Err("its model is not BPE".into());
        };
        let affixed = |affix: &Option<String>| affix.as_ref().is_some_and(|a| !a.is_empty());
        if affixed(&bpe.continuing_subword_prefix) || affixed(&bpe.end_of_word_suffix) {
            return Err("its BPE marks subwords with a prefix or suffix".into());
        }
        let to_byte: HashMap<char, u8> = (0..=255u8).map(|b| (byte_char(b), b)).collect();
        let vocab = bpe.get_vocab();
        // Every byte must have its own entry: a byte without one would be dropped
        // or made `<unk>`, covering what no entry spells.
        if let Some(b) = (0..=255u8).find(|b| !vocab.contains_key(&byte_char(*b).to_string())) {
            return Err(format!("its vocabulary has no entry for the byte {b:#04x}"));
        }
        // Entries with a character outside the byte alphabet (special tokens
        // listed in the model's vocabulary) are never a merge's result.
        let entries: HashSet<Vec<u8>> = vocab
            .keys()
            .filter_map(|entry| entry.chars().map(|c| to_byte.get(&c).copied()).collect())
            .collect();
        let longest = entries.iter().map(Vec::len).max().unwrap_or(1);
        let entries = DoubleArrayAhoCorasickBuilder::new()
            .match_kind(MatchKind::Standard)
            .build_with_values(entries.into_iter().map(|bytes| {
                let len = bytes.len() as u32;
                (bytes, len)
            }))
            .map_err(|e| format!("its vocabulary cannot be matched: {e}"))?;
        Ok(Cover { entries, longest })
    }

    /// What the automaton holds, in bytes.
    pub fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
    }

    /// Whether `text` (a part of a piece cut exactly, so tokenized on its own
    /// as within the whole) has surely more than `room` tokens: then the least
    /// it has and how many of its bytes were read to know it. `None` when it may
    /// not (or its normalizer failed: the tokenizer will say so).
    pub fn more_than(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        room: usize,
    ) -> Option<(usize, usize)> {
        let read = Cell::new(0);
        let failed = Cell::new(false);
        let bytes = NormalizedBytes {
            normalizer: tokenizer.get_normalizer(),
            text,
            read: &read,
            failed: &failed,
            chunk: Vec::new(),
            at: 0,
        };
        // `fewest` of the last `longest + 1` boundaries, by boundary modulo that.
        let window = self.longest + 1;
        let mut fewest = vec![u32::MAX; window];
        fewest[0] = 0;
        let mut last = 0;
        let mut next_check = CHECK;
        let least_so_far = |fewest: &[u32], end: usize| {
            // Boundaries end - longest .. end - 1 are final; the byte before
            // `end` is there, so a cover has a token that covers it.
            (end.saturating_sub(self.longest)..end)
                .map(|i| fewest[i % window])
                .min()
                .map_or(u32::MAX, |least| least.saturating_add(1))
        };
        for found in self.entries.find_overlapping_iter_from_iter(bytes) {
            let end = found.end();
            if end > last {
                // The boundaries after `last` are new: no cover reaches them yet
                // (their slots held boundaries a window back).
                for j in last + 1..=end {
                    fewest[j % window] = u32::MAX;
                }
                last = end;
                if end >= next_check {
                    next_check = end + CHECK;
                    let least = least_so_far(&fewest, end) as usize;
                    if least > room {
                        return Some((least, read.get()));
                    }
                }
            }
            let before = fewest[found.start() % window];
            let slot = &mut fewest[end % window];
            *slot = (*slot).min(before.saturating_add(1));
        }
        if failed.get() {
            return None;
        }
        let least = fewest[last % window] as usize;
        (least > room).then_some((least, text.len()))
    }
}

/// The normalized bytes of a text, a step at a time: cut only before a
/// character that never changes and never combines with the one before it, so
/// that the steps normalized one by one are the whole normalized.
struct NormalizedBytes<'a> {
    normalizer: Option<&'a tokenizers::normalizers::NormalizerWrapper>,
    text: &'a str,
    /// Bytes of `text` normalized so far.
    read: &'a Cell<usize>,
    failed: &'a Cell<bool>,
    chunk: Vec<u8>,
    at: usize,
}

impl Iterator for NormalizedBytes<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        while self.at == self.chunk.len() {
            let from = self.read.get();
            if from >= self.text.len() || self.failed.get() {
                return None;
            }
            let end = step_end(self.text, from);
            let raw = &self.text[from..end];
            self.chunk = match self.normalizer {
                None => raw.as_bytes().to_vec(),
                Some(normalizer) => {
                    let mut normalized = NormalizedString::from(raw);
                    if normalizer.normalize(&mut normalized).is_err() {
                        self.failed.set(true);
                        return None;
                    }
                    normalized.get().as_bytes().to_vec()
                }
            };
            self.at = 0;
            self.read.set(end);
        }
        let byte = self.chunk[self.at];
        self.at += 1;
        Some(byte)
    }
}

/// The end of the step that starts at `from`: before an ASCII character or a CJK
/// ideograph at least [`STEP`] bytes on (the characters [`super::cuts`] relies
/// on for the same reason), or the end of the text.
fn step_end(text: &str, from: usize) -> usize {
    let mut target = from.saturating_add(STEP);
    while target < text.len() && !text.is_char_boundary(target) {
        target += 1;
    }
    if target >= text.len() {
        return text.len();
    }
    text[target..]
        .char_indices()
        .find(|(_, c)| c.is_ascii() || ('\u{4E00}'..='\u{9FA5}').contains(c))
        .map_or(text.len(), |(i, _)| target + i)
}

/// The character byte-level BPE writes for byte `b` (GPT-2's table, which
/// `tokenizers`' `ByteLevel` uses): printable Latin-1 as itself, the others from
/// U+0100 on, in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let before = (0..b).filter(|&o| !printable(o)).count() as u32;
    char::from_u32(0x100 + before).unwrap_or(char::REPLACEMENT_CHARACTER)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cuts::{tests, QWEN2_PATTERN};

    #[test]
    fn the_byte_table_is_byte_level_s() {
        let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        let ours: HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(ours, alphabet.into_iter().collect());
        assert_eq!(byte_char(b' '), '\u{120}');
        assert_eq!(byte_char(b'\n'), '\u{10A}');
    }

    /// The bound is never above the count BPE gives, at any room: for whole
    /// texts, and for runs of one character, where it is close to it.
    #[test]
    fn the_fewest_tokens_that_cover_a_text_are_never_more_than_bpe_s() {
        let tokenizer = tests::trained(
            Some(tokenizers::normalizers::NFC.into()),
            tests::split(QWEN2_PATTERN),
        );
        let cover = Cover::for_tokenizer(&tokenizer).unwrap();
        let mut texts = tests::texts(200, 40);
        texts.push("a".repeat(100_000));
        texts.push("中文".repeat(40_000));
        texts.push(" ".repeat(70_000));
        for text in &texts {
            let n = tokenizer.encode_fast(text.as_str(), false).unwrap().len();
            // Not more than `n - 1` is never claimed; more than 0 is whenever
            // the text is not empty.
            assert_eq!(cover.more_than(&tokenizer, text, n), None, "{text:?}");
            let Some((least, read)) = cover.more_than(&tokenizer, text, 0) else {
                panic!("{text:?}: no token at all");
            };
            assert!(least <= n && read <= text.len(), "{least} > {n}");
            if let Some((least, _)) = cover.more_than(&tokenizer, text, n / 3) {
                assert!(least <= n, "{least} > {n}");
            }
        }
        // A run of one letter: known over the room after about as many bytes as
        // BPE's tokens of that room span (with one step of normalizing), and long
        // before its end.
        let run = "a".repeat(1 << 20);
        let n = tokenizer.encode_fast(run.as_str(), false).unwrap().len();
        let room = 1_000;
        let (least, read) = cover.more_than(&tokenizer, &run, room).unwrap();
        assert!(least > room && least <= n);
        assert!(read <= room * run.len() / n * 2 + STEP + CHECK, "{read}");
    }
}
