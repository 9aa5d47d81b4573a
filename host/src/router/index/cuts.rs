//! Holders of a node's leading blocks only: per-worker cut-offs inside a node.
//!
//! A node is a run of blocks, and its holders used to hold every block of it, so a
//! worker holding a prefix of the run split it there. Nested prefixes of one long
//! prompt, each held by another worker (what a fleet serving one system prompt or one
//! document to many requests caches), then made a chain of as many nodes as there were
//! prefix lengths: at 1,024 workers on a 2,048-block prompt, 1,024 nodes of two blocks,
//! and a store walked one node per two blocks (its child lookup, holder words, merge
//! checks and join), which ablations put at 5 of the 30 ns a block of that build
//! (issue 29), and a lookup ANDed 16 holder words per node. Dynamo's compressed tree
//! keeps such a run as one edge with a cut-off per worker (`NodeState::worker_cutoffs`);
//! so does this index now: a holder of a node may hold only its first `cut` blocks.
//!
//! A node's `holders` still name every worker holding any of its blocks (so a lookup
//! entering a node ANDs the same words); [`Cuts`] says which of them stop early, and
//! where. Only two steps make cut-offs, both in a store: a worker joining a node from
//! its first block that stops before its end, and a worker that holds all of a
//! childless node appending its new blocks there (the node's other holders now stop
//! where it ended). Every other change to a node with cut-offs (a removal, a clear, a
//! join from the middle) first splits it back into plain nodes, one per cut-off
//! ([`KvIndex::materialize`](super::KvIndex)), and runs as before: the splits a join no
//! longer makes are made there, once, and only where something else changes.

use super::holders::{Holders, Slot};

/// The holders of a node that hold only its leading blocks, with how many: a holder
/// with cut `c` holds positions `0..c`, `0 < c < len`.
#[derive(Debug, Clone, Default)]
pub(super) struct Cuts {
    /// (cut, slot), ascending: the order in which a lookup drops them.
    by_cut: Vec<(u32, Slot)>,
    /// (slot, cut), ascending by slot: a slot's cut, by binary search.
    by_slot: Vec<(Slot, u32)>,
    /// The same slots as a set, so that the node's full holders (its holders without
    /// these) are a word-by-word difference.
    slots: Holders,
}

impl Cuts {
    pub(super) fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.by_slot.len()
    }

    /// `slot`'s cut, if it is one of these holders.
    #[inline]
    pub(super) fn cut_of(&self, slot: Slot) -> Option<usize> {
        if !self.slots.contains(slot) {
            return None;
        }
        let at = self.by_slot.binary_search_by_key(&slot, |e| e.0).ok()?;
        Some(self.by_slot[at].1 as usize)
    }

    /// Records that `slot` (not one of these) holds the first `cut` blocks.
    pub(super) fn insert(&mut self, slot: Slot, cut: usize) {
        let cut = cut as u32;
        if !self.slots.insert(slot) {
            return;
        }
        let at = self.by_slot.partition_point(|e| e.0 < slot);
        self.by_slot.insert(at, (slot, cut));
        let at = self.by_cut.partition_point(|e| *e < (cut, slot));
        self.by_cut.insert(at, (cut, slot));
    }

    /// Takes `slot` out; returns its cut if it was one of these.
    pub(super) fn remove(&mut self, slot: Slot) -> Option<usize> {
        if !self.slots.remove(slot) {
            return None;
        }
        let at = self.by_slot.binary_search_by_key(&slot, |e| e.0).ok()?;
        let (_, cut) = self.by_slot.remove(at);
        if let Ok(at) = self.by_cut.binary_search(&(cut, slot)) {
            self.by_cut.remove(at);
        }
        Some(cut as usize)
    }

    /// (cut, slot), ascending by cut.
    pub(super) fn by_cut(&self) -> &[(u32, Slot)] {
        &self.by_cut
    }

    /// The members of `holders` that are not among these: the node's full holders.
    pub(super) fn full(&self, holders: &Holders) -> Holders {
        holders.without(&self.slots)
    }

    /// Splits before position `k` of the node: these keep the cuts below `k` (those at
    /// or past it hold the whole head); returns the tail's cuts (those past `k`, less
    /// `k`), and writes the slots that hold nothing of the tail (cut at or below `k`)
    /// into `gone`.
    pub(super) fn split_off(&mut self, k: usize, gone: &mut Vec<Slot>) -> Cuts {
        let k = k as u32;
        let mut tail = Cuts::default();
        let mut head = Cuts::default();
        for &(cut, slot) in &self.by_cut {
            if cut > k {
                tail.insert(slot, (cut - k) as usize);
            } else {
                gone.push(slot);
                if cut < k {
                    head.insert(slot, cut as usize);
                }
            }
        }
        *self = head;
        tail
    }
}

#[cfg(test)]
impl Cuts {
    /// The three views list the same members, each sorted (for invariant checks).
    pub(super) fn check(&self) {
        let mut by_cut: Vec<(Slot, u32)> = self.by_cut.iter().map(|&(c, s)| (s, c)).collect();
        by_cut.sort_unstable();
        assert_eq!(by_cut, self.by_slot, "cuts by cut and by slot agree");
        assert!(
            self.by_cut.windows(2).all(|p| p[0] < p[1]),
            "by cut, ascending"
        );
        let slots: Vec<Slot> = self.slots.slots().collect();
        let listed: Vec<Slot> = self.by_slot.iter().map(|e| e.0).collect();
        assert_eq!(slots, listed, "the set of cut slots agrees");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_are_found_by_slot_and_listed_by_cut() {
        let mut c = Cuts::default();
        for (slot, cut) in [(70, 5), (3, 2), (200, 5), (9, 1)] {
            c.insert(slot, cut);
        }
        assert_eq!(c.by_cut(), &[(1, 9), (2, 3), (5, 70), (5, 200)]);
        assert_eq!(
            (c.cut_of(70), c.cut_of(3), c.cut_of(4)),
            (Some(5), Some(2), None)
        );
        let mut holders = Holders::default();
        for slot in [3, 9, 70, 200, 64, 1] {
            holders.insert(slot);
        }
        assert_eq!(c.full(&holders).slots().collect::<Vec<_>>(), vec![1, 64]);
        assert_eq!(c.remove(3), Some(2));
        assert_eq!(c.remove(3), None);
        assert_eq!(c.len(), 3);

        // Split before 2: 9 (cut 1) holds nothing of the tail and keeps its cut in the
        // head; 70 and 200 hold the whole head and three blocks of the tail.
        let mut gone = Vec::new();
        let tail = c.split_off(2, &mut gone);
        assert_eq!(gone, vec![9]);
        assert_eq!(c.by_cut(), &[(1, 9)]);
        assert_eq!(tail.by_cut(), &[(3, 70), (3, 200)]);
        // Split before 1 of that head: 9 holds the head whole and nothing after.
        let mut gone = Vec::new();
        let tail = c.split_off(1, &mut gone);
        assert!(c.is_empty() && tail.is_empty());
        assert_eq!(gone, vec![9]);
    }
}
