//! A node's engine hashes: one row the holders share, and rows of their own only for
//! holders that name the node's blocks differently.
//!
//! When engines of one model share a hash seed, they name the same tokens alike, and
//! the holders of a block agree on its engine hash. Keeping one row per holder made a
//! popular node's names grow with its holders: a worker joining a node held by a
//! thousand others moved a thousand rows, and splitting or merging it copied them all.
//! With a shared row, joining with the same names costs a compare. Engines that seed
//! their hashes per process (vLLM without a fixed `PYTHONHASHSEED`) name every block
//! differently; their rows are kept as before, side by side in slot order in one
//! buffer, found by the holder's rank, so reading a peer's names is one slice of it.

use super::holders::{Holders, Slot};

#[derive(Debug, Clone, Default)]
pub(super) struct EngineRows {
    /// The names the holders share: the first holder's, or the node's sole holder's.
    common: Vec<u64>,
    /// Holders whose names differ from `common` somewhere in the node. Boxed: most
    /// nodes have none, and a walk reads every node it passes.
    odd: Option<Box<OddRows>>,
}

#[derive(Debug, Clone, Default)]
struct OddRows {
    slots: Holders,
    /// One row of `common.len()` per slot of `slots`, in slot order.
    rows: Vec<u64>,
}

impl EngineRows {
    /// The engine hashes under which `slot` (a holder of the node) holds its blocks.
    #[inline]
    pub(super) fn row(&self, slot: Slot) -> &[u64] {
        let Some(odd) = &self.odd else {
            return &self.common;
        };
        match odd.slots.rank_of(slot) {
            Some(rank) => {
                let len = self.common.len();
                &odd.rows[rank * len..(rank + 1) * len]
            }
            None => &self.common,
        }
    }

    /// Holders with a row of their own (for tests and invariants).
    #[cfg(test)]
    pub(super) fn own_rows(&self) -> Vec<(Slot, &[u64])> {
        let Some(odd) = &self.odd else {
            return Vec::new();
        };
        let len = self.common.len();
        odd.slots
            .slots()
            .enumerate()
            .map(|(r, s)| (s, &odd.rows[r * len..(r + 1) * len]))
            .collect()
    }

    /// Whether some holder has a row of its own.
    pub(super) fn has_odd(&self) -> bool {
        self.odd.is_some()
    }

    /// The shared row.
    #[inline(always)]
    pub(super) fn common(&self) -> &[u64] {
        &self.common
    }

    /// Room for `additional` more blocks (amortized: a node appended to event after
    /// event grows its row by doubling, like its other arrays).
    pub(super) fn reserve(&mut self, additional: usize) {
        self.common.reserve(additional);
    }

    /// `slot` joins the node naming its blocks `names`; `first`: it is the only
    /// holder now, so its names become the shared row. Names that agree with the
    /// shared row cost a compare and no copy.
    pub(super) fn add(
        &mut self,
        slot: Slot,
        names: impl Iterator<Item = u64> + Clone,
        first: bool,
    ) {
        if first {
            self.common.clear();
            self.common.extend(names);
            self.odd = None;
        } else if !names.clone().eq(self.common.iter().copied()) {
            self.add_own(slot, names);
        }
    }

    /// `slot` joins the node with a row of its own, `names`.
    fn add_own(&mut self, slot: Slot, names: impl Iterator<Item = u64>) {
        let len = self.common.len();
        let odd = self.odd.get_or_insert_with(Box::default);
        let at = odd.slots.position(slot) * len;
        if odd.slots.insert(slot) {
            if at == odd.rows.len() {
                // After every other own row (a worker registered after the others):
                // appended, without `splice`'s bookkeeping for a tail to move.
                odd.rows.extend(names);
            } else {
                odd.rows.splice(at..at, names);
            }
        }
    }

    /// [`add`](Self::add) with the names of `items`, (engine hash, sequence hash)
    /// pairs as a store carries them. A store joining a chain of short nodes calls
    /// this once per node, and nearly always with the shared row's names: compared
    /// as two slices side by side, not through `add`'s iterator (whose generic
    /// compare took 37 of such a join's ~570 instructions; this one takes about 20).
    #[inline]
    pub(super) fn add_pairs(&mut self, slot: Slot, items: &[(u64, u64)], first: bool) {
        let names = items.iter().map(|(engine, _)| *engine);
        if first || items.len() != self.common.len() {
            self.add(slot, names, first);
        } else if !items.iter().zip(&self.common).all(|(item, c)| item.0 == *c) {
            // Compared already: no second compare in `add`.
            self.add_own(slot, names);
        }
    }

    /// `slot` leaves the node.
    pub(super) fn remove(&mut self, slot: Slot) {
        let len = self.common.len();
        if let Some(odd) = &mut self.odd {
            if let Some(rank) = odd.slots.rank_of(slot) {
                odd.slots.remove(slot);
                odd.rows.drain(rank * len..(rank + 1) * len);
                if odd.slots.is_empty() {
                    self.odd = None;
                }
            }
        }
    }

    /// `slot` now names block `pos` `engine`; `sole`: it is the node's only holder.
    pub(super) fn set(&mut self, slot: Slot, pos: usize, engine: u64, sole: bool) {
        let len = self.common.len();
        if let Some(odd) = &mut self.odd {
            if let Some(rank) = odd.slots.rank_of(slot) {
                odd.rows[rank * len + pos] = engine;
                self.normalize();
                return;
            }
        }
        if self.common[pos] == engine {
            return;
        }
        if sole {
            self.common[pos] = engine;
            return;
        }
        let mut row = self.common.clone();
        row[pos] = engine;
        self.add(slot, row.into_iter(), false);
    }

    /// Appends a block that `slot`, the node's only holder, names `engine`.
    /// Inlined, with the rare case out of line: it runs for every block appended.
    #[inline(always)]
    pub(super) fn push_sole(&mut self, slot: Slot, engine: u64) {
        if self.odd.is_some() {
            self.make_sole(slot);
        }
        self.common.push(engine);
    }

    /// Appends blocks that `slot`, the node's only holder, names `engines`.
    pub(super) fn extend_sole(&mut self, slot: Slot, engines: impl Iterator<Item = u64>) {
        if self.odd.is_some() {
            self.make_sole(slot);
        }
        self.common.extend(engines);
    }

    /// The sole holder's own row, if it has one, becomes the shared row.
    #[cold]
    #[inline(never)]
    fn make_sole(&mut self, slot: Slot) {
        let own = self.row(slot).to_vec();
        self.common = own;
        self.odd = None;
    }

    /// Empty rows whose shared row fills `common` (a pooled buffer).
    pub(super) fn with_common(common: Vec<u64>) -> Self {
        Self { common, odd: None }
    }

    /// The shared row's buffer, leaving it empty (for [`split_off`](Self::split_off)'s
    /// spare).
    pub(super) fn take_common(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.common)
    }

    /// The shared row's buffer, for reuse once its node is freed.
    pub(super) fn into_common(self) -> Vec<u64> {
        self.common
    }

    /// Splits before position `k`: `self` keeps the first `k` names of every row, the
    /// result has the rest (its shared row in `spare`'s buffer, or this one's).
    pub(super) fn split_off(&mut self, k: usize, spare: Vec<u64>) -> Self {
        let len = self.common.len();
        let common = super::tree::split_buffer(&mut self.common, k, spare);
        let Some(odd) = &mut self.odd else {
            return Self { common, odd: None };
        };
        let rows = odd.slots.len();
        let mut tail_rows = Vec::with_capacity(rows * (len - k));
        for r in 0..rows {
            tail_rows.extend_from_slice(&odd.rows[r * len + k..(r + 1) * len]);
        }
        for r in 0..rows {
            odd.rows.copy_within(r * len..r * len + k, r * k);
        }
        odd.rows.truncate(rows * k);
        let mut tail = Self {
            common,
            odd: Some(Box::new(OddRows {
                slots: odd.slots.clone(),
                rows: tail_rows,
            })),
        };
        self.normalize();
        tail.normalize();
        tail
    }

    /// Appends the rows of `next`, a node with the same holders that follows this one
    /// (whose buffers stay with it, for reuse).
    pub(super) fn append(&mut self, next: &Self) {
        if self.odd.is_some() || next.odd.is_some() {
            let mut slots = Holders::default();
            for odd in [&self.odd, &next.odd].into_iter().flatten() {
                for slot in odd.slots.slots() {
                    slots.insert(slot);
                }
            }
            let mut rows =
                Vec::with_capacity(slots.len() * (self.common.len() + next.common.len()));
            for slot in slots.slots() {
                rows.extend_from_slice(self.row(slot));
                rows.extend_from_slice(next.row(slot));
            }
            self.odd = Some(Box::new(OddRows { slots, rows }));
        }
        self.common.extend_from_slice(&next.common);
        self.normalize();
    }

    /// Drops own rows that equal the shared one.
    fn normalize(&mut self) {
        let len = self.common.len();
        let Some(odd) = &mut self.odd else {
            return;
        };
        let mut slots = Holders::default();
        let mut keep = 0;
        for (r, slot) in odd.slots.slots().enumerate() {
            if odd.rows[r * len..(r + 1) * len] != self.common[..] {
                if keep != r {
                    odd.rows.copy_within(r * len..(r + 1) * len, keep * len);
                }
                slots.insert(slot);
                keep += 1;
            }
        }
        odd.rows.truncate(keep * len);
        odd.slots = slots;
        if keep == 0 {
            self.odd = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_naming_alike_share_one_row_and_others_keep_their_own() {
        let mut rows = EngineRows::default();
        rows.add(3, [1, 2, 3].into_iter(), true);
        rows.add(5, [1, 2, 3].into_iter(), false);
        rows.add(9, [1, 7, 3].into_iter(), false);
        rows.add(70, [4, 2, 3].into_iter(), false);
        assert_eq!(rows.row(3), &[1, 2, 3]);
        assert_eq!(rows.row(5), &[1, 2, 3]);
        assert_eq!(rows.row(9), &[1, 7, 3]);
        assert_eq!(rows.row(70), &[4, 2, 3]);
        assert_eq!(rows.own_rows().len(), 2, "only the odd holders have rows");

        let tail = {
            let mut r = rows.clone();
            let tail = r.split_off(2, Vec::new());
            assert_eq!(
                (r.row(9), r.row(70), r.row(3)),
                (&[1, 7][..], &[4, 2][..], &[1, 2][..])
            );
            assert_eq!(r.own_rows().len(), 2);
            tail
        };
        assert_eq!(tail.row(9), &[3]);
        assert!(tail.own_rows().is_empty(), "the tail's names agree again");

        // Renaming the odd block back makes the holder ordinary again.
        rows.set(9, 1, 2, false);
        assert_eq!(rows.own_rows().len(), 1);
        rows.set(5, 0, 8, false);
        assert_eq!(rows.row(5), &[8, 2, 3]);
        assert_eq!(rows.row(3), &[1, 2, 3]);
        assert_eq!(rows.row(70), &[4, 2, 3]);
        rows.remove(5);
        rows.remove(70);
        assert!(rows.own_rows().is_empty());
    }

    #[test]
    fn merging_rows_keeps_each_holders_names() {
        let mut head = EngineRows::default();
        head.add(1, [10, 11].into_iter(), true);
        head.add(2, [10, 12].into_iter(), false);
        let mut tail = EngineRows::default();
        tail.add(2, [13].into_iter(), true);
        tail.add(1, [14].into_iter(), false);
        head.append(&tail);
        assert_eq!(head.row(1), &[10, 11, 14]);
        assert_eq!(head.row(2), &[10, 12, 13]);
        assert_eq!(head.common(), &[10, 11, 13]);

        // A sole holder with its own row appending: its names become the shared row.
        let mut sole = EngineRows::default();
        sole.add(1, [1].into_iter(), true);
        sole.add(2, [2].into_iter(), false);
        sole.remove(1);
        sole.push_sole(2, 3);
        assert_eq!(sole.row(2), &[2, 3]);
        assert!(sole.own_rows().is_empty());
    }
}
