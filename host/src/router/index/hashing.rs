//! The router's block hashes: one chained xxh3 per full block of a prompt.
//!
//! A request is matched before any engine has seen it, so the router names blocks by a
//! hash of their content and everything before them, computed the same way for a prompt
//! ([`block_hashes`]) and for the blocks a `stored` event reports. One xxh3 call per
//! block: seeding it with the parent's hash chains the whole prefix in at no extra cost.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every router block hash. Fixed so that hashes agree across router restarts
/// and between the router and any tool that recomputes them.
pub const HASH_SEED: u64 = 1337;

/// The router's chained block hashes of a prompt: one per FULL block of `block_size`
/// tokens (a trailing partial block gets none, because no engine caches a partial block
/// under a name another request could match).
///
/// Block 0's hash = `xxh3_64_with_seed(its token ids as little-endian u32 bytes, 1337)`;
/// block `i > 0`'s = `xxh3_64_with_seed(its token ids, seed = block i-1's hash)`.
/// Clears `out` and fills it. A `block_size` of 0 yields no hashes.
pub fn block_hashes(token_ids: &[u32], block_size: usize, out: &mut Vec<u64>) {
    out.clear();
    if block_size == 0 {
        return;
    }
    out.reserve(token_ids.len() / block_size);
    let mut parent = None;
    for block in token_ids.chunks_exact(block_size) {
        let hash = chained_hash(parent, block);
        out.push(hash);
        parent = Some(hash);
    }
}

/// The sequence hash of a block of `tokens` following `parent` (`None` for block 0).
#[inline]
pub fn chained_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let seed = parent.unwrap_or(HASH_SEED);
    // The hash is defined over little-endian bytes; on a little-endian machine those are
    // the tokens' own bytes, so no copy is made (the copy was a third of the cost).
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for t in tokens {
            hasher.update(&t.to_le_bytes());
        }
        hasher.digest()
    }
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
        let second = xxh3_64_with_seed(&bytes(&tokens[16..32]), first);
        assert_eq!(out, vec![first, second]);
        block_hashes(&tokens, 0, &mut out);
        assert!(out.is_empty());
    }
}
