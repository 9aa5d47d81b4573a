//! A set of worker slots as 64-slot bitmap words.
//!
//! Bitmaps make the prefix walk cheap where holder lists are expensive: the workers
//! still matching are the AND of the sets met so far, one word per 64 workers, so a
//! node that 64 workers hold costs one AND instead of 64 checks. Only words with a bit
//! set are kept, so a node held by a few workers of a large fleet costs a word or two,
//! not a fleet-sized bitmap. The set is small (40 bytes, one word inline) because
//! every node of the tree carries one and a walk reads one per node.

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
    /// Members, so that sets of different sizes are told apart without their words.
    len: u32,
}

// Every node carries one (see the module documentation).
const _: () = assert!(std::mem::size_of::<Holders>() <= 40);

impl Holders {
    pub fn words(&self) -> &[Word] {
        &self.words
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The word `slot` is in (`Ok`), or where that word would go (`Err`), in `words`
    /// (the set's words as one slice: each access to a `SmallVec` first checks where
    /// its items are, and a store that joins a chain of nodes asks each node twice).
    #[inline(always)]
    fn find(words: &[Word], slot: Slot) -> Result<usize, usize> {
        let index = slot / 64;
        // Past the last word (a worker registered after the others): no search.
        match words.last() {
            None => Err(0),
            Some(last) if last.index < index => Err(words.len()),
            Some(last) if last.index == index => Ok(words.len() - 1),
            Some(_) => words.binary_search_by_key(&index, |w| w.index),
        }
    }

    #[inline(always)]
    pub fn contains(&self, slot: Slot) -> bool {
        let bit = 1u64 << (slot % 64);
        let words = self.words.as_slice();
        Self::find(words, slot).is_ok_and(|at| words[at].bits & bit != 0)
    }

    /// How many members come before `slot` (its position, if it is one or joins).
    #[inline]
    pub fn position(&self, slot: Slot) -> usize {
        let index = slot / 64;
        let below = (1u64 << (slot % 64)) - 1;
        // In or past the last word (a worker registered after the others, as most
        // joiners of a node are): counted back from the end, one word read. Counted
        // up from the first, a join of a node a thousand workers hold read sixteen
        // words, on cache lines nothing else of the join touches.
        match self.words.last() {
            None => return 0,
            Some(last) if last.index < index => return self.len as usize,
            Some(last) if last.index == index => {
                return self.len as usize - (last.bits & !below).count_ones() as usize;
            }
            Some(_) => {}
        }
        let mut rank = 0;
        for word in &self.words {
            if word.index >= index {
                if word.index == index {
                    rank += (word.bits & below).count_ones() as usize;
                }
                break;
            }
            rank += word.bits.count_ones() as usize;
        }
        rank
    }

    /// `slot`'s position among the members, if it is one.
    pub fn rank_of(&self, slot: Slot) -> Option<usize> {
        self.contains(slot).then(|| self.position(slot))
    }

    /// Adds `slot`; returns false (and changes nothing) if it is a member.
    #[inline(always)]
    pub fn insert(&mut self, slot: Slot) -> bool {
        let bit = 1u64 << (slot % 64);
        let words = self.words.as_mut_slice();
        match Self::find(words, slot) {
            Ok(at) if words[at].bits & bit != 0 => return false,
            Ok(at) => words[at].bits |= bit,
            Err(at) => self.words.insert(
                at,
                Word {
                    index: slot / 64,
                    bits: bit,
                },
            ),
        }
        self.len += 1;
        true
    }

    /// Removes `slot`; returns whether it was a member.
    pub fn remove(&mut self, slot: Slot) -> bool {
        let bit = 1u64 << (slot % 64);
        match Self::find(&self.words, slot) {
            Ok(at) if self.words[at].bits & bit != 0 => {
                self.words[at].bits &= !bit;
                if self.words[at].bits == 0 {
                    self.words.remove(at);
                }
                self.len -= 1;
                true
            }
            _ => false,
        }
    }

    /// The members not in `other`: one pass over both sets' words.
    pub fn without(&self, other: &Holders) -> Holders {
        let mut out = Holders::default();
        let mut j = 0;
        for word in &self.words {
            while j < other.words.len() && other.words[j].index < word.index {
                j += 1;
            }
            let bits = match other.words.get(j) {
                Some(o) if o.index == word.index => word.bits & !o.bits,
                _ => word.bits,
            };
            if bits != 0 {
                out.words.push(Word {
                    index: word.index,
                    bits,
                });
                out.len += bits.count_ones();
            }
        }
        out
    }

    /// Whether both sets have the same members.
    #[inline]
    pub fn same_members(&self, other: &Holders) -> bool {
        // The member counts first: sets that differ usually differ in size, and the
        // count is known without touching the words.
        self.len == other.len && self.words == other.words
    }

    pub fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        self.words
            .iter()
            .flat_map(|w| Bits(w.bits).map(move |b| w.index * 64 + b))
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
    fn insert_and_remove_across_words() {
        let mut h = Holders::default();
        for slot in [70, 3, 200, 64, 5] {
            assert!(h.insert(slot));
        }
        assert!(!h.insert(3), "a slot is held once");
        assert_eq!(h.slots().collect::<Vec<_>>(), vec![3, 5, 64, 70, 200]);
        assert_eq!((h.len(), h.words().len()), (5, 3));
        assert!(h.contains(70) && !h.contains(71) && !h.contains(1000));
        assert_eq!(
            (h.rank_of(3), h.rank_of(70), h.rank_of(200)),
            (Some(0), Some(3), Some(4))
        );
        assert_eq!(
            (h.rank_of(71), h.position(71), h.position(1000)),
            (None, 4, 5)
        );
        assert!(h.remove(200));
        assert!(!h.remove(200));
        assert_eq!(h.words().len(), 2, "an empty word is dropped");
        assert!(h.remove(3) && h.remove(5));
        assert_eq!(h.slots().collect::<Vec<_>>(), vec![64, 70]);
        let mut other = Holders::default();
        other.insert(70);
        assert!(!h.same_members(&other));
        other.insert(64);
        assert!(h.same_members(&other));
        let mut minus = Holders::default();
        for slot in [70, 1000] {
            minus.insert(slot);
        }
        assert_eq!(h.without(&minus).slots().collect::<Vec<_>>(), vec![64]);
        assert_eq!(h.without(&minus).len(), 1);
        assert_eq!(
            h.without(&Holders::default()).slots().collect::<Vec<_>>(),
            vec![64, 70]
        );
        assert!(h.remove(64) && h.remove(70));
        assert!(h.is_empty() && h.words().is_empty());
    }
}
