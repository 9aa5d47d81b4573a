//! Engine KV-event batches (msgpack) → the index's [`KvEvent`]s.
//!
//! vLLM, SGLang and TensorRT-LLM's push publisher send one batch per scheduler step:
//! `[ts, events, dp_rank?]`, each event either a map tagged by `"type"` (vLLM ≥ 0.24,
//! SGLang, TRT-LLM) or a tagged array (vLLM ≤ 0.23). The decoder reads the bytes in one
//! pass with `rmp`'s primitives, borrowing strings from the payload, and turns each
//! event straight into the index's form, so a block costs one hash read and its token
//! ids, not a tree of dynamic values. A stored block leaves as its engine hash and the
//! router's hash of its content ([`KvEvent::Hashed`]): hashing here, on the source's
//! own thread, keeps that work off the ingestion thread that every source shares.
//! What it decides per event:
//! - **Hashes.** A u64 is kept as is; a negative integer (SGLang's signed i64) keeps its
//!   64 bits (so a `kv.fetch` can give the engine back exactly what it published); a
//!   byte string (vLLM's 32-byte digest when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`)
//!   becomes its last 8 bytes big-endian — the very integer vLLM publishes in its
//!   default integer mode, so the same engine is matched alike in either mode.
//! - **Which blocks count.** Only media in the configured set (default `GPU`; a missing
//!   medium is the device), only `LOCAL` or unspecified locality (a `REMOTE` block is
//!   not in this engine's cache), and only full-attention groups of hybrid models (a
//!   store whose `kv_cache_spec_kind` is anything else, and later removals in that
//!   group, are skipped). `ownership` (which offloading tier made the event) changes
//!   nothing: the medium already says where the block lives.
//! - **Identity.** `lora_name` and `cache_salt` (SGLang's field, or vLLM's salt in the
//!   first block's `extra_keys`) seed the router's hashes; other extra keys of a block
//!   (multimodal items, prompt-embedding digests) are hashed into that block, so it
//!   matches no prompt of tokens alone.
//!
//! Unknown fields are skipped; unknown event types and refused events are counted in
//! [`DecodeCounts`]; anything malformed fails the whole batch with a [`DecodeError`]
//! that says where — the subscriber counts it and resynchronises, never panics.

use crate::router::index::{hashed_blocks, identity_seed, KvEvent};
use rmp::decode as mp;
use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

/// Which blocks count, and the router's block size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeSettings {
    pub block_size: usize,
    /// Media whose blocks are indexed, compared without regard to case.
    pub media: Vec<String>,
}

impl DecodeSettings {
    fn counts_medium(&self, medium: Option<&str>) -> bool {
        match medium {
            None => true,
            Some(medium) => self.media.iter().any(|m| m.eq_ignore_ascii_case(medium)),
        }
    }
}

/// A malformed batch: what was expected and at which byte of the payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KV-event batch at byte {offset}: {problem}")]
pub struct DecodeError {
    pub offset: usize,
    pub problem: String,
}

/// What one batch held besides its events, for metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DecodeCounts {
    pub stored: u64,
    pub removed: u64,
    pub cleared: u64,
    /// Events of a type this router does not know (skipped).
    pub unknown_type: u64,
    /// Events for a medium or locality that does not count (skipped).
    pub other_medium: u64,
    /// Events of a group that is not full attention (skipped).
    pub other_group: u64,
    /// Stores whose block size is not the router's (refused).
    pub wrong_block_size: u64,
    /// The block size of the last such store, for the log line.
    pub last_wrong_block_size: Option<u64>,
    /// Stores without tokens (vLLM's offloading placeholders: `block_size` 0, no
    /// token ids): nothing to match, skipped.
    pub placeholder: u64,
    /// Events whose fields contradict each other (refused; the rest of the batch
    /// counts).
    pub malformed: u64,
    /// What was wrong with the last of those, for the log line.
    pub last_malformed: Option<String>,
}

/// How the engine spelled its hashes, seen so far on one source.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HashForms {
    /// A negative integer: the engine's hashes are signed 64-bit (SGLang).
    pub signed: bool,
    /// A byte string: the engine publishes digests (vLLM without integer hashes).
    pub digest: bool,
}

/// One decoded batch.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DecodedBatch {
    pub ts: f64,
    pub dp_rank: Option<u32>,
    pub events: Vec<KvEvent>,
    pub counts: DecodeCounts,
    pub hashes: HashForms,
}

/// Per-source decoding state that outlives one batch: the groups of a hybrid model
/// that are not full attention, learnt from their stores.
#[derive(Debug, Default, Clone)]
pub struct GroupFilter {
    skipped: Vec<i64>,
}

/// How to read a token id from the 8 bytes at its marker, loaded as one big-endian
/// word, by marker: the id takes `TOKEN_ADVANCE` bytes and is `(word >> TOKEN_SHIFT) as
/// u32 & TOKEN_MASK`. A positive fixint is its marker (1 byte); u8, u16 and u32 take
/// their 1, 2 or 4 bytes after it. An advance of 0 marks any other encoding (read the
/// slow way). Separate tables rather than one packed word: each field is then one
/// load, not a load, shifts and masks, in a loop that runs for every token id of
/// every event.
const TOKEN_ADVANCE: [u8; 256] = by_marker(0, [1, 2, 3, 5]);

/// See [`TOKEN_ADVANCE`].
const TOKEN_SHIFT: [u8; 256] = by_marker(0, [56, 48, 40, 24]);

/// See [`TOKEN_ADVANCE`].
const TOKEN_MASK: [u32; 256] = by_marker(0, [0xff, 0xff, 0xffff, u32::MAX]);

/// See [`TOKEN_ADVANCE`]: the shift that brings the next marker, `advance` bytes into
/// the word, to its low byte (`56 - 8 * advance`).
const TOKEN_NEXT: [u8; 256] = by_marker(0, [48, 40, 32, 16]);

/// A table by msgpack marker: `[fixint, u8, u16, u32]` for a positive fixint and the
/// unsigned markers 0xcc, 0xcd and 0xce, `other` for every other marker.
const fn by_marker<T: Copy>(other: T, [fixint, u8, u16, u32]: [T; 4]) -> [T; 256] {
    let mut table = [other; 256];
    let mut m = 0;
    while m < 0x80 {
        table[m] = fixint;
        m += 1;
    }
    table[0xcc] = u8;
    table[0xcd] = u16;
    table[0xce] = u32;
    table
}

const _: () = {
    let mut m = 0;
    while m < 256 {
        assert!(TOKEN_ADVANCE[m] == 0 || TOKEN_NEXT[m] == 56 - 8 * TOKEN_ADVANCE[m]);
        m += 1;
    }
};

/// Token ids read per stretch of [`Reader::tokens`]' fast loop, and the bytes a stretch
/// may span (a power of two, at least five bytes an id).
const TOKEN_STRETCH: usize = 16;
const TOKEN_SPAN: usize = 128;
const _: () = assert!(TOKEN_STRETCH * 5 <= TOKEN_SPAN && TOKEN_SPAN.is_power_of_two());

/// Groups a hybrid model may have that are not full attention, remembered at most.
const MAX_GROUPS: usize = 64;

/// Most elements reserved up front for one list: a length field is not trusted
/// further than this before its elements arrive.
const MAX_LEN: u32 = 1 << 16;

/// Decodes one batch payload into `out` (cleared first).
pub fn decode_batch(
    payload: &[u8],
    settings: &DecodeSettings,
    groups: &mut GroupFilter,
    out: &mut DecodedBatch,
) -> Result<(), DecodeError> {
    out.events.clear();
    out.counts = DecodeCounts::default();
    out.hashes = HashForms::default();
    out.dp_rank = None;
    let mut rd = Reader::new(payload);
    let len = rd.array_len("the batch [ts, events, dp_rank]")?;
    if !(2..=3).contains(&len) {
        return Err(rd.fail(format!(
            "a batch is an array of 2 or 3 elements [ts, events, dp_rank], found {len}"
        )));
    }
    out.ts = rd.number("the batch's ts")?;
    let events = rd.array_len("the batch's events")?;
    for _ in 0..events {
        rd.event(settings, groups, out)?;
    }
    if len == 3 {
        out.dp_rank = rd.optional_u32("the batch's dp_rank")?;
    }
    if !rd.rest.is_empty() {
        return Err(rd.fail(format!("{} bytes follow the batch", rd.rest.len())));
    }
    Ok(())
}

/// The fields an event may carry, whichever encoding it came in.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u32>,
    block_size: Option<u64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    cache_salt: Option<&'a str>,
    /// The raw `extra_keys` value, read once the LoRA name is known.
    extra_keys: Option<&'a [u8]>,
    group_idx: Option<i64>,
    kind: Option<&'a str>,
    locality: Option<&'a str>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Type {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Type {
    fn parse(name: &str) -> Self {
        match name {
            "BlockStored" => Self::Stored,
            "BlockRemoved" => Self::Removed,
            "AllBlocksCleared" => Self::Cleared,
            _ => Self::Unknown,
        }
    }
}

struct Reader<'a> {
    rest: &'a [u8],
    total: usize,
}

impl<'a> Reader<'a> {
    fn new(payload: &'a [u8]) -> Self {
        Self {
            rest: payload,
            total: payload.len(),
        }
    }

    fn offset(&self) -> usize {
        self.total - self.rest.len()
    }

    fn fail(&self, problem: impl Into<String>) -> DecodeError {
        DecodeError {
            offset: self.offset(),
            problem: problem.into(),
        }
    }

    fn peek(&self) -> Option<Marker> {
        self.rest.first().map(|b| Marker::from_u8(*b))
    }

    fn expected(&self, what: &str) -> DecodeError {
        match self.peek() {
            None => self.fail(format!("the payload ends where {what} should be")),
            Some(marker) => self.fail(format!("expected {what}, found {}", describe(marker))),
        }
    }

    fn is_nil(&mut self) -> bool {
        if self.peek() == Some(Marker::Null) {
            self.rest = &self.rest[1..];
            true
        } else {
            false
        }
    }

    fn array_len(&mut self, what: &str) -> Result<u32, DecodeError> {
        let before = self.rest;
        mp::read_array_len(&mut self.rest).map_err(|_| {
            self.rest = before;
            self.expected(&format!("an array ({what})"))
        })
    }

    fn map_len(&mut self, what: &str) -> Result<u32, DecodeError> {
        let before = self.rest;
        mp::read_map_len(&mut self.rest).map_err(|_| {
            self.rest = before;
            self.expected(&format!("a map ({what})"))
        })
    }

    fn str(&mut self, what: &str) -> Result<&'a str, DecodeError> {
        let before = self.rest;
        let text = self.key(what)?;
        std::str::from_utf8(text).map_err(|_| {
            // The error's offset names where the string starts.
            self.rest = before;
            self.fail(format!("{what} is not valid UTF-8"))
        })
    }

    /// A string's bytes, for a map key: keys are only compared with the fields this
    /// decoder knows, so one that is not UTF-8 is just another unknown field, and no
    /// key needs the UTF-8 check that [`str`](Self::str) makes (a few dozen bytes of
    /// every event).
    fn key(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let before = self.rest;
        let len = match mp::read_str_len(&mut self.rest) {
            Ok(len) => len as usize,
            Err(_) => {
                self.rest = before;
                return Err(self.expected(&format!("a string ({what})")));
            }
        };
        if self.rest.len() < len {
            return Err(self.fail(format!("{what}: a string of {len} bytes runs past the end")));
        }
        let (key, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok(key)
    }

    fn optional_str(&mut self, what: &str) -> Result<Option<&'a str>, DecodeError> {
        if self.is_nil() {
            Ok(None)
        } else {
            self.str(what).map(Some)
        }
    }

    fn number(&mut self, what: &str) -> Result<f64, DecodeError> {
        match self.peek() {
            Some(Marker::F64) => mp::read_f64(&mut self.rest).map_err(|_| self.expected(what)),
            Some(Marker::F32) => mp::read_f32(&mut self.rest)
                .map(f64::from)
                .map_err(|_| self.expected(what)),
            _ => {
                let before = self.rest;
                mp::read_int::<i64, _>(&mut self.rest)
                    .map(|n| n as f64)
                    .map_err(|_| {
                        self.rest = before;
                        self.expected(&format!("a number ({what})"))
                    })
            }
        }
    }

    fn int<T: num_traits::FromPrimitive>(&mut self, what: &str) -> Result<T, DecodeError> {
        let before = self.rest;
        mp::read_int::<T, _>(&mut self.rest).map_err(|_| {
            self.rest = before;
            self.expected(&format!("an integer in range ({what})"))
        })
    }

    fn optional_int<T: num_traits::FromPrimitive>(
        &mut self,
        what: &str,
    ) -> Result<Option<T>, DecodeError> {
        if self.is_nil() {
            Ok(None)
        } else {
            self.int(what).map(Some)
        }
    }

    fn optional_u32(&mut self, what: &str) -> Result<Option<u32>, DecodeError> {
        self.optional_int::<u32>(what)
    }

    /// One engine hash: an unsigned or signed integer, or a byte string.
    fn hash(&mut self, forms: &mut HashForms, what: &str) -> Result<u64, DecodeError> {
        // vLLM's and TRT-LLM's hashes are nearly all full-width u64s: read those first.
        if let Some(([0xcf, value @ ..], rest)) = self.rest.split_first_chunk::<9>() {
            self.rest = rest;
            return Ok(u64::from_be_bytes(*value));
        }
        match self.peek() {
            Some(Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64) => {
                let value = self.int::<i64>(what)?;
                if value < 0 {
                    forms.signed = true;
                }
                Ok(value as u64)
            }
            Some(Marker::Bin8 | Marker::Bin16 | Marker::Bin32) => {
                let len =
                    mp::read_bin_len(&mut self.rest).map_err(|_| self.expected(what))? as usize;
                if len == 0 || self.rest.len() < len {
                    return Err(self.fail(format!(
                        "{what}: a byte-string hash of {len} bytes (empty, or past the end)"
                    )));
                }
                let (digest, rest) = self.rest.split_at(len);
                self.rest = rest;
                forms.digest = true;
                let tail = &digest[len.saturating_sub(8)..];
                Ok(tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
            }
            _ => self.int::<u64>(what),
        }
    }

    fn hashes(&mut self, forms: &mut HashForms, out: &mut Vec<u64>) -> Result<(), DecodeError> {
        let len = self.array_len("block_hashes")?;
        out.clear();
        out.reserve(len.min(MAX_LEN) as usize);
        for _ in 0..len {
            out.push(self.hash(forms, "a block hash")?);
        }
        Ok(())
    }

    fn optional_hash(
        &mut self,
        forms: &mut HashForms,
        what: &str,
    ) -> Result<Option<u64>, DecodeError> {
        if self.is_nil() {
            Ok(None)
        } else {
            self.hash(forms, what).map(Some)
        }
    }

    fn tokens(&mut self, out: &mut Vec<u32>) -> Result<(), DecodeError> {
        let len = self.array_len("token_ids")? as usize;
        out.clear();
        // Every token id takes at least a byte: a count past the end of the payload is
        // malformed, and refusing it bounds what is allocated for the ids.
        if len > self.rest.len() {
            return Err(self.fail(format!(
                "token_ids promises {len} ids but {} bytes remain",
                self.rest.len()
            )));
        }
        out.resize(len, 0);
        // Token ids are non-negative integers below 2^32, and a vocabulary mixes their
        // one-, two-, three- and five-byte encodings at random, so a branch per width
        // would mispredict about every other token: one 8-byte load at the token's
        // position, and tables by its marker say how to shift and mask the id out of
        // it and how far to move on. Where the payload holds a whole stretch of ids'
        // worth of bytes (and 8 to spare), no load in the stretch needs a bounds check
        // of its own: its offset is masked into the span, which it never leaves. Other
        // encodings, and the last few bytes of the payload, take `rmp`'s path.
        let bytes = self.rest;
        let mut at = 0;
        let mut i = 0;
        while i < len {
            if let Some(span) = bytes
                .get(at..)
                .and_then(<[u8]>::first_chunk::<{ TOKEN_SPAN + 8 }>)
            {
                let stretch = (len - i).min(TOKEN_STRETCH);
                let word_at = |p: usize| {
                    span[p & (TOKEN_SPAN - 1)..]
                        .first_chunk::<8>()
                        .map_or(0, |w| u64::from_be_bytes(*w))
                };
                let mut p = 0;
                let mut read = 0;
                let mut word = word_at(0);
                let mut marker = (word >> 56) as usize;
                for slot in &mut out[i..i + stretch] {
                    let advance = TOKEN_ADVANCE[marker];
                    if advance == 0 {
                        break;
                    }
                    *slot = (word >> TOKEN_SHIFT[marker]) as u32 & TOKEN_MASK[marker];
                    // Where the next id starts depends on this one's marker: a chain
                    // through the whole list, which is what bounds this loop. Its next
                    // link is read off the word already loaded (the next marker is
                    // `advance` bytes into it), so loading the next word stays off
                    // the chain: a table lookup and a shift per id instead of a table
                    // lookup, a load and a byte swap.
                    marker = (word >> TOKEN_NEXT[marker]) as u8 as usize;
                    p += usize::from(advance);
                    word = word_at(p);
                    read += 1;
                }
                at += p;
                i += read;
                if read == stretch {
                    continue;
                }
            } else if let Some(word) = bytes.get(at..).and_then(<[u8]>::first_chunk::<8>) {
                let word = u64::from_be_bytes(*word);
                let marker = (word >> 56) as usize;
                let advance = TOKEN_ADVANCE[marker];
                if advance != 0 {
                    out[i] = (word >> TOKEN_SHIFT[marker]) as u32 & TOKEN_MASK[marker];
                    at += usize::from(advance);
                    i += 1;
                    continue;
                }
            }
            self.rest = bytes.get(at..).unwrap_or_default();
            out[i] = if self.peek() == Some(Marker::FixArray(2)) {
                // SGLang under EAGLE publishes each token as a bigram (the token, the
                // next one): the first is the token.
                self.rest = &self.rest[1..];
                let token = self.int::<u32>("a token id")?;
                self.value()?;
                token
            } else {
                self.int::<u32>("a token id")?
            };
            at = bytes.len() - self.rest.len();
            i += 1;
        }
        self.rest = bytes.get(at..).unwrap_or_default();
        Ok(())
    }

    /// Skips one value of any shape, returning its bytes. Iterative, and a container
    /// cannot promise more values than bytes remain, so hostile input costs at most
    /// one step per byte.
    fn value(&mut self) -> Result<&'a [u8], DecodeError> {
        let start = self.rest;
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let Some((&byte, rest)) = self.rest.split_first() else {
                return Err(self.fail("a value runs past the end"));
            };
            self.rest = rest;
            let (skip, more) = match Marker::from_u8(byte) {
                Marker::Null
                | Marker::True
                | Marker::False
                | Marker::FixPos(_)
                | Marker::FixNeg(_) => (0, 0),
                Marker::U8 | Marker::I8 => (1, 0),
                Marker::U16 | Marker::I16 => (2, 0),
                Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
                Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
                Marker::FixStr(n) => (usize::from(n), 0),
                Marker::Str8 | Marker::Bin8 => (self.length(1)?, 0),
                Marker::Str16 | Marker::Bin16 => (self.length(2)?, 0),
                Marker::Str32 | Marker::Bin32 => (self.length(4)?, 0),
                Marker::FixArray(n) => (0, usize::from(n)),
                Marker::Array16 => (0, self.length(2)?),
                Marker::Array32 => (0, self.length(4)?),
                Marker::FixMap(n) => (0, 2 * usize::from(n)),
                Marker::Map16 => (0, 2 * self.length(2)?),
                Marker::Map32 => (0, 2 * self.length(4)?),
                Marker::FixExt1 => (2, 0),
                Marker::FixExt2 => (3, 0),
                Marker::FixExt4 => (5, 0),
                Marker::FixExt8 => (9, 0),
                Marker::FixExt16 => (17, 0),
                Marker::Ext8 => (self.length(1)? + 1, 0),
                Marker::Ext16 => (self.length(2)? + 1, 0),
                Marker::Ext32 => (self.length(4)? + 1, 0),
                Marker::Reserved => return Err(self.fail("a reserved byte (0xc1)")),
            };
            if skip > self.rest.len() {
                return Err(self.fail("a value runs past the end"));
            }
            self.rest = &self.rest[skip..];
            pending += more;
            if pending > self.rest.len() {
                return Err(self.fail("a container holds more values than bytes remain"));
            }
        }
        Ok(&start[..start.len() - self.rest.len()])
    }

    /// A big-endian length of `width` bytes.
    fn length(&mut self, width: usize) -> Result<usize, DecodeError> {
        if self.rest.len() < width {
            return Err(self.fail("a length runs past the end"));
        }
        let (bytes, rest) = self.rest.split_at(width);
        self.rest = rest;
        Ok(bytes.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b)))
    }

    fn event(
        &mut self,
        settings: &DecodeSettings,
        groups: &mut GroupFilter,
        out: &mut DecodedBatch,
    ) -> Result<(), DecodeError> {
        let mut fields = Fields::default();
        let mut forms = HashForms::default();
        let kind = match self.peek() {
            Some(Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
                self.tagged_map(&mut fields, &mut forms)?
            }
            Some(Marker::FixArray(_) | Marker::Array16 | Marker::Array32) => {
                self.tagged_array(&mut fields, &mut forms)?
            }
            _ => return Err(self.expected("an event (a map with \"type\", or a tagged array)")),
        };
        let events = out.events.len();
        if let Err(problem) = finish(kind, fields, settings, groups, out) {
            // The batch's framing held, so only this event is refused.
            out.counts.malformed += 1;
            out.counts.last_malformed = Some(problem);
        }
        // Only events that count say how the engine spells its hashes (vLLM's CPU
        // offloading publishes digests even in its integer mode).
        if out.events.len() > events {
            out.hashes.signed |= forms.signed;
            out.hashes.digest |= forms.digest;
        }
        Ok(())
    }

    fn tagged_map(
        &mut self,
        fields: &mut Fields<'a>,
        forms: &mut HashForms,
    ) -> Result<Type, DecodeError> {
        let len = self.map_len("an event")?;
        let mut kind = None;
        for _ in 0..len {
            let key = self.key("an event field name")?;
            match key {
                b"type" => kind = Some(Type::parse(self.str("the event type")?)),
                b"block_hashes" => self.hashes(forms, &mut fields.block_hashes)?,
                b"parent_block_hash" => {
                    fields.parent = self.optional_hash(forms, "parent_block_hash")?
                }
                b"token_ids" => self.tokens(&mut fields.token_ids)?,
                b"block_size" => fields.block_size = self.optional_int("block_size")?,
                b"medium" => fields.medium = self.optional_str("medium")?,
                b"lora_name" => fields.lora_name = self.optional_str("lora_name")?,
                b"cache_salt" => fields.cache_salt = self.optional_str("cache_salt")?,
                b"extra_keys" => fields.extra_keys = Some(self.value()?),
                b"group_idx" => fields.group_idx = self.optional_int("group_idx")?,
                b"kv_cache_spec_kind" => fields.kind = self.optional_str("kv_cache_spec_kind")?,
                b"locality" => fields.locality = self.optional_str("locality")?,
                _ => {
                    self.value()?;
                }
            }
        }
        kind.ok_or_else(|| self.fail("an event map has no \"type\" field"))
    }

    /// vLLM ≤ 0.23: `[tag, fields…]` in declaration order; trailing fields may be
    /// missing (older versions) or more (newer ones, skipped).
    fn tagged_array(
        &mut self,
        fields: &mut Fields<'a>,
        forms: &mut HashForms,
    ) -> Result<Type, DecodeError> {
        let len = self.array_len("an event")?;
        if len == 0 {
            return Err(self.fail("an event array is empty (no type tag)"));
        }
        let kind = Type::parse(self.str("the event type tag")?);
        for position in 1..len {
            match (kind, position) {
                (Type::Stored | Type::Removed, 1) => {
                    self.hashes(forms, &mut fields.block_hashes)?
                }
                (Type::Stored, 2) => {
                    fields.parent = self.optional_hash(forms, "parent_block_hash")?
                }
                (Type::Stored, 3) => self.tokens(&mut fields.token_ids)?,
                (Type::Stored, 4) => fields.block_size = self.optional_int("block_size")?,
                (Type::Stored, 6) | (Type::Removed, 2) => {
                    fields.medium = self.optional_str("medium")?
                }
                (Type::Stored, 7) => fields.lora_name = self.optional_str("lora_name")?,
                (Type::Stored, 8) => fields.extra_keys = Some(self.value()?),
                (Type::Stored, 9) | (Type::Removed, 3) => {
                    fields.group_idx = self.optional_int("group_idx")?
                }
                (Type::Stored, 10) => fields.kind = self.optional_str("kv_cache_spec_kind")?,
                _ => {
                    self.value()?;
                }
            }
        }
        Ok(kind)
    }
}

/// Turns one event's fields into an index event (or a count).
fn finish(
    kind: Type,
    fields: Fields<'_>,
    settings: &DecodeSettings,
    groups: &mut GroupFilter,
    out: &mut DecodedBatch,
) -> Result<(), String> {
    let counts = &mut out.counts;
    match kind {
        Type::Unknown => {
            counts.unknown_type += 1;
            return Ok(());
        }
        Type::Cleared => {
            counts.cleared += 1;
            out.events.push(KvEvent::Cleared);
            return Ok(());
        }
        Type::Stored | Type::Removed => {}
    }
    let counted_medium = settings.counts_medium(fields.medium)
        && fields
            .locality
            .is_none_or(|l| l.eq_ignore_ascii_case("LOCAL"));
    if kind == Type::Removed {
        if !counted_medium {
            counts.other_medium += 1;
        } else if fields
            .group_idx
            .is_some_and(|g| groups.skipped.contains(&g))
        {
            counts.other_group += 1;
        } else {
            counts.removed += 1;
            out.events.push(KvEvent::Removed {
                block_hashes: fields.block_hashes,
            });
        }
        return Ok(());
    }
    if let (Some(spec), Some(group)) = (fields.kind, fields.group_idx) {
        let full = spec.eq_ignore_ascii_case("full_attention");
        match groups.skipped.iter().position(|g| *g == group) {
            Some(at) if full => {
                groups.skipped.swap_remove(at);
            }
            None if !full && groups.skipped.len() < MAX_GROUPS => groups.skipped.push(group),
            _ => {}
        }
    }
    if fields
        .kind
        .is_some_and(|k| !k.eq_ignore_ascii_case("full_attention"))
        || (fields.kind.is_none()
            && fields
                .group_idx
                .is_some_and(|g| groups.skipped.contains(&g)))
    {
        counts.other_group += 1;
        return Ok(());
    }
    if !counted_medium {
        counts.other_medium += 1;
        return Ok(());
    }
    let blocks = fields.block_hashes.len();
    if fields.token_ids.is_empty() && fields.block_size == Some(0) {
        counts.placeholder += 1;
        return Ok(());
    }
    let block_size = fields.block_size.unwrap_or(settings.block_size as u64);
    if block_size != settings.block_size as u64 {
        counts.wrong_block_size += 1;
        counts.last_wrong_block_size = Some(block_size);
        return Ok(());
    }
    if fields.token_ids.len() != blocks * settings.block_size {
        return Err(format!(
            "a BlockStored event has {blocks} block hashes but {} token ids (expected \
             {blocks} × block_size {})",
            fields.token_ids.len(),
            settings.block_size
        ));
    }
    let (cache_salt, extra_keys) = match fields.extra_keys {
        None => (fields.cache_salt, Vec::new()),
        Some(raw) => read_extra_keys(raw, blocks, fields.lora_name, fields.parent.is_none())?
            .fold_salt(fields.cache_salt),
    };
    counts.stored += 1;
    // Each block is hashed here, on the source's own thread, straight from the
    // decoded token ids: the ingestion thread that every source shares only chains
    // the hashes, and the event carries 16 bytes a block, not its tokens.
    let stored = hashed_blocks(
        fields
            .block_hashes
            .iter()
            .copied()
            .zip(fields.token_ids.chunks_exact(settings.block_size)),
        &extra_keys,
    );
    out.events.push(KvEvent::Hashed {
        parent_block_hash: fields.parent,
        identity: identity_seed(fields.lora_name, cache_salt),
        blocks: stored,
    });
    Ok(())
}

/// What a stored event's `extra_keys` said.
struct ExtraKeys<'a> {
    salt: Option<&'a str>,
    blocks: Vec<(u32, u64)>,
}

impl<'a> ExtraKeys<'a> {
    fn fold_salt(self, field: Option<&'a str>) -> (Option<&'a str>, Vec<(u32, u64)>) {
        (field.or(self.salt), self.blocks)
    }
}

/// vLLM's `extra_keys`: `nil`, or one entry per block, each `nil` or an array of keys
/// in the order vLLM hashes them: the LoRA name, multimodal `(identifier, offset)`
/// pairs, the cache salt (first block of a sequence only), prompt-embedding digests.
/// The LoRA name is already the event's `lora_name`; a string on a sequence's first
/// block that is not the LoRA name is the salt; every other key (multimodal, digests,
/// anything newer) is hashed into its block.
fn read_extra_keys<'a>(
    raw: &'a [u8],
    blocks: usize,
    lora_name: Option<&str>,
    starts_sequence: bool,
) -> Result<ExtraKeys<'a>, String> {
    let mut rd = Reader::new(raw);
    let mut out = ExtraKeys {
        salt: None,
        blocks: Vec::new(),
    };
    if rd.is_nil() {
        return Ok(out);
    }
    let len = rd
        .array_len("extra_keys")
        .map_err(|e| format!("extra_keys: {}", e.problem))? as usize;
    if len != blocks {
        return Err(format!(
            "extra_keys has {len} entries for {blocks} blocks (one per block expected)"
        ));
    }
    for block in 0..len {
        if rd.is_nil() {
            continue;
        }
        let keys = rd
            .array_len("a block's extra keys")
            .map_err(|e| format!("extra_keys[{block}]: {}", e.problem))?;
        let mut other: Option<u64> = None;
        let mut mix = |bytes: &[u8]| {
            let hash = xxh3_64(bytes);
            other = Some(other.map_or(hash, |h| h.rotate_left(23) ^ hash));
        };
        // vLLM puts the salt after the multimodal keys; older versions publish a
        // multimodal identifier as a bare string, so of a first block's strings
        // the last one is the salt and any before it are hashed in.
        let mut salt: Option<(&'a str, &'a [u8])> = None;
        for _ in 0..keys {
            let start = rd.rest;
            let text = match rd.peek() {
                Some(Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32) => Some(
                    rd.str("an extra key")
                        .map_err(|e| format!("extra_keys[{block}]: {}", e.problem))?,
                ),
                _ => {
                    rd.value()
                        .map_err(|e| format!("extra_keys[{block}]: {}", e.problem))?;
                    None
                }
            };
            let bytes = &start[..start.len() - rd.rest.len()];
            match text {
                Some(text) if Some(text) == lora_name => {}
                Some(text) if block == 0 && starts_sequence => {
                    if let Some((_, earlier)) = salt.replace((text, bytes)) {
                        mix(earlier);
                    }
                }
                _ => mix(bytes),
            }
        }
        out.salt = out.salt.or(salt.map(|(text, _)| text));
        if let Some(hash) = other {
            out.blocks.push((block as u32, hash));
        }
    }
    Ok(out)
}

fn describe(marker: Marker) -> &'static str {
    match marker {
        Marker::Null => "nil",
        Marker::True | Marker::False => "a boolean",
        Marker::FixPos(_)
        | Marker::FixNeg(_)
        | Marker::U8
        | Marker::U16
        | Marker::U32
        | Marker::U64
        | Marker::I8
        | Marker::I16
        | Marker::I32
        | Marker::I64 => "an integer",
        Marker::F32 | Marker::F64 => "a float",
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => "a string",
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => "a byte string",
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => "an array",
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => "a map",
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => "an extension value",
        Marker::Reserved => "a reserved byte (0xc1)",
    }
}
