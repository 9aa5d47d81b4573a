//! A `stored` event, in two steps. [`KvIndex::resolve`] checks it and computes each
//! block's sequence hash, changing nothing: an event is atomic without an undo log, and
//! the second copy of a shared index replays the result without hashing again.
//! [`KvIndex::store_resolved`] records it: it walks the tree from the parent, joins the
//! worker to the stretches of blocks it now holds as well (one probe of its names per
//! block; a stretch from a node's start that ends inside it is a cut, not a split), and
//! appends the blocks no one held to a node of the worker's own (or to the end of a
//! childless node it holds whole, the other holders cut there), as runs.

use super::hashing::{chained_content, chained_hash, chained_hash_with_extra, identity_seed};
use super::holders::Slot;
use super::names::{self, Book, Names};
use super::tree::{BlockAt, Place};
use super::{
    ApplyStats, BlockId, HashedBlock, KvEvent, KvEventError, KvIndex, NodeId, Scratch, StoredBlock,
    WorkerKey, NO_NODE,
};

/// The parts of a stored event [`KvIndex::resolve`] hashes, besides its parent.
#[derive(Clone, Copy)]
pub(crate) struct Stored<'a> {
    /// [`identity_seed`] of the event's LoRA name and cache salt.
    pub identity: Option<u64>,
    pub contents: Contents<'a>,
}

/// A stored event's blocks: their tokens ([`KvEvent::Stored`]), or their content
/// hashes, computed where the event was decoded ([`KvEvent::Hashed`]).
#[derive(Clone, Copy)]
pub(crate) enum Contents<'a> {
    Tokens {
        blocks: &'a [StoredBlock],
        /// (block index, hash of its other inputs), ascending by index.
        extra_keys: &'a [(u32, u64)],
    },
    Hashed(&'a [HashedBlock]),
}

impl<'a> Stored<'a> {
    /// The parts of `event` to resolve and its parent, if it stores blocks.
    pub(crate) fn of(event: &'a KvEvent) -> Option<(Option<u64>, Self)> {
        match event {
            KvEvent::Stored {
                parent_block_hash,
                blocks,
                lora_name,
                cache_salt,
                extra_keys,
            } => Some((
                *parent_block_hash,
                Stored {
                    identity: identity_seed(lora_name.as_deref(), cache_salt.as_deref()),
                    contents: Contents::Tokens { blocks, extra_keys },
                },
            )),
            KvEvent::Hashed {
                parent_block_hash,
                identity,
                blocks,
            } => Some((
                *parent_block_hash,
                Stored {
                    identity: *identity,
                    contents: Contents::Hashed(blocks),
                },
            )),
            KvEvent::Removed { .. } | KvEvent::Cleared => None,
        }
    }

    fn len(&self) -> usize {
        match self.contents {
            Contents::Tokens { blocks, .. } => blocks.len(),
            Contents::Hashed(blocks) => blocks.len(),
        }
    }
}

impl KvIndex {
    /// Checks a `stored` event and hashes its blocks, changing nothing: each block's
    /// (engine hash, sequence hash) goes into `resolved`, for
    /// [`store_resolved`](Self::store_resolved) to record (on both copies of a shared
    /// index, without hashing twice).
    pub(super) fn resolve(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        stored: Stored<'_>,
        resolved: &mut Vec<(u64, u64)>,
    ) -> Result<ApplyStats, KvEventError> {
        resolved.clear();
        // Nothing changes here (`resolved` is scratch), so the event stays atomic
        // without an undo log: every check is done before `store_resolved` changes
        // anything. (A hashed event's block size was checked where it was decoded,
        // against the same setting.) A wrong block size is reported before an unknown
        // parent, as the event's own fault.
        let mut parent = match self.first_parent(book, worker, parent_block_hash, stored.identity) {
            Ok(parent) => parent,
            Err(unknown) => return Err(self.first_wrong_size(worker, &stored).unwrap_or(unknown)),
        };
        resolved.reserve(stored.len());
        match stored.contents {
            Contents::Tokens { blocks, extra_keys } => {
                let mut extras = extra_keys.iter().peekable();
                for (index, block) in blocks.iter().enumerate() {
                    // The size is checked in the same pass as the hashing.
                    if block.token_ids.len() != self.block_size {
                        return Err(self.wrong_size(worker, index, block));
                    }
                    let seq = match extras.next_if(|(at, _)| *at as usize == index) {
                        Some(&(_, extra)) => {
                            chained_hash_with_extra(parent, &block.token_ids, extra)
                        }
                        None => chained_hash(parent, &block.token_ids),
                    };
                    resolved.push((block.block_hash, seq));
                    parent = Some(seq);
                }
            }
            Contents::Hashed(blocks) => {
                for block in blocks {
                    let seq = chained_content(parent, block.content);
                    resolved.push((block.block_hash, seq));
                    parent = Some(seq);
                }
            }
        }
        Ok(ApplyStats {
            stored: stored.len(),
            ..ApplyStats::default()
        })
    }

    /// The first block of a stored event whose token count is not the block size, as
    /// the error that refuses the event.
    #[cold]
    fn first_wrong_size(&self, worker: WorkerKey, stored: &Stored<'_>) -> Option<KvEventError> {
        let Contents::Tokens { blocks, .. } = stored.contents else {
            return None;
        };
        blocks
            .iter()
            .enumerate()
            .find(|(_, b)| b.token_ids.len() != self.block_size)
            .map(|(index, block)| self.wrong_size(worker, index, block))
    }

    /// The refusal of a stored event whose block `index` has the wrong token count.
    #[cold]
    fn wrong_size(&self, worker: WorkerKey, index: usize, block: &StoredBlock) -> KvEventError {
        KvEventError::WrongBlockSize {
            worker,
            index,
            block_hash: block.block_hash,
            tokens: block.token_ids.len(),
            block_size: self.block_size,
        }
    }

    /// What a stored event's first block chains onto: the sequence hash of the block
    /// its engine calls `parent_block_hash`, or for a sequence's first block the
    /// request identity (a continuation inherits it through its parent's hash).
    fn first_parent(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        identity: Option<u64>,
    ) -> Result<Option<u64>, KvEventError> {
        match parent_block_hash {
            None => Ok(identity),
            Some(parent_hash) => match self
                .slot_of(worker)
                .and_then(|slot| self.copy_in(book, slot, parent_hash))
            {
                Some(copy) => Ok(Some(self.seq_of(copy.block))),
                None => Err(KvEventError::UnknownParent {
                    worker,
                    parent_block_hash: parent_hash,
                }),
            },
        }
    }

    /// [`resolve`](Self::resolve) of a [`KvEvent::Hashed`] that hands over its blocks:
    /// they become its (engine hash, sequence hash) pairs in their own buffer, with no
    /// copy and no allocation.
    pub(super) fn resolve_hashed(
        &self,
        book: &Book,
        worker: WorkerKey,
        parent_block_hash: Option<u64>,
        identity: Option<u64>,
        blocks: Vec<HashedBlock>,
    ) -> Result<(ApplyStats, Vec<(u64, u64)>), KvEventError> {
        let mut parent = self.first_parent(book, worker, parent_block_hash, identity)?;
        let stats = ApplyStats {
            stored: blocks.len(),
            ..ApplyStats::default()
        };
        let resolved = blocks
            .into_iter()
            .map(|block| {
                let seq = chained_content(parent, block.content);
                parent = Some(seq);
                (block.block_hash, seq)
            })
            .collect();
        Ok((stats, resolved))
    }

    /// Records `worker`'s copies (engine hash, sequence hash) chained onto the block its
    /// engine calls `parent_engine`; already [`resolve`](Self::resolve)d (the parent
    /// exists).
    pub(super) fn store_resolved(
        &mut self,
        names: &mut impl Names,
        worker: WorkerKey,
        parent_engine: Option<u64>,
        items: &[(u64, u64)],
    ) {
        if items.is_empty() {
            return;
        }
        let slot = self.add_worker_with(names, worker);
        names.reserve(slot, items.len());
        let mut cursor: Option<Place> = match parent_engine {
            Some(p) => match self.copy_of(names, slot, p) {
                Some(copy) => Some(self.place(copy.block)),
                // Resolved before: only a replay of a refused event lands here.
                None => return,
            },
            None => None,
        };
        // Nodes that may have lost their last holder; pruned once the store is done, so
        // no block the cursor names is freed under it.
        let mut prune = std::mem::take(&mut self.scratch.prune);
        prune.clear();
        // The node the last step joined `slot` to, if the last step was a join: a
        // join that goes on into its child need not try to merge the two.
        let mut joined = NO_NODE;
        let mut i = 0;
        while i < items.len() {
            let (engine, seq) = items[i];
            let Some(here) = self.child_of(cursor, seq) else {
                joined = NO_NODE;
                // A new block: one probe of the engine-hash map claims the name for it
                // (the common case, a sequence no one holds yet).
                let block = self.reserve_block();
                if self.backed_copy(names, slot, engine).is_none()
                    && names.claim(slot, engine, block).is_none()
                {
                    self.entries += 1;
                    let after = cursor.map(|c| c.block);
                    self.attach_new(names, slot, after, block, (engine, seq), items.len() - i);
                    cursor = Some(self.place(block));
                    i += 1;
                    // The rest of the event follows a block no one else holds, which
                    // has no children yet: each is new too, and goes at the end of
                    // the same node (this worker's alone). No lookups but the name.
                    let (added, last) = self.append_run(names, slot, block, &items[i..]);
                    if added > 0 {
                        cursor = Some(self.place(last));
                        i += added;
                    }
                } else {
                    // The engine reused a hash for other tokens: its old block is
                    // gone; then this item again.
                    self.free_blocks.push(block);
                    self.remove_copy(names, slot, engine, &mut prune);
                    cursor = cursor.map(|c| self.place(c.block));
                }
                continue;
            };
            let Place { block, node, pos } = here;
            let after = joined;
            joined = NO_NODE;
            let held = self.nodes[node as usize].holds(slot, pos);
            // One probe of the worker's names: a new name is recorded at once (as
            // an extra copy of a block it holds, or the first of a stretch it joins).
            let mut backed = false;
            let existing = if held {
                self.held_name(names, slot, engine, block)
            } else {
                let (existing, through_shared) =
                    self.join_name(names, slot, node, pos, engine, block);
                backed = through_shared;
                existing
            };
            match existing {
                None if held => {
                    self.entries += 1;
                    i += 1;
                    let (more, last) = self.extra_run(names, slot, here, &items[i..]);
                    cursor = Some(last);
                    i += more;
                }
                None => {
                    let (taken, last) =
                        self.hold_stretch(names, slot, here, &items[i..], after, backed);
                    cursor = Some(last);
                    joined = last.node;
                    i += taken;
                }
                // Stored again: nothing changes (engines re-announce on prefix hits).
                Some(copy) if copy.block == block => {
                    cursor = Some(here);
                    i += 1;
                }
                // Reused for other tokens: the old block loses it, then this item again
                // (removing a copy restructures nodes, never the blocks' chain, so the
                // cursor's block stays but its place may move).
                Some(_) => {
                    self.remove_copy(names, slot, engine, &mut prune);
                    cursor = cursor.map(|c| self.place(c.block));
                }
            }
        }
        self.prune_all(names, prune);
    }

    /// After an extra copy of the block at `at` (which `slot` holds): records `items`
    /// as extra copies of the node's next blocks, as far as they follow them and are
    /// new names. The same tokens stored again under another salt name a whole run of
    /// a node this way, and one pass over the node spares each the walk's child lookup
    /// and holder check. Returns how many it recorded and the place of the last block
    /// with a copy.
    fn extra_run(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        at: Place,
        items: &[(u64, u64)],
    ) -> (usize, Place) {
        let Place { node, pos, .. } = at;
        let n = &self.nodes[node as usize];
        let held = n.held_until(slot);
        let mut k = 0;
        while k < items.len()
            && pos + 1 + k < held
            && n.seqs[pos + 1 + k] == items[k].1
            // A name held already (stored again, or reused) ends the run: the walk
            // deals with that item.
            && self
                .held_name(names, slot, items[k].0, n.ids[pos + 1 + k])
                .is_none()
        {
            k += 1;
        }
        let last = Place {
            block: n.ids[pos + k],
            node,
            pos: pos + k,
        };
        self.entries += k;
        (k, last)
    }

    /// Appends `items` to the node that ends with `last` (`slot` alone holds that end,
    /// no children) as new blocks, up to the first whose engine hash is already in use;
    /// returns how many it appended and the last block.
    pub(super) fn append_run(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        mut last: BlockId,
        items: &[(u64, u64)],
    ) -> (usize, BlockId) {
        let node = self.blocks[last as usize].node;
        self.before_push(names, node);
        // The run's names are claimed first, an id reserved for each, up to the first
        // name in use; then the node's arrays grow once by the whole run, as copies of
        // slices rather than a push per array per block.
        let mut ids = std::mem::take(&mut self.scratch.ids);
        ids.clear();
        self.blocks.reserve(items.len());
        for &(engine, _) in items {
            let block = self.reserve_block();
            if self.backed_copy(names, slot, engine).is_some()
                || names.claim(slot, engine, block).is_some()
            {
                self.free_blocks.push(block);
                break;
            }
            ids.push(block);
        }
        let added = ids.len();
        if let Some(&end) = ids.last() {
            self.entries += added;
            let n = &mut self.nodes[node as usize];
            let base = n.first.wrapping_add(n.len() as u32);
            // An entered shared row stays entered: the new names (the row's from
            // here, as `extend_sole` appends them) are entered with their blocks.
            let entered = n.entered;
            n.entered = false;
            // Before the ids grow: a sole holder's own names move to the shared row
            // by the node's blocks so far.
            let sole = n.holders.len() == 1;
            n.engines.extend_sole(
                &mut self.own,
                slot,
                &n.ids,
                items[..added].iter().map(|&(engine, _)| engine),
                sole,
            );
            n.seqs.extend(items[..added].iter().map(|&(_, seq)| seq));
            n.ids.extend_from_slice(&ids);
            for (j, &block) in ids.iter().enumerate() {
                self.blocks[block as usize] = BlockAt {
                    node,
                    offset: base.wrapping_add(j as u32),
                };
            }
            let appended = items[..added].iter().map(|&(engine, _)| engine);
            self.enter_appended(names, node, entered, appended.zip(ids.iter().copied()));
            last = end;
        }
        Scratch::keep(&mut self.scratch.ids, ids);
        (added, last)
    }

    /// The block after `cursor` (or a first block, for `None`) named `seq`, if any.
    #[inline(always)]
    fn child_of(&self, cursor: Option<Place>, seq: u64) -> Option<Place> {
        let node = match cursor {
            None => *self.roots.get(&seq)?,
            Some(Place { block, node, pos }) => {
                debug_assert_eq!(self.at(block), (node, pos), "a stale cursor");
                let n = &self.nodes[node as usize];
                if pos + 1 < n.len() {
                    return (n.seqs[pos + 1] == seq).then(|| Place {
                        block: n.ids[pos + 1],
                        node,
                        pos: pos + 1,
                    });
                }
                n.children.get(seq)?
            }
        };
        Some(Place {
            block: self.nodes[node as usize].ids[0],
            node,
            pos: 0,
        })
    }

    /// Adds `slot` as a holder of the blocks of `at`'s node from `at` on that `items`
    /// continue (as far as the node goes and no item's engine hash is already in use);
    /// the first item's name is already claimed for the block at `at`
    /// (`first_backed`: held through the shared names). Returns how many items it
    /// took (at least one) and where the last of them is now.
    ///
    /// `joined`: the node this event's previous step joined `slot` to, or `NO_NODE`.
    /// When that is the parent of the stretch (the store goes on from the parent's
    /// last block into this node), the two are not tried: they had different holders
    /// before (or they would be one node) and both gained `slot`. Nearly every join
    /// of a store that follows a chain of nodes is such a one. (A node with cuts that
    /// a split here leaves without them may agree with that parent after all: the
    /// split lists it for the event's end, [`KvIndex::remerge`].)
    fn hold_stretch(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        at: Place,
        items: &[(u64, u64)],
        joined: NodeId,
        first_backed: bool,
    ) -> (usize, Place) {
        let Place { block, node, pos } = at;
        // A join from a node's first block by a worker that holds none of it takes
        // the node as it is (whole, or its first blocks by a cut); any other join of a
        // node with cuts (from the middle, or by a holder cut before `at`) splits it
        // back into plain nodes first.
        let (node, pos) = {
            let n = &self.nodes[node as usize];
            if n.cuts.is_some() && (pos > 0 || n.holders.contains(slot)) {
                let mut pieces = std::mem::take(&mut self.scratch.pieces);
                pieces.clear();
                self.materialize(node, &mut pieces);
                Scratch::keep(&mut self.scratch.pieces, pieces);
                self.at(block)
            } else {
                (node, pos)
            }
        };
        // The first item's name is claimed; claim each next one's as the stretch grows:
        // one probe per block. A name already in use (reused for other tokens, or
        // repeated within this event) ends the stretch; the caller deals with that item
        // next.
        let mut taken = 1;
        let mut backed = usize::from(first_backed);
        let last = {
            let n = &self.nodes[node as usize];
            // Names the shared row has, entered, are held through the shared names:
            // only the worker's own names need asking whether it has them already.
            let entered = n.entered && !n.holders.is_empty();
            let common = n.engines.common();
            while taken < items.len()
                && pos + taken < n.len()
                && n.seqs[pos + taken] == items[taken].1
            {
                let (engine, block) = (items[taken].0, n.ids[pos + taken]);
                let through_shared = entered && common[pos + taken] == engine;
                let existing = if through_shared {
                    names.get(slot, engine)
                } else {
                    // A name this stretch already took through the shared names (an
                    // event naming two blocks alike) is not in the tree or the count
                    // yet: look for it in the stretch.
                    let entered_for = match backed {
                        0 => names.backed(slot, engine),
                        _ => names.shared(engine),
                    };
                    match entered_for {
                        Some(b)
                            if self.names_block(slot, b, engine)
                                || self.in_stretch(b, node, pos, &items[..taken], engine) =>
                        {
                            Some(names::Copy {
                                block: b,
                                extra: names::NAMED,
                            })
                        }
                        _ => names.claim(slot, engine, block),
                    }
                };
                if existing.is_some() {
                    break;
                }
                backed += usize::from(through_shared);
                taken += 1;
            }
            n.ids[pos + taken - 1]
        };
        self.entries += taken;
        if backed > 0 {
            names.back(slot, backed);
        }
        {
            // A store that ends inside a node it joined from the first block, beside
            // other holders: a cut, no split (nested prefixes of one prompt stay one
            // node). One that goes on past the stretch (its next block is not the
            // node's next) splits the node there anyway: the split now, as before.
            let n = &self.nodes[node as usize];
            if pos == 0 && taken < n.len() && taken == items.len() && !n.holders.is_empty() {
                self.nodes[node as usize].add_cut(
                    &mut self.own,
                    slot,
                    &items[..taken],
                    items.len(),
                );
                return (
                    taken,
                    Place {
                        block: last,
                        node,
                        pos: taken - 1,
                    },
                );
            }
        }
        if self.nodes[node as usize].holders.is_empty() {
            // `slot`'s names become the shared row: the old one's go.
            self.take_out_row(names, node, |_| true);
        }
        let m = self.isolate(node, pos, pos + taken);
        self.nodes[m as usize].add_holder(&mut self.own, slot, &items[..taken], items.len());
        // `m` holds just the stretch; merged into its parent, it follows the parent's
        // blocks (merging its child in appends after it and moves nothing).
        let parent = self.nodes[m as usize].parent;
        let now = if pos == 0 && parent == joined && parent != NO_NODE {
            self.merge_child(m)
        } else {
            let before = match parent {
                NO_NODE => 0,
                parent => self.nodes[parent as usize].len(),
            };
            let now = self.merge_around(m);
            if now != m {
                return (
                    taken,
                    Place {
                        block: last,
                        node: now,
                        pos: before + taken - 1,
                    },
                );
            }
            now
        };
        let pos = taken - 1;
        (
            taken,
            Place {
                block: last,
                node: now,
                pos,
            },
        )
    }

    /// Places the new block `block` (reserved, its name claimed; `(engine, seq)` its
    /// hashes) after `cursor`, held by `slot` alone: appended to the cursor's node when
    /// `slot` holds all of it and it ends there (a worker extending its own sequence,
    /// or a prefix others hold shorter: they are cut where it ended), else the start of
    /// a new node.
    /// `rest`: blocks of the event from this one on, for which a new node reserves room
    /// (the rest of an event's new blocks all land in it).
    fn attach_new(
        &mut self,
        names: &mut impl Names,
        slot: Slot,
        cursor: Option<BlockId>,
        block: BlockId,
        (engine, seq): (u64, u64),
        rest: usize,
    ) {
        let parent = match cursor {
            None => NO_NODE,
            Some(at) => {
                let (node, pos) = self.at(at);
                if pos + 1 < self.nodes[node as usize].len() {
                    self.split(node, pos + 1);
                }
                self.at(at).0
            }
        };
        if parent != NO_NODE {
            let p = &mut self.nodes[parent as usize];
            // Extended in place when `slot` holds all of it and it leads nowhere: the
            // other holders now hold its blocks up to here (cuts). An entered shared
            // row stays entered (the new name is entered with the block), so the next
            // holder naming it so joins through the shared names. Not when the row is
            // listed without being entered and others hold it: each extension would
            // leave the row to be entered again whole by the next such holder.
            if p.children.is_empty()
                && p.holds_all(slot)
                && (p.holders.len() == 1 || !p.listed || p.entered)
            {
                p.cut_others(slot);
                self.before_push(names, parent);
                let p = &mut self.nodes[parent as usize];
                let entered = p.entered;
                let offset = p.first.wrapping_add(p.len() as u32);
                p.push_block(&mut self.own, slot, seq, block, engine);
                self.blocks[block as usize] = BlockAt {
                    node: parent,
                    offset,
                };
                self.enter_appended(names, parent, entered, [(engine, block)]);
                return;
            }
        }
        let node = self.new_node(parent);
        {
            let n = &mut self.nodes[node as usize];
            n.seqs.reserve_exact(rest);
            n.ids.reserve_exact(rest);
            n.engines.reserve(rest);
            n.holders.insert(slot);
            n.push_block(&mut self.own, slot, seq, block, engine);
        }
        self.blocks[block as usize] = BlockAt { node, offset: 0 };
        if parent == NO_NODE {
            self.roots.insert(seq, node);
        } else {
            self.nodes[parent as usize].children.insert(seq, node);
        }
    }
}
