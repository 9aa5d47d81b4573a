//! The tree's half of a worker's names. A worker holds a copy under an engine hash
//! either in its own names ([`names`]) or, when the holders of a node
//! share that name, through the shared names, which say only "this name is block b":
//! the tree confirms that the worker holds b and that its row names b so. These helpers
//! ask both, and keep a node's shared row entered in the shared names as it changes.

use super::holders::Slot;
use super::names::{self, Book, Names};
use super::{BlockId, KvIndex, NodeId};

impl KvIndex {
    /// Whether `slot` holds `block` and its row names it `engine`: the tree's half of
    /// a backed copy (the shared names give the other).
    pub(super) fn names_block(&self, slot: Slot, block: BlockId, engine: u64) -> bool {
        let Some(at) = self.blocks.get(block as usize) else {
            return false;
        };
        let Some(n) = self.nodes.get(at.node as usize) else {
            return false;
        };
        let pos = at.offset.wrapping_sub(n.first) as usize;
        n.live && pos < n.len() && n.holds(slot, pos) && n.name(&self.own, slot, pos) == engine
    }

    /// Whether `block` is one of the blocks of `node` from `pos` on that a stretch
    /// being joined has taken so far (`taken`, their items), under `engine`.
    pub(super) fn in_stretch(
        &self,
        block: BlockId,
        node: NodeId,
        pos: usize,
        taken: &[(u64, u64)],
        engine: u64,
    ) -> bool {
        let Some(at) = self.blocks.get(block as usize) else {
            return false;
        };
        let Some(n) = self.nodes.get(node as usize) else {
            return false;
        };
        let q = at.offset.wrapping_sub(n.first) as usize;
        at.node == node && q >= pos && taken.get(q - pos).is_some_and(|&(name, _)| name == engine)
    }

    /// The backed copy `slot` holds under `engine`, if any.
    #[inline(always)]
    pub(super) fn backed_copy(
        &self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
    ) -> Option<names::Copy> {
        let block = names.backed(slot, engine)?;
        self.names_block(slot, block, engine)
            .then_some(names::Copy {
                block,
                extra: names::NAMED,
            })
    }

    /// The copy `slot` holds under `engine`: in its own names, or backed.
    pub(super) fn copy_of(
        &self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
    ) -> Option<names::Copy> {
        names
            .get(slot, engine)
            .or_else(|| self.backed_copy(names, slot, engine))
    }

    /// [`copy_of`](Self::copy_of), asking the book directly (nothing recorded).
    pub(super) fn copy_in(&self, book: &Book, slot: Slot, engine: u64) -> Option<names::Copy> {
        book.copy(slot, engine).or_else(|| {
            let block = book.backed_block(slot, engine)?;
            self.names_block(slot, block, engine)
                .then_some(names::Copy {
                    block,
                    extra: names::NAMED,
                })
        })
    }

    /// A name for `block`, which `slot` holds: a copy it holds already under that
    /// name (backed, or in its own names), or else a new extra copy.
    #[inline(always)]
    pub(super) fn held_name(
        &self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
        block: BlockId,
    ) -> Option<names::Copy> {
        self.backed_copy(names, slot, engine)
            .or_else(|| names.add_extra(slot, block, engine))
    }

    /// The name of the first block of a stretch `slot` joins, at `pos` of `node`:
    /// held through the shared names when the node's shared row has it and is
    /// entered (entering it first if the node has holders and is not), else claimed in
    /// `slot`'s own names. Returns the copy `slot` already holds under `engine`, if
    /// any, and whether the new copy is backed.
    #[inline(always)]
    pub(super) fn join_name(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        node: NodeId,
        pos: usize,
        engine: u64,
        block: BlockId,
    ) -> (Option<names::Copy>, bool) {
        let n = &self.nodes[node as usize];
        if !n.holders.is_empty() && n.engines.common()[pos] == engine {
            if !n.entered {
                self.enter_row(names, node);
            }
            if self.nodes[node as usize].entered {
                return (names.get(slot, engine), true);
            }
        }
        let existing = self
            .backed_copy(names, slot, engine)
            .or_else(|| names.claim(slot, engine, block));
        (existing, false)
    }

    /// Enters `node`'s shared row in the shared names, block by block; the node is
    /// entered if every name is (a name another block has stays with it).
    #[cold]
    #[inline(never)]
    fn enter_row(&mut self, names: &mut impl Names, node: NodeId) {
        let n = &self.nodes[node as usize];
        let mut all = true;
        for (&engine, &block) in n.engines.common().iter().zip(&n.ids) {
            all &= names.enter(engine, block);
        }
        let n = &mut self.nodes[node as usize];
        n.listed = true;
        n.entered = all;
    }

    /// Takes the names of `node`'s shared row out of the shared names, at the
    /// positions `which` picks (all of them when the node is freed or its row
    /// replaced).
    pub(super) fn take_out_row(
        &mut self,
        names: &mut impl Names,
        node: NodeId,
        which: impl Fn(usize) -> bool,
    ) {
        let n = &mut self.nodes[node as usize];
        if !n.listed {
            return;
        }
        for (pos, (&engine, &block)) in n.engines.common().iter().zip(&n.ids).enumerate() {
            if which(pos) {
                names.take_out(engine, block);
            }
        }
        n.entered = false;
        n.listed = false;
    }

    /// After blocks were appended to `node` (`appended`: their names and ids), whose
    /// shared row was `entered` before: enters the new names, so that the row stays
    /// entered (if every one goes in) and the next holder naming it alike joins
    /// through the shared names instead of entering the whole row again.
    pub(super) fn enter_appended(
        &mut self,
        names: &mut impl Names,
        node: NodeId,
        entered: bool,
        appended: impl IntoIterator<Item = (u64, BlockId)>,
    ) {
        if !entered {
            return;
        }
        // Every name is entered even after one fails: the recording and replaying
        // `Names` ask the same questions in the same order.
        let all = appended.into_iter().fold(true, |all, (engine, block)| {
            names.enter(engine, block) && all
        });
        self.nodes[node as usize].entered = all;
    }

    /// Before a block is appended to `node`, its sole holder's: if that holder has
    /// names of its own there, they become the shared row's, so the shared names that
    /// row does not have go. (Appended beside holders cut before the new block, the
    /// row stays theirs: only the new names are the appender's.)
    pub(super) fn before_push(&mut self, names: &mut impl Names, node: NodeId) {
        let n = &self.nodes[node as usize];
        if !n.listed || !n.engines.has_odd() || n.holders.len() != 1 {
            return;
        }
        let Some(slot) = n.holders.slots().next() else {
            return;
        };
        let own: Vec<u64> = n.row(&self.own, slot);
        let common: Vec<u64> = n.engines.common().to_vec();
        self.take_out_row(names, node, |pos| own[pos] != common[pos]);
        // Names both rows have stay entered; the node is listed still.
        self.nodes[node as usize].listed = true;
    }
}
