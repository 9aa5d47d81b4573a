//! The router's block hashes: one chained xxh3 per full block of a prompt.
//!
//! A request is matched before any engine has seen it, so the router names blocks by a
//! hash of their content and everything before them, computed the same way for a prompt
//! ([`block_hashes`]) and for the blocks a `stored` event reports: an xxh3 of each block's
//! tokens, chained by a cheap mix with the hash before it.

use super::events::HashedBlock;
use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Seed of every router block hash. Fixed so that hashes agree across router restarts
/// and between the router and any tool that recomputes them.
pub const HASH_SEED: u64 = 1337;

/// Mixes a parent's sequence hash with a block's content hash (a folded 64×64→128-bit
/// multiply, wyhash's `mum`, with its constants).
#[inline]
fn chain(parent: u64, content: u64) -> u64 {
    let product =
        u128::from(parent ^ 0xa076_1d64_78bd_642f) * u128::from(content ^ 0xe703_7ed1_a0b4_28db);
    (product as u64) ^ ((product >> 64) as u64)
}

/// A block's content hash: `xxh3_64_with_seed(its token ids as little-endian u32 bytes,
/// 1337)`.
#[inline]
pub fn content_hash(tokens: &[u32]) -> u64 {
    // The hash is defined over little-endian bytes; on a little-endian machine those are
    // the tokens' own bytes, so no copy is made.
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), HASH_SEED)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, HASH_SEED)
    }
}

/// The router's chained block hashes of a prompt: one per FULL block of `block_size`
/// tokens (a trailing partial block gets none, because no engine caches a partial block
/// under a name another request could match).
///
/// Block 0's hash is its [`content_hash`]; block `i > 0`'s is `chain(block i-1's hash,
/// block i's content hash)`, where `chain(p, c)` = the 128-bit product `(p ^
/// 0xa0761d6478bd642f) × (c ^ 0xe7037ed1a0b428db)` with its halves XORed. So a block's
/// hash covers everything before it, yet the expensive part — hashing each block's
/// tokens — is independent per block and the processor overlaps it; only the cheap mix
/// is serial. (Seeding each block's xxh3 with its parent's hash made every block wait
/// for the one before: a third slower than Dynamo's unchained hashes.)
/// Clears `out` and fills it. A `block_size` of 0 yields no hashes.
pub fn block_hashes(token_ids: &[u32], block_size: usize, out: &mut Vec<u64>) {
    seeded_block_hashes(token_ids, block_size, None, out);
}

/// [`block_hashes`] of a prompt whose identity (LoRA adapter, cache salt) is `seed`
/// ([`identity_seed`]): block 0's hash is `chain(seed, content)` instead of its bare
/// content hash, so every block differs from the same tokens under another identity.
pub fn seeded_block_hashes(
    token_ids: &[u32],
    block_size: usize,
    seed: Option<u64>,
    out: &mut Vec<u64>,
) {
    out.clear();
    if block_size == 0 {
        return;
    }
    // One pass: the processor hashes the next blocks' tokens while the mix of this one
    // (a multiply's latency) completes, so the chain adds next to nothing.
    let mut blocks = token_ids.chunks_exact(block_size);
    let Some(first) = blocks.next() else {
        return;
    };
    let mut parent = chained(seed, content_hash(first));
    out.push(parent);
    for block in blocks {
        parent = chain(parent, content_hash(block));
        out.push(parent);
    }
}

#[inline]
fn chained(parent: Option<u64>, content: u64) -> u64 {
    match parent {
        None => content,
        Some(parent) => chain(parent, content),
    }
}

/// The sequence hash of a block of `tokens` following `parent` (`None` for block 0).
#[inline]
pub fn chained_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    chained(parent, content_hash(tokens))
}

/// [`chained_hash`] of a block whose engine hash also covers inputs other than its
/// tokens (a multimodal item, prompt embeddings), hashed to `extra`: the block then
/// matches no prompt of tokens alone, as it matches none in the engine.
#[inline]
pub fn chained_hash_with_extra(parent: Option<u64>, tokens: &[u32], extra: u64) -> u64 {
    chained(parent, block_content(tokens, Some(extra)))
}

/// What a block contributes to its sequence hash, before the chain: its
/// [`content_hash`], or, for a block whose engine hash also covers other inputs
/// hashed to `extra`, `chain(content_hash, extra ^ 0x6d6d6b6579730001)`. An engine
/// subscription computes it where it decodes the event ([`super::KvEvent::Hashed`]),
/// and [`chained_content`] finishes the sequence hash on the ingestion thread, to the
/// same value [`chained_hash`] / [`chained_hash_with_extra`] give.
#[inline]
pub fn block_content(tokens: &[u32], extra: Option<u64>) -> u64 {
    match extra {
        None => content_hash(tokens),
        Some(extra) => chain(content_hash(tokens), extra ^ EXTRA_TAG),
    }
}

/// The [`HashedBlock`]s of a stored event's blocks, given as (engine hash, token ids),
/// with `extra_keys` as (block index, hash of the block's other inputs), ascending by
/// index: what an engine subscription hands the index ([`super::KvEvent::Hashed`]).
pub fn hashed_blocks<'t>(
    blocks: impl Iterator<Item = (u64, &'t [u32])>,
    extra_keys: &[(u32, u64)],
) -> Vec<HashedBlock> {
    let mut extras = extra_keys.iter().peekable();
    blocks
        .enumerate()
        .map(|(index, (block_hash, tokens))| {
            let extra = extras
                .next_if(|(at, _)| *at as usize == index)
                .map(|&(_, extra)| extra);
            HashedBlock {
                block_hash,
                content: block_content(tokens, extra),
            }
        })
        .collect()
}

/// The sequence hash of a block whose [`block_content`] is `content`, following
/// `parent` (`None` for block 0; the request identity seed there, if any).
#[inline]
pub fn chained_content(parent: Option<u64>, content: u64) -> u64 {
    chained(parent, content)
}

const EXTRA_TAG: u64 = 0x6d6d_6b65_7973_0001;

/// The seed of a request's block hashes from its identity: `None` for a request
/// with neither a LoRA adapter nor a cache salt (so plain prompts hash as they always
/// did); otherwise an xxh3 (seed 1337) of the tag `kvhint-identity-v1` followed by,
/// for the LoRA name and then the salt, a byte 0 (absent) or 1 and its UTF-8 length
/// (u64 little-endian) and bytes. Length prefixes keep `("a", "bc")` and `("ab",
/// "c")` apart. An empty name or salt counts as absent, as the engines treat it.
pub fn identity_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> Option<u64> {
    let lora_name = lora_name.filter(|s| !s.is_empty());
    let cache_salt = cache_salt.filter(|s| !s.is_empty());
    if lora_name.is_none() && cache_salt.is_none() {
        return None;
    }
    // Streamed, so a booking with an identity allocates nothing for it.
    let mut hasher = Xxh3::with_seed(HASH_SEED);
    hasher.update(b"kvhint-identity-v1");
    for part in [lora_name, cache_salt] {
        match part {
            None => hasher.update(&[0]),
            Some(text) => {
                hasher.update(&[1]);
                hasher.update(&(text.len() as u64).to_le_bytes());
                hasher.update(text.as_bytes());
            }
        }
    }
    Some(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition in the doc comment, spelled out with explicit byte order, so a
    /// change that alters the hashes (and breaks agreement with stored indexes and
    /// tools) fails here.
    #[test]
    fn hashes_follow_the_documented_definition() {
        let tokens: Vec<u32> = (0..40u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let mut out = Vec::new();
        block_hashes(&tokens, 16, &mut out);
        assert_eq!(out.len(), 2, "the trailing partial block gets no hash");
        let bytes = |block: &[u32]| {
            block
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>()
        };
        let first = xxh3_64_with_seed(&bytes(&tokens[..16]), HASH_SEED);
        let content = xxh3_64_with_seed(&bytes(&tokens[16..32]), HASH_SEED);
        let product =
            u128::from(first ^ 0xa076_1d64_78bd_642f) * u128::from(content ^ 0xe703_7ed1_a0b4_28db);
        let second = (product as u64) ^ ((product >> 64) as u64);
        assert_eq!(out, vec![first, second]);
        assert_eq!(chained_hash(Some(first), &tokens[16..32]), second);
        block_hashes(&tokens, 0, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn an_identity_seeds_every_block_and_none_changes_nothing() {
        let tokens: Vec<u32> = (0..32).collect();
        let (mut plain, mut none, mut lora, mut salt, mut both) =
            (vec![], vec![], vec![], vec![], vec![]);
        block_hashes(&tokens, 16, &mut plain);
        seeded_block_hashes(&tokens, 16, identity_seed(None, Some("")), &mut none);
        seeded_block_hashes(&tokens, 16, identity_seed(Some("a"), None), &mut lora);
        seeded_block_hashes(&tokens, 16, identity_seed(None, Some("a")), &mut salt);
        seeded_block_hashes(&tokens, 16, identity_seed(Some("a"), Some("a")), &mut both);
        assert_eq!(plain, none, "an empty salt is no salt");
        for (i, other) in [&lora, &salt, &both].into_iter().enumerate() {
            for block in 0..2 {
                assert_ne!(plain[block], other[block], "identity {i}, block {block}");
            }
        }
        assert_ne!(lora, salt, "a LoRA name and a salt of the same text differ");
        assert_ne!(
            identity_seed(Some("a"), Some("bc")),
            identity_seed(Some("ab"), Some("c"))
        );
        let seed = identity_seed(Some("a"), None);
        assert_eq!(lora[0], chained_hash(seed, &tokens[..16]));
        // The documented definition, spelled out in one buffer.
        let mut bytes = b"kvhint-identity-v1".to_vec();
        bytes.extend_from_slice(&[1, 1, 0, 0, 0, 0, 0, 0, 0, b'a', 0]);
        assert_eq!(seed, Some(xxh3_64_with_seed(&bytes, HASH_SEED)));
        assert_ne!(
            chained_hash_with_extra(None, &tokens[..16], 5),
            chained_hash(None, &tokens[..16])
        );
    }
}
