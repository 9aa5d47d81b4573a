//! Removals: one copy (a `removed` event, or an engine hash reused for other tokens),
//! every copy a worker holds (`cleared`), and a worker leaving (deregistration). A block
//! stays held until the worker's last copy of it goes; then the worker leaves it, run by
//! run, and the nodes left empty are pruned. A node with cuts is split back into plain
//! nodes before a worker leaves some of its blocks ([`cuts`](super::cuts)).

use super::holders::Slot;
use super::names::{Names, Taken};
use super::{ApplyStats, BlockId, KvIndex, NodeId, Scratch, WorkerKey};

impl KvIndex {
    /// Removes one copy; the block loses `slot` when it was the last. A block whose node
    /// may have become empty is added to `prune` (a block, not a node: nodes split and
    /// merge meanwhile, a block stays where its node is).
    pub(super) fn remove_copy(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
        prune: &mut Vec<BlockId>,
    ) -> bool {
        match self.take_copy(names, slot, engine) {
            None => false,
            Some(None) => true,
            Some(Some(block)) => {
                self.release_blocks(slot, &[block], prune);
                self.scratch.left.clear();
                true
            }
        }
    }

    /// Takes one copy out of `slot`'s names: `None` if there was no such copy,
    /// `Some(Some(block))` if it was the worker's last copy of `block` (the worker must
    /// then leave the block), `Some(None)` if another copy still names it. When the
    /// named copy goes and extras remain, an extra becomes the named one, and the
    /// node's row says so.
    fn take_copy(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        engine: u64,
    ) -> Option<Option<BlockId>> {
        let mut taken = names.take(slot, engine);
        if taken == Taken::Missing {
            if let Some(copy) = self.backed_copy(names, slot, engine) {
                if !self.scratch.left.contains(&copy.block) {
                    taken = names.take_backed(slot, copy.block);
                }
            }
        }
        if let Taken::Last(block) = taken {
            self.scratch.left.insert(block);
        }
        if taken != Taken::Missing {
            self.entries -= 1;
        }
        match taken {
            Taken::Missing => None,
            Taken::Extra => Some(None),
            Taken::Last(block) => Some(Some(block)),
            Taken::Renamed { block, named } => {
                let (node, pos) = self.at(block);
                let n = &mut self.nodes[node as usize];
                let old = n.engines.common()[pos];
                n.set_engine(&mut self.own, slot, pos, named);
                if n.engines.common()[pos] != old {
                    // The sole holder renamed it: the old name is no one's now.
                    n.entered = false;
                    names.take_out(old, block);
                }
                Some(None)
            }
        }
    }

    /// `slot` leaves `blocks` (each a block it held, once). Blocks are taken node by
    /// node, as runs of consecutive positions from the highest down, so a run costs one
    /// or two splits whatever its length (splitting keeps the lower positions where
    /// they are), and a node the worker leaves whole is not split at all. The nodes
    /// touched are then merged where they agree, and their blocks added to `prune`.
    pub(super) fn release_blocks(
        &mut self,
        slot: Slot,
        blocks: &[BlockId],
        prune: &mut Vec<BlockId>,
    ) {
        // Nodes with cuts go back to plain nodes first: a holder leaving some of its
        // blocks may leave a gap, which only plain nodes can show.
        let mut pieces = std::mem::take(&mut self.scratch.pieces);
        for &block in blocks {
            let node = self.blocks[block as usize].node;
            if self.nodes[node as usize].cuts.is_some() {
                pieces.clear();
                self.materialize(node, &mut pieces);
            }
        }
        Scratch::keep(&mut self.scratch.pieces, pieces);
        let mut at = std::mem::take(&mut self.scratch.at);
        at.clear();
        at.extend(blocks.iter().map(|&block| {
            let (node, pos) = self.at(block);
            (node, pos, block)
        }));
        at.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut touched = std::mem::take(&mut self.scratch.touched);
        touched.clear();
        let mut k = 0;
        while k < at.len() {
            let (node, high, block) = at[k];
            let mut low = high;
            k += 1;
            while k < at.len() && at[k].0 == node && at[k].1 + 1 == low {
                low = at[k].1;
                k += 1;
            }
            let m = self.isolate(node, low, high + 1);
            self.nodes[m as usize].remove_holder(Some(&mut self.own), slot);
            touched.push(block);
        }
        for &block in &touched {
            let node = self.blocks[block as usize].node;
            if self.nodes[node as usize].live {
                self.merge_around(node);
            }
        }
        prune.extend_from_slice(&touched);
        Scratch::keep(&mut self.scratch.at, at);
        Scratch::keep(&mut self.scratch.touched, touched);
    }

    pub(super) fn apply_removed(
        &mut self,
        names: &mut impl Names,
        worker: WorkerKey,
        engine_hashes: &[u64],
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(&slot) = self.slots.get(&worker) else {
            stats.missing_removals = engine_hashes.len();
            return stats;
        };
        let mut leaving = std::mem::take(&mut self.scratch.leaving);
        leaving.clear();
        for &engine in engine_hashes {
            match self.take_copy(names, slot, engine) {
                None => stats.missing_removals += 1,
                Some(last) => {
                    stats.removed += 1;
                    leaving.extend(last);
                }
            }
        }
        let mut prune = std::mem::take(&mut self.scratch.prune);
        prune.clear();
        self.release_blocks(slot, &leaving, &mut prune);
        self.scratch.left.clear();
        Scratch::keep(&mut self.scratch.leaving, leaving);
        self.prune_all(names, prune);
        stats
    }

    /// Forgets everything `worker` stored (deregistration) and frees its slot.
    pub fn remove_worker(&mut self, worker: WorkerKey) {
        let book = self.book();
        let mut book = book.lock();
        self.remove_worker_with(&mut *book, worker);
    }

    pub(super) fn remove_worker_with(&mut self, names: &mut impl Names, worker: WorkerKey) {
        self.clear_worker(names, worker);
        if let Some(slot) = self.slots.remove(&worker) {
            names.close(slot);
            self.slot_keys[slot as usize] = None;
            self.free_slots.push(slot);
        }
    }

    /// Drops every block `worker` holds but keeps its slot, since a cleared engine
    /// usually starts storing again at once. Returns how many copies were dropped.
    /// The worker leaves whole nodes, or the first blocks of a node it holds by a cut:
    /// no splitting, but for a node with cuts it is the last to hold whole.
    pub(super) fn clear_worker(&mut self, names: &mut impl Names, worker: WorkerKey) -> usize {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let mut blocks = Vec::new();
        let (own, backed) = names.drain(slot, &mut blocks);
        let dropped = own + backed;
        let mut nodes: Vec<NodeId> = blocks
            .into_iter()
            .map(|block| self.blocks[block as usize].node)
            .collect();
        if backed > 0 {
            // Backed copies are in no list of the worker's: their nodes are found by
            // their holders (a clear is rare; the walk is one look per node).
            nodes.extend(
                self.nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| n.live && n.holders.contains(slot))
                    .map(|(id, _)| id as NodeId),
            );
        }
        nodes.sort_unstable();
        nodes.dedup();
        // A node with cuts whose last holder of every block this is goes back to plain
        // nodes first, or its blocks past the cuts would be left held by no one.
        let mut pieces = Vec::new();
        for &node in &nodes {
            let n = &self.nodes[node as usize];
            if let Some(cuts) = &n.cuts {
                if n.holds_all(slot) && n.holders.len() - cuts.len() == 1 {
                    self.materialize(node, &mut pieces);
                }
            }
        }
        nodes.extend_from_slice(&pieces);
        // Its own names go whole, not block by block.
        self.own.clear(slot);
        for &node in &nodes {
            self.nodes[node as usize].remove_holder(None, slot);
        }
        self.entries -= dropped;
        // Merging frees nodes, so first prune, then merge what is still there.
        for &node in &nodes {
            self.prune(names, node);
        }
        for node in nodes {
            if self.nodes[node as usize].live {
                self.merge_around(node);
            }
        }
        self.remerge();
        dropped
    }
}
