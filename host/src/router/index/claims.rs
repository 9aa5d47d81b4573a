//! A worker's claims: engine hash → the copy of a block it names, 12 bytes to a
//! bucket.
//!
//! Every block a worker stores under a name of its own writes one entry here (a
//! removal or a later event's parent arrives as that name), so at 1,024 workers that
//! each name a shared prompt by their own hashes (issue 29) these inserts were the
//! largest part of the ingest: ~8 ns of ~20 a block, nearly all of it the entry's cache
//! line coming from memory (the same inserts into one table that stays in the cache
//! cost under 3 ns). What an insert costs is the bytes the table spreads over, so an
//! entry is the engine hash as two `u32` words (4-byte alignment) and one `u32`: the
//! block of a named copy, or for an extra copy (a block stored again under another
//! name, as cache salts do) its place in a slab of (block, entry in the worker's
//! [`Extras`]), which grows at its end. 12 bytes a bucket instead of the 16 of
//! `(u64, Copy)`, and still one probe a name, whatever its kind.
//!
//! [`Extras`]: super::names::Extras

use super::names::{Copy, NAMED};
use super::BlockId;
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;
use std::hash::{Hash, Hasher};

/// The top bit of an entry: the rest is a place in the slab of extra copies, not a
/// block id. (Block ids index the tree's array of blocks, which memory bounds far
/// below 2³¹ entries; so does the slab.)
const EXTRA: u32 = 1 << 31;

/// Places an emptied slab keeps (of 8 bytes) for the next extra copies.
const SLAB_KEEP: usize = 1 << 12;

/// An engine hash as two `u32` words, so that a bucket is 4-byte aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key([u32; 2]);

impl Key {
    #[inline(always)]
    fn of(engine: u64) -> Self {
        Key([engine as u32, (engine >> 32) as u32])
    }

    #[cfg(test)]
    fn engine(self) -> u64 {
        u64::from(self.0[0]) | u64::from(self.0[1]) << 32
    }
}

impl Hash for Key {
    /// Hashed as the one `u64` it is (one step of the hasher, not two).
    #[inline(always)]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(u64::from(self.0[0]) | u64::from(self.0[1]) << 32);
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct Claims {
    /// Engine hash → a named copy's block, or [`EXTRA`] and an extra copy's place
    /// in `extra_copies`.
    by_engine: FxHashMap<Key, u32>,
    /// The extra copies (block and extras entry); free places are reused.
    extra_copies: Vec<Copy>,
    free: Vec<u32>,
}

impl Claims {
    /// The copy an entry stands for.
    #[inline(always)]
    fn copy(&self, stored: u32) -> Copy {
        if stored & EXTRA == 0 {
            return Copy {
                block: stored,
                extra: NAMED,
            };
        }
        let copy = self.extra_copies.get((stored & !EXTRA) as usize).copied();
        // Every extra entry has its place; a miss would only ever follow a bug.
        debug_assert!(copy.is_some(), "an extra entry without its place");
        copy.unwrap_or(Copy {
            block: stored & !EXTRA,
            extra: NAMED,
        })
    }

    /// Frees the slab place of an extra entry; once every place is free, the slab
    /// starts again from empty (as the worker's extras do).
    fn release(&mut self, stored: u32) {
        if stored & EXTRA == 0 {
            return;
        }
        self.free.push(stored & !EXTRA);
        if self.free.len() == self.extra_copies.len() {
            self.free.clear();
            self.extra_copies.clear();
            if self.extra_copies.capacity() > SLAB_KEEP {
                self.extra_copies.shrink_to(SLAB_KEEP);
                self.free.shrink_to(SLAB_KEEP);
            }
        }
    }

    /// Checks the slab's bookkeeping: every place is an extra entry's or free, once.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let mut owner = vec![0u32; self.extra_copies.len()];
        let extra = self.by_engine.values().filter(|&&v| v & EXTRA != 0);
        for at in extra.map(|v| v & !EXTRA).chain(self.free.iter().copied()) {
            owner[at as usize] += 1;
        }
        assert!(
            owner.iter().all(|&n| n == 1),
            "each slab place used once: {owner:?}"
        );
    }

    pub(super) fn len(&self) -> usize {
        self.by_engine.len()
    }

    pub(super) fn reserve(&mut self, additional: usize) {
        self.by_engine.reserve(additional);
    }

    #[inline]
    pub(super) fn get(&self, engine: u64) -> Option<Copy> {
        let stored = *self.by_engine.get(&Key::of(engine))?;
        Some(self.copy(stored))
    }

    /// Names `block` `engine` unless the worker holds a copy under that hash already:
    /// then changes nothing and returns that copy. One probe either way.
    #[inline(always)]
    pub(super) fn claim(&mut self, engine: u64, block: BlockId) -> Option<Copy> {
        debug_assert_eq!(block & EXTRA, 0, "block ids stay below 2^31");
        match self.by_engine.entry(Key::of(engine)) {
            Entry::Vacant(v) => {
                v.insert(block);
                None
            }
            Entry::Occupied(o) => {
                let stored = *o.get();
                Some(self.copy(stored))
            }
        }
    }

    /// An extra copy of `block` under `engine`, its extras entry made by `entry`,
    /// unless the worker holds a copy under that hash already (returned, nothing
    /// changed). One probe either way.
    #[inline]
    pub(super) fn add_extra(
        &mut self,
        engine: u64,
        block: BlockId,
        entry: impl FnOnce() -> u32,
    ) -> Option<Copy> {
        match self.by_engine.entry(Key::of(engine)) {
            Entry::Vacant(v) => {
                let copy = Copy {
                    block,
                    extra: entry(),
                };
                let at = match self.free.pop() {
                    Some(at) => {
                        self.extra_copies[at as usize] = copy;
                        at
                    }
                    None => {
                        self.extra_copies.push(copy);
                        (self.extra_copies.len() - 1) as u32
                    }
                };
                v.insert(EXTRA | at);
                None
            }
            Entry::Occupied(o) => {
                let stored = *o.get();
                Some(self.copy(stored))
            }
        }
    }

    pub(super) fn remove(&mut self, engine: u64) -> Option<Copy> {
        let stored = self.by_engine.remove(&Key::of(engine))?;
        let copy = self.copy(stored);
        self.release(stored);
        Some(copy)
    }

    /// The extra copy under `engine` becomes its block's named one.
    pub(super) fn make_named(&mut self, engine: u64) {
        let Some(&stored) = self.by_engine.get(&Key::of(engine)) else {
            return;
        };
        let block = self.copy(stored).block;
        self.release(stored);
        self.by_engine.insert(Key::of(engine), block);
    }

    /// Forgets every copy; appends the block of each named one to `blocks`.
    pub(super) fn drain_named(&mut self, blocks: &mut Vec<BlockId>) {
        self.extra_copies.clear();
        self.free.clear();
        blocks.extend(
            self.by_engine
                .drain()
                .filter(|&(_, stored)| stored & EXTRA == 0)
                .map(|(_, stored)| stored),
        );
    }

    /// Every (engine hash, copy) (for invariant checks).
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, Copy)> + '_ {
        self.by_engine
            .iter()
            .map(|(&key, &stored)| (key.engine(), self.copy(stored)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The packing this module is for.
    const _: () = assert!(std::mem::size_of::<(Key, BlockId)>() == 12);

    /// Named and extra copies against a `HashMap` of `Copy`s: claims, extras, renames
    /// (an extra made the named copy), removals and drains, engine hashes whose halves
    /// repeat.
    #[test]
    fn claims_answer_like_a_map_of_copies() {
        let mut claims = Claims::default();
        let mut model: std::collections::HashMap<u64, Copy> = Default::default();
        let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
        for step in 0..20_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let engine = (rng % 61) | (rng >> 58) << 32;
            let block = step % 1000;
            if step % 4_000 == 3_999 {
                let mut blocks = Vec::new();
                claims.drain_named(&mut blocks);
                let mut want: Vec<BlockId> = model
                    .drain()
                    .filter(|(_, c)| c.extra == NAMED)
                    .map(|(_, c)| c.block)
                    .collect();
                blocks.sort_unstable();
                want.sort_unstable();
                assert_eq!(blocks, want, "step {step}");
            }
            match rng >> 61 {
                0 | 1 => {
                    let want = model.get(&engine).copied();
                    assert_eq!(claims.claim(engine, block), want, "step {step}");
                    model.entry(engine).or_insert(Copy {
                        block,
                        extra: NAMED,
                    });
                }
                2 | 3 => {
                    let want = model.get(&engine).copied();
                    assert_eq!(claims.add_extra(engine, block, || step), want);
                    model.entry(engine).or_insert(Copy { block, extra: step });
                }
                4 => {
                    claims.make_named(engine);
                    if let Some(c) = model.get_mut(&engine) {
                        c.extra = NAMED;
                    }
                }
                5 | 6 => assert_eq!(claims.remove(engine), model.remove(&engine)),
                _ => {}
            }
            claims.check();
            assert_eq!(claims.len(), model.len(), "step {step}");
            assert_eq!(claims.get(engine), model.get(&engine).copied());
        }
        let mut all: Vec<(u64, Copy)> = claims.iter().collect();
        let mut want: Vec<(u64, Copy)> = model.into_iter().collect();
        all.sort_by_key(|&(e, _)| e);
        want.sort_by_key(|&(e, _)| e);
        assert_eq!(all, want);
    }
}
