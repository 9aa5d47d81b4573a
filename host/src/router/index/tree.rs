//! The tree's shape: nodes (runs of consecutive blocks that one set of workers holds,
//! some of them only the first blocks, [`cuts`](super::cuts)), where each block is, and
//! the restructuring every change needs: a node is split where holder sets diverge,
//! merged back where they agree again (never with cuts on either side), split back into
//! plain nodes where a change needs them, and pruned once no one holds it and it leads
//! nowhere.
//!
//! Blocks have ids that outlive the nodes around them, because nodes split and merge
//! under them: a store's cursor, a worker's names and a prune candidate all name a
//! block, never a node. A node counts its blocks' positions from its `first`, so a
//! split rewrites only the moved blocks' entries.

use super::cuts::Cuts;
use super::holders::{Holders, Slot};
use super::names::Names;
use super::rows::{EngineRows, OwnNames};
use super::{BlockId, KvIndex, NodeId, Scratch, NO_NODE};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;

/// Children of a node by the sequence hash of their first block: a short list scanned
/// in order, or a map once a node has many (a shared system prompt followed by many
/// different user prompts).
#[derive(Debug, Clone)]
pub(super) enum Children {
    Few(SmallVec<[(u64, NodeId); 2]>),
    Many(FxHashMap<u64, NodeId>),
}

const FEW_CHILDREN: usize = 8;

impl Default for Children {
    fn default() -> Self {
        Self::Few(SmallVec::new())
    }
}

impl Children {
    #[inline]
    pub(super) fn get(&self, seq: u64) -> Option<NodeId> {
        match self {
            Self::Few(list) => list.iter().find(|(s, _)| *s == seq).map(|(_, n)| *n),
            Self::Many(map) => map.get(&seq).copied(),
        }
    }

    pub(super) fn insert(&mut self, seq: u64, node: NodeId) {
        match self {
            Self::Few(list) => {
                if let Some(entry) = list.iter_mut().find(|(s, _)| *s == seq) {
                    entry.1 = node;
                } else if list.len() < FEW_CHILDREN {
                    list.push((seq, node));
                } else {
                    let mut map: FxHashMap<u64, NodeId> = list.iter().copied().collect();
                    map.insert(seq, node);
                    *self = Self::Many(map);
                }
            }
            Self::Many(map) => {
                map.insert(seq, node);
            }
        }
    }

    pub(super) fn remove(&mut self, seq: u64) {
        match self {
            Self::Few(list) => list.retain(|(s, _)| *s != seq),
            Self::Many(map) => {
                map.remove(&seq);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Few(list) => list.len(),
            Self::Many(map) => map.len(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub(super) fn only(&self) -> Option<NodeId> {
        match self {
            // One look at where the list's items are, not one for its length and
            // one more for its item.
            Self::Few(list) => match list.as_slice() {
                [(_, node)] => Some(*node),
                _ => None,
            },
            Self::Many(map) if map.len() == 1 => map.values().next().copied(),
            _ => None,
        }
    }

    pub(super) fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        let (few, many) = match self {
            Self::Few(list) => (Some(list.iter().map(|(_, n)| *n)), None),
            Self::Many(map) => (None, Some(map.values().copied())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }
}

/// A run of consecutive blocks that the same workers hold, but for holders of its
/// leading blocks only ([`Cuts`](super::cuts)).
#[derive(Debug, Clone, Default)]
// In this order, C-laid: what a lookup reads of every node it passes (the run, the
// holder words, the children, the cuts) is its first 120 bytes, together whatever
// order the compiler would choose. Measured against the compiler's order after the
// cuts made a node 8 bytes larger, the lookup over a chain of a thousand nodes was
// within the noise (`shared/1024w/32k` 14.2, 15.3 against 14.4, 16.3 µs).
#[repr(C)]
pub(super) struct Node {
    /// Sequence hashes of the blocks, in chain order.
    pub(super) seqs: Vec<u64>,
    /// Every worker holding any block of the node: all of them, but those in `cuts`.
    pub(super) holders: Holders,
    pub(super) children: Children,
    /// The holders that hold only the node's first blocks, if any
    /// ([`cuts`](super::cuts)); boxed, since most nodes have none.
    pub(super) cuts: Option<Box<Cuts>>,
    /// Ids of the blocks, parallel to `seqs`.
    pub(super) ids: Vec<BlockId>,
    /// Each holder's engine hashes of the node's blocks ([`rows`](super::rows)): one row
    /// the holders share; a holder's names that differ are in a table of its own.
    pub(super) engines: EngineRows,
    /// `NO_NODE` for a node whose first block starts a sequence.
    pub(super) parent: NodeId,
    /// The `offset` its blocks' [`BlockAt`] entries count from, so that splitting a node
    /// rewrites only the moved blocks' entries. It only grows along a sequence that
    /// keeps growing at its end while losing its head, so after 2^32 blocks through one
    /// sequence it wraps: offsets and positions are computed modulo 2^32 (wrapping
    /// arithmetic), which is exact while a node holds fewer than 2^32 blocks.
    pub(super) first: u32,
    pub(super) live: bool,
    /// Every name of the shared row is entered in the book's shared names for its
    /// block ([`names::Shared`](super::names::Shared)): a holder joining with the same names holds the
    /// blocks through them and writes nothing in its own names.
    pub(super) entered: bool,
    /// Some names of the shared row may be entered: the node's names are taken out
    /// when it is freed or its shared row renamed.
    pub(super) listed: bool,
}

impl Node {
    pub(super) fn len(&self) -> usize {
        self.seqs.len()
    }

    /// How many leading blocks of the node `slot` holds: all, its cut, or none.
    #[inline]
    pub(super) fn held_until(&self, slot: Slot) -> usize {
        if !self.holders.contains(slot) {
            return 0;
        }
        self.cut_of(slot).unwrap_or(self.len())
    }

    /// `slot`'s cut, if it holds only the node's first blocks.
    #[inline]
    pub(super) fn cut_of(&self, slot: Slot) -> Option<usize> {
        self.cuts.as_ref()?.cut_of(slot)
    }

    /// Whether `slot` holds the block at `pos`.
    #[inline]
    pub(super) fn holds(&self, slot: Slot, pos: usize) -> bool {
        pos < self.held_until(slot)
    }

    /// Whether `slot` holds every block of the node.
    #[inline]
    pub(super) fn holds_all(&self, slot: Slot) -> bool {
        self.holders.contains(slot) && self.cut_of(slot).is_none()
    }

    /// Adds `slot`, not a holder, as a holder of the node's first `items.len()` blocks
    /// (fewer than all), naming them by the engine hashes of `items`; `rest` as for
    /// [`add_holder`](Self::add_holder). The node has other holders.
    pub(super) fn add_cut(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        items: &[(u64, u64)],
        rest: usize,
    ) {
        debug_assert!(!self.holders.is_empty() && items.len() < self.len());
        if self.holders.insert(slot) {
            self.cuts
                .get_or_insert_with(Box::default)
                .insert(slot, items.len());
            self.engines
                .add_pairs(own, slot, items, &self.ids, false, rest);
        }
    }

    /// Before `slot`, a holder of every block of this childless node, appends blocks
    /// to it: every other holder of every block now holds only the blocks before them.
    pub(super) fn cut_others(&mut self, slot: Slot) {
        if self.holders.len() == 1 {
            return;
        }
        let full = match &self.cuts {
            Some(cuts) => cuts.full(&self.holders),
            None => self.holders.clone(),
        };
        let len = self.len();
        let cuts = self.cuts.get_or_insert_with(Box::default);
        for other in full.slots().filter(|&s| s != slot) {
            cuts.insert(other, len);
        }
    }

    /// The engine hash under which the holder `slot` holds the block at `pos`.
    #[inline]
    pub(super) fn name(&self, own: &OwnNames, slot: Slot, pos: usize) -> u64 {
        self.engines.name(own, slot, pos, self.ids[pos])
    }

    /// The holder `slot`'s engine hashes of the node's first `out.len()` blocks.
    #[inline]
    pub(super) fn copy_row(&self, own: &OwnNames, slot: Slot, out: &mut [u64]) {
        self.engines.copy_row(own, slot, &self.ids, out);
    }

    /// The holder `slot`'s engine hashes of the node's blocks.
    pub(super) fn row(&self, own: &OwnNames, slot: Slot) -> Vec<u64> {
        self.engines.row_of(own, slot, &self.ids)
    }

    pub(super) fn set_engine(&mut self, own: &mut OwnNames, slot: Slot, pos: usize, engine: u64) {
        if self.holders.contains(slot) {
            let sole = self.holders.len() == 1;
            self.engines
                .set(own, slot, pos, self.ids[pos], engine, sole);
        }
    }

    /// Adds `slot` with its engine hashes of every block: the first of each of
    /// `items` (`len()` of them); `rest`: the store's blocks left from the first on.
    #[inline(always)]
    pub(super) fn add_holder(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        items: &[(u64, u64)],
        rest: usize,
    ) {
        let first = self.holders.is_empty();
        if self.holders.insert(slot) {
            self.engines
                .add_pairs(own, slot, items, &self.ids, first, rest);
        }
    }

    /// Takes `slot` out of the holders, with its own names of the node's blocks
    /// (`own`: `None` when they are dropped whole elsewhere).
    pub(super) fn remove_holder(&mut self, own: Option<&mut OwnNames>, slot: Slot) {
        if self.holders.remove(slot) {
            if let Some(cuts) = &mut self.cuts {
                cuts.remove(slot);
                if cuts.is_empty() {
                    self.cuts = None;
                }
            }
            self.engines
                .remove(own, slot, &self.ids, self.holders.len());
        }
    }

    /// Appends a block held by `slot` alone (the node's only holder, or the only one
    /// holding all of it, the others cut before it). Inlined: it runs for every block
    /// appended, and as a call it spilled registers around three pushes.
    #[inline(always)]
    pub(super) fn push_block(
        &mut self,
        own: &mut OwnNames,
        slot: Slot,
        seq: u64,
        block: BlockId,
        engine: u64,
    ) {
        // The new block's name is not entered.
        self.entered = false;
        let sole = self.holders.len() == 1;
        self.engines.push_sole(own, slot, &self.ids, engine, sole);
        self.seqs.push(seq);
        self.ids.push(block);
    }
}

/// Splits `v` before `k` like [`Vec::split_off`], but into `spare` (a pooled buffer,
/// see [`Buffers`]), and copies the shorter side out: the longer side keeps the buffer
/// and its spare room. A worker that evicts the head of a sequence it is still
/// extending splits off a short head, so the tail, where its next blocks are appended,
/// keeps the capacity it grew instead of starting again from an exact-size copy.
pub(super) fn split_buffer<T: Copy>(v: &mut Vec<T>, k: usize, mut spare: Vec<T>) -> Vec<T> {
    spare.clear();
    if k <= v.len() - k {
        spare.extend_from_slice(&v[..k]);
        v.drain(..k);
        std::mem::replace(v, spare)
    } else {
        spare.extend_from_slice(&v[k..]);
        v.truncate(k);
        spare
    }
}

/// Buffers of the nodes this copy of the tree freed, for the nodes it makes next.
///
/// In a steady stream an engine stores new sequences as fast as it evicts old ones,
/// so nodes are freed (pruned, or merged into their parent) and made (new sequences,
/// splits) at the same rate. Each made node used to allocate its arrays and grow them
/// block by block as its sequence grew (a `realloc` and a copy at each doubling), and
/// each freed one gave them back: a tenth of the instructions of applying the stream
/// went to the allocator. Reused, a buffer keeps the room its last node grew.
/// Bounded: at most [`BUFFERS_KEEP`] of each kind, none larger than [`BUFFER_MAX`]
/// entries, so an index that shrinks gives nearly all of its memory back.
#[derive(Debug, Default)]
pub(super) struct Buffers {
    /// Sequence hashes' and engine hashes' arrays.
    pub(super) wide: Vec<Vec<u64>>,
    /// Block ids' arrays.
    pub(super) ids: Vec<Vec<BlockId>>,
}

pub(super) const BUFFERS_KEEP: usize = 256;
pub(super) const BUFFER_MAX: usize = 4096;

impl Buffers {
    fn keep<T>(pool: &mut Vec<Vec<T>>, mut buffer: Vec<T>) {
        if buffer.capacity() > 0 && buffer.capacity() <= BUFFER_MAX && pool.len() < BUFFERS_KEEP {
            buffer.clear();
            pool.push(buffer);
        }
    }

    /// Keeps the arrays of a node being freed.
    pub(super) fn keep_node(&mut self, node: Node) {
        Self::keep(&mut self.wide, node.seqs);
        Self::keep(&mut self.ids, node.ids);
        Self::keep(&mut self.wide, node.engines.into_common());
    }

    pub(super) fn wide(&mut self) -> Vec<u64> {
        self.wide.pop().unwrap_or_default()
    }

    pub(super) fn ids(&mut self) -> Vec<BlockId> {
        self.ids.pop().unwrap_or_default()
    }
}

/// A block with its node and position in it, as a store's walk carries it: a store
/// that joins a long chain of short nodes meets a node per block or two, and looking
/// each block up again in `blocks` put one more dependent load in every step.
#[derive(Debug, Clone, Copy)]
pub(super) struct Place {
    pub(super) block: BlockId,
    pub(super) node: NodeId,
    pub(super) pos: usize,
}

/// Where a block is: its node and `first + position` in it.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockAt {
    pub(super) node: NodeId,
    pub(super) offset: u32,
}

impl KvIndex {
    pub(super) fn at(&self, block: BlockId) -> (NodeId, usize) {
        let at = self.blocks[block as usize];
        let node = &self.nodes[at.node as usize];
        (at.node, at.offset.wrapping_sub(node.first) as usize)
    }

    pub(super) fn seq_of(&self, block: BlockId) -> u64 {
        let (node, pos) = self.at(block);
        self.nodes[node as usize].seqs[pos]
    }

    /// `block` with its node and position.
    pub(super) fn place(&self, block: BlockId) -> Place {
        let (node, pos) = self.at(block);
        Place { block, node, pos }
    }

    /// A block id for a block about to be placed.
    pub(super) fn reserve_block(&mut self) -> BlockId {
        match self.free_blocks.pop() {
            Some(id) => id,
            None => {
                self.blocks.push(BlockAt {
                    node: NO_NODE,
                    offset: 0,
                });
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    pub(super) fn new_node(&mut self, parent: NodeId) -> NodeId {
        let node = Node {
            parent,
            live: true,
            seqs: self.buffers.wide(),
            ids: self.buffers.ids(),
            engines: EngineRows::with_common(self.buffers.wide()),
            ..Node::default()
        };
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Splits `node` before position `k` (0 < k < len). The node keeps its id and its
    /// first `k` blocks; a new child takes the rest, the holders and the children. Only
    /// the moved blocks' entries are rewritten. Returns the new node.
    pub(super) fn split(&mut self, node: NodeId, k: usize) -> NodeId {
        let tail_id = self.new_node(node);
        let t = &mut self.nodes[tail_id as usize];
        let (spare_seqs, spare_ids, spare_engines) = (
            std::mem::take(&mut t.seqs),
            std::mem::take(&mut t.ids),
            t.engines.take_common(),
        );
        let n = &mut self.nodes[node as usize];
        let seqs = split_buffer(&mut n.seqs, k, spare_seqs);
        let ids = split_buffer(&mut n.ids, k, spare_ids);
        let mut holders = n.holders.clone();
        // Holders cut at or before `k` hold nothing of the tail; those cut past it hold
        // the head whole and the tail up to their cut.
        let cuts = match &mut n.cuts {
            None => None,
            Some(cuts) => {
                let mut gone = Vec::new();
                let tail = cuts.split_off(k, &mut gone);
                if cuts.is_empty() {
                    n.cuts = None;
                }
                // A node split where it had cuts may leave a head without them, which
                // then agrees with its parent, or a tail without them, which agrees
                // with its only child: looked at again at the event's end.
                self.scratch.remerge.push(n.ids[0]);
                if let Some(&last) = ids.last() {
                    self.scratch.remerge.push(last);
                }
                for slot in gone {
                    holders.remove(slot);
                }
                (!tail.is_empty()).then(|| Box::new(tail))
            }
        };
        let engines = n.engines.split_off(k, spare_engines);
        let children = std::mem::take(&mut n.children);
        let first = n.first.wrapping_add(k as u32);
        let head_seq = seqs[0];
        n.children.insert(head_seq, tail_id);
        for child in children.nodes() {
            self.nodes[child as usize].parent = tail_id;
        }
        for &block in &ids {
            self.blocks[block as usize].node = tail_id;
        }
        let (entered, listed) = (
            self.nodes[node as usize].entered,
            self.nodes[node as usize].listed,
        );
        let t = &mut self.nodes[tail_id as usize];
        t.seqs = seqs;
        t.ids = ids;
        t.holders = holders;
        t.cuts = cuts;
        t.engines = engines;
        t.children = children;
        t.first = first;
        t.entered = entered;
        t.listed = listed;
        tail_id
    }

    /// Splits as needed so that one node holds exactly positions `a..b` of `node`;
    /// returns it.
    pub(super) fn isolate(&mut self, node: NodeId, a: usize, b: usize) -> NodeId {
        if b < self.nodes[node as usize].len() {
            self.split(node, b);
        }
        if a > 0 {
            self.split(node, a)
        } else {
            node
        }
    }

    /// Splits `node` back into plain nodes, one per distinct cut (each holder then holds
    /// whole nodes), before a change that only plain nodes take (a removal, a clear, a
    /// join from the middle). The node keeps its id and its first blocks; the pieces
    /// after it, which its holders cut earliest leave first, are pushed on `pieces`.
    pub(super) fn materialize(&mut self, node: NodeId, pieces: &mut Vec<NodeId>) {
        let Some(cuts) = self.nodes[node as usize].cuts.take() else {
            return;
        };
        let n = &self.nodes[node as usize];
        // From the end: the last piece is held by the full holders, each piece before
        // it by those and the holders cut at its end.
        let mut holding = cuts.full(&n.holders);
        // The cuts kept the node from merging with its parent and its only child: its
        // first and last blocks name the pieces that may agree with them now, however
        // the rest of the event splits the pieces further.
        self.scratch.remerge.push(n.ids[0]);
        if let Some(&last) = n.ids.last() {
            self.scratch.remerge.push(last);
        }
        let list = cuts.by_cut();
        let mut j = list.len();
        while j > 0 {
            let k = list[j - 1].0 as usize;
            let tail = self.split(node, k);
            self.nodes[tail as usize].holders = holding.clone();
            self.scratch.remerge.push(self.nodes[tail as usize].ids[0]);
            pieces.push(tail);
            while j > 0 && list[j - 1].0 as usize == k {
                holding.insert(list[j - 1].1);
                j -= 1;
            }
        }
    }

    /// Tries to merge every node that lost cuts this event ([`materialize`](Self::materialize),
    /// or a [`split`](Self::split) where a node had them) with its parent and its only
    /// child: it may agree with a neighbour that the cuts kept apart (a parent with the
    /// same holders as the node's first blocks, a child with those of its last), and
    /// nothing else of the event need touch it. Run at the event's end, when no cursor
    /// or list names a node.
    pub(super) fn remerge(&mut self) {
        if self.scratch.remerge.is_empty() {
            return;
        }
        let mut list = std::mem::take(&mut self.scratch.remerge);
        for &block in &list {
            // A block of a piece pruned since may be free, its entry naming a freed or
            // reused node: merging only ever joins live nodes that agree, right for any.
            let Some(at) = self.blocks.get(block as usize) else {
                continue;
            };
            let node = at.node;
            if self.nodes.get(node as usize).is_some_and(|n| n.live) {
                self.merge_around(node);
            }
        }
        list.clear();
        Scratch::keep(&mut self.scratch.remerge, list);
    }

    /// Merges `child` into `parent` if it is the parent's only child and both have the
    /// same holders: a run that holder sets no longer divide becomes one node again.
    ///
    /// The check is inlined and the merge is not: a store that joins a stretch tries
    /// two merges per node it passes, and nearly all of them fail at the check.
    #[inline(always)]
    fn try_merge(&mut self, parent: NodeId, child: NodeId) -> bool {
        if parent == NO_NODE {
            return false;
        }
        let p = &self.nodes[parent as usize];
        let c = &self.nodes[child as usize];
        // The holder counts first: known without touching the children or the words,
        // and a store joining a chain of nodes leaves each with one holder more than
        // its child, so nearly every check ends here.
        if p.holders.len() != c.holders.len()
            || p.children.only() != Some(child)
            || !p.holders.same_members(&c.holders)
            // A holder cut in either would hold blocks on both sides of a gap.
            || p.cuts.is_some()
            || c.cuts.is_some()
        {
            return false;
        }
        self.merge(parent, child);
        true
    }

    /// Merges `child`, the only child of `parent`, with the same holders, into it.
    #[inline(never)]
    fn merge(&mut self, parent: NodeId, child: NodeId) {
        let mut c = std::mem::take(&mut self.nodes[child as usize]);
        let p = &mut self.nodes[parent as usize];
        let base = p.first.wrapping_add(p.len() as u32);
        p.entered &= c.entered;
        p.listed |= c.listed;
        p.engines.append(&c.engines);
        for (j, &block) in c.ids.iter().enumerate() {
            self.blocks[block as usize] = BlockAt {
                node: parent,
                offset: base.wrapping_add(j as u32),
            };
        }
        p.seqs.extend_from_slice(&c.seqs);
        p.ids.extend_from_slice(&c.ids);
        for grandchild in c.children.nodes() {
            self.nodes[grandchild as usize].parent = parent;
        }
        self.nodes[parent as usize].children = std::mem::take(&mut c.children);
        self.buffers.keep_node(c);
        self.free_nodes.push(child);
    }

    /// After `node`'s holders changed: merges it with its parent and its only child
    /// where they now agree. Returns the node its blocks are in now.
    #[inline(always)]
    pub(super) fn merge_around(&mut self, node: NodeId) -> NodeId {
        let parent = self.nodes[node as usize].parent;
        let node = if self.try_merge(parent, node) {
            parent
        } else {
            node
        };
        self.merge_child(node)
    }

    /// Merges `node`'s only child into it if they now agree, and the only child of
    /// what it merged in turn while they agree; returns `node`. (An event that takes a
    /// holder from a chain of nodes may make each agree with the next; a node merged
    /// into its parent is gone before its own turn to merge with its child.)
    #[inline(always)]
    pub(super) fn merge_child(&mut self, node: NodeId) -> NodeId {
        while let Some(child) = self.nodes[node as usize].children.only() {
            if !self.try_merge(node, child) {
                break;
            }
        }
        node
    }

    /// Frees nodes no worker holds and no longer lead anywhere, then their parents in
    /// turn, merging what is left where it agrees.
    /// `candidates` is the event's prune list, kept for the next event afterwards.
    pub(super) fn prune_all(&mut self, names: &mut impl Names, candidates: Vec<BlockId>) {
        for &block in &candidates {
            // A candidate's node may be gone already (pruned with an earlier one); a
            // stale entry then names a free or reused node, and pruning only ever
            // removes a node that is empty and leads nowhere, which is right for any.
            if let Some(at) = self.blocks.get(block as usize) {
                if (at.node as usize) < self.nodes.len() {
                    self.prune(names, at.node);
                }
            }
        }
        Scratch::keep(&mut self.scratch.prune, candidates);
        self.remerge();
    }

    pub(super) fn prune(&mut self, names: &mut impl Names, mut node: NodeId) {
        loop {
            let n = &self.nodes[node as usize];
            if !n.live || !n.holders.is_empty() || !n.children.is_empty() {
                return;
            }
            self.take_out_row(names, node, |_| true);
            let n = &self.nodes[node as usize];
            let parent = n.parent;
            let first_seq = n.seqs[0];
            let n = std::mem::take(&mut self.nodes[node as usize]);
            self.free_blocks.extend_from_slice(&n.ids);
            self.buffers.keep_node(n);
            self.free_nodes.push(node);
            if parent == NO_NODE {
                self.roots.remove(&first_seq);
                return;
            }
            self.nodes[parent as usize].children.remove(first_seq);
            if let Some(child) = self.nodes[parent as usize].children.only() {
                // The parent and its last child may agree now; merged, the node may
                // itself be prunable (both were empty), so look at it again.
                if !self.try_merge(parent, child) {
                    return;
                }
                // What the child led to may agree with them too.
                self.merge_child(parent);
            }
            node = parent;
        }
    }
}
