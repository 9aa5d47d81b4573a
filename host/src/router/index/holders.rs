//! The workers holding one block: a set of worker slots as 64-slot bitmap words, with
//! one engine hash per holder.
//!
//! Bitmaps make the prefix walk cheap where it is expensive with holder lists: the
//! workers still matching after block `d` are the AND of the sets so far, one word per
//! 64 workers, so a block that 64 workers hold costs one AND instead of 64 checks. Only
//! words with a bit set are kept, so a block held by a few workers of a large fleet
//! costs a word or two, not a fleet-sized bitmap.
//!
//! A worker is in a block's set at most once, however many engine hashes it stored the
//! same tokens under (salts, adapters, a misbehaving engine): the copies are tracked per
//! worker (see `WorkerBlocks` in the parent module), and the set keeps one of them as the
//! name a `kv.fetch` uses. So the walk's work is bounded by workers, never by copies.

use smallvec::SmallVec;

/// Dense worker number: bit `slot % 64` of word `slot / 64`.
pub type Slot = u32;

/// 64 slots of a holder set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word {
    /// `slot / 64` of the slots this word covers.
    pub index: u32,
    pub bits: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Holders {
    /// Non-zero words, ascending by `index`.
    words: SmallVec<[Word; 1]>,
    /// One engine hash per set bit, in slot order.
    engines: SmallVec<[u64; 1]>,
}

impl Holders {
    pub fn words(&self) -> &[Word] {
        &self.words
    }

    /// One engine hash per holder, in slot order.
    pub fn engines(&self) -> &[u64] {
        &self.engines
    }

    pub fn len(&self) -> usize {
        self.engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    /// Position of `slot`'s engine hash, and whether it is present (else where it would go).
    fn rank(&self, slot: Slot) -> (usize, bool, Result<usize, usize>) {
        let index = slot / 64;
        let bit = 1u64 << (slot % 64);
        let mut rank = 0;
        for (at, word) in self.words.iter().enumerate() {
            if word.index == index {
                rank += (word.bits & (bit - 1)).count_ones() as usize;
                return (rank, word.bits & bit != 0, Ok(at));
            }
            if word.index > index {
                return (rank, false, Err(at));
            }
            rank += word.bits.count_ones() as usize;
        }
        (rank, false, Err(self.words.len()))
    }

    /// The engine hash `slot` holds this block under, if it holds it.
    pub fn engine_of(&self, slot: Slot) -> Option<u64> {
        match self.rank(slot) {
            (rank, true, _) => Some(self.engines[rank]),
            _ => None,
        }
    }

    pub fn contains(&self, slot: Slot) -> bool {
        self.rank(slot).1
    }

    /// Adds `slot` under `engine`; returns false (and changes nothing) if it is present.
    pub fn insert(&mut self, slot: Slot, engine: u64) -> bool {
        let bit = 1u64 << (slot % 64);
        match self.rank(slot) {
            (_, true, _) => false,
            (rank, false, Ok(at)) => {
                self.words[at].bits |= bit;
                self.engines.insert(rank, engine);
                true
            }
            (rank, false, Err(at)) => {
                self.words.insert(
                    at,
                    Word {
                        index: slot / 64,
                        bits: bit,
                    },
                );
                self.engines.insert(rank, engine);
                true
            }
        }
    }

    /// Renames `slot`'s copy (its named copy was removed, another remains).
    pub fn set_engine(&mut self, slot: Slot, engine: u64) {
        if let (rank, true, _) = self.rank(slot) {
            self.engines[rank] = engine;
        }
    }

    /// Removes `slot`; returns whether it was present.
    pub fn remove(&mut self, slot: Slot) -> bool {
        let bit = 1u64 << (slot % 64);
        match self.rank(slot) {
            (rank, true, Ok(at)) => {
                self.words[at].bits &= !bit;
                if self.words[at].bits == 0 {
                    self.words.remove(at);
                }
                self.engines.remove(rank);
                true
            }
            _ => false,
        }
    }

    /// Every (slot, engine hash), in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Slot, u64)> + '_ {
        self.words
            .iter()
            .flat_map(|w| Bits(w.bits).map(move |b| w.index * 64 + b))
            .zip(self.engines.iter().copied())
    }
}

/// The set bits of a word, lowest first.
pub struct Bits(pub u64);

impl Iterator for Bits {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_and_rank_across_words() {
        let mut h = Holders::default();
        for (slot, engine) in [(70, 7), (3, 3), (200, 20), (64, 6), (5, 5)] {
            assert!(h.insert(slot, engine));
        }
        assert!(!h.insert(3, 99), "a slot is held once");
        assert_eq!(
            h.iter().collect::<Vec<_>>(),
            vec![(3, 3), (5, 5), (64, 6), (70, 7), (200, 20)]
        );
        assert_eq!(h.words().len(), 3);
        assert_eq!(h.engine_of(70), Some(7));
        assert_eq!(h.engine_of(71), None);
        h.set_engine(64, 60);
        assert!(h.remove(200));
        assert!(!h.remove(200));
        assert_eq!(h.words().len(), 2, "an empty word is dropped");
        assert!(h.remove(3) && h.remove(5));
        assert_eq!(h.iter().collect::<Vec<_>>(), vec![(64, 60), (70, 7)]);
        assert!(h.remove(64) && h.remove(70));
        assert!(h.is_empty() && h.words().is_empty());
    }
}
