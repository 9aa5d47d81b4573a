//! A node's engine hashes: one row the holders share, and own rows only for holders
//! that name the node's blocks differently.
//!
//! Engines of one model with one hash seed name the same tokens alike, so in a fleet the
//! holders of a block nearly always agree on its engine hash. Keeping one row per holder
//! made a popular node's names grow with its holders: a worker joining a node held by a
//! thousand others moved a thousand rows, and splitting or merging it copied them all.
//! With a shared row, joining with the same names costs a compare, and only a worker
//! whose names differ (another hash seed, a salt the router does not see, a re-used
//! engine hash) pays for a row of its own.

use super::holders::Slot;

#[derive(Debug, Clone, Default)]
pub(super) struct EngineRows {
    /// The names the holders share: the first holder's, or the node's sole holder's.
    common: Vec<u64>,
    /// Holders whose names differ from `common` somewhere in the node, by slot,
    /// ascending. Nearly always empty.
    own: Vec<(Slot, Vec<u64>)>,
}

impl EngineRows {
    fn find(&self, slot: Slot) -> Result<usize, usize> {
        self.own.binary_search_by_key(&slot, |(s, _)| *s)
    }

    /// The engine hashes under which `slot` (a holder of the node) holds its blocks.
    #[inline]
    pub(super) fn row(&self, slot: Slot) -> &[u64] {
        if self.own.is_empty() {
            return &self.common;
        }
        match self.find(slot) {
            Ok(i) => &self.own[i].1,
            Err(_) => &self.common,
        }
    }

    /// Holders with a row of their own (for tests and invariants).
    #[cfg(test)]
    pub(super) fn own_rows(&self) -> impl Iterator<Item = (Slot, &[u64])> {
        self.own.iter().map(|(s, r)| (*s, r.as_slice()))
    }

    #[cfg(test)]
    pub(super) fn common(&self) -> &[u64] {
        &self.common
    }

    pub(super) fn reserve(&mut self, additional: usize) {
        self.common.reserve_exact(additional);
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
            self.own.clear();
        } else if !names.clone().eq(self.common.iter().copied()) {
            if let Err(i) = self.find(slot) {
                self.own.insert(i, (slot, names.collect()));
            }
        }
    }

    /// `slot` leaves the node.
    pub(super) fn remove(&mut self, slot: Slot) {
        if let Ok(i) = self.find(slot) {
            self.own.remove(i);
        }
    }

    /// `slot` now names block `pos` `engine`; `sole`: it is the node's only holder.
    pub(super) fn set(&mut self, slot: Slot, pos: usize, engine: u64, sole: bool) {
        match self.find(slot) {
            Ok(i) => {
                self.own[i].1[pos] = engine;
                if self.own[i].1 == self.common {
                    self.own.remove(i);
                }
            }
            Err(_) if self.common[pos] == engine => {}
            Err(_) if sole => self.common[pos] = engine,
            Err(i) => {
                let mut row = self.common.clone();
                row[pos] = engine;
                self.own.insert(i, (slot, row));
            }
        }
    }

    /// Appends a block that `slot`, the node's only holder, names `engine`.
    pub(super) fn push_sole(&mut self, slot: Slot, engine: u64) {
        if !self.own.is_empty() {
            // The sole holder's own row, if it has one, becomes the shared row.
            if let Ok(i) = self.find(slot) {
                let (_, row) = self.own.swap_remove(i);
                self.common = row;
            }
            self.own.clear();
        }
        self.common.push(engine);
    }

    /// Splits before position `k`: `self` keeps the first `k` names of every row, the
    /// result has the rest.
    pub(super) fn split_off(&mut self, k: usize) -> Self {
        let common = self.common.split_off(k);
        let mut tail = Self {
            common,
            own: Vec::new(),
        };
        if self.own.is_empty() {
            return tail;
        }
        for (slot, row) in &mut self.own {
            let rest = row.split_off(k);
            if rest != tail.common {
                tail.own.push((*slot, rest));
            }
        }
        let head = &self.common;
        self.own.retain(|(_, row)| row != head);
        tail
    }

    /// Appends the rows of `next`, a node with the same holders that follows this one.
    pub(super) fn append(&mut self, next: Self) {
        if !(self.own.is_empty() && next.own.is_empty()) {
            let mut own: Vec<(Slot, Vec<u64>)> =
                Vec::with_capacity(self.own.len() + next.own.len());
            let mut slots: Vec<Slot> = self.own.iter().chain(&next.own).map(|(s, _)| *s).collect();
            slots.sort_unstable();
            slots.dedup();
            for slot in slots {
                let mut row = self.row(slot).to_vec();
                row.extend_from_slice(next.row(slot));
                own.push((slot, row));
            }
            self.own = own;
        }
        self.common.extend_from_slice(&next.common);
        let common = &self.common;
        self.own.retain(|(_, row)| row != common);
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
        assert_eq!(rows.row(3), &[1, 2, 3]);
        assert_eq!(rows.row(5), &[1, 2, 3]);
        assert_eq!(rows.row(9), &[1, 7, 3]);
        assert_eq!(rows.own_rows().count(), 1, "only the odd holder has a row");

        let tail = {
            let mut r = rows.clone();
            let tail = r.split_off(2);
            assert_eq!(r.row(9), &[1, 7]);
            assert_eq!(r.own_rows().count(), 1);
            tail
        };
        assert_eq!(tail.row(9), &[3]);
        assert_eq!(tail.own_rows().count(), 0, "the tail's names agree again");

        // Renaming the odd block back makes the holder ordinary again.
        rows.set(9, 1, 2, false);
        assert_eq!(rows.own_rows().count(), 0);
        rows.set(5, 0, 8, false);
        assert_eq!(rows.row(5), &[8, 2, 3]);
        assert_eq!(rows.row(3), &[1, 2, 3]);
        rows.remove(5);
        assert_eq!(rows.own_rows().count(), 0);
    }

    #[test]
    fn merging_rows_keeps_each_holders_names() {
        let mut head = EngineRows::default();
        head.add(1, [10, 11].into_iter(), true);
        head.add(2, [10, 12].into_iter(), false);
        let mut tail = EngineRows::default();
        tail.add(1, [13].into_iter(), true);
        tail.add(2, [13].into_iter(), false);
        head.append(tail);
        assert_eq!(head.row(1), &[10, 11, 13]);
        assert_eq!(head.row(2), &[10, 12, 13]);
        assert_eq!(head.common(), &[10, 11, 13]);

        // A sole holder with its own row appending: its names become the shared row.
        let mut sole = EngineRows::default();
        sole.add(1, [1].into_iter(), true);
        sole.add(2, [2].into_iter(), false);
        sole.remove(1);
        sole.push_sole(2, 3);
        assert_eq!(sole.row(2), &[2, 3]);
        assert_eq!(sole.own_rows().count(), 0);
    }
}
