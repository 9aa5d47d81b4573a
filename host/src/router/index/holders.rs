//! A set of worker slots as 64-slot bitmap words, with one value per member.
//!
//! Bitmaps make the prefix walk cheap where holder lists are expensive: the workers
//! still matching are the AND of the sets met so far, one word per 64 workers, so a
//! node that 64 workers hold costs one AND instead of 64 checks. Only words with a bit
//! set are kept, so a node held by a few workers of a large fleet costs a word or two,
//! not a fleet-sized bitmap. Each member's value (in the tree: its engine hashes of the
//! node's blocks) is kept in slot order, found by rank.

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

#[derive(Debug, Clone)]
pub struct Holders<T> {
    /// Non-zero words, ascending by `index`.
    words: SmallVec<[Word; 1]>,
    /// One value per set bit, in slot order.
    values: SmallVec<[T; 1]>,
}

impl<T> Default for Holders<T> {
    fn default() -> Self {
        Self {
            words: SmallVec::new(),
            values: SmallVec::new(),
        }
    }
}

impl<T> Holders<T> {
    pub fn words(&self) -> &[Word] {
        &self.words
    }

    /// The members' values, in slot order.
    pub fn values(&self) -> &[T] {
        &self.values
    }

    pub fn values_mut(&mut self) -> &mut [T] {
        &mut self.values
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Position of `slot`'s value, whether it is a member, and the word it is in
    /// (or where that word would go).
    fn rank(&self, slot: Slot) -> (usize, bool, Result<usize, usize>) {
        let index = slot / 64;
        let bit = 1u64 << (slot % 64);
        // Past the last word (a worker registered after the others): no counting.
        match self.words.last() {
            None => return (0, false, Err(0)),
            Some(last) if last.index < index => {
                return (self.values.len(), false, Err(self.words.len()))
            }
            Some(last) if last.index == index => {
                let above = (last.bits & !(bit | (bit - 1))).count_ones() as usize;
                let rank = self.values.len() - above - usize::from(last.bits & bit != 0);
                return (rank, last.bits & bit != 0, Ok(self.words.len() - 1));
            }
            Some(_) => {}
        }
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

    pub fn get(&self, slot: Slot) -> Option<&T> {
        match self.rank(slot) {
            (rank, true, _) => Some(&self.values[rank]),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, slot: Slot) -> Option<&mut T> {
        match self.rank(slot) {
            (rank, true, _) => Some(&mut self.values[rank]),
            _ => None,
        }
    }

    pub fn contains(&self, slot: Slot) -> bool {
        self.rank(slot).1
    }

    /// Position of `slot` among the members (slot order), if it is one.
    pub fn rank_of(&self, slot: Slot) -> Option<usize> {
        match self.rank(slot) {
            (rank, true, _) => Some(rank),
            _ => None,
        }
    }

    /// Position `slot` has or would have among the members.
    pub fn position(&self, slot: Slot) -> usize {
        self.rank(slot).0
    }

    /// Adds `slot` with `value`; returns false (and changes nothing) if it is a member.
    pub fn insert(&mut self, slot: Slot, value: T) -> bool {
        let bit = 1u64 << (slot % 64);
        match self.rank(slot) {
            (_, true, _) => false,
            (rank, false, Ok(at)) => {
                self.words[at].bits |= bit;
                self.values.insert(rank, value);
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
                self.values.insert(rank, value);
                true
            }
        }
    }

    /// Removes `slot`, returning its value.
    pub fn remove(&mut self, slot: Slot) -> Option<T> {
        let bit = 1u64 << (slot % 64);
        match self.rank(slot) {
            (rank, true, Ok(at)) => {
                self.words[at].bits &= !bit;
                if self.words[at].bits == 0 {
                    self.words.remove(at);
                }
                Some(self.values.remove(rank))
            }
            _ => None,
        }
    }

    /// Whether both sets have the same members (values aside).
    pub fn same_members<U>(&self, other: &Holders<U>) -> bool {
        // The member counts first: sets that differ usually differ in size, and the
        // count is known without touching the words.
        self.values.len() == other.values.len() && self.words == other.words
    }

    /// The same members with values made by `f`.
    pub fn map<U>(&self, f: impl FnMut(&T) -> U) -> Holders<U> {
        Holders {
            words: self.words.clone(),
            values: self.values.iter().map(f).collect(),
        }
    }

    /// Every (slot, value), in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Slot, &T)> + '_ {
        self.slots().zip(self.values.iter())
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = (Slot, &mut T)> + '_ {
        let words = &self.words;
        words
            .iter()
            .flat_map(|w| Bits(w.bits).map(move |b| w.index * 64 + b))
            .zip(self.values.iter_mut())
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
    fn insert_remove_and_rank_across_words() {
        let mut h = Holders::default();
        for (slot, value) in [(70, 7), (3, 3), (200, 20), (64, 6), (5, 5)] {
            assert!(h.insert(slot, value));
        }
        assert!(!h.insert(3, 99), "a slot is held once");
        assert_eq!(
            h.iter().map(|(s, v)| (s, *v)).collect::<Vec<_>>(),
            vec![(3, 3), (5, 5), (64, 6), (70, 7), (200, 20)]
        );
        assert_eq!(h.words().len(), 3);
        assert_eq!(h.get(70), Some(&7));
        assert_eq!(h.get(71), None);
        *h.get_mut(64).unwrap() = 60;
        assert_eq!(h.remove(200), Some(20));
        assert_eq!(h.remove(200), None);
        assert_eq!(h.words().len(), 2, "an empty word is dropped");
        assert!(h.remove(3).is_some() && h.remove(5).is_some());
        assert_eq!(
            h.iter().map(|(s, v)| (s, *v)).collect::<Vec<_>>(),
            vec![(64, 60), (70, 7)]
        );
        let other = h.map(|v| v * 2);
        assert!(h.same_members(&other));
        assert!(h.remove(64).is_some() && h.remove(70).is_some());
        assert!(h.is_empty() && h.words().is_empty());
    }
}
